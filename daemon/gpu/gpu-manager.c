/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The GPU domain's hooks into the Manager: creating and releasing configured GPU arenas
 * (the Subsystem's arenas hooks for Domain=gpu), start-up report and shutdown. The CUDA transport's
 * completion fd is watched by whoever posts to it (the handoff code), like every
 * transport's. Glue only; the logic is in gpu-domain.c. */

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/epoll.h>

#include <systemd/sd-event.h>

#include "core/manager.h"
#include "gpu/bus-gpu.h"
#include "gpu/gpu-domain.h"
#include "gpu/gpu-manager.h"
#include "log.h"
#include "macro.h"
#include "transport/cuda.h"

/* A configured Domain=gpu arena, loading the driver on first use. Fails with a clear
 * "no GPU" message where there is none. */
static int gpu_manager_arena_new(Manager *m, const ArenaConfig *c, uint32_t index, Arena **ret) {
        int r;

        if (!m->gpu) {
                r = gpu_context_new(secure_getenv("EPD_LIBCUDA"), &m->gpu);
                if (r < 0)
                        return log_error_errno(r, "Arena %s is configured with Domain=gpu, but %s.",
                                               c->name, cuda_absence_to_string(r));
        }
        return gpu_context_arena_new(m->gpu, c, index, ret);
}

static void gpu_manager_arena_release(Manager *m, Arena *a) {
        if (a->gpu) {
                if (m->gpu)
                        gpu_context_arena_forget(m->gpu, a);
                /* The last reference: unmaps and releases the allocation (workers that
                 * still map it keep it alive until they unmap). */
                a->gpu = gpu_arena_unref(a->gpu);
        }
}

/* One asynchronous copy-on-write batch: its cookie in the engine is this struct. */
typedef struct CowCall {
        PageCopyDoneFn done;
        void *userdata;
} CowCall;

static void cow_dispatch(GpuContext *g) {
        GpuCopyDone d[64];
        size_t n;

        while ((n = gpu_copy_reap(g->cow_engine, d, ELEMENTSOF(d))) > 0)
                for (size_t i = 0; i < n; i++) {
                        CowCall *c = (CowCall *)(uintptr_t)d[i].cookie;
                        c->done(c->userdata, d[i].error);
                        free(c);
                }
}

static int on_cow_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Manager *m = userdata;
        if (m->gpu && m->gpu->cow_engine)
                cow_dispatch(m->gpu);
        return 0;
}

int gpu_manager_page_copy_async(void *userdata, uint32_t arena, const uint64_t *dst, const uint64_t *src,
                                size_t n, uint64_t length, PageCopyDoneFn done, void *done_userdata) {
        Manager *m = userdata;
        _cleanup_(freep) GpuCopySeg *segs = NULL;
        int r;

        if (!m || !done || n == 0)
                return -EINVAL;
        if (!m->gpu || !m->gpu->cow_engine)
                return -ENODEV;
        if (arena >= m->n_arenas || !m->arenas[arena]->gpu)
                return -EINVAL;
        GpuArena *g = m->arenas[arena]->gpu;
        segs = calloc(n, sizeof *segs);
        if (!segs)
                return -ENOMEM;
        for (size_t i = 0; i < n; i++) {
                if (!gpu_arena_range_ok(g, dst[i], length) || !gpu_arena_range_ok(g, src[i], length))
                        return -ERANGE;
                segs[i] = (GpuCopySeg) { .src = g, .dst = g, .src_offset = src[i], .dst_offset = dst[i],
                                         .length = length };
        }
        CowCall *c = malloc(sizeof *c);
        if (!c)
                return -ENOMEM;
        *c = (CowCall) { .done = done, .userdata = done_userdata };
        r = gpu_copy_submit(m->gpu->cow_engine, segs, n, (uint64_t)(uintptr_t)c);
        if (r < 0)
                free(c);
        return r;
}

void gpu_manager_page_copy_drain(Manager *m) {
        GpuContext *g = m ? m->gpu : NULL;
        if (!g || !g->cow_engine)
                return;
        /* A GPU copy cannot be recalled: wait for it (the engine's fd; no spinning). */
        while (gpu_copy_engine_in_flight(g->cow_engine) > 0 && gpu_copy_wait(g->cow_engine, 1000) >= 0)
                cow_dispatch(g);
        cow_dispatch(g);
}

