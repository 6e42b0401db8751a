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

finish
