/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* A decode worker waiting for the handoff of its request to arrive here, without
 * polling: org.epd1.Handoffs.AcceptWait (a D-Bus call answered once the destination
 * side exists, or at its deadline) and the ring's EPD_RING_OP_ACCEPT (answered with an
 * EPD_RING_EV_HANDOFF_ACCEPTED record). Either accepts for its client the moment the
 * destination is prepared here (handoff_expect_arrived), so that the worker owns it, and
 * hears of its progress on its ring, before the first byte lands. Each waiter is a
 * ClientObject of its client (counted against MaxObjectsPerClient, released on
 * disconnect) with a timer.
 *
 * A destination that rolls back before anyone accepted it (its deadline passed while
 * the decode was busy, the source went away) leaves an ending behind: an Accept or
 * AcceptWait for its request then hears Stale and why at once, where it would hear
 * NotFound or wait out its whole deadline for a handoff that is not coming. A newer
 * attempt for the request (the source trying again) clears it. The last
 * HANDOFF_ENDINGS_MAX endings are kept, in memory only. */
#include "handoff/handoff-internal.h"

/* A slot of hm->endings is in use while ending_map maps its request id to it. */
struct HandoffEnding {
        EpdId request_id;
        HandoffCause cause;
        usec_t at;
};

void handoff_ending_remember(HandoffObject *d) {
        HandoffManager *hm = d->hm;
        if (!hm->ending_map) {
                hm->ending_map = hashmap_new(HASHMAP_KEY_BYTES, sizeof(EpdId));
                hm->endings = calloc(HANDOFF_ENDINGS_MAX, sizeof *hm->endings);
                if (!hm->ending_map || !hm->endings) {
                        hm->ending_map = hashmap_free(hm->ending_map);
                        free(hm->endings);
                        hm->endings = NULL;
                        return; /* only a diagnosis lost: Accept answers NotFound */
                }
        }
        handoff_ending_forget(hm, &d->h->request_id);
        HandoffEnding *e = &hm->endings[hm->endings_next];
        if (hashmap_get(hm->ending_map, e->request_id.bytes) == e)
                (void)hashmap_remove(hm->ending_map, e->request_id.bytes); /* the oldest goes */
        *e = (HandoffEnding){ .request_id = d->h->request_id, .cause = d->h->cause,
                              .at = now_usec(CLOCK_MONOTONIC) };
        if (hashmap_put(hm->ending_map, e->request_id.bytes, e) < 0)
                return;
        hm->endings_next = (hm->endings_next + 1) % HANDOFF_ENDINGS_MAX;
}

void handoff_ending_forget(HandoffManager *hm, const EpdId *request_id) {
        if (hm->ending_map)
                (void)hashmap_remove(hm->ending_map, request_id->bytes);
}

int handoff_ending_refuse(HandoffManager *hm, const EpdId *request_id, const char *request_str, Reason *why) {
        const HandoffEnding *e = hm->ending_map ? hashmap_get(hm->ending_map, request_id->bytes) : NULL;
        if (!e)
                return 0;
        usec_t now = now_usec(CLOCK_MONOTONIC), ago = now > e->at ? now - e->at : 0;
        return reason_set(why, -ESTALE,
                          "The handoff for request %s was rolled back here %" PRIu64 ".%03" PRIu64
                          " s ago (%s), before anyone accepted it.",
                          request_str, ago / USEC_PER_SEC, ago % USEC_PER_SEC / USEC_PER_MSEC,
                          handoff_cause_to_string(e->cause));
}

void handoff_endings_free(HandoffManager *hm) {
        hm->ending_map = hashmap_free(hm->ending_map);
        free(hm->endings);
        hm->endings = NULL;
}

/* One waiter, in its request's list (hm->expects: request id -> first waiter). */
typedef struct Expect Expect;
struct Expect {
        ClientObject object;
        HandoffManager *hm;
        EpdId request_id;
        char request_str[EPD_ID_STRING_MAX];
        uint64_t client_serial;
        uint64_t ring_id;          /* the ring it came on (ClientRing.id), not a later one */
        HandoffAcceptWaiter *bus;  /* AcceptWait; NULL: the client's ring */
        uint64_t user_data;        /* ring: echoed in the answer */
        usec_t timeout;
        sd_event_source *timer;
        LIST_FIELDS(Expect, by_request);
};

