#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""What the feature cache's calls cost the encoder and the prefill on the host, step by
step, with the GPU idle: the same calls as the e2e benchmark's encoder (produce: flush,
AcquireOrReserve, finding the GPU arena, the views, the device-to-device copies, Publish
+ Release sent) and prefill (fetch: Acquire, the tensors' descriptions, the views), on
the Qwen3-VL 8B feature bundle (embeddings and 3 DeepStack layers of 256 x 4096 bf16, the
grid), against a real epdd and a GPU feature arena. The limit beside them: a bare bus
round trip through libepd (the Manager's Version property).

    feature-overhead.py --address direct:/path/to/bus [--reps 200]
"""
import argparse
import ctypes
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

from epd import Client, _lib  # noqa: E402
from epd.feature import Feature  # noqa: E402
from epd.workers import connector as C  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=4096)
    a = ap.parse_args()

    enc, pre = Client(a.address), Client(a.address)
    enc.register("encoder", "feature-overhead", "cuda:0")
    pre.register("prefill", "feature-overhead", "cuda:0")
    out = {"embeds": torch.randn(a.tokens, a.hidden, device="cuda").to(torch.bfloat16)}
    for i in range(3):
        out[f"deepstack.{i}"] = torch.randn(a.tokens, a.hidden, device="cuda").to(torch.bfloat16)
    out["grid_thw"] = torch.tensor([[1, 32, 32]], device="cuda")
    layout = C._layout(out)
    lib = _lib.lib()
    lib.epd_get_version.restype = ctypes.c_int
    lib.epd_get_version.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
    lib.free.argtypes = [ctypes.c_void_p]

    steps = {k: [] for k in ("bus round trip (limit)", "enc flush", "enc AcquireOrReserve", "enc find arena",
                             "enc views", "enc copies queued", "enc Publish+Release sent", "pre Acquire",
                             "pre tensors", "pre find arena", "pre views", "pre Release")}
    run = f"{os.getpid()}-{time.time_ns()}"
    for i in range(a.reps + 10):
        rec = i >= 10  # the first ten warm up
        t0 = time.perf_counter()
        p = ctypes.c_void_p()
        if lib.epd_get_version(enc._c, ctypes.byref(p)) < 0:
            raise SystemExit("Version: failed")
        lib.free(p)
        t1 = time.perf_counter()
        key = f"feature-overhead-{run}-{i}"
        enc.flush(5)
        t2 = time.perf_counter()
        f = Feature.acquire_or_reserve(enc, key, layout[1], layout[0], "%032x" % i)
        t3 = time.perf_counter()
        assert f.result == "produce", f.result
        gpu = C._feature_gpu_arena(enc, f)
        if gpu is None:
            raise SystemExit("the feature arena is not a GPU arena")
        t4 = time.perf_counter()
        views = f.cuda_all(gpu)
        t5 = time.perf_counter()
        for t, (name, x) in zip(layout[0], out.items()):
            views[t.name].copy_(x)
        t6 = time.perf_counter()
        torch.cuda.current_stream().synchronize()
        t7 = time.perf_counter()
        f.publish_release(1)
        t8 = time.perf_counter()
        enc.flush(5)  # the prefill comes after the Publish, as in the benchmark
        t9 = time.perf_counter()
        r = Feature.acquire(pre, key)
        t10 = time.perf_counter()
        assert r.result == "hit", r.result
        tensors = r.tensors
        t11 = time.perf_counter()
        g2 = C._feature_gpu_arena(pre, r)
        t12 = time.perf_counter()
        got = r.cuda_all(g2)
        t13 = time.perf_counter()
        r.release()
        t14 = time.perf_counter()
        assert len(tensors) == len(got) == len(out)
        if rec:
            for k, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t8 - t7, t10 - t9,
                                    t11 - t10, t12 - t11, t13 - t12, t14 - t13)):
                steps[k].append(v)
    assert torch.equal(got["embeds"], out["embeds"]) and torch.equal(got["deepstack.2"], out["deepstack.2"])
    med = {k: 1e6 * statistics.median(v) for k, v in steps.items()}
    limit = med["bus round trip (limit)"]
    print(f"feature overhead, GPU idle ({a.tokens} x {a.hidden} bf16 x 4 + grid, {layout[1] / 1e6:.1f} MB), "
          f"median of {a.reps}, host us: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    enc_us = sum(med[k] for k in med if k.startswith("enc ") and k != "enc flush")
    pre_us = sum(med[k] for k in med if k.startswith("pre ") and k != "pre Release")
    print(f"feature overhead: the encoder's calls {enc_us:.1f} us ({enc_us / limit:.1f} bus round trips), "
          f"the prefill's fetch {pre_us:.1f} us ({pre_us / limit:.1f} bus round trips); "
          f"a bus round trip {limit:.1f} us")
    enc.close()
    pre.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
