#!/usr/bin/env bash
# The preallocate filter's public measurement (shared/reference/
# preallocate-filter.md §9, the v7 cover letter's table), imgtool bench and
# qemu-img bench side by side on the same loop mounts (XFS and ext4):
#
#   aligned:   bench -c COUNT -d 64 -f qcow2 -s 16k -t none -n -w IMG
#   unaligned: bench -c COUNT -d 64 -f qcow2 -o 1k -s 64k -t none -n -w IMG
#              (really 64 KiB at a 1 KiB offset: the published script ran
#              the aligned 16k case twice)
#
# each without the filter (-f qcow2 IMG) and with it (--image-opts
# driver=qcow2,file.driver=preallocate,file.file.driver=file,
# file.file.filename=IMG). Every run starts from a fresh empty 16 GiB qcow2
# made by `qemu-img create` (identical for both tools), as a user's image
# is: with the 1 MiB extent size hint qemu-img sets on XFS. Not a copy of
# one template: `cp` drops the hint, and a reflinked copy shares extents
# with the template, so that XFS reports a 4 KiB O_DIRECT alignment instead
# of 512 bytes and turns every 1 KiB-offset write into a read-modify-write.
# Each cell first runs both tools unmeasured (sbs_calibrate: also the
# warm-up), from COUNT requests up, until the faster tool's run lasts at
# least MIN_SECONDS (1 s; the cover letter's 10,000 requests took 0.12 s
# at 84,000 IOPS), at most 4 GiB of writes per run; without and with the
# filter, and both columns of a case then run the larger of the two counts.
# The tools alternate (and swap which goes first) run by run, each run after
# `sync` and `fstrim` (sbs_settle). IOPS = requests / the run's seconds as
# the tool measured them (sbs_bench_seconds: imgtool's --output=json,
# qemu-img's "Run completed in X seconds.").
# Prints a Markdown table: mean ± standard deviation over REPS runs, the
# filter's gain (prealloc / no-prealloc - 1) per tool, and imgtool /
# qemu-img per column with the Mann-Whitney U test of the runs; every run
# also goes to $OUT/prealloc_side_by_side-<host>.json (sbs_results.py).
#
#   sudo benchmarks/prealloc_side_by_side.sh
#
# Environment:
#   IMGTOOL  path of an imgtool binary (skips the build)
#   BAZEL    bazel command used to build it (default "bazel")
#   REPS     runs per tool and cell (default 5)
#   COUNT    requests of the first calibration run (default 10000, as the
#            cover letter)
#   MIN_SECONDS  shortest run (default 1)
#   FSES     filesystems (default "xfs ext4")
#   OUT      directory of the result file (default bench-results, relative
#            to the directory the script was started from)
#   QUICK    1: a smoke run: FSES=xfs, REPS=4, marked `quick` in the file
#   WORKDIR  where the loop devices' backing files go (default /var/tmp)
#   LOOP_DIRECT_IO  1: the loop devices use direct I/O on their backing
#            files (losetup --direct-io=on), so the file systems' writes
#            reach WORKDIR's disk as they sent them (default 0: buffered
#            loop devices; there imgtool's merged requests run at half
#            the rate of qemu-img's 16 KiB ones in the aligned cells,
#            README "Preallocate filter", sessions 31 and 33)
#   ALSO_AIO also run imgtool with `-i ALSO_AIO` in place of -n (e.g.
#            io_uring) in the same rotation: extra rows, to see the
#            engine's own effect
set -euo pipefail
SBS_CALLER_PWD=$PWD
cd "$(dirname "$0")/.."

if [[ ${QUICK:-0} == 1 ]]; then FSES=${FSES:-xfs} REPS=${REPS:-4}; fi
REPS=${REPS:-5}
COUNT=${COUNT:-10000}
FSES=${FSES:-"xfs ext4"}
WORKDIR=${WORKDIR:-/var/tmp}
ALSO_AIO=${ALSO_AIO:-}
LOOP_DIRECT_IO=${LOOP_DIRECT_IO:-0}

