#!/usr/bin/env bash
# Runs the whole test suite: installs what it needs, then `bazel test //...`.
# Real-filesystem tests (XFS/ext4 loop mounts) need root; as another user
# they skip with a message.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bazel test //... "$@"
