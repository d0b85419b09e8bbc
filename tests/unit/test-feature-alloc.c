/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "feature/feature-alloc.h"
#include "macro.h"
#include "../check-main.h"

#define CHUNK 4096u

START_TEST(test_basic) {
        _cleanup_(feature_allocator_freep) FeatureAllocator *a = NULL;
        uint64_t off[4], len;

        ck_assert_int_eq(feature_allocator_new(0, 100, 3, &a), -EINVAL);    /* chunk not 2^n */
        ck_assert_int_eq(feature_allocator_new(0, 100, 4096, &a), -EINVAL); /* no chunk */
        ck_assert_int_eq(feature_allocator_new(1 << 20, 64 * CHUNK + 17, CHUNK, &a), 0);
        ck_assert_uint_eq(feature_allocator_total(a), 64 * CHUNK);

        ck_assert_int_eq(feature_allocator_alloc(a, 0, &off[0], &len), -EINVAL);
        ck_assert_int_eq(feature_allocator_alloc(a, 1, &off[0], &len), 0);
        ck_assert_uint_eq(off[0], 1 << 20);
        ck_assert_uint_eq(len, CHUNK);
        ck_assert_int_eq(feature_allocator_alloc(a, CHUNK + 1, &off[1], &len), 0);
        ck_assert_uint_eq(len, 2 * CHUNK);
        ck_assert_uint_eq(off[1], (1 << 20) + CHUNK);
        ck_assert_int_eq(feature_allocator_alloc(a, 61 * CHUNK, &off[2], &len), 0);
        ck_assert_uint_eq(feature_allocator_used(a), 64 * CHUNK);
        ck_assert_int_eq(feature_allocator_alloc(a, 1, &off[3], &len), -ENOSPC);
        ck_assert_int_eq(feature_allocator_check(a), 0);

        /* bad frees change nothing */
        ck_assert_int_eq(feature_allocator_release(a, 0), -EINVAL);
        ck_assert_int_eq(feature_allocator_release(a, off[1] + 1), -EINVAL);
        ck_assert_int_eq(feature_allocator_release(a, off[1] + CHUNK), -EINVAL); /* inside a run */
        ck_assert_int_eq(feature_allocator_release(a, (1 << 20) + 64 * CHUNK), -EINVAL);
        ck_assert_int_eq(feature_allocator_release(a, off[1]), 0);
        ck_assert_int_eq(feature_allocator_release(a, off[1]), -EINVAL); /* double free */
        ck_assert_int_eq(feature_allocator_check(a), 0);

        /* coalescing both ways gives back one run */
        ck_assert_int_eq(feature_allocator_release(a, off[0]), 0);
        ck_assert_int_eq(feature_allocator_release(a, off[2]), 0);
        ck_assert_int_eq(feature_allocator_check(a), 0);
        ck_assert_uint_eq(feature_allocator_used(a), 0);
        ck_assert_uint_eq(feature_allocator_largest_free(a), 64 * CHUNK);
        ck_assert_int_eq(feature_allocator_alloc(a, 64 * CHUNK, &off[0], &len), 0);
        ck_assert_int_eq(feature_allocator_alloc(a, 1, &off[1], NULL), -ENOSPC);
}
END_TEST

START_TEST(test_fragmentation) {
        _cleanup_(feature_allocator_freep) FeatureAllocator *a = NULL;
        uint64_t off[32];

        ck_assert_int_eq(feature_allocator_new(0, 32 * CHUNK, CHUNK, &a), 0);
        for (int i = 0; i < 32; i++)
                ck_assert_int_eq(feature_allocator_alloc(a, CHUNK, &off[i], NULL), 0);
        /* free every other chunk: 16 free, but no two contiguous */
        for (int i = 0; i < 32; i += 2)
                ck_assert_int_eq(feature_allocator_release(a, off[i]), 0);
        ck_assert_int_eq(feature_allocator_check(a), 0);
        uint64_t o;
        ck_assert_int_eq(feature_allocator_alloc(a, 2 * CHUNK, &o, NULL), -ENOSPC);
        /* freeing one in between joins three */
        ck_assert_int_eq(feature_allocator_release(a, off[5]), 0);
        ck_assert_int_eq(feature_allocator_check(a), 0);
        ck_assert_int_eq(feature_allocator_alloc(a, 3 * CHUNK, &o, NULL), 0);
        ck_assert_uint_eq(o, off[4]);
}
END_TEST

