#!/usr/bin/env bash
# Oracle test for measure: imgtool and qemu-img 7.2 must print the same
# numbers, messages and exit status over a grid of qcow2 output options
# (cluster sizes 512..2M, extended_l2, preallocation, refcount_bits,
# compat) and sizes, and for sources with holes, written zeroes, data,
# zero and compressed clusters, backing files and "backing": null.
# Usage: measure_oracle_test.sh PATH_TO_IMGTOOL
set -u
IMGTOOL=$(realpath "$1")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/measure_oracle.XXXXXX")
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

S=$WORK/src
mkdir -p "$S"
m() { same_output "$S" measure "$@"; }

# --- Sources ---------------------------------------------------------------
(
  cd "$S" || exit 1
  truncate -s 10M sparse.raw
  # Data, written zeroes (data to block status), holes, an odd tail.
  truncate -s 5M mixed.raw
  head -c 70000 /dev/urandom | dd of=mixed.raw conv=notrunc status=none
  dd if=/dev/zero of=mixed.raw bs=1k seek=1024 count=512 conv=notrunc status=none
  head -c 5000 /dev/urandom | dd of=mixed.raw bs=1 seek=3000000 conv=notrunc status=none
  head -c 1000 /dev/urandom >odd.raw
  # qcow2 without backing: data, zero clusters, a compressed cluster,
  # extended L2 subclusters.
  mk plain.qcow2 8M
  qio -c 'write -P 1 0 100k' -c 'write -z 1M 256k' -c 'write -P 2 3M 4k' \
    -c 'write -c -P 3 6M 64k' plain.qcow2
  mk -o cluster_size=512 small.qcow2 1M
  qio -c 'write -P 1 1000 3000' -c 'write -P 2 600k 1' small.qcow2
  mk -o extended_l2=on,cluster_size=128k sub.qcow2 4M
  qio -c 'write -P 1 4k 4k' -c 'write -z 1M 64k' -c 'write -P 2 2M 200k' sub.qcow2
  # Backing chains: raw under qcow2, qcow2 under qcow2, a shorter backing.
  truncate -s 6M base.raw
  head -c 300000 /dev/urandom | dd of=base.raw bs=1k seek=2048 conv=notrunc status=none
  mk -b base.raw -F raw over.qcow2 8M
  qio -c 'write -P 5 0 64k' -c 'write -z 2M 64k' over.qcow2
  mk base.qcow2 2M
  qio -c 'write -P 7 512k 1M' base.qcow2
  mk -b base.qcow2 -F qcow2 top.qcow2 4M
  qio -c 'write -P 8 3M 1k' top.qcow2
  mk -o compat=0.10 v2.qcow2 3M
  qio -c 'write -P 9 1M 1M' v2.qcow2
  mk empty.qcow2 0
  # Data clusters whose host range is a hole in the file: counted unless
  # the image looks metadata-preallocated (QEMU's recurse heuristic).
  mk punched.qcow2 8M
  qio -c 'write -P 1 0 4M' punched.qcow2
  fallocate --punch-hole -o $((0x50000)) -l 65536 punched.qcow2
  mk sparse-punched.qcow2 4M
  qio -c 'write -P 1 0 128k' sparse-punched.qcow2
  fallocate --punch-hole -o $((0x50000)) -l 65536 sparse-punched.qcow2
  mk -o preallocation=metadata meta.qcow2 4M
  qio -c 'write -P 1 1M 64k' meta.qcow2
  mk -o preallocation=falloc falloc.qcow2 4M
)

# --- --size grid -------------------------------------------------------------
for size in 0 1 512 1000 65537 1G 100G; do
  m --size "$size"
  m --size "$size" -O qcow2
done
m --size 9223372036854775807
m --size 2P -O qcow2 -o cluster_size=2M
m --size 2P -O qcow2
m --size 9223372036854775807 -O qcow2
m --size 128G -O qcow2 -o cluster_size=512
m --size 129G -O qcow2 -o cluster_size=512
for cs in 512 1k 2k 4k 8k 16k 32k 64k 128k 256k 512k 1M 2M; do
  for rb in 1 2 4 8 16 32 64; do
    m --size 1G -O qcow2 -o cluster_size=$cs,refcount_bits=$rb
  done
  m --size 7777777 -O qcow2 -o cluster_size=$cs,refcount_bits=1
  m --size 100G -O qcow2 -o cluster_size=$cs,refcount_bits=64
  for p in off metadata falloc full; do
    m --size 3G -O qcow2 -o cluster_size=$cs,preallocation=$p
  done
