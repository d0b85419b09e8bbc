/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The block directory: block hash → cached page, for prefix reuse across requests and
 * agent steps. A block hash is the chained hash that the worker computes over token ids
 * (as vLLM does: hash(parent hash, tokens of the block, extra keys)), so a whole prefix
 * is identified by the hash of its last block and the lookup of a chain of n hashes is
 * a walk of at most n table probes that stops at the first miss: linear in the chain's
 * length whatever the tokens are (no substring search, nothing quadratic).
 *
 * An entry holds its page "cached" in the page's pool (pages.h): while no sequence,
 * pin or lease holds the page it is IDLE, on the pool's LRU queue, and the directory is
 * the pool's eviction callback: when an arena runs short, the least recently released
 * IDLE pages are evicted and their entries forgotten. Pinned (referenced) and leased
 * pages are LIVE and never evicted.
 *
 * Each hash has an owner host, chosen by rendezvous hashing over the live hosts
 * (deterministic on every host; a single host owns all); the owner keeps the
 * cluster-wide record of who caches the block (directory-shard.h, docs/cluster.md).
 * Pure; unit-tested. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pages/pages.h"

/* This host, up to 256 [Peer:] sections and up to PEER_MEMBERS_MAX (1024) members. */
#define DIRECTORY_HOSTS_MAX 2048
#define DIRECTORY_CHAIN_MAX (UINT32_C(1) << 20) /* hashes in one lookup or publish */

typedef struct Directory Directory;

typedef struct DirectoryStats {
        uint64_t entries;
        uint64_t lookups;      /* lookup calls */
        uint64_t hits;         /* blocks found (and pinned) */
        uint64_t misses;       /* lookups that stopped before the end of their chain */
        uint64_t inserts;
        uint64_t conflicts;    /* inserts refused: hash present, or page cached already */
        uint64_t removals;     /* explicit removals and pool teardown */
        uint64_t evictions;    /* entries dropped by LRU eviction */
        uint64_t evictions_refused; /* evictions not made: the journal refused the removal */
        uint64_t probes;       /* hash table probes by lookups (linearity checks) */
} DirectoryStats;

int directory_new(Directory **ret);
/* Forgets every entry (their IDLE pages become FREE) and frees the directory. */
Directory *directory_free(Directory *d);

/* Makes the directory the eviction callback of pool. */
void directory_attach_pool(Directory *d, PagePool *pool);
/* Forgets every entry of pool and detaches from it (before the pool is freed). */
void directory_detach_pool(Directory *d, PagePool *pool);

/* The hosts (host ids) that own hashes, and which of them this host is. Copies the
 * strings. n = 0 means this host alone. -EINVAL for self >= n or n > DIRECTORY_HOSTS_MAX. */
int directory_set_hosts(Directory *d, const char *const *host_ids, size_t n, size_t self);
/* Rendezvous (highest random weight) hashing: the index of the host of hosts[0..n)
 * that owns hash; the same on every host whatever the order of the list. */
size_t directory_rendezvous(const char *const *hosts, size_t n, uint64_t hash);
/* Index of the host that owns hash (0 when no hosts are configured). */
size_t directory_owner(const Directory *d, uint64_t hash);
/* The owner's host id, or NULL when no hosts are configured (this host owns all). */
const char *directory_owner_host(const Directory *d, uint64_t hash);
bool directory_owns(const Directory *d, uint64_t hash);

/* Journaling (directory-record.h, docs/wal.md): fn is called for every entry that
 * appears (put = true) or goes (put = false: removal, LRU eviction, pool teardown),
 * before the call that did it returns and, for an eviction, before the page is
 * reused. A put whose journaling fails is undone and the error returned. */
typedef int (*DirectoryJournalFn)(void *userdata, bool put, uint64_t hash, PagePool *pool, PageId page);
void directory_set_journal(Directory *d, DirectoryJournalFn fn, void *userdata);

/* Calls fn for every entry (snapshots). A negative return stops and is returned. */
int directory_foreach(Directory *d, int (*fn)(void *userdata, uint64_t hash, PagePool *pool, PageId page),
                      void *userdata);

/* Records hash → page. The page must be LIVE in pool (the caller holds it); the entry
 * then keeps it cached after the caller lets go. -EEXIST if hash is present already
 * (the first page stays: blocks with equal hashes hold equal KV), -EBUSY if the page is
 * cached under another hash, -ESTALE if the page is not LIVE, -EINVAL for a foreign
 * pool. */
int directory_insert(Directory *d, PagePool *pool, uint64_t hash, PageId page);
/* Inserts hashes[i] → pages[i] for i < n, skipping the ones that conflict; returns the
 * number inserted, or a negative errno for bad arguments (nothing inserted), or for
 * running out of memory or a journal that fails (what was inserted before stays). */
int directory_insert_chain(Directory *d, PagePool *pool, const uint64_t *hashes,
                           const PageId *pages, size_t n);

/* Looks up the chain hashes[0..n) and returns the longest prefix cached in pool: its
 * length in *ret_len and its pages in ret_pages[] (room for n). Each returned page is
 * pinned for the caller (one reference, page_ref()), which the caller owns and drops
 * with page_unref() (or hands to a sequence: sequence_new_from_pages() then unref).
 * Stops at the first hash that is missing or cached in another pool. */
int directory_lookup(Directory *d, PagePool *pool, const uint64_t *hashes, size_t n,
                     PageId *ret_pages, size_t *ret_len);
/* Whether hash is cached here, and where (either may be NULL); nothing is pinned. */
bool directory_find(Directory *d, uint64_t hash, PagePool **ret_pool, PageId *ret_page);
/* Length of the cached prefix without pinning anything. */
size_t directory_match_len(Directory *d, PagePool *pool, const uint64_t *hashes, size_t n);

/* Forgets one hash (-ENOENT if absent). */
int directory_remove(Directory *d, uint64_t hash);
/* Forgets everything. */
void directory_clear(Directory *d);

size_t directory_size(const Directory *d);
void directory_stats(const Directory *d, DirectoryStats *ret);
/* Counts entries whose page does not point back at them or is FREE (orphans): 0 when
 * consistent. O(entries). */
size_t directory_orphans(const Directory *d);
