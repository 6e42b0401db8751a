#!/usr/bin/env bash
# Oracle test for qcow2 persistent dirty bitmaps (issue 18): `imgtool bitmap`
# against `qemu-img bitmap`, writes through `imgtool io` against the same
# writes through qemu-io on images with bitmaps, crash (abort) leaving
# bitmaps in use, info, convert --bitmaps, measure, and broken bitmap
# directories. The oracle for a bitmap's bits is QEMU itself: qemu-nbd -r -B
# NAME exports it as the meta context qemu:dirty-bitmap:NAME and nbdinfo
# --map prints it. Files must be byte-identical to QEMU's where QEMU's
# result is deterministic (it is for all of these).
# Usage: bitmap_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/bitmap_oracle.XXXXXX")
# Unix socket paths must stay under 108 bytes (Bazel's TEST_TMPDIR is long).
SOCKDIR=$(mktemp -d /tmp/bmo.XXXXXX)
NBD_PID=""
cleanup() {
  [[ -n "$NBD_PID" ]] && kill "$NBD_PID" 2>/dev/null
  rm -rf "$WORK" "$SOCKDIR"
}
trap cleanup EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi
for t in qemu-img qemu-io qemu-nbd nbdinfo; do
  command -v $t >/dev/null || { echo "$t not installed (tools/setup.sh)"; exit 1; }
done

# bitmap_map IMG NAME: the bits of bitmap NAME of IMG as QEMU reads them
# (nbdinfo --map over qemu-nbd -r -B NAME on a unix socket). qemu-nbd
# serves one client and exits; it is waited for, never left running.
bitmap_map() {
  local img=$1 name=$2 sock="$SOCKDIR/nbd.sock" i
  rm -f "$sock"
  qemu-nbd -r -f qcow2 -B "$name" -k "$sock" "$img" 2>"$WORK/nbd.err" &
  NBD_PID=$!
  for i in $(seq 100); do
    [[ -S "$sock" ]] && break
    kill -0 "$NBD_PID" 2>/dev/null || break
    sleep 0.05
  done
  if ! nbdinfo --map="qemu:dirty-bitmap:$name" "nbd+unix:///?socket=$sock" \
    2>"$WORK/nbdinfo.err"; then
    # A failed read never compares equal to another one.
    fail "nbdinfo --map of bitmap $name of $img: $(cat "$WORK/nbdinfo.err" "$WORK/nbd.err")"
    echo "nbdinfo failed $RANDOM"
  fi
  kill "$NBD_PID" 2>/dev/null
  wait "$NBD_PID" 2>/dev/null
  NBD_PID=""
}

# same_maps A B NAMES...: the bitmaps NAMES of images A and B have the
# same bits by QEMU's reading, and neither map is empty of dirty bits
# unless EXPECT_CLEAN is set.
same_maps() {
  local a=$1 b=$2
  shift 2
  local n
  for n in "$@"; do
    checks=$((checks + 1))
    local ma mb
    ma=$(bitmap_map "$a" "$n")
    mb=$(bitmap_map "$b" "$n")
    diff_text "bitmap $n of $a and $b" "dirty map" "$ma" "$mb"
  done
}

# expect_map IMG NAME EXPECTED: QEMU reads exactly EXPECTED (nbdinfo's
# lines, spaces squeezed) as bitmap NAME of IMG.
expect_map() {
  checks=$((checks + 1))
  local got
  got=$(bitmap_map "$1" "$2" | tr -s ' ' | sed 's/^ //')
  diff_text "bitmap $2 of $1" "dirty map" "$got" "$3"
}

clean_check() {  # IMG: qemu-img check finds nothing
  checks=$((checks + 1))
  local out
  out=$(qemu-img check "$1" 2>&1) || fail "qemu-img check $1: $out"
}

