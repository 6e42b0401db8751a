#!/usr/bin/env bash
# Installs every Debian package that imgtool's build, tests and benchmarks need.
# Idempotent: safe to re-run. Must run as root on Debian 12.
set -euo pipefail
packages=(
  bazel-bootstrap g++ pkg-config
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev libbenchmark-tools
  liburing-dev libprotobuf-dev protobuf-compiler zlib1g-dev
  qemu-utils xfsprogs e2fsprogs util-linux strace fio hyperfine python3
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
