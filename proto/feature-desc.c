/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"
#include "proto/feature-desc.h"
#include "unaligned.h"

static const struct {
        const char *name;
        const char *alias;
        size_t size;
} dtypes[_FEATURE_DTYPE_MAX] = {
        [FEATURE_DTYPE_F32] = { "f32", "float32", 4 },
        [FEATURE_DTYPE_F16] = { "f16", "float16", 2 },
        [FEATURE_DTYPE_BF16] = { "bf16", "bfloat16", 2 },
        [FEATURE_DTYPE_F64] = { "f64", "float64", 8 },
        [FEATURE_DTYPE_FP8_E4M3] = { "fp8_e4m3", "float8_e4m3fn", 1 },
        [FEATURE_DTYPE_FP8_E5M2] = { "fp8_e5m2", "float8_e5m2", 1 },
        [FEATURE_DTYPE_I8] = { "i8", "int8", 1 },
        [FEATURE_DTYPE_U8] = { "u8", "uint8", 1 },
        [FEATURE_DTYPE_I16] = { "i16", "int16", 2 },
        [FEATURE_DTYPE_I32] = { "i32", "int32", 4 },
        [FEATURE_DTYPE_I64] = { "i64", "int64", 8 },
        [FEATURE_DTYPE_BOOL] = { "bool", "bool", 1 },
};

const char *feature_dtype_to_string(FeatureDType t) {
        if ((unsigned)t >= _FEATURE_DTYPE_MAX)
                return NULL;
        return dtypes[t].name;
}

int feature_dtype_from_string(const char *s) {
        if (!s)
                return -EINVAL;
        for (unsigned i = 0; i < _FEATURE_DTYPE_MAX; i++)
                if (strcmp(s, dtypes[i].name) == 0 || strcmp(s, dtypes[i].alias) == 0)
                        return (int)i;
        /* torch's repr: "torch.float16" */
        if (strncmp(s, "torch.", 6) == 0)
                return feature_dtype_from_string(s + 6);
        return -EINVAL;
}

size_t feature_dtype_size(FeatureDType t) {
        if ((unsigned)t >= _FEATURE_DTYPE_MAX)
                return 0;
        return dtypes[t].size;
}

static const char *const desc_errors[_FEATURE_DESC_ERROR_MAX] = {
        [FEATURE_DESC_OK] = "ok",
        [FEATURE_DESC_TRUNCATED] = "truncated",
        [FEATURE_DESC_BAD_MAGIC] = "bad-magic",
        [FEATURE_DESC_BAD_VERSION] = "bad-version",
        [FEATURE_DESC_TRAILING_BYTES] = "trailing-bytes",
        [FEATURE_DESC_RESERVED_NONZERO] = "reserved-nonzero",
        [FEATURE_DESC_NO_TENSORS] = "no-tensors",
        [FEATURE_DESC_TOO_MANY_TENSORS] = "too-many-tensors",
        [FEATURE_DESC_BAD_NAME] = "bad-name",
        [FEATURE_DESC_DUPLICATE_NAME] = "duplicate-name",
        [FEATURE_DESC_UNKNOWN_DTYPE] = "unknown-dtype",
        [FEATURE_DESC_BAD_RANK] = "bad-rank",
        [FEATURE_DESC_SIZE_OVERFLOW] = "size-overflow",
        [FEATURE_DESC_SELF_OVERLAP] = "self-overlap",
        [FEATURE_DESC_MISALIGNED] = "misaligned",
        [FEATURE_DESC_OUT_OF_RANGE] = "out-of-range",
        [FEATURE_DESC_OVERLAP] = "overlap",
};

const char *feature_desc_error_to_string(FeatureDescError e) {
        if ((unsigned)e >= _FEATURE_DESC_ERROR_MAX)
                return NULL;
        return desc_errors[e];
}

const char *feature_desc_issue_format(const FeatureDescIssue *issue, const FeatureDesc *d,
                                      char *buf, size_t size) {
        const char *e = feature_desc_error_to_string(issue->error) ?: "invalid";

        if (issue->tensor < 0)
                snprintf(buf, size, "%s", e);
        else if (!d || (size_t)issue->tensor >= d->n_tensors)
                snprintf(buf, size, "%s: tensor %d", e, issue->tensor);
        else if (issue->other >= 0 && (size_t)issue->other < d->n_tensors)
                snprintf(buf, size, "%s: tensor %d (\"%.64s\") with tensor %d (\"%.64s\")", e,
                         issue->tensor, d->tensors[issue->tensor].name, issue->other,
                         d->tensors[issue->other].name);
        else
                snprintf(buf, size, "%s: tensor %d (\"%.64s\")", e, issue->tensor,
                         d->tensors[issue->tensor].name);
        return buf;
}

