#!/usr/bin/env bash
# Oracle test of the raw foundation on real storage (loop mounts and loop
# devices; needs root, so the target is tagged "local"): a full filesystem,
# compared with qemu-img 7.2.
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
cleanup() {
  local m
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
else
  fail "cannot mount ext4"
fi

finish
