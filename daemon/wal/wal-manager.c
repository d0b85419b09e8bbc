/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <inttypes.h>

#include "bus-error.h"
#include "log.h"
#include "time-util.h"
#include "wal/wal-manager.h"
#include "wal/wal-writer.h"

/* A reply waiting for the durability of the records before it. */
typedef struct Pending {
        sd_bus_message *call, *reply;
} Pending;

/* The subsystem's writer and queue, hung on the Wal (wal_set_userdata). */
typedef struct WalGlue {
        WalWriter *writer;
        sd_event_source *durable;  /* the writer's eventfd: the durable point moved */
        uint64_t last;             /* LSN of the last record this loop appended */
        WalWaitQueue waiting;      /* replies (and other acknowledgements) in LSN order */
        uint64_t compactions;      /* the writer's, as last seen */
        uint64_t compaction_failures; /* the writer's, as last seen */
        uint64_t compact_after;    /* after a failed compaction: the log's size at which
                                    * the next is tried (another CompactSize= of records) */
        sd_event_source *urge;     /* idle-priority defer: urge the writer once the loop
                                    * has handled every request that was ready */
        uint64_t urge_since;       /* CLOCK_MONOTONIC µs the urge was first deferred; 0: none */
        uint64_t urged_lsn;        /* the writer was urged with every record up to it */
        sd_event_source *lazy;     /* the lazy bound of records nobody waits for: the
                                    * loop times them, so the writer thread is not woken
                                    * for each batch of them */
        uint64_t batch_lsn;        /* the first record of the latest such batch */
        uint64_t batch_since;      /* CLOCK_MONOTONIC µs it began */
        bool lazy_pending;         /* that batch is bounded by manager_run()'s loop (its
                                    * wait's timeout) rather than by the timer `lazy` */
        int refused;               /* an append was refused (its change is not in the
                                    * log): every later append and acknowledgement fails
                                    * with it, as after a failed write (docs/wal.md) */
} WalGlue;

static WalGlue *glue(Manager *m) {
        return m->wal ? wal_get_userdata(m->wal) : NULL;
}

/* A reply queued this long after a deferred urge urges at once (a busy loop still syncs). */
#define WAL_URGE_DEFER_MAX_USEC 200ULL

/* The writer takes every record appended so far in its next batch. */
static void urge_writer(WalGlue *g) {
        g->urge_since = 0;
        g->urged_lsn = g->last;
        wal_writer_urge(g->writer);
}

static void urge_now(WalGlue *g) {
        if (g->urge)
                (void)sd_event_source_set_enabled(g->urge, SD_EVENT_OFF);
        urge_writer(g);
}

static int on_urge(sd_event_source *s, void *userdata) {
        WalGlue *g = glue(userdata);
        if (g && g->writer)
                urge_now(g);
        return 0;
}

/* The lazy timer: the latest batch of records nobody waits for is urged once it is
 * WAL_WRITER_LAZY_USEC old, unless it is durable already (a reply's sync took it); a
 * batch that began after the timer was armed gets its own full bound. */
static int on_lazy(sd_event_source *s, uint64_t usec, void *userdata) {
        WalGlue *g = glue(userdata);
        if (!g || !g->writer || wal_writer_durable(g->writer) >= g->batch_lsn)
                return 0;
        uint64_t due = g->batch_since + WAL_WRITER_LAZY_USEC, now = now_usec(CLOCK_MONOTONIC);
        if (now + WAL_WRITER_LAZY_USEC / 10 >= due ||
            sd_event_source_set_time(s, due) < 0 || sd_event_source_set_enabled(s, SD_EVENT_ONESHOT) < 0)
                urge_writer(g);
        return 0;
}

/* The same bound in manager_run()'s loop, checked after every dispatch and before it
 * waits: the batch is urged once it is WAL_WRITER_LAZY_USEC old, from a tenth of that
 * before (the wait's timeout is rounded up to whole milliseconds: the urge comes within
 * a tenth of the bound either side), unless an urge took it meanwhile (a reply's).
 * Returns when the loop must be back to urge it (its wait's timeout), UINT64_MAX if it
 * need not. */
