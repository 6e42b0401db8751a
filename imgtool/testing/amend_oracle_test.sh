#!/usr/bin/env bash
# Oracle test for amend: imgtool and qemu-img 7.2 amend copies of the same
# qcow2 images; stdout, stderr, exit status and the resulting files must be
# the same (byte for byte), and imgtool's results pass qemu-img check.
# Usage: amend_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/amend_oracle.XXXXXX")
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

# The images (made in the current directory by qemu-img and qemu-io).
v3() {  # data, a zero cluster, a preallocated zero cluster, a hole
  mk img.qcow2 4M
  qio -c 'write -P 1 0 128k' -c 'write -z 256k 64k' -c 'write -P 2 1M 64k' \
    -c 'write -z 1M 64k' -c 'write -P 3 3M 4k' img.qcow2
}
v3_backed() {  # the same over a backing file (zero clusters hide it)
  truncate -s 4M base.raw
  qio -f raw -c 'write -P 0x61 0 4M' base.raw
  mk -b base.raw -F raw img.qcow2 4M
  qio -c 'write -P 1 0 64k' -c 'write -z 128k 128k' -c 'write -P 2 1M 64k' \
    -c 'write -z 1M 64k' -c 'write -z -u 2M 64k' img.qcow2
}
v3_qcow2_backed() { mk base.qcow2 2M; mk -b base.qcow2 -F qcow2 img.qcow2 2M; }
v3_lazy() {
  mk -o lazy_refcounts=on img.qcow2 2M
  qio -c 'write -P 4 0 100k' -c 'write -z 512k 64k' img.qcow2
}
v2() {
  mk -o compat=0.10 img.qcow2 3M
  qio -c 'write -P 5 64k 200k' img.qcow2
}
v2_small() { mk -o compat=0.10,cluster_size=512 img.qcow2 300k; qio -c 'write -P 1 0 1k' img.qcow2; }
v3_small() { mk -o cluster_size=512 img.qcow2 300k; qio -c 'write -z 0 10k' -c 'write -P 1 20k 1k' img.qcow2; }
v3_2m() { mk -o cluster_size=2M img.qcow2 8M; qio -c 'write -z 2M 2M' -c 'write -P 2 0 4k' img.qcow2; }
extl2() { mk -o extended_l2=on img.qcow2 1M; }
# With an internal snapshot (made once: the snapshot's date is in the file).
mkdir -p "$WORK/tmpl"
(cd "$WORK/tmpl" && mk -o compat=0.10 img.qcow2 3M && qemu-img snapshot -c s1 img.qcow2 &&
  qio -c 'write -P 6 0 64k' img.qcow2)
v2_snap() { cp "$WORK/tmpl/img.qcow2" img.qcow2; }
rc8() { mk -o refcount_bits=8 img.qcow2 1M; }
empty() { mk img.qcow2 0; }
dirty() {  # lazy refcounts, writer killed: the dirty bit is set
  mk -o lazy_refcounts=on img.qcow2 4M
  qemu-io -c 'write -P 1 0 64k' -c 'write -z 1M 64k' -c 'sigraise 9' img.qcow2 >/dev/null 2>&1
}
compressed() { mk img.qcow2 1M; qio -c 'write -c -P 1 0 64k' -c 'write -z 512k 64k' img.qcow2; }
zstd() { mk -o compression_type=zstd img.qcow2 1M; qio -c 'write -P 1 0 64k' -c 'write -z 512k 64k' img.qcow2; }
zstd_compressed() { zstd; qio -c 'write -c -P 2 128k 64k' img.qcow2; }
prealloc() { mk -o preallocation=metadata img.qcow2 1M; qio -c 'write -z 0 128k' img.qcow2; }
raw() { truncate -s 1M img.raw; }

