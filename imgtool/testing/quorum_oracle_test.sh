#!/usr/bin/env bash
# Oracle test for the `quorum` driver against qemu-io and qemu-img 7.2 on
# the same graphs of raw and qcow2 children: votes that win and lose
# (children whose files were written to directly), threshold 1, 2 and 3 of
# 3, read-pattern fifo, rewrite-corrupted (the repaired files compared),
# blkverify, each option error, a missing child, info and map through
# quorum, and qcow2 over quorum with a relative backing file name (iotest
# 110's "(cannot determine actual path)"). Same stdout, stderr and exit
# status, and byte-identical files afterwards.
# Usage: quorum_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/quorum_oracle.XXXXXX")
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

# Three raw children of 1 MiB with the same 0x11 at 0..64k; then
# a.raw/b.raw/c.raw differ as each setup says.
three() {
  local f
  for f in a b c; do
    qemu-img create -q -f raw $f.raw 1M
    qio -f raw -c 'write -P 0x11 0 64k' $f.raw
  done
  sync -f .
}
# b differs at 0..4k: 2 of 3 agree there.
one_bad() {
  three
  qio -f raw -c 'write -P 0x22 0 4k' b.raw
}
# a, b and c all differ at 0..4k: no two agree.
all_bad() {
  one_bad
  qio -f raw -c 'write -P 0x33 0 4k' c.raw
}
# a and b differ at 0..4k (threshold 1 of 2: the tie).
two_differ() {
  three
  qio -f raw -c 'write -P 0x44 512 1k' b.raw
}
# c is shorter: lengths disagree.
short() {
  three
  qemu-img resize -q --shrink -f raw c.raw 512k
}
# qcow2 children over one base, top.qcow2 and copy.qcow2 (iotest 110).
qcow2_pair() {
  mk base.qcow2 1M
  qio -c 'write -P 0x55 0 64k' base.qcow2
  mk -b base.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0x66 64k 64k' top.qcow2
  cp top.qcow2 copy.qcow2
  # Allocated now, not when ext4 flushes delayed blocks: "disk size" sums
  # both children.
  sync -f .
}

kids3='{"driver":"file","filename":"a.raw"},{"driver":"file","filename":"b.raw"},{"driver":"file","filename":"c.raw"}'
kids2='{"driver":"file","filename":"a.raw"},{"driver":"file","filename":"b.raw"}'
# q OPTIONS CHILDREN: a json: quorum.
q() { echo "json:{\"driver\":\"quorum\",$1,\"children\":[$2]}"; }

echo "== votes"
for t in 1 2 3; do
  same_io three -c 'read -P 0x11 0 64k' -c 'read -P 0 64k 64k' "$(q "\"vote-threshold\":$t" "$kids3")"
  same_io one_bad -c 'read -P 0x11 0 64k' -c 'read -P 0x11 4k 4k' "$(q "\"vote-threshold\":$t" "$kids3")"
  same_io all_bad -c 'read -v 0 16' -c 'read -P 0x11 4k 4k' "$(q "\"vote-threshold\":$t" "$kids3")"
done
same_io two_differ -c 'read -v 512 16' -c 'read -v 0 16' "$(q '"vote-threshold":1' "$kids2")"
same_io two_differ -c 'read -v 512 16' "$(q '"vote-threshold":2' "$kids2")"

echo "== writes, zero writes, discard, flush, length, truncate, info"
same_io all_bad -c 'write -P 0x77 0 8k' -c 'read -P 0x77 0 8k' \
  -c 'write -z 64k 64k' -c 'write -z -u 128k 64k' -c 'discard 0 4k' \
  -c 'read -P 0x77 0 4k' -c flush -c length -c 'truncate 2M' -c info \
  "$(q '"vote-threshold":3' "$kids3")"
same_io three -c 'aio_write -P 0x12 0 4k' -c aio_flush -c 'read -P 0x12 0 4k' \
  -c 'map' -c 'alloc 0 1M' "$(q '"vote-threshold":2' "$kids3")"

echo "== fifo"
same_io one_bad -c 'read -v 0 16' -c 'read -P 0x11 4k 4k' \
  "$(q '"vote-threshold":1,"read-pattern":"fifo"' \
    '{"driver":"file","filename":"b.raw"},{"driver":"file","filename":"a.raw"}')"
same_io one_bad -c 'read -v 0 16' \
  "$(q '"vote-threshold":3,"read-pattern":"fifo","rewrite-corrupted":true' "$kids3")"
# fifo past a child that cannot be read: blkdebug fails every read of b.
same_io one_bad -c 'read -v 0 16' \
  "$(q '"vote-threshold":1,"read-pattern":"fifo"' \
    '{"driver":"blkdebug","inject-error":[{"event":"read_aio","errno":"5"}],"image":{"driver":"file","filename":"b.raw"}},{"driver":"file","filename":"a.raw"}')"

echo "== rewrite-corrupted"
same_io one_bad -c 'read -P 0x11 0 2k' \
  "$(q '"vote-threshold":2,"rewrite-corrupted":true' "$kids3")"
