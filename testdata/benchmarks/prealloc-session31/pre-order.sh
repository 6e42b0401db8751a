#!/bin/bash
# pre-order.sh SEQ (e.g. "Q I I Q I I"): the ext4 aligned-with-filter cell of prealloc_side_by_side.sh by hand,
# recording per run: IOPS, img.qcow2's extents (count, first and last physical block) and the loop
# backing file's allocated blocks.
IMG=${IMG:-/var/tmp/imgtool-31}; COUNT=${COUNT:-148302}; W=${W:-/var/tmp/preorder}; M=$W/m
umount $M 2>/dev/null; mkdir -p $M; rm -f $W/fs.img; truncate -s 8G $W/fs.img
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 $W/fs.img; mount -o loop $W/fs.img $M; cd $M
for t in $1; do
  qemu-img create -q -f qcow2 img.qcow2 16G; sync; fstrim $M
  bin=$IMG; [[ $t == Q ]] && bin=qemu-img
  dirty=$(awk '/^Dirty:/{print $2}' /proc/meminfo)
  s=$(date +%s.%N)
  $bin bench -q -c $COUNT -d 64 -s 16k -t none -n -w --image-opts driver=qcow2,file.driver=preallocate,file.file.driver=file,file.file.filename=img.qcow2 >/dev/null
  e=$(date +%s.%N)
  ext=$(filefrag -v img.qcow2 | awk '/^ *[0-9]+:/{n++; gsub(/\.\./," "); if(n==1)f=$4; l=$5} END{print n, f, l}')
  echo "$t IOPS $(python3 -c "print(int($COUNT/($e-$s)))") extents/first/last $ext fsimg_blocks $(stat -c %b $W/fs.img) dirty_kB_before $dirty"
  rm -f img.qcow2
done
cd /; umount $M
