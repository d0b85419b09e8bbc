# SPDX-License-Identifier: LGPL-2.1-or-later
"""The workers' side of epd (hooks.py puts it behind vLLM's connector hook names):

- features (encoder cache connector): the encoder `produce()`s a FeatureBundle into a
  feature buffer of epdd keyed by the image's content hash; the prefill `fetch()`es it
  (a hit means the vision encoder never runs);
- KV (KV connector): the prefill's `EpdKvSink` writes each layer's K/V into epd pages as
  the forward pass produces it (save_kv_layer) and reports each layer group ready, which
  ships that group at once (layered handoff); the decode's `EpdKvSource` accepts the
  handoff (start_load_kv), waits for the groups (wait_for_layer_load), reads the pages and
  commits (get_finished);
- agent branches: an agent request's first turn keeps its committed KV as the root of a
  workflow (`EpdKvSource.finish(keep=True)`); each follow-up turn forks a branch of it
  and advances it with its tokens, and `EpdBranchKv` serves the shared prefix pages as
  the model's KV source and writes the newly computed tokens into the branch's own
  pages (the decode worker reuses the prefix instead of recomputing it).

Arrays may be numpy arrays or torch tensors; reads return the same kind. In a GPU arena
each layer's K/V goes between the model's tensors and the pages by one kernel launch on
torch's current stream (KvPages); from a host arena, a GPU process registers the arena
with CUDA once (page-locked) and copies asynchronously. Either way a layer group is
reported ready when a CUDA event says its writes have landed, never by a host sync."""

import contextlib
import ctypes
import errno as _errno
import time
from typing import Callable, Dict, List, Optional, Sequence as Seq, Tuple

from .. import Arena, EpdError
from ..feature import Feature, Tensor
from ..handoff import Accepted, Handoff, Ring
from ..sequence import Sequence

KV_LAYER_ALIGN = 256  # daemon/pages/kvlayout.h

# A tensor's dtype (torch's or numpy's name) -> a feature's (proto/feature-desc.c: every
# dtype a feature may have, epd.feature._TORCH the other way).
_DT_NAMES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "int64": "i64", "int32": "i32",
             "int16": "i16", "uint8": "u8", "int8": "i8", "float64": "f64", "bool": "bool",
             "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch")


def _dtype_name(x) -> str:
    return str(x.dtype).replace("torch.", "")


def _elem_size(x) -> int:
    return x.element_size() if _is_torch(x) else x.itemsize


def _write(mv: memoryview, x, non_blocking: bool = False) -> None:
    """Copies array x (numpy or torch, any device) into the bytes of mv, row-major.
    non_blocking: a GPU tensor is copied asynchronously (mv must be pinned, see _pin_host;
    the caller waits for the stream before the bytes are used)."""
    if _is_torch(x):
        import torch
        dst = torch.frombuffer(mv, dtype=torch.uint8)[: x.numel() * x.element_size()]
        dst.view(x.dtype).view(x.shape).copy_(x, non_blocking=non_blocking)
    else:
        import numpy as np
        np.frombuffer(mv, dtype=x.dtype, count=x.size).reshape(x.shape)[...] = x


# ---------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------

def _layout(tensors: Dict[str, object], align: int = 256) -> Tuple[List[Tensor], int]:
    out, off = [], 0
    for name, t in tensors.items():
        off = (off + align - 1) // align * align
        dt = _DT_NAMES[_dtype_name(t)]
        out.append(Tensor(name, dt, tuple(int(s) for s in t.shape), off))
        n = _elem_size(t)
        for s in t.shape:
            n *= int(s)
        off += n
    return out, max(off, 1)


def _gpu_events():
    """Three timing events (before and after encode_fn, after the copies), if torch has CUDA up."""
    try:
        import torch
    except ImportError:
        return None
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    return [torch.cuda.Event(enable_timing=True) for _ in range(3)]


