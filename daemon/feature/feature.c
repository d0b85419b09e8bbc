/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "feature/feature-alloc.h"
#include "feature/feature-internal.h"
#include "feature/feature-store.h"
#include "feature/feature.h"
#include "hashmap.h"
#include "log.h"
#include "macro.h"

static const char *const state_names[_FEATURE_STATE_MAX] = {
        [FEATURE_RESERVED] = "reserved",
        [FEATURE_READY] = "ready",
        [FEATURE_FAILED] = "failed",
        [FEATURE_EVICTED] = "evicted",
};

const char *feature_state_to_string(FeatureState s) {
        if ((unsigned)s >= _FEATURE_STATE_MAX)
                return NULL;
        return state_names[s];
}

bool feature_key_valid(const char *key) {
        if (!key)
                return false;
        size_t n = strnlen(key, FEATURE_KEY_MAX + 1);
        return n > 0 && n <= FEATURE_KEY_MAX;
}

int feature_cache_new(const FeatureCacheConfig *config, FeatureCache **ret) {
        FeatureCache *c = calloc(1, sizeof *c);

        if (!c)
                return -ENOMEM;
        c->config = *config;
        if (c->config.max_features == 0)
                c->config.max_features = FEATURE_CACHE_MAX_FEATURES_DEFAULT;
        if (c->config.max_refs == 0)
                c->config.max_refs = FEATURE_CACHE_MAX_REFS_DEFAULT;
        if (c->config.announce_timeout_usec == 0)
                c->config.announce_timeout_usec = FEATURE_ANNOUNCE_TIMEOUT_DEFAULT;
        if (c->config.max_announced == 0)
                c->config.max_announced = FEATURE_CACHE_MAX_ANNOUNCED_DEFAULT;
        c->features = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!c->features) {
                free(c);
                return -ENOMEM;
        }
        *ret = c;
        return 0;
}

void feature_entry_destroy(Feature *f) {
        feature_desc_free(f->desc);
        free(f->key);
        free(PRIV(f));
}

FeatureCache *feature_cache_free(FeatureCache *c) {
        if (!c)
                return NULL;
        /* Entries still in the table; FAILED/EVICTED ones left belong to references,
         * which the clients released before (client_free runs first at shutdown). */
        size_t it = 0;
        void *v;
        Feature **all = calloc(hashmap_size(c->features) + 1, sizeof(Feature *));
        size_t n = 0;
        while (hashmap_iterate(c->features, &it, &v, NULL))
                if (all)
                        all[n++] = v;
        hashmap_free(c->features);
        for (size_t i = 0; i < n; i++)
                feature_entry_destroy(all[i]);
        free(all);
        for (size_t i = 0; i < c->n_arenas; i++) {
                feature_allocator_free(c->arenas[i].alloc);
                free(c->arenas[i].fence_offsets);
        }
        free(c->arenas);
        feature_replay_skipped_free(c);
        free(c);
        return NULL;
}

void feature_cache_set_callback(FeatureCache *c, feature_state_cb cb, void *userdata) {
        c->cb = cb;
        c->userdata = userdata;
}

void *feature_cache_get_userdata(const FeatureCache *c) {
        return c->userdata;
}

int feature_cache_add_arena(FeatureCache *c, uint32_t index, void *base, uint64_t data_offset,
                            uint64_t data_size, uint64_t chunk) {
        FeatureAllocator *a;
        CacheArena *n;
        int r;

        for (size_t i = 0; i < c->n_arenas; i++)
                if (c->arenas[i].index == index)
                        return -EEXIST;
        r = feature_allocator_new(data_offset, data_size, chunk, &a);
        if (r < 0)
                return r;
        n = reallocarray(c->arenas, c->n_arenas + 1, sizeof(CacheArena));
        if (!n) {
                feature_allocator_free(a);
                return -ENOMEM;
        }
        c->arenas = n;
        c->arenas[c->n_arenas++] = (CacheArena){ .index = index, .base = base, .alloc = a };
        return 0;
}

void feature_cache_set_store(FeatureCache *c, FeatureStore *s) {
        c->store = s;
}

void feature_cache_set_spill(FeatureCache *c, feature_spill_fn fn, void *userdata) {
        c->spill_fn = fn;
        c->spill_userdata = userdata;
}

void feature_cache_set_loader(FeatureCache *c, feature_load_fn fn, void *userdata) {
        c->load_fn = fn;
        c->load_userdata = userdata;
}

void feature_cache_set_prober(FeatureCache *c, feature_probe_fn fn, void *userdata) {
        c->probe_fn = fn;
        c->probe_userdata = userdata;
}

bool feature_loading(const Feature *f) {
        return f && PRIV(f)->loading;
}

bool feature_lookup_failed(const Feature *f) {
        return f && f->state == FEATURE_FAILED && PRIV(f)->lookup_failed;
}

const FeatureStats *feature_cache_stats(FeatureCache *c) {
        return &c->stats;
}

void feature_cache_count_read_back_timeout(FeatureCache *c) {
        c->stats.read_back_timeouts++;
}

uint64_t feature_cache_budget(const FeatureCache *c) {
        return c->config.budget_bytes;
}

Feature *feature_cache_get(FeatureCache *c, const char *key) {
        if (!feature_key_valid(key))
                return NULL;
        return hashmap_get(c->features, key);
}

CacheArena *feature_arena_of(const FeatureCache *c, uint32_t index) {
        for (size_t i = 0; i < c->n_arenas; i++)
                if (c->arenas[i].index == index)
                        return &c->arenas[i];
        return NULL;
}

