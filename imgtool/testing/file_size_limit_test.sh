#!/bin/bash
# Writes past the file size limit (`ulimit -f`, RLIMIT_FSIZE): every command
# gets EFBIG and reports it (exit status 1, "File too large"), where the
# default action of SIGXFSZ would kill imgtool with a core dump (exit status
# 153). The engines' threads (thread pool, io_uring, libaio) make the failing
# syscalls too. What qemu-img/qemu-io 7.2 print in the same situation is
# checked alongside: where imgtool words it differently, the comment says so.
# Usage: file_size_limit_test.sh IMGTOOL
set -u

IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/fsize.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
failures=0
checks=0
kLimitKiB=10240  # 10 MiB

fail() {
  echo "FAIL: $*"
  failures=$((failures + 1))
}

# limited DIR TOOL ARGS...: runs TOOL ARGS in DIR under the file size limit;
# sets OUT, ERR (without the "Sending ..." line bench prints first) and RC.
limited() {
  local dir=$1
  shift
  (cd "$dir" && ulimit -f "$kLimitKiB" && "$@" >"$WORK/out" 2>"$WORK/err")
  RC=$?
  OUT=$(cat "$WORK/out")
  ERR=$(cat "$WORK/err")
}

# expect LABEL RC OUT ERR: the last `limited` run printed exactly this.
expect() {
  checks=$((checks + 1))
  [[ $RC == "$2" ]] || fail "$1: exit status $RC, want $2 (153 = SIGXFSZ)"
  [[ $OUT == "$3" ]] || fail "$1: stdout '$OUT', want '$3'"
  [[ $ERR == "$4" ]] || fail "$1: stderr '$ERR', want '$4'"
}

# fresh: an empty directory with a 100 MiB sparse raw image, a 100 MiB qcow2
# image and 20 MiB of data to convert.
fresh() {
  D="$WORK/d"
  rm -rf "$D"
  mkdir -p "$D"
  truncate -s 100M "$D/r.raw"
  qemu-img create -q -f qcow2 "$D/q.qcow2" 100M
  head -c 20M /dev/zero | tr '\0' 'a' >"$D/src.raw"
}

echo "== create"
# qemu-img replaces EFBIG from create with "The image size is too large for
# file format 'raw'" (qcow2: "... 'qcow2' (try using a larger cluster
# size)"), exit status 1, and leaves the new file at length 0; imgtool keeps
# the cause and removes the file it created, as after ENOSPC (where
# qemu-img's qcow2 message has "Could not resize image: " before "Failed to
# resize underlying file: ...").
for c in "raw full Could not resize file" \
         "raw falloc Could not preallocate new data" \
         "raw off Could not resize file" \
         "qcow2 full Failed to resize underlying file: Could not resize file" \
         "qcow2 falloc Failed to resize underlying file: Could not preallocate new data"; do
  read -r fmt mode what <<<"$c"
  fresh
  limited "$D" "$IMGTOOL" create -q -f "$fmt" -o preallocation="$mode" x 100M
  expect "create -f $fmt -o preallocation=$mode" 1 "" \
    "imgtool: x: $what: File too large"
  [[ ! -e "$D/x" ]] || fail "create -f $fmt $mode left the file behind"
  limited "$D" qemu-img create -q -f "$fmt" -o preallocation="$mode" y 100M
  hint=""
  [[ $fmt == qcow2 ]] && hint=" (try using a larger cluster size)"
  expect "qemu-img create -f $fmt -o preallocation=$mode" 1 "" \
    "qemu-img: y: The image size is too large for file format '$fmt'$hint"
done

