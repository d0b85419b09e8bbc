/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Writes evicted features to the FeatureStore on a thread of its own, so that an
 * eviction (which happens inside a Reserve) never waits for the disk. At eviction the
 * feature's bytes are copied into a private buffer (memcpy speed) and queued; the region
 * is reused at once. The queue is bounded in bytes: past it, a feature is not spilled
 * (it is a cache: dropping is always correct). At shutdown the thread writes what is
 * queued and exits. */

#include <stdint.h>

#include "feature/feature.h"

typedef struct FeatureSpiller FeatureSpiller;

int feature_spiller_new(FeatureStore *store, uint64_t max_pending_bytes, FeatureSpiller **ret);
/* Writes what is queued, stops the thread, frees. NULL is fine. */
FeatureSpiller *feature_spiller_free(FeatureSpiller *s);

/* Changes the bound (a reload of [Features] CacheSize=). What is queued stays queued,
 * also past a smaller bound: it is copied already, and is written as before; features
 * are refused until the queue is back within it. */
void feature_spiller_set_max_pending(FeatureSpiller *s, uint64_t max_pending_bytes);

/* A feature_spill_fn: copies f and queues it. -ENOBUFS past the bound. */
int feature_spiller_queue(FeatureCache *c, const Feature *f, const void *data, void *userdata);

/* queued: features copied and queued; written, failed: what their writes did; dropped:
 * not queued (past the bound, or no memory to copy them); pending_bytes: queued, not
 * yet written. org.epd1.Feature's Spill* properties and the epd_feature_spill_* metrics. */
typedef struct FeatureSpillerStats {
        uint64_t queued, written, failed, dropped, pending_bytes;
} FeatureSpillerStats;
void feature_spiller_stats(FeatureSpiller *s, FeatureSpillerStats *ret);
/* Blocks until the queue is empty (for tests). */
void feature_spiller_flush(FeatureSpiller *s);
