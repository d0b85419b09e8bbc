#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Cluster benchmarks: 8 epdd in network namespaces and one etcd (the setup of
tests/integration/test-cluster-etcd.py), each figure beside a limit measured in the
same run:

  1. convergence after start: every member sees every other (etcd and an authenticated
     session), after the last start and after the first; limits: one etcd round trip
     through its JSON gateway, and the resolution of the polling (one epdctl call);
  2. convergence after a host loss (kill -9): every other member has its session down,
     and has it leave the membership; limit: the lease TTL (the bound by design);
  3. locating a 64-block prefix: Placement.LocatePrefix through the owners (cache off,
     and cached), against Pages.MatchPrefix on the host that holds it (a local lookup),
     a bare sd-bus round trip, and a TCP ping-pong between the same namespaces; with
     syscalls of epdd and LOOKUP round trips per locate;
  4. membership churn: one host joins and leaves every second while handoffs run
     between the others: the failed handoffs between live hosts (must be 0).

    bench-cluster.py BUILD_ROOT [--quick]

Needs root and etcd (exits 77 without them)."""

import importlib.util
import json
import os
import random
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location("cluster_etcd",
                                              os.path.join(HERE, "..", "tests", "integration", "test-cluster-etcd.py"))
ce = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ce)
MiB = 1 << 20


def ms(x):
    return f"{x * 1000:8.1f} ms"


def etcd_rtt(cl, n=20):
    """Median seconds of a range through etcd's JSON gateway, from the bridge namespace."""
    code = ("import time,urllib.request,sys\n"
            "u=sys.argv[1]+'/v3/kv/range'\n"
            "t=[]\n"
            "for i in range(%d):\n"
            "  t0=time.monotonic();urllib.request.urlopen(u,data=b'{\"key\":\"L2VwZC8=\"}').read();"
            "t.append(time.monotonic()-t0)\n"
            "t.sort();print(t[len(t)//2])\n" % n)
    r = subprocess.run(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c", code, cl.etcd.url],
                       stdout=subprocess.PIPE, text=True, check=True)
    return float(r.stdout)


def tcp_pingpong(cl, a, b, n=2000):
    """Median seconds of a 64-byte TCP round trip from host a to host b."""
    port = 7600
    server = ("import socket\n"
              "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
              "s.bind(('%s',%d));s.listen(1);print('ready',flush=True)\n"
              "c,_=s.accept();c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
              "while True:\n"
              "  d=c.recv(64)\n"
              "  if not d: break\n"
              "  c.sendall(d)\n" % (cl.net.ip(b), port))
    client = ("import socket,time\n"
              "c=socket.create_connection(('%s',%d));c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
              "t=[]\n"
              "for i in range(%d):\n"
              "  t0=time.monotonic();c.sendall(b'x'*64);n=0\n"
              "  while n<64: n+=len(c.recv(64-n))\n"
              "  t.append(time.monotonic()-t0)\n"
              "t.sort();print(t[len(t)//2])\n" % (cl.net.ip(b), port, n))
    srv = subprocess.Popen(["ip", "netns", "exec", cl.net.hosts[b], sys.executable, "-c", server],
                           stdout=subprocess.PIPE, text=True)
    srv.stdout.readline()
    r = subprocess.run(["ip", "netns", "exec", cl.net.hosts[a], sys.executable, "-c", client],
                       stdout=subprocess.PIPE, text=True, check=True)
    srv.wait(timeout=5)
    return float(r.stdout)


def poll_cost(cl, i, n=10):
    t0 = time.monotonic()
    for _ in range(n):
        cl.cluster(i)
    return (time.monotonic() - t0) / n


def converge_start(cl):
    t_first = time.monotonic()
    for i in range(cl.n):
        cl.start(i)
    t_last = time.monotonic()
    pending = set(range(cl.n))
    done = {}
    while pending:
        for i in list(pending):
            if cl.sees(i, [j for j in range(cl.n) if j != i]):
                done[i] = time.monotonic()
                pending.discard(i)
        if time.monotonic() - t_last > 30:
            raise AssertionError("no convergence in 30 s")
    t = max(done.values())
    return t - t_last, t - t_first


def converge_loss(cl, victim):
    others = [i for i in range(cl.n) if i != victim]
    name = cl.names[victim]
    t0 = time.monotonic()
    cl.kill(victim)
    down, left = {}, {}
    while len(left) < len(others):
        for i in others:
            if i in left:
                continue
            c = cl.cluster(i)
            m = {x["host_id"]: x for x in c["members"]} if c else {}
            if name in m and m[name]["session"] != "up" and i not in down:
                down[i] = time.monotonic()
            if name in m and m[name]["lease"] == "left":
                left[i] = time.monotonic()
        if time.monotonic() - t0 > 30:
            raise AssertionError("the lost host did not leave in 30 s")
    return max(down.values()) - t0, max(left.values()) - t0


