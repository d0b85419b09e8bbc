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

#ifdef __cplusplus
}
#endif
