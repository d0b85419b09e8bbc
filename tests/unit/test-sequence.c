/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages/directory.h"
#include "macro.h"
#include "pages/pages.h"
#include "pages/sequence.h"
#include "../check-main.h"

#define PS 32 /* page size of the test pools */

typedef struct Arena {
        uint8_t *mem;
        size_t copies;
        int fail_after; /* fail the copy after this many (-1: never) */
} TestArena;

static int arena_copy(void *userdata, uint64_t dst, uint64_t src, uint64_t length) {
        TestArena *a = userdata;
        if (a->fail_after == 0)
                return -EIO;
        if (a->fail_after > 0)
                a->fail_after--;
        memcpy(a->mem + dst, a->mem + src, length);
        a->copies++;
        return 0;
}

static void fill(TestArena *a, PagePool *p, PageId id, uint8_t v) {
        memset(a->mem + page_offset(p, id), v, PS);
}

static uint8_t content(TestArena *a, PagePool *p, PageId id) {
        uint8_t *b = a->mem + page_offset(p, id);
        bool uniform = true;
        for (size_t i = 1; i < PS; i++)
                uniform = uniform && b[i] == b[0];
        ck_assert_msg(uniform, "page %" PRIu32 " was partly overwritten", id);
        return b[0];
}

START_TEST(test_clone_and_cow) {
        PagePool *p;
        Sequence *s, *c, *cc;
        TestArena a = { .mem = calloc(16, PS), .fail_after = -1 };
        PageId ids[4], w[4];
        size_t copied;
        PagePoolStats st;

        ck_assert_int_eq(page_pool_new(16, PS, 0, &p), 0);
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, 4, ids), 0);
        for (int i = 0; i < 4; i++)
                fill(&a, p, ids[i], (uint8_t)(1 + i));

        /* A clone copies nothing and shares everything. */
        ck_assert_int_eq(sequence_clone(s, &c), 0);
        ck_assert_uint_eq(a.copies, 0);
        ck_assert_uint_eq(sequence_size(c), 4);
        ck_assert_mem_eq(sequence_pages(c), sequence_pages(s), 4 * sizeof(PageId));
        ck_assert_uint_eq(sequence_shared_pages(s), 4);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.shared, 4);
        ck_assert_uint_eq(st.bytes_saved, 4 * PS);
        ck_assert_uint_eq(st.live, 4);

        /* Writing pages 1..2 of the clone copies exactly those two. */
        ck_assert_int_eq(sequence_prepare_write(c, 1, 2, arena_copy, &a, w, &copied), 0);
        ck_assert_uint_eq(copied, 2);
        ck_assert_uint_eq(a.copies, 2);
        ck_assert_uint_ne(w[0], ids[1]);
        ck_assert_uint_ne(w[1], ids[2]);
        ck_assert_uint_eq(content(&a, p, w[0]), 2);
        ck_assert_uint_eq(content(&a, p, w[1]), 3);
        fill(&a, p, w[0], 0x42);
        ck_assert_uint_eq(content(&a, p, ids[1]), 2); /* the original is untouched */
        ck_assert_uint_eq(c->cow_copies, 2);

        /* Writing them again copies nothing: they are exclusive now. */
        ck_assert_int_eq(sequence_prepare_write(c, 0, 4, arena_copy, &a, w, &copied), 0);
        ck_assert_uint_eq(copied, 2); /* pages 0 and 3 were still shared with s */
        ck_assert_uint_eq(a.copies, 4);
        ck_assert_uint_eq(sequence_shared_pages(s), 0);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.cow_copies, 4);
        ck_assert_uint_eq(st.cow_bytes, 4 * PS);

        /* Nested clone, released in every order. */
        ck_assert_int_eq(sequence_clone(c, &cc), 0);
        sequence_free(c);
        ck_assert_uint_eq(content(&a, p, sequence_pages(cc)[1]), 0x42);
        sequence_free(s);
        sequence_free(cc);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        ck_assert_int_eq(page_pool_verify(p), 0);
        page_pool_free(p);
        free(a.mem);
}
END_TEST

