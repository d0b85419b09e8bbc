# SPDX-License-Identifier: LGPL-2.1-or-later
"""bench/bench-handoff-latency.c against a real epdd (a local handoff, kv0 -> kv1), small,
so that the benchmark keeps working where there is no second host: the decode side's
commit on its ring (EPD_RING_OP_COMMIT, the default) and on the bus (--bus-commit), one
and several handoffs in flight, from threads and pipelined from one (--pipeline: Prepare
without waiting, epd_handoff_prepare_async); each run completes every handoff and leaves
nothing behind."""

import json
import os
import re
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_binding import Daemon  # noqa: E402

BENCH = os.environ.get("BENCH_HANDOFF_LATENCY")


@unittest.skipUnless(BENCH, "BENCH_HANDOFF_LATENCY not set")
class BenchLatencyTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon("[Arena:kv0]\nSize=16M\n[Arena:kv1]\nSize=16M\n")

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def run_bench(self, *extra, count=40):
        argv = [BENCH, "--prefill", self.d.address, "--decode", self.d.address, "--arena", "kv0",
                "--dest-arena", "kv1", "--count", str(count), "--warmup", "2", *extra]
        p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout)
        m = re.search(r"^RESULT handoffs=(\d+) inflight=(\d+)", p.stdout, re.M)
        self.assertIsNotNone(m, p.stdout)
        return int(m.group(1)), int(m.group(2)), p.stdout

    def test_commit_on_the_ring_and_the_bus(self):
        for extra in ((), ("--bus-commit",), ("--inflight", "4"), ("--inflight", "4", "--bus-commit"),
                      ("--pipeline", "8"), ("--pipeline", "8", "--groups", "1")):
            n, k, out = self.run_bench(*extra)
            self.assertEqual(n, 40, (extra, out))
            self.assertEqual(k, int(extra[1]) if extra[:1] in (("--inflight",), ("--pipeline",)) else 1)
            self.assertIn("all_p50=", out)
            self.assertEqual("pipelined=1" in out, extra[:1] == ("--pipeline",), out)
        # More in flight than a pipelined slot table of 64 held before (a source seen
        # committed before its Prepare's answer was dropped, and its slot never ended).
        n, k, out = self.run_bench("--pipeline", "100", count=200)
        self.assertEqual((n, k), (200, 100), out)
        # Nothing left: every page free again, no handoff, no sequence.
        for pool in self.epdctl("pages")["pools"]:
            self.assertEqual(pool["free"], pool["total"], pool)
        self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])
        self.assertEqual(self.epdctl("sequences"), [])

    def epdctl(self, *args):
        r = subprocess.run([os.environ["EPDCTL"], "-A", self.d.address, "--json", *args], stdout=subprocess.PIPE,
                           text=True, check=True)
        return json.loads(r.stdout)


if __name__ == "__main__":
    unittest.main()
