/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Handoffs (/org/epd1/handoff) and org.epd1.Handoff (/org/epd1/handoff/<id>):
 * vtables and argument glue only; the logic is handoff-manager.c and handoff.c. The
 * contract is dbus/org.epd1.Handoff.xml. */
#include "handoff/bus-handoff.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/arena.h"
#include "core/bus-dict.h"
#include "core/bus-objects.h"
#include "core/manager.h"
#include "core/worker.h"
#include "handoff/handoff-manager.h"
#include "log.h"
#include "macro.h"
#include "pages/page-manager.h"
#include "telemetry/telemetry-manager.h"
#include "wal/wal-manager.h"

static HandoffManager *hm_of(void *userdata) {
        return ((Manager *)userdata)->handoffs;
}

static const char *peer_of(const HandoffObject *o) {
        return o->peer_host[0] ? o->peer_host : "";
}

/* Replies (types, ...) once the transitions the call journaled are durable
 * (docs/wal.md). */
static int reply_journaled(Manager *m, sd_bus_message *msg, const char *types, ...) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        va_list ap;
        int r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        va_start(ap, types);
        r = sd_bus_message_appendv(reply, types, ap);
        va_end(ap);
        if (r < 0)
                return r;
        return wal_manager_reply(m, msg, reply);
}

/* Prepare's answer, once its records are durable: the handoff and its token. */
static int reply_journaled_object(Manager *m, sd_bus_message *msg, HandoffObject *o) {
        return reply_journaled(m, msg, "ot", o->path, o->h->token);
}

void bus_handoff_emit_progress(HandoffObject *o, bool to_owner, uint32_t done) {
        handoff_emit_signal(o, to_owner, "Progress", "uut", done, o->h->n_groups, o->bytes_moved);
}

void bus_handoff_emit_state(HandoffObject *o, bool to_owner) {
        handoff_emit_signal(o, to_owner, "StateChanged", "ss", handoff_state_to_string(o->h->state),
                            handoff_cause_to_string(o->h->cause));
}

/* -- org.epd1.Handoffs -- */

/* A Prepare whose answer waits for the destination host: the call, answered by done(). */
typedef struct PrepareCall {
        HandoffPrepareWaiter waiter;
        Manager *manager;
        sd_bus_message *msg;
        char request_id[TRACE_REQUEST_ID_MAX + 1];
        uint32_t uid; /* the caller's: it may read the trace */
} PrepareCall;

/* A refused Prepare in its request's trace, with the reason the caller hears (a
 * backpressure deferral has its own event: prepare_admit()). */
static void trace_refused(Manager *m, const char *request_id, uint32_t uid, int error, const char *why) {
        char what[TRACE_DETAIL_MAX];
        if (error == -EAGAIN)
                return;
        snprintf(what, sizeof what, "prepare refused: %.70s", why && why[0] ? why : strerror(-error));
        (void)telemetry_trace(m, request_id, TRACE_ERROR,
                              &(TraceDetail) { .detail = what, .has_uid = true, .uid = uid });
}

static PrepareCall *prepare_call_free(PrepareCall *c) {
        if (c) {
                sd_bus_message_unref(c->msg);
                free(c);
        }
        return NULL;
}

static void prepare_done(HandoffPrepareWaiter *w, HandoffObject *o, int error, const char *why) {
        PrepareCall *c = container_of(w, PrepareCall, waiter);
        int r;
        if (error < 0) {
                trace_refused(c->manager, c->request_id, c->uid, error, why);
                r = bus_glue_reply_errno(c->msg, error, why);
        } else
                r = reply_journaled_object(c->manager, c->msg, o);
        if (r < 0)
                log_debug_errno(r, "handoff: cannot answer Prepare: %m");
        prepare_call_free(c);
}

