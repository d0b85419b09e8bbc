/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The destination side of a handoff: reserving pages (here, or for a source on another
 * host that sent PREPARE), the handoff messages of the peer protocol, validating and
 * counting the writes a peer lands in those pages, and the decode worker's Accept and
 * Commit (which builds the decode sequence and journals it in the commit's record). */
#include "handoff/handoff-internal.h"

/* ---- destination: reserving pages ---- */

/* A KV arena with pages of page_size that `target` (if any) maps. Prefers `prefer`
 * (the source's own arena: its pages are handed over in place, none allocated), then
 * the first that has n_pages free or evictable (the scheduler admits a request that
 * fits one of a decode worker's arenas, not necessarily the first), then the first
 * match (whose pool says NoSpace). Bytes from
 * another host land in host arenas only (the peer transports write into the daemon's
 * mapping); within this host, GPU arenas too (the CUDA transport). */
Arena *handoff_pick_arena(Manager *m, uint64_t page_size, uint32_t n_pages, const Worker *target, Arena *prefer,
                          bool host_only) {
        Arena *first = NULL;

        if (prefer && prefer->pages && page_pool_page_size(prefer->pages) == page_size &&
            (!host_only || prefer->domain == MEMORY_HOST) &&
            (!target || (target->arena_mask & (UINT64_C(1) << prefer->index))))
                return prefer;
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                PagePoolStats st;
                if (a->usage != ARENA_USAGE_KV || !a->pages || page_pool_page_size(a->pages) != page_size)
                        continue;
                if (host_only && a->domain != MEMORY_HOST)
                        continue;
                if (a->domain == MEMORY_GPU && !m->gpu)
                        continue;
                if (target && !(target->arena_mask & (UINT64_C(1) << a->index)))
                        continue;
                page_pool_stats(a->pages, &st);
                if (st.free + st.cached_idle >= n_pages)
                        return a;
                if (!first)
                        first = a;
        }
        return first;
}

/* Allocates, leases and indexes the destination's pages. */
int handoff_dest_reserve(HandoffObject *d, Arena *a, uint32_t n_pages) {
        HandoffManager *hm = d->hm;
        d->arena = a->index;
        d->pool = a->pages;
        d->n_pages = n_pages;
        d->pages = calloc(n_pages, sizeof *d->pages);
        d->page_keys = calloc(n_pages, sizeof *d->page_keys);
        if (!d->pages || !d->page_keys)
                return -ENOMEM;
        int r = page_pool_alloc_many(a->pages, n_pages, d->pages);
        if (r < 0)
                return r;
        for (uint32_t i = 0; i < n_pages; i++) {
                (void)page_lease(a->pages, d->pages[i]);
                d->page_keys[i] = ((uint64_t)a->index << 32) | d->pages[i];
        }
        d->holds_pages = true;
        for (uint32_t i = 0; i < n_pages; i++) {
                r = hashmap_put(hm->dest_pages, &d->page_keys[i], d);
                if (r < 0)
                        return r; /* handoff_obj_free drops what was put */
        }
        return 0;
}

/* ---- destination: remote Prepare ---- */

static void refuse(Peer *p, const HandoffMessage *in, HandoffCause cause, int err) {
        HandoffMessage out = {
                .type = HANDOFF_MSG_PREPARE_REFUSED,
                .request_id = in->request_id,
                .token = in->token,
                .cause = cause,
                .error = err,
        };
        _cleanup_(freep) uint8_t *buf = NULL;
        size_t len;
        if (handoff_message_encode(&out, &buf, &len) >= 0)
                (void)peer_send(p, out.type, buf, len);
}

static void send_prepare_ok(HandoffObject *d) {
        HandoffMessage ok = {
                .type = HANDOFF_MSG_PREPARE_OK,
                .region = d->arena,
                .n_pages = d->n_pages,
                .page_offsets = calloc(d->n_pages, sizeof(uint64_t)),
        };
        if (!ok.page_offsets)
                return;
        for (uint32_t i = 0; i < d->n_pages; i++)
                ok.page_offsets[i] = page_offset(d->pool, d->pages[i]);
        /* The pages may be prefix-cache entries just evicted for room: the source writes
         * into them once told, so it is told once their removals are durable (else a
         * crash could bring an entry back over the handoff's bytes). */
        if (page_manager_pages_settled(d->hm->manager->page_manager, d->pool, d->pages, d->n_pages))
                handoff_send_message(d, &ok);
        else
                handoff_send_message_when_durable(d, &ok);
        free(ok.page_offsets);
}

