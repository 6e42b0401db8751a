"""Malformed and refused NBD traffic against a server on a unix socket.

Usage: nbd_hostile.py SOCKET
Prints one line per probe (the server's answer: option reply types, request
error numbers, or "closed"), so that the output for imgtool nbd can be
compared with qemu-nbd 7.2's for the same export. The export must be named
"" and be read-only (the write probe expects a refusal), at least 1 MiB.
"""
import socket
import struct
import sys

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY = 0x67446698
STRUCTURED_REPLY = 0x668E33EF


def recv_exact(s, n):
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def connect(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    magic, opt, flags = struct.unpack(">QQH", recv_exact(s, 18))
    assert magic == NBDMAGIC and opt == IHAVEOPT, (magic, opt)
    s.sendall(struct.pack(">I", 3))  # FIXED_NEWSTYLE | NO_ZEROES
    return s


def option(s, opt, data=b""):
    s.sendall(struct.pack(">QII", IHAVEOPT, opt, len(data)) + data)


def option_replies(s, opt):
    """Reads replies to `opt` until a non-INFO/META one; their types."""
    types = []
    while True:
        magic, o, rtype, length = struct.unpack(">QIII", recv_exact(s, 20))
        assert magic == REPLY_MAGIC and o == opt
        recv_exact(s, length)
        types.append(rtype)
        if rtype not in (2, 3, 4):  # SERVER, INFO, META_CONTEXT
            return types


def go(s, structured):
    if structured:
        option(s, 8)
        assert option_replies(s, 8) == [1]
    option(s, 7, struct.pack(">IH", 0, 0))
    option_replies(s, 7)


def request(s, cmd, offset, length, flags=0, handle=1, payload=b"",
            magic=REQUEST_MAGIC):
    s.sendall(struct.pack(">IHHQQI", magic, flags, cmd, handle, offset,
                          length) + payload)


def reply(s, read=0):
    """The error of a simple reply (whose `read` bytes of data, if it
    succeeded, are read too), or of the last structured chunk."""
    return reply_form(s, read)[1]


def reply_form(s, read=0):
    """("simple", error) or ("structured", the last chunk's error)."""
    magic = struct.unpack(">I", recv_exact(s, 4))[0]
    if magic == SIMPLE_REPLY:
        error, _ = struct.unpack(">IQ", recv_exact(s, 12))
        if error == 0:
            recv_exact(s, read)
        return "simple", error
    assert magic == STRUCTURED_REPLY, hex(magic)
    while True:
        flags, rtype, _, length = struct.unpack(">HHQI", recv_exact(s, 16))
        body = recv_exact(s, length)
        error = struct.unpack(">I", body[:4])[0] if rtype & 0x8000 else 0
        if flags & 1:
            return "structured", error
        magic = struct.unpack(">I", recv_exact(s, 4))[0]


def closed(s):
    """Whether the server closed the connection (a reset is a close with
    unread data left behind)."""
    try:
        return "closed" if s.recv(1) == b"" else "open"
    except ConnectionResetError:
        return "closed"
    except socket.timeout:
        return "open (timeout)"


def main():
    path = sys.argv[1]
    # Options: unknown, STARTTLS without TLS, STRUCTURED_REPLY with data,
    # INFO of an unknown export, GO with a truncated body, LIST, then a
    # meta context list before structured replies.
    s = connect(path)
    option(s, 99, b"x" * 100)
    print("unknown option:", option_replies(s, 99))
    option(s, 5)
    print("starttls:", option_replies(s, 5))
    option(s, 8, b"abc")
    print("structured reply with data:", option_replies(s, 8))
    option(s, 6, struct.pack(">I", 3) + b"abc" + struct.pack(">H", 0))
    print("info of unknown export:", option_replies(s, 6))
    option(s, 7, struct.pack(">I", 50) + b"ab")
    print("go with a short body:", option_replies(s, 7))
    option(s, 9, struct.pack(">II", 0, 0))
    print("list meta before structured:", option_replies(s, 9))
    option(s, 3)
    print("list:", option_replies(s, 3))
    option(s, 2)
    print("abort:", option_replies(s, 2), closed(s))
    s.close()

    # A bad option magic closes the connection.
    s = connect(path)
    s.sendall(struct.pack(">QII", 0x1234, 7, 0))
    print("bad option magic:", closed(s))
    s.close()

    # Requests, with simple and structured replies.
    for structured in (False, True):
        s = connect(path)
        go(s, structured)
        tag = "structured" if structured else "simple"
        request(s, 0, 0, 4096)
        print(tag, "read:", reply(s, 4096))
        request(s, 0, 1 << 40, 512)
        print(tag, "read past the end:", reply(s))
        request(s, 0, 0xFFFFFFFFFFFFFE00, 4096)
        print(tag, "read at offset 2^64 - 512:", reply(s))
        request(s, 0, 0, 32 * 1024 * 1024 + 1)
        print(tag, "read over 32 MiB:", reply(s))
        request(s, 99, 0, 512)
        print(tag, "unknown command:", reply(s))
        request(s, 0, 0, 512, flags=0x40)
        print(tag, "unknown flag:", reply(s, 512))
        request(s, 1, 0, 512, payload=b"\0" * 512)
        print(tag, "write to a read-only export:", reply(s))
        request(s, 6, 0, 512)
        print(tag, "write zeroes to a read-only export:", reply(s))
        request(s, 7, 0, 512)
        print(tag, "block status without a context:", reply(s))
        request(s, 3, 0, 0)
        # qemu 7.2 answers a command without data that succeeded with a
        # simple reply even when structured replies were negotiated
        print(tag, "flush:", *reply_form(s))
        request(s, 0, 0, 512, magic=0xDEADBEEF)
        print(tag, "bad request magic:", reply(s), closed(s))
        s.close()

    # A client that promises more than it sends, then leaves.
    s = connect(path)
    option(s, 99, b"")
    s.sendall(struct.pack(">QII", IHAVEOPT, 99, 0x7FFFFFFF) + b"y" * 1000)
    s.close()
    s = connect(path)
    go(s, True)
    request(s, 0, 0, 1 << 20)
    s.close()  # gone before its reply
    # Still serving.
    s = connect(path)
    go(s, True)
    request(s, 0, 0, 4096)
    print("next client read:", reply(s))
    request(s, 2, 0, 0)  # DISC
    print("after disc:", closed(s))
    s.close()


if __name__ == "__main__":
    main()
