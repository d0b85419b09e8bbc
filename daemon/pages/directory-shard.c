/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/directory-shard.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hashmap.h"
#include "macro.h"

/* ---- names, interned: records hold 16-bit indexes ---- */

#define NAMES_MAX 65535U

typedef struct Names {
        char **s;
        size_t n, cap;
        Hashmap *index; /* (uintptr_t)(i + 1) by string */
} Names;

static void names_done(Names *nm) {
        for (size_t i = 0; i < nm->n; i++)
                free(nm->s[i]);
        free(nm->s);
        hashmap_free(nm->index);
}

static int names_intern(Names *nm, const char *s, uint16_t *ret) {
        void *v = hashmap_get(nm->index, s);
        char **ns, *d;
        int r;

        if (v) {
                *ret = (uint16_t)((uintptr_t)v - 1);
                return 0;
        }
        if (nm->n >= NAMES_MAX)
                return -ENOSPC;
        if (nm->n == nm->cap) {
                /* Doubling: one name at a time would copy the whole table each time. */
                size_t cap = MIN(MAX(nm->cap * 2, (size_t)16), (size_t)NAMES_MAX);
                ns = reallocarray(nm->s, cap, sizeof *ns);
                if (!ns)
                        return -ENOMEM;
                nm->s = ns;
                nm->cap = cap;
        }
        d = strdup(s);
        if (!d)
                return -ENOMEM;
        r = hashmap_put(nm->index, d, (void *)(uintptr_t)(nm->n + 1));
        if (r < 0) {
                free(d);
                return r;
        }
        nm->s[nm->n] = d;
        *ret = (uint16_t)nm->n++;
        return 0;
}

static int names_find(const Names *nm, const char *s, uint16_t *ret) {
        void *v = hashmap_get(nm->index, s);
        if (!v)
                return -ENOENT;
        *ret = (uint16_t)((uintptr_t)v - 1);
        return 0;
}

typedef struct Holder {
        uint16_t host, arena, worker;
} Holder;

typedef struct Entry {
        uint64_t hash; /* the map's key */
        uint8_t n;
        Holder h[DIRECTORY_HOLDERS_MAX];
        usec_t expires; /* cache only */
} Entry;

static void entry_fill(const Names *nm, const Entry *e, DirectoryAnswerEntry *ret) {
        ret->hash = e->hash;
        ret->n_holders = e->n;
        for (unsigned i = 0; i < e->n; i++) {
                snprintf(ret->holders[i].host, sizeof ret->holders[i].host, "%s", nm->s[e->h[i].host]);
                snprintf(ret->holders[i].arena, sizeof ret->holders[i].arena, "%s", nm->s[e->h[i].arena]);
                snprintf(ret->holders[i].worker, sizeof ret->holders[i].worker, "%s", nm->s[e->h[i].worker]);
        }
}

/* ---- the owner's records ---- */

struct DirectoryShard {
        Hashmap *map; /* Entry* by hash */
        Names names;
        size_t records, max;
        /* Holders removed or renamed (each may leave a name unused), and how many there
         * had been at the last compaction: a full table with none since is compacted
         * no more (it would find nothing to drop, on every put). */
        uint64_t released, released_at_compaction;
        uint64_t compactions;
};

int directory_shard_new(DirectoryShard **ret, size_t max_records) {
        DirectoryShard *sh = calloc(1, sizeof *sh);
        if (!sh)
                return -ENOMEM;
        sh->max = max_records;
        sh->map = hashmap_new(HASHMAP_KEY_U64, 0);
        sh->names.index = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!sh->map || !sh->names.index) {
                directory_shard_free(sh);
                return -ENOMEM;
        }
        *ret = sh;
        return 0;
}

static void map_free_entries(Hashmap *map) {
        size_t i = 0;
        void *v;
        while (hashmap_iterate(map, &i, &v, NULL))
                free(v);
        hashmap_clear(map);
}

DirectoryShard *directory_shard_free(DirectoryShard *sh) {
        if (!sh)
                return NULL;
        if (sh->map)
                map_free_entries(sh->map);
        hashmap_free(sh->map);
        names_done(&sh->names);
        free(sh);
        return NULL;
}

