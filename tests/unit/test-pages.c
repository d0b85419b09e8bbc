/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "pages/pages.h"
#include "../check-main.h"

static void verify(const PagePool *p) {
        ck_assert_int_eq(page_pool_verify(p), 0);
}

START_TEST(test_new_args) {
        PagePool *p = NULL;
        ck_assert_int_eq(page_pool_new(0, 4096, 0, &p), -EINVAL);
        ck_assert_int_eq(page_pool_new(16, 0, 0, &p), -EINVAL);
        ck_assert_int_eq(page_pool_new(UINT64_C(1) << 40, 4096, 0, &p), -ERANGE);
        ck_assert_int_eq(page_pool_new(1 << 20, UINT64_MAX / 2, 0, &p), -ERANGE);
        ck_assert_int_eq(page_pool_new(16, 4096, UINT64_MAX - 4096, &p), -ERANGE);
        ck_assert_ptr_null(page_pool_free(NULL));
}
END_TEST

START_TEST(test_alloc_free_all) {
        PagePool *p;
        PageId ids[64], id;
        PagePoolStats st;

        ck_assert_int_eq(page_pool_new(64, 4096, 8192, &p), 0);
        ck_assert_uint_eq(page_pool_size(p), 64);
        ck_assert_uint_eq(page_pool_free_count(p), 64);
        for (int i = 0; i < 64; i++) {
                ck_assert_int_eq(page_pool_alloc(p, &ids[i]), 0);
                ck_assert_uint_eq(page_refs(p, ids[i]), 1);
                ck_assert(page_is_exclusive(p, ids[i]));
                ck_assert_uint_eq(page_offset(p, ids[i]), 8192 + (uint64_t)ids[i] * 4096);
                ck_assert_uint_eq(page_from_offset(p, page_offset(p, ids[i])), ids[i]);
        }
        ck_assert_int_eq(page_pool_alloc(p, &id), -ENOSPC);
        ck_assert_uint_eq(page_pool_free_count(p), 0);
        verify(p);
        /* All distinct. */
        for (int i = 0; i < 64; i++)
                for (int j = i + 1; j < 64; j++)
                        ck_assert_uint_ne(ids[i], ids[j]);
        for (int i = 0; i < 64; i++)
                ck_assert_int_eq(page_unref(p, ids[i]), 0);
        ck_assert_uint_eq(page_pool_free_count(p), 64);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.allocs, 64);
        ck_assert_uint_eq(st.frees, 64);
        ck_assert_uint_eq(st.alloc_failures, 1);
        verify(p);

        /* Double free and stale ids are refused, not counted. */
        ck_assert_int_eq(page_unref(p, ids[0]), -ESTALE);
        ck_assert_int_eq(page_ref(p, ids[0]), -ESTALE);
        ck_assert_int_eq(page_lease(p, ids[0]), -ESTALE);
        ck_assert_int_eq(page_unlease(p, ids[0]), -ESTALE);
        ck_assert_int_eq(page_ref(p, 64), -EINVAL);
        ck_assert_int_eq(page_unref(p, PAGE_ID_INVALID), -EINVAL);
        ck_assert_uint_eq(page_offset(p, 64), UINT64_MAX);
        ck_assert_uint_eq(page_from_offset(p, 8192 + 1), PAGE_ID_INVALID);
        ck_assert_uint_eq(page_from_offset(p, 0), PAGE_ID_INVALID);
        ck_assert_uint_eq(page_from_offset(p, 8192 + 64 * 4096), PAGE_ID_INVALID);
        verify(p);
        page_pool_free(p);
}
END_TEST

