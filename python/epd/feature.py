# SPDX-License-Identifier: LGPL-2.1-or-later
"""The feature cache (org.epd1.Feature): encoder outputs by content key.

    import epd, epd.feature as ef
    with epd.Client() as c:
        c.register("prefill", "Qwen3-VL-8B", "cuda:0")
        f = ef.Feature.acquire(c, key, may_produce=True)
        if f.result == "produce":
            f.produce(nbytes, [ef.Tensor("image_embeds", "bf16", (n, hidden)),
                               ef.Tensor("grid_thw", "i64", (1, 3), offset=n * hidden * 2)])
            f.buffer()[:] = encoder_output_bytes        # or f.torch("image_embeds")[...] = ...
            f.publish(encode_usec)
        elif f.result == "wait":
            f.wait(5.0)                                 # no polling; raises if the producer failed
        embeds = f.torch("image_embeds")                # a view of the shared arena: no copy
        f.release()

Every Feature is a handle in the daemon; release() it (or use `with`). A producer that
goes away before publishing fails the waiters ("producer-gone"). See docs/features.md.
"""

import ctypes
import errno as _errno
import hashlib
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

from . import EpdError, _lib

__all__ = ["Tensor", "Feature", "FeatureCall", "prefetch", "content_key"]

RANK_MAX = 8
TENSORS_MAX = 64
KEY_MAX = 256

_c_u64_8 = ctypes.c_uint64 * RANK_MAX


class _CTensor(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("dtype", ctypes.c_char_p), ("rank", ctypes.c_uint32),
                ("shape", _c_u64_8), ("strides", _c_u64_8), ("offset", ctypes.c_uint64)]


class _CFeature(ctypes.Structure):
    """Mirrors epd_feature in <epd/epd-feature.h>."""
    _fields_ = [("key", ctypes.c_char * (KEY_MAX + 1)), ("handle", ctypes.c_char * 33),
                ("result", ctypes.c_char * 16), ("state", ctypes.c_char * 16),
                ("error", ctypes.c_char * 32), ("arena", ctypes.c_int),
                ("offset", ctypes.c_uint64), ("bytes", ctypes.c_uint64), ("data", ctypes.c_void_p),
                ("request_id", ctypes.c_char * 33), ("n_tensors", ctypes.c_size_t),
                ("tensors", _CTensor * TENSORS_MAX),
                ("_names", ((ctypes.c_char * 72) * 2) * TENSORS_MAX)]


_Fp = ctypes.POINTER(_CFeature)


def _lib_features():
    lib = _lib.lib()
    if getattr(lib, "_epd_features_declared", False):
        return lib
    c_int, c_char_p, c_size_t, c_uint64, c_bool = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t,
                                                   ctypes.c_uint64, ctypes.c_bool)
    c_void_p, P = ctypes.c_void_p, ctypes.POINTER
    decls = {
        "epd_feature_acquire": (c_int, [c_void_p, c_char_p, c_bool, P(_Fp)]),
        "epd_feature_reserve": (c_int, [c_void_p, c_char_p, c_uint64, P(_CTensor), c_size_t, c_char_p, P(_Fp)]),
        "epd_feature_produce": (c_int, [c_void_p, _Fp, c_uint64, P(_CTensor), c_size_t, c_char_p]),
        "epd_feature_acquire_or_reserve": (c_int, [c_void_p, c_char_p, c_uint64, P(_CTensor), c_size_t, c_char_p,
                                                   P(_Fp)]),
        "epd_feature_acquire_or_reserve_send": (c_int, [c_void_p, c_char_p, c_uint64, P(_CTensor), c_size_t,
                                                        c_char_p, P(c_void_p)]),
        "epd_feature_call_finish": (c_int, [c_void_p, c_void_p, c_uint64, P(_Fp)]),
        "epd_feature_call_taken": (c_bool, [c_void_p]),
        "epd_feature_call_free": (None, [c_void_p, c_void_p]),
        "epd_feature_publish": (c_int, [c_void_p, _Fp, c_uint64]),
        "epd_feature_publish_release": (c_int, [c_void_p, _Fp, c_uint64]),
        "epd_feature_fail": (c_int, [c_void_p, _Fp, c_char_p]),
        "epd_feature_wait": (c_int, [c_void_p, _Fp, c_uint64]),
        "epd_feature_refresh": (c_int, [c_void_p, _Fp]),
        "epd_feature_pin": (c_int, [c_void_p, c_char_p, P(_Fp)]),
        "epd_feature_release": (c_int, [c_void_p, _Fp]),
        "epd_feature_prefetch": (c_int, [c_void_p, P(c_char_p), c_size_t]),
    }
    _lib.declare(lib, decls)
    lib._epd_features_declared = True
    return lib


