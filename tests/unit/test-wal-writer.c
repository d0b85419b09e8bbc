/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The WAL writer thread (wal-writer.h): group commit (many appenders, one write and one
 * fdatasync for all of them, each waiter answered only once its own record is durable,
 * in order), the three sync policies, compaction through the thread (the records before
 * the snapshot in the old log, the later ones in the new), and replay of what it wrote:
 * exactly the records appended, in LSN order, each appender's in its own order. */
#include <check.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "macro.h"
#include "unaligned.h"
#include "wal/wal-writer.h"
#include "../check-main.h"

#define APPENDERS 8
#define PER_APPENDER 250

static char *make_dir(void) {
        char *d = strdup("/tmp/test-wal-writer-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(d));
        return d;
}

static void rm_dir(char *d) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", d);
        ck_assert_int_eq(system(cmd), 0);
        free(d);
}

static Wal *open_replayed(const char *dir, WalSyncPolicy p, WalApplyFn apply, void *userdata) {
        Wal *w = NULL;
        ck_assert_int_eq(wal_open(dir, p, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, userdata), 0);
        return w;
}

/* Payload: appender (u32), its sequence number (u32). */
typedef struct Appender {
        WalWriter *ww;
        uint32_t id;
        uint64_t lsns[PER_APPENDER];
} Appender;

static void *appender(void *userdata) {
        Appender *a = userdata;
        for (uint32_t i = 0; i < PER_APPENDER; i++) {
                uint8_t p[8];
                unaligned_write_le32(p, a->id);
                unaligned_write_le32(p + 4, i);
                ck_assert_int_eq(wal_writer_append(a->ww, WAL_RECORD_TEST + 1, p, sizeof p, &a->lsns[i]), 0);
        }
        return NULL;
}

typedef struct Replay {
        uint64_t records, last_lsn;
        uint32_t next[APPENDERS]; /* each appender's next sequence number */
        uint64_t bad;
        uint64_t snapshot;        /* the count a snapshot record said */
} Replay;

static int replay_apply(void *userdata, const WalRecord *r, bool from_snapshot) {
        Replay *x = userdata;
        if (from_snapshot) {
                if (r->type == WAL_RECORD_TEST && r->length == 8)
                        x->snapshot = unaligned_read_le64(r->payload);
                else
                        x->bad++;
                return 0;
        }
        if (r->type != WAL_RECORD_TEST + 1 || r->length != 8 || (x->last_lsn && r->lsn != x->last_lsn + 1)) {
                x->bad++;
                return 0;
        }
        uint32_t id = unaligned_read_le32(r->payload), seq = unaligned_read_le32((const uint8_t *)r->payload + 4);
        if (id >= APPENDERS || seq != x->next[id])
                x->bad++;
        else
                x->next[id]++;
        x->records++;
        x->last_lsn = r->lsn;
        return 0;
}

/* A waiter: answered once, with its record durable. */
typedef struct Waiter {
        WalWriter *ww;
        uint64_t lsn;
        int calls, error;
        uint64_t durable_then;
        unsigned order;
} Waiter;

static unsigned answered;

static void waiter_done(void *userdata, int error) {
        Waiter *w = userdata;
        w->calls++;
        w->error = error;
        w->durable_then = wal_writer_durable(w->ww);
        w->order = answered++;
}

static void wait_readable(int fd) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        ck_assert_int_eq(poll(&p, 1, 10000), 1);
}

