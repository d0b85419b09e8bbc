# SPDX-License-Identifier: LGPL-2.1-or-later
"""GPU arenas: the daemon's CUDA VMM memory mapped into this process, as tensors with
no copy.

    import epd, epd.gpu, torch
    with epd.Client() as c:
        c.register("decode", "Qwen3-VL-8B", "cuda:0", kv=...)
        g = epd.gpu.Gpu()                            # loads libcuda at run time
        m = g.map_arena(c, "kvgpu")                  # the arena passed at registration
        t = torch.as_tensor(m.view(m.data_offset, (16, 8, 128), "bfloat16"), device="cuda")

`GpuArena.view()` returns an object with `__cuda_array_interface__` (version 3), which
torch, CuPy and Numba take without copying. The daemon keeps owning the memory: closing
the mapping, or this process dying, only drops this process's mapping. Without a GPU,
`Gpu()` raises EpdError with the driver's reason ("no NVIDIA driver", "no GPU")."""

import ctypes
import weakref
import errno as _errno
from typing import Optional, Sequence as Seq

from . import EpdError, _lib

__all__ = ["Gpu", "GpuArena", "CudaView", "KvRows", "PageTable", "Notifier", "kv_write_host", "kv_read_host"]

_P = ctypes.POINTER

# numpy typestr of the dtypes KV and features use (torch's names: every dtype of a
# feature, proto/feature-desc.c, is one; the __cuda_array_interface__ wants one). bfloat16
# and the float8 types have none in numpy: "<V2" / "|V1", raw bytes of their size, which
# a consumer reads with the dtype it is told apart (GpuArena.torch imports them as
# _IMPORT_AS and views the result as the dtype).
_TYPESTR = {"uint8": "|u1", "int8": "|i1", "int16": "<i2", "int32": "<i4", "int64": "<i8",
            "float16": "<f2", "float32": "<f4", "float64": "<f8", "bfloat16": "<V2", "bool": "|b1",
            "float8_e4m3fn": "|V1", "float8_e5m2": "|V1"}
