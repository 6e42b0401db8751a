#!/usr/bin/env bash
# Oracle test on a real XFS filesystem (loop mount; needs root, so the
# target is tagged "local"): extent size hints at creation, the extra
# extent-size-hint lines of `info`, and failures on a read-only filesystem
# and in an immutable directory, compared with qemu-img 7.2.
# Usage: oracle_xfs_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi
if [[ $(id -u) -ne 0 ]] || ! command -v mkfs.xfs >/dev/null ||
  ! command -v xfs_io >/dev/null; then
  echo "SKIPPED: needs root, mkfs.xfs and xfs_io"
  exit 0
fi

BASE=$(mktemp -d "${TEST_TMPDIR:-/tmp}/oracle_xfs.XXXXXX")
MNT="$BASE/mnt"
cleanup() {
  chattr -i "$MNT/immutable" 2>/dev/null
  umount "$MNT" 2>/dev/null || umount -l "$MNT" 2>/dev/null
  rm -rf "$BASE"
}
trap cleanup EXIT
truncate -s 1G "$BASE/xfs.img"
mkfs.xfs -q "$BASE/xfs.img" || exit 1
mkdir "$MNT"
if ! mount -o loop "$BASE/xfs.img" "$MNT"; then
  echo "SKIPPED: cannot loop-mount XFS here"
  exit 0
fi
WORK="$MNT"
SCRATCH="$BASE"

extsize() { xfs_io -c extsize "$1" 2>&1; }

echo "== create: extent size hints"
nothing() { :; }
for args in "h.raw 256M" "-o extent_size_hint=4M h.raw 256M" \
  "-o extent_size_hint=0 h.raw 256M" "-o extent_size_hint=3000 h.raw 1M" \
  "-o extent_size_hint=2G h.raw 1M" \
  "-o preallocation=falloc,extent_size_hint=2M h.raw 8M" \
  "-o preallocation=full h.raw 3M" "-o extent_size_hint=5G h.raw 1M"; do
  eval same_effect nothing create "$args"
  # Same hint on both files.
  checks=$((checks + 1))
  a=$(cd "$WORK/effect.a" && [[ -f h.raw ]] && extsize h.raw)
  b=$(cd "$WORK/effect.b" && [[ -f h.raw ]] && extsize h.raw)
  diff_text "create $args" "extent size hint" "$a" "$b"
done

echo "== info with an extent size hint"
D="$WORK/files"
mkdir -p "$D"
(cd "$D" && "$IMGTOOL" create -q hint.raw 1G &&
  "$IMGTOOL" create -q -o extent_size_hint=0 nohint.raw 1G &&
  "$IMGTOOL" create -q -o extent_size_hint=4M four.raw 100M) || fail "create"
checks=$((checks + 1))
diff_text "info hint.raw" stdout "$(cd "$D" && "$IMGTOOL" info hint.raw)" \
  "$(cd "$D" && qemu-img info hint.raw)
Child node '/file':
    filename: hint.raw
    protocol type: file
    file length: 1 GiB (1073741824 bytes)
    disk size: 1 MiB
    Format specific information:
        extent size hint: 1048576"
checks=$((checks + 1))
diff_text "info --output=json four.raw" stdout \
  "$(cd "$D" && "$IMGTOOL" info -f raw --output=json four.raw)" \
  "$(cd "$D" && qemu-img info -f raw --output=json four.raw | sed '$d'),
    \"extent-size-hint\": 4194304
}"
checks=$((checks + 1))
diff_text "xfs_io extsize four.raw" "hint" "$(extsize "$D/four.raw")" \
  "[4194304] $D/four.raw"
same_output "$D" info nohint.raw
same_output "$D" info --output=json nohint.raw

echo "== map after interleaved writes"
for f in hint nohint; do
  qemu-io -f raw -c 'write -P 1 0 4k' -c 'write -P 2 12k 4k' \
    -c 'write -P 3 1M 64k' -c 'write -P 4 5000k 4k' "$D/$f.raw" >/dev/null
  same_output "$D" map $f.raw
  same_output "$D" map --output=json $f.raw
  same_output "$D" map --output=json --start-offset=5k --max-length=4M $f.raw
