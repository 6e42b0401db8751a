#!/bin/bash
# qemu-io 7.2's session commands against imgtool run as qemu-io (a link
# named qemu-io, so names and prompts are the same): open, close, reopen,
# -s (snapshot mode), sigraise, abort, help texts and the interactive mode
# (commands from standard input, with prompts). Each case runs on copies of
# the same files; stdout, stderr, the exit status and the files left behind
# must be identical (timing figures removed).
# Usage: io_session_oracle_test.sh IMGTOOL
set -u

IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/io_session.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin"
ln -s "$IMGTOOL" "$WORK/bin/qemu-io"
# -s puts its temporary overlay in $TMPDIR, as QEMU does; both tools must
# leave nothing behind there.
export TMPDIR="$WORK/tmp"
mkdir -p "$TMPDIR"
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi

normalize() {
  sed -E \
    -e 's/[0-9]+:[0-9]{2}:[0-9]{2}\.[0-9]{2}|[0-9]{2}\.[0-9]{2} sec/T/g' \
    -e 's/\(([0-9.]+ [A-Za-z]+)\/sec and [0-9.]+ ops\/sec\)/(R)/g' \
    -e 's/vl\.[A-Za-z0-9]{6}/vl.XXXXXX/g' \
    -e 's/#block[0-9]{3,}/NODE_NAME/g' "$1"
}

setup() {
  qemu-img create -q -f raw "$1/r.raw" 1M
  qemu-img create -q -f qcow2 "$1/q.qcow2" 1M
  qemu-img create -q -f qcow2 -o lazy_refcounts=on "$1/l.qcow2" 1M
  qemu-img create -q -f qcow2 -b q.qcow2 -F qcow2 "$1/top.qcow2" 1M
  qemu-io -f qcow2 -c 'write -P 5 0 64k' "$1/q.qcow2" >/dev/null
  qemu-img create -q -f qcow2 -o cluster_size=4k "$1/v.qcow2" 1M
  qemu-img create -q -f qcow2 -o extended_l2=on "$1/e.qcow2" 100M
}

