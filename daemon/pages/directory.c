/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/directory.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "hashmap.h"
#include "macro.h"
#include "siphash24.h"

typedef struct DirectoryEntry {
        uint64_t hash; /* the map's key points here */
        PagePool *pool;
        PageId page;
} DirectoryEntry;

struct Directory {
        Hashmap *map; /* DirectoryEntry* by hash */
        PagePool **pools;
        size_t n_pools;
        char **hosts;
        size_t n_hosts;
        size_t self;
        DirectoryStats stats;
        DirectoryJournalFn journal;
        void *journal_userdata;
};

/* Rendezvous hashing must agree between hosts: a fixed key, not the per-process one. */
static const uint8_t rendezvous_key[16] = "epd1-rendezvous";

int directory_new(Directory **ret) {
        Directory *d = calloc(1, sizeof *d);
        if (!d)
                return -ENOMEM;
        d->map = hashmap_new(HASHMAP_KEY_U64, 0);
        if (!d->map) {
                free(d);
                return -ENOMEM;
        }
        *ret = d;
        return 0;
}

static void hosts_free(Directory *d) {
        for (size_t i = 0; i < d->n_hosts; i++)
                free(d->hosts[i]);
        free(d->hosts);
        d->hosts = NULL;
        d->n_hosts = d->self = 0;
}

Directory *directory_free(Directory *d) {
        if (!d)
                return NULL;
        directory_clear(d);
        for (size_t i = 0; i < d->n_pools; i++)
                page_pool_set_evict(d->pools[i], NULL, NULL);
        free(d->pools);
        hashmap_free(d->map);
        hosts_free(d);
        free(d);
        return NULL;
}

static bool pool_attached(const Directory *d, const PagePool *pool) {
        for (size_t i = 0; i < d->n_pools; i++)
                if (d->pools[i] == pool)
                        return true;
        return false;
}

void directory_set_journal(Directory *d, DirectoryJournalFn fn, void *userdata) {
        d->journal = fn;
        d->journal_userdata = userdata;
}

static int entry_journal_removal(Directory *d, DirectoryEntry *e) {
        return d->journal ? d->journal(d->journal_userdata, false, e->hash, e->pool, e->page) : 0;
}

/* Every way an entry goes ends here or in entry_forget_journaled(), so that each goes
 * into the journal. This one for pools that go away (their pages with them). */
static void entry_forget(Directory *d, DirectoryEntry *e) {
        (void)hashmap_remove(d->map, &e->hash);
        (void)entry_journal_removal(d, e);
        free(e);
}

/* An entry whose page is freed for reuse: only once its removal is in the journal.
 * Otherwise a restart would bring the hash back on a page that holds other bytes by
 * then (another block's KV, silently). */
static int entry_forget_journaled(Directory *d, DirectoryEntry *e) {
        int r = entry_journal_removal(d, e);
        if (r < 0)
                return r;
        (void)hashmap_remove(d->map, &e->hash);
        free(e);
        return 0;
}

int directory_foreach(Directory *d, int (*fn)(void *userdata, uint64_t hash, PagePool *pool, PageId page),
                      void *userdata) {
        size_t i = 0;
        void *v;
        while (d && hashmap_iterate(d->map, &i, &v, NULL)) {
                DirectoryEntry *e = v;
                int r = fn(userdata, e->hash, e->pool, e->page);
                if (r < 0)
                        return r;
        }
        return 0;
}

static size_t directory_evict(PagePool *pool, size_t want, void *userdata) {
        Directory *d = userdata;
        size_t n = 0;

        while (n < want) {
                DirectoryEntry *e = page_pool_lru_peek(pool);
                if (!e)
                        break;
                /* The journal refused the removal: the page stays cached and the
                 * allocation that wanted it fails (no space) instead. */
                if (entry_forget_journaled(d, e) < 0) {
                        d->stats.evictions_refused++;
                        break;
                }
                (void)page_pool_evict_lru(pool, NULL, NULL);
                d->stats.evictions++;
                n++;
        }
        return n;
}

void directory_attach_pool(Directory *d, PagePool *pool) {
        if (!d || !pool || pool_attached(d, pool))
                return;
        PagePool **p = realloc(d->pools, (d->n_pools + 1) * sizeof *p);
        if (!p)
                /* Without the table entry the pool's pages cannot be cached (inserts
                 * fail with -EINVAL), which is safe. */
                return;
        d->pools = p;
        d->pools[d->n_pools++] = pool;
        page_pool_set_evict(pool, directory_evict, d);
}

