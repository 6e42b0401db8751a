#!/usr/bin/env bash
# Per-request cost (issue 20 part 1): imgtool bench against qemu-img bench
# and fio, side by side on one raw file on a fresh XFS loop mount, with
# nothing to merge and nothing to allocate:
#
#   step12k   4 KiB O_DIRECT requests, each 12 KiB after the one before
#             (`bench -t none -s 4k -S 12k`, fio `rw=write:8k` / `read:8k`:
#             a gap of 8 KiB after each 4 KiB), so no two are adjacent
#   random    4 KiB O_DIRECT requests at random 4 KiB-aligned offsets
#             (imgtool `--random`, an imgtool extension; fio
#             `rw=randwrite` / `randread` with norandommap; qemu-img bench
#             has no random mode: no qemu-img entries)
#
# writes and reads, at queue depths $DEPTHS, each tool with each of its Linux
# engines:
#   imgtool   -i native (Linux AIO), -i io_uring, -i threads
#   qemu-img  -i native, -i io_uring, -i threads (qemu-img's -n is -i native:
#             with both -n and -i io_uring it uses native, file-posix.c
#             raw_open_common)
#   fio       --ioengine=libaio, --ioengine=io_uring (the ceiling of a cell
#             is the best fio median: results.py, reqcost_side_by_side)
# on a 1 GiB raw file written in full first (qemu-img create -o
# preallocation=full), so every write overwrites written blocks.
#
# Per cell (case and depth): one unmeasured round of every configuration
# (the warm-up) sizes the request count so that the fastest configuration's
# run lasts MIN_SECONDS (with 25 % to spare); then REPS rounds, each running
# every configuration once, the order rotated by one each round (tools
# interleaved). A run's time is the tool's own: bench's elapsed time
# (imgtool --output=json, qemu-img's "Run completed in" in ms), fio's job
# runtime (ms). Every run goes to $OUT/reqcost_side_by_side-<host>.json
# (sbs_results.py); the load average before and after is in its context.
# Prints a Markdown table of medians with the ratios to qemu-img's same
# engine and to the ceiling.
#
#   sudo benchmarks/reqcost_side_by_side.sh
#
# Environment:
#   IMGTOOL      path of an imgtool binary (skips the build)
#   BAZEL        bazel command used to build it (default "bazel")
#   REPS         rounds per cell (default 5)
#   DEPTHS       queue depths (default "1 16 64")
#   CASES        of write_step12k read_step12k randwrite randread (default all)
#   ENGINES      of imgtool:native imgtool:io_uring imgtool:threads
#                qemu-img:native qemu-img:io_uring qemu-img:threads
#                fio:libaio fio:io_uring (default all)
#   MIN_SECONDS  shortest run of the fastest configuration (default 1)
#   FILE_MIB     size of the raw file (default 1024)
#   OUT          directory of the result file (default bench-results,
#                relative to the directory the script was started from)
#   QUICK        1: a smoke run: REPS=4, DEPTHS="1 64", MIN_SECONDS=0.1,
#                FILE_MIB=256, marked `quick` in the file
#   WORKDIR      where the XFS backing file goes (default /var/tmp)
set -euo pipefail
SBS_CALLER_PWD=$PWD
cd "$(dirname "$0")/.."

if [[ ${QUICK:-0} == 1 ]]; then
  REPS=${REPS:-4} DEPTHS=${DEPTHS:-"1 64"} MIN_SECONDS=${MIN_SECONDS:-0.1}
  FILE_MIB=${FILE_MIB:-256}
fi
REPS=${REPS:-5}
DEPTHS=${DEPTHS:-"1 16 64"}
CASES=${CASES:-"write_step12k read_step12k randwrite randread"}
ENGINES=${ENGINES:-"imgtool:native imgtool:io_uring imgtool:threads qemu-img:native qemu-img:io_uring qemu-img:threads fio:libaio fio:io_uring"}
MIN_SECONDS=${MIN_SECONDS:-1}
FILE_MIB=${FILE_MIB:-1024}
WORKDIR=${WORKDIR:-/var/tmp}

source benchmarks/side_by_side_lib.sh
SBS_MIN_SECONDS=$MIN_SECONDS
sbs_setup reqcost_side_by_side.sh imgtool-reqcost qemu-img fio mkfs.xfs python3

truncate -s $(((FILE_MIB + 512) * 1048576)) "$work/xfs.img"
mkfs.xfs -q "$work/xfs.img"
mount -o loop "$work/xfs.img" "$mnt"
cd "$mnt"
qemu-img create -q -f raw -o preallocation=full bench.raw "${FILE_MIB}M"
sync

echo "imgtool:  $IMGTOOL" >&2
echo "qemu-img: $(qemu-img --version | head -1)" >&2
echo "fio:      $(fio --version)" >&2
echo "kernel:   $(uname -r), $(nproc) CPUs, XFS on a loop device in $WORKDIR" >&2

