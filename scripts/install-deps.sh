#!/bin/bash
# Installs what epd needs to build, run and test, from Debian's packages.
# Idempotent and quiet when everything is already there.
set -euo pipefail

PKGS=(
        build-essential meson ninja-build pkg-config
        libsystemd-dev check
        libnl-3-dev libnl-route-3-dev libssl-dev libncurses-dev
        libbpf-dev libelf-dev zlib1g-dev bpftool clang llvm
        libibverbs-dev
        libmicrohttpd-dev
        libcurl4-openssl-dev libjson-c-dev etcd-server etcd-client openssl
        dbus systemd-container iproute2 nftables iperf3 tmux
        python3 python3-numpy
        groff-base man-db
)
# Only one test needs prometheus (test-prometheus: a real Prometheus scraping epdd, and
# promtool); where they cannot be had, that test says so and skips, and nothing else
# is held up.
# The soft-RoCE VM test (tests/rdma/run-vm-test.sh) needs the next ones; without them it
# skips and says why.
OPTIONAL=(prometheus qemu-system-x86 busybox-static kmod cpio rdma-core ibverbs-providers)

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
missing=()
for p in "${PKGS[@]}"; do
        installed "$p" || missing+=("$p")
done
optional=()
for p in "${OPTIONAL[@]}"; do
        installed "$p" || optional+=("$p")
done
if [ ${#missing[@]} -eq 0 ] && [ ${#optional[@]} -eq 0 ]; then
        exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
        SUDO=sudo
else
        SUDO=
fi
export DEBIAN_FRONTEND=noninteractive
# etcd-server and prometheus ship a daemon that their packages would enable and start
# on this host (ports 2379 and 9090, at every boot): the tests only use the binaries,
# each starting its own. While installing, a policy-rc.d refuses every start, and the
# units these packages newly bring are disabled afterwards. (One already there is
# left as it was.)
daemons=(etcd prometheus)
was_enabled=()
for u in "${daemons[@]}"; do
        systemctl is-enabled "$u.service" >/dev/null 2>&1 && was_enabled+=("$u") || true
done
policy=
# On every exit, a failed install included: the policy file goes, and the daemon units
# the install enabled are disabled again.
finish() {
        [ -z "$policy" ] || $SUDO rm -f "$policy"
        for u in "${daemons[@]}"; do
                [[ " ${was_enabled[*]} " == *" $u "* ]] && continue
                systemctl is-enabled "$u.service" >/dev/null 2>&1 || continue
                $SUDO systemctl disable --now "$u.service" >/dev/null 2>&1 || true
        done
}
trap finish EXIT
if [ ! -e /usr/sbin/policy-rc.d ]; then
        policy=/usr/sbin/policy-rc.d
        printf '#!/bin/sh\n# scripts/install-deps.sh: no daemon starts while installing\nexit 101\n' |
                $SUDO tee $policy >/dev/null
        $SUDO chmod 0755 $policy
fi
$SUDO apt-get update -qq
if [ ${#missing[@]} -gt 0 ]; then
        echo "Installing: ${missing[*]}"
        $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for p in "${optional[@]}"; do
        $SUDO apt-get install -y -qq --no-install-recommends "$p" >/dev/null ||
                echo "Cannot install $p here (optional: the test that needs it will skip and say why)." >&2
done
