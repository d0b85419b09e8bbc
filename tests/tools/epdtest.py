# SPDX-License-Identifier: LGPL-2.1-or-later
"""What the tests of the tools (tests/tools/test-*.py) share: epdd on a private socket and a
private state directory in a temporary directory (never the host's /run/epd or
/var/lib/epd), the built tools, and a skip that says why."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

BUILD = os.environ.get("BUILD_ROOT", "")
SOURCE = os.environ.get("SOURCE_ROOT", "")


def tool(name):
    paths = {"epdd": "daemon/epdd", "epdctl": "tools/epdctl", "epdtop": "tools/epdtop",
             "epd-demo": "tools/epd-demo"}
    return os.path.join(BUILD, paths[name])


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Daemon:
    """epdd with its own socket and StateDirectory under a temporary directory."""

    def __init__(self, extra_conf="", host_id="tools-host", directory=None, start=True):
        self.dir = directory or tempfile.mkdtemp(prefix="epd-tools-")
        self.owns_dir = directory is None
        self.socket = os.path.join(self.dir, "bus")
        self.state = os.path.join(self.dir, "state")
        self.conf = os.path.join(self.dir, "epd.conf")
        with open(self.conf, "w") as f:
            f.write(f"[Daemon]\nSocket={self.socket}\nSystemBus=no\nHostId={host_id}\n"
                    f"StateDirectory={self.state}\n{extra_conf}")
        self.log_path = os.path.join(self.dir, "epdd.log")
        self.proc = None
        if start:
            self.start()

    @property
    def address(self):
        return "direct:" + self.socket

    def start(self, args=()):
        if getattr(self, "log", None):
            self.log.close()
        self.log = open(self.log_path, "a")
        self.proc = subprocess.Popen([tool("epdd"), f"--config={self.conf}", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"epdd exited ({self.proc.returncode}): {self.log_text()[-2000:]}")
            if os.path.exists(self.socket):
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(self.socket)
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            time.sleep(0.01)
        raise RuntimeError("epdd did not start: " + self.log_text()[-2000:])

    def log_text(self):
        with open(self.log_path) as f:
            return f.read()

    def epdctl(self, *args, check=True, json_out=False):
        cmd = [tool("epdctl"), f"--address={self.address}", *args]
        if json_out:
            cmd.append("--json")
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr}")
        return json.loads(p.stdout) if json_out else p

    def stop(self):
        rc = None
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
        elif self.proc:
            rc = self.proc.returncode
        self.proc = None
        if getattr(self, "log", None):
            self.log.close()
        return rc

    def close(self):
        self.stop()
        if self.owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


class Pair:
    """Two epdd, alpha and bravo, peers of each other over 127.0.0.1 (a cluster key of
    their own), each on its own socket and state directory. The heartbeat is the
    default's 2 s: a peer that stops closes its connections, which the other sees at
    once; a shorter bound only declared live peers down (and rolled their handoffs
    back) when a loaded 2-core machine ran sanitizer builds side by side. host_ids: their
    HostId= (the [Peer:alpha] and [Peer:bravo] sections keep their names)."""

    def __init__(self, extra_conf="", host_ids=("alpha", "bravo")):
        self.host_ids = host_ids
        self.dir = tempfile.mkdtemp(prefix="epd-tools-pair-")
        key = os.path.join(self.dir, "cluster.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, os.urandom(32).hex().encode())
        os.close(fd)
        # Each names the other's port in its config, so both ports are chosen before
        # either binds: one that another process took in between (tests run in
        # parallel) is retried with other ports, never reported as a failure.
        for attempt in range(20):
            if self._start(key, extra_conf, attempt):
                break
        else:
            raise RuntimeError("no free pair of ports in 20 attempts")
        self.alpha, self.bravo = self.daemons
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if all(d.epdctl("status", json_out=True)["peers_up"] == 1 for d in self.daemons):
                return
            time.sleep(0.05)
        raise RuntimeError("the two daemons did not connect: " + self.alpha.log_text()[-1500:])

    def _start(self, key, extra_conf, attempt):
        ports = [free_port(), free_port()]
        names = ["alpha", "bravo"]
        self.daemons = []
        for i in (0, 1):
            d = os.path.join(self.dir, f"{names[i]}-{attempt}" if attempt else names[i])
            os.mkdir(d)
            j = 1 - i
            try:
                self.daemons.append(Daemon(
                    f"[Cluster]\nListen=127.0.0.1:{ports[i]}\nClusterKeyFile={key}\nHeartbeatInterval=2s\n"
                    f"[Peer:{names[j]}]\nAddress=127.0.0.1:{ports[j]}\nHostId={self.host_ids[j]}\n{extra_conf}",
                    host_id=self.host_ids[i], directory=d))
            except RuntimeError as e:
                for x in self.daemons:
                    x.close()
                if "Address already in use" not in str(e):
                    raise
                print(f"port {ports[i]} was taken before epdd bound it; trying others", file=sys.stderr)
                return False
        return True

    def close(self):
        for d in self.daemons:
            d.close()
        shutil.rmtree(self.dir, ignore_errors=True)
