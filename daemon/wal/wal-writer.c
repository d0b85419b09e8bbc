/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "unaligned.h"
#include "wal/wal-writer.h"

/* A compaction queued at a point of the record stream: the records before `split` bytes
 * of the pending batch are the ones up to `lsn`, which the snapshot holds. */
typedef struct CompactJob {
        void *snapshot;
        size_t size;
        uint64_t lsn;
        uint64_t records;   /* in the snapshot */
        size_t split;       /* bytes of the pending batch up to lsn */
} CompactJob;

struct WalWriter {
        Wal *wal;              /* its I/O is the thread's from wal_writer_new() on */
        pthread_t thread;
        bool started;
        pthread_mutex_t lock;
        /* The thread waits here for work, posted once per sleep (wake_take()). Not a
         * condition variable: pthread_cond_wait() takes the mutex back marked as
         * contended, so the thread's next unlock made a FUTEX_WAKE system call for
         * nobody, once per batch. */
        sem_t wake;
        pthread_cond_t done;   /* wal_writer_flush() and a full append wait here (CLOCK_MONOTONIC) */
        int efd;

        /* Under lock. */
        bool sleeping;         /* the thread waits on `wake` (or is about to) */
        bool stop;
        bool hold;
        bool urgent;           /* the pending batch is waited for, or urged: write now */
        WalSyncPolicy policy;
        uint8_t *pending;      /* encoded records, LSNs durable+1.. in order */
        size_t pending_size, pending_cap;
        uint64_t pending_records;
        CompactJob compact;
        bool have_compact;     /* queued, not yet taken by the thread */
        bool compacting;       /* queued or running */
        unsigned room_waiters; /* appends waiting for the pending batch to be taken */
        size_t pending_max;
        uint64_t full_wait_usec;
        size_t batch_cap;      /* the thread's buffer, for the stats */
        WalWriterStats stats;
};

static void lock(WalWriter *ww) {
        pthread_mutex_lock(&ww->lock);
}

static void unlock(WalWriter *ww) {
        pthread_mutex_unlock(&ww->lock);
}

/* Under lock, by whoever just gave the thread something to look at: true when the thread
 * sleeps and is to be posted (wake_post(), best after unlock(), so that it does not wake
 * into a held mutex). It then counts as awake: one post per sleep, so the semaphore never
 * holds a post the thread's next sleep would take for a wake-up. */
static bool wake_take(WalWriter *ww) {
        bool s = ww->sleeping;
        ww->sleeping = false;
        return s;
}

static void wake_post(WalWriter *ww) {
        (void)sem_post(&ww->wake);
}

/* Under lock: waits until there is a batch to take (waited for or urged, a compaction)
 * or the thread is to stop. Records nobody waits for wait for one that is (it makes them
 * durable with it) or for their owner's urge (wal_writer_append_deferred): the thread
 * keeps no timer of its own. */
static void wait_for_work(WalWriter *ww) {
        while (!ww->stop) {
                if (!ww->hold && (ww->have_compact || (ww->pending_size > 0 && ww->urgent)))
                        return;
                /* Whoever changes what is checked above does so under the lock, then sees
                 * `sleeping` and posts: a change after the unlock below is never missed. */
                ww->sleeping = true;
                unlock(ww);
                while (sem_wait(&ww->wake) < 0 && errno == EINTR)
                        ;
                lock(ww);
        }
}

static void kick(WalWriter *ww) {
        uint64_t one = 1;
        /* EAGAIN: the counter is full, the loop is woken anyway. */
        (void)!write(ww->efd, &one, sizeof one);
}

/* Writes records [p, p+n) (their LSNs end at last_lsn) and makes them durable under the
 * Wal's policy. Returns 0 or the error; *syncs counts the fdatasyncs it made. */