/* ---- destination pages freed by a record not yet durable ---- */

/* The pages a destination reserved may be ones just freed (a Release, a Truncate, an
 * eviction) whose record is not durable yet (page_manager_pages_settled()): no byte
 * goes into them before it is, or a crash would bring the sequence or the entry back
 * over the handoff's bytes. A local copy's source posts nothing, a pipelined
 * destination parks the writes naming its slot, until then. The wait names its object
 * (cleared if the object goes first: handoff_settle_forget()), never the request's
 * newest attempt, which a retry may have made another one meanwhile. */
typedef struct SettleWait {
        HandoffManager *hm;
        HandoffObject *object; /* NULL once it is freed (handoff_settle_forget()) */
        Peer *peer;     /* destination: whose parked streams resume (peers outlive the WAL) */
        bool in_call;   /* inside wal_manager_after_durable(): its caller acts on the answer */
        bool answered;
        int error;
} SettleWait;

static void settle_done(void *userdata, int error) {
        SettleWait *w = userdata;
        HandoffManager *hm = w->hm;
        if (w->in_call) {
                w->answered = true;
                w->error = error;
                return;
        }
        /* This object, not whatever attempt at its request is newest now: a retry that
         * replaced it in the request map must not leave it unsettled for good (its slot's
         * writes would park until the park's timeout reset the whole peer session). */
        HandoffObject *o = w->object;
        if (o && o->settle == w)
                o->settle = NULL; /* also when stopping: the object is freed after this */
        if (hm->manager->stopping)
                o = NULL;
        Peer *peer = w->peer;
        free(w);
        /* The parked streams resume whatever became of the handoff: its writes are then
         * taken, or refused if it is gone, never left parked until the park times out. */
        if (peer && !hm->manager->stopping)
                peer_manager_resume_incoming(hm->manager->peers, peer);
        if (!o || !o->unsettled)
                return;
        o->unsettled = false;
        if (error < 0) {
                log_warning_errno(error, "handoff %s: the release of its destination pages is not durable (%m): "
                                  "rolled back.", o->request_str);
                (void)handoff_rollback(o->h, HANDOFF_CAUSE_TRANSFER_FAILED, false);
        } else if (o->h->role == HANDOFF_SOURCE)
                handoff_pump(o);
        handoff_after_event(o);
}

int handoff_settle_wait(HandoffObject *o) {
        SettleWait *w = calloc(1, sizeof *w);
        if (!w)
                return -ENOMEM;
        *w = (SettleWait){ .hm = o->hm, .object = o,
                           .peer = o->h->role == HANDOFF_DESTINATION ? o->peer : NULL, .in_call = true };
        o->unsettled = true;
        int r = wal_manager_after_durable(o->hm->manager, settle_done, w);
        if (r >= 0 && !w->answered) {
                w->in_call = false; /* settle_done() acts when the records are durable */
                handoff_settle_forget(o); /* an earlier wait's answer is this one's too */
                o->settle = w;
                o->hm->counters.journal_waits++;
                return 0;
        }
        /* Refused, or answered at once: the caller goes on (0) or fails the Prepare. */
        o->unsettled = false;
        if (r >= 0)
                r = w->error;
        free(w);
        return r;
}

void handoff_settle_forget(HandoffObject *o) {
        if (o->settle)
                o->settle->object = NULL; /* its answer still resumes the peer's streams */
        o->settle = NULL;
}

/* ---- pipelined handoffs: slots (handoff-proto.h) ---- */

/* The last slot a peer announced in a pipelined PREPARE (they come in order on its
 * control connection): a write naming a larger one waits for its PREPARE (at most the
 * transport's park timeout); a write naming a smaller one that no live handoff holds is
 * refused. */
typedef struct PeerSlots {
        uint64_t key;   /* the Peer pointer */
        uint64_t last;
        /* Slots of PREPAREs that could not be read (on_unreadable()): their writes are
         * refused, not parked. Not `last`: a slot read from a message that failed its
         * checks must not fence off the peer's later slots. */
        uint64_t unreadable[8];
        unsigned unreadable_next;
} PeerSlots;

static PeerSlots *peer_slots(HandoffManager *hm, Peer *p, bool create) {
        uint64_t key = (uint64_t)(uintptr_t)p;
        PeerSlots *ps = hashmap_get(hm->peer_slots, &key);
        if (ps || !create)
                return ps;
        ps = calloc(1, sizeof *ps);
        if (!ps)
                return NULL;
        ps->key = key;
        if (hashmap_put(hm->peer_slots, &ps->key, ps) < 0) {
                free(ps);
                return NULL;
        }
        return ps;
}

