/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/directory-forward.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hashmap.h"
#include "log.h"
#include "macro.h"
#include "pages/directory.h"
#include "pages/page-manager.h"
#include "peer/peer-manager.h"

#define FLUSH_DELAY_USEC (1 * USEC_PER_MSEC)
#define REBALANCE_STEP 8192

/* What is queued for one owner: one PUBLISH and one UNPUBLISH batch, each for one
 * (arena, worker); another (arena, worker) flushes the batch first. */
typedef struct Batch {
        uint16_t type;
        char arena[DIRECTORY_NAME_MAX + 1];
        char worker[DIRECTORY_NAME_MAX + 1];
        uint64_t *hashes;
        size_t n;
} Batch;

typedef struct OwnerQueue {
        Peer *peer;
        Batch publish, unpublish;
} OwnerQueue;

typedef struct Locate Locate;

/* One LOOKUP in flight to one owner. */
typedef struct LookupPart {
        uint64_t request; /* the map's key */
        Locate *locate;
        Peer *peer;
        size_t owner;     /* its index in the owners the locate was sent under */
        size_t *index;    /* positions in the locate's entries, in the LOOKUP's order */
        size_t n;
        uint64_t owners_generation; /* the owners it was sent under (df->owners_generation) */
} LookupPart;

struct Locate {
        DirectoryForward *df;
        DirectoryLocateWaiter *waiter;
        DirectoryLocateResult res;
        size_t pending;   /* parts not answered */
        sd_event_source *timer;
        uint64_t *missing; /* owners (by index at the start) counted in res.owners_missing */
        size_t n_owners;
};

/* An owner that did not answer (a part of its LOOKUP, or all of them): counted once,
 * however many parts it was sent. */
static void locate_missing(Locate *l, size_t owner) {
        if (owner < l->n_owners && (l->missing[owner / 64] & (UINT64_C(1) << (owner % 64))))
                return;
        if (owner < l->n_owners)
                l->missing[owner / 64] |= UINT64_C(1) << (owner % 64);
        l->res.owners_missing++;
}

/* A worker name that tags entries: one copy per name, kept while an entry names it
 * (workers come and go, unnamed ones under a new path each registration). */
typedef struct WorkerName {
        char *name; /* the map's key */
        uint64_t refs;
} WorkerName;

/* The worker that published a local entry. */
typedef struct EntryTag {
        uint64_t hash; /* the map's key */
        WorkerName *worker;
} EntryTag;

struct DirectoryForward {
        Manager *m;
        DirectoryShard *shard;
        DirectoryCache *cache;
        usec_t cache_ttl;
        uint64_t owners_generation; /* owner changes: answers from before one are not cached */

        /* Owners: this host and the peers up, as handed to the directory. */
        char **hosts;
        size_t n_hosts;

        Hashmap *tags;   /* EntryTag* by hash */
        Hashmap *names;  /* WorkerName* by name */

        Hashmap *queues; /* OwnerQueue* by host id */
        sd_event_source *flush_timer;

        /* Rebalancing after the owners changed, in steps of REBALANCE_STEP hashes per
         * loop iteration over snapshots of the keys: the records this host no longer
         * owns go, its own entries whose owner changed are published to the new one. */
        sd_event_source *rebalance;
        char **old_hosts;        /* the owners before the change; NULL: publish all */
        size_t n_old_hosts;
        uint64_t *shard_keys, *entry_keys;
        size_t n_shard_keys, n_entry_keys, shard_done, entry_done;
        uint64_t *owned;         /* of this host's entries, how many each of hosts[] owns */
        uint32_t *share;         /* the part of the hash space each of hosts[] owns, permille */

        Hashmap *parts;  /* LookupPart* by request */
        uint64_t next_request;
        size_t n_locates;
        size_t locate_hashes; /* of the locates in flight */

        DirectoryForwardStats stats;
};

static Directory *dir(DirectoryForward *df) {
        return df->m->page_manager->directory;
}

static const char *self_id(DirectoryForward *df) {
        return df->m->config.host_id;
}

/* ---- the worker that published each local entry ---- */

static const char *entry_worker(DirectoryForward *df, uint64_t hash) {
        EntryTag *t = hashmap_get(df->tags, &hash);
        return t ? t->worker->name : "";
}

