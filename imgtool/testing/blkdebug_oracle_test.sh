#!/bin/bash
# blkdebug graphs through imgtool against qemu-img / qemu-io 7.2: the same
# command lines on copies of the same files print the same stdout, stderr
# (tool names read as imgtool's, timing lines removed) and exit status, and
# leave byte-identical files behind; after each injected error `qemu-img
# check` of both images agrees.
# Usage: blkdebug_oracle_test.sh IMGTOOL
set -u

IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/blkdebug_oracle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi

normalize() {
  sed -E \
    -e '/^[0-9.]+ (bytes|KiB|MiB|GiB|TiB|PiB|EiB), [0-9]+ ops; /d' \
    -e 's/qemu-io: /imgtool: /; s/qemu-img: /imgtool: /' "$1"
}

# run_pair SETUP SUB REAL ARGS...: `imgtool SUB ARGS` in $WORK/a and
# `REAL ARGS` in $WORK/b, both prepared by SETUP; streams in
# $WORK/{a,b}.{out,err}, exit statuses in a_rc and b_rc.
run_pair() {
  local setup=$1 sub=$2 real=$3
  shift 3
  checks=$((checks + 1))
  local a="$WORK/a" b="$WORK/b"
  rm -rf "$a" "$b"
  mkdir -p "$a" "$b"
  (cd "$a" && $setup)
  (cd "$b" && $setup)
  (cd "$a" && "$IMGTOOL" $sub "$@" >"$WORK/a.out" 2>"$WORK/a.err")
  a_rc=$?
  (cd "$b" && $real "$@" >"$WORK/b.out" 2>"$WORK/b.err")
  b_rc=$?
}

# pair_case NAME SETUP SUB REAL ARGS...: run_pair, then stdout, stderr and
# the exit status compared. Returns 1 after the first difference.
pair_case() {
  local name=$1
  shift
  local a_rc b_rc
  run_pair "$@"
  diff_text "$name" stdout "$(normalize "$WORK/a.out")" \
      "$(normalize "$WORK/b.out")" &&
    diff_text "$name" stderr "$(normalize "$WORK/a.err")" \
      "$(normalize "$WORK/b.err")" &&
    diff_text "$name" "exit status" "$a_rc" "$b_rc"
}

# io_case NAME SETUP ARGS...: `imgtool io ARGS` against `qemu-io ARGS`
# (pair_case); then `qemu-img check` and the files.
io_case() {
  local name=$1 a="$WORK/a" b="$WORK/b"
  pair_case "$1" "$2" io qemu-io "${@:3}" &&
    diff_text "$name" "check" \
      "$(cd "$a" && for f in *.qcow2; do qemu-img check "$f" 2>&1; echo "rc=$?"; done)" \
      "$(cd "$b" && for f in *.qcow2; do qemu-img check "$f" 2>&1; echo "rc=$?"; done)" &&
    diff_text "$name" "resulting files" "$(state "$a")" "$(state "$b")"
}

# info_case ARGS...: `imgtool info ARGS` against `qemu-img info ARGS`.
info_case() {
  same_output "$WORK/img" info "$@"
}

setup_raw() { truncate -s 1M t.raw; }
setup_qcow2() { qemu-img create -q -f qcow2 t.qcow2 64M; }
setup_qcow2_data() {
  qemu-img create -q -f qcow2 t.qcow2 64M
  qemu-io -c 'write -P 0x11 0 128k' t.qcow2 >/dev/null
}
conf() {
  # conf EVENT ERRNO ONCE [EXTRA]: blkdebug.conf with one inject-error rule.
  printf '[inject-error]\nevent = "%s"\nerrno = "%s"\nonce = "%s"\n%s' \
    "$1" "$2" "$3" "${4:-}" >blkdebug.conf
}

