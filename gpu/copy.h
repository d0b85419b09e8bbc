/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The GPU copy paths of one process (the daemon's GpuContext owns one):
 *
 *   same GPU       cuMemcpyDtoDAsync on the device's D2D stream (copy engine)
 *   GPU → GPU      cuMemcpyDtoDAsync on the destination's PEER stream when the
 *                  destination has peer access to the source (NVLink/PCIe P2P: arenas are
 *                  mapped for every peer that can reach them), else cuMemcpyPeerAsync,
 *                  which the driver stages through host memory
 *   GPU → host     cuMemcpyDtoHAsync on the source device's D2H stream (pinned host
 *                  memory: gpu_host_register)
 *   host → GPU     cuMemcpyHtoDAsync on the destination device's H2D stream
 *
 * Each path has its own non-blocking stream per device, so transfers in the two
 * directions and between GPUs overlap. A batch (gpu_copy_submit) completes once, with
 * the first error of any of its segments: an event recorded behind each of its parts.
 * Each (device, path) queue has a completion thread of its own (made on the queue's
 * first part), which waits for the queue's parts in order (it sleeps on a timer until
 * shortly before the part's expected end, polls the event a while, then sleeps in the
 * blocking-sync wait; a failed stream fails the wait: gpu_copy_engine_set_spin()); the
 * thread that sees a batch's last part done queues the completion and writes to an
 * eventfd; the event loop watches that fd and calls gpu_copy_reap(). Queues do not wait
 * for each other: batches on different GPUs or paths complete as their own parts end,
 * not necessarily in submission order; batches of one queue complete in order. No
 * stream waits for the host (as behind a stream callback) between parts.
 *
 * A group of several device-to-device segments is one cuMemcpyBatchAsync call where
 * the driver has it (13.0+; still the copy engines), else one cuMemcpyDtoDAsync each.
 * Batches of many small same-GPU or peer segments can optionally go through one launch
 * of the batched copy kernel (pack.h) instead of one copy-engine operation per segment;
 * this uses SMs of the GPU, which the workers' kernels share, so it is off unless
 * gpu_copy_engine_set_kernel_batching() turns it on. Copy-on-write page copies are
 * same-GPU segments of one arena. */

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pack.h"
#include "system.h"
#include "vmm.h"

typedef struct GpuCopyEngine GpuCopyEngine;

typedef enum GpuCopyPath {
        GPU_COPY_SAME_GPU,
        GPU_COPY_PEER,
        GPU_COPY_D2H,
        GPU_COPY_H2D,
        _GPU_COPY_PATH_MAX,
        _GPU_COPY_PATH_INVALID = -EINVAL,
} GpuCopyPath;

typedef struct GpuCopySeg {
        GpuArena *src;          /* NULL: src_host */
        GpuArena *dst;          /* NULL: dst_host */
        void *src_host;         /* pinned host memory (gpu_host_register) */
        void *dst_host;
        uint64_t src_offset;    /* into the arena, or added to the host pointer */
        uint64_t dst_offset;
        uint64_t length;
} GpuCopySeg;

typedef struct GpuCopyDone {
        uint64_t cookie;
        int error;              /* 0 or negative errno */
        uint64_t bytes;
} GpuCopyDone;

typedef struct GpuCopyStats {
        uint64_t batches;
        uint64_t segments;      /* after coalescing */
        uint64_t bytes;
        uint64_t kernel_launches;
        uint64_t batch_api_calls;
        uint64_t strided_copies;  /* cuMemcpy2DAsync calls */
        uint64_t strided_rows;    /* the segments they moved */
        uint64_t failures;
        uint64_t bytes_by_path[_GPU_COPY_PATH_MAX];
} GpuCopyStats;

const char *gpu_copy_path_to_string(GpuCopyPath p);
/* Which path a segment takes (pure over the peer matrix); -EINVAL for host → host or
 * a segment without a source or destination. */
GpuCopyPath gpu_copy_path(const GpuSystem *s, const GpuCopySeg *seg);

