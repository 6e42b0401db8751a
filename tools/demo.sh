#!/usr/bin/env bash
# The main job: builds imgtool and runs a real workflow on real image files,
# side by side with qemu-img. As root it works on a fresh XFS loop mount
# (where extent size hints apply); otherwise in a temporary directory.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
bazel build //imgtool
imgtool="$PWD/bazel-bin/imgtool/imgtool"

work=$(mktemp -d /var/tmp/imgtool-demo.XXXXXX)
mnt=""
cleanup() {
  cd /
  if [[ -n "$mnt" ]]; then umount "$mnt" 2>/dev/null || umount -l "$mnt"; fi
  rm -rf "$work"
}
trap cleanup EXIT
if [[ $(id -u) -eq 0 ]]; then
  truncate -s 2G "$work/xfs.img"
  mkfs.xfs -q "$work/xfs.img"
  mnt="$work/mnt"
  mkdir "$mnt"
  mount -o loop "$work/xfs.img" "$mnt"
  cd "$mnt"
  echo "== working on a fresh XFS loop mount: $mnt"
else
  cd "$work"
  echo "== not root: working in $work (no XFS, extent size hints may not apply)"
fi

run() { echo "\$ $*"; "$@"; }

echo "== create: default extent size hint (1 MiB) vs none"
run "$imgtool" create -f raw hint.raw 1G
run "$imgtool" create -f raw -o extent_size_hint=0 nohint.raw 1G
run "$imgtool" info hint.raw

echo "== interleaved 4 KiB O_DIRECT writes, step 8 KiB, twice (the fragmentation pattern)"
for img in hint.raw nohint.raw; do
  run "$imgtool" bench -f raw -w -t none -d 64 -c 16384 -s 4k -S 8k "$img"
  run "$imgtool" bench -f raw -w -t none -d 64 -c 16384 -s 4k -S 8k -o 4k "$img"
done
for img in hint.raw nohint.raw; do
  echo "extents in $img: $(filefrag "$img" | sed 's/.*: //')"
done

echo "== map: imgtool vs qemu-img on a file with a hole every 8 KiB"
run "$imgtool" create -f raw -o extent_size_hint=0 holes.raw 256M
"$imgtool" bench -f raw -w -t none -d 64 -c 16384 -s 4k -S 8k holes.raw
"$imgtool" map -f raw --output=json holes.raw > map.imgtool.json
qemu-img map -f raw --output=json holes.raw > map.qemu.json
if cmp -s map.imgtool.json map.qemu.json; then
  echo "map --output=json identical ($(wc -l < map.qemu.json) extents)"
else
  echo "map outputs differ:"; diff map.imgtool.json map.qemu.json | head; exit 1
fi

echo "== resize with preallocation keeps the data"
before=$(head -c 1M hint.raw | md5sum)
run "$imgtool" resize -f raw --preallocation=falloc hint.raw +1G
after=$(head -c 1M hint.raw | md5sum)
[[ "$before" == "$after" ]] && echo "first MiB unchanged"
run "$imgtool" info -f raw --output=json hint.raw
run qemu-img info -f raw hint.raw
echo "== done"
