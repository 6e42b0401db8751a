#!/usr/bin/env bash
# Oracle test for convert -c where several sources or requests meet in one
# compressed target cluster: the tail of one source and the start of the
# next ones (sizes not multiples of the cluster size, 3+ sources, sources
# shorter than a cluster, empty ones), data next to zero ranges inside a
# cluster, the image's last, partial cluster, -S 0 / -S sizes, -m 1, -B
# backing files (with -S 0 too), zstd and extended L2 entries, cluster
# sizes 512 to 2M.
# imgtool and qemu-img 7.2 must leave byte-identical files (in-order
# writes); with -W -m 16 the targets must read the same (qemu-img compare)
# and pass qemu-img check.
# Usage: compress_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/compress_oracle.XXXXXX")
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

head -c 1M /dev/urandom >"$WORK/seed"
put() {  # put FILE OFFSET LENGTH: seed bytes into FILE without truncating
  dd if="$WORK/seed" of="$1" bs=1 count=0 status=none
  dd if="$WORK/seed" of="$1" iflag=count_bytes,skip_bytes oflag=seek_bytes \
    skip="$2" seek="$2" count="$3" conv=notrunc status=none
}
S="$WORK/sources"
mkdir -p "$S"
(
  cd "$S" || exit 1
  # iotest 122's case: two 1023k images with 1k clusters, data at the end
  # of the first and at the start of the second.
  mk -o cluster_size=1024 t1.qcow2 1023k
  qio -c 'write -P 0x33 1022k 1k' t1.qcow2
  mk -o cluster_size=1024 t2.qcow2 1023k
  qio -c 'write -P 0x44 0 1k' t2.qcow2
  truncate -s 1000 a.raw   # rounded up to 1024: 24 bytes past its end
  put a.raw 0 1000
  truncate -s 3000 b.raw
  put b.raw 100 200
  put b.raw 2900 100
  truncate -s 512 c.raw
  put c.raw 0 10
  truncate -s 70001 d.raw
  put d.raw 60000 10001
  truncate -s 100k e.raw
  put e.raw 96k 4k
  truncate -s 5000 f.raw   # all hole
  truncate -s 65535 g.raw
  put g.raw 65000 535
  : >empty.raw
  # Zero clusters next to data.
  mk -o cluster_size=4k h.qcow2 61k
  qio -c 'write -P 5 60k 1k' -c 'write -z 0 4k' h.qcow2
  mk i.qcow2 200k
  qio -c 'write -P 6 0 1k' -c 'write -z 1k 63k' -c 'write -P 7 130k 2k' \
    -c 'write -z 132k 60k' i.qcow2
  # An overlay larger than its backing file, whose end is not aligned.
  truncate -s 100000 base.raw
  put base.raw 0 100000
  mk -b base.raw -F raw ov.qcow2 300k
  qio -c 'write -P 8 99k 2k' -c 'write -z 120k 8k' ov.qcow2
)
# copy: copies the sources named in COPY_FILES (and the backing file of
# ov.qcow2) into the current directory; fewer files make the comparison of
# the resulting files faster.
COPY_FILES=""
copy() {
  local f
  for f in $COPY_FILES; do
    [[ -f "$S/$f" ]] && cp -a --sparse=always "$S/$f" .
    [[ $f == ov.qcow2 ]] && cp -a --sparse=always "$S/base.raw" .
  done
  return 0
}

cases="t1.qcow2 t2.qcow2|t2.qcow2 t1.qcow2 t1.qcow2|a.raw b.raw c.raw
  a.raw a.raw a.raw a.raw c.raw c.raw b.raw|d.raw e.raw f.raw g.raw
  g.raw g.raw d.raw|empty.raw a.raw empty.raw b.raw empty.raw|h.qcow2 i.qcow2 h.qcow2|f.raw a.raw f.raw|i.qcow2|d.raw
  -S 0 a.raw b.raw g.raw|-S 512 h.qcow2 i.qcow2|-S 64k d.raw e.raw
  -m 1 d.raw e.raw f.raw g.raw|-B base.raw -F raw ov.qcow2
  -B base.raw -F raw -S 0 ov.qcow2|-B ov.qcow2 -F qcow2 i.qcow2
  -o compression_type=zstd a.raw b.raw c.raw
  -o extended_l2=on d.raw e.raw f.raw g.raw"
IFS='|' read -r -a case_list <<<"$(echo "$cases" | tr '\n' '|' | sed 's/| */|/g')"

echo "== convert -c: byte-identical to qemu-img's"
for cs in 512 1k 4k 64k 2M; do
  for args in "${case_list[@]}"; do
    COPY_FILES=$args
    # shellcheck disable=SC2086
    same_effect copy convert -O qcow2 -c -o cluster_size=$cs $args out.qcow2
  done
done
# -B with -S 0 without -c: the ranges left to the backing file stay
# unallocated (imgtool used to write zeroes over them).
COPY_FILES=ov.qcow2
for cs in 4k 64k; do
  same_effect copy convert -O qcow2 -o cluster_size=$cs -B base.raw -F raw \
    -S 0 ov.qcow2 out.qcow2
done

echo "== convert -c -W -m 16: same contents, check clean"
for cs in 1k 4k 64k 2M; do
  for srcs in "t1.qcow2 t2.qcow2" "d.raw e.raw f.raw g.raw a.raw" \
    "a.raw b.raw c.raw a.raw h.qcow2 i.qcow2"; do
    checks=$((checks + 1))
    rm -f "$WORK/w.qcow2" "$WORK/q.qcow2"
    # shellcheck disable=SC2086
    run "$IMGTOOL" "$S" convert -W -m 16 -c -O qcow2 -o cluster_size=$cs \
      $srcs "$WORK/w.qcow2"
    [[ $RC -eq 0 ]] || { fail "convert -W -c $cs $srcs: exit $RC: $ERR"; continue; }
    # shellcheck disable=SC2086
    (cd "$S" && qemu-img convert -c -O qcow2 -o cluster_size=$cs $srcs \
      "$WORK/q.qcow2")
    qemu-img compare -q "$WORK/w.qcow2" "$WORK/q.qcow2" ||
      fail "convert -W -c $cs $srcs: contents differ from qemu-img's"
    qemu-img check -q "$WORK/w.qcow2" || fail "convert -W -c $cs $srcs: check"
  done
done

echo "== iotest 122's reads"
rm -f "$WORK/o.qcow2"
(cd "$S" && "$IMGTOOL" convert -c -O qcow2 t1.qcow2 t2.qcow2 "$WORK/o.qcow2")
for read in "-P 0 0 1022k" "-P 0x33 1022k 1k" "-P 0x44 1023k 1k" \
  "-P 0 1024k 1022k"; do
  checks=$((checks + 1))
  out=$(qemu-io -c "read $read" "$WORK/o.qcow2")
  [[ "$out" != *"verification failed"* && "$out" == read* ]] ||
    fail "read $read: $out"
done

finish
