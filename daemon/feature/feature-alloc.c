/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "feature/feature-alloc.h"
#include "macro.h"

#define SL_LOG2 4u
#define SL_COUNT (1u << SL_LOG2)
#define FL_COUNT (32u - SL_LOG2 + 1u) /* run lengths are < 2^32 chunks */
#define NIL UINT32_MAX
#define OWN_CLASS_SCAN 32u

enum {
        CHUNK_INNER = 0, /* not the first chunk of a run */
        CHUNK_USED = 1,  /* first chunk of an allocated run */
        CHUNK_FREE = 2,  /* first chunk of a free run */
};

struct FeatureAllocator {
        uint64_t base, chunk;
        uint32_t n_chunks;
        uint32_t used_chunks;
        uint64_t n_allocations;
        uint32_t *len;   /* [start] run length in chunks */
        uint32_t *tag;   /* [last chunk] start of its run */
        uint32_t *next;  /* [start of a free run] free list */
        uint32_t *prev;
        uint8_t *state;  /* [i] CHUNK_* */
        uint32_t fl_bitmap;
        uint32_t sl_bitmap[FL_COUNT];
        uint32_t heads[FL_COUNT][SL_COUNT];
};

static unsigned log2_u32(uint32_t v) {
        return 31u - (unsigned)__builtin_clz(v);
}

/* The class whose lists hold runs of exactly n chunks. */
static void mapping_insert(uint32_t n, unsigned *fl, unsigned *sl) {
        if (n < SL_COUNT) {
                *fl = 0;
                *sl = n;
        } else {
                unsigned f = log2_u32(n);
                *sl = (n >> (f - SL_LOG2)) ^ SL_COUNT;
                *fl = f - SL_LOG2 + 1;
        }
}

/* The smallest class all of whose runs hold n chunks. False if there is none. */
static bool mapping_search(uint32_t n, unsigned *fl, unsigned *sl) {
        uint64_t m = n;
        if (n >= SL_COUNT)
                m += (1ull << (log2_u32(n) - SL_LOG2)) - 1;
        if (m > UINT32_MAX)
                return false;
        mapping_insert((uint32_t)m, fl, sl);
        return true;
}

static void list_insert(FeatureAllocator *a, uint32_t s) {
        unsigned fl, sl;
        mapping_insert(a->len[s], &fl, &sl);
        uint32_t h = a->heads[fl][sl];
        a->next[s] = h;
        a->prev[s] = NIL;
        if (h != NIL)
                a->prev[h] = s;
        a->heads[fl][sl] = s;
        a->fl_bitmap |= 1u << fl;
        a->sl_bitmap[fl] |= 1u << sl;
        a->state[s] = CHUNK_FREE;
}

static void list_remove(FeatureAllocator *a, uint32_t s) {
        unsigned fl, sl;
        mapping_insert(a->len[s], &fl, &sl);
        if (a->prev[s] != NIL)
                a->next[a->prev[s]] = a->next[s];
        else
                a->heads[fl][sl] = a->next[s];
        if (a->next[s] != NIL)
                a->prev[a->next[s]] = a->prev[s];
        if (a->heads[fl][sl] == NIL) {
                a->sl_bitmap[fl] &= ~(1u << sl);
                if (a->sl_bitmap[fl] == 0)
                        a->fl_bitmap &= ~(1u << fl);
        }
        a->next[s] = a->prev[s] = NIL;
        a->state[s] = CHUNK_INNER;
}

static void set_run(FeatureAllocator *a, uint32_t s, uint32_t n) {
        a->len[s] = n;
        a->tag[s + n - 1] = s;
}

int feature_allocator_new(uint64_t base, uint64_t size, uint64_t chunk, FeatureAllocator **ret) {
        FeatureAllocator *a;
        uint64_t n;

        if (!IS_POWER_OF_2(chunk))
                return -EINVAL;
        n = size / chunk;
        if (n == 0 || n >= UINT32_MAX)
                return -EINVAL;
        if (base + size < base)
                return -EINVAL;

        a = calloc(1, sizeof *a);
        if (!a)
                return -ENOMEM;
        a->base = base;
        a->chunk = chunk;
        a->n_chunks = (uint32_t)n;
        a->len = calloc(n, sizeof(uint32_t));
        a->tag = calloc(n, sizeof(uint32_t));
        a->next = calloc(n, sizeof(uint32_t));
        a->prev = calloc(n, sizeof(uint32_t));
        a->state = calloc(n, 1);
        if (!a->len || !a->tag || !a->next || !a->prev || !a->state) {
                feature_allocator_free(a);
                return -ENOMEM;
        }
        memset(a->heads, 0xff, sizeof a->heads);
        set_run(a, 0, a->n_chunks);
        list_insert(a, 0);
        *ret = a;
        return 0;
}

