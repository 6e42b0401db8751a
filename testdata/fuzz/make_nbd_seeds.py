#!/usr/bin/env python3
"""Writes the seeds of //nbd_server:server_fuzzer into testdata/fuzz/nbd/.

Run from the repository root: python3 testdata/fuzz/make_nbd_seeds.py.
Each seed is what server_fuzzer.cc takes: one settings byte (bit 0
read-only, 1 allocation-depth, 2 bitmap "b0", 3 detect-zeroes, 4
discard=unmap, 5 write-through, 6 TLS required (PSK)), then the bytes a client sends: its 4
handshake flags, options (doc/proto.md "Option haggling"), then requests
("Transmission").
The export is 1 MiB, named "".
"""
import os
import struct

IHAVEOPT = 0x49484156454F5054
REQUEST_MAGIC = 0x25609513
OUT = "testdata/fuzz/nbd"

(OPT_EXPORT_NAME, OPT_ABORT, OPT_LIST, OPT_STARTTLS, OPT_INFO, OPT_GO,
 OPT_STRUCTURED, OPT_LIST_META, OPT_SET_META) = 1, 2, 3, 5, 6, 7, 8, 9, 10
(READ, WRITE, DISC, FLUSH, TRIM, CACHE, WRITE_ZEROES,
 BLOCK_STATUS) = range(8)
FUA, NO_HOLE, DF, REQ_ONE, FAST_ZERO = 1, 2, 4, 8, 16


def opt(code, data=b""):
    return struct.pack(">QII", IHAVEOPT, code, len(data)) + data


def go(code=OPT_GO, infos=(1, 2, 3)):
    return opt(code, struct.pack(">IH", 0, len(infos)) +
               b"".join(struct.pack(">H", i) for i in infos))


def meta(code, queries):
    data = struct.pack(">I", 0) + struct.pack(">I", len(queries))
    for q in queries:
        data += struct.pack(">I", len(q)) + q
    return opt(code, data)


def req(cmd, offset=0, length=0, flags=0, handle=1, payload=b"",
        magic=REQUEST_MAGIC):
    return struct.pack(">IHHQQI", magic, flags, cmd, handle, offset,
                       length) + payload


HELLO = struct.pack(">I", 3)  # FIXED_NEWSTYLE | NO_ZEROES


def every_request():
    return b"".join([
        req(READ, 0, 4096, handle=1),
        req(READ, 512 << 10, 8192, handle=2),  # the zero half: a hole
        req(READ, 500 << 10, 64 << 10, DF, handle=3),
        req(WRITE, 4096, 4096, FUA, handle=4, payload=b"\xab" * 4096),
        req(WRITE, 8192, 512, handle=5, payload=bytes(512)),
        req(FLUSH, handle=6),
        req(TRIM, 0, 65536, handle=7),
        req(WRITE_ZEROES, 65536, 65536, NO_HOLE, handle=8),
        req(WRITE_ZEROES, 131072, 4096, FAST_ZERO, handle=9),
        req(CACHE, 0, 4096, handle=10),
        req(BLOCK_STATUS, 0, 1 << 20, handle=11),
        req(BLOCK_STATUS, 0, 1 << 20, REQ_ONE, handle=12),
        req(READ, (1 << 20) - 512, 512, handle=13),
        req(DISC),
    ])


seeds = {
    # Structured replies, base:allocation, GO, every command.
    "go_structured": b"\x00" + HELLO + opt(OPT_STRUCTURED) +
    meta(OPT_SET_META, [b"base:allocation"]) + go() + every_request(),
    # The same on a read-only export: writes refused.
    # Write-through: a flush after each write.
    "go_write_through": b"\x20" + HELLO + opt(OPT_STRUCTURED) + go() +
    every_request(),
    "go_read_only": b"\x01" + HELLO + opt(OPT_STRUCTURED) +
    meta(OPT_SET_META, [b"base:allocation"]) + go() + every_request(),
    # Every context: LIST with the wildcards, SET of all three, INFO, GO.
    "meta_contexts": b"\x06" + HELLO + opt(OPT_STRUCTURED) +
    meta(OPT_LIST_META, [b"base:", b"qemu:", b"qemu:dirty-bitmap:"]) +
    meta(OPT_LIST_META, []) +
    meta(OPT_SET_META, [b"base:allocation", b"qemu:allocation-depth",
                        b"qemu:dirty-bitmap:b0", b"qemu:nonesuch"]) +
    go(OPT_INFO) + go() + every_request(),
    # Old-style EXPORT_NAME, simple replies, detect-zeroes and unmap.
    "export_name_simple": b"\x18" + struct.pack(">I", 1) +
    opt(OPT_EXPORT_NAME) + every_request(),
    # LIST, unknown options, STARTTLS without TLS, ABORT.
    "options_then_abort": b"\x00" + HELLO + opt(OPT_LIST) +
    opt(0x1234, b"x" * 100) + opt(OPT_STARTTLS) + go(OPT_INFO, ()) +
    opt(OPT_ABORT),
    # Refused requests: past the end, over 32 MiB, unknown command and
    # flags, BLOCK_STATUS without a context, bad magic (closes).
    "hostile_requests": b"\x00" + HELLO + opt(OPT_STRUCTURED) + go() +
    req(READ, 1 << 20, 4096) + req(READ, 0, (32 << 20) + 1) +
    req(WRITE, (1 << 20) - 512, 1024, payload=b"\x11" * 1024) +
    req(42, 0, 512) + req(READ, 0, 512, flags=0x80) +
    req(BLOCK_STATUS, 0, 4096) + req(READ, 0, 512, magic=0x12345678),
    # A WRITE announcing 32 MiB whose payload stops short.
    "write_short_payload": b"\x00" + HELLO + go() +
    req(WRITE, 0, 32 << 20, payload=b"\x22" * 5000),
    # TLS required: options before STARTTLS (TLS_REQD), EXPORT_NAME
    # before TLS (closes).
    "tls_required_options": b"\x40" + HELLO + opt(OPT_LIST) +
    opt(OPT_STRUCTURED) + go() + meta(OPT_LIST_META, [b"base:"]) +
    opt(0x1234, b"x" * 10) + opt(OPT_ABORT),
    "tls_export_name": b"\x40" + HELLO + opt(OPT_INFO, b"ab") +
    opt(OPT_EXPORT_NAME),
    # STARTTLS with data (refused), and STARTTLS then garbage, then a TLS
    # record header with a truncated ClientHello.
    "tls_starttls_data": b"\x40" + HELLO + opt(OPT_STARTTLS, b"zz"),
    "tls_handshake_garbage": b"\x40" + HELLO + opt(OPT_STARTTLS) +
    b"\x00garbage" * 8,
    "tls_client_hello": b"\x40" + HELLO + opt(OPT_LIST) + opt(OPT_STARTTLS) +
    b"\x16\x03\x01\x00\x40\x01\x00\x00\x3c\x03\x03" + bytes(32) +
    b"\x00\x00\x04\x00\xa8\x00\xff\x01\x00",
    # A bad option magic right after the flags.
    "bad_option_magic": b"\x00" + HELLO + b"\x00" * 16,
}

os.makedirs(OUT, exist_ok=True)
for name, data in seeds.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