same_io one_bad -c 'read -P 0x11 0 64k' \
  "$(q '"vote-threshold":2,"rewrite-corrupted":"on"' "$kids3")"
same_io all_bad -c 'read 0 4k' \
  "$(q '"vote-threshold":1,"rewrite-corrupted":true' "$kids3")"
same_io one_bad -r -c 'read 0 4k' \
  "$(q '"vote-threshold":2,"rewrite-corrupted":true' "$kids3")"

echo "== blkverify"
same_io three -c 'read -P 0x11 0 64k' \
  "$(q '"vote-threshold":2,"blkverify":true' "$kids2")"
same_io two_differ -c 'read -P 0x11 0 512' -c 'read 0 4k' -c 'read 0 512' \
  "$(q '"vote-threshold":2,"blkverify":true' "$kids2")"

echo "== errors"
for o in '"vote-threshold":0' '"vote-threshold":4' '"blkverify":false' \
  '"vote-threshold":-1' '"vote-threshold":"x"' \
  '"vote-threshold":1,"blkverify":true' \
  '"vote-threshold":2,"blkverify":true' \
  '"vote-threshold":1,"read-pattern":"foo"' \
  '"vote-threshold":1,"read-pattern":"fifo","blkverify":true' \
  '"vote-threshold":1,"blkverify":"maybe"' \
  '"vote-threshold":1,"foo":1'; do
  same_io three -c 'read 0 512' "$(q "$o" "$kids3")"
done
same_io three -c 'read 0 512' "$(q '"vote-threshold":2,"blkverify":true,"rewrite-corrupted":true' "$kids2")"
same_io three -c 'read 0 512' 'json:{"driver":"quorum","vote-threshold":1}'
same_io three -c 'read 0 512' 'json:{"driver":"quorum","vote-threshold":1,"children":[]}'
same_io three -c 'read 0 512' 'json:{"driver":"quorum","vote-threshold":1,"children":["a.raw"]}'
same_io three -c 'read 0 512' \
  "$(q '"vote-threshold":1' '{"driver":"file","filename":"a.raw"},{"driver":"file","filename":"missing.raw"}')"
same_io three -c 'read 0 512' \
  "$(q '"vote-threshold":9' '{"driver":"file","filename":"missing.raw"}')"
same_io short -c 'read 0 512' "$(q '"vote-threshold":1' "$kids3")"
same_io three --image-opts -c 'read -P 0x11 0 512' \
  'driver=quorum,vote-threshold=2,children.0.driver=file,children.0.filename=a.raw,children.1.driver=raw,children.1.file.filename=b.raw'
same_io three --image-opts -c 'read 0 512' \
  'driver=quorum,vote-threshold=1,children.0.driver=file,children.0.filename=a.raw,children.2.driver=file,children.2.filename=b.raw'

# info without the disk size: st_blocks of freshly written files depends on
# when the filesystem allocates them (ext4's delayed allocation), which a
# loaded machine changes (as oracle_lib's state() leaves "actual-size" out).
no_disk_size() { grep -v '^disk size: \|"actual-size"'; }

echo "== info and map"
for fmt in human json; do
  OUT_FILTER=no_disk_size same_effect three info --output=$fmt "$(q '"vote-threshold":2' "$kids3")"
  same_effect one_bad map --output=$fmt "$(q '"vote-threshold":2' "$kids3")"
  OUT_FILTER=no_disk_size same_effect three info --output=$fmt "$(q '"vote-threshold":1,"read-pattern":"fifo","blkverify":false' "$kids2")"
done
OUT_FILTER=no_disk_size same_effect three info "$(q '"vote-threshold":1,"rewrite-corrupted":true' "$kids2")"
OUT_FILTER=no_disk_size same_effect short info "$(q '"vote-threshold":1' "$kids3")"

echo "== qcow2 over quorum: a relative backing file name"
qkids='{"driver":"file","filename":"top.qcow2"},{"driver":"file","filename":"copy.qcow2"}'
top="json:{\"driver\":\"qcow2\",\"file\":$(q '"vote-threshold":1' "$qkids" | sed 's/^json://')}"
for fmt in human json; do
  OUT_FILTER=no_disk_size same_effect qcow2_pair info --output=$fmt "$top"
done
OUT_FILTER=no_disk_size same_effect qcow2_pair info --backing-chain "$top"
same_io qcow2_pair -c 'read 0 512' "$top"
# An absolute backing file name works through quorum: one base, read only,
# at the same path for both tools.
mkdir -p "$WORK/abs"
(cd "$WORK/abs" && mk base.qcow2 1M && qio -c 'write -P 0x55 0 64k' base.qcow2)
qcow2_abs() {
  qcow2_pair
  qemu-img rebase -q -u -b "$WORK/abs/base.qcow2" -F qcow2 top.qcow2
  cp top.qcow2 copy.qcow2
}
same_io qcow2_abs -c 'read -P 0x55 0 64k' -c 'read -P 0x66 64k 64k' -c map "$top"
same_effect qcow2_abs map --output=json "$top"

finish
