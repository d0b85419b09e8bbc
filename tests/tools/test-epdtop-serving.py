#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""epdtop shows the serving side, against two live daemons while epd-demo hands KV off
from alpha to bravo: per worker its role, pages held, handoffs out and in, features
produced and hit (org.epd1.Worker.Stats); the handoff latency P50/P99 and the feature hit
rate over the last interval; the peer's transport (tcp) and state beside its path. It
used to print "features: -  handoffs: -" and an empty TRANSPORT column. On an 80x24
terminal (tmux) no line wraps (the PID stayed on its row), and ? shows the keys."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from epdtest import Pair, tool  # noqa: E402


class Serving(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.pair = Pair()
        # A workload that runs for the whole test: 2 lanes, decode on bravo.
        cls.demo = subprocess.Popen([tool("epd-demo"), f"--address={cls.pair.alpha.address}",
                                     f"--decode-address={cls.pair.bravo.address}", "--requests=100000",
                                     "--concurrency=2", "--images=3"],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            h = cls.pair.alpha.epdctl("handoffs", json_out=True)["counters"]
            if h.get("committed", 0) >= 4:
                break
            time.sleep(0.1)

    @classmethod
    def tearDownClass(cls):
        cls.demo.terminate()
        cls.demo.wait(30)
        cls.pair.close()

    def top(self, *args):
        p = subprocess.run([tool("epdtop"), f"--address={self.pair.alpha.address}", "--pins=/nonexistent", *args],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        return p.stdout

    def test_json(self):
        snaps = [json.loads(line) for line in self.top("--json", "-n", "2", "-d", "1").splitlines()]
        s = snaps[-1]
        self.assertGreater(s["interval"], 0.5)
        roles = sorted(w["role"] for w in s["workers"])
        self.assertEqual(roles, ["encoder", "encoder", "prefill", "prefill"])
        prefill = [w for w in s["workers"] if w["role"] == "prefill"]
        self.assertTrue(all(w["handoffs_out"] > 0 for w in prefill), prefill)
        self.assertTrue(all(w["feature_hits"] > 0 for w in prefill), prefill)
        encoders = [w for w in s["workers"] if w["role"] == "encoder"]
        self.assertGreaterEqual(sum(w["features_produced"] for w in encoders), 0)
        self.assertGreater(sum(w["feature_hits"] + w["feature_misses"] for w in encoders), 0)
        h = s["handoffs"]
        self.assertGreater(h["completed"], 0)
        self.assertIn("p50_usec", h)
        self.assertGreater(h["p50_usec"], 0)
        self.assertGreaterEqual(h["p99_usec"], h["p50_usec"])
        self.assertTrue(h["latency_interval"])
        self.assertGreater(h["completed_per_sec"], 0)
        self.assertTrue(s["features"]["hit_rate_interval"])
        self.assertGreater(s["features"]["hit_rate"], 0.5)
        peers = {p["name"]: p for p in s["peers"]}
        self.assertEqual(peers["bravo"]["transport"], "tcp")
        self.assertEqual(peers["bravo"]["state"], "up")
        # bravo sees the decode side: its workers accepted handoffs.
        p = subprocess.run([tool("epdtop"), f"--address={self.pair.bravo.address}", "--pins=/nonexistent", "--json"],
                           capture_output=True, text=True, timeout=60)
        b = json.loads(p.stdout)
        self.assertTrue(all(w["handoffs_in"] > 0 for w in b["workers"] if w["role"] == "decode"), b["workers"])

    def test_batch(self):
        out = self.top("--batch")
        self.assertRegex(out, r"handoffs: \d+ in flight, .* P50 \S+ P99 \S+")
        self.assertRegex(out, r"features: hit rate \d+%")
        self.assertRegex(out, r"(?m)^WORKER +ROLE +MODEL +DEVICE +PID +SEQS +PAGES +HO-OUT +HO-IN")
        self.assertRegex(out, r"(?m)^bravo .* tcp +up +static +\d+\.\d%$")  # LEASE, SHARE: membership

    def test_screen_80x24(self):
        if not shutil.which("tmux"):
            self.skipTest("tmux is not installed")
        session = f"epdtop-serving-{os.getpid()}"
        cmd = f"TERM=xterm-256color {tool('epdtop')} --address={self.pair.alpha.address} --pins=/nonexistent -d 0.3"
        if subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "80", "-y", "24", cmd]).returncode != 0:
            self.skipTest("tmux cannot start a session")
        try:
            def screen():
                return subprocess.run(["tmux", "capture-pane", "-t", session, "-p"], capture_output=True,
                                      text=True).stdout

            def wait_for(regex):
                for _ in range(50):
                    s = screen()
                    if re.search(regex, s, re.M):
                        return s
                    time.sleep(0.1)
                self.fail(f"no {regex!r} on the screen:\n{screen()}")

            s = wait_for(r"^WORKER ")
            pid = str(self.demo.pid)
            rows = [line for line in s.splitlines() if re.match(r"^[0-9a-f]{12} +(encoder|prefill) ", line)]
            self.assertEqual(len(rows), 4, s)
            for line in s.splitlines():
                self.assertLessEqual(len(line), 80)
            for line in rows:  # the PID is on the worker's own row
                self.assertIn(f" {pid} ", line + " ")
            self.assertRegex(s, r"(?m)^bravo .*tcp")
            subprocess.run(["tmux", "send-keys", "-t", session, "?"])
            wait_for(r"^epdtop - keys")
            s = screen()
            self.assertIn("q          quit", s)
            subprocess.run(["tmux", "send-keys", "-t", session, "x"])  # any key closes it
            wait_for(r"^WORKER ")
            subprocess.run(["tmux", "send-keys", "-t", session, "q"])
            for _ in range(30):
                if subprocess.run(["tmux", "has-session", "-t", session], capture_output=True).returncode != 0:
                    break
                time.sleep(0.1)
        finally:
            subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


class LongHostId(unittest.TestCase):
    """A peer whose host id is as long as HostId= takes (63 characters; /etc/machine-id,
    the default, has 32): epdtop showed it cut to 31 characters, as two rows merged into
    one (the telemetry's, cut, and the peer list's, added because the cut name matched
    no host id) with the peer list's fields only, and without its LEASE (membership is
    matched by the whole id)."""

    BRAVO = "bravo-" + "0123456789abcdef" * 3 + "012345678"

    @classmethod
    def setUpClass(cls):
        assert len(cls.BRAVO) == 63
        cls.pair = Pair(host_ids=("alpha", cls.BRAVO))

    @classmethod
    def tearDownClass(cls):
        cls.pair.close()

    def test_json(self):
        p = subprocess.run([tool("epdtop"), f"--address={self.pair.alpha.address}", "--pins=/nonexistent", "--json"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        s = json.loads(p.stdout)
        self.assertEqual([x["name"] for x in s["peers"]], [self.BRAVO], s["peers"])
        bravo = s["peers"][0]
        self.assertEqual(bravo["state"], "up")
        self.assertEqual(bravo["transport"], "tcp")
        self.assertEqual(bravo["lease"], "static")
        b = subprocess.run([tool("epdtop"), f"--address={self.pair.bravo.address}", "--pins=/nonexistent", "--json"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(json.loads(b.stdout)["host"], self.BRAVO)


if __name__ == "__main__":
    unittest.main(verbosity=2)
