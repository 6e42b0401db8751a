#!/usr/bin/env bash
# Oracle test for internal snapshots: the same sequences of snapshot
# create/apply/delete and writes run on twin images, one with qemu-img and
# qemu-io 7.2, the other with imgtool snapshot and imgtool io. After every
# step: the same stdout, stderr and exit status (snapshot dates masked), the
# files byte-identical apart from the snapshot entries' date fields,
# qemu-img check clean on imgtool's image, and every snapshot reading the
# same through `convert -l` from both images with both tools. Then mixed
# use (one image, both tools taking turns) against a QEMU-only twin, the
# -l/-s forms of convert and measure, and error messages.
# Usage: snapshot_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/snapshot_oracle.XXXXXX")
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
export TZ=UTC
# The system's python3 (a pyenv shim takes a second to start).
PY=$(command -v /usr/bin/python3 || command -v python3)

Q=$WORK/q  # QEMU's twin
I=$WORK/i  # imgtool's twin

# The image with the snapshot entries' date fields (bytes 16..23 of each
# entry) zeroed, on stdout.
masked() {
  "$PY" - "$1" <<'EOF'
import struct, sys
d = bytearray(open(sys.argv[1], 'rb').read())
nb, off = struct.unpack('>IQ', d[60:72])
p = off
for _ in range(nb):
    p = (p + 7) & ~7
    if p + 40 > len(d):  # a table past the end of the file
        break
    _, _, il, nl, _, _, _, _, es = struct.unpack('>QIHHIIQII', d[p:p + 40])
    d[p + 16:p + 24] = bytes(8)
    p += 40 + es + il + nl
sys.stdout.buffer.write(bytes(d))
EOF
}

# Dates and times in snapshot lists vary.
undate() {
  sed -E -e 's/[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}/DATE/' \
    -e 's/"date-(sec|nsec)": [0-9]+/"date-\1": N/' \
    -e '/^disk size: /d' \
    -e '/^[0-9.]+ (bytes|KiB|MiB), [0-9]+ ops; /d' \
    -e 's/^(qemu-img|qemu-io|imgtool): /PROG: /' "$1"
}

# step LABEL QEMU_TOOL ARGS...: runs QEMU_TOOL ARGS on $Q/img.qcow2 and
# imgtool's counterpart on $I/img.qcow2 (ARGS end before the file name);
# compares streams and status, then the files.
step() {
  local label=$1 tool=$2
  shift 2
  checks=$((checks + 1))
  local sub=()
  [[ $tool == qemu-io ]] && sub=(io)
  (cd "$Q" && "$tool" "$@" img.qcow2 >q.out 2>q.err)
  local q_rc=$?
  (cd "$I" && "$IMGTOOL" "${sub[@]}" "$@" img.qcow2 >i.out 2>i.err)
  local i_rc=$?
  diff_text "$label: $tool $*" stdout "$(undate "$I/i.out")" "$(undate "$Q/q.out")"
  diff_text "$label: $tool $*" stderr "$(undate "$I/i.err")" "$(undate "$Q/q.err")"
  diff_text "$label: $tool $*" "exit status" "$i_rc" "$q_rc"
  if ! cmp -s <(masked "$Q/img.qcow2") <(masked "$I/img.qcow2"); then
    fail "$label: $tool $*: the files differ (dates masked)"
    cmp <(masked "$Q/img.qcow2") <(masked "$I/img.qcow2") | head -3
  fi
}

# verify LABEL: both images clean; every snapshot and the current state
# read the same from both images through both tools' convert -l.
verify() {
  local label=$1
  checks=$((checks + 1))
  qemu-img check "$I/img.qcow2" >"$WORK/check.out" 2>&1 ||
    fail "$label: qemu-img check of imgtool's image: $(head -5 "$WORK/check.out")"
  "$IMGTOOL" check "$I/img.qcow2" >"$WORK/check.out" 2>&1 ||
    fail "$label: imgtool check: $(head -5 "$WORK/check.out")"
  local ids id
  ids=$(qemu-img snapshot -l "$Q/img.qcow2" | awk 'NR > 2 { print $1 }')
  for id in "" $ids; do
    local l=()
    [[ -n $id ]] && l=(-l "snapshot.id=$id")
    qemu-img convert "${l[@]}" -O raw "$Q/img.qcow2" "$WORK/q.raw"
    "$IMGTOOL" convert "${l[@]}" -O raw "$I/img.qcow2" "$WORK/i.raw"
    qemu-img convert "${l[@]}" -O raw "$I/img.qcow2" "$WORK/qi.raw"
    "$IMGTOOL" convert "${l[@]}" -O raw "$Q/img.qcow2" "$WORK/iq.raw"
    cmp -s "$WORK/q.raw" "$WORK/i.raw" && cmp -s "$WORK/q.raw" "$WORK/qi.raw" &&
      cmp -s "$WORK/q.raw" "$WORK/iq.raw" ||
      fail "$label: snapshot '${id:-current}' reads differently"
  done
}

