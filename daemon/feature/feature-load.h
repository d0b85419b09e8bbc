/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Reads spilled features back from the FeatureStore on a thread of its own, so that
 * an Acquire of a spilled feature never makes the event loop touch the disk. First the
 * thread looks the key up (a feature_probe_fn: the file's open, header, key and
 * descriptor) and the loop calls feature_probe_done(); the cache (feature.c) reserves
 * the region there and hands the positioned fd back here (a feature_load_fn); the
 * thread reads the data straight into the region, and the loop calls
 * feature_load_done(). Results come back through an eventfd, in the order the jobs were
 * queued. A file found short, unreadable or damaged (its data's CRC32C) is removed from
 * the store and the feature FAILS with that error (-EBADMSG for a truncated or damaged
 * file). */

#include <systemd/sd-event.h>

#include "feature/feature-store.h"
#include "feature/feature.h"

typedef struct FeatureLoader FeatureLoader;

int feature_loader_new(sd_event *event, FeatureStore *store, FeatureLoader **ret);
/* Stops the thread (after the read in progress) and drops what is queued or done
 * without completing it: for shutdown, before the cache is freed. NULL is fine. */
FeatureLoader *feature_loader_free(FeatureLoader *l);

/* A feature_probe_fn (userdata: the FeatureLoader). */
int feature_loader_probe(FeatureCache *c, Feature *f, void *userdata);
/* A feature_load_fn (userdata: the FeatureLoader). */
int feature_loader_queue(FeatureCache *c, Feature *f, int fd, void *dst, uint64_t size, uint32_t crc,
                         void *userdata);

typedef struct FeatureLoaderStats {
        uint64_t probed, queued, loaded, failed; /* failed: lookups and reads */
} FeatureLoaderStats;
void feature_loader_stats(FeatureLoader *l, FeatureLoaderStats *ret);
