# SPDX-License-Identifier: LGPL-2.1-or-later
"""epd.placement against a real epdd (one host: the directory's owner is this host):
the longest cached prefix, the worker that published it, named errors."""

import json
import os
import signal
import subprocess
import socket
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import epd  # noqa: E402
import epd.placement  # noqa: E402
import epd.sequence  # noqa: E402
from test_binding import Daemon  # noqa: E402

KV = epd.KvLayout(layers=4, tokens_per_block=16, k_bytes_per_token=256, v_bytes_per_token=256)


class PlacementTest(unittest.TestCase):
    def setUp(self):
        self.d = Daemon()

    def tearDown(self):
        self.assertEqual(self.d.stop(), 0)

    def test_locate(self):
        with epd.Client(self.d.address) as c:
            c.register("prefill", "m", "cpu", kv=KV, name="prefill-0")
            s = epd.sequence.Sequence.create(c, "host0", 4)
            chain = [101, 102, 103, 104]
            self.assertEqual(s.publish(0, chain[:3]), 3)
            p = epd.placement.locate_prefix(c, chain)
            self.assertEqual((p.n_blocks, p.host, p.arena, p.worker, p.owners_missing),
                             (3, "py-host", "host0", "prefill-0", 0))
            self.assertEqual(p.candidates, [epd.placement.Candidate("py-host", "host0", "prefill-0", 3)])
            # A chain that diverges at its second block: the prefix up to it.
            self.assertEqual(epd.placement.locate_prefix(c, [101, 999, 103]).n_blocks, 1)
            # Nobody holds the first block.
            p = epd.placement.locate_prefix(c, [7, 101])
            self.assertEqual((p.n_blocks, p.host, p.candidates), (0, "", []))
            # Released sequences leave their blocks cached: still found.
            s.release()
            self.assertEqual(epd.placement.locate_prefix(c, chain).n_blocks, 3)
            with self.assertRaises(epd.EpdError) as e:
                epd.placement.locate_prefix(c, [])
            self.assertEqual(e.exception.name, "org.epd1.Error.InvalidArgument")
            with self.assertRaises(epd.EpdError) as e:
                epd.placement.locate_prefix(c, list(range(65537)))
            self.assertEqual(e.exception.name, "org.epd1.Error.LimitExceeded")
            # A hash outside uint64_t is refused, not cut to its low 64 bits (which found
            # the chain of 101 for 2**64 + 101).
            for bad in ([2**64 + 101], [101, -1]):
                with self.assertRaises(ValueError) as e:
                    epd.placement.locate_prefix(c, bad)
                self.assertIn("hashes[", str(e.exception))

    def test_reload_keeps_the_live_owners(self):
        """The directory's owners are this host and the peers that are up. A reload
        (SIGHUP) leaves that to the cluster's membership: a configured peer that never
        came up does not become the owner of half the hashes, whose entries would then
        be sent to it and lost (LocatePrefix finding no holder for them)."""
        self.d.stop()
        keydir = tempfile.mkdtemp(prefix="epd-py-key-")
        key = os.path.join(keydir, "key")
        with open(key, "w") as f:
            f.write("0123456789abcdef0123456789abcdef\n")
        os.chmod(key, 0o600)
        ports = []
        for _ in range(2):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
            s.close()
        self.d = Daemon(f"[Cluster]\nListen=127.0.0.1:{ports[0]}\nClusterKeyFile={key}\n"
                        f"[Peer:ghost]\nAddress=127.0.0.1:{ports[1]}\nHostId=ghost\n")
        try:
            with epd.Client(self.d.address) as c:
                c.register("prefill", "m", "cpu", kv=KV, name="prefill-0")
                first = list(range(1001, 1033))
                s = epd.sequence.Sequence.create(c, "host0", len(first))
                self.assertEqual(s.publish(0, first), len(first))
                self.assertEqual(epd.placement.locate_prefix(c, first).n_blocks, len(first))
                self.d.proc.send_signal(signal.SIGHUP)
                time.sleep(0.3)
                again = list(range(2001, 2033))
                t = epd.sequence.Sequence.create(c, "host0", len(again))
                self.assertEqual(t.publish(0, again), len(again))
                for chain in (first, again):
                    p = epd.placement.locate_prefix(c, chain)
                    self.assertEqual((p.n_blocks, p.owners_missing), (len(chain), 0))
                # Every entry stayed with this host, the only owner up: none was sent
                # to the configured peer that never came up.
                out = subprocess.run([os.environ["EPDCTL"], "-A", self.d.address, "--json", "cluster"], check=True,
                                     stdout=subprocess.PIPE).stdout
                directory = json.loads(out)["directory"]
                self.assertEqual((directory["send-failures"], directory["published-forwarded"]), (0, 0))
                s.release()
                t.release()
        finally:
            os.unlink(key)
            os.rmdir(keydir)


if __name__ == "__main__":
    unittest.main()
