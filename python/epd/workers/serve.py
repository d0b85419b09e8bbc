# SPDX-License-Identifier: LGPL-2.1-or-later
"""Worker processes (encoder, prefill, decode) and the proxy/load generator that drives
them through epdd. Requests are described by seeds, so every process rebuilds the same
inputs without shipping tensors between processes; everything that moves between roles
moves through epdd (features, KV pages, handoffs). Two backends:

- "synthetic": numpy tensors of a model's shapes (CI: no torch, no GPU);
- "qwen3vl": the real Hugging Face Qwen3-VL model (qwen3vl.py) on a GPU.

Layouts: how many encoder, prefill and decode processes ("1E1P1D", "1E1P2D", "2P2D";
without encoders the prefill workers run the vision tower themselves, still through the
feature cache), each on its own GPU (CUDA_VISIBLE_DEVICES per process, round robin over
`gpus`; with one GPU they all share GPU 0).

Agent requests (Spec.branches > 0): the first turn runs E -> P -> D as usual, but the
decode worker keeps the committed KV as the root of a workflow; each follow-up turn
forks a branch of it (a copy-on-write clone) and advances the branch with the first
turn's prompt plus the turn's new text: the branch's head shares the prompt's whole
pages, the decode worker computes only the rest on top of them, writes it into the
branch's own pages, and generates. The last turn releases the workflow.

Used by python/tests/test_workers.py (CI) and bench/e2e/run-device.sh (GPU)."""

import hashlib
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .. import Client
from .. import KvLayout
from . import connector as C
from . import hooks as H


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
    branches: int = 0      # agent request: follow-up turns, each on a branch forked from this turn's KV
    branch_tokens: int = 24  # new tokens each follow-up turn adds (a tool's output)
    image_key: str = ""    # the image's feature key, once the encoder has computed it


def request_id_of(i: int) -> str:
    return hashlib.sha256(f"req-{i}".encode()).hexdigest()[:32]


def parse_layout(layout: str) -> Dict[str, int]:
    """'1E1P2D' -> {'encoder': 1, 'prefill': 1, 'decode': 2}; E may be absent (0)."""
    import re
    m = re.fullmatch(r"(?:(\d+)E\+?)?(\d+)P\+?(\d+)D", layout.replace(" ", "").upper())
    if not m or int(m.group(2)) < 1 or int(m.group(3)) < 1:
        raise ValueError(f"layout {layout!r}: expected e.g. 1E1P1D, 1E+1P+2D or 2P2D")
    return {"encoder": int(m.group(1) or 0), "prefill": int(m.group(2)), "decode": int(m.group(3))}


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

    def image(self, spec: Spec) -> None:
        """The image before its key (nothing to make here: the key is of its seed)."""

    def image_key(self, spec: Spec) -> str:
        return spec.image_key or hashlib.sha256(f"synthetic-image-{spec.image_seed}{spec.cache_salt}".encode()).hexdigest()

    def feature_shape_key(self, spec: Spec):
        """What fixes the shapes of encode()'s output: here nothing (one shape)."""
        return "synthetic"

    def prompt_len(self, spec: Spec) -> int:
        return (self.n_image_tokens + 2 if spec.image_seed is not None else 0) + spec.text_tokens

    def encoder_inputs(self, spec: Spec) -> None:
        """What the tower needs whatever the cache says (nothing to upload here)."""

    def encode(self, spec: Spec) -> Dict[str, object]:
        # EPD_SYNTHETIC_ENCODE_MS: a vision tower that takes this long (tests of overlap).
        delay = float(os.environ.get("EPD_SYNTHETIC_ENCODE_MS", "0") or 0)
        if delay > 0:
            time.sleep(delay / 1e3)
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
        h = hashlib.sha256()
        for layer in range(self.layers):
            k, v = source.layer(layer)
            h.update(k.tobytes())
            h.update(v.tobytes())
        return self._tokens_of(h, first, spec.max_new_tokens)

    @staticmethod
    def _tokens_of(h, first: int, n: int) -> List[int]:
        d = h.digest()
        while len(d) < 2 * n:
            d += hashlib.sha256(d).digest()
        return ([first] + [int.from_bytes(d[i:i + 2], "little") for i in range(0, 2 * (n - 1), 2)])[:n]

    def tokens(self, spec: Spec) -> List[int]:
        """The prompt's token ids (image placeholders, then text), by seed."""
        img = [1] + [2] * self.n_image_tokens + [3] if spec.image_seed is not None else []
        rng = self.np.random.default_rng(10_000 + spec.text_seed)
        return img + [int(t) for t in rng.integers(1000, 20000, spec.text_tokens)]

    def branch_suffix(self, spec: Spec, branch: int) -> List[int]:
        rng = self.np.random.default_rng([50_000 + spec.text_seed, branch])
        return [int(t) for t in rng.integers(1000, 20000, spec.branch_tokens)]

    def branch_kv(self, spec: Spec, branch: int, layer: int, n_new: int, prefix_k):
        """Synthetic K/V of a branch's new tokens; depends on the prefix KV it sees."""
        np = self.np
        base = np.float16(float(prefix_k.astype(np.float32).sum()) % 7)
        rng = np.random.default_rng([spec.text_seed, 1000 + branch, layer])
        k = rng.standard_normal((1, self.kv_heads, n_new, self.head_dim)).astype(np.float16)
        return k, (k * 0.5 + base).astype(np.float16)

    def branch(self, spec: Spec, branch: int, kv, tokens: List[int], delta: int) -> List[int]:
        """A follow-up turn: reads the shared prefix, writes the new tokens' K/V into the
        branch's pages, then 'generates' from every KV byte of the branch read back."""
        n, P = len(tokens), kv.prefix_tokens
        for layer in range(self.layers):
            kp, _ = kv.read(layer, P)
            k, v = self.branch_kv(spec, branch, layer, n - P, kp)
            kv.write(layer, P, k, v)
        h = hashlib.sha256()
        for layer in range(self.layers):
            k, v = kv.read(layer, n)
            h.update(k.tobytes())
            h.update(v.tobytes())
        return self._tokens_of(h, tokens[-1] % 50000, spec.max_new_tokens)


