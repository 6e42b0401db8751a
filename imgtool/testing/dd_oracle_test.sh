#!/usr/bin/env bash
# Oracle test for dd: imgtool and qemu-img 7.2 run on copies of the same
# files must print the same output, exit with the same status and leave the
# same files behind (size, content, allocation map, info), for every option.
# Usage: dd_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/dd_oracle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi

if ! command -v qemu-img >/dev/null; then
  echo "qemu-img not installed"
  exit 1
fi

# Inputs: a qcow2 image with data, zero and unallocated clusters over a
# backing file; a raw image with a hole; a raw file of 1000 bytes (its
# virtual size is 1024).
inputs() {
  mk base.qcow2 2M
  qio -c 'write -P 0x11 0 1M' base.qcow2
  mk -b base.qcow2 -F qcow2 in.qcow2
  qio -c 'write -P 0x22 64k 100k' -c 'write -z 512k 64k' \
    -c 'write -c -P 0x33 1536k 64k' in.qcow2
  truncate -s 3M in.raw
  qio -f raw -c 'write -P 0x44 0 256k' -c 'write -P 0x45 2M 4k' in.raw
  cp "$WORK/seed" small.raw
}
head -c 1000 /dev/urandom >"$WORK/seed"

for f in in.qcow2 in.raw small.raw; do
  same_effect inputs dd if=$f of=out.raw
  same_effect inputs dd -O qcow2 if=$f of=out.qcow2
done
same_effect inputs dd -f qcow2 -O raw if=in.qcow2 of=out.raw
same_effect inputs dd -f raw if=in.qcow2 of=out.raw
same_effect inputs dd -U if=in.qcow2 of=out.raw
same_effect inputs dd -O file if=in.raw of=out.raw
same_effect inputs dd --image-opts if=driver=qcow2,file.filename=in.qcow2 \
  of=out.raw
for bs in 512 1000 4k 64k 1M 3M; do
  same_effect inputs dd bs=$bs if=in.qcow2 of=out.raw
done
# count counts from the start of the input, the skipped blocks included.
for args in "count=3" "bs=4k count=10" "bs=64k count=100" "count=0" \
  "skip=1" "bs=4k skip=3" "bs=64k skip=16" "bs=64k skip=40" \
  "bs=64k skip=41" "bs=4k skip=2 count=10" "bs=1000 skip=1 count=3" \
  "bs=1000 count=3" "skip=100000000000"; do
  # shellcheck disable=SC2086
  same_effect inputs dd $args if=in.qcow2 of=out.raw
  # shellcheck disable=SC2086
  same_effect inputs dd -O qcow2 $args if=in.raw of=out.qcow2
done
same_effect inputs dd bs=1000 skip=1 if=small.raw of=out.raw
# The last operand of a kind wins.
same_effect inputs dd if=in.raw if=in.qcow2 of=a.raw of=out.raw
# An existing output is replaced.
same_effect inputs dd if=in.qcow2 of=in.raw

# Errors.
same_effect inputs dd if=in.qcow2
same_effect inputs dd of=out.raw
same_effect inputs dd
same_effect inputs dd bogus if=in.qcow2 of=out.raw
same_effect inputs dd foo=1 if=in.qcow2 of=out.raw
for bs in 0 3G 1x -1; do
  same_effect inputs dd bs=$bs if=in.qcow2 of=out.raw
done
same_effect inputs dd count=1x if=in.qcow2 of=out.raw
same_effect inputs dd skip=-5 if=in.qcow2 of=out.raw
same_effect inputs dd -O bogus if=in.qcow2 of=out.raw
same_effect inputs dd if=missing.raw of=out.raw
same_effect inputs dd if=in.qcow2 of=nodir/out.raw
same_effect inputs dd -f raw --image-opts if=driver=qcow2,file.filename=in.qcow2 of=out.raw
same_error "$WORK" dd --bogus if=a of=b

finish
