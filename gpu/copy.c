/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "copy-internal.h"
#include "copy.h"
#include "list.h"
#include "log.h"
#include "time-util.h"

/* Pinned descriptor slots for the batched copy kernel, per device. */
#define DESC_SLOTS 64U
#define DESC_SLOT_CHUNKS 4096U
#define DESC_BYTES ((size_t)DESC_SLOTS * DESC_SLOT_CHUNKS * sizeof(GpuChunk)) /* 6 MiB */
#define ARENAS_PER_JOB_INLINE 4U

typedef struct GpuCopyJob GpuCopyJob;

/* Streams per path and device: device-to-device groups of many segments may be spread
 * over several, so that the copy engines work on several at once. */
#define STREAMS_PER_PATH 4U

typedef struct DeviceLane {
        /* Set up on first use (lane_setup()): a process takes no context, streams or
         * descriptor memory on the GPUs it can see but never copies on. */
        bool ready;
        CUstream streams[_GPU_COPY_PATH_MAX][STREAMS_PER_PATH];
        /* Completion events (blocking-sync) recorded and waited for: reused. Every event
         * ever made is here or in one of the lane's watch queues (e->queues). */
        CUevent *spare_events;
        size_t n_spare_events, n_events;
        GpuKernels *kernels;         /* NULL: not built or not loadable */
        GpuChunk *desc_host;         /* DESC_SLOTS * DESC_SLOT_CHUNKS, pinned */
        CUdeviceptr desc_dev;
        bool slot_busy[DESC_SLOTS];
        /* Descriptors go up on a stream of their own, each slot's upload marked by its
         * event, which the kernel's stream waits for: a part's upload overlaps the
         * kernel before it instead of sitting between two kernels (a copy engine's
         * start and a cross-engine handover each time). NULL: on the kernel's stream. */
        CUstream upload;
        CUevent uploaded[DESC_SLOTS];
        /* Timeline (gpu_copy_engine_set_timeline()): an event recorded when the engine
         * went busy from idle, and the host's clock then: GPU times are placed on the
         * host's clock from it. */
        CUevent tl_ref;
        uint64_t tl_ref_usec;
        uint64_t max_pitch;          /* of a 2D copy (0: none) */
} DeviceLane;

struct GpuCopyJob {
        GpuCopyEngine *engine;
        uint64_t cookie;
        uint64_t bytes;
        int error;
        unsigned pending;            /* completion events still to pass, +1 while submitting */
        GpuArena **arenas;           /* references held until reaped */
        size_t n_arenas;
        GpuArena *arenas_inline[ARENAS_PER_JOB_INLINE];
        /* descriptor slots held: (device, slot) pairs */
        int slot_dev[_GPU_COPY_PATH_MAX * 4];
        int slot_idx[_GPU_COPY_PATH_MAX * 4];
        size_t n_slots;
        /* Arrays handed to cuMemcpyBatchAsync, kept until the batch completes. */
        CUdeviceptr *batch_dst, *batch_src;
        size_t *batch_size;
        uint64_t timeline_seq;       /* its number in the timeline */
        LIST_FIELDS(GpuCopyJob, done);
};

static int lane_setup(GpuCopyEngine *e, int dev);

/* A job's part on one stream: done once its event is. */
typedef struct Watch {
        CUevent event;
        GpuCopyJob *job;
        int dev;
        GpuCopyPath path;
        /* When the part was queued (CLOCK_MONOTONIC µs) and its bytes (0 for a part of
         * a group spread over several streams): where its end should fall (the
         * completion thread's pace). */
        uint64_t queued_usec, bytes;
        /* Timeline only: an event recorded before the part's work, when submission
         * began (CLOCK_MONOTONIC µs), the segments and bytes of its (device, path) group. */
        CUevent start;
        uint64_t enter_usec, group_bytes;
        size_t segs;
} Watch;

/* The parts of one path of one device (its streams), in submission order, and the
 * completion thread that waits for them: made on the queue's first part. Parts of one
 * queue end in order (a stream runs its work in order; a group spread over several of
 * the path's streams is one queue too); parts of different queues do not wait for each
 * other: a GPU → host staging copy does not hold back a GPU → GPU layer group submitted
 * after it, nor one GPU's copies another's. */
typedef struct WatchQueue {
        GpuCopyEngine *engine;
        int dev;
        GpuCopyPath path;
        pthread_t thread;
        bool started;                /* written by the submitting thread only */
        pthread_cond_t more;         /* with the engine's lock */
        Watch *watches;              /* circular: [head, head + n) */
        size_t cap, head, n;
        /* The path's pace, which places the end of its next part
         * (gpu_copy_pace_predict()): written by the queue's thread under the lock. */
        GpuCopyPace pace;
} WatchQueue;

struct GpuCopyEngine {
        GpuSystem *system;
        DeviceLane *lanes;
        int efd;
        pthread_mutex_t lock;        /* guards done, slot_busy, job->pending/error, watches, events */
        /* Completion: an event recorded behind each part, and a thread per (device, path)
         * queue that waits for its parts in order. (A stream callback would hold the
         * stream until the driver's callback thread has run: a bubble between one part
         * and the next.) */
        WatchQueue *queues;          /* n_devices × _GPU_COPY_PATH_MAX, [dev * MAX + path] */
        size_t n_watches;            /* in all the queues */
        bool stopping;
        QUEUE_HEAD(GpuCopyJob, done);
        size_t in_flight;
        uint64_t bytes_in_flight;    /* of the batches in_flight counts */
        GpuCopyKernelPolicy kernel_policy;
        size_t kernel_min_segments;
        bool batch_api;              /* cuMemcpyBatchAsync for multi-segment D2D groups */
        bool strided;                /* cuMemcpy2DAsync for runs of evenly spaced segments */
        bool uniform;                /* the uniform kernel (lanes set up later take it too) */
        unsigned d2d_streams;        /* streams a D2D group is spread over (1..4) */
        unsigned spin_usec;          /* the completion thread polls an event this long first */
        int timeline_fd;             /* gpu_copy_engine_set_timeline(); -EBADF: off */
        uint64_t timeline_jobs;      /* jobs submitted while it is on (their numbers) */
        GpuCopyStats stats;
        /* Submission's working arrays (order, group: 2 × scratch_cap), kept between
         * submissions: large batches would otherwise fault in fresh pages each time. */
        size_t *scratch;
        size_t scratch_cap;
};

static const char *const path_names[_GPU_COPY_PATH_MAX] = {
        [GPU_COPY_SAME_GPU] = "same-gpu",
        [GPU_COPY_PEER] = "peer",
        [GPU_COPY_D2H] = "d2h",
        [GPU_COPY_H2D] = "h2d",
};

const char *gpu_copy_path_to_string(GpuCopyPath p) {
        if (p < 0 || p >= _GPU_COPY_PATH_MAX)
                return NULL;
        return path_names[p];
}

GpuCopyPath gpu_copy_path(const GpuSystem *s, const GpuCopySeg *seg) {
        if (seg->src && seg->dst)
                return seg->src->ordinal == seg->dst->ordinal ? GPU_COPY_SAME_GPU : GPU_COPY_PEER;
        if (seg->src && seg->dst_host)
                return GPU_COPY_D2H;
        if (seg->dst && seg->src_host)
                return GPU_COPY_H2D;
        return _GPU_COPY_PATH_INVALID;
}