HandoffObject *handoff_slot_get(HandoffManager *hm, Peer *p, uint64_t slot) {
        SlotKey k = { .peer = p, .slot = slot };
        return hashmap_get(hm->slots, &k);
}

void handoff_slot_forget(HandoffObject *d) {
        if (!d->slot || d->h->role != HANDOFF_DESTINATION)
                return;
        if (handoff_slot_get(d->hm, d->slot_key.peer, d->slot) == d)
                (void)hashmap_remove(d->hm->slots, &d->slot_key);
        d->slot = 0;
}

/* The peer's session ended: its slots start again with the next one. */
void handoff_slots_peer_down(HandoffManager *hm, Peer *p) {
        uint64_t key = (uint64_t)(uintptr_t)p;
        free(hashmap_remove(hm->peer_slots, &key));
        HandoffObject *o;
        size_t it = 0;
        unsigned n = 0;
        HandoffObject **v = calloc(MAX(hashmap_size(hm->slots), (size_t)1), sizeof *v);
        if (!v)
                return;
        while (hashmap_iterate(hm->slots, &it, (void **)&o, NULL))
                if (o->slot_key.peer == p)
                        v[n++] = o;
        for (unsigned i = 0; i < n; i++)
                handoff_slot_forget(v[i]);
        free(v);
}

static void on_remote_prepare(HandoffManager *hm, Peer *p, HandoffMessage *in) {
        Manager *m = hm->manager;
        bool pipelined = in->flags & HANDOFF_PREPARE_F_PIPELINED;
        bool slotted = in->flags & HANDOFF_PREPARE_F_SLOT;
        if (slotted) {
                PeerSlots *ps = peer_slots(hm, p, true);
                if (!ps || in->slot <= ps->last) {
                        refuse(p, in, HANDOFF_CAUSE_PROTOCOL, ps ? -EPROTO : -ENOMEM);
                        return;
                }
                /* From here the slot is announced: its writes are taken (or refused). */
                ps->last = in->slot;
                if (pipelined)
                        peer_manager_resume_incoming(m->peers, p);
        }
        HandoffObject *old = hashmap_get(hm->destinations, in->request_id.bytes);
        if (old && old->peer == p) {
                if (old->h->token == in->token) {
                        if (handoff_is_live(old->h) && !pipelined)
                                send_prepare_ok(old); /* a repeat: same answer */
                        return;
                }
                if (old->h->token > in->token) {
                        refuse(p, in, HANDOFF_CAUSE_REFUSED, -ESTALE);
                        return;
                }
                /* A newer attempt fences the older one off. */
                (void)handoff_rollback(old->h, HANDOFF_CAUSE_REMOTE, true);
                handoff_after_event(old);
        }

        uint64_t *bytes = calloc(in->n_groups, sizeof *bytes);
        HandoffGroupLayout *layouts = calloc(in->n_groups, sizeof *layouts);
        if (!bytes || !layouts) {
                free(bytes);
                free(layouts);
                refuse(p, in, HANDOFF_CAUSE_REFUSED, -ENOMEM);
                return;
        }
        for (uint32_t g = 0; g < in->n_groups; g++) {
                (void)handoff_message_group_layout(in, g, &layouts[g]);
                bytes[g] = handoff_group_layout_bytes(&layouts[g]) * in->n_pages;
        }
        Arena *a = handoff_pick_arena(m, in->page_size, in->n_pages, NULL, NULL, true);
        usec_t timeout = in->timeout_usec ? MIN(in->timeout_usec, m->config.handoff_timeout_usec)
                                          : m->config.handoff_timeout_usec;
        HandoffObject *d = NULL;
        int r = a ? handoff_obj_new(hm, HANDOFF_DESTINATION, &in->request_id, in->token, in->n_groups, bytes, timeout, &d)
                  : -EINVAL;
        free(bytes);
        if (r >= 0) {
                d->layouts = layouts;
                layouts = NULL;
                d->peer = p;
                snprintf(d->peer_host, sizeof d->peer_host, "%s", peer_host_id(p));
                d->page_size = in->page_size;
                d->target_worker = in->target_worker;
                d->imm = in->flags & HANDOFF_PREPARE_F_IMM;
                r = handoff_dest_reserve(d, a, in->n_pages);
                if (r >= 0 && slotted) {
                        d->slot_key = (SlotKey){ .peer = p, .slot = in->slot };
                        r = hashmap_put(hm->slots, &d->slot_key, d);
                        if (r >= 0)
                                d->slot = in->slot;
                }
                if (r >= 0)
                        r = handoff_journal_prepared(d); /* before PREPARE_OK acknowledges it */
                if (r < 0) {
                        handoff_obj_free(d);
                        d = NULL;
                }
        }
        free(layouts);
        if (r < 0) {
                HandoffCause cause = r == -ENOSPC ? HANDOFF_CAUSE_NO_SPACE : HANDOFF_CAUSE_REFUSED;
                hm->counters.refused++;
                handoff_count_failure(hm, cause);
                log_info("handoff %s from %s: refused: %s", epd_id_to_string(&in->request_id, (char[EPD_ID_STRING_MAX]) {}),
                         peer_host_id(p), a ? strerror(-r) : "no host KV arena with this page size");
                refuse(p, in, cause, r == -ENOSPC ? -ENOSPC : (r < 0 ? r : -EINVAL));
                return;
        }
        hm->counters.prepared++;
        d->sched_taken = (uint32_t)manager_pages_taken(m, d->request_str, a, d->n_pages);
        if (!pipelined)
                send_prepare_ok(d);
        else if (!page_manager_pages_settled(m->page_manager, d->pool, d->pages, d->n_pages) &&
                 handoff_settle_wait(d) < 0) {
                (void)handoff_rollback(d->h, HANDOFF_CAUSE_REFUSED, false);
                handoff_after_event(d);
                return;
        }
        handoff_expect_arrived(d);
}

