/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "kvcopy.h"

#include <errno.h>
#include <string.h>

#include "macro.h"

static uint64_t head_stride(const GpuKvRows *r) {
        return r->head_stride ? r->head_stride : r->tokens * r->row_bytes;
}

static uint64_t token_stride(const GpuKvRows *r) {
        return r->token_stride ? r->token_stride : r->row_bytes;
}

uint64_t gpu_kv_rows_pages(const GpuKvRows *r) {
        /* Not DIV_ROUND_UP: tokens + T - 1 wraps for a count near 2^64 (0 pages). */
        return r->tokens_per_page ? r->tokens / r->tokens_per_page + (r->tokens % r->tokens_per_page != 0) : 0;
}

int gpu_kv_rows_check(const GpuKvRows *r, size_t n_pages, uint64_t page_size) {
        uint64_t block, end;

        if (!r || r->tokens == 0 || r->heads == 0 || r->tokens_per_page == 0 || r->row_bytes == 0 || !r->k ||
            !r->v)
                return -EINVAL;
        if (gpu_kv_rows_pages(r) > n_pages)
                return -ERANGE;
        /* One page's K (or V) block: T × H rows. */
        if (MUL_OVERFLOW((uint64_t)r->tokens_per_page * r->heads, r->row_bytes, &block))
                return -EOVERFLOW;
        if (ADD_OVERFLOW(r->k_offset, block, &end) || end > page_size)
                return -ERANGE;
        if (ADD_OVERFLOW(r->v_offset, block, &end) || end > page_size)
                return -ERANGE;
        if (r->k_offset < r->v_offset + block && r->v_offset < r->k_offset + block)
                return -EINVAL; /* K and V overlap */
        /* The tensors: their last row's end. */
        uint64_t last;
        if (r->head_stride && r->head_stride < r->row_bytes)
                return -EINVAL;
        if (r->token_stride && r->token_stride < r->row_bytes)
                return -EINVAL;
        if (MUL_OVERFLOW((uint64_t)(r->heads - 1), head_stride(r), &last) ||
            MUL_OVERFLOW(r->tokens - 1, token_stride(r), &block) || ADD_OVERFLOW(last, block, &last) ||
            ADD_OVERFLOW(last, r->row_bytes, &last) || ADD_OVERFLOW(r->k, last, &end) ||
            ADD_OVERFLOW(r->v, last, &end))
                return -EOVERFLOW;
        return 0;
}

bool gpu_kv_rows_aligned(const GpuKvRows *r, const uint64_t *pages, size_t n_pages) {
        if (((r->k | r->v | r->row_bytes | r->k_offset | r->v_offset | head_stride(r) | token_stride(r)) & 15) != 0)
                return false;
        for (size_t i = 0; i < n_pages; i++)
                if (pages[i] & 15)
                        return false;
        return true;
}

/* Row (kv, h, s): its address in the tensor and in the pages. */
static void row_addresses(const GpuKvRows *r, const uint64_t *pages, unsigned kv, uint32_t h, uint64_t s,
                          uint64_t *ret_tensor, uint64_t *ret_page) {
        uint64_t t = s % r->tokens_per_page;
        *ret_tensor = (kv ? r->v : r->k) + h * head_stride(r) + s * token_stride(r);
        *ret_page = pages[s / r->tokens_per_page] + (kv ? r->v_offset : r->k_offset) +
                    (t * r->heads + h) * r->row_bytes;
}

size_t gpu_kv_rows_chunks(const GpuKvRows *r, const uint64_t *pages, GpuKvDirection d, GpuChunk *out,
                          size_t max) {
        size_t n = 0;
        for (unsigned kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < r->heads; h++)
                        for (uint64_t s = 0; s < r->tokens && n < max; s++) {
                                uint64_t t, p;
                                row_addresses(r, pages, kv, h, s, &t, &p);
                                out[n++] = d == GPU_KV_TO_PAGES ? (GpuChunk){ t, p, r->row_bytes }
                                                                : (GpuChunk){ p, t, r->row_bytes };
                        }
        return n;
}

