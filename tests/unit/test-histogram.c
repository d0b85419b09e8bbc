/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* common/histogram: bucket placement at and between bounds, quantiles as Prometheus'
 * histogram_quantile() computes them, and the quantile of a difference of snapshots. */
#include <check.h>
#include <math.h>

#include "histogram.h"
#include "../check-main.h"

START_TEST(test_observe) {
        Histogram h = {};
        histogram_observe(&h, 0);         /* bucket 0 (<= 100us) */
        histogram_observe(&h, 100);       /* on the bound: bucket 0 */
        histogram_observe(&h, 101);       /* bucket 1 (<= 250us) */
        histogram_observe(&h, 30000000);  /* the last finite bound */
        histogram_observe(&h, 30000001);  /* +Inf */
        ck_assert_uint_eq(h.counts[0], 2);
        ck_assert_uint_eq(h.counts[1], 1);
        ck_assert_uint_eq(h.counts[HISTOGRAM_BUCKETS - 1], 1);
        ck_assert_uint_eq(h.counts[HISTOGRAM_BUCKETS], 1);
        ck_assert_uint_eq(h.count, 5);
        ck_assert_uint_eq(h.sum_usec, 0 + 100 + 101 + 30000000 + 30000001ULL);
        for (size_t i = 1; i < HISTOGRAM_BUCKETS; i++)
                ck_assert_uint_lt(histogram_bounds_usec[i - 1], histogram_bounds_usec[i]);
}
END_TEST

START_TEST(test_quantile) {
        uint64_t c[HISTOGRAM_BUCKETS + 1] = {};
        ck_assert(histogram_quantile_usec(c, HISTOGRAM_BUCKETS + 1, 0.5) < 0); /* empty */
        /* 10 in (1ms, 2.5ms]: the median is the bucket's middle, P99 near its top. */
        c[4] = 10;
        ck_assert(fabs(histogram_quantile_usec(c, HISTOGRAM_BUCKETS + 1, 0.5) - 1750) < 1e-6);
        ck_assert(fabs(histogram_quantile_usec(c, HISTOGRAM_BUCKETS + 1, 0.99) - (1000 + 1500 * 0.99)) < 1e-6);
        /* 90 fast ones in (0, 100us] and 10 slow ones in (1s, 2.5s]. */
        c[4] = 0;
        c[0] = 90;
        c[13] = 10;
        ck_assert(fabs(histogram_quantile_usec(c, HISTOGRAM_BUCKETS + 1, 0.5) - 100 * 50.0 / 90) < 1e-6);
        ck_assert(fabs(histogram_quantile_usec(c, HISTOGRAM_BUCKETS + 1, 0.99) - (1e6 + 1.5e6 * 0.9)) < 1e-3);
        /* In +Inf: the largest finite bound. */
        uint64_t inf[HISTOGRAM_BUCKETS + 1] = { [HISTOGRAM_BUCKETS] = 3 };
        ck_assert(histogram_quantile_usec(inf, HISTOGRAM_BUCKETS + 1, 0.5) == 30000000);
}
END_TEST

START_TEST(test_interval) {
        /* What epdtop does: the quantile of what arrived between two snapshots. */
        Histogram a = {}, b;
        for (int i = 0; i < 1000; i++)
                histogram_observe(&a, 50); /* an old, fast history */
        b = a;
        for (int i = 0; i < 10; i++)
                histogram_observe(&b, 40000); /* the last interval: slow */
        uint64_t d[HISTOGRAM_BUCKETS + 1];
        for (size_t i = 0; i <= HISTOGRAM_BUCKETS; i++)
                d[i] = b.counts[i] - a.counts[i];
        double p50 = histogram_quantile_usec(d, HISTOGRAM_BUCKETS + 1, 0.5);
        ck_assert(p50 > 25000 && p50 <= 50000);
}
END_TEST

int main(void) {
        Suite *s = suite_create("histogram");
        TCase *tc = tcase_create("histogram");
        tcase_add_test(tc, test_observe);
        tcase_add_test(tc, test_quantile);
        tcase_add_test(tc, test_interval);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
