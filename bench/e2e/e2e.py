# SPDX-License-Identifier: LGPL-2.1-or-later
"""End to end: a Qwen3-VL model served Encoder -> Prefill -> Decode through epdd (three
worker processes), against the same model colocated in one process without epd.

  python3 bench/e2e/e2e.py --address direct:/tmp/epd/bus --check small     # token-exact
  python3 bench/e2e/e2e.py --address direct:/tmp/epd/bus --bench 8b        # benchmark

--backend synthetic runs the disaggregated path with numpy tensors (no GPU), for a
smoke test of this driver. Results are printed as a table and written as JSON."""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
from epd.workers import serve  # noqa: E402


def specs(n, images, text_tokens, max_new, salt="", first=0):
    out = []
    for i in range(first, first + n):
        out.append(serve.Spec(serve.request_id_of(i) if not salt else serve.request_id_of(10_000 + i),
                              image_seed=i % images, text_seed=i, text_tokens=text_tokens + (i % 5) * 8,
                              max_new_tokens=max_new, cache_salt=f"{salt}{i}" if salt else ""))
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


def summarize(name, results, wall):
    ttft = [r["ttft_s"] for r in results]
    toks = sum(len(r["tokens"]) for r in results)
    row = {"config": name, "requests": len(results), "wall_s": wall, "rps": len(results) / wall,
           "tok_s": toks / wall, "ttft_mean_ms": 1e3 * statistics.mean(ttft), "ttft_p95_ms": 1e3 * pct(ttft, 95),
           "latency_mean_ms": 1e3 * statistics.mean(r["latency_s"] for r in results)}
    if results and "prefill" in results[0]:
        row["exposed_transfer_ms"] = 1e3 * statistics.mean(r["decode"]["wait_s"] for r in results)
        row["epd_share_of_ttft"] = statistics.mean(
            (r["prefill"]["fetch_s"] + r["prefill"]["sink_s"]) / r["ttft_s"] for r in results)
        row["kv_bytes"] = sum(r["prefill"]["kv_bytes"] for r in results)
        row["encoder_hits"] = sum(1 for r in results if r.get("encode", {}).get("result") == "hit")
        row["encoder_runs"] = sum(1 for r in results if r.get("encode", {}).get("result") == "produced")
    return row


def colocated(model_name, reqs):
    """The same model in one process, no epd: vision tower, prefill, decode; in turn."""
    import torch
    from epd.workers import qwen3vl as q
    m = q.build_model(model_name)
    enc, pre, dec = q.Encoder(m), q.Prefill(m), q.Decode(m)
    out = []
    t_all = time.perf_counter()
    for s in reqs:
        t0 = time.perf_counter()
        r = q.make_request(m, s.image_seed, s.text_seed, text_tokens=s.text_tokens)
        kv = q.MemoryKv()
        first, delta = pre.prefill(r, enc.encode(r), kv)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        toks = dec.decode(kv, r.input_ids.shape[1], first, delta, s.max_new_tokens)
        torch.cuda.synchronize()
        out.append({"ttft_s": t1 - t0, "latency_s": time.perf_counter() - t0, "tokens": toks})
    return out, time.perf_counter() - t_all, m


def check(args):
    """Token-exact: disaggregated greedy output == colocated HF generate, every request."""
    from epd.workers import qwen3vl as q
    reqs = specs(args.requests, images=3, text_tokens=40, max_new=args.max_new)
    w = serve.Workers(args.address, args.model)
    try:
        res = w.run(reqs, concurrency=args.concurrency)
    finally:
        w.close()
    m = q.build_model(args.model)
    exact = 0
    for s, r in zip(reqs, res):
        base = q.colocated_generate(m, q.make_request(m, s.image_seed, s.text_seed, text_tokens=s.text_tokens),
                                    s.max_new_tokens)
        same = base == r["tokens"]
        exact += same
        print(f"  {s.request_id[:8]} image {s.image_seed} prompt {r['prefill']['prompt_len']:4d} "
              f"encoder {r['encode']['result']:8s} {'EXACT' if same else 'DIFF ' + str(base[:6]) + ' ' + str(r['tokens'][:6])}",
              flush=True)
    return {"token_exact": exact, "requests": len(reqs)}


