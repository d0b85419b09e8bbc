/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The handoff manager's core: lifetime of handoff objects (one per side, owned by a
 * client, timed out, freed only when no write into their pages can land), the central
 * step after every event (journal, tell the other side and the owner, drop pages, free),
 * Rollback and Release, the counters, and the Subsystem. The other sides of the work
 * live beside it: handoff-source.c, handoff-dest.c, handoff-journal.c, handoff-stage.c,
 * handoff-window.c, handoff-ring.c (handoff-internal.h). */
#include "handoff/handoff-internal.h"

#include "copy.h"
#include "gpu/gpu-domain.h"
#include "transport/cuda.h"
#include "transport/local.h"
#include "wal/wal.h"

_Static_assert(HANDOFF_GPU_MERGE_MAX <= CUDA_COOKIES_MERGED,
               "a merged batch's groups complete once each (handoff_pump(), batch_complete())");

/* The request's trace (daemon/telemetry/telemetry.h): every step of a handoff under its request id. */
static void trace_fill(HandoffObject *o, TraceDetail *x) {
        /* Its owner (the prefill's client, the accepting decode's) may read the trace. */
        if (!x->has_uid && o->object.owner) {
                x->has_uid = true;
                x->uid = (uint32_t)o->object.owner->uid;
        }
        if (!x->transport && o->peer) {
                Transport *t = peer_manager_transport_for(o->hm->manager->peers, o->peer);
                x->transport = t ? t->ops->name : "tcp";
        }
        x->transport = x->transport ?: (o->gpu ? "cuda" : "local");
        x->peer = x->peer ?: (o->peer_host[0] ? o->peer_host : NULL);
}

static void trace(HandoffObject *o, TraceEventType type, const TraceDetail *d) {
        TraceDetail x = d ? *d : (TraceDetail){};
        trace_fill(o, &x);
        (void)telemetry_trace(o->hm->manager, o->request_str, type, &x);
}

int handoff_obj_group_ready(HandoffObject *o, uint32_t g) {
        int r = handoff_group_ready(o->h, g);
        if (r > 0) {
                o->h->groups[g].ready_usec = now_usec(CLOCK_MONOTONIC);
                /* An event for the first group only (the prefill's output starts to
                 * flow): each group's group-sent carries the time since its own ready,
                 * so a per-group event here would only cost the hot path (a trace
                 * lookup per LayerGroupReady, 36 a request). */
                if (g == 0)
                        trace(o, TRACE_GROUP_READY, &(TraceDetail){ .has_group = true, .group = 0,
                                                                   .bytes = o->h->groups[0].bytes_expected });
        }
        return r;
}

/* One event per layer group of [from, to), recorded together; a source's group-sent
 * carries the time from its group-ready. */
static void trace_groups(HandoffObject *o, TraceEventType type, uint32_t from, uint32_t to) {
        TraceDetail x[64];
        usec_t now = type == TRACE_GROUP_SENT ? now_usec(CLOCK_MONOTONIC) : 0;
        while (from < to) {
                size_t n = MIN((size_t)(to - from), ELEMENTSOF(x));
                for (size_t i = 0; i < n; i++) {
                        const HandoffGroup *g = &o->h->groups[from + i];
                        x[i] = (TraceDetail){ .has_group = true, .group = (int32_t)(from + i),
                                              .bytes = g->bytes_done,
                                              .duration_usec = now > g->ready_usec && g->ready_usec > 0
                                                                       ? now - g->ready_usec
                                                                       : 0 };
                        if (i == 0)
                                trace_fill(o, &x[0]);
                        else {
                                x[i].transport = x[0].transport;
                                x[i].peer = x[0].peer;
                                x[i].has_uid = x[0].has_uid;
                                x[i].uid = x[0].uid;
                        }
                }
                (void)telemetry_trace_n(o->hm->manager, o->request_str, type, x, n);
                from += (uint32_t)n;
        }
}

/* The CUDA transport, where the GPU domain is on. */
Transport *handoff_gpu_transport(HandoffManager *hm) {
        return hm->manager->gpu ? hm->manager->gpu->transport : NULL;
}

Manager *handoff_obj_manager(HandoffObject *o) {
        return o->hm->manager;
}

uint64_t handoff_client_serial(const Client *c) {
        return c ? c->serial : 0;
}

uint32_t handoff_worker_arena_index(Client *c, uint32_t arena) {
        Worker *w = c ? client_get_worker(c) : NULL;
        if (!w || arena >= 64 || !(w->arena_mask & (UINT64_C(1) << arena)))
                return UINT32_MAX;
        /* RegisterWorker's reply lists the mapped arenas in the daemon's order. */
        return (uint32_t)__builtin_popcountll(w->arena_mask & ((UINT64_C(1) << arena) - 1));
}

bool handoff_object_owned_by(const HandoffObject *o, const Client *c) {
        return o && c && o->owned && o->object.owner == c;
}

HandoffObject *handoff_manager_get(HandoffManager *hm, const char *handle_or_path) {
        if (!hm || !handle_or_path)
                return NULL;
        const char *s = handle_or_path;
        if (strncmp(s, HANDOFF_PATH_PREFIX "/", strlen(HANDOFF_PATH_PREFIX) + 1) == 0)
                s += strlen(HANDOFF_PATH_PREFIX) + 1;
        return hashmap_get(hm->by_handle, s);
}

