#!/usr/bin/env bash
# Oracle test for block graphs from options: --image-opts strings and
# json:{...} filenames through every command that opens an image (info, map,
# check, bench, resize, convert with --target-image-opts, compare, and io
# against qemu-io), against qemu-img/qemu-io 7.2 on the same files: the same
# stdout, stderr and exit status, and the same files afterwards. Covers the
# drivers file, raw, qcow2 (with backing files) and preallocate, chains such
# as qcow2 over preallocate over file and qcow2 over raw over file (named
# json:{...} by info and map), and the option errors (unknown driver or
# option, missing file name, read-only=on, prealloc-align=3, ...).
# Usage: image_opts_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/image_opts_oracle.XXXXXX")
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

# The images every case starts from: a qcow2 image with data, an overlay
# of it, a raw image with data.
make_images() {
  qemu-img create -q -f qcow2 x.qcow2 64M
  qemu-io -c 'write -P 1 0 100k' -c 'write -P 2 1M 64k' x.qcow2 >/dev/null
  qemu-img create -q -f qcow2 -b x.qcow2 -F qcow2 ov.qcow2
  qemu-io -c 'write -P 3 64k 64k' ov.qcow2 >/dev/null
  qemu-img create -q -f raw r.raw 1M
  qemu-io -f raw -c 'write -P 4 4k 8k' r.raw >/dev/null
}
D="$WORK/images"
mkdir -p "$D"
(cd "$D" && make_images)

Q=driver=qcow2,file.driver=file,file.filename=x.qcow2
QRAW=driver=qcow2,file.driver=raw,file.file.driver=file,file.file.filename=x.qcow2
R=driver=raw,file.filename=r.raw
RR=driver=raw,file.driver=raw,file.file.filename=r.raw
OV=driver=qcow2,file.filename=ov.qcow2
JQ='json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2"}}'
# qcow2 over the preallocate filter over the file (issue 5's chain).
P=driver=qcow2,file.driver=preallocate,file.file.driver=file,file.file.filename=x.qcow2
PS=driver=qcow2,file.driver=preallocate,file.prealloc-size=256k,file.prealloc-align=64k,file.file.filename=x.qcow2
PR=driver=preallocate,file.filename=r.raw
JP='json:{"driver":"qcow2","file":{"driver":"preallocate","prealloc-size":"1M","file":{"driver":"file","filename":"x.qcow2"}}}'
JQRAW='json:{"driver":"qcow2","file":{"driver":"raw","file":{"driver":"file","filename":"x.qcow2"}}}'

echo "== info"
for o in "$Q" "$QRAW" "$R" "$RR" "$OV" "$P" "$PS" "$PR" \
  driver=raw,file.driver=preallocate,file.file.filename=r.raw \
  driver=preallocate,file.driver=preallocate,file.file.filename=r.raw \
  file.driver=preallocate,file.file.filename=x.qcow2 \
  "$PR,prealloc-align=0,prealloc-size=0" file.filename=x.qcow2 \
  file.driver=qcow2,file.file.filename=x.qcow2 \
  driver=preallocate,file.driver=qcow2,file.file.filename=ov.qcow2 \
  file.filename=r.raw driver=file,filename=x.qcow2 \
  "$Q,l2-cache-size=1M,refcount-cache-size=256k,lazy-refcounts=on" \
  "$Q,file.locking=off,file.aio=threads,cache.direct=off,read-only=on" \
  "$Q,node-name=top,auto-read-only=on,discard=ignore,detect-zeroes=off"; do
  same_output "$D" info --image-opts "$o"
  same_output "$D" info --output=json --image-opts "$o"
done
same_output "$D" info --backing-chain --image-opts "$OV"
same_output "$D" info --backing-chain --output=json --image-opts "$OV"
for j in "$JQ" "$JQRAW" 'json:{"file":{"driver":"file","filename":"x.qcow2"}}' \
  'json:{"driver":"file","filename":"r.raw"}' "$JP" \
  'json:{"driver":"qcow2","file":{"filename":"x.qcow2"},"l2-cache-size":65536,"lazy-refcounts":true}'; do
  same_output "$D" info "$j"
  same_output "$D" info --output=json "$j"
