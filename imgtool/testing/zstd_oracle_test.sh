#!/usr/bin/env bash
# Oracle test for qcow2 images with compression_type=zstd (qcow2 spec,
# header byte 104 and incompatible feature bit 3), written by qemu-io 7.2
# with `write -c`: cluster sizes 4k..2M, extended L2 off and on, single and
# multi-cluster compressed writes, incompressible clusters (written
# uncompressed by QEMU), partial overwrites of compressed clusters, and a
# backing chain. imgtool must read them as qemu-img does (convert -O raw,
# io read -P, compare) and print the same check, map and info; a damaged
# zstd cluster must fail the same way in `io` as in qemu-io; `convert -c -o
# compression_type=zstd` must make the same file as qemu-img's.
# Usage: zstd_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/zstd_oracle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi

D="$WORK/images"
mkdir -p "$D"
cd "$D" || exit 1
head -c 2M /dev/urandom >random.bin
# Half random, half zero: compresses to about half a cluster.
python3 -c 'import sys; d=open("random.bin","rb").read(); sys.stdout.buffer.write(b"".join(d[i:i+2048]+bytes(2048) for i in range(0, 1<<21, 2048)))' >half.bin
qio() { qemu-io "$@" >/dev/null || fail "setup: qemu-io $*"; }
mk() { qemu-img create -q -f qcow2 "$@" || fail "setup: qemu-img create $*"; }

images=()
for cs in 4096 65536 2097152; do
  for ext in off on; do
    ((cs < 16384)) && [[ $ext == on ]] && continue  # extended L2 needs >= 16k
    f=z-$cs-$ext.qcow2
    # 12 clusters, at least 9M: a short last cluster for the small sizes.
    size=$((cs * 12 > 9 << 20 ? cs * 12 : (9 << 20) - 1024))
    mk -o compression_type=zstd,cluster_size=$cs,extended_l2=$ext "$f" $size
    # One cluster, several clusters in one write, an incompressible cluster
    # (QEMU writes it uncompressed), mixed data, a normal write into a
    # compressed cluster (QEMU copies the rest of the cluster out of it),
    # and the short last cluster.
    last=$(((size - 1) / cs * cs))
    qio -f qcow2 -c "write -c -P 7 0 $cs" -c "write -c -P 9 $((cs * 2)) $((cs * 3))" \
      -c "write -c -s random.bin $((cs * 8)) $cs" \
      -c "write -c -s half.bin $((cs * 9)) $((cs * 2))" \
      -c "write -c -P 11 $((cs * 6)) $cs" -c "write -P 12 $((cs * 6 + 1000)) 3000" \
      -c "write -c -P 13 $last $((size - last))" "$f"
    images+=("$f")
  done
done
# zstd layers over a zstd base with compressed clusters, and a zlib layer.
mk -o compression_type=zstd base.qcow2 4M
qio -f qcow2 -c 'write -c -P 21 0 1M' -c 'write -c -s half.bin 2M 256k' base.qcow2
mk -o compression_type=zstd -b base.qcow2 -F qcow2 top.qcow2
qio -f qcow2 -c 'write -c -P 22 512k 128k' -c 'write -P 23 100k 5k' \
  -c 'write -c -s half.bin 3M 128k' top.qcow2
mk -b top.qcow2 -F qcow2 zlib-top.qcow2
qio -f qcow2 -c 'write -c -P 24 64k 64k' zlib-top.qcow2
images+=(base.qcow2 top.qcow2 zlib-top.qcow2)
grep -q 'compressed clusters' <(qemu-img check z-65536-off.qcow2) ||
  fail "setup: no compressed clusters"

for f in "${images[@]}"; do
  checks=$((checks + 1))
  qemu-img convert -O raw "$f" "$WORK/q.raw" || fail "qemu-img convert $f"
  "$IMGTOOL" convert -O raw "$f" "$WORK/i.raw" || fail "imgtool convert $f"
  cmp "$WORK/q.raw" "$WORK/i.raw" || fail "$f: convert -O raw differs"
  same_output "$D" compare "$f" "$WORK/q.raw"
  same_output "$D" check "$f"
  same_output "$D" check --output=json "$f"
  same_output "$D" map --output=json "$f"
  same_output "$D" info "$f"
done

# io read -P on the compressed clusters (stdout, stderr, status as qemu-io).
io_same() {
  checks=$((checks + 1))
  local q i qrc irc
  q=$(qemu-io "$@" 2>&1 | sed -E '/ ops; /d; s/^qemu-io: /imgtool: /')
  qrc=${PIPESTATUS[0]}
  i=$("$IMGTOOL" io "$@" 2>&1 | sed -E '/ ops; /d')
  irc=${PIPESTATUS[0]}
  diff_text "io $*" output "$i" "$q" && diff_text "io $*" "exit status" "$irc" "$qrc"
}
io_same -r -f qcow2 -c 'read -P 7 0 64k' -c 'read -P 9 128k 192k' \
  -c 'read -P 11 384k 1000' -c 'read -P 12 394216 3000' -c 'read -P 11 397216 2k' \
  -c 'read -P 13 9152k 63k' -c 'read -v 600k 32' -c 'read -v 512k 32' \
  z-65536-off.qcow2
