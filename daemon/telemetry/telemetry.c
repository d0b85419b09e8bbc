/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>

#include "hashmap.h"
#include "log.h"
#include "telemetry/telemetry-bpf.h"
#include "telemetry/telemetry.h"

#define TELEMETRY_CONNS_PER_PEER 64
/* Of those, clients' (TrackSocket) may take all but these: the daemon's own control
 * connection and data streams (PEER_MAX_STREAMS) always find room. */
#define TELEMETRY_CONNS_DAEMON_RESERVED 20
/* And all clients' together at most half of what the kernel map holds. */
#define TELEMETRY_CLIENT_CONNS_MAX (EPD_TELEMETRY_MAX_CONNS / 2)

typedef struct TelemetryPeer TelemetryPeer;

typedef struct TelemetryConn {
        uint64_t cookie;
        TelemetryPeer *peer;
        bool closed;               /* the kernel reported it closing */
        bool client;               /* a client's (TrackSocket), not the daemon's own */
        TelemetryConnReading last; /* its counters as last read from the kernel */
} TelemetryConn;

struct TelemetryPeer {
        char *name;
        uint32_t id;
        TelemetryConn *conns[TELEMETRY_CONNS_PER_PEER];
        unsigned n_conns;
        bool ever_tracked;
        BackpressureState bp;
        TelemetryPathStats path;
        unsigned handoffs_in_flight;
        uint64_t dest_free, dest_total;
        uint64_t events;
        bool dirty;                /* an urgent event arrived: evaluate at once */
        TelemetryPeerTotals retired; /* of connections no longer tracked */
        TelemetryPeerTotals totals;  /* retired + each tracked connection's last */
};

static void totals_add(TelemetryPeerTotals *a, const TelemetryPeerTotals *b) {
        a->bytes_sent += b->bytes_sent;
        a->bytes_acked += b->bytes_acked;
        a->bytes_received += b->bytes_received;
        a->bytes_retrans += b->bytes_retrans;
        a->segs_out += b->segs_out;
        a->retransmits += b->retransmits;
}

void telemetry_conn_reading_update(TelemetryConnReading *r, uint64_t bytes_sent, uint64_t bytes_acked,
                                   uint64_t bytes_received, uint64_t bytes_retrans, uint32_t segs_out,
                                   uint32_t total_retrans) {
        r->totals.bytes_sent = bytes_sent - MIN(bytes_sent, r->base.bytes_sent);
        r->totals.bytes_acked = bytes_acked - MIN(bytes_acked, r->base.bytes_acked);
        r->totals.bytes_received = bytes_received - MIN(bytes_received, r->base.bytes_received);
        r->totals.bytes_retrans = bytes_retrans - MIN(bytes_retrans, r->base.bytes_retrans);
        if (r->have_raw) {
                r->totals.segs_out += (uint32_t)(segs_out - r->raw_segs_out);
                r->totals.retransmits += (uint32_t)(total_retrans - r->raw_retrans);
        } else {
                r->totals.segs_out = segs_out;
                r->totals.retransmits = total_retrans;
        }
        r->raw_segs_out = segs_out;
        r->raw_retrans = total_retrans;
        r->have_raw = true;
}

void telemetry_conn_reading_start(TelemetryConnReading *r, uint64_t bytes_sent, uint64_t bytes_acked,
                                  uint64_t bytes_received, uint64_t bytes_retrans, uint32_t segs_out,
                                  uint32_t total_retrans) {
        *r = (TelemetryConnReading){
                .base = { .bytes_sent = bytes_sent, .bytes_acked = bytes_acked, .bytes_received = bytes_received,
                          .bytes_retrans = bytes_retrans },
                .raw_segs_out = segs_out,
                .raw_retrans = total_retrans,
                .have_raw = true,
        };
}