void *feature_data(const Feature *f) {
        CacheArena *a;

        if (!f || !f->has_region)
                return NULL;
        a = feature_arena_of(f->cache, f->arena);
        if (!a || !a->base)
                return NULL;
        return a->base + f->offset;
}

/* Table and queues. */

int feature_entry_new(FeatureCache *c, const char *key, Feature **ret) {
        FeaturePriv *p = calloc(1, sizeof *p);
        int r;

        if (!p)
                return -ENOMEM;
        p->pub.cache = c;
        p->pub.state = FEATURE_RESERVED;
        p->pub.producer_uid = UINT32_MAX;
        p->pub.key = strdup(key);
        if (!p->pub.key) {
                free(p);
                return -ENOMEM;
        }
        r = hashmap_put(c->features, p->pub.key, &p->pub);
        if (r < 0) {
                free(p->pub.key);
                free(p);
                return r;
        }
        p->in_table = true;
        c->stats.n_features++;
        *ret = &p->pub;
        return 0;
}

static void producing_remove(FeatureCache *c, Feature *f) {
        if (!f->in_producing)
                return;
        QUEUE_REMOVE(producing, c->producing, f);
        f->in_producing = false;
}

void feature_producing_start(FeatureCache *c, Feature *f, usec_t now) {
        if (!c || !f || c->config.produce_timeout_usec == 0 || f->state != FEATURE_RESERVED || !f->producer)
                return;
        producing_remove(c, f);
        f->produce_deadline = usec_add(now, c->config.produce_timeout_usec);
        /* In deadline order: nearly always at the back (one timeout), but a reload that
         * lowered it puts new claims before older ones. */
        Feature *after = c->producing.last;
        while (after && after->produce_deadline > f->produce_deadline)
                after = after->producing_prev;
        QUEUE_INSERT_AFTER(producing, c->producing, after, f);
        f->in_producing = true;
}

void feature_cache_set_produce_timeout(FeatureCache *c, usec_t timeout) {
        if (c)
                c->config.produce_timeout_usec = timeout;
}

/* The cold list, and its arena's (with the bytes each could free by evicting). */
static void lru_push(FeatureCache *c, Feature *f) {
        CacheArena *a = f->has_region ? feature_arena_of(c, f->arena) : NULL;

        QUEUE_PUSH_BACK(lru, c->lru, f);
        f->in_lru = true;
        f->lru_seq = c->lru_seq++;
        f->lru_bytes = f->size;
        c->evictable += f->size;
        f->lru_arena = a ? (size_t)(a - c->arenas) + 1 : 0;
        if (a) {
                QUEUE_PUSH_BACK(arena_lru, a->arena_lru, f);
                a->evictable += f->size;
        }
}

static void lru_remove(FeatureCache *c, Feature *f) {
        if (!f->in_lru)
                return;
        QUEUE_REMOVE(lru, c->lru, f);
        f->in_lru = false;
        c->evictable -= f->lru_bytes;
        if (f->lru_arena > 0) {
                CacheArena *a = &c->arenas[f->lru_arena - 1];
                QUEUE_REMOVE(arena_lru, a->arena_lru, f);
                a->evictable -= f->lru_bytes;
                f->lru_arena = 0;
        }
}

void feature_entry_unlink(FeatureCache *c, Feature *f) {
        producing_remove(c, f);
        if (PRIV(f)->in_table) {
                hashmap_remove(c->features, f->key);
                PRIV(f)->in_table = false;
                c->stats.n_features--;
        }
        lru_remove(c, f);
        if (f->in_announced) {
                QUEUE_REMOVE(announced, c->announced, f);
                f->in_announced = false;
                c->stats.n_announced--;
        }
}

void feature_region_release(FeatureCache *c, Feature *f) {
        CacheArena *a;

        if (!f->has_region)
                return;
        if (f->state == FEATURE_READY)
                feature_journal_gone(c, f);
        a = feature_arena_of(c, f->arena);
        if (a)
                (void)feature_allocator_release(a->alloc, f->offset);
        if (f->state == FEATURE_READY)
                c->stats.bytes_cached -= f->size;
        else
                c->stats.bytes_reserved -= f->size;
        f->has_region = false;
}

/* Frees a feature that left the table once nothing refers to it any more. */
void feature_entry_maybe_destroy(Feature *f) {
        if (PRIV(f)->in_table || f->n_readers > 0 || f->n_pins > 0 || f->producer)
                return;
        feature_entry_destroy(f);
}

void feature_lru_update(FeatureCache *c, Feature *f) {
        bool want = f->state == FEATURE_READY && f->n_readers == 0 && f->n_pins == 0 && !PRIV(f)->fenced;

        if (want && !f->in_lru)
                lru_push(c, f);
        else if (!want && f->in_lru)
                lru_remove(c, f);
}

static void lru_touch(FeatureCache *c, Feature *f) {
        if (!f->in_lru)
                return;
        lru_remove(c, f);
        lru_push(c, f);
}

static void spill(FeatureCache *c, Feature *f) {
        const void *data;
        int r;

        if (!c->store || PRIV(f)->on_disk || !f->desc)
                return;
        data = feature_data(f);
        if (!data)
                return;
        if (c->spill_fn) {
                r = c->spill_fn(c, f, data, c->spill_userdata);
                if (r >= 0)
                        c->stats.spilled++;
                return;
        }
        r = feature_store_save(c->store,
                               &(FeatureStoreRecord){ .key = f->key,
                                                      .size = f->bytes,
                                                      .desc = f->desc,
                                                      .request_id = f->request_id,
                                                      .encode_usec = f->encode_usec },
                               data);
        if (r < 0) {
                log_debug_errno(r, "Failed to spill feature to the store, dropping it: %m");
                return;
        }
        PRIV(f)->on_disk = true;
        c->stats.spilled++;
}

