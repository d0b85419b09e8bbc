/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "histogram.h"

#include "macro.h"

const uint64_t histogram_bounds_usec[HISTOGRAM_BUCKETS] = {
        100,    250,    500,    1000,    2500,    5000,     10000,    25000,    50000,
        100000, 250000, 500000, 1000000, 2500000, 5000000, 10000000, 20000000, 30000000,
};

void histogram_observe(Histogram *h, uint64_t usec) {
        size_t i = 0;
        while (i < HISTOGRAM_BUCKETS && usec > histogram_bounds_usec[i])
                i++;
        h->counts[i]++;
        h->count++;
        h->sum_usec += usec;
}

double histogram_quantile_usec(const uint64_t *counts, size_t n, double q) {
        uint64_t total = 0;
        n = MIN(n, (size_t)HISTOGRAM_BUCKETS + 1);
        for (size_t i = 0; i < n; i++)
                total += counts[i];
        if (total == 0)
                return -1;
        q = CLAMP(q, 0.0, 1.0);
        double rank = q * (double)total, below = 0;
        for (size_t i = 0; i < n; i++) {
                if (counts[i] == 0 || below + (double)counts[i] < rank) {
                        below += (double)counts[i];
                        continue;
                }
                if (i == HISTOGRAM_BUCKETS)
                        return (double)histogram_bounds_usec[HISTOGRAM_BUCKETS - 1];
                double lo = i == 0 ? 0 : (double)histogram_bounds_usec[i - 1];
                double hi = (double)histogram_bounds_usec[i];
                return lo + (hi - lo) * (rank - below) / (double)counts[i];
        }
        return (double)histogram_bounds_usec[HISTOGRAM_BUCKETS - 1];
}