static uint64_t lazy_check(WalGlue *g) {
        if (!g->lazy_pending)
                return UINT64_MAX;
        if (g->urged_lsn >= g->batch_lsn) {
                g->lazy_pending = false;
                return UINT64_MAX;
        }
        uint64_t due = g->batch_since + WAL_WRITER_LAZY_USEC - WAL_WRITER_LAZY_USEC / 10;
        if (now_usec(CLOCK_MONOTONIC) >= due) {
                g->lazy_pending = false;
                urge_writer(g);
                return UINT64_MAX;
        }
        return due;
}

/* A batch of records nobody waits for began (its first record: lsn). In manager_run()'s
 * loop, the loop's own wait bounds it (lazy_check()): no timer is armed, then disarmed
 * or fired for nothing when a reply's sync takes the batch first (a timerfd_settime
 * each, and the wake-up). Elsewhere the timer: an armed timer is left as it is (on_lazy
 * re-arms it for this batch if need be), one timer syscall per bound at most, however
 * many batches. */
static void lazy_arm(Manager *m, WalGlue *g, uint64_t lsn) {
        int enabled = SD_EVENT_OFF;
        g->batch_lsn = lsn;
        g->batch_since = now_usec(CLOCK_MONOTONIC);
        if (m->in_loop) {
                g->lazy_pending = true;
                return;
        }
        if (!g->lazy || (sd_event_source_get_enabled(g->lazy, &enabled) >= 0 && enabled != SD_EVENT_OFF))
                return;
        if (sd_event_source_set_time(g->lazy, g->batch_since + WAL_WRITER_LAZY_USEC) < 0 ||
            sd_event_source_set_enabled(g->lazy, SD_EVENT_ONESHOT) < 0)
                urge_writer(g); /* no timer: durable now rather than late */
}

static const Subsystem *journal_owner(uint16_t type) {
        for (const Subsystem *const *sp = manager_subsystems(); *sp; sp++)
                if ((*sp)->journal)
                        for (const uint8_t *f = (*sp)->journal->families; *f; f++)
                                if (*f == type >> 8)
                                        return *sp;
        return NULL;
}

static int apply(void *userdata, const WalRecord *r, bool from_snapshot) {
        Manager *m = userdata;
        const Subsystem *s = journal_owner(r->type);
        int k;

        if (!s || !s->journal->apply_record) {
                /* A record of a subsystem this daemon does not run: kept, not applied. */
                log_debug("WAL: record %" PRIu64 " of type 0x%04x (%s) not applied here.", r->lsn, r->type,
                          wal_record_type_to_string(r->type));
                return 0;
        }
        k = s->journal->apply_record(m, r->type, r->payload, r->length);
        if (k == -EBADMSG) {
                /* Its checksum held: epdd wrote it, and this version cannot read it. One
                 * record is skipped, not the log with every record after it (replay
                 * stopping here would start a new log). */
                log_error_errno(k, "WAL: %s record %" PRIu64 " (%s) is malformed; skipped.", s->name, r->lsn,
                                wal_record_type_to_string(r->type));
                return 0;
        }
        if (k == -ENOMEM)
                /* Not the record's fault: the start fails (and is tried again) rather than
                 * go on without the state it holds. */
                return log_error_errno(k, "WAL: %s record %" PRIu64 " (%s): out of memory replaying it.", s->name,
                                       r->lsn, wal_record_type_to_string(r->type));
        if (k < 0)
                log_full_errno(k == -ENOENT || k == -ESTALE ? LOG_DEBUG : LOG_WARNING, k,
                               "WAL: %s record %" PRIu64 " (%s) does not apply: %m", s->name, r->lsn,
                               wal_record_type_to_string(r->type));
        return 0;
}