static HandoffObject *find_for_message(HandoffManager *hm, Peer *p, HandoffRole role, const HandoffMessage *in) {
        HandoffObject *o = hashmap_get(handoff_request_map(hm, role), in->request_id.bytes);
        if (!o || o->peer != p || o->h->token != in->token)
                return NULL; /* unknown, another peer's, or an older attempt: fenced off */
        return o;
}

/* A message this side cannot read (a newer peer's flag, a malformed one): its handoff is
 * answered at once, as a protocol failure, rather than left to wait for the Prepare
 * answer bound or, for a pipelined one, to park the peer's data streams until the
 * session is reset under every other handoff. A PREPARE is refused (and its slot is
 * remembered, so that its writes are refused, not parked); the handoff another message
 * names is rolled back, and the peer told. A message too short to name a handoff, or of
 * a type this version does not know, can only be dropped: said, not at debug level. */
static void on_unreadable(HandoffManager *hm, Peer *p, uint16_t type, const void *payload, size_t len, int error) {
        const char *what = strna(handoff_message_type_to_string(type));
        char rid[EPD_ID_STRING_MAX];
        HandoffMessage head;
        HandoffObject *o;

        if (error == -EOPNOTSUPP) { /* a type this version does not know: ignored, as
                                     * frames of a range nobody handles are */
                log_warning("handoff: a message of type 0x%04x from %s is not known to this version, ignored.", type,
                            peer_host_id(p));
                return;
        }
        if (handoff_message_decode_head(type, payload, len, &head) < 0) {
                log_warning_errno(error, "handoff: a %s message (0x%04x, %zu bytes) from %s cannot be read and names "
                                         "no handoff, dropped: %m", what, type, len, peer_host_id(p));
                return;
        }
        log_warning_errno(error, "handoff %s from %s: its %s message cannot be read (%m); %s.",
                          epd_id_to_string(&head.request_id, rid), peer_host_id(p), what,
                          type == HANDOFF_MSG_PREPARE ? "refused" : "rolled back");
        switch (type) {
        case HANDOFF_MSG_PREPARE: {
                if ((head.flags & HANDOFF_PREPARE_F_SLOT) && head.slot) {
                        PeerSlots *ps = peer_slots(hm, p, true);
                        if (ps && head.slot > ps->last) {
                                ps->unreadable[ps->unreadable_next++ % ELEMENTSOF(ps->unreadable)] = head.slot;
                                peer_manager_resume_incoming(hm->manager->peers, p);
                        }
                }
                HandoffCause cause = error == -ENOMEM ? HANDOFF_CAUSE_REFUSED : HANDOFF_CAUSE_PROTOCOL;
                hm->counters.refused++;
                handoff_count_failure(hm, cause);
                refuse(p, &head, cause, error == -ENOMEM ? -ENOMEM : -EPROTO);
                return;
        }
        case HANDOFF_MSG_GROUP_SENT:
                o = find_for_message(hm, p, HANDOFF_DESTINATION, &head);
                break;
        case HANDOFF_MSG_ROLLBACK:
                o = find_for_message(hm, p, HANDOFF_SOURCE, &head);
                if (!o)
                        o = find_for_message(hm, p, HANDOFF_DESTINATION, &head);
                break;
        default: /* PREPARE_OK, PREPARE_REFUSED, COMMIT: answers to a source */
                o = find_for_message(hm, p, HANDOFF_SOURCE, &head);
                break;
        }
        if (!o)
                return;
        (void)handoff_rollback(o->h, HANDOFF_CAUSE_PROTOCOL, false);
        handoff_after_event(o);
}