_SIZE = {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "float16": 2, "float32": 4,
         "float64": 8, "bfloat16": 2, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
# What GpuArena.torch imports a dtype as when it imports a range on its own (a type of
# the same size torch takes through __cuda_array_interface__), then views as the dtype.
_IMPORT_AS = {"bfloat16": "int16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8", "bool": "uint8"}


class KvRows(ctypes.Structure):
    """One layer's K and V (epd_kv_rows, epd-gpu.h): the model's (1, H, S, D) cache tensors
    k and v (last dimension contiguous; head_stride/token_stride in bytes, 0: (H, S, D)
    contiguous), and where the layer's rows are in a page."""
    _fields_ = [("k", ctypes.c_uint64), ("v", ctypes.c_uint64), ("tokens", ctypes.c_uint64),
                ("heads", ctypes.c_uint32), ("tokens_per_page", ctypes.c_uint32),
                ("row_bytes", ctypes.c_uint64), ("k_offset", ctypes.c_uint64), ("v_offset", ctypes.c_uint64),
                ("head_stride", ctypes.c_uint64), ("token_stride", ctypes.c_uint64)]


def _addresses(pages: Seq[int]):
    return _lib.u64_array(pages, "pages")


def _refused(r: int, what: str, message: Optional[str] = None) -> EpdError:
    """A refusal of libepd's GPU side: its calls take no client, so there is no last
    error to read; the refusal is libepd's own, named as libepd names those (errno.N)."""
    return EpdError(-r, f"errno.{-r}", message, what)


def _ordinal(ordinal: int) -> int:
    """A GPU ordinal (a C int): in [0, 2**31), else ValueError."""
    return _lib.unsigned(ordinal, 31, "ordinal")


def kv_write_host(pages: Seq[int], page_size: int, rows: KvRows) -> None:
    """Host memory: writes the layer's K and V rows into the pages at these addresses."""
    a, n = _addresses(pages)
    r = _lib_gpu().epd_kv_write_host(a, n, _lib.u64(page_size, "page_size"), ctypes.byref(rows))
    if r < 0:
        raise _refused(r, "write KV rows")


def kv_read_host(pages: Seq[int], page_size: int, rows: KvRows) -> None:
    """Host memory: reads the layer's K and V rows from the pages into the tensors."""
    a, n = _addresses(pages)
    r = _lib_gpu().epd_kv_read_host(a, n, _lib.u64(page_size, "page_size"), ctypes.byref(rows))
    if r < 0:
        raise _refused(r, "read KV rows")


def _lib_gpu():
    lib = _lib.lib()
    if getattr(lib, "_epd_gpu_declared", False):
        return lib
    c_int, c_char_p, c_void_p, c_uint64, c_size_t = ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, \
        ctypes.c_uint64, ctypes.c_size_t
    decls = {
        "epd_gpu_open": (c_int, [_P(c_void_p)]),
        "epd_gpu_close": (c_void_p, [c_void_p]),
        "epd_gpu_strerror": (c_char_p, [c_int]),
        "epd_gpu_arena_map": (c_int, [c_void_p, c_void_p, c_size_t, _P(c_void_p)]),
        "epd_gpu_mapping_device_pointer": (c_uint64, [c_void_p]),
        "epd_gpu_mapping_size": (c_uint64, [c_void_p]),
        "epd_gpu_mapping_ordinal": (c_int, [c_void_p]),
        "epd_gpu_unmap": (c_void_p, [c_void_p]),
        "epd_gpu_pages_new": (c_int, [c_void_p, c_int, _P(c_uint64), c_size_t, c_uint64, c_uint64,
                                      _P(c_void_p)]),
        "epd_gpu_pages_free": (c_void_p, [c_void_p]),
        "epd_gpu_kv_write": (c_int, [c_void_p, _P(KvRows), c_uint64]),
        "epd_gpu_kv_read": (c_int, [c_void_p, _P(KvRows), c_uint64]),
        "epd_gpu_kv_write_many": (c_int, [c_void_p, _P(KvRows), ctypes.c_size_t, c_uint64]),
        "epd_gpu_kv_read_many": (c_int, [c_void_p, _P(KvRows), ctypes.c_size_t, c_uint64]),
        "epd_gpu_notifier_new": (c_int, [c_void_p, c_int, c_void_p, _P(c_void_p)]),
        "epd_gpu_notifier_ready_after": (c_int, [c_void_p, c_uint64, c_char_p, c_uint64, ctypes.c_uint32]),
        "epd_gpu_notifier_ready_after_range": (c_int, [c_void_p, c_uint64, c_char_p, c_uint64, ctypes.c_uint32,
                                                       ctypes.c_uint32]),
        "epd_gpu_notifier_flush": (c_int, [c_void_p, c_uint64]),
        "epd_gpu_notifier_pending": (c_uint64, [c_void_p]),
        "epd_gpu_notifier_submitted": (c_uint64, [c_void_p]),
        "epd_gpu_notifier_free": (c_void_p, [c_void_p]),
        "epd_kv_write_host": (c_int, [_P(c_uint64), c_size_t, c_uint64, _P(KvRows)]),
        "epd_kv_read_host": (c_int, [_P(c_uint64), c_size_t, c_uint64, _P(KvRows)]),
    }
    _lib.declare(lib, decls)
    lib._epd_gpu_declared = True
    return lib


class _Mapping:
    """One mapping of a GPU arena (epd_gpu_arena_map), unmapped when the last object that
    holds it goes: its GpuArena (until close()) and every view taken of it (CudaView,
    and through it the torch tensors made from one), so that a view never points at
    memory close() unmapped (as a host arena's views keep their own mappings)."""

    def __init__(self, m: ctypes.c_void_p):
        self.m = m

    def __del__(self):
        try:
            if self.m is not None:
                _lib_gpu().epd_gpu_unmap(self.m)  # a driver call: fine in any thread
                self.m = None
        except Exception:
            pass


class CudaView:
    """A typed window of device memory, for frameworks that speak
    __cuda_array_interface__. It keeps its mapping alive while it lives."""

    def __init__(self, owner: _Mapping, pointer: int, shape: Seq[int], dtype: str,
                 strides: Optional[Seq[int]] = None):
        self._owner = owner
        self.pointer, self.shape, self.dtype = pointer, tuple(int(s) for s in shape), dtype
        self.strides = tuple(strides) if strides is not None else None

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": _TYPESTR[self.dtype], "data": (self.pointer, False),
                "strides": self.strides, "version": 3}