class Qwen3VL:
    def __init__(self, name: str, device: str = "cuda", role: Optional[str] = None):
        from . import qwen3vl as q
        self.q = q
        self.model = q.build_model(name, device)
        if role == "encoder":  # it runs the vision tower only
            q.keep_vision_tower(self.model)
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

    def image(self, spec: Spec) -> None:
        if spec.image_seed is not None and not spec.image_key:
            self.request(spec).synthesize()

    def image_key(self, spec: Spec) -> str:
        return spec.image_key or self.request(spec).image_key + spec.cache_salt

    def feature_shape_key(self, spec: Spec):
        """What fixes the shapes of encode()'s output: the image's pixel shape (its grid)."""
        return ("qwen3vl",) + self.request(spec).pixel_shape

    def prompt_len(self, spec: Spec) -> int:
        return int(self.request(spec).input_ids.shape[1])

    def encoder_inputs(self, spec: Spec) -> None:
        """The pixels on the GPU (their upload, which encode() would do first): run while
        the feature cache's answer is on its way; on a hit they were not needed."""
        if spec.image_seed is not None:
            self.request(spec).pixel_values

    def encode(self, spec: Spec):
        b = self.q.Encoder(self.model).encode(self.request(spec))
        return b.tensors()

    def prefill(self, spec: Spec, feats, sink) -> tuple:
        bundle = self.q.FeatureBundle.from_tensors(feats)
        first, delta = self.q.Prefill(self.model).prefill(self.request(spec), bundle, sink)
        return first, delta

    def decode(self, spec: Spec, source, prompt_len, first, delta) -> List[int]:
        return self.q.Decode(self.model).decode(source, prompt_len, first, delta, spec.max_new_tokens)

    def tokens(self, spec: Spec) -> List[int]:
        return self.request(spec).input_ids[0].tolist()

    def branch_suffix(self, spec: Spec, branch: int) -> List[int]:
        return self.q.branch_suffix(self.model, spec.text_seed, branch, spec.branch_tokens)

    def branch(self, spec: Spec, branch: int, kv, tokens: List[int], delta: int) -> List[int]:
        import torch
        ids = torch.tensor([tokens], device=self.device)
        return self.q.Continue(self.model).run(kv, kv.prefix_tokens, ids, delta, kv, spec.max_new_tokens)


def make_backend(name: str, role: Optional[str] = None):
    """The backend a worker of `role` computes with (an encoder's real model keeps its
    vision tower only)."""
    if name == "synthetic":
        return Synthetic()
    return Qwen3VL(name, role=role)