static int write_batch(WalWriter *ww, const uint8_t *p, size_t n, uint64_t last_lsn, bool one_by_one,
                       uint64_t *syncs) {
        Wal *w = ww->wal;
        int r;

        if (n == 0)
                return 0;
        if (!one_by_one) {
                r = wal_write_encoded(w, p, n, last_lsn);
                if (r >= 0 && wal_get_policy(w) != WAL_SYNC_NONE && wal_needs_sync(w)) {
                        r = wal_sync(w);
                        if (r >= 0)
                                (*syncs)++;
                }
                return r;
        }
        /* Sync=always: a write and a sync per record, in order. */
        for (size_t off = 0; off < n;) {
                size_t size = wal_record_size(unaligned_read_le32(p + off));
                uint64_t lsn = unaligned_read_le64(p + off + 8);
                r = wal_write_encoded(w, p + off, size, lsn);
                if (r >= 0 && wal_needs_sync(w)) {
                        r = wal_sync(w);
                        if (r >= 0)
                                (*syncs)++;
                }
                if (r < 0)
                        return r;
                off += size;
        }
        return 0;
}

static void *writer_thread(void *userdata) {
        WalWriter *ww = userdata;
        uint8_t *batch = NULL;
        size_t batch_cap = 0;

        lock(ww);
        for (;;) {
                wait_for_work(ww);
                if (ww->pending_size == 0 && !ww->have_compact)
                        break; /* stopping, and everything is written */
                ww->urgent = false; /* whoever waits is in this batch */

                /* Take the whole batch (and the compaction, if one is queued): the loop
                 * keeps appending into the other buffer meanwhile. */
                uint8_t *b = ww->pending;
                size_t n = ww->pending_size, cap = ww->pending_cap;
                uint64_t last_lsn = ww->stats.assigned_lsn;
                ww->pending = batch;
                ww->pending_cap = batch_cap;
                ww->pending_size = 0;
                ww->pending_records = 0;
                batch = b;
                batch_cap = cap;
                ww->batch_cap = cap;
                if (ww->room_waiters > 0)
                        pthread_cond_broadcast(&ww->done); /* room for a full append */
                CompactJob job = ww->compact;
                bool compact = ww->have_compact;
                ww->have_compact = false;
                ww->compact = (CompactJob){};
                WalSyncPolicy policy = ww->policy;
                bool failed = ww->stats.error < 0;
                unlock(ww);

                Wal *w = ww->wal;
                uint64_t syncs = 0, before = wal_synced_lsn(w);
                int r = failed ? -EIO : 0;
                if (r >= 0 && wal_get_policy(w) != policy)
                        wal_set_policy(w, policy);
                bool one_by_one = policy == WAL_SYNC_ALWAYS;
                int compact_error = 0;
                if (r >= 0 && compact) {
                        /* The records the snapshot holds go to the old log first. */
                        r = write_batch(ww, batch, job.split, job.lsn, one_by_one, &syncs);
                        if (r >= 0) {
                                /* A snapshot that could not be written (a full disk) leaves
                                 * the log as it was: the records go on into it, and the
                                 * loop tries again later. Only a log that takes no more
                                 * records fails the writer. */
                                compact_error = wal_compact_buffer(w, job.snapshot, job.size, job.lsn, job.records);
                                if (compact_error < 0 && wal_is_broken(w))
                                        r = compact_error;
                        }
                        if (r >= 0)
                                r = write_batch(ww, batch + job.split, n - job.split, last_lsn, one_by_one, &syncs);
                } else if (r >= 0)
                        r = write_batch(ww, batch, n, last_lsn, one_by_one, &syncs);
                free(job.snapshot);
                /* A burst's buffer is not kept for good: the next batch that needs more
                 * grows it again. */
                if (batch_cap > WAL_WRITER_KEEP_CAP && n < batch_cap / 4) {
                        free(batch);
                        batch = NULL;
                        batch_cap = 0;
                }
                const WalStats *ws = wal_get_stats(w);
                uint64_t durable = wal_synced_lsn(w);

                lock(ww);
                if (r < 0 && ww->stats.error == 0) {
                        ww->stats.error = r;
                        log_error_errno(r, "WAL: records after LSN %" PRIu64 " could not be made durable; "
                                        "no further record is accepted: %m", durable);
                }
                ww->stats.durable_lsn = durable;
                ww->stats.writes += n > 0 ? 1 : 0;
                ww->stats.syncs += syncs;
                if (syncs > 0 && durable > before) {
                        ww->stats.synced_records += durable - before;
                        ww->stats.max_batch = MAX(ww->stats.max_batch, one_by_one ? 1 : (durable - before) / syncs);
                }
                ww->stats.log_bytes = ws->log_bytes;
                ww->stats.compactions = ws->compactions;
                ww->stats.snapshot_records = ws->snapshot_records;
                ww->batch_cap = batch_cap;
                if (compact)
                        ww->compacting = false;
                if (compact_error < 0 && r >= 0) {
                        ww->stats.compaction_failures++;
                        ww->stats.compaction_error = compact_error;
                }
                pthread_cond_broadcast(&ww->done);
                /* The loop's wake-up after the unlock: woken while this thread still held
                 * the lock, the loop blocked on it (a FUTEX_WAIT and a FUTEX_WAKE a batch). */
                unlock(ww);
                kick(ww);
                lock(ww);
        }
        unlock(ww);
        free(batch);
        return NULL;
}

