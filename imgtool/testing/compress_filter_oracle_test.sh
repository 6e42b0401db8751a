#!/usr/bin/env bash
# Oracle test for the `compress` filter driver (QEMU 7.2's
# block/filter-compress.c) against qemu-io and qemu-img 7.2 on the same
# files: the same stdout, stderr and exit status, and byte-identical files
# afterwards where QEMU's own result is deterministic (writes of one cluster
# each). A compressed write of several clusters is compressed in parallel
# by QEMU, so their host order varies from run to run; those cases compare
# output, guest data and qemu-img check's cluster counts instead.
# Usage: compress_filter_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/compress_filter_oracle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi
if ! command -v qemu-io >/dev/null; then
  echo "qemu-io not installed"
  exit 1
fi

# c.qcow2: 2 MiB, 64 KiB clusters, empty.
empty() { mk -o cluster_size=64k c.qcow2 2M; }
# The same with data at 128k (a normal cluster) and a zero cluster at 1M.
used() {
  mk -o cluster_size=64k c.qcow2 2M
  qio -c 'write -P 7 128k 64k' -c 'write -z 1M 64k' c.qcow2
}
# 4 KiB clusters, zstd.
zstd() { mk -o cluster_size=4k,compression_type=zstd c.qcow2 256k; }
# Extended L2 entries (32 KiB clusters).
ext_l2() { mk -o cluster_size=32k,extended_l2=on c.qcow2 1M; }
# 100 KiB: not a multiple of the cluster size.
odd() { mk c.qcow2 100k; }
# raw.img: a raw image.
raw() { qemu-img create -q -f raw raw.img 1M; }

OPTS=driver=compress,file.driver=qcow2,file.file.driver=file,file.file.filename=c.qcow2
JSON='json:{"driver":"compress","file":{"driver":"qcow2","file":{"driver":"file","filename":"c.qcow2"}}}'

echo "== one-cluster writes (byte-identical files)"
same_io empty -c 'write -P 0xbb 0 64k' -c 'read -P 0xbb 0 64k' -c map \
  --image-opts "$OPTS"
same_io empty -c 'write -P 0xbb 0 64k' -c 'write -P 0xcc 4k 4k' \
  --image-opts "$OPTS"
same_io empty -c 'write -P 0xbc 64k 1000' -c 'write -P 0xbd 0x30100 1000' \
  -c 'read -P 0 64k 0' -c 'read -P 0xbc 64k 1000' -c 'read -P 0 0x10000400 0' \
  -c 'read -P 0 0x103e8 0xfc18' -c map --image-opts "$OPTS"
same_io empty -c 'write -z 256k 4k' -c 'write -z 384k 128k' \
  -c 'write -z -u 640k 64k' -c 'write -z 1000k 1k' -c map "$JSON"
same_io used -c 'write -z 130k 1k' -c 'write -P 1 1M 4k' \
  -c 'write -P 2 1M+64k 512' -c map "$JSON"
same_io used -c 'discard 128k 64k' -c 'write -P 3 128k 64k' -c map \
  --image-opts "$OPTS"
same_io used -c 'write -c -P 3 512k 64k' -c 'flush' -c 'length' -c 'info' \
  --image-opts "$OPTS"
same_io zstd -c 'write -P 5 8k 4k' -c 'write -P 6 20k 100' -c map \
  --image-opts "$OPTS"
same_io ext_l2 -c 'write -P 5 32k 2k' -c 'write -z 96k 1k' -c map \
  --image-opts "$OPTS"
same_io empty -r -c 'read -P 0 0 64k' -c 'write 0 64k' --image-opts "$OPTS"
same_io empty -c 'write -f -P 9 192k 64k' --image-opts "$OPTS"

echo "== the VM state area and zero-length writes"
# QEMU passes read -b / write -b down to the qcow2 node (not compressed). A
# zero-length write at a cluster boundary reaches qcow2's compressed write,
# which pads the file to a multiple of 512 bytes; the block layer drops one
# elsewhere (the filter's request alignment is the cluster size).
same_io empty -c 'write -b -P 0x44 0 64k' -c 'read -b -P 0x44 0 64k' -c map \
  --image-opts "$OPTS"
same_io empty -c 'write 0 0' --image-opts "$OPTS"
same_io empty -c 'write 4k 0' -c 'write 64k 0' --image-opts "$OPTS"
same_io empty -c 'write 4k 0' --image-opts "$OPTS"

