/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The GPU domain's hooks into the Manager: creating and releasing configured GPU arenas
 * (the Subsystem's arenas hooks for Domain=gpu), start-up report and shutdown. The CUDA transport's
 * completion fd is watched by whoever posts to it (the handoff code), like every
 * transport's. Glue only; the logic is in gpu-domain.c. */

#include <errno.h>
#include <stdlib.h>

#include "core/manager.h"
#include "gpu/bus-gpu.h"
#include "gpu/gpu-domain.h"
#include "gpu/gpu-manager.h"
#include "log.h"
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

/* Copy-on-write of a page in a GPU arena (offsets into the arena): the copy engine, on
 * the daemon's context. Synchronous, like the host arenas' memcpy: the writer may only
 * write once its private copy exists; a page is MBs, microseconds on the copy engine.
 * The page manager installs it when it makes a GPU arena's page pool. */
int gpu_manager_page_copy(void *userdata, uint64_t dst, uint64_t src, uint64_t length) {
        Arena *a = userdata;
        GpuArena *g = a->gpu;
        int r;

        if (!g || !gpu_arena_range_ok(g, dst, length) || !gpu_arena_range_ok(g, src, length))
                return -ERANGE;
        r = gpu_device_make_current(g->system, &g->system->devices[g->ordinal]);
        if (r >= 0)
                r = CU(g->system->driver, cuMemcpyDtoD, g->base + dst, g->base + src, length);
        return r;
}

static int gpu_init(Manager *m) {
        char *text = NULL;

        if (!m->gpu)
                return 0; /* no GPU arena configured: the GPU domain stays off */

        /* Scattered pages: the batched copy kernel for groups of many small segments. */
        gpu_copy_engine_set_kernel_policy(cuda_transport_engine(m->gpu->transport),
                                          (GpuCopyKernelPolicy)m->config.gpu_copy_kernel, 16);

        /* Host arenas are pinned for the GPU ↔ host copy paths (cuMemHostRegister). */
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                int r;
                if (a->domain != MEMORY_HOST)
                        continue;
                r = m->gpu->transport->ops->register_region(m->gpu->transport, &a->region);
                if (r < 0)
                        log_warning_errno(r, "Arena %s: pinning for GPU copies failed, GPU <-> host copies of it will fail: %m",
                                          a->name);
        }

        if (gpu_context_format(m->gpu, &text) >= 0) {
                log_info("GPUs:\n%s", text);
                free(text);
        }
        return 0;
}

static void gpu_done(Manager *m) {
        if (!m->gpu)
                return;
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

const Subsystem gpu_subsystem = {
        .name = "gpu",
        .init = gpu_init,
        .done = gpu_done,
        .add_bus = bus_gpu_add,
        .worker_gone = bus_gpu_worker_gone,
        .arenas = &(const SubsystemArenas){
                .domain = MEMORY_GPU,
                .make = gpu_manager_arena_new,
                .release = gpu_manager_arena_release,
        },
};