int wal_writer_new(Wal *w, WalWriter **ret) {
        WalWriter *ww = calloc(1, sizeof *ww);
        int r;

        if (!ww)
                return -ENOMEM;
        ww->wal = w;
        ww->policy = wal_get_policy(w);
        ww->stats.assigned_lsn = ww->stats.durable_lsn = wal_last_lsn(w);
        ww->stats.log_bytes = wal_get_stats(w)->log_bytes;
        ww->stats.compactions = wal_get_stats(w)->compactions;
        ww->stats.snapshot_records = wal_get_stats(w)->snapshot_records;
        ww->pending_max = WAL_WRITER_PENDING_MAX;
        ww->full_wait_usec = WAL_WRITER_FULL_WAIT_USEC;
        pthread_mutex_init(&ww->lock, NULL);
        (void)sem_init(&ww->wake, 0, 0);
        pthread_condattr_t attr;
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&ww->done, &attr);
        pthread_condattr_destroy(&attr);
        ww->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (ww->efd < 0) {
                r = -errno;
                wal_writer_free(ww);
                return r;
        }
        r = -pthread_create(&ww->thread, NULL, writer_thread, ww);
        if (r < 0) {
                wal_writer_free(ww);
                return r;
        }
        (void)pthread_setname_np(ww->thread, "epd-wal");
        ww->started = true;
        *ret = ww;
        return 0;
}

WalWriter *wal_writer_free(WalWriter *ww) {
        if (!ww)
                return NULL;
        if (ww->started) {
                lock(ww);
                ww->stop = true;
                bool wake = wake_take(ww);
                unlock(ww);
                if (wake)
                        wake_post(ww);
                pthread_join(ww->thread, NULL);
        }
        pthread_mutex_destroy(&ww->lock);
        (void)sem_destroy(&ww->wake);
        pthread_cond_destroy(&ww->done);
        safe_close(ww->efd);
        free(ww->pending);
        free(ww->compact.snapshot);
        free(ww);
        return NULL;
}

void wal_writer_set_limits(WalWriter *ww, size_t pending_max, uint64_t full_wait_usec) {
        lock(ww);
        ww->pending_max = pending_max ? pending_max : WAL_WRITER_PENDING_MAX;
        ww->full_wait_usec = full_wait_usec ? full_wait_usec : WAL_WRITER_FULL_WAIT_USEC;
        unlock(ww);
}

/* Under the lock: the pending batch has no room for `size` more bytes. Urges the thread
 * to take it and waits until it has, up to full_wait_usec. 0 with room, else -ENOBUFS
 * (or -EIO: the writer failed meanwhile). */