echo "== open errors"
same_io raw -c 'read 0 4k' \
  --image-opts driver=compress,file.driver=raw,file.file.filename=raw.img
same_io raw -c 'read 0 4k' -f compress raw.img
same_io raw -c 'read 0 4k' --image-opts driver=compress,file.filename=raw.img
same_io empty -c 'read 0 4k' --image-opts driver=compress
same_io odd -c 'write 0 4k' \
  --image-opts driver=compress,file.driver=qcow2,file.file.filename=c.qcow2
same_io odd -r -c 'read -P 0 0 100k' \
  --image-opts driver=compress,file.driver=qcow2,file.file.filename=c.qcow2
same_io empty -c 'open -o driver=compress c.qcow2' -c 'read 0 4k'
same_io empty -c 'read 0 4k' \
  --image-opts driver=compress,file.driver=qcow2,file.file.filename=c.qcow2,foo=1

# same_io_multi SETUP ARGS...: like same_io, for writes of several
# clusters: output and exit status, then guest data (qemu-img compare) and
# qemu-img check's counts of the two resulting images.
same_io_multi() {
  io_pair "$@" || return
  shift
  local q="$WORK/io.q" i="$WORK/io.i"
  diff_text "io $*" "guest data" "Images are identical." \
    "$(qemu-img compare "$q/c.qcow2" "$i/c.qcow2" 2>&1)" || return
  local counts='/"(allocated|compressed|fragmented)-clusters"|"check-errors"|"leaks"|"corruptions"/p'
  diff_text "io $*" "check" \
    "$(qemu-img check --output=json "$i/c.qcow2" 2>&1 | sed -nE "$counts")" \
    "$(qemu-img check --output=json "$q/c.qcow2" 2>&1 | sed -nE "$counts")"
}

echo "== several clusters (iotest 214's case)"
same_io_multi empty -c 'write -P 0xbb 0 224k' --image-opts "$OPTS"
same_io_multi empty -c 'write -P 0xbb 0 224k' \
  -c 'write -P 0xcc 272k 224k' -c map "$JSON"
same_io_multi empty -c 'write -P 0xbb 0 224k' -c 'write -P 0xcc 4k 4k' \
  -c 'read -P 0xbb 0 224k' "$JSON"
same_io_multi used -c 'write -P 1 64k 128k' -c 'write -z 1000k 200k' \
  -c map "$JSON"
same_io_multi empty -c 'write -z 10k 200k' -c map "$JSON"

echo "== qemu-img"
for cmd in info "info --output=json" map "map --output=json" check; do
  checks=$((checks + 1))
  rm -rf "$WORK/img" && mkdir -p "$WORK/img" && (cd "$WORK/img" && used)
  # shellcheck disable=SC2086
  same_output "$WORK/img" $cmd --image-opts "$OPTS"
done
# map looks through a filter on top of qcow2 to the qcow2 node and its
# backing chain (QEMU's bdrv_skip_filters; iotest 204 maps through
# blkdebug).
chain() {
  mk -o cluster_size=64k base.qcow2 2M
  qio -c 'write -P 1 0 1M' base.qcow2
  mk -b base.qcow2 -F qcow2 c.qcow2
  qio -c 'write -P 2 64k 64k' -c 'write -z 512k 64k' c.qcow2
}
for top in compress preallocate blkdebug; do
  child=file
  [[ $top == blkdebug ]] && child=image
  for fmt in "" "--output=json"; do
    checks=$((checks + 1))
    rm -rf "$WORK/img" && mkdir -p "$WORK/img" && (cd "$WORK/img" && chain)
    # shellcheck disable=SC2086
    same_output "$WORK/img" map $fmt --image-opts \
      "driver=$top,$child.driver=qcow2,$child.file.filename=c.qcow2"
  done
done
src() {
  qemu-img create -q -f raw src.raw 2M
  qio -f raw -c 'write -P 5 0 300k' -c 'write -P 7 1M 64k' src.raw
  mk -o cluster_size=64k c.qcow2 2M
}
# The padded first write (0..320k) allocates the cluster at 256k, so the
# next one fails (compression can't overwrite): QEMU's EIO at byte 307200.
# QEMU compresses the five clusters of that write in parallel, so only the
# messages are compared.
same_messages src convert -n -f raw src.raw --target-image-opts "$OPTS"
same_messages src convert -n -f raw src.raw --target-image-opts \
  driver=compress,file.driver=raw,file.file.filename=c.qcow2

finish
