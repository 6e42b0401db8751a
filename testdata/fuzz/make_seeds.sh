#!/usr/bin/env bash
# Remakes the qcow2 seed images of testdata/fuzz/qcow2/ with qemu-img and
# qemu-io 7.2 (testdata/README.md lists each one). Run from the repository
# root: bash testdata/fuzz/make_seeds.sh. Images are small: 512 B to 16 KiB
# clusters, a few writes; the files are written as QEMU leaves them, then a
# few are patched (corrupt_*) or cut (cut_*) as their comments say.
set -euo pipefail
out=testdata/fuzz/qcow2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out"
q() { qemu-io -f qcow2 "$@" >/dev/null; }
# patch FILE OFFSET HEXBYTES
patch() { printf "$(echo "$3" | sed 's/../\\x&/g')" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none; }

qemu-img create -q -f qcow2 -o cluster_size=512 "$out/c512.qcow2" 64k
q -c 'write -P 0xaa 0 1k' -c 'write -z 4k 1k' -c 'write -P 0x11 60k 512' "$out/c512.qcow2"

qemu-img create -q -f qcow2 -o compat=0.10,cluster_size=4k "$out/v2_c4k.qcow2" 256k
q -c 'write -P 0x22 0 6k' -c 'write -P 0x33 128k 4k' "$out/v2_c4k.qcow2"

qemu-img create -q -f qcow2 -o cluster_size=4k "$out/c4k_compressed.qcow2" 64k
q -c 'write -c -P 0x44 0 4k' -c 'write -c -P 0x45 8k 4k' -c 'write -P 0x46 16k 4k' "$out/c4k_compressed.qcow2"

qemu-img create -q -f qcow2 -o cluster_size=4k,compression_type=zstd "$out/c4k_zstd.qcow2" 64k
q -c 'write -c -P 0x47 0 4k' -c 'write -c -P 0x48 4k 4k' "$out/c4k_zstd.qcow2"

# The backing file sits beside the images while they are made, then goes:
# the seeds keep only its name.
qemu-img create -q -f raw "$out/base.raw" 64k
qemu-img create -q -f qcow2 -o cluster_size=4k -b base.raw -F raw "$out/c4k_backing.qcow2" 64k
q -c 'write -P 0x55 4k 4k' -c 'write -z 12k 4k' "$out/c4k_backing.qcow2"

qemu-img create -q -f qcow2 -o cluster_size=4k,refcount_bits=1 "$out/c4k_refbits1.qcow2" 64k
q -c 'write -P 0x66 0 8k' "$out/c4k_refbits1.qcow2"

qemu-img create -q -f qcow2 -o cluster_size=4k,refcount_bits=64 "$out/c4k_refbits64.qcow2" 64k
q -c 'write -P 0x67 0 8k' "$out/c4k_refbits64.qcow2"

# Lazy refcounts, killed before close (qemu-io's abort): dirty bit set,
# refcounts of the new clusters not written.
qemu-img create -q -f qcow2 -o cluster_size=4k,lazy_refcounts=on "$out/c4k_lazy_dirty.qcow2" 64k
q -c 'write -P 0x77 0 8k' -c abort "$out/c4k_lazy_dirty.qcow2" 2>/dev/null || true

qemu-img create -q -f qcow2 -o cluster_size=16k,extended_l2=on "$out/c16k_extl2.qcow2" 128k
q -c 'write -P 0x88 0 512' -c 'write -z 1k 1k' -c 'write -P 0x89 20k 2k' -c 'discard 16k 512' "$out/c16k_extl2.qcow2"

qemu-img create -q -f qcow2 -o cluster_size=16k,extended_l2=on -b base.raw -F raw "$out/c16k_extl2_backing.qcow2" 64k
q -c 'write -P 0x8a 1k 512' "$out/c16k_extl2_backing.qcow2"

rm "$out/base.raw"

# A 2 MiB-cluster header only (the image is cut after cluster 0's first 4 KiB).
qemu-img create -q -f qcow2 -o cluster_size=2M "$tmp/c2m.qcow2" 1G
head -c 4096 "$tmp/c2m.qcow2" > "$out/cut_c2m_header.qcow2"

# A 64 KiB-cluster image cut inside its header (50 bytes).
qemu-img create -q -f qcow2 "$tmp/c64k.qcow2" 1M
head -c 50 "$tmp/c64k.qcow2" > "$out/cut_c64k_50.qcow2"