void telemetry_totals_merge_max(TelemetryPeerTotals *kept, const TelemetryPeerTotals *now) {
        kept->bytes_sent = MAX(kept->bytes_sent, now->bytes_sent);
        kept->bytes_acked = MAX(kept->bytes_acked, now->bytes_acked);
        kept->bytes_received = MAX(kept->bytes_received, now->bytes_received);
        kept->bytes_retrans = MAX(kept->bytes_retrans, now->bytes_retrans);
        kept->segs_out = MAX(kept->segs_out, now->segs_out);
        kept->retransmits = MAX(kept->retransmits, now->retransmits);
}

/* A connection goes from the peer's tracked set: its counters stay in the totals. */
static void conn_retire(TelemetryPeer *p, TelemetryConn *c) {
        totals_add(&p->retired, &c->last.totals);
}

struct Telemetry {
        sd_event *event;
        TelemetryConfig config;
        TelemetryBpf *bpf;
        char *bpf_unavailable;
        sd_event_source *ring_source, *timer_source, *defer_source;

        Hashmap *peers;            /* TelemetryPeer* by name */
        TelemetryPeer **peer_by_id;
        size_t n_peer_ids;
        Hashmap *conns;            /* TelemetryConn* by cookie */
        size_t n_client_conns;     /* of them, clients' */
        usec_t pruned_usec;        /* the kernel's per-connection records last pruned */
        TraceStore *traces;

        /* Subscribers to backpressure changes (the bus signal, the handoff window and
         * the workers' rings): telemetry_add_backpressure_handler(). */
        struct {
                TelemetryBackpressureFn fn;
                void *userdata;
        } on_backpressure[TELEMETRY_BACKPRESSURE_HANDLERS_MAX];
        size_t n_on_backpressure;

        uint64_t ring_events, ring_bad, ring_wakeups;
};

static TelemetryPeer *peer_free(TelemetryPeer *p) {
        if (!p)
                return NULL;
        free(p->name);
        free(p);
        return NULL;
}

int telemetry_new(Telemetry **ret, sd_event *event, const TelemetryConfig *config) {
        _cleanup_(telemetry_freep) Telemetry *t = NULL;
        int r;

        t = calloc(1, sizeof *t);
        if (!t)
                return -ENOMEM;
        t->event = sd_event_ref(event);
        r = config ? telemetry_config_copy(&t->config, config) : telemetry_config_defaults(&t->config);
        if (r < 0)
                return r;

        t->peers = hashmap_new(HASHMAP_KEY_STRING, 0);
        t->conns = hashmap_new(HASHMAP_KEY_U64, 0);
        t->traces = trace_store_new(t->config.trace_requests, t->config.trace_events);
        if (!t->peers || !t->conns || !t->traces)
                return -ENOMEM;

        *ret = TAKE_PTR(t);
        return 0;
}

Telemetry *telemetry_free(Telemetry *t) {
        if (!t)
                return NULL;

        sd_event_source_disable_unref(t->ring_source);
        sd_event_source_disable_unref(t->timer_source);
        sd_event_source_disable_unref(t->defer_source);
        telemetry_bpf_free(t->bpf);

        size_t i = 0;
        void *v;
        while (hashmap_iterate(t->conns, &i, &v, NULL))
                free(v);
        hashmap_free(t->conns);
        i = 0;
        while (hashmap_iterate(t->peers, &i, &v, NULL))
                peer_free(v);
        hashmap_free(t->peers);
        free(t->peer_by_id);
        trace_store_free(t->traces);
        free(t->bpf_unavailable);
        telemetry_config_done(&t->config);
        sd_event_unref(t->event);
        free(t);
        return NULL;
}

int telemetry_add_backpressure_handler(Telemetry *t, TelemetryBackpressureFn fn, void *userdata) {
        if (t->n_on_backpressure >= ELEMENTSOF(t->on_backpressure))
                return -ENOSPC;
        t->on_backpressure[t->n_on_backpressure].fn = fn;
        t->on_backpressure[t->n_on_backpressure++].userdata = userdata;
        return 0;
}

