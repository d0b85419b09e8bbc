/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>

#include "log.h"
#include "pack.h"

int gpu_pack_plan(uint64_t page_base, const uint64_t *page_offsets, size_t n_pages,
                  uint64_t group_offset, uint64_t group_bytes, uint64_t staging,
                  GpuChunk *out) {
        if (n_pages > 0 && (!page_offsets || !out))
                return -EINVAL;
        for (size_t i = 0; i < n_pages; i++) {
                uint64_t src, dst, end;

                if (ADD_OVERFLOW(page_base, page_offsets[i], &src) ||
                    ADD_OVERFLOW(src, group_offset, &src) ||
                    ADD_OVERFLOW(src, group_bytes, &end) ||
                    MUL_OVERFLOW((uint64_t)i, group_bytes, &dst) ||
                    ADD_OVERFLOW(dst, staging, &dst) ||
                    ADD_OVERFLOW(dst, group_bytes, &end))
                        return -ERANGE;
                out[i] = (GpuChunk) { .src = src, .dst = dst, .len = group_bytes };
        }
        return 0;
}

void gpu_chunks_reverse(GpuChunk *c, size_t n) {
        for (size_t i = 0; i < n; i++) {
                uint64_t t = c[i].src;
                c[i].src = c[i].dst;
                c[i].dst = t;
        }
}

size_t gpu_chunks_coalesce(GpuChunk *c, size_t n) {
        size_t k = 0;

        for (size_t i = 0; i < n; i++) {
                if (c[i].len == 0)
                        continue;
                if (k > 0 && c[k - 1].src + c[k - 1].len == c[i].src &&
                    c[k - 1].dst + c[k - 1].len == c[i].dst &&
                    c[k - 1].len <= UINT64_MAX - c[i].len) {
                        c[k - 1].len += c[i].len;
                        continue;
                }
                c[k++] = c[i];
        }
        return k;
}

uint64_t gpu_chunks_bytes(const GpuChunk *c, size_t n) {
        uint64_t s = 0;
        for (size_t i = 0; i < n; i++)
                if (ADD_OVERFLOW(s, c[i].len, &s))
                        return UINT64_MAX;
        return s;
}

bool gpu_chunks_uniform(const GpuChunk *c, size_t n) {
        if (n == 0 || c[0].len == 0)
                return false;
        for (size_t i = 0; i < n; i++)
                if (c[i].len != c[0].len || ((c[i].src | c[i].dst | c[i].len) & 15))
                        return false;
        return true;
}

void gpu_chunks_grid(size_t n, uint64_t max_len, int sms, unsigned *grid_x, unsigned *grid_y) {
        /* One block per GPU_CHUNK_TILE of a chunk (x), one row of blocks per chunk (y; the
         * kernel loops over chunks past 65535). sms does not change the shape: tiles are
         * small enough that the blocks spread evenly over any number of SMs. */
        uint64_t gx = DIV_ROUND_UP(MAX(max_len, (uint64_t)1), (uint64_t)GPU_CHUNK_TILE);

        (void)sms;
        *grid_x = (unsigned)CLAMP(gx, (uint64_t)1, (uint64_t)INT32_MAX);
        *grid_y = (unsigned)MIN((uint64_t)MAX(n, (size_t)1), (uint64_t)65535);
}

GpuKernels *gpu_kernels_free(GpuKernels *k) {
        if (!k)
                return NULL;
        if (k->module) {
                (void)gpu_device_make_current(k->system, &k->system->devices[k->ordinal]);
                (void)CU(k->system->driver, cuModuleUnload, k->module);
        }
        gpu_system_unref(k->system);
        free(k);
        return NULL;
}

int gpu_kernels_load(GpuSystem *s, int ordinal, GpuKernels **ret) {
        _cleanup_(gpu_kernels_freep) GpuKernels *k = NULL;
        GpuDevice *g = gpu_system_device(s, ordinal);
        int r, v = 0;

        if (!g)
                return -ENODEV;
        if (epd_pack_fatbin_size == 0)
                return -EOPNOTSUPP; /* built without nvcc */
        r = gpu_device_make_current(s, g);
        if (r < 0)
                return r;
        k = calloc(1, sizeof *k);
        if (!k)
                return -ENOMEM;
        k->system = gpu_system_ref(s);
        k->ordinal = ordinal;
        r = CU(s->driver, cuModuleLoadData, &k->module, epd_pack_fatbin);
        if (r < 0)
                return r;
        r = CU(s->driver, cuModuleGetFunction, &k->copy_chunks, k->module, "epd_copy_chunks");
        if (r >= 0)
                r = CU(s->driver, cuModuleGetFunction, &k->copy_uniform, k->module, "epd_copy_uniform");
        if (r >= 0)
                r = CU(s->driver, cuModuleGetFunction, &k->kv_rows, k->module, "epd_kv_rows");
        if (r >= 0)
                r = CU(s->driver, cuModuleGetFunction, &k->kv_layers, k->module, "epd_kv_layers");
        if (r < 0)
                return r;
        if (CU(s->driver, cuDeviceGetAttribute, &v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
               g->dev) >= 0)
                k->sms = v;
        *ret = TAKE_PTR(k);
        return 0;
}

int gpu_kernels_copy_chunks(GpuKernels *k, CUstream stream, const GpuChunk *chunks,
                            CUdeviceptr desc_buf, size_t n) {
        uint64_t max_len = 0;
        for (size_t i = 0; i < n; i++)
                max_len = MAX(max_len, chunks[i].len);
        return gpu_kernels_copy_chunks_sized(k, stream, chunks, desc_buf, n, max_len);
}

