#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Soak: two epdd (alpha and bravo, peers over 127.0.0.1, each with its own socket, state
directory and WAL) under mixed load for a given time, sampled every few seconds; prints
the least-squares slope per hour of every sampled series at the end. Goal: flat.

    soak.py BUILD_DIR [--minutes M] [--interval S] [--csv FILE]

The load, in a loop until the time is up:
  - features and handoffs: epd-demo on alpha with its decode side on bravo (images
    encoded once and then hit in the feature cache, KV handed off alpha -> bravo);
  - workflows: a client registers, creates a sequence and a workflow, forks, advances,
    drops a branch and releases it, then disconnects; every other one is SIGKILLed in
    the middle instead (its workflow, sequences and worker must go with it);
  - clients dying: a client registers and holds sequences (two of them cloned, one
    granted) and is SIGKILLed.

Sampled per daemon: RSS and open fds (/proc), the size of wal.log (the file), and from
its /metrics: clients, workers, features, feature references, live and idle KV pages,
handoffs in flight, WAL appends. Not in CI (bounded, but it is a long run); see
bench/RESULTS.md for the recorded runs. Run it under `nice` on a shared machine.
"""

import argparse
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request

SOURCE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A workflow client: argv[1] = address, argv[2] = seconds to sleep before the end
# (the parent SIGKILLs it in that sleep when it means it to die).
WORKFLOW_CLIENT = r"""
import sys, time, epd, epd.workflow as ew
from epd.sequence import Sequence
addr, hold = sys.argv[1], float(sys.argv[2])
kv = epd.KvLayout(layers=8, tokens_per_block=16, k_bytes_per_token=2048, v_bytes_per_token=2048)
with epd.Client(addr) as c:
    c.register("decode", "soak-model", "cuda:0", kv=kv)
    seq = Sequence.create(c, "host0", 4)
    toks = list(range(64))
    wf = ew.Workflow.create(c, seq.path, toks)
    b, _ = wf.fork(0)
    wf.advance(b, toks + list(range(1000, 1040)))
    b2, _ = wf.fork(b)
    wf.advance(0, toks + [7] * 20)
    time.sleep(hold)
    wf.drop(b2)
    wf.release()
    seq.release()