/* Random alloc/free against a shadow map: no two live runs overlap, every invariant
 * holds, and everything comes back at the end. */
START_TEST(test_random) {
        enum { N_CHUNKS = 4096, SLOTS = 512, ROUNDS = 40000 };
        _cleanup_(feature_allocator_freep) FeatureAllocator *a = NULL;
        uint64_t off[SLOTS] = {}, len[SLOTS] = {};
        uint8_t *owner = calloc(N_CHUNKS, 1);
        unsigned seed = 12345;

        ck_assert_int_eq(feature_allocator_new(CHUNK, N_CHUNKS * (uint64_t)CHUNK, CHUNK, &a), 0);
        for (int round = 0; round < ROUNDS; round++) {
                int s = rand_r(&seed) % SLOTS;
                if (len[s]) {
                        for (uint64_t c = (off[s] - CHUNK) / CHUNK; c < (off[s] - CHUNK + len[s]) / CHUNK; c++)
                                owner[c] = 0;
                        ck_assert_int_eq(feature_allocator_release(a, off[s]), 0);
                        len[s] = 0;
                } else {
                        /* mostly small, sometimes large */
                        uint64_t want = (rand_r(&seed) % 8 == 0) ? (uint64_t)(rand_r(&seed) % (256 * CHUNK)) + 1
                                                                 : (uint64_t)(rand_r(&seed) % (8 * CHUNK)) + 1;
                        if (feature_allocator_alloc(a, want, &off[s], &len[s]) < 0) {
                                len[s] = 0;
                                continue;
                        }
                        ck_assert_uint_ge(len[s], want);
                        ck_assert_uint_lt(len[s] - want, CHUNK);
                        for (uint64_t c = (off[s] - CHUNK) / CHUNK; c < (off[s] - CHUNK + len[s]) / CHUNK; c++) {
                                ck_assert_uint_eq(owner[c], 0);
                                owner[c] = 1;
                        }
                }
                if (round % 997 == 0)
                        ck_assert_int_eq(feature_allocator_check(a), 0);
        }
        for (int s = 0; s < SLOTS; s++)
                if (len[s])
                        ck_assert_int_eq(feature_allocator_release(a, off[s]), 0);
        ck_assert_int_eq(feature_allocator_check(a), 0);
        ck_assert_uint_eq(feature_allocator_used(a), 0);
        ck_assert_uint_eq(feature_allocator_n_allocations(a), 0);
        ck_assert_uint_eq(feature_allocator_largest_free(a), N_CHUNKS * (uint64_t)CHUNK);
        free(owner);
}
END_TEST

/* Good fit: a large-enough run in a higher class is always found; a run in the
 * request's own class (which good fit skips) is found by the bounded scan. */
START_TEST(test_good_fit) {
        _cleanup_(feature_allocator_freep) FeatureAllocator *a = NULL;
        uint64_t o[3], x;

        ck_assert_int_eq(feature_allocator_new(0, 1000 * (uint64_t)CHUNK, CHUNK, &a), 0);
        ck_assert_int_eq(feature_allocator_alloc(a, 100 * CHUNK, &o[0], NULL), 0);
        ck_assert_int_eq(feature_allocator_alloc(a, 1 * CHUNK, &o[1], NULL), 0);
        ck_assert_int_eq(feature_allocator_alloc(a, 899 * CHUNK, &o[2], NULL), 0);
        ck_assert_int_eq(feature_allocator_release(a, o[0]), 0);
        /* only a 100-chunk run is free: 100 fits, 101 does not */
        ck_assert_int_eq(feature_allocator_alloc(a, 101 * CHUNK, &x, NULL), -ENOSPC);
        ck_assert_int_eq(feature_allocator_alloc(a, 97 * CHUNK, &x, NULL), 0);
        ck_assert_uint_eq(x, o[0]);
        ck_assert_int_eq(feature_allocator_check(a), 0);
        ck_assert_int_eq(feature_allocator_release(a, x), 0);
        /* an exact hole of 97 chunks: class [96, 100), skipped by good fit */
        ck_assert_int_eq(feature_allocator_alloc(a, 3 * CHUNK, &x, NULL), 0);
        ck_assert_int_eq(feature_allocator_alloc(a, 97 * CHUNK, &x, NULL), 0);
        ck_assert_uint_eq(x, o[0] + 3 * CHUNK);
        ck_assert_int_eq(feature_allocator_check(a), 0);
}
END_TEST