def produce(client, key: str, request_id: str, encode_fn, timeout_s: float = 60.0,
            detail: Optional[Dict[str, float]] = None,
            layout: Optional[Tuple[List[Tensor], int]] = None,
            on_acquired: Optional[Callable[[str], None]] = None,
            overlap: Optional[Callable[[], None]] = None) -> Tuple[str, float]:
    """Encoder: makes sure `key` is cached. Returns ("hit"|"waited"|"produced", encode seconds).
    encode_fn() -> {name: array} runs only when this worker is told to produce.

    layout, when the caller knows encode_fn's output layout beforehand (_layout() of an
    earlier output of the same shapes): the Acquire reserves the region in the same call
    (AcquireOrReserve, one round trip instead of two); an output that does not match it
    fails the feature and raises ValueError.

    The Publish and the Release go out together without waiting for epdd's replies (the
    Publish's waits for the journal's sync, which the producer need not: the feature is
    READY for readers once epdd has read it); the next produce() first takes their replies,
    so a refusal is raised there (or call client.flush()).

    detail, when given, gets the parts in seconds: the Acquire ("acquire"), host time until
    encode_fn returned ("fn"), the reserve ("reserve"), finding the arena and queueing the
    copies ("copy"), waiting for the GPU ("sync"), sending Publish + Release ("publish");
    on a GPU also the GPU's own time for encode_fn's work ("fn_gpu") and from there to the
    copies queued ("copy_gpu"), from CUDA events (no extra synchronization).

    on_acquired(result), when given, is called once the Acquire has answered (hit, wait
    or produce), before encode_fn runs: from then on a reader's Acquire of `key` finds the
    feature (ready, or being produced: it waits for the Publish, woken by epdd), so a
    caller can start the reader's side (a prefill) while the encoder runs.

    overlap, when given with layout: work that runs while the AcquireOrReserve is on its
    way (sent, its answer not yet taken): what encode_fn will need whatever the answer
    and costs little when it is a hit (an upload of the encoder's inputs, say). Then
    "acquire" in detail is only the call's part not hidden behind it (the send, and the
    wait for the answer once overlap returned), and "overlap" overlap's own time."""
    client.flush(timeout_s)  # the previous produce's Publish and Release: answered, not refused
    t_a = time.perf_counter()
    if layout is not None and overlap is not None:
        call = Feature.acquire_or_reserve_send(client, key, layout[1], layout[0], request_id)
        t_s = time.perf_counter()
        try:
            overlap()
        except BaseException:
            # Take the answer and give it back now (a producer's claim failed at once, as
            # when encode_fn raises), not on this client's next call.
            try:
                g = call.finish(min(timeout_s, 5.0))
                if g.result == "produce":
                    g.fail("encoder-error")
                g.release()
            except Exception:
                pass  # the call was given up: its handle goes back when the answer comes
            raise
        t_o = time.perf_counter()
        f = call.finish(timeout_s)
        if detail is not None:
            detail["overlap"] = t_o - t_s
        t_a += t_o - t_s  # the call's exposed part: its send and its wait after overlap
    elif layout is not None:
        f = Feature.acquire_or_reserve(client, key, layout[1], layout[0], request_id)
    else:
        f = Feature.acquire(client, key, may_produce=True)
    released = False
    try:
        if detail is not None:
            detail["acquire"] = time.perf_counter() - t_a
        if on_acquired is not None:
            on_acquired(f.result)
        if f.result == "hit":
            return "hit", 0.0
        if f.result == "wait":
            if not f.wait(timeout_s):
                raise EpdError(110, "org.epd1.Error.Timeout", "feature not produced in time", "produce")
            return "waited", 0.0
        ev = _gpu_events() if detail is not None else None
        t0 = time.perf_counter()
        try:
            if ev:
                ev[0].record()
            tensors = encode_fn()
            if ev:
                ev[1].record()
            t1 = time.perf_counter()
            spec, nbytes = _layout(tensors)
            if layout is None:
                f.produce(nbytes, spec, request_id)
            elif (spec, nbytes) != (list(layout[0]), layout[1]):
                raise ValueError(f"feature {key}: the encoder's output {spec} ({nbytes} bytes) is not the "
                                 f"layout reserved for it {layout[0]} ({layout[1]} bytes)")
            t2 = time.perf_counter()
            gpu = _feature_gpu_arena(client, f)
            if gpu is not None:
                # A GPU feature arena: device-to-device copies into views of it (one import).
                views = f.cuda_all(gpu)
                _copy_all([views[t.name] for t in spec], list(tensors.values()))
            else:
                buf = f.buffer()
                for t, (name, x) in zip(spec, tensors.items()):
                    _write(buf[t.offset:], x)
            if ev:
                ev[2].record()
            t3 = time.perf_counter()
            if any(_is_torch(x) and x.is_cuda for x in tensors.values()):
                import torch
                torch.cuda.current_stream().synchronize()  # the bytes are there before Publish
        except BaseException:
            f.fail("encoder-error")
            raise
        t4 = time.perf_counter()
        dt = t4 - t0
        released = True
        f.publish_release(int(dt * 1e6))
        if detail is not None:
            # publish_at: when the Publish went out (time.perf_counter(), CLOCK_MONOTONIC on
            # Linux: comparable with a reader's woke_at in another process of the host).
            detail.update(fn=t1 - t0, reserve=t2 - t1, copy=t3 - t2, sync=t4 - t3,
                          publish=time.perf_counter() - t4, publish_at=t4)
            if ev:
                ev[2].synchronize()
                detail.update(fn_gpu=ev[0].elapsed_time(ev[1]) / 1e3, copy_gpu=ev[1].elapsed_time(ev[2]) / 1e3)
        return "produced", dt
    finally:
        if not released:
            f.release()


def _copy_all(dst: List[object], src: List[object]) -> None:
    """dst[i].copy_(src[i]) for every i (torch tensors), as one call of torch's foreach
    copy (one launch for tensors of one dtype, its own loop in C++ otherwise) rather than
    a Python call and a launch each; each copy_ on its own where torch has no foreach copy
    or refuses the lists."""
    import torch
    fe = getattr(torch, "_foreach_copy_", None)
    if fe is not None:
        try:
            fe(dst, src)
            return
        except (RuntimeError, TypeError):
            pass
    for d, x in zip(dst, src):
        d.copy_(x)


def _feature_gpu_arena(client, f: Feature):
    """The mapping of the GPU arena that holds f, or None (a host arena); looked up once
    per arena of this client's registration (kept on the client by (registration,
    index): an index of an earlier registration may be another arena; one closed
    meanwhile is mapped anew, as gpu_arena() does)."""
    i = f.arena
    if i < 0:
        return None
    key = (client._generation, i)
    seen = client._feature_gpu_arenas
    if key not in seen or (seen[key] is not None and seen[key].closed):
        a = Arena(client, i)
        seen[key] = gpu_arena(client, a.name) if a.domain == "gpu" else None
    return seen[key]


class FeatureTensors(dict):
    """A feature's tensors by name. From a GPU arena they are views of it (no copy), and
    the feature stays pinned until release() (or, dropped unreleased, while this object
    or any of the tensor objects it holds lives: each holds the handle, so that
    fetch(...)["x"] stays valid; a tensor made from one of them does not); from a host
    arena, copies (release() does nothing)."""

    def __init__(self, tensors: Dict[str, object], handle: Optional[Feature] = None,
                 timing: Optional[Dict[str, float]] = None):
        super().__init__(tensors)
        self._handle = handle
        self.timing = timing or {}  # seconds: acquire (the bus call), wait (for the producer), read

    def release(self) -> None:
        if self._handle is not None:
            h, self._handle = self._handle, None
            h.release()


