#!/bin/bash
# pre-root.sh SEQ: the aligned-with-filter cell on the VM's root ext4 itself (virtio disk, no loop device).
IMG=${IMG:-/var/tmp/imgtool-mm}; COUNT=${COUNT:-148302}; D=/var/tmp/preroot; mkdir -p $D; cd $D
for t in $1; do
  rm -f img.qcow2; sync; fstrim / 2>/dev/null
  qemu-img create -q -f qcow2 img.qcow2 16G; sync
  bin=$IMG; eng=-n; [[ $t == Q ]] && bin=qemu-img; unset X_MAXMERGE X_SUBMIT1; [[ $t == S ]] && export X_MAXMERGE=16384 X_SUBMIT1=1
  w0=$(awk '{print $5}' /sys/block/vda/stat)
  s=$(date +%s.%N)
  $bin bench -q -c $COUNT -d 64 -s 16k -t none $eng -w --image-opts driver=qcow2,file.driver=preallocate,file.file.driver=file,file.file.filename=img.qcow2 >/dev/null
  e=$(date +%s.%N)
  echo "$t $(python3 -c "print(int($COUNT/($e-$s)))") vda_writes $(( $(awk '{print $5}' /sys/block/vda/stat) - w0 ))"
done
rm -f img.qcow2
