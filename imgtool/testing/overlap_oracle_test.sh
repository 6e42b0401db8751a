#!/usr/bin/env bash
# Oracle test for qcow2's metadata overlap check and its open options
# (QEMU 7.2's overlap-check, overlap-check.template and overlap-check.<kind>,
# block/qcow2.c qcow2_update_options_prepare; the check is
# qcow2-refcount.c's qcow2_check_metadata_overlap): `imgtool io` against
# qemu-io 7.2 on the same images, same output, exit status and files.
# Option errors through `open -o`, --image-opts and json:; writes refused
# (image marked corrupt) or let through depending on the kinds checked, on
# images with one L2 entry poked to point at metadata (as iotest 060); the
# inactive-L2 check on a snapshot whose L1 table offset or size is invalid
# (iotest 080: the check itself fails, EINVAL / EFBIG). Also qemu-img
# snapshot -c failing with EAGAIN when the snapshot's refcount increase had
# to allocate a refcount block (080).
# Usage: overlap_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/overlap_oracle.XXXXXX")
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

T="$WORK/templates"
mkdir -p "$T"
poke() { printf "$3" | dd of="$1" bs=1 seek=$(($2)) conv=notrunc status=none; }

# 1 MiB, 64k clusters: data written, snapshot 'foo' taken, data rewritten.
# Layout (qemu-img 7.2): active L1 0x30000 -> L2 0x80000; the snapshot's
# L1 0x60000 -> L2 0x40000; snapshot table 0x70000; refcount block 0x20000.
mk "$T/plain.qcow2" 1M
mk "$T/snap.qcow2" 1M
qio -c 'write -P 1 0 512' "$T/snap.qcow2"
qemu-img snapshot -c foo "$T/snap.qcow2"
qio -c 'write -P 2 0 512' "$T/snap.qcow2"
# The active L2 entry 0 pointing at the snapshot's L2 table (060).
cp "$T/snap.qcow2" "$T/into-inactive-l2.qcow2"
poke "$T/into-inactive-l2.qcow2" 0x80000 '\x80\x00\x00\x00\x00\x04\x00\x00'
# ... at the refcount block, and at the active L1 table.
cp "$T/snap.qcow2" "$T/into-refblock.qcow2"
poke "$T/into-refblock.qcow2" 0x80000 '\x80\x00\x00\x00\x00\x02\x00\x00'
cp "$T/snap.qcow2" "$T/into-l1.qcow2"
poke "$T/into-l1.qcow2" 0x80000 '\x80\x00\x00\x00\x00\x03\x00\x00'
# The snapshot's L1 table offset unaligned, its size too large (080).
cp "$T/snap.qcow2" "$T/snap-l1-offset.qcow2"
poke "$T/snap-l1-offset.qcow2" 0x70000 '\x00\x00\x00\x00\x00\x06\x02\x00'
cp "$T/snap.qcow2" "$T/snap-l1-size.qcow2"
poke "$T/snap-l1-size.qcow2" 0x70008 '\x10\x00\x00\x00'
# A bitmap, and an L2 entry pointing at its directory.
mk "$T/bitmap.qcow2" 1M
qio -c 'write -P 1 0 512' "$T/bitmap.qcow2"
qemu-img bitmap --add "$T/bitmap.qcow2" b0
be() { echo $((0x$(od -An -tx1 -j $(($2)) -N "$3" "$1" | tr -d ' \n'))); }
# The bitmaps extension (magic 0x23852875) after the header: its
# bitmap_directory_offset is at +24 of the extension.
off=$(be "$T/bitmap.qcow2" 100 4)
while [[ $(be "$T/bitmap.qcow2" "$off" 4) -ne $((0x23852875)) ]]; do
  len=$(be "$T/bitmap.qcow2" $((off + 4)) 4)
  off=$((off + 8 + (len + 7) / 8 * 8))
done
bitmap_dir=$(be "$T/bitmap.qcow2" $((off + 24)) 8)
l2=$(( $(be "$T/bitmap.qcow2" $(be "$T/bitmap.qcow2" 40 8) 8) & 0xfffffffffe00 ))
cp "$T/bitmap.qcow2" "$T/into-bitmap-dir.qcow2"
poke "$T/into-bitmap-dir.qcow2" "$l2" "$(printf '\\x%02x' 0x80 0 0 0 \
  $(((bitmap_dir >> 24) & 255)) $(((bitmap_dir >> 16) & 255)) 0 0)"