void telemetry_remove_backpressure_handler(Telemetry *t, TelemetryBackpressureFn fn, void *userdata) {
        for (size_t i = 0; t && i < t->n_on_backpressure; i++)
                if (t->on_backpressure[i].fn == fn && t->on_backpressure[i].userdata == userdata) {
                        memmove(&t->on_backpressure[i], &t->on_backpressure[i + 1],
                                (t->n_on_backpressure - i - 1) * sizeof t->on_backpressure[0]);
                        t->n_on_backpressure--;
                        return;
                }
}

static void backpressure_notify(Telemetry *t, const char *peer, BackpressureLevel level, BackpressureReason reason) {
        for (size_t i = 0; i < t->n_on_backpressure; i++)
                t->on_backpressure[i].fn(t, peer, level, reason, t->on_backpressure[i].userdata);
}

/* A peer that nothing refers to any more: no connection tracked, no handoff or
 * destination load reported. Its entry is what a full table
 * gives up for a new peer (names come from clients' TrackSocket too: made-up ones must
 * not use up MaxPeers= for good). */
static bool peer_idle(const TelemetryPeer *p) {
        /* (Its level does not count: with no connection left it reads "disconnected".) */
        return p->n_conns == 0 && p->handoffs_in_flight == 0 && p->dest_total == 0;
}

static bool peer_reclaim_one(Telemetry *t) {
        for (size_t i = 0; i < t->n_peer_ids; i++) {
                TelemetryPeer *p = t->peer_by_id[i];
                if (!p || !peer_idle(p))
                        continue;
                /* Its id is free for the next peer (no connection of it is tracked in
                 * BPF under it any more). Whoever heard it was backpressured (a
                 * disconnected peer reads stalled) hears that it is not any more: the
                 * daemon itself now reads none for the name, and a worker left with the
                 * old level would defer that peer's work for good. */
                if (p->bp.level != BACKPRESSURE_NONE) {
                        log_info("Backpressure towards %s: none (forgotten: nothing refers to it).", p->name);
                        backpressure_notify(t, p->name, BACKPRESSURE_NONE, BACKPRESSURE_REASON_NONE);
                }
                hashmap_remove(t->peers, p->name);
                t->peer_by_id[i] = NULL;
                peer_free(p);
                return true;
        }
        return false;
}

/* How many of MaxPeers= entries clients' TrackSocket names may fill: the rest (a
 * quarter, at least one) are the daemon's own peers' (made-up names must not leave a
 * real peer without telemetry and backpressure). */
static size_t client_peers_max(const Telemetry *t) {
        return t->config.max_peers - MAX(t->config.max_peers / 4, 1u);
}

typedef enum PeerCreate {
        PEER_FIND,
        PEER_CREATE,        /* the daemon's own: every entry */
        PEER_CREATE_CLIENT, /* a client's TrackSocket: client_peers_max() */
} PeerCreate;