/* The name table without the names no record uses any more (workers come and go, each
 * with its own name): a new table of the names in use, every record's indexes moved
 * to it. Run when the table is full. */
static int shard_names_compact(DirectoryShard *sh) {
        Names nn = { .index = hashmap_new(HASHMAP_KEY_STRING, 0) };
        size_t i = 0;
        void *v;
        int r = nn.index ? 0 : -ENOMEM;

        /* Intern what is used into nn first: nothing changes until all of it is in. */
        while (r >= 0 && hashmap_iterate(sh->map, &i, &v, NULL)) {
                Entry *e = v;
                uint16_t x;
                for (unsigned k = 0; r >= 0 && k < e->n; k++)
                        if ((r = names_intern(&nn, sh->names.s[e->h[k].host], &x)) >= 0 &&
                            (r = names_intern(&nn, sh->names.s[e->h[k].arena], &x)) >= 0)
                                r = names_intern(&nn, sh->names.s[e->h[k].worker], &x);
        }
        if (r < 0) {
                names_done(&nn);
                return r;
        }
        i = 0;
        while (hashmap_iterate(sh->map, &i, &v, NULL)) {
                Entry *e = v;
                for (unsigned k = 0; k < e->n; k++) {
                        (void)names_find(&nn, sh->names.s[e->h[k].host], &e->h[k].host);
                        (void)names_find(&nn, sh->names.s[e->h[k].arena], &e->h[k].arena);
                        (void)names_find(&nn, sh->names.s[e->h[k].worker], &e->h[k].worker);
                }
        }
        names_done(&sh->names);
        sh->names = nn;
        return 0;
}

static int shard_intern(DirectoryShard *sh, const char *host, const char *arena, const char *worker, Holder *h) {
        int r;
        for (int pass = 0;; pass++) {
                if ((r = names_intern(&sh->names, host, &h->host)) >= 0 &&
                    (r = names_intern(&sh->names, arena, &h->arena)) >= 0 &&
                    (r = names_intern(&sh->names, worker, &h->worker)) >= 0)
                        return 0;
                if (r != -ENOSPC || pass > 0)
                        return r;
                if (sh->compactions > 0 && sh->released == sh->released_at_compaction)
                        return -ENOSPC; /* every name in the table is in use */
                r = shard_names_compact(sh);
                if (r < 0)
                        return r;
                sh->compactions++;
                sh->released_at_compaction = sh->released;
        }
}

int directory_shard_put(DirectoryShard *sh, uint64_t hash, const char *host, const char *arena, const char *worker) {
        Holder h;
        Entry *e;
        int r;

        if (!directory_name_is_valid(host, true) || !directory_name_is_valid(arena, false) ||
            !directory_name_is_valid(worker, false))
                return -EINVAL;
        e = hashmap_get(sh->map, &hash);
        if (!e && sh->records >= sh->max)
                return -ENOSPC;
        if ((r = shard_intern(sh, host, arena, worker, &h)) < 0)
                return r;
        if (e) {
                for (unsigned i = 0; i < e->n; i++)
                        if (e->h[i].host == h.host && e->h[i].arena == h.arena) {
                                sh->released += e->h[i].worker != h.worker;
                                e->h[i].worker = h.worker;
                                return 0;
                        }
                /* Refused with its names interned: they may be used by no record. */
                if (e->n >= DIRECTORY_HOLDERS_MAX) {
                        sh->released++;
                        return -E2BIG;
                }
                if (sh->records >= sh->max) {
                        sh->released++;
                        return -ENOSPC;
                }
                e->h[e->n++] = h;
                sh->records++;
                return 0;
        }
        e = calloc(1, sizeof *e);
        if (!e) {
                sh->released++;
                return -ENOMEM;
        }
        e->hash = hash;
        e->h[0] = h;
        e->n = 1;
        r = hashmap_put(sh->map, &e->hash, e);
        if (r < 0) {
                free(e);
                sh->released++;
                return r;
        }
        sh->records++;
        return 0;
}

static void entry_remove_at(DirectoryShard *sh, Entry *e, unsigned i) {
        e->h[i] = e->h[--e->n];
        sh->records--;
        sh->released++;
        if (e->n == 0) {
                (void)hashmap_remove(sh->map, &e->hash);
                free(e);
        }
}

