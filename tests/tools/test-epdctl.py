#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""epdctl as a newcomer uses it: options after the command work (the README's own
`epdctl workers --json`), an unknown option or a stray argument is refused loudly,
`epdctl help` and `--version`, an --address in a form libepd does not know is explained
(with the direct: form a bare path meant), a failed connect names the address it tried,
and `epdctl status` shows uptime, peers and backpressure at a glance. Every command the
help lists runs against a live daemon, in text and in JSON."""

import json
import os
import re
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from epdtest import Daemon, Pair, tool  # noqa: E402


def run(*args, env=None):
    return subprocess.run([tool("epdctl"), *args], capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, **(env or {})))


class Options(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.d.close()

    def test_options_after_command(self):
        p = run("workers", "--json", f"--address={self.d.address}")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(json.loads(p.stdout), [])
        p = run("arenas", "-j", "-A", self.d.address)
        self.assertEqual([a["name"] for a in json.loads(p.stdout)], ["host0", "feat0"])

    def test_unknown_option_refused(self):
        p = run("arenas", "--bogus", f"--address={self.d.address}")
        self.assertEqual(p.returncode, 1)
        self.assertIn("--bogus", p.stderr)
        self.assertEqual(p.stdout, "")

    def test_stray_argument_refused(self):
        p = run("arenas", "extra", f"--address={self.d.address}")
        self.assertEqual(p.returncode, 1)
        self.assertIn("epdctl arenas takes no arguments (got 'extra')", p.stderr)
        p = run("trace", f"--address={self.d.address}")
        self.assertEqual(p.returncode, 1)
        self.assertIn("Usage: epdctl trace REQUEST_ID", p.stderr)

    def test_help_and_version(self):
        for args in (["help"], ["--help"], ["-h"]):
            p = run(*args)
            self.assertEqual(p.returncode, 0)
            self.assertIn("Usage: epdctl [OPTIONS] COMMAND", p.stdout)
        p = run("--version")
        self.assertEqual(p.returncode, 0)
        self.assertRegex(p.stdout, r"^epdctl \d+\.\d+\.\d+\n$")

    def test_address_forms(self):
        p = run(f"--address={self.d.socket}", "status")
        self.assertEqual(p.returncode, 1)
        self.assertIn("expected direct:PATH", p.stderr)
        self.assertIn(f"did you mean --address=direct:{self.d.socket}?", p.stderr)
        p = run("--address=unix:path=/x", "status")
        self.assertIn("did you mean --address=bus:unix:path=/x", p.stderr)

    def test_connect_failure_names_address(self):
        missing = os.path.join(self.d.dir, "no-such-socket")
        p = run(f"--address=direct:{missing}", "status")
        self.assertEqual(p.returncode, 1)
        self.assertIn(f"cannot connect to epdd at direct:{missing}: No such file or directory", p.stderr)
        p = run("status", env={"EPD_SOCKET": missing})
        self.assertIn(f"cannot connect to epdd at direct:{missing} (from $EPD_SOCKET)", p.stderr)

    def test_every_command(self):
        verbs = re.findall(r"^  (\w+)", run("help").stdout, re.M)
        self.assertGreaterEqual(len(verbs), 14)
        for v in verbs:
            if v in ("help", "trace"):
                continue
            args = ["0x1"] if v == "placement" else []  # a block hash
            p = run(v, *args, f"--address={self.d.address}")
            self.assertEqual(p.returncode, 0, f"epdctl {v}: {p.stderr}")
            if v == "cluster":  # a daemon on its own has no Cluster object: said plainly
                self.assertIn("Membership: none (this epdd has no peers", p.stdout)
            p = run(v, *args, "--json", f"--address={self.d.address}")
            self.assertEqual(p.returncode, 0, f"epdctl {v} --json: {p.stderr}")
            json.loads(p.stdout)

    def test_status_single(self):
        s = self.d.epdctl("status", json_out=True)
        self.assertEqual(s["state_directory"], self.d.state)
        self.assertEqual(s["socket"], self.d.socket)
        self.assertGreater(s["started_at_usec"], 0)
        self.assertGreaterEqual(s["uptime_sec"], 0)
        text = self.d.epdctl("status").stdout
        self.assertRegex(text, r"epdd \S+ on host tools-host, up \d+s\n")
        self.assertIn("  peers:        none configured\n", text)
        self.assertIn("  backpressure: none", text)
        self.assertIn("  metrics:      off", text)


class StatusWithPeers(unittest.TestCase):
    def test_peers_and_backpressure(self):
        pair = Pair()
        try:
            s = pair.alpha.epdctl("status", json_out=True)
            self.assertEqual((s["peers"], s["peers_up"]), (1, 1))
            text = pair.alpha.epdctl("status").stdout
            self.assertIn("  peers:        1 of 1 up (bravo up)\n", text)
            self.assertRegex(text, r"  backpressure: (none|elevated|high|stalled)")
            pair.bravo.stop()
            for _ in range(100):
                if pair.alpha.epdctl("status", json_out=True)["peers_up"] == 0:
                    break
                time.sleep(0.05)
            self.assertIn("  peers:        0 of 1 up (bravo ", pair.alpha.epdctl("status").stdout)
        finally:
            pair.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
