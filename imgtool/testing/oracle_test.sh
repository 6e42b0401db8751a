#!/usr/bin/env bash
# Oracle test: imgtool and qemu-img 7.2 on the same raw files must print
# byte-identical map/info output, create identical images with identical
# "Formatting" lines, resize identically, and fail with the same messages.
# Usage: oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/oracle.XXXXXX")
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

D="$WORK/files"
mkdir -p "$D"
head -c 8M /dev/urandom >"$WORK/seed"
put() {  # put FILE OFFSET LENGTH: seed bytes into FILE without truncating
  dd if="$WORK/seed" of="$1" bs=1 count=0 status=none
  dd if="$WORK/seed" of="$1" iflag=count_bytes,skip_bytes oflag=seek_bytes \
    skip="$2" seek="$2" count="$3" conv=notrunc status=none
}
(
  cd "$D"
  truncate -s 10M sparse.raw
  put full.raw 0 4M
  truncate -s 8M holes.raw
  for mib in 0 3 5 7; do put holes.raw $((mib << 20)) 192K; done
  truncate -s 2M ends.raw
  put ends.raw 0 64K
  put ends.raw $(((2 << 20) - 65536)) 64K
  put odd.raw 0 3000
  truncate -s 100001 odd2.raw
  put odd2.raw 32768 4096
  truncate -s 1000 tail.raw
  put tiny.raw 0 3
  : >empty.raw
)
layouts="sparse full holes ends odd odd2 tail tiny empty"

echo "== map"
for f in $layouts; do
  for out in human json; do
    same_output "$D" map --output=$out $f.raw
    same_output "$D" map -f raw --output $out $f.raw
    same_output "$D" map -f file -U --output=$out $f.raw
    for start in 0 100 4097 65536 2000000 3145829 99999999; do
      for len in "" 0 5000 1M; do
        same_output "$D" map --output=$out --start-offset=$start \
          ${len:+--max-length=$len} $f.raw
      done
    done
  done
done

echo "== map with O_DIRECT: unaligned ends"
# QEMU's file-posix rounds a data extent that ends at an unaligned end of
# file up to the O_DIRECT request alignment (iotest 253); a hole at the end
# is one zero extent either way. Sizes N*4096 + 1, + 511, + 4095 and 1 MiB
# - 1, with data or a hole at the end, buffered and O_DIRECT.
(
  cd "$D"
  for size in 1044481 1044991 1048575 1048065; do
    truncate -s $size d$size.raw
    put d$size.raw 0 4096
    put d$size.raw $((size - 100)) 100
    truncate -s $size h$size.raw
    put h$size.raw 0 4096
  done
  put w4095.raw 0 4095
)
for f in d1044481 d1044991 d1048575 d1048065 h1044481 h1048575 w4095 odd \
  odd2 tail tiny; do
  for out in human json; do
    for direct in "" ",cache.direct=on"; do
      opts="driver=raw,file.driver=file,file.filename=$f.raw$direct"
      same_output "$D" map --output=$out --image-opts "$opts"
      same_output "$D" map --output=$out --start-offset=1040000 \
        --max-length=4500 --image-opts "$opts"
    done
    same_output "$D" map --output=$out --image-opts \
      "driver=file,filename=$f.raw,cache.direct=on"
    same_output "$D" map --output=$out \
      "json:{\"driver\":\"raw\",\"file\":{\"driver\":\"file\",\"filename\":\"$f.raw\",\"cache\":{\"direct\":true}}}"
  done
done

echo "== info"
for f in $layouts; do
  same_output "$D" info $f.raw
  same_output "$D" info --output=json $f.raw
  same_output "$D" info -f raw -U --output=human $f.raw
  same_output "$D" info -f file --output=json $f.raw
  same_output "$D" info --backing-chain $f.raw
done
same_output "$D" info /dev/null
same_output "$D" info --output=json /dev/null