/* The device whose stream carries the segment. */
static int seg_device(GpuCopyPath p, const GpuCopySeg *seg) {
        switch (p) {
        case GPU_COPY_SAME_GPU:
        case GPU_COPY_D2H:
                return seg->src->ordinal;
        case GPU_COPY_PEER:
        case GPU_COPY_H2D:
                return seg->dst->ordinal;
        default:
                return -1;
        }
}

static void job_free(GpuCopyJob *j) {
        if (!j)
                return;
        for (size_t i = 0; i < j->n_arenas; i++)
                gpu_arena_unref(j->arenas[i]);
        if (j->arenas != j->arenas_inline)
                free(j->arenas);
        free(j->batch_dst);
        free(j->batch_src);
        free(j->batch_size);
        free(j);
}

/* Called with e->lock held. */
static void job_finish_locked(GpuCopyEngine *e, GpuCopyJob *j) {
        uint64_t one = 1;

        for (size_t i = 0; i < j->n_slots; i++)
                e->lanes[j->slot_dev[i]].slot_busy[j->slot_idx[i]] = false;
        j->n_slots = 0;
        QUEUE_PUSH_BACK(done, e->done, j);
        /* An eventfd write only fails on counter overflow, which cannot happen here. */
        (void)!write(e->efd, &one, sizeof one);
}

/* One line of the timeline for a part seen done (the completion thread): the part's
 * job, its size, and on the host's monotonic clock in µs when its submission began,
 * when it was queued, when the GPU started and finished it (its two events, placed by
 * the lane's reference) and when this thread saw it done. */
static void timeline_write(GpuCopyEngine *e, const Watch *w, int result) {
        CudaDriver *d = e->system->driver;
        const DeviceLane *l = &e->lanes[w->dev];
        uint64_t seen = now_usec(CLOCK_MONOTONIC);
        float a = 0, b = 0;

        if (result < 0 || CU(d, cuEventElapsedTime, &a, l->tl_ref, w->start) < 0 ||
            CU(d, cuEventElapsedTime, &b, l->tl_ref, w->event) < 0)
                a = b = -1;
        dprintf(e->timeline_fd,
                "part job=%" PRIu64 " dev=%d segs=%zu bytes=%" PRIu64 " enter=%" PRIu64 " queued=%" PRIu64
                " gpu_start=%.0f gpu_end=%.0f seen=%" PRIu64 " error=%d\n",
                w->job->timeline_seq, w->dev, w->segs, w->group_bytes, w->enter_usec, w->queued_usec,
                a < 0 ? -1.0 : (double)l->tl_ref_usec + (double)a * 1e3,
                b < 0 ? -1.0 : (double)l->tl_ref_usec + (double)b * 1e3, seen, result);
}

/* A queue's completion thread: waits for each of its watched events in order (a
 * blocking-sync event: it sleeps, after an optional poll), then counts its job's part
 * done; the last part (of whichever queue) finishes the job. */
static void *waiter_thread(void *userdata) {
        WatchQueue *q = userdata;
        GpuCopyEngine *e = q->engine;
        GpuSystem *s = e->system;
        DeviceLane *l = &e->lanes[q->dev];
        bool current = false;

        /* Its timers (the sleeps before a part's end, the naps) as exact as the kernel
         * makes them: a thread's default slack lets them fire 50 µs late. */
        (void)prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);

        pthread_mutex_lock(&e->lock);
        for (;;) {
                while (q->n == 0 && !e->stopping)
                        pthread_cond_wait(&q->more, &e->lock);
                if (q->n == 0)
                        break;
                Watch w = q->watches[q->head];
                pthread_mutex_unlock(&e->lock);

                if (!current)
                        current = gpu_device_make_current(s, &s->devices[q->dev]) >= 0;
                /* Waited for even when the context could not be made current (an event
                 * names its own): a part counted done must be done on the GPU, or its job's
                 * arenas and pages could go under a copy still running. */
                GpuCopySeen how;
                uint64_t look;
                /* The pace is written by this thread alone, under the lock (read by
                 * gpu_copy_engine_pace()): read here without it. */
                int r = gpu_copy_event_wait(s, w.event, w.queued_usec, w.bytes, &q->pace,
                                            __atomic_load_n(&e->spin_usec, __ATOMIC_RELAXED), &how, &look);
                uint64_t seen = now_usec(CLOCK_MONOTONIC);
                if (w.start) {
                        timeline_write(e, &w, r);
                        (void)CU(s->driver, cuEventDestroy, w.start);
                }

                pthread_mutex_lock(&e->lock);
                if (r >= 0)
                        gpu_copy_pace_observe(&q->pace, w.queued_usec, w.bytes, seen, how, look);
                q->head = (q->head + 1) % q->cap;
                q->n--;
                e->n_watches--;
                l->spare_events[l->n_spare_events++] = w.event; /* room: see watch_add() */
                if (r < 0 && w.job->error == 0)
                        w.job->error = r;
                if (--w.job->pending == 0)
                        job_finish_locked(e, w.job);
        }
        pthread_mutex_unlock(&e->lock);
        return NULL;
}

/* The queue's completion thread, on its first part (on the submitting thread). */
static int queue_start(GpuCopyEngine *e, WatchQueue *q) {
        int r;

        if (q->started)
                return 0;
        pthread_cond_init(&q->more, NULL); /* never waited for with a timeout */
        r = -pthread_create(&q->thread, NULL, waiter_thread, q);
        if (r < 0) {
                pthread_cond_destroy(&q->more);
                return log_debug_errno(r, "GPU %d: no completion thread for %s copies: %m", q->dev,
                                       gpu_copy_path_to_string(q->path));
        }
        q->started = true;
        return 0;
}

/* The job's work queued on `stream` of device dev so far completes the job's part: an
 * event recorded there, watched by the completion thread (the device's context current). */
static int watch_add(GpuCopyEngine *e, int dev, GpuCopyPath path, CUstream stream, GpuCopyJob *j, uint64_t bytes,
                     const Watch *tl) {
        CudaDriver *d = e->system->driver;
        DeviceLane *l = &e->lanes[dev];
        WatchQueue *q = &e->queues[(size_t)dev * _GPU_COPY_PATH_MAX + (size_t)path];
        CUevent ev = NULL;
        int r;

        r = queue_start(e, q);
        if (r < 0)
                return r;
        pthread_mutex_lock(&e->lock);
        if (l->n_spare_events > 0)
                ev = l->spare_events[--l->n_spare_events];
        else {
                /* A new event needs room among the spares for when it comes back. */
                CUevent *m = realloc(l->spare_events, (l->n_events + 1) * sizeof *m);
                if (!m)
                        r = -ENOMEM;
                else
                        l->spare_events = m;
        }
        if (r >= 0 && q->n == q->cap) {
                size_t cap = MAX(q->cap * 2, (size_t)64);
                Watch *m = malloc(cap * sizeof *m);
                if (!m)
                        r = -ENOMEM;
                else {
                        for (size_t i = 0; i < q->n; i++)
                                m[i] = q->watches[(q->head + i) % q->cap];
                        free(q->watches);
                        q->watches = m;
                        q->cap = cap;
                        q->head = 0;
                }
        }
        pthread_mutex_unlock(&e->lock);
        if (r < 0) {
                if (ev) {
                        pthread_mutex_lock(&e->lock);
                        l->spare_events[l->n_spare_events++] = ev;
                        pthread_mutex_unlock(&e->lock);
                }
                return r;
        }
        if (!ev) {
                /* With the timeline on, events keep their time (it places the parts). */
                r = CU(d, cuEventCreate, &ev,
                       CU_EVENT_BLOCKING_SYNC | (e->timeline_fd >= 0 ? 0 : CU_EVENT_DISABLE_TIMING));
                if (r < 0)
                        return r;
                pthread_mutex_lock(&e->lock);
                l->n_events++;
                pthread_mutex_unlock(&e->lock);
        }
        r = CU(d, cuEventRecord, ev, stream);
        pthread_mutex_lock(&e->lock);
        if (r < 0)
                l->spare_events[l->n_spare_events++] = ev;
        else {
                /* Room: the queue grew above, and only this thread adds. */
                Watch w = tl ? *tl : (Watch) {};
                w.event = ev;
                w.job = j;
                w.dev = dev;
                w.path = path;
                w.bytes = bytes;
                w.queued_usec = now_usec(CLOCK_MONOTONIC);
                q->watches[(q->head + q->n++) % q->cap] = w;
                e->n_watches++;
                j->pending++;
                pthread_cond_signal(&q->more);
        }
        pthread_mutex_unlock(&e->lock);
        return r;
}