void handoff_count_failure(HandoffManager *hm, HandoffCause c) {
        if (c > HANDOFF_CAUSE_NONE && c < _HANDOFF_CAUSE_MAX)
                hm->counters.failures[c]++;
}

/* Local handoffs have two objects; the counters count a handoff once (its source). */
bool handoff_counts(const HandoffObject *o) {
        return !o->twin || o->h->role == HANDOFF_SOURCE;
}

/* ---- pages ---- */

void handoff_obj_drop_pages(HandoffObject *o) {
        if (!o->holds_pages)
                return;
        o->holds_pages = false;
        /* Last page first, like sequences (sequence.c): freed pages come back in order. */
        for (uint32_t i = o->n_pages; i > 0; i--) {
                if (o->page_keys)
                        (void)hashmap_remove(o->hm->dest_pages, &o->page_keys[i - 1]);
                (void)page_unlease(o->pool, o->pages[i - 1]);
                if (o->h->role == HANDOFF_DESTINATION && !o->zero_copy)
                        (void)page_unref(o->pool, o->pages[i - 1]);
        }
        page_manager_take_frees(o->hm->manager->page_manager);
        /* Allocated for a request and back in the pool uncommitted: the scheduler holds
         * them back for it again (zero-copy pages stay with the prefill's sequence). */
        if (o->sched_taken > 0 && !o->zero_copy && o->h->state != HANDOFF_COMMITTED) {
                Manager *m = o->hm->manager;
                if (o->arena < m->n_arenas)
                        manager_pages_taken(m, o->request_str, m->arenas[o->arena], -(int64_t)o->sched_taken);
        }
        o->sched_taken = 0;
}

/* ---- object lifetime ---- */

static void obj_unown(HandoffObject *o) {
        if (!o->owned)
                return;
        client_object_unlink(&o->object);
        o->owned = false;
}

static void release_client_object(ClientObject *co) {
        HandoffObject *o = container_of(co, HandoffObject, object);
        if (handoff_is_live(o->h))
                (void)handoff_rollback(o->h, HANDOFF_CAUSE_WORKER_GONE, false);
        (void)handoff_release(o->h);
        obj_unown(o);
        handoff_after_event(o);
}

int handoff_obj_link(HandoffObject *o, Client *c) {
        int r = client_object_link(c, &o->object, CLIENT_OBJECT_HANDOFF, release_client_object);
        if (r < 0)
                return r;
        o->owned = true;
        return 0;
}

Hashmap *handoff_request_map(HandoffManager *hm, HandoffRole role) {
        return role == HANDOFF_SOURCE ? hm->sources : hm->destinations;
}

void handoff_obj_free(HandoffObject *o) {
        if (!o)
                return;
        HandoffManager *hm = o->hm;
        handoff_window_leave(o);
        handoff_signals_flush_one(o); /* its last signals leave before it goes */
        /* Gone is released, also on the error paths of Prepare. */
        handoff_journal_released(o);
        handoff_obj_drop_pages(o);
        obj_unown(o);
        if (o->in_request_map && hashmap_get(handoff_request_map(hm, o->h->role), o->h->request_id.bytes) == o) {
                (void)hashmap_remove(handoff_request_map(hm, o->h->role), o->h->request_id.bytes);
                /* The request's last attempt here ends unaccepted: a late Accept hears why. */
                if (o->h->role == HANDOFF_DESTINATION && o->h->accepted_by == 0 &&
                    o->h->state == HANDOFF_ROLLED_BACK) {
                        handoff_ending_remember(o);
                        handoff_expect_ended(o);
                }
        }
        (void)hashmap_remove(hm->by_handle, o->handle_str);
        handoff_settle_forget(o);
        handoff_slot_forget(o);
        handoff_unstall_forget(o);
        if (o->twin)
                o->twin->twin = NULL;
        if (o->waiter) {
                HandoffPrepareWaiter *w = TAKE_PTR(o->waiter);
                w->done(w, NULL, -EIO, "Handoff ended.");
        }
        sd_event_source_disable_unref(o->timer);
        handoff_staging_put(o); /* no write of it is in flight (handoff_can_free) */
        for (uint32_t g = 0; o->net_writes && g < o->h->n_groups; g++)
                free(o->net_writes[g]);
        free(o->net_writes);
        free(o->n_net);
        free(o->stage_landed);
        free(o->pages);
        free(o->page_keys);
        free(o->dst_offsets);
        free(o->layouts);
        free(o->path);
        free(o->sequence_path);
        handoff_free(o->h);
        free(o);
}

