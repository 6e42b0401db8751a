#!/bin/bash
# one fio replay under strace: when the process starts, submits its first request, reaps its last, exits
W=/var/tmp/s33/cow/w; M=$W/m; COUNT=682
mkdir -p $M; truncate -s 7G $W/xfs.img; mkfs.xfs -q -f $W/xfs.img; L=$(losetup --direct-io=on -f --show $W/xfs.img); mount $L $M; cd $M
trap 'cd /; umount $M; losetup -d $L; rm -rf $W' EXIT
qemu-img create -q -f raw base.raw 2048M; qemu-img bench -q -f raw -w -t none -d 16 -s 1M -S 1M --pattern=170 -c 2048 base.raw >/dev/null
python3 -c "
import sys
c=1<<20; step=4182016; size=2048<<20; base='$M/base.raw'; copy='$M/copy.raw'
print('fio version 2 iolog')
for a in ('add','open'): print(base,a); print(copy,a)
host={}; off=0
for _ in range($COUNT):
    cl=off//c*c
    if cl not in host: host[cl]=len(host)*c; print(base,'read',cl,c); print(copy,'write',host[cl],c)
    else: print(copy,'write',host[cl]+off-cl,4096)
    off=(off+step)%size
print(base,'close'); print(copy,'close')" > $W/copy.iolog
qemu-img create -q -f raw copy.raw $((COUNT<<20)); sync; fstrim $M; echo 3 > /proc/sys/vm/drop_caches
strace -f -tt -e trace=io_submit,io_getevents,openat,execve,exit_group -o /var/tmp/s33/cow/fio.strace fio --name=cow --read_iolog=$W/copy.iolog --ioengine=libaio --direct=1 --iodepth=64 --output-format=json | python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["job_runtime"])'
