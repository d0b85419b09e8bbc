# SPDX-License-Identifier: LGPL-2.1-or-later
"""End to end: a Qwen3-VL model served Encoder -> Prefill -> Decode through epdd (worker
processes), against the same model colocated in one process without epd.

  python3 bench/e2e/e2e.py --address direct:/tmp/epd/bus --check small     # token-exact
  python3 bench/e2e/e2e.py --address direct:/tmp/epd/bus --bench 8b        # benchmark
  python3 bench/e2e/e2e.py ... --bench 8b --layout 1E1P2D --gpus 4         # one GPU per process

The request stream mixes images (some repeated: the feature cache hits) and agent
requests: every --agent-every'th request is an agent whose --branches follow-up turns
fork branches of its first turn's KV through a workflow (the decode worker reuses the
shared prefix pages and computes only the new tokens).

--check: every first turn's greedy tokens == Hugging Face generate in one process, and
every branch's tokens == the same model in one process continuing from its in-memory
KV of the first turn (the same computation without epd); the branch against a full
recompute of its prompt is reported too (bf16 rounding of a different computation may
flip a token there; it is not a gate).
--bench: repeated images with the feature cache, and the same requests with the cache
bypassed (every key unique: the vision tower always runs), side by side, against the
colocated baseline (one process) and, with --gpus N > 1 or --dp, the colocated
data-parallel baseline (N processes, one per GPU, requests dealt round robin; --dp-procs M:
M processes over the GPUs round robin, e.g. 2 on one GPU beside a layout with two
decode processes on it).
--layout: 1E1P1D, 1E1P2D, 2P2D, ... (no E: the prefill workers encode); --gpus N puts
each worker process on its own GPU, round robin (with one GPU all share GPU 0).

Gates (the exit status): every request and turn succeeds, token-exact (--check), no
handoff failure, rollback or ring fallback, no failed encode, no handoff, sequence,
workflow or feature handle left, nothing reserved, 0 retained KV pages after the run
(all read from epdctl). --backend synthetic runs the
disaggregated path with numpy tensors (no GPU), a smoke test of this driver."""

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from epd.workers import serve  # noqa: E402


def specs(n, images, text_tokens, max_new, salt="", first=0, agent_every=0, branches=2, branch_tokens=24):
    out = []
    for i in range(first, first + n):
        agent = agent_every > 0 and (i - first) % agent_every == agent_every - 1
        out.append(serve.Spec(serve.request_id_of(i) if not salt else serve.request_id_of(10_000 + i),
                              image_seed=i % images, text_seed=i, text_tokens=text_tokens + (i % 5) * 8,
                              max_new_tokens=max_new, cache_salt=f"{salt}{i}" if salt else "",
                              branches=branches if agent else 0, branch_tokens=branch_tokens + (i % 3) * 5))
    return out


