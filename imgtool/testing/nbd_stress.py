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
  nbd_stress.py pipeline SOCKET
      Requests pipelined in one sendall() each (the server parses several
      from one receive): 64 WRITEs (62 of 4 KiB, whose 4,124-byte requests
      straddle any 64 KiB receive buffer's edges, and 2 of 96 KiB), then 64
      READs of them, then a WRITE + READ pair in one packet, then a READ
      past the end among valid ones; with simple and with structured
      replies. Replies may come in any order: each handle must be answered
      once, with its error and the data written. Prints counts only.
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


def replies(s, want):
    """Reads replies until every handle in `want` ({handle: READ length or
    0}) is answered: {handle: (error, data)}. A structured READ's data is
    its OFFSET_DATA chunks, placed by offset (no holes: all written)."""
    got = {}
    while len(got) < len(want):
        magic = struct.unpack(">I", recv_exact(s, 4))[0]
        if magic == 0x67446698:  # simple
            error, handle = struct.unpack(">IQ", recv_exact(s, 12))
            assert handle in want and handle not in got, handle
            data = recv_exact(s, want[handle]) if error == 0 else b""
            got[handle] = (error, data)
            continue
        assert magic == 0x668E33EF, hex(magic)
        flags, rtype, handle, length = struct.unpack(">HHQI", recv_exact(s, 16))
        body = recv_exact(s, length)
        assert handle in want and handle not in got, handle
        error, data = partial.setdefault(handle, [0, bytearray(want[handle])])
        if rtype == 1:  # OFFSET_DATA: the offset is the request's + n
            rel = struct.unpack(">Q", body[:8])[0] - base_of[handle]
            data[rel:rel + len(body) - 8] = body[8:]
        elif rtype & 0x8000:
            partial[handle][0] = struct.unpack(">I", body[:4])[0]
        if flags & 1:  # DONE
            e, d = partial.pop(handle)
            got[handle] = (e, bytes(d) if e == 0 else b"")
    return got


partial = {}
base_of = {}


def pipeline(path):
    base = 8 << 20
    for structured in (False, True):
        tag = "structured" if structured else "simple"
        s = connect(path)
        go(s, structured)
        s.settimeout(60)
        # (handle, offset, length, fill byte) for 64 writes.
        writes = []
        for i in range(64):
            length = 96 * 1024 if i in (20, 41) else 4096
            offset = base + i * 128 * 1024
            writes.append((1000 + i, offset, length, (i * 7 + 1) & 0xFF))
        packet = b"".join(
            struct.pack(">IHHQQI", 0x25609513, 0, CMD_WRITE, h, o, n) +
            bytes([b]) * n for h, o, n, b in writes)
        s.sendall(packet)
        got = replies(s, {h: 0 for h, _, _, _ in writes})
        ok = sum(1 for h, _, _, _ in writes if got[h][0] == 0)
        print(f"{tag}: {len(packet)} bytes, 64 writes in one send: "
              f"{len(got)} answered, {ok} ok")
        packet = b"".join(
            struct.pack(">IHHQQI", 0x25609513, 0, CMD_READ, h + 100, o, n)
            for h, o, n, _ in writes)
        for h, o, n, _ in writes:
            base_of[h + 100] = o
        s.sendall(packet)
        got = replies(s, {h + 100: n for h, _, n, _ in writes})
        ok = sum(1 for h, _, n, b in writes
                 if got[h + 100] == (0, bytes([b]) * n))
        print(f"{tag}: 64 reads in one send: {len(got)} answered, "
              f"{ok} with the data written")
        # A WRITE and a READ (of another range) in one packet.
        h0, o0, n0, b0 = writes[5]
        base_of[7] = o0
        s.sendall(struct.pack(">IHHQQI", 0x25609513, 0, CMD_WRITE, 6,
                              base + 64 * 128 * 1024, 512) + b"\x77" * 512 +
                  struct.pack(">IHHQQI", 0x25609513, 0, CMD_READ, 7, o0, n0))
        got = replies(s, {6: 0, 7: n0})
        print(f"{tag}: write + read in one packet: write error {got[6][0]}, "
              f"read error {got[7][0]}, data "
              f"{'right' if got[7][1] == bytes([b0]) * n0 else 'wrong'}")
        # A READ past the end between two valid ones: its error only.
        base_of[8], base_of[10] = base, base + 128 * 1024
        s.sendall(b"".join(struct.pack(">IHHQQI", 0x25609513, 0, CMD_READ,
                                       h, o, 4096)
                           for h, o in ((8, base), (9, 1 << 40),
                                        (10, base + 128 * 1024))))
        got = replies(s, {8: 4096, 9: 4096, 10: 4096})
        print(f"{tag}: read past the end among two: errors "
              f"{[got[h][0] for h in (8, 9, 10)]}, data "
              f"{[got[h][1] == bytes([writes[i][3]]) * 4096 for h, i in ((8, 0), (10, 1))]}")
        s.close()


def main():
    cmd = sys.argv[1]
    if cmd == "slow-write":
        slow_write(sys.argv[2], int(sys.argv[3]))
    elif cmd == "stall":
        stall(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "many":
        many(sys.argv[2], int(sys.argv[3]))
    elif cmd == "pipeline":
        pipeline(sys.argv[2])
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
