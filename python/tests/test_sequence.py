# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.sequence against a real epdd: create, write, clone (no copy), copy-on-write,
publish and reuse by prefix, grants, named errors."""

import os
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epd  # noqa: E402
import epd.sequence  # noqa: E402
from test_binding import Daemon  # noqa: E402

KV = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=256, v_bytes_per_token=256)


class SequenceTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon()

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def test_clone_cow_prefix(self):
        with epd.Client(self.d.address) as c:
            c.register("prefill", "qwen3-vl-test", "cpu", kv=KV)
            s = epd.sequence.Sequence.create(c, "host0", 3)
            self.assertEqual(len(s.pages), 3)
            self.assertEqual(s.page_size, 4 * 16 * 512)
            s.page_buffer(1)[:3] = b"abc"
            b = s.clone()
            self.assertEqual(b.pages, s.pages)
            pages, copied = b.prepare_write(1, 1)
            self.assertEqual(copied, 1)
            self.assertNotEqual(pages[0], s.pages[1])
            self.assertEqual(bytes(b.page_buffer(1)[:3]), b"abc")  # the daemon copied the bytes
            b.page_buffer(1)[:3] = b"xyz"
            self.assertEqual(bytes(s.page_buffer(1)[:3]), b"abc")  # the original is untouched

            hashes = [11, 12, 13]
            self.assertEqual(s.publish(0, hashes), 3)
            s.release()
            self.assertEqual(epd.sequence.prefix_match(c, "host0", hashes + [14]), 3)
            t, n = epd.sequence.Sequence.from_prefix(c, "host0", hashes + [14])
            self.assertEqual(n, 3)
            self.assertEqual(bytes(t.page_buffer(1)[:3]), b"abc")
            with self.assertRaises(epd.EpdError) as e:
                epd.sequence.Sequence.create(c, "host0", 200000)
            self.assertEqual(e.exception.name, "org.epd1.Error.NoSpace")

    def test_out_of_range_counts_refused(self):
        """A page count, page number or hash outside its C type is ValueError naming it,
        before libepd: ctypes kept the low bits (create(2**32 + 3) made 3 pages,
        truncate(2**32) dropped every page, prepare_write(2**32 + 1, 1) copied page 1, a
        hash 2**64 + 11 matched the block of hash 11)."""
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cpu", kv=KV)
            for n in (2**32 + 3, -1, 2.0):
                with self.assertRaises(ValueError) as e:
                    epd.sequence.Sequence.create(c, "host0", n)
                self.assertIn("n_pages", str(e.exception))
            s = epd.sequence.Sequence.create(c, "host0", 4)
            pages = s.pages
            for call, word in ((lambda: s.truncate(2**32), "n_pages"), (lambda: s.truncate(-1), "n_pages"),
                               (lambda: s.append(2**32 + 1), "n_pages"),
                               (lambda: s.prepare_write(2**32 + 1, 1), "first"),
                               (lambda: s.prepare_write(0, 2**32), "count"),
                               (lambda: s.publish(2**32, [11]), "first"),
                               (lambda: s.publish(0, [11, 2**64 + 12]), "hashes[1]"),
                               (lambda: s.publish(0, [-1]), "hashes[0]")):
                with self.assertRaises(ValueError) as e:
                    call()
                self.assertIn(word, str(e.exception))
            self.assertEqual(s.pages, pages)  # nothing reached the daemon
            self.assertEqual(s.publish(0, [11]), 1)
            with self.assertRaises(ValueError):
                epd.sequence.prefix_match(c, "host0", [2**64 + 11])
            with self.assertRaises(ValueError):
                epd.sequence.Sequence.from_prefix(c, "host0", [2**64 + 11])
            self.assertEqual(epd.sequence.prefix_match(c, "host0", [11]), 1)
            s.release()

    def test_arena_of_a_sequence_by_path(self):
        """A Sequence made from its path alone (a granted one, say) finds its arena from
        the daemon: page_buffer() views the pages where they are, not in host0."""
        self.d.stop()
        self.d = Daemon("[Arena:host0]\nUsage=kv\nSize=16M\n[Arena:kv1]\nUsage=kv\nSize=16M\n")
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("prefill", "m", "cpu", kv=KV, arenas=["host0", "kv1"])
            b.register("decode", "m", "cpu", kv=KV, arenas=["host0", "kv1"])
            s = epd.sequence.Sequence.create(a, "kv1", 2)
            s.page_buffer(1)[:5] = b"kv1!!"
            s.grant(b.worker_path)
            theirs = epd.sequence.Sequence(b, s.path)
            self.assertEqual(theirs.arena, "kv1")
            self.assertEqual(bytes(theirs.page_buffer(1)[:5]), b"kv1!!")
            clone = theirs.clone()
            self.assertEqual(clone.arena, "kv1")
            self.assertEqual(bytes(clone.page_buffer(1)[:5]), b"kv1!!")
            clone.release()
            s.release()

    def test_grant(self):
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("prefill", "m", "cpu", kv=KV)
            b.register("decode", "m", "cpu", kv=KV)
            s = epd.sequence.Sequence.create(a, "host0", 2)
            theirs = epd.sequence.Sequence(b, s.path, "host0")
            with self.assertRaises(epd.EpdError) as e:
                theirs.clone()
            self.assertEqual(e.exception.name, "org.epd1.Error.PermissionDenied")
            s.grant(b.worker_path)
            mine = theirs.clone()
            self.assertEqual(mine.pages, s.pages)
            with self.assertRaises(epd.EpdError):
                theirs.release()
            mine.release()


if __name__ == "__main__":
    unittest.main()
