/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "feature/feature-manager.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "core/worker.h"
#include "feature/bus-feature.h"
#include "log.h"
#include "macro.h"
#include "parse-util.h"
#include "wal/wal-manager.h"

FeatureManager *feature_manager_get(Manager *m) {
        return m->features ? feature_cache_get_userdata(m->features) : NULL;
}

static void handle_release_object(ClientObject *o) {
        feature_handle_release(container_of(o, FeatureHandle, object));
}

/* A feature changed state: FeatureReady on the bus, and the calls that waited for it
 * (Acquires for its load, Waits for its Publish or failure) are answered. A failed
 * feature's producer handle, still held (its production timed out, or was failed), is
 * noted: a late Reserve through it is refused. */
static void on_state(FeatureCache *c, Feature *f, void *userdata) {
        FeatureManager *fm = userdata;
        FeatureHolders *g = f->state == FEATURE_FAILED ? feature_manager_holders(fm, f) : NULL;
        if (g)
                LIST_FOREACH(holders, h, g->handles)
                        if (h->producer && !h->in_failed_producers) {
                                LIST_PREPEND(failed_producers, fm->failed_producers, h);
                                h->in_failed_producers = true;
                        }
        bus_feature_emit_ready(fm->manager, f);
        /* f's own waiting handles. An answer may release its own handle (never another:
         * `next` stays), and with the last one f's holders: not touched after. */
        int error = f->state == FEATURE_READY ? 0 : (f->error < 0 ? f->error : -EIO);
        g = feature_manager_holders(fm, f);
        FeatureHandle *next;
        for (FeatureHandle *h = g ? g->waiting : NULL; h; h = next) {
                next = h->waiting_next;
                FeatureLoadWaiter *w = TAKE_PTR(h->waiter);
                LIST_REMOVE(waiting, g->waiting, h);
                w->done(w, h, error);
        }
}

static int on_timer(sd_event_source *s, uint64_t usec, void *userdata);

void feature_manager_arm_timer(FeatureManager *fm) {
        usec_t next = feature_cache_expire(fm->manager->features, now_usec(CLOCK_MONOTONIC));
        if (next == USEC_INFINITY) {
                if (fm->timer)
                        (void)sd_event_source_set_enabled(fm->timer, SD_EVENT_OFF);
                return;
        }
        if (!fm->timer) {
                int r = sd_event_add_time(fm->manager->event, &fm->timer, CLOCK_MONOTONIC, next,
                                          10 * USEC_PER_MSEC, on_timer, fm);
                if (r < 0)
                        log_warning_errno(r, "Cannot arm the feature announce timer: %m");
                return;
        }
        (void)sd_event_source_set_time(fm->timer, next);
        (void)sd_event_source_set_enabled(fm->timer, SD_EVENT_ONESHOT);
}

static int on_timer(sd_event_source *s, uint64_t usec, void *userdata) {
        feature_manager_arm_timer(userdata);
        return 0;
}

/* ---- handles ---- */

FeatureHolders *feature_manager_holders(FeatureManager *fm, const Feature *f) {
        return fm && f ? hashmap_get(fm->holders, &f) : NULL;
}

/* h among its feature's handles. */
static int holders_add(FeatureManager *fm, FeatureHandle *h) {
        Feature *f = h->ref->feature;
        FeatureHolders *g = hashmap_get(fm->holders, &f);
        if (!g) {
                g = calloc(1, sizeof *g);
                if (!g)
                        return -ENOMEM;
                g->feature = f;
                int r = hashmap_put(fm->holders, &g->feature, g);
                if (r < 0) {
                        free(g);
                        return r;
                }
        }
        LIST_PREPEND(holders, g->handles, h);
        g->n_handles++;
        h->holders = g;
        return 0;
}

static void holders_remove(FeatureManager *fm, FeatureHandle *h) {
        FeatureHolders *g = TAKE_PTR(h->holders);
        if (!g)
                return;
        LIST_REMOVE(holders, g->handles, h);
        if (--g->n_handles == 0) {
                hashmap_remove(fm->holders, &g->feature);
                free(g);
        }
}

