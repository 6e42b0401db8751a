# Helpers of the NBD server oracle tests (nbd_server_oracle_test.sh,
# nbd_hostile_oracle_test.sh): qemu-nbd and imgtool nbd started with --fork
# and a pid file on unix sockets, stopped on every exit path.
# Needs IMGTOOL (absolute path of the binary); nbd_setup makes WORK and
# SOCKDIR.

# nbd_setup NAME: WORK (a scratch directory under TEST_TMPDIR) and SOCKDIR (a
# short directory under /tmp with q/ for qemu-nbd's sockets and pid files, o/
# for imgtool's: unix socket paths must stay under 108 bytes, and Bazel's
# TEST_TMPDIR is long), both removed at exit after every server is stopped.
nbd_setup() {
  WORK=$(mktemp -d "${TEST_TMPDIR:-/tmp}/$1.XXXXXX")
  SOCKDIR=$(mktemp -d /tmp/nbdso.XXXXXX)
  mkdir -p "$SOCKDIR/q" "$SOCKDIR/o"
  trap 'stop_servers; rm -rf "$WORK" "$SOCKDIR"' EXIT
  trap 'exit 1' INT TERM
}

# stop_pid_file FILE: SIGTERM to the pid in FILE, SIGKILL if still there
# after 5 s; removes FILE.
stop_pid_file() {
  local f=$1 pid
  [[ -f "$f" ]] || return 0
  pid=$(cat "$f")
  if [[ -n "$pid" ]]; then
    kill "$pid" 2>/dev/null
    # Wait until it is gone (it is not our child after --fork).
    for _ in $(seq 250); do kill -0 "$pid" 2>/dev/null || break; sleep 0.02; done
    kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$f"
}
stop_servers() {
  local f
  for f in "$SOCKDIR"/q/*.pid "$SOCKDIR"/o/*.pid; do stop_pid_file "$f"; done
}

# serve WHO NAME ARGS...: starts qemu-nbd (WHO=q) or imgtool nbd (WHO=o)
# with --fork on $SOCKDIR/WHO/NAME.sock; its pid in NAME.pid.
serve() {
  local who=$1 name=$2
  shift 2
  local prog=(qemu-nbd)
  [[ $who == o ]] && prog=("$IMGTOOL" nbd)
  rm -f "$SOCKDIR/$who/$name.sock"
  if ! timeout 30 "${prog[@]}" --fork --pid-file="$SOCKDIR/$who/$name.pid" \
    -k "$SOCKDIR/$who/$name.sock" "$@" 2>"$WORK/serve.err"; then
    echo "SETUP FAILED: ${prog[*]} $*: $(cat "$WORK/serve.err")"
  fi
}
stop() { stop_pid_file "$SOCKDIR/$1/$2.pid"; }
uri() { echo "nbd+unix:///${3:-}?socket=$SOCKDIR/$1/$2.sock"; }