# A 4 KiB-cluster image cut 1 byte into its L1 table (at 0x3000), so that
# check reports and -r all repairs the cut table (issue 15).
qemu-img create -q -f qcow2 -o cluster_size=4k "$tmp/c4k_l1.qcow2" 64k
q -c 'write -P 0x9c 0 4k' "$tmp/c4k_l1.qcow2"
head -c $((0x3000 + 1)) "$tmp/c4k_l1.qcow2" > "$out/cut_c4k_l1.qcow2"

# c4k images with one field broken (offsets from qemu-img's layout of a
# 64 KiB image with 4 KiB clusters: refcount table at 0x1000, refcount block
# at 0x2000, L1 table at 0x3000, first L2 table at 0x4000).
qemu-img create -q -f qcow2 -o cluster_size=4k "$out/corrupt_l2_offset.qcow2" 64k
q -c 'write -P 0x99 0 4k' "$out/corrupt_l2_offset.qcow2"
patch "$out/corrupt_l2_offset.qcow2" $((0x3000)) 8000010000000200   # L1[0]: unaligned, past EOF

qemu-img create -q -f qcow2 -o cluster_size=4k "$out/corrupt_refcount_zero.qcow2" 64k
q -c 'write -P 0x9a 0 4k' "$out/corrupt_refcount_zero.qcow2"
patch "$out/corrupt_refcount_zero.qcow2" $((0x2000 + 2 * 4)) 0000   # refcount of the L2 table's cluster 4 -> 0

qemu-img create -q -f qcow2 -o cluster_size=4k "$out/corrupt_l2_reserved.qcow2" 64k
q -c 'write -P 0x9b 0 4k' "$out/corrupt_l2_reserved.qcow2"
patch "$out/corrupt_l2_reserved.qcow2" $((0x4000)) 81   # L2[0]: a reserved bit (56) set

qemu-img create -q -f qcow2 -o cluster_size=4k "$out/corrupt_refcount_table.qcow2" 64k
patch "$out/corrupt_refcount_table.qcow2" $((0x1000)) 0000010000000000   # refcount table[0] -> 1 TiB

# Persistent bitmaps (issue 18) on a c4k image: b0 (enabled, granularity
# 4k) with bits set, b1 (disabled, 512). qemu-img's layout: bitmaps
# extension fields at 120 (nb_bitmaps), 128 (directory size), 136
# (directory offset); directory at 0xe000 (b0's entry; b1's at 0xe020),
# b0's table at 0xc000 with its data cluster at 0xb000, b1's table at 0xd000
# (all zero). The broken ones are refused at open with QEMU's messages.
bm="$tmp/bm_c4k.qcow2"
qemu-img create -q -f qcow2 -o cluster_size=4k "$bm" 64k
qemu-img bitmap --add "$bm" b0
qemu-img bitmap --add -g 512 --disable "$bm" b1
q -c 'write -P 0xb1 0 8k' -c 'write -z 16k 4k' "$bm"
cp "$bm" "$out/bm_c4k.qcow2"
# bm_seed NAME OFFSET HEXBYTES: a copy of bm_c4k with one field patched.
bm_seed() { cp "$bm" "$out/$1.qcow2"; patch "$out/$1.qcow2" "$2" "$3"; }
bm_seed bm_count_high 120 00000003                       # Less bitmaps found
bm_seed bm_dir_past_eof 136 0000000000100000             # zeroes: Bitmap ''
bm_seed bm_dir_size_short 128 0000000000000018           # Broken bitmap directory
bm_seed bm_table_unaligned $((0xe000)) 000000000000c200  # b0: constraints
bm_seed bm_table_size_huge $((0xe008)) ffffffff          # b0: constraints
bm_seed bm_name_long $((0xe012)) ffff                    # Broken bitmap directory
bm_seed bm_table_entry_reserved $((0xc000)) 0000000000000002  # Could not read bitmap_table
bm_seed bm_data_past_eof $((0xc000)) 0000000000100000    # loads zeroes; check: past the end
bm_seed bm_table_shared $((0xe020)) 000000000000c000  # b1 shares b0's table
# A writer killed with the bitmaps in use (inconsistent, flag in_use).
cp "$bm" "$out/bm_in_use.qcow2"
q -c 'write -P 0xb2 32k 4k' -c abort "$out/bm_in_use.qcow2" 2>/dev/null || true

