#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Handoffs over RDMA on soft-RoCE, with faults: run inside the VM of run-vm-test.sh
(guest-epd.sh sets up veth0/veth1 with rxe0/rxe1 in the initial network namespace).

    test-rdma-vm.py BUILD_ROOT

Two epdd (alpha on 10.1.0.1/veth0/rxe0, bravo on 10.1.0.2/veth1/rxe1) and the handoff
clients of the TCP tests (tests/integration/handoff-client, driven through the Cluster
and Client classes of test-handoff-netns.py). Checked:
  - both peers choose rdma and say why; handoffs both ways commit with every byte
    exact, and the bytes went through the rxe devices (their hw_counters), not tcp;
  - kill -9 of the remote daemon, the link cut (veth down), and RoCE packets dropped
    while the control connection lives (the work requests time out): each handoff rolls
    back, nothing is leaked on either side, and RDMA comes back after healing;
  - the rxe device removed (`rdma link delete`) mid-transfer: the handoff rolls back,
    both peers fall back to tcp and say why, the next handoff commits over tcp, and epdd
    closes the device so that the kernel finishes removing it."""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("handoff_netns",
                                               os.path.join(HERE, "..", "integration", "test-handoff-netns.py"))
hn = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hn)
Cluster, check_ok, rid, wait_until, sh, key_file = hn.Cluster, hn.check_ok, hn.rid, hn.wait_until, hn.sh, hn.key_file

# Soft-RoCE under TCG emulation runs RoCE in the guest kernel on two emulated CPUs: a
# daemon's loop can be held for a second. A longer heartbeat than the tcp tests' (1 s),
# and bounds to match: a dead peer is noticed after HEARTBEAT_S, a WR to a peer that
# stopped answering fails after the RC retries (~4 s, transport/rdma.c).
HEARTBEAT_S = 4.0
BOUND_S = 20.0
IPS = ["10.1.0.1", "10.1.0.2"]
VETH = ["veth0", "veth1"]
RXE = ["rxe0", "rxe1"]


class VethNet:
    """The guest's veth pair in the initial namespace (rxe listens only there)."""
    hosts = [None, None]

    def ip(self, i):
        return IPS[i]

    def close(self):
        pass


class RdmaCluster(Cluster):
    def __init__(self, build, tmp):
        self.build, self.tmp = build, tmp
        self.epdd = os.path.join(build, "daemon", "epdd")
        self.epdctl = os.path.join(build, "tools", "epdctl")
        self.client = os.path.join(build, "tests", "integration", "handoff-client")
        self.names = ["alpha", "bravo"]
        self.keys = [key_file(tmp, "key", "e" * 64)] * 2
        self.arena_mb = 64
        self.heartbeat_s, self.extra = HEARTBEAT_S, ""
        self.procs, self.clients = {}, []
        self.net = VethNet()

    def conf(self, i):
        p = super().conf(i)
        with open(p) as f:
            text = f.read()
        with open(p, "w") as f:
            f.write(text.replace("[Cluster]\n", "[Cluster]\nTransport=auto\n", 1))
        return p

    def start(self, i):
        if os.path.exists(self.sock(i)):
            os.unlink(self.sock(i))
        log = open(os.path.join(self.tmp, f"{self.names[i]}.log"), "a")
        self.procs[i] = subprocess.Popen([self.epdd, "-c", self.conf(i), "-s", self.sock(i), "--no-system-bus"],
                                         stdout=log, stderr=log)
        log.close()
        wait_until(lambda: os.path.exists(self.sock(i)), 30, f"{self.names[i]} socket")

    def peer(self, i):
        ps = self.ctl(i, "peers") or []
        return ps[0] if ps else {}

    def transport(self, i):
        return self.peer(i).get("transport")

    def wait_rdma(self, timeout=30):
        wait_until(lambda: self.transport(0) == "rdma" and self.transport(1) == "rdma", timeout, "rdma both ways")

    def shape(self, i, rate):
        sh("tc", "qdisc", "replace", "dev", VETH[i], "root", "tbf", "rate", rate, "burst", "16kb", "latency",
           "400ms")

    def unshape(self, i):
        sh("tc", "qdisc", "del", "dev", VETH[i], "root", check=False)

    def log(self, i):
        with open(os.path.join(self.tmp, f"{self.names[i]}.log")) as f:
            return f.read()


def rxe_counter(dev, name):
    try:
        with open(f"/sys/class/infiniband/{dev}/ports/1/hw_counters/{name}") as f:
            return int(f.read())
    except OSError:
        return None


def veth_routes():
    """Locally generated traffic to the other end leaves through the veths (not lo):
    the routes go with a link that goes down, so they are put back after healing."""
    sh("ip", "route", "replace", IPS[1], "dev", VETH[0], "src", IPS[0], "table", "100")
    sh("ip", "route", "replace", IPS[0], "dev", VETH[1], "src", IPS[1], "table", "101")