FeatureHandle *feature_manager_failed_producer(FeatureManager *fm, const Client *c, const char *key) {
        LIST_FOREACH(failed_producers, h, fm->failed_producers)
                if (h->object.owner == c && strcmp(h->ref->feature->key, key) == 0)
                        return h;
        return NULL;
}

void feature_handle_release(FeatureHandle *h) {
        FeatureLoadWaiter *w = feature_handle_unwait(h);
        if (w)
                w->done(w, h, -ECANCELED);
        client_object_unlink(&h->object);
        hashmap_remove(h->fm->handles, &h->id);
        /* Before the reference goes: a producer's release fails the feature, whose
         * FeatureReady is for the handles that stay. */
        holders_remove(h->fm, h);
        if (h->in_failed_producers)
                LIST_REMOVE(failed_producers, h->fm->failed_producers, h);
        feature_ref_release(h->ref); /* a producer's release fails its waiters */
        feature_cache_region_free(h->fm->manager->features, &h->held);
        free(h);
}

/* A client whose connection went while its process may still run (it maps GPU memory:
 * client_gone() waits up to 10 s for the process to exit before freeing it): what it was
 * producing fails now, so that the readers waiting for it hear so at once (a dying
 * encoder never hangs a prefill), but each region stays allocated, held by its handle,
 * until the client is freed: its GPU work may still be writing there. */
static void feature_worker_departing(Manager *m, Worker *w) {
        FeatureManager *fm = feature_manager_get(m);
        Client *c = w->object.owner;
        FeatureHandle *h, **mine;
        size_t it = 0, n = 0;
        if (!fm || !c || hashmap_size(fm->handles) == 0)
                return;
        /* Collected first: failing wakes the readers, whose answers may add handles. */
        mine = calloc(hashmap_size(fm->handles), sizeof *mine);
        if (!mine) {
                log_warning("Cannot fail the features of departing client %s for want of memory: their readers "
                            "wait until its process exits.", c->key);
                return;
        }
        while (hashmap_iterate(fm->handles, &it, (void **)&h, NULL))
                if (h->object.owner == c && h->ref->kind == FEATURE_REF_PRODUCER &&
                    h->ref->feature->state == FEATURE_RESERVED)
                        mine[n++] = h;
        for (size_t i = 0; i < n; i++)
                (void)feature_fail_holding_region(mine[i]->ref, -EPIPE, &mine[i]->held);
        free(mine);
}

int feature_handle_new(FeatureManager *fm, Client *c, FeatureRef *ref, FeatureHandle **ret) {
        FeatureHandle *h = calloc(1, sizeof *h);
        int r;

        if (!h)
                return -ENOMEM;
        h->fm = fm;
        h->ref = ref;
        r = epd_id_random(&h->id);
        if (r >= 0)
                r = client_object_link(c, &h->object,
                                       ref->kind == FEATURE_REF_PIN ? CLIENT_OBJECT_PIN
                                                                    : CLIENT_OBJECT_FEATURE_REF,
                                       handle_release_object);
        if (r < 0) {
                free(h);
                return r;
        }
        r = hashmap_put(fm->handles, &h->id, h);
        if (r < 0) {
                client_object_unlink(&h->object);
                free(h);
                return r;
        }
        r = holders_add(fm, h);
        if (r < 0) {
                hashmap_remove(fm->handles, &h->id);
                client_object_unlink(&h->object);
                free(h);
                return r;
        }
        h->producer = ref->kind == FEATURE_REF_PRODUCER;
        h->produce_timeout = fm->manager->config.feature_produce_timeout_usec;
        ref->userdata = h;
        *ret = h;
        return 0;
}

int feature_handle_lookup(FeatureManager *fm, Client *caller, const char *id_str, FeatureHandle **ret,
                          Reason *why) {
        EpdId id;
        FeatureHandle *h;

        if (epd_id_from_string(id_str, &id) < 0)
                return reason_set(why, -EINVAL, "'%.64s' is not a handle.", id_str);
        h = hashmap_get(fm->handles, &id);
        if (!h)
                return reason_set(why, -ENOENT, "No feature handle %s.", id_str);
        if (h->object.owner != caller)
                return reason_set(why, -EPERM, "Feature handle %s belongs to another client.", id_str);
        *ret = h;
        return 0;
}