# Snapshot tables (issue 18) on a c4k image with two snapshots: "a" (id 1,
# its L1 table at 0x7000) and "b" (id 2, L1 at 0xb000), each with 24 bytes
# of extra data; qemu-img's layout: header fields nb_snapshots at 60 and
# snapshots_offset at 64, the table at 0xc000 (a's entry; b's at 0xc048),
# refcount table at 0x1000, active L1 at 0x3000; the file ends with the
# table (0xc08a). The entries' dates are set to one fixed time so that the
# seeds are the same on every run. Each broken one is refused or read as
# qemu-img 7.2 does (testdata/README.md gives the outcome).
sn="$tmp/sn_c4k.qcow2"
qemu-img create -q -f qcow2 -o cluster_size=4k "$sn" 64k
q -c 'write -P 0xc1 0 8k' "$sn"
qemu-img snapshot -c a "$sn"
q -c 'write -P 0xc2 4k 4k' "$sn"
qemu-img snapshot -c b "$sn"
patch "$sn" $((0xc010)) 6b00000000000000
patch "$sn" $((0xc058)) 6b00000000000000
cp "$sn" "$out/sn_c4k.qcow2"
# sn_seed NAME OFFSET HEXBYTES: a copy of sn_c4k with one field patched.
sn_seed() { cp "$sn" "$out/$1.qcow2"; patch "$out/$1.qcow2" "$2" "$3"; }
sn_seed sn_count_huge 60 00010001                     # Too many snapshots
sn_seed sn_count_high 60 00000003                     # a third entry of zeroes
sn_seed sn_table_past_eof 64 0000000000100000         # entries of zeroes
sn_seed sn_table_unaligned 64 000000000000c200        # offset invalid
sn_seed sn_table_offset_huge 64 7ffffffffffff000      # offset invalid
sn_seed sn_table_on_header 64 0000000000000000        # the header as entries
sn_seed sn_table_on_l1 64 0000000000003000            # the L1 table as entries
sn_seed sn_table_on_reftable 64 0000000000001000      # the refcount table
sn_seed sn_id_long $((0xc00c)) ffff                   # a's id runs over b's entry
sn_seed sn_name_long $((0xc056)) ffff                 # b's name runs past EOF
sn_seed sn_extra_huge $((0xc024)) ffffffff            # Too much extra metadata
sn_seed sn_l1_unaligned $((0xc000)) 0000000000007200  # a: L1 not aligned
sn_seed sn_l1_past_eof $((0xc000)) 0000000000100000   # a: L1 past the end
sn_seed sn_l1_size_huge $((0xc048 + 8)) 10000000      # b: L1 too large
sn_seed sn_id_duplicate $((0xc048 + 64)) 31           # b's id "2" -> "1"
# Tables rewritten whole (entry sizes change): sn_extra_short, a's extra
# data cut to 0 bytes and b's to 8 (v3 wants 16: check reports, -r all
# fills in); sn_name_65535, b named with 65535 bytes (qemu-img's longest
# name is 255, so the table is written here).
sn_rewrite() {
  cp "$sn" "$out/$1.qcow2"
  python3 - "$out/$1.qcow2" "$1" <<'PY'
import struct, sys
path, what = sys.argv[1], sys.argv[2]
d = bytearray(open(path, 'rb').read())
nb, off = struct.unpack('>IQ', d[60:72])
entries, p = [], off
for _ in range(nb):
    p = (p + 7) & ~7
    h = list(struct.unpack('>QIHHIIQII', d[p:p + 40]))
    es, il, nl = h[8], h[2], h[3]
    entries.append([h, d[p + 40:p + 40 + es], d[p + 40 + es:p + 40 + es + il],
                    d[p + 40 + es + il:p + 40 + es + il + nl]])
    p += 40 + es + il + nl
if what == 'sn_extra_short':
    entries[0][1] = b''
    entries[1][1] = entries[1][1][:8]
else:
    entries[1][3] = b'n' * 65535
t = bytearray()
for h, extra, ident, name in entries:
    t += bytes((-len(t)) % 8)
    h[2], h[3], h[8] = len(ident), len(name), len(extra)
    t += struct.pack('>QIHHIIQII', *h) + extra + ident + name
d[off:] = t
open(path, 'wb').write(bytes(d))
PY
}
sn_rewrite sn_extra_short
sn_rewrite sn_name_65535
