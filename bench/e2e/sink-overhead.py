#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""What the prefill's KV sink costs the host per layer when the GPU is not the bottleneck.

In the benchmark the sink's time is measured inside the model's forward pass, where the
host runs ahead of the GPU: a kernel launch there can wait for room in the launch queue,
and that wait (the model's compute, not epd's) lands in whichever call makes it. Here the
same calls run with the GPU idle, against a real epdd and a GPU KV arena: one
KvPages.write per layer (the batched scatter launch through libepd), and per layer group
the CUDA event the sink records and queries. The GPU time of the writes is measured apart
with CUDA events (for one launch per layer, events around the 36 launches: when the kernels
are shorter than the launches, that is the host's pace); and every layer in one launch
(the sink's save="end", the decode's read of all layers), events around that launch alone,
against one contiguous copy of the same bytes on the same GPU (the limit).

    sink-overhead.py --address direct:/path/to/bus --arena kvgpu [--layers 36 --kv-heads 8
                     --head-dim 128 --tokens 1400 --reps 20]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import torch  # noqa: E402

from epd import Client  # noqa: E402
from epd.sequence import Sequence  # noqa: E402
from epd.workers import connector as C  # noqa: E402
from epd.workers.serve import KvLayout  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--arena", default="kvgpu")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1400)
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()

    layout = C.KvPageLayout(a.layers, 16, a.kv_heads, a.head_dim, 2)
    client = Client(a.address)
    client.register("prefill", "sink-overhead", "cuda:0",
                    kv=KvLayout(a.layers, 16, layout.k_bytes_per_token, layout.v_bytes_per_token, "bfloat16"))
    seq = Sequence.create(client, a.arena, layout.pages_for(a.tokens))
    kv = C.KvPages(client, a.arena, layout, C._seq_offsets(client, a.arena, seq.pages, layout.page_size))
    # The model's cache tensors: (1, H, S, D), one pair per layer.
    ks = [torch.randn(1, a.kv_heads, a.tokens, a.head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(a.layers)]
    vs = [torch.randn(1, a.kv_heads, a.tokens, a.head_dim, dtype=torch.bfloat16, device="cuda") for _ in range(a.layers)]
    for layer in range(a.layers):  # warm-up: page table, kernels loaded
        kv.write(layer, ks[layer], vs[layer])
    torch.cuda.synchronize()

    # The parts of a write on the host: the stream lookup, and a bare torch launch of
    # one small kernel (what any launch from Python costs here) as the reference.
    tiny = torch.zeros(16, device="cuda")
    n = 1000
    t0 = time.perf_counter()
    for _ in range(n):
        C._stream_of(ks[0])
    stream_us = 1e6 * (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        tiny.zero_()
    torch_launch_us = 1e6 * (time.perf_counter() - t0) / n
    torch.cuda.synchronize()

    # Groups reported ready through libepd's notifier (an event recorded per group, the
    # ring submission on its thread), one group per layer, against a real local handoff.
    from epd.handoff import Handoff, Ring
    ring = Ring(client)
    notifier = C._notifier(ring, kv._m.ordinal)
    notify_us = []
    for rep in range(a.reps):
        rid = "%032x" % (0x5e0000 + rep)
        h = Handoff.prepare(client, rid, "", seq.path, [1] * a.layers)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(a.layers):
            notifier.ready_after(C._stream_of(ks[0]), rid.encode(), h.token, layer)
        notify_us.append(1e6 * (time.perf_counter() - t0) / a.layers)
        notifier.flush(10)
        h.rollback()
        h.release()
    C.close_notifiers(ring)
    ring.close()

    write_us, event_us, gpu_us = [], [], []
    for _ in range(a.reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer in range(a.layers):
            kv.write(layer, ks[layer], vs[layer])
        t1 = time.perf_counter()
        for layer in range(a.layers):
            ev = torch.cuda.Event()
            ev.record()
            ev.query()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        write_us.append(1e6 * (t1 - t0) / a.layers)
        event_us.append(1e6 * (t2 - t1) / a.layers)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in range(a.layers):
            kv.write(layer, ks[layer], vs[layer])
        end.record()
        end.synchronize()
        gpu_us.append(1e3 * start.elapsed_time(end) / a.layers)
    # Every layer in one launch (the sink's save="end", the decode's read of all layers),
    # its GPU time from events around the launch alone, against the limit in the same
    # run: one contiguous device-to-device copy of the same bytes (torch's copy_).
    items = [(layer, ks[layer], vs[layer]) for layer in range(a.layers)]
    nbytes = 2 * a.layers * a.tokens * layout.k_bytes_per_token
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)

    host = {}

    def gpu_time(fn, name=None):
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        t0 = time.perf_counter()
        fn(ev)
        if name:  # the call's host time: the rows built and checked, the launch
            host.setdefault(name, []).append(1e6 * (time.perf_counter() - t0))
        ev[1].synchronize()
        return 1e3 * ev[0].elapsed_time(ev[1])

    def limit(ev):
        ev[0].record()
        dst.copy_(src)
        ev[1].record()

    for _ in range(3):  # warm-up
        gpu_time(lambda ev: kv.write_layers(items, events=ev))
        gpu_time(lambda ev: kv.read_layers(range(a.layers), a.tokens, "bfloat16", events=ev))
        gpu_time(limit)
    write_all = statistics.median(gpu_time(lambda ev: kv.write_layers(items, events=ev), "write")
                                  for _ in range(a.reps))
    read_all = statistics.median(gpu_time(lambda ev: kv.read_layers(range(a.layers), a.tokens, "bfloat16", events=ev),
                                          "read") for _ in range(a.reps))
    copy_all = statistics.median(gpu_time(limit) for _ in range(a.reps))
    parts = write_layers_parts(kv, items, a.tokens, 10 * a.reps)
    kv.close()
    seq.release()
    client.close()
    print(f"every layer in one launch ({nbytes / 1e6:.1f} MB), GPU time, median of {a.reps}: write "
          f"{write_all:.1f} us ({copy_all / write_all:.3f} of the limit), read {read_all:.1f} us "
          f"({copy_all / read_all:.3f}); the limit, one contiguous copy of the same bytes: {copy_all:.1f} us; "
          f"host time of the call: write {statistics.median(host['write']):.1f} us, "
          f"read {statistics.median(host['read']):.1f} us")
    mb = 2 * a.tokens * layout.k_bytes_per_token / 1e6
    print(f"sink overhead, GPU idle ({a.layers} layers, {a.tokens} tokens, {mb:.2f} MB of K+V a layer), "
          f"median of {a.reps}: host per layer: write {statistics.median(write_us):.1f} us, "
          f"event record+query {statistics.median(event_us):.1f} us; GPU per layer write "
          f"{statistics.median(gpu_us):.1f} us; a forward pass: host "
          f"{a.layers * (statistics.median(write_us) + statistics.median(event_us)) / 1e3:.2f} ms, "
          f"GPU {a.layers * statistics.median(gpu_us) / 1e3:.2f} ms")
    print(f"sink overhead parts (host, per call): notifier ready_after {statistics.median(notify_us):.1f} us "
          f"(the events path above: record+query); stream lookup {stream_us:.2f} us; a bare torch launch "
          f"(zero_ of 16 floats) {torch_launch_us:.1f} us")
    print("write_layers in parts (host, GPU idle, median us): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))


def write_layers_parts(kv, items, tokens, reps):
    """The host's parts of KvPages.write_layers (every layer in one launch), each timed
    on its own with the GPU idle: the per-layer checks and addresses (_many_rows), the
    rows array alone, the two timing events, the stream lookup, the launch through
    libepd; and the whole call with its events."""
    k0 = items[0][1]
    t = kv._tables.get(0) or kv._table(0)
    stream = C._stream_of(k0)
    rows = kv._many_rows(items, tokens)
    layers = [layer for layer, _, _ in items]
    kp = [k.data_ptr() for _, k, _ in items]
    vp = [v.data_ptr() for _, _, v in items]
    first = kv._rows(layers[0], items[0][1], items[0][2], tokens)

    def events():
        ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        ev[0].record()
        ev[1].record()

    steps = {
        "checks and addresses (_many_rows)": lambda: kv._many_rows(items, tokens),
        "rows array alone": lambda: kv._rows_array(first, layers, kp, vp),
        "first layer's rows (_rows)": lambda: kv._rows(layers[0], items[0][1], items[0][2], tokens),
        "two timing events": events,
        "stream lookup": lambda: C._stream_of(k0),
        "launch (write_many)": lambda: t.write_many(rows, stream),
        "whole write_layers": lambda: kv.write_layers(items),
    }
    out = {}
    for name, fn in steps.items():
        v = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            v.append(1e6 * (time.perf_counter() - t0))
        out[name] = statistics.median(v)
    torch.cuda.synchronize()
    return out


if __name__ == "__main__":
    main()
