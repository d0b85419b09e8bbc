#!/usr/bin/env bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# Builds epd on a GPU machine, runs the unit tests, the GPU device tests (also under
# ASan+UBSan) and the GPU benchmarks (gpu-bench: the transport, kernels and VMM;
# gpu-handoff-bench: handoffs between GPU arenas through a real epdd and worker
# processes, and CoW on a GPU arena), and prints the tables last. Written for any
# number of GPUs: the GPU 0 -> GPU 1 rows run where there are two or more.
#
#   bench/gpu/run-device.sh            (from anywhere; builds in build-device*/)
#   EPD_DEVICE_TESTS=gpu bench/gpu/run-device.sh   (only the GPU tests of the suite)
#
# Needs: a CUDA driver and GPU, nvcc, meson + ninja, libsystemd. Logs go to $OUT when
# it is set (the device tool's output folder), else to build-device/logs.
# -Werror is off there by default (its gcc 13 warns where CI's does not, in other
# subsystems' files); EPD_DEVICE_WERROR=true turns it on.
set -u
export NCCL_NVLS_ENABLE=0
cd "$(dirname "$0")/../.."
ROOT=$PWD
LOGS=${OUT:-$ROOT/build-device/logs}
mkdir -p "$LOGS"

. bench/device-env.sh
status() { printf '%-28s %s\n' "$1" "$2" | tee -a "$LOGS/summary.txt"; }
: >"$LOGS/summary.txt"

nvidia-smi --query-gpu=name,driver_version,memory.total,pci.bus_id --format=csv,noheader 2>&1 | tee "$LOGS/gpu.txt"
echo "nvcc: $(command -v nvcc || echo none)"

build() { # dir, extra meson args...
        local dir=$1; shift
        if [ ! -f "$dir/build.ninja" ]; then
                "${MESON[@]}" setup "$dir" -Dbpf=disabled -Dcuda=enabled -Dwerror=${EPD_DEVICE_WERROR:-false} "$@" \
                        >>"$LOGS/build.log" 2>&1 || { tail -30 "$LOGS/build.log"; return 1; }
        fi
        ninja -C "$dir" >>"$LOGS/build.log" 2>&1 || { grep -E "error|FAILED" -A5 "$LOGS/build.log" | head -40; return 1; }
}

rc=0
t0=$(date +%s)
if build build-device; then status build ok; else status build FAILED; exit 1; fi
# Only the GPU targets under the sanitizers, without -Werror: this gcc may warn where
# CI's does not, in files that are not the GPU domain's.
if "${MESON[@]}" setup build-device-asan -Dbpf=disabled -Dcuda=enabled -Db_sanitize=address,undefined \
        >>"$LOGS/build.log" 2>&1 || [ -f build-device-asan/build.ninja ]; then
        if ninja -C build-device-asan bench/gpu/gpu-device-test >>"$LOGS/build.log" 2>&1; then
                status "build (asan,ubsan)" ok
        else
                status "build (asan,ubsan)" FAILED
        fi
fi
status "build time" "$(( $(date +%s) - t0 )) s"

if ls build-device/tests/unit/test-* >/dev/null 2>&1; then
        # Unit and integration tests (test-gpu runs epdd with a GPU arena here).
        if [ "${EPD_DEVICE_TESTS:-all}" = gpu ]; then
                "${MESON[@]}" test -C build-device test-gpu-loader test-gpu test-gpu-handoff >"$LOGS/tests.log" 2>&1
        else
                "${MESON[@]}" test -C build-device --suite unit --suite integration >"$LOGS/tests.log" 2>&1
        fi
        cp build-device/meson-logs/testlog.txt "$LOGS/testlog.txt" 2>/dev/null
        ok=$(grep -cE '^ *[0-9]+/[0-9]+ .* OK' "$LOGS/tests.log")
        skip=$(grep -cE '^ *[0-9]+/[0-9]+ .* SKIP' "$LOGS/tests.log")
        bad=$(grep -E '^ *[0-9]+/[0-9]+ .* (FAIL|ERROR|TIMEOUT)' "$LOGS/tests.log")
        if [ -z "$bad" ]; then
                status "unit+integration tests" "ok ($ok passed, $skip skipped)"
        else
                status "unit+integration tests" "FAILED"; echo "$bad"; rc=1
        fi
        grep -A3 "^test:.*test-gpu$" -m1 "$LOGS/testlog.txt" >/dev/null && \
                sed -n '/test-gpu$/,/^====/p' "$LOGS/testlog.txt" | grep -E "shared by two|epdctl|GPU domain|^[0-9]+ +[0-9a-f]{4}:" | head
        sed -n '/test-gpu-handoff$/,/^====/p' "$LOGS/testlog.txt" | grep -E "^driver|^handoff|^CoW|Checks" | head