int gpu_copy_engine_new(GpuSystem *s, GpuCopyEngine **ret);
/* Sets up the engine's streams, batched kernels and descriptor memory on GPU dev (its
 * primary context retained and made current on the calling thread, which must be the
 * submitting one). A new engine holds nothing on any GPU: a GPU is set up when a
 * submission first copies on it, or ahead of that by this call, so that the first copy
 * does not pay for loading the kernels. Idempotent. */
int gpu_copy_engine_use_device(GpuCopyEngine *e, int dev);
/* Waits for everything in flight (shutdown only), then frees. */
GpuCopyEngine *gpu_copy_engine_free(GpuCopyEngine *e);
DEFINE_TRIVIAL_CLEANUP_FUNC(GpuCopyEngine *, gpu_copy_engine_free);

/* When a device-to-device group goes through one launch of the batched copy kernel
 * instead of the copy engines (which cost a few microseconds per operation, whatever
 * its size, so that many scattered pages reach a fraction of the copy's bandwidth):
 *   never   the copy engines only (the default of a new engine)
 *   small   groups of at least min_segments segments whose mean length is at most
 *           GPU_COPY_KERNEL_SMALL_MAX (epdd's default: [Gpu] CopyKernel=small)
 *   always  every group of at least min_segments segments
 * The kernel runs on SMs that the workers' kernels share. */
typedef enum GpuCopyKernelPolicy {
        GPU_COPY_KERNEL_NEVER,
        GPU_COPY_KERNEL_SMALL,
        GPU_COPY_KERNEL_ALWAYS,
        _GPU_COPY_KERNEL_POLICY_MAX,
        _GPU_COPY_KERNEL_POLICY_INVALID = -EINVAL,
} GpuCopyKernelPolicy;

#define GPU_COPY_KERNEL_SMALL_MAX (8ULL << 20)

const char *gpu_copy_kernel_policy_to_string(GpuCopyKernelPolicy p);
GpuCopyKernelPolicy gpu_copy_kernel_policy_from_string(const char *s);
void gpu_copy_engine_set_kernel_policy(GpuCopyEngine *e, GpuCopyKernelPolicy p, size_t min_segments);
/* Pure: whether a group of n segments of `bytes` in all goes to the kernel under p. */
bool gpu_copy_kernel_wanted(GpuCopyKernelPolicy p, size_t min_segments, size_t n, uint64_t bytes);
/* Pure: whether a kernel on device `dev` may read every segment's source arena (the
 * segments idx[0..n) of a peer group: the group is keyed by the destination's device,
 * and its sources may lie on several other devices). */
bool gpu_copy_sources_reachable(const GpuSystem *s, int dev, const GpuCopySeg *segs, const size_t *idx, size_t n);
/* enable: GPU_COPY_KERNEL_ALWAYS, else NEVER. */
void gpu_copy_engine_set_kernel_batching(GpuCopyEngine *e, bool enable, size_t min_segments);
/* On: batches of equal, aligned chunks go to the persistent uniform kernel; off (the
 * default: on the H200 it measured 2-4 % slower than the tiled 2-D grid, bench/RESULTS.md)
 * every batch takes the 2-D grid. The benchmark compares the two. */
void gpu_copy_engine_set_kernel_uniform(GpuCopyEngine *e, bool enable);
/* Segments that fall into few evenly spaced runs (a layer group's piece of each page of
 * a run of pages, on both sides) go as one cuMemcpy2DAsync per run on the copy engines,
 * before the kernel or the batch API is considered. Off by default: on an H100 a 2D copy
 * of 256 KiB rows 2 MiB apart moved 0.56 of a contiguous cuMemcpyDtoDAsync, the batched
 * kernel 0.81-0.88 (bench/RESULTS.md, 2026-12-06 04:28). */
void gpu_copy_engine_set_strided(GpuCopyEngine *e, bool enable);
/* Rows narrower than this stay with the kernel: only 256 KiB rows were measured on the
 * copy engines (bench/RESULTS.md), and the engines' cost per row is not known for small
 * ones. */
