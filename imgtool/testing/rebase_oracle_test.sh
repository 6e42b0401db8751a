#!/usr/bin/env bash
# Oracle test for rebase: imgtool rebase and qemu-img 7.2 rebase run on
# copies of the same backing chains must print the same output, exit with
# the same status and leave byte-identical files (every file, backing files
# included: size, content, allocation map). Safe, unsafe (-u) and flatten
# (-b "") over raw and qcow2 chains 1 to 3 deep, compressed and zero
# clusters, subclusters, backing files shorter and longer than the overlay,
# relative names, errors; then one SIGKILL during a safe rebase.
# Usage: rebase_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/rebase_oracle.XXXXXX")
trap "${KEEP_WORK:+:} rm -rf \"$WORK\"" EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi

if ! command -v qemu-img >/dev/null; then
  echo "qemu-img not installed"
  exit 1
fi

# Every file under DIR, subdirectories included (oracle_lib.sh's state looks
# at DIR's own files only).
state() { "$ORACLE_PYTHON" -S "$ORACLE_LIB_DIR/file_state.py" --recursive "$1"; }

M="$WORK/masters"
mkdir -p "$M"
qraw() { qemu-io -f raw "$@" >/dev/null || echo "SETUP FAILED: qemu-io $*"; }
qq() { qemu-io -f qcow2 "$@" >/dev/null || echo "SETUP FAILED: qemu-io $*"; }

# c1: a raw backing file under a qcow2 overlay, and a new raw backing file
# that differs from the old one in places the overlay does and does not
# allocate.
mkdir -p "$M/c1"
(
  cd "$M/c1" || exit 1
  truncate -s 4M base.raw new.raw
  qraw -c 'write -P 0x11 0 1M' -c 'write -P 0x22 2M 1M' base.raw
  qraw -c 'write -P 0x11 0 1M' -c 'write -P 0x33 512k 128k' \
    -c 'write -P 0x33 1000k 3k' -c 'write -P 0x22 2M 1M' \
    -c 'write -z 2M 64k' -c 'write -P 0x44 3M 512k' new.raw
  mk -b base.raw -F raw ov.qcow2
  qq -c 'write -P 0x55 0 64k' -c 'write -P 0x56 600k 4k' \
    -c 'write -z 2176k 64k' ov.qcow2
  mk -o cluster_size=512 ov512.qcow2 4M
)
# c3: base.qcow2 (compressed clusters) <- mid.qcow2 (data, zero clusters)
# <- top.qcow2, and a raw file equal to base in parts.
mkdir -p "$M/c3"
(
  cd "$M/c3" || exit 1
  truncate -s 4M src.raw new.raw
  qraw -c 'write -P 0x11 0 1M' -c 'write -P 0x22 2M 1M' src.raw
  qemu-img convert -c -f raw -O qcow2 src.raw base.qcow2
  rm src.raw
  mk -b base.qcow2 -F qcow2 mid.qcow2
  qq -c 'write -P 0x66 256k 128k' -c 'write -z 2M 64k' \
    -c 'write -P 0x67 3082k 4k' mid.qcow2
  mk -b mid.qcow2 -F qcow2 top.qcow2
  qq -c 'write -P 0x77 0 4k' -c 'write -z 1M 64k' top.qcow2
  qraw -c 'write -P 0x11 0 1M' -c 'write -P 0x99 3584k 64k' new.raw
)
# len: backing files shorter (not a multiple of 512 bytes) and longer
# than the 4 MiB overlays; a version 2 overlay (no zero clusters).
mkdir -p "$M/len"
(
  cd "$M/len" || exit 1
  truncate -s $(((1 << 20) + 1000)) short.raw
  truncate -s 8M long.raw
  qraw -c 'write -P 0x21 0 1049576' short.raw
  qraw -c 'write -P 0x31 0 64k' -c 'write -P 0x32 3900k 600k' \
    -c 'write -P 0x33 6M 100k' long.raw
  mk -b short.raw -F raw ov_s.qcow2 4M
  qq -c 'write -P 0x41 512k 4k' ov_s.qcow2
  mk -b long.raw -F raw ov_l.qcow2 4M
  qq -c 'write -P 0x42 4000k 4k' ov_l.qcow2
  mk -o compat=0.10 -b short.raw -F raw ov_s2.qcow2 4M
  qq -c 'write -P 0x43 100k 1k' ov_s2.qcow2
)
# sub: extended L2 overlays (64 KiB clusters, 2 KiB subclusters) on c1's
# files.
mkdir -p "$M/sub"
(
  cd "$M/sub" || exit 1
  cp -a --sparse=always "$M/c1/base.raw" "$M/c1/new.raw" .
  mk -o extended_l2=on -b base.raw -F raw ov.qcow2
  qq -c 'write -P 0x51 4k 4k' -c 'write -P 0x52 70k 1k' \
    -c 'write -P 0x53 1022k 2k' ov.qcow2
  mk -o extended_l2=on,cluster_size=128k -b base.raw -F raw ov128.qcow2
  qq -c 'write -P 0x54 512k 8k' ov128.qcow2
)
# rel: the chain in a subdirectory, named relative to it.
mkdir -p "$M/rel/d"
(
  cd "$M/rel/d" || exit 1
  cp -a --sparse=always "$M/c1/base.raw" "$M/c1/new.raw" .
  mk -b base.raw -F raw ov.qcow2
  qq -c 'write -P 0x61 1M 64k' ov.qcow2
)

