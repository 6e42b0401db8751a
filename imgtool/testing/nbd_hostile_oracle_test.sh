#!/usr/bin/env bash
# Oracle test for the NBD server against clients that take time or hold
# connections (issue 19; nbd_server_oracle_test.sh has the quick malformed
# probes of nbd_hostile.py). Each case runs against qemu-nbd 7.2 (Debian's,
# with the CVE-2024-7409 backports) and imgtool nbd, and their answers are
# compared line by line (nbd_stress.py):
#  - slow-write: a WRITE announcing 32 MiB whose payload trickles in (80 KiB
#    over 2 s), then the client leaves; a second client writes and reads
#    meanwhile. The server's VmRSS / VmHWM may not grow by the announced
#    size: the bound is 8 MiB (what is legitimately held: 80 KiB received,
#    one 256 KiB receive piece, a few 4 KiB request buffers, allocator
#    slack; a buffer for the announced 32 MiB would exceed it 4 times).
#  - stall: a port scan, then a silent client or one sending half an option,
#    on a server with -e 1 and no -t: the stalled client is dropped after
#    the 10 s handshake limit, nbdinfo queued behind it is then served, and
#    the server exits after nbdinfo (a client that never negotiated, as the
#    scan, does not stop it).
#  - many: 5 clients at once on -e 2 -t: 2 served, one more when one leaves.
#  - pipeline: 64 WRITEs in one send (4 KiB requests straddling the
#    server's 64 KiB receive buffer, two of 96 KiB), 64 READs of them in
#    one send, a WRITE + READ pair in one packet, a READ past the end among
#    valid ones; simple and structured replies, answered in any order.
#  - killed: imgtool nbd -f qcow2 --cache=writethrough (extended_l2=on;
#    lazy_refcounts off and on) under nbdcopy writing 24 MiB (8 requests in
#    flight), killed with SIGKILL once the file
#    has grown past 2, 8 and 16 MiB; qemu-img check must find no corruption
#    (leaks allowed) without lazy refcounts, and with them `check -r all`
#    must leave the image clean, as for qemu-nbd killed the same way; and
#    the acknowledged writes must be in the image (all but 3 MiB of what
#    the file held at the kill).
# Every server is started with --fork and a pid file and stopped on every
# exit path (trap). Usage: nbd_hostile_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  LIBDIR="$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing"
else
  LIBDIR=$(realpath "$(dirname "$0")")
fi
source "$LIBDIR/oracle_lib.sh" || exit 1
source "$LIBDIR/nbd_lib.sh" || exit 1
nbd_setup nbd_hostile_oracle
STRESS="$LIBDIR/nbd_stress.py"
PY=/usr/bin/python3
for t in qemu-img qemu-nbd nbdinfo nbdcopy $PY; do
  command -v $t >/dev/null || { echo "$t not installed (tools/setup.sh)"; exit 1; }
done

sock() { echo "$SOCKDIR/$1/$2.sock"; }
pid_of() { cat "$SOCKDIR/$1/$2.pid"; }
# compare LABEL: q.out (qemu-nbd's answers) and o.out (imgtool's) equal.
compare() {
  checks=$((checks + 1))
  if ! cmp -s q.out o.out; then
    fail "$1: answers differ (< qemu-nbd, > imgtool nbd)"
    diff q.out o.out | head -20
  fi
}

cd "$WORK" || exit 1
qemu-img create -q -f raw disk.img 64M

# --- A 32 MiB WRITE whose payload trickles in ----------------------------
for who in q o; do
  serve $who slow -t -e 4 -f raw disk.img
  timeout 60 $PY "$STRESS" slow-write "$(sock $who slow)" "$(pid_of $who slow)" \
    >"slow.$who" 2>&1
  stop $who slow
  grep -v '^growth' "slow.$who" >"$who.out"
done
compare "slow write: the second client"
grep -q '^second client: 20 of 20' o.out || fail "slow write: $(head -2 o.out)"
for who in q o; do
  checks=$((checks + 1))
  read -r rss hwm < <(sed -n 's/^growth KiB: rss \(-\{0,1\}[0-9]*\) hwm \([0-9]*\)$/\1 \2/p' "slow.$who")
  if [[ -z "${hwm:-}" || $rss -gt 8192 || $hwm -gt 8192 ]]; then
    fail "slow write ($who): memory grew by more than 8 MiB: $(tail -1 "slow.$who")"
  fi
  echo "slow write ($who): $(tail -1 "slow.$who")"
done

# --- Clients that never negotiate; -e accounting; no -t -----------------
# All four servers at once: each case waits for the 10 s handshake limit.
declare -A stall_pid
for who in q o; do
  for kind in silent half; do
    serve $who $kind -e 1 -f raw disk.img
    stall_pid[$who.$kind]=$(pid_of $who $kind)
    timeout 90 $PY "$STRESS" stall "$(sock $who $kind)" "$(uri $who $kind)" \
      $kind >"stall.$kind.$who" 2>&1 &
  done
done
wait
cat stall.silent.q stall.half.q >q.out
cat stall.silent.o stall.half.o >o.out
compare "stalled clients"
checks=$((checks + 1))
if ! diff - o.out >/dev/null <<'EOF'
nbdinfo --size: 67108864 (exit 0)
silent client: closed after at least 9 s
nbdinfo --size: 67108864 (exit 0)
half client: closed after at least 9 s
EOF
then
  fail "stalled clients: $(cat o.out)"