done

echo "== bench -n and io -k: Linux AIO (io_submit, no io_uring), same data"
B="$MNT/bench"
mkdir -p "$B"
# The calls of `syscall` in an `strace -c` summary (0 if absent).
calls() { awk -v s="$2" '$NF == s { n = $4 } END { print n + 0 }' "$1"; }
for args in "-c 2000 -d 64 -s 16k" "-c 2000 -d 64 -o 1k -s 64k"; do
  checks=$((checks + 1))
  rm -f "$B"/*.qcow2
  qemu-img create -q -f qcow2 "$B/ours.qcow2" 256M
  cp "$B/ours.qcow2" "$B/theirs.qcow2"
  strace -f -c -o "$B/trace" "$IMGTOOL" bench $args -f qcow2 -t none -n -w \
    "$B/ours.qcow2" >/dev/null 2>"$B/err" || fail "bench -n $args: $(cat "$B/err")"
  qemu-img bench $args -f qcow2 -t none -n -w "$B/theirs.qcow2" >/dev/null
  [[ $(calls "$B/trace" io_submit) -gt 0 &&
    $(calls "$B/trace" io_uring_setup) -eq 0 ]] ||
    fail "bench -n $args: not on Linux AIO: $(cat "$B/trace")"
  diff_text "bench -n $args" "qemu-img compare" \
    "$(qemu-img compare -f qcow2 -F qcow2 "$B/ours.qcow2" "$B/theirs.qcow2")" \
    "Images are identical."
done
checks=$((checks + 1))
strace -f -c -o "$B/trace" "$IMGTOOL" io -k -t none -f qcow2 \
  -c "write -P 0x5a 0 1M" -c "aio_write -P 0x6b 1M 64k" -c aio_flush \
  -c "read -P 0x6b 1M 64k" -c "read -P 0x5a 0 1M" "$B/ours.qcow2" \
  >"$B/out" 2>&1 || fail "io -k: $(cat "$B/out")"
[[ $(calls "$B/trace" io_submit) -gt 0 &&
  $(calls "$B/trace" io_uring_setup) -eq 0 ]] ||
  fail "io -k: not on Linux AIO: $(cat "$B/trace")"

echo "== immutable directory"
mkdir "$MNT/immutable"
(cd "$MNT/immutable" && qemu-img create -q -o extent_size_hint=0 old.raw 1M)
chattr +i "$MNT/immutable" || fail "chattr +i"
before=$(ls -la "$MNT/immutable"; md5sum <"$MNT/immutable/old.raw")
for args in "create new.raw 1M" "create -o preallocation=full new.raw 1M" \
  "info old.raw" "map --output=json old.raw"; do
  eval same_output "$MNT/immutable" "$args"
done
checks=$((checks + 1))
run "$IMGTOOL" "$MNT/immutable" create new.raw 1M
[[ $RC -eq 1 && "$ERR" == "imgtool: new.raw: Could not create 'new.raw': "* ]] ||
  fail "create in an immutable directory: rc=$RC $ERR"
[[ "$(ls -la "$MNT/immutable"; md5sum <"$MNT/immutable/old.raw")" == "$before" ]] ||
  fail "the immutable directory changed"
chattr -i "$MNT/immutable"

echo "== read-only filesystem"
before=$(md5sum <"$D/hint.raw"; stat -c %s "$D/hint.raw")
mount -o remount,ro "$MNT" || fail "remount ro"
for args in "create new.raw 1M" "create hint.raw 1M" "resize -f raw hint.raw 2G" \
  "resize hint.raw +1M" "info nohint.raw" "info --output=json nohint.raw" \
  "map --output=json hint.raw"; do
  eval same_output "$D" "$args"
done
mount -o remount,rw "$MNT"
[[ "$(md5sum <"$D/hint.raw"; stat -c %s "$D/hint.raw")" == "$before" ]] ||
  fail "hint.raw changed on a read-only filesystem"

finish
