# SPDX-License-Identifier: LGPL-2.1-or-later
"""The vLLM-named connector hooks (epd.workers.hooks) against a real epdd, without torch:
a prefill saves layer by layer, a decode loads layer by layer, transfers finish by
request id as vLLM's KVConnectorBase_V1 says (a send only for a request the engine
finished and request_finished() delayed, a receive when it is complete), and nothing is
left behind; the encoder-cache side skips the encoder on a hit and lends features until
get_finished."""

import ctypes
import json
import os
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_binding import Daemon  # noqa: E402

try:
    import numpy as np
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False

LAYERS, HEADS, DIM, TOKENS = 4, 2, 64, 37  # pages of 32 KiB (host0's); the last one partial


def names():
    return {f"layers.{i}.attn": None for i in range(LAYERS)}


@unittest.skipUnless(HAVE_NUMPY, "numpy not installed")
class HooksTest(unittest.TestCase):
    def setUp(self):
        from epd import Client, KvLayout
        from epd.handoff import Ring
        from epd.workers import connector as C
        self.d = Daemon()
        self.layout = C.KvPageLayout(LAYERS, 16, HEADS, DIM, 2)
        kv = KvLayout(LAYERS, 16, self.layout.k_bytes_per_token, self.layout.v_bytes_per_token, "float16")
        self.p, self.c = Client(self.d.address), Client(self.d.address)
        self.p.register("prefill", "m", "cpu", kv=kv)
        self.c.register("decode", "m", "cpu", kv=kv)
        self.rp, self.rc = Ring(self.p), Ring(self.c)

    def tearDown(self):
        for x in (self.rp, self.rc, self.p, self.c):
            x.close()
        self.assertEqual(self.d.stop(), 0)

    def epdctl(self, *args):
        out = subprocess.run([os.environ["EPDCTL"], "-A", self.d.address, "--json", *args],
                             check=True, stdout=subprocess.PIPE).stdout
        return json.loads(out)

    def assert_nothing_held(self):
        """No sequence, no handoff, every page of the KV arena free."""
        self.assertEqual(self.epdctl("sequences"), [])
        self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])
        pools = self.epdctl("pages")["pools"]
        kv = [p for p in pools if p["arena"] == "host0"][0]
        self.assertEqual(kv["free"], kv["total"], pools)

    def kv(self, layer):
        rng = np.random.default_rng(layer)
        k = rng.standard_normal((1, HEADS, TOKENS, DIM)).astype(np.float16)
        return k, (k * 3).astype(np.float16)

    def test_layerwise_save_load_and_finish(self):
        self._save_load("ab" * 16, background=False)

    def test_layerwise_save_with_background_setup(self):
        """The save's sequence and Prepare on a thread while the caller goes on: the same
        bytes, the same cleanup."""
        self._save_load("ac" * 16, background=True)

    def test_background_setup_failure_reaches_the_first_save(self):
        from epd import EpdError
        from epd.workers import hooks as H
        prod = H.EpdKvConnector(self.p, self.layout, "producer", arena="nosuch", ring=self.rp,
                                dtype="float16", background_setup=True)
        prod.register_kv_caches(names())
        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer("ad" * 16, TOKENS)]))
        with self.assertRaises(EpdError) as e:
            prod.save_kv_layer("layers.0.attn", self.kv(0))
        self.assertEqual(e.exception.name, "org.epd1.Error.NotFound")
        prod.shutdown()
        self.assertEqual(self.epdctl("sequences"), [])
        self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])

    def test_failed_notifier_setup_holds_nothing(self):
        """A GPU arena's save takes the ring's notifier in its setup; when that fails, the
        setup lets go of the sequence and the handoff it made (a failed setup holds
        nothing), in the background and in the constructor alike. (A host arena that
        says it is a GPU one reaches that step without a GPU.)"""
        from unittest import mock
        from epd.workers import connector as C
        from epd.workers import hooks as H

        class GpuLikePages(C.KvPages):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                self.on_gpu, self._m = True, type("M", (), {"ordinal": 0})()

            def prepare(self):
                pass

        def no_notifier(ring, ordinal):
            raise OSError(12, "no notifier")

        with mock.patch.object(C, "KvPages", GpuLikePages), mock.patch.object(C, "_notifier", no_notifier):
            with self.assertRaises(OSError):
                C.EpdKvSink(self.p, "host0", self.layout, "ae" * 16, TOKENS, [LAYERS], ring=self.rp)
            self.assertEqual(self.epdctl("sequences"), [])
            self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])
            prod = H.EpdKvConnector(self.p, self.layout, "producer", ring=self.rp, dtype="float16",
                                    background_setup=True)
            prod.register_kv_caches(names())
            rid = "af" * 16
            prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(rid, TOKENS)]))
            with self.assertRaises(OSError):
                prod.save_kv_layer("layers.0.attn", self.kv(0))
            prod.clear_connector_metadata()
            self.assertEqual(prod.request_finished(rid), (False, None))
            self.assertEqual(prod.get_finished({rid}), (None, None))
            self.assertEqual(self.epdctl("sequences"), [])
            self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])
            prod.shutdown()

    def test_failed_save_does_not_hold_up_the_others(self):
        """A save whose background setup failed holds nothing: request_finished says so
        (no delay), get_finished forgets it without reporting it (vLLM expects a request
        in finished_sending only if it was told to wait for it), and a later save the
        engine delays is reported as usual (it does not raise its error at every call)."""
        from epd import EpdError
        from epd.workers import hooks as H
        prod = H.EpdKvConnector(self.p, self.layout, "producer", group_size=2, ring=self.rp, dtype="float16",
                                background_setup=True)
        cons = H.EpdKvConnector(self.c, self.layout, "consumer", group_size=2, ring=self.rc, dtype="float16")
        prod.register_kv_caches(names())
        cons.register_kv_caches(names())
        bad, good = "b1" * 16, "b2" * 16
        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(bad, 10 ** 8)]))  # no room
        with self.assertRaises(EpdError):
            prod.save_kv_layer(0, self.kv(0))
        prod.clear_connector_metadata()
        self.assertEqual(prod.request_finished(bad), (False, None))
        # Not delayed, so never reported as sent: vLLM freed it already.
        self.assertEqual(prod.get_finished({bad}), (None, None))
        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(good, TOKENS)]))
        cons.bind_connector_metadata(cons.build_connector_meta(loads=[H.KvTransfer(good, TOKENS)]))
        cons.start_load_kv()
        for layer in range(LAYERS):
            prod.save_kv_layer(layer, self.kv(layer))
        prod.wait_for_save()
        prod.clear_connector_metadata()
        for layer in range(LAYERS):
            cons.wait_for_layer_load(layer)
        cons.clear_connector_metadata()
        self.assertEqual(cons.get_finished({good}), (None, {good}))
        self.assertTrue(prod.request_finished(good)[0])
        sent, deadline = None, time.monotonic() + 10
        while sent is None and time.monotonic() < deadline:
            sent, _ = prod.get_finished({good})
            if sent is None:
                self.rp.poll(0.05)
        self.assertEqual(sent, {good})
        prod.shutdown()
        cons.shutdown()
        self.assertEqual(self.epdctl("sequences"), [])
        self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])

    def test_sends_reported_only_when_delayed(self):
        """vLLM's contract (KVConnectorBase_V1): get_finished() reports a finished send only
        for a request whose request_finished() returned delay_free_blocks=True (the
        scheduler asserts it waited for each id reported and frees its blocks). A save the
        engine did not delay is released all the same once the decode is done with it,
        without a word. The decision may come in the connector metadata (`delayed`: an
        adapter's request_finished runs on the scheduler side, another process). Loads
        are reported when complete, before the engine has finished the requests."""
        from epd.workers import hooks as H
        prod = H.EpdKvConnector(self.p, self.layout, "producer", group_size=2, ring=self.rp, dtype="float16")
        cons = H.EpdKvConnector(self.c, self.layout, "consumer", group_size=2, ring=self.rc, dtype="float16")
        prod.register_kv_caches(names())
        cons.register_kv_caches(names())
        quiet, told, carried = "d1" * 16, "d2" * 16, "d3" * 16
        rids = (quiet, told, carried)
        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(r, TOKENS) for r in rids]))
        cons.bind_connector_metadata(cons.build_connector_meta(loads=[H.KvTransfer(r, TOKENS) for r in rids]))
        cons.start_load_kv()
        for layer in range(LAYERS):
            prod.save_kv_layer(layer, {r: self.kv(layer) for r in rids})
        prod.wait_for_save()
        prod.clear_connector_metadata()
        for layer in range(LAYERS):
            got = cons.wait_for_layer_load(layer)
            for r in rids:
                np.testing.assert_array_equal(got[r][0], self.kv(layer)[0])
        cons.clear_connector_metadata()

        def finish(ids):
            """get_finished(ids) until their saves are released: what it reported, in order."""
            reported, deadline = [], time.monotonic() + 10
            while set(ids) & set(prod._sinks) and time.monotonic() < deadline:
                sent, received = prod.get_finished(set(ids))
                self.assertIsNone(received)
                reported += sorted(sent or ())
                if set(ids) & set(prod._sinks):
                    self.rp.poll(0.05)
            self.assertFalse(set(ids) & set(prod._sinks), "the saves were not released within 10 s")
            return reported
        self.assertEqual(prod.request_finished(told)[0], True)
        self.assertEqual(finish([quiet, told]), [told], "a send reported that was never delayed")
        # The scheduler side's decision for `carried`, bound with the next step's metadata.
        prod.bind_connector_metadata(prod.build_connector_meta(delayed=[carried]))
        prod.clear_connector_metadata()
        self.assertEqual(finish([carried]), [carried])
        # The loads: reported once they are complete, before the engine has finished them.
        self.assertEqual(cons.get_finished(set()), (None, set(rids)))
        self.assertEqual(cons.get_finished(set(rids)), (None, None))
        self.assertEqual(prod.get_finished(set(rids)), (None, None))
        prod.shutdown()
        cons.shutdown()
        self.assert_nothing_held()

    def test_sink_setup_reads_its_pages_once(self):
        """EpdKvSink's setup reads the sequence's pages once, before Prepare (nothing after
        Prepare may fail: a prepared handoff and its sequence would be left behind). The
        page list was read again after Prepare; a failure of that second GetPages (here
        injected) left both in the daemon."""
        from unittest import mock
        from epd import EpdError
        from epd.sequence import Sequence
        from epd.workers import connector as C
        real = Sequence.pages
        reads = []

        def pages(seq):
            reads.append(seq.path)
            if len(reads) > 1:
                raise EpdError(5, "org.epd1.Error.Failed", "injected: GetPages after Prepare", "sequence pages")
            return real.fget(seq)
        rid = "d4" * 16
        with mock.patch.object(Sequence, "pages", property(pages)):
            try:
                sink = C.EpdKvSink(self.p, "host0", self.layout, rid, TOKENS, [LAYERS], ring=self.rp)
            except EpdError:
                self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [], "a failed setup left its handoff")
                self.assertEqual(self.epdctl("sequences"), [], "a failed setup left its sequence")
                raise
        self.assertEqual(len(reads), 1)
        self.assertEqual(sink.pages, real.fget(sink.seq))
        h = sink.handoff
        h.rollback()
        h.release()
        sink.done()
        self.assertEqual(self.epdctl("sequences"), [])
        self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])

    def test_host_kv_pages_outlive_the_registration(self):
        """KvPages over a host arena copies through a mapping of its own (the client's
        view, which it holds), not libepd's (Arena.address()), which unregister() and
        close() unmap: after an unregister its layer writes and reads still land in the
        arena's memory, and after a new registration they do not go to whatever libepd
        mapped since (here the feature arena, feat0). Run in a child process: before, the first write after the
        unregister died of SIGSEGV."""
        child = r"""
import sys
import numpy as np
from epd import Client, KvLayout
from epd.sequence import Sequence
from epd.workers import connector as C
L = C.KvPageLayout(4, 16, 2, 64, 2)
kvl = KvLayout(4, 16, L.k_bytes_per_token, L.v_bytes_per_token, "float16")
c = Client(sys.argv[1])
c.register("prefill", "m", "cpu", kv=kvl)
seq = Sequence.create(c, "host0", L.pages_for(37))
kv = C.KvPages(c, "host0", L, C._seq_offsets(c, "host0", seq.pages, L.page_size))
def t(layer):
    k = np.random.default_rng(layer).standard_normal((1, 2, 37, 64)).astype(np.float16)
    return k, (k * 3).astype(np.float16)
def check(layer):
    k, v = kv.read(layer, 37, "float16")
    assert (k == t(layer)[0]).all() and (v == t(layer)[1]).all(), f"layer {layer} differs"
kv.write(0, *t(0))
check(0)
c.unregister()
kv.write(1, *t(1))
check(0)
check(1)
c.register("encoder", "m", "cpu", arenas=["feat0"])  # another arena now
other = c.arena("feat0")
other.address()  # libepd maps the new registration's arena: maybe where host0 was
before = bytes(other.buffer())
kv.write(2, *t(2))
for layer in range(3):
    check(layer)
assert bytes(other.buffer()) == before, "a write through the old pages landed in the new mapping"
c.close()
kv.write(3, *t(3))
check(3)
print("ok")
"""
        r = subprocess.run([sys.executable, "-c", child, self.d.address], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, timeout=60)
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "ok"),
                         f"the child exited {r.returncode} (negative: killed by that signal): {r.stderr[-3000:]}")

    def test_background_setup_needs_a_ring(self):
        from epd.workers import hooks as H
        with self.assertRaises(ValueError):
            H.EpdKvConnector(self.p, self.layout, "producer", background_setup=True)

    def test_aborted_load_lets_go(self):
        """The engine finishes a request whose KV never fully loaded (aborted): the decode
        side's handoff and page tables go at get_finished, the prefill's save ends rolled
        back and is reported (the engine delayed it); the ids of requests that are neither
        saves nor loads are not kept."""
        from epd.workers import hooks as H
        rid = "b3" * 16
        prod = H.EpdKvConnector(self.p, self.layout, "producer", group_size=2, ring=self.rp, dtype="float16")
        cons = H.EpdKvConnector(self.c, self.layout, "consumer", group_size=2, ring=self.rc, dtype="float16")
        prod.register_kv_caches(names())
        cons.register_kv_caches(names())
        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(rid, TOKENS)]))
        cons.bind_connector_metadata(cons.build_connector_meta(loads=[H.KvTransfer(rid, TOKENS)]))
        cons.start_load_kv()
        prod.save_kv_layer(0, self.kv(0))  # the first group only
        prod.save_kv_layer(1, self.kv(1))
        cons.wait_for_layer_load(0)
        cons.clear_connector_metadata()
        self.assertEqual(cons.get_finished({rid, "f0" * 16}), (None, None))  # aborted: not received
        with self.assertRaises(KeyError):
            cons.source_of(rid)
        self.assertEqual(cons._finished_reqs, set())
        prod.clear_connector_metadata()
        self.assertTrue(prod.request_finished(rid)[0])
        sent, deadline = None, time.monotonic() + 10
        while sent is None and time.monotonic() < deadline:
            sent, _ = prod.get_finished({rid, "f1" * 16})
            if sent is None:
                self.rp.poll(0.05)
        self.assertEqual(sent, {rid})
        self.assertEqual(prod._finished_reqs, set())
        prod.shutdown()
        cons.shutdown()
        self.assert_nothing_held()

    def test_failed_page_map_lets_the_handoff_go(self):
        """The decode accepted a handoff and then could not map its pages (here a
        KvPages that raises, as an arena this process cannot see does): the handoff is let
        go at once, rolled back on both sides, not left to the prefill's HandoffTimeout=."""
        from epd.workers import hooks as H
        from epd.workers import connector as C
        rid = "b4" * 16
        prod = H.EpdKvConnector(self.p, self.layout, "producer", group_size=2, ring=self.rp, dtype="float16")
        cons = H.EpdKvConnector(self.c, self.layout, "consumer", group_size=2, ring=self.rc, dtype="float16")
        prod.register_kv_caches(names())
        cons.register_kv_caches(names())
        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(rid, TOKENS)]))
        prod.save_kv_layer(0, self.kv(0))
        real = C.KvPages

        def no_pages(*a, **k):
            raise OSError(19, "this process cannot see that GPU")
        C.KvPages = no_pages
        try:
            cons.bind_connector_metadata(cons.build_connector_meta(loads=[H.KvTransfer(rid, TOKENS)]))
            with self.assertRaises(OSError):
                cons.start_load_kv()
        finally:
            C.KvPages = real
        cons.clear_connector_metadata()
        for layer in range(1, LAYERS):
            try:
                prod.save_kv_layer(layer, self.kv(layer))
            except Exception:
                break  # rolled back under it
        prod.clear_connector_metadata()
        self.assertTrue(prod.request_finished(rid)[0])
        sent, deadline = None, time.monotonic() + 5
        while sent is None and time.monotonic() < deadline:
            sent, _ = prod.get_finished({rid})
            if sent is None:
                self.rp.poll(0.05)
        self.assertEqual(sent, {rid}, "the prefill's handoff did not end within 5 s")
        prod.shutdown()
        cons.shutdown()
        self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])

    def test_kept_load_reported_once(self):
        """A load kept for take_sequence() (an agent's root) is reported received once,
        as vLLM expects of each id, however often get_finished() is called before the
        sequence is taken."""
        from epd.workers import hooks as H
        rid = "c1" * 16
        prod = H.EpdKvConnector(self.p, self.layout, "producer", group_size=2, ring=self.rp, dtype="float16")
        cons = H.EpdKvConnector(self.c, self.layout, "consumer", group_size=2, ring=self.rc, dtype="float16")
        prod.register_kv_caches(names())
        cons.register_kv_caches(names())
        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(rid, TOKENS)]))
        cons.bind_connector_metadata(cons.build_connector_meta(loads=[H.KvTransfer(rid, TOKENS, keep=True)]))
        cons.start_load_kv()
        for layer in range(LAYERS):
            prod.save_kv_layer(layer, self.kv(layer))
        prod.wait_for_save()
        prod.clear_connector_metadata()
        for layer in range(LAYERS):
            cons.wait_for_layer_load(layer)
        cons.clear_connector_metadata()
        self.assertEqual(cons.get_finished({rid}), (None, {rid}))
        self.assertEqual(cons.get_finished(set()), (None, None))
        self.assertEqual(cons.get_finished({rid}), (None, None))
        seq = cons.take_sequence(rid)
        self.assertIsNotNone(seq)
        seq.release()
        self.assertTrue(prod.request_finished(rid)[0])
        deadline, sent = time.monotonic() + 10, None
        while sent is None and time.monotonic() < deadline:
            sent, _ = prod.get_finished({rid})
            if sent is None:
                self.rp.poll(0.05)
        self.assertEqual(sent, {rid})
        prod.shutdown()
        cons.shutdown()
        self.assertEqual(self.epdctl("sequences"), [])

    def _save_load(self, rid, background):
        from epd.workers import hooks as H
        prod = H.EpdKvConnector(self.p, self.layout, "producer", group_size=2, ring=self.rp, dtype="float16",
                                background_setup=background)
        cons = H.EpdKvConnector(self.c, self.layout, "consumer", group_size=2, ring=self.rc, dtype="float16")
        prod.register_kv_caches(names())
        cons.register_kv_caches(names())
        with self.assertRaises(RuntimeError):  # no metadata bound
            prod.save_kv_layer("layers.0.attn", self.kv(0))

        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(rid, TOKENS)]))
        with self.assertRaises(KeyError):
            prod.save_kv_layer("layers.7.attn", self.kv(0))
        # The decode side accepts before the prefill has written anything, then loads
        # layer by layer as the groups land.
        cons.bind_connector_metadata(cons.build_connector_meta(loads=[H.KvTransfer(rid, TOKENS)]))
        cons.start_load_kv()
        for layer in range(LAYERS):
            prod.save_kv_layer(f"layers.{layer}.attn", self.kv(layer))
        prod.wait_for_save()
        prod.clear_connector_metadata()
        delay, params = prod.request_finished(rid)
        self.assertTrue(delay)
        self.assertEqual(params["tokens"], TOKENS)
        for layer in range(LAYERS):
            k, v = cons.wait_for_layer_load(f"layers.{layer}.attn")[rid]
            ek, ev = self.kv(layer)
            np.testing.assert_array_equal(k, ek)
            np.testing.assert_array_equal(v, ev)
        cons.clear_connector_metadata()
        # Reported as soon as it is complete, before the engine says the request is
        # finished (vLLM: finished_recving when the transfer is done; the engine waits
        # for it to go on with the request), and once.
        self.assertEqual(cons.get_finished(set()), (None, {rid}))
        self.assertEqual(cons.get_finished({rid}), (None, None))
        # Not kept: the pages went back, and the connector forgot the load once it
        # reported it (an engine that never asks for a sequence leaks nothing).
        with self.assertRaises(KeyError):
            cons.source_of(rid)
        self.assertEqual(cons.get_finished({rid}), (None, None))
        self.assertIsNone(cons.take_sequence(rid))
        deadline = time.monotonic() + 10
        sent = None
        while sent is None and time.monotonic() < deadline:
            sent, _ = prod.get_finished({rid})
            if sent is None:
                self.rp.poll(0.05)
        self.assertEqual(sent, {rid})
        self.assertEqual(prod.request_finished(rid), (False, None))
        self.assert_nothing_held()

    def test_rings_let_go_mid_transfer(self):
        """The daemon lets go of both workers' rings in the middle of a transfer (here
        CloseRing; also a corrupt queue, or a client dropped for not reading its bus
        connection) while it lives on: the connectors carry on over the bus (the groups
        reported, landed and finished asked there) and open their rings again at the
        step's end, instead of raising ECONNRESET at every call from then on."""
        from epd.handoff import _lib_handoffs
        from epd.workers import hooks as H
        prod = H.EpdKvConnector(self.p, self.layout, "producer", group_size=2, ring=self.rp, dtype="float16",
                                background_setup=True)
        cons = H.EpdKvConnector(self.c, self.layout, "consumer", group_size=2, ring=self.rc, dtype="float16")
        prod.register_kv_caches(names())
        cons.register_kv_caches(names())
        rid = "e1" * 16
        prod.bind_connector_metadata(prod.build_connector_meta(saves=[H.KvTransfer(rid, TOKENS)]))
        cons.bind_connector_metadata(cons.build_connector_meta(loads=[H.KvTransfer(rid, TOKENS)]))
        cons.start_load_kv()
        for layer in range(2):  # group 0, on the ring
            prod.save_kv_layer(layer, self.kv(layer))
        np.testing.assert_array_equal(cons.wait_for_layer_load(0)[rid][0], self.kv(0)[0])
        lib = _lib_handoffs()
        for c in (self.p, self.c):
            self.assertEqual(lib.epd_ring_release(c._c, None), 0)  # the daemon's side only
        for layer in range(2, LAYERS):
            prod.save_kv_layer(layer, self.kv(layer))
        prod.wait_for_save()
        prod.clear_connector_metadata()
        self.assertTrue(prod.request_finished(rid)[0])
        for layer in range(1, LAYERS):
            np.testing.assert_array_equal(cons.wait_for_layer_load(layer)[rid][0], self.kv(layer)[0])
        cons.clear_connector_metadata()
        self.assertEqual(cons.get_finished(set()), (None, {rid}))
        sent, deadline = None, time.monotonic() + 10
        while sent is None and time.monotonic() < deadline:
            sent, _ = prod.get_finished({rid})
            if sent is None:
                time.sleep(0.05)
        self.assertEqual(sent, {rid})
        for r in (self.rp, self.rc):
            self.assertFalse(r.let_go)
            self.assertIsNone(r.next(0))  # open again
        prod.shutdown()
        cons.shutdown()
        self.assert_nothing_held()
        self._save_load("e2" * 16, background=True)  # on the rings opened again

    def test_load_times_out_named(self):
        from epd import EpdError
        from epd.workers import hooks as H
        cons = H.EpdKvConnector(self.c, self.layout, "consumer", ring=self.rc, timeout_s=0.2)
        cons.register_kv_caches(names())
        cons.bind_connector_metadata(cons.build_connector_meta(loads=[H.KvTransfer("cd" * 16, TOKENS)]))
        t0 = time.monotonic()
        with self.assertRaises(EpdError) as e:
            cons.start_load_kv()  # nobody prepares this handoff
        self.assertEqual(e.exception.name, "org.epd1.Error.Timeout")
        self.assertLess(time.monotonic() - t0, 5)

    def test_encoder_cache(self):
        from epd.workers import hooks as H
        import hashlib
        key = hashlib.sha256(b"an image").hexdigest()
        from epd import Client
        enc = Client(self.d.address)
        self.addCleanup(enc.close)
        enc.register("encoder", "m", "cpu")
        ec = H.EpdEcConnector(enc)
        self.assertFalse(ec.has_cache_item(key))
        calls = []
        feats = {"embeds": np.arange(96, dtype=np.float16).reshape(12, 8)}

        def encode():
            calls.append(1)
            return feats
        ec.save_caches({key: encode}, key, "01" * 16)
        self.assertEqual(ec.last_save[0], "produced")
        self.assertTrue(ec.has_cache_item(key))
        ec.save_caches({key: encode}, key, "02" * 16)  # a hit: the encoder does not run
        self.assertEqual((ec.last_save[0], len(calls)), ("hit", 1))

        ec2 = H.EpdEcConnector(self.p)  # the prefill reads it
        cache = {}
        ec2.bind_connector_metadata(H.EpdEcMetadata({"r1": [key]}))
        ec2.start_load_caches(cache)
        ec2.clear_connector_metadata()
        np.testing.assert_array_equal(cache[key]["embeds"], feats["embeds"])
        # A second request with the same image finds it in the engine's cache: no fetch,
        # but the pin stays until the last request reading it is finished.
        ec2.bind_connector_metadata(H.EpdEcMetadata({"r1b": [key]}))
        ec2.start_load_caches(cache)
        ec2.clear_connector_metadata()
        # (A host arena's fetch copies and lets go of its handle at once: the pin is the
        # connector's, which matters for a GPU arena's views.)
        self.assertEqual(ec2.get_finished({"r1"}), (None, {"r1"}))
        self.assertEqual(ec2._pins[key][1], {"r1b"})
        self.assertEqual(ec2.get_finished({"r1b"}), (None, {"r1b"}))
        self.assertEqual(ec2._pins, {})
        self.assertEqual(self.epdctl("features")["handles"], 0)

        # With a shape key, the layout of the first output of that key is reserved with
        # the next Acquire (one call); the bytes are the encoder's all the same.
        from epd.workers import connector as C
        made = []

        def encode2(i):
            out = {"embeds": np.full((12, 8), i, dtype=np.float16)}
            made.append(i)
            return out
        for i in range(3):
            k = hashlib.sha256(b"image %d" % i).hexdigest()
            # overlap: runs while the Acquire is on its way, once the layout is known (the
            # second image on), before the encoder
            ec.save_caches({k: lambda i=i: encode2(i)}, k, "03" * 16, shape_key=("12x8",),
                           overlap=lambda i=i: made.append(("overlap", i)))
            self.assertEqual(ec.last_save[0], "produced")
            self.assertEqual("overlap" in ec.last_save_detail, i > 0)
            ec2.bind_connector_metadata(H.EpdEcMetadata({"r2": [k]}))
            cache = {}
            ec2.start_load_caches(cache)
            ec2.clear_connector_metadata()
            np.testing.assert_array_equal(cache[k]["embeds"], np.full((12, 8), i, dtype=np.float16))
            ec2.get_finished({"r2"})
        self.assertEqual(made, [0, ("overlap", 1), 1, ("overlap", 2), 2])
        # A hit runs the overlap too (it cannot know the answer beforehand), not the encoder.
        ec.save_caches({k: lambda: encode2(7)}, k, "05" * 16, shape_key=("12x8",),
                       overlap=lambda: made.append(("overlap", "hit")))
        self.assertEqual((ec.last_save[0], made[-1]), ("hit", ("overlap", "hit")))
        del made[-1]
        # An overlap that raises: the error reaches the caller, and the reservation the
        # answer brought is failed at once (another encoder may produce the key now).
        k3 = hashlib.sha256(b"image overlap fails").hexdigest()

        def boom():
            raise RuntimeError("upload failed")
        with self.assertRaises(RuntimeError):
            ec.save_caches({k3: lambda: encode2(3)}, k3, "06" * 16, shape_key=("12x8",), overlap=boom)
        from epd import feature as ef
        other = ef.Feature.acquire(self.p, k3, may_produce=True)
        self.assertEqual(other.result, "produce")
        other.fail("test")
        other.release()
        self.assertEqual(ec._layouts[("12x8",)], C._layout(encode2(9)))
        # An output that does not match the reserved layout fails the feature, named.
        k = hashlib.sha256(b"image odd").hexdigest()
        with self.assertRaises(ValueError):
            ec.save_caches({k: lambda: {"embeds": np.zeros((13, 8), np.float16)}}, k, "04" * 16,
                           shape_key=("12x8",))
        self.assertFalse(ec.has_cache_item(k))
        self.assertEqual(ec._layouts[("12x8",)], C._layout(encode2(9)))  # not taught by the odd one
        ec.shutdown()

    def test_encoder_cache_entry_goes_with_its_last_pin(self):
        """A feature fetched into the engine's cache leaves it when the last request reading
        it is finished: a later request with the same image fetches and pins it again
        rather than reading views whose handle is gone."""
        from epd.workers import hooks as H
        import hashlib
        from epd import Client
        key = hashlib.sha256(b"another image").hexdigest()
        enc = Client(self.d.address)
        self.addCleanup(enc.close)
        enc.register("encoder", "m", "cpu")
        ec = H.EpdEcConnector(enc)
        feats = {"embeds": np.arange(48, dtype=np.float16).reshape(6, 8)}
        ec.save_caches({key: lambda: feats}, key, "05" * 16)
        ec2 = H.EpdEcConnector(self.p)
        cache = {}
        ec2.start_load_caches(cache, loads={"r1": [key]})
        first = cache[key]
        self.assertEqual(ec2.get_finished({"r1"}), (None, {"r1"}))
        self.assertNotIn(key, cache)  # its pin is gone: so is the engine's entry
        ec2.start_load_caches(cache, loads={"r3": [key]})
        self.assertIsNot(cache[key], first)
        self.assertEqual(ec2._pins[key][1], {"r3"})
        np.testing.assert_array_equal(cache[key]["embeds"], feats["embeds"])
        # The engine's own entry (not fetched here) is left alone.
        own = {"embeds": feats["embeds"]}
        mine = {key: own}
        ec2.start_load_caches(mine, loads={"r4": [key]})
        self.assertIs(mine[key], own)
        ec2.get_finished({"r3", "r4"})
        self.assertEqual(ec2._pins, {})
        self.assertNotIn(key, cache)
        self.assertIs(mine[key], own)
        ec.shutdown()
        ec2.shutdown()