# --- Opening and naming ----------------------------------------------------
mkdir -p "$WORK/img"
(
  cd "$WORK/img" || exit 1
  qemu-img create -q -f qcow2 t.qcow2 1M
  printf '[inject-error]\nevent = "l2_load"\n' >b.conf
  printf '[inject-error]\nevent = "l2_load"\nfoo = "1"\n' >bad1.conf
  printf '[inject-error]\nevent = "nonsense"\n' >bad2.conf
  printf '[inject-error]\nerrno = "5"\n' >bad3.conf
  printf '[foo]\nevent = "l2_load"\n' >bad4.conf
  printf 'event = "l2_load"\n' >bad5.conf
  printf '[inject-error]\nevent = "l2_load"\nerrno = "x"\n' >bad6.conf
  printf '[inject-error]\nevent = "l2_load"\niotype = "x"\n' >bad7.conf
  printf '[set-state]\nevent = "l2_load"\nnew_state = "2"\n' >state.conf
)
info_case blkdebug:b.conf:t.qcow2
info_case blkdebug::t.qcow2
info_case -f raw blkdebug::t.qcow2
info_case -f qcow2 blkdebug:state.conf:t.qcow2
info_case --image-opts driver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2
info_case --image-opts driver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2,file.inject-error.0.event=l2_load
info_case --image-opts driver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2,file.config=b.conf,file.align=512,file.set-state.0.event=l2_load,file.set-state.0.new_state=2
info_case --image-opts driver=blkdebug,image.filename=t.qcow2,config=b.conf,align=512
info_case --image-opts driver=blkdebug,image.filename=t.qcow2,max-transfer=1000
info_case --image-opts driver=qcow2,file.driver=blkdebug,file.x-image=t.qcow2
info_case 'json:{"driver": "qcow2", "file": {"driver": "blkdebug", "image": {"driver": "file", "filename": "t.qcow2"}, "inject-error": [{"event": "l2_load"}]}}'
for bad in bad1 bad2 bad3 bad4 bad5 bad6 bad7 nonexistent; do
  info_case "blkdebug:$bad.conf:t.qcow2"
done
info_case blkdebug:t.qcow2
info_case blkdebug::nonexistent
info_case --image-opts driver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2,file.foo=1
info_case --image-opts driver=qcow2,file.driver=blkdebug,file.file.filename=t.qcow2
info_case --image-opts driver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2,file.align=3
info_case --image-opts driver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2,file.align=4096,file.max-transfer=1000

# --- Errors on a raw image through blkdebug (event none: at open) ----------
setup_none_once() { setup_raw; conf none 28 on; }
setup_none_always() { setup_raw; conf none 5 off; }
setup_none_write() { setup_raw; conf none 5 off 'iotype = "write"\n'; }
setup_none_sector() { setup_raw; conf none 5 off 'sector = "8"\n'; }
io_case "none once" setup_none_once -f raw -c 'write -P 1 0 4k' -c 'write -P 2 0 4k' -c 'read -P 2 0 4k' blkdebug:blkdebug.conf:t.raw
io_case "none always" setup_none_always -f raw -c 'write -P 1 0 4k' -c 'read 0 4k' -c 'flush' blkdebug:blkdebug.conf:t.raw
io_case "none iotype write" setup_none_write -f raw -c 'read 0 4k' -c 'write -P 1 0 4k' -c 'write -z 0 4k' blkdebug:blkdebug.conf:t.raw
io_case "none sector 8" setup_none_sector -f raw -c 'write -P 1 0 4k' -c 'write -P 2 4k 4k' -c 'read -P 2 4k 4k' blkdebug:blkdebug.conf:t.raw
io_case "align rmw" setup_raw --image-opts -c 'write -P 7 100 1000' -c 'read -P 7 100 1000' -c 'read -P 0 0 100' driver=raw,file.driver=blkdebug,file.align=4096,file.image.filename=t.raw

# A discard with unaligned ends through blkdebug's opt-discard/max-discard:
# the ends are cut at the request alignment and the whole clusters between
# are discarded (QEMU's bdrv_co_pdiscard; iotest 177).
setup_qcow2_4m() {
  qemu-img create -q -f qcow2 t.qcow2 8M
  qemu-io -c 'write -P 0x22 0 8M' t.qcow2 >/dev/null
}
io_case "unaligned discard" setup_qcow2_4m --image-opts \
  -c 'discard 100001 3M' -c 'map' -c 'read -P 0 1M 2M' \
  driver=blkdebug,image.driver=qcow2,image.file.filename=t.qcow2,align=512,opt-discard=1M,max-discard=1M

# --- Errors at the qcow2 driver's events ------------------------------------
for event in write_aio l2_update l1_update cluster_alloc refblock_alloc \
    refblock_update_part l2_alloc_write; do
  for errno in 5 28; do
    for once in on off; do
      eval "setup_q() { setup_qcow2; conf $event $errno $once; }"
      io_case "$event $errno once=$once" setup_q \
        -c 'write -P 0x22 0 64k' -c 'read -P 0x22 0 64k' \
        blkdebug:blkdebug.conf:t.qcow2
    done
  done
