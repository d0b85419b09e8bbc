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
        libcurl4-openssl-dev libjson-c-dev etcd-server etcd-client openssl
        dbus systemd-container iproute2 nftables iperf3 tmux
        python3 python3-numpy
)

missing=()
for p in "${PKGS[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
        exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
        SUDO=sudo
else
        SUDO=
fi
echo "Installing: ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
