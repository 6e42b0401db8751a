#!/bin/bash
# Installs imgtool and its drop-in names: `bazel run //imgtool:install --
# DIR` copies the binary to DIR/imgtool and links DIR/qemu-img and
# DIR/qemu-io to it (run under those names it behaves as those tools; see
# imgtool/main.cc). DIR is created if missing; a relative DIR is taken from
# the directory bazel was run in. Existing files of those names in DIR are
# replaced. Usage: install.sh IMGTOOL_BINARY DIR
set -euo pipefail
if [[ $# -ne 2 ]]; then
  echo "usage: bazel run //imgtool:install -- DIR" >&2
  exit 2
fi
binary=$(realpath "$1")
dir=$2
if [[ $dir != /* && -n ${BUILD_WORKING_DIRECTORY:-} ]]; then
  dir=$BUILD_WORKING_DIRECTORY/$dir
fi
mkdir -p "$dir"
install -m 0755 "$binary" "$dir/imgtool.new"
mv -f "$dir/imgtool.new" "$dir/imgtool"
for name in qemu-img qemu-io; do
  ln -sfn imgtool "$dir/$name"
done
echo "installed $dir/imgtool, $dir/qemu-img and $dir/qemu-io"