class GpuArena(_lib.Closing):
    """One GPU arena of this worker's registration, mapped on this process's ordinal of
    the daemon's GPU. The mapping needs nothing of the client once made: it does not
    keep the client (a client that caches it, epd.workers.connector.gpu_arena, is then
    collected, and disconnected, as soon as it is dropped)."""

    def __init__(self, gpu: "Gpu", client, index: int, mapping: ctypes.c_void_p):
        self._gpu, self._map = gpu, _Mapping(mapping)
        self._tables = weakref.WeakSet()  # page tables of it, closed before it is unmapped
        a = _lib.lib().epd_arena_get(client._c, index).contents
        self.index, self.name, self.usage = index, a.name.decode(), a.usage.decode()
        self.data_offset = a.data_offset
        lib = _lib_gpu()
        self.device_pointer = lib.epd_gpu_mapping_device_pointer(mapping)
        self.size = lib.epd_gpu_mapping_size(mapping)
        self.ordinal = lib.epd_gpu_mapping_ordinal(mapping)
        self._torch_base = None  # the whole arena as one torch uint8 tensor, once asked for
        self._typed = {}  # the same by dtype name (typed())

    @property
    def closed(self) -> bool:
        """close() was called: no new view or page table (epd.workers.connector.gpu_arena
        maps the arena anew)."""
        return self._map is None

    def page_table(self, pages: Seq[int], page_size: int, stream: int = 0) -> "PageTable":
        """The page table of these pages (page ids of this arena) for the KV copies. It
        keeps the mapping alive while it lives; close() of the arena closes it first."""
        if self._map is None:
            raise ValueError(f"GPU arena {self.name} is unmapped")
        n = (self.size - self.data_offset) // page_size if page_size > 0 else 0
        bad = [p for p in pages if not 0 <= p < n]
        if bad:  # a kernel would write past the mapping: a device fault, or another's memory
            raise ValueError(f"page ids {bad[:4]} outside GPU arena {self.name} ({n} pages of {page_size} bytes)")
        return self._table([self.data_offset + p * page_size for p in pages], page_size, stream)

    def page_table_at(self, offsets: Seq[int], page_size: int, stream: int = 0) -> "PageTable":
        """page_table() of the pages at these byte offsets of the arena (as the daemon gives
        them: Accepted.offsets, a sequence's data_offset + page * page_size), each a whole
        page inside its data area."""
        if self._map is None:
            raise ValueError(f"GPU arena {self.name} is unmapped")
        bad = [o for o in offsets if not self.data_offset <= o <= self.size - page_size]
        if bad or page_size <= 0:
            raise ValueError(f"pages at {bad[:4]} (+{page_size}) outside GPU arena {self.name} "
                             f"[{self.data_offset}, {self.size})")
        return self._table(offsets, page_size, stream)

    def _table(self, offsets: Seq[int], page_size: int, stream: int) -> "PageTable":
        if self._map is None:
            raise ValueError(f"GPU arena {self.name} is unmapped")
        t = PageTable(self._gpu, self.ordinal, [self.device_pointer + o for o in offsets], page_size, stream,
                      owner=self)
        self._tables.add(t)
        return t

    def view(self, offset: int, shape: Seq[int], dtype: str = "uint8") -> CudaView:
        """The bytes at `offset` of the arena as a C-contiguous array of `shape`."""
        if dtype not in _TYPESTR:
            raise ValueError(f"dtype {dtype} not one of {', '.join(_TYPESTR)}")
        n = _SIZE[dtype]
        for s in shape:
            n *= int(s)
        if offset < 0 or n < 0 or offset + n > self.size:
            raise ValueError(f"range {offset}+{n} outside GPU arena {self.name} of {self.size} bytes")
        if self._map is None:
            raise ValueError(f"GPU arena {self.name} is unmapped")
        return CudaView(self._map, self.device_pointer + offset, shape, dtype)

    def torch(self, offset: int, shape: Seq[int], dtype: str = "uint8"):
        """A torch tensor on the arena's GPU viewing `offset` (torch needed); no copy.
        The whole arena is imported into torch once (a __cuda_array_interface__ import
        costs tens of microseconds: the driver is asked about the pointer), and each
        call is a slice and a view of it. torch has no typestr for bfloat16 or the float8
        types, so a range the slice cannot be reinterpreted at is imported on its own as
        an integer type of their size (_IMPORT_AS) and viewed as the dtype."""
        import torch
        v = self.view(offset, shape, dtype)  # checks the range, the dtype, the mapping
        n = _SIZE[dtype]
        for s in v.shape:
            n *= s
        flat = self._base()[offset:offset + n]
        if dtype != "uint8":
            try:
                flat = flat.view(getattr(torch, dtype))
            except RuntimeError:  # an offset the dtype cannot be viewed at: on its own
                as_dtype = _IMPORT_AS.get(dtype, dtype)
                t = torch.as_tensor(self.view(offset, shape, as_dtype), device=f"cuda:{self.ordinal}")
                return t.view(getattr(torch, dtype)) if as_dtype != dtype else t
        return flat.view(v.shape)

    def _base(self):
        """The whole arena as one torch uint8 tensor, imported the first time."""
        if self._torch_base is None:
            import torch
            # On the arena's own GPU: "cuda" alone means torch's current device, and
            # a view of another GPU's memory would silently come back as a copy there.
            self._torch_base = torch.as_tensor(self.view(0, (self.size,), "uint8"), device=f"cuda:{self.ordinal}")
        return self._torch_base

    def typed(self, dtype: str):
        """The whole arena as one torch tensor of `dtype` (a torch dtype name), imported
        once (torch()'s import, viewed as the dtype) and kept: Feature.cuda_all makes each
        view with one as_strided of it, which torch checks against the arena's bounds."""
        t = self._typed.get(dtype)
        if t is None:
            import torch
            t = self._typed[dtype] = self._base().view(getattr(torch, dtype))
        return t

    def close(self):
        for t in list(self._tables):
            t.close()  # no copy through a table of pages that are about to be unmapped
        self._typed = {}
        self._torch_base = None
        # Unmapped now unless views of it live on: then when the last of them goes.
        self._map = None


