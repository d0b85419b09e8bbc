/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages/directory-record.h"
#include "pages/directory.h"
#include "hashmap.h"
#include "macro.h"
#include "pages/sequence.h"
#include "../check-main.h"

/* A vLLM-style chained block hash: hash(parent, tokens of the block). */
static void chain_hashes(const uint32_t *tokens, size_t n_tokens, size_t block, uint64_t *ret) {
        uint64_t parent = 0;
        uint8_t buf[8 + 4 * 64];

        ck_assert_uint_le(block, 64);
        for (size_t b = 0; b < n_tokens / block; b++) {
                memcpy(buf, &parent, 8);
                memcpy(buf + 8, tokens + b * block, 4 * block);
                parent = ret[b] = hashmap_hash_bytes(buf, 8 + 4 * block);
        }
}

START_TEST(test_insert_lookup_pin) {
        PagePool *p, *q;
        Directory *d;
        PageId ids[4], got[6];
        uint64_t h[6] = { 11, 12, 13, 14, 15, 16 };
        size_t len;

        ck_assert_int_eq(page_pool_new(8, 64, 0, &p), 0);
        ck_assert_int_eq(page_pool_new(8, 64, 0, &q), 0);
        ck_assert_int_eq(directory_new(&d), 0);
        ck_assert_int_eq(page_pool_alloc_many(p, 4, ids), 0);

        /* Not attached: refused. */
        ck_assert_int_eq(directory_insert(d, p, h[0], ids[0]), -EINVAL);
        directory_attach_pool(d, p);
        directory_attach_pool(d, p); /* idempotent */
        ck_assert_int_eq(directory_insert_chain(d, p, h, ids, 4), 4);
        ck_assert_uint_eq(directory_size(d), 4);
        ck_assert_int_eq(directory_insert(d, p, h[0], ids[1]), -EEXIST);
        ck_assert_int_eq(directory_insert(d, p, h[5], ids[1]), -EBUSY);
        ck_assert_int_eq(directory_insert(d, p, h[5], 99), -EINVAL);
        ck_assert_int_eq(directory_insert_chain(d, p, h, ids, 4), 0);

        /* Chains: full hit of 4 out of 6; a miss at the start; a hole in the middle. */
        ck_assert_int_eq(directory_lookup(d, p, h, 6, got, &len), 0);
        ck_assert_uint_eq(len, 4);
        ck_assert_mem_eq(got, ids, sizeof ids);
        for (int i = 0; i < 4; i++)
                ck_assert_uint_eq(page_refs(p, ids[i]), 2); /* ours + the pin */
        uint64_t miss[2] = { 99, 11 };
        ck_assert_int_eq(directory_lookup(d, p, miss, 2, got, &len), 0);
        ck_assert_uint_eq(len, 0);
        ck_assert_int_eq(directory_remove(d, 13), 0);
        ck_assert_int_eq(directory_remove(d, 13), -ENOENT);
        ck_assert_uint_eq(directory_match_len(d, p, h, 6), 2);
        /* Another pool's lookup never returns p's pages. */
        ck_assert_int_eq(directory_lookup(d, q, h, 6, got, &len), 0);
        ck_assert_uint_eq(len, 0);

        DirectoryStats st;
        directory_stats(d, &st);
        ck_assert_uint_eq(st.entries, 3);
        ck_assert_uint_eq(st.lookups, 3);
        ck_assert_uint_eq(st.hits, 4);
        ck_assert_uint_eq(st.misses, 3);
        ck_assert_uint_eq(st.inserts, 4);
        ck_assert_uint_eq(st.conflicts, 2 + 4);

        /* Unpin, drop our own references: the cached ones stay IDLE, the other FREE. */
        for (int i = 0; i < 4; i++) {
                ck_assert_int_eq(page_unref(p, ids[i]), 1);
                ck_assert_int_eq(page_unref(p, ids[i]), 0);
        }
        ck_assert_uint_eq(page_pool_retained(p), 3);
        ck_assert_uint_eq(directory_orphans(d), 0);
        directory_detach_pool(d, p);
        ck_assert_uint_eq(directory_size(d), 0);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        ck_assert_int_eq(page_pool_verify(p), 0);
        directory_free(d);
        page_pool_free(p);
        page_pool_free(q);
}
END_TEST

