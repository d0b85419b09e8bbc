/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The KV layout of a model, as a prefill or decode worker describes it when it
 * registers: how many layers, how many tokens one block (page) holds, how many bytes of
 * K and of V one token takes in one layer, and the element type. From it the daemon
 * derives the page size and where, inside a page, the bytes of each layer live.
 *
 * Layout of one page (layer-major within the page; see docs/pages.md):
 *
 *   page ─┬─ layer 0 ─┬─ K: tokens_per_block × k_bytes_per_token_per_layer
 *         │           ├─ V: tokens_per_block × v_bytes_per_token_per_layer
 *         │           └─ padding up to layer_stride (a multiple of KV_LAYER_ALIGN)
 *         ├─ layer 1 ─ ... at 1 × layer_stride
 *         └─ layer L-1 at (L-1) × layer_stride;  page_size = layers × layer_stride
 *
 * So the bytes of a group of consecutive layers are one contiguous range of every page,
 * and a transfer of layer group g of a set of pages is one range per page (merged
 * where pages are adjacent and the group spans whole pages). Pure; unit-tested. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KV_LAYER_ALIGN 256U        /* every layer starts 256-byte aligned in a page */
#define KV_LAYERS_MAX 4096U
#define KV_TOKENS_PER_BLOCK_MAX 65536U
#define KV_BYTES_PER_TOKEN_MAX (UINT64_C(1) << 24) /* per layer, K or V */
#define KV_PAGE_SIZE_MAX (UINT64_C(1) << 30)
/* The smallest page, as for [Arena] PageSize=: the pool keeps 32 bytes of bookkeeping a
 * page (and 4 more through a restart), so pages of a few hundred bytes would cost the
 * daemon an eighth of the arena's size in memory, set up on its loop. */
#define KV_PAGE_SIZE_MIN 4096U
#define KV_DTYPE_MAX 24

typedef struct KvLayout {
        /* Given by the worker. */
        uint32_t layers;
        uint32_t tokens_per_block;
        uint64_t k_bytes_per_token_per_layer;
        uint64_t v_bytes_per_token_per_layer;
        char dtype[KV_DTYPE_MAX]; /* "float16", "bfloat16", "float8_e4m3fn", ... */

        /* Derived by kv_layout_init(). */
        uint64_t layer_bytes;  /* K+V bytes of one layer in one page, without padding */
        uint64_t layer_stride; /* layer_bytes rounded up to KV_LAYER_ALIGN */
        uint64_t page_size;    /* layers × layer_stride */
} KvLayout;

/* One byte range of an arena (offsets from the arena's start). */
typedef struct KvRange {
        uint64_t offset;
        uint64_t length;
} KvRange;

/* Element size of a dtype name, or 0 if the name is unknown. */
size_t kv_dtype_size(const char *dtype);

/* Checks the worker-given fields (not the derived ones). On error returns -EINVAL (or
 * -ERANGE for sizes too large) and points *error_text (if non-NULL) at a static
 * explanation fit for a D-Bus error message. */
int kv_layout_validate(const KvLayout *l, const char **error_text);

/* Fills *ret from the worker-given values, validates them and derives the rest. */
int kv_layout_init(KvLayout *ret, uint32_t layers, uint32_t tokens_per_block,
                   uint64_t k_bytes_per_token_per_layer, uint64_t v_bytes_per_token_per_layer,
                   const char *dtype, const char **error_text);

/* Two workers can exchange pages only if their layouts are equal in every given field. */
bool kv_layout_equal(const KvLayout *a, const KvLayout *b);

/* Where the bytes of one layer live inside a page: [*offset, *offset + *len). *len
 * covers K then V of that layer, without padding. -EINVAL if layer is out of range. */
int kv_layout_layer_range(const KvLayout *l, uint32_t layer, uint64_t *offset, uint64_t *len);

/* The same for K and V separately. */
int kv_layout_layer_kv(const KvLayout *l, uint32_t layer, uint64_t *k_offset, uint64_t *k_len,
                       uint64_t *v_offset, uint64_t *v_len);

/* The in-page range of layers [first_layer, first_layer + n_layers): one contiguous
 * range from the first layer's start to the last layer's last V byte. */
int kv_layout_group_range(const KvLayout *l, uint32_t first_layer, uint32_t n_layers,
                          uint64_t *offset, uint64_t *len);

/* The arena ranges of layer group [first_layer, first_layer + n_layers) for a set of
 * pages, given each page's arena offset (page_offset() of pages.h). Writes at most
 * n_pages ranges into ret[] (which must hold n_pages) and returns how many: adjacent
 * ranges (consecutive pages when the group covers every layer) are merged. Returns
 * -EINVAL for a bad group, -ERANGE on offset overflow. */
int kv_layout_group_ranges(const KvLayout *l, uint32_t first_layer, uint32_t n_layers,
                           const uint64_t *page_offsets, size_t n_pages, KvRange *ret);

/* "32x16 k=256 v=256 bfloat16 page=256KiB" style text for logs and epdctl. */
char *kv_layout_to_string(const KvLayout *l, char *buf, size_t size);
