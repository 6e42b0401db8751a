#!/usr/bin/python3 -S
"""An oldstyle NBD server for nbd_oldstyle_oracle_test.sh.

The NBD protocol document (doc/proto.md), "Oldstyle negotiation": the
greeting "NBDMAGIC", 0x00420281861253, the export's size (64 bits), FLAGS (32
bits, given on the command line: 0 is what QEMU's iotest 277 server,
nbd-fault-injector.py --classic-negotiation, sends) and 124 zero bytes; then
simple replies to READ, WRITE, FLUSH, TRIM (no-op) and DISC over FILE (the
export is the file's size), other commands EINVAL. One connection at a time,
as the fault injector, on the unix socket SOCKET; it serves the next
connection after one ends, until killed.

--drop-writes=N: the first N WRITE requests close the connection once their
data has been read, without a reply (the injector's event=data when=after).

Usage: nbd_oldstyle_server.py [--drop-writes=N] SOCKET FILE FLAGS
Prints "Listening on SOCKET" once it listens.
"""
import os
import socket
import struct
import sys

REQUEST_MAGIC = 0x25609513
REPLY_MAGIC = 0x67446698


def recv_all(conn, n):
    chunks = []
    while n > 0:
        chunk = conn.recv(min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b''.join(chunks)


def serve(conn, fd, size, flags, state):
    conn.sendall(struct.pack('>8sQQI124x', b'NBDMAGIC', 0x00420281861253,
                             size, flags))
    while True:
        req = recv_all(conn, 28)
        if req is None:
            return
        magic, _, cmd, handle, offset, length = struct.unpack('>IHHQQI', req)
        if magic != REQUEST_MAGIC:
            return
        error = 0
        if cmd == 2:  # NBD_CMD_DISC
            return
        if cmd in (0, 1) and (offset > size or length > size - offset):
            error = 22
        if cmd == 1:  # NBD_CMD_WRITE
            data = recv_all(conn, length)
            if data is None:
                return
            if state['drop_writes'] > 0:
                state['drop_writes'] -= 1
                return
            if not error:
                os.pwrite(fd, data, offset)
        elif cmd == 0:  # NBD_CMD_READ
            if not error:
                data = os.pread(fd, length, offset)
                conn.sendall(struct.pack('>IIQ', REPLY_MAGIC, 0, handle) + data)
                continue
        elif cmd == 3:  # NBD_CMD_FLUSH
            os.fsync(fd)
        elif cmd != 4:  # not NBD_CMD_TRIM (a no-op)
            error = 22
        conn.sendall(struct.pack('>IIQ', REPLY_MAGIC, error, handle))


def main(argv):
    state = {'drop_writes': 0}
    args = []
    for a in argv[1:]:
        if a.startswith('--drop-writes='):
            state['drop_writes'] = int(a.split('=', 1)[1])
        else:
            args.append(a)
    if len(args) != 3:
        sys.stderr.write(__doc__)
        return 2
    path, file, flags = args[0], args[1], int(args[2], 0)
    fd = os.open(file, os.O_RDWR)
    size = os.fstat(fd).st_size
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(path)
    sock.listen(0)
    print('Listening on %s' % path, flush=True)
    while True:
        conn, _ = sock.accept()
        try:
            serve(conn, fd, size, flags, state)
        except OSError:
            pass
        conn.close()


if __name__ == '__main__':
    sys.exit(main(sys.argv))