# twin SETUP: both directories made afresh by the shell function SETUP
# (run in each, with QEMU's tools).
twin() {
  rm -rf "$Q" "$I"
  mkdir -p "$Q" "$I"
  (cd "$Q" && $1)
  cp -a "$Q/." "$I/"
}

# The sequence: data, compressed and zero clusters; snapshots taken,
# written over (shared data, compressed and zero clusters copied),
# applied, deleted in several orders. Compressed writes are one cluster
# ($2) each: qemu-io compresses the clusters of one request in parallel,
# and places them in the order they finish.
sequence() {
  local c=$1 cs=$2
  step "$c" qemu-io -c 'write -P 1 0 192k' -c "write -c -P 2 1M $cs" \
    -c 'write -z 2M 64k' -c 'write -P 3 3M 4k'
  step "$c" qemu-img snapshot -c s1
  step "$c" qemu-img snapshot -l
  verify "$c after -c s1"
  step "$c" qemu-io -c 'write -P 4 64k 4k' -c 'write -P 5 1M 4k' \
    -c 'write -P 6 2M 4k' -c 'write -z 0 64k' -c 'discard 128k 128k'
  step "$c" qemu-img snapshot -c s2
  step "$c" qemu-io -c 'write -P 7 3M 64k' -c "write -c -P 8 1M $cs"
  step "$c" qemu-img snapshot -c s1  # a name taken already: a new entry
  step "$c" qemu-img snapshot -l
  verify "$c three snapshots"
  step "$c" qemu-img snapshot -a 1
  step "$c" qemu-io -c 'write -P 9 0 8k' -c 'write -P 10 1M 64k'
  verify "$c after -a 1"
  step "$c" qemu-img snapshot -a s2
  step "$c" qemu-img snapshot -d s1  # the first named s1
  step "$c" qemu-img snapshot -d 2   # no snapshot named 2
  step "$c" qemu-img snapshot -l
  verify "$c after -d s1"
  step "$c" qemu-io -c 'write -P 11 64k 64k'
  step "$c" qemu-img snapshot -d s2
  step "$c" qemu-img snapshot -c s4
  step "$c" qemu-img snapshot -a s1
  verify "$c after -a s1"
  step "$c" qemu-img snapshot -d s1
  step "$c" qemu-img snapshot -d s4
  step "$c" qemu-img snapshot -l
  verify "$c all deleted"
}

std() { mk img.qcow2 4M; }
ext() { mk -o extended_l2=on img.qcow2 4M; }
small() { mk -o cluster_size=4k img.qcow2 4M; }  # several L1 entries
v2() { mk -o compat=0.10 img.qcow2 4M; }
lazy() { mk -o lazy_refcounts=on img.qcow2 4M; }
backed() {
  truncate -s 4M base.raw
  qio -f raw -c 'write -P 0x61 0 4M' base.raw
  mk -b base.raw -F raw img.qcow2 4M
}
backed_ext() {
  mk base.qcow2 4M
  qio -c 'write -P 0x62 0 4M' base.qcow2
  mk -b base.qcow2 -F qcow2 -o extended_l2=on,cluster_size=128k img.qcow2 4M
}

for setup in std:64k ext:64k small:4k v2:64k lazy:64k backed:64k \
  backed_ext:128k; do
  twin "${setup%%:*}"
  sequence "${setup%%:*}" "${setup#*:}"
done

# Apply across a resize: the snapshot's size comes back (L1 grown).
twin small
step resize qemu-io -c 'write -P 1 0 64k'
step resize qemu-img snapshot -c small
qemu-img resize -q "$Q/img.qcow2" 64M
"$IMGTOOL" resize -q "$I/img.qcow2" 64M
step resize qemu-io -c 'write -P 2 60M 64k'
step resize qemu-img snapshot -c big
step resize qemu-img snapshot -a small
step resize qemu-img info
verify resize
step resize qemu-img snapshot -a big
verify "resize back"

# refcount_bits=1: no cluster can be shared (QEMU's -22, the L1 copy
# leaked).
r1() { mk -o refcount_bits=1 img.qcow2 4M; qio -c 'write 0 512' img.qcow2; }
twin r1
step refcount_bits=1 qemu-img snapshot -c foo
step refcount_bits=1 qemu-img check

# refcount_bits=2 (at most 3): the +1 and -1 of the snapshot refcount
# update at each end of the range (1 -> 2 -> 3, a third snapshot failing
# with QEMU's -22, 3 -> 2 -> 1), data, compressed and zero clusters.
r2() {
  mk -o refcount_bits=2 img.qcow2 4M
  qio -c 'write -P 1 0 1M' -c 'write -c -P 2 1M 64k' -c 'write -z 2M 64k' img.qcow2
}
twin r2
for args in "-c a" "-c b" "-c c" "-d a" "-c d" "-d b" "-d d" "-l"; do
  # shellcheck disable=SC2086
  step refcount_bits=2 qemu-img snapshot $args
