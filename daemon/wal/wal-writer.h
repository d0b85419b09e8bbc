/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The WAL's writer thread: group commit off the event loop.
 *
 * The loop appends records (wal_writer_append: encode into the pending batch under a
 * mutex, take the next LSN; no I/O, no waiting for the disk). The thread takes the whole
 * pending batch at once, writes it to the log with one write, makes it durable with one
 * fdatasync (Sync=batch) — every record that arrived meanwhile, of every subsystem,
 * shares that sync — publishes the new durable LSN and kicks an eventfd that the loop
 * watches. So under load the records per sync grow by themselves, and the loop never
 * waits for the disk: a reply waits only until its own record is durable
 * (wal-manager.c keeps it until then).
 *
 *   Sync=always  one record per write and per fdatasync (no batching)
 *   Sync=batch   one write and one fdatasync per batch
 *   Sync=none    one write per batch, no fdatasync: durable = written (survives a crash
 *                of epdd, not of the machine)
 *
 * A failed write or sync is sticky: the log is cut back to its last good record, the
 * LSNs past the durable point are never acknowledged (wal_writer_error()), and every
 * later append fails with -EIO: a record after a lost one would be cut at replay.
 *
 * Compaction also runs here: wal_writer_compact() hands over a snapshot built on the
 * loop (wal_snapshot_build()); the thread first writes the records before it to the old
 * log, then replaces the log with the snapshot (wal_compact_buffer()), and later records
 * go to the new log. A compaction that fails before its snapshot is in place leaves the
 * old log appending (counted in compaction_failures); one that fails after it fails the
 * writer like a failed write. Pure apart from the thread: no bus, no event loop. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "macro.h"
#include "wal/wal.h"

typedef struct WalWriter WalWriter;

/* The pending batch may hold at most this many bytes, so that a stalled disk does not
 * grow memory without bound: an append past it waits (the thread urged) for the batch
 * before it to be taken, up to WAL_WRITER_FULL_WAIT_USEC, then fails (-ENOBUFS). A short
 * stall slows the loop rather than fail the journal for good (wal-manager.c); a long one
 * fails it well within the unit's WatchdogSec=. */
#define WAL_WRITER_PENDING_MAX (256U << 20)
#define WAL_WRITER_FULL_WAIT_USEC (10ULL * 1000000ULL)
/* A buffer of more than this that a batch used less than a quarter of is given back
 * (after a burst, two buffers of up to WAL_WRITER_PENDING_MAX were kept for good). */
#define WAL_WRITER_KEEP_CAP (4U << 20)

typedef struct WalWriterStats {
        WalSyncPolicy policy;
        uint64_t assigned_lsn;   /* last LSN handed out */
        uint64_t durable_lsn;    /* every record up to it is durable under the policy */
        uint64_t appended;       /* records */
        uint64_t appended_bytes;
        uint64_t writes;         /* batches written */
        uint64_t syncs;          /* fdatasync calls */
        uint64_t synced_records; /* records made durable by those syncs */
        uint64_t max_batch;      /* most records one sync made durable */
        uint64_t log_bytes;      /* size of wal.log */
        uint64_t compactions;
        uint64_t compaction_failures; /* the log went on as it was (its snapshot not written) */
        int compaction_error;         /* the last such failure's, 0 */
        uint64_t snapshot_records;
        int error;               /* sticky: the first failed write or sync, 0 */
        uint64_t full_waits;     /* appends that waited for room (WAL_WRITER_PENDING_MAX) */
        uint64_t buffer_bytes;   /* held by the two batch buffers */
} WalWriterStats;

/* Starts the thread over a replayed Wal (which the writer then owns the I/O of: the
 * caller does not call wal_append/wal_sync/wal_compact on it any more). */
int wal_writer_new(Wal *w, WalWriter **ret);
/* Tests: a smaller pending bound and wait (0: the defaults above). */
void wal_writer_set_limits(WalWriter *ww, size_t pending_max, uint64_t full_wait_usec);
/* Makes everything appended durable, stops and joins the thread. The Wal stays the
 * caller's. */
