#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""What one durable WAL record costs on a directory's file system, three ways, 1000 times
each (docs/wal.md, "Writing ahead"):

    bench-wal-sync.py [DIRECTORY]     (default: /var/tmp; a temporary directory in it)

  append      write 80 bytes with O_APPEND, then fdatasync (the file grows: its size is
              journaled with every sync: the log before records were written ahead)
  over zeros  pwrite 80 bytes over zeros written (and synced) ahead, then fdatasync (what
              epdd's WAL does now)
  fallocated  the same over fallocate()d space instead of written zeros (for reference)

Prints the mean microseconds of each and the ratio of the second to the first. Removes
its files."""

import os
import sys
import tempfile
import time

N, REC = 1000, b"x" * 80


def timed(fd, write):
    t = time.perf_counter()
    for i in range(N):
        write(fd, i)
        os.fdatasync(fd)
    return (time.perf_counter() - t) / N * 1e6


def main():
    base = sys.argv[1] if len(sys.argv) > 1 else "/var/tmp"
    with tempfile.TemporaryDirectory(prefix="epd-wal-sync-", dir=base) as d:
        fd = os.open(os.path.join(d, "append"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        append = timed(fd, lambda fd, i: os.write(fd, REC))
        os.close(fd)
        fd = os.open(os.path.join(d, "zeros"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"\0" * (1 << 20))
        os.fsync(fd)
        zeros = timed(fd, lambda fd, i: os.pwrite(fd, REC, i * len(REC)))
        os.close(fd)
        fd = os.open(os.path.join(d, "fallocated"), os.O_WRONLY | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, 1 << 20)
        os.fsync(fd)
        falloc = timed(fd, lambda fd, i: os.pwrite(fd, REC, i * len(REC)))
        os.close(fd)
    print(f"wal sync in {base}, {N} records of {len(REC)} bytes: append+fdatasync {append:.0f} us; "
          f"over zeros {zeros:.0f} us ({zeros / append:.2f} of append); over fallocated space {falloc:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
