#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Membership in etcd, the cluster-wide block directory and prefix-aware placement, with
a real etcd (Debian's etcd-server) and epdd hosts in network namespaces joined by one
bridge (as in test-peer-netns.py). etcd runs in the bridge's namespace, on an address of
the bridge itself; the test starts it on a free port in its own temporary directory and
stops it. No host lists another in a [Peer:] section: they find each other in etcd.

    test-cluster-etcd.py TEST BUILD_ROOT [SOURCE_ROOT]

cluster-etcd-eight: 8 epdd and one etcd: all 8 see each other (membership and
  authenticated sessions) within 2 s of the last start; a handoff between every ordered
  pair succeeds with exact bytes; a prefix published on one host is found by a lookup
  on another (through the owners of its blocks, which are other hosts), and a handoff of
  exactly those pages to that host's decode worker succeeds; the bus objects match
  dbus/org.epd1.Cluster.xml and dbus/org.epd1.Placement.xml.
cluster-etcd-tls: 3 epdd and etcd on https with client certificates required: two
  members with the CA and a client certificate form the cluster; one without a client
  certificate is refused by etcd, says so (degraded) and serves alone.
cluster-etcd-faults: 4 epdd: kill -9 one during a handoff with it: the live side rolls
  back within the heartbeat bound and holds nothing afterwards, every member drops it
  within lease TTL + heartbeat bound, lookups of its shards go to the new owners, and
  it rejoins when restarted; etcd stopped: serving continues (a handoff succeeds) on
  the last membership, visibly degraded; etcd restarted: membership recovers with no
  duplicate member; records forged in etcd (a member's address rewritten, a host that
  does not exist) are refused and never dialed; a member with a wrong cluster key has
  its record refused, and nothing is written to it.
cluster-etcd-hang: 3 epdd, one of them reaching etcd first through an endpoint that hangs
  (connections kept open, nothing answered): its lease never lapses (keepalives move to
  the next endpoint within the TTL) and its watch moves on too (a member killed then
  leaves its view within lease TTL + heartbeat bound); another's watch alone follows an
  endpoint that hangs (its session uses the next one): the watch moves on as well. Then
  one host's only endpoint answers 503 after its watch had worked: its reads back off
  (at most 10 range reads in 5 s; every 100 ms before).
cluster-etcd-junk: 3 epdd; more under the members' prefix than one answer of etcd holds
  (16 MiB: 14,000 junk keys of 1 KiB and 12 values of 1 MB, sorting before every
  member): a host started then reads it all in pages, is up and sees the others, and
  sees a member that is killed leave.

Needs root (ip netns) and etcd; exits 77 (skip) without them."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, file):
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, file))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


peer_netns = _load("peer_netns", "test-peer-netns.py")
handoff_netns = _load("handoff_netns", "test-handoff-netns.py")
Net, sh, key_file, wait_until, skip = (peer_netns.Net, peer_netns.sh, peer_netns.key_file, peer_netns.wait_until,
                                       peer_netns.skip)
Client = handoff_netns.Client

HEARTBEAT_S = 1.0
LEASE_TTL_S = 2
# A dead peer is noticed within the heartbeat (checked every quarter of it); slack for
# polling through epdctl on this small shared machine.
BOUND_S = HEARTBEAT_S * 1.25 + 1.25
CONVERGE_S = 2.0
CLUSTER_SIGNAL = "/org/epd1/cluster org.epd1.Cluster"
PROPS_SIGNAL = "/org/epd1/cluster org.freedesktop.DBus.Properties PropertiesChanged"


def cluster_changed(line, prop):
    """Whether `line` (from epd-signals) is a PropertiesChanged of org.epd1.Cluster that
    carries prop ("Name=value"), among the others coalesced with it."""
    head = f"{PROPS_SIGNAL} org.epd1.Cluster "
    return line.startswith(head) and prop in line[len(head):].split(" ")
SRC = None


def rid(n):
    return f"{n:032x}"


def make_tls(tmp, ip):
    """A CA, a server certificate for ip and a client certificate (openssl)."""
    d = os.path.join(tmp, "tls")
    os.makedirs(d)

    def ossl(*args):
        subprocess.run(["openssl"] + list(args), cwd=d, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
         "-subj", "/CN=epd-test-ca")
    # etcd's JSON gateway dials etcd's own gRPC server with the server certificate: it
    # needs clientAuth too, or every gateway call fails (503 "connection closed").
    for name, ext in (("server", f"subjectAltName=IP:{ip}\nextendedKeyUsage=serverAuth,clientAuth"),
                      ("client", "extendedKeyUsage=clientAuth")):
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext + "\n")
        ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
             f"/CN=epd-test-{name}")
        ossl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext")
    for f in os.listdir(d):
        os.chmod(os.path.join(d, f), 0o600)
    return {k: os.path.join(d, v) for k, v in (("ca", "ca.pem"), ("cert", "client.pem"), ("key", "client.key"),
                                                ("server_cert", "server.pem"), ("server_key", "server.key"))}


# Etcd.fill(): as many puts per transaction as etcd takes (128 operations, 1.5 MiB).
FILL = """
import base64, json, sys, urllib.request
url, prefix, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
per = max(1, min(128, (1 << 20) // (size + 64)))
val = base64.b64encode(b"j" * size).decode()
for s in range(0, n, per):
    ops = [{"request_put": {"key": base64.b64encode(f"{prefix}{i:06d}".encode()).decode(), "value": val}}
           for i in range(s, min(n, s + per))]
    req = urllib.request.Request(url + "/v3/kv/txn", json.dumps({"success": ops}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read()).get("succeeded"), "txn failed"
"""


