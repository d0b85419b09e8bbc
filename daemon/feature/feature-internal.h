/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Internal to feature/: the cache's structures and the helpers its files share
 * (feature.c: the cache; feature-replay.c: its journal's replay, snapshot and the
 * drop of an arena's features). The API is feature.h. */

#include <stdbool.h>
#include <stdint.h>

#include "feature/feature-alloc.h"
#include "feature/feature.h"
#include "hashmap.h"
#include "macro.h"

typedef struct CacheArena {
        uint32_t index;
        uint8_t *base;
        FeatureAllocator *alloc;
        QUEUE_HEAD(Feature, arena_lru); /* this arena's features of the cache's lru, in its order */
        uint64_t evictable;             /* their bytes (kept as they come and go) */
        /* The fence after a restart (feature_cache_fence()): the runs that were free,
         * taken from the allocator until feature_cache_unfence(). */
        uint64_t *fence_offsets;
        size_t n_fence;
        bool helps;         /* eviction_could_help(): evicting here can make the region */
} CacheArena;

struct FeatureCache {
        FeatureCacheConfig config;
        Hashmap *features; /* key → Feature, RESERVED and READY only */
        CacheArena *arenas;
        size_t n_arenas;
        QUEUE_HEAD(Feature, lru);                 /* first: coldest */
        uint64_t lru_seq;                         /* the next lru_seq given */
        uint64_t evictable;                       /* bytes of the features in lru */
        QUEUE_HEAD(Feature, announced); /* first: earliest deadline */
        QUEUE_HEAD(Feature, producing); /* first: earliest produce deadline (one timeout: in order) */
        FeatureStats stats;
        FeatureStore *store;
        feature_state_cb cb;
        void *userdata;
        feature_spill_fn spill_fn;
        void *spill_userdata;
        feature_load_fn load_fn;
        void *load_userdata;
        feature_probe_fn probe_fn;
        void *probe_userdata;
        feature_journal_fn journal_fn;
        void *journal_userdata;
        /* Keys whose READY the replay could not take back (the arena is cut or used
         * differently now): journaled GONE once the journal is set. Key → its own copy
         * (the value, which the key points into); NULL when none. */
        Hashmap *skipped;
        bool fenced; /* feature_cache_fence() until feature_cache_unfence() */
};

/* Private flags kept beside the public fields. */
typedef struct FeaturePriv {
        Feature pub;
        bool in_table;
        bool on_disk; /* an identical copy is in the store */
        bool loading; /* its data is being read back from the store (load_fn) */
        bool probing; /* loading, its stored copy still being looked up (probe_fn) */
        bool lookup_failed; /* FAILED at that lookup: no usable stored copy (no data read) */
        uint32_t load_readers; /* Acquires answered by that read: hits once it lands */
        bool load_prefetched; /* a Prefetch started that read: its hit once it lands */
        bool fenced; /* replayed, kept off the LRU until feature_cache_unfence() */
        /* Failed past its produce deadline with its producer still there (maybe still
         * writing): its region stays allocated until this reference, the producer's (a
         * reader of the failed feature now), goes; not until the waiters' go too. */
        FeatureRef *region_holder;
} FeaturePriv;

#define PRIV(f) container_of(f, FeaturePriv, pub)

CacheArena *feature_arena_of(const FeatureCache *c, uint32_t index);
/* A new RESERVED feature for key in the table (counted). */
int feature_entry_new(FeatureCache *c, const char *key, Feature **ret);
/* Out of the table and queues. */
void feature_entry_unlink(FeatureCache *c, Feature *f);
void feature_entry_destroy(Feature *f);
/* Destroyed unless still in the table or referenced. */
void feature_entry_maybe_destroy(Feature *f);
/* In the LRU exactly when READY and unreferenced. */
void feature_lru_update(FeatureCache *c, Feature *f);
/* The journal's READY of f (0 without a journal; its error, logged) and GONE (feature-replay.c). */
int feature_journal_ready(FeatureCache *c, Feature *f);
void feature_journal_gone(FeatureCache *c, Feature *f);
/* Its region back to the arena (a READY one's GONE journaled first). */
void feature_region_release(FeatureCache *c, Feature *f);
/* feature-replay.c: the keys whose READY the replay skipped, journaled GONE (once the
 * journal is set), or freed. */
void feature_replay_skipped_journal(FeatureCache *c);
void feature_replay_skipped_free(FeatureCache *c);
