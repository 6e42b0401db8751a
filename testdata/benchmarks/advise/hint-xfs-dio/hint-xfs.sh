#!/bin/bash
# (session 28 hint-xfs.sh; LOOPDIO=1: the loop device with --direct-io=on)
# XFS: 4 KiB random O_DIRECT writes at depth 64 into a fresh sparse raw image,
# extent size hint 0 / 1M / 8M, alternating, REPS rounds. usage: hint-xfs.sh COUNT REPS SIZE
set -eu
COUNT=${1:-100000}; REPS=${2:-9}; SIZE=${3:-1G}
IMG=${IMGTOOL:-/var/tmp/imgtool-33}; L=
W=$(mktemp -d /var/tmp/hint.XXXX); M=$W/mnt; mkdir $M
trap 'cd /; umount $M 2>/dev/null; [[ -n $L ]] && losetup -d $L; rm -rf $W' EXIT
truncate -s 8G $W/fs.img; mkfs.xfs -q -f $W/fs.img; if [[ ${LOOPDIO:-0} == 1 ]]; then L=$(losetup --direct-io=on -f --show $W/fs.img); else L=$(losetup -f --show $W/fs.img); fi; mount $L $M; cd $M
for ((r=0;r<REPS;r++)); do
  hints="0 1M 8M"; ((r%2)) && hints="8M 1M 0"
  for h in $hints; do
    $IMG create -q -f raw -o extent_size_hint=$h img.raw $SIZE
    sync; fstrim $M
    j=$($IMG bench --output=json -f raw -t none -w -d 64 -s 4k --random=$((r+1)) -c $COUNT img.raw)
    ext=$(xfs_bmap img.raw | grep -vc hole || true)
    python3 -c "import json,sys; d=json.loads(sys.argv[1]); print(sys.argv[2], sys.argv[3], round(d['iops']), d['parameters']['aio'], sys.argv[4])" "$j" $r $h "$ext"
    rm -f img.raw
  done
done
