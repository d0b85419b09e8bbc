/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The feature cache's journal (docs/wal.md): its records replayed at start, its
 * snapshot, the drop of the features of an arena whose bytes are gone, and the fence
 * that keeps the restored arenas as they were while workers of before may use them. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "feature/feature-internal.h"
#include "log.h"

/* A key's READY skipped by the replay, or (!skipped) a later READY or GONE of it. Keyed
 * by the key: a replay whose every READY is skipped (the arena index names no feature
 * arena now, or the arena shrank) scanned a list for each record, and took minutes on a
 * full log. */
static int replay_note_skipped(FeatureCache *c, const char *key, bool skipped) {
        char *k = c->skipped ? hashmap_get(c->skipped, key) : NULL;

        if (k) {
                if (!skipped)
                        free(hashmap_remove(c->skipped, key));
                return 0;
        }
        if (!skipped)
                return 0;
        if (!c->skipped && !(c->skipped = hashmap_new(HASHMAP_KEY_STRING, 0)))
                goto oom;
        k = strdup(key);
        if (!k)
                goto oom;
        if (hashmap_put(c->skipped, k, k) < 0) {
                free(k);
                goto oom;
        }
        return 0;
oom:
        /* Without its GONE, a later start could bring it back over bytes written since:
         * the start fails instead. */
        return log_error_errno(-ENOMEM, "Feature %s: skipped at replay, and no memory left to journal that it is gone.",
                               key);
}

void feature_replay_skipped_free(FeatureCache *c) {
        size_t it = 0;
        void *k;

        while (c->skipped && hashmap_iterate(c->skipped, &it, &k, NULL))
                free(k);
        c->skipped = hashmap_free(c->skipped);
}

void feature_replay_skipped_journal(FeatureCache *c) {
        size_t it = 0;
        void *v;

        /* One GONE per key, each of a different key: their order does not matter. */
        while (c->skipped && c->journal_fn && hashmap_iterate(c->skipped, &it, &v, NULL)) {
                const char *k = v;
                int r = c->journal_fn(c, FEATURE_REC_GONE, k, strlen(k), c->journal_userdata);
                if (r < 0)
                        log_warning_errno(r, "Feature %s: cannot journal that the replay dropped it: %m", k);
        }
        feature_replay_skipped_free(c);
}

static void replayed_drop(FeatureCache *c, Feature *f) {
        feature_region_release(c, f); /* no journal is set during the replay */
        feature_entry_unlink(c, f);
        feature_entry_maybe_destroy(f);
}

/* A well-formed READY of key: the feature back in its region, or why not. */
static int apply_ready(FeatureCache *c, const FeatureRecord *rec, const char *key) {
        _cleanup_(feature_desc_freep) FeatureDesc *desc = NULL;
        CacheArena *a;
        Feature *f;
        uint64_t size;
        int r;

        f = hashmap_get(c->features, key);
        if (f)
                replayed_drop(c, f);
        a = feature_arena_of(c, rec->arena);
        if (!a)
                return -ENODEV;
        r = feature_desc_parse(rec->desc, rec->desc_len, rec->bytes, &desc, NULL);
        if (r < 0)
                return r == -ENOMEM ? r : -EBADMSG;
        if (c->stats.n_features >= c->config.max_features)
                return -EDQUOT;
        r = feature_allocator_alloc_at(a->alloc, rec->offset, rec->bytes, &size);
        if (r < 0)
                return r;
        if (size != rec->size) {
                /* Well-formed, but the arena is cut differently now (its PageSize=
                 * changed): the region is not what was journaled; drop the feature. */
                (void)feature_allocator_release(a->alloc, rec->offset);
                return -ESTALE;
        }
        r = feature_entry_new(c, key, &f);
        if (r < 0) {
                (void)feature_allocator_release(a->alloc, rec->offset);
                return r;
        }
        f->has_region = true;
        f->arena = rec->arena;
        f->offset = rec->offset;
        f->size = size;
        f->bytes = rec->bytes;
        f->desc = TAKE_PTR(desc);
        f->request_id = rec->request_id;
        f->encode_usec = rec->encode_usec;
        f->state = FEATURE_READY;
        c->stats.bytes_cached += size;
        feature_lru_update(c, f);
        return 0;
}