START_TEST(test_group_commit) {
        char *dir = make_dir();
        Wal *w = open_replayed(dir, WAL_SYNC_BATCH, NULL, NULL);
        WalWriter *ww;
        ck_assert_int_eq(wal_writer_new(w, &ww), 0);

        /* The thread holds: many appenders queue behind it. */
        wal_writer_hold(ww, true);
        pthread_t t[APPENDERS];
        static Appender a[APPENDERS];
        for (uint32_t i = 0; i < APPENDERS; i++) {
                a[i] = (Appender){ .ww = ww, .id = i };
                ck_assert_int_eq(pthread_create(&t[i], NULL, appender, &a[i]), 0);
        }
        for (uint32_t i = 0; i < APPENDERS; i++)
                ck_assert_int_eq(pthread_join(t[i], NULL), 0);
        WalWriterStats st;
        wal_writer_stats(ww, &st);
        ck_assert_uint_eq(st.assigned_lsn, APPENDERS * PER_APPENDER);
        ck_assert_uint_eq(st.durable_lsn, 0);
        ck_assert_uint_eq(st.syncs, 0);

        /* A waiter per record, in LSN order (as the event loop queues replies): none is
         * answered while nothing is durable. */
        static Waiter wt[APPENDERS * PER_APPENDER];
        WalWaitQueue q = {};
        for (uint64_t lsn = 1; lsn <= APPENDERS * PER_APPENDER; lsn++) {
                wt[lsn - 1] = (Waiter){ .ww = ww, .lsn = lsn };
                ck_assert_int_eq(wal_wait_queue_push(&q, lsn, waiter_done, &wt[lsn - 1]), 0);
        }
        ck_assert_int_eq(wal_wait_queue_push(&q, 1, waiter_done, &wt[0]), -EINVAL); /* LSNs do not go back */
        ck_assert_uint_eq(wal_wait_queue_advance(&q, st.durable_lsn, 0), 0);

        /* Released: one write and one fdatasync make all of them durable. */
        wal_writer_hold(ww, false);
        wait_readable(wal_writer_fd(ww));
        wal_writer_ack(ww);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        wal_writer_stats(ww, &st);
        ck_assert_uint_eq(st.durable_lsn, APPENDERS * PER_APPENDER);
        ck_assert_uint_eq(st.syncs, 1);
        ck_assert_uint_eq(st.writes, 1);
        ck_assert_uint_eq(st.synced_records, APPENDERS * PER_APPENDER);
        ck_assert_uint_eq(st.max_batch, APPENDERS * PER_APPENDER);
        ck_assert_int_eq(st.error, 0);
        answered = 0;
        ck_assert_uint_eq(wal_wait_queue_advance(&q, st.durable_lsn, 0), APPENDERS * PER_APPENDER);
        for (uint64_t i = 0; i < APPENDERS * PER_APPENDER; i++) {
                ck_assert_int_eq(wt[i].calls, 1);
                ck_assert_int_eq(wt[i].error, 0);
                ck_assert_uint_ge(wt[i].durable_then, wt[i].lsn);
                ck_assert_uint_eq(wt[i].order, i);
        }

        /* A waiter whose record is not durable yet waits; the next batch answers it. */
        wal_writer_hold(ww, true);
        uint64_t lsn;
        ck_assert_int_eq(wal_writer_append(ww, WAL_RECORD_TEST + 1, (uint8_t[8]){ 0, 0, 0, 0, 250, 0, 0, 0 }, 8, &lsn),
                         0);
        Waiter late = { .ww = ww, .lsn = lsn };
        ck_assert_int_eq(wal_wait_queue_push(&q, lsn, waiter_done, &late), 0);
        ck_assert_uint_eq(wal_wait_queue_advance(&q, wal_writer_durable(ww), 0), 0);
        ck_assert_int_eq(late.calls, 0);
        wal_writer_hold(ww, false);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        ck_assert_uint_eq(wal_wait_queue_advance(&q, wal_writer_durable(ww), 0), 1);
        ck_assert_int_eq(late.calls, 1);
        ck_assert_uint_ge(late.durable_then, lsn);
        wal_wait_queue_done(&q, 0);

        /* Bad records are refused before they take an LSN. */
        ck_assert_int_eq(wal_writer_append(ww, WAL_RECORD_SNAPSHOT_END, NULL, 0, NULL), -EINVAL);
        ck_assert_int_eq(wal_writer_append(ww, WAL_RECORD_TEST, NULL, 5, NULL), -EINVAL);
        ck_assert_uint_eq(wal_writer_assigned(ww), lsn);
        ww = wal_writer_free(ww);
        wal_free(w);

        /* Replay: exactly the records appended, in LSN order, each appender's in order. */
        Replay x = {};
        w = open_replayed(dir, WAL_SYNC_BATCH, replay_apply, &x);
        ck_assert_uint_eq(x.bad, 0);
        ck_assert_uint_eq(x.records, APPENDERS * PER_APPENDER + 1);
        for (uint32_t i = 0; i < APPENDERS; i++)
                ck_assert_uint_eq(x.next[i], i == 0 ? PER_APPENDER + 1 : PER_APPENDER);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* Records nobody waits for are not synced on their own: they wait for one that is
 * waited for (then one sync makes all durable), or for their caller's urge (the loop's
 * lazy timer in epdd: handoff-netns-pipelined checks that bound). */