static int on_timer(sd_event_source *s, uint64_t usec, void *userdata) {
        HandoffObject *o = userdata;
        usec_t now = now_usec(CLOCK_MONOTONIC);

        if (now < o->h->deadline_usec) {
                /* Early: the bound on a Prepare's wait for its destination. */
                if (!o->waiter || o->h->state != HANDOFF_PREPARING) {
                        (void)handoff_obj_arm_timer(o, o->h->deadline_usec);
                        return 0;
                }
                log_info("handoff %s: the destination did not answer Prepare within %llus: rolled back",
                         o->request_str, (unsigned long long)(HANDOFF_PREPARE_ANSWER_USEC / USEC_PER_SEC));
                (void)handoff_rollback(o->h, HANDOFF_CAUSE_TIMEOUT, false);
        } else if (handoff_check_timeout(o->h, now) > 0)
                log_info("handoff %s (%s): timed out", o->request_str, handoff_role_to_string(o->h->role));
        handoff_after_event(o);
        return 0;
}

int handoff_obj_arm_timer(HandoffObject *o, usec_t when) {
        if (when == USEC_INFINITY)
                return o->timer ? sd_event_source_set_enabled(o->timer, SD_EVENT_OFF) : 0;
        if (!o->timer)
                return sd_event_add_time(o->hm->manager->event, &o->timer, CLOCK_MONOTONIC, when, 0, on_timer, o);
        int r = sd_event_source_set_time(o->timer, when);
        if (r >= 0)
                r = sd_event_source_set_enabled(o->timer, SD_EVENT_ONESHOT);
        return r;
}

int handoff_obj_new(HandoffManager *hm, HandoffRole role, const EpdId *request_id, uint64_t token,
                   uint32_t n_groups, const uint64_t *bytes_per_group, usec_t timeout,
                   HandoffObject **ret) {
        Manager *m = hm->manager;
        if (hashmap_size(hm->by_handle) >= HANDOFF_MANAGER_MAX)
                return -EDQUOT;
        if (role == HANDOFF_DESTINATION) {
                /* At most one live destination per request, whatever side prepared it (a
                 * peer, another peer, this host): a newer token rolls the older attempt
                 * back (its source is told), an older one is refused. Both would have
                 * lived, the older deaf to its messages (the request map names one) and
                 * committing without a journal entry (the journal keeps the newest). */
                HandoffObject *old = hashmap_get(hm->destinations, request_id->bytes);
                if (old && handoff_is_live(old->h)) {
                        if (old->h->token >= token)
                                return -ESTALE;
                        (void)handoff_rollback(old->h, HANDOFF_CAUSE_REFUSED, false);
                        handoff_after_event(old);
                }
        }

        HandoffObject *o = calloc(1, sizeof *o);
        if (!o)
                return -ENOMEM;
        o->hm = hm;
        usec_t now = now_usec(CLOCK_MONOTONIC);
        int r = handoff_new(role, request_id, token, n_groups, bytes_per_group, now, timeout, &o->h);
        if (r < 0) {
                free(o);
                return r;
        }
        o->notified_state = o->h->state;
        epd_id_to_string(request_id, o->request_str);
        (void)telemetry_trace(m, o->request_str, TRACE_HANDOFF_PREPARE,
                              &(TraceDetail){ .detail = handoff_role_to_string(role) });
        r = epd_id_random(&o->handle);
        if (r >= 0) {
                epd_id_to_string(&o->handle, o->handle_str);
                if (asprintf(&o->path, HANDOFF_PATH_PREFIX "/%s", o->handle_str) < 0) {
                        o->path = NULL;
                        r = -ENOMEM;
                }
        }
        if (r >= 0)
                r = hashmap_put(hm->by_handle, o->handle_str, o);
        if (r >= 0 && o->h->deadline_usec != USEC_INFINITY)
                r = sd_event_add_time(m->event, &o->timer, CLOCK_MONOTONIC, o->h->deadline_usec, 0,
                                      on_timer, o);
        if (r < 0) {
                handoff_obj_free(o);
                return r;
        }
        /* A newer attempt for the same request replaces the older one in the request
         * map; the older stays reachable by its handle until released. */
        Hashmap *map = handoff_request_map(hm, role);
        void *old = NULL;
        r = hashmap_replace(map, o->h->request_id.bytes, o, &old);
        if (r < 0) {
                handoff_obj_free(o);
                return r;
        }
        if (old)
                ((HandoffObject *)old)->in_request_map = false;
        o->in_request_map = true;
        if (role == HANDOFF_DESTINATION)
                handoff_ending_forget(hm, &o->h->request_id); /* a newer attempt */
        *ret = o;
        return 0;
}

/* ---- the central step: after any event, tell who needs to know and free what can go ---- */

static void on_progress(HandoffObject *o, uint32_t from, uint32_t to) {
        Handoff *h = o->h;
        if (h->role == HANDOFF_SOURCE) {
                if (handoff_counts(o))
                        o->hm->counters.groups += to - from;
                trace_groups(o, TRACE_GROUP_SENT, from, to);
                for (uint32_t g = from; g < to; g++) {
                        if (o->twin) {
                                (void)handoff_group_sent_notice(o->twin->h, g, h->groups[g].bytes_expected);
                        } else if (!o->imm) {
                                /* Without in-band completions the destination needs the
                                 * word that every write of the group landed. */
                                HandoffMessage msg = {
                                        .type = HANDOFF_MSG_GROUP_SENT,
                                        .group = g,
                                        .bytes = h->groups[g].bytes_done,
                                };
                                handoff_send_message(o, &msg);
                        }
                }
                if (o->twin)
                        handoff_after_event(o->twin);
        } else
                trace_groups(o, TRACE_GROUP_RECEIVED, from, to);
        handoff_notify_progress(o, to);
}

