# SPDX-License-Identifier: LGPL-2.1-or-later
"""The Python binding against a real epdd (started here on a private direct socket).
Runs without torch: plain buffers, and numpy when present."""

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epd  # noqa: E402


def finished_soon(h, ring, polls: int = 200) -> bool:
    """Whether handoff h is finished (Handoff.finished through ring) within `polls` waits
    of 10 ms on the ring."""
    for _ in range(polls):
        if h.finished(ring):
            return True
        ring.poll(0.01)
    return h.finished(ring)


class Daemon:
    def __init__(self, extra_conf: str = "", env=None, state: bool = True):
        """Every daemon gets its own socket and its own StateDirectory (the WAL) in a
        temporary directory, never the host's /var/lib/epd (a journal left there by
        another run would fix the arenas' page sizes). `state` is kept for callers that
        say they need the WAL; it is always there."""
        self.dir = tempfile.mkdtemp(prefix="epd-py-")
        self.socket = os.path.join(self.dir, "bus")
        self.state_dir = os.path.join(self.dir, "state")
        conf = os.path.join(self.dir, "epd.conf")
        with open(conf, "w") as f:
            f.write(f"[Daemon]\nSocket={self.socket}\nSystemBus=no\nHostId=py-host\n"
                    f"StateDirectory={self.state_dir}\n{extra_conf}")
        self.log = open(os.path.join(self.dir, "epdd.log"), "w")
        try:
            self.proc = subprocess.Popen([os.environ["EPDD"], f"--config={conf}"],
                                         stdout=self.log, stderr=self.log,
                                         env=dict(os.environ, **(env or {})))
        except BaseException:
            # No epdd to run (EPDD unset, a binary missing): nothing left behind.
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        for _ in range(500):
            if os.path.exists(self.socket):
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(self.socket)
                    return
                except OSError:
                    pass
                finally:
                    s.close()
            time.sleep(0.01)
            if self.proc.poll() is not None:
                break
        # Neither the daemon nor its directory outlives a start that failed.
        log = open(os.path.join(self.dir, "epdd.log")).read()[-2000:]
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        raise RuntimeError("epdd did not start: " + log)

    @property
    def address(self):
        return "direct:" + self.socket

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # a hung stop fails the test, and leaves nothing running
            self.proc.wait()
            rc = "did not stop within 10 s"
        finally:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)
        return rc


class RingRecordTest(unittest.TestCase):
    """Decoding the ring's backpressure record: pure, with built records."""

    def test_backpressure(self):
        from epd.handoff import RingRecord, RING_EV_BACKPRESSURE
        rec = RingRecord()
        rec.opcode, rec.group, rec.count, rec.arg0, rec.arg1 = RING_EV_BACKPRESSURE, 2, 2, 1000, 1000000
        raw = bytearray(bytes(rec))
        raw[8:13] = b"bravo"
        rec = RingRecord.from_buffer_copy(bytes(raw))
        bp = rec.backpressure()
        self.assertEqual((bp.peer, bp.truncated, bp.level, bp.level_name, bp.reason, bp.permille, bp.retry_after_usec),
                         ("bravo", False, 2, "high", "retransmits", 1000, 1000000))
        # A 32-byte host id fills the field without a terminator; a longer one is flagged.
        raw[8:40] = b"h" * 32
        raw[2:4] = (0x0002).to_bytes(2, "little")
        bp = RingRecord.from_buffer_copy(bytes(raw)).backpressure()
        self.assertEqual((bp.peer, bp.truncated), ("h" * 32, True))
        # Another opcode, or a level this version does not know: None.
        other = RingRecord()
        other.opcode = 0x81
        self.assertIsNone(other.backpressure())
        rec.group = 7
        self.assertIsNone(rec.backpressure())


    def test_handoffs_of_one_token_kept_apart(self):
        """Two handoffs with the same token from two source daemons (tokens are unique per
        source only) are two handoffs on the decode worker's ring: one's progress and
        rollback say nothing of the other's."""
        import errno
        from epd.handoff import (Accepted, Ring, RingRecord, RING_EV_GROUP_PROGRESS, RING_EV_HANDOFF_STATE,
                                 RING_EV_HANDOFF_ACCEPTED, HANDOFF_STATE_ROLLED_BACK)
        ring = object.__new__(Ring)
        ring.progress, ring.state, ring.other, ring.accepted = {}, {}, [], {}
        ring.poll = lambda timeout_s=0.0: 0  # no mapping behind it: the tables alone,
        ring.overflows = lambda: 0            # and nothing lost
        a_rid, b_rid, token = "a" * 32, "b" * 32, 1764900000000000

        def record(opcode, rid, group=0, arg0=0, arg1=0):
            rec = RingRecord()
            rec.opcode, rec.token, rec.group, rec.arg0, rec.arg1 = opcode, token, group, arg0, arg1
            rec.request_id[:] = list(bytes.fromhex(rid))
            return rec

        ring._absorb(record(RING_EV_HANDOFF_ACCEPTED, a_rid))
        ring._absorb(record(RING_EV_HANDOFF_ACCEPTED, b_rid))
        ring._absorb(record(RING_EV_GROUP_PROGRESS, a_rid, group=4))
        self.assertEqual(ring.groups_landed(a_rid, token), 4)
        self.assertEqual(ring.groups_landed(b_rid, token), 0)
        b = object.__new__(Accepted)
        b.request_id, b.token, b.groups_done = b_rid, token, 0
        with self.assertRaises(epd.EpdError) as e:
            b.wait_groups(4, ring, timeout_s=0.1)  # A's groups are not B's
        self.assertEqual(e.exception.errno, errno.ETIMEDOUT)
        ring._absorb(record(RING_EV_HANDOFF_STATE, a_rid, arg0=HANDOFF_STATE_ROLLED_BACK, arg1=1))
        self.assertIsNone(ring.handoff_state(b_rid, token))
        with self.assertRaises(epd.EpdError) as e:
            b.wait_groups(4, ring, timeout_s=0.1)  # A's rollback is not B's
        self.assertEqual(e.exception.errno, errno.ETIMEDOUT)
        ring._absorb(record(RING_EV_GROUP_PROGRESS, b_rid, group=4))
        self.assertEqual(b.wait_groups(4, ring, timeout_s=0.1), 4)
        ring.forget(a_rid, token)
        self.assertEqual(ring.accepted, {b_rid: token})
        self.assertEqual(ring.groups_landed(b_rid, token), 4)
        ring.forget(b_rid.upper(), token)  # the id as the worker spelled it
        self.assertEqual((ring.accepted, ring.progress, ring.state), ({}, {}, {}))


