/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The feature cache: content-keyed FeatureBundles in feature arenas.
 *
 * A feature is RESERVED (a producer is writing it, or it was announced by Prefetch and
 * waits for one), then READY (readable), and finally EVICTED (its region reused) or
 * FAILED (its producer failed or went away, or nobody produced it in time). A FAILED or
 * EVICTED feature leaves the key table at once, so the next Acquire of that key starts
 * over; references still held to it see the final state and nothing else.
 *
 * References (FeatureRef) are what clients hold: readers of a READY feature, waiters
 * on a RESERVED one, the producer of a RESERVED one, and pins. A READY feature with no
 * reference stays cached, in LRU order, and counts against the byte budget; space is
 * made by evicting from the cold end (spilling to the FeatureStore first, if one is
 * configured). Referenced and pinned features are never evicted.
 *
 * Nothing is kept per request once its reference is released: the number of live
 * references is bounded (max_refs) and the number of features by the budget and
 * max_features, so a long run holds a bounded amount of memory.
 *
 * Pure logic, driven by the daemon's event loop (not thread-safe). State changes that
 * waiters care about (READY, FAILED) are reported through a callback; the bus glue turns
 * them into the FeatureReady signal. Time is passed in, for tests. */

#include <stdbool.h>
#include <stdint.h>

#include "id.h"
#include "list.h"
#include "proto/feature-desc.h"
#include "time-util.h"

typedef struct FeatureCache FeatureCache;
typedef struct Feature Feature;
typedef struct FeatureRef FeatureRef;
typedef struct FeatureStore FeatureStore;

#define FEATURE_KEY_MAX 256u /* bytes; keys are opaque, any byte but NUL */

typedef enum FeatureState {
        FEATURE_RESERVED,
        FEATURE_READY,
        FEATURE_FAILED,
        FEATURE_EVICTED,
        _FEATURE_STATE_MAX,
} FeatureState;

const char *feature_state_to_string(FeatureState s);

typedef enum FeatureRefKind {
        FEATURE_REF_READER,   /* holds a READY feature, or waits for a RESERVED one */
        FEATURE_REF_PRODUCER, /* must Reserve (if not yet), then Publish or Fail */
        FEATURE_REF_PIN,      /* keeps the feature from eviction; not a reader */
} FeatureRefKind;

struct Feature {
        FeatureCache *cache;
        char *key;
        FeatureState state;
        int error;              /* FAILED: the negative errno */

        bool has_region;
        uint32_t arena;         /* arena index (the Manager's numbering) */
        uint64_t offset;        /* bytes from the start of the arena fd */
        uint64_t size;          /* length of the region (whole chunks) */
        uint64_t bytes;         /* what the producer asked for */
        FeatureDesc *desc;

        EpdId request_id;       /* the request that produced it, for tracing */
        /* The uid of the client that reserved it (bus glue; UINT32_MAX when unknown:
         * replayed, read back): the request id is shown to that uid and root only. */
        uint32_t producer_uid;
        usec_t encode_usec;     /* encoder time reported at Publish */
        usec_t deadline;        /* announced (no producer yet): fails at this time */

        FeatureRef *producer;
        unsigned n_readers;     /* readers and waiters */
        unsigned n_pins;
        bool in_lru;
        LIST_FIELDS(Feature, lru);
        /* While in_lru: also in its arena's cold list (lru_arena: that arena's index in
         * the cache, + 1; 0: none, no region), in the same order, lru_seq counting
         * its place among all arenas' (feature.c: the coldest feature of the arenas
         * that can help, and what each could free, without walking the whole list). */
        LIST_FIELDS(Feature, arena_lru);
        size_t lru_arena;
        uint64_t lru_seq, lru_bytes;
        bool in_announced;      /* waits for a producer, in deadline order */
        LIST_FIELDS(Feature, announced);
        /* A producer at work, until this time (FeatureCacheConfig.produce_timeout_usec):
         * in the cache's producing queue, in deadline order. */
        usec_t produce_deadline;
        bool in_producing;
        LIST_FIELDS(Feature, producing);
};

struct FeatureRef {
        Feature *feature;
        FeatureRefKind kind;
        void *userdata;         /* the bus object wrapping it */
};

