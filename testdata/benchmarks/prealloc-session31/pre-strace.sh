#!/bin/bash
# pre-strace.sh TOOL(Q|I): one run on a fresh disk-backed ext4 under strace (fdatasync, fsync, fallocate, ftruncate, pwrite*)
IMG=${IMG:-/var/tmp/imgtool-31}; COUNT=${COUNT:-148302}; W=${W:-/var/tmp/preorder}; M=$W/m
mkdir -p $M; umount $M 2>/dev/null; rm -f $W/fs.img; truncate -s 8G $W/fs.img
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 $W/fs.img; mount -o loop $W/fs.img $M; cd $M
qemu-img create -q -f qcow2 img.qcow2 16G; sync; fstrim $M
bin=$IMG; [[ $1 == Q ]] && bin=qemu-img
strace -f -T -tt -e trace=fdatasync,fsync,fallocate,ftruncate,pwrite64,pwritev,pwritev2 -o /var/tmp/pre-strace-$1.txt $bin bench -q -c $COUNT -d 64 -s 16k -t none -n -w --image-opts driver=qcow2,file.driver=preallocate,file.file.driver=file,file.file.filename=img.qcow2 >/dev/null
cd /; umount $M
