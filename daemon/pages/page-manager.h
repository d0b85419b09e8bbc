/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* PageManager: the pages subsystem of epdd. It ties a PagePool to every KV arena (made
 * when the first KV layout arrives, or at start when the arena's PageSize= is set),
 * owns the block directory and every Sequence registered under an id, and binds each
 * sequence to the client that created it (a ClientObject: released on Release and on
 * disconnect through one function). The bus glue is bus-sequence.c. */

#include <stdbool.h>
#include <stdint.h>

#include "core/manager.h"
#include "pages/directory.h"
#include "pages/kvlayout.h"
#include "pages/pages.h"
#include "pages/sequence.h"
#include "time-util.h"

#define PAGE_MANAGER_SEQUENCES_MAX 65536U
#define SEQUENCE_PATH_PREFIX "/org/epd1/sequence"

typedef struct PageManager {
        Manager *manager;
        Directory *directory;
        Hashmap *sequences;          /* Sequence* by id_str */
        /* Per arena (index): copy function for copy-on-write, set when the arena's pool
         * is made. Host arenas: memcpy (copy); GPU arenas: the copy engine, finishing off
         * the loop (copy_async, gpu_manager_page_copy_async()). */
        PageCopyFn *copy;
        PageCopyAsyncFn *copy_async;
        void **copy_userdata;
        size_t writes_pending;       /* page_manager_prepare_write_async() under way */
        /* Per arena (index): what fixed its pool's page size, in words for the worker
         * whose KV layout does not fit ("PageSize= in ...", "restored from the journal",
         * "the KV layout of worker ID"); NULL while it has no pool. */
        char **pool_origin;
        bool restoring;              /* in page_manager_restore_finish() */
        uint64_t sequences_created, sequences_released;
        /* Restart (docs/wal.md): sequences restored by the WAL replay have no owner
         * until their uid Attaches; those still unclaimed when `grace` fires are
         * released (unless a workflow's branch still heads on them). */
        bool replaying;
        sd_event_source *grace;
        /* Whether another subsystem still refers to an ownerless sequence (a workflow
         * branch's head): page_manager_set_keeper(). */
        bool (*keeps)(void *userdata, const EpdId *sequence);
        void *keeps_userdata;
        /* Run when the grace ends, before the sweep: the keeper lets go of what nobody
         * attached either (ownerless workflows), so their sequences go too. */
        void (*grace_ends)(void *userdata);
        uint64_t sequences_restored;
        /* Directory entries read by the replay (DirectoryRecord* by hash), put back by
         * page_manager_restore_finish(). */
        Hashmap *restored_directory;
        uint64_t directory_restored;
        /* Ids (strdup'd strings, key and value) whose latest PUT the replay could not
         * apply (another page size, a page past the pool...): their drop is journaled
         * once the replay is over, so that a later start does not bring them back. */
        Hashmap *replay_skipped;
        /* Set around a registration (or a release) whose caller journals the sequence's
         * PUT (or DEL) in its own record (a handoff's commit, a workflow transition):
         * page_manager_journal() and page_manager_release() leave it to it. */
        bool journal_held;
        /* The cluster-wide directory (directory-forward.c) hears of every entry that
         * appears or goes: page_manager_set_directory_observer(). */
        void (*observer)(void *userdata, bool put, uint64_t hash, const char *arena, const char *worker);
        void *observer_userdata;
        const char *publishing_worker; /* set around page_manager_publish()'s inserts */
} PageManager;

/* Whether the records that freed the pages of pool (a sequence's DEL, a Truncate's PUT,
 * an eviction's DEL) are durable: the daemon writes into pages it just handed out only
 * then, or a crash could bring the sequence or the entry back over other bytes. Each
 * page is marked with the record that freed it (pages.h), and freed pages are handed
 * out oldest first, so pages handed out are usually settled already. */
bool page_manager_pages_settled(PageManager *pm, PagePool *pool, const PageId *pages, size_t n);
/* Pages just returned to FREE outside a sequence record (a handoff dropping its leases
 * on pages a Release freed while leased): the mark takes them now, at the last LSN,
 * which covers the records that freed them, rather than at the next write (by then a
 * later record of that write's own). */
void page_manager_take_frees(PageManager *pm);

/* Called after each directory entry appears (put) or goes, once it is journaled, with
 * its arena's name and, for a Publish, the name of the worker that published it ("" if
 * none). One observer; NULL removes it. */
typedef void (*PageDirectoryObserver)(void *userdata, bool put, uint64_t hash, const char *arena, const char *worker);
void page_manager_set_directory_observer(PageManager *pm, PageDirectoryObserver fn, void *userdata);
/* Publish: hashes[i] -> page first+i of s in the block directory; the number inserted
 * (directory_insert_chain()), -ERANGE outside the sequence. worker names the publisher. */
int page_manager_publish(Sequence *s, uint32_t first, const uint64_t *hashes, size_t n, const char *worker);
/* The name of the arena of pool, or NULL. */
const char *page_manager_arena_of(PageManager *pm, const PagePool *pool);

/* How long sequences restored after a restart wait for their owner to Attach, by
 * default ([Limits] AttachGrace=). */
#define PAGE_MANAGER_ATTACH_GRACE_USEC (300 * USEC_PER_SEC)

extern const Subsystem pages_subsystem;

/* A subsystem that refers to sequences without owning them (workflows, whose branches
 * head on them) keeps the ones it names from being released when the attach grace
 * period ends; grace_ends (optional) runs first, for it to let go of its own ownerless
 * objects. One keeper; NULL removes it. */
void page_manager_set_keeper(PageManager *pm, bool (*keeps)(void *userdata, const EpdId *sequence),
                             void (*grace_ends)(void *userdata), void *userdata);

/* The pool of a KV arena, creating it for page_size if there is none yet (-EBUSY if
 * the pool exists with another page size, -EINVAL for a feature arena, -ENOSPC if the
 * arena holds less than one page). */
int page_manager_pool(PageManager *pm, Arena *a, uint64_t page_size, PagePool **ret);
/* The pool goes (it must hold no page): the arena has no page size again. */
void page_manager_pool_drop(PageManager *pm, Arena *a);

/* The subsystem's worker hooks (page-workers.c). */
int pages_worker_added(Manager *m, Worker *w, Reason *refused);
void pages_worker_gone(Manager *m, Worker *w);
void pages_worker_stats(Manager *m, Worker *w, WorkerStats *st);

/* Registers a bare sequence (from sequence_new*) under a fresh id, owned by client c,
 * over arena a (whose pool it must use). On failure the sequence is NOT freed. */
int page_manager_register(PageManager *pm, Sequence *s, Client *c, Arena *a);
/* Whether page_manager_register() has room for one more sequence of c: -EDQUOT (the
 * daemon's or the client's limit) or 0. Checked before allocating pages, which may evict
 * the prefix cache's idle pages: a call refused at a limit changes nothing. */
int page_manager_room(PageManager *pm, Client *c);
/* Release path of a registered sequence: unlinks it from its client and the id map and
 * frees it (dropping its page references). The Release method and the client's death
 * both end here. */
void page_manager_release(Sequence *s);

/* The sequence with this id (32 hex digits) or object path, or NULL. */
Sequence *page_manager_get(PageManager *pm, const char *id_or_path);

typedef enum SequenceAccess {
        SEQUENCE_ACCESS_READ,  /* properties, Clone: owner or a granted worker */
        SEQUENCE_ACCESS_OWNER, /* everything else: the owner only */
} SequenceAccess;

/* Whether client c may access s: 0, or -EPERM. */
int page_manager_check_access(const Sequence *s, Client *c, SequenceAccess access);
/* Lookup by id or path with the access check: -ENOENT, -EPERM, or 0 with *ret set.
 * This is what other subsystems (handoff) call on behalf of a client. */
int page_manager_lookup(PageManager *pm, Client *c, const char *id_or_path,
                        SequenceAccess access, Sequence **ret);

/* Arena of a registered sequence. */
Arena *page_manager_sequence_arena(PageManager *pm, const Sequence *s);

/* Copy-on-write for a registered sequence, with the arena's copy function. */
int page_manager_prepare_write(PageManager *pm, Sequence *s, size_t first, size_t count,
                               PageId *ret_pages, size_t *ret_copied);

/* The same without waiting for copies on the event loop: 0 when the range is writable
 * now (*ret_copied: the pages copied, synchronously, as in host arenas), 1 when copies
 * are under way (a GPU arena's copy engine), or a negative errno. After 1, ready()
 * runs exactly once on the loop: with the sequence looked up again and the number of
 * pages swapped in, or an error with the pages an earlier round swapped in (0: the
 * table unchanged; more: journaled before ready() runs) (-ENOENT: the sequence was
 * released meanwhile, s NULL; -ECANCELED: the daemon is stopping, reply to nobody; a
 * copy's or the journal's own failure, wrapped by page_copy_failed()). Its pages are
 * then [first, first + count) of s, if still there. The synchronous return wraps such
 * failures too. */
typedef void (*PageWriteReadyFn)(void *userdata, Sequence *s, int error, size_t copied);

/* A copy's failure (the driver's errno: CUDA_ERROR_INVALID_VALUE reads -EINVAL, an
 * out-of-resources launch -ENOSPC) or the journal's, as against a refusal of the plan
 * (-ENOSPC: no free page; -EINVAL: a range outside the sequence...): the same errno
 * means different things, so a copy's is moved out of the errno range, and callers name
 * it Failed with page_copy_errno()'s text. */
#define PAGE_COPY_FAILED_BASE 4096
static inline int page_copy_failed(int r) {
        return r < 0 && r > -PAGE_COPY_FAILED_BASE ? r - PAGE_COPY_FAILED_BASE : r;
}
/* The wrapped errno of a copy's failure (negative), or 0 for any other r. */
static inline int page_copy_errno(int r) {
        return r <= -PAGE_COPY_FAILED_BASE ? r + PAGE_COPY_FAILED_BASE : 0;
}
int page_manager_prepare_write_async(PageManager *pm, Sequence *s, size_t first, size_t count,
                                     size_t *ret_copied, PageWriteReadyFn ready, void *userdata);

/* Journals the whole state of a registered sequence (a PUT record) after a committed
 * transition. 0 when there is no WAL or the daemon is stopping; -E2BIG past
 * SEQUENCE_REC_PAGES_MAX pages. */
int page_manager_journal(Sequence *s);
/* The same after a change that only added (pages appended, a grant): when its record
 * cannot be built (no memory) the call fails, and the journal is not refused, since
 * the log's older record gives no one what the sequence no longer holds. */
int page_manager_journal_addition(Sequence *s);
/* The most pages a sequence may have here: SEQUENCE_REC_PAGES_MAX with a journal (its
 * record must fit), else SEQUENCE_PAGES_MAX. */
size_t page_manager_max_pages(PageManager *pm);
/* The PUT payload of a registered sequence (sequence-record.h), for a record that
 * carries it (a handoff's commit). The caller frees *ret. */
int page_manager_sequence_record(Sequence *s, void **ret, size_t *ret_len);
/* WAL replay: applies one 0x04xx record (sequence-record.h). Pages get their references
 * only in page_manager_restore_finish(), once every record is in. */
int page_manager_apply_record(PageManager *pm, uint16_t type, const void *payload, size_t len);
/* WAL replay: applies one 0x02xx record (directory-record.h); the entries are put back
 * in page_manager_restore_finish(). */
int page_manager_apply_directory_record(PageManager *pm, uint16_t type, const void *payload, size_t len);
/* After the replay: rebuilds every pool's refcounts and free list from the restored
 * sequences and arms the Attach grace period. */
int page_manager_restore_finish(PageManager *pm);
/* Snapshot: one PUT per registered sequence, then one directory PUT per entry. */
int page_manager_snapshot(PageManager *pm, int (*add)(void *userdata, uint16_t type, const void *rec, size_t len),
                          void *userdata);
/* Attach after a restart: client c (of the sequence's uid, or root) becomes the owner
 * of a sequence that has none. -EBUSY if another client owns it, -EPERM for another uid,
 * -EADDRINUSE if a workflow branch heads on it (the workflow owns it: Workflow.Attach
 * takes it back, and the workflow's transitions and its release free it). */
int page_manager_attach(PageManager *pm, Sequence *s, Client *c);
/* A restored head of a live workflow branch, taken back with its workflow by the
 * workflow's client (Workflow.Attach): as page_manager_attach() without the refusal of
 * heads, whose purpose is to keep them from a client other than the workflow's. */
int page_manager_attach_head(PageManager *pm, Sequence *s, Client *c);

/* Grants a worker read access (Grant) / takes it back (Revoke: -ENOENT if absent). */
int page_manager_grant(Sequence *s, const EpdId *worker);
int page_manager_revoke(Sequence *s, const EpdId *worker);