static void name_unref(DirectoryForward *df, WorkerName *n) {
        if (!n || --n->refs > 0)
                return;
        (void)hashmap_remove(df->names, n->name);
        free(n->name);
        free(n);
}

/* Tags hash with worker (none: untagged), in place of its tag before. The names are
 * looked up, not scanned, and go with their last entry. */
static void tag_entry(DirectoryForward *df, uint64_t hash, const char *worker) {
        EntryTag *t = hashmap_remove(df->tags, &hash);
        WorkerName *n;

        if (t) {
                name_unref(df, t->worker);
                free(t);
        }
        if (!worker || !worker[0])
                return;
        n = hashmap_get(df->names, worker);
        if (!n) {
                n = calloc(1, sizeof *n);
                if (!n)
                        return;
                if (!(n->name = strdup(worker)) || hashmap_put(df->names, n->name, n) < 0) {
                        free(n->name);
                        free(n);
                        return;
                }
        }
        n->refs++;
        t = malloc(sizeof *t);
        if (t)
                *t = (EntryTag){ hash, n };
        if (!t || hashmap_put(df->tags, &t->hash, t) < 0) { /* the key lives in t */
                free(t);
                name_unref(df, n);
        }
}

/* ---- owners ---- */

static const char *owner_of(DirectoryForward *df, uint64_t hash) {
        const char *o = directory_owner_host(dir(df), hash);
        return o ?: self_id(df);
}

static bool is_self(DirectoryForward *df, const char *host) {
        return strcmp(host, self_id(df)) == 0;
}

/* ---- batches to owners ---- */

static void batch_send(DirectoryForward *df, OwnerQueue *q, Batch *b) {
        uint8_t *payload = NULL;
        size_t len;
        int r;

        if (b->n == 0)
                return;
        r = directory_publish_encode(b->type, b->arena, b->worker, b->hashes, b->n, &payload, &len);
        if (r >= 0)
                r = peer_send(q->peer, b->type, payload, len);
        if (r < 0) {
                /* The owner is down or swamped: its records are lost as a cache would be;
                 * they come back when the owner set changes again (republish). */
                df->stats.send_failures++;
                log_debug_errno(r, "directory: cannot forward %zu hashes to %s: %m", b->n, peer_host_id(q->peer));
        } else if (b->type == DIRECTORY_MSG_PUBLISH)
                df->stats.published_forwarded += b->n;
        else
                df->stats.unpublished_forwarded += b->n;
        free(payload);
        b->n = 0;
}

static void flush_all(DirectoryForward *df) {
        size_t i = 0;
        void *v;

        while (hashmap_iterate(df->queues, &i, &v, NULL)) {
                OwnerQueue *q = v;
                peer_cork(q->peer);
                batch_send(df, q, &q->publish);
                batch_send(df, q, &q->unpublish);
                peer_uncork(q->peer);
        }
}

static int flush_cb(sd_event_source *s, uint64_t usec, void *userdata) {
        flush_all(userdata);
        return 0;
}

static OwnerQueue *queue_for(DirectoryForward *df, const char *host) {
        OwnerQueue *q = hashmap_get(df->queues, host);
        Peer *p;

        if (q)
                return q;
        p = peer_manager_find(df->m->peers, host);
        if (!p)
                return NULL;
        q = calloc(1, sizeof *q);
        if (!q)
                return NULL;
        q->peer = p;
        q->publish.type = DIRECTORY_MSG_PUBLISH;
        q->unpublish.type = DIRECTORY_MSG_UNPUBLISH;
        /* The peer's host id string lives as long as the peer manager. */
        if (hashmap_put(df->queues, peer_host_id(p), q) < 0) {
                free(q);
                return NULL;
        }
        return q;
}

