# s31-choice.sh ROUNDS OUT: depth-1 4 KiB random O_DIRECT reads and writes on the RAM-backed mount, interleaved:
# fio libaio, the minimal loop (d1, reads), imgtool -n before (ff785a5: spin), without the spin (scratch X_NOSPIN),
# after (the spin choice)
source "$(dirname "$0")/s31.sh"  # imgtool-sc: spin-choice.diff, first version (latency from submission to completion)
for r in $(seq $1); do
  echo "fio_libaio $(fr libaio)"; echo "d1 $(/var/tmp/d1 $B/m/f 60000)"
  echo "spin $(ib /var/tmp/imgtool-ff -n -d 1)"; echo "nospin $(X_NOSPIN=1 ib /var/tmp/imgtool-xu -n -d 1)"; echo "choice $(ib /var/tmp/imgtool-sc -n -d 1)"
  echo "w_fio_libaio $(fr libaio write)"
  echo "w_spin $(ib /var/tmp/imgtool-ff -n -w -d 1)"; echo "w_nospin $(X_NOSPIN=1 ib /var/tmp/imgtool-xu -n -w -d 1)"; echo "w_choice $(ib /var/tmp/imgtool-sc -n -w -d 1)"
done > $2
