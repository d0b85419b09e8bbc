/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Pack/unpack and batched chunk copies on the GPU (kernels in pack.cu, built by nvcc
 * into a fatbin embedded in the binary and loaded with cuModuleLoadData).
 *
 * A chunk is (src, dst, len) in device addresses. Pack gathers one layer group of a
 * list of pages into a contiguous staging buffer (for transports that want contiguous
 * bytes: TCP, RDMA); unpack scatters it back. The planning of chunks is pure and
 * unit-tested; the launch needs a GPU. Built without nvcc, gpu_kernels_load() returns
 * -EOPNOTSUPP and callers use the copy engine alone. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "system.h"

/* Same layout as EpdChunk in pack.cu. */
typedef struct GpuChunk {
        uint64_t src;
        uint64_t dst;
        uint64_t len;
} GpuChunk;

/* The most chunks one launch takes (the descriptor buffer's size). */
#define GPU_CHUNKS_MAX 65536U

/* Pure planning. Page i's group lives at page_base + page_offsets[i] + group_offset and
 * is group_bytes long; the staging buffer holds them back to back in page order.
 * Fills out[n_pages]; returns 0 or -EINVAL/-ERANGE (overflow). */
int gpu_pack_plan(uint64_t page_base, const uint64_t *page_offsets, size_t n_pages,
                  uint64_t group_offset, uint64_t group_bytes, uint64_t staging,
                  GpuChunk *out);
/* The same chunks with src and dst swapped (staging → pages). */
void gpu_chunks_reverse(GpuChunk *c, size_t n);
/* Merges neighbours that are contiguous on both sides, drops empty chunks; returns the
 * new count. Order is kept. */
size_t gpu_chunks_coalesce(GpuChunk *c, size_t n);
/* Sum of lengths (saturating). */
uint64_t gpu_chunks_bytes(const GpuChunk *c, size_t n);

/* The bytes of a chunk one block of the copy kernel moves. 16 KiB measured best on the
 * H200 (bench/gpu/kernel-study.cu: 0.92-0.95 of a raw copy for scattered 2 MiB and
 * 256 KiB pieces, against 0.90-0.92 with 64 KiB and 256 KiB tiles). */
#define GPU_CHUNK_TILE (16U << 10)

/* Whether n chunks all have one length and 16-byte aligned addresses (the uniform
 * kernel's case). Pure. */
bool gpu_chunks_uniform(const GpuChunk *c, size_t n);

/* Launch geometry for n chunks of at most max_len bytes on a device with `sms`
 * multiprocessors: a block per tile of a chunk. Pure. */
void gpu_chunks_grid(size_t n, uint64_t max_len, int sms, unsigned *grid_x, unsigned *grid_y);

/* The fatbin embedded at build time (size 0 when built without nvcc). Hidden: libepd.so
 * holds its own copy, and a program linking both must not have one interpose the other. */
extern const unsigned char epd_pack_fatbin[] __attribute__((visibility("hidden")));
extern const size_t epd_pack_fatbin_size __attribute__((visibility("hidden")));

typedef struct GpuKernels {
        GpuSystem *system;
        int ordinal;
        int sms;
        CUmodule module;
        CUfunction copy_chunks;
        CUfunction copy_uniform; /* chunks of one length, aligned */
        CUfunction kv_rows;     /* kvcopy.h */
        CUfunction kv_layers;   /* kvcopy.h: several layers a launch */
        bool uniform;           /* equal aligned chunks: the persistent kernel (off: 2-D grid) */
} GpuKernels;

int gpu_kernels_load(GpuSystem *s, int ordinal, GpuKernels **ret);
GpuKernels *gpu_kernels_free(GpuKernels *k);
DEFINE_TRIVIAL_CLEANUP_FUNC(GpuKernels *, gpu_kernels_free);

/* Enqueues one batched copy on `stream`: copies the n descriptors from `host_desc`
 * (pinned host memory, left untouched until the launch completes) to `dev_desc` (device
 * memory of at least n * sizeof(GpuChunk), not reused before then either) and launches.
 * The device's context must be current. n <= GPU_CHUNKS_MAX. */
int gpu_kernels_copy_chunks(GpuKernels *k, CUstream stream, const GpuChunk *host_desc,
                            CUdeviceptr dev_desc, size_t n);
/* The same, told the longest chunk's length (the launch's shape) by a caller that saw
 * every chunk already, instead of another pass over them. */
int gpu_kernels_copy_chunks_sized(GpuKernels *k, CUstream stream, const GpuChunk *host_desc,
                                  CUdeviceptr dev_desc, size_t n, uint64_t max_len);
/* The launch alone, on descriptors already in dev_desc (host_desc: the same, read for
 * the launch's shape): for a caller that uploads them on a stream of its own, ahead of
 * the kernel that comes before on `stream`, and makes `stream` wait for the upload. */
int gpu_kernels_launch_chunks(GpuKernels *k, CUstream stream, const GpuChunk *host_desc, CUdeviceptr dev_desc,
                              size_t n, uint64_t max_len);

/* The layer table of one epd_kv_layers launch, passed by value as its parameter
 * (pack.cu: EpdKvLayers, the same layout): 2 KiB, inside the 4 KiB every CUDA version
 * takes for a kernel's parameters. */
#define GPU_KV_LAYERS_MAX 64
typedef struct GpuKvLayer {
        uint64_t k, v, k_offset, v_offset;
} GpuKvLayer;
typedef struct GpuKvLayers {
        uint64_t tokens, head_words, token_words;
        uint32_t heads, words_per_row, tokens_per_page, n_layers;
        int32_t to_pages;
        uint32_t pad;
        GpuKvLayer layer[GPU_KV_LAYERS_MAX];
} GpuKvLayers;

/* The grid of epd_kv_rows / epd_kv_layers (pack.cu: kv_rows_copy): one block per page the
 * tokens use (*gx), per K or V and head (*gy; the layers are z), *bx threads covering
 * one page's rows of a head (T × words_per_row words, a multiple of 32 up to 256), so a
 * thread moves one word, or a few when a page holds more. -EINVAL for what the kernel's
 * 32-bit index arithmetic or the grid's limits cannot take, -E2BIG for too many pages. */
int gpu_kv_grid(uint64_t tokens, uint32_t heads, uint64_t words_per_row, uint32_t tokens_per_page, unsigned *gx,
                unsigned *gy, unsigned *bx);

/* Launches epd_kv_layers on `stream`: p->n_layers (1..GPU_KV_LAYERS_MAX) layers of
 * p's common geometry. */
int gpu_kernels_kv_layers(GpuKernels *k, CUstream stream, CUdeviceptr pages, const GpuKvLayers *p);

/* Launches epd_kv_rows on `stream` (kvcopy.h: rows of words_per_row 16-byte words, 16-byte
 * aligned). */
int gpu_kernels_kv_rows(GpuKernels *k, CUstream stream, CUdeviceptr pages, uint64_t k_rows, uint64_t v_rows,
                        uint64_t tokens, uint32_t heads, uint64_t words_per_row, uint32_t tokens_per_page,
                        uint64_t k_offset, uint64_t v_offset, uint64_t head_words, uint64_t token_words,
                        bool to_pages);