/* Copy-on-write in two steps (a copy that finishes later): the table is unchanged until
 * the commit; the plan keeps its pages alive even when the sequence goes first; a slot
 * that changed meanwhile keeps its page and the copy is dropped. */
START_TEST(test_cow_plan_commit) {
        PagePool *p;
        Sequence *s, *c;
        SequenceCow *cow;
        TestArena a = { .mem = calloc(16, PS), .fail_after = -1 };
        PageId ids[4];
        PagePoolStats st;

        ck_assert_int_eq(page_pool_new(16, PS, 0, &p), 0);
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, 4, ids), 0);
        for (int i = 0; i < 4; i++)
                fill(&a, p, ids[i], (uint8_t)(1 + i));
        ck_assert_int_eq(sequence_clone(s, &c), 0);

        /* Nothing to copy in exclusive pages: no plan. */
        PageId extra;
        ck_assert_int_eq(sequence_append(c, 1, &extra), 0);
        ck_assert_int_eq(sequence_cow_plan(c, 4, 1, &cow), 0);
        ck_assert_ptr_null(cow);
        ck_assert_int_eq(sequence_cow_plan(c, 4, 2, &cow), -EINVAL);

        /* Plan pages 1..3: three fresh pages, the table as it was. */
        ck_assert_int_eq(sequence_cow_plan(c, 1, 3, &cow), 0);
        ck_assert_ptr_nonnull(cow);
        ck_assert_uint_eq(cow->n, 3);
        ck_assert_mem_eq(sequence_pages(c), ids, 4 * sizeof(PageId));
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.live, 4 + 1 + 3);
        for (size_t j = 0; j < cow->n; j++) {
                ck_assert_uint_eq(cow->original[j], ids[1 + j]);
                ck_assert_uint_eq(page_refs(p, cow->original[j]), 3); /* s, c and the plan */
                memcpy(a.mem + page_offset(p, cow->fresh[j]), a.mem + page_offset(p, cow->original[j]), PS);
        }
        /* Meanwhile slot 2 is written by another path (truncate and re-append). */
        PageId slot3 = sequence_pages(c)[3];
        ck_assert_int_eq(sequence_truncate(c, 2), 0);
        PageId fresh2;
        ck_assert_int_eq(sequence_append(c, 1, &fresh2), 0);
        ck_assert_int_eq(sequence_append_pages(c, &slot3, 1), 0);
        ck_assert_uint_eq(sequence_cow_commit(c, cow), 2); /* slots 1 and 3; slot 2's copy dropped */
        ck_assert_uint_eq(c->cow_copies, 2);
        ck_assert_uint_ne(sequence_pages(c)[1], ids[1]);
        ck_assert_uint_eq(sequence_pages(c)[2], fresh2);
        ck_assert_uint_ne(sequence_pages(c)[3], ids[3]);
        ck_assert_uint_eq(content(&a, p, sequence_pages(c)[1]), 2);
        ck_assert_uint_eq(content(&a, p, sequence_pages(c)[3]), 4);
        for (int i = 0; i < 4; i++)
                ck_assert_uint_eq(page_refs(p, ids[i]), i == 0 ? 2 : 1);

        /* The sequence goes while a plan is out: the plan's pages stay until it goes. */
        ck_assert_int_eq(sequence_cow_plan(c, 0, 1, &cow), 0);
        ck_assert_ptr_nonnull(cow);
        sequence_free(c);
        ck_assert_uint_eq(page_refs(p, cow->original[0]), 2); /* s and the plan */
        ck_assert(page_is_allocated(p, cow->fresh[0]));
        ck_assert_uint_eq(sequence_cow_commit(NULL, cow), 0);
        sequence_free(s);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.live, 0);
        ck_assert_int_eq(page_pool_verify(p), 0);

        /* Out of pages: nothing changes. */
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, 10, NULL), 0);
        ck_assert_int_eq(sequence_clone(s, &c), 0);
        ck_assert_int_eq(sequence_cow_plan(c, 0, 10, &cow), -ENOSPC);
        ck_assert_ptr_null(cow);
        ck_assert_int_eq(sequence_cow_plan(c, 0, 6, &cow), 0);
        sequence_cow_free(cow);
        sequence_free(c);
        sequence_free(s);
        page_pool_stats(p, &st);
        ck_assert_uint_eq(st.live, 0);
        ck_assert_int_eq(page_pool_verify(p), 0);
        page_pool_free(p);
        free(a.mem);
}
END_TEST

