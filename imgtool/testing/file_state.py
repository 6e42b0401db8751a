#!/usr/bin/env python3
"""Prints what the oracle tests compare of every file in a directory.

Usage: file_state.py [--recursive] DIR

For each regular file of DIR (its own files, sorted as `ls -A | sort` does;
with --recursive every file below it, named ./PATH as `find . -type f`
prints them): a line "== NAME SIZE DIGEST" (BLAKE2b of the data runs and
their offsets), then the file's allocation as
SEEK_DATA/SEEK_HOLE report it ("data START LENGTH" / "hole START LENGTH",
bytes), which is what `qemu-img map -f raw` reads from a raw file
(block/file-posix.c find_allocation) without its 512-byte rounding.

One process per directory instead of five per file (stat, md5sum, qemu-img
info, dd, qemu-img map): the oracle tests call this twice per check, on
directories of 30-odd files, and the process starts were most of their time.

Each file is fsync()ed first (ext4 allocates delayed blocks only at
writeback: the map would show when writeback happened to run), then its
cached pages are dropped (POSIX_FADV_DONTNEED): on ext4, SEEK_DATA reports
an unwritten (fallocated) extent as data where its pages are cached, so
without the drop the map showed what the page cache held, not the file.
"""

import hashlib
import os
import sys


def allocation(fd, size):
    """Yields (kind, start, length) runs covering [0, size)."""
    pos = 0
    while pos < size:
        try:
            data = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data at or after pos
            data = size
        if data > pos:
            yield "hole", pos, data - pos
            pos = data
            continue
        hole = min(os.lseek(fd, pos, os.SEEK_HOLE), size)
        yield "data", pos, hole - pos
        pos = hole


def describe(path, name):
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        try:
            os.fsync(fd)
        except OSError:
            pass  # a read-only file system holds no delayed blocks
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        runs = list(allocation(fd, size))
        # The contents: a digest of the data runs only (holes read as
        # zeroes, and where they are is in the map below), so sparse
        # images of gigabytes cost what their data costs.
        digest = hashlib.blake2b(digest_size=16)
        for kind, start, length in runs:
            if kind != "data":
                continue
            digest.update(b"%d:" % start)
            end = start + length
            while start < end:
                chunk = os.pread(fd, min(1 << 20, end - start), start)
                if not chunk:
                    break  # the file shrank under us: the map says so
                digest.update(chunk)
                start += len(chunk)
        print(f"== {name} {size} {digest.hexdigest()}")
        for kind, start, length in runs:
            print(f"{kind} {start} {length}")
    finally:
        os.close(fd)


def main(argv):
    recursive = len(argv) > 1 and argv[1] == "--recursive"
    args = argv[2:] if recursive else argv[1:]
    if len(args) != 1:
        sys.exit("usage: file_state.py [--recursive] DIR")
    top = args[0]
    if recursive:
        names = []
        for root, _, files in os.walk(top):
            rel = os.path.relpath(root, top)
            prefix = "." if rel == "." else "./" + rel
            names += [prefix + "/" + f for f in files
                      if os.path.isfile(os.path.join(root, f))
                      and not os.path.islink(os.path.join(root, f))]
        names.sort()
    else:
        names = sorted(f for f in os.listdir(top)
                       if os.path.isfile(os.path.join(top, f)))
    for name in names:
        try:
            describe(os.path.join(top, name), name)
        except OSError as e:
            print(f"== {name} unreadable: {e.strerror}")


if __name__ == "__main__":
    main(sys.argv)