for f in "$T"/*.qcow2; do
  qemu-img check -q "$f" >/dev/null 2>&1
done

# same_io_md5 SETUP ARGS...: io_pair, and the two leave img.qcow2 with
# the same bytes (not allocation: the templates are sparse copies).
same_io_md5() {
  io_pair "$@" || return
  shift
  diff_text "io $*" "resulting image" "$(md5sum <"$WORK/io.i/img.qcow2")" \
    "$(md5sum <"$WORK/io.q/img.qcow2")"
}

setup_plain() { cp "$T/plain.qcow2" img.qcow2; }
setup_from() { cp "$T/$1.qcow2" img.qcow2; }
setup_snap() { setup_from snap; }
setup_into_inactive_l2() { setup_from into-inactive-l2; }
setup_into_refblock() { setup_from into-refblock; }
setup_into_l1() { setup_from into-l1; }
setup_snap_l1_offset() { setup_from snap-l1-offset; }
setup_snap_l1_size() { setup_from snap-l1-size; }
setup_into_bitmap_dir() { setup_from into-bitmap-dir; }

# Option values and their errors.
# (imgtool takes `overlap-check=X` and `overlap-check.<kind>=Y` only apart:
# one option tree cannot hold a value and a group of the same name, so
# "overlap-check=all,overlap-check.inactive-l2=on" fails, which QEMU's flat
# options take; the template is then given as overlap-check.template.)
for o in overlap-check=bogus overlap-check.template=bogus \
  overlap-check.template=constant overlap-check.inactive-l2=maybe \
  overlap-check.bogus=on overlap-check.template.x=1 \
  overlap-check.main-header=off overlap-check=none; do
  same_io_md5 setup_plain -c "open -o $o img.qcow2" -c 'write 0 4k'
done
same_io_md5 setup_plain --image-opts -c 'write 0 4k' \
  driver=qcow2,file.filename=img.qcow2,overlap-check.template=all,overlap-check.active-l2=off
for j in '"overlap-check":"bogus"' '"overlap-check":{"inactive-l2":7}' \
  '"overlap-check":{"template":"constant","inactive-l2":true}'; do
  same_io_md5 setup_plain -c 'write 0 4k' \
    "json:{\"driver\":\"qcow2\",\"file\":{\"filename\":\"img.qcow2\"},$j}"
done

# Writes into metadata: refused where that kind is checked (the image then
# marked corrupt), let through where it is not.
for o in overlap-check=all overlap-check=cached \
  overlap-check.template=all,overlap-check.inactive-l2=off; do
  same_io_md5 setup_into_inactive_l2 -c "open -o $o img.qcow2" \
    -c 'write -P 3 0 512'
done
for o in overlap-check=cached overlap-check=constant; do
  same_io_md5 setup_into_refblock -c "open -o $o img.qcow2" \
    -c 'write -P 3 0 512'
done
same_io_md5 setup_into_l1 -c 'open -o overlap-check.active-l1=off img.qcow2' \
  -c 'write -P 3 0 512'
# (With bitmap-directory=off QEMU overwrites the directory and then prints
# "Lost persistent bitmaps during inactivation of node ...: Broken bitmap
# directory" at close; imgtool keeps its own copy: not compared.)
same_io_md5 setup_into_bitmap_dir -c 'write -P 3 0 512' img.qcow2

# A snapshot L1 table the inactive-L2 check cannot use fails the check (and
# so the write, and the close's refcount block write-back) with EINVAL /
# EFBIG; without that check the write goes through.
for s in setup_snap_l1_offset setup_snap_l1_size; do
  same_io_md5 "$s" -c 'open -o overlap-check.inactive-l2=on img.qcow2' \
    -c 'write 0 4k'
done
same_io_md5 setup_snap_l1_offset -c 'write 0 4k' img.qcow2
# The inactive-L2 check reading the snapshot's valid L1 table: no overlap.
same_io_md5 setup_snap -c 'open -o overlap-check=all img.qcow2' \
  -c 'write -P 5 0 64k' -c 'write -P 6 128k 4k'

# qemu-img snapshot -c whose refcount increase allocates a refcount block
# for an L2 entry pointing 1 TiB into the file: EAGAIN (080).
setup_huge_l2_entry() {
  mk img.qcow2 64M
  qio -c 'write 0 512' img.qcow2
  poke img.qcow2 0x40000 '\x80\x00\x00\xff\xff\xff\x00\x00'
}
same_effect setup_huge_l2_entry snapshot -c test img.qcow2

finish