static int job_hold_arena(GpuCopyJob *j, GpuArena *a) {
        if (!a)
                return 0;
        for (size_t i = 0; i < j->n_arenas; i++)
                if (j->arenas[i] == a)
                        return 0;
        if (j->n_arenas == ARENAS_PER_JOB_INLINE && j->arenas == j->arenas_inline) {
                GpuArena **m = malloc(sizeof *m * ARENAS_PER_JOB_INLINE * 2);
                if (!m)
                        return -ENOMEM;
                memcpy(m, j->arenas_inline, sizeof j->arenas_inline);
                j->arenas = m;
        } else if (j->n_arenas >= ARENAS_PER_JOB_INLINE && IS_POWER_OF_2(j->n_arenas)) {
                GpuArena **m = realloc(j->arenas, sizeof *m * j->n_arenas * 2);
                if (!m)
                        return -ENOMEM;
                j->arenas = m;
        }
        j->arenas[j->n_arenas++] = gpu_arena_ref(a);
        return 0;
}

static int seg_validate(const GpuSystem *s, const GpuCopySeg *seg) {
        GpuCopyPath p = gpu_copy_path(s, seg);

        if (p < 0)
                return -EINVAL;
        if (seg->length == 0)
                return -EINVAL;
        if (seg->src && !gpu_arena_range_ok(seg->src, seg->src_offset, seg->length))
                return -ERANGE;
        if (seg->dst && !gpu_arena_range_ok(seg->dst, seg->dst_offset, seg->length))
                return -ERANGE;
        /* host + offset + length must not wrap (each step checked: a sum that wraps
         * itself would pass a check of the whole). */
        if (!seg->src && (seg->src_offset > UINTPTR_MAX - (uintptr_t)seg->src_host ||
                          seg->length > UINTPTR_MAX - (uintptr_t)seg->src_host - seg->src_offset))
                return -ERANGE;
        if (!seg->dst && (seg->dst_offset > UINTPTR_MAX - (uintptr_t)seg->dst_host ||
                          seg->length > UINTPTR_MAX - (uintptr_t)seg->dst_host - seg->dst_offset))
                return -ERANGE;
        /* An overlapping copy inside one arena would be undefined. */
        if (seg->src && seg->src == seg->dst &&
            seg->src_offset < seg->dst_offset + seg->length &&
            seg->dst_offset < seg->src_offset + seg->length)
                return -EINVAL;
        return 0;
}

static int seg_enqueue(GpuCopyEngine *e, GpuCopyPath p, const GpuCopySeg *seg, CUstream st) {
        CudaDriver *d = e->system->driver;

        switch (p) {
        case GPU_COPY_SAME_GPU:
                return CU(d, cuMemcpyDtoDAsync, seg->dst->base + seg->dst_offset,
                          seg->src->base + seg->src_offset, seg->length, st);
        case GPU_COPY_PEER:
                if (gpu_system_can_access_peer(e->system, seg->dst->ordinal, seg->src->ordinal))
                        return CU(d, cuMemcpyDtoDAsync, seg->dst->base + seg->dst_offset,
                                  seg->src->base + seg->src_offset, seg->length, st);
                return CU(d, cuMemcpyPeerAsync, seg->dst->base + seg->dst_offset,
                          gpu_device_ctx(e->system, &e->system->devices[seg->dst->ordinal]),
                          seg->src->base + seg->src_offset,
                          gpu_device_ctx(e->system, &e->system->devices[seg->src->ordinal]), seg->length, st);
        case GPU_COPY_D2H:
                return CU(d, cuMemcpyDtoHAsync, (uint8_t *)seg->dst_host + seg->dst_offset,
                          seg->src->base + seg->src_offset, seg->length, st);
        case GPU_COPY_H2D:
                return CU(d, cuMemcpyHtoDAsync, seg->dst->base + seg->dst_offset,
                          (const uint8_t *)seg->src_host + seg->src_offset, seg->length, st);
        default:
                return -EINVAL;
        }
}

bool gpu_copy_sources_reachable(const GpuSystem *s, int dev, const GpuCopySeg *segs, const size_t *idx, size_t n) {
        int last = -1;

        for (size_t k = 0; k < n; k++) {
                const GpuArena *a = segs[idx ? idx[k] : k].src;
                if (!a)
                        return false;
                if (a->ordinal == last)
                        continue; /* a part's segments nearly always share their source */
                if (!gpu_system_can_access_peer(s, dev, a->ordinal))
                        return false;
                last = a->ordinal;
        }
        return true;
}

/* The timeline (on): the lane's reference placed anew while nothing of the engine is
 * in flight (no watch still reads it): recorded on the idle stream and waited for, so
 * that its GPU time is the host's time now; then the part's start event, recorded
 * before its work. Without an event the part has no line (best effort: a diagnostic). */
static void timeline_start(GpuCopyEngine *e, int dev, CUstream stream, Watch *tl) {
        CudaDriver *d = e->system->driver;
        DeviceLane *l = &e->lanes[dev];
        bool idle;

        /* No watch at all: nothing reads any lane's reference (a completion thread
         * drops a watch only after its line is written; only this thread adds them). */
        pthread_mutex_lock(&e->lock);
        idle = e->n_watches == 0;
        pthread_mutex_unlock(&e->lock);
        if (!l->tl_ref || idle) {
                if (!l->tl_ref && CU(d, cuEventCreate, &l->tl_ref, 0) < 0) {
                        l->tl_ref = NULL;
                        return;
                }
                /* Polled, not a blocking-sync wait: the host's time then is the event's
                 * within the poll's microsecond, not a wake-up later. */
                if (CU(d, cuEventRecord, l->tl_ref, stream) < 0)
                        return;
                CUresult q;
                while ((q = d->cuEventQuery(l->tl_ref)) == CUDA_ERROR_NOT_READY)
                        ;
                if (q != CUDA_SUCCESS)
                        return;
                l->tl_ref_usec = now_usec(CLOCK_MONOTONIC);
        }
        if (CU(d, cuEventCreate, &tl->start, CU_EVENT_BLOCKING_SYNC) < 0)
                tl->start = NULL;
        else if (CU(d, cuEventRecord, tl->start, stream) < 0) {
                (void)CU(d, cuEventDestroy, tl->start);
                tl->start = NULL;
        }
}