done
# "backing": null: no backing file (qcow2), accepted and ignored on other
# nodes; no deprecation warning (that is for "backing": "").
for j in '{"driver":"qcow2","file":{"driver":"file","filename":"ov.qcow2"},"backing":null}' \
  '{"driver":"qcow2","backing":null,"file":{"driver":"preallocate","file":{"driver":"file","filename":"ov.qcow2"}}}' \
  '{"driver":"qcow2","file":{"driver":"preallocate","backing":null,"file":{"filename":"ov.qcow2","backing":null}}}' \
  '{"backing":null,"file":{"filename":"ov.qcow2"}}' '{"driver":"raw","file":{"filename":"x.qcow2"},"backing":null}'; do
  same_output "$D" info "json:$j"
  same_output "$D" map --output=json "json:$j"
  same_output "$D" check "json:$j"
  same_output "$D" compare "json:$j" x.qcow2
done
same_output "$D" info -f raw "$JQ"
same_output "$D" info -f preallocate x.qcow2

echo "== option errors"
for o in "$Q,file.foo=1" "$Q,foo=1" "$Q,foo.bar=1" "$Q,cache.foo=1" \
  driver=xyz,file.filename=x.qcow2 driver=qcow2,file.driver=xyz,file.filename=x.qcow2 \
  driver=qcow2,file.driver=file driver=qcow2 filename=x.qcow2 \
  driver=qcow2,filename=x.qcow2 driver=raw,filename=r.raw x.qcow2 \
  driver=qcow2,file=x.qcow2 '' driver=qcow2,file.locking=off \
  driver=qcow2,filename=x.qcow2,file.filename=x.qcow2 "$R,foo=1" \
  driver=file,filename=r.raw,foo=1 driver=file,filename=x.qcow2,file.x=1 \
  driver=file driver=file,filename= "$Q,l2-cache-size=1x" "$Q,l2-cache-size=-1" \
  "$Q,lazy-refcounts=maybe" "$Q,cache.direct=maybe" "$Q,force-share=maybe" \
  "$Q,file.locking=maybe" "$Q,file.aio=foo" "$Q,backing=foo" \
  "$Q,backing.file.filename=r.raw" \
  driver=qcow2,file.filename=nonexist driver=qcow2,file.filename=nonexist,foo=1 \
  driver=qcow2,file.filename=r.raw driver=qcow2,file.filename=r.raw,foo=1 \
  driver=qcow2,file.driver=file,file.filename=. \
  'driver=qcow2,file.filename=a,,b.qcow2' driver=qcow2,file.driver=qcow2,file.file.filename=x.qcow2 \
  "$PR,prealloc-align=3" "$PR,prealloc-size=3x" "$PR,foo=1" "$P,file.foo=1" \
  "$P,file.file.foo=1" driver=preallocate,filename=r.raw \
  driver=qcow2,file.driver=preallocate,file.filename=x.qcow2 \
  "$Q,file.aio=native" "$Q,file.aio=native,cache.direct=off" \
  driver=file,filename=,aio=bad driver=qcow2,file.file.filename=x.qcow2 \
  driver=preallocate,file.driver=qcow2,file.file.driver=xyz,file.file.filename=x.qcow2 \
  "$OV,backing=" "$R,backing=" driver=qcow2,backing=,file.filename=nonexist; do
  same_output "$D" info --image-opts "$o"
done
for j in 'json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2"},"foo":1}' \
  'json:{"filename":"x.qcow2"}' 'json:[]' 'json:{"driver":"qcow2","file":"x.qcow2"}' \
  'json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2"}' \
  'json:null' 'json:[null,{"a":null}]'; do
  same_output "$D" info "$j"
  same_output "$D" info -f qcow2 "$j"