int feature_cache_apply_record(FeatureCache *c, uint16_t type, const void *payload, size_t len) {
        char key[FEATURE_KEY_MAX + 1];
        FeatureRecord rec;
        Feature *f;
        int r, k;

        if (!c || c->journal_fn)
                return -EBUSY; /* only before the journal is set: at start */
        switch (type & 0xff) {
        case FEATURE_REC_GONE:
                if (!payload || len == 0 || len > FEATURE_KEY_MAX || memchr(payload, 0, len))
                        return -EBADMSG;
                memcpy(key, payload, len);
                key[len] = 0;
                (void)replay_note_skipped(c, key, false); /* takes nothing */
                f = hashmap_get(c->features, key);
                if (!f)
                        return -ENOENT;
                replayed_drop(c, f);
                return 0;
        case FEATURE_REC_READY:
                break;
        default:
                return -EBADMSG;
        }
        r = feature_record_ready_parse(payload, len, &rec);
        if (r < 0)
                return r;
        memcpy(key, rec.key, rec.key_len);
        key[rec.key_len] = 0;
        /* One that cannot come back is journaled GONE after the replay: a later start
         * that could take it back must not, over the bytes written there since. */
        r = apply_ready(c, &rec, key);
        if (r == -ENOMEM)
                return r; /* says nothing of the feature: the start fails, it is not dropped */
        k = replay_note_skipped(c, key, r < 0);
        return k < 0 ? k : r;
}

int feature_cache_snapshot(FeatureCache *c, int (*add)(void *userdata, uint16_t type, const void *rec, size_t len),
                           void *userdata, uint16_t type_base) {
        size_t it = 0;
        void *v;
        int r;

        if (!c)
                return 0;
        while (hashmap_iterate(c->features, &it, &v, NULL)) {
                Feature *f = v;
                _cleanup_(freep) void *buf = NULL;
                size_t len;

                if (f->state != FEATURE_READY || !f->has_region || !f->desc)
                        continue;
                r = feature_record_ready_encode(f, &buf, &len);
                if (r < 0)
                        return r;
                r = add(userdata, type_base + FEATURE_REC_READY, buf, len);
                if (r < 0)
                        return r;
        }
        return 0;
}

uint64_t feature_cache_drop_arena(FeatureCache *c, uint32_t arena) {
        uint64_t n = 0;
        size_t it = 0;
        void *v;

        if (!c)
                return 0;
        /* Collected in one pass, then dropped (a rescan after each was quadratic). */
        _cleanup_(freep) Feature **gone = calloc(MAX(hashmap_size(c->features), (size_t)1), sizeof *gone);
        while (hashmap_iterate(c->features, &it, &v, NULL)) {
                Feature *f = v;
                if (!f->has_region || f->arena != arena || f->state != FEATURE_READY)
                        continue;
                if (!gone) {
                        /* No memory for the list: one at a time, the scan started over
                         * (none may stay: its bytes are gone). */
                        replayed_drop(c, f); /* journals GONE once the journal is set */
                        n++;
                        it = 0;
                        continue;
                }
                gone[n++] = f;
        }
        for (uint64_t i = 0; gone && i < n; i++)
                replayed_drop(c, gone[i]);
        return n;
}

static bool fence_covers(const CacheArena *a, uint64_t arena_mask) {
        return a->index >= 64 || (arena_mask & (1ULL << a->index));
}