class PageTable(_lib.Closing):
    """A sequence's pages in a GPU arena, as a page table on the GPU: each layer's K/V
    copy between the model's cache and the pages is then one kernel launch on the given
    stream (a CUstream handle, e.g. torch.cuda.current_stream().cuda_stream)."""

    def __init__(self, gpu: "Gpu", ordinal: int, addresses: Seq[int], page_size: int, stream: int = 0,
                 owner: Optional["GpuArena"] = None):
        self._p = None
        a, n = _addresses(addresses)
        p = ctypes.c_void_p()
        r = _lib_gpu().epd_gpu_pages_new(gpu._g, _ordinal(ordinal), a, n, _lib.u64(page_size, "page_size"),
                                         _lib.u64(stream, "stream"), ctypes.byref(p))
        if r < 0:
            raise _refused(r, "page table")
        # owner: the mapping the addresses are in, kept mapped while the table lives
        self._p, self._gpu, self._owner, self.n_pages, self.page_size = p, gpu, owner, n, page_size
        self._write, self._read = _lib_gpu().epd_gpu_kv_write, _lib_gpu().epd_gpu_kv_read

    def _handle(self):
        if not self._p:
            raise ValueError("the page table is closed (or its GPU arena was)")
        return self._p

    def write(self, rows: KvRows, stream: int = 0) -> None:
        """Enqueues tensors -> pages on `stream`."""
        r = self._write(self._handle(), ctypes.byref(rows), _lib.u64(stream, "stream"))
        if r < 0:
            raise _refused(r, "write KV rows")

    def read(self, rows: KvRows, stream: int = 0) -> None:
        """Enqueues pages -> tensors on `stream`."""
        r = self._read(self._handle(), ctypes.byref(rows), _lib.u64(stream, "stream"))
        if r < 0:
            raise _refused(r, "read KV rows")

    def read_many(self, rows, stream: int = 0) -> None:
        """pages -> tensors for every KvRows of the ctypes array `rows` (one layer each),
        in one call: all checked first, then enqueued on `stream` (one launch for up to
        64 layers of one geometry)."""
        r = _lib_gpu().epd_gpu_kv_read_many(self._handle(), rows, len(rows), _lib.u64(stream, "stream"))
        if r < 0:
            raise _refused(r, "read KV rows")

    def write_many(self, rows, stream: int = 0) -> None:
        """tensors -> pages for every KvRows of the ctypes array `rows`, in one call."""
        r = _lib_gpu().epd_gpu_kv_write_many(self._handle(), rows, len(rows), _lib.u64(stream, "stream"))
        if r < 0:
            raise _refused(r, "write KV rows")

    def close(self):
        if self._p:
            _lib_gpu().epd_gpu_pages_free(self._p)
            self._p = None
        self._owner = None


