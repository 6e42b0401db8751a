#!/usr/bin/env bash
# imgtool advise (issue 20 part 4): option errors, refusals (missing DIR, a
# file, a read-only mount, a tmpfs too small for the matrix), cleanup (DIR's
# listing identical after a run and after SIGINT, SIGHUP and SIGTERM during
# the create table and during a workload, with the signal's exit status),
# the JSON passing check_results.py with the structure the command promises
# (whole rounds, the context keys), the human table's columns, the progress
# bar on a terminal (a pty) and its absence otherwise, and the advice's
# create lines run as printed giving the images they describe (qemu-img
# info). Never which configuration wins, nor how far the budget got: the
# machine is shared, so a workload may end with "no verdict: the budget ran
# out"; the checks take either form. Needs root for the mounts ("local").
# Usage: advise_test.sh PATH_TO_IMGTOOL PATH_TO_CHECK_RESULTS
set -u
IMGTOOL=$(realpath "$1")
CHECK=$(realpath "$2")
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi
PY=/usr/bin/python3
[[ -x $PY ]] || PY=python3

BASE=$(mktemp -d "${TEST_TMPDIR:-/tmp}/advise.XXXXXX")
MOUNTS=()
cleanup() {
  local m
  for m in "${MOUNTS[@]}"; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
  done
  rm -rf "$BASE"
}
trap cleanup EXIT
WORK="$BASE/work"
SCRATCH="$BASE"
mkdir -p "$WORK"

# expect_error WHAT WANT_STDERR ARGS...: exit 1, nothing on stdout, stderr
# exactly WANT_STDERR.
expect_error() {
  local what=$1 want=$2
  shift 2
  checks=$((checks + 1))
  local out err rc
  out=$("$IMGTOOL" advise "$@" 2>"$BASE/err")
  rc=$?
  err=$(cat "$BASE/err")
  [[ $rc -eq 1 ]] || fail "$what: exit $rc, want 1"
  [[ -z "$out" ]] || fail "$what: stdout not empty: $out"
  [[ "$err" == "$want" ]] || fail "$what: stderr
  got:  $err
  want: $want"
}

# advise_pty.py OUT TTY WAIT_FOR SIGNAL -- CMD...: runs CMD with stdout to OUT
# and stderr on a pseudo-terminal (isatty), everything the terminal got
# saved to TTY; when WAIT_FOR (bytes) appears there, sends SIGNAL (a name)
# at once. Prints the exit status as a shell gives it (128 + N for signal
# N). The synchronisation is the text itself; the 240 s limit only keeps a
# broken binary from hanging the test.
cat >"$BASE/advise_pty.py" <<'EOF'
import os, select, signal, subprocess, sys, time
out_path, tty_path, wait_for, sig = sys.argv[1:5]
cmd = sys.argv[6:]
master, slave = os.openpty()
with open(out_path, "wb") as out:
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out,
                         stderr=slave)
os.close(slave)
buf = b""
sent = False
limit = time.monotonic() + 240
while True:
    if time.monotonic() > limit:
        p.kill()
        print("advise_pty: 240 s and no end", file=sys.stderr)
        break
    ready, _, _ = select.select([master], [], [], 1)
    if not ready:
        continue
    try:
        data = os.read(master, 65536)
    except OSError:  # EIO: every writer of the terminal is gone
        break
    if not data:
        break
    buf += data
    if wait_for and not sent and wait_for.encode() in buf:
        os.kill(p.pid, getattr(signal, sig))
        sent = True
rc = p.wait()
open(tty_path, "wb").write(buf)
print(128 - rc if rc < 0 else rc)
EOF

# listing DIR: every name (hidden too), type, size and content hash.
listing() {
  (cd "$1" && find . -printf '%p %y %s\n' | sort &&
    find . -type f -exec md5sum {} + | sort)
}