START_TEST(test_write_exclusive_no_copy) {
        PagePool *p;
        Sequence *s;
        PageId ids[3], w[3];
        size_t copied = 99;

        ck_assert_int_eq(page_pool_new(3, PS, 0, &p), 0);
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, 3, ids), 0);
        /* No copy needed: the callback may be NULL. */
        ck_assert_int_eq(sequence_prepare_write(s, 0, 3, NULL, NULL, w, &copied), 0);
        ck_assert_uint_eq(copied, 0);
        ck_assert_mem_eq(w, ids, sizeof ids);
        ck_assert_int_eq(sequence_prepare_write(s, 3, 0, NULL, NULL, NULL, NULL), 0);
        ck_assert_int_eq(sequence_prepare_write(s, 2, 2, NULL, NULL, NULL, NULL), -EINVAL);
        ck_assert_int_eq(sequence_prepare_write(s, 4, 0, NULL, NULL, NULL, NULL), -EINVAL);
        ck_assert_int_eq(sequence_prepare_write(s, SIZE_MAX, 2, NULL, NULL, NULL, NULL), -EINVAL);
        sequence_free(s);
        page_pool_free(p);
}
END_TEST

START_TEST(test_write_all_or_nothing) {
        PagePool *p;
        Sequence *s, *c;
        TestArena a = { .mem = calloc(6, PS), .fail_after = -1 };
        PageId ids[3];
        size_t copied;

        ck_assert_int_eq(page_pool_new(6, PS, 0, &p), 0);
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, 3, ids), 0);
        ck_assert_int_eq(sequence_clone(s, &c), 0);

        /* A copy fails half-way: nothing changes, no page leaks. */
        a.fail_after = 1;
        ck_assert_int_eq(sequence_prepare_write(c, 0, 3, arena_copy, &a, NULL, &copied), -EIO);
        ck_assert_mem_eq(sequence_pages(c), ids, sizeof ids);
        ck_assert_uint_eq(page_pool_free_count(p), 3);
        /* Needs a copy but no callback. */
        ck_assert_int_eq(sequence_prepare_write(c, 0, 1, NULL, NULL, NULL, NULL), -EINVAL);

        /* Too few pages: 3 free, 4 needed after appending one more shared page. */
        a.fail_after = -1;
        PageId extra;
        ck_assert_int_eq(sequence_append(s, 1, &extra), 0);
        ck_assert_int_eq(sequence_append_pages(c, &extra, 1), 0);
        ck_assert_int_eq(sequence_prepare_write(c, 0, 4, arena_copy, &a, NULL, &copied), -ENOSPC);
        ck_assert_uint_eq(page_pool_free_count(p), 2);
        ck_assert_int_eq(page_pool_verify(p), 0);
        sequence_free(s);
        ck_assert_int_eq(sequence_prepare_write(c, 0, 4, arena_copy, &a, NULL, &copied), 0);
        ck_assert_uint_eq(copied, 0); /* s went away: c holds every page alone */
        sequence_free(c);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        page_pool_free(p);
        free(a.mem);
}
END_TEST

