/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* PagePool: the fixed-size page allocator of one arena. Pure bookkeeping: it never
 * touches the arena's bytes (copies go through callbacks), so it works the same for
 * host and GPU arenas, and unit tests drive it directly.
 *
 * Every page has a reference count (sequences and pins that hold it) and a lease count
 * (transfers and offloads in flight that read or write it), and may be "cached": held
 * by a block directory entry (directory.h) through a pointer stored here. A page is in
 * exactly one of three states:
 *
 *   FREE     refs = 0, leases = 0, not cached   on the free stack, allocatable
 *   LIVE     refs > 0 or leases > 0             someone uses it
 *   IDLE     refs = 0, leases = 0, cached       kept only by the directory; on the LRU
 *                                               queue (least recently released first)
 *
 * A page returns to FREE only when refs AND leases are both zero and no directory entry
 * holds it: a lease keeps a page alive after its last reference is dropped. Alloc and
 * free are O(1) (a LIFO stack of page ids threaded through the page array); there is no
 * fragmentation because every page has the same size. When the free stack is empty,
 * alloc asks the eviction callback (the directory: it evicts IDLE pages, LRU first)
 * before it fails with -ENOSPC. LIVE pages (pinned, referenced or leased) are never on
 * the LRU queue, so they cannot be evicted. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef uint32_t PageId;
#define PAGE_ID_INVALID UINT32_MAX
#define PAGE_POOL_PAGES_MAX (UINT32_MAX - 1)
#define PAGE_REFS_MAX (UINT32_MAX - 1)

typedef struct PagePool PagePool;

/* Asked to free up to `want` pages; returns how many it freed (0 if it could not). */
typedef size_t (*PageEvictFn)(PagePool *pool, size_t want, void *userdata);

/* Copies `length` bytes inside the pool's arena, from arena offset `src` to `dst`.
 * Host arenas use memcpy; GPU arenas a CUDA copy. Returns 0 or negative errno. */
typedef int (*PageCopyFn)(void *userdata, uint64_t dst, uint64_t src, uint64_t length);
/* The same for n pages at once, finishing later: 0 when queued (done(done_userdata,
 * error) follows exactly once, on the caller's event loop), a negative errno when
 * nothing was queued (done never runs). */
typedef void (*PageCopyDoneFn)(void *userdata, int error);
typedef int (*PageCopyAsyncFn)(void *userdata, uint32_t arena, const uint64_t *dst, const uint64_t *src,
                               size_t n, uint64_t length, PageCopyDoneFn done, void *done_userdata);

typedef struct PagePoolStats {
        uint64_t total;         /* pages in the pool */
        uint64_t free;          /* FREE */
        uint64_t cached_idle;   /* IDLE: evictable */
        uint64_t live;          /* LIVE (total - free - cached_idle) */
        uint64_t cached;        /* held by a directory entry (IDLE or LIVE) */
        uint64_t shared;        /* refs >= 2 */
        uint64_t leased;        /* leases >= 1 */
        uint64_t refs;          /* sum of all refs */
        uint64_t leases;        /* sum of all leases */
        uint64_t page_size;
        uint64_t bytes_saved;   /* (refs - pages with refs > 0) × page_size: what sharing saves */
        uint64_t allocs;
        uint64_t frees;         /* returns to FREE */
        uint64_t alloc_failures;
        uint64_t evictions;     /* IDLE pages freed through page_pool_evict_lru() */
        uint64_t cow_copies;    /* pages copied by copy-on-write (sequence.h) */
        uint64_t cow_bytes;
} PagePoolStats;

/* A pool of n_pages pages of page_size bytes; page i lives at arena offset
 * base_offset + i × page_size. -EINVAL for 0 pages or size, -ERANGE on overflow. */
int page_pool_new(uint64_t n_pages, uint64_t page_size, uint64_t base_offset, PagePool **ret);
/* Frees the bookkeeping. Pages still LIVE or cached are reported by
 * page_pool_retained() beforehand; freeing a pool does not care. */
PagePool *page_pool_free(PagePool *pool);

void page_pool_set_evict(PagePool *pool, PageEvictFn fn, void *userdata);

uint64_t page_pool_size(const PagePool *pool);
uint64_t page_pool_page_size(const PagePool *pool);
uint64_t page_pool_free_count(const PagePool *pool);
/* Pages not FREE (LIVE + IDLE). */
uint64_t page_pool_retained(const PagePool *pool);
void page_pool_stats(const PagePool *pool, PagePoolStats *ret);

/* Allocates one page with refs = 1, leases = 0. -ENOSPC when none is free and the
 * eviction callback freed none. */