static int snapshot_add(void *userdata, uint16_t type, const void *rec, size_t len) {
        return wal_snapshot_add(userdata, type, rec, len);
}

static int snapshot(void *userdata, WalSnapshot *s) {
        Manager *m = userdata;

        /* In start order: sequences before the handoffs and workflows that refer to them. */
        for (const Subsystem *const *sp = manager_subsystems(); *sp; sp++)
                if ((*sp)->journal && (*sp)->journal->snapshot) {
                        int r = (*sp)->journal->snapshot(m, snapshot_add, s);
                        if (r < 0)
                                return r;
                }
        return 0;
}

static void reply_one(void *userdata, int error) {
        Pending *p = userdata;
        /* Never acknowledge what is not known durable. */
        if (error < 0)
                (void)sd_bus_reply_method_errorf(p->call, EPD_ERROR_FAILED,
                                                 "The journal could not be made durable: %s", strerror(-error));
        else
                (void)sd_bus_send(NULL, p->reply, NULL);
        sd_bus_message_unref(p->call);
        sd_bus_message_unref(p->reply);
        free(p);
}

static void maybe_compact(Manager *m, WalGlue *g, const WalWriterStats *st) {
        /* Not after a refused append either: the state in memory then holds a change
         * whose record was refused (its caller told Failed), which a snapshot would make
         * durable after all. */
        if (st->error < 0 || g->refused < 0 || st->log_bytes <= MAX(m->config.wal_compact_bytes, g->compact_after) ||
            wal_writer_compacting(g->writer))
                return;
        /* The state is taken here, where it lives, as of the last record appended; the
         * writer thread writes it out after the records before it. */
        void *snap;
        size_t size;
        uint64_t records;
        int r = wal_snapshot_build(snapshot, m, g->last, &snap, &size, &records);
        if (r >= 0)
                r = wal_writer_compact(g->writer, snap, size, g->last, records);
        if (r < 0) {
                /* As for a compaction the writer failed: not again at every batch (each
                 * try builds the whole state), but after another CompactSize= of log. */
                g->compact_after = st->log_bytes + m->config.wal_compact_bytes;
                log_warning_errno(r, "WAL: cannot compact (%m); next try at %" PRIu64 " bytes.", g->compact_after);
        } else
                log_debug("WAL compaction queued: %" PRIu64 " snapshot records as of LSN %" PRIu64 ".", records,
                          g->last);
}

static int on_durable(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Manager *m = userdata;
        WalGlue *g = glue(m);
        WalWriterStats st;

        if (!g || !g->writer)
                return 0;
        wal_writer_ack(g->writer);
        wal_writer_stats(g->writer, &st);
        (void)wal_wait_queue_advance(&g->waiting, st.durable_lsn, st.error);
        if (st.compactions > g->compactions) {
                g->compactions = st.compactions;
                g->compact_after = 0;
                log_info("WAL compacted: %" PRIu64 " snapshot records.", st.snapshot_records);
        }
        if (st.compaction_failures > g->compaction_failures) {
                /* The log goes on as it was; retrying at once would build a snapshot
                 * for every batch while the disk stays full. */
                g->compaction_failures = st.compaction_failures;
                g->compact_after = st.log_bytes + m->config.wal_compact_bytes;
                log_warning_errno(st.compaction_error,
                                  "WAL compaction failed (%m); the log keeps every record and grows, next try "
                                  "at %" PRIu64 " bytes.",
                                  g->compact_after);
        }
        maybe_compact(m, g, &st);
        return 0;
}

int wal_manager_refuse(Manager *m, int error, const char *what) {
        WalGlue *g = glue(m);
        if (!g || !g->writer)
                return -ENOTCONN;
        if (g->refused < 0)
                return g->refused;
        g->refused = error < 0 ? error : -EIO;
        log_error_errno(g->refused, "WAL: %s could not be journaled (%m); nothing more is journaled or "
                                    "acknowledged until epdd restarts.", what);
        return g->refused;
}

