/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The KV layer copies (gpu/kvcopy.h) on host memory: a layer's K and V land in the
 * pages exactly where the page layout puts them (token-major rows, the last page partly
 * used), whatever the tensors' strides, and the gather gives back what was scattered;
 * the chunk list describes the same copies; bad shapes are refused. The GPU kernel is
 * checked against the same host copy on the GPU machine (bench/gpu/gpu-device-test). */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../check-main.h"
#include "kvcopy.h"
#include "macro.h"

#define H 3
#define D 8 /* elements of 2 bytes: 16-byte rows */
#define T 4
#define LAYERS 2
#define ROW (D * 2)
/* A page: per layer a K block and a V block of T × H rows. */
#define LAYER_STRIDE 384
#define PAGE (LAYERS * LAYER_STRIDE)

static uint16_t value(unsigned kv, unsigned layer, unsigned h, unsigned s, unsigned d) {
        return (uint16_t)(kv << 15 | layer << 13 | h << 10 | s << 4 | d);
}

/* (H, S, D) tensors, or with transposed memory (S, H, D). */
static void fill(uint16_t *t, unsigned kv, unsigned layer, unsigned S, bool token_major) {
        for (unsigned h = 0; h < H; h++)
                for (unsigned s = 0; s < S; s++)
                        for (unsigned d = 0; d < D; d++)
                                t[(token_major ? (s * H + h) : (h * S + s)) * D + d] = value(kv, layer, h, s, d);
}

static GpuKvRows rows_of(uint16_t *k, uint16_t *v, unsigned layer, unsigned S, bool token_major) {
        return (GpuKvRows){
                .k = (uintptr_t)k, .v = (uintptr_t)v, .tokens = S, .heads = H, .tokens_per_page = T,
                .row_bytes = ROW, .k_offset = layer * LAYER_STRIDE, .v_offset = layer * LAYER_STRIDE + T * H * ROW,
                .head_stride = token_major ? ROW : 0, .token_stride = token_major ? H * ROW : 0,
        };
}

/* Every element where the page layout says it is. */
static void check_pages(uint8_t *arena, const unsigned *page_ids, unsigned layer, unsigned S) {
        for (unsigned kv = 0; kv < 2; kv++)
                for (unsigned s = 0; s < S; s++)
                        for (unsigned h = 0; h < H; h++)
                                for (unsigned d = 0; d < D; d++) {
                                        uint8_t *page = arena + (size_t)page_ids[s / T] * PAGE;
                                        size_t off = layer * LAYER_STRIDE + (kv ? T * H * ROW : 0) +
                                                     ((s % T) * H + h) * ROW + d * 2;
                                        uint16_t x;
                                        memcpy(&x, page + off, 2);
                                        ck_assert_uint_eq(x, value(kv, layer, h, s, d));
                                }
}

static void round_trip(bool token_major) {
        /* 10 tokens: 3 pages, the last holding 2; pages out of order in the arena. */
        const unsigned S = 10, page_ids[] = { 5, 1, 3 };
        uint8_t *arena = aligned_alloc(64, 8 * PAGE);
        uint64_t pages[3];
        uint16_t k[H * 10 * D], v[H * 10 * D], k2[H * 10 * D], v2[H * 10 * D];

        ck_assert_ptr_nonnull(arena);
        memset(arena, 0xee, 8 * PAGE);
        for (unsigned i = 0; i < 3; i++)
                pages[i] = (uintptr_t)(arena + (size_t)page_ids[i] * PAGE);
        for (unsigned layer = 0; layer < LAYERS; layer++) {
                fill(k, 0, layer, S, token_major);
                fill(v, 1, layer, S, token_major);
                GpuKvRows r = rows_of(k, v, layer, S, token_major);
                ck_assert_int_eq(gpu_kv_rows_check(&r, 3, PAGE), 0);
                ck_assert(gpu_kv_rows_aligned(&r, pages, 3));
                gpu_kv_rows_copy_host(&r, pages, GPU_KV_TO_PAGES);
                check_pages(arena, page_ids, layer, S);
        }
        /* Pages no token uses are untouched; so is the last page past its 2 tokens. */
        for (size_t i = 0; i < PAGE; i++)
                ck_assert_uint_eq(arena[0 * PAGE + i], 0xee);
        ck_assert_uint_eq(arena[3 * PAGE + 2 * H * ROW], 0xee);
        /* Gather gives the tensors back. */
        for (unsigned layer = 0; layer < LAYERS; layer++) {
                fill(k, 0, layer, S, token_major);
                fill(v, 1, layer, S, token_major);
                memset(k2, 0, sizeof k2);
                memset(v2, 0, sizeof v2);
                GpuKvRows r = rows_of(k2, v2, layer, S, token_major);
                gpu_kv_rows_copy_host(&r, pages, GPU_KV_FROM_PAGES);
                ck_assert_mem_eq(k2, k, sizeof k);
                ck_assert_mem_eq(v2, v, sizeof v);
        }
        free(arena);
}

