#!/usr/bin/env bash
# Oracle test for the nbd client driver against an oldstyle NBD server whose
# greeting has transmission flags 0 (QEMU's iotest 277 runs such a server,
# nbd-fault-injector.py --classic-negotiation; libnbd 1.14 alone refuses it,
# nbd_block/oldstyle.h relays it). The server is nbd_oldstyle_server.py (a
# raw file, simple replies, one connection at a time). imgtool and
# qemu-img / qemu-io 7.2 ask the same server (or each its own copy, for
# writes) the same: info, map, compare, convert out of the export, io reads
# and writes and the file afterwards, a connection the server closes after
# a write's data without reconnect-delay (EIO) and with it (the write sent
# again on the next connection, as iotest 277), and a server with flags
# (NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH: not relayed).
# Every server is killed at the end of its case and on every exit path.
# Usage: nbd_oldstyle_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  LIBDIR="$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing"
else
  LIBDIR=$(cd "$(dirname "$0")" && pwd)
fi
source "$LIBDIR/oracle_lib.sh" || exit 1
# nbd_setup (WORK, SOCKDIR, the exit trap) and stop_pid_file; the servers'
# pid files are $SOCKDIR/NAME.pid here.
source "$LIBDIR/nbd_lib.sh" || exit 1
nbd_setup nbd_oldstyle_oracle
stop_servers() {
  local f
  for f in "$SOCKDIR"/*.pid; do stop_pid_file "$f"; done
}
for t in qemu-img qemu-io; do
  command -v $t >/dev/null || { echo "$t not installed (tools/setup.sh)"; exit 1; }
done
PY=/usr/bin/python3
[[ -x $PY ]] || PY=python3
cd "$WORK" || exit 1

# serve NAME FLAGS FILE [--drop-writes=N]: starts the oldstyle server on
# $SOCKDIR/NAME.sock exporting FILE with greeting flags FLAGS; returns once
# it listens.
serve() {
  local name=$1 flags=$2 file=$3
  shift 3
  local sock="$SOCKDIR/$name.sock"
  rm -f "$sock"
  "$PY" -S "$LIBDIR/nbd_oldstyle_server.py" "$@" "$sock" "$file" "$flags" \
    >"$WORK/$name.log" 2>&1 &
  echo $! >"$SOCKDIR/$name.pid"
  for _ in $(seq 250); do
    grep -q '^Listening on ' "$WORK/$name.log" 2>/dev/null && return
    sleep 0.02
  done
  fail "setup: oldstyle server $name does not listen: $(cat "$WORK/$name.log")"
}
uri() { echo "nbd+unix://?socket=$SOCKDIR/$1.sock"; }
opts() { echo "driver=nbd,server.type=unix,server.path=$SOCKDIR/$1.sock$2"; }

qemu-img create -q -f raw base.raw 4M
qio -f raw -c 'write -P 0x11 0 1M' -c 'write -P 0x22 2M 512k' base.raw

# --- one server, flags 0: what the tools read ------------------------------
serve r 0 base.raw
U=$(uri r)
same_output . info "$U"
same_output . info --output=json "$U"
same_output . map "$U"
same_output . map --output=json "$U"
same_output . compare "$U" base.raw
checks=$((checks + 1))
rm -f i.raw q.raw
"$IMGTOOL" convert -f raw -O raw "$U" i.raw 2>i.err &&
  qemu-img convert -f raw -O raw "$U" q.raw 2>q.err &&
  cmp -s i.raw q.raw && cmp -s i.raw base.raw ||
  fail "convert out of the export: $(cat i.err q.err) files differ"
stop_servers

# --- writes: each tool its own server on its own copy ----------------------
# writes LABEL FLAGS SERVER_OPTION OPTS COMMANDS...: qemu-io and imgtool io
# run COMMANDS (-c ...) on --image-opts "$(opts NAME)OPTS" against a fresh
# server each on a copy of base.raw; their stdout, stderr, exit status and
# the copies afterwards must be the same.
writes() {
  local label=$1 flags=$2 server_option=$3 o=$4 side
  shift 4
  for side in q i; do
    cp base.raw "w.$side.raw"
    serve "w$side" "$flags" "w.$side.raw" $server_option
    if [[ $side == q ]]; then
      timeout 60 qemu-io "$@" --image-opts "$(opts wq "$o")" >q.out 2>q.err
    else
      timeout 60 "$IMGTOOL" io "$@" --image-opts "$(opts wi "$o")" >i.out 2>i.err
    fi
    echo $? >"$side.rc"
    sed -i "s|$SOCKDIR/w$side.sock|@S@|g" "$side.out" "$side.err"
    stop_servers
  done
  checks=$((checks + 1))
  local f
  for f in out err; do
    diff_text "$label" "std$f" "$(normalize_io i.$f)" "$(normalize_io q.$f)" || return
  done
  diff_text "$label" "exit status" "$(cat i.rc)" "$(cat q.rc)" || return
  cmp -s w.i.raw w.q.raw || fail "$label: the exports' files differ"
}

IO=(-c 'read -P 0x11 0 1M' -c 'write -P 0xab 64k 300k'
  -c 'read -P 0xab 64k 300k' -c 'write -z 1M 64k' -c 'discard 2M 64k'
  -c 'flush' -c 'read -P 0x22 2M 512k' -c 'read -P 0 1M 64k'
  -c 'aio_write -P 0xcd 3M 64k' -c 'aio_flush' -c 'read -P 0xcd 3M 64k')
writes io 0 "" "" "${IO[@]}"
# Flags (HAS_FLAGS | SEND_FLUSH): libnbd reads the greeting, flush is sent.
writes io-flags 0x5 "" "" "${IO[@]}"
# The server closes the connection after the first write's data: EIO...
writes lost 0 --drop-writes=1 "" -c 'write -P 0x7 0 3M' -c 'read -P 0x11 0 64k'
# ... and with reconnect-delay the write is sent again on the next
# connection (iotest 277).
writes reconnect 0 --drop-writes=1 ",reconnect-delay=7" \
  -c 'write -P 0x7 0 3M' -c 'read -P 0x7 0 3M'

finish
