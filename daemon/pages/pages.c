/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/pages.h"

#include <errno.h>
#include <stdlib.h>

#include "macro.h"

typedef struct Page {
        uint32_t refs;
        uint32_t leases;
        /* FREE: next on the free stack or the quarantine. IDLE: neighbours on the LRU
         * queue. */
        PageId next, prev;
        void *cached; /* directory entry holding this page, or NULL */
        uint64_t freed_at; /* the pool's `frees` when it last became FREE (0: never); kept
                            * when it is handed out again */
} Page;

/* The pool's frees up to `frees` are covered by the record `stamp` (page_pool_mark_frees()). */
typedef struct FreeMark {
        uint64_t frees, stamp;
} FreeMark;

/* Marks kept apart at most: beyond, the newest takes the frees of the next (a later
 * stamp for them: they settle later, never early). */
#define FREE_MARKS_MAX 64U

struct PagePool {
        Page *pages;
        uint32_t n_pages;
        uint64_t page_size;
        uint64_t base_offset;

        /* FREE pages: the stack of those whose freeing record is known durable, handed
         * out last freed first (warm in the caches, mapped by the workers already), and
         * with a durability check set (page_pool_set_durable()) the quarantine of those
         * freed since, oldest first, which move to the stack as their marks settle and
         * are handed out only when the stack is empty (page_pool_pages_settled() then
         * says the caller must wait). */
        PageId free_top;
        PageId q_head, q_tail;
        uint64_t n_quarantined;
        PageDurableFn durable;
        void *durable_userdata;
        PageId lru_first, lru_last; /* IDLE queue, first = least recently released */

        PageEvictFn evict;
        void *evict_userdata;

        uint64_t n_free, n_idle, n_cached, n_shared, n_leased, n_referenced;
        uint64_t refs, leases;
        uint64_t allocs, frees, alloc_failures, evictions, cow_copies;

        FreeMark marks[FREE_MARKS_MAX]; /* oldest first, ring of marks_n from marks_head */
        unsigned marks_head, marks_n;
        uint64_t marked_frees;            /* frees a mark covers */
        uint64_t settled_frees;           /* frees whose mark's record is durable */
};

int page_pool_new(uint64_t n_pages, uint64_t page_size, uint64_t base_offset, PagePool **ret) {
        uint64_t span, end;

        if (!ret || n_pages == 0 || page_size == 0)
                return -EINVAL;
        if (n_pages > PAGE_POOL_PAGES_MAX || MUL_OVERFLOW(n_pages, page_size, &span) ||
            ADD_OVERFLOW(span, base_offset, &end) || n_pages > SIZE_MAX / sizeof(Page))
                return -ERANGE;

        PagePool *p = calloc(1, sizeof *p);
        if (!p)
                return -ENOMEM;
        p->pages = malloc(n_pages * sizeof(Page));
        if (!p->pages) {
                free(p);
                return -ENOMEM;
        }
        p->n_pages = (uint32_t)n_pages;
        p->page_size = page_size;
        p->base_offset = base_offset;

        /* The stack hands out low ids first, which keeps fresh sequences contiguous. */
        for (uint32_t i = 0; i < p->n_pages; i++)
                p->pages[i] = (Page){ .next = i + 1 < p->n_pages ? i + 1 : PAGE_ID_INVALID,
                                      .prev = PAGE_ID_INVALID };
        p->free_top = 0;
        p->q_head = p->q_tail = PAGE_ID_INVALID;
        p->n_free = n_pages;
        p->lru_first = p->lru_last = PAGE_ID_INVALID;
        *ret = p;
        return 0;
}

PagePool *page_pool_free(PagePool *pool) {
        if (!pool)
                return NULL;
        free(pool->pages);
        free(pool);
        return NULL;
}

void page_pool_set_evict(PagePool *pool, PageEvictFn fn, void *userdata) {
        pool->evict = fn;
        pool->evict_userdata = userdata;
}

uint64_t page_pool_size(const PagePool *pool) {
        return pool ? pool->n_pages : 0;
}

uint64_t page_pool_page_size(const PagePool *pool) {
        return pool ? pool->page_size : 0;
}

uint64_t page_pool_free_count(const PagePool *pool) {
        return pool ? pool->n_free : 0;
}