START_TEST(test_duplicate_page_in_range) {
        PagePool *p;
        Sequence *s;
        TestArena a = { .mem = calloc(4, PS), .fail_after = -1 };
        PageId id, w[2];
        size_t copied;

        ck_assert_int_eq(page_pool_new(4, PS, 0, &p), 0);
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, 1, &id), 0);
        ck_assert_int_eq(sequence_append_pages(s, &id, 1), 0); /* same page twice */
        ck_assert_uint_eq(page_refs(p, id), 2);
        ck_assert_int_eq(sequence_prepare_write(s, 0, 2, arena_copy, &a, w, &copied), 0);
        ck_assert_uint_eq(copied, 2);
        ck_assert_uint_ne(w[0], w[1]);
        ck_assert(!page_is_allocated(p, id));
        ck_assert_int_eq(page_pool_verify(p), 0);
        sequence_free(s);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        page_pool_free(p);
        free(a.mem);
}
END_TEST

START_TEST(test_release_while_leased) {
        PagePool *p;
        Sequence *s, *c;
        TestArena a = { .mem = calloc(8, PS), .fail_after = -1 };
        PageId ids[4], leased[2], w[4];
        size_t copied;

        ck_assert_int_eq(page_pool_new(8, PS, 0, &p), 0);
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, 4, ids), 0);
        ck_assert_int_eq(sequence_lease(s, 1, 2, leased), 0);
        ck_assert_uint_eq(leased[0], ids[1]);
        ck_assert_int_eq(sequence_lease(s, 3, 2, leased), -EINVAL);

        /* A leased page is copied before a write (the transfer reads it). */
        ck_assert_int_eq(sequence_prepare_write(s, 0, 4, arena_copy, &a, w, &copied), 0);
        ck_assert_uint_eq(copied, 2);
        ck_assert_uint_eq(page_refs(p, ids[1]), 0);
        ck_assert(page_is_allocated(p, ids[1])); /* kept by its lease */

        ck_assert_int_eq(sequence_clone(s, &c), 0);
        sequence_free(s);
        ck_assert_int_eq(sequence_truncate(c, 5), -EINVAL);
        ck_assert_int_eq(sequence_truncate(c, 1), 0);
        ck_assert_uint_eq(sequence_size(c), 1);
        sequence_free(c);
        ck_assert_uint_eq(page_pool_retained(p), 2);
        ck_assert_int_eq(page_unlease(p, leased[0]), 0);
        ck_assert_int_eq(page_unlease(p, leased[1]), 0);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        ck_assert_int_eq(page_pool_verify(p), 0);
        page_pool_free(p);
        free(a.mem);
}
END_TEST

START_TEST(test_new_from_pages) {
        PagePool *p;
        Sequence *s;
        PageId ids[3];

        ck_assert_int_eq(page_pool_new(4, PS, 0, &p), 0);
        /* The receiving side of a handoff: pages allocated and leased while bytes land. */
        ck_assert_int_eq(page_pool_alloc_many(p, 3, ids), 0);
        for (int i = 0; i < 3; i++)
                ck_assert_int_eq(page_lease(p, ids[i]), 0);
        ck_assert_int_eq(sequence_new_from_pages(p, ids, 3, &s), 0);
        for (int i = 0; i < 3; i++) {
                ck_assert_uint_eq(page_refs(p, ids[i]), 2);
                ck_assert_int_eq(page_unref(p, ids[i]), 1);
                ck_assert_int_eq(page_unlease(p, ids[i]), 0);
                ck_assert(page_is_exclusive(p, ids[i]));
        }
        /* A FREE page in the list: refused, nothing changed. */
        PageId bad[2] = { ids[0], 3 };
        Sequence *t = NULL;
        ck_assert_int_eq(sequence_new_from_pages(p, bad, 2, &t), -ESTALE);
        ck_assert_ptr_null(t);
        ck_assert_uint_eq(page_refs(p, ids[0]), 1);
        ck_assert_int_eq(sequence_new_from_pages(p, NULL, 0, &t), 0);
        ck_assert_uint_eq(sequence_size(t), 0);
        sequence_free(t);
        sequence_free(s);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        page_pool_free(p);
}
END_TEST

