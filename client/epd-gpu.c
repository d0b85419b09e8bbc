/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>
#include <strings.h>

#include "epd/epd-gpu.h"
#include "system.h"
#include "vmm.h"

struct EpdGpu {
        GpuSystem *system;
        unsigned n_mappings;
        bool closing;
};

struct EpdGpuMapping {
        EpdGpu *gpu;
        GpuArena *arena;
};

static void epd_gpu_free(EpdGpu *g) {
        gpu_system_unref(g->system);
        free(g);
}

int epd_gpu_open(EpdGpu **ret) {
        EpdGpu *g;
        int r;

        if (!ret)
                return -EINVAL;
        g = calloc(1, sizeof *g);
        if (!g)
                return -ENOMEM;
        r = gpu_system_open(secure_getenv("EPD_LIBCUDA"), &g->system);
        if (r < 0) {
                free(g);
                return r;
        }
        *ret = g;
        return 0;
}

/* The handle lives until its last mapping is gone, so that unmapping after close is
 * safe. */
EpdGpu *epd_gpu_close(EpdGpu *g) {
        if (!g)
                return NULL;
        g->closing = true;
        if (g->n_mappings == 0)
                epd_gpu_free(g);
        return NULL;
}

const char *epd_gpu_strerror(int error) {
        return cuda_absence_to_string(error);
}

int epd_gpu_ordinal_from_pci_bus_id(EpdGpu *g, const char *pci_bus_id) {
        if (!g || !pci_bus_id)
                return -EINVAL;
        for (size_t i = 0; i < g->system->n_devices; i++)
                if (strcasecmp(g->system->devices[i].pci_bus_id, pci_bus_id) == 0)
                        return (int)i;
        return -ENODEV;
}

int epd_gpu_map(EpdGpu *g, int fd, uint64_t size, int ordinal, EpdGpuMapping **ret) {
        EpdGpuMapping *m;
        int r;

        if (!g || g->closing || !ret)
                return -EINVAL;
        m = calloc(1, sizeof *m);
        if (!m)
                return -ENOMEM;
        r = gpu_arena_import(g->system, ordinal, fd, size, &m->arena);
        if (r < 0) {
                free(m);
                return r;
        }
        m->gpu = g;
        g->n_mappings++;
        *ret = m;
        return 0;
}

uint64_t epd_gpu_mapping_device_pointer(const EpdGpuMapping *m) {
        return m ? m->arena->base : 0;
}

uint64_t epd_gpu_mapping_size(const EpdGpuMapping *m) {
        return m ? m->arena->size : 0;
}

EpdGpuMapping *epd_gpu_unmap(EpdGpuMapping *m) {
        EpdGpu *g;

        if (!m)
                return NULL;
        g = m->gpu;
        gpu_arena_unref(m->arena);
        free(m);
        if (--g->n_mappings == 0 && g->closing)
                epd_gpu_free(g);
        return NULL;
}

int epd_gpu_export(EpdGpu *g, uint64_t device_pointer, int *ret_fd) {
        if (!g || !ret_fd || device_pointer == 0)
                return -EINVAL;
        return gpu_export_allocation(g->system, device_pointer, ret_fd);
}