void feature_handle_wait_load(FeatureHandle *h, FeatureLoadWaiter *w) {
        assert(h->holders && !h->waiter); /* a live handle is among its feature's holders */
        h->waiter = w;
        LIST_PREPEND(waiting, h->holders->waiting, h);
}

FeatureLoadWaiter *feature_handle_unwait(FeatureHandle *h) {
        FeatureLoadWaiter *w = TAKE_PTR(h->waiter);
        if (w)
                LIST_REMOVE(waiting, h->holders->waiting, h);
        return w;
}

void feature_manager_count_acquire(Worker *w, FeatureAcquireResult res) {
        /* A read back from the store counts once it landed (bus-feature.c's answer). */
        if (res == FEATURE_ACQUIRE_HIT)
                w->stats.feature_hits++;
        else if (res == FEATURE_ACQUIRE_PRODUCE)
                w->stats.feature_misses++;
}

void feature_manager_count_publish(FeatureHandle *h) {
        Worker *w = h->object.owner ? client_get_worker(h->object.owner) : NULL;
        if (w)
                w->stats.features_produced++;
}

/* ---- the subsystem ---- */

bool feature_manager_region_settled(FeatureManager *fm) {
        return wal_manager_mark_durable(fm->manager, &fm->gone_lsn);
}

/* A read back from the store into a region that may be an evicted feature's: handed to
 * the load thread once that eviction's GONE is durable, as a producer's region is
 * (send_region in bus-feature.c). Until then the feature stays RESERVED and loading. */
typedef struct HeldLoad {
        FeatureManager *fm;
        FeatureCache *cache;
        Feature *feature;
        int fd;
        void *dst;
        uint64_t size;
        uint32_t crc;
        bool in_call; /* inside wal_manager_after_durable(): the caller takes the result */
        bool answered;
        int result;
} HeldLoad;

static void held_load_go(void *userdata, int error) {
        HeldLoad *l = userdata;
        int r = error;

        if (r >= 0)
                r = feature_loader_queue(l->cache, l->feature, TAKE_FD(l->fd), l->dst, l->size, l->crc, l->fm->loader);
        else
                l->fd = safe_close(l->fd);
        if (l->in_call) {
                l->answered = true;
                l->result = r;
                return;
        }
        if (r < 0) {
                if (error < 0) /* the journal refused the GONE of the region's evicted features */
                        log_warning_errno(r, "Feature %.64s: not read back from the store: the journal refused "
                                          "the record of what its region held before: %m", l->feature->key);
                else
                        log_warning_errno(r, "Feature %.64s: cannot read it back from the store: %m", l->feature->key);
                feature_load_done(l->feature, r);
        }
        free(l);
}

static int queue_load(FeatureCache *c, Feature *f, int fd, void *dst, uint64_t size, uint32_t crc, void *userdata) {
        FeatureManager *fm = userdata;
        int r;

        if (feature_manager_region_settled(fm))
                return feature_loader_queue(c, f, fd, dst, size, crc, fm->loader);
        if (fm->gone_lsn == UINT64_MAX) {
                safe_close(fd); /* the GONE was refused: it never becomes durable */
                return -EIO;
        }
        HeldLoad *l = malloc(sizeof *l);
        if (!l) {
                safe_close(fd);
                return -ENOMEM;
        }
        *l = (HeldLoad) { .fm = fm, .cache = c, .feature = f, .fd = fd, .dst = dst, .size = size, .crc = crc,
                          .in_call = true };
        r = wal_manager_after_durable(fm->manager, held_load_go, l);
        if (r < 0 || l->answered) {
                if (r >= 0)
                        r = l->result;
                safe_close(l->fd);
                free(l);
                return r;
        }
        l->in_call = false;
        return 0;
}

/* The spill queue's bound: the smaller of SPILL_PENDING_MAX and CacheSize=, at start and
 * at every reload. */
static uint64_t spill_pending_max(const Config *c) {
        return MIN(SPILL_PENDING_MAX, c->feature_cache_bytes);
}

