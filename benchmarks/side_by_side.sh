#!/usr/bin/env bash
# imgtool vs qemu-img, measured in the same run on one fresh XFS loop mount.
#
#   sudo benchmarks/side_by_side.sh
#
# Prints a table and two ratios:
#   bench: imgtool bench IOPS / qemu-img bench IOPS (same flags; targets >= 1.0)
#          write: -f raw -t none -d 64 -s 4k -w; read: the same without -w
#          (each tool's default aio: imgtool native for -t none since
#          session 28 (io_uring before), qemu-img threads);
#          then both again with -i io_uring for both tools (informational).
#          REPS repetitions per case, the two tools alternating (and swapping
#          which goes first), median of each tool's IOPS. Before them both
#          tools run unmeasured (sbs_calibrate: also the warm-up) from COUNT
#          requests up until the faster one's run lasts MIN_SECONDS (1 s).
#   map:   imgtool map time / qemu-img map time (target <= 1.0) on a raw file
#          with ~MAP_EXTENTS extents (hint 0, 4 KiB O_DIRECT writes every
#          8 KiB, written by qemu-img bench -S 8k), timed with hyperfine.
#
# Environment:
#   IMGTOOL      path of an imgtool binary (skips the build)
#   BAZEL        bazel command used to build it (default "bazel"), e.g.
#                BAZEL="bazel --output_base=/root/.cache/bazel-me"
#   REPS         bench repetitions per tool and case (default 5)
#   COUNT        requests of the first calibration run (default 200000)
#   MIN_SECONDS  shortest bench run (default 1)
#   OUT          directory of the result file side_by_side-<host>.json
#                (sbs_results.py; default bench-results, relative to the
#                directory the script was started from)
#   QUICK        1: a smoke run: REPS=4, COUNT=20000, MAP_EXTENTS=2000,
#                MAP_RUNS=4, marked `quick` in the result file
#   MAP_EXTENTS  extents of the map file (default 200000)
#   MAP_RUNS     hyperfine runs per map command (default 5)
#   WORKDIR      where the XFS backing file goes (default /var/tmp)
set -euo pipefail
SBS_CALLER_PWD=$PWD
cd "$(dirname "$0")/.."

if [[ ${QUICK:-0} == 1 ]]; then
  REPS=${REPS:-4} COUNT=${COUNT:-20000} MAP_EXTENTS=${MAP_EXTENTS:-2000} MAP_RUNS=${MAP_RUNS:-4}
fi
REPS=${REPS:-5}
COUNT=${COUNT:-200000}
MAP_EXTENTS=${MAP_EXTENTS:-200000}
MAP_RUNS=${MAP_RUNS:-5}
WORKDIR=${WORKDIR:-/var/tmp}

source benchmarks/side_by_side_lib.sh
SBS_MIN_SECONDS=${MIN_SECONDS:-1}  # runs_below_min_seconds in the result file
sbs_setup side_by_side.sh imgtool-sbs qemu-img mkfs.xfs hyperfine python3 filefrag

# Big enough for the 1 GiB bench image and the map file (8 KiB per extent).
map_bytes=$((MAP_EXTENTS * 8192))
fs_bytes=$(((map_bytes + (1 << 30)) * 2 + (1 << 30)))
truncate -s "$fs_bytes" "$work/xfs.img"
mkfs.xfs -q "$work/xfs.img"
mount -o loop "$work/xfs.img" "$mnt"
cd "$mnt"

echo "imgtool:  $IMGTOOL" >&2
echo "qemu-img: $(qemu-img --version | head -1)" >&2
echo "kernel:   $(uname -r), $(nproc) CPUs, XFS on a loop device in $WORKDIR" >&2

# --- bench -------------------------------------------------------------------
# Fully allocated image, so every run overwrites written blocks and no run
# pays for allocation that an earlier run already did.
qemu-img create -q -f raw -o preallocation=full bench.raw 1G

# Seconds of one run of $count requests (sbs_calibrate's RUN_FN).
bench_seconds() {  # tool, count, flags...
  local tool=$1
  shift 2
  sbs_bench_seconds "$tool" -f raw -c "$count" "$@" bench.raw
}

# One measured run: records it, prints its IOPS.
measure() {  # case, tool's name, tool, rep, flags...
  local name=$1 tname=$2 tool=$3 rep=$4 secs
  shift 4
  secs=$(bench_seconds "$tool" "$count" "$@")
  sbs_record "fs:xfs/case:$name/tool:$tname" "$rep" "seconds=$secs" \
    "IOPS=$(python3 -c 'import sys; print(int(sys.argv[1]) / float(sys.argv[2]))' "$count" "$secs")"
  python3 -c 'import sys; print(round(int(sys.argv[1]) / float(sys.argv[2])))' "$count" "$secs"
}

declare -A results
run_bench_case() {  # name, flags...
  local name=$1; shift
  local a=() b=()
  count=$COUNT
  sbs_calibrate 100000000 bench_seconds "$@"
  for ((i = 0; i < REPS; i++)); do
    if ((i % 2 == 0)); then
      a+=("$(measure "$name" imgtool "$IMGTOOL" "$i" "$@")"); b+=("$(measure "$name" qemu-img qemu-img "$i" "$@")")
    else
      b+=("$(measure "$name" qemu-img qemu-img "$i" "$@")"); a+=("$(measure "$name" imgtool "$IMGTOOL" "$i" "$@")")
    fi
  done
  echo "  $name ($count requests): imgtool IOPS ${a[*]}" >&2
  echo "  $name ($count requests): qemu-img IOPS ${b[*]}" >&2
  results[$name]="${a[*]}|${b[*]}"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg)