void gpu_kv_rows_copy_host(const GpuKvRows *r, const uint64_t *pages, GpuKvDirection d) {
        for (unsigned kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < r->heads; h++)
                        for (uint64_t s = 0; s < r->tokens; s++) {
                                uint64_t t, p;
                                row_addresses(r, pages, kv, h, s, &t, &p);
                                if (d == GPU_KV_TO_PAGES)
                                        memcpy((void *)(uintptr_t)p, (const void *)(uintptr_t)t, r->row_bytes);
                                else
                                        memcpy((void *)(uintptr_t)t, (const void *)(uintptr_t)p, r->row_bytes);
                        }
}

int gpu_kv_rows_copy(GpuSystem *s, GpuKernels *k, CUstream stream, CUdeviceptr pages_dev, const uint64_t *pages,
                     size_t n_pages, const GpuKvRows *r, GpuKvDirection d) {
        if (k && k->kv_rows && pages_dev && gpu_kv_rows_aligned(r, pages, n_pages))
                return gpu_kernels_kv_rows(k, stream, pages_dev, r->k, r->v, r->tokens, r->heads,
                                           r->row_bytes / 16, r->tokens_per_page, r->k_offset, r->v_offset,
                                           head_stride(r) / 16, token_stride(r) / 16, d == GPU_KV_TO_PAGES);
        /* Row by row on the copy engine. */
        for (unsigned kv = 0; kv < 2; kv++)
                for (uint32_t h = 0; h < r->heads; h++)
                        for (uint64_t i = 0; i < r->tokens; i++) {
                                uint64_t t, p;
                                row_addresses(r, pages, kv, h, i, &t, &p);
                                int e = d == GPU_KV_TO_PAGES
                                                ? CU(s->driver, cuMemcpyDtoDAsync, p, t, r->row_bytes, stream)
                                                : CU(s->driver, cuMemcpyDtoDAsync, t, p, r->row_bytes, stream);
                                if (e < 0)
                                        return e;
                        }
        return 0;
}

bool gpu_kv_rows_uniform(const GpuKvRows *rows, size_t n, const uint64_t *pages, size_t n_pages) {
        if (n == 0 || !gpu_kv_rows_aligned(&rows[0], pages, n_pages))
                return false;
        for (size_t i = 1; i < n; i++) {
                const GpuKvRows *a = &rows[0], *b = &rows[i];
                if (b->tokens != a->tokens || b->heads != a->heads || b->tokens_per_page != a->tokens_per_page ||
                    b->row_bytes != a->row_bytes || head_stride(b) != head_stride(a) ||
                    token_stride(b) != token_stride(a) ||
                    ((b->k | b->v | b->k_offset | b->v_offset) & 15) != 0)
                        return false;
        }
        return true;
}

void gpu_kv_layers_params(const GpuKvRows *rows, size_t n, GpuKvDirection d, GpuKvLayers *ret) {
        const GpuKvRows *r = &rows[0];

        *ret = (GpuKvLayers){
                .tokens = r->tokens,
                .head_words = head_stride(r) / 16,
                .token_words = token_stride(r) / 16,
                .heads = r->heads,
                .words_per_row = (uint32_t)(r->row_bytes / 16),
                .tokens_per_page = r->tokens_per_page,
                .n_layers = (uint32_t)n,
                .to_pages = d == GPU_KV_TO_PAGES,
        };
        for (size_t i = 0; i < n; i++)
                ret->layer[i] = (GpuKvLayer){ rows[i].k, rows[i].v, rows[i].k_offset, rows[i].v_offset };
}

int gpu_kv_rows_copy_many(GpuSystem *s, GpuKernels *k, CUstream stream, CUdeviceptr pages_dev, const uint64_t *pages,
                          size_t n_pages, const GpuKvRows *rows, size_t n, GpuKvDirection d) {
        if (k && k->kv_layers && pages_dev && n > 1 && rows[0].row_bytes / 16 <= UINT32_MAX &&
            gpu_kv_rows_uniform(rows, n, pages, n_pages)) {
                GpuKvLayers p;
                for (size_t i = 0; i < n; i += GPU_KV_LAYERS_MAX) {
                        gpu_kv_layers_params(rows + i, MIN(n - i, (size_t)GPU_KV_LAYERS_MAX), d, &p);
                        int e = gpu_kernels_kv_layers(k, stream, pages_dev, &p);
                        if (e < 0)
                                return e;
                }
                return 0;
        }
        for (size_t i = 0; i < n; i++) {
                int e = gpu_kv_rows_copy(s, k, stream, pages_dev, pages, n_pages, &rows[i], d);
                if (e < 0)
                        return e;
        }
        return 0;
}