/* What feature_init() refuses of [Features] StoreDirectory= (a directory that does not
 * exist, is not one or cannot be read; a kernel without openat2), with its message,
 * nothing made or removed: `epdd --check-config` and a reload refuse it as start-up
 * does. */
static int feature_verify(Manager *m) {
        const char *dir = m->config.feature_store_dir;
        int r;

        if (!dir)
                return 0;
        r = feature_store_check(dir);
        if (r < 0)
                return log_error_errno(r, "Feature store %s: %m", dir);
        return 0;
}

static int feature_init(Manager *m) {
        _cleanup_(feature_cache_freep) FeatureCache *c = NULL;
        FeatureManager *fm;
        int r;

        r = feature_cache_new(&(FeatureCacheConfig){ .budget_bytes = m->config.feature_cache_bytes,
                                                     .produce_timeout_usec = m->config.feature_produce_timeout_usec },
                              &c);
        if (r < 0)
                return log_error_errno(r, "Cannot create the feature cache: %m");
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (a->usage != ARENA_USAGE_FEATURE)
                        continue;
                uint64_t chunk = a->index < m->config.n_arenas ? m->config.arenas[a->index].page_size : 0;
                r = feature_cache_add_arena(c, a->index, a->domain == MEMORY_HOST ? a->base : NULL,
                                            a->data_offset, arena_data_size(a),
                                            chunk ? chunk : FEATURE_CHUNK_DEFAULT);
                if (r < 0)
                        return log_error_errno(r, "Arena '%s': cannot use it for features: %m", a->name);
        }
        fm = calloc(1, sizeof *fm);
        if (!fm)
                return log_oom();
        fm->manager = m;
        fm->handles = hashmap_new(HASHMAP_KEY_BYTES, sizeof(EpdId));
        fm->holders = hashmap_new(HASHMAP_KEY_BYTES, sizeof(Feature *));
        if (!fm->handles || !fm->holders) {
                hashmap_free(fm->handles);
                hashmap_free(fm->holders);
                free(fm);
                return log_oom();
        }
        if (m->config.feature_store_dir) {
                r = feature_store_open(m->config.feature_store_dir, m->config.feature_store_max_bytes,
                                       &fm->store);
                if (r < 0) {
                        hashmap_free(fm->handles);
                        hashmap_free(fm->holders);
                        free(fm);
                        return log_error_errno(r, "Feature store %s: %m", m->config.feature_store_dir);
                }
                r = feature_spiller_new(fm->store, spill_pending_max(&m->config), &fm->spiller);
                if (r < 0) {
                        feature_store_free(fm->store);
                        hashmap_free(fm->handles);
                        hashmap_free(fm->holders);
                        free(fm);
                        return log_error_errno(r, "Cannot start the feature spill thread: %m");
                }
                r = feature_loader_new(m->event, fm->store, &fm->loader);
                if (r < 0) {
                        feature_spiller_free(fm->spiller);
                        feature_store_free(fm->store);
                        hashmap_free(fm->handles);
                        hashmap_free(fm->holders);
                        free(fm);
                        return log_error_errno(r, "Cannot start the feature load thread: %m");
                }
                feature_cache_set_store(c, fm->store);
                feature_cache_set_spill(c, feature_spiller_queue, fm->spiller);
                feature_cache_set_loader(c, queue_load, fm);
                feature_cache_set_prober(c, feature_loader_probe, fm->loader);
        }
        feature_cache_set_callback(c, on_state, fm);
        m->features = TAKE_PTR(c);
        return 0;
}

static void feature_done(Manager *m) {
        FeatureManager *fm = feature_manager_get(m);

        if (!fm)
                return;
        /* Clients (and with them every handle) are gone by now. The load thread stops
         * before the cache (and the regions it reads into) goes. */
        fm->loader = feature_loader_free(fm->loader);
        m->features = feature_cache_free(m->features);
        sd_event_source_disable_unref(fm->timer);
        feature_spiller_free(fm->spiller); /* writes what is queued */
        feature_store_free(fm->store);
        hashmap_free(fm->handles);
        hashmap_free(fm->holders); /* empty: every handle went with its client */
        free(fm);
}