def model_copies(layout: Dict[str, int]) -> Dict[str, int]:
    """What a layout's worker processes hold of the model: whole models (prefill and
    decode workers) and vision towers alone (encoder workers)."""
    return {"whole": layout["prefill"] + layout["decode"], "towers": layout["encoder"]}


# ------------------------------------------------------------------------------------
# Worker processes
# ------------------------------------------------------------------------------------

class _DecodeAgents:
    """The decode worker's agent requests: request id -> (workflow, prompt tokens, delta)."""

    def __init__(self, client, layout, backend, device, kv_arena: str = "host0"):
        from ..workflow import Workflow
        self.Workflow = Workflow
        self.client, self.layout, self.b, self.device, self.kv_arena = client, layout, backend, device, kv_arena
        self.live: Dict[str, tuple] = {}

    def root(self, spec: Spec, seq, prompt_len: int, delta: int) -> dict:
        """First turn done: its committed KV becomes branch 0 of a workflow."""
        tokens = self.b.tokens(spec)
        if len(tokens) != prompt_len:
            raise RuntimeError(f"{spec.request_id}: {len(tokens)} prompt tokens, KV of {prompt_len}")
        wf = self.Workflow.create(self.client, seq.path, tokens, arena=self.kv_arena)
        seq.release()  # the workflow holds its own clone
        self.live[spec.request_id] = (wf, tokens, delta)
        return {"workflow": wf.id}

    def branch(self, spec: Spec, idx: int) -> dict:
        """A follow-up turn: fork branch 0, advance it with the turn's tokens (the head
        shares the prompt's whole pages), compute the rest into the branch's own pages,
        generate."""
        t0 = time.perf_counter()
        wf, root_tokens, delta = self.live[spec.request_id]
        tokens = root_tokens + self.b.branch_suffix(spec, idx)
        nb, _ = wf.fork(0)
        step = wf.advance(nb, tokens)
        L = self.layout
        shared = step.prefix_blocks
        need = L.pages_for(len(tokens)) - shared
        if need <= 0:
            raise RuntimeError(f"{spec.request_id}: branch {idx} adds no token to compute")
        step.head.append(need)
        _, copied = step.head.prepare_write(shared, need)  # fresh pages: nothing to copy
        kv = C.EpdBranchKv(self.client, step.head, L, shared * L.tokens_per_block, arena=self.kv_arena,
                           device=self.device, dtype=self.b.dtype)
        t1 = time.perf_counter()
        toks = self.b.branch(spec, idx, kv, tokens, delta)
        _sync(self.device)
        return {"tokens": toks, "branch": nb, "forks": 1, "shared_pages": shared,
                "reused_tokens": shared * L.tokens_per_block, "computed_tokens": len(tokens) - kv.prefix_tokens,
                "prompt_len": len(tokens), "cow_copies": copied, "kv_read_bytes": kv.bytes_read,
                "kv_written_bytes": kv.bytes_written, "epd_s": (t1 - t0) + kv.seconds, "t": time.perf_counter() - t0}

    def end(self, spec: Spec) -> dict:
        wf, _, _ = self.live.pop(spec.request_id)
        n = len(wf.branches())
        wf.release()
        return {"branches": n}

    def close(self):
        for wf, _, _ in self.live.values():
            try:
                wf.release()
            except Exception:
                pass
        self.live.clear()


def _layer_name(layer: int) -> str:
    return f"model.language_model.layers.{layer}.self_attn"


class _SaveThrough:
    """The model's KV sink, through the KV connector's save_kv_layer / wait_for_save."""

    def __init__(self, kvc):
        self.kvc = kvc

    def layer(self, layer: int, k, v) -> None:
        self.kvc.save_kv_layer(_layer_name(layer), (k, v))

    def done(self) -> None:
        self.kvc.wait_for_save()


class _LoadThrough:
    """The model's KV source, through the KV connector's wait_for_layer_load."""

    def __init__(self, kvc, request_id: str):
        self.kvc, self.request_id = kvc, request_id

    def layer(self, layer: int):
        return self.kvc.wait_for_layer_load(_layer_name(layer))[self.request_id]