# odd: 7 MiB + 512 bytes, so that qemu-img's progress step is 100/3 %,
# with data every 320 KiB in the old backing file and a new one that
# differs in every other piece.
mkdir -p "$M/odd"
(
  cd "$M/odd" || exit 1
  truncate -s $(((7 << 20) + 512)) base.raw new.raw
  for i in $(seq 0 22); do
    qraw -c "write -P $((i + 1)) $((i * 320))k 32k" base.raw
    (( i % 2 )) && qraw -c "write -P $((i + 1)) $((i * 320))k 32k" new.raw
  done
  mk -b base.raw -F raw ov.qcow2
  qq -c 'write -P 0x81 1M 1M' -c 'write -P 0x82 6M 4k' ov.qcow2
)

SET=""
use() { SET=$1; }
setup() { cp -a --sparse=always "$M/$SET/." .; }
no_base() { setup; rm base.raw; }

echo "== unsafe"
use c1
same_effect setup rebase -u -b other.qcow2 -F qcow2 ov.qcow2
same_effect setup rebase -u -b new.raw -F raw ov.qcow2
same_effect setup rebase -u -b "" ov.qcow2
same_effect setup rebase -u ov.qcow2
same_effect setup rebase -u -p -b new.raw -F raw ov.qcow2
same_effect setup rebase -u -q -b new.raw -F raw ov.qcow2
same_effect setup rebase -u -b new.raw ov.qcow2
same_effect setup rebase -u -b new.raw -F foo ov.qcow2
same_effect setup rebase -u -b new.raw -F vmdk ov.qcow2
same_effect setup rebase -u -b "$(printf 'n%.0s' $(seq 376))" -F raw ov512.qcow2
same_effect setup rebase -u -b "$(printf 'n%.0s' $(seq 377))" -F raw ov512.qcow2
same_effect setup rebase -u -b "$(printf 'n%.0s' $(seq 1024))" -F raw ov.qcow2
same_effect setup rebase -u -b new.raw -F raw -f raw base.raw
same_effect setup rebase -u -f raw base.raw
same_effect no_base rebase -u -b new.raw -F raw ov.qcow2
same_effect setup rebase -u -b new.raw -F raw --image-opts \
  driver=qcow2,file.filename=ov.qcow2
use len
same_effect setup rebase -u -b long.raw -F raw ov_s2.qcow2
use sub
same_effect setup rebase -u -b new.raw -F raw ov.qcow2

echo "== safe"
use c1
same_effect setup rebase -b new.raw -F raw ov.qcow2
same_effect setup rebase -p -b new.raw -F raw ov.qcow2
same_effect setup rebase -b "" ov.qcow2
same_effect setup rebase -p -b "" ov.qcow2
same_effect setup rebase -b base.raw -F raw ov.qcow2
same_effect setup rebase -t none -T none -b new.raw -F raw -f qcow2 ov.qcow2
same_effect setup rebase -U -b new.raw -F raw ov.qcow2
same_effect setup rebase -b new.raw -F raw --image-opts \
  driver=qcow2,file.filename=ov.qcow2