/* Evicts an unreferenced READY feature (the cold end of the LRU). */
static void evict(FeatureCache *c, Feature *f) {
        spill(c, f);
        feature_region_release(c, f);
        f->state = FEATURE_EVICTED;
        feature_entry_unlink(c, f);
        c->stats.evictions++;
        feature_entry_maybe_destroy(f);
}

static bool evict_one(FeatureCache *c) {
        if (!c->lru.first)
                return false;
        evict(c, c->lru.first);
        return true;
}

static void enforce_budget(FeatureCache *c) {
        while (c->stats.bytes_cached + c->stats.bytes_reserved > c->config.budget_bytes &&
               evict_one(c))
                ;
}

void feature_cache_set_budget(FeatureCache *c, uint64_t budget_bytes) {
        c->config.budget_bytes = budget_bytes;
        enforce_budget(c);
}

uint64_t feature_cache_flush(FeatureCache *c) {
        uint64_t n = 0;
        while (evict_one(c))
                n++;
        return n;
}

/* EncoderTimeSavedUSec: n hits of f, each worth its encode time. Saturating: that time
 * is the producer's word (the bus glue bounds it) or a stored file's. */
static void count_saved(FeatureCache *c, const Feature *f, uint64_t n) {
        uint64_t add;
        if (MUL_OVERFLOW(n, f->encode_usec, &add))
                add = UINT64_MAX;
        c->stats.encoder_usec_saved = usec_add(c->stats.encoder_usec_saved, add);
}

static void notify(FeatureCache *c, Feature *f) {
        if (c->cb)
                c->cb(c, f, c->userdata);
}

/* RESERVED → FAILED: the region goes back, the key leaves the table (so the next
 * Acquire starts over), waiters are told. */
static void set_failed(FeatureCache *c, Feature *f, int error) {
        producing_remove(c, f);
        if (!PRIV(f)->region_holder)
                feature_region_release(c, f);
        f->state = FEATURE_FAILED;
        f->error = error < 0 ? error : -EIO;
        feature_entry_unlink(c, f);
        if (f->producer) {
                /* the producer stays, as a reader of the failed feature */
                f->producer->kind = FEATURE_REF_READER;
                f->producer = NULL;
                f->n_readers++;
        }
        if (!PRIV(f)->lookup_failed)
                c->stats.failed++; /* a stored copy found unusable is a miss, not a failure */
        notify(c, f);
        feature_entry_maybe_destroy(f);
}

static bool arena_allowed(const CacheArena *a, bool need_map, uint64_t mask) {
        if (need_map && !a->base)
                return false;
        return a->index >= 64 || (mask & (1ULL << a->index));
}

/* What a region of bytes takes in arena a: whole chunks of its allocator. */
static uint64_t arena_need(const CacheArena *a, uint64_t bytes) {
        uint64_t chunk = feature_allocator_chunk(a->alloc);
        return chunk > 1 && bytes <= UINT64_MAX - chunk ? ALIGN_TO(bytes, chunk) : bytes;
}

/* An arena that a region of bytes may go to: allowed, and large enough, within the
 * budget, its chunk rounding included. */
static bool arena_fits(const FeatureCache *c, const CacheArena *a, uint64_t bytes, bool need_map, uint64_t mask) {
        uint64_t need = arena_need(a, bytes);
        return arena_allowed(a, need_map, mask) && feature_allocator_total(a->alloc) >= need &&
               need <= c->config.budget_bytes;
}

/* Whether evicting every unreferenced feature could make room at all: in some arena
 * that fits, with the budget and that arena's free chunks plus its evictable ones
 * enough for the region as that arena rounds it (a fragmented arena may still refuse).
 * Marks those arenas (helps). A request that this says no to evicts nothing. */
static bool eviction_could_help(FeatureCache *c, uint64_t bytes, bool need_map, uint64_t mask) {
        bool any = false;

        /* The counts are kept as features come and go: no walk of the cold list for
         * each Reserve that has to evict. */
        uint64_t held = c->stats.bytes_cached + c->stats.bytes_reserved - c->evictable;
        for (size_t i = 0; i < c->n_arenas; i++) {
                CacheArena *a = &c->arenas[i];
                uint64_t need = arena_need(a, bytes);
                a->helps = arena_fits(c, a, bytes, need_map, mask) && held + need <= c->config.budget_bytes &&
                           feature_allocator_total(a->alloc) - feature_allocator_used(a->alloc) + a->evictable >=
                                   need;
                any = any || a->helps;
        }
        return any;
}

/* The coldest unreferenced feature in an arena where evicting can make the region
 * (eviction_could_help() marked them): one elsewhere would go for nothing. */
static Feature *coldest_in(FeatureCache *c) {
        Feature *best = NULL;

        /* Each arena's coldest, the coldest of those: not a walk past every feature of
         * the arenas that cannot help, for each eviction. */
        for (size_t i = 0; i < c->n_arenas; i++) {
                Feature *f = c->arenas[i].arena_lru.first;
                if (c->arenas[i].helps && f && (!best || f->lru_seq < best->lru_seq))
                        best = f;
        }
        return best;
}