START_TEST(test_lease_keeps_page) {
        PagePool *p;
        PageId a, b;

        ck_assert_int_eq(page_pool_new(2, 4096, 0, &p), 0);
        ck_assert_int_eq(page_pool_alloc(p, &a), 0);
        ck_assert_int_eq(page_lease(p, a), 0);
        ck_assert(!page_is_exclusive(p, a));
        /* The last reference goes while a transfer still reads the page: it stays. */
        ck_assert_int_eq(page_unref(p, a), 0);
        ck_assert(page_is_allocated(p, a));
        ck_assert_uint_eq(page_pool_free_count(p), 1);
        ck_assert_int_eq(page_pool_alloc(p, &b), 0);
        ck_assert_uint_ne(a, b);
        ck_assert_int_eq(page_pool_alloc(p, &b), -ENOSPC);
        /* A leased page can be referenced again (e.g. a receiver adopting it). */
        ck_assert_int_eq(page_ref(p, a), 0);
        ck_assert_int_eq(page_unref(p, a), 0);
        ck_assert(page_is_allocated(p, a));
        ck_assert_int_eq(page_unlease(p, a), 0);
        ck_assert(!page_is_allocated(p, a));
        ck_assert_uint_eq(page_pool_free_count(p), 1);
        /* And the other order. */
        ck_assert_int_eq(page_lease(p, b), 0);
        ck_assert_int_eq(page_lease(p, b), 0);
        ck_assert_int_eq(page_unlease(p, b), 1);
        ck_assert_int_eq(page_unlease(p, b), 0);
        ck_assert(page_is_allocated(p, b));
        ck_assert_int_eq(page_unref(p, b), 0);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        verify(p);
        page_pool_free(p);
}
END_TEST

START_TEST(test_shared_counters) {
        PagePool *p;
        PageId a;
        PagePoolStats st;

        ck_assert_int_eq(page_pool_new(4, 1000, 0, &p), 0);
        ck_assert_int_eq(page_pool_alloc(p, &a), 0);
        ck_assert_int_eq(page_ref(p, a), 0);
        ck_assert_int_eq(page_ref(p, a), 0);
        ck_assert_int_eq(page_lease(p, a), 0);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.shared, 1);
        ck_assert_uint_eq(st.leased, 1);
        ck_assert_uint_eq(st.refs, 3);
        ck_assert_uint_eq(st.bytes_saved, 2000);
        ck_assert_uint_eq(st.live, 1);
        ck_assert_uint_eq(st.free, 3);
        ck_assert_int_eq(page_unref(p, a), 2);
        ck_assert_int_eq(page_unref(p, a), 1);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.shared, 0);
        ck_assert_uint_eq(st.bytes_saved, 0);
        ck_assert_int_eq(page_unref(p, a), 0);
        ck_assert_int_eq(page_unlease(p, a), 0);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.leased, 0);
        ck_assert_uint_eq(st.free, 4);
        verify(p);
        page_pool_free(p);
}
END_TEST

/* A minimal cache on top of the pool hooks: evicts LRU, counts what it forgot. */
typedef struct MiniCache {
        int forgotten[16];
        size_t n_forgotten;
        size_t calls;
} MiniCache;

static size_t mini_evict(PagePool *pool, size_t want, void *userdata) {
        MiniCache *c = userdata;
        size_t n = 0;
        void *e;
        PageId id;

        c->calls++;
        while (n < want && page_pool_evict_lru(pool, &id, &e) == 0) {
                c->forgotten[c->n_forgotten++] = *(int *)e;
                n++;
        }
        return n;
}

