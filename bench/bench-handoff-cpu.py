#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Daemon CPU per small handoff: two epdd in network namespaces (bench-handoff-netns.py's
pair), bench-handoff-latency running COUNT 64 KiB handoffs of one layer group alpha ->
bravo with one in flight (and 50 of warm-up); the user and system CPU each daemon and
the client spent meanwhile (/proc/PID/stat, the client's rusage), divided by the
handoffs, and as CPUs kept busy over the run. Needs root (ip netns).

    bench-handoff-cpu.py BUILD_ROOT [COUNT] [--perf] [--inflight N | --pipeline N] [--bus-commit]

--inflight N keeps N handoffs in flight (4 layer groups each, as the latency run's
throughput lines), where the machine's CPUs are the limit: N client threads. --pipeline
N keeps N in flight from one client thread on one connection and ring per side
(bench-handoff-latency --pipeline). --bus-commit (not with --pipeline): the decode
commits with Accept and CommitAndRelease on the bus instead of on its ring.

With --perf, `perf record -g` runs on both daemons meanwhile (perf-alpha.data and
perf-bravo.data in the current directory) for `perf report --no-children`."""

import importlib.util
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_netns", os.path.join(HERE, "bench-handoff-netns.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def cpu_seconds(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tck = os.sysconf("SC_CLK_TCK")
    return int(f[11]) / tck, int(f[12]) / tck  # utime, stime


def main():
    argv = sys.argv[1:]
    inflight, mode = 1, "--inflight"
    for opt in ("--inflight", "--pipeline"):
        if opt in argv:
            i = argv.index(opt)
            inflight, mode = int(argv[i + 1]), opt
            del argv[i:i + 2]
    args = [a for a in argv if not a.startswith("--")]
    if not args:
        print(__doc__)
        return 2
    build, count, perf = args[0], int(args[1]) if len(args) > 1 else 2000, "--perf" in sys.argv
    count = max(count // inflight, 1) * inflight
    groups = "1" if inflight == 1 else "4"
    if os.geteuid() != 0:
        print("SKIP: needs root (ip netns)")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        net = bench.Net(2)
        try:
            pair = bench.Pair(build, tmp, net, 1, 256, extra="[Arena:kv1]\nSize=64M\n")
            try:
                recorders = [subprocess.Popen(["perf", "record", "-F", "4999", "-g", "-o", f"perf-{n}.data", "-p",
                                               str(p.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                             for n, p in zip(("alpha", "bravo"), pair.procs)] if perf else []
                time.sleep(1 if perf else 0)
                warmup = 50 if inflight == 1 else inflight
                before = [cpu_seconds(p.pid) for p in pair.procs]
                ru0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
                r = subprocess.run([os.path.join(build, "bench", "bench-handoff-latency"), "--prefill",
                                    f"direct:{pair.sock(0)}", "--decode", f"direct:{pair.sock(1)}", "--dest", "bravo",
                                    "--count", str(count), "--warmup", str(warmup), "--groups", groups,
                                    mode, str(inflight)] + (["--bus-commit"] if "--bus-commit" in argv else []),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                wall = time.perf_counter() - t0
                ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
                after = [cpu_seconds(p.pid) for p in pair.procs]
                for p in recorders:
                    p.send_signal(2)
                    p.wait()
                if r.returncode != 0:
                    raise RuntimeError(r.stderr)
                res = bench.result(r.stdout)
                # The warm-up is per in-flight slot (bench-handoff-latency's --warmup): every
                # handoff made counts (before 2026-12-04 13:50 UTC this divided by count +
                # warmup, 1.6 x too few handoffs at 64 in flight).
                warmup_all = warmup * inflight if inflight > 1 else warmup
                n = count + warmup_all
                how = "Accept + CommitAndRelease on the bus" if "--bus-commit" in argv else "commit on the ring"
                if mode == "--pipeline":
                    how += ", pipelined from one thread"
                print(f"bench-handoff-cpu: {count} + {warmup_all} handoffs of 64 KiB, {groups} group(s), {inflight} in "
                      f"flight, alpha -> bravo, {how}; {res['per_s']:.0f} handoffs/s, all landed P50 "
                      f"{res['all_p50']:.1f} us; {os.cpu_count()} CPUs")
                client = (ru1.ru_utime - ru0.ru_utime, ru1.ru_stime - ru0.ru_stime)
                for name, u, s in [(nm, a[0] - b[0], a[1] - b[1])
                                   for nm, b, a in zip(("alpha (source)", "bravo (destination)"), before, after)] + \
                                  [("client", client[0], client[1])]:
                    print(f"  {name:20} user {u:.2f} s  sys {s:.2f} s  = {(u + s) / n * 1e6:.0f} us of CPU "
                          f"per handoff, {(u + s) / wall:.2f} CPUs busy")
            finally:
                pair.close()
        finally:
            net.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
