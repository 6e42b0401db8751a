#!/usr/bin/env bash
# Oracle test for the NBD server (imgtool nbd, nbd_server/): each case
# exports copies of the same image with qemu-nbd 7.2 and with imgtool nbd
# and asks both the same questions with real clients: qemu-img info / map /
# compare / convert, qemu-io read / write / discard / zero patterns (the
# files compared afterwards), nbdinfo --json / --map / --list, nbdcopy with
# 4 connections (-e 4), a libnbd client without structured replies (nbdsh's
# python module), a read-only export, a qcow2 image with a backing file,
# -A / -B (qemu:allocation-depth and qemu:dirty-bitmap contexts on a
# 3-layer chain: LIST / SET queries, maps, bitmap errors), --detect-zeroes
# (the files after zero-filled writes), -l (internal snapshots) and -s
# (a temporary overlay: the file unchanged, nothing left in TMPDIR), -L
# (imgtool and qemu-nbd listing either server's exports), one
# TCP export on 127.0.0.1, hostile traffic (nbd_hostile.py: bad magics,
# oversized and out-of-range requests, refused writes, a client leaving
# mid-request) and the command line (--help, usage errors, open errors,
# exit after the last client without -t).
# Every server is started with --fork and a pid file and stopped at the end
# of its case and on every exit path (trap): none is left running.
# Usage: nbd_server_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  LIBDIR="$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing"
else
  LIBDIR=$(realpath "$(dirname "$0")")
fi
source "$LIBDIR/oracle_lib.sh" || exit 1
source "$LIBDIR/nbd_lib.sh" || exit 1
nbd_setup nbd_server_oracle
HOSTILE="$LIBDIR/nbd_hostile.py"
# Debian's python3 has the libnbd module (python3-libnbd).
PY=/usr/bin/python3
for t in qemu-img qemu-io qemu-nbd nbdinfo nbdcopy $PY; do
  command -v $t >/dev/null || { echo "$t not installed (tools/setup.sh)"; exit 1; }
done
$PY -c 'import nbd' || { echo "python3-libnbd not installed (tools/setup.sh)"; exit 1; }