START_TEST(test_cached_lru) {
        PagePool *p;
        PageId ids[4], x;
        int tags[4] = { 10, 11, 12, 13 };
        MiniCache c = {};
        PagePoolStats st;

        ck_assert_int_eq(page_pool_new(4, 64, 0, &p), 0);
        page_pool_set_evict(p, mini_evict, &c);
        ck_assert_int_eq(page_pool_alloc_many(p, 4, ids), 0);
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(page_set_cached(p, ids[i], &tags[i]), 0);
        ck_assert_int_eq(page_set_cached(p, ids[0], &tags[1]), -EBUSY);
        ck_assert(!page_is_exclusive(p, ids[0]));

        /* Release in order 2, 0, 3; keep 1 referenced and lease 3 again. */
        ck_assert_int_eq(page_unref(p, ids[2]), 0);
        ck_assert_int_eq(page_unref(p, ids[0]), 0);
        ck_assert_int_eq(page_unref(p, ids[3]), 0);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.cached_idle, 3);
        ck_assert_uint_eq(st.free, 0);
        ck_assert_uint_eq(st.cached, 4);
        ck_assert(page_pool_can_alloc(p, 3));
        ck_assert(!page_pool_can_alloc(p, 4));
        ck_assert_int_eq(page_lease(p, ids[3]), 0); /* leaves the LRU */
        verify(p);

        /* Alloc evicts the least recently released first: 2, then 0; never 1 or 3. */
        ck_assert_int_eq(page_pool_alloc(p, &x), 0);
        ck_assert_uint_eq(x, ids[2]);
        ck_assert_int_eq(c.forgotten[0], 12);
        ck_assert_ptr_null(page_cached_entry(p, x));
        ck_assert_int_eq(page_pool_alloc(p, &x), 0);
        ck_assert_uint_eq(x, ids[0]);
        ck_assert_int_eq(page_pool_alloc(p, &x), -ENOSPC);
        ck_assert_uint_eq(c.n_forgotten, 2);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.evictions, 2);
        verify(p);

        /* A pin (ref) revives an IDLE page; clearing the cache of an idle page frees it. */
        ck_assert_int_eq(page_unlease(p, ids[3]), 0); /* idle again */
        ck_assert_int_eq(page_ref(p, ids[3]), 0);     /* pinned */
        ck_assert_int_eq(page_pool_alloc(p, &x), -ENOSPC);
        ck_assert_int_eq(page_unref(p, ids[3]), 0);
        ck_assert_int_eq(page_clear_cached(p, ids[3]), 0);
        ck_assert_int_eq(page_clear_cached(p, ids[3]), -ENOENT);
        ck_assert_uint_eq(page_pool_free_count(p), 1);
        ck_assert_int_eq(page_set_cached(p, ids[3], &tags[3]), -ESTALE); /* FREE */
        verify(p);

        /* Teardown. */
        ck_assert_int_eq(page_clear_cached(p, ids[1]), 0);
        ck_assert_int_eq(page_unref(p, ids[1]), 0);
        ck_assert_int_eq(page_unref(p, ids[2]), 0);
        ck_assert_int_eq(page_unref(p, ids[0]), 0);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        ck_assert_int_eq(page_pool_evict_lru(p, &x, NULL), -ENOENT);
        verify(p);
        page_pool_free(p);
}
END_TEST

START_TEST(test_alloc_many_all_or_nothing) {
        PagePool *p;
        PageId ids[8];

        ck_assert_int_eq(page_pool_new(8, 64, 0, &p), 0);
        ck_assert_int_eq(page_pool_alloc_many(p, 5, ids), 0);
        ck_assert_int_eq(page_pool_alloc_many(p, 4, ids + 5), -ENOSPC);
        ck_assert_uint_eq(page_pool_free_count(p), 3);
        ck_assert_int_eq(page_pool_alloc_many(p, 3, ids + 5), 0);
        ck_assert_int_eq(page_pool_alloc_many(p, 0, NULL), 0);
        for (int i = 0; i < 8; i++)
                ck_assert_int_eq(page_unref(p, ids[i]), 0);
        verify(p);
        page_pool_free(p);
}
END_TEST

