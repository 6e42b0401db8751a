#!/usr/bin/env bash
# Oracle test for commit: imgtool and qemu-img 7.2 run on copies of the same
# backing chains must print the same output, exit with the same status and
# leave the same files behind (base and top byte for byte, allocation map,
# info). Then a commit killed half way leaves valid images with the guest
# view unchanged.
# Usage: commit_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/commit_oracle.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi

if ! command -v qemu-img >/dev/null; then
  echo "qemu-img not installed"
  exit 1
fi

# qemu-img's mirror job writes up to 16 requests at once, so the host
# clusters a qcow2 base allocates for several ranges come in whatever order
# they finish: its files differ from run to run (imgtool writes in guest
# order). Such a base is compared by what qemu-img sees of it: same length,
# same content, the same qcow2 allocation (map without host offsets), and
# a clean check. Everything else (the top, raw bases, stdout, stderr, exit
# status) must be identical.
qcow2_view() {  # qcow2_view FILE: the allocation without host offsets
  # map's extents, merged where only the host offsets had split them.
  qemu-img map -U -f qcow2 --output=json "$1" |
    sed -n 's/.*"start": \([0-9]*\), "length": \([0-9]*\), \(.*\), "data": \([a-z]*\).*/\1 \2 \3 \4/p' |
    awk '{ k = $3 " " $4 " " $5 " " $6 " " $7 " " $8 " " $9
           if (k == key && $1 == end) { end += $2; next }
           if (key != "") print start, end, key
           start = $1; end = $1 + $2; key = k }
         END { if (key != "") print start, end, key }'
  qemu-img info -U --output=json "$1" | grep -v '"actual-size"\|"filename"\|"dirty-flag"'
}
same_files() {  # same_files DIR_A DIR_B LABEL
  local f
  for f in $(ls -A "$1" | sort); do
    [[ -f "$1/$f" ]] || continue
    cmp -s "$1/$f" "$2/$f" && continue
    if [[ $f == *.qcow2 && $(stat -c %s "$1/$f") == $(stat -c %s "$2/$f") ]] &&
      qemu-img compare -q -U "$1/$f" "$2/$f" &&
      qemu-img check -q "$1/$f" && qemu-img check -q "$2/$f" &&
      [[ "$(qcow2_view "$1/$f")" == "$(qcow2_view "$2/$f")" ]]; then
      continue
    fi
    fail "$3: $f differs"
    diff <(qcow2_view "$1/$f" 2>&1) <(qcow2_view "$2/$f" 2>&1) | head -10
  done
}
same_effect() {
  local setup=$1
  shift
  checks=$((checks + 1))
  local a="$WORK/effect.a" b="$WORK/effect.b"
  rm -rf "$a" "$b"
  mkdir -p "$a" "$b"
  (cd "$a" && $setup)
  (cd "$b" && $setup)
  run "$IMGTOOL" "$a" "$@"
  local a_out=$OUT a_err=$ERR a_rc=$RC
  run qemu-img "$b" "$@"
  diff_text "$*" stdout "$a_out" "$OUT" &&
    diff_text "$*" stderr "$a_err" "$ERR" &&
    diff_text "$*" "exit status" "$a_rc" "$RC" &&
    same_files "$a" "$b" "$*"
}

# The chains (run in the directory the files go to).