echo "== option errors"
D="$BASE/dir"
mkdir -p "$D"
expect_error "--size abc" "imgtool: Invalid --size 'abc': a multiple of 2 MiB from 16M to 1P is needed" --size abc "$D"
expect_error "--size 1M" "imgtool: Invalid --size '1M': a multiple of 2 MiB from 16M to 1P is needed" --size 1M "$D"
expect_error "--size 17M" "imgtool: Invalid --size '17M': a multiple of 2 MiB from 16M to 1P is needed" --size 17M "$D"
expect_error "--time 4" "imgtool: Invalid --time '4': whole seconds from 5 to 86400" --time 4 "$D"
expect_error "--time 1.5" "imgtool: Invalid --time '1.5': whole seconds from 5 to 86400" --time 1.5 "$D"
expect_error "--workload" "imgtool: Invalid --workload 'random': random-4k, sequential, overlay or all" --workload random "$D"
expect_error "--output" "imgtool: --output must be used with human or json as argument." --output=xml "$D"
expect_error "--imgtool-commit" "imgtool: Invalid --imgtool-commit 'a b': 1 to 64 letters, digits, '-', '_' or '.'" --imgtool-commit 'a b' "$D"
USAGE="Usage: imgtool advise [--size SIZE] [--time SECONDS] [--workload random-4k|sequential|overlay|all] [--output=human|json] [--imgtool-commit ID] DIR"
expect_error "no DIR" "imgtool: Expecting one directory
$USAGE
Try 'imgtool --help' for more information" --time 5
expect_error "two DIRs" "imgtool: Expecting one directory
$USAGE
Try 'imgtool --help' for more information" "$D" "$D"
checks=$((checks + 1))
"$IMGTOOL" advise --help >"$BASE/help" 2>&1 && grep -q "^  --workload W" "$BASE/help" ||
  fail "advise --help: $(cat "$BASE/help")"

echo "== refusals"
expect_error "missing DIR" "imgtool: $BASE/nope: No such file or directory" "$BASE/nope"
: >"$BASE/afile"
expect_error "a file" "imgtool: $BASE/afile: Not a directory" "$BASE/afile"
mkdir -p "$BASE/ro" "$BASE/small"
if mount -t tmpfs -o ro,size=64m tmpfs "$BASE/ro"; then
  MOUNTS+=("$BASE/ro")
  expect_error "read-only DIR" "imgtool: $BASE/ro: not writable: Read-only file system" --size 16M "$BASE/ro"
else
  fail "cannot mount a read-only tmpfs"
fi
if mount -t tmpfs -o size=40m tmpfs "$BASE/small"; then
  MOUNTS+=("$BASE/small")
  echo keep >"$BASE/small/existing"
  before=$(listing "$BASE/small")
  expect_error "small DIR" "imgtool: $BASE/small: not enough free space for the planned matrix: it needs 132.0 MiB (images of 32M and the overlay's backing file), the filesystem has 40.0 MiB free; use a smaller --size" --size 32M "$BASE/small"
  expect_error "small DIR, no overlay" "imgtool: $BASE/small: not enough free space for the planned matrix: it needs 168.0 MiB (images of 64M), the filesystem has 40.0 MiB free; use a smaller --size" --size 64M --workload random-4k "$BASE/small"
  checks=$((checks + 1))
  [[ "$(listing "$BASE/small")" == "$before" ]] || fail "small DIR changed"
else
  fail "cannot mount a small tmpfs"
fi

# The runs go to an ext4 loop mount (FIEMAP; tmpfs has none).
R="$BASE/run"
mkdir -p "$R"
truncate -s 400M "$BASE/run.img"
if ! mkfs.ext4 -q "$BASE/run.img" || ! mount -o loop "$BASE/run.img" "$R"; then
  fail "cannot make the ext4 loop mount"
  finish
  exit 1
fi
MOUNTS+=("$R")
mkdir -p "$R/sub"
head -c 100000 /dev/urandom >"$R/sub/data.bin"
echo hello >"$R/.hidden"
before=$(listing "$R")

echo "== a JSON run (all workloads, 15 s)"
OUTDIR="$BASE/results"
mkdir -p "$OUTDIR"
JSON="$OUTDIR/advise-$(hostname).json"
checks=$((checks + 1))
"$IMGTOOL" advise --size 32M --time 15 --output=json --imgtool-commit abc1234-dirty "$R" >"$JSON" 2>"$BASE/err"
rc=$?
[[ $rc -eq 0 ]] || fail "json run: exit $rc: $(cat "$BASE/err")"
# no progress bar: stderr is not a terminal
[[ ! -s "$BASE/err" ]] || fail "json run: stderr not empty: $(cat "$BASE/err")"
checks=$((checks + 1))
[[ "$(listing "$R")" == "$before" ]] || fail "json run changed DIR:
$(diff <(echo "$before") <(listing "$R"))"
checks=$((checks + 1))
"$PY" "$CHECK" "$JSON" >"$BASE/check.out" 2>&1 ||
  fail "check_results.py: $(cat "$BASE/check.out")"