/* Room reserved for waits is used without allocating again (so those pushes cannot
 * fail for memory), whatever is queued around the queue's wrap, and keeps the order. */
static uint64_t reserve_next;

static void reserve_done(void *userdata, int error) {
        ck_assert_int_eq(error, 0);
        ck_assert_uint_eq((uint64_t)(uintptr_t)userdata, ++reserve_next); /* in order, each once */
}

START_TEST(test_wait_queue_reserve) {
        WalWaitQueue q = {};
        uint64_t lsn = 0;

        reserve_next = 0;
        for (int round = 0; round < 3; round++) {
                for (int i = 0; i < 50; i++, lsn++)
                        ck_assert_int_eq(wal_wait_queue_push(&q, lsn + 1, reserve_done, (void *)(uintptr_t)(lsn + 1)),
                                         0);
                ck_assert_int_eq(wal_wait_queue_reserve(&q, 70), 0);
                ck_assert_uint_ge(q.cap - q.n, 70);
                WalWaiter *v = q.v;
                for (int i = 0; i < 70; i++, lsn++)
                        ck_assert_int_eq(wal_wait_queue_push(&q, lsn + 1, reserve_done, (void *)(uintptr_t)(lsn + 1)),
                                         0);
                ck_assert_ptr_eq(q.v, v); /* no allocation */
                ck_assert_int_eq(wal_wait_queue_reserve(&q, 0), 0);
                size_t before = q.n;
                ck_assert_uint_eq(wal_wait_queue_advance(&q, lsn - 10, 0), before - 10); /* all but the last 10 */
        }
        ck_assert_uint_eq(q.n, 10);
        ck_assert_uint_eq(wal_wait_queue_advance(&q, lsn, 0), 10);
        ck_assert_uint_eq(reserve_next, lsn);
        wal_wait_queue_done(&q, 0);
}
END_TEST

