#!/usr/bin/env bash
# Oracle test for the nbd client driver (nbd_block): imgtool and qemu-img /
# qemu-io 7.2 against the same qemu-nbd servers (raw and qcow2 exports,
# read-only, unix sockets and TCP on 127.0.0.1): info, map, convert from and
# (-n) into an export, compare, io read/write/discard/zero, bench, qcow2 over
# an nbd file node, x-dirty-bitmap (bitmaps and allocation depth read as
# block status), open-timeout and reconnect-delay, and the errors (no server, wrong export, bad URIs and
# options, read-only export opened for writing).
# Every qemu-nbd is started with --fork (it returns once it listens) and
# killed at the end of its case and on every exit path (trap): none is left
# running.
# Usage: nbd_client_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/nbd_client_oracle.XXXXXX")
# Unix socket paths must stay under 108 bytes (Bazel's TEST_TMPDIR is long).
SOCKDIR=$(mktemp -d /tmp/nbdco.XXXXXX)
PIDS=()
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
for t in qemu-img qemu-io qemu-nbd; do
  command -v $t >/dev/null || { echo "$t not installed (tools/setup.sh)"; exit 1; }
done

# serve NAME QEMU_NBD_ARGS...: starts qemu-nbd -t on $SOCKDIR/NAME.sock
# (persistent: both tools connect in turn); its pid in NAME.pid.
serve() {
  local name=$1
  shift
  rm -f "$SOCKDIR/$name.sock"
  if ! qemu-nbd --fork --pid-file="$SOCKDIR/$name.pid" -t \
    -k "$SOCKDIR/$name.sock" "$@" 2>"$WORK/nbd.err"; then
    echo "SETUP FAILED: qemu-nbd $*: $(cat "$WORK/nbd.err")"
  fi
}
sock() { echo "nbd+unix:///?socket=$SOCKDIR/$1.sock"; }

cd "$WORK" || exit 1

# --- A raw export with data, a zeroed range and a hole --------------------
qemu-img create -q -f raw raw.img 4M
qio -f raw -c 'write -P 0xaa 0 64k' -c 'write -P 0xbb 1M 4k' raw.img
serve raw -f raw raw.img
R=$(sock raw)
same_output . info "$R"
same_output . info --output=json "$R"
same_output . info -f raw "$R"
same_output . map "$R"
same_output . map --output=json "$R"
same_output . map --output=json -f raw "$R"
same_output . compare "$R" raw.img
same_output . convert -O qcow2 "$R" out.qcow2
# convert from the export: the same file from both tools.
checks=$((checks + 1))
"$IMGTOOL" convert -f raw -O qcow2 "$R" a.qcow2 &&
  qemu-img convert -f raw -O qcow2 "$R" b.qcow2 &&
  cmp -s a.qcow2 b.qcow2 || fail "convert nbd -> qcow2: files differ"
checks=$((checks + 1))
"$IMGTOOL" convert -f raw -O raw "$R" a.raw &&
  qemu-img convert -f raw -O raw "$R" b.raw && cmp -s a.raw b.raw &&
  [[ "$(qemu-img map --output=json -f raw a.raw)" == \
     "$(qemu-img map --output=json -f raw b.raw)" ]] ||
  fail "convert nbd -> raw: files or maps differ"
# The legacy syntax and --image-opts / json: name the same node.
same_output . info "nbd:unix:$SOCKDIR/raw.sock"
same_output . info --image-opts \
  "driver=nbd,server.type=unix,server.path=$SOCKDIR/raw.sock"
same_output . map --output=json --image-opts \
  "driver=raw,file.driver=nbd,file.server.type=unix,file.server.path=$SOCKDIR/raw.sock"
same_output . info \
  "json:{\"driver\": \"nbd\", \"server\": {\"type\": \"unix\", \"path\": \"$SOCKDIR/raw.sock\"}}"
stop_servers

# --- Errors ---------------------------------------------------------------
serve raw -f raw raw.img
same_output . info "nbd+unix:///nope?socket=$SOCKDIR/raw.sock"
same_output . info "nbd+unix:///?socket=$SOCKDIR/none.sock"
same_output . info "nbd://127.0.0.1:1/"
same_output . create -f qcow2 "nbd+unix:///?socket=$SOCKDIR/none.sock" 1M
for bad in 'nbd+unix:///' 'nbd:///x' 'nbd://' 'nbd+foo://x' \
  "nbd+unix:///?socket=$SOCKDIR/raw.sock&foo=1" 'nbd://h:99999/' \
  'nbd+unix://host/?socket=/x' 'nbd+tcp://127.0.0.1/e?a=b' \
  'nbd:unix:/x:exportname='; do
  same_output . info "$bad"
