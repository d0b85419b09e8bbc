# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.feature against a real epdd: produce, publish, hit across clients, coalescing,
a producer that goes away, named errors."""

import errno
import json
import os
import subprocess
import sys
import threading
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
            self.assertFalse(w.wait(-0.001))  # a deadline passed: no wait (not forever)
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
            # A feature described under a registration that is gone: its arena index and
            # data pointer are of the old mappings. buffer() refuses it until refresh()
            # (before, it viewed the arena of that index in the new registration).
            h = ef.Feature.acquire(b, "img:1")
            b.unregister()
            b.register("prefill", "m", "cpu")
            with self.assertRaises(epd.EpdError) as cm:
                h.buffer()
            self.assertEqual(cm.exception.errno, errno.ESTALE)
            h.refresh()
            self.assertEqual(bytes(h.buffer()[:4]), b"\x01\x02\x03\x04")
            h.release()

    def handles(self):
        out = subprocess.run([os.environ["EPDCTL"], "-A", self.d.address, "--json", "features"], check=True,
                             stdout=subprocess.PIPE).stdout
        return json.loads(out)["handles"]

    def test_collected_handle_released_by_the_next_call(self):
        """A handle collected in another thread makes no bus call there (the connection is
        not thread-safe and may be in use meanwhile); the client gives it back on its next
        call, from the thread that makes it."""
        with epd.Client(self.d.address) as a:
            a.register("prefill", "m", "cpu")
            with ef.Feature.acquire(a, "img:gc", may_produce=True) as p:
                p.produce(NBYTES, BUNDLE)
                p.publish()
            held = [ef.Feature.acquire(a, "img:gc")]
            self.assertEqual(held[0].result, "hit")
            self.assertEqual(self.handles(), 1)
            t = threading.Thread(target=held.clear)
            t.start()
            t.join()
            self.assertEqual(len(a._orphans), 1)
            self.assertEqual(self.handles(), 1)  # not released from the collecting thread
            self.assertEqual(ef.prefetch(a, ["img:gc"]), 1)  # the next call
            self.assertEqual(len(a._orphans), 0)
            self.assertEqual(self.handles(), 0)
            # Collected and never followed by a call: close() frees it, the daemon
            # released it with the connection.
            held.append(ef.Feature.acquire(a, "img:gc"))
            held.clear()
            self.assertEqual(len(a._orphans), 1)
        self.assertEqual(self.handles(), 0)

    def test_handle_collected_while_the_client_closes(self):
        """A handle collected in another thread while close() disconnects (the client
        is still open to its test) is queued then, and close() frees it after the
        disconnect; one collected after close() is freed at once. Before, a handle
        queued after close() had drained the queue stayed there, its libepd structure
        never freed."""
        freed = []

        def release(client, handle):
            freed.append((client, handle))

        class Lib:  # libepd, with a collection in another thread during the disconnect
            def __init__(self, real, client):
                self._real, self._client = real, client

            def __getattr__(self, name):
                return getattr(self._real, name)

            def epd_disconnect(self, c):
                t = threading.Thread(target=self._client._orphan, args=(release, "during"))
                t.start()
                t.join()
                return self._real.epd_disconnect(c)

        a = epd.Client(self.d.address)
        a._l = Lib(a._l, a)
        a.close()
        self.assertEqual(freed, [(None, "during")])
        self.assertEqual(len(a._orphans), 0)
        a._orphan(release, "after")
        self.assertEqual(freed, [(None, "during"), (None, "after")])
        self.assertEqual(len(a._orphans), 0)

    def test_views_hold_the_handle(self):
        """A view of a feature taken from a handle nobody keeps (Feature.acquire(...)
        .buffer(), .numpy(): a temporary) holds the handle: the daemon keeps the feature
        pinned while the view, or anything made from it, lives, and the handle is given
        back once they are gone. Before, the collected handle was released at the
        client's next call while the view still read the bytes, which the daemon could
        then evict and reuse."""
        import gc
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("encoder", "m", "cpu")
            b.register("prefill", "m", "cpu")
            with ef.Feature.reserve(a, "img:view", NBYTES, BUNDLE) as p:
                p.buffer()[:4] = b"\x01\x02\x03\x04"
                p.buffer(16 * 64 * 2, 24)[:8] = (7).to_bytes(8, "little")
                p.publish()
            self.assertEqual(self.handles(), 0)
            v = ef.Feature.acquire(b, "img:view").buffer()
            head = v[:4]  # a view of the view
            del v
            gc.collect()
            self.assertEqual(ef.prefetch(b, ["img:view"]), 1)  # a call: collected handles go back
            self.assertEqual(self.handles(), 1, "the view's handle was released while the view lives")
            self.assertEqual(bytes(head), b"\x01\x02\x03\x04")
            del head
            gc.collect()
            self.assertEqual(ef.prefetch(b, ["img:view"]), 1)
            self.assertEqual(self.handles(), 0, "the handle outlived its views")
            try:
                import numpy  # noqa: F401
            except ImportError:
                return
            row = ef.Feature.acquire(b, "img:view").numpy("grid_thw")[0]  # a view of a numpy view
            gc.collect()
            self.assertEqual(ef.prefetch(b, ["img:view"]), 1)
            self.assertEqual(self.handles(), 1)
            self.assertEqual(int(row[0]), 7)
            del row
            gc.collect()
            self.assertEqual(ef.prefetch(b, ["img:view"]), 1)
            self.assertEqual(self.handles(), 0)

    def test_ring_calls_give_back_nothing(self):
        """A ring call makes no bus call, not even to give a collected handle back: it is
        what a worker's main thread does while a background thread uses the connection
        (the connector's setup), and sd-bus is not thread-safe. The next bus call gives
        the handle back."""
        from epd.handoff import Ring
        with epd.Client(self.d.address) as a:
            a.register("prefill", "m", "cpu")
            with ef.Feature.acquire(a, "img:ring", may_produce=True) as p:
                p.produce(NBYTES, BUNDLE)
                p.publish()
            ring = Ring(a)
            held = [ef.Feature.acquire(a, "img:ring")]
            held.clear()
            self.assertEqual(len(a._orphans), 1)
            ring.accept("00000000000000000000000000000077", 0.05)
            self.assertIsNone(ring.next(0))
            self.assertEqual(len(a._orphans), 1)  # still queued: no bus call from the ring
            self.assertEqual(self.handles(), 1)
            self.assertEqual(ef.prefetch(a, ["img:ring"]), 1)  # a bus call
            self.assertEqual(len(a._orphans), 0)
            self.assertEqual(self.handles(), 0)
            ring.close()

    def test_layout_kept_per_shape(self):
        """cuda_all's layout (names, dtypes, shapes, strides, offsets, spans) is read from
        the C structure once per shape of feature: two features of one shape, held by
        different handles at different addresses, share it; another shape gets its own."""
        other = [ef.Tensor("image_embeds", "bfloat16", (8, 64)),
                 ef.Tensor("grid_thw", "i64", (1, 3), offset=8 * 64 * 2)]
        with epd.Client(self.d.address) as a:
            a.register("encoder", "m", "cpu")
            fs = [ef.Feature.reserve(a, "img:lay1", NBYTES, BUNDLE), ef.Feature.reserve(a, "img:lay2", NBYTES, BUNDLE),
                  ef.Feature.reserve(a, "img:lay3", 8 * 64 * 2 + 24, other)]
            lays = [f._layout() for f in fs]
            self.assertEqual(lays[0], (("image_embeds", "bfloat16", 2, (16, 64), (64, 1), 0, 16 * 64 * 2),
                                       ("grid_thw", "int64", 8, (1, 3), (3, 1), 16 * 64 * 2, 24)))
            self.assertIs(lays[1], lays[0])
            self.assertEqual(lays[2][0][3], (8, 64))
            self.assertEqual(lays[2][1][5], 8 * 64 * 2)
            for f in fs:
                f.fail("test")
                f.release()

    def test_torch_view_of_a_tensor_before_a_narrower_one(self):
        """f.torch() views a tensor whose bytes from its offset to the feature's end are not
        a whole number of its elements (an int64 before 6 bytes of bf16): the view is of its
        own span."""
        try:
            import torch
        except ImportError:
            self.skipTest("torch not installed")
        bundle = [ef.Tensor("grid_thw", "i64", (1,)), ef.Tensor("emb", "bf16", (3,), offset=8)]
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("encoder", "m", "cpu")
            b.register("prefill", "m", "cpu")
            p = ef.Feature.acquire(a, "img:narrow", may_produce=True)
            self.assertEqual(p.result, "produce")
            p.produce(14, bundle)
            p.buffer(0, 8)[:] = (7).to_bytes(8, "little")
            p.buffer(8, 6)[:] = b"\x80\x3f\x00\x40\x40\x40"  # bf16 1.0, 2.0, 3.0
            p.publish(1000)
            with ef.Feature.acquire(b, "img:narrow") as h:
                self.assertEqual(h.result, "hit")
                self.assertEqual(h.torch("grid_thw").tolist(), [7])
                self.assertEqual(h.torch("emb").tolist(), [1.0, 2.0, 3.0])
            p.release()

    def test_publish_release_without_waiting(self):
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("encoder", "m", "cpu")
            b.register("prefill", "m", "cpu")
            p = ef.Feature.acquire(a, "img:nowait", may_produce=True)
            self.assertEqual(p.result, "produce")
            w = ef.Feature.acquire(b, "img:nowait")
            self.assertEqual(w.result, "wait")
            p.produce(NBYTES, BUNDLE)
            p.buffer()[:4] = b"\x05\x06\x07\x08"
            p.publish_release(250)  # sent, not waited for: the handle is gone from p at once
            with self.assertRaises(ValueError):
                p.key
            self.assertTrue(w.wait(5))  # the waiter is woken by the Publish
            self.assertEqual(bytes(w.buffer()[:4]), b"\x05\x06\x07\x08")
            w.release()
            self.assertIsNone(a.flush(5))  # both answered, neither refused
            with ef.Feature.acquire(b, "img:nowait") as h:
                self.assertEqual(h.result, "hit")
            # A refusal comes back from flush(), naming the call; the Release still went.
            r = ef.Feature.acquire(a, "img:nowait")
            self.assertEqual(r.result, "hit")
            r.publish_release(1)  # a reader's handle: not the producer
            with self.assertRaises(epd.EpdError) as e:
                a.flush(5)
            self.assertEqual(e.exception.name, "org.epd1.Error.Stale")
            self.assertIn("Publish", str(e.exception))
            self.assertIsNone(a.flush(5))  # returned once
            # Every handle of a was released: a's Release after the refused Publish too.
            p2 = ef.Feature.acquire(a, "img:other", may_produce=True)
            self.assertEqual(p2.result, "produce")
            p2.release()

    def test_wait_runs_signal_handlers(self):
        """Feature.wait() with no timeout lets Python's signal handlers run while it waits
        (one Wait call per slice of 0.2 s): ctypes keeps the thread in C, where sd-bus
        either retries a wait a signal interrupted (the handler then ran only once the
        feature was published) or ends it with EINTR (the wait failed, for a handler
        that returns). A handler that returns lets the wait go on; SIGINT is a
        KeyboardInterrupt; the connection stays usable (the answers of the Waits given
        up on are dropped)."""
        import signal
        import time

        ran = []
        old_alrm = signal.signal(signal.SIGALRM, lambda signum, frame: ran.append(time.monotonic()))
        old_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # may be ignored when run in background
        timers = []
        try:
            with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
                a.register("encoder", "m", "cpu")
                b.register("prefill", "m", "cpu")
                p1 = ef.Feature.reserve(a, "img:sig1", NBYTES, BUNDLE)
                p2 = ef.Feature.reserve(a, "img:sig2", NBYTES, BUNDLE)
                w1, w2 = ef.Feature.acquire(b, "img:sig1"), ef.Feature.acquire(b, "img:sig2")
                self.assertEqual((w1.result, w2.result), ("wait", "wait"))
                # A handler that returns, 0.3 s in; the Publish 1.5 s in (client a, its own thread).
                timers.append(threading.Timer(1.5, p1.publish))
                timers[-1].start()
                t0 = time.monotonic()
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                self.assertTrue(w1.wait(None))
                self.assertGreaterEqual(time.monotonic() - t0, 1.4)
                timers[-1].join()
                self.assertEqual(len(ran), 1)
                self.assertLess(ran[0] - t0, 1.0, "the handler ran only once the wait ended")
                # SIGINT: KeyboardInterrupt within a slice (a Publish 5 s in ends a wait that ignores it).
                timers.append(threading.Timer(5, p2.publish))
                timers[-1].start()
                t0 = time.monotonic()
                ctrl_c = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
                ctrl_c.start()
                try:
                    with self.assertRaises(KeyboardInterrupt):
                        w2.wait(None)
                finally:
                    ctrl_c.join()
                self.assertLess(time.monotonic() - t0, 1.5, "SIGINT ended the wait only once it ended")
                self.assertFalse(w2.wait(0.5))  # a timeout past a slice: False
                timers[-1].cancel()
                timers[-1].join()
                if p2.state == "reserved":
                    p2.publish()
                self.assertTrue(w2.wait(None))
                self.assertEqual(w2.state, "ready")
                for f in (w1, w2, p1, p2):
                    f.release()
        finally:
            for t in timers:
                t.cancel()
                t.join()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alrm)
            signal.signal(signal.SIGINT, old_int)

    def test_acquire_or_reserve_send(self):
        """AcquireOrReserve in two steps: the caller works between the send and finish();
        a call given up (close(), or collected) holds nothing once its answer came."""
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("encoder", "m", "cpu")
            b.register("prefill", "m", "cpu")
            # The send returns with epdd stopped: nothing waits for the answer until finish.
            import signal
            import time
            os.kill(self.d.proc.pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                call = ef.Feature.acquire_or_reserve_send(a, "img:send", NBYTES, BUNDLE, "0a" * 16)
                sent_s = time.monotonic() - t0
            finally:
                os.kill(self.d.proc.pid, signal.SIGCONT)
            self.assertLess(sent_s, 1.0)
            p = call.finish(5)
            self.assertEqual((p.result, p.state), ("produce", "reserved"))
            with self.assertRaises(ValueError):
                call.finish(5)  # used up
            p.buffer()[:NBYTES] = bytes(range(256)) * (NBYTES // 256) + bytes(NBYTES % 256)
            p.publish_release(1)
            a.flush(5)
            h = ef.Feature.acquire_or_reserve_send(b, "img:send", NBYTES, BUNDLE).finish(5)
            self.assertEqual(h.result, "hit")
            self.assertEqual(bytes(h.buffer()[:256]), bytes(range(256)))
            h.release()
            # Refused: the named error from finish().
            with self.assertRaises(epd.EpdError) as cm:
                ef.Feature.acquire_or_reserve_send(a, "img:big", 1 << 40, BUNDLE).finish(5)
            self.assertEqual(cm.exception.name, "org.epd1.Error.InvalidArgument")
            # Given up: its handle goes back when the answer comes; collected: on the
            # client's next call.
            ef.Feature.acquire_or_reserve_send(a, "img:gone1", NBYTES, BUNDLE).close()
            call = ef.Feature.acquire_or_reserve_send(a, "img:gone2", NBYTES, BUNDLE)
            a.flush(5)  # its answer is in
            del call
            self.assertEqual(ef.prefetch(a, ["img:x"]), 0)  # a call: the collected one is given up
            self.assertEqual(ef.prefetch(a, ["img:x"]), 0)  # and epdd has read its Release
            self.assertEqual(self.handles(), 0)
            # No answer in time: ETIMEDOUT, the call given up, its late answer's handle
            # released when it comes.
            os.kill(self.d.proc.pid, signal.SIGSTOP)
            try:
                late = ef.Feature.acquire_or_reserve_send(a, "img:gone3", NBYTES, BUNDLE)
                with self.assertRaises(epd.EpdError) as cm:
                    late.finish(0.3)
            finally:
                os.kill(self.d.proc.pid, signal.SIGCONT)
            self.assertEqual(cm.exception.errno, errno.ETIMEDOUT)
            with self.assertRaises(ValueError):
                late.finish(1)
            a.flush(5)
            self.assertEqual(ef.prefetch(a, ["img:x"]), 0)  # epdd has read the Release
            self.assertEqual(self.handles(), 0)
            # flush(None) with a call unanswered (epdd stopped) ends for a signal whose
            # handler raises: it waits in slices, the handler runs between them (a single
            # C wait without end does not return for a signal with libsystemd >= 253).
            class Alarm(Exception):
                pass

            def on_alarm(signum, frame):
                raise Alarm()
            old = signal.signal(signal.SIGALRM, on_alarm)
            os.kill(self.d.proc.pid, signal.SIGSTOP)
            try:
                stuck = ef.Feature.acquire_or_reserve_send(a, "img:gone4", NBYTES, BUNDLE)
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                t0 = time.monotonic()
                with self.assertRaises(Alarm):
                    a.flush(None)
                self.assertLess(time.monotonic() - t0, 3.0)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
                os.kill(self.d.proc.pid, signal.SIGCONT)
            stuck.close()
            a.flush(5)
            self.assertEqual(ef.prefetch(a, ["img:x"]), 0)
            self.assertEqual(self.handles(), 0)
            for k in ("img:gone1", "img:gone2", "img:gone3", "img:gone4"):
                f = ef.Feature.acquire(b, k, may_produce=True)
                self.assertEqual(f.result, "produce")  # the given-up producers' claims went
                f.fail("test")
                f.release()

    def test_acquire_or_reserve_send_daemon_gone(self):
        """epdd killed while the call is on its way: finish() says the connection went
        (ENOTCONN), not a timeout; the call is used up."""
        import signal
        d = Daemon()  # its own: this one dies
        try:
            with epd.Client(d.address) as a:
                a.register("encoder", "m", "cpu")
                os.kill(d.proc.pid, signal.SIGSTOP)
                call = ef.Feature.acquire_or_reserve_send(a, "img:dies", NBYTES, BUNDLE)
                d.proc.kill()
                d.proc.wait()
                with self.assertRaises(epd.EpdError) as cm:
                    call.finish(10)
                self.assertEqual(cm.exception.errno, errno.ENOTCONN, str(cm.exception))
                with self.assertRaises(ValueError):
                    call.finish(1)
        finally:
            d.stop()

    def test_acquire_or_reserve_send_client_closed_by_a_signal_handler(self):
        """A signal handler that closes the client while finish() waits (between two of
        its slices): finish raises ValueError, no call on the closed client."""
        import signal
        a = epd.Client(self.d.address)
        a.register("encoder", "m", "cpu")
        def handler(*_):
            os.kill(self.d.proc.pid, signal.SIGCONT)  # close() makes calls of its own
            a.close()
        old = signal.signal(signal.SIGALRM, handler)
        os.kill(self.d.proc.pid, signal.SIGSTOP)
        try:
            call = ef.Feature.acquire_or_reserve_send(a, "img:sig", NBYTES, BUNDLE)
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with self.assertRaises(ValueError):
                call.finish(5)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
            os.kill(self.d.proc.pid, signal.SIGCONT)
            a.close()

    def test_publish_release_on_a_closed_client_frees_the_handle(self):
        """publish_release() gives its handle's C structure (~20 KB) to libepd before
        the call, which frees it whatever the result: on a closed client too (the call
        is refused, ValueError), where libepd returned -EINVAL and kept it, a leak per
        call. Measured with glibc's mallinfo2 over 100 handles."""
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
        with open("/proc/self/maps") as maps:
            if "libasan" in maps.read():
                # ASan's allocator is not glibc's: mallinfo2 does not see it (the C
                # tests' leak checks cover this under ASan).
                self.skipTest("AddressSanitizer's allocator: mallinfo2 does not count it")
        try:
            mallinfo2 = ctypes.CDLL(None).mallinfo2
        except AttributeError:
            self.skipTest("no mallinfo2 (glibc 2.33 or later)")
        mallinfo2.restype = MallInfo2
        n = 100
        a = epd.Client(self.d.address)
        a.register("encoder", "m", "cpu")
        fs = [ef.Feature.reserve(a, f"img:closed{i}", NBYTES, BUNDLE) for i in range(n)]
        a.close()
        before = mallinfo2().uordblks
        for f in fs:
            with self.assertRaises(ValueError):
                f.publish_release(1)
            self.assertIsNone(f._p)
        freed = before - mallinfo2().uordblks
        self.assertGreater(freed, n * ctypes.sizeof(ef._CFeature) // 2,
                           f"{freed} bytes freed for {n} handles of {ctypes.sizeof(ef._CFeature)} bytes")

    def test_failed_feature_carries_libepd_error(self):
        """wait() on a feature its producer failed raises EpdError with libepd's error name
        (errno.32) and sentence, as every refusal does (it had name None and the reason
        alone)."""
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("encoder", "m", "cpu")
            b.register("prefill", "m", "cpu")
            p = ef.Feature.acquire(a, "img:failed", may_produce=True)
            w = ef.Feature.acquire(b, "img:failed")
            self.assertEqual((p.result, w.result), ("produce", "wait"))
            p.fail("bad-input")
            with self.assertRaises(epd.EpdError) as e:
                w.wait(5)
            self.assertEqual(e.exception.errno, errno.EPIPE)
            self.assertEqual(e.exception.name, f"errno.{errno.EPIPE}")
            self.assertEqual(e.exception.name, b._l.epd_last_error_name(b._c).decode())
            self.assertIn(b._l.epd_last_error_message(b._c).decode(), str(e.exception))
            self.assertIn("feature 'img:failed' failed", str(e.exception))
            self.assertIn(w.error, str(e.exception))  # the reason ("producer-failed") is kept
            w.release()
            p.release()

    def test_out_of_range_sizes_refused(self):
        """A size, tensor dimension, offset or time outside uint64_t is ValueError naming
        it, before libepd: ctypes kept the low bits (nbytes 2**64 + 24 was 24, a dimension
        -1 was 2**64 - 1)."""
        with epd.Client(self.d.address) as a:
            a.register("encoder", "m", "cpu")
            for nbytes, tensors, word in ((2**64 + NBYTES, BUNDLE, "nbytes"), (-1, BUNDLE, "nbytes"),
                                          (NBYTES, [ef.Tensor("x", "u8", (-1,))], "shape[0]"),
                                          (NBYTES, [ef.Tensor("x", "u8", (4,), offset=2**64)], "offset"),
                                          (NBYTES, [ef.Tensor("x", "u8", (4, 2), strides=(2, -1))], "strides[1]")):
                for make in (ef.Feature.reserve, ef.Feature.acquire_or_reserve, ef.Feature.acquire_or_reserve_send):
                    with self.assertRaises(ValueError) as e:
                        make(a, "img:range", nbytes, tensors)
                    self.assertIn(word, str(e.exception))
            p = ef.Feature.acquire(a, "img:range", may_produce=True)
            with self.assertRaises(ValueError):
                p.produce(2**64, BUNDLE)
            p.produce(NBYTES, BUNDLE)
            for call in (p.publish, p.publish_release):
                with self.assertRaises(ValueError) as e:
                    call(-1)
                self.assertIn("encode_usec", str(e.exception))
            self.assertEqual(p.state, "reserved")  # the handle kept, nothing sent
            p.publish(1)
            self.assertEqual(p.state, "ready")
            p.release()

    def test_infinite_and_nan_timeouts(self):
        """float('inf') is no timeout (it raised OverflowError), NaN is ValueError; a
        FeatureCall whose finish() was given NaN is not used up."""
        inf, nan = float("inf"), float("nan")
        with epd.Client(self.d.address) as a, epd.Client(self.d.address) as b:
            a.register("encoder", "m", "cpu")
            b.register("prefill", "m", "cpu")
            p = ef.Feature.acquire(a, "img:inf", may_produce=True)
            w = ef.Feature.acquire(b, "img:inf")
            with self.assertRaises(ValueError):
                w.wait(nan)
            p.produce(NBYTES, BUNDLE)
            p.publish(1)
            self.assertTrue(w.wait(inf))
            w.release()
            p.release()
            call = ef.Feature.acquire_or_reserve_send(b, "img:inf", NBYTES, BUNDLE)
            with self.assertRaises(ValueError):
                call.finish(nan)
            h = call.finish(inf)
            self.assertEqual(h.result, "hit")
            h.release()
            a.flush(inf)

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
            self.assertEqual(e.exception.name, f"errno.{errno.EPIPE}")  # libepd's, as for every refusal
            self.assertIn("producer-gone", str(e.exception))
            self.assertEqual(w.error, "producer-gone")
            w.release()
            bad = [ef.Tensor("a", "f32", (4,)), ef.Tensor("b", "f32", (4,), offset=8)]
            with self.assertRaises(epd.EpdError) as e:
                ef.Feature.reserve(a, "img:y", 32, bad)
            self.assertIn("overlap", str(e.exception))
            with self.assertRaises(epd.EpdError) as e:
                ef.Feature.acquire(b, "img:none")
            self.assertEqual(e.exception.errno, errno.ENOENT)


class ContentKeyTest(unittest.TestCase):
    """epd.feature.content_key: chunks hashed on threads, one definition of the key."""

    def reference(self, data: bytes, extra: bytes = b"") -> str:
        import hashlib
        h = hashlib.sha256(b"epd-content-v2|%d|" % len(data))
        for i in range(0, max(len(data), 1), ef.CONTENT_CHUNK):
            h.update(hashlib.sha256(data[i:i + ef.CONTENT_CHUNK]).digest())
        h.update(b"|" + extra)
        return h.hexdigest()

    def test_key(self):
        import os
        for n in (0, 1, ef.CONTENT_CHUNK - 1, ef.CONTENT_CHUNK, ef.CONTENT_CHUNK + 1, 5 * ef.CONTENT_CHUNK + 7,
                  37 * ef.CONTENT_CHUNK + 3):  # more chunks than threads: runs of several a thread
            data = os.urandom(n)
            k = ef.content_key(data, b"448")
            self.assertEqual(k, self.reference(data, b"448"), n)
            self.assertEqual(len(k), 64)
            self.assertEqual(ef.content_key(bytearray(data), b"448"), k)  # any buffer, the same key
            self.assertNotEqual(ef.content_key(data, b"449"), k)  # extra counts
            if n:
                flipped = bytearray(data)
                flipped[n // 2] ^= 1
                self.assertNotEqual(ef.content_key(flipped, b"448"), k)  # one bit counts
        # The length counts: a buffer and the same buffer with a zero byte more differ.
        self.assertNotEqual(ef.content_key(b"\0" * 10), ef.content_key(b"\0" * 11))


if __name__ == "__main__":
    unittest.main()
