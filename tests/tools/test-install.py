#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Installing and using epd as the README says:
- units/postinstall.sh creates user epd, /etc/epd, /var/lib/epd and reloads systemd only
  for a system prefix (/usr, /usr/local) or -Dsystem_setup=true: `meson install` as root
  into a custom prefix used to create the user and change the host's /var/lib/epd. (Run
  here with the host-changing tools replaced by recorders on PATH: the test itself must
  not change the host.)
- `import epd` finds libepd where meson installed it (`meson install --destdir`, prefix
  relative) and in the build tree (BUILD/python), with no LD_LIBRARY_PATH or EPD_LIBRARY.
- The README's C worker and Python worker, and docs/api.md's Python example, as written,
  build and run against epdd.
- The man pages of every command are installed."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from epdtest import BUILD, SOURCE, Daemon  # noqa: E402

MESON = os.environ.get("MESON", "meson")
# A sanitized libepd needs its runtime preloaded into an interpreter (python/meson.build).
PRELOAD = os.environ.get("EPD_TEST_PRELOAD", "")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "EPD_LIBRARY", "PYTHONPATH",
                                                            "EPD_SOCKET", "EPD_BUS_ADDRESS")}
    env.update(extra)
    return env


def readme_block(lang):
    with open(os.path.join(SOURCE, "README.md")) as f:
        text = f.read()
    m = re.search(r"```" + lang + r"\n(.*?)```", text, re.S)
    assert m, f"no {lang} block in the README"
    return m.group(1)


