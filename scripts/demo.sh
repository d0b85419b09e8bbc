#!/bin/bash
# The main job on its embedded defaults: installs dependencies, builds, and runs the demo
# workload (tools/epd-demo.c: Encoder, Prefill and Decode workers through epdd), which
# prints what moved, how fast, and what the feature cache reused. One line per step,
# with the time it took.
#
# As root (network namespaces available): two epdd, "prefill-host" and "decode-host", each
# in its own network namespace, joined by a veth pair and authenticated with a freshly
# generated cluster key; the encoder and prefill workers talk to the first, the decode
# worker to the second, and the KV is handed off between the daemons over the peer
# protocol (tcp). Otherwise (or with EPD_DEMO_LOCAL=1): one epdd on a private direct
# socket, the handoff within it.
#
# Every daemon runs on a socket and a state directory (its WAL) in a private temporary
# directory, never the host's /run/epd or /var/lib/epd. Daemons, namespaces and that
# directory go on every exit path (success, failure, ^C, SIGTERM).
#
# Environment: EPD_DEMO_LOCAL=1 (one daemon even as root); EPD_BUILD_DIR=DIR (use that
# meson build directory as it is instead of build-release; the tests do); arguments are
# passed to epd-demo (e.g. --requests=50 --concurrency=4).
set -euo pipefail
cd "$(dirname "$0")/.."

# Microseconds since the epoch (bash 5: $EPOCHREALTIME), for the time each step took.
now_us() { local t=${EPOCHREALTIME/./}; echo "${t#0}"; }
seconds_since() { local d=$(($(now_us) - $1)); printf '%d.%d' $((d / 1000000)) $((d % 1000000 / 100000)); }
t_start=$(now_us)
step_n=0
step_t=
# A step on one line: "[n] what ... result (time)".
step() {
        step_n=$((step_n + 1))
        step_t=$(now_us)
        printf '[%d] %s ... ' "$step_n" "$*"
}
done_step() {
        printf '%s (%s s)\n' "${1:-done}" "$(seconds_since "$step_t")"
}
# A step whose own output follows on the next lines.
step_long() {
        step_n=$((step_n + 1))
        step_t=$(now_us)
        printf '[%d] %s:\n' "$step_n" "$*"
}
done_long() {
        printf '[%d] done in %s s\n' "$step_n" "$(seconds_since "$step_t")"
}

