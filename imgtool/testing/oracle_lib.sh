# Helpers for the oracle tests: run imgtool and qemu-img 7.2 on the same
# files and compare what they print and what they leave behind.
# Needs IMGTOOL (absolute path of the binary) and WORK (scratch directory);
# captured output goes to SCRATCH (default WORK), which must stay writable.

failures=0
checks=0

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# Setting up files with QEMU's tools: a failure is reported, not fatal.
mk() { qemu-img create -q -f qcow2 "$@" || echo "SETUP FAILED: create $*"; }
qio() { qemu-io "$@" >/dev/null || echo "SETUP FAILED: qemu-io $*"; }

# run TOOL DIR ARGS...: runs TOOL in DIR; sets OUT, ERR (qemu-img's name
# replaced by imgtool's) and RC.
run() {
  local tool=$1 dir=$2
  shift 2
  local scratch=${SCRATCH:-$WORK}
  (cd "$dir" && "$tool" "$@" >"$scratch/.out" 2>"$scratch/.err")
  RC=$?
  OUT=$(cat "$scratch/.out"; echo x)
  ERR=$(sed 's/qemu-img/imgtool/g' "$scratch/.err"; echo x)
}

# diff_text LABEL WHAT A B: reports a difference between two texts.
diff_text() {
  if [[ "$3" != "$4" ]]; then
    fail "$1: $2 differs (< imgtool, > qemu-img)"
    diff <(printf '%s' "$3") <(printf '%s' "$4") | head -20
    return 1
  fi
  return 0
}

# same_output DIR ARGS...: imgtool and qemu-img print the same stdout,
# stderr and exit status for ARGS, run in DIR.
same_output() {
  local dir=$1
  shift
  checks=$((checks + 1))
  run "$IMGTOOL" "$dir" "$@"
  local a_out=$OUT a_err=$ERR a_rc=$RC
  run qemu-img "$dir" "$@"
  diff_text "$*" stdout "$a_out" "$OUT" &&
    diff_text "$*" stderr "$a_err" "$ERR" &&
    diff_text "$*" "exit status" "$a_rc" "$RC"
}

# same_results WHAT DIR REAL_RC OURS_RC: one command run by the real tool
# (output in DIR/real.out, DIR/real.err) and by imgtool under that tool's
# name (DIR/ours.out, DIR/ours.err) exited with the same code and printed
# the same stdout and stderr, qemu-io's timing lines left out. WHAT names
# the command in failures; its first word is the tool.
same_results() {
  local what=$1 d=$2 real_rc=$3 ours_rc=$4 tool=${1%% *} f
  [[ $real_rc == "$ours_rc" ]] ||
    fail "$what: exit $ours_rc, $tool 7.2 exits $real_rc"
  for f in real.out ours.out; do
    sed -i -E '/^[0-9.]+ (bytes|KiB|MiB), [0-9]+ ops; /d' "$d/$f"
  done
  for f in out err; do
    if ! cmp -s "$d/real.$f" "$d/ours.$f"; then
      fail "$what: std$f differs (< real $tool, > imgtool)"
      diff "$d/real.$f" "$d/ours.$f" | head -10
    fi
  done
}

# same_error DIR ARGS...: both fail with the same exit status and the same
# first stderr line (imgtool adds its usage after usage errors).
same_error() {
  local dir=$1
  shift
  checks=$((checks + 1))
  run "$IMGTOOL" "$dir" "$@"
  local a_err=${ERR%%$'\n'*} a_rc=$RC
  run qemu-img "$dir" "$@"
  [[ $a_rc -ne 0 ]] || fail "$*: imgtool succeeded"
  diff_text "$*" "first stderr line" "$a_err" "${ERR%%$'\n'*}" &&
    diff_text "$*" "exit status" "$a_rc" "$RC"
}

