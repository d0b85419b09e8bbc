/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* PrepareWrite: the copy-on-write of a sequence's shared pages, inline in host arenas,
 * on a GPU arena's copy engine off the loop (rounds until no page of the range is
 * shared), never into fresh pages before the records that freed them are durable
 * (page_manager_pages_settled()). */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "core/arena.h"
#include "log.h"
#include "macro.h"
#include "pages/page-manager.h"
#include "wal/wal-manager.h"

static int no_copy(void *userdata, uint64_t dst, uint64_t src, uint64_t length) {
        return -EOPNOTSUPP;
}

/* A copy-on-write whose copies are under way. The sequence is found again by its id
 * when they finish: it may have been released meanwhile. */
typedef struct PendingWrite {
        PageManager *pm;
        char id[EPD_ID_STRING_MAX];
        uint32_t arena;
        uint64_t *dst, *src;         /* while the copies wait for a removal's durability */
        bool in_call;                /* inside wal_manager_after_durable(): its caller answers */
        bool answered;               /* ... and the callback ran in it */
        int call_error;
        SequenceCow *cow;
        size_t first, count;
        size_t copied;               /* by the rounds before this one */
        unsigned round;
        PageWriteReadyFn ready;
        void *userdata;
} PendingWrite;

/* Copy rounds for one PrepareWrite at most: a page of the range can become shared again
 * while a round's copies run (a Clone, a Publish, a handoff's lease), and then needs
 * another; past this many the caller hears Busy. */
#define PREPARE_WRITE_ROUNDS 4

static int prepare_write_round(PageManager *pm, Sequence *s, size_t first, size_t count, size_t copied,
                               unsigned round, PageWriteReadyFn ready, void *userdata, size_t *ret_copied);
static void pending_write_done(void *userdata, int error);

/* The copies of a round whose fresh pages may be evicted entries' start once every
 * directory removal before them is durable (page_manager_pages_settled()). */
static void pending_write_go(void *userdata, int error) {
        PendingWrite *p = userdata;
        PageManager *pm = p->pm;
        _cleanup_(freep) uint64_t *dst = TAKE_PTR(p->dst), *src = TAKE_PTR(p->src);
        size_t n = p->cow->n;
        uint64_t page_size = page_pool_page_size(p->cow->pool);

        if (error >= 0 && pm->manager->stopping)
                error = -ECANCELED;
        if (p->in_call) {
                /* At once (durable meanwhile, or the journal refused): the caller,
                 * prepare_write_round(), copies now or says the error. */
                p->answered = true;
                p->call_error = error;
                p->dst = TAKE_PTR(dst);
                p->src = TAKE_PTR(src);
                return;
        }
        if (error < 0) {
                pending_write_done(p, error);
                return;
        }
        if (pm->copy_async[p->arena]) {
                error = pm->copy_async[p->arena](pm->copy_userdata[p->arena], p->arena, dst, src, n, page_size,
                                                 pending_write_done, p);
                if (error < 0)
                        pending_write_done(p, error);
                return;
        }
        PageCopyFn fn = pm->copy[p->arena] ?: no_copy;
        for (size_t j = 0; error >= 0 && j < n; j++)
                error = fn(pm->copy_userdata[p->arena], dst[j], src[j], page_size);
        pending_write_done(p, error);
}

static void pending_write_done(void *userdata, int error) {
        PendingWrite *p = userdata;
        PageManager *pm = p->pm;
        Sequence *s = hashmap_get(pm->sequences, p->id);

        assert(pm->writes_pending > 0);
        pm->writes_pending--;
        free(p->dst);
        free(p->src);
        /* Every error that comes here is the copies' (their completion, their
         * submission) or the journal's (a removal's durability), never the plan's; but
         * an arena with no copy path at all (no_copy()) is a refusal, as when it is
         * found without waiting. */
        bool no_path = !pm->copy[p->arena] && !pm->copy_async[p->arena] && error == -EOPNOTSUPP;
        if (error != -ECANCELED && !no_path)
                error = page_copy_failed(error);
        if (pm->manager->stopping)
                error = -ECANCELED; /* the table stays as journaled */
        else if (error >= 0 && !s)
                error = -ENOENT;
        if (error < 0) {
                sequence_cow_free(p->cow);
                /* An earlier round's copies were committed (their bytes are the pages'
                 * own): the table as it is now goes into the journal before the failure
                 * is told, or a retry that needs no copy is answered over a table the log
                 * does not have. */
                if (s && p->copied > 0 && !pm->manager->stopping)
                        (void)page_manager_journal(s);
                p->ready(p->userdata, s, error, p->copied);
        } else {
                size_t swapped = sequence_cow_commit(s, p->cow);
                size_t n = p->copied + swapped;
                /* The loop served other calls while the copies ran, and serves more while
                 * the next round's do: the swap goes into the journal now (the PUT with
                 * the new table, its LSN marking the frees), or an original the commit
                 * freed (its sharers went meanwhile), or one freed later by its last
                 * sharer's DEL or lease's end, counts as settled by a record that does
                 * not cover it, and may be written into while the log still gives it to
                 * this sequence: a crash then brings the sequence back on another's
                 * bytes. The reply journals the final table again. */
                if (swapped > 0)
                        (void)page_manager_journal(s);
                /* The loop served other calls while the copies ran: every page of the
                 * range must still be this sequence's alone, or its writes would land in
                 * another's KV. */
                size_t more = 0;
                int r = prepare_write_round(pm, s, p->first, p->count, n, p->round + 1, p->ready, p->userdata,
                                            &more);
                n += more;
                if (r == 0)
                        p->ready(p->userdata, s, 0, n);
                else if (r < 0) {
                        /* The copies committed so far stay (their bytes are the pages'
                         * own): journal the table as it is now before saying it failed. */
                        if (n > 0)
                                (void)page_manager_journal(s);
                        p->ready(p->userdata, s, r, n);
                }
                /* r > 0: another round, whose end answers */
        }
        free(p);
}

