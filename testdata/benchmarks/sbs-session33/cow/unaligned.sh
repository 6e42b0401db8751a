#!/bin/bash
# unaligned.sh FS: the prealloc table's "unaligned seq 64k" cell without the filter against fio on the same
# mount: 64 KiB O_DIRECT writes at a 1 KiB offset, depth 64, into a new sparse raw file (fio, libaio) and into
# a new qcow2 (imgtool -n, qemu-img -n), 18,686 writes each, loop device with direct I/O, fresh image, sync
# and fstrim before each run; fio's runtime, the tools' own clocks.
FS=$1; W=/var/tmp/s33/cow/u; M=$W/m; N=18686; IMG=${IMG:-/var/tmp/imgtool-33}
mkdir -p $M; truncate -s 8G $W/fs.img
if [[ $FS == xfs ]]; then mkfs.xfs -q -f $W/fs.img; else mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 $W/fs.img; fi
L=$(losetup --direct-io=on -f --show $W/fs.img); mount $L $M; cd $M
trap 'cd /; umount $M; losetup -d $L; rm -rf $W' EXIT
for r in 1 2 3; do
  for t in F I Q; do
    if [[ $t == F ]]; then qemu-img create -q -f raw img 16G; else qemu-img create -q -f qcow2 img 16G; fi
    sync; fstrim $M
    case $t in
      F) s=$(fio --name=u --filename=img --rw=write --bs=64k --offset=1k --size=$((N*65536)) --iodepth=64 --ioengine=libaio --direct=1 --output-format=json | python3 -c 'import json,sys; print(json.load(sys.stdin)["jobs"][0]["job_runtime"]/1000)') ;;
      I) s=$($IMG bench --output=json -f qcow2 -w -t none -n -d 64 -o 1k -s 64k -c $N img | python3 -c 'import json,sys; print(json.load(sys.stdin)["elapsed_seconds"])') ;;
      Q) s=$(qemu-img bench -f qcow2 -w -t none -n -d 64 -o 1k -s 64k -c $N img | sed -n 's/Run completed in \([0-9.]*\) seconds./\1/p') ;;
    esac
    echo "$FS $t $(python3 -c "print(round($N/$s))")"
    rm -f img
  done
done