int wal_manager_append(Manager *m, uint16_t type, const void *payload, size_t len) {
        WalGlue *g = glue(m);
        uint64_t lsn;
        if (!g || !g->writer)
                return -ENOTCONN;
        if (g->refused < 0)
                return g->refused;
        /* Synced when a reply waits for it (wal_manager_after_durable), or at the latest
         * when the loop's lazy timer fires. */
        int r = wal_writer_append_deferred(g->writer, type, payload, len, &lsn);
        if (r == -EINVAL)
                return r; /* this record is malformed (too large): its caller's refusal */
        if (r < 0) {
                /* The log took no record (its writer failed, or it is out of room): a
                 * change made without its record, which a later record in the log would
                 * be replayed without, and a reply that counted on it would say what is
                 * not durable. Nothing is acknowledged from here until a restart. */
                g->refused = r;
                log_error_errno(r, "WAL: a record was refused (%m); nothing more is journaled or acknowledged "
                                   "until epdd restarts.");
                return r;
        }
        g->last = lsn;
        if (r > 0)
                lazy_arm(m, g, lsn);
        return 0;
}

bool wal_manager_mark_durable(Manager *m, uint64_t *mark) {
        if (*mark != 0 && *mark != UINT64_MAX && wal_manager_durable(m, *mark))
                *mark = 0;
        return *mark == 0;
}

int wal_manager_reserve_waits(Manager *m, size_t n) {
        WalGlue *g = glue(m);
        return g && g->writer ? wal_wait_queue_reserve(&g->waiting, n) : 0;
}

int wal_manager_after_durable(Manager *m, WalWaitFn fn, void *userdata) {
        WalGlue *g = glue(m);
        if (!g || !g->writer) {
                fn(userdata, 0); /* no WAL: nothing to wait for */
                return 0;
        }
        WalWriterStats st;
        wal_writer_stats(g->writer, &st);
        /* A refused record (this reply's, perhaps) is never acknowledged: from then on
         * every reply that waits for the journal fails (those queued before the refusal
         * still get their own records' answer). */
        if (g->refused < 0) {
                fn(userdata, g->refused);
                return 0;
        }
        /* At once when nothing of this loop's waits for the disk and nothing is queued
         * before it (acknowledgements leave in order). */
        if (g->waiting.n == 0 && (st.durable_lsn >= g->last || st.error < 0)) {
                fn(userdata, st.durable_lsn >= g->last ? 0 : st.error);
                return 0;
        }
        int r = wal_wait_queue_push(&g->waiting, g->last, fn, userdata);
        if (r < 0)
                return r;
        /* Someone waits: no lazy delay, but not a sync per reply either. The urge is
         * deferred to the loop's idle point, so every request that was ready when this
         * one was handled journals first and their replies share one fdatasync. That
         * point is found by the idle-priority defer source's turn: its epoll_wait(0) is
         * what sees the requests still unread in their sockets (sd-bus reads one message
         * per dispatch), which a hook run before the loop polls again would not. On a
         * loop that stays busy, a reply queued WAL_URGE_DEFER_MAX_USEC after the deferral
         * urges at once; the lazy bound (WAL_WRITER_LAZY_USEC) holds anyway. */
        uint64_t now = now_usec(CLOCK_MONOTONIC);
        if (!g->urge || (g->urge_since > 0 && now - g->urge_since >= WAL_URGE_DEFER_MAX_USEC))
                urge_now(g);
        else if (g->urge_since == 0) {
                g->urge_since = now;
                if (sd_event_source_set_enabled(g->urge, SD_EVENT_ONESHOT) < 0)
                        urge_now(g);
        }
        return 0;
}

int wal_manager_reply(Manager *m, sd_bus_message *call, sd_bus_message *reply) {
        Pending *p = malloc(sizeof *p);
        if (!p)
                return -ENOMEM;
        *p = (Pending){ sd_bus_message_ref(call), sd_bus_message_ref(reply) };
        int r = wal_manager_after_durable(m, reply_one, p);
        if (r < 0) {
                sd_bus_message_unref(p->call);
                sd_bus_message_unref(p->reply);
                free(p);
                return r;
        }
        return 1;
}

