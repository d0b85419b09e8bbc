/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"
#include "workflow/workflow-match.h"
#include "../check-main.h"

#define P 16

static uint32_t rnd(uint64_t *x) {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        return (uint32_t)*x;
}

/* Every reported segment must really be equal, lie inside both sequences, not overlap
 * another in the new sequence, and start after the prefix. */
static void check_valid(const uint32_t *prev, size_t np, const uint32_t *next, size_t nn,
                        const MatchResult *r) {
        size_t last_end = r->prefix_blocks * P, total = 0;
        for (size_t i = 0; i < r->prefix_blocks * P; i++)
                ck_assert_uint_eq(prev[i], next[i]);
        for (size_t s = 0; s < r->n_segments; s++) {
                const MatchSegment *g = &r->segments[s];
                ck_assert_uint_ge(g->n_blocks, 1);
                ck_assert_uint_ge(g->new_offset, last_end);
                ck_assert_uint_le((g->prev_block + g->n_blocks) * P, np);
                ck_assert_uint_le(g->new_offset + g->n_blocks * P, nn);
                ck_assert_int_eq(memcmp(prev + g->prev_block * P, next + g->new_offset,
                                        g->n_blocks * P * sizeof(uint32_t)), 0);
                ck_assert_int_eq(g->aligned, g->new_offset % P == 0);
                last_end = g->new_offset + g->n_blocks * P;
                total += g->n_blocks;
        }
        ck_assert_uint_eq(total, r->matched_blocks);
}

START_TEST(test_basic) {
        /* prev: blocks A B C D; next: A B X D C plus C D unaligned after 5 junk tokens. */
        uint32_t prev[4 * P], next[5 * P + 5 + 2 * P];
        uint64_t x = 1;
        for (size_t i = 0; i < 4 * P; i++)
                prev[i] = rnd(&x);
        memcpy(next, prev, 2 * P * 4);
        for (size_t i = 0; i < P; i++)
                next[2 * P + i] = rnd(&x);
        memcpy(next + 3 * P, prev + 3 * P, P * 4);
        memcpy(next + 4 * P, prev + 2 * P, P * 4);
        for (size_t i = 0; i < 5; i++)
                next[5 * P + i] = rnd(&x);
        memcpy(next + 5 * P + 5, prev + 2 * P, 2 * P * 4);

        MatchResult r;
        MatchOptions o = { .block_tokens = P, .seed = 12345 };
        ck_assert_int_eq(workflow_match(prev, 4 * P, next, ELEMENTSOF(next), &o, &r), 0);
        check_valid(prev, 4 * P, next, ELEMENTSOF(next), &r);
        ck_assert_uint_eq(r.prefix_blocks, 2);
        ck_assert_uint_eq(r.n_segments, 3);
        ck_assert_uint_eq(r.segments[0].prev_block, 3);
        ck_assert_uint_eq(r.segments[0].new_offset, 3 * P);
        ck_assert(r.segments[0].aligned);
        ck_assert_uint_eq(r.segments[1].prev_block, 2);
        ck_assert_uint_eq(r.segments[1].new_offset, 4 * P);
        ck_assert_uint_eq(r.segments[2].prev_block, 2);
        ck_assert_uint_eq(r.segments[2].n_blocks, 2);
        ck_assert_uint_eq(r.segments[2].new_offset, 5 * P + 5);
        ck_assert(!r.segments[2].aligned);
        match_result_done(&r);

        /* Aligned only: the unaligned run is not reported. */
        o.aligned_only = true;
        ck_assert_int_eq(workflow_match(prev, 4 * P, next, ELEMENTSOF(next), &o, &r), 0);
        check_valid(prev, 4 * P, next, ELEMENTSOF(next), &r);
        ck_assert_uint_eq(r.n_segments, 2);
        match_result_done(&r);

        /* min_blocks filters short runs; max_segments bounds the answer. */
        o = (MatchOptions){ .block_tokens = P, .min_blocks = 2 };
        ck_assert_int_eq(workflow_match(prev, 4 * P, next, ELEMENTSOF(next), &o, &r), 0);
        ck_assert_uint_eq(r.n_segments, 1);
        match_result_done(&r);
        o = (MatchOptions){ .block_tokens = P, .max_segments = 1 };
        ck_assert_int_eq(workflow_match(prev, 4 * P, next, ELEMENTSOF(next), &o, &r), 0);
        ck_assert_uint_eq(r.n_segments, 1);
        ck_assert(r.truncated);
        match_result_done(&r);
}
END_TEST

START_TEST(test_edges) {
        MatchResult r;
        MatchOptions o = { .block_tokens = P };
        uint32_t a[3] = { 1, 2, 3 };
        ck_assert_int_eq(workflow_match(NULL, 0, NULL, 0, &o, &r), 0);
        ck_assert_uint_eq(r.n_segments + r.prefix_blocks, 0);
        ck_assert_int_eq(workflow_match(a, 3, a, 3, &o, &r), 0); /* shorter than a block */
        ck_assert_uint_eq(r.n_segments + r.prefix_blocks, 0);
        ck_assert_int_eq(workflow_match(NULL, 3, a, 3, &o, &r), -EINVAL);
        o.block_tokens = 0;
        ck_assert_int_eq(workflow_match(a, 3, a, 3, &o, &r), -EINVAL);
        o.block_tokens = WORKFLOW_MATCH_BLOCK_MAX + 1;
        ck_assert_int_eq(workflow_match(a, 3, a, 3, &o, &r), -EINVAL);
        o.block_tokens = 1;
        ck_assert_int_eq(workflow_match(a, WORKFLOW_MATCH_TOKENS_MAX + 1, a, 3, &o, &r), -E2BIG);
        /* Block size 1: every token a block. */
        uint32_t b[4] = { 3, 2, 1, 9 };
        ck_assert_int_eq(workflow_match(a, 3, b, 4, &o, &r), 0);
        ck_assert_uint_eq(r.prefix_blocks, 0);
        ck_assert_uint_eq(r.matched_blocks, 3);
        match_result_done(&r);
        match_result_done(NULL);
}
END_TEST