# base.qcow2 <- top.qcow2: data over data, new data, a zero cluster over
# data, a zero cluster over nothing, a compressed cluster, a partial write.
chain_qcow2() {
  mk base.qcow2 4M
  qio -c 'write -P 0x11 0 1M' -c 'write -P 0x12 2M 128k' base.qcow2
  mk -b base.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0x21 64k 64k' -c 'write -P 0x22 1536k 100k' \
    -c 'write -z 256k 64k' -c 'write -z 3M 64k' -c 'write -c -P 0x23 2M 64k' \
    -c 'write -P 0x24 3500k 1k' top.qcow2
}
chain_raw_base() {
  truncate -s 4M base.raw
  qio -f raw -c 'write -P 0x31 0 192k' -c 'write -P 0x32 3M 64k' base.raw
  mk -b base.raw -F raw top.qcow2
  qio -c 'write -P 0x41 128k 128k' -c 'write -z 3M 64k' \
    -c 'write -P 0x42 1000k 3k' top.qcow2
}
# base <- mid <- top, each with its own data.
chain_3() {
  mk base.qcow2 4M
  qio -c 'write -P 0x51 0 2M' base.qcow2
  mk -b base.qcow2 -F qcow2 mid.qcow2
  qio -c 'write -P 0x52 1M 1M' -c 'write -z 0 64k' mid.qcow2
  mk -b mid.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0x53 1536k 64k' -c 'write -P 0x54 3M 64k' top.qcow2
}
chain_3_raw() {
  truncate -s 4M base.raw
  qio -f raw -c 'write -P 0x61 0 1M' base.raw
  mk -b base.raw -F raw mid.qcow2
  qio -c 'write -P 0x62 512k 1M' mid.qcow2
  mk -b mid.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0x63 768k 64k' top.qcow2
}
# Extended L2 entries: 4 KiB writes allocate single subclusters.
chain_subclusters() {
  mk -o cluster_size=128k,extended_l2=on base.qcow2 4M
  qio -c 'write -P 0x71 0 1M' base.qcow2
  mk -o cluster_size=128k,extended_l2=on -b base.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0x72 4k 4k' -c 'write -P 0x73 1M 8k' \
    -c 'write -z 256k 4k' -c 'write -P 0x74 2M 4k' top.qcow2
}
chain_subclusters_top_only() {
  mk base.qcow2 4M
  qio -c 'write -P 0x75 0 512k' base.qcow2
  mk -o cluster_size=64k,extended_l2=on -b base.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0x76 8k 2k' -c 'write -P 0x77 700k 4k' top.qcow2
}
# The backing file shorter than the overlay (the base grows), and longer.
chain_short_base() {
  mk base.qcow2 1M
  qio -c 'write -P 0x81 0 1M' base.qcow2
  mk -b base.qcow2 -F qcow2 top.qcow2 3M
  qio -c 'write -P 0x82 512k 64k' -c 'write -P 0x83 2M 64k' top.qcow2
}
chain_short_raw_base() {
  truncate -s 1M base.raw
  qio -f raw -c 'write -P 0x84 0 1M' base.raw
  mk -b base.raw -F raw top.qcow2 3M
  qio -c 'write -P 0x85 2M 64k' top.qcow2
}
chain_long_base() {
  mk base.qcow2 8M
  qio -c 'write -P 0x91 0 1M' -c 'write -P 0x92 6M 1M' base.qcow2
  mk -b base.qcow2 -F qcow2 top.qcow2 2M
  qio -c 'write -P 0x93 64k 64k' top.qcow2
}
# Other cluster sizes on each side.
chain_clusters() {
  mk -o cluster_size=4k base.qcow2 4M
  qio -c 'write -P 0xa1 0 1M' base.qcow2
  mk -o cluster_size=1M -b base.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0xa2 1M 4k' -c 'write -z 0 1M' top.qcow2
}
chain_big_base_cluster() {
  mk -o cluster_size=1M base.qcow2 4M
  mk -o cluster_size=4k -b base.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0xa3 8k 4k' -c 'write -P 0xa4 2M 64k' top.qcow2
}
# Version 2 images (no zero flag; emptying discards cluster by cluster).
chain_v2() {
  mk -o compat=0.10 base.qcow2 4M
  qio -c 'write -P 0xb1 0 1M' base.qcow2
  mk -o compat=0.10 -b base.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0xb2 64k 128k' -c 'write -P 0xb3 3M 64k' top.qcow2
}
# Nothing to commit.
chain_empty_top() {
  mk base.qcow2 1M
  qio -c 'write -P 0xc1 0 64k' base.qcow2
  mk -b base.qcow2 -F qcow2 top.qcow2
}
no_backing() {
  mk top.qcow2 1M
  qio -c 'write -P 0xd1 0 64k' top.qcow2
  truncate -s 1M top.raw
}

for setup in chain_qcow2 chain_raw_base chain_subclusters \
  chain_subclusters_top_only chain_short_base chain_short_raw_base \
  chain_long_base chain_clusters chain_big_base_cluster chain_v2 \
  chain_empty_top; do
  same_effect $setup commit top.qcow2
  same_effect $setup commit -d top.qcow2
