# Shared prologue of the side-by-side scripts (imgtool vs qemu-img in one
# run): source it from the repository root, then call
#   sbs_setup SCRIPT_NAME WORK_PREFIX TOOL...
# It checks for root and the named tools, builds //imgtool with $BAZEL
# (default bazel) unless $IMGTOOL names a binary, and makes a work directory
# under $WORKDIR (default /var/tmp). It sets:
#   IMGTOOL  the imgtool binary
#   work     the work directory, removed on exit
#   mnt      "$work/mnt" (created), unmounted on exit if mounted
#   loopdev  empty; a script that attaches a loop device itself stores it
#            here so that it is detached on exit
# and defines sbs_settle, to call right before every measured run, and the
# helpers below for results files and run lengths. A script sets
# SBS_CALLER_PWD=$PWD before it changes to the repository root.

# Before each measured run: write back what earlier runs left dirty
# (`sync`; XFS also finishes freeing deleted files' blocks then) and hand
# the mount's free space back to the loop device (`fstrim`, which punches it
# out of the loop's backing file), so that every run starts from the same
# filesystem and host state whichever tool or case ran before. Without it,
# runs late in a sequence ran up to 5x slower than early ones on ext4, which
# made a case measured after another look slower than it is.
sbs_settle() {
  sync
  fstrim "$mnt" 2>/dev/null || true
}

sbs_fail() {
  echo "$SBS_NAME: $*" >&2
  exit 1
}

sbs_cleanup() {
  cd /
  if mountpoint -q "$mnt" 2>/dev/null; then umount "$mnt" 2>/dev/null || umount -l "$mnt"; fi
  if [[ -n "$loopdev" ]]; then losetup -d "$loopdev" 2>/dev/null || true; fi
  rm -rf "$work"
}

sbs_setup() {
  SBS_NAME=$1
  SBS_REPO=$PWD  # the scripts source this file from the repository root
  local prefix=$2
  shift 2
  [[ $(id -u) -eq 0 ]] || sbs_fail "needs root (loop mounts)"
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || sbs_fail "$tool missing (tools/setup.sh)"
  done
  if [[ -z "${IMGTOOL:-}" ]]; then
    BAZEL=${BAZEL:-bazel}
    $BAZEL build -c opt //imgtool >&2
    IMGTOOL="$($BAZEL info -c opt bazel-bin 2>/dev/null)/imgtool/imgtool"
  fi
  [[ -x "$IMGTOOL" ]] || sbs_fail "no imgtool binary at $IMGTOOL"
  work=$(mktemp -d "${WORKDIR:-/var/tmp}/$prefix.XXXXXX")
  mnt="$work/mnt"
  loopdev=
  trap sbs_cleanup EXIT
  mkdir "$mnt"
}

# sbs_mount_loop IMAGE FS_NAME: attaches IMAGE (a file system image made by
# the caller) to a loop device, stores it in `loopdev`, mounts it at $mnt
# and sets `storage` to a description for the result file and table.
# LOOP_DIRECT_IO=1 attaches it with --direct-io=on (fails if the kernel
# did not take it): what the file system writes and reads then reaches
# $WORKDIR's disk as it sent it, as on a disk. Default 0: a buffered loop
# device, where the host's page cache and writeback of IMAGE sit between
# the file system and the disk (README, "Preallocate filter", session 33:
# there large requests ran at half the rate of many small ones).
sbs_mount_loop() {
  local image=$1 fs=$2
  if [[ ${LOOP_DIRECT_IO:-0} == 1 ]]; then
    loopdev=$(losetup --direct-io=on -f --show "$image")
    local dio
    dio=$(cat "/sys/block/${loopdev#/dev/}/loop/dio")
    [[ $dio == 1 ]] || sbs_fail "$loopdev did not take --direct-io=on (dio=$dio)"
    storage="$fs on a loop device with direct I/O (losetup --direct-io=on) on a file in ${WORKDIR:-/var/tmp}"
  else
    loopdev=$(losetup -f --show "$image")
    storage="$fs on a loop device (buffered: its backing file in ${WORKDIR:-/var/tmp} goes through the host page cache)"
  fi
  mount "$loopdev" "$mnt"
}

# sbs_umount_loop: undoes sbs_mount_loop.
sbs_umount_loop() {
  umount "$mnt"
  losetup -d "$loopdev"
  loopdev=
}

