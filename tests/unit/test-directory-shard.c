/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The owner's records and the cache of remote answers (daemon/pages/directory-shard.c),
 * and placement's ranking of them (daemon/sched/placement.c). */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages/directory-shard.h"
#include "sched/placement.h"
#include "../check-main.h"

static bool keep_even(void *userdata, uint64_t hash) {
        return hash % 2 == 0;
}

START_TEST(test_shard) {
        DirectoryShard *sh;
        DirectoryAnswerEntry e;

        ck_assert_int_eq(directory_shard_new(&sh, 10), 0);
        ck_assert_int_eq(directory_shard_put(sh, 1, "alpha", "kv0", "w0"), 0);
        ck_assert_int_eq(directory_shard_put(sh, 1, "bravo", "kv0", "w1"), 0);
        /* The same holder again: refreshed (worker), not added. */
        ck_assert_int_eq(directory_shard_put(sh, 1, "alpha", "kv0", "w2"), 0);
        ck_assert_uint_eq(directory_shard_records(sh), 2);
        directory_shard_get(sh, 1, &e);
        ck_assert_uint_eq(e.n_holders, 2);
        ck_assert_str_eq(e.holders[0].worker, "w2");
        directory_shard_get(sh, 2, &e);
        ck_assert_uint_eq(e.n_holders, 0);
        ck_assert_uint_eq(e.hash, 2);
        ck_assert_int_eq(directory_shard_put(sh, 1, "bad host", "kv0", ""), -EINVAL);

        /* A hash holds at most DIRECTORY_HOLDERS_MAX holders. */
        char host[16];
        for (unsigned i = 2; i < DIRECTORY_HOLDERS_MAX; i++) {
                snprintf(host, sizeof host, "h%u", i);
                ck_assert_int_eq(directory_shard_put(sh, 1, host, "kv0", ""), 0);
        }
        ck_assert_int_eq(directory_shard_put(sh, 1, "one-more", "kv0", ""), -E2BIG);
        ck_assert_uint_eq(directory_shard_records(sh), DIRECTORY_HOLDERS_MAX);
        /* The record bound. */
        ck_assert_int_eq(directory_shard_put(sh, 2, "alpha", "kv0", ""), 0);
        ck_assert_int_eq(directory_shard_put(sh, 4, "alpha", "kv0", ""), 0);
        ck_assert_int_eq(directory_shard_put(sh, 6, "alpha", "kv0", ""), -ENOSPC);

        ck_assert_int_eq(directory_shard_del(sh, 1, "bravo", "kv0"), 0);
        ck_assert_int_eq(directory_shard_del(sh, 1, "bravo", "kv0"), -ENOENT);
        ck_assert_int_eq(directory_shard_del(sh, 1, "nobody", "kv0"), -ENOENT);
        ck_assert_uint_eq(directory_shard_records(sh), 9);
        /* A holder that goes takes every record of its own with it. */
        ck_assert_uint_eq(directory_shard_drop_host(sh, "alpha"), 3);
        ck_assert_uint_eq(directory_shard_hashes(sh), 1);
        directory_shard_get(sh, 2, &e);
        ck_assert_uint_eq(e.n_holders, 0);
        ck_assert_uint_eq(directory_shard_drop_host(sh, "never-seen"), 0);
        /* Hashes this host no longer owns go. */
        ck_assert_int_eq(directory_shard_put(sh, 10, "h2", "kv0", ""), 0);
        ck_assert_uint_eq(directory_shard_prune(sh, keep_even, NULL), 6);
        ck_assert_uint_eq(directory_shard_hashes(sh), 1);
        ck_assert_uint_eq(directory_shard_records(sh), 1);
        /* A snapshot of the keys, and forgetting a hash whole. */
        ck_assert_int_eq(directory_shard_put(sh, 12, "h2", "kv0", ""), 0);
        ck_assert_int_eq(directory_shard_put(sh, 12, "h3", "kv0", ""), 0);
        uint64_t *keys;
        size_t nk;
        ck_assert_int_eq(directory_shard_keys(sh, &keys, &nk), 0);
        ck_assert_uint_eq(nk, 2);
        ck_assert(keys[0] + keys[1] == 10 + 12);
        free(keys);
        ck_assert_uint_eq(directory_shard_forget(sh, 12), 2);
        ck_assert_uint_eq(directory_shard_forget(sh, 12), 0);
        ck_assert_uint_eq(directory_shard_records(sh), 1);
        directory_shard_free(sh);
}
END_TEST

