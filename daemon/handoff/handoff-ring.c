/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The workers' ring pairs (ring.h): progress and state of a handoff go to its owner's
 * ring first (the bus signal stays, as the fallback), and LayerGroupReady comes in as
 * submissions. */
#include "handoff/handoff-internal.h"
#include "wal/wal-manager.h"

/* ---- notifications to the owning worker: ring first, D-Bus as fallback ---- */

/* A signal to one client: on its direct connection, or unicast to its unique name. */
static void emit_to(Client *c, const char *path, const char *member, const char *types, va_list ap) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
        va_list aq;
        if (!c || !c->bus || c->dying)
                return;
        int r = sd_bus_message_new_signal(c->bus, &m, path, "org.epd1.Handoff", member);
        if (r >= 0 && c->unique_name)
                r = sd_bus_message_set_destination(m, c->unique_name);
        if (r >= 0) {
                va_copy(aq, ap);
                r = sd_bus_message_appendv(m, types, aq);
                va_end(aq);
        }
        if (r >= 0)
                r = sd_bus_send(c->bus, m, NULL);
        if (r < 0)
                log_debug_errno(r, "handoff: cannot send %s to client %" PRIu64 ": %m", member, c->serial);
}

void handoff_emit_signal(HandoffObject *o, bool to_owner, const char *member, const char *types, ...) {
        HandoffManager *hm = o->hm;
        Client *owner = o->owned ? o->object.owner : NULL;
        HandoffWatcher *w;
        size_t it = 0;
        va_list ap;
        va_start(ap, types);
        while (hashmap_iterate(hm->watchers, &it, (void **)&w, NULL))
                if (w->object.owner != owner) /* the owner gets it once, below */
                        emit_to(w->object.owner, o->path, member, types, ap);
        if (owner && (to_owner || hashmap_get(hm->watchers, &(uint64_t){ handoff_client_serial(owner) })))
                emit_to(owner, o->path, member, types, ap);
        va_end(ap);
}

void handoff_watcher_free(HandoffWatcher *w) {
        if (!w)
                return;
        (void)hashmap_remove(w->hm->watchers, &w->serial);
        if (w->object.owner)
                client_object_unlink(&w->object);
        free(w);
}

static void release_watcher(ClientObject *co) {
        handoff_watcher_free(container_of(co, HandoffWatcher, object));
}

int handoff_manager_watch(HandoffManager *hm, Client *c, bool enable, Reason *why) {
        uint64_t serial = handoff_client_serial(c);
        HandoffWatcher *w = hashmap_get(hm->watchers, &serial);
        if (!enable) {
                handoff_watcher_free(w);
                return 0;
        }
        if (w)
                return 0; /* a repeat */
        w = calloc(1, sizeof *w);
        if (!w)
                return -ENOMEM;
        w->hm = hm;
        w->serial = serial;
        int r = hashmap_put(hm->watchers, &w->serial, w);
        if (r >= 0) {
                r = client_object_link(c, &w->object, CLIENT_OBJECT_OTHER, release_watcher);
                if (r < 0)
                        (void)hashmap_remove(hm->watchers, &w->serial);
        }
        if (r < 0) {
                free(w);
                if (r == -EDQUOT)
                        return reason_set(why, -EDQUOT, "Too many objects for this client.");
                return r;
        }
        return 0;
}

static ClientRing *owner_ring(HandoffObject *o) {
        if (!o->owned)
                return NULL;
        uint64_t serial = handoff_client_serial(o->object.owner);
        return hashmap_get(o->hm->rings, &serial);
}

void handoff_notify_progress(HandoffObject *o, uint32_t done) {
        Handoff *h = o->h;
        ClientRing *cr = owner_ring(o);
        if (cr) {
                struct epd_ring_record rec;
                ring_record_group_progress(&rec, h->request_id.bytes, h->token, done, h->n_groups,
                                           o->bytes_moved);
                int r = ring_post(cr->ring, &rec);
                handoff_ring_kick_later(cr);
                if (r >= 0) {
                        handoff_signal_later(o, HANDOFF_SIG_PROGRESS);
                        return;
                }
                o->hm->counters.ring_fallbacks++;
        }
        handoff_signal_later(o, HANDOFF_SIG_PROGRESS | HANDOFF_SIG_PROGRESS_OWNER);
}

