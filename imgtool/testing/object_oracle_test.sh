#!/usr/bin/env bash
# --object (QEMU's user-creatable objects: secrets) against qemu-img and
# qemu-io 7.2: imgtool installed under their names (links, as
# imgtool/install.sh makes them) must print the same stdout and stderr, exit
# with the same code and leave the same files, for every command that takes
# --object, for `--object help` / `TYPE,help`, and for bad objects (keyval
# syntax, unknown type, missing or bad id, duplicate id, bad or unexpected
# property, missing file, base64, encrypted secrets up to the decryption).
# Usage: object_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/object_oracle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi
for t in qemu-img qemu-io; do
  command -v $t >/dev/null || { echo "$t not installed"; exit 1; }
done
QEMU_IMG=$(command -v qemu-img)
QEMU_IO=$(command -v qemu-io)
mkdir -p "$WORK/bin"
ln -s "$IMGTOOL" "$WORK/bin/qemu-img"
ln -s "$IMGTOOL" "$WORK/bin/qemu-io"

# The files every case starts from.
T=$WORK/template
mkdir -p "$T"
(
  cd "$T" || exit 1
  qemu-img create -q -f qcow2 a.qcow2 1M
  qemu-io -c 'write -P 0x5a 0 64k' a.qcow2 >/dev/null
  qemu-img create -q -f qcow2 -b a.qcow2 -F qcow2 ov.qcow2
  qemu-io -c 'write -P 0x33 64k 64k' ov.qcow2 >/dev/null
  truncate -s 1M r.raw
  printf 'passw0rd' >key
  printf 'cGFzc3cwcmQ=\n' >key.b64
  printf '%032d' 0 >key32
  printf 'a\0b' >nul
  # A snapshot table at an offset that is not cluster-aligned: check's
  # "ERROR ..." line carries the program's name.
  cp a.qcow2 snapoff.qcow2
  printf '\0\0\0\1\0\0\0\0\0\1\0\10' |
    dd of=snapoff.qcow2 bs=1 seek=60 conv=notrunc status=none
) || fail "setup"

# same TOOL ARGS...: the real TOOL and imgtool under TOOL's name, each run
# in a fresh copy of the template, print the same stdout and stderr, exit
# with the same code and leave the same files. Under FILES=none both run
# in the template itself and only the output is compared (commands that
# fail before opening anything or only read).
same() {
  local tool=$1
  shift
  checks=$((checks + 1))
  if [[ ${FILES:-} == none ]]; then
    same_output_only "$tool" "$T" "$@"
    return
  fi
  local real=$QEMU_IMG
  [[ $tool == qemu-io ]] && real=$QEMU_IO
  local d="$WORK/c$checks" side
  for side in real ours; do
    mkdir -p "$d/$side"
    cp -a "$T/." "$d/$side/"
  done
  (cd "$d/real" && "$real" "$@" >../real.out 2>../real.err)
  local real_rc=$?
  (cd "$d/ours" && "$WORK/bin/$tool" "$@" >../ours.out 2>../ours.err)
  same_results "$tool $*" "$d" "$real_rc" "$?"
  local f
  # The files left behind, byte for byte (imgtool's are qemu-img's).
  for side in real ours; do
    (cd "$d/$side" && for f in $(ls -A | sort); do
      echo "$f $(stat -c %s "$f") $(md5sum <"$f")"
    done) >"$d/$side.state"
  done
  if ! cmp -s "$d/real.state" "$d/ours.state"; then
    fail "$tool $*: files differ (< real $tool, > imgtool)"
    diff "$d/real.state" "$d/ours.state" | head -10
  fi
  rm -rf "$d"
}

# same_output_only TOOL DIR ARGS...: stdout, stderr and exit code only.
same_output_only() {
  local tool=$1 dir=$2
  shift 2
  local real=$QEMU_IMG
  [[ $tool == qemu-io ]] && real=$QEMU_IO
  (cd "$dir" && "$real" "$@" >"$WORK/real.out" 2>"$WORK/real.err")
  local real_rc=$?
  (cd "$dir" && "$WORK/bin/$tool" "$@" >"$WORK/ours.out" 2>"$WORK/ours.err")
  same_results "$tool $*" "$WORK" "$real_rc" "$?"
}