/* The peer callbacks get the Manager, not the HandoffManager: at shutdown this subsystem
 * stops before the peer manager does, which may still call them. */
int handoff_on_peer_message(Peer *p, uint16_t type, const void *payload, size_t len, void *userdata) {
        HandoffManager *hm = ((Manager *)userdata)->handoffs;
        HandoffMessage in;
        HandoffObject *o;
        if (!hm)
                return 0;
        int r = handoff_message_decode(type, payload, len, &in);
        if (r < 0) {
                on_unreadable(hm, p, type, payload, len, r);
                return 0;
        }

        switch (type) {
        case HANDOFF_MSG_PREPARE:
                on_remote_prepare(hm, p, &in);
                break;

        case HANDOFF_MSG_PREPARE_OK:
                o = find_for_message(hm, p, HANDOFF_SOURCE, &in);
                if (!o || o->h->state != HANDOFF_PREPARING)
                        break;
                if (in.n_pages != o->n_pages) {
                        (void)handoff_rollback(o->h, HANDOFF_CAUSE_PROTOCOL, false);
                        handoff_after_event(o);
                        break;
                }
                o->dst_region = in.region;
                if (!o->slot) /* else its writes go to the slot: offsets in it */
                        o->dst_offsets = TAKE_PTR(in.page_offsets);
                (void)handoff_prepared(o->h);
                handoff_pump(o);
                handoff_after_event(o);
                break;

        case HANDOFF_MSG_PREPARE_REFUSED:
                o = find_for_message(hm, p, HANDOFF_SOURCE, &in);
                if (!o)
                        break;
                o->refused_error = in.error;
                (void)handoff_rollback(o->h, in.cause, true);
                handoff_after_event(o);
                break;

        case HANDOFF_MSG_GROUP_SENT:
                o = find_for_message(hm, p, HANDOFF_DESTINATION, &in);
                if (!o)
                        break;
                if (in.group >= o->h->n_groups || handoff_group_sent_notice(o->h, in.group, in.bytes) == -EINVAL)
                        (void)handoff_rollback(o->h, HANDOFF_CAUSE_PROTOCOL, false);
                handoff_after_event(o);
                break;

        case HANDOFF_MSG_COMMIT:
                o = find_for_message(hm, p, HANDOFF_SOURCE, &in);
                if (o && o->imm && o->h->state == HANDOFF_TRANSFERRING) {
                        /* Completions in-band: the destination had every group from the
                         * data, and its WRITE_ACKS came before this COMMIT on the control
                         * connection; their completions may still wait on the transport's
                         * eventfd. Take them first, so the writes are done here too. */
                        (void)handoff_on_peer_completion(NULL, -1, 0, hm);
                        o = find_for_message(hm, p, HANDOFF_SOURCE, &in);
                }
                if (!o)
                        break;
                /* Still TRANSFERRING: more completions waited than one turn takes
                 * (HANDOFF_TURN_COMPLETIONS_MAX, every handoff's together); the rest come
                 * at the next turns, and the COMMIT applies then (handoff_after_event()),
                 * not dropped: the source would wait for it until its timeout, pages held,
                 * and report a committed handoff rolled back. */
                r = handoff_commit(o->h, 0);
                if (r == -EBUSY && o->h->state == HANDOFF_TRANSFERRING)
                        o->commit_received = true;
                else if (r == 1 && handoff_counts(o))
                        hm->counters.committed++;
                handoff_after_event(o);
                break;

        case HANDOFF_MSG_ROLLBACK:
                o = find_for_message(hm, p, HANDOFF_SOURCE, &in);
                if (!o)
                        o = find_for_message(hm, p, HANDOFF_DESTINATION, &in);
                if (!o)
                        break;
                (void)handoff_rollback(o->h, in.cause, true);
                handoff_after_event(o);
                break;
        }
        handoff_message_done(&in);
        return 0;
}