#define GPU_COPY_STRIDED_MIN_ROW (64U * 1024U)
/* Pure: how many of the segments idx[k..n) (idx NULL: the identity) one 2D copy moves
 * from the k-th on, and its pitch on each side (0 when 1). */
size_t gpu_copy_run_length(const GpuCopySeg *segs, const size_t *idx, size_t k, size_t n, uint64_t max_pitch,
                           uint64_t *ret_src_pitch, uint64_t *ret_dst_pitch);
/* cuMemcpyBatchAsync (driver 13.0+) for multi-segment device-to-device groups: on by
 * default where the driver has it; off, every segment is its own cuMemcpyDtoDAsync. */
void gpu_copy_engine_set_batch_api(GpuCopyEngine *e, bool enable);
/* Spreads the segments of a device-to-device group that goes segment by segment over
 * n streams (1..4, default 1), so that several copy engines work at once. */
void gpu_copy_engine_set_d2d_streams(GpuCopyEngine *e, unsigned n);
/* How long a completion thread polls a part's event (cuEventQuery) around the part's
 * expected end (0: it sleeps in the blocking-sync wait at once, woken by the GPU's
 * interrupt). The end is placed by the pace the thread learned of its GPU's path
 * (gpu_copy_pace_predict()): the thread sleeps on its timer (for at most 20 ms) until
 * half the window and 50 µs (a timer's lateness) before it; until the pace is known, or
 * when the end is near, it polls at once. Past the window it looks every 50 µs (timer
 * naps) for up to 20 ms, then takes the blocking sync. Parts spread over several
 * streams (gpu_copy_engine_set_d2d_streams()) run side by side: no pace for them.
 * The interrupt's wake-up took 0.1 to 0.7 ms on the H200 of bench/RESULTS.md (2026-12-06
 * 20:31), against 0.02 ms on another H200 before: on such a machine every part of a
 * handoff lands that much late, and the last one adds it to the handoff. Default 200 µs:
 * the thread polls about that long a part, a CPU's worth only while parts end closer
 * together than that (on each path of each GPU that copies at the time: a thread each). */
#define GPU_COPY_SPIN_USEC 200U
void gpu_copy_engine_set_spin(GpuCopyEngine *e, unsigned usec);
/* A diagnostic: from now on every part of every batch (one stream's share of it) adds a
 * line to fd (dup'ed; lines of one write(), so O_APPEND keeps them whole) when the
 * completion thread of its (device, path) sees it done (lines of different queues in
 * the order their parts were seen): its batch's number, segments and bytes, and on the
 * host's CLOCK_MONOTONIC in µs when its submission began, when it was queued, when the
 * GPU started and finished it (timing events, placed on the host's clock by a reference
 * event recorded whenever the engine goes busy from idle) and when it was seen done:
 *   part job=N dev=D segs=S bytes=B enter=T queued=T gpu_start=T gpu_end=T seen=T error=E
 * and, when the caller reaps the batch (gpu_copy_reap()), a line with the time it did:
 *   reap job=N at=T
 * Parts spread over several streams have a line for the first stream only. Costs an
 * event pair a part and a wait when the engine goes busy from idle: epdd turns it on
 * only with EPD_GPU_COPY_TIMELINE=PATH (docs/gpu.md). Before the first submission, on
 * the thread that submits: -EBUSY after it, -EALREADY when on. A part's line counts the
 * segments and bytes of its whole (device, path) group; spread over several streams, its
 * GPU end is the first stream's. */
int gpu_copy_engine_set_timeline(GpuCopyEngine *e, int fd);
const GpuCopyStats *gpu_copy_engine_stats(const GpuCopyEngine *e);

/* The pace of one path of one GPU as its completion thread learns it: bytes a µs of the
 * parts it saw end, and when the last one ended (CLOCK_MONOTONIC µs). */