static void expect_unlink(Expect *e) {
        HandoffManager *hm = e->hm;
        Expect *head = hashmap_get(hm->expects, e->request_id.bytes), *h = head;
        LIST_REMOVE(by_request, h, e);
        if (h != head) {
                if (h)
                        (void)hashmap_replace(hm->expects, h->request_id.bytes, h, NULL);
                else
                        (void)hashmap_remove(hm->expects, e->request_id.bytes);
        }
}

static void expect_free(Expect *e) {
        if (!e)
                return;
        expect_unlink(e);
        if (e->object.owner)
                client_object_unlink(&e->object);
        sd_event_source_disable_unref(e->timer);
        free(e);
}

static ClientRing *expect_ring(Expect *e) {
        ClientRing *cr = hashmap_get(e->hm->rings, &e->client_serial);
        return cr && cr->id == e->ring_id ? cr : NULL;
}

/* Answers the waiter (o accepted, or error with why) and frees it. */
static void expect_answer(Expect *e, HandoffObject *o, int error, const char *why) {
        HandoffAcceptWaiter *w = e->bus;
        ClientRing *cr = w ? NULL : expect_ring(e);
        uint64_t user_data = e->user_data;
        expect_free(e);
        if (w) {
                w->done(w, o, error, why);
                return;
        }
        if (!cr)
                return; /* the ring went away meanwhile: nobody to tell */
        struct epd_ring_record rec;
        if (error < 0)
                ring_record_completion(&rec, user_data, error);
        else
                ring_record_handoff_accepted(&rec, user_data, o->h->request_id.bytes, o->h->token, o->h->n_done,
                                             o->h->n_groups, o->n_pages,
                                             handoff_worker_arena_index(cr->object.owner, o->arena));
        handoff_ring_answer(cr, &rec);
}

static void release_expect(ClientObject *co) {
        Expect *e = container_of(co, Expect, object);
        expect_answer(e, NULL, -ECONNRESET, "The client is gone.");
}

static int on_expect_timeout(sd_event_source *s, uint64_t usec, void *userdata) {
        Expect *e = userdata;
        Reason why;
        (void)reason_set(&why, -ETIMEDOUT, "No handoff for request %s arrived here within %" PRIu64 " us.",
                         e->request_str, (uint64_t)e->timeout);
        expect_answer(e, NULL, -ETIMEDOUT, why.text);
        return 0;
}

void handoff_expect_arrived(HandoffObject *d) {
        HandoffManager *hm = d->hm;
        /* Each waiter of the request in turn: the first accepts, the others hear why not
         * (Busy: accepted by another client). Answering may run a bus reply, never a
         * callback into this list: take the head anew each time. */
        Expect *e;
        while (hm->expects && (e = hashmap_get(hm->expects, d->h->request_id.bytes))) {
                Reason why = {};
                HandoffObject *o;
                /* The waiter is one of its client's objects: the client is there. Its
                 * room goes to the handoff it accepts (counted against
                 * MaxObjectsPerClient as the waiter was): with the waiter still counted,
                 * a client at its limit would hear Quota for a handoff it can own. */
                Client *c = e->object.owner;
                client_object_unlink(&e->object);
                int r = handoff_dest_accept(hm, c, d, &o, &why);
                if (r < 0)
                        expect_answer(e, NULL, r, why.text);
                else
                        expect_answer(e, d, 0, NULL);
        }
}

void handoff_expect_ended(HandoffObject *d) {
        HandoffManager *hm = d->hm;
        char rid[EPD_ID_STRING_MAX];
        Expect *e;
        epd_id_to_string(&d->h->request_id, rid);
        while (hm->expects && (e = hashmap_get(hm->expects, d->h->request_id.bytes))) {
                Reason why = {};
                if (handoff_ending_refuse(hm, &d->h->request_id, rid, &why) >= 0) /* no ending kept (memory) */
                        (void)reason_set(&why, -ESTALE, "The handoff for request %s was rolled back here (%s), "
                                         "before anyone accepted it.", rid, handoff_cause_to_string(d->h->cause));
                expect_answer(e, NULL, -ESTALE, why.text);
        }
}

