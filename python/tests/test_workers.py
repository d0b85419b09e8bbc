# SPDX-License-Identifier: LGPL-2.1-or-later
"""The worker harness's control flow against a real epdd, without torch or a GPU:
encoder, prefill and decode are separate processes with synthetic numpy tensors of the
small Qwen3-VL shapes. Features go encoder -> prefill through the feature cache (a
repeated image is a hit), KV goes prefill -> decode through pages and a layered handoff
with ring notices; the decode side checks every byte against what the prefill wrote."""

import hashlib
import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_binding import Daemon  # noqa: E402

try:
    import numpy  # noqa: F401
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False


def expected_tokens(b, spec, first):
    """What the synthetic decode must produce if every KV byte arrived intact."""
    h = hashlib.sha256()
    feats = b.encode(spec) if spec.image_seed is not None else None
    fsum = float(feats["embeds"].astype("float32").sum()) if feats else 0.0
    for layer in range(b.layers):
        k, v = b.kv(spec, layer, fsum)
        h.update(k.tobytes())
        h.update(v.tobytes())
    d = h.digest()
    return ([first] + [int.from_bytes(d[i:i + 2], "little") for i in range(0, 2 * (spec.max_new_tokens - 1), 2)]
            )[: spec.max_new_tokens]


@unittest.skipUnless(HAVE_NUMPY, "numpy not installed")
class WorkersTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon()

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def epdctl(self, *args):
        out = subprocess.run([os.environ["EPDCTL"], "-A", self.d.address, "--json", *args],
                             check=True, stdout=subprocess.PIPE).stdout
        return json.loads(out)

    def test_encode_prefill_decode(self):
        from epd.workers import serve
        w = serve.Workers(self.d.address, "synthetic", group_size=2)
        try:
            specs = [serve.Spec(serve.request_id_of(i), image_seed=i % 3 if i != 5 else None, text_seed=i,
                                text_tokens=20 + i, max_new_tokens=8) for i in range(8)]
            results = w.run(specs, concurrency=3)
        finally:
            w.close()
        b = serve.Synthetic()
        hits = 0
        for s, r in zip(specs, results):
            self.assertEqual(r["tokens"], expected_tokens(b, s, r["prefill"]["first"]), s.request_id)
            self.assertEqual(r["prefill"]["prompt_len"], b.prompt_len(s))
            if "encode" in r:
                hits += r["encode"]["result"] == "hit"
        # Images 0, 1, 2 repeat: after the first of each, the encoder is skipped.
        self.assertGreaterEqual(hits, 3)
        # Nothing is left behind: every page is free, no handoff remains.
        pools = self.epdctl("pages")["pools"]
        kv = [p for p in pools if p["arena"] == "host0"][0]
        self.assertEqual(kv["free"], kv["total"], pools)
        self.assertEqual(self.epdctl("sequences"), [])

    def test_ring_keeps_up(self):
        """Many requests with one notice per layer on small rings: more events than a
        completion ring holds. The workers drain their rings, so the daemon never falls
        back to D-Bus signals, and no request's events are lost to another's wait."""
        from epd.workers import serve
        w = serve.Workers(self.d.address, "synthetic", group_size=1, ring_entries=64)
        try:
            specs = [serve.Spec(serve.request_id_of(100 + i), image_seed=None, text_seed=i, text_tokens=16,
                                max_new_tokens=2) for i in range(48)]
            results = w.run(specs, concurrency=4)
        finally:
            w.close()
        self.assertEqual(len(results), len(specs))
        counters = self.epdctl("handoffs")["counters"]
        self.assertGreater(counters["groups"], 64, counters)
        self.assertEqual(counters["ring-fallbacks"], 0, counters)
        self.assertEqual(counters["committed"], len(specs), counters)


if __name__ == "__main__":
    unittest.main()
