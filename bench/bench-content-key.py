#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.feature.content_key against its limit, one sha256 over the same bytes, in the same
run (median of 50 after a warm-up each):

    bench-content-key.py [MIB]      (default 2.4: the pixels of a 448 px Qwen3-VL image)

Prints both times and content_key's share of the single sha256 (below 1: faster)."""

import hashlib
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import epd.feature as ef  # noqa: E402


def median_ms(fn, n=50):
    fn()
    v = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        v.append((time.perf_counter() - t) * 1e3)
    return statistics.median(v)


def main():
    mib = float(sys.argv[1]) if len(sys.argv) > 1 else 784 * 1536 * 2 / (1 << 20)
    data = os.urandom(int(mib * (1 << 20)))
    key = median_ms(lambda: ef.content_key(data, b"448"))
    one = median_ms(lambda: hashlib.sha256(data).hexdigest())
    print(f"bench-content-key: {len(data) / 1e6:.2f} MB, {os.cpu_count()} CPUs: content_key {key:.3f} ms, "
          f"one sha256 (the limit) {one:.3f} ms, ratio {key / one:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