done
same_output "$D" info -f qcow2 --image-opts "$Q"

echo "== map"
for o in "$Q" "$QRAW" "$R" "$RR" "$OV" "$P" "$PR"; do
  same_output "$D" map --image-opts "$o"
  same_output "$D" map --output=json --image-opts "$o"
done
same_output "$D" map --output=json "$JQRAW"
same_output "$D" map "$JP"
same_output "$D" map --image-opts "$Q,foo=1"
same_output "$D" map --image-opts "$OV,backing="
same_output "$D" map -f qcow2 --image-opts "$Q"

echo "== check"
for o in "$Q" "$QRAW" "$OV" "$P" "$PS" "$PR" file.filename=x.qcow2 "$R" file.filename=r.raw \
  "$Q,foo=1" "$R,foo=1" driver=xyz,file.filename=x.qcow2 "$Q,file.foo=1" \
  driver=qcow2,file.filename=nonexist driver=qcow2 "$Q,l2-cache-size=1M"; do
  same_output "$D" check --image-opts "$o"
  same_output "$D" check --output=json --image-opts "$o"
done
same_output "$D" check "$JQ"
same_output "$D" check --output=json "$JQRAW"
same_output "$D" check -f qcow2 --image-opts "$Q"
same_output "$D" check --image-opts "$PR,prealloc-align=3"
same_output "$D" check --image-opts file.foo=1,file.file.filename=x.qcow2
same_output "$D" check --image-opts file.filename=r.raw,driver=qcow2
same_output "$D" check --image-opts file.driver=qcow2,file.file.filename=x.qcow2
same_output "$D" check --image-opts driver=qcow2,file.file.driver=file,file.file.filename=x.qcow2
copy_images() { cp -a "$D/." .; }
same_effect copy_images check -r all --image-opts "$Q,read-only=on"
same_effect copy_images check -r all --image-opts "$Q"
same_effect copy_images check -r all --image-opts "$P"
same_output "$D" check -f preallocate x.qcow2

echo "== compare"
same_output "$D" compare --image-opts "$Q" "$QRAW"
same_output "$D" compare --image-opts "$OV" "$Q"
same_output "$D" compare --image-opts "$R" "$RR"
same_output "$D" compare --image-opts "$P" "$Q"
same_output "$D" compare --image-opts "$PR" "$R"
same_output "$D" compare "$JP" x.qcow2
same_output "$D" compare "$JQ" "$JQRAW"
same_output "$D" compare -f qcow2 --image-opts "$Q" "$Q"
same_output "$D" compare --image-opts "$Q" x.qcow2
same_output "$D" compare --image-opts "$Q,foo=1" "$Q"

echo "== resize"
same_effect copy_images resize --image-opts "$Q" 128M
same_effect copy_images resize --image-opts "$QRAW" +1M
same_effect copy_images resize --image-opts "$R" 2M
same_effect copy_images resize --image-opts "$P" 1G
same_effect copy_images resize --image-opts "$PS" 80M
same_effect copy_images resize --image-opts "$PR" 3M
same_effect copy_images resize --image-opts "$P,file.prealloc-align=3" 1G
same_effect copy_images resize "$JQ" 96M
same_effect copy_images resize --image-opts "$Q,read-only=on" 128M
same_effect copy_images resize --image-opts "$Q,file.read-only=on" 128M
same_effect copy_images resize --image-opts "$Q,force-share=on" 128M
same_effect copy_images resize -f qcow2 --image-opts "$Q" 128M

