# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.feature against a real epdd: produce, publish, hit across clients, coalescing,
a producer that goes away, named errors."""

import errno
import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epd  # noqa: E402
import epd.feature as ef  # noqa: E402
from test_binding import Daemon  # noqa: E402

BUNDLE = [ef.Tensor("image_embeds", "bfloat16", (16, 64)),
          ef.Tensor("grid_thw", "i64", (1, 3), offset=16 * 64 * 2)]
NBYTES = 16 * 64 * 2 + 24


class FeatureTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon()

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def test_produce_wait_hit(self):
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("prefill", "m", "cpu")
            b.register("prefill", "m", "cpu")
            p = ef.Feature.acquire(a, "img:1", may_produce=True)
            self.assertEqual(p.result, "produce")
            w = ef.Feature.acquire(b, "img:1", may_produce=True)
            self.assertEqual(w.result, "wait")
            self.assertFalse(w.wait(0.05))
            p.produce(NBYTES, BUNDLE, request_id="0123456789abcdef0123456789abcdef")
            p.buffer()[:4] = b"\x01\x02\x03\x04"
            p.buffer(16 * 64 * 2, 24)[:8] = (7).to_bytes(8, "little")
            p.publish(1000)
            self.assertTrue(w.wait(5))
            self.assertEqual(bytes(w.buffer()[:4]), b"\x01\x02\x03\x04")
            self.assertEqual(w.request_id, "0123456789abcdef0123456789abcdef")
            self.assertEqual([t.name for t in w.tensors], ["image_embeds", "grid_thw"])
            self.assertEqual(w.tensors[0].strides, (64, 1))
            try:
                import numpy  # noqa: F401
                self.assertEqual(int(w.numpy("grid_thw")[0, 0]), 7)
            except ImportError:
                pass
            w.release()
            p.release()
            with ef.Feature.acquire(b, "img:1") as h:
                self.assertEqual(h.result, "hit")
            self.assertEqual(ef.prefetch(b, ["img:1", "img:2"]), 1)

    def test_producer_gone_and_errors(self):
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("encoder", "m", "cpu")
            b.register("prefill", "m", "cpu")
            p = ef.Feature.reserve(a, "img:x", NBYTES, BUNDLE)
            w = ef.Feature.acquire(b, "img:x")
            self.assertEqual(w.result, "wait")
            p.release()  # before publishing
            with self.assertRaises(epd.EpdError) as e:
                w.wait(10)
            self.assertEqual(e.exception.errno, errno.EPIPE)
            self.assertEqual(w.error, "producer-gone")
            w.release()
            bad = [ef.Tensor("a", "f32", (4,)), ef.Tensor("b", "f32", (4,), offset=8)]
            with self.assertRaises(epd.EpdError) as e:
                ef.Feature.reserve(a, "img:y", 32, bad)
            self.assertIn("overlap", str(e.exception))
            with self.assertRaises(epd.EpdError) as e:
                ef.Feature.acquire(b, "img:none")
            self.assertEqual(e.exception.errno, errno.ENOENT)


if __name__ == "__main__":
    unittest.main()