void handoff_on_peer_state(Peer *p, bool up, void *userdata) {
        HandoffManager *hm = ((Manager *)userdata)->handoffs;
        if (up || !hm)
                return;
        /* Everything in flight with this peer rolls back, on this side now; the other
         * side does the same when it notices (heartbeats), within the same bound. */
        size_t n = 0, it = 0, cap = hashmap_size(hm->by_handle);
        HandoffObject *o, **v = calloc(MAX(cap, (size_t)1), sizeof *v);
        if (!v)
                return;
        while (hashmap_iterate(hm->by_handle, &it, (void **)&o, NULL))
                if (o->peer == p && n < cap)
                        v[n++] = o;
        for (size_t i = 0; i < n; i++) {
                v[i]->peer = NULL; /* nothing more to send it */
                if (handoff_rollback(v[i]->h, HANDOFF_CAUSE_PEER_DOWN, true) > 0)
                        log_info("handoff %s: peer %s went down", v[i]->request_str, v[i]->peer_host);
        }
        /* Keep the peer pointers of incoming writes: their done calls still come. */
        for (size_t i = 0; i < n; i++)
                handoff_after_event(v[i]);
        free(v);
        handoff_slots_peer_down(hm, p);
}

/* A pipelined write (TRANSPORT_WRITE_TARGET): the slot's handoff, the page and the
 * offset in it; resolved into the arena region and offset. */
static int resolve_slot(HandoffManager *hm, Peer *p, TransportIncoming *in, HandoffObject **ret) {
        HandoffObject *d = handoff_slot_get(hm, p, in->target);
        if (!d) {
                PeerSlots *ps = peer_slots(hm, p, false);
                /* Its PREPARE is still on its way on the control connection (or none of
                 * this session came yet: the source numbers its slots across sessions
                 * and peers, so they need not be near the last one): wait, as long as
                 * the parked stream's timer allows. A slot announced already and gone
                 * (refused, rolled back): refused. */
                if (ps && in->target > ps->last)
                        for (size_t i = 0; i < ELEMENTSOF(ps->unreadable); i++)
                                if (ps->unreadable[i] == in->target)
                                        return -ESTALE; /* its PREPARE came, unreadable */
                if (!ps || in->target > ps->last)
                        return -EAGAIN;
                return -ESTALE;
        }
        if (d->unsettled)
                return -EAGAIN; /* its pages' freeing record is being made durable */
        uint64_t page = in->offset >> 32, in_page = in->offset & UINT32_MAX, end;
        if (page >= d->n_pages || ADD_OVERFLOW(in_page, in->length, &end) || end > d->page_size)
                return -ERANGE;
        in->region = d->arena;
        in->offset = page_offset(d->pool, d->pages[page]) + in_page;
        *ret = d;
        return 0;
}

int handoff_on_incoming_validate(Peer *p, TransportIncoming *in, void *userdata) {
        Manager *m = userdata;
        HandoffManager *hm = m->handoffs;
        HandoffObject *d = NULL;
        int r;
        if (!hm)
                return -ESHUTDOWN;
        if (in->flags & TRANSPORT_WRITE_TARGET) {
                r = resolve_slot(hm, p, in, &d);
                if (r < 0)
                        return r;
        }
        uint32_t region = in->region;
        uint64_t offset = in->offset, length = in->length, cookie = in->cookie;
        if (region >= m->n_arenas || !m->arenas[region]->pages)
                return -ENOENT;
        Arena *a = m->arenas[region];
        uint64_t ps = page_pool_page_size(a->pages);
        if (offset < a->data_offset)
                return -ERANGE;
        uint64_t page = (offset - a->data_offset) / ps;
        uint64_t key = ((uint64_t)region << 32) | page;
        HandoffObject *owner = page < UINT32_MAX ? hashmap_get(hm->dest_pages, &key) : NULL;
        uint32_t g = (uint32_t)(cookie & ((1U << COOKIE_GROUP_BITS) - 1));
        if (!owner || owner->peer != p || (d && owner != d))
                return -EACCES;
        /* A write that names its attempt (rdma: real offsets) lands only in that
         * attempt's pages: a late REQUEST of an attempt rolled back here, whose pages the
         * same peer's next handoff got, is refused, not counted into the next one's. */
        if ((in->flags & TRANSPORT_WRITE_ATTEMPT) && owner->h->token != in->target)
                return -ESTALE;
        d = owner;
        if ((in->flags & TRANSPORT_WRITE_IMM) && (!d->imm || HANDOFF_IMM_GROUP(in->imm) != g))
                return -EPROTO;
        if (!handoff_may_land(d->h, g))
                return -ESTALE;
        /* Inside group g's bytes of every page it touches: a group that covers whole
         * pages is planned as one write over adjacent pages, each of which must be
         * this handoff's. */
        uint64_t pos = offset, left = length;
        if (length == 0)
                return -ERANGE;
        while (left > 0) {
                if (pos != offset) {
                        page = (pos - a->data_offset) / ps;
                        key = ((uint64_t)region << 32) | page;
                        if (page >= UINT32_MAX || hashmap_get(hm->dest_pages, &key) != d)
                                return -EACCES;
                }
                uint64_t in_page = pos - page_offset(d->pool, (PageId)page);
                uint64_t chunk = MIN(left, ps - in_page), end = in_page + chunk;
                bool inside = false;
                for (uint32_t i = 0; i < d->layouts[g].n_ranges; i++) {
                        const HandoffRange *rg = &d->layouts[g].ranges[i];
                        if (in_page >= rg->offset && end <= rg->offset + rg->length)
                                inside = true;
                }
                if (!inside)
                        return -ERANGE;
                pos += chunk;
                left -= chunk;
        }
        InWrite *w = calloc(1, sizeof *w);
        if (!w)
                return -ENOMEM;
        *w = (InWrite) { .key = { .peer = p, .cookie = cookie }, .obj = d, .group = g, .length = length };
        r = hashmap_put(hm->incoming, &w->key, w);
        if (r < 0) {
                free(w);
                return r; /* -EEXIST: a cookie in flight twice */
        }
        (void)handoff_write_landing(d->h, g);
        return 0;
}