/* The destination answered the source's Prepare (pages reserved, or refused, or the
 * peer is gone): the caller waiting for Prepare hears of it. */
static void prepare_answered(HandoffObject *o) {
        HandoffPrepareWaiter *w = TAKE_PTR(o->waiter);
        if (!w)
                return;
        if (!handoff_is_ended(o->h)) {
                w->done(w, o, 0, NULL); /* handoff_journal_state() appended the PREPARED record */
                return;
        }
        int r;
        switch (o->h->cause) {
        case HANDOFF_CAUSE_NO_SPACE:
                r = -ENOSPC;
                break;
        case HANDOFF_CAUSE_PEER_DOWN:
                r = -EHOSTUNREACH;
                break;
        case HANDOFF_CAUSE_TIMEOUT:
                r = -ETIMEDOUT;
                break;
        default:
                /* Why the destination refused, where it said so in a way the caller can
                 * act on (the same names as a refusal on one host); anything else is
                 * Failed. */
                switch (o->refused_error) {
                case -ESTALE:
                case -EINVAL:
                case -ENOSPC:
                case -ENOMEM:
                case -EBUSY:
                case -EEXIST:
                case -EDQUOT: /* its limits (objects, the journal): LimitExceeded, as on one host */
                case -EAGAIN:
                        r = o->refused_error;
                        break;
                default:
                        r = -EIO;
                        break;
                }
                break;
        }
        Reason why;
        if (o->journal_error < 0)
                (void)reason_set(&why, r = o->journal_error, "Handoff %s: cannot journal the Prepare: %s.",
                                 o->request_str, strerror(-o->journal_error));
        else if (o->refused_error == 0 && o->h->cause == HANDOFF_CAUSE_TRANSFER_FAILED)
                /* This side's post failed (the destination had not answered yet). */
                (void)reason_set(&why, r, "Handoff %s: its layer groups could not be sent to %s (transfer-failed).",
                                 o->request_str, o->peer_host);
        else
                (void)reason_set(&why, r, "Handoff %s: the destination did not reserve pages (%s%s%s).",
                                 o->request_str, handoff_cause_to_string(o->h->cause),
                                 r != -EIO ? ": " : "", r != -EIO ? strerror(-r) : "");
        w->done(w, NULL, r, why.text);
        /* The caller never learnt the handoff's path: it goes now. */
        (void)handoff_release(o->h);
        obj_unown(o);
}

static HandoffPath *path_get(HandoffManager *hm, const char *peer, const char *transport) {
        for (size_t i = 0; i < hm->n_paths; i++)
                if (strcmp(hm->paths[i].peer, peer) == 0 && strcmp(hm->paths[i].transport, transport) == 0)
                        return &hm->paths[i];
        if (hm->n_paths >= HANDOFF_PATHS_MAX)
                return NULL; /* counted in the daemon's totals all the same */
        HandoffPath *p = reallocarray(hm->paths, hm->n_paths + 1, sizeof *p);
        if (!p)
                return NULL;
        hm->paths = p;
        p = &hm->paths[hm->n_paths++];
        *p = (HandoffPath){};
        snprintf(p->peer, sizeof p->peer, "%s", peer);
        snprintf(p->transport, sizeof p->transport, "%s", transport);
        return p;
}

/* A handoff committed or rolled back: its (peer, transport) counts it, once per side
 * (the source of a local handoff only: its twin is the same handoff). */
static void path_count(HandoffObject *o, bool committed) {
        Handoff *h = o->h;
        if (o->twin && h->role != HANDOFF_SOURCE)
                return;
        const char *transport = o->transport;
        if (!transport) {
                Transport *t = o->peer ? peer_manager_transport_for(o->hm->manager->peers, o->peer) : NULL;
                transport = t ? t->ops->name : o->peer ? "tcp" : "local";
        }
        HandoffPath *p = path_get(o->hm, o->peer_host[0] && !o->twin ? o->peer_host : "local", transport);
        if (!p)
                return;
        if (!committed)
                p->failed++;
        else if (h->role == HANDOFF_SOURCE) {
                p->handoffs_out++;
                p->bytes_out += o->bytes_moved;
                usec_t now = now_usec(CLOCK_MONOTONIC);
                histogram_observe(&p->duration, now > h->created_usec ? now - h->created_usec : 0);
        } else {
                p->handoffs_in++;
                p->bytes_in += o->bytes_moved;
        }
}

const HandoffPath *handoff_manager_path(HandoffManager *hm, size_t i) {
        return hm && i < hm->n_paths ? &hm->paths[i] : NULL;
}

