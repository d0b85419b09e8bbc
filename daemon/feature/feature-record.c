/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The feature cache's READY record (docs/wal.md): what the journal keeps of a published
 * feature, and its checked parse for the replay. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "feature/feature.h"
#include "macro.h"
#include "unaligned.h"

int feature_record_ready_encode(const Feature *f, void **ret, size_t *ret_len) {
        _cleanup_(freep) void *desc = NULL;
        size_t desc_len = 0, key_len, len;
        uint8_t *p;
        int r;

        if (!f || f->state != FEATURE_READY || !f->has_region || !f->desc)
                return -EINVAL;
        r = feature_desc_serialize(f->desc, &desc, &desc_len);
        if (r < 0)
                return r;
        key_len = strlen(f->key);
        len = FEATURE_REC_HEADER_SIZE + key_len + desc_len;
        p = calloc(1, len);
        if (!p)
                return -ENOMEM;
        unaligned_write_le(p, f->arena, 4);
        unaligned_write_le(p + 4, key_len, 4);
        unaligned_write_le(p + 8, f->offset, 8);
        unaligned_write_le(p + 16, f->size, 8);
        unaligned_write_le(p + 24, f->bytes, 8);
        unaligned_write_le(p + 32, f->encode_usec, 8);
        memcpy(p + 40, f->request_id.bytes, 16);
        unaligned_write_le(p + 56, desc_len, 4);
        memcpy(p + FEATURE_REC_HEADER_SIZE, f->key, key_len);
        memcpy(p + FEATURE_REC_HEADER_SIZE + key_len, desc, desc_len);
        *ret = p;
        *ret_len = len;
        return 0;
}

int feature_record_ready_parse(const void *buf, size_t n, FeatureRecord *ret) {
        const uint8_t *p = buf;
        uint64_t key_len, desc_len;

        if (!p || n < FEATURE_REC_HEADER_SIZE || unaligned_read_le(p + 60, 4) != 0)
                return -EBADMSG;
        key_len = unaligned_read_le(p + 4, 4);
        desc_len = unaligned_read_le(p + 56, 4);
        if (key_len == 0 || key_len > FEATURE_KEY_MAX || desc_len > FEATURE_DESC_BINARY_MAX ||
            n != FEATURE_REC_HEADER_SIZE + key_len + desc_len)
                return -EBADMSG;
        *ret = (FeatureRecord){
                .arena = (uint32_t)unaligned_read_le(p, 4),
                .offset = unaligned_read_le(p + 8, 8),
                .size = unaligned_read_le(p + 16, 8),
                .bytes = unaligned_read_le(p + 24, 8),
                .encode_usec = unaligned_read_le(p + 32, 8),
                .key = (const char *)p + FEATURE_REC_HEADER_SIZE,
                .key_len = (size_t)key_len,
                .desc = p + FEATURE_REC_HEADER_SIZE + key_len,
                .desc_len = (size_t)desc_len,
        };
        memcpy(ret->request_id.bytes, p + 40, 16);
        if (memchr(ret->key, 0, ret->key_len) || ret->bytes == 0 || ret->size < ret->bytes)
                return -EBADMSG;
        return 0;
}