void handoff_notify_state(HandoffObject *o) {
        Handoff *h = o->h;
        ClientRing *cr = owner_ring(o);
        bool fallback = true;
        if (cr) {
                struct epd_ring_record rec;
                ring_record_handoff_state(&rec, h->request_id.bytes, h->token, h->state, h->cause);
                if (ring_post(cr->ring, &rec) < 0)
                        o->hm->counters.ring_fallbacks++;
                else
                        fallback = false;
                handoff_ring_kick_later(cr);
        }
        /* On the bus: to the watchers, and to the owner when its ring did not take it. */
        handoff_signal_later(o, HANDOFF_SIG_STATE | (fallback ? HANDOFF_SIG_STATE_OWNER : 0));
}

void handoff_signals_flush_one(HandoffObject *o) {
        unsigned s = o->signals;
        if (!s)
                return;
        o->signals = 0;
        LIST_REMOVE(signal, o->hm->signal_pending, o);
        /* The last one went early (its object is being freed): the defer source would
         * only cost the loop a turn for an empty list. */
        if (!o->hm->signal_pending && o->hm->signal_source)
                (void)sd_event_source_set_enabled(o->hm->signal_source, SD_EVENT_OFF);
        if (s & HANDOFF_SIG_PROGRESS)
                bus_handoff_emit_progress(o, s & HANDOFF_SIG_PROGRESS_OWNER, o->h->n_notified);
        if (s & HANDOFF_SIG_STATE)
                bus_handoff_emit_state(o, s & HANDOFF_SIG_STATE_OWNER);
}

static int on_signals(sd_event_source *es, void *userdata) {
        HandoffManager *hm = userdata;
        while (hm->signal_pending)
                handoff_signals_flush_one(hm->signal_pending);
        return 0;
}

void handoff_signal_later(HandoffObject *o, unsigned signals) {
        HandoffManager *hm = o->hm;
        /* Nobody to tell: no watcher, and the owner's ring took it. */
        if (!(signals & (HANDOFF_SIG_STATE_OWNER | HANDOFF_SIG_PROGRESS_OWNER)) && hashmap_size(hm->watchers) == 0)
                return;
        if (!o->signals)
                LIST_PREPEND(signal, hm->signal_pending, o);
        o->signals |= signals;
        if (!hm->signal_source &&
            sd_event_add_defer(hm->manager->event, &hm->signal_source, on_signals, hm) < 0) {
                on_signals(NULL, hm); /* no source: at once */
                return;
        }
        (void)sd_event_source_set_enabled(hm->signal_source, SD_EVENT_ONESHOT);
}

/* ---- rings ---- */

static void handoff_ring_lose(ClientRing *cr);

/* may_free: a lost ring is closed here (the loop's after-dispatch point, or an event of
 * its own); not when run synchronously under a caller that may still use the ring (the
 * fallback of handoff_ring_kick_later()): the worker already knows (closed flag), the
 * ring goes at the next of those points or with its client. */
static void kick_all(HandoffManager *hm, bool may_free) {
        while (hm->kick_pending) {
                ClientRing *cr = hm->kick_pending;
                LIST_REMOVE(kick, hm->kick_pending, cr);
                cr->kick_queued = false;
                (void)ring_kick(cr->ring);
                if (may_free && (cr->lost || ring_is_broken(cr->ring)))
                        handoff_ring_lose(cr);
        }
}

static int on_kicks(sd_event_source *s, void *userdata) {
        kick_all(userdata, true);
        return 0;
}

void handoff_rings_kick_pending(HandoffManager *hm) {
        if (hm && hm->kick_pending)
                kick_all(hm, true);
}

