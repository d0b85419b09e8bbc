/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Handoff WAL records and the journal they rebuild (handoff-record.h): round trips,
 * malformed payloads refused, the replay rules (newer attempt replaces, commit and
 * rollback are final, release removes), recovery after a restart (in flight -> rolled
 * back, committed stays) and snapshots that rebuild the same journal. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "handoff/handoff-record.h"

static EpdId rid(uint8_t v) {
        EpdId id;
        memset(id.bytes, v, sizeof id.bytes);
        return id;
}

/* Applies a record built from r (pages for PREPARED) to j, through its encoding. */
static int apply(HandoffJournal *j, HandoffRecord r, const uint32_t *pages) {
        size_t n = handoff_record_size(&r);
        uint8_t *buf = malloc(n);
        ck_assert_ptr_nonnull(buf);
        handoff_record_encode(buf, &r, pages);
        HandoffRecord back;
        ck_assert_int_eq(handoff_record_parse(r.type, buf, n, &back), 0);
        ck_assert(epd_id_equal(&back.request_id, &r.request_id));
        ck_assert_uint_eq(back.token, r.token);
        int k = handoff_journal_apply(j, r.type, buf, n);
        free(buf);
        return k;
}

static HandoffRecord prep(uint8_t id, uint64_t token, HandoffRole role, uint32_t n_pages) {
        return (HandoffRecord){ .type = HANDOFF_REC_PREPARED, .request_id = rid(id), .token = token, .role = role,
                                .value = 4, .arena = 1, .n_pages = n_pages, .page_size = 32768 };
}

static HandoffRecord ev(uint8_t type, uint8_t id, uint64_t token, HandoffRole role) {
        return (HandoffRecord){ .type = type, .request_id = rid(id), .token = token, .role = role };
}

START_TEST(test_journal_rules) {
        HandoffJournal j;
        uint32_t pages[3] = { 7, 8, 9 };
        ck_assert_int_eq(handoff_journal_init(&j), 0);

        ck_assert_int_eq(apply(&j, prep(1, 100, HANDOFF_SOURCE, 3), pages), 0);
        ck_assert_int_eq(apply(&j, prep(1, 100, HANDOFF_DESTINATION, 3), pages), 0);
        HandoffJournalEntry *e = handoff_journal_get(&j, &(EpdId){ .bytes = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1 } },
                                                     HANDOFF_DESTINATION);
        ck_assert_ptr_nonnull(e);
        ck_assert_int_eq(e->state, HANDOFF_PREPARED);
        ck_assert_uint_eq(e->n_pages, 3);
        ck_assert_uint_eq(e->pages[2], 9);
        /* Group progress only grows. */
        HandoffRecord g = ev(HANDOFF_REC_GROUPS, 1, 100, HANDOFF_DESTINATION);
        g.value = 3;
        ck_assert_int_eq(apply(&j, g, NULL), 0);
        g.value = 2;
        ck_assert_int_eq(apply(&j, g, NULL), 0);
        ck_assert_uint_eq(e->groups_done, 3);
        g.value = 5;
        ck_assert_int_eq(apply(&j, g, NULL), -EINVAL);
        /* Another token: not this attempt. */
        ck_assert_int_eq(apply(&j, ev(HANDOFF_REC_COMMITTED, 1, 99, HANDOFF_DESTINATION), NULL), -ENOENT);
        /* Commit with the decode sequence (here its id only). */
        EpdId seq = rid(0x42);
        HandoffRecord c = ev(HANDOFF_REC_COMMITTED, 1, 100, HANDOFF_DESTINATION);
        c.extra = seq.bytes;
        c.extra_len = 16;
        ck_assert_int_eq(apply(&j, c, NULL), 0);
        ck_assert_int_eq(e->state, HANDOFF_COMMITTED);
        ck_assert(e->has_sequence && epd_id_equal(&e->sequence, &seq));
        /* Committed is final. */
        ck_assert_int_eq(apply(&j, ev(HANDOFF_REC_ROLLED_BACK, 1, 100, HANDOFF_DESTINATION), NULL), -EALREADY);
        ck_assert_int_eq(e->state, HANDOFF_COMMITTED);
        /* A newer attempt of the same request replaces the older one; an older is stale. */
        ck_assert_int_eq(apply(&j, prep(1, 200, HANDOFF_SOURCE, 1), pages), 0);
        ck_assert_int_eq(apply(&j, prep(1, 150, HANDOFF_SOURCE, 1), pages), -ESTALE);
        ck_assert_uint_eq(handoff_journal_size(&j), 2);
        HandoffRecord rb = ev(HANDOFF_REC_ROLLED_BACK, 1, 200, HANDOFF_SOURCE);
        rb.cause = HANDOFF_CAUSE_TIMEOUT;
        ck_assert_int_eq(apply(&j, rb, NULL), 0);
        /* Released: gone. */
        ck_assert_int_eq(apply(&j, ev(HANDOFF_REC_RELEASED, 1, 200, HANDOFF_SOURCE), NULL), 0);
        ck_assert_uint_eq(handoff_journal_size(&j), 1);
        ck_assert_int_eq(apply(&j, ev(HANDOFF_REC_RELEASED, 1, 200, HANDOFF_SOURCE), NULL), -ENOENT);
        handoff_journal_done(&j);
}
END_TEST

