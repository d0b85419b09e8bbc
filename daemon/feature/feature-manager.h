/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The feature subsystem of epdd: the feature cache (feature.c, pure) with its arenas,
 * the file store it spills to and loads from (off the event loop), the per-client
 * handles (ClientObjects: a dying client releases them, and a producer that dies
 * before publishing fails its waiters at once), the announce timer and the WAL hooks.
 * The bus glue is bus-feature.c. */

#include <stdbool.h>

#include "core/manager.h"
#include "feature/feature-load.h"
#include "feature/feature-spill.h"
#include "feature/feature-store.h"
#include "feature/feature.h"
#include "hashmap.h"
#include "id.h"
#include "list.h"
#include "reason.h"

#define FEATURE_PATH "/org/epd1/feature"
#define FEATURE_IFACE "org.epd1.Feature"
#define FEATURE_CHUNK_DEFAULT (64ULL << 10)
#define SPILL_PENDING_MAX (256ULL << 20) /* bytes copied and queued for the store (or CacheSize=,
                                           * when smaller: at start and at each reload) */

typedef struct FeatureHandle FeatureHandle;
typedef struct FeatureHolders FeatureHolders;

/* A call answered once its handle's feature settles (the bus glue's: an Acquire waiting
 * for a read back, a Wait for a Publish): done() is called once, with error 0 when the
 * feature is ready, its error when it failed, or -ECANCELED when the handle goes first. */
typedef struct FeatureLoadWaiter FeatureLoadWaiter;
struct FeatureLoadWaiter {
        void (*done)(FeatureLoadWaiter *w, FeatureHandle *h, int error);
};

typedef struct FeatureManager {
        Manager *manager;
        FeatureStore *store;
        FeatureSpiller *spiller; /* writes evictions to the store off the event loop */
        Hashmap *handles;        /* FeatureHandle* by id bytes */
        sd_event_source *timer;  /* announce deadlines */
        FeatureLoader *loader;   /* reads spilled features back off the event loop */
        uint64_t gone_lsn;       /* the last eviction's GONE record while not known durable
                                  * (0: none pending; UINT64_MAX: refused) */
        usec_t rerun_deadline;   /* while an Acquire asked again is dispatched: its first
                                  * read back's deadline (0: none), which it keeps */
        /* Feature* (its address) → FeatureHolders, while the feature has handles: a
         * FeatureReady goes to its own holders, not a walk over every handle. */
        Hashmap *holders;
        /* Producer handles whose production failed (ProduceTimeout=, Fail) and that
         * their clients still hold: a Reserve of the key by that client is refused, not
         * answered with another handle (the caller's library would lose the first). */
        LIST_HEAD(FeatureHandle, failed_producers);
} FeatureManager;

/* The handles on one feature (its producer, readers and waiters, pins). */
struct FeatureHolders {
        Feature *feature; /* the key of FeatureManager.holders */
        LIST_HEAD(FeatureHandle, handles);
        size_t n_handles;
        /* Those of its handles whose Acquire waits for its load, or whose Wait for its
         * Publish or failure: a state change answers its own, not a walk over every
         * waiting handle of every feature. */
        LIST_HEAD(FeatureHandle, waiting);
};

struct FeatureHandle {
        ClientObject object;
        FeatureManager *fm;
        EpdId id;
        FeatureRef *ref;
        FeatureLoadWaiter *waiter; /* while its feature is read back */
        FeatureHeldRegion held;    /* a departing producer's region, freed with the handle */
        LIST_FIELDS(FeatureHandle, waiting); /* in holders->waiting while it has a waiter */
        FeatureHolders *holders;   /* its feature's handles, this one among them */
        LIST_FIELDS(FeatureHandle, holders);
        /* Made for a producer (told to produce, or its Reserve made the feature), and
         * the ProduceTimeout= it was given then. */
        bool producer;
        usec_t produce_timeout;
        bool in_failed_producers;  /* its production failed: in FeatureManager.failed_producers */
        LIST_FIELDS(FeatureHandle, failed_producers);
};

/* Whether every evicted feature's GONE is durable, so that a region handed out now may
 * be written: otherwise a crash could leave the evicted feature's READY in the log
 * over the new bytes (a hit with another feature's bytes after the restart). */
bool feature_manager_region_settled(FeatureManager *fm);

extern const Subsystem feature_subsystem;

FeatureManager *feature_manager_get(Manager *m);

/* A handle of client c over ref (which it takes), linked to c. */
int feature_handle_new(FeatureManager *fm, Client *c, FeatureRef *ref, FeatureHandle **ret);
/* The explicit Release and the client's death: drops the reference (a producer's
 * release fails its waiters). */
void feature_handle_release(FeatureHandle *h);
/* The handle named id_str, if it is the caller's; else a negative errno and why. */
int feature_handle_lookup(FeatureManager *fm, Client *caller, const char *id_str, FeatureHandle **ret,
                          Reason *why);
/* w is called once h's feature settles (READY or FAILED): h's Acquire once the feature
 * is read back, or h's Wait once it is published or failed. */
void feature_handle_wait_load(FeatureHandle *h, FeatureLoadWaiter *w);
/* Takes h's waiter off (NULL if none), without calling it. */
FeatureLoadWaiter *feature_handle_unwait(FeatureHandle *h);
/* The handles on f (NULL when it has none). */
FeatureHolders *feature_manager_holders(FeatureManager *fm, const Feature *f);
/* The producer handle of client c on key whose production failed (it timed out or was
 * failed) and that c still holds; NULL if none. */
FeatureHandle *feature_manager_failed_producer(FeatureManager *fm, const Client *c, const char *key);

/* A worker's Acquire (hit, or told to produce) and Publish, in its counters
 * (core/worker.h: WorkerStats). */
void feature_manager_count_acquire(Worker *w, FeatureAcquireResult res);
void feature_manager_count_publish(FeatureHandle *h);

/* Re-arms the announce timer after the cache's deadlines changed. */
void feature_manager_arm_timer(FeatureManager *fm);