static void on_state(HandoffObject *o, HandoffState old) {
        Handoff *h = o->h;
        HandoffManager *hm = o->hm;
        bool was_live = old != HANDOFF_COMMITTED && old != HANDOFF_ROLLED_BACK && old != HANDOFF_RELEASED;

        /* The destination answered (pages reserved, or refused, or the peer is gone). */
        if (o->waiter && h->state != HANDOFF_PREPARING)
                prepare_answered(o);

        if (handoff_is_ended(h) && was_live && h->cause != HANDOFF_CAUSE_NONE) {
                if (handoff_counts(o)) {
                        hm->counters.rolled_back++;
                        handoff_count_failure(hm, h->cause);
                }
                path_count(o, false);
                log_info("handoff %s (%s): rolled back: %s%s", o->request_str, handoff_role_to_string(h->role),
                         handoff_cause_to_string(h->cause), h->remote_rolled_back ? " (other side)" : "");
                trace(o, TRACE_ROLLBACK, &(TraceDetail){ .detail = handoff_cause_to_string(h->cause) });
                if (!h->remote_rolled_back) {
                        if (o->twin) {
                                HandoffObject *t = o->twin;
                                (void)handoff_rollback(t->h, h->cause, true);
                                handoff_after_event(t);
                        } else {
                                HandoffMessage msg = { .type = HANDOFF_MSG_ROLLBACK, .cause = h->cause };
                                handoff_send_message(o, &msg);
                        }
                }
        }
        if (h->state == HANDOFF_COMMITTED && old != HANDOFF_COMMITTED) {
                trace(o, TRACE_COMMIT, &(TraceDetail){ .detail = handoff_role_to_string(h->role) });
                path_count(o, true);
        }
        if (h->state == HANDOFF_RELEASED && old != HANDOFF_RELEASED)
                trace(o, TRACE_RELEASE, &(TraceDetail){ .detail = handoff_role_to_string(h->role) });
        if (h->state == HANDOFF_RELEASED && handoff_counts(o))
                hm->counters.released++;
        handoff_notify_state(o);
}

void handoff_after_event(HandoffObject *o) {
        Handoff *h = o->h;
        uint32_t from, to;

        /* Telling one side of a local handoff tells the other, which may tell this one
         * again (both rolled back on their own, say): the nested call tells and frees
         * nothing of o's; the outermost one, still using o, decides whether it goes. */
        o->in_event++;
        /* A COMMIT that came before this side's completions were all taken. */
        if (o->commit_received && h->state != HANDOFF_TRANSFERRING) {
                o->commit_received = false;
                if (handoff_commit(h, 0) == 1 && handoff_counts(o))
                        o->hm->counters.committed++;
        }
        /* Progress is not journaled: a handoff in flight comes back rolled back after a
         * restart anyway (docs/wal.md). */
        if (handoff_take_progress(h, &from, &to) > 0)
                on_progress(o, from, to);
        if (h->state != o->notified_state) {
                HandoffState old = o->notified_state;
                handoff_journal_state(o);
                o->notified_state = h->state;
                on_state(o, old);
        }
        /* Out of the peer's window once every byte is across (or it ended). */
        if (o->windowed && (handoff_is_ended(h) || h->state >= HANDOFF_TRANSFERRED))
                handoff_window_leave(o);
        /* Ended with staged groups waiting for room to the peer: their writes complete
         * (cancelled) now, so that nothing stays counted in flight. */
        if (o->staged && handoff_is_ended(h))
                handoff_stage_send_landed(o);
        if (h->inflight == 0 && (handoff_is_ended(h) || h->state == HANDOFF_COMMITTED)) {
                handoff_obj_drop_pages(o);
                handoff_staging_put(o);
        }
        if (--o->in_event > 0)
                return;
        /* Prepared with release_on_commit: committed (its owner told above), so
         * released as a Release call would; nothing of o is used after. */
        if (o->release_on_commit && o->owned && h->state == HANDOFF_COMMITTED) {
                /* An owner without a ring (or whose ring had no room) hears "committed"
                 * while it still owns the object: queued signals go to the owner at the
                 * loop's turn, by which time the release has unowned and freed it. */
                handoff_signals_flush_one(o);
                handoff_manager_release(o);
                return;
        }
        if (handoff_can_free(h) && (h->state == HANDOFF_RELEASED || !o->owned))
                handoff_obj_free(o);
}

int handoff_manager_rollback(HandoffObject *o, Reason *why) {
        int r = handoff_rollback(o->h, HANDOFF_CAUSE_REQUESTED, false);
        if (r == -EALREADY)
                return reason_set(why, -EBUSY, "Handoff %s is committed.", o->request_str);
        if (r < 0)
                return reason_set(why, -ESTALE, "Handoff %s was released.", o->request_str);
        handoff_after_event(o);
        return 0;
}

void handoff_obj_hold(HandoffObject *o) {
        o->in_event++;
}

void handoff_obj_unhold(HandoffObject *o) {
        o->in_event--;
        handoff_after_event(o);
}

void handoff_manager_release(HandoffObject *o) {
        (void)handoff_release(o->h);
        obj_unown(o);
        handoff_after_event(o);
}

/* ---- counters ---- */

uint64_t handoff_manager_ring_backlogged(HandoffManager *hm) {
        uint64_t n = hm->counters.ring_backlogged;
        ClientRing *cr;
        size_t it = 0;
        while (hashmap_iterate(hm->rings, &it, (void **)&cr, NULL))
                n += cr->ring->backlogged;
        return n;
}

