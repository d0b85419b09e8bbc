/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/sequence.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"

int sequence_new(PagePool *pool, Sequence **ret) {
        if (!pool || !ret)
                return -EINVAL;
        Sequence *s = calloc(1, sizeof *s);
        if (!s)
                return -ENOMEM;
        s->pool = pool;
        *ret = s;
        return 0;
}

static int sequence_reserve(Sequence *s, size_t extra) {
        size_t need;

        if (ADD_OVERFLOW(s->n_pages, extra, &need) || need > SEQUENCE_PAGES_MAX)
                return -E2BIG;
        if (need <= s->n_allocated)
                return 0;
        size_t n = MAX(need, MAX(s->n_allocated * 2, (size_t)16));
        n = MIN(n, (size_t)SEQUENCE_PAGES_MAX);
        PageId *p = realloc(s->pages, n * sizeof(PageId));
        if (!p)
                return -ENOMEM;
        s->pages = p;
        s->n_allocated = n;
        return 0;
}

/* Takes one reference on each page; on failure drops the ones taken. */
static int ref_all(PagePool *pool, const PageId *pages, size_t n) {
        for (size_t i = 0; i < n; i++) {
                int r = page_ref(pool, pages[i]);
                if (r < 0) {
                        while (i > 0)
                                (void)page_unref(pool, pages[--i]);
                        return r;
                }
        }
        return 0;
}

/* Last page first: the pool's free stack then hands the pages out again in this
 * order, so that a sequence made after another was released gets the same runs of
 * adjacent pages (one copy each, not one per page). */
static void unref_all(PagePool *pool, const PageId *pages, size_t n) {
        for (size_t i = n; i > 0; i--)
                (void)page_unref(pool, pages[i - 1]);
}

int sequence_new_from_pages(PagePool *pool, const PageId *pages, size_t n, Sequence **ret) {
        Sequence *s;
        int r;

        if (!pool || !ret || (n > 0 && !pages))
                return -EINVAL;
        r = sequence_new(pool, &s);
        if (r < 0)
                return r;
        r = sequence_append_pages(s, pages, n);
        if (r < 0) {
                sequence_free(s);
                return r;
        }
        *ret = s;
        return 0;
}

void sequence_release_pages(Sequence *s) {
        if (!s)
                return;
        unref_all(s->pool, s->pages, s->n_pages);
        s->n_pages = 0;
}

Sequence *sequence_free(Sequence *s) {
        if (!s)
                return NULL;
        sequence_release_pages(s);
        free(s->pages);
        free(s->path);
        free(s);
        return NULL;
}

int sequence_append(Sequence *s, size_t n, PageId *ret_new) {
        int r;

        if (!s)
                return -EINVAL;
        if (n == 0)
                return 0;
        if (n > SEQUENCE_PAGES_MAX)
                return -E2BIG;
        /* Refuse what cannot fit before growing the table: a client asking for more
         * pages than the arena holds must not leave a huge table behind. */
        if (!page_pool_can_alloc(s->pool, n))
                return -ENOSPC;
        r = sequence_reserve(s, n);
        if (r < 0)
                return r;
        r = page_pool_alloc_many(s->pool, n, s->pages + s->n_pages);
        if (r < 0)
                return r;
        if (ret_new)
                memcpy(ret_new, s->pages + s->n_pages, n * sizeof(PageId));
        s->n_pages += n;
        return 0;
}

int sequence_append_pages(Sequence *s, const PageId *pages, size_t n) {
        int r;

        if (!s || (n > 0 && !pages))
                return -EINVAL;
        if (n == 0)
                return 0;
        r = sequence_reserve(s, n);
        if (r < 0)
                return r;
        r = ref_all(s->pool, pages, n);
        if (r < 0)
                return r;
        memcpy(s->pages + s->n_pages, pages, n * sizeof(PageId));
        s->n_pages += n;
        return 0;
}

int sequence_truncate(Sequence *s, size_t n_pages) {
        if (!s || n_pages > s->n_pages)
                return -EINVAL;
        unref_all(s->pool, s->pages + n_pages, s->n_pages - n_pages);
        s->n_pages = n_pages;
        return 0;
}

int sequence_clone(const Sequence *s, Sequence **ret) {
        Sequence *c;
        int r;

        if (!s || !ret)
                return -EINVAL;
        r = sequence_new(s->pool, &c);
        if (r < 0)
                return r;
        r = sequence_append_pages(c, s->pages, s->n_pages);
        if (r < 0) {
                sequence_free(c);
                return r;
        }
        *ret = c;
        return 0;
}

static bool range_ok(const Sequence *s, size_t first, size_t count) {
        return s && first <= s->n_pages && count <= s->n_pages - first;
}

int sequence_range_shared(const Sequence *s, size_t first, size_t count, size_t *ret) {
        size_t n = 0;
        if (!range_ok(s, first, count) || !ret)
                return -EINVAL;
        for (size_t i = first; i < first + count; i++)
                n += !page_is_exclusive(s->pool, s->pages[i]);
        *ret = n;
        return 0;
}