class Etcd:
    """etcd in the bridge's namespace, on the bridge's own address; with tls, on https
    with client certificates required."""

    def __init__(self, net, tmp, tls=False):
        self.net, self.tmp = net, tmp
        self.ip = f"10.{net.subnet}.0.254"
        sh("ip", "-n", net.bridge, "addr", "add", f"{self.ip}/24", "dev", "br0")
        sh("ip", "-n", net.bridge, "link", "set", "lo", "up")
        self.port = 20000 + os.getpid() % 20000
        self.tls = make_tls(tmp, self.ip) if tls else None
        self.url = f"{'https' if tls else 'http'}://{self.ip}:{self.port}"
        self.data = os.path.join(tmp, "etcd.data")
        self.proc = None

    def start(self):
        log = open(os.path.join(self.tmp, "etcd.log"), "a")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.net.bridge, "etcd", "--name", "epdtest", "--data-dir", self.data,
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", f"http://127.0.0.1:{self.port + 1}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.port + 1}",
             "--initial-cluster", f"epdtest=http://127.0.0.1:{self.port + 1}",
             "--heartbeat-interval", "100", "--election-timeout", "1000", "--log-level", "warn"] +
            (["--cert-file", self.tls["server_cert"], "--key-file", self.tls["server_key"], "--client-cert-auth",
              "--trusted-ca-file", self.tls["ca"]] if self.tls else []),
            stdout=log, stderr=log)
        log.close()
        wait_until(self.healthy, 20, "etcd up")

    def ctl(self, *args):
        tls = ["--cacert", self.tls["ca"], "--cert", self.tls["cert"], "--key", self.tls["key"]] if self.tls else []
        return subprocess.run(["ip", "netns", "exec", self.net.bridge, "etcdctl", "--endpoints", self.url] + tls +
                              list(args),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=dict(os.environ, ETCDCTL_API="3"))

    def fill(self, prefix, n, size):
        """n keys prefix000000.. with values of size bytes, by transactions through the JSON
        gateway (one process: etcdctl would be one per transaction)."""
        r = subprocess.run(["ip", "netns", "exec", self.net.bridge, sys.executable, "-c", FILL, self.url, prefix,
                            str(n), str(size)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert r.returncode == 0, r.stdout

    def healthy(self):
        return self.ctl("endpoint", "health").returncode == 0

    def keys(self):
        r = self.ctl("get", "--prefix", "--keys-only", "/epd/")
        return [k for k in r.stdout.split() if k]

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


UNAVAILABLE_SERVER = r"""
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"error":"etcdserver: no leader","code":14,"message":"etcdserver: no leader"}'
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        with open(sys.argv[2], "a") as f:
            f.write(self.path + "\n")
    def log_message(self, *a):
        pass
http.server.HTTPServer((sys.argv[1], int(sys.argv[3])), H).serve_forever()
"""


class Unavailable:
    """An etcd endpoint that answers every call with 503 (a member without a leader, a
    learner, a gateway that cannot reach its member), in the bridge's namespace."""

    def __init__(self, cl):
        self.log = os.path.join(cl.tmp, "unavailable.calls")
        port = cl.etcd.port + 2
        self.url = f"http://{cl.etcd.ip}:{port}"
        self.proc = subprocess.Popen(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c",
                                      UNAVAILABLE_SERVER, cl.etcd.ip, self.log, str(port)])
        cl.clients.append(self.proc)
        probe = f"import socket; socket.create_connection(({cl.etcd.ip!r}, {port}), 1).close()"
        wait_until(lambda: subprocess.run(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c", probe],
                                          stderr=subprocess.DEVNULL).returncode == 0, 10, "the 503 endpoint up")

    def calls(self):
        with open(self.log) as f:
            return [line.strip() for line in f if line.strip()]


FREEZABLE_PROXY = r"""
import signal, socket, sys, threading
# A TCP relay to etcd that, on SIGUSR1, stops moving bytes either way while keeping every
# connection open (the kernel still acknowledges, keepalives included): an etcd member
# hung on a stalled disk, or stopped, as its clients see it.
frozen = threading.Event()
signal.signal(signal.SIGUSR1, lambda *a: frozen.set())
def pump(a, b):
    try:
        while True:
            d = a.recv(65536)
            if not d:
                break
            while frozen.is_set():
                frozen.wait(3600)
            b.sendall(d)
    except OSError:
        pass
    try:
        b.shutdown(socket.SHUT_WR)  # the other side's end goes on: nothing held open
    except OSError:
        pass
def serve(c):
    if frozen.is_set():
        return  # accepted and held: never answered
    if len(sys.argv) > 5 and sys.argv[5] == "lease503":
        # Lease calls refused (503, as a member without a leader): a session goes on to
        # the next endpoint, a watch stays here.
        head = b""
        while b"\r\n" not in head:
            head = c.recv(512, socket.MSG_PEEK)
            if not head:
                c.close()
                return
        if head.startswith(b"POST /v3/lease"):
            c.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            c.shutdown(socket.SHUT_WR)
            return
    try:
        u = socket.create_connection((sys.argv[3], int(sys.argv[4])))
    except OSError:
        c.close()
        return
    threading.Thread(target=pump, args=(c, u), daemon=True).start()
    threading.Thread(target=pump, args=(u, c), daemon=True).start()
held = []
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(64)
while True:
    c, _ = s.accept()
    held.append(c)
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


class Freezable:
    """An endpoint relaying to etcd until freeze(): then it keeps every connection open
    and answers nothing (a hung member), in the bridge's namespace."""

    def __init__(self, cl, port_offset=3, lease503=False):
        port = cl.etcd.port + port_offset
        self.url = f"http://{cl.etcd.ip}:{port}"
        self.proc = subprocess.Popen(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c", FREEZABLE_PROXY,
                                      cl.etcd.ip, str(port), cl.etcd.ip, str(cl.etcd.port)] +
                                     (["lease503"] if lease503 else []))
        cl.clients.append(self.proc)
        probe = f"import socket; socket.create_connection(({cl.etcd.ip!r}, {port}), 1).close()"
        wait_until(lambda: subprocess.run(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c", probe],
                                          stderr=subprocess.DEVNULL).returncode == 0, 10, "the relay up")

    def freeze(self):
        self.proc.send_signal(signal.SIGUSR1)


REFUSING_PROXY = r"""
import signal, socket, sys, threading
# A TCP relay to etcd that, on SIGUSR1, ends every connection it relays and answers every
# request from then on with 503 (a member without a leader: etcd unavailable), writing
# each request's path to a file: what epdd asks of etcd during an outage.
refusing = threading.Event()
lock = threading.Lock()
conns = []
def refuse(*a):
    refusing.set()
    with lock:
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
signal.signal(signal.SIGUSR1, refuse)
def pump(a, b):
    try:
        while True:
            d = a.recv(65536)
            if not d:
                break
            b.sendall(d)
    except OSError:
        pass
    try:
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
def answer(c):
    try:
        data = b""
        while b"\r\n\r\n" not in data:
            d = c.recv(65536)
            if not d:
                return
            data += d
        head, body = data.split(b"\r\n\r\n", 1)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v.strip())
        while len(body) < length:
            d = c.recv(65536)
            if not d:
                break
            body += d
        with open(sys.argv[5], "a") as f:
            f.write(head.split(b" ")[1].decode() + "\n")
        msg = b'{"error":"etcdserver: no leader","code":14,"message":"etcdserver: no leader"}'
        c.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: " +
                  str(len(msg)).encode() + b"\r\nConnection: close\r\n\r\n" + msg)
        c.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        c.close()
def serve(c):
    if refusing.is_set():
        answer(c)
        return
    try:
        u = socket.create_connection((sys.argv[3], int(sys.argv[4])))
    except OSError:
        c.close()
        return
    with lock:
        conns.extend((c, u))
    threading.Thread(target=pump, args=(c, u), daemon=True).start()
    threading.Thread(target=pump, args=(u, c), daemon=True).start()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(64)
while True:
    c, _ = s.accept()
    threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


class Refusing:
    """An endpoint relaying to etcd until refuse(): then it ends every connection and
    answers 503 to everything (etcd unavailable), noting each request's path."""

    def __init__(self, cl, port_offset=5):
        port = cl.etcd.port + port_offset
        self.url = f"http://{cl.etcd.ip}:{port}"
        self.log = os.path.join(cl.tmp, f"refusing-{port}.calls")
        self.proc = subprocess.Popen(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c", REFUSING_PROXY,
                                      cl.etcd.ip, str(port), cl.etcd.ip, str(cl.etcd.port), self.log])
        cl.clients.append(self.proc)
        probe = f"import socket; socket.create_connection(({cl.etcd.ip!r}, {port}), 1).close()"
        wait_until(lambda: subprocess.run(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c", probe],
                                          stderr=subprocess.DEVNULL).returncode == 0, 10, "the relay up")

    def refuse(self):
        self.proc.send_signal(signal.SIGUSR1)

    def calls(self):
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [line.strip() for line in f if line.strip()]


