/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/directory-record.h"
#include "unaligned.h"

#include <errno.h>
#include <string.h>

void directory_record_put_encode(void *buf, const DirectoryRecord *r) {
        uint8_t *p = buf;
        unaligned_write_le(p, r->hash, 8);
        unaligned_write_le(p + 8, r->arena, 4);
        unaligned_write_le(p + 12, r->page, 4);
        unaligned_write_le(p + 16, r->page_size, 8);
        unaligned_write_le(p + 24, 0, 8);
}

void directory_record_del_encode(void *buf, uint64_t hash) {
        unaligned_write_le(buf, hash, 8);
}

int directory_record_put_parse(const void *buf, size_t n, DirectoryRecord *ret) {
        const uint8_t *p = buf;
        if (n != DIRECTORY_REC_PUT_SIZE || unaligned_read_le(p + 24, 8) != 0)
                return -EBADMSG;
        *ret = (DirectoryRecord){
                .hash = unaligned_read_le(p, 8),
                .arena = (uint32_t)unaligned_read_le(p + 8, 4),
                .page = (uint32_t)unaligned_read_le(p + 12, 4),
                .page_size = unaligned_read_le(p + 16, 8),
        };
        if (ret->page_size == 0)
                return -EBADMSG;
        return 0;
}

int directory_record_del_parse(const void *buf, size_t n, uint64_t *ret) {
        if (n != DIRECTORY_REC_DEL_SIZE)
                return -EBADMSG;
        *ret = unaligned_read_le(buf, 8);
        return 0;
}
