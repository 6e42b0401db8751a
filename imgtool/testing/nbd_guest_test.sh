#!/usr/bin/env bash
# A real QEMU guest on an `imgtool nbd` export (issue 19, Tests): a qcow2
# image with extended L2 entries (subclusters) exported by imgtool nbd on a
# unix socket is the virtio disk of qemu-system-x86_64 (TCG: /dev/kvm on
# these machines is a software KVM that stops a stock kernel mid-boot)
# booting Debian 12's cloud kernel with a busybox-static initramfs built
# here. The guest loads virtio_blk from the kernel package, makes an ext2
# filesystem, writes files, unmounts, drops its caches, reads them back
# (md5), deletes one and runs fstrim (TRIM through the export), writes a
# known byte pattern to the raw disk past the filesystem and powers off.
# Then, on the host: qemu-img check is clean, the image still has extended
# L2 entries, e2fsck -fn passes, debugfs reads the files' data equal to what
# the guest wrote, and qemu-io read -P finds the pattern.
#
# The kernel: the .deb of the current bookworm cloud kernel
# (linux-image-*-cloud-amd64), downloaded by tools/setup.sh into
# $IMGTOOL_GUEST_KERNEL_DIR (default /var/cache/imgtool/guest-kernel) and
# unpacked here with dpkg-deb -x: the test itself stays offline. Missing, it
# skips with a message, or fails when CI=true.
# The guest gets at most 180 s (about 15-20 s expected); its console goes to
# a file printed on failure. The VM and the server are stopped on every
# exit path (trap).
# Usage: nbd_guest_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
KDIR=${IMGTOOL_GUEST_KERNEL_DIR:-/var/cache/imgtool/guest-kernel}
GUEST_TIMEOUT=180
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/nbd_guest.XXXXXX")
# Unix socket paths must stay under 108 bytes (Bazel's TEST_TMPDIR is long).
SOCKDIR=$(mktemp -d /tmp/nbdgu.XXXXXX)
QPID=""
stop_vm() {
  [[ -n "$QPID" ]] || return 0
  kill -9 "$QPID" 2>/dev/null
  wait "$QPID" 2>/dev/null
  QPID=""
}
cleanup() {
  stop_vm
  stop_server
  rm -rf "$WORK" "$SOCKDIR"
}
trap cleanup EXIT
trap 'exit 1' INT TERM
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  LIBDIR="$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing"
else
  LIBDIR=$(dirname "$0")
fi
source "$LIBDIR/oracle_lib.sh" || exit 1
# stop_pid_file (its other functions are replaced below or not used).
source "$LIBDIR/nbd_lib.sh" || exit 1
stop_server() { stop_pid_file "$SOCKDIR/srv.pid"; }
for t in qemu-img qemu-io qemu-system-x86_64 dpkg-deb debugfs e2fsck gzip; do
  command -v $t >/dev/null || { echo "$t not installed (tools/setup.sh)"; exit 1; }
done
BUSYBOX=/bin/busybox
file -L "$BUSYBOX" 2>/dev/null | grep -q 'statically linked' ||
  { echo "$BUSYBOX is not busybox-static (tools/setup.sh)"; exit 1; }

DEB=$(ls -v "$KDIR"/linux-image-*-cloud-amd64_*_amd64.deb 2>/dev/null | tail -1)
if [[ -z "$DEB" ]]; then
  echo "no linux-image-*-cloud-amd64 .deb in $KDIR (tools/setup.sh downloads it)"
  [[ "${CI:-}" == true ]] && exit 1
  echo "SKIPPED (CI is not true)"
  exit 0
fi
echo "kernel package: $(basename "$DEB")"

