# SPDX-License-Identifier: LGPL-2.1-or-later
"""Qwen3-VL split into Encoder, Prefill and Decode roles (transformers 5.x).

- The encoder runs the vision tower on an image's patches and returns a FeatureBundle:
  image embeddings, the DeepStack intermediate features, grid_thw.
- The prefill worker runs the language model's prefill with precomputed features (the
  vision tower is skipped: get_image_features is answered from the bundle), and hands
  each layer's K/V to a KvSink as the forward pass produces it (so a transfer can start
  while later layers still compute); it returns the first generated token.
- The decode worker rebuilds its KV cache from a KvSource and generates greedily.

Weights are random and deterministic (a seed): nothing is downloaded. Configs: `small`
for tests, `8b` for benchmarks (the Qwen3-VL-8B text settings)."""

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

# head_dim stays 128 in both: Qwen3-VL's interleaved M-RoPE sections are sized for it.
SMALL = dict(text=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=512, head_dim=128),
             vision=dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, out_hidden_size=256,
                         deepstack_visual_indexes=[1, 2, 3]))
EIGHT_B = dict(text=dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=12288, head_dim=128),
               vision=dict(out_hidden_size=4096))
CONFIGS = {"small": SMALL, "8b": EIGHT_B}
IMAGE_TOKEN_ID = [151655]  # set from the config by build_model


def build_model(name: str = "small", device: str = "cuda", seed: int = 0, dtype=torch.bfloat16):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    spec = CONFIGS[name]
    cfg = Qwen3VLConfig()
    for k, v in spec["text"].items():
        setattr(cfg.text_config, k, v)
    for k, v in spec["vision"].items():
        setattr(cfg.vision_config, k, v)
    cfg.text_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        m = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=dtype)
    m.eval()
    IMAGE_TOKEN_ID[0] = cfg.image_token_id
    return m


def keep_vision_tower(m):
    """Frees all of model m but its vision tower (the config stays): what an encoder
    process needs. The tower's weights are those build_model made with the whole model
    (the same seed, drawn in the same order), so features match the colocated model's;
    the 8B config's language model is ~16 GB of GPU memory an encoder never reads."""
    import gc
    m.model.language_model = None
    m.lm_head = None
    gc.collect()  # the modules refer to each other: freed by the collector
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return m


def tower_bytes(m) -> int:
    """The bytes of model m's vision tower's weights."""
    return sum(p.numel() * p.element_size() for p in m.model.visual.parameters())


class Request:
    """One image + text prompt, made deterministically from seeds (no processor). The
    pixels and their content key are made when first asked for: a prefill that reads the
    image's features from epd needs neither (its key comes with the request, computed
    once where the image is, as a serving frontend does)."""

    def __init__(self, input_ids: torch.Tensor, image_grid_thw: torch.Tensor, image_seed: int, image_px: int,
                 pixel_shape, device):
        self.input_ids = input_ids              # (1, L)
        self.image_grid_thw = image_grid_thw    # (1, 3)
        self._seed, self._px, self._shape, self._device = image_seed, image_px, pixel_shape, device
        self._pixels_cpu = self._pixels = self._key = None

    def _cpu(self) -> torch.Tensor:
        if self._pixels_cpu is None:
            g = torch.Generator(device="cpu").manual_seed(self._seed)
            self._pixels_cpu = torch.randn(*self._shape, generator=g).to(torch.bfloat16)
        return self._pixels_cpu

    @property
    def pixel_values(self) -> torch.Tensor:
        """(patches, C*T*P*P), bfloat16 on the device."""
        if self._pixels is None:
            self._pixels = self._cpu().to(self._device)
        return self._pixels

    @property
    def pixel_row(self) -> torch.Tensor:
        """One row of zeros shaped like the pixels: what the model's forward is given when
        the features come from elsewhere (it never reads them)."""
        return torch.zeros(1, self._shape[1], dtype=torch.bfloat16, device=self._device)

    @property
    def pixel_shape(self) -> tuple:
        """The pixels' shape, (patches, C*T*P*P): it fixes the vision tower's output shapes."""
        return tuple(self._shape)

    def synthesize(self) -> None:
        """Makes the image's pixels (on the CPU), as decoding a real image would."""
        self._cpu()

    @property
    def image_key(self) -> str:
        """The content key of the image: epd.feature.content_key of its pixels' bytes and
        size (chunks hashed in parallel)."""
        if self._key is None:
            from ..feature import content_key
            # The pixels' own buffer, not a copy of it (the same bytes, the same key).
            self._key = content_key(self._cpu().view(torch.int16).contiguous().numpy(), str(self._px).encode())
        return self._key

    @property
    def mm_token_type_ids(self) -> torch.Tensor:
        """1 where a token is an image placeholder (what the processor returns)."""
        return (self.input_ids == IMAGE_TOKEN_ID[0]).to(torch.int32)