done
step refcount_bits=2 qemu-img check

# Mixed use of one image: QEMU's tools and imgtool take turns, the twin
# sees QEMU's tools only; the results are the same.
twin std
checks=$((checks + 1))
(
  cd "$Q" || exit 1
  qemu-io -c 'write -P 1 0 128k' img.qcow2 >/dev/null
  qemu-img snapshot -c a img.qcow2
  qemu-io -c 'write -P 2 64k 128k' img.qcow2 >/dev/null
  qemu-img snapshot -c b img.qcow2
  qemu-img snapshot -a a img.qcow2
  qemu-io -c 'write -P 3 0 4k' img.qcow2 >/dev/null
  qemu-img snapshot -d b img.qcow2
)
(
  cd "$I" || exit 1
  qemu-io -c 'write -P 1 0 128k' img.qcow2 >/dev/null
  "$IMGTOOL" snapshot -c a img.qcow2
  "$IMGTOOL" io -c 'write -P 2 64k 128k' img.qcow2 >/dev/null
  qemu-img snapshot -c b img.qcow2
  "$IMGTOOL" snapshot -a a img.qcow2
  qemu-io -c 'write -P 3 0 4k' img.qcow2 >/dev/null
  "$IMGTOOL" snapshot -d b img.qcow2
)
cmp -s <(masked "$Q/img.qcow2") <(masked "$I/img.qcow2") ||
  fail "mixed use: the files differ (dates masked)"
verify "mixed use"

# info shows the table as qemu-img does.
twin std
step info qemu-img snapshot -c one
step info qemu-io -c 'write 0 64k'
step info qemu-img snapshot -c two
step info qemu-img info
step info qemu-img info --output=json

# convert -l and measure -l forms and their errors.
twin std
step forms qemu-io -c 'write -P 1 0 1M'
step forms qemu-img snapshot -c one
step forms qemu-io -c 'write -P 2 0 2M'
step forms qemu-img snapshot -c 5
for l in one 1 5 2 snapshot.id=1 snapshot.name=one snapshot.id=1,snapshot.name=one \
  snapshot.id=2,snapshot.name=one snapshot.id= snapshot.name=1 nope \
  snapshot.foo=1; do
  same_output "$I" convert -l "$l" -O raw img.qcow2 out.raw
  same_output "$I" measure -l "$l" -O qcow2 img.qcow2
  same_output "$I" measure --output=json -l "$l" img.qcow2
done
same_error "$I" convert -s one -O raw img.qcow2 out.raw  # not in 7.2

# Errors and option handling (no -f: qemu-img 7.2's snapshot has none).
truncate -s 1M "$I/r.raw"
for args in "-c x r.raw" "-l r.raw" "-a x r.raw" "-d x r.raw" \
  "-a nope img.qcow2" "-d nope img.qcow2" "-U -c x img.qcow2" \
  "-U -l img.qcow2" "-l nofile.qcow2" "-q -l img.qcow2" "img.qcow2" \
  "--image-opts -l driver=qcow2,file.filename=img.qcow2"; do
  # shellcheck disable=SC2086
  same_output "$I" snapshot $args
done
for args in "-l -c x img.qcow2" "-c" "-l" "-l img.qcow2 other" \
  "-x img.qcow2" "-f qcow2 -l img.qcow2"; do
  # shellcheck disable=SC2086
  same_error "$I" snapshot $args
done

