#!/usr/bin/env bash
# Oracle test for convert and compare: imgtool and qemu-img 7.2 run on
# copies of the same files must print the same output, exit with the same
# status and leave the same files behind (size, content, allocation map and
# disk usage), and each tool's compare must accept the other's convert.
# Usage: convert_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/convert_oracle.XXXXXX")
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

head -c 4M /dev/urandom >"$WORK/seed"
put() {  # put FILE OFFSET LENGTH: seed bytes into FILE without truncating
  dd if="$WORK/seed" of="$1" bs=1 count=0 status=none
  dd if="$WORK/seed" of="$1" iflag=count_bytes,skip_bytes oflag=seek_bytes \
    skip="$(($2 % (3 << 20)))" seek="$2" count="$3" conv=notrunc status=none
}
zeros() {  # zeros FILE OFFSET LENGTH: written (allocated) zero bytes
  dd if=/dev/zero of="$1" iflag=count_bytes oflag=seek_bytes seek="$2" \
    count="$3" conv=notrunc status=none
}
byte() {  # byte FILE OFFSET: one 0xff byte
  printf '\377' | dd of="$1" bs=1 seek="$2" conv=notrunc status=none
}

# The source layouts (run in the directory the files go to).
make_sources() {
  truncate -s 10M sparse.raw
  put full.raw 0 3M
  truncate -s 8M holes.raw
  for mib in 0 3 5 7; do put holes.raw $((mib << 20)) 192K; done
  # Zero-filled data extents, and data with zeroes scattered through it:
  # 512 bytes of data every 8 KiB, every 4 KiB, every 6 KiB, and zero runs
  # of 3.5 KiB, 4 KiB and 4.5 KiB at odd offsets.
  truncate -s 16M zeroes.raw
  put zeroes.raw 0 4K
  zeros zeroes.raw 1M 1M
  zeros zeroes.raw 3M 512K
  local i
  for i in $(seq 0 63); do put zeroes.raw $(((3 << 20) + i * 8192)) 512; done
  zeros zeroes.raw 5M 1M
  for i in $(seq 0 127); do put zeroes.raw $(((5 << 20) + i * 4096)) 512; done
  for i in $(seq 0 99); do put zeroes.raw $(((5 << 20) + 524288 + i * 6144)) 512; done
  zeros zeroes.raw 8M 2M
  put zeroes.raw $((8 << 20)) 1000
  put zeroes.raw $(((8 << 20) + 1000 + 3584)) 700
  put zeroes.raw $(((8 << 20) + 1000 + 3584 + 700 + 4096)) 300
  put zeroes.raw $(((8 << 20) + 1000 + 3584 + 700 + 4096 + 300 + 4608)) 1
  byte zeroes.raw $(((9 << 20) + 511))
  byte zeroes.raw $(((9 << 20) + 8192 + 512))
  zeros zeroes.raw $((16 << 20)) 4608  # data extent past 16M, all zero
  zeros allzero.raw 0 4608
  put odd.raw 0 3000
  truncate -s 100001 odd2.raw
  put odd2.raw 32768 4096
  truncate -s 1000 tail.raw
  put tiny.raw 0 3
  : >empty.raw
  put big_chunks.raw 0 3M     # data chunks split at 2 MiB
  zeros big_chunks.raw $((3 << 20)) 3M
  put big_chunks.raw $(((4 << 20) + 4000)) 5000
}
layouts="sparse full holes zeroes allzero odd odd2 tail tiny empty big_chunks"

S="$WORK/sources"
mkdir -p "$S"
(cd "$S" && make_sources)
# same_effect runs the shell function SETUP_FN in two fresh directories;
# `with FILES...` chooses the source files it copies there (fewer files make
# the check of the resulting files faster).
SETUP_FILES=""
with() { SETUP_FILES="$*"; }
setup_sources() {
  local f
  for f in $SETUP_FILES; do cp -a --sparse=always "$S/$f" .; done
}
# Existing targets for -n: garbage everywhere, or a fresh sparse file.
setup_targets() {
  setup_sources
  put garbage.raw 0 3M
  put garbage.raw $((3 << 20)) 3M
  put garbage.raw $((6 << 20)) 3M
  put garbage.raw $((9 << 20)) 3M
  put garbage.raw $((12 << 20)) 3M
  put garbage.raw $((15 << 20)) 3M
  truncate -s 20M blank.raw
  truncate -s 1M small.raw
}