def make_request(model, image_seed: int, text_seed: int, image_px: int = 448, text_tokens: int = 100,
                 device: str = "cuda") -> Request:
    cfg = model.config
    vc = cfg.vision_config
    ps, ms, tps = vc.patch_size, vc.spatial_merge_size, vc.temporal_patch_size
    gh = gw = image_px // ps
    grid = torch.tensor([[1, gh, gw]], device=device)
    n_img = gh * gw // (ms * ms)
    gt = torch.Generator(device="cpu").manual_seed(10_000 + text_seed)
    vocab = cfg.text_config.vocab_size
    text = torch.randint(1000, min(vocab, 20000), (text_tokens,), generator=gt).tolist()
    ids = [cfg.vision_start_token_id] + [cfg.image_token_id] * n_img + [cfg.vision_end_token_id] + text
    return Request(torch.tensor([ids], device=device), grid, image_seed, image_px,
                   (gh * gw, vc.in_channels * tps * ps * ps), device)


@dataclass
class FeatureBundle:
    embeds: torch.Tensor               # (n_image_tokens, hidden)
    deepstack: List[torch.Tensor]      # each (n_image_tokens, hidden)
    grid_thw: torch.Tensor             # (1, 3) int64

    def tensors(self) -> Dict[str, torch.Tensor]:
        d = {"embeds": self.embeds, "grid_thw": self.grid_thw}
        for i, t in enumerate(self.deepstack):
            d[f"deepstack.{i}"] = t
        return d

    @staticmethod
    def from_tensors(d: Dict[str, torch.Tensor]) -> "FeatureBundle":
        ds = [d[f"deepstack.{i}"] for i in range(sum(1 for k in d if k.startswith("deepstack.")))]
        return FeatureBundle(d["embeds"], ds, d["grid_thw"])


class Encoder:
    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def encode(self, req: Request) -> FeatureBundle:
        out = self.model.model.visual(req.pixel_values.type(self.model.model.visual.dtype),
                                      grid_thw=req.image_grid_thw, return_dict=True)
        return FeatureBundle(out.pooler_output, list(out.deepstack_features), req.image_grid_thw)