done
# stdout and stderr into one file: qemu-io's stdout stays buffered until exit,
# so close's "Failed to flush ..." lines come before "write failed" (iotest
# 026 pipes only stdout through its filter). No flush of stdout at close or
# before an error line.
for event in refblock_load l2_alloc_write; do
  checks=$((checks + 1))
  for tool in a b; do
    rm -rf "$WORK/$tool" && mkdir -p "$WORK/$tool"
    (cd "$WORK/$tool" &&
      qemu-img create -q -f qcow2 -o cluster_size=1024 t.qcow2 1G &&
      conf $event 5 off)
  done
  (cd "$WORK/a" && "$IMGTOOL" io -c 'write 0 128k' \
    blkdebug:blkdebug.conf:t.qcow2 >"$WORK/a.all" 2>&1)
  (cd "$WORK/b" && qemu-io -c 'write 0 128k' \
    blkdebug:blkdebug.conf:t.qcow2 >"$WORK/b.all" 2>&1)
  diff_text "$event once=off, 2>&1" "stdout and stderr" \
    "$(normalize "$WORK/a.all")" "$(normalize "$WORK/b.all")"
done

for event in read_aio l2_load; do
  for once in on off; do
    eval "setup_q() { setup_qcow2_data; conf $event 5 $once; }"
    io_case "$event 5 once=$once" setup_q \
      -c 'read -P 0x11 0 64k' -c 'read -P 0x11 0 64k' \
      blkdebug:blkdebug.conf:t.qcow2
  done
done

# A write from an allocated cluster into the image's partial last cluster:
# the tail past the image end is copied (perform_cow: cow_read, then
# cow_write after the data).
setup_qcow2_partial() {
  qemu-img create -q -f qcow2 t.qcow2 100k
  qemu-io -c 'write -P 0x11 0 4k' t.qcow2 >/dev/null
}
for event in cow_read cow_write; do
  eval "setup_q() { setup_qcow2_partial; conf $event 5 on; }"
  io_case "partial last cluster $event 5 once=on" setup_q \
    -c 'write -P 0x22 60k 8k' -c 'read -P 0x22 60k 8k' \
    blkdebug:blkdebug.conf:t.qcow2
done

# The raw format raises read_aio and write_aio on its file (QEMU's
# raw_co_preadv/raw_co_pwritev), with or without offset and size.
for event in read_aio write_aio; do
  eval "setup_r() { setup_raw; conf $event 5 on; }"
  io_case "raw $event 5 once=on" setup_r -f raw -c 'read 0 4k' \
    -c 'write -P 1 0 4k' -c 'read -P 1 0 4k' blkdebug:blkdebug.conf:t.raw
  io_case "raw offset $event 5 once=on" setup_r --image-opts \
    -c 'read 0 4k' -c 'write -P 1 0 4k' -c 'read -P 1 0 4k' \
    driver=raw,offset=4096,file.driver=blkdebug,file.config=blkdebug.conf,file.image.filename=t.raw
done
# cor_write: QEMU 7.2 raises it on the node doing the copy-on-read, and a
# blkdebug node sees only the events raised on itself: under a qcow2 image
# opened with -C never; as the top node, yes (cor_oracle_test).
setup_cor() {
  qemu-img create -q -f qcow2 t.qcow2.base 1M
  qemu-io -c 'write -P 0x11 0 64k' t.qcow2.base >/dev/null
  qemu-img create -q -f qcow2 -b t.qcow2.base -F qcow2 t.qcow2 1M
  conf cor_write 5 off
}
io_case "cor_write under qcow2 -C" setup_cor -C -c 'read -P 0x11 0 4k' \
  -c 'read -P 0x11 0 4k' -c map blkdebug:blkdebug.conf:t.qcow2
io_case "cor_write over qcow2 -C" setup_cor -C --image-opts \
  -c 'read -P 0x11 0 4k' -c 'read -P 0x11 0 4k' -c map \
  driver=blkdebug,config=blkdebug.conf,image.driver=qcow2,image.file.filename=t.qcow2

# iotest 066's last case: a write over a data cluster, a preallocated zero
# cluster and a data cluster at contiguous host offsets is one data write
# (one write_aio: the error armed by it never fires) that reuses all three
# clusters; the same with a head and a tail, and with the zero cluster first.
setup_066() {
  qemu-img create -q -f qcow2 t.qcow2 192k
  qemu-io -c 'write -P 42 0 192k' -c 'write -z 64k 64k' t.qcow2 >/dev/null
}
setup_066_first() {
  qemu-img create -q -f qcow2 t.qcow2 192k
  qemu-io -c 'write -P 42 0 192k' -c 'write -z 0 64k' t.qcow2 >/dev/null
}
armed_066="driver=qcow2,file.driver=blkdebug,file.image.filename=t.qcow2,file.set-state.0.event=write_aio,file.set-state.0.new_state=2,file.inject-error.0.event=write_aio,file.inject-error.0.state=2"
io_case "066 reuse over zero cluster" setup_066 --image-opts \
  -c 'write -P 42 0 192k' -c 'read -P 42 0 192k' -c map "$armed_066"