START_TEST(test_restore) {
        PagePool *p;
        uint32_t refs[8] = { 0, 2, 1, 0, 3, 0, 0, 1 };
        PageId id;

        ck_assert_int_eq(page_pool_new(8, 4096, 0, &p), 0);
        ck_assert_int_eq(page_pool_restore(p, refs), 0);
        ck_assert_int_eq(page_pool_verify(p), 0);
        PagePoolStats s;
        page_pool_stats(p, &s);
        ck_assert_uint_eq(s.free, 4);
        ck_assert_uint_eq(s.refs, 7);
        ck_assert_uint_eq(s.shared, 2);
        ck_assert_uint_eq(page_refs(p, 4), 3);
        /* Free pages come back low ids first, never a restored one. */
        ck_assert_int_eq(page_pool_alloc(p, &id), 0);
        ck_assert_uint_eq(id, 0);
        ck_assert_int_eq(page_pool_alloc(p, &id), 0);
        ck_assert_uint_eq(id, 3);
        /* Only an unused pool. */
        ck_assert_int_eq(page_pool_restore(p, refs), -EBUSY);
        ck_assert_int_eq(page_unref(p, 1), 1);
        ck_assert_int_eq(page_pool_verify(p), 0);
        page_pool_free(p);
}
END_TEST

/* The durable LSN in the tests below: marks at or under it are durable. */
static uint64_t durable_lsn;
static unsigned durable_asked;
static bool durable_test(void *userdata, uint64_t stamp) {
        durable_asked++;
        return stamp != UINT64_MAX && stamp <= durable_lsn;
}

START_TEST(test_free_quarantine_and_marks) {
        PagePool *p;
        PageId a[4], b[4], id;
        ck_assert_int_eq(page_pool_new(8, 4096, 0, &p), 0);
        page_pool_set_durable(p, durable_test, NULL);
        durable_lsn = 0;
        ck_assert_int_eq(page_pool_alloc_many(p, 4, a), 0);
        for (unsigned i = 0; i < 4; i++)
                ck_assert_uint_eq(a[i], i); /* low ids first */
        ck_assert(page_pool_pages_settled(p, a, 4)); /* never freed */

        /* Page 1 freed by record 10, page 3 by record 20 (a mark with no new free adds
         * nothing): neither durable, so the pages never used go first. */
        ck_assert_int_eq(page_unref(p, a[1]), 0);
        page_pool_mark_frees(p, 10);
        ck_assert_int_eq(page_unref(p, a[3]), 0);
        page_pool_mark_frees(p, 20);
        page_pool_mark_frees(p, 30);
        verify(p);
        ck_assert(!page_pool_pages_settled(p, &a[1], 1));
        ck_assert_int_eq(page_pool_alloc_many(p, 4, b), 0);
        for (unsigned i = 0; i < 4; i++) {
                ck_assert_uint_eq(b[i], 4 + i);
                ck_assert(page_pool_pages_settled(p, &b[i], 1));
        }
        /* Nothing else free: the one freed longest ago, which the caller must wait for. */
        ck_assert_int_eq(page_pool_alloc(p, &id), 0);
        ck_assert_uint_eq(id, 1);
        ck_assert(!page_pool_pages_settled(p, &id, 1));
        durable_lsn = 15; /* record 10: page 1 settles, page 3 not yet */
        ck_assert(page_pool_pages_settled(p, &id, 1));
        ck_assert(!page_pool_pages_settled(p, &a[3], 1));
        durable_lsn = 20;
        durable_asked = 0;
        ck_assert(page_pool_pages_settled(p, &a[3], 1));
        ck_assert(page_pool_pages_settled(p, &a[3], 1));
        ck_assert_uint_eq(durable_asked, 1); /* settled once: not asked again */
        verify(p);

        /* Settled pages go last freed first; one freed since (record 40, not durable)
         * waits behind them. */
        ck_assert_int_eq(page_unref(p, b[0]), 0); /* page 4 */
        ck_assert_int_eq(page_unref(p, b[1]), 0); /* page 5 */
        page_pool_mark_frees(p, 20);
        ck_assert_int_eq(page_unref(p, b[2]), 0); /* page 6 */
        page_pool_mark_frees(p, 40);
        PageId c[3];
        ck_assert_int_eq(page_pool_alloc_many(p, 3, c), 0);
        ck_assert_uint_eq(c[0], 5); /* settled, last freed first */
        ck_assert_uint_eq(c[1], 4);
        ck_assert_uint_eq(c[2], 3);
        ck_assert_int_eq(page_pool_alloc(p, &id), 0);
        ck_assert_uint_eq(id, 6);
        ck_assert(!page_pool_pages_settled(p, &id, 1));
        verify(p);

        /* A record refused (UINT64_MAX): what it freed never settles. */
        ck_assert_int_eq(page_unref(p, c[1]), 0);
        page_pool_mark_frees(p, UINT64_MAX);
        durable_lsn = 1000;
        ck_assert(page_pool_pages_settled(p, &id, 1));
        ck_assert(!page_pool_pages_settled(p, &c[1], 1));
        /* Freed and not marked yet: not settled either. */
        ck_assert_int_eq(page_unref(p, c[2]), 0);
        ck_assert(!page_pool_pages_settled(p, &c[2], 1));
        verify(p);
        ck_assert_int_eq(page_pool_alloc(p, &id), 0);
        ck_assert_uint_eq(id, c[1]); /* nothing settled is free: the oldest freed */
        verify(p);

        /* No check: nothing waits, the quarantine is emptied onto the stack. */
        page_pool_set_durable(p, NULL, NULL);
        ck_assert(page_pool_pages_settled(p, &c[2], 1));
        verify(p);
        ck_assert_int_eq(page_pool_alloc(p, &id), 0);
        ck_assert_uint_eq(id, c[2]);
        ck_assert_int_eq(page_pool_alloc(p, &id), -ENOSPC);
        page_pool_free(p);
}
END_TEST

