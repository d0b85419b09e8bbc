#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# epdtop against a live epdd: the arena rows come from the daemon's bus, the peer row
# from pinned BPF maps of a tracked TCP connection (the telemetry helper's, until the
# peer subsystem's connections are tracked by epdd itself). Checks --json, --batch and
# the interactive screen in tmux, including keys and a resize.
set -u
EPDD=${1:?usage: $0 EPDD EPDTOP HELPER}
EPDTOP=${2:?}
HELPER=${3:?}

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; [ -f "$TMP/epdd.log" ] && tail -20 "$TMP/epdd.log"; exit 1; }

[ "$(id -u)" = 0 ] || skip "needs root (network namespace, BPF)"
for t in ip jq tmux; do command -v $t >/dev/null || skip "$t not installed"; done

NS=epdtop-$$
TMP=$(mktemp -d /tmp/epdtop-test.XXXXXX)
BPFFS=$TMP/bpffs
PIDS=()
SESSION=epdtop-test-$$
cleanup() {
        tmux kill-session -t $SESSION 2>/dev/null
        for p in "${PIDS[@]}"; do kill $p 2>/dev/null; done
        wait 2>/dev/null
        ip netns del $NS 2>/dev/null
        umount $BPFFS 2>/dev/null
        rm -rf "$TMP"
}
trap cleanup EXIT

mkdir -p $BPFFS $TMP/state
mount -t bpf bpf $BPFFS || skip "cannot mount a bpf filesystem"
ip netns add $NS || skip "cannot create a network namespace"
ip -n $NS link set lo up

cat > $TMP/epd.conf <<CONF
[Daemon]
StateDirectory=$TMP/state
[Telemetry]
PinDirectory=$BPFFS/epdd
CONF
"$EPDD" --config=$TMP/epd.conf --no-system-bus --socket=$TMP/bus > $TMP/epdd.log 2>&1 &
PIDS+=($!)
for i in $(seq 50); do [ -S $TMP/bus ] && break; sleep 0.1; done
[ -S $TMP/bus ] || fail "epdd did not start"
ADDR=direct:$TMP/bus

# A second epdd told the same pin directory neither replaces the first one's pins nor
# removes them when it stops (the directory is locked while pinned).
for i in $(seq 50); do [ -e $BPFFS/epdd/counters ] && break; sleep 0.1; done
if [ -e $BPFFS/epdd/counters ]; then
        inode=$(stat -c %i $BPFFS/epdd/counters)
        mkdir -p $TMP/state2
        sed "s|$TMP/state|$TMP/state2|" $TMP/epd.conf > $TMP/epd2.conf
        "$EPDD" --config=$TMP/epd2.conf --no-system-bus --socket=$TMP/bus2 > $TMP/epdd2.log 2>&1 &
        second=$!
        PIDS+=($second)
        for i in $(seq 50); do [ -S $TMP/bus2 ] && break; sleep 0.1; done
        [ -S $TMP/bus2 ] || fail "the second epdd did not start"
        grep -q "another epdd pins its maps in $BPFFS/epdd" $TMP/epdd2.log || fail "the second epdd did not say why it pins nothing: $(cat $TMP/epdd2.log)"
        [ "$(stat -c %i $BPFFS/epdd/counters)" = "$inode" ] || fail "the second epdd replaced the first one's pins"
        kill $second; wait $second
        [ -e $BPFFS/epdd/counters ] || fail "the second epdd removed the first one's pins when it stopped"
        echo "ok: a second epdd on the same pin directory left the first one's pins alone"
else
        echo "note: epdd pinned nothing (no kernel telemetry here?): the pin directory's lock is not checked"
fi

ip netns exec $NS "$HELPER" sink 7421 > /dev/null &
PIDS+=($!)
ip netns exec $NS "$HELPER" send 127.0.0.1 7421 --seconds 12 --rate 20000000 --peer peerB \
        --set Telemetry.PinDirectory=$BPFFS/helper > $TMP/helper.jsonl 2>&1 &
HELPER_PID=$!
PIDS+=($HELPER_PID)
for i in $(seq 50); do [ -e $BPFFS/helper/conns ] && break; sleep 0.1; done
if [ ! -e $BPFFS/helper/conns ]; then
        wait $HELPER_PID
        [ $? = 77 ] && skip "kernel telemetry unavailable: $(cat $TMP/helper.jsonl)"
        fail "helper did not pin its maps"
fi
sleep 1

# --json: two snapshots, rates from the second.
"$EPDTOP" -A $ADDR --pins $BPFFS/helper --json -n 2 -d 0.5 > $TMP/top.jsonl || fail "epdtop --json failed"
[ $(wc -l < $TMP/top.jsonl) = 2 ] || fail "expected 2 JSON lines"
jq -e . $TMP/top.jsonl > /dev/null || fail "--json output is not JSON"
tail -1 $TMP/top.jsonl | jq -e '
        .bus == true and .pins == true and .version != "" and
        ([.arenas[].name] | index("host0") != null) and
        (.arenas | all(.size > 0)) and
        (.peers | length == 1) and
        (.peers[0].name == "peerB" and .peers[0].connections == 1 and .peers[0].kernel == true) and
        (.peers[0].bytes_acked > 1000000 and .peers[0].bandwidth > 1000000) and
        (.peers[0].srtt_us > 0 and .peers[0].min_rtt_us > 0)' > /dev/null ||
        { cat $TMP/top.jsonl; fail "--json content"; }
