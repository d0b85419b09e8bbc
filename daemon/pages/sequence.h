/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Sequence: the ordered page table of one request or agent branch, over one PagePool
 * (one arena). Every page in the table holds one reference of the sequence's own; a
 * page may appear in many sequences (clones, directory prefix hits), never twice in a
 * way that matters: each occurrence is one reference.
 *
 *   sequence_clone()          shares every page: refcounts only, zero bytes copied.
 *   sequence_prepare_write()  returns the pages of a range that the caller may write:
 *                             a page written in place must be held by this sequence
 *                             alone (refs 1, no lease, not in the directory); any other
 *                             page is first copied into a fresh page (copy-on-write)
 *                             through the copy callback. Only pages in the range are
 *                             copied, and only those not exclusive.
 *
 * Pure (no bus): the PageManager (page-manager.h) registers sequences under ids, binds
 * them to clients and grants; the fields below the marker are its business. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/client.h"
#include "id.h"
#include "macro.h"
#include "pages/pages.h"

#define SEQUENCE_PAGES_MAX (UINT32_C(1) << 22) /* 4M pages per sequence */
#define SEQUENCE_GRANTS_MAX 16

typedef struct PageManager PageManager;
typedef struct Sequence Sequence;

struct Sequence {
        PagePool *pool;
        PageId *pages;
        size_t n_pages;
        size_t n_allocated;
        uint64_t cow_copies; /* pages this sequence copied on write */

        /* --- registration (page-manager.c); zero/NULL for a bare sequence --- */
        PageManager *manager;
        uint32_t arena;            /* index of the arena of `pool` */
        EpdId id;
        char id_str[EPD_ID_STRING_MAX];
        char *path;                /* /org/epd1/sequence/<id_str> */
        ClientObject object;       /* owner, release */
        EpdId grants[SEQUENCE_GRANTS_MAX]; /* workers it is shared with (Grant) */
        size_t n_grants;
        uint64_t created_usec;     /* CLOCK_REALTIME */
        uint32_t uid;              /* owner's uid: who may Attach after a restart */
};

/* An empty sequence over pool. */
int sequence_new(PagePool *pool, Sequence **ret);

/* A sequence over existing pages, in order (e.g. the decode side of a handoff, whose
 * pages were allocated and received under a lease, or a directory prefix hit). The
 * sequence takes one reference of its OWN on every page; the caller's references and
 * leases are left as they are, so the caller drops its own afterwards (page_unref(),
 * page_unlease()). Every page must be allocated (LIVE or IDLE): -ESTALE otherwise,
 * and then nothing changed. */
int sequence_new_from_pages(PagePool *pool, const PageId *pages, size_t n, Sequence **ret);

/* Drops every page reference and frees the sequence (and its path). Accepts NULL. The
 * registration (client object, id map) must be undone first: page_manager does so. */
Sequence *sequence_free(Sequence *s);

static inline size_t sequence_size(const Sequence *s) {
        return s ? s->n_pages : 0;
}
static inline const PageId *sequence_pages(const Sequence *s) {
        return s->pages;
}

/* Appends n freshly allocated pages (all or nothing; -ENOSPC, -E2BIG past
 * SEQUENCE_PAGES_MAX). Their ids go to ret_new[] if non-NULL. */
int sequence_append(Sequence *s, size_t n, PageId *ret_new);
/* Appends existing pages, taking a reference on each (all or nothing). */
int sequence_append_pages(Sequence *s, const PageId *pages, size_t n);
/* Keeps the first n_pages pages, dropping the references of the rest. -EINVAL if
 * n_pages is larger than the sequence. */
int sequence_truncate(Sequence *s, size_t n_pages);
/* Drops every page; the sequence stays, empty. */
void sequence_release_pages(Sequence *s);

/* A new sequence sharing every page of s (one more reference each, no byte copied). */
int sequence_clone(const Sequence *s, Sequence **ret);

/* Makes pages [first, first + count) writable by this sequence, copying each page that
 * is not exclusive into a fresh page with copy(userdata, dst, src, page_size). All or
 * nothing: the fresh pages are allocated (-ENOSPC) and copied (the callback's error)
 * before any entry of the table changes. The writable page ids go to ret_pages[] (count
 * entries) if non-NULL, the number of pages copied to *ret_copied. -EINVAL for a range
 * outside the sequence or a missing callback when a copy is needed. */
int sequence_prepare_write(Sequence *s, size_t first, size_t count, PageCopyFn copy,
                           void *userdata, PageId *ret_pages, size_t *ret_copied);

/* The same in two steps, for a copy that finishes later (a GPU arena's copy engine, off
 * the event loop): sequence_cow_plan() decides which pages of the range are copied and
 * allocates their fresh pages (*ret NULL when none needs a copy); the caller copies
 * c->original[j] into c->fresh[j] (page ids of c->pool), then sequence_cow_commit()
 * swaps the copies into the table, or sequence_cow_free() drops them. Until then the
 * table is unchanged and the plan holds one reference on every original and fresh page,
 * so neither is freed under the copy even if the sequence is released meanwhile. The
 * commit skips a slot whose page changed since the plan (its copy is dropped), takes
 * the sequence s (NULL: it is gone, everything is dropped), frees c and returns the
 * number of pages swapped in. */
typedef struct SequenceCow {
        PagePool *pool;
        size_t n;
        size_t *slots;     /* indices into the table */
        PageId *original;  /* what each slot held at the plan */
        PageId *fresh;     /* its copy */
} SequenceCow;

int sequence_cow_plan(Sequence *s, size_t first, size_t count, SequenceCow **ret);
/* How many pages of the range are shared (a plan would copy them), allocating nothing;
 * -EINVAL for a range outside the sequence. */
int sequence_range_shared(const Sequence *s, size_t first, size_t count, size_t *ret);
size_t sequence_cow_commit(Sequence *s, SequenceCow *c);
SequenceCow *sequence_cow_free(SequenceCow *c);
DEFINE_TRIVIAL_CLEANUP_FUNC(SequenceCow *, sequence_cow_free);

/* Leases pages [first, first + count) (for a transfer reading them), all or nothing,
 * and writes their ids to ret_pages[] (count entries). The leases are the caller's:
 * they outlive the sequence and even a later copy-on-write of the range, so the caller
 * ends them by id with page_unlease(), never by index. */
int sequence_lease(Sequence *s, size_t first, size_t count, PageId *ret_pages);

/* Number of pages of s that are shared (refs >= 2): what a clone saved. */
size_t sequence_shared_pages(const Sequence *s);