# run_seconds TOOL ENGINE CASE DEPTH COUNT: one run; prints its seconds.
run_seconds() {
  local tool=$1 engine=$2 c=$3 depth=$4 count=$5 w=() pat=()
  case $c in
    write_*|randwrite) w=(-w) ;;
  esac
  case $c in
    *_step12k) pat=(-S 12k) ;;
    rand*) pat=(--random) ;;
  esac
  case $tool in
    imgtool)
      sbs_bench_seconds "$IMGTOOL" -f raw -t none -i "$engine" -s 4k -d "$depth" \
        -c "$count" "${w[@]}" "${pat[@]}" bench.raw ;;
    qemu-img)
      sbs_bench_seconds qemu-img -f raw -t none -i "$engine" -s 4k -d "$depth" \
        -c "$count" "${w[@]}" "${pat[@]}" bench.raw ;;
    fio)
      local rw
      case $c in
        write_step12k) rw=write:8k ;;
        read_step12k) rw=read:8k ;;
        *) rw=$c ;;
      esac
      fio --name=reqcost --filename=bench.raw --ioengine="$engine" --direct=1 \
        --bs=4k --rw="$rw" --iodepth="$depth" --size="${FILE_MIB}M" \
        --io_size=$((count * 4096)) --norandommap --randrepeat=1 \
        --output-format=json |
        python3 -c 'import json,sys
j = json.load(sys.stdin)["jobs"][0]
d = j["write"] if j["write"]["total_ios"] else j["read"]
print("%.6f" % (d["runtime"] / 1000.0))' ;;
  esac
}

# case_has TOOL CASE: whether the tool can run the case.
case_has() {
  [[ $1 != qemu-img || $2 != rand* ]]
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "== $REPS rounds per cell, every configuration once per round, order rotated" >&2
for c in $CASES; do
  for depth in $DEPTHS; do
    configs=()
    for e in $ENGINES; do
      if case_has "${e%%:*}" "$c"; then configs+=("$e"); fi
    done
    # Warm-up: sizes the count from the fastest configuration.
    count=$((depth == 1 ? 5000 : 20000))
    times=()
    for e in "${configs[@]}"; do
      times+=("$(run_seconds "${e%%:*}" "${e#*:}" "$c" "$depth" "$count")")
    done
    count=$(sbs_size_count "$count" 100000000 "${times[@]}")
    echo "  $c depth $depth: $count requests per run" >&2
    n=${#configs[@]}
    for ((rep = 0; rep < REPS; rep++)); do
      line=""
      for ((k = 0; k < n; k++)); do
        e=${configs[$(((k + rep) % n))]}
        tool=${e%%:*} engine=${e#*:}
        s=$(run_seconds "$tool" "$engine" "$c" "$depth" "$count")
        iops=$(python3 -c 'import sys; print("%.1f" % (int(sys.argv[1]) / float(sys.argv[2])))' "$count" "$s")
        sbs_record "fs:xfs/case:$c/depth:$depth/engine:$engine/tool:$tool" "$rep" \
          "seconds=$s" "IOPS=$iops" "requests=$count"
        line+=" $tool/$engine ${iops%.*}"
      done
      echo "    rep $rep:$line" >&2
    done
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
sbs_write_results reqcost_side_by_side xfs \
  "load_avg_start=${load_before%% *}" "load_avg_end=$load_after" \
  "min_seconds=$MIN_SECONDS" "file_mib=$FILE_MIB" \
  "qemu_img=$(qemu-img --version | head -1)" "fio=$(fio --version)"
echo "load average (1/5/15 min): $load_before before, $load_after after"
echo
PYTHONPATH="$SBS_REPO" python3 - "$work/records" <<'PY'
import statistics, sys
from benchmarks import results  # PYTHONPATH: the repository root
runs, cells = {}, []
for line in open(sys.argv[1]):
    name, rep, *counters = line.split()
    kv = dict(c.split("=", 1) for c in counters)
    l = dict(part.split(":", 1) for part in name.split("/"))
    cell = (l["case"], l["depth"])
    if cell not in cells:
        cells.append(cell)
    runs.setdefault(cell, {}).setdefault((l["tool"], l["engine"]), []).append(
        float(kv["IOPS"]))
print("| case | depth | configuration | IOPS (median) | / qemu-img same engine (U test) | / ceiling |")
print("|---|---:|---|---:|---:|---:|")
for cell in cells:
    by = runs[cell]
    fio = {k: statistics.median(v) for k, v in by.items() if k[0] == "fio"}
    ceiling = max(fio.values()) if fio else None
    for (tool, engine), v in by.items():
        med = statistics.median(v)
        q = by.get(("qemu-img", engine))
        vs_q = "-"
        if tool == "imgtool" and q:
            vs_q = "%.2f (%s)" % (med / statistics.median(q),
                                  results.utest_values(q, v).text())
        vs_c = "%.2f" % (med / ceiling) if ceiling else "-"
        print(f"| {cell[0]} | {cell[1]} | {tool} {engine} | {med:,.0f} | {vs_q} | {vs_c} |")
PY