START_TEST(test_eviction_lru_never_pinned_or_leased) {
        PagePool *p;
        Directory *d;
        PageId ids[6], got[1], x;
        size_t len;
        uint64_t h[6] = { 1, 2, 3, 4, 5, 6 };

        ck_assert_int_eq(page_pool_new(6, 64, 0, &p), 0);
        ck_assert_int_eq(directory_new(&d), 0);
        directory_attach_pool(d, p);
        ck_assert_int_eq(page_pool_alloc_many(p, 6, ids), 0);
        ck_assert_int_eq(directory_insert_chain(d, p, h, ids, 6), 6);
        /* Release in order 5, 4, 3, 2, 1, 0 → LRU order is 5 first. */
        for (int i = 5; i >= 0; i--)
                ck_assert_int_eq(page_unref(p, ids[i]), 0);
        ck_assert_uint_eq(page_pool_free_count(p), 0);

        /* Pin hash 6 (page 5) and lease page 4. */
        ck_assert_int_eq(directory_lookup(d, p, &h[5], 1, got, &len), 0);
        ck_assert_uint_eq(len, 1);
        ck_assert_int_eq(page_lease(p, ids[4]), 0);

        /* Four allocations evict pages 3, 2, 1, 0 in that order; then nothing is left. */
        for (int i = 3; i >= 0; i--) {
                ck_assert_int_eq(page_pool_alloc(p, &x), 0);
                ck_assert_uint_eq(x, ids[i]);
                ck_assert_uint_eq(directory_match_len(d, p, &h[i], 1), 0);
        }
        ck_assert_int_eq(page_pool_alloc(p, &x), -ENOSPC);
        ck_assert_uint_eq(directory_size(d), 2);
        ck_assert_uint_eq(directory_match_len(d, p, &h[4], 2), 2);
        DirectoryStats st;
        directory_stats(d, &st);
        ck_assert_uint_eq(st.evictions, 4);
        ck_assert_uint_eq(directory_orphans(d), 0);

        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(page_unref(p, ids[i]), 0);
        ck_assert_int_eq(page_unref(p, got[0]), 0);
        ck_assert_int_eq(page_unlease(p, ids[4]), 0);
        directory_free(d); /* forgets the rest and detaches */
        ck_assert_uint_eq(page_pool_retained(p), 0);
        ck_assert_int_eq(page_pool_verify(p), 0);
        page_pool_free(p);
}
END_TEST

/* The prototype's matching was quadratic on repetitive tokens. With chained hashes a
 * lookup of n blocks costs at most n probes, however repetitive the tokens are: count
 * the probes (not time) for growing n. */
START_TEST(test_matching_linear) {
        enum { BLOCK = 16, MAX_BLOCKS = 1 << 15 };
        PagePool *p;
        Directory *d;
        Sequence *s;
        uint32_t *tokens = malloc(sizeof(uint32_t) * BLOCK * MAX_BLOCKS);
        uint64_t *hashes = malloc(sizeof(uint64_t) * MAX_BLOCKS);
        PageId *got = malloc(sizeof(PageId) * MAX_BLOCKS);

        /* The most repetitive input there is: one token id, over and over. */
        for (size_t i = 0; i < (size_t)BLOCK * MAX_BLOCKS; i++)
                tokens[i] = 13;
        chain_hashes(tokens, (size_t)BLOCK * MAX_BLOCKS, BLOCK, hashes);
        /* Equal blocks still get distinct hashes: the chain carries the position. */
        ck_assert_uint_ne(hashes[0], hashes[1]);

        ck_assert_int_eq(page_pool_new(MAX_BLOCKS, 64, 0, &p), 0);
        ck_assert_int_eq(directory_new(&d), 0);
        directory_attach_pool(d, p);
        ck_assert_int_eq(sequence_new(p, &s), 0);
        ck_assert_int_eq(sequence_append(s, MAX_BLOCKS / 2, NULL), 0);
        ck_assert_int_eq(directory_insert_chain(d, p, hashes, sequence_pages(s), MAX_BLOCKS / 2),
                         MAX_BLOCKS / 2);

        for (size_t n = 256; n <= MAX_BLOCKS; n *= 2) {
                DirectoryStats a, b;
                size_t len;
                directory_stats(d, &a);
                ck_assert_int_eq(directory_lookup(d, p, hashes, n, got, &len), 0);
                directory_stats(d, &b);
                ck_assert_uint_eq(len, MIN(n, (size_t)MAX_BLOCKS / 2));
                /* At most one probe per block, plus the one that misses. */
                ck_assert_uint_le(b.probes - a.probes, len + 1);
                ck_assert_uint_le(b.probes - a.probes, n);
                for (size_t i = 0; i < len; i++)
                        ck_assert_int_eq(page_unref(p, got[i]), 1);
        }
        sequence_free(s);
        ck_assert_uint_eq(page_pool_retained(p), MAX_BLOCKS / 2); /* cached, IDLE */
        directory_clear(d);
        ck_assert_uint_eq(page_pool_retained(p), 0);
        directory_free(d);
        page_pool_free(p);
        free(tokens);
        free(hashes);
        free(got);
}
END_TEST

