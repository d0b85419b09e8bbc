#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# The installed systemd integration, as systemd's own tools read it:
#   - `meson install --destdir` puts every file where systemd, the bus and polkit
#     look for it, and the unit's ExecStart= names the installed epdd;
#   - `systemd-analyze verify` of the installed epd.service prints nothing (and, as a
#     control, does complain about a broken copy of it);
#   - `systemd-analyze security --offline` rates the unit's exposure at most 2.0;
#   - systemd-sysusers and systemd-tmpfiles accept the files and create user and
#     group epd and the directories with the intended owners and modes;
#   - the D-Bus activation file points at the unit, the policy files are well-formed.
# verify runs with --root= on a tree made of the install plus the host's own units
# (sysinit.target, dbus.socket, ...) and kill(1) for ExecReload=, so every path the
# unit names resolves the way it would on an installed machine.
set -eu
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
ok()   { echo "ok: $*"; }

: "${BUILD_ROOT:?BUILD_ROOT is set by meson}"
MESON=${MESON:-meson}
command -v systemd-analyze >/dev/null || skip "systemd-analyze is not installed"
HOST_UNITS=$(pkg-config --variable=systemdsystemunitdir systemd 2>/dev/null || true)
[ -d "${HOST_UNITS:-/nonexistent}" ] || HOST_UNITS=/usr/lib/systemd/system
[ -f "$HOST_UNITS/sysinit.target" ] || skip "no systemd unit directory on this machine"

