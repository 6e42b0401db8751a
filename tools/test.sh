#!/usr/bin/env bash
# Runs the whole test suite: installs what it needs, then `bazel test //...`,
# the unit tests again under ASan + UBSan, then the fuzz targets.
# Real-filesystem tests (XFS/ext4 loop mounts) need root; as another user
# they skip with a message.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bazel test //... "$@"

# Sanitizers (README "Sanitizers"): every cc_test (//:unit_tests, not the
# sh_test oracle tests) built with --config=asan and run again. A cc_test
# left out of //:unit_tests fails here, so none escapes the sanitizers.
# IMGTOOL_SKIP_ASAN=1 leaves the asan run out (not the check).
missing=$(bazel query --noshow_progress \
  'kind(cc_test, //...) except tests(//:unit_tests)')
if [[ -n $missing ]]; then
  echo "tools/test.sh: cc_test not in //:unit_tests (root BUILD.bazel):" >&2
  echo "$missing" >&2
  exit 1
fi
if [[ -z ${IMGTOOL_SKIP_ASAN:-} ]]; then
  bazel test --config=asan //:unit_tests "$@"
fi

# Fuzzing (README "Fuzzing"): every libFuzzer target built with
# --config=fuzz in its own output base, its seed corpus replayed, then 30 s
# of fuzzing each. IMGTOOL_SKIP_FUZZ=1 leaves it out.
if [[ -z ${IMGTOOL_SKIP_FUZZ:-} ]]; then
  bash tools/fuzz.sh --all 30
fi
