#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""The man pages document everything there is: every option each program's --help
lists (epdd, epdctl, epdtop, epd-demo), every epdctl command, and every section and key
epd.conf accepts (the table in daemon/core/config.c) with its default; and groff reads
each page without a warning. epdctl.1 used to document 5 of 13 commands and
epd.conf.5 was one paragraph without defaults."""

import os
import re
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(__file__))
from epdtest import SOURCE, tool  # noqa: E402

MAN = os.path.join(SOURCE, "docs", "man")
PAGES = {"epdd": "epdd.8", "epdctl": "epdctl.1", "epdtop": "epdtop.1", "epd-demo": "epd-demo.1"}


def page(name):
    with open(os.path.join(MAN, name)) as f:
        return f.read()


def plain(roff):
    """The page's text with roff escapes of dashes undone and fonts dropped."""
    return re.sub(r"\\f[BIRP]", "", roff.replace("\\-", "-"))


class ManPages(unittest.TestCase):
    def test_groff_clean(self):
        if not shutil.which("groff"):
            self.skipTest("groff is not installed")
        for name in sorted(os.listdir(MAN)):
            p = subprocess.run(["groff", "-man", "-ww", "-z", os.path.join(MAN, name)], capture_output=True, text=True)
            self.assertEqual((p.returncode, p.stderr), (0, ""), name)

    def test_every_option(self):
        for prog, name in PAGES.items():
            if not os.path.exists(tool(prog)):
                continue  # epdtop without ncursesw
            help_text = subprocess.run([tool(prog), "--help"], capture_output=True, text=True).stdout
            options = set(re.findall(r"--([a-z][a-z-]+)", help_text))
            self.assertGreater(len(options), 2, prog)
            text = plain(page(name))
            for o in sorted(options):
                self.assertIn("--" + o, text, f"{name} does not document --{o}")

    def test_every_epdctl_command(self):
        help_text = subprocess.run([tool("epdctl"), "help"], capture_output=True, text=True).stdout
        commands = re.findall(r"^  (\w+)", help_text, re.M)
        self.assertGreaterEqual(len(commands), 14)
        text = page("epdctl.1")
        for c in commands:
            self.assertRegex(text, r'(?m)^\.BI? "?' + c + r'\b', f"epdctl.1 does not document '{c}'")

    def test_every_config_key_with_default(self):
        with open(os.path.join(SOURCE, "daemon", "core", "config.c")) as f:
            source = f.read()
        items = re.findall(r'\{ "(\w+)", "(\w+)", p_\w+,', source)
        self.assertGreater(len(items), 60)
        named = set(re.search(r"named_sections\[\] = \{([^}]*)\}", source).group(1).replace('"', "").replace(" ", "")
                    .split(","))
        # The page's sections: .SS "[Name]" or .SS "[Name:NAME]", each up to the next.
        text = page("epd.conf.5")
        sections = {}
        for m in re.finditer(r'^\.SS "\[(\w+)(:NAME)?\]"\n(.*?)(?=^\.S[SH] |\Z)', text, re.M | re.S):
            sections[m.group(1)] = (m.group(2) is not None, m.group(3))
        for section, key in items:
            self.assertIn(section, sections, f"epd.conf.5 has no section [{section}]")
            is_named, body = sections[section]
            self.assertEqual(is_named, section in named, f"[{section}] named or not")
            # The key's paragraph: from its .TP to the next.
            m = re.search(r"^\.TP\n\\fB" + key + r"=\\fR.*?(?=^\.TP|\Z)", body, re.M | re.S)
            self.assertIsNotNone(m, f"epd.conf.5 does not document [{section}] {key}=")
            self.assertRegex(m.group(0), r"(Default|Required)", f"[{section}] {key}= has no default")

    # What config_restart_notices() says in words rather than as Key=: the words the
    # page's restart list must hold for it. A new entry of that kind fails the test below
    # until it is added here.
    RESTART_PHRASES = {
        "Arena configuration": ["arenas"],
        "TLS files": ["EtcdCAFile=", "EtcdCertFile=", "EtcdKeyFile="],
    }

    def test_restart_list(self):
        """Every key a reload cannot apply (config_restart_notices() in config.c names it
        in its "... changed: it takes effect at the next restart" notice) is in
        epd.conf.5's list of what needs a restart. The page used to name four of them."""
        with open(os.path.join(SOURCE, "daemon", "core", "config.c")) as f:
            source = f.read()
        items = set(re.findall(r'\{ "(\w+)", "(\w+)", p_\w+,', source))
        keys = {k for _, k in items}
        sections = {s for s, _ in items} | {"Peer"}
        fn = re.search(r"^unsigned config_restart_notices\(.*?^\}", source, re.M | re.S)
        self.assertIsNotNone(fn, "config.c has no config_restart_notices()")
        table = re.search(r"\bfixed\[\]\s*=\s*\{(.*?)\n\s*\};", fn.group(0), re.S)
        self.assertIsNotNone(table, "config_restart_notices() has no fixed[] table")
        # Each entry is { condition, "what" }: the string literals (adjacent ones joined)
        # just before an entry's closing brace.
        whats = ["".join(re.findall(r'"((?:[^"\\]|\\.)*)"', m))
                 for m in re.findall(r'((?:"(?:[^"\\]|\\.)*"\s*)+)\}', table.group(1))]
        self.assertGreaterEqual(len(whats), 10, f"too few restart notices parsed: {whats}")

        text = page("epd.conf.5")
        m = re.search(r"^\.PP\nSIGHUP.*?(?=^\.(?:PP|SH|SS)\b)", text, re.M | re.S)
        self.assertIsNotNone(m, "epd.conf.5 has no SIGHUP paragraph")
        para = re.sub(r"\s+", " ", plain(m.group(0)))
        for what in whats:
            needs = []
            for sec in re.findall(r"\[(\w+):?\]", what):
                self.assertIn(sec, sections, f"{what!r}: no section [{sec}] in config.c")
                needs.append("[" + sec)
            for key in re.findall(r"\b(\w+)=", what):
                self.assertIn(key, keys, f"{what!r}: {key}= is no key of config.c's table")
                needs.append(key + "=")
            for phrase, words in self.RESTART_PHRASES.items():
                if phrase in what:
                    needs += words
            self.assertTrue(needs, f"{what!r}: names no Key= or [Section]; add its words to RESTART_PHRASES")
            for n in needs:
                self.assertIn(n, para, f"epd.conf.5's restart list lacks {n} (config.c: {what!r})")


if __name__ == "__main__":
    unittest.main(verbosity=2)