START_TEST(test_owner_rendezvous) {
        Directory *d;
        const char *hosts[4] = { "host-a", "host-b", "host-c", "host-d" };
        unsigned count[4] = {};
        enum { N = 20000 };
        size_t *owner3 = malloc(sizeof(size_t) * N);

        ck_assert_int_eq(directory_new(&d), 0);
        /* No hosts configured: this host owns all. */
        ck_assert_uint_eq(directory_owner(d, 42), 0);
        ck_assert_ptr_null(directory_owner_host(d, 42));
        ck_assert(directory_owns(d, 42));
        ck_assert_int_eq(directory_set_hosts(d, hosts, 4, 4), -EINVAL);
        ck_assert_int_eq(directory_set_hosts(d, hosts, 1, 0), 0);
        ck_assert_str_eq(directory_owner_host(d, 7), "host-a");
        ck_assert(directory_owns(d, 7));

        ck_assert_int_eq(directory_set_hosts(d, hosts, 3, 1), 0);
        for (uint64_t h = 0; h < N; h++)
                owner3[h] = directory_owner(d, h * 0x9e3779b97f4a7c15ULL);
        ck_assert_int_eq(directory_set_hosts(d, hosts, 4, 1), 0);
        size_t moved = 0;
        for (uint64_t h = 0; h < N; h++) {
                size_t o = directory_owner(d, h * 0x9e3779b97f4a7c15ULL);
                ck_assert_uint_lt(o, 4);
                count[o]++;
                /* Adding host-d only moves keys to host-d. */
                if (o != owner3[h]) {
                        ck_assert_uint_eq(o, 3);
                        moved++;
                }
        }
        /* Balanced within 10% and about a quarter moved. */
        for (int i = 0; i < 4; i++)
                ck_assert_msg(count[i] > N / 4 * 9 / 10 && count[i] < N / 4 * 11 / 10,
                              "host %d owns %u of %d", i, count[i], N);
        ck_assert_uint_eq(moved, count[3]);
        /* Deterministic: a second directory agrees (it runs on another host). */
        Directory *e;
        ck_assert_int_eq(directory_new(&e), 0);
        ck_assert_int_eq(directory_set_hosts(e, hosts, 4, 2), 0);
        for (uint64_t h = 0; h < 1000; h++)
                ck_assert_uint_eq(directory_owner(d, h), directory_owner(e, h));
        ck_assert_int_eq(directory_owns(e, 5), directory_owner(e, 5) == 2);
        directory_free(e);
        ck_assert_int_eq(directory_set_hosts(d, NULL, 0, 0), 0);
        ck_assert(directory_owns(d, 5));
        directory_free(d);
        free(owner3);
}
END_TEST

/* Journaling (docs/wal.md): every entry that appears or goes is reported, evictions
 * included, before the page is reused; a put the journal refuses is undone; records
 * round-trip. */
typedef struct JournalLog {
        int n_put, n_del;
        uint64_t last_del;
        int fail_put; /* errno to refuse puts with, 0: accept */
        int fail_del; /* the same for removals */
} JournalLog;

static int journal(void *userdata, bool put, uint64_t hash, PagePool *pool, PageId page) {
        JournalLog *l = userdata;
        if (put && l->fail_put)
                return -l->fail_put;
        if (!put && l->fail_del)
                return -l->fail_del;
        if (put)
                l->n_put++;
        else {
                l->n_del++;
                l->last_del = hash;
        }
        return 0;
}

