# SPDX-License-Identifier: LGPL-2.1-or-later
"""On a GPU machine with torch: epd.gpu's zero-copy tensors on the real driver. epdd
creates a GPU arena (CUDA VMM, POSIX-fd handle); a prefill process maps it, writes a
bf16 K block through a torch tensor that views the arena (no copy), and a decode process
maps the same arena from the fd epdd passes it and reads the same block through its own
tensor, bit for bit. Needs EPDD and EPD_LIBRARY; prints the import+map time."""
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import epd  # noqa: E402
import epd.gpu  # noqa: E402
from test_binding import Daemon  # noqa: E402

KV = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=2048, v_bytes_per_token=2048)
SHAPE = (1024, 8, 128)

READER = r"""
import sys, torch, epd, epd.gpu
c = epd.Client(sys.argv[1])
c.register("decode", "m", "cuda:0", kv=epd.KvLayout(4, 16, 2048, 2048))
g = epd.gpu.Gpu()
a = g.map_arena(c, "kvgpu")
t = a.torch(a.data_offset, (1024, 8, 128), "bfloat16")
torch.manual_seed(7)
ref = torch.randn(1024, 8, 128, device="cuda").to(torch.bfloat16)
print("equal" if torch.equal(t, ref) else "differs", t.data_ptr() == a.device_pointer + a.data_offset)
"""

d = Daemon("[Arena:kvgpu]\nDomain=gpu\nGpu=0\nUsage=kv\nSize=1G\n"
           "[Arena:featgpu]\nDomain=gpu\nGpu=0\nUsage=feature\nSize=256M\nPageSize=64K\n")