# ---- Setups -----------------------------------------------------------------
three() {  # b0 (64k), b1 (512, enabled), b2 (disabled), made by qemu-img
  mk img.qcow2 10M
  qemu-img bitmap --add img.qcow2 b0
  qemu-img bitmap --add -g 512 img.qcow2 b1
  qemu-img bitmap --add --disable img.qcow2 b2
}
three_written() {  # the same with bits set
  three
  qio -c 'write 0 64k' -c 'write 1M 512' -c 'write -z 3M 100k' \
    -c 'discard 5M 64k' img.qcow2
}
plain() { mk img.qcow2 10M; }
small_clusters() {
  mk -o cluster_size=512 img.qcow2 4M
  qemu-img bitmap --add img.qcow2 b0
}
extended() {
  mk -o extended_l2=on,cluster_size=128k img.qcow2 8M
  qemu-img bitmap --add -g 4k img.qcow2 b0
}
backed() {
  mk base.qcow2 10M
  qio -c 'write -P 1 0 10M' base.qcow2
  mk -b base.qcow2 -F qcow2 img.qcow2
  qemu-img bitmap --add img.qcow2 b0
  qemu-img bitmap --add -g 1M base.qcow2 bb
}
crashed() {  # a writer killed: every bitmap stays in use (inconsistent)
  three_written
  qemu-io -c 'write 2M 4k' -c abort img.qcow2 >/dev/null 2>&1
  qemu-img bitmap --add img.qcow2 b4
}
v2() { mk -o compat=0.10 img.qcow2 1M; }
raw() { truncate -s 1M img.raw; }

# ---- bitmap command: output, exit status, files ------------------------------
same_effect plain bitmap --add img.qcow2 b0
same_effect plain bitmap --add -g 512 img.qcow2 b0
same_effect plain bitmap --add -g 2M img.qcow2 b0
same_effect plain bitmap --add --disable img.qcow2 b0
same_effect plain bitmap --disable --add img.qcow2 b0
same_effect plain bitmap --add -f qcow2 img.qcow2 'a name with spaces'
same_effect three bitmap --add img.qcow2 b0
same_effect three bitmap --add img.qcow2 b3
same_effect three bitmap --remove img.qcow2 b1
same_effect three bitmap --remove img.qcow2 b0
same_effect three bitmap --remove img.qcow2 nope
same_effect three bitmap --remove --add img.qcow2 b0
same_effect three_written bitmap --clear img.qcow2 b1
same_effect three_written bitmap --enable img.qcow2 b2
same_effect three_written bitmap --disable img.qcow2 b0
same_effect three_written bitmap --merge b1 img.qcow2 b2
same_effect three_written bitmap --merge b0 img.qcow2 b1
same_effect three_written bitmap --add --merge b1 img.qcow2 new
same_effect three_written bitmap --merge nope img.qcow2 b1
same_effect three_written bitmap --clear img.qcow2 nope
same_effect three_written bitmap --add img.qcow2 ''
same_effect three_written bitmap --add -g 100 img.qcow2 x
same_effect three_written bitmap --add -g 4G img.qcow2 x
same_effect three_written bitmap --add -g 3x img.qcow2 x
same_effect three_written bitmap -g 1k --clear img.qcow2 b1
same_effect three_written bitmap -F qcow2 --clear img.qcow2 b1
same_effect three_written bitmap -b img.qcow2 --clear img.qcow2 b1
same_effect three_written bitmap img.qcow2 b1
same_effect three_written bitmap --clear img.qcow2
same_effect three_written bitmap --add --image-opts \
  driver=qcow2,file.driver=file,file.filename=img.qcow2 b9
same_effect backed bitmap --add --merge bb -b base.qcow2 -F qcow2 img.qcow2 t
same_effect backed bitmap --merge b0 -b img.qcow2 base.qcow2 bb
same_effect crashed bitmap --clear img.qcow2 b0
same_effect crashed bitmap --enable img.qcow2 b1
same_effect crashed bitmap --remove img.qcow2 b0
same_effect crashed bitmap --merge b1 img.qcow2 b4
same_effect crashed bitmap --merge b4 img.qcow2 b1
same_effect v2 bitmap --clear img.qcow2 b0
same_effect small_clusters bitmap --add img.qcow2 b1
# Only the node name ('#blockNNN' in qemu-img) differs: compare the start.
same_error "$WORK" bitmap --add -f qcow2 /dev/null/x b0
run "$IMGTOOL" "$WORK" bitmap --add v2img b0  # (no such file)
(cd "$WORK" && v2 && mv img.qcow2 v2.qcow2)
run "$IMGTOOL" "$WORK" bitmap --add v2.qcow2 b0
checks=$((checks + 1))
[[ $RC == 1 && "$ERR" == *"Cannot store dirty bitmaps in qcow2 v2 files"* ]] ||
  fail "bitmap --add on v2: rc $RC, $ERR"

