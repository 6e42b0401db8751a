#!/bin/bash
# Runs the benchmark suites and writes one JSON result file per suite and
# machine, DIR/<suite>-<hostname>.json (contract: benchmarks/README.md,
# "Result files"). Needs root: the suites make their own loop-mounted XFS and
# ext4 filesystems.
#
#   bazel run //benchmarks:run -- [suite...] [--out DIR] [--quick] [--reps N]
#       [-- extra Google Benchmark flags for every suite]
#
# Suites (all by default, in this order): hint create_prealloc prealloc_filter
# subcluster engine chain snapshot nbd. Defaults take about an hour on 2 cores
# (engine, on XFS and ext4: about 31 minutes, estimated); --quick is a smoke
# run of about 6 minutes (small sizes, 2 repetitions). DIR defaults to
# ./bench-results (relative to where `bazel run` was called). Each file is
# checked against the contract (check_results.py) after its suite ran.
# engine runs its repetitions in random interleaved order (Google
# Benchmark's --benchmark_enable_random_interleaving): a slow minute of the
# storage is spread over every configuration instead of one. The loop
# filesystems' backing files go under TMPDIR (default /tmp); TMPDIR=/dev/shm
# keeps them in RAM (engine: about 3 GiB), which takes the VM's disk out of
# the measurement (README, "The engine suite on XFS and ext4").
set -euo pipefail

ALL_SUITES=(hint create_prealloc prealloc_filter subcluster engine chain snapshot nbd)
binary_of() {
  case "$1" in
    hint) echo hint_bench ;;
    create_prealloc) echo create_prealloc_bench ;;
    prealloc_filter) echo prealloc_filter_bench ;;
    subcluster) echo subcluster_bench ;;
    engine) echo engine_bench ;;
    chain) echo chain_bench ;;
    snapshot) echo snapshot_bench ;;
    nbd) echo nbd_bench ;;
    *) return 1 ;;
  esac
}

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# Runfiles: `bazel run` sets RUNFILES_DIR (or we sit next to <script>.runfiles).
if [[ -z "${RUNFILES_DIR:-}" ]]; then
  if [[ -d "$0.runfiles" ]]; then RUNFILES_DIR="$0.runfiles"; else RUNFILES_DIR="$PWD/.."; fi
fi
HERE="$RUNFILES_DIR/imgtool/benchmarks"
[[ -d "$HERE" ]] || HERE="$(cd "$(dirname "$0")" && pwd)"
IMGTOOL_BIN="$RUNFILES_DIR/imgtool/imgtool/imgtool"

suites=()
out=bench-results
quick=0
reps=""
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out) [[ $# -ge 2 ]] || usage; out="$2"; shift 2 ;;
    --out=*) out="${1#--out=}"; shift ;;
    --quick) quick=1; shift ;;
    --reps) [[ $# -ge 2 ]] || usage; reps="$2"; shift 2 ;;
    --reps=*) reps="${1#--reps=}"; shift ;;
    -h|--help) usage ;;
    --) shift; extra=("$@"); break ;;
    -*) echo "run: unknown flag '$1'" >&2; usage ;;
    *)
      binary_of "$1" >/dev/null || {
        echo "run: unknown suite '$1' (suites: ${ALL_SUITES[*]})" >&2; exit 2; }
      suites+=("$1"); shift ;;
  esac
done
[[ ${#suites[@]} -gt 0 ]] || suites=("${ALL_SUITES[@]}")
if [[ -z "$reps" ]]; then
  if [[ $quick == 1 ]]; then reps=2; else reps=5; fi
fi
[[ "$reps" =~ ^[1-9][0-9]*$ ]] || { echo "run: --reps must be a positive number" >&2; exit 2; }

if [[ $(id -u) != 0 ]]; then
  echo "run: the suites mount loop filesystems and need root" >&2
  exit 1
fi

# Paths the user gave are relative to where `bazel run` was called.
if [[ "$out" != /* && -n "${BUILD_WORKING_DIRECTORY:-}" ]]; then
  out="$BUILD_WORKING_DIRECTORY/$out"
fi
# A bad --out fails now, with one line, not after the suites ran.
if ! err=$(mkdir -p -- "$out" 2>&1); then
  echo "run: --out $out: cannot create the directory: ${err##*: }" >&2
  exit 1
fi
if ! probe=$(mktemp -p "$out" .run-probe.XXXXXX 2>/dev/null); then
  echo "run: --out $out: cannot write files there" >&2
  exit 1
fi
rm -f -- "$probe"

commit=unknown
src="${BUILD_WORKSPACE_DIRECTORY:-}"
if [[ -n "$src" ]] && commit=$(git -C "$src" rev-parse --short HEAD 2>/dev/null); then
  if [[ -n "$(git -C "$src" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    commit="$commit-dirty"
  fi
else
  commit=unknown
fi
host=$(hostname)

# The suites make their loop filesystems (backing files and mount points)
# under $TEST_TMPDIR (base/testing/loop_mount.h): a directory of this run's
# own, so that a suite killed by Ctrl-C or `kill` (its destructors do not
# run) leaves no mounted filesystem or backing file behind.
work=$(mktemp -d "${TMPDIR:-/tmp}/imgtool-bench.XXXXXX")
cleanup() {
  local mnt
  while read -r _ mnt _; do
    case "$mnt" in
      "$work"/*) umount "$mnt" 2>/dev/null || umount -l "$mnt" ;;
    esac
  done </proc/self/mounts
  rm -rf --one-file-system -- "$work"
}
trap cleanup EXIT
trap 'echo "run: interrupted" >&2; exit 130' INT
trap 'echo "run: terminated" >&2; exit 143' TERM
export TEST_TMPDIR="$work"

failed=()
# A failed suite's file (empty, partial or off the contract) becomes
# <file>.failed, so that report/dashboard on DIR read only good files.
set_aside() {
  if [[ -e "$1" ]]; then
    mv -f -- "$1" "$1.failed"
    echo "run: kept what it wrote as $1.failed" >&2
  fi
}
start_all=$SECONDS
for suite in "${suites[@]}"; do
  bin="$HERE/$(binary_of "$suite")"
  file="$out/$suite-$host.json"
  if [[ ! -x "$bin" ]]; then
    echo "run: suite $suite: $bin is missing" >&2
    failed+=("$suite")
    continue
  fi
  args=(--imgtool_commit="$commit"
        --benchmark_repetitions="$reps"
        --benchmark_report_aggregates_only=false
        --benchmark_out="$file" --benchmark_out_format=json)
  [[ $quick == 1 ]] && args+=(--quick)
  [[ $suite == engine ]] && args+=(--benchmark_enable_random_interleaving=true)
  [[ $suite == create_prealloc || $suite == chain || $suite == snapshot || $suite == nbd ]] && args+=(--imgtool="$IMGTOOL_BIN")
  echo "=== suite $suite -> $file"
  start=$SECONDS
  if ! "$bin" "${args[@]}" "${extra[@]}"; then
    echo "run: suite $suite failed" >&2
    set_aside "$file"
    failed+=("$suite")
    continue
  fi
  if ! /usr/bin/python3 "$HERE/check_results.py" "$file"; then
    echo "run: $file does not follow the result file contract" >&2
    set_aside "$file"
    failed+=("$suite")
    continue
  fi
  echo "=== suite $suite done in $((SECONDS - start)) s"
done
echo "=== all done in $((SECONDS - start_all)) s; results in $out"
if [[ ${#failed[@]} -gt 0 ]]; then
  echo "run: failed suites: ${failed[*]}" >&2
  exit 1
fi