echo "== convert: layouts and sparse sizes"
for f in $layouts; do
  with $f.raw
  same_effect setup_sources convert $f.raw out.raw
  same_effect setup_sources convert -f raw -O raw -S 0 $f.raw out.raw
  same_effect setup_sources convert -p $f.raw out.raw
done
for sparse in 512 1k 3k 8k 64k 16M 0; do
  for f in zeroes big_chunks odd2; do
    with $f.raw
    same_effect setup_sources convert -S $sparse $f.raw out.raw
  done
done

echo "== convert: options"
for opts in "-m 1" "-m 16" "-m 3 -W" "-W" "-p -q" "-q" "-t none" \
  "-T none" "-t writethrough -T directsync" "-U" "-t off" \
  "-o preallocation=falloc" "-o preallocation=full" "-o extent_size_hint=0" \
  "-o size=1M" "-o nocow=on" "-C"; do
  for f in zeroes holes; do
    with $f.raw
    # shellcheck disable=SC2086
    same_effect setup_sources convert $opts $f.raw out.raw
  done
done
with zeroes.raw full.raw
same_effect setup_sources convert -p -m 1 -S 512 zeroes.raw full.raw out.raw

echo "== convert: several sources"
with holes.raw odd.raw zeroes.raw tail.raw
same_effect setup_sources convert holes.raw odd.raw zeroes.raw tail.raw out.raw
with empty.raw tiny.raw odd2.raw
same_effect setup_sources convert empty.raw tiny.raw odd2.raw empty.raw out.raw
with full.raw holes.raw
same_effect setup_sources convert -W -m 16 full.raw holes.raw full.raw out.raw
with sparse.raw big_chunks.raw
same_effect setup_sources convert -p sparse.raw big_chunks.raw out.raw

echo "== convert: existing targets (-n)"
with zeroes.raw holes.raw odd.raw
same_effect setup_targets convert -n zeroes.raw garbage.raw
same_effect setup_targets convert -n -S 0 holes.raw garbage.raw
same_effect setup_targets convert -n -p holes.raw odd.raw garbage.raw
same_effect setup_targets convert -n zeroes.raw blank.raw
same_effect setup_targets convert -n --target-is-zero zeroes.raw blank.raw
same_effect setup_targets convert -n --target-is-zero -S 0 holes.raw blank.raw
same_effect setup_targets convert -n zeroes.raw small.raw
same_effect setup_targets convert -n zeroes.raw missing.raw

echo "== convert: errors"
with tiny.raw full.raw
for args in "" "tiny.raw" "-S 1000 tiny.raw out.raw" \
  "-S 17M tiny.raw out.raw" "-S 3x tiny.raw out.raw" \
  "-S 99999999999999999999 tiny.raw out.raw" "-m 0 tiny.raw out.raw" \
  "-m 17 tiny.raw out.raw" "-m x tiny.raw out.raw" \
  "-t foo tiny.raw out.raw" "-T foo tiny.raw out.raw" \
  "-n -o size=1M tiny.raw out.raw" "--target-is-zero tiny.raw out.raw" \
  "missing.raw out.raw" "tiny.raw missing.raw out.raw" \
  "-O foo tiny.raw out.raw" "-c -C tiny.raw out.raw" \
  "-S 4k -C tiny.raw out.raw" "-o foo=1 tiny.raw out.raw" \
  "-o preallocation=bad tiny.raw out.raw" "-o ,, tiny.raw out.raw" \
  "-o size=3x tiny.raw out.raw" "-B base.raw tiny.raw out.raw" \
  "-c tiny.raw out.raw" "--target-image-opts tiny.raw out.raw" \
  "-l snap tiny.raw out.raw" "-l snap tiny.raw full.raw out.raw" \
  "tiny.raw nodir/out.raw" "tiny.raw ''" "-o help tiny.raw out.raw" "-o help" \
  "-p missing.raw out.raw" "-p -t foo tiny.raw out.raw" \
  "--bitmaps tiny.raw out.raw" "--skip-broken-bitmaps tiny.raw out.raw"; do
  # shellcheck disable=SC2086
  same_effect setup_sources convert $args
done
same_error "$S" convert -x tiny.raw out.raw

