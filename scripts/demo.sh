#!/bin/bash
# The main job on its embedded defaults: installs dependencies, builds, starts epdd on
# a private direct socket, runs the demo workload (tools/epd-demo.c: Encoder, Prefill
# and Decode workers through the daemon), prints what moved, and stops the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
B=build-release
if [ ! -d $B ]; then
        meson setup $B -Dbuildtype=release -Dwerror=true >/dev/null
fi
ninja -C $B >/dev/null

dir=$(mktemp -d /tmp/epd-demo-XXXXXX)
cleanup() {
        [ -n "${pid:-}" ] && kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
        rm -rf "$dir"
}
trap cleanup EXIT

$B/daemon/epdd --no-system-bus --socket="$dir/bus" --config=/dev/null 2>"$dir/epdd.log" &
pid=$!
for _ in $(seq 200); do [ -S "$dir/bus" ] && break; sleep 0.05; done
if [ ! -S "$dir/bus" ]; then
        echo "epdd did not start:" >&2
        cat "$dir/epdd.log" >&2
        exit 1
fi
$B/tools/epd-demo --address="direct:$dir/bus" "$@"
$B/tools/epdctl --address="direct:$dir/bus" status