uint64_t page_pool_retained(const PagePool *pool) {
        return pool ? pool->n_pages - pool->n_free : 0;
}

void page_pool_stats(const PagePool *pool, PagePoolStats *ret) {
        *ret = (PagePoolStats){
                .total = pool->n_pages,
                .free = pool->n_free,
                .cached_idle = pool->n_idle,
                .live = pool->n_pages - pool->n_free - pool->n_idle,
                .cached = pool->n_cached,
                .shared = pool->n_shared,
                .leased = pool->n_leased,
                .refs = pool->refs,
                .leases = pool->leases,
                .page_size = pool->page_size,
                .bytes_saved = (pool->refs - pool->n_referenced) * pool->page_size,
                .allocs = pool->allocs,
                .frees = pool->frees,
                .alloc_failures = pool->alloc_failures,
                .evictions = pool->evictions,
                .cow_copies = pool->cow_copies,
                .cow_bytes = pool->cow_copies * pool->page_size,
        };
}

static inline bool page_valid(const PagePool *pool, PageId id) {
        return pool && id < pool->n_pages;
}

static inline bool page_state_free(const Page *p) {
        return p->refs == 0 && p->leases == 0 && !p->cached;
}

static inline bool page_state_idle(const Page *p) {
        return p->refs == 0 && p->leases == 0 && p->cached;
}

static void lru_push(PagePool *pool, PageId id) {
        Page *p = &pool->pages[id];
        p->next = PAGE_ID_INVALID;
        p->prev = pool->lru_last;
        if (pool->lru_last != PAGE_ID_INVALID)
                pool->pages[pool->lru_last].next = id;
        else
                pool->lru_first = id;
        pool->lru_last = id;
        pool->n_idle++;
}

static void lru_remove(PagePool *pool, PageId id) {
        Page *p = &pool->pages[id];
        if (p->prev != PAGE_ID_INVALID)
                pool->pages[p->prev].next = p->next;
        else
                pool->lru_first = p->next;
        if (p->next != PAGE_ID_INVALID)
                pool->pages[p->next].prev = p->prev;
        else
                pool->lru_last = p->prev;
        p->next = p->prev = PAGE_ID_INVALID;
        pool->n_idle--;
}

static void stack_push(PagePool *pool, PageId id) {
        Page *p = &pool->pages[id];
        p->prev = PAGE_ID_INVALID;
        p->next = pool->free_top;
        pool->free_top = id;
}

static void free_push(PagePool *pool, PageId id) {
        Page *p = &pool->pages[id];
        p->freed_at = ++pool->frees;
        pool->n_free++;
        if (!pool->durable) {
                stack_push(pool, id);
                return;
        }
        p->prev = p->next = PAGE_ID_INVALID;
        if (pool->q_tail != PAGE_ID_INVALID)
                pool->pages[pool->q_tail].next = id;
        else
                pool->q_head = id;
        pool->q_tail = id;
        pool->n_quarantined++;
}

static PageId quarantine_pop(PagePool *pool) {
        PageId id = pool->q_head;
        pool->q_head = pool->pages[id].next;
        if (pool->q_head == PAGE_ID_INVALID)
                pool->q_tail = PAGE_ID_INVALID;
        pool->n_quarantined--;
        return id;
}

/* Moves settled_frees up over the marks whose record is durable, as far as `upto`
 * needs (UINT64_MAX: as far as they go). */
static void settle(PagePool *pool, uint64_t upto) {
        while (upto > pool->settled_frees && pool->marks_n > 0 && pool->durable &&
               pool->durable(pool->durable_userdata, pool->marks[pool->marks_head].stamp)) {
                pool->settled_frees = pool->marks[pool->marks_head].frees;
                pool->marks_head = (pool->marks_head + 1) % FREE_MARKS_MAX;
                pool->marks_n--;
        }
}

/* The quarantined pages whose mark settled go on the stack (the last freed on top). */
static void quarantine_release(PagePool *pool) {
        if (pool->q_head == PAGE_ID_INVALID)
                return;
        settle(pool, pool->pages[pool->q_tail].freed_at);
        while (pool->q_head != PAGE_ID_INVALID && pool->pages[pool->q_head].freed_at <= pool->settled_frees)
                stack_push(pool, quarantine_pop(pool));
}