# amend_case SETUP ARGS...: same_effect, then qemu-img check of every qcow2
# file imgtool left behind.
amend_case() {
  same_effect "$@"
  local f
  for f in "$WORK"/effect.a/*.qcow2; do
    [[ -e "$f" ]] || continue
    # qemu-img 7.2 itself leaves some images unclean (a downgrade sets
    # OFLAG_COPIED on a zero cluster expanded in place that snapshots
    # share): then qemu-img's own result must be just as unclean.
    qemu-img check -q "$f" >/dev/null 2>&1 ||
      [[ "$(cd "$WORK/effect.a" && qemu-img check "$(basename "$f")" 2>&1)" == \
         "$(cd "$WORK/effect.b" && qemu-img check "$(basename "$f")" 2>&1)" ]] ||
      fail "$*: qemu-img check of imgtool's $(basename "$f") fails: $(qemu-img check "$f" 2>&1 | head -3)"
  done
}

# --- compat both ways --------------------------------------------------------
for setup in v3 v3_backed v3_qcow2_backed v3_lazy v3_small v3_2m empty; do
  amend_case $setup amend -o compat=0.10 img.qcow2
  amend_case $setup amend -o compat=v2 img.qcow2
  amend_case $setup amend -o compat=1.1 img.qcow2
done
for setup in v2 v2_small; do
  amend_case $setup amend -o compat=1.1 img.qcow2
  amend_case $setup amend -o compat=v3 -f qcow2 img.qcow2
  amend_case $setup amend -o compat=0.10 img.qcow2
  amend_case $setup amend -o compat=1.1,lazy_refcounts=on img.qcow2
done
amend_case v3 amend -p -o compat=0.10 img.qcow2
amend_case v2_snap amend -o compat=1.1 img.qcow2
amend_case v2_snap amend -o compat=1.1,lazy_refcounts=on,size=5M img.qcow2
for setup in compressed zstd zstd_compressed prealloc; do
  amend_case $setup amend -o compat=0.10 img.qcow2
done
amend_case v3_backed amend -p -o compat=0.10 img.qcow2
amend_case v2 amend -p -o compat=1.1 img.qcow2
amend_case v3 amend -q -p -o compat=0.10 img.qcow2
amend_case v3 amend -p -o lazy_refcounts=on img.qcow2
amend_case extl2 amend -o compat=0.10 img.qcow2
amend_case extl2 amend -p -o compat=0.10 img.qcow2
amend_case rc8 amend -o compat=0.10 img.qcow2
amend_case v3 amend -o compat=0.10,refcount_bits=8 img.qcow2
amend_case v3 amend -o compat=0.10,lazy_refcounts=on img.qcow2
amend_case v3 amend -o compat=1.0 img.qcow2

# --- lazy refcounts ----------------------------------------------------------
amend_case v3 amend -o lazy_refcounts=on img.qcow2
amend_case v3_lazy amend -o lazy_refcounts=off img.qcow2
amend_case v3_lazy amend -o lazy_refcounts=on img.qcow2
amend_case v2 amend -o lazy_refcounts=on img.qcow2
amend_case v2 amend -o lazy_refcounts=off img.qcow2
amend_case v3 amend -o lazy_refcounts=maybe img.qcow2

for opts in lazy_refcounts=off lazy_refcounts=on compat=0.10 compat=1.1 size=8M; do
  amend_case dirty amend -o $opts img.qcow2
done

# --- size --------------------------------------------------------------------
amend_case v3 amend -o size=8M img.qcow2
amend_case v3 amend -o size=2M img.qcow2
amend_case v3 amend -o size=1000 img.qcow2
amend_case v3 amend -o size=0 img.qcow2
amend_case v3_lazy amend -o size=1G,lazy_refcounts=off img.qcow2
amend_case v2 amend -o size=5M,compat=1.1 img.qcow2
amend_case v3 amend -o size=6M,compat=0.10 img.qcow2

# --- backing file: only as it is ---------------------------------------------
amend_case v3_backed amend -o backing_file=base.raw,backing_fmt=raw img.qcow2
amend_case v3_backed amend -o backing_file=base.raw img.qcow2
amend_case v3_backed amend -o backing_fmt=raw img.qcow2
amend_case v3_backed amend -o backing_file=other.raw,backing_fmt=raw img.qcow2
amend_case v3_backed amend -o backing_fmt=qcow2,backing_file=base.raw img.qcow2
amend_case v3 amend -o backing_file=base.raw img.qcow2

# --- refcount_bits -----------------------------------------------------------
amend_case v3 amend -o refcount_bits=16 img.qcow2
amend_case v3 amend -o refcount_bits=3 img.qcow2
amend_case v3 amend -o refcount_bits=128 img.qcow2
amend_case v3 amend -o refcount_bits=0 img.qcow2
amend_case v3 amend -o refcount_bits=x img.qcow2
amend_case rc8 amend -o refcount_bits=8 img.qcow2
amend_case v2 amend -o refcount_bits=8 img.qcow2

# --- options amend refuses ---------------------------------------------------
for opt in cluster_size=4k extended_l2=on extended_l2=off preallocation=full \
  compression_type=zstd encryption=on encrypt.format=luks nocow=on \
  foo=bar cluster_size=4k,foo=bar cluster_size=3x; do
  amend_case v3 amend -o "$opt" img.qcow2
done
amend_case v3 amend -o encrypt.state=active img.qcow2
amend_case v3 amend -o data_file=x img.qcow2
amend_case v3 amend -o data_file_raw=on img.qcow2
amend_case v3 amend -o data_file_raw=off img.qcow2
amend_case v3 amend -p -o cluster_size=4k img.qcow2
amend_case v3 amend -p -o compat=9 img.qcow2

# --- help, usage, other formats, bad input -----------------------------------
amend_case v3 amend -o help img.qcow2
amend_case v3 amend -f qcow2 -o help
amend_case v3 amend -f qcow2 -o '?'
amend_case v3 amend -f qcow2 -o compat=1.1,help
amend_case v3 amend -p -f qcow2 -o help
amend_case v3 amend -f raw -o help
amend_case v3 amend -f foo -o help
amend_case raw amend -o help img.raw
amend_case raw amend -f raw -o compat=1.1 img.raw
amend_case raw amend -o compat=1.1 img.raw
amend_case v3 amend img.qcow2
amend_case v3 amend -o compat=1.1
amend_case v3 amend -o compat=1.1 img.qcow2 img.qcow2
amend_case v3 amend -t bogus -o compat=1.1 img.qcow2
amend_case v3 amend -t none -o compat=0.10 img.qcow2
amend_case v3 amend -t writethrough -o lazy_refcounts=on img.qcow2
amend_case v3 amend --force -o lazy_refcounts=on img.qcow2
amend_case v3 amend -o , img.qcow2
amend_case v3 amend -o 'compat=1.1,' img.qcow2
amend_case v3 amend -o compat=1.1 missing.qcow2
amend_case v3 amend -f raw -o compat=1.1 img.qcow2
amend_case v3 amend --image-opts -o compat=0.10 driver=qcow2,file.filename=img.qcow2
amend_case v3 amend -o compat=0.10 'json:{"driver":"qcow2","file":{"driver":"file","filename":"img.qcow2"}}'

# --- an image another process has open ---------------------------------------
L="$WORK/locked"
mkdir -p "$L"
(cd "$L" && v3)
before=$(md5sum <"$L/img.qcow2")
qemu-io -c 'sleep 8000' "$L/img.qcow2" >/dev/null 2>&1 &
holder=$!
wait_until_locked "$L/img.qcow2"
same_output "$L" amend -o compat=0.10 img.qcow2
same_output "$L" amend -o lazy_refcounts=on img.qcow2
kill "$holder" 2>/dev/null
wait "$holder" 2>/dev/null
[[ "$(md5sum <"$L/img.qcow2")" == "$before" ]] ||
  fail "the locked image was changed"

# --- refcount_bits: every width both ways -----------------------------------
# Images made once (snapshot dates are in the files), copied for each case.
T="$WORK/tmpl"
(cd "$T" &&
  mk -o refcount_bits=16 snap3.qcow2 4M &&
  qio -c 'write -P 1 0 256k' -c 'write -z 512k 128k' snap3.qcow2 &&
  qemu-img snapshot -c s1 snap3.qcow2 &&
  qio -c 'write -P 2 64k 64k' -c 'write -z 1M 64k' snap3.qcow2 &&
  qemu-img snapshot -c second-snapshot snap3.qcow2 &&
  qio -c 'write -z 0 64k' -c 'write -P 3 2M 64k' snap3.qcow2)
# A snapshot whose L2 table is still shared with the active image, zero
# clusters in it, over a backing file.
(cd "$T" && truncate -s 2M base.raw && qio -f raw -c 'write -P 0x61 0 2M' base.raw &&
  mk -b base.raw -F raw shared.qcow2 2M &&
  qio -c 'write -P 1 0 64k' -c 'write -z 64k 128k' -c 'write -z -u 1M 64k' shared.qcow2 &&
  qemu-img snapshot -c s1 shared.qcow2)
(cd "$T" && mk -o compat=0.10 snap2.qcow2 3M && qio -c 'write -P 1 0 128k' snap2.qcow2 &&
  qemu-img snapshot -c s1 snap2.qcow2 && qio -c 'write -P 6 0 64k' snap2.qcow2 &&
  qemu-img snapshot -c another-one snap2.qcow2 && qio -c 'write -P 7 1M 64k' snap2.qcow2)
(cd "$T" && mk resized.qcow2 1M && qemu-img snapshot -c s1 resized.qcow2 &&
  qemu-img resize -q resized.qcow2 2M)
(cd "$T" && mk -o cluster_size=512 snap512.qcow2 1M &&
  qio -c 'write -P 1 0 300k' -c 'write -z 400k 10k' snap512.qcow2 &&
  qemu-img snapshot -c s1 snap512.qcow2 && qio -c 'write -P 2 0 50k' snap512.qcow2)

# shorten_extra FILE BYTES: rewrites every snapshot table entry in place
# with only BYTES (0 or 8) of extra data, as QEMU before 1.1 wrote them.
shorten_extra() {
  local f=$1 keep=$2 n off pos=0 out="" i id_len name_len extra
  n=$((16#$(xxd -s 60 -l 4 -p "$f")))
  off=$((16#$(xxd -s 64 -l 8 -p "$f" | tr -d '\n')))
  local src=$off
  for ((i = 0; i < n; i++)); do
    src=$(( (src + 7) / 8 * 8 ))
    while (( pos % 8 )); do out+="00"; pos=$((pos + 1)); done
    id_len=$((16#$(xxd -s $((src + 12)) -l 2 -p "$f")))
    name_len=$((16#$(xxd -s $((src + 14)) -l 2 -p "$f")))
    extra=$((16#$(xxd -s $((src + 36)) -l 4 -p "$f")))
    out+=$(xxd -s "$src" -l 36 -p "$f" | tr -d '\n')
    out+=$(printf '%08x' "$keep")
    ((keep > 0)) && out+=$(xxd -s $((src + 40)) -l "$keep" -p "$f" | tr -d '\n')
    out+=$(xxd -s $((src + 40 + extra)) -l $((id_len + name_len)) -p "$f" | tr -d '\n')
    pos=$((pos + 40 + keep + id_len + name_len))
    src=$((src + 40 + extra + id_len + name_len))
  done
  printf '%s' "$out" | xxd -r -p | dd of="$f" bs=1 seek="$off" conv=notrunc status=none
}
cp "$T/snap2.qcow2" "$T/old0.qcow2" && shorten_extra "$T/old0.qcow2" 0
cp "$T/snap2.qcow2" "$T/old8.qcow2" && shorten_extra "$T/old8.qcow2" 8
for f in old0 old8; do
  qemu-img check -q "$T/$f.qcow2" || fail "setup: $f.qcow2 is not clean"
done
snap3() { cp "$T/snap3.qcow2" img.qcow2; }
shared() { cp "$T/base.raw" "$T/shared.qcow2" .; mv shared.qcow2 img.qcow2; }
snap2() { cp "$T/snap2.qcow2" img.qcow2; }
old0() { cp "$T/old0.qcow2" img.qcow2; }
old8() { cp "$T/old8.qcow2" img.qcow2; }
resized() { cp "$T/resized.qcow2" img.qcow2; }
snap512() { cp "$T/snap512.qcow2" img.qcow2; }
compressed2() {  # compressed clusters sharing host clusters
  mk img.qcow2 2M
  qio -c 'write -c -P 1 0 64k' -c 'write -c -P 2 64k 64k' -c 'write -c -P 3 128k 64k' \
    -c 'write -P 4 1M 64k' img.qcow2
}
extl2_data() {
  mk -o extended_l2=on img.qcow2 2M
  qio -c 'write -P 1 0 4k' -c 'write -z 64k 64k' -c 'write -P 2 100k 8k' img.qcow2
}
v3_4k() { mk -o cluster_size=4k img.qcow2 8M; qio -c 'write -P 1 0 1M' -c 'write -z 2M 16k' img.qcow2; }
big512() {  # many refcount blocks: the tables grow and move
  mk -o cluster_size=512 img.qcow2 8M
  qio -c 'write -P 1 0 2M' -c 'write -P 2 6M 512k' img.qcow2
}
for width in 1 2 4 8 16 32 64; do
  rcfrom() { mk -o refcount_bits=$width img.qcow2 4M; qio -c 'write -P 9 0 192k' -c 'write -z 1M 64k' img.qcow2; }
  amend_case v3 amend -o refcount_bits=$width img.qcow2
  amend_case rcfrom amend -o refcount_bits=16 img.qcow2
  amend_case rcfrom amend -o refcount_bits=1 img.qcow2
  amend_case rcfrom amend -o refcount_bits=64 img.qcow2
  for setup in v3_small v3_4k big512 v3_lazy compressed2 extl2_data snap3; do
    amend_case $setup amend -o refcount_bits=$width img.qcow2
  done
  amend_case v2 amend -o compat=1.1,refcount_bits=$width img.qcow2
  amend_case snap2 amend -o compat=v3,refcount_bits=$width img.qcow2
done
amend_case v3 amend -p -o refcount_bits=1 img.qcow2
amend_case big512 amend -p -o refcount_bits=64 img.qcow2
amend_case v2 amend -p -o compat=1.1,refcount_bits=4 img.qcow2
amend_case rc8 amend -p -o compat=0.10,refcount_bits=16 img.qcow2
amend_case rc8 amend -o refcount_bits=16,compat=0.10,lazy_refcounts=off img.qcow2
amend_case v3 amend -o refcount_bits=2,lazy_refcounts=on,size=6M img.qcow2
amend_case dirty amend -o refcount_bits=4 img.qcow2
amend_case v3_backed amend -o refcount_bits=32 img.qcow2
amend_case v3 amend -o refcount_bits=16,refcount_bits=8 img.qcow2
amend_case v3 amend -o refcount_bits=0x8 img.qcow2
amend_case v3 amend -o refcount_bits=-8 img.qcow2
amend_case v3 amend -o refcount_bits=65 img.qcow2
amend_case v3 amend -o compat=0.10,refcount_bits=1 img.qcow2
amend_case snap2 amend -o refcount_bits=8 img.qcow2
# Refcounts too large for the new width.
amend_case compressed2 amend -o refcount_bits=1 img.qcow2
amend_case snap3 amend -o refcount_bits=1 img.qcow2
amend_case snap3 amend -p -o refcount_bits=1 img.qcow2
amend_case snap2 amend -o compat=1.1,refcount_bits=1 img.qcow2

# --- snapshots across versions -----------------------------------------------
for setup in snap3 shared snap512 resized; do
  amend_case $setup amend -o compat=0.10 img.qcow2
  amend_case $setup amend -p -o compat=0.10 img.qcow2
done
amend_case snap3 amend -o compat=0.10,lazy_refcounts=off img.qcow2
amend_case shared amend -o compat=0.10,size=2M img.qcow2
for setup in old0 old8 snap2; do
  amend_case $setup amend -o compat=1.1 img.qcow2
  amend_case $setup amend -p -o compat=1.1 img.qcow2
  amend_case $setup amend -o compat=1.1,lazy_refcounts=on img.qcow2
  amend_case $setup amend -o compat=1.1,refcount_bits=2 img.qcow2
  amend_case $setup amend -o compat=0.10 img.qcow2
done

# --- a refcount width change killed midway -------------------------------------
# The header names either the old refcount structures or the new ones: a
# kill at any point leaves at most leaked clusters (qemu-img check exit 3).
K="$WORK/killed"
mkdir -p "$K"
(cd "$K" && mk -o cluster_size=512 src.qcow2 64M && qio -c 'write -P 1 0 24M' -c 'write -P 2 40M 8M' src.qcow2)
mid=0
for delay in 0.01 0.02 0.04 0.06 0.08 0.1 0.15 0.2 0.3 0.5; do
  for bits in 1 64; do
    checks=$((checks + 1))
    cp "$K/src.qcow2" "$K/img.qcow2"
    "$IMGTOOL" amend -o refcount_bits=$bits "$K/img.qcow2" >/dev/null 2>&1 &
    pid=$!
    sleep "$delay"
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    wait_until_unlocked "$K/img.qcow2"
    qemu-img check "$K/img.qcow2" >"$K/check.out" 2>&1
    rc=$?
    [[ $rc -eq 0 || $rc -eq 3 ]] ||
      fail "refcount_bits=$bits killed after ${delay}s: qemu-img check exit $rc: $(head -5 "$K/check.out")"
    [[ $rc -eq 3 ]] && mid=$((mid + 1))
    qemu-img compare -q "$K/src.qcow2" "$K/img.qcow2" ||
      fail "refcount_bits=$bits killed after ${delay}s: guest data changed"
  done
done
echo "killed rebuilds that left leaked clusters: $mid of 20"
finish