FeatureAllocator *feature_allocator_free(FeatureAllocator *a) {
        if (!a)
                return NULL;
        free(a->len);
        free(a->tag);
        free(a->next);
        free(a->prev);
        free(a->state);
        free(a);
        return NULL;
}

static uint32_t find_free(FeatureAllocator *a, uint32_t n) {
        unsigned fl, sl;
        uint32_t map;

        if (!mapping_search(n, &fl, &sl))
                return NIL;
        if (fl >= FL_COUNT)
                return NIL;
        map = a->sl_bitmap[fl] & (~0u << sl);
        if (map == 0) {
                if (fl + 1 >= FL_COUNT)
                        return NIL;
                uint32_t fmap = a->fl_bitmap & (~0u << (fl + 1));
                if (fmap == 0)
                        return NIL;
                fl = (unsigned)__builtin_ctz(fmap);
                map = a->sl_bitmap[fl];
        }
        sl = (unsigned)__builtin_ctz(map);
        return a->heads[fl][sl];
}

/* Chunks [s, s + n) of the free run [r, r + len), taken off its list already and with
 * what lies before s given back: they become one used run, the rest after them a free
 * run again. */
static void take_run(FeatureAllocator *a, uint32_t r, uint32_t s, uint32_t len, uint32_t n, uint64_t *ret_length) {
        if ((uint64_t)r + len > (uint64_t)s + n) {
                uint32_t t = s + n;
                set_run(a, t, r + len - t);
                list_insert(a, t);
        }
        set_run(a, s, n);
        a->state[s] = CHUNK_USED;
        a->used_chunks += n;
        a->n_allocations++;
        if (ret_length)
                *ret_length = (uint64_t)n * a->chunk;
}

int feature_allocator_alloc(FeatureAllocator *a, uint64_t bytes, uint64_t *ret_offset,
                            uint64_t *ret_length) {
        uint64_t n64;
        uint32_t n, s;

        if (bytes == 0)
                return -EINVAL;
        n64 = bytes / a->chunk + (bytes % a->chunk != 0);
        if (n64 > a->n_chunks - a->used_chunks)
                return -ENOSPC;
        n = (uint32_t)n64;

        s = find_free(a, n);
        if (s == NIL) {
                /* Good fit skips the request's own class, whose runs may be shorter
                 * than n; look at a bounded number of them before giving up, so that
                 * an exact-size hole left by a freed feature is reused. */
                unsigned fl, sl, k = 0;
                mapping_insert(n, &fl, &sl);
                for (s = a->heads[fl][sl]; s != NIL && a->len[s] < n && k < OWN_CLASS_SCAN;
                     s = a->next[s], k++)
                        ;
                if (s == NIL || a->len[s] < n)
                        return -ENOSPC;
        }
        list_remove(a, s);
        take_run(a, s, s, a->len[s], n, ret_length);
        *ret_offset = a->base + (uint64_t)s * a->chunk;
        return 0;
}

int feature_allocator_release(FeatureAllocator *a, uint64_t offset) {
        uint64_t rel;
        uint32_t s, n;

        if (offset < a->base)
                return -EINVAL;
        rel = offset - a->base;
        if (rel % a->chunk != 0 || rel / a->chunk >= a->n_chunks)
                return -EINVAL;
        s = (uint32_t)(rel / a->chunk);
        if (a->state[s] != CHUNK_USED)
                return -EINVAL;

        n = a->len[s];
        a->used_chunks -= n;
        a->n_allocations--;
        a->state[s] = CHUNK_INNER;

        if (s > 0) {
                uint32_t l = a->tag[s - 1];
                if (a->state[l] == CHUNK_FREE) {
                        list_remove(a, l);
                        a->len[s] = 0;
                        n += a->len[l];
                        s = l;
                }
        }
        if ((uint64_t)s + n < a->n_chunks) {
                uint32_t r = s + n;
                if (a->state[r] == CHUNK_FREE) {
                        list_remove(a, r);
                        n += a->len[r];
                        a->len[r] = 0;
                }
        }
        set_run(a, s, n);
        list_insert(a, s);
        return 0;
}

uint64_t feature_allocator_chunk(const FeatureAllocator *a) {
        return a->chunk;
}

uint64_t feature_allocator_total(const FeatureAllocator *a) {
        return (uint64_t)a->n_chunks * a->chunk;
}

uint64_t feature_allocator_used(const FeatureAllocator *a) {
        return (uint64_t)a->used_chunks * a->chunk;
}

uint64_t feature_allocator_n_allocations(const FeatureAllocator *a) {
        return a->n_allocations;
}