int gpu_kernels_copy_chunks_sized(GpuKernels *k, CUstream stream, const GpuChunk *chunks,
                                  CUdeviceptr desc_buf, size_t n, uint64_t max_len) {
        int r;

        if (n == 0)
                return 0;
        if (n > GPU_CHUNKS_MAX)
                return -E2BIG;
        r = CU(k->system->driver, cuMemcpyHtoDAsync, desc_buf, chunks, n * sizeof *chunks, stream);
        if (r < 0)
                return r;
        return gpu_kernels_launch_chunks(k, stream, chunks, desc_buf, n, max_len);
}

int gpu_kernels_launch_chunks(GpuKernels *k, CUstream stream, const GpuChunk *chunks, CUdeviceptr desc_buf,
                              size_t n, uint64_t max_len) {
        unsigned gx, gy, n32 = (unsigned)n, tile_words = GPU_CHUNK_TILE / 16;
        unsigned long long len_words;

        if (n == 0)
                return 0;
        if (n > GPU_CHUNKS_MAX)
                return -E2BIG;
        if (k->uniform && gpu_chunks_uniform(chunks, n)) {
                /* A persistent grid: about 8 blocks per SM, each looping over tiles. */
                uint64_t tiles = DIV_ROUND_UP(max_len, (uint64_t)256 * 4 * 16) * n;
                void *params[] = { &desc_buf, &n32, &len_words };

                len_words = max_len / 16;
                gx = (unsigned)CLAMP(tiles, (uint64_t)1, (uint64_t)MAX(k->sms, 1) * 8);
                return CU(k->system->driver, cuLaunchKernel, k->copy_uniform, gx, 1, 1, 256, 1, 1, 0,
                          stream, params, NULL);
        }
        void *params[] = { &desc_buf, &n32, &tile_words };
        gpu_chunks_grid(n, max_len, k->sms, &gx, &gy);
        return CU(k->system->driver, cuLaunchKernel, k->copy_chunks, gx, gy, 1, 256, 1, 1, 0,
                  stream, params, NULL);
}

int gpu_kv_grid(uint64_t tokens, uint32_t heads, uint64_t words_per_row, uint32_t tokens_per_page, unsigned *gx,
                unsigned *gy, unsigned *bx) {
        uint64_t pages, words;

        /* The kernel's loop counts a page's words in 32 bits, 256 a step: room for the
         * last step, or it wraps and never ends. */
        if (tokens == 0 || heads == 0 || 2ULL * heads > 65535 || words_per_row == 0 || tokens_per_page == 0 ||
            (uint64_t)tokens_per_page * words_per_row > UINT32_MAX - 256 ||
            (uint64_t)heads * words_per_row > UINT32_MAX)
                return -EINVAL;
        pages = DIV_ROUND_UP(tokens, (uint64_t)tokens_per_page);
        if (pages > INT32_MAX)
                return -E2BIG;
        words = (uint64_t)tokens_per_page * words_per_row;
        *gx = (unsigned)pages;
        *gy = 2 * heads;
        *bx = (unsigned)MIN(DIV_ROUND_UP(words, (uint64_t)32) * 32, (uint64_t)256);
        return 0;
}

int gpu_kernels_kv_rows(GpuKernels *k, CUstream stream, CUdeviceptr pages, uint64_t k_rows, uint64_t v_rows,
                        uint64_t tokens, uint32_t heads, uint64_t words_per_row, uint32_t tokens_per_page,
                        uint64_t k_offset, uint64_t v_offset, uint64_t head_words, uint64_t token_words,
                        bool to_pages) {
        unsigned long long kk = k_rows, vv = v_rows, s = tokens, ko = k_offset, vo = v_offset, hw = head_words,
                           tw = token_words;
        unsigned h = heads, w = (unsigned)words_per_row, t = tokens_per_page, gx, gy, bx;
        int dir = to_pages, r = gpu_kv_grid(tokens, heads, words_per_row, tokens_per_page, &gx, &gy, &bx);
        void *params[] = { &pages, &kk, &vv, &s, &h, &w, &t, &ko, &vo, &hw, &tw, &dir };

        if (r < 0)
                return r;
        return CU(k->system->driver, cuLaunchKernel, k->kv_rows, gx, gy, 1, bx, 1, 1, 0, stream, params, NULL);
}

_Static_assert(sizeof(GpuKvLayers) == 48 + GPU_KV_LAYERS_MAX * sizeof(GpuKvLayer) && sizeof(GpuKvLayers) <= 4096,
               "GpuKvLayers mirrors pack.cu's EpdKvLayers and fits a launch's parameters");

int gpu_kernels_kv_layers(GpuKernels *k, CUstream stream, CUdeviceptr pages, const GpuKvLayers *p) {
        /* The driver copies the parameter at the launch: the caller's table may change as
         * soon as this returns. */
        void *params[] = { &pages, (void *)p };
        unsigned gx, gy, bx;
        int r;

        if (!k->kv_layers)
                return -EOPNOTSUPP;
        if (p->n_layers == 0 || p->n_layers > GPU_KV_LAYERS_MAX)
                return -EINVAL;
        r = gpu_kv_grid(p->tokens, p->heads, p->words_per_row, p->tokens_per_page, &gx, &gy, &bx);
        if (r < 0)
                return r;
        return CU(k->system->driver, cuLaunchKernel, k->kv_layers, gx, gy, p->n_layers, bx, 1, 1, 0, stream, params,
                  NULL);
}
