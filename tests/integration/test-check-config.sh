#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# `epdd --check-config` runs the checks start-up runs and says what start-up says:
# for every configuration below that start-up refuses (a cluster key file readable by
# others, too short, empty, /dev/zero or a directory; a Listen= or peer Address= with
# a host name; a NUL byte; an arena too small; a SocketGroup= that does not exist; a
# feature StoreDirectory= that does not exist or is not a directory) it
# exits non-zero with exactly the output epdd gives when started with the same
# configuration, and neither creates the socket's nor the state directory. A good
# configuration passes, also without creating anything. A reload (SIGHUP) of a running
# epdd refuses what start-up refuses and says what needs a restart.
set -u
skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }
ok()   { echo "ok: $*"; }
FAILED=0
# Each case is checked to the end, so that one run names every case that fails.
bad()  { echo "FAIL: $*"; FAILED=1; }

: "${EPDD:?EPDD is set by meson}"
[ -x "$EPDD" ] || skip "no epdd at $EPDD"
command -v timeout >/dev/null || skip "timeout(1) is not installed"

W=$(mktemp -d /tmp/epd-check-config.XXXXXX)
trap 'rm -rf "$W"' EXIT
# Every run gets its own socket and state directory under $W: neither may appear.
ARGS=(--no-system-bus --socket="$W/run/bus" --state-directory="$W/state")

printf '%s\n' 0123456789abcdef0123456789abcdef > "$W/key-good"
chmod 600 "$W/key-good"
cp "$W/key-good" "$W/key-0644"
chmod 644 "$W/key-0644"
printf 'abc\n' > "$W/key-short"
chmod 600 "$W/key-short"
: > "$W/key-empty"
chmod 600 "$W/key-empty"
mkdir "$W/key-dir"
chmod 700 "$W/key-dir"

cluster() { # KEYFILE [LISTEN]
        printf '[Daemon]\nHostId=node-a\n[Arena:kv]\nSize=16M\n[Cluster]\nClusterKeyFile=%s\nListen=%s\n' \
                "$1" "${2:-127.0.0.1:7199}"
}

# name | file content (printf format) | what the message must say
check_refused() {
        local name=$1 want=$2 conf="$W/$1.conf" rc
        rm -rf "$W/run" "$W/state"
        "$EPDD" --check-config -c "$conf" "${ARGS[@]}" >"$W/$name.check.out" 2>"$W/$name.check.err"
        rc=$?
        if [ $rc -eq 0 ]; then
                cat "$W/$name.check.out" "$W/$name.check.err"
                bad "$name: --check-config exited 0"
                return
        fi
        if ! grep -qF -- "$want" "$W/$name.check.err"; then
                cat "$W/$name.check.err"
                bad "$name: --check-config does not say '$want'"
                return
        fi
        [ ! -e "$W/run" ] && [ ! -e "$W/state" ] ||
                { bad "$name: --check-config created the socket's or the state directory"; return; }
        [ ! -s "$W/$name.check.out" ] || { cat "$W/$name.check.out"; bad "$name: --check-config printed on stdout"; return; }

        timeout 30 "$EPDD" -c "$conf" "${ARGS[@]}" >"$W/$name.start.out" 2>"$W/$name.start.err"
        rc=$?
        if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then
                cat "$W/$name.start.err"
                bad "$name: epdd started (rc $rc)"
                return
        fi
        if ! cmp -s "$W/$name.check.err" "$W/$name.start.err"; then
                diff "$W/$name.check.err" "$W/$name.start.err"
                bad "$name: --check-config and start-up say different things"
                return
        fi
        [ ! -e "$W/state" ] || { bad "$name: start-up made the state directory before refusing"; return; }
        ok "$name: refused by both, with: $(head -c 160 "$W/$name.check.err" | tr '\n' ' ')"
}

cluster "$W/key-0644" > "$W/key-mode.conf"
check_refused key-mode "cannot load the cluster key $W/key-0644: it is readable or writable by group or others; chmod 600 it"
# The etcd client's TLS key likewise (curl took any file).
{ cluster "$W/key-good"; printf 'Etcd=http://127.0.0.1:2379\nEtcdCertFile=%s\nEtcdKeyFile=%s\n' "$W/key-good" \
        "$W/key-0644"; } > "$W/etcd-key-mode.conf"