def epdctl(args, *cmd):
    out = subprocess.run([args.epdctl, "-A", args.address, "--json", *cmd], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        return json.loads(out.stdout)
    except json.JSONDecodeError:
        return {"error": out.stderr.strip()}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def mean(xs):
    xs = list(xs)
    return statistics.mean(xs) if xs else float("nan")


def feature_delivery_s(r):
    """A prefill that waited for its feature (its Acquire found it being produced): from
    the encoder's Publish to the prefill awake (epdd reads the Publish, answers the
    prefill's Wait; one clock, CLOCK_MONOTONIC, in both processes). On the critical path,
    and epd's. A prefill that found the feature ready (it started after the Publish, as
    when it queued behind another request) has none: its start was late for other
    reasons, counted as queueing."""
    pub = ((r.get("encode") or {}).get("detail") or {}).get("publish_at")
    ff = r["prefill"].get("fetch_detail") or {}
    if pub is None or "woke_at" not in ff or not ff.get("waited", False):
        return 0.0
    return max(0.0, ff["woke_at"] - pub)


def prefill_fetch_critical_s(r):
    """The prefill's feature fetch on the critical path of TTFT: its calls (the Acquire,
    the views; not the wait for the encoder), less the Acquire when it then waited (the
    Acquire ran while the encoder's tower did: off the critical path), plus the Publish's
    delivery to it."""
    p = r["prefill"]
    ff = p.get("fetch_detail") or {}
    s = p["fetch_s"] - (ff.get("acquire", 0.0) if ff.get("waited", False) else 0.0)
    return max(0.0, s) + feature_delivery_s(r)


def sink_counted_s(r):
    """The prefill's KV sink, all of it: its host time (the writes' launches and the
    notices) and, for a write of every layer at the end, that copy's GPU time."""
    p = r["prefill"]
    return p["sink_s"] + (p.get("sink_detail") or {}).get("write_gpu", 0.0)


def sink_critical_s(r):
    """The KV sink on the critical path: as sink_counted_s(), less the host time it
    spent while the GPU was still on the model's work queued before its write (the
    write's start event not yet reached when the host was done: the GPU was the longer
    path, and the sink's host work added nothing to it)."""
    hidden = (r["prefill"].get("sink_detail") or {}).get("host_hidden", 0.0)
    return max(0.0, sink_counted_s(r) - hidden)


def prefill_compute_s(r):
    """The prefill's compute in the TTFT split: its window less the KV sink's host time
    (timed apart), and less the write's GPU time, which the sink's column counts (the
    wait for the save, inside the window, runs through it): each part counted once."""
    p = r["prefill"]
    return max(0.0, p["compute_s"] - (p.get("sink_detail") or {}).get("write_gpu", 0.0))


def summarize(name, results, wall):
    """One table row. Requests: first turns; turns: first turns + agent follow-ups."""
    ttft = [r["ttft_s"] for r in results]
    branches = [b for r in results for b in r.get("branches", [])]
    toks = sum(len(r["tokens"]) for r in results) + sum(len(b["tokens"]) for b in branches)
    row = {"config": name, "requests": len(results), "turns": len(results) + len(branches), "wall_s": wall,
           "rps": (len(results) + len(branches)) / wall, "tok_s": toks / wall,
           "ttft_mean_ms": 1e3 * mean(ttft), "ttft_p95_ms": 1e3 * pct(ttft, 95),
           "latency_mean_ms": 1e3 * mean(r["latency_s"] for r in results),
           "branch_latency_mean_ms": 1e3 * mean(b["latency_s"] for b in branches)}
    # The decode's steps after the first token (the split's: its KV loads included), per
    # token; the split's latency also holds an agent request's workflow root.
    dec = [(r["decode"] if "decode" in r else r) for r in results]
    if dec and all("decode_s" in d for d in dec):
        row["decode_ms_per_token"] = 1e3 * mean(d["decode_s"] / max(len(r["tokens"]) - 1, 1)
                                                for d, r in zip(dec, results))
        row["workflow_root_ms"] = 1e3 * mean(d.get("root_s", 0.0) for d in dec)
    # The steps in two parts: the host issuing the forward pass, the wait for its token.
    steps = [d["steps"] for d in dec if d.get("steps", {}).get("steps")]
    if steps:
        n = sum(st["steps"] for st in steps)
        row["step_launch_ms"] = 1e3 * sum(st["launch_s"] for st in steps) / n
        row["step_wait_ms"] = 1e3 * sum(st["wait_s"] for st in steps) / n
    if results and "prefill" in results[0]:
        row["exposed_transfer_ms"] = 1e3 * mean(r["decode"]["wait_s"] for r in results)
        # epd's part of TTFT: its calls and copies on the critical path (feature fetch,
        # sequence + Prepare, the KV sink's writes and notices; a sink that writes every
        # layer at the end also its copy's GPU time, which runs after the forward pass).
        # And the encoder's: its Acquire (a hit's only call), and when it produced, the
        # reserve, the copies into the arena and sending Publish + Release (not the vision
        # tower, nor waiting for it). The prefill's feature fetch is its Acquire and views,
        # and when it waited for the encoder, its views and the Publish's delivery to it
        # (prefill_fetch_critical_s(): its Acquire then ran while the tower did), not the
        # wait for the tower. The KV sink's host time counts unless it ran while the GPU
        # was still on the model's work (sink_critical_s()); the figure with all of it
        # counted is kept beside (epd_share_of_ttft_host_counted), and the prefill's part
        # alone (the figure of runs before the encoder's was counted).
        def enc_epd(r):
            d = (r.get("encode") or {}).get("detail") or {}
            return sum(d.get(k, 0.0) for k in ("acquire", "reserve", "copy", "publish"))

        def pre_epd(r, sink=sink_critical_s):
            return prefill_fetch_critical_s(r) + r["prefill"]["prepare_s"] + sink(r)
        row["epd_share_of_ttft"] = mean((pre_epd(r) + enc_epd(r)) / r["ttft_s"] for r in results)
        row["epd_share_of_ttft_host_counted"] = mean((pre_epd(r, sink_counted_s) + enc_epd(r)) / r["ttft_s"]
                                                     for r in results)
        row["epd_share_of_ttft_prefill_only"] = mean(pre_epd(r) / r["ttft_s"] for r in results)
        row["encoder_epd_critical_ms"] = 1e3 * mean(enc_epd(r) for r in results)
        enc = [r["encode"]["t"] for r in results if "encode" in r]
        row["split_ms"] = {
            "encoder": 1e3 * mean(enc) if enc else 0.0,
            "feature_fetch": 1e3 * mean(prefill_fetch_critical_s(r) for r in results),
            "prepare": 1e3 * mean(r["prefill"]["prepare_s"] for r in results),
            "prefill_compute": 1e3 * mean(prefill_compute_s(r) for r in results),
            "kv_sink": 1e3 * mean(sink_critical_s(r) for r in results),
            "kv_sink_wait": 1e3 * mean(r["prefill"].get("sink_wait_s", 0.0) for r in results),
            "hops_and_queue": 1e3 * mean(r["hops_s"] for r in results),
            "decode_accept_wait": 1e3 * mean(r["decode"]["accept_s"] for r in results),
            "handoff_exposed": 1e3 * mean(r["decode"]["wait_s"] for r in results),
            "decode_kv_load": 1e3 * mean(r["decode"]["load_s"] for r in results),
        }
        # The feature fetch's parts: the bus call, the wait for the producer, the read.
        parts = [r["prefill"].get("fetch_detail") or {} for r in results]
        row["feature_fetch_ms"] = {k: 1e3 * mean(p.get(k, 0.0) for p in parts)
                                   for k in ("acquire", "wait", "read")}
        row["feature_fetch_ms"]["publish_to_woken"] = 1e3 * mean(feature_delivery_s(r) for r in results)
        # The Acquire's spread: a mean of ms can be one slow call or all of them.
        acq = [1e3 * p["acquire"] for p in parts if "acquire" in p]
        row["feature_fetch_ms"].update(acquire_p50=pct(acq, 50), acquire_p95=pct(acq, 95),
                                       acquire_max=max(acq) if acq else float("nan"))
        # The KV sink's parts: the writes (one launch per layer) and the groups' events
        # and ready notices.
        sparts = [r["prefill"].get("sink_detail") or {} for r in results]
        row["kv_sink_ms"] = {k: 1e3 * mean(p.get(k, 0.0) for p in sparts)
                             for k in ("write", "write_gpu", "host_hidden", "notice", "setup", "setup_wait")}
        row["kv_sink_mode"] = ",".join(sorted({p.get("mode", "layer") for p in sparts}))
        row["decode_layers_in_one_launch"] = mean(r["decode"].get("load_layers_at_once", 0) for r in results)
        # The encoder's time outside the image, its key and the produce (the tower, the
        # reserve, the copies, Publish + Release sent): the Acquire and the pipe's turn.
        encs = [r["encode"] for r in results if r.get("encode", {}).get("result") == "produced"]
        row["encoder_epd_ms"] = (1e3 * mean(e["t"] - e["encode_s"] - e.get("key_s", 0.0) for e in encs)
                                 if encs else 0.0)
        row["encoder_key_ms"] = 1e3 * mean(e.get("key_s", 0.0) for e in encs) if encs else 0.0
        row["encoder_image_ms"] = 1e3 * mean(e.get("image_s", 0.0) for e in encs) if encs else 0.0
        row["encoder_tower_ms"] = 1e3 * mean(e["encode_s"] for e in encs) if encs else 0.0
        # The tower's produce in parts: the Acquire's exposed part, the work done while it
        # was on its way (the pixels' upload: "overlap"), the host until the tower's
        # launches returned, the reserve, the copies queued, the wait for the GPU; the
        # GPU's own time for the tower and for the copies (CUDA events).
        dets = [e.get("detail") or {} for e in encs]
        row["encoder_produce_ms"] = {k: 1e3 * mean(d[k] for d in dets if k in d)
                                     for k in ("acquire", "overlap", "fn", "reserve", "copy", "sync", "publish",
                                               "fn_gpu", "copy_gpu")
                                     if any(k in d for d in dets)}
        row["kv_sink_ms"]["groups"] = mean(p.get("groups", 0) for p in sparts)
        row["kv_bytes"] = sum(r["prefill"]["kv_bytes"] for r in results)
        row["encoder_hits"] = sum(1 for r in results if r.get("encode", {}).get("result") == "hit")
        row["encoder_runs"] = sum(1 for r in results if r.get("encode", {}).get("result") == "produced")
        row["workflow"] = {
            "workflows": sum(1 for r in results if r.get("branches")),
            "forks": sum(b["forks"] for b in branches),
            "shared_pages": sum(b["shared_pages"] for b in branches),
            "reused_prefix_tokens": sum(b["reused_tokens"] for b in branches),
            "computed_tokens": sum(b["computed_tokens"] for b in branches),
            "cow_copies": sum(b["cow_copies"] for b in branches),
            "branch_epd_ms": 1e3 * mean(b["epd_s"] for b in branches),
        }
    return row


def colocated(model_name, reqs, device="cuda", m=None):
    """The same model in one process, no epd: vision tower, prefill, decode, and each
    agent follow-up continuing from the first turn's KV kept in memory; in turn."""
    import torch
    from epd.workers import qwen3vl as q
    m = m if m is not None else q.build_model(model_name, device)
    enc, pre, dec, cont = q.Encoder(m), q.Prefill(m), q.Decode(m), q.Continue(m)
    out = []
    t_all = time.perf_counter()
    for s in reqs:
        t0 = time.perf_counter()
        r = q.make_request(m, s.image_seed, s.text_seed, text_tokens=s.text_tokens, device=device)
        kv = q.MemoryKv()
        r.synthesize()  # the image's pixels (made on first use anyway): timed apart, as the split's "image"
        torch.cuda.synchronize()
        ti = time.perf_counter()
        feats = enc.encode(r)
        torch.cuda.synchronize()
        te = time.perf_counter()
        first, delta = pre.prefill(r, feats, kv)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        steps0 = dict(q.STEP_TIMING)
        toks = dec.decode(kv, r.input_ids.shape[1], first, delta, s.max_new_tokens)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        res = {"ttft_s": t1 - t0, "latency_s": t2 - t0, "tokens": toks, "decode_s": t2 - t1,
               "steps": q.step_timing_since(steps0),
               "encode_s": te - t0, "image_s": ti - t0, "tower_s": te - ti, "prefill_s": t1 - te}
        if s.branches:
            n = int(r.input_ids.shape[1])
            P = n // 16 * 16
            res["branches"] = []
            for i in range(s.branches):
                tb = time.perf_counter()
                ids = torch.cat([r.input_ids, torch.tensor([q.branch_suffix(m, s.text_seed, i, s.branch_tokens)],
                                                           device=r.input_ids.device)], dim=1)
                bt = cont.run(q.PrefixKv(kv, P), P, ids, delta, None, s.max_new_tokens)
                torch.cuda.synchronize()
                res["branches"].append({"tokens": bt, "latency_s": time.perf_counter() - tb, "ids": ids})
        out.append(res)
    return out, time.perf_counter() - t_all, m


def _dp_worker(gpu, model_name, reqs, warm, conn):
    """One replica of the data-parallel baseline, alone on its GPU."""
    try:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
        _, _, m = colocated(model_name, warm, "cuda")  # builds this replica's model; warm-up
        conn.send(("ready", None))
        conn.recv()
        res, wall, _ = colocated(model_name, reqs, "cuda", m)
        for r in res:
            for b in r.get("branches", []):
                b.pop("ids", None)
        conn.send(("ok", res))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def warm_specs(args, n, salt="warm", first=0):
    """Warm-up requests: every one an agent request when the mix has agents, so that the
    branch path (a prefill on top of cached KV) is warm too."""
    return specs(n, args.images, args.text_tokens, args.max_new, salt=salt, first=first,
                 agent_every=1 if args.agent_every else 0, branches=args.branches, branch_tokens=args.branch_tokens)


def colocated_dp(model_name, reqs, gpus, warm, n_procs=None):
    """Colocated data parallel: `n_procs` processes (default: one per GPU) over `gpus` GPUs
    round robin, requests dealt round robin; the clock runs from the common start to the
    last replica's end."""
    ctx = mp.get_context("spawn")
    n_procs = n_procs or gpus
    shares = [reqs[i::n_procs] for i in range(n_procs)]
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    procs, conns = [], []
    try:
        for i in range(n_procs):
            g = i % gpus
            os.environ["CUDA_VISIBLE_DEVICES"] = str(g)
            a, b = ctx.Pipe()
            p = ctx.Process(target=_dp_worker, args=(g, model_name, shares[i], warm, b), daemon=True)
            p.start()
            procs.append(p)
            conns.append(a)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    for c in conns:
        msg = c.recv()
        if msg[0] != "ready":
            raise RuntimeError(f"data-parallel replica failed:\n{msg[1]}")
    t0 = time.perf_counter()
    for c in conns:
        c.send("go")
    out = []
    for c in conns:
        msg = c.recv()
        if msg[0] != "ok":
            raise RuntimeError(f"data-parallel replica failed:\n{msg[1]}")
        out += msg[1]
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    return out, wall


def workers(args):
    return serve.Workers(args.address, args.model, layout=args.layout, gpus=args.gpus, kv_arena=args.kv_arena)


def check(args):
    """Token-exact: disaggregated greedy output == colocated, every request and branch."""
    reqs = specs(args.requests, images=3, text_tokens=40, max_new=args.max_new, agent_every=args.agent_every,
                 branches=args.branches, branch_tokens=args.branch_tokens)
    w = workers(args)
    try:
        placement = w.placement()
        res = w.run(reqs, concurrency=args.concurrency)
    finally:
        w.close()
    out = {"requests": len(reqs), "turns": len(reqs) + sum(s.branches for s in reqs), "layout": args.layout,
           "placement": placement, "completed": sum(1 for r in res if r is not None)}
    out["workflow"] = summarize("check", res, 1.0).get("workflow")
    if args.backend == "synthetic":
        out["token_exact"], out["branch_exact"] = len(reqs), sum(s.branches for s in reqs)
        return out
    from epd.workers import qwen3vl as q
    base, _, m = colocated(args.model, reqs)
    exact = bexact = brecompute = 0
    for s, r, b in zip(reqs, res, base):
        ref = q.colocated_generate(m, q.make_request(m, s.image_seed, s.text_seed, text_tokens=s.text_tokens),
                                   s.max_new_tokens)
        same = ref == r["tokens"] and b["tokens"] == ref
        exact += same
        line = (f"  {s.request_id[:8]} image {s.image_seed} prompt {r['prefill']['prompt_len']:4d} "
                f"encoder {r['encode']['result']:8s} {'EXACT' if same else 'DIFF ' + str(ref[:6]) + ' ' + str(r['tokens'][:6])}")
        print(line, flush=True)
        for i, (rb, bb) in enumerate(zip(r.get("branches", []), b.get("branches", []))):
            same_b = rb["tokens"] == bb["tokens"]
            bexact += same_b
            req = q.make_request(m, s.image_seed, s.text_seed, text_tokens=s.text_tokens)
            req.input_ids = bb["ids"]
            full = q.colocated_generate(m, req, s.max_new_tokens)
            brecompute += full == rb["tokens"]
            print(f"      branch {rb['branch']}: prompt {rb['prompt_len']} shared pages {rb['shared_pages']} "
                  f"computed {rb['computed_tokens']} tokens "
                  f"{'EXACT' if same_b else 'DIFF ' + str(bb['tokens'][:6]) + ' ' + str(rb['tokens'][:6])}"
                  f" (vs full recompute: {'same' if full == rb['tokens'] else 'differs'})", flush=True)
    out.update(token_exact=exact, branch_exact=bexact, branch_same_as_full_recompute=brecompute)
    return out


def bench(args):
    rows = []
    n = args.requests
    kw = dict(agent_every=args.agent_every, branches=args.branches, branch_tokens=args.branch_tokens)
    # At least one warm-up request per worker process of a role (least-busy routing
    # spreads them), so that no process meets its first request in a measured row.
    warm = max([args.warmup] + list(serve.parse_layout(args.layout).values()))
    # The colocated baseline runs its requests once before the split's rows and once
    # after (its model kept meanwhile), and its row holds both: the host's speed drifts
    # within minutes on these machines (the decode step, launch-bound, by up to a third),
    # and a baseline measured only before or after the split would carry that drift
    # into the ratio. The row shows each pass apart.
    base_reqs = specs(n, args.images, args.text_tokens, args.max_new, first=100, **kw)
    base = []
    m = None
    # The data-parallel baseline (several colocated processes) likewise, a pass before
    # the split's rows and one after.
    dp_procs = (args.dp_procs or args.gpus) if args.gpus and (args.gpus > 1 or args.dp or args.dp_procs) else 0
    base_dp = []

    def dp_pass():
        base_dp.append(colocated_dp(args.model, base_reqs, args.gpus, warm_specs(args, 1, salt="", first=900),
                                    dp_procs))

    if args.backend != "synthetic":
        _, _, m = colocated(args.model, warm_specs(args, 2, salt="", first=900))  # warm-up
        res, wall = colocated(args.model, base_reqs, m=m)[:2]  # no second reference to the model
        base.append((res, wall))
        if dp_procs:
            dp_pass()
    # The worker processes each hold a model of their own beside this one (an encoder its
    # vision tower alone); where the GPU cannot hold them all (the 8B config in 1E1P2D:
    # four whole copies with this one, and epdd's arenas, need more than an 80 GB card),
    # the baseline's model is freed while the split's rows run and built
    # again after them (the same seed: the same weights), then warmed up again.
    rebuilt = False
    if m is not None and not _fits_beside(m, serve.model_copies(serve.parse_layout(args.layout))):
        import gc
        import torch
        del m
        m = None
        gc.collect()  # the model's modules refer to each other: freed by the collector
        torch.cuda.empty_cache()
        rebuilt = True
        print(f"the baseline's model freed while the split runs (GPU memory held here now: "
              f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB)", flush=True)
    w = workers(args)
    try:
        placement = w.placement()
        w.run(warm_specs(args, warm), max(args.concurrency, warm))
        # The same requests: repeated images with the feature cache, then with every key
        # unique (the cache bypassed: the vision tower runs for every request), several in
        # flight; and bypassed one at a time, the colocated baseline's own shape (its TTFT
        # compares like for like).
        c = args.concurrency
        for name, salt, conc in ((f"EPD {args.layout}, repeated images, feature cache, {c} in flight", "", c),
                                 (f"EPD {args.layout}, repeated images, cache bypassed, {c} in flight", "nocache", c),
                                 (f"EPD {args.layout}, repeated images, cache bypassed, 1 in flight", "serial", 1)):
            reqs = specs(n, args.images, args.text_tokens, args.max_new, salt=salt, first=100, **kw)
            f0, st0 = epdctl(args, "features"), epdctl(args, "status")
            t0 = time.perf_counter()
            res = w.run(reqs, conc)
            rows.append(summarize(name, res, time.perf_counter() - t0))
            rows[-1]["completed"] = sum(1 for r in res if r is not None)
            rows[-1]["feature_counters"] = feature_delta(f0, epdctl(args, "features"))
            # The daemon's event loop: dispatches that held it 1 ms or longer in this row,
            # and the longest since it started (what it was).
            st1 = epdctl(args, "status")
            rows[-1]["loop_stalls"] = {"count": st1["loop_stalls"] - st0["loop_stalls"],
                                       "longest_ms_so_far": st1["loop_stall_max_usec"] / 1e3,
                                       "longest_what": st1["loop_stall_max_what"]}
            print(json.dumps(rows[-1]), flush=True)
    finally:
        w.close()
    reqs = base_reqs
    if args.backend != "synthetic":
        if m is None:
            _, _, m = colocated(args.model, warm_specs(args, 2, salt="", first=900))  # rebuilt; warm-up
        res, wall, _ = colocated(args.model, reqs, m=m)
        base.append((res, wall))
        del m
        from epd.workers import qwen3vl as q
        q.write_profiles()  # EPD_DECODE_PROFILE's tables, if any
        res = [r for rs, _ in base for r in rs]
        rows.append(summarize("colocated, 1 process, no epd", res, sum(wl for _, wl in base)))
        rows[-1]["passes"] = [{k: v for k, v in summarize(when, rs, wl).items()
                               if k in ("config", "rps", "ttft_mean_ms", "decode_ms_per_token", "step_launch_ms",
                                        "step_wait_ms")}
                              for when, (rs, wl) in zip(("before the split's rows", "after them"), base)]
        rows[-1]["baseline_model_rebuilt"] = rebuilt
        rows[-1]["split_ms"] = {"encoder": 1e3 * mean(r["encode_s"] for r in res),
                                "prefill_compute": 1e3 * mean(r["prefill_s"] for r in res)}
        rows[-1]["encoder_image_ms"] = 1e3 * mean(r["image_s"] for r in res)
        rows[-1]["encoder_tower_ms"] = 1e3 * mean(r["tower_s"] for r in res)
        print(json.dumps(rows[-1]), flush=True)
        if dp_procs:
            dp_pass()
            res = [r for rs, _ in base_dp for r in rs]
            rows.append(summarize(f"colocated data-parallel, {dp_procs} processes on {args.gpus} GPU(s), no epd",
                                  res, sum(wl for _, wl in base_dp)))
            rows[-1]["passes"] = [{k: v for k, v in summarize(when, rs, wl).items()
                                   if k in ("config", "rps", "ttft_mean_ms", "decode_ms_per_token", "step_launch_ms",
                                            "step_wait_ms")}
                                  for when, (rs, wl) in zip(("before the split's rows", "after them"), base_dp)]
            print(json.dumps(rows[-1]), flush=True)
    return rows, placement


def _fits_beside(m, copies) -> bool:
    """Whether the GPU's free memory holds the workers' copies of model m beside it
    (serve.model_copies: whole models, and encoders' vision towers alone), with an
    eighth to spare for activations and caches."""
    import torch
    from epd.workers import qwen3vl as q
    size = copies["whole"] * sum(p.numel() * p.element_size() for p in m.parameters()) \
        + copies["towers"] * q.tower_bytes(m)
    free, _ = torch.cuda.mem_get_info()
    fits = free >= size * 9 // 8
    print(f"GPU memory free {free / 2**30:.1f} GiB; the workers' models ({copies['whole']} whole, "
          f"{copies['towers']} vision towers alone) {size / 2**30:.1f} GiB: "
          f"{'fits' if fits else 'does not fit'} beside the baseline's", flush=True)
    return fits


def feature_delta(before, after):
    """Counters of the feature cache that moved during a run."""
    def flat(d, pre=""):
        out = {}
        for k, v in (d.items() if isinstance(d, dict) else []):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[pre + k] = v
            elif isinstance(v, dict):
                out.update(flat(v, pre + k + "."))
        return out
    a, b = flat(before), flat(after)
    return {k: b[k] - a.get(k, 0) for k in b if b[k] != a.get(k, 0)}


def gates(args, out):
    """Reads the daemon's state after the run; returns (ok, line)."""
    pools = epdctl(args, "pages")
    hand = epdctl(args, "handoffs")
    seqs = epdctl(args, "sequences")
    journal = epdctl(args, "journal")
    feats = epdctl(args, "features")
    out["pages"], out["handoffs"], out["journal"], out["features"] = pools, hand, journal, feats
    kv = [p for p in pools.get("pools", []) if p.get("arena") == args.kv_arena] if isinstance(pools, dict) else []
    retained = kv[0]["total"] - kv[0]["free"] if kv else None
    counters = hand.get("counters", {}) if isinstance(hand, dict) else {}
    failures = sum(v for k, v in counters.items() if k.startswith("failures.")) + counters.get("rolled-back", 0)
    left = len(hand.get("handoffs", [])) if isinstance(hand, dict) else None
    n_seqs = len(seqs) if isinstance(seqs, list) else None
    wfs = journal.get("workflows") if isinstance(journal, dict) else None
    # Features: no handle held, nothing reserved, no failed encode.
    f_handles = feats.get("handles") if isinstance(feats, dict) else None
    f_reserved = feats.get("bytes_reserved") if isinstance(feats, dict) else None
    f_failed = feats.get("failed") if isinstance(feats, dict) else None
    out.update(retained_pages=retained, failures=failures, fallbacks=counters.get("ring-fallbacks", 0),
               handoffs_left=left, sequences_left=n_seqs, workflows_left=wfs, feature_handles_left=f_handles,
               feature_bytes_reserved=f_reserved, feature_failures=f_failed)
    ok = (retained == 0 and failures == 0 and out["fallbacks"] == 0 and left == 0 and n_seqs == 0
          and wfs == 0 and f_handles == 0 and f_reserved == 0 and f_failed == 0)
    line = (f"retained pages {retained}, handoffs left {left}, sequences left {n_seqs}, workflows left {wfs}, "
            f"feature handles left {f_handles}, feature bytes reserved {f_reserved}, "
            f"failures {failures} (features {f_failed}), ring fallbacks {out['fallbacks']}")
    return ok, line


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--epdctl", default="epdctl")
    ap.add_argument("--check", metavar="MODEL")
    ap.add_argument("--bench", metavar="MODEL")
    ap.add_argument("--backend", default="qwen3vl")
    ap.add_argument("--layout", default="1E1P1D", help="worker processes: 1E1P1D, 1E1P2D, 2P2D, ...")
    ap.add_argument("--gpus", type=int, default=None,
                    help="GPUs: one per worker process, round robin (default: leave CUDA_VISIBLE_DEVICES alone)")
    ap.add_argument("--dp", action="store_true", help="also the data-parallel baseline with --gpus 1")
    ap.add_argument("--dp-procs", type=int, default=0,
                    help="the data-parallel baseline with this many processes over the GPUs (default: one per GPU)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=100)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--agent-every", type=int, default=3, help="every Nth request is an agent request (0: none)")
    ap.add_argument("--branches", type=int, default=2, help="follow-up turns (branches) per agent request")
    ap.add_argument("--branch-tokens", type=int, default=24, help="new tokens per follow-up turn")
    ap.add_argument("--kv-arena", default="host0", help="the KV arena of the workers (a GPU arena: KV stays on the GPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    serve.parse_layout(args.layout)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layout": args.layout, "gpus": args.gpus,
           "argv": sys.argv[1:]}
    ok = True
    try:
        if args.check:
            args.model = args.check if args.backend != "synthetic" else "synthetic"
            c = out["check"] = check(args)
            n_branch = c["turns"] - c["requests"]
            ok &= c["completed"] == c["requests"]
            ok &= c["token_exact"] == c["requests"] and c["branch_exact"] == n_branch
            print(f"token-exact: {c['token_exact']}/{c['requests']}, branches {c['branch_exact']}/{n_branch}"
                  + (f" (same as a full recompute: {c['branch_same_as_full_recompute']}/{n_branch})"
                     if "branch_same_as_full_recompute" in c else "")
                  + f"; workflow {json.dumps(c['workflow'])}", flush=True)
        if args.bench:
            args.model = args.bench if args.backend != "synthetic" else "synthetic"
            out["bench"], out["placement"] = bench(args)
            ok &= all(r.get("completed", r["requests"]) == r["requests"] for r in out["bench"])
    except Exception:
        traceback.print_exc()
        out["error"] = traceback.format_exc()
        ok = False
    g_ok, line = gates(args, out)
    ok &= g_ok
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    if "bench" in out:
        print("\n| config | turns | req/s | tok/s | TTFT mean ms | TTFT P95 ms | latency ms | branch turn ms "
              "| exposed transfer ms | epd share of TTFT | encoder runs/hits |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in out["bench"]:
            print(f"| {r['config']} | {r['turns']} | {r['rps']:.2f} | {r['tok_s']:.1f} | {r['ttft_mean_ms']:.1f} "
                  f"| {r['ttft_p95_ms']:.1f} | {r['latency_mean_ms']:.1f} | {r['branch_latency_mean_ms']:.1f} "
                  f"| {r.get('exposed_transfer_ms', float('nan')):.2f} "
                  f"| {r.get('epd_share_of_ttft', float('nan')):.3f} "
                  f"| {r.get('encoder_runs', '-')}/{r.get('encoder_hits', '-')} |")
        print("\nWhere TTFT goes (mean ms): encoder | feature fetch | sequence + Prepare | prefill compute "
              "| KV sink | (of prefill compute: the sink's wait for the model) | hops and queueing; decode: accept "
              "| handoff exposed | KV load")
        for r in out["bench"]:
            sp = r.get("split_ms", {})
            print(f"| {r['config']} | " + " | ".join(
                f"{sp[k]:.1f}" if k in sp else "-" for k in ("encoder", "feature_fetch", "prepare", "prefill_compute",
                                                             "kv_sink", "kv_sink_wait", "hops_and_queue",
                                                             "decode_accept_wait", "handoff_exposed",
                                                             "decode_kv_load")) + " |")
        for r in out["bench"]:
            if "epd_share_of_ttft_prefill_only" in r:
                print(f"epd share of TTFT ({r['config']}): {r['epd_share_of_ttft']:.4f}, of which the encoder's calls "
                      f"{r['encoder_epd_critical_ms']:.2f} ms a request; the prefill's calls alone "
                      f"{r['epd_share_of_ttft_prefill_only']:.4f}; with all of the KV sink's host time counted "
                      f"{r.get('epd_share_of_ttft_host_counted', float('nan')):.4f}")
        for r in out["bench"]:
            if "kv_sink_ms" in r:
                ks, ff = r["kv_sink_ms"], r.get("feature_fetch_ms", {})
                print(f"parts ({r['config']}): KV sink ({r.get('kv_sink_mode', 'layer')}) writes {ks['write']:.2f} ms "
                      f"of host time and {ks.get('write_gpu', 0):.2f} ms of GPU time (measured when written at the end), "
                      f"events and notices {ks['notice']:.2f} ms (of the writes' and notices' host time, "
                      f"{ks.get('host_hidden', 0):.2f} ms while the GPU was still on the model's work: not counted), "
                      f"{ks['groups']:.0f} groups, sequence + Prepare "
                      f"{ks.get('setup', 0):.2f} ms (on a thread; the first layer waited {ks.get('setup_wait', 0):.2f} ms); "
                      f"feature fetch acquire {ff.get('acquire', 0):.2f} ms (P50 {ff.get('acquire_p50', 0):.2f}, "
                      f"P95 {ff.get('acquire_p95', 0):.2f}, max {ff.get('acquire_max', 0):.2f}; counted when it "
                      f"found the feature ready, not when it waited: the tower ran meanwhile), "
                      f"wait {ff.get('wait', 0):.2f} ms (for the encoder, which the prefill overlaps: not epd's, "
                      f"but for the Publish's delivery to it, {ff.get('publish_to_woken', 0):.2f} ms, counted), "
                      f"read {ff.get('read', 0):.2f} ms; encoder: image + key {r.get('encoder_key_ms', 0):.2f} ms "
                      f"(the image {r.get('encoder_image_ms', 0):.2f}, its key "
                      f"{r.get('encoder_key_ms', 0) - r.get('encoder_image_ms', 0):.2f}), vision tower "
                      f"{r.get('encoder_tower_ms', 0):.2f} ms, "
                      f"(in parts: {json.dumps({k: round(v, 2) for k, v in r.get('encoder_produce_ms', {}).items()})}), "
                      f"outside these {r.get('encoder_epd_ms', 0):.2f} ms; decode: "
                      f"{r.get('decode_layers_in_one_launch', 0):.1f} layers read in one launch (mean)")
        for r in out["bench"]:
            if "decode_ms_per_token" in r:
                parts = (f" (a step: the host issuing it {r['step_launch_ms']:.2f} ms, then waiting for its "
                         f"token {r['step_wait_ms']:.2f} ms)" if "step_launch_ms" in r else "")
                print(f"decode ({r['config']}): {r['decode_ms_per_token']:.2f} ms a token after the first{parts}; "
                      f"an agent request's workflow root {r['workflow_root_ms']:.2f} ms (mean over requests)")
        for r in out["bench"]:
            for p in r.get("passes", []):
                print(f"{r['config']}, {p['config']}: {p['rps']:.2f} req/s, TTFT {p['ttft_mean_ms']:.1f} ms, decode "
                      f"{p.get('decode_ms_per_token', float('nan')):.2f} ms a token (issuing "
                      f"{p.get('step_launch_ms', float('nan')):.2f}, waiting {p.get('step_wait_ms', float('nan')):.2f})")
        for r in out["bench"]:
            if "kv_sink_ms" not in r and "encoder_tower_ms" in r:
                print(f"parts ({r['config']}): encoder: the image {r['encoder_image_ms']:.2f} ms, "
                      f"vision tower {r['encoder_tower_ms']:.2f} ms")
        for r in out["bench"]:
            if "loop_stalls" in r:
                ls = r["loop_stalls"]
                print(f"epdd's event loop ({r['config']}): {ls['count']} dispatches held it 1 ms or longer; "
                      f"the longest since it started {ls['longest_ms_so_far']:.2f} ms ({ls['longest_what'] or '-'})")
        for r in out["bench"]:
            if "workflow" in r:
                print(f"workflow ({r['config']}): {json.dumps(r['workflow'])}")
    print(f"gates: {line}: {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