done
for opts in driver=nbd driver=nbd,server.type=foo driver=nbd,server.type=unix \
  driver=nbd,server.type=inet,server.host=127.0.0.1 \
  "driver=nbd,server.type=unix,server.path=$SOCKDIR/raw.sock,bogus=1"; do
  same_output . info --image-opts "$opts"
done
stop_servers

# --- Writing through an export: convert -n, io, read-only ----------------
# with_export TOOL SUBCOMMAND ARGS...: a fresh 4 MiB raw file exported
# writable; TOOL (qemu-img/qemu-io or imgtool [io]) runs ARGS on it ($T is
# the URI); the output and the file afterwards go to $WORK/<label>.*.
src_setup() {
  qemu-img create -q -f qcow2 src.qcow2 4M
  qio -c 'write -P 0x5c 0 200k' -c 'write -z 1M 1M' -c 'write -P 0x6d 3M 12k' \
    src.qcow2
}
(src_setup)
writes() {  # writes LABEL EXPORT_FORMAT COMMAND...
  local label=$1 fmt=$2 side
  shift 2
  for side in q i; do
    rm -f "t.$side.img"
    if [[ $fmt == qcow2 ]]; then
      qemu-img create -q -f qcow2 "t.$side.img" 4M
    else
      qemu-img create -q -f raw "t.$side.img" 4M
      qio -f raw -c 'write -P 0x01 2M 1M' "t.$side.img"
    fi
    serve "t$side" -f "$fmt" "t.$side.img"
    local uri
    uri=$(sock "t$side")
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
    # create names the export in its output.
    sed -i "s|$uri|@T@|g" "$WORK/$label.$side.out" "$WORK/$label.$side.err"
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
  cmp -s t.q.img t.i.img || fail "$label: the exported files differ"
  [[ "$(qemu-img map --output=json -f "$fmt" t.q.img)" == \
     "$(qemu-img map --output=json -f "$fmt" t.i.img)" ]] ||
    fail "$label: the exported files' maps differ"
}
writes convert-n raw qemu-img convert -n -f qcow2 -O raw src.qcow2 @T@
writes convert-n-qcow2 qcow2 qemu-img convert -n -f qcow2 -O raw src.qcow2 @T@
writes convert-n-W raw qemu-img convert -n -W -f qcow2 -O raw src.qcow2 @T@
writes io-rw raw qemu-io -f raw -c 'write -P 0x42 0 64k' -c 'read -P 0x42 0 64k' \
  -c 'write -P 0x43 100k 3k' -c 'read -P 0x01 2M 4k' -c 'read -v 2M 32' \
  -c 'discard 2M 64k' -c 'write -z 3M 128k' -c 'write -z -u 2560k 64k' \
  -c 'flush' -c 'aio_write -P 0x44 1M 4k' -c 'aio_flush' \
  -c 'read -P 0x44 1M 4k' @T@
writes io-qcow2 qcow2 qemu-io -f raw -c 'write -P 0x42 0 64k' \
  -c 'write -z 64k 64k' -c 'discard 0 4k' -c 'read -P 0 0 4k' @T@
writes io-past-end raw qemu-io -f raw -c 'write 4M 512' -c 'read 4190000 10000' @T@
writes bench-w raw qemu-img bench -w -c 64 -d 16 -s 4k -S 8k -f raw @T@
# create on an export (bdrv_co_create_opts_simple): qcow2 written into it
# (any size: its file starts empty), raw no larger than the export, the
# first sector zeroed; preallocation refused.
writes create-qcow2 raw qemu-img create -f qcow2 @T@ 1M
writes create-qcow2-xl2 raw qemu-img create -f qcow2 -o extended_l2=on,cluster_size=128k @T@ 8M
writes create-raw raw qemu-img create -f raw @T@ 2M
writes create-raw-grow raw qemu-img create -f raw @T@ 8M
writes create-raw-prealloc raw qemu-img create -f raw -o preallocation=full @T@ 1M
writes create-qcow2-bad raw qemu-img create -f qcow2 -o compression_type=foo @T@ 1M
# convert and dd create their targets so too (a new qcow2 image in an
# export reads as zeroes: its holes are not written).
writes convert-qcow2 raw qemu-img convert -f qcow2 -O qcow2 src.qcow2 @T@
writes convert-raw raw qemu-img convert -f qcow2 -O raw src.qcow2 @T@
writes dd-raw raw qemu-img dd -f qcow2 -O raw if=src.qcow2 of=@T@ bs=64k

