/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The GPU memory domain of epdd (struct GpuContext, Manager.gpu): the GPUs found at
 * start (gpu/system.h), the daemon's GPU arenas ([Arena:NAME] Domain=gpu Gpu=N),
 * external memory registered by workers, and the CUDA transport (transport/cuda.h).
 *
 * Off until configured: without a GPU arena in the config, no GpuContext exists and
 * libcuda is never loaded. With one but no usable GPU, startup fails with a clear "no
 * GPU" message (cuda_absence_to_string()).
 *
 * Nothing here touches the bus; the Subsystem hooks and the event source are in
 * gpu-manager.c. */

#include <stdint.h>

#include "copy.h"
#include "core/arena.h"
#include "hashmap.h"
#include "system.h"
#include "transport/transport.h"
#include "vmm.h"

/* External registrations a GpuContext accepts in all (each client also has its own
 * per-type limit through its ClientObjects). */
#define GPU_EXTERNAL_MAX 256U
#define GPU_EXTERNAL_PER_CLIENT_MAX 32U
/* Region ids of external memory start here; daemon arenas use their index. */
#define GPU_EXTERNAL_REGION_BASE 0x80000000U

typedef struct GpuExternal GpuExternal;

typedef struct GpuContext {
        GpuSystem *system;
        Transport *transport;        /* the CUDA transport */
        /* Copy-on-write copies of GPU pages (gpu-manager.c): an engine of their own, whose
         * completions the event loop hears on its fd (cow_source, an sd_event_source). */
        GpuCopyEngine *cow_engine;
        void *cow_source;
        Hashmap *by_base;            /* uint64_t device base → GpuArena* (referenced) */
        unsigned n_external;
        uint32_t next_external_id;
} GpuContext;

/* A worker's own GPU memory, imported by the daemon. The worker keeps ownership: the
 * daemon never frees the memory; releasing drops the daemon's mapping and reference. */
struct GpuExternal {
        GpuContext *context;
        GpuArena *arena;
        TransportRegion region;
};

int gpu_context_new(const char *library, GpuContext **ret);
/* Waits for copies in flight, drops the context's arena references. Arenas (which hold
 * their own reference on the driver) may be freed after this. */
GpuContext *gpu_context_free(GpuContext *g);
DEFINE_TRIVIAL_CLEANUP_FUNC(GpuContext *, gpu_context_free);

/* Creates a configured GPU arena as an Arena (domain MEMORY_GPU, data_offset 0, fd: a
 * dup of the exported VMM handle, gpu: the allocation, region: filled in and
 * registered with the CUDA transport). The caller frees it with arena_free(), which
 * must drop a->gpu (gpu_arena_unref) — see docs/gpu.md. */
int gpu_context_arena_new(GpuContext *g, const ArenaConfig *c, uint32_t index, Arena **ret);
/* Unregisters a GPU arena from the transport before arena_free(). */
void gpu_context_arena_forget(GpuContext *g, Arena *a);

/* The GpuArena mapped at this device base, or NULL. */
GpuArena *gpu_context_lookup(GpuContext *g, uint64_t device_base);

/* Imports a worker's exported memory (fd not consumed). -EDQUOT past GPU_EXTERNAL_MAX. */
int gpu_context_register_external(GpuContext *g, int ordinal, int fd, uint64_t size,
                                  GpuExternal **ret);
GpuExternal *gpu_external_release(GpuExternal *x);
DEFINE_TRIVIAL_CLEANUP_FUNC(GpuExternal *, gpu_external_release);

/* "epdctl gpus": the devices and the peer matrix, as text. */
int gpu_context_format(GpuContext *g, char **ret);
