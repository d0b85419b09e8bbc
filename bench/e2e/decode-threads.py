#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""The 8B-class config's greedy decode alone (the harness's _generate, the step the
split's decode worker and the colocated process both run), timed per token in this
process as its OpenMP setting leaves it: the worker processes start with
OMP_WAIT_POLICY=PASSIVE (docs/e2e.md), the colocated process with OpenMP's default.
run-device.sh's `overhead` step runs it under each setting, one process each,
alternating.

    decode-threads.py [--reps 5] [--prompt 1400] [--tokens 32] [--idle-contexts N]

--idle-contexts N first starts N processes that each open a CUDA context on the GPU,
take 1 GiB of it and wait (as the split's other workers and epdd sit beside its decode
at one request in flight), and ends them after.

Prints one line: the setting and the median time of a decode step (the model's forward
for one token and the argmax read back), over --reps decodes of --tokens tokens each
from a --prompt-token text prompt, after a warm-up."""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402


def _idle(conn):
    """A process that holds a CUDA context and 1 GiB of the GPU, doing nothing on it."""
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    conn.send("ready")
    conn.recv()
    del x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=1400)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--idle-contexts", type=int, default=0)
    a = ap.parse_args()

    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    idle = []
    for _ in range(a.idle_contexts):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_idle, args=(theirs,), daemon=True)
        p.start()
        idle.append((p, mine))
    for _, conn in idle:
        conn.recv()

    from transformers.cache_utils import DynamicCache
    from epd.workers import qwen3vl as q
    m = q.build_model("8b", "cuda")
    cfg = m.config.text_config
    g = torch.Generator(device="cpu").manual_seed(7)
    ids = torch.randint(1000, 30000, (1, a.prompt), generator=g).to("cuda")
    steps = []
    with torch.no_grad():
        for rep in range(1 + a.reps):
            cache = DynamicCache(config=cfg)
            out = m(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
            first = int(out.logits[0, -1].argmax())
            delta = int(out.rope_deltas.reshape(-1)[0]) if getattr(out, "rope_deltas", None) is not None else 0
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            toks = q._generate(m, cache, a.prompt, first, delta, a.tokens)
            torch.cuda.synchronize()
            if rep > 0:  # the first is the warm-up
                steps.append(1e3 * (time.perf_counter() - t0) / (len(toks) - 1))
    for p, conn in idle:
        conn.send("stop")
        p.join(30)
    setting = (f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')} "
               f"torch threads {torch.get_num_threads()}, {a.idle_contexts} idle CUDA contexts beside it")
    print(f"decode-threads: {setting}: {statistics.median(steps):.2f} ms a decode step (median of {a.reps} "
          f"decodes of {a.tokens} tokens after a {a.prompt}-token prompt; min {min(steps):.2f}, "
          f"max {max(steps):.2f}; {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
