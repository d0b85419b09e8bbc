# SPDX-License-Identifier: LGPL-2.1-or-later
"""Worker processes (encoder, prefill, decode) and the proxy/load generator that drives
them through epdd. Requests are described by seeds, so every process rebuilds the same
inputs without shipping tensors between processes; everything that moves between roles
moves through epdd (features, KV pages, handoffs). Two backends:

- "synthetic": numpy tensors of a model's shapes (CI: no torch, no GPU);
- "qwen3vl": the real Hugging Face Qwen3-VL model (qwen3vl.py) on a GPU.

Used by python/tests/test_workers.py (CI) and bench/e2e/run-device.sh (GPU)."""

import hashlib
import multiprocessing as mp
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .. import Client
from .. import KvLayout
from . import connector as C


@dataclass
class Spec:
    """A request: image (by seed) + text (by seed), and how many tokens to generate."""
    request_id: str
    image_seed: Optional[int]
    text_seed: int
    text_tokens: int
    max_new_tokens: int
    submit_t: float = 0.0
    cache_salt: str = ""   # non-empty: a key no other request shares (measures no-cache)


def request_id_of(i: int) -> str:
    return hashlib.sha256(f"req-{i}".encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------------
# Backends: what each role computes
# ------------------------------------------------------------------------------------

class Synthetic:
    """numpy stand-in with the small Qwen3-VL shapes: deterministic from the seeds."""
    layers, kv_heads, head_dim, hidden, n_image_tokens, deepstack = 4, 1, 128, 256, 196, 3
    dtype = "float16"

    def __init__(self, device=None):
        import numpy as np
        self.np = np

    def image_key(self, spec: Spec) -> str:
        return hashlib.sha256(f"synthetic-image-{spec.image_seed}{spec.cache_salt}".encode()).hexdigest()

    def prompt_len(self, spec: Spec) -> int:
        return (self.n_image_tokens + 2 if spec.image_seed is not None else 0) + spec.text_tokens

    def encode(self, spec: Spec) -> Dict[str, object]:
        rng = self.np.random.default_rng(spec.image_seed)
        out = {"embeds": rng.standard_normal((self.n_image_tokens, self.hidden)).astype(self.np.float16)}
        for i in range(self.deepstack):
            out[f"deepstack.{i}"] = rng.standard_normal((self.n_image_tokens, self.hidden)).astype(self.np.float16)
        out["grid_thw"] = self.np.array([[1, 28, 28]], dtype=self.np.int64)
        return out

    def kv(self, spec: Spec, layer: int, features_sum: float):
        S = self.prompt_len(spec)
        rng = self.np.random.default_rng([spec.text_seed, layer])
        k = rng.standard_normal((1, self.kv_heads, S, self.head_dim)).astype(self.np.float16)
        v = (k * 0.5 + self.np.float16(features_sum % 7)).astype(self.np.float16)
        return k, v

    def prefill(self, spec: Spec, feats, sink) -> tuple:
        fsum = float(feats["embeds"].astype(self.np.float32).sum()) if feats else 0.0
        for layer in range(self.layers):
            k, v = self.kv(spec, layer, fsum)
            sink.layer(layer, k, v)
        return int(abs(fsum * 1000)) % 50000, 0

    def decode(self, spec: Spec, source, prompt_len, first, delta) -> List[int]:
        toks = [first]
        h = hashlib.sha256()
        for layer in range(self.layers):
            k, v = source.layer(layer)
            h.update(k.tobytes())
            h.update(v.tobytes())
        d = h.digest()
        toks += [int.from_bytes(d[i:i + 2], "little") for i in range(0, 2 * (spec.max_new_tokens - 1), 2)]
        return toks[: spec.max_new_tokens]


class Qwen3VL:
    def __init__(self, name: str, device: str = "cuda"):
        from . import qwen3vl as q
        self.q = q
        self.model = q.build_model(name, device)
        cfg = self.model.config.text_config
        self.layers, self.kv_heads, self.head_dim = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        self.dtype = "bfloat16"
        self.device = device
        self._reqs = {}

    def request(self, spec: Spec):
        r = self._reqs.get(spec.request_id)
        if r is None:
            r = self.q.make_request(self.model, spec.image_seed if spec.image_seed is not None else 0,
                                    spec.text_seed, text_tokens=spec.text_tokens, device=self.device)
            self._reqs = {spec.request_id: r}  # keep one: the worker serves them in turn
        return r

    def image_key(self, spec: Spec) -> str:
        return self.request(spec).image_key + spec.cache_salt

    def prompt_len(self, spec: Spec) -> int:
        return int(self.request(spec).input_ids.shape[1])

    def encode(self, spec: Spec):
        b = self.q.Encoder(self.model).encode(self.request(spec))
        return b.tensors()

    def prefill(self, spec: Spec, feats, sink) -> tuple:
        bundle = self.q.FeatureBundle.from_tensors(feats)
        first, delta = self.q.Prefill(self.model).prefill(self.request(spec), bundle, sink)
        return first, delta

    def decode(self, spec: Spec, source, prompt_len, first, delta) -> List[int]:
        return self.q.Decode(self.model).decode(source, prompt_len, first, delta, spec.max_new_tokens)


def make_backend(name: str):
    if name == "synthetic":
        return Synthetic()
    return Qwen3VL(name)


# ------------------------------------------------------------------------------------
# Worker processes
# ------------------------------------------------------------------------------------

def _worker(role: str, address: str, backend_name: str, conn, group_size: int, model_label: str,
            ring_entries: int = 1024):
    """One process: registers with epdd as `role`, then serves requests from the pipe."""
    try:
        b = make_backend(backend_name)
        client = Client(address)
        elem = 2
        layout = C.KvPageLayout(b.layers, 16, b.kv_heads, b.head_dim, elem)
        kv = KvLayout(b.layers, 16, layout.k_bytes_per_token, layout.v_bytes_per_token, b.dtype)
        client.register(role, model_label, "cuda:0" if backend_name != "synthetic" else "cpu",
                        kv=kv if role in ("prefill", "decode") else None)
        ring = None
        if role in ("prefill", "decode"):
            from ..handoff import Ring
            ring = Ring(client, cq_entries=ring_entries)
        groups = C.groups_of(b.layers, group_size)
        conn.send(("ready", os.getpid()))
        pending = []  # prefill: sinks whose handoff is not released yet
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            spec: Spec = msg[1]
            t0 = time.perf_counter()
            if role == "encoder":
                key = b.image_key(spec)
                result, enc_s = C.produce(client, key, spec.request_id, lambda: b.encode(spec))
                _sync(backend_name)
                conn.send(("ok", {"result": result, "encode_s": enc_s, "t": time.perf_counter() - t0}))
            elif role == "prefill":
                feats = None
                if spec.image_seed is not None:
                    feats = C.fetch(client, b.image_key(spec), device=None if backend_name == "synthetic" else "cuda")
                t1 = time.perf_counter()
                plen = b.prompt_len(spec)
                sink = C.EpdKvSink(client, "host0", layout, spec.request_id, plen, groups, ring=ring)
                first, delta = b.prefill(spec, feats, sink)
                _sync(backend_name)
                sink.done()
                pending.append(sink)
                conn.send(("ok", {"first": first, "delta": delta, "prompt_len": plen,
                                  "fetch_s": t1 - t0, "t": time.perf_counter() - t0,
                                  "sink_s": sink.seconds, "kv_bytes": sink.bytes_written}))
                # Release the handoffs the decode side has finished with.
                still = []
                for s in pending:
                    if s.handoff.finished(ring):
                        s.handoff.release(ring)
                    else:
                        still.append(s)
                pending = still
            elif role == "decode":
                info = msg[2]
                src = C.EpdKvSource(client, spec.request_id, layout, info["prompt_len"], ring=ring,
                                    device=None if backend_name == "synthetic" else "cuda", dtype=b.dtype)
                t1 = time.perf_counter()
                toks = b.decode(spec, src, info["prompt_len"], info["first"], info["delta"])
                _sync(backend_name)
                src.finish()
                conn.send(("ok", {"tokens": toks, "wait_s": src.wait_s, "accept_s": t1 - t0,
                                  "t": time.perf_counter() - t0}))
        for s in pending:
            try:
                s.handoff.release()
            except Exception:
                pass
        client.close()
        conn.send(("stopped", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _sync(backend_name: str):
    if backend_name != "synthetic":
        import torch
        torch.cuda.synchronize()


class Workers:
    """Starts the three worker processes and runs requests through them, pipelined: a
    request's decode overlaps the next one's prefill and encode."""

    def __init__(self, address: str, backend: str, group_size: int = 1, model_label: str = "qwen3-vl",
                 ring_entries: int = 1024):
        ctx = mp.get_context("spawn")
        self.procs, self.conns, self.locks = {}, {}, {}
        for role in ("encoder", "prefill", "decode"):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(role, address, backend, b, group_size, model_label, ring_entries), daemon=True)
            p.start()
            self.procs[role], self.conns[role], self.locks[role] = p, a, threading.Lock()
        for role, c in self.conns.items():
            msg = c.recv()
            if msg[0] != "ready":
                raise RuntimeError(f"{role} worker failed to start:\n{msg[1]}")

    def _call(self, role: str, *msg):
        with self.locks[role]:
            self.conns[role].send(msg)
            r = self.conns[role].recv()
        if r[0] != "ok":
            raise RuntimeError(f"{role} worker failed:\n{r[1]}")
        return r[1]

    def run_one(self, spec: Spec) -> dict:
        spec.submit_t = spec.submit_t or time.perf_counter()
        out = {"request_id": spec.request_id}
        if spec.image_seed is not None:
            out["encode"] = self._call("encoder", "encode", spec)
        out["prefill"] = self._call("prefill", "prefill", spec)
        out["ttft_s"] = time.perf_counter() - spec.submit_t
        out["decode"] = self._call("decode", "decode", spec, out["prefill"])
        out["latency_s"] = time.perf_counter() - spec.submit_t
        out["tokens"] = out["decode"]["tokens"]
        return out

    def run(self, specs: List[Spec], concurrency: int = 3) -> List[dict]:
        """Runs the requests with up to `concurrency` in flight (one thread each; a
        request's clock starts when a thread takes it)."""
        results: List[Optional[dict]] = [None] * len(specs)
        it = iter(enumerate(specs))
        lock = threading.Lock()
        errors = []

        def loop():
            while True:
                with lock:
                    nxt = next(it, None)
                if nxt is None:
                    return
                i, s = nxt
                try:
                    s.submit_t = time.perf_counter()
                    results[i] = self.run_one(s)
                except BaseException as e:  # reported by the caller
                    errors.append(e)
                    return

        threads = [threading.Thread(target=loop) for _ in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results

    def close(self):
        for role, c in self.conns.items():
            try:
                c.send(("stop",))
                c.recv()
            except Exception:
                pass
        for p in self.procs.values():
            p.join(10)
            if p.is_alive():
                p.kill()