static int peer_get(Telemetry *t, const char *name, PeerCreate create, TelemetryPeer **ret) {
        TelemetryPeer *p = hashmap_get(t->peers, name);
        if (p) {
                *ret = p;
                return 0;
        }
        if (create == PEER_FIND)
                return -ENOENT;
        /* A peer is named by its host id (up to 63 characters, HostId=); the BPF map
         * keeps a truncated copy for tools (EPD_TELEMETRY_PEER_MAX), not a key. */
        size_t len = strlen(name);
        if (len == 0 || len > TELEMETRY_PEER_NAME_MAX)
                return -EINVAL;
        /* A client's name reclaims until the table is under its cap, not one entry for
         * one: reclaiming the daemon's idle entries one for one let clients' names take
         * the whole table while the daemon's peers were down. */
        size_t cap = create == PEER_CREATE_CLIENT ? client_peers_max(t) : t->config.max_peers;
        while (hashmap_size(t->peers) >= cap)
                if (!peer_reclaim_one(t))
                        return -ENOSPC;

        size_t id = 0;
        while (id < t->n_peer_ids && t->peer_by_id[id])
                id++; /* a reclaimed peer's id, or a new one */
        if (id == t->n_peer_ids) {
                if (t->n_peer_ids == UINT32_MAX)
                        return -ENOSPC;
                TelemetryPeer **ids = reallocarray(t->peer_by_id, t->n_peer_ids + 1, sizeof *ids);
                if (!ids)
                        return -ENOMEM;
                t->peer_by_id = ids;
                ids[t->n_peer_ids] = NULL;
        }

        p = calloc(1, sizeof *p);
        if (!p)
                return -ENOMEM;
        p->name = strdup(name);
        if (!p->name) {
                free(p);
                return -ENOMEM;
        }
        p->id = (uint32_t)id;
        backpressure_state_init(&p->bp);
        int r = hashmap_put(t->peers, p->name, p);
        if (r < 0) {
                peer_free(p);
                return r;
        }
        t->peer_by_id[id] = p;
        if (id == t->n_peer_ids)
                t->n_peer_ids++;
        *ret = p;
        return 0;
}

static void peer_evaluate(Telemetry *t, TelemetryPeer *p, usec_t now) {
        TelemetryPathStats path = {};
        bool connected = false;

        TelemetryPeerTotals totals = p->retired;
        for (unsigned i = 0; i < p->n_conns; i++) {
                TelemetryConn *c = p->conns[i];
                struct epd_conn_stats st;
                if (t->bpf && telemetry_bpf_conn_stats(t->bpf, c->cookie, &st) >= 0) {
                        if (tcp_state_is_closing(st.state))
                                c->closed = true;
                        telemetry_path_stats_add(&path, &st);
                        telemetry_conn_reading_update(&c->last, st.bytes_sent, st.bytes_acked, st.bytes_received,
                                                      st.bytes_retrans, (uint32_t)st.segs_out, st.total_retrans);
                }
                totals_add(&totals, &c->last.totals); /* its last values while the kernel has none */
        }
        /* Never down (a connection's counters only grow; a missing record keeps its last). */
        telemetry_totals_merge_max(&p->totals, &totals);
        for (unsigned i = 0; i < p->n_conns; i++)
                if (!p->conns[i]->closed)
                        connected = true;
        p->path = path;

        BackpressureSample x = {
                .now = now,
                .have_kernel = t->bpf && path.n_conns > 0,
                .connected = connected || !p->ever_tracked,
                .srtt_usec = path.srtt_usec,
                .min_rtt_usec = path.min_rtt_usec,
                .segs_out = path.segs_out,
                .retransmits = path.retransmits,
                .bytes_acked = path.bytes_acked,
                .send_queue_bytes = path.send_queue,
                .inflight_bytes = path.inflight,
                .handoffs_in_flight = p->handoffs_in_flight,
                .destination_free_pages = p->dest_free,
                .destination_total_pages = p->dest_total,
        };
        p->dirty = false;
        int r = backpressure_update(&p->bp, &t->config.backpressure, &x);
        if (r <= 0)
                return;

        log_info("Backpressure towards %s: %s (%s; srtt %uus, min %uus, retransmit rate %.3f).",
                 p->name, backpressure_level_to_string(p->bp.level),
                 backpressure_reason_to_string(p->bp.reason), path.srtt_usec, path.min_rtt_usec,
                 p->bp.retransmit_rate);
        backpressure_notify(t, p->name, p->bp.level, p->bp.reason);
}

int telemetry_evaluate(Telemetry *t) {
        usec_t now = now_usec(CLOCK_MONOTONIC);
        size_t i = 0;
        void *v;
        while (hashmap_iterate(t->peers, &i, &v, NULL))
                peer_evaluate(t, v, now);
        return 0;
}