def fetch(client, key: str, device: Optional[str] = None, timeout_s: float = 60.0) -> FeatureTensors:
    """Prefill: the tensors of `key`, waiting for its producer if needed. From a GPU arena
    (device given): views of the arena, read in place; release() them when done. From a
    host arena: with device, torch tensors on it (one host-to-device copy each); else numpy
    copies."""
    t0 = time.perf_counter()
    f = Feature.acquire(client, key, may_produce=False)
    t1 = time.perf_counter()
    keep = False
    try:
        if f.result != "hit" and not f.wait(timeout_s):
            raise EpdError(110, "org.epd1.Error.Timeout", f"feature {key} not ready", "fetch")
        t2 = time.perf_counter()
        gpu = _feature_gpu_arena(client, f) if device is not None else None
        if gpu is not None:
            out = f.cuda_all(gpu)
            keep = True  # the views need the handle: FeatureTensors.release() lets go
        else:
            out = {}
            for t in f.tensors:
                if device is not None:
                    out[t.name] = f.torch(t.name).to(device, non_blocking=False)
                else:
                    out[t.name] = f.numpy(t.name).copy()
        # woke_at: when the wait returned (time.perf_counter(); see produce's publish_at);
        # waited: whether there was a wait (the Acquire did not find the feature ready).
        timing = {"acquire": t1 - t0, "wait": t2 - t1, "read": time.perf_counter() - t2, "woke_at": t2,
                  "waited": f.result != "hit"}
        return FeatureTensors(out, f if keep else None, timing)
    finally:
        if not keep:
            f.release()


# ---------------------------------------------------------------------------------------
# KV
# ---------------------------------------------------------------------------------------

class KvPageLayout:
    """Where a layer's K and V live inside a page (docs/pages.md: layer-major pages)."""

    def __init__(self, layers: int, tokens_per_block: int, kv_heads: int, head_dim: int, elem_size: int):
        self.layers, self.tokens_per_block = layers, tokens_per_block
        self.kv_heads, self.head_dim, self.elem_size = kv_heads, head_dim, elem_size
        self.k_bytes_per_token = kv_heads * head_dim * elem_size
        self.v_bytes_per_token = self.k_bytes_per_token
        layer_bytes = tokens_per_block * (self.k_bytes_per_token + self.v_bytes_per_token)
        self.layer_stride = (layer_bytes + KV_LAYER_ALIGN - 1) // KV_LAYER_ALIGN * KV_LAYER_ALIGN
        self.page_size = layers * self.layer_stride

    def k_offset(self, layer: int) -> int:
        return layer * self.layer_stride

    def v_offset(self, layer: int) -> int:
        return layer * self.layer_stride + self.tokens_per_block * self.k_bytes_per_token

    def pages_for(self, tokens: int) -> int:
        return (tokens + self.tokens_per_block - 1) // self.tokens_per_block