static uint64_t seg_src_addr(const GpuCopySeg *g) {
        return (g->src ? g->src->base : (uint64_t)(uintptr_t)g->src_host) + g->src_offset;
}

static uint64_t seg_dst_addr(const GpuCopySeg *g) {
        return (g->dst ? g->dst->base : (uint64_t)(uintptr_t)g->dst_host) + g->dst_offset;
}

/* How many of the segments idx[k..n) one 2D copy moves from idx[k] on: segments of one
 * length between the same two arenas (or host buffers), each `pitch` after the last on
 * both sides (its own pitch per side, at least the length and at most max_pitch: rows
 * that do not overlap). A layer group's piece of every page of a run of pages is such
 * a run: 8192 pieces of a 2 MiB-page sequence, one copy. Never within one arena (a 2D
 * copy's two sides may not overlap, and copy-on-write copies are single pages). */
size_t gpu_copy_run_length(const GpuCopySeg *segs, const size_t *idx, size_t k, size_t n, uint64_t max_pitch,
                           uint64_t *ret_src_pitch, uint64_t *ret_dst_pitch) {
        const GpuCopySeg *a = &segs[idx ? idx[k] : k];
        uint64_t sp = 0, dp = 0;
        size_t h = 1;

        if (a->src && a->src == a->dst)
                return 1;
        for (size_t i = k + 1; i < n; i++, h++) {
                const GpuCopySeg *p = &segs[idx ? idx[i - 1] : i - 1], *g = &segs[idx ? idx[i] : i];
                uint64_t s0 = seg_src_addr(p), s1 = seg_src_addr(g), d0 = seg_dst_addr(p), d1 = seg_dst_addr(g);
                if (g->length != a->length || g->src != a->src || g->dst != a->dst || g->src_host != a->src_host ||
                    g->dst_host != a->dst_host || s1 <= s0 || d1 <= d0)
                        break;
                if (h == 1) {
                        sp = s1 - s0;
                        dp = d1 - d0;
                        if (sp < a->length || dp < a->length || sp > max_pitch || dp > max_pitch)
                                break;
                } else if (s1 - s0 != sp || d1 - d0 != dp)
                        break;
        }
        *ret_src_pitch = h > 1 ? sp : 0;
        *ret_dst_pitch = h > 1 ? dp : 0;
        return h;
}

/* A group whose segments fall into few evenly spaced runs (gpu_copy_run_length(): a
 * quarter as many runs as segments or fewer) of rows of GPU_COPY_STRIDED_MIN_ROW or
 * more: one cuMemcpy2DAsync per run on the copy engines, a plain copy for a run of one.
 * Returns 1 if done, 0 if the caller should take another way, <0 on error. */
static int group_try_strided(GpuCopyEngine *e, int dev, GpuCopyPath p, const GpuCopySeg *segs, const size_t *idx,
                             size_t n) {
        CudaDriver *d = e->system->driver;
        DeviceLane *l = &e->lanes[dev];
        CUstream st = l->streams[p][0];
        size_t runs = 0;
        uint64_t sp, dp;
        int r;

        if (!e->strided || !d->cuMemcpy2DAsync || l->max_pitch == 0 || n < 4 ||
            segs[idx[0]].length < GPU_COPY_STRIDED_MIN_ROW)
                return 0;
        if (p == GPU_COPY_PEER && !gpu_copy_sources_reachable(e->system, dev, segs, idx, n))
                return 0; /* cuMemcpyPeerAsync's staging: segment by segment */
        for (size_t k = 0; k < n && runs * 4 <= n; runs++)
                k += gpu_copy_run_length(segs, idx, k, n, l->max_pitch, &sp, &dp);
        if (runs * 4 > n)
                return 0;
        for (size_t k = 0, h; k < n; k += h) {
                const GpuCopySeg *g = &segs[idx[k]];
                h = gpu_copy_run_length(segs, idx, k, n, l->max_pitch, &sp, &dp);
                if (h == 1) {
                        r = seg_enqueue(e, p, g, st);
                        if (r < 0)
                                return r;
                        continue;
                }
                CUDA_MEMCPY2D c = {
                        .srcMemoryType = g->src ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST,
                        .srcHost = g->src ? NULL : (const uint8_t *)g->src_host + g->src_offset,
                        .srcDevice = g->src ? g->src->base + g->src_offset : 0,
                        .srcPitch = sp,
                        .dstMemoryType = g->dst ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST,
                        .dstHost = g->dst ? NULL : (uint8_t *)g->dst_host + g->dst_offset,
                        .dstDevice = g->dst ? g->dst->base + g->dst_offset : 0,
                        .dstPitch = dp,
                        .WidthInBytes = g->length,
                        .Height = h,
                };
                r = CU(d, cuMemcpy2DAsync, &c, st);
                if (r == -EINVAL || r == -EOPNOTSUPP) {
                        /* This driver refuses it: without from now on (the kernel or the
                         * copy engines). Nothing of the group queued yet: the caller takes
                         * another way; else the rest goes segment by segment here. */
                        log_debug_errno(r, "cuMemcpy2DAsync refused (%m), no 2D copies from now on");
                        e->strided = false;
                        if (k == 0)
                                return 0;
                        for (size_t q = k; q < n; q++) {
                                r = seg_enqueue(e, p, &segs[idx[q]], st);
                                if (r < 0)
                                        return r;
                        }
                        return 1;
                }
                if (r < 0)
                        return r;
                e->stats.strided_copies++;
                e->stats.strided_rows += h;
        }
        return 1;
}

/* Tries to move a group of device-to-device segments with batched kernel launches.
 * Returns 1 if done that way, 0 if the caller should use the copy engine, <0 on error. */
static int group_try_kernel(GpuCopyEngine *e, GpuCopyJob *j, int dev, GpuCopyPath p,
                            const GpuCopySeg *segs, const size_t *idx, size_t n, uint64_t bytes) {
        DeviceLane *l = &e->lanes[dev];
        size_t slots_needed = DIV_ROUND_UP(n, (size_t)DESC_SLOT_CHUNKS);
        int slots[DESC_SLOTS];
        size_t got = 0;
        int r;

        if (!l->kernels || (p != GPU_COPY_SAME_GPU && p != GPU_COPY_PEER))
                return 0;
        if (!gpu_copy_kernel_wanted(e->kernel_policy, e->kernel_min_segments, n, bytes))
                return 0;
        if (p == GPU_COPY_PEER && !gpu_copy_sources_reachable(e->system, dev, segs, idx, n))
                return 0; /* a read from a device without peer access would fault the context */
        if (j->n_slots + slots_needed > ELEMENTSOF(j->slot_dev))
                return 0;

        pthread_mutex_lock(&e->lock);
        for (unsigned s = 0; s < DESC_SLOTS && got < slots_needed; s++)
                if (!l->slot_busy[s])
                        slots[got++] = (int)s;
        if (got == slots_needed)
                for (size_t i = 0; i < got; i++) {
                        l->slot_busy[slots[i]] = true;
                        j->slot_dev[j->n_slots] = dev;
                        j->slot_idx[j->n_slots++] = slots[i];
                }
        pthread_mutex_unlock(&e->lock);
        if (got < slots_needed)
                return 0; /* all descriptor slots in flight: the copy engine takes it */

        for (size_t s = 0, k = 0; s < slots_needed; s++) {
                GpuChunk *h = l->desc_host + (size_t)slots[s] * DESC_SLOT_CHUNKS;
                uint64_t max_len = 0;
                size_t m = 0;

                for (; k < n && m < DESC_SLOT_CHUNKS; k++, m++) {
                        const GpuCopySeg *g = &segs[idx[k]];
                        h[m] = (GpuChunk) {
                                .src = g->src->base + g->src_offset,
                                .dst = g->dst->base + g->dst_offset,
                                .len = g->length,
                        };
                        max_len = MAX(max_len, g->length);
                }
                CUdeviceptr dd = l->desc_dev + (CUdeviceptr)slots[s] * DESC_SLOT_CHUNKS * sizeof(GpuChunk);
                if (l->upload) {
                        CudaDriver *d = e->system->driver;
                        r = CU(d, cuMemcpyHtoDAsync, dd, h, m * sizeof *h, l->upload);
                        if (r >= 0)
                                r = CU(d, cuEventRecord, l->uploaded[slots[s]], l->upload);
                        if (r >= 0)
                                r = CU(d, cuStreamWaitEvent, l->streams[p][0], l->uploaded[slots[s]], 0);
                        if (r >= 0)
                                r = gpu_kernels_launch_chunks(l->kernels, l->streams[p][0], h, dd, m, max_len);
                } else
                        r = gpu_kernels_copy_chunks_sized(l->kernels, l->streams[p][0], h, dd, m, max_len);
                if (r < 0)
                        return r;
                e->stats.kernel_launches++;
        }
        return 1;
}

