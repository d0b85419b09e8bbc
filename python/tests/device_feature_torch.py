# SPDX-License-Identifier: LGPL-2.1-or-later
"""On a machine with torch (and numpy): epd.feature's zero-copy views. An encoder
process writes a bf16 embedding and an i64 grid_thw through torch views of the shared
arena; a prefill process reads them through its own views, checks them bit for bit,
and (with a GPU) moves the embedding to the device. Needs EPDD and EPD_LIBRARY."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch  # noqa: E402

import epd  # noqa: E402
import epd.feature as ef  # noqa: E402
from test_binding import Daemon  # noqa: E402

d = Daemon()
try:
    n, hidden = 256, 1024
    tensors = [ef.Tensor("image_embeds", torch.bfloat16, (n, hidden)),
               ef.Tensor("grid_thw", "int64", (1, 3), offset=n * hidden * 2)]
    nbytes = n * hidden * 2 + 24
    ref = torch.randn(n, hidden).to(torch.bfloat16)
    with epd.Client(d.address) as enc, epd.Client(d.address) as pre:
        enc.register("encoder", "m", "cpu")
        pre.register("prefill", "m", "cpu")
        p = ef.Feature.reserve(enc, "img:torch", nbytes, tensors)
        p.torch("image_embeds").copy_(ref)
        p.torch("grid_thw").copy_(torch.tensor([[1, 16, 16]]))
        p.publish(1234)
        with ef.Feature.acquire(pre, "img:torch") as f:
            assert f.result == "hit", f.result
            e = f.torch("image_embeds")
            assert e.dtype == torch.bfloat16 and tuple(e.shape) == (n, hidden)
            assert torch.equal(e, ref), "embedding differs"
            assert f.torch("grid_thw").tolist() == [[1, 16, 16]]
            assert f.numpy("grid_thw").tolist() == [[1, 16, 16]]
            # a view, not a copy: a write through the producer's view shows here
            p.torch("grid_thw")[0, 0] = 2
            assert int(f.torch("grid_thw")[0, 0]) == 2
            # transposed layout: strides (1, n)
            if torch.cuda.is_available():
                g = e.to("cuda", non_blocking=False)
                assert torch.equal(g.cpu(), ref)
                print("cuda copy ok on", torch.cuda.get_device_name(0))
        p.release()
    print("device_feature_torch: ok (torch", torch.__version__, ")")
finally:
    rc = d.stop()
    assert rc == 0, rc
