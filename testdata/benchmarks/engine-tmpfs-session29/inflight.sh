#!/bin/bash
# RAM-backed XFS loop mount; d64 4k random O_DIRECT writes; samples the
# loop device's in-flight counters at ~100 Hz during each run.
set -u
B=/dev/shm/pe; umount $B/m 2>/dev/null; rm -rf $B; mkdir -p $B/m
truncate -s 1600M $B/xfs.img; mkfs.xfs -q $B/xfs.img
dev=$(losetup -f --show $B/xfs.img); mount $dev $B/m; d=${dev#/dev/}
fio --name=w --filename=$B/m/f --size=1G --rw=write --bs=1M --direct=1 --ioengine=libaio --iodepth=8 --output-format=terse >/dev/null
IMG=${IMG:-/var/tmp/imgtool-main}
sample() { local n=0 r w s=0 c=0; while [[ -e /tmp/pe.run ]]; do read r w < /sys/block/$d/inflight; s=$((s + r + w)); c=$((c + 1)); sleep 0.01; done; echo "inflight mean $((c ? s / c : 0)) over $c samples"; }
run() { # label, command...
  local label=$1; shift
  touch /tmp/pe.run; sample > /tmp/pe.sample & local sp=$!
  local out; out=$("$@" 2>&1 | tail -1); rm -f /tmp/pe.run; wait $sp
  echo "$label | $out | $(cat /tmp/pe.sample)"
}
fiorun() { fio --name=t --filename=$B/m/f --size=1G --rw=randwrite --bs=4k --direct=1 --iodepth=$2 --ioengine=$1 --time_based --runtime=2 --randrepeat=0 --norandommap --output-format=json 2>/dev/null | /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(int(j["write"]["iops"]), "IOPS")'; }
for r in 1 2 3; do
  run "r$r imgtool native d64" $IMG bench -f raw -t none -n -w -d 64 -s 4k --random -c 500000 $B/m/f
  run "r$r fio libaio d64" fiorun libaio 64
  run "r$r imgtool io_uring d64" $IMG bench -f raw -t none -i io_uring -w -d 64 -s 4k --random -c 500000 $B/m/f
  run "r$r fio io_uring d64" fiorun io_uring 64
  run "r$r imgtool native d128" $IMG bench -f raw -t none -n -w -d 128 -s 4k --random -c 500000 $B/m/f
done
umount $B/m; losetup -d $dev; rm -rf $B
