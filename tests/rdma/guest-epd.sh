#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# Runs inside the VM of run-vm-test.sh (Debian kernel, host root via 9p + overlay).
# Two epdd in the initial network namespace (rxe in this kernel listens only there),
# each on its own rxe device over one veth pair; checks what epdd discovers and chooses,
# then runs the handoff and fault tests over RDMA (test-rdma-vm.py).
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
OUT=/run/epd-vm-out/result.log
exec > >(tee $OUT) 2>&1
BUILD=$(sed -n 's/.*epdbuild=\([^ ]*\).*/\1/p' /proc/cmdline)
EPDD=$BUILD/daemon/epdd EPDCTL=$BUILD/tools/epdctl
FAIL=0
check() { if eval "$2"; then echo "ok: $1"; else echo "FAILED: $1"; FAIL=1; fi; }
finish() { [ $FAIL = 0 ] && echo "RESULT PASS" || echo "RESULT FAIL"; sync; busybox poweroff -f; }

ip link set lo up
for m in rdma_rxe ib_uverbs veth; do modprobe $m || echo "modprobe $m FAILED"; done
ip link add veth0 type veth peer name veth1
ip addr add 10.1.0.1/24 dev veth0; ip addr add 10.1.0.2/24 dev veth1
ip link set veth0 up; ip link set veth1 up
# Both ends are local addresses: accept packets with a local source (recipe's trap).
for k in all default veth0 veth1; do sysctl -qw net.ipv4.conf.$k.accept_local=1 net.ipv4.conf.$k.rp_filter=0; done
# Locally generated traffic to the other end leaves through the veth (not lo), so the
# route each epdd sees to its peer is the interface its rxe device carries.
# The local table's rule (pref 0) would answer first: move it behind ours.
ip rule add pref 100 lookup local && ip rule del pref 0
ip rule add pref 10 to 10.1.0.2 iif lo lookup 100
ip route add 10.1.0.2 dev veth0 src 10.1.0.1 table 100
ip rule add pref 11 to 10.1.0.1 iif lo lookup 101
ip route add 10.1.0.1 dev veth1 src 10.1.0.2 table 101
rdma link add rxe0 type rxe netdev veth0 && rdma link add rxe1 type rxe netdev veth1
ibv_devices
ip route get 10.1.0.2; ip route get 10.1.0.1

T=/tmp/epd-vm; mkdir -p $T
(umask 077; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > $T/key; echo >> $T/key; chmod 600 $T/key)
conf() { # name, own ip, peer name, peer ip, extra [Cluster] line
        printf '[Daemon]\nHostId=%s\nSystemBus=no\nStateDirectory=%s\n[Arena:kv]\nSize=16M\n[Cluster]\nListen=%s:7300\nClusterKeyFile=%s\nHeartbeatInterval=4s\n%s\n[Peer:%s]\nAddress=%s:7300\nHostId=%s\n' \
                "$1" $T/$1.state "$2" $T/key "$5" "$3" "$4" "$3" > $T/$1.conf
}
conf alpha 10.1.0.1 bravo 10.1.0.2 "Transport=auto"
conf bravo 10.1.0.2 alpha 10.1.0.1 "Transport=rdma"
for n in alpha bravo; do
        $EPDD -c $T/$n.conf -s $T/$n.sock --no-system-bus > $T/$n.log 2>&1 &
        PIDS="${PIDS:-} $!"
done
for i in $(seq 1 100); do
        [ -S $T/alpha.sock ] && [ -S $T/bravo.sock ] &&
                $EPDCTL -A direct:$T/alpha.sock peers 2>/dev/null | grep -q ' up ' &&
                $EPDCTL -A direct:$T/bravo.sock peers 2>/dev/null | grep -q ' up ' && break
        sleep 0.3
done
# The queue pairs connect right after the control session: rdma follows within a moment.
for i in $(seq 1 50); do
        $EPDCTL -A direct:$T/alpha.sock --json peers 2>/dev/null | grep -q '"transport":"rdma"' &&
                $EPDCTL -A direct:$T/bravo.sock --json peers 2>/dev/null | grep -q '"transport":"rdma"' && break
        sleep 0.3
done
for n in alpha bravo; do echo "--- $n: epdctl peers"; $EPDCTL -A direct:$T/$n.sock peers; done
A=$($EPDCTL -A direct:$T/alpha.sock --json peers) B=$($EPDCTL -A direct:$T/bravo.sock --json peers)
check "alpha finds rxe0 on veth0" "grep -q 'rdma: device rxe0 port 1 carries veth0' $T/alpha.log"
check "no 'no RDMA devices' with rxe present" "! grep -q 'no RDMA devices' $T/alpha.log"
check "alpha chose rdma (auto) on veth0, naming both devices" "echo '$A' | grep -q '\"transport\":\"rdma\".*dev veth0.*rdma: rxe0 port 1 on veth0 here, rxe1 on the peer (Transport=auto)'"
check "bravo chose rdma (Transport=rdma) on veth1" "echo '$B' | grep -q '\"transport\":\"rdma\".*dev veth1.*rdma: rxe1 port 1 on veth1 here, rxe0 on the peer (Transport=rdma)'"
check "peers are up" "echo '$A' | grep -q '\"state\":\"up\"' && echo '$B' | grep -q '\"state\":\"up\"'"
check "alpha connected an RC queue pair" "grep -q 'writes to this peer go over RDMA' $T/alpha.log"
# The port goes down with its netdev: the peers fall back to tcp, and the reason says so.
ip link set veth0 down; sleep 2
# veth1 loses its carrier with veth0: bravo's route still names veth1, whose rxe1 port
# is now down. (alpha's table-100 route goes with veth0, so alpha falls back to lo.)
B=$($EPDCTL -A direct:$T/bravo.sock --json peers)
echo "after veth0 down: $B"
check "bravo sees rxe1's port go down" "echo '$B' | grep -q 'RDMA device rxe1 port 1 on veth1 is [a-zA-Z_]*, not ACTIVE'"
check "bravo uses tcp" "echo '$B' | grep -q '\"transport\":\"tcp\"'"
check "bravo logged the fallback" "grep -q 'falling back to tcp' $T/bravo.log"
for n in alpha bravo; do echo "--- $n.log"; cat $T/$n.log; done
# (not a bare `wait`: it would also wait for the tee of the output)
kill $PIDS 2>/dev/null; wait $PIDS

# Handoffs over RDMA, faults, fallback (the TCP tests' clients and checks).
ip link set veth0 up; sleep 1
ip route replace 10.1.0.2 dev veth0 src 10.1.0.1 table 100
ip route replace 10.1.0.1 dev veth1 src 10.1.0.2 table 101
S=$(date +%s)
if timeout 900 python3 -u $(dirname $0)/test-rdma-vm.py $BUILD; then
        echo "ok: test-rdma-vm.py ($(( $(date +%s) - S )) s)"
else
        echo "FAILED: test-rdma-vm.py ($(( $(date +%s) - S )) s)"; FAIL=1
fi
finish
