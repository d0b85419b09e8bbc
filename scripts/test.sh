#!/bin/bash
# The whole test suite: installs dependencies, builds warning-free with -Werror, and
# runs every test under ASan+UBSan (unit, integration, fuzz regressions, systemd
# boot). Tests that need something this machine lacks exit 77 and say why.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# 1. A plain optimized build must be warning-free (-Werror).
# (A setup interrupted earlier leaves a directory meson does not take again.)
[ -f build-release/build.ninja ] || rm -rf build-release
if [ ! -d build-release ]; then
        meson setup build-release -Dbuildtype=release -Dwerror=true >/dev/null
fi
ninja -C build-release

# 2. Everything again under the sanitizers, and every test run there.
[ -f build-asan/build.ninja ] || rm -rf build-asan
if [ ! -d build-asan ]; then
        meson setup build-asan -Dbuildtype=debug -Dwerror=true -Db_sanitize=address,undefined \
                -Db_lundef=false >/dev/null
fi
ninja -C build-asan

# No test may read or write the host's epd state (a journal a run left in /var/lib/epd
# once broke every later run; the host service's BPF pins under /sys/fs/bpf/epd): each
# uses its own temporary directories. What is there before the suite (or its absence)
# must be exactly what is there after it. (On a machine where something else runs epdd
# at the same time, that daemon's changes show here too: CI's machine runs nothing
# else.)
host_state() {
        local d
        for d in /var/lib/epd /etc/epd /run/epd /sys/fs/bpf/epd; do
                if [ -e "$d" ]; then
                        find "$d" -printf '%p %y %m %s %T@\n' 2>/dev/null | sort
                else
                        echo "$d absent"
                fi
        done
        return 0 # a directory find cannot read (a bpffs mounted 0700, not root) is listed as far as it goes
}
state_before=$(host_state)

rc=0
meson test -C build-asan --print-errorlogs --num-processes 2 "$@" || rc=$?

# 3. RDMA on soft-RoCE: two epdd in a qemu VM (TCG) on rxe devices, handoffs over RDMA,
# faults, fallback to tcp (tests/rdma/run-vm-test.sh, docs/rdma.md). About a minute; bounded
# so that a hung guest fails the suite instead of holding it. It runs the release build
# (the sanitizers' cost under emulation would multiply the time). Exit 77 (no qemu, no
# rxe provider, the kernel package cannot be downloaded) is a skip with its reason. Its work
# files (the kernel package, kept for the next run; the initramfs, the guest's output)
# live in the build tree, not in /tmp.
rdma_rc=0
EPD_RDMA_VM_DIR=${EPD_RDMA_VM_DIR:-$PWD/build-release/rdma-vm} EPD_RDMA_VM_TIMEOUT=${EPD_RDMA_VM_TIMEOUT:-480} \
        timeout 540 tests/rdma/run-vm-test.sh build-release || rdma_rc=$?
case $rdma_rc in
0) echo "ok: RDMA soft-RoCE VM test passed" ;;
77) echo "SKIP: RDMA soft-RoCE VM test (reason above)" ;;
*) echo "FAIL: RDMA soft-RoCE VM test (exit $rdma_rc)"; rc=1 ;;
esac

state_after=$(host_state)
if [ "$state_before" != "$state_after" ]; then
        echo "FAIL: the suite changed the host's epd state (/var/lib/epd, /etc/epd, /run/epd, /sys/fs/bpf/epd); before < > after:"
        diff <(echo "$state_before") <(echo "$state_after") || true
        rc=1
else
        echo "ok: /var/lib/epd, /etc/epd, /run/epd and /sys/fs/bpf/epd are as they were before the suite"
fi

# The closing line, counted from meson's own log.
python3 - build-asan/meson-logs/testlog.json <<'PY'
import json, sys
n = {"OK": 0, "FAIL": 0, "SKIP": 0}
for line in open(sys.argv[1]):
    r = json.loads(line).get("result", "")
    if r in ("OK", "EXPECTEDFAIL"):
        n["OK"] += 1
    elif r == "SKIP":
        n["SKIP"] += 1
    else:
        n["FAIL"] += 1
print(f"tests: {n['OK']} passed, {n['FAIL']} failed, {n['SKIP']} skipped")
PY
exit $rc
