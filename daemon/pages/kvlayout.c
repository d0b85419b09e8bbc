/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/kvlayout.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "macro.h"

static const struct {
        const char *name;
        size_t size;
} dtypes[] = {
        { "float32", 4 },        { "float16", 2 },       { "bfloat16", 2 },
        { "float8_e4m3fn", 1 },  { "float8_e4m3fnuz", 1 }, { "float8_e5m2", 1 },
        { "float8_e5m2fnuz", 1 }, { "int8", 1 },         { "uint8", 1 },
        { "fp8", 1 },            { "fp8_e4m3", 1 },      { "fp8_e5m2", 1 },
        /* Short names that engines use in their configs. */
        { "fp32", 4 },           { "fp16", 2 },          { "bf16", 2 },
        { "half", 2 },           { "float", 4 },
};

size_t kv_dtype_size(const char *dtype) {
        if (!dtype)
                return 0;
        for (size_t i = 0; i < ELEMENTSOF(dtypes); i++)
                if (strcmp(dtypes[i].name, dtype) == 0)
                        return dtypes[i].size;
        return 0;
}

static int fail(const char **error_text, const char *text, int r) {
        if (error_text)
                *error_text = text;
        return r;
}

int kv_layout_validate(const KvLayout *l, const char **error_text) {
        if (!l)
                return fail(error_text, "no layout", -EINVAL);
        if (l->layers == 0 || l->layers > KV_LAYERS_MAX)
                return fail(error_text, "layers must be between 1 and 4096", -EINVAL);
        if (l->tokens_per_block == 0 || l->tokens_per_block > KV_TOKENS_PER_BLOCK_MAX)
                return fail(error_text, "tokens per block must be between 1 and 65536", -EINVAL);
        if (l->k_bytes_per_token_per_layer == 0 || l->v_bytes_per_token_per_layer > KV_BYTES_PER_TOKEN_MAX ||
            l->k_bytes_per_token_per_layer > KV_BYTES_PER_TOKEN_MAX)
                /* V may be 0: MLA-style models keep one latent per token (K only). */
                return fail(error_text, "K bytes per token per layer must be between 1 and 16 MiB, V at most 16 MiB",
                            -EINVAL);
        if (memchr(l->dtype, 0, sizeof l->dtype) == NULL)
                return fail(error_text, "dtype name too long", -EINVAL);
        size_t es = kv_dtype_size(l->dtype);
        if (es == 0)
                return fail(error_text, "unknown dtype (expected float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8, uint8, ...)",
                            -EINVAL);
        if (l->k_bytes_per_token_per_layer % es != 0 || l->v_bytes_per_token_per_layer % es != 0)
                return fail(error_text, "bytes per token are not a multiple of the dtype's size", -EINVAL);

        uint64_t kv, layer_bytes, stride, page;
        if (ADD_OVERFLOW(l->k_bytes_per_token_per_layer, l->v_bytes_per_token_per_layer, &kv) ||
            MUL_OVERFLOW(kv, (uint64_t)l->tokens_per_block, &layer_bytes) ||
            ADD_OVERFLOW(layer_bytes, (uint64_t)KV_LAYER_ALIGN - 1, &stride) ||
            MUL_OVERFLOW(stride / KV_LAYER_ALIGN * KV_LAYER_ALIGN, (uint64_t)l->layers, &page) ||
            page > KV_PAGE_SIZE_MAX)
                return fail(error_text, "page size (layers x tokens per block x bytes per token) exceeds 1 GiB", -ERANGE);
        return 0;
}

