#!/usr/bin/env bash
# Backing-chain and sizing commands side by side (issue 16's benchmarks):
# imgtool vs qemu-img 7.2 in the same run, on the same XFS loop mount, on
# the same files: wall time (median), peak RSS and the bytes each run read
# from the disk.
#
#   sudo benchmarks/chain_side_by_side.sh
#
# The files (made once with qemu-img and qemu-io, 64 KiB clusters):
#   base.qcow2   SIZE_GIB GiB virtual, DATA_GIB GiB of data in 64 KiB
#                pieces spread evenly over it (a piece every
#                SIZE_GIB/DATA_GIB clusters; each piece its own byte)
#   base2.qcow2  base.qcow2 with 1 % of its data pieces rewritten (0x55)
#   top.qcow2    overlay of base.qcow2 (-F qcow2) holding 64 KiB pieces in
#                1 % of all clusters, none where base.qcow2 has data
#   sparse.raw   a raw file of 100,000 data extents (4 KiB of data every
#                40 KiB) for measure
# The cases, each run on fresh reflink copies (cp --reflink; instant on
# XFS) so every run starts from the same files:
#   rebase       rebase -f qcow2 -b base2.qcow2 -F qcow2 top.qcow2 (safe)
#   flatten      rebase -f qcow2 -b "" top.qcow2
#   commit       commit -f qcow2 top.qcow2 (into base.qcow2)
#   measure      measure -O qcow2 -f raw sparse.raw
#   dd           dd -f qcow2 -O raw bs=1M count=DATA_GIB*1024 if=base.qcow2 of=out.raw
# Before every run: sbs_settle (sync, fstrim) and the page cache dropped,
# so "read" is what the run read from the loop device (its sectors-read
# counter in /sys/block/loopN/stat, times 512): the bytes it had to fetch.
# One unmeasured run per case, then REPS runs per tool and case,
# alternating which tool goes first; medians. Every run also goes to
# $OUT/chain_side_by_side-<host>.json (sbs_results.py: the suites' result
# contract, for report and dashboard; a failed command as an error entry).
# A command imgtool does not have yet is shown as "-".
#
# Targets (issue 16): imgtool's time at most 0.8 of qemu-img's in every
# case, peak RSS no higher, and safe rebase reading nothing of the ranges
# both chains leave unallocated or zero (compare "read" with the "needed"
# row: the data of base.qcow2 plus base2.qcow2 outside top.qcow2's pieces).
#
# Environment:
#   IMGTOOL   path of an imgtool binary (skips the build)
#   BAZEL     bazel command used to build it (default "bazel")
#   REPS      runs per tool and case (default 3)
#   SIZE_GIB  virtual size (default 4)
#   DATA_GIB  data in base.qcow2 (default 1)
#   CASES     which cases (default "rebase flatten commit measure dd")
#   WORKDIR   where the XFS backing file goes (default /var/tmp)
#   OUT       directory of the result file (default bench-results, relative
#             to the directory the script was started from)
#   QUICK     1: a smoke run: SIZE_GIB=2, REPS=4, marked `quick` in the
#             result file
set -euo pipefail
SBS_CALLER_PWD=$PWD
cd "$(dirname "$0")/.."

if [[ ${QUICK:-0} == 1 ]]; then REPS=${REPS:-4} SIZE_GIB=${SIZE_GIB:-2}; fi
REPS=${REPS:-3}
SIZE_GIB=${SIZE_GIB:-4}
DATA_GIB=${DATA_GIB:-1}
CASES=${CASES:-"rebase flatten commit measure dd"}
WORKDIR=${WORKDIR:-/var/tmp}

source benchmarks/side_by_side_lib.sh
sbs_setup chain_side_by_side.sh imgtool-chain qemu-img qemu-io mkfs.xfs losetup python3

# Room for every file, the copies of a run, and the dd output.
fs_bytes=$(((SIZE_GIB + DATA_GIB * 6 + 2) << 30))
truncate -s "$fs_bytes" "$work/xfs.img"
mkfs.xfs -q -m reflink=1 "$work/xfs.img"
loopdev=$(losetup -f --show "$work/xfs.img")
mount "$loopdev" "$mnt"
stat_file="/sys/block/${loopdev#/dev/}/stat"
cd "$mnt"