class Notifier(_lib.Closing):
    """Layer groups reported ready from the GPU (epd_gpu_notifier_*, epd-gpu.h):
    ready_after() records an event on the stream and returns; libepd's thread puts the
    group's LayerGroupReady on the ring once the event is done. flush() waits until
    every group asked for so far is on the ring and raises the first error since the
    last flush (a failed event, a ring that stayed full): such a group is never
    reported, so its handoff rolls back rather than ship unwritten bytes."""

    def __init__(self, gpu: "Gpu", ordinal: int, ring):
        p = ctypes.c_void_p()
        r = _lib_gpu().epd_gpu_notifier_new(gpu._g, _ordinal(ordinal), ring._handle(), ctypes.byref(p))
        if r < 0:
            raise _refused(r, "GPU notifier")
        self._n, self._gpu, self._ring = p, gpu, ring
        self._ready_after = _lib_gpu().epd_gpu_notifier_ready_after
        ring._users.add(self)  # Ring.close() stops this notifier's thread first
        ring._notifiers += 1  # and the collector's close of the ring waits for close()

    @property
    def closed(self) -> bool:
        return not self._n

    def _handle(self):
        if not self._n:
            raise ValueError("the notifier is closed (or its ring was)")
        return self._n

    def ready_after(self, stream: int, request_id: bytes, token: int, group: int) -> None:
        """request_id: the handoff's request id, 32 hex digits, as bytes."""
        r = self._ready_after(self._handle(), _lib.u64(stream, "stream"), request_id, _lib.u64(token, "token"),
                              _lib.u32(group, "group"))
        if r < 0:
            raise _refused(r, f"layer group {group} ready after the stream's work")

    def ready_after_range(self, stream: int, request_id: bytes, token: int, first: int, count: int) -> None:
        """Groups [first, first + count) ready after one event (every layer written in one
        launch: one notice for all of its groups)."""
        r = _lib_gpu().epd_gpu_notifier_ready_after_range(self._handle(), _lib.u64(stream, "stream"), request_id,
                                                          _lib.u64(token, "token"), _lib.u32(first, "first"),
                                                          _lib.u32(count, "count"))
        if r < 0:
            raise _refused(r, f"layer groups {first}..{first + count - 1} ready after the stream's work")

    def flush(self, timeout_s: Optional[float] = None) -> None:
        """Waits until every group asked for so far is on the ring, at most
        timeout_s (None or infinity: no timeout); EpdError(ETIMEDOUT) past it. In slices
        of at most 0.2 s (_lib.wait_slices): Python's signal handlers run during the wait."""
        for t in _lib.wait_slices(timeout_s):
            r = _lib_gpu().epd_gpu_notifier_flush(self._handle(), t)
            if r != -_errno.ETIMEDOUT:
                break
        if r == -_errno.ECONNRESET:
            raise _refused(r, "layer groups reported ready from the GPU", "the daemon let go of the ring: the groups "
                           "not submitted by then are not reported (their handoffs roll back at their timeout)")
        if r < 0:
            raise _refused(r, "layer groups reported ready from the GPU")

    @property
    def pending(self) -> int:
        return _lib_gpu().epd_gpu_notifier_pending(self._handle())

    @property
    def submitted(self) -> int:
        return _lib_gpu().epd_gpu_notifier_submitted(self._handle())

    def close(self):
        if self._n:
            _lib_gpu().epd_gpu_notifier_free(self._n)
            self._n = None
            self._ring._notifier_closed()


class Gpu(_lib.Closing):
    """libepd's GPU side: the CUDA driver loaded at run time (EPD_LIBCUDA overrides
    libcuda.so.1)."""

    def __init__(self):
        self._lib = _lib_gpu()
        p = ctypes.c_void_p()
        r = self._lib.epd_gpu_open(ctypes.byref(p))
        if r < 0:
            raise _refused(r, "open the GPU driver", self._lib.epd_gpu_strerror(r).decode())
        self._g = p

    def map_arena(self, client, name: str) -> GpuArena:
        """Maps the GPU arena `name` the daemon passed at registration (ValueError on a
        closed client)."""
        i = client._l.epd_arena_find(client._open(), name.encode())
        if i < 0:
            raise EpdError(_errno.ENOENT, "org.epd1.Error.NotFound", f"no arena {name} mapped", "GPU arena")
        m = ctypes.c_void_p()
        client._check(self._lib.epd_gpu_arena_map(client._c, self._g, i, ctypes.byref(m)),
                      f"map GPU arena {name}")
        return GpuArena(self, client, i, m)

    def close(self):
        if self._g:
            self._lib.epd_gpu_close(self._g)
            self._g = None
