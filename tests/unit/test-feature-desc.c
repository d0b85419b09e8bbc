/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/feature-desc.h"
#include "macro.h"
#include "../check-main.h"

/* A Qwen-VL style bundle: image embeddings, three DeepStack layers and grid_thw. */
static FeatureDesc *qwen_bundle(uint64_t *ret_bytes) {
        FeatureDesc *d;
        const uint64_t tokens = 1024, hidden = 3584;
        uint64_t off = 0;

        ck_assert_int_eq(feature_desc_new(5, &d), 0);
        for (int i = 0; i < 4; i++) {
                FeatureTensor *t = &d->tensors[i];
                if (i == 0)
                        snprintf(t->name, sizeof t->name, "image_embeds");
                else
                        snprintf(t->name, sizeof t->name, "deepstack.%d", i - 1);
                t->dtype = FEATURE_DTYPE_BF16;
                t->rank = 2;
                t->shape[0] = tokens;
                t->shape[1] = hidden;
                t->strides[0] = hidden;
                t->strides[1] = 1;
                t->offset = off;
                off += tokens * hidden * 2;
        }
        FeatureTensor *g = &d->tensors[4];
        snprintf(g->name, sizeof g->name, "grid_thw");
        g->dtype = FEATURE_DTYPE_I64;
        g->rank = 2;
        g->shape[0] = 1;
        g->shape[1] = 3;
        g->strides[0] = 3;
        g->strides[1] = 1;
        g->offset = off;
        off += 24;
        *ret_bytes = off;
        return d;
}

START_TEST(test_valid_bundle) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = NULL, *back = NULL;
        _cleanup_(freep) void *bin = NULL;
        FeatureDescIssue issue;
        uint64_t bytes;
        size_t size;

        d = qwen_bundle(&bytes);
        ck_assert_int_eq(feature_desc_validate(d, bytes, &issue), 0);
        ck_assert_int_eq(issue.error, FEATURE_DESC_OK);
        /* one byte short: the last tensor is out of range */
        ck_assert_int_eq(feature_desc_validate(d, bytes - 1, &issue), -EINVAL);
        ck_assert_int_eq(issue.error, FEATURE_DESC_OUT_OF_RANGE);
        ck_assert_int_eq(issue.tensor, 4);

        ck_assert_int_eq(feature_desc_serialize(d, &bin, &size), 0);
        ck_assert_uint_le(size, FEATURE_DESC_BINARY_MAX);
        ck_assert_int_eq(feature_desc_parse(bin, size, bytes, &back, &issue), 0);
        ck_assert_uint_eq(back->n_tensors, d->n_tensors);
        ck_assert_mem_eq(back->tensors, d->tensors, d->n_tensors * sizeof(FeatureTensor));

        /* every truncation is rejected as truncated (never read past the end) */
        for (size_t n = 0; n < size; n++) {
                FeatureDesc *x = NULL;
                ck_assert_int_eq(feature_desc_parse(bin, n, bytes, &x, &issue), -EINVAL);
                ck_assert_ptr_null(x);
                ck_assert_int_eq(issue.error, FEATURE_DESC_TRUNCATED);
        }
}
END_TEST

START_TEST(test_transposed_and_empty) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = NULL;
        FeatureDescIssue issue;
        uint64_t span;

        ck_assert_int_eq(feature_desc_new(3, &d), 0);
        /* a transposed 4×8 f32 view: strides (1, 4) */
        strcpy(d->tensors[0].name, "t");
        d->tensors[0].dtype = FEATURE_DTYPE_F32;
        d->tensors[0].rank = 2;
        d->tensors[0].shape[0] = 4;
        d->tensors[0].shape[1] = 8;
        d->tensors[0].strides[0] = 1;
        d->tensors[0].strides[1] = 4;
        ck_assert_int_eq(feature_tensor_span(&d->tensors[0], &span), 0);
        ck_assert_uint_eq(span, 128);
        /* a tensor with a zero dimension occupies nothing, even where others are */
        strcpy(d->tensors[1].name, "empty");
        d->tensors[1].dtype = FEATURE_DTYPE_F16;
        d->tensors[1].rank = 2;
        d->tensors[1].shape[0] = 0;
        d->tensors[1].shape[1] = 7;
        d->tensors[1].strides[0] = 7;
        d->tensors[1].strides[1] = 1;
        d->tensors[1].offset = 16;
        /* a scalar (rank 0) right after */
        strcpy(d->tensors[2].name, "scale");
        d->tensors[2].dtype = FEATURE_DTYPE_F32;
        d->tensors[2].rank = 0;
        d->tensors[2].offset = 128;
        ck_assert_int_eq(feature_desc_validate(d, 132, &issue), 0);
        /* a gap-strided (padded rows) layout is fine as well */
        d->tensors[0].strides[0] = 10;
        d->tensors[0].strides[1] = 1;
        d->tensors[0].shape[0] = 3;
        d->tensors[0].shape[1] = 8;
        ck_assert_int_eq(feature_desc_validate(d, 132, &issue), 0);
}
END_TEST

