/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "system.h"

/* Atomic: libepd's threads take and drop references without a common lock (a Python
 * sink's setup thread maps an arena while the main thread loads the kernels or the
 * collector unmaps one). */
GpuSystem *gpu_system_ref(GpuSystem *s) {
        if (s)
                __atomic_add_fetch(&s->n_ref, 1, __ATOMIC_RELAXED);
        return s;
}

GpuSystem *gpu_system_unref(GpuSystem *s) {
        if (!s || __atomic_sub_fetch(&s->n_ref, 1, __ATOMIC_ACQ_REL) > 0)
                return NULL;
        for (size_t i = 0; i < s->n_devices; i++)
                if (s->devices[i].ctx)
                        (void)s->driver->cuDevicePrimaryCtxRelease(s->devices[i].dev);
        free(s->devices);
        free(s->peer);
        cuda_driver_close(s->driver);
        free(s);
        return NULL;
}

static int probe_device(CudaDriver *d, GpuDevice *g, int ordinal) {
        CUmemAllocationProp prop = {
                .type = CU_MEM_ALLOCATION_TYPE_PINNED,
                .requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                .location = { .type = CU_MEM_LOCATION_TYPE_DEVICE, .id = ordinal },
        };
        int v, r;
        size_t bytes;

        g->ordinal = ordinal;
        r = CU(d, cuDeviceGet, &g->dev, ordinal);
        if (r < 0)
                return r;
        r = CU(d, cuDeviceGetName, g->name, sizeof g->name, g->dev);
        if (r < 0)
                return r;
        r = CU(d, cuDeviceGetPCIBusId, g->pci_bus_id, sizeof g->pci_bus_id, g->dev);
        if (r < 0)
                return r;
        /* The driver prints upper-case hex; sysfs and lspci use lower case. */
        for (char *p = g->pci_bus_id; *p; p++)
                if (*p >= 'A' && *p <= 'F')
                        *p = (char)(*p - 'A' + 'a');
        if (CU(d, cuDeviceTotalMem, &bytes, g->dev) >= 0)
                g->total_memory = bytes;
        if (CU(d, cuDeviceGetAttribute, &v, CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT, g->dev) >= 0)
                g->copy_engines = v;
        if (CU(d, cuDeviceGetAttribute, &v, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
               g->dev) >= 0)
                g->vmm = v;
        if (CU(d, cuDeviceGetAttribute, &v,
               CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, g->dev) >= 0)
                g->posix_fd = v;
        if (CU(d, cuDeviceGetAttribute, &v,
               CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, g->dev) >= 0)
                g->gdr_vmm = v;
        if (g->vmm && g->posix_fd) {
                if (CU(d, cuMemGetAllocationGranularity, &bytes, &prop,
                       CU_MEM_ALLOC_GRANULARITY_MINIMUM) >= 0)
                        g->granularity = bytes;
                if (CU(d, cuMemGetAllocationGranularity, &bytes, &prop,
                       CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) >= 0)
                        g->granularity_recommended = bytes;
        }
        return 0; /* its primary context is retained on first use: gpu_device_ctx() */
}

int gpu_system_open(const char *library, GpuSystem **ret) {
        _cleanup_(gpu_system_unrefp) GpuSystem *s = NULL;
        size_t n;
        int r;

        s = calloc(1, sizeof *s);
        if (!s)
                return -ENOMEM;
        s->n_ref = 1;
        r = cuda_driver_open(library, &s->driver);
        if (r < 0)
                return r;

        n = MIN((size_t)s->driver->n_devices, (size_t)GPU_DEVICES_MAX);
        s->devices = calloc(n, sizeof *s->devices);
        s->peer = calloc(n * n, sizeof *s->peer);
        if (!s->devices || !s->peer)
                return -ENOMEM;
        for (size_t i = 0; i < n; i++) {
                r = probe_device(s->driver, &s->devices[i], (int)i);
                if (r < 0)
                        return log_debug_errno(r, "Probing GPU %zu failed: %m", i);
                s->n_devices = i + 1;
        }
        for (size_t i = 0; i < n; i++)
                for (size_t j = 0; j < n; j++) {
                        int can = 0;
                        if (i == j)
                                continue;
                        if (CU(s->driver, cuDeviceCanAccessPeer, &can, s->devices[i].dev,
                               s->devices[j].dev) >= 0)
                                s->peer[i * n + j] = can;
                }

        *ret = TAKE_PTR(s);
        return 0;
}