typedef struct FeatureStats {
        uint64_t hits;              /* Acquire found it READY (in memory or in the store) */
        uint64_t misses;            /* Acquire found nothing */
        uint64_t coalesced_waits;   /* Acquire found it RESERVED and waits */
        uint64_t produced;          /* Publish */
        uint64_t failed;            /* Fail, producer gone, or announce timeout */
        uint64_t evictions;
        uint64_t spilled;           /* written to the store before eviction */
        uint64_t loaded;            /* read back from the store */
        uint64_t read_back_timeouts;/* Acquires refused past [Features] ReadBackTimeout= */
        uint64_t produce_timeouts;  /* producers failed past [Features] ProduceTimeout= */
        uint64_t prefetch_requests;
        uint64_t prefetch_hits;     /* Prefetch found it READY, or read it back (once it lands) */
        uint64_t encoder_usec_saved;/* sum of encode_usec over hits */
        uint64_t bytes_cached;      /* regions of READY features */
        uint64_t bytes_reserved;    /* regions of RESERVED features */
        uint64_t n_features;        /* in the key table */
        uint64_t n_refs;            /* live references */
        uint64_t n_announced;       /* placeholders waiting for a producer */
        uint64_t bytes_fenced;      /* free at the restart, held back until its fence ends */
} FeatureStats;

typedef struct FeatureCacheConfig {
        uint64_t budget_bytes;      /* regions of READY + RESERVED features */
        uint64_t max_features;      /* entries in the key table */
        uint64_t max_refs;          /* live references, all clients together */
        usec_t announce_timeout_usec;/* Prefetch placeholder without a producer */
        uint64_t max_announced;     /* placeholders at once; they never evict anything */
        usec_t produce_timeout_usec;/* a producer that has not published by then fails (0: never) */
} FeatureCacheConfig;

#define FEATURE_CACHE_MAX_FEATURES_DEFAULT 65536u
#define FEATURE_CACHE_MAX_REFS_DEFAULT 262144u
#define FEATURE_ANNOUNCE_TIMEOUT_DEFAULT (30 * USEC_PER_SEC)
#define FEATURE_CACHE_MAX_ANNOUNCED_DEFAULT 4096u

/* Called when a feature becomes READY or FAILED (waiters wake up), before any
 * reference is freed. */
typedef void (*feature_state_cb)(FeatureCache *c, Feature *f, void *userdata);

int feature_cache_new(const FeatureCacheConfig *config, FeatureCache **ret);
/* Frees everything; outstanding references must have been released (their owners, the
 * clients, go first at shutdown). */
FeatureCache *feature_cache_free(FeatureCache *c);
void feature_cache_set_callback(FeatureCache *c, feature_state_cb cb, void *userdata);
void *feature_cache_get_userdata(const FeatureCache *c);
/* Adds a feature arena: [data_offset, data_offset + data_size) of arena `index`, cut in
 * chunks of `chunk` bytes. `base` is the daemon's mapping of the whole arena (NULL for
 * memory the daemon does not map, e.g. GPU: such features are never spilled). */
int feature_cache_add_arena(FeatureCache *c, uint32_t index, void *base, uint64_t data_offset,
                            uint64_t data_size, uint64_t chunk);
/* Spill/load through this store (not owned; NULL to stop). */
void feature_cache_set_store(FeatureCache *c, FeatureStore *s);
/* By default an eviction writes the feature to the store before its region goes. With a
 * spill function, eviction hands the feature (intact, for the duration of the call) to
 * it instead: it copies what it needs and writes later, off the event loop (the daemon
 * uses feature-spill.c). A negative return means "not spilled". */
/* Journal (docs/wal.md, WAL record types 0x05xx): READY is journaled when a feature
 * becomes READY (Publish, or loaded from the store) with its region and descriptor;
 * GONE (payload: the key) when a READY feature's region is released (eviction, flush).
 * References, pins and RESERVED features are not journaled: after a restart a client
 * that held one acquires again. Set the journal after the replay; a failed journal
 * write is logged, the transition stays. */