/* The reloadable settings of both copy engines: CompletionSpin=, and StridedCopies= when
 * it is set anew (a reload that leaves it alone keeps an engine's own "off" after the
 * driver refused a 2D copy). */
static void engines_set(Manager *m, const Config *c, bool strided) {
        unsigned usec = (unsigned)MIN(c->gpu_completion_spin_usec, (usec_t)UINT_MAX);
        GpuCopyEngine *e[] = { cuda_transport_engine(m->gpu->transport), m->gpu->cow_engine };
        for (size_t i = 0; i < ELEMENTSOF(e); i++)
                if (e[i]) {
                        gpu_copy_engine_set_spin(e[i], usec);
                        if (strided)
                                gpu_copy_engine_set_strided(e[i], c->gpu_strided_copies);
                }
}

/* EPD_GPU_COPY_TIMELINE=PATH: every part the handoffs' copy engine moves adds a line to
 * PATH (gpu_copy_engine_set_timeline(); docs/gpu.md): a diagnostic, off otherwise. */
static void timeline_open(Manager *m) {
        const char *path = secure_getenv("EPD_GPU_COPY_TIMELINE");
        if (!path || !*path)
                return;
        int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | O_NOFOLLOW, 0600);
        int r = fd < 0 ? -errno : gpu_copy_engine_set_timeline(cuda_transport_engine(m->gpu->transport), fd);
        if (r < 0)
                log_warning_errno(r, "GPU: no copy timeline in %s: %m", path);
        else
                log_notice("GPU: the copy engine's timeline goes to %s (a diagnostic: it costs an event "
                           "pair a part)", path);
        safe_close(fd);
}

static int gpu_init(Manager *m) {
        char *text = NULL;

        if (!m->gpu)
                return 0; /* no GPU arena configured: the GPU domain stays off */

        /* Scattered pages: the batched copy kernel for groups of many small segments. */
        gpu_copy_engine_set_kernel_policy(cuda_transport_engine(m->gpu->transport),
                                          (GpuCopyKernelPolicy)m->config.gpu_copy_kernel, 16);
        timeline_open(m);

        /* Copy-on-write copies, off the loop (gpu_manager_page_copy_async). */
        GpuCopyEngine *e = NULL;
        int r = gpu_copy_engine_new(m->gpu->system, &e);
        if (r < 0)
                return log_error_errno(r, "GPU: cannot start the copy-on-write copy engine: %m");
        m->gpu->cow_engine = e;
        gpu_copy_engine_set_kernel_policy(e, (GpuCopyKernelPolicy)m->config.gpu_copy_kernel, 16);
        /* Copy-on-write copies stay within a GPU arena: only their GPUs are set up. */
        for (size_t i = 0; i < m->n_arenas; i++)
                if (m->arenas[i]->domain == MEMORY_GPU) {
                        r = gpu_copy_engine_use_device(e, m->arenas[i]->gpu->ordinal);
                        if (r < 0)
                                return log_error_errno(r, "GPU: cannot set up copy-on-write copies on GPU %d: %m",
                                                       m->arenas[i]->gpu->ordinal);
                }
        sd_event_source *src = NULL;
        r = sd_event_add_io(m->event, &src, gpu_copy_engine_fd(e), EPOLLIN, on_cow_completion, m);
        if (r < 0)
                return log_error_errno(r, "GPU: cannot watch the copy-on-write copy engine: %m");
        m->gpu->cow_source = src;

        /* Host arenas are pinned for the GPU ↔ host copy paths (cuMemHostRegister). */
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (a->domain != MEMORY_HOST)
                        continue;
                r = m->gpu->transport->ops->register_region(m->gpu->transport, &a->region);
                if (r < 0)
                        log_warning_errno(r, "Arena %s: pinning for GPU copies failed, GPU <-> host copies of it will fail: %m",
                                          a->name);
        }

        engines_set(m, &m->config, true);

        if (gpu_context_format(m->gpu, &text) >= 0) {
                log_info("GPUs:\n%s", text);
                free(text);
        }
        return 0;
}