/* Against a brute-force reference on small random inputs over a tiny alphabet: the
 * matcher finds a segment wherever an aligned block of the new sequence (past the
 * prefix and not covered by an earlier match) equals some predecessor block. */
START_TEST(test_random_vs_reference) {
        uint64_t x = 7;
        for (int iter = 0; iter < 300; iter++) {
                size_t np = rnd(&x) % (12 * P), nn = rnd(&x) % (12 * P);
                uint32_t prev[12 * P], next[12 * P];
                unsigned alpha = 1 + rnd(&x) % 3;
                for (size_t i = 0; i < np; i++)
                        prev[i] = rnd(&x) % alpha;
                /* Build next from pieces of prev and noise. */
                for (size_t i = 0; i < nn;) {
                        if (np >= P && rnd(&x) % 2) {
                                size_t from = rnd(&x) % (np - P + 1), want = (size_t)P * (1 + rnd(&x) % 3);
                                size_t len = MIN(want, MIN(nn - i, np - from));
                                memcpy(next + i, prev + from, len * 4);
                                i += len;
                        } else
                                next[i++] = rnd(&x) % (alpha + 1);
                }
                MatchOptions o = { .block_tokens = P, .seed = iter + 1, .aligned_only = iter % 2 };
                MatchResult r;
                ck_assert_int_eq(workflow_match(prev, np, next, nn, &o, &r), 0);
                check_valid(prev, np, next, nn, &r);
                /* Reference: prefix length. */
                size_t pre = 0;
                while ((pre + 1) * P <= MIN(np, nn) && memcmp(prev + pre * P, next + pre * P, P * 4) == 0)
                        pre++;
                ck_assert_uint_eq(r.prefix_blocks, pre);
                /* Greedy completeness: each position the scan reached uncovered that holds
                 * an equal block was taken. Check aligned positions not covered. */
                size_t s = 0;
                for (size_t j = pre * P; j + P <= nn; j += P) {
                        while (s < r.n_segments && r.segments[s].new_offset + r.segments[s].n_blocks * P <= j)
                                s++;
                        bool covered = s < r.n_segments && r.segments[s].new_offset < j + P;
                        if (covered)
                                continue;
                        for (size_t b = 0; b + 1 <= np / P; b++)
                                ck_assert_msg(memcmp(prev + b * P, next + j, P * 4) != 0,
                                              "iter %d: missed block at %zu", iter, j);
                }
                match_result_done(&r);
        }
}
END_TEST

/* Linear time on long repetitive inputs, where greedy LCS matching is quadratic. */
START_TEST(test_linear_on_repetitive) {
        enum { N = 1 << 20 };
        uint32_t *prev = malloc(N * sizeof *prev), *next = malloc(N * sizeof *next);
        ck_assert_ptr_nonnull(prev);
        ck_assert_ptr_nonnull(next);
        struct {
                const char *name;
                int kind;
        } cases[] = { { "one token", 0 }, { "period 3", 1 }, { "two tokens random", 2 }, { "shifted", 3 } };
        uint64_t x = 99;
        for (size_t c = 0; c < ELEMENTSOF(cases); c++) {
                for (size_t i = 0; i < N; i++) {
                        switch (cases[c].kind) {
                        case 0:
                                prev[i] = next[i] = 7;
                                break;
                        case 1:
                                prev[i] = i % 3;
                                next[i] = (i + 1) % 3;
                                break;
                        case 2:
                                prev[i] = rnd(&x) & 1;
                                next[i] = rnd(&x) & 1;
                                break;
                        default:
                                prev[i] = 5;
                                next[i] = i % 1000 == 999 ? 6 : 5;
                                break;
                        }
                }
                next[0] = 1000; /* no common prefix: the scan does all the work */
                for (int aligned = 0; aligned < 2; aligned++) {
                        MatchOptions o = { .block_tokens = P, .aligned_only = aligned };
                        MatchResult r;
                        ck_assert_int_eq(workflow_match(prev, N, next, N, &o, &r), 0);
                        /* The bound: a small constant times the input, independent of the
                         * number of equal candidates (with LCS scanning it is ~N^2/2). */
                        ck_assert_msg(r.ops <= 6ull * (2 * N), "%s: %llu ops for %d tokens",
                                      cases[c].name, (unsigned long long)r.ops, 2 * N);
                        if (cases[c].kind != 2)
                                ck_assert_uint_gt(r.matched_blocks, N / P / 2);
                        check_valid(prev, N, next, N, &r);
                        match_result_done(&r);
                }
        }
        free(prev);
        free(next);
}
END_TEST

int main(void) {
        Suite *s = suite_create("workflow-match");
        TCase *tc = tcase_create("workflow-match");
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_basic);
        tcase_add_test(tc, test_edges);
        tcase_add_test(tc, test_random_vs_reference);
        tcase_add_test(tc, test_linear_on_repetitive);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
