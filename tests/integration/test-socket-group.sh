#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# epdd started by hand as root gives its direct socket the group of epd's users, as
# under systemd (docs/security.md): the socket's directory is mode 0750 and the
# socket 0660, both of group SocketGroup= (a group this test makes with groupadd), so
# that a member of the group (and not a non-member) can connect. Without SocketGroup=
# and without a group epd, the directory is still 0750 and the socket 0660. Needs
# root (groupadd, setpriv); skips otherwise.
set -u
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
ok()   { echo "ok: $*"; }

: "${EPDD:?EPDD is set by meson}"
: "${BUILD_ROOT:?BUILD_ROOT is set by meson}"
EPDCTL=$BUILD_ROOT/tools/epdctl
[ "$(id -u)" -eq 0 ] || skip "needs root (to start epdd as root and to make a test group)"
command -v groupadd >/dev/null && command -v groupdel >/dev/null || skip "groupadd/groupdel are not installed"
command -v setpriv >/dev/null || skip "setpriv(1) is not installed"
[ -x "$EPDCTL" ] || skip "no epdctl at $EPDCTL"

G=epdtest$$
getent group "$G" >/dev/null && skip "group $G exists already"
groupadd "$G" || skip "groupadd $G failed"
W=$(mktemp -d /tmp/epd-socket-group.XXXXXX)
PID=
cleanup() {
        [ -n "$PID" ] && kill "$PID" 2>/dev/null && wait "$PID" 2>/dev/null
        groupdel "$G" 2>/dev/null
        rm -rf "$W"
}
trap cleanup EXIT
chmod 0755 "$W" # others may traverse $W: only the socket's own directory decides
GID=$(getent group "$G" | cut -d: -f3)

start() { # CONF RUNDIR
        "$EPDD" -c "$1" --no-system-bus --socket="$2/bus" --state-directory="$W/state-$(basename "$2")" \
                >"$W/epdd.log" 2>&1 &
        PID=$!
        for _ in $(seq 200); do
                [ -S "$2/bus" ] && "$EPDCTL" --address="direct:$2/bus" status >/dev/null 2>&1 && return 0
                kill -0 "$PID" 2>/dev/null || { cat "$W/epdd.log"; fail "epdd exited"; }
                sleep 0.1
        done
        cat "$W/epdd.log"
        fail "epdd did not serve $2/bus"
}
stop() {
        kill "$PID" && wait "$PID"
        PID=
}

# 1. SocketGroup= names the test group.
printf '[Daemon]\nSocketGroup=%s\n[Arena:kv]\nSize=16M\n' "$G" > "$W/g.conf"
start "$W/g.conf" "$W/run"
got=$(stat -c '%a %G' "$W/run")
[ "$got" = "750 $G" ] || fail "socket directory is '$got', expected '750 $G'"
got=$(stat -c '%a %G %F' "$W/run/bus")
[ "$got" = "660 $G socket" ] || fail "socket is '$got', expected '660 $G socket'"
ok "as root with SocketGroup=$G: $W/run 0750 $G, bus 0660 $G"

# A member of the group who is not root connects; the same user without it cannot.
setpriv --reuid=65534 --regid=65534 --groups="$GID" "$EPDCTL" --address="direct:$W/run/bus" status \
        >"$W/member.out" 2>&1 || { cat "$W/member.out"; fail "a member of $G cannot use the socket"; }
if setpriv --reuid=65534 --regid=65534 --clear-groups "$EPDCTL" --address="direct:$W/run/bus" status \
        >"$W/other.out" 2>&1; then
        fail "a user outside $G used the socket"
fi
ok "uid 65534 in $G connects; without $G it is refused: $(head -c 120 "$W/other.out" | tr '\n' ' ')"
stop

# 2. No SocketGroup= and no group epd: the daemon's own group, the same modes.
if getent group epd >/dev/null; then
        want=epd
else
        want=$(id -gn)
fi
printf '[Arena:kv]\nSize=16M\n' > "$W/d.conf"
start "$W/d.conf" "$W/run2"
got=$(stat -c '%a %G' "$W/run2")
[ "$got" = "750 $want" ] || fail "socket directory is '$got', expected '750 $want'"
got=$(stat -c '%a %G' "$W/run2/bus")
[ "$got" = "660 $want" ] || fail "socket is '$got', expected '660 $want'"
ok "as root without SocketGroup=: $W/run2 0750 $want, bus 0660 $want"
stop

# 3. A directory that exists already and is not the default /run/epd is left as it is.
mkdir -m 0711 "$W/run3"
start "$W/g.conf" "$W/run3"
got=$(stat -c '%a %G' "$W/run3")
[ "$got" = "711 $(id -gn)" ] || fail "an existing directory was changed to '$got'"
got=$(stat -c '%a %G' "$W/run3/bus")
[ "$got" = "660 $G" ] || fail "socket is '$got', expected '660 $G'"
ok "an existing directory stays 0711; its socket is 0660 $G"
stop