/* Plans the copies of the range's shared pages and starts them: 1 (ready is called when
 * they are done), 0 (none needed), or a negative errno (-EBUSY after
 * PREPARE_WRITE_ROUNDS rounds). */
static int prepare_write_round(PageManager *pm, Sequence *s, size_t first, size_t count, size_t copied,
                               unsigned round, PageWriteReadyFn ready, void *userdata, size_t *ret_copied) {
        _cleanup_(sequence_cow_freep) SequenceCow *c = NULL;
        PageCopyAsyncFn fn = pm->copy_async[s->arena];
        int r;

        if (round >= PREPARE_WRITE_ROUNDS) {
                /* Refused before a plan: its allocation may evict cached blocks, which
                 * would go for nothing. */
                size_t shared;
                r = sequence_range_shared(s, first, count, &shared);
                if (r < 0)
                        return r;
                if (shared > 0)
                        return -EBUSY;
        }
        r = sequence_cow_plan(s, first, count, &c);
        if (r < 0)
                return r;
        if (!c)
                return 0;
        _cleanup_(freep) uint64_t *dst = malloc(c->n * sizeof(uint64_t));
        _cleanup_(freep) uint64_t *src = malloc(c->n * sizeof(uint64_t));
        PendingWrite *p = calloc(1, sizeof *p);
        if (!dst || !src || !p) {
                free(p);
                return -ENOMEM;
        }
        for (size_t j = 0; j < c->n; j++) {
                dst[j] = page_offset(c->pool, c->fresh[j]);
                src[j] = page_offset(c->pool, c->original[j]);
        }
        *p = (PendingWrite) { .pm = pm, .arena = s->arena, .cow = c, .first = first, .count = count,
                              .copied = copied, .round = round, .ready = ready, .userdata = userdata };
        memcpy(p->id, s->id_str, sizeof p->id);
        if (!page_manager_pages_settled(pm, c->pool, c->fresh, c->n)) {
                /* The fresh pages may be entries just evicted (the plan allocated them):
                 * no byte goes into them before their removal is durable. */
                p->dst = TAKE_PTR(dst);
                p->src = TAKE_PTR(src);
                p->in_call = true;
                r = wal_manager_after_durable(pm->manager, pending_write_go, p);
                p->in_call = false;
                if (r >= 0 && p->answered && p->call_error < 0)
                        r = p->call_error == -ECANCELED ? -ECANCELED : page_copy_failed(p->call_error);
                else if (r < 0 && r != -ECANCELED)
                        r = page_copy_failed(r); /* the journal's */
                if (r < 0) {
                        c = TAKE_PTR(p->cow); /* dropped with the plan */
                        free(p->dst);
                        free(p->src);
                        free(p);
                        return r;
                }
                if (!p->answered) {
                        TAKE_PTR(c); /* the pending write's now */
                        pm->writes_pending++;
                        return 1;
                }
                /* Durable by the time it was asked: the copies go now, as below. */
                dst = TAKE_PTR(p->dst);
                src = TAKE_PTR(p->src);
        }
        if (!fn) {
                /* Host pages, nothing to wait for: the copies inline, then the commit. */
                uint64_t page_size = page_pool_page_size(c->pool);
                PageCopyFn copy = pm->copy[s->arena] ?: no_copy;
                free(p);
                for (size_t j = 0; j < c->n; j++) {
                        r = copy(pm->copy_userdata[s->arena], dst[j], src[j], page_size);
                        if (r < 0) /* no copy path (-EOPNOTSUPP) is a refusal; a copy's error is not */
                                return pm->copy[s->arena] ? page_copy_failed(r) : r;
                }
                *ret_copied = sequence_cow_commit(s, TAKE_PTR(c));
                return 0;
        }
        r = fn(pm->copy_userdata[s->arena], s->arena, dst, src, c->n, page_pool_page_size(c->pool),
               pending_write_done, p);
        if (r < 0) {
                free(p);
                return page_copy_failed(r); /* the driver refused the submission */
        }
        TAKE_PTR(c); /* the pending write's now */
        pm->writes_pending++;
        return 1;
}

int page_manager_prepare_write_async(PageManager *pm, Sequence *s, size_t first, size_t count,
                                     size_t *ret_copied, PageWriteReadyFn ready, void *userdata) {
        int r;

        if (!pm || !s || s->arena >= pm->manager->n_arenas || !ret_copied || !ready)
                return -EINVAL;
        if (!pm->copy_async[s->arena] && !pm->manager->wal) {
                /* No journal, nothing to wait for: the host copies inline. */
                r = page_manager_prepare_write(pm, s, first, count, NULL, ret_copied);
                return r < 0 ? r : 0;
        }
        *ret_copied = 0;
        return prepare_write_round(pm, s, first, count, 0, 0, ready, userdata, ret_copied);
}

int page_manager_prepare_write(PageManager *pm, Sequence *s, size_t first, size_t count,
                               PageId *ret_pages, size_t *ret_copied) {
        if (!pm || !s || s->arena >= pm->manager->n_arenas)
                return -EINVAL;
        /* Without a copy function (a GPU arena before the GPU domain installed one),
         * writes that need no copy still work; the others fail with -EOPNOTSUPP. */
        PageCopyFn fn = pm->copy[s->arena] ?: no_copy;
        return sequence_prepare_write(s, first, count, fn, pm->copy_userdata[s->arena],
                                      ret_pages, ret_copied);
}