static void enqueue(DirectoryForward *df, const char *owner, uint16_t type, uint64_t hash, const char *arena,
                    const char *worker) {
        OwnerQueue *q = queue_for(df, owner);
        Batch *b;

        if (!q) {
                df->stats.send_failures++;
                return;
        }
        if (!directory_name_is_valid(arena, false))
                arena = "";
        if (!directory_name_is_valid(worker, false))
                worker = "";
        b = type == DIRECTORY_MSG_PUBLISH ? &q->publish : &q->unpublish;
        if (b->n > 0 && (strcmp(b->arena, arena) != 0 || strcmp(b->worker, worker) != 0))
                batch_send(df, q, b);
        if (!b->hashes) {
                b->hashes = malloc(DIRECTORY_BATCH_MAX * sizeof *b->hashes);
                if (!b->hashes) {
                        df->stats.send_failures++;
                        return;
                }
        }
        snprintf(b->arena, sizeof b->arena, "%s", arena);
        snprintf(b->worker, sizeof b->worker, "%s", worker);
        b->hashes[b->n++] = hash;
        if (b->n == DIRECTORY_BATCH_MAX)
                batch_send(df, q, b);
        else if (sd_event_source_get_enabled(df->flush_timer, NULL) == 0) {
                (void)sd_event_source_set_time_relative(df->flush_timer, FLUSH_DELAY_USEC);
                (void)sd_event_source_set_enabled(df->flush_timer, SD_EVENT_ONESHOT);
        }
}

/* A local entry appeared or went (the page manager's observer). */
static void on_entry(void *userdata, bool put, uint64_t hash, const char *arena, const char *worker) {
        DirectoryForward *df = userdata;
        const char *owner = owner_of(df, hash);
        size_t oi = directory_owner(dir(df), hash);

        if (df->owned && oi < df->n_hosts) {
                if (put)
                        df->owned[oi]++;
                else if (df->owned[oi] > 0)
                        df->owned[oi]--;
        }

        tag_entry(df, hash, put ? worker : NULL);
        if (is_self(df, owner)) {
                if (put)
                        (void)directory_shard_put(df->shard, hash, owner, arena, entry_worker(df, hash));
                else
                        (void)directory_shard_del(df->shard, hash, owner, arena);
                return;
        }
        enqueue(df, owner, put ? DIRECTORY_MSG_PUBLISH : DIRECTORY_MSG_UNPUBLISH, hash, arena,
                put ? entry_worker(df, hash) : "");
}

/* ---- the owner set ---- */

static void hosts_free(char **h, size_t n) {
        for (size_t i = 0; i < n; i++)
                free(h[i]);
        free(h);
}

static void rebalance_reset(DirectoryForward *df) {
        hosts_free(df->old_hosts, df->n_old_hosts);
        df->old_hosts = NULL;
        df->n_old_hosts = 0;
        free(df->shard_keys);
        free(df->entry_keys);
        df->shard_keys = df->entry_keys = NULL;
        df->n_shard_keys = df->n_entry_keys = df->shard_done = df->entry_done = 0;
}

/* One entry of this host's directory, after the owners changed. */
static void rebalance_entry(DirectoryForward *df, uint64_t hash) {
        PagePool *pool;
        const char *arena, *owner, *was;
        size_t oi;

        if (!directory_find(dir(df), hash, &pool, NULL))
                return; /* gone since the snapshot (its removal went to the new owner) */
        oi = directory_owner(dir(df), hash);
        owner = owner_of(df, hash);
        if (oi < df->n_hosts)
                df->owned[oi]++;
        was = df->old_hosts ? df->old_hosts[directory_rendezvous((const char *const *)df->old_hosts,
                                                                 df->n_old_hosts, hash)]
                            : NULL;
        if (was && strcmp(owner, was) == 0)
                return;
        arena = page_manager_arena_of(df->m->page_manager, pool) ?: "";
        df->stats.republished++;
        if (is_self(df, owner))
                (void)directory_shard_put(df->shard, hash, owner, arena, entry_worker(df, hash));
        else
                enqueue(df, owner, DIRECTORY_MSG_PUBLISH, hash, arena, entry_worker(df, hash));
}

static int rebalance_cb(sd_event_source *s, void *userdata) {
        DirectoryForward *df = userdata;
        size_t budget = REBALANCE_STEP;

        /* First the records this host no longer owns... */
        for (; budget > 0 && df->shard_done < df->n_shard_keys; budget--, df->shard_done++) {
                uint64_t h = df->shard_keys[df->shard_done];
                if (!directory_owns(dir(df), h))
                        df->stats.records_dropped += directory_shard_forget(df->shard, h);
        }
        /* ...then this host's entries whose owner changed. */
        for (; budget > 0 && df->entry_done < df->n_entry_keys; budget--, df->entry_done++)
                rebalance_entry(df, df->entry_keys[df->entry_done]);
        flush_all(df);
        if (df->shard_done < df->n_shard_keys || df->entry_done < df->n_entry_keys)
                return sd_event_source_set_enabled(s, SD_EVENT_ONESHOT);
        rebalance_reset(df);
        return 0;
}