def strace_syscalls(pid, fn):
    """Runs fn() while strace counts the syscalls of pid (all threads); returns the total."""
    out = tempfile.NamedTemporaryFile(delete=False)
    out.close()
    st = subprocess.Popen(["strace", "-c", "-f", "-q", "-o", out.name, "-p", str(pid)], stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    fn()
    st.send_signal(signal.SIGINT)
    st.wait(timeout=10)
    total = 0
    for line in open(out.name):
        parts = line.split()
        if parts and parts[-1] == "total":
            total = int(parts[3]) if len(parts) >= 5 else int(parts[2])
    os.unlink(out.name)
    return total


def locate_bench(cl, iters):
    base, blocks = 0x10c8_0000, 64
    pre = ce.publish_prefix(cl, 1, base, blocks, "prefill-h1", "h0")
    pre.kill()  # the blocks stay cached in h1's directory
    hashes = [base + b for b in range(blocks)]
    ce.wait_until(lambda: (cl.locate(5, hashes) or {}).get("n_blocks") == blocks, 5, "prefix located")
    loc_bin = os.path.join(cl.build, "bench", "bench-locate")

    def run(i, n):
        r = subprocess.run([loc_bin, cl.addr(i), "kv0", str(base), str(blocks), str(n)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        if r.returncode != 0:
            raise AssertionError(f"bench-locate on {cl.names[i]}: {r.stderr}")
        return r.stdout

    rtt = tcp_pingpong(cl, 5, 1)
    print(f"limit  TCP ping-pong h5 -> h1 (64 B, median)      {rtt * 1e6:8.1f} us")
    print("\n-- h1 (holds the prefix): local lookup, and LocatePrefix through the owners")
    print(run(1, iters), end="")
    print("-- h5 (DirectoryCacheTime=0: every LocatePrefix asks the owners)")
    print(run(5, iters), end="")
    # Counted in a run of its own: strace slows every syscall down.
    before = cl.counters(5)
    holder = {}
    pid5 = cl.procs[5].pid  # ip netns exec execs epdd: the same pid
    sysc = strace_syscalls(pid5, lambda: holder.setdefault("out", run(5, 200)))
    after = cl.counters(5)
    lookups = after["lookups"] - before["lookups"]
    queries = after["remote-queries"] - before["remote-queries"]
    print(f"   per iteration on h5 (Ping + MatchPrefix + LocatePrefix): {queries / max(lookups, 1):.2f} LOOKUP round "
          f"trips to the owners (sent at once), {sysc / max(lookups, 1):.1f} epdd syscalls "
          f"(strace -c -f, all threads: {sysc} for {lookups} iterations)")
    print("-- h6 (DirectoryCacheTime=1s: answers cached)")
    print(run(6, iters), end="")


def churn(cl, seconds):
    """h7 joins and leaves every second; handoffs run between h0..h6 meanwhile."""
    stop = threading.Event()
    results = {"committed": 0, "failed": [], "refused": 0}
    lock = threading.Lock()

    def handoffs(worker):
        k = 0
        rnd = random.Random(worker)
        while not stop.is_set():
            a, b = rnd.sample(range(7), 2)
            r = ce.rid(0xc0000000 + worker * 100000 + k)
            k += 1
            dec = cl.decode(b, r)
            pre = cl.prefill(a, cl.names[b], r, 8)
            rp, rd = pre.finish(), dec.finish()
            ok = (rp == 0 and rd == 0 and pre.final() and pre.final()[1] == "committed" and dec.final()
                  and dec.final()[1] == "committed")
            with lock:
                if ok:
                    results["committed"] += 1
                else:
                    results["failed"].append((cl.names[a], cl.names[b], pre.lines[-3:], dec.lines[-3:]))
            cl.clients.remove(dec)
            cl.clients.remove(pre)

    threads = [threading.Thread(target=handoffs, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    t0 = time.monotonic()
    cycles = 0
    while time.monotonic() - t0 < seconds:
        c0 = time.monotonic()
        cl.start(7)
        time.sleep(0.5)
        cl.kill(7, signal.SIGTERM)
        cycles += 1
        time.sleep(max(0.0, 1.0 - (time.monotonic() - c0)))
    stop.set()
    for t in threads:
        t.join()
    return cycles, results


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    build = sys.argv[1]
    quick = "--quick" in sys.argv
    if os.geteuid() != 0:
        ce.skip("needs root for network namespaces")
    for tool in ("ip", "etcd", "etcdctl", "strace"):
        if not shutil.which(tool):
            ce.skip(f"{tool} not installed")
    ce.SRC = os.path.dirname(HERE)
    with tempfile.TemporaryDirectory() as tmp:
        cl = ce.EtcdCluster(build, tmp, 8)
        cl.extra = {5: "DirectoryCacheTime=0\n"}
        try:
            cl.etcd.start()
            print(f"8 epdd, etcd {cl.etcd.url}, lease TTL {ce.LEASE_TTL_S}s, heartbeat {ce.HEARTBEAT_S}s"
                  f"{', quick' if quick else ''}")
            last, first = converge_start(cl)
            rt, pc = etcd_rtt(cl), poll_cost(cl, 0)
            print("\n1. convergence after start (every member sees every other: etcd and session up)")
            print(f"   epd    after the last host started   {ms(last)}   after the first {ms(first)}")
            print(f"   limit  etcd gateway round trip       {ms(rt)}   polling resolution (one epdctl) {ms(pc)}")
            print(f"   ratio  convergence / etcd round trip {last / rt:8.1f}x")
            down, left = converge_loss(cl, 7)
            print("\n2. convergence after a host loss (kill -9 h7)")
            print(f"   epd    sessions down everywhere      {ms(down)}   left the membership everywhere {ms(left)}")
            print(f"   limit  lease TTL                     {ms(ce.LEASE_TTL_S)}")
            print(f"   ratio  leave / TTL                   {left / ce.LEASE_TTL_S:8.2f}")
            print("\n3. locating a 64-block prefix (published on h1)")
            locate_bench(cl, 500 if quick else 3000)
            seconds = 10 if quick else 60
            cycles, res = churn(cl, seconds)
            print(f"\n4. churn: h7 joined and left {cycles} times in {seconds}s while handoffs ran between h0..h6")
            print(f"   handoffs committed {res['committed']}, failed {len(res['failed'])}")
            for f in res["failed"][:5]:
                print("   failed:", f)
            assert not res["failed"], "handoffs between live hosts failed during churn"
        finally:
            cl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
