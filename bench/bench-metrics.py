#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""What a Prometheus scrape costs epdd, against the limit measured in the same run.

Two epdd (alpha and bravo, peers over 127.0.0.1, [Metrics] Listen= on each), a workload
that leaves handoff paths and their histograms behind (epd-demo, alpha -> bravo), and
WORKERS workers registered on alpha, each holding a sequence, so that every family has
samples. Then, over one keep-alive HTTP connection to alpha:

  limit:   GET /         the same libmicrohttpd server on the same loop, a fixed line:
                         the HTTP round trip and the loop's wakeup without rendering
  scrape:  GET /metrics  the whole exposition, rendered on the loop

and prints the round-trip time of each (median, P99), their ratio, the CPU time epdd
spent per request (its utime+stime from /proc, over all requests: the time the loop is
busy with one), its system calls per request (strace -c -f on epdd), and the size of
the exposition. Nothing is fsynced on a scrape (strace shows it).

usage: bench-metrics.py BUILD_DIR [--workers N] [--requests N] [--no-strace]
"""

import argparse
import http.client
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.parse

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--workers", type=int, default=60)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--no-strace", action="store_true")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    os.environ["BUILD_ROOT"] = build
    os.environ["SOURCE_ROOT"] = SOURCE
    sys.path.insert(0, os.path.join(SOURCE, "tests", "tools"))
    sys.path.insert(0, os.path.join(build, "python"))
    from epdtest import Pair, tool  # noqa: E402
    import epd  # noqa: E402
    from epd.sequence import Sequence  # noqa: E402

    pair = Pair("[Metrics]\nListen=127.0.0.1:0\n")
    clients, sequences = [], []
    try:
        url = pair.alpha.epdctl("status", json_out=True)["metrics"]
        p = subprocess.run([tool("epd-demo"), f"--address={pair.alpha.address}",
                            f"--decode-address={pair.bravo.address}", "--requests=20", "--images=4",
                            "--concurrency=2"], capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            sys.exit("epd-demo failed: " + p.stdout + p.stderr)
        kv = epd.KvLayout(layers=8, tokens_per_block=16, k_bytes_per_token=2048, v_bytes_per_token=2048)  # the demo's
        for i in range(args.workers):
            c = epd.Client(pair.alpha.address)
            c.register(("prefill", "decode", "encoder")[i % 3], f"model-{i % 4}", f"cuda:{i % 8}",
                       kv=kv if i % 3 != 2 else None)
            if i % 3 != 2:
                sequences.append(Sequence.create(c, "host0", 2))
            clients.append(c)

        host, port = urllib.parse.urlsplit(url).netloc.split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        pid = pair.alpha.proc.pid

        def get(path):
            conn.request("GET", path)
            r = conn.getresponse()
            body = r.read()
            assert r.status == 200, (path, r.status)
            return body

        def cpu_usec():
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) * 1e6 / os.sysconf("SC_CLK_TCK")

        def measure(path):
            for _ in range(50):  # warm up
                get(path)
            times = []
            c0 = cpu_usec()
            for _ in range(args.requests):
                t = time.perf_counter_ns()
                body = get(path)
                times.append((time.perf_counter_ns() - t) / 1000)
            cpu = (cpu_usec() - c0) / args.requests
            times.sort()
            return statistics.median(times), times[int(len(times) * 0.99) - 1], cpu, body

        def syscalls(path, n=200):
            if args.no_strace or not shutil.which("strace"):
                return None, None
            out = os.path.join(pair.dir, f"strace-{path.strip('/') or 'root'}.txt")
            st = subprocess.Popen(["strace", "-f", "-c", "-o", out, "-p", str(pid)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.5)  # attached
            t0 = time.monotonic()
            for _ in range(n):
                get(path)
            elapsed = time.monotonic() - t0
            st.send_signal(signal.SIGINT)
            st.wait(10)
            with open(out) as f:
                text = f.read()
            # "% time  seconds  usecs/call  calls  [errors]  syscall"
            calls = {}
            for m in re.finditer(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)$", text, re.M):
                calls[m.group(2)] = int(m.group(1))
            total = calls.pop("total", None)
            fsyncs = calls.get("fsync", 0) + calls.get("fdatasync", 0)
            top = ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1])[:6])
            return (total / n if total else None), fsyncs, top

        lim = measure("/")
        scr = measure("/metrics")
        text = scr[3].decode()
        families = len(re.findall(r"^# TYPE ", text, re.M))
        samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        sys_lim = syscalls("/")
        sys_scr = syscalls("/metrics")
        conn.close()

        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
        print(f"bench-metrics: {args.workers} workers, 1 peer, {args.requests} requests each way, "
              f"one keep-alive connection; load average {load}")
        print(f"exposition: {len(scr[3])} bytes, {families} families, {samples} samples")
        print(f"{'':34} {'median':>10} {'P99':>10} {'epdd CPU/req':>13}")
        print(f"{'limit: GET / (no rendering)':34} {lim[0]:>8.1f}us {lim[1]:>8.1f}us {lim[2]:>11.1f}us")
        print(f"{'scrape: GET /metrics':34} {scr[0]:>8.1f}us {scr[1]:>8.1f}us {scr[2]:>11.1f}us")
        print(f"ratio scrape/limit: median {scr[0] / lim[0]:.2f}, epdd CPU {scr[2] / max(lim[2], 0.01):.2f}; "
              f"rendering costs the loop about {scr[2] - lim[2]:.0f} us a scrape "
              f"({(scr[2] - lim[2]) / max(samples, 1) * 1000:.0f} ns a sample)")
        if sys_lim[0] is not None and sys_scr[0] is not None:
            print(f"syscalls per request (strace -c -f on epdd, 200 requests; the peer heartbeats' included): "
                  f"GET / {sys_lim[0]:.1f}, GET /metrics {sys_scr[0]:.1f}; fsyncs during the scrapes: {sys_scr[1]}")
            print(f"  GET /:        {sys_lim[2]}")
            print(f"  GET /metrics: {sys_scr[2]}")
    finally:
        for c in clients:
            c.close()
        pair.close()


if __name__ == "__main__":
    main()