static void evaluate_dirty(Telemetry *t) {
        usec_t now = now_usec(CLOCK_MONOTONIC);
        size_t i = 0;
        void *v;
        while (hashmap_iterate(t->peers, &i, &v, NULL)) {
                TelemetryPeer *p = v;
                if (p->dirty)
                        peer_evaluate(t, p, now);
        }
}

/* Called by libbpf for each ring record, inside telemetry_bpf_consume(). */
static int on_ring_record(void *userdata, const void *data, size_t size) {
        Telemetry *t = userdata;
        TelemetryEvent e;

        if (telemetry_event_decode(data, size, &e) < 0) {
                t->ring_bad++;
                return 0;
        }
        t->ring_events++;

        TelemetryConn *c = hashmap_get(t->conns, &e.cookie);
        if (!c)
                return 0; /* untracked meanwhile */
        c->peer->events++;
        switch (e.type) {
        case TELEMETRY_EVENT_STATE:
                if (tcp_state_is_closing(e.new_state))
                        c->closed = true;
                c->peer->dirty = true;
                break;
        case TELEMETRY_EVENT_RETRANSMIT:
                c->peer->dirty = true;
                break;
        case TELEMETRY_EVENT_SAMPLE:
                break;
        }
        return 0;
}

static int on_ring_ready(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Telemetry *t = userdata;

        t->ring_wakeups++;
        /* The epoll fd libbpf gives is level-triggered on the ring's own fd: drain it all
         * now, in one batch, then evaluate the peers that had urgent events. */
        int r = telemetry_bpf_consume(t->bpf);
        if (r < 0)
                log_debug_errno(r, "Consuming the telemetry ring failed: %m");
        evaluate_dirty(t);
        return 0;
}

static bool conn_tracked(void *userdata, uint64_t cookie) {
        Telemetry *t = userdata;
        return hashmap_get(t->conns, &cookie) != NULL;
}

static int on_timer(sd_event_source *s, uint64_t usec, void *userdata) {
        Telemetry *t = userdata;

        if (t->bpf)
                (void)telemetry_bpf_consume(t->bpf);
        telemetry_evaluate(t);
        /* Every 10 s: kernel records of sockets no longer tracked (one made just as its
         * socket was untracked is deleted by nobody else). */
        usec_t now = now_usec(CLOCK_MONOTONIC);
        if (t->bpf && now - t->pruned_usec >= 10 * USEC_PER_SEC) {
                t->pruned_usec = now;
                (void)telemetry_bpf_prune(t->bpf, conn_tracked, t);
        }

        int r = sd_event_source_set_time_relative(s, t->config.backpressure.interval_usec);
        if (r >= 0)
                r = sd_event_source_set_enabled(s, SD_EVENT_ONESHOT);
        if (r < 0)
                return log_error_errno(r, "Cannot rearm the telemetry timer: %m");
        return 0;
}

static void bpf_close(Telemetry *t) {
        t->ring_source = sd_event_source_disable_unref(t->ring_source);
        t->bpf = telemetry_bpf_free(t->bpf);
}

static int bpf_start(Telemetry *t) {
        _cleanup_(freep) char *why = NULL;
        int r;

        free(t->bpf_unavailable);
        t->bpf_unavailable = NULL;

        if (!t->config.bpf) {
                t->bpf_unavailable = strdup("disabled in the configuration ([Telemetry] BPF=no)");
                log_info("Kernel telemetry is disabled in the configuration.");
                return 0;
        }

        r = telemetry_bpf_open(&t->bpf, t->config.pin_dir,
                               t->config.sample_interval_usec * NSEC_PER_USEC,
                               t->config.wakeup_bytes, on_ring_record, t, &why);
        if (r < 0) {
                log_notice("Kernel telemetry unavailable, running without it: %s.",
                           why ? why : strerror(-r));
                t->bpf_unavailable = TAKE_PTR(why);
                return 0;
        }

        r = sd_event_add_io(t->event, &t->ring_source, telemetry_bpf_ring_fd(t->bpf), EPOLLIN,
                            on_ring_ready, t);
        if (r < 0) {
                bpf_close(t);
                return log_error_errno(r, "Cannot watch the telemetry ring buffer: %m");
        }
        (void)sd_event_source_set_description(t->ring_source, "telemetry-ring");

        /* Re-register connections tracked before a restart of the BPF side. */
        size_t i = 0;
        void *v;
        while (hashmap_iterate(t->conns, &i, &v, NULL)) {
                TelemetryConn *c = v;
                (void)telemetry_bpf_track(t->bpf, c->cookie, c->peer->id, c->peer->name);
        }

        const char *pins = telemetry_bpf_pin_dir(t->bpf);
        log_info("Kernel telemetry loaded%s%s%s.", pins ? ", maps pinned under " : "", pins ?: "",
                 !pins && t->config.pin_dir ? ", maps not pinned (see above)" : "");
        return 0;
}