class _FakeTorchTensor:
    """Just what KvPages._many_rows reads of a torch tensor (no torch in CI)."""

    def __init__(self, ptr, shape=(1, 2, 37, 8), strides=None, dtype="bfloat16"):
        self._ptr, self.shape, self.dtype = ptr, shape, dtype
        self._strides = strides or (2 * 37 * 8, 37 * 8, 8, 1)

    def data_ptr(self):
        return self._ptr

    def stride(self):
        return self._strides

    def element_size(self):
        return 2


_FakeTorchTensor.__module__ = "torch.fake"


class ManyRowsTest(unittest.TestCase):
    """The batched KV copies' rows, built column by column, equal the per-layer rows."""

    def test_columns_equal_per_layer_rows(self):
        from epd.workers import connector as C
        from epd import gpu as G
        pages = object.__new__(C.KvPages)
        pages.layout = C.KvPageLayout(layers=40, tokens_per_block=16, kv_heads=2, head_dim=8, elem_size=2)
        layers = [0, 3, 4, 17, 39]
        items = [(i, _FakeTorchTensor(0x7f0000000000 + 4096 * i), _FakeTorchTensor(0x7f1000000000 + 8192 * i))
                 for i in layers]
        rows = pages._many_rows(items, 37)
        self.assertEqual(len(rows), len(items))
        for r, (layer, k, v) in zip(rows, items):
            want = pages._rows(layer, k, v, 37)
            self.assertEqual(bytes(r), bytes(want), layer)
            self.assertEqual((r.k, r.v, r.heads, r.tokens_per_page), (k.data_ptr(), v.data_ptr(), 2, 16))
        self.assertEqual(ctypes.sizeof(G.KvRows), 72)
        # A layer of another shape: no batched rows.
        odd = items + [(5, _FakeTorchTensor(1 << 40, shape=(1, 2, 36, 8)), _FakeTorchTensor(2 << 40))]
        self.assertIsNone(pages._many_rows(odd, 37))


if __name__ == "__main__":
    unittest.main()