size_t handoff_manager_counters(HandoffManager *hm, const char **names, uint64_t *values, size_t n) {
        const HandoffCounters *c = &hm->counters;
        size_t k = 0;
#define PUT(nm, v)                                                                       \
        do {                                                                             \
                if (k < n) {                                                             \
                        names[k] = nm;                                                   \
                        values[k] = v;                                                   \
                }                                                                        \
                k++;                                                                     \
        } while (0)
        PUT("prepared", c->prepared);
        PUT("committed", c->committed);
        PUT("rolled-back", c->rolled_back);
        PUT("released", c->released);
        PUT("refused", c->refused);
        PUT("deferred", c->deferred);
        PUT("groups", c->groups);
        PUT("bytes", c->bytes);
        PUT("batches", c->batches);
        PUT("zero-copy-groups", c->zero_copy_groups);
        PUT("merged-groups", c->merged_groups);
        PUT("gpu-slices", c->gpu_slices);
        PUT("ring-fallbacks", c->ring_fallbacks);
        PUT("ring-backlogged", handoff_manager_ring_backlogged(hm));
        PUT("rings-lost", c->rings_lost);
        PUT("pipelined", c->pipelined);
        PUT("journal-waits", c->journal_waits);
        PUT("write-stalls", c->stalls);
        PUT("post-yields", c->post_yields);
        PUT("live", hashmap_size(hm->by_handle));
        PUT("writes-in-flight", hashmap_size(hm->writes) + hashmap_size(hm->incoming));
        uint64_t staging, staging_busy;
        handoff_staging_count(hm, &staging, &staging_busy);
        PUT("staging-buffers", staging);
        PUT("staging-busy", staging_busy);
        PUT("staging-bytes", hm->staging_bytes);
        static const char *const fail[_HANDOFF_CAUSE_MAX] = {
                [HANDOFF_CAUSE_REQUESTED] = "failures.requested",
                [HANDOFF_CAUSE_TIMEOUT] = "failures.timeout",
                [HANDOFF_CAUSE_PEER_DOWN] = "failures.peer-down",
                [HANDOFF_CAUSE_WORKER_GONE] = "failures.worker-gone",
                [HANDOFF_CAUSE_TRANSFER_FAILED] = "failures.transfer-failed",
                [HANDOFF_CAUSE_NO_SPACE] = "failures.no-space",
                [HANDOFF_CAUSE_REFUSED] = "failures.refused",
                [HANDOFF_CAUSE_REMOTE] = "failures.remote",
                [HANDOFF_CAUSE_SHUTDOWN] = "failures.shutdown",
                [HANDOFF_CAUSE_PROTOCOL] = "failures.protocol",
        };
        for (int i = 1; i < _HANDOFF_CAUSE_MAX; i++)
                PUT(fail[i], c->failures[i]);
#undef PUT
        return k;
}

/* ---- subsystem ---- */

static int attach_peer(sd_event_source *s, void *userdata) {
        HandoffManager *hm = userdata;
        Manager *m = hm->manager;
        hm->attach = sd_event_source_disable_unref(hm->attach);
        if (!m->peers || hm->peer_attached)
                return 0;
        int r = peer_manager_register_handler(m->peers, HANDOFF_MSG_FIRST, HANDOFF_MSG_LAST, handoff_on_peer_message, m);
        if (r >= 0)
                r = peer_manager_add_state_handler(m->peers, handoff_on_peer_state, m);
        Transport *t = peer_manager_transport(m->peers);
        if (r >= 0 && t && t->ops->completion_fd(t) >= 0)
                r = sd_event_add_io(m->event, &hm->peer_source, t->ops->completion_fd(t), EPOLLIN, handoff_on_peer_completion, hm);
        t = peer_manager_rdma(m->peers);
        if (r >= 0 && t && t->ops->completion_fd(t) >= 0)
                r = sd_event_add_io(m->event, &hm->rdma_source, t->ops->completion_fd(t), EPOLLIN, handoff_on_rdma_completion, hm);
        if (r < 0)
                return log_error_errno(r, "handoff: cannot hook into the peer manager: %m");
        peer_manager_set_incoming_validator(m->peers, handoff_on_incoming_validate, m);
        peer_manager_set_incoming_done(m->peers, handoff_on_incoming_done, m);
        hm->peer_attached = true;
        return 0;
}