/* Names are interned (records hold 16-bit indexes), and workers come and go with names
 * of their own: once the table is full, the names no record uses any more are dropped
 * and the put goes through; what the records say is unchanged. */
START_TEST(test_shard_names_reclaimed) {
        DirectoryShard *sh;
        DirectoryAnswerEntry e;
        char w[32];

        ck_assert_int_eq(directory_shard_new(&sh, 100), 0);
        ck_assert_int_eq(directory_shard_put(sh, 1, "alpha", "kv0", "keeper"), 0);
        for (unsigned i = 0; i < 70000; i++) {
                snprintf(w, sizeof w, "worker-%u", i);
                ck_assert_msg(directory_shard_put(sh, 2, "bravo", "kv1", w) == 0, "put %u", i);
                ck_assert_int_eq(directory_shard_del(sh, 2, "bravo", "kv1"), 0);
        }
        ck_assert_int_eq(directory_shard_put(sh, 3, "charlie", "kv2", "last"), 0);
        ck_assert_uint_eq(directory_shard_records(sh), 2);
        directory_shard_get(sh, 1, &e);
        ck_assert_uint_eq(e.n_holders, 1);
        ck_assert_str_eq(e.holders[0].host, "alpha");
        ck_assert_str_eq(e.holders[0].arena, "kv0");
        ck_assert_str_eq(e.holders[0].worker, "keeper");
        directory_shard_get(sh, 3, &e);
        ck_assert_uint_eq(e.n_holders, 1);
        ck_assert_str_eq(e.holders[0].host, "charlie");
        ck_assert_str_eq(e.holders[0].worker, "last");
        ck_assert_int_eq(directory_shard_del(sh, 1, "alpha", "kv0"), 0);
        directory_shard_free(sh);
}
END_TEST

/* A table full of names in use: a put with a new name is refused at once, and the
 * table is not compacted again on every such put (each compaction walks every record:
 * a peer publishing new names would hold the loop) until a holder goes. */
START_TEST(test_shard_names_full_in_use) {
        DirectoryShard *sh;
        char w[32];

        ck_assert_int_eq(directory_shard_new(&sh, 70000), 0);
        int r = 0;
        unsigned i;
        for (i = 0; r == 0; i++) {
                snprintf(w, sizeof w, "worker-%u", i);
                r = directory_shard_put(sh, 1000 + i, "bravo", "kv1", w);
        }
        ck_assert_int_eq(r, -ENOSPC);
        ck_assert_uint_eq(directory_shard_compactions(sh), 1); /* found nothing to drop */
        for (unsigned k = 0; k < 1000; k++) {
                snprintf(w, sizeof w, "new-%u", k);
                ck_assert_int_eq(directory_shard_put(sh, 500000 + k, "bravo", "kv1", w), -ENOSPC);
        }
        ck_assert_uint_eq(directory_shard_compactions(sh), 1);
        /* A holder goes: its name can be dropped, and the next new name goes in. */
        ck_assert_int_eq(directory_shard_del(sh, 1000, "bravo", "kv1"), 0);
        ck_assert_int_eq(directory_shard_put(sh, 600000, "bravo", "kv1", "fresh"), 0);
        ck_assert_uint_eq(directory_shard_compactions(sh), 2);
        directory_shard_free(sh);
}
END_TEST

/* A put refused after its names went into the table (the hash has all its holders)
 * leaves a name no record uses: it counts as released, so that the full table is
 * compacted again for the next new name (it was refused, the table full of in-use
 * names by the count). */