static int collect_key(void *userdata, uint64_t hash, PagePool *pool, PageId page) {
        DirectoryForward *df = userdata;
        df->entry_keys[df->n_entry_keys++] = hash;
        return 0;
}

/* Recomputes the owners (this host and the peers up) and starts moving what changed
 * owner, a step per loop iteration. */
static void hosts_changed(DirectoryForward *df) {
        size_t n = 1, cap = 1 + peer_manager_n_peers(df->m->peers);
        char **hosts = calloc(cap, sizeof *hosts), **old = df->hosts;
        uint64_t *owned = calloc(cap, sizeof *owned);
        size_t n_old = df->n_hosts;
        Peer *p;
        int r;

        if (!hosts || !owned || !(hosts[0] = strdup(self_id(df)))) {
                free(hosts);
                free(owned);
                log_oom();
                return;
        }
        for (size_t i = 0; (p = peer_manager_peer(df->m->peers, i)); i++)
                if (peer_is_up(p) && !(hosts[n++] = strdup(peer_host_id(p)))) {
                        hosts_free(hosts, n - 1);
                        free(owned);
                        log_oom();
                        return;
                }
        r = directory_set_hosts(dir(df), (const char *const *)hosts, n, 0);
        if (r < 0) {
                log_error_errno(r, "directory: cannot take %zu hosts as owners (%m); the owners stay those of "
                                   "the %zu hosts before.", n, n_old);
                hosts_free(hosts, n);
                free(owned);
                return;
        }
        df->hosts = hosts;
        df->n_hosts = n;
        free(df->owned);
        df->owned = owned;
        /* Each owner's share of the hash space, by a fixed sample of 1000 hashes. */
        free(df->share);
        df->share = calloc(n, sizeof *df->share);
        for (uint64_t k = 0, x = 0x9e3779b97f4a7c15ULL; df->share && k < 1000; k++) {
                x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                df->share[directory_owner(dir(df), x)]++;
        }
        /* Answers cached under the old owners may be stale now, and so may answers
         * still on their way: those are used but not cached. */
        directory_cache_clear(df->cache);
        df->owners_generation++;
        if (df->shard_keys || df->entry_keys) {
                /* A change while the last one is still being applied: its entries may sit
                 * with owners of either view. Publish every entry to its owner now. */
                rebalance_reset(df);
                hosts_free(old, n_old);
        } else {
                df->old_hosts = old;
                df->n_old_hosts = n_old;
        }
        r = directory_shard_keys(df->shard, &df->shard_keys, &df->n_shard_keys);
        if (r >= 0) {
                df->entry_keys = malloc(MAX(directory_size(dir(df)), (size_t)1) * sizeof *df->entry_keys);
                if (!df->entry_keys)
                        r = -ENOMEM;
        }
        if (r >= 0)
                r = directory_foreach(dir(df), collect_key, df);
        if (r >= 0)
                r = sd_event_source_set_enabled(df->rebalance, SD_EVENT_ONESHOT);
        if (r < 0) {
                log_warning_errno(r, "directory: cannot move records to the new owners: %m");
                rebalance_reset(df);
        }
}

/* ---- locates ---- */

static void add_self(DirectoryForward *df, DirectoryAnswerEntry *e);

static Locate *locate_free(Locate *l) {
        if (!l)
                return NULL;
        sd_event_source_disable_unref(l->timer);
        free(l->res.entries);
        free(l->missing);
        free(l);
        return NULL;
}

static void part_free(DirectoryForward *df, LookupPart *part) {
        (void)hashmap_remove(df->parts, &part->request);
        free(part->index);
        free(part);
}

/* Up to n request ids of the parts sent to peer p, or of locate l, from the map's start.
 * The callers free them a batch at a time (each looked up again: a locate's end may
 * free others), not restarting the walk after each removal: O(parts) a batch, where a
 * peer going down with 1024 locates out walked the map 1024 times. */