check_refused etcd-key-mode "[Cluster] EtcdKeyFile= $W/key-0644 is readable or writable by group or others; chmod 600 it"
cluster "$W/key-short" > "$W/key-length.conf"
check_refused key-length "cannot load the cluster key $W/key-short: it holds fewer than 16 bytes"
cluster "$W/key-empty" > "$W/key-empty.conf"
check_refused key-empty "cannot load the cluster key $W/key-empty: it is empty"
cluster /dev/zero > "$W/key-devzero.conf"
check_refused key-devzero "cannot load the cluster key /dev/zero: it is not a regular file"
cluster "$W/key-dir" > "$W/key-dir.conf"
check_refused key-dir "cannot load the cluster key $W/key-dir: it is a directory, not a file"
cluster "$W/key-good" localhost:7199 > "$W/listen-name.conf"
check_refused listen-name "listen-name.conf:7: Listen=localhost:7199: expected a numeric IPv4 address and a port"
{ cluster "$W/key-good"; printf '[Peer:b]\nAddress=peer-b.example:7199\nHostId=node-b\n'; } > "$W/peer-name.conf"
check_refused peer-name "peer-name.conf:9: Address=peer-b.example:7199: expected a numeric IPv4 address and a port"
printf '[Daemon]\nHostId=node-a\n[Arena:kv]\nSize=16M\x00\n' > "$W/nul.conf"
check_refused nul "nul.conf:4: a NUL byte: the file is not text"
printf '[Arena:kv]\nSize=4K\n' > "$W/arena-small.conf"
check_refused arena-small "Arena 'kv': Size=4096 is out of range"
printf '[Daemon]\nSocketGroup=epd-no-such-group\n' > "$W/group.conf"
check_refused group "[Daemon] SocketGroup=epd-no-such-group: no such group."
printf '[Wal]\nCompactSize=0\n' > "$W/compact-zero.conf"
check_refused compact-zero "[Wal] CompactSize= must be at least 4K"
# The feature store's directory must exist (epdd never makes it) and be a directory.
printf '[Features]\nStoreDirectory=%s\n' "$W/no-store" > "$W/store-missing.conf"
check_refused store-missing "Feature store $W/no-store: No such file or directory"
[ ! -e "$W/no-store" ] || bad "store-missing: the store directory was made"
printf '[Features]\nStoreDirectory=%s\n' "$W/key-good" > "$W/store-file.conf"
check_refused store-file "Feature store $W/key-good: Not a directory"
# A name too long for one line of the report: cut to the line, and the next error
# still shows (the report used to copy past the end of its line buffer).
long=$(printf 'x%.0s' $(seq 1 600))
longdir=$(printf 'd%.0s' $(seq 1 200))
mkdir -p "$W/$longdir"
printf '[Daemon]\nHostId=%s\n[Nope]\n' "$long" > "$W/$longdir/long.conf"
check_refused "$longdir/long" "long.conf:3: unknown section [Nope]"
# --host-id= is checked like HostId=.
rm -rf "$W/run" "$W/state"
if "$EPDD" --check-config --host-id='bad id' "${ARGS[@]}" >/dev/null 2>"$W/host-id.err"; then
        bad "--host-id='bad id' passed --check-config"
elif ! grep -qF -- "--host-id=bad id: only letters, digits" "$W/host-id.err"; then
        cat "$W/host-id.err"; bad "--host-id='bad id': no reason given"
else
        ok "--host-id='bad id' refused: $(head -c 160 "$W/host-id.err")"
fi

# --socket= is bounded like Socket= (the socket is bound as <path>.<pid>, then renamed):
# a 104-byte path passed --check-config and failed the start only after the WAL replay,
# or not, by the number of digits of the pid.
sock104="/$(printf 's%.0s' $(seq 1 103))"
rm -rf "$W/run" "$W/state"
if "$EPDD" --check-config --no-system-bus --socket="$sock104" --state-directory="$W/state" >/dev/null \
        2>"$W/socket-long.err"; then
        bad "--socket= of 104 bytes passed --check-config"
elif ! grep -qF -- "--socket= needs an absolute path shorter than 100 bytes" "$W/socket-long.err"; then
        cat "$W/socket-long.err"; bad "--socket= of 104 bytes: no reason given"
else
        ok "--socket= of 104 bytes refused: $(head -c 160 "$W/socket-long.err")"
fi

# A configuration start-up takes passes, and --check-config still creates nothing.
{ cluster "$W/key-good"; printf '[Peer:b]\nAddress=127.0.0.2:7199\nHostId=node-b\n'; } > "$W/good.conf"
rm -rf "$W/run" "$W/state"
out=$("$EPDD" --check-config -c "$W/good.conf" "${ARGS[@]}" 2>"$W/good.err") ||
        { cat "$W/good.err"; fail "a good configuration is refused"; }
[ "$out" = "Configuration OK: 1 arena(s), 1 peer(s)." ] || fail "unexpected output: $out"
[ ! -e "$W/run" ] && [ ! -e "$W/state" ] || fail "--check-config of a good configuration created a directory"
ok "a good configuration: $out"
[ $FAILED -eq 0 ] || fail "some configurations were not refused alike (above)"