# --- results in the suites' JSON contract (benchmarks/sbs_results.py) --------
# Each measured run appends one line with sbs_record; sbs_write_results
# writes $OUT/<suite>-<hostname>.json from them (OUT: default bench-results,
# relative to the directory the script was started from, $SBS_CALLER_PWD)
# and checks it with check_results.py.

# sbs_record NAME REP COUNTER=VALUE...  (or NAME error MESSAGE...)
sbs_record() {
  echo "$*" >> "$work/records"
}

# sbs_write_results SUITE FILESYSTEMS [KEY=VALUE...]: extra context keys.
# With SBS_MIN_SECONDS set (the bench scripts: MIN_SECONDS), the file counts
# the runs shorter than that (runs_below_min_seconds) and a warning names
# them: the calibration sizes runs from unmeasured ones, and the load may
# change after it.
sbs_write_results() {
  local suite=$1 fses=$2 kv out
  shift 2
  local ctx=(--context "quick=$([[ ${QUICK:-0} == 1 ]] && echo true || echo false)")
  [[ -z ${SBS_MIN_SECONDS:-} ]] || ctx+=(--min-seconds "$SBS_MIN_SECONDS")
  for kv in "$@"; do ctx+=(--context "$kv"); done
  out=${OUT:-bench-results}
  [[ $out == /* ]] || out="${SBS_CALLER_PWD:-$PWD}/$out"
  python3 "$SBS_REPO/benchmarks/sbs_results.py" --suite "$suite" --out "$out" \
    --filesystems "$fses" "${ctx[@]}" "$work/records"
}

# sbs_bench_seconds TOOL BENCH_ARGS...: runs `TOOL bench BENCH_ARGS` and
# prints the run's time in seconds as the tool measured it (the requests
# only, not start-up or open): imgtool's `--output=json` elapsed_seconds
# (nanosecond resolution), qemu-img's "Run completed in X seconds." (it has
# no JSON and prints milliseconds: with runs of at least MIN_SECONDS = 1 s
# the rounding is below 0.05 %).
sbs_bench_seconds() {
  local tool=$1
  shift
  if [[ $(basename "$tool") == qemu-img ]]; then
    "$tool" bench "$@" | python3 -c 'import re,sys; print(re.search(r"Run completed in ([0-9.]+) seconds", sys.stdin.read()).group(1))'
  else
    "$tool" bench --output=json "$@" | python3 -c 'import json,sys; print("%.9f" % json.load(sys.stdin)["elapsed_seconds"])'
  fi
}

# sbs_size_count COUNT MAX SECONDS...: the request count for runs of at least
# MIN_SECONDS (default 1) when COUNT requests took SECONDS (one figure per
# tool: the fastest decides), with 25 % to spare, at most MAX. Prints COUNT
# itself when the fastest run already took MIN_SECONDS.
sbs_size_count() {
  python3 - "${MIN_SECONDS:-1}" "$@" <<'PY'
import math, sys
min_s, count, most = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
fastest = min(float(s) for s in sys.argv[4:])
if fastest >= min_s:
    print(count)
else:
    print(min(most, max(count + 1, math.ceil(count * min_s * 1.25 / max(fastest, 1e-6)))))
PY
}

# sbs_calibrate MAX RUN_FN ARGS...: unmeasured runs of both tools at growing
# counts until the faster one lasts MIN_SECONDS, or the count reaches MAX
# (then a warning on stderr). The first round is the warm-up: it sizes the
# count but cannot end the calibration (a cold first run is the slowest),
# so there are at least two rounds. RUN_FN TOOL COUNT ARGS... must print a
# run's seconds. Sets `count`; starts from its current value.
sbs_calibrate() {
  local most=$1 fn=$2 t_a t_b next round=0
  shift 2
  while :; do
    t_a=$("$fn" "$IMGTOOL" "$count" "$@")
    t_b=$("$fn" qemu-img "$count" "$@")
    next=$(sbs_size_count "$count" "$most" "$t_a" "$t_b")
    round=$((round + 1))
    if ((next <= count && round >= 2)); then
      if python3 -c 'import sys; sys.exit(min(map(float, sys.argv[2:])) >= float(sys.argv[1]))' "${MIN_SECONDS:-1}" "$t_a" "$t_b"; then
        echo "  warning: $count requests (the most here) took only $t_a s (imgtool) / $t_b s (qemu-img), less than MIN_SECONDS=${MIN_SECONDS:-1}" >&2
      fi
      return
    fi
    count=$next
  done
}
