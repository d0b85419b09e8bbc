/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/sequence-record.h"

#include <errno.h>
#include <string.h>

#include "pages/sequence.h"
#include "unaligned.h"

size_t sequence_record_put_size(uint32_t n_grants, uint32_t n_pages) {
        return SEQUENCE_REC_HEADER_SIZE + (size_t)n_grants * 16 + (size_t)n_pages * 4;
}

void sequence_record_put_encode(void *buf, const EpdId *id, uint32_t arena, uint32_t uid,
                                uint64_t page_size, uint64_t created_usec, const EpdId *grants,
                                uint32_t n_grants, const PageId *pages, uint32_t n_pages) {
        uint8_t *p = buf;

        memcpy(p, id->bytes, 16);
        unaligned_write_le32(p + 16, arena);
        unaligned_write_le32(p + 20, uid);
        unaligned_write_le64(p + 24, page_size);
        unaligned_write_le64(p + 32, created_usec);
        unaligned_write_le32(p + 40, n_grants);
        unaligned_write_le32(p + 44, n_pages);
        p += SEQUENCE_REC_HEADER_SIZE;
        for (uint32_t i = 0; i < n_grants; i++, p += 16)
                memcpy(p, grants[i].bytes, 16);
        for (uint32_t i = 0; i < n_pages; i++, p += 4)
                unaligned_write_le32(p, pages[i]);
}

int sequence_record_put_parse(const void *buf, size_t n, SequenceRecord *ret) {
        const uint8_t *p = buf;

        if (!p || n < SEQUENCE_REC_HEADER_SIZE)
                return -EBADMSG;
        *ret = (SequenceRecord){
                .arena = unaligned_read_le32(p + 16),
                .uid = unaligned_read_le32(p + 20),
                .page_size = unaligned_read_le64(p + 24),
                .created_usec = unaligned_read_le64(p + 32),
                .n_grants = unaligned_read_le32(p + 40),
                .n_pages = unaligned_read_le32(p + 44),
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
        return unaligned_read_le32(r->pages + (size_t)i * 4);
}