WORK=$(mktemp -d "$BUILD_ROOT/test-units.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
DEST=$WORK/dest
"$MESON" install -C "$BUILD_ROOT" --destdir "$DEST" --no-rebuild --quiet >"$WORK/install.log" 2>&1 ||
        { cat "$WORK/install.log"; fail "meson install --destdir"; }

# Where the installed files must be (prefix /usr, the build's default).
UNIT=$(cd "$DEST" && ls -d usr/lib/systemd/system/epd.service 2>/dev/null || true)
[ -n "$UNIT" ] || fail "epd.service is not installed under /usr/lib/systemd/system"
for f in usr/lib/sysusers.d/epd.conf usr/lib/tmpfiles.d/epd.conf \
         usr/share/dbus-1/system-services/org.epd1.service \
         usr/share/dbus-1/system.d/org.epd1.conf \
         usr/share/polkit-1/actions/org.epd1.policy; do
        [ -f "$DEST/$f" ] || fail "/$f is not installed"
done
EXEC=$(sed -n 's/^ExecStart=//p' "$DEST/$UNIT")
[ -x "$DEST$EXEC" ] || fail "ExecStart=$EXEC is not the installed epdd"
ok "installed files in place, ExecStart=$EXEC"

# A root for verify: the install, the host's units, kill(1), merged-/usr links.
ROOT=$WORK/root
cp -a "$DEST" "$ROOT"
mkdir -p "$ROOT/usr/bin" "$ROOT/usr/lib/systemd/system" "$ROOT/etc"
cp -a "$HOST_UNITS/." "$ROOT/usr/lib/systemd/system/"
cp -a "$DEST/$UNIT" "$ROOT/usr/lib/systemd/system/epd.service"
cp "$(type -P kill)" "$ROOT/usr/bin/kill"
ln -s usr/bin "$ROOT/bin"
ln -s usr/lib "$ROOT/lib"
ln -s usr/sbin "$ROOT/sbin" 2>/dev/null || true

# Documentation=man:... pages are looked up with man(1): in the install tree, so the
# check also proves that the pages the unit names are installed.
MANCHECK=--man=yes
command -v man >/dev/null || { MANCHECK=--man=no; echo "note: man(1) is not installed, Documentation= not checked"; }
verify() { MANPATH="$ROOT/usr/share/man" SYSTEMD_LOG_COLOR=0 systemd-analyze verify $MANCHECK --root="$ROOT" "$@" 2>&1; }
out=$(verify epd.service) || fail "systemd-analyze verify failed: $out"
[ -z "$out" ] || fail "systemd-analyze verify printed:
$out"
ok "systemd-analyze verify epd.service: silent"

# Control: the same check sees a bad line, so its silence above means something.
cp "$ROOT/usr/lib/systemd/system/epd.service" "$WORK/epd.service.good"
sed -i 's/^NotifyAccess=main$/NotifyAccess=main\nNoSuchSetting=1/' "$ROOT/usr/lib/systemd/system/epd.service"
out=$(verify epd.service || true)
[ -n "$out" ] || fail "verify did not notice an unknown key: the check above proves nothing"
cp "$WORK/epd.service.good" "$ROOT/usr/lib/systemd/system/epd.service"
ok "control: verify reports a broken copy ($(echo "$out" | head -n1))"

sec=$(systemd-analyze security --offline=true --root="$ROOT" --no-pager --threshold=20 epd.service 2>&1) ||
        fail "systemd-analyze security: exposure above 2.0 (docs/systemd.md explains what remains):
$sec"
ok "$(echo "$sec" | grep -o 'Overall exposure level.*' | head -n1)"

# sysusers and tmpfiles, applied to the root as on a first boot.
systemd-sysusers --root="$ROOT" "$ROOT/usr/lib/sysusers.d/epd.conf" >"$WORK/sysusers.log" 2>&1 ||
        { cat "$WORK/sysusers.log"; fail "systemd-sysusers rejected epd.conf"; }
uid=$(awk -F: '$1 == "epd" { print $3 }' "$ROOT/etc/passwd")
gid=$(awk -F: '$1 == "epd" { print $3 }' "$ROOT/etc/group")
[ -n "$uid" ] && [ -n "$gid" ] || fail "sysusers did not create user and group epd"
[ "$(awk -F: '$1 == "epd" { print $4 }' "$ROOT/etc/passwd")" = "$gid" ] || fail "user epd's group is not epd"
if [ "$(id -u)" = 0 ]; then
        systemd-tmpfiles --root="$ROOT" --create "$ROOT/usr/lib/tmpfiles.d/epd.conf" >"$WORK/tmpfiles.log" 2>&1 ||
                { cat "$WORK/tmpfiles.log"; fail "systemd-tmpfiles rejected epd.conf"; }
        [ "$(stat -c '%a %u %g' "$ROOT/var/lib/epd")" = "750 $uid $gid" ] ||
                fail "/var/lib/epd is $(stat -c '%a %u %g' "$ROOT/var/lib/epd"), want 750 epd epd"
        [ "$(stat -c '%a %u' "$ROOT/etc/epd")" = "755 0" ] || fail "/etc/epd is not 0755 root"
else
        # Not root: tmpfiles cannot chown, and 252 has no --dry-run. The boot test
        # (root only) applies it for real.
        echo "note: not root, tmpfiles.d/epd.conf not applied"
fi
ok "sysusers: epd uid $uid gid $gid; tmpfiles: /var/lib/epd 0750 epd:epd, /etc/epd 0755 root (as root)"

# The unit's own directories agree with tmpfiles (both create them).
grep -qx 'User=epd' "$DEST/$UNIT" && grep -qx 'Group=epd' "$DEST/$UNIT" || fail "unit does not run as epd:epd"
grep -qx 'StateDirectoryMode=0750' "$DEST/$UNIT" || fail "StateDirectoryMode differs from tmpfiles"

# D-Bus activation: the name, and the unit that the bus asks systemd to start.
act=$DEST/usr/share/dbus-1/system-services/org.epd1.service
grep -qx 'Name=org.epd1' "$act" || fail "activation file does not name org.epd1"
svc=$(sed -n 's/^SystemdService=//p' "$act")
[ "$svc" = epd.service ] && [ -f "$DEST/usr/lib/systemd/system/$svc" ] ||
        fail "activation file's SystemdService=$svc is not the installed unit"
bus=$(sed -n 's/^BusName=//p' "$DEST/$UNIT")
[ "$bus" = org.epd1 ] || fail "unit's BusName=$bus"
ok "D-Bus activation: org.epd1 -> $svc (BusName=$bus)"

for x in usr/share/dbus-1/system.d/org.epd1.conf usr/share/polkit-1/actions/org.epd1.policy; do
        if command -v xmllint >/dev/null; then
                xmllint --noout --nonet "$DEST/$x" || fail "/$x is not well-formed XML"
        else
                python3 -c 'import sys, xml.dom.minidom; xml.dom.minidom.parse(sys.argv[1])' "$DEST/$x" ||
                        fail "/$x is not well-formed XML"
        fi
done
grep -q 'allow own="org.epd1"' "$DEST/usr/share/dbus-1/system.d/org.epd1.conf" || fail "policy lets nobody own org.epd1"
for a in org.epd1.manage org.epd1.manage-clients org.epd1.manage-cache org.epd1.manage-peers; do
        grep -q "<action id=\"$a\">" "$DEST/usr/share/polkit-1/actions/org.epd1.policy" || fail "polkit action $a missing"
done
ok "bus policy and polkit actions well-formed"