echo "== convert"
with_target() { copy_images; qemu-img create -q -f qcow2 t.qcow2 64M; }
same_effect copy_images convert --image-opts "$Q" -O raw out.raw
same_effect copy_images convert --image-opts "$QRAW" -O qcow2 out.qcow2
same_effect copy_images convert --image-opts "$OV" -O qcow2 out.qcow2
same_effect copy_images convert "$JQ" -O raw out.raw
same_effect copy_images convert --image-opts "$P" -O qcow2 out.qcow2
same_effect with_target convert -n --image-opts "$OV" \
  --target-image-opts driver=qcow2,file.driver=preallocate,file.file.filename=t.qcow2
same_effect with_target convert -n -f qcow2 x.qcow2 \
  --target-image-opts driver=qcow2,file.driver=preallocate,file.prealloc-size=64k,file.file.filename=t.qcow2
same_effect with_target convert -n --image-opts "$OV" \
  --target-image-opts driver=qcow2,file.filename=t.qcow2
same_effect with_target convert -n -f qcow2 x.qcow2 \
  --target-image-opts driver=qcow2,file.driver=raw,file.file.filename=t.qcow2
same_effect with_target convert --image-opts "$Q" \
  --target-image-opts driver=qcow2,file.filename=t.qcow2
same_effect with_target convert -n --image-opts "$Q" \
  --target-image-opts driver=qcow2,file.filename=t.qcow2,foo=1
same_effect with_target convert -n -O qcow2 x.qcow2 \
  --target-image-opts driver=qcow2,file.filename=t.qcow2
same_effect copy_images convert -f qcow2 --image-opts "$Q" out.raw
# -c with -n: the target's format is checked once it is open (through the
# filter it is qcow2, so compression works; open errors come first).
same_effect with_target convert -n -c -f qcow2 x.qcow2 \
  --target-image-opts driver=qcow2,file.driver=preallocate,file.file.filename=t.qcow2
same_effect with_target convert -n -c -f qcow2 x.qcow2 \
  --target-image-opts file.filename=t.qcow2
same_effect with_target convert -n -c -f qcow2 x.qcow2 \
  --target-image-opts driver=preallocate,file.driver=qcow2,file.file.filename=t.qcow2
same_effect with_target convert -n -c -f qcow2 x.qcow2 \
  --target-image-opts driver=qcow2,file.filename=nonexist
same_effect with_target convert -n -c -O raw -f qcow2 x.qcow2 \
  --target-image-opts driver=qcow2,file.filename=t.qcow2
same_effect with_target convert -n -c -f qcow2 x.qcow2 nonexist
same_effect copy_images convert -n -c -f qcow2 x.qcow2 r.raw

echo "== bench"
# The run time varies: compare the first line and the exit status.
bench_same() {
  checks=$((checks + 1))
  run "$IMGTOOL" "$D" "$@"
  local a_out=${OUT%%$'\n'*} a_err=$ERR a_rc=$RC
  run qemu-img "$D" "$@"
  diff_text "$*" "first stdout line" "$a_out" "${OUT%%$'\n'*}" &&
    diff_text "$*" stderr "$a_err" "$ERR" &&
    diff_text "$*" "exit status" "$a_rc" "$RC"
}
bench_same bench -c 100 --image-opts "$Q"
bench_same bench -c 100 -d 4 -s 64k --image-opts "$QRAW"
bench_same bench -c 100 "$JQ"
bench_same bench -c 100 --image-opts "$P"
bench_same bench -c 100 -w --image-opts "$PR"
bench_same bench -c 100 --image-opts "$Q,foo=1"
bench_same bench -c 100 -f qcow2 --image-opts "$Q"
rm -rf "$WORK/bench" && mkdir "$WORK/bench"
# Written through the filter and without it: clean images with the same
# map, and after close the file ends at its data (the filter trimmed it).
for chain in "driver=qcow2,file.filename=" \
  "driver=qcow2,file.driver=preallocate,file.file.filename="; do
  for tool in "$IMGTOOL" qemu-img; do
    checks=$((checks + 1))
    qemu-img create -q -f qcow2 "$WORK/bench/b.qcow2" 64M
    "$tool" bench -w -c 1000 -s 4k -S 12k --pattern=90 --image-opts \
      "$chain$WORK/bench/b.qcow2" >/dev/null 2>&1 ||
      fail "$tool bench -w --image-opts $chain failed"
    qemu-img check -q "$WORK/bench/b.qcow2" ||
      fail "$tool bench -w $chain: check failed"
    qemu-img map --output=json "$WORK/bench/b.qcow2" \
      >"$WORK/bench/map.$(basename "$tool")"
    stat -c %s "$WORK/bench/b.qcow2" >"$WORK/bench/size.$(basename "$tool")"
  done
  diff_text "bench -w $chain" map "$(cat "$WORK/bench/map.imgtool")" \
    "$(cat "$WORK/bench/map.qemu-img")"
  diff_text "bench -w $chain" "file size" "$(cat "$WORK/bench/size.imgtool")" \
    "$(cat "$WORK/bench/size.qemu-img")"