echo "== convert: locks"
with holes.raw tiny.raw
same_effect setup_sources convert holes.raw holes.raw
same_effect setup_sources convert -n holes.raw holes.raw
L="$WORK/locked"
mkdir -p "$L"
cp -a --sparse=always "$S/holes.raw" "$L/in-use.raw"
cp -a --sparse=always "$S/tiny.raw" "$L/tiny.raw"
# qemu-io keeps the image open (and locked for writing) while it sleeps.
# (Not tested: converting onto it. qemu-io shares write on a raw image and
# qemu-img convert writes into it; imgtool's read-write opens keep other
# writers out.)
qemu-io -f raw -c 'sleep 20000' "$L/in-use.raw" >/dev/null 2>&1 &
holder=$!
wait_until_locked "$L/in-use.raw"
same_output "$L" convert in-use.raw out1.raw
same_output "$L" convert -U in-use.raw out2.raw
same_output "$L" compare in-use.raw out2.raw
same_output "$L" compare -U in-use.raw out2.raw
kill "$holder" 2>/dev/null
wait "$holder" 2>/dev/null
checks=$((checks + 1))
cmp -s "$L/in-use.raw" "$S/holes.raw" || fail "the image in use was changed"

echo "== convert: each tool's compare accepts the other's convert"
for f in $layouts; do
  checks=$((checks + 1))
  rm -f "$WORK/a.raw" "$WORK/q.raw"
  "$IMGTOOL" convert "$S/$f.raw" "$WORK/a.raw" || fail "convert $f"
  qemu-img convert -O raw "$S/$f.raw" "$WORK/q.raw" || fail "qemu convert $f"
  qemu-img compare -q -f raw -F raw "$S/$f.raw" "$WORK/a.raw" ||
    fail "qemu-img compare: $f and imgtool's copy differ"
  "$IMGTOOL" compare -q -f raw -F raw "$S/$f.raw" "$WORK/q.raw" ||
    fail "imgtool compare: $f and qemu-img's copy differ"
  cmp -s "$WORK/a.raw" "$WORK/q.raw" || fail "$f: copies differ"
done

echo "== compare"
C="$WORK/compare"
mkdir -p "$C"
(
  cd "$C" || exit 1
  cp -a --sparse=always "$S"/. .
  cp --sparse=never holes.raw holes_full.raw
  cp -a --sparse=always holes.raw holes_diff.raw
  byte holes_diff.raw $(((5 << 20) + 1000))
  cp -a --sparse=always holes.raw holes_diff0.raw
  byte holes_diff0.raw 0
  cp -a --sparse=always holes.raw holes_hole_diff.raw
  byte holes_hole_diff.raw $(((6 << 20) + 4095))
  cp -a --sparse=always holes.raw longer_zero.raw
  truncate -s 12M longer_zero.raw
  cp -a --sparse=always longer_zero.raw longer_zeroed.raw
  zeros longer_zeroed.raw $((8 << 20)) 1M
  cp -a --sparse=always longer_zero.raw longer_data.raw
  byte longer_data.raw $(((11 << 20) + 600))
  cp -a --sparse=always holes.raw shorter.raw
  truncate -s 5M shorter.raw
  truncate -s 1000 t1.raw
  truncate -s 1024 t2.raw
  put x1.raw 0 8K
  zeros x1.raw 8K 4K
  put x2.raw 0 8K
  truncate -s 12K x2.raw
  qemu-img convert -O raw zeroes.raw zeroes_copy.raw
)
pairs="holes.raw:holes.raw holes.raw:holes_full.raw
  holes.raw:holes_diff.raw holes_diff.raw:holes.raw holes.raw:holes_diff0.raw
  holes.raw:holes_hole_diff.raw holes_full.raw:holes_hole_diff.raw
  holes.raw:longer_zero.raw longer_zero.raw:holes.raw
  holes.raw:longer_zeroed.raw holes.raw:longer_data.raw
  longer_data.raw:holes.raw holes.raw:shorter.raw shorter.raw:holes.raw
  t1.raw:t2.raw tail.raw:odd.raw x1.raw:x2.raw x1.raw:x1.raw
  empty.raw:empty.raw empty.raw:tiny.raw zeroes.raw:zeroes_copy.raw
  sparse.raw:zeroes.raw"
for pair in $pairs; do
  a=${pair%%:*} b=${pair##*:}
  for opts in "" "-s" "-q" "-p" "-s -p" "-f raw -F raw -U" "-T none"; do
    # shellcheck disable=SC2086
    same_output "$C" compare $opts $a $b
  done
done
for args in "holes.raw missing.raw" "missing.raw holes.raw" \
  "-p missing.raw holes.raw" "-T foo holes.raw holes.raw" \
  "-f foo holes.raw holes.raw" "-q missing.raw holes.raw"; do
  # shellcheck disable=SC2086
  same_output "$C" compare $args
done
for args in "-x holes.raw holes.raw" "holes.raw" "holes.raw holes.raw holes.raw"; do
  # shellcheck disable=SC2086
  same_error "$C" compare $args
done

finish
