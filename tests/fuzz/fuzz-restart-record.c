/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the WAL records of restart without loss (sequence records 0x04xx, feature
 * records 0x05xx, block-directory records 0x02xx, handoff records 0x03xx): their
 * payloads come from disk. The input is a sequence of records, each prefixed with a
 * kind byte and a 16-bit little-endian length. Kind bits 2-3 choose the family:
 *   0: low bit: sequence or feature; bit 1: PUT/READY or DEL/GONE. Sequence payloads
 *      are parsed and re-encoded (the round trip must be exact); feature payloads are
 *      applied to a feature cache with one unmapped arena, which exercises exact-region
 *      allocation, descriptor parsing and replacement of a key;
 *   1: a directory record (bit 1: DEL), parsed and re-encoded exactly;
 *   2: a handoff record of type 1 + (kind >> 4) % 5, applied to a handoff journal
 *      (and re-encoded exactly when it parses);
 *   3: the journal is recovered (in-flight entries roll back) and snapshotted into a
 *      second journal, which must come out with the same entries.
 * The cache's allocator is checked at the end. */
#include <assert.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pages/directory-record.h"
#include "feature/feature.h"
#include "handoff/handoff-record.h"
#include "pages/sequence-record.h"
#include "pages/sequence.h"

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

static void directory_one(uint8_t kind, const uint8_t *p, size_t n) {
        uint8_t buf[DIRECTORY_REC_PUT_SIZE];
        if (kind & 2) {
                uint64_t hash;
                if (directory_record_del_parse(p, n, &hash) < 0)
                        return;
                directory_record_del_encode(buf, hash);
                assert(memcmp(buf, p, DIRECTORY_REC_DEL_SIZE) == 0);
                return;
        }
        DirectoryRecord r;
        if (directory_record_put_parse(p, n, &r) < 0)
                return;
        directory_record_put_encode(buf, &r);
        assert(memcmp(buf, p, DIRECTORY_REC_PUT_SIZE) == 0);
}

static void handoff_one(HandoffJournal *j, uint8_t kind, const uint8_t *p, size_t n) {
        uint8_t type = (uint8_t)(1 + (kind >> 4) % 5);
        HandoffRecord r;
        if (handoff_record_parse(type, p, n, &r) == 0) {
                uint32_t *pages = malloc((r.n_pages ? r.n_pages : 1) * sizeof *pages);
                uint8_t *buf = malloc(n);
                if (pages && buf) {
                        for (uint32_t i = 0; i < r.n_pages; i++)
                                pages[i] = (uint32_t)r.pages[4 * i] | (uint32_t)r.pages[4 * i + 1] << 8 |
                                           (uint32_t)r.pages[4 * i + 2] << 16 | (uint32_t)r.pages[4 * i + 3] << 24;
                        assert(handoff_record_size(&r) == n);
                        handoff_record_encode(buf, &r, pages);
                        assert(memcmp(buf, p, n) == 0);
                }
                free(pages);
                free(buf);
        }
        (void)handoff_journal_apply(j, type, p, n);
}

static int snapshot_into(void *userdata, uint8_t type, const void *rec, size_t len) {
        int r = handoff_journal_apply(userdata, type, rec, len);
        assert(r == 0);
        return r;
}

static void handoff_recover_snapshot(HandoffJournal *j) {
        HandoffJournal copy;
        HandoffJournalEntry *e;
        size_t i = 0;
        (void)handoff_journal_recover(j, NULL, NULL);
        if (handoff_journal_init(&copy) < 0)
                return;
        while (handoff_journal_iterate(j, &i, &e))
                (void)handoff_journal_snapshot_entry(e, snapshot_into, &copy);
        assert(handoff_journal_size(&copy) == handoff_journal_size(j));
        i = 0;
        while (handoff_journal_iterate(j, &i, &e)) {
                HandoffJournalEntry *c = handoff_journal_get(&copy, &e->request_id, e->role);
                assert(c && c->token == e->token && c->state == e->state && c->n_pages == e->n_pages &&
                       c->has_sequence == e->has_sequence);
                assert(memcmp(c->pages, e->pages, e->n_pages * sizeof *e->pages) == 0);
        }
        handoff_journal_done(&copy);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        FeatureCacheConfig cfg = { .budget_bytes = 1 << 24 };
        HandoffJournal journal;
        FeatureCache *c;

        if (handoff_journal_init(&journal) < 0)
                return 0;
        if (feature_cache_new(&cfg, &c) < 0) {
                handoff_journal_done(&journal);
                return 0;
        }
        if (feature_cache_add_arena(c, 1, NULL, 4096, 1 << 22, 4096) < 0) {
                feature_cache_free(c);
                handoff_journal_done(&journal);
                return 0;
        }
        while (size >= 3) {
                uint8_t kind = data[0];
                size_t n = (size_t)data[1] | (size_t)data[2] << 8;
                data += 3;
                size -= 3;
                n = n < size ? n : size;
                if ((kind & 0x0c) == 0x04)
                        directory_one(kind, data, n);
                else if ((kind & 0x0c) == 0x08)
                        handoff_one(&journal, kind, data, n);
                else if ((kind & 0x0c) == 0x0c)
                        handoff_recover_snapshot(&journal);
                else if (kind & 1)
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
        handoff_journal_done(&journal);
        return 0;
}