WalWriter *wal_writer_free(WalWriter *ww);
DEFINE_TRIVIAL_CLEANUP_FUNC(WalWriter *, wal_writer_free);

/* Queues one record; its LSN in *ret_lsn. -EINVAL (bad type or length), -ENOBUFS
 * (WAL_WRITER_PENDING_MAX still full after WAL_WRITER_FULL_WAIT_USEC), -EIO once a write
 * or sync failed, -ENOMEM. */
int wal_writer_append(WalWriter *ww, uint16_t type, const void *payload, size_t len, uint64_t *ret_lsn);
/* The same for a record nobody waits for yet: it is written with the next record that
 * is waited for (wal_writer_append, wal_writer_urge, wal_writer_wait), or when its
 * caller urges, which it does at the latest WAL_WRITER_LAZY_USEC after the first such
 * record of the batch (the thread is not woken for it and keeps no timer: no context
 * switch per record on a quiet loop). Returns 1 when the record begins a batch that
 * nobody urged yet (the caller's bound starts), 0 when the batch is already waited for
 * or urged, or the error. */
#define WAL_WRITER_LAZY_USEC (5ULL * 1000ULL)
int wal_writer_append_deferred(WalWriter *ww, uint16_t type, const void *payload, size_t len,
                               uint64_t *ret_lsn);
/* Someone waits for what is pending: write and sync it now. */
void wal_writer_urge(WalWriter *ww);
/* Queues a compaction: `snapshot` (from wal_snapshot_build(), taken over: freed by the
 * writer; `records` in it) holds the state as of `lsn`, which must be the last LSN
 * assigned. -EBUSY while one is queued or running. */
int wal_writer_compact(WalWriter *ww, void *snapshot, size_t size, uint64_t lsn, uint64_t records);
bool wal_writer_compacting(WalWriter *ww);

/* Readable while the durable point advanced (or an error happened) since the last
 * wal_writer_ack(); the loop watches it. */
int wal_writer_fd(WalWriter *ww);
void wal_writer_ack(WalWriter *ww);
/* A consistent copy of the counters. */
void wal_writer_stats(WalWriter *ww, WalWriterStats *ret);
uint64_t wal_writer_durable(WalWriter *ww);
uint64_t wal_writer_assigned(WalWriter *ww);
/* Blocks until every record appended so far is durable (or failed); returns the
 * sticky error. For shutdown and tests: the loop never calls it while serving. */
int wal_writer_flush(WalWriter *ww);
/* Blocks until record `lsn` is durable (or failed); for appenders on other threads
 * (tests, benchmarks): the loop waits through the eventfd instead. */
int wal_writer_wait(WalWriter *ww, uint64_t lsn);
void wal_writer_set_policy(WalWriter *ww, WalSyncPolicy p);
/* The thread takes no new batch while held (appends still queue): a maintenance pause,
 * and how tests line many appends up behind one sync. */
void wal_writer_hold(WalWriter *ww, bool hold);

/* Callers waiting for their records to be durable, in the order they came (their LSNs
 * do not decrease): the loop's side of group commit. wal_wait_queue_advance() runs, in
 * order, every waiter whose LSN is durable (error 0), and with error < 0 every other one
 * too, with that error: nothing waits for a log that can no longer be written. */
typedef void (*WalWaitFn)(void *userdata, int error);
typedef struct WalWaiter {
        uint64_t lsn;
        WalWaitFn fn;
        void *userdata;
} WalWaiter;
typedef struct WalWaitQueue {
        WalWaiter *v;
        size_t head, n, cap;
} WalWaitQueue;

/* -ENOMEM, or -EINVAL when lsn is below the last waiter's. */
int wal_wait_queue_push(WalWaitQueue *q, uint64_t lsn, WalWaitFn fn, void *userdata);
/* Room for `more` pushes that then cannot fail for memory. */
int wal_wait_queue_reserve(WalWaitQueue *q, size_t more);
/* Returns how many ran. */
size_t wal_wait_queue_advance(WalWaitQueue *q, uint64_t durable, int error);
void wal_wait_queue_done(WalWaitQueue *q, int error); /* runs every waiter with error */