START_TEST(test_heads_major) {
        round_trip(false);
}
END_TEST

START_TEST(test_tokens_major) {
        round_trip(true);
}
END_TEST

START_TEST(test_chunks_are_the_same_copies) {
        const unsigned S = 7;
        uint8_t *a = aligned_alloc(64, 4 * PAGE), *b = aligned_alloc(64, 4 * PAGE);
        uint16_t k[H * 7 * D], v[H * 7 * D];
        GpuChunk c[2 * H * 7];
        uint64_t pa[2], pb[2];

        memset(a, 0, 4 * PAGE);
        memset(b, 0, 4 * PAGE);
        pa[0] = (uintptr_t)(a + 2 * PAGE), pa[1] = (uintptr_t)a;
        pb[0] = (uintptr_t)(b + 2 * PAGE), pb[1] = (uintptr_t)b;
        fill(k, 0, 1, S, false);
        fill(v, 1, 1, S, false);
        GpuKvRows r = rows_of(k, v, 1, S, false);
        gpu_kv_rows_copy_host(&r, pa, GPU_KV_TO_PAGES);
        size_t n = gpu_kv_rows_chunks(&r, pb, GPU_KV_TO_PAGES, c, ELEMENTSOF(c));
        ck_assert_uint_eq(n, 2 * H * S);
        for (size_t i = 0; i < n; i++) {
                ck_assert_uint_eq(c[i].len, ROW);
                memcpy((void *)(uintptr_t)c[i].dst, (const void *)(uintptr_t)c[i].src, c[i].len);
        }
        ck_assert_mem_eq(a, b, 4 * PAGE);
        /* A short buffer: at most max chunks. */
        ck_assert_uint_eq(gpu_kv_rows_chunks(&r, pb, GPU_KV_TO_PAGES, c, 5), 5);
        free(a);
        free(b);
}
END_TEST

START_TEST(test_bad_shapes_are_refused) {
        uint16_t k[64], v[64];
        GpuKvRows r = rows_of(k, v, 0, 9, false);

        ck_assert_int_eq(gpu_kv_rows_check(&r, 3, PAGE), 0);
        ck_assert_int_eq(gpu_kv_rows_check(&r, 2, PAGE), -ERANGE); /* 9 tokens need 3 pages */
        ck_assert_int_eq(gpu_kv_rows_check(&r, 3, LAYER_STRIDE - 1), -ERANGE);
        GpuKvRows x = r;
        x.v_offset = x.k_offset + ROW; /* V over K */
        ck_assert_int_eq(gpu_kv_rows_check(&x, 3, PAGE), -EINVAL);
        x = r;
        x.tokens = 0;
        ck_assert_int_eq(gpu_kv_rows_check(&x, 3, PAGE), -EINVAL);
        x = r;
        x.token_stride = ROW / 2; /* rows overlap */
        ck_assert_int_eq(gpu_kv_rows_check(&x, 3, PAGE), -EINVAL);
        x = r;
        x.k = UINT64_MAX - 8;
        ck_assert_int_eq(gpu_kv_rows_check(&x, 3, PAGE), -EOVERFLOW);
        x = r;
        x.row_bytes = 24; /* not whole 16-byte words: no kernel */
        uint64_t pages[3] = { 0, PAGE, 2 * PAGE };
        ck_assert(!gpu_kv_rows_aligned(&x, pages, 3));
        ck_assert_uint_eq(gpu_kv_rows_pages(&r), 3);
        /* A token count whose page count would wrap in tokens + T - 1. */
        x = r;
        x.tokens = UINT64_MAX - 1;
        ck_assert_uint_eq(gpu_kv_rows_pages(&x),
                          (uint64_t)(((unsigned __int128)x.tokens + x.tokens_per_page - 1) / x.tokens_per_page));
        ck_assert_int_eq(gpu_kv_rows_check(&x, 3, PAGE), -ERANGE);
}
END_TEST

/* What epd_kv_layers (pack.cu: kv_rows_copy) does with its parameters, block by block
 * and thread by thread of the grid gpu_kv_grid() gives it, on the host: the launcher's
 * grid and the parameters gpu_kv_layers_params() makes must put every row where the
 * one-layer copy does. (The kernel itself is checked against the host copy on a GPU:
 * gpu-device-test.) */
