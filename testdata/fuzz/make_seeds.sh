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