uint64_t wal_manager_last_lsn(Manager *m) {
        WalGlue *g = glue(m);
        return g ? g->last : 0;
}

bool wal_manager_durable(Manager *m, uint64_t lsn) {
        WalGlue *g = glue(m);
        WalWriterStats st;
        if (!g || !g->writer)
                return true;
        wal_writer_stats(g->writer, &st);
        return st.error == 0 && g->refused == 0 && lsn <= st.durable_lsn;
}

int wal_manager_reply_empty(Manager *m, sd_bus_message *call) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r = sd_bus_message_new_method_return(call, &reply);
        if (r < 0)
                return r;
        return wal_manager_reply(m, call, reply);
}

int wal_manager_stats(Manager *m, WalManagerStats *ret) {
        WalGlue *g = glue(m);
        if (!g || !g->writer) {
                *ret = (WalManagerStats){};
                return -ENOTCONN;
        }
        wal_writer_stats(g->writer, &ret->writer);
        ret->policy = wal_sync_policy_to_string(ret->writer.policy);
        ret->replies_waiting = g->waiting.n;
        return 0;
}

size_t wal_manager_counters(Manager *m, const char **names, uint64_t *values, size_t n) {
        WalManagerStats st;
        size_t k = 0;
        if (wal_manager_stats(m, &st) < 0)
                return 0;
        const WalWriterStats *w = &st.writer;
        const struct {
                const char *name;
                uint64_t value;
        } c[] = {
                { "appended", w->appended },
                { "appended-bytes", w->appended_bytes },
                { "assigned-lsn", w->assigned_lsn },
                { "durable-lsn", w->durable_lsn },
                { "writes", w->writes },
                { "syncs", w->syncs },
                { "synced-records", w->synced_records },
                { "max-records-per-sync", w->max_batch },
                { "log-bytes", w->log_bytes },
                { "compactions", w->compactions },
                { "compaction-failures", w->compaction_failures },
                { "full-waits", w->full_waits },
                { "buffer-bytes", w->buffer_bytes },
                { "replies-waiting", st.replies_waiting },
                { "failed", w->error < 0 },
        };
        for (size_t i = 0; i < ELEMENTSOF(c); i++, k++)
                if (k < n) {
                        names[k] = c[i].name;
                        values[k] = c[i].value;
                }
        return k;
}

