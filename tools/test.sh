#!/usr/bin/env bash
# Runs the whole test suite: installs what it needs, then `bazel test //...`.
# Real-filesystem tests (XFS/ext4 loop mounts) need root; as another user
# they skip with a message.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bazel test //... "$@"

# Fuzzing (README "Fuzzing"): every libFuzzer target built with
# --config=fuzz in its own output base, its seed corpus replayed, then 30 s
# of fuzzing each. IMGTOOL_SKIP_FUZZ=1 leaves it out.
if [[ -z ${IMGTOOL_SKIP_FUZZ:-} ]]; then
  bash tools/fuzz.sh --all 30
fi
