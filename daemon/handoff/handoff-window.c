/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The handoff window per peer (docs/telemetry.md): handoffs and bytes in flight to a
 * host, bounded by its backpressure level, and the telemetry subscription that posts
 * level changes to every worker's ring. */
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