typedef struct GpuCopyPace {
        double bytes_per_usec;  /* 0: not known yet */
        uint64_t last_end_usec;
} GpuCopyPace;
/* Samples shorter than these say more about launch and wake-up than about the pace. */
#define GPU_COPY_PACE_MIN_BYTES (1ULL << 20)
#define GPU_COPY_PACE_MIN_USEC 20U
#define GPU_COPY_PACE_MAX 1e7   /* bytes a µs (10 TB/s): no faster, whatever is seen */
/* Pure: when a part of `bytes` queued at queued_usec should end (it starts when the
 * path's last part ended, if after it was queued); 0 while the pace is not known. */
uint64_t gpu_copy_pace_predict(const GpuCopyPace *p, uint64_t queued_usec, uint64_t bytes);
/* How the completion thread saw a part end. */
typedef enum GpuCopySeen {
        GPU_COPY_SEEN_AT_ONCE,   /* done at its first look, which may come long after its end */
        GPU_COPY_SEEN_POLLING,   /* after a look saw it running, within a poll or a nap: the end */
        GPU_COPY_SEEN_OVERSLEPT, /* it had ended when the thread woke from its timer */
        GPU_COPY_SEEN_LATE,      /* after the blocking sync, whose wake-up may come long after */
} GpuCopySeen;
/* Pure: learns from a part seen ended at seen_usec. Seen polling: a faster part raises
 * the pace to its own at once, a slower one lowers it an eighth of the way (a predicted
 * end should fall early, not late). At once: the part went at least as fast as its time
 * to seen_usec says, which can only raise a known pace. Overslept (woke from the timer
 * at look_usec): the pace rises by half, and to at least what the wake-up's time says.
 * Late: the part was still running at the last look (look_usec), so it went no faster
 * than that: a pace not known starts there, a faster one falls an eighth of the way. A
 * part under GPU_COPY_PACE_MIN_BYTES, or shorter than GPU_COPY_PACE_MIN_USEC, teaches
 * only its end. */
void gpu_copy_pace_observe(GpuCopyPace *p, uint64_t queued_usec, uint64_t bytes, uint64_t seen_usec, GpuCopySeen how,
                           uint64_t look_usec);
/* The pace the completion thread of a path of GPU dev learned (a diagnostic). */
int gpu_copy_engine_pace(GpuCopyEngine *e, int dev, GpuCopyPath path, GpuCopyPace *ret);

/* Readable (eventfd, O_CLOEXEC|O_NONBLOCK) when completions are waiting. */
int gpu_copy_engine_fd(const GpuCopyEngine *e);
/* Makes the fd readable again: for a caller that reaped completions into a queue of its
 * own outside its fd's handler (the reap drained the fd), so that its handler runs. */
void gpu_copy_engine_kick(GpuCopyEngine *e);
/* Batches submitted and not yet reaped, and their bytes. */
size_t gpu_copy_engine_in_flight(const GpuCopyEngine *e);
uint64_t gpu_copy_engine_bytes_in_flight(const GpuCopyEngine *e);

/* Merges neighbours in place: segment k+1 that continues segment k on both sides (same
 * arenas or host buffers, src and dst adjacent) joins it. Returns the new count. Pure. */
size_t gpu_copy_segs_coalesce(GpuCopySeg *segs, size_t n);

/* Validates every segment (bounds, path), then queues them all.
 * Returns 0 when the batch was queued (it completes exactly once), or a negative errno
 * when nothing was queued. The batch holds a reference on every arena it touches until
 * it is reaped. */
int gpu_copy_submit(GpuCopyEngine *e, const GpuCopySeg *segs, size_t n, uint64_t cookie);
/* Returns up to n finished batches, without blocking. */
size_t gpu_copy_reap(GpuCopyEngine *e, GpuCopyDone *out, size_t n);
/* For tests, tools and drains without an event loop: poll()s the fd (no spinning; a
 * signal does not end the wait, and a poll() that fails sleeps 10 ms instead: a drain
 * never gives up on copies in flight). Returns 1 when completions are ready, 0 on
 * timeout. */
int gpu_copy_wait(GpuCopyEngine *e, int timeout_ms);

/* Pins host memory (an arena's mapping) for the GPU copy paths. */
int gpu_host_register(GpuSystem *s, void *p, size_t size);
int gpu_host_unregister(GpuSystem *s, void *p);