static int handoff_init(Manager *m) {
        HandoffManager *hm = calloc(1, sizeof *hm);
        if (!hm)
                return -ENOMEM;
        hm->manager = m;
        hm->slice_size = HANDOFF_SLICE_DEFAULT;
        hm->by_handle = hashmap_new(HASHMAP_KEY_STRING, 0);
        hm->sources = hashmap_new(HASHMAP_KEY_BYTES, sizeof(EpdId));
        hm->destinations = hashmap_new(HASHMAP_KEY_BYTES, sizeof(EpdId));
        hm->writes = hashmap_new(HASHMAP_KEY_U64, 0);
        hm->incoming = hashmap_new(HASHMAP_KEY_BYTES, sizeof(InKey));
        hm->dest_pages = hashmap_new(HASHMAP_KEY_U64, 0);
        hm->rings = hashmap_new(HASHMAP_KEY_U64, 0);
        hm->watchers = hashmap_new(HASHMAP_KEY_U64, 0);
        hm->windows = hashmap_new(HASHMAP_KEY_STRING, 0);
        hm->expects = hashmap_new(HASHMAP_KEY_BYTES, sizeof(EpdId));
        hm->slots = hashmap_new(HASHMAP_KEY_BYTES, sizeof(SlotKey));
        hm->peer_slots = hashmap_new(HASHMAP_KEY_U64, 0);
        m->handoffs = hm;
        if (handoff_journal_init(&hm->journal) < 0)
                return -ENOMEM;
        if (!hm->by_handle || !hm->sources || !hm->destinations || !hm->writes || !hm->incoming ||
            !hm->dest_pages || !hm->rings || !hm->watchers || !hm->windows || !hm->expects || !hm->slots || !hm->peer_slots)
                return -ENOMEM;

        int r = local_transport_new(0, &hm->local);
        if (r < 0)
                return log_error_errno(r, "handoff: cannot start the local transport: %m");
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (a->domain != MEMORY_HOST)
                        continue;
                r = hm->local->ops->register_region(hm->local, &a->region);
                if (r < 0)
                        return log_error_errno(r, "handoff: cannot register arena %s: %m", a->name);
        }
        r = sd_event_add_io(m->event, &hm->local_source, hm->local->ops->completion_fd(hm->local), EPOLLIN,
                            handoff_on_local_completion, hm);
        if (r < 0)
                return r;
        /* The GPU domain's copies (its subsystem starts first and registered every arena
         * with the CUDA transport). */
        Transport *gt = handoff_gpu_transport(hm);
        if (gt) {
                r = sd_event_add_io(m->event, &hm->gpu_source, gt->ops->completion_fd(gt), EPOLLIN,
                                    handoff_on_gpu_completion, hm);
                if (r < 0)
                        return log_error_errno(r, "handoff: cannot watch the CUDA transport: %m");
        }
        /* Workers that use the ring hear of backpressure there, without the bus (the
         * telemetry subsystem starts first). */
        if (m->telemetry) {
                r = telemetry_add_backpressure_handler(m->telemetry, handoff_on_backpressure, hm);
                if (r < 0)
                        return log_error_errno(r, "handoff: cannot subscribe to backpressure: %m");
        }
        /* The peer manager may start after this subsystem: hook into it from the loop's
         * first iteration, before any peer can have authenticated. */
        r = sd_event_add_defer(m->event, &hm->attach, attach_peer, hm);
        if (r >= 0)
                r = sd_event_source_set_priority(hm->attach, SD_EVENT_PRIORITY_IMPORTANT);
        return r;
}