static int wait_for_room(WalWriter *ww, size_t size) {
        struct timespec deadline;
        int r = 0;

        if (size > ww->pending_max)
                return -ENOBUFS;
        if (!ww->urgent) {
                ww->urgent = true;
                if (wake_take(ww))
                        wake_post(ww); /* under the lock: this caller waits below anyway */
        }
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        uint64_t ns = (uint64_t)deadline.tv_nsec + (ww->full_wait_usec % 1000000ULL) * 1000ULL;
        deadline.tv_sec += (time_t)(ww->full_wait_usec / 1000000ULL + ns / 1000000000ULL);
        deadline.tv_nsec = (long)(ns % 1000000000ULL);
        ww->stats.full_waits++;
        ww->room_waiters++;
        while (ww->pending_size + size > ww->pending_max && ww->stats.error == 0 && r == 0)
                r = pthread_cond_timedwait(&ww->done, &ww->lock, &deadline) == ETIMEDOUT ? -ENOBUFS : 0;
        ww->room_waiters--;
        if (ww->stats.error < 0)
                return -EIO;
        return ww->pending_size + size > ww->pending_max ? -ENOBUFS : 0;
}

/* waited: someone waits for the record (write now); else the caller times the batch and
 * urges. Returns 1 when a record nobody waits for begins a batch nobody urged (the
 * caller's timer starts), else 0, or the error. The thread is signalled after the lock is
 * released, so that it does not wake into a held mutex. */
static int append(WalWriter *ww, uint16_t type, const void *payload, size_t len, bool waited,
                  uint64_t *ret_lsn) {
        size_t size;
        bool wake = false;
        int r = 0;

        if (len > WAL_RECORD_PAYLOAD_MAX || (len > 0 && !payload) || type == WAL_RECORD_SNAPSHOT_END)
                return -EINVAL;
        size = wal_record_size(len);
        lock(ww);
        if (ww->stats.error < 0)
                r = -EIO;
        else if (ww->pending_size + size > ww->pending_max)
                r = wait_for_room(ww, size);
        if (r >= 0 && ww->pending_size + size > ww->pending_cap) {
                size_t cap = MAX(MAX(ww->pending_cap * 2, ww->pending_size + size), (size_t)65536);
                uint8_t *p = realloc(ww->pending, cap);
                if (p) {
                        ww->pending = p;
                        ww->pending_cap = cap;
                } else
                        r = -ENOMEM;
        }
        if (r >= 0) {
                uint64_t lsn = ++ww->stats.assigned_lsn;
                wal_record_encode(ww->pending + ww->pending_size, lsn, type, payload, len);
                ww->pending_size += size;
                ww->pending_records++;
                ww->stats.appended++;
                ww->stats.appended_bytes += size;
                if (ret_lsn)
                        *ret_lsn = lsn;
                /* The thread hears of every record someone waits for, never of one
                 * nobody waits for. */
                if (waited) {
                        if (!ww->urgent)
                                wake = wake_take(ww);
                        ww->urgent = true;
                } else
                        r = ww->pending_records == 1 && !ww->urgent;
        }
        unlock(ww);
        if (wake)
                wake_post(ww);
        return r;
}

int wal_writer_append(WalWriter *ww, uint16_t type, const void *payload, size_t len, uint64_t *ret_lsn) {
        return append(ww, type, payload, len, true, ret_lsn);
}

int wal_writer_append_deferred(WalWriter *ww, uint16_t type, const void *payload, size_t len,
                               uint64_t *ret_lsn) {
        return append(ww, type, payload, len, false, ret_lsn);
}

void wal_writer_urge(WalWriter *ww) {
        bool wake = false;
        lock(ww);
        if (ww->pending_size > 0 && !ww->urgent) {
                ww->urgent = true;
                wake = wake_take(ww);
        }
        unlock(ww);
        if (wake)
                wake_post(ww);
}

int wal_writer_compact(WalWriter *ww, void *snapshot, size_t size, uint64_t lsn, uint64_t records) {
        bool wake = false;
        int r = 0;

        lock(ww);
        if (ww->stats.error < 0)
                r = -EIO;
        else if (ww->compacting)
                r = -EBUSY;
        else if (lsn != ww->stats.assigned_lsn)
                r = -EINVAL;
        else {
                ww->compact = (CompactJob){
                        .snapshot = snapshot,
                        .size = size,
                        .lsn = lsn,
                        .records = records,
                        .split = ww->pending_size,
                };
                ww->have_compact = ww->compacting = true;
                wake = wake_take(ww);
        }
        unlock(ww);
        if (wake)
                wake_post(ww);
        if (r < 0)
                free(snapshot);
        return r;
}