# qcow2 over an nbd file node (the qcow2 file exported raw).
cp src.qcow2 served.qcow2
serve q -f raw served.qcow2
QI="driver=qcow2,file.driver=nbd,file.server.type=unix,file.server.path=$SOCKDIR/q.sock"
same_output . info --image-opts "$QI"
same_output . map --output=json --image-opts "$QI"
same_output . map --image-opts "$QI"
same_output . compare --image-opts "$QI" src.qcow2
checks=$((checks + 1))
"$IMGTOOL" convert --image-opts "$QI" -O raw qa.raw &&
  qemu-img convert --image-opts "$QI" -O raw qb.raw && cmp -s qa.raw qb.raw ||
  fail "convert qcow2-over-nbd -> raw: files differ"
stop_servers

# The same qcow2 image exported as qcow2 (qemu-nbd -f qcow2): the map of
# the guest view.
cp src.qcow2 served2.qcow2
serve q2 -f qcow2 served2.qcow2
same_output . map --output=json "$(sock q2)"
same_output . compare "$(sock q2)" src.qcow2
stop_servers

# Read-only export: reads work, opening for writing fails as in QEMU.
serve ro -r -f raw raw.img
RO=$(sock ro)
same_output . info "$RO"
same_output . map --output=json "$RO"
same_output . convert -n -f raw -O raw raw.img "$RO"
same_output . resize -f raw "$RO" 8M
same_output . create -f qcow2 "$RO" 1M
run "$IMGTOOL" . io -f raw -c 'write 0 512' "$RO"
a_err=$ERR a_rc=$RC
run qemu-io . -f raw -c 'write 0 512' "$RO"
checks=$((checks + 1))
diff_text "io write on -r export" stderr "$a_err" "${ERR//qemu-io/imgtool}" &&
  diff_text "io write on -r export" "exit status" "$a_rc" "$RC"
stop_servers

# x-dirty-bitmap (iotest qemu-img-bitmaps' "hack for reading bitmaps"): the
# meta context asked for is the option's, its set bits read as holes.
# qemu-nbd -B exports qemu:dirty-bitmap:NAME, -A qemu:allocation-depth.
qemu-img create -q -f qcow2 bm.qcow2 10M
qemu-img bitmap --add bm.qcow2 b0
qio -f qcow2 -c 'write 3M 1M' -c 'write 5M 64k' bm.qcow2
qemu-img bitmap --add -g 512k bm.qcow2 b1
qio -f qcow2 -c 'write 1M 1k' bm.qcow2
serve bm -r -f qcow2 -B b0 -B b1 -A bm.qcow2
BM="driver=nbd,server.type=unix,server.path=$SOCKDIR/bm.sock"
for ctx in qemu:dirty-bitmap:b0 qemu:dirty-bitmap:b1 qemu:allocation-depth \
  base:allocation qemu:dirty-bitmap:none; do
  same_output . map --output=json --image-opts "$BM,x-dirty-bitmap=$ctx"
done
same_output . map --image-opts "$BM,x-dirty-bitmap=qemu:dirty-bitmap:b0"
same_output . info --image-opts "$BM,x-dirty-bitmap=qemu:dirty-bitmap:b1"
same_output . map --output=json \
  "json:{\"driver\":\"nbd\",\"server\":{\"type\":\"unix\",\"path\":\"$SOCKDIR/bm.sock\"},\"x-dirty-bitmap\":\"qemu:dirty-bitmap:b1\"}"
same_output . map --output=json --image-opts \
  "$BM,x-dirty-bitmap=qemu:dirty-bitmap:$(printf 'x%.0s' $(seq 4097))"
stop_servers