void handoff_ring_kick_later(ClientRing *cr) {
        HandoffManager *hm = cr->hm;
        if (!cr->kick_queued) {
                cr->kick_queued = true;
                LIST_PREPEND(kick, hm->kick_pending, cr);
        }
        /* manager_run()'s loop kicks right after the callback that queued this (the
         * subsystem's after_dispatch hook), with no loop turn of its own. */
        if (hm->manager->in_loop)
                return;
        /* Any other loop (tests, helpers): the next thing it runs. */
        if (!hm->kick_source) {
                if (sd_event_add_defer(hm->manager->event, &hm->kick_source, on_kicks, hm) < 0) {
                        kick_all(hm, false); /* no source: at once */
                        return;
                }
                /* First thing on the loop's next turn: the worker waits for it. */
                (void)sd_event_source_set_priority(hm->kick_source, SD_EVENT_PRIORITY_IMPORTANT);
        }
        if (sd_event_source_set_enabled(hm->kick_source, SD_EVENT_ONESHOT) < 0)
                kick_all(hm, false);
}

void handoff_ring_free(ClientRing *cr) {
        if (!cr)
                return;
        if (cr->kick_queued) {
                LIST_REMOVE(kick, cr->hm->kick_pending, cr);
                cr->kick_queued = false;
        }
        log_debug("handoff: ring of client %" PRIu64 " closed", cr->serial);
        if (cr->ring) /* NULL when OpenRing failed making it */
                cr->hm->counters.ring_backlogged += cr->ring->backlogged;
        if (hashmap_get(cr->hm->rings, &cr->serial) == cr) {
                (void)hashmap_remove(cr->hm->rings, &cr->serial);
                handoff_expect_drop_ring(cr->hm, cr->serial);
        }
        if (cr->object.owner)
                client_object_unlink(&cr->object);
        sd_event_source_disable_unref(cr->source);
        ring_free(cr->ring);
        free(cr);
}

/* A ring that lost an answer, or whose CQ the worker corrupted: closed (the worker
 * takes what was posted, then hears -ECONNRESET; its client may open another). */
static void handoff_ring_lose(ClientRing *cr) {
        log_warning("handoff: the ring of client %" PRIu64 " %s; closing it.", cr->serial,
                    ring_is_broken(cr->ring) ? "has a corrupt completion queue"
                                             : "could not take the answer to a submission (its completion queue "
                                               "and backlog are full: the worker does not take its records)");
        cr->hm->counters.rings_lost++;
        handoff_ring_free(cr);
}

void handoff_ring_answer(ClientRing *cr, const struct epd_ring_record *rec) {
        if (ring_post(cr->ring, rec) < 0 && !cr->lost) {
                cr->lost = true;
                /* The worker learns now (what was posted, then -ECONNRESET); the daemon
                 * side goes at a point where nobody uses it (kick_all()). */
                ring_mark_closed(cr->ring);
        }
        handoff_ring_kick_later(cr);
}

static void release_ring(ClientObject *co) {
        handoff_ring_free(container_of(co, ClientRing, object));
}

static int ring_accept(ClientRing *cr, const struct epd_ring_record *rec) {
        HandoffManager *hm = cr->hm;
        char rid[EPD_ID_STRING_MAX];
        HandoffObject *o = NULL;
        Reason why = {};
        EpdId id;
        memcpy(id.bytes, rec->request_id, sizeof id.bytes);
        epd_id_to_string(&id, rid);
        /* 0: the daemon's HandoffTimeout=, which may be longer than a wait can be. */
        usec_t timeout = rec->arg0 ? rec->arg0 : MIN(hm->manager->config.handoff_timeout_usec, HANDOFF_ACCEPT_WAIT_MAX);
        int r = handoff_manager_accept_wait(hm, cr->object.owner, rid, timeout, NULL, rec->user_data, &o, &why);
        if (r < 0) {
                log_debug("handoff: ring accept of %s for client %" PRIu64 ": %s", rid, cr->serial, why.text);
                return r;
        }
        if (r == HANDOFF_ACCEPT_PENDING)
                return 0;
        struct epd_ring_record out;
        ring_record_handoff_accepted(&out, rec->user_data, o->h->request_id.bytes, o->h->token, o->h->n_done,
                                     o->h->n_groups, o->n_pages, handoff_worker_arena_index(cr->object.owner, o->arena));
        handoff_ring_answer(cr, &out);
        return 0;
}