int feature_desc_new(size_t n_tensors, FeatureDesc **ret) {
        FeatureDesc *d;

        if (n_tensors > FEATURE_TENSORS_MAX)
                return -E2BIG;
        d = calloc(1, sizeof(FeatureDesc) + n_tensors * sizeof(FeatureTensor));
        if (!d)
                return -ENOMEM;
        d->n_tensors = n_tensors;
        *ret = d;
        return 0;
}

FeatureDesc *feature_desc_free(FeatureDesc *d) {
        free(d);
        return NULL;
}

FeatureDesc *feature_desc_dup(const FeatureDesc *d) {
        size_t sz = sizeof(FeatureDesc) + d->n_tensors * sizeof(FeatureTensor);
        FeatureDesc *c = malloc(sz);

        if (c)
                memcpy(c, d, sz);
        return c;
}

static int fail(FeatureDescIssue *issue, FeatureDescError e, int tensor, int other) {
        if (issue)
                *issue = (FeatureDescIssue){ .error = e, .tensor = tensor, .other = other };
        return -EINVAL;
}

static bool name_valid(const char *name) {
        size_t n = strnlen(name, FEATURE_TENSOR_NAME_MAX + 1);

        if (n == 0 || n > FEATURE_TENSOR_NAME_MAX)
                return false;
        for (size_t i = 0; i < n; i++) {
                char c = name[i];
                if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '_' || c == '.' || c == ':' || c == '-'))
                        return false;
        }
        return true;
}

int feature_tensor_span(const FeatureTensor *t, uint64_t *ret) {
        size_t esize = feature_dtype_size(t->dtype);
        uint64_t last = 0; /* index of the last element, in elements */

        if (esize == 0 || t->rank > FEATURE_RANK_MAX)
                return -EINVAL;
        for (uint32_t i = 0; i < t->rank; i++)
                if (t->shape[i] == 0) {
                        *ret = 0;
                        return 0;
                }
        for (uint32_t i = 0; i < t->rank; i++) {
                uint64_t step;
                if (MUL_OVERFLOW(t->shape[i] - 1, t->strides[i], &step) ||
                    ADD_OVERFLOW(last, step, &last))
                        return -EOVERFLOW;
        }
        if (ADD_OVERFLOW(last, 1, &last) || MUL_OVERFLOW(last, (uint64_t)esize, &last))
                return -EOVERFLOW;
        *ret = last;
        return 0;
}

/* True if no two distinct index tuples map to the same element. Sufficient check:
 * ordering the dimensions (of extent > 1) by stride, each stride must step over the
 * whole extent of the dimensions below it. Called after the span computed without
 * overflow, so the partial sums below cannot overflow either. */
static bool strides_disjoint(const FeatureTensor *t) {
        uint32_t idx[FEATURE_RANK_MAX], n = 0;
        uint64_t extent = 1; /* elements covered by the dimensions so far */

        for (uint32_t i = 0; i < t->rank; i++)
                if (t->shape[i] > 1)
                        idx[n++] = i;
        /* insertion sort by stride; n ≤ 8 */
        for (uint32_t i = 1; i < n; i++)
                for (uint32_t j = i; j > 0 && t->strides[idx[j]] < t->strides[idx[j - 1]]; j--) {
                        uint32_t x = idx[j];
                        idx[j] = idx[j - 1];
                        idx[j - 1] = x;
                }
        for (uint32_t k = 0; k < n; k++) {
                uint64_t s = t->strides[idx[k]];
                if (s < extent)
                        return false;
                extent = s * (t->shape[idx[k]] - 1) + extent;
        }
        return true;
}

typedef struct Range {
        uint64_t start, end;
        int tensor;
} Range;

static int range_cmp(const void *a, const void *b) {
        const Range *x = a, *y = b;
        if (x->start != y->start)
                return x->start < y->start ? -1 : 1;
        return x->tensor - y->tensor;
}

