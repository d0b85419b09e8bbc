# SPDX-License-Identifier: LGPL-2.1-or-later
"""Python binding of libepd, the client library of epd.

Workers use it to reach epdd, register, and map the daemon's arenas; tensors are
views of the mapped memory, never copies:

    import epd
    with epd.Client() as c:                 # $EPD_SOCKET, /run/epd/bus or the system bus
        c.register("prefill", "Qwen3-VL-8B", "cuda:0",
                   kv=epd.KvLayout(layers=36, tokens_per_block=16,
                                   k_bytes_per_token=2048, v_bytes_per_token=2048))
        buf = c.arena("host0").buffer()     # a writable memoryview of the shared arena

Errors are EpdError exceptions carrying errno and the D-Bus error name
(e.g. "org.epd1.Error.NoSpace").
"""

import collections
import ctypes
import errno as _errno
import os
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

from . import _lib

__all__ = ["Client", "EpdError", "KvLayout", "Arena"]


class EpdError(OSError):
    """A failed libepd call: errno, the daemon's error name and message."""

    def __init__(self, err: int, name: Optional[str], message: Optional[str], what: str):
        self.name = name
        self.what = what
        text = f"{what}: {name + ': ' if name else ''}{message or os.strerror(err)}"
        super().__init__(err, text)


@dataclass
class KvLayout:
    layers: int
    tokens_per_block: int
    k_bytes_per_token: int  # per token per layer
    v_bytes_per_token: int
    dtype: str = "bf16"

    def _c(self):
        return _lib.EpdKvLayout(_lib.u32(self.layers, "layers"), _lib.u32(self.tokens_per_block, "tokens_per_block"),
                                _lib.u64(self.k_bytes_per_token, "k_bytes_per_token"),
                                _lib.u64(self.v_bytes_per_token, "v_bytes_per_token"), self.dtype.encode())


class Arena:
    """One arena the daemon passed to this worker (by fd) at registration."""

    def __init__(self, client: "Client", index: int):
        a = _lib.lib().epd_arena_get(client._open(), index)
        if not a:
            raise ValueError(f"no arena {index} in this registration")
        a = a.contents
        self._client = client
        self._generation = client._generation  # of the registration it belongs to
        self.index = index
        self.name = a.name.decode()
        self.domain = a.domain.decode()
        self.usage = a.usage.decode()
        self.size = a.size
        self.data_offset = a.data_offset
        self.gpu = a.gpu
        self.fd = a.fd

    def _current(self):
        """Refuses an Arena of an earlier registration (or of a closed client): its index
        is another arena's, or none, in the registration there is now."""
        if self._generation != self._client._generation:
            raise ValueError(f"arena {self.name} belongs to an earlier registration of this client")

    def address(self) -> int:
        """Maps a host arena (once) and returns its address in this process: libepd's
        mapping, valid until unregister() or close() unmaps it (buffer(), numpy() and
        torch() views hold mappings of their own and stay valid). Refused (ValueError)
        for an Arena of an earlier registration, as buffer() is."""
        self._current()
        p = ctypes.c_void_p()
        self._client._check(_lib.lib().epd_arena_map(self._client._c, self.index, ctypes.byref(p)),
                            f"map arena {self.name}")
        return p.value

    def buffer(self, offset: int = 0, length: Optional[int] = None) -> memoryview:
        """A writable view of [offset, offset+length) of the arena; no copy. The view
        holds its own mapping of the arena: it stays valid after close() or unregister()
        (which unmap libepd's), as long as it is referenced."""
        if length is None:
            length = self.size - offset
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ValueError(f"range {offset}+{length} outside arena {self.name} of {self.size} bytes")
        self._current()
        v = self._client._arena_view(self.index)
        if offset + length > len(v):
            raise ValueError(f"range {offset}+{length} outside arena {self.name} of {len(v)} bytes")
        return v[offset:offset + length]

    def numpy(self, dtype, shape, offset: int):
        """A numpy array viewing the arena at `offset` (numpy needed)."""
        import numpy as np
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        return np.frombuffer(self.buffer(offset, n), dtype=dt).reshape(shape)

    def torch(self, dtype, shape, offset: int):
        """A torch tensor viewing the arena at `offset` (torch needed); no copy."""
        import torch
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return torch.frombuffer(self.buffer(offset, nbytes), dtype=dtype).view(*shape)


