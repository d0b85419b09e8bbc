# SPDX-License-Identifier: LGPL-2.1-or-later
"""bench/e2e/e2e.py, the proxy/load generator, with the synthetic backend (numpy, no GPU)
against a real epdd: the mixed stream (repeated images, agent requests on workflow
branches), cache on and bypassed side by side, a layout of several processes, the
workflow counters, and the gates: a run passes when everything is released, and fails
when the daemon still holds a page afterwards."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epd  # noqa: E402
import epd.sequence  # noqa: E402
from test_binding import Daemon  # noqa: E402

E2E = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "e2e", "e2e.py")

try:
    import numpy  # noqa: F401
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False


def _e2e_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("e2e_bench", E2E)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


class ShareAccountingTest(unittest.TestCase):
    """What epd's share of TTFT counts. The Publish's delivery to a waiting prefill counts;
    a prefill that found its feature ready (it queued behind another request: its start
    came after the Publish for reasons not epd's) has none, however late it started. The
    KV sink's host time counts unless the GPU was still on the model's work meanwhile."""

    def test_only_a_wait_counts(self):
        d = _e2e_module().feature_delivery_s
        enc = {"encode": {"detail": {"publish_at": 10.0}}}
        waited = dict(enc, prefill={"fetch_detail": {"woke_at": 10.0004, "wait": 0.03, "waited": True}})
        self.assertAlmostEqual(d(waited), 0.0004)
        hit = dict(enc, prefill={"fetch_detail": {"woke_at": 10.0177, "wait": 1e-6, "waited": False}})
        self.assertEqual(d(hit), 0.0)
        older = dict(enc, prefill={"fetch_detail": {"woke_at": 10.0177, "wait": 1e-6}})  # no "waited": none
        self.assertEqual(d(older), 0.0)
        self.assertEqual(d({"prefill": {"fetch_detail": {"woke_at": 1.0, "waited": True}}}), 0.0)  # no Publish
        early = dict(enc, prefill={"fetch_detail": {"woke_at": 9.9, "waited": True}})
        self.assertEqual(d(early), 0.0)

    def test_fetch_on_the_critical_path(self):
        f = _e2e_module().prefill_fetch_critical_s
        enc = {"encode": {"detail": {"publish_at": 10.0}}}
        # It waited: its Acquire (0.2 ms) overlapped the tower; the read (0.15) and the
        # delivery (0.4) are on the path.
        waited = dict(enc, prefill={"fetch_s": 0.00035, "fetch_detail": {"acquire": 0.0002, "wait": 0.03,
                                                                          "woke_at": 10.0004, "waited": True}})
        self.assertAlmostEqual(f(waited), 0.00055)
        # A hit: the whole fetch is on the path, no delivery.
        hit = dict(enc, prefill={"fetch_s": 0.00035, "fetch_detail": {"acquire": 0.0002, "wait": 1e-6,
                                                                       "woke_at": 10.02, "waited": False}})
        self.assertAlmostEqual(f(hit), 0.00035)

    def test_sink_on_the_critical_path(self):
        m = _e2e_module()
        # 0.4 ms of host time, all of it while the GPU was still on the model's work: only
        # the write's GPU time (0.05) is on the path; counted, all of it.
        hidden = {"prefill": {"sink_s": 0.0004, "sink_detail": {"write_gpu": 0.00005, "host_hidden": 0.0004}}}
        self.assertAlmostEqual(m.sink_critical_s(hidden), 0.00005)
        self.assertAlmostEqual(m.sink_counted_s(hidden), 0.00045)
        exposed = {"prefill": {"sink_s": 0.0004, "sink_detail": {"write_gpu": 0.00005, "host_hidden": 0.0}}}
        self.assertAlmostEqual(m.sink_critical_s(exposed), 0.00045)
        older = {"prefill": {"sink_s": 0.0004}}  # no detail: all of it
        self.assertAlmostEqual(m.sink_critical_s(older), 0.0004)

    def test_split_counts_each_part_once(self):
        """The write's GPU time is the KV sink's column, not also the prefill compute's
        (the save's wait inside the compute window runs through it)."""
        m = _e2e_module()
        r = {"prefill": {"compute_s": 0.050, "sink_s": 0.0004,
                         "sink_detail": {"write_gpu": 0.002, "host_hidden": 0.0}}}
        self.assertAlmostEqual(m.prefill_compute_s(r) + m.sink_critical_s(r), 0.050 + 0.0004)
        self.assertAlmostEqual(m.prefill_compute_s({"prefill": {"compute_s": 0.050}}), 0.050)


@unittest.skipUnless(HAVE_NUMPY, "numpy not installed")
class E2eDriverTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon(state=True)
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()
        self.assertEqual(self.d.stop(), 0)

    def e2e(self, *args):
        out = os.path.join(self.tmp.name, "out.json")
        p = subprocess.run([sys.executable, E2E, "--address", self.d.address, "--epdctl", os.environ["EPDCTL"],
                            "--backend", "synthetic", "--json", out, *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
        with open(out) as f:
            return p.returncode, p.stdout, json.load(f)

    def test_check_and_bench(self):
        rc, text, out = self.e2e("--check", "x", "--bench", "x", "--requests", "6", "--warmup", "1", "--images", "3",
                                 "--layout", "1E+1P+2D", "--gpus", "1", "--agent-every", "3", "--branches", "2")
        self.assertEqual(rc, 0, text)
        c = out["check"]
        self.assertEqual((c["requests"], c["turns"], c["completed"]), (6, 10, 6))
        self.assertEqual(c["workflow"]["workflows"], 2)
        self.assertEqual(c["workflow"]["forks"], 4)
        self.assertGreater(c["workflow"]["shared_pages"], 0)
        self.assertEqual(c["workflow"]["reused_prefix_tokens"], 16 * c["workflow"]["shared_pages"])
        self.assertEqual([p["role"] for p in c["placement"]], ["encoder", "prefill", "decode", "decode"])
        self.assertTrue(all(p["gpu"] == 0 for p in c["placement"]))
        cached, bypassed, serial = out["bench"]
        self.assertIn("feature cache", cached["config"])
        self.assertIn("cache bypassed", bypassed["config"])
        self.assertIn("1 in flight", serial["config"])
        self.assertEqual(serial["encoder_runs"], 6)
        # 3 images over 6 requests: the cache skips the vision tower for repeats;
        # bypassed, it runs for every request.
        self.assertLessEqual(cached["encoder_runs"], 3)
        self.assertGreaterEqual(cached["feature_counters"]["hits"], 6)  # every prefill fetch, and repeats
        self.assertEqual(bypassed["encoder_runs"], 6)
        self.assertEqual(bypassed["encoder_hits"], 0)
        # The encoder's epd calls count in epd's share: its produce's parts are timed.
        for k in ("acquire", "fn", "reserve", "copy", "sync", "publish"):
            self.assertIn(k, bypassed["encoder_produce_ms"])
        self.assertGreater(bypassed["encoder_epd_critical_ms"], 0)
        self.assertGreaterEqual(bypassed["epd_share_of_ttft"], bypassed["epd_share_of_ttft_prefill_only"])
        self.assertGreaterEqual(bypassed["epd_share_of_ttft_host_counted"], bypassed["epd_share_of_ttft"])
        for row in (cached, bypassed, serial):
            self.assertEqual(row["turns"], 10)
            # The decode's steps per token and an agent request's workflow root, timed.
            self.assertGreater(row["decode_ms_per_token"], 0)
            self.assertGreater(row["workflow_root_ms"], 0)
            self.assertIn(f"decode ({row['config']}): ", text)
            self.assertEqual(row["workflow"]["forks"], 4)
            # The daemon's loop stalls are read for every row (how many is the machine's).
            self.assertIsInstance(row["loop_stalls"]["count"], int)
            self.assertIn("longest_what", row["loop_stalls"])
        self.assertIn("epdd's event loop (", text)
        for k in ("retained_pages", "failures", "fallbacks", "handoffs_left", "sequences_left", "workflows_left",
                  "feature_handles_left"):
            self.assertEqual(out[k], 0, k)
        self.assertIn("PASS", text)

    def test_prefill_that_encodes(self):
        """No encoder process: the prefill runs the vision tower, and its produce's epd calls
        (Acquire, reserve, copies, Publish) count in epd's share as an encoder's do."""
        rc, text, out = self.e2e("--bench", "x", "--requests", "3", "--warmup", "1", "--images", "3",
                                 "--layout", "1P1D", "--gpus", "1")
        self.assertEqual(rc, 0, text)
        bypassed = out["bench"][1]
        self.assertIn("cache bypassed", bypassed["config"])
        self.assertEqual(bypassed["encoder_runs"], 3)
        for k in ("acquire", "reserve", "copy", "publish"):
            self.assertIn(k, bypassed["encoder_produce_ms"])
        self.assertGreater(bypassed["encoder_epd_critical_ms"], 0)
        self.assertGreater(bypassed["epd_share_of_ttft"], bypassed["epd_share_of_ttft_prefill_only"])

    def test_gate_fails_on_retained_page(self):
        kv = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=256, v_bytes_per_token=256,
                          dtype="float16")
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cpu", kv=kv)
            epd.sequence.Sequence.create(c, "host0", 2)  # held past the run
            rc, text, out = self.e2e("--check", "x", "--requests", "2", "--agent-every", "0")
        self.assertEqual(rc, 1, text)
        self.assertEqual(out["retained_pages"], 2)
        self.assertEqual(out["sequences_left"], 1)
        self.assertIn("FAIL", text)


if __name__ == "__main__":
    unittest.main()
