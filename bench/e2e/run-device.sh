#!/usr/bin/env bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# On a GPU machine: builds epd, starts epdd, runs the token-exact check (small Qwen3-VL:
# Encoder, Prefill and Decode processes through epdd vs Hugging Face generate in one
# process), then the benchmark (8B-class Qwen3-VL, random weights) against the
# colocated baseline, and prints the table last. Results: $OUT (or build-e2e/out).
#
#   bench/e2e/run-device.sh [REQUESTS] [LAYOUT] [GPUS]
#
# LAYOUT: worker processes, 1E1P1D (default), 1E1P2D, 2P2D, ... (no E: the prefill
# workers encode); GPUS: how many GPUs to spread them over, one per process, round robin
# (default: all the machine has; with one GPU every process shares GPU 0). With more
# than one GPU the benchmark adds the colocated data-parallel baseline on GPUS GPUs.
# E2E_MPS=1 runs every process (epdd's CUDA work included) as a client of a CUDA MPS
# server started for the run, so that the processes' kernels share the GPU side by side;
# E2E_STEPS="gpu check bench overhead" (default) picks the parts to run; E2E_BENCH_MODEL (default 8b)
# is the benchmark's config; E2E_DP=N adds the colocated data-parallel baseline with N
# processes over the GPUs (E2E_DP=2 with one GPU: two colocated processes on it, the
# baseline for a layout with two decode processes on that GPU);
# E2E_PROFILE=N[,N...] runs the Nth greedy decode of each process (counted per process:
# the decode worker's warm-up, then each row's first turns; the benchmark's own process:
# the colocated baseline's warm-up, its pass before the split's rows, its pass after)
# under torch's profiler, tables in $OUT/profile (qwen3vl.py's EPD_DECODE_PROFILE); with
# 12 requests, E2E_PROFILE=5,20,30 takes the decode worker's 5th (four in flight), 20th
# (four in flight, cache bypassed) and 30th (one in flight), the colocated baseline's
# 5th (its pass before) and 20th (after).
# EPDD_NICE=N starts epdd under `nice -n N`, default -10 as its unit runs it (a daemon on
# every request's critical path runs ahead of the workers' threads: docs/systemd.md);
# EPDD_NICE=0 for the default priority.
# The request stream mixes repeated images and agent requests (follow-up turns on
# workflow branches).
#
# Sizes and limits from the environment: CHECK_REQUESTS CHECK_MAX_NEW CHECK_TIMEOUT
# WARMUP IMAGES MAX_NEW CONCURRENCY BENCH_TIMEOUT (defaults below).
#
# Needs: a CUDA GPU, python3 with torch and transformers (Qwen3VLForConditionalGeneration),
# meson + ninja, libsystemd (headers from EPD_DEVICE_SYSROOT when the machine has none:
# see docs/gpu.md).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
cd "$(dirname "$0")/../.."
ROOT=$PWD
REQUESTS=${1:-12}
LAYOUT=${2:-1E1P1D}
GPUS=${3:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || echo 1)}
[ "$GPUS" -ge 1 ] 2>/dev/null || GPUS=1
STEPS=${E2E_STEPS:-gpu check bench overhead}
BENCH_MODEL=${E2E_BENCH_MODEL:-8b}
DP=()
[ -n "${E2E_DP:-}" ] && DP=(--dp --dp-procs "$E2E_DP")
OUTDIR=${OUT:-$ROOT/build-e2e/out}
mkdir -p "$OUTDIR"
. bench/device-env.sh
B=build-e2e
t0=$(date +%s)
if [ ! -f $B/build.ninja ]; then
        "${MESON[@]}" setup $B -Dbuildtype=release -Dbpf=disabled -Dtests=disabled -Dtui=disabled \
                >"$OUTDIR/build.log" 2>&1 || { tail -30 "$OUTDIR/build.log"; exit 1; }