int64_t feature_cache_fence(FeatureCache *c, uint64_t arena_mask) {
        uint64_t bytes = 0;
        size_t it = 0;
        void *v;

        if (!c)
                return 0;
        if (c->fenced)
                return (int64_t)c->stats.bytes_fenced;
        /* The free runs counted first: every array is made before the allocators change,
         * so that a failure leaves nothing half fenced. */
        for (size_t i = 0; i < c->n_arenas; i++) {
                CacheArena *a = &c->arenas[i];
                uint64_t off, len, from = 0, n = 0;

                if (!fence_covers(a, arena_mask))
                        continue;
                for (; feature_allocator_next_free(a->alloc, from, &off, &len) == 0; from = off + len)
                        n++;
                if (n == 0)
                        continue;
                a->fence_offsets = calloc(n, sizeof *a->fence_offsets);
                if (!a->fence_offsets) {
                        for (size_t k = 0; k < i; k++) {
                                free(c->arenas[k].fence_offsets);
                                c->arenas[k].fence_offsets = NULL;
                        }
                        return -ENOMEM;
                }
        }
        for (size_t i = 0; i < c->n_arenas; i++) {
                CacheArena *a = &c->arenas[i];
                uint64_t off, len, got, from = 0;

                if (!a->fence_offsets)
                        continue;
                for (; feature_allocator_next_free(a->alloc, from, &off, &len) == 0; from = off + len) {
                        if (feature_allocator_alloc_at(a->alloc, off, len, &got) < 0)
                                continue; /* cannot be: the run was just found free */
                        a->fence_offsets[a->n_fence++] = off;
                        bytes += got;
                }
        }
        /* The READY features there now are the replayed ones: kept off the LRU. */
        while (hashmap_iterate(c->features, &it, &v, NULL)) {
                Feature *f = v;
                CacheArena *a = f->has_region ? feature_arena_of(c, f->arena) : NULL;

                if (f->state != FEATURE_READY || !a || !fence_covers(a, arena_mask))
                        continue;
                PRIV(f)->fenced = true;
                feature_lru_update(c, f);
        }
        c->fenced = true;
        c->stats.bytes_fenced = bytes;
        return (int64_t)bytes;
}

void feature_cache_unfence(FeatureCache *c) {
        size_t it = 0;
        void *v;

        if (!c || !c->fenced)
                return;
        for (size_t i = 0; i < c->n_arenas; i++) {
                CacheArena *a = &c->arenas[i];
                for (size_t k = 0; k < a->n_fence; k++)
                        (void)feature_allocator_release(a->alloc, a->fence_offsets[k]);
                free(a->fence_offsets);
                a->fence_offsets = NULL;
                a->n_fence = 0;
        }
        while (hashmap_iterate(c->features, &it, &v, NULL)) {
                Feature *f = v;
                if (!PRIV(f)->fenced)
                        continue;
                PRIV(f)->fenced = false;
                feature_lru_update(c, f);
        }
        c->fenced = false;
        c->stats.bytes_fenced = 0;
        /* A budget lowered meanwhile could not evict them: it can now. */
        feature_cache_set_budget(c, c->config.budget_bytes);
}

bool feature_cache_fenced(const FeatureCache *c) {
        return c && c->fenced;
}

/* -- records written (the READY record's format: feature-record.c) -- */

int feature_journal_ready(FeatureCache *c, Feature *f) {
        _cleanup_(freep) void *buf = NULL;
        size_t len;
        int r;

        if (!c->journal_fn)
                return 0;
        r = feature_record_ready_encode(f, &buf, &len);
        if (r >= 0)
                r = c->journal_fn(c, FEATURE_REC_READY, buf, len, c->journal_userdata);
        if (r < 0)
                log_warning_errno(r, "Cannot journal feature %.64s as ready: %m", f->key);
        return r;
}

void feature_journal_gone(FeatureCache *c, Feature *f) {
        int r;

        if (!c->journal_fn)
                return;
        r = c->journal_fn(c, FEATURE_REC_GONE, f->key, strlen(f->key), c->journal_userdata);
        if (r < 0)
                log_warning_errno(r, "Cannot journal an evicted feature: %m");
}

void feature_cache_set_journal(FeatureCache *c, feature_journal_fn fn, void *userdata) {
        c->journal_fn = fn;
        c->journal_userdata = userdata;
        /* The replay is over: what it skipped is gone for good, said in the log. */
        feature_replay_skipped_journal(c);
}
