#!/usr/bin/env bash
# qcow2 subclusters (extended L2): imgtool bench vs qemu-img bench on the
# workload of the public subcluster measurement (shared/reference/
# subclusters.md §9, "backing" rows), same run, same XFS loop mount.
#
#   sudo benchmarks/subcluster_side_by_side.sh
#
# A raw backing file of BASE_MIB MiB is fully written (0xaa). For each
# cluster size in CLUSTERS and extended_l2 off/on (on only from 16k, as
# QEMU requires), one overlay is made with
#   qemu-img create -f qcow2 -b base.raw -F raw -o cluster_size=C,extended_l2=X
# afresh before every single run (qemu-img create makes identical files),
# so both tools start from the identical empty overlay, with the 1 MiB
# extent size hint qemu-img sets on XFS as a user's overlay has it. (A
# `cp` of one template would drop the hint: XFS then allocates every 4 KiB
# write on its own, which slows both tools and hides what subclusters
# save.) Each run is
#   <tool> bench -f qcow2 -w -t none -d DEPTH -s 4k -S STEP -c N overlay
# i.e. 4 KiB writes whose offsets advance by STEP modulo the virtual size
# (an odd multiple of 4 KiB: no offset repeats before the whole disk has
# been visited), so they spread over the whole disk and nearly every write
# is the first one into its cluster: the worst case, where standard
# clusters copy a whole cluster from the backing file and subclusters copy
# at most one subcluster.
# Each cell first runs both tools unmeasured (sbs_calibrate: also the
# warm-up), from COUNT requests up, until the faster tool's run lasts at
# least MIN_SECONDS (1 s): a run of 256 writes took 0.04-0.1 s, too short to
# tell the tools apart. At most one write per allocation unit of the disk
# (a cluster, or with extended_l2 a subcluster of at least 4 KiB), so that
# nearly every write still allocates: standard 2M clusters reach 1 s only
# with BASE_MIB=2048 on a quiet machine (about 630 writes per second).
# Then REPS runs per tool and cell, alternating the tools (and which goes
# first),
# each after `sync` and `fstrim` (sbs_settle) and, by default, with the page
# cache dropped (COLD_BACKING); the table shows medians, the ratio imgtool /
# qemu-img and the Mann-Whitney U test of the runs (benchmarks/results.py),
# and the load average before and after the runs. Every run also goes to
# $OUT/subcluster_side_by_side-<host>.json (sbs_results.py: the suites'
# result contract, for report and dashboard).
#
# Targets: imgtool >= qemu-img in every cell; with subclusters, 64k..256k
# clusters several times the IOPS of standard clusters.
#
# Environment:
#   IMGTOOL   path of an imgtool binary (skips the build)
#   BAZEL     bazel command used to build it (default "bazel")
#   REPS      runs per tool and cell (default 5: the U test needs 4)
#   BASE_MIB  backing file = virtual disk size in MiB (default 1024)
#   COUNT     requests of the first calibration run (default 256)
#   MIN_SECONDS  shortest run (default 1)
#   OUT       directory of the result file (default bench-results, relative
#             to the directory the script was started from)
#   QUICK     1: a smoke run: CLUSTERS="64k 2M", REPS=4, BASE_MIB=256,
#             marked `quick` in the result file
#   DEPTH     requests in flight (default 64)
#   STEP      offset step in bytes (default 4182016 = 4 KiB * 1021)
#   CLUSTERS  cluster sizes (default "4k 16k 32k 64k 128k 256k 512k 1M 2M")
#   WORKDIR   where the XFS backing file goes (default /var/tmp)
#   LOOP_DIRECT_IO  1: the loop device under XFS uses direct I/O on its
#             backing file (losetup --direct-io=on), so what XFS writes and
#             reads reaches WORKDIR's disk instead of ending in the host's
#             page cache, and copy-on-write costs real I/O (default 0: a
#             plain `mount -o loop`, where a whole-cluster copy of data the
#             host has cached is nearly free)
#   CEILING   cluster sizes whose standard-cluster cells also run fio as
#             the ceiling (default none; e.g. "512k 1M 2M", where both tools
#             are bound by the copy): fio (libaio, O_DIRECT) replaying the
#             data I/O of the cell's writes (fio_seconds below), REPS runs
#             after the tools', with the same settling and cold cache;
#             "tool:fio" in the result file, a ceiling column in the table.
#             FIO_DEPTH requests in flight (default DEPTH). The metadata
#             (L2, refcounts, flushes) is not in it: for cells bound by it
#             the ceiling is far off.
#   COLD_BACKING  1: drop the page cache (`echo 3 > /proc/sys/vm/drop_caches`)
#             after settling, before every run, so the copy-on-write reads
#             from the backing file reach the disk, as in the public
#             measurement, whose 40 GB backing image was read from its SSD
#             (default 1); 0: the backing file is read from memory after the
#             warm-up run, which makes whole-cluster copies nearly free
set -euo pipefail
SBS_CALLER_PWD=$PWD
cd "$(dirname "$0")/.."

