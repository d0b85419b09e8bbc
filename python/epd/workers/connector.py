# SPDX-License-Identifier: LGPL-2.1-or-later
"""The workers' side of epd, shaped like vLLM's connectors so an engine adapter is thin:

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

Arrays may be numpy arrays or torch tensors; reads return the same kind. A GPU process
registers the host arena with CUDA once (page-locked), so that K/V goes between the GPU
and the pages by asynchronous copies, and a layer group is reported ready when a CUDA
event says its copies have landed."""

import time
from typing import Dict, List, Optional, Sequence as Seq, Tuple

from .. import EpdError
from ..feature import Feature, Tensor
from ..handoff import Accepted, Handoff, Ring
from ..sequence import Sequence

KV_LAYER_ALIGN = 256  # daemon/pages/kvlayout.h

_DT_NAMES = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "int64": "i64", "int32": "i32",
             "uint8": "u8", "int8": "i8", "float64": "f64"}


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


_PINNED: Dict[int, bool] = {}  # arena mapping address -> registered with CUDA


def _pin_host(address: int, length: int) -> bool:
    """Registers a mapped host arena with CUDA once per process (page-locked, so that
    copies between it and the GPU are asynchronous DMA on the copy engine instead of
    synchronous staged copies). False when there is no CUDA or the driver refuses; the
    callers then copy synchronously."""
    if address not in _PINNED:
        ok = False
        try:
            import torch
            if torch.cuda.is_available():
                ok = int(torch.cuda.cudart().cudaHostRegister(address, length, 0)) == 0
        except Exception:
            ok = False
        _PINNED[address] = ok
    return _PINNED[address]


def _view(mv: memoryview, dtype_name: str, shape, like_torch: bool):
    if like_torch:
        import torch
        dt = getattr(torch, dtype_name)
        n = 1
        for s in shape:
            n *= s
        return torch.frombuffer(mv, dtype=torch.uint8)[: n * torch.empty((), dtype=dt).element_size()] \
            .view(dt).view(*shape)
    import numpy as np
    n = 1
    for s in shape:
        n *= s
    return np.frombuffer(mv, dtype=np.dtype(dtype_name), count=n).reshape(shape)


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


def produce(client, key: str, request_id: str, encode_fn, timeout_s: float = 60.0) -> Tuple[str, float]:
    """Encoder: makes sure `key` is cached. Returns ("hit"|"waited"|"produced", encode seconds).
    encode_fn() -> {name: array} runs only when this worker is told to produce."""
    f = Feature.acquire(client, key, may_produce=True)
    try:
        if f.result == "hit":
            return "hit", 0.0
        if f.result == "wait":
            if not f.wait(timeout_s):
                raise EpdError(110, "org.epd1.Error.Timeout", "feature not produced in time", "produce")
            return "waited", 0.0
        t0 = time.perf_counter()
        try:
            tensors = encode_fn()
            spec, nbytes = _layout(tensors)
            f.produce(nbytes, spec, request_id)
            buf = f.buffer()
            for t, (name, x) in zip(spec, tensors.items()):
                _write(buf[t.offset:], x)
            if any(_is_torch(x) and x.is_cuda for x in tensors.values()):
                import torch
                torch.cuda.synchronize()
        except BaseException:
            f.fail("encoder-error")
            raise
        dt = time.perf_counter() - t0
        f.publish(int(dt * 1e6))
        return "produced", dt
    finally:
        f.release()


def fetch(client, key: str, device: Optional[str] = None, timeout_s: float = 60.0) -> Dict[str, object]:
    """Prefill: the tensors of `key`, waiting for its producer if needed. With device,
    torch tensors on it (one host-to-device copy each); else numpy views copied out."""
    f = Feature.acquire(client, key, may_produce=False)
    try:
        if f.result != "hit" and not f.wait(timeout_s):
            raise EpdError(110, "org.epd1.Error.Timeout", f"feature {key} not ready", "fetch")
        out = {}
        for t in f.tensors:
            if device is not None:
                out[t.name] = f.torch(t.name).to(device, non_blocking=False)
            else:
                out[t.name] = f.numpy(t.name).copy()
        return out
    finally:
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