/* Allocates a region of bytes in some arena (mapped ones only, if need_map; of those,
 * the ones in mask). Unless may_evict is false, it evicts from the cold end: while no
 * allowed arena has a run long enough, the coldest feature of an allowed arena (one
 * elsewhere would not help, and a refused request must not empty other arenas); once
 * a run is there but the budget is short, the coldest feature of any arena. Nothing is
 * evicted for a request that could not be met by evicting everything. */
static int region_alloc(FeatureCache *c, uint64_t bytes, bool need_map, uint64_t mask, bool may_evict,
                        uint32_t *ret_arena, uint64_t *ret_offset, uint64_t *ret_size) {
        bool any = false, checked = false;

        if (bytes == 0)
                return -EINVAL;
        if (c->n_arenas == 0)
                return -ENODEV;
        for (size_t i = 0; i < c->n_arenas; i++)
                if (arena_fits(c, &c->arenas[i], bytes, need_map, mask))
                        any = true;
        if (!any)
                return -E2BIG;

        for (;;) {
                bool have_run = false;
                Feature *victim;

                for (size_t i = 0; i < c->n_arenas; i++) {
                        CacheArena *a = &c->arenas[i];
                        uint64_t off, size;

                        if (!arena_fits(c, a, bytes, need_map, mask))
                                continue;
                        if (feature_allocator_alloc(a->alloc, bytes, &off, &size) < 0)
                                continue;
                        if (c->stats.bytes_cached + c->stats.bytes_reserved + size >
                            c->config.budget_bytes) {
                                /* a run, but over the budget (chunk rounding included) */
                                (void)feature_allocator_release(a->alloc, off);
                                have_run = true;
                                continue;
                        }
                        *ret_arena = a->index;
                        *ret_offset = off;
                        *ret_size = size;
                        return 0;
                }
                if (!may_evict)
                        return -ENOSPC;
                if (!checked) {
                        if (!eviction_could_help(c, bytes, need_map, mask))
                                return -ENOSPC;
                        checked = true;
                }
                victim = have_run ? c->lru.first : coldest_in(c);
                if (!victim)
                        return -ENOSPC;
                evict(c, victim);
        }
}

/* f (RESERVED, no region) takes the region allocated for `bytes` (counted reserved). */
static void region_set(FeatureCache *c, Feature *f, uint32_t arena, uint64_t off, uint64_t size, uint64_t bytes) {
        f->has_region = true;
        f->arena = arena;
        f->offset = off;
        f->size = size;
        f->bytes = bytes;
        c->stats.bytes_reserved += size;
}

/* Gives f (RESERVED, no region) a region and its descriptor. Changes nothing on
 * failure. */
static int region_attach(FeatureCache *c, Feature *f, uint64_t bytes, uint64_t mask,
                         FeatureDesc **desc, const EpdId *request_id, FeatureDescIssue *issue) {
        uint64_t off, size;
        uint32_t arena;
        int r;

        if (!desc || !*desc)
                return -EINVAL;
        r = feature_desc_validate(*desc, bytes, issue);
        if (r < 0)
                return r;
        r = region_alloc(c, bytes, false, mask, true, &arena, &off, &size);
        if (r < 0)
                return r;
        region_set(c, f, arena, off, size, bytes);
        f->desc = TAKE_PTR(*desc);
        if (request_id)
                f->request_id = *request_id;
        return 0;
}

/* Makes room for one more feature, evicting the coldest unless may_evict is false. */
static int make_slot(FeatureCache *c, bool may_evict) {
        while (c->stats.n_features >= c->config.max_features)
                if (!may_evict || !evict_one(c))
                        return -ENOSPC;
        return 0;
}

static FeatureRef *ref_new(FeatureCache *c) {
        if (c->stats.n_refs >= c->config.max_refs)
                return NULL;
        return calloc(1, sizeof(FeatureRef));
}

static void ref_link(FeatureCache *c, FeatureRef *r, Feature *f, FeatureRefKind kind) {
        r->feature = f;
        r->kind = kind;
        switch (kind) {
        case FEATURE_REF_READER:
                f->n_readers++;
                break;
        case FEATURE_REF_PRODUCER:
                f->producer = r;
                break;
        case FEATURE_REF_PIN:
                f->n_pins++;
                break;
        }
        c->stats.n_refs++;
        feature_lru_update(c, f);
}

static void load_finish(FeatureCache *c, Feature *f) {
        c->stats.bytes_reserved -= f->size;
        c->stats.bytes_cached += f->size;
        f->state = FEATURE_READY;
        PRIV(f)->on_disk = true;
        c->stats.loaded++;
        (void)feature_journal_ready(c, f); /* in the store: a restart without its record loads it again */
        feature_lru_update(c, f);
}

/* A new RESERVED feature for key with a region of `bytes` (mapped). */
static int load_new(FeatureCache *c, const char *key, uint64_t bytes, bool may_evict, Feature **ret) {
        uint64_t off, size;
        uint32_t arena;
        Feature *f;
        int r = make_slot(c, may_evict);
        if (r < 0)
                return r;
        r = region_alloc(c, bytes, true, UINT64_MAX, may_evict, &arena, &off, &size);
        if (r < 0)
                return r;
        r = feature_entry_new(c, key, &f);
        if (r < 0) {
                (void)feature_allocator_release(feature_arena_of(c, arena)->alloc, off);
                return r;
        }
        region_set(c, f, arena, off, size, bytes);
        *ret = f;
        return 0;
}

/* Undoes load_new(): nobody has seen f. */
static void load_drop(FeatureCache *c, Feature *f) {
        feature_region_release(c, f);
        feature_entry_unlink(c, f);
        feature_entry_destroy(f);
}