if [[ ${QUICK:-0} == 1 ]]; then
  CLUSTERS=${CLUSTERS:-"64k 2M"} REPS=${REPS:-4} BASE_MIB=${BASE_MIB:-256}
fi
REPS=${REPS:-5}
BASE_MIB=${BASE_MIB:-1024}
COUNT=${COUNT:-256}
DEPTH=${DEPTH:-64}
STEP=${STEP:-4182016}
CLUSTERS=${CLUSTERS:-"4k 16k 32k 64k 128k 256k 512k 1M 2M"}
WORKDIR=${WORKDIR:-/var/tmp}
LOOP_DIRECT_IO=${LOOP_DIRECT_IO:-0}
COLD_BACKING=${COLD_BACKING:-1}
CEILING=${CEILING:-}
FIO_DEPTH=${FIO_DEPTH:-$DEPTH}

source benchmarks/side_by_side_lib.sh
SBS_MIN_SECONDS=${MIN_SECONDS:-1}  # runs_below_min_seconds in the result file
sbs_setup subcluster_side_by_side.sh imgtool-sub qemu-img mkfs.xfs losetup python3
[[ -z $CEILING ]] || command -v fio >/dev/null || sbs_fail "fio missing (tools/setup.sh), needed by CEILING"

# The backing file and one overlay that grows up to
# the virtual size, plus room for XFS.
fs_bytes=$(((BASE_MIB * 3 + 512) << 20))
truncate -s "$fs_bytes" "$work/xfs.img"
mkfs.xfs -q "$work/xfs.img"
sbs_mount_loop "$work/xfs.img" XFS
if [[ "$COLD_BACKING" == 1 ]]; then
  storage+=", page cache dropped before every run (cold backing file)"
else
  storage+=", backing file read from the page cache (COLD_BACKING=0)"
fi
cd "$mnt"

echo "imgtool:  $IMGTOOL" >&2
echo "qemu-img: $(qemu-img --version | head -1)" >&2
echo "kernel:   $(uname -r), $(nproc) CPUs, $storage" >&2

# --- backing file: every byte written (no holes, no unwritten extents) -------
echo "== writing the ${BASE_MIB} MiB backing file" >&2
qemu-img create -q -f raw base.raw "${BASE_MIB}M"
qemu-img bench -q -f raw -w -t none -d 16 -s 1M -S 1M --pattern=170 \
  -c "$BASE_MIB" base.raw >/dev/null

to_bytes() {  # 4k / 1M -> bytes
  python3 -c 'import sys; s=sys.argv[1]; m={"k":1<<10,"K":1<<10,"M":1<<20,"G":1<<30}; print(int(s[:-1])*m[s[-1]] if s[-1] in m else int(s))' "$1"
}

# Prints the seconds of one run on a fresh overlay made with $create_opts.
bench_seconds() {  # tool, count
  local tool=$1 count=$2
  qemu-img create -q -f qcow2 -b base.raw -F raw -o "$create_opts" overlay.qcow2
  # Start without dirty pages or unfreed blocks of earlier runs, whose
  # writeback would slow down whichever tool runs next.
  sbs_settle
  # The public measurement's 40 GB backing image could not sit in memory:
  # every copy-on-write read came from the SSD. Ours is smaller, and the
  # loop device's backing file is cached by the host, so drop the caches
  # to make those reads reach the disk again.
  if [[ "$COLD_BACKING" == 1 ]]; then echo 3 > /proc/sys/vm/drop_caches; fi
  sbs_bench_seconds "$tool" -f qcow2 -w -t none -d "$DEPTH" -s 4k -S "$STEP" -c "$count" overlay.qcow2
  rm -f overlay.qcow2
}

