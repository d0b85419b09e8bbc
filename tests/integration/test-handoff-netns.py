#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Layered handoffs between epdd hosts in separate network namespaces (veth pairs to a
bridge, as in test-peer-netns.py), with faults in the middle of the transfer.

    test-handoff-netns.py TEST BUILD_ROOT

A prefill client (handoff-client, libepd) on one host hands a sequence's KV off to a
decode client on another: groups must land in order with exactly the bytes written.
The faults hit mid-transfer, on a link shaped with tbf so the transfer is slow enough
to be interrupted reliably: kill -9 the remote daemon, link down, an nftables drop-all
rule, kill -9 the decode worker, random packet loss in the kernel (nftables numgen).
Every handoff must end in commit or rollback, and both daemons must hold no page,
lease, handoff or write in flight afterwards (epdctl --json pages/handoffs/peers),
within the heartbeat bound (HeartbeatInterval=1s). A host with the wrong cluster key:
Prepare fails with PeerUnavailable and nothing is written there.

handoff-netns-backpressure: kernel loss on the alpha -> bravo path (tbf and nftables
random drop at bravo) during a transfer drives the path's backpressure level to high;
then new handoffs to bravo are deferred (Prepare fails with Error.Backpressure and a
retry-after), a worker's ring gets the backpressure record, and Admit defers work for a
decode worker placed on bravo with reason "backpressure"; once the link recovers, the
level steps down, the ring says so, and handoffs and admissions resume.