def groups_of(layers: int, group_size: int) -> List[int]:
    """Layers per group, in order, summing to `layers`."""
    g = [group_size] * (layers // group_size)
    if layers % group_size:
        g.append(layers % group_size)
    return g


# The GPU side of this process: the driver handle and the upload streams. The GPU arenas
# mapped are the client's (Client._gpu_arenas), the notifiers the ring's
# (Ring.gpu_notifiers): nothing here holds a client.
_GPU: Dict[object, object] = {}


def _gpu():
    g = _GPU.get("gpu")
    if g is None:
        from .. import gpu as G
        g = _GPU["gpu"] = G.Gpu()
    return g


def gpu_arena(client, name: str):
    """The GPU arena `name` of client's registration, mapped once per registration: kept
    on the client by (registration, name), dropped when it registers again, unregisters
    or closes, and unmapped once nothing made from it (views, page tables, KvPages) is
    left. One closed meanwhile (GpuArena.close()) is mapped anew."""
    key = (client._generation, name)
    m = client._gpu_arenas.get(key)
    if m is None or m.closed:
        if not client._c:
            raise ValueError(f"GPU arena {name}: the client is closed")
        m = client._gpu_arenas[key] = _gpu().map_arena(client, name)
    return m


def _notifier(ring, ordinal: int):
    """The notifier (epd.gpu.Notifier) of this ring on GPU `ordinal`: one per ring and GPU,
    kept on the ring (Ring.gpu_notifiers), so that it goes with the ring and its client
    (a ring and its notifier dropped together are one cycle of garbage, which the
    collector closes in order: Ring.__del__) and Ring.close() drops it."""
    n = ring.gpu_notifiers.get(ordinal)
    if n is None:
        from .. import gpu as G
        n = ring.gpu_notifiers[ordinal] = G.Notifier(_gpu(), ordinal, ring)
    return n


def close_notifiers(ring) -> None:
    """Flushes and ends the ring's notifiers (before the ring itself is closed)."""
    while ring.gpu_notifiers:
        ring.gpu_notifiers.popitem()[1].close()


_RAW_STREAM = []


def _stream_of(t) -> int:
    """The current CUDA stream (a CUstream handle) of torch tensor t's device: the
    model's stream, by torch's own cheap accessor where this torch has it."""
    if not _RAW_STREAM:
        import torch
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _RAW_STREAM.append(raw if raw is not None else
                           (lambda dev: torch.cuda.current_stream(dev).cuda_stream))
    return _RAW_STREAM[0](t.get_device())


def _stream() -> int:
    """The current CUDA stream of torch (the model's), or the default stream without torch."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.current_stream().cuda_stream if torch.cuda.is_available() else 0


_TORCH_DTYPES = {"bfloat16", "float16", "float32"}


def _strides(x) -> Tuple[int, ...]:
    """x's strides in elements, where a dimension of size 1 (whose stride is arbitrary:
    torch calls such a tensor contiguous whatever it says) counts as laid out contiguously
    after the ones that follow it."""
    shape = tuple(int(n) for n in x.shape)
    st = list(x.stride() if _is_torch(x) else (s // x.itemsize for s in x.strides))
    inner = 1
    for d in range(len(shape) - 1, -1, -1):
        if shape[d] == 1:
            st[d] = inner
        inner = st[d] * shape[d]
    return tuple(st)


class KvPages:
    """The pages of one sequence (byte offsets in an arena) seen through a KvPageLayout:
    each layer's K and V go in, or come out, in one call of the batched scatter/gather
    (epd.gpu.PageTable / kv_write_host): one kernel launch on the current CUDA stream when
    the arena is a GPU arena, one C call over host memory otherwise. Tensors are the
    model's (1, H, S, D) cache tensors (numpy or torch; the last dimension contiguous)."""

    def __init__(self, client, arena: str, layout: "KvPageLayout", offsets: Seq[int]):
        a = client.arena(arena)
        self.layout, self.offsets = layout, [int(o) for o in offsets]
        # The pages are the daemon's word; the copies below write through raw addresses:
        # a page outside the arena would be another mapping's memory.
        for o in self.offsets:
            if o < a.data_offset or o + layout.page_size > a.size:
                raise ValueError(f"page at {o} (+{layout.page_size}) outside arena {arena} "
                                 f"[{a.data_offset}, {a.size})")
        self.on_gpu = a.domain == "gpu"
        self._tables: Dict[int, object] = {}
        self._cached_rows = None  # (tensors' shapes, strides and dtype, KvRows): see _gpu_rows
        if self.on_gpu:
            self._m = gpu_arena(client, arena)
        else:
            # A mapping of this object's own (the client's view of the arena, held here),
            # not libepd's (Arena.address()): that one goes at unregister() or close(), and
            # a re-registration may map the next arena at the same address.
            view = client._arena_view(a.index)
            self._hold = (ctypes.c_ubyte * len(view)).from_buffer(view)
            base = ctypes.addressof(self._hold)
            self._addrs = [base + o for o in self.offsets]

    def _table(self, first: int, stream: Optional[int] = None):
        """The page table of pages [first, ...), built on `stream` (default: the current
        one) the first time it is asked for."""
        t = self._tables.get(first)
        if t is None:
            # The arena's own: made only while it is mapped (ValueError once it was
            # closed), and closed by its close(), so that no copy goes through a table
            # of pages no longer mapped.
            t = self._tables[first] = self._m.page_table_at(self.offsets[first:], self.layout.page_size,
                                                            _stream() if stream is None else stream)
        return t

    def prepare(self) -> None:
        """Builds the page table of the whole sequence now (its device memory allocated
        and the pages' addresses uploaded), off the caller's critical path: from a setup
        thread, on a stream of its own that it waits for, so that the copies later
        launched on the model's stream, whichever it is, find it in place."""
        if not self.on_gpu or 0 in self._tables:
            return
        try:
            import torch
        except ImportError:  # no torch (a fake GPU in tests): built at the first copy, as before
            return
        s = _GPU.get(("upload", self._m.ordinal))
        if s is None:
            s = _GPU[("upload", self._m.ordinal)] = torch.cuda.Stream(device=self._m.ordinal)
        self._table(0, s.cuda_stream)
        s.synchronize()

    def _rows(self, layer: int, k, v, tokens: int):
        from .. import gpu as G
        L = self.layout
        es = _elem_size(k)
        st, sv = _strides(k), _strides(v)
        if st != sv or st[3] != 1 or tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"layer {layer}: K and V must share shape and strides, the last dimension contiguous")
        if len(k.shape) != 4 or k.shape[1] != L.kv_heads or k.shape[3] != L.head_dim or es != L.elem_size \
                or k.shape[2] < tokens:
            raise ValueError(f"layer {layer}: K/V of shape {tuple(k.shape)} and {es}-byte elements for a layout of "
                             f"{L.kv_heads} heads of {L.head_dim} x {L.elem_size} bytes, {tokens} tokens")
        ptr_k, ptr_v = (k.data_ptr(), v.data_ptr()) if _is_torch(k) else (k.ctypes.data, v.ctypes.data)
        return G.KvRows(k=ptr_k, v=ptr_v, tokens=tokens, heads=L.kv_heads, tokens_per_page=L.tokens_per_block,
                        row_bytes=L.head_dim * es, k_offset=L.k_offset(layer), v_offset=L.v_offset(layer),
                        head_stride=st[1] * es, token_stride=st[2] * es)

    def _cached_gpu_rows(self, layer: int, k, v, tokens: int):
        """The KvRows kept by _gpu_rows, updated for this layer's tensors, when they have
        the same shape, strides and dtype as the checked ones (else None). The hot path
        of a forward pass: no stride analysis, no new ctypes structure."""
        c = self._cached_rows
        if c is None or c[0] != (k.shape, k.stride(), v.stride(), k.dtype, v.dtype):
            return None
        rows, L = c[1], self.layout
        rows.k, rows.v, rows.tokens = k.data_ptr(), v.data_ptr(), tokens
        rows.k_offset, rows.v_offset = L.k_offset(layer), L.v_offset(layer)
        return rows

    def _gpu_rows(self, layer: int, k, v, tokens: int):
        """_rows for the GPU path, without redoing per layer what is the same for every
        layer of a forward pass: the model's K/V tensors have one shape, strides and dtype
        from layer to layer, so the checked KvRows of the first layer is kept and only its
        addresses, token count and the layer's offsets change (the launch copies the
        struct's values: reusing it is safe)."""
        key = (tuple(k.shape), tuple(k.stride()), tuple(v.stride()), k.dtype, v.dtype)
        c = self._cached_rows
        if c is None or c[0] != key:
            rows = self._rows(layer, k, v, tokens)
            self._cached_rows = (key, rows)
            return rows
        rows, L = c[1], self.layout
        rows.k, rows.v, rows.tokens = k.data_ptr(), v.data_ptr(), tokens
        rows.k_offset, rows.v_offset = L.k_offset(layer), L.v_offset(layer)
        return rows

    def _first_page(self, start: int) -> int:
        if start % self.layout.tokens_per_block:
            raise ValueError(f"KV at token {start}: not at a page boundary")
        return start // self.layout.tokens_per_block

    def write(self, layer: int, k, v, start: int = 0) -> None:
        """K/V (1, H, S, D) of tokens [start, start+S) (start at a page boundary)."""
        from .. import gpu as G
        first = self._first_page(start)
        if self.on_gpu:
            if _is_torch(k):
                rows = self._cached_gpu_rows(layer, k, v, k.shape[2])
                if rows is None:
                    if k.stride(3) != 1 or v.stride(3) != 1 or _strides(v) != _strides(k):
                        k, v = k.contiguous(), v.contiguous()
                    rows = self._gpu_rows(layer, k, v, int(k.shape[2]))
                t = self._tables.get(first)
                (t if t is not None else self._table(first)).write(rows, _stream_of(k))
                return
            if _strides(k)[3] != 1 or _strides(v) != _strides(k):
                k, v = k.contiguous(), v.contiguous()
            self._table(first).write(self._rows(layer, k, v, int(k.shape[2])), _stream())
            return
        if _is_torch(k):
            k, v = k.contiguous().cpu(), v.contiguous().cpu()
        elif k.strides[3] != k.itemsize or k.strides != v.strides:
            import numpy as np
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        G.kv_write_host(self._addrs[first:], self.layout.page_size, self._rows(layer, k, v, int(k.shape[2])))

    def read(self, layer: int, tokens: int, dtype: str, device: Optional[str] = None):
        """K/V of tokens [0, tokens) as (1, H, S, D): torch on `device` (a GPU arena reads
        straight into it), else numpy."""
        from .. import gpu as G
        L = self.layout
        shape = (1, L.kv_heads, tokens, L.head_dim)
        if self.on_gpu:
            import torch
            dt = getattr(torch, dtype)
            # On the arena's GPU unless told: "cuda" alone is torch's current device, and
            # the gather would write into another GPU's memory.
            device = device or f"cuda:{self._m.ordinal}"
            k = torch.empty(shape, dtype=dt, device=device)
            v = torch.empty(shape, dtype=dt, device=device)
            rows = self._cached_gpu_rows(layer, k, v, tokens)
            if rows is None:
                rows = self._gpu_rows(layer, k, v, tokens)
            t = self._tables.get(0)
            (t if t is not None else self._table(0)).read(rows, _stream_of(k))
            return k, v
        if device is not None or dtype == "bfloat16":
            import torch
            dt = getattr(torch, dtype)
            k, v = torch.empty(shape, dtype=dt), torch.empty(shape, dtype=dt)
        else:
            import numpy as np
            k, v = np.empty(shape, dtype=np.dtype(dtype)), np.empty(shape, dtype=np.dtype(dtype))
        G.kv_read_host(self._addrs, L.page_size, self._rows(layer, k, v, tokens))
        if device is not None:
            k, v = k.to(device), v.to(device)
        return k, v

    def _many_rows(self, items, tokens: int):
        """A ctypes array of KvRows for [(layer, k, v)] whose tensors share one shape,
        strides and dtype (the layers of one model), from the first layer's checked rows;
        None if they do not."""
        l0, k0, v0 = items[0]
        shape, ks, vs, kd, vd = k0.shape, k0.stride(), v0.stride(), k0.dtype, v0.dtype
        layers, kp, vp = [], [], []
        for layer, k, v in items:  # one pass: the checks and the addresses
            if k.shape != shape or v.shape != shape or k.stride() != ks or v.stride() != vs or k.dtype != kd \
                    or v.dtype != vd:
                return None
            layers.append(layer)
            kp.append(k.data_ptr())
            vp.append(v.data_ptr())
        return self._rows_array(self._rows(l0, k0, v0, tokens), layers, kp, vp)

    def _rows_array(self, first, layers, kp, vp):
        """A ctypes array of KvRows: `first`'s (checked) geometry for every layer, with
        the layers' tensor addresses kp / vp and the layers' offsets in a page."""
        from .. import gpu as G
        L = self.layout
        stride, v_in_page = L.layer_stride, L.tokens_per_block * L.k_bytes_per_token
        import numpy as np
        # Column by column (a few numpy calls, not a dozen ctypes and torch calls per
        # layer): KvRows is 9 words, k, v, tokens, heads|tokens_per_page, row_bytes,
        # k_offset, v_offset, head_stride, token_stride (native byte order).
        assert ctypes.sizeof(G.KvRows) == 9 * 8, "KvRows is not 9 words"
        a = np.empty((len(layers), 9), dtype=np.uint64)
        a[:] = np.frombuffer(bytes(first), dtype=np.uint64)
        a[:, 0] = kp
        a[:, 1] = vp
        off = np.array(layers, dtype=np.uint64) * np.uint64(stride)
        a[:, 5] = off  # KvPageLayout.k_offset / v_offset, without the calls
        a[:, 6] = off + np.uint64(v_in_page)
        return (G.KvRows * len(layers)).from_buffer(a)  # keeps `a` alive

    def write_layers(self, items, start: int = 0, events=None) -> None:
        """Several layers' K/V, [(layer, k, v)] of tokens [start, start+S), in one call:
        on a GPU arena one launch of the batched scatter for all of them (layers of one
        shape and dtype); else layer by layer. events: CUDA events (start, end) recorded
        on the tensors' stream just before and after the launch (the copy's GPU time,
        without the host's preparation of the launch)."""
        if not items:
            return
        k0 = items[0][1]
        v0 = items[0][2]
        # _many_rows holds every layer to the first one's strides: checking it is enough.
        if self.on_gpu and _is_torch(k0) and k0.stride(3) == 1 and v0.stride(3) == 1:
            rows = self._many_rows(items, int(k0.shape[2]))
            if rows is not None:
                t = self._table(self._first_page(start))
                with _between(events):
                    t.write_many(rows, _stream_of(k0))
                return
        with _between(events):
            for layer, k, v in items:
                self.write(layer, k, v, start)

    def read_layers(self, layers: Seq[int], tokens: int, dtype: str, device: Optional[str] = None, events=None):
        """K/V of tokens [0, tokens) of these layers, [(k, v)]: on a GPU arena one
        allocation and one launch of the batched gather for all of them (views of one
        buffer, each (1, H, S, D) contiguous); else layer by layer (read()). events: as
        write_layers (GPU arenas)."""
        if not self.on_gpu or not layers:
            return [self.read(layer, tokens, dtype, device) for layer in layers]
        import numpy as np
        import torch
        L = self.layout
        layers = list(layers)
        buf = torch.empty((len(layers), 2, 1, L.kv_heads, tokens, L.head_dim), dtype=getattr(torch, dtype),
                          device=device or f"cuda:{self._m.ordinal}")  # the arena's GPU, as read()
        out = [tuple(kv.unbind(0)) for kv in buf.unbind(0)]
        # Views of one contiguous buffer: the first layer's rows checked, every other
        # layer's K and V at fixed distances from it (no per-layer torch calls).
        layer_bytes = L.kv_heads * tokens * L.head_dim * buf.element_size()
        kp = np.uint64(buf.data_ptr()) + np.arange(len(layers), dtype=np.uint64) * np.uint64(2 * layer_bytes)
        rows = self._rows_array(self._rows(layers[0], out[0][0], out[0][1], tokens), layers, kp,
                                kp + np.uint64(layer_bytes))
        t = self._table(0)
        with _between(events):
            t.read_many(rows, _stream_of(buf))
        return out

    def close(self) -> None:
        for t in self._tables.values():
            t.close()
        self._tables.clear()