# Snapshot-table faults (QEMU 7.2's qcow2_read_snapshots,
# qcow2_check_read_snapshot_table and qcow2_check_fix_snapshot_table): an
# image with two snapshots whose table is then rewritten in place with the
# fault $FAULT. Both tools' open, list, check and `check -r all` must print
# the same and leave the same file; after the repair both checks are clean.
faulty() {
  mk img.qcow2 4M
  qio -c 'write -P 1 0 128k' img.qcow2
  qemu-img snapshot -c a img.qcow2 || echo "SETUP FAILED: snapshot a"
  qio -c 'write -P 2 64k 64k' img.qcow2
  qemu-img snapshot -c b img.qcow2 || echo "SETUP FAILED: snapshot b"
  "$PY" - img.qcow2 "$FAULT" <<'EOF2'
import struct, sys
path, fault = sys.argv[1], sys.argv[2]
d = bytearray(open(path, 'rb').read())
nb, off = struct.unpack('>IQ', d[60:72])
entries, p = [], off
for _ in range(nb):
    p = (p + 7) & ~7
    h = list(struct.unpack('>QIHHIIQII', d[p:p + 40]))
    es, il, nl = h[8], h[2], h[3]
    extra = bytes(d[p + 40:p + 40 + es])
    ids = bytes(d[p + 40 + es:p + 40 + es + il + nl])
    entries.append([h, extra, ids])
    p += 40 + es + il + nl
if fault == 'extra_big':      # entry 1: 2000 bytes of extra data
    entries[1][1] = entries[1][1] + bytes(2000 - len(entries[1][1]))
elif fault == 'v3_short':     # entries 0 and 1: 0 and 8 bytes of extra data
    entries[0][1] = b''
    entries[1][1] = entries[1][1][:8]
elif fault == 'l1_unaligned':
    entries[0][0][0] += 0x200
elif fault == 'l1_huge':
    entries[1][0][1] = 0x10000000
out, p = bytearray(), off
for h, extra, ids in entries:
    out += bytes((-len(out)) % 8)
    h[8] = len(extra)
    out += struct.pack('>QIHHIIQII', *h) + extra + ids
d[off:off + len(out)] = out
if fault == 'eof':            # the table moved past the end of the file
    d[64:72] = struct.pack('>Q', 16 << 20)
elif fault == 'too_many':     # one snapshot more than QEMU allows
    d[60:64] = struct.pack('>I', 65537)
open(path, 'wb').write(bytes(d))
EOF2
}
for FAULT in extra_big v3_short l1_unaligned l1_huge eof too_many; do
  twin faulty
  step "$FAULT" qemu-img info
  step "$FAULT" qemu-img snapshot -l
  step "$FAULT" qemu-img check
  step "$FAULT" qemu-img check --output=json
  step "$FAULT" qemu-img measure -l a -O qcow2
  step "$FAULT" qemu-img snapshot -a a
  step "$FAULT" qemu-img check -r all
  step "$FAULT" qemu-img check
  step "$FAULT" qemu-img snapshot -l
  step "$FAULT" qemu-img snapshot -d b
  step "$FAULT" qemu-img check
done

# An I/O error injected by blkdebug on cluster_free during snapshot -d
# (iotest 217): the old table's free reports it as qcow2_free_clusters
# ("qcow2_free_clusters failed: Input/output error"), then the L1's refcount
# update fails the command; the leaks are QEMU's.
# (The snapshot is made once, by qemu-img, before the twins are copied:
# the deleted table stays in the file unreferenced, date and all.)
cluster_free_setup() {
  mk img.qcow2 4M
  qio -c 'write 0 64k' img.qcow2
  qemu-img snapshot -c foo img.qcow2
}
twin cluster_free_setup
printf '[inject-error]\nevent = "cluster_free"\nerrno = "5"\n' >"$Q/bd.conf"
cp "$Q/bd.conf" "$I/bd.conf"
checks=$((checks + 1))
(cd "$Q" && qemu-img snapshot -d foo blkdebug:bd.conf:img.qcow2 >q.out 2>q.err)
q_rc=$?
(cd "$I" && "$IMGTOOL" snapshot -d foo blkdebug:bd.conf:img.qcow2 >i.out 2>i.err)
i_rc=$?
diff_text "cluster_free: snapshot -d over blkdebug" stderr \
  "$(undate "$I/i.err")" "$(undate "$Q/q.err")"
diff_text "cluster_free: snapshot -d over blkdebug" "exit status" "$i_rc" "$q_rc"
# One difference on purpose: imgtool's failed snapshot update leaves its
# dirty bit (incompatible feature bit 0, byte 79) set, so that the next
# read-write open repairs the leaks; QEMU sets none for snapshots. The
# files are otherwise the same.
checks=$((checks + 1))
"$PY" - "$I/img.qcow2" "$WORK/i-clean.qcow2" <<'EOF2'
import sys
d = bytearray(open(sys.argv[1], 'rb').read())
if d[79] & 1 == 0:
    sys.exit('imgtool left no dirty bit')
d[79] &= ~1
open(sys.argv[2], 'wb').write(bytes(d))
EOF2
cmp -s <(masked "$Q/img.qcow2") <(masked "$WORK/i-clean.qcow2") ||
  fail "cluster_free: snapshot -d over blkdebug: the files differ beyond the dirty bit"
for tool in qemu-img "$IMGTOOL"; do
  checks=$((checks + 1))
  run "$tool" . check "$Q/img.qcow2"
  q_out=$OUT q_err=$ERR q_rc=$RC
  run "$tool" . check "$I/img.qcow2"
  diff_text "cluster_free: $tool check" stdout "${OUT//$I/$Q}" "$q_out" &&
    diff_text "cluster_free: $tool check" stderr "$ERR" "$q_err" &&
    diff_text "cluster_free: $tool check" "exit status" "$RC" "$q_rc"
done

finish