static int feature_reload(Manager *m, const Config *n) {
        FeatureManager *fm = feature_manager_get(m);

        feature_cache_set_produce_timeout(m->features, n->feature_produce_timeout_usec);
        /* The spill queue's bound follows CacheSize= (before the budget: a smaller budget
         * evicts at once, and spills within the new bound). Shrunk, what is queued stays
         * queued: copied already, it is written as before, and evictions are dropped
         * until the queue is back within the bound. */
        if (fm && fm->spiller)
                feature_spiller_set_max_pending(fm->spiller, spill_pending_max(n));
        if (n->feature_cache_bytes != feature_cache_budget(m->features)) {
                feature_cache_set_budget(m->features, n->feature_cache_bytes);
                manager_emit_changed(m, FEATURE_PATH, FEATURE_IFACE, "CacheBytes");
        }
        return 0;
}

static int feature_apply_record(Manager *m, uint16_t type, const void *payload, size_t len) {
        return m->features ? feature_cache_apply_record(m->features, type, payload, len) : 0;
}

static int feature_journal(FeatureCache *c, uint16_t rec, const void *payload, size_t len, void *userdata) {
        Manager *m = userdata;
        /* What is dropped while stopping stays in the WAL for the next start. */
        if (m->stopping)
                return 0;
        int r = wal_manager_append(m, WAL_RECORD_FEATURE + rec, payload, len);
        if (r == -ENOTCONN)
                r = 0;
        if (rec == FEATURE_REC_GONE) {
                /* Its region may be handed out again at once: whoever gets it writes only
                 * after this GONE is durable (feature_manager_region_settled()). Refused,
                 * it never is. */
                FeatureManager *fm = feature_manager_get(m);
                if (fm)
                        fm->gone_lsn = r < 0 ? UINT64_MAX : wal_manager_last_lsn(m);
        }
        return r;
}

/* Replay is done: journal from now on, and forget what was journaled in arenas whose
 * memory did not survive the restart. */
static int feature_restore_finish(Manager *m) {
        if (!m->features)
                return 0;
        feature_cache_set_journal(m->features, feature_journal, m);
        for (size_t i = 0; i < m->n_arenas; i++)
                if (!m->arenas[i]->adopted && feature_cache_drop_arena(m->features, (uint32_t)i) > 0)
                        log_info("Arena %s: journaled features dropped: its memory did not survive (no fd store).",
                                 m->arenas[i]->name);
        return 0;
}

/* core/mappers.h: the restored feature arenas (host memory back from the fd store). */
static void feature_fence(Manager *m, bool on) {
        uint64_t mask = 0;
        char sz[32];

        if (!m->features)
                return;
        if (!on) {
                feature_cache_unfence(m->features);
                return;
        }
        for (size_t i = 0; i < m->n_arenas && i < 64; i++)
                if (m->arenas[i]->adopted && m->arenas[i]->domain == MEMORY_HOST &&
                    m->arenas[i]->usage == ARENA_USAGE_FEATURE)
                        mask |= 1ULL << i;
        int64_t n = feature_cache_fence(m->features, mask);
        if (n < 0)
                log_warning_errno((int)n, "Cannot fence the restored feature arenas (%m): their free bytes are handed "
                                          "out at once.");
        else
                log_info("Feature arenas: %s free at the restart held back, %" PRIu64 " restored feature(s) kept.",
                         format_size(sz, sizeof sz, (uint64_t)n), feature_cache_stats(m->features)->n_features);
}

static int feature_snapshot(Manager *m, SubsystemSnapshotAdd add, void *userdata) {
        return m->features ? feature_cache_snapshot(m->features, add, userdata, WAL_RECORD_FEATURE) : 0;
}

static const SubsystemJournal feature_journal_hooks = {
        .families = (const uint8_t[]){ WAL_RECORD_FEATURE >> 8, 0 },
        .apply_record = feature_apply_record,
        .restore_finish = feature_restore_finish,
        .snapshot = feature_snapshot,
};

const Subsystem feature_subsystem = {
        .name = "features",
        .verify = feature_verify,
        .init = feature_init,
        .done = feature_done,
        .add_bus = bus_feature_add,
        .reload = feature_reload,
        .journal = &feature_journal_hooks,
        .worker_departing = feature_worker_departing,
        .fence = feature_fence,
};