int telemetry_start(Telemetry *t) {
        int r = bpf_start(t);
        if (r < 0)
                return r;

        if (!t->timer_source) {
                r = sd_event_add_time_relative(t->event, &t->timer_source, CLOCK_MONOTONIC,
                                               t->config.backpressure.interval_usec,
                                               t->config.backpressure.interval_usec / 10, on_timer, t);
                if (r < 0)
                        return log_error_errno(r, "Cannot add the telemetry timer: %m");
                (void)sd_event_source_set_description(t->timer_source, "telemetry-timer");
        }
        return 0;
}

int telemetry_reconfigure(Telemetry *t, const TelemetryConfig *config) {
        TelemetryConfig c;
        int r = telemetry_config_copy(&c, config);
        if (r < 0)
                return r;

        bool restart_bpf = c.bpf != t->config.bpf ||
                           c.sample_interval_usec != t->config.sample_interval_usec ||
                           c.wakeup_bytes != t->config.wakeup_bytes ||
                           !!c.pin_dir != !!t->config.pin_dir ||
                           (c.pin_dir && strcmp(c.pin_dir, t->config.pin_dir) != 0);
        /* The trace store's bounds apply to new requests; it is not rebuilt. */
        telemetry_config_done(&t->config);
        t->config = c;
        if (restart_bpf) {
                bpf_close(t);
                r = bpf_start(t);
                if (r < 0)
                        return r;
        }
        return 0;
}

static int socket_cookie(int fd, uint64_t *ret) {
        socklen_t l = sizeof *ret;
        if (getsockopt(fd, SOL_SOCKET, SO_COOKIE, ret, &l) < 0)
                return -errno;
        return 0;
}