void handoff_on_incoming_done(Peer *p, const TransportIncoming *in, int error, void *userdata) {
        HandoffManager *hm = ((Manager *)userdata)->handoffs;
        if (!hm)
                return;
        InKey key = { .peer = p, .cookie = in->cookie };
        InWrite *w = hashmap_remove(hm->incoming, &key);
        if (!w)
                return;
        HandoffObject *d = w->obj;
        uint64_t bytes = error < 0 ? 0 : w->length;
        (void)handoff_write_landed(d->h, w->group, bytes, error);
        d->bytes_moved += bytes;
        hm->counters.bytes += bytes;
        /* The group's last write says the group is complete (the source's GROUP_SENT,
         * in-band): it is RECEIVED once every byte of it has landed. */
        if (error == 0 && (in->flags & TRANSPORT_WRITE_IMM) &&
            handoff_group_sent_notice(d->h, HANDOFF_IMM_GROUP(in->imm), HANDOFF_IMM_BYTES(in->imm)) == -EINVAL)
                (void)handoff_rollback(d->h, HANDOFF_CAUSE_PROTOCOL, false);
        free(w);
        handoff_after_event(d);
}

/* ---- decode side: Accept, Commit ---- */

int handoff_manager_accept(HandoffManager *hm, Client *c, const char *request_id, HandoffObject **ret,
                           Reason *why) {
        EpdId rid;
        int r = handoff_parse_request_id(request_id, &rid, why);
        if (r < 0)
                return r;
        HandoffObject *d = hashmap_get(hm->destinations, rid.bytes);
        if (!d) {
                r = handoff_ending_refuse(hm, &rid, request_id, why);
                return r < 0 ? r : reason_set(why, -ENOENT, "No handoff for request %s here.", request_id);
        }
        return handoff_dest_accept(hm, c, d, ret, why);
}

int handoff_dest_accept(HandoffManager *hm, Client *c, HandoffObject *d, HandoffObject **ret, Reason *why) {
        Manager *m = hm->manager;
        const char *request_id = d->request_str;
        Worker *w = client_get_worker(c);
        if (!w)
                return reason_set(why, -ENOTCONN, "Register as a worker first.");
        if (!epd_id_is_null(&d->target_worker) && !epd_id_equal(&d->target_worker, &w->id))
                return reason_set(why, -EPERM, "Handoff %s is meant for another worker.",
                                     request_id);
        if (!(w->arena_mask & (UINT64_C(1) << d->arena)))
                return reason_set(why, -EPERM,
                                     "Handoff %s lands in arena '%s', which worker %s did not map.", request_id,
                                     m->arenas[d->arena]->name, w->id_str);
        int r = handoff_accept(d->h, handoff_client_serial(c));
        if (r == -ESTALE)
                return reason_set(why, -ESTALE, "Handoff %s was rolled back (%s).", request_id,
                                     handoff_cause_to_string(d->h->cause));
        if (r == -EPERM)
                return reason_set(why, -EBUSY, "Handoff %s was accepted by another client.", request_id);
        if (r < 0)
                return r;
        if (r > 0) {
                r = handoff_obj_link(d, c);
                if (r < 0) {
                        d->h->accepted_by = 0;
                        return reason_set(why, -EDQUOT, "Too many objects for this client.");
                }
                w->stats.handoffs_in++;
        }
        *ret = d;
        return 0;
}