dir=
tag="epdd$$"
pids=()
namespaces=()
child=
# Runs a command as a child the traps can interrupt: bash runs a trap only once a
# foreground command ends, but `wait` returns at once for a signal.
run() {
        "$@" &
        child=$!
        local rc=0
        wait "$child" || rc=$?
        child=
        return $rc
}
# A step's command with its output kept aside: on failure the step says so, with the
# command's last lines, and the demo stops with the command's status.
steplog=
run_step() {
        [ -n "$steplog" ] || steplog=$(mktemp /tmp/epd-demo-step-XXXXXX)
        local rc=0
        run "$@" >"$steplog" 2>&1 || rc=$?
        if [ $rc -ne 0 ]; then
                printf 'failed (%s s)\n' "$(seconds_since "$step_t")"
                echo "$* exited with status $rc; its last lines:" >&2
                tail -n 40 "$steplog" >&2
                exit $rc
        fi
}
cleanup() {
        local rc=$? p
        trap - EXIT INT TERM HUP
        [ -z "$steplog" ] || rm -f "$steplog"
        if [ -n "$child" ]; then
                kill -TERM "$child" 2>/dev/null || true
                wait "$child" 2>/dev/null || true
        fi
        for p in "${pids[@]}"; do
                kill -TERM "$p" 2>/dev/null || true
        done
        for p in "${pids[@]}"; do
                wait "$p" 2>/dev/null || true
        done
        for p in "${namespaces[@]}"; do
                ip netns del "$p" 2>/dev/null || true
        done
        if [ -n "$dir" ]; then
                rm -rf "$dir"
        fi
        if [ ${#pids[@]} -gt 0 ] || [ -n "$dir" ]; then
                echo "Cleaned up: ${#pids[@]} daemon(s) stopped, ${#namespaces[@]} namespace(s) and $dir removed."
        fi
        exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

if [ -n "${EPD_BUILD_DIR:-}" ]; then
        B=$EPD_BUILD_DIR
        [ -x "$B/daemon/epdd" ] && [ -x "$B/tools/epd-demo" ] ||
                { echo "EPD_BUILD_DIR=$B holds no built epdd and epd-demo" >&2; exit 1; }
        echo "Using the build in $B."
else
        step "Checking build dependencies (Debian packages; apt-get installs what is missing)"
        run_step scripts/install-deps.sh
        done_step
        B=build-release
        if [ ! -f $B/build.ninja ]; then
                rm -rf $B # an interrupted setup leaves a directory meson does not take again
                step "Configuring the build (meson setup $B, release, -Werror)"
                run_step meson setup $B -Dbuildtype=release -Dwerror=true
                done_step
        fi
        step "Building epdd, libepd and the tools (ninja -C $B; a few minutes the first time)"
        run_step ninja -C $B
        done_step
fi

dir=$(mktemp -d /tmp/epd-demo-XXXXXX)
echo "Working directory: $dir (sockets, state, logs; removed at the end)"

# Starts epdd (in namespace $1 unless empty) with config $2; log in $3; waits until it
# serves on the Socket= of its config ($4).
start_epdd() {
        local ns=$1 conf=$2 log=$3 sock=$4
        if [ -n "$ns" ]; then
                ip netns exec "$ns" $B/daemon/epdd --config="$conf" 2>"$log" &
        else
                $B/daemon/epdd --config="$conf" 2>"$log" &
        fi
        pids+=($!)
        for _ in $(seq 400); do
                [ -S "$sock" ] && return 0
                kill -0 "${pids[-1]}" 2>/dev/null || break
                sleep 0.025
        done
        echo "failed" >&2
        echo "epdd did not start; its log:" >&2
        cat "$log" >&2
        exit 1
}

two_hosts=0
if [ "$(id -u)" = 0 ] && [ -z "${EPD_DEMO_LOCAL:-}" ] && command -v ip >/dev/null &&
   ip netns add "${tag}p" 2>/dev/null; then
        namespaces+=("${tag}p")
        two_hosts=1
fi

if [ $two_hosts = 1 ]; then
        step "Making two hosts: network namespaces ${tag}p and ${tag}d joined by a veth pair"
        ip netns add "${tag}d"
        namespaces+=("${tag}d")
        net="10.$((200 + $$ % 50)).$(($$ % 250))"
        ip -n "${tag}p" link set lo up
        ip -n "${tag}d" link set lo up
        ip -n "${tag}p" link add eth0 type veth peer name eth0 netns "${tag}d"
        ip -n "${tag}p" addr add "$net.1/24" dev eth0
        ip -n "${tag}d" addr add "$net.2/24" dev eth0
        ip -n "${tag}p" link set eth0 up
        ip -n "${tag}d" link set eth0 up
        # A fresh cluster key: 32 random bytes, hex, readable by root only.
        (umask 077; od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$dir/cluster.key")
        done_step
        names=(prefill-host decode-host)
        socks=("$dir/prefill.sock" "$dir/decode.sock")
        for i in 0 1; do
                j=$((1 - i))
                cat >"$dir/${names[i]}.conf" <<EOF
[Daemon]
HostId=${names[i]}
SystemBus=no
Socket=${socks[i]}
StateDirectory=$dir/${names[i]}.state
[Cluster]
Listen=$net.$((i + 1)):7300
ClusterKeyFile=$dir/cluster.key
HeartbeatInterval=1s
[Peer:${names[j]}]
Address=$net.$((j + 1)):7300
HostId=${names[j]}
EOF
        done
        step "Starting two epdd: prefill-host ($net.1) and decode-host ($net.2)"
        start_epdd "${tag}p" "$dir/prefill-host.conf" "$dir/prefill.log" "${socks[0]}"
        start_epdd "${tag}d" "$dir/decode-host.conf" "$dir/decode.log" "${socks[1]}"
        done_step "pids ${pids[*]}"
        step "Waiting for the daemons to authenticate each other (cluster key, HMAC challenge)"
        up=0
        for _ in $(seq 400); do
                if $B/tools/epdctl --address="direct:${socks[0]}" --json peers 2>/dev/null |
                   grep -q '"state": *"up"'; then
                        up=1
                        break
                fi
                sleep 0.025
        done
        if [ $up = 0 ]; then
                echo "failed"
                echo "The two daemons did not connect:" >&2
                cat "$dir/prefill.log" "$dir/decode.log" >&2
                exit 1
        fi
        done_step "up"
        addr="direct:${socks[0]}"
        step_long "Running the workload (epd-demo: encoder and prefill on prefill-host, decode on decode-host)"
        run $B/tools/epd-demo --address="$addr" --decode-address="direct:${socks[1]}" "$@"
        done_long
        echo
        echo "The daemons' view (epdctl peers, on prefill-host):"
        $B/tools/epdctl --address="$addr" peers
else
        cat >"$dir/epd.conf" <<EOF
[Daemon]
HostId=demo-host
SystemBus=no
Socket=$dir/bus
StateDirectory=$dir/state
EOF
        step "Starting epdd on its embedded defaults (a 256 MiB KV arena, a 64 MiB feature arena)"
        start_epdd "" "$dir/epd.conf" "$dir/epdd.log" "$dir/bus"
        done_step "pid ${pids[0]}"
        addr="direct:$dir/bus"
        step_long "Running the workload (epd-demo: encoder, prefill and decode workers of one daemon)"
        run $B/tools/epd-demo --address="$addr" "$@"
        done_long
        echo
        echo "The daemon's view (epdctl status):"
        $B/tools/epdctl --address="$addr" status
fi

cat <<EOF

What the lines above mean:
  feature cache     the encoder asks epdd for an image's hidden states before running its
                    vision tower; a hit means the tower did not run again (here: the same
                    image in both requests).
  layered handoff   the prefill worker reports each layer group of KV ready as soon as it is
                    computed; epdd moves it at once (or, within one arena, hands the pages
                    over), overlapping the transfer with the rest of the prefill.
  progress notice   a record epdd writes into the decode worker's ring (a shared-memory
                    queue, like io_uring) when a layer group has arrived: no D-Bus call.
  rate              completed requests per second of wall time, each request being encode
                    (or a cache hit), prefill into pages, the handoff and the decode side's
                    check of every byte; with a handoff between hosts, also the KV bytes per
                    second moved.

Try next (the daemons above are gone; start one of your own):
  $B/daemon/epdd --no-system-bus --socket=/tmp/epd/bus --state-directory=/tmp/epd/state &
  $B/tools/epdctl --address=direct:/tmp/epd/bus status     # epdctl help lists every command
  $B/tools/epdtop --address=direct:/tmp/epd/bus            # live view of the serving side; ? for keys
  $B/tools/epd-demo --address=direct:/tmp/epd/bus --requests=500 --concurrency=4
  scripts/demo.sh --requests=200 --concurrency=4           # this demo as a load test
EOF
echo "Demo finished in $(seconds_since "$t_start") s."