bool wal_writer_compacting(WalWriter *ww) {
        lock(ww);
        bool c = ww->compacting;
        unlock(ww);
        return c;
}

int wal_writer_fd(WalWriter *ww) {
        return ww->efd;
}

void wal_writer_ack(WalWriter *ww) {
        uint64_t v;
        (void)!read(ww->efd, &v, sizeof v);
}

void wal_writer_stats(WalWriter *ww, WalWriterStats *ret) {
        lock(ww);
        *ret = ww->stats;
        ret->policy = ww->policy;
        ret->buffer_bytes = ww->pending_cap + ww->batch_cap;
        unlock(ww);
}

uint64_t wal_writer_durable(WalWriter *ww) {
        lock(ww);
        uint64_t d = ww->stats.durable_lsn;
        unlock(ww);
        return d;
}

uint64_t wal_writer_assigned(WalWriter *ww) {
        lock(ww);
        uint64_t a = ww->stats.assigned_lsn;
        unlock(ww);
        return a;
}

int wal_writer_flush(WalWriter *ww) {
        return wal_writer_wait(ww, wal_writer_assigned(ww));
}

int wal_writer_wait(WalWriter *ww, uint64_t want) {
        lock(ww);
        if (ww->stats.durable_lsn < want && ww->pending_size > 0 && !ww->urgent) {
                ww->urgent = true; /* someone waits now */
                if (wake_take(ww))
                        wake_post(ww); /* under the lock: this caller waits below anyway */
        }
        while (ww->stats.durable_lsn < want && ww->stats.error == 0)
                pthread_cond_wait(&ww->done, &ww->lock);
        int r = ww->stats.durable_lsn >= want ? 0 : ww->stats.error;
        unlock(ww);
        return r;
}

void wal_writer_set_policy(WalWriter *ww, WalSyncPolicy p) {
        if (p < 0 || p >= _WAL_SYNC_POLICY_MAX)
                return;
        lock(ww);
        ww->policy = p;
        unlock(ww);
}

void wal_writer_hold(WalWriter *ww, bool hold) {
        lock(ww);
        ww->hold = hold;
        bool wake = wake_take(ww);
        unlock(ww);
        if (wake)
                wake_post(ww);
}

int wal_wait_queue_reserve(WalWaitQueue *q, size_t more) {
        if (q->cap - q->n >= more)
                return 0;
        size_t cap = MAX(q->cap * 2, (size_t)64);
        while (cap - q->n < more)
                cap *= 2;
        WalWaiter *v = malloc(cap * sizeof *v);
        if (!v)
                return -ENOMEM;
        for (size_t i = 0; i < q->n; i++)
                v[i] = q->v[(q->head + i) % q->cap];
        free(q->v);
        q->v = v;
        q->cap = cap;
        q->head = 0;
        return 0;
}

int wal_wait_queue_push(WalWaitQueue *q, uint64_t lsn, WalWaitFn fn, void *userdata) {
        if (!fn)
                return -EINVAL;
        if (q->n > 0 && q->v[(q->head + q->n - 1) % q->cap].lsn > lsn)
                return -EINVAL;
        int r = wal_wait_queue_reserve(q, 1);
        if (r < 0)
                return r;
        q->v[(q->head + q->n) % q->cap] = (WalWaiter){ lsn, fn, userdata };
        q->n++;
        return 0;
}

size_t wal_wait_queue_advance(WalWaitQueue *q, uint64_t durable, int error) {
        size_t ran = 0;
        while (q->n > 0) {
                WalWaiter w = q->v[q->head];
                if (w.lsn > durable && error == 0)
                        break;
                /* Out of the queue before it runs: fn may push again. */
                q->head = (q->head + 1) % q->cap;
                q->n--;
                w.fn(w.userdata, w.lsn > durable ? error : 0);
                ran++;
        }
        if (q->n == 0)
                q->head = 0;
        return ran;
}

void wal_wait_queue_done(WalWaitQueue *q, int error) {
        (void)wal_wait_queue_advance(q, 0, error < 0 ? error : -ECANCELED);
        free(q->v);
        *q = (WalWaitQueue){};
}
