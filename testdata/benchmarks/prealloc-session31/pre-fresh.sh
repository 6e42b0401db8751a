#!/bin/bash
# pre-fresh.sh SEQ: as pre-order.sh, but every run on a new 8 GiB ext4 (new sparse backing file, mkfs, mount).
IMG=${IMG:-/var/tmp/imgtool-31}; COUNT=${COUNT:-148302}; W=${W:-/var/tmp/preorder}; M=$W/m
mkdir -p $M
for t in $1; do
  umount $M 2>/dev/null; rm -f $W/fs.img; truncate -s 8G $W/fs.img
  if [[ ${FS:-ext4} == xfs ]]; then mkfs.xfs -q -f $W/fs.img; else mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 $W/fs.img; fi; mount -o loop $W/fs.img $M; cd $M
  qemu-img create -q -f qcow2 img.qcow2 16G; sync; fstrim $M
  bin=$IMG; eng=-n; [[ $t == Q ]] && bin=qemu-img; [[ $t == U ]] && eng="-i io_uring"; [[ $t == T ]] && eng="-i threads"; unset X_MAXMERGE; [[ $t == N ]] && export X_MAXMERGE=16384; [[ $t == M ]] && export X_MAXMERGE=131072; unset X_SUBMIT1; [[ $t == S ]] && export X_MAXMERGE=16384 X_SUBMIT1=1
  dev=$(losetup -j $W/fs.img | cut -d: -f1); dev=${dev#/dev/}; w0=$(awk '{print $7}' /sys/block/$dev/stat); n0=$(awk '{print $5}' /sys/block/$dev/stat); t0=$(awk '{print $8}' /sys/block/$dev/stat)
  s=$(date +%s.%N)
  $bin bench -q -c $COUNT -d 64 -s 16k -t none $eng -w --image-opts driver=qcow2,file.driver=preallocate,file.file.driver=file,file.file.filename=img.qcow2 >/dev/null
  e=$(date +%s.%N)
  dev=$(losetup -j $W/fs.img | cut -d: -f1); dev=${dev#/dev/}; sync; wsec=$(awk "{print \$7}" /sys/block/$dev/stat); rsec=$(awk "{print \$3}" /sys/block/$dev/stat)
  ext=$(filefrag -v img.qcow2 | awk '/^ *[0-9]+:/{n++; gsub(/\.\./," "); if(n==1)f=$4; l=$5} END{print n, f, l}')
  echo "$t IOPS $(python3 -c "print(int($COUNT/($e-$s)))") extents/first/last $ext loop_write_MiB $(((wsec-w0)/2048)) loop_writes $(( $(awk '{print $5}' /sys/block/$dev/stat) - n0 )) write_ticks_ms $(( $(awk '{print $8}' /sys/block/$dev/stat) - t0 )) loop_read_MiB $((rsec/2048))"
  cd /
done
umount $M