done

echo "== io"
# qemu-io's timing lines vary; it names itself in its errors.
io_same() {
  checks=$((checks + 1))
  local a="$WORK/io.a" b="$WORK/io.b"
  rm -rf "$a" "$b" && mkdir -p "$a" "$b"
  (cd "$a" && copy_images) && (cd "$b" && copy_images)
  (cd "$a" && "$IMGTOOL" io "$@" >"$WORK/io.a.out" 2>"$WORK/io.a.err")
  local a_rc=$?
  (cd "$b" && qemu-io "$@" >"$WORK/io.b.out" 2>"$WORK/io.b.err")
  local b_rc=$?
  diff_text "io $*" stdout "$(normalize_io "$WORK/io.a.out")" \
    "$(normalize_io "$WORK/io.b.out")" &&
    diff_text "io $*" stderr "$(normalize_io "$WORK/io.a.err")" \
      "$(normalize_io "$WORK/io.b.err")" &&
    diff_text "io $*" "exit status" "$a_rc" "$b_rc" &&
    diff_text "io $*" "resulting files" "$(state "$a")" "$(state "$b")"
}
io_same --image-opts -c 'read -P 1 0 100k' -c map -c 'alloc 0 2M' "$Q"
io_same --image-opts -c 'write -P 9 32k 64k' -c 'read -P 9 32k 64k' "$QRAW"
io_same --image-opts -c 'read -P 3 64k 64k' -c 'read -P 1 0 64k' -c map "$OV"
io_same --image-opts -c 'write -P 5 0 4k' -c 'read -P 5 0 4k' "$R"
io_same -c 'read -P 1 0 100k' "$JQ"
io_same --image-opts -c 'write -P 6 4M 1M' -c 'read -P 6 4M 1M' -c map "$P"
io_same --image-opts -c 'write -P 6 100k 3k' -c 'write -z 1M 64k' -c map "$PS"
io_same --image-opts -c 'write -P 6 1M 4k' -c 'read -P 6 1M 4k' "$PR"
io_same -c 'write -P 6 2M 64k' -c 'read -P 1 0 100k' "$JP"
io_same --image-opts -c 'read 0 1' "$PR,prealloc-align=3"
io_same --image-opts -c 'read 0 1' driver=foo,file.filename=x.qcow2
io_same --image-opts -c 'read 0 1' "$Q,foo=bar"
io_same --image-opts -c 'read 0 1' driver=qcow2,file.filename=nonexist
io_same -c 'read 0 1' 'json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2"},"foo":1}'
io_same -f qcow2 --image-opts -c 'read 0 1' "$Q"
io_same -r --image-opts -c 'write 0 1' "$Q"
io_same -c 'read -P 0 0 64k' -c 'read -P 3 64k 64k' -c map \
  'json:{"driver":"qcow2","backing":null,"file":{"driver":"preallocate","file":{"filename":"ov.qcow2"}}}'
io_same -U --image-opts -c 'read 0 1' "$P"
io_same -i native --image-opts -c 'read 0 1' "$P"

finish
