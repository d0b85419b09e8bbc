# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.placement against a real epdd (one host: the directory's owner is this host):
the longest cached prefix, the worker that published it, named errors."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epd  # noqa: E402
import epd.placement  # noqa: E402
import epd.sequence  # noqa: E402
from test_binding import Daemon  # noqa: E402

KV = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=256, v_bytes_per_token=256)


class PlacementTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon()

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def test_locate(self):
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cpu", kv=KV, name="prefill-0")
            s = epd.sequence.Sequence.create(c, "host0", 4)
            chain = [101, 102, 103, 104]
            self.assertEqual(s.publish(0, chain[:3]), 3)
            p = epd.placement.locate_prefix(c, chain)
            self.assertEqual((p.n_blocks, p.host, p.arena, p.worker, p.owners_missing),
                             (3, "py-host", "host0", "prefill-0", 0))
            self.assertEqual(p.candidates, [epd.placement.Candidate("py-host", "host0", "prefill-0", 3)])
            # A chain that diverges at its second block: the prefix up to it.
            self.assertEqual(epd.placement.locate_prefix(c, [101, 999, 103]).n_blocks, 1)
            # Nobody holds the first block.
            p = epd.placement.locate_prefix(c, [7, 101])
            self.assertEqual((p.n_blocks, p.host, p.candidates), (0, "", []))
            # Released sequences leave their blocks cached: still found.
            s.release()
            self.assertEqual(epd.placement.locate_prefix(c, chain).n_blocks, 3)
            with self.assertRaises(epd.EpdError) as e:
                epd.placement.locate_prefix(c, [])
            self.assertEqual(e.exception.name, "org.epd1.Error.InvalidArgument")
            with self.assertRaises(epd.EpdError) as e:
                epd.placement.locate_prefix(c, list(range(65537)))
            self.assertEqual(e.exception.name, "org.epd1.Error.LimitExceeded")


if __name__ == "__main__":
    unittest.main()
