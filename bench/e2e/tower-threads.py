#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""The 8B-class config's vision tower alone, timed in this process as its environment
and torch's CPU threads leave it: the split's encoder and the colocated process run the
same tower, but under different OpenMP settings (the worker processes start with
OMP_WAIT_POLICY=PASSIVE, docs/e2e.md), and the tower's CPU-side parts wait for its
OpenMP threads. run-device.sh runs it under each setting, one process each.

    tower-threads.py [--reps 20] [--threads N] [--gap S]

--gap S idles this process S seconds before each tower, as the split's encoder does
between requests at one in flight (while the decode runs elsewhere); without it the
towers run back to back, as in a process kept busy. Prints one line: the setting, the
tower's wall time and its GPU time (CUDA events around the call), medians of --reps
after a warm-up."""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave it)")
    ap.add_argument("--image-px", type=int, default=448)
    ap.add_argument("--gap", type=float, default=0.0, help="seconds idle before each tower")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)

    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    from epd.workers import qwen3vl as q
    cfg = Qwen3VLConfig()
    for k, v in q.EIGHT_B["vision"].items():
        setattr(cfg.vision_config, k, v)
    vc = cfg.vision_config
    torch.manual_seed(0)
    with torch.device("cuda"):
        tower = Qwen3VLVisionModel._from_config(vc, dtype=torch.bfloat16)
    tower.eval()
    g = a.image_px // vc.patch_size
    grid = torch.tensor([[1, g, g]], device="cuda")
    pixels = torch.randn(g * g, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                         device="cuda").to(torch.bfloat16)

    wall, gpu = [], []
    with torch.no_grad():
        for i in range(5 + a.reps):
            torch.cuda.synchronize()
            if a.gap and i >= 5:
                time.sleep(a.gap)
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            t0 = time.perf_counter()
            ev[0].record()
            tower(pixels, grid_thw=grid, return_dict=True)
            ev[1].record()
            ev[1].synchronize()
            if i >= 5:
                wall.append(1e3 * (time.perf_counter() - t0))
                gpu.append(ev[0].elapsed_time(ev[1]))
    setting = (f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')} "
               f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '-')} torch threads {torch.get_num_threads()}"
               f"{f', {a.gap:g} s idle before each' if a.gap else ', back to back'}")
    print(f"tower-threads: {setting}: wall {statistics.median(wall):.2f} ms, GPU {statistics.median(gpu):.2f} ms "
          f"(median of {a.reps}; {g * g} patches, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