#define PARTS_BATCH 64
static size_t parts_matching(DirectoryForward *df, const Peer *p, const Locate *l, uint64_t ids[static PARTS_BATCH]) {
        size_t i = 0, k = 0;
        void *v;
        while (k < PARTS_BATCH && hashmap_iterate(df->parts, &i, &v, NULL)) {
                const LookupPart *part = v;
                if ((p && part->peer == p) || (l && part->locate == l))
                        ids[k++] = part->request;
        }
        return k;
}

static void locate_finish(Locate *l) {
        DirectoryForward *df = l->df;
        uint64_t ids[PARTS_BATCH];

        /* Parts still out: their owners count as missing. */
        for (size_t k; l->pending > 0 && (k = parts_matching(df, NULL, l, ids)) > 0;)
                for (size_t j = 0; j < k; j++) {
                        LookupPart *part = hashmap_get(df->parts, &ids[j]);
                        if (!part)
                                continue;
                        locate_missing(l, part->owner);
                        l->pending--;
                        df->stats.remote_timeouts++;
                        part_free(df, part);
                }
        /* This host's own blocks, from its directory: exact, whoever owns them. */
        for (size_t k = 0; k < l->res.n; k++)
                add_self(df, l->res.entries + k);
        df->n_locates--;
        df->locate_hashes -= l->res.n;
        l->waiter->done(l->waiter, &l->res);
        locate_free(l);
}

static int locate_timeout(sd_event_source *s, uint64_t usec, void *userdata) {
        locate_finish(userdata);
        return 0;
}

/* This host as a holder of e's block exactly when its directory has it: added, or a
 * stale entry (from a remote owner's answer or the answer cache) dropped. */
static void add_self(DirectoryForward *df, DirectoryAnswerEntry *e) {
        PagePool *pool;

        if (!directory_find(dir(df), e->hash, &pool, NULL)) {
                directory_answer_set_self(e, self_id(df), NULL, NULL);
                return;
        }
        directory_answer_set_self(e, self_id(df), page_manager_arena_of(df->m->page_manager, pool) ?: "",
                                  entry_worker(df, e->hash));
}

static int send_part(DirectoryForward *df, Locate *l, Peer *p, size_t owner, const size_t *index, size_t n) {
        LookupPart *part = calloc(1, sizeof *part);
        uint64_t *hashes = malloc(n * sizeof *hashes);
        uint8_t *payload = NULL;
        size_t len;
        int r;

        if (!part || !hashes || !(part->index = malloc(n * sizeof *part->index))) {
                free(part);
                free(hashes);
                return -ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
                part->index[i] = index[i];
                hashes[i] = l->res.entries[index[i]].hash;
        }
        part->n = n;
        part->peer = p;
        part->owner = owner;
        part->locate = l;
        part->owners_generation = df->owners_generation;
        part->request = ++df->next_request;
        r = directory_lookup_encode(part->request, hashes, n, &payload, &len);
        free(hashes);
        if (r >= 0)
                r = hashmap_put(df->parts, &part->request, part);
        if (r < 0) {
                free(payload);
                free(part->index);
                free(part);
                return r;
        }
        r = peer_send(p, DIRECTORY_MSG_LOOKUP, payload, len);
        free(payload);
        if (r < 0) {
                part_free(df, part);
                return r;
        }
        l->pending++;
        df->stats.remote_queries++;
        return 0;
}

