# source me after ../engine-submit-session30/ram.sh (RAM-backed XFS loop at /dev/shm/pe/m, file f)
# fr ENGINE [read|write] [DEPTH]: fio IOPS, 2 s; ib BIN OPTS...: imgtool bench IOPS over 60,000 random 4 KiB
B=/dev/shm/pe
fr() { fio --name=t --filename=$B/m/f --size=1G --rw=rand${2:-read} --bs=4k --direct=1 --iodepth=${3:-1} --ioengine=$1 --time_based --runtime=2 --randrepeat=0 --norandommap --output-format=json 2>/dev/null | /usr/bin/python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(int(j["'${2:-read}'"]["iops"]))'; }
# ib BIN "opts" -> IOPS
ib() { local bin=$1; shift; $bin bench -f raw -t none "$@" -s 4k --random -c 60000 $B/m/f 2>&1 | awk '/Run completed/{printf "%d\n", 60000/$4}'; }
