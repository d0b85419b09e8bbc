# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.gpu against a real epdd, without a GPU: the stand-in driver (tests/unit/fake-libcuda,
FAKE_LIBCUDA) in its "gpu" mode gives epdd and libepd one fake GPU whose VMM memory is
memfds, device pointers are addresses of this process, and imports map the same pages.
So what runs here is the real path — the daemon creates the arena, passes its fd at
registration, libepd imports and maps it, __cuda_array_interface__ describes it — and
two processes sharing one arena can be checked byte for byte. On the GPU machine the
same calls run on the real driver (bench/gpu/run-device.sh)."""

import contextlib
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
            # libepd's own refusal (its GPU calls take no client): named errno.N
            self.assertEqual(e.exception.name, f"errno.{e.exception.errno}")
        finally:
            os.environ.pop("EPD_LIBCUDA")
            os.environ.pop("FAKE_CUDA_MODE")

    def test_no_driver_is_an_error_that_says_so(self):
        os.environ["EPD_LIBCUDA"] = "/nonexistent/libcuda.so.1"
        try:
            with self.assertRaises(epd.EpdError) as e:
                epd.gpu.Gpu()
            self.assertIn("driver", str(e.exception))
            self.assertEqual(e.exception.name, f"errno.{e.exception.errno}")
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

    def test_views_outlive_close(self):
        """close() unmaps the arena only once no view of it is left: a CudaView (or a torch
        tensor made from one) taken before still reads the memory, and the last view
        gone, the range is unmapped."""
        import gc

        def mapped(ptr):
            with open("/proc/self/maps") as f:
                for line in f:
                    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                    if lo <= ptr < hi:
                        return "rw" in line.split()[1]
            return False

        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cuda:0", kv=KV)
            g = epd.gpu.Gpu()
            m = g.map_arena(c, "kvgpu")
            v = m.view(m.data_offset, (64,), "uint8")
            ptr = v.__cuda_array_interface__["data"][0]
            pattern = bytes(range(64))
            ctypes.memmove(ptr, pattern, 64)
            m.close()
            with self.assertRaises(ValueError):
                m.view(m.data_offset, (4,), "uint8")
            self.assertTrue(mapped(ptr))
            self.assertEqual(ctypes.string_at(ptr, 64), pattern)
            del v
            gc.collect()
            self.assertFalse(mapped(ptr), "the last view gone, the arena is still mapped")
            g.close()

    def test_ring_close_closes_its_notifiers(self):
        """Ring.close() stops the notifiers that submit to it first (their threads never
        touch a freed ring); a closed notifier's calls are refused."""
        from epd.handoff import Ring
        with epd.Client(self.d.address) as p:
            p.register("prefill", "m", "cuda:0", kv=KV)
            g = epd.gpu.Gpu()
            ring = Ring(p)
            n = epd.gpu.Notifier(g, 0, ring)
            n.flush(1)
            ring.close()
            with self.assertRaises(ValueError):
                n.flush(1)
            with self.assertRaises(ValueError):
                n.ready_after(0, b"%032x" % 1, 1, 0)
            with self.assertRaises(ValueError):
                ring.next(0)
            n.close()
            g.close()

    def test_ring_and_notifier_collected_together(self):
        """A ring and its notifier that are garbage together (one cycle: their
        finalizers run in no set order): the ring's side is closed after the notifier's
        thread stopped, whichever finalizer runs first. Before, the ring's could free it
        while the notifier's close still flushed into it."""
        import gc
        from epd.handoff import Ring
        g = epd.gpu.Gpu()
        for case in ("ring first", "notifier first", "cycle"):
            with epd.Client(self.d.address) as p:  # one ring a client
                p.register("prefill", "m", "cuda:0", kv=KV)
                ring = Ring(p)
                n = epd.gpu.Notifier(g, 0, ring)
                self.assertTrue(ring._r)
                if case == "ring first":
                    ring.__del__()  # what the collector may run first
                    self.assertTrue(ring._r, "closed under its notifier")
                    self.assertTrue(ring._close_pending)
                    n.close()
                    self.assertIsNone(ring._r, "the notifier's close closes it")
                elif case == "notifier first":
                    n.close()
                    ring.__del__()
                    self.assertIsNone(ring._r)
                else:
                    ring.cycle, n.cycle = n, ring
                    del ring, n
                    gc.collect()
        g.close()

    def test_connector_notifier_does_not_keep_its_client(self):
        """epd.workers.connector's notifier of a ring (_notifier(): one per ring and GPU) is
        kept on the ring, not in a module-level cache, which held the notifier, through
        it the ring and through that the client, for ever (its connection, its fds, the
        notifier's thread): a client whose ring had one is collected once dropped, closed
        ring or not, and Ring.close() closes the notifier and lets go of it."""
        import gc
        import weakref
        from epd.handoff import Ring
        from epd.workers import connector as C
        for close_ring in (True, False):
            c = epd.Client(self.d.address)
            c.register("prefill", "m", "cuda:0", kv=KV)
            ring = Ring(c)
            n = C._notifier(ring, 0)
            self.assertIs(C._notifier(ring, 0), n, "one notifier per ring and GPU")
            n.flush(1)
            client, ring_ref, notifier = weakref.ref(c), weakref.ref(ring), weakref.ref(n)
            if close_ring:
                ring.close()
                with self.assertRaises(ValueError):
                    n.flush(1)  # closed with its ring
                del n
                gc.collect()
                self.assertIsNone(notifier(), "Ring.close() closed the notifier and kept it")
            del c, ring
            n = None
            gc.collect()
            self.assertIsNone(notifier(), f"the notifier outlived its dropped ring (ring closed: {close_ring})")
            self.assertIsNone(ring_ref(), f"the ring outlived its dropped client (ring closed: {close_ring})")
            self.assertIsNone(client(), f"a dropped client is kept by its ring's notifier (ring closed: {close_ring})")

    def test_every_feature_dtype_views_a_gpu_arena(self):
        """Every dtype a feature may have (proto/feature-desc.c, epd.feature's names) is
        one GpuArena.view() takes, with the feature's element size (Feature.cuda() and
        GpuArena.torch() go through it), and one the encoder's produce() can name
        (connector._DT_NAMES): bool, float8_e4m3fn and float8_e5m2 were refused. A
        feature of those in a GPU feature arena: views of its tensors where they are,
        typestr "|b1" for bool and raw bytes of the size ("|V1") for the float8 types,
        which torch imports as uint8 and views as the dtype. (torch itself: on the GPU
        machine, device_gpu_torch.py.)"""
        import epd.feature as ef
        from epd.workers import connector as C
        for short, name in ef._TORCH.items():
            self.assertIn(name, epd.gpu._TYPESTR)
            self.assertEqual(epd.gpu._SIZE[name], ef._SIZE[short], name)
            self.assertEqual(C._DT_NAMES[name], short, name)
        for name, as_dtype in epd.gpu._IMPORT_AS.items():
            self.assertEqual(epd.gpu._SIZE[as_dtype], epd.gpu._SIZE[name])
            self.assertNotIn("V", epd.gpu._TYPESTR[as_dtype])  # a typestr torch imports

        class Fake:  # what _layout reads of a torch tensor
            __module__ = "torch.fake"

            def __init__(self, dtype, shape):
                self.dtype, self.shape = dtype, shape

            def element_size(self):
                return 1
        spec, nbytes = C._layout({"mask": Fake("torch.bool", (3, 5)), "e4m3": Fake("torch.float8_e4m3fn", (4, 4)),
                                  "e5m2": Fake("torch.float8_e5m2", (2, 8))})
        self.assertEqual([(t.name, t.dtype, t.offset) for t in spec],
                         [("mask", "bool", 0), ("e4m3", "fp8_e4m3", 256), ("e5m2", "fp8_e5m2", 512)])
        self.assertEqual(nbytes, 528)
        feat = "[Arena:featgpu]\nDomain=gpu\nGpu=0\nUsage=feature\nSize=32M\nPageSize=64K\n"
        d = Daemon(ARENA + feat, env=gpu_env("gpu"))
        try:
            with epd.Client(d.address) as c:
                c.register("encoder", "m", "cuda:0")
                f = ef.Feature.reserve(c, "img:dtypes", nbytes, spec)
                m = C._feature_gpu_arena(c, f)
                self.assertIsNotNone(m, "the feature is not in the GPU feature arena")
                want = {}
                for i, t in enumerate(f.tensors):
                    v = m.view(f.offset + t.offset, t.shape, ef._TORCH[t.dtype])
                    cai = v.__cuda_array_interface__
                    self.assertEqual(cai["typestr"], "|b1" if t.dtype == "bool" else "|V1", t.dtype)
                    self.assertEqual((cai["data"][0], cai["shape"]), (m.device_pointer + f.offset + t.offset, t.shape))
                    n = 1
                    for x in t.shape:
                        n *= x
                    want[t.name] = bytes((i * 64 + j) % 2 if t.dtype == "bool" else (i * 64 + j) % 256
                                         for j in range(n))
                    ctypes.memmove(cai["data"][0], want[t.name], n)  # the stand-in's memory is this process's
                f.publish(1)
                f.release()
                with ef.Feature.acquire(c, "img:dtypes") as g:
                    self.assertEqual(g.result, "hit")
                    for t in g.tensors:
                        v = m.view(g.offset + t.offset, t.shape, ef._TORCH[t.dtype])
                        self.assertEqual(ctypes.string_at(v.pointer, len(want[t.name])), want[t.name], t.name)
        finally:
            self.assertEqual(d.stop(), 0)

    def test_notifier_reports_groups_ready_from_events(self):
        """epd.gpu.Notifier: each group's event recorded on the stream, LayerGroupReady
        put on the ring by libepd's thread; the decode side sees every group; a failed
        event (the stand-in driver's FAKE_CUDA_FAIL_EVENTS) is never reported ready and
        flush() raises it."""
        from epd.handoff import Accepted, Handoff, Ring
        from epd.sequence import Sequence
        with epd.Client(self.d.address) as p, epd.Client(self.d.address) as d:
            p.register("prefill", "m", "cuda:0", kv=KV)
            d.register("decode", "m", "cuda:0", kv=KV)
            g = epd.gpu.Gpu()
            with Ring(d) as dring, Ring(p) as pring:
                n = epd.gpu.Notifier(g, 0, pring)
                seq = Sequence.create(p, "kvgpu", 2)

                def landed(h, a, submitted):
                    """Both groups reported after their events, landed, committed, released."""
                    n.flush(10)
                    self.assertEqual((n.pending, n.submitted), (0, submitted))
                    self.assertEqual(a.wait_groups(2, dring, timeout_s=5), 2)
                    Sequence(d, a.commit(), a.arena).release()
                    a.release(dring)
                    h.release(pring)
                rid = "%032x" % 0x6161
                h = Handoff.prepare(p, rid, "", seq.path, [2, 2])
                a = Accepted.accept(d, rid, wait_s=1)
                for grp in range(2):
                    n.ready_after(0, rid.encode(), h.token, grp)
                landed(h, a, 2)

                # Every group after one event (a save written in one launch).
                rid = "%032x" % 0x6163
                h = Handoff.prepare(p, rid, "", seq.path, [2, 2])
                a = Accepted.accept(d, rid, wait_s=1)
                with self.assertRaises(epd.EpdError):
                    n.ready_after_range(0, rid.encode(), h.token, 0, 0)
                n.ready_after_range(0, rid.encode(), h.token, 0, 2)
                landed(h, a, 4)

                rid = "%032x" % 0x6162
                h = Handoff.prepare(p, rid, "", seq.path, [2, 2])
                os.environ["FAKE_CUDA_FAIL_EVENTS"] = "1"
                try:
                    n.ready_after(0, rid.encode(), h.token, 0)
                    with self.assertRaises(epd.EpdError) as e:
                        n.flush(10)
                finally:
                    os.environ.pop("FAKE_CUDA_FAIL_EVENTS")
                self.assertIn("layer groups reported ready", str(e.exception))
                self.assertEqual(n.submitted, 4)
                self.assertEqual(h.status()["groups_done"], 0)
                h.rollback()
                h.release()
                seq.release()
                n.close()
            g.close()

    def test_host_arena_is_not_a_gpu_arena(self):
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cuda:0", kv=KV)
            g = epd.gpu.Gpu()
            with self.assertRaises(epd.EpdError) as e:
                g.map_arena(c, "nosuch")
            self.assertEqual(e.exception.name, "org.epd1.Error.NotFound")
            g.close()

    def test_closed_client_refused(self):
        """map_arena() on a closed client is ValueError("the client is closed"), as the
        client's own calls are (it was EpdError NotFound: no arena of that name)."""
        c = epd.Client(self.d.address)
        c.register("prefill", "m", "cuda:0", kv=KV)
        g = epd.gpu.Gpu()
        g.map_arena(c, "kvgpu").close()
        c.close()
        with self.assertRaises(ValueError) as e:
            g.map_arena(c, "kvgpu")
        self.assertIn("the client is closed", str(e.exception))
        g.close()

    def test_out_of_range_arguments_refused(self):
        """A stream, token, layer group, page size or ordinal outside its C type is
        ValueError naming it, before libepd (ctypes kept the low bits: group 2**32 + 1
        was reported as group 1)."""
        from epd.handoff import Ring
        with epd.Client(self.d.address) as p:
            p.register("prefill", "m", "cuda:0", kv=KV)
            g = epd.gpu.Gpu()
            with Ring(p) as ring:
                with self.assertRaises(ValueError):
                    epd.gpu.Notifier(g, 2**32, ring)
                n = epd.gpu.Notifier(g, 0, ring)
                rid = ("%032x" % 0x6a6a).encode()
                for args, word in (((0, rid, 1, 2**32 + 1), "group"), ((0, rid, -1, 0), "token"),
                                   ((-1, rid, 1, 0), "stream")):
                    with self.assertRaises(ValueError) as e:
                        n.ready_after(*args)
                    self.assertIn(word, str(e.exception))
                with self.assertRaises(ValueError) as e:
                    n.ready_after_range(0, rid, 1, 0, 2**32 + 2)
                self.assertIn("count", str(e.exception))
                self.assertEqual(n.submitted, 0)
                n.close()
            m = g.map_arena(p, "kvgpu")
            with self.assertRaises(ValueError):
                m.page_table([0], 4096, stream=-1)
            with self.assertRaises(ValueError):
                epd.gpu.PageTable(g, 0, [m.device_pointer + m.data_offset], 2**64 + 4096)
            m.close()
            g.close()


