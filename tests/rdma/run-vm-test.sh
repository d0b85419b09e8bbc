#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# Runs epd's RDMA tests on soft-RoCE: boots Debian's kernel (which ships rdma_rxe) under
# qemu with this host's root shared read-only over 9p, and runs guest-epd.sh inside.
#
#   tests/rdma/run-vm-test.sh [BUILD_DIR]        (default: ./build)
#
# Needs: qemu-system-x86 busybox-static kmod cpio rdma-core ibverbs-providers, and apt
# access for `apt-get download` of the kernel package the first time. Exits 77 when
# something it needs is missing. Work files: $EPD_RDMA_VM_DIR (default /tmp/epd-rdma-vm).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=$(cd "${1:-build}" && pwd) || exit 2
P=${EPD_RDMA_VM_DIR:-/tmp/epd-rdma-vm}
KPKG=${KPKG:-linux-image-6.1.0-57-amd64}   # a Debian bookworm kernel: ships rdma_rxe.ko

skip() { echo "SKIP: $*"; exit 77; }
for b in qemu-system-x86_64 busybox modprobe depmod cpio dpkg; do
        command -v $b >/dev/null || skip "$b is not installed (see docs/rdma.md)"
done
[ -e /usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so ] || ls /usr/lib/*/libibverbs/librxe-* >/dev/null 2>&1 ||
        skip "the rxe verbs provider (ibverbs-providers) is not installed"
[ -x "$BUILD/daemon/epdd" ] && [ -x "$BUILD/tools/epdctl" ] || { echo "no epdd/epdctl in $BUILD"; exit 2; }

mkdir -p "$P" && cd "$P" || exit 2
if [ ! -d kpkg/lib/modules ]; then
        if ! ls ${KPKG}_*.deb >/dev/null 2>&1 && ! apt-get download "$KPKG" >/dev/null 2>&1; then
                # The archive drops an old kernel's package when it publishes the next:
                # then the kernel linux-image-amd64 depends on now.
                alt=$(apt-cache depends linux-image-amd64 2>/dev/null |
                      awk '/Depends: linux-image-[0-9]/ { print $2; exit }')
                [ -n "$alt" ] && apt-get download "$alt" >/dev/null 2>&1 ||
                        skip "cannot download $KPKG${alt:+ nor $alt} with apt-get"
                KPKG=$alt
        fi
        mkdir -p kpkg && dpkg -x ${KPKG}_*.deb kpkg || exit 2
fi
KV=$(ls kpkg/lib/modules | head -1)
[ -f initramfs.cpio.gz ] && [ initramfs.cpio.gz -nt "$HERE/init" ] || P=$P KV=$KV "$HERE/build-initramfs.sh" >/dev/null || exit 2
rm -rf out && mkdir -p out
START=$(date +%s)
# TCG: /dev/kvm is not usable on these machines. The guest has no network device.
timeout ${EPD_RDMA_VM_TIMEOUT:-1200} qemu-system-x86_64 -accel ${ACCEL:-tcg} -cpu ${CPU:-max} -smp 2 -m 2G \
        -nographic -serial mon:stdio -no-reboot -nic none \
        -kernel kpkg/boot/vmlinuz-$KV -initrd initramfs.cpio.gz \
        -append "console=ttyS0 edd=off panic=-1 loglevel=4 epdscript=$HERE/guest-epd.sh epdbuild=$BUILD" \
        -virtfs local,path=/,mount_tag=root,security_model=none,readonly=on,multidevs=remap \
        -virtfs local,path=$P/kpkg/lib/modules,mount_tag=mods,security_model=none,readonly=on \
        -virtfs local,path=$P/out,mount_tag=out,security_model=none </dev/null >console.log 2>&1
echo "VM run: $(( $(date +%s) - START )) s (console: $P/console.log)"
cat out/result.log 2>/dev/null || { tail -30 console.log; echo "FAIL: no result from the guest"; exit 1; }
grep -q '^RESULT PASS' out/result.log