class EpdKvSink:
    """Prefill: writes K/V layer by layer into a fresh sequence and ships each layer group
    as soon as its last layer is written (save_kv_layer + layer group ready)."""

    def __init__(self, client, arena: str, layout: KvPageLayout, request_id: str, tokens: int,
                 group_sizes: Seq[int], destination: str = "", ring: Optional[Ring] = None,
                 target: Optional[str] = None):
        self.client, self.layout, self.ring = client, layout, ring
        self.tokens = tokens
        self.seq = Sequence.create(client, arena, layout.pages_for(tokens))
        if self.seq.page_size != layout.page_size:
            raise EpdError(22, "org.epd1.Error.InvalidArgument",
                           f"page size {self.seq.page_size} != layout {layout.page_size}", "kv sink")
        self.pages = self.seq.pages
        a = client.arena(arena)
        self._arena_buf = a.buffer()
        self._base = a.data_offset
        self.group_last = []
        n = 0
        for g in group_sizes:
            n += g
            self.group_last.append(n - 1)
        self.handoff = Handoff.prepare(client, request_id, destination, self.seq.path, list(group_sizes),
                                       target=target)
        self.bytes_written = 0
        self.groups_sent = 0
        self.seconds = 0.0  # time spent in this sink: device-to-host copies, page writes, notices
        self.wait_s = 0.0   # time done() waited for the model's kernels before the last copies
        self._pending = []  # (CUDA event, group) of groups whose copies are in flight
        self._pinned = _pin_host(a.address(), a.size)

    def _page(self, i: int) -> memoryview:
        off = self._base + self.pages[i] * self.layout.page_size
        return self._arena_buf[off: off + self.layout.page_size]

    def layer(self, layer_idx: int, k, v) -> None:
        t_start = time.perf_counter()
        L, T = self.layout, self.layout.tokens_per_block
        # (1, H, S, D) -> (S, H, D) row-major: transposed on the device, then each page's
        # slice goes to the host page. Into a pinned arena the copies are asynchronous and
        # the group is reported ready once a CUDA event says its copies have landed.
        async_copy = _is_torch(k) and k.is_cuda and self._pinned
        if _is_torch(k):
            k = k[0].transpose(0, 1).contiguous()
            v = v[0].transpose(0, 1).contiguous()
            if not async_copy:
                k, v = k.cpu(), v.cpu()
        else:
            k = k[0].transpose(1, 0, 2).copy()
            v = v[0].transpose(1, 0, 2).copy()
        S = k.shape[0]
        for b in range(L.pages_for(S)):
            t0, t1 = b * T, min((b + 1) * T, S)
            page = self._page(b)
            _write(page[L.k_offset(layer_idx):], k[t0:t1], async_copy)
            _write(page[L.v_offset(layer_idx):], v[t0:t1], async_copy)
        self.bytes_written += 2 * S * L.k_bytes_per_token
        if layer_idx in self.group_last:
            g = self.group_last.index(layer_idx)
            if async_copy:
                import torch
                ev = torch.cuda.Event()
                ev.record()
                self._pending.append((ev, g))
                self._flush(block=False)
            else:
                self._ready(g)
        self.seconds += time.perf_counter() - t_start

    def _ready(self, group: int) -> None:
        self.handoff.layer_group_ready(group, self.ring)
        self.groups_sent += 1

    def _flush(self, block: bool) -> None:
        """Reports ready, in order, the groups whose copies have landed (all when block)."""
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

    def done(self) -> None:
        # Every group's copies have landed and been reported before the sequence goes.
        # Leases keep the pages alive until the transfer completes; the decode side's
        # commit gives it references of its own. Idempotent (the model's prefill and the
        # worker loop may both call it).
        self._flush(block=True)
        if self.seq is not None:
            seq, self.seq = self.seq, None
            seq.release()


class EpdKvSource:
    """Decode: accepts the handoff of a request, waits for its layer groups, gives back
    each layer's K/V, then commits and releases."""

    def __init__(self, client, request_id: str, layout: KvPageLayout, tokens: int, ring: Optional[Ring] = None,
                 device: Optional[str] = None, dtype: str = "bfloat16", accept_timeout_s: float = 30.0):
        self.client, self.layout, self.tokens, self.device, self.dtype = client, layout, tokens, device, dtype
        self.ring = ring
        deadline = time.monotonic() + accept_timeout_s
        while True:
            try:
                self.accepted = Accepted.accept(client, request_id)
                break
            except EpdError as e:
                if e.name != "org.epd1.Error.NotFound" or time.monotonic() > deadline:
                    raise
                time.sleep(0.001)
        t0 = time.perf_counter()
        self.accepted.wait_groups(self.accepted.n_groups, ring)
        self.wait_s = time.perf_counter() - t0
        a = client.arena(self.accepted.arena)
        self._arena_buf = a.buffer()
        self._pinned = device is not None and _pin_host(a.address(), a.size)

    def layer(self, layer_idx: int):
        L = self.layout
        pages = [lambda off=off: self._arena_buf[off: off + L.page_size] for off in self.accepted.offsets]
        return _read_tokens(L, pages, layer_idx, self.tokens, self.dtype, self.device, self._pinned)

    def finish(self, keep: bool = False) -> Optional[Sequence]:
        """After the cache is built: commit (the pages become ours), then let them go, or
        with keep, return the committed sequence (an agent request's first turn: the
        root of its workflow)."""
        seq = Sequence(self.client, self.accepted.commit(), self.accepted.arena)
        self.accepted.release(self.ring)
        if keep:
            return seq
        seq.release()
        return None