/* Removes every entry matching pool (all when pool is NULL). */
static void forget_where(Directory *d, PagePool *pool) {
        _cleanup_(freep) DirectoryEntry **doomed = NULL;
        size_t n = 0, i = 0;
        void *v;

        doomed = malloc(MAX(hashmap_size(d->map), (size_t)1) * sizeof *doomed);
        if (!doomed) {
                /* Slow path without memory: one entry per scan. */
                for (bool again = true; again;) {
                        again = false;
                        i = 0;
                        while (hashmap_iterate(d->map, &i, &v, NULL)) {
                                DirectoryEntry *e = v;
                                if (pool && e->pool != pool)
                                        continue;
                                (void)page_clear_cached(e->pool, e->page);
                                entry_forget(d, e);
                                d->stats.removals++;
                                again = true;
                                break;
                        }
                }
                return;
        }
        while (hashmap_iterate(d->map, &i, &v, NULL)) {
                DirectoryEntry *e = v;
                if (!pool || e->pool == pool)
                        doomed[n++] = e;
        }
        for (i = 0; i < n; i++) {
                (void)page_clear_cached(doomed[i]->pool, doomed[i]->page);
                entry_forget(d, doomed[i]);
        }
        d->stats.removals += n;
}

void directory_detach_pool(Directory *d, PagePool *pool) {
        if (!d || !pool)
                return;
        forget_where(d, pool);
        for (size_t i = 0; i < d->n_pools; i++)
                if (d->pools[i] == pool) {
                        page_pool_set_evict(pool, NULL, NULL);
                        d->pools[i] = d->pools[--d->n_pools];
                        break;
                }
}

void directory_clear(Directory *d) {
        if (!d)
                return;
        forget_where(d, NULL);
}

int directory_set_hosts(Directory *d, const char *const *host_ids, size_t n, size_t self) {
        char **hosts = NULL;

        if (!d || n > DIRECTORY_HOSTS_MAX || (n > 0 && (!host_ids || self >= n)))
                return -EINVAL;
        if (n > 0) {
                hosts = calloc(n, sizeof *hosts);
                if (!hosts)
                        return -ENOMEM;
                for (size_t i = 0; i < n; i++) {
                        if (!host_ids[i] || !(hosts[i] = strdup(host_ids[i]))) {
                                for (size_t k = 0; k < i; k++)
                                        free(hosts[k]);
                                free(hosts);
                                return host_ids[i] ? -ENOMEM : -EINVAL;
                        }
                }
        }
        hosts_free(d);
        d->hosts = hosts;
        d->n_hosts = n;
        d->self = self;
        return 0;
}

size_t directory_rendezvous(const char *const *hosts, size_t n, uint64_t hash) {
        size_t best = 0;
        uint64_t best_score = 0;
        uint8_t buf[8 + 256];

        if (!hosts || n <= 1)
                return 0;
        for (size_t i = 0; i < n; i++) {
                size_t l = strnlen(hosts[i], sizeof buf - 8);
                for (size_t b = 0; b < 8; b++)
                        buf[b] = (uint8_t)(hash >> (8 * b));
                memcpy(buf + 8, hosts[i], l);
                uint64_t score = siphash24(buf, 8 + l, rendezvous_key);
                if (i == 0 || score > best_score) {
                        best = i;
                        best_score = score;
                }
        }
        return best;
}

size_t directory_owner(const Directory *d, uint64_t hash) {
        if (!d || d->n_hosts <= 1)
                return 0;
        return directory_rendezvous((const char *const *)d->hosts, d->n_hosts, hash);
}

bool directory_find(Directory *d, uint64_t hash, PagePool **ret_pool, PageId *ret_page) {
        DirectoryEntry *e = hashmap_get(d->map, &hash);
        if (!e)
                return false;
        if (ret_pool)
                *ret_pool = e->pool;
        if (ret_page)
                *ret_page = e->page;
        return true;
}

const char *directory_owner_host(const Directory *d, uint64_t hash) {
        if (!d || d->n_hosts == 0)
                return NULL;
        return d->hosts[directory_owner(d, hash)];
}

bool directory_owns(const Directory *d, uint64_t hash) {
        return !d || d->n_hosts == 0 || directory_owner(d, hash) == d->self;
}