# ---- writes through imgtool io set the bits as qemu-io's do -------------------
io_cases=(
  "write 0 64k"
  "write 1M 512"
  "write 65535 2"
  "write -z 3M 100k"
  "write -z -u 2M 1M"
  "discard 5M 64k"
  "discard 6M 1000"
  "write -c 0 64k"
  "aio_write 4M 8k"
  "write 10485248 512"
)
for c in "${io_cases[@]}"; do
  same_io three "-c" "$c" img.qcow2
  same_maps "$WORK/io.i/img.qcow2" "$WORK/io.q/img.qcow2" b0 b1 b2
  clean_check "$WORK/io.i/img.qcow2"
done
same_io three -c 'write 0 64k' -c 'write 1M 512' -c 'write -z 3M 100k' \
  -c 'discard 5M 64k' img.qcow2
expect_map "$WORK/io.i/img.qcow2" b0 "0 65536 1 dirty
65536 983040 0 clean
1048576 65536 1 dirty
1114112 2031616 0 clean
3145728 131072 1 dirty
3276800 1966080 0 clean
5242880 65536 1 dirty
5308416 5177344 0 clean"
expect_map "$WORK/io.i/img.qcow2" b2 "0 10485760 0 clean"
same_io small_clusters -c 'write 0 4k' -c 'write 1M 3000' img.qcow2
same_maps "$WORK/io.i/img.qcow2" "$WORK/io.q/img.qcow2" b0
same_io extended -c 'write 0 4k' -c 'write -z 1M 64k' -c 'discard 4M 128k' img.qcow2
same_maps "$WORK/io.i/img.qcow2" "$WORK/io.q/img.qcow2" b0
same_io backed -c 'write -P 2 64k 4k' img.qcow2
same_maps "$WORK/io.i/img.qcow2" "$WORK/io.q/img.qcow2" b0
# Bits set before accumulate; a read-only open changes nothing, a
# read-write one without writes stores the bitmaps again (as QEMU's).
same_io three_written -c 'write 8M 64k' img.qcow2
same_maps "$WORK/io.i/img.qcow2" "$WORK/io.q/img.qcow2" b0 b1 b2
same_io three_written -r -c 'read 0 64k' img.qcow2
same_io three_written -c 'read 0 64k' img.qcow2
same_io three_written -c abort img.qcow2
same_effect three_written info img.qcow2
# A killed writer: every consistent bitmap is left in use.
same_io three_written -c 'write 2M 4k' -c abort img.qcow2
same_effect crashed info img.qcow2
same_effect crashed info --output=json img.qcow2
same_effect crashed check img.qcow2
# check -r opens the image read-write as qemu-img's does: the bitmaps are
# stored again at close (moved); in-use ones are kept as they are. Files
# are compared below on whole_crashed: this setup's partial-cluster writes
# leave holes that may differ between the twins.
same_messages crashed check -r all img.qcow2
same_messages crashed check -r leaks img.qcow2
# Writes to an image with inconsistent bitmaps keep them as they are.
same_io crashed -c 'write 0 4k' img.qcow2
same_maps "$WORK/io.i/img.qcow2" "$WORK/io.q/img.qcow2" b4

# ---- other writers: convert -n, dd-like paths, resize -------------------------
src() { mk src.qcow2 10M; qio -c 'write -P 7 1M 192k' -c 'write -P 8 7M 4k' src.qcow2; }
conv_n() { three; src; }
same_effect conv_n convert -n -O qcow2 src.qcow2 img.qcow2
same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0 b1 b2
same_effect three_written resize img.qcow2 20M
same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0 b1
same_effect crashed resize img.qcow2 20M
# bench -w through imgtool only (qemu-img bench writes the same offsets).
(cd "$WORK" && rm -f bench.qcow2 && mk bench.qcow2 8M &&
  qemu-img bitmap --add bench.qcow2 b0 &&
  "$IMGTOOL" bench -w -c 16 -s 4k -S 64k -o 1M bench.qcow2 >/dev/null)
expect_map "$WORK/bench.qcow2" b0 "0 1048576 0 clean
1048576 1048576 1 dirty
2097152 6291456 0 clean"
clean_check "$WORK/bench.qcow2"
# The same bench through qemu-img sets the same bits (maps compared, not
# files: 4k writes into 64k clusters).
for args in "-c 16 -s 4k -S 64k -o 1M" "-c 40 -s 1k -S 3000 -o 5000" \
  "-c 8 -d 4 -s 64k -S 192k"; do
  (cd "$WORK" && rm -rf bench.i bench.q && mkdir bench.i bench.q &&
    for d in bench.i bench.q; do
      (cd $d && mk img.qcow2 8M && qemu-img bitmap --add img.qcow2 b0 &&
        qemu-img bitmap --add -g 512 img.qcow2 b1)
    done
    "$IMGTOOL" bench -w $args bench.i/img.qcow2 >/dev/null
    qemu-img bench -w $args bench.q/img.qcow2 >/dev/null)
  same_maps "$WORK/bench.i/img.qcow2" "$WORK/bench.q/img.qcow2" b0 b1