int directory_forward_locate(DirectoryForward *df, const uint64_t *hashes, size_t n, DirectoryLocateWaiter *w) {
        usec_t now = now_usec(CLOCK_MONOTONIC);
        size_t *todo = NULL, *owner_of_todo = NULL, n_todo = 0;
        Locate *l;
        int r = 0;

        if (!df || !w || n == 0 || n > DIRECTORY_LOCATE_HASHES_MAX || !hashes)
                return -EINVAL;
        if (df->n_locates >= DIRECTORY_LOCATES_MAX || df->locate_hashes + n > DIRECTORY_LOCATE_HASHES_IN_FLIGHT_MAX)
                return -EBUSY;
        l = calloc(1, sizeof *l);
        if (l) {
                l->n_owners = df->n_hosts;
                l->missing = calloc(DIV_ROUND_UP(MAX(df->n_hosts, (size_t)1), 64), sizeof *l->missing);
        }
        if (!l || !l->missing || !(l->res.entries = calloc(n, sizeof *l->res.entries)) ||
            !(todo = malloc(n * sizeof *todo)) || !(owner_of_todo = malloc(n * sizeof *owner_of_todo))) {
                locate_free(l);
                free(todo);
                return -ENOMEM;
        }
        l->df = df;
        l->waiter = w;
        l->res.n = n;
        df->stats.lookups++;
        for (size_t i = 0; i < n; i++) {
                DirectoryAnswerEntry *e = l->res.entries + i;
                const char *owner = owner_of(df, hashes[i]);

                e->hash = hashes[i];
                if (is_self(df, owner))
                        directory_shard_get(df->shard, hashes[i], e);
                else if (directory_cache_get(df->cache, hashes[i], now, e))
                        df->stats.cache_hits++;
                else {
                        df->stats.cache_misses++;
                        /* The owner's index in hosts[], so that parts group by owner. */
                        owner_of_todo[n_todo] = directory_owner(dir(df), hashes[i]);
                        todo[n_todo++] = i;
                }
        }
        /* One LOOKUP (or a few, of at most DIRECTORY_LOOKUP_MAX) per remote owner. */
        for (size_t o = 0; o < df->n_hosts && n_todo > 0; o++) {
                size_t batch[DIRECTORY_LOOKUP_MAX], k = 0;
                Peer *p = o == 0 ? NULL : peer_manager_find(df->m->peers, df->hosts[o]);

                for (size_t t = 0; t < n_todo; t++) {
                        if (owner_of_todo[t] != o)
                                continue;
                        batch[k++] = todo[t];
                        if (k == DIRECTORY_LOOKUP_MAX || t == n_todo - 1) {
                                if (!p || send_part(df, l, p, o, batch, k) < 0)
                                        locate_missing(l, o);
                                k = 0;
                        }
                }
                if (k > 0 && (!p || send_part(df, l, p, o, batch, k) < 0))
                        locate_missing(l, o);
        }
        free(todo);
        free(owner_of_todo);
        df->n_locates++;
        df->locate_hashes += n;
        if (l->pending == 0) {
                locate_finish(l);
                return 0;
        }
        r = sd_event_add_time_relative(df->m->event, &l->timer, CLOCK_MONOTONIC, DIRECTORY_LOCATE_TIMEOUT_USEC, 0,
                                       locate_timeout, l);
        if (r < 0)
                locate_finish(l); /* give up on the remote answers rather than wait without a bound */
        return 0;
}

/* ---- messages from peers ---- */

static void on_publish(DirectoryForward *df, Peer *p, const DirectoryMessage *msg) {
        for (uint32_t i = 0; i < msg->count; i++) {
                uint64_t h = msg->hashes[i];
                /* The sender's view of the owners may be ahead of ours (a member just came
                 * up): keep the record anyway; the next owner change prunes what is not
                 * ours once both views agree. */
                if (!directory_owns(dir(df), h))
                        df->stats.misdirected++;
                if (msg->type == DIRECTORY_MSG_PUBLISH) {
                        if (directory_shard_put(df->shard, h, peer_host_id(p), msg->arena, msg->worker) >= 0)
                                df->stats.records_received++;
                } else
                        (void)directory_shard_del(df->shard, h, peer_host_id(p), msg->arena);
        }
}

static void on_lookup(DirectoryForward *df, Peer *p, const DirectoryMessage *msg) {
        DirectoryAnswerEntry *e = calloc(msg->count, sizeof *e);
        uint8_t *payload = NULL;
        size_t len;
        int r;

        if (!e) {
                log_oom();
                return; /* the asker's timeout covers it */
        }
        for (uint32_t i = 0; i < msg->count; i++) {
                e[i].hash = msg->hashes[i];
                if (directory_owns(dir(df), msg->hashes[i]))
                        directory_shard_get(df->shard, msg->hashes[i], e + i);
                add_self(df, e + i);
        }
        r = directory_answer_encode(msg->request, e, msg->count, &payload, &len);
        if (r >= 0)
                r = peer_send(p, DIRECTORY_MSG_ANSWER, payload, len);
        if (r < 0)
                log_debug_errno(r, "directory: cannot answer %s: %m", peer_host_id(p));
        free(payload);
        free(e);
}

