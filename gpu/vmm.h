/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* GPU arenas: device memory from the CUDA virtual memory API, shared between processes
 * by POSIX fd, the way host arenas share memfds.
 *
 *  - gpu_arena_new(): the daemon's own arena. cuMemCreate (handle type POSIX fd, size
 *    rounded to the device's granularity), exported once as an fd (kept here, dup'ed for
 *    every worker), reserved, mapped and made read-write for the owning device and for
 *    every device with peer access to it. The daemon owns it: the physical memory lives
 *    until the daemon frees it, whatever workers that mapped it do (a dying worker only
 *    drops its own mapping).
 *  - gpu_arena_import(): the other side of an fd: map memory exported by another
 *    process. libepd uses it to map the daemon's arenas; the daemon uses it for
 *    registered external memory (a worker's own KV cache, exported by the worker). An
 *    imported arena never owns the memory: freeing it unmaps and drops this process's
 *    reference only, and the exporting process decides when the memory goes.
 *
 * GpuArena is reference counted so that copies in flight keep their arenas mapped until
 * they complete (gpu/copy.h takes a reference per batch). */

#include <stdbool.h>
#include <stdint.h>

#include "system.h"

typedef struct GpuArena {
        unsigned n_ref;
        GpuSystem *system;      /* referenced */
        int ordinal;            /* device the memory lives on (this process's ordinal) */
        bool owned;             /* created here with cuMemCreate */
        CUmemGenericAllocationHandle handle;
        bool have_handle;
        uint64_t size;          /* multiple of the device's granularity */
        CUdeviceptr base;       /* 0 until mapped */
        bool reserved, mapped;
        int fd;                 /* owned arenas: the exported handle; else -EBADF */
        void *userdata;
} GpuArena;

/* Rounds a requested size up to the granularity, refusing 0, non-power-of-2
 * granularities and overflow. Pure. */
int gpu_arena_size_round(uint64_t requested, uint64_t granularity, uint64_t *ret);

int gpu_arena_new(GpuSystem *s, int ordinal, uint64_t size, GpuArena **ret);
/* Maps the allocation behind `fd` (not consumed; the caller closes it) of `size` bytes,
 * which must be the exported allocation's size (a multiple of the granularity).
 * -EXDEV when the driver says the memory is not on GPU `ordinal` (another GPU's, or host
 * memory): the sender's word for where it lives is checked, never taken. */
int gpu_arena_import(GpuSystem *s, int ordinal, int fd, uint64_t size, GpuArena **ret);

GpuArena *gpu_arena_ref(GpuArena *a);
GpuArena *gpu_arena_unref(GpuArena *a);
DEFINE_TRIVIAL_CLEANUP_FUNC(GpuArena *, gpu_arena_unref);

/* A new O_CLOEXEC duplicate of an owned arena's exported fd, for sending to a worker. */
int gpu_arena_dup_fd(const GpuArena *a);

/* For a worker that allocated device memory itself with cuMemCreate and a POSIX-fd
 * handle type (e.g. PyTorch's expandable segments): exports the allocation mapped at
 * `ptr` as a new fd, to be registered with the daemon. */
int gpu_export_allocation(GpuSystem *s, CUdeviceptr ptr, int *ret_fd);

/* Device-side bounds check for copies: [offset, offset+length) inside the arena. */
static inline bool gpu_arena_range_ok(const GpuArena *a, uint64_t offset, uint64_t length) {
        return offset <= a->size && length <= a->size - offset;
}