/* f takes what the stored entry e says (its data fits f's region). */
static int load_describe(Feature *f, FeatureStoreEntry *e) {
        if (e->size > f->size)
                return -EBADMSG; /* not the size the store's index had for it */
        f->bytes = e->size;
        f->desc = TAKE_PTR(e->desc);
        f->request_id = e->request_id;
        f->encode_usec = e->encode_usec;
        return 0;
}

/* With a prober, the lookup itself (open, header, key, descriptor) goes off the loop
 * too: f is made RESERVED and loading at once, with a region of the size the store's
 * index gives (so that no room is said now, as without a prober), and
 * feature_probe_done() goes on. */
static int load_begin(FeatureCache *c, const char *key, uint64_t bytes, bool may_evict, Feature **ret) {
        Feature *f;
        int r = load_new(c, key, bytes, may_evict, &f);
        if (r < 0)
                return r;
        PRIV(f)->loading = PRIV(f)->probing = true;
        r = c->probe_fn(c, f, c->probe_userdata);
        if (r < 0) {
                load_drop(c, f);
                return r;
        }
        *ret = f;
        return 1;
}

/* A region reserved from a bound on its data's size (the store's index after a scan)
 * gives back the chunks the data turned out not to need: freed and taken again at the
 * same offset, shorter (nobody has seen it yet). */
static void region_fit(FeatureCache *c, Feature *f) {
        CacheArena *a = feature_arena_of(c, f->arena);
        uint64_t size;

        if (!a || !f->has_region || f->bytes == 0 ||
            ALIGN_TO(f->bytes, feature_allocator_chunk(a->alloc)) >= f->size)
                return;
        if (feature_allocator_release(a->alloc, f->offset) < 0)
                return;
        if (feature_allocator_alloc_at(a->alloc, f->offset, f->bytes, &size) < 0 &&
            feature_allocator_alloc_at(a->alloc, f->offset, f->size, &size) < 0) {
                /* Cannot be: the chunks were its own a moment ago, and the loop's alone. */
                log_error("Feature %.64s: cannot take its region back after shrinking it.", f->key);
                f->has_region = false;
                c->stats.bytes_reserved -= f->size;
                f->size = 0;
                return;
        }
        c->stats.bytes_reserved -= f->size - size;
        f->size = size;
}

void feature_probe_done(Feature *f, int error, FeatureStoreEntry *e) {
        FeatureCache *c;
        int r = error;

        if (!f || !PRIV(f)->probing) {
                feature_store_entry_done(e);
                return;
        }
        c = f->cache;
        PRIV(f)->probing = false;
        if (r >= 0) {
                /* Larger than the index said (a save's new copy in between): the index
                 * has its size now, so the Acquires asked again read it back. */
                r = load_describe(f, e);
                if (r >= 0) {
                        region_fit(c, f);
                        r = f->has_region ? c->load_fn(c, f, TAKE_FD(e->fd), feature_data(f), f->bytes, e->crc,
                                                       c->load_userdata) : -ENOMEM;
                        if (r < 0) {
                                log_warning_errno(r, "Feature %.64s: cannot read its stored copy back now, a miss: %m",
                                                  f->key);
                                feature_store_forget(c->store, f->key);
                        }
                }
        } else if (r != -ENOENT && r != -EBADMSG)
                /* Out of file descriptors or memory: not tried again (the lookup keeps the
                 * name for such errors), so that the Acquires asked again are misses, not
                 * this lookup once more. Gone, damaged or another key's: the lookup
                 * dropped the name itself, unless a save has just put a new copy there. */
                feature_store_forget(c->store, f->key);
        feature_store_entry_done(e);
        /* FAILED, its waiters told: the Acquires are asked again, misses (or read-backs
         * of the copy a save has put there). */
        PRIV(f)->lookup_failed = r < 0;
        if (r < 0)
                feature_load_done(f, r);
}

/* Reads key back from the store into a mapped arena: -ENOENT at once when the
 * store's index has no copy of it. Synchronously without a loader (0: READY); with
 * one, the feature stays RESERVED while the loader reads its data off the loop (1:
 * feature_load_done() follows). With a prober as well, the header, key and descriptor
 * are read off the loop too (1: feature_probe_done(), then feature_load_done()); a
 * copy that then turns out unusable FAILS the feature with feature_lookup_failed()
 * (its Acquires are asked again: misses), instead of being this call's error. Without
 * may_evict (Prefetch) only free space is used: -ENOSPC rather than an eviction. */
static int load(FeatureCache *c, const char *key, bool may_evict, Feature **ret) {
        _cleanup_(feature_store_entry_done) FeatureStoreEntry e = { .fd = -EBADF };
        Feature *f;
        int r;

        /* Most misses: the store's index knows it has no copy, no system call made. */
        uint64_t bound;
        if (!c->store || !feature_store_has(c->store, key, &bound))
                return -ENOENT;
        if (c->probe_fn && c->load_fn && bound != UINT64_MAX)
                return load_begin(c, key, bound, may_evict, ret);
        r = feature_store_lookup(c->store, key, &e);
        if (r < 0)
                return r;
        r = load_new(c, key, e.size, may_evict, &f);
        if (r < 0)
                return r;
        (void)load_describe(f, &e);
        if (c->load_fn) {
                r = c->load_fn(c, f, TAKE_FD(e.fd), feature_data(f), e.size, e.crc, c->load_userdata);
                if (r >= 0) {
                        PRIV(f)->loading = true;
                        *ret = f;
                        return 1;
                }
        } else
                r = feature_store_entry_read(&e, feature_data(f));
        if (r < 0) {
                load_drop(c, f);
                return r;
        }
        load_finish(c, f);
        *ret = f;
        return 0;
}