int directory_shard_del(DirectoryShard *sh, uint64_t hash, const char *host, const char *arena) {
        Entry *e = hashmap_get(sh->map, &hash);
        uint16_t hi, ai;

        if (!e || names_find(&sh->names, host, &hi) < 0 || names_find(&sh->names, arena, &ai) < 0)
                return -ENOENT;
        for (unsigned i = 0; i < e->n; i++)
                if (e->h[i].host == hi && e->h[i].arena == ai) {
                        entry_remove_at(sh, e, i);
                        return 0;
                }
        return -ENOENT;
}

size_t directory_shard_drop_host(DirectoryShard *sh, const char *host) {
        size_t before = sh->records, n = 0, i = 0;
        uint64_t *hit;
        uint16_t hi;
        void *v;

        if (names_find(&sh->names, host, &hi) < 0)
                return 0;
        /* Collect first, then remove: the map moves entries on removal. */
        hit = malloc(MAX(hashmap_size(sh->map), (size_t)1) * sizeof *hit);
        if (!hit)
                return 0;
        while (hashmap_iterate(sh->map, &i, &v, NULL)) {
                Entry *e = v;
                for (unsigned j = 0; j < e->n; j++)
                        if (e->h[j].host == hi) {
                                hit[n++] = e->hash;
                                break;
                        }
        }
        for (size_t k = 0; k < n; k++) {
                Entry *e = hashmap_get(sh->map, &hit[k]);
                for (unsigned j = 0; e && j < e->n;) {
                        if (e->h[j].host != hi) {
                                j++;
                                continue;
                        }
                        bool last = e->n == 1;
                        entry_remove_at(sh, e, j);
                        if (last)
                                break;
                }
        }
        free(hit);
        return before - sh->records;
}

size_t directory_shard_prune(DirectoryShard *sh, bool (*keep)(void *userdata, uint64_t hash), void *userdata) {
        size_t before = sh->records, n = 0, k = 0, i = 0;
        uint64_t *drop;
        void *v;

        /* Collect first, then remove: the map moves entries on removal. */
        drop = malloc(MAX(hashmap_size(sh->map), (size_t)1) * sizeof *drop);
        if (!drop)
                return 0;
        while (hashmap_iterate(sh->map, &i, &v, NULL))
                if (!keep(userdata, ((Entry *)v)->hash))
                        drop[n++] = ((Entry *)v)->hash;
        for (k = 0; k < n; k++) {
                Entry *e = hashmap_remove(sh->map, &drop[k]);
                if (e) {
                        sh->records -= e->n;
                        sh->released += e->n;
                        free(e);
                }
        }
        free(drop);
        return before - sh->records;
}

size_t directory_shard_forget(DirectoryShard *sh, uint64_t hash) {
        Entry *e = hashmap_remove(sh->map, &hash);
        size_t n = e ? e->n : 0;

        sh->records -= n;
        sh->released += n;
        free(e);
        return n;
}

int directory_shard_keys(const DirectoryShard *sh, uint64_t **ret, size_t *ret_n) {
        size_t n = 0, i = 0;
        uint64_t *k = malloc(MAX(hashmap_size(sh->map), (size_t)1) * sizeof *k);
        void *v;

        if (!k)
                return -ENOMEM;
        while (hashmap_iterate(sh->map, &i, &v, NULL))
                k[n++] = ((Entry *)v)->hash;
        *ret = k;
        *ret_n = n;
        return 0;
}

void directory_shard_get(const DirectoryShard *sh, uint64_t hash, DirectoryAnswerEntry *ret) {
        const Entry *e = hashmap_get(sh->map, &hash);

        ret->hash = hash;
        ret->n_holders = 0;
        if (e)
                entry_fill(&sh->names, e, ret);
}

void directory_answer_set_self(DirectoryAnswerEntry *e, const char *host, const char *arena, const char *worker) {
        bool present = false;
        unsigned k = 0;
        DirectoryHolder *h;

        for (unsigned i = 0; i < e->n_holders; i++) {
                h = e->holders + i;
                if (strcmp(h->host, host) == 0) {
                        if (!arena || present || strcmp(h->arena, arena) != 0)
                                continue; /* stale */
                        present = true;
                }
                if (k != i)
                        e->holders[k] = *h;
                k++;
        }
        e->n_holders = k;
        if (!arena || present)
                return;
        if (e->n_holders >= DIRECTORY_HOLDERS_MAX)
                e->n_holders--;
        h = e->holders + e->n_holders++;
        snprintf(h->host, sizeof h->host, "%s", host);
        snprintf(h->arena, sizeof h->arena, "%s", arena);
        snprintf(h->worker, sizeof h->worker, "%s", worker);
}