START_TEST(test_lazy) {
        char *dir = make_dir();
        Wal *w = open_replayed(dir, WAL_SYNC_BATCH, NULL, NULL);
        WalWriter *ww;
        WalWriterStats st;
        uint64_t lsn = 0;
        uint8_t p[8] = { 0 };
        ck_assert_int_eq(wal_writer_new(w, &ww), 0);

        for (unsigned i = 0; i < 10; i++) {
                p[4] = (uint8_t)i; /* appender 0, sequence i */
                /* The first begins the batch the caller times; the others join it. */
                ck_assert_int_eq(wal_writer_append_deferred(ww, WAL_RECORD_TEST + 1, p, sizeof p, &lsn), i == 0);
        }
        usleep(100 * 1000);
        wal_writer_stats(ww, &st);
        ck_assert_uint_eq(st.durable_lsn, 0); /* nobody asked */
        ck_assert_uint_eq(st.syncs, 0);
        ck_assert_uint_eq(st.writes, 0);
        /* One that is waited for takes them all along: one write, one sync. */
        p[4] = 10;
        ck_assert_int_eq(wal_writer_append(ww, WAL_RECORD_TEST + 1, p, sizeof p, &lsn), 0);
        ck_assert_int_eq(wal_writer_wait(ww, lsn), 0);
        wal_writer_stats(ww, &st);
        ck_assert_uint_eq(st.durable_lsn, 11);
        ck_assert_uint_eq(st.syncs, 1);
        ck_assert_uint_eq(st.writes, 1);

        /* wal_writer_urge: the same for them alone. */
        p[4] = 11;
        ck_assert_int_eq(wal_writer_append_deferred(ww, WAL_RECORD_TEST + 1, p, sizeof p, &lsn), 1);
        usleep(50 * 1000);
        ck_assert_uint_eq(wal_writer_durable(ww), 11);
        wal_writer_urge(ww);
        ck_assert_int_eq(wal_writer_wait(ww, lsn), 0);
        ck_assert_uint_eq(wal_writer_durable(ww), 12);

        /* Pending at the end: wal_writer_free() makes it durable. */
        p[4] = 12;
        ck_assert_int_eq(wal_writer_append_deferred(ww, WAL_RECORD_TEST + 1, p, sizeof p, &lsn), 1);
        ww = wal_writer_free(ww);
        wal_free(w);

        /* Replay: all of them, in order. */
        Replay x = {};
        w = open_replayed(dir, WAL_SYNC_BATCH, replay_apply, &x);
        ck_assert_uint_eq(x.bad, 0);
        ck_assert_uint_eq(x.records, 13);
        ck_assert_uint_eq(x.next[0], 13);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* Appends while the thread syncs: every record lands, in as few syncs as the disk
 * allows (at most one per append). */
START_TEST(test_load) {
        char *dir = make_dir();
        Wal *w = open_replayed(dir, WAL_SYNC_BATCH, NULL, NULL);
        WalWriter *ww;
        ck_assert_int_eq(wal_writer_new(w, &ww), 0);
        pthread_t t[APPENDERS];
        static Appender a[APPENDERS];
        for (uint32_t i = 0; i < APPENDERS; i++) {
                a[i] = (Appender){ .ww = ww, .id = i };
                ck_assert_int_eq(pthread_create(&t[i], NULL, appender, &a[i]), 0);
        }
        for (uint32_t i = 0; i < APPENDERS; i++)
                ck_assert_int_eq(pthread_join(t[i], NULL), 0);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        WalWriterStats st;
        wal_writer_stats(ww, &st);
        ck_assert_uint_eq(st.durable_lsn, APPENDERS * PER_APPENDER);
        ck_assert_uint_ge(st.syncs, 1);
        ck_assert_uint_le(st.syncs, APPENDERS * PER_APPENDER);
        ck_assert_uint_eq(st.synced_records, APPENDERS * PER_APPENDER);
        ww = wal_writer_free(ww);
        wal_free(w);
        Replay x = {};
        w = open_replayed(dir, WAL_SYNC_BATCH, replay_apply, &x);
        ck_assert_uint_eq(x.bad, 0);
        ck_assert_uint_eq(x.records, APPENDERS * PER_APPENDER);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

static void append_some(WalWriter *ww, uint32_t id, uint32_t from, uint32_t n) {
        for (uint32_t i = from; i < from + n; i++) {
                uint8_t p[8];
                unaligned_write_le32(p, id);
                unaligned_write_le32(p + 4, i);
                ck_assert_int_eq(wal_writer_append(ww, WAL_RECORD_TEST + 1, p, sizeof p, NULL), 0);
        }
}

START_TEST(test_policies) {
        /* always: a sync per record; none: no sync, durable once written. */
        for (int pass = 0; pass < 2; pass++) {
                char *dir = make_dir();
                WalSyncPolicy p = pass == 0 ? WAL_SYNC_ALWAYS : WAL_SYNC_NONE;
                Wal *w = open_replayed(dir, p, NULL, NULL);
                WalWriter *ww;
                ck_assert_int_eq(wal_writer_new(w, &ww), 0);
                wal_writer_hold(ww, true);
                append_some(ww, 0, 0, 20);
                wal_writer_hold(ww, false);
                ck_assert_int_eq(wal_writer_flush(ww), 0);
                WalWriterStats st;
                wal_writer_stats(ww, &st);
                ck_assert_uint_eq(st.durable_lsn, 20);
                ck_assert_uint_eq(st.syncs, p == WAL_SYNC_ALWAYS ? 20 : 0);
                ck_assert_int_eq(st.policy, p);
                /* A reload changes it for the next batch. */
                wal_writer_set_policy(ww, WAL_SYNC_BATCH);
                wal_writer_hold(ww, true);
                append_some(ww, 0, 20, 5);
                wal_writer_hold(ww, false);
                ck_assert_int_eq(wal_writer_flush(ww), 0);
                wal_writer_stats(ww, &st);
                ck_assert_uint_eq(st.syncs, (p == WAL_SYNC_ALWAYS ? 20 : 0) + 1);
                ww = wal_writer_free(ww);
                wal_free(w);
                Replay x = {};
                w = open_replayed(dir, WAL_SYNC_BATCH, replay_apply, &x);
                ck_assert_uint_eq(x.bad, 0);
                ck_assert_uint_eq(x.records, 25);
                wal_free(w);
                rm_dir(dir);
        }
}
END_TEST

static int snapshot_fn(void *userdata, WalSnapshot *s) {
        uint64_t *n = userdata;
        return wal_snapshot_add(s, WAL_RECORD_TEST, n, 8);
}

START_TEST(test_compaction) {
        char *dir = make_dir();
        Wal *w = open_replayed(dir, WAL_SYNC_BATCH, NULL, NULL);
        WalWriter *ww;
        ck_assert_int_eq(wal_writer_new(w, &ww), 0);
        /* 30 records, a snapshot as of them queued behind them, then 12 more: the thread
         * writes the 30 to the old log, replaces it, and the 12 go to the new one. */
        wal_writer_hold(ww, true);
        append_some(ww, 0, 0, 30);
        uint64_t n = 30;
        void *snap;
        size_t size;
        uint64_t records;
        ck_assert_int_eq(wal_snapshot_build(snapshot_fn, &n, 30, &snap, &size, &records), 0);
        ck_assert_uint_eq(records, 1);
        ck_assert_int_eq(wal_writer_compact(ww, snap, size, 29, records), -EINVAL); /* not the last LSN */
        ck_assert_int_eq(wal_snapshot_build(snapshot_fn, &n, 30, &snap, &size, &records), 0);
        ck_assert_int_eq(wal_writer_compact(ww, snap, size, 30, records), 0);
        ck_assert(wal_writer_compacting(ww));
        ck_assert_int_eq(wal_snapshot_build(snapshot_fn, &n, 30, &snap, &size, &records), 0);
        ck_assert_int_eq(wal_writer_compact(ww, snap, size, 30, records), -EBUSY);
        append_some(ww, 1, 0, 12);
        wal_writer_hold(ww, false);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        WalWriterStats st;
        wal_writer_stats(ww, &st);
        ck_assert(!wal_writer_compacting(ww));
        ck_assert_uint_eq(st.compactions, 1);
        ck_assert_uint_eq(st.durable_lsn, 42);
        ww = wal_writer_free(ww);
        wal_free(w);

        Replay x = {};
        w = open_replayed(dir, WAL_SYNC_BATCH, replay_apply, &x);
        ck_assert_uint_eq(x.snapshot, 30);
        ck_assert_uint_eq(x.bad, 0);
        ck_assert_uint_eq(x.records, 12); /* the log holds only what came after the snapshot */
        ck_assert_uint_eq(x.next[1], 12);
        ck_assert_uint_eq(wal_last_lsn(w), 42);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* A writer whose compaction cannot write its snapshot (wal.snapshot.tmp is a
 * directory, as a full disk would fail it): 30 records, the compaction as of them, 12
 * more, flushed. *ret_obstacle: the directory's path. */
static WalWriter *failing_compaction(char *dir, Wal **ret_w, char *ret_obstacle, size_t n_obstacle) {
        Wal *w = open_replayed(dir, WAL_SYNC_BATCH, NULL, NULL);
        snprintf(ret_obstacle, n_obstacle, "%s/wal.snapshot.tmp", dir);
        ck_assert_int_eq(mkdir(ret_obstacle, 0700), 0);
        WalWriter *ww;
        ck_assert_int_eq(wal_writer_new(w, &ww), 0);
        wal_writer_hold(ww, true);
        append_some(ww, 0, 0, 30);
        uint64_t n = 30;
        void *snap;
        size_t size;
        uint64_t records;
        ck_assert_int_eq(wal_snapshot_build(snapshot_fn, &n, 30, &snap, &size, &records), 0);
        ck_assert_int_eq(wal_writer_compact(ww, snap, size, 30, records), 0);
        append_some(ww, 1, 0, 12);
        wal_writer_hold(ww, false);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        *ret_w = w;
        return ww;
}

/* A compaction that cannot write its snapshot (wal.snapshot.tmp is a directory here, as
 * a full disk would fail it) changes nothing: the records around it go on into the old
 * log, the writer takes more, nothing is lost at replay, and a later compaction works. */
START_TEST(test_compaction_fails) {
        char *dir = make_dir(), obstacle[512];
        Wal *w;
        WalWriter *ww = failing_compaction(dir, &w, obstacle, sizeof obstacle);
        WalWriterStats st;
        wal_writer_stats(ww, &st);
        ck_assert(!wal_writer_compacting(ww));
        ck_assert_int_eq(st.error, 0);
        ck_assert_uint_eq(st.compactions, 0);
        ck_assert_uint_eq(st.compaction_failures, 1);
        ck_assert_int_lt(st.compaction_error, 0);
        ck_assert_uint_eq(st.durable_lsn, 42);
        /* It takes more, and once the obstacle is gone the next compaction works. */
        append_some(ww, 1, 12, 8);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        ck_assert_int_eq(rmdir(obstacle), 0);
        uint64_t n = 50, records;
        void *snap;
        size_t size;
        ck_assert_int_eq(wal_snapshot_build(snapshot_fn, &n, 50, &snap, &size, &records), 0);
        ck_assert_int_eq(wal_writer_compact(ww, snap, size, 50, records), 0);
        append_some(ww, 2, 0, 5);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        wal_writer_stats(ww, &st);
        ck_assert_int_eq(st.error, 0);
        ck_assert_uint_eq(st.compactions, 1);
        ck_assert_uint_eq(st.durable_lsn, 55);
        ww = wal_writer_free(ww);
        wal_free(w);

        Replay x = {};
        w = open_replayed(dir, WAL_SYNC_BATCH, replay_apply, &x);
        ck_assert_uint_eq(x.snapshot, 50);
        ck_assert_uint_eq(x.bad, 0);
        ck_assert_uint_eq(x.records, 5);
        ck_assert_uint_eq(wal_last_lsn(w), 55);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* The same failing compaction, and the records around it replayed from the old log. */
START_TEST(test_compaction_fails_replay) {
        char *dir = make_dir(), obstacle[512];
        Wal *w;
        WalWriter *ww = failing_compaction(dir, &w, obstacle, sizeof obstacle);
        ww = wal_writer_free(ww);
        wal_free(w);

        Replay x = {};
        w = open_replayed(dir, WAL_SYNC_BATCH, replay_apply, &x);
        ck_assert_uint_eq(x.snapshot, 0);
        ck_assert_uint_eq(x.bad, 0);
        ck_assert_uint_eq(x.records, 42);
        ck_assert_uint_eq(x.next[0], 30);
        ck_assert_uint_eq(x.next[1], 12);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

static uint64_t mono_usec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000ULL + (uint64_t)ts.tv_nsec / 1000ULL;
}

static void *release_after_200ms(void *userdata) {
        usleep(200 * 1000);
        wal_writer_hold(userdata, false);
        return NULL;
}

/* A full pending batch (a stalled disk: the thread holds here) makes an append wait for
 * room, not fail at once: taken in time, the record goes in and the writer stays
 * healthy; past the wait, -ENOBUFS, and nothing of it is in the log. */
START_TEST(test_full_batch_waits) {
        char *dir = make_dir();
        Wal *w = open_replayed(dir, WAL_SYNC_BATCH, NULL, NULL);
        WalWriter *ww;
        WalWriterStats st;
        static uint8_t payload[4096];
        const size_t rec = wal_record_size(sizeof payload), max = 64 * 1024;
        ck_assert_int_eq(wal_writer_new(w, &ww), 0);
        wal_writer_set_limits(ww, max, 300 * 1000);

        wal_writer_hold(ww, true);
        size_t n = max / rec;
        for (size_t i = 0; i < n; i++)
                ck_assert_int_ge(wal_writer_append_deferred(ww, WAL_RECORD_TEST + 1, payload, sizeof payload, NULL), 0);
        /* Still stalled when the wait ends: refused, the writer not failed. */
        uint64_t t0 = mono_usec();
        ck_assert_int_eq(wal_writer_append(ww, WAL_RECORD_TEST + 1, payload, sizeof payload, NULL), -ENOBUFS);
        ck_assert_uint_ge(mono_usec() - t0, 250 * 1000);
        wal_writer_stats(ww, &st);
        ck_assert_uint_eq(st.full_waits, 1);
        ck_assert_int_eq(st.error, 0);
        ck_assert_uint_eq(st.assigned_lsn, n);

        /* The disk comes back within the wait: the append goes in. */
        pthread_t t;
        ck_assert_int_eq(pthread_create(&t, NULL, release_after_200ms, ww), 0);
        t0 = mono_usec();
        uint64_t lsn = 0;
        ck_assert_int_eq(wal_writer_append(ww, WAL_RECORD_TEST + 1, payload, sizeof payload, &lsn), 0);
        ck_assert_uint_ge(mono_usec() - t0, 150 * 1000);
        ck_assert_int_eq(pthread_join(t, NULL), 0);
        ck_assert_uint_eq(lsn, n + 1);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        wal_writer_stats(ww, &st);
        ck_assert_uint_eq(st.full_waits, 2);
        ck_assert_int_eq(st.error, 0);
        ck_assert_uint_eq(st.durable_lsn, n + 1);

        /* A burst's buffers are given back once batches are small again. */
        wal_writer_set_limits(ww, 0, 0);
        static uint8_t big[512 * 1024];
        wal_writer_hold(ww, true);
        for (int i = 0; i < 40; i++) /* 20 MiB in one batch */
                ck_assert_int_ge(wal_writer_append_deferred(ww, WAL_RECORD_TEST + 1, big, sizeof big, NULL), 0);
        wal_writer_hold(ww, false);
        ck_assert_int_eq(wal_writer_flush(ww), 0);
        wal_writer_stats(ww, &st);
        ck_assert_uint_ge(st.buffer_bytes, 40 * sizeof big);
        for (int i = 0; i < 2; i++) { /* each buffer takes a small batch once */
                ck_assert_int_eq(wal_writer_append(ww, WAL_RECORD_TEST + 1, payload, 8, NULL), 0);
                ck_assert_int_eq(wal_writer_flush(ww), 0);
        }
        wal_writer_stats(ww, &st);
        ck_assert_uint_lt(st.buffer_bytes, WAL_WRITER_KEEP_CAP);
        ww = wal_writer_free(ww);
        wal_free(w);

        /* Replay: the records that went in, the refused one not. */
        Wal *w2 = NULL;
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_BATCH, &w2), 0);
        ck_assert_int_eq(wal_replay(w2, NULL, NULL), 0);
        ck_assert_uint_eq(wal_last_lsn(w2), n + 1 + 40 + 2);
        wal_free(w2);
        rm_dir(dir);
}
END_TEST

int main(void) {
        Suite *s = suite_create("wal-writer");
        TCase *tc = tcase_create("writer");
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_group_commit);
        tcase_add_test(tc, test_wait_queue_reserve);
        tcase_add_test(tc, test_lazy);
        tcase_add_test(tc, test_load);
        tcase_add_test(tc, test_policies);
        tcase_add_test(tc, test_compaction);
        tcase_add_test(tc, test_compaction_fails);
        tcase_add_test(tc, test_compaction_fails_replay);
        tcase_add_test(tc, test_full_batch_waits);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