# Records one run of $count writes that took SECS, prints its IOPS.
record_run() {  # tool name, rep, secs
  sbs_record "fs:xfs/cluster:$cbytes/extended_l2:$sub/tool:$1" "$2" \
    "seconds=$3" "IOPS=$(python3 -c 'import sys; print(int(sys.argv[1]) / float(sys.argv[2]))' "$count" "$3")" \
    "writes=$count"
  python3 -c 'import sys; print(round(int(sys.argv[1]) / float(sys.argv[2])))' "$count" "$3"
}

# One measured run: records it, prints its IOPS.
measure() {  # tool name, tool, rep
  local secs
  secs=$(bench_seconds "$2" "$count")
  record_run "$1" "$3" "$secs"
}

# Prints the seconds of one fio run (CEILING) that replays the I/O both
# tools send for $count writes into standard clusters of $cbytes: for each
# write that allocates, one read of its cluster from base.raw and one write
# of a whole cluster to the next host cluster of a new file made as the
# overlay is (qemu-img create: the 1 MiB hint); for a write into a cluster
# allocated before, the 4 KiB write alone. Offsets as bench's (-S STEP
# modulo the disk). A fio iolog (version 2) replayed with FIO_DEPTH
# requests in flight; no L2, refcount or flush I/O.
fio_seconds() {
  python3 - "$count" "$cbytes" "$STEP" "$((BASE_MIB << 20))" "$PWD" > copy.iolog <<'PY'
import sys
count, c, step, size = (int(x) for x in sys.argv[1:5])
base, copy = sys.argv[5] + "/base.raw", sys.argv[5] + "/copy.raw"
print("fio version 2 iolog")
for action in ("add", "open"):
    print(base, action)
    print(copy, action)
host, off = {}, 0
for _ in range(count):
    cluster = off // c * c
    if cluster not in host:
        host[cluster] = len(host) * c
        if c > 4096:
            print(base, "read", cluster, c)
        print(copy, "write", host[cluster], c)
    else:
        print(copy, "write", host[cluster] + off - cluster, 4096)
    off = (off + step) % size
print(base, "close")
print(copy, "close")
PY
  qemu-img create -q -f raw copy.raw "$((count * cbytes))"
  sbs_settle
  if [[ "$COLD_BACKING" == 1 ]]; then echo 3 > /proc/sys/vm/drop_caches; fi
  fio --name=cow --read_iolog=copy.iolog --ioengine=libaio --direct=1 --iodepth="$FIO_DEPTH" \
    --output-format=json | python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["job_runtime"] / 1000)'
  rm -f copy.raw copy.iolog
}

# One fio run (CEILING): records it, prints its IOPS (the cell's writes per second).
measure_fio() {  # rep
  local secs
  secs=$(fio_seconds)
  record_run fio "$1" "$secs"
}

# Does imgtool bench take qcow2 overlays? (If not, only qemu-img is measured.)
imgtool_ok=yes
create_opts=cluster_size=64k,extended_l2=on
if ! bench_seconds "$IMGTOOL" 64 >/dev/null 2>"$work/check.err"; then
  imgtool_ok=no
  echo "imgtool bench -f qcow2 failed, measuring qemu-img only: $(head -3 "$work/check.err")" >&2
fi

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
results=()
echo "== $REPS runs per tool and cell, -d $DEPTH -s 4k -S $STEP, alternating" >&2
for c in $CLUSTERS; do
  cbytes=$(to_bytes "$c")
  for sub in off on; do
    [[ $sub == on && $cbytes -lt 16384 ]] && continue
    create_opts="cluster_size=$c,extended_l2=$sub"
    # at most one write per allocation unit: a cluster, or a subcluster
    # (cluster / 32) of at least 4 KiB
    unit=$cbytes
    [[ $sub == on ]] && unit=$((cbytes / 32))
    ((unit < 4096)) && unit=4096
    most=$(((BASE_MIB << 20) / unit))
    count=$((COUNT < most ? COUNT : most))
    a=() b=()
    # Unmeasured runs first (as prealloc_side_by_side.sh), until a run lasts
    # MIN_SECONDS: the first reads of a cell's copy-on-write ranges are the
    # slowest (caches under the VM's disk), and the first measured run is
    # imgtool's.
    if [[ $imgtool_ok == no ]]; then
      bench_seconds qemu-img "$count" >/dev/null
    else
      sbs_calibrate "$most" bench_seconds
    fi
    for ((i = 0; i < REPS; i++)); do
      if [[ $imgtool_ok == no ]]; then
        b+=("$(measure qemu-img qemu-img "$i")")
      elif ((i % 2 == 0)); then
        a+=("$(measure imgtool "$IMGTOOL" "$i")"); b+=("$(measure qemu-img qemu-img "$i")")
      else
        b+=("$(measure qemu-img qemu-img "$i")"); a+=("$(measure imgtool "$IMGTOOL" "$i")")
      fi
    done
    f=()
    if [[ $sub == off && " $CEILING " == *" $c "* ]]; then
      for ((i = 0; i < REPS; i++)); do f+=("$(measure_fio "$i")"); done
    fi
    echo "  $c sub=$sub ($count writes): imgtool ${a[*]:--} / qemu-img ${b[*]}${f:+ / fio ${f[*]}}" >&2
    results+=("$c $sub $count ${a[*]:--}|${b[*]}|${f[*]:--}")
  done