done
for cs in 16k 64k 512k 2M; do
  for p in off metadata falloc full; do
    m --size 10G -O qcow2 -o extended_l2=on,cluster_size=$cs,preallocation=$p
  done
done
m --size 1G -O qcow2 -o compat=0.10
m --size 1G -O qcow2 -o compat=1.1,lazy_refcounts=on
m --size 1G -O qcow2 -o backing_file=x,backing_fmt=raw
m --size 1G -O raw -o preallocation=full
m --size 1G -O qcow2 -o size=5G
m -O qcow2 -o size=5G --size 1G
m --size 1G -O qcow2 -o cluster_size=64k -o cluster_size=4k
m --output=json --size 1G -O qcow2
m --output=json --size 1G
m --output=human --size 1G

# --- Sources -----------------------------------------------------------------
for f in sparse.raw mixed.raw odd.raw plain.qcow2 small.qcow2 sub.qcow2 \
  over.qcow2 top.qcow2 v2.qcow2 empty.qcow2 base.raw base.qcow2 \
  punched.qcow2 sparse-punched.qcow2 meta.qcow2 falloc.qcow2; do
  m "$f"
  m -O qcow2 "$f"
  m --output=json -O qcow2 "$f"
  m --output=json "$f"
  for cs in 512 4k 64k 2M; do m -O qcow2 -o cluster_size=$cs "$f"; done
  m -O qcow2 -o extended_l2=on,cluster_size=32k "$f"
  m -O qcow2 -o compat=0.10 "$f"
  m -O qcow2 -o preallocation=full,refcount_bits=2 "$f"
  m -O qcow2 -o backing_file=x "$f"
done
m -f raw mixed.raw -O qcow2
m -f qcow2 over.qcow2 -O qcow2 -U
m -O qcow2 'json:{"driver":"qcow2","file":{"driver":"file","filename":"over.qcow2"},"backing":null}'
m --output=json -O qcow2 'json:{"driver":"qcow2","file":{"driver":"file","filename":"top.qcow2"},"backing":null}'
m -O qcow2 'json:{"driver":"qcow2","file":{"driver":"file","filename":"top.qcow2"}}'
m -O qcow2 --image-opts driver=qcow2,file.filename=top.qcow2
m -O qcow2 --image-opts driver=raw,file.filename=mixed.raw

# --- Errors ------------------------------------------------------------------
m
m --size 1G plain.qcow2
m plain.qcow2 sparse.raw
m -f qcow2 --size 1G
m --image-opts --size 1G
m -l snap --size 1G
m -l snap plain.qcow2
m -l snap sparse.raw
m --size 1x
m --size -1
m --size 9223372036854775808
m --output=xml --size 1G
m -O foo --size 1G
m -O vmdk_nonexistent --size 1G
m -O file --size 1G
m -O qcow2 -o foo=bar --size 1G
m -O raw -o cluster_size=4k --size 1G
m -O qcow2 -o cluster_size=3k --size 1G
m -O qcow2 -o cluster_size=4M --size 1G
m -O qcow2 -o cluster_size=4k,extended_l2=on --size 1G
m -O qcow2 -o extended_l2=maybe --size 1G
m -O qcow2 -o refcount_bits=3 --size 1G
m -O qcow2 -o refcount_bits=128 --size 1G
m -O qcow2 -o refcount_bits=x --size 1G
m -O qcow2 -o compat=0.10,refcount_bits=8 --size 1G
m -O qcow2 -o compat=2 --size 1G
m -O qcow2 -o compat=v3 --size 1G
m -O qcow2 -o preallocation=foo --size 1G
m -O qcow2 -o cluster_size=1x --size 1G
m -O qcow2 -o , --size 1G
m -O qcow2 -o 'cluster_size=4k,' --size 1G
m -O qcow2 missing.qcow2
m -O qcow2 -f qcow2 sparse.raw
m -O foo missing.qcow2

finish