START_TEST(test_malformed) {
        uint8_t buf[64] = {};
        HandoffRecord r;
        uint32_t page = 3;
        /* Too short, bad role, token 0, reserved bytes, cause outside a rollback. */
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_RELEASED, buf, 31, &r), -EBADMSG);
        HandoffRecord ok = ev(HANDOFF_REC_RELEASED, 3, 5, HANDOFF_SOURCE);
        handoff_record_encode(buf, &ok, NULL);
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_RELEASED, buf, 32, &r), 0);
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_RELEASED, buf, 33, &r), -EBADMSG);
        ck_assert_int_eq(handoff_record_parse(0, buf, 32, &r), -EBADMSG);
        ck_assert_int_eq(handoff_record_parse(6, buf, 32, &r), -EBADMSG);
        buf[24] = 7;
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_RELEASED, buf, 32, &r), -EBADMSG);
        buf[24] = 0;
        buf[25] = 1;
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_RELEASED, buf, 32, &r), -EBADMSG);
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_ROLLED_BACK, buf, 32, &r), 0);
        buf[25] = 0;
        buf[26] = 1;
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_RELEASED, buf, 32, &r), -EBADMSG);
        /* PREPARED whose page count does not match its length, or with no groups. */
        HandoffRecord p = prep(3, 5, HANDOFF_SOURCE, 1);
        handoff_record_encode(buf, &p, &page);
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_PREPARED, buf, HANDOFF_REC_PREPARED_SIZE(1), &r), 0);
        ck_assert_uint_eq(r.n_pages, 1);
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_PREPARED, buf, HANDOFF_REC_PREPARED_SIZE(1) + 4, &r), -EBADMSG);
        buf[28] = 0;
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_PREPARED, buf, HANDOFF_REC_PREPARED_SIZE(1), &r), -EBADMSG);
        /* A source's commit carries no sequence. */
        HandoffRecord c = ev(HANDOFF_REC_COMMITTED, 3, 5, HANDOFF_SOURCE);
        handoff_record_encode(buf, &c, NULL);
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_COMMITTED, buf, 48, &r), -EBADMSG);
}
END_TEST

static int into(void *userdata, uint8_t type, const void *rec, size_t len) {
        return handoff_journal_apply(userdata, type, rec, len);
}

START_TEST(test_recover_and_snapshot) {
        HandoffJournal j, s;
        uint32_t pages[2] = { 1, 2 };
        unsigned reported = 0;
        ck_assert_int_eq(handoff_journal_init(&j), 0);
        ck_assert_int_eq(apply(&j, prep(1, 10, HANDOFF_SOURCE, 2), pages), 0);      /* in flight */
        ck_assert_int_eq(apply(&j, prep(1, 10, HANDOFF_DESTINATION, 2), pages), 0); /* in flight, 1 group */
        HandoffRecord g = ev(HANDOFF_REC_GROUPS, 1, 10, HANDOFF_DESTINATION);
        g.value = 1;
        ck_assert_int_eq(apply(&j, g, NULL), 0);
        ck_assert_int_eq(apply(&j, prep(2, 11, HANDOFF_SOURCE, 2), pages), 0);      /* committed */
        ck_assert_int_eq(apply(&j, ev(HANDOFF_REC_COMMITTED, 2, 11, HANDOFF_SOURCE), NULL), 0);
        ck_assert_int_eq(apply(&j, prep(3, 12, HANDOFF_SOURCE, 2), pages), 0);      /* rolled back */
        HandoffRecord rb = ev(HANDOFF_REC_ROLLED_BACK, 3, 12, HANDOFF_SOURCE);
        rb.cause = HANDOFF_CAUSE_REQUESTED;
        ck_assert_int_eq(apply(&j, rb, NULL), 0);

        /* The snapshot of the live journal rebuilds it. */
        ck_assert_int_eq(handoff_journal_init(&s), 0);
        HandoffJournalEntry *e;
        size_t it = 0;
        while (handoff_journal_iterate(&j, &it, &e))
                ck_assert_int_eq(handoff_journal_snapshot_entry(e, into, &s), 0);
        ck_assert_uint_eq(handoff_journal_size(&s), 4);
        e = handoff_journal_get(&s, &(EpdId){ .bytes = { 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1 } },
                                HANDOFF_DESTINATION);
        ck_assert_ptr_nonnull(e);
        ck_assert_uint_eq(e->groups_done, 1);
        ck_assert_int_eq(e->state, HANDOFF_PREPARED);
        handoff_journal_done(&s);

        /* Recovery: in flight -> rolled back (shutdown); the others as they were. */
        ck_assert_uint_eq(handoff_journal_recover(&j, NULL, NULL), 2);
        it = 0;
        while (handoff_journal_iterate(&j, &it, &e)) {
                ck_assert(e->recovered);
                ck_assert_int_ne(e->state, HANDOFF_PREPARED);
                if (e->request_id.bytes[0] == 1) {
                        ck_assert_int_eq(e->state, HANDOFF_ROLLED_BACK);
                        ck_assert_int_eq(e->cause, HANDOFF_CAUSE_SHUTDOWN);
                        reported++;
                } else if (e->request_id.bytes[0] == 2)
                        ck_assert_int_eq(e->state, HANDOFF_COMMITTED);
                else {
                        ck_assert_int_eq(e->state, HANDOFF_ROLLED_BACK);
                        ck_assert_int_eq(e->cause, HANDOFF_CAUSE_REQUESTED);
                }
        }
        ck_assert_uint_eq(reported, 2);
        /* A second recovery changes nothing. */
        ck_assert_uint_eq(handoff_journal_recover(&j, NULL, NULL), 0);
        handoff_journal_done(&j);
}
END_TEST