/* Called when refs and leases both reached zero. */
static void page_release(PagePool *pool, PageId id) {
        if (pool->pages[id].cached)
                lru_push(pool, id);
        else
                free_push(pool, id);
}

/* After quarantine_release(). */
static int alloc_one(PagePool *pool, PageId *ret) {
        PageId id;
        if (pool->free_top != PAGE_ID_INVALID) {
                id = pool->free_top;
                pool->free_top = pool->pages[id].next;
        } else
                id = quarantine_pop(pool); /* freed longest ago: the first to settle */
        Page *p = &pool->pages[id];

        pool->n_free--;
        *p = (Page){ .refs = 1, .next = PAGE_ID_INVALID, .prev = PAGE_ID_INVALID, .freed_at = p->freed_at };
        pool->refs++;
        pool->n_referenced++;
        pool->allocs++;
        *ret = id;
        return 0;
}

static void make_room(PagePool *pool, size_t n) {
        if (pool->n_free >= n || !pool->evict)
                return;
        (void)pool->evict(pool, n - pool->n_free, pool->evict_userdata);
}

int page_pool_alloc(PagePool *pool, PageId *ret) {
        if (!pool || !ret)
                return -EINVAL;
        make_room(pool, 1);
        if (pool->n_free == 0) {
                pool->alloc_failures++;
                return -ENOSPC;
        }
        quarantine_release(pool);
        return alloc_one(pool, ret);
}

bool page_pool_can_alloc(const PagePool *pool, size_t n) {
        return pool && pool->n_free + pool->n_idle >= n;
}

int page_pool_alloc_many(PagePool *pool, size_t n, PageId *ret) {
        if (!pool || (n > 0 && !ret))
                return -EINVAL;
        if (n == 0)
                return 0;
        /* Check first, so that a request that cannot succeed evicts nothing. */
        if (n > pool->n_free + (pool->evict ? pool->n_idle : 0)) {
                pool->alloc_failures++;
                return -ENOSPC;
        }
        make_room(pool, n);
        if (pool->n_free < n) {
                pool->alloc_failures++;
                return -ENOSPC;
        }
        quarantine_release(pool);
        for (size_t i = 0; i < n; i++)
                (void)alloc_one(pool, &ret[i]);
        return 0;
}

bool page_is_allocated(const PagePool *pool, PageId id) {
        return page_valid(pool, id) && !page_state_free(&pool->pages[id]);
}

uint32_t page_refs(const PagePool *pool, PageId id) {
        return page_valid(pool, id) ? pool->pages[id].refs : 0;
}

uint32_t page_leases(const PagePool *pool, PageId id) {
        return page_valid(pool, id) ? pool->pages[id].leases : 0;
}

bool page_is_exclusive(const PagePool *pool, PageId id) {
        if (!page_valid(pool, id))
                return false;
        const Page *p = &pool->pages[id];
        return p->refs == 1 && p->leases == 0 && !p->cached;
}

/* Common checks of page_ref()/page_lease(); an IDLE page leaves the LRU queue. */
static int page_hold(PagePool *pool, PageId id, uint32_t count) {
        if (!page_valid(pool, id))
                return -EINVAL;
        Page *p = &pool->pages[id];
        if (page_state_free(p))
                return -ESTALE;
        if (count >= PAGE_REFS_MAX)
                return -EOVERFLOW;
        if (page_state_idle(p))
                lru_remove(pool, id);
        return 0;
}

int page_ref(PagePool *pool, PageId id) {
        int r = page_hold(pool, id, page_refs(pool, id));
        if (r < 0)
                return r;
        Page *p = &pool->pages[id];
        if (p->refs == 0)
                pool->n_referenced++;
        else if (p->refs == 1)
                pool->n_shared++;
        p->refs++;
        pool->refs++;
        return 0;
}

int page_unref(PagePool *pool, PageId id) {
        if (!page_valid(pool, id))
                return -EINVAL;
        Page *p = &pool->pages[id];
        if (p->refs == 0)
                return -ESTALE;
        p->refs--;
        pool->refs--;
        if (p->refs == 1)
                pool->n_shared--;
        else if (p->refs == 0) {
                pool->n_referenced--;
                if (p->leases == 0)
                        page_release(pool, id);
        }
        return (int)MIN(p->refs, (uint32_t)INT32_MAX);
}