START_TEST(test_append_limits) {
        PagePool *p;
        Sequence *s;

        ck_assert_int_eq(page_pool_new(4, PS, 0, &p), 0);
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, 5, NULL), -ENOSPC);
        ck_assert_int_eq(sequence_append(s, (size_t)SEQUENCE_PAGES_MAX + 1, NULL), -E2BIG);
        ck_assert_int_eq(sequence_append(s, SIZE_MAX, NULL), -E2BIG);
        ck_assert_int_eq(sequence_append(s, (size_t)SEQUENCE_PAGES_MAX, NULL), -ENOSPC);
        ck_assert_uint_eq(sequence_size(s), 0);
        ck_assert_uint_le(s->n_allocated, 16); /* a refused request grew nothing */
        ck_assert_uint_eq(page_pool_free_count(p), 4);
        ck_assert_int_eq(sequence_append(s, 4, NULL), 0);
        sequence_release_pages(s);
        ck_assert_uint_eq(page_pool_free_count(p), 4);
        sequence_free(s);
        ck_assert_ptr_null(sequence_free(NULL));
        page_pool_free(p);
}
END_TEST

/* ------------------------------------------------------------------------------------
 * Model-based test: random operations on sequences, clones, writes, leases, pins and
 * the directory, checked after every step against a reference model. */

#define NP 40
#define MAXS 10
#define MAXSLOTS 24
#define NHASH 48
#define MAXPINS 64
#define MAXLEASES 64

typedef struct Model {
        Sequence *seq[MAXS];
        uint8_t value[MAXS][MAXSLOTS * 4]; /* expected content per slot */
        PageId pins[MAXPINS];
        size_t n_pins;
        PageId leases[MAXLEASES];
        size_t n_leases;
        bool dir_has[NHASH];
        PageId dir_page[NHASH];
        uint8_t dir_value[NHASH];
} Model;

/* ck_assert records every passing check (a write to its results pipe): the model's
 * per-step sweeps check with plain comparisons and fail through ck_abort_msg(). */