static int method_prepare(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        HandoffPrepareArgs a = {};
        const void *groups;
        HandoffObject *o;
        Reason why = {};
        Worker *w;
        size_t sz;
        int r;

        r = sd_bus_message_read(msg, "sso", &a.request_id, &a.destination, &a.sequence);
        if (r < 0)
                return r;
        r = sd_bus_message_read_array(msg, 'u', &groups, &sz);
        if (r < 0)
                return r;
        a.layer_groups = groups;
        a.n_groups = sz / sizeof(uint32_t);

        static const BusDictItem options[] = {
                BUS_DICT("arena", "s", HandoffPrepareArgs, arena),
                BUS_DICT("target", "o", HandoffPrepareArgs, target),
                BUS_DICT("timeout_usec", "t", HandoffPrepareArgs, timeout_usec),
                BUS_DICT("ready", "u", HandoffPrepareArgs, ready),
                BUS_DICT("release_on_commit", "b", HandoffPrepareArgs, release_on_commit),
                {},
        };
        r = bus_dict_read(msg, options, &a, "option", error);
        if (r < 0)
                return r;
        r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;

        PrepareCall *call = calloc(1, sizeof *call);
        if (!call)
                return -ENOMEM;
        *call = (PrepareCall) { .waiter.done = prepare_done, .manager = m, .msg = sd_bus_message_ref(msg),
                                .uid = (uint32_t)w->object.owner->uid };
        snprintf(call->request_id, sizeof call->request_id, "%.64s", a.request_id);
        r = handoff_manager_prepare(hm_of(userdata), w, &a, &call->waiter, &o, &why);
        if (r == HANDOFF_PREPARE_PENDING)
                return 1; /* prepare_done() answers and frees the call */
        prepare_call_free(call);
        if (r < 0) {
                trace_refused(m, a.request_id, (uint32_t)w->object.owner->uid, r, why.text);
                return epd_bus_error_errno(error, r, why.text);
        }
        /* Also for a repeated Prepare: the first one's record may not be durable yet. */
        return reply_journaled_object(m, msg, o);
}

/* Accept's answer: where the pages land, and the progress so far. */
static int reply_accepted(Manager *m, sd_bus_message *msg, HandoffObject *o) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "ots", o->path, o->h->token, m->arenas[o->arena]->name);
        if (r >= 0)
                r = sd_bus_message_open_container(reply, 'a', "t");
        for (uint32_t i = 0; r >= 0 && i < o->n_pages; i++)
                r = sd_bus_message_append(reply, "t", page_offset(o->pool, o->pages[i]));
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "uu", o->h->n_groups, o->h->n_notified);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

static int method_accept(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        HandoffManager *hm = hm_of(userdata);
        const char *rid;
        HandoffObject *o;
        Client *c;
        int r;

        r = sd_bus_message_read(msg, "s", &rid);
        if (r < 0)
                return r;
        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        Reason why = {};
        r = handoff_manager_accept(hm, c, rid, &o, &why);
        if (r < 0)
                return epd_bus_error_errno(error, r, why.text);
        return reply_accepted(m, msg, o);
}

/* An AcceptWait whose handoff has not arrived yet: the call, answered by done(). */
typedef struct AcceptCall {
        HandoffAcceptWaiter waiter;
        Manager *manager;
        sd_bus_message *msg;
} AcceptCall;

static void accept_done(HandoffAcceptWaiter *w, HandoffObject *o, int error, const char *why) {
        AcceptCall *c = container_of(w, AcceptCall, waiter);
        int r;
        if (error < 0)
                r = bus_glue_reply_errno(c->msg, error, why);
        else
                r = reply_accepted(c->manager, c->msg, o);
        if (r < 0)
                log_debug_errno(r, "handoff: cannot answer AcceptWait: %m");
        sd_bus_message_unref(c->msg);
        free(c);
}

static int method_accept_wait(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *rid;
        uint64_t timeout;
        HandoffObject *o;
        Client *c;
        int r;

        r = sd_bus_message_read(msg, "st", &rid, &timeout);
        if (r < 0)
                return r;
        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        AcceptCall *call = calloc(1, sizeof *call);
        if (!call)
                return -ENOMEM;
        *call = (AcceptCall){ .waiter.done = accept_done, .manager = m, .msg = sd_bus_message_ref(msg) };
        Reason why = {};
        r = handoff_manager_accept_wait(hm_of(userdata), c, rid, timeout, &call->waiter, 0, &o, &why);
        if (r == HANDOFF_ACCEPT_PENDING)
                return 1; /* accept_done() answers and frees the call */
        sd_bus_message_unref(call->msg);
        free(call);
        if (r < 0)
                return epd_bus_error_errno(error, r, why.text);
        return reply_accepted(m, msg, o);
}