if __name__ == "__main__":
    unittest.main()


def _per_page(layout, pages, layer, k, v):
    """The per-page path: page i's rows of the layer's K and V, written one token row at a
    time in the page layout (token-major rows of H × D), as bytes by page."""
    import numpy as np
    T, H = layout.tokens_per_block, layout.kv_heads
    out = {p: bytearray(layout.page_size) for p in pages}
    S = k.shape[2]
    for s in range(S):
        page = out[pages[s // T]]
        for kv, x in ((0, k), (1, v)):
            base = layout.k_offset(layer) if kv == 0 else layout.v_offset(layer)
            row = np.ascontiguousarray(x[0, :, s, :]).tobytes()  # H rows of D for token s
            off = base + (s % T) * H * len(row) // H
            page[off: off + len(row)] = row
    return out


class KvCopyTest(unittest.TestCase):
    """The batched scatter/gather of one layer (epd_kv_*, epd.gpu) writes exactly the bytes
    the per-page path writes: partial last pages, several layers (groups), both tensor
    memory layouts; and reads them back. On the stand-in driver the GPU page table takes
    the same path as a GPU without the kernels (one copy per row); the kernel itself is
    checked against the host copy on the GPU machine (gpu-device-test kv-rows)."""

    def layout(self):
        from epd.workers.connector import KvPageLayout
        return KvPageLayout(layers=4, tokens_per_block=16, kv_heads=2, head_dim=64, elem_size=2)

    def tensors(self, layer, S, transposed=False):
        import numpy as np
        rng = np.random.default_rng(layer)
        k = rng.integers(0, 1 << 16, (1, 2, S, 64), dtype=np.uint16).view(np.float16)
        v = rng.integers(0, 1 << 16, (1, 2, S, 64), dtype=np.uint16).view(np.float16)
        if transposed:  # (1, S, H, D) memory seen as (1, H, S, D)
            k = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
            v = np.ascontiguousarray(v.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
        return k, v

    def check_host(self, S, transposed):
        import numpy as np
        L = self.layout()
        pages = [7, 2, 5, 0]
        n = L.pages_for(S)
        arena = np.zeros(8 * L.page_size, dtype=np.uint8)
        addrs = [arena.ctypes.data + p * L.page_size for p in pages[:n]]
        groups = [(0, 1), (2, 3)]  # two layer groups
        for g in groups:
            for layer in g:
                k, v = self.tensors(layer, S, transposed)
                es = 2
                rows = epd.gpu.KvRows(k=k.ctypes.data, v=v.ctypes.data, tokens=S, heads=2, tokens_per_page=16,
                                      row_bytes=64 * es, k_offset=L.k_offset(layer), v_offset=L.v_offset(layer),
                                      head_stride=k.strides[1], token_stride=k.strides[2])
                epd.gpu.kv_write_host(addrs, L.page_size, rows)
                want = _per_page(L, pages[:n], layer, k, v)
                for p in pages[:n]:
                    got = arena[p * L.page_size:(p + 1) * L.page_size]
                    for base in (L.k_offset(layer), L.v_offset(layer)):
                        span = min(16, S) * 2 * 64 * es
                        if p == pages[n - 1] and S % 16:
                            span = (S % 16) * 2 * 64 * es
                        self.assertEqual(got[base:base + span].tobytes(), bytes(want[p][base:base + span]),
                                         f"layer {layer} page {p}")
                k2, v2 = np.zeros((1, 2, S, 64), np.float16), np.zeros((1, 2, S, 64), np.float16)
                rows = epd.gpu.KvRows(k=k2.ctypes.data, v=v2.ctypes.data, tokens=S, heads=2, tokens_per_page=16,
                                      row_bytes=64 * es, k_offset=L.k_offset(layer), v_offset=L.v_offset(layer))
                epd.gpu.kv_read_host(addrs, L.page_size, rows)
                self.assertTrue((k2.view(np.uint16) == np.ascontiguousarray(k).view(np.uint16)).all())
                self.assertTrue((v2.view(np.uint16) == np.ascontiguousarray(v).view(np.uint16)).all())
        # Pages not used are untouched.
        for p in set(range(8)) - set(pages[:n]):
            self.assertFalse(arena[p * L.page_size:(p + 1) * L.page_size].any())

    def test_host_partial_last_page(self):
        self.check_host(50, False)

    def test_host_whole_pages_transposed_memory(self):
        self.check_host(64, True)

    def test_size_one_dimensions_take_any_stride(self):
        """torch calls a tensor contiguous whatever the strides of its size-1 dimensions
        (one KV head, one new token), and K and V may differ there: the connector's rows
        accept them and copy the bytes the per-page path writes."""
        import numpy as np
        from numpy.lib.stride_tricks import as_strided
        from epd.workers.connector import KvPageLayout, KvPages
        L = KvPageLayout(layers=2, tokens_per_block=16, kv_heads=1, head_dim=64, elem_size=2)
        S = 20
        rng = np.random.default_rng(3)
        base_k = rng.integers(0, 1 << 16, 4096, dtype=np.uint16).view(np.float16)
        base_v = rng.integers(0, 1 << 16, 4096, dtype=np.uint16).view(np.float16)
        k = as_strided(base_k, (1, 1, S, 64), (4096 * 2, 999 * 2, 64 * 2, 2))
        v = as_strided(base_v, (1, 1, S, 64), (7 * 2, 5 * 2, 64 * 2, 2))
        kp = object.__new__(KvPages)
        kp.layout = L
        rows = kp._rows(1, k, v, S)
        self.assertEqual((rows.head_stride, rows.token_stride), (S * 64 * 2, 64 * 2))
        pages = [1, 0]
        arena = np.zeros(2 * L.page_size, dtype=np.uint8)
        addrs = [arena.ctypes.data + p * L.page_size for p in pages]
        epd.gpu.kv_write_host(addrs, L.page_size, rows)
        want = _per_page(L, pages, 1, k, v)
        for p in pages:
            got = arena[p * L.page_size:(p + 1) * L.page_size].tobytes()
            self.assertEqual(got, bytes(want[p]), f"page {p}")
        with self.assertRaises(ValueError):  # a real stride difference is still refused
            kp._rows(1, k, as_strided(base_v, (1, 1, S, 64), (0, 0, 128 * 2, 2)), S)

    def test_tensors_must_fit_the_layout(self):
        """The rows take the layout's heads, head size and element size: K/V tensors of
        another shape or dtype (the copy would read or write past them), or a V shaped
        unlike K, are refused before anything is copied."""
        import numpy as np
        from epd.workers.connector import KvPageLayout, KvPages
        L = KvPageLayout(layers=2, tokens_per_block=16, kv_heads=2, head_dim=64, elem_size=2)
        kp = object.__new__(KvPages)
        kp.layout = L
        ok = np.zeros((1, 2, 20, 64), np.float16)
        kp._rows(0, ok, ok.copy(), 20)
        for k, v, tokens in ((np.zeros((1, 1, 20, 64), np.float16), None, 20),  # fewer heads
                             (np.zeros((1, 2, 20, 32), np.float16), None, 20),  # shorter rows
                             (np.zeros((1, 2, 20, 64), np.float32), None, 20),  # wider elements
                             (ok, np.zeros((1, 2, 12, 64), np.float16), 20),    # V shorter than K
                             (ok, None, 24)):                                    # more tokens than given
            with self.assertRaises(ValueError):
                kp._rows(0, k, v if v is not None else k.copy(), tokens)

    def test_bad_rows_are_refused(self):
        import numpy as np
        L = self.layout()
        k = np.zeros((1, 2, 40, 64), np.float16)
        arena = np.zeros(2 * L.page_size, dtype=np.uint8)
        rows = epd.gpu.KvRows(k=k.ctypes.data, v=k.ctypes.data, tokens=40, heads=2, tokens_per_page=16,
                              row_bytes=128, k_offset=L.k_offset(0), v_offset=L.v_offset(0))
        addrs = [arena.ctypes.data, arena.ctypes.data + L.page_size]
        with self.assertRaises(epd.EpdError) as e:  # 40 tokens need 3 pages
            epd.gpu.kv_write_host(addrs, L.page_size, rows)
        self.assertEqual(e.exception.name, f"errno.{e.exception.errno}")  # libepd's own refusal
        # A page size or address outside uint64_t: ValueError, not its low 64 bits.
        for call in (lambda: epd.gpu.kv_write_host(addrs, 2**64 + L.page_size, rows),
                     lambda: epd.gpu.kv_read_host([addrs[0] + 2**64, addrs[1]], L.page_size, rows),
                     lambda: epd.gpu.kv_read_host(addrs, -1, rows)):
            with self.assertRaises(ValueError):
                call()

    @contextlib.contextmanager
    def gpu_prefill(self):
        """A client registered as a prefill worker of an epdd with a GPU arena (the
        stand-in driver in its gpu mode), and the page layout of its KV."""
        os.environ.update(gpu_env("gpu"))
        d = Daemon(ARENA, env=gpu_env("gpu"))
        try:
            kvl = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=2 * 64 * 2,
                               v_bytes_per_token=2 * 64 * 2)
            with epd.Client(d.address) as c:
                c.register("prefill", "m", "cuda:0", kv=kvl)
                yield c, self.layout()
        finally:
            os.environ.pop("EPD_LIBCUDA")
            os.environ.pop("FAKE_CUDA_MODE")
            self.assertEqual(d.stop(), 0)

    @unittest.skipUnless(FAKE, "FAKE_LIBCUDA (the stand-in driver) not given")
    def test_gpu_page_table_on_the_stand_in_driver(self):
        import numpy as np
        from epd.workers.connector import KvPages, gpu_arena
        with self.gpu_prefill() as (c, L):
            m = gpu_arena(c, "kvgpu")
            pages = [3, 1, 4]
            offsets = [m.data_offset + p * L.page_size for p in pages]
            pg = KvPages(c, "kvgpu", L, offsets)
            self.assertTrue(pg.on_gpu)
            # Device pointers are addresses here: numpy tensors stand in for the model's.
            for layer in range(4):
                k, v = self.tensors(layer, 40)
                rows = pg._rows(layer, k, v, 40)
                pg._table(0).write(rows, 0)
                want = _per_page(L, pages, layer, k, v)
                for p in pages:
                    raw = ctypes.string_at(m.device_pointer + m.data_offset + p * L.page_size, L.page_size)
                    for base in (L.k_offset(layer), L.v_offset(layer)):
                        span = (16 if p != pages[-1] else 40 % 16) * 2 * 64 * 2
                        self.assertEqual(raw[base:base + span], bytes(want[p][base:base + span]))
                k2, v2 = np.zeros_like(k), np.zeros_like(v)
                pg._table(0).read(pg._rows(layer, k2, v2, 40), 0)
                self.assertTrue((k2.view(np.uint16) == k.view(np.uint16)).all())
            # Every layer in one call (read_many / write_many): the same bytes; a bad
            # row anywhere refuses the whole call before anything is copied.
            outs = [tuple(np.zeros_like(t) for t in self.tensors(layer, 40)) for layer in range(4)]
            rows = (epd.gpu.KvRows * 4)()
            for layer, (k2, v2) in enumerate(outs):
                rows[layer] = pg._rows(layer, k2, v2, 40)
            pg._table(0).read_many(rows, 0)
            for layer, (k2, v2) in enumerate(outs):
                k, v = self.tensors(layer, 40)
                self.assertTrue((k2.view(np.uint16) == k.view(np.uint16)).all())
                self.assertTrue((v2.view(np.uint16) == v.view(np.uint16)).all())
            new = [tuple(t[::-1].copy() for t in self.tensors(layer, 40)) for layer in range(4)]
            rows = (epd.gpu.KvRows * 4)()
            for layer, (k, v) in enumerate(new):
                rows[layer] = pg._rows(layer, k, v, 40)
            pg._table(0).write_many(rows, 0)
            bad = (epd.gpu.KvRows * 2)()
            k3, v3 = np.zeros_like(new[0][0]), np.zeros_like(new[0][1])
            bad[0] = pg._rows(0, k3, v3, 40)
            bad[1] = pg._rows(1, k3, v3, 40)
            bad[1].tokens = 1000  # past the three pages
            with self.assertRaises(epd.EpdError):
                pg._table(0).read_many(bad, 0)
            self.assertFalse(k3.any())  # nothing was copied
            for layer, (k, v) in enumerate(new):
                k2, v2 = np.zeros_like(k), np.zeros_like(v)
                pg._table(0).read(pg._rows(layer, k2, v2, 40), 0)
                self.assertTrue((k2.view(np.uint16) == k.view(np.uint16)).all())
                self.assertTrue((v2.view(np.uint16) == v.view(np.uint16)).all())
            pg.close()

    @unittest.skipUnless(FAKE, "FAKE_LIBCUDA (the stand-in driver) not given")
    def test_connector_mappings_follow_the_registration(self):
        """epd.workers.connector's GPU arena mappings (gpu_arena) and the GPU arena of
        each feature arena index (_feature_gpu_arena) are kept on the client for its
        registration: a new registration whose arena 0 is another arena maps that one
        (not the earlier arena's cached mapping, which would have a feature's bytes
        written into the wrong arena); a mapping nothing else holds is unmapped when the
        registration changes or the client closes, one a view holds when the view goes;
        a client dropped without close() is collected (a module-level cache held it, and
        its connection, for ever)."""
        import gc
        import types
        import weakref
        from epd.workers.connector import _feature_gpu_arena, gpu_arena
        two = ARENA + "[Arena:kvgpu2]\nDomain=gpu\nGpu=0\nUsage=kv\nSize=32M\n"
        at0 = types.SimpleNamespace(arena=0)  # a feature in arena 0 of the registration
        os.environ.update(gpu_env("gpu"))
        d = Daemon(two, env=gpu_env("gpu"))
        try:
            c = epd.Client(d.address)
            c.register("prefill", "m", "cuda:0", kv=KV, arenas=["kvgpu"])
            self.assertEqual(c.arenas()[0].name, "kvgpu")
            m = _feature_gpu_arena(c, at0)
            self.assertEqual(m.name, "kvgpu")
            self.assertIs(gpu_arena(c, "kvgpu"), m)  # one mapping per arena and registration
            mapped = weakref.ref(m._map)
            del m
            c.unregister()
            self.assertIsNone(mapped(), "the first registration's mapping is still mapped")
            c.register("prefill", "m", "cuda:0", kv=KV, arenas=["kvgpu2"])
            self.assertEqual(c.arenas()[0].name, "kvgpu2")
            m = _feature_gpu_arena(c, at0)
            self.assertEqual(m.name, "kvgpu2", "arena 0 of the new registration mapped as the old one's")
            self.assertIs(gpu_arena(c, "kvgpu2"), m)
            view = m.view(m.data_offset, (16,))
            mapped = weakref.ref(m._map)
            del m
            c.close()
            self.assertIsNotNone(mapped())  # the view keeps its mapping
            del view
            self.assertIsNone(mapped(), "closed, and nothing holds it: still mapped")
            c = epd.Client(d.address)
            c.register("prefill", "m", "cuda:0", kv=KV, arenas=["kvgpu"])
            mapped = weakref.ref(gpu_arena(c, "kvgpu")._map)
            client = weakref.ref(c)
            del c
            gc.collect()
            self.assertIsNone(client(), "a client dropped without close() is kept by its GPU arena mapping")
            self.assertIsNone(mapped())
        finally:
            os.environ.pop("EPD_LIBCUDA")
            os.environ.pop("FAKE_CUDA_MODE")
            self.assertEqual(d.stop(), 0)

    @unittest.skipUnless(FAKE, "FAKE_LIBCUDA (the stand-in driver) not given")
    def test_page_table_keeps_its_arena_mapped(self):
        """A page table made from a GpuArena keeps the mapping alive (the arena object
        collected, the copies still land in mapped memory); closing the arena closes its
        page tables first, and a copy through one is then refused, not sent to memory
        that is no longer mapped."""
        import gc
        import numpy as np
        with self.gpu_prefill() as (c, L):
            g = epd.gpu.Gpu()
            pt = g.map_arena(c, "kvgpu").page_table([3, 1, 4], L.page_size)
            gc.collect()  # the arena object is only the table's now
            k, v = self.tensors(0, 40)
            rows = epd.gpu.KvRows(k=k.ctypes.data, v=v.ctypes.data, tokens=40, heads=2, tokens_per_page=16,
                                  row_bytes=128, k_offset=L.k_offset(0), v_offset=L.v_offset(0))
            pt.write(rows)
            k2, v2 = np.zeros_like(k), np.zeros_like(v)
            pt.read(epd.gpu.KvRows(k=k2.ctypes.data, v=v2.ctypes.data, tokens=40, heads=2,
                                   tokens_per_page=16, row_bytes=128, k_offset=L.k_offset(0),
                                   v_offset=L.v_offset(0)))
            self.assertTrue((k2.view(np.uint16) == k.view(np.uint16)).all())
            self.assertTrue((v2.view(np.uint16) == v.view(np.uint16)).all())
            pt.close()
            m = g.map_arena(c, "kvgpu")
            # Page ids past the arena (or negative) would have the kernels write past the
            # mapping: refused.
            n_pages = (m.size - m.data_offset) // L.page_size
            for bad in ([0, n_pages], [-1]):
                with self.assertRaises(ValueError):
                    m.page_table(bad, L.page_size)
            m.page_table([n_pages - 1], L.page_size).close()
            pt = m.page_table([0, 2], L.page_size)
            m.close()
            with self.assertRaises(ValueError):
                pt.write(rows)
            with self.assertRaises(ValueError):
                m.page_table([0], L.page_size)
            g.close()

    @unittest.skipUnless(FAKE, "FAKE_LIBCUDA (the stand-in driver) not given")
    def test_kv_pages_follow_their_arena_closed(self):
        """KvPages' page tables are the GPU arena's (GpuArena.page_table_at): made only
        while it is mapped, and closed by its close(), like the arena's own; and
        connector.gpu_arena() maps anew once its cached arena was closed. Before, a
        KvPages built its tables at the arena's device addresses on its own: after the
        arena's close its copies went to memory no longer its mapping (here a view keeps
        the range mapped, so that they land somewhere instead of faulting)."""
        import types
        import numpy as np
        from epd.workers.connector import KvPages, _feature_gpu_arena, gpu_arena
        with self.gpu_prefill() as (c, L):
            m = gpu_arena(c, "kvgpu")
            in_kvgpu = types.SimpleNamespace(arena=c.arena("kvgpu").index)  # a feature there
            self.assertIs(_feature_gpu_arena(c, in_kvgpu), m)
            keep = m.view(0, (m.size,))  # the range stays mapped, whatever is closed
            offsets = [m.data_offset + p * L.page_size for p in (3, 1, 4)]
            built, fresh = KvPages(c, "kvgpu", L, offsets), KvPages(c, "kvgpu", L, offsets)
            built._table(0)  # a table made while the arena was mapped
            k, v = self.tensors(0, 40)
            m.close()
            for pg in (built, fresh):
                with self.assertRaises(ValueError):
                    pg.write(0, k, v)
            self.assertFalse(np.frombuffer(ctypes.string_at(m.device_pointer + offsets[0], 64), np.uint8).any())
            m2 = gpu_arena(c, "kvgpu")
            self.assertIsNot(m2, m, "gpu_arena() kept a closed arena")
            self.assertIs(_feature_gpu_arena(c, in_kvgpu), m2)
            pg = KvPages(c, "kvgpu", L, offsets)
            pg.write(0, k, v)
            k2, v2 = np.zeros_like(k), np.zeros_like(v)
            pg._table(0).read(pg._rows(0, k2, v2, 40), 0)
            self.assertTrue((k2.view(np.uint16) == k.view(np.uint16)).all())
            # Pages outside the arena are refused by the arena as well.
            with self.assertRaises(ValueError):
                m2.page_table_at([m2.size - L.page_size // 2], L.page_size)
            with self.assertRaises(ValueError):
                m2.page_table_at([m2.data_offset - 1], L.page_size)
            pg.close()
            del keep

    @unittest.skipUnless(FAKE, "FAKE_LIBCUDA (the stand-in driver) not given")
    def test_kv_reads_land_on_the_arena_gpu(self):
        """KvPages.read()/read_layers() of a GPU arena allocate their tensors on the arena's
        GPU (cuda:ORDINAL), not on torch's current device ("cuda"), where the gather would
        write another GPU's memory; a device the caller names is kept. torch is not needed:
        a stand-in records where the tensors were asked for (on the GPU machine,
        device_gpu_torch.py runs the real thing)."""
        import types
        from unittest import mock
        from epd.workers import connector as C

        class Asked(Exception):
            pass
        asked = []

        def empty(*shape, dtype=None, device=None):
            asked.append(device)
            raise Asked()
        fake = types.SimpleNamespace(empty=empty, float16="float16", bfloat16="bfloat16")
        env = dict(gpu_env("gpu"), FAKE_CUDA_DEVICES="2")
        os.environ.update(env)
        d = Daemon(ARENA.replace("Gpu=0", "Gpu=1"), env=env)
        try:
            with epd.Client(d.address) as c:
                c.register("decode", "m", "cuda:1", kv=epd.KvLayout(4, 16, 2 * 64 * 2, 2 * 64 * 2))
                L = self.layout()
                a = c.arena("kvgpu")
                with mock.patch.dict(C._GPU, clear=True):  # a driver opened with both GPUs
                    pg = C.KvPages(c, "kvgpu", L, [a.data_offset])
                self.assertEqual(pg._m.ordinal, 1)
                with mock.patch.dict(sys.modules, {"torch": fake}):
                    for call in (lambda dev: pg.read(0, 16, "float16", dev),
                                 lambda dev: pg.read_layers([0, 1], 16, "float16", dev)):
                        for dev, want in ((None, "cuda:1"), ("cuda:0", "cuda:0")):
                            asked.clear()
                            with self.assertRaises(Asked):
                                call(dev)
                            self.assertEqual(asked, [want])
                pg.close()
        finally:
            for k in env:
                os.environ.pop(k)
            self.assertEqual(d.stop(), 0)