static void emulate_kv_layers(const uint64_t *pages, const GpuKvLayers *p) {
        unsigned gx, gy, bx;
        ck_assert_int_eq(gpu_kv_grid(p->tokens, p->heads, p->words_per_row, p->tokens_per_page, &gx, &gy, &bx), 0);
        ck_assert_uint_eq(gx, DIV_ROUND_UP(p->tokens, (uint64_t)p->tokens_per_page));
        ck_assert_uint_eq(gy, 2 * p->heads);
        ck_assert(bx > 0 && bx <= 256 && bx % 32 == 0);
        for (unsigned z = 0; z < p->n_layers; z++)
                for (unsigned y = 0; y < gy; y++)
                        for (unsigned x = 0; x < gx; x++)
                                for (unsigned thread = 0; thread < bx; thread++) {
                                        const GpuKvLayer *l = &p->layer[z];
                                        const unsigned kv = y / p->heads, h = y - kv * p->heads;
                                        const uint64_t first = (uint64_t)x * p->tokens_per_page;
                                        if (first >= p->tokens)
                                                continue;
                                        const uint64_t left = p->tokens - first;
                                        const unsigned n_tok = left < p->tokens_per_page ? (unsigned)left
                                                                                           : p->tokens_per_page;
                                        const unsigned n = n_tok * p->words_per_row,
                                                       page_token = p->heads * p->words_per_row;
                                        uint8_t *page = (uint8_t *)(uintptr_t)(pages[x] +
                                                                               (kv ? l->v_offset : l->k_offset)) +
                                                        (uint64_t)h * p->words_per_row * 16;
                                        uint8_t *tensor = (uint8_t *)(uintptr_t)(kv ? l->v : l->k) +
                                                          ((uint64_t)h * p->head_words + first * p->token_words) * 16;
                                        for (unsigned i = thread; i < n; i += bx) {
                                                const unsigned t = i / p->words_per_row, w = i - t * p->words_per_row;
                                                uint8_t *pg = page + ((uint64_t)t * page_token + w) * 16;
                                                uint8_t *row = tensor + ((uint64_t)t * p->token_words + w) * 16;
                                                if (p->to_pages)
                                                        memcpy(pg, row, 16);
                                                else
                                                        memcpy(row, pg, 16);
                                        }
                                }
}

/* The grid's limits: what the kernel's 32-bit arithmetic or the launch cannot take. */
START_TEST(test_kv_grid) {
        unsigned gx, gy, bx;
        ck_assert_int_eq(gpu_kv_grid(1400, 8, 16, 16, &gx, &gy, &bx), 0);
        ck_assert_uint_eq(gx, 88); /* 87.5 pages */
        ck_assert_uint_eq(gy, 16);
        ck_assert_uint_eq(bx, 256); /* 16 tokens × 16 words: one word a thread */
        ck_assert_int_eq(gpu_kv_grid(5, 1, 1, 16, &gx, &gy, &bx), 0);
        ck_assert_uint_eq(bx, 32); /* 16 words: one warp */
        ck_assert_uint_eq(gx, 1);
        ck_assert_int_eq(gpu_kv_grid(100, 2, 64, 64, &gx, &gy, &bx), 0);
        ck_assert_uint_eq(bx, 256); /* 4096 words a page: 16 a thread */
        ck_assert_int_eq(gpu_kv_grid(0, 8, 16, 16, &gx, &gy, &bx), -EINVAL);
        ck_assert_int_eq(gpu_kv_grid(16, 0, 16, 16, &gx, &gy, &bx), -EINVAL);
        ck_assert_int_eq(gpu_kv_grid(16, 40000, 16, 16, &gx, &gy, &bx), -EINVAL);
        ck_assert_int_eq(gpu_kv_grid(16, 8, 0, 16, &gx, &gy, &bx), -EINVAL);
        ck_assert_int_eq(gpu_kv_grid(16, 8, 16, 0, &gx, &gy, &bx), -EINVAL);
        ck_assert_int_eq(gpu_kv_grid(16, 8, 1ULL << 30, 16, &gx, &gy, &bx), -EINVAL);
        ck_assert_int_eq(gpu_kv_grid(16ULL << 32, 8, 16, 1, &gx, &gy, &bx), -E2BIG);
        /* A page of nearly 2^32 words: the kernel's 32-bit count, 256 a step, wrapped
         * below the end and never stopped (review). */
        ck_assert_int_eq(gpu_kv_grid(65537, 1, 65535, 65537, &gx, &gy, &bx), -EINVAL);
        ck_assert_int_eq(gpu_kv_grid(16, 1, 1, UINT32_MAX - 256, &gx, &gy, &bx), 0);
        ck_assert_int_eq(gpu_kv_grid(16, 1, 1, UINT32_MAX - 255, &gx, &gy, &bx), -EINVAL);
}
END_TEST