static void on_answer(DirectoryForward *df, Peer *p, const DirectoryMessage *msg) {
        LookupPart *part = hashmap_get(df->parts, &msg->request);
        usec_t now = now_usec(CLOCK_MONOTONIC);
        Locate *l;

        if (!part || part->peer != p || part->n != msg->count) {
                df->stats.misdirected++;
                return; /* late (timed out), or not ours */
        }
        l = part->locate;
        for (size_t i = 0; i < part->n; i++)
                if (l->res.entries[part->index[i]].hash != msg->entries[i].hash) {
                        df->stats.misdirected++;
                        return; /* the part stays out and times out */
                }
        bool cache = part->owners_generation == df->owners_generation;
        for (size_t i = 0; i < part->n; i++) {
                l->res.entries[part->index[i]] = msg->entries[i];
                if (cache)
                        (void)directory_cache_put(df->cache, msg->entries + i, now, df->cache_ttl);
        }
        df->stats.remote_answers++;
        part_free(df, part);
        if (--l->pending == 0)
                locate_finish(l);
}

static int on_message(Peer *p, uint16_t type, const void *payload, size_t len, void *userdata) {
        DirectoryForward *df = userdata;
        DirectoryMessage msg;
        int r;

        r = directory_message_parse(type, payload, len, &msg);
        if (r == -EPROTONOSUPPORT) {
                log_debug("directory: %s speaks a newer directory protocol; message dropped", peer_host_id(p));
                return 0;
        }
        if (r < 0)
                return r; /* a malformed frame ends the session, as for every protocol error */
        switch (type) {
        case DIRECTORY_MSG_PUBLISH:
        case DIRECTORY_MSG_UNPUBLISH:
                on_publish(df, p, &msg);
                break;
        case DIRECTORY_MSG_LOOKUP:
                on_lookup(df, p, &msg);
                break;
        case DIRECTORY_MSG_ANSWER:
                on_answer(df, p, &msg);
                break;
        }
        directory_message_done(&msg);
        return 0;
}

/* A peer went up or down: the owners change. One that went down takes its records and
 * its queued batches with it, and its lookups in flight count as unanswered. */
static void on_peer_state(Peer *p, bool up, void *userdata) {
        DirectoryForward *df = userdata;

        if (!up) {
                OwnerQueue *q = hashmap_remove(df->queues, peer_host_id(p));
                uint64_t ids[PARTS_BATCH];

                if (q) {
                        free(q->publish.hashes);
                        free(q->unpublish.hashes);
                        free(q);
                }
                df->stats.records_dropped += directory_shard_drop_host(df->shard, peer_host_id(p));
                for (size_t k; (k = parts_matching(df, p, NULL, ids)) > 0;)
                        for (size_t j = 0; j < k; j++) {
                                LookupPart *part = hashmap_get(df->parts, &ids[j]);
                                if (!part)
                                        continue;
                                Locate *l = part->locate;
                                locate_missing(l, part->owner);
                                part_free(df, part);
                                if (--l->pending == 0)
                                        locate_finish(l);
                        }
        }
        hosts_changed(df);
}

/* ---- accessors ---- */

void directory_forward_stats(DirectoryForward *df, DirectoryForwardStats *ret) {
        *ret = df ? df->stats : (DirectoryForwardStats){};
}

size_t directory_forward_records(DirectoryForward *df) {
        return df ? directory_shard_records(df->shard) : 0;
}

const char *const *directory_forward_hosts(DirectoryForward *df, size_t *ret_n) {
        *ret_n = df ? df->n_hosts : 0;
        return df ? (const char *const *)df->hosts : NULL;
}

uint32_t directory_forward_share_permille(DirectoryForward *df, const char *host) {
        for (size_t i = 0; df && df->share && i < df->n_hosts; i++)
                if (strcmp(df->hosts[i], host) == 0)
                        return df->share[i];
        return 0;
}

uint64_t directory_forward_entries_owned_by(DirectoryForward *df, const char *host) {
        for (size_t i = 0; df && df->owned && i < df->n_hosts; i++)
                if (strcmp(df->hosts[i], host) == 0)
                        return df->owned[i];
        return 0;
}