done

# ---- info, convert --bitmaps, measure ----------------------------------------
same_effect three_written info img.qcow2
same_effect three_written info --output=json img.qcow2
same_effect three_written convert --bitmaps -O qcow2 img.qcow2 out.qcow2
same_maps "$WORK/effect.a/out.qcow2" "$WORK/effect.b/out.qcow2" b0 b1 b2
same_effect three_written convert --bitmaps -O raw img.qcow2 out.raw
same_effect three_written convert --skip-broken-bitmaps -O qcow2 img.qcow2 out.qcow2
same_effect crashed convert --bitmaps -O qcow2 img.qcow2 out.qcow2
same_effect crashed convert --bitmaps --skip-broken-bitmaps -O qcow2 img.qcow2 out.qcow2
same_effect raw convert --bitmaps -O qcow2 img.raw out.qcow2
same_effect three_written measure -O qcow2 img.qcow2
same_effect three_written measure -O qcow2 -o cluster_size=4k img.qcow2
same_effect three_written measure --output=json -O qcow2 img.qcow2
same_effect crashed measure -O qcow2 img.qcow2
same_effect three_written amend -o compat=0.10 img.qcow2

# ---- images with bitmaps written by imgtool, read by QEMU (and back) --------
(cd "$WORK" && rm -rf x && mkdir x && cd x && three_written &&
  "$IMGTOOL" io -c 'write 7M 64k' img.qcow2 >/dev/null &&
  qemu-io -c 'write 9M 512' img.qcow2 >/dev/null &&
  "$IMGTOOL" bitmap --add -g 1M img.qcow2 late &&
  "$IMGTOOL" io -c 'write -z 4M 1M' img.qcow2 >/dev/null)
expect_map "$WORK/x/img.qcow2" b0 "0 65536 1 dirty
65536 983040 0 clean
1048576 65536 1 dirty
1114112 2031616 0 clean
3145728 131072 1 dirty
3276800 917504 0 clean
4194304 1114112 1 dirty
5308416 2031616 0 clean
7340032 65536 1 dirty
7405568 2031616 0 clean
9437184 65536 1 dirty
9502720 983040 0 clean"
expect_map "$WORK/x/img.qcow2" late "0 4194304 0 clean
4194304 1048576 1 dirty
5242880 5242880 0 clean"
clean_check "$WORK/x/img.qcow2"

# ---- broken bitmap directories: one clear error, no crash, no hang -----------
# poke FILE OFFSET HEX: writes bytes.
poke() { printf "$(sed 's/\(..\)/\\x\1/g' <<<"$3")" |
  dd of="$1" bs=1 seek=$(($2)) conv=notrunc status=none; }