print("ok")
"""

# A client that holds sequences and is SIGKILLed: argv[1] = address.
HOLDING_CLIENT = r"""
import sys, time, epd
from epd.sequence import Sequence
addr = sys.argv[1]
kv = epd.KvLayout(layers=8, tokens_per_block=16, k_bytes_per_token=2048, v_bytes_per_token=2048)
c = epd.Client(addr)
c.register("prefill", "soak-model", "cuda:1", kv=kv)
s = [Sequence.create(c, "host0", 3) for _ in range(3)]
s.append(s[0].clone())
s[1].append(2)
print("holding", flush=True)
time.sleep(60)
"""

METRICS = {
    "clients": r"^epd_clients (\S+)$",
    "workers": r"^epd_workers\{[^}]*\} (\S+)$",
    "features": r"^epd_features (\S+)$",
    "feature_refs": r"^epd_feature_references (\S+)$",
    "pages_live": r'^epd_arena_pages\{[^}]*state="live"[^}]*\} (\S+)$',
    "pages_idle": r'^epd_arena_pages\{[^}]*state="idle"[^}]*\} (\S+)$',
    "handoffs_in_flight": r"^epd_handoffs_in_flight (\S+)$",
    "wal_appends": r"^epd_wal_appends_total (\S+)$",
}


def scrape(url):
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for name, rx in METRICS.items():
        vals = [float(m.group(1)) for m in re.finditer(rx, text, re.M)]
        out[name] = sum(vals) if vals else float("nan")
    return out


def proc_sample(pid):
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
    return {"rss_kib": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def slope_per_hour(ts, ys):
    pts = [(t, y) for t, y in zip(ts, ys) if y == y]  # drop NaN
    n = len(pts)
    if n < 2:
        return float("nan")
    mt = sum(t for t, _ in pts) / n
    my = sum(y for _, y in pts) / n
    var = sum((t - mt) ** 2 for t, _ in pts)
    return sum((t - mt) * (y - my) for t, y in pts) / var * 3600 if var else float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build")
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--interval", type=float, default=5)
    ap.add_argument("--csv")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    os.environ["BUILD_ROOT"] = build
    os.environ["SOURCE_ROOT"] = SOURCE
    sys.path.insert(0, os.path.join(SOURCE, "tests", "tools"))
    from epdtest import Pair, tool  # noqa: E402
    pyenv = dict(os.environ, PYTHONPATH=os.path.join(build, "python"))
    rnd = random.Random(args.seed)

    pair = Pair("[Metrics]\nListen=127.0.0.1:0\n")
    daemons = {"alpha": pair.alpha, "bravo": pair.bravo}
    urls = {n: d.epdctl("status", json_out=True)["metrics"] for n, d in daemons.items()}
    samples = []  # (t, name, {series: value})
    counts = {"demo": 0, "demo_failed": 0, "workflow": 0, "workflow_killed": 0, "workflow_failed": 0,
              "holder_killed": 0}
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    next_sample = t0
    live = []  # (Popen, kill_at or None, kind)

    def sample():
        t = time.monotonic() - t0
        for n, d in daemons.items():
            v = proc_sample(d.proc.pid)
            v.update(scrape(urls[n]))
            wal = os.path.join(d.state, "wal", "wal.log")
            v["wal_file_bytes"] = os.path.getsize(wal) if os.path.exists(wal) else float("nan")
            samples.append((t, n, v))

    try:
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_sample:
                sample()
                next_sample += args.interval
            # reap / kill
            for p, kill_at, kind in list(live):
                if kill_at is not None and now >= kill_at and p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    counts[kind + "_killed"] = counts.get(kind + "_killed", 0) + 1
                if p.poll() is not None:
                    out, _ = p.communicate()
                    if p.returncode not in (0, -signal.SIGKILL):
                        counts[kind + "_failed"] = counts.get(kind + "_failed", 0) + 1
                        print(f"{kind} exited {p.returncode}: {out[-500:]}", file=sys.stderr)
                    live.remove((p, kill_at, kind))
            if len(live) < 4:
                r = rnd.random()
                if r < 0.35:
                    p = subprocess.Popen([tool("epd-demo"), f"--address={pair.alpha.address}",
                                          f"--decode-address={pair.bravo.address}", "--requests=8",
                                          "--images=3", "--concurrency=2"],
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    live.append((p, None, "demo"))
                    counts["demo"] += 1
                elif r < 0.75:
                    die = rnd.random() < 0.5
                    p = subprocess.Popen([sys.executable, "-c", WORKFLOW_CLIENT,
                                          rnd.choice([pair.alpha.address, pair.bravo.address]), "1.0"],
                                         env=pyenv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    live.append((p, now + rnd.uniform(0.2, 1.5) if die else None, "workflow"))
                    counts["workflow"] += 1
                else:
                    p = subprocess.Popen([sys.executable, "-c", HOLDING_CLIENT,
                                          rnd.choice([pair.alpha.address, pair.bravo.address])],
                                         env=pyenv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                    live.append((p, now + rnd.uniform(0.5, 2.5), "holder"))
            time.sleep(0.05)
        for p, _, _ in live:
            p.wait(130)
        time.sleep(args.interval)
        sample()  # the last one, after every client has gone
    finally:
        for p, _, _ in live:
            if p.poll() is None:
                p.kill()
                p.wait()
        alive = {n: d.proc is not None and d.proc.poll() is None for n, d in daemons.items()}
        pair.close()

    series = list(samples[0][2].keys()) if samples else []
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("t,daemon," + ",".join(series) + "\n")
            for t, n, v in samples:
                f.write(f"{t:.1f},{n}," + ",".join(str(v[s]) for s in series) + "\n")
    print(f"soak: {args.minutes:g} min, {len(samples) // 2} samples per daemon every {args.interval:g} s; "
          f"load: {counts}; daemons alive to the end: {alive}")
    print(f"{'series':20} {'daemon':6} {'first':>12} {'last':>12} {'min':>12} {'max':>12} {'slope/h':>12}")
    for n in daemons:
        rows = [(t, v) for t, dn, v in samples if dn == n]
        ts = [t for t, _ in rows]
        for s in series:
            ys = [v[s] for _, v in rows]
            ok = [y for y in ys if y == y] or [float("nan")]
            # The first 10% is warm-up (arenas touched, caches filling): left out of the slope.
            k = len(ts) // 10
            print(f"{s:20} {n:6} {ys[0]:12.0f} {ys[-1]:12.0f} {min(ok):12.0f} {max(ok):12.0f} "
                  f"{slope_per_hour(ts[k:], ys[k:]):12.1f}")
    failed = counts.get("demo_failed", 0) + counts.get("workflow_failed", 0) + counts.get("holder_failed", 0)
    return 1 if failed or not all(alive.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