class Install(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="epd-install-")
        cls.dest = os.path.join(cls.tmp, "dest")
        p = subprocess.run([MESON, "install", "-C", BUILD, "--destdir", cls.dest, "--no-rebuild", "--quiet"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def python(self, code, pythonpath, **env):
        env = clean_env(PYTHONPATH=pythonpath, PYTHONDONTWRITEBYTECODE="1", **env)
        if PRELOAD:
            env["LD_PRELOAD"] = PRELOAD
            env["ASAN_OPTIONS"] = "detect_leaks=0"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)

    def test_python_finds_installed_library(self):
        site = os.path.join(self.dest, "usr", "lib", "python3", "dist-packages")
        self.assertTrue(os.path.exists(os.path.join(site, "epd", "_where.py")))
        p = self.python("import epd._lib as l; print(l._find_library()); l.lib()", site)
        self.assertEqual(p.returncode, 0, p.stderr)
        found = p.stdout.strip()
        self.assertTrue(found.startswith(self.dest + "/usr/lib/") and found.endswith("/libepd.so.0"), found)
        self.assertTrue(os.path.exists(found))

    def test_python_finds_build_library(self):
        p = self.python("import epd._lib as l; print(l._find_library()); l.lib()", os.path.join(BUILD, "python"))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(p.stdout.strip().startswith(os.path.join(BUILD, "client", "libepd.so")), p.stdout)

    def test_readme_python_worker(self):
        site = os.path.join(self.dest, "usr", "lib", "python3", "dist-packages")
        p = self.python(readme_block("python"), site, EPD_SOCKET=self.daemon.socket)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertRegex(p.stdout, r"^/org/epd1/worker/[0-9a-f]{32} \d+\n$")

    def test_api_md_python_example(self):
        # docs/api.md's Python example, as written, with the installed package.
        with open(os.path.join(SOURCE, "docs", "api.md")) as f:
            text = f.read()
        m = re.search(r"^## Python\n.*?```python\n(.*?)```", text, re.S | re.M)
        self.assertIsNotNone(m, "docs/api.md has no Python section with an example")
        site = os.path.join(self.dest, "usr", "lib", "python3", "dist-packages")
        d = Daemon()  # its own: the example's KV layout fixes host0's page size
        try:
            p = self.python(m.group(1), site, EPD_SOCKET=d.socket)
        finally:
            d.close()
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stdout, "hit 00010203\norg.epd1.Error.NotFound\n")

    def test_readme_c_worker(self):
        src = os.path.join(self.tmp, "worker.c")
        with open(src, "w") as f:
            f.write(readme_block("c"))
        exe = os.path.join(self.tmp, "worker")
        cflags = ["-std=gnu11", "-Wall", "-Wextra", "-Werror"]
        if "address" in os.environ.get("B_SANITIZE", ""):
            cflags += ["-fsanitize=address,undefined"]
        # What `pkg-config --cflags --libs libepd` gives an installed epd: the header and
        # the library, here the build's.
        p = subprocess.run(["cc", *cflags, src, "-o", exe, "-I", os.path.join(SOURCE, "client", "include"),
                            "-L", os.path.join(BUILD, "client"), "-Wl,-rpath," + os.path.join(BUILD, "client"),
                            "-lepd"], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stderr)
        env = clean_env(EPD_SOCKET=self.daemon.socket, ASAN_OPTIONS="detect_leaks=1")
        p = subprocess.run([exe], capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertRegex(p.stdout, r"^registered as /org/epd1/worker/[0-9a-f]{32}; arena host0 mapped at 0x")
        # Without a daemon it says so and fails.
        p = subprocess.run([exe], capture_output=True, text=True, timeout=60,
                           env=clean_env(EPD_SOCKET=os.path.join(self.tmp, "none")))
        self.assertEqual(p.returncode, 1)
        self.assertIn("Cannot reach epdd", p.stderr)
        # The pkg-config file says the same.
        pc = os.path.join(self.dest, "usr", "lib")
        pcs = [os.path.join(d, f) for d, _, fs in os.walk(pc) for f in fs if f == "libepd.pc"]
        self.assertEqual(len(pcs), 1, pcs)

    def test_man_pages_installed(self):
        man = os.path.join(self.dest, "usr", "share", "man")
        for page in ("man8/epdd.8", "man1/epdctl.1", "man1/epdtop.1", "man1/epd-demo.1", "man5/epd.conf.5"):
            self.assertTrue(os.path.exists(os.path.join(man, page)), page)


class PostInstall(unittest.TestCase):
    """units/postinstall.sh decides; the tools it would run are recorders here."""

    def run_script(self, prefix, setup):
        tmp = tempfile.mkdtemp(prefix="epd-postinstall-")
        try:
            bin_ = os.path.join(tmp, "bin")
            os.mkdir(bin_)
            log = os.path.join(tmp, "calls")
            for tool in ("systemd-sysusers", "systemd-tmpfiles", "busctl", "systemctl"):
                with open(os.path.join(bin_, tool), "w") as f:
                    f.write(f"#!/bin/sh\necho {tool} \"$@\" >> {log}\n")
                os.chmod(os.path.join(bin_, tool), 0o755)
            env = dict(os.environ, PATH=bin_ + ":/usr/bin:/bin", MESON_INSTALL_PREFIX=prefix)
            p = subprocess.run(["sh", os.path.join(SOURCE, "units", "postinstall.sh"), f"{prefix}/lib/sysusers.d",
                                f"{prefix}/lib/tmpfiles.d", setup], capture_output=True, text=True, env=env)
            self.assertEqual(p.returncode, 0, p.stderr)
            calls = ""
            if os.path.exists(log):
                with open(log) as f:
                    calls = f.read()
            return calls, p.stderr
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_custom_prefix_changes_nothing(self):
        calls, err = self.run_script("/tmp/epd-custom-prefix", "auto")
        self.assertEqual(calls, "")
        self.assertIn("not a system prefix", err)
        self.assertIn("-Dsystem_setup=true", err)

    def test_system_prefix_sets_up(self):
        if os.geteuid() != 0:
            self.skipTest("the script sets up only as root")
        calls, _ = self.run_script("/usr", "auto")
        self.assertIn("systemd-sysusers /usr/lib/sysusers.d/epd.conf", calls)
        self.assertIn("systemd-tmpfiles --create /usr/lib/tmpfiles.d/epd.conf", calls)

    def test_explicit_option(self):
        calls, err = self.run_script("/usr", "false")
        self.assertEqual(calls, "")
        self.assertIn("system_setup=false", err)
        if os.geteuid() == 0:
            calls, _ = self.run_script("/opt/epd", "true")
            self.assertIn("systemd-sysusers /opt/epd/lib/sysusers.d/epd.conf", calls)


if __name__ == "__main__":
    unittest.main(verbosity=2)