class Client(_lib.Closing):
    """A connection to epdd. address: None (libepd's default search), 'direct:PATH',
    'bus:ADDRESS' or 'system'."""

    def __init__(self, address: Optional[str] = None):
        self._l = _lib.lib()
        c = ctypes.c_void_p()
        r = self._l.epd_connect(address.encode() if address else None, ctypes.byref(c))
        if r < 0:
            # No client, so no last error to read: the refusal is libepd's own (no
            # daemon was asked), named as libepd names those.
            raise EpdError(-r, f"errno.{-r}", None, f"connect to epdd ({address or 'default'})")
        self._c = c
        # Handles whose Python objects were collected, to give back on this client's
        # next call: (release function, handle). The collector may run in any thread,
        # while another uses the connection, which is not thread-safe; so the collected
        # object only queues (a deque's append is atomic) and the thread that calls next
        # makes the bus call.
        self._orphans = collections.deque()
        # Taken by _orphan() around its test of _c and its append, and by close() to set
        # _c to None: a handle is either queued before close() drains the queue, or
        # freed at once after. Reentrant: a collection can run in the thread holding it.
        self._orphan_lock = threading.RLock()
        # Host arenas mapped for Python views, by index: a view keeps its mapping (a
        # Python mmap of the arena's fd) alive, so that a buffer, numpy array or tensor
        # taken from it never points at memory close() or unregister() unmapped.
        self._views = {}
        # GPU arenas mapped for this registration by epd.workers.connector (gpu_arena(),
        # by (generation, name)) and the GPU arena, or None for a host arena, of each
        # arena index a feature was found in (_feature_gpu_arena(), by (generation,
        # index)): kept here, not in a module, so that they go with the client and are
        # dropped at every registration change (an index or a name of an earlier
        # registration may be another arena now). A dropped mapping is unmapped once no
        # view, page table or KvPages of it is left.
        self._gpu_arenas = {}
        self._feature_gpu_arenas = {}
        self._generation = 0  # bumped by register(), unregister() and close(): Arena objects check it

    def _open(self):
        """The libepd client, or ValueError once closed (a NULL client would make libepd
        refuse the call with a misleading errno, or answer as if nothing were there)."""
        if not self._c:
            raise ValueError("the client is closed")
        return self._c

    def _check(self, r: int, what: str) -> int:
        if r < 0:
            if not self._c:
                raise ValueError(f"{what}: the client is closed")
            name = self._l.epd_last_error_name(self._c)
            msg = self._l.epd_last_error_message(self._c)
            self._release_orphans()
            raise EpdError(-r, name.decode() if name else None, msg.decode() if msg else None, what)
        if self._orphans:
            self._release_orphans()
        return r

    def _new_registration(self):
        """The arenas change (register, unregister, close): cached views and GPU arena
        mappings go (each keeps its mapping while referenced) and Arena objects of
        before are refused."""
        self._views.clear()
        self._gpu_arenas.clear()
        self._feature_gpu_arenas.clear()
        self._generation += 1

    def _arena_view(self, index: int) -> memoryview:
        """The whole of this registration's arena `index` (host arenas), read from libepd
        now: fd, size and domain of the current registration, never a stale copy."""
        v = self._views.get(index)
        if v is None:
            a = self._l.epd_arena_get(self._open(), index)
            if not a:
                raise ValueError(f"no arena {index} in this registration")
            a = a.contents
            if a.domain.decode() != "host":
                raise ValueError(f"arena {a.name.decode()} is a {a.domain.decode()} arena: map it with epd.gpu")
            import mmap
            m = mmap.mmap(a.fd, a.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            v = self._views[index] = memoryview(m).cast("B")
        return v

    def _orphan(self, release, handle):
        """From a __del__: release(client, handle) on this client's next call (or its
        close), never here; a closed client's, release(None, handle) at once (it only
        frees libepd's structure: the daemon let go with the connection)."""
        lock = getattr(self, "_orphan_lock", None)
        if lock is not None:
            with lock:
                if self._c:
                    self._orphans.append((release, handle))
                    return
        release(None, handle)

    def _release_orphans(self):
        while self._orphans:
            try:
                release, handle = self._orphans.popleft()
            except IndexError:
                return
            release(self._c, handle)  # an error (the daemon gone) changes nothing here

    def close(self):
        if self._c:
            self._new_registration()  # views taken keep their mappings
            self._l.epd_disconnect(self._c)
            # Handles collected until now (during the disconnect too, in another
            # thread) are queued; any collected from here on are freed at once.
            with self._orphan_lock:
                self._c = None
            # The daemon released what the connection held when it went: only free
            # the collected handles' memory (a call still on its way was ended by the
            # disconnect, so libepd frees it now).
            while self._orphans:
                release, handle = self._orphans.popleft()
                release(None, handle)

    def register(self, role: str, model: str, device: str, kv: Optional[KvLayout] = None,
                 arenas: Optional[Sequence[str]] = None, name: Optional[str] = None,
                 labels: Optional[Sequence[str]] = None) -> str:
        """name and labels: what epd.conf's [Pool:NAME] worker selectors match."""
        kvp = ctypes.byref(kv._c()) if kv else None
        arr = None
        if arenas is not None:
            arr = (ctypes.c_char_p * (len(arenas) + 1))(*[a.encode() for a in arenas], None)
        lab = None
        if labels is not None:
            lab = (ctypes.c_char_p * (len(labels) + 1))(*[x.encode() for x in labels], None)
        before = self._l.epd_worker_path(self._c) if self._c else None
        r = self._l.epd_register_named(self._c, role.encode(), model.encode(), device.encode(), kvp, arr,
                                       name.encode() if name is not None else None, lab)
        # The arenas change only with the registration: one refused (EALREADY on a client
        # registered already, a refusal of the daemon's) leaves the one there, its views
        # and its mappings as they were.
        if r >= 0 or (self._c and self._l.epd_worker_path(self._c) != before):
            self._new_registration()
        self._check(r, f"register {role} worker")
        return self.worker_path

    def unregister(self):
        r = self._l.epd_unregister(self._c)
        # Refused for a time-out, the registration (and its arenas) stays, here as there:
        # then nothing of it is dropped. Otherwise libepd closed the arenas' fds; views
        # taken keep their mappings.
        if self._l.epd_worker_path(self._c) is None:
            self._new_registration()
        self._check(r, "unregister")

    @property
    def worker_path(self) -> Optional[str]:
        """The worker's object path; None while not registered. ValueError once closed."""
        p = self._l.epd_worker_path(self._open())
        return p.decode() if p else None

    def arenas(self):
        """This registration's arenas ([] while not registered). ValueError once closed."""
        return [Arena(self, i) for i in range(self._l.epd_arena_count(self._open()))]

    def arena(self, name: str) -> Arena:
        """The arena `name` of this registration: EpdError NotFound if it has none of that
        name, ValueError once closed."""
        i = self._l.epd_arena_find(self._open(), name.encode())
        if i < 0:
            raise EpdError(_errno.ENOENT, "org.epd1.Error.NotFound", f"no arena {name} mapped", "arena")
        return Arena(self, i)

    def fileno(self) -> int:
        return self._check(self._l.epd_get_fd(self._open()), "fileno")

    def wait(self, timeout_s: Optional[float] = None) -> int:
        """Blocks until something arrives from the daemon (or the timeout; None or
        infinity: none, a past one: do not wait) and processes it."""
        t = _lib.usec(timeout_s, "timeout_s", past=True)
        return self._check(self._l.epd_wait(self._c, t), "wait")

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Waits until every call sent without waiting (Feature.publish_release) is
        answered; raises the first refusal among them (EpdError, naming the call), or
        EpdError(ETIMEDOUT) if some are still unanswered after timeout_s (None or
        infinity: no end).
        The wait is one libepd call per slice of at most 0.2 s (_lib.wait_slices): Python's
        signal handlers run between them (Ctrl-C ends it with KeyboardInterrupt; a C wait
        without end does not return for a signal with every libsystemd)."""
        for t in _lib.wait_slices(timeout_s):
            r = self._l.epd_flush(self._c, t)
            if r != -_errno.ETIMEDOUT:
                break
        self._check(r, "calls sent without waiting")