/* The table of bad descriptors: each mutation of a valid two-tensor descriptor, with
 * the named error and tensor it must produce. */
typedef struct BadCase {
        const char *what;
        void (*mutate)(FeatureDesc *d);
        uint64_t region;
        FeatureDescError error;
        int tensor;
} BadCase;

static void m_none(FeatureDesc *d) {
        (void)d;
}
static void m_unknown_dtype(FeatureDesc *d) {
        d->tensors[1].dtype = _FEATURE_DTYPE_MAX;
}
static void m_huge_dtype(FeatureDesc *d) {
        d->tensors[0].dtype = 0xffffffffu;
}
static void m_rank(FeatureDesc *d) {
        d->tensors[1].rank = FEATURE_RANK_MAX + 1;
}
static void m_rank_absurd(FeatureDesc *d) {
        d->tensors[0].rank = 1u << 30;
}
static void m_empty_name(FeatureDesc *d) {
        d->tensors[1].name[0] = 0;
}
static void m_slash_name(FeatureDesc *d) {
        strcpy(d->tensors[0].name, "../x");
}
static void m_space_name(FeatureDesc *d) {
        strcpy(d->tensors[0].name, "a b");
}
static void m_long_name(FeatureDesc *d) {
        memset(d->tensors[0].name, 'a', sizeof d->tensors[0].name); /* no NUL within the limit */
}
static void m_dup_name(FeatureDesc *d) {
        strcpy(d->tensors[1].name, d->tensors[0].name);
}
static void m_overlap(FeatureDesc *d) {
        d->tensors[1].offset = 60; /* tensor 0 is [0, 64) */
}
static void m_overlap_contained(FeatureDesc *d) {
        /* tensor 1 entirely inside tensor 0 */
        d->tensors[1].offset = 8;
        d->tensors[1].shape[0] = 1;
}
static void m_misaligned(FeatureDesc *d) {
        d->tensors[1].offset = 66;
}
static void m_out_of_range(FeatureDesc *d) {
        d->tensors[1].offset = 1 << 20;
}
static void m_offset_overflow(FeatureDesc *d) {
        d->tensors[1].offset = UINT64_MAX - 3;
}
static void m_shape_overflow(FeatureDesc *d) {
        d->tensors[0].shape[0] = 1ull << 62;
        d->tensors[0].strides[0] = 4;
}
static void m_elem_overflow(FeatureDesc *d) {
        /* the element index fits, the byte count does not */
        d->tensors[0].shape[0] = 1ull << 62;
        d->tensors[0].strides[0] = 1;
        d->tensors[0].rank = 1;
}
static void m_zero_stride(FeatureDesc *d) {
        d->tensors[0].strides[0] = 0; /* broadcast: rows alias */
}
static void m_self_overlap(FeatureDesc *d) {
        d->tensors[0].strides[0] = 2; /* rows of 4 elements, 2 apart */
}
static void m_no_tensors(FeatureDesc *d) {
        d->n_tensors = 0;
}

#define REGION 128
static const BadCase bad_cases[] = {
        { "valid", m_none, REGION, FEATURE_DESC_OK, -1 },
        { "unknown dtype", m_unknown_dtype, REGION, FEATURE_DESC_UNKNOWN_DTYPE, 1 },
        { "dtype 2^32-1", m_huge_dtype, REGION, FEATURE_DESC_UNKNOWN_DTYPE, 0 },
        { "rank 9", m_rank, REGION, FEATURE_DESC_BAD_RANK, 1 },
        { "rank 2^30", m_rank_absurd, REGION, FEATURE_DESC_BAD_RANK, 0 },
        { "empty name", m_empty_name, REGION, FEATURE_DESC_BAD_NAME, 1 },
        { "name with slash", m_slash_name, REGION, FEATURE_DESC_BAD_NAME, 0 },
        { "name with space", m_space_name, REGION, FEATURE_DESC_BAD_NAME, 0 },
        { "name too long", m_long_name, REGION, FEATURE_DESC_BAD_NAME, 0 },
        { "duplicate name", m_dup_name, REGION, FEATURE_DESC_DUPLICATE_NAME, 1 },
        { "overlap", m_overlap, REGION, FEATURE_DESC_OVERLAP, 1 },
        { "overlap, contained", m_overlap_contained, REGION, FEATURE_DESC_OVERLAP, 1 },
        { "misaligned", m_misaligned, REGION, FEATURE_DESC_MISALIGNED, 1 },
        { "out of range", m_out_of_range, REGION, FEATURE_DESC_OUT_OF_RANGE, 1 },
        { "offset + span overflows", m_offset_overflow, REGION, FEATURE_DESC_OUT_OF_RANGE, 1 },
        { "shape × stride overflows", m_shape_overflow, REGION, FEATURE_DESC_SIZE_OVERFLOW, 0 },
        { "bytes overflow", m_elem_overflow, REGION, FEATURE_DESC_SIZE_OVERFLOW, 0 },
        { "zero stride", m_zero_stride, REGION, FEATURE_DESC_SELF_OVERLAP, 0 },
        { "self-overlapping strides", m_self_overlap, REGION, FEATURE_DESC_SELF_OVERLAP, 0 },
        { "no tensors", m_no_tensors, REGION, FEATURE_DESC_NO_TENSORS, -1 },
        { "region too small", m_none, 64, FEATURE_DESC_OUT_OF_RANGE, 1 },
};