GpuDevice *gpu_system_device(GpuSystem *s, int ordinal) {
        if (!s || ordinal < 0 || (size_t)ordinal >= s->n_devices)
                return NULL;
        return &s->devices[ordinal];
}

static int device_ctx(GpuSystem *s, const GpuDevice *d, CUcontext *ret) {
        GpuDevice *g = &s->devices[d->ordinal]; /* d is one of them */
        CUcontext c = __atomic_load_n(&g->ctx, __ATOMIC_ACQUIRE), none = NULL;
        if (!c) {
                int r = CU(s->driver, cuDevicePrimaryCtxRetain, &c, g->dev);
                if (r < 0)
                        return r;
                /* Threads that race here each retained it: one keeps its reference. */
                if (!__atomic_compare_exchange_n(&g->ctx, &none, c, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                        (void)CU(s->driver, cuDevicePrimaryCtxRelease, g->dev);
                        c = none;
                }
        }
        *ret = c;
        return 0;
}

CUcontext gpu_device_ctx(GpuSystem *s, const GpuDevice *d) {
        CUcontext c = NULL;
        return device_ctx(s, d, &c) >= 0 ? c : NULL;
}

int gpu_device_make_current(GpuSystem *s, const GpuDevice *d) {
        CUcontext c;
        int r = device_ctx(s, d, &c);
        if (r < 0)
                return r;
        return CU(s->driver, cuCtxSetCurrent, c);
}

GpuCtxSaved gpu_ctx_save(GpuSystem *s) {
        GpuCtxSaved c = {};
        c.valid = s->driver->cuCtxGetCurrent(&c.ctx) == CUDA_SUCCESS;
        return c;
}

void gpu_ctx_restore(GpuSystem *s, const GpuCtxSaved *saved) {
        CUcontext now = NULL;
        if (!saved->valid || (s->driver->cuCtxGetCurrent(&now) == CUDA_SUCCESS && now == saved->ctx))
                return;
        (void)s->driver->cuCtxSetCurrent(saved->ctx);
}

bool gpu_system_can_access_peer(const GpuSystem *s, int from, int to) {
        if (from < 0 || to < 0 || (size_t)from >= s->n_devices || (size_t)to >= s->n_devices)
                return false;
        if (from == to)
                return true;
        return s->peer[(size_t)from * s->n_devices + (size_t)to];
}

int gpu_system_format(const GpuSystem *s, char **ret) {
        char *buf = NULL;
        size_t size = 0;
        FILE *f;

        f = open_memstream(&buf, &size);
        if (!f)
                return -ENOMEM;
        fprintf(f, "driver %d.%d, %zu GPU(s)\n", s->driver ? s->driver->driver_version / 1000 : 0,
                s->driver ? (s->driver->driver_version % 1000) / 10 : 0, s->n_devices);
        fprintf(f, "%-4s %-14s %-10s %-3s %-5s %-4s %-6s %s\n", "GPU", "PCI", "MEMORY", "CE",
                "VMM", "FD", "GDR", "NAME");
        for (size_t i = 0; i < s->n_devices; i++) {
                const GpuDevice *g = &s->devices[i];
                fprintf(f, "%-4d %-14s %6.1f GiB %-3d %-5s %-4s %-6s %s\n", g->ordinal,
                        g->pci_bus_id, (double)g->total_memory / (1ULL << 30), g->copy_engines,
                        g->vmm ? "yes" : "no", g->posix_fd ? "yes" : "no",
                        g->gdr_vmm ? "yes" : "no", g->name);
        }
        if (s->n_devices > 1) {
                fprintf(f, "peer access (row can access column):\n     ");
                for (size_t j = 0; j < s->n_devices; j++)
                        fprintf(f, " %3zu", j);
                fputc('\n', f);
                for (size_t i = 0; i < s->n_devices; i++) {
                        fprintf(f, " %3zu ", i);
                        for (size_t j = 0; j < s->n_devices; j++)
                                fprintf(f, " %3s", i == j ? "-" :
                                        s->peer[i * s->n_devices + j] ? "yes" : "no");
                        fputc('\n', f);
                }
        }
        if (fclose(f) != 0) {
                free(buf);
                return -ENOMEM;
        }
        *ret = buf;
        return 0;
}