TEST: handoff-netns-two, handoff-netns-three, handoff-netns-faults, handoff-netns-loss,
handoff-netns-wrong-key, handoff-netns-backpressure, handoff-netns-pipelined. Needs root (ip netns, tc, nft);
exits 77 (skip) without it."""

import importlib.util
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("peer_netns", os.path.join(HERE, "test-peer-netns.py"))
peer_netns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer_netns)
Net, sh, key_file, wait_until, skip = (peer_netns.Net, peer_netns.sh, peer_netns.key_file, peer_netns.wait_until,
                                       peer_netns.skip)

HEARTBEAT_S = 1.0
# A dead peer is noticed after HEARTBEAT_S of silence (checked every quarter of it); the
# rollback, the frees and our epdctl polling follow. Slack for this small shared machine.
BOUND_S = HEARTBEAT_S * 1.25 + 1.25
PAGE = 64 << 10
MiB = 1 << 20
ONLY = None


class Cluster:
    def __init__(self, build, tmp, n, keys=None, arena_mb=64, heartbeat_s=HEARTBEAT_S, extra=""):
        self.heartbeat_s, self.extra = heartbeat_s, extra
        self.build, self.tmp = build, tmp
        self.epdd = os.path.join(build, "daemon", "epdd")
        self.epdctl = os.path.join(build, "tools", "epdctl")
        self.client = os.path.join(build, "tests", "integration", "handoff-client")
        self.names = ["alpha", "bravo", "charlie"][:n]
        self.keys = keys or [key_file(tmp, "key", "e" * 64)] * n
        self.arena_mb = arena_mb
        self.procs = {}
        self.clients = []
        self.net = Net(n)

    def conf(self, i):
        p = os.path.join(self.tmp, f"{self.names[i]}.conf")
        with open(p, "w") as f:
            f.write(f"[Daemon]\nHostId={self.names[i]}\nSystemBus=no\n"
                    f"StateDirectory={self.tmp}/{self.names[i]}.state\n"
                    f"[Arena:kv0]\nSize={self.arena(i)}M\n"
                    f"[Cluster]\nListen={self.net.ip(i)}:7400\nClusterKeyFile={self.keys[i]}\n"
                    f"HeartbeatInterval={int(self.heartbeat_s * 1000)}ms\n" + self.extra)
            for j, n in enumerate(self.names):
                if j != i:
                    f.write(f"[Peer:{n}]\nAddress={self.net.ip(j)}:7400\nHostId={n}\n")
        return p

    def arena(self, i):
        return self.arena_mb[i] if isinstance(self.arena_mb, (list, tuple)) else self.arena_mb

    def sock(self, i):
        return os.path.join(self.tmp, f"{self.names[i]}.sock")

    def addr(self, i):
        return f"direct:{self.sock(i)}"

    def start(self, i):
        if os.path.exists(self.sock(i)):
            os.unlink(self.sock(i))
        log = open(os.path.join(self.tmp, f"{self.names[i]}.log"), "a")
        self.procs[i] = subprocess.Popen(["ip", "netns", "exec", self.net.hosts[i], self.epdd, "-c", self.conf(i),
                                          "-s", self.sock(i), "--no-system-bus"],
                                         stdout=subprocess.DEVNULL, stderr=log)
        log.close()
        wait_until(lambda: os.path.exists(self.sock(i)), 10, f"{self.names[i]} socket")

    def start_all(self):
        for i in range(len(self.names)):
            self.start(i)

    def kill(self, i):
        self.procs[i].kill()
        self.procs[i].wait()

    def ctl(self, i, what):
        r = subprocess.run([self.epdctl, "-A", self.addr(i), "--json", what], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def peers_up(self, i, others):
        ps = self.ctl(i, "peers") or []
        up = {p["host_id"] for p in ps if p["state"] == "up" and p["streams"] >= 1}
        return all(self.names[j] in up for j in others)

    def wait_mesh(self, hosts=None, timeout=15):
        hosts = hosts if hosts is not None else list(range(len(self.names)))
        wait_until(lambda: all(self.peers_up(i, [j for j in hosts if j != i]) for i in hosts), timeout,
                   "peers up")

    def clean(self, i):
        """No page allocated, leased or cached, no handoff, no write in flight."""
        pages, hand = self.ctl(i, "pages"), self.ctl(i, "handoffs")
        if pages is None or hand is None:
            return False
        for p in pages["pools"]:
            if p["free"] != p["total"] or p["leased"] or p["live"]:
                return False
        c = hand["counters"]
        return not hand["handoffs"] and c["live"] == 0 and c["writes-in-flight"] == 0

    def counters(self, i):
        return self.ctl(i, "handoffs")["counters"]

    def spawn(self, *args):
        c = Client([self.client] + [str(a) for a in args])
        self.clients.append(c)
        return c

    def prefill(self, i, dest, rid, pages, groups=4, delay_ms=0, timeout_ms=20000, retry_backpressure=True):
        """A prefill worker on host i handing `pages` pages to `dest`. A Prepare refused
        with Error.Backpressure (the path's window closed by loss, a burst's queueing on a
        loaded machine) is retried after its retry-after, as a worker would, unless
        retry_backpressure is False (the backpressure test looks at the refusal itself)."""
        os.environ["HANDOFF_CLIENT_RETRY_BACKPRESSURE"] = "1" if retry_backpressure else "0"
        try:
            return self.spawn("prefill", self.addr(i), "kv0", dest, rid, pages, groups, delay_ms, timeout_ms)
        finally:
            os.environ.pop("HANDOFF_CLIENT_RETRY_BACKPRESSURE", None)

    def decode(self, i, rid, timeout_ms=20000):
        """A decode worker on host i waiting for `rid`; returns once it has registered, so
        that a Prepare towards host i finds its KV page size (a daemon whose KV arena has
        no layout yet refuses: "no host KV arena with this page size")."""
        d = self.spawn("decode", self.addr(i), rid, timeout_ms)
        assert d.wait_line("registered", 30), ("decode worker did not register", d.lines)
        return d

    def shape(self, i, rate):
        """tbf on host i's eth0 (its egress): slow enough to interrupt reliably."""
        sh("tc", "-n", self.net.hosts[i], "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate,
           "burst", "16kb", "latency", "200ms")

    def unshape(self, i):
        sh("tc", "-n", self.net.hosts[i], "qdisc", "del", "dev", "eth0", "root", check=False)

    def nft(self, i, rules):
        p = subprocess.run(["ip", "netns", "exec", self.net.hosts[i], "nft", "-f", "-"], input=rules, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if p.returncode != 0:
            raise RuntimeError(f"nft: {p.stderr.strip()}")

    def nft_flush(self, i):
        subprocess.run(["ip", "netns", "exec", self.net.hosts[i], "nft", "flush", "ruleset"], check=False)

    def close(self):
        for c in self.clients:
            c.kill()
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.net.close()


class Client:
    def __init__(self, argv):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        self.lines = []
        self.buf = ""
        self.eof = False

    def _read(self, timeout):
        if self.eof:
            return False
        r, _, _ = select.select([self.proc.stdout], [], [], max(timeout, 0))
        if not r:
            return False
        chunk = os.read(self.proc.stdout.fileno(), 65536).decode()
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            self.lines.append(line)
        return True

    def wait_line(self, prefix, timeout):
        """The first line starting with prefix (waiting up to timeout), or None."""
        end = time.monotonic() + timeout
        while True:
            for l in self.lines:
                if l.startswith(prefix):
                    return l
            left = end - time.monotonic()
            if left <= 0 or self.eof:
                return None
            self._read(left)

    def finish(self, timeout=30):
        end = time.monotonic() + timeout
        while not self.eof and time.monotonic() < end:
            self._read(end - time.monotonic())
        try:
            rc = self.proc.wait(timeout=max(end - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.argv[1]} client did not finish: {self.lines}")
        return rc

    def wait_line_from(self, start, pred, timeout):
        """The first line at index >= start for which pred(line) holds, or None."""
        end = time.monotonic() + timeout
        while True:
            for l in self.lines[start:]:
                if pred(l):
                    return l
            left = end - time.monotonic()
            if left <= 0 or self.eof:
                return None
            self._read(left)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def final(self):
        return next((l.split() for l in self.lines if l.startswith("final ")), None)


def rid(n):
    return f"{n:032x}"


def check_ok(cl, pre, dec, label, n_groups=4):
    """A handoff that must commit: groups in order, exact bytes, everything released."""
    rp, rd = pre.finish(), dec.finish()
    groups = [l for l in dec.lines if l.startswith("group ")]
    print(f"{label}: prefill {pre.lines[-3:]} decode {groups} {dec.lines[-2:]}")
    assert rd == 0 and rp == 0, (label, rp, pre.lines, rd, dec.lines)
    assert groups == [f"group {g} ok" for g in range(len(groups))] and len(groups) == n_groups, (label, dec.lines)
    assert dec.final()[1] == "committed" and pre.final()[1] == "committed", (label, pre.lines, dec.lines)
    assert "released" in pre.lines and "released" in dec.lines


def test_two(cl):
    cl.start_all()
    cl.wait_mesh()
    # alpha -> bravo and bravo -> alpha at once, 8 MiB each, groups 20 ms apart.
    d1, d2 = cl.decode(1, rid(1)), cl.decode(0, rid(2))
    p1 = cl.prefill(0, "bravo", rid(1), 128, 4, 20)
    p2 = cl.prefill(1, "alpha", rid(2), 128, 4, 20)
    check_ok(cl, p1, d1, "alpha->bravo")
    check_ok(cl, p2, d2, "bravo->alpha")
    # One group of 32 MiB, no delay.
    d, p = cl.decode(1, rid(3)), cl.prefill(0, "bravo", rid(3), 512, 4, 0)
    check_ok(cl, p, d, "alpha->bravo 32 MiB")
    # One group of every layer: whole pages, adjacent ones shipped as one write.
    d, p = cl.decode(1, rid(4)), cl.prefill(0, "bravo", rid(4), 64, 1, 0)
    check_ok(cl, p, d, "alpha->bravo one group", 1)
    for i in (0, 1):
        wait_until(lambda i=i: cl.clean(i), 5, f"{cl.names[i]} clean")
    c0, c1 = cl.counters(0), cl.counters(1)
    print("alpha:", {k: v for k, v in c0.items() if v}, "\nbravo:", {k: v for k, v in c1.items() if v})
    assert c0["rolled-back"] == 0 and c1["rolled-back"] == 0 and c0["committed"] >= 3 and c1["committed"] >= 3


def test_three(cl):
    cl.start_all()
    cl.wait_mesh()
    # Every host hands off to both others at once: 6 handoffs over 3 links. The decode
    # workers register first: a fresh daemon learns its KV page size from the first
    # worker's layout, and refuses a Prepare that arrives before it.
    pairs = [(i, j) for i in range(3) for j in range(3) if i != j]
    decodes = [cl.decode(j, rid(0x30 + k)) for k, (i, j) in enumerate(pairs)]
    runs = []
    for k, (i, j) in enumerate(pairs):
        runs.append((cl.prefill(i, cl.names[j], rid(0x30 + k), 64, 4, 10), decodes[k],
                     f"{cl.names[i]}->{cl.names[j]}"))
    for p, d, label in runs:
        check_ok(cl, p, d, label)
    # Small ones (512 KiB: pipelined, slots numbered across both peers of each source).
    runs = []
    for k, (i, j) in enumerate(pairs):
        runs.append((cl.prefill(i, cl.names[j], rid(0x40 + k), 8, 4, 0), cl.decode(j, rid(0x40 + k)),
                     f"{cl.names[i]}->{cl.names[j]} pipelined"))
    for p, d, label in runs:
        check_ok(cl, p, d, label)
    for i in range(3):
        wait_until(lambda i=i: cl.clean(i), 5, f"{cl.names[i]} clean")
        assert cl.counters(i)["committed"] >= 4 and cl.counters(i)["rolled-back"] == 0, cl.counters(i)
        assert cl.counters(i)["pipelined"] >= 2, cl.counters(i)


def interrupted(cl, label, fault, after="group 0 ok", pages=256, expect_cause=None, heal=None, before=None):
    """Starts a slow handoff alpha -> bravo, applies fault() once `after` shows on the
    decode side, and checks that it ends in a rollback on alpha (and bravo, where it
    still runs) with both sides clean within the bound."""
    if ONLY and ONLY not in label:
        return
    n = interrupted.count = getattr(interrupted, "count", 0) + 1
    r = rid(0x100 + n)
    d = cl.decode(1, r)
    p = cl.prefill(0, "bravo", r, pages, 4, 0)
    assert d.wait_line(after, 30), (label, d.lines, p.lines)
    if before:
        before()
    assert d.wait_line("group 3", 0) is None, f"{label}: the transfer finished before the fault"
    t0 = time.monotonic()
    fault()
    assert p.wait_line("final", BOUND_S + 1), (label, p.lines)
    t_pre = time.monotonic() - t0
    live = [0] + ([1] if cl.procs[1].poll() is None else [])
    wait_until(lambda: all(cl.clean(i) for i in live), BOUND_S + 1, f"{label}: both sides clean")
    t_clean = time.monotonic() - t0
    fp = p.final()
    assert fp[1] == "rolled-back", (label, p.lines)
    if expect_cause:
        assert fp[2] in expect_cause, (label, fp)
    assert p.finish() == 0, (label, p.lines)
    rd = d.finish()
    fd = d.final()
    if fd is not None:
        assert fd[1] == "rolled-back", (label, d.lines)
    print(f"{label}: prefill {fp[1]} ({fp[2]}) after {t_pre:.2f}s, decode {fd[1:3] if fd else rd}, "
          f"both clean after {t_clean:.2f}s (bound {BOUND_S:.2f}s)")
    assert t_clean < BOUND_S + 1
    if heal:
        heal()
    cl.wait_mesh()
    for i in (0, 1):
        wait_until(lambda i=i: cl.clean(i), 5, f"{cl.names[i]} clean after healing")


def test_faults(cl):
    cl.start_all()
    cl.wait_mesh()
    # 16 MiB at 40 Mbit/s: about 3.4 s, four groups of 0.85 s.
    cl.shape(0, "40mbit")
    h = cl.net.hosts[1]

    def restart_bravo():
        cl.start(1)

    interrupted(cl, "kill -9 the remote daemon", lambda: cl.kill(1), heal=restart_bravo,
                expect_cause=("peer-down", "transfer-failed"))
    interrupted(cl, "link down", lambda: sh("ip", "-n", h, "link", "set", "eth0", "down"),
                heal=lambda: sh("ip", "-n", h, "link", "set", "eth0", "up"),
                expect_cause=("peer-down", "transfer-failed"))
    drop_all = ("table inet epdfault {\n chain in { type filter hook input priority 0; policy drop; }\n"
                " chain out { type filter hook output priority 0; policy drop; }\n}\n")
    interrupted(cl, "nftables drop-all", lambda: cl.nft(1, drop_all), heal=lambda: cl.nft_flush(1),
                expect_cause=("peer-down", "transfer-failed"))
    victim = []

    def kill_decode():
        d = cl.clients[-2]  # interrupted() spawns the decode client first
        assert d.argv[1] == "decode"
        victim.append(d)
        d.kill()
    interrupted(cl, "kill -9 the decode worker", kill_decode, expect_cause=("worker-gone",))
    # Nothing is left behind on either side across all of it.
    c0, c1 = cl.counters(0), cl.counters(1)
    print("alpha:", {k: v for k, v in c0.items() if v}, "\nbravo:", {k: v for k, v in c1.items() if v})
    assert c0["committed"] == 0 and c1["committed"] == 0, (c0, c1)
    assert c0["rolled-back"] == interrupted.count, c0


# Handoffs up to 64 MiB are pipelined here (no round trip before the data).
PIPE_CONF = "PipelineBytes=64M\n"


def dest_bytes(cl, i, r):
    """Bytes landed so far at host i for request r (its destination side), or -1."""
    for h in (cl.ctl(i, "handoffs") or {}).get("handoffs", []):
        if h.get("request_id") == r and h.get("role") == "destination":
            return h["bytes"]
    return -1


def test_pipelined(cl):
    """Pipelined handoffs (PREPARE and data without a round trip, group completions in the
    data stream): many small ones at once both ways commit with exact bytes; one the
    destination cannot hold is refused there and rolls back both sides; a link cut
    after part of a group's data landed but before its completion flag (the group's
    last write) rolls back both sides within the bound."""
    cl.start_all()
    cl.wait_mesh()
    runs = []
    for k in range(6):
        src, dst = (0, 1) if k < 4 else (1, 0)
        r = rid(0x400 + k)
        runs.append((cl.decode(dst, r), cl.prefill(src, cl.names[dst], r, 8, 4, 0), f"pipelined {k}"))
    for d, p, label in runs:
        check_ok(cl, p, d, label)
    # 4 groups of 16 pages in one, at once after Prepare; and a single group.
    d, p = cl.decode(1, rid(0x410)), cl.prefill(0, "bravo", rid(0x410), 16, 1, 0)
    check_ok(cl, p, d, "pipelined one group", 1)
    # No Release calls: the source prepared with release_on_commit goes when bravo
    # commits, bravo's side in its CommitAndRelease.
    os.environ["HANDOFF_CLIENT_RELEASE_ON_COMMIT"] = "1"
    try:
        d, p = cl.decode(1, rid(0x411)), cl.prefill(0, "bravo", rid(0x411), 8, 4, 0)
        check_ok(cl, p, d, "pipelined, released at commit")
    finally:
        del os.environ["HANDOFF_CLIENT_RELEASE_ON_COMMIT"]
    # A record nobody waits for is durable by the WAL's lazy bound (5 ms) all the same: bravo
    # journals the PREPARE of a handoff whose groups come a second apart, and no call there
    # waits for the disk meanwhile (the decode worker only waits for the groups).
    before = cl.ctl(1, "journal")["last_lsn"]
    d, p = cl.decode(1, rid(0x412)), cl.prefill(0, "bravo", rid(0x412), 8, 4, 1000)
    wait_until(lambda: cl.ctl(1, "journal")["last_lsn"] > before, 5, "bravo journaled the PREPARE")
    j = None
    for _ in range(100):
        j = cl.ctl(1, "journal")
        if j["synced_lsn"] == j["last_lsn"]:
            break
        time.sleep(0.01)
    assert j["synced_lsn"] == j["last_lsn"], ("a record nobody waits for was not made durable", j)
    check_ok(cl, p, d, "pipelined, groups a second apart")
    for i in (0, 1):
        wait_until(lambda i=i: cl.clean(i), 5, f"{cl.names[i]} clean")
    c0, c1 = cl.counters(0), cl.counters(1)
    assert c0["pipelined"] >= 6 and c1["pipelined"] >= 2, (c0, c1)
    assert c0["rolled-back"] == 0 and c1["rolled-back"] == 0, (c0, c1)

    # bravo's arena (16 MiB) cannot hold 32 MiB: it refuses the PREPARE it never
    # answered; the source (which had answered Prepare already) rolls back.
    r = rid(0x420)
    d = cl.decode(1, r, 3000)
    p = cl.prefill(0, "bravo", r, 512, 4, 0, 5000)
    assert p.finish() == 0, p.lines
    fp = p.final()
    assert fp and fp[1] == "rolled-back", p.lines
    assert any(l.startswith("prepared") for l in p.lines), ("not pipelined", p.lines)
    d.kill()
    for i in (0, 1):
        wait_until(lambda i=i: cl.clean(i), 5, f"{cl.names[i]} clean after the refusal")
    print(f"refused at the destination: prefill {fp[1:3]}")
    assert cl.counters(0)["rolled-back"] == 1, cl.counters(0)

    # 8 MiB (4 groups of 2 MiB) at 40 Mbit/s: cut the link once group 1's first bytes
    # landed at bravo (its completion rides its last write, not sent yet).
    cl.shape(0, "40mbit")
    h = cl.net.hosts[1]
    n = getattr(interrupted, "count", 0) + 1
    group = 128 * PAGE // 4

    def group1_partly_landed():
        wait_until(lambda: dest_bytes(cl, 1, rid(0x100 + n)) > group, 10, "part of group 1 landed")
    interrupted(cl, "pipelined: link down between a group's data and its completion",
                lambda: sh("ip", "-n", h, "link", "set", "eth0", "down"), pages=128,
                heal=lambda: sh("ip", "-n", h, "link", "set", "eth0", "up"),
                expect_cause=("peer-down", "transfer-failed"), before=group1_partly_landed)
    cl.unshape(0)
    c0 = cl.counters(0)
    assert c0["pipelined"] >= 7 and c0["committed"] >= 5, c0


def test_loss(cl):
    cl.start_all()
    cl.wait_mesh()
    cl.shape(0, "200mbit")
    results = []
    for pct in (2, 10, 40):
        # The loss of the step before raised the path's level, which closes the handoff
        # window (Prepare: Error.Backpressure, retry after): start each step once it is
        # open again, as a client honouring the retry-after would.
        wait_until(lambda: (path_level(cl, 0, "bravo") or {}).get("level") not in ("high", "stalled"), 30,
                   f"the path open again before {pct}% loss")
        cl.nft(1, "table inet epdloss {\n chain in { type filter hook input priority 0; policy accept;\n"
                  f"  numgen random mod 100 < {pct} drop\n }}\n}}\n")
        r = rid(0x200 + pct)
        d = cl.decode(1, r, 30000)
        p = cl.prefill(0, "bravo", r, 128, 4, 0, 30000)
        rp, rd = p.finish(60), d.finish(60)
        fp, fd = p.final(), d.final()
        cl.nft_flush(1)
        assert rp == 0 and rd in (0,), (pct, p.lines, d.lines)
        assert fp[1] in ("committed", "rolled-back") and fd[1] == fp[1], (pct, p.lines, d.lines)
        groups = [l for l in d.lines if l.startswith("group ")]
        assert all(l.endswith(" ok") for l in groups), (pct, d.lines)
        assert groups == [f"group {g} ok" for g in range(len(groups))], d.lines
        results.append(f"{pct}% loss: {fp[1]} ({fp[2]}), {len(groups)}/4 groups verified")
        cl.wait_mesh(timeout=30)
        for i in (0, 1):
            wait_until(lambda i=i: cl.clean(i), BOUND_S + 1, f"{cl.names[i]} clean after {pct}% loss")
    print("\n".join(results))


def test_wrong_key(cl):
    # charlie has another key: it never becomes a peer; a Prepare towards it fails with
    # PeerUnavailable at once, and nothing lands on it.
    cl.start_all()
    cl.wait_mesh([0, 1])
    time.sleep(HEARTBEAT_S * 2)
    assert not cl.peers_up(0, [2]) and not cl.peers_up(2, [0])
    p = cl.prefill(0, "charlie", rid(0x300), 16, 4, 0, 2000)
    assert p.finish() == 0, p.lines
    assert p.lines[0] == "prepare-failed org.epd1.Error.PeerUnavailable", p.lines
    c2 = cl.counters(2)
    assert c2["prepared"] == 0 and c2["bytes"] == 0 and cl.clean(2), c2
    assert cl.clean(0)
    # The right key still works alongside.
    d, p = cl.decode(1, rid(0x301)), cl.prefill(0, "bravo", rid(0x301), 16, 4, 0)
    check_ok(cl, p, d, "alpha->bravo next to a wrong-key host")


BP_CONF = ("[Telemetry]\nPinDirectory=no\n"
           "[Backpressure]\nInterval=100ms\nHold=1s\nStallTimeout=2s\nRTTFloor=50ms\n")


def path_level(cl, i, peer):
    for p in cl.ctl(i, "paths") or []:
        if p["peer"] == peer:
            return p
    return None


def test_backpressure(cl):
    cl.start_all()
    cl.wait_mesh()
    log = open(os.path.join(cl.tmp, "alpha.log")).read()
    if "Kernel telemetry loaded" not in log:
        skip("kernel telemetry did not load: " +
             next((l for l in log.splitlines() if "telemetry" in l.lower()), "(no log line)"))
    # A worker with a ring on alpha, and a decode worker placed on bravo for Admit.
    w = cl.spawn("watch", cl.addr(0), "bravo", 90)
    assert w.wait_line("ring-open", 10), w.lines
    assert w.wait_line("verdict admit none", 10), w.lines
    mark = len(w.lines)

    # Loss on the path during a transfer: retransmits -> level high.
    cl.shape(0, "40mbit")
    cl.nft(1, "table inet epdloss {\n chain in { type filter hook input priority 0; policy accept;\n"
              "  numgen random mod 100 < 15 drop\n }\n}\n")
    big_d = cl.decode(1, rid(0x400), 60000)
    big_p = cl.prefill(0, "bravo", rid(0x400), 512, 4, 0, 60000)
    assert big_p.wait_line("prepared", 10), big_p.lines
    wait_until(lambda: (path_level(cl, 0, "bravo") or {}).get("kernel"), 10, "kernel records of the path")
    # The record to wait for is one that closes the window: level stalled, or high for a
    # reason that stops new work (retransmits 2, destination full 6, stalled 7,
    # disconnected 8). High for RTT inflation (1) or the send queue (3, 4) only narrows
    # it (backpressure_window_closed()), and may come first on a shaped link.
    def closes(l):
        f = l.split()
        if len(f) != 6 or f[0] != "backpressure" or f[1] != "bravo":
            return False
        return int(f[2]) >= 3 or (int(f[2]) == 2 and int(f[3]) in (2, 6, 7, 8))

    hi = w.wait_line_from(mark, closes, 30)
    assert hi, ("no backpressure record closing the window", w.lines, path_level(cl, 0, "bravo"))
    _, peer, level, reason, permille, retry = hi.split()
    print(f"ring: {hi}  path: {path_level(cl, 0, 'bravo')}")
    assert int(permille) == 1000 and int(retry) >= 1_000_000, hi  # closed window; retry after Hold

    # While it is closed: a new handoff to bravo is deferred with the named error, and
    # Admit defers work for the decode worker on bravo. The loss goes on while the big
    # handoff moves, so the window closes again whenever it opened in between.
    deferred, k, end = 0, 0, time.monotonic() + 20
    while not deferred and k < 12 and time.monotonic() < end:
        if path_level(cl, 0, "bravo")["level"] not in ("high", "stalled"):
            time.sleep(0.1)
            continue
        q = cl.prefill(0, "bravo", rid(0x500 + k), 16, 4, 0, 5000, retry_backpressure=False)
        k += 1
        assert q.finish() == 0, q.lines
        print(f"prepare while {path_level(cl, 0, 'bravo')['level']}: {q.lines[0]}")
        if q.lines[0].startswith("prepare-failed org.epd1.Error.Backpressure retry_after_usec="):
            retry_after = int(q.lines[0].split("=")[1])
            if retry_after >= 1_000_000:  # closed: retry after Hold (a full window: sooner)
                deferred += 1
        elif not q.lines[0].startswith("prepare-failed"):
            time.sleep(0.1)
    assert deferred == 1, "no Prepare was deferred while the path's window was closed"
    assert cl.counters(0)["deferred"] >= 1, cl.counters(0)
    assert w.wait_line_from(mark, lambda l: l == "verdict defer backpressure", 5), w.lines

    # The link recovers: the level steps down (after Hold), the ring says so, work resumes.
    cl.nft_flush(1)
    cl.unshape(0)
    big_p.finish(60)
    big_d.finish(60)
    mark = len(w.lines)
    ok = w.wait_line_from(mark, lambda l: l.startswith("backpressure bravo 0 "), 30)
    assert ok, ("no backpressure record back at none", w.lines, path_level(cl, 0, "bravo"))
    assert ok.split()[5] == "0", ok  # no retry-after at none
    assert w.wait_line_from(mark, lambda l: l == "verdict admit none", 10), w.lines
    d, p = cl.decode(1, rid(0x420)), cl.prefill(0, "bravo", rid(0x420), 64, 4, 0)
    check_ok(cl, p, d, "alpha->bravo after recovery")
    w.kill()
    for i in (0, 1):
        wait_until(lambda i=i: cl.clean(i), 10, f"{cl.names[i]} clean")
    print("ring records:", [l for l in w.lines if l.startswith("backpressure")])
    print("verdicts:", [l for l in w.lines if l.startswith("verdict")])


def main():
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    global ONLY
    test, build = sys.argv[1], sys.argv[2]
    ONLY = sys.argv[3] if len(sys.argv) > 3 else None  # run only the faults whose label has this
    if os.geteuid() != 0:
        skip("needs root for network namespaces")
    for tool in ("ip", "tc", "nft"):
        if not shutil.which(tool):
            skip(f"{tool} not installed")
    r = sh("ip", "netns", "add", f"epdprobe{os.getpid()}", check=False)
    if r.returncode != 0:
        skip("cannot create network namespaces: " + r.stderr.strip())
    sh("ip", "netns", "del", f"epdprobe{os.getpid()}")
    tests = {
        "handoff-netns-two": (test_two, 2),
        "handoff-netns-three": (test_three, 3),
        "handoff-netns-faults": (test_faults, 2),
        "handoff-netns-loss": (test_loss, 2),
        "handoff-netns-wrong-key": (test_wrong_key, 3),
        "handoff-netns-backpressure": (test_backpressure, 2),
        "handoff-netns-pipelined": (test_pipelined, 2),
    }
    fn, n = tests[test]
    with tempfile.TemporaryDirectory() as tmp:
        keys = None
        if test == "handoff-netns-wrong-key":
            good = key_file(tmp, "good", "1f" * 32)
            keys = [good, good, key_file(tmp, "bad", "2e" * 32)]
        if test == "handoff-netns-backpressure":
            # A longer heartbeat: lossy intervals must not take the peer down.
            cl = Cluster(build, tmp, n, keys, heartbeat_s=10.0, extra=BP_CONF)
        elif test == "handoff-netns-pipelined":
            cl = Cluster(build, tmp, n, keys, arena_mb=(64, 16), extra=PIPE_CONF)
        else:
            cl = Cluster(build, tmp, n, keys)
        try:
            fn(cl)
        except BaseException:
            for i, name in enumerate(cl.names):
                p = os.path.join(tmp, f"{name}.log")
                if os.path.exists(p):
                    print(f"--- {name}.log (tail)")
                    print("".join(open(p).readlines()[-20:]))
            raise
        finally:
            cl.close()
    print("PASS", test)
    return 0


if __name__ == "__main__":
    sys.exit(main())
