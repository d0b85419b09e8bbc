#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""One epdd per socket and per state directory (daemon/core/lockfile.c): a second epdd on
the same socket refuses to start, names the pid that holds it, and leaves the first one
serving; so does one on another socket with the same StateDirectory; once the first is
gone (even by SIGKILL) the next one starts. Before the lock, the second silently took the
socket over and, stopping, unlinked it from under the first.

The socket appears at its path only once it listens (bound under <path>.<pid>, renamed):
a caller that connects the moment the file is there is never refused. Bound at the path,
a connect() between bind() and listen() got ECONNREFUSED (the GPU handoff bench, which
waits for the file, failed so in CI)."""

import os
import signal
import socket
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from epdtest import Daemon, tool  # noqa: E402


class SingleDaemon(unittest.TestCase):
    def setUp(self):
        self.d = Daemon()

    def tearDown(self):
        self.d.close()

    def second(self, conf):
        return subprocess.run([tool("epdd"), f"--config={conf}"], capture_output=True, text=True, timeout=20)

    def test_same_socket(self):
        p = self.second(self.d.conf)
        self.assertEqual(p.returncode, 1)
        self.assertIn(f"Socket {self.d.socket} is served by another epdd (pid {self.d.proc.pid})", p.stderr)
        # The first still serves, on its socket.
        self.assertIn("epdd", self.d.epdctl("status").stdout)
        self.assertTrue(os.path.exists(self.d.socket))

    def test_same_state_directory(self):
        conf = os.path.join(self.d.dir, "other.conf")
        with open(conf, "w") as f:
            f.write(f"[Daemon]\nSocket={self.d.dir}/other-bus\nSystemBus=no\nStateDirectory={self.d.state}\n")
        p = self.second(conf)
        self.assertEqual(p.returncode, 1)
        self.assertIn(f"State directory {self.d.state} is in use by another epdd (pid {self.d.proc.pid})", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.d.dir, "other-bus")))
        self.d.epdctl("status")

    def test_after_kill(self):
        self.d.proc.send_signal(signal.SIGKILL)
        self.d.proc.wait()
        self.d.start()  # the kernel dropped the locks with the process
        self.d.epdctl("status")

    def test_socket_listens_when_it_appears(self):
        """listen() made 300 ms slow (tests/integration/fault-peer.c): the path must not be
        there before it returns."""
        self.d.stop()
        env = dict(os.environ, EPD_FAULT_LISTEN_SLOW_MS="300",
                   LD_PRELOAD=" ".join(filter(None, [os.environ.get("EPD_TEST_PRELOAD", ""),
                                                     os.environ["FAULT_PEER"]])),
                   ASAN_OPTIONS=":".join(filter(None, [os.environ.get("ASAN_OPTIONS", ""),
                                                       "verify_asan_link_order=0"])))
        refused = []
        for i in range(3):
            proc = subprocess.Popen([tool("epdd"), f"--config={self.d.conf}"], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, env=env)
            try:
                deadline = time.monotonic() + 20
                while not os.path.exists(self.d.socket):  # as soon as it is there
                    self.assertIsNone(proc.poll(), "epdd exited")
                    self.assertLess(time.monotonic(), deadline, "no socket")
                    time.sleep(0.001)
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(self.d.socket)
                except ConnectionRefusedError:
                    refused.append(i)
                finally:
                    s.close()
                self.assertEqual([n for n in os.listdir(self.d.dir) if n.startswith("bus.")], ["bus.lock"])
            finally:
                proc.send_signal(signal.SIGTERM)
                self.assertEqual(proc.wait(20), 0)
            self.assertFalse(os.path.lexists(self.d.socket))
        self.assertEqual(refused, [], "connect() refused on a socket that was already there")

    def test_not_a_socket_left_alone(self):
        self.d.stop()
        with open(self.d.socket, "w") as f:
            f.write("precious\n")
        p = self.second(self.d.conf)
        self.assertEqual(p.returncode, 1)
        self.assertIn(f"Cannot serve the direct socket {self.d.socket}: a file that is not a socket is there",
                      p.stderr)
        with open(self.d.socket) as f:
            self.assertEqual(f.read(), "precious\n")
        self.assertEqual(sorted(n for n in os.listdir(self.d.dir) if n.startswith("bus")), ["bus", "bus.lock"])
        os.unlink(self.d.socket)

    def test_stale_socket_replaced(self):
        self.d.proc.send_signal(signal.SIGKILL)  # leaves its socket behind
        self.d.proc.wait()
        self.assertTrue(os.path.exists(self.d.socket))
        self.d.start()
        self.d.epdctl("status")


if __name__ == "__main__":
    unittest.main(verbosity=2)