static int track(Telemetry *t, int fd, const char *peer, bool client) {
        TelemetryPeer *p;
        uint64_t cookie;
        int r;

        if (!t || fd < 0 || !peer)
                return -EINVAL;
        r = socket_cookie(fd, &cookie);
        if (r < 0)
                return r;
        if (hashmap_contains(t->conns, &cookie))
                return -EEXIST;

        r = peer_get(t, peer, client ? PEER_CREATE_CLIENT : PEER_CREATE, &p);
        if (r < 0)
                return r;
        if (p->n_conns >= TELEMETRY_CONNS_PER_PEER)
                return -ENOSPC;
        if (client) {
                unsigned mine = 0;
                for (unsigned i = 0; i < p->n_conns; i++)
                        mine += p->conns[i]->client;
                if (mine >= TELEMETRY_CONNS_PER_PEER - TELEMETRY_CONNS_DAEMON_RESERVED ||
                    t->n_client_conns >= TELEMETRY_CLIENT_CONNS_MAX)
                        return -ENOSPC;
        }
        /* The peer is back after every connection of it was gone: a new path, judged
         * afresh (hysteresis would otherwise hold "disconnected" for seconds while the
         * new connection works, and the handoff window would stay closed). */
        bool was_gone = p->ever_tracked;
        for (unsigned i = 0; i < p->n_conns; i++)
                if (!p->conns[i]->closed)
                        was_gone = false;
        if (hashmap_size(t->conns) >= EPD_TELEMETRY_MAX_CONNS)
                return -ENOSPC;

        TelemetryConn *c = calloc(1, sizeof *c);
        if (!c)
                return -ENOMEM;
        c->cookie = cookie;
        c->peer = p;
        c->client = client;
        struct tcp_info ti = {};
        socklen_t til = sizeof ti;
        if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &til) >= 0 &&
            til >= offsetof(struct tcp_info, tcpi_bytes_retrans) + sizeof ti.tcpi_bytes_retrans)
                telemetry_conn_reading_start(&c->last, ti.tcpi_bytes_sent, ti.tcpi_bytes_acked, ti.tcpi_bytes_received,
                                             ti.tcpi_bytes_retrans, ti.tcpi_segs_out, ti.tcpi_total_retrans);
        r = hashmap_put(t->conns, &c->cookie, c);
        if (r < 0) {
                free(c);
                return r;
        }
        p->conns[p->n_conns++] = c;
        t->n_client_conns += client;
        p->ever_tracked = true;
        if (was_gone && p->bp.level != BACKPRESSURE_NONE) {
                backpressure_state_init(&p->bp);
                log_info("Backpressure towards %s: none (connected again).", p->name);
                backpressure_notify(t, p->name, BACKPRESSURE_NONE, BACKPRESSURE_REASON_NONE);
        }

        if (t->bpf) {
                r = telemetry_bpf_track(t->bpf, cookie, p->id, p->name);
                if (r < 0)
                        log_warning_errno(r, "Cannot track the connection to %s in the kernel: %m", peer);
        }
        return 0;
}

int telemetry_track(Telemetry *t, int fd, const char *peer) {
        return track(t, fd, peer, false);
}

int telemetry_track_client(Telemetry *t, int fd, const char *peer) {
        return track(t, fd, peer, true);
}

int telemetry_untrack(Telemetry *t, int fd) {
        uint64_t cookie;
        int r;

        if (!t || fd < 0)
                return -EINVAL;
        r = socket_cookie(fd, &cookie);
        if (r < 0)
                return r;

        TelemetryConn *c = hashmap_remove(t->conns, &cookie);
        if (!c)
                return -ENOENT;
        TelemetryPeer *p = c->peer;
        for (unsigned i = 0; i < p->n_conns; i++)
                if (p->conns[i] == c) {
                        p->conns[i] = p->conns[--p->n_conns];
                        break;
                }
        conn_retire(p, c);
        if (c->client && t->n_client_conns > 0)
                t->n_client_conns--;
        if (t->bpf)
                (void)telemetry_bpf_untrack(t->bpf, cookie);
        free(c);
        p->dirty = true;
        return 0;
}

int telemetry_untrack_all(Telemetry *t, const char *peer) {
        TelemetryPeer *p;
        if (!t || !peer)
                return -EINVAL;
        int r = peer_get(t, peer, PEER_FIND, &p);
        if (r < 0)
                return r;
        for (unsigned i = p->n_conns; i-- > 0;) {
                TelemetryConn *c = p->conns[i];
                if (c->client)
                        continue;
                p->conns[i] = p->conns[--p->n_conns];
                hashmap_remove(t->conns, &c->cookie);
                conn_retire(p, c);
                if (t->bpf)
                        (void)telemetry_bpf_untrack(t->bpf, c->cookie);
                free(c);
        }
        p->dirty = true;
        return 0;
}

int telemetry_set_peer_load(Telemetry *t, const char *peer, unsigned handoffs_in_flight,
                            uint64_t destination_free_pages, uint64_t destination_total_pages) {
        TelemetryPeer *p;
        if (!t || !peer || destination_free_pages > destination_total_pages)
                return -EINVAL;
        int r = peer_get(t, peer, PEER_CREATE, &p);
        if (r < 0)
                return r;
        p->handoffs_in_flight = handoffs_in_flight;
        p->dest_free = destination_free_pages;
        p->dest_total = destination_total_pages;
        return 0;
}