int kv_layout_init(KvLayout *ret, uint32_t layers, uint32_t tokens_per_block,
                   uint64_t k_bytes_per_token_per_layer, uint64_t v_bytes_per_token_per_layer,
                   const char *dtype, const char **error_text) {
        KvLayout l = {
                .layers = layers,
                .tokens_per_block = tokens_per_block,
                .k_bytes_per_token_per_layer = k_bytes_per_token_per_layer,
                .v_bytes_per_token_per_layer = v_bytes_per_token_per_layer,
        };
        int r;

        if (!ret)
                return -EINVAL;
        if (!dtype || strlen(dtype) >= sizeof l.dtype)
                return fail(error_text, "dtype name missing or too long", -EINVAL);
        strcpy(l.dtype, dtype);

        r = kv_layout_validate(&l, error_text);
        if (r < 0)
                return r;

        /* No overflow: checked by kv_layout_validate(). */
        l.layer_bytes = (k_bytes_per_token_per_layer + v_bytes_per_token_per_layer) * tokens_per_block;
        l.layer_stride = ALIGN_TO(l.layer_bytes, (uint64_t)KV_LAYER_ALIGN);
        l.page_size = l.layer_stride * layers;
        *ret = l;
        return 0;
}

bool kv_layout_equal(const KvLayout *a, const KvLayout *b) {
        if (!a || !b)
                return a == b;
        return a->layers == b->layers && a->tokens_per_block == b->tokens_per_block &&
               a->k_bytes_per_token_per_layer == b->k_bytes_per_token_per_layer &&
               a->v_bytes_per_token_per_layer == b->v_bytes_per_token_per_layer &&
               strncmp(a->dtype, b->dtype, sizeof a->dtype) == 0;
}

int kv_layout_layer_range(const KvLayout *l, uint32_t layer, uint64_t *offset, uint64_t *len) {
        return kv_layout_group_range(l, layer, 1, offset, len);
}

int kv_layout_layer_kv(const KvLayout *l, uint32_t layer, uint64_t *k_offset, uint64_t *k_len,
                       uint64_t *v_offset, uint64_t *v_len) {
        uint64_t off, len;
        int r;

        r = kv_layout_layer_range(l, layer, &off, &len);
        if (r < 0)
                return r;
        uint64_t kl = l->k_bytes_per_token_per_layer * l->tokens_per_block;
        if (k_offset)
                *k_offset = off;
        if (k_len)
                *k_len = kl;
        if (v_offset)
                *v_offset = off + kl;
        if (v_len)
                *v_len = len - kl;
        return 0;
}

int kv_layout_group_range(const KvLayout *l, uint32_t first_layer, uint32_t n_layers,
                          uint64_t *offset, uint64_t *len) {
        if (!l || l->page_size == 0 || n_layers == 0 || first_layer >= l->layers ||
            n_layers > l->layers - first_layer)
                return -EINVAL;
        if (offset)
                *offset = (uint64_t)first_layer * l->layer_stride;
        if (len)
                *len = (uint64_t)(n_layers - 1) * l->layer_stride + l->layer_bytes;
        return 0;
}

int kv_layout_group_ranges(const KvLayout *l, uint32_t first_layer, uint32_t n_layers,
                           const uint64_t *page_offsets, size_t n_pages, KvRange *ret) {
        uint64_t off, len;
        size_t n = 0;
        int r;

        r = kv_layout_group_range(l, first_layer, n_layers, &off, &len);
        if (r < 0)
                return r;
        if (n_pages > 0 && (!page_offsets || !ret))
                return -EINVAL;
        if (n_pages > INT32_MAX)
                return -ERANGE;

        for (size_t i = 0; i < n_pages; i++) {
                uint64_t start, end;
                if (ADD_OVERFLOW(page_offsets[i], off, &start) || ADD_OVERFLOW(start, len, &end))
                        return -ERANGE;
                if (n > 0 && ret[n - 1].offset + ret[n - 1].length == start)
                        ret[n - 1].length += len;
                else
                        ret[n++] = (KvRange){ .offset = start, .length = len };
        }
        return (int)n;
}

char *kv_layout_to_string(const KvLayout *l, char *buf, size_t size) {
        if (!buf || size == 0)
                return buf;
        if (!l) {
                snprintf(buf, size, "(none)");
                return buf;
        }
        snprintf(buf, size, "%" PRIu32 " layers x %" PRIu32 " tokens, k=%" PRIu64 " v=%" PRIu64 " %s, page=%" PRIu64,
                 l->layers, l->tokens_per_block, l->k_bytes_per_token_per_layer,
                 l->v_bytes_per_token_per_layer, l->dtype, l->page_size);
        return buf;
}
