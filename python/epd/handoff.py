# SPDX-License-Identifier: LGPL-2.1-or-later
"""Layered KV handoffs (org.epd1.Handoffs / org.epd1.Handoff) and the ring pair.

Prefill side:
    h = Handoff.prepare(c, request_id, "", seq, layer_groups=[4, 4, 4])   # "" : this host
    ring = Ring(c)                       # optional: per-group notices without a bus round trip
    ... compute group g ... ; h.layer_group_ready(g, ring)
Decode side:
    a = Accepted.accept(c, request_id, wait_s=30)   # arena + page offsets where the KV lands
                                         # (waits for the prefill's Prepare, no polling)
    a.wait_groups(a.n_groups, ring)      # progress records (or polling without a ring)
    seq_path = a.commit()

See docs/handoff.md for the states and the guarantees."""

import ctypes
import errno as _errno
import math
import time
import weakref
from typing import List, NamedTuple, Optional, Sequence as Seq

from . import _lib

__all__ = ["Handoff", "Accepted", "Ring", "RingRecord", "Backpressure"]

_P = ctypes.POINTER
RING_EV_COMPLETION = 0x81
RING_EV_GROUP_PROGRESS = 0x82
RING_EV_HANDOFF_STATE = 0x83
RING_EV_BACKPRESSURE = 0x84
RING_EV_HANDOFF_ACCEPTED = 0x85
_COMMIT_USER_DATA = 0x434F4D4D << 32  # "COMM": Ring.commit()'s answers
HANDOFF_STATE_COMMITTED = 4
HANDOFF_STATE_RELEASED = 5
HANDOFF_STATE_ROLLED_BACK = 6
# The longest the daemon waits for a handoff to be prepared here (an accept's wait,
# handoff.h: "at most an hour"; a longer one is refused): Ring.accept's infinite
# timeout, and the slices of Accepted.accept's.
ACCEPT_WAIT_MAX_S = 3600


class _Options(ctypes.Structure):
    _fields_ = [("arena", ctypes.c_char_p), ("target", ctypes.c_char_p), ("timeout_usec", ctypes.c_uint64),
                ("ready", ctypes.c_uint32), ("release_on_commit", ctypes.c_bool)]


class _Accepted(ctypes.Structure):
    _fields_ = [("path", ctypes.c_char_p), ("token", ctypes.c_uint64), ("arena", ctypes.c_char_p),
                ("offsets", _P(ctypes.c_uint64)), ("n_pages", ctypes.c_size_t), ("n_groups", ctypes.c_uint32),
                ("groups_done", ctypes.c_uint32)]


class _Status(ctypes.Structure):
    _fields_ = [("state", ctypes.c_char * 24), ("cause", ctypes.c_char * 24), ("groups_done", ctypes.c_uint32),
                ("n_groups", ctypes.c_uint32), ("bytes", ctypes.c_uint64)]


RING_F_PEER_TRUNCATED = 0x0002
BACKPRESSURE_LEVELS = ("none", "elevated", "high", "stalled")
BACKPRESSURE_REASONS = ("none", "rtt-inflation", "retransmits", "send-queue", "send-queue-growth",
                        "handoffs-in-flight", "destination-full", "stalled", "disconnected")


class Backpressure(NamedTuple):
    """EPD_RING_EV_BACKPRESSURE, decoded: a peer path's level changed."""
    peer: str               # the peer's host id (cut at 32 bytes when `truncated`)
    truncated: bool
    level: int              # 0 none, 1 elevated, 2 high, 3 stalled
    level_name: str
    reason: str             # as in the D-Bus signal ("retransmits", ...)
    permille: int           # how full the handoff window to that peer is (1000: closed)
    retry_after_usec: int   # what a Prepare towards it would be told now (0 at none)