# A reload (SIGHUP) runs the same checks: what start-up refuses, it refuses, keeping the
# running configuration (and serving); what it cannot apply it says needs a restart. The
# command line (--socket, --state-directory here) still wins over the file.
wait_log() { # PATTERN: within 10 s
        for _ in $(seq 1 200); do grep -qF -- "$1" "$W/reload.err" && return 0; sleep 0.05; done
        return 1
}
reload_conf() { # KEYFILE [SOCKETGROUP]
        { printf '[Daemon]\nHostId=node-a\n'
          [ -n "${2:-}" ] && printf 'SocketGroup=%s\n' "$2"
          printf '[Arena:kv]\nSize=16M\n[Cluster]\nClusterKeyFile=%s\n' "$1"; } > "$W/reload.conf"
}
rm -rf "$W/run" "$W/state"
reload_conf "$W/key-good"
"$EPDD" -c "$W/reload.conf" "${ARGS[@]}" >/dev/null 2>"$W/reload.err" &
PID=$!
trap 'kill $PID 2>/dev/null; rm -rf "$W"' EXIT
for _ in $(seq 1 200); do [ -S "$W/run/bus" ] && break; sleep 0.05; done
[ -S "$W/run/bus" ] || { cat "$W/reload.err"; fail "epdd did not start for the reload checks"; }
reload_conf "$W/key-good" epd-no-such-group
kill -HUP $PID
wait_log "Reload refused" || { cat "$W/reload.err"; fail "a reload with a SocketGroup= that does not exist was not refused"; }
grep -qF "[Daemon] SocketGroup=epd-no-such-group: no such group." "$W/reload.err" ||
        { cat "$W/reload.err"; fail "the refused reload does not say why"; }
! grep -qF "Configuration reloaded" "$W/reload.err" || fail "a refused reload was applied"
kill -0 $PID 2>/dev/null && [ -S "$W/run/bus" ] || fail "epdd stopped serving after a refused reload"
ok "reload: a SocketGroup= that does not exist is refused as at start-up; epdd serves on"
cp "$W/key-good" "$W/key-good2"
reload_conf "$W/key-good2" root
kill -HUP $PID
wait_log "Configuration reloaded" || { cat "$W/reload.err"; fail "a good reload did not complete"; }
for what in "ClusterKeyFile= changed: it takes effect at the next restart." \
            "SocketGroup= changed: it takes effect at the next restart."; do
        grep -qF -- "$what" "$W/reload.err" || { cat "$W/reload.err"; fail "a reload does not say: $what"; }
done
! grep -qE "(Socket|StateDirectory)= changed" "$W/reload.err" ||
        { cat "$W/reload.err"; fail "a reload took the file's socket or state directory over the command line's"; }
ok "reload: what needs a restart is said (the key, the socket's group); the command line still wins"
# Settings read once at start (an arena's page kind, the transport policy, etcd) are
# named too, never silently ignored. A StoreDirectory= that does not exist is refused
# first, as the next start would refuse it; once made, it is named as needing a restart.
{ printf '[Daemon]\nHostId=node-a\nSocketGroup=root\n[Limits]\nMaxRequestsPerClient=7\nAttachGrace=60s\n'
  printf '[Telemetry]\nTraceEvents=8\n[Features]\nStoreDirectory=%s\n' "$W/features"
  printf '[Arena:kv]\nSize=16M\nHugePages=try\n[Cluster]\nClusterKeyFile=%s\nTransport=tcp\n' "$W/key-good2"; } > "$W/reload.conf"
kill -HUP $PID
wait_log "Feature store $W/features: No such file or directory" ||
        { cat "$W/reload.err"; fail "a reload to a StoreDirectory= that does not exist was not refused with its reason"; }
for _ in $(seq 1 200); do [ "$(grep -cF "Reload refused" "$W/reload.err")" -ge 2 ] && break; sleep 0.05; done
[ "$(grep -cF "Reload refused" "$W/reload.err")" -ge 2 ] || { cat "$W/reload.err"; fail "the reload was not refused"; }
[ "$(grep -cF "Configuration reloaded" "$W/reload.err")" -eq 1 ] || { cat "$W/reload.err"; fail "a refused reload was applied"; }
[ ! -e "$W/features" ] || fail "the refused reload made the store directory"
kill -0 $PID 2>/dev/null && [ -S "$W/run/bus" ] || fail "epdd stopped serving after a refused reload"
ok "reload: a StoreDirectory= that does not exist is refused as at start-up; epdd serves on"
mkdir "$W/features"
kill -HUP $PID
for _ in $(seq 1 200); do [ "$(grep -cF "Configuration reloaded" "$W/reload.err")" -ge 2 ] && break; sleep 0.05; done
for what in "Arena configuration changed: it takes effect at the next restart." \
            "[Cluster] Transport= changed: it takes effect at the next restart." \
            "[Limits] AttachGrace= changed: it takes effect at the next restart." \
            "[Telemetry] TraceRequests= or TraceEvents= changed: it takes effect at the next restart." \
            "[Features] StoreDirectory= changed: it takes effect at the next restart." \
            "Configuration reloaded from $W/reload.conf; some changes take effect at the next restart"; do
        grep -qF -- "$what" "$W/reload.err" || { cat "$W/reload.err"; fail "a reload does not say: $what"; }
done
ok "reload: an arena's HugePages=, the Transport= policy, AttachGrace=, the trace bounds and StoreDirectory= are named as needing a restart"
kill -TERM $PID
wait $PID || fail "epdd exited with $? after the reloads"
