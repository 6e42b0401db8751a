#!/usr/bin/env bash
# Oracle test of the raw foundation on real storage (loop mounts and loop
# devices; needs root, so the target is tagged "local"): a full filesystem,
# create and resize on block and character devices, files too long for
# QEMU on XFS, compared with qemu-img 7.2.
# Usage: oracle_fs_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi
if [[ $(id -u) -ne 0 ]] || ! command -v mkfs.ext4 >/dev/null; then
  echo "SKIPPED: needs root and mkfs.ext4"
  exit 0
fi

BASE=$(mktemp -d "${TEST_TMPDIR:-/tmp}/oracle_fs.XXXXXX")
MOUNTS=()
LOOP=""
cleanup() {
  local m
  [[ -z "$LOOP" ]] || losetup -d "$LOOP"
  for m in "${MOUNTS[@]}"; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
  done
  rm -rf "$BASE"
}
trap cleanup EXIT
WORK="$BASE/work"
SCRATCH="$BASE"
mkdir -p "$WORK"

# mount_fs MKFS SIZE DIR: a fresh filesystem of SIZE on a loop mount at DIR.
mount_fs() {
  truncate -s "$2" "$BASE/$(basename "$3").img" &&
    $1 -q "$BASE/$(basename "$3").img" && mkdir -p "$3" &&
    mount -o loop "$BASE/$(basename "$3").img" "$3" && MOUNTS+=("$3")
}

echo "== full filesystem (40 MiB ext4)"
if mount_fs mkfs.ext4 40M "$BASE/ext4"; then
  D="$BASE/ext4"
  for mode in full falloc; do
    checks=$((checks + 1))
    run "$IMGTOOL" "$D" create -o preallocation=$mode f.raw 100M
    a_out=$OUT a_err=$ERR a_rc=$RC
    # imgtool removes the file it created; qemu-img leaves it at length 0.
    [[ ! -e "$D/f.raw" ]] || fail "create $mode on a full fs left f.raw"
    [[ $(printf '%s' "$a_err" | wc -l) -eq 1 ]] ||
      fail "create $mode on a full fs: not one line: $a_err"
    run qemu-img "$D" create -o preallocation=$mode f.raw 100M
    rm -f "$D/f.raw"
    diff_text "create $mode, full fs" stdout "$a_out" "$OUT" &&
      diff_text "create $mode, full fs" stderr "$a_err" "$ERR" &&
      diff_text "create $mode, full fs" "exit status" "$a_rc" "$RC"
  done
  (cd "$D" && qemu-img create -q -f raw g.raw 100M)
  eval same_output "$D" "resize -f raw --preallocation=full g.raw 200M"
  eval same_output "$D" "resize -f raw --preallocation=falloc g.raw 200M"
  [[ $(stat -c %s "$D/g.raw") -eq 104857600 ]] || fail "g.raw changed length"
  rm -f "$D/g.raw"
  # convert into the full filesystem: qemu-img reports the write's errno
  # alone ("error while writing at byte N: No space left on device").
  head -c 48M /dev/urandom >"$BASE/src.raw"
  # (With -W each of qemu-img's coroutines prints the error once.)
  for args in "-O raw" "-O qcow2" "-c -O qcow2" "-O qcow2 -t none"; do
    checks=$((checks + 1))
    eval run "$IMGTOOL" "$D" "convert $args $BASE/src.raw o.img"
    a_out=$OUT a_err=$ERR a_rc=$RC
    rm -f "$D/o.img"
    eval run qemu-img "$D" "convert $args $BASE/src.raw o.img"
    rm -f "$D/o.img"
    # The byte where the filesystem ran out may differ; the rest may not.
    a_err=$(printf '%s' "$a_err" | sed 's/at byte [0-9]*/at byte N/')
    ERR=$(printf '%s' "$ERR" | sed 's/at byte [0-9]*/at byte N/')
    diff_text "convert $args, full fs" stdout "$a_out" "$OUT" &&
      diff_text "convert $args, full fs" stderr "$a_err" "$ERR" &&
      diff_text "convert $args, full fs" "exit status" "$a_rc" "$RC"
  done
else
  fail "cannot mount ext4"
fi

echo "== block device (8 MiB loop device)"
truncate -s 8M "$BASE/dev.img"
LOOP=$(losetup --find --show "$BASE/dev.img")
if [[ "$LOOP" == /dev/loop* ]]; then
  fill() { yes $'\xab' | tr -d '\n' | head -c 8192 | dd of="$LOOP" conv=notrunc status=none; }
  head16k() { head -c 16384 "$LOOP" | md5sum; }
  for args in "create -f raw $LOOP 8M" "create -f raw $LOOP 4M" \
    "create -f raw $LOOP 0" "create -f raw $LOOP 16M" \
    "create -f raw -o preallocation=full $LOOP 8M" \
    "create -f raw -o preallocation=falloc $LOOP 4M"; do
    # Same output and the same first bytes left on the device.
    fill
    eval run "$IMGTOOL" "$WORK" "$args"
    a_out=$OUT a_err=$ERR a_rc=$RC a_head=$(head16k)
    fill
    eval run qemu-img "$WORK" "$args"
    checks=$((checks + 1))
    diff_text "$args" stdout "$a_out" "$OUT" &&
      diff_text "$args" stderr "$a_err" "$ERR" &&
      diff_text "$args" "exit status" "$a_rc" "$RC" &&
      diff_text "$args" "first 16 KiB" "$a_head" "$(head16k)"
  done
  for args in "8M" "16M" "4M" "--shrink 4M" "+1M" "--shrink -- -1M" "+0" \
    "--preallocation=falloc 16M" "--preallocation=full 8M"; do
    eval same_output "$WORK" "resize -f raw $LOOP $args"
  done
  eval same_output "$WORK" "resize $LOOP 16M"
  [[ $(blockdev --getsize64 "$LOOP") -eq 8388608 ]] || fail "$LOOP changed size"
else
  fail "losetup failed"
  LOOP=""
fi

echo "== huge files on XFS"
if command -v mkfs.xfs >/dev/null && mount_fs mkfs.xfs 300M "$BASE/xfs"; then
  D="$BASE/xfs"
  limit=$(((1 << 62) - (1 << 29) + (1 << 62) - (1 << 29)))  # 2^63 - 2^30
  truncate -s $limit "$D/limit.raw"
  truncate -s $((limit + 1)) "$D/over.raw"
  truncate -s 9223372036854775807 "$D/max.raw"
  for f in over.raw max.raw; do
    for args in "info -f raw $f" "info $f" "info --output=json -f raw $f" \
      "map -f raw $f" "resize -f raw $f 1M" "bench -f raw -c 1 $f"; do
      eval same_output "$D" "$args"
    done
  done
  for args in "info -f raw limit.raw" "map -f raw --output=json limit.raw"; do
    eval same_output "$D" "$args"
  done
else
  echo "SKIPPED: no XFS"
fi

echo "== character device (/dev/null)"
for args in "create -f raw /dev/null 0" "create -f raw /dev/null 1M" \
  "create -f raw -o preallocation=full /dev/null 0" \
  "resize -f raw /dev/null 1M" "resize -f raw --shrink /dev/null 0" \
  "info -f raw /dev/null"; do
  eval same_output "$WORK" "$args"
done

finish