static FeatureDesc *two_tensors(void) {
        FeatureDesc *d;
        ck_assert_int_eq(feature_desc_new(2, &d), 0);
        /* "a": f32 [4, 4] at 0 → [0, 64); "b": f32 [4, 4] at 64 → [64, 128) */
        for (int i = 0; i < 2; i++) {
                FeatureTensor *t = &d->tensors[i];
                snprintf(t->name, sizeof t->name, "%c", 'a' + i);
                t->dtype = FEATURE_DTYPE_F32;
                t->rank = 2;
                t->shape[0] = t->shape[1] = 4;
                t->strides[0] = 4;
                t->strides[1] = 1;
                t->offset = 64u * (unsigned)i;
        }
        return d;
}

START_TEST(test_bad_table) {
        const BadCase *c = &bad_cases[_i];
        _cleanup_(feature_desc_freep) FeatureDesc *d = two_tensors();
        FeatureDescIssue issue = { .error = _FEATURE_DESC_ERROR_MAX };
        char msg[256];
        int r;

        c->mutate(d);
        r = feature_desc_validate(d, c->region, &issue);
        feature_desc_issue_format(&issue, d, msg, sizeof msg);
        ck_assert_msg(issue.error == c->error, "%s: got \"%s\", expected %s", c->what, msg,
                      feature_desc_error_to_string(c->error));
        ck_assert_int_eq(r, c->error == FEATURE_DESC_OK ? 0 : -EINVAL);
        ck_assert_int_eq(issue.tensor, c->tensor);
        /* every error has a name, and the message names it */
        ck_assert_ptr_nonnull(strstr(msg, feature_desc_error_to_string(c->error)));
}
END_TEST

START_TEST(test_overlap_names_both) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = two_tensors();
        FeatureDescIssue issue;
        char msg[256];

        d->tensors[1].offset = 32;
        ck_assert_int_eq(feature_desc_validate(d, REGION, &issue), -EINVAL);
        ck_assert_int_eq(issue.error, FEATURE_DESC_OVERLAP);
        ck_assert_int_eq(issue.tensor, 1);
        ck_assert_int_eq(issue.other, 0);
        feature_desc_issue_format(&issue, d, msg, sizeof msg);
        ck_assert_str_eq(msg, "overlap: tensor 1 (\"b\") with tensor 0 (\"a\")");

        /* The overlap is found even when the earlier-starting tensor is not the
         * neighbour in offset order: [0, 96) against [64, 80) with [32, 48) between. */
        _cleanup_(feature_desc_freep) FeatureDesc *e = NULL;
        ck_assert_int_eq(feature_desc_new(3, &e), 0);
        const uint64_t offs[3] = { 0, 32, 64 }, lens[3] = { 96, 16, 16 };
        for (int i = 0; i < 3; i++) {
                snprintf(e->tensors[i].name, sizeof e->tensors[i].name, "t%d", i);
                e->tensors[i].dtype = FEATURE_DTYPE_U8;
                e->tensors[i].rank = 1;
                e->tensors[i].shape[0] = lens[i];
                e->tensors[i].strides[0] = 1;
                e->tensors[i].offset = offs[i];
        }
        ck_assert_int_eq(feature_desc_validate(e, 96, &issue), -EINVAL);
        ck_assert_int_eq(issue.error, FEATURE_DESC_OVERLAP);
        ck_assert_int_eq(issue.tensor, 1);
        ck_assert_int_eq(issue.other, 0);
}
END_TEST

START_TEST(test_too_many) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = NULL;
        FeatureDesc *x = NULL;
        ck_assert_int_eq(feature_desc_new(FEATURE_TENSORS_MAX + 1, &x), -E2BIG);
        ck_assert_int_eq(feature_desc_new(FEATURE_TENSORS_MAX, &d), 0);
        FeatureDescIssue issue;
        d->n_tensors = FEATURE_TENSORS_MAX + 1; /* forged count */
        ck_assert_int_eq(feature_desc_validate(d, 1 << 20, &issue), -EINVAL);
        ck_assert_int_eq(issue.error, FEATURE_DESC_TOO_MANY_TENSORS);
}
END_TEST

