/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* A latency histogram with fixed bucket bounds (100 µs to 30 s, about three buckets a
 * decade), the same bounds everywhere: epdd observes into it, exports it over D-Bus
 * (counts per bucket) and to Prometheus (cumulative _bucket series), and epdtop
 * subtracts two snapshots to get the quantiles of the last interval. Pure. */

#include <stddef.h>
#include <stdint.h>

#define HISTOGRAM_BUCKETS 18 /* finite upper bounds; counts[] has one more: +Inf */

typedef struct Histogram {
        uint64_t counts[HISTOGRAM_BUCKETS + 1]; /* per bucket, not cumulative */
        uint64_t count;
        uint64_t sum_usec;
} Histogram;

/* The upper bound of bucket i (inclusive), in microseconds. */
extern const uint64_t histogram_bounds_usec[HISTOGRAM_BUCKETS];

void histogram_observe(Histogram *h, uint64_t usec);

/* The q-quantile (0 <= q <= 1) of n bucket counts (per bucket, n <= HISTOGRAM_BUCKETS
 * + 1, the bounds above), interpolated linearly within its bucket as Prometheus'
 * histogram_quantile() does; a quantile in the +Inf bucket is the largest finite bound.
 * Returns -1 when the counts are all zero. */
double histogram_quantile_usec(const uint64_t *counts, size_t n, double q);
