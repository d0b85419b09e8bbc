/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* libepd, GPU side: map the daemon's GPU arenas into this process and export this
 * process's own GPU memory for registration. The CUDA driver is loaded at run time;
 * nothing here needs a GPU to link, and every function returns 0 or a negative errno:
 * -ENOENT (no NVIDIA driver) and -ENODEV (no GPU) from epd_gpu_open() mean "no GPU",
 * which epd_gpu_strerror() says in words.
 *
 * A GPU arena arrives as an fd (D-Bus type `h`) with its size and its GPU's PCI bus id;
 * the daemon keeps owning the memory: unmapping, or this process dying, only drops this
 * process's mapping. The device pointer is valid in the device's primary context (the
 * one the CUDA runtime, and so PyTorch, uses). */

#include <stdint.h>

#include "epd/epd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct EpdGpu EpdGpu;
typedef struct EpdGpuMapping EpdGpuMapping;

int epd_gpu_open(EpdGpu **ret);
EpdGpu *epd_gpu_close(EpdGpu *g);
const char *epd_gpu_strerror(int error);

/* This process's ordinal for the GPU with the given PCI bus id ("0000:19:00.0"; case
 * does not matter), which differs from the daemon's under CUDA_VISIBLE_DEVICES; or
 * -ENODEV when this process cannot see that GPU. */
int epd_gpu_ordinal_from_pci_bus_id(EpdGpu *g, const char *pci_bus_id);

/* Maps an arena. `fd` is not consumed. */
int epd_gpu_map(EpdGpu *g, int fd, uint64_t size, int ordinal, EpdGpuMapping **ret);
uint64_t epd_gpu_mapping_device_pointer(const EpdGpuMapping *m);
uint64_t epd_gpu_mapping_size(const EpdGpuMapping *m);
EpdGpuMapping *epd_gpu_unmap(EpdGpuMapping *m);

/* Exports memory this process allocated itself with cuMemCreate and a POSIX-fd handle
 * type, mapped at `device_pointer`, as a new fd (O_CLOEXEC), for registration with the
 * daemon as external memory. The process keeps ownership: the daemon never frees it,
 * and drops its mapping when the registration is released or this process goes. */
int epd_gpu_export(EpdGpu *g, uint64_t device_pointer, int *ret_fd);

/* With a daemon connection (epd.h): */

/* Maps GPU arena i of this worker's registration (epd_arena_get(c, i)->domain "gpu"),
 * on this process's ordinal of the daemon's GPU (found by PCI bus id through
 * org.epd1.Gpu.Gpus). The mapping is the caller's; unmap with epd_gpu_unmap(). */
int epd_gpu_arena_map(epd_client *c, EpdGpu *g, size_t i, EpdGpuMapping **ret);

/* Registers memory this process allocated itself (see epd_gpu_export) on its GPU
 * `ordinal` with the daemon (org.epd1.Gpu.RegisterMemory): the daemon can then copy into
 * and out of it. *ret_region is the daemon's id for it. The process keeps ownership;
 * the registration ends with epd_gpu_release_memory(), UnregisterWorker, or the end of
 * the connection. */
int epd_gpu_register_memory(epd_client *c, EpdGpu *g, int ordinal, uint64_t device_pointer,
                            uint64_t size, uint32_t *ret_region);
int epd_gpu_release_memory(epd_client *c, uint32_t region);

/* The daemon's GPUs (org.epd1.Gpu): count, and the PCI bus id of the daemon's ordinal
 * (copied into buf). */
int epd_gpu_daemon_pci_bus_id(epd_client *c, uint32_t daemon_ordinal, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
