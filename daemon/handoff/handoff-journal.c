/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The handoff's WAL records (handoff-record.h): each transition appended before it is
 * acknowledged, the journal of every side kept in step with them, and the Subsystem's
 * journal hooks: replay, the rollback of what was in flight at a restart, and
 * snapshots. */
#include "handoff/handoff-internal.h"

#include "pages/sequence-record.h"
#include "wal/wal-manager.h"

/* ---- the WAL: every transition is appended before it is acknowledged ---- */

int handoff_journal_append(HandoffManager *hm, const HandoffRecord *r, const uint32_t *pages) {
        Manager *m = hm->manager;
        size_t len = handoff_record_size(r);
        _cleanup_(freep) uint8_t *buf = malloc(len);
        int k;

        if (!buf)
                return -ENOMEM;
        /* While stopping nothing is journaled: what is in flight comes back rolled back. */
        if (m->stopping)
                return 0;
        handoff_record_encode(buf, r, pages);
        k = wal_manager_append(m, (uint16_t)(WAL_RECORD_HANDOFF + r->type), buf, len);
        if (k < 0 && k != -ENOTCONN)
                return k;
        /* The journal follows the record just appended: replay rebuilds the same. */
        k = handoff_journal_apply(&hm->journal, r->type, buf, len);
        if (k < 0) {
                log_debug_errno(k, "handoff: journal record 0x%02x does not apply: %m", r->type);
                /* A Prepare the journal did not take (an older attempt of the request with
                 * a larger token, say) has no entry: its commit would be acknowledged
                 * without a record of it, and its decode sequence lost in a crash. Such a
                 * Prepare fails (the replay skips its record the same way). */
                if (r->type == HANDOFF_REC_PREPARED)
                        return k;
        }
        return 0;
}

HandoffRecord handoff_record_of(HandoffObject *o, uint8_t type) {
        return (HandoffRecord){
                .type = type,
                .request_id = o->h->request_id,
                .token = o->h->token,
                .role = o->h->role,
        };
}

/* The journal's entry for this very attempt, or NULL. */
HandoffJournalEntry *handoff_journal_entry_of(HandoffObject *o) {
        HandoffJournalEntry *e = handoff_journal_get(&o->hm->journal, &o->h->request_id, o->h->role);
        return e && e->token == o->h->token ? e : NULL;
}

int handoff_journal_prepared(HandoffObject *o) {
        HandoffRecord r = handoff_record_of(o, HANDOFF_REC_PREPARED);
        r.value = o->h->n_groups;
        r.arena = o->arena;
        r.n_pages = o->n_pages;
        r.page_size = o->page_size;
        return handoff_journal_append(o->hm, &r, o->pages);
}

static void journal_warn(HandoffObject *o, int r, const char *what) {
        if (r < 0)
                log_warning_errno(r, "handoff %s (%s): cannot journal %s: %m", o->request_str,
                                  handoff_role_to_string(o->h->role), what);
}

void handoff_journal_released(HandoffObject *o) {
        if (!handoff_journal_entry_of(o))
                return;
        HandoffRecord r = handoff_record_of(o, HANDOFF_REC_RELEASED);
        journal_warn(o, handoff_journal_append(o->hm, &r, NULL), "the release");
}

/* A state change seen by handoff_after_event(), before anyone is told of it. */
void handoff_journal_state(HandoffObject *o) {
        Handoff *h = o->h;
        HandoffJournalEntry *e = handoff_journal_entry_of(o);
        HandoffRecord r;

        switch (h->state) {
        case HANDOFF_PREPARED:
        case HANDOFF_TRANSFERRING:
        case HANDOFF_TRANSFERRED:
                /* A remote destination answered the source's Prepare: acknowledged to
                 * the caller only with its record. One the journal refuses rolls back
                 * (the destination is told), and the Prepare fails saying why. */
                if (!e) {
                        int q = handoff_journal_prepared(o);
                        if (q < 0) {
                                journal_warn(o, q, "Prepare");
                                o->journal_error = q;
                                (void)handoff_rollback(h, HANDOFF_CAUSE_REFUSED, false);
                        }
                }
                break;
        case HANDOFF_COMMITTED:
                if (e && e->state == HANDOFF_PREPARED) {
                        r = handoff_record_of(o, HANDOFF_REC_COMMITTED);
                        journal_warn(o, handoff_journal_append(o->hm, &r, NULL), "the commit");
                }
                break;
        case HANDOFF_ROLLED_BACK:
                if (e && e->state == HANDOFF_PREPARED) {
                        r = handoff_record_of(o, HANDOFF_REC_ROLLED_BACK);
                        r.cause = h->cause;
                        journal_warn(o, handoff_journal_append(o->hm, &r, NULL), "the rollback");
                }
                break;
        case HANDOFF_RELEASED:
                handoff_journal_released(o);
                break;
        default:
                break;
        }
}

int handoff_manager_apply_record(Manager *m, uint16_t type, const void *payload, size_t len) {
        HandoffManager *hm = m->handoffs;
        HandoffRecord rec;
        int r;

        if (!hm)
                return 0;
        r = handoff_record_parse((uint8_t)(type & 0xff), payload, len, &rec);
        if (r < 0)
                return r;
        /* The decode sequence a commit made is in the commit's record. */
        if (rec.type == HANDOFF_REC_COMMITTED && rec.extra_len > 16 && m->page_manager) {
                r = page_manager_apply_record(m->page_manager, WAL_RECORD_SEQUENCE + SEQUENCE_REC_PUT, rec.extra,
                                              rec.extra_len);
                if (r == -EBADMSG || r == -ENOMEM)
                        return r; /* ENOMEM: the start fails rather than go on without it */
                if (r < 0)
                        log_warning_errno(r, "WAL: the decode sequence of a handoff commit does not apply: %m");
        }
        return handoff_journal_apply(&hm->journal, rec.type, payload, len);
}

