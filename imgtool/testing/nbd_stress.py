"""Hostile NBD clients that take time or hold connections, for
nbd_hostile_oracle_test.sh (nbd_hostile.py has the quick malformed probes).

Usage:
  nbd_stress.py slow-write SOCKET PID
      Client A: GO, then a WRITE announcing 32 MiB whose payload comes in
      4 KiB pieces every 100 ms for 2 s (80 KiB in all), then A leaves.
      Meanwhile client B writes and reads back 4 KiB after each piece.
      Prints B's round trips and the server's VmRSS / VmHWM growth in KiB
      (/proc/PID/status) from before A connected to after A left.
  nbd_stress.py stall SOCKET URI silent|half
      For a server with -e 1: a client connects and closes at once (a port
      scan), then one connects and sends nothing (silent) or its flags and
      half an option header (half); then nbdinfo --size URI, queued behind
      the stalled client until the server drops it. Prints nbdinfo's answer
      and whether the server closed the stalled client ("after at least
      9 s": a lower bound that load cannot break, the only timing printed).
  nbd_stress.py many SOCKET N
      N clients connect at once to a server with -e 2: prints which were
      greeted, then which after the first greeted one leaves.
The output of imgtool nbd is compared with qemu-nbd 7.2's line by line.
"""
import select
import socket
import subprocess
import struct
import sys
import time

from nbd_hostile import connect, go, recv_exact, reply, request

CMD_READ, CMD_WRITE = 0, 1


def status_kib(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def slow_write(path, pid):
    b = connect(path)
    go(b, structured=False)
    # B's first round trip before the baseline: its buffers exist already.
    request(b, CMD_WRITE, 40 << 20, 4096, payload=b"\x5b" * 4096)
    assert reply(b) == 0
    rss0, hwm0 = status_kib(pid, "VmRSS"), status_kib(pid, "VmHWM")
    a = connect(path)
    go(a, structured=False)
    # 32 MiB announced at offset 0.
    a.sendall(struct.pack(">IHHQQI", 0x25609513, 0, CMD_WRITE, 7, 0, 32 << 20))
    ok = 0
    pieces = 20
    for i in range(pieces):
        a.sendall(bytes([i + 1]) * 4096)
        data = bytes([0x60 + i]) * 4096
        request(b, CMD_WRITE, (40 << 20) + i * 4096, 4096, payload=data,
                handle=100 + i)
        if reply(b) != 0:
            continue
        request(b, CMD_READ, (40 << 20) + i * 4096, 4096, handle=200 + i)
        magic, error, handle = struct.unpack(">IIQ", recv_exact(b, 16))
        if error == 0 and recv_exact(b, 4096) == data:
            ok += 1
        time.sleep(0.1)
    rss1 = status_kib(pid, "VmRSS")
    a.close()
    # A's request never completed: B still works afterwards.
    request(b, CMD_READ, 40 << 20, 4096, handle=300)
    magic, error, handle = struct.unpack(">IIQ", recv_exact(b, 16))
    after = error == 0 and recv_exact(b, 4096) == b"\x60" * 4096
    hwm1 = status_kib(pid, "VmHWM")
    b.close()
    print(f"second client: {ok} of {pieces} round trips during the slow write")
    print(f"second client after A left: {'ok' if after else 'failed'}")
    print(f"growth KiB: rss {rss1 - rss0} hwm {hwm1 - hwm0}")


def closed_within(s, timeout):
    """True when the server closes `s` (EOF or reset) within `timeout` s."""
    s.setblocking(False)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        r, _, _ = select.select([s], [], [], max(0.0, end - time.monotonic()))
        if r:
            try:
                if not s.recv(4096):
                    return True
            except ConnectionError:
                return True
    return False


def stall(path, uri, kind):
    start = time.monotonic()
    scan = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    scan.connect(path)
    scan.close()
    if kind == "silent":
        stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stalled.connect(path)
    else:
        stalled = connect(path)
        stalled.sendall(struct.pack(">Q", 0x49484156454F5054))
    # The one slot of -e 1 is taken: nbdinfo waits in the backlog until the
    # server drops the stalled client, then is served.
    info = subprocess.run(["nbdinfo", "--size", uri], capture_output=True,
                          text=True, timeout=60)
    print(f"nbdinfo --size: {info.stdout.strip()} (exit {info.returncode})")
    closed = closed_within(stalled, 60)
    seconds = int(time.monotonic() - start)
    print(f"{kind} client: {'closed' if closed else 'still open'}"
          f"{' after at least 9 s' if closed and seconds >= 9 else ''}")
    stalled.close()


def greeted(s, timeout):
    r, _, _ = select.select([s], [], [], timeout)
    if not r:
        return False
    recv_exact(s, 18)
    return True


def newly_greeted(conns, candidates, timeout):
    """The candidates greeted within `timeout` s (one select over all)."""
    r, _, _ = select.select([conns[i] for i in candidates], [], [], timeout)
    ready = [i for i in candidates if conns[i] in r]
    for i in ready:
        recv_exact(conns[i], 18)
    return ready


def many(path, n):
    conns = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(path)
        conns.append(s)
    # The first two are served at once (wait as long as load needs); the
    # others must not be greeted while two are connected: any greeting
    # within 1 s would be one too many, load cannot cause one.
    first = [i for i in range(2) if greeted(conns[i], 30)]
    for i in first:
        conns[i].sendall(struct.pack(">I", 3))
        go(conns[i], structured=False)
    waiting = list(range(2, n))
    extra = newly_greeted(conns, waiting, 1)
    print(f"greeted while 2 are connected: {first + extra}")
    conns[0].close()
    waiting = [i for i in waiting if i not in extra]
    nxt = newly_greeted(conns, waiting, 30)
    waiting = [i for i in waiting if i not in nxt]
    also = newly_greeted(conns, waiting, 1) if waiting else []
    print(f"greeted after client 0 left: {nxt}, then {also}")
    for s in conns[1:]:
        s.close()


def main():
    cmd = sys.argv[1]
    if cmd == "slow-write":
        slow_write(sys.argv[2], int(sys.argv[3]))
    elif cmd == "stall":
        stall(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "many":
        many(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