class Tensor(NamedTuple):
    """One tensor of a FeatureBundle. strides are in elements (None: row-major)."""
    name: str
    dtype: str
    shape: Tuple[int, ...]
    offset: int = 0
    strides: Optional[Tuple[int, ...]] = None


_NUMPY = {"f32": "float32", "f16": "float16", "f64": "float64", "i8": "int8", "u8": "uint8",
          "i16": "int16", "i32": "int32", "i64": "int64", "bool": "bool"}
_TORCH = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64", "i8": "int8",
          "u8": "uint8", "i16": "int16", "i32": "int32", "i64": "int64", "bool": "bool",
          "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
_SIZE = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "fp8_e4m3": 1, "fp8_e5m2": 1, "i8": 1, "u8": 1,
         "i16": 2, "i32": 4, "i64": 8, "bool": 1}


# Feature.cuda_all's layouts, by the C structure's bytes (Feature._layout).
_LAYOUTS: Dict[bytes, tuple] = {}


def _c_tensors(tensors: Sequence[Tensor]):
    if not tensors or len(tensors) > TENSORS_MAX:
        raise ValueError(f"a bundle has 1 to {TENSORS_MAX} tensors")
    arr = (_CTensor * len(tensors))()
    keep = []
    for i, t in enumerate(tensors):
        if len(t.shape) > RANK_MAX or (t.strides is not None and len(t.strides) != len(t.shape)):
            raise ValueError(f"tensor {t.name}: bad rank or strides")
        name, dtype = t.name.encode(), str(t.dtype).replace("torch.", "").encode()
        keep += [name, dtype]
        arr[i].name, arr[i].dtype, arr[i].rank = name, dtype, len(t.shape)
        arr[i].offset = _lib.u64(t.offset, f"tensor {t.name} offset")
        for j, d in enumerate(t.shape):
            arr[i].shape[j] = _lib.u64(d, f"tensor {t.name} shape[{j}]")
            arr[i].strides[j] = _lib.u64(t.strides[j], f"tensor {t.name} strides[{j}]") if t.strides else 0
    return arr, keep


def _holding(view: memoryview, holder) -> memoryview:
    """`view` again, exported through a ctypes array that also holds `holder`: every
    memoryview, numpy array or torch tensor made from the result, and every view of
    those, keeps holder alive (as it keeps the arena's mapping, which the array holds)."""
    a = (ctypes.c_ubyte * len(view)).from_buffer(view)
    a._epd_holds = holder
    return memoryview(a).cast("B")