done

# --- table -------------------------------------------------------------------
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
sbs_write_results subcluster_side_by_side xfs "load_avg_start=${load_before%% *}" "storage=$storage" \
  "load_avg_end=$load_after" "depth=$DEPTH" "step=$STEP" "base_mib=$BASE_MIB" \
  "min_seconds=${MIN_SECONDS:-1}" "qemu_img=$(qemu-img --version | head -1)" \
  ${CEILING:+"fio=$(fio --version)" "fio_depth=$FIO_DEPTH"}
PYTHONPATH="$SBS_REPO" python3 - "$REPS" "$BASE_MIB" "$STEP" "$DEPTH" "$load_before" "$load_after" "$storage" "${results[@]}" <<'EOF'
import statistics, sys
from benchmarks import results  # PYTHONPATH: the repository root
reps, base_mib, step, depth, load_before, load_after, storage = sys.argv[1:8]
rows, by = [], {}
for r in sys.argv[8:]:
    head, qemu, ceil = r.split("|")
    c, sub, count, *ours = head.split()
    ours = [int(x) for x in ours] if ours != ["-"] else []
    theirs = [int(x) for x in qemu.split()]
    a = statistics.median(ours) if ours else None
    b = statistics.median(theirs)
    test = results.utest_values(ours, theirs).text()
    f = statistics.median(int(x) for x in ceil.split()) if ceil != "-" else None
    rows.append((c, sub, int(count), a, b, test, f))
    by[(c, sub)] = (a, b)

print(f"4 KiB random writes into an empty qcow2 overlay on a fully written "
      f"{base_mib} MiB raw backing file (-t none -d {depth} -S {step}), "
      f"IOPS, median of {reps}; {storage}; load average (1/5/15 min) "
      f"{load_before} before, {load_after} after")
print()
print("| cluster size | subclusters | writes/run | imgtool IOPS | qemu-img IOPS | ratio | U test |"
      " fio copy ceiling | imgtool / ceiling |")
print("|---|---|---:|---:|---:|---:|---|---:|---:|")
ok = True
for c, sub, count, a, b, test, f in rows:
    ratio = f"{a / b:.2f}" if a is not None else "-"
    if a is not None and a < b:
        ok = False
    ours = f"{a:,.0f}" if a is not None else "-"
    ceil = f"{f:,.0f}" if f is not None else "-"
    to_ceil = f"{a / f:.2f}" if f and a is not None else "-"
    print(f"| {c} | {sub} | {count:,} | {ours} | {b:,.0f} | {ratio} | {test} | {ceil} | {to_ceil} |")
print()
print("Subcluster gain (IOPS with / without subclusters):")
print()
print("| cluster size | imgtool | qemu-img |")
print("|---|---:|---:|")
gains = {}
for c, sub, *_ in rows:
    if sub != "on" or (c, "off") not in by:
        continue
    (a1, b1), (a0, b0) = by[(c, "on")], by[(c, "off")]
    ga = a1 / a0 if a1 is not None and a0 else None
    gains[c] = ga
    print(f"| {c} | {f'{ga:.1f}x' if ga is not None else '-'} | {b1 / b0:.1f}x |")
print()
print(f"imgtool >= qemu-img in every cell: {'yes' if ok else 'NO'}")
mid = [gains.get(c) for c in ("64k", "128k", "256k") if c in gains]
if mid and all(g is not None for g in mid):
    print("imgtool subcluster gain at 64k..256k: "
          + ", ".join(f"{g:.1f}x" for g in mid)
          + (" (target: several times)"))
EOF