fi
ninja -C $B daemon/epdd tools/epdctl client/libepd.so.0.1.0 >>"$OUTDIR/build.log" 2>&1 || { grep -E "error|FAILED" -A5 "$OUTDIR/build.log" | head -40; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"

D=/tmp/epd-e2e
rm -rf $D; mkdir -p $D
# Where KV and features live: GPU arenas of epdd on GPU 0 (the default with one GPU:
# the prefill writes K/V into pages with one kernel per layer, the decode on the same GPU
# takes the pages over without a byte copied, features are read in place), or host
# arenas (E2E_ARENAS=host; the default with several GPUs, whose processes cannot all map
# GPU 0's arenas).
E2E_ARENAS=${E2E_ARENAS:-$([ "$GPUS" -eq 1 ] && echo gpu || echo host)}
if [ "$E2E_ARENAS" = gpu ]; then
        KV_ARENA=kvgpu
        ARENAS="[Arena:kvgpu]
Domain=gpu
Gpu=0
Usage=kv
Size=8G
[Arena:featgpu]
Domain=gpu
Gpu=0
Usage=feature
Size=2G
PageSize=64K"
else
        KV_ARENA=host0
        ARENAS="[Arena:host0]
Usage=kv
Size=4G
[Arena:feat0]
Usage=feature
Size=2G
PageSize=64K"
fi
cat >$D/epd.conf <<CONF
[Daemon]
Socket=$D/bus
SystemBus=no
HostId=gpu-host
StateDirectory=$D/state
$ARENAS
[Features]
CacheSize=1G
CONF
start_epdd() { # a fresh daemon: a KV arena takes the page size of the first layout
        rm -rf $D/state $D/bus
        nice -n "${EPDD_NICE:--10}" $B/daemon/epdd --config=$D/epd.conf 2>>"$OUTDIR/epdd.log" &
        EPDD=$!
        for _ in $(seq 200); do [ -S $D/bus ] && break; sleep 0.05; done
}
stop_epdd() {
        kill -TERM $EPDD; wait $EPDD; epdd_rc=$?
}
EPDD=
MPS=off
# E2E_MPS=1: the processes sharing the GPU run as clients of a CUDA MPS server started
# here (its pipe and log directories in $D; stopped at the end), so that their kernels
# can run side by side instead of taking turns.
if [ "${E2E_MPS:-0}" = 1 ]; then
        if command -v nvidia-cuda-mps-control >/dev/null; then
                export CUDA_MPS_PIPE_DIRECTORY=$D/mps-pipe CUDA_MPS_LOG_DIRECTORY=$D/mps-log
                mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
                nvidia-cuda-mps-control -d && MPS=on || MPS="failed to start"
        else
                MPS="not available (no nvidia-cuda-mps-control)"
        fi
fi
stop_mps() { [ "$MPS" = on ] && echo quit | nvidia-cuda-mps-control; MPS=stopped; }
trap 'kill -TERM $EPDD 2>/dev/null; wait $EPDD 2>/dev/null; stop_mps' EXIT
export EPD_LIBRARY=$ROOT/$B/client/libepd.so
ARGS=(--address direct:$D/bus --epdctl $ROOT/$B/tools/epdctl --layout "$LAYOUT" --gpus "$GPUS" --kv-arena "$KV_ARENA")
echo "layout $LAYOUT on $GPUS GPU(s); arenas: $E2E_ARENAS; steps: $STEPS; MPS: $MPS"
gpu_torch_rc=- check_rc=- bench_rc=- epdd_rc=-

if [[ " $STEPS " == *" gpu "* ]]; then
        echo "== GPU arena through torch views (python/tests/device_gpu_torch.py)"
        (cd python/tests && EPDD=$ROOT/$B/daemon/epdd timeout 60 python3 device_gpu_torch.py) 2>&1 | tail -12 \
                | tee "$OUTDIR/gpu-torch.log"
        gpu_torch_rc=${PIPESTATUS[0]}
fi
if [[ " $STEPS " == *" check "* ]]; then
        start_epdd
        echo "== token-exact check (small config; first turns and agent branches)"
        timeout ${CHECK_TIMEOUT:-150} python3 bench/e2e/e2e.py "${ARGS[@]}" --check small \
                --requests ${CHECK_REQUESTS:-6} --agent-every 3 --branches 2 --max-new ${CHECK_MAX_NEW:-16} \
                --concurrency 3 --json "$OUTDIR/check.json" 2>&1 | grep -vE "Warning|warn\(" \
                | tee "$OUTDIR/check.log" | tail -22
        check_rc=${PIPESTATUS[0]}
        stop_epdd
fi
if [[ " $STEPS " == *" bench "* ]]; then
        start_epdd
        echo "== benchmark ($BENCH_MODEL config)"
        [ -n "${E2E_PROFILE:-}" ] && export EPD_DECODE_PROFILE="$OUTDIR/profile:$E2E_PROFILE"
        timeout ${BENCH_TIMEOUT:-300} python3 bench/e2e/e2e.py "${ARGS[@]}" ${DP[@]+"${DP[@]}"} \
                --bench "$BENCH_MODEL" --requests "$REQUESTS" --warmup ${WARMUP:-2} --images ${IMAGES:-4} \
                --max-new ${MAX_NEW:-32} --concurrency ${CONCURRENCY:-4} --agent-every 3 --branches 2 \
                --json "$OUTDIR/bench.json" 2>&1 | grep -vE "Warning|warn\(" | tee "$OUTDIR/bench.log" | tail -20
        bench_rc=${PIPESTATUS[0]}
        unset EPD_DECODE_PROFILE
        $B/tools/epdctl -A direct:$D/bus features >"$OUTDIR/features.txt" 2>&1
        stop_epdd
fi
if [[ " $STEPS " == *" overhead "* ]] && [ "$E2E_ARENAS" = gpu ]; then
        start_epdd
        # The sink's host cost per layer with the GPU idle, and its one-launch write in
        # parts (bench/e2e/sink-overhead.py).
        timeout 90 python3 bench/e2e/sink-overhead.py --address direct:$D/bus --arena $KV_ARENA 2>&1 \
                | grep -vE "Warning|warn\(" | tail -5 | tee "$OUTDIR/sink-overhead.log"
        # The feature calls' host cost, step by step, beside a bus round trip
        # (bench/e2e/feature-overhead.py).
        timeout 60 python3 bench/e2e/feature-overhead.py --address direct:$D/bus 2>&1 \
                | grep -vE "Warning|warn\(" | tail -2 | tee "$OUTDIR/feature-overhead.log"
        stop_epdd
        # The vision tower alone, as the workers run it (OMP_WAIT_POLICY=PASSIVE), back to
        # back and after idling as the encoder does between requests at one in flight
        # (bench/e2e/tower-threads.py).
        for gap in 0 1.2; do
                OMP_WAIT_POLICY=PASSIVE timeout 90 python3 bench/e2e/tower-threads.py --reps 10 --gap $gap 2>&1 \
                        | grep -E "^tower-threads" | tee -a "$OUTDIR/tower-threads.log"
        done
        # The greedy decode alone, per step, under OpenMP's default (the colocated
        # process's) and the workers' setting (bench/e2e/decode-threads.py).
        for policy in - PASSIVE; do
                if [ "$policy" = - ]; then run=(env -u OMP_WAIT_POLICY); else run=(env OMP_WAIT_POLICY=$policy); fi
                "${run[@]}" timeout 100 python3 bench/e2e/decode-threads.py --reps 4 2>&1 \
                        | grep -E "^decode-threads" | tee -a "$OUTDIR/decode-threads.log"
        done
fi
stop_mps
trap - EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "gpu-torch rc=$gpu_torch_rc check rc=$check_rc bench rc=$bench_rc epdd exit=$epdd_rc total $(( $(date +%s) - t0 )) s"
failed=0
for rc in "$gpu_torch_rc" "$check_rc" "$bench_rc"; do  # "-": the step was not asked for
        [ "$rc" = - ] || [ "$rc" = 0 ] || failed=1
done
exit $failed
