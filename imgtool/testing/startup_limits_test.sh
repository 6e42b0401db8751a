#!/usr/bin/env bash
# The commands callers run before nearly every operation (info, map, check,
# create), under the limits OpenStack Nova and oVirt vdsm put on qemu-img
# (issue 20 part 2): a 1 GiB address space and 30 s of CPU
# (`prlimit --as=1073741824 --cpu=30`). imgtool prints what qemu-img 7.2
# prints under the same limits and leaves the same files; and it still
# runs under a 64 MiB address space (its peak is about 16 MiB: no large
# ring, pool or arena reserved up front), where qemu-img 7.2 aborts.
# Usage: startup_limits_test.sh PATH_TO_IMGTOOL
set -u
REAL_IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/startup_limits.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi
QEMU_IMG=$(command -v qemu-img) || { echo "qemu-img not installed"; exit 1; }

# Both tools through wrappers that set the limits; the qemu-img wrapper
# keeps the name so that its messages read "qemu-img: ...".
limits="--as=1073741824 --cpu=30"
mkdir -p "$WORK/bin"
printf '#!/bin/sh\nexec prlimit %s %s "$@"\n' "$limits" "$QEMU_IMG" >"$WORK/bin/qemu-img"
printf '#!/bin/sh\nexec prlimit %s %s "$@"\n' "$limits" "$REAL_IMGTOOL" >"$WORK/bin/imgtool"
chmod +x "$WORK/bin/qemu-img" "$WORK/bin/imgtool"
PATH="$WORK/bin:$PATH"
IMGTOOL="$WORK/bin/imgtool"

D="$WORK/d"
mkdir -p "$D"
(
  cd "$D" || exit 1
  "$QEMU_IMG" create -q -f qcow2 img.qcow2 1G
  qemu-io -c 'write -P 1 0 1M' -c 'write -P 2 512M 64k' img.qcow2 >/dev/null
  "$QEMU_IMG" create -q -f qcow2 -o extended_l2=on,cluster_size=2M -b img.qcow2 -F qcow2 top.qcow2
  truncate -s 16M plain.raw
)
for args in "info img.qcow2" "info --output=json img.qcow2" \
  "info --backing-chain top.qcow2" "map img.qcow2" "map --output=json top.qcow2" \
  "check img.qcow2" "check --output=json top.qcow2" "info plain.raw"; do
  same_output "$D" $args
done
copy() { cp -a "$D/." .; }
for args in "create -f qcow2 new.qcow2 1G" "create -f qcow2 -o preallocation=metadata new.qcow2 64M" \
  "create -f qcow2 -b img.qcow2 -F qcow2 new.qcow2" "create -f raw new.raw 1G"; do
  same_effect copy $args
done

# 64 MiB of address space: enough for imgtool.
for args in "info img.qcow2" "map --output=json top.qcow2" "check img.qcow2" \
  "create -q -f qcow2 small.qcow2 1G"; do
  checks=$((checks + 1))
  rm -f "$D/small.qcow2"
  (cd "$D" && prlimit --as=67108864 "$REAL_IMGTOOL" $args >/dev/null 2>"$WORK/err") ||
    fail "imgtool $args under a 64 MiB address space: $(head -1 "$WORK/err")"
done

echo "$checks checks, $failures failures"
[[ $failures -eq 0 ]]