class RingRecord(ctypes.Structure):
    """struct epd_ring_record (client/include/epd/ring.h), 64 bytes."""
    _fields_ = [("opcode", ctypes.c_uint16), ("flags", ctypes.c_uint16), ("result", ctypes.c_int32),
                ("user_data", ctypes.c_uint64), ("request_id", ctypes.c_uint8 * 16), ("token", ctypes.c_uint64),
                ("group", ctypes.c_uint32), ("count", ctypes.c_uint32), ("arg0", ctypes.c_uint64),
                ("arg1", ctypes.c_uint64)]

    def backpressure(self) -> Optional[Backpressure]:
        """The backpressure notice this record carries, or None for another record (or a
        level this version does not know)."""
        if self.opcode != RING_EV_BACKPRESSURE or self.group >= len(BACKPRESSURE_LEVELS):
            return None
        raw = bytes(self)[8:40]
        peer = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
        reason = BACKPRESSURE_REASONS[self.count] if self.count < len(BACKPRESSURE_REASONS) else str(self.count)
        return Backpressure(peer, bool(self.flags & RING_F_PEER_TRUNCATED), self.group,
                            BACKPRESSURE_LEVELS[self.group], reason, min(self.arg0, 1000), self.arg1)


assert ctypes.sizeof(RingRecord) == 64


def _lib_handoffs():
    lib = _lib.lib()
    if getattr(lib, "_epd_handoffs_declared", False):
        return lib
    c_int, c_char_p, c_size_t, c_void_p = ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p
    c_uint32, c_uint64 = ctypes.c_uint32, ctypes.c_uint64
    decls = {
        "epd_handoff_prepare": (c_int, [c_void_p, c_char_p, c_char_p, c_char_p, _P(c_uint32), c_size_t,
                                        _P(_Options), _P(c_void_p), _P(c_uint64)]),
        "epd_handoff_layer_group_ready": (c_int, [c_void_p, c_char_p, c_uint32]),
        "epd_handoff_accept": (c_int, [c_void_p, c_char_p, _P(_Accepted)]),
        "epd_handoff_accept_wait": (c_int, [c_void_p, c_char_p, c_uint64, _P(_Accepted)]),
        "epd_ring_accept": (c_int, [c_void_p, c_char_p, c_uint64, c_uint64]),
        "epd_ring_commit": (c_int, [c_void_p, c_char_p, c_uint64, c_int, c_uint64]),
        "epd_ring_fd": (c_int, [c_void_p]),
        "epd_ring_daemon_fd": (c_int, [c_void_p]),
        "epd_handoff_accepted_done": (None, [_P(_Accepted)]),
        "epd_handoff_commit": (c_int, [c_void_p, c_char_p, _P(c_void_p)]),
        "epd_handoff_commit_and_release": (c_int, [c_void_p, c_char_p, _P(c_void_p)]),
        "epd_handoff_rollback": (c_int, [c_void_p, c_char_p]),
        "epd_handoff_watch": (c_int, [c_void_p, ctypes.c_bool]),
        "epd_handoff_release": (c_int, [c_void_p, c_char_p]),
        "epd_handoff_get": (c_int, [c_void_p, c_char_p, _P(_Status)]),
        "epd_ring_open": (c_int, [c_void_p, c_uint32, c_uint32, _P(c_void_p)]),
        "epd_ring_close": (c_void_p, [c_void_p]),
        "epd_ring_layer_group_ready": (c_int, [c_void_p, c_char_p, c_uint64, c_uint32, c_uint64]),
        "epd_ring_next": (c_int, [c_void_p, _P(RingRecord), c_uint64]),
        "epd_ring_overflows": (c_uint32, [c_void_p]),
        "epd_ring_release": (c_int, [c_void_p, c_void_p]),
    }
    _lib.declare(lib, decls)
    lib._epd_handoffs_declared = True
    return lib