void feature_load_done(Feature *f, int error) {
        FeatureCache *c;

        if (!f || !PRIV(f)->loading)
                return;
        c = f->cache;
        PRIV(f)->loading = false;
        /* The state callback answers the waiting Acquires and may drop their references,
         * the last one too: held here until it returns (and out of the LRU meanwhile). */
        f->n_pins++;
        /* Its readers' Acquires are hits once the bytes are back; a failed read saved nothing. */
        c->stats.hits += error >= 0 ? PRIV(f)->load_readers : 0;
        count_saved(c, f, error >= 0 ? PRIV(f)->load_readers : 0);
        PRIV(f)->load_readers = 0;
        c->stats.prefetch_hits += error >= 0 && PRIV(f)->load_prefetched;
        PRIV(f)->load_prefetched = false;
        if (error < 0)
                set_failed(c, f, error);
        else {
                load_finish(c, f);
                notify(c, f);
        }
        f->n_pins--;
        if (f->state == FEATURE_READY) {
                feature_lru_update(c, f);
                enforce_budget(c);
        } else
                feature_entry_maybe_destroy(f);
}

/* A new reference for a call on key, and the key's feature if there is one. */
static int ref_for_key(FeatureCache *c, const char *key, FeatureRef **ret, Feature **ret_feature) {
        if (!feature_key_valid(key))
                return -EINVAL;
        *ret = ref_new(c);
        if (!*ret)
                return c->stats.n_refs >= c->config.max_refs ? -EUSERS : -ENOMEM;
        *ret_feature = hashmap_get(c->features, key);
        return 0;
}

int feature_acquire(FeatureCache *c, const char *key, bool may_produce, usec_t now,
                    FeatureRef **ret, FeatureAcquireResult *result) {
        _cleanup_(freep) FeatureRef *r = NULL;
        Feature *f;
        int k = ref_for_key(c, key, &r, &f);
        if (k < 0)
                return k;
        if (f && f->state == FEATURE_READY) {
                c->stats.hits++;
                count_saved(c, f, 1);
                ref_link(c, r, f, FEATURE_REF_READER);
                *result = FEATURE_ACQUIRE_HIT;
        } else if (f && PRIV(f)->loading) {
                PRIV(f)->load_readers++; /* a hit once the read lands */
                ref_link(c, r, f, FEATURE_REF_READER);
                *result = FEATURE_ACQUIRE_LOADING;
        } else if (f && (f->producer || !may_produce)) {
                c->stats.coalesced_waits++;
                ref_link(c, r, f, FEATURE_REF_READER);
                *result = FEATURE_ACQUIRE_WAIT;
        } else if (f) {
                /* announced, nobody producing yet: the caller does */
                c->stats.misses++;
                if (f->in_announced) {
                        QUEUE_REMOVE(announced, c->announced, f);
                        f->in_announced = false;
                        c->stats.n_announced--;
                }
                ref_link(c, r, f, FEATURE_REF_PRODUCER);
                feature_producing_start(c, f, now);
                *result = FEATURE_ACQUIRE_PRODUCE;
        } else if ((k = load(c, key, true, &f)) >= 0) {
                PRIV(f)->load_readers += k > 0; /* read off the loop: a hit once it lands */
                c->stats.hits += k == 0;
                count_saved(c, f, k == 0);
                ref_link(c, r, f, FEATURE_REF_READER);
                *result = k > 0 ? FEATURE_ACQUIRE_LOADING : FEATURE_ACQUIRE_HIT;
        } else {
                c->stats.misses++;
                /* A corrupt stored copy is said, and one there is no room to read back
                 * now (NoSpace: not absent, which a worker that cannot encode would take
                 * for good). One larger than every arena never fits: a miss. */
                if (!may_produce)
                        return k == -EBADMSG || k == -ENOSPC ? k : -ENOENT;
                k = make_slot(c, true);
                if (k < 0)
                        return k;
                k = feature_entry_new(c, key, &f);
                if (k < 0)
                        return k;
                ref_link(c, r, f, FEATURE_REF_PRODUCER);
                feature_producing_start(c, f, now);
                *result = FEATURE_ACQUIRE_PRODUCE;
        }
        *ret = TAKE_PTR(r);
        return 0;
}

int feature_reserve(FeatureCache *c, const char *key, uint64_t bytes, FeatureDesc **desc,
                    const EpdId *request_id, FeatureRef **ret, FeatureDescIssue *issue) {
        return feature_reserve_in(c, key, bytes, UINT64_MAX, desc, request_id, ret, issue);
}