SEC='secret,id=sec0,data=passw0rd'

# --- Every command that takes --object, with a good secret and with help --
same qemu-img info --object "$SEC" -f raw r.raw
same qemu-img map --object secret,id=sec0,file=key --image-opts driver=qcow2,file.filename=ov.qcow2
same qemu-img check --object "$SEC" a.qcow2
same qemu-img check snapoff.qcow2
same qemu-img map --object "$SEC" --output=json a.qcow2
same qemu-img measure --object "$SEC" -O qcow2 a.qcow2
same qemu-img compare --object "$SEC" a.qcow2 ov.qcow2
same qemu-img convert --object "$SEC" -O raw a.qcow2 out.raw
same qemu-img create --object "$SEC" -f qcow2 new.qcow2 1M
same qemu-img resize --object "$SEC" -f raw r.raw 2M
same qemu-img commit --object "$SEC" ov.qcow2
same qemu-img rebase --object "$SEC" -u -b r.raw -F raw ov.qcow2
same qemu-img amend --object "$SEC" -o lazy_refcounts=on a.qcow2
same qemu-img dd --object "$SEC" -f qcow2 -O raw if=a.qcow2 of=d.raw
same qemu-io --object "$SEC" -c 'read -P 0x5a 0 64k' -f qcow2 a.qcow2
same qemu-io --object secret,id=sec0,file=key --image-opts -c 'read 0 512' driver=qcow2,file.filename=ov.qcow2
# The rest only read, or fail before touching a file.
FILES=none
for cmd in info check map compare convert create commit rebase amend dd measure; do
  same qemu-img $cmd --object help a.qcow2
done
same qemu-img resize --object help r.raw 2M
same qemu-img info --object secret,help a.qcow2
same qemu-img convert --object secret,id=s,? a.qcow2 x.raw
same qemu-img info --object throttle-group,help a.qcow2
same qemu-img info --object foo,help a.qcow2
same qemu-img info --object help,id=x a.qcow2
same qemu-img info --object '?' a.qcow2
same qemu-io --object help -c 'read 0 512' r.raw
same qemu-io --object secret,help -c 'read 0 512' r.raw
for ty in authz-list authz-list-file authz-simple main-loop pr-manager-helper \
    secret_keyring thread-context tls-cipher-suites tls-creds-anon \
    tls-creds-psk tls-creds-x509; do
  same qemu-img info --object $ty,help a.qcow2
done
# The first --object error or help ends the command.
same qemu-img info --object help --object foo a.qcow2
same qemu-img info --object foo --object help a.qcow2
same qemu-img create --object foo -f qcow2 new.qcow2 1M
same qemu-img convert -O raw a.qcow2 out.raw --object secret,id=s
same qemu-io -c 'write 0 512' --object secret -f raw r.raw

# --- Good secrets ----------------------------------------------------------
for obj in secret,id=s0,data= secret,id=s0,data=a,,b secret,id=s0,data=x, \
    qom-type=secret,id=s0,data=x secret,id=s0,data=x,id=s1 \
    secret,id=a-b.c_d,data=x secret,id=s0,data=x,format=raw \
    secret,id=s0,file=key,format=raw secret,id=s0,file=key.b64,format=base64 \
    secret,id=s0,data=aGVsbG8=,format=base64 secret,id=s0,data=aGVsbG8,format=base64 \
    secret,id=s0,data=xyz,format=base64 secret,id=s0,data=====,format=base64 \
    secret,id=s0,data=,format=base64 secret,id=s0,file=nul \
    secret,id=s0,data=x,iv=@@ secret,id=s0,data=x,iv=AAAA; do
  same qemu-img info --object "$obj" -f raw r.raw
done
same qemu-img info --object secret,id=s0,data=x --object secret,id=s1,file=key -f raw r.raw
same qemu-img info --object secret,id=s0,data=x,id=s1 --object secret,id=s0,data=y -f raw r.raw

