#!/usr/bin/env bash
# Oracle test for the file driver's checks and the host_device/host_cdrom
# drivers (iotest 226): imgtool io and imgtool against qemu-io and qemu-img
# 7.2 on a directory, /dev/null, a regular file and, as root, a loop
# device: messages, exit codes, lengths, reads, writes, zero writes,
# discards, truncates, map, info and create -f host_device|host_cdrom, and
# the device's bytes afterwards.
# Not compared: qemu-io's `truncate` to another length than the device's,
# which QEMU asks for inexactly (lowering succeeds and changes nothing,
# growing is "Cannot grow device files") and imgtool exactly ("Cannot
# resize device files"), as qemu-img resize does in both.
# Usage: host_device_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/host_device_oracle.XXXXXX")
LOOP=""
cleanup() {
  [[ -n "$LOOP" ]] && losetup -d "$LOOP"
  rm -rf "$WORK"
}
trap cleanup EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi

if ! command -v qemu-io >/dev/null; then
  echo "qemu-io not installed"
  exit 1
fi

# A directory (t.qcow2, as iotest 226 names it) and a regular file.
files() {
  mkdir t.qcow2
  truncate -s 1M plain.raw
}

echo "== iotest 226: a directory and /dev/null"
for proto in file host_device host_cdrom; do
  for ro in "-r " ""; do
    same_io files -c "open ${ro}-o driver=$proto,filename=t.qcow2"
    same_io files -c "open ${ro}-o driver=$proto,filename=/dev/null,locking=off"
    same_io files -c "open ${ro}-o driver=$proto,filename=plain.raw"
  done
done
for args in "-c info /dev/null" "-r -c length /dev/null" \
  "-c map -c alloc\ 0\ 0 /dev/null" "-f raw -c info /dev/null" \
  "-c open\ -o\ driver=host_device,filename=/dev/null -c info -c map" \
  "-f file -c info /dev/null" "-r -f host_device -c length plain.raw"; do
  eval "same_io files $args"
done
for args in "info /dev/null" "info --output=json /dev/null" \
  "info -f file /dev/null" "info -f host_device /dev/null" \
  "info -f host_device plain.raw" "info file:/dev/null" \
  "info host_device:/dev/null" "map /dev/null" \
  "info --image-opts driver=raw,file.filename=/dev/null" \
  "info --image-opts driver=raw,file.driver=host_cdrom,file.filename=/dev/null" \
  "info --image-opts driver=file,filename=t.qcow2" "info t.qcow2" \
  "check -f raw t.qcow2"; do
  # shellcheck disable=SC2086
  same_messages files $args
done
# create -f host_device|host_cdrom: QEMU's bdrv_co_create_opts_simple
# (opens what exists, creates nothing).
for proto in host_device host_cdrom; do
  for args in "plain.raw 1M" "t.qcow2 1M" "missing.raw 1M" "/dev/null 0" \
    "/dev/null 1M" "/dev/null" "-q /dev/null 0" "-o help" "-o help /dev/null" \
    "-o help plain.raw" "-o preallocation=falloc missing.raw 1M" \
    "-o preallocation=bogus /dev/null 0" "-o nocow=on /dev/null 0" \
    "-o extent_size_hint=1M /dev/null 0" "-b plain.raw /dev/null 0"; do
    # shellcheck disable=SC2086
    same_messages files create -f $proto $args
  done
done
for args in "create -f raw -o help /dev/null" "create -f file -o help /dev/null" \
  "convert -O host_device plain.raw missing.raw" \
  "convert -O host_cdrom plain.raw plain2.raw" \
  "convert -O host_device plain.raw /dev/null" \
  "convert -O host_device -o preallocation=full plain.raw /dev/null" \
  "dd -O host_device if=plain.raw of=missing.raw" \
  "dd -O host_device if=plain.raw of=/dev/null"; do
  # shellcheck disable=SC2086
  same_messages files $args
done

# A loop device (root only): what both tools do to its bytes.
if [[ $(id -u) -ne 0 ]] || ! command -v losetup >/dev/null; then
  echo "not root or no losetup: loop device cases skipped"
  finish
  exit
fi
truncate -s 4M "$WORK/backing"
LOOP=$(losetup -f --show "$WORK/backing" 2>/dev/null) || LOOP=""
if [[ -z "$LOOP" ]]; then
  echo "no loop device: loop device cases skipped"
  finish
  exit