def interrupted(cl, label, fault, heal=None, pages=256, bound=BOUND_S):
    """A slow handoff alpha -> bravo over RDMA; fault() once group 0 landed; it must end
    in a rollback with both sides clean; then heal() and RDMA must come back."""
    n = interrupted.count = getattr(interrupted, "count", 0) + 1
    r = rid(0x100 + n)
    cl.wait_rdma()
    d = cl.decode(1, r, 60000)
    p = cl.prefill(0, "bravo", r, pages, 4, 0, 60000)
    assert d.wait_line("group 0 ok", 60), (label, d.lines, p.lines)
    assert d.wait_line("group 3", 0) is None, f"{label}: the transfer finished before the fault"
    t0 = time.monotonic()
    fault()
    assert p.wait_line("final", bound), (label, p.lines)
    t_pre = time.monotonic() - t0
    live = [0] + ([1] if cl.procs[1].poll() is None else [])
    wait_until(lambda: all(cl.clean(i) for i in live), bound, f"{label}: both sides clean")
    t_clean = time.monotonic() - t0
    fp = p.final()
    assert fp[1] == "rolled-back", (label, p.lines)
    assert p.finish() == 0, (label, p.lines)
    rd = d.finish(60)
    fd = d.final()
    if fd is not None:
        assert fd[1] == "rolled-back", (label, d.lines)
    print(f"ok: {label}: prefill {fp[1]} ({fp[2]}) after {t_pre:.2f}s, decode {fd[1:3] if fd else rd}, "
          f"both clean after {t_clean:.2f}s", flush=True)
    if heal:
        heal()
    cl.wait_mesh(timeout=60)
    for i in (0, 1):
        wait_until(lambda i=i: cl.clean(i), 10, f"{cl.names[i]} clean after healing")


def main():
    build = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        cl = RdmaCluster(build, tmp)
        try:
            run(cl)
        except BaseException:
            for i, name in enumerate(cl.names):
                p = os.path.join(tmp, f"{name}.log")
                if os.path.exists(p):
                    print(f"--- {name}.log (tail)")
                    print("".join(open(p).readlines()[-80:]))
            raise
        finally:
            cl.close()
    print("PASS test-rdma-vm")
    return 0