#define MUST(cond)                                                                       \
        do {                                                                             \
                if (!(cond))                                                             \
                        ck_abort_msg("model mismatch at line %d: %s", __LINE__, #cond);  \
        } while (0)

static uint8_t content_fast(TestArena *a, PagePool *p, PageId id) {
        uint8_t *b = a->mem + page_offset(p, id);
        for (size_t i = 1; i < PS; i++)
                MUST(b[i] == b[0]);
        return b[0];
}

static uint64_t rng_state;
static uint64_t rnd(void) {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        return rng_state;
}
static size_t rn(size_t n) {
        return n ? (size_t)(rnd() % n) : 0;
}

static uint64_t hkey(size_t h) {
        return UINT64_C(0x9e3779b97f4a7c15) * (h + 1);
}

typedef struct Expect {
        uint32_t refs[NP], leases[NP];
        bool cached[NP];
        size_t free, idle;
} Expect;

static void expect_compute(const Model *m, Expect *e) {
        memset(e, 0, sizeof *e);
        for (size_t i = 0; i < MAXS; i++)
                for (size_t k = 0; m->seq[i] && k < m->seq[i]->n_pages; k++)
                        e->refs[m->seq[i]->pages[k]]++;
        for (size_t i = 0; i < m->n_pins; i++)
                e->refs[m->pins[i]]++;
        for (size_t i = 0; i < m->n_leases; i++)
                e->leases[m->leases[i]]++;
        for (size_t h = 0; h < NHASH; h++)
                if (m->dir_has[h])
                        e->cached[m->dir_page[h]] = true;
        for (size_t p = 0; p < NP; p++)
                if (e->refs[p] == 0 && e->leases[p] == 0) {
                        if (e->cached[p])
                                e->idle++;
                        else
                                e->free++;
                }
}

static void check_model(const Model *m, PagePool *p, Directory *d, TestArena *a) {
        Expect e;
        PagePoolStats st;
        size_t shared = 0, leased = 0, n_dir = 0;

        expect_compute(m, &e);
        for (PageId i = 0; i < NP; i++) {
                MUST((page_refs(p, i)) == (e.refs[i]));
                MUST((page_leases(p, i)) == (e.leases[i]));
                MUST((!!page_cached_entry(p, i)) == (e.cached[i]));
                shared += e.refs[i] >= 2;
                leased += e.leases[i] > 0;
        }
        page_pool_stats(p, &st);
        MUST((st.free) == (e.free));
        MUST((st.cached_idle) == (e.idle));
        MUST((st.shared) == (shared));
        MUST((st.leased) == (leased));
        MUST((page_pool_verify(p)) == (0));
        for (size_t h = 0; h < NHASH; h++)
                if (m->dir_has[h]) {
                        n_dir++;
                        /* A cached block's bytes never change. */
                        MUST((content_fast(a, p, m->dir_page[h])) == (m->dir_value[h]));
                }
        MUST((directory_size(d)) == (n_dir));
        MUST((directory_orphans(d)) == (0));
        /* Copy-on-write: every slot of every sequence shows what was written to it. */
        for (size_t i = 0; i < MAXS; i++)
                for (size_t k = 0; m->seq[i] && k < m->seq[i]->n_pages; k++)
                        MUST((content_fast(a, p, m->seq[i]->pages[k])) == (m->value[i][k]));
}

/* Entries evicted by the last allocation: drop them from the model. They must have
 * been IDLE before it; returns how many. */
static size_t sync_evicted(Model *m, const Expect *before, Directory *d, PagePool *p) {
        size_t n = 0;
        for (size_t h = 0; h < NHASH; h++) {
                if (!m->dir_has[h])
                        continue;
                uint64_t k = hkey(h);
                if (directory_match_len(d, p, &k, 1) == 1)
                        continue;
                PageId pg = m->dir_page[h];
                ck_assert_uint_eq(before->refs[pg], 0);
                ck_assert_uint_eq(before->leases[pg], 0);
                m->dir_has[h] = false;
                n++;
        }
        return n;
}

static void run_model(uint64_t seed, size_t steps) {
        PagePool *p;
        Directory *d;
        TestArena a = { .mem = calloc(NP, PS), .fail_after = -1 };
        Model m = {};
        uint8_t next_value = 1;
        size_t ops[16] = {};

        rng_state = seed ? seed : 1;
        ck_assert_int_eq(page_pool_new(NP, PS, 0, &p), 0);
        ck_assert_int_eq(directory_new(&d), 0);
        directory_attach_pool(d, p);

        for (size_t step = 0; step < steps; step++) {
                Expect before;
                size_t i = rn(MAXS), op = rn(13);
                Sequence *s = m.seq[i];
                int r;

                expect_compute(&m, &before);
                ops[op]++;
                switch (op) {
                case 0: /* create or grow */
                case 1: {
                        size_t k = 1 + rn(6);
                        PageId ids[8];
                        if (!s) {
                                ck_assert_int_eq(sequence_new(p, &m.seq[i]), 0);
                                s = m.seq[i];
                        }
                        if (s->n_pages + k > MAXSLOTS)
                                break;
                        r = sequence_append(s, k, ids);
                        if (k > before.free + before.idle) {
                                ck_assert_int_eq(r, -ENOSPC);
                                ck_assert_uint_eq(sync_evicted(&m, &before, d, p), 0);
                                break;
                        }
                        ck_assert_int_eq(r, 0);
                        ck_assert_uint_eq(sync_evicted(&m, &before, d, p),
                                          k > before.free ? k - before.free : 0);
                        for (size_t j = 0; j < k; j++) {
                                fill(&a, p, ids[j], next_value);
                                m.value[i][s->n_pages - k + j] = next_value++;
                        }
                        break;
                }
                case 2: { /* clone into a free slot */
                        size_t t = rn(MAXS);
                        if (!s || m.seq[t])
                                break;
                        ck_assert_int_eq(sequence_clone(s, &m.seq[t]), 0);
                        memcpy(m.value[t], m.value[i], sizeof m.value[i]);
                        break;
                }
                case 3: /* write a range */
                case 4: {
                        if (!s || s->n_pages == 0)
                                break;
                        size_t first = rn(s->n_pages), count = 1 + rn(s->n_pages - first);
                        size_t need = 0, copied;
                        PageId w[MAXSLOTS];
                        /* Model of "exclusive": refs 1, no lease, not cached. */
                        for (size_t k = first; k < first + count; k++) {
                                PageId pg = s->pages[k];
                                need += !(before.refs[pg] == 1 && before.leases[pg] == 0 && !before.cached[pg]);
                        }
                        size_t copies_before = a.copies;
                        r = sequence_prepare_write(s, first, count, arena_copy, &a, w, &copied);
                        if (need > before.free + before.idle) {
                                ck_assert_int_eq(r, -ENOSPC);
                                break;
                        }
                        ck_assert_int_eq(r, 0);
                        ck_assert_uint_eq(copied, need);
                        ck_assert_uint_eq(a.copies - copies_before, need);
                        ck_assert_uint_eq(sync_evicted(&m, &before, d, p),
                                          need > before.free ? need - before.free : 0);
                        /* Write a few of the writable pages. */
                        for (size_t k = 0; k < count; k++)
                                if (rn(2)) {
                                        fill(&a, p, w[k], next_value);
                                        m.value[i][first + k] = next_value++;
                                }
                        break;
                }
                case 5: /* truncate */
                        if (!s)
                                break;
                        ck_assert_int_eq(sequence_truncate(s, rn(s->n_pages + 1)), 0);
                        break;
                case 6: /* release */
                        m.seq[i] = sequence_free(s);
                        break;
                case 7: { /* lease a range */
                        if (!s || s->n_pages == 0)
                                break;
                        size_t first = rn(s->n_pages), count = 1 + rn(MIN(s->n_pages - first, (size_t)4));
                        if (m.n_leases + count > MAXLEASES)
                                break;
                        ck_assert_int_eq(sequence_lease(s, first, count, m.leases + m.n_leases), 0);
                        m.n_leases += count;
                        break;
                }
                case 8: { /* end a lease */
                        if (m.n_leases == 0)
                                break;
                        size_t k = rn(m.n_leases);
                        ck_assert_int_eq(page_unlease(p, m.leases[k]) >= 0, 1);
                        m.leases[k] = m.leases[--m.n_leases];
                        break;
                }
                case 9: { /* publish a page of a sequence under a hash */
                        if (!s || s->n_pages == 0)
                                break;
                        size_t k = rn(s->n_pages), h = rn(NHASH);
                        PageId pg = s->pages[k];
                        r = directory_insert(d, p, hkey(h), pg);
                        if (m.dir_has[h])
                                ck_assert_int_eq(r, -EEXIST);
                        else if (before.cached[pg])
                                ck_assert_int_eq(r, -EBUSY);
                        else {
                                ck_assert_int_eq(r, 0);
                                m.dir_has[h] = true;
                                m.dir_page[h] = pg;
                                m.dir_value[h] = m.value[i][k];
                        }
                        break;
                }
                case 10: { /* look up a chain, keep the pins */
                        uint64_t chain[6];
                        size_t hidx[6];
                        PageId got[6];
                        size_t n = 1 + rn(6), len, want = 0;
                        for (size_t k = 0; k < n; k++) {
                                /* Often walk along existing entries so that hits happen. */
                                size_t h = rn(NHASH);
                                if (rn(3)) {
                                        for (size_t t = 0; t < NHASH; t++)
                                                if (m.dir_has[(h + t) % NHASH]) {
                                                        h = (h + t) % NHASH;
                                                        break;
                                                }
                                }
                                hidx[k] = h;
                                chain[k] = hkey(h);
                        }
                        while (want < n && m.dir_has[hidx[want]])
                                want++;
                        if (m.n_pins + n > MAXPINS)
                                break;
                        ck_assert_int_eq(directory_lookup(d, p, chain, n, got, &len), 0);
                        ck_assert_uint_eq(len, want);
                        for (size_t k = 0; k < len; k++) {
                                ck_assert_uint_eq(got[k], m.dir_page[hidx[k]]);
                                m.pins[m.n_pins++] = got[k];
                        }
                        break;
                }
                case 11: { /* unpin, or turn pins into a new sequence */
                        if (m.n_pins == 0)
                                break;
                        if (!s && rn(2)) {
                                size_t n = MIN(m.n_pins, (size_t)MAXSLOTS);
                                ck_assert_int_eq(sequence_new_from_pages(p, m.pins + m.n_pins - n, n, &m.seq[i]), 0);
                                for (size_t k = 0; k < n; k++) {
                                        PageId pg = m.pins[m.n_pins - n + k];
                                        m.value[i][k] = content(&a, p, pg);
                                        ck_assert_int_eq(page_unref(p, pg) >= 1, 1);
                                }
                                m.n_pins -= n;
                        } else {
                                size_t k = rn(m.n_pins);
                                ck_assert_int_eq(page_unref(p, m.pins[k]) >= 0, 1);
                                m.pins[k] = m.pins[--m.n_pins];
                        }
                        break;
                }
                case 12: { /* forget a hash */
                        size_t h = rn(NHASH);
                        r = directory_remove(d, hkey(h));
                        ck_assert_int_eq(r, m.dir_has[h] ? 0 : -ENOENT);
                        m.dir_has[h] = false;
                        break;
                }
                }
                check_model(&m, p, d, &a);
        }

        /* Tear down in a random order: everything must come back. */
        for (size_t i = 0; i < MAXS; i++)
                m.seq[(i * 7 + 3) % MAXS] = sequence_free(m.seq[(i * 7 + 3) % MAXS]);
        while (m.n_leases > 0)
                ck_assert_int_eq(page_unlease(p, m.leases[--m.n_leases]) >= 0, 1);
        while (m.n_pins > 0)
                ck_assert_int_eq(page_unref(p, m.pins[--m.n_pins]) >= 0, 1);
        check_model(&m, p, d, &a);
        /* The run exercised what it claims to. */
        DirectoryStats ds;
        PagePoolStats st;
        directory_stats(d, &ds);
        page_pool_stats(p, &st);
        ck_assert_uint_gt(ds.evictions, 0);
        ck_assert_uint_gt(ds.hits, 0);
        ck_assert_uint_gt(st.cow_copies, 0);
        ck_assert_uint_gt(st.alloc_failures, 0);
        directory_free(d);
        ck_assert_uint_eq(page_pool_free_count(p), NP);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        ck_assert_int_eq(page_pool_verify(p), 0);
        for (size_t k = 0; k < 13; k++)
                ck_assert_uint_gt(ops[k], 0);
        page_pool_free(p);
        free(a.mem);
}

START_TEST(test_model) {
        const char *e = getenv("EPD_TEST_SEED");
        uint64_t seed = e ? strtoull(e, NULL, 0) : UINT64_C(0x5eed) + (uint64_t)_i;
        const char *st = getenv("EPD_TEST_STEPS");
        run_model(seed, st ? strtoul(st, NULL, 0) : 6000);
}
END_TEST

int main(void) {
        Suite *s = suite_create("sequence");
        TCase *tc = tcase_create("sequence");
        tcase_add_test(tc, test_clone_and_cow);
        tcase_add_test(tc, test_cow_plan_commit);
        tcase_add_test(tc, test_write_exclusive_no_copy);
        tcase_add_test(tc, test_write_all_or_nothing);
        tcase_add_test(tc, test_duplicate_page_in_range);
        tcase_add_test(tc, test_release_while_leased);
        tcase_add_test(tc, test_new_from_pages);
        tcase_add_test(tc, test_append_limits);
        tcase_add_loop_test(tc, test_model, 0, 4);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
