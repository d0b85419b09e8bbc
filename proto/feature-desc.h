/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* A FeatureBundle descriptor: the tensors an encoder produced for one multimodal item
 * (image embeddings, DeepStack intermediate layers, grid_thw, ...), each with a name,
 * dtype, shape, strides (in elements, like torch) and a byte offset into the feature's
 * region. Validation is pure and total: every descriptor that passes describes tensors
 * that lie wholly inside the region, do not overlap each other or themselves, and whose
 * sizes are computed without overflow. A descriptor that fails names what is wrong
 * (FeatureDescError) and which tensor.
 *
 * The binary form (feature_desc_parse/serialize) is what the file store writes beside
 * the bytes and what libepd may pass as one `ay`; it is fuzzed (tests/fuzz). */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define FEATURE_TENSORS_MAX 64u
#define FEATURE_RANK_MAX 8u
#define FEATURE_TENSOR_NAME_MAX 64u /* bytes, without the NUL */

typedef enum FeatureDType {
        FEATURE_DTYPE_F32,
        FEATURE_DTYPE_F16,
        FEATURE_DTYPE_BF16,
        FEATURE_DTYPE_F64,
        FEATURE_DTYPE_FP8_E4M3,
        FEATURE_DTYPE_FP8_E5M2,
        FEATURE_DTYPE_I8,
        FEATURE_DTYPE_U8,
        FEATURE_DTYPE_I16,
        FEATURE_DTYPE_I32,
        FEATURE_DTYPE_I64,
        FEATURE_DTYPE_BOOL,
        _FEATURE_DTYPE_MAX,
} FeatureDType;

const char *feature_dtype_to_string(FeatureDType t);
/* Returns the dtype or -EINVAL. Accepts the names above ("f32", "bf16", ...) and the
 * torch spellings ("float32", "bfloat16", "int64", ...). */
int feature_dtype_from_string(const char *s);
/* Element size in bytes; 0 for an invalid dtype. */
size_t feature_dtype_size(FeatureDType t);

typedef struct FeatureTensor {
        char name[FEATURE_TENSOR_NAME_MAX + 1];
        uint32_t dtype;                       /* FeatureDType; checked by validation */
        uint32_t rank;                        /* checked by validation */
        uint64_t shape[FEATURE_RANK_MAX];
        uint64_t strides[FEATURE_RANK_MAX];   /* in elements */
        uint64_t offset;                      /* bytes from the start of the region */
} FeatureTensor;

typedef struct FeatureDesc {
        size_t n_tensors;
        FeatureTensor tensors[];
} FeatureDesc;

/* Named validation errors. Each maps to -EINVAL (the bus reports
 * org.epd1.Error.InvalidArgument with the name in the message). */
typedef enum FeatureDescError {
        FEATURE_DESC_OK,
        FEATURE_DESC_TRUNCATED,        /* binary form ends early */
        FEATURE_DESC_BAD_MAGIC,
        FEATURE_DESC_BAD_VERSION,
        FEATURE_DESC_TRAILING_BYTES,
        FEATURE_DESC_RESERVED_NONZERO, /* a reserved field of the binary form is not 0 */
        FEATURE_DESC_NO_TENSORS,
        FEATURE_DESC_TOO_MANY_TENSORS,
        FEATURE_DESC_BAD_NAME,         /* empty, too long, or characters outside [A-Za-z0-9_.:-] */
        FEATURE_DESC_DUPLICATE_NAME,
        FEATURE_DESC_UNKNOWN_DTYPE,
        FEATURE_DESC_BAD_RANK,         /* more than FEATURE_RANK_MAX dimensions */
        FEATURE_DESC_SIZE_OVERFLOW,    /* shape × strides × element size overflows 64 bits */
        FEATURE_DESC_SELF_OVERLAP,     /* strides make elements of one tensor alias (e.g. 0) */
        FEATURE_DESC_MISALIGNED,       /* offset not a multiple of the element size */
        FEATURE_DESC_OUT_OF_RANGE,     /* tensor ends past the region */
        FEATURE_DESC_OVERLAP,          /* two tensors' byte ranges intersect */
        _FEATURE_DESC_ERROR_MAX,
} FeatureDescError;

const char *feature_desc_error_to_string(FeatureDescError e);

/* Where validation failed: the error, the tensor index (-1: the descriptor as a
 * whole), and for OVERLAP/DUPLICATE_NAME the other tensor. */
typedef struct FeatureDescIssue {
        FeatureDescError error;
        int tensor;
        int other;
} FeatureDescIssue;

/* Formats an issue as e.g. "overlap: tensor 2 (\"deepstack.1\") with tensor 1". */
const char *feature_desc_issue_format(const FeatureDescIssue *issue, const FeatureDesc *d,
                                      char *buf, size_t size);

int feature_desc_new(size_t n_tensors, FeatureDesc **ret);
FeatureDesc *feature_desc_free(FeatureDesc *d);
FeatureDesc *feature_desc_dup(const FeatureDesc *d);

/* Validates against a region of region_bytes bytes. Returns 0 or -EINVAL (with *issue
 * filled in, if issue is non-NULL). */
int feature_desc_validate(const FeatureDesc *d, uint64_t region_bytes, FeatureDescIssue *issue);

/* Byte span of one tensor: 0 for a tensor with a zero dimension. Requires a valid
 * dtype and rank; returns -EOVERFLOW on overflow. */
int feature_tensor_span(const FeatureTensor *t, uint64_t *ret);

/* Binary form, little-endian:
 *   "EPDFDESC" u32 version(=1) u32 n_tensors
 *   per tensor: u8 name_len, name, u8 dtype, u8 rank, u16 0, u64 offset,
 *               rank × u64 shape, rank × u64 strides
 * Parsing validates too (against region_bytes); the result is a valid descriptor. */
#define FEATURE_DESC_MAGIC "EPDFDESC"
#define FEATURE_DESC_VERSION 1u
/* Largest binary descriptor (all limits at their maximum). */
#define FEATURE_DESC_BINARY_MAX                                                          \
        (16u + FEATURE_TENSORS_MAX * (1u + FEATURE_TENSOR_NAME_MAX + 4u + 8u +           \
                                      2u * 8u * FEATURE_RANK_MAX))

int feature_desc_parse(const void *data, size_t size, uint64_t region_bytes,
                       FeatureDesc **ret, FeatureDescIssue *issue);
int feature_desc_serialize(const FeatureDesc *d, void **ret, size_t *ret_size);

static inline void feature_desc_freep(FeatureDesc **d) {
        feature_desc_free(*d);
}