source benchmarks/side_by_side_lib.sh
SBS_MIN_SECONDS=${MIN_SECONDS:-1}  # runs_below_min_seconds in the result file
sbs_setup prealloc_side_by_side.sh imgtool-prealloc qemu-img mkfs.xfs mkfs.ext4 losetup python3

echo "imgtool:  $IMGTOOL" >&2
echo "qemu-img: $(qemu-img --version | head -1)" >&2
echo "kernel:   $(uname -r), $(nproc) CPUs, loop devices in $WORKDIR" >&2

# Seconds of one run of $count requests: tool ("alt": imgtool with
# -i $ALSO_AIO for -n), filter (0/1), bench flags...
run_once() {
  local tool=$1 filter=$2; shift 2
  if [[ $tool == alt ]]; then
    tool=$IMGTOOL
    local flags=() f
    for f in "$@"; do
      if [[ $f == -n ]]; then flags+=(-i "$ALSO_AIO"); else flags+=("$f"); fi
    done
    set -- "${flags[@]}"
  fi
  qemu-img create -q -f qcow2 img.qcow2 16G
  sbs_settle
  if [[ $filter == 1 ]]; then
    sbs_bench_seconds "$tool" -c "$count" "$@" --image-opts \
      "driver=qcow2,file.driver=preallocate,file.file.driver=file,file.file.filename=img.qcow2"
  else
    sbs_bench_seconds "$tool" -c "$count" -f qcow2 "$@" img.qcow2
  fi
  rm -f img.qcow2
}

calibration_run() {  # tool, count, filter, flags... (sbs_calibrate's RUN_FN)
  local tool=$1
  shift 2
  run_once "$tool" "$@"
}

# One measured run: records it, prints its IOPS.
measure_one() {  # tool, tool's name, filter, rep, bench flags...
  local tool=$1 name=$2 filter=$3 rep=$4 secs
  shift 4
  secs=$(run_once "$tool" "$filter" "$@")
  local off=off
  [[ $filter == 1 ]] && off=on
  sbs_record "fs:$fs/write:$label/filter:$off/tool:${name// /_}" "$rep" "seconds=$secs" \
    "IOPS=$(python3 -c 'import sys; print(int(sys.argv[1]) / float(sys.argv[2]))' "$count" "$secs")" \
    "writes=$count"
  python3 -c 'import sys; print(round(int(sys.argv[1]) / float(sys.argv[2])))' "$count" "$secs"
}

declare -A runs  # "<fs>|<case>|<tool>|<filter>" -> "iops iops ..."
declare -A counts  # "<fs>|<case>|<filter>" -> requests per run