START_TEST(test_free_marks_bounded) {
        /* More marks than are kept apart: the newest takes the later frees (settling
         * later, never earlier). */
        PagePool *p;
        PageId ids[200];
        ck_assert_int_eq(page_pool_new(200, 4096, 0, &p), 0);
        page_pool_set_durable(p, durable_test, NULL);
        durable_lsn = 0;
        ck_assert_int_eq(page_pool_alloc_many(p, 200, ids), 0);
        for (unsigned i = 0; i < 200; i++) {
                ck_assert_int_eq(page_unref(p, ids[i]), 0);
                page_pool_mark_frees(p, 1000 + i);
        }
        verify(p);
        ck_assert_int_eq(page_pool_alloc_many(p, 200, ids), 0);
        for (unsigned i = 0; i < 200; i++)
                ck_assert_uint_eq(ids[i], i); /* the quarantine, oldest first */
        durable_lsn = 1000 + 62; /* the first 63 marks */
        ck_assert(page_pool_pages_settled(p, ids, 63));
        ck_assert(!page_pool_pages_settled(p, &ids[63], 1));
        durable_lsn = 1000 + 198; /* the coalesced last mark took stamp 1199 */
        ck_assert(!page_pool_pages_settled(p, &ids[63], 1));
        durable_lsn = 1000 + 199;
        ck_assert(page_pool_pages_settled(p, ids, 200));
        verify(p);
        page_pool_free(p);
}
END_TEST

int main(void) {
        Suite *s = suite_create("pages");
        TCase *tc = tcase_create("pages");
        tcase_add_test(tc, test_new_args);
        tcase_add_test(tc, test_alloc_free_all);
        tcase_add_test(tc, test_lease_keeps_page);
        tcase_add_test(tc, test_shared_counters);
        tcase_add_test(tc, test_cached_lru);
        tcase_add_test(tc, test_alloc_many_all_or_nothing);
        tcase_add_test(tc, test_restore);
        tcase_add_test(tc, test_free_quarantine_and_marks);
        tcase_add_test(tc, test_free_marks_bounded);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