# open-timeout: no server yet. 0 (or none) fails at once with the connect
# error; a number that is none fails as QEMU's QemuOpts.
NONE="driver=nbd,server.type=unix,server.path=$SOCKDIR/none.sock"
same_output . info --image-opts "$NONE,open-timeout=0"
same_output . info --image-opts "$NONE,open-timeout=abc"
same_output . info --image-opts "$NONE,reconnect-delay=1.5"
# A server that starts after the client: both tools wait for it (retries
# after 1 s, 2 s, ...; 30 s is far more than the start takes).
rm -f late.*
qemu-img create -q -f raw late.img 1M
"$IMGTOOL" info --image-opts "$NONE,open-timeout=30" >late.i.out 2>&1 &
late_i=$!
qemu-img info --image-opts "$NONE,open-timeout=30" >late.q.out 2>&1 &
late_q=$!
sleep 0.3
serve none -f raw late.img
wait $late_i
echo "exit $?" >>late.i.out
wait $late_q
echo "exit $?" >>late.q.out
checks=$((checks + 1))
diff_text "info with open-timeout=30, server started later" output \
  "$(cat late.i.out)" "$(sed 's/^qemu-img: /imgtool: /' late.q.out)"
stop_servers

# reconnect-delay: an io session (commands through a fifo) whose server is
# killed between two commands. With reconnect-delay the next command waits
# for the server to come back and then works; without it fails with EIO.
# The server comes back while the command waits (or before: the result
# is the same).
wait_for() {  # wait_for FILE TEXT: until FILE has TEXT (at most 60 s)
  for _ in $(seq 1200); do grep -qF -- "$2" "$1" 2>/dev/null && return 0; sleep 0.05; done
  return 1
}
reconnect_session() {  # reconnect_session OUT OPTIONS TOOL...
  local out=$1 opts=$2 pid
  shift 2
  rm -f rc.fifo "$out"
  mkfifo rc.fifo
  qemu-img create -q -f raw rc.img 1M
  serve rc ${RC_SERVE:-} -f raw rc.img
  "$@" --image-opts "driver=nbd,server.type=unix,server.path=$SOCKDIR/rc.sock$opts" \
    <rc.fifo >"$out" 2>&1 &
  pid=$!
  exec 4>rc.fifo
  echo 'write -P 0x5a 0 64k' >&4
  wait_for "$out" "wrote 65536/65536" || echo "SETUP: no write reply" >>"$out"
  stop_servers
  echo 'read -P 0x5a 0 64k' >&4
  sleep 0.5
  serve rc ${RC_SERVE:-} -f raw rc.img 4>&-  # the server must not hold the fifo open
  echo 'write -P 0x6b 64k 4k' >&4
  exec 4>&-
  wait "$pid"
  echo "exit $?" >>"$out"
  stop_servers
  sed -i -E '/^[0-9.]+ (bytes|KiB|MiB), [0-9]+ ops; /d; s/^qemu-io/imgtool/' "$out"
  qemu-io -f raw -c 'read -P 0x5a 0 64k' -c 'read -P 0x6b 64k 4k' rc.img |
    grep -c '^read' >>"$out"
}
for opts in ",reconnect-delay=20" ""; do
  reconnect_session rc.i.out "$opts" "$IMGTOOL" io
  reconnect_session rc.q.out "$opts" qemu-io
  checks=$((checks + 1))
  diff_text "io session, server killed and back, options '$opts'" output \
    "$(cat rc.i.out)" "$(cat rc.q.out)"
done

# --- multi-conn (imgtool's extension; nbd_block/nbd_node.h) ---------------
# The same io session with two connections to a qemu-nbd that offers
# multi-conn (-e 2): both lost, both made again, as qemu-io's one.
RC_SERVE="-e 2" reconnect_session rc.i.out ",reconnect-delay=20,multi-conn=2" \
  "$IMGTOOL" io
RC_SERVE="-e 2" reconnect_session rc.q.out ",reconnect-delay=20" qemu-io
checks=$((checks + 1))
diff_text "io session, multi-conn=2, server killed and back" output \
  "$(cat rc.i.out)" "$(cat rc.q.out)"

# connections: CONN = the connections nbdkit's log filter saw since the last
# call.
mc_seen=0
connections() {
  local n
  n=$(grep -c ' Connect ' "$WORK/mc.log")
  CONN=$((n - mc_seen))
  mc_seen=$n
}
qemu-img create -q -f raw mc.img 8M
qio -f raw -c 'write -P 0x71 0 3M' -c 'write -P 0x72 5M 64k' -c 'write -z 6M 1M' \
  mc.img