/* A ring COMMIT's answer, once its records are durable: posted to the ring it came on if
 * the client still has it (looked up again: it may have closed meanwhile, and a ring the
 * client opened since is another, whose user_data may mean something else). */
typedef struct RingCommit {
        HandoffManager *hm;
        uint64_t serial, ring_id, user_data;
        EpdId sequence;
} RingCommit;

static void ring_commit_durable(void *userdata, int error) {
        RingCommit *rc = userdata;
        HandoffManager *hm = rc->hm;
        ClientRing *cr = hashmap_get(hm->rings, &rc->serial);
        if (cr && cr->id == rc->ring_id) {
                struct epd_ring_record out;
                ring_record_completion(&out, rc->user_data, error < 0 ? error : 0);
                if (error >= 0)
                        memcpy(out.request_id, rc->sequence.bytes, sizeof out.request_id);
                handoff_ring_answer(cr, &out);
        }
        free(rc);
}

/* EPD_RING_OP_COMMIT: the destination handoff (request id, token) this client accepted,
 * committed (and released when asked) as Commit / CommitAndRelease do; answered by
 * ring_commit_durable(). <0: answered at once with that error. */
static int ring_commit(ClientRing *cr, const struct epd_ring_record *rec) {
        HandoffManager *hm = cr->hm;
        HandoffObject *o = hashmap_get(hm->destinations, rec->request_id);
        Client *c = cr->object.owner;
        const char *seq;
        Reason why = {};
        if (!o || o->h->token != rec->token)
                return -ENOENT;
        if (!handoff_object_owned_by(o, c))
                return -EPERM;
        /* Before the commit: once it is made, its answer must not be an error. So is
         * the room for its wait for the journal (and for those a release may add: a
         * peer's message, freed pages' settling). */
        RingCommit *rc = calloc(1, sizeof *rc);
        if (!rc)
                return -ENOMEM;
        int r = wal_manager_reserve_waits(hm->manager, 8);
        if (r < 0) {
                free(rc);
                return r;
        }
        r = handoff_manager_commit(o, c, &seq, &why);
        if (r < 0) {
                log_debug("handoff: ring commit of %s for client %" PRIu64 ": %s", o->request_str, cr->serial,
                          why.text);
                free(rc);
                return r;
        }
        *rc = (RingCommit) { .hm = hm, .serial = cr->serial, .ring_id = cr->id, .user_data = rec->user_data };
        const char *id = strrchr(seq, '/');
        if (!id || epd_id_from_string(id + 1, &rc->sequence) < 0) {
                free(rc);
                return -EIO;
        }
        if (rec->arg0 & EPD_RING_COMMIT_RELEASE)
                handoff_manager_release(o); /* o may be gone after this */
        r = wal_manager_after_durable(hm->manager, ring_commit_durable, rc);
        if (r < 0)
                free(rc);
        return r;
}

/* Submissions taken in one turn of the loop. */
#define RING_SUBMIT_BUDGET 4096U

