#!/usr/bin/env bash
# `imgtool advise` (issue 20 part 4) on the three filesystems the issue
# names, each a fresh loop mount (a sparse file under $WORKDIR): XFS, ext4,
# and ext4 without extents (mkfs.ext4 -O ^extent,^64bit: a 64-bit ext4
# needs extents). Each run's JSON goes to
# $OUT/<fs>/advise-<host>.json (suite `advise`, benchmarks/README.md);
# each file is checked with check_results.py and its verdicts printed.
#
#   sudo benchmarks/advise_filesystems.sh
#
# Environment:
#   IMGTOOL  path of an imgtool binary (default: bazel build //imgtool)
#   IMGTOOL_COMMIT  the JSON's imgtool_commit (default: this checkout's
#            short HEAD, "-dirty" if changed, when the script builds imgtool
#            itself; "unknown" for an IMGTOOL from elsewhere)
#   BAZEL    bazel command used to build it (default "bazel")
#   SIZE     advise --size (default 1G)
#   TIME     advise --time per filesystem (default 60)
#   FSES     filesystems (default "xfs ext4 ext4_noextents")
#   OUT      result directory (default bench-results/advise, relative to the
#            directory the script was started from)
#   WORKDIR  where the loop files go (default /var/tmp)
set -euo pipefail
CALLER_PWD=$PWD
cd "$(dirname "$0")/.."
SIZE=${SIZE:-1G}
TIME=${TIME:-60}
FSES=${FSES:-xfs ext4 ext4_noextents}
OUT=${OUT:-bench-results/advise}
[[ $OUT == /* ]] || OUT="$CALLER_PWD/$OUT"
BUILT_HERE=0
if [[ -z ${IMGTOOL:-} ]]; then
  ${BAZEL:-bazel} build //imgtool >&2
  IMGTOOL=$PWD/bazel-bin/imgtool/imgtool
  BUILT_HERE=1
fi
BASE=$(mktemp -d "${WORKDIR:-/var/tmp}/advise_fs.XXXXXX")
MNT=""
cleanup() {
  [[ -z $MNT ]] || umount "$MNT" 2>/dev/null || umount -l "$MNT" 2>/dev/null || true
  rm -rf "$BASE"
}
trap cleanup EXIT
HOST=$(hostname)
# the JSON's imgtool_commit, as benchmarks/run.sh gives the suites theirs;
# this checkout's HEAD says nothing about an IMGTOOL built elsewhere
COMMIT=${IMGTOOL_COMMIT:-unknown}
if [[ -z ${IMGTOOL_COMMIT:-} && $BUILT_HERE == 1 ]] &&
    HEAD_ID=$(git rev-parse --short HEAD 2>/dev/null); then
  COMMIT=$HEAD_ID
  [[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]] || COMMIT="$COMMIT-dirty"
fi
for fs in $FSES; do
  img="$BASE/$fs.img"
  truncate -s 4G "$img"
  case $fs in
    xfs) mkfs.xfs -q "$img" ;;
    ext4) mkfs.ext4 -q "$img" ;;
    ext4_noextents) mkfs.ext4 -q -O ^extent,^64bit "$img" ;;
    *) echo "unknown filesystem $fs" >&2; exit 1 ;;
  esac
  MNT="$BASE/$fs"
  mkdir -p "$MNT" "$OUT/$fs"
  mount -o loop "$img" "$MNT"
  echo "== $fs (load $(cut -d' ' -f1-3 /proc/loadavg))" >&2
  "$IMGTOOL" advise --size "$SIZE" --time "$TIME" --output=json \
    --imgtool-commit "$COMMIT" "$MNT" \
    >"$OUT/$fs/advise-$HOST.json"
  umount "$MNT"
  MNT=""
  rm -f "$img"
  python3 benchmarks/check_results.py "$OUT/$fs/advise-$HOST.json"
  python3 - "$OUT/$fs/advise-$HOST.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))["context"]
for w in ("random-4k", "sequential", "overlay"):
    if "winner_" + w in c:
        print("%s %s: %s" % (c["filesystems"], w, c.get("winner_%s_verdict" % w, c["winner_" + w])))
print("notes:", c["notes"])
PY
done
