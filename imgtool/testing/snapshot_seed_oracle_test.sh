#!/usr/bin/env bash
# Oracle test for broken qcow2 snapshot tables (issue 18): every sn_* seed
# of testdata/fuzz/qcow2 (testdata/fuzz/make_seeds.sh), plus a table offset
# QEMU's free refuses with EFBIG, run through the read-only commands (info,
# check, check --output=json, snapshot -l) and, each on a fresh twin copy,
# the changing ones (a 64 KiB write, check -r all, snapshot -a / -c / -d)
# with qemu-img / qemu-io 7.2 and with imgtool. Compared: stdout, stderr
# (program names and snapshot dates normalised), exit status and the
# resulting files byte for byte (snapshot dates masked).
# Usage: snapshot_seed_oracle_test.sh PATH_TO_IMGTOOL SEED...
set -u
IMGTOOL=$(realpath "$1")
shift
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/snapshot_seed_oracle.XXXXXX")
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
PY=$(command -v /usr/bin/python3 || command -v python3)

SEEDS=$WORK/seeds
mkdir -p "$SEEDS"
for s in "$@"; do
  cp "$s" "$SEEDS/"
done
[[ -f $SEEDS/sn_c4k.qcow2 ]] || { echo "no sn_c4k.qcow2 among the seeds"; exit 1; }
# The table at 2^63 - 2^30 - 64 KiB: reads fail (past BDRV_MAX_LENGTH), and
# check -r all's free of the table fails in qcow2_free_clusters with EFBIG.
cp "$SEEDS/sn_c4k.qcow2" "$SEEDS/sn_table_offset_max.qcow2"
printf '\x7f\xff\xff\xff\xbf\xff\x00\x00' |
  dd of="$SEEDS/sn_table_offset_max.qcow2" bs=1 seek=64 conv=notrunc status=none

# The image on stdout with the date fields (bytes 16..23) of the entries of
# a readable snapshot table zeroed; anything else is left as it is.
masked() {
  "$PY" - "$1" <<'PYEOF'
import struct, sys
d = bytearray(open(sys.argv[1], 'rb').read())
nb, off = struct.unpack('>IQ', d[60:72])
p = off
for _ in range(min(nb, 1024)):
    p = (p + 7) & ~7
    if p + 40 > len(d):
        break
    _, _, il, nl, _, _, _, _, es = struct.unpack('>QIHHIIQII', d[p:p + 40])
    d[p + 16:p + 24] = bytes(8)
    p += 40 + es + il + nl
# snapshot -c c's entry wherever it is (sn_table_on_header's header ends up
# naming no table): id "3" or "1", name "c", extra data up to 1 KiB.
for p in range(0, len(d) - 48, 8):
    il, nl = struct.unpack('>HH', d[p + 12:p + 16])
    es = struct.unpack('>I', d[p + 36:p + 40])[0]
    if il == 1 and nl == 1 and es <= 1024 and \
            d[p + 40 + es + 1:p + 40 + es + 2] == b'c':
        d[p + 16:p + 24] = bytes(8)
sys.stdout.buffer.write(bytes(d))
PYEOF
}

undate() {
  sed -E -e 's/[0-9]{4}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2}:[0-9]{2}/DATE/' \
    -e 's/"date-(sec|nsec)": [0-9]+/"date-\1": N/' \
    -e '/^disk size: /d' \
    -e '/"actual-size": /d' \
    -e '/^[0-9.]+ (bytes|KiB|MiB), [0-9]+ ops; /d' \
    -e 's/^(qemu-img|qemu-io|imgtool): /PROG: /' "$1"
}

Q=$WORK/q
I=$WORK/i
mkdir -p "$Q" "$I"

# step SEED FRESH TOOL ARGS...: runs TOOL ARGS img.qcow2 in $Q and imgtool's
# counterpart in $I (copies of SEED made first when FRESH is "fresh");
# compares streams, exit status and the files.
step() {
  local seed=$1 fresh=$2 tool=$3
  shift 3
  checks=$((checks + 1))
  if [[ $fresh == fresh ]]; then
    cp "$SEEDS/$seed.qcow2" "$Q/img.qcow2"
    cp "$SEEDS/$seed.qcow2" "$I/img.qcow2"
  fi
  local sub=()
  [[ $tool == qemu-io ]] && sub=(io)
  (cd "$Q" && timeout 60 "$tool" "$@" img.qcow2 >q.out 2>q.err)
  local q_rc=$?
  (cd "$I" && timeout 60 "$IMGTOOL" "${sub[@]}" "$@" img.qcow2 >i.out 2>i.err)
  local i_rc=$?
  local label="$seed: $tool $*"
  diff_text "$label" stdout "$(undate "$I/i.out")" "$(undate "$Q/q.out")"
  diff_text "$label" stderr "$(undate "$I/i.err")" "$(undate "$Q/q.err")"
  diff_text "$label" "exit status" "$i_rc" "$q_rc"
  if ! cmp -s <(masked "$Q/img.qcow2") <(masked "$I/img.qcow2"); then
    fail "$label: the files differ (dates masked; offset, imgtool, qemu-img)"
    cmp -l <(masked "$I/img.qcow2") <(masked "$Q/img.qcow2") 2>&1 | head -5
  fi
}

for path in "$SEEDS"/sn_*.qcow2; do
  seed=$(basename "$path" .qcow2)
  step "$seed" fresh qemu-img info
  step "$seed" keep qemu-img check
  step "$seed" keep qemu-img check --output=json
  step "$seed" keep qemu-img snapshot -l
  step "$seed" fresh qemu-io -c 'write 0 64k'
  step "$seed" fresh qemu-img check -r all
  step "$seed" fresh qemu-img snapshot -a a
  step "$seed" fresh qemu-img snapshot -c c
  step "$seed" fresh qemu-img snapshot -d b
done

finish