checks=$((checks + 1))
"$PY" - "$JSON" "$BASE/lines" <<'EOF' || fail "json structure"
import json, sys
d = json.load(open(sys.argv[1]))
ctx, benches = d["context"], d["benchmarks"]
problems = []
if ctx["suite"] != "advise" or ctx["filesystems"] != "ext4":
    problems.append("suite/filesystems: %s %s" % (ctx["suite"], ctx["filesystems"]))
if ctx["imgtool_commit"] != "abc1234-dirty" or ctx["imgtool_version"] != "0.2.0":
    problems.append("commit/version: %s %s" % (ctx["imgtool_commit"], ctx["imgtool_version"]))
notes = ctx["notes"]
# quick: "true" exactly when the budget cut something (every cut is a note)
cut = "(time budget" in notes or "the budget ran out" in notes or "over the" in notes
if ctx["quick"] != ("true" if cut else "false"):
    problems.append("quick %s with notes %r" % (ctx["quick"], notes))
reps = {}
for b in benches:
    if b["run_type"] == "iteration":
        reps[b["run_name"]] = reps.get(b["run_name"], 0) + 1
configs = {}
for name, n in reps.items():
    _, fs, w, c = name.split("/")
    configs.setdefault(w.split(":")[1], {})[c.split(":")[1]] = n
# whole rounds: every configuration of a workload has the same repetitions
for w, c in configs.items():
    if len(set(c.values())) != 1:
        problems.append("%s: repetitions differ: %r" % (w, c))
create = configs.get("create", {})
if create and sorted(create) != sorted(
        ["raw_off", "raw_falloc", "raw_full", "qcow2_off", "qcow2_metadata",
         "qcow2_falloc", "qcow2_full"]):
    problems.append("create configs %s" % sorted(create))
if not create and "create: 0 of 5 repetitions" not in notes:
    problems.append("no create table and no note")
if create and min(create.values()) < 5 and "create: %d of 5 repetitions" % min(create.values()) not in notes:
    problems.append("create: %d repetitions without a note" % min(create.values()))
if any(c.startswith("raw") for c in configs.get("overlay", {})):
    problems.append("overlay has raw configs")
lines = []
verdicts = 0
for w in ("random-4k", "sequential", "overlay"):
    c = configs.get(w, {})
    verdict = ctx.get("winner_%s_verdict" % w, "")
    if verdict.startswith("no verdict: the budget ran out"):
        # the budget ended first: no winner, fewer than 3 rounds, a note
        if "winner_" + w in ctx or ctx.get("winner_%s_decided" % w) != "false":
            problems.append("%s: no verdict but winner keys" % w)
        if c and max(c.values()) >= 3:
            problems.append("%s: no verdict with %d rounds" % (w, max(c.values())))
        if "%s: %s" % (w, verdict) not in notes:
            problems.append("%s: no note %r" % (w, verdict))
        continue
    verdicts += 1
    if c and min(c.values()) < 3:
        problems.append("%s: a verdict from %d rounds" % (w, min(c.values())))
    must = ["qcow2_64k", "qcow2_64k_subclusters", "qcow2_64k_prealloc-filter",
            "qcow2_64k_subclusters_prealloc-filter"]
    if w != "overlay":
        must += ["raw_hint0", "raw_hint1M", "raw_hint8M"]
    for m in must:
        if m not in c:
            problems.append("%s: no %s" % (w, m))
    win = ctx.get("winner_" + w)
    line = ctx.get("winner_%s_create" % w, "")
    if win not in c:
        problems.append("winner_%s %r" % (w, win))
    if not line.startswith("imgtool create -f "):
        problems.append("winner_%s_create %r" % (w, line))
    if ctx.get("winner_%s_decided" % w) not in ("true", "false"):
        problems.append("winner_%s_decided" % w)
    lines.append("%s|%s|%s" % (win, line, ctx.get("winner_%s_image_opts" % w, "")))
print("verdicts: %d of 3; notes: %s" % (verdicts, notes))
open(sys.argv[2], "w").write("\n".join(lines) + "\n")
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
EOF

echo "== a human run on a terminal (random-4k, 10 s): the table and the progress bar"
checks=$((checks + 1))
rc=$("$PY" "$BASE/advise_pty.py" "$BASE/human" "$BASE/human.tty" "" none -- \
  "$IMGTOOL" advise --size 32M --time 10 --workload random-4k "$R")