/* ---- subsystem ---- */

static DirectoryForward *forward_free(DirectoryForward *df) {
        size_t i = 0;
        void *v;

        if (!df)
                return NULL;
        if (df->m->page_manager)
                page_manager_set_directory_observer(df->m->page_manager, NULL, NULL);
        /* Locates in flight end now, unanswered. */
        while (df->parts && hashmap_size(df->parts) > 0) {
                i = 0;
                if (!hashmap_iterate(df->parts, &i, &v, NULL))
                        break;
                locate_finish(((LookupPart *)v)->locate);
        }
        i = 0;
        while (df->queues && hashmap_iterate(df->queues, &i, &v, NULL)) {
                OwnerQueue *q = v;
                free(q->publish.hashes);
                free(q->unpublish.hashes);
                free(q);
        }
        hashmap_free(df->queues);
        hashmap_free(df->parts);
        i = 0;
        while (df->tags && hashmap_iterate(df->tags, &i, &v, NULL))
                free(v);
        hashmap_free(df->tags);
        i = 0;
        while (df->names && hashmap_iterate(df->names, &i, &v, NULL)) {
                WorkerName *n = v;
                free(n->name);
                free(n);
        }
        hashmap_free(df->names);
        hosts_free(df->hosts, df->n_hosts);
        rebalance_reset(df);
        free(df->owned);
        free(df->share);
        sd_event_source_disable_unref(df->rebalance);
        sd_event_source_disable_unref(df->flush_timer);
        directory_shard_free(df->shard);
        directory_cache_free(df->cache);
        free(df);
        return NULL;
}

static int directory_forward_init(Manager *m) {
        DirectoryForward *df;
        int r;

        if (!m->page_manager)
                return 0;
        df = calloc(1, sizeof *df);
        if (!df)
                return -ENOMEM;
        df->m = m;
        df->cache_ttl = m->config.directory_cache_usec;
        df->tags = hashmap_new(HASHMAP_KEY_U64, 0);
        df->names = hashmap_new(HASHMAP_KEY_STRING, 0);
        df->queues = hashmap_new(HASHMAP_KEY_STRING, 0);
        df->parts = hashmap_new(HASHMAP_KEY_U64, 0);
        if (!df->tags || !df->names || !df->queues || !df->parts) {
                forward_free(df);
                return -ENOMEM;
        }
        r = directory_shard_new(&df->shard, DIRECTORY_SHARD_RECORDS_MAX);
        if (r >= 0)
                r = directory_cache_new(&df->cache, DIRECTORY_CACHE_MAX);
        if (r >= 0)
                r = sd_event_add_time_relative(m->event, &df->flush_timer, CLOCK_MONOTONIC, FLUSH_DELAY_USEC, 0,
                                               flush_cb, df);
        if (r >= 0)
                r = sd_event_source_set_enabled(df->flush_timer, SD_EVENT_OFF);
        if (r >= 0)
                r = sd_event_add_defer(m->event, &df->rebalance, rebalance_cb, df);
        if (r >= 0)
                r = sd_event_source_set_enabled(df->rebalance, SD_EVENT_OFF);
        if (r >= 0 && m->peers) {
                r = peer_manager_register_handler(m->peers, DIRECTORY_MSG_FIRST, DIRECTORY_MSG_LAST, on_message, df);
                if (r >= 0)
                        r = peer_manager_add_state_handler(m->peers, on_peer_state, df);
        }
        if (r < 0) {
                forward_free(df);
                return log_error_errno(r, "directory: cannot set up the cluster-wide directory: %m");
        }
        m->directory_forward = df;
        page_manager_set_directory_observer(m->page_manager, on_entry, df);
        hosts_changed(df); /* this host alone until peers come up */
        return 0;
}

static void directory_forward_done(Manager *m) {
        m->directory_forward = forward_free(m->directory_forward);
}

static int directory_forward_reload(Manager *m, const Config *n) {
        if (m->directory_forward)
                m->directory_forward->cache_ttl = n->directory_cache_usec;
        return 0;
}

const Subsystem directory_subsystem = {
        .name = "directory",
        .init = directory_forward_init,
        .done = directory_forward_done,
        .reload = directory_forward_reload,
};