static int wal_init(Manager *m) {
        _cleanup_(freep) char *dir = NULL;
        WalGlue *g;
        int r;

        /* Under systemd, StateDirectory= made it; elsewhere make it (one level). */
        if (mkdir(m->config.state_dir, 0755) < 0 && errno != EEXIST)
                return log_error_errno(errno, "Cannot create the state directory %s: %m", m->config.state_dir);
        if (asprintf(&dir, "%s/wal", m->config.state_dir) < 0)
                return log_oom();
        r = wal_open(dir, (WalSyncPolicy)m->config.wal_sync, &m->wal);
        if (r < 0)
                return r; /* logged */
        g = calloc(1, sizeof *g);
        if (!g)
                return log_oom();
        wal_set_userdata(m->wal, g);
        r = wal_replay(m->wal, apply, m);
        if (r < 0)
                return log_error_errno(r, "Cannot replay the WAL in %s: %m", dir);
        WalStats replayed = *wal_get_stats(m->wal);
        /* From here on the thread does the log's I/O: what the subsystems journal while
         * they finish their restore (in-flight handoffs rolled back, ...) goes through it. */
        r = wal_writer_new(m->wal, &g->writer);
        if (r < 0)
                return log_error_errno(r, "Cannot start the WAL writer thread: %m");
        g->last = wal_writer_assigned(g->writer);
        r = sd_event_add_io(m->event, &g->durable, wal_writer_fd(g->writer), EPOLLIN, on_durable, m);
        if (r < 0)
                return log_error_errno(r, "Cannot watch the WAL writer: %m");
        r = sd_event_add_defer(m->event, &g->urge, on_urge, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the WAL urge source: %m");
        (void)sd_event_source_set_priority(g->urge, SD_EVENT_PRIORITY_IDLE);
        (void)sd_event_source_set_enabled(g->urge, SD_EVENT_OFF);
        /* Accuracy: a tenth of the bound, so that sd-event may coalesce its wake-up. */
        r = sd_event_add_time_relative(m->event, &g->lazy, CLOCK_MONOTONIC, WAL_WRITER_LAZY_USEC,
                                       WAL_WRITER_LAZY_USEC / 10, on_lazy, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the WAL lazy timer: %m");
        (void)sd_event_source_set_enabled(g->lazy, SD_EVENT_OFF);
        for (const Subsystem *const *sp = manager_subsystems(); *sp; sp++)
                if ((*sp)->journal && (*sp)->journal->restore_finish) {
                        r = (*sp)->journal->restore_finish(m);
                        if (r < 0)
                                return r; /* logged */
                }
        /* What the restore dropped (the state of arenas whose memory did not survive) is
         * durable before anything goes on: fresh arena memory enters the fd store only
         * after this (manager_startup), or a start that died now would leave the old
         * records to be replayed over fresh memory by the next. */
        r = wal_writer_flush(g->writer);
        if (r < 0)
                return log_error_errno(r, "WAL %s: the restore's records cannot be made durable: %m", dir);
        log_info("WAL %s: %" PRIu64 " snapshot and %" PRIu64 " log records replayed, sync=%s%s.", dir,
                 replayed.snapshot_records, replayed.replayed, wal_sync_policy_to_string(m->config.wal_sync),
                 replayed.cut_bytes ? ", a damaged tail was cut" : "");
        return 0;
}

static void wal_done(Manager *m) {
        WalGlue *g = glue(m);
        if (g) {
                WalWriterStats st = {};
                /* Everything appended is written (and synced) before the thread stops. */
                if (g->writer) {
                        (void)wal_writer_flush(g->writer);
                        wal_writer_stats(g->writer, &st);
                        g->writer = wal_writer_free(g->writer);
                }
                (void)wal_wait_queue_advance(&g->waiting, st.durable_lsn,
                                             st.error < 0 ? st.error : (st.durable_lsn < g->last ? -EIO : 0));
                wal_wait_queue_done(&g->waiting, -ESHUTDOWN);
                sd_event_source_disable_unref(g->durable);
                sd_event_source_disable_unref(g->urge);
                sd_event_source_disable_unref(g->lazy);
                free(g);
        }
        m->wal = wal_free(m->wal);
}

static int wal_reload(Manager *m, const Config *n) {
        WalGlue *g = glue(m);
        if (g && g->writer)
                wal_writer_set_policy(g->writer, (WalSyncPolicy)n->wal_sync);
        m->config.wal_sync = n->wal_sync;
        m->config.wal_compact_bytes = n->wal_compact_bytes;
        return 0;
}

/* manager_run()'s loop is about to wait: it waits no longer than the lazy bound. */
static uint64_t wal_before_wait(Manager *m) {
        WalGlue *g = glue(m);
        if (!g || !g->writer)
                return UINT64_MAX;
        return lazy_check(g);
}

/* The lazy bound on a loop that does not idle (and after a wait that timed out). */
static void wal_after_dispatch(Manager *m) {
        WalGlue *g = glue(m);
        if (g && g->writer && g->lazy_pending)
                (void)lazy_check(g);
}

const Subsystem wal_subsystem = {
        .name = "wal",
        .init = wal_init,
        .done = wal_done,
        .reload = wal_reload,
        .after_dispatch = wal_after_dispatch,
        .before_wait = wal_before_wait,
};