[[ $rc == 0 ]] || fail "human run: exit $rc: $(cat -v "$BASE/human.tty")"
checks=$((checks + 1))
[[ "$(listing "$R")" == "$before" ]] || fail "human run changed DIR"
checks=$((checks + 1))
"$PY" - "$BASE/human.tty" <<'EOF' || fail "progress bar: $(cat -v "$BASE/human.tty" | tail -c 600)"
import re, sys
tty = open(sys.argv[1], "rb").read()
problems = []
# every frame: clear the line, [30 cells] PERCENT% WHAT
frames = re.findall(rb"\r\x1b\[K\[([#.]{30})\] +(\d+)% ([^\r\x1b]*)", tty)
if len(frames) < 3:
    problems.append("%d frames" % len(frames))
else:
    bars = [f[0].count(b"#") for f in frames]
    pcts = [int(f[1]) for f in frames]
    if bars != sorted(bars) or pcts != sorted(pcts):
        problems.append("not monotonic: %r %r" % (bars, pcts))
    if max(pcts[:-1]) > 99:
        problems.append("100%% before the end: %r" % pcts)
    if not any(f[2].startswith(b"create: raw_off, round 1 of ") for f in frames):
        problems.append("no create frame")
    if not any(f[2] == b"random-4k: calibrating raw_hint0" for f in frames):
        problems.append("no calibration frame")
    # the end: the bar full, "done", and a new line
    if not re.search(rb"\r\x1b\[K\[#{30}\] 100% done in \d+\.\d s\r\n$", tty):
        problems.append("does not end full: %r" % tty[-80:])
    if b"imgtool advise:" in tty or b"rank" in tty:
        problems.append("the report went to the terminal")
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
EOF
checks=$((checks + 1))
"$PY" - "$BASE/human" "$R" <<'EOF' || fail "human table: $(cat "$BASE/human")"
import re, sys
text = open(sys.argv[1]).read().split("\n")
problems = []
if not text[0].startswith("imgtool advise: %s (ext4), images of 32M, budget 10 s, took " % sys.argv[2]):
    problems.append("first line %r" % text[0])
if "\x1b" in "\n".join(text):
    problems.append("escape sequences in the report")
no_verdict = any(l.startswith("  no verdict: the budget ran out") for l in text)
heads = [l for l in text if l.startswith("rank") or l.startswith("configuration")]
want_bench = ["rank", "configuration", "IOPS", "MiB/s", "spread", "extents",
              "space", "MiB", "create", "ms"]
want_create = ["configuration", "create", "ms", "extents", "space", "MiB"]
if [h.split() for h in heads] != [want_create, want_bench] and not no_verdict:
    problems.append("headers %r" % heads)
rows = []
if any(h.startswith("rank") for h in heads):
    i = text.index(next(h for h in heads if h.startswith("rank")))
    for l in text[i + 1:]:
        if not re.match(r"^ +\d+  ", l):
            break
        rows.append(l.split())
if [int(r[0]) for r in rows] != list(range(1, len(rows) + 1)):
    problems.append("ranks %r" % [r[0] for r in rows])
for r in rows:
    if len(r) != 8 or not r[1].startswith(("raw_", "qcow2_")):
        problems.append("row %r" % r)
iops = [float(r[2].replace(",", "")) for r in rows]
if iops != sorted(iops, reverse=True):
    problems.append("not ranked by IOPS: %r" % iops)
if no_verdict:
    if any(l.startswith("Winner: ") or l.startswith("  imgtool create") for l in text):
        problems.append("no verdict, yet a winner or a create line")
    if not any(l.startswith("  random-4k: no verdict: the budget ran out") for l in text):
        problems.append("no verdict without its note")
else:
    if len(rows) < 7:
        problems.append("%d rows" % len(rows))
    if not any(l.startswith("Winner: " + rows[0][1] + ": median ") for l in text):
        problems.append("no winner line for %s" % rows[0][1])
    if not any(re.match(r"^  (TIE: tie with|better than) [a-z0-9_A-Z-]+ \(median [0-9,]+ IOPS\): [-+]", l) for l in text):
        problems.append("no verdict line")
    if not any(l.startswith("  imgtool create -f ") for l in text):
        problems.append("no create line")
for p in problems:
    print(p)
sys.exit(1 if problems else 0)
EOF