try:
    with epd.Client(d.address) as c:
        c.register("prefill", "m", "cuda:0", kv=KV)
        g = epd.gpu.Gpu()
        t0 = time.perf_counter()
        a = g.map_arena(c, "kvgpu")
        map_ms = 1e3 * (time.perf_counter() - t0)
        t = a.torch(a.data_offset, SHAPE, "bfloat16")
        assert t.is_cuda and t.data_ptr() == a.device_pointer + a.data_offset, "not a view of the arena"
        torch.manual_seed(7)
        t.copy_(torch.randn(*SHAPE, device="cuda").to(torch.bfloat16))
        torch.cuda.synchronize()
        # The reader imports epd from this checkout, as this script does.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")] +
            [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
        out = subprocess.run([sys.executable, "-c", READER, d.address], check=True, stdout=subprocess.PIPE,
                             text=True, env=env).stdout.split()
        assert out == ["equal", "True"], out
        a.close()
        g.close()

        # Every layer in one launch (KvPages.write_layers / read_layers: the several-layer
        # kernel) puts and finds the same bytes as one launch per layer: per-layer writes
        # read back in one launch and the other way round, both tensor layouts, a last
        # page partly used.
        from epd.sequence import Sequence
        from epd.workers.connector import KvPageLayout, KvPages, _seq_offsets
        L = KvPageLayout(layers=4, tokens_per_block=16, kv_heads=8, head_dim=128, elem_size=2)
        S = 37
        kv = [(torch.randn(1, 8, S, 128, device="cuda").to(torch.bfloat16),
               torch.randn(1, 8, S, 128, device="cuda").to(torch.bfloat16)) for _ in range(L.layers)]
        # (B, S, H, D) memory seen as (B, H, S, D): the projections' layout.
        kv_t = [(k.transpose(1, 2).contiguous().transpose(1, 2), v.transpose(1, 2).contiguous().transpose(1, 2))
                for k, v in kv]
        for tensors in (kv, kv_t):
            seqs = [Sequence.create(c, "kvgpu", L.pages_for(S)) for _ in range(2)]
            one, many = (KvPages(c, "kvgpu", L, _seq_offsets(c, "kvgpu", q.pages, L.page_size)) for q in seqs)
            for layer, (k, v) in enumerate(tensors):
                one.write(layer, k, v)
            many.write_layers([(layer, k, v) for layer, (k, v) in enumerate(tensors)])
            got_many = one.read_layers(list(range(L.layers)), S, "bfloat16")
            got_one = [many.read(layer, S, "bfloat16") for layer in range(L.layers)]
            torch.cuda.synchronize()
            for layer, (k, v) in enumerate(tensors):
                for got in (got_many[layer], got_one[layer]):
                    assert torch.equal(got[0], k) and torch.equal(got[1], v), f"layer {layer} differs"
            one.close()
            many.close()
            for q in seqs:
                q.release()
        # The KV sink's save="end" write: its host time is told apart as hidden when the
        # GPU was still on work queued before it (here 20+ ms of torch.cuda._sleep): the
        # write then starts right after that work, no gap; with the GPU idle (the stream
        # empty as the sink begins) none of it. The bytes land either way.
        from epd.workers.connector import EpdKvSink
        hidden = {}
        for busy in (True, False):
            rid = "%032x" % (0xd0e0 + busy)
            sink = EpdKvSink(c, "kvgpu", L, rid, S, [2, 2], save="end")
            for layer, (k, v) in enumerate(kv):
                sink.layer(layer, k, v)
            if busy:
                torch.cuda._sleep(40_000_000)
            else:
                torch.cuda.synchronize()
            sink.flush()
            hidden[busy] = (sink.host_hidden_s, sink.write_s + sink.notice_s)
            got = sink.kv.read_layers(list(range(L.layers)), S, "bfloat16")
            torch.cuda.synchronize()
            for layer, (k, v) in enumerate(kv):
                assert torch.equal(got[layer][0], k) and torch.equal(got[layer][1], v), f"sink layer {layer} differs"
            h = sink.handoff
            h.rollback()
            h.release()
            sink.done()
        assert hidden[True][0] >= 0.9 * hidden[True][1], hidden
        assert hidden[False][0] == 0, hidden
        # A feature in a GPU feature arena: the prefill's views of all its tensors from
        # one import (Feature.cuda_all) are the same views as one import each (cuda()).
        from epd.workers.connector import _feature_gpu_arena, fetch, produce
        enc = epd.Client(d.address)
        enc.register("encoder", "m", "cuda:0")
        feats = {"embeds": torch.randn(196, 4096, device="cuda").to(torch.bfloat16),
                 "deepstack.0": torch.randn(196, 4096, device="cuda").to(torch.bfloat16),
                 "grid_thw": torch.tensor([[1, 28, 28]], device="cuda"),
                 "scale": torch.randn(7, device="cuda").to(torch.float16),
                 # the one-byte dtypes a feature may have (proto/feature-desc.c): no
                 # __cuda_array_interface__ typestr torch takes for the float8 types
                 "mask": torch.rand(3, 5, device="cuda") > 0.5}
        for f8 in ("float8_e4m3fn", "float8_e5m2"):
            if hasattr(torch, f8):  # torch 2.1 on
                feats[f8] = torch.randn(4, 33, device="cuda").to(getattr(torch, f8))

        def same(a, b):
            """Bit for bit (torch.equal has no float8 kernels)."""
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if a.element_size() == 1:
                a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
            return torch.equal(a, b)
        assert produce(enc, "img:gpu-views", "ab" * 16, lambda: feats)[0] == "produced"
        got = fetch(c, "img:gpu-views", device="cuda")
        fh = got._handle
        assert _feature_gpu_arena(c, fh) is not None, "the feature is not in the GPU feature arena"
        m = _feature_gpu_arena(c, fh)
        for name, x in feats.items():
            one = fh.cuda(name, m)
            assert same(got[name], x) and same(one, x), f"feature tensor {name} differs"
            assert got[name].data_ptr() == one.data_ptr() and got[name].stride() == one.stride(), name
        got.release()
        enc.close()
    print(f"device_gpu_torch: ok: the KV sink's host time hidden behind queued GPU work "
          f"{1e3 * hidden[True][0]:.3f} of {1e3 * hidden[True][1]:.3f} ms, with the GPU idle "
          f"{1e3 * hidden[False][0]:.3f} of {1e3 * hidden[False][1]:.3f} ms")
    print(f"device_gpu_torch: ok: a GPU feature's tensors viewed from one import = one import each "
          f"({len(feats)} tensors: {', '.join(sorted({str(x.dtype) for x in feats.values()}))})")
    print(f"device_gpu_torch: ok: every layer in one launch = one launch per layer (4 layers, {S} tokens, both "
          f"layouts)")
    print(f"device_gpu_torch: ok: two processes share a {a.size >> 20} MiB GPU arena through torch views "
          f"(import+map {map_ms:.2f} ms, torch {torch.__version__})")
finally:
    rc = d.stop()
    assert rc == 0, rc
