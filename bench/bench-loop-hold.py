#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""How long a daemon busy with many small writes to another host keeps a bus call waiting.

Runs the integration test that moves 113552 page writes from alpha to charlie
(test-handoff-peers, tcase many-writes) in BUILD and, while it runs, calls
`epdctl handoffs` on alpha every 5 ms, timing each call (a process start included:
the median is that cost, the maximum is the longest the loop kept the call waiting).
Prints calls, median, p99 and max per run; the limit beside it is the median itself
(an epdctl call to an idle daemon).

    python3 bench/bench-loop-hold.py BUILD [RUNS]
"""
import glob
import os
import subprocess
import sys
import time


def alpha_socket(deadline):
    while time.time() < deadline:
        for conf in glob.glob('/tmp/epd-test-run-*/epd-test-*/epd.conf') + glob.glob('/tmp/epd-test-*/epd.conf'):
            try:
                if 'HostId=alpha' in open(conf).read():
                    sock = os.path.join(os.path.dirname(conf), 'bus')
                    if os.path.exists(sock):
                        return sock
            except OSError:
                pass
        time.sleep(0.02)
    return None


def one_run(build):
    env = dict(os.environ, CK_RUN_CASE='many-writes')
    env.pop('CK_RUN_SUITE', None)
    test = subprocess.Popen(['meson', 'test', '-C', build, '--no-rebuild', 'test-handoff-peers'],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sock = alpha_socket(time.time() + 20)
    lat = []
    while sock and test.poll() is None:
        t0 = time.monotonic()
        r = subprocess.run([os.path.join(build, 'tools', 'epdctl'), '-A', 'direct:' + sock, 'handoffs'],
                           capture_output=True)
        if r.returncode == 0:
            lat.append((time.monotonic() - t0) * 1000)
        time.sleep(0.005)
    out = test.communicate()[0]
    ok = test.returncode == 0
    if not lat:
        return ok, None
    lat.sort()
    return ok, (len(lat), lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))], lat[-1])


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    build, runs = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    for i in range(runs):
        ok, st = one_run(build)
        if st is None:
            print('run %d: no call answered (test %s)' % (i + 1, 'passed' if ok else 'FAILED'))
            continue
        print('run %d: calls %d  median %.1f ms (the limit: an epdctl call)  p99 %.1f ms  max %.1f ms  '
              'max/median %.1f  test %s' % (i + 1, st[0], st[1], st[2], st[3], st[3] / st[1],
                                            'passed' if ok else 'FAILED'))


if __name__ == '__main__':
    main()