TRAP = r"""
import socket, sys
# Where a forged member record points: every connection that reaches it is noted.
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(64)
while True:
    c, a = s.accept()
    with open(sys.argv[3], "a") as f:
        f.write(a[0] + "\n")
    c.close()
"""


class Trap:
    """A listener in the bridge's namespace that notes every connection it gets."""

    def __init__(self, cl, port_offset=6):
        port = cl.etcd.port + port_offset
        self.addr = f"{cl.etcd.ip}:{port}"
        self.log = os.path.join(cl.tmp, f"trap-{port}.hits")
        self.proc = subprocess.Popen(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c", TRAP, cl.etcd.ip,
                                      str(port), self.log])
        cl.clients.append(self.proc)
        probe = f"import socket; socket.create_connection(({cl.etcd.ip!r}, {port}), 1).close()"
        wait_until(lambda: subprocess.run(["ip", "netns", "exec", cl.net.bridge, sys.executable, "-c", probe],
                                          stderr=subprocess.DEVNULL).returncode == 0, 10, "the trap up")
        wait_until(lambda: os.path.exists(self.log), 5, "the trap's probe noted")
        os.unlink(self.log)  # the probe's

    def hits(self):
        if not os.path.exists(self.log):
            return []
        with open(self.log) as f:
            return [line.strip() for line in f if line.strip()]


class EtcdCluster:
    def __init__(self, build, tmp, n, tls=False):
        self.build, self.tmp, self.n = os.path.abspath(build), tmp, n
        self.epdd = os.path.join(build, "daemon", "epdd")
        self.epdctl = os.path.join(build, "tools", "epdctl")
        self.client = os.path.join(build, "tests", "integration", "handoff-client")
        self.names = [f"h{i}" for i in range(n)]
        self.key = key_file(tmp, "key", "e" * 64)
        self.keys = [self.key] * n
        self.procs = {}
        self.clients = []
        self.extra = {}  # host index -> more [Cluster] lines (benchmarks)
        self.no_client_cert = set()  # hosts that offer etcd no client certificate
        self.net = Net(n)
        try:
            self.etcd = Etcd(self.net, tmp, tls)
        except Exception:
            self.net.close()
            raise

    def conf(self, i):
        p = os.path.join(self.tmp, f"{self.names[i]}.conf")
        with open(p, "w") as f:
            f.write(f"[Daemon]\nHostId={self.names[i]}\nSystemBus=no\n"
                    f"StateDirectory={self.tmp}/{self.names[i]}.state\n"
                    f"[Arena:kv0]\nSize=16M\n"
                    f"[Cluster]\nListen={self.net.ip(i)}:7500\nClusterKeyFile={self.keys[i]}\n"
                    f"HeartbeatInterval={int(HEARTBEAT_S * 1000)}ms\n"
                    f"Etcd={self.etcd.url}\nEtcdLeaseTTL={LEASE_TTL_S}s\n" + self.tls_conf(i) + self.extra.get(i, ""))
        return p

    def tls_conf(self, i):
        t = self.etcd.tls
        if not t:
            return ""
        if i in self.no_client_cert:
            return f"EtcdCAFile={t['ca']}\n"
        return f"EtcdCAFile={t['ca']}\nEtcdCertFile={t['cert']}\nEtcdKeyFile={t['key']}\n"

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

    def kill(self, i, sig=signal.SIGKILL):
        self.procs[i].send_signal(sig)
        self.procs[i].wait()

    def ctl(self, i, *what):
        r = subprocess.run([self.epdctl, "-A", self.addr(i), "--json"] + list(what), stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True)
        return json.loads(r.stdout) if r.returncode == 0 and r.stdout.strip() else None

    def cluster(self, i):
        return self.ctl(i, "cluster")

    def sees(self, i, others):
        """Host i has every other host as a member alive in etcd and a session up."""
        c = self.cluster(i)
        if not c:
            return False
        m = {x["host_id"]: x for x in c["members"]}
        return all(self.names[j] in m and m[self.names[j]]["lease"] == "alive" and m[self.names[j]]["session"] == "up"
                   for j in others)

    def mesh(self, hosts):
        return all(self.sees(i, [j for j in hosts if j != i]) for i in hosts)

    def clean(self, i):
        pages, hand = self.ctl(i, "pages"), self.ctl(i, "handoffs")
        if pages is None or hand is None:
            return False
        for p in pages["pools"]:
            if p["leased"] or p["live"]:
                return False
        c = hand["counters"]
        return not hand["handoffs"] and c["live"] == 0 and c["writes-in-flight"] == 0

    def spawn(self, args, env=None, stdin=False):
        c = Client([self.client] + [str(a) for a in args]) if not stdin else StdinClient(
            [self.client] + [str(a) for a in args], env)
        self.clients.append(c)
        return c

    def decode(self, i, r, timeout_ms=20000):
        d = self.spawn(["decode", self.addr(i), r, timeout_ms])
        assert d.wait_line("registered", 30), ("decode worker did not register", d.lines)
        return d

    def prefill(self, i, dest, r, pages, groups=2, delay_ms=0, timeout_ms=20000):
        # The environment is passed, never set in os.environ: benchmarks spawn from threads.
        return self.spawn(["prefill", self.addr(i), "kv0", dest, r, pages, groups, delay_ms, timeout_ms],
                          env={"HANDOFF_CLIENT_RETRY_BACKPRESSURE": "1"}, stdin=True)

    def signals(self, i, seconds=120):
        """epd-signals on host i's socket: a line per signal its clients receive."""
        c = Client([os.path.join(self.build, "tests", "integration", "epd-signals"), self.sock(i), str(seconds)])
        self.clients.append(c)
        assert c.wait_line("ready", 10), c.lines
        return c

    def locate(self, i, hashes):
        return self.ctl(i, "placement", *[str(h) for h in hashes])

    def counters(self, i):
        """The directory forwarding's counters (org.epd1.Placement.Counters)."""
        return self.cluster(i)["directory"]

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
        self.etcd.stop()
        self.net.close()


class StdinClient(Client):
    """A handoff-client with stdin (the publishing prefill waits for "go")."""

    def __init__(self, argv, env):
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, bufsize=1, env=dict(os.environ, **(env or {})))
        self.lines, self.buf, self.eof = [], "", False

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()


