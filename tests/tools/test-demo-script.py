#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""scripts/demo.sh, on the build under test (EPD_BUILD_DIR): it says what it does, one line
per step with its time; its daemons keep their state in the demo's own temporary
directory (epdctl status shows it), never the host's /var/lib/epd (a journal left there
broke the next test run); it runs twice in a row; and it removes its daemons, namespaces
and directory on every exit path: success, and SIGTERM in the middle of the workload.
The two-host run (network namespaces) needs root; without it that part skips."""

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from epdtest import BUILD, SOURCE  # noqa: E402

DEMO = os.path.join(SOURCE, "scripts", "demo.sh")


def env(local):
    e = dict(os.environ, EPD_BUILD_DIR=BUILD)
    e.pop("EPD_DEMO_LOCAL", None)
    if local:
        e["EPD_DEMO_LOCAL"] = "1"
    return e


def pids_mentioning(text):
    """Processes whose command line mentions text (the demo's directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def namespaces():
    p = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return p.stdout if p.returncode == 0 else ""


class Demo(unittest.TestCase):
    def check_run(self, local):
        p = subprocess.run([DEMO], capture_output=True, text=True, timeout=180, env=env(local))
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        out = p.stdout
        workdir = re.search(r"^Working directory: (/tmp/epd-demo-\S+)", out, re.M).group(1)
        # One line per step, each with its time.
        steps = re.findall(r"^\[(\d+)\] (.*?)(?: \.\.\. .*\((\d+\.\d) s\)|:)$", out, re.M)
        self.assertGreaterEqual(len(steps), 2, out)
        self.assertRegex(out, r"\[\d+\] done in \d+\.\d s")
        self.assertIn("every byte as the encoder wrote it", out)
        self.assertNotIn("MISMATCH", out)
        # The terms explained, what to try next.
        self.assertIn("progress notice   a record epdd writes", out)
        self.assertIn("rate              completed requests per second", out)
        self.assertIn("Try next", out)
        self.assertRegex(out, r"Demo finished in \d+\.\d s\.")
        # Everything it made is gone.
        self.assertFalse(os.path.exists(workdir))
        self.assertEqual(pids_mentioning(workdir), [])
        self.assertIn(f"{workdir} removed.", out)
        return out, workdir

    def test_local_twice(self):
        for _ in range(2):
            out, workdir = self.check_run(local=True)
            # Its daemon kept its WAL in the demo's directory.
            self.assertIn(f"  state:        {workdir}/state\n", out)

    def test_two_hosts(self):
        if os.geteuid() != 0 or subprocess.run(["ip", "netns", "add", "epd-demo-probe"]).returncode != 0:
            self.skipTest("network namespaces need root")
        subprocess.run(["ip", "netns", "del", "epd-demo-probe"])
        out, workdir = self.check_run(local=False)
        self.assertIn("prefill-host -> decode-host, across hosts", out)
        self.assertIn("2 namespace(s)", out)
        made = re.search(r"network namespaces (\S+) and (\S+) joined", out).groups()
        left = namespaces().split()
        for ns in made:
            self.assertNotIn(ns, left)

    def test_failed_step_says_so(self):
        # A step that fails (here the dependency check, as on a machine without the
        # package registry) stops the demo with that command's status, says "failed"
        # and shows its last lines; before, its output went to /dev/null and a failed
        # build left "[3] Building ... " as the demo's last words.
        tmp = tempfile.mkdtemp(prefix="epd-demo-fail-")
        try:
            os.mkdir(os.path.join(tmp, "scripts"))
            shutil.copy(DEMO, os.path.join(tmp, "scripts", "demo.sh"))
            deps = os.path.join(tmp, "scripts", "install-deps.sh")
            with open(deps, "w") as f:
                f.write("#!/bin/sh\necho 'E: Unable to locate package libmicrohttpd-dev' >&2\nexit 100\n")
            os.chmod(deps, 0o755)
            before = set(glob.glob("/tmp/epd-demo-step-*"))
            e = env(local=True)
            e.pop("EPD_BUILD_DIR")
            p = subprocess.run([os.path.join(tmp, "scripts", "demo.sh")], capture_output=True, text=True,
                               timeout=60, env=e)
            self.assertEqual(p.returncode, 100, p.stdout + p.stderr)
            self.assertRegex(p.stdout, r"\[1\] Checking build dependencies .* \.\.\. failed \(\d+\.\d s\)\n$")
            self.assertIn("scripts/install-deps.sh exited with status 100; its last lines:\n"
                          "E: Unable to locate package libmicrohttpd-dev\n", p.stderr)
            self.assertEqual(set(glob.glob("/tmp/epd-demo-step-*")), before)  # its log went too
            self.assertFalse(os.path.exists(os.path.join(tmp, "build-release")))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_sigterm_mid_workload(self):
        proc = subprocess.Popen([DEMO, "--requests=100000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env(local=True))
        workdir, lines = None, []
        deadline = time.monotonic() + 60
        for line in proc.stdout:
            lines.append(line)
            m = re.match(r"Working directory: (/tmp/epd-demo-\S+)", line)
            if m:
                workdir = m.group(1)
            if "Running the workload" in line:
                break
            if time.monotonic() > deadline:
                break
        self.assertIsNotNone(workdir, "".join(lines))
        time.sleep(0.5)  # well into the workload
        self.assertTrue(os.path.exists(workdir))
        proc.send_signal(signal.SIGTERM)
        rest = proc.stdout.read()
        proc.stdout.close()
        self.assertEqual(proc.wait(30), 143, rest)
        self.assertIn("Cleaned up: 1 daemon(s) stopped", rest)
        self.assertFalse(os.path.exists(workdir))
        for _ in range(50):
            if not pids_mentioning(workdir):
                break
            time.sleep(0.1)
        self.assertEqual(pids_mentioning(workdir), [])


if __name__ == "__main__":
    unittest.main(verbosity=2)
