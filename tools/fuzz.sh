#!/usr/bin/env bash
# Builds one libFuzzer target with --config=fuzz (clang, libFuzzer, ASan,
# UBSan) and runs it, or all of them as CI does (README "Fuzzing").
#
#   bash tools/fuzz.sh //qcow2:image_fuzzer [SECONDS]   # fuzz (default 60 s)
#   bash tools/fuzz.sh //qcow2:image_fuzzer 0           # replay the corpus only
#   bash tools/fuzz.sh --all [SECONDS]                  # every target: replay,
#                                                       # then fuzz (default 30 s)
#
# The seed corpus (testdata/fuzz/, read only) is replayed first; inputs the
# run finds are kept in $FUZZ_WORK/<name>/corpus (default
# /tmp/imgtool-fuzz), crashes, leaks, timeouts and out-of-memory inputs in
# $FUZZ_WORK/<name>/ (crash-*, leak-*, timeout-*, oom-*), and the exit code
# is libFuzzer's (non-zero on a finding). Extra libFuzzer flags:
# FUZZ_FLAGS="-jobs=2 -workers=2". The build uses its own Bazel output base
# ($FUZZ_OUTPUT_BASE, default ~/.cache/imgtool-fuzz/<checkout hash>), since
# switching the compiler reconfigures the toolchain; its server is shut down
# at exit. Needs the packages of tools/setup.sh (clang, libclang-rt-14-dev).
set -euo pipefail
cd "$(dirname "$0")/.."

# name -> seed directories under testdata/fuzz (the first is the target's own).
declare -A seeds=(
  [format_fuzzer]="format qcow2"
  [image_fuzzer]="image qcow2"
  [options_fuzzer]="options"
  [server_fuzzer]="nbd"
)
targets=(//qcow2/format:format_fuzzer //qcow2:image_fuzzer //base:options_fuzzer
  //nbd_server:server_fuzzer)
# Every target: memory bounded by the input (image_fuzzer's copies grow to
# 2 * input + 8 MiB at most), no input runs longer than 25 s.
common_flags=(-rss_limit_mb=1024 -timeout=25 -print_final_stats=1)

if [[ $# -lt 1 ]]; then
  sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
if [[ $1 == --all ]]; then
  run=("${targets[@]}")
  seconds=${2:-30}
else
  run=("$1")
  seconds=${2:-60}
fi
for t in "${run[@]}"; do
  name=${t##*:}
  [[ -n ${seeds[$name]:-} ]] || { echo "fuzz.sh: unknown target $t (known: ${targets[*]})" >&2; exit 2; }
done
command -v clang >/dev/null || { echo "fuzz.sh: clang missing; run tools/setup.sh" >&2; exit 1; }

output_base=${FUZZ_OUTPUT_BASE:-${XDG_CACHE_HOME:-$HOME/.cache}/imgtool-fuzz/$(pwd -P | md5sum | cut -c1-12)}
bz() { bazel --output_base="$output_base" "$@"; }
trap 'bz shutdown 2>/dev/null || true' EXIT
# --symlink_prefix=/: leave the checkout's bazel-* links to the normal build.
bz build --config=fuzz --symlink_prefix=/ "${run[@]}"

bin=$(bz info --config=fuzz bazel-bin 2>/dev/null)
work=${FUZZ_WORK:-/tmp/imgtool-fuzz}
status=0
for t in "${run[@]}"; do
  name=${t##*:}
  pkg=${t#//}
  binary=$bin/${pkg%%:*}/$name
  dirs=()
  # A target's own directory exists once a seed or finding is kept there
  # (git keeps no empty directories).
  for d in ${seeds[$name]}; do
    if [[ -d testdata/fuzz/$d ]]; then dirs+=("testdata/fuzz/$d"); fi
  done
  mkdir -p "$work/$name/corpus"
  echo "== $t: replaying ${dirs[*]}"
  if ! "$binary" "${common_flags[@]}" -runs=0 "${dirs[@]}"; then
    status=1
    continue
  fi
  if ((seconds > 0)); then
    echo "== $t: fuzzing for $seconds s (new inputs in $work/$name/corpus)"
    # shellcheck disable=SC2086  # FUZZ_FLAGS is a list of flags
    "$binary" "${common_flags[@]}" -max_total_time="$seconds" \
      -artifact_prefix="$work/$name/" ${FUZZ_FLAGS:-} \
      "$work/$name/corpus" "${dirs[@]}" || status=1
  fi
done
exit $status