int handoff_manager_accept_wait(HandoffManager *hm, Client *c, const char *request_id, usec_t timeout,
                                HandoffAcceptWaiter *waiter, uint64_t user_data, HandoffObject **ret,
                                Reason *why) {
        Manager *m = hm->manager;
        EpdId rid;
        int r = handoff_parse_request_id(request_id, &rid, why);
        if (r < 0)
                return r;
        if (timeout > HANDOFF_ACCEPT_WAIT_MAX)
                return reason_set(why, -EINVAL, "A wait of at most %" PRIu64 " us.", (uint64_t)HANDOFF_ACCEPT_WAIT_MAX);
        if (!client_get_worker(c))
                return reason_set(why, -ENOTCONN, "Register as a worker first.");
        /* Here already, or rolled back here unaccepted, or not worth waiting for: as
         * Accept. */
        if (timeout == 0 || hashmap_get(hm->destinations, rid.bytes) ||
            (hm->ending_map && hashmap_get(hm->ending_map, rid.bytes)))
                return handoff_manager_accept(hm, c, request_id, ret, why);

        Expect *e = calloc(1, sizeof *e);
        if (!e)
                return -ENOMEM;
        *e = (Expect){
                .hm = hm,
                .request_id = rid,
                .client_serial = handoff_client_serial(c),
                .bus = waiter,
                .user_data = user_data,
                .timeout = timeout,
        };
        epd_id_to_string(&rid, e->request_str);
        if (!waiter) {
                ClientRing *cr = hashmap_get(hm->rings, &e->client_serial);
                e->ring_id = cr ? cr->id : 0;
        }
        /* Within a hundredth of the wait, at most 1 ms (accuracy 0 would be sd-event's
         * 250 ms: a 2 ms wait answered a quarter of a second late, and a handoff arriving
         * meanwhile accepted after the wait asked for was over). */
        r = sd_event_add_time_relative(m->event, &e->timer, CLOCK_MONOTONIC, timeout,
                                       CLAMP(timeout / 100, (usec_t)1, USEC_PER_MSEC), on_expect_timeout, e);
        if (r < 0) {
                free(e);
                return r;
        }
        r = client_object_link(c, &e->object, CLIENT_OBJECT_OTHER, release_expect);
        if (r < 0) {
                sd_event_source_disable_unref(e->timer);
                free(e);
                return r == -EDQUOT ? reason_set(why, -EDQUOT, "Too many objects for this client.") : r;
        }
        Expect *head = hashmap_get(hm->expects, rid.bytes);
        /* Waiters of a request are answered in the order they came: append. */
        if (!head)
                r = hashmap_put(hm->expects, e->request_id.bytes, e);
        else {
                Expect *t = head;
                while (t->by_request_next)
                        t = t->by_request_next;
                t->by_request_next = e;
                e->by_request_prev = t;
        }
        if (r < 0) {
                client_object_unlink(&e->object);
                sd_event_source_disable_unref(e->timer);
                free(e);
                return r;
        }
        return HANDOFF_ACCEPT_PENDING;
}

void handoff_expect_drop_ring(HandoffManager *hm, uint64_t client_serial) {
        /* The client closed its ring: its ring ACCEPTs still waiting would otherwise
         * accept a handoff for it that nobody hears of (or answer a later ring with this
         * one's user_data). Its bus AcceptWaits stay. Collected first: freeing edits the
         * map being walked. */
        size_t n = 0, cap = 0, it = 0;
        Expect **drop = NULL, *head;
        while (hm->expects && hashmap_iterate(hm->expects, &it, (void **)&head, NULL))
                for (Expect *e = head; e; e = e->by_request_next) {
                        if (e->bus || e->client_serial != client_serial)
                                continue;
                        if (n == cap) {
                                size_t c = cap ? 2 * cap : 16;
                                Expect **d = reallocarray(drop, c, sizeof *d);
                                if (!d)
                                        goto done; /* what is collected goes; the rest times out */
                                drop = d;
                                cap = c;
                        }
                        drop[n++] = e;
                }
done:
        for (size_t i = 0; i < n; i++)
                expect_free(drop[i]);
        free(drop);
}

void handoff_expect_done(HandoffManager *hm) {
        Expect *e;
        size_t it;
        while ((it = 0, hm->expects && hashmap_iterate(hm->expects, &it, (void **)&e, NULL)))
                expect_answer(e, NULL, -ESHUTDOWN, "The daemon is stopping.");
}