echo "== create"
nothing() { :; }
old_file() { head -c 1M "$WORK/seed" >x.raw; }
for args in "x.raw 1M" "-f raw x.raw 1M" "-f file x.raw 1M" "-q x.raw 1M" \
  "x.raw 0" "x.raw 1000" "x.raw 1.7k" "x.raw ' 2k'" "x.raw 0x10000" \
  "x.raw 1000b" "-o size=1.7k x.raw" "-o size=0x10 x.raw" \
  "-o size=1M -o preallocation=full x.raw" "-o size=1M,size=2M x.raw" \
  "-o preallocation=falloc,extent_size_hint=2M x.raw 1M" \
  "-o extent_size_hint=2M,preallocation=falloc,nocow=on x.raw 1000" \
  "-o preallocation=full,nocow=off x.raw 3M" "-o preallocation=off x.raw 5M" \
  "-o nocow=yes x.raw 1M" "-o extent_size_hint=0 x.raw 1M" \
  "-o extent_size_hint=4294967295 x.raw 1M" "-u x.raw 1M" \
  "-- -x.raw 1M"; do
  eval same_effect nothing create "$args"
  eval same_effect old_file create "$args"
done

echo "== create errors"
for args in "-o size=1M x.raw 1M" "x.raw" "x.raw 1kb" "x.raw 1.5" \
  "x.raw 99999999999999999999" "x.raw 9E" "-f qcow3 x.raw 1M" \
  "-o size=3x x.raw" "-o size=16E x.raw" "-o foo=1 x.raw 1M" \
  "-o foo=1,size=3x x.raw" "-o size=3x,foo=1 x.raw" "-o nocow=1 x.raw 1M" \
  "-o extent_size_hint=bad x.raw 1M" "-o extent_size_hint=5G x.raw 1M" \
  "-o preallocation=bad x.raw 1M" \
  "-o preallocation=falloc,,x x.raw 1M" "-o , x.raw 1M" "-o '' x.raw 1M" \
  "-o a=1,, x.raw 1M" "-b base.raw x.raw 1M" "-F raw x.raw 1M" \
  "nodir/x.raw 1M" "-o help" "-o help x.raw" "-f file -o help" \
  "-o size=1M,? x.raw" "-f foo -o help" "'' 1M"; do
  eval same_effect nothing create "$args"
  eval same_effect old_file create "$args"
done
# qemu-img creates (or empties) the file before refusing "metadata";
# imgtool refuses it before touching anything.
same_messages nothing create -o preallocation=metadata x.raw 1M
same_messages old_file create -o preallocation=metadata x.raw 1M
for args in "" "-f raw" "x.raw 1M extra" "-z x.raw 1M" "--foo x.raw 1M" \
  "x.raw 1M -o"; do
  eval same_error "$D" create "$args"
done
# A backing format qemu-img has no driver for (iotest 114): QAPI's error,
# after the file was created and removed again; -u does not skip it.
for args in "-f qcow2 -u -b b.qcow2 -F foo x.qcow2 1M" \
  "-f qcow2 -u -b b.qcow2 -o backing_fmt=foo x.qcow2 1M" \
  "-f qcow2 -u -b b.qcow2 -F foo -o compression_type=x x.qcow2 1M" \
  "-f qcow2 -u -b b.qcow2 -F vmdk x.qcow2 1M"; do
  eval same_effect nothing create "$args"
done

echo "== formats without image creation (iotests 082, 113)"
# QEMU 7.2's drivers without image creation: create, convert, dd and measure
# refuse them by qemu-img's words before touching any file.
for fmt in blkdebug blklogwrites blkverify bochs cloop compress \
  copy-before-write copy-on-read dmg null-aio null-co preallocate quorum \
  replication snapshot-access throttle vvfat; do
  for args in "create -f $fmt x.raw 1M" "create -f $fmt -o help" \
    "create -f $fmt -o help x.raw" "create -f $fmt nbd://example.com 64M" \
    "convert -O $fmt x.raw y.raw" "convert -O $fmt -o help" \
    "convert -O $fmt -o help x.raw y.raw" "dd -O $fmt if=x.raw of=y.raw" \
    "measure -O $fmt --size 1M" "measure -O $fmt x.raw" \
    "amend -f $fmt -o help x.raw"; do
    eval same_effect old_file "$args"
  done
done