def _worker(role: str, address: str, backend_name: str, conn, group_size: int, model_label: str,
            ring_entries: int = 1024, kv_arena: str = "host0"):
    """One process: registers with epdd as `role`, then serves requests from the pipe."""
    try:
        b = make_backend(backend_name, role)
        device = None if backend_name == "synthetic" else "cuda"
        client = Client(address)
        elem = 2
        layout = C.KvPageLayout(b.layers, 16, b.kv_heads, b.head_dim, elem)
        kv = KvLayout(b.layers, 16, layout.k_bytes_per_token, layout.v_bytes_per_token, b.dtype)
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        # The physical GPU (this process sees it as cuda:0), as epdctl shows the worker.
        client.register(role, model_label, (f"cuda:{gpu}" if gpu else "cuda:0") if device else "cpu",
                        kv=kv if role in ("prefill", "decode") else None)
        ring = None
        if role in ("prefill", "decode"):
            from ..handoff import Ring
            ring = Ring(client, cq_entries=ring_entries)
        # The engine-facing hooks (vLLM's names): features through the EC connector, K/V
        # through the KV connector, the model's layers registered by name.
        ec = H.EpdEcConnector(client, device=device)
        kvc = None
        if role in ("prefill", "decode"):
            kvc = H.EpdKvConnector(client, layout, "producer" if role == "prefill" else "consumer",
                                   arena=kv_arena, group_size=group_size, ring=ring, device=device, dtype=b.dtype,
                                   background_setup=True)
            kvc.register_kv_caches({_layer_name(l): None for l in range(b.layers)})
        agents = _DecodeAgents(client, layout, b, device, kv_arena) if role == "decode" else None
        conn.send(("ready", {"pid": os.getpid(), "gpu": gpu, "worker": client.worker_path}))

        def encode_into_cache(spec, key, on_acquired=None):
            """The vision tower through the feature cache (it runs only on a miss):
            (hit|waited|produced, encode seconds)."""
            ec.save_caches({key: lambda: b.encode(spec)}, key, spec.request_id, shape_key=b.feature_shape_key(spec),
                           on_acquired=on_acquired, overlap=lambda: b.encoder_inputs(spec))
            _sync(device)
            return ec.last_save

        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            kind, spec = msg[0], msg[1]
            t0 = time.perf_counter()
            if kind == "encode":
                b.image(spec)  # the image, synthesized here (as decoding a real one)
                image_s = time.perf_counter() - t0
                key = b.image_key(spec)  # its content hash
                key_s = time.perf_counter() - t0
                # Asked to (msg[2]): the key goes back as soon as epdd has the feature (ready
                # or being produced here), so that the prefill starts while the tower runs;
                # the reply follows when the feature is published.
                announce = (lambda result: conn.send(("key", key))) if len(msg) > 2 and msg[2] else None
                result, enc_s = encode_into_cache(spec, key, announce)
                conn.send(("ok", {"result": result, "encode_s": enc_s, "key_s": key_s, "image_s": image_s,
                                  "key": key, "detail": ec.last_save_detail, "t": time.perf_counter() - t0}))
            elif kind == "prefill":
                feats, enc, key, detail = None, None, b.image_key(spec), {}
                if spec.image_seed is not None:
                    if msg[2]:  # no encoder process: this worker runs the vision tower (feature cache first)
                        result, enc_s = encode_into_cache(spec, key)
                        # Its produce's epd calls (Acquire, reserve, copies, Publish) are on
                        # this prefill's critical path: timed as an encoder's are.
                        enc = {"result": result, "encode_s": enc_s, "detail": ec.last_save_detail,
                               "t": time.perf_counter() - t0}
                    feats = {}
                    ec.bind_connector_metadata(H.EpdEcMetadata({spec.request_id: [key]}))
                    ec.start_load_caches(feats)
                    ec.clear_connector_metadata()
                    feats = feats[key]
                    detail = feats.timing
                t1 = time.perf_counter()
                feature_wait = detail.get("wait", 0.0)  # for the encoder still producing it: not epd's time
                plen = b.prompt_len(spec)  # the model's input (token ids on the GPU): its time, not epd's
                t1b = time.perf_counter()
                kvc.bind_connector_metadata(kvc.build_connector_meta(saves=[H.KvTransfer(spec.request_id, plen)]))
                t2 = time.perf_counter()
                s0 = dict(kvc.stats)
                first, delta = b.prefill(spec, feats, _SaveThrough(kvc))
                _sync(device)
                kvc.wait_for_save()
                kvc.clear_connector_metadata()
                t3 = time.perf_counter()
                sink = kvc.sink_of(spec.request_id)
                save_s = kvc.stats["save_s"] - s0["save_s"]
                out = {"first": first, "delta": delta, "prompt_len": plen,
                       "fetch_s": t1 - t0 - (enc["t"] if enc else 0.0) - feature_wait,
                       "feature_wait_s": feature_wait, "t": t3 - t0,
                       "fetch_detail": detail, "prepare_s": t2 - t1b, "sink_s": save_s,
                       "sink_wait_s": kvc.stats["save_wait_s"] - s0["save_wait_s"],
                       "compute_s": t3 - t2 - save_s + (t1b - t1), "kv_bytes": sink.bytes_written,
                       "sink_detail": {"write": sink.write_s, "write_gpu": sink.write_gpu_s,
                                       "host_hidden": sink.host_hidden_s,
                                       "mode": sink.save, "notice": sink.notice_s,
                                       "groups": sink.groups_sent, "setup": sink.setup_s,
                                       "setup_wait": sink.setup_wait_s}}
                if enc:
                    out["encode"] = enc
                conn.send(("ok", out))
                # The features' pins (views of a GPU feature arena: the model is done with
                # them; a Release on the bus, after the reply, not inside TTFT), and the
                # handoffs the decode side has finished with.
                ec.get_finished({spec.request_id})
                kvc.get_finished({spec.request_id})
            elif kind == "decode":
                info = msg[2]
                rid = spec.request_id
                kvc.bind_connector_metadata(kvc.build_connector_meta(
                    loads=[H.KvTransfer(rid, info["prompt_len"], keep=spec.branches > 0)]))
                s0 = dict(kvc.stats)
                kvc.start_load_kv()
                q = getattr(b, "q", None)  # the model's backend: its decode steps are timed
                steps0 = dict(q.STEP_TIMING) if q is not None else None
                t1 = time.perf_counter()
                toks = b.decode(spec, _LoadThrough(kvc, rid), info["prompt_len"], info["first"], info["delta"])
                _sync(device)
                t2 = time.perf_counter()
                kvc.clear_connector_metadata()
                at_once = kvc.source_of(rid).layers_at_once
                _, received = kvc.get_finished({rid})
                if not received or rid not in received:
                    raise RuntimeError(f"decode of {rid}: the model did not read every layer")
                seq = kvc.take_sequence(rid)
                out = {"tokens": toks, "wait_s": kvc.stats["wait_s"] - s0["wait_s"], "accept_s": t1 - t0,
                       "load_s": kvc.stats["load_s"] - s0["load_s"], "load_layers_at_once": at_once}
                t3 = time.perf_counter()
                if seq is not None:
                    out.update(agents.root(spec, seq, info["prompt_len"], info["delta"]))
                # The model's decoding (the KV loads included) and, for an agent request,
                # keeping its KV as a workflow's root: both inside the request's latency.
                out["decode_s"], out["root_s"] = t2 - t1, time.perf_counter() - t3
                if steps0 is not None:
                    out["steps"] = q.step_timing_since(steps0)
                out["t"] = time.perf_counter() - t0
                conn.send(("ok", out))
            elif kind == "branch":
                conn.send(("ok", agents.branch(spec, msg[2])))
            elif kind == "end":
                conn.send(("ok", agents.end(spec)))
        if agents:
            agents.close()
        if hasattr(b, "q"):
            b.q.write_profiles()  # EPD_DECODE_PROFILE's tables, if any
        if kvc:
            kvc.shutdown()
        ec.shutdown()
        client.close()
        conn.send(("stopped", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _sync(device):
    if device is not None:
        import torch
        torch.cuda.synchronize()


# How often _wait_ready looks whether a worker that has not answered yet still lives.
WORKER_LIVENESS_S = 0.5


def _exit_reason(exitcode: Optional[int]) -> str:
    """multiprocessing's exit code in words: "exit code 3", "killed by SIGKILL (-9)"."""
    if exitcode is None:
        return "still running, its pipe closed"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"killed by {name} (exit code {exitcode})"
    return f"exit code {exitcode}"


def _recv(w: "_Proc"):
    """The next message of worker w; EOFError once its process has ended with nothing
    more sent, also where its end of the pipe lives on in a process it started (no EOF
    on the pipe then)."""
    while not w.conn.poll(WORKER_LIVENESS_S):
        if not w.proc.is_alive():
            if w.conn.poll(0):  # what it sent before it ended
                break
            raise EOFError(f"{w.role} worker {w.index} ended")
    return w.conn.recv()


class _Proc:
    def __init__(self, role: str, index: int, proc, conn, gpu: Optional[int]):
        self.role, self.index, self.proc, self.conn, self.gpu = role, index, proc, conn, gpu
        self.lock = _FifoLock()
        self.busy = 0  # requests routed to it and not finished (routing: least busy)
        self.info: dict = {}


class _FifoLock:
    """A lock taken in the order it was asked for: a worker serves the requests routed to
    it first come, first served (threading.Lock wakes any waiter, so a prefill waiting for
    a feature still being encoded could go before one whose feature is ready)."""

    def __init__(self):
        self._c = threading.Condition()
        self._next = self._serving = 0

    def __enter__(self):
        with self._c:
            ticket = self._next
            self._next += 1
            while self._serving != ticket:
                self._c.wait()

    def __exit__(self, *exc):
        with self._c:
            self._serving += 1
            self._c.notify_all()


class Workers:
    """Starts the worker processes of a layout and runs requests through them,
    pipelined: a request's decode overlaps the next one's prefill and encode. Each
    request goes to the least busy worker of each role; an agent request's follow-up
    turns go to the decode worker that holds its workflow."""

    def __init__(self, address: str, backend: str, group_size: int = 1, model_label: str = "qwen3-vl",
                 layout: str = "1E1P1D", gpus: Optional[int] = None, ring_entries: int = 1024,
                 kv_arena: str = "host0"):
        ctx = mp.get_context("spawn")
        self.layout = parse_layout(layout)
        self.pools: Dict[str, List[_Proc]] = {r: [] for r in ("encoder", "prefill", "decode")}
        self.route_lock = threading.Lock()
        n = 0
        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        saved_omp = os.environ.get("OMP_WAIT_POLICY")
        # The workers share the host's cores with each other and with epdd: an OpenMP
        # thread of torch's that spins after each parallel region (OpenMP's default)
        # takes a core from the others' hot paths (measured on the H200 host: the
        # encoder's content key 2.1-4.1 ms spinning, 1.3 ms passive). Unless the caller
        # chose, the workers' threads sleep at once (the spawned child inherits it).
        if saved_omp is None:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        # A real model's encoder workers build the whole model (the seed's weights drawn
        # in order) and then free all but the vision tower: the others start once the
        # encoders are ready, so that the GPU never holds more whole models at once than
        # the layout keeps.
        try:
            for role in ("encoder", "prefill", "decode"):
                if role == "prefill":
                    self._wait_ready(self.pools["encoder"])
                for i in range(self.layout[role]):
                    gpu = n % gpus if gpus else None
                    n += 1
                    if gpu is not None:
                        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)  # the spawned child inherits it
                    a, b = ctx.Pipe()
                    p = ctx.Process(target=_worker, args=(role, address, backend, b, group_size, model_label,
                                                          ring_entries, kv_arena),
                                    daemon=True)
                    p.start()
                    # The child's end stays in the child alone: kept here, it would keep
                    # recv() from seeing EOF when the worker dies hard (a segfault, the
                    # OOM killer) during its model's load or a request.
                    b.close()
                    self.pools[role].append(_Proc(role, i, p, a, gpu))
        finally:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
            if saved_omp is None:
                os.environ.pop("OMP_WAIT_POLICY", None)
        self._wait_ready([w for w in self.procs() if not w.info])  # those not yet ready

    def _wait_ready(self, procs: List["_Proc"]) -> None:
        """Waits for each worker's "ready" (a model's load may take minutes: no timeout),
        watching that the process lives: one that dies without a word (killed by a
        signal, by the OOM killer, or exiting) is an error naming it and how it ended,
        not a wait for ever (its end of the pipe may live on in a process it started)."""
        for w in procs:
            try:
                msg = _recv(w)
            except (EOFError, OSError):  # it ended without a word
                msg = None
            if msg is not None and msg[0] != "ready":
                self.close()
                raise RuntimeError(f"{w.role} worker {w.index} failed to start:\n{msg[1]}")
            if msg is None:
                w.proc.join(5)  # how it ended, before close() kills what still runs
                reason = _exit_reason(w.proc.exitcode)
                self.close()
                raise RuntimeError(f"{w.role} worker {w.index} (pid {w.proc.pid}) died before it was ready: "
                                   f"{reason}")
            w.info = msg[1]

    def procs(self) -> List[_Proc]:
        return [w for pool in self.pools.values() for w in pool]

    def placement(self) -> List[dict]:
        """Where each worker process runs: role, index, GPU, pid."""
        return [{"role": w.role, "index": w.index, "gpu": w.gpu, "pid": w.info.get("pid")} for w in self.procs()]

    def _pick(self, role: str) -> _Proc:
        with self.route_lock:
            w = min(self.pools[role], key=lambda w: w.busy)
            w.busy += 1
            return w

    def _done(self, w: _Proc):
        with self.route_lock:
            w.busy -= 1

    def _call(self, w: _Proc, *msg):
        with w.lock:
            w.conn.send(msg)
            r = _recv(w)
        if r[0] != "ok":
            raise RuntimeError(f"{w.role} worker {w.index} failed:\n{r[1]}")
        return r[1]

    def _call_role(self, role: str, *msg):
        w = self._pick(role)
        try:
            return self._call(w, *msg)
        finally:
            self._done(w)

    def _encode_and_prefill(self, spec: Spec):
        """The encoder and the prefill overlapped: the encoder answers with the feature's
        key as soon as epdd has the feature (ready, or being produced by it), and the
        prefill starts then, on a thread: its Acquire, sequence and handoff Prepare run
        while the tower does, and it waits for the Publish (woken by epdd, no polling),
        not for the encoder's reply to come back through this process. (encode, prefill)
        replies; the encoder is free for the next request once it has replied."""
        we = self._pick("encoder")
        pre: dict = {}

        def prefill():
            try:
                pre["r"] = self._call_role("prefill", "prefill", spec, False)
            except BaseException as e:  # raised by the caller below
                pre["e"] = e

        th = None
        try:
            with we.lock:
                we.conn.send(("encode", spec, True))
                r = _recv(we)
                if r[0] == "key":
                    spec.image_key = r[1]  # the prefill reads the features by it
                    th = threading.Thread(target=prefill)
                    th.start()
                    r = _recv(we)
        finally:
            self._done(we)
        if th is not None:
            th.join()  # an encoder that failed after the key failed the feature: the prefill's wait ends
        if r[0] != "ok":
            raise RuntimeError(f"encoder worker {we.index} failed:\n{r[1]}")
        if th is None:
            raise RuntimeError(f"encoder worker {we.index} answered without the feature's key")
        if "e" in pre:
            raise pre["e"]
        return r[1], pre["r"]

    def run_one(self, spec: Spec) -> dict:
        spec.submit_t = spec.submit_t or time.perf_counter()
        out = {"request_id": spec.request_id}
        encoders = bool(self.pools["encoder"])
        if spec.image_seed is not None and encoders:
            out["encode"], out["prefill"] = self._encode_and_prefill(spec)
        else:
            out["prefill"] = self._call_role("prefill", "prefill", spec, not encoders)
        if "encode" in out["prefill"]:
            out["encode"] = out["prefill"]["encode"]
        out["ttft_s"] = time.perf_counter() - spec.submit_t
        # Process hops and queueing: the part of TTFT spent outside the workers' own work
        # (pipes, routing, waiting for a busy worker). The prefill's wait for its feature
        # overlaps the encoder's work.
        inside = (out["prefill"]["t"] - out["prefill"].get("feature_wait_s", 0.0)
                  + (out["encode"]["t"] if "encode" in out and encoders else 0.0))
        out["hops_s"] = max(0.0, out["ttft_s"] - inside)
        d = self._pick("decode")
        try:
            out["decode"] = self._call(d, "decode", spec, out["prefill"])
            out["latency_s"] = time.perf_counter() - spec.submit_t
            out["tokens"] = out["decode"]["tokens"]
            if spec.branches > 0:
                # A failed turn ends its worker (which releases everything it held).
                out["branches"] = []
                for i in range(spec.branches):
                    t0 = time.perf_counter()
                    r = self._call(d, "branch", spec, i)
                    r["latency_s"] = time.perf_counter() - t0
                    out["branches"].append(r)
                self._call(d, "end", spec)
        finally:
            self._done(d)
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
        for w in self.procs():
            try:
                w.conn.send(("stop",))
                _recv(w)
            except Exception:
                pass
        for w in self.procs():
            w.proc.join(10)
            if w.proc.is_alive():
                w.proc.kill()
