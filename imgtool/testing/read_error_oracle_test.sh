#!/usr/bin/env bash
# Oracle test for read errors: blkdebug makes every read of a qcow2 image's
# data fail with EIO (event read_aio), and compare, convert, dd, rebase,
# commit and map must print qemu-img 7.2's messages, in qemu-img's order when
# stdout and stderr go to the same file (stdout is fully buffered there, so
# the error comes before "Warning: Image size mismatch!"; iotest 074), exit
# with its status and leave the same files.
# Usage: read_error_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/read_error_oracle.XXXXXX")
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

conf() {
  cat >bd.conf <<'EOF'
[inject-error]
event = "read_aio"
errno = "5"
once ="off"
EOF
}

# a.qcow2 (1 GiB, 512 bytes of data at 512), b.qcow2 (empty, 0 bytes),
# c.qcow2 (1 GiB, empty).
images() {
  conf
  mk a.qcow2 1G
  qio -c 'write -P 102 512 512' a.qcow2
  mk b.qcow2 0
  mk c.qcow2 1G
}

# top.qcow2 over base.qcow2 named through blkdebug (its reads from the
# backing file fail); nb.qcow2 a new backing file.
chain() {
  conf
  mk base.qcow2 1M
  qio -c 'write -P 4 64k 64k' base.qcow2
  mk -u -b blkdebug:bd.conf:base.qcow2 -F qcow2 top.qcow2 1M
  qio -c 'write -P 3 0 64k' top.qcow2
  mk nb.qcow2 1M
}

# same_merged SETUP ARGS...: stdout and stderr written to one file give the
# same text and exit status with both tools.
same_merged() {
  local setup=$1
  shift
  checks=$((checks + 1))
  local a="$WORK/merged.a" b="$WORK/merged.b"
  rm -rf "$a" "$b"
  mkdir -p "$a" "$b"
  (cd "$a" && $setup)
  (cd "$b" && $setup)
  (cd "$a" && "$IMGTOOL" "$@" >"$WORK/merged.a.txt" 2>&1)
  local a_rc=$?
  (cd "$b" && qemu-img "$@" >"$WORK/merged.b.txt" 2>&1)
  local b_rc=$?
  diff_text "$* (2>&1)" "output" "$(cat "$WORK/merged.a.txt")" \
    "$(sed 's/qemu-img/imgtool/g' "$WORK/merged.b.txt")" &&
    diff_text "$* (2>&1)" "exit status" "$a_rc" "$b_rc"
}

for cmd in "compare blkdebug:bd.conf:a.qcow2 c.qcow2" \
  "compare blkdebug:bd.conf:a.qcow2 b.qcow2" \
  "compare b.qcow2 blkdebug:bd.conf:a.qcow2" \
  "compare -s blkdebug:bd.conf:a.qcow2 c.qcow2"; do
  # shellcheck disable=SC2086
  same_messages images $cmd
  # shellcheck disable=SC2086
  same_merged images $cmd
done
same_messages images compare -f qcow2 -F qcow2 blkdebug:bd.conf:a.qcow2 c.qcow2
same_messages chain compare top.qcow2 base.qcow2
same_effect images convert -O raw blkdebug:bd.conf:a.qcow2 out.raw
same_merged images convert -p -O raw blkdebug:bd.conf:a.qcow2 out.raw
same_effect chain convert -O qcow2 top.qcow2 out.qcow2
same_effect images dd if=blkdebug:bd.conf:a.qcow2 of=out.raw bs=64k count=2
same_effect chain dd if=top.qcow2 of=out.raw bs=1M
same_effect chain rebase -b nb.qcow2 -F qcow2 top.qcow2
same_effect chain rebase -b '' top.qcow2
same_merged chain rebase -p -b '' top.qcow2
same_messages chain map top.qcow2
same_effect chain commit top.qcow2

finish