/* One cuMemcpyBatchAsync for a group of device-to-device segments: one driver call for
 * the whole group, still on the copy engines. Returns 1 if done, 0 if the caller should
 * enqueue the segments one by one, <0 on error. */
static int group_try_batch_api(GpuCopyEngine *e, GpuCopyJob *j, int dev, GpuCopyPath p,
                               const GpuCopySeg *segs, const size_t *idx, size_t pos, size_t n,
                               size_t total) {
        CudaDriver *d = e->system->driver;
        CUmemcpyAttributes attr = {
                .srcAccessOrder = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                .srcLocHint = { .type = CU_MEM_LOCATION_TYPE_DEVICE },
                .dstLocHint = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = dev },
        };
        size_t attr_idx = 0;
        int r;

        if (!e->batch_api || !d->cuMemcpyBatchAsync || n < 2 ||
            (p != GPU_COPY_SAME_GPU && p != GPU_COPY_PEER))
                return 0;
        if (p == GPU_COPY_PEER) {
                /* One source hint for the whole call: a group from several devices goes
                 * segment by segment. */
                for (size_t k = 1; k < n; k++)
                        if (segs[idx[k]].src->ordinal != segs[idx[0]].src->ordinal)
                                return 0;
                if (!gpu_system_can_access_peer(e->system, dev, segs[idx[0]].src->ordinal))
                        return 0;
        }
        if (!j->batch_dst) {
                j->batch_dst = malloc(total * sizeof *j->batch_dst);
                j->batch_src = malloc(total * sizeof *j->batch_src);
                j->batch_size = malloc(total * sizeof *j->batch_size);
                if (!j->batch_dst || !j->batch_src || !j->batch_size)
                        return -ENOMEM;
        }
        attr.srcLocHint.id = segs[idx[0]].src->ordinal;
        for (size_t k = 0; k < n; k++) {
                const GpuCopySeg *g = &segs[idx[k]];
                j->batch_dst[pos + k] = g->dst->base + g->dst_offset;
                j->batch_src[pos + k] = g->src->base + g->src_offset;
                j->batch_size[pos + k] = g->length;
        }
        r = CU(d, cuMemcpyBatchAsync, j->batch_dst + pos, j->batch_src + pos, j->batch_size + pos,
               n, &attr, &attr_idx, 1, e->lanes[dev].streams[p][0]);
        if (r == -EINVAL || r == -EOPNOTSUPP) {
                /* Nothing was queued: this driver refuses it; do without from now on. */
                log_debug_errno(r, "cuMemcpyBatchAsync refused (%m), copying segment by segment");
                e->batch_api = false;
                return 0;
        }
        if (r < 0)
                return r;
        e->stats.batch_api_calls++;
        return 1;
}

