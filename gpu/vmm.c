/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>

#include "log.h"
#include "vmm.h"

int gpu_arena_size_round(uint64_t requested, uint64_t granularity, uint64_t *ret) {
        if (requested == 0 || !IS_POWER_OF_2(granularity))
                return -EINVAL;
        if (requested > UINT64_MAX - (granularity - 1))
                return -ERANGE;
        *ret = ALIGN_TO(requested, granularity);
        return 0;
}

static GpuArena *gpu_arena_free(GpuArena *a) {
        CudaDriver *d;

        if (!a)
                return NULL;
        d = a->system->driver;
        (void)gpu_device_make_current(a->system, &a->system->devices[a->ordinal]);
        if (a->mapped)
                (void)CU(d, cuMemUnmap, a->base, a->size);
        if (a->reserved)
                (void)CU(d, cuMemAddressFree, a->base, a->size);
        /* For an owned arena this frees the memory once no other process maps it; for an
         * imported one it only drops this process's reference. */
        if (a->have_handle)
                (void)CU(d, cuMemRelease, a->handle);
        safe_close(a->fd);
        gpu_system_unref(a->system);
        free(a);
        return NULL;
}

GpuArena *gpu_arena_ref(GpuArena *a) {
        if (a)
                a->n_ref++;
        return a;
}

GpuArena *gpu_arena_unref(GpuArena *a) {
        if (!a)
                return NULL;
        if (--a->n_ref > 0)
                return NULL;
        return gpu_arena_free(a);
}

/* Reserve a VA range, map the handle, and grant access to the owning device and to
 * every device that has peer access to it. */
static int arena_map(GpuArena *a) {
        GpuSystem *s = a->system;
        CudaDriver *d = s->driver;
        CUmemAccessDesc desc[GPU_DEVICES_MAX];
        size_t n = 0;
        int r;

        r = CU(d, cuMemAddressReserve, &a->base, a->size, 0, 0, 0);
        if (r < 0)
                return r;
        a->reserved = true;
        r = CU(d, cuMemMap, a->base, a->size, 0, a->handle, 0);
        if (r < 0)
                return r;
        a->mapped = true;

        for (size_t i = 0; i < s->n_devices; i++)
                if (gpu_system_can_access_peer(s, (int)i, a->ordinal))
                        desc[n++] = (CUmemAccessDesc) {
                                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = (int)i },
                                .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                        };
        return CU(d, cuMemSetAccess, a->base, a->size, desc, n);
}

static int arena_alloc(GpuSystem *s, int ordinal, uint64_t size, GpuArena **ret) {
        GpuDevice *g = gpu_system_device(s, ordinal);
        GpuArena *a;
        int r;

        if (!g)
                return -ENODEV;
        if (!g->vmm || !g->posix_fd || g->granularity == 0)
                return -EOPNOTSUPP;
        if (size == 0 || size % g->granularity != 0 || size > g->total_memory)
                return -EINVAL;
        r = gpu_device_make_current(s, g);
        if (r < 0)
                return r;

        a = calloc(1, sizeof *a);
        if (!a)
                return -ENOMEM;
        *a = (GpuArena) {
                .n_ref = 1,
                .system = gpu_system_ref(s),
                .ordinal = ordinal,
                .size = size,
                .fd = -EBADF,
        };
        *ret = a;
        return 0;
}

int gpu_arena_new(GpuSystem *s, int ordinal, uint64_t size, GpuArena **ret) {
        _cleanup_(gpu_arena_unrefp) GpuArena *a = NULL;
        GpuDevice *g = gpu_system_device(s, ordinal);
        CUmemAllocationProp prop = {
                .type = CU_MEM_ALLOCATION_TYPE_PINNED,
                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal },
        };
        int fd = -1, r;

        if (!g)
                return -ENODEV;
        /* Request GPUDirect RDMA capability where the device offers it on VMM memory, so
         * that the RDMA transport can register these arenas. */
        prop.allocFlags.gpuDirectRDMACapable = g->gdr_vmm;

        r = arena_alloc(s, ordinal, size, &a);
        if (r < 0)
                return r;
        a->owned = true;
        r = CU(s->driver, cuMemCreate, &a->handle, a->size, &prop, 0);
        if (r < 0)
                return r;
        a->have_handle = true;
        r = CU(s->driver, cuMemExportToShareableHandle, &fd, a->handle,
               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (r < 0)
                return r;
        a->fd = fd;
        /* The driver's fd may lack FD_CLOEXEC: every fd of ours has it. */
        r = fcntl(a->fd, F_GETFD);
        if (r < 0 || fcntl(a->fd, F_SETFD, r | FD_CLOEXEC) < 0)
                return -errno;
        r = arena_map(a);
        if (r < 0)
                return r;

        *ret = TAKE_PTR(a);
        return 0;
}

int gpu_arena_import(GpuSystem *s, int ordinal, int fd, uint64_t size, GpuArena **ret) {
        _cleanup_(gpu_arena_unrefp) GpuArena *a = NULL;
        int r;

        if (fd < 0)
                return -EBADF;
        r = arena_alloc(s, ordinal, size, &a);
        if (r < 0)
                return r;
        r = CU(s->driver, cuMemImportFromShareableHandle, &a->handle, (void *)(intptr_t)fd,
               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (r < 0)
                return r;
        a->have_handle = true;
        /* The fd's sender says which GPU the memory is on; the driver knows. Memory of
         * another GPU taken as this one's would be copied by the wrong device's engines
         * through peer access (or not at all), and host memory is not this domain's. */
        CUmemAllocationProp prop = {};
        r = CU(s->driver, cuMemGetAllocationPropertiesFromHandle, &prop, a->handle);
        if (r < 0)
                return r;
        if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
            prop.location.id != s->devices[ordinal].dev)
                return log_debug_errno(EXDEV, "Imported GPU memory is at location %d:%d, not on device %d.",
                                       (int)prop.location.type, prop.location.id, ordinal);
        /* Mapping more than the exported allocation holds fails here (-EINVAL). */
        r = arena_map(a);
        if (r < 0)
                return r;

        *ret = TAKE_PTR(a);
        return 0;
}

int gpu_arena_dup_fd(const GpuArena *a) {
        if (!a || a->fd < 0)
                return -EBADF;
        return RET_NERRNO(fcntl(a->fd, F_DUPFD_CLOEXEC, 3));
}

int gpu_export_allocation(GpuSystem *s, CUdeviceptr ptr, int *ret_fd) {
        CUmemGenericAllocationHandle h;
        int fd = -1, r, k;

        r = CU(s->driver, cuMemRetainAllocationHandle, &h, (void *)(uintptr_t)ptr);
        if (r < 0)
                return r;
        r = CU(s->driver, cuMemExportToShareableHandle, &fd, h,
               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        (void)CU(s->driver, cuMemRelease, h);
        if (r < 0)
                return r;
        k = fcntl(fd, F_GETFD);
        if (k < 0 || fcntl(fd, F_SETFD, k | FD_CLOEXEC) < 0) {
                r = -errno;
                safe_close(fd);
                return r;
        }
        *ret_fd = fd;
        return 0;
}