START_TEST(test_layers_in_one_launch) {
        enum { S = 9 }; /* 3 pages, the last one partly used */
        _Alignas(16) static uint16_t k[LAYERS][H * S * D], v[LAYERS][H * S * D], back[2][LAYERS][H * S * D];
        _Alignas(16) static uint8_t arena[5 * PAGE], ref[5 * PAGE];
        const unsigned ids[] = { 4, 0, 2 };
        uint64_t pages[3], ref_pages[3];
        GpuKvRows rows[LAYERS], again[LAYERS];
        GpuKvLayers p;

        for (int tm = 0; tm < 2; tm++) {
                memset(arena, 0, sizeof arena);
                memset(ref, 0, sizeof ref);
                for (unsigned i = 0; i < 3; i++) {
                        pages[i] = (uintptr_t)(arena + ids[i] * PAGE);
                        ref_pages[i] = (uintptr_t)(ref + ids[i] * PAGE);
                }
                for (unsigned l = 0; l < LAYERS; l++) {
                        fill(k[l], 0, l, S, tm);
                        fill(v[l], 1, l, S, tm);
                        rows[l] = rows_of(k[l], v[l], l, S, tm);
                        ck_assert_int_eq(gpu_kv_rows_check(&rows[l], 3, PAGE), 0);
                        gpu_kv_rows_copy_host(&rows[l], ref_pages, GPU_KV_TO_PAGES);
                }
                ck_assert(gpu_kv_rows_uniform(rows, LAYERS, pages, 3));
                /* Scatter: the same bytes as layer by layer. */
                gpu_kv_layers_params(rows, LAYERS, GPU_KV_TO_PAGES, &p);
                ck_assert_uint_eq(p.n_layers, LAYERS);
                ck_assert_uint_eq(p.words_per_row, ROW / 16);
                ck_assert_int_eq(p.to_pages, 1);
                emulate_kv_layers(pages, &p);
                ck_assert_int_eq(memcmp(arena, ref, sizeof arena), 0);
                for (unsigned l = 0; l < LAYERS; l++)
                        check_pages(arena, ids, l, S);
                /* Gather back into fresh tensors of the same layout. */
                for (unsigned l = 0; l < LAYERS; l++) {
                        again[l] = rows_of(back[0][l], back[1][l], l, S, tm);
                        memset(back[0][l], 0, sizeof back[0][l]);
                        memset(back[1][l], 0, sizeof back[1][l]);
                }
                gpu_kv_layers_params(again, LAYERS, GPU_KV_FROM_PAGES, &p);
                ck_assert_int_eq(p.to_pages, 0);
                emulate_kv_layers(pages, &p);
                for (unsigned l = 0; l < LAYERS; l++) {
                        ck_assert_int_eq(memcmp(back[0][l], k[l], sizeof k[l]), 0);
                        ck_assert_int_eq(memcmp(back[1][l], v[l], sizeof v[l]), 0);
                }
        }

        /* Layers of different geometry, or unaligned, go one launch each. */
        GpuKvRows x[2] = { rows[0], rows[1] };
        x[1].tokens = S - 1;
        ck_assert(!gpu_kv_rows_uniform(x, 2, pages, 3));
        x[1] = rows[1];
        x[1].token_stride = x[1].head_stride = 0; /* the other layout (rows are token-major here) */
        ck_assert(!gpu_kv_rows_uniform(x, 2, pages, 3));
        x[1] = rows[1];
        x[1].v += 2;
        ck_assert(!gpu_kv_rows_uniform(x, 2, pages, 3));
        x[1] = rows[1];
        pages[2] += 8;
        ck_assert(!gpu_kv_rows_uniform(x, 2, pages, 3));
        ck_assert(!gpu_kv_rows_uniform(x, 0, pages, 3));
}
END_TEST

static Suite *suite(void) {
        Suite *s = suite_create("kvcopy");
        TCase *tc = tcase_create("kvcopy");
        tcase_add_test(tc, test_heads_major);
        tcase_add_test(tc, test_tokens_major);
        tcase_add_test(tc, test_chunks_are_the_same_copies);
        tcase_add_test(tc, test_bad_shapes_are_refused);
        tcase_add_test(tc, test_layers_in_one_launch);
        tcase_add_test(tc, test_kv_grid);
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        return check_run(suite(), CK_FORK_GETENV);
}