echo "== resize"
two_mib() { head -c 2M "$WORK/seed" >r.raw; }
odd_size() { truncate -s 1048676 r.raw; head -c 4096 "$WORK/seed" | dd of=r.raw conv=notrunc status=none; }
for setup in two_mib odd_size; do
  for args in "r.raw 3M" "-f raw r.raw 3M" "-q -f raw r.raw 3M" "r.raw +1M" \
    "-f raw r.raw -512K" "-f raw r.raw -- -512K" "--shrink -f raw r.raw -512K" \
    "--shrink -f raw r.raw -- -512K" "--shrink r.raw 1M" "-f raw r.raw +100" \
    "-f raw r.raw +0" "-f raw r.raw +1" "-f raw r.raw 1048600" \
    "-f raw --shrink r.raw 1048600" "-f file r.raw 5M" \
    "--preallocation=full -f raw r.raw 3M" "--preallocation=falloc -f raw r.raw 3M" \
    "--preallocation=off -f raw r.raw 3M" "--preallocation=falloc -f raw r.raw +1" \
    "--preallocation=full -f raw r.raw +1M" "-f raw r.raw ' 4M'" \
    "-f raw r.raw 1M" "--preallocation=foo r.raw 4M" \
    "--preallocation=full --shrink -f raw r.raw 1M" \
    "--preallocation=full -f raw r.raw 2M" "--preallocation=metadata r.raw 5M" \
    "-f raw r.raw 0" "-f raw --shrink r.raw 0" "-f raw r.raw -- -10M" \
    "-f raw r.raw 1x" "-f raw r.raw ''" "-f raw r.raw +" "-f raw r.raw 9E" \
    "-f raw r.raw +9E" "-f raw r.raw 16E" "nonexist 1M" \
    "-f raw --image-opts r.raw 1M"; do
    eval same_effect $setup resize "$args"
  done
done
for args in "" "r.raw" "-q r.raw" "r.raw 1M 2M" "-U r.raw 2M"; do
  eval same_error "$D" resize "$args"
done

echo "== read-only command errors"
mkdir -p "$D/dir"
for args in "info nonexist" "map nonexist" "info dir" "map dir" \
  "info --output=xml sparse.raw" "map --output=yaml sparse.raw" \
  "info -f foo sparse.raw" "map -f foo sparse.raw" \
  "map --start-offset=foo sparse.raw" "map --max-length=-1 sparse.raw" \
  "map --start-offset=99999999999999999999 sparse.raw" \
  "map --max-length=1x sparse.raw" \
  "info --image-opts -f raw sparse.raw" "map -f raw --image-opts sparse.raw"; do
  eval same_output "$D" "$args"
done
for args in "info" "info a b" "map" "map a b" "info -z x" "map --foo x" \
  "info -f" "map --output"; do
  eval same_error "$D" "$args"
done

echo "== files cut inside their qcow2 header"
# QEMU probes the first 2 KiB with zeroes past the end of the file, so a
# file that starts with the qcow2 magic and a version >= 2 is qcow2 however
# short it is: opening it fails, it is never used as a raw image (cut6: the
# version reads as 0, raw in both). Cut later, where QEMU reads the missing
# tables as zeroes, imgtool refuses them as beyond the end of the file.
T="$WORK/short"
mkdir -p "$T"
qemu-img create -q -f qcow2 "$T/whole.qcow2" 1M
for n in 6 8 50 72; do
  head -c $n "$T/whole.qcow2" >"$T/cut$n.qcow2"
  for args in "info cut$n.qcow2" "map cut$n.qcow2" "check cut$n.qcow2" \
    "compare cut$n.qcow2 whole.qcow2" "convert -O raw cut$n.qcow2 out.raw" \
    "resize cut$n.qcow2 2M" "create -f qcow2 -b cut$n.qcow2 top.qcow2"; do
    eval same_output "$T" "$args"
  done
  [[ $n -gt 6 ]] || continue
  before=$(md5sum <"$T/cut$n.qcow2")
  checks=$((checks + 1))
  (cd "$T" && "$IMGTOOL" io -c 'write 0 512' "cut$n.qcow2" >/dev/null 2>&1)
  rc=$?
  [[ $rc -eq 1 && "$(md5sum <"$T/cut$n.qcow2")" == "$before" ]] ||
    fail "io write into cut$n.qcow2: exit status $rc, file changed or kept"