echo "== io (qemu-io's messages, byte for byte)"
# qemu-io prints "write failed: <strerror>" on stdout and never names the
# image; imgtool io is its twin. Default engine (io_uring), libaio (-n) and
# O_DIRECT.
for opts in "" "-n" "-t none" "-t none -n"; do
  for fmt in raw qcow2; do
    img=r.raw
    [[ $fmt == qcow2 ]] && img=q.qcow2
    # raw: a write starting past the limit, then one crossing it (a short
    # write, then EFBIG); qcow2: clusters allocated up to the limit.
    cmds=(-c 'write -q 0 1M' -c 'write -q 12M 1M' -c 'write -q 9M 2M')
    [[ $fmt == qcow2 ]] && cmds=(-c 'write -q 0 12M')
    want="write failed: File too large"
    [[ $fmt == raw ]] && want+=$'\n'"write failed: File too large"
    sums=()
    for tool in "$IMGTOOL io" qemu-io; do
      name=${tool##*/}
      fresh
      # shellcheck disable=SC2086
      limited "$D" $tool -f "$fmt" $opts "${cmds[@]}" "$img"
      expect "$name -f $fmt $opts ${cmds[*]}" 1 "$want" ""
      if [[ $fmt == qcow2 ]]; then
        [[ $(stat -c %s "$D/$img") -eq $((kLimitKiB * 1024)) ]] ||
          fail "$name -f $fmt $opts: length $(stat -c %s "$D/$img")"
        qemu-img check -q "$D/$img" || fail "$name -f $fmt $opts: check"
      fi
      sums+=("$(md5sum <"$D/$img")")
    done
    [[ ${sums[0]} == "${sums[1]}" ]] ||
      fail "io -f $fmt $opts: the image differs from qemu-io's"
  done
done

echo "== convert"
# -O qcow2: both print "error while writing at byte 8388608: File too
# large" (the request's errno, no file name).
for c in "raw|d.raw: error while converting raw: Could not resize file|e.raw: error while converting raw: Could not resize file" \
         "qcow2|error while writing at byte 8388608|error while writing at byte 8388608"; do
  IFS='|' read -r fmt mine theirs <<<"$c"
  fresh
  limited "$D" "$IMGTOOL" convert -O "$fmt" src.raw "d.$fmt"
  expect "convert -O $fmt" 1 "" "imgtool: $mine: File too large"
  limited "$D" qemu-img convert -O "$fmt" src.raw "e.$fmt"
  expect "qemu-img convert -O $fmt" 1 "" "qemu-img: $theirs: File too large"
done

echo "== resize (qemu-img's messages, which do not name the file)"
for mode in off falloc full; do
  what="Could not resize file"
  [[ $mode == falloc ]] && what="Could not preallocate new data"
  fresh
  truncate -s 4M "$D/r.raw"
  limited "$D" "$IMGTOOL" resize -f raw --preallocation=$mode r.raw 100M
  expect "resize --preallocation=$mode" 1 "" "imgtool: $what: File too large"
  limited "$D" qemu-img resize -f raw --preallocation=$mode r.raw 100M
  expect "qemu-img resize --preallocation=$mode" 1 "" \
    "qemu-img: $what: File too large"
  [[ $(stat -c %s "$D/r.raw") -eq $((4 << 20)) ]] ||
    fail "resize --preallocation=$mode changed the length"
done

echo "== bench (each engine's threads make the writes)"
# qemu-img: "Failed request: File too large"; imgtool names the file.
sending="Sending 100 write requests, 1048576 bytes each, 64 in parallel"
sending+=" (starting at offset 12582912, step size 1048576)"
for engine in threads io_uring; do
  fresh
  limited "$D" "$IMGTOOL" bench -w -f raw -i $engine -c 100 -s 1M -o 12M r.raw
  expect "bench -i $engine" 1 "$sending" \
    "imgtool: Failed request: r.raw: pwritev: File too large"
done
fresh
limited "$D" "$IMGTOOL" bench -w -f raw -t none -i native -c 100 -s 1M \
  -o 12M r.raw
expect "bench -i native" 1 "$sending" \
  "imgtool: Failed request: r.raw: pwritev: File too large"
limited "$D" qemu-img bench -w -f raw -c 100 -s 1M -o 12M r.raw
expect "qemu-img bench" 1 "$sending" "qemu-img: Failed request: File too large"

echo "$checks checks, $failures failures"
[[ $failures -eq 0 ]]
