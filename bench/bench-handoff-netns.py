#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Inter-host HANDOFF throughput between two epdd in network namespaces (a veth pair
through a bridge), against iperf3 between the same namespaces in the same run.

    bench-handoff-netns.py BUILD_ROOT [--quick] [--max-size SIZE_MIB] [--prefault]

For DataStreams=1 (vs iperf3 -P 1) and DataStreams=4 (vs iperf3 -P 4): a prefill
client (libepd, tests/integration/handoff-client in bench mode: no pattern fill or
check) on "alpha" hands a sequence of SIZE bytes (4 layer groups, reported ready at
once; BENCH_GROUPS=n for another count) off to a decode
client on "bravo"; the time is from LayerGroupReady to the source's handoff reaching
"transferred" (every byte acknowledged by the destination daemon), waited for on the
prefill client's ring (its eventfd), not polled. Sizes 64 KiB to 1 GiB; the small ones repeat and take the median, the large
ones run twice (cold arenas, then warm; the warm one is the figure; --prefault
configures both daemons' arena Prefault=yes, so that "cold" pages are allocated at start). Prints
handoff MiB/s, iperf3 MiB/s and the ratio. Needs root (ip netns) and iperf3; exits 77
(skip) otherwise. Keep it short: this is a small shared machine.

    bench-handoff-netns.py BUILD_ROOT --latency [--count N] [--quick]

Small handoffs end to end (bench-handoff-latency: a prefill and a decode client in one
process, the decode worker waiting on its ring, groups ready with Prepare): 64 KiB in 4
groups, in 1 group and 63 KiB in 36 groups, alpha -> bravo and local on alpha (kv0 ->
kv1: a copy); latency from Prepare to the first group and to every group landed at the
decode worker (mean, P50, P99), beside the limit measured in the same run: a bare TCP
ping-pong (bench-tcp-pingpong: 64 KiB one way, 8 bytes back, between the same
namespaces) and iperf3 -P 1. Then handoffs/s with 1, 8 and 64 in flight (64 KiB, 4
groups; K client threads, and K pipelined from one thread on one connection and ring
per side, as a worker that pipelines its requests) against iperf3's throughput
(measured again right before them: a shared VM's speed drifts within a run), with
how many of those handoffs waited for the record that freed their pages (`journal
waits`, source / destination: the journal-waits counter). A Prepare refused with
Error.Backpressure is retried after its retry-after, as workers do.

    bench-handoff-netns.py BUILD_ROOT --local-groups R [--count N]

The local handoff (alpha, kv36 -> kv36b and kv0 -> kv1) of 64 KiB in one layer group and
of 63 KiB in 36 groups, alternating R times (N each, default 1000), beside the same
run's TCP ping-pong: the per-group cost of a local copy, which a single --latency run
cannot separate from the VM's drift.

    bench-handoff-netns.py BUILD_ROOT --syscalls [--count N] [--groups 36]

The system calls per 64 KiB 4-group inter-host handoff with one in flight (the
--latency run's strace line alone: strace -c -f of both daemons and the client over N
handoffs, default 300), then that handoff's latency over 1000 more without strace,
beside the same run's TCP ping-pong: what a change to the hot path is measured with.
With --groups 36 the same for the 63 KiB handoff in 36 layer groups (the latency run's
third case) instead of 64 KiB in 4.
    bench-handoff-netns.py BUILD_ROOT --cpu [--count N]

What bounds many small handoffs in flight: 64 KiB 4-group handoffs pipelined from one
thread with 16, 64 and 256 in flight (N each, default 20000; the per-peer window off,
`[Backpressure] Enabled=no WindowHandoffs=0`, so that no Prepare is deferred), each
with its handoffs/s against iperf3 -P 1, the CPU time per handoff of the source, the
destination and the client, and the machine's CPUs over the run (/proc/stat: user,
system with softirq, idle with iowait); then iperf3 -P 1 for 3 s with the CPU it keeps
busy, as microseconds of CPU per 64 KiB moved. Throughput that stops growing with
more in flight while the CPUs are busy is bound by CPU: the ceiling is then iperf3's
CPU per 64 KiB over epd's (the ratio printed last), whatever the number in flight."""

import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "peer_netns", os.path.join(HERE, "..", "tests", "integration", "test-peer-netns.py"))
peer_netns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_netns)
Net, sh, key_file, wait_until = peer_netns.Net, peer_netns.sh, peer_netns.key_file, peer_netns.wait_until

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB
GROUPS = os.environ.get("BENCH_GROUPS", "4")