int gpu_copy_submit(GpuCopyEngine *e, const GpuCopySeg *segs, size_t n, uint64_t cookie) {
        size_t *order, *group;
        GpuCopyJob *j;
        size_t n_groups = 0, queued = 0;
        int r, err = 0;

        if (n == 0)
                return -EINVAL;

        if (n > e->scratch_cap) {
                size_t *m = realloc(e->scratch, 2 * n * sizeof *m);
                if (!m)
                        return -ENOMEM;
                e->scratch = m;
                e->scratch_cap = n;
        }
        order = e->scratch;
        group = e->scratch + n;
        j = calloc(1, sizeof *j);
        if (!j)
                return -ENOMEM;
        j->engine = e;
        j->cookie = cookie;
        /* Submission holds one count, so that an early callback cannot finish the job
         * while later groups are still being queued. */
        j->pending = 1;
        j->arenas = j->arenas_inline;
        uint64_t enter = 0;
        if (e->timeline_fd >= 0) {
                enter = now_usec(CLOCK_MONOTONIC);
                j->timeline_seq = ++e->timeline_jobs;
        }
        /* One pass over the segments (a part of a batch is thousands of them): each
         * checked, its (device, path) group, the arenas held, the bytes counted, and
         * whether they all share one group (nearly always: the scan per group is then
         * the identity). */
        uint64_t path_bytes[_GPU_COPY_PATH_MAX] = {};
        bool one_group = true;
        for (size_t i = 0; i < n; i++) {
                r = seg_validate(e->system, &segs[i]);
                GpuCopyPath q = r < 0 ? _GPU_COPY_PATH_INVALID : gpu_copy_path(e->system, &segs[i]);
                /* Batches usually touch the same two arenas: skip repeats cheaply. */
                if (r >= 0 && (i == 0 || segs[i].src != segs[i - 1].src))
                        r = job_hold_arena(j, segs[i].src);
                if (r >= 0 && (i == 0 || segs[i].dst != segs[i - 1].dst))
                        r = job_hold_arena(j, segs[i].dst);
                if (r < 0) {
                        job_free(j);
                        return r;
                }
                group[i] = (size_t)seg_device(q, &segs[i]) * _GPU_COPY_PATH_MAX + (size_t)q;
                order[i] = i;
                one_group = one_group && group[i] == group[0];
                j->bytes += segs[i].length;
                path_bytes[q] += segs[i].length;
        }

        /* Group by (device, path): one stream and one callback per group, in submission
         * order within each. */
        for (size_t dev = 0; err == 0 && dev < e->system->n_devices; dev++)
                for (int p = 0; err == 0 && p < _GPU_COPY_PATH_MAX; p++) {
                        CUstream *streams = e->lanes[dev].streams[p];
                        size_t key = dev * _GPU_COPY_PATH_MAX + (size_t)p, start = queued, m, used = 1;
                        uint64_t bytes;

                        if (one_group) {
                                if (key != group[0])
                                        continue;
                                queued = n; /* order[] is the identity */
                                bytes = j->bytes;
                        } else {
                                bytes = 0;
                                for (size_t i = 0; i < n; i++)
                                        if (group[i] == key) {
                                                order[queued++] = i;
                                                bytes += segs[i].length;
                                        }
                        }
                        m = queued - start;
                        if (m == 0)
                                continue;
                        r = lane_setup(e, (int)dev); /* and its context current */
                        if (r < 0) {
                                err = r; /* nothing of this group is on a stream */
                                break;
                        }
                        Watch tl = { .enter_usec = enter, .group_bytes = bytes, .segs = m };
                        if (e->timeline_fd >= 0)
                                timeline_start(e, (int)dev, streams[0], &tl);
                        /* Whether part of the group may be on the streams when a call
                         * fails: a kernel or batch call may have made some of its
                         * launches; segment by segment, those before the failed one. */
                        bool partial = true;
                        r = group_try_strided(e, (int)dev, p, segs, order + start, m);
                        if (r == 0)
                                r = group_try_kernel(e, j, (int)dev, p, segs, order + start, m, bytes);
                        if (r == 0)
                                r = group_try_batch_api(e, j, (int)dev, p, segs, order + start,
                                                        start, m, n);
                        if (r == 0) {
                                if (p == GPU_COPY_SAME_GPU || p == GPU_COPY_PEER)
                                        used = MIN((size_t)e->d2d_streams, m);
                                size_t k = 0;
                                for (; r >= 0 && k < m; k++)
                                        r = seg_enqueue(e, p, &segs[order[start + k]], streams[k % used]);
                                partial = k > 1;
                        }
                        if (r < 0) {
                                if (tl.start)
                                        (void)CU(e->system->driver, cuEventDestroy, tl.start);
                                err = r;
                                /* Part of the group may be on the streams already: the job
                                 * (and its references) may go only once it drained. Its
                                 * streams' events say when, on the completion threads, the
                                 * job ending with the error; a synchronize here would hold
                                 * the loop behind every other job queued on these shared
                                 * streams (seconds of other handoffs' groups, or for ever on
                                 * a GPU that hangs). Only a stream whose event cannot be
                                 * recorded is waited for here. */
                                for (size_t k = 0; partial && k < used; k++) {
                                        if (watch_add(e, (int)dev, (GpuCopyPath)p, streams[k], j, 0, NULL) >= 0)
                                                n_groups++;
                                        else
                                                (void)CU(e->system->driver, cuStreamSynchronize, streams[k]);
                                }
                                break;
                        }
                        for (size_t k = 0; k < used; k++) {
                                /* The timeline's start event is on the first stream. */
                                /* Spread over several streams, parts run side by side: the
                                 * pace (one part after another) says nothing of them. */
                                r = watch_add(e, (int)dev, (GpuCopyPath)p, streams[k], j, used > 1 ? 0 : bytes,
                                              k == 0 && tl.start ? &tl : NULL);
                                if (r >= 0 && k == 0)
                                        tl.start = NULL; /* the watch has it */
                                if (r < 0) {
                                        /* Without its event this stream's part cannot
                                         * complete: wait for it here (failure path only). */
                                        for (size_t q = k; q < used; q++)
                                                (void)CU(e->system->driver, cuStreamSynchronize, streams[q]);
                                        err = r;
                                        break;
                                }
                                n_groups++;
                        }
                        if (tl.start)
                                (void)CU(e->system->driver, cuEventDestroy, tl.start);
                }

        pthread_mutex_lock(&e->lock);
        if (err < 0 && j->error == 0)
                j->error = err;
        if (n_groups == 0) {
                /* Nothing reached a stream (or what did has drained): nothing is queued. */
                for (size_t i = 0; i < j->n_slots; i++)
                        e->lanes[j->slot_dev[i]].slot_busy[j->slot_idx[i]] = false;
                pthread_mutex_unlock(&e->lock);
                e->stats.failures++;
                job_free(j);
                return err < 0 ? err : -EIO;
        }
        e->in_flight++;
        e->bytes_in_flight += j->bytes;
        if (--j->pending == 0)
                job_finish_locked(e, j);
        pthread_mutex_unlock(&e->lock);
        /* j may be reaped from here on: do not touch it. */

        e->stats.batches++;
        e->stats.segments += n;
        for (int q = 0; q < _GPU_COPY_PATH_MAX; q++)
                e->stats.bytes_by_path[q] += path_bytes[q];
        return 0;
}

size_t gpu_copy_reap(GpuCopyEngine *e, GpuCopyDone *out, size_t n) {
        size_t k = 0;
        uint64_t v;

        /* Drain the counter first: a callback that runs after this read writes again. */
        (void)!read(e->efd, &v, sizeof v);
        while (k < n) {
                GpuCopyJob *j;

                pthread_mutex_lock(&e->lock);
                j = e->done.first;
                if (j) {
                        QUEUE_REMOVE(done, e->done, j);
                        e->in_flight--;
                        e->bytes_in_flight -= j->bytes;
                }
                pthread_mutex_unlock(&e->lock);
                if (!j)
                        break;
                out[k++] = (GpuCopyDone) { .cookie = j->cookie, .error = j->error,
                                           .bytes = j->error < 0 ? 0 : j->bytes };
                if (e->timeline_fd >= 0)
                        /* When the caller (epdd's loop) took it: after `seen`, the wake-up
                         * of the caller. */
                        dprintf(e->timeline_fd, "reap job=%" PRIu64 " at=%" PRIu64 "\n", j->timeline_seq,
                                now_usec(CLOCK_MONOTONIC));
                if (j->error < 0)
                        e->stats.failures++;
                else
                        e->stats.bytes += j->bytes;
                job_free(j); /* drops the arena references, outside the callback */
        }
        if (k == n) {
                /* More may be waiting: keep the fd readable. */
                uint64_t one = 1;
                pthread_mutex_lock(&e->lock);
                if (e->done.first)
                        (void)!write(e->efd, &one, sizeof one);
                pthread_mutex_unlock(&e->lock);
        }
        return k;
}

int gpu_copy_wait(GpuCopyEngine *e, int timeout_ms) {
        struct pollfd p = { .fd = e->efd, .events = POLLIN };
        int r;

        pthread_mutex_lock(&e->lock);
        r = e->done.first != NULL;
        pthread_mutex_unlock(&e->lock);
        if (r)
                return 1;
        /* A signal is no reason to stop waiting: the drains at shutdown would otherwise
         * free what copies still in flight read or write. (The timeout restarts: a
         * bound, not a deadline.) */
        do
                r = poll(&p, 1, timeout_ms);
        while (r < 0 && errno == EINTR);
        if (r < 0) {
                /* Nor is a poll that fails (ENOMEM): the completion thread finishes the
                 * jobs without it. Wait out a short while and say "not yet", so that a
                 * drain goes on counting what is in flight rather than giving up. */
                log_debug_errno(errno, "Waiting for GPU copies: poll() failed (%m), sleeping instead.");
                (void)nanosleep(&(struct timespec) { .tv_nsec = 10 * 1000 * 1000 }, NULL);
                return 0;
        }
        return r > 0;
}

void gpu_copy_engine_kick(GpuCopyEngine *e) {
        uint64_t one = 1;
        (void)!write(e->efd, &one, sizeof one);
}

int gpu_copy_engine_fd(const GpuCopyEngine *e) {
        return e->efd;
}

size_t gpu_copy_engine_in_flight(const GpuCopyEngine *e) {
        return e->in_flight;
}