enum {
        FEATURE_REC_READY = 0x01,
        FEATURE_REC_GONE = 0x02,
};

/* READY payload, little-endian: u32 arena, u32 key length K, u64 offset, u64 size,
 * u64 bytes, u64 encode_usec, 16-byte request id, u32 descriptor length D, u32 0,
 * then K key bytes (no NUL) and the D-byte binary descriptor (feature-desc.h). */
#define FEATURE_REC_HEADER_SIZE 64u

typedef struct FeatureRecord {
        uint32_t arena;
        uint64_t offset, size, bytes;
        usec_t encode_usec;
        EpdId request_id;
        const char *key; /* not NUL-terminated, inside the parsed buffer */
        size_t key_len;
        const void *desc;
        size_t desc_len;
} FeatureRecord;

int feature_record_ready_encode(const Feature *f, void **ret, size_t *ret_len);
/* Pure parsing of a READY payload (fuzzed): 0 or -EBADMSG; the descriptor is not parsed. */
int feature_record_ready_parse(const void *buf, size_t n, FeatureRecord *ret);

typedef int (*feature_journal_fn)(FeatureCache *c, uint16_t rec, const void *payload, size_t len,
                                  void *userdata);
void feature_cache_set_journal(FeatureCache *c, feature_journal_fn fn, void *userdata);
/* WAL replay (before the journal is set): READY puts the feature back in the table at
 * its exact region, READY and unreferenced (on the LRU); GONE takes it out. */
int feature_cache_apply_record(FeatureCache *c, uint16_t type, const void *payload, size_t len);
/* Drops every READY feature of an arena whose memory did not survive the restart
 * (journaled as GONE when the journal is set). Returns how many. */
uint64_t feature_cache_drop_arena(FeatureCache *c, uint32_t arena);
/* After a restart whose workers of before may still be running (they mapped the arenas
 * and may still read a feature there, or write one they had reserved): until
 * feature_cache_unfence(), no byte of the arenas in arena_mask (bit = arena index; those
 * at 64 or above always) that was free when this is called is handed out, and no READY
 * feature there now (the replayed ones) is evicted. Hits on them are served. Returns the
 * bytes held back, or -ENOMEM (then nothing is fenced). Once fenced, a second call
 * changes nothing. */
int64_t feature_cache_fence(FeatureCache *c, uint64_t arena_mask);
/* Ends the fence: the runs go back, the features to the LRU (within the budget). */
void feature_cache_unfence(FeatureCache *c);
bool feature_cache_fenced(const FeatureCache *c);
/* Snapshot: one READY record (type_base + FEATURE_REC_READY) per READY feature. */
int feature_cache_snapshot(FeatureCache *c, int (*add)(void *userdata, uint16_t type, const void *rec, size_t len),
                           void *userdata, uint16_t type_base);

typedef int (*feature_spill_fn)(FeatureCache *c, const Feature *f, const void *data, void *userdata);
void feature_cache_set_spill(FeatureCache *c, feature_spill_fn fn, void *userdata);
/* Reads a feature's data back from the store off the event loop: fd is positioned at
 * the data (taken over in every case), dst is the feature's region (size bytes). The
 * reader calls feature_load_done() on the loop when it has finished. Without a loader,
 * loads are synchronous. */
typedef int (*feature_load_fn)(FeatureCache *c, Feature *f, int fd, void *dst, uint64_t size, uint32_t crc,
                               void *userdata);
void feature_cache_set_loader(FeatureCache *c, feature_load_fn fn, void *userdata);
/* The data of a loading feature is in place (error 0: READY) or could not be read
 * (error < 0, e.g. -EBADMSG for a truncated file: FAILED with that error). Notifies. */
void feature_load_done(Feature *f, int error);
/* Being read back from the store: RESERVED, no producer, READY or FAILED follows. */
bool feature_loading(const Feature *f);
/* Looks f's key up in the store off the event loop (its file's open, header, key and
 * descriptor: on a disk that stalls, these stall too); then calls feature_probe_done()
 * on the loop. Used only with a loader: the data's read follows through it. Without a
 * prober, the lookup is made on the caller's thread. */
