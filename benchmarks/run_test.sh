#!/bin/bash
# Runs `run.sh --quick hint create_prealloc` (root, loop mounts) and checks the
# result files against the contract (check_results.py, which run.sh also
# runs) and a few facts: the exact set of configurations, 2 repetitions with
# their aggregates, and what the filesystems must show (the 1 MiB hint gives
# far fewer extents on XFS than hint 0; falloc/full allocate the whole image,
# off almost nothing).
set -euo pipefail
RUNFILES="${RUNFILES_DIR:-$TEST_SRCDIR}"
HERE="$RUNFILES/imgtool/benchmarks"
OUT="$TEST_TMPDIR/results"

if [[ $(id -u) != 0 ]]; then
  echo "run_test: needs root (loop mounts); skipped"
  exit 0
fi
# Bad arguments: one line naming the problem, exit status != 0, and no
# suite runs.
expect_error() {  # expect_error MESSAGE ARGS...
  local want="$1" err rc=0
  shift
  err=$("$HERE/run.sh" "$@" 2>&1 >/dev/null) || rc=$?
  if [[ $rc == 0 || "$err" != "$want" ]]; then
    echo "FAIL: run.sh $*: exit $rc, stderr:"; echo "$err"
    echo "want: $want"; exit 1
  fi
}
expect_error "run: unknown suite 'nosuch' (suites: hint create_prealloc prealloc_filter subcluster engine chain snapshot nbd)" nosuch
touch "$TEST_TMPDIR/a-file"
expect_error "run: --out $TEST_TMPDIR/a-file: cannot create the directory: File exists" \
  --quick hint --out "$TEST_TMPDIR/a-file"
expect_error "run: --out /sys/kernel: cannot write files there" --quick hint --out /sys/kernel

# A suite that fails leaves no .json in DIR (report/dashboard on DIR would
# stop at it): a filter that matches nothing makes Google Benchmark write an
# empty file.
rc=0
"$HERE/run.sh" --quick hint --out "$TEST_TMPDIR/f" -- --benchmark_filter=nomatch \
  >/dev/null 2>&1 || rc=$?
if [[ $rc != 1 || -n "$(cd "$TEST_TMPDIR/f" && ls -- *.json 2>/dev/null)" ]]; then
  echo "FAIL: failed suite: exit $rc, DIR:"; ls -la "$TEST_TMPDIR/f"; exit 1
fi

# Killed in the middle of a suite (Ctrl-C signals the whole process group):
# no loop filesystem of the run stays mounted, no backing file stays.
KILLED="$TEST_TMPDIR/killed"
mkdir -p "$KILLED"
TMPDIR="$KILLED" setsid "$HERE/run.sh" --quick hint --out "$TEST_TMPDIR/k" \
  >"$TEST_TMPDIR/killed.log" 2>&1 &
pid=$!
for _ in $(seq 300); do
  grep -q " $KILLED/imgtool-bench\.[^/ ]*/loop_mount_mnt_" /proc/self/mounts && break
  sleep 0.1
done
grep -q " $KILLED/" /proc/self/mounts || { echo "FAIL: no mount seen"; exit 1; }
kill -TERM -- "-$pid"
rc=0
wait "$pid" || rc=$?
if [[ $rc != 143 ]] || grep -q " $KILLED/" /proc/self/mounts ||
   [[ -n "$(ls -A "$KILLED")" ]]; then
  echo "FAIL: after kill: exit $rc, left behind:"
  grep " $KILLED/" /proc/self/mounts; ls -A "$KILLED"; cat "$TEST_TMPDIR/killed.log"
  exit 1
fi

"$HERE/run.sh" --quick hint create_prealloc --out "$OUT"
host=$(hostname)
ls -l "$OUT"
[[ $(ls "$OUT" | wc -l) == 2 ]] || { echo "want exactly 2 result files"; exit 1; }
/usr/bin/python3 "$HERE/check_results.py" "$OUT/hint-$host.json" "$OUT/create_prealloc-$host.json"

/usr/bin/python3 - "$OUT/hint-$host.json" "$OUT/create_prealloc-$host.json" <<'PY'
import json, sys
hint, create = (json.load(open(p)) for p in sys.argv[1:])
fails = []
def expect(cond, msg):
    if not cond:
        fails.append(msg)

def runs(data):
    out = {}
    for b in data["benchmarks"]:
        out.setdefault(b["run_name"], []).append(b)
    return out

def mean(data, run_name, counter):
    for b in data["benchmarks"]:
        if b["run_name"] == run_name and b.get("aggregate_name") == "mean":
            return b[counter]
    raise KeyError(run_name)

for data in (hint, create):
    expect(data["context"]["quick"] == "true", "context quick")
    expect(data["context"]["imgtool_commit"] != "", "imgtool_commit")
    for name, entries in runs(data).items():
        kinds = sorted(b.get("aggregate_name", "iteration") for b in entries)
        expect(kinds == ["cv", "iteration", "iteration", "mean", "median", "stddev"],
               f"{name}: entries {kinds}")
        for b in entries:
            expect(not b.get("error_occurred"), f"{name}: {b.get('error_message')}")
            if b["run_type"] == "iteration":
                expect(b["iterations"] == 1, f"{name}: iterations {b['iterations']}")

want = {f"hint/fs:{fs}/hint:{h}/op:{op}" for fs in ("xfs", "ext4")
        for h in (0, 1048576, 8388608) for op in ("write", "map")}
expect(set(runs(hint)) == want, f"hint names {sorted(set(runs(hint)) ^ want)}")
want = {f"create_prealloc/fs:{fs}/fmt:{fmt}/prealloc:{p}"
        for fs in ("xfs", "ext4", "ext4_noextents") for fmt in ("raw", "qcow2")
        for p in ("off", "falloc", "full")}
expect(set(runs(create)) == want, f"create names {sorted(set(runs(create)) ^ want)}")

size = int(hint["context"]["image_bytes"])
expect(size == 32 << 20, f"hint image_bytes {size}")
# 32 MiB of 4 KiB writes every 8 KiB: hint 0 leaves thousands of extents on
# XFS, the 1 MiB hint a few dozen at most.
e0 = mean(hint, "hint/fs:xfs/hint:0/op:write", "extents")
e1 = mean(hint, "hint/fs:xfs/hint:1048576/op:write", "extents")
expect(e0 >= 10 * e1, f"xfs extents hint 0: {e0}, 1 MiB: {e1}")
expect(e1 <= 128, f"xfs extents with the 1 MiB hint: {e1}")

size = int(create["context"]["image_bytes"])
for fs in ("xfs", "ext4", "ext4_noextents"):
    off = mean(create, f"create_prealloc/fs:{fs}/fmt:raw/prealloc:off", "allocated_bytes")
    expect(off <= 1 << 20, f"{fs} raw off allocates {off}")
    for fmt in ("raw", "qcow2"):
        for p in ("falloc", "full"):
            a = mean(create, f"create_prealloc/fs:{fs}/fmt:{fmt}/prealloc:{p}",
                     "allocated_bytes")
            expect(a >= size, f"{fs} {fmt} {p} allocates {a} < {size}")
        s = mean(create, f"create_prealloc/fs:{fs}/fmt:{fmt}/prealloc:off", "syscalls")
        expect(s > 10, f"{fs} {fmt} off: {s} syscalls")
for f in fails:
    print("FAIL:", f)
sys.exit(1 if fails else 0)
PY
echo PASS