SequenceCow *sequence_cow_free(SequenceCow *c) {
        if (!c)
                return NULL;
        unref_all(c->pool, c->fresh, c->n);
        unref_all(c->pool, c->original, c->n);
        free(c->slots);
        free(c->original);
        free(c->fresh);
        free(c);
        return NULL;
}

int sequence_cow_plan(Sequence *s, size_t first, size_t count, SequenceCow **ret) {
        _cleanup_(sequence_cow_freep) SequenceCow *c = NULL;
        size_t n_copy = 0;
        int r;

        if (!ret)
                return -EINVAL;
        *ret = NULL;
        if (!range_ok(s, first, count))
                return -EINVAL;
        (void)sequence_range_shared(s, first, count, &n_copy);
        if (n_copy == 0)
                return 0;

        c = calloc(1, sizeof *c);
        if (!c)
                return -ENOMEM;
        c->pool = s->pool;
        c->slots = malloc(n_copy * sizeof(size_t));
        c->original = malloc(n_copy * sizeof(PageId));
        c->fresh = malloc(n_copy * sizeof(PageId));
        if (!c->slots || !c->original || !c->fresh)
                return -ENOMEM;
        /* Decide once which slots are copied: a page that occurs twice in the range
         * becomes exclusive half-way through the commit. */
        for (size_t i = first, j = 0; i < first + count; i++)
                if (!page_is_exclusive(s->pool, s->pages[i])) {
                        c->slots[j] = i;
                        c->original[j++] = s->pages[i];
                }
        /* Eviction may run here; it only frees IDLE pages, never ours (the sequence
         * holds a reference on every page of the range). */
        r = page_pool_alloc_many(s->pool, n_copy, c->fresh);
        if (r < 0)
                return r; /* c->n is 0: nothing to drop */
        r = ref_all(s->pool, c->original, n_copy);
        if (r < 0) {
                unref_all(s->pool, c->fresh, n_copy);
                return r;
        }
        c->n = n_copy;
        *ret = TAKE_PTR(c);
        return 0;
}

size_t sequence_cow_commit(Sequence *s, SequenceCow *c) {
        size_t swapped = 0;

        if (!c)
                return 0;
        if (s && s->pool == c->pool)
                for (size_t j = 0; j < c->n; j++) {
                        if (c->slots[j] >= s->n_pages || s->pages[c->slots[j]] != c->original[j])
                                continue; /* the table changed meanwhile: the copy is dropped */
                        (void)page_unref(s->pool, s->pages[c->slots[j]]);
                        s->pages[c->slots[j]] = c->fresh[j];
                        c->fresh[j] = PAGE_ID_INVALID;
                        swapped++;
                }
        for (size_t j = 0; j < c->n; j++)
                if (c->fresh[j] != PAGE_ID_INVALID)
                        (void)page_unref(c->pool, c->fresh[j]);
        unref_all(c->pool, c->original, c->n);
        if (swapped > 0) {
                page_pool_count_cow(s->pool, swapped);
                s->cow_copies += swapped;
        }
        c->n = 0;
        sequence_cow_free(c);
        return swapped;
}

int sequence_prepare_write(Sequence *s, size_t first, size_t count, PageCopyFn copy,
                           void *userdata, PageId *ret_pages, size_t *ret_copied) {
        _cleanup_(sequence_cow_freep) SequenceCow *c = NULL;
        size_t n_copy = 0;
        int r;

        r = sequence_cow_plan(s, first, count, &c);
        if (r < 0)
                return r;
        if (c) {
                if (!copy)
                        return -EINVAL;
                uint64_t page_size = page_pool_page_size(s->pool);
                for (size_t j = 0; j < c->n; j++) {
                        r = copy(userdata, page_offset(s->pool, c->fresh[j]), page_offset(s->pool, c->original[j]),
                                 page_size);
                        if (r < 0)
                                return r;
                }
                /* Commit: swap the copies in, dropping our reference on the originals. */
                n_copy = sequence_cow_commit(s, TAKE_PTR(c));
        }

        if (ret_pages && count > 0)
                memcpy(ret_pages, s->pages + first, count * sizeof(PageId));
        if (ret_copied)
                *ret_copied = n_copy;
        return 0;
}

int sequence_lease(Sequence *s, size_t first, size_t count, PageId *ret_pages) {
        if (!range_ok(s, first, count) || (count > 0 && !ret_pages))
                return -EINVAL;
        for (size_t i = 0; i < count; i++) {
                int r = page_lease(s->pool, s->pages[first + i]);
                if (r < 0) {
                        while (i > 0)
                                (void)page_unlease(s->pool, s->pages[first + --i]);
                        return r;
                }
                ret_pages[i] = s->pages[first + i];
        }
        return 0;
}

size_t sequence_shared_pages(const Sequence *s) {
        size_t n = 0;
        if (!s)
                return 0;
        for (size_t i = 0; i < s->n_pages; i++)
                n += page_refs(s->pool, s->pages[i]) >= 2;
        return n;
}