# same CMD...: runs CMD with @Q@ and @O@ replaced by qemu-nbd's and
# imgtool's URI (set in QU and OU); stdout, stderr and exit status equal
# once imgtool's socket directory reads as qemu-nbd's.
same() {
  checks=$((checks + 1))
  local qargs=() oargs=() a
  for a in "$@"; do
    qargs+=("${a//@U@/$QU}")
    oargs+=("${a//@U@/$OU}")
  done
  local q_out q_rc o_out o_rc
  q_out=$(timeout 60 "${qargs[@]}" 2>&1; echo "rc=$?")
  o_out=$(timeout 60 "${oargs[@]}" 2>&1; echo "rc=$?")
  o_out=${o_out//$SOCKDIR\/o\//$SOCKDIR/q/}
  # qemu-io's timing lines differ from run to run.
  q_out=$(sed -E '/^[0-9.]+ (bytes|KiB|MiB), [0-9]+ ops; /d' <<<"$q_out")
  o_out=$(sed -E '/^[0-9.]+ (bytes|KiB|MiB), [0-9]+ ops; /d' <<<"$o_out")
  if [[ "$q_out" != "$o_out" ]]; then
    fail "$*: output differs (< qemu-nbd, > imgtool nbd)"
    diff <(echo "$q_out") <(echo "$o_out") | head -20
  fi
}

# same_files LABEL A B: two image files with equal contents and maps.
same_files() {
  checks=$((checks + 1))
  cmp -s "$2" "$3" || { fail "$1: files $2 and $3 differ"; return; }
}

cd "$WORK" || exit 1

# --- A raw export: data, a zeroed range, a hole; reads and writes ---------
qemu-img create -q -f raw base.img 4M
qio -f raw -c 'write -P 0xaa 0 64k' -c 'write -P 0xbb 1M 4k' \
  -c 'write -z 2M 64k' base.img
cp base.img q.img && cp base.img o.img
serve q raw -t -f raw q.img
serve o raw -t -f raw o.img
QU=$(uri q raw) OU=$(uri o raw)
same qemu-img info @U@
same qemu-img info --output=json @U@
same qemu-img map --output=json @U@
same qemu-img map @U@
same qemu-img compare @U@ base.img
same nbdinfo --json @U@
same nbdinfo --map @U@
same nbdinfo --map --totals @U@
same nbdinfo --list @U@
same nbdinfo --can structured-reply @U@
checks=$((checks + 1))
qemu-img convert -O qcow2 "$QU" cq.qcow2 && qemu-img convert -O qcow2 "$OU" co.qcow2 &&
  cmp -s cq.qcow2 co.qcow2 || fail "convert from the exports: files differ"
same qemu-io -f raw -c 'read -P 0xaa 0 64k' -c 'read -P 0xbb 1M 4k' \
  -c 'read -P 0 2M 64k' -c 'read -P 0 3M 512' -c 'read -v 65530 12' @U@
same qemu-io -f raw -c 'write -P 0x5a 512k 64k' -c 'write -P 0x11 4095 3' \
  -c 'writev -P 0x22 700k 4k 8k' -c 'aio_write -P 0x33 900k 16k' \
  -c 'aio_flush' -c 'write -z 1M 2k' \
  -c 'write -z -u 40k 8k' -c 'discard 3M 64k' -c 'flush' \
  -c 'read -P 0x5a 512k 64k' -c 'read -P 0x11 4095 3' -c 'read -P 0 1M 2k' @U@
same qemu-io -f raw -c 'write -P 1 4194303 1' -c 'write 4194303 2' \
  -c 'read 4194000 1000' @U@
same qemu-img map --output=json @U@
same qemu-img compare -f raw -F raw @U@ base.img
stop q raw
stop o raw
same_files "raw export after writes" q.img o.img

# --- --discard=unmap: discard and zero writes punch holes -----------------
cp base.img q.img && cp base.img o.img
serve q unmap -t -f raw --discard=unmap q.img
serve o unmap -t -f raw --discard=unmap o.img
QU=$(uri q unmap) OU=$(uri o unmap)
same qemu-io -f raw -c 'discard 0 64k' -c 'write -z -u 1M 4k' @U@
same nbdinfo --map @U@
stop q unmap
stop o unmap
same_files "--discard=unmap" q.img o.img
checks=$((checks + 1))
[[ "$(qemu-img map --output=json -f raw q.img)" == \
   "$(qemu-img map --output=json -f raw o.img)" ]] ||
  fail "--discard=unmap: the maps of the files differ"

# --- A client without structured replies (simple replies only) ------------
cp base.img q.img && cp base.img o.img
serve q simple -t -f raw q.img
serve o simple -t -f raw o.img
QU=$(uri q simple) OU=$(uri o simple)
cat >simple.py <<'EOF'
import hashlib, sys, nbd
h = nbd.NBD()
h.set_request_structured_replies(False)
h.connect_uri(sys.argv[1])
print("structured:", h.get_structured_replies_negotiated())
print("size:", h.get_size(), "ro:", h.is_read_only(), "flush:", h.can_flush(),
      "trim:", h.can_trim(), "zero:", h.can_zero(), "cache:", h.can_cache(),
      "multi:", h.can_multi_conn(), "df:", h.can_df())
print(hashlib.sha256(h.pread(4 << 20, 0)).hexdigest())
h.pwrite(b"\x77" * 5000, 12345)
h.zero(8192, 1 << 20, nbd.CMD_FLAG_NO_HOLE)
h.trim(65536, 3 << 20)
h.flush()
h.cache(4096, 0)
print(hashlib.sha256(h.pread(4 << 20, 0)).hexdigest())
try:
    h.pread(512, 4 << 20)
except nbd.Error as e:
    print("past the end:", e.errno)
h.shutdown()
EOF
same $PY simple.py @U@
stop q simple
stop o simple
same_files "simple replies" q.img o.img

# --- Read-only, shared by 4 clients: multi-conn, nbdcopy --connections=4 ---
cp base.img q.img && cp base.img o.img
serve q ro -t -r -e 4 -x exp -D "a description" -f raw q.img
serve o ro -t -r -e 4 -x exp -D "a description" -f raw o.img
QU=$(uri q ro exp) OU=$(uri o ro exp)
same nbdinfo --json @U@
same nbdinfo --list @U@
same qemu-img info @U@
same qemu-io -f raw -c 'write 0 512' @U@
same qemu-io -r -f raw -c 'read -P 0xbb 1M 4k' @U@
checks=$((checks + 1))
nbdcopy --connections=4 "$QU" cq.raw && nbdcopy --connections=4 "$OU" co.raw &&
  cmp -s cq.raw co.raw && cmp -s co.raw base.img ||
  fail "nbdcopy --connections=4 from the read-only exports: files differ"
stop q ro
stop o ro

# --- Writing with 4 connections (-e 4): nbdcopy into the exports ----------
qemu-img create -q -f raw src.img 4M
qio -f raw -c 'write -P 0x61 0 1M' -c 'write -P 0x62 3M 512k' src.img
qemu-img create -q -f raw q.img 4M && cp q.img o.img
serve q mc -t -e 4 -f raw q.img
serve o mc -t -e 4 -f raw o.img
QU=$(uri q mc) OU=$(uri o mc)
same nbdinfo --can multi-conn @U@
checks=$((checks + 1))
nbdcopy --connections=4 src.img "$QU" && nbdcopy --connections=4 src.img "$OU" ||
  fail "nbdcopy --connections=4 into the exports failed"
stop q mc
stop o mc
same_files "nbdcopy into -e 4 exports" q.img o.img
same_files "nbdcopy into -e 4 exports (source)" src.img o.img

# --- qcow2 with a backing file ---------------------------------------------
qemu-img create -q -f qcow2 back.qcow2 4M
qio -c 'write -P 0x10 0 1M' -c 'write -P 0x20 2M 512k' back.qcow2
qemu-img create -q -f qcow2 -b back.qcow2 -F qcow2 q.qcow2
qio -c 'write -P 0x30 512k 1M' -c 'write -z 2M 64k' q.qcow2
cp q.qcow2 o.qcow2
serve q chain -t -f qcow2 q.qcow2
serve o chain -t -f qcow2 o.qcow2
QU=$(uri q chain) OU=$(uri o chain)
same nbdinfo --map @U@
same qemu-img map --output=json @U@
same qemu-io -f raw -c 'read -P 0x10 0 512k' -c 'read -P 0x30 512k 1M' \
  -c 'read -P 0 2M 64k' -c 'read -P 0x20 2112k 448k' -c 'read -P 0 3M 1M' @U@
same qemu-io -f raw -c 'write -P 0x40 100k 8k' -c 'write -z 3M 64k' \
  -c 'discard 0 64k' -c 'read -P 0x40 100k 8k' @U@
checks=$((checks + 1))
qemu-img convert -O raw "$QU" cq.raw && qemu-img convert -O raw "$OU" co.raw &&
  cmp -s cq.raw co.raw || fail "convert from the qcow2 exports: files differ"
stop q chain
stop o chain
checks=$((checks + 1))
qemu-img check -q o.qcow2 || fail "qcow2 chain: qemu-img check of imgtool's image"
checks=$((checks + 1))
qemu-img compare q.qcow2 o.qcow2 >/dev/null ||
  fail "qcow2 chain: the images differ after writes through the exports"
checks=$((checks + 1))
[[ "$(qemu-img map --output=json o.qcow2)" == \
   "$(qemu-img map --output=json q.qcow2)" ]] ||
  fail "qcow2 chain: the maps differ after writes through the exports"

# --- -A / -B: qemu:allocation-depth and qemu:dirty-bitmap:NAME ------------
# A 3-layer chain whose bottom layer is shorter (2M of 4M); bitmaps b0
# (enabled), b1 (disabled after some writes) in the top, bl1 in the middle.
qemu-img create -q -f qcow2 l0.qcow2 2M
qio -c 'write -P 1 0 1M' -c 'write -z 1536k 64k' l0.qcow2
qemu-img create -q -f qcow2 -b l0.qcow2 -F qcow2 l1.qcow2 4M
qemu-img bitmap --add -g 128k l1.qcow2 bl1
qio -c 'write -P 2 512k 512k' -c 'write -P 2 2M 64k' l1.qcow2
qemu-img create -q -f qcow2 -b l1.qcow2 -F qcow2 l2.qcow2 4M
qemu-img bitmap --add l2.qcow2 b0
qemu-img bitmap --add -g 256k l2.qcow2 b1
qio -c 'write -P 3 768k 128k' -c 'write -z 3M 64k' l2.qcow2
qemu-img bitmap --disable l2.qcow2 b1
qio -c 'write -P 4 3200k 4k' l2.qcow2
cp l2.qcow2 q.qcow2 && cp l2.qcow2 o.qcow2
serve q depth -t -A -B b0 -B b1 -B bl1 -f qcow2 q.qcow2
serve o depth -t -A -B b0 -B b1 -B bl1 -f qcow2 o.qcow2
QU=$(uri q depth) OU=$(uri o depth)
same nbdinfo --json @U@
same nbdinfo --map=qemu:allocation-depth @U@
same nbdinfo --map @U@
same nbdinfo --map=qemu:dirty-bitmap:b0 @U@
same nbdinfo --map=qemu:dirty-bitmap:b1 @U@
same nbdinfo --map=qemu:dirty-bitmap:bl1 @U@
cat >meta.py <<'EOF2'
import sys, nbd
uri = sys.argv[1]
def listed(queries):
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_uri(uri)
    for q in queries:
        h.add_meta_context(q)
    names = []
    n = h.opt_list_meta_context(lambda name: names.append(name) or 0)
    print("list", queries, n, names)
    h.opt_abort()
for qs in ([], ["qemu:"], ["base:"], ["qemu:dirty-bitmap:"],
           ["qemu:allocation-depth"], ["qemu:dirty-bitmap:b1", "base:allocation"],
           ["qemu:nothing", "other:x", "base:nothing"], ["qemu:dirty-bitmap:nope"],
           ["qemu:dirty-bitmap:b0", "qemu:", "qemu:dirty-bitmap:b0"]):
    listed(qs)
contexts = ["qemu:dirty-bitmap:bl1", "base:allocation", "qemu:allocation-depth",
            "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1", "qemu:x"]
h = nbd.NBD()
for c in contexts:
    h.add_meta_context(c)
h.connect_uri(uri)
print([(c, h.can_meta_context(c)) for c in contexts])
def cb(context, offset, entries, err):
    print(context, offset, entries)
    return 0
size = h.get_size()
h.block_status(size, 0, cb)
h.block_status(size, 0, cb, nbd.CMD_FLAG_REQ_ONE)
h.block_status(1 << 20, 700 << 10, cb)
h.block_status(4096, 3 << 20, cb, nbd.CMD_FLAG_REQ_ONE)
h.shutdown()
EOF2
same $PY meta.py @U@
same qemu-io -f raw -c 'write -P 9 2560k 4k' -c 'write -z 100k 4k' @U@
same nbdinfo --map=qemu:dirty-bitmap:b0 @U@
same nbdinfo --map=qemu:dirty-bitmap:b1 @U@
same nbdinfo --map=qemu:allocation-depth @U@
QU="driver=nbd,server.type=unix,server.path=$SOCKDIR/q/depth.sock"
OU="driver=nbd,server.type=unix,server.path=$SOCKDIR/o/depth.sock"
same qemu-img map --output=json --image-opts @U@,x-dirty-bitmap=qemu:allocation-depth
same qemu-img map --output=json --image-opts @U@,x-dirty-bitmap=qemu:dirty-bitmap:b0
same qemu-img map --output=json --image-opts @U@,x-dirty-bitmap=qemu:dirty-bitmap:bl1
stop q depth
stop o depth
checks=$((checks + 1))
[[ "$(qemu-img info o.qcow2 | sed 's/o\.qcow2/q.qcow2/')" == "$(qemu-img info q.qcow2)" ]] ||
  fail "-B: the images' bitmaps differ after writes through the exports"
# A read-only export of an enabled bitmap; a bitmap that is not there, one
# left in use by a killed writer (inconsistent).
serve q depthro -t -r -A -B b0 -f qcow2 l2.qcow2
serve o depthro -t -r -A -B b0 -f qcow2 l2.qcow2
QU=$(uri q depthro) OU=$(uri o depthro)
same nbdinfo --map=qemu:dirty-bitmap:b0 @U@
same nbdinfo --map=qemu:allocation-depth @U@
same nbdinfo --list @U@
stop q depthro
stop o depthro
cp l2.qcow2 crashed.qcow2
qemu-io -c 'write 2M 4k' -c abort crashed.qcow2 >/dev/null 2>&1

# --- --detect-zeroes: what zero-filled WRITEs leave in the file ------------
qemu-img convert -O qcow2 base.img dz.qcow2
dz_case() {  # dz_case NAME FMT IMAGE ARGS...
  local name=$1 fmt=$2 src=$3
  shift 3
  cp "$src" q.dz && cp "$src" o.dz
  serve q "$name" -t -f "$fmt" "$@" q.dz
  serve o "$name" -t -f "$fmt" "$@" o.dz
  QU=$(uri q "$name") OU=$(uri o "$name")
  same qemu-io -f raw -c 'write -P 0 0 64k' -c 'write -P 0 1M 4k' \
    -c 'write -P 0 3M 64k' -c 'write -P 0 66048 512' -c 'write -P 7 2M 4k' \
    -c 'aio_write -P 0 1536k 128k' -c aio_flush @U@
  same nbdinfo --map @U@
  stop q "$name"
  stop o "$name"
  checks=$((checks + 1))
  [[ "$(qemu-img map --output=json -f "$fmt" o.dz)" == \
     "$(qemu-img map --output=json -f "$fmt" q.dz)" ]] ||
    fail "--detect-zeroes $name: the maps of the files differ"
  if [[ $fmt == raw ]]; then
    same_files "--detect-zeroes $name" q.dz o.dz
  else
    checks=$((checks + 1))
    qemu-img compare -q q.dz o.dz && qemu-img check -q o.dz ||
      fail "--detect-zeroes $name: images differ or imgtool's is not clean"
  fi
}

dz_case dzon raw base.img --detect-zeroes=on
dz_case dzunmap raw base.img --discard=unmap --detect-zeroes=unmap
dz_case dzqon qcow2 dz.qcow2 --detect-zeroes=on
dz_case dzqunmap qcow2 dz.qcow2 --discard=unmap --detect-zeroes=unmap

# --- -l: an internal snapshot, read-only; -s: a temporary overlay ----------
qemu-img create -q -f qcow2 sn.qcow2 4M
qio -c 'write -P 0x51 0 1M' sn.qcow2
qemu-img snapshot -c s1 sn.qcow2
qio -c 'write -P 0x52 512k 1M' sn.qcow2
qemu-img snapshot -c s2 sn.qcow2
qio -c 'write -P 0x53 0 64k' sn.qcow2
cp sn.qcow2 sn.orig
for l in s1 snapshot.id=2,snapshot.name=s2; do
  serve q lsn -t -l "$l" -f qcow2 sn.qcow2
  serve o lsn -t -l "$l" -f qcow2 sn.qcow2
  QU=$(uri q lsn) OU=$(uri o lsn)
  same qemu-io -r -f raw -c 'read -P 0x51 0 64k' -c 'read -P 0x52 1M 64k' \
    -c 'read -P 0 2M 64k' @U@
  same nbdinfo --map @U@
  same qemu-io -f raw -c 'write 0 512' @U@
  stop q lsn
  stop o lsn
done
mkdir -p tmpq tmpo
cp base.img s.img
TMPDIR=$WORK/tmpq serve q snap -t -s -f raw s.img
TMPDIR=$WORK/tmpo serve o snap -t -s -f raw s.img
QU=$(uri q snap) OU=$(uri o snap)
same qemu-io -f raw -c 'write -P 0x66 0 1M' -c 'write -z 3M 64k' \
  -c 'discard 2M 64k' -c 'read -P 0x66 0 1M' -c 'read -P 0xbb 1M 4k' @U@
same nbdinfo --map @U@
stop q snap
stop o snap
checks=$((checks + 1))
cmp -s s.img base.img || fail "-s: the image file changed"
checks=$((checks + 1))
[[ -z "$(ls -A tmpo)" ]] || fail "-s: left in TMPDIR: $(ls -A tmpo)"
TMPDIR=$WORK/tmpq serve q snapq -t -s -A -f qcow2 sn.qcow2
TMPDIR=$WORK/tmpo serve o snapq -t -s -A -f qcow2 sn.qcow2
QU=$(uri q snapq) OU=$(uri o snapq)
same qemu-io -f raw -c 'write -P 0x67 1M 64k' -c 'read -P 0x53 0 64k' @U@
same nbdinfo --map=qemu:allocation-depth @U@
same nbdinfo --map @U@
stop q snapq
stop o snapq
checks=$((checks + 1))
cmp -s sn.qcow2 sn.orig || fail "-s: the qcow2 image file changed"
checks=$((checks + 1))
[[ -z "$(ls -A tmpo)" ]] || fail "-s: left in TMPDIR: $(ls -A tmpo)"

# --- -L: qemu-nbd and imgtool as clients listing a server's exports ---------
serve q list -t -r -A -B b0 -x exp -D "a description" -f qcow2 l2.qcow2
serve o list -t -r -A -B b0 -x exp -D "a description" -f qcow2 l2.qcow2
serve q list2 -t -r -e 3 -f raw base.img
serve o list2 -t -r -e 3 -f raw base.img
for sock in list list2; do
  QU=$SOCKDIR/q/$sock.sock OU=$SOCKDIR/o/$sock.sock
  same qemu-nbd -L -k @U@
  same "$IMGTOOL" nbd -L -k @U@
  checks=$((checks + 1))
  out_q=$(timeout 30 qemu-nbd -L -k "$QU" 2>&1; echo "rc=$?")
  out_o=$(timeout 30 "$IMGTOOL" nbd -L -k "$QU" 2>&1; echo "rc=$?")
  [[ "$out_q" == "$out_o" ]] || {
    fail "-L of qemu-nbd's $sock: imgtool's listing differs from qemu-nbd's"
    diff <(echo "$out_q") <(echo "$out_o") | head -10
  }
done
stop q list
stop o list
stop q list2
stop o list2

# --- A raw file of 1000 bytes: the export is 1024, its tail a hole ----------
head -c 1000 /dev/zero | tr '\0' '\132' >odd.img
serve q odd -t -f raw odd.img
serve o odd -t -f raw odd.img
QU=$(uri q odd) OU=$(uri o odd)
same nbdinfo --map @U@
same nbdinfo --size @U@
same qemu-img map --output=json @U@
same qemu-io -f raw -r -c 'read -v 990 34' @U@
stop q odd
stop o odd

# --- TCP on 127.0.0.1 -------------------------------------------------------
port=$($PY -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
checks=$((checks + 1))
if timeout 30 "$IMGTOOL" nbd --fork --pid-file="$SOCKDIR/o/tcp.pid" -t \
  -b 127.0.0.1 -p "$port" -f raw base.img; then
  out=$(timeout 30 qemu-img compare -f raw -F raw "nbd://127.0.0.1:$port" base.img) ||
    fail "TCP: compare: $out"
  json=$(timeout 30 nbdinfo --json "nbd://127.0.0.1:$port" | grep -v '"uri"')
  serve q tcpref -t -f raw base.img
  ref=$(timeout 30 nbdinfo --json "$(uri q tcpref)" | grep -v '"uri"')
  [[ "$json" == "$ref" ]] || fail "TCP: nbdinfo --json differs from qemu-nbd's"
  stop q tcpref
else
  fail "TCP: imgtool nbd -b 127.0.0.1 -p $port did not start"
fi
stop o tcp

# --- Hostile clients (read-only export) ------------------------------------
serve q hostile -t -r -f raw base.img
serve o hostile -t -r -f raw base.img
checks=$((checks + 1))
timeout 60 $PY "$HOSTILE" "$SOCKDIR/q/hostile.sock" >hq.out 2>&1
timeout 60 $PY "$HOSTILE" "$SOCKDIR/o/hostile.sock" >ho.out 2>&1
if ! cmp -s hq.out ho.out; then
  fail "hostile clients: answers differ (< qemu-nbd, > imgtool nbd)"
  diff hq.out ho.out | head -20
fi
checks=$((checks + 1))
grep -q '^after disc: closed$' ho.out || fail "hostile clients: $(tail -3 ho.out)"
QU=$(uri q hostile) OU=$(uri o hostile)
same qemu-img compare -f raw @U@ base.img
stop q hostile
stop o hostile

# --- Without -t: the server exits after its last client ---------------------
serve o once -f raw base.img
checks=$((checks + 1))
pid=$(cat "$SOCKDIR/o/once.pid")
timeout 30 nbdinfo --size "$(uri o once)" >/dev/null || fail "once: nbdinfo failed"
for _ in $(seq 250); do kill -0 "$pid" 2>/dev/null || break; sleep 0.02; done
if kill -0 "$pid" 2>/dev/null; then
  fail "without -t the server is still running after its client left"
fi
[[ -e "$SOCKDIR/o/once.sock" ]] && fail "without -t: the socket file is left behind"
stop o once

# --- -o/--offset: an image inside a container file (iotest 302's OVA) ------
# A qcow2 image converted into the export at offset 1536 of a raw file.
for who in q o; do
  qemu-img create -q -f raw ova.$who 4M
  qio -f raw -c 'write -P 0x11 0 1536' ova.$who
done
qemu-img create -q -f qcow2 src.qcow2 1M
qio -c 'write -P 0x22 64k 64k' src.qcow2
serve q offset -f raw -o 1536 -x exp ova.q
serve o offset -f raw --offset=0x600 -x exp ova.o
QU=$(uri q offset exp)
OU=$(uri o offset exp)
same qemu-img info @U@
same qemu-img convert -f qcow2 -O qcow2 -c src.qcow2 @U@
same qemu-img check @U@
same qemu-img compare -f qcow2 src.qcow2 @U@
stop q offset
stop o offset
same_files "-o: the container after convert" ova.q ova.o

# --- --fork -v: the daemon's standard streams are /dev/null (Debian's
# qemu-nbd 7.2 with its --fork-over-ssh fix), -v changes nothing ------------
checks=$((checks + 1))
daemon_fds() {
  local pid n
  pid=$(cat "$SOCKDIR/$1/verbose.pid")
  for n in 0 1 2; do echo "$n $(readlink "/proc/$pid/fd/$n")"; done
  echo "cwd $(readlink "/proc/$pid/cwd")"
}
serve q verbose -v -r -f raw base.img
serve o verbose --verbose -r -f raw base.img
q_fds=$(daemon_fds q)
o_fds=$(daemon_fds o)
[[ "$q_fds" == "$o_fds" && "$o_fds" == *"2 /dev/null"* ]] ||
  fail "--fork daemon's streams: qemu-nbd [$q_fds], imgtool [$o_fds]"
stop q verbose
stop o verbose

# --- Command line, compared under the name qemu-nbd -------------------------
mkdir -p bin && ln -sf "$IMGTOOL" bin/qemu-nbd
cli() {
  checks=$((checks + 1))
  local q o
  q=$(cd "$WORK" && timeout 10 qemu-nbd "$@" 2>&1; echo "rc=$?")
  o=$(cd "$WORK" && timeout 10 bin/qemu-nbd "$@" 2>&1; echo "rc=$?")
  o=${o//bin\/qemu-nbd/qemu-nbd}
  if [[ "$q" != "$o" ]]; then
    fail "qemu-nbd $*: output differs (< qemu-nbd, > imgtool as qemu-nbd)"
    diff <(echo "$q") <(echo "$o") | head -10
  fi
}
cli
cli a b
cli --frobnicate x.img
cli -z x.img
cli -x
cli -v
cli -o x base.img
cli -o 12junk base.img
cli -k "$SOCKDIR/o/none.sock" -f raw -o 99999999 base.img
cli -k "$SOCKDIR/o/none.sock" nonexistent.img
cli -k "$SOCKDIR/o/none.sock" -f qcow2 base.img
cli -k "$SOCKDIR/o/none.sock" -B nope l2.qcow2
cli -k "$SOCKDIR/o/none.sock" -B b0 -B nope l2.qcow2
cli -k "$SOCKDIR/o/none.sock" -B b0 crashed.qcow2
cli -k "$SOCKDIR/o/none.sock" -B b0 -f raw l2.qcow2
cli -k "$SOCKDIR/o/none.sock" --detect-zeroes=foo base.img
cli -k "$SOCKDIR/o/none.sock" --detect-zeroes=unmap base.img
cli -k "$SOCKDIR/o/none.sock" --detect-zeroes=unmap --discard=unmap base.img
cli -k "$SOCKDIR/o/none.sock" --discard=unmap --detect-zeroes=on --detect-zeroes=x base.img
cli -k "$SOCKDIR/o/none.sock" -l nope sn.qcow2
cli -k "$SOCKDIR/o/none.sock" -l snapshot.id=x,snapshot.foo=1 sn.qcow2
cli -k "$SOCKDIR/o/none.sock" -l snapshot.name= sn.qcow2
cli -k "$SOCKDIR/o/none.sock" -l s1 -f raw sn.qcow2
cli -L -k "$SOCKDIR/o/none.sock"
cli -L x.img
cli -L -f raw
cli -L -B b0
cli -L --fork
# --- A probed raw image of an unaligned size (iotest 241) -----------------
# QEMU gives a probed raw node a request alignment of 512: qemu-nbd
# advertises a minimum block size of 512 (1 with -f raw), and qemu-img's
# client rounds the 1000 bytes of data up to the 1024-byte export.
mkdir -p q o
printf %01000d 0 >q/u.raw
cp q/u.raw o/u.raw
for who in q o; do
  serve $who probed -t $who/u.raw
  sed "s|'o/|'q/|" "$WORK/serve.err" >"$WORK/probed.$who.err"
done
checks=$((checks + 1))
diff "$WORK/probed.q.err" "$WORK/probed.o.err" ||
  fail "probed raw export: the servers' warnings differ"
grep -q "probing guessed raw" "$WORK/probed.q.err" ||
  fail "probed raw export: qemu-nbd printed no probing warning"
QU=$(uri q probed) OU=$(uri o probed)
same nbdinfo --json @U@
same qemu-img map -f raw --output=json @U@
same qemu-io -f raw -c map @U@
checks=$((checks + 1))
nbdinfo --json "$OU" | grep -q '"block_size_minimum": 512' ||
  fail "probed raw export: imgtool nbd's minimum block size is not 512"
stop q probed
stop o probed
serve q aligned -t -f raw q/u.raw
serve o aligned -t -f raw o/u.raw
QU=$(uri q aligned) OU=$(uri o aligned)
same nbdinfo --json @U@
same qemu-img map -f raw --output=json @U@
stop q aligned
stop o aligned

checks=$((checks + 1))
"$IMGTOOL" nbd --help | grep -q -- '--persistent' || fail "imgtool nbd --help"
checks=$((checks + 1))
helplines() {
  "$@" --help | sed -n -e '/^Exposing part of the image:/,/^$/p' \
    -e '/^  -L, /p' -e '/-s, --snapshot/,/ID_OR_NAME/p' \
    -e '/--detect-zeroes=MODE/p'
}
diff <(helplines qemu-nbd) <(helplines "$IMGTOOL" nbd) ||
  fail "--help: the 'Exposing part of the image' section, -L, -s, -l, --detect-zeroes lines differ from qemu-nbd's"

echo "$checks checks, $failures failures"
((failures == 0))
