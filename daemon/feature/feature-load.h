/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Reads spilled features back from the FeatureStore on a thread of its own, so that
 * an Acquire of a large spilled feature never stalls the event loop. The cache
 * (feature.c) reads the small header on the loop, reserves the region and hands the
 * positioned fd here (a feature_load_fn); the thread reads the data straight into the
 * region and posts the result back through an eventfd, on which the loop calls
 * feature_load_done(). A file found short, unreadable or damaged (its data's CRC32C) is
 * removed from the store and the feature FAILS with that error (-EBADMSG for a truncated
 * or damaged file). */

#include <systemd/sd-event.h>

#include "feature/feature-store.h"
#include "feature/feature.h"

typedef struct FeatureLoader FeatureLoader;

int feature_loader_new(sd_event *event, FeatureStore *store, FeatureLoader **ret);
/* Stops the thread (after the read in progress) and drops what is queued or done
 * without completing it: for shutdown, before the cache is freed. NULL is fine. */
FeatureLoader *feature_loader_free(FeatureLoader *l);

/* A feature_load_fn (userdata: the FeatureLoader). */
int feature_loader_queue(FeatureCache *c, Feature *f, int fd, void *dst, uint64_t size, uint32_t crc,
                         void *userdata);

typedef struct FeatureLoaderStats {
        uint64_t queued, loaded, failed;
} FeatureLoaderStats;
void feature_loader_stats(FeatureLoader *l, FeatureLoaderStats *ret);
