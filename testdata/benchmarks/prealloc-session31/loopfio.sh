#!/bin/bash
# loopfio.sh: sequential O_DIRECT writes straight to a loop device over a sparse file on the root ext4
# (no file system inside), 2 GiB per run, same bytes in flight (1 MiB): bs=16k iodepth=64 vs bs=512k iodepth=2
# vs bs=1m iodepth=1; a fresh backing file per run.
W=/var/tmp/loopfio; mkdir -p $W
one() {  # bs depth
  losetup -D 2>/dev/null; rm -f $W/b.img; truncate -s 4G $W/b.img; sync
  dev=$(losetup -f --show $W/b.img)
  fio --name=w --filename=$dev --rw=write --bs=$1 --iodepth=$2 --ioengine=libaio --direct=1 --size=2G \
    --output-format=json 2>/dev/null | python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["write"]; print("%d MiB/s" % (j["bw"]/1024))'
  losetup -d $dev
}
for r in $(seq ${1:-2}); do
  echo "r$r 16k/d64 $(one 16k 64) | 512k/d2 $(one 512k 2) | 1m/d1 $(one 1m 1) | 512k/d64 $(one 512k 64)"
done
rm -f $W/b.img
