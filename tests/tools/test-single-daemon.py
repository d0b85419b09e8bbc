#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""One epdd per socket and per state directory (daemon/core/lockfile.c): a second epdd on
the same socket refuses to start, names the pid that holds it, and leaves the first one
serving; so does one on another socket with the same StateDirectory; once the first is
gone (even by SIGKILL) the next one starts. Before the lock, the second silently took the
socket over and, stopping, unlinked it from under the first."""

import os
import signal
import subprocess
import sys
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


if __name__ == "__main__":
    unittest.main(verbosity=2)
