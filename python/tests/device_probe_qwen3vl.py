# SPDX-License-Identifier: LGPL-2.1-or-later
"""On a GPU machine: the model-side split (encoder -> prefill with injected features
and per-layer KV capture -> decode from a rebuilt cache) is token-exact against
colocated Hugging Face generate. No epd involved; bench/e2e runs the real thing."""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

from epd.workers import qwen3vl as q  # noqa: E402

name = sys.argv[1] if len(sys.argv) > 1 else "small"
m = q.build_model(name)
enc, pre, dec = q.Encoder(m), q.Prefill(m), q.Decode(m)
ok = 0
for i in range(4):
    req = q.make_request(m, image_seed=i % 2, text_seed=i, text_tokens=40 + 10 * i)
    t = time.time()
    base = q.colocated_generate(m, req, 16)
    t1 = time.time()
    b = enc.encode(req)
    kv = q.MemoryKv()
    first, delta = pre.prefill(req, b, kv)
    toks = dec.decode(kv, req.input_ids.shape[1], first, delta, 16)
    t2 = time.time()
    same = toks == base
    ok += same
    print(f"req {i}: prompt {req.input_ids.shape[1]} delta {delta} colocated {t1-t:.2f}s split {t2-t1:.2f}s "
          f"{'EXACT' if same else 'DIFF'} {base[:8]} {toks[:8]}", flush=True)
print(f"token-exact {ok}/4")
sys.exit(0 if ok == 4 else 1)