use c3
same_effect setup rebase -b "" top.qcow2
same_effect setup rebase -p -b "" top.qcow2
same_effect setup rebase -b base.qcow2 -F qcow2 top.qcow2
same_effect setup rebase -p -b base.qcow2 -F qcow2 top.qcow2
same_effect setup rebase -b mid.qcow2 -F qcow2 top.qcow2
same_effect setup rebase -b new.raw -F raw top.qcow2
same_effect setup rebase -b "" mid.qcow2
same_effect setup rebase -b new.raw -F raw -f qcow2 base.qcow2
# base.qcow2 is in top's chain: that node is used, whatever -F says.
same_effect setup rebase -p -b base.qcow2 -F raw top.qcow2
use len
same_effect setup rebase -b long.raw -F raw ov_s.qcow2
same_effect setup rebase -b short.raw -F raw ov_l.qcow2
same_effect setup rebase -b "" ov_s.qcow2
same_effect setup rebase -b "" ov_l.qcow2
same_effect setup rebase -b long.raw -F raw ov_s2.qcow2
same_effect setup rebase -p -b short.raw -F raw ov_l.qcow2
use odd
same_effect setup rebase -p -b new.raw -F raw ov.qcow2
same_effect setup rebase -p -b "" ov.qcow2
use sub
same_effect setup rebase -b new.raw -F raw ov.qcow2
same_effect setup rebase -b "" ov.qcow2
same_effect setup rebase -b new.raw -F raw ov128.qcow2
use rel
same_effect setup rebase -b new.raw -F raw d/ov.qcow2
same_effect setup rebase -b d/new.raw -F raw d/ov.qcow2
# The backing file it has, named relative to d/: qemu-img's chain lookup
# resolves the already resolved name again and misses it, so it opens the
# file a second time (its walk and -p lines differ from a found one).
same_effect setup rebase -p -b base.raw -F raw d/ov.qcow2
same_effect setup rebase -p -b d/base.raw -F raw d/ov.qcow2
same_effect setup rebase -b "" d/ov.qcow2
same_effect setup rebase -u -b new.raw -F raw d/ov.qcow2
same_effect setup rebase -b nothere.raw -F raw d/ov.qcow2

echo "== errors"
use c1
same_effect setup rebase -b nothere.raw -F raw ov.qcow2
same_effect setup rebase -p -b nothere.raw -F raw ov.qcow2
same_effect setup rebase -b new.raw -F qcow2 ov.qcow2
same_effect setup rebase -b new.raw -F foo ov.qcow2
same_effect setup rebase -b new.raw ov.qcow2
same_effect setup rebase ov.qcow2
same_effect setup rebase -b new.raw -F raw
same_effect setup rebase -b new.raw -F raw ov.qcow2 new.raw
same_effect setup rebase -t bogus -b new.raw -F raw ov.qcow2
same_effect setup rebase -T bogus -b new.raw -F raw ov.qcow2
same_effect setup rebase -b new.raw -F raw -f raw base.raw
same_effect setup rebase -b "" -f raw base.raw
same_effect no_base rebase -b new.raw -F raw ov.qcow2
same_effect setup rebase -b new.raw -F raw nothere.qcow2
same_effect setup rebase -f qcow2 --image-opts -b new.raw -F raw \
  driver=qcow2,file.filename=ov.qcow2
use c3
# A loop: base would get top as its backing file, whose chain holds base.
same_effect setup rebase -b top.qcow2 -F qcow2 base.qcow2
same_effect setup rebase -b top.qcow2 -F qcow2 top.qcow2
same_effect setup rebase -b mid.qcow2 -F qcow2 mid.qcow2
same_error "$M/c1" rebase -x -b new.raw -F raw ov.qcow2

