# uring-split.sh ROUNDS OUT: 4 KiB random O_DIRECT reads and writes at depth 1, 4, 16, 64 on the RAM-backed
# mount, interleaved: fio io_uring, imgtool -i io_uring before (/var/tmp/imgtool-ff: ff785a5) and after
# (/var/tmp/imgtool-us: the split submit and wait). Result: uring-split-5rounds.txt (18:27-18:31 UTC, session 31)
source "$(dirname "$0")/s31.sh"
ibn() { local n=$1 bin=$2; shift 2; $bin bench -f raw -t none "$@" -s 4k --random -c $n $B/m/f 2>&1 | awk -v n=$n '/Run completed/{printf "%d\n", n/$4}'; }
for r in $(seq $1); do for d in 1 4 16 64; do
  n=$((d == 1 ? 60000 : 200000))
  echo "d$d/fio_uring $(fr io_uring read $d)"; echo "d$d/before $(ibn $n /var/tmp/imgtool-ff -i io_uring -d $d)"; echo "d$d/after $(ibn $n /var/tmp/imgtool-us -i io_uring -d $d)"
  echo "d$d/w_fio_uring $(fr io_uring write $d)"; echo "d$d/w_before $(ibn $n /var/tmp/imgtool-ff -i io_uring -w -d $d)"; echo "d$d/w_after $(ibn $n /var/tmp/imgtool-us -i io_uring -w -d $d)"
done; done > $2