done

echo "== qcow2 resize past the largest L1 table"
# 64 KiB clusters: an L1 table of 32 MiB covers 2 PiB; beyond, both fail
# with EFBIG from growing the L1 table and leave the image as it was.
G="$WORK/grow"
mkdir -p "$G"
qemu-img create -q -f qcow2 "$G/g.qcow2" 64M
before=$(md5sum <"$G/g.qcow2")
for size in 2049T 4P +3P; do
  same_output "$G" resize g.qcow2 $size
done
[[ "$(md5sum <"$G/g.qcow2")" == "$before" ]] || fail "a failed resize changed g.qcow2"

echo "== bench -w -U"
# force-share needs a read-only image; the message does not name the file
# twice.
same_output "$G" bench -c 1 -w -U g.qcow2
same_output "$D" bench -c 1 -w -U -f raw full.raw
# read-only=off beside force-share=on fails even where the command opens
# read-only (in QEMU read-only=off makes the node writable).
same_output "$G" info --image-opts \
  driver=qcow2,file.filename=g.qcow2,force-share=on,read-only=off
same_output "$G" info --image-opts \
  driver=qcow2,file.filename=g.qcow2,force-share=on,read-only=on

echo "== a pipe as the image"
# QEMU's file driver takes regular files, block and character devices; a
# pipe (/dev/stdin fed by a pipeline) fails with its "regular file" error.
for args in "info -f raw /dev/stdin" "convert -f raw -O qcow2 /dev/stdin p.qcow2" \
  "map -f raw /dev/stdin" "compare -f raw /dev/stdin full.raw"; do
  checks=$((checks + 1))
  a_err=$(cd "$D" && head -c 64k "$WORK/seed" | "$IMGTOOL" $args 2>&1 >/dev/null)
  a_rc=$?
  q_err=$(cd "$D" && head -c 64k "$WORK/seed" | qemu-img $args 2>&1 >/dev/null |
    sed 's/qemu-img/imgtool/g')
  q_rc=$(cd "$D" && head -c 64k "$WORK/seed" | qemu-img $args >/dev/null 2>&1; echo $?)
  diff_text "$args from a pipe" stderr "$a_err" "$q_err" &&
    diff_text "$args from a pipe" "exit status" "$a_rc" "$q_rc"
  [[ ! -e "$D/p.qcow2" ]] || fail "$args from a pipe left p.qcow2"
done

echo "== locked image"
L="$WORK/locked"
mkdir -p "$L"
qemu-img create -q -f qcow2 "$L/in-use.qcow2" 1M
before=$(md5sum <"$L/in-use.qcow2")
# qemu-io keeps the image open (and locked for writing) while it sleeps.
qemu-io -c 'sleep 8000' "$L/in-use.qcow2" >/dev/null 2>&1 &
holder=$!
wait_until_locked "$L/in-use.qcow2"
for args in "resize -f raw in-use.qcow2 2M" "resize -f raw --shrink in-use.qcow2 1K" \
  "create in-use.qcow2 1M" "create -f raw -o preallocation=full in-use.qcow2 1M" \
  "info -f raw in-use.qcow2" "info -U -f raw --output=json in-use.qcow2" \
  "map -f raw --output=json in-use.qcow2"; do
  eval same_output "$L" "$args"
done
for args in "resize -f raw in-use.qcow2 2M" "create in-use.qcow2 1M"; do
  checks=$((checks + 1))
  run "$IMGTOOL" "$L" $args
  [[ $RC -eq 1 ]] || fail "$args on a locked image: exit status $RC"
  [[ "$ERR" == *'Failed to get "write" lock'* ]] || fail "$args: $ERR"
done
kill "$holder" 2>/dev/null
wait "$holder" 2>/dev/null
[[ "$(md5sum <"$L/in-use.qcow2")" == "$before" ]] ||
  fail "the locked image was changed"

finish