else
        status "unit+integration tests" "skipped: no libcheck on this machine"
fi

./build-device/bench/gpu/gpu-device-test >"$LOGS/device-test.log" 2>&1; r=$?
cat "$LOGS/device-test.log"
if [ $r -eq 0 ]; then status "gpu device tests" ok; else status "gpu device tests" "FAILED (rc=$r)"; rc=1; fi

if [ -x build-device-asan/bench/gpu/gpu-device-test ]; then
        # CUDA needs the shadow gap unprotected; libcuda's own allocations are not ours.
        ASAN_OPTIONS=protect_shadow_gap=0:detect_leaks=0 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
                ./build-device-asan/bench/gpu/gpu-device-test >"$LOGS/device-test-asan.log" 2>&1; r=$?
        if [ $r -eq 0 ]; then status "gpu device tests (asan)" ok; else status "gpu device tests (asan)" "FAILED (rc=$r)"; tail -30 "$LOGS/device-test-asan.log"; rc=1; fi
fi

# Handoffs through epdd: a real daemon, a prefill and a decode worker process.
./build-device/bench/gpu/gpu-handoff-bench ./build-device/daemon/epdd >"$LOGS/handoff-bench.log" 2>&1; r=$?
if [ $r -eq 0 ]; then status "gpu handoff bench" ok; else status "gpu handoff bench" "FAILED (rc=$r)"; tail -30 "$LOGS/handoff-bench.log"; rc=1; fi

./build-device/bench/gpu/gpu-bench >"$LOGS/bench.log" 2>&1; r=$?
if [ $r -ne 0 ]; then status "gpu bench" "FAILED (rc=$r)"; tail -30 "$LOGS/bench.log"; rc=1; fi

# The copy kernels alone (descriptors already on the GPU, CUDA-event timing): which tile
# and which kernel come closest to a raw copy for scattered chunks (bench/gpu/kernel-study.cu).
if nvcc -O3 -std=c++17 -arch=sm_90a -DSTUDY_TMA -o build-device/kernel-study bench/gpu/kernel-study.cu -lcuda \
        >"$LOGS/kernel-study-build.log" 2>&1 || nvcc -O3 -std=c++17 -o build-device/kernel-study \
        bench/gpu/kernel-study.cu -lcuda >>"$LOGS/kernel-study-build.log" 2>&1; then
        timeout 120 ./build-device/kernel-study >"$LOGS/kernel-study.log" 2>&1 || status "kernel study" "FAILED"
else
        status "kernel study" "not built (see kernel-study-build.log)"
fi

echo
echo "== summary =="
cat "$LOGS/summary.txt"
grep '^RESULT' "$LOGS/device-test.log" || true
echo
echo "== benchmarks ($(head -1 "$LOGS/gpu.txt"); $(grep -c . "$LOGS/gpu.txt") GPU(s)) =="
sed -n '/^| benchmark/,$p' "$LOGS/bench.log"
echo "(post_ms: the host's part of each transport batch, before the GPU has all of it)"
grep -E '^RESULT d2d' "$LOGS/bench.log" | sed 's/bytes=[0-9]* //'
echo
echo "== copy kernels alone (scattered chunks; ratio to a raw copy of the same 4 GiB) =="
grep -E '^raw|^STUDY' "$LOGS/kernel-study.log" 2>/dev/null | grep -E 'raw|pack.cu|64K cs U4|32K plain U8|bulk2 4x32K|copy engine'
echo
echo "== handoffs through epdd =="
grep -E "^GPUs:|^CoW:|not measured|^timeline" "$LOGS/handoff-bench.log"
sed -n '/^| benchmark/,$p' "$LOGS/handoff-bench.log"
exit $rc
