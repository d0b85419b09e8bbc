/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the WAL records of restart without loss (sequence records 0x04xx, feature
 * records 0x05xx): their payloads come from disk. The input is a sequence of records,
 * each prefixed with a type byte (low bit: sequence or feature; bit 1: PUT/READY or
 * DEL/GONE) and a 16-bit little-endian length. Sequence payloads are parsed and
 * re-encoded (the round trip must be exact); feature payloads are applied to a feature
 * cache with one unmapped arena, which exercises exact-region allocation, descriptor
 * parsing and replacement of a key. The cache's allocator is checked at the end. */
#include <assert.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "feature.h"
#include "sequence-record.h"
#include "sequence.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void sequence_one(uint8_t kind, const uint8_t *p, size_t n) {
        SequenceRecord r;
        EpdId id;

        if (kind & 2) {
                (void)sequence_record_del_parse(p, n, &id);
                return;
        }
        if (sequence_record_put_parse(p, n, &r) < 0)
                return;
        EpdId grants[SEQUENCE_GRANTS_MAX];
        PageId *pages = malloc((r.n_pages ? r.n_pages : 1) * sizeof(PageId));
        if (!pages)
                return;
        for (uint32_t i = 0; i < r.n_grants; i++)
                memcpy(grants[i].bytes, r.grants + 16 * i, 16);
        for (uint32_t i = 0; i < r.n_pages; i++)
                pages[i] = sequence_record_page(&r, i);
        void *buf = malloc(n);
        if (buf) {
                sequence_record_put_encode(buf, &r.id, r.arena, r.uid, r.page_size, r.created_usec, grants,
                                           r.n_grants, pages, r.n_pages);
                assert(memcmp(buf, p, n) == 0);
                free(buf);
        }
        free(pages);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        FeatureCacheConfig cfg = { .budget_bytes = 1 << 24 };
        FeatureCache *c;

        if (feature_cache_new(&cfg, &c) < 0)
                return 0;
        if (feature_cache_add_arena(c, 1, NULL, 4096, 1 << 22, 4096) < 0) {
                feature_cache_free(c);
                return 0;
        }
        while (size >= 3) {
                uint8_t kind = data[0];
                size_t n = (size_t)data[1] | (size_t)data[2] << 8;
                data += 3;
                size -= 3;
                n = n < size ? n : size;
                if (kind & 1)
                        (void)feature_cache_apply_record(c, (kind & 2) ? FEATURE_REC_GONE : FEATURE_REC_READY, data,
                                                         n);
                else
                        sequence_one(kind, data, n);
                FeatureRecord fr;
                (void)feature_record_ready_parse(data, n, &fr);
                data += n;
                size -= n;
        }
        assert(feature_cache_stats(c)->n_refs == 0);
        feature_cache_free(c);
        return 0;
}