measure_case() {  # fs, case name, label, request bytes, bench flags...
  local fs=$1 name=$2 label=$3 req=$4; shift 4
  local tools=("$IMGTOOL" qemu-img) names=(imgtool qemu-img)
  if [[ -n $ALSO_AIO ]]; then tools+=(alt); names+=("imgtool -i $ALSO_AIO"); fi
  local n=${#tools[@]}
  # One request count for both filter columns: the larger of the two
  # calibrations. Runs of different lengths are not comparable here: on
  # these loop devices a run of 2.9 GiB wrote slower per request than one
  # of 0.7 GiB (writeback of the loop's backing file), which made session
  # 27's ext4 aligned filter gain of imgtool look like -28 % (README,
  # "Preallocate filter", session 28).
  local filter most=0
  for filter in 0 1; do
    count=$COUNT
    sbs_calibrate $(((4 << 30) / req)) calibration_run "$filter" "$@"
    ((count > most)) && most=$count
  done
  for filter in 0 1; do
    local t k
    count=$most
    counts["$fs|$name|$filter"]=$count
    declare -A got=()
    for ((i = 0; i < REPS; i++)); do
      # Rotate (and on odd runs reverse) the order of the tools.
      for ((k = 0; k < n; k++)); do
        local j=$(((i % 2 == 0 ? k : n - 1 - k) + i / 2))
        j=$((j % n))
        got[$j]+="$(measure_one "${tools[$j]}" "${names[$j]}" "$filter" "$i" "$@") "
      done
    done
    local line="  $fs $name filter=$filter ($count requests):"
    for ((k = 0; k < n; k++)); do
      line+=" ${names[$k]} ${got[$k]% }|"
      runs["$fs|$name|${names[$k]}|$filter"]="${got[$k]% }"
    done
    echo "${line%|}" >&2
    unset got
  done
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
for fs in $FSES; do
  rm -f "$work/fs.img"
  truncate -s 8G "$work/fs.img"
  case $fs in
    xfs) mkfs.xfs -q -f "$work/fs.img" ;;
    # Inode tables and journal written now, not by ext4lazyinit in the
    # background during the runs.
    ext4) mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$work/fs.img" ;;
    *) echo "prealloc_side_by_side.sh: unknown filesystem $fs" >&2; exit 1 ;;
  esac
  sbs_mount_loop "$work/fs.img" "$fs"
  cd "$mnt"
  echo "== $storage" >&2
  echo "== $fs ($REPS runs per tool and cell, each at least ${MIN_SECONDS:-1} s, alternating)" >&2
  measure_case "$fs" "aligned seq 16k" aligned16k 16384 -d 64 -s 16k -t none -n -w
  measure_case "$fs" "unaligned seq 64k" unaligned64k 65536 -d 64 -o 1k -s 64k -t none -n -w
  cd /
  sbs_umount_loop
done

# --- table -------------------------------------------------------------------
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
sbs_write_results prealloc_side_by_side "$(echo $FSES | tr ' ' ,)" "load_avg_start=${load_before%% *}" \
  "load_avg_end=$load_after" "min_seconds=${MIN_SECONDS:-1}" "loop_direct_io=$LOOP_DIRECT_IO" \
  "qemu_img=$(qemu-img --version | head -1)"
echo "load average (1/5/15 min): $load_before before, $load_after after; requests per run:" \
  "$(for k in "${!counts[@]}"; do echo -n "$k=${counts[$k]} "; done)"
echo
{
  for key in "${!runs[@]}"; do echo "$key|${runs[$key]}"; done
} | PYTHONPATH="$SBS_REPO" python3 -c '
import statistics, sys
from benchmarks import results  # PYTHONPATH: the repository root
runs = {}
order = []
for line in sys.stdin:
    fs, case, tool, flt, vals = line.rstrip("\n").split("|")
    runs[(fs, case, tool, flt)] = [int(v) for v in vals.split()]
    if (fs, case) not in order:
        order.append((fs, case))
fses = sys.argv[1].split()
order.sort(key=lambda k: (fses.index(k[0]), k[1]))
fmt = results.mean_rsd
print("| case | tool | no-prealloc IOPS | prealloc IOPS | Δ |")
print("|---|---|---:|---:|---:|")
tools = ["imgtool", "qemu-img"] + sorted(
    {k[2] for k in runs} - {"imgtool", "qemu-img"})
for fs, case in order:
    for tool in tools:
        off = runs[(fs, case, tool, "0")]
        on = runs[(fs, case, tool, "1")]
        gain = statistics.mean(on) / statistics.mean(off) - 1
        print(f"| {fs}, {case} | {tool} | {fmt(off)} | {fmt(on)} | {gain * 100:+.0f}% |")
    for tool in tools:
        if tool == "qemu-img":
            continue
        r, tests = [], []
        for flt in ("0", "1"):
            ours, theirs = runs[(fs, case, tool, flt)], runs[(fs, case, "qemu-img", flt)]
            r.append(statistics.mean(ours) / statistics.mean(theirs))
            tests.append(results.utest_values(ours, theirs).text())
        print(f"| {fs}, {case} | {tool} / qemu-img | {r[0]:.2f} ({tests[0]}) | {r[1]:.2f} ({tests[1]}) | |")
' "$FSES"