io_case "066 reuse, head and tail in place" setup_066 --image-opts \
  -c 'write -P 7 1k 190k' -c 'read -P 42 0 1k' -c 'read -P 7 1k 190k' \
  -c map "$armed_066"
io_case "066 reuse, zero cluster first" setup_066_first --image-opts \
  -c 'write -P 7 1k 190k' -c 'read -P 0 0 1k' -c 'read -P 7 1k 190k' \
  -c map "$armed_066"
# The same shapes with extended L2 entries (32 subclusters of 2 KiB): a
# partial write over [in place][preallocated zero] and over
# [preallocated zero][in place] must leave the subcluster bitmaps, the data
# and the errors QEMU leaves.
setup_066x() {
  qemu-img create -q -f qcow2 -o extended_l2=on t.qcow2 192k
  qemu-io -c 'write -P 42 0 192k' -c "write -z $1 64k" t.qcow2 >/dev/null
}
setup_066x_mid() { setup_066x 64k; }
setup_066x_first() { setup_066x 0; }
io_case "066 extended L2, head and tail in place" setup_066x_mid \
  --image-opts -c 'write -P 7 1k 190k' -c 'read -P 42 0 1k' \
  -c 'read -P 7 1k 190k' -c map "$armed_066"
io_case "066 extended L2, in place then zero" setup_066x_mid \
  -c 'write -P 7 32k 64k' -c 'read -P 42 0 32k' -c 'read -P 7 32k 64k' \
  -c 'read -P 0 96k 32k' -c map t.qcow2
io_case "066 extended L2, zero then in place" setup_066x_first \
  -c 'write -P 7 34k 60k' -c 'read -P 0 0 34k' -c 'read -P 7 34k 60k' \
  -c 'read -P 42 94k 98k' -c map t.qcow2

# --- Errors while qemu-img commit empties the top (qcow2_make_empty) --------
# img_case NAME SETUP CMD ARGS...: `imgtool CMD ARGS` against `qemu-img
# CMD ARGS` (pair_case); then the files, a read-write open of t.qcow2 (which
# repairs a dirty image: its messages compared) and `qemu-img check`
# (iotest 098).
img_case() {
  local name=$1 a="$WORK/a" b="$WORK/b"
  pair_case "$1" "$2" "$3" "qemu-img $3" "${@:4}" &&
    diff_text "$name" "resulting files" "$(state "$a")" "$(state "$b")" &&
    diff_text "$name" "open" \
      "$(cd "$a" && "$IMGTOOL" io -c close t.qcow2 2>&1 | normalize /dev/stdin)" \
      "$(cd "$b" && qemu-io -c close t.qcow2 2>&1 | normalize /dev/stdin)" &&
    diff_text "$name" "check" \
      "$(cd "$a" && qemu-img check t.qcow2 2>&1; echo "rc=$?")" \
      "$(cd "$b" && qemu-img check t.qcow2 2>&1; echo "rc=$?")" &&
    diff_text "$name" "repaired files" "$(state "$a")" "$(state "$b")"
}
setup_commit() {
  qemu-img create -q -f qcow2 t.qcow2.base 64M
  qemu-img create -q -f qcow2 -b t.qcow2.base -F qcow2 t.qcow2 64M
  qemu-io -c 'write -P 0x33 0 64k' t.qcow2 >/dev/null
}
img_case "commit" setup_commit commit t.qcow2
for event in l1_update empty_image_prepare reftable_update refblock_alloc \
    cluster_alloc refblock_update_part pwritev_zero; do
  for once in on off; do
    eval "setup_c() { setup_commit; conf $event 5 $once; }"
    img_case "commit $event 5 once=$once" setup_c commit \
      blkdebug:blkdebug.conf:t.qcow2
  done
done
for event in empty_image_prepare refblock_alloc; do
  eval "setup_c() { setup_commit; conf $event 28 off; }"
  img_case "commit $event 28 once=off" setup_c commit \
    blkdebug:blkdebug.conf:t.qcow2
done