START_TEST(test_shard_names_failed_put) {
        DirectoryShard *sh;
        char w[32];

        ck_assert_int_eq(directory_shard_new(&sh, 70000), 0);
        for (unsigned k = 0; k < DIRECTORY_HOLDERS_MAX; k++) {
                snprintf(w, sizeof w, "h%u", k);
                ck_assert_int_eq(directory_shard_put(sh, 1, w, "kv1", "w"), 0);
        }
        int r = 0;
        for (unsigned i = 0; r == 0; i++) {
                snprintf(w, sizeof w, "worker-%u", i);
                r = directory_shard_put(sh, 1000 + i, "bravo", "kv1", w);
        }
        ck_assert_int_eq(r, -ENOSPC);
        ck_assert_uint_eq(directory_shard_compactions(sh), 1);
        ck_assert_int_eq(directory_shard_del(sh, 1000, "bravo", "kv1"), 0);
        /* A ninth holder: its host name takes the slot worker-0 left, then it is refused. */
        ck_assert_int_eq(directory_shard_put(sh, 1, "h8", "kv1", "w"), -E2BIG);
        ck_assert_uint_eq(directory_shard_compactions(sh), 2);
        /* "h8" is used by no record: compacted away, and the new name goes in. */
        ck_assert_int_eq(directory_shard_put(sh, 3, "bravo", "kv1", "fresh"), 0);
        ck_assert_uint_eq(directory_shard_compactions(sh), 3);
        directory_shard_free(sh);
}
END_TEST

START_TEST(test_cache) {
        DirectoryCache *c;
        DirectoryAnswerEntry e = { .hash = 5, .n_holders = 1 }, out;

        strcpy(e.holders[0].host, "alpha");
        strcpy(e.holders[0].arena, "kv0");
        ck_assert_int_eq(directory_cache_new(&c, 2), 0);
        ck_assert_int_eq(directory_cache_put(c, &e, 100, 50), 0);
        ck_assert(directory_cache_get(c, 5, 149, &out));
        ck_assert_str_eq(out.holders[0].host, "alpha");
        ck_assert(!directory_cache_get(c, 5, 150, &out)); /* expired */
        /* An answer of "nobody holds it" is cached too. */
        DirectoryAnswerEntry none = { .hash = 6 };
        ck_assert_int_eq(directory_cache_put(c, &none, 100, 50), 0);
        ck_assert(directory_cache_get(c, 6, 120, &out));
        ck_assert_uint_eq(out.n_holders, 0);
        /* Past the bound the oldest goes. */
        DirectoryAnswerEntry third = { .hash = 7 };
        ck_assert_int_eq(directory_cache_put(c, &third, 100, 50), 0);
        ck_assert_uint_eq(directory_cache_size(c), 2);
        ck_assert(!directory_cache_get(c, 5, 101, &out));
        ck_assert(directory_cache_get(c, 7, 101, &out));
        directory_cache_clear(c);
        ck_assert_uint_eq(directory_cache_size(c), 0);
        ck_assert(!directory_cache_get(c, 7, 101, &out));
        ck_assert_int_eq(directory_cache_put(c, &e, 100, 50), 0);
        directory_cache_free(c);
}
END_TEST

static void holder(DirectoryAnswerEntry *e, const char *host, const char *arena, const char *worker) {
        DirectoryHolder *h = e->holders + e->n_holders++;
        strcpy(h->host, host);
        strcpy(h->arena, arena);
        strcpy(h->worker, worker);
}

/* This host's own knowledge overrides what an answer says about it: a block it dropped
 * is not reported held by it, even when a remote owner's record or a cached answer
 * (DirectoryCacheTime=) still says so; a block it holds is added, once. */