@contextlib.contextmanager
def _between(events):
    """CUDA events (start, end), when given, recorded on the current stream just before
    and after what the block enqueues."""
    if events is not None:
        events[0].record()
    yield
    if events is not None:
        events[1].record()


def _seq_offsets(client, arena: str, pages: Seq[int], page_size: int) -> List[int]:
    base = client.arena(arena).data_offset
    return [base + p * page_size for p in pages]


_SETUP_EXECUTOR = []


def _setup_executor():
    """The one thread that runs sinks' background setups, in the order asked: a new
    thread per request cost its start-up on the caller's critical path (the caller
    waited for the thread to run), and one after the other the setups never use the
    client connection at the same time."""
    if not _SETUP_EXECUTOR:
        from concurrent.futures import ThreadPoolExecutor
        _SETUP_EXECUTOR.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="epd-sink-setup"))
    return _SETUP_EXECUTOR[0]


class EpdKvSink:
    """Prefill: writes K/V layer by layer into a fresh sequence and ships each layer group
    as soon as its last layer is written (save_kv_layer + layer group ready). On a GPU
    the writes are asynchronous on the model's stream, and a group is reported ready
    once a CUDA event says its writes have landed (never before)."""

    def __init__(self, client, arena: str, layout: KvPageLayout, request_id: str, tokens: int,
                 group_sizes: Seq[int], destination: str = "", ring: Optional[Ring] = None,
                 target: Optional[str] = None, background: bool = False, save: str = "layer"):
        """background: the sequence and the handoff's Prepare (bus calls, the daemon's
        journal) are made on a thread of their own while the caller goes on launching the
        model's forward pass; the first layer() waits for them. Only while this sink is
        being set up, nothing else may use `client` (libepd's connection is not shared
        between threads).

        save: "layer" writes each layer as it comes and ships each group once its writes
        have run (the transfer overlaps the rest of the forward pass); "end" keeps the
        model's K/V tensors and writes every layer in one launch at flush()/done(), with
        one notice for every group: for a handoff with nothing to overlap (a destination
        in the same GPU arena takes the pages, zero bytes move), it saves a launch and a
        notice per layer on the prefill's critical path. Host arenas always write layer
        by layer (the copies are the CPU's either way)."""
        if save not in ("layer", "end"):
            raise ValueError(f"save {save!r}: layer or end")
        self.save = save
        self._deferred = []  # save="end": (layer, k, v) not written yet
        self.write_gpu_s = 0.0  # save="end": the GPU time of the one write (CUDA events)
        # save="end": the part of the write's and notices' host time that did not delay
        # the write on the GPU. When the model's stream still had work queued as the sink
        # began: their host time less the GPU's gap between the end of that work and the
        # write's start (CUDA events: the delay the host's preparation put on the GPU's
        # timeline, whatever else shared the GPU); the GPU still busy with the model all
        # along, all of it. When the stream was idle already: none (all of it counted).
        self.host_hidden_s = 0.0
        self._host_s = 0.0
        self._gpu_timing = None
        self.client, self.layout, self.ring = client, layout, ring
        self.tokens = tokens
        self.group_last = []
        n = 0
        for g in group_sizes:
            n += g
            self.group_last.append(n - 1)
        self.bytes_written = 0
        self.groups_sent = 0
        self.seconds = 0.0  # time spent in this sink: launches or host copies, notices
        self.write_s = 0.0  # of which the writes (launches, host copies)
        self.notice_s = 0.0  # of which the groups' events and ready notices
        self.wait_s = 0.0   # time done() waited for the model's kernels before the last groups
        self.setup_s = 0.0  # the sequence and Prepare themselves (hidden when in the background)
        self.setup_wait_s = 0.0  # how long the first layer waited for a background setup
        self._pending = []  # (CUDA event, group) of groups whose writes are in flight
        self._seq = self._kv = self._handoff = self._notifier = None
        self._setup_error: Optional[BaseException] = None
        self._thread = None
        args = (arena, request_id, destination, list(group_sizes), target)
        if background:
            self._thread = _setup_executor().submit(self._setup_in_background, *args)
        else:
            self._setup(*args)

    def _setup(self, arena, request_id, destination, group_sizes, target) -> None:
        t0 = time.perf_counter()
        seq = Sequence.create(self.client, arena, self.layout.pages_for(self.tokens))
        kv = None
        try:
            if seq.page_size != self.layout.page_size:
                raise EpdError(22, "org.epd1.Error.InvalidArgument",
                               f"page size {seq.page_size} != layout {self.layout.page_size}", "kv sink")
            # Read once, here (a GetPages bus call): `pages` keeps them; asked again after
            # Prepare, a failure there left the prepared handoff and the sequence behind.
            pages = seq.pages
            kv = KvPages(self.client, arena, self.layout,
                         _seq_offsets(self.client, arena, pages, self.layout.page_size))
            kv.prepare()  # a GPU page table's allocation and upload: here, not at the first write
            # GPU arena and a ring: libepd's notifier reports each group ready once its
            # writes have run on the GPU, from its own thread (no polling, no host sync).
            # (One per ring and GPU, kept for the next sinks: nothing to undo if Prepare fails.)
            # Not on a ring the daemon let go of (until it is opened again): the groups
            # are then reported from CUDA events, on the bus (_ready).
            ring = self.ring
            notifier = _notifier(ring, kv._m.ordinal) if ring is not None and not ring.let_go and kv.on_gpu \
                else None
            # Last: nothing after it can fail, so a prepared handoff is never left behind.
            handoff = Handoff.prepare(self.client, request_id, destination, seq.path, group_sizes, target=target)
        except BaseException:
            if kv is not None:
                kv.close()  # its page tables' device memory
            seq.release()
            raise
        self._seq_pages = pages
        self._seq, self._kv, self._handoff, self._notifier = seq, kv, handoff, notifier
        self._rid = handoff.request_id.encode()
        self.setup_s = time.perf_counter() - t0

    def _setup_in_background(self, *args) -> None:
        try:
            self._setup(*args)
        except BaseException as e:  # raised to the caller by _settle()
            self._setup_error = e

    def _settle(self) -> None:
        """Waits for a background setup; raises what it failed with."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.result()
            self.setup_wait_s += time.perf_counter() - t0
            self._thread = None
        if self._setup_error is not None:
            raise self._setup_error

    def setup_error(self) -> Optional[BaseException]:
        """What the sequence and Prepare failed with (waiting for a background setup), or
        None. A failed setup holds nothing: it let go of what it had made."""
        try:
            self._settle()
        except BaseException as e:
            return e
        return None

    @property
    def seq(self):
        self._settle()
        return self._seq

    @property
    def kv(self):
        self._settle()
        return self._kv

    @property
    def handoff(self):
        self._settle()
        return self._handoff

    @property
    def pages(self):
        self._settle()
        return self._seq_pages

    def layer(self, layer_idx: int, k, v) -> None:
        if self._deferred or (self.save == "end" and _is_torch(k) and k.is_cuda):
            # Kept (the model's cache holds these tensors anyway) and written at flush():
            # nothing else here, this runs in the forward pass.
            self._deferred.append((layer_idx, k, v))
            return
        t_start = time.perf_counter()
        if self._thread is not None or self._setup_error is not None:
            self._settle()
        self._kv.write(layer_idx, k, v)
        t_written = time.perf_counter()
        self.write_s += t_written - t_start
        S = int(k.shape[2])
        self.bytes_written += 2 * S * self.layout.k_bytes_per_token
        if layer_idx in self.group_last:
            g = self.group_last.index(layer_idx)
            if self._notifier is not None and _is_torch(k) and k.is_cuda:
                self._notifier.ready_after(_stream_of(k), self._rid, self._handoff.token, g)
                self.groups_sent += 1
            elif _is_torch(k) and k.is_cuda:
                import torch
                ev = torch.cuda.Event()
                ev.record()
                self._pending.append((ev, g))
                self._flush(block=False)
            else:
                self._ready(g)
        t_end = time.perf_counter()
        self.notice_s += t_end - t_written
        self.seconds += t_end - t_start

    def _ready(self, group: int) -> None:
        ring = self.ring
        if ring is not None and not ring.let_go:
            try:
                self.handoff.layer_group_ready(group, ring)
                self.groups_sent += 1
                return
            except EpdError as e:
                if e.errno != _errno.ECONNRESET:  # the daemon let go of the ring: nothing submitted
                    raise
        if ring is not None and _SETUP_EXECUTOR:
            # On the bus, from this thread: first every background setup asked for (the
            # executor's one thread runs them in order) is let finish, the client is one
            # thread's at a time.
            _SETUP_EXECUTOR[0].submit(lambda: None).result()
        self.handoff.layer_group_ready(group)
        self.groups_sent += 1

    def _write_deferred(self) -> None:
        """save="end": every kept layer in one launch on the model's stream, then every
        group reported ready after it (one event, one notice)."""
        if not self._deferred:
            return
        import torch
        t0 = time.perf_counter()
        # Work still queued on the model's stream (its forward pass)? If so, an event
        # reached when it is done, on the GPU's clock.
        queued_done = None
        if not torch.cuda.current_stream().query():
            queued_done = torch.cuda.Event(enable_timing=True)
            queued_done.record()
        items, self._deferred = self._deferred, []
        k0 = items[0][1]
        self.bytes_written += sum(2 * int(k.shape[2]) for _, k, _ in items) * self.layout.k_bytes_per_token
        if self.group_last[-1] not in (layer for layer, _, _ in items):
            raise ValueError(f"save='end': the last layer ({self.group_last[-1]}) was never saved")
        stream = _stream_of(k0)
        # The copy's GPU time: the events go around the launch alone (recorded before the
        # launch's preparation, they would time the host's work as the GPU's).
        timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._kv.write_layers(items, events=timing)
        self._gpu_timing = (queued_done,) + timing
        t1 = time.perf_counter()
        self.write_s += t1 - t0
        n = len(self.group_last)
        if self._notifier is not None:
            self._notifier.ready_after_range(stream, self._rid, self._handoff.token, 0, n)
            self.groups_sent += n
        else:
            ev = torch.cuda.Event()
            ev.record()
            self._pending.extend((ev, g) for g in range(n))
        t2 = time.perf_counter()
        self.notice_s += t2 - t1
        self.seconds += t2 - t0
        self._host_s = t2 - t0  # set against the GPU's gap once the events are done

    def _flush(self, block: bool) -> None:
        """Reports ready, in order, the groups whose writes have landed (all when block)."""
        if self._deferred:
            self._settle()
            self._write_deferred()
        if block and self._notifier is not None and not self._notifier.closed:
            # (closed: with its ring, reopened at a step's end, after this sink's flush)
            t0 = time.perf_counter()
            self._notifier.flush(30.0)
            self.wait_s += time.perf_counter() - t0
        while self._pending:
            ev, g = self._pending[0]
            if block:
                t0 = time.perf_counter()
                ev.synchronize()
                self.wait_s += time.perf_counter() - t0
            elif not ev.query():
                return
            self._pending.pop(0)
            self._ready(g)
        if block and self._gpu_timing is not None:
            queued_done, start, end = self._gpu_timing
            self._gpu_timing = None
            end.synchronize()  # done already: the groups' notices waited for it
            self.write_gpu_s += start.elapsed_time(end) / 1e3
            if queued_done is not None:
                # What the host's preparation delayed the write by on the GPU: the gap from
                # the model's last work to the write's start (0: the GPU was still busy).
                gap = max(0.0, queued_done.elapsed_time(start) / 1e3)
                self.host_hidden_s += max(0.0, self._host_s - gap)

    def flush(self) -> None:
        """Waits for the model's writes of every layer so far and reports their groups."""
        self._settle()
        self._flush(block=True)

    def done(self) -> None:
        # Every group's writes have landed and been reported before the sequence goes.
        # Leases keep the pages alive until the transfer completes; the decode side's
        # commit gives it references of its own. Idempotent (the model's prefill and the
        # worker loop may both call it).
        self._settle()
        self._flush(block=True)
        if self._seq is not None:
            seq, self._seq = self._seq, None
            self._kv.close()
            seq.release()


