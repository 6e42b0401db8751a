#!/usr/bin/env bash
# Start-up cost (issue 20 part 2), imgtool against qemu-img side by side:
# the commands callers run before nearly every operation on an image, each
# timed from process start to exit on the same small qcow2 image (1 GiB
# virtual, 1 MiB + 64 KiB of data, made by qemu-img):
#
#   info IMG   info --output=json IMG   map --output=json IMG   check IMG
#   create -f qcow2 NEW 1G (NEW removed before each run, untimed)
#
# Each repetition times RUNS runs of one tool and then RUNS of the other
# (`hyperfine -N`: no shell between, 5 warm-up runs), the order swapped
# every repetition; a run's time is the block's mean. The work directory
# is on $WORKDIR's filesystem (the page cache holds the image: this is the
# CPU cost of starting, opening and printing, not I/O).
# Per tool and command also: the peak RSS (`/usr/bin/time`'s maximum
# resident set, the largest of 5 runs) and the smallest address-space limit
# (`prlimit --as`, in MiB, halving from 1,024 down to 8) the command still
# succeeds under: Nova and vdsm run `qemu-img info` under a 1-2 GiB cap.
# Prints a Markdown table (mean ± relative standard deviation over REPS,
# imgtool / qemu-img with the Mann-Whitney U test); every repetition goes
# to $OUT/startup_side_by_side-<host>.json (sbs_results.py).
#
#   sudo benchmarks/startup_side_by_side.sh
#
# Environment:
#   IMGTOOL  path of an imgtool binary (skips the build)
#   BAZEL    bazel command used to build it (default "bazel")
#   REPS     repetitions per tool and command (default 5)
#   RUNS     runs per repetition (default 200)
#   OUT      directory of the result file (default bench-results, relative
#            to the directory the script was started from)
#   QUICK    1: a smoke run: REPS=4, RUNS=20, marked `quick` in the file
#   WORKDIR  where the work directory goes (default /var/tmp)
set -euo pipefail
SBS_CALLER_PWD=$PWD
cd "$(dirname "$0")/.."

if [[ ${QUICK:-0} == 1 ]]; then REPS=${REPS:-4} RUNS=${RUNS:-20}; fi
REPS=${REPS:-5}
RUNS=${RUNS:-200}

source benchmarks/side_by_side_lib.sh
sbs_setup startup_side_by_side.sh startup hyperfine qemu-img qemu-io prlimit findmnt

cd "$work"
qemu-img create -q -f qcow2 img.qcow2 1G
qemu-io -c 'write -P 1 0 1M' -c 'write -P 2 512M 64k' img.qcow2 >/dev/null
cases=(info info_json map check create)
declare -A args=(
  [info]="info img.qcow2"
  [info_json]="info --output=json img.qcow2"
  [map]="map --output=json img.qcow2"
  [check]="check img.qcow2"
  [create]="create -q -f qcow2 new.qcow2 1G"
)

# tool_name TOOL: the name in the results.
tool_name() { [[ $(basename "$1") == qemu-img ]] && echo qemu-img || echo imgtool; }

# time_block TOOL CASE: the mean seconds of RUNS runs.
time_block() {
  local tool=$1 c=$2 prep=()
  [[ $c != create ]] || prep=(--prepare "rm -f new.qcow2")
  hyperfine -N -w 5 -r "$RUNS" "${prep[@]}" --export-json block.json \
    --style none "$tool ${args[$c]}" >/dev/null 2>&1 ||
    sbs_fail "$(tool_name "$tool") ${args[$c]} failed"
  python3 -c 'import json,sys; print("%.9f" % json.load(open(sys.argv[1]))["results"][0]["mean"])' block.json
}

# peak_rss_kib TOOL CASE: the largest maximum resident set of 5 runs.
peak_rss_kib() {
  local tool=$1 c=$2 most=0 kib i
  for i in 1 2 3 4 5; do
    rm -f new.qcow2
    kib=$(/usr/bin/time -f %M $tool ${args[$c]} 2>&1 >/dev/null | tail -1)
    ((kib > most)) && most=$kib
  done
  echo "$most"
}