/* A local handoff's commit is one record for both sides. */
START_TEST(test_commit_pair) {
        HandoffJournal j;
        uint32_t pages[2] = { 3, 4 };
        ck_assert_int_eq(handoff_journal_init(&j), 0);
        ck_assert_int_eq(apply(&j, prep(7, 50, HANDOFF_SOURCE, 2), pages), 0);
        ck_assert_int_eq(apply(&j, prep(7, 50, HANDOFF_DESTINATION, 2), pages), 0);
        EpdId seq = rid(0x77), id = rid(7);
        HandoffRecord c = ev(HANDOFF_REC_COMMITTED, 7, 50, HANDOFF_DESTINATION);
        c.value = HANDOFF_REC_COMMIT_PAIR;
        c.extra = seq.bytes;
        c.extra_len = 16;
        ck_assert_int_eq(apply(&j, c, NULL), 0);
        HandoffJournalEntry *src = handoff_journal_get(&j, &id, HANDOFF_SOURCE);
        HandoffJournalEntry *dst = handoff_journal_get(&j, &id, HANDOFF_DESTINATION);
        ck_assert_int_eq(src->state, HANDOFF_COMMITTED);
        ck_assert_int_eq(dst->state, HANDOFF_COMMITTED);
        ck_assert(dst->has_sequence && !src->has_sequence);
        /* Nothing is in flight: recovery leaves both committed. */
        ck_assert_uint_eq(handoff_journal_recover(&j, NULL, NULL), 0);
        ck_assert_int_eq(src->state, HANDOFF_COMMITTED);

        /* The pair flag belongs to a destination's commit only, and is 0 or 1. */
        uint8_t buf[HANDOFF_REC_HEADER_SIZE];
        HandoffRecord bad = ev(HANDOFF_REC_COMMITTED, 7, 50, HANDOFF_SOURCE), back;
        bad.value = HANDOFF_REC_COMMIT_PAIR;
        handoff_record_encode(buf, &bad, NULL);
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_COMMITTED, buf, sizeof buf, &back), -EBADMSG);
        bad.role = HANDOFF_DESTINATION;
        bad.value = 2;
        handoff_record_encode(buf, &bad, NULL);
        ck_assert_int_eq(handoff_record_parse(HANDOFF_REC_COMMITTED, buf, sizeof buf, &back), -EBADMSG);
        /* A source of another attempt is left alone. */
        ck_assert_int_eq(apply(&j, prep(8, 60, HANDOFF_SOURCE, 2), pages), 0);
        ck_assert_int_eq(apply(&j, prep(8, 61, HANDOFF_DESTINATION, 2), pages), 0);
        HandoffRecord c2 = ev(HANDOFF_REC_COMMITTED, 8, 61, HANDOFF_DESTINATION);
        c2.value = HANDOFF_REC_COMMIT_PAIR;
        ck_assert_int_eq(apply(&j, c2, NULL), 0);
        EpdId id8 = rid(8);
        ck_assert_int_eq(handoff_journal_get(&j, &id8, HANDOFF_SOURCE)->state, HANDOFF_PREPARED);
        handoff_journal_done(&j);
}
END_TEST

int main(void) {
        Suite *s = suite_create("handoff-record");
        TCase *tc = tcase_create("handoff-record");
        tcase_add_test(tc, test_journal_rules);
        tcase_add_test(tc, test_malformed);
        tcase_add_test(tc, test_recover_and_snapshot);
        tcase_add_test(tc, test_commit_pair);
        suite_add_tcase(s, tc);
        SRunner *sr = srunner_create(s);
        srunner_run_all(sr, CK_NORMAL);
        int failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