echo "== bench ($REPS reps per tool, each at least ${MIN_SECONDS:-1} s, alternating)" >&2
run_bench_case write -t none -d 64 -s 4k -w
run_bench_case read -t none -d 64 -s 4k
run_bench_case write_uring -t none -d 64 -s 4k -w -i io_uring
run_bench_case read_uring -t none -d 64 -s 4k -i io_uring

# --- map ---------------------------------------------------------------------
echo "== map: writing $MAP_EXTENTS interleaved 4 KiB blocks (hint 0)" >&2
qemu-img create -q -f raw -o extent_size_hint=0 map.raw "$map_bytes"
qemu-img bench -f raw -w -t none -d 64 -s 4k -S 8k -c "$MAP_EXTENTS" map.raw >/dev/null
# FIEMAP records (what map walks). filefrag's own "N extents found" merges
# records whose physical gap equals the logical gap, so count the -v lines.
extents=$(filefrag -v map.raw | grep -cE '^ *[0-9]+:')
echo "  map.raw: $extents extents" >&2

"$IMGTOOL" map -f raw map.raw > map.imgtool.txt
qemu-img map -f raw map.raw > map.qemu.txt
"$IMGTOOL" map -f raw --output=json map.raw > map.imgtool.json
qemu-img map -f raw --output=json map.raw > map.qemu.json
same_human=no; cmp -s map.imgtool.txt map.qemu.txt && same_human=yes
same_json=no; cmp -s map.imgtool.json map.qemu.json && same_json=yes
echo "  identical output: human $same_human, json $same_json ($(wc -l < map.qemu.txt) lines)" >&2

hyperfine --style basic --warmup 1 --runs "$MAP_RUNS" --export-json map_human.json \
  -n imgtool "'$IMGTOOL' map -f raw map.raw" \
  -n qemu-img "qemu-img map -f raw map.raw" >&2
hyperfine --style basic --warmup 1 --runs "$MAP_RUNS" --export-json map_json.json \
  -n imgtool "'$IMGTOOL' map -f raw --output=json map.raw" \
  -n qemu-img "qemu-img map -f raw --output=json map.raw" >&2

# Every hyperfine run of map into the result file.
python3 - map_human.json map_json.json >> "$work/records" <<'EOF'
import json, sys
for path, case in zip(sys.argv[1:], ("map", "map_json")):
    for r in json.load(open(path))["results"]:
        for i, t in enumerate(r["times"]):
            print("fs:xfs/case:%s/tool:%s %d seconds=%.9f" % (case, r["command"], i, t))
EOF
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
sbs_write_results side_by_side xfs "load_avg_start=${load_before%% *}" "load_avg_end=$load_after" \
  "min_seconds=${MIN_SECONDS:-1}" "map_extents=$extents" \
  "map_identical=human $same_human, json $same_json" \
  "qemu_img=$(qemu-img --version | head -1)"

# --- table -------------------------------------------------------------------
python3 - "${results[write]}" "${results[read]}" "${results[write_uring]}" \
  "${results[read_uring]}" map_human.json map_json.json \
  "$extents" "$REPS" "$same_human" "$same_json" <<'EOF'
import json, statistics, sys
(write, read, write_u, read_u, map_human, map_json, extents, reps,
 same_h, same_j) = sys.argv[1:]

def medians(pair):
    a, b = pair.split("|")
    return (statistics.median(int(x) for x in a.split()),
            statistics.median(int(x) for x in b.split()))

def map_medians(path):
    r = {x["command"]: x["median"] for x in json.load(open(path))["results"]}
    return r["imgtool"], r["qemu-img"]

rows = []
for name, pair, target in (("write", write, ">= 1.0"), ("read", read, ">= 1.0"),
                           ("write -i io_uring", write_u, "(info)"),
                           ("read -i io_uring", read_u, "(info)")):
    a, b = medians(pair)
    rows.append((f"bench {name} 4k -d 64 -t none (IOPS, median of {reps})",
                 f"{a:,.0f}", f"{b:,.0f}", a / b, target, a / b >= 1.0))
for name, path, same in (("map", map_human, same_h),
                         ("map --output=json", map_json, same_j)):
    a, b = map_medians(path)
    rows.append((f"{name}, {int(extents):,} extents (s, median)",
                 f"{a:.3f}", f"{b:.3f}", a / b, "<= 1.0", a / b <= 1.0))

print(f"| case | imgtool | qemu-img | ratio | target | met |")
print(f"|---|---:|---:|---:|---|---|")
for case, a, b, ratio, target, ok in rows:
    met = "-" if target == "(info)" else ("yes" if ok else "NO")
    print(f"| {case} | {a} | {b} | {ratio:.2f} | {target} | {met} |")
print()
print(f"bench ratio (imgtool/qemu-img IOPS): write {rows[0][3]:.2f}, read {rows[1][3]:.2f}")
print(f"  both with -i io_uring: write {rows[2][3]:.2f}, read {rows[3][3]:.2f}")
print(f"map ratio (imgtool/qemu-img time): human {rows[4][3]:.2f}, json {rows[5][3]:.2f}"
      f" (outputs identical: human {same_h}, json {same_j})")
EOF