static int on_ring_submit(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        ClientRing *cr = userdata;
        HandoffManager *hm = cr->hm;
        struct epd_ring_record rec, out;
        int r;

        (void)ring_drain_submit(cr->ring);
        for (unsigned budget = 0;; budget++) {
                if (budget == RING_SUBMIT_BUDGET) {
                        /* Other work gets its turn; the rest are taken on the next one. The
                         * wakeup that announced them was read above: without one of our
                         * own they would wait for the worker's next submission. */
                        (void)ring_wake_submit(cr->ring);
                        break;
                }
                if (cr->lost)
                        break; /* nothing more is taken from it: its answers could not come */
                r = ring_consume(cr->ring, &rec);
                if (r == -EAGAIN)
                        break;
                if (r < 0) {
                        log_warning("handoff: client %" PRIu64 " corrupted its ring; closing it.", cr->serial);
                        handoff_ring_free(cr);
                        return 0;
                }
                r = ring_record_validate_submission(&rec);
                if (r >= 0 && rec.opcode == EPD_RING_OP_ACCEPT) {
                        /* Answered by an EPD_RING_EV_HANDOFF_ACCEPTED record, now or
                         * when the handoff arrives (handoff-expect.c), or by a
                         * completion with the error. */
                        r = ring_accept(cr, &rec);
                        if (r >= 0)
                                continue;
                } else if (r >= 0 && rec.opcode == EPD_RING_OP_COMMIT) {
                        /* Answered once durable (ring_commit_durable()), or now with
                         * the error. */
                        r = ring_commit(cr, &rec);
                        if (r >= 0)
                                continue;
                } else if (r >= 0 && rec.opcode == EPD_RING_OP_LAYER_GROUP_READY) {
                        HandoffObject *o = hashmap_get(hm->sources, rec.request_id);
                        if (!o || o->h->token != rec.token || !o->owned ||
                            handoff_client_serial(o->object.owner) != cr->serial)
                                r = -ENOENT;
                        else {
                                r = handoff_obj_group_ready(o, rec.group);
                                if (r > 0)
                                        handoff_pump(o);
                                handoff_after_event(o);
                        }
                }
                if (r < 0 || rec.opcode == EPD_RING_OP_NOP || (rec.flags & EPD_RING_F_ACK)) {
                        ring_record_completion(&out, rec.user_data, r < 0 ? r : 0);
                        handoff_ring_answer(cr, &out);
                }
        }
        (void)ring_kick(cr->ring);
        if (cr->lost || ring_is_broken(cr->ring))
                handoff_ring_lose(cr);
        return 0;
}

int handoff_manager_close_ring(HandoffManager *hm, Client *c, Reason *why) {
        uint64_t serial = handoff_client_serial(c);
        ClientRing *cr = hashmap_get(hm->rings, &serial);
        if (!cr)
                return reason_set(why, -ENOENT, "This client has no ring.");
        handoff_ring_free(cr);
        return 0;
}

int handoff_manager_open_ring(HandoffManager *hm, Client *c, uint32_t sq, uint32_t cq, Ring **ret,
                              Reason *why) {
        uint64_t serial = handoff_client_serial(c);
        if (!epd_ring_entries_valid(sq) || !epd_ring_entries_valid(cq))
                return reason_set(why, -EINVAL,
                                     "Ring sizes are powers of two from %u to %u.", EPD_RING_ENTRIES_MIN,
                                     EPD_RING_ENTRIES_MAX);
        if (hashmap_get(hm->rings, &serial))
                return reason_set(why, -EEXIST, "This client has a ring already.");
        ClientRing *cr = calloc(1, sizeof *cr);
        if (!cr)
                return -ENOMEM;
        cr->hm = hm;
        cr->serial = serial;
        cr->id = ++hm->next_ring_id;
        int r = ring_new(sq, cq, &cr->ring);
        if (r < 0) {
                handoff_ring_free(cr);
                return reason_set(why, r, "Cannot make the ring (its memory and eventfds): %s.", strerror(-r));
        }
        r = sd_event_add_io(hm->manager->event, &cr->source, cr->ring->submit_fd, EPOLLIN, on_ring_submit, cr);
        if (r >= 0)
                r = hashmap_put(hm->rings, &cr->serial, cr);
        if (r >= 0) {
                r = client_object_link(c, &cr->object, CLIENT_OBJECT_RING, release_ring);
                if (r < 0)
                        (void)hashmap_remove(hm->rings, &cr->serial);
        }
        if (r < 0) {
                cr->object.owner = NULL;
                handoff_ring_free(cr);
                if (r == -EDQUOT)
                        return reason_set(why, -EDQUOT, "Too many objects for this client.");
                return r;
        }
        *ret = cr->ring;
        return 0;
}