# --- Events of open, refcount table growth, shrink and the VM state area ---
# safe_case NAME SETUP SUB REAL ARGS...: for cases whose files cannot equal
# QEMU's (see the callers): `imgtool SUB ARGS` prints the same stdout and
# exits as `REAL ARGS`, and `qemu-img check` finds imgtool's t.qcow2 free of
# corruption (leaked clusters allowed: exit status 0 or 3).
safe_case() {
  local name=$1
  shift
  local a_rc b_rc
  run_pair "$@"
  local check check_rc
  check=$(cd "$WORK/a" && qemu-img check t.qcow2 2>&1)
  check_rc=$?
  diff_text "$name" stdout "$(normalize "$WORK/a.out")" \
      "$(normalize "$WORK/b.out")" &&
    diff_text "$name" "exit status" "$a_rc" "$b_rc" &&
    diff_text "$name" "check of imgtool's image (rc 0 or 3, no errors)" \
      "$(grep -E '^ERROR|^[0-9]+ errors were found|corrupt' <<<"$check"; [[ $check_rc == 0 || $check_rc == 3 ]] || echo "rc=$check_rc")" ""
}
setup_shrink() {
  qemu-img create -q -f qcow2 -o cluster_size=512 t.qcow2 4M
  qemu-io -c 'write -P 0x55 0 4M' t.qcow2 >/dev/null
}
for once in on off; do
  eval "setup_q() { setup_qcow2_data; conf reftable_load 5 $once; }"
  io_case "reftable_load 5 once=$once" setup_q -c 'read -P 0x11 0 64k' \
    blkdebug:blkdebug.conf:t.qcow2
  for event in vmstate_save vmstate_load; do
    eval "setup_q() { setup_qcow2; conf $event 5 $once; }"
    io_case "$event 5 once=$once" setup_q -c 'write -b -P 0x44 0 64k' \
      -c 'read -b -P 0x44 0 64k' -c 'read -b -P 0x44 0 64k' \
      blkdebug:blkdebug.conf:t.qcow2
  done
done
# 512-byte clusters: one refcount table cluster covers 8 MiB of file. With
# once=off QEMU's image leaks one L2 table's data (64 clusters) more than
# imgtool's: QEMU writes the pieces of one request in parallel tasks, and the
# piece before the failed one links its L2 entries only after the failure,
# too late for any write; imgtool writes and links them in turn, and the
# next L2 allocation writes the linked table out (QEMU's l2_allocate flushes
# the L2 cache). Both exit alike; imgtool's image only leaks.
eval "setup_q() { qemu-img create -q -f qcow2 -o cluster_size=512 t.qcow2 16M; conf reftable_grow 5 on; }"
io_case "reftable_grow 5 once=on" setup_q -c 'write -P 0x22 0 9M' \
  -c 'read -P 0x22 0 9M' blkdebug:blkdebug.conf:t.qcow2
eval "setup_q() { qemu-img create -q -f qcow2 -o cluster_size=512 t.qcow2 16M; conf reftable_grow 5 off; }"
safe_case "reftable_grow 5 once=off" setup_q io qemu-io \
  -c 'write -P 0x22 0 9M' -c 'read -P 0x22 0 9M' blkdebug:blkdebug.conf:t.qcow2
# qemu-img resize --shrink (QEMU's qcow2_shrink_l1_table). With once=off,
# every I/O after the event fails, and which refcount updates reach the disk
# before that depends on the refcount cache: QEMU's holds 4 clusters (here
# 2 KiB), imgtool's 256 KiB, and imgtool writes the discarded clusters'
# refcounts before zeroing the L1 entries. QEMU leaves the freed data
# clusters' refcounts at 1 where imgtool's are 0, and at
# l1_shrink_free_l2_clusters QEMU prints "qcow2_free_clusters failed" for
# each table its cache cannot hold (113 here) and fails later ("Failed to
# discard unused refblocks") where imgtool stops at the first. Both exit 1;
# imgtool's image only leaks.
for event in l1_shrink_write_table l1_shrink_free_l2_clusters; do
  eval "setup_q() { setup_shrink; conf $event 5 on; }"
  img_case "resize --shrink $event 5 once=on" setup_q resize --shrink \
    blkdebug:blkdebug.conf:t.qcow2 16k
  eval "setup_q() { setup_shrink; conf $event 5 off; }"
  safe_case "resize --shrink $event 5 once=off" setup_q resize \
    "qemu-img resize" --shrink blkdebug:blkdebug.conf:t.qcow2 16k
done
# Close's failures after a failed shrink: the error first, then one line
# per cache, as qemu-img's blk_unref reports them.
eval "setup_q() { setup_shrink; conf l1_shrink_write_table 5 off; }"
pair_case "resize --shrink l1_shrink_write_table 5 once=off: messages" \
  setup_q resize "qemu-img resize" --shrink blkdebug:blkdebug.conf:t.qcow2 16k

finish
