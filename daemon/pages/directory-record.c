/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/directory-record.h"

#include <errno.h>
#include <string.h>

static void put_le(uint8_t *p, uint64_t v, int n) {
        for (int i = 0; i < n; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get_le(const uint8_t *p, int n) {
        uint64_t v = 0;
        for (int i = n - 1; i >= 0; i--)
                v = v << 8 | p[i];
        return v;
}

void directory_record_put_encode(void *buf, const DirectoryRecord *r) {
        uint8_t *p = buf;
        put_le(p, r->hash, 8);
        put_le(p + 8, r->arena, 4);
        put_le(p + 12, r->page, 4);
        put_le(p + 16, r->page_size, 8);
        put_le(p + 24, 0, 8);
}

void directory_record_del_encode(void *buf, uint64_t hash) {
        put_le(buf, hash, 8);
}

int directory_record_put_parse(const void *buf, size_t n, DirectoryRecord *ret) {
        const uint8_t *p = buf;
        if (n != DIRECTORY_REC_PUT_SIZE || get_le(p + 24, 8) != 0)
                return -EBADMSG;
        *ret = (DirectoryRecord){
                .hash = get_le(p, 8),
                .arena = (uint32_t)get_le(p + 8, 4),
                .page = (uint32_t)get_le(p + 12, 4),
                .page_size = get_le(p + 16, 8),
        };
        if (ret->page_size == 0)
                return -EBADMSG;
        return 0;
}

int directory_record_del_parse(const void *buf, size_t n, uint64_t *ret) {
        if (n != DIRECTORY_REC_DEL_SIZE)
                return -EBADMSG;
        *ret = get_le(buf, 8);
        return 0;
}