int gpu_copy_engine_pace(GpuCopyEngine *e, int dev, GpuCopyPath path, GpuCopyPace *ret) {
        if (dev < 0 || (size_t)dev >= e->system->n_devices || path < 0 || path >= _GPU_COPY_PATH_MAX)
                return -EINVAL;
        pthread_mutex_lock(&e->lock);
        *ret = e->queues[(size_t)dev * _GPU_COPY_PATH_MAX + (size_t)path].pace;
        pthread_mutex_unlock(&e->lock);
        return 0;
}

uint64_t gpu_copy_engine_bytes_in_flight(const GpuCopyEngine *e) {
        return e->bytes_in_flight;
}

void gpu_copy_engine_set_d2d_streams(GpuCopyEngine *e, unsigned n) {
        e->d2d_streams = CLAMP(n, 1U, STREAMS_PER_PATH);
}

void gpu_copy_engine_set_spin(GpuCopyEngine *e, unsigned usec) {
        __atomic_store_n(&e->spin_usec, usec, __ATOMIC_RELAXED);
}

int gpu_copy_engine_set_timeline(GpuCopyEngine *e, int fd) {
        int r = 0;

        pthread_mutex_lock(&e->lock);
        for (size_t i = 0; i < e->system->n_devices; i++)
                if (e->lanes[i].n_events > 0)
                        r = -EBUSY; /* events made without timing already */
        if (r == 0 && e->timeline_fd < 0) {
                e->timeline_fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
                if (e->timeline_fd < 0)
                        r = -errno;
        } else if (r == 0)
                r = -EALREADY;
        pthread_mutex_unlock(&e->lock);
        return r;
}

void gpu_copy_engine_set_strided(GpuCopyEngine *e, bool enable) {
        e->strided = enable;
}

void gpu_copy_engine_set_batch_api(GpuCopyEngine *e, bool enable) {
        e->batch_api = enable;
}

static const char *const kernel_policy_names[_GPU_COPY_KERNEL_POLICY_MAX] = {
        [GPU_COPY_KERNEL_NEVER] = "never",
        [GPU_COPY_KERNEL_SMALL] = "small",
        [GPU_COPY_KERNEL_ALWAYS] = "always",
};

const char *gpu_copy_kernel_policy_to_string(GpuCopyKernelPolicy p) {
        if (p < 0 || p >= _GPU_COPY_KERNEL_POLICY_MAX)
                return NULL;
        return kernel_policy_names[p];
}

GpuCopyKernelPolicy gpu_copy_kernel_policy_from_string(const char *s) {
        for (int i = 0; s && i < _GPU_COPY_KERNEL_POLICY_MAX; i++)
                if (strcmp(s, kernel_policy_names[i]) == 0)
                        return (GpuCopyKernelPolicy)i;
        return _GPU_COPY_KERNEL_POLICY_INVALID;
}

bool gpu_copy_kernel_wanted(GpuCopyKernelPolicy p, size_t min_segments, size_t n, uint64_t bytes) {
        if (n == 0 || n < MAX(min_segments, (size_t)1))
                return false;
        switch (p) {
        case GPU_COPY_KERNEL_ALWAYS:
                return true;
        case GPU_COPY_KERNEL_SMALL:
                return bytes / n <= GPU_COPY_KERNEL_SMALL_MAX;
        default:
                return false;
        }
}

void gpu_copy_engine_set_kernel_policy(GpuCopyEngine *e, GpuCopyKernelPolicy p, size_t min_segments) {
        e->kernel_policy = p >= 0 && p < _GPU_COPY_KERNEL_POLICY_MAX ? p : GPU_COPY_KERNEL_NEVER;
        e->kernel_min_segments = MAX(min_segments, (size_t)1);
}

void gpu_copy_engine_set_kernel_uniform(GpuCopyEngine *e, bool enable) {
        e->uniform = enable;
        for (size_t i = 0; i < e->system->n_devices; i++)
                if (e->lanes[i].kernels)
                        e->lanes[i].kernels->uniform = enable;
}

void gpu_copy_engine_set_kernel_batching(GpuCopyEngine *e, bool enable, size_t min_segments) {
        gpu_copy_engine_set_kernel_policy(e, enable ? GPU_COPY_KERNEL_ALWAYS : GPU_COPY_KERNEL_NEVER, min_segments);
}

static bool seg_continues(const GpuCopySeg *a, const GpuCopySeg *b) {
        uint64_t len;
        if (a->src != b->src || a->dst != b->dst || a->src_host != b->src_host || a->dst_host != b->dst_host)
                return false;
        if (a->src_offset + a->length != b->src_offset || a->dst_offset + a->length != b->dst_offset ||
            ADD_OVERFLOW(a->length, b->length, &len))
                return false;
        /* Within one arena, two disjoint copies may overlap once merged (a shift). */
        if (a->src && a->src == a->dst && a->src_offset < a->dst_offset + len && a->dst_offset < a->src_offset + len)
                return false;
        return true;
}

size_t gpu_copy_segs_coalesce(GpuCopySeg *segs, size_t n) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
                if (k > 0 && seg_continues(&segs[k - 1], &segs[i]))
                        segs[k - 1].length += segs[i].length;
                else
                        segs[k++] = segs[i];
        }
        return k;
}

const GpuCopyStats *gpu_copy_engine_stats(const GpuCopyEngine *e) {
        return &e->stats;
}

/* Frees what a lane holds (all of it, or what a failed setup made), its work first. */
static void lane_clear(GpuCopyEngine *e, int dev) {
        CudaDriver *d = e->system->driver;
        DeviceLane *l = &e->lanes[dev];
        /* lane_setup() makes the first stream first: without it, nothing was made. */
        if (!l->streams[0][0]) {
                free(l->spare_events);
                *l = (DeviceLane) {};
                return; /* never used: its context is not made for this */
        }
        (void)gpu_device_make_current(e->system, &e->system->devices[dev]);
        for (int p = 0; p < _GPU_COPY_PATH_MAX; p++)
                for (unsigned k = 0; k < STREAMS_PER_PATH; k++)
                        if (l->streams[p][k]) {
                                (void)CU(d, cuStreamSynchronize, l->streams[p][k]);
                                (void)CU(d, cuStreamDestroy, l->streams[p][k]);
                        }
        if (l->upload) {
                (void)CU(d, cuStreamSynchronize, l->upload);
                (void)CU(d, cuStreamDestroy, l->upload);
        }
        for (unsigned k = 0; k < DESC_SLOTS; k++)
                if (l->uploaded[k])
                        (void)CU(d, cuEventDestroy, l->uploaded[k]);
        for (size_t k = 0; k < l->n_spare_events; k++)
                (void)CU(d, cuEventDestroy, l->spare_events[k]);
        if (l->tl_ref)
                (void)CU(d, cuEventDestroy, l->tl_ref);
        free(l->spare_events);
        if (l->desc_dev)
                (void)CU(d, cuMemFree, l->desc_dev);
        if (l->desc_host)
                (void)CU(d, cuMemFreeHost, l->desc_host);
        gpu_kernels_free(l->kernels);
        *l = (DeviceLane) {};
}

/* The lane's batched kernels and their descriptor memory (its context current): without
 * either (no kernels built or loadable, no room for the descriptors), the lane copies
 * with the copy engines alone (l->kernels NULL): an option, never a reason to fail. */