int handoff_manager_commit(HandoffObject *o, Client *c, const char **ret_sequence, Reason *why) {
        HandoffManager *hm = o->hm;
        Manager *m = hm->manager;
        Handoff *h = o->h;

        if (h->role != HANDOFF_DESTINATION)
                return reason_set(why, -EINVAL,
                                     "Commit is the decode side's: the source commits when the destination does.");
        if (h->state == HANDOFF_COMMITTED && h->accepted_by == handoff_client_serial(c)) {
                *ret_sequence = o->sequence_path ? o->sequence_path : "/";
                return 0;
        }
        /* Past the deadline a commit is refused even before the timer has run: the
         * source rolls back on its own soon after, and the two must agree. */
        if (handoff_check_timeout(h, now_usec(CLOCK_MONOTONIC)) > 0) {
                log_info("handoff %s: Commit after the deadline: rolled back (timeout)", o->request_str);
                handoff_after_event(o);
        }
        if (handoff_is_ended(h))
                return reason_set(why, -ESTALE, "Handoff %s was rolled back (%s).", o->request_str,
                                     handoff_cause_to_string(h->cause));
        if (h->state != HANDOFF_TRANSFERRED)
                return reason_set(why, -EBUSY, "Handoff %s: %" PRIu32 " of %" PRIu32 " layer groups arrived.",
                                     o->request_str, h->n_done, h->n_groups);

        /* Its journal entry is where the commit's record goes: without one (a newer
         * attempt of the request took it) the commit would be acknowledged unjournaled,
         * and a crash would lose the decode sequence. Newer attempts roll older ones back
         * (handoff_obj_new()), so this is a last guard. */
        if (!handoff_journal_entry_of(o) && !m->stopping)
                return reason_set(why, -ESTALE, "Handoff %s: a newer attempt of the request holds its journal entry.",
                                  o->request_str);
        /* Build the decode sequence first: if it fails, nothing changed. Its record
         * goes into the commit's, so that the WAL has both or neither. */
        Sequence *s;
        int r = sequence_new_from_pages(o->pool, o->pages, o->n_pages, &s);
        if (r < 0)
                return r;
        m->page_manager->journal_held = true;
        r = page_manager_register(m->page_manager, s, c, m->arenas[o->arena]);
        m->page_manager->journal_held = false;
        if (r < 0) {
                sequence_free(s);
                return reason_set(why, -EDQUOT, "Cannot register the decode sequence: %s",
                                     strerror(-r));
        }
        _cleanup_(freep) void *put = NULL;
        size_t put_len = 0;
        HandoffRecord rec = handoff_record_of(o, HANDOFF_REC_COMMITTED);
        /* Within this host the source commits with it, in the same record: a crash leaves
         * both sides committed or neither. */
        if (o->twin && handoff_journal_entry_of(o->twin))
                rec.value = HANDOFF_REC_COMMIT_PAIR;
        r = page_manager_sequence_record(s, &put, &put_len);
        if (r >= 0) {
                rec.extra = put;
                rec.extra_len = put_len;
                r = handoff_journal_append(hm, &rec, NULL);
        }
        if (r < 0) {
                log_warning_errno(r, "handoff %s: cannot journal the commit: %m", o->request_str);
                page_manager_release(s);
                return r;
        }
        r = handoff_commit(h, handoff_client_serial(c));
        if (r < 0) { /* cannot happen after the checks above */
                page_manager_release(s);
                return r;
        }
        free(o->sequence_path);
        o->sequence_path = strdup(s->path);
        if (handoff_counts(o))
                hm->counters.committed++;
        /* The sequence holds the pages now. */
        if (h->inflight == 0)
                handoff_obj_drop_pages(o);
        if (o->twin) {
                HandoffObject *t = o->twin;
                if (handoff_commit(t->h, 0) > 0 && handoff_counts(t))
                        hm->counters.committed++;
                handoff_after_event(t);
        } else {
                /* Told once this commit's record is durable: a source told before drops
                 * (or releases) its pages while a crash here could still roll the commit
                 * back, and the KV would be lost on both sides. */
                HandoffMessage msg = { .type = HANDOFF_MSG_COMMIT };
                handoff_send_message_when_durable(o, &msg);
        }
        *ret_sequence = o->sequence_path ? o->sequence_path : s->path;
        handoff_after_event(o);
        return 0;
}