# min_as_mib TOOL CASE: the smallest of 1024, 512, ..., 8 MiB of address
# space the command succeeds under (0: not even 1,024).
min_as_mib() {
  local tool=$1 c=$2 mib=1024 ok=0
  while ((mib >= 8)); do
    rm -f new.qcow2
    prlimit --as=$((mib * 1048576)) $tool ${args[$c]} >/dev/null 2>&1 || break
    ok=$mib
    mib=$((mib / 2))
  done
  echo "$ok"
}

fs=$(findmnt -n -o FSTYPE --target "$work")
load_before=$(cut -d' ' -f1-3 /proc/loadavg)
declare -A rss as
for c in "${cases[@]}"; do
  for tool in "$IMGTOOL" qemu-img; do
    n=$(tool_name "$tool")
    rss[$c/$n]=$(peak_rss_kib "$tool" "$c")
    as[$c/$n]=$(min_as_mib "$tool" "$c")
  done
done
echo "== $REPS repetitions of $RUNS runs per tool and command, alternating" >&2
for ((rep = 0; rep < REPS; rep++)); do
  for c in "${cases[@]}"; do
    order=("$IMGTOOL" qemu-img)
    ((rep % 2 == 0)) || order=(qemu-img "$IMGTOOL")
    for tool in "${order[@]}"; do
      n=$(tool_name "$tool")
      s=$(time_block "$tool" "$c")
      sbs_record "fs:$fs/cmd:$c/tool:$n" "$rep" "seconds=$s" "peak_rss_kib=${rss[$c/$n]}" \
        "min_address_space_mib=${as[$c/$n]}"
      echo "  rep $rep $c $n: $(python3 -c "print('%.3f ms' % (float('$s') * 1000))")" >&2
    done
  done
done
load_after=$(cut -d' ' -f1-3 /proc/loadavg)
sbs_write_results startup_side_by_side "$fs" \
  "load_avg_start=${load_before%% *}" "load_avg_end=$load_after" "runs_per_repetition=$RUNS" \
  "qemu_img=$(qemu-img --version | head -1)"
echo "load average (1/5/15 min): $load_before before, $load_after after"
echo
PYTHONPATH="$SBS_REPO" python3 - "$work/records" <<'PY'
import statistics, sys
from benchmarks import results  # PYTHONPATH: the repository root
runs, extra, order = {}, {}, []
for line in open(sys.argv[1]):
    name, rep, *counters = line.split()
    kv = dict(c.split("=", 1) for c in counters)
    labels = dict(part.split(":", 1) for part in name.split("/"))
    case, tool = labels["cmd"], labels["tool"]
    runs.setdefault((case, tool), []).append(float(kv["seconds"]) * 1000)
    extra[(case, tool)] = (int(kv["peak_rss_kib"]), int(kv["min_address_space_mib"]))
    if case not in order:
        order.append(case)
def fmt(v):
    return results.mean_rsd(v, "{:.2f}")
print("| command | imgtool ms | qemu-img ms | imgtool / qemu-img (time) | peak RSS MiB (imgtool / qemu-img) | smallest --as MiB (imgtool / qemu-img) |")
print("|---|---:|---:|---:|---:|---:|")
for case in order:
    a, b = runs[(case, "imgtool")], runs[(case, "qemu-img")]
    test = results.utest_values(a, b).text()
    ra, rb = extra[(case, "imgtool")], extra[(case, "qemu-img")]
    print(f"| {case} | {fmt(a)} | {fmt(b)} | {statistics.mean(a) / statistics.mean(b):.2f} ({test}) "
          f"| {ra[0] / 1024:.1f} / {rb[0] / 1024:.1f} | {ra[1]} / {rb[1]} |")
PY