int page_lease(PagePool *pool, PageId id) {
        int r = page_hold(pool, id, page_leases(pool, id));
        if (r < 0)
                return r;
        Page *p = &pool->pages[id];
        if (p->leases == 0)
                pool->n_leased++;
        p->leases++;
        pool->leases++;
        return 0;
}

int page_unlease(PagePool *pool, PageId id) {
        if (!page_valid(pool, id))
                return -EINVAL;
        Page *p = &pool->pages[id];
        if (p->leases == 0)
                return -ESTALE;
        p->leases--;
        pool->leases--;
        if (p->leases == 0) {
                pool->n_leased--;
                if (p->refs == 0)
                        page_release(pool, id);
        }
        return (int)MIN(p->leases, (uint32_t)INT32_MAX);
}

uint64_t page_offset(const PagePool *pool, PageId id) {
        if (!page_valid(pool, id))
                return UINT64_MAX;
        return pool->base_offset + (uint64_t)id * pool->page_size;
}

PageId page_from_offset(const PagePool *pool, uint64_t offset) {
        if (!pool || offset < pool->base_offset)
                return PAGE_ID_INVALID;
        uint64_t rel = offset - pool->base_offset;
        if (rel % pool->page_size != 0 || rel / pool->page_size >= pool->n_pages)
                return PAGE_ID_INVALID;
        return (PageId)(rel / pool->page_size);
}

int page_set_cached(PagePool *pool, PageId id, void *entry) {
        if (!page_valid(pool, id) || !entry)
                return -EINVAL;
        Page *p = &pool->pages[id];
        if (p->refs == 0 && p->leases == 0)
                return p->cached ? -EBUSY : -ESTALE;
        if (p->cached)
                return -EBUSY;
        p->cached = entry;
        pool->n_cached++;
        return 0;
}

int page_clear_cached(PagePool *pool, PageId id) {
        if (!page_valid(pool, id))
                return -EINVAL;
        Page *p = &pool->pages[id];
        if (!p->cached)
                return -ENOENT;
        if (page_state_idle(p))
                lru_remove(pool, id);
        p->cached = NULL;
        pool->n_cached--;
        if (page_state_free(p))
                free_push(pool, id);
        return 0;
}

void *page_cached_entry(const PagePool *pool, PageId id) {
        return page_valid(pool, id) ? pool->pages[id].cached : NULL;
}

void *page_pool_lru_peek(const PagePool *pool) {
        return pool && pool->lru_first != PAGE_ID_INVALID ? pool->pages[pool->lru_first].cached : NULL;
}

int page_pool_evict_lru(PagePool *pool, PageId *ret_id, void **ret_entry) {
        if (!pool)
                return -EINVAL;
        PageId id = pool->lru_first;
        if (id == PAGE_ID_INVALID)
                return -ENOENT;
        void *entry = pool->pages[id].cached;
        (void)page_clear_cached(pool, id);
        pool->evictions++;
        if (ret_id)
                *ret_id = id;
        if (ret_entry)
                *ret_entry = entry;
        return 0;
}

void page_pool_mark_frees(PagePool *pool, uint64_t stamp) {
        if (!pool || pool->frees == pool->marked_frees)
                return;
        if (pool->marks_n == FREE_MARKS_MAX) {
                FreeMark *back = &pool->marks[(pool->marks_head + pool->marks_n - 1) % FREE_MARKS_MAX];
                back->frees = pool->frees;
                back->stamp = MAX(back->stamp, stamp);
        } else
                pool->marks[(pool->marks_head + pool->marks_n++) % FREE_MARKS_MAX] =
                        (FreeMark){ .frees = pool->frees, .stamp = stamp };
        pool->marked_frees = pool->frees;
}

void page_pool_set_durable(PagePool *pool, PageDurableFn fn, void *userdata) {
        if (!pool || pool->durable == fn)
                return;
        quarantine_release(pool);
        pool->durable = fn;
        pool->durable_userdata = userdata;
        /* Without a check there is nothing to wait for: the quarantine goes. */
        while (!fn && pool->q_head != PAGE_ID_INVALID)
                stack_push(pool, quarantine_pop(pool));
}