def iperf3(net, streams, seconds):
    srv = subprocess.Popen(["ip", "netns", "exec", net.hosts[1], "iperf3", "-s", "-1", "-B", net.ip(1)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            r = subprocess.run(["ip", "netns", "exec", net.hosts[0], "iperf3", "-c", net.ip(1), "-P", str(streams),
                                "-t", str(seconds), "-J"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            if r.returncode == 0:
                j = json.loads(r.stdout)
                if "sum_received" in j.get("end", {}):
                    return j["end"]["sum_received"]["bits_per_second"] / 8 / MiB
                if "error" in j and "connect" not in j["error"]:
                    raise RuntimeError("iperf3: " + j["error"])
            time.sleep(0.05)  # the server is not listening yet
        raise RuntimeError("iperf3 failed: " + r.stderr)
    finally:
        srv.kill()
        srv.wait()


class Pair:
    def __init__(self, build, tmp, net, streams, arena_mb, extra="", prefault=False):
        self.build, self.tmp, self.net = build, tmp, net
        self.client = os.path.join(build, "tests", "integration", "handoff-client")
        key = key_file(tmp, "key", "b" * 64)
        names = ["alpha", "bravo"]
        self.procs = []
        for i in (0, 1):
            conf = os.path.join(tmp, f"{names[i]}-{streams}.conf")
            with open(conf, "w") as f:
                f.write(f"[Daemon]\nHostId={names[i]}\nSystemBus=no\nLogLevel=warning\n"
                        f"StateDirectory={tmp}/{names[i]}-{streams}.state\n"
                        f"[Arena:kv0]\nSize={arena_mb}M\nHugePages=try\n" +
                        ("Prefault=yes\n" if prefault else "") + extra +
                        f"[Cluster]\nListen={net.ip(i)}:7500\nClusterKeyFile={key}\nDataStreams={streams}\n"
                        f"HandoffTimeout=300s\n"
                        f"[Peer:{names[1 - i]}]\nAddress={net.ip(1 - i)}:7500\nHostId={names[1 - i]}\n")
            sock = self.sock(i)
            if os.path.exists(sock):
                os.unlink(sock)
            self.procs.append(subprocess.Popen(["ip", "netns", "exec", net.hosts[i],
                                                os.path.join(build, "daemon", "epdd"), "-c", conf, "-s", sock,
                                                "--no-system-bus"],
                                               stdout=subprocess.DEVNULL,
                                               stderr=open(os.path.join(tmp, f"{names[i]}.log"), "a")))
            wait_until(lambda: os.path.exists(sock), 10, f"{names[i]} socket")
        epdctl = os.path.join(build, "tools", "epdctl")

        def up():
            r = subprocess.run([epdctl, "-A", f"direct:{self.sock(0)}", "--json", "peers"], stdout=subprocess.PIPE,
                               text=True)
            return r.returncode == 0 and all(p["state"] == "up" and p["streams"] == streams
                                             for p in json.loads(r.stdout)) and r.stdout.strip() != "[]"
        wait_until(up, 15, "peers up")
        self.n = 0

    def sock(self, i):
        return os.path.join(self.tmp, f"h{i}.sock")

    def counter(self, i, name):
        """A handoff counter of daemon i (org.epd1.Handoffs.Counters, epdctl handoffs)."""
        r = subprocess.run([os.path.join(self.build, "tools", "epdctl"), "-A", f"direct:{self.sock(i)}", "--json",
                            "handoffs"], stdout=subprocess.PIPE, text=True)
        return json.loads(r.stdout)["counters"][name] if r.returncode == 0 else -1

    def handoff(self, size):
        self.n += 1
        rid = f"{os.getpid():016x}{self.n:016x}"
        # A Prepare refused with Error.Backpressure is retried after its retry-after, as the
        # tests and workers do.
        env = dict(os.environ, HANDOFF_CLIENT_BENCH="1", HANDOFF_CLIENT_RETRY_BACKPRESSURE="1")
        dec = subprocess.Popen([self.client, "decode", f"direct:{self.sock(1)}", rid, "60000"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        pre = subprocess.run([self.client, "prefill", f"direct:{self.sock(0)}", "kv0", "bravo", rid,
                              str(max(size // PAGE, 1)), GROUPS, "0", "60000"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        out, err = dec.communicate(timeout=90)
        shipped = [l.split() for l in pre.stdout.splitlines() if l.startswith("shipped ")]
        if pre.returncode != 0 or dec.returncode != 0 or not shipped:
            logs = "".join(open(os.path.join(self.tmp, f"{n}.log")).read() for n in ("alpha", "bravo"))
            raise RuntimeError(f"handoff of {size} failed: {pre.stdout} {pre.stderr} / {out} {err}\n{logs}")
        us, nbytes = int(shipped[0][1]), int(shipped[0][2])
        return nbytes / MiB / (us / 1e6)

    def close(self):
        for p in self.procs:
            p.terminate()
            p.wait()


def run_ns(net, i, argv, **kw):
    return subprocess.Popen(["ip", "netns", "exec", net.hosts[i]] + argv, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def result(out):
    line = next((l for l in out.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError("no RESULT in: " + out)
    return {k: float(v) for k, v in (kv.split("=") for kv in line.split()[1:])}


def pingpong(build, net, size, count):
    prog = os.path.join(build, "bench", "bench-tcp-pingpong")
    srv = run_ns(net, 1, [prog, "server", net.ip(1), "7600"])
    try:
        srv.stdout.readline()  # listening
        cl = run_ns(net, 0, [prog, "client", net.ip(1), "7600", str(size), str(count)])
        out, err = cl.communicate(timeout=120)
        if cl.returncode != 0:
            raise RuntimeError("bench-tcp-pingpong: " + err)
        return result(out)
    finally:
        srv.kill()
        srv.wait()


def handoff_latency(build, pair, dest, count, layers, groups, layer_bytes, inflight=1, dest_arena=None, arena="kv0",
                    pipelined=False):
    """pipelined: the K handoffs in flight from one client thread (--pipeline), not K threads."""
    argv = [os.path.join(build, "bench", "bench-handoff-latency"), "--prefill", f"direct:{pair.sock(0)}",
            "--arena", arena,
            "--decode", f"direct:{pair.sock(1 if dest else 0)}", "--dest", dest, "--layers", str(layers),
            "--groups", str(groups), "--layer-bytes", str(layer_bytes), "--count", str(count),
            "--pipeline" if pipelined else "--inflight", str(inflight),
            "--warmup", str(min(50, max(count // (10 * inflight), 2)))]
    if dest_arena:
        argv += ["--dest-arena", dest_arena]
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"bench-handoff-latency {argv[1:]}: {r.stdout} {r.stderr}")
    return result(r.stdout)


def strace_counts(path):
    """{syscall: calls} from strace -c output."""
    calls = {}
    for line in open(path):
        f = line.split()
        if len(f) >= 5 and f[0][0].isdigit() and f[-1] != "total":
            try:
                calls[f[-1]] = int(f[3])
            except ValueError:
                pass
    return calls


def syscalls(build, tmp, pair, count, inflight=1, shape=(), pipelined=False):
    """strace -c -f on both daemons and the client over `count` 64 KiB 4-group handoffs
    (or `shape`: bench-handoff-latency's --layers/--groups/--layer-bytes/--arena
    arguments) (warmup 0: every one counted): syscalls and fdatasyncs per handoff, per
    process."""
    outs = [os.path.join(tmp, f"strace-{n}.txt") for n in ("source", "destination", "client")]
    tracers = [subprocess.Popen(["strace", "-f", "-c", "-o", outs[i], "-p", str(pair.procs[i].pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in (0, 1)]
    time.sleep(1.0)  # attached
    argv = ["strace", "-f", "-c", "-o", outs[2], os.path.join(build, "bench", "bench-handoff-latency"),
            "--prefill", f"direct:{pair.sock(0)}", "--decode", f"direct:{pair.sock(1)}", "--dest", "bravo",
            "--count", str(count), "--warmup", "0", "--pipeline" if pipelined else "--inflight",
            str(inflight)] + list(shape)
    r = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    for t in tracers:
        t.send_signal(2)
        t.wait()
    if r.returncode != 0:
        raise RuntimeError("strace run: " + r.stderr)
    res = []
    for name, path in zip(("source", "destination", "client"), outs):
        c = strace_counts(path)
        top = sorted(c.items(), key=lambda kv: -kv[1])[:8]
        res.append((name, sum(c.values()) / count, c.get("fdatasync", 0) / count,
                    " ".join(f"{k} {v / count:.1f}" for k, v in top)))
    return res


def latency_main(build, quick, count):
    print(f"bench-handoff-netns --latency: small handoffs alpha -> bravo (network namespaces, veth + bridge) "
          f"and local on alpha (kv0 -> kv1), {count} each, vs a bare TCP ping-pong and iperf3 in the same run")
    with tempfile.TemporaryDirectory() as tmp:
        net = Net(2)
        try:
            pp = pingpong(build, net, 64 * KiB, count)
            limit = iperf3(net, 1, 1 if quick else 2)
            print(f"  limit: TCP ping-pong 64 KiB mean {pp['rtt_mean']:.1f} us  P50 {pp['rtt_p50']:.1f} us  "
                  f"P99 {pp['rtt_p99']:.1f} us;  iperf3 -P 1 {limit:.1f} MiB/s", flush=True)
            # An arena holds pages of one size: the 36-layer layout (63 KiB pages) has its own.
            pair = Pair(build, tmp, net, 1, 256, extra="[Arena:kv1]\nSize=64M\n[Arena:kv36]\nSize=32M\n"
                                                        "[Arena:kv36b]\nSize=32M\n")
            try:
                cases = [("64 KiB, 4 groups", 8, 4, 8192, "kv0", "kv1"), ("64 KiB, 1 group", 8, 1, 8192, "kv0", "kv1"),
                         ("63 KiB, 36 groups", 36, 36, 1792, "kv36", "kv36b")]
                for label, layers, groups, lb, arena, local_arena in cases:
                    for where, dest, da in (("inter-host", "bravo", None), ("local", "", local_arena)):
                        r = handoff_latency(build, pair, dest, count, layers, groups, lb, dest_arena=da, arena=arena)
                        ratio = r["all_p50"] / pp["rtt_p50"]
                        print(f"  {where:10} {label:18}: first group mean {r['first_mean']:7.1f} P50 "
                              f"{r['first_p50']:7.1f} P99 {r['first_p99']:7.1f} us;  all landed mean "
                              f"{r['all_mean']:7.1f} P50 {r['all_p50']:7.1f} P99 {r['all_p99']:7.1f} us (Prepare call P50 "
                              f"{r['prepare_p50']:.1f});  "
                              f"P50 / ping-pong P50 {ratio:5.2f}, P99 / ping-pong P99 "
                              f"{r['all_p99'] / pp['rtt_p99']:5.2f}", flush=True)
                for k, pipelined in ((1, False), (64, False), (64, True)) if shutil.which("strace") else ():
                    n = (128 if quick else 512) if k > 1 else (100 if quick else 300)
                    res = syscalls(build, tmp, pair, n, k, pipelined=pipelined)
                    how = "pipelined from one thread" if pipelined else "in flight"
                    print(f"  syscalls per 64 KiB 4-group inter-host handoff, {k} {how} (strace -c -f, {n} "
                          f"handoffs, the clients' connection setup included): "
                          + ", ".join(f"{name} {sc:.1f} (fdatasync {fs:.2f})" for name, sc, fs, _ in res), flush=True)
                    for name, _, _, top in res:
                        print(f"    {name:11} most made, per handoff: {top}", flush=True)
                # The VM's speed drifts within a run: the throughput lines are set against
                # iperf3 measured again right before them.
                limit = iperf3(net, 1, 1 if quick else 2)
                print(f"  limit again, right before the throughput runs: iperf3 -P 1 {limit:.1f} MiB/s", flush=True)
                for k, pipelined in ((1, False), (8, False), (64, False), (8, True), (64, True)):
                    n = max(count, 4 * k) // k * k
                    waits = [pair.counter(i, "journal-waits") for i in (0, 1)]
                    r = handoff_latency(build, pair, "bravo", n, 8, 4, 8192, inflight=k, pipelined=pipelined)
                    waits = [pair.counter(i, "journal-waits") - w for i, w in zip((0, 1), waits)]
                    how = "pipelined from one thread" if pipelined else "in flight"
                    print(f"  inter-host 64 KiB x {k:2} {how}: {r['per_s']:8.0f} handoffs/s  "
                          f"{r['mib_s']:7.1f} MiB/s  = {r['mib_s'] / limit:5.3f} of iperf3 -P 1;  all landed P50 "
                          f"{r['all_p50']:.1f} P99 {r['all_p99']:.1f} us;  journal waits {waits[0]} / {waits[1]}",
                          flush=True)
            finally:
                pair.close()
        finally:
            net.close()
    return 0


def local_groups_main(build, count, reps):
    print(f"bench-handoff-netns --local-groups: local handoffs on alpha, 64 KiB in 1 group and 63 KiB in 36 "
          f"groups, {count} each, alternating {reps} times, vs a bare TCP ping-pong in the same run")
    with tempfile.TemporaryDirectory() as tmp:
        net = Net(2)
        try:
            pp = pingpong(build, net, 64 * KiB, count)
            print(f"  limit: TCP ping-pong 64 KiB P50 {pp['rtt_p50']:.1f} us  P99 {pp['rtt_p99']:.1f} us", flush=True)
            pair = Pair(build, tmp, net, 1, 256, extra="[Arena:kv1]\nSize=64M\n[Arena:kv36]\nSize=32M\n"
                                                        "[Arena:kv36b]\nSize=32M\n")
            try:
                ratios = []
                for i in range(reps):
                    one = handoff_latency(build, pair, "", count, 8, 1, 8192, dest_arena="kv1", arena="kv0")
                    many = handoff_latency(build, pair, "", count, 36, 36, 1792, dest_arena="kv36b", arena="kv36")
                    ratios.append(many["all_p50"] / one["all_p50"])
                    print(f"  {i + 1}: 1 group P50 {one['all_p50']:7.1f} us, 36 groups P50 {many['all_p50']:7.1f} us "
                          f"(P99 {many['all_p99']:.1f}): {ratios[-1]:.2f} x;  36 groups / ping-pong P50 "
                          f"{many['all_p50'] / pp['rtt_p50']:.2f}", flush=True)
                print(f"  36 groups / 1 group: median {statistics.median(ratios):.2f}, "
                      f"{min(ratios):.2f}-{max(ratios):.2f}", flush=True)
            finally:
                pair.close()
        finally:
            net.close()
    return 0


# The latency run's 36-group case: 36 layers of 1792 bytes (63 KiB pages) in an arena of their own.
SHAPE_36 = ("--layers", "36", "--groups", "36", "--layer-bytes", "1792", "--arena", "kv36")


def syscalls_main(build, count, groups36=False):
    shape, label = (SHAPE_36, "63 KiB 36-group") if groups36 else ((), "64 KiB 4-group")
    with tempfile.TemporaryDirectory() as tmp:
        net = Net(2)
        try:
            pp = pingpong(build, net, 64 * KiB, 1000)
            pair = Pair(build, tmp, net, 1, 256, extra="[Arena:kv36]\nSize=32M\n" if groups36 else "")
            try:
                layers, groups, lb, arena = (36, 36, 1792, "kv36") if groups36 else (8, 4, 8192, "kv0")
                handoff_latency(build, pair, "bravo", 100, layers, groups, lb, arena=arena)  # warm up
                res = syscalls(build, tmp, pair, count, 1, shape)
                print(f"bench-handoff-netns --syscalls: {label} handoffs alpha -> bravo, 1 in flight "
                      f"(strace -c -f, {count} handoffs, the clients' connection setup included)")
                for name, sc, fs, top in res:
                    print(f"  {name:11} {sc:6.1f} system calls per handoff (fdatasync {fs:.2f}); most made: {top}")
                r = handoff_latency(build, pair, "bravo", 1000, layers, groups, lb, arena=arena)
                print(f"  latency without strace, 1000 handoffs: all landed P50 {r['all_p50']:.1f} P99 "
                      f"{r['all_p99']:.1f} us; limit: TCP ping-pong 64 KiB P50 {pp['rtt_p50']:.1f} P99 "
                      f"{pp['rtt_p99']:.1f} us", flush=True)
            finally:
                pair.close()
        finally:
            net.close()
    return 0


def cpu_ticks():
    """The machine's CPU time (/proc/stat's first line), in clock ticks: user (with nice),
    system (with irq and softirq), idle (with iowait), steal."""
    f = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    return {"user": f[0] + f[1], "system": f[2] + f[5] + f[6], "idle": f[3] + f[4], "steal": f[7] if len(f) > 7 else 0}


def proc_cpu_s(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def cpu_share(t0, t1):
    d = {k: t1[k] - t0[k] for k in t0}
    total = max(sum(d.values()), 1)
    return {k: v / total for k, v in d.items()}, sum(d.values()) / os.sysconf("SC_CLK_TCK")


def cpu_main(build, count):
    import resource
    ncpu = os.cpu_count()
    print(f"bench-handoff-netns --cpu: 64 KiB 4-group handoffs alpha -> bravo pipelined from one thread, "
          f"{count} per row, window off; {ncpu} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        net = Net(2)
        try:
            pair = Pair(build, tmp, net, 1, 512, extra="[Backpressure]\nEnabled=no\nWindowHandoffs=0\n")
            try:
                handoff_latency(build, pair, "bravo", 500, 8, 4, 8192, 16, pipelined=True)  # warm up
                limit = iperf3(net, 1, 2)
                for k in (16, 64, 256):
                    d0 = [proc_cpu_s(p.pid) for p in pair.procs]
                    c0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), cpu_ticks()
                    n = max(count // k, 1) * k
                    r = handoff_latency(build, pair, "bravo", n, 8, 4, 8192, k, pipelined=True)
                    t1, c1 = cpu_ticks(), resource.getrusage(resource.RUSAGE_CHILDREN)
                    d1 = [proc_cpu_s(p.pid) for p in pair.procs]
                    n += min(50, max(n // (10 * k), 2)) * k  # handoff_latency's warm-up rounds ran too
                    share, _ = cpu_share(t0, t1)
                    client = (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime) / n * 1e6
                    src, dst = ((d1[i] - d0[i]) / n * 1e6 for i in (0, 1))
                    mib = r["per_s"] * 64 * KiB / MiB
                    print(f"  {k:3} in flight: {r['per_s']:7.0f} handoffs/s = {mib / limit:.3f} of iperf3 -P 1 "
                          f"({limit:.1f} MiB/s);  CPU per handoff: source {src:.0f}, destination {dst:.0f}, "
                          f"client {client:.0f} us = {src + dst + client:.0f} us;  CPUs: user {share['user']:.2f} "
                          f"system {share['system']:.2f} idle {share['idle']:.2f} steal {share['steal']:.2f}",
                          flush=True)
                    last = (src + dst + client, r["per_s"])
                t0 = cpu_ticks()
                limit = iperf3(net, 1, 3)
                share, secs = cpu_share(t0, cpu_ticks())
                busy = (1 - share["idle"]) * secs  # CPU-seconds kept busy over the iperf3 run (setup included)
                per64 = busy / (limit * MiB * 3 / (64 * KiB)) * 1e6
                print(f"  iperf3 -P 1: {limit:.1f} MiB/s, CPUs: user {share['user']:.2f} system {share['system']:.2f} "
                      f"idle {share['idle']:.2f};  {per64:.1f} us of CPU per 64 KiB moved (an upper bound: its start "
                      f"and end are counted)")
                ceiling = ncpu / (last[0] / 1e6)
                print(f"  epd at 256 in flight: {last[0]:.0f} us of CPU per handoff (iperf3: {per64:.1f} per 64 KiB); "
                      f"with all {ncpu} CPUs busy at that cost, {ceiling:.0f} handoffs/s = "
                      f"{ceiling * 64 * KiB / MiB / limit:.3f} of this iperf3 (measured: {last[1]:.0f}/s)")
            finally:
                pair.close()
        finally:
            net.close()
    return 0


def fmt(size):
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    build = sys.argv[1]
    quick = "--quick" in sys.argv
    max_mib = 1024
    if "--max-size" in sys.argv:
        max_mib = int(sys.argv[sys.argv.index("--max-size") + 1])
    if os.geteuid() != 0:
        print("SKIP: needs root for network namespaces")
        return 77
    for tool in ("ip", "iperf3"):
        if not shutil.which(tool):
            print(f"SKIP: {tool} not installed")
            return 77
    if "--latency" in sys.argv:
        count = int(sys.argv[sys.argv.index("--count") + 1]) if "--count" in sys.argv else (200 if quick else 1000)
        return latency_main(build, quick, count)
    if "--local-groups" in sys.argv:
        count = int(sys.argv[sys.argv.index("--count") + 1]) if "--count" in sys.argv else 1000
        return local_groups_main(build, count, int(sys.argv[sys.argv.index("--local-groups") + 1]))
    if "--cpu" in sys.argv:
        count = int(sys.argv[sys.argv.index("--count") + 1]) if "--count" in sys.argv else 20000
        return cpu_main(build, count)
    if "--syscalls" in sys.argv:
        if not shutil.which("strace"):
            print("SKIP: strace not installed")
            return 77
        count = int(sys.argv[sys.argv.index("--count") + 1]) if "--count" in sys.argv else 300
        return syscalls_main(build, count, "--groups" in sys.argv and sys.argv[sys.argv.index("--groups") + 1] == "36")
    sizes = [64 * KiB, MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
    sizes = [s for s in sizes if s <= max_mib * MiB]
    if quick:
        sizes = [s for s in sizes if s <= 16 * MiB]
    arena_mb = max(sizes) // MiB + 64
    prefault = "--prefault" in sys.argv
    print(f"bench-handoff-netns: epdd handoffs alpha -> bravo (network namespaces, veth + bridge) vs iperf3, "
          f"same run; 4 layer groups, pages of 64 KiB" + ("; arena kv0 Prefault=yes" if prefault else ""))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        net = Net(2)
        try:
            for streams in (1, 4):
                limit = iperf3(net, streams, 1 if quick else 2)
                pair = Pair(build, tmp, net, streams, arena_mb, prefault=prefault)
                try:
                    pair.handoff(MiB)  # warm up: connections, pages, page cache
                    for size in sizes:
                        if size <= 16 * MiB:
                            rates = [pair.handoff(size) for _ in range(9 if size <= MiB else 3)]
                            rate, note = statistics.median(rates), f"median of {len(rates)}"
                        else:
                            # The first touches the arenas' pages (page faults on both
                            # sides); the second runs on warm pages.
                            cold = pair.handoff(size)
                            rate, note = pair.handoff(size), f"warm; cold arenas {cold:.1f} MiB/s"
                        rows.append((streams, size, rate, limit))
                        print(f"  streams={streams} {fmt(size):>9}: handoff {rate:9.1f} MiB/s   "
                              f"iperf3 -P {streams} {limit:9.1f} MiB/s   ratio {rate / limit:5.2f}   ({note})",
                              flush=True)
                finally:
                    pair.close()
        finally:
            net.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