int directory_insert(Directory *d, PagePool *pool, uint64_t hash, PageId page) {
        int r;

        if (!d || !pool || !pool_attached(d, pool) || page >= page_pool_size(pool))
                return -EINVAL;
        if (hashmap_contains(d->map, &hash)) {
                d->stats.conflicts++;
                return -EEXIST;
        }
        DirectoryEntry *e = malloc(sizeof *e);
        if (!e)
                return -ENOMEM;
        *e = (DirectoryEntry){ .hash = hash, .pool = pool, .page = page };
        r = page_set_cached(pool, page, e);
        if (r < 0) {
                if (r == -EBUSY)
                        d->stats.conflicts++;
                free(e);
                return r;
        }
        r = hashmap_put(d->map, &e->hash, e);
        if (r < 0) {
                (void)page_clear_cached(pool, page);
                free(e);
                return r;
        }
        if (d->journal) {
                r = d->journal(d->journal_userdata, true, hash, pool, page);
                if (r < 0) {
                        (void)hashmap_remove(d->map, &e->hash);
                        (void)page_clear_cached(pool, page);
                        free(e);
                        return r;
                }
        }
        d->stats.inserts++;
        return 0;
}

int directory_insert_chain(Directory *d, PagePool *pool, const uint64_t *hashes,
                           const PageId *pages, size_t n) {
        int inserted = 0;

        if (!d || !pool || !pool_attached(d, pool) || n > DIRECTORY_CHAIN_MAX ||
            (n > 0 && (!hashes || !pages)))
                return -EINVAL;
        for (size_t i = 0; i < n; i++) {
                int r = directory_insert(d, pool, hashes[i], pages[i]);
                if (r < 0 && r != -EEXIST && r != -EBUSY && r != -ESTALE && r != -EINVAL)
                        return inserted > 0 && r == -ENOMEM ? inserted : r;
                inserted += r >= 0;
        }
        return inserted;
}

static DirectoryEntry *probe(Directory *d, PagePool *pool, uint64_t hash) {
        d->stats.probes++;
        DirectoryEntry *e = hashmap_get(d->map, &hash);
        return e && e->pool == pool ? e : NULL;
}

int directory_lookup(Directory *d, PagePool *pool, const uint64_t *hashes, size_t n,
                     PageId *ret_pages, size_t *ret_len) {
        size_t len = 0;

        if (!d || !pool || !ret_len || n > DIRECTORY_CHAIN_MAX || (n > 0 && (!hashes || !ret_pages)))
                return -EINVAL;
        d->stats.lookups++;
        for (; len < n; len++) {
                DirectoryEntry *e = probe(d, pool, hashes[len]);
                if (!e || page_ref(pool, e->page) < 0)
                        break;
                ret_pages[len] = e->page;
        }
        d->stats.hits += len;
        if (len < n)
                d->stats.misses++;
        *ret_len = len;
        return 0;
}

size_t directory_match_len(Directory *d, PagePool *pool, const uint64_t *hashes, size_t n) {
        size_t len = 0;

        if (!d || !pool || !hashes)
                return 0;
        while (len < n && probe(d, pool, hashes[len]))
                len++;
        return len;
}

int directory_remove(Directory *d, uint64_t hash) {
        if (!d)
                return -EINVAL;
        DirectoryEntry *e = hashmap_get(d->map, &hash);
        if (!e)
                return -ENOENT;
        PagePool *pool = e->pool;
        PageId page = e->page;
        int r = entry_forget_journaled(d, e);
        if (r < 0)
                return r;
        (void)page_clear_cached(pool, page);
        d->stats.removals++;
        return 0;
}

size_t directory_size(const Directory *d) {
        return d ? hashmap_size(d->map) : 0;
}

void directory_stats(const Directory *d, DirectoryStats *ret) {
        *ret = d->stats;
        ret->entries = hashmap_size(d->map);
}

size_t directory_orphans(const Directory *d) {
        size_t n = 0, i = 0;
        void *v;

        if (!d)
                return 0;
        while (hashmap_iterate(d->map, &i, &v, NULL)) {
                DirectoryEntry *e = v;
                if (!pool_attached(d, e->pool) || page_cached_entry(e->pool, e->page) != e ||
                    !page_is_allocated(e->pool, e->page))
                        n++;
        }
        return n;
}
