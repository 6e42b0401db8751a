#!/usr/bin/env bash
# Session 32: the new-L2-table phase of the subcluster script's 4k cell on
# its own: 4 KiB writes at -d 64 -S 4182016 into an empty 4k-cluster
# overlay of a written 2 GiB raw file, COUNT writes (1,024 by default: the
# first 512 each need a new L2 table, the next 512 mostly), so that every
# run is the flush-bound case session 28 traced. Tools alternate per round
# (order rotated), each run on a fresh overlay after sync, fstrim and
# dropped caches; XFS on a loop device with direct I/O, as
# LOOP_DIRECT_IO=1 benchmarks/subcluster_side_by_side.sh.
#   sudo OLD=<imgtool before> NEW=<imgtool after> [NEW2=<another>] ROUNDS=9 tables.sh
# prints "TOOL SECONDS IOPS" per run (TOOL old, new, new2, qemu-img).
# VSIZE (overlay size, default 2048M) and STEP (default 4182016) make the
# table phase longer: VSIZE=64G STEP=2101248 COUNT=16384 gives every write
# a new table (4 KiB writes into 4 KiB clusters never copy from the
# backing file, so the overlay may be larger than it).
set -euo pipefail
OLD=${OLD:?} NEW=${NEW:?} NEW2=${NEW2:-} ROUNDS=${ROUNDS:-9} COUNT=${COUNT:-1024}
VSIZE=${VSIZE:-2048M} STEP=${STEP:-4182016}
work=$(mktemp -d /var/tmp/tables.XXXXXX)
mnt=$work/mnt; mkdir "$mnt"
truncate -s $(( (2048 * 3 + 512) << 20 )) "$work/xfs.img"
mkfs.xfs -q "$work/xfs.img"
dev=$(losetup --direct-io=on -f --show "$work/xfs.img")
mount "$dev" "$mnt"
trap 'cd /; umount "$mnt"; losetup -d "$dev"; rm -rf "$work"' EXIT
cd "$mnt"
qemu-img create -q -f raw base.raw 2048M
qemu-img bench -q -f raw -w -t none -d 16 -s 1M -S 1M --pattern=170 -c 2048 base.raw >/dev/null
run() {  # label binary
  qemu-img create -q -f qcow2 -b base.raw -F raw -o cluster_size=4k overlay.qcow2 "$VSIZE"
  sync; fstrim "$mnt"; echo 3 > /proc/sys/vm/drop_caches
  local s
  s=$("$2" bench -f qcow2 -w -t none -d 64 -s 4k -S "$STEP" -c "$COUNT" overlay.qcow2 |
      sed -n 's/^Run completed in \([0-9.]*\) seconds./\1/p')
  qemu-img check -q overlay.qcow2
  echo "$1 $s $(python3 -c "print(round($COUNT/$s))")"
}
tools=(old new qemu-img)
[[ -n "$NEW2" ]] && tools+=(new2)
for ((r = 0; r < ROUNDS; r++)); do
  for ((k = 0; k < ${#tools[@]}; k++)); do
    t=${tools[$(((r + k) % ${#tools[@]}))]}
    case $t in
      old) run old "$OLD" ;;
      new) run new "$NEW" ;;
      new2) run new2 "$NEW2" ;;
      qemu-img) run qemu-img qemu-img ;;
    esac
  done
done
