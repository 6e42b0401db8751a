# Shared prologue of the side-by-side scripts (imgtool vs qemu-img in one
# run): source it from the repository root, then call
#   sbs_setup SCRIPT_NAME WORK_PREFIX TOOL...
# It checks for root and the named tools, builds //imgtool with $BAZEL
# (default bazel) unless $IMGTOOL names a binary, and makes a work directory
# under $WORKDIR (default /var/tmp). It sets:
#   IMGTOOL  the imgtool binary
#   work     the work directory, removed on exit
#   mnt      "$work/mnt" (created), unmounted on exit if mounted
#   loopdev  empty; a script that attaches a loop device itself stores it
#            here so that it is detached on exit
# and defines sbs_settle, to call right before every measured run.

# Before each measured run: write back what earlier runs left dirty
# (`sync`; XFS also finishes freeing deleted files' blocks then) and hand
# the mount's free space back to the loop device (`fstrim`, which punches it
# out of the loop's backing file), so that every run starts from the same
# filesystem and host state whichever tool or case ran before. Without it,
# runs late in a sequence ran up to 5x slower than early ones on ext4, which
# made a case measured after another look slower than it is.
sbs_settle() {
  sync
  fstrim "$mnt" 2>/dev/null || true
}

sbs_fail() {
  echo "$SBS_NAME: $*" >&2
  exit 1
}

sbs_cleanup() {
  cd /
  if mountpoint -q "$mnt" 2>/dev/null; then umount "$mnt" 2>/dev/null || umount -l "$mnt"; fi
  if [[ -n "$loopdev" ]]; then losetup -d "$loopdev" 2>/dev/null || true; fi
  rm -rf "$work"
}

sbs_setup() {
  SBS_NAME=$1
  local prefix=$2
  shift 2
  [[ $(id -u) -eq 0 ]] || sbs_fail "needs root (loop mounts)"
  local tool
  for tool in "$@"; do
    command -v "$tool" >/dev/null || sbs_fail "$tool missing (tools/setup.sh)"
  done
  if [[ -z "${IMGTOOL:-}" ]]; then
    BAZEL=${BAZEL:-bazel}
    $BAZEL build -c opt //imgtool >&2
    IMGTOOL="$($BAZEL info -c opt bazel-bin 2>/dev/null)/imgtool/imgtool"
  fi
  [[ -x "$IMGTOOL" ]] || sbs_fail "no imgtool binary at $IMGTOOL"
  work=$(mktemp -d "${WORKDIR:-/var/tmp}/$prefix.XXXXXX")
  mnt="$work/mnt"
  loopdev=
  trap sbs_cleanup EXIT
  mkdir "$mnt"
}