echo "== locks"
# A qcow2 new backing file another process writes: its lock keeps safe
# rebase out unless -U (the file under a raw one would share writes).
for d in la lb; do
  mkdir -p "$WORK/$d"
  cp -a --sparse=always "$M/c1/." "$WORK/$d/"
  qemu-img convert -f raw -O qcow2 "$WORK/$d/new.raw" "$WORK/$d/new.qcow2"
done
qemu-io -f qcow2 -c 'sleep 20000' "$WORK/la/new.qcow2" >/dev/null 2>&1 &
holder_a=$!
qemu-io -f qcow2 -c 'sleep 20000' "$WORK/lb/new.qcow2" >/dev/null 2>&1 &
holder_b=$!
wait_until_locked "$WORK/la/new.qcow2"
wait_until_locked "$WORK/lb/new.qcow2"
same_output "$WORK/la" rebase -b new.qcow2 -F qcow2 ov.qcow2
checks=$((checks + 1))
run "$IMGTOOL" "$WORK/la" rebase -U -b new.qcow2 -F qcow2 ov.qcow2
a_out=$OUT a_err=$ERR a_rc=$RC
run qemu-img "$WORK/lb" rebase -U -b new.qcow2 -F qcow2 ov.qcow2
diff_text "rebase -U (locked new backing file)" output \
  "$a_out$a_err$a_rc" "$OUT$ERR$RC" &&
  diff_text "rebase -U (locked new backing file)" "resulting image" \
    "$(md5sum <"$WORK/la/ov.qcow2")" "$(md5sum <"$WORK/lb/ov.qcow2")"
kill "$holder_a" "$holder_b" 2>/dev/null
wait "$holder_a" "$holder_b" 2>/dev/null

echo "== a safe rebase killed while it copies"
K="$WORK/kill"
mkdir -p "$K"
(
  cd "$K" || exit 1
  head -c 64M /dev/urandom >base.raw
  mk -b base.raw -F raw ov.qcow2
  qq -c 'write -P 0x71 1M 1M' -c 'write -z 40M 1M' ov.qcow2
  qemu-img convert -f qcow2 -O raw ov.qcow2 view.raw
)
checks=$((checks + 1))
mkfifo "$K/progress"
(cd "$K" && exec "$IMGTOOL" rebase -p -b "" ov.qcow2 >progress 2>err) &
pid=$!
killed=0
{
while IFS= read -r -d $'\r' record; do
  # "    (NN.NN/100%)": kill once a fifth is copied.
  pct=${record//[^0-9.]/}
  pct=${pct%%.*}
  if [[ -n "$pct" && "$pct" -ge 20 && $killed -eq 0 ]]; then
    kill -KILL "$pid" 2>/dev/null && killed=1
  fi
done <"$K/progress"
wait "$pid"
rc=$?
} 2>/dev/null  # not bash's "Killed" notice
if [[ $killed -ne 1 || $rc -ne 137 ]]; then
  fail "SIGKILL: imgtool was not killed while copying (rc $rc)"
else
  wait_until_unlocked "$K/ov.qcow2"
  out=$(qemu-img check "$K/ov.qcow2" 2>&1)
  crc=$?
  [[ $crc -eq 0 || $crc -eq 3 ]] || fail "SIGKILL: check exit $crc: $out"
  grep -q ERROR <<<"$out" && fail "SIGKILL: check found errors: $out"
  qemu-img info "$K/ov.qcow2" | grep -q "^backing file: base.raw " ||
    fail "SIGKILL: the header changed before the copy was done"
  qemu-img compare -f qcow2 -F raw "$K/ov.qcow2" "$K/view.raw" >/dev/null ||
    fail "SIGKILL: the guest view changed"
  # The rebase done again completes it.
  "$IMGTOOL" rebase -b "" "$K/ov.qcow2" || fail "SIGKILL: rebase again failed"
  qemu-img check "$K/ov.qcow2" >/dev/null || fail "SIGKILL: check after rebase"
  qemu-img info "$K/ov.qcow2" | grep -q '^backing file' &&
    fail "SIGKILL: still a backing file after the second rebase"
  qemu-img compare -f qcow2 -F raw "$K/ov.qcow2" "$K/view.raw" >/dev/null ||
    fail "SIGKILL: the guest view changed after the second rebase"
fi

finish