bool page_pool_pages_settled(PagePool *pool, const PageId *ids, size_t n) {
        if (!pool || !pool->durable)
                return true;
        uint64_t latest = 0;
        for (size_t i = 0; i < n; i++)
                if (page_valid(pool, ids[i]))
                        latest = MAX(latest, pool->pages[ids[i]].freed_at);
        settle(pool, latest);
        return latest <= pool->settled_frees;
}

void page_pool_count_cow(PagePool *pool, uint64_t pages) {
        pool->cow_copies += pages;
}

int page_pool_verify(const PagePool *pool) {
        uint64_t n_free = 0, n_idle = 0, n_cached = 0, n_shared = 0, n_leased = 0, n_referenced = 0,
                 refs = 0, leases = 0;
        uint64_t walked;

        if (!pool)
                return -EINVAL;
        for (uint32_t i = 0; i < pool->n_pages; i++) {
                const Page *p = &pool->pages[i];
                n_free += page_state_free(p);
                n_idle += page_state_idle(p);
                n_cached += !!p->cached;
                n_shared += p->refs >= 2;
                n_leased += p->leases > 0;
                n_referenced += p->refs > 0;
                refs += p->refs;
                leases += p->leases;
        }
        if (n_free != pool->n_free || n_idle != pool->n_idle || n_cached != pool->n_cached ||
            n_shared != pool->n_shared || n_leased != pool->n_leased ||
            n_referenced != pool->n_referenced || refs != pool->refs || leases != pool->leases)
                return -EUCLEAN;

        /* The free stack and the quarantine hold exactly the FREE pages, the LRU queue the
         * IDLE ones. */
        walked = 0;
        for (PageId id = pool->free_top; id != PAGE_ID_INVALID; id = pool->pages[id].next) {
                if (id >= pool->n_pages || !page_state_free(&pool->pages[id]) || ++walked > n_free)
                        return -EUCLEAN;
        }
        uint64_t quarantined = 0;
        PageId last = PAGE_ID_INVALID;
        for (PageId id = pool->q_head; id != PAGE_ID_INVALID; id = pool->pages[id].next) {
                if (id >= pool->n_pages || !page_state_free(&pool->pages[id]) || ++walked > n_free ||
                    (last != PAGE_ID_INVALID && pool->pages[id].freed_at <= pool->pages[last].freed_at))
                        return -EUCLEAN;
                quarantined++;
                last = id;
        }
        if (walked != n_free || quarantined != pool->n_quarantined || last != pool->q_tail)
                return -EUCLEAN;
        walked = 0;
        PageId prev = PAGE_ID_INVALID;
        for (PageId id = pool->lru_first; id != PAGE_ID_INVALID; id = pool->pages[id].next) {
                if (id >= pool->n_pages || !page_state_idle(&pool->pages[id]) ||
                    pool->pages[id].prev != prev || ++walked > n_idle)
                        return -EUCLEAN;
                prev = id;
        }
        if (walked != n_idle || prev != pool->lru_last)
                return -EUCLEAN;
        return 0;
}

int page_pool_restore(PagePool *pool, const uint32_t *refs) {
        if (!pool || !refs)
                return -EINVAL;
        /* Only a pool nobody has used yet (right after the WAL replay). */
        if (pool->n_free != pool->n_pages || pool->n_cached > 0)
                return -EBUSY;
        for (uint32_t i = 0; i < pool->n_pages; i++)
                if (refs[i] > PAGE_REFS_MAX)
                        return -EOVERFLOW;
        pool->free_top = pool->q_head = pool->q_tail = PAGE_ID_INVALID;
        pool->n_quarantined = 0;
        pool->n_free = pool->n_shared = pool->n_referenced = pool->refs = 0;
        /* Pushed from the top down so that low ids are handed out first again. What the
         * WAL replayed is durable: no page waits for a mark. */
        for (uint32_t i = pool->n_pages; i > 0; i--) {
                PageId id = i - 1;
                Page *p = &pool->pages[id];
                *p = (Page){ .refs = refs[id], .next = PAGE_ID_INVALID, .prev = PAGE_ID_INVALID };
                if (refs[id] == 0) {
                        stack_push(pool, id);
                        pool->n_free++;
                        continue;
                }
                pool->refs += refs[id];
                pool->n_referenced++;
                if (refs[id] >= 2)
                        pool->n_shared++;
        }
        return 0;
}