static int method_open_ring(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        uint32_t sq, cq;
        Client *c;
        Ring *ring;
        int r;

        r = sd_bus_message_read(msg, "uu", &sq, &cq);
        if (r < 0)
                return r;
        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        r = bus_glue_require_fds(msg, "OpenRing", error);
        if (r < 0)
                return r;
        Reason why = {};
        r = handoff_manager_open_ring(hm_of(userdata), c, sq, cq, &ring, &why);
        if (r < 0)
                return epd_bus_error_errno(error, r, why.text);
        /* sd-bus duplicates the fds into the message. A ring whose fds did not reach the
         * client (its connection cannot pass fds, or the reply failed) goes again: else it
         * would hold its memory and refuse every OpenRing (Exists) until the client left. */
        r = sd_bus_reply_method_return(msg, "hhht", ring->memfd, ring->submit_fd, ring->complete_fd, ring->size);
        if (r < 0)
                (void)handoff_manager_close_ring(hm_of(userdata), c, &why);
        return r;
}

static int method_close_ring(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        Reason why = {};
        Client *c;
        int r;

        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        r = handoff_manager_close_ring(hm_of(userdata), c, &why);
        if (r < 0)
                return epd_bus_error_errno(error, r, why.text);
        return sd_bus_reply_method_return(msg, NULL);
}

static int method_watch(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        Reason why = {};
        Client *c;
        int enable, r;

        r = sd_bus_message_read(msg, "b", &enable);
        if (r < 0)
                return r;
        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        r = handoff_manager_watch(hm_of(userdata), c, enable, &why);
        if (r < 0)
                return epd_bus_error_errno(error, r, why.text[0] ? why.text : "Cannot watch handoffs.");
        return sd_bus_reply_method_return(msg, NULL);
}

static int property_handoffs(sd_bus *bus, const char *path, const char *interface, const char *property,
                             sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        HandoffManager *hm = hm_of(userdata);
        HandoffObject *o;
        size_t it = 0;
        bool root;
        Client *c;
        /* Every handoff to root; to anyone else its own (docs/security.md). */
        int r = manager_reader_require(hm->manager, sd_bus_get_current_message(bus), "Handoffs", &root, &c, error);
        if (r < 0)
                return r;
        r = sd_bus_message_open_container(reply, 'a', "(ossssuuts)");
        while (r >= 0 && hashmap_iterate(hm->by_handle, &it, (void **)&o, NULL))
                if (root || handoff_object_owned_by(o, c))
                        r = sd_bus_message_append(reply, "(ossssuuts)", o->path, o->request_str,
                                                  handoff_role_to_string(o->h->role),
                                                  handoff_state_to_string(o->h->state), peer_of(o), o->h->n_done,
                                                  o->h->n_groups, o->bytes_moved, handoff_cause_to_string(o->h->cause));
        return r < 0 ? r : sd_bus_message_close_container(reply);
}

static int property_counters(sd_bus *bus, const char *path, const char *interface, const char *property,
                             sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        const char *names[64];
        uint64_t values[64];
        size_t n = MIN(handoff_manager_counters(hm_of(userdata), names, values, 64), (size_t)64);
        int r = sd_bus_message_open_container(reply, 'a', "{st}");
        for (size_t i = 0; r >= 0 && i < n; i++)
                r = sd_bus_message_append(reply, "{st}", names[i], values[i]);
        return r < 0 ? r : sd_bus_message_close_container(reply);
}

/* Per (peer, transport): counts, bytes and the duration histogram (handoff-manager.h). */
static int property_paths(sd_bus *bus, const char *path, const char *interface, const char *property,
                          sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        HandoffManager *hm = hm_of(userdata);
        const HandoffPath *p;
        int r = sd_bus_message_open_container(reply, 'a', "(ssttttttat)");
        for (size_t i = 0; r >= 0 && (p = handoff_manager_path(hm, i)); i++) {
                r = sd_bus_message_open_container(reply, 'r', "ssttttttat");
                if (r >= 0)
                        r = sd_bus_message_append(reply, "sstttttt", p->peer, p->transport, p->handoffs_out,
                                                  p->handoffs_in, p->failed, p->bytes_out, p->bytes_in,
                                                  p->duration.sum_usec);
                if (r >= 0)
                        r = sd_bus_message_append_array(reply, 't', p->duration.counts, sizeof p->duration.counts);
                if (r >= 0)
                        r = sd_bus_message_close_container(reply);
        }
        return r < 0 ? r : sd_bus_message_close_container(reply);
}