# Header extension of `three`: the bitmaps extension's fields, found by magic.
ext_at() {
  python3 - "$1" <<'PY'
import struct, sys
d = open(sys.argv[1], 'rb').read(65536)
hl = struct.unpack('>I', d[100:104])[0]
p = hl
while p + 8 <= len(d):
    t, n = struct.unpack('>II', d[p:p+8])
    if t == 0x23852875:
        print(p + 8)
        break
    if t == 0:
        break
    p += 8 + (n + 7) // 8 * 8
PY
}
dir_at() { python3 -c "
import struct,sys
d=open('$1','rb').read(65536); e=$2
print(struct.unpack('>Q', d[e+16:e+24])[0])"; }
broken_case() {  # LABEL EXPECTED_SUBSTRING POKE...
  local label=$1 want=$2
  shift 2
  checks=$((checks + 1))
  local d="$WORK/broken"
  rm -rf "$d" && mkdir -p "$d"
  (cd "$d" && three_written)
  local f="$d/img.qcow2" e dir
  e=$(ext_at "$f")
  dir=$(dir_at "$f" "$e")
  eval "$*"
  local qe ie qrc irc
  qe=$(cd "$d" && timeout 20 qemu-img info img.qcow2 2>&1 >/dev/null); qrc=$?
  ie=$(cd "$d" && timeout 20 "$IMGTOOL" info img.qcow2 2>&1 >/dev/null); irc=$?
  [[ $irc -ne 0 && $irc -lt 124 ]] || fail "$label: imgtool info exit $irc"
  [[ "$ie" == *"$want"* ]] || fail "$label: imgtool says: $ie"
  [[ -n "${OWN_MESSAGE:-}" ]] ||
    diff_text "$label" "error (qemu-img's name replaced)" "$ie" \
      "${qe//qemu-img/imgtool}"
  ie=$(cd "$d" && timeout 20 "$IMGTOOL" io -c 'write 0 4k' img.qcow2 2>&1 >/dev/null)
  irc=$?
  [[ $irc -ne 0 && $irc -lt 124 ]] || fail "$label: imgtool io exit $irc"
  # qemu-img check fails at open too, in every repair mode, leaving the
  # file as it is.
  local r sum
  for r in "" "-r leaks" "-r all"; do
    checks=$((checks + 1))
    sum=$(md5sum <"$f")
    qe=$(cd "$d" && timeout 20 qemu-img check $r img.qcow2 2>&1 >/dev/null); qrc=$?
    ie=$(cd "$d" && timeout 20 "$IMGTOOL" check $r img.qcow2 2>&1 >/dev/null); irc=$?
    diff_text "$label: check $r" "error" "$ie" "${qe//qemu-img/imgtool}"
    diff_text "$label: check $r" "exit status" "$irc" "$qrc"
    [[ "$(md5sum <"$f")" == "$sum" ]] || fail "$label: check $r changed the file"
  done
}
broken_case "count too high" "Less bitmaps found than specified" \
  'poke "$f" "$e" 00000004'
broken_case "count too low" "More bitmaps found than specified" \
  'poke "$f" "$e" 00000001'
broken_case "huge count" "exceeding the QEMU supported maximum" \
  'poke "$f" "$e" 7fffffff'
# Past the end of the file the directory reads as zeroes, as in QEMU.
broken_case "directory past the end" "Bitmap '' doesn't satisfy the constraints" \
  'poke "$f" "$((e + 16))" 0000000100000000'
broken_case "directory partly past the end" "doesn't satisfy the constraints" \
  'truncate -s $((dir + 40)) "$f"'
broken_case "directory unaligned" "invalid bitmap directory offset" \
  'poke "$f" "$((e + 16))" $(printf %016x $((dir + 8)))'
broken_case "directory too short" "Broken bitmap directory" \
  'poke "$f" "$((e + 8))" 0000000000000048'
broken_case "table unaligned" "doesn't satisfy the constraints" \
  'poke "$f" "$dir" $(printf %016x 0x30200)'
broken_case "table size zero" "doesn't satisfy the constraints" \
  'poke "$f" "$((dir + 8))" 00000000'
broken_case "name too long" "Broken bitmap directory" \
  'poke "$f" "$((dir + 18))" ffff'
broken_case "extra data" "Bitmap extra data is not supported" \
  'poke "$f" "$((dir + 20))" 00000008'
broken_case "reserved flags" "doesn't satisfy the constraints" \
  'poke "$f" "$((dir + 12))" 00000006'
broken_case "bad type" "doesn't satisfy the constraints" \
  'poke "$f" "$((dir + 16))" 02'
broken_case "granularity too small" "doesn't satisfy the constraints" \
  'poke "$f" "$((dir + 17))" 08'
table_of() { python3 -c "
import struct,sys
d=open('$1','rb').read(); print(struct.unpack('>Q', d[$2:$2+8])[0])"; }
broken_case "table entry reserved bits" "Could not read bitmap_table" \
  'poke "$f" "$(table_of "$f" "$dir")" 0000000000000002'
broken_case "table size not the image's" "Could not read bitmap 'b1' from image" \
  'poke "$f" "$((dir + 40))" 00000002'

# ---- check -r stores the bitmaps again; other commands on images with bitmaps
# Setups write whole clusters only (a partial-cluster write leaves
# fallocate/punch holes in the file that differ between the twins).
whole() {  # b0 (64k), b1 (4k, enabled), b2 (disabled), bits set
  mk img.qcow2 10M
  qemu-img bitmap --add img.qcow2 b0
  qemu-img bitmap --add -g 4k img.qcow2 b1
  qemu-img bitmap --add --disable img.qcow2 b2
  qio -c 'write -P 1 0 128k' -c 'write -P 2 1M 64k' -c 'write -z 3M 128k' \
    -c 'discard 1M 64k' -c 'write -P 3 6M 64k' img.qcow2
}
# l2_entry_at IMG GUEST_OFFSET: file offset of the standard L2 entry (64k
# clusters) of GUEST_OFFSET.
l2_entry_at() { python3 -c "
import struct
d=open('$1','rb').read()
l1=struct.unpack('>Q', d[40:48])[0]
l2=struct.unpack('>Q', d[l1:l1+8])[0] & 0x00fffffffffffe00
print(l2 + ($2 >> 16) * 8)"; }
leaked() {  # whole, and the data cluster of 6M no longer referenced
  whole
  poke img.qcow2 "$(l2_entry_at img.qcow2 $((6 << 20)))" 0000000000000000
}
bm_file_fields() {  # sets e, dir for img.qcow2
  e=$(ext_at img.qcow2)
  dir=$(dir_at img.qcow2 "$e")
}
table_past_eof() {  # b0's bitmap table past the end of the file
  whole
  bm_file_fields
  poke img.qcow2 "$dir" $(printf %016x 0x1000000)
}
data_past_eof() {  # b0's data cluster past the end of the file
  whole
  bm_file_fields
  poke img.qcow2 "$(table_of img.qcow2 "$dir")" $(printf %016x 0x1000000)
}
whole_crashed() {  # whole, then a killed writer: b0, b1 in use
  whole
  (qemu-io -c 'write -P 4 2M 64k' -c abort img.qcow2) >/dev/null 2>&1
}
for r in leaks all; do
  same_effect whole check -r $r img.qcow2
  same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0 b1 b2
  same_effect leaked check -r $r img.qcow2
  same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0 b1 b2
  same_effect whole_crashed check -r $r img.qcow2
  # QEMU reads zeroes past the end: b0 loads clean; freeing its old
  # clusters there fails ("qcow2_free_clusters failed: Invalid argument")
  # and the store goes on.
  same_effect table_past_eof check -r $r img.qcow2
  same_effect data_past_eof check -r $r img.qcow2
  same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0 b1
done
same_effect whole check img.qcow2
same_effect leaked check img.qcow2
same_effect table_past_eof check img.qcow2
same_effect data_past_eof check --output=json img.qcow2

backed_whole() {  # base with bitmap bb, top with b0; whole clusters
  mk base.qcow2 10M
  qio -c 'write -P 1 0 4M' base.qcow2
  qemu-img bitmap --add -g 1M base.qcow2 bb
  mk -b base.qcow2 -F qcow2 img.qcow2
  qemu-img bitmap --add img.qcow2 b0
  qio -c 'write -P 2 1M 128k' -c 'write -P 3 8M 64k' -c 'write -z 2M 64k' img.qcow2
  mk -b base.qcow2 -F qcow2 other.qcow2
  qio -c 'write -P 5 5M 64k' other.qcow2
}
same_effect backed_whole commit img.qcow2
same_maps "$WORK/effect.a/base.qcow2" "$WORK/effect.b/base.qcow2" bb
same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0
same_effect backed_whole commit -b base.qcow2 -d img.qcow2
same_maps "$WORK/effect.a/base.qcow2" "$WORK/effect.b/base.qcow2" bb
same_effect backed_whole rebase -b other.qcow2 -F qcow2 img.qcow2
same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0
same_effect backed_whole rebase -b '' img.qcow2
same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0
same_effect backed_whole rebase -u -b other.qcow2 -F qcow2 img.qcow2
same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0
same_effect whole dd if=img.qcow2 of=out.qcow2 -O qcow2 bs=64k count=100
same_effect whole dd if=img.qcow2 of=out.raw -O raw bs=1M
same_effect backed_whole dd if=other.qcow2 of=img.qcow2 -O qcow2
same_effect whole amend -o lazy_refcounts=on img.qcow2
same_maps "$WORK/effect.a/img.qcow2" "$WORK/effect.b/img.qcow2" b0 b1 b2
same_effect whole amend -o compat=0.10 img.qcow2
same_effect whole_crashed amend -o lazy_refcounts=on img.qcow2
same_effect whole resize img.qcow2 20M
same_effect whole resize --shrink img.qcow2 5M
same_effect whole_crashed resize --shrink img.qcow2 5M

finish