static void recovered_rolled_back(void *userdata, const HandoffJournalEntry *e) {
        HandoffManager *hm = userdata;
        HandoffRecord r = {
                .type = HANDOFF_REC_ROLLED_BACK,
                .request_id = e->request_id,
                .token = e->token,
                .role = e->role,
                .cause = HANDOFF_CAUSE_SHUTDOWN,
        };
        uint8_t buf[HANDOFF_REC_HEADER_SIZE];
        char id[EPD_ID_STRING_MAX];
        handoff_record_encode(buf, &r, NULL);
        int k = wal_manager_append(hm->manager, WAL_RECORD_HANDOFF + HANDOFF_REC_ROLLED_BACK, buf, sizeof buf);
        if (k < 0 && k != -ENOTCONN)
                log_warning_errno(k, "handoff %s: cannot journal its rollback at restart: %m",
                                  epd_id_to_string(&e->request_id, id));
        log_info("handoff %s (%s): in flight at the last stop: rolled back; its pages are free.",
                 epd_id_to_string(&e->request_id, id), handoff_role_to_string(e->role));
}

/* A restored entry nobody took up: RELEASED journaled, and gone. */
static void journal_grace_release(HandoffManager *hm, HandoffJournalEntry *e) {
        HandoffRecord r = { .type = HANDOFF_REC_RELEASED, .request_id = e->request_id, .token = e->token,
                            .role = e->role };
        (void)handoff_journal_append(hm, &r, NULL); /* removes e */
        if (handoff_journal_get(&hm->journal, &r.request_id, r.role) == e) {
                (void)hashmap_remove(hm->journal.entries, e->key);
                free(e->pages);
                free(e);
        }
}

static int on_journal_grace(sd_event_source *s, uint64_t usec, void *userdata) {
        HandoffManager *hm = userdata;
        HandoffJournalEntry *e;
        unsigned n = 0;
        size_t it = 0, k = 0;
        /* Collected in one pass, then released (a rescan after each was quadratic). */
        _cleanup_(freep) HandoffJournalEntry **v = calloc(MAX(handoff_journal_size(&hm->journal), (size_t)1),
                                                           sizeof *v);
        while (handoff_journal_iterate(&hm->journal, &it, &e)) {
                if (!e->recovered)
                        continue;
                if (!v) {
                        /* No memory for the list: one at a time, the scan started over. */
                        journal_grace_release(hm, e);
                        n++;
                        it = 0;
                        continue;
                }
                v[k++] = e;
        }
        for (size_t i = 0; i < k; i++) {
                journal_grace_release(hm, v[i]);
                n++;
        }
        hm->journal_grace = sd_event_source_disable_unref(hm->journal_grace);
        if (n > 0)
                log_info("handoff: %u journal entries of before the restart released.", n);
        return 0;
}

int handoff_manager_restore_finish(Manager *m) {
        HandoffManager *hm = m->handoffs;
        if (!hm)
                return 0;
        unsigned n = handoff_journal_recover(&hm->journal, recovered_rolled_back, hm);
        size_t total = handoff_journal_size(&hm->journal);
        if (total == 0)
                return 0;
        /* New attempts' tokens stay above every journaled one, even with the wall clock
         * behind the previous run's (a step back, a skewed clock at boot): a retry of a
         * recovered request is newer than its entry, not refused as stale. */
        HandoffJournalEntry *e;
        size_t it = 0;
        while (handoff_journal_iterate(&hm->journal, &it, &e))
                hm->last_token = MAX(hm->last_token, e->token);
        log_info("handoff: %zu journaled handoff sides restored (%u in flight, rolled back).", total, n);
        /* The same grace as the sequences' ([Limits] AttachGrace=): a commit's decode
         * sequence is attached within it, and its entry lives as long. */
        usec_t grace = m->config.attach_grace_usec ?: PAGE_MANAGER_ATTACH_GRACE_USEC;
        int r = sd_event_add_time_relative(m->event, &hm->journal_grace, CLOCK_MONOTONIC, grace, USEC_PER_SEC / 10,
                                           on_journal_grace, hm);
        if (r < 0)
                return log_error_errno(r, "handoff: cannot arm the journal's grace period: %m");
        return 0;
}

/* Snapshot: every entry of the journal (after the sequences, which commits name). */
typedef struct JournalSnapshot {
        int (*add)(void *userdata, uint16_t type, const void *rec, size_t len);
        void *userdata;
} JournalSnapshot;

static int journal_snapshot_add(void *userdata, uint8_t type, const void *rec, size_t len) {
        JournalSnapshot *js = userdata;
        return js->add(js->userdata, (uint16_t)(WAL_RECORD_HANDOFF + type), rec, len);
}

int handoff_manager_snapshot(Manager *m, int (*add)(void *userdata, uint16_t type, const void *rec, size_t len),
                             void *userdata) {
        HandoffManager *hm = m->handoffs;
        HandoffJournalEntry *e;
        JournalSnapshot js = { add, userdata };
        size_t it = 0;
        while (hm && handoff_journal_iterate(&hm->journal, &it, &e)) {
                int r = handoff_journal_snapshot_entry(e, journal_snapshot_add, &js);
                if (r < 0)
                        return r;
        }
        return 0;
}