def committed(pre, dec, label, n_groups=2):
    rp, rd = pre.finish(), dec.finish()
    groups = [l for l in dec.lines if l.startswith("group ")]
    assert rd == 0 and rp == 0, (label, rp, pre.lines, rd, dec.lines)
    assert groups == [f"group {g} ok" for g in range(n_groups)], (label, dec.lines)
    assert dec.final()[1] == "committed" and pre.final()[1] == "committed", (label, pre.lines, dec.lines)


def check_contract(cl, i, path, iface, xml):
    introspect = os.path.join(cl.build, "tests", "integration", "epd-introspect")
    live = subprocess.run([introspect, cl.sock(i), path], stdout=subprocess.PIPE, text=True).stdout
    with open(os.path.join(SRC, "dbus", xml)) as f:
        want = f.read()

    def part(x):
        a = x.index(f'<interface name="{iface}">')
        return x[a:x.index("</interface>", a)]
    assert part(live) == part(want), f"{iface} introspection differs from dbus/{xml}"


def start_all(cl, hosts):
    """Starts the hosts one after the other; returns the seconds from the last start
    (its direct socket serving) until every member sees every other, and from the first."""
    t_first = time.monotonic()
    for i in hosts:
        cl.start(i)
    t_last = time.monotonic()
    wait_until(lambda: cl.mesh(hosts), 30, "all members see each other")
    t = time.monotonic()
    return t - t_last, t - t_first


def publish_prefix(cl, i, base, pages, name, dest):
    """A prefill worker on host i fills `pages` pages, publishes them as the chain base..,
    and waits (for "go") before handing them off to dest."""
    p = cl.spawn(["prefill", cl.addr(i), "kv0", dest, rid(base), pages, 2, 0, 20000],
                 env={"HANDOFF_CLIENT_PUBLISH": str(base), "HANDOFF_CLIENT_NAME": name}, stdin=True)
    assert p.wait_line("published", 30) == f"published {pages}", p.lines
    return p


def check_views(cl, i):
    """epdctl peers (text and JSON) and epdtop --json on host i show where membership
    comes from, each member's lease and its share of the hash space."""
    ps = cl.ctl(i, "peers")
    assert len(ps) == cl.n - 1 and all(p["source"] == "etcd" and p["lease"] == "alive" and p["share_permille"] > 0
                                       for p in ps), ps
    text = subprocess.run([cl.epdctl, "-A", cl.addr(i), "peers"], stdout=subprocess.PIPE, text=True,
                          check=True).stdout
    assert text.startswith("Membership: etcd (up: registered at ") and " SOURCE " in text and " SHARE" in text, text
    assert sum(1 for l in text.splitlines() if " etcd " in l and " alive " in l) == cl.n - 1, text
    epdtop = os.path.join(cl.build, "tools", "epdtop")
    if not os.path.exists(epdtop):
        print("epdtop not built (no ncursesw): its membership view is not checked")
        return
    top = subprocess.run([epdtop, "-A", cl.addr(i), "--json", "-n", "1"],
                         stdout=subprocess.PIPE, text=True, check=True).stdout
    top = json.loads(top.splitlines()[0])
    assert top["membership"] == f"etcd up, {cl.n - 1} alive", top.get("membership")
    assert len(top["peers"]) == cl.n - 1 and all(p["lease"] == "alive" and p["share_permille"] > 0
                                                for p in top["peers"]), top["peers"]


def test_eight(cl):
    n = cl.n
    cl.etcd.start()
    # The last host lists first an endpoint that answers 503 to everything: it goes on
    # to the next one instead of staying with the one that answered.
    bad = Unavailable(cl)
    cl.extra[n - 1] = f"Etcd={bad.url} {cl.etcd.url}\n"
    took, total = start_all(cl, range(n))
    print(f"8 hosts: every member sees every other (etcd and sessions) {took:.2f}s after the last start, "
          f"{total:.2f}s after the first")
    assert took <= CONVERGE_S, f"convergence took {took:.2f}s > {CONVERGE_S}s"
    # Nobody put its key twice at its start: the watch's first read, taken before the
    # session's put and applied after it, was taken for the key lost.
    for name in cl.names:
        with open(os.path.join(cl.tmp, f"{name}.log")) as f:
            assert "registering again" not in f.read(), f"{name} registered again at its start"
    c0 = cl.cluster(0)
    assert c0["source"] == "etcd" and c0["etcd_state"] == "up" and c0["members_alive"] == n - 1, c0
    assert sorted(cl.etcd.keys()) == sorted(f"/epd/members/{h}" for h in cl.names), cl.etcd.keys()
    c7 = cl.cluster(n - 1)
    assert c7["etcd_state"] == "up" and c7["etcd_reason"].startswith(f"registered at {cl.etcd.url}"), c7
    assert bad.calls(), "the 503 endpoint was never asked"
    print(f"{cl.names[n - 1]}: past an endpoint answering 503 ({len(bad.calls())} calls): {c7['etcd_reason']}")
    # Shares of the hash space: every live member owns some, and they add up.
    shares = [m["share_permille"] for m in c0["members"]]
    assert all(s > 0 for s in shares) and abs(sum(shares) - 1000) <= 1, shares
    check_views(cl, 0)
    check_contract(cl, 0, "/org/epd1/cluster", "org.epd1.Cluster", "org.epd1.Cluster.xml")
    check_contract(cl, 0, "/org/epd1/placement", "org.epd1.Placement", "org.epd1.Placement.xml")

    # A handoff between every ordered pair: 7 rounds, each host sending to one and
    # receiving from another at once.
    t0 = time.monotonic()
    k = 0
    for shift in range(1, n):
        pairs = [(i, (i + shift) % n) for i in range(n)]
        decs = [cl.decode(j, rid(1000 + k + x)) for x, (i, j) in enumerate(pairs)]
        pres = [cl.prefill(i, cl.names[j], rid(1000 + k + x), 8) for x, (i, j) in enumerate(pairs)]
        for x, (i, j) in enumerate(pairs):
            committed(pres[x], decs[x], f"{cl.names[i]}->{cl.names[j]}")
        k += len(pairs)
    print(f"{k} handoffs between every ordered pair: {time.monotonic() - t0:.1f}s, all committed, bytes exact")

    # A prefix published on h1 is found from h5 through the owners of its blocks.
    base, pages = 0x5eed0000, 16
    owners = set()
    pre = publish_prefix(cl, 1, base, pages, "prefill-h1", "h5")
    hashes = [base + b for b in range(pages)]
    wait_until(lambda: (cl.locate(5, hashes) or {}).get("n_blocks") == pages, 5, "prefix located from h5")
    loc = cl.locate(5, hashes)
    print("located from h5:", loc)
    text = subprocess.run([cl.epdctl, "-A", cl.addr(5), "placement"] + [str(h) for h in hashes],
                          stdout=subprocess.PIPE, text=True, check=True).stdout
    assert text.startswith(f"Best: h1, arena kv0, worker prefill-h1: {pages} of {pages} blocks cached\n"), text
    assert loc["host"] == "h1" and loc["arena"] == "kv0" and loc["worker"] == "prefill-h1", loc
    assert loc["owners_missing"] == 0, loc
    # The records live with the owners: h1 published to others than itself and h5 asked others.
    c1 = cl.cluster(1)
    owners = {m["host_id"] for m in c1["members"] if m["published_here"] > 0}
    assert owners - {"h1", "h5"}, f"every block owned by h1 or h5: {owners}"
    cnt = cl.counters(5)
    assert cnt["remote-queries"] > 0 and cnt["remote-answers"] > 0, cnt
    # A shorter chain that diverges: the prefix up to the divergence.
    loc = cl.locate(5, hashes[:5] + [0xdead] + hashes[6:])
    assert loc["host"] == "h1" and loc["n_blocks"] == 5, loc
    # Nobody has it.
    loc = cl.locate(5, [0xbad0, 0xbad1])
    assert loc["n_blocks"] == 0 and loc["candidates"] == [], loc
    # A handoff of exactly those pages from h1 to h5's decode worker.
    dec = cl.decode(5, rid(base))
    pre.go()
    committed(pre, dec, "h1->h5 located prefix")
    print("handoff of the located prefix h1 -> h5: committed, bytes exact")
    for i in range(n):
        wait_until(lambda i=i: cl.clean(i), 5, f"{cl.names[i]} clean")


