#!/usr/bin/env bash
# Oracle test for the nbd client driver (nbd_block) against servers other
# than qemu-nbd (issue 19, Tests): nbdkit 1.32 (memory, sparse-random,
# pattern; its error filter injecting EIO / ENOSPC, its delay filter, and
# --no-sr for a server without structured replies) and nbd-server 3.24 (a
# config file in the test's directory exporting a raw file on a unix
# socket). imgtool and qemu-img / qemu-io 7.2 ask the same server the same:
# info, map (human and json), compare, convert out of the export (md5 of the
# result), io reads / writes / discards / zeroes (the export's content and
# map afterwards, read through qemu-img), convert -n into the export, and the
# error lines and exit statuses when the server fails requests.
# Every server runs daemonized with a pid file and is killed at the end of
# its case and on every exit path (trap): none is left running.
# Usage: nbd_interop_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/nbd_interop_oracle.XXXXXX")
# Unix socket paths must stay under 108 bytes (Bazel's TEST_TMPDIR is long).
SOCKDIR=$(mktemp -d /tmp/nbdio.XXXXXX)
cleanup() {
  stop_servers
  rm -rf "$WORK" "$SOCKDIR"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  LIBDIR="$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing"
else
  LIBDIR=$(dirname "$0")
fi
source "$LIBDIR/oracle_lib.sh" || exit 1
# stop_pid_file (its other functions are replaced below or not used).
source "$LIBDIR/nbd_lib.sh" || exit 1
stop_servers() {
  local f
  for f in "$SOCKDIR"/*.pid; do stop_pid_file "$f"; done
}
for t in qemu-img qemu-io nbdkit nbd-server; do
  command -v $t >/dev/null || { echo "$t not installed (tools/setup.sh)"; exit 1; }
done

# serve NAME SERVER ARGS...: starts SERVER (nbdkit or nbd-server) on the unix
# socket $SOCKDIR/NAME.sock, its pid in NAME.pid; returns once it listens.
# nbd-server ARGS: FILE [OPTION=VALUE...] (the export "exp" in a config file).
serve() {
  local name=$1 server=$2
  shift 2
  local sock="$SOCKDIR/$name.sock" pid="$SOCKDIR/$name.pid"
  rm -f "$sock"
  case $server in
    nbdkit)
      nbdkit -U "$sock" -P "$pid" "$@" 2>"$WORK/serve.err" ||
        echo "SETUP FAILED: nbdkit $*: $(cat "$WORK/serve.err")"
      ;;
    nbd-server)
      local file=$1 opt
      shift
      {
        printf '[generic]\nunixsock = %s\n[exp]\nexportname = %s\n' "$sock" "$(realpath "$file")"
        for opt in "$@"; do echo "${opt/=/ = }"; done
      } >"$WORK/$name.conf"
      nbd-server -C "$WORK/$name.conf" -p "$pid" 2>"$WORK/serve.err" ||
        echo "SETUP FAILED: nbd-server: $(cat "$WORK/serve.err")"
      ;;
  esac
  for _ in $(seq 250); do [[ -S "$sock" && -s "$pid" ]] && return; sleep 0.02; done
  echo "SETUP FAILED: $server $* does not listen on $sock"
}
uri() { echo "nbd+unix:///${2:-}?socket=$SOCKDIR/$1.sock"; }

# same_md5 LABEL URI: convert out of the export to raw: the same data.
same_md5() {
  checks=$((checks + 1))
  rm -f i.raw q.raw
  "$IMGTOOL" convert -f raw -O raw "$2" i.raw 2>i.err &&
    qemu-img convert -f raw -O raw "$2" q.raw 2>q.err &&
    cmp -s i.raw q.raw ||
    fail "$1: convert -O raw: $(cat i.err q.err) files differ"
}

# writes LABEL COMMAND...: serves ${SERVER[@]} twice (a fresh server each,
# for nbd-server a fresh copy of ${EXPORT_FILE}); qemu-img / qemu-io run
# COMMAND against one, imgtool [io] against the other (@T@ in COMMAND is
# the URI); stdout, stderr, exit status and the export's content and map
# afterwards (read by qemu-img) must be the same.
writes() {
  local label=$1 side uri
  shift
  for side in q i; do
    if [[ ${SERVER[0]} == nbd-server ]]; then
      cp "$EXPORT_FILE" "$WORK/w.$side.img"
      serve "w$side" nbd-server "$WORK/w.$side.img" "${SERVER[@]:1}"
      uri=$(uri "w$side" exp)
    else
      serve "w$side" "${SERVER[@]}"
      uri=$(uri "w$side")
    fi
    local args=("${@//@T@/$uri}")
    if [[ $side == q ]]; then
      "${args[@]}" >"$WORK/$label.q.out" 2>"$WORK/$label.q.err"
    else
      case ${args[0]} in
        qemu-img) "$IMGTOOL" "${args[@]:1}" ;;
        qemu-io) "$IMGTOOL" io "${args[@]:1}" ;;
      esac >"$WORK/$label.i.out" 2>"$WORK/$label.i.err"
    fi
    echo $? >"$WORK/$label.$side.rc"
    sed -i "s|$uri|@T@|g" "$WORK/$label.$side.out" "$WORK/$label.$side.err"
    # The export afterwards, through qemu-img (the error filter, if any,
    # is the server's: read what it lets through).
    qemu-img map --output=json -f raw "$uri" >"$WORK/$label.$side.map" 2>&1
    rm -f "$WORK/$label.$side.raw"
    qemu-img convert -f raw -O raw "$uri" "$WORK/$label.$side.raw" 2>/dev/null
    stop_servers
  done
  checks=$((checks + 1))
  local f
  for f in out err; do
    normalize_io "$WORK/$label.q.$f" | sed -e 's/qemu-img: /imgtool: /' \
      -e '/^Run completed in /d' >"$WORK/$label.q.$f.n"
    normalize_io "$WORK/$label.i.$f" | sed '/^Run completed in /d' \
      >"$WORK/$label.i.$f.n"
    cmp -s "$WORK/$label.q.$f.n" "$WORK/$label.i.$f.n" || {
      fail "$label: std$f differs (< qemu, > imgtool)"
      diff "$WORK/$label.q.$f.n" "$WORK/$label.i.$f.n" | head -10
    }
  done
  cmp -s "$WORK/$label.q.rc" "$WORK/$label.i.rc" ||
    fail "$label: exit $(cat "$WORK/$label.i.rc"), qemu's $(cat "$WORK/$label.q.rc")"
  cmp -s "$WORK/$label.q.map" "$WORK/$label.i.map" ||
    fail "$label: the export's maps differ"
  cmp -s "$WORK/$label.q.raw" "$WORK/$label.i.raw" ||
    fail "$label: the export's contents differ"
}

cd "$WORK" || exit 1
qemu-img create -q -f qcow2 src.qcow2 4M
qio -c 'write -P 0x5c 0 200k' -c 'write -z 1M 1M' -c 'write -P 0x6d 3M 12k' src.qcow2
IO_RW=(-c 'write -P 0x42 0 64k' -c 'read -P 0x42 0 64k' -c 'write -P 0x43 100k 3k'
  -c 'read -v 100k 32' -c 'discard 2M 64k' -c 'read -P 0 2M 64k'
  -c 'write -z 3M 128k' -c 'write -z -u 2560k 64k' -c 'flush'
  -c 'aio_write -P 0x44 1M 4k' -c 'aio_flush' -c 'read -P 0x44 1M 4k'
  -c 'write 4M 512' -c 'read 4190000 10000')

# --- nbdkit sparse-random: data runs and holes ---------------------------
serve sr nbdkit sparse-random 64M seed=42 percent=25 runlength=262144
U=$(uri sr)
same_output . info "$U"
same_output . info --output=json "$U"
same_output . map "$U"
same_output . map --output=json "$U"
same_output . map --output=json --start-offset=1M --max-length=5M "$U"
same_md5 sparse-random "$U"
same_output . convert -O qcow2 "$U" sr.qcow2
checks=$((checks + 1))
"$IMGTOOL" convert -f raw -O qcow2 "$U" a.qcow2 &&
  qemu-img convert -f raw -O qcow2 "$U" b.qcow2 && cmp -s a.qcow2 b.qcow2 ||
  fail "sparse-random: convert -O qcow2: files differ"
same_output . compare "$U" b.qcow2
stop_servers

# --- nbdkit pattern (8-byte big-endian offsets), read-only ----------------
serve pat nbdkit -r pattern 4M
U=$(uri pat)
same_output . info "$U"
same_output . map --output=json "$U"
same_md5 pattern "$U"
io_pair true -r -f raw -c 'read -v 8 16' -c 'read -v 1048568 24' -c 'read 4M 1' "$U"
run "$IMGTOOL" . io -f raw -c 'write 0 512' "$U"
a_err=$ERR a_rc=$RC
run qemu-io . -f raw -c 'write 0 512' "$U"
checks=$((checks + 1))
diff_text "io write on nbdkit -r" stderr "$a_err" "${ERR//qemu-io/imgtool}" &&
  diff_text "io write on nbdkit -r" "exit status" "$a_rc" "$RC"
same_output . convert -n -f qcow2 -O raw src.qcow2 "$U"
stop_servers

# --- nbdkit without structured replies (--no-sr): no block status --------
serve nosr nbdkit --no-sr sparse-random 16M seed=7 percent=30 runlength=65536
U=$(uri nosr)
same_output . map --output=json "$U"
same_output . map "$U"
same_md5 no-sr "$U"
stop_servers

# --- nbdkit memory: writes, the export's content afterwards ---------------
SERVER=(nbdkit memory 4M)
writes mem-io qemu-io -f raw "${IO_RW[@]}" @T@
writes mem-convert-n qemu-img convert -n -f qcow2 -O raw src.qcow2 @T@
writes mem-bench qemu-img bench -w -c 64 -d 16 -s 4k -S 8k -f raw @T@
# The delay filter (slow storage): the same results, in flight together.
SERVER=(nbdkit --filter=delay memory 4M delay-read=20ms delay-write=20ms
  delay-zero=20ms delay-trim=20ms delay-extents=20ms)
writes delay-io qemu-io -f raw "${IO_RW[@]}" @T@

# --- nbdkit's error filter: injected errors, every request of the kind ----
# Reads fail: io read, convert, compare, map (extents fine). 1 MiB: one
# chunk of convert (qemu-img prints the error of every read in flight, in
# the order the server answers them).
serve er nbdkit --filter=error pattern 1M error-pread=EIO error-pread-rate=100%
U=$(uri er)
same_output . convert -f raw -O raw "$U" er.raw
same_output . compare -f raw "$U" src.qcow2
same_output . map --output=json "$U"
io_pair true -r -f raw -c 'read 0 4k' -c 'read -P 0 512k 64k' -c 'write -P 1 0 4k' "$U"
stop_servers
# Block status fails.
serve ee nbdkit --filter=error sparse-random 4M seed=3 error-extents=EIO error-extents-rate=100%
U=$(uri ee)
same_output . map --output=json "$U"
same_output . map "$U"
same_output . convert -f raw -O raw "$U" ee.raw
stop_servers
# Writes fail with EIO, with ENOSPC; zeroes and trims fail.
SERVER=(nbdkit --filter=error memory 4M error-pwrite=EIO error-pwrite-rate=100%)
writes err-write-io qemu-io -f raw -c 'write -P 1 0 4k' -c 'aio_write -P 2 64k 4k' \
  -c 'aio_flush' -c 'read -P 0 0 4k' -c 'write -z 8k 4k' @T@
writes err-write-convert qemu-img convert -n -f qcow2 -O raw src.qcow2 @T@
SERVER=(nbdkit --filter=error memory 4M error-pwrite=ENOSPC error-pwrite-rate=100%)
writes err-enospc-io qemu-io -f raw -c 'write -P 1 0 4k' @T@
SERVER=(nbdkit --filter=error memory 4M error-zero=EIO error-zero-rate=100%
  error-trim=EIO error-trim-rate=100%)
writes err-zero-trim qemu-io -f raw -c 'write -z 0 64k' -c 'discard 64k 64k' \
  -c 'write -P 3 128k 4k' @T@

# --- nbd-server: a raw file in a config file's export ---------------------
qemu-img create -q -f raw ns.raw 4M
qio -f raw -c 'write -P 0xab 0 1M' -c 'write -P 0xcd 3M 64k' ns.raw
serve ns nbd-server ns.raw
U=$(uri ns exp)
same_output . info "$U"
same_output . info --output=json "$U"
same_output . map "$U"
same_output . map --output=json "$U"
same_md5 nbd-server "$U"
same_output . compare "$U" ns.raw
same_output . info "$(uri ns nope)"
stop_servers
EXPORT_FILE=ns.raw
SERVER=(nbd-server trim=true flush=true fua=true)
writes ns-io qemu-io -f raw "${IO_RW[@]}" @T@
SERVER=(nbd-server readonly=true)
writes ns-readonly qemu-io -f raw -c 'read -P 0xab 0 4k' -c 'write 0 4k' @T@

finish
