/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* One layer's K and V between a worker's cache tensors and KV pages, in one step: the
 * batched scatter (tensor → pages, the prefill's save of a layer) and gather (pages →
 * tensor, the decode's load of a layer).
 *
 * The tensors are (1, H, S, D) attention-cache tensors whose last dimension is
 * contiguous: one "row" of row_bytes (D × element size) per head and token, head h's row
 * of token s at h × head_stride + s × token_stride (bytes). (H, S, D) contiguous is
 * head_stride S × row_bytes, token_stride row_bytes (the default, both 0); the
 * (B, S, H, D) memory of a projection seen as (B, H, S, D) is head_stride row_bytes,
 * token_stride H × row_bytes. A page holds every
 * layer (docs/pages.md); in it, the layer's K rows start at k_offset and its V rows at
 * v_offset, token-major: the row of token t (the page's t-th) and head h at
 * ((t × H) + h) × row_bytes, as vLLM's (block, token, head, dim) cache blocks are.
 * Token s of the sequence is row s mod T of page s / T (T tokens per page); the last
 * page may be partly used.
 *
 * On a GPU the copy is one kernel launch for K and V together (pack.cu: epd_kv_rows),
 * reading the page table from device memory; without the kernels (a build without
 * nvcc, or the stand-in driver of the tests) the rows are copied one by one with the
 * copy engine. On host memory, gpu_kv_rows_copy_host() is the same copy and the
 * reference the GPU paths are checked against. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pack.h"

typedef struct GpuKvRows {
        uint64_t k, v;               /* the tensors' addresses */
        uint64_t tokens;             /* S: tokens [0, S) */
        uint32_t heads;              /* H */
        uint32_t tokens_per_page;    /* T */
        uint64_t row_bytes;          /* D × element size */
        uint64_t k_offset, v_offset; /* the layer's K and V rows in a page */
        uint64_t head_stride;        /* bytes between heads in the tensors; 0: tokens × row_bytes */
        uint64_t token_stride;       /* bytes between tokens; 0: row_bytes */
} GpuKvRows;

typedef enum GpuKvDirection {
        GPU_KV_TO_PAGES,   /* scatter: tensors → pages */
        GPU_KV_FROM_PAGES, /* gather: pages → tensors */
} GpuKvDirection;

/* Pages needed for r's tokens. */
uint64_t gpu_kv_rows_pages(const GpuKvRows *r);
/* Whether r fits n_pages pages of page_size bytes (every row inside its page, no
 * overflow, K and V apart): 0, or -EINVAL / -ERANGE / -EOVERFLOW. Pure. */
int gpu_kv_rows_check(const GpuKvRows *r, size_t n_pages, uint64_t page_size);
/* Rows are whole 16-byte words at 16-byte aligned addresses (the kernel's fast path). */
bool gpu_kv_rows_aligned(const GpuKvRows *r, const uint64_t *pages, size_t n_pages);

/* The row copies as (src, dst, len) chunks, K then V, head by head, token by token:
 * 2 × H × S of them. Returns how many were written (at most max). Pure. */
size_t gpu_kv_rows_chunks(const GpuKvRows *r, const uint64_t *pages, GpuKvDirection d, GpuChunk *out,
                          size_t max);

/* The copy on memory this process can address (host arenas; the stand-in driver's
 * "device" memory). pages[i]: page i's address. */
void gpu_kv_rows_copy_host(const GpuKvRows *r, const uint64_t *pages, GpuKvDirection d);

/* Whether rows[0..n) can go in one launch of the several-layer kernel: the same tensor
 * shape and strides, row size and tokens per page (the layers of one model), each
 * aligned as gpu_kv_rows_aligned() asks. Pure. */
bool gpu_kv_rows_uniform(const GpuKvRows *rows, size_t n, const uint64_t *pages, size_t n_pages);
/* The launch parameters for rows[0..n) (n <= GPU_KV_LAYERS_MAX, uniform). Pure. */
void gpu_kv_layers_params(const GpuKvRows *rows, size_t n, GpuKvDirection d, GpuKvLayers *ret);

/* On the GPU, on `stream` (the device's context current): one launch when the kernels
 * are loaded (k non-NULL) and the rows are aligned, else one copy-engine copy per row.
 * pages_dev: the page table (n_pages addresses) in device memory; pages: the same on the
 * host. */
int gpu_kv_rows_copy(GpuSystem *s, GpuKernels *k, CUstream stream, CUdeviceptr pages_dev, const uint64_t *pages,
                     size_t n_pages, const GpuKvRows *r, GpuKvDirection d);
/* n layers (each already checked with gpu_kv_rows_check()): one launch for up to
 * GPU_KV_LAYERS_MAX uniform layers when the kernels are loaded, else
 * gpu_kv_rows_copy() layer by layer. */
int gpu_kv_rows_copy_many(GpuSystem *s, GpuKernels *k, CUstream stream, CUdeviceptr pages_dev, const uint64_t *pages,
                          size_t n_pages, const GpuKvRows *rows, size_t n, GpuKvDirection d);