int feature_reserve_in(FeatureCache *c, const char *key, uint64_t bytes, uint64_t arena_mask,
                       FeatureDesc **desc, const EpdId *request_id, FeatureRef **ret,
                       FeatureDescIssue *issue) {
        _cleanup_(freep) FeatureRef *r = NULL;
        Feature *f;
        int k = ref_for_key(c, key, &r, &f);
        if (k < 0)
                return k;
        if (f && f->state == FEATURE_READY)
                return -EEXIST;
        if (f && (f->producer || PRIV(f)->loading))
                return -EBUSY;
        if (f) {
                /* announced: claim it */
                k = region_attach(c, f, bytes, arena_mask, desc, request_id, issue);
                if (k < 0)
                        return k;
                if (f->in_announced) {
                        QUEUE_REMOVE(announced, c->announced, f);
                        f->in_announced = false;
                        c->stats.n_announced--;
                }
        } else {
                /* Validate before evicting anything for it. */
                if (!desc || !*desc)
                        return -EINVAL;
                k = feature_desc_validate(*desc, bytes, issue);
                if (k < 0)
                        return k;
                k = make_slot(c, true);
                if (k < 0)
                        return k;
                k = feature_entry_new(c, key, &f);
                if (k < 0)
                        return k;
                k = region_attach(c, f, bytes, arena_mask, desc, request_id, issue);
                if (k < 0) {
                        feature_entry_unlink(c, f);
                        feature_entry_destroy(f);
                        return k;
                }
        }
        ref_link(c, r, f, FEATURE_REF_PRODUCER);
        *ret = TAKE_PTR(r);
        return 0;
}

int feature_ref_reserve(FeatureRef *r, uint64_t bytes, FeatureDesc **desc,
                        const EpdId *request_id, FeatureDescIssue *issue) {
        return feature_ref_reserve_in(r, bytes, UINT64_MAX, desc, request_id, issue);
}

int feature_ref_reserve_in(FeatureRef *r, uint64_t bytes, uint64_t arena_mask, FeatureDesc **desc,
                           const EpdId *request_id, FeatureDescIssue *issue) {
        Feature *f = r ? r->feature : NULL;

        if (!f || r->kind != FEATURE_REF_PRODUCER || f->state != FEATURE_RESERVED)
                return -EBADSLT;
        if (f->has_region)
                return -EALREADY;
        return region_attach(f->cache, f, bytes, arena_mask, desc, request_id, issue);
}

int feature_publish(FeatureRef *r, usec_t encode_usec) {
        Feature *f = r ? r->feature : NULL;
        FeatureCache *c;

        if (!f || r->kind != FEATURE_REF_PRODUCER || f->state != FEATURE_RESERVED ||
            !f->has_region)
                return -EBADSLT;
        c = f->cache;
        /* Journaled first: a Publish whose record the log did not take is refused (the
         * feature stays reserved, its producer may fail it or retry), never acknowledged
         * as durable with nothing in the log. */
        usec_t was = f->encode_usec;
        f->encode_usec = encode_usec;
        f->state = FEATURE_READY; /* what the record says */
        int e = feature_journal_ready(c, f);
        if (e < 0) {
                f->state = FEATURE_RESERVED;
                f->encode_usec = was;
                return e == -EBADSLT ? -EIO : e;
        }
        c->stats.bytes_reserved -= f->size;
        c->stats.bytes_cached += f->size;
        producing_remove(c, f);
        f->producer = NULL;
        r->kind = FEATURE_REF_READER;
        f->n_readers++;
        c->stats.produced++;
        notify(c, f);
        feature_lru_update(c, f);
        return 0;
}

int feature_fail(FeatureRef *r, int error) {
        Feature *f = r ? r->feature : NULL;

        if (!f || r->kind != FEATURE_REF_PRODUCER || f->state != FEATURE_RESERVED)
                return -EBADSLT;
        set_failed(f->cache, f, error);
        return 0;
}

int feature_fail_holding_region(FeatureRef *r, int error, FeatureHeldRegion *ret_held) {
        Feature *f = r ? r->feature : NULL;

        *ret_held = (FeatureHeldRegion){};
        if (!f || r->kind != FEATURE_REF_PRODUCER || f->state != FEATURE_RESERVED)
                return -EBADSLT;
        if (f->has_region) {
                /* Out of the feature, still allocated and counted as reserved. */
                *ret_held = (FeatureHeldRegion){ .arena = f->arena, .offset = f->offset, .size = f->size };
                f->has_region = false;
        }
        set_failed(f->cache, f, error);
        return 0;
}

void feature_cache_region_free(FeatureCache *c, const FeatureHeldRegion *held) {
        if (!c || !held || held->size == 0)
                return;
        CacheArena *a = feature_arena_of(c, held->arena);
        if (a)
                (void)feature_allocator_release(a->alloc, held->offset);
        c->stats.bytes_reserved -= MIN(c->stats.bytes_reserved, held->size);
}

int feature_pin(FeatureCache *c, const char *key, FeatureRef **ret) {
        FeatureRef *r;
        Feature *f;

        if (!feature_key_valid(key))
                return -EINVAL;
        f = hashmap_get(c->features, key);
        if (!f)
                return -ENOENT;
        r = ref_new(c);
        if (!r)
                return c->stats.n_refs >= c->config.max_refs ? -EUSERS : -ENOMEM;
        ref_link(c, r, f, FEATURE_REF_PIN);
        *ret = r;
        return 0;
}