def lease_of(cl, host):
    r = cl.etcd.ctl("get", f"/epd/members/{host}", "-w", "json")
    kvs = json.loads(r.stdout).get("kvs") or [] if r.returncode == 0 else []
    return kvs[0].get("lease") if kvs else None


def test_hang(cl):
    n = cl.n
    cl.etcd.start()
    # h0 reaches etcd first through a relay that will hang (connections open, nothing
    # answered), then directly: its keepalives and its watch must move on in time.
    relay = Freezable(cl)
    cl.extra[0] = f"Etcd={relay.url} {cl.etcd.url}\n"
    # h1's first endpoint refuses lease calls: its session goes on to the second, its
    # watch stays on the first, which then hangs where the session never looks.
    relay_w = Freezable(cl, port_offset=4, lease503=True)
    cl.extra[1] = f"Etcd={relay_w.url} {cl.etcd.url}\n"
    start_all(cl, range(n))
    c0 = cl.cluster(0)
    assert c0["etcd_state"] == "up" and c0["etcd_reason"].startswith(f"registered at {relay.url}"), c0
    c1 = cl.cluster(1)
    assert c1["etcd_state"] == "up" and c1["etcd_reason"].startswith(f"registered at {cl.etcd.url}"), c1
    lease = lease_of(cl, "h0")
    assert lease, "h0 has no lease in etcd"
    sig = cl.signals(1)
    mark = len(sig.lines)
    relay.freeze()
    relay_w.freeze()
    # Its lease never lapses: the keepalive gives the hung endpoint a third of the TTL and
    # goes on to the next within the lease's life, so nobody sees h0 leave or come back.
    time.sleep(LEASE_TTL_S * 2 + 1)
    assert lease_of(cl, "h0") == lease, "h0's lease lapsed: it registered again"
    with open(os.path.join(cl.tmp, "h0.log")) as f:
        log = f.read()
    assert "expired in etcd" not in log, log[-2000:]
    assert "stopped answering" in log, log[-2000:]
    # h0's own keepalive found the endpoint hung and ended its watch there (no probe).
    assert "which the watch follows" not in log, log[-2000:]
    assert (cl.cluster(0) or {}).get("etcd_reason", "").startswith(f"registered at {cl.etcd.url}"), cl.cluster(0)
    # h1's session finds its watch's endpoint hung with the status probe after an
    # answered keepalive: within a few keepalives, later on a loaded machine (a CI run
    # under ASan beside other tests once took more than the 5 s above): waited for, up
    # to 10 s more.
    deadline = time.monotonic() + 10
    while True:
        with open(os.path.join(cl.tmp, "h1.log")) as f:
            log = f.read()
        if "stopped answering" in log or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert "stopped answering" in log, log[-2000:]
    assert not any(" MemberChanged h0 " in l for l in sig.lines[mark:]), sig.lines[mark:]
    assert (cl.cluster(0) or {}).get("etcd_state") == "up", cl.cluster(0)
    # Its watch moved on too: a member that dies now is dropped from h0's view within the
    # lease TTL and the heartbeat bound, as everywhere else.
    t0 = time.monotonic()
    cl.kill(n - 1)

    def dropped(i):
        c = cl.cluster(i)
        m = {x["host_id"]: x for x in c["members"]} if c else {}
        return cl.names[n - 1] in m and m[cl.names[n - 1]]["lease"] == "left"
    wait_until(lambda: dropped(0) and dropped(1), LEASE_TTL_S + BOUND_S + 1,
               f"{cl.names[n - 1]} left the views of h0 and h1")
    print(f"{cl.names[n - 1]} left the views of h0 and h1 {time.monotonic() - t0:.2f}s after kill -9, etcd reached "
          f"past the hung endpoints")
    sig.kill()
    # A stop while etcd hangs (every endpoint) is not held up by a keepalive waiting on
    # it: h1 again with a 6 s lease (keepalives every 2 s, each call given until 5.4 s
    # after the last answered one), etcd stopped mid-keepalive, then SIGTERM: the call
    # ends at once and only the lease revoke's half second is left.
    cl.kill(1, signal.SIGTERM)
    cl.extra[1] += "EtcdLeaseTTL=6s\n"
    cl.start(1)
    wait_until(lambda: (cl.cluster(1) or {}).get("etcd_state") == "up", 10, "h1 up again")
    time.sleep(2.5)  # one keepalive answered since
    os.kill(cl.etcd.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # the next keepalive began 0.5 to 2.5 s ago: 1.4 s or more of it left
        t0 = time.monotonic()
        cl.kill(1, signal.SIGTERM)
        took = time.monotonic() - t0
    finally:
        os.kill(cl.etcd.proc.pid, signal.SIGCONT)
    print(f"h1 stopped {took:.2f}s after SIGTERM with etcd hung mid-keepalive")
    assert cl.procs[1].returncode == 0, cl.procs[1].returncode
    assert took < 1.2, f"h1 took {took:.2f}s to stop: a keepalive on the hung etcd held it"
    watch_backoff(cl)


def watch_backoff(cl):
    """etcd unavailable after the watch had worked: the watch's reads back off (100 ms
    doubling to 2 s) as they do when etcd was never reached. They went on every 100 ms
    (the stream of an earlier attempt taken for one of this attempt): every epdd read
    everything under the prefix ten times a second for as long as etcd was away."""
    relay = Refusing(cl)
    cl.extra[1] = f"Etcd={relay.url}\n"
    cl.start(1)
    wait_until(lambda: (cl.cluster(1) or {}).get("etcd_state") == "up", 10, "h1 up through the relay")
    before = len(relay.calls())
    relay.refuse()
    time.sleep(5.0)
    reads = [c for c in relay.calls()[before:] if c == "/v3/kv/range"]
    print(f"etcd unavailable after a working watch: {len(reads)} range reads in 5 s (backoff 100 ms doubling to 2 s: "
          f"5 or 6)")
    assert 2 <= len(reads) <= 10, f"{len(reads)} range reads in 5 s: the watch does not back off"
    wait_until(lambda: (cl.cluster(1) or {}).get("etcd_state") == "degraded", 5, "h1 degraded")


def test_faults(cl):
    n = cl.n
    cl.etcd.start()
    start_all(cl, range(n))
    c = cl.cluster(0)
    assert c["etcd_state"] == "up", c

    # Another tool's key under the prefix, longer than any member record: nobody reads
    # it (members/ only), so it cannot stop the watches (before, a value over 4 KiB failed
    # every resync and watch message: membership froze, degraded, on every host).
    r = cl.etcd.ctl("put", "/epd/config", "x" * 5000)
    assert r.returncode == 0, r.stderr
    # A member's key overwritten with what is not a record: that member re-registers
    # (its own watch sees the key lost), and every view ends the same.
    r = cl.etcd.ctl("put", "/epd/members/h2", "not a record")
    assert r.returncode == 0, r.stderr

    def h2_valid():
        g = cl.etcd.ctl("get", "/epd/members/h2", "--print-value-only")
        try:
            return g.returncode == 0 and json.loads(g.stdout)["host_id"] == "h2"
        except ValueError:
            return False
    wait_until(h2_valid, 10, "h2 registered again over the invalid record")
    wait_until(lambda: cl.mesh(range(n)), 15, "every member sees the others after the invalid record")
    assert all((cl.cluster(i) or {}).get("etcd_state") == "up" for i in range(n))
    assert cl.etcd.ctl("del", "/epd/config").returncode == 0
    forged_records(cl)

    # A prefix on h1 whose records are spread over the owners (h3 among them).
    base, pages = 0x77770000, 24
    hashes = [base + b for b in range(pages)]
    pre = publish_prefix(cl, 1, base, pages, "prefill-h1", "h0")
    pre.kill()  # its pages stay cached in h1's directory (IDLE), as after any request
    wait_until(lambda: (cl.locate(0, hashes) or {}).get("n_blocks") == pages, 5, "prefix located from h0")
    assert any(m["host_id"] == "h3" and m["published_here"] > 0 for m in cl.cluster(1)["members"]), \
        "h3 owns none of the prefix's blocks"

    # A prefix cached on h3 itself, known to every member through the owners.
    base3, pages3 = 0x33330000, 8
    hashes3 = [base3 + b for b in range(pages3)]
    pre3 = publish_prefix(cl, 3, base3, pages3, "prefill-h3", "h0")
    pre3.kill()
    wait_until(lambda: all((cl.locate(i, hashes3) or {}).get("host") == "h3" and
                           cl.locate(i, hashes3)["n_blocks"] == pages3 for i in (0, 1, 2)), 5, "h3's prefix located")

    # An owner that stops answering (SIGSTOP: its session stays up until the heartbeat
    # bound) counts once in owners_missing, however many LOOKUP parts (512 hashes at
    # most each) it was sent: 6000 hashes give each of the four owners about 1500.
    many = [0x5e5e0000 + b for b in range(6000)]
    cl.procs[1].send_signal(signal.SIGSTOP)
    try:
        loc = cl.locate(0, many)
    finally:
        cl.procs[1].send_signal(signal.SIGCONT)
    assert loc and loc["owners_missing"] == 1, loc
    wait_until(lambda: cl.mesh(range(n)), 15, "h1 back in the mesh")

    # What h0's clients are told: MemberChanged, and EtcdState as it changes.
    sig = cl.signals(0)

    # kill -9 h3 in the middle of a handoff h2 -> h3 and of one h3 -> h0 (groups 600 ms
    # apart): the live side of each rolls back.
    dec = cl.decode(3, rid(300))
    p = cl.prefill(2, "h3", rid(300), 16, groups=4, delay_ms=600)
    dec_in = cl.decode(0, rid(301))
    p_in = cl.prefill(3, "h0", rid(301), 16, groups=4, delay_ms=600)
    assert p.wait_line("ready 0", 20), p.lines
    assert dec_in.wait_line("group 0 ok", 20), (dec_in.lines, p_in.lines)
    assert dec_in.wait_line("final", 0) is None, f"h3 -> h0 ended before the kill: {dec_in.lines}"
    t0 = time.monotonic()
    cl.kill(3)
    rp = p.finish(timeout=20)
    fin = p.final()
    print(f"kill -9 h3: h2's handoff ended {fin} after {time.monotonic() - t0:.2f}s")
    assert rp == 0 and fin and fin[1] == "rolled-back", p.lines
    rd = dec_in.finish(timeout=20)
    fin = dec_in.final()
    print(f"kill -9 h3: h0's incoming handoff ended {fin} after {time.monotonic() - t0:.2f}s")
    assert rd == 0 and fin and fin[1] == "rolled-back", dec_in.lines
    dec.kill()
    p_in.kill()
    wait_until(lambda: cl.clean(2) and cl.clean(0), BOUND_S, "h2 and h0 hold nothing of the handoffs")
    # Every other member drops it: session at once, membership within lease TTL + bound.

    def dropped(i):
        c = cl.cluster(i)
        m = {x["host_id"]: x for x in c["members"]} if c else {}
        return "h3" in m and m["h3"]["lease"] == "left" and m["h3"]["session"] != "up"
    wait_until(lambda: all(dropped(i) for i in (0, 1, 2)), LEASE_TTL_S + BOUND_S + 1, "h3 left everywhere")
    print(f"h3 left every member's view {time.monotonic() - t0:.2f}s after kill -9")
    mark = len(sig.lines)
    left = sig.wait_line(f"{CLUSTER_SIGNAL} MemberChanged h3 left ", 2)
    assert left, sig.lines
    print("h0 was told:", left)
    # Its shards moved: the whole prefix is found again, through the new owners.
    wait_until(lambda: (cl.locate(0, hashes) or {}).get("n_blocks") == pages and
               cl.locate(0, hashes)["owners_missing"] == 0, 5, "prefix located after h3 left")
    assert not any(m["host_id"] == "h3" and m["published_here"] > 0 for m in cl.cluster(1)["members"])
    # h3's own entries went with it: nobody finds its prefix any more.
    for i in (0, 1, 2):
        loc = cl.locate(i, hashes3)
        assert loc["n_blocks"] == 0 and loc["candidates"] == [] and loc["owners_missing"] == 0, (i, loc)
    # It comes back and rejoins.
    t0 = time.monotonic()
    cl.start(3)
    wait_until(lambda: cl.mesh(range(n)), 15, "h3 rejoined")
    print(f"h3 rejoined in {time.monotonic() - t0:.2f}s")
    assert sig.wait_line_from(mark, lambda l: l.startswith(f"{CLUSTER_SIGNAL} MemberChanged h3 joined "), 2), \
        sig.lines
    # A crash-restart within the lease TTL: the new h3's first read of etcd still finds
    # the old one's record (its lease alive). That is not another epdd with its host id:
    # no "host ids must be unique" error (it was logged on such restarts).
    log3 = os.path.join(cl.tmp, f"{cl.names[3]}.log")
    seen = os.path.getsize(log3)
    cl.kill(3)
    cl.start(3)
    wait_until(lambda: cl.mesh(range(n)), 15, "h3 back after a restart within the lease TTL")
    with open(log3) as f:
        f.seek(seen)
        text = f.read()
    assert "must be unique" not in text, text[-2000:]

    # etcd stops: serving continues on the last membership, visibly degraded.
    cl.etcd.stop()
    wait_until(lambda: all((cl.cluster(i) or {}).get("etcd_state") == "degraded" for i in range(n)), 10,
               "degraded everywhere")
    c = cl.cluster(0)
    print("etcd stopped:", c["etcd_state"], c["etcd_reason"])
    mark = len(sig.lines)
    # (PropertiesChanged is coalesced: other properties may ride in the same signal, in
    # the order they changed.)
    assert sig.wait_line_from(mark, lambda l: cluster_changed(l, "EtcdState=degraded"), 2), sig.lines
    for i in range(n):
        with open(os.path.join(cl.tmp, f"{cl.names[i]}.log")) as f:
            assert "etcd unreachable" in f.read(), f"{cl.names[i]} did not log that etcd is unreachable"
    text = subprocess.run([cl.epdctl, "-A", cl.addr(0), "cluster"], stdout=subprocess.PIPE, text=True,
                          check=True).stdout
    assert text.startswith("Membership: etcd (degraded: "), text
    assert c["members_alive"] == n - 1 and cl.mesh(range(n)), c
    dec, p = cl.decode(1, rid(400)), cl.prefill(0, "h1", rid(400), 8)
    committed(p, dec, "h0->h1 with etcd down")
    # etcd restarts (same data): membership recovers, no duplicate members.
    cl.etcd.start()
    wait_until(lambda: all((cl.cluster(i) or {}).get("etcd_state") == "up" for i in range(n)), 15, "etcd up again")
    assert sig.wait_line_from(mark, lambda l: cluster_changed(l, "EtcdState=up"), 2), sig.lines
    # Recovering the membership from etcd told nobody of a member joining or leaving (a
    # member that registered again under a new lease is "updated").
    assert not any(" MemberChanged " in l and (" joined " in l or " left " in l) for l in sig.lines[mark:]), \
        sig.lines[mark:]
    for i in range(n):
        ids = [m["host_id"] for m in cl.cluster(i)["members"]]
        assert len(ids) == len(set(ids)) == n, ids
    assert cl.mesh(range(n))
    assert sorted(cl.etcd.keys()) == sorted(f"/epd/members/{h}" for h in cl.names), cl.etcd.keys()

    # h1's key deleted by hand while its lease lives: h1 puts it again at once, and no
    # member drops it.
    mark = len(sig.lines)
    t0 = time.monotonic()
    r = cl.etcd.ctl("del", "/epd/members/h1")
    assert r.returncode == 0 and r.stdout.strip() == "1", (r.stdout, r.stderr)
    wait_until(lambda: "/epd/members/h1" in cl.etcd.keys(), 5, "h1 registered again after its key was deleted")
    print(f"h1's key deleted: back in etcd after {time.monotonic() - t0:.2f}s")
    with open(os.path.join(cl.tmp, "h1.log")) as f:
        assert "registering again" in f.read(), "h1 did not say why it registered again"
    # etcd loses its data (revisions start over): every host registers again, and no
    # member is dropped past the grace (a resync's records are taken as they are).
    cl.etcd.stop()
    shutil.rmtree(cl.etcd.data)
    cl.etcd.start()
    wait_until(lambda: sorted(cl.etcd.keys()) == sorted(f"/epd/members/{h}" for h in cl.names), 15,
               "every host registered in the empty etcd")
    wait_until(lambda: all((cl.cluster(i) or {}).get("etcd_state") == "up" for i in range(n)), 15,
               "etcd up again after losing its data")
    time.sleep(LEASE_TTL_S + 1.5)  # past the grace of a member missing from a resync
    assert cl.mesh(range(n)), [cl.cluster(i)["members"] for i in range(n)]
    assert not any(" MemberChanged " in l and " left " in l for l in sig.lines[mark:]), sig.lines[mark:]
    print("etcd lost its data: every member stayed")
    sig.kill()

    # A member with a wrong cluster key: registered in etcd, but its record does not verify
    # with the cluster key: listed as refused, never dialed, nothing written.
    cl.kill(n - 1, signal.SIGTERM)  # a clean stop revokes its lease: gone from etcd at once
    wait_until(lambda: f"/epd/members/h{n - 1}" not in cl.etcd.keys(), 5, "clean stop revoked the lease")
    cl.keys[n - 1] = key_file(cl.tmp, "wrong", "2e" * 32)
    cl.start(n - 1)
    wait_until(lambda: f"/epd/members/h{n - 1}" in cl.etcd.keys(), 10, "the wrong-key member registered")

    def refused(i):
        c = cl.cluster(i)
        m = {x["host_id"]: x for x in c["members"]} if c else {}
        return f"h{n - 1}" in m and m[f"h{n - 1}"]["lease"] == "refused" and m[f"h{n - 1}"]["session"] != "up"
    wait_until(lambda: all(refused(i) for i in range(n - 1)), 10, "the wrong-key member's record refused")
    time.sleep(1.0)
    assert all(refused(i) for i in range(n - 1))
    bad = cl.ctl(n - 1, "cluster")
    assert all(m["session"] != "up" for m in bad["members"] if m["source"] != "self"), bad
    p = cl.prefill(0, f"h{n - 1}", rid(500), 8, timeout_ms=1500)
    p.finish(timeout=20)
    assert any(l.startswith("prepare-failed org.epd1.Error.PeerUnavailable") for l in p.lines), p.lines
    hand = cl.ctl(n - 1, "handoffs")
    assert hand["counters"]["live"] == 0 and not hand["handoffs"], hand
    pool = cl.ctl(n - 1, "pages")["pools"]
    assert all(x["live"] == 0 and x["leased"] == 0 for x in pool), pool
    print("wrong key: registered in etcd, refused by every member, nothing written")
    for i in range(n - 1):
        wait_until(lambda i=i: cl.clean(i), 5, f"{cl.names[i]} clean")


def forged_records(cl):
    """Whoever can write etcd cannot have a member dialed at an address of its choosing
    (there to relay the handshake to the real host and sit in the middle of a session
    both ends take for authenticated): records are signed with the cluster key. h2's key
    deleted and put again with another address (its MAC kept), and the record of a host
    that does not exist (sorting after every member, so that each of them would dial it):
    both refused, listed as such, and never dialed; h2 registers again over the forgery."""
    n = cl.n
    trap = Trap(cl)
    real = f"{cl.net.ip(2)}:7500"
    rec = json.loads(cl.etcd.ctl("get", "/epd/members/h2", "--print-value-only").stdout)
    assert rec["address"] == real, rec
    assert cl.etcd.ctl("put", "/epd/members/zz-forged",
                       json.dumps(dict(rec, host_id="zz-forged", address=trap.addr))).returncode == 0
    assert cl.etcd.ctl("del", "/epd/members/h2").returncode == 0
    assert cl.etcd.ctl("put", "/epd/members/h2", json.dumps(dict(rec, address=trap.addr))).returncode == 0
    time.sleep(2.0)  # a join is dialed at once (its dialer retries every few hundred ms)
    assert not trap.hits(), f"dialed at the forged address {trap.addr} by {sorted(set(trap.hits()))}"

    def h2_real():
        g = cl.etcd.ctl("get", "/epd/members/h2", "--print-value-only")
        try:
            return g.returncode == 0 and json.loads(g.stdout)["address"] == real
        except ValueError:
            return False
    wait_until(h2_real, 10, "h2 registered again over the forged record")
    wait_until(lambda: cl.mesh(range(n)), 15, "every member sees the others after the forged records")

    def listed(i, host):
        c = cl.cluster(i)
        m = {x["host_id"]: x for x in c["members"]} if c else {}
        return m.get(host)
    wait_until(lambda: all((listed(i, "zz-forged") or {}).get("lease") == "refused" for i in range(n)), 5,
               "the forged member listed as refused")
    f = listed(0, "zz-forged")
    print("a forged record:", f)
    assert f["session"] != "up" and "not dialed" in f["last_error"] and trap.addr in f["last_error"], f
    with open(os.path.join(cl.tmp, "h0.log")) as log:
        text = log.read()
    assert "member record of zz-forged in etcd refused" in text, text[-3000:]
    assert "member record of h2 in etcd refused" in text, text[-3000:]
    with open(os.path.join(cl.tmp, "h2.log")) as log:
        assert "member record of h2 in etcd refused" in log.read(), "h2 did not see its record forged"
    assert not trap.hits(), f"dialed at the forged address {trap.addr} by {sorted(set(trap.hits()))}"
    # Gone from etcd, gone from the list.
    assert cl.etcd.ctl("del", "/epd/members/zz-forged").returncode == 0
    wait_until(lambda: all(listed(i, "zz-forged") is None for i in range(n)), 5, "the forged record gone")
    print("forged records: refused everywhere, never dialed; h2 back at its own address")


def test_junk(cl):
    """Whoever can write etcd puts more under PREFIX members/ than one answer holds (the
    client caps one at 16 MiB): a resync read it in one answer, failed, and retried
    forever: a host started then stayed degraded and never saw a member. Read in pages
    (1000 keys, halved past the cap: the 1 MB values), it is up and sees the others."""
    cl.etcd.start()
    start_all(cl, [0, 1])
    t0 = time.monotonic()
    # Before every member's key ("g" < "h"), so that the members are on the last page.
    cl.etcd.fill("/epd/members/g-big-", 12, 1000000)
    cl.etcd.fill("/epd/members/g-junk-", 14000, 1024)
    print(f"etcd: 14,000 keys of 1 KiB and 12 of 1 MB written in {time.monotonic() - t0:.2f}s")
    # One answer of it all would be past the client's cap.
    r = cl.etcd.ctl("get", "--prefix", "/epd/members/", "-w", "json")
    assert r.returncode == 0 and len(r.stdout) > 16 << 20, (r.returncode, len(r.stdout))
    t0 = time.monotonic()
    cl.start(2)
    wait_until(lambda: (cl.cluster(2) or {}).get("etcd_state") == "up" and cl.mesh([0, 1, 2]), 15,
               "h2 up and in the mesh over 16 MiB of junk under the prefix")
    print(f"h2 up and in the mesh {time.monotonic() - t0:.2f}s after its start")
    c2 = cl.cluster(2)
    assert sorted(m["host_id"] for m in c2["members"]) == ["h0", "h1", "h2"], c2["members"]
    assert all((cl.cluster(i) or {}).get("etcd_state") == "up" for i in (0, 1))
    # Its watch follows from the read's revision: a member killed leaves its view.
    t0 = time.monotonic()
    cl.kill(1)

    def left(i):
        c = cl.cluster(i)
        m = {x["host_id"]: x for x in c["members"]} if c else {}
        return "h1" in m and m["h1"]["lease"] == "left"
    wait_until(lambda: left(0) and left(2), LEASE_TTL_S + BOUND_S + 1, "h1 left h0's and h2's views")
    print(f"h1 left h0's and h2's views {time.monotonic() - t0:.2f}s after kill -9")


def test_tls(cl):
    """etcd on https, client certificates required: members with the CA and a client
    certificate form the cluster; one without a certificate is refused by etcd, says
    why, and serves alone."""
    cl.no_client_cert = {2}
    cl.etcd.start()
    start_all(cl, [0, 1])
    c = cl.cluster(0)
    assert c["etcd_state"] == "up" and c["etcd_reason"].startswith("registered at https://"), c
    cl.start(2)
    wait_until(lambda: (cl.cluster(2) or {}).get("etcd_state") == "degraded", 10, "h2 degraded")
    c2 = cl.cluster(2)
    print("without a client certificate:", c2["etcd_reason"])
    assert [m["host_id"] for m in c2["members"]] == ["h2"], c2
    assert "/epd/members/h2" not in cl.etcd.keys() and len(cl.etcd.keys()) == 2, cl.etcd.keys()
    dec, p = cl.decode(1, rid(600)), cl.prefill(0, "h1", rid(600), 8)
    committed(p, dec, "h0->h1 over a cluster found through etcd over TLS")


def main():
    global SRC
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    test, build = sys.argv[1], sys.argv[2]
    SRC = sys.argv[3] if len(sys.argv) > 3 else os.path.dirname(os.path.dirname(HERE))
    if os.geteuid() != 0:
        skip("needs root for network namespaces")
    for tool in ("ip", "etcd", "etcdctl"):
        if not shutil.which(tool):
            skip(f"{tool} not installed (Debian: etcd-server, etcd-client)")
    r = sh("ip", "netns", "add", f"epdprobe{os.getpid()}", check=False)
    if r.returncode != 0:
        skip("cannot create network namespaces: " + r.stderr.strip())
    sh("ip", "netns", "del", f"epdprobe{os.getpid()}")
    tests = {"cluster-etcd-eight": (test_eight, 8), "cluster-etcd-faults": (test_faults, 4),
             "cluster-etcd-tls": (test_tls, 3), "cluster-etcd-hang": (test_hang, 3),
             "cluster-etcd-junk": (test_junk, 3)}
    fn, n = tests[test]
    if test == "cluster-etcd-tls" and not shutil.which("openssl"):
        skip("openssl not installed (certificates for etcd's TLS)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        cl = EtcdCluster(build, tmp, n, tls=test == "cluster-etcd-tls")
        try:
            fn(cl)
        except BaseException:
            for name in cl.names + ["etcd"]:
                p = os.path.join(tmp, f"{name}.log")
                if os.path.exists(p):
                    print(f"--- {name}.log (tail)")
                    print("".join(open(p).readlines()[-25:]))
            raise
        finally:
            cl.close()
    print(f"PASS {test} in {time.monotonic() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