static int property_duration_buckets(sd_bus *bus, const char *path, const char *interface,
                                     const char *property, sd_bus_message *reply, void *userdata,
                                     sd_bus_error *error) {
        return sd_bus_message_append_array(reply, 't', histogram_bounds_usec, sizeof histogram_bounds_usec);
}

static bool journal_entry_owned_by(HandoffManager *hm, const HandoffJournalEntry *e, const Client *c) {
        HandoffObject *o = hashmap_get(e->role == HANDOFF_SOURCE ? hm->sources : hm->destinations,
                                       e->request_id.bytes);
        return o && o->h->token == e->token && handoff_object_owned_by(o, c);
}

/* The WAL's view (handoff-record.h): every handoff side journaled and not released. */
static int property_journal(sd_bus *bus, const char *path, const char *interface, const char *property,
                            sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        HandoffManager *hm = hm_of(userdata);
        HandoffJournalEntry *e;
        size_t it = 0;
        bool root;
        Client *c;
        /* Every entry to root; to anyone else those of the handoffs it owns now. */
        int r = manager_reader_require(hm->manager, sd_bus_get_current_message(bus), "Journal", &root, &c, error);
        if (r < 0)
                return r;
        r = sd_bus_message_open_container(reply, 'a', "(sstssuuob)");
        while (r >= 0 && handoff_journal_iterate(&hm->journal, &it, &e)) {
                if (!root && !journal_entry_owned_by(hm, e, c))
                        continue;
                char rid[EPD_ID_STRING_MAX], sid[EPD_ID_STRING_MAX], seq[64 + EPD_ID_STRING_MAX];
                if (e->has_sequence)
                        snprintf(seq, sizeof seq, SEQUENCE_PATH_PREFIX "/%s", epd_id_to_string(&e->sequence, sid));
                else
                        snprintf(seq, sizeof seq, "/");
                r = sd_bus_message_append(reply, "(sstssuuob)", epd_id_to_string(&e->request_id, rid),
                                          handoff_role_to_string(e->role), e->token, handoff_state_to_string(e->state),
                                          handoff_cause_to_string(e->cause), e->groups_done, e->n_groups, seq,
                                          e->recovered);
        }
        return r < 0 ? r : sd_bus_message_close_container(reply);
}