# check NAME INPUT ARGS...: runs `qemu-io ARGS <INPUT` with both tools (INPUT
# a file of commands, or /dev/null).
check() {
  local name=$1 input=$2
  shift 2
  checks=$((checks + 1))
  local q="$WORK/$checks/qemu" i="$WORK/$checks/imgtool"
  mkdir -p "$q" "$i"
  setup "$q"
  cp -a "$q/." "$i/"
  (cd "$q" && exec qemu-io "$@" <"$input" >"$WORK/q.out" 2>"$WORK/q.err")
  local q_rc=$?
  (cd "$i" && exec "$WORK/bin/qemu-io" "$@" <"$input" >"$WORK/i.out" \
    2>"$WORK/i.err")
  local i_rc=$?
  same_streams "$name" "$q_rc" "$i_rc"
  local f
  for f in $(cd "$q" && ls -A); do
    if [[ -n ${PREFIX_ONLY:-} ]]; then
      # Killed before close: imgtool's file may still be grown ahead
      # (posix_file), so the bytes up to qemu-io's end are compared, and
      # what qemu-img check makes of both.
      if ! cmp -s -n "$(stat -c %s "$q/$f")" "$q/$f" "$i/$f" ||
         [[ "$(qemu-img check "$q/$f" 2>&1)" != \
            "$(qemu-img check "$i/$f" 2>&1 | sed "s|$i/|$q/|")" ]]; then
        echo "FAIL: $name: $f differs after the commands"
        failures=$((failures + 1))
      fi
      continue
    fi
    if ! cmp -s "$q/$f" "$i/$f"; then
      echo "FAIL: $name: $f differs after the commands"
      failures=$((failures + 1))
    fi
  done
  if [[ -n "$(ls -A "$TMPDIR")" ]]; then
    echo "FAIL: $name: left files in TMPDIR: $(ls -A "$TMPDIR")"
    failures=$((failures + 1))
    rm -rf "${TMPDIR:?}"/*
  fi
}

N=/dev/null

# --- help: the list, each command's text, aliases, unknown commands.
check "help" $N -c help
for c in abort aio_flush aio_read aio_write alloc break close discard flush \
    help info length map open quit read readv remove_break reopen resume \
    sigraise sleep truncate wait_break write writev o c q '?' a d f i l r t w \
    multiwrite nosuch; do
  check "help $c" $N -c "help $c"
done

# --- no image: which commands need one; argument counts come after.
check "no image" $N -c 'read 0 1' -c read -c close -c reopen -c 'break a b' \
  -c sleep -c sigraise -c 'sleep 1' -c length

# --- open and close.
check "close twice" $N -f raw r.raw -c close -c close -c 'read 0 1'
check "open while open" $N -c 'open -r r.raw' -c 'open r.raw' -c 'write 0 1'
check "open -o driver=raw" $N -c 'open -o driver=raw r.raw' -c info \
  -c 'write -P 3 0 1k' -c 'read -P 3 0 1k'
check "open -o driver=file" $N -c 'open -o driver=file r.raw' -c info
check "open -o wrong driver" $N -c 'open -o driver=qcow2 r.raw' -c length
check "open -o without path" $N -c 'open -o driver=raw'
check "open -o filename" $N -c 'open -o driver=raw,file.filename=r.raw' \
  -c length
check "open -o unknown key" $N -c 'open -o driver=raw,foo=bar r.raw'
check "open -o qcow2 in qcow2" $N \
  -c 'open -o driver=qcow2,file.driver=qcow2,file.file.filename=q.qcow2' \
  -c 'read -P 0 0 64k' -c length
check "open without path" $N -c 'open -r' -c open -c 'open a b'
check "open -U read-write" $N -c 'open -U r.raw'
check "open bad -t -d -i" $N -c 'open -t foo r.raw' -c 'open -d foo r.raw' \
  -c 'open -i foo r.raw'
check "open missing file" $N -c 'open nonexist' -c 'read 0 1'
check "open alias, then read" $N -c 'o -r -U q.qcow2' -c 'read -P 5 0 64k' \
  -c 'c' -c 'o -n top.qcow2' -c 'read -P 5 0 64k' -c 'write -P 6 4k 4k' \
  -c map
check "open probed raw writes" $N -c 'open r.raw' -c 'write 0 1'
check "--image-opts open" $N --image-opts \
  -c 'open driver=raw,file.filename=r.raw' -c length -c close \
  -c 'open driver=raw,file.filename=nonex' -c 'open -o driver=raw r.raw'
check "open -C" $N -c 'open -r -C q.qcow2'

# --- reopen.
check "reopen -r -w" $N -f qcow2 q.qcow2 -c 'reopen -r' -c 'write 0 64k' \
  -c 'reopen -w' -c 'write -P 7 0 64k' -c 'read -P 7 0 64k' -c map
check "reopen from -r" $N -r -f qcow2 q.qcow2 -c 'write 0 64k' \
  -c 'reopen -w' -c 'write 64k 64k' -c 'reopen -r' -c 'write 0 1'
check "reopen option errors" $N -f raw r.raw -c 'reopen -r -w' \
  -c 'reopen -c foo' -c 'reopen x' -c 'reopen -o foo=bar' \
  -c 'reopen -o node-name=x' -c 'reopen -o driver=raw' \
  -c 'reopen -o driver=file' -c 'reopen -o file.driver=file' \
  -c 'reopen -o file.driver=raw'
check "reopen read-only option" $N -f raw -r r.raw \
  -c 'reopen -o read-only=off' -c 'write 0 1' -c 'reopen -w -o read-only=on' \
  -c 'reopen -o read-only=foo' -c 'reopen -c none -o cache.direct=on' \
  -c 'reopen -o cache.no-flush=bar' -c 'reopen -o auto-read-only=qux' \
  -c 'reopen -o cache.direct=baz'
check "reopen cache modes" $N -f qcow2 q.qcow2 -c 'reopen -c writeback' \
  -c 'reopen -c none' -c 'write 0 4k' -c 'reopen -o cache.direct=on' \
  -c 'read 0 4k'
check "reopen lazy-refcounts" $N -f qcow2 q.qcow2 \
  -c 'reopen -o lazy-refcounts=on' -c 'write 0 64k' \
  -c 'reopen -o lazy-refcounts=off' -c 'write 64k 64k'

# --- -s: writes go to a temporary overlay, never to the image.
check "-s raw" $N -s -f raw r.raw -c 'write -P 1 0 64k' -c 'read -P 1 0 64k' \
  -c info -c map
check "-s qcow2" $N -s -f qcow2 q.qcow2 -c 'write -P 1 64k 64k' \
  -c 'read -P 5 0 64k' -c 'read -P 1 64k 64k' -c map -c length
check "-s probed, -r -s" $N -s q.qcow2 -c 'write 0 1'
check "-r -s" $N -r -s -f raw r.raw -c 'write 0 1' -c info
check "-s missing file" $N -s nonexist -c 'write 0 1'
# reopen with -s: QEMU opens the unlinked overlay again by name (and fails)
# when read-only or O_DIRECT is involved, and on every reopen after the
# first; the image stays open as it was.
check "-s reopen -r" $N -s -f qcow2 top.qcow2 -c 'reopen -r' \
  -c 'reopen -c none' -c 'reopen -o read-only=on' -c 'write -P 3 0 4k' \
  -c 'read -P 3 0 4k' -c map
check "-s reopen -c" $N -s -f qcow2 top.qcow2 -c 'reopen -c writeback' \
  -c 'reopen -c writethrough' -c 'write -P 3 0 4k' -c 'read -P 3 0 4k'
check "-s reopen -w" $N -s -f qcow2 top.qcow2 -c 'reopen -w' -c reopen
check "-s -t none reopen" $N -s -t none -f qcow2 top.qcow2 \
  -c 'reopen -c directsync' -c 'write 0 4k'
# reopen with -C: copy-on-read stays on; read-only is refused.
check "-C reopen" $N -C -f qcow2 top.qcow2 -c 'reopen -o read-only=on' \
  -c 'reopen -r -o lazy-refcounts=on' -c 'reopen -c none' \
  -c 'read -P 5 0 4k' -c map -c 'reopen -w' -c 'read -P 5 8k 4k' -c map
check "open -s" $N -c 'open -s -o driver=raw r.raw' -c 'write 0 1' \
  -c 'read -P 0xcd 0 1' -c close -c 'open -r -f raw r.raw'

# --- read -b / write -b: qcow2's VM state area past the disk (the L1
# table grows: 4 KiB clusters map 2 MiB per L1 entry); ENOTSUP for raw.
check "vmstate qcow2" $N -f qcow2 q.qcow2 -c 'write -b -P 1 0 64k' \
  -c 'read -b -P 1 0 64k' -c 'read -b -v 64k 512' -c info -c map
check "vmstate L1 growth" $N -f qcow2 v.qcow2 -c 'write -b -P 1 0 64k' \
  -c 'write -b -P 2 4m 8k' -c 'write -b -P 3 2m 4k' -c 'read -b -P 2 4m 8k' \
  -c 'read -b -P 0 8m 4k' -c 'write -b 100m 4k' -c 'read -b -P 3 2m 4k'
check "vmstate extended L2" $N -f qcow2 e.qcow2 -c 'write -b -P 1 512 64k' \
  -c 'read -b -P 1 512 64k' -c 'read -b -P 0 0 512'
check "vmstate over a backing file" $N -f qcow2 top.qcow2 \
  -c 'write -b -P 1 512 4k' -c 'read -b -P 0 0 512' -c 'read -P 5 0 4k'
check "vmstate raw" $N -f raw r.raw -c 'write -b -P 1 0 64k' -c 'read -b 0 512'
check "vmstate read-only" $N -r -f qcow2 q.qcow2 -c 'write -b -P 1 0 64k' \
  -c 'read -b 0 512'
check "vmstate errors" $N -f qcow2 q.qcow2 -c 'write -b -P 1 1 64k' \
  -c 'read -b 0 511' -c 'write -b -z 0 512' -c 'write -b -f 0 512'
check "vmstate -s" $N -s -f qcow2 q.qcow2 -c 'write -b -P 1 0 64k' \
  -c 'read -b -P 1 0 64k'

# --- sigraise and abort (output buffered before abort is lost, as in
# qemu-io; sigraise flushes first).
check "sigraise errors" $N -f raw r.raw -c 'sigraise foo' -c 'sigraise 0' \
  -c 'sigraise 10000' -c 'sigraise -1' -c 'sigraise 1k'
check "sigraise TERM" $N -f raw r.raw -c 'write 0 1' -c 'sigraise 15'
check "sigraise KILL" $N -f raw r.raw -c 'write -P 2 0 1' -c 'sigraise 9'
check "abort" $N -f raw r.raw -c 'write 0 1' -c abort
# A dirty lazy-refcounts image killed after a write (iotest 039): the L2
# update is on disk (writethrough flushes each write) and the dirty bit set.
PREFIX_ONLY=1 check "sigraise KILL, lazy refcounts" $N -f qcow2 l.qcow2 \
  -c 'write 0 64k' -c 'write -P 1 1m 64k' -c 'sigraise 9'
PREFIX_ONLY=1 check "reopen lazy-refcounts, sigraise KILL" $N -f qcow2 \
  q.qcow2 -c 'reopen -o lazy-refcounts=on' -c 'write 64k 64k' -c 'sigraise 9'

# --- interactive mode: the same commands from standard input.
printf '%s\n' 'read 0 512' 'open r.raw' 'close' 'close' 'read 0 1' \
  'open -r r.raw' 'open r.raw' 'write 0 1' 'close' \
  'open -o driver=raw r.raw' 'aio_write -P 7 0 64k' 'close' \
  'open -r -o driver=raw r.raw' 'read -P 7 0 64k' 'help close' >"$WORK/in1"
check "interactive" "$WORK/in1" -f raw r.raw
printf '%s\n' 'open -o driver=qcow2 q.qcow2' 'read -P 5 0 64k' 'quit' \
  'read 0 1' >"$WORK/in2"
check "interactive quit" "$WORK/in2"

echo "$checks cases, $failures failures"
[[ $failures -eq 0 ]]