class Feature(_lib.Closing):
    """A handle on one feature. Attributes mirror the daemon's answer.

    The handle pins the feature in the daemon (no eviction, no reuse of its bytes) until
    release(), or until the object is collected. The views it gives (buffer(), numpy(),
    torch(), and anything made from them) hold the object, so a feature whose handle was
    dropped stays pinned while any of its host views lives; cuda() and cuda_all()
    tensors hold it as the tensor objects they return (their memory is a view of the
    whole GPU arena, shared by every feature: a tensor made from one of them, a slice or
    a view, does not hold it: keep the returned tensor, or the handle, while using it)."""

    def __init__(self, client, p: _Fp):
        self._client, self._p, self._lib = client, p, _lib_features()
        # The registration its arena index and data pointer belong to (a new one maps
        # the arenas again, maybe in another order): buffer() checks it.
        self._generation = client._generation

    # -- constructors --------------------------------------------------------------
    @classmethod
    def acquire(cls, client, key: str, may_produce: bool = False) -> "Feature":
        """result is "hit" (read it), "wait" (call wait()) or "produce" (you produce)."""
        lib, p = _lib_features(), _Fp()
        client._check(lib.epd_feature_acquire(client._c, key.encode(), may_produce, ctypes.byref(p)),
                      f"acquire feature {key!r}")
        return cls(client, p)

    @classmethod
    def reserve(cls, client, key: str, nbytes: int, tensors: Sequence[Tensor],
                request_id: Optional[str] = None) -> "Feature":
        """Encoder: a writable region for key (publish() when written)."""
        lib, p = _lib_features(), _Fp()
        arr, _keep = _c_tensors(tensors)
        nbytes = _lib.u64(nbytes, "nbytes")
        client._check(lib.epd_feature_reserve(client._c, key.encode(), nbytes, arr, len(tensors),
                                              request_id.encode() if request_id else None, ctypes.byref(p)),
                      f"reserve feature {key!r}")
        return cls(client, p)

    @classmethod
    def acquire_or_reserve(cls, client, key: str, nbytes: int, tensors: Sequence[Tensor],
                           request_id: Optional[str] = None) -> "Feature":
        """acquire(may_produce=True) and, when told to produce, reserve() in the same call:
        result "hit", "wait" or "produce" (reserved: write, then publish)."""
        lib, p = _lib_features(), _Fp()
        arr, _keep = _c_tensors(tensors)
        nbytes = _lib.u64(nbytes, "nbytes")
        client._check(lib.epd_feature_acquire_or_reserve(client._c, key.encode(), nbytes, arr, len(tensors),
                                                         request_id.encode() if request_id else None,
                                                         ctypes.byref(p)),
                      f"acquire or reserve feature {key!r}")
        return cls(client, p)

    @classmethod
    def acquire_or_reserve_send(cls, client, key: str, nbytes: int, tensors: Sequence[Tensor],
                                request_id: Optional[str] = None) -> "FeatureCall":
        """acquire_or_reserve() in two steps: sends the call and returns at once; the
        returned FeatureCall's finish() takes the answer (a Feature). Work done between the
        two overlaps the round trip (an encoder uploads its inputs, say)."""
        lib, call = _lib_features(), ctypes.c_void_p()
        arr, _keep = _c_tensors(tensors)
        nbytes = _lib.u64(nbytes, "nbytes")
        client._check(lib.epd_feature_acquire_or_reserve_send(client._c, key.encode(), nbytes, arr, len(tensors),
                                                              request_id.encode() if request_id else None,
                                                              ctypes.byref(call)),
                      f"acquire or reserve feature {key!r}")
        return FeatureCall(client, call, key)

    @classmethod
    def pin(cls, client, key: str) -> "Feature":
        """Keeps key from eviction until released."""
        lib, p = _lib_features(), _Fp()
        client._check(lib.epd_feature_pin(client._c, key.encode(), ctypes.byref(p)), f"pin feature {key!r}")
        return cls(client, p)

    # -- state ---------------------------------------------------------------------
    def _f(self) -> _CFeature:
        if not self._p:
            raise ValueError("feature handle already released")
        return self._p.contents

    key = property(lambda self: self._f().key.decode())
    handle = property(lambda self: self._f().handle.decode())
    result = property(lambda self: self._f().result.decode())
    state = property(lambda self: self._f().state.decode())
    error = property(lambda self: self._f().error.decode())
    offset = property(lambda self: self._f().offset)
    nbytes = property(lambda self: self._f().bytes)
    request_id = property(lambda self: self._f().request_id.decode())
    arena = property(lambda self: self._f().arena)  # index for Client arenas; -1: no region

    @property
    def tensors(self) -> List[Tensor]:
        f = self._f()
        out = []
        for i in range(f.n_tensors):
            t = f.tensors[i]
            out.append(Tensor(t.name.decode(), t.dtype.decode(), tuple(t.shape[:t.rank]), t.offset,
                              tuple(t.strides[:t.rank])))
        return out

    # -- producer ------------------------------------------------------------------
    def produce(self, nbytes: int, tensors: Sequence[Tensor], request_id: Optional[str] = None):
        """After acquire() answered "produce": reserve the region through this handle."""
        arr, _keep = _c_tensors(tensors)
        nbytes = _lib.u64(nbytes, "nbytes")
        self._client._check(self._lib.epd_feature_produce(self._client._c, self._p, nbytes, arr, len(tensors),
                                                          request_id.encode() if request_id else None),
                            f"produce feature {self.key!r}")

    def publish(self, encode_usec: int = 0):
        encode_usec = _lib.u64(encode_usec, "encode_usec")
        self._client._check(self._lib.epd_feature_publish(self._client._c, self._p, encode_usec),
                            f"publish feature {self.key!r}")

    def publish_release(self, encode_usec: int = 0):
        """publish() and release() at once, without waiting for epdd's replies (the
        Publish's waits for the journal's sync): the feature is READY for readers as soon
        as epdd has read the call. A refusal comes back from client.flush(). The handle
        is gone from this object whatever the result: libepd frees it on every path (a
        closed client's call, refused with ValueError, included); a bad encode_usec is
        refused (ValueError) before anything, the handle kept."""
        encode_usec = _lib.u64(encode_usec, "encode_usec")
        key = self.key
        p, self._p = self._p, None  # freed by the call, sent or not
        self._client._check(self._lib.epd_feature_publish_release(self._client._c, p, encode_usec),
                            f"publish feature {key!r}")

    def fail(self, reason: str = ""):
        self._client._check(self._lib.epd_feature_fail(self._client._c, self._p, reason.encode()),
                            f"fail feature {self.key!r}")

    # -- reader --------------------------------------------------------------------
    def wait(self, timeout_s: Optional[float] = None) -> bool:
        """Blocks until ready (True) or the timeout (False; None or infinity: no timeout,
        a past one: only look); raises EpdError(EPIPE) if the producer failed or went
        away, with libepd's name (errno.32) and sentence, which says the reason (so does
        self.error: "producer-gone", "producer-failed", ...).
        The wait is one Wait call per slice of at most 0.2 s (_lib.wait_slices; a later
        Wait of a handle takes the place of the one given up on), so that Python's
        signal handlers run during it: Ctrl-C raises KeyboardInterrupt here, and a
        handler that returns lets the wait go on (a Wait that sd-bus ended for the
        signal, EINTR, is made again)."""
        for t in _lib.wait_slices(timeout_s):
            r = self._lib.epd_feature_wait(self._client._c, self._p, t)
            if r not in (-_errno.ETIMEDOUT, -_errno.EINTR):
                break
            # The answer of the Wait given up on (or the Stale error of its replacement)
            # comes later: dispatched here (dropped), not kept in the connection's queue.
            self._lib.epd_process(self._client._c)
        else:
            return False
        # The EPIPE of a failed feature is named and worded by libepd as any refusal is
        # (nothing ran since: epd_process() only between slices that timed out).
        self._client._check(r, f"feature {self.key!r} failed" if r == -_errno.EPIPE else
                            f"wait for feature {self.key!r}")
        return True

    def refresh(self):
        self._client._check(self._lib.epd_feature_refresh(self._client._c, self._p),
                            f"describe feature {self.key!r}")
        self._generation = self._client._generation

    def buffer(self, offset: int = 0, length: Optional[int] = None) -> memoryview:
        """A writable view of the feature's bytes in the shared arena; no copy. It (and
        whatever is made from it) holds this handle: the feature stays pinned while it
        lives, even with the handle dropped (not after release())."""
        f = self._f()
        if self._generation != self._client._generation:
            # Its arena index is of a registration that is gone: as a view it would be
            # another arena's bytes (review). refresh() takes it up again.
            raise EpdError(_errno.ESTALE, None, "the client registered again since this feature was described: "
                           "refresh() it first", "feature buffer")
        if not f.data:
            raise EpdError(_errno.ENODATA, None, f"feature is {self.state}, or its arena is not mapped",
                           "feature buffer")
        length = f.bytes - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > f.bytes:
            raise ValueError(f"range {offset}+{length} outside the feature of {f.bytes} bytes")
        # Through the client's own mapping of the arena: the view outlives close().
        from . import Arena
        return _holding(Arena(self._client, f.arena).buffer(f.offset + offset, length), self)

    def _tensor(self, name: str) -> Tensor:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def numpy(self, name: str):
        """A numpy view of one tensor (numpy needed; not for bf16/fp8)."""
        import numpy as np
        t = self._tensor(name)
        if t.dtype not in _NUMPY:
            raise TypeError(f"numpy has no {t.dtype}; use torch()")
        size = _SIZE[t.dtype]
        return np.ndarray(t.shape, dtype=_NUMPY[t.dtype], buffer=self.buffer(), offset=t.offset,
                          strides=tuple(s * size for s in t.strides))

    def torch(self, name: str):
        """A torch view of one tensor (torch needed); no copy."""
        import torch
        t = self._tensor(name)
        dtype = getattr(torch, _TORCH[t.dtype])
        # the daemon validated the layout: the offset is aligned, the view in range
        flat = torch.frombuffer(self.buffer(), dtype=torch.uint8)
        # Its own span only: the bytes from its offset to the feature's end need not be a
        # whole number of its elements (view(dtype) would refuse them).
        span = 0 if 0 in t.shape else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.strides))
        end = t.offset + span * _SIZE[t.dtype]
        return flat[t.offset:end].view(dtype).as_strided(t.shape, t.strides)

    def cuda(self, name: str, arena):
        """A torch view, on the GPU, of one tensor of a feature in a GPU arena (`arena`: its
        epd.gpu.GpuArena mapping); no copy. The view is valid while this handle is held:
        the returned tensor object holds it (not a tensor made from it)."""
        t = self._tensor(name)
        span = 1
        for n, st in zip(t.shape, t.strides):
            span += (n - 1) * st
        flat = arena.torch(self.offset + t.offset, (span,), _TORCH[t.dtype])
        out = flat.as_strided(t.shape, t.strides)
        out._epd_feature = self
        return out

    def _layout(self) -> Tuple[Tuple[str, str, int, Tuple[int, ...], Tuple[int, ...], int, int], ...]:
        """The tensors as (name, torch dtype, element size, shape, strides, offset, bytes
        spanned), kept per layout: features of one shape (every image of one size) share
        it, and reading it from the C structure field by field costs more than the rest
        of a fetch. Keyed by the structure's bytes less its two string pointers per
        tensor (they point into the structure itself), plus the strings."""
        f = self._f()
        n = f.n_tensors
        size = ctypes.sizeof(_CTensor)
        raw = ctypes.string_at(ctypes.addressof(f.tensors), n * size)
        key = b"".join(raw[i * size + 16:(i + 1) * size] for i in range(n)) + \
            ctypes.string_at(ctypes.addressof(f._names), n * ctypes.sizeof(f._names[0]))
        lay = _LAYOUTS.get(key)
        if lay is None:
            out = []
            for t in self.tensors:
                span = 1
                for d, st in zip(t.shape, t.strides):
                    span += (d - 1) * st
                es = _SIZE[t.dtype]
                out.append((t.name, _TORCH[t.dtype], es, t.shape, t.strides, t.offset,
                            span * es if all(t.shape) else 0))
            lay = tuple(out)
            if len(_LAYOUTS) >= 256:
                _LAYOUTS.clear()
            _LAYOUTS[key] = lay
        return lay

    def cuda_all(self, arena) -> Dict[str, object]:
        """Every tensor of the feature as torch views of a GPU arena (as cuda()): one
        as_strided each over the whole arena imported once per dtype (GpuArena.typed),
        the layout read once per shape of feature (_layout); torch checks each view
        against the arena's bounds. One __cuda_array_interface__ import per tensor cost
        tens of microseconds each."""
        out = {}
        base = self.offset
        for name, dtype, es, shape, strides, off, nbytes in self._layout():
            o = base + off
            if nbytes and o % es == 0:
                t = out[name] = arena.typed(dtype).as_strided(shape, strides, o // es)
                t._epd_feature = self  # the handle lives as long as the tensor object (cuda())
            else:  # empty, or an offset the dtype cannot view at: on its own
                out[name] = self.cuda(name, arena)
        return out

    def release(self):
        if self._p:
            p, self._p = self._p, None
            self._client._check(self._lib.epd_feature_release(self._client._c, p), "release feature")

    def close(self):
        self.release()

    def __del__(self):
        # Collected, maybe in another thread than the one using the client: no bus call
        # here; the client gives the handle back on its next call.
        try:
            p, self._p = self._p, None
            if p:
                self._client._orphan(self._lib.epd_feature_release, p)
        except Exception:
            pass


class FeatureCall(_lib.Closing):
    """An AcquireOrReserve on its way (Feature.acquire_or_reserve_send). finish() takes
    its answer; close() (or collection) gives it up: a handle an answer brings that
    finish() did not take is released (when it comes). Either uses the call up."""

    def __init__(self, client, call: ctypes.c_void_p, key: str):
        self._client, self._call, self._key, self._lib = client, call, key, _lib_features()

    def finish(self, timeout_s: Optional[float] = None) -> Feature:
        """The answer, as acquire_or_reserve() returns it (None or infinity: no time
        limit). Raises EpdError for a refusal, or ETIMEDOUT when none came in time (a
        handle its answer brings later is released when it comes); the call is used up
        either way (but for a timeout_s refused, NaN: ValueError). Waits in slices
        (_lib.wait_slices), so that Python's signal handlers run meanwhile: an exception
        one raises gives the call up too."""
        if not self._call:
            raise ValueError("feature call already finished or given up")
        p = _Fp()
        lib = self._lib
        slices = _lib.wait_slices(timeout_s)  # a bad timeout_s (NaN): ValueError, the call kept
        try:
            for t in slices:
                # Read each slice: a signal handler run between two may have closed the client.
                r = lib.epd_feature_call_finish(self._client._c, self._call, t, ctypes.byref(p))
                if r not in (-_errno.ETIMEDOUT, -_errno.EINTR) or lib.epd_feature_call_taken(self._call):
                    break  # the answer (a refusal's errno may look like a wait cut short)
        finally:
            self.close()  # libepd frees it, releasing an answer not taken (now or when it comes)
        self._client._check(r, f"acquire or reserve feature {self._key!r}")
        return Feature(self._client, p)

    def close(self):
        call, self._call = self._call, None
        if call:
            self._lib.epd_feature_call_free(self._client._c, call)

    def __del__(self):
        # Collected, maybe in another thread: freed on the client's next call.
        try:
            call, self._call = self._call, None
            if call:
                self._client._orphan(self._lib.epd_feature_call_free, call)
        except Exception:
            pass


def prefetch(client, keys: Sequence[str]) -> int:
    """Announces keys; returns how many are already cached."""
    lib = _lib_features()
    arr = (ctypes.c_char_p * max(len(keys), 1))(*[k.encode() for k in keys])
    return client._check(lib.epd_feature_prefetch(client._c, arr, len(keys)), "prefetch features")


# -- content keys --------------------------------------------------------------------
CONTENT_CHUNK = 256 << 10
CONTENT_THREADS = 8
_HASH_POOL = []


def _hash_pool():
    if not _HASH_POOL:
        from concurrent.futures import ThreadPoolExecutor
        _HASH_POOL.append(ThreadPoolExecutor(max_workers=min(CONTENT_THREADS, os.cpu_count() or 1),
                                             thread_name_prefix="epd-content-key"))
    return _HASH_POOL[0]


def _hash_chunks(chunks) -> bytes:
    return b"".join(hashlib.sha256(c).digest() for c in chunks)


def content_key(data, extra: bytes = b"") -> str:
    """A key for the feature cache from the content itself (an image's bytes or pixels):
    sha256 over the sha256 of each 256 KiB chunk of `data` (any contiguous buffer), its
    length and `extra`, as 64 hex digits ("epd-content-v2"; v1 had 1 MiB chunks, three
    for an image of 2.4 MB: no more than three threads at once). The chunks are hashed on
    up to CONTENT_THREADS threads at once, each a run of consecutive chunks (hashlib lets
    go of the GIL), so a large image costs the worker's critical path a fraction of one
    sha256 over it; the key depends on the bytes alone, not on the threads: the same bytes
    give the same key in every process on every machine."""
    mv = memoryview(data).cast("B")
    n = len(mv)
    chunks = [mv[i:i + CONTENT_CHUNK] for i in range(0, n, CONTENT_CHUNK)] or [mv]
    tasks = min(len(chunks), CONTENT_THREADS, os.cpu_count() or 1)
    if tasks > 1:
        per = -(-len(chunks) // tasks)
        digests = b"".join(_hash_pool().map(_hash_chunks, [chunks[i:i + per] for i in range(0, len(chunks), per)]))
    else:
        digests = _hash_chunks(chunks)
    h = hashlib.sha256(b"epd-content-v2|%d|" % n)
    h.update(digests)
    h.update(b"|" + bytes(extra))
    return h.hexdigest()
