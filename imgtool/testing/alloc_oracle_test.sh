#!/usr/bin/env bash
# Oracle test for qcow2 allocation: the same image put through the same
# operation by imgtool and by qemu-img/qemu-io 7.2 must come out
# byte-identical, allocated alike (holes where QEMU punches them) and with
# the same `qemu-img check` report (no leaks, same image end offset). The
# cases come from qemu-iotests 163 (shrinking images whose refcount blocks
# count other refcount blocks), 044 (growing the refcount table) and 125
# (preallocated growth).
# Usage: alloc_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/alloc_oracle.XXXXXX")
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

# clean_check DIR FILE LABEL: qemu-img check finds nothing wrong in the
# file imgtool left (same_effect already compared it with qemu-img's).
clean_check() {
  checks=$((checks + 1))
  local out
  out=$(qemu-img check "$1/$2" 2>&1) || fail "$3: check: $out"
}

echo "== resize --shrink (iotest 163)"
# Image LEN with clusters CS and refcount width RB, written in CHUNK pieces
# in ORDER (seq: ascending, rev: descending, mix: a fixed shuffle, none).
(
  cd "$D" || exit 1
  while read -r name cs rb len chunk order; do
    qemu-img create -q -f qcow2 -o cluster_size=$cs,refcount_bits=$rb \
      $name.qcow2 $len
    offsets=$(seq 0 $(numfmt --from=iec $chunk) $(($(numfmt --from=iec $len) - 1)))
    case $order in
      rev) offsets=$(tac <<<"$offsets") ;;
      mix) offsets=$(awk '{ print (NR * 7) % 12 " " $0 }' <<<"$offsets" |
                     sort -n | cut -d' ' -f2) ;;
      none) offsets= ;;
    esac
    for o in $offsets; do qio -c "write -q -P 0xff $o $chunk" $name.qcow2; done
  done <<'EOF'
s512 512 64 3M 256K seq
s512r 512 64 3M 256K rev
s512m 512 64 3M 256K mix
s512e 512 64 3M 256K none
s64k 64K 16 128M 16M seq
s64km 64K 16 128M 16M mix
s1m 1M 1 128M 16M seq
s1mm 1M 1 128M 16M mix
s4k64 4k 64 24M 1M seq
EOF
)
for args in "s512 1M" "s512r 1M" "s512m 1M" "s512e 1M" "s512 100k" \
  "s64k 10M" "s64km 10M" "s1m 10M" "s1mm 10M" "s4k64 3M" "s4k64 5M"; do
  set -- $args
  copy() { cp "$D/$1.qcow2" .; }
  same_effect "copy $1" resize -q -f qcow2 --shrink $1.qcow2 $2
  clean_check "$WORK/effect.a" $1.qcow2 "resize --shrink $1 $2"
done

echo "== one write request over several L2 tables (iotest 044)"
# QEMU's qcow2_alloc_host_offset allocates each L2 table's share of a
# request right after the host clusters of the share before, as many free
# ones as there are there, and only then searches anew.
#
# full.qcow2: iotest 044's image scaled down to an 8 MiB file with 512-byte
# clusters whose every cluster is in use and whose refcount table (one
# cluster) is full; writing 1 MiB grows the table, frees the old one and
# leaves 191 free clusters between the new refcount block and the new
# refcount area, which QEMU fills with 3 L2 tables' shares (64 + 64 + 63).
mkfull() {
  qemu-img create -q -f qcow2 -o cluster_size=512 full.qcow2 16M
  python3 - full.qcow2 <<'PY'
import struct, sys
cs, rt_clusters = 512, 1
file_size = rt_clusters * 64 * 256 * cs
l1_size = 2 * file_size // (64 * cs)
off_rt = cs
off_rb = off_rt + rt_clusters * cs
off_l1 = off_rb + rt_clusters * 64 * cs
off_l2 = off_l1 + (l1_size * 8 + cs - 1) // cs * cs
off_data = off_l2 + l1_size * cs
with open(sys.argv[1], 'r+b') as f:
    f.seek(36)  # l1_size, l1_table_offset, refcount_table_offset/_clusters
    f.write(struct.pack('>IQQI', l1_size, off_l1, off_rt, rt_clusters))
    f.seek(off_rt)
    f.write(struct.pack('>%dQ' % (rt_clusters * 64),
                        *[off_rb + i * cs for i in range(rt_clusters * 64)]))
    f.write(struct.pack('>H', 1) * (rt_clusters * 64 * 256))
    f.write(struct.pack('>%dQ' % l1_size,
                        *[(1 << 63) | (off_l2 + j * cs) for j in range(l1_size)]))
    n = (file_size - off_data) // cs
    f.write(struct.pack('>%dQ' % n,
                        *[(1 << 63) | (off_data + j * cs) for j in range(n)]))
    f.truncate(file_size)
PY
}
# hole.qcow2: every L2 table allocated first (write -z), then data behind
# them; a discard leaves a run of 100 free clusters, so a 256-cluster write
# takes 64 + 36 of them, then the rest at the end.
mkhole() {
  mk -o cluster_size=512 hole.qcow2 4M
  qio -c 'write -q -z 0 4M' -c 'write -q -P 1 0 256K' -c 'discard -q 64K 50K' \
    hole.qcow2
}
# seam.qcow2: the last cluster of an L2 table is written in place and the
# host cluster after it is free while a lower one is the first free one: a
# write over the seam takes the one right after.
mkseam() {
  mk -o cluster_size=512 seam.qcow2 4M
  qio -c 'write -q -z 0 4M' -c 'write -q -P 1 1M 512' -c 'write -q -P 2 0 32K' \
    -c 'discard -q 1M 512' seam.qcow2
}
# xhole.qcow2: mkhole with extended L2 entries (16 KiB clusters, 1024 per
# L2 table): a hole of 1600 clusters, a write of 2048.
mkxhole() {
  mk -o cluster_size=16K,extended_l2=on xhole.qcow2 128M
  qio -c 'write -q -z 0 128M' -c 'write -q -P 1 0 64M' -c 'discard -q 16M 25M' \
    xhole.qcow2
}
(cd "$D" && mkfull && mkhole && mkseam && mkxhole)
while read -r name cmd; do
  copy() { cp "$D/$name.qcow2" .; }
  same_io_effect copy -c "$cmd" $name.qcow2
  clean_check "$WORK/effect.a" $name.qcow2 "io $name: $cmd"
