#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd-demo as a load generator: it runs twice against the same daemon (the second run
finds the image cached and still checks every byte: it used to report "feature bytes ...
MISMATCH"), every request has its own id (the trace of one shows that request only), it
runs requests concurrently, it retries a Prepare refused with Backpressure after the
retry-after it was given (a peer window of one handoff), it hands off across two daemons,
and --help/--version/bad options behave."""

import json
import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from epdtest import Daemon, Pair, tool  # noqa: E402


def demo(*args, check=True):
    p = subprocess.run([tool("epd-demo"), *args], capture_output=True, text=True, timeout=240)
    if check and p.returncode != 0:
        raise AssertionError(f"epd-demo {' '.join(args)}: exit {p.returncode}\n{p.stdout}\n{p.stderr}")
    return p


class OneDaemon(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.d.close()

    def test_twice(self):
        for run in range(2):
            p = demo(f"--address={self.d.address}")
            self.assertIn("every byte as the encoder wrote it", p.stdout)
            self.assertIn("every page as prefill wrote it", p.stdout)
            self.assertNotIn("MISMATCH", p.stdout)
            self.assertIn("progress notices", p.stdout)

    def test_unique_ids_and_concurrency(self):
        s = json.loads(demo(f"--address={self.d.address}", "--requests=12", "--concurrency=3", "--images=3",
                            "--json").stdout)
        self.assertTrue(s["ok"])
        self.assertEqual((s["completed"], s["failed"]), (12, 0))
        self.assertEqual(s["prefill_hits"], 12)
        self.assertEqual(s["ring_notices"], 12 * 4)
        self.assertEqual(s["feature_mismatches"] + s["kv_mismatches"], 0)
        # The trace of request 5 of this run holds that request's handoff only.
        rid = s["run_id"] + "%016x" % 5
        t = self.d.epdctl("trace", rid, json_out=True)
        self.assertGreater(len(t["events"]), 0)
        self.assertEqual(t["request"], rid)
        other = self.d.epdctl("trace", s["run_id"] + "%016x" % 6, json_out=True)
        self.assertGreater(len(other["events"]), 0)
        # Workers of the lanes are gone with their connections.
        self.assertEqual(self.d.epdctl("workers", json_out=True), [])

    def test_options(self):
        p = demo("--help")
        self.assertIn("--concurrency=C", p.stdout)
        self.assertRegex(demo("--version").stdout, r"^epd-demo \d+\.\d+\.\d+\n$")
        p = demo("--bogus", check=False)
        self.assertEqual(p.returncode, 2)
        p = demo("--requests=0", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--requests=0: expected a number from 1", p.stderr)
        p = demo(f"--address={self.d.socket}", check=False)
        self.assertIn("did you mean --address=direct:", p.stderr)


class TwoDaemons(unittest.TestCase):
    def test_backpressure_retried(self):
        # A window of one handoff in flight per peer: concurrent Prepares to bravo are
        # refused with Backpressure and a retry-after, which epd-demo waits and retries.
        pair = Pair("[Backpressure]\nWindowHandoffs=1\nInterval=50ms\n")
        try:
            s = json.loads(demo(f"--address={pair.alpha.address}", f"--decode-address={pair.bravo.address}",
                                "--requests=8", "--concurrency=4", "--json").stdout)
            self.assertTrue(s["ok"], s)
            self.assertEqual(s["completed"], 8)
            self.assertEqual(s["remote"], 8)
            self.assertEqual(s["bytes_moved"], 8 * 36 * 512 * 1024)
            self.assertGreater(s["backpressure_retries"], 0)
            deferred = pair.alpha.epdctl("handoffs", json_out=True)["counters"]["deferred"]
            self.assertEqual(deferred, s["backpressure_retries"])
        finally:
            pair.close()

    def test_window_reloaded(self):
        # The handoff window follows a reload (SIGHUP): started with the default
        # window (128), alpha is told WindowHandoffs=1, and concurrent Prepares to
        # bravo are then refused with Backpressure (it was only telemetry's copy of
        # [Backpressure] that a reload used to change).
        pair = Pair("[Backpressure]\nInterval=50ms\n")
        try:
            a = pair.alpha
            with open(a.conf, "a") as f:
                f.write("WindowHandoffs=1\n")
            a.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while "Configuration reloaded" not in a.log_text():
                self.assertLess(time.monotonic(), deadline, a.log_text()[-1500:])
                time.sleep(0.05)
            s = json.loads(demo(f"--address={a.address}", f"--decode-address={pair.bravo.address}",
                                "--requests=8", "--concurrency=4", "--json").stdout)
            self.assertTrue(s["ok"], s)
            self.assertEqual((s["completed"], s["remote"]), (8, 8))
            self.assertGreater(s["backpressure_retries"], 0)
        finally:
            pair.close()


if __name__ == "__main__":
    unittest.main(verbosity=2)