class EpdKvSource:
    """Decode: accepts the handoff of a request, waits for its layer groups, gives back
    each layer's K/V, then commits and releases."""

    def __init__(self, client, request_id: str, layout: KvPageLayout, tokens: int, ring: Optional[Ring] = None,
                 device: Optional[str] = None, dtype: str = "bfloat16", accept_timeout_s: float = 30.0,
                 wait: bool = True):
        self.client, self.layout, self.tokens, self.device, self.dtype = client, layout, tokens, device, dtype
        self.ring, self.timeout_s = ring, accept_timeout_s
        t0 = time.perf_counter()
        self.accepted = Accepted.accept_wait(client, request_id, accept_timeout_s, ring)
        self.accept_s = time.perf_counter() - t0
        self.seconds = 0.0  # launches or host copies of the layers
        self.wait_s = 0.0   # waiting for layer groups to land
        self._loaded = None  # layers read ahead in one launch: {layer: (k, v)}
        self.layers_at_once = 0  # how many layers that one launch read
        try:
            self.kv = KvPages(client, self.accepted.arena, layout, self.accepted.offsets)
            if wait:
                self.wait_layer_group(self.accepted.n_groups)
        except BaseException:
            # Nobody else knows this handoff was accepted: let it go now (rolled back on
            # both sides), not at the prefill's HandoffTimeout=.
            try:
                self.accepted.release(ring)
            except Exception:
                pass
            raise

    def wait_layer_group(self, n: int, timeout_s: Optional[float] = None) -> None:
        """Blocks until layer groups [0, n) have landed (progress records from the ring)."""
        if self.accepted.groups_done >= n:
            return
        t0 = time.perf_counter()
        self.accepted.wait_groups(n, self.ring, self.timeout_s if timeout_s is None else timeout_s)
        self.wait_s += time.perf_counter() - t0

    def layer(self, layer_idx: int):
        """The layer's (k, v). On a GPU arena, once every group has landed (at once when
        the handoff moved the pages within one arena), the first layer asked for reads it
        and every later layer in one launch; before that, layer by layer."""
        t0 = time.perf_counter()
        out = self._loaded.pop(layer_idx, None) if self._loaded else None
        if out is None:
            a = self.accepted
            if self.kv.on_gpu and self._loaded is None and a.groups_done < a.n_groups and self.ring is not None:
                # What the ring says already (no wait): the groups may all have landed.
                a.landed(self.ring)
            if self.kv.on_gpu and self._loaded is None and a.groups_done >= a.n_groups:
                rest = list(range(layer_idx, self.layout.layers))
                self._loaded = dict(zip(rest, self.kv.read_layers(rest, self.tokens, self.dtype, self.device)))
                self.layers_at_once = len(rest)
                out = self._loaded.pop(layer_idx)
            else:
                out = self.kv.read(layer_idx, self.tokens, self.dtype, self.device)
        self.seconds += time.perf_counter() - t0
        return out

    def abandon(self) -> None:
        """A load the engine gave up on (the request aborted, or its wait or commit
        failed): its page tables closed, the handoff released (rolled back when not
        committed). Idempotent."""
        if self.kv is not None:
            self.kv.close()
            self.kv = None
        self._loaded = None
        if self.accepted is not None:
            a, self.accepted = self.accepted, None
            a.release(self.ring)

    def finish(self, keep: bool = False) -> Optional[Sequence]:
        """After the cache is built: commit (the pages become ours), then let them go, or
        with keep, return the committed sequence (an agent request's first turn: the
        root of its workflow)."""
        self.kv.close()
        self._loaded = None
        seq = Sequence(self.client, self.accepted.commit(release=True, ring=self.ring), self.accepted.arena)
        if keep:
            return seq
        seq.release()
        return None