static void handoff_done(Manager *m) {
        HandoffManager *hm = m->handoffs;
        if (!hm)
                return;
        telemetry_remove_backpressure_handler(m->telemetry, handoff_on_backpressure, hm);
        HandoffObject *o;
        ClientRing *cr;
        size_t it;
        if (m->peers && hm->peer_attached) {
                /* No more incoming writes into pages that are about to go. */
                peer_manager_set_incoming_validator(m->peers, NULL, NULL);
                peer_manager_set_incoming_done(m->peers, NULL, NULL);
        }
        handoff_expect_done(hm);
        /* Clients are gone by now: what is left has no owner. Roll everything back; the
         * transports are stopped below, so nothing lands later. */
        if (hm->local) {
                hm->local->ops->cancel_peer(hm->local, NULL);
                for (size_t i = 0; i < m->n_arenas; i++)
                        if (m->arenas[i]->domain == MEMORY_HOST)
                                hm->local->ops->unregister_region(hm->local, &m->arenas[i]->region);
                hm->local->ops->free(hm->local); /* joins the copy threads */
                hm->local = NULL;
        }
        /* A GPU copy cannot be recalled: wait for those in flight before their pages go
         * (the CUDA transport itself goes later, with the GPU domain). */
        Transport *gt = handoff_gpu_transport(hm);
        if (gt) {
                GpuCopyEngine *e = cuda_transport_engine(gt);
                TransportCompletion c[64];
                while (gpu_copy_engine_in_flight(e) > 0 && gpu_copy_wait(e, 1000) >= 0)
                        while (gt->ops->poll(gt, c, ELEMENTSOF(c)) > 0)
                                ;
                while (gt->ops->poll(gt, c, ELEMENTSOF(c)) > 0)
                        ;
        }
        /* Peer writes out of staging buffers: none may read them once they are gone. */
        Transport *nt = m->peers ? peer_manager_transport(m->peers) : NULL;
        it = 0;
        Transport *rt = m->peers ? peer_manager_rdma(m->peers) : NULL;
        while (nt && hm->by_handle && hashmap_iterate(hm->by_handle, &it, (void **)&o, NULL))
                if (o->staging && o->peer) {
                        nt->ops->cancel_peer(nt, o->peer);
                        if (rt)
                                rt->ops->cancel_peer(rt, o->peer);
                }
        while ((it = 0, hm->by_handle && hashmap_iterate(hm->by_handle, &it, (void **)&o, NULL))) {
                if (handoff_is_live(o->h))
                        (void)handoff_rollback(o->h, HANDOFF_CAUSE_SHUTDOWN, false);
                o->peer = NULL;
                o->h->inflight = 0;
                for (uint32_t g = 0; g < o->h->n_groups; g++)
                        o->h->groups[g].writes_pending = 0;
                (void)handoff_release(o->h);
                obj_unown(o);
                handoff_obj_free(o);
        }
        while ((it = 0, hm->rings && hashmap_iterate(hm->rings, &it, (void **)&cr, NULL)))
                handoff_ring_free(cr);
        HandoffWatcher *hw;
        while ((it = 0, hm->watchers && hashmap_iterate(hm->watchers, &it, (void **)&hw, NULL)))
                handoff_watcher_free(hw);
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX; i++)
                handoff_staging_free(hm, hm->staging[i]);
        void *v;
        while ((it = 0, hm->writes && hashmap_iterate(hm->writes, &it, &v, NULL)))
                free(hashmap_remove(hm->writes, &((OutWrite *)v)->cookie));
        while ((it = 0, hm->incoming && hashmap_iterate(hm->incoming, &it, &v, NULL)))
                free(hashmap_remove(hm->incoming, &((InWrite *)v)->key));
        sd_event_source_disable_unref(hm->local_source);
        hm->signal_source = sd_event_source_disable_unref(hm->signal_source);
        hm->kick_source = sd_event_source_disable_unref(hm->kick_source);
        hm->yield_source = sd_event_source_disable_unref(hm->yield_source);
        sd_event_source_disable_unref(hm->peer_source);
        sd_event_source_disable_unref(hm->rdma_source);
        sd_event_source_disable_unref(hm->gpu_source);
        sd_event_source_disable_unref(hm->attach);
        sd_event_source_disable_unref(hm->journal_grace);
        handoff_journal_done(&hm->journal);
        free(hm->paths);
        hashmap_free(hm->by_handle);
        hashmap_free(hm->sources);
        hashmap_free(hm->destinations);
        hashmap_free(hm->writes);
        hashmap_free(hm->incoming);
        hashmap_free(hm->dest_pages);
        hashmap_free(hm->rings);
        hashmap_free(hm->watchers);
        hashmap_free(hm->expects);
        handoff_endings_free(hm);
        hashmap_free(hm->slots);
        while ((it = 0, hm->peer_slots && hashmap_iterate(hm->peer_slots, &it, &v, NULL)))
                free(hashmap_remove(hm->peer_slots, v));
        hashmap_free(hm->peer_slots);
        while ((it = 0, hm->windows && hashmap_iterate(hm->windows, &it, &v, NULL))) {
                free(hashmap_remove(hm->windows, ((PeerWindow *)v)->host));
        }
        hashmap_free(hm->windows);
        free(hm);
        m->handoffs = NULL;
}

static const SubsystemJournal handoff_journal_hooks = {
        .families = (const uint8_t[]){ WAL_RECORD_HANDOFF >> 8, 0 },
        .apply_record = handoff_manager_apply_record,
        .restore_finish = handoff_manager_restore_finish,
        .snapshot = handoff_manager_snapshot,
};

static void handoff_after_dispatch(Manager *m) {
        handoff_rings_kick_pending(m->handoffs);
        handoff_yield_after_dispatch(m->handoffs);
}

/* A decode worker is gone: the handoffs meant for it alone (Prepare's target) that it
 * had not accepted go with it, as an accepted one goes with its client. Nobody else
 * may accept them: left, they held both sides' pages until their timeout (or, with
 * none, until the source let go). */
static void handoff_worker_gone(Manager *m, Worker *w) {
        HandoffManager *hm = m->handoffs;
        HandoffObject *o, **v;
        size_t it = 0, n = 0;
        if (!hm || hashmap_size(hm->destinations) == 0)
                return;
        v = calloc(hashmap_size(hm->by_handle), sizeof *v);
        if (!v) {
                log_oom();
                return; /* they end at their timeout, as before */
        }
        while (hashmap_iterate(hm->by_handle, &it, (void **)&o, NULL))
                if (o->h->role == HANDOFF_DESTINATION && o->h->accepted_by == 0 && handoff_is_live(o->h) &&
                    !epd_id_is_null(&o->target_worker) && epd_id_equal(&o->target_worker, &w->id)) {
                        handoff_obj_hold(o);
                        v[n++] = o;
                }
        for (size_t i = 0; i < n; i++) {
                if (handoff_is_live(v[i]->h)) {
                        log_info("handoff %s: its decode worker %s is gone before it accepted: rolled back.",
                                 v[i]->request_str, w->id_str);
                        (void)handoff_rollback(v[i]->h, HANDOFF_CAUSE_WORKER_GONE, false);
                        handoff_after_event(v[i]);
                }
                handoff_obj_unhold(v[i]);
        }
        free(v);
}

const Subsystem handoff_subsystem = {
        .name = "handoff",
        .init = handoff_init,
        .done = handoff_done,
        .add_bus = bus_handoff_add,
        .after_dispatch = handoff_after_dispatch,
        .worker_gone = handoff_worker_gone,
        .worker_departing = handoff_worker_gone,
        .journal = &handoff_journal_hooks,
};
