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

d = Daemon("[Arena:kvgpu]\nDomain=gpu\nGpu=0\nUsage=kv\nSize=1G\n")
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
    print(f"device_gpu_torch: ok: two processes share a {a.size >> 20} MiB GPU arena through torch views "
          f"(import+map {map_ms:.2f} ms, torch {torch.__version__})")
finally:
    rc = d.stop()
    assert rc == 0, rc