FeatureRef *feature_ref_release(FeatureRef *r) {
        FeatureRefKind kind;
        FeatureCache *c;
        Feature *f;

        if (!r)
                return NULL;
        f = r->feature;
        c = f->cache;
        kind = r->kind;
        switch (kind) {
        case FEATURE_REF_PRODUCER:
                f->producer = NULL;
                break;
        case FEATURE_REF_READER:
                f->n_readers--;
                /* Its Acquire, answered when the read lands, never will be: not a hit
                 * (its caller gone, or refused past ReadBackTimeout=). */
                if (PRIV(f)->loading && PRIV(f)->load_readers > 0)
                        PRIV(f)->load_readers--;
                break;
        case FEATURE_REF_PIN:
                f->n_pins--;
                break;
        }
        c->stats.n_refs--;
        if (PRIV(f)->region_holder == r) {
                /* The producer that timed out let go (its handle released, or its
                 * client freed once its process exited). Its region is free at once,
                 * whoever still holds the failed feature: only that producer could
                 * write there, nobody reads it (never READY), and no READY record was
                 * journaled, so no GONE must be durable first. */
                PRIV(f)->region_holder = NULL;
                feature_region_release(c, f);
        }
        free(r);

        if (f->state == FEATURE_RESERVED && kind == FEATURE_REF_PRODUCER)
                set_failed(c, f, -EPIPE); /* the producer went away before publishing */
        else if (f->state == FEATURE_READY) {
                feature_lru_update(c, f);
                enforce_budget(c);
        } else
                feature_entry_maybe_destroy(f);
        return NULL;
}

FeatureRef *feature_ref_unclaim(FeatureRef *r) {
        if (!r)
                return NULL;
        Feature *f = r->feature;
        FeatureCache *c = f->cache;
        if (r->kind != FEATURE_REF_PRODUCER || f->state != FEATURE_RESERVED)
                return feature_ref_release(r);
        /* Its caller is not told to produce: its Acquire is no miss (the claim counted
         * one; all in one dispatch of the daemon's loop, so nobody sees it come and go). */
        c->stats.misses -= MIN(c->stats.misses, (uint64_t)1);
        bool fresh = f->deadline == 0, alone = f->n_readers == 0 && f->n_pins == 0;
        if ((!fresh && f->has_region) || (fresh && !alone))
                return feature_ref_release(r); /* its holders hear that it failed */
        producing_remove(c, f);
        f->producer = NULL;
        c->stats.n_refs--;
        free(r);
        if (fresh) {
                /* Made by this claim, and nobody else has seen it: gone as if never made,
                 * as a refused Reserve's (no failure counted, nobody to tell). */
                feature_region_release(c, f);
                feature_entry_unlink(c, f);
                feature_entry_destroy(f);
                return NULL;
        }
        /* Back among the announced, in deadline order (feature_cache_expire() fails it
         * when that passes, as if nobody had claimed it). */
        Feature *before = c->announced.first;
        while (before && before->deadline <= f->deadline)
                before = before->announced_next;
        if (!before)
                QUEUE_PUSH_BACK(announced, c->announced, f);
        else {
                f->announced_next = before;
                f->announced_prev = before->announced_prev;
                if (before->announced_prev)
                        before->announced_prev->announced_next = f;
                else
                        c->announced.first = f;
                before->announced_prev = f;
        }
        f->in_announced = true;
        c->stats.n_announced++;
        return NULL;
}

int feature_prefetch(FeatureCache *c, const char *key, usec_t now, FeaturePrefetchResult *ret) {
        Feature *f;
        int r;

        if (!feature_key_valid(key))
                return -EINVAL;
        c->stats.prefetch_requests++;
        f = hashmap_get(c->features, key);
        if (f && f->state == FEATURE_READY) {
                lru_touch(c, f);
                c->stats.prefetch_hits++;
                *ret = FEATURE_PREFETCH_PRESENT;
                return 0;
        }
        if (f) {
                *ret = FEATURE_PREFETCH_PENDING;
                return 0;
        }
        /* A Prefetch never evicts: a stored key without free room for it is no-space
         * (an Acquire loads it then), not announced for an encoder to redo; so is one
         * that no mapped arena can hold (-E2BIG). */
        r = load(c, key, false, &f);
        if (r >= 0) {
                /* Read back already (0), or being read off the loop (1): a hit once the
                 * bytes land, not when a copy that may prove unusable is found. */
                if (r == 0)
                        c->stats.prefetch_hits++;
                else
                        PRIV(f)->load_prefetched = true;
                *ret = FEATURE_PREFETCH_LOADED;
                return 0;
        }
        /* Only a key with no stored copy is announced (one found to be another key's
         * is none). Anything else is said: no room (-ENOSPC, -E2BIG), or a copy that
         * could not be read (damaged and removed, out of memory or file descriptors,
         * the loader's refusal), which the Acquire that comes produces. */
        if (r != -ENOENT)
                return r;
        if (c->stats.n_announced >= c->config.max_announced ||
            c->stats.n_features >= c->config.max_features)
                return -ENOSPC;
        r = feature_entry_new(c, key, &f);
        if (r < 0)
                return r;
        f->deadline = now + c->config.announce_timeout_usec;
        QUEUE_PUSH_BACK(announced, c->announced, f);
        f->in_announced = true;
        c->stats.n_announced++;
        *ret = FEATURE_PREFETCH_ANNOUNCED;
        return 0;
}

usec_t feature_cache_expire(FeatureCache *c, usec_t now) {
        while (c->announced.first && c->announced.first->deadline <= now)
                set_failed(c, c->announced.first, -ETIMEDOUT);
        while (c->producing.first && c->producing.first->produce_deadline <= now) {
                Feature *f = c->producing.first;
                c->stats.produce_timeouts++;
                /* Its producer may still write there: the region goes with its
                 * reference (feature_ref_release()), a reader's from here. */
                PRIV(f)->region_holder = f->has_region ? f->producer : NULL;
                set_failed(c, f, -ETIMEDOUT); /* out of the queue */
        }
        usec_t a = c->announced.first ? c->announced.first->deadline : USEC_INFINITY;
        usec_t p = c->producing.first ? c->producing.first->produce_deadline : USEC_INFINITY;
        return MIN(a, p);
}