def run(cl):
    cl.start_all()
    cl.wait_mesh(timeout=60)
    cl.wait_rdma()
    for i in (0, 1):
        pe = cl.peer(i)
        print(f"{cl.names[i]}: transport {pe['transport']}: {pe['path_reason']}", flush=True)
        assert "rdma: " + RXE[i] in pe["path_reason"], pe
    print("ok: both peers chose rdma", flush=True)

    # Bytes exact, both ways at once, then one big group, then whole pages.
    sent0, tcp0 = rxe_counter(RXE[0], "sent_pkts"), int(open(f"/sys/class/net/{VETH[0]}/statistics/tx_bytes").read())
    d1, d2 = cl.decode(1, rid(1), 60000), cl.decode(0, rid(2), 60000)
    p1 = cl.prefill(0, "bravo", rid(1), 128, 4, 20, 60000)
    p2 = cl.prefill(1, "alpha", rid(2), 128, 4, 20, 60000)
    check_ok(cl, p1, d1, "alpha->bravo 8 MiB over rdma")
    check_ok(cl, p2, d2, "bravo->alpha 8 MiB over rdma")
    d, p = cl.decode(1, rid(3), 60000), cl.prefill(0, "bravo", rid(3), 512, 4, 0, 60000)
    check_ok(cl, p, d, "alpha->bravo 32 MiB over rdma")
    d, p = cl.decode(1, rid(4), 60000), cl.prefill(0, "bravo", rid(4), 64, 1, 0, 60000)
    check_ok(cl, p, d, "alpha->bravo one group of whole pages over rdma", 1)
    for i in (0, 1):
        wait_until(lambda i=i: cl.clean(i), 10, f"{cl.names[i]} clean")
    sent1 = rxe_counter(RXE[0], "sent_pkts")
    tcp1 = int(open(f"/sys/class/net/{VETH[0]}/statistics/tx_bytes").read())
    moved = (128 + 512 + 64) * 64 * 1024
    print(f"rxe0 sent_pkts +{sent1 - sent0 if sent0 is not None else '?'}; veth0 tx bytes +{tcp1 - tcp0} "
          f"for {moved} bytes of KV from alpha", flush=True)
    if sent0 is not None:
        # At MTU 1024 or larger: at least moved/4096 packets (the bytes went by RoCE).
        assert sent1 - sent0 >= moved // 4096, (sent0, sent1)
    c0, c1 = cl.counters(0), cl.counters(1)
    assert c0["rolled-back"] == 0 and c1["rolled-back"] == 0 and c0["committed"] >= 3, (c0, c1)
    print("ok: handoffs over rdma commit with exact bytes, both sides clean", flush=True)

    # RoCE v2 (udp 4791) dropped, the control connection kept: the first work requests
    # time out after the RC retries, the QP drains, the peer reconnects, the handoff
    # rolls back. (Dropped from the start of a small handoff: deterministic, and each
    # go-back-N round of retransmissions stays short under emulation.)
    drop_roce = ("table inet epdroce {\n chain in { type filter hook input priority 0; policy accept;\n"
                 "  udp dport 4791 counter drop\n }\n}\n")
    cl.wait_rdma()
    subprocess.run(["nft", "-f", "-"], input=drop_roce, text=True, check=True)
    r = rid(0x150)
    d, p = cl.decode(1, r, 60000), cl.prefill(0, "bravo", r, 16, 4, 0, 60000)
    t0 = time.monotonic()
    assert p.wait_line("final", 45), (p.lines, d.lines)
    t_pre = time.monotonic() - t0
    wait_until(lambda: all(cl.clean(i) for i in (0, 1)), 20, "clean after the RoCE drop")
    assert p.final()[1] == "rolled-back", p.lines
    assert p.finish() == 0 and d.finish(60) == 0, (p.lines, d.lines)
    out = subprocess.run(["nft", "list", "table", "inet", "epdroce"], stdout=subprocess.PIPE, text=True).stdout
    subprocess.run(["nft", "delete", "table", "inet", "epdroce"], check=False)
    assert "RDMA WRITE failed" in cl.log(0) and "queue pair failed; reconnecting" in cl.log(0), "no WR failure"
    print(f"ok: rdma: RoCE packets dropped: the work requests timed out, prefill {p.final()[1]} ({p.final()[2]}) "
          f"after {t_pre:.2f}s, both clean; "
          + " ".join(l.strip() for l in out.splitlines() if "counter" in l), flush=True)
    cl.wait_mesh(timeout=60)
    cl.wait_rdma()

    # Faults mid-transfer, on a shaped link so that a transfer can be interrupted.
    cl.shape(0, "40mbit")

    def restart_bravo():
        cl.start(1)
    interrupted(cl, "rdma: kill -9 the remote daemon", lambda: cl.kill(1), heal=restart_bravo)

    def link_up():
        sh("ip", "link", "set", VETH[1], "up")
        veth_routes()
    interrupted(cl, "rdma: link down", lambda: sh("ip", "link", "set", VETH[1], "down"), heal=link_up)
    c0 = cl.counters(0)
    assert c0["committed"] >= 3 and c0["rolled-back"] == interrupted.count + 1, c0

    # The rxe device goes away mid-transfer: rollback, then tcp, visibly.
    cl.wait_rdma()
    r = rid(0x200)
    d = cl.decode(1, r, 60000)
    p = cl.prefill(0, "bravo", r, 256, 4, 0, 60000)
    assert d.wait_line("group 0 ok", 60), (d.lines, p.lines)
    deleted = {}

    def delete():
        t = time.monotonic()
        deleted["rc"] = subprocess.run(["rdma", "link", "delete", RXE[1]]).returncode
        deleted["s"] = time.monotonic() - t
    th = threading.Thread(target=delete)
    th.start()
    assert p.wait_line("final", BOUND_S), p.lines
    assert p.final()[1] == "rolled-back", p.lines
    assert p.finish() == 0 and d.finish(60) in (0,), (p.lines, d.lines)
    wait_until(lambda: all(cl.clean(i) for i in (0, 1)), BOUND_S, "clean after device removal")
    th.join(30)
    assert deleted.get("rc") == 0, f"rdma link delete did not finish: {deleted}"
    print(f"ok: rxe1 removed mid-transfer: rolled back; `rdma link delete` returned after {deleted['s']:.2f}s",
          flush=True)
    wait_until(lambda: cl.transport(0) == "tcp" and cl.transport(1) == "tcp", 10, "tcp both ways")
    for i in (0, 1):
        pe = cl.peer(i)
        print(f"{cl.names[i]}: transport {pe['transport']}: {pe['path_reason']}", flush=True)
    assert "rxe1: device removed" in cl.peer(1)["path_reason"], cl.peer(1)
    assert "the peer stopped RDMA" in cl.peer(0)["path_reason"], cl.peer(0)
    assert "falling back to tcp" in cl.log(1) and "falling back to tcp" in cl.log(0)
    cl.unshape(0)
    d, p = cl.decode(1, rid(0x201), 60000), cl.prefill(0, "bravo", rid(0x201), 64, 4, 0, 60000)
    check_ok(cl, p, d, "alpha->bravo over tcp after the fallback")
    for i in (0, 1):
        wait_until(lambda i=i: cl.clean(i), 10, f"{cl.names[i]} clean")
    print("ok: fallback to tcp after the device removal, visible in epdctl and the logs; tcp handoff commits",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