cd "$WORK" || exit 1
dpkg-deb -x "$DEB" kernel || { echo "dpkg-deb -x $DEB failed"; exit 1; }
VMLINUZ=$(ls kernel/boot/vmlinuz-* 2>/dev/null | head -1)
MODDIR=$(ls -d kernel/lib/modules/*/kernel 2>/dev/null | head -1)
[[ -n "$VMLINUZ" && -n "$MODDIR" ]] || { echo "no kernel or modules in $DEB"; exit 1; }

# The initramfs: busybox, the virtio modules (in dependency order, from the
# modules' depends= fields; ext4, which serves ext2, is built in) and init.
MODULES="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_blk"
mkdir -p root/bin root/lib/modules root/dev root/proc root/sys root/mnt
cp "$BUSYBOX" root/bin/busybox
for m in $MODULES; do
  f=$(find "$MODDIR" -name "$m.ko" | head -1)
  [[ -n "$f" ]] || { echo "$m.ko not in $DEB"; exit 1; }
  cp "$f" root/lib/modules/
done
# The pattern file's content, the raw pattern's place (after the 32 MiB
# filesystem on the 64 MiB disk): the host checks the same.
cat >root/init <<EOF
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
fail() { echo "GUEST FAIL: \$*"; poweroff -f; }
for m in $MODULES; do insmod /lib/modules/\$m.ko || fail "insmod \$m"; done
for i in \$(seq 100); do [ -b /dev/vda ] && break; sleep 0.1; done
[ -b /dev/vda ] || fail "no /dev/vda"
echo "GUEST disk \$(cat /sys/block/vda/size) sectors"
mke2fs -q /dev/vda 32768 || fail mke2fs
mount -t ext2 /dev/vda /mnt || fail mount
yes imgtool-guest | head -c 1048576 >/mnt/pattern || fail "write pattern"
head -c 3145728 /dev/urandom >/mnt/random || fail "write random"
head -c 2097152 /dev/urandom >/mnt/deleted || fail "write deleted"
mkdir /mnt/dir || fail mkdir
for i in \$(seq 20); do echo "file \$i" >/mnt/dir/f\$i || fail "write f\$i"; done
sync
umount /mnt || fail umount
echo 3 >/proc/sys/vm/drop_caches
mount -t ext2 /dev/vda /mnt || fail remount
echo "GUEST md5 pattern \$(md5sum </mnt/pattern | cut -d' ' -f1)"
echo "GUEST md5 random \$(md5sum </mnt/random | cut -d' ' -f1)"
echo "GUEST f7 \$(cat /mnt/dir/f7)"
rm /mnt/deleted || fail rm
sync
fstrim /mnt || fail fstrim
umount /mnt || fail "second umount"
yes Z | tr -d '\n' | head -c 1048576 | dd of=/dev/vda bs=65536 seek=768 conv=fsync 2>/dev/null || fail dd
echo "GUEST done"
poweroff -f
EOF
chmod +x root/init
(cd root && find . | "$BUSYBOX" cpio -o -H newc 2>/dev/null) | gzip -1 >initrd.gz ||
  { echo "initramfs: cpio failed"; exit 1; }

# The disk: a 64 MiB qcow2 image with extended L2 entries (64 KiB clusters,
# 2 KiB subclusters), exported writable by imgtool nbd.
"$IMGTOOL" create -q -f qcow2 -o extended_l2=on,cluster_size=64k disk.qcow2 64M ||
  { echo "imgtool create failed"; exit 1; }
if ! timeout 30 "$IMGTOOL" nbd --fork --pid-file="$SOCKDIR/srv.pid" \
  -k "$SOCKDIR/srv.sock" -x disk -f qcow2 disk.qcow2 2>server.err; then
  echo "imgtool nbd failed: $(cat server.err)"
  exit 1
fi

# The guest (TCG; -no-reboot: poweroff -f ends QEMU).
qemu-system-x86_64 -accel tcg -m 256 -nodefaults -no-reboot -display none \
  -serial file:console.log -kernel "$VMLINUZ" -initrd initrd.gz \
  -append "console=ttyS0 panic=-1 quiet" \
  -drive "file=nbd+unix:///disk?socket=$SOCKDIR/srv.sock,format=raw,if=virtio,discard=unmap" \
  >qemu.out 2>&1 &
QPID=$!
start=$SECONDS
while kill -0 "$QPID" 2>/dev/null && ((SECONDS - start < GUEST_TIMEOUT)); do
  sleep 0.2
done
checks=$((checks + 1))
if kill -0 "$QPID" 2>/dev/null; then
  fail "the guest did not power off within $GUEST_TIMEOUT s"
  stop_vm
else
  wait "$QPID"
  rc=$?
  QPID=""
  [[ $rc == 0 ]] || fail "qemu-system-x86_64 exited with $rc: $(cat qemu.out)"
fi
echo "guest ran $((SECONDS - start)) s"
stop_server

guest_says() { sed -n "s/^GUEST $1 //p" console.log | tr -d '\r' | head -1; }
checks=$((checks + 1))
if ! grep -q '^GUEST done' console.log || grep -q 'GUEST FAIL' console.log; then
  fail "the guest did not finish its work (console below)"
fi
checks=$((checks + 1))
[[ "$(guest_says disk)" == "131072 sectors" ]] ||
  fail "guest disk size: '$(guest_says disk)', expected 131072 sectors"
checks=$((checks + 1))
expected=$(yes imgtool-guest | head -c 1048576 | md5sum | cut -d' ' -f1)
[[ "$(guest_says 'md5 pattern')" == "$expected" ]] ||
  fail "the guest read back pattern with md5 '$(guest_says 'md5 pattern')', expected $expected"
checks=$((checks + 1))
[[ "$(guest_says f7)" == "file 7" ]] || fail "the guest read back f7 as '$(guest_says f7)'"

# The image on the host.
checks=$((checks + 1))
qemu-img check -f qcow2 disk.qcow2 >check.out 2>&1 ||
  fail "qemu-img check: $(cat check.out)"
checks=$((checks + 1))
grep -q '^No errors were found on the image.$' check.out ||
  fail "qemu-img check: $(cat check.out)"
checks=$((checks + 1))
qemu-img info -f qcow2 disk.qcow2 | grep -q '^    extended l2: true$' ||
  fail "the image lost its extended L2 entries: $(qemu-img info disk.qcow2)"
qemu-img convert -f qcow2 -O raw disk.qcow2 disk.raw ||
  fail "qemu-img convert of the image failed"
checks=$((checks + 1))
e2fsck -fn disk.raw >fsck.out 2>&1 || fail "e2fsck -fn: $(cat fsck.out)"
checks=$((checks + 1))
got=$(debugfs -R 'cat /pattern' disk.raw 2>/dev/null | md5sum | cut -d' ' -f1)
[[ "$got" == "$expected" ]] || fail "/pattern in the image: md5 $got, expected $expected"
checks=$((checks + 1))
got=$(debugfs -R 'cat /random' disk.raw 2>/dev/null | md5sum | cut -d' ' -f1)
[[ -n "$(guest_says 'md5 random')" && "$got" == "$(guest_says 'md5 random')" ]] ||
  fail "/random in the image: md5 $got, the guest's $(guest_says 'md5 random')"
checks=$((checks + 1))
got=$(for i in $(seq 20); do debugfs -R "cat /dir/f$i" disk.raw 2>/dev/null; done | md5sum)
[[ "$got" == "$(for i in $(seq 20); do echo "file $i"; done | md5sum)" ]] ||
  fail "/dir/f1../dir/f20 in the image differ"
checks=$((checks + 1))
debugfs -R 'stat /deleted' disk.raw 2>&1 | grep -q 'File not found' ||
  fail "/deleted is still in the image"
checks=$((checks + 1))
qemu-io -f qcow2 -c 'read -P 0x5a 48M 1M' disk.qcow2 >pio.out 2>&1 &&
  grep -q '^read 1048576/1048576 bytes at offset 50331648$' pio.out ||
  fail "the raw pattern at 48 MiB: $(cat pio.out)"

if ((failures)); then
  echo "--- guest console (console.log) ---"
  tr -d '\r' <console.log | tail -60
  echo "--- qemu-system-x86_64 ---"
  cat qemu.out
  [[ -n "${TEST_UNDECLARED_OUTPUTS_DIR:-}" ]] &&
    cp console.log "$TEST_UNDECLARED_OUTPUTS_DIR/nbd_guest_console.log"
fi
finish
