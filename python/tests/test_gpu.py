# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.gpu against a real epdd, without a GPU: the stand-in driver (tests/unit/fake-libcuda,
FAKE_LIBCUDA) in its "gpu" mode gives epdd and libepd one fake GPU whose VMM memory is
memfds, device pointers are addresses of this process, and imports map the same pages.
So what runs here is the real path — the daemon creates the arena, passes its fd at
registration, libepd imports and maps it, __cuda_array_interface__ describes it — and
two processes sharing one arena can be checked byte for byte. On the GPU machine the
same calls run on the real driver (bench/gpu/run-device.sh)."""

import ctypes
import os
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epd  # noqa: E402
import epd.gpu  # noqa: E402
from test_binding import Daemon  # noqa: E402

FAKE = os.environ.get("FAKE_LIBCUDA")
KV = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=256, v_bytes_per_token=256)
ARENA = "[Arena:kvgpu]\nDomain=gpu\nGpu=0\nUsage=kv\nSize=32M\n"

READER = r"""
import ctypes, hashlib, sys
import epd, epd.gpu
c = epd.Client(sys.argv[1])
c.register("decode", "m", "cuda:0", kv=epd.KvLayout(4, 16, 256, 256))
g = epd.gpu.Gpu()
a = g.map_arena(c, "kvgpu")
v = a.view(a.data_offset, (1 << 16,), "uint8")
print(hashlib.sha256(ctypes.string_at(v.__cuda_array_interface__["data"][0], 1 << 16)).hexdigest())
a.close(); g.close(); c.close()
"""


def gpu_env(mode):
    return {"EPD_LIBCUDA": FAKE, "FAKE_CUDA_MODE": mode}


@unittest.skipUnless(FAKE, "FAKE_LIBCUDA (the stand-in driver) not given")
class NoGpuTest(unittest.TestCase):
    def test_no_device_is_an_error_that_says_so(self):
        os.environ.update(gpu_env("nodevice"))
        try:
            with self.assertRaises(epd.EpdError) as e:
                epd.gpu.Gpu()
            self.assertIn("GPU", str(e.exception))
        finally:
            os.environ.pop("EPD_LIBCUDA")
            os.environ.pop("FAKE_CUDA_MODE")

    def test_no_driver_is_an_error_that_says_so(self):
        os.environ["EPD_LIBCUDA"] = "/nonexistent/libcuda.so.1"
        try:
            with self.assertRaises(epd.EpdError) as e:
                epd.gpu.Gpu()
            self.assertIn("driver", str(e.exception))
        finally:
            os.environ.pop("EPD_LIBCUDA")


@unittest.skipUnless(FAKE, "FAKE_LIBCUDA (the stand-in driver) not given")
class GpuArenaTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon(ARENA, env=gpu_env("gpu"))
        os.environ.update(gpu_env("gpu"))

    def tearDown(self):
        os.environ.pop("EPD_LIBCUDA")
        os.environ.pop("FAKE_CUDA_MODE")
        self.assertEqual(self.d.stop(), 0)

    def test_two_processes_share_one_arena_without_copies(self):
        import hashlib
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cuda:0", kv=KV)
            a = [x for x in c.arenas() if x.name == "kvgpu"][0]
            self.assertEqual(a.domain, "gpu")
            g = epd.gpu.Gpu()
            m = g.map_arena(c, "kvgpu")
            self.assertGreaterEqual(m.size, 32 << 20)
            v = m.view(m.data_offset, (1 << 16,), "uint8")
            cai = v.__cuda_array_interface__
            self.assertEqual(cai["version"], 3)
            self.assertEqual(cai["shape"], (1 << 16,))
            self.assertEqual(cai["typestr"], "|u1")
            self.assertEqual(cai["data"], (m.device_pointer + m.data_offset, False))
            pattern = bytes((i * 7 + 3) & 0xFF for i in range(1 << 16))
            ctypes.memmove(cai["data"][0], pattern, len(pattern))
            # Another worker process maps the same arena from the fd epdd passes it and
            # reads the bytes this one wrote through its own device pointer.
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")] +
                [x for x in os.environ.get("PYTHONPATH", "").split(os.pathsep) if x]))
            out = subprocess.run([sys.executable, "-c", READER, self.d.address], check=True,
                                 stdout=subprocess.PIPE, text=True, env=env).stdout.split()
            self.assertEqual(out[-1], hashlib.sha256(pattern).hexdigest())
            # Views are typed and bounded.
            self.assertEqual(m.view(m.data_offset, (8, 4, 128), "bfloat16").__cuda_array_interface__["shape"],
                             (8, 4, 128))
            with self.assertRaises(ValueError):
                m.view(m.size - 8, (16,), "uint8")
            with self.assertRaises(ValueError):
                m.view(0, (4,), "complex64")
            m.close()
            with self.assertRaises(ValueError):
                m.view(0, (4,), "uint8")
            g.close()

    def test_host_arena_is_not_a_gpu_arena(self):
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cuda:0", kv=KV)
            g = epd.gpu.Gpu()
            with self.assertRaises(epd.EpdError) as e:
                g.map_arena(c, "nosuch")
            self.assertEqual(e.exception.name, "org.epd1.Error.NotFound")
            g.close()


if __name__ == "__main__":
    unittest.main()