fi
for who in q o; do
  for kind in silent half; do
    # Without -t the server exits once nbdinfo (which negotiated) left.
    checks=$((checks + 1))
    pid=${stall_pid[$who.$kind]}
    for _ in $(seq 500); do kill -0 "$pid" 2>/dev/null || break; sleep 0.02; done
    if kill -0 "$pid" 2>/dev/null; then
      fail "stall ($who, $kind): the server still runs after nbdinfo left"
    fi
  done
done

# --- More clients than -e -------------------------------------------------
for who in q o; do
  serve $who many -t -e 2 -f raw disk.img
  timeout 90 $PY "$STRESS" many "$(sock $who many)" 5 >"$who.out" 2>&1
  stop $who many
done
compare "five clients on -e 2"
grep -q '^greeted while 2 are connected: \[0, 1\]$' o.out || fail "many: $(cat o.out)"

# --- Pipelined requests: many in one packet ------------------------------
for who in q o; do
  serve $who pipe -t -f raw disk.img
  timeout 120 $PY "$STRESS" pipeline "$(sock $who pipe)" >"$who.out" 2>&1
  stop $who pipe
done
compare "pipelined requests"
checks=$((checks + 1))
if ! diff - o.out >/dev/null <<'EOF'
simple: 452352 bytes, 64 writes in one send: 64 answered, 64 ok
simple: 64 reads in one send: 64 answered, 64 with the data written
simple: write + read in one packet: write error 0, read error 0, data right
simple: read past the end among two: errors [0, 22, 0], data [True, True]
structured: 452352 bytes, 64 writes in one send: 64 answered, 64 ok
structured: 64 reads in one send: 64 answered, 64 with the data written
structured: write + read in one packet: write error 0, read error 0, data right
structured: read past the end among two: errors [0, 22, 0], data [True, True]
EOF
then
  fail "pipelined requests: $(cat o.out)"
fi

# --- A killed server leaves a consistent qcow2 ----------------------------
head -c $((24 << 20)) /dev/urandom >src.raw
# gone PID: the process has ended (a killed --fork server is not our child:
# under a sandbox that does not reap it, it stays a zombie).
gone() { ! kill -0 "$1" 2>/dev/null || [[ $(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) == Z ]]; }
# killed WHO LAZY GROWTH_MIB: the check result after a SIGKILL once the
# image file holds more than GROWTH_MIB MiB of blocks (its size says little:
# imgtool grows it ahead of the writes) or nbdcopy ended. The export
# is writethrough, so the metadata reaches the file as the writes go and
# the kill lands among its updates.
killed() {
  local who=$1 lazy=$2 mib=$3 f=k.$1.qcow2 pid size rc
  rm -f "$f"
  qemu-img create -q -f qcow2 -o extended_l2=on,lazy_refcounts=$lazy "$f" 64M
  serve "$who" kill -t -f qcow2 --cache=writethrough "$f"
  pid=$(pid_of "$who" kill)
  timeout 60 nbdcopy --requests=8 src.raw "$(uri "$who" kill)" 2>/dev/null &
  local copy=$!
  for _ in $(seq 3000); do
    size=$(( $(stat -c "%b * %B" "$f") ))
    ((size > mib << 20)) && break
    kill -0 $copy 2>/dev/null || break
    sleep 0.01
  done
  kill -9 "$pid"
  wait $copy 2>/dev/null
  for _ in $(seq 250); do gone "$pid" && break; sleep 0.02; done
  wait_until_unlocked "$f"
  rm -f "$SOCKDIR/$who/kill.pid"
  if [[ $lazy == on ]]; then
    # The dirty bit is set: the refcounts are rebuilt first, as QEMU does
    # when it opens such an image read-write.
    qemu-img check -r all "$f" >/dev/null 2>&1
  fi
  qemu-img check "$f" >check.out 2>&1
  rc=$?
  # MiB of data the image maps after the kill (whole MiB, rounded down).
  local data
  data=$(qemu-img map --output=json "$f" | $PY -c 'import json, sys
print(sum(e["length"] for e in json.load(sys.stdin) if e["data"]) >> 20)')
  echo "lazy_refcounts=$lazy killed past $mib MiB: data $data MiB," \
    "check exit $rc, $(grep -E 'leaked clusters|errors were found' check.out | tr '\n' ' ')"
}
for lazy in off on; do
  for mib in 2 8 16; do
    for who in q o; do
      checks=$((checks + 1))
      line=$(killed $who $lazy $mib)
      echo "killed ($who): $line"
      # 0: clean; 3: leaks only (as a killed qemu-nbd may leave); 2 is
      # corruption, 1 a check that could not finish.
      if [[ ! $line =~ "check exit "[03]"," ]]; then
        fail "killed ($who): $line"
        head -10 check.out
      fi
      # Writethrough: every acknowledged write is in the image, metadata
      # included; at the kill the file held more than $mib MiB of blocks, of
      # which at most nbdcopy's 8 requests in flight (8 x 256 KiB) and the
      # metadata's few clusters were not acknowledged.
      checks=$((checks + 1))
      data=$(sed 's/.* data \([0-9]*\) MiB,.*/\1/' <<<"$line")
      if ((data < mib - 3)); then
        fail "killed ($who): $data MiB of data left, acknowledged writes lost: $line"
      fi
    done
  done
done

echo "$checks checks, $failures failures"
((failures == 0))