echo "imgtool:  $IMGTOOL" >&2
echo "qemu-img: $(qemu-img --version | head -1)" >&2
echo "kernel:   $(uname -r), $(nproc) CPUs, XFS on $loopdev (file in $WORKDIR)" >&2

# --- the files -----------------------------------------------------------------
cluster=65536
clusters=$((SIZE_GIB << 14))   # 64 KiB clusters in SIZE_GIB GiB
stride=$((SIZE_GIB / DATA_GIB)) # a data piece every `stride` clusters
((stride >= 2)) || sbs_fail "SIZE_GIB must be at least twice DATA_GIB"
echo "== making base.qcow2 (${DATA_GIB} GiB of data in ${SIZE_GIB} GiB), base2, top, sparse.raw" >&2
python3 - "$clusters" "$stride" <<'EOF'
import os, sys
clusters, stride = int(sys.argv[1]), int(sys.argv[2])
fd = os.open("base.raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, clusters * 65536)
for i in range(0, clusters, stride):
    os.pwrite(fd, bytes([i // stride % 255 + 1]) * 65536, i * 65536)
os.close(fd)
fd = os.open("sparse.raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.ftruncate(fd, 100000 * 40960)
for i in range(100000):
    os.pwrite(fd, b"\x01" * 4096, i * 40960)
os.close(fd)
EOF
qemu-img convert -f raw -O qcow2 -o cluster_size=64k base.raw base.qcow2
rm base.raw
data_pieces=$((clusters / stride))
# 1 % of the data pieces rewritten in base2, 1 % of all clusters in top.
cp --reflink=always base.qcow2 base2.qcow2
args=()
for ((k = 0; k < data_pieces; k += 100)); do
  args+=(-c "write -q -P 0x55 $((k * stride * cluster)) 64k")
done
qemu-io -f qcow2 "${args[@]}" base2.qcow2
qemu-img create -q -f qcow2 -o cluster_size=64k -b base.qcow2 -F qcow2 top.qcow2
args=()
top_pieces=0
for ((c = 1; c < clusters; c += 100)); do
  ((c % stride == 0)) && continue
  args+=(-c "write -q -P 0x77 $((c * cluster)) 64k")
  top_pieces=$((top_pieces + 1))
done
qemu-io -f qcow2 "${args[@]}" top.qcow2
# What a safe rebase must read at least: both backing files' data outside
# the top's pieces (top's pieces never meet base's, see above).
needed=$((2 * data_pieces * cluster))
sync

# --- one run -----------------------------------------------------------------
# run_case TOOL CASE [REP]: prints "SECONDS PEAK_RSS_KIB BYTES_READ", or "-"
# if the tool failed (a command imgtool lacks); with REP (a measured run)
# also records it.
run_case() {
  local tool=$1 case=$2 rep=${3:-}
  rm -rf run && mkdir run
  local cmd=()
  case $case in
    rebase)
      cp --reflink=always top.qcow2 base.qcow2 base2.qcow2 run/
      cmd=(rebase -f qcow2 -b base2.qcow2 -F qcow2 top.qcow2) ;;
    flatten)
      cp --reflink=always top.qcow2 base.qcow2 run/
      cmd=(rebase -f qcow2 -b "" top.qcow2) ;;
    commit)
      cp --reflink=always top.qcow2 base.qcow2 run/
      cmd=(commit -f qcow2 top.qcow2) ;;
    measure)
      cmd=(measure -O qcow2 -f raw ../sparse.raw) ;;
    dd)
      cp --reflink=always base.qcow2 run/
      cmd=(dd -f qcow2 -O raw bs=1M "count=$((DATA_GIB * 1024))" if=base.qcow2 of=out.raw) ;;
  esac
  sbs_settle
  echo 3 >/proc/sys/vm/drop_caches
  local before after
  before=$(awk '{print $3}' "$stat_file")
  local name=qemu-img
  [[ $tool == qemu-img ]] || name=imgtool
  local label="fs:xfs/case:$case/tool:$name"
  if ! (cd run && /usr/bin/time -f '%e %M' -o ../time.txt "$tool" "${cmd[@]}" >../out.txt 2>"../err-$name.txt"); then
    [[ -z $rep ]] || sbs_record "$label" error "$(grep -v '^Command exited' "err-$name.txt" | head -1)"
    echo "-"
    return
  fi
  after=$(awk '{print $3}' "$stat_file")
  local secs rss
  read -r secs rss < time.txt
  [[ -z $rep ]] || sbs_record "$label" "$rep" "seconds=$secs" \
    "max_rss_bytes=$((rss * 1024))" "bytes_read=$(((after - before) * 512))"
  echo "$secs $rss $(((after - before) * 512))"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
results=()
for case in $CASES; do
  a=() b=()
  # One unmeasured run first: the first run of a case after the files were
  # made took 2-3 times as long as the later ones, whichever tool it was
  # (XFS sharing the freshly written extents on the first reflink copy).
  run_case qemu-img "$case" >/dev/null
  for ((i = 0; i < REPS; i++)); do
    if ((i % 2 == 0)); then
      a+=("$(run_case "$IMGTOOL" "$case" "$i")"); b+=("$(run_case qemu-img "$case" "$i")")
    else
      b+=("$(run_case qemu-img "$case" "$i")"); a+=("$(run_case "$IMGTOOL" "$case" "$i")")
    fi
  done
  if [[ ${a[0]} == - ]]; then
    echo "  $case: imgtool failed: $(grep -v '^Command exited' err-imgtool.txt | head -1)" >&2
  fi
  echo "  $case: imgtool ${a[*]} / qemu-img ${b[*]}" >&2
  results+=("$case;$(IFS=,; echo "${a[*]}");$(IFS=,; echo "${b[*]}")")
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
sbs_write_results chain_side_by_side xfs "load_avg_start=${load_before%% *}" "load_avg_end=$load_after" \
  "size_gib=$SIZE_GIB" "data_gib=$DATA_GIB" "needed_bytes=$needed" \
  "qemu_img=$(qemu-img --version | head -1)"

# --- table -------------------------------------------------------------------
python3 - "$REPS" "$SIZE_GIB" "$DATA_GIB" "$needed" "$top_pieces" "$load_before" "$load_after" "${results[@]}" <<'EOF'
import statistics, sys
reps, size, data, needed, top_pieces, lb, la = sys.argv[1:8]
def med(runs):
    runs = [r.split() for r in runs.split(",") if r != "-"]
    if not runs:
        return None
    return tuple(statistics.median(float(r[k]) for r in runs) for k in range(3))
print(f"{size} GiB chain, {data} GiB of data in 64 KiB pieces in base.qcow2, "
      f"top.qcow2 with {int(top_pieces):,} 64 KiB pieces; XFS loop mount, page cache "
      f"dropped before every run; median of {reps}; load average {lb} before, {la} after")
print()
print("| case | imgtool s | qemu-img s | time ratio | imgtool MiB RSS | qemu-img MiB RSS | imgtool MiB read | qemu-img MiB read |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for r in sys.argv[8:]:
    case, ours, theirs = r.split(";")
    a, b = med(ours), med(theirs)
    fmt = lambda v, k, d: "-" if v is None else (f"{v[k]:.2f}" if k == 0 else f"{v[k] / d:,.0f}")
    ratio = "-" if a is None or b is None or b[0] == 0 else f"{a[0] / b[0]:.2f}"
    print(f"| {case} | {fmt(a,0,1)} | {fmt(b,0,1)} | {ratio} | {fmt(a,1,1024)} | {fmt(b,1,1024)} "
          f"| {fmt(a,2,1<<20)} | {fmt(b,2,1<<20)} |")
print()
print(f"Safe rebase needs to read at least {int(needed) / (1 << 20):,.0f} MiB "
      "(both backing files' data outside the top's pieces).")
EOF
