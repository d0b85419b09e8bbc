/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The GPUs of this machine as epd sees them: the loaded driver, each device's primary
 * context, PCI bus id and capabilities, and the peer-access matrix. Used by the daemon
 * (one per GpuContext) and by libepd (one per process that maps GPU arenas). */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cuda-loader.h"

#define GPU_PCI_BUS_ID_MAX 32
#define GPU_NAME_MAX 96
#define GPU_DEVICES_MAX 64

typedef struct GpuDevice {
        int ordinal;
        CUdevice dev;
        CUcontext ctx;                  /* primary context, retained on first use (atomic) */
        char name[GPU_NAME_MAX];
        char pci_bus_id[GPU_PCI_BUS_ID_MAX]; /* "0000:19:00.0" */
        uint64_t total_memory;
        int copy_engines;               /* CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT */
        bool vmm;                       /* virtual memory management */
        bool posix_fd;                  /* VMM handles exportable as POSIX fds */
        bool gdr_vmm;                   /* GPUDirect RDMA on VMM allocations */
        uint64_t granularity;           /* minimum VMM granularity for this device */
        uint64_t granularity_recommended;
} GpuDevice;

typedef struct GpuSystem {
        unsigned n_ref;
        CudaDriver *driver;
        GpuDevice *devices;
        size_t n_devices;
        /* peer[i * n + j]: device i can access memory on device j (i != j). */
        bool *peer;
} GpuSystem;

/* Loads the driver (library NULL: libcuda.so.1) and probes every device. Returns the
 * errors of cuda_driver_open() when there is no usable GPU. */
int gpu_system_open(const char *library, GpuSystem **ret);
/* Reference counted: every GpuArena holds one, so arenas may outlive their creator. */
GpuSystem *gpu_system_ref(GpuSystem *s);
GpuSystem *gpu_system_unref(GpuSystem *s);
DEFINE_TRIVIAL_CLEANUP_FUNC(GpuSystem *, gpu_system_unref);

GpuDevice *gpu_system_device(GpuSystem *s, int ordinal);
/* Makes the device's primary context current on the calling thread. */
int gpu_device_make_current(GpuSystem *s, const GpuDevice *d);
/* The device's primary context, retained on first use: a process does not create a
 * context (hundreds of MiB of device memory each) on GPUs it can see but never uses.
 * NULL if it cannot be retained. */
CUcontext gpu_device_ctx(GpuSystem *s, const GpuDevice *d);
/* The calling thread's current context, to put back after work on a device: a library
 * (libepd) leaves its caller's current device (torch's) as it found it. */
typedef struct GpuCtxSaved {
        CUcontext ctx;
        bool valid;
} GpuCtxSaved;
GpuCtxSaved gpu_ctx_save(GpuSystem *s);
void gpu_ctx_restore(GpuSystem *s, const GpuCtxSaved *saved);
bool gpu_system_can_access_peer(const GpuSystem *s, int from, int to);

/* Writes a human-readable table of devices and the peer matrix ("epdctl gpus"),
 * returns a malloc'ed string. Pure over the probed data. */
int gpu_system_format(const GpuSystem *s, char **ret);
