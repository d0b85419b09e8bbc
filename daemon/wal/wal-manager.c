/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <inttypes.h>

#include "bus-error.h"
#include "log.h"
#include "wal/wal-manager.h"

#define PENDING_MAX 4096u

typedef struct Pending {
        sd_bus_message *call, *reply;
} Pending;

/* The subsystem's event source and queue, hung on the Wal (wal_set_userdata). */
typedef struct WalGlue {
        sd_event_source *commit;  /* post source: one sync per loop iteration */
        Pending *pending;         /* replies waiting for the sync */
        size_t n_pending;
} WalGlue;

static WalGlue *glue(Manager *m) {
        return m->wal ? wal_get_userdata(m->wal) : NULL;
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
        if (k == -EBADMSG)
                return log_error_errno(k, "WAL: %s record %" PRIu64 " (%s) is malformed.", s->name, r->lsn,
                                       wal_record_type_to_string(r->type));
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

static void flush_pending(WalGlue *g, int error) {
        for (size_t i = 0; i < g->n_pending; i++) {
                Pending *p = &g->pending[i];
                /* Never acknowledge what is not known durable. */
                if (error < 0)
                        (void)sd_bus_reply_method_errorf(p->call, EPD_ERROR_FAILED,
                                                         "The journal could not be made durable: %s",
                                                         strerror(-error));
                else
                        (void)sd_bus_send(NULL, p->reply, NULL);
                sd_bus_message_unref(p->call);
                sd_bus_message_unref(p->reply);
        }
        g->n_pending = 0;
}

static int on_commit(sd_event_source *s, void *userdata) {
        Manager *m = userdata;
        WalGlue *g = glue(m);
        int r = 0;

        if (!g || !m->wal)
                return 0;
        if (wal_needs_sync(m->wal))
                r = wal_sync(m->wal);
        flush_pending(g, r);
        if (r >= 0 && wal_get_stats(m->wal)->log_bytes > m->config.wal_compact_bytes) {
                r = wal_compact(m->wal, snapshot, m);
                if (r >= 0)
                        log_info("WAL compacted: %" PRIu64 " snapshot records.",
                                 wal_get_stats(m->wal)->snapshot_records);
        }
        return 0;
}

int wal_manager_append(Manager *m, uint16_t type, const void *payload, size_t len) {
        if (!m->wal)
                return -ENOTCONN;
        return wal_append(m->wal, type, payload, len, NULL);
}

int wal_manager_reply(Manager *m, sd_bus_message *call, sd_bus_message *reply) {
        WalGlue *g = glue(m);
        int r;

        if (!g || !wal_needs_sync(m->wal) || g->n_pending >= PENDING_MAX) {
                if (m->wal && wal_needs_sync(m->wal)) {
                        r = wal_sync(m->wal);
                        if (r < 0)
                                return r;
                }
                r = sd_bus_send(NULL, reply, NULL);
                return r < 0 ? r : 1;
        }
        if (!g->pending) {
                g->pending = calloc(PENDING_MAX, sizeof *g->pending);
                if (!g->pending)
                        return -ENOMEM;
        }
        g->pending[g->n_pending++] = (Pending){ sd_bus_message_ref(call), sd_bus_message_ref(reply) };
        return 1;
}

int wal_manager_reply_empty(Manager *m, sd_bus_message *call) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r = sd_bus_message_new_method_return(call, &reply);
        if (r < 0)
                return r;
        return wal_manager_reply(m, call, reply);
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
        for (const Subsystem *const *sp = manager_subsystems(); *sp; sp++)
                if ((*sp)->journal && (*sp)->journal->restore_finish) {
                        r = (*sp)->journal->restore_finish(m);
                        if (r < 0)
                                return r; /* logged */
                }
        log_info("WAL %s: %" PRIu64 " snapshot and %" PRIu64 " log records replayed, sync=%s%s.", dir,
                 wal_get_stats(m->wal)->snapshot_records, wal_get_stats(m->wal)->replayed,
                 wal_sync_policy_to_string(wal_get_policy(m->wal)),
                 wal_get_stats(m->wal)->cut_bytes ? ", a damaged tail was cut" : "");
        r = sd_event_add_post(m->event, &g->commit, on_commit, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the WAL commit source: %m");
        return 0;
}

static void wal_done(Manager *m) {
        WalGlue *g = glue(m);
        if (g) {
                int r = wal_sync(m->wal);
                flush_pending(g, r);
                sd_event_source_disable_unref(g->commit);
                free(g->pending);
                free(g);
        }
        m->wal = wal_free(m->wal);
}

static int wal_reload(Manager *m, const Config *n) {
        if (m->wal)
                wal_set_policy(m->wal, (WalSyncPolicy)n->wal_sync);
        m->config.wal_sync = n->wal_sync;
        m->config.wal_compact_bytes = n->wal_compact_bytes;
        return 0;
}

const Subsystem wal_subsystem = {
        .name = "wal",
        .init = wal_init,
        .done = wal_done,
        .reload = wal_reload,
};