class EpdBranchKv:
    """The KV of one agent branch's head sequence, in place in its pages: the first
    `prefix_tokens` tokens are the shared pages (read, never written), the rest is
    computed by the worker and written into the branch's own pages. Used as the
    model's KvSource (reads: the prefix) and KvSink (writes: from the prefix on)."""

    def __init__(self, client, head: Sequence, layout: KvPageLayout, prefix_tokens: int, arena: str = "host0",
                 device: Optional[str] = None, dtype: str = "bfloat16"):
        if prefix_tokens % layout.tokens_per_block:
            raise ValueError(f"prefix of {prefix_tokens} tokens: not whole pages")
        self.client, self.head, self.layout, self.arena = client, head, layout, arena
        self.prefix_tokens, self.device, self.dtype = prefix_tokens, device, dtype
        self.kv = None
        self.refresh()
        self.bytes_read = self.bytes_written = 0
        self.seconds = 0.0

    def refresh(self):
        """Reads the page table again (after append / prepare_write)."""
        if self.kv is not None:
            self.kv.close()
        self.pages = self.head.pages
        self.kv = KvPages(self.client, self.arena, self.layout,
                          _seq_offsets(self.client, self.arena, self.pages, self.layout.page_size))

    def read(self, layer_idx: int, tokens: int):
        t0 = time.perf_counter()
        k, v = self.kv.read(layer_idx, tokens, self.dtype, self.device)
        self.bytes_read += 2 * tokens * self.layout.k_bytes_per_token
        self.seconds += time.perf_counter() - t0
        return k, v

    def write(self, layer_idx: int, start: int, k, v) -> None:
        t0 = time.perf_counter()
        self.kv.write(layer_idx, k, v, start)
        self.bytes_written += 2 * int(k.shape[2]) * self.layout.k_bytes_per_token
        self.seconds += time.perf_counter() - t0

    def layer(self, layer_idx: int, k=None, v=None):
        if k is None:
            return self.read(layer_idx, self.prefix_tokens)
        self.write(layer_idx, self.prefix_tokens, k, v)

    def done(self) -> None:
        if self.kv is not None:
            self.kv.close()