typedef struct FeatureStoreEntry FeatureStoreEntry;
typedef int (*feature_probe_fn)(FeatureCache *c, Feature *f, void *userdata);
void feature_cache_set_prober(FeatureCache *c, feature_probe_fn fn, void *userdata);
/* The lookup of a probing feature ended: error < 0 (-ENOENT: no stored copy after all;
 * -EBADMSG: a damaged one, removed), or e describes the stored copy (its fd and
 * descriptor taken over here, in every case). The feature then gives back the chunks
 * of its region the data does not need and its data is read through the loader, or it
 * FAILS with the error. */
void feature_probe_done(Feature *f, int error, FeatureStoreEntry *e);
/* FAILED at its stored copy's lookup (gone, damaged header, another key's, out of file
 * descriptors), before its read could start (the loader refused it), or larger than
 * the store's index had it: nothing of it was read, and asking again is a miss (the
 * store no longer offers the key), or for the last, a read-back of the right size.
 * Not counted in the cache's failures. A failed read of the data is not this. */
bool feature_lookup_failed(const Feature *f);
/* Changes the budget; evicts down to it. */
void feature_cache_set_budget(FeatureCache *c, uint64_t budget_bytes);
const FeatureStats *feature_cache_stats(FeatureCache *c);
/* An Acquire refused while its feature was still being read back (the bus glue's). */
void feature_cache_count_read_back_timeout(FeatureCache *c);
uint64_t feature_cache_budget(const FeatureCache *c);

/* Validates a client-supplied key: 1..FEATURE_KEY_MAX bytes. */
bool feature_key_valid(const char *key);

Feature *feature_cache_get(FeatureCache *c, const char *key);

typedef enum FeatureAcquireResult {
        FEATURE_ACQUIRE_HIT,     /* READY: read it */
        FEATURE_ACQUIRE_WAIT,    /* RESERVED by someone: wait for READY or FAILED */
        FEATURE_ACQUIRE_PRODUCE, /* you produce: Reserve through the returned ref */
        FEATURE_ACQUIRE_LOADING, /* being read back from the store (loader set): READY or FAILED follows */
} FeatureAcquireResult;

/* Acquires a reference to key. If the key is missing (and not in the store) and
 * may_produce, creates a RESERVED feature whose producer is the returned ref
 * (PRODUCE); so does an announced feature that no producer has claimed yet. Without
 * may_produce a missing key is -ENOENT. -EUSERS past max_refs, -ENOSPC past
 * max_features. */
int feature_acquire(FeatureCache *c, const char *key, bool may_produce, usec_t now,
                    FeatureRef **ret, FeatureAcquireResult *result);

/* Reserves a region of `bytes` for key, described by desc (validated against bytes;
 * taken over on success). A missing or announced key becomes RESERVED with the
 * returned ref as its producer. -EEXIST if READY, -EBUSY if another producer holds it,
 * -E2BIG if bytes exceeds the budget or every arena, -ENODEV if there is no feature
 * arena at all, -ENOSPC if nothing more can be
 * evicted to make room, -EINVAL for a bad descriptor (*issue says which). */
int feature_reserve(FeatureCache *c, const char *key, uint64_t bytes, FeatureDesc **desc,
                    const EpdId *request_id, FeatureRef **ret, FeatureDescIssue *issue);
/* The same for a producer ref from Acquire (PRODUCE) that has no region yet. */
int feature_ref_reserve(FeatureRef *r, uint64_t bytes, FeatureDesc **desc,
                        const EpdId *request_id, FeatureDescIssue *issue);
/* Both, with the region placed only in arenas whose index bit is set in arena_mask (the
 * arenas the producer has mapped); -E2BIG if none of those can ever hold it. */
int feature_reserve_in(FeatureCache *c, const char *key, uint64_t bytes, uint64_t arena_mask,
                       FeatureDesc **desc, const EpdId *request_id, FeatureRef **ret,
                       FeatureDescIssue *issue);
int feature_ref_reserve_in(FeatureRef *r, uint64_t bytes, uint64_t arena_mask, FeatureDesc **desc,
                           const EpdId *request_id, FeatureDescIssue *issue);