int feature_desc_validate(const FeatureDesc *d, uint64_t region_bytes, FeatureDescIssue *issue) {
        Range ranges[FEATURE_TENSORS_MAX];
        size_t n_ranges = 0;

        if (!d || d->n_tensors == 0)
                return fail(issue, FEATURE_DESC_NO_TENSORS, -1, -1);
        if (d->n_tensors > FEATURE_TENSORS_MAX)
                return fail(issue, FEATURE_DESC_TOO_MANY_TENSORS, -1, -1);

        for (size_t i = 0; i < d->n_tensors; i++) {
                const FeatureTensor *t = &d->tensors[i];
                uint64_t span, end;
                size_t esize;

                if (!name_valid(t->name))
                        return fail(issue, FEATURE_DESC_BAD_NAME, (int)i, -1);
                /* n ≤ 64: quadratic is 2016 comparisons at most, and bounded. */
                for (size_t j = 0; j < i; j++)
                        if (strcmp(t->name, d->tensors[j].name) == 0)
                                return fail(issue, FEATURE_DESC_DUPLICATE_NAME, (int)i, (int)j);
                esize = feature_dtype_size(t->dtype);
                if (esize == 0)
                        return fail(issue, FEATURE_DESC_UNKNOWN_DTYPE, (int)i, -1);
                if (t->rank > FEATURE_RANK_MAX)
                        return fail(issue, FEATURE_DESC_BAD_RANK, (int)i, -1);
                if (feature_tensor_span(t, &span) < 0)
                        return fail(issue, FEATURE_DESC_SIZE_OVERFLOW, (int)i, -1);
                if (span > 0 && !strides_disjoint(t))
                        return fail(issue, FEATURE_DESC_SELF_OVERLAP, (int)i, -1);
                if (t->offset % esize != 0)
                        return fail(issue, FEATURE_DESC_MISALIGNED, (int)i, -1);
                if (ADD_OVERFLOW(t->offset, span, &end) || end > region_bytes)
                        return fail(issue, FEATURE_DESC_OUT_OF_RANGE, (int)i, -1);
                if (span > 0)
                        ranges[n_ranges++] = (Range){ t->offset, end, (int)i };
        }

        /* Sort by start; a range overlaps an earlier one iff it starts before the
         * furthest end seen so far. O(n log n). */
        qsort(ranges, n_ranges, sizeof(Range), range_cmp);
        uint64_t max_end = 0;
        int max_tensor = -1;
        for (size_t k = 0; k < n_ranges; k++) {
                if (max_tensor >= 0 && ranges[k].start < max_end) {
                        int a = ranges[k].tensor, b = max_tensor;
                        return fail(issue, FEATURE_DESC_OVERLAP, MAX(a, b), MIN(a, b));
                }
                if (ranges[k].end > max_end) {
                        max_end = ranges[k].end;
                        max_tensor = ranges[k].tensor;
                }
        }

        if (issue)
                *issue = (FeatureDescIssue){ .error = FEATURE_DESC_OK, .tensor = -1, .other = -1 };
        return 0;
}

/* Binary form. */

typedef struct Reader {
        const uint8_t *p;
        size_t left;
} Reader;

static bool read_bytes(Reader *r, void *dst, size_t n) {
        if (r->left < n)
                return false;
        memcpy(dst, r->p, n);
        r->p += n;
        r->left -= n;
        return true;
}

static bool read_u8(Reader *r, uint8_t *v) {
        return read_bytes(r, v, 1);
}

static bool read_le16(Reader *r, uint16_t *v) {
        uint8_t b[2];
        if (!read_bytes(r, b, 2))
                return false;
        *v = unaligned_read_le16(b);
        return true;
}

static bool read_le32(Reader *r, uint32_t *v) {
        uint8_t b[4];
        if (!read_bytes(r, b, 4))
                return false;
        *v = unaligned_read_le32(b);
        return true;
}

static bool read_le64(Reader *r, uint64_t *v) {
        uint8_t b[8];
        if (!read_bytes(r, b, 8))
                return false;
        *v = unaligned_read_le64(b);
        return true;
}