def bench(args):
    rows = []
    n, warm = args.requests, args.warmup
    # Disaggregated, repeated images (the feature cache hits), then every image new.
    w = serve.Workers(args.address, args.model)
    try:
        w.run(specs(warm, args.images, args.text_tokens, args.max_new, salt="warm"), args.concurrency)
        # Concurrency 1 is the colocated baseline's own shape (one request at a time): its
        # TTFT compares like for like; at args.concurrency the workers overlap requests.
        for name, salt, conc in ((f"EPD 1E+1P+1D, feature cache, {args.concurrency} in flight", "", args.concurrency),
                                 (f"EPD 1E+1P+1D, no cache hits, {args.concurrency} in flight", "nocache",
                                  args.concurrency),
                                 ("EPD 1E+1P+1D, no cache hits, 1 in flight", "serial", 1)):
            reqs = specs(n, args.images, args.text_tokens, args.max_new, salt=salt, first=100)
            t0 = time.perf_counter()
            res = w.run(reqs, conc)
            rows.append(summarize(name, res, time.perf_counter() - t0))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        w.close()
    reqs = specs(n, args.images, args.text_tokens, args.max_new, first=100)
    if args.backend != "synthetic":
        colocated(args.model, specs(2, 2, args.text_tokens, args.max_new, first=900))  # warm-up
        res, wall, _ = colocated(args.model, reqs)
        rows.append(summarize("colocated, 1 process, no epd", res, wall))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--epdctl", default="epdctl")
    ap.add_argument("--check", metavar="MODEL")
    ap.add_argument("--bench", metavar="MODEL")
    ap.add_argument("--backend", default="qwen3vl")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--text-tokens", type=int, default=100)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    ok = True
    try:
        if args.check:
            args.model = args.check if args.backend != "synthetic" else "synthetic"
            out["check"] = check(args)
            ok &= out["check"]["token_exact"] == out["check"]["requests"]
            print(f"token-exact: {out['check']['token_exact']}/{out['check']['requests']}", flush=True)
        if args.bench:
            args.model = args.bench if args.backend != "synthetic" else "synthetic"
            out["bench"] = bench(args)
    except Exception:
        traceback.print_exc()
        out["error"] = traceback.format_exc()
        ok = False
    # Gates: nothing retained, no handoff left, no failure or fallback.
    pools = epdctl(args, "pages")
    hand = epdctl(args, "handoffs")
    out["pages"], out["handoffs"] = pools, hand
    kv = [p for p in pools.get("pools", []) if p.get("arena") == "host0"]
    retained = kv[0]["total"] - kv[0]["free"] if kv else None
    out["retained_pages"] = retained
    ok &= retained == 0
    counters = hand.get("counters", {}) if isinstance(hand, dict) else {}
    failures = sum(v for k, v in counters.items() if k.startswith("failures.")) + counters.get("rolled-back", 0)
    out["failures"], out["fallbacks"] = failures, counters.get("ring-fallbacks", 0)
    ok &= failures == 0 and out["fallbacks"] == 0 and not hand.get("handoffs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if "bench" in out:
        print("\n| config | req/s | tok/s | TTFT mean ms | TTFT P95 ms | latency ms | exposed transfer ms | epd share of TTFT | encoder runs/hits |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in out["bench"]:
            print(f"| {r['config']} | {r['rps']:.2f} | {r['tok_s']:.1f} | {r['ttft_mean_ms']:.1f} | {r['ttft_p95_ms']:.1f} "
                  f"| {r['latency_mean_ms']:.1f} | {r.get('exposed_transfer_ms', float('nan')):.2f} "
                  f"| {r.get('epd_share_of_ttft', float('nan')):.3f} | {r.get('encoder_runs', '-')}/{r.get('encoder_hits', '-')} |")
    print(f"gates: retained pages {retained}, handoffs left {len(hand.get('handoffs', []))}, "
          f"failures {out['failures']}, ring fallbacks {out['fallbacks']}: {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
