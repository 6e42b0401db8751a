#!/usr/bin/env bash
# Oracle test for TLS over NBD (issue 19): a CA, server and client
# certificates (certtool) and PSK files (psktool) made at test time; copies of
# one qcow2 image exported by qemu-nbd 7.2 and by imgtool nbd with the same
# --object tls-creds-x509 / tls-creds-psk and --tls-creds, then asked the same
# questions by real clients over TLS: nbdinfo (nbds+unix://...?
# tls-certificates= / tls-psk-file=), qemu-img info / map / convert and
# qemu-io writes and reads (--object tls-creds-*,endpoint=client and
# --image-opts ...,tls-creds=,tls-hostname=), nbdcopy; the files compared
# afterwards. Refusals compared too: a client without TLS, a client without
# a certificate, with a certificate of another CA, trusting another CA, with
# a wrong PSK key, and what the servers print about them
# ("option negotiation failed: ..."); qemu-nbd's command-line errors for
# --object tls-creds-* / --tls-creds.
# Every server runs in the background with a pid file and is stopped at the
# end of its case and on every exit path (trap).
# Usage: nbd_tls_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/nbd_tls_oracle.XXXXXX")
# Unix socket paths must stay under 108 bytes (Bazel's TEST_TMPDIR is long).
SOCKDIR=$(mktemp -d /tmp/nbdtls.XXXXXX)
mkdir -p "$SOCKDIR/q" "$SOCKDIR/o"
cleanup() {
  stop_servers
  wait 2>/dev/null
  [[ -n "${KEEP_LOGS:-}" ]] && cat "$SOCKDIR"/q/*.log
  rm -rf "$WORK" "$SOCKDIR"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  LIBDIR="$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing"
else
  LIBDIR=$(realpath "$(dirname "$0")")
fi
source "$LIBDIR/oracle_lib.sh" || exit 1
# stop_pid_file, stop_servers (q/ and o/), stop; serve and uri are this
# test's own (below).
source "$LIBDIR/nbd_lib.sh" || exit 1
for t in qemu-img qemu-io qemu-nbd nbdinfo nbdcopy certtool psktool; do
  command -v $t >/dev/null || { echo "$t not installed (tools/setup.sh)"; exit 1; }
done
cd "$WORK" || exit 1

# --- Credentials ------------------------------------------------------------
# ca/: the CA; srv/: the server's directory; cli/: a client's (CA and client
# certificate); noc/: the CA only; other/: a client certificate of another
# CA (with the right CA); wrongca/: another CA's ca-cert.pem only.
mkdir -p ca srv cli noc other wrongca psk badpsk
cat >ca.info <<'EOF'
cn = imgtool test CA
ca
cert_signing_key
expiration_days = 3650
EOF
cat >server.info <<'EOF'
organization = imgtool test
cn = localhost
dns_name = localhost
ip_address = 127.0.0.1
tls_www_server
encryption_key
signing_key
expiration_days = 3650
EOF
cat >client.info <<'EOF'
organization = imgtool test
cn = client
tls_www_client
encryption_key
signing_key
expiration_days = 3650
EOF
gen() { certtool "$@" >/dev/null 2>&1 || echo "SETUP FAILED: certtool $*"; }
key() { certtool --generate-privkey --key-type=ecdsa --outfile "$1" >/dev/null 2>&1 ||
  echo "SETUP FAILED: key $1"; }
key ca/key.pem
gen --generate-self-signed --load-privkey ca/key.pem --template ca.info \
  --outfile ca/ca-cert.pem
key ca/other-key.pem
gen --generate-self-signed --load-privkey ca/other-key.pem --template ca.info \
  --outfile wrongca/ca-cert.pem
cp ca/ca-cert.pem srv/ && cp ca/ca-cert.pem cli/ && cp ca/ca-cert.pem noc/ &&
  cp ca/ca-cert.pem other/
key srv/server-key.pem
gen --generate-certificate --load-ca-certificate ca/ca-cert.pem \
  --load-ca-privkey ca/key.pem --load-privkey srv/server-key.pem \
  --template server.info --outfile srv/server-cert.pem
key cli/client-key.pem
gen --generate-certificate --load-ca-certificate ca/ca-cert.pem \
  --load-ca-privkey ca/key.pem --load-privkey cli/client-key.pem \
  --template client.info --outfile cli/client-cert.pem
key other/client-key.pem
gen --generate-certificate --load-ca-certificate wrongca/ca-cert.pem \
  --load-ca-privkey ca/other-key.pem --load-privkey other/client-key.pem \
  --template client.info --outfile other/client-cert.pem
psktool -u qemu -p psk/keys.psk >/dev/null 2>&1 || echo "SETUP FAILED: psktool"
psktool -u qemu -p badpsk/keys.psk >/dev/null 2>&1 || echo "SETUP FAILED: psktool"
W=$WORK

# serve WHO NAME ARGS...: starts qemu-nbd (WHO=q) or imgtool nbd (WHO=o) in
# the background on $SOCKDIR/WHO/NAME.sock, stderr in NAME.log, pid in
# NAME.pid; returns once the socket exists.
serve() {
  local who=$1 name=$2
  shift 2
  local prog=(qemu-nbd)
  [[ $who == o ]] && prog=("$IMGTOOL" nbd)
  local sock=$SOCKDIR/$who/$name.sock
  rm -f "$sock"
  "${prog[@]}" --pid-file="$SOCKDIR/$who/$name.pid" -k "$sock" "$@" \
    2>"$SOCKDIR/$who/$name.log" &
  for _ in $(seq 1500); do
    [[ -S "$sock" ]] && return 0
    kill -0 $! 2>/dev/null || break
    sleep 0.02
  done
  echo "SETUP FAILED: ${prog[*]} $*: $(cat "$SOCKDIR/$who/$name.log")"
}

# same CMD...: runs CMD with @S@ replaced by qemu-nbd's and imgtool's socket
# path (set in QS and OS); stdout, stderr and exit status equal once
# imgtool's socket path reads as qemu-nbd's.
same() {
  checks=$((checks + 1))
  local qargs=() oargs=() a
  for a in "$@"; do
    qargs+=("${a//@S@/$QS}")
    oargs+=("${a//@S@/$OS}")
  done
  local q_out o_out
  q_out=$(timeout 60 "${qargs[@]}" 2>&1; echo "rc=$?")
  o_out=$(timeout 60 "${oargs[@]}" 2>&1; echo "rc=$?")
  o_out=${o_out//$OS/$QS}
  # A server that refuses the client's certificate closes the socket right
  # after the handshake: whether the client's next write fails (push), its
  # read sees a reset (pull) or the end of the stream (non-properly
  # terminated) is a race between the two processes.
  local race='s/gnutls_record_(send|recv): (Error in the (push|pull) function|The TLS connection was non-properly terminated)\./gnutls_record_send or recv: (the server closed the connection)/'
  q_out=$(sed -E "$race" <<<"$q_out")
  o_out=$(sed -E "$race" <<<"$o_out")
  q_out=$(sed -E '/^[0-9.]+ (bytes|KiB|MiB), [0-9]+ ops; /d' <<<"$q_out")
  o_out=$(sed -E '/^[0-9.]+ (bytes|KiB|MiB), [0-9]+ ops; /d' <<<"$o_out")
  if [[ "$q_out" != "$o_out" ]]; then
    fail "$*: output differs (< qemu-nbd, > imgtool nbd)"
    diff <(echo "$q_out") <(echo "$o_out") | head -20
  fi
  LAST_OUT=$q_out
}

# works CMD...: as same, and the command succeeded.
works() {
  same "$@"
  [[ $LAST_OUT == *rc=0 ]] || fail "$*: failed against both servers"
}

# refused CMD...: as same, and the command failed.
refused() {
  same "$@"
  [[ $LAST_OUT == *rc=0 ]] && fail "$*: succeeded against both servers"
}

# same_log NAME: what the two servers printed on stderr, imgtool's program
# name read as qemu-nbd's.
same_log() {
  checks=$((checks + 1))
  local q o
  # qemu-nbd reports a reply it could not write (a client that left after
  # NBD_REP_ERR_TLS_REQD without NBD_OPT_ABORT: libnbd); imgtool's server
  # does not report write failures. A client that closes right after
  # connecting (imgtool's client refusing to go on without a TLS host name)
  # is a failed read of the flags or a failed write of the greeting,
  # whichever the server meets: both servers' "Failed to read flags" lines
  # are left out (the hs case counts imgtool's).
  q=$(grep -v -e 'write failed: Unable to write to socket' \
    -e 'Failed to read flags: ' "$SOCKDIR/q/$1.log")
  o=$(sed 's/^imgtool: /qemu-nbd: /' "$SOCKDIR/o/$1.log" | grep -v 'Failed to read flags: ')
  if [[ "$q" != "$o" ]]; then
    fail "$1: server stderr differs (< qemu-nbd, > imgtool nbd)"
    diff <(echo "$q") <(echo "$o") | head -20
  fi
}

same_files() {
  checks=$((checks + 1))
  cmp -s "$2" "$3" || fail "$1: files $2 and $3 differ"
}

X509_SRV="tls-creds-x509,id=t0,dir=$W/srv,endpoint=server"
X509_CLI="tls-creds-x509,id=c0,dir=$W/cli,endpoint=client"
opts() { echo "driver=nbd,server.type=unix,server.path=@S@,tls-creds=c0,tls-hostname=localhost"; }

# --- X.509: data through TLS ----------------------------------------------
qemu-img create -q -f qcow2 -o extended_l2=on base.qcow2 8M
qio -c 'write -P 0xaa 0 64k' -c 'write -P 0xbb 3M 1M' -c 'write -z 5M 64k' \
  base.qcow2
cp base.qcow2 q.qcow2 && cp base.qcow2 o.qcow2
serve q x509 -t --object "$X509_SRV" --tls-creds=t0 q.qcow2
serve o x509 -t --object "$X509_SRV" --tls-creds=t0 o.qcow2
QS=$SOCKDIR/q/x509.sock OS=$SOCKDIR/o/x509.sock
U="nbds+unix:///?socket=@S@&tls-certificates=$W/cli"
works nbdinfo --json "$U"
works nbdinfo --map "$U"
works nbdinfo --list "$U"
works qemu-img info --object "$X509_CLI" --image-opts "$(opts)"
works qemu-img map --output=json --object "$X509_CLI" --image-opts "$(opts)"
works qemu-io --object "$X509_CLI" --image-opts "$(opts)" \
  -c 'write -P 0x11 64k 128k' -c 'write -z 3M 4k' -c 'discard 4M 64k' \
  -c 'read -P 0x11 64k 128k' -c 'read -P 0xbb 3149824 64k'
works qemu-img map --output=json --object "$X509_CLI" --image-opts "$(opts)"
works qemu-img convert -O raw --object "$X509_CLI" --image-opts "$(opts)" \
  "$W/conv.raw"
rm -f "$W/conv.raw"
# tls-creds as QEMU takes them in json: filenames.
works qemu-img info --object "$X509_CLI" \
  "json:{\"driver\":\"nbd\",\"server\":{\"type\":\"unix\",\"path\":\"@S@\"},\"tls-creds\":\"c0\",\"tls-hostname\":\"localhost\"}"
checks=$((checks + 1))
nbdcopy "nbds+unix:///?socket=$QS&tls-certificates=$W/cli" q-copy.raw &&
  nbdcopy "nbds+unix:///?socket=$OS&tls-certificates=$W/cli" o-copy.raw ||
  fail "nbdcopy over TLS failed"
same_files "nbdcopy over TLS" q-copy.raw o-copy.raw

# client ARGS...: imgtool's nbd client and qemu-img run ARGS (@S@: each
# server's socket in turn) and print the same, imgtool's name read as
# qemu-img's.
client() {
  local sock a q o args
  for sock in "$QS" "$OS"; do
    checks=$((checks + 1))
    args=()
    for a in "$@"; do args+=("${a//@S@/$sock}"); done
    q=$(timeout 60 qemu-img "${args[@]}" 2>&1; echo "rc=$?")
    o=$(timeout 60 "$IMGTOOL" "${args[@]}" 2>&1; echo "rc=$?")
    o=${o//imgtool:/qemu-img:}
    if [[ "$q" != "$o" ]]; then
      fail "imgtool $* on $sock: differs from qemu-img (< qemu-img, > imgtool)"
      diff <(echo "$q") <(echo "$o") | head -10
    fi
  done
}
client info --object "$X509_CLI" --image-opts "$(opts)"
client map --output=json --object "$X509_CLI" --image-opts "$(opts)"
client info --object "$X509_CLI" \
  "json:{\"driver\":\"nbd\",\"server\":{\"type\":\"unix\",\"path\":\"@S@\"},\"tls-creds\":\"c0\",\"tls-hostname\":\"localhost\"}"
client info "nbd+unix:///?socket=@S@"
client info --object "$X509_CLI" --image-opts \
  "driver=nbd,server.type=unix,server.path=@S@,tls-creds=c0"
client info --image-opts "driver=nbd,server.type=unix,server.path=@S@,tls-creds=zz"
client info --object "${X509_CLI/client/server}" --image-opts "$(opts)"
checks=$((checks + 1))
"$IMGTOOL" convert -O raw --object "$X509_CLI" --image-opts "$(opts | sed "s|@S@|$OS|")" \
  o-client.raw 2>&1 && cmp -s o-client.raw o-copy.raw ||
  fail "imgtool convert from imgtool nbd over TLS: not the nbdcopy copy"

# --- nbds:// URIs (imgtool's: qemu-img 7.2 has no such protocol) ----------
# libnbd's tls-certificates=DIR: the map and the copy qemu-img makes through
# tls-creds.
N="nbds+unix:///?socket=@S@&tls-certificates=$W/cli"
works "$IMGTOOL" map --output=json "$N"
checks=$((checks + 1))
[[ "$LAST_OUT" == "$(qemu-img map --output=json --object "$X509_CLI" \
  --image-opts "$(opts | sed "s|@S@|$QS|")" 2>&1; echo "rc=$?")" ]] ||
  fail "imgtool map nbds://: not qemu-img's map through tls-creds"
checks=$((checks + 1))
"$IMGTOOL" convert -O raw "${N//@S@/$OS}" o-nbds.raw &&
  cmp -s o-nbds.raw o-client.raw ||
  fail "imgtool convert from nbds+unix://: not the tls-creds copy"
works "$IMGTOOL" info "$N"
checks=$((checks + 1))
[[ "$LAST_OUT" == "image: nbds+unix://?socket=$QS&tls-certificates=$W/cli"* ]] ||
  fail "imgtool info nbds://: image name: $LAST_OUT"
refused qemu-img info "$N"
checks=$((checks + 1))
[[ "$LAST_OUT" == "qemu-img: Could not open '${N//@S@/$QS}': Unknown protocol 'nbds+unix'"$'\n'"rc=1" ]] ||
  fail "qemu-img 7.2 took nbds+unix://: $LAST_OUT"
# Without certificates: a clear error.
refused "$IMGTOOL" info "nbds+unix:///?socket=@S@"
checks=$((checks + 1))
[[ "$LAST_OUT" == "imgtool: Could not open 'nbds+unix:///?socket=$QS': nbds:// needs tls-certificates=DIR in the URI or the tls-creds option"$'\n'"rc=1" ]] ||
  fail "bare nbds://: $LAST_OUT"
# Over multi-conn: 4 TLS connections to nbdkit (--tls=require, its log
# filter counts them), the data qemu-img reads.
if command -v nbdkit >/dev/null; then
  qemu-img convert -q -O raw base.qcow2 mc.raw
  rm -f "$SOCKDIR/mc.sock"
  nbdkit -U "$SOCKDIR/mc.sock" -P "$SOCKDIR/mc.pid" --tls=require \
    --tls-certificates="$W/srv" --tls-verify-peer --filter=log file \
    "$W/mc.raw" logfile="$W/mc.log" || fail "SETUP: nbdkit --tls=require"
  checks=$((checks + 1))
  "$IMGTOOL" convert -f raw -O raw \
    "nbds+unix:///?socket=$SOCKDIR/mc.sock&tls-certificates=$W/cli" mc-copy.raw &&
    cmp -s mc-copy.raw mc.raw &&
    [[ $(grep -c ' Connect .* tls=1 ' mc.log) == 4 ]] ||
    fail "convert over 4 TLS connections: $(grep -c ' Connect ' mc.log) connections or data differ"
  kill "$(cat "$SOCKDIR/mc.pid")"
fi

# --- X.509: refused clients ------------------------------------------------
# Without TLS: every option gets NBD_REP_ERR_TLS_REQD (qemu-img prints the
# server's message), NBD_OPT_EXPORT_NAME closes.
refused qemu-img info "nbd+unix:///?socket=@S@"
refused nbdinfo "nbd+unix:///?socket=@S@"
# Without a client certificate, with one of another CA: the server refuses
# it after the handshake (verify-peer=on by default).
refused nbdinfo "nbds+unix:///?socket=@S@&tls-certificates=$W/noc"
refused nbdinfo "nbds+unix:///?socket=@S@&tls-certificates=$W/other"
# Trusting another CA: the client refuses the server.
refused nbdinfo "nbds+unix:///?socket=@S@&tls-certificates=$W/wrongca"
refused "$IMGTOOL" info "nbds+unix:///?socket=@S@&tls-certificates=$W/noc"
refused "$IMGTOOL" info "nbds+unix:///?socket=@S@&tls-certificates=$W/wrongca"
refused qemu-img info --object "tls-creds-x509,id=c0,dir=$W/wrongca,endpoint=client" \
  --image-opts "$(opts)"
# The wrong host name.
refused qemu-img info --object "$X509_CLI" --image-opts \
  "driver=nbd,server.type=unix,server.path=@S@,tls-creds=c0,tls-hostname=otherhost"
stop q x509
stop o x509
same_log x509
same_files "x509 export after the writes" q.qcow2 o.qcow2
qemu-img check -q o.qcow2 || fail "qemu-img check of imgtool's export"

# --- X.509 with verify-peer=off: no client certificate needed ---------------
serve q nover -r --object "$X509_SRV,verify-peer=off" --tls-creds=t0 q.qcow2
serve o nover -r --object "$X509_SRV,verify-peer=off" --tls-creds=t0 o.qcow2
QS=$SOCKDIR/q/nover.sock OS=$SOCKDIR/o/nover.sock
works nbdinfo --map "nbds+unix:///?socket=@S@&tls-certificates=$W/noc"
stop q nover
stop o nover

# --- PSK ------------------------------------------------------------------
PSK_SRV="tls-creds-psk,id=t0,dir=$W/psk,endpoint=server"
serve q psk -t --object "$PSK_SRV" --tls-creds=t0 q.qcow2
serve o psk -t --object "$PSK_SRV" --tls-creds=t0 o.qcow2
QS=$SOCKDIR/q/psk.sock OS=$SOCKDIR/o/psk.sock
works nbdinfo --map "nbds+unix://qemu@/?socket=@S@&tls-psk-file=$W/psk/keys.psk"
PSK_CLI="tls-creds-psk,id=c0,dir=$W/psk,endpoint=client"
works qemu-io --object "$PSK_CLI" --image-opts \
  "driver=nbd,server.type=unix,server.path=@S@,tls-creds=c0" \
  -c 'write -P 0x22 1M 64k' -c 'read -P 0x22 1M 64k' -c 'read -P 0xaa 0 64k'
refused nbdinfo "nbds+unix://qemu@/?socket=@S@&tls-psk-file=$W/badpsk/keys.psk"
refused qemu-img info --object "tls-creds-psk,id=c0,dir=$W/badpsk,endpoint=client" \
  --image-opts "driver=nbd,server.type=unix,server.path=@S@,tls-creds=c0"
refused qemu-img info "nbd+unix:///?socket=@S@"
client info --object "$PSK_CLI" --image-opts \
  "driver=nbd,server.type=unix,server.path=@S@,tls-creds=c0"
stop q psk
stop o psk
same_log psk
same_files "psk export after the writes" q.qcow2 o.qcow2

# --- -L with --tls-creds -------------------------------------------------------
# listing ARGS...: qemu-nbd -L and imgtool nbd -L with ARGS (@S@: each
# server's socket in turn) print the same (imgtool's name read as
# qemu-nbd's), and the same for both servers.
listing() {
  local sock a q o args first=""
  for sock in "$QS" "$OS"; do
    checks=$((checks + 1))
    args=()
    for a in "$@"; do args+=("${a//@S@/$sock}"); done
    q=$(timeout 60 qemu-nbd -L "${args[@]}" 2>&1; echo "rc=$?")
    o=$(timeout 60 "$IMGTOOL" nbd -L "${args[@]}" 2>&1; echo "rc=$?")
    o=${o//imgtool:/qemu-nbd:}
    # A server refusing the handshake closes: push, pull or an unclean
    # end, whichever the client meets first.
    q=$(sed -E 's/^(qemu-nbd: TLS handshake failed: ).*/\1(the server closed the connection)/' <<<"$q")
    o=$(sed -E 's/^(qemu-nbd: TLS handshake failed: ).*/\1(the server closed the connection)/' <<<"$o")
    if [[ "$q" != "$o" ]]; then
      fail "nbd -L $* on $sock: differs from qemu-nbd -L (< qemu-nbd, > imgtool)"
      diff <(echo "$q") <(echo "$o") | head -10
    fi
    q=${q//$sock/@S@}
    [[ -z "$first" ]] && first=$q
    [[ "$q" == "$first" ]] || fail "nbd -L $*: qemu-nbd's and imgtool's servers list differently"
  done
  LAST_OUT=$q
}
serve q lx -t -r -x ex -D "a description" --object "$X509_SRV" --tls-creds=t0 q.qcow2
serve o lx -t -r -x ex -D "a description" --object "$X509_SRV" --tls-creds=t0 o.qcow2
QS=$SOCKDIR/q/lx.sock OS=$SOCKDIR/o/lx.sock
listing -k @S@ --object "$X509_CLI" --tls-creds=c0 --tls-hostname=localhost
checks=$((checks + 1))
[[ "$LAST_OUT" == *"export: 'ex'"*"description: a description"*rc=0 ]] ||
  fail "-L over TLS: $LAST_OUT"
listing -k @S@ --object "$X509_CLI,verify-peer=off" --tls-creds=c0
listing -k @S@ --object "$X509_CLI" --tls-creds=c0
listing -k @S@
listing -k @S@ --object "$X509_SRV" --tls-creds=t0
listing -k @S@ --object "$X509_CLI" --tls-creds=c0 --tls-authz=a0
listing -k @S@ --object "$X509_CLI" --tls-creds=zz
stop q lx
stop o lx
serve q lp -t -r --object "$PSK_SRV" --tls-creds=t0 q.qcow2
serve o lp -t -r --object "$PSK_SRV" --tls-creds=t0 o.qcow2
QS=$SOCKDIR/q/lp.sock OS=$SOCKDIR/o/lp.sock
listing -k @S@ --object "$PSK_CLI" --tls-creds=c0
listing -k @S@ --object "$X509_CLI" --tls-creds=c0 --tls-hostname=localhost
stop q lp
stop o lp
serve q ln -t -r q.qcow2
serve o ln -t -r o.qcow2
QS=$SOCKDIR/q/ln.sock OS=$SOCKDIR/o/ln.sock
listing -k @S@ --object "$X509_CLI" --tls-creds=c0 --tls-hostname=localhost
listing -k @S@ --object "$PSK_CLI" --tls-creds=c0
stop q ln
stop o ln

# --- --tls-authz -------------------------------------------------------------
# An authz-simple object allows one distinguished name (gnutls's order:
# "O=imgtool test,CN=client"); another is refused after the handshake with
# "TLS x509 authz check for DN is denied", an unknown id or an object that is
# not an authz one per client; psk and verify-peer=off do not consult it.
CLI_DN="O=imgtool test,,CN=client"
authz_case() {  # NAME SERVER-ARGS...
  local n=$1
  shift
  serve q "$n" -t -r "$@" q.qcow2
  serve o "$n" -t -r "$@" o.qcow2
  QS=$SOCKDIR/q/$n.sock OS=$SOCKDIR/o/$n.sock
}
authz_case zallow --object "$X509_SRV" --object "authz-simple,id=a0,identity=$CLI_DN" \
  --tls-creds=t0 --tls-authz=a0
works nbdinfo --map "nbds+unix:///?socket=@S@&tls-certificates=$W/cli"
works qemu-img info --object "$X509_CLI" --image-opts "$(opts)"
for bad in "--object authz-simple,id=a0,identity=CN=client --tls-authz=a0" \
    "--tls-authz=zz" "--object secret,id=a0,data=x --tls-authz=a0"; do
  # shellcheck disable=SC2086
  authz_case zdeny --object "$X509_SRV" --tls-creds=t0 $bad
  refused nbdinfo --map "nbds+unix:///?socket=@S@&tls-certificates=$W/cli"
  stop q zdeny
  stop o zdeny
  same_log zdeny
  checks=$((checks + 1))
  grep -q -e 'authz check for O=imgtool test,CN=client is denied' \
    -e 'Cannot find QAuthZ object ID zz' -e "Object 'a0' is not a QAuthZ subclass" \
    "$SOCKDIR/o/zdeny.log" || fail "--tls-authz $bad: $(cat "$SOCKDIR/o/zdeny.log")"
done
stop q zallow
stop o zallow
same_log zallow
authz_case znover --object "$X509_SRV,verify-peer=off" \
  --object authz-simple,id=a0,identity=CN=x --tls-creds=t0 --tls-authz=a0
works nbdinfo --map "nbds+unix:///?socket=@S@&tls-certificates=$W/noc"
stop q znover
stop o znover
authz_case zpsk --object "$PSK_SRV" --object authz-simple,id=a0,identity=CN=x \
  --tls-creds=t0 --tls-authz=a0
works nbdinfo --map "nbds+unix://qemu@/?socket=@S@&tls-psk-file=$W/psk/keys.psk"
stop q zpsk
stop o zpsk

# imgtool's client asking for TLS from a server without it.
serve q plain -t -r q.qcow2
serve o plain -t -r o.qcow2
QS=$SOCKDIR/q/plain.sock OS=$SOCKDIR/o/plain.sock
client info --object "$X509_CLI" --image-opts "$(opts)"
refused "$IMGTOOL" info "nbds+unix:///?socket=@S@&tls-certificates=$W/cli"
checks=$((checks + 1))
[[ "$LAST_OUT" == *"Denied by server for option 5 (starttls)"$'\n'"server reported: TLS not configured"$'\n'"rc=1" ]] ||
  fail "nbds:// to a server without TLS: $LAST_OUT"
stop q plain
stop o plain

# --- Handshake failures without TLS: what the servers print ----------------------
# A client leaving or erring at each step of the handshake; qemu-nbd prints
# "option negotiation failed: ..." naming the field it was reading. Each
# client waits for its server's line before the next one connects.
cat >hs.py <<'PYEOF'
import socket, struct, sys, time
sock, log = sys.argv[1], sys.argv[2]
M = 0x49484156454F5054
cases = {
    "noflags": b"", "halfflags": b"\0\0", "badflags": struct.pack(">I", 0x11),
    "nomagic": struct.pack(">I", 1), "halfmagic": struct.pack(">I", 1) + b"IHAV",
    "badmagic": struct.pack(">I", 1) + b"X" * 16,
    "nooption": struct.pack(">IQ", 1, M), "nolength": struct.pack(">IQI", 1, M, 3),
    "shortdata": struct.pack(">IQII", 1, M, 7, 20) + b"ab",
    "exportname": struct.pack(">IQII", 1, M, 1, 3) + b"abc",
    "exportshort": struct.pack(">IQII", 1, M, 1, 3) + b"a",
    "longname": struct.pack(">IQII", 1, M, 1, 5000),
    "unknowndata": struct.pack(">IQII", 1, M, 99, 100) + b"x",
}
for i, data in enumerate(cases.values()):
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.recv(18)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    time.sleep(0.05)
    s.close()
    for _ in range(1000):
        if open(log, "rb").read().count(b"option negotiation failed") > i:
            break
        time.sleep(0.02)
PYEOF
serve q hs -t -r q.qcow2
serve o hs -t -r o.qcow2
for who in q o; do
  python3 hs.py "$SOCKDIR/$who/hs.sock" "$SOCKDIR/$who/hs.log"
done
stop q hs
stop o hs
same_log hs
checks=$((checks + 1))
[[ $(grep -c 'option negotiation failed' "$SOCKDIR/o/hs.log") == 13 ]] ||
  fail "handshake failures: $(cat "$SOCKDIR/o/hs.log")"

# --- Clients dropped in the transmission phase: what the servers print -----------
# qemu-nbd prints "Disconnect client, due to: ..." for a request header cut
# short, a WRITE's payload cut short, a bad request magic and a WRITE over
# 32 MiB (both answered with EINVAL, then dropped); nothing for a READ over
# 32 MiB, an unknown command or a clean end of the stream (EINVAL replies
# or nothing, the connection kept). (Not compared: a WRITE followed by the
# end of the stream, where qemu-nbd closes the channel at the end of the
# stream while the write is in flight and prints "Failed to send reply:
# Unable to write to socket: Broken pipe"; imgtool nbd sends the reply.)
# Each client negotiates with
# NBD_OPT_EXPORT_NAME, sends its request, reads the replies until the
# server closes, and waits for its server's line before the next one
# connects.
cat >tx.py <<'PYEOF'
import socket, struct, sys, time
sock, log = sys.argv[1], sys.argv[2]
M, R = 0x49484156454F5054, 0x25609513
def req(t, length, magic=R):
    return struct.pack(">IHHQQI", magic, 0, t, 1, 0, length)
cases = [  # (bytes sent after the handshake, whether the server prints)
    (req(0, 512, 0x12345678), 1), (req(1, 33 << 20), 1),
    (req(1, 4096) + b"x" * 100, 1), (req(0, 512)[:14], 1),
    (req(0, 33 << 20), 0), (req(99, 512), 0), (b"", 0),
]
lines = 0
for data, prints in cases:
    s = socket.socket(socket.AF_UNIX)
    s.connect(sock)
    s.recv(18)
    s.sendall(struct.pack(">IQII", 1, M, 1, 0))
    got = b""
    while len(got) < 134:
        got += s.recv(200)
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    # Every reply read until the server closes (a client gone before its
    # reply is a failed send, which qemu-nbd prints too).
    s.settimeout(20)
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass
    lines += prints
    for _ in range(1000):
        if open(log, "rb").read().count(b"Disconnect client") >= lines:
            break
        time.sleep(0.02)
    s.close()
PYEOF
qemu-img create -q -f raw q.tx.raw 1M
cp q.tx.raw o.tx.raw
serve q tx -t -f raw q.tx.raw
serve o tx -t -f raw o.tx.raw
for who in q o; do
  python3 tx.py "$SOCKDIR/$who/tx.sock" "$SOCKDIR/$who/tx.log"
done
stop q tx
stop o tx
same_log tx
checks=$((checks + 1))
[[ $(grep -c 'Disconnect client, due to: ' "$SOCKDIR/o/tx.log") == 4 ]] ||
  fail "transmission failures: $(cat "$SOCKDIR/o/tx.log")"

# --- The command line ---------------------------------------------------------
# cmdline ARGS...: qemu-nbd and imgtool nbd refuse ARGS alike (stderr with
# the program's name, exit status).
cmdline() {
  checks=$((checks + 1))
  local q o
  q=$(timeout 20 qemu-nbd -k "$SOCKDIR/q/cl.sock" "$@" 2>&1; echo "rc=$?")
  o=$(timeout 20 "$IMGTOOL" nbd -k "$SOCKDIR/q/cl.sock" "$@" 2>&1; echo "rc=$?")
  o=$(sed 's/^imgtool: /qemu-nbd: /' <<<"$o")
  if [[ "$q" != "$o" ]]; then
    fail "nbd $*: differs (< qemu-nbd, > imgtool nbd)"
    diff <(echo "$q") <(echo "$o") | head -10
  fi
}
cmdline --tls-creds=t0 base.qcow2
cmdline --object secret,id=t0,data=x --tls-creds=t0 base.qcow2
cmdline --object "tls-creds-x509,id=t0,dir=$W/srv" --tls-creds=t0 base.qcow2
cmdline --object "tls-creds-x509,id=t0,dir=$W/cli,endpoint=server" --tls-creds=t0 base.qcow2
cmdline --object "tls-creds-x509,id=t0,dir=$W/nodir,endpoint=server" --tls-creds=t0 base.qcow2
cmdline --object "tls-creds-x509,id=t0,endpoint=server" --tls-creds=t0 base.qcow2
cmdline --object "tls-creds-x509,id=t0,dir=$W/srv,endpoint=sideways" --tls-creds=t0 base.qcow2
cmdline --object "tls-creds-x509,id=t0,dir=$W/srv,endpoint=server,verify-peer=maybe" --tls-creds=t0 base.qcow2
cmdline --object "tls-creds-psk,id=t0,dir=$W/srv,endpoint=server" --tls-creds=t0 base.qcow2
cmdline --object "tls-creds-psk,id=t0,dir=$W/psk,endpoint=server,username=x" --tls-creds=t0 base.qcow2
cmdline --tls-authz=a0 base.qcow2
cmdline --object authz-simple,id=a0 --object "$X509_SRV" --tls-creds=t0 --tls-authz=a0 base.qcow2
cmdline --object authz-simple,id=a0,identity=x,bogus=1 base.qcow2
cmdline --object authz-simple,id=a0,identity=x --tls-authz=a0 base.qcow2
cmdline -L --object "$X509_SRV" --tls-creds=t0 --tls-authz=a0
cmdline --object authz-simple,help
cmdline --tls-hostname=h base.qcow2
cmdline --object "$X509_SRV" --tls-creds=t0 --tls-hostname=h base.qcow2
mkdir -p badca && cp srv/server-*.pem badca/ && echo garbage >badca/ca-cert.pem
cmdline --object "tls-creds-x509,id=t0,dir=$W/badca,endpoint=server" --tls-creds=t0 base.qcow2
mkdir -p mism && cp wrongca/ca-cert.pem mism/ && cp srv/server-*.pem mism/
cmdline --object "tls-creds-x509,id=t0,dir=$W/mism,endpoint=server" --tls-creds=t0 base.qcow2

echo "$checks checks, $failures failed"
[[ $failures -eq 0 ]]