static void peer_fill(const Telemetry *t, const TelemetryPeer *p, TelemetryPeerStats *ret) {
        *ret = (TelemetryPeerStats){
                .name = p->name,
                .kernel = t->bpf && p->path.n_conns > 0,
                .tracked = p->n_conns,
                .path = p->path,
                .level = p->bp.level,
                .reason = p->bp.reason,
                .rtt_inflation = p->bp.rtt_inflation,
                .retransmit_rate = p->bp.retransmit_rate,
                .handoffs_in_flight = p->handoffs_in_flight,
                .destination_free_pages = p->dest_free,
                .destination_total_pages = p->dest_total,
                .events = p->events,
                .totals = p->totals,
        };
}

int telemetry_get_peer(Telemetry *t, const char *peer, TelemetryPeerStats *ret) {
        TelemetryPeer *p;
        if (!t || !peer || !ret)
                return -EINVAL;
        int r = peer_get(t, peer, PEER_FIND, &p);
        if (r < 0)
                return r;
        peer_fill(t, p, ret);
        return 0;
}

int telemetry_iterate_peers(Telemetry *t, size_t *state, TelemetryPeerStats *ret) {
        if (!t || !state || !ret)
                return -EINVAL;
        while (*state < t->n_peer_ids && !t->peer_by_id[*state])
                (*state)++; /* reclaimed */
        if (*state >= t->n_peer_ids)
                return 0;
        peer_fill(t, t->peer_by_id[(*state)++], ret);
        return 1;
}

BackpressureLevel telemetry_get_level(Telemetry *t, const char *peer) {
        TelemetryPeer *p;
        if (!t || !peer || peer_get(t, peer, PEER_FIND, &p) < 0)
                return BACKPRESSURE_NONE;
        return p->bp.level;
}

void telemetry_get_counters(Telemetry *t, TelemetryCounters *ret) {
        *ret = (TelemetryCounters){
                .bpf_loaded = t->bpf != NULL,
                .bpf_unavailable = t->bpf_unavailable,
                .pin_dir = t->bpf ? telemetry_bpf_pin_dir(t->bpf) : NULL,
                .ring_events = t->ring_events,
                .ring_bad = t->ring_bad,
                .ring_wakeups = t->ring_wakeups,
                .tracked = (unsigned)hashmap_size(t->conns),
                .peers = (unsigned)hashmap_size(t->peers),
                .traces = trace_store_size(t->traces),
                .traces_evicted = trace_store_evicted(t->traces),
        };
        uint64_t k[_EPD_COUNTER_MAX];
        if (t->bpf && telemetry_bpf_counters(t->bpf, k) >= 0) {
                ret->kernel_events = k[EPD_COUNTER_EVENTS];
                ret->kernel_dropped = k[EPD_COUNTER_DROPPED];
        }
        if (t->bpf)
                (void)telemetry_bpf_prog_stats(t->bpf, &ret->kernel_run_nsec, &ret->kernel_runs);
}

int telemetry_record(Telemetry *t, const char *request_id, TraceEventType type, const TraceDetail *d) {
        if (!t)
                return -EINVAL;
        return trace_store_add(t->traces, request_id, now_usec(CLOCK_REALTIME), type, d);
}

int telemetry_record_n(Telemetry *t, const char *request_id, TraceEventType type, const TraceDetail *d, size_t n) {
        if (!t)
                return -EINVAL;
        return trace_store_add_n(t->traces, request_id, now_usec(CLOCK_REALTIME), type, d, n);
}

const TraceRequest *telemetry_get_trace(Telemetry *t, const char *request_id) {
        return t ? trace_store_get(t->traces, request_id) : NULL;
}

/* Manager-facing API. */