echo "== the advice's lines, run as printed"
# label -> what qemu-img info must say
check_image() {  # LABEL FILE IMAGE_OPTS
  local label=$1 file=$2 opts=$3 info want_cluster want_l2 fmt
  checks=$((checks + 1))
  if [[ $label == raw_* ]]; then
    info=$(qemu-img info --output=json "$file") || { fail "$label: qemu-img info"; return; }
    fmt=$(printf '%s' "$info" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["format"])')
    [[ $fmt == raw ]] || fail "$label: format $fmt"
    return
  fi
  local c=${label#qcow2_}
  c=${c%%_*}
  case $c in
    *k) want_cluster=$(( ${c%k} * 1024 )) ;;
    *M) want_cluster=$(( ${c%M} * 1048576 )) ;;
  esac
  want_l2=false
  [[ $label == *_subclusters* ]] && want_l2=true
  if [[ -n $opts ]]; then
    info=$(cd "$(dirname "$file")" && qemu-img info --output=json --image-opts "$opts") ||
      { fail "$label: qemu-img info --image-opts $opts"; return; }
  else
    info=$(qemu-img info --output=json "$file") || { fail "$label: qemu-img info"; return; }
  fi
  got=$(printf '%s' "$info" | "$PY" -c '
import json, sys
d = json.load(sys.stdin)
s = d.get("format-specific", {}).get("data", {})
print(d["format"], d["cluster-size"], str(s.get("extended-l2", False)).lower(), d["virtual-size"])')
  [[ $got == "qcow2 $want_cluster $want_l2 33554432" ]] ||
    fail "$label: qemu-img info says '$got', want 'qcow2 $want_cluster $want_l2 33554432'"
}
while IFS='|' read -r label line opts; do
  [[ -n $label ]] || continue
  L="$BASE/lines.$RANDOM"
  mkdir -p "$L"
  args=${line#imgtool create }
  if [[ $args == *" -b base.raw "* ]]; then
    qemu-img create -q -f raw "$L/base.raw" 32M
  fi
  (cd "$L" && eval "\"$IMGTOOL\" create $args" >/dev/null) || { fail "$line failed"; continue; }
  file=$(ls -t "$L" | grep -v base.raw | head -1)
  check_image "$label" "$L/$file" "$opts"
done <"$BASE/lines"

echo "== signals during the create table and during a workload"
# signal_case SIGNAL WANT_STATUS PHASE WAIT_FOR ARGS...: advise on a terminal,
# SIGNAL sent as soon as the progress bar shows WAIT_FOR; then the exit
# status is the signal's, nothing is printed on stdout, the bar's line is
# cleared, its last frame was still PHASE's, and DIR is as it was.
signal_case() {
  local sig=$1 want=$2 phase=$3 wait_for=$4 rc
  shift 4
  checks=$((checks + 1))
  rc=$("$PY" "$BASE/advise_pty.py" "$BASE/sig.out" "$BASE/sig.tty" "$wait_for" "$sig" -- \
    "$IMGTOOL" advise --size 32M --time 60 "$@" "$R")
  [[ $rc == "$want" ]] || fail "$sig in $phase: exit $rc, want $want: $(cat -v "$BASE/sig.tty" | tail -c 300)"
  [[ ! -s "$BASE/sig.out" ]] || fail "$sig in $phase: printed $(head -c 200 "$BASE/sig.out")"
  "$PY" - "$BASE/sig.tty" "$phase" <<'EOF' || fail "$sig in $phase: terminal $(cat -v "$BASE/sig.tty" | tail -c 300)"
import re, sys
tty = open(sys.argv[1], "rb").read()
frames = re.findall(rb"\r\x1b\[K\[[#.]{30}\] +\d+% ([^\r\x1b]*)", tty)
ok = tty.endswith(b"\r\x1b[K") and frames and frames[-1].startswith(sys.argv[2].encode())
sys.exit(0 if ok else 1)
EOF
  checks=$((checks + 1))
  [[ "$(listing "$R")" == "$before" ]] || fail "$sig in $phase left DIR changed:
$(diff <(echo "$before") <(listing "$R"))"
}
signal_case SIGINT 130 "create: " "create: raw_off"
signal_case SIGHUP 129 "create: " "create: raw_off"
signal_case SIGINT 130 "random-4k: " "random-4k: calibrating" --workload random-4k
signal_case SIGHUP 129 "overlay: " "overlay: calibrating" --workload overlay
signal_case SIGTERM 143 "sequential: " "sequential: calibrating" --workload sequential --output=json

finish
