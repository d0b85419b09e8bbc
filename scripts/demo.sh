#!/bin/bash
# The main job on its embedded defaults: installs dependencies, builds, and runs the demo
# workload (tools/epd-demo.c: Encoder, Prefill and Decode workers through epdd), which
# prints what moved, how fast, and what the feature cache reused.
#
# As root (network namespaces available): two epdd, "prefill-host" and "decode-host", each
# in its own network namespace, joined by a veth pair and authenticated with a freshly
# generated cluster key; the encoder and prefill workers talk to the first, the decode
# worker to the second, and the KV is handed off between the daemons over the peer
# protocol (tcp). Otherwise (or with EPD_DEMO_LOCAL=1): one epdd on a private direct
# socket, the handoff within it. Daemons, namespaces and files go on every exit path.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
B=build-release
if [ ! -d $B ]; then
        meson setup $B -Dbuildtype=release -Dwerror=true >/dev/null
fi
ninja -C $B >/dev/null

dir=$(mktemp -d /tmp/epd-demo-XXXXXX)
tag="epdd$$"
pids=()
namespaces=()
cleanup() {
        local p
        for p in "${pids[@]}"; do
                kill -TERM "$p" 2>/dev/null || true
        done
        for p in "${pids[@]}"; do
                wait "$p" 2>/dev/null || true
        done
        for p in "${namespaces[@]}"; do
                ip netns del "$p" 2>/dev/null || true
        done
        rm -rf "$dir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# Starts epdd (in namespace $1 unless empty) on socket $2 with config $3; log in $4.
start_epdd() {
        local ns=$1 sock=$2 conf=$3 log=$4
        if [ -n "$ns" ]; then
                ip netns exec "$ns" $B/daemon/epdd --no-system-bus --socket="$sock" --config="$conf" 2>"$log" &
        else
                $B/daemon/epdd --no-system-bus --socket="$sock" --config="$conf" 2>"$log" &
        fi
        pids+=($!)
        for _ in $(seq 200); do [ -S "$sock" ] && return 0; sleep 0.025; done
        echo "epdd did not start:" >&2
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
        names=(prefill-host decode-host)
        for i in 0 1; do
                j=$((1 - i))
                cat >"$dir/${names[i]}.conf" <<EOF
[Daemon]
HostId=${names[i]}
SystemBus=no
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
        start_epdd "${tag}p" "$dir/prefill.sock" "$dir/prefill-host.conf" "$dir/prefill.log"
        start_epdd "${tag}d" "$dir/decode.sock" "$dir/decode-host.conf" "$dir/decode.log"
        up=0
        for _ in $(seq 200); do
                if $B/tools/epdctl --address="direct:$dir/prefill.sock" --json peers 2>/dev/null |
                   grep -q '"state": *"up"'; then
                        up=1
                        break
                fi
                sleep 0.025
        done
        if [ $up = 0 ]; then
                echo "The two daemons did not connect:" >&2
                cat "$dir/prefill.log" "$dir/decode.log" >&2
                exit 1
        fi
        echo "two hosts: prefill-host ($net.1, netns ${tag}p) <-veth-> decode-host ($net.2, netns ${tag}d)"
        $B/tools/epd-demo --address="direct:$dir/prefill.sock" --decode-address="direct:$dir/decode.sock" "$@"
        $B/tools/epdctl --address="direct:$dir/prefill.sock" peers
else
        start_epdd "" "$dir/bus" /dev/null "$dir/epdd.log"
        $B/tools/epd-demo --address="direct:$dir/bus" "$@"
        $B/tools/epdctl --address="direct:$dir/bus" status
fi