class ArgumentCheckTest(unittest.TestCase):
    """epd._lib's checks of what goes to libepd: pure. ctypes keeps the low bits of any
    Python int it is given, and float('inf') has no microseconds."""

    def test_unsigned(self):
        from epd import _lib
        self.assertEqual((_lib.u32(2**32 - 1, "n"), _lib.u64(2**64 - 1, "n")), (2**32 - 1, 2**64 - 1))
        for f, v in ((_lib.u32, 2**32 + 3), (_lib.u32, -1), (_lib.u64, 2**64), (_lib.u32, 1.0), (_lib.u32, "3")):
            with self.assertRaises(ValueError) as e:
                f(v, "n_pages")
            self.assertIn("n_pages", str(e.exception))
            self.assertIn("[0, 2**", str(e.exception))
        arr, n = _lib.u32_array([1, 2, 3], "tokens")
        self.assertEqual((arr[:n], n), ([1, 2, 3], 3))
        self.assertEqual(_lib.u32_array([], "tokens")[1], 0)
        for bad in ([1, 2**32 + 2], [1, -2], [1, 0.5]):
            with self.assertRaises(ValueError) as e:
                _lib.u32_array(bad, "layer_groups")
            self.assertIn("layer_groups[1]", str(e.exception))

    def test_timeouts(self):
        from epd import _lib
        inf, nan = float("inf"), float("nan")
        self.assertEqual([_lib.timeout(v, "t") for v in (None, inf, 0, 1.5)], [None, None, 0.0, 1.5])
        self.assertEqual(_lib.usec(inf, "t"), 2**64 - 1)  # libepd's "forever"
        self.assertEqual(_lib.timeout(-1, "t", past=True), 0.0)  # a wait's passed deadline: only look
        for v, past in ((-1, False), (nan, False), (nan, True), ("1", True)):
            with self.assertRaises(ValueError):
                _lib.timeout(v, "timeout_s", past)
        self.assertEqual(next(_lib.wait_slices(inf)), _lib.WAIT_SLICE_USEC)
        with self.assertRaises(ValueError):
            _lib.wait_slices(nan)  # at once, not at the first slice