/* The most encoder time a Publish may report (the bus glue refuses more): one encode
 * that took longer is no encode, and every hit adds it to EncoderTimeSavedUSec. */
#define FEATURE_ENCODE_USEC_MAX (3600 * USEC_PER_SEC)

/* Producer: marks the feature READY (the ref becomes a reader). -EBADSLT if the ref is
 * not the producer of a feature with a region; the journal's error if its READY record
 * was not taken (the feature then stays RESERVED, the ref its producer). */
int feature_publish(FeatureRef *r, usec_t encode_usec);
/* Producer: marks it FAILED with error (negative errno), waking waiters. The ref stays,
 * as a reader of a FAILED feature. */
int feature_fail(FeatureRef *r, int error);
/* As feature_fail(), but its region stays allocated, the producer's still (its process may
 * still write there: a departing client's GPU work), until feature_cache_region_free()
 * with what *ret_held says (held->size 0: it had no region). */
typedef struct FeatureHeldRegion {
        uint32_t arena;
        uint64_t offset, size;
} FeatureHeldRegion;
int feature_fail_holding_region(FeatureRef *r, int error, FeatureHeldRegion *ret_held);
void feature_cache_region_free(FeatureCache *c, const FeatureHeldRegion *held);

/* Pins a READY or RESERVED feature: it is never evicted while the pin lives. */
int feature_pin(FeatureCache *c, const char *key, FeatureRef **ret);

/* Releases a reference of any kind. A producer that releases before Publish fails the
 * feature with -EPIPE (the same path as a producer whose client dies). NULL is fine. */
FeatureRef *feature_ref_release(FeatureRef *r);
/* A producer reference from feature_acquire() (PRODUCE) whose claim came to nothing
 * (its reservation or its handle was refused), as a refused Reserve: its Acquire is
 * not counted as a miss; an announced feature goes back to waiting for a producer,
 * until its deadline; a fresh one that nobody else holds is dropped (not failed: no
 * failure counted, nobody told). Anything else as feature_ref_release(). */
FeatureRef *feature_ref_unclaim(FeatureRef *r);

typedef enum FeaturePrefetchResult {
        FEATURE_PREFETCH_PRESENT,   /* READY in memory (moved to the hot end) */
        FEATURE_PREFETCH_LOADED,    /* in the store: READY now, or being read back (loader set) */
        FEATURE_PREFETCH_PENDING,   /* already RESERVED */
        FEATURE_PREFETCH_ANNOUNCED, /* created, waits for a producer (announce timeout) */
} FeaturePrefetchResult;

/* Announces that key will be needed, so that an encoder can start on it before a
 * prefill asks. Neither an announcement nor a read-back from the store evicts a cached
 * feature: past max_announced, with the key table full, or with a stored key that does
 * not fit in free space, it is -ENOSPC; a stored key that no mapped arena can hold is
 * -E2BIG. A stored copy that cannot be read is its error (-EBADMSG: damaged, removed;
 * -ENOMEM, ...): never announced. */
int feature_prefetch(FeatureCache *c, const char *key, usec_t now, FeaturePrefetchResult *ret);

/* Fails announced features whose deadline passed, and features whose producer has not
 * published by its produce deadline (-ETIMEDOUT: their waiters hear it, the next Acquire
 * produces); returns the next deadline (USEC_INFINITY if none), for the daemon's timer. */
usec_t feature_cache_expire(FeatureCache *c, usec_t now);
/* f's producer just took it (Acquire's "produce", a Reserve that made it): it has until
 * now + produce_timeout_usec to publish. Nothing without a producer or a timeout. */
void feature_producing_start(FeatureCache *c, Feature *f, usec_t now);
/* For the claims made from now on. */
void feature_cache_set_produce_timeout(FeatureCache *c, usec_t timeout);

/* Evicts every unreferenced READY feature (e.g. `epdctl features flush`). Returns how
 * many. */
uint64_t feature_cache_flush(FeatureCache *c);

/* The daemon's mapping of a feature's bytes, or NULL (no region or unmapped arena). */
void *feature_data(const Feature *f);

static inline void feature_cache_freep(FeatureCache **c) {
        feature_cache_free(*c);
}
