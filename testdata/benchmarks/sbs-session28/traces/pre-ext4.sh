#!/bin/bash
# ext4 aligned 16k with the preallocate filter: imgtool vs qemu-img, long runs
# usage: pre-ext4.sh COUNT ROUNDS [extra imgtool configs...]
set -eu
COUNT=${1:-186307}; ROUNDS=${2:-2}
IMG=${IMGTOOL:-/var/tmp/imgtool-ce4}
W=$(mktemp -d /var/tmp/pre4.XXXX); M=$W/mnt; mkdir $M
trap 'cd /; umount $M 2>/dev/null; rm -rf $W' EXIT
truncate -s 8G $W/fs.img
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 $W/fs.img
mount -o loop $W/fs.img $M; cd $M
opts="driver=qcow2,file.driver=preallocate,file.file.driver=file,file.file.filename=img.qcow2"
run() { # name cmd...
  qemu-img create -q -f qcow2 img.qcow2 16G; sync; fstrim $M
  local t0=$(date +%s.%N)
  "$@" > out.txt 2>&1 || { cat out.txt; }
  local t1=$(date +%s.%N)
  python3 -c "import sys; print('%-28s %8.0f IOPS  (%.2f s)' % (sys.argv[1], int(sys.argv[2])/(float(sys.argv[4])-float(sys.argv[3])), float(sys.argv[4])-float(sys.argv[3])))" "$NAME" $COUNT $t0 $t1
  rm -f img.qcow2
}
for ((r=0;r<ROUNDS;r++)); do
  NAME=imgtool-native run $IMG bench -q -c $COUNT -d 64 -s 16k -t none -n -w --image-opts $opts
  NAME=qemu-img-native run qemu-img bench -q -c $COUNT -d 64 -s 16k -t none -n -w --image-opts $opts
  NAME=imgtool-uring run $IMG bench -q -c $COUNT -d 64 -s 16k -t none -i io_uring -w --image-opts $opts
  NAME=imgtool-nofilter run $IMG bench -q -c $COUNT -d 64 -s 16k -t none -n -w -f qcow2 img.qcow2
  NAME=qemu-img-nofilter run qemu-img bench -q -c $COUNT -d 64 -s 16k -t none -n -w -f qcow2 img.qcow2
done
