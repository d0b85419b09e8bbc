/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The handoff window per peer (docs/telemetry.md): handoffs and bytes in flight to a
 * host, bounded by its backpressure level, and the telemetry subscription that posts
 * level changes to every worker's ring. The sources that wait to post writes to other
 * hosts: for room in the transport's writes in flight, or for the loop's next turn. */
#include "handoff/handoff-internal.h"

/* ---- the backpressure window per peer ---- */

PeerWindow *handoff_window_get(HandoffManager *hm, Peer *peer, bool create) {
        const char *host = peer_host_id(peer);
        PeerWindow *w = hashmap_get(hm->windows, host);
        if (w || !create)
                return w;
        w = calloc(1, sizeof *w);
        if (!w)
                return NULL;
        snprintf(w->host, sizeof w->host, "%s", host);
        if (hashmap_put(hm->windows, w->host, w) < 0) {
                free(w);
                return NULL;
        }
        return w;
}

void handoff_window_publish(HandoffManager *hm, PeerWindow *w) {
        /* The daemon's own load, folded into the path's level (HandoffsElevated/High). */
        (void)telemetry_peer_load(hm->manager, w->host, w->handoffs, 0, 0);
}

void handoff_window_leave(HandoffObject *o) {
        if (!o->windowed)
                return;
        o->windowed = false;
        PeerWindow *w = hashmap_get(o->hm->windows, o->peer_host);
        if (!w)
                return;
        assert(w->handoffs > 0 && w->bytes >= o->window_bytes);
        w->handoffs--;
        w->bytes -= o->window_bytes;
        usec_t now = now_usec(CLOCK_MONOTONIC), held = now > o->window_since ? now - o->window_since : 0;
        w->held_avg = backpressure_held_average(w->held_avg, held);
        handoff_window_publish(o->hm, w);
}

void handoff_manager_window(HandoffManager *hm, const char *peer, unsigned *ret_handoffs, uint64_t *ret_bytes) {
        PeerWindow *w = hm && peer ? hashmap_get(hm->windows, peer) : NULL;
        if (ret_handoffs)
                *ret_handoffs = w ? w->handoffs : 0;
        if (ret_bytes)
                *ret_bytes = w ? w->bytes : 0;
}

/* A peer path's backpressure level changed (a telemetry subscription): posts an
 * EPD_RING_EV_BACKPRESSURE record to every worker's ring. */
void handoff_on_backpressure(Telemetry *t, const char *peer, BackpressureLevel level,
                            BackpressureReason reason, void *userdata) {
        HandoffManager *hm = userdata;
        if (!hm || !peer)
                return;
        Manager *m = hm->manager;
        const char *host = peer; /* telemetry keys peers by host id, as the windows are */
        PeerWindow *w = hashmap_get(hm->windows, host);
        unsigned n = w ? w->handoffs : 0, permille = 0;
        usec_t retry = 0;
        /* The retry-after a Prepare would get now: 0 while the window takes one. */
        (void)backpressure_window_admit(&m->config.telemetry.backpressure, level, reason, n, w ? w->bytes : 0, 0,
                                        w ? w->held_avg : 0, &retry, &permille);
        if (level == BACKPRESSURE_NONE)
                retry = 0;

        struct epd_ring_record rec;
        ring_record_backpressure(&rec, host, level, reason, permille, retry);
        ClientRing *cr;
        size_t it = 0;
        while (hashmap_iterate(hm->rings, &it, (void **)&cr, NULL)) {
                if (ring_post(cr->ring, &rec) < 0)
                        hm->counters.ring_fallbacks++; /* the D-Bus signal carries it too */
                handoff_ring_kick_later(cr);
        }
}

/* ---- sources waiting to post: for room, or for the next dispatch ---- */

/* A source waits in one of two queues: hm->stalled when its post found the writes in
 * flight to its peer at the transport's bound (completions wake it), hm->yielded when
 * the dispatch had posted its HANDOFF_TURN_WRITES_MAX writes (the yield source wakes it,
 * behind whatever else was pending then). o->stalled is set in either. */
static void wait_in(HandoffObject *o, bool yielded) {
        HandoffManager *hm = o->hm;
        o->stalled = true;
        o->yielded = yielded;
        if (yielded)
                QUEUE_PUSH_BACK(stall, hm->yielded, o);
        else
                QUEUE_PUSH_BACK(stall, hm->stalled, o);
}

void handoff_stall(HandoffObject *o) {
        if (o->stalled)
                return;
        wait_in(o, false);
        o->hm->counters.stalls++;
}

void handoff_unstall_forget(HandoffObject *o) {
        if (!o->stalled)
                return;
        if (o->yielded)
                QUEUE_REMOVE(stall, o->hm->yielded, o);
        else
                QUEUE_REMOVE(stall, o->hm->stalled, o);
        o->stalled = o->yielded = false;
}

/* The remote writes posted in this dispatch are below HANDOFF_TURN_WRITES_MAX (a
 * dispatch is an iteration of the loop: sd_event_prepare() counts them). */
