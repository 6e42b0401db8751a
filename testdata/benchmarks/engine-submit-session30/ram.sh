# source me: sets up RAM-backed XFS loop at /dev/shm/pe/m, file f (1G written)
B=/dev/shm/pe; umount $B/m 2>/dev/null; losetup -D 2>/dev/null; rm -rf $B; mkdir -p $B/m
truncate -s 1600M $B/xfs.img; mkfs.xfs -q $B/xfs.img
dev=$(losetup -f --show $B/xfs.img); mount $dev $B/m; d=${dev#/dev/}
fio --name=w --filename=$B/m/f --size=1G --rw=write --bs=1M --direct=1 --ioengine=libaio --iodepth=8 --output-format=terse >/dev/null
fiorun() { fio --name=t --filename=$B/m/f --size=1G --rw=randwrite --bs=4k --direct=1 --iodepth=$2 --ioengine=$1 --time_based --runtime=2 --randrepeat=0 --norandommap "${@:3}" --output-format=json 2>/dev/null | /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(int(j["write"]["iops"]), "IOPS")'; }