/* Bad binary forms, each with its error. */
START_TEST(test_bad_binary) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = two_tensors();
        _cleanup_(freep) uint8_t *bin = NULL;
        FeatureDescIssue issue;
        FeatureDesc *x = NULL;
        size_t size;
        void *p;

        ck_assert_int_eq(feature_desc_serialize(d, &p, &size), 0);
        bin = p;
        uint8_t *copy = malloc(size + 1);

#define EXPECT(err)                                                                      \
        do {                                                                             \
                ck_assert_int_eq(feature_desc_parse(copy, n, REGION, &x, &issue), -EINVAL); \
                ck_assert_ptr_null(x);                                                   \
                ck_assert_int_eq(issue.error, err);                                      \
        } while (0)
        size_t n = size;

        memcpy(copy, bin, size);
        copy[0] = 'X';
        EXPECT(FEATURE_DESC_BAD_MAGIC);

        memcpy(copy, bin, size);
        copy[8] = 2;
        EXPECT(FEATURE_DESC_BAD_VERSION);

        memcpy(copy, bin, size);
        copy[12] = 0;
        EXPECT(FEATURE_DESC_NO_TENSORS);

        memcpy(copy, bin, size);
        copy[12] = 65;
        EXPECT(FEATURE_DESC_TOO_MANY_TENSORS);

        memcpy(copy, bin, size);
        copy[15] = 0x80; /* 2^31 tensors: refused before anything is allocated */
        EXPECT(FEATURE_DESC_TOO_MANY_TENSORS);

        memcpy(copy, bin, size);
        copy[16] = 0; /* name length 0 */
        EXPECT(FEATURE_DESC_BAD_NAME);

        memcpy(copy, bin, size);
        copy[17] = 0; /* NUL inside the name */
        EXPECT(FEATURE_DESC_BAD_NAME);

        memcpy(copy, bin, size);
        copy[18] = 99; /* dtype */
        EXPECT(FEATURE_DESC_UNKNOWN_DTYPE);

        memcpy(copy, bin, size);
        copy[19] = 200; /* rank */
        EXPECT(FEATURE_DESC_BAD_RANK);

        memcpy(copy, bin, size);
        copy[20] = 1; /* reserved u16 after the rank */
        EXPECT(FEATURE_DESC_RESERVED_NONZERO);

        memcpy(copy, bin, size);
        copy[size] = 0;
        n = size + 1;
        EXPECT(FEATURE_DESC_TRAILING_BYTES);
        n = size;

        /* semantic errors surface through parse as well */
        memcpy(copy, bin, size);
        ck_assert_int_eq(feature_desc_parse(copy, n, 100, &x, &issue), -EINVAL);
        ck_assert_int_eq(issue.error, FEATURE_DESC_OUT_OF_RANGE);
#undef EXPECT
        free(copy);
}
END_TEST

START_TEST(test_dtypes) {
        for (int i = 0; i < _FEATURE_DTYPE_MAX; i++) {
                ck_assert_ptr_nonnull(feature_dtype_to_string(i));
                ck_assert_int_eq(feature_dtype_from_string(feature_dtype_to_string(i)), i);
                ck_assert_uint_gt(feature_dtype_size(i), 0);
        }
        ck_assert_int_eq(feature_dtype_from_string("torch.bfloat16"), FEATURE_DTYPE_BF16);
        ck_assert_int_eq(feature_dtype_from_string("float32"), FEATURE_DTYPE_F32);
        ck_assert_int_eq(feature_dtype_from_string("complex64"), -EINVAL);
        ck_assert_int_eq(feature_dtype_from_string(""), -EINVAL);
        ck_assert_uint_eq(feature_dtype_size(_FEATURE_DTYPE_MAX), 0);
        for (int i = 0; i < _FEATURE_DESC_ERROR_MAX; i++)
                ck_assert_ptr_nonnull(feature_desc_error_to_string(i));
}
END_TEST

int main(void) {
        Suite *s = suite_create("feature-desc");
        TCase *tc = tcase_create("feature-desc");
        tcase_add_test(tc, test_valid_bundle);
        tcase_add_test(tc, test_transposed_and_empty);
        tcase_add_loop_test(tc, test_bad_table, 0, (int)ELEMENTSOF(bad_cases));
        tcase_add_test(tc, test_overlap_names_both);
        tcase_add_test(tc, test_too_many);
        tcase_add_test(tc, test_bad_binary);
        tcase_add_test(tc, test_dtypes);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