# --- Bad objects -----------------------------------------------------------
for obj in '' foo foo,id=x Secret,id=s0,data=x helpx id=s0 qom-type=help \
    secret secret,bogus=1 secret,id=s0 secret,id=s0,data=x,file=key \
    secret,id=s0,file=/nonexistent secret,id=s0,file= secret,id=s0,file=/ \
    secret,id=s0,file=/nonexistent,format=base64 \
    secret,id=s0,data=x,bogus=1 secret,id=0bad,bogus=1 secret,id=0bad,data=x \
    secret,id=,data=x secret,id=s0,,data=x secret,,id=s0,data=x \
    secret,id=s0,data secret,id=s0,=x secret,id=s0,data=x,1a=1 \
    secret,id=s0,data=x,a.=1 secret,id=s0,data=x,a..b=1 secret,id=s0,data=x,a.b=1 \
    secret,id=s0,data.x=1 secret,id=s0,data.0=x secret,id=s0,data=x,data.x=1 \
    secret,id=s0,data.x=1,format=hex secret,id.x=s0 \
    secret,id=s0,data=x,qom-type.x=1 secret,id=s0,data=x,qom-type=foo \
    secret,id=s0,data=x,format=hex secret,id=s0,data=x,format= \
    secret,id=s0,bogus=1,format=hex secret,id=s0,data=x,,,a=b \
    secret,id=s0,data=x,help=1 secret,id=s0,data=x,loaded=on \
    secret,id=s0,loaded=maybe secret,id=0bad,data=x,loaded=on \
    secret,id=s0,data=@@@,format=base64 'secret,id=s0,data=aGVs bG8=,format=base64' \
    secret,id=s0,data=ab-_,format=base64 secret,id=s0,file=nul,format=base64 \
    secret,id=s0,data=x,keyid=s1 secret,id=s0,data=x,keyid=s0 \
    secret,id=s0,data=@@,format=base64,keyid=zz \
    secret,id=s0,data=x,id=0bad; do
  same qemu-img info --object "$obj" -f raw r.raw
done
same qemu-img info --object secret,id=s0,data=x --object secret,id=s0,data=y -f raw r.raw
same qemu-img info --object secret,id=s0,data=x --object secret,id=s0 -f raw r.raw
same qemu-img info --object secret,id=s0,data=x,id=s1 --object secret,id=s1,data=y -f raw r.raw
same qemu-img info --object secret,id=s0,data=x --object secret,id=s0,data=x,loaded=on -f raw r.raw
# Encrypted secrets: every check before the decryption itself.
K=secret,id=k,file=key32
same qemu-img info --object secret,id=short,data=x --object secret,id=s0,data=x,keyid=short -f raw r.raw
same qemu-img info --object $K --object secret,id=s0,data=x,keyid=k -f raw r.raw
same qemu-img info --object $K --object secret,id=s0,data=x,keyid=k,iv=@ -f raw r.raw
same qemu-img info --object $K --object secret,id=s0,data=x,keyid=k,iv=AAAA -f raw r.raw
same qemu-img info --object $K --object secret,id=s0,data=@,format=base64,keyid=k,iv=AAAAAAAAAAAAAAAAAAAAAA== -f raw r.raw
same qemu-img info --object $K --object secret,id=s0,data=x,keyid=k,iv=AAAAAAAAAAAAAAAAAAAAAA== -f raw r.raw
# Bad objects in the other commands and in qemu-io.
same qemu-img create --object secret,id=s0 -f qcow2 new.qcow2 1M
same qemu-img convert --object secret,id=s0,file=/nonexistent -O raw a.qcow2 out.raw
same qemu-img commit --object bogus ov.qcow2
same qemu-img rebase --object secret -u -b r.raw -F raw ov.qcow2
same qemu-img amend --object secret,id=s0,data=x,x=y -o lazy_refcounts=on -f raw r.raw
same qemu-img resize --object secret,id=s0,data=x --object secret,id=s0,data=x -f raw r.raw 2M
same qemu-io --object secret,id=s0,file=/nonexistent -c 'read 0 512' -f raw r.raw
same qemu-io --object foo -c 'read 0 512' -f raw r.raw
same qemu-io --object secret,id=0bad,data=x -c 'read 0 512' -f raw r.raw

echo "$checks checks, $failures failures"
[[ $failures == 0 ]]