START_TEST(test_alloc_at) {
        FeatureAllocator *a;
        uint64_t len, off;

        ck_assert_int_eq(feature_allocator_new(1 << 20, 64 * CHUNK, CHUNK, &a), 0);
        ck_assert_int_eq(feature_allocator_alloc_at(a, (1 << 20) + 10 * CHUNK, 3 * CHUNK - 1, &len), 0);
        ck_assert_uint_eq(len, 3 * CHUNK);
        ck_assert_int_eq(feature_allocator_alloc_at(a, (1 << 20) + 12 * CHUNK, 1, &len), -EBUSY);
        ck_assert_int_eq(feature_allocator_alloc_at(a, (1 << 20) + 9 * CHUNK, 2 * CHUNK, &len), -EBUSY);
        ck_assert_int_eq(feature_allocator_alloc_at(a, (1 << 20) + 13 * CHUNK, CHUNK, &len), 0);
        ck_assert_int_eq(feature_allocator_alloc_at(a, (1 << 20) + 63 * CHUNK, 2 * CHUNK, &len), -ERANGE);
        ck_assert_int_eq(feature_allocator_alloc_at(a, (1 << 20) + 5, CHUNK, &len), -EINVAL);
        ck_assert_int_eq(feature_allocator_alloc_at(a, 1 << 20, CHUNK, &len), 0);
        ck_assert_int_eq(feature_allocator_check(a), 0);
        ck_assert_uint_eq(feature_allocator_used(a), 5 * CHUNK);
        /* The free runs, in order: [1, 10), [14, 64); from inside a used run too. */
        ck_assert_int_eq(feature_allocator_next_free(a, 1 << 20, &off, &len), 0);
        ck_assert_uint_eq(off, (1 << 20) + CHUNK);
        ck_assert_uint_eq(len, 9 * CHUNK);
        ck_assert_int_eq(feature_allocator_next_free(a, off + len, &off, &len), 0);
        ck_assert_uint_eq(off, (1 << 20) + 14 * CHUNK);
        ck_assert_uint_eq(len, 50 * CHUNK);
        ck_assert_int_eq(feature_allocator_next_free(a, (1 << 20) + 11 * CHUNK, &off, &len), 0);
        ck_assert_uint_eq(off, (1 << 20) + 14 * CHUNK);
        ck_assert_int_eq(feature_allocator_next_free(a, off + len, &off, &len), -ENOENT);
        ck_assert_int_eq(feature_allocator_next_free(a, 0, &off, &len), 0);
        ck_assert_uint_eq(off, (1 << 20) + CHUNK);
        /* The holes left around them are allocatable, and everything frees. */
        ck_assert_int_eq(feature_allocator_alloc(a, 9 * CHUNK, &off, &len), 0);
        ck_assert_int_eq(feature_allocator_release(a, off), 0);
        ck_assert_int_eq(feature_allocator_release(a, (1 << 20) + 10 * CHUNK), 0);
        ck_assert_int_eq(feature_allocator_release(a, (1 << 20) + 13 * CHUNK), 0);
        ck_assert_int_eq(feature_allocator_release(a, 1 << 20), 0);
        ck_assert_int_eq(feature_allocator_check(a), 0);
        ck_assert_uint_eq(feature_allocator_largest_free(a), 64 * CHUNK);
        feature_allocator_free(a);
}
END_TEST

int main(void) {
        Suite *s = suite_create("feature-alloc");
        TCase *tc = tcase_create("feature-alloc");
        tcase_add_test(tc, test_basic);
        tcase_add_test(tc, test_fragmentation);
        tcase_add_test(tc, test_random);
        tcase_add_test(tc, test_good_fit);
        tcase_add_test(tc, test_alloc_at);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
