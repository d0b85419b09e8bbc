# SPDX-License-Identifier: LGPL-2.1-or-later
"""The worker harness's control flow against a real epdd, without torch or a GPU:
encoder, prefill and decode are separate processes with synthetic numpy tensors of the
small Qwen3-VL shapes. Features go encoder -> prefill through the feature cache (a
repeated image is a hit), KV goes prefill -> decode through pages and a layered handoff
with ring notices; the decode side checks every byte against what the prefill wrote."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from test_binding import Daemon  # noqa: E402

try:
    import numpy  # noqa: F401
    HAVE_NUMPY = True
except ImportError:
    HAVE_NUMPY = False


def expected_branch_tokens(b, spec, branch):
    """What the synthetic follow-up turn must produce if the branch read the first turn's
    KV intact from the shared pages and its own new KV from its pages."""
    import numpy as np
    feats = b.encode(spec) if spec.image_seed is not None else None
    fsum = float(feats["embeds"].astype("float32").sum()) if feats else 0.0
    tokens = b.tokens(spec) + b.branch_suffix(spec, branch)
    P = len(b.tokens(spec)) // 16 * 16
    h = hashlib.sha256()
    for layer in range(b.layers):
        k, v = b.kv(spec, layer, fsum)
        kn, vn = b.branch_kv(spec, branch, layer, len(tokens) - P, k[:, :, :P])
        h.update(np.concatenate([k[:, :, :P], kn], axis=2).tobytes())
        h.update(np.concatenate([v[:, :, :P], vn], axis=2).tobytes())
    return b._tokens_of(h, tokens[-1] % 50000, spec.max_new_tokens), P


def expected_tokens(b, spec, first):
    """What the synthetic decode must produce if every KV byte arrived intact."""
    h = hashlib.sha256()
    feats = b.encode(spec) if spec.image_seed is not None else None
    fsum = float(feats["embeds"].astype("float32").sum()) if feats else 0.0
    for layer in range(b.layers):
        k, v = b.kv(spec, layer, fsum)
        h.update(k.tobytes())
        h.update(v.tobytes())
    d = h.digest()
    return ([first] + [int.from_bytes(d[i:i + 2], "little") for i in range(0, 2 * (spec.max_new_tokens - 1), 2)]
            )[: spec.max_new_tokens]


@unittest.skipUnless(HAVE_NUMPY, "numpy not installed")
class WorkersTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon(state=True)  # the WAL: agent requests use workflows

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def epdctl(self, *args):
        out = subprocess.run([os.environ["EPDCTL"], "-A", self.d.address, "--json", *args],
                             check=True, stdout=subprocess.PIPE).stdout
        return json.loads(out)

    def test_encode_prefill_decode(self):
        from epd.workers import serve
        saved = os.environ.pop("OMP_WAIT_POLICY", None)
        try:
            w = serve.Workers(self.d.address, "synthetic", group_size=2)
            self.assertNotIn("OMP_WAIT_POLICY", os.environ)  # the caller's environment is left alone
        finally:
            if saved is not None:
                os.environ["OMP_WAIT_POLICY"] = saved
        try:
            # Each worker's OpenMP threads sleep when idle (they share the cores).
            for p in w.procs():
                with open(f"/proc/{p.proc.pid}/environ", "rb") as f:
                    self.assertIn(b"OMP_WAIT_POLICY=PASSIVE", f.read().split(b"\0"))
            specs = [serve.Spec(serve.request_id_of(i), image_seed=i % 3 if i != 5 else None, text_seed=i,
                                text_tokens=20 + i, max_new_tokens=8) for i in range(8)]
            results = w.run(specs, concurrency=3)
        finally:
            w.close()
        b = serve.Synthetic()
        hits = 0
        for s, r in zip(specs, results):
            self.assertEqual(r["tokens"], expected_tokens(b, s, r["prefill"]["first"]), s.request_id)
            self.assertEqual(r["prefill"]["prompt_len"], b.prompt_len(s))
            if "encode" in r:
                hits += r["encode"]["result"] == "hit"
        # Images 0, 1, 2 repeat: after the first of each, the encoder is skipped.
        self.assertGreaterEqual(hits, 3)
        # Nothing is left behind: every page is free, no handoff remains.
        pools = self.epdctl("pages")["pools"]
        kv = [p for p in pools if p["arena"] == "host0"][0]
        self.assertEqual(kv["free"], kv["total"], pools)
        self.assertEqual(self.epdctl("sequences"), [])

    def test_prefill_overlaps_the_encoder(self):
        """The prefill starts once the encoder has the feature in epdd, not when the
        encoder replies: its Acquire, sequence and Prepare run while the tower does and it
        waits for the Publish, woken by epdd. With a tower of 300 ms, the prefill's wait
        for its feature is most of it, and TTFT is less than the encoder's and the
        prefill's times end to end; the bytes are still the ones the encoder made."""
        from epd.workers import serve
        os.environ["EPD_SYNTHETIC_ENCODE_MS"] = "300"
        try:
            w = serve.Workers(self.d.address, "synthetic", group_size=2)
        finally:
            del os.environ["EPD_SYNTHETIC_ENCODE_MS"]
        try:
            specs = [serve.Spec(serve.request_id_of(40 + i), image_seed=40 + i, text_seed=i, text_tokens=20,
                                max_new_tokens=4) for i in range(2)]
            results = w.run(specs, concurrency=1)
        finally:
            w.close()
        b = serve.Synthetic()
        for s, r in zip(specs, results):
            self.assertEqual(r["encode"]["result"], "produced")
            self.assertEqual(r["tokens"], expected_tokens(b, s, r["prefill"]["first"]), s.request_id)
            self.assertGreater(r["prefill"]["feature_wait_s"], 0.15, r["prefill"])
            self.assertLess(r["ttft_s"], r["encode"]["t"] + r["prefill"]["t"] - 0.15)
            self.assertLess(r["prefill"]["fetch_s"], 0.15)  # the wait is not counted as the fetch
            # Its tail is epd's: the Publish going out to the prefill awake, on one clock.
            self.assertTrue(r["prefill"]["fetch_detail"]["waited"])
            woken = r["prefill"]["fetch_detail"]["woke_at"] - r["encode"]["detail"]["publish_at"]
            self.assertGreaterEqual(woken, 0.0)
            self.assertLess(woken, 0.15)
        self.check_clean()

    def check_clean(self):
        pools = self.epdctl("pages")["pools"]
        kv = [p for p in pools if p["arena"] == "host0"][0]
        self.assertEqual(kv["free"], kv["total"], pools)
        self.assertEqual(self.epdctl("sequences"), [])
        self.assertEqual(self.epdctl("journal")["workflows"], 0)
        self.assertEqual(self.epdctl("handoffs").get("handoffs", []), [])

    def run_mix(self, layout):
        """Plain and agent requests; an agent request's follow-up turns fork branches of
        its first turn's KV through a workflow."""
        from epd.workers import serve
        w = serve.Workers(self.d.address, "synthetic", group_size=2, layout=layout, gpus=1)
        try:
            self.assertEqual(len(w.placement()), sum(serve.parse_layout(layout).values()))
            self.assertTrue(all(p["gpu"] == 0 for p in w.placement()))
            self.assertTrue(all(p["pid"] for p in w.placement()))  # every process ready, encoders first
            n = serve.parse_layout(layout)
            self.assertEqual(serve.model_copies(n), {"whole": n["prefill"] + n["decode"], "towers": n["encoder"]})
            specs = [serve.Spec(serve.request_id_of(i), image_seed=i % 2 if i != 3 else None, text_seed=i,
                                text_tokens=20 + 3 * i, max_new_tokens=8, branches=2 if i % 3 == 1 else 0,
                                branch_tokens=10 + i)
                     for i in range(6)]
            results = w.run(specs, concurrency=3)
        finally:
            w.close()
        b = serve.Synthetic()
        n_branches = 0
        for s, r in zip(specs, results):
            self.assertEqual(r["tokens"], expected_tokens(b, s, r["prefill"]["first"]), s.request_id)
            self.assertEqual(len(r.get("branches", [])), s.branches)
            for i, br in enumerate(r.get("branches", [])):
                want, P = expected_branch_tokens(b, s, i)
                self.assertEqual(br["tokens"], want, (s.request_id, i))
                self.assertEqual(br["branch"], i + 1)
                self.assertEqual(br["shared_pages"], P // 16)
                self.assertEqual(br["reused_tokens"], P)
                self.assertEqual(br["computed_tokens"], b.prompt_len(s) + s.branch_tokens - P)
                self.assertEqual(br["cow_copies"], 0)
                n_branches += 1
        self.assertEqual(n_branches, 4)
        self.check_clean()
        return results

    def test_agent_branches(self):
        self.run_mix("1E1P1D")

    def test_layouts(self):
        """Several prefill and decode processes (all on 'GPU 0' here); without an
        encoder process the prefill workers encode, through the feature cache."""
        for layout in ("1E1P2D", "2P2D"):
            res = self.run_mix(layout)
            if layout == "2P2D":
                self.assertTrue(all("encode" in r for r in res if r["prefill"]["prompt_len"] > 100))

    def test_ring_keeps_up(self):
        """Many requests with one notice per layer on small rings: more events than a
        completion ring holds. The workers drain their rings, so the daemon never falls
        back to D-Bus signals, and no request's events are lost to another's wait."""
        from epd.workers import serve
        w = serve.Workers(self.d.address, "synthetic", group_size=1, ring_entries=64)
        try:
            specs = [serve.Spec(serve.request_id_of(100 + i), image_seed=None, text_seed=i, text_tokens=16,
                                max_new_tokens=2) for i in range(48)]
            results = w.run(specs, concurrency=4)
        finally:
            w.close()
        self.assertEqual(len(results), len(specs))
        counters = self.epdctl("handoffs")["counters"]
        self.assertGreater(counters["groups"], 64, counters)
        self.assertEqual(counters["ring-fallbacks"], 0, counters)
        self.assertEqual(counters["committed"], len(specs), counters)


def _die_loading(conn):
    """A worker process that dies hard while it loads its model (the OOM killer, a
    segfault): no word on the pipe, its end of it still open until it dies."""
    os.kill(os.getpid(), signal.SIGKILL)


class WaitReadyTest(unittest.TestCase):
    """Workers._wait_ready with a worker process that dies before it is ready: an error
    naming the worker and how it ended, never a wait for ever. The process is started
    as Workers() starts its workers (spawn, a pipe); no epdd needed."""

    def wait_ready(self, close_child_end: bool):
        import multiprocessing as mp
        from epd.workers import serve
        ctx = mp.get_context("spawn")
        a, b = ctx.Pipe()
        p = ctx.Process(target=_die_loading, args=(b,), daemon=True)
        p.start()
        if close_child_end:
            b.close()  # as Workers() does: only the child holds its end
        else:
            self.addCleanup(b.close)  # another process holds it (one the worker started)
        w = object.__new__(serve.Workers)
        w.pools = {"encoder": [serve._Proc("encoder", 0, p, a, None)], "prefill": [], "decode": []}
        out = {}

        def run():
            try:
                w._wait_ready(w.procs())
            except BaseException as e:
                out["e"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(20)
        self.assertFalse(t.is_alive(), "_wait_ready still waits 20 s after the worker died")
        e = out.get("e")
        self.assertIsInstance(e, RuntimeError, repr(e))
        self.assertIn(f"encoder worker 0 (pid {p.pid}) died before it was ready", str(e))
        self.assertIn("killed by SIGKILL (exit code -9)", str(e))

    def test_dead_worker_seen_by_eof(self):
        self.wait_ready(close_child_end=True)

    def test_dead_worker_seen_by_liveness(self):
        self.wait_ready(close_child_end=False)


if __name__ == "__main__":
    unittest.main()