# state DIR: sizes, contents (BLAKE2b) and allocation maps (SEEK_DATA/SEEK_HOLE,
# what `qemu-img map -f raw` reads) of every file in DIR, with the directory
# name left out; file_state.py says how (delayed allocation flushed, cached
# pages dropped first), in one process per directory.
# The system Python without site packages (-S; stdlib only): a pyenv shim
# first in PATH costs ~0.5 s per start, about ten times the script itself.
ORACLE_LIB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ORACLE_PYTHON=/usr/bin/python3
[[ -x $ORACLE_PYTHON ]] || ORACLE_PYTHON=python3
state() { "$ORACLE_PYTHON" -S "$ORACLE_LIB_DIR/file_state.py" "$@"; }

# same_effect SETUP ARGS...: in two fresh directories prepared by the shell
# function SETUP, runs imgtool ARGS in one and qemu-img ARGS in the other;
# output, exit status and the resulting files must be the same.
same_effect() { same_effect_of qemu-img "" "$@"; }

# same_io_effect SETUP ARGS...: the same for `imgtool io ARGS` against
# `qemu-io ARGS`.
same_io_effect() { same_effect_of qemu-io io "$@"; }

# same_effect_of QEMU_TOOL SUBCOMMAND SETUP ARGS...: imgtool [SUBCOMMAND]
# ARGS against QEMU_TOOL ARGS (QEMU_TOOL's name in its messages reads as
# imgtool's, as run() does for qemu-img). With OUT_FILTER set (a command or
# function reading stdin), both stdouts are compared through it.
same_effect_of() {
  local tool=$1 sub=$2 setup=$3
  shift 3
  checks=$((checks + 1))
  local a="$WORK/effect.a" b="$WORK/effect.b"
  local what="${sub:+$sub }$*"
  rm -rf "$a" "$b"
  mkdir -p "$a" "$b"
  (cd "$a" && $setup)
  (cd "$b" && $setup)
  run "$IMGTOOL" "$a" ${sub:+"$sub"} "$@"
  local a_out=$OUT a_err=$ERR a_rc=$RC
  run "$tool" "$b" "$@"
  if [[ -n ${OUT_FILTER:-} ]]; then
    a_out=$(printf '%s' "$a_out" | $OUT_FILTER)
    OUT=$(printf '%s' "$OUT" | $OUT_FILTER)
  fi
  local b_err=${ERR//$tool/imgtool}
  diff_text "$what" stdout "$a_out" "$OUT" &&
    diff_text "$what" stderr "$a_err" "$b_err" &&
    diff_text "$what" "exit status" "$a_rc" "$RC" &&
    diff_text "$what" "resulting files" "$(state "$a")" "$(state "$b")"
}

# same_messages SETUP ARGS...: like same_effect, but only stdout, stderr
# and exit status are compared (for documented differences in the files).
same_messages() {
  local setup=$1
  shift
  checks=$((checks + 1))
  local a="$WORK/effect.a" b="$WORK/effect.b"
  rm -rf "$a" "$b"
  mkdir -p "$a" "$b"
  (cd "$a" && $setup)
  (cd "$b" && $setup)
  run "$IMGTOOL" "$a" "$@"
  local a_out=$OUT a_err=$ERR a_rc=$RC
  run qemu-img "$b" "$@"
  diff_text "$*" stdout "$a_out" "$OUT" &&
    diff_text "$*" stderr "$a_err" "$ERR" &&
    diff_text "$*" "exit status" "$a_rc" "$RC"
}

# same_streams NAME Q_RC I_RC [sort]: compares what qemu-io and imgtool
# printed, WORK/q.{out,err} against WORK/i.{out,err}, each passed through the
# caller's `normalize FILE` (and its lines sorted with "sort": aio
# completions come in any order), then the two exit statuses.
same_streams() {
  local name=$1 q_rc=$2 i_rc=$3 sort=${4:-}
  local f
  for f in out err; do
    normalize "$WORK/q.$f" >"$WORK/q.$f.n"
    normalize "$WORK/i.$f" >"$WORK/i.$f.n"
    if [[ $sort == sort ]]; then
      sort -o "$WORK/q.$f.n" "$WORK/q.$f.n"
      sort -o "$WORK/i.$f.n" "$WORK/i.$f.n"
    fi
    if ! cmp -s "$WORK/q.$f.n" "$WORK/i.$f.n"; then
      echo "FAIL: $name: std$f differs (< qemu-io, > imgtool)"
      diff "$WORK/q.$f.n" "$WORK/i.$f.n" | head -20
      failures=$((failures + 1))
    fi
  done
  if [[ $q_rc != "$i_rc" ]]; then
    echo "FAIL: $name: exit status qemu-io $q_rc, imgtool $i_rc"
    failures=$((failures + 1))
  fi
}

# normalize_io FILE: qemu-io's timing lines vary from run to run; it names
# itself in errors.
normalize_io() {
  sed -E \
    -e '/^[0-9.]+ (bytes|KiB|MiB|GiB|TiB|PiB|EiB), [0-9]+ ops; /d' \
    -e 's/^qemu-io: /imgtool: /' "$1"
}

# io_pair SETUP ARGS...: runs `qemu-io ARGS` in $WORK/io.q and `imgtool io
# ARGS` in $WORK/io.i, both prepared by the shell function SETUP, and
# compares their stdout, stderr (normalize_io) and exit status; returns 1
# after the first difference. Counts one check.
io_pair() {
  local setup=$1
  shift
  checks=$((checks + 1))
  local q="$WORK/io.q" i="$WORK/io.i" f
  rm -rf "$q" "$i"
  mkdir -p "$q" "$i"
  (cd "$q" && $setup)
  (cd "$i" && $setup)
  (cd "$q" && qemu-io "$@" >"$WORK/q.out" 2>"$WORK/q.err")
  local q_rc=$?
  (cd "$i" && "$IMGTOOL" io "$@" >"$WORK/i.out" 2>"$WORK/i.err")
  local i_rc=$?
  for f in out err; do
    diff_text "io $*" "std$f" "$(normalize_io "$WORK/i.$f")" \
      "$(normalize_io "$WORK/q.$f")" || return 1
  done
  diff_text "io $*" "exit status" "$i_rc" "$q_rc"
}

# same_io SETUP ARGS...: io_pair, and the two leave the same files.
same_io() {
  io_pair "$@" || return
  shift
  diff_text "io $*" "resulting files" "$(state "$WORK/io.i")" \
    "$(state "$WORK/io.q")"
}

finish() {
  echo "$checks checks, $failures failures"
  [[ $failures -eq 0 ]]
}

# ofd_locked INODE: whether /proc/locks has an OFD lock on that inode
# ("1: OFDLCK ADVISORY READ -1 fe:00:INODE 100 100").
ofd_locked() {
  grep -q "OFDLCK.*:$1 " /proc/locks
}

# wait_until_locked FILE: waits (at most 5 s) until the process that opened
# FILE in the background holds its image locks: an OFD lock on FILE's inode
# (ofd_locked; any OFDLCK line is not enough, other processes hold such
# locks too), then 0.2 s for the rest of its lock bytes, taken right after
# the first.
wait_until_locked() {
  local ino _
  ino=$(stat -c %i "$1") || return 1
  for _ in $(seq 50); do
    if ofd_locked "$ino"; then
      sleep 0.2
      return 0
    fi
    sleep 0.1
  done
}

# wait_until_unlocked FILE: waits (at most 5 s) until no process holds an
# OFD lock on FILE's inode (/proc/locks, as wait_until_locked), e.g. after
# `kill -KILL` and `wait` on a process that had FILE open. Its locks can
# outlive the reaped process: an io_uring ring is torn down by the kernel's
# exit work after the process is gone, and requests it still had in flight
# hold the file, and so its OFD locks, until then (imgtool amend killed
# after 0.01 s, then qemu-img check at once: "Failed to get shared "write"
# lock" in 18 of 30 tries with io_uring, 0 of 20 with aio=threads, gone
# within one qemu-img check's time; session 29).
wait_until_unlocked() {
  local ino _
  ino=$(stat -c %i "$1") || return 1
  for _ in $(seq 100); do
    ofd_locked "$ino" || return 0
    sleep 0.05
  done
  return 1
}