if command -v nbdkit >/dev/null; then
  rm -f "$SOCKDIR/mc.sock"
  nbdkit -U "$SOCKDIR/mc.sock" -P "$SOCKDIR/mc.pid" --filter=log file \
    "$WORK/mc.img" logfile="$WORK/mc.log" ||
    fail "SETUP: nbdkit --filter=log file"
  K="nbd+unix:///?socket=$SOCKDIR/mc.sock"
  KO="driver=nbd,server.type=unix,server.path=$SOCKDIR/mc.sock"
  # convert's source: 4 connections (nbdcopy's default), the data qemu-img's.
  checks=$((checks + 1))
  "$IMGTOOL" convert -f raw -O raw "$K" a.mc &&
    qemu-img convert -f raw -O raw "$K" b.mc && cmp -s a.mc b.mc &&
    cmp -s a.mc mc.img || fail "multi-conn convert from nbdkit: data differ"
  # (qemu-img's one connection counted too.)
  checks=$((checks + 1))
  connections; [[ $CONN == 5 ]] || fail "convert from nbdkit: not 4 + 1 connections"
  # info, io: one (QEMU's client), unless multi-conn=N.
  same_output . info -f raw "$K"
  checks=$((checks + 1))
  connections; [[ $CONN == 2 ]] || fail "info: $CONN connections, not one each"
  checks=$((checks + 1))
  run "$IMGTOOL" . compare --image-opts "$KO,multi-conn=3" \
    "driver=file,filename=mc.img"
  connections
  [[ $RC == 0 && "$OUT" == $'Images are identical.\nx' && $CONN == 3 ]] ||
    fail "compare multi-conn=3: $OUT, $CONN connections"
  # Writes spread over the connections; a flush reaches every connection that
  # wrote (bench -w: 64 writes of 64 KiB at depth 8, a flush every 16).
  mc_lines=$(wc -l <mc.log)
  checks=$((checks + 1))
  "$IMGTOOL" bench -f raw -w -t writeback -c 64 -d 8 -s 64k -o 1M --flush-interval=16 \
    "$K" >/dev/null || fail "bench -w over nbd multi-conn failed"
  wrote=$(tail -n +$((mc_lines + 1)) mc.log | grep -o 'connection=[0-9]* Write ' |
    sort -u | cut -d' ' -f1)
  flushed=$(tail -n +$((mc_lines + 1)) mc.log | grep -o 'connection=[0-9]* Flush ' |
    sort -u | cut -d' ' -f1)
  checks=$((checks + 1))
  connections
  [[ $CONN == 4 && $(echo "$wrote" | wc -l) -ge 2 &&
     -z "$(comm -23 <(echo "$wrote") <(echo "$flushed"))" ]] ||
    fail "bench -w: writes on 4 connections, each flushed (wrote: $wrote; flushed: $flushed)"
  # convert -n into the export over 4 connections: the file qemu-img makes.
  qemu-img create -q -f qcow2 mcsrc.qcow2 8M
  qio -c 'write -P 0x44 1M 2M' -c 'write -z 4M 1M' -c 'write -P 0x45 7M 4k' \
    mcsrc.qcow2
  checks=$((checks + 1))
  "$IMGTOOL" convert -n -O raw mcsrc.qcow2 "$K" 2>/dev/null && cp mc.img a.mcw &&
    qemu-img convert -n -O raw mcsrc.qcow2 "$K" 2>/dev/null &&
    cmp -s a.mcw mc.img && connections && [[ $CONN == 5 ]] ||
    fail "convert -n into nbdkit over multi-conn: data or connections differ"
  for n in 0 17; do
    checks=$((checks + 1))
    run "$IMGTOOL" . info --image-opts "$KO,multi-conn=$n"
    [[ $RC == 1 && "$ERR" == "imgtool: Could not open '$KO,multi-conn=$n': Parameter 'multi-conn' expects a number from 1 to 16
x" ]] || fail "multi-conn=$n: $ERR"
  done
  kill "$(cat "$SOCKDIR/mc.pid")"; rm -f "$SOCKDIR/mc.pid"
  # A server without multi-conn: one connection whatever was asked.
  rm -f "$SOCKDIR/mc.sock"
  nbdkit -U "$SOCKDIR/mc.sock" -P "$SOCKDIR/mc.pid" --filter=multi-conn \
    --filter=log file "$WORK/mc.img" multi-conn-mode=disable \
    logfile="$WORK/mc.log" || fail "SETUP: nbdkit --filter=multi-conn"
  mc_seen=$(grep -c ' Connect ' "$WORK/mc.log")
  checks=$((checks + 1))
  "$IMGTOOL" convert -f raw -O raw "$K" c.mc && cmp -s c.mc mc.img &&
    "$IMGTOOL" info --image-opts "$KO,multi-conn=4" >/dev/null &&
    connections && [[ $CONN == 2 ]] ||
    fail "nbdkit without multi-conn: data or connections differ"
  kill "$(cat "$SOCKDIR/mc.pid")"; rm -f "$SOCKDIR/mc.pid"
fi
# Block status out of qemu-nbd (nbd_block/nbd_node.h, "Block status"):
# copying a qcow2 export of 1 MiB data and 3 MiB holes (16 of each, as the
# nbd bench's copy image) through nbdkit's log filter (nbd plugin in front of
# qemu-nbd -r -e 4). qemu-img 7.2 asks with REQ_ONE, an extent at a time
# (64 requests here), and reads 16 x 1 MiB; imgtool asks once without
# REQ_ONE (qemu-nbd answers all 32 extents) and reads the same bytes as 64
# reads of 256 KiB (nbdcopy's request size). Before, imgtool sent 32 REQ_ONE
# requests, each waited for in turn, and 1 MiB reads, which qemu-nbd serves
# slowly: what made its copy out of qemu-nbd slower than nbdcopy.
if command -v nbdkit >/dev/null; then
  qemu-img create -q -f qcow2 -o cluster_size=64k,extended_l2=on bs.qcow2 64M
  qemu-img bench -q -f qcow2 -w -t none -d 16 -s 1M -S 4M --pattern=170 -c 16 \
    bs.qcow2 || fail "SETUP: qemu-img bench -w"
  qemu-nbd --fork --pid-file="$SOCKDIR/bsq.pid" -t -r -e 4 -f qcow2 \
    -k "$SOCKDIR/bsq.sock" bs.qcow2 || fail "SETUP: qemu-nbd -e 4"
  # requests TOOL ARGS...: runs TOOL's copy through a fresh nbdkit log; its
  # BLOCK_STATUS requests (offset count req_one) in bs.TOOL.status, its
  # reads (offset count, sorted) in bs.TOOL.reads.
  requests() {
    local tool=$1
    shift
    rm -f "$SOCKDIR/bsk.sock" bs.log
    nbdkit -U "$SOCKDIR/bsk.sock" -P "$SOCKDIR/bsk.pid" --filter=log nbd \
      socket="$SOCKDIR/bsq.sock" logfile="$WORK/bs.log" ||
      fail "SETUP: nbdkit --filter=log nbd"
    "$@" "nbd+unix:///?socket=$SOCKDIR/bsk.sock" "bs.$tool.raw" ||
      fail "$tool convert out of nbdkit -> qemu-nbd failed"
    stop_pid_file "$SOCKDIR/bsk.pid"
    grep -o ' Extents id=[0-9]* offset=[0-9a-fx]* count=[0-9a-fx]* req_one=[01]' \
      bs.log | cut -d' ' -f4- >"bs.$tool.status"
    grep -o ' Read id=[0-9]* offset=[0-9a-fx]* count=[0-9a-fx]*' bs.log |
      cut -d' ' -f4- | sort >"bs.$tool.reads"
  }
  requests qemu-img qemu-img convert -f raw -O raw
  requests imgtool "$IMGTOOL" convert -f raw -O raw
  checks=$((checks + 1))
  [[ $(wc -l <bs.qemu-img.status) == 64 && $(grep -c 'req_one=1' bs.qemu-img.status) == 64 ]] ||
    fail "qemu-img's BLOCK_STATUS requests: $(wc -l <bs.qemu-img.status), not 64 with REQ_ONE"
  checks=$((checks + 1))
  diff_text "imgtool convert's BLOCK_STATUS requests out of qemu-nbd" requests \
    "$(cat bs.imgtool.status)" "offset=0x0 count=0x4000000 req_one=0"
  # qemu-img's 1 MiB reads, each as 4 of 256 KiB.
  pieces=$(while read -r o c; do
    for k in 0 1 2 3; do
      printf 'offset=0x%x count=0x40000\n' $((${o#offset=} + k * 0x40000))
    done
  done <bs.qemu-img.reads | sort)
  checks=$((checks + 1))
  [[ $(wc -l <bs.qemu-img.reads) == 16 && $(grep -c 'count=0x100000$' bs.qemu-img.reads) == 16 ]] &&
    diff_text "imgtool convert's reads out of qemu-nbd (qemu-img's in 256 KiB)" reads \
      "$(cat bs.imgtool.reads)" "$pieces" ||
    fail "imgtool's reads are not qemu-img's (16 of 1 MiB: $(wc -l <bs.qemu-img.reads)) in 256 KiB pieces"
  checks=$((checks + 1))
  cmp -s bs.imgtool.raw bs.qemu-img.raw &&
    [[ "$(qemu-img map --output=json -f raw bs.imgtool.raw)" == \
       "$(qemu-img map --output=json -f raw bs.qemu-img.raw)" ]] ||
    fail "convert out of qemu-nbd: files or maps differ from qemu-img's"
  stop_servers
fi
# qemu-nbd 7.2 offers multi-conn when -e is not 1 (nbd/server.c,
# nbd_export_create). Read-only with -e 4 and imgtool nbd -e 4: the data
# qemu-img reads.
for server in qemu-nbd imgtool; do
  rm -f "$SOCKDIR/mce.sock"
  if [[ $server == qemu-nbd ]]; then
    qemu-nbd --fork --pid-file="$SOCKDIR/mce.pid" -t -r -e 4 \
      -k "$SOCKDIR/mce.sock" -f raw mc.img || fail "SETUP: qemu-nbd -e 4"
  else
    "$IMGTOOL" nbd --fork --pid-file="$SOCKDIR/mce.pid" -t -r -e 4 \
      -k "$SOCKDIR/mce.sock" -f raw mc.img || fail "SETUP: imgtool nbd -e 4"
  fi
  E="nbd+unix:///?socket=$SOCKDIR/mce.sock"
  checks=$((checks + 1))
  "$IMGTOOL" convert -f raw -O qcow2 "$E" a.mce.qcow2 &&
    qemu-img convert -f raw -O qcow2 "$E" b.mce.qcow2 &&
    cmp -s a.mce.qcow2 b.mce.qcow2 ||
    fail "convert from $server -e 4: files differ"
  same_output . compare "$E" mc.img
  same_output . map --output=json --image-opts \
    "driver=nbd,server.type=unix,server.path=$SOCKDIR/mce.sock"
  stop_servers
done
# qemu-nbd -e 2 with one client already in: convert's second connection stays in
# the listen backlog; convert gives it up after 5 s (no greeting) and
# copies over the one it has (no hang).
qemu-nbd --fork --pid-file="$SOCKDIR/mcb.pid" -t -r -e 2 \
  -k "$SOCKDIR/mcb.sock" -f raw mc.img || fail "SETUP: qemu-nbd -e 2"
rm -f hold.fifo hold.out
mkfifo hold.fifo
qemu-io -r -f raw "nbd+unix:///?socket=$SOCKDIR/mcb.sock" <hold.fifo \
  >hold.out 2>&1 &
holder=$!
exec 5>hold.fifo
echo 'read 0 512' >&5
wait_for hold.out "read 512/512" || fail "SETUP: qemu-io holding a connection"
checks=$((checks + 1))
timeout 60 "$IMGTOOL" convert -f raw -O raw \
  "nbd+unix:///?socket=$SOCKDIR/mcb.sock" d.mc && cmp -s d.mc mc.img ||
  fail "convert from a full qemu-nbd -e 2: failed or data differ"
exec 5>&-
wait "$holder"
stop_servers

# TCP on 127.0.0.1 with an export name (a free port: qemu-nbd refuses a
# busy one, then the next is tried).
for try in 1 2 3 4 5; do
  port=$((20000 + RANDOM % 20000))
  qemu-nbd --fork --pid-file="$SOCKDIR/tcp.pid" -t -b 127.0.0.1 -p "$port" \
    -x exp -f raw raw.img 2>/dev/null && break
  port=""
done
if [[ -z "$port" ]]; then
  fail "SETUP: no free TCP port for qemu-nbd"
else
  same_output . info "nbd://127.0.0.1:$port/exp"
  same_output . map --output=json "nbd+tcp://127.0.0.1:$port/exp"
  same_output . info "nbd:127.0.0.1:$port:exportname=exp"
  same_output . info --image-opts \
    "driver=nbd,server.type=inet,server.host=127.0.0.1,server.port=$port,export=exp"
  same_output . info "nbd://127.0.0.1:$port/wrong"
  same_output . compare "nbd://127.0.0.1:$port/exp" raw.img
fi
stop_servers

finish