START_TEST(test_journal) {
        PagePool *p;
        Directory *d;
        PageId ids[3], x;
        uint64_t h[3] = { 11, 12, 13 };
        JournalLog l = {};

        ck_assert_int_eq(page_pool_new(3, 64, 0, &p), 0);
        ck_assert_int_eq(directory_new(&d), 0);
        directory_attach_pool(d, p);
        directory_set_journal(d, journal, &l);
        ck_assert_int_eq(page_pool_alloc_many(p, 3, ids), 0);
        ck_assert_int_eq(directory_insert_chain(d, p, h, ids, 2), 2);
        ck_assert_int_eq(l.n_put, 2);
        /* Refused by the journal: not inserted, the error comes back. */
        l.fail_put = EIO;
        ck_assert_int_eq(directory_insert(d, p, h[2], ids[2]), -EIO);
        ck_assert_int_eq(directory_insert_chain(d, p, &h[2], &ids[2], 1), -EIO);
        ck_assert_uint_eq(directory_size(d), 2);
        ck_assert_ptr_null(page_cached_entry(p, ids[2]));
        l.fail_put = 0;
        /* An eviction is journaled before the allocation that caused it returns. */
        for (int i = 0; i < 3; i++)
                ck_assert_int_eq(page_unref(p, ids[i]), 0);
        PageId first;
        ck_assert_int_eq(page_pool_alloc(p, &first), 0); /* the free page */
        ck_assert_int_eq(l.n_del, 0);
        ck_assert_int_eq(page_pool_alloc(p, &x), 0); /* evicts hash 11's page */
        ck_assert_int_eq(l.n_del, 1);
        ck_assert_uint_eq(l.last_del, 11);
        ck_assert_int_eq(directory_remove(d, 12), 0);
        ck_assert_int_eq(l.n_del, 2);
        ck_assert_uint_eq(l.last_del, 12);
        ck_assert_int_eq(page_unref(p, x), 0);
        ck_assert_int_eq(page_unref(p, first), 0);
        directory_free(d);
        ck_assert_int_eq(page_pool_verify(p), 0);
        page_pool_free(p);

        /* A removal the journal refuses does not happen: the page is not reused (a
         * restart would find the hash on it, holding another block's bytes), the
         * allocation that wanted it fails, an explicit Remove says why. */
        l = (JournalLog) {};
        ck_assert_int_eq(page_pool_new(2, 64, 0, &p), 0);
        ck_assert_int_eq(directory_new(&d), 0);
        directory_attach_pool(d, p);
        directory_set_journal(d, journal, &l);
        ck_assert_int_eq(page_pool_alloc_many(p, 2, ids), 0);
        ck_assert_int_eq(directory_insert_chain(d, p, h, ids, 2), 2);
        ck_assert_int_eq(page_unref(p, ids[0]), 0);
        ck_assert_int_eq(page_unref(p, ids[1]), 0);
        l.fail_del = ENOSPC;
        ck_assert_int_eq(page_pool_alloc(p, &x), -ENOSPC);
        ck_assert_uint_eq(directory_size(d), 2);
        ck_assert_ptr_nonnull(page_cached_entry(p, ids[0]));
        ck_assert_int_eq(directory_remove(d, 12), -ENOSPC);
        ck_assert_uint_eq(directory_size(d), 2);
        DirectoryStats ds;
        directory_stats(d, &ds);
        ck_assert_uint_eq(ds.evictions, 0);
        ck_assert_uint_ge(ds.evictions_refused, 1);
        /* Once the journal takes removals again, eviction works. */
        l.fail_del = 0;
        ck_assert_int_eq(page_pool_alloc(p, &x), 0);
        ck_assert_int_eq(l.n_del, 1);
        ck_assert_uint_eq(l.last_del, 11);
        ck_assert_int_eq(page_unref(p, x), 0);
        directory_free(d);
        ck_assert_int_eq(page_pool_verify(p), 0);
        page_pool_free(p);

        /* Records. */
        uint8_t buf[DIRECTORY_REC_PUT_SIZE];
        DirectoryRecord r = { .hash = 0x0123456789abcdefULL, .arena = 2, .page = 77, .page_size = 32768 }, back;
        directory_record_put_encode(buf, &r);
        ck_assert_int_eq(directory_record_put_parse(buf, sizeof buf, &back), 0);
        ck_assert_uint_eq(back.hash, r.hash);
        ck_assert_uint_eq(back.arena, 2);
        ck_assert_uint_eq(back.page, 77);
        ck_assert_uint_eq(back.page_size, 32768);
        ck_assert_int_eq(directory_record_put_parse(buf, sizeof buf - 1, &back), -EBADMSG);
        buf[30] = 1; /* reserved */
        ck_assert_int_eq(directory_record_put_parse(buf, sizeof buf, &back), -EBADMSG);
        uint64_t hh;
        directory_record_del_encode(buf, 42);
        ck_assert_int_eq(directory_record_del_parse(buf, DIRECTORY_REC_DEL_SIZE, &hh), 0);
        ck_assert_uint_eq(hh, 42);
        ck_assert_int_eq(directory_record_del_parse(buf, 9, &hh), -EBADMSG);
}
END_TEST

int main(void) {
        Suite *s = suite_create("directory");
        TCase *tc = tcase_create("directory");
        tcase_add_test(tc, test_insert_lookup_pin);
        tcase_add_test(tc, test_eviction_lru_never_pinned_or_leased);
        tcase_add_test(tc, test_matching_linear);
        tcase_add_test(tc, test_owner_rendezvous);
        tcase_add_test(tc, test_journal);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
