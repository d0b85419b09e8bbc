/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/gpu-domain.h"
#include "log.h"
#include "transport/cuda.h"

static int by_base_add(GpuContext *g, GpuArena *a) {
        int r = hashmap_put(g->by_base, &a->base, a);
        if (r < 0)
                return r;
        gpu_arena_ref(a);
        return 0;
}

static void by_base_remove(GpuContext *g, GpuArena *a) {
        if (hashmap_get(g->by_base, &a->base) == a) {
                hashmap_remove(g->by_base, &a->base);
                gpu_arena_unref(a);
        }
}

static GpuArena *context_lookup(void *userdata, uint64_t device_base) {
        return gpu_context_lookup(userdata, device_base);
}

int gpu_context_new(const char *library, GpuContext **ret) {
        _cleanup_(gpu_context_freep) GpuContext *g = NULL;
        int r;

        g = calloc(1, sizeof *g);
        if (!g)
                return -ENOMEM;
        g->next_external_id = GPU_EXTERNAL_REGION_BASE;
        g->by_base = hashmap_new(HASHMAP_KEY_U64, 0);
        if (!g->by_base)
                return -ENOMEM;
        r = gpu_system_open(library, &g->system);
        if (r < 0)
                return r;
        r = cuda_transport_new(g->system, context_lookup, g, &g->transport);
        if (r < 0)
                return r;
        *ret = TAKE_PTR(g);
        return 0;
}

GpuContext *gpu_context_free(GpuContext *g) {
        size_t i = 0;
        void *v;

        if (!g)
                return NULL;
        /* The transport first: it waits for copies in flight and unpins host regions. */
        if (g->transport)
                g->transport->ops->free(g->transport);
        g->cow_engine = gpu_copy_engine_free(g->cow_engine); /* waits for copies in flight */
        if (g->by_base) {
                while (hashmap_iterate(g->by_base, &i, &v, NULL))
                        gpu_arena_unref(v);
                hashmap_free(g->by_base);
        }
        gpu_system_unref(g->system);
        free(g);
        return NULL;
}

GpuArena *gpu_context_lookup(GpuContext *g, uint64_t device_base) {
        return g ? hashmap_get(g->by_base, &device_base) : NULL;
}

int gpu_context_arena_new(GpuContext *g, const ArenaConfig *c, uint32_t index, Arena **ret) {
        _cleanup_(gpu_arena_unrefp) GpuArena *ga = NULL;
        GpuDevice *dev;
        Arena *a;
        uint64_t size;
        int r;

        if (!g || !c || c->domain != MEMORY_GPU)
                return -EINVAL;
        dev = gpu_system_device(g->system, c->gpu);
        if (!dev)
                return log_error_errno(ENODEV, "Arena %s: Gpu=%d, but this machine has %zu GPU(s).",
                                       c->name, c->gpu, g->system->n_devices);
        if (!dev->vmm || !dev->posix_fd)
                return log_error_errno(EOPNOTSUPP,
                                       "Arena %s: GPU %d (%s) cannot export VMM memory as a file descriptor.",
                                       c->name, c->gpu, dev->pci_bus_id);
        r = gpu_arena_size_round(c->size, dev->granularity, &size);
        if (r < 0)
                return log_error_errno(r, "Arena %s: bad size %" PRIu64 ": %m", c->name, c->size);
        r = gpu_arena_new(g->system, c->gpu, size, &ga);
        if (r < 0)
                return log_error_errno(r, "Arena %s: allocating %" PRIu64 " bytes on GPU %d failed: %m",
                                       c->name, size, c->gpu);

        a = calloc(1, sizeof *a);
        if (!a)
                return log_oom();
        *a = (Arena) {
                .index = index,
                .name = strdup(c->name ?: ""),
                .domain = MEMORY_GPU,
                .usage = c->usage,
                .size = size,
                .data_offset = 0, /* GPU arenas carry no header: workers get the layout by bus */
                .fd = gpu_arena_dup_fd(ga),
                .region = {
                        .id = index,
                        .domain = MEMORY_GPU,
                        .gpu_ordinal = c->gpu,
                        .device_base = ga->base,
                        .size = size,
                },
        };
        if (!a->name || a->fd < 0) {
                r = a->fd < 0 ? a->fd : -ENOMEM;
                safe_close(a->fd);
                free(a->name);
                free(a);
                return log_error_errno(r, "Arena %s: %m", c->name);
        }
        r = by_base_add(g, ga);
        if (r >= 0) {
                r = g->transport->ops->register_region(g->transport, &a->region);
                if (r < 0)
                        by_base_remove(g, ga);
        }
        if (r < 0) {
                safe_close(a->fd);
                free(a->name);
                free(a);
                return log_error_errno(r, "Arena %s: registering with the CUDA transport failed: %m", c->name);
        }
        a->gpu = TAKE_PTR(ga);
        log_info("Arena %s: %" PRIu64 " MiB on GPU %d (%s), exported as fd.", c->name,
                 size >> 20, c->gpu, dev->pci_bus_id);
        *ret = a;
        return 0;
}

void gpu_context_arena_forget(GpuContext *g, Arena *a) {
        if (!g || !a || !a->gpu)
                return;
        g->transport->ops->unregister_region(g->transport, &a->region);
        by_base_remove(g, a->gpu);
}

int gpu_context_register_external(GpuContext *g, int ordinal, int fd, uint64_t size,
                                  GpuExternal **ret) {
        _cleanup_(gpu_arena_unrefp) GpuArena *ga = NULL;
        GpuExternal *x;
        int r;

        if (!g || fd < 0 || !ret)
                return -EINVAL;
        if (g->n_external >= GPU_EXTERNAL_MAX)
                return -EDQUOT;
        if (!gpu_system_device(g->system, ordinal))
                return -ENODEV;
        r = gpu_arena_import(g->system, ordinal, fd, size, &ga);
        if (r < 0)
                return r;

        x = calloc(1, sizeof *x);
        if (!x)
                return -ENOMEM;
        x->context = g;
        x->region = (TransportRegion) {
                .id = g->next_external_id,
                .domain = MEMORY_GPU,
                .gpu_ordinal = ordinal,
                .device_base = ga->base,
                .size = ga->size,
        };
        r = by_base_add(g, ga);
        if (r >= 0) {
                r = g->transport->ops->register_region(g->transport, &x->region);
                if (r < 0)
                        by_base_remove(g, ga);
        }
        if (r < 0) {
                free(x);
                return r;
        }
        g->next_external_id = g->next_external_id == UINT32_MAX ? GPU_EXTERNAL_REGION_BASE
                                                                : g->next_external_id + 1;
        g->n_external++;
        x->arena = TAKE_PTR(ga);
        *ret = x;
        return 0;
}

GpuExternal *gpu_external_release(GpuExternal *x) {
        GpuContext *g;

        if (!x)
                return NULL;
        g = x->context;
        /* Copies in flight keep their own references: the mapping goes when they finish.
         * The memory itself stays the worker's: this only drops the daemon's import. */
        g->transport->ops->unregister_region(g->transport, &x->region);
        by_base_remove(g, x->arena);
        gpu_arena_unref(x->arena);
        g->n_external--;
        free(x);
        return NULL;
}

int gpu_context_format(GpuContext *g, char **ret) {
        return gpu_system_format(g->system, ret);
}