static const sd_bus_vtable handoffs_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Handoffs", "a(ossssuuts)", property_handoffs, 0, 0),
        SD_BUS_PROPERTY("Counters", "a{st}", property_counters, 0, 0),
        SD_BUS_PROPERTY("Journal", "a(sstssuuob)", property_journal, 0, 0),
        SD_BUS_PROPERTY("Paths", "a(ssttttttat)", property_paths, 0, 0),
        SD_BUS_PROPERTY("DurationBuckets", "at", property_duration_buckets, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_METHOD_WITH_ARGS("Prepare",
                                SD_BUS_ARGS("s", request_id, "s", destination, "o", sequence, "au", layer_groups,
                                            "a{sv}", options),
                                SD_BUS_RESULT("o", handoff, "t", token), method_prepare, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Accept", SD_BUS_ARGS("s", request_id),
                                SD_BUS_RESULT("o", handoff, "t", token, "s", arena, "at", offsets, "u", n_groups,
                                              "u", groups_done),
                                method_accept, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("AcceptWait", SD_BUS_ARGS("s", request_id, "t", timeout_usec),
                                SD_BUS_RESULT("o", handoff, "t", token, "s", arena, "at", offsets, "u", n_groups,
                                              "u", groups_done),
                                method_accept_wait, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("OpenRing", SD_BUS_ARGS("u", sq_entries, "u", cq_entries),
                                SD_BUS_RESULT("h", memfd, "h", submit_fd, "h", complete_fd, "t", size),
                                method_open_ring, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("CloseRing", SD_BUS_NO_ARGS, SD_BUS_NO_RESULT, method_close_ring,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Watch", SD_BUS_ARGS("b", enable), SD_BUS_NO_RESULT, method_watch,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_VTABLE_END,
};

/* -- org.epd1.Handoff -- */

static int owner_check(HandoffObject *o, sd_bus_message *msg, Client **ret, sd_bus_error *error) {
        Client *c = manager_client_lookup_message(o->hm->manager, msg);
        if (!handoff_object_owned_by(o, c))
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED, "Handoff %s is not yours.", o->handle_str);
        if (ret)
                *ret = c;
        return 0;
}

static int method_layer_group_ready(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        HandoffObject *o = userdata;
        Reason why = {};
        uint32_t g;
        int r = sd_bus_message_read(msg, "u", &g);
        if (r >= 0)
                r = owner_check(o, msg, NULL, error);
        if (r < 0)
                return r;
        r = handoff_manager_group_ready(o, g, &why);
        if (r < 0)
                return epd_bus_error_errno(error, r, why.text);
        return sd_bus_reply_method_return(msg, NULL);
}

/* Commit; with release, Release too, in the same call: the reply (the decode sequence)
 * waits for both records, one sync. */
static int commit(sd_bus_message *msg, HandoffObject *o, bool release, sd_bus_error *error) {
        const char *seq;
        Client *c = NULL;
        Reason why = {};
        int r = owner_check(o, msg, &c, error);
        if (r < 0)
                return r;
        r = handoff_manager_commit(o, c, &seq, &why);
        if (r < 0)
                return epd_bus_error_errno(error, r, why.text);
        _cleanup_(freep) char *path = strdup(seq); /* o may be gone after the release */
        if (!path)
                return -ENOMEM;
        Manager *m = o->hm->manager;
        if (release)
                handoff_manager_release(o);
        return reply_journaled(m, msg, "o", path);
}

static int method_commit(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        return commit(msg, userdata, false, error);
}

static int method_commit_and_release(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        return commit(msg, userdata, true, error);
}

static int method_rollback(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        HandoffObject *o = userdata;
        Reason why = {};
        int r = owner_check(o, msg, NULL, error);
        if (r < 0)
                return r;
        /* The object may be gone after this (a Prepare still waiting for its destination
         * is answered and released by the rollback); the reply waits for its record. */
        Manager *m = o->hm->manager;
        r = handoff_manager_rollback(o, &why);
        if (r < 0)
                return epd_bus_error_errno(error, r, why.text);
        return wal_manager_reply_empty(m, msg);
}

static int method_release(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        HandoffObject *o = userdata;
        int r = owner_check(o, msg, NULL, error);
        if (r < 0)
                return r;
        /* The object may be gone after this; the reply waits for the release's record. */
        Manager *m = o->hm->manager;
        handoff_manager_release(o);
        return wal_manager_reply_empty(m, msg);
}

/* A handoff's properties are its owner's (the prefill client on the source side, the
 * accepting decode client on the destination side), as its methods are: a request id
 * says whose request it is (docs/security.md). The refusal names the handle the caller
 * already knows, not the request. */
static int read_check(HandoffObject *o, sd_bus *bus, sd_bus_error *error) {
        Client *c = manager_client_lookup_message(o->hm->manager, sd_bus_get_current_message(bus));
        if (!handoff_object_owned_by(o, c))
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "Handoff %s belongs to another client; its properties are its owner's.",
                                     o->handle_str);
        return 0;
}

#define H_PROPERTY(name, body)                                        \
        BUS_PROPERTY_GETTER(name, HandoffObject, o, {                 \
                int _r = read_check(o, bus, error);                   \
                if (_r < 0)                                           \
                        return _r;                                    \
                body                                                  \
        })

H_PROPERTY(property_request_id, { return sd_bus_message_append(reply, "s", o->request_str); })
H_PROPERTY(property_token, { return sd_bus_message_append(reply, "t", o->h->token); })
H_PROPERTY(property_role, { return sd_bus_message_append(reply, "s", handoff_role_to_string(o->h->role)); })
H_PROPERTY(property_state, { return sd_bus_message_append(reply, "s", handoff_state_to_string(o->h->state)); })
H_PROPERTY(property_cause, { return sd_bus_message_append(reply, "s", handoff_cause_to_string(o->h->cause)); })
H_PROPERTY(property_peer, { return sd_bus_message_append(reply, "s", peer_of(o)); })
H_PROPERTY(property_groups, { return sd_bus_message_append(reply, "u", o->h->n_groups); })
H_PROPERTY(property_groups_done, { return sd_bus_message_append(reply, "u", o->h->n_done); })
H_PROPERTY(property_bytes, { return sd_bus_message_append(reply, "t", o->bytes_moved); })
H_PROPERTY(property_zero_copy, { return sd_bus_message_append(reply, "b", o->zero_copy); })
H_PROPERTY(property_arena, {
        Manager *m = o->hm->manager;
        return sd_bus_message_append(reply, "s", o->pool && o->arena < m->n_arenas ? m->arenas[o->arena]->name : "");
})

static const sd_bus_vtable handoff_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("RequestId", "s", property_request_id, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Token", "t", property_token, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Role", "s", property_role, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Peer", "s", property_peer, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Arena", "s", property_arena, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("ZeroCopy", "b", property_zero_copy, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Groups", "u", property_groups, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("State", "s", property_state, 0, 0),
        SD_BUS_PROPERTY("Cause", "s", property_cause, 0, 0),
        SD_BUS_PROPERTY("GroupsDone", "u", property_groups_done, 0, 0),
        SD_BUS_PROPERTY("Bytes", "t", property_bytes, 0, 0),
        SD_BUS_METHOD_WITH_ARGS("LayerGroupReady", SD_BUS_ARGS("u", group), SD_BUS_NO_RESULT,
                                method_layer_group_ready, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Commit", SD_BUS_NO_ARGS, SD_BUS_RESULT("o", sequence), method_commit,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("CommitAndRelease", SD_BUS_NO_ARGS, SD_BUS_RESULT("o", sequence),
                                method_commit_and_release, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Rollback", SD_BUS_NO_ARGS, SD_BUS_NO_RESULT, method_rollback,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Release", SD_BUS_NO_ARGS, SD_BUS_NO_RESULT, method_release,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_SIGNAL_WITH_ARGS("Progress", SD_BUS_ARGS("u", groups_done, "u", n_groups, "t", bytes), 0),
        SD_BUS_SIGNAL_WITH_ARGS("StateChanged", SD_BUS_ARGS("s", state, "s", cause), 0),
        SD_BUS_VTABLE_END,
};

static int handoff_find(sd_bus *bus, const char *path, const char *interface, void *userdata, void **found,
                        sd_bus_error *error) {
        HandoffObject *o = handoff_manager_get(hm_of(userdata), path);
        if (!o || strcmp(o->path, path) != 0)
                return 0;
        *found = o;
        return 1;
}

static bool handoff_readable(const void *o, void *userdata) {
        return handoff_object_owned_by(o, userdata);
}

/* The object tree shows the handoffs Handoffs lists: all to root, to anyone else its own. */
static int handoff_enumerate(sd_bus *bus, const char *path, void *userdata, char ***nodes, sd_bus_error *error) {
        HandoffManager *hm = hm_of(userdata);
        bool root = false;
        Client *c = NULL;
        if (manager_reader(hm->manager, sd_bus_get_current_message(bus), &root, &c) < 0)
                root = false, c = NULL;
        return bus_enumerate_paths(hm->by_handle, offsetof(HandoffObject, path), root ? NULL : handoff_readable, c,
                                   nodes);
}

int bus_handoff_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, HANDOFF_PATH, "org.epd1.Handoffs", handoffs_vtable, NULL, m);
        if (r >= 0)
                r = bus_glue_add_vtable(bus, HANDOFF_PATH_PREFIX, "org.epd1.Handoff", handoff_vtable,
                                               handoff_find, m);
        if (r >= 0)
                r = sd_bus_add_node_enumerator(bus, NULL, HANDOFF_PATH_PREFIX, handoff_enumerate, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Handoff objects: %m");
        return 0;
}
