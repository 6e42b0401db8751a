#!/bin/bash
# cow.sh C COUNT SEQ: the subcluster script's standard-cluster cell by hand (XFS on a loop device with direct
# I/O, 2 GiB backing file written in full, fresh overlay, sync+fstrim+drop_caches per run) with the loop
# device's counters per run: I imgtool, Q qemu-img, F fio replay of the data I/O (the script's fio_seconds).
C=$1; COUNT=$2; IMG=${IMG:-/var/tmp/imgtool-33}; W=/var/tmp/s33/cow/w; M=$W/m; STEP=4182016
mkdir -p $M; truncate -s 7G $W/xfs.img; mkfs.xfs -q -f $W/xfs.img; L=$(losetup --direct-io=on -f --show $W/xfs.img); mount $L $M; cd $M
trap 'cd /; umount $M; losetup -d $L; rm -rf $W' EXIT
qemu-img create -q -f raw base.raw 2048M; qemu-img bench -q -f raw -w -t none -d 16 -s 1M -S 1M --pattern=170 -c 2048 base.raw >/dev/null
cb=$(python3 -c "print({'k':1<<10,'M':1<<20}['$C'[-1]]*int('$C'[:-1]))")
python3 - $COUNT $cb $STEP $((2048<<20)) $M > $W/copy.iolog <<'PY'
import sys
count, c, step, size = (int(x) for x in sys.argv[1:5]); base, copy = sys.argv[5] + "/base.raw", sys.argv[5] + "/copy.raw"
print("fio version 2 iolog")
for a in ("add", "open"): print(base, a); print(copy, a)
host, off = {}, 0
for _ in range(count):
    cl = off // c * c
    if cl not in host:
        host[cl] = len(host) * c; print(base, "read", cl, c); print(copy, "write", host[cl], c)
    else: print(copy, "write", host[cl] + off - cl, 4096)
    off = (off + step) % size
print(base, "close"); print(copy, "close")
PY
d=${L#/dev/}
for t in $3; do
  if [[ $t == F ]]; then qemu-img create -q -f raw copy.raw $((COUNT*cb)); else qemu-img create -q -f qcow2 -b base.raw -F raw -o cluster_size=$C overlay.qcow2; fi
  sync; fstrim $M; echo 3 > /proc/sys/vm/drop_caches
  read -a s0 < /sys/block/$d/stat; st=$(date +%s.%N)
  case $t in
    I) own=$($IMG bench --output=json -f qcow2 -w -t none -d 64 -s 4k -S $STEP -c $COUNT overlay.qcow2 | python3 -c 'import json,sys; print(json.load(sys.stdin)["elapsed_seconds"])') ;;
    Q) own=$(qemu-img bench -f qcow2 -w -t none -d 64 -s 4k -S $STEP -c $COUNT overlay.qcow2 | sed -n 's/Run completed in \([0-9.]*\) seconds./\1/p') ;;
    F) own=$(fio --name=cow --read_iolog=$W/copy.iolog --ioengine=libaio --direct=1 --iodepth=64 ${FIOX:-} --output-format=json | python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["job_runtime"]/1000)') ;;
  esac
  en=$(date +%s.%N); read -a s1 < /sys/block/$d/stat
  echo "$t C=$C wall-writes/s $(python3 -c "print(round($COUNT/($en-$st)))") own-writes/s $(python3 -c "print(round($COUNT/$own))") reads $((s1[0]-s0[0])) rMiB $(((s1[2]-s0[2])/2048)) writes $((s1[4]-s0[4])) wMiB $(((s1[6]-s0[6])/2048)) flushes $((s1[14]-s0[14])) inflight-ms r $((s1[3]-s0[3])) w $((s1[7]-s0[7]))" | sed -E 's/reads ([0-9]+)-([0-9]+)/reads \1-\2/'
  rm -f overlay.qcow2 copy.raw
done