class KvSink:
    """Receives each layer's K/V, (1, kv_heads, seq, head_dim), as prefill makes it."""

    def layer(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError

    def done(self) -> None:
        pass


class KvSource:
    """Gives back each layer's K/V for the decode worker."""

    def layer(self, layer_idx: int):
        raise NotImplementedError


def _patched_image_features(bundle: FeatureBundle):
    """A get_image_features that answers from a FeatureBundle: the vision tower never runs."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    def get_image_features(pixel_values, image_grid_thw=None, **kwargs):
        n = (bundle.grid_thw.prod(-1) // 4).tolist()  # spatial_merge_size**2 == 4 in every Qwen3-VL
        return BaseModelOutputWithDeepstackFeatures(pooler_output=torch.split(bundle.embeds, n),
                                                     deepstack_features=bundle.deepstack)
    return get_image_features


def _sink_cache(sink: Optional[KvSink], config):
    """A DynamicCache that hands every layer's K/V to the sink right after it is computed
    (while .sink is set: loading a prefix into it does not)."""
    from transformers.cache_utils import DynamicCache

    class SinkCache(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
            if self.sink is not None:
                self.sink.layer(layer_idx, key_states, value_states)
            return out

    c = SinkCache(config=config)
    c.sink = sink
    return c


class Prefill:
    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def prefill(self, req: Request, bundle: FeatureBundle, sink: KvSink):
        """Returns (first token id, rope delta). The vision tower is not run."""
        inner = self.model.model
        saved = inner.get_image_features
        inner.get_image_features = _patched_image_features(bundle)
        try:
            cache = _sink_cache(sink, self.model.config.text_config)
            out = self.model(input_ids=req.input_ids, attention_mask=torch.ones_like(req.input_ids),
                             pixel_values=req.pixel_row, image_grid_thw=bundle.grid_thw,
                             mm_token_type_ids=req.mm_token_type_ids,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
        finally:
            inner.get_image_features = saved
        sink.done()
        first = int(out.logits[0, -1].argmax())
        return first, int(out.rope_deltas.reshape(-1)[0])


# What this process's greedy decode steps cost, summed: the host's time to issue a
# step's forward pass ("launch": Python, torch and the CUDA launches, the GPU running
# behind it) and its wait for the step's token ("wait": the GPU finishing the step). A
# caller takes the difference around its own decode (a launch-bound step shows a short
# wait; a step the GPU holds back, by other work on it or a slower kernel, a long one).
STEP_TIMING = {"steps": 0, "launch_s": 0.0, "wait_s": 0.0}


def step_timing_since(before: Dict[str, float]) -> Dict[str, float]:
    return {k: STEP_TIMING[k] - before[k] for k in STEP_TIMING}


class Decode:
    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def decode(self, source: KvSource, prompt_len: int, first_token: int, rope_delta: int,
               max_new_tokens: int) -> List[int]:
        from transformers.cache_utils import DynamicCache
        cfg = self.model.config.text_config
        cache = DynamicCache(config=cfg)
        for l in range(cfg.num_hidden_layers):
            k, v = source.layer(l)
            cache.update(k, v, l)
        with _maybe_profiled("decode"):
            return _generate(self.model, cache, prompt_len, first_token, rope_delta, max_new_tokens)


_PROFILED_CALLS: Dict[str, int] = {}
_PROFILES: List[tuple] = []  # (table path, torch profiler) of the calls profiled


@contextlib.contextmanager
def _maybe_profiled(what: str):
    """EPD_DECODE_PROFILE=DIR:N[,N...]: the Nth call (counted per process from 1) of
    `what` runs under torch's profiler; write_profiles() writes each one's operators'
    table to DIR/<what>-<pid>-<N>.txt (a benchmark's diagnosis; off unless set). The
    tables are made then, not at the call's end: making one takes seconds, which a
    worker serving requests does not have (its handoffs would time out meanwhile)."""
    spec = os.environ.get("EPD_DECODE_PROFILE", "")
    n = _PROFILED_CALLS[what] = _PROFILED_CALLS.get(what, 0) + 1
    where, _, at = spec.rpartition(":")
    if not where or str(n) not in at.split(","):
        yield
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        yield
    _PROFILES.append((os.path.join(where, f"{what}-{os.getpid()}-{n}.txt"), prof))


def write_profiles():
    """Writes the tables of the calls profiled so far (EPD_DECODE_PROFILE)."""
    while _PROFILES:
        path, prof = _PROFILES.pop(0)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        ka = prof.key_averages()
        with open(path, "w") as f:
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30))
            f.write("\n")
            f.write(ka.table(sort_by="self_device_time_total", row_limit=20))


def _generate(model, cache, prompt_len: int, first_token: int, rope_delta: int, max_new_tokens: int) -> List[int]:
    """Greedy decoding from a cache holding the prompt's KV (text positions: index + delta)."""
    dev = model.device
    tokens = [first_token]
    tok = torch.tensor([[first_token]], device=dev)
    clock = time.perf_counter
    launch = wait = 0.0
    for step in range(max_new_tokens - 1):
        t0 = clock()
        pos = prompt_len + step + rope_delta
        position_ids = torch.full((3, 1, 1), pos, device=dev, dtype=torch.long)
        out = model(input_ids=tok, past_key_values=cache, position_ids=position_ids, use_cache=True)
        t1 = clock()
        nxt = int(out.logits[0, -1].argmax())
        t2 = clock()
        launch += t1 - t0
        wait += t2 - t1
        tokens.append(nxt)
        tok = torch.tensor([[nxt]], device=dev)
    STEP_TIMING["steps"] += max(max_new_tokens - 1, 0)
    STEP_TIMING["launch_s"] += launch
    STEP_TIMING["wait_s"] += wait
    return tokens


def branch_suffix(model, text_seed: int, branch: int, n: int) -> List[int]:
    """The text a follow-up turn of an agent request adds (a tool's output), by seed."""
    g = torch.Generator(device="cpu").manual_seed(50_000 + 97 * text_seed + branch)
    vocab = model.config.text_config.vocab_size
    return torch.randint(1000, min(vocab, 20000), (n,), generator=g).tolist()


class Continue:
    """An agent branch's turn: the prompt's first `prefix_tokens` tokens have their KV
    already (shared pages of the first turn); the rest (text only) is computed on top of
    it, each layer's new K/V handed to `sink`, then generation goes on greedily."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def run(self, prefix: KvSource, prefix_tokens: int, input_ids: torch.Tensor, rope_delta: int,
            sink: Optional[KvSink], max_new_tokens: int) -> List[int]:
        cfg = self.model.config.text_config
        n = int(input_ids.shape[1])
        if not 0 < prefix_tokens < n:
            raise ValueError(f"prefix of {prefix_tokens} tokens for a prompt of {n}")
        if (input_ids[0, prefix_tokens:] == IMAGE_TOKEN_ID[0]).any():
            raise ValueError("the part to compute holds image tokens: the prefix must cover the image")
        cache = _sink_cache(None, cfg)
        for l in range(cfg.num_hidden_layers):
            k, v = prefix.layer(l)
            if k.shape[2] != prefix_tokens:
                raise ValueError(f"layer {l}: prefix KV of {k.shape[2]} tokens, expected {prefix_tokens}")
            cache.update(k, v, l)
        cache.sink = sink
        dev = self.model.device
        pos = torch.arange(prefix_tokens, n, device=dev, dtype=torch.long) + rope_delta
        out = self.model(input_ids=input_ids[:, prefix_tokens:], past_key_values=cache,
                         position_ids=pos.view(1, 1, -1).expand(3, 1, -1), use_cache=True, logits_to_keep=1)
        cache.sink = None
        if sink is not None:
            sink.done()
        first = int(out.logits[0, -1].argmax())
        return _generate(self.model, cache, n, first, rope_delta, max_new_tokens)


class PrefixKv(KvSource):
    """The first n tokens of another source's KV (an in-process prefix cache)."""

    def __init__(self, source: KvSource, n: int):
        self.source, self.n = source, n

    def layer(self, layer_idx: int):
        k, v = self.source.layer(layer_idx)
        return k[:, :, : self.n], v[:, :, : self.n]


@torch.no_grad()
def colocated_generate(model, req: Request, max_new_tokens: int) -> List[int]:
    """The baseline: the same model in one process, Hugging Face generate, greedy."""
    out = model.generate(input_ids=req.input_ids, attention_mask=torch.ones_like(req.input_ids),
                         pixel_values=req.pixel_values, image_grid_thw=req.image_grid_thw,
                         mm_token_type_ids=req.mm_token_type_ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, req.input_ids.shape[1]:].tolist()


class MemoryKv(KvSink, KvSource):
    """KV kept in memory (tests; the epd connector replaces it with pages)."""

    def __init__(self):
        self.layers = {}

    def layer(self, layer_idx, k=None, v=None):
        if k is None:
            return self.layers[layer_idx]
        self.layers[layer_idx] = (k.clone(), v.clone())