done <<'EOF'
full write -q -P 3 12M 1M
full write -q -P 3 12M 64K
hole write -q -P 3 1M 128K
hole write -q -P 3 1M 1M
seam write -q -P 3 32256 1K
seam write -q -P 3 32256 64K
xhole write -q -P 3 64M 32M
EOF

# Copy-on-write of a new cluster's untouched parts: zeroed with the rest of
# the cluster (an unwritten extent, then the data alone) when block status
# says they read as zeroes (QEMU 7.2's is_zero_cow), else copied and written
# as data: past the end of the image, over a raw backing file. The maps
# state() compares show which.
cow_small() { mk c.qcow2 100k; }
cow_small_data() { mk c.qcow2 100k; qio -c 'write -q -P 1 0 64k' c.qcow2; }
cow_zero() { mk c.qcow2 1M; qio -c 'write -q -z 0 64k' c.qcow2; }
cow_zero_after() {
  mk c.qcow2 1M
  qio -c 'write -q -P 1 0 64k' -c 'write -q -z 64k 64k' c.qcow2
}
cow_qcow2_backing() { mk b.qcow2 1M; mk -b b.qcow2 -F qcow2 c.qcow2; }
cow_short_backing() { mk b.qcow2 100k; mk -b b.qcow2 -F qcow2 c.qcow2 1M; }
cow_raw_backing() { truncate -s 1M b.raw; mk -b b.raw -F raw c.qcow2; }
# Zero clusters of a qcow2 backing file read as zeroes (one run of them: a
# zero 4 KiB cluster followed by unallocated ones is copied).
cow_zero_backing() {
  mk b.qcow2 1M
  qio -c 'write -q -P 1 0 1M' -c 'write -q -z 0 64k' b.qcow2
  mk -b b.qcow2 -F qcow2 c.qcow2
}
cow_zero_run_backing() {
  mk -o cluster_size=4k b.qcow2 1M
  qio -c 'write -q -z 8k 4k' b.qcow2
  mk -b b.qcow2 -F qcow2 c.qcow2
}
cow_ext_zero() {
  mk -o extended_l2=on c.qcow2 1M
  qio -c 'write -q -z 0 64k' c.qcow2
}
while read -r setup cmd; do
  same_io_effect "$setup" -c "$cmd" c.qcow2
done <<'EOF'
cow_small write -q -P 3 68k 4k
cow_small_data write -q -P 3 32k 40k
cow_zero write -q -P 3 4k 4k
cow_zero_after write -q -P 3 32k 64k
cow_qcow2_backing write -q -P 3 4k 4k
cow_short_backing write -q -P 3 200k 4k
cow_short_backing write -q -P 3 68k 4k
cow_raw_backing write -q -P 3 4k 4k
cow_zero_backing write -q -P 3 4k 4k
cow_zero_run_backing write -q -P 3 4k 4k
cow_ext_zero write -q -P 3 1k 2k
EOF
same_effect cow_small_data dd -O qcow2 bs=1000 count=3 if=c.qcow2 of=out.qcow2

finish