io_same -r -f qcow2 -c 'read -P 7 0 4k' -c 'read -P 9 8k 12k' \
  -c 'read -P 13 9212k 3k' z-4096-off.qcow2
io_same -r -f qcow2 -c 'read -P 7 0 2M' -c 'read -P 9 4M 6M' \
  -c 'read -P 11 12M 1000' -c 'read -P 13 22M 2M' z-2097152-on.qcow2
io_same -r -f qcow2 -c 'read -P 21 0 100k' -c 'read -P 23 100k 5k' \
  -c 'read -P 22 512k 128k' -c 'read -P 21 640k 384k' -c 'read -P 24 64k 64k' \
  zlib-top.qcow2

# Writing: convert -c to compression_type=zstd makes the same file as
# qemu-img convert -c (same libzstd, QEMU 7.2's parameters, incompressible
# clusters written uncompressed), for a raw file of random, partly random,
# sparse and tiny-data clusters and for the images above; each tool's
# compare accepts the other's output.
python3 - <<'PY'
d = open("random.bin", "rb").read()
out = bytearray(6 << 20)
for i in range(0, len(out), 65536):
    k = (i >> 16) % 5
    n = {0: 65536, 1: 3000, 2: 40000, 3: 0, 4: 20}[k]
    out[i:i + n] = d[i % (1 << 20):i % (1 << 20) + n]
open("mix.raw", "wb").write(bytes(out) + d[:5000])
PY
convert_same() {  # convert_same OPTIONS SOURCE
  checks=$((checks + 1))
  rm -f "$WORK/i.qcow2" "$WORK/q.qcow2"
  "$IMGTOOL" convert -c -O qcow2 -o "$1" "$2" "$WORK/i.qcow2" ||
    fail "imgtool convert -c -o $1 $2"
  qemu-img convert -c -O qcow2 -o "$1" "$2" "$WORK/q.qcow2" ||
    fail "qemu-img convert -c -o $1 $2"
  cmp "$WORK/i.qcow2" "$WORK/q.qcow2" || fail "convert -c -o $1 $2: files differ"
  qemu-img compare -q "$2" "$WORK/i.qcow2" || fail "convert -c -o $1 $2: qemu-img compare"
  "$IMGTOOL" compare -q "$2" "$WORK/q.qcow2" || fail "convert -c -o $1 $2: imgtool compare"
  grep -q '"compression-type": "zstd"' <(qemu-img info --output=json "$WORK/i.qcow2") ||
    fail "convert -c -o $1 $2: not zstd"
}
for cs in 4096 65536 2097152; do
  convert_same compression_type=zstd,cluster_size=$cs mix.raw
done
convert_same compression_type=zstd,extended_l2=on mix.raw
convert_same compression_type=zstd z-65536-on.qcow2
convert_same compression_type=zstd,cluster_size=4096 zlib-top.qcow2

# Damaged zstd data: qemu-io fails the read with EIO, the other clusters
# still read. The first compressed cluster's data starts at the host offset
# in its L2 entry (64k clusters: bits 0..53).
host_of_first() {
  python3 - "$1" <<'PY'
import struct, sys
f = open(sys.argv[1], "rb")
h = f.read(48)
l1 = struct.unpack(">Q", h[40:48])[0]
f.seek(l1); l2 = struct.unpack(">Q", f.read(8))[0] & 0x00fffffffffffe00
f.seek(l2); e = struct.unpack(">Q", f.read(8))[0]
print(e & ((1 << 54) - 1))
PY
}
damage() {  # damage FILE OFFSET BYTES
  printf "$3" | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}
mk -o compression_type=zstd bad.qcow2 1M
qio -f qcow2 -c 'write -c -s half.bin 0 64k' -c 'write -c -P 5 64k 64k' bad.qcow2
h=$(host_of_first bad.qcow2)
cp bad.qcow2 bad-magic.qcow2; damage bad-magic.qcow2 "$h" '\x00\x00'
cp bad.qcow2 bad-data.qcow2; damage bad-data.qcow2 $((h + 4)) '\xff\xff\xff\xff\xff\xff\xff\xff'
for f in bad-magic.qcow2 bad-data.qcow2; do
  io_same -r -f qcow2 -c 'read 0 4k' -c 'read -P 5 64k 64k' -c 'read 0 64k' "$f"
  io_same -f qcow2 -c 'write -P 6 4k 4k' -c 'read -P 5 64k 64k' "$f"
  # convert fails at the same byte (imgtool adds the cause).
  run "$IMGTOOL" "$D" convert -O raw "$f" "$WORK/i.raw"
  i_rc=$RC i_err=$ERR
  run qemu-img "$D" convert -O raw "$f" "$WORK/q.raw"
  checks=$((checks + 1))
  diff_text "convert $f" "exit status" "$i_rc" "$RC"
  [[ $i_err == "${ERR%%Input/output error*}$f: compressed cluster at host offset"*" does not decompress"* ]] ||
    fail "convert $f: imgtool says $i_err, qemu-img $ERR"
done

finish