uint64_t feature_allocator_overhead(const FeatureAllocator *a) {
        return sizeof *a + (uint64_t)a->n_chunks * (4 * sizeof(uint32_t) + 1);
}

uint64_t feature_allocator_largest_free(const FeatureAllocator *a) {
        uint32_t best = 0;
        for (uint32_t s = 0; s < a->n_chunks; s += a->len[s])
                if (a->state[s] == CHUNK_FREE && a->len[s] > best)
                        best = a->len[s];
        return (uint64_t)best * a->chunk;
}

int feature_allocator_next_free(const FeatureAllocator *a, uint64_t from, uint64_t *ret_offset,
                                uint64_t *ret_length) {
        uint64_t rel;
        uint32_t s;

        if (!a)
                return -EINVAL;
        rel = from < a->base ? 0 : (from - a->base) / a->chunk;
        if (rel >= a->n_chunks)
                return -ENOENT;
        /* The run that holds chunk rel, then run after run. */
        for (s = (uint32_t)rel; a->state[s] == CHUNK_INNER; s--)
                if (s == 0)
                        return -EUCLEAN;
        for (; s < a->n_chunks; s += a->len[s])
                if (a->state[s] == CHUNK_FREE) {
                        *ret_offset = a->base + (uint64_t)s * a->chunk;
                        *ret_length = (uint64_t)a->len[s] * a->chunk;
                        return 0;
                }
        return -ENOENT;
}

int feature_allocator_check(const FeatureAllocator *a) {
        uint64_t used = 0, n_alloc = 0, n_free_runs = 0, listed = 0;
        bool prev_free = false;

        for (uint64_t s = 0; s < a->n_chunks;) {
                uint32_t n = a->len[s];
                if (n == 0 || s + n > a->n_chunks || a->tag[s + n - 1] != s)
                        return -EUCLEAN;
                for (uint64_t i = s + 1; i < s + n; i++)
                        if (a->state[i] != CHUNK_INNER)
                                return -EUCLEAN;
                if (a->state[s] == CHUNK_USED) {
                        used += n;
                        n_alloc++;
                        prev_free = false;
                } else if (a->state[s] == CHUNK_FREE) {
                        if (prev_free)
                                return -EUCLEAN; /* missed coalescing */
                        n_free_runs++;
                        prev_free = true;
                } else
                        return -EUCLEAN;
                s += n;
        }
        if (used != a->used_chunks || n_alloc != a->n_allocations)
                return -EUCLEAN;

        for (unsigned fl = 0; fl < FL_COUNT; fl++)
                for (unsigned sl = 0; sl < SL_COUNT; sl++) {
                        bool bit = a->sl_bitmap[fl] & (1u << sl);
                        uint32_t h = a->heads[fl][sl];
                        if (bit != (h != NIL))
                                return -EUCLEAN;
                        for (uint32_t s = h, p = NIL; s != NIL; p = s, s = a->next[s]) {
                                unsigned f2, s2;
                                if (a->state[s] != CHUNK_FREE || a->prev[s] != p)
                                        return -EUCLEAN;
                                mapping_insert(a->len[s], &f2, &s2);
                                if (f2 != fl || s2 != sl)
                                        return -EUCLEAN;
                                if (++listed > a->n_chunks)
                                        return -EUCLEAN; /* cycle */
                        }
                        if (((a->fl_bitmap >> fl) & 1) != (a->sl_bitmap[fl] != 0))
                                return -EUCLEAN;
                }
        if (listed != n_free_runs)
                return -EUCLEAN;
        return 0;
}

int feature_allocator_alloc_at(FeatureAllocator *a, uint64_t offset, uint64_t bytes, uint64_t *ret_length) {
        uint64_t rel, n64;
        uint32_t s, n, r;

        if (!a || bytes == 0 || offset < a->base)
                return -EINVAL;
        rel = offset - a->base;
        if (rel % a->chunk != 0 || rel / a->chunk >= a->n_chunks)
                return -EINVAL;
        s = (uint32_t)(rel / a->chunk);
        n64 = bytes / a->chunk + (bytes % a->chunk != 0);
        if (n64 > a->n_chunks - s)
                return -ERANGE;
        n = (uint32_t)n64;

        /* The run that holds chunk s: its first chunk is the closest one that is not
         * INNER (a linear walk: this runs at restore, not per request). */
        for (r = s; a->state[r] == CHUNK_INNER; r--)
                if (r == 0)
                        return -EUCLEAN;
        if (a->state[r] != CHUNK_FREE || (uint64_t)r + a->len[r] < (uint64_t)s + n)
                return -EBUSY;

        uint32_t len = a->len[r];
        list_remove(a, r);
        if (s > r) {
                set_run(a, r, s - r);
                list_insert(a, r);
        }
        take_run(a, r, s, len, n, ret_length);
        return 0;
}