class BindingTest(unittest.TestCase):
    @contextlib.contextmanager
    def prefill_and_decode(self):
        """Two clients of the daemon registered as a prefill and a decode worker of one
        small KV layout."""
        kv = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=256, v_bytes_per_token=256)
        with epd.Client(self.d.address) as p, epd.Client(self.d.address) as d:
            p.register("prefill", "m", "cpu", kv=kv)
            d.register("decode", "m", "cpu", kv=kv)
            yield p, d

    def setUp(self):
        self.d = Daemon()

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def test_register_and_map(self):
        kv = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=256, v_bytes_per_token=256)
        with epd.Client(self.d.address) as c:
            path = c.register("prefill", "qwen3-vl-test", "cpu", kv=kv)
            self.assertTrue(path.startswith("/org/epd1/worker/"))
            names = sorted(a.name for a in c.arenas())
            self.assertEqual(names, ["feat0", "host0"])
            a = c.arena("host0")
            hdr = a.buffer(0, 64)
            self.assertEqual(bytes(hdr[:8]), b"EPDARENA")
            # Shared memory: what one client writes, another sees.
            a.buffer(a.data_offset, 4)[:] = b"\x01\x02\x03\x04"
            with epd.Client(self.d.address) as d:
                # name and labels: what epd.conf's [Pool:NAME] worker selectors match.
                d.register("decode", "qwen3-vl-test", "cpu", kv=kv, name="dec-0", labels=["fast", "h200"])
                self.assertEqual(bytes(d.arena("host0").buffer(a.data_offset, 4)), b"\x01\x02\x03\x04")

    def test_views_outlive_close(self):
        """A view taken from an arena (a buffer, numpy array or tensor) holds its own
        mapping: close() and unregister() unmap libepd's, and touching the view after is
        not a segfault (it was). Run in a child so that a crash fails this test only."""
        code = (
            "import epd, sys\n"
            "c = epd.Client(sys.argv[1])\n"
            "c.register('prefill', 'm', 'cpu')\n"
            "a = c.arena('host0')\n"
            "v = a.buffer(a.data_offset, 4096)\n"
            "v[:4] = b'\\x05\\x06\\x07\\x08'\n"
            "c.unregister()\n"
            "assert bytes(v[:4]) == b'\\x05\\x06\\x07\\x08'\n"
            "c.register('prefill', 'm', 'cpu')\n"
            "w = c.arena('host0').buffer(a.data_offset, 4)\n"
            "c.close()\n"
            "v[4:8] = b'abcd'\n"
            "assert bytes(w) == b'\\x05\\x06\\x07\\x08' and bytes(v[4:8]) == b'abcd'\n"
            "print('ok')\n")
        r = subprocess.run([sys.executable, "-c", code, self.d.address], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=dict(os.environ), timeout=60)
        self.assertEqual((r.returncode, r.stdout.strip()), (0, "ok"), r.stderr)

    def test_stale_arena_refused(self):
        """An Arena object belongs to the registration it came from: after close(), or
        unregister() and a new registration (whose arenas may reuse its fd number and
        index), its buffer() is refused instead of mapping whatever now has that fd."""
        c = epd.Client(self.d.address)
        c.register("prefill", "m", "cpu", arenas=["feat0"])
        old = c.arena("feat0")
        c.unregister()
        c.register("prefill", "m", "cpu", arenas=["host0"])
        with self.assertRaises(ValueError):
            old.buffer(0, 8)
        new = c.arena("host0")
        self.assertEqual(len(new.buffer()), new.size)  # not the old arena's size
        c.close()
        with self.assertRaises(ValueError):
            new.buffer(0, 8)

    def test_stale_arena_address_refused(self):
        """address() of an Arena of an earlier registration is refused as buffer() is: its
        index is another arena's in the new registration (it returned host0's mapping for
        an old feat0 object, and a write through it landed in host0)."""
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cpu", arenas=["feat0"])
            old = c.arena("feat0")
            self.assertEqual(old.index, 0)
            c.unregister()
            c.register("prefill", "m", "cpu", arenas=["host0", "feat0"])
            self.assertEqual(c.arena("host0").index, 0)
            with self.assertRaises(ValueError) as e:
                old.address()
            self.assertIn("earlier registration", str(e.exception))
            new = c.arena("feat0")
            self.assertTrue(new.address())
            c.close()
            with self.assertRaises(ValueError):
                new.address()

    def test_out_of_range_arguments_refused(self):
        """A count, layer group, token or size outside its C type is ValueError naming it,
        before libepd: ctypes kept the low bits (layer_groups [2**32 + 2, 2] was prepared
        as [2, 2], timeout_s=-1 as a timeout of 2**64 - 10**6 us)."""
        from epd.handoff import Handoff, Ring
        from epd.sequence import Sequence
        kv = epd.KvLayout(layers=2**32 + 4, tokens_per_block=16, k_bytes_per_token=256, v_bytes_per_token=256)
        with epd.Client(self.d.address) as c:
            with self.assertRaises(ValueError) as e:
                c.register("prefill", "m", "cpu", kv=kv)
            self.assertIn("layers", str(e.exception))
            self.assertIsNone(c.worker_path)
        with self.prefill_and_decode() as (p, d):
            seq = Sequence.create(p, "host0", 2)
            for groups, kw, word in (([2**32 + 2, 2], {}, "layer_groups[0]"), ([2, -2], {}, "layer_groups[1]"),
                                     ([2, 2], {"timeout_s": -1}, "timeout_s"),
                                     ([2, 2], {"timeout_s": float("nan")}, "timeout_s"),
                                     ([2, 2], {"ready": 2**32 + 1}, "ready")):
                with self.assertRaises(ValueError) as e:
                    Handoff.prepare(p, "%032x" % 0x7171, "", seq.path, groups, **kw)
                self.assertIn(word, str(e.exception))
            with self.assertRaises(ValueError):
                Ring(p, sq_entries=2**32 + 256)
            h = Handoff.prepare(p, "%032x" % 0x7171, "", seq.path, [2, 2])
            self.assertEqual(h.status()["n_groups"], 2)
            with Ring(p) as ring:
                for group, token in ((2**32, h.token), (0, -1), (0, 2**64 + h.token)):
                    with self.assertRaises(ValueError):
                        ring.layer_group_ready(h.request_id, token, group)
                for ring_or_bus in (ring, None):
                    with self.assertRaises(ValueError) as e:
                        h.layer_group_ready(2**32, ring_or_bus)  # was group 0
                    self.assertIn("group", str(e.exception))
                with self.assertRaises(ValueError):
                    ring.accept("%032x" % 0x7172, timeout_s=-1)
            self.assertEqual(h.status()["groups_done"], 0)
            h.rollback()
            h.release()
            seq.release()

    def test_infinite_timeouts(self):
        """float('inf') is no timeout (it raised OverflowError); NaN is ValueError."""
        from epd.handoff import Accepted, Handoff
        from epd.sequence import Sequence
        inf, nan = float("inf"), float("nan")
        rid = "%032x" % 0x7373
        with self.prefill_and_decode() as (p, d):
            p.flush(inf)
            for call in (lambda: p.flush(nan), lambda: p.wait(nan), lambda: Accepted.accept(d, rid, wait_s=nan)):
                with self.assertRaises(ValueError):
                    call()
            seq = Sequence.create(p, "host0", 2)
            h = Handoff.prepare(p, rid, "", seq.path, [2, 2], timeout_s=inf)  # the daemon's HandoffTimeout=
            a = Accepted.accept(d, rid, wait_s=inf)
            self.assertEqual(a.token, h.token)
            a.rollback()
            a.release()
            h.release()
            seq.release()

    def test_numpy_view(self):
        try:
            import numpy as np
        except ImportError:
            self.skipTest("numpy not installed")
        with epd.Client(self.d.address) as c:
            c.register("encoder", "m", "cpu")
            a = c.arena("feat0")
            x = a.numpy(np.float32, (16, 8), a.data_offset)
            x[:] = np.arange(128, dtype=np.float32).reshape(16, 8)
            y = a.numpy(np.float32, (128,), a.data_offset)
            self.assertEqual(float(y[127]), 127.0)

    def test_accept_waits_for_the_handoff(self):
        """The decode side waits for a handoff not prepared yet, on its ring and with
        Accepted.accept(wait_s=...): no polling."""
        import errno
        from epd.handoff import Accepted, Handoff, Ring
        from epd.sequence import Sequence
        rid = "%032x" % 0x5151
        with self.prefill_and_decode() as (p, d):
            with self.assertRaises(epd.EpdError) as e:
                Accepted.accept(d, "%032x" % 0x5152, wait_s=0.05)
            self.assertEqual(e.exception.errno, errno.ETIMEDOUT)
            self.assertEqual(e.exception.name, "org.epd1.Error.Timeout")
            with Ring(d) as dring, Ring(p) as pring:
                dring.accept(rid, timeout_s=5, user_data=3)
                seq = Sequence.create(p, "host0", 2)
                h = Handoff.prepare(p, rid, "", seq.path, [2, 2])
                while rid not in dring.accepted:
                    dring.poll(1.0)
                self.assertEqual(dring.accepted[rid], h.token)
                dring.forget(rid, h.token)  # what release(dring) does: the answer goes too
                self.assertNotIn(rid, dring.accepted)
                a = Accepted.accept(d, rid, wait_s=1)   # a repeat: the offsets
                self.assertEqual(a.token, h.token)
                for g in range(2):
                    h.layer_group_ready(g, pring)
                self.assertEqual(a.wait_groups(2, dring, timeout_s=5), 2)
                Sequence(d, a.commit(), a.arena).release()
                a.release(dring)
                h.release(pring)
                seq.release()

    def test_ring_progress_counts_groups_landed(self):
        """The ring's progress for a handoff is the number of groups landed (the record's
        `group`), not the handoff's group count: one group ready of three, and the decode
        side sees 1, not 3 (it would read layers that have not arrived)."""
        from epd.handoff import Accepted, Handoff, Ring
        from epd.sequence import Sequence
        rid = "%032x" % 0x5159
        with self.prefill_and_decode() as (p, d):
            with Ring(d) as dring, Ring(p) as pring:
                seq = Sequence.create(p, "host0", 2)
                h = Handoff.prepare(p, rid, "", seq.path, [2, 1, 1])
                a = Accepted.accept(d, rid, wait_s=1)
                self.assertEqual(a.n_groups, 3)
                for g in range(3):
                    h.layer_group_ready(g, pring)
                    self.assertEqual(a.wait_groups(g + 1, dring, timeout_s=5), g + 1)
                    dring.poll(0.05)  # any later record would say more than has landed
                    self.assertEqual(dring.groups_landed(rid, a.token), g + 1)
                    pring.poll(0.05)
                    self.assertLessEqual(pring.groups_landed(rid, h.token), g + 1)
                Sequence(d, a.commit(), a.arena).release()
                a.release(dring)
                h.release(pring)
                seq.release()

    def test_ring_overflow_falls_back_to_the_bus(self):
        """Records the daemon could not post (the CQ and its backlog full: a worker that
        did not read its ring) are counted in the ring's overflow word (Ring.overflows())
        and go out as D-Bus signals, which the binding does not read: a handoff whose
        progress or "committed" record was lost so asks the bus once the count moved.
        Before, its wait_groups() ran to its timeout and finished() never said yes (the
        prefill held its pages)."""
        import copy
        from epd.handoff import Accepted, Handoff, Ring
        from epd.sequence import Sequence
        n = 24  # a few records each: far past 8 + 4 x 8 on either ring
        with self.prefill_and_decode() as (p, d):
            with Ring(d, cq_entries=8) as dring, Ring(p, cq_entries=8) as pring:
                self.assertEqual((dring.overflows(), pring.overflows()), (0, 0))
                seqs, hs, accs = [], [], []
                for i in range(n):
                    rid = "%032x" % (0x5180 + i)
                    seqs.append(Sequence.create(p, "host0", 2))
                    hs.append(Handoff.prepare(p, rid, "", seqs[-1].path, [2, 2]))
                    accs.append(Accepted.accept(d, rid, wait_s=1))
                    for g in range(2):
                        hs[-1].layer_group_ready(g)  # on the bus: neither ring is read meanwhile
                for a in accs:  # landed (asked of a copy: `a` knows only what its ring says)
                    deadline = time.monotonic() + 5
                    while copy.copy(a).status()["groups_done"] < 2 and time.monotonic() < deadline:
                        time.sleep(0.01)
                self.assertGreater(dring.overflows(), 0)
                for a in accs:
                    self.assertEqual(a.wait_groups(2, dring, timeout_s=2), 2, a.request_id)
                    Sequence(d, a.commit(), a.arena).release()
                    a.release(dring)
                self.assertGreater(pring.overflows(), 0)
                left, deadline = list(hs), time.monotonic() + 5
                while left and time.monotonic() < deadline:
                    left = [h for h in left if not h.finished(pring)]
                    time.sleep(0.01)
                self.assertEqual([h.request_id for h in left], [], "committed, never seen finished")
                for h, seq in zip(hs, seqs):
                    h.release(pring)
                    seq.release()

    def test_ring_let_go_falls_back_to_the_bus(self):
        """A ring the daemon let go of (here CloseRing on its client; also a corrupt queue,
        or a client dropped for not reading its bus connection) ends its waits with
        ECONNRESET, saying so: a handoff's finished(), wait_groups() and commit(ring=) then
        ask the bus, and Ring.reopen() opens another in its place, whose handoffs ask the
        bus once (their notices went as D-Bus signals meanwhile)."""
        from epd.handoff import Accepted, Handoff, Ring, _lib_handoffs
        from epd.sequence import Sequence
        lib = _lib_handoffs()
        with self.prefill_and_decode() as (p, d):
            with Ring(d) as dring, Ring(p) as pring:
                seq = Sequence.create(p, "host0", 2)
                rid = "%032x" % 0x51a0
                h = Handoff.prepare(p, rid, "", seq.path, [2, 2])
                a = Accepted.accept(d, rid, wait_s=1)
                for c in (p, d):
                    self.assertEqual(lib.epd_ring_release(c._c, None), 0)  # the daemon's side only
                with self.assertRaises(epd.EpdError) as e:
                    pring.next(1)
                self.assertEqual(e.exception.errno, errno.ECONNRESET)
                self.assertIn("let go of the ring", str(e.exception))
                with self.assertRaises(epd.EpdError) as e:
                    h.layer_group_ready(0, pring)
                self.assertIn("let go of the ring", str(e.exception))
                for g in range(2):
                    h.layer_group_ready(g)
                self.assertEqual(a.wait_groups(2, dring, timeout_s=5), 2)
                Sequence(d, a.commit(ring=dring), a.arena).release()
                self.assertTrue(finished_soon(h, pring))
                a.release(dring)
                h.release(pring)
                # Reopened in place: the same object, a new ring at the daemon.
                for r in (pring, dring):
                    seen = r.overflows()
                    r.reopen()
                    self.assertIsNone(r.next(0))
                    self.assertGreater(r.overflows(), seen)  # what was sent meanwhile went as signals
                rid = "%032x" % 0x51a1
                h = Handoff.prepare(p, rid, "", seq.path, [2, 2])
                a = Accepted.accept(d, rid, wait_s=1)
                for g in range(2):
                    h.layer_group_ready(g, pring)
                self.assertEqual(a.wait_groups(2, dring, timeout_s=5), 2)
                Sequence(d, a.commit(release=True, ring=dring), a.arena).release()
                self.assertTrue(finished_soon(h, pring))
                h.release(pring)
                seq.release()

    def test_second_register_keeps_the_first(self):
        """register() on a client registered already is refused by libepd (EALREADY)
        without changing anything: the first registration's arenas and views stay (they
        were dropped before the call, and its Arena objects refused)."""
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cpu")
            a = c.arena("host0")
            path = c.worker_path
            with self.assertRaises(epd.EpdError) as e:
                c.register("prefill", "m", "cpu")
            self.assertEqual(e.exception.errno, errno.EALREADY)
            self.assertEqual(c.worker_path, path)
            self.assertEqual(bytes(a.buffer(0, 8)), b"EPDARENA")

    def test_flush_waits_through_signals(self):
        """Client.flush() without a timeout waits in slices (docs/api.md): a signal whose
        handler returns lets it go on until the answers come (no EpdError(EINTR)), one
        whose handler raises ends it with that exception."""
        import signal
        import threading
        import epd.feature as ef

        class Alarm(Exception):
            pass
        handled = []
        old = signal.signal(signal.SIGALRM, lambda s, f: handled.append(s))
        pid = self.d.proc.pid
        try:
            with epd.Client(self.d.address) as c:
                c.register("encoder", "m", "cpu")
                for raising in (False, True):
                    f = ef.Feature.acquire(c, f"img:flush-{int(raising)}", may_produce=True)
                    f.produce(64, [ef.Tensor("x", "u8", (64,), 0)])
                    os.kill(pid, signal.SIGSTOP)  # the answers wait until SIGCONT
                    resume = threading.Timer(0.8, os.kill, (pid, signal.SIGCONT))
                    try:
                        f.publish_release(1)
                        if raising:
                            signal.signal(signal.SIGALRM, lambda s, f: (_ for _ in ()).throw(Alarm()))
                        resume.start()
                        signal.setitimer(signal.ITIMER_REAL, 0.2)
                        t0 = time.monotonic()
                        if raising:
                            with self.assertRaises(Alarm):
                                c.flush()
                            self.assertLess(time.monotonic() - t0, 0.7)
                            resume.join()
                            self.assertIsNone(c.flush(5))
                        else:
                            self.assertIsNone(c.flush())
                            self.assertGreaterEqual(time.monotonic() - t0, 0.7)
                            self.assertEqual(handled, [signal.SIGALRM])
                    finally:
                        signal.setitimer(signal.ITIMER_REAL, 0)
                        resume.cancel()
                        resume.join()
                        os.kill(pid, signal.SIGCONT)
        finally:
            signal.signal(signal.SIGALRM, old)

    def test_released_at_commit(self):
        """release_on_commit and commit(release=True): no release() on either side; the
        handoffs are gone once the decode side committed, its sequence stays."""
        from epd.handoff import Accepted, Handoff, Ring
        from epd.sequence import Sequence
        rid = "%032x" % 0x5153
        with self.prefill_and_decode() as (p, d):
            with Ring(d) as dring, Ring(p) as pring:
                seq = Sequence.create(p, "host0", 2)
                h = Handoff.prepare(p, rid, "", seq.path, [2, 2], ready=2, release_on_commit=True)
                a = Accepted.accept(d, rid, wait_s=1)
                self.assertEqual(a.wait_groups(2, dring, timeout_s=5), 2)
                dseq = a.commit(release=True)
                with self.assertRaises(epd.EpdError):
                    a.status()
                for _ in range(200):
                    try:
                        h.status()
                    except epd.EpdError:
                        break
                    pring.poll(0.01)
                else:
                    self.fail("the source side was not released at commit")
                # The prefill's ring says committed, then forgets the handoff (no release()
                # will): a long-running worker's tables do not grow.
                self.assertTrue(finished_soon(h, pring))
                self.assertIsNone(pring.handoff_state(rid, h.token))
                self.assertNotIn((rid, h.token), pring.progress)
                Sequence(d, dseq, a.arena).release()
                seq.release()

    def test_commit_on_the_ring(self):
        """Accepted.commit(ring=): the commit (and release) as a ring submission, answered
        once durable with the decode sequence; a refusal raises Commit's errno."""
        import errno
        from epd.handoff import Accepted, Handoff, Ring
        from epd.sequence import Sequence
        rid = "%032x" % 0x5154
        with self.prefill_and_decode() as (p, d):
            with Ring(d) as dring, Ring(p) as pring:
                seq = Sequence.create(p, "host0", 2)
                h = Handoff.prepare(p, rid, "", seq.path, [2, 2], release_on_commit=True)
                a = Accepted.accept(d, rid, wait_s=1)
                with self.assertRaises(epd.EpdError) as e:
                    a.commit(release=True, ring=dring)  # no group has arrived
                self.assertEqual(e.exception.errno, errno.EBUSY)
                for g in range(2):
                    h.layer_group_ready(g, pring)
                self.assertEqual(a.wait_groups(2, dring, timeout_s=5), 2)
                dseq = a.commit(release=True, ring=dring)
                self.assertTrue(dseq.startswith("/org/epd1/sequence/"), dseq)
                s = Sequence(d, dseq, a.arena)
                self.assertEqual(len(s.pages), 2)
                with self.assertRaises(epd.EpdError):
                    a.status()  # released with the commit
                self.assertNotIn((rid, a.token), dring.progress)
                s.release()
                seq.release()

    def test_ring_reopened_after_close(self):
        """Ring.close() closes the daemon's side too: the same client opens another."""
        from epd.handoff import Ring
        with self.prefill_and_decode() as (p, d):
            for _ in range(3):
                with Ring(d) as r:
                    r.accept("%032x" % 0x5170, timeout_s=0.01, user_data=9)
                    rec = r.next(5)
                    self.assertEqual(rec.user_data, 9)

    def test_ring_wait_ends_when_the_daemon_dies(self):
        """Ring.next() with no timeout (wait for ever) returns once the daemon is gone,
        with ECONNRESET: a decode waiting on its ring never hangs on a dead epdd."""
        import errno as _errno
        import threading
        from epd.handoff import Ring
        d = Daemon()
        try:
            c = epd.Client(d.address)
            c.register("decode", "m", "cpu")
            ring = Ring(c)
            out = {}

            def wait():
                try:
                    out["rec"] = ring.next(None)
                except epd.EpdError as e:
                    out["errno"] = e.errno
            import select
            dfd = ring.daemon_fileno()
            self.assertIsNotNone(dfd)
            self.assertEqual(select.select([dfd], [], [], 0)[0], [])  # alive: quiet
            t = threading.Thread(target=wait)
            t.start()
            time.sleep(0.2)
            d.proc.kill()
            d.proc.wait()
            t.join(5)
            self.assertFalse(t.is_alive(), "Ring.next() still waits 5 s after the daemon died")
            self.assertEqual(out, {"errno": _errno.ECONNRESET})
            self.assertEqual(select.select([dfd], [], [], 1)[0], [dfd])  # for a caller's own loop
            ring.close()
            c.close()
        finally:
            d.stop()

    def test_ring_wait_runs_signal_handlers(self):
        """Ring.next() with no timeout lets Python's signal handlers run while it waits:
        libepd retries a poll() that a signal interrupted and ctypes keeps the thread in
        C, so the binding waits in slices of 0.2 s. A handler that raises ends the wait
        within a slice, and SIGINT is a KeyboardInterrupt. (Without the slices the
        handler ran only once the wait ended: here when the daemon is killed, 5 s on; on
        a bus connection, which has no daemon pidfd, never.)"""
        import signal
        import threading
        from epd.handoff import Ring

        class Alarm(Exception):
            pass

        def on_alarm(signum, frame):
            raise Alarm()

        d = Daemon()
        killer = threading.Timer(30, d.proc.kill)  # ends a wait that ignores the signals
        old_alrm = signal.signal(signal.SIGALRM, on_alarm)
        old_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # may be ignored when run in background
        try:
            with epd.Client(d.address) as c:
                c.register("decode", "m", "cpu")
                ring = Ring(c)
                killer.start()
                t0 = time.monotonic()
                signal.setitimer(signal.ITIMER_REAL, 0.3)
                with self.assertRaises(Alarm):
                    ring.next(None)
                self.assertLess(time.monotonic() - t0, 1.5, "the handler ran only once the wait ended")
                t0 = time.monotonic()
                ctrl_c = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
                ctrl_c.start()
                try:
                    with self.assertRaises(KeyboardInterrupt):
                        ring.next(None)
                finally:
                    ctrl_c.join()
                self.assertLess(time.monotonic() - t0, 1.5)
                # A timeout longer than a slice is still a timeout: None after it.
                t0 = time.monotonic()
                self.assertIsNone(ring.next(0.5))
                self.assertGreaterEqual(time.monotonic() - t0, 0.5)
                ring.close()
        finally:
            killer.cancel()
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old_alrm)
            signal.signal(signal.SIGINT, old_int)
            d.stop()

    def test_ring_fd_quiet_once_drained(self):
        """A worker that waits on Ring.fileno() in its own loop (select, poll, asyncio) and
        takes the records with next(0) until None finds the fd quiet again: a readable fd
        with nothing to take would spin its loop."""
        import select
        from epd.handoff import Ring
        with self.prefill_and_decode() as (p, d):
            with Ring(d) as dring:
                for i in range(3):
                    # Two answers (timeouts: no such handoff), then the fd.
                    dring.accept("%032x" % (0x5160 + 2 * i), timeout_s=0.02, user_data=1)
                    dring.accept("%032x" % (0x5161 + 2 * i), timeout_s=0.02, user_data=2)
                    got = []
                    while len(got) < 2:
                        r, _, _ = select.select([dring], [], [], 5)
                        self.assertTrue(r, "no wakeup for the answers")
                        while (rec := dring.next(0)) is not None:
                            got.append(rec.user_data)
                    self.assertEqual(sorted(got), [1, 2])
                    r, _, _ = select.select([dring], [], [], 0.05)
                    self.assertEqual(r, [], "the ring's fd stays readable with nothing to take")

    def test_closed_client_refused(self):
        """A closed client's calls are refused in words; none reaches libepd with no
        connection (a NULL handle)."""
        c = epd.Client(self.d.address)
        c.register("prefill", "m", "cpu")
        c.close()
        for call in (c.fileno, lambda: c.wait(0), lambda: c.flush(0), c.unregister,
                     lambda: c.register("prefill", "m", "cpu"), lambda: c.arena("host0"), c.arenas,
                     lambda: c.worker_path):
            with self.assertRaises(ValueError) as e:
                call()
            self.assertIn("closed", str(e.exception))

    def test_local_refusal_not_named_after_an_earlier_error(self):
        with epd.Client(self.d.address) as c:
            with self.assertRaises(epd.EpdError) as e:
                c.register("prefill", "m", "cpu", arenas=["nosuch"])
            self.assertEqual(e.exception.name, "org.epd1.Error.NotFound")
            with self.assertRaises(epd.EpdError) as e:
                c.unregister()
            self.assertEqual(e.exception.errno, errno.ENOTCONN)
            self.assertEqual(e.exception.name, f"errno.{errno.ENOTCONN}")
            self.assertIn("not registered", str(e.exception))

    def test_errors_carry_dbus_names(self):
        with epd.Client(self.d.address) as c:
            with self.assertRaises(epd.EpdError) as e:
                c.register("janitor", "m", "cpu")
            self.assertEqual(e.exception.name, "org.epd1.Error.InvalidArgument")
            self.assertIn("unknown role", str(e.exception))
            with self.assertRaises(epd.EpdError) as e:
                c.register("prefill", "m", "cpu", arenas=["nosuch"])
            self.assertEqual(e.exception.name, "org.epd1.Error.NotFound")
            c.register("prefill", "m", "cpu")
            with self.assertRaises(epd.EpdError) as e:
                c.arena("nosuch")
            with self.assertRaises(ValueError):
                c.arena("host0").buffer(0, 1 << 40)
        with self.assertRaises(epd.EpdError) as e:
            epd.Client("direct:/nonexistent/socket")
        # libepd's own refusal (no daemon asked, no client to read a name from): errno.N
        self.assertEqual(e.exception.name, f"errno.{e.exception.errno}")


if __name__ == "__main__":
    unittest.main()