int page_pool_alloc(PagePool *pool, PageId *ret);
/* Allocates n pages, all or nothing (on -ENOSPC none stays allocated). */
int page_pool_alloc_many(PagePool *pool, size_t n, PageId *ret);
/* Whether n pages could be allocated now, counting IDLE pages as available. */
bool page_pool_can_alloc(const PagePool *pool, size_t n);

/* Is id a valid page that is LIVE or IDLE (i.e. not FREE)? */
bool page_is_allocated(const PagePool *pool, PageId id);
/* refs/leases of a page (0 for invalid ids). */
uint32_t page_refs(const PagePool *pool, PageId id);
uint32_t page_leases(const PagePool *pool, PageId id);
/* Written by its one holder only: refs == 1, leases == 0, not cached. */
bool page_is_exclusive(const PagePool *pool, PageId id);

/* Takes a reference on a LIVE or IDLE page (an IDLE page becomes LIVE: a pin).
 * -ESTALE for a FREE page, -EINVAL for an id out of range, -EOVERFLOW past PAGE_REFS_MAX. */
int page_ref(PagePool *pool, PageId id);
/* Drops a reference. Returns the refs left, -ESTALE if it had none, -EINVAL for a bad id. */
int page_unref(PagePool *pool, PageId id);
/* Leases a LIVE or IDLE page; same errors as page_ref(). */
int page_lease(PagePool *pool, PageId id);
/* Ends a lease. Returns the leases left, -ESTALE if it had none. */
int page_unlease(PagePool *pool, PageId id);

/* Byte offset of page id in its arena (UINT64_MAX for an invalid id). */
uint64_t page_offset(const PagePool *pool, PageId id);
/* The page at an arena offset (exact page start), or PAGE_ID_INVALID. */
PageId page_from_offset(const PagePool *pool, uint64_t offset);

/* Directory hooks. page_set_cached() marks a LIVE page as held by `entry` (-EBUSY if it
 * is cached already, -ESTALE if it is not LIVE). page_clear_cached() drops that hold;
 * an IDLE page becomes FREE. page_cached_entry() returns the entry or NULL. */
int page_set_cached(PagePool *pool, PageId id, void *entry);
int page_clear_cached(PagePool *pool, PageId id);
void *page_cached_entry(const PagePool *pool, PageId id);
/* Frees the least recently released IDLE page: returns its directory entry through
 * *ret_entry (the caller forgets it) and the page through *ret_id. -ENOENT if there is
 * no IDLE page. */
int page_pool_evict_lru(PagePool *pool, PageId *ret_id, void **ret_entry);
/* The directory entry of the page page_pool_evict_lru() would free next, or NULL. */
void *page_pool_lru_peek(const PagePool *pool);

/* Copy-on-write accounting, called by sequence.c. */
void page_pool_count_cow(PagePool *pool, uint64_t pages);

/* Rebuilds a pool that nobody used yet from the reference count of every page (n_pages
 * entries, e.g. counted over the sequences a WAL replay restored): pages with refs 0 go
 * back on the free stack, the others are LIVE with those refs and no lease. -EBUSY if
 * the pool is in use already, -EOVERFLOW for a count past PAGE_REFS_MAX. */
int page_pool_restore(PagePool *pool, const uint32_t *refs);

/* The records that free pages (a sequence's DEL, a Truncate's PUT, an eviction's DEL)
 * may not be durable yet when the daemon writes into the pages they freed: a crash would
 * bring the old owner back over the new bytes. page_pool_set_durable() gives the pool
 * the check (NULL: none, nothing waits); page_pool_mark_frees() says that every page
 * freed so far and not marked yet is covered by the record `stamp` (an LSN, UINT64_MAX:
 * one that never will be durable); page_pool_pages_settled() whether the marks of every
 * page of ids (handed out now, or still free) are durable (asked oldest first, up to
 * the first that is not: marks settle in order). A page never freed, or freed before
 * page_pool_restore(), is settled. Pages freed since the last settled mark are handed
 * out only when no settled page is free. */
typedef bool (*PageDurableFn)(void *userdata, uint64_t stamp);
void page_pool_set_durable(PagePool *pool, PageDurableFn fn, void *userdata);
void page_pool_mark_frees(PagePool *pool, uint64_t stamp);
bool page_pool_pages_settled(PagePool *pool, const PageId *ids, size_t n);

/* Walks every page and checks the counters and the free/LRU lists against the pages'
 * states: returns 0 or -EUCLEAN. For tests and `epdctl pages --check`; O(n). */
int page_pool_verify(const PagePool *pool);