static void lane_setup_kernels(GpuCopyEngine *e, int dev) {
        GpuSystem *s = e->system;
        CudaDriver *d = s->driver;
        DeviceLane *l = &e->lanes[dev];
        void *h = NULL;
        int r;

        r = gpu_kernels_load(s, dev, &l->kernels);
        if (r < 0) {
                log_debug_errno(r, "GPU %d: batched copy kernel unavailable (%m), using the copy engine only", dev);
                l->kernels = NULL;
                return;
        }
        l->kernels->uniform = e->uniform;
        r = CU(d, cuMemAllocHost, &h, DESC_BYTES);
        if (r >= 0) {
                l->desc_host = h;
                r = CU(d, cuMemAlloc, &l->desc_dev, DESC_BYTES);
        }
        if (r < 0) {
                log_warning_errno(r, "GPU %d: no memory for the batched copy kernel's descriptors (%m), "
                                     "using the copy engine only", dev);
                if (l->desc_host)
                        (void)CU(d, cuMemFreeHost, l->desc_host);
                l->desc_host = NULL;
                l->desc_dev = 0;
                l->kernels = gpu_kernels_free(l->kernels);
                return;
        }
        /* Without them the descriptors go up on the kernel's stream, as before. */
        if (CU(d, cuStreamCreate, &l->upload, CU_STREAM_NON_BLOCKING) < 0)
                l->upload = NULL;
        for (unsigned k = 0; l->upload && k < DESC_SLOTS; k++)
                if (CU(d, cuEventCreate, &l->uploaded[k], CU_EVENT_DISABLE_TIMING) < 0) {
                        for (unsigned q = 0; q < k; q++)
                                (void)CU(d, cuEventDestroy, l->uploaded[q]);
                        memset(l->uploaded, 0, sizeof l->uploaded);
                        (void)CU(d, cuStreamDestroy, l->upload);
                        l->upload = NULL;
                }
}

/* Sets up device dev's lane (its context current, streams, the batched kernels and
 * their descriptor memory) and leaves its context current. Idempotent; on the
 * submitting thread. A failure to make its context or streams leaves the lane as it was
 * (a later use tries again); the kernels are optional (lane_setup_kernels()). */
static int lane_setup(GpuCopyEngine *e, int dev) {
        GpuSystem *s = e->system;
        CudaDriver *d = s->driver;
        DeviceLane *l;
        int r;

        if (dev < 0 || (size_t)dev >= s->n_devices)
                return -ENODEV;
        l = &e->lanes[dev];
        r = gpu_device_make_current(s, &s->devices[dev]);
        if (r < 0 || l->ready)
                return r;
        for (int p = 0; p < _GPU_COPY_PATH_MAX; p++)
                for (unsigned k = 0; k < STREAMS_PER_PATH; k++) {
                        r = CU(d, cuStreamCreate, &l->streams[p][k], CU_STREAM_NON_BLOCKING);
                        if (r < 0) {
                                lane_clear(e, dev);
                                return r;
                        }
                }
        int pitch = 0;
        if (CU(d, cuDeviceGetAttribute, &pitch, CU_DEVICE_ATTRIBUTE_MAX_PITCH, s->devices[dev].dev) >= 0 && pitch > 0)
                l->max_pitch = (uint64_t)pitch;
        lane_setup_kernels(e, dev);
        l->ready = true;
        return 0;
}

int gpu_copy_engine_use_device(GpuCopyEngine *e, int dev) {
        if (!e)
                return -EINVAL;
        return lane_setup(e, dev);
}

GpuCopyEngine *gpu_copy_engine_free(GpuCopyEngine *e) {
        if (!e)
                return NULL;

        if (e->queues) {
                size_t n = e->system->n_devices * _GPU_COPY_PATH_MAX;
                /* Shutdown: each queue's thread sees every event of its work in flight
                 * pass first. */
                pthread_mutex_lock(&e->lock);
                e->stopping = true;
                for (size_t i = 0; i < n; i++)
                        if (e->queues[i].started)
                                pthread_cond_signal(&e->queues[i].more);
                pthread_mutex_unlock(&e->lock);
                for (size_t i = 0; i < n; i++) {
                        WatchQueue *q = &e->queues[i];
                        if (q->started) {
                                (void)pthread_join(q->thread, NULL);
                                pthread_cond_destroy(&q->more);
                        }
                        free(q->watches);
                }
                free(e->queues);
        }
        if (e->lanes)
                for (size_t i = 0; i < e->system->n_devices; i++)
                        lane_clear(e, (int)i);
        /* Batches finished but never reaped. */
        while (e->done.first) {
                GpuCopyJob *j = e->done.first;
                QUEUE_REMOVE(done, e->done, j);
                job_free(j);
        }
        free(e->lanes);
        free(e->scratch);
        safe_close(e->efd);
        safe_close(e->timeline_fd);
        pthread_mutex_destroy(&e->lock);
        gpu_system_unref(e->system);
        free(e);
        return NULL;
}

int gpu_copy_engine_new(GpuSystem *s, GpuCopyEngine **ret) {
        _cleanup_(gpu_copy_engine_freep) GpuCopyEngine *e = NULL;

        e = calloc(1, sizeof *e);
        if (!e)
                return -ENOMEM;
        e->system = gpu_system_ref(s);
        e->efd = -EBADF;
        e->timeline_fd = -EBADF;
        pthread_mutex_init(&e->lock, NULL);
        e->kernel_min_segments = 16;
        e->batch_api = true;
        e->strided = false;
        e->d2d_streams = 1;
        e->spin_usec = GPU_COPY_SPIN_USEC;
        e->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (e->efd < 0)
                return -errno;
        e->lanes = calloc(s->n_devices, sizeof *e->lanes);
        if (!e->lanes)
                return -ENOMEM;
        e->queues = calloc(s->n_devices * _GPU_COPY_PATH_MAX, sizeof *e->queues);
        if (!e->queues)
                return -ENOMEM;
        for (size_t i = 0; i < s->n_devices * _GPU_COPY_PATH_MAX; i++)
                e->queues[i] = (WatchQueue) { .engine = e, .dev = (int)(i / _GPU_COPY_PATH_MAX),
                                              .path = (GpuCopyPath)(i % _GPU_COPY_PATH_MAX) };
        /* No lane yet: each is set up when its GPU is first used, and each queue's
         * completion thread on its first part. */
        *ret = TAKE_PTR(e);
        return 0;
}

/* Pinning and unpinning need a current context (any: the pin is PORTABLE): the
 * thread's own, else one this process holds already, else the first GPU's. */
static int host_context(GpuSystem *s) {
        CUcontext cur = NULL;
        if (s->driver->cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur)
                return 0;
        for (size_t i = 0; i < s->n_devices; i++)
                if (__atomic_load_n(&s->devices[i].ctx, __ATOMIC_ACQUIRE))
                        return gpu_device_make_current(s, &s->devices[i]);
        return s->n_devices > 0 ? gpu_device_make_current(s, &s->devices[0]) : -ENODEV;
}

int gpu_host_register(GpuSystem *s, void *p, size_t size) {
        if (!p || size == 0)
                return -EINVAL;
        int r = host_context(s);
        if (r < 0)
                return r;
        return CU(s->driver, cuMemHostRegister, p, size, CU_MEMHOSTREGISTER_PORTABLE);
}

int gpu_host_unregister(GpuSystem *s, void *p) {
        int r = host_context(s);
        if (r < 0)
                return r;
        return CU(s->driver, cuMemHostUnregister, p);
}
