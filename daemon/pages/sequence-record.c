/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/sequence-record.h"

#include <errno.h>
#include <string.h>

#include "pages/sequence.h"

static void put_u32(uint8_t *p, uint32_t v) {
        for (int i = 0; i < 4; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v) {
        for (int i = 0; i < 8; i++)
                p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p) {
        return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_u64(const uint8_t *p) {
        return (uint64_t)get_u32(p) | (uint64_t)get_u32(p + 4) << 32;
}

size_t sequence_record_put_size(uint32_t n_grants, uint32_t n_pages) {
        return SEQUENCE_REC_HEADER_SIZE + (size_t)n_grants * 16 + (size_t)n_pages * 4;
}

void sequence_record_put_encode(void *buf, const EpdId *id, uint32_t arena, uint32_t uid,
                                uint64_t page_size, uint64_t created_usec, const EpdId *grants,
                                uint32_t n_grants, const PageId *pages, uint32_t n_pages) {
        uint8_t *p = buf;

        memcpy(p, id->bytes, 16);
        put_u32(p + 16, arena);
        put_u32(p + 20, uid);
        put_u64(p + 24, page_size);
        put_u64(p + 32, created_usec);
        put_u32(p + 40, n_grants);
        put_u32(p + 44, n_pages);
        p += SEQUENCE_REC_HEADER_SIZE;
        for (uint32_t i = 0; i < n_grants; i++, p += 16)
                memcpy(p, grants[i].bytes, 16);
        for (uint32_t i = 0; i < n_pages; i++, p += 4)
                put_u32(p, pages[i]);
}

int sequence_record_put_parse(const void *buf, size_t n, SequenceRecord *ret) {
        const uint8_t *p = buf;

        if (!p || n < SEQUENCE_REC_HEADER_SIZE)
                return -EBADMSG;
        *ret = (SequenceRecord){
                .arena = get_u32(p + 16),
                .uid = get_u32(p + 20),
                .page_size = get_u64(p + 24),
                .created_usec = get_u64(p + 32),
                .n_grants = get_u32(p + 40),
                .n_pages = get_u32(p + 44),
        };
        memcpy(ret->id.bytes, p, 16);
        if (ret->n_grants > SEQUENCE_GRANTS_MAX || ret->n_pages > SEQUENCE_PAGES_MAX ||
            ret->page_size == 0 || n != sequence_record_put_size(ret->n_grants, ret->n_pages))
                return -EBADMSG;
        ret->grants = p + SEQUENCE_REC_HEADER_SIZE;
        ret->pages = ret->grants + (size_t)ret->n_grants * 16;
        for (uint32_t i = 0; i < ret->n_pages; i++)
                if (sequence_record_page(ret, i) == PAGE_ID_INVALID)
                        return -EBADMSG;
        return 0;
}

int sequence_record_del_parse(const void *buf, size_t n, EpdId *ret) {
        if (!buf || n != 16)
                return -EBADMSG;
        memcpy(ret->bytes, buf, 16);
        return 0;
}

PageId sequence_record_page(const SequenceRecord *r, uint32_t i) {
        return get_u32(r->pages + (size_t)i * 4);
}