# Filter and sort from the command line.
"$EPDTOP" -A $ADDR --pins $BPFFS/helper --json --filter nomatch --sort rtt | \
        jq -e '(.peers | length == 0) and .sort == "rtt" and .filter == "nomatch"' > /dev/null || fail "--filter/--sort"

# --batch text.
"$EPDTOP" -A $ADDR --pins $BPFFS/helper --batch > $TMP/top.txt || fail "epdtop --batch failed"
grep -q '^host0 ' $TMP/top.txt || { cat $TMP/top.txt; fail "--batch: no arena row"; }
grep -q '^peerB ' $TMP/top.txt || { cat $TMP/top.txt; fail "--batch: no peer row"; }

# Interactive, in tmux.
tmux new-session -d -s $SESSION -x 160 -y 40 \
        "TERM=xterm-256color '$EPDTOP' -A $ADDR --pins $BPFFS/helper -d 0.3" || skip "tmux cannot start a session"
screen() { tmux capture-pane -t $SESSION -p; }
wait_for() { # wait_for REGEX MESSAGE
        for i in $(seq 40); do screen | grep -qE "$1" && return 0; sleep 0.1; done
        screen; fail "$2"
}
wait_for '^host0 +host +kv' "screen: no arena row"
wait_for '^peerB +1 ' "screen: no peer row"
wait_for '^PEER .*BANDWIDTH HISTORY' "screen: no sparkline column at 160 columns"
tmux send-keys -t $SESSION s
wait_for 'sort:bandwidth' "screen: 's' did not change the sort key"
tmux send-keys -t $SESSION / p e e r Enter
wait_for 'filter:peer' "screen: filter not applied"
wait_for '^peerB ' "screen: filter hid the matching peer"
tmux send-keys -t $SESSION / x y z Enter
for i in $(seq 20); do screen | grep -q '^peerB ' || break; sleep 0.1; done
screen | grep -q '^peerB ' && fail "screen: filter did not hide the peer"
tmux send-keys -t $SESSION c
wait_for '^peerB ' "screen: clearing the filter did not bring the peer back"
# Resize: narrow and short; still drawn, without the wide columns.
tmux resize-window -t $SESSION -x 82 -y 14 2>/dev/null || tmux resize-pane -t $SESSION -x 82 -y 14
sleep 1
screen | grep -q 'BANDWIDTH HISTORY' && { screen; fail "screen: sparklines at 82 columns"; }
wait_for '^PEER ' "screen: peer section lost after resize"
tmux resize-window -t $SESSION -x 30 -y 6 2>/dev/null || tmux resize-pane -t $SESSION -x 30 -y 6
wait_for 'too small' "screen: tiny terminal not handled"
tmux resize-window -t $SESSION -x 160 -y 40 2>/dev/null || tmux resize-pane -t $SESSION -x 160 -y 40
wait_for '^peerB ' "screen: not redrawn after growing again"
tmux send-keys -t $SESSION q
for i in $(seq 30); do tmux has-session -t $SESSION 2>/dev/null || break; sleep 0.1; done
tmux has-session -t $SESSION 2>/dev/null && fail "epdtop did not quit on 'q'"

# A peer with a long host id (HostId= takes 63 characters; /etc/machine-id has 32):
# epdd tracks a connection to it (TrackSocket), its bus names the peer whole and its
# pinned maps keep the first 31 characters. One row, named whole, with the kernel's
# numbers (it was cut to 31 characters).
LONG=peer-0123456789abcdef0123456789abcdef0123456789abcdef0123456789
[ ${#LONG} = 63 ] || fail "LONG is ${#LONG} characters"
ip netns exec $NS "$HELPER" send 127.0.0.1 7421 --seconds 15 --rate 20000000 --peer $LONG \
        --daemon $ADDR > $TMP/long.jsonl 2>&1 &
PIDS+=($!)
long_ok() {
        "$EPDTOP" -A $ADDR --json | jq -e --arg id $LONG '
                .pins == true and
                ([.peers[] | select(.name | startswith("peer-0123"))] | length == 1) and
                ([.peers[] | select(.name == $id and .kernel == true and .connections == 1 and
                                    .bytes_acked > 0)] | length == 1)' > /dev/null
}
for i in $(seq 40); do long_ok && break; sleep 0.1; done
long_ok || { "$EPDTOP" -A $ADDR --json; cat $TMP/long.jsonl; fail "a peer with a 63-character host id"; }
echo "ok: a peer with a 63-character host id is one row, named whole, with its kernel numbers"

# Without a daemon and without pins, --json says so and fails.
"$EPDTOP" -A direct:$TMP/nonexistent --pins $TMP/none --json > $TMP/none.json 2>&1 && fail "epdtop without sources succeeded"
echo PASS