bool handoff_turn_has_room(HandoffManager *hm) {
        uint64_t it = 0;
        (void)sd_event_get_iteration(hm->manager->event, &it);
        if (it != hm->turn) {
                hm->turn = it;
                hm->turn_writes = 0;
        }
        return hm->turn_writes < HANDOFF_TURN_WRITES_MAX;
}

void handoff_turn_count(HandoffManager *hm, size_t n) {
        (void)handoff_turn_has_room(hm); /* a new iteration starts from 0 */
        hm->turn_writes = (uint32_t)MIN((uint64_t)hm->turn_writes + n, (uint64_t)UINT32_MAX);
}

static void pump_waiting(HandoffManager *hm, HandoffObject *o) {
        handoff_unstall_forget(o);
        handoff_obj_hold(o);
        if (o->staged)
                handoff_stage_send_landed(o); /* its staged groups first, in order */
        if (!handoff_is_ended(o->h) && !o->stalled)
                handoff_pump(o);
        handoff_after_event(o);
        handoff_obj_unhold(o);
}

static int yield_arm(HandoffManager *hm);

static int on_yield(sd_event_source *s, void *userdata) {
        HandoffManager *hm = userdata;
        /* The ones that yielded, first come first, while this dispatch has writes left
         * (one that posts them and has more goes to the back): pumping the rest once the
         * writes are posted would only send each to the back again, in the same order,
         * and the first would have every dispatch. */
        size_t n = 0;
        for (HandoffObject *i = hm->yielded.first; i; i = i->stall_next)
                n++;
        while (n-- > 0 && hm->yielded.first && handoff_turn_has_room(hm))
                pump_waiting(hm, hm->yielded.first);
        if (hm->yielded.first && yield_arm(hm) < 0)
                /* Nothing would wake them: they go now (handoff_yield() cannot arm
                 * either, so they post on rather than wait). */
                while (hm->yielded.first) {
                        hm->turn_writes = 0;
                        pump_waiting(hm, hm->yielded.first);
                }
        return 0;
}

/* The yield source runs below the normal priority: the bus calls, completions,
 * heartbeats and data streams pending meanwhile go first (a defer source of the same
 * priority would not let them: its pending mark, from the dispatch that armed it, is
 * older than theirs, so it would win every dispatch while sources keep yielding). So
 * that a loop never idle does not keep the yielded sources waiting for ever, it is
 * raised to the normal priority HANDOFF_YIELD_TURNS dispatches after it was armed
 * (handoff_yield_after_dispatch()), where that old mark puts it first. */
static int yield_arm(HandoffManager *hm) {
        if (hm->yield_source && sd_event_source_get_enabled(hm->yield_source, NULL) > 0)
                return 0; /* armed already */
        int r = 0;
        if (!hm->yield_source)
                r = sd_event_add_defer(hm->manager->event, &hm->yield_source, on_yield, hm);
        if (r >= 0)
                r = sd_event_source_set_priority(hm->yield_source, SD_EVENT_PRIORITY_NORMAL + 1);
        if (r >= 0)
                r = sd_event_source_set_enabled(hm->yield_source, SD_EVENT_ONESHOT);
        if (r >= 0)
                (void)sd_event_get_iteration(hm->manager->event, &hm->yield_armed);
        return r;
}

void handoff_yield_after_dispatch(HandoffManager *hm) {
        uint64_t it = 0;
        int64_t prio = 0;
        if (!hm || !hm->yielded.first || !hm->yield_source)
                return;
        (void)sd_event_get_iteration(hm->manager->event, &it);
        if (it - hm->yield_armed >= HANDOFF_YIELD_TURNS &&
            sd_event_source_get_priority(hm->yield_source, &prio) >= 0 && prio != SD_EVENT_PRIORITY_NORMAL)
                (void)sd_event_source_set_priority(hm->yield_source, SD_EVENT_PRIORITY_NORMAL);
}

bool handoff_yield(HandoffObject *o) {
        HandoffManager *hm = o->hm;
        if (o->stalled)
                return true;
        int r = yield_arm(hm);
        if (r < 0) {
                /* Not left waiting with nothing to wake it: the groups go now. */
                log_debug_errno(r, "handoff %s: cannot yield the loop, posting on: %m", o->request_str);
                hm->turn_writes = 0;
                return false;
        }
        wait_in(o, true);
        hm->counters.post_yields++;
        return true;
}

/* Writes to other hosts completed: the sources that waited for room post again, first
 * come first, each once (one that finds no room yet goes to the back and waits for the
 * next completions). Once this dispatch's writes are posted, the rest wait for the
 * next dispatch instead (handoff_yield(): not planned again only to be put back). */
void handoff_unstall(HandoffManager *hm) {
        size_t n = 0;
        for (HandoffObject *i = hm->stalled.first; i; i = i->stall_next)
                n++;
        while (n-- > 0 && hm->stalled.first) {
                HandoffObject *o = hm->stalled.first;
                if (!handoff_turn_has_room(hm)) {
                        handoff_unstall_forget(o);
                        if (!handoff_yield(o))
                                pump_waiting(hm, o);
                        continue;
                }
                pump_waiting(hm, o);
        }
}