class Ring(_lib.Closing):
    """The shared-memory ring pair (memfd + eventfds): submit records, take events.

    Events of every handoff this process owns arrive on one completion ring, in any order.
    The ring keeps, per handoff token, the latest progress and state it has seen, so that
    a worker waiting for one request never drops another request's events, and a worker
    that only submits (prefill) can drain its events with poll() and never fill the ring
    (a full ring makes the daemon hold its events back, and past 4 x its size fall back
    to D-Bus signals, which this binding does not read: overflows() counts them, and a
    handoff whose records may be among them asks the bus, see Handoff.finished and
    Accepted.wait_groups).

    The daemon may let go of a ring while it lives on (CloseRing, a corrupt queue, its
    client dropped for not reading its bus connection): its waits and submissions then
    end with EpdError(ECONNRESET), `let_go` is set, the handoffs' calls given it ask the
    bus, and reopen() opens another in its place."""

    let_go = False  # the daemon let go of it (ECONNRESET): reopen() opens another
    _lost = 0       # added to the daemon's overflow count: moved past it by reopen()

    def __init__(self, client, sq_entries: int = 256, cq_entries: int = 1024):
        self._client, self._lib = client, _lib_handoffs()
        sq_entries, cq_entries = _lib.u32(sq_entries, "sq_entries"), _lib.u32(cq_entries, "cq_entries")
        p = ctypes.c_void_p()
        client._check(self._lib.epd_ring_open(client._c, sq_entries, cq_entries, ctypes.byref(p)), "open ring")
        self._r = p
        self._sizes = (sq_entries, cq_entries)
        # The client's ring (a client has one): a handoff made on the client starts from
        # its overflows() then (_overflows_now), not from 0, which would cost every
        # handoff a status call once the ring ever lost a record.
        client._ring_ref = weakref.ref(self)
        # Objects that use the ring from a thread of their own (epd.gpu.Notifier): closed
        # before the ring is, so that no thread submits to a ring that was freed.
        self._users = weakref.WeakSet()
        # Notifiers open on this ring (gpu.Notifier): their threads submit to it, so the
        # collector's close of this side waits for the last of them (_close_pending).
        self._notifiers = 0
        self._close_pending = False
        # The notifier of this ring on each GPU, by ordinal (epd.workers.connector's
        # _notifier(): one per ring and GPU, kept for the next saves). Kept here, not in
        # a module-level cache: it holds the ring, the ring its client, and a cache that
        # outlives them kept a dropped client, its connection and the notifier's thread
        # for ever. close() closes and drops them.
        self.gpu_notifiers = {}
        # A handoff is (request id, token), never its token alone: tokens are unique per
        # source daemon only, and a decode worker takes handoffs from several hosts.
        self.progress = {}  # (request id (32 hex digits), token) -> groups landed (the highest count seen)
        self.state = {}     # (request id, token) -> (EPD_HANDOFF_STATE_*, EPD_HANDOFF_CAUSE_*)
        self.other = []     # events that are not about a handoff (completions, backpressure), oldest first
        self.accepted = {}  # request id -> token: answers to accept()
        self._serial = 0    # commit()'s user_data

    def _check(self, r: int, what: str) -> int:
        """A ring call's result. Unlike Client._check, no bus call here (no collected handle
        given back) and no error name from the connection: a ring call is the one thing a
        thread may do while another thread uses the connection (a connector's background
        setup), and the connection's last error belongs to that other call."""
        if r < 0:
            from . import EpdError
            if r == -_errno.ECONNRESET:
                self.let_go = True
                raise EpdError(-r, None, "the daemon let go of the ring (CloseRing, a corrupt queue, its client "
                               "dropped, or it exited): nothing more comes on it; the handoffs' states are on the "
                               "bus, and reopen() opens another ring", what)
            raise EpdError(-r, None, None, what)
        return r

    def overflows(self) -> int:
        """How many records the daemon could not post on this ring (the CQ and its backlog
        were full: a worker that did not read it) and sent as D-Bus signals instead
        (epd_ring_overflows), and past that once more for every reopen() (what was sent
        while the daemon had let go of it went the same way). Never goes back: a handoff
        that saw it move since its last look asks the bus (Handoff.finished,
        Accepted.wait_groups), its records may be among those lost."""
        return self._lost + self._lib.epd_ring_overflows(self._handle())

    def reopen(self):
        """Opens another ring in this one's place, of the same sizes, once the daemon let go
        of this one (let_go): the same object, its tables kept. Its notifiers are closed
        first (ask for new ones: connector._notifier does); overflows() moves on, so that
        every handoff asks the bus once for what went as signals meanwhile. On a client
        whose connection is gone this raises as opening a ring does."""
        lost = self._lost + (self._lib.epd_ring_overflows(self._r) if self._r else 0) + 1
        for u in list(self._users):
            u.close()
        self.gpu_notifiers.clear()
        if self._r:
            old, self._r = self._r, None
            if getattr(self._client, "_c", None):
                self._lib.epd_ring_release(self._client._c, old)  # -ENOENT when the daemon has none; closes old
            else:
                self._lib.epd_ring_close(old)
        self._lost = lost
        p = ctypes.c_void_p()
        self._client._check(self._lib.epd_ring_open(self._client._c, *self._sizes, ctypes.byref(p)), "reopen ring")
        self._r = p
        self.let_go = False

    def _handle(self):
        if not self._r:
            raise ValueError("the ring is closed")
        return self._r

    def layer_group_ready(self, request_id: str, token: int, group: int, user_data: int = 0):
        token, group = _lib.u64(token, "token"), _lib.u32(group, "group")
        self._check(self._lib.epd_ring_layer_group_ready(self._handle(), request_id.encode(), token, group,
                                                         _lib.u64(user_data, "user_data")),
                    "ring: layer group ready")

    def accept(self, request_id: str, timeout_s: Optional[float] = 0, user_data: int = 0):
        """Asks the daemon to accept the handoff of request_id for this client as soon as it
        is prepared here (waiting up to timeout_s; 0: the daemon's HandoffTimeout=; None
        or infinity: the longest the daemon waits, ACCEPT_WAIT_MAX_S; negative or NaN:
        ValueError). The answer is a RING_EV_HANDOFF_ACCEPTED record (kept in `accepted`,
        by request id) or a completion with the error (in `other`); Accepted.accept() then
        gives the offsets."""
        t = _lib.timeout(timeout_s, "timeout_s")
        usec = _lib.u64(int((ACCEPT_WAIT_MAX_S if t is None else t) * 1e6), "timeout_s in microseconds")
        self._check(self._lib.epd_ring_accept(self._handle(), request_id.encode(), usec,
                                              _lib.u64(user_data, "user_data")),
                    "ring: accept")

    def commit(self, request_id: str, token: int, release: bool = False, timeout_s: Optional[float] = 30.0) -> str:
        """Commits the handoff (request_id, token) this client accepted, and releases it
        too with release (CommitAndRelease), on the ring: no bus round trip. Waits for the
        answer (sent once the records are durable; other events met meanwhile go to the
        tables as poll() puts them; None or infinity: no time limit) and returns the
        decode sequence's path; EpdError with Commit's errno on a refusal (EBUSY groups
        missing, ESTALE rolled back, EPERM another client's, ENOENT none)."""
        timeout_s = _lib.timeout(timeout_s, "timeout_s", past=True)  # before anything is submitted
        return self._commit_wait(request_id, token, release, self._commit_submit(request_id, token, release),
                                 timeout_s)

    def _commit_submit(self, request_id: str, token: int, release: bool) -> int:
        """The commit's submission (raises, nothing submitted, when the ring refuses it);
        its user_data."""
        token = _lib.u64(token, "token")
        self._serial += 1
        user_data = _COMMIT_USER_DATA | self._serial
        self._check(self._lib.epd_ring_commit(self._handle(), request_id.encode(), token, int(release), user_data),
                    "ring: commit")
        return user_data

    def _commit_wait(self, request_id: str, token: int, release: bool, user_data: int,
                     timeout_s: Optional[float]) -> str:
        """timeout_s: as _lib.timeout() gives it (None: no end)."""
        from . import EpdError
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                rec = self.next(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except EpdError as e:
                if e.errno != _errno.ECONNRESET:
                    raise
                raise EpdError(e.errno, None, f"the daemon let go of the ring before it answered the commit of "
                               f"{request_id}: whether it committed, the handoff's status says", "ring: commit")
            if rec is None:
                raise EpdError(_errno.ETIMEDOUT, "org.epd1.Error.Timeout", f"no answer to the commit of {request_id}",
                               "ring: commit")
            if rec.opcode == RING_EV_COMPLETION and rec.user_data == user_data:
                if rec.result < 0:
                    raise EpdError(-rec.result, None, f"commit of {request_id} refused", "ring: commit")
                if release:
                    self.forget(request_id, token)
                return "/org/epd1/sequence/" + bytes(rec.request_id).hex()
            self._absorb(rec)

    def fileno(self) -> int:
        """The completion eventfd: readable when events were posted (select/poll/asyncio);
        take them with next(0) until None, which also clears it."""
        return self._lib.epd_ring_fd(self._handle())

    def daemon_fileno(self) -> Optional[int]:
        """A pidfd of the daemon, readable once it exited: a loop that waits on fileno()
        watches this one too, or it never notices a dead daemon. None where there is none
        (a bus connection, an older kernel)."""
        fd = self._lib.epd_ring_daemon_fd(self._handle())
        return fd if fd >= 0 else None

    def next(self, timeout_s: Optional[float] = None) -> Optional[RingRecord]:
        """The next raw event, or None after timeout_s (None: wait until one comes; a
        past or 0 timeout: only look). The wait is made of slices of at most 0.2 s
        (_lib.wait_slices), so that Python's signal handlers run during it: Ctrl-C
        raises KeyboardInterrupt here even where nothing tells libepd that the daemon
        died (a bus connection, a daemon in another PID namespace)."""
        rec = RingRecord()
        for t in _lib.wait_slices(timeout_s):
            r = self._lib.epd_ring_next(self._handle(), ctypes.byref(rec), t)
            if r != -_errno.EAGAIN:
                self._check(r, "ring: next")
                return rec
        return None

    def _absorb(self, rec: RingRecord):
        if rec.opcode == RING_EV_GROUP_PROGRESS:
            # groups [0, group) complete, out of count (ring.h)
            key = (bytes(rec.request_id).hex(), rec.token)
            self.progress[key] = max(self.progress.get(key, 0), rec.group)
        elif rec.opcode == RING_EV_HANDOFF_STATE:
            self.state[(bytes(rec.request_id).hex(), rec.token)] = (rec.arg0, rec.arg1)
        elif rec.opcode == RING_EV_HANDOFF_ACCEPTED:
            rid = bytes(rec.request_id).hex()
            self.accepted[rid] = rec.token
            self.progress[(rid, rec.token)] = max(self.progress.get((rid, rec.token), 0), rec.group)
        else:
            self.other.append(rec)
            del self.other[:-1024]  # bounded: only the newest are kept

    def poll(self, timeout_s: float = 0.0) -> int:
        """Takes every event that is there (waiting up to timeout_s for the first one) into
        the per-handoff tables; returns how many were taken."""
        n = 0
        rec = self.next(timeout_s)
        while rec is not None:
            self._absorb(rec)
            n += 1
            rec = self.next(0)
        return n

    def groups_landed(self, request_id: str, token: int) -> int:
        """The groups of handoff (request_id, token) the ring said have landed (0: none yet)."""
        return self.progress.get((request_id.lower(), token), 0)

    def handoff_state(self, request_id: str, token: int):
        """(EPD_HANDOFF_STATE_*, EPD_HANDOFF_CAUSE_*) of handoff (request_id, token) from the
        ring's state records, or None when none came."""
        return self.state.get((request_id.lower(), token))

    def _lost_since(self, seen: int):
        """(whether this ring's tables may miss records of a handoff that last looked when
        overflows() was `seen`, overflows() now): it moved since, or the daemon let go of
        the ring (then nothing more comes on it: the bus it is, every time). Read before
        the caller asks the bus, so that a record lost after that is seen next time."""
        if self.let_go:
            return True, seen
        n = self.overflows()
        return n != seen, n

    def _poll_quietly(self, timeout_s: float = 0.0) -> None:
        """poll(), where a ring the daemon let go of (ECONNRESET) only sets let_go: the
        handoffs' calls then ask the bus."""
        from . import EpdError
        if self.let_go:
            return
        try:
            self.poll(timeout_s)
        except EpdError as e:
            if e.errno != _errno.ECONNRESET:
                raise

    def forget(self, request_id: str, token: int):
        """Drops what the ring remembers of a handoff this process is done with (its
        progress, state and accept answer): a long-running worker's tables stay as large
        as its handoffs in flight."""
        rid = request_id.lower()
        self.progress.pop((rid, token), None)
        self.state.pop((rid, token), None)
        if self.accepted.get(rid) == token:
            del self.accepted[rid]

    def close(self):
        """Closes the ring on both sides while the client is open (the daemon's side goes
        too: notifications go back to D-Bus signals and the client may open another
        ring), else this side alone (the daemon's goes with the client)."""
        for u in list(self._users):
            u.close()
        self.gpu_notifiers.clear()
        if self._r:
            if getattr(self._client, "_c", None):
                self._lib.epd_ring_release(self._client._c, self._r)  # closes self._r either way
            else:
                self._lib.epd_ring_close(self._r)
            self._r = None

    def _notifier_closed(self):
        self._notifiers -= 1
        if self._notifiers == 0 and self._close_pending and self._r:
            self._lib.epd_ring_close(self._r)
            self._r = None

    def __del__(self):
        # Collected: this side alone, no bus call (the collector may run in any thread,
        # while another uses the client); the daemon's side goes with the client. A ring
        # collected with a notifier of it (one cycle of garbage: their finalizers run in
        # no set order) is closed by that notifier's close, after its thread stopped
        # submitting: closed first, the thread wrote into freed memory.
        try:
            if self._r:
                if self._notifiers > 0:
                    self._close_pending = True
                else:
                    self._lib.epd_ring_close(self._r)
                    self._r = None
        except Exception:
            pass


def _overflows_now(client) -> int:
    """The overflows() of the client's ring, read before a Prepare or Accept: records of
    the handoff it makes can only be lost after it, so a handoff that starts from it asks
    the bus only if the count moves later. 0 (asks once) where there is no ring or the
    daemon let go of it."""
    ref = getattr(client, "_ring_ref", None)
    ring = ref() if ref is not None else None
    if ring is None or not ring._r or ring.let_go:
        return 0
    return ring.overflows()


def watch(client, enable: bool = True):
    """This client gets every handoff's Progress and StateChanged signals (a monitor)."""
    client._check(_lib_handoffs().epd_handoff_watch(client._c, enable), "watch")


class Handoff:
    """The prefill side of one handoff."""

    _overflows_seen = 0  # Ring.overflows() at this handoff's last look at a ring (finished())

    def __init__(self, client, path: str, token: int, request_id: str, release_on_commit: bool = False):
        self._client, self._lib = client, _lib_handoffs()
        self.path, self.token, self.request_id = path, token, request_id
        self.release_on_commit = release_on_commit
        self._finished = False

    @classmethod
    def prepare(cls, client, request_id: str, destination: str, sequence: str, layer_groups: Seq[int],
                arena: Optional[str] = None, target: Optional[str] = None, timeout_s: float = 0,
                ready: int = 0, release_on_commit: bool = False) -> "Handoff":
        """ready: layer groups [0, ready) are computed already and ship with Prepare.
        timeout_s: how long the handoff may take (0: the daemon's HandoffTimeout=, also its
        most: None or infinity asks for that; negative or NaN: ValueError). Each layer
        group's count, and ready, in [0, 2**32) (ValueError: checked here, ctypes would
        pass the low bits). release_on_commit: the source side is released once the
        destination commits (no release() call; its ring says committed first)."""
        lib = _lib_handoffs()
        groups, n_groups = _lib.u32_array(layer_groups, "layer_groups")
        opts = _Options(arena.encode() if arena else None, target.encode() if target else None,
                        _lib.usec(timeout_s, "timeout_s"), _lib.u32(ready, "ready"), release_on_commit)
        path, token = ctypes.c_void_p(), ctypes.c_uint64()
        seen = _overflows_now(client)
        client._check(lib.epd_handoff_prepare(client._c, request_id.encode(), destination.encode(),
                                              sequence.encode(), groups, n_groups, ctypes.byref(opts),
                                              ctypes.byref(path), ctypes.byref(token)),
                      f"prepare handoff {request_id}")
        h = cls(client, _lib.take_string(lib, path), token.value, request_id, release_on_commit)
        h._overflows_seen = seen
        return h

    def layer_group_ready(self, group: int, ring: Optional[Ring] = None):
        """Group computed: ship it now (through the ring when given: no bus round trip)."""
        group = _lib.u32(group, "group")
        if ring is not None:
            ring.layer_group_ready(self.request_id, self.token, group)
        else:
            self._client._check(self._lib.epd_handoff_layer_group_ready(self._client._c, self.path.encode(), group),
                                f"layer group {group} ready")

    def status(self) -> dict:
        st = _Status()
        self._client._check(self._lib.epd_handoff_get(self._client._c, self.path.encode(), ctypes.byref(st)),
                            "handoff status")
        return {"state": st.state.decode(), "cause": st.cause.decode(), "groups_done": st.groups_done,
                "n_groups": st.n_groups, "bytes": st.bytes}

    def finished(self, ring: Optional[Ring] = None) -> bool:
        """Whether the destination is done with this handoff (committed or rolled back): from
        the ring's state records when given (no bus round trip), else from its status. With
        a ring that may have lost one of its records (its overflows() moved since this
        handoff last looked: the daemon sent them as D-Bus signals; or the daemon let go of
        it), from its status too: a bus call, on the client's thread."""
        from . import EpdError
        if self._finished:
            return True
        if ring is not None:
            ring._poll_quietly()
            st = ring.handoff_state(self.request_id, self.token)
            self._finished = st is not None and st[0] in (HANDOFF_STATE_COMMITTED, HANDOFF_STATE_ROLLED_BACK)
            committed = self._finished and st[0] == HANDOFF_STATE_COMMITTED
            if not self._finished:
                lost, self._overflows_seen = ring._lost_since(self._overflows_seen)
                if lost:
                    try:
                        state = self.status()["state"]
                    except EpdError as e:
                        if e.errno != _errno.ENOENT or not self.release_on_commit:
                            raise
                        state = "committed"  # released at commit: gone from the bus
                    self._finished = state in ("committed", "rolled-back")
                    committed = state == "committed"
            if committed and self.release_on_commit:
                ring.forget(self.request_id, self.token)  # released at commit: no release() will forget it
            return self._finished
        return self.status()["state"] in ("committed", "rolled-back")

    def rollback(self):
        self._client._check(self._lib.epd_handoff_rollback(self._client._c, self.path.encode()), "rollback")

    def release(self, ring: Optional[Ring] = None):
        self._client._check(self._lib.epd_handoff_release(self._client._c, self.path.encode()), "release handoff")
        if ring is not None:
            ring.forget(self.request_id, self.token)


class Accepted:
    """The decode side of one handoff: where the KV lands, and its progress."""

    _overflows_seen = 0  # Ring.overflows() at this handoff's last look at a ring (wait_groups())

    def __init__(self, client, a: _Accepted, request_id: str):
        self._client, self._lib = client, _lib_handoffs()
        self.request_id = request_id
        self.path = a.path.decode()
        self.token = a.token
        self.arena = a.arena.decode()
        self.offsets: List[int] = [a.offsets[i] for i in range(a.n_pages)]
        self.n_groups = a.n_groups
        self.groups_done = a.groups_done

    @classmethod
    def accept(cls, client, request_id: str, wait_s: Optional[float] = 0) -> "Accepted":
        """Takes the handoff of request_id on this host. With wait_s > 0, one that is not
        prepared here yet is waited for (AcceptWait: no polling) and taken the moment it
        arrives; EpdError with errno ETIMEDOUT (org.epd1.Error.Timeout) when none came.
        None or infinity waits without end (AcceptWaits of ACCEPT_WAIT_MAX_S, the
        daemon's most, one after another); a negative wait_s does not wait; NaN is
        ValueError."""
        wait_s = _lib.timeout(wait_s, "wait_s", past=True)
        lib, a = _lib_handoffs(), _Accepted()
        seen = _overflows_now(client)
        if wait_s is None:
            while True:
                r = lib.epd_handoff_accept_wait(client._c, request_id.encode(), ACCEPT_WAIT_MAX_S * 1000000,
                                                ctypes.byref(a))
                if r != -_errno.ETIMEDOUT:
                    break
        elif wait_s > 0:
            r = lib.epd_handoff_accept_wait(client._c, request_id.encode(), _lib.usec(wait_s, "wait_s"),
                                            ctypes.byref(a))
        else:
            r = lib.epd_handoff_accept(client._c, request_id.encode(), ctypes.byref(a))
        client._check(r, f"accept handoff {request_id}")
        try:
            acc = cls(client, a, request_id)
            acc._overflows_seen = seen
            return acc
        finally:
            lib.epd_handoff_accepted_done(ctypes.byref(a))

    @classmethod
    def accept_wait(cls, client, request_id: str, timeout_s: Optional[float] = 30.0,
                    ring: Optional[Ring] = None) -> "Accepted":
        """Accepts the handoff of request_id, waiting up to timeout_s for the prefill to
        prepare it (a decode worker may be told of a request before its handoff exists):
        one AcceptWait call that the daemon answers when the handoff is prepared here
        (None or infinity: no time limit, as accept())."""
        timeout_s = _lib.timeout(timeout_s, "timeout_s", past=True)
        return cls.accept(client, request_id, wait_s=None if timeout_s is None else max(timeout_s, 1e-6))

    def status(self) -> dict:
        st = _Status()
        self._client._check(self._lib.epd_handoff_get(self._client._c, self.path.encode(), ctypes.byref(st)),
                            "handoff status")
        self.groups_done = st.groups_done
        return {"state": st.state.decode(), "cause": st.cause.decode(), "groups_done": st.groups_done,
                "n_groups": st.n_groups, "bytes": st.bytes}

    def _look(self, ring: Optional[Ring]) -> None:
        """groups_done from what has arrived: the ring's tables, and the handoff's status
        (a bus call) without a ring or where the ring may have lost one of its records (its
        overflows() moved since this handoff last looked, or the daemon let go of it).
        Raises EpdError(ECANCELED) once the handoff was rolled back or released."""
        from . import EpdError
        if ring is not None:
            self.groups_done = max(self.groups_done, ring.groups_landed(self.request_id, self.token))
            st = ring.handoff_state(self.request_id, self.token)
            if st is not None and st[0] == HANDOFF_STATE_ROLLED_BACK:
                raise EpdError(_errno.ECANCELED, None, f"the handoff was rolled back (cause {st[1]})",
                               "wait for layer groups")
            lost, self._overflows_seen = ring._lost_since(self._overflows_seen)
            if not lost:
                return
        done = self.groups_done
        st = self.status()
        self.groups_done = max(done, self.groups_done)
        if st["state"] in ("rolled-back", "released"):
            raise EpdError(_errno.ECANCELED, None, f"handoff {st['state']} ({st['cause']})",
                           "wait for layer groups")

    def landed(self, ring: Optional[Ring] = None) -> int:
        """The groups landed so far, without waiting (what the ring has is taken first):
        wait_groups' look."""
        if ring is not None:
            ring._poll_quietly()
        self._look(ring)
        return self.groups_done

    def wait_groups(self, n: int, ring: Optional[Ring] = None, timeout_s: Optional[float] = 30.0) -> int:
        """Blocks until groups [0, n) have landed; progress records from the ring, or the
        handoff's state when there is no ring, or where the ring may have lost one of its
        records (its overflows() moved since this handoff last looked: the daemon sent them
        as D-Bus signals; or the daemon let go of it): a bus call, on the client's thread.
        Raises EpdError on rollback or timeout (None or infinity: no time limit)."""
        from . import EpdError
        timeout_s = _lib.timeout(timeout_s, "timeout_s", past=True)
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        while self.groups_done < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EpdError(_errno.ETIMEDOUT, "org.epd1.Error.Timeout", f"groups {self.groups_done}/{n}",
                               "wait for layer groups")
            self._look(ring)
            if self.groups_done < n:
                if ring is not None and not ring.let_go:
                    ring._poll_quietly(min(left, 1.0))
                else:
                    time.sleep(0.0005)
        return self.groups_done

    def commit(self, release: bool = False, ring: Optional[Ring] = None) -> str:
        """The decode sequence's path. release: the handoff is released in the same call
        (one round trip, one sync): call no release() after it. With the ring this client
        accepted on: the commit goes on it (Ring.commit, no bus round trip) and the ring
        forgets the handoff when released."""
        from . import EpdError
        if ring is not None and not ring.let_go:
            try:
                user_data = ring._commit_submit(self.request_id, self.token, release)
            except EpdError as e:
                if e.errno != _errno.ECONNRESET:
                    raise
                user_data = None  # the daemon let go of the ring, nothing submitted: on the bus
            if user_data is not None:
                return ring._commit_wait(self.request_id, self.token, release, user_data, 30.0)
        p = ctypes.c_void_p()
        fn = self._lib.epd_handoff_commit_and_release if release else self._lib.epd_handoff_commit
        self._client._check(fn(self._client._c, self.path.encode(), ctypes.byref(p)), "commit handoff")
        if ring is not None and release:
            ring.forget(self.request_id, self.token)
        return _lib.take_string(self._lib, p)

    def rollback(self):
        self._client._check(self._lib.epd_handoff_rollback(self._client._c, self.path.encode()), "rollback")

    def release(self, ring: Optional[Ring] = None):
        self._client._check(self._lib.epd_handoff_release(self._client._c, self.path.encode()), "release handoff")
        if ring is not None:
            ring.forget(self.request_id, self.token)