int feature_desc_parse(const void *data, size_t size, uint64_t region_bytes,
                       FeatureDesc **ret, FeatureDescIssue *issue) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = NULL;
        Reader r = { data, size };
        char magic[8];
        uint32_t version, n;
        int k;

        if (!read_bytes(&r, magic, sizeof magic))
                return fail(issue, FEATURE_DESC_TRUNCATED, -1, -1);
        if (memcmp(magic, FEATURE_DESC_MAGIC, sizeof magic) != 0)
                return fail(issue, FEATURE_DESC_BAD_MAGIC, -1, -1);
        if (!read_le32(&r, &version) || !read_le32(&r, &n))
                return fail(issue, FEATURE_DESC_TRUNCATED, -1, -1);
        if (version != FEATURE_DESC_VERSION)
                return fail(issue, FEATURE_DESC_BAD_VERSION, -1, -1);
        if (n == 0)
                return fail(issue, FEATURE_DESC_NO_TENSORS, -1, -1);
        if (n > FEATURE_TENSORS_MAX)
                return fail(issue, FEATURE_DESC_TOO_MANY_TENSORS, -1, -1);

        k = feature_desc_new(n, &d);
        if (k < 0)
                return k;

        for (uint32_t i = 0; i < n; i++) {
                FeatureTensor *t = &d->tensors[i];
                uint8_t name_len, dtype, rank;
                uint16_t pad;

                if (!read_u8(&r, &name_len))
                        return fail(issue, FEATURE_DESC_TRUNCATED, (int)i, -1);
                if (name_len == 0 || name_len > FEATURE_TENSOR_NAME_MAX)
                        return fail(issue, FEATURE_DESC_BAD_NAME, (int)i, -1);
                if (!read_bytes(&r, t->name, name_len))
                        return fail(issue, FEATURE_DESC_TRUNCATED, (int)i, -1);
                t->name[name_len] = 0;
                if (strlen(t->name) != name_len) /* embedded NUL */
                        return fail(issue, FEATURE_DESC_BAD_NAME, (int)i, -1);
                if (!read_u8(&r, &dtype) || !read_u8(&r, &rank) || !read_le16(&r, &pad) ||
                    !read_le64(&r, &t->offset))
                        return fail(issue, FEATURE_DESC_TRUNCATED, (int)i, -1);
                if (pad != 0)
                        return fail(issue, FEATURE_DESC_RESERVED_NONZERO, (int)i, -1);
                t->dtype = dtype;
                if (feature_dtype_size(t->dtype) == 0)
                        return fail(issue, FEATURE_DESC_UNKNOWN_DTYPE, (int)i, -1);
                if (rank > FEATURE_RANK_MAX)
                        return fail(issue, FEATURE_DESC_BAD_RANK, (int)i, -1);
                t->rank = rank;
                for (uint32_t j = 0; j < rank; j++)
                        if (!read_le64(&r, &t->shape[j]))
                                return fail(issue, FEATURE_DESC_TRUNCATED, (int)i, -1);
                for (uint32_t j = 0; j < rank; j++)
                        if (!read_le64(&r, &t->strides[j]))
                                return fail(issue, FEATURE_DESC_TRUNCATED, (int)i, -1);
        }
        if (r.left != 0)
                return fail(issue, FEATURE_DESC_TRAILING_BYTES, -1, -1);

        k = feature_desc_validate(d, region_bytes, issue);
        if (k < 0)
                return k;
        *ret = TAKE_PTR(d);
        return 0;
}

static uint8_t *put_le(uint8_t *p, uint64_t v, unsigned bytes) {
        unaligned_write_le(p, v, bytes);
        return p + bytes;
}

int feature_desc_serialize(const FeatureDesc *d, void **ret, size_t *ret_size) {
        size_t size = 16;
        uint8_t *buf, *p;

        if (!d || d->n_tensors == 0 || d->n_tensors > FEATURE_TENSORS_MAX)
                return -EINVAL;
        for (size_t i = 0; i < d->n_tensors; i++) {
                const FeatureTensor *t = &d->tensors[i];
                size_t nl = strnlen(t->name, FEATURE_TENSOR_NAME_MAX + 1);
                if (nl == 0 || nl > FEATURE_TENSOR_NAME_MAX || t->rank > FEATURE_RANK_MAX ||
                    t->dtype > UINT8_MAX)
                        return -EINVAL;
                size += 1 + nl + 4 + 8 + 16 * (size_t)t->rank;
        }

        buf = p = malloc(size);
        if (!buf)
                return -ENOMEM;
        memcpy(p, FEATURE_DESC_MAGIC, 8);
        p += 8;
        p = put_le(p, FEATURE_DESC_VERSION, 4);
        p = put_le(p, d->n_tensors, 4);
        for (size_t i = 0; i < d->n_tensors; i++) {
                const FeatureTensor *t = &d->tensors[i];
                size_t nl = strlen(t->name);
                *p++ = (uint8_t)nl;
                memcpy(p, t->name, nl);
                p += nl;
                *p++ = (uint8_t)t->dtype;
                *p++ = (uint8_t)t->rank;
                p = put_le(p, 0, 2);
                p = put_le(p, t->offset, 8);
                for (uint32_t j = 0; j < t->rank; j++)
                        p = put_le(p, t->shape[j], 8);
                for (uint32_t j = 0; j < t->rank; j++)
                        p = put_le(p, t->strides[j], 8);
        }
        *ret = buf;
        *ret_size = size;
        return 0;
}