def _write_tokens(L: KvPageLayout, page_fn, layer_idx: int, start: int, k, v) -> None:
    """Writes K/V of tokens [start, start+S) (k, v: (S, H, D) on the host) of one layer
    into the pages; page_fn(i) is page i's bytes. start is block-aligned."""
    T = L.tokens_per_block
    if start % T:
        raise ValueError(f"write at token {start}: not at a page boundary")
    S = k.shape[0]
    for b in range(L.pages_for(S)):
        t0, t1 = b * T, min((b + 1) * T, S)
        page = page_fn(start // T + b)
        _write(page[L.k_offset(layer_idx):], k[t0:t1])
        _write(page[L.v_offset(layer_idx):], v[t0:t1])


def _read_tokens(L: KvPageLayout, pages, layer_idx: int, S: int, dtype: str, device: Optional[str],
                 pinned: bool = False):
    """K/V of tokens [0, S) of one layer as (1, H, S, D): torch on `device`, or numpy when
    device is None. pages[i]() is page i's bytes; pinned: the arena is page-locked, each
    page goes straight to the GPU by an asynchronous copy."""
    T, H, D = L.tokens_per_block, L.kv_heads, L.head_dim
    ks, vs = [], []
    torch_like = device is not None
    for b in range(L.pages_for(S)):
        n = min(T, S - b * T)
        page = pages[b]()
        ks.append(_view(page[L.k_offset(layer_idx):], dtype, (n, H, D), torch_like))
        vs.append(_view(page[L.v_offset(layer_idx):], dtype, (n, H, D), torch_like))
    if torch_like:
        import torch
        if pinned:
            k = torch.cat([x.to(device, non_blocking=True) for x in ks])
            v = torch.cat([x.to(device, non_blocking=True) for x in vs])
        else:
            k, v = torch.cat(ks).to(device), torch.cat(vs).to(device)
        k = k.transpose(0, 1).unsqueeze(0).contiguous()
        v = v.transpose(0, 1).unsqueeze(0).contiguous()
    else:
        import numpy as np
        k = np.concatenate(ks).transpose(1, 0, 2)[None].copy()
        v = np.concatenate(vs).transpose(1, 0, 2)[None].copy()
    return k, v


def _host_shd(k):
    """(1, H, S, D) -> (S, H, D) row-major on the host: one synchronous device-to-host copy."""
    if _is_torch(k):
        return k[0].transpose(0, 1).contiguous().cpu()
    return k[0].transpose(1, 0, 2).copy()


class EpdBranchKv:
    """The KV of one agent branch's head sequence, in place in its pages: the first
    `prefix_tokens` tokens are the shared pages (read, never written), the rest is
    computed by the worker and written into the branch's own pages. Used as the
    model's KvSource (reads: the prefix) and KvSink (writes: from the prefix on)."""

    def __init__(self, client, head: Sequence, layout: KvPageLayout, prefix_tokens: int, arena: str = "host0",
                 device: Optional[str] = None, dtype: str = "bfloat16"):
        if prefix_tokens % layout.tokens_per_block:
            raise ValueError(f"prefix of {prefix_tokens} tokens: not whole pages")
        self.client, self.head, self.layout = client, head, layout
        self.prefix_tokens, self.device, self.dtype = prefix_tokens, device, dtype
        a = client.arena(arena)
        self._buf, self._base = a.buffer(), a.data_offset
        self._pinned = device is not None and _pin_host(a.address(), a.size)
        self.refresh()
        self.bytes_read = self.bytes_written = 0
        self.seconds = 0.0

    def refresh(self):
        """Reads the page table again (after append / prepare_write)."""
        self.pages = self.head.pages

    def _page(self, i: int) -> memoryview:
        off = self._base + self.pages[i] * self.layout.page_size
        return self._buf[off: off + self.layout.page_size]

    def read(self, layer_idx: int, tokens: int):
        t0 = time.perf_counter()
        pages = [lambda i=i: self._page(i) for i in range(self.layout.pages_for(tokens))]
        k, v = _read_tokens(self.layout, pages, layer_idx, tokens, self.dtype, self.device, self._pinned)
        self.bytes_read += 2 * tokens * self.layout.k_bytes_per_token
        self.seconds += time.perf_counter() - t0
        return k, v

    def write(self, layer_idx: int, start: int, k, v) -> None:
        t0 = time.perf_counter()
        k, v = _host_shd(k), _host_shd(v)
        _write_tokens(self.layout, self._page, layer_idx, start, k, v)
        self.bytes_written += 2 * k.shape[0] * self.layout.k_bytes_per_token
        self.seconds += time.perf_counter() - t0

    def layer(self, layer_idx: int, k=None, v=None):
        if k is None:
            return self.read(layer_idx, self.prefix_tokens)
        self.write(layer_idx, self.prefix_tokens, k, v)

    def done(self) -> None:
        pass
