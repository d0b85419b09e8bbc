#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# A test that runs over a private dbus-daemon, on a machine without one (PATH lacks
# dbus-daemon), skips as a whole: exit 77 with its reason, never a failure made of
# every case exiting 77 inside check's forked children.
set -u
fail() { echo "FAIL: $*"; exit 1; }
[ $# -ge 1 ] || fail "usage: $0 TEST-BINARY..."
EMPTY=$(mktemp -d /tmp/epd-test-nobus.XXXXXX)
trap 'rm -rf "$EMPTY"' EXIT
for t in "$@"; do
        out=$(env PATH="$EMPTY" "$t" 2>&1)
        rc=$?
        [ "$rc" -eq 77 ] || { echo "$out"; fail "$(basename "$t") exited $rc without a dbus-daemon in PATH, not 77"; }
        case "$out" in
        *SKIP:*dbus-daemon*) ;;
        *) echo "$out"; fail "$(basename "$t") skipped without saying why" ;;
        esac
        echo "ok: $(basename "$t") skips (77) without a dbus-daemon: $out"
done