fi
head -c 4M /dev/urandom >"$WORK/seed"
dd if=/dev/zero of="$WORK/seed" bs=64k seek=16 count=16 conv=notrunc 2>/dev/null

# same_on_device TOOL_ARGS...: qemu-img/qemu-io (first word "img" or "io")
# and imgtool run on the device reset to the seed each time: same output,
# exit status and device bytes.
same_on_device() {
  local kind=$1
  shift
  checks=$((checks + 1))
  local what="$kind $*" qtool=qemu-img sub=""
  [[ $kind == io ]] && qtool=qemu-io && sub=io
  dd if="$WORK/seed" of="$LOOP" bs=1M conv=fsync 2>/dev/null
  (cd "$WORK" && $qtool "$@" >"$WORK/q.out" 2>"$WORK/q.err")
  local q_rc=$?
  local q_sum
  q_sum=$(md5sum <"$LOOP")
  dd if="$WORK/seed" of="$LOOP" bs=1M conv=fsync 2>/dev/null
  (cd "$WORK" && "$IMGTOOL" $sub "$@" >"$WORK/i.out" 2>"$WORK/i.err")
  local i_rc=$?
  local f
  for f in out err; do
    diff_text "$what" "std$f" "$(normalize_io "$WORK/i.$f" | sed "s/^imgtool: /$qtool: /")" \
      "$(normalize_io "$WORK/q.$f" | sed "s/^imgtool: /$qtool: /")" || return
  done
  diff_text "$what" "exit status" "$i_rc" "$q_rc" || return
  diff_text "$what" "device bytes" "$(md5sum <"$LOOP")" "$q_sum"
}

echo "== loop device $LOOP"
for args in "info $LOOP" "info --output=json $LOOP" "info -f raw $LOOP" \
  "info -f host_device $LOOP" "info -f file $LOOP" "map $LOOP" \
  "map --output=json $LOOP" "map --output=json host_device:$LOOP" \
  "info --image-opts driver=raw,file.filename=$LOOP" \
  "compare -f raw -F raw $LOOP seed" \
  "convert -O qcow2 $LOOP out.qcow2" "convert -n -O raw seed $LOOP" \
  "resize -f raw $LOOP 4M" "resize -f raw $LOOP 8M" \
  "resize -f raw --shrink $LOOP 3M" "create -f host_device $LOOP 1M" \
  "create -f host_device $LOOP 8M" "create -f host_device $LOOP 4M" \
  "create -f host_device -o preallocation=full $LOOP 1M" \
  "create -f host_cdrom $LOOP 1M" "create -f raw -o help $LOOP" \
  "create -f raw $LOOP 1M" "convert -O host_device seed $LOOP" \
  "dd -O host_device bs=64k count=20 if=seed of=$LOOP"; do
  # shellcheck disable=SC2086
  same_on_device img $args
done
for cmds in "length" "info" "map" "alloc 0 4M" "read -P 0 1M 1M" \
  "read -v 0 32" "write -P 0xab 512 4k" "write -z 64k 128k" \
  "write -z -u 256k 64k" "discard 512k 64k" "flush" "truncate 4M" \
  "read 4M 512" "write 3M 2M"; do
  same_on_device io -c "open -o driver=host_device,filename=$LOOP" -c "$cmds"
  same_on_device io -f raw -c "$cmds" "$LOOP"
done
same_on_device io -r -c "write 0 512" "$LOOP"
same_on_device io -c "open -o driver=file,filename=$LOOP"

echo "== image locks on the device"
# A writer holds the device: readers need -U, a second writer fails.
qemu-io -f raw -c "sleep 20000" "$LOOP" >/dev/null 2>&1 &
holder=$!
if wait_until_locked "$LOOP"; then
  for args in "info $LOOP" "info -U $LOOP" "map -U $LOOP"; do
    # shellcheck disable=SC2086
    same_messages files $args
  done
  same_io files -f raw -c "read 0 512" "$LOOP"
  same_io files -r -U -f raw -c "read 0 512" "$LOOP"
  same_io files -c "open -o driver=host_device,filename=$LOOP,locking=off" -c "read 0 512"
else
  fail "qemu-io did not lock $LOOP"
fi
kill "$holder" 2>/dev/null
wait "$holder" 2>/dev/null

finish
