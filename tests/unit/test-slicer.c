/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>

#include "peer/peer-proto.h"
#include "transport/slicer.h"
#include "../check-main.h"

START_TEST(test_single_write) {
        SliceQueue q = {};
        SliceWrite w;
        Slice s;
        uint64_t total = 0, n = 0;

        ck_assert_int_eq(slice_write_init(&w, 10 * 4096 + 7, 4096), 0);
        slice_queue_push(&q, &w);
        while (slice_queue_next(&q, &s)) {
                ck_assert_ptr_eq(s.write, &w);
                ck_assert_uint_eq(s.offset, total);
                total += s.length;
                n++;
                ck_assert(s.last == (total == 10 * 4096 + 7));
        }
        ck_assert_uint_eq(total, 10 * 4096 + 7);
        ck_assert_uint_eq(n, 11);
        ck_assert(slice_queue_empty(&q));
}
END_TEST

START_TEST(test_init_bounds) {
        SliceWrite w;

        ck_assert_int_eq(slice_write_init(&w, 0, 4096), -EINVAL);
        ck_assert_int_eq(slice_write_init(&w, 1, PEER_SLICE_MIN - 1), -EINVAL);
        ck_assert_int_eq(slice_write_init(&w, 1, PEER_SLICE_MAX + 1), -EINVAL);
        ck_assert_int_eq(slice_write_init(&w, (uint64_t)4096 * PEER_MAX_SLICES_PER_WRITE + 1, 4096), -EINVAL);
        ck_assert_int_eq(slice_write_init(&w, (uint64_t)4096 * PEER_MAX_SLICES_PER_WRITE, 4096), 0);
}
END_TEST

/* A small write posted behind a huge one goes out within one round, not after the
 * huge one. */
START_TEST(test_no_starvation) {
        SliceQueue q = {};
        SliceWrite big, big2, small;
        Slice s;
        int before_small = 0;

        ck_assert_int_eq(slice_write_init(&big, (uint64_t)1 << 30, 1 << 20), 0);
        ck_assert_int_eq(slice_write_init(&big2, (uint64_t)1 << 30, 1 << 20), 0);
        ck_assert_int_eq(slice_write_init(&small, 64 * 1024, 1 << 20), 0);
        slice_queue_push(&q, &big);
        slice_queue_push(&q, &big2);
        /* Some of the big ones go out first. */
        for (int i = 0; i < 10; i++)
                ck_assert(slice_queue_next(&q, &s));
        slice_queue_push(&q, &small);
        for (;;) {
                ck_assert(slice_queue_next(&q, &s));
                if (s.write == &small)
                        break;
                before_small++;
        }
        ck_assert(s.last);
        ck_assert_uint_eq(s.length, 64 * 1024);
        ck_assert_int_le(before_small, 2);
        /* The big writes alternate and both finish. */
        uint64_t a = 0, b = 0;
        SliceWrite *prev = NULL;
        while (slice_queue_next(&q, &s)) {
                if (prev && a < (1u << 30) && b < (1u << 30))
                        ck_assert_ptr_ne(prev, s.write);
                prev = s.write;
                if (s.write == &big)
                        a += s.length;
                else
                        b += s.length;
        }
        /* 10 slices before the small write was queued, before_small after. */
        ck_assert_uint_eq(a + b + (uint64_t)(10 + before_small) * (1 << 20), (uint64_t)2 << 30);
}
END_TEST

START_TEST(test_remove) {
        SliceQueue q = {};
        SliceWrite a, b;
        Slice s;

        ck_assert_int_eq(slice_write_init(&a, 3 * 4096, 4096), 0);
        ck_assert_int_eq(slice_write_init(&b, 3 * 4096, 4096), 0);
        slice_queue_push(&q, &a);
        slice_queue_push(&q, &a); /* twice: no-op */
        slice_queue_push(&q, &b);
        ck_assert_uint_eq(q.n, 2);
        slice_queue_remove(&q, &a);
        slice_queue_remove(&q, &a);
        ck_assert_uint_eq(q.n, 1);
        while (slice_queue_next(&q, &s))
                ck_assert_ptr_eq(s.write, &b);
        ck_assert(slice_queue_empty(&q));
}
END_TEST

START_TEST(test_tracker) {
        SliceTracker t;

        ck_assert_int_eq(slice_tracker_init(&t, 0, 4096), -EINVAL);
        ck_assert_int_eq(slice_tracker_init(&t, (uint64_t)4096 * PEER_MAX_SLICES_PER_WRITE + 1, 4096), -EINVAL);
        ck_assert_int_eq(slice_tracker_init(&t, 200 * 4096 + 1, 4096), 0);
        ck_assert_uint_eq(t.n_slices, 201);
        /* Out of order, duplicates refused, out of range refused. */
        for (uint64_t i = 200;; i--) {
                ck_assert(!slice_tracker_complete(&t));
                ck_assert_int_eq(slice_tracker_mark(&t, i), 0);
                ck_assert_int_eq(slice_tracker_mark(&t, i), -EEXIST);
                if (i == 0)
                        break;
        }
        ck_assert(slice_tracker_complete(&t));
        ck_assert_int_eq(slice_tracker_mark(&t, 201), -ERANGE);
        ck_assert_int_eq(slice_tracker_mark(&t, UINT64_MAX), -ERANGE);
        slice_tracker_done(&t);
        slice_tracker_done(&t);
}
END_TEST

int main(void) {
        Suite *s = suite_create("slicer");
        TCase *tc = tcase_create("slicer");
        tcase_add_test(tc, test_single_write);
        tcase_add_test(tc, test_init_bounds);
        tcase_add_test(tc, test_no_starvation);
        tcase_add_test(tc, test_remove);
        tcase_add_test(tc, test_tracker);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
