#!/bin/bash
# The drop-in names: imgtool installed as qemu-img and qemu-io (by
# imgtool/install.sh, as `bazel run //imgtool:install` does) against the
# real qemu-img and qemu-io 7.2: the same stderr and exit code for errors
# that name the program, the same prompt, a --version first line that the
# callers' regex accepts (Cinder: `qemu-img version ([0-9.]*)`), and the
# --help text CloudStack greps (--target-is-zero). Run as imgtool, the
# binary keeps its own name.
# Usage: dropin_test.sh IMGTOOL INSTALL_SH
set -u
IMGTOOL=$(realpath "$1")
INSTALL=$(realpath "$2")
WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/dropin.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${TEST_SRCDIR:-}" ]]; then
  source "$TEST_SRCDIR/$TEST_WORKSPACE/imgtool/testing/oracle_lib.sh" || exit 1
else
  source "$(dirname "$0")/oracle_lib.sh" || exit 1
fi

bash "$INSTALL" "$IMGTOOL" "$WORK/bin" >/dev/null || fail "install.sh failed"
for name in imgtool qemu-img qemu-io; do
  [[ -x $WORK/bin/$name ]] || fail "install.sh made no $WORK/bin/$name"
done
[[ $(readlink "$WORK/bin/qemu-img") == imgtool ]] ||
  fail "qemu-img is not a link to imgtool"
QEMU_IMG=$(command -v qemu-img)
QEMU_IO=$(command -v qemu-io)

# same TOOL STDIN ARGS...: the real TOOL and the installed one, both found
# through PATH as callers run them (getopt's messages name argv[0]), run in
# copies of one directory with STDIN as input, print the same stdout and
# stderr and exit with the same code.
same() {
  local tool=$1 input=$2
  shift 2
  checks=$((checks + 1))
  local real
  if [[ $tool == qemu-img ]]; then real=$QEMU_IMG; else real=$QEMU_IO; fi
  local d="$WORK/c$checks"
  mkdir -p "$d/real" "$d/ours"
  truncate -s 1M "$d/real/img.raw"
  cp "$d/real/img.raw" "$d/ours/img.raw"
  (cd "$d/real" && printf '%s' "$input" | PATH="$(dirname "$real"):$PATH" "$tool" "$@" >../real.out 2>../real.err)
  local real_rc=$?
  (cd "$d/ours" && printf '%s' "$input" | PATH="$WORK/bin:$PATH" "$tool" "$@" >../ours.out 2>../ours.err)
  same_results "$tool $*" "$d" "$real_rc" "$?"
}

same qemu-img '' info missing.qcow2
same qemu-img '' -f qcow2 info img.raw
same qemu-img ''
same qemu-img '' frobnicate img.raw
same qemu-img '' info --frobnicate img.raw
same qemu-img '' check -f raw img.raw
same qemu-img '' create -f qcow2 new.qcow2 1P1
same qemu-img '' info -f qcow2 img.raw
same qemu-io '' -c 'read 0 512' missing.raw
same qemu-io '' -f raw -c 'read 2M 512' img.raw
same qemu-io $'write -P 1 0 512\nread -P 2 0 512\nquit\n' -f raw img.raw
same qemu-io '' -f raw -c frobnicate img.raw
# qemu-io's own help, and its usage failures (getopt's message, the whole
# help on stdout, exit 1).
same qemu-io '' -h
same qemu-io '' --help
same qemu-io '' --frobnicate img.raw
same qemu-io '' -x img.raw
same qemu-io '' -c
same qemu-io '' --cmd
same qemu-io '' -f raw img.raw other.raw

# --version: the first line callers parse.
checks=$((checks + 1))
first=$("$WORK/bin/qemu-img" --version | head -1)
[[ $first == 'qemu-img version 7.2.0 (imgtool 0.2.0)' ]] ||
  fail "qemu-img --version first line: '$first'"
[[ $first =~ ^qemu-img\ version\ ([0-9.]*) && ${BASH_REMATCH[1]} == 7.2.0 ]] ||
  fail "Cinder's regex does not find 7.2.0 in '$first'"
first=$("$WORK/bin/qemu-io" --version | head -1)
[[ $first == 'qemu-io version 7.2.0 (imgtool 0.2.0)' ]] ||
  fail "qemu-io --version first line: '$first'"
first=$("$WORK/bin/imgtool" --version | head -1)
[[ $first == 'imgtool version 0.2.0' ]] ||
  fail "imgtool --version first line: '$first'"
# -V anywhere among qemu-io's options prints the version before any open.
for args in "-V" "-f raw -V img.raw" "-c quit --version missing.raw"; do
  checks=$((checks + 1))
  # shellcheck disable=SC2086
  first=$("$WORK/bin/qemu-io" $args | head -1)
  [[ $first == 'qemu-io version 7.2.0 (imgtool 0.2.0)' ]] ||
    fail "qemu-io $args first line: '$first'"
done
checks=$((checks + 1))
first=$("$WORK/bin/imgtool" io -V | head -1)
[[ $first == 'imgtool version 0.2.0' ]] ||
  fail "imgtool io -V first line: '$first'"

# imgtool io --help lists every option qemu-io --help lists.
io_help=$("$WORK/bin/imgtool" io --help)
while read -r opt; do
  checks=$((checks + 1))
  grep -q -e "$opt[ ,]" <<<"$io_help" || fail "imgtool io --help lacks $opt"
done < <(qemu-io --help | grep -o -E '^  (-[A-Za-z], )?--[a-z-]+' |
         grep -o -E -- '--[a-z-]+$|^  -[A-Za-z]' | sed 's/^  //')

# --help: under qemu-img's name, with the options callers look for.
checks=$((checks + 1))
help=$("$WORK/bin/qemu-img" --help)
grep -q -- '--target-is-zero' <<<"$help" || fail "qemu-img --help lacks --target-is-zero"
grep -q '^  convert ' <<<"$help" || fail "qemu-img --help lacks convert"
grep -q 'imgtool' <<<"$(sed 1d <<<"$help")" &&
  fail "qemu-img --help names imgtool past its first line"
grep -q "^usage: qemu-img " <<<"$help" || fail "qemu-img --help: no 'usage: qemu-img' line"
for cmd in amend commit dd info measure rebase; do
  grep -q "^  $cmd " <<<"$help" || fail "qemu-img --help lacks $cmd"
done
# libguestfs: `qemu-img --help | grep -sqE '\binfo\b.*-U\b'`.
grep -sqE '\binfo\b.*-U\b' <<<"$help" || fail "qemu-img --help: no 'info ... -U'"

# Run as imgtool (also through a link of another name), it stays imgtool.
checks=$((checks + 1))
ln -s imgtool "$WORK/bin/other-name"
err=$(cd "$WORK" && "$WORK/bin/other-name" info missing.qcow2 2>&1 >/dev/null)
[[ $err == "imgtool: Could not open 'missing.qcow2': Could not open 'missing.qcow2': No such file or directory" ]] ||
  fail "other-name info missing.qcow2: '$err'"

echo "$checks checks, $failures failures"
[[ $failures == 0 ]]