START_TEST(test_answer_set_self) {
        DirectoryAnswerEntry e = { .hash = 7, .n_holders = 3 };

        snprintf(e.holders[0].host, sizeof e.holders[0].host, "west");
        snprintf(e.holders[0].arena, sizeof e.holders[0].arena, "kv");
        snprintf(e.holders[1].host, sizeof e.holders[1].host, "self");
        snprintf(e.holders[1].arena, sizeof e.holders[1].arena, "kv");
        snprintf(e.holders[2].host, sizeof e.holders[2].host, "north");
        snprintf(e.holders[2].arena, sizeof e.holders[2].arena, "kv");
        DirectoryAnswerEntry orig = e;

        /* held, as the answer says: unchanged */
        directory_answer_set_self(&e, "self", "kv", "w1");
        ck_assert_int_eq(memcmp(&e, &orig, sizeof e), 0);
        /* not held any more: the stale entry goes, the others stay in order */
        directory_answer_set_self(&e, "self", NULL, NULL);
        ck_assert_uint_eq(e.n_holders, 2);
        ck_assert_str_eq(e.holders[0].host, "west");
        ck_assert_str_eq(e.holders[1].host, "north");
        directory_answer_set_self(&e, "self", NULL, NULL);
        ck_assert_uint_eq(e.n_holders, 2);
        /* held in another arena than the answer says: only the exact entry */
        e = orig;
        directory_answer_set_self(&e, "self", "kv2", "w1");
        ck_assert_uint_eq(e.n_holders, 3);
        ck_assert_str_eq(e.holders[0].host, "west");
        ck_assert_str_eq(e.holders[1].host, "north");
        ck_assert_str_eq(e.holders[2].host, "self");
        ck_assert_str_eq(e.holders[2].arena, "kv2");
        ck_assert_str_eq(e.holders[2].worker, "w1");
        /* a full answer gives this host the last slot */
        e.n_holders = DIRECTORY_HOLDERS_MAX;
        for (unsigned i = 0; i < DIRECTORY_HOLDERS_MAX; i++)
                snprintf(e.holders[i].host, sizeof e.holders[i].host, "h%u", i);
        directory_answer_set_self(&e, "self", "kv", "w1");
        ck_assert_uint_eq(e.n_holders, DIRECTORY_HOLDERS_MAX);
        ck_assert_str_eq(e.holders[DIRECTORY_HOLDERS_MAX - 1].host, "self");
        ck_assert_str_eq(e.holders[DIRECTORY_HOLDERS_MAX - 2].host, "h6");
}
END_TEST

START_TEST(test_placement) {
        DirectoryAnswerEntry e[4] = { { .hash = 1 }, { .hash = 2 }, { .hash = 3 }, { .hash = 4 } };
        PlacementCandidate *c;
        size_t n;

        /* Nobody holds the first block: no candidate, whatever holds the rest. */
        holder(&e[1], "alpha", "kv0", "w");
        ck_assert_int_eq(placement_rank(e, 4, "self", &c, &n), 0);
        ck_assert_uint_eq(n, 0);
        ck_assert_ptr_null(c);

        /* alpha: blocks 0,1,2; bravo: 0,1 and 3 (a hole at 2: 2 blocks); self: 0,1. */
        holder(&e[0], "bravo", "kv0", "wb");
        holder(&e[0], "alpha", "kv0", "wa");
        holder(&e[0], "self", "kv0", "ws");
        holder(&e[1], "bravo", "kv0", "");
        holder(&e[1], "self", "kv0", "");
        holder(&e[2], "alpha", "kv0", "");
        holder(&e[3], "bravo", "kv0", "");
        ck_assert_int_eq(placement_rank(e, 4, "self", &c, &n), 0);
        ck_assert_uint_eq(n, 3);
        ck_assert_str_eq(c[0].host, "alpha");
        ck_assert_uint_eq(c[0].n_blocks, 3);
        ck_assert_str_eq(c[0].worker, "wa");
        /* Equal lengths: this host first, then host ids in order. */
        ck_assert_str_eq(c[1].host, "self");
        ck_assert_uint_eq(c[1].n_blocks, 2);
        ck_assert_str_eq(c[2].host, "bravo");
        ck_assert_uint_eq(c[2].n_blocks, 2);
        free(c);
        /* The same host in two arenas is two candidates. */
        DirectoryAnswerEntry f[1] = { { .hash = 9 } };
        holder(&f[0], "alpha", "kv1", "");
        holder(&f[0], "alpha", "kv0", "");
        ck_assert_int_eq(placement_rank(f, 1, "self", &c, &n), 0);
        ck_assert_uint_eq(n, 2);
        ck_assert_str_eq(c[0].arena, "kv0");
        free(c);
        ck_assert_int_eq(placement_rank(NULL, 1, "self", &c, &n), -EINVAL);
}
END_TEST

int main(void) {
        Suite *s = suite_create("directory-shard");
        TCase *tc = tcase_create("directory-shard");
        tcase_add_test(tc, test_shard);
        tcase_add_test(tc, test_shard_names_reclaimed);
        tcase_add_test(tc, test_shard_names_full_in_use);
        tcase_add_test(tc, test_shard_names_failed_put);
        tcase_add_test(tc, test_cache);
        tcase_add_test(tc, test_answer_set_self);
        tcase_add_test(tc, test_placement);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