uint64_t directory_shard_compactions(const DirectoryShard *sh) {
        return sh->compactions;
}

size_t directory_shard_records(const DirectoryShard *sh) {
        return sh ? sh->records : 0;
}

size_t directory_shard_hashes(const DirectoryShard *sh) {
        return sh ? hashmap_size(sh->map) : 0;
}

/* ---- remote answers ---- */

struct DirectoryCache {
        Hashmap *map;    /* Entry* by hash */
        Names names;
        uint64_t *ring;  /* insertion order, for eviction */
        size_t head, n, max;
};

int directory_cache_new(DirectoryCache **ret, size_t max) {
        DirectoryCache *c;

        if (max == 0)
                return -EINVAL;
        c = calloc(1, sizeof *c);
        if (!c)
                return -ENOMEM;
        c->max = max;
        c->map = hashmap_new(HASHMAP_KEY_U64, 0);
        c->names.index = hashmap_new(HASHMAP_KEY_STRING, 0);
        c->ring = calloc(max, sizeof *c->ring);
        if (!c->map || !c->names.index || !c->ring) {
                directory_cache_free(c);
                return -ENOMEM;
        }
        *ret = c;
        return 0;
}

void directory_cache_clear(DirectoryCache *c) {
        map_free_entries(c->map);
        names_done(&c->names);
        c->names = (Names){ .index = hashmap_new(HASHMAP_KEY_STRING, 0) };
        c->head = c->n = 0;
}

DirectoryCache *directory_cache_free(DirectoryCache *c) {
        if (!c)
                return NULL;
        if (c->map)
                map_free_entries(c->map);
        hashmap_free(c->map);
        names_done(&c->names);
        free(c->ring);
        free(c);
        return NULL;
}

int directory_cache_put(DirectoryCache *c, const DirectoryAnswerEntry *a, usec_t now, usec_t ttl) {
        Entry *e, fresh = { .hash = a->hash };
        int r;

        if (!c->names.index)
                return -ENOMEM;
        if (a->n_holders > DIRECTORY_HOLDERS_MAX)
                return -EINVAL;
        for (unsigned i = 0; i < a->n_holders; i++) {
                Holder *h = fresh.h + fresh.n;
                if ((r = names_intern(&c->names, a->holders[i].host, &h->host)) < 0 ||
                    (r = names_intern(&c->names, a->holders[i].arena, &h->arena)) < 0 ||
                    (r = names_intern(&c->names, a->holders[i].worker, &h->worker)) < 0) {
                        if (r != -ENOSPC)
                                return r;
                        directory_cache_clear(c); /* the names filled up: start over */
                        return 0;
                }
                fresh.n++;
        }
        fresh.expires = now + ttl;
        e = hashmap_get(c->map, &a->hash);
        if (e) {
                *e = fresh;
                return 0;
        }
        if (c->n == c->max) {
                /* Evict the oldest insertion. */
                uint64_t old = c->ring[c->head];
                free(hashmap_remove(c->map, &old));
                c->head = (c->head + 1) % c->max;
                c->n--;
        }
        e = malloc(sizeof *e);
        if (!e)
                return -ENOMEM;
        *e = fresh;
        r = hashmap_put(c->map, &e->hash, e);
        if (r < 0) {
                free(e);
                return r;
        }
        c->ring[(c->head + c->n) % c->max] = e->hash;
        c->n++;
        return 0;
}

bool directory_cache_get(DirectoryCache *c, uint64_t hash, usec_t now, DirectoryAnswerEntry *ret) {
        Entry *e = hashmap_get(c->map, &hash);

        if (!e || now >= e->expires)
                return false;
        entry_fill(&c->names, e, ret);
        return true;
}

size_t directory_cache_size(const DirectoryCache *c) {
        return c ? hashmap_size(c->map) : 0;
}
