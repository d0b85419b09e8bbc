/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The CUDA transport: moves bytes between regions of this host where at least one side
 * is GPU memory, through gpu/copy.h (copy engine, peer access, pinned host memory).
 * Host ↔ host writes belong to the local transport and are refused here (-EINVAL).
 *
 * GPU regions must be arenas the GPU domain knows (daemon arenas and registered
 * external memory), found by their device base through the lookup the domain hands
 * to cuda_transport_new(): each registered region holds a
 * reference on its GpuArena, and every batch in flight holds references on the arenas
 * it touches, so an arena cannot be unmapped under a copy. Host regions are pinned with
 * cuMemHostRegister while registered. `peer` must be NULL (same host only). */

#include "transport/transport.h"

typedef struct GpuArena GpuArena;
typedef struct GpuCopyEngine GpuCopyEngine;
typedef struct GpuSystem GpuSystem;

/* The GPU arena whose mapping starts at device_base, or NULL. */
typedef GpuArena *(*CudaArenaLookup)(void *userdata, uint64_t device_base);

/* A finished batch completes once per cookie (however the cookies alternate) for up to
 * this many distinct cookies; past that, once per run of equal cookies. */
#define CUDA_COOKIES_MERGED 16

int cuda_transport_new(GpuSystem *system, CudaArenaLookup lookup, void *userdata, Transport **ret);
/* The engine under the transport (for its stats and kernel-batching policy). */
GpuCopyEngine *cuda_transport_engine(Transport *t);
/* The parts a batch goes to the engine in: `first` writes, then twice as many each
 * time up to `max` (both clamped to 1..65536; by default 256 and 4096). For
 * benchmarks comparing the part sizes. */
void cuda_transport_set_parts(Transport *t, size_t first, size_t max);