static void gpu_done(Manager *m) {
        if (!m->gpu)
                return;
        /* The page manager drained its copies at its own shutdown, which comes first. */
        m->gpu->cow_source = sd_event_source_disable_unref((sd_event_source *)m->gpu->cow_source);
        /* Arenas keep their own references to the driver, so they may go after this. */
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (!a)
                        continue;
                if (a->gpu)
                        gpu_context_arena_forget(m->gpu, a);
                else
                        m->gpu->transport->ops->unregister_region(m->gpu->transport, &a->region);
        }
        m->gpu = gpu_context_free(m->gpu);
}

/* [Gpu] CompletionSpin= and StridedCopies= take effect at once (MergeGroups= and
 * BatchesInFlight= are read at each handoff's pump; CopyKernel= at the next start). */
static int gpu_reload(Manager *m, const Config *n) {
        if (!m->gpu)
                return 0;
        engines_set(m, n, n->gpu_strided_copies != m->config.gpu_strided_copies);
        if (n->gpu_merge_groups != m->config.gpu_merge_groups ||
            n->gpu_batches_in_flight != m->config.gpu_batches_in_flight ||
            n->gpu_completion_spin_usec != m->config.gpu_completion_spin_usec ||
            n->gpu_strided_copies != m->config.gpu_strided_copies)
                log_info("GPU handoffs now: MergeGroups=%u BatchesInFlight=%u CompletionSpin=%" PRIu64
                         "us StridedCopies=%s",
                         n->gpu_merge_groups, n->gpu_batches_in_flight, (uint64_t)n->gpu_completion_spin_usec,
                         n->gpu_strided_copies ? "yes" : "no");
        return 0;
}

const GpuCopyCounter gpu_copy_counters[] = {
        { "batches", "epd_gpu_copy_submissions", NULL, "Submissions to a GPU copy engine (a handoff batch's parts).",
          offsetof(GpuCopyStats, batches) },
        { "segments", "epd_gpu_copy_segments", NULL, "Copies submitted to a GPU copy engine, after coalescing.",
          offsetof(GpuCopyStats, segments) },
        { "bytes", "epd_gpu_copy_bytes", "bytes", "Bytes a GPU copy engine copied without error.",
          offsetof(GpuCopyStats, bytes) },
        { "failures", "epd_gpu_copy_failures", NULL, "GPU copy submissions refused and copies that failed.",
          offsetof(GpuCopyStats, failures) },
        { "kernel-launches", "epd_gpu_copy_kernel_launches", NULL, "Launches of the batched copy kernel.",
          offsetof(GpuCopyStats, kernel_launches) },
        { "batch-api-calls", NULL, NULL, NULL, offsetof(GpuCopyStats, batch_api_calls) },
        { "strided-copies", "epd_gpu_copy_strided_copies", NULL, "2D copies (cuMemcpy2DAsync) of evenly spaced pieces.",
          offsetof(GpuCopyStats, strided_copies) },
        { "strided-rows", NULL, NULL, NULL, offsetof(GpuCopyStats, strided_rows) },
};
const size_t gpu_copy_counters_n = ELEMENTSOF(gpu_copy_counters);

void gpu_manager_copy_stats(Manager *m, const GpuCopyStats **ret_handoff, const GpuCopyStats **ret_cow) {
        GpuContext *g = m ? m->gpu : NULL;
        *ret_handoff = g ? gpu_copy_engine_stats(cuda_transport_engine(g->transport)) : NULL;
        *ret_cow = g && g->cow_engine ? gpu_copy_engine_stats(g->cow_engine) : NULL;
}

const Subsystem gpu_subsystem = {
        .name = "gpu",
        .init = gpu_init,
        .done = gpu_done,
        .reload = gpu_reload,
        .add_bus = bus_gpu_add,
        .worker_gone = bus_gpu_worker_gone,
        .arenas = &(const SubsystemArenas){
                .domain = MEMORY_GPU,
                .make = gpu_manager_arena_new,
                .release = gpu_manager_arena_release,
        },
};
