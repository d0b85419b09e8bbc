# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.workflow against a real epdd (with its WAL): create over a sequence, fork branches
(copy-on-write clones: same pages, no byte copied), advance with prefix reuse and
segment matches, merge, drop, release, the branch listing, named errors, and that
nothing is retained afterwards. No torch, no numpy."""

import json
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epd  # noqa: E402
import epd.sequence  # noqa: E402
import epd.workflow as ew  # noqa: E402
from test_binding import Daemon  # noqa: E402

T = 16  # tokens per block
KV = epd.KvLayout(layers=2, tokens_per_block=T, k_bytes_per_token=128, v_bytes_per_token=128)


class WorkflowTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon(state=True)

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def epdctl(self, *args):
        out = subprocess.run([os.environ["EPDCTL"], "-A", self.d.address, "--json", *args],
                             check=True, stdout=subprocess.PIPE).stdout
        return json.loads(out)

    def free_pages(self):
        kv = [p for p in self.epdctl("pages")["pools"] if p["arena"] == "host0"][0]
        return kv["free"], kv["total"]

    def test_fork_advance_merge_release(self):
        with epd.Client(self.d.address) as c:
            c.register("decode", "qwen3-vl-test", "cpu", kv=KV)
            prompt = list(range(1000, 1000 + 4 * T))          # 4 full blocks
            root = epd.sequence.Sequence.create(c, "host0", 4)
            for i in range(4):
                root.page_buffer(i)[:4] = bytes([i + 1] * 4)
            wf = ew.Workflow.create(c, root.path, prompt, arena="host0")
            self.assertEqual(len(wf.id), 32)
            root_pages = root.pages
            root.release()                                    # the workflow holds its own clone
            self.assertEqual(wf.head(0).pages, root_pages)

            # Fork: a new branch on the same pages.
            b1, h1 = wf.fork(0)
            b2, h2 = wf.fork(0)
            self.assertEqual((b1, b2), (1, 2))
            self.assertEqual(h1.pages, root_pages)
            self.assertEqual(h2.pages, root_pages)

            # Advance: the same first 2.5 blocks, then new tokens: 2 pages shared.
            tokens1 = prompt[: 2 * T + 8] + [7] * 30
            s1 = wf.advance(b1, tokens1)
            self.assertEqual(s1.prefix_blocks, 2)
            self.assertEqual(s1.segments, [])
            self.assertEqual(s1.head.pages, root_pages[:2])
            self.assertEqual(bytes(s1.head.page_buffer(1)[:4]), b"\x02" * 4)  # the same bytes, not a copy
            new = s1.head.append(3)                           # the rest is the worker's to compute
            self.assertEqual(len(new), 3)
            self.assertTrue(set(new).isdisjoint(root_pages))
            s1.head.page_buffer(2)[:4] = b"b1b1"
            # A write into a shared page copies it first; the other branch keeps its bytes.
            pages, copied = s1.head.prepare_write(1, 1)
            self.assertEqual(copied, 1)
            self.assertNotEqual(pages[0], root_pages[1])
            s1.head.page_buffer(1)[:4] = b"XXXX"
            self.assertEqual(bytes(h2.page_buffer(1)[:4]), b"\x02" * 4)

            # Segments: block 3 of the predecessor reappears at a block-aligned offset.
            tokens2 = [5] * T + prompt[3 * T: 4 * T] + [6] * T
            s2 = wf.advance(b2, tokens2, segments=True)
            self.assertEqual(s2.prefix_blocks, 0)
            self.assertEqual(s2.segments, [ew.Segment(3, 1, T, True)])

            br = wf.branches()
            self.assertEqual([b.branch for b in br], [0, 1, 2])
            self.assertTrue(all(b.alive for b in br))
            self.assertEqual(br[1].n_tokens, len(tokens1))
            self.assertEqual(br[1].steps, 1)
            self.assertEqual(br[1].head, s1.head.path)

            # Merge 1 into 2: 2 adopts 1's head; drop 0; errors are named.
            wf.merge(b1, b2)
            br = wf.branches()
            self.assertFalse(br[1].alive)
            self.assertEqual(br[2].head, s1.head.path)
            wf.drop(0)
            with self.assertRaises(epd.EpdError) as e:
                wf.fork(0)
            self.assertEqual(e.exception.name, "org.epd1.Error.NotFound")
            with self.assertRaises(epd.EpdError) as e:
                wf.advance(9, tokens1)
            self.assertEqual(e.exception.name, "org.epd1.Error.NotFound")
            with epd.Client(self.d.address) as other:
                other.register("decode", "qwen3-vl-test", "cpu", kv=KV)
                with self.assertRaises(epd.EpdError) as e:
                    ew.Workflow(other, wf.id).fork(2)
                self.assertEqual(e.exception.name, "org.epd1.Error.PermissionDenied")
            self.assertEqual(self.epdctl("journal")["workflows"], 1)
            wf.release()
            with self.assertRaises(epd.EpdError) as e:
                wf.branches()
            self.assertEqual(e.exception.name, "org.epd1.Error.NotFound")
            self.assertEqual(self.epdctl("journal")["workflows"], 0)
            free, total = self.free_pages()
            self.assertEqual(free, total)

    def test_out_of_range_branches_refused(self):
        """A branch number or token outside uint32_t is ValueError naming it, before
        libepd: ctypes kept the low bits (fork(2**32) forked branch 0, drop(2**32) dropped
        it, a token 2**32 + 5 was token 5)."""
        with epd.Client(self.d.address) as c:
            c.register("decode", "qwen3-vl-test", "cpu", kv=KV)
            root = epd.sequence.Sequence.create(c, "host0", 1)
            with self.assertRaises(ValueError) as e:
                ew.Workflow.create(c, root.path, list(range(T - 1)) + [-1], arena="host0")
            self.assertIn("tokens[15]", str(e.exception))
            wf = ew.Workflow.create(c, root.path, list(range(T)), arena="host0")
            root.release()
            for call, word in ((lambda: wf.fork(2**32), "branch"), (lambda: wf.drop(2**32), "branch"),
                               (lambda: wf.advance(2**32, list(range(T))), "branch"),
                               (lambda: wf.advance(0, [2**32 + 5] * T), "tokens[0]"),
                               (lambda: wf.merge(2**32, 0), "source"), (lambda: wf.merge(0, -1), "into")):
                with self.assertRaises(ValueError) as e:
                    call()
                self.assertIn(word, str(e.exception))
            self.assertEqual([(b.branch, b.alive, b.steps) for b in wf.branches()], [(0, True, 0)])
            wf.release()

    def test_branch_ids_limit_named(self):
        """Branch ids are not reused: after 63 forks (dropped or not) a workflow takes no
        more, and the refusal says which limit it hit."""
        with epd.Client(self.d.address) as c:
            c.register("decode", "qwen3-vl-test", "cpu", kv=KV)
            root = epd.sequence.Sequence.create(c, "host0", 1)
            wf = ew.Workflow.create(c, root.path, list(range(T)), arena="host0")
            root.release()
            for _ in range(63):
                b, h = wf.fork(0)
                wf.drop(b)
            with self.assertRaises(epd.EpdError) as e:
                wf.fork(0)
            self.assertEqual(e.exception.name, "org.epd1.Error.LimitExceeded")
            self.assertIn("64 branch ids per workflow", str(e.exception))
            wf.release()

    def test_advance_needs_block_size(self):
        """Advance shares the pages of the common prefix, in whole blocks: a caller whose
        block size (its KV layout's tokens per page) is unknown is refused, not answered
        with a guessed one that could share pages holding other tokens."""
        with epd.Client(self.d.address) as k, epd.Client(self.d.address) as c:
            k.register("prefill", "qwen3-vl-test", "cpu", kv=KV)  # the arena's page size
            c.register("decode", "qwen3-vl-test", "cpu")           # no KV layout
            root = epd.sequence.Sequence.create(c, "host0", 2)
            wf = ew.Workflow.create(c, root.path, list(range(2 * T)), arena="host0")
            root.release()
            with self.assertRaises(epd.EpdError) as e:
                wf.advance(0, list(range(T)) + [9] * T)
            self.assertEqual(e.exception.name, "org.epd1.Error.InvalidArgument")
            self.assertIn("no KV layout", str(e.exception))
            wf.release()

    def test_advance_segments_block_limit_named(self):
        """Segments are matched in blocks of at most 4096 tokens: a caller with larger
        blocks that asks for them is refused with the limit and its block size named,
        and the prefix alone is still served."""
        big = epd.KvLayout(layers=1, tokens_per_block=8192, k_bytes_per_token=2, v_bytes_per_token=2)
        with epd.Client(self.d.address) as c:
            c.register("decode", "qwen3-vl-test", "cpu", kv=big)
            root = epd.sequence.Sequence.create(c, "host0", 1)
            wf = ew.Workflow.create(c, root.path, list(range(8192)), arena="host0")
            root.release()
            with self.assertRaises(epd.EpdError) as e:
                wf.advance(0, list(range(8192)) + [7], segments=True)
            self.assertEqual(e.exception.name, "org.epd1.Error.InvalidArgument")
            self.assertIn("at most 4096 tokens", str(e.exception))
            self.assertIn("8192 tokens per page", str(e.exception))
            wf.advance(0, list(range(8192)) + [7])
            wf.release()
        free, total = self.free_pages()
        self.assertEqual(free, total)

    def test_client_gone_releases(self):
        """A workflow and its branches go with the client that made them."""
        c = epd.Client(self.d.address)
        c.register("decode", "qwen3-vl-test", "cpu", kv=KV)
        root = epd.sequence.Sequence.create(c, "host0", 2)
        wf = ew.Workflow.create(c, root.path, list(range(2 * T)))
        wf.fork(0)
        wf.fork(1)
        self.assertEqual(self.epdctl("journal")["workflows"], 1)
        c.close()
        self.assertEqual(self.epdctl("journal")["workflows"], 0)
        free, total = self.free_pages()
        self.assertEqual(free, total)

    def test_needs_registration(self):
        with epd.Client(self.d.address) as c:
            with self.assertRaises(epd.EpdError) as e:
                ew.Workflow.create(c, "/org/epd1/sequence/00000000000000000000000000000000", [1, 2])
            self.assertIsNotNone(e.exception.name)


if __name__ == "__main__":
    unittest.main()
