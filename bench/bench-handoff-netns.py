#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Inter-host HANDOFF throughput between two epdd in network namespaces (a veth pair
through a bridge), against iperf3 between the same namespaces in the same run.

    bench-handoff-netns.py BUILD_ROOT [--quick] [--max-size SIZE_MIB]

For DataStreams=1 (vs iperf3 -P 1) and DataStreams=4 (vs iperf3 -P 4): a prefill
client (libepd, tests/integration/handoff-client in bench mode: no pattern fill or
check) on "alpha" hands a sequence of SIZE bytes (4 layer groups, reported ready at
once; BENCH_GROUPS=n for another count) off to a decode
client on "bravo"; the time is from LayerGroupReady to the source's handoff reaching
"transferred" (every byte acknowledged by the destination daemon), polled every
100 us. Sizes 64 KiB to 1 GiB; the small ones repeat and take the median, the large
ones run twice (cold arenas, then warm; the warm one is the figure). Prints
handoff MiB/s, iperf3 MiB/s and the ratio. Needs root (ip netns) and iperf3; exits 77
(skip) otherwise. Keep it short: this is a small shared machine."""

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
    def __init__(self, build, tmp, net, streams, arena_mb):
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
                        f"[Arena:kv0]\nSize={arena_mb}M\nHugePages=try\n"
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

    def handoff(self, size):
        self.n += 1
        rid = f"{os.getpid():016x}{self.n:016x}"
        env = dict(os.environ, HANDOFF_CLIENT_BENCH="1")
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
    sizes = [64 * KiB, MiB, 16 * MiB, 256 * MiB, 1024 * MiB]
    sizes = [s for s in sizes if s <= max_mib * MiB]
    if quick:
        sizes = [s for s in sizes if s <= 16 * MiB]
    arena_mb = max(sizes) // MiB + 64
    print(f"bench-handoff-netns: epdd handoffs alpha -> bravo (network namespaces, veth + bridge) vs iperf3, "
          f"same run; 4 layer groups, pages of 64 KiB")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        net = Net(2)
        try:
            for streams in (1, 4):
                limit = iperf3(net, streams, 1 if quick else 2)
                pair = Pair(build, tmp, net, streams, arena_mb)
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
