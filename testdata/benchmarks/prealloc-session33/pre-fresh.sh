#!/bin/bash
# pre-fresh.sh SEQ: session 31's pre-fresh.sh (testdata/benchmarks/prealloc-session31/) with LOOPDIO=1:
# the loop device takes --direct-io=on. Every run on a new 8 GiB file system (new sparse backing file in W,
# mkfs, mount), `qemu-img create -f qcow2 img.qcow2 16G`, sync, fstrim, then the prealloc table's aligned
# filter command. SEQ letters: I imgtool -n, U imgtool -i io_uring, Q qemu-img -n.
IMG=${IMG:-/var/tmp/imgtool-33}; COUNT=${COUNT:-148302}; W=${W:-/var/tmp/preorder}; M=$W/m
mkdir -p $M
for t in $1; do
  umount $M 2>/dev/null; for l in $(losetup -j $W/fs.img | cut -d: -f1); do losetup -d $l; done; rm -f $W/fs.img; truncate -s 8G $W/fs.img
  if [[ ${FS:-ext4} == xfs ]]; then mkfs.xfs -q -f $W/fs.img; else mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 $W/fs.img; fi
  if [[ ${LOOPDIO:-0} == 1 ]]; then dev=$(losetup --direct-io=on -f --show $W/fs.img); else dev=$(losetup -f --show $W/fs.img); fi
  mount $dev $M; cd $M
  qemu-img create -q -f qcow2 img.qcow2 16G; sync; fstrim $M
  bin=$IMG; eng=-n; [[ $t == Q ]] && bin=qemu-img; [[ $t == U ]] && eng="-i io_uring"
  d=${dev#/dev/}; w0=$(awk '{print $7}' /sys/block/$d/stat); n0=$(awk '{print $5}' /sys/block/$d/stat)
  s=$(date +%s.%N)
  $bin bench -q -c $COUNT -d 64 -s 16k -t none $eng -w --image-opts driver=qcow2,file.driver=preallocate,file.file.driver=file,file.file.filename=img.qcow2 >/dev/null
  e=$(date +%s.%N)
  sync; wsec=$(awk '{print $7}' /sys/block/$d/stat)
  echo "$t IOPS $(python3 -c "print(int($COUNT/($e-$s)))") dio $(cat /sys/block/$d/loop/dio) loop_write_MiB $(((wsec-w0)/2048)) loop_writes $(( $(awk '{print $5}' /sys/block/$d/stat) - n0 ))"
  cd /
done
umount $M; for l in $(losetup -j $W/fs.img | cut -d: -f1); do losetup -d $l; done; rm -f $W/fs.img