done
same_effect chain_qcow2 commit -q -f qcow2 -t none top.qcow2
same_effect chain_qcow2 commit -f qcow2 -t writethrough -r 100M top.qcow2
same_effect chain_3 commit top.qcow2
same_effect chain_3 commit -d top.qcow2
same_effect chain_3 commit -b base.qcow2 top.qcow2
same_effect chain_3 commit -b mid.qcow2 top.qcow2
same_effect chain_3 commit -b ./base.qcow2 -d top.qcow2
same_effect chain_3 commit mid.qcow2
same_effect chain_3_raw commit -b base.raw top.qcow2
same_effect chain_3_raw commit top.qcow2
same_effect chain_qcow2 commit --image-opts \
  driver=qcow2,file.driver=file,file.filename=top.qcow2

# Errors.
same_effect no_backing commit top.qcow2
same_effect no_backing commit -f raw top.raw
same_effect no_backing commit -p top.qcow2
same_effect chain_3 commit -b nothere.qcow2 top.qcow2
same_effect chain_3 commit -b top.qcow2 top.qcow2
same_effect chain_qcow2 commit -t bogus top.qcow2
same_effect chain_qcow2 commit -r 1x top.qcow2
same_effect chain_qcow2 commit missing.qcow2
same_error "$WORK" commit
same_error "$WORK" commit a.qcow2 b.qcow2
same_error "$WORK" commit --bogus top.qcow2
same_effect chain_qcow2 commit -f raw --image-opts driver=qcow2,file.filename=top.qcow2

# -p: the records qemu-img prints in between depend on its event loop; the
# first and the last ones and the files must be the same.
progress_check() {
  local setup=$1
  shift
  checks=$((checks + 1))
  local a="$WORK/effect.a" b="$WORK/effect.b"
  rm -rf "$a" "$b"
  mkdir -p "$a" "$b"
  (cd "$a" && $setup)
  (cd "$b" && $setup)
  run "$IMGTOOL" "$a" commit -p "$@"
  local a_out=$OUT a_rc=$RC
  run qemu-img "$b" commit -p "$@"
  [[ "${a_out:0:16}" == "${OUT:0:16}" ]] ||
    fail "commit -p $*: first record: '${a_out:0:16}' vs '${OUT:0:16}'"
  local tail=$'    (100.00/100%)\r\nImage committed.\nx'
  [[ "$a_out" == *"$tail" && "$OUT" == *"$tail" ]] ||
    fail "commit -p $*: last record"
  [[ "$a_out" =~ ^(\ \ \ \ \([0-9]+\.[0-9][0-9]/100%\)$'\r')+$'\n' ]] ||
    fail "commit -p $*: records: $(printf %q "$a_out")"
  diff_text "commit -p $*" "exit status" "$a_rc" "$RC"
  same_files "$a" "$b" "commit -p $*"
}
progress_check chain_qcow2 top.qcow2
progress_check chain_3 -b base.qcow2 top.qcow2

# A commit killed while it copies (slowed by -r): every image stays valid
# (check: no corruption; leaks allowed) and the top reads as before.
checks=$((checks + 1))
k="$WORK/kill"
mkdir -p "$k"
(
  cd "$k" || exit 1
  mk base.qcow2 64M
  qio -c 'write -P 0xe1 0 64M' base.qcow2
  mk -b base.qcow2 -F qcow2 top.qcow2
  qio -c 'write -P 0xe2 1M 30M' -c 'write -z 40M 4M' top.qcow2
  qemu-img convert -O raw top.qcow2 view.raw
)
"$IMGTOOL" commit -r 10M "$k/top.qcow2" >/dev/null 2>&1 &
pid=$!
sleep 1.2
kill -KILL $pid
wait $pid 2>/dev/null
for f in base.qcow2 top.qcow2; do
  wait_until_unlocked "$k/$f"
  qemu-img check "$k/$f" >"$WORK/check.out" 2>&1
  rc=$?
  [[ $rc -eq 0 || $rc -eq 3 ]] || {
    fail "killed commit: check $f exit $rc"
    head -5 "$WORK/check.out"
  }
done
qemu-img compare -f qcow2 -F raw "$k/top.qcow2" "$k/view.raw" >/dev/null ||
  fail "killed commit: the top reads differently"
# The base got part of the data: done again, the commit completes.
"$IMGTOOL" commit "$k/top.qcow2" >/dev/null ||
  fail "killed commit: commit again failed"
qemu-img compare -f qcow2 -F raw "$k/base.qcow2" "$k/view.raw" >/dev/null ||
  fail "killed commit: the base does not read as the top did"
qemu-img check "$k/top.qcow2" >/dev/null || fail "check of the emptied top"

finish
