/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "handoff/handoff-manager.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>

#include "core/arena.h"
#include "handoff/bus-handoff.h"
#include "copy.h"
#include "gpu/gpu-domain.h"
#include "handoff/handoff-proto.h"
#include "pages/kvlayout.h"
#include "log.h"
#include "macro.h"
#include "pages/page-manager.h"
#include "peer/peer-manager.h"
#include "pages/sequence-record.h"
#include "pages/sequence.h"
#include "telemetry/telemetry.h"
#include "transport/cuda.h"
#include "transport/local.h"
#include "wal/wal-manager.h"
#include "core/worker.h"

/* Writes this daemon posted (source side), by cookie: one per write to a peer (whose
 * cookies travel and must be unique), one per group's batch within this host (every
 * write of the batch carries the cookie; `pending` of them have not completed). */
typedef struct OutWrite {
        uint64_t cookie;
        HandoffObject *obj;
        uint32_t group;
        size_t pending;
        bool stage;   /* a GPU → staging copy (CUDA transport) of a remote handoff */
        int error;    /* stage: the first error of its writes */
} OutWrite;

/* A pinned host buffer that GPU pages are staged through on their way to another host. */
struct HandoffStaging {
        TransportRegion region;  /* MEMORY_HOST; id HANDOFF_STAGING_REGION_BASE + slot */
        uint32_t slot;
        bool busy;
        bool in_cuda, in_peer;   /* registered with the CUDA / the peer transport */
        bool in_rdma;            /* ... and the rdma one, where there is one */
};

/* A write a peer is landing here (destination side), by (peer, cookie). */
typedef struct InKey {
        Peer *peer;
        uint64_t cookie;
} InKey;

typedef struct InWrite {
        InKey key;
        HandoffObject *obj;
        uint32_t group;
        uint64_t length;
} InWrite;

/* A worker's ring pair. */
typedef struct ClientRing {
        ClientObject object;
        HandoffManager *hm;
        uint64_t serial;
        Ring *ring;
        sd_event_source *source;
} ClientRing;

/* Handoffs in flight towards one peer (source side): from Prepare until every group is
 * transferred, or the handoff ends. Bounded by the backpressure window
 * (backpressure_window_admit); one per peer ever used, freed at shutdown. */
typedef struct PeerWindow {
        char host[PEER_HOST_ID_MAX + 1]; /* key: the peer's host id */
        char *name;                      /* the peer's name in telemetry */
        unsigned handoffs;
        uint64_t bytes;
} PeerWindow;

#define COOKIE_GROUP_BITS 10

static bool isempty_str(const char *s) {
        return !s || !s[0];
}

static const char *strna(const char *s) {
        return s ? s : "n/a";
}
_Static_assert((1U << COOKIE_GROUP_BITS) >= HANDOFF_GROUPS_MAX, "cookie group bits");

static void after_event(HandoffObject *o);
static void obj_free(HandoffObject *o);

/* The request's trace (daemon/telemetry/telemetry.h): every step of a handoff under its request id. */
static void trace(HandoffObject *o, TraceEventType type, const TraceDetail *d) {
        TraceDetail x = d ? *d : (TraceDetail){};
        if (!x.transport && o->peer) {
                Transport *t = peer_manager_transport_for(o->hm->manager->peers, o->peer);
                x.transport = t ? t->ops->name : "tcp";
        }
        x.transport = x.transport ?: (o->gpu ? "cuda" : "local");
        x.peer = x.peer ?: (o->peer_host[0] ? o->peer_host : NULL);
        (void)telemetry_trace(o->hm->manager, o->request_str, type, &x);
}

/* The CUDA transport, where the GPU domain is on. */
static Transport *gpu_transport(HandoffManager *hm) {
        return hm->manager->gpu ? hm->manager->gpu->transport : NULL;
}

static Manager *obj_manager(HandoffObject *o) {
        return o->hm->manager;
}

static uint64_t client_serial(const Client *c) {
        return c ? c->serial : 0;
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

static void count_failure(HandoffManager *hm, HandoffCause c) {
        if (c > HANDOFF_CAUSE_NONE && c < _HANDOFF_CAUSE_MAX)
                hm->counters.failures[c]++;
}

/* Local handoffs have two objects; the counters count a handoff once (its source). */
static bool counts(const HandoffObject *o) {
        return !o->twin || o->h->role == HANDOFF_SOURCE;
}

/* ---- notifications to the owning worker: ring first, D-Bus as fallback ---- */

static ClientRing *owner_ring(HandoffObject *o) {
        if (!o->owned)
                return NULL;
        uint64_t serial = client_serial(o->object.owner);
        return hashmap_get(o->hm->rings, &serial);
}

static void notify_progress(HandoffObject *o, uint32_t done) {
        Handoff *h = o->h;
        ClientRing *cr = owner_ring(o);
        if (cr) {
                struct epd_ring_record rec;
                ring_record_group_progress(&rec, h->request_id.bytes, h->token, done, h->n_groups,
                                           o->bytes_moved);
                int r = ring_post(cr->ring, &rec);
                if (r >= 0) {
                        (void)ring_kick(cr->ring);
                        return;
                }
                o->hm->counters.ring_fallbacks++;
                (void)ring_kick(cr->ring);
        }
        bus_handoff_emit_progress(o, done);
}

static void notify_state(HandoffObject *o) {
        Handoff *h = o->h;
        ClientRing *cr = owner_ring(o);
        if (cr) {
                struct epd_ring_record rec;
                ring_record_handoff_state(&rec, h->request_id.bytes, h->token, h->state, h->cause);
                if (ring_post(cr->ring, &rec) < 0)
                        o->hm->counters.ring_fallbacks++;
                (void)ring_kick(cr->ring);
        }
        /* State changes are rare: always on the bus too. */
        bus_handoff_emit_state(o);
}

/* ---- the backpressure window per peer ---- */

static PeerWindow *window_get(HandoffManager *hm, Peer *peer, bool create) {
        const char *host = peer_host_id(peer);
        PeerWindow *w = hashmap_get(hm->windows, host);
        if (w || !create)
                return w;
        w = calloc(1, sizeof *w);
        if (!w)
                return NULL;
        snprintf(w->host, sizeof w->host, "%s", host);
        w->name = strdup(peer_name(peer) ?: host);
        if (!w->name || hashmap_put(hm->windows, w->host, w) < 0) {
                free(w->name);
                free(w);
                return NULL;
        }
        return w;
}

static void window_publish(HandoffManager *hm, PeerWindow *w) {
        /* The daemon's own load, folded into the path's level (HandoffsElevated/High). */
        (void)telemetry_peer_load(hm->manager, w->name, w->handoffs, 0, 0);
}

static void window_leave(HandoffObject *o) {
        if (!o->windowed)
                return;
        o->windowed = false;
        PeerWindow *w = hashmap_get(o->hm->windows, o->peer_host);
        if (!w)
                return;
        assert(w->handoffs > 0 && w->bytes >= o->window_bytes);
        w->handoffs--;
        w->bytes -= o->window_bytes;
        window_publish(o->hm, w);
}

void handoff_manager_window(HandoffManager *hm, const char *peer, unsigned *ret_handoffs, uint64_t *ret_bytes) {
        PeerWindow *w = hm && peer ? hashmap_get(hm->windows, peer) : NULL;
        if (ret_handoffs)
                *ret_handoffs = w ? w->handoffs : 0;
        if (ret_bytes)
                *ret_bytes = w ? w->bytes : 0;
}

/* The host id of the peer telemetry calls `name` (peers are named in the config by
 * their section; handoffs, and so workers, use host ids). */
static const char *peer_host_of_name(Manager *m, const char *name) {
        for (size_t i = 0; i < peer_manager_n_peers(m->peers); i++) {
                Peer *p = peer_manager_peer(m->peers, i);
                if (p && peer_name(p) && strcmp(peer_name(p), name) == 0)
                        return peer_host_id(p);
        }
        return name;
}

/* A peer path's backpressure level changed (a telemetry subscription): posts an
 * EPD_RING_EV_BACKPRESSURE record to every worker's ring. */
static void on_backpressure(Telemetry *t, const char *peer, BackpressureLevel level,
                            BackpressureReason reason, void *userdata) {
        HandoffManager *hm = userdata;
        if (!hm || !peer)
                return;
        Manager *m = hm->manager;
        const char *host = peer_host_of_name(m, peer);
        unsigned n = 0, permille = 0;
        uint64_t bytes = 0;
        usec_t retry = 0;
        handoff_manager_window(hm, host, &n, &bytes);
        (void)backpressure_window_admit(&m->config.telemetry.backpressure, level, reason, n, bytes, 0, &retry,
                                        &permille);
        if (level == BACKPRESSURE_NONE)
                retry = 0;

        struct epd_ring_record rec;
        ring_record_backpressure(&rec, host, level, reason, permille, retry);
        ClientRing *cr;
        size_t it = 0;
        while (hashmap_iterate(hm->rings, &it, (void **)&cr, NULL)) {
                if (ring_post(cr->ring, &rec) < 0)
                        hm->counters.ring_fallbacks++; /* the D-Bus signal carries it too */
                (void)ring_kick(cr->ring);
        }
}

/* ---- messages to the peer ---- */

static void send_message(HandoffObject *o, HandoffMessage *m) {
        _cleanup_(freep) uint8_t *buf = NULL;
        size_t len;
        if (!o->peer)
                return;
        m->request_id = o->h->request_id;
        m->token = o->h->token;
        int r = handoff_message_encode(m, &buf, &len);
        if (r >= 0)
                r = peer_send(o->peer, m->type, buf, len);
        if (r < 0)
                log_debug_errno(r, "handoff %s: cannot send %s to %s: %m", o->request_str,
                                handoff_message_type_to_string(m->type), o->peer_host);
}

/* ---- staging buffers (GPU pages to another host) ---- */

static void staging_free(HandoffManager *hm, HandoffStaging *st) {
        Manager *m = hm->manager;
        Transport *t;
        if (!st)
                return;
        if (st->in_peer && (t = peer_manager_transport(m->peers)))
                t->ops->unregister_region(t, &st->region);
        if (st->in_rdma && (t = peer_manager_rdma(m->peers)))
                t->ops->unregister_region(t, &st->region);
        if (st->in_cuda && (t = gpu_transport(hm)))
                t->ops->unregister_region(t, &st->region); /* unpins */
        if (st->region.host_base) {
                (void)munmap(st->region.host_base, st->region.size);
                hm->staging_bytes -= st->region.size;
        }
        hm->staging[st->slot] = NULL;
        free(st);
}

/* An idle buffer of at least `size` bytes, or a new one (pinned and registered with
 * both transports), within HANDOFF_STAGING_BYTES_MAX in all: idle buffers go to make
 * room. -ENOSPC when busy ones fill it. */
static int staging_acquire(HandoffManager *hm, uint64_t size, HandoffStaging **ret) {
        Manager *m = hm->manager;
        HandoffStaging *best = NULL;
        uint32_t slot = HANDOFF_STAGING_MAX;
        int r;

        size = ALIGN_TO(size, (uint64_t)(2U << 20));
        if (size == 0 || size > HANDOFF_STAGING_BYTES_MAX)
                return -ENOSPC;
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX; i++) {
                HandoffStaging *st = hm->staging[i];
                if (st && !st->busy && st->region.size >= size && (!best || st->region.size < best->region.size))
                        best = st;
        }
        if (best) {
                best->busy = true;
                *ret = best;
                return 0;
        }
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX && hm->staging_bytes + size > HANDOFF_STAGING_BYTES_MAX; i++)
                if (hm->staging[i] && !hm->staging[i]->busy)
                        staging_free(hm, hm->staging[i]);
        if (hm->staging_bytes + size > HANDOFF_STAGING_BYTES_MAX)
                return -ENOSPC;
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX && slot == HANDOFF_STAGING_MAX; i++)
                if (!hm->staging[i])
                        slot = i;
        if (slot == HANDOFF_STAGING_MAX)
                return -ENOSPC;

        HandoffStaging *st = calloc(1, sizeof *st);
        if (!st)
                return -ENOMEM;
        st->slot = slot;
        hm->staging[slot] = st;
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
                r = -errno;
                staging_free(hm, st);
                return r;
        }
        st->region = (TransportRegion) { .id = HANDOFF_STAGING_REGION_BASE + slot, .domain = MEMORY_HOST,
                                         .host_base = p, .size = size };
        hm->staging_bytes += size;
        Transport *gt = gpu_transport(hm), *nt = peer_manager_transport(m->peers);
        r = gt && nt ? 0 : -ENOTCONN;
        if (r >= 0)
                r = gt->ops->register_region(gt, &st->region);
        if (r >= 0) {
                st->in_cuda = true;
                r = nt->ops->register_region(nt, &st->region);
        }
        /* GPU pages to a peer on RDMA go through this pinned host buffer too (the
         * registration is an ibv_reg_mr on each open device). */
        Transport *rt = peer_manager_rdma(m->peers);
        if (r >= 0 && rt) {
                st->in_peer = true;
                r = rt->ops->register_region(rt, &st->region);
                if (r >= 0)
                        st->in_rdma = true;
        }
        if (r < 0) {
                log_warning_errno(r, "handoff: cannot set up a staging buffer of %" PRIu64 " bytes: %m", size);
                staging_free(hm, st);
                return r;
        }
        st->in_peer = true;
        st->busy = true;
        log_debug("handoff: staging buffer %u of %" PRIu64 " bytes (%" PRIu64 " in all)", slot, size,
                  hm->staging_bytes);
        *ret = st;
        return 0;
}

/* ---- the WAL: every transition is appended before it is acknowledged ---- */

static int journal_record(HandoffManager *hm, const HandoffRecord *r, const uint32_t *pages) {
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
        if (k < 0)
                log_debug_errno(k, "handoff: journal record 0x%02x does not apply: %m", r->type);
        return 0;
}

static HandoffRecord record_of(HandoffObject *o, uint8_t type) {
        return (HandoffRecord){
                .type = type,
                .request_id = o->h->request_id,
                .token = o->h->token,
                .role = o->h->role,
        };
}

/* The journal's entry for this very attempt, or NULL. */
static HandoffJournalEntry *journal_entry(HandoffObject *o) {
        HandoffJournalEntry *e = handoff_journal_get(&o->hm->journal, &o->h->request_id, o->h->role);
        return e && e->token == o->h->token ? e : NULL;
}

static int journal_prepared(HandoffObject *o) {
        HandoffRecord r = record_of(o, HANDOFF_REC_PREPARED);
        r.value = o->h->n_groups;
        r.arena = o->arena;
        r.n_pages = o->n_pages;
        r.page_size = o->page_size;
        return journal_record(o->hm, &r, o->pages);
}

static void journal_warn(HandoffObject *o, int r, const char *what) {
        if (r < 0)
                log_warning_errno(r, "handoff %s (%s): cannot journal %s: %m", o->request_str,
                                  handoff_role_to_string(o->h->role), what);
}

static void journal_groups(HandoffObject *o, uint32_t done) {
        HandoffJournalEntry *e = journal_entry(o);
        if (!e || e->state != HANDOFF_PREPARED || done <= e->groups_done)
                return;
        HandoffRecord r = record_of(o, HANDOFF_REC_GROUPS);
        r.value = done;
        journal_warn(o, journal_record(o->hm, &r, NULL), "group progress");
}

static void journal_released(HandoffObject *o) {
        if (!journal_entry(o))
                return;
        HandoffRecord r = record_of(o, HANDOFF_REC_RELEASED);
        journal_warn(o, journal_record(o->hm, &r, NULL), "the release");
}

/* A state change seen by after_event(), before anyone is told of it. */
static void journal_state(HandoffObject *o) {
        Handoff *h = o->h;
        HandoffJournalEntry *e = journal_entry(o);
        HandoffRecord r;

        switch (h->state) {
        case HANDOFF_PREPARED:
        case HANDOFF_TRANSFERRING:
        case HANDOFF_TRANSFERRED:
                /* A remote destination answered the source's Prepare. */
                if (!e)
                        journal_warn(o, journal_prepared(o), "Prepare");
                break;
        case HANDOFF_COMMITTED:
                if (e && e->state == HANDOFF_PREPARED) {
                        r = record_of(o, HANDOFF_REC_COMMITTED);
                        journal_warn(o, journal_record(o->hm, &r, NULL), "the commit");
                }
                break;
        case HANDOFF_ROLLED_BACK:
                if (e && e->state == HANDOFF_PREPARED) {
                        r = record_of(o, HANDOFF_REC_ROLLED_BACK);
                        r.cause = h->cause;
                        journal_warn(o, journal_record(o->hm, &r, NULL), "the rollback");
                }
                break;
        case HANDOFF_RELEASED:
                journal_released(o);
                break;
        default:
                break;
        }
}

static int handoff_manager_apply_record(Manager *m, uint16_t type, const void *payload, size_t len) {
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
                if (r == -EBADMSG)
                        return r;
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
        log_info("handoff %s (%s): in flight at the last stop: rolled back, %" PRIu32 " of %" PRIu32
                 " groups had arrived; its pages are free.",
                 epd_id_to_string(&e->request_id, id), handoff_role_to_string(e->role), e->groups_done, e->n_groups);
}

static int on_journal_grace(sd_event_source *s, uint64_t usec, void *userdata) {
        HandoffManager *hm = userdata;
        HandoffJournalEntry *e;
        unsigned n = 0;
        for (bool again = true; again;) {
                size_t it = 0;
                again = false;
                while (handoff_journal_iterate(&hm->journal, &it, &e)) {
                        if (!e->recovered)
                                continue;
                        HandoffRecord r = { .type = HANDOFF_REC_RELEASED, .request_id = e->request_id,
                                            .token = e->token, .role = e->role };
                        (void)journal_record(hm, &r, NULL); /* removes e */
                        if (handoff_journal_get(&hm->journal, &r.request_id, r.role) == e) {
                                (void)hashmap_remove(hm->journal.entries, e->key);
                                free(e->pages);
                                free(e);
                        }
                        n++;
                        again = true;
                        break;
                }
        }
        hm->journal_grace = sd_event_source_disable_unref(hm->journal_grace);
        if (n > 0)
                log_info("handoff: %u journal entries of before the restart released.", n);
        return 0;
}

static int handoff_manager_restore_finish(Manager *m) {
        HandoffManager *hm = m->handoffs;
        if (!hm)
                return 0;
        unsigned n = handoff_journal_recover(&hm->journal, recovered_rolled_back, hm);
        size_t total = handoff_journal_size(&hm->journal);
        if (total == 0)
                return 0;
        log_info("handoff: %zu journaled handoff sides restored (%u in flight, rolled back).", total, n);
        int r = sd_event_add_time_relative(m->event, &hm->journal_grace, CLOCK_MONOTONIC,
                                           PAGE_MANAGER_ATTACH_GRACE_USEC, USEC_PER_SEC, on_journal_grace, hm);
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

static int handoff_manager_snapshot(Manager *m, int (*add)(void *userdata, uint16_t type, const void *rec, size_t len),
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

/* ---- pages ---- */

static void obj_drop_pages(HandoffObject *o) {
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
        after_event(o);
}

static int obj_link(HandoffObject *o, Client *c) {
        int r = client_object_link(c, &o->object, CLIENT_OBJECT_HANDOFF, release_client_object);
        if (r < 0)
                return r;
        o->owned = true;
        return 0;
}

static Hashmap *request_map(HandoffManager *hm, HandoffRole role) {
        return role == HANDOFF_SOURCE ? hm->sources : hm->destinations;
}

static void obj_free(HandoffObject *o) {
        if (!o)
                return;
        HandoffManager *hm = o->hm;
        window_leave(o);
        /* Gone is released, also on the error paths of Prepare. */
        journal_released(o);
        obj_drop_pages(o);
        obj_unown(o);
        if (o->in_request_map && hashmap_get(request_map(hm, o->h->role), o->h->request_id.bytes) == o)
                (void)hashmap_remove(request_map(hm, o->h->role), o->h->request_id.bytes);
        (void)hashmap_remove(hm->by_handle, o->handle_str);
        if (o->twin)
                o->twin->twin = NULL;
        if (o->waiter) {
                HandoffPrepareWaiter *w = TAKE_PTR(o->waiter);
                w->done(w, NULL, -EIO, "Handoff ended.");
        }
        sd_event_source_disable_unref(o->timer);
        if (o->staging)
                o->staging->busy = false; /* no write of it is in flight (handoff_can_free) */
        for (uint32_t g = 0; o->net && g < o->h->n_groups; g++)
                free(o->net[g]);
        free(o->net);
        free(o->n_net);
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
        if (handoff_check_timeout(o->h, now_usec(CLOCK_MONOTONIC)) > 0)
                log_info("handoff %s (%s): timed out", o->request_str, handoff_role_to_string(o->h->role));
        after_event(o);
        return 0;
}

static int obj_new(HandoffManager *hm, HandoffRole role, const EpdId *request_id, uint64_t token,
                   uint32_t n_groups, const uint64_t *bytes_per_group, usec_t timeout,
                   HandoffObject **ret) {
        Manager *m = hm->manager;
        if (hashmap_size(hm->by_handle) >= HANDOFF_MANAGER_MAX)
                return -EDQUOT;

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
                obj_free(o);
                return r;
        }
        /* A newer attempt for the same request replaces the older one in the request
         * map; the older stays reachable by its handle until released. */
        Hashmap *map = request_map(hm, role);
        void *old = NULL;
        r = hashmap_replace(map, o->h->request_id.bytes, o, &old);
        if (r < 0) {
                obj_free(o);
                return r;
        }
        if (old)
                ((HandoffObject *)old)->in_request_map = false;
        o->in_request_map = true;
        *ret = o;
        return 0;
}

/* ---- the central step: after any event, tell who needs to know and free what can go ---- */

static void on_progress(HandoffObject *o, uint32_t from, uint32_t to) {
        Handoff *h = o->h;
        if (h->role == HANDOFF_SOURCE) {
                if (counts(o))
                        o->hm->counters.groups += to - from;
                for (uint32_t g = from; g < to; g++) {
                        trace(o, TRACE_GROUP_SENT,
                              &(TraceDetail){ .has_group = true, .group = (int32_t)g,
                                              .bytes = h->groups[g].bytes_done });
                        if (o->twin) {
                                (void)handoff_group_sent_notice(o->twin->h, g, h->groups[g].bytes_expected);
                        } else {
                                HandoffMessage msg = {
                                        .type = HANDOFF_MSG_GROUP_SENT,
                                        .group = g,
                                        .bytes = h->groups[g].bytes_done,
                                };
                                send_message(o, &msg);
                        }
                }
                if (o->twin)
                        after_event(o->twin);
        } else
                for (uint32_t g = from; g < to; g++)
                        trace(o, TRACE_GROUP_RECEIVED,
                              &(TraceDetail){ .has_group = true, .group = (int32_t)g,
                                              .bytes = h->groups[g].bytes_done });
        notify_progress(o, to);
}

/* The destination answered the source's Prepare (pages reserved, or refused, or the
 * peer is gone): the caller waiting for Prepare hears of it. */
static void prepare_answered(HandoffObject *o) {
        HandoffPrepareWaiter *w = TAKE_PTR(o->waiter);
        if (!w)
                return;
        if (!handoff_is_ended(o->h)) {
                w->done(w, o, 0, NULL); /* journal_state() appended the PREPARED record */
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
                r = -EIO;
                break;
        }
        Reason why;
        (void)reason_set(&why, r, "Handoff %s: the destination did not reserve pages (%s).", o->request_str,
                         handoff_cause_to_string(o->h->cause));
        w->done(w, NULL, r, why.text);
        /* The caller never learnt the handoff's path: it goes now. */
        (void)handoff_release(o->h);
        obj_unown(o);
}

static void on_state(HandoffObject *o, HandoffState old) {
        Handoff *h = o->h;
        HandoffManager *hm = o->hm;
        bool was_live = old != HANDOFF_COMMITTED && old != HANDOFF_ROLLED_BACK && old != HANDOFF_RELEASED;

        /* The destination answered (pages reserved, or refused, or the peer is gone). */
        if (o->waiter && h->state != HANDOFF_PREPARING)
                prepare_answered(o);

        if (handoff_is_ended(h) && was_live && h->cause != HANDOFF_CAUSE_NONE) {
                if (counts(o)) {
                        hm->counters.rolled_back++;
                        count_failure(hm, h->cause);
                }
                log_info("handoff %s (%s): rolled back: %s%s", o->request_str, handoff_role_to_string(h->role),
                         handoff_cause_to_string(h->cause), h->remote_rolled_back ? " (other side)" : "");
                trace(o, TRACE_ROLLBACK, &(TraceDetail){ .detail = handoff_cause_to_string(h->cause) });
                if (!h->remote_rolled_back) {
                        if (o->twin) {
                                HandoffObject *t = o->twin;
                                (void)handoff_rollback(t->h, h->cause, true);
                                after_event(t);
                        } else {
                                HandoffMessage msg = { .type = HANDOFF_MSG_ROLLBACK, .cause = h->cause };
                                send_message(o, &msg);
                        }
                }
        }
        if (h->state == HANDOFF_COMMITTED && old != HANDOFF_COMMITTED)
                trace(o, TRACE_COMMIT, &(TraceDetail){ .detail = handoff_role_to_string(h->role) });
        if (h->state == HANDOFF_RELEASED && old != HANDOFF_RELEASED)
                trace(o, TRACE_RELEASE, &(TraceDetail){ .detail = handoff_role_to_string(h->role) });
        if (h->state == HANDOFF_RELEASED && counts(o))
                hm->counters.released++;
        notify_state(o);
}

static void after_event(HandoffObject *o) {
        Handoff *h = o->h;
        uint32_t from, to;

        if (handoff_take_progress(h, &from, &to) > 0) {
                journal_groups(o, to);
                on_progress(o, from, to);
        }
        if (h->state != o->notified_state) {
                HandoffState old = o->notified_state;
                journal_state(o);
                o->notified_state = h->state;
                on_state(o, old);
        }
        /* Out of the peer's window once every byte is across (or it ended). */
        if (o->windowed && (handoff_is_ended(h) || h->state >= HANDOFF_TRANSFERRED))
                window_leave(o);
        if (o->holds_pages && h->inflight == 0 &&
            (handoff_is_ended(h) || h->state == HANDOFF_COMMITTED))
                obj_drop_pages(o);
        if (handoff_can_free(h) && (h->state == HANDOFF_RELEASED || !o->owned))
                obj_free(o);
}

/* ---- shipping groups (source) ---- */

typedef struct PlanCtx {
        HandoffObject *o;
        uint32_t group;
        TransportWrite *w;
        size_t n, cap;
} PlanCtx;

static int plan_collect(const HandoffSlice *s, void *userdata) {
        PlanCtx *c = userdata;
        if (c->n == c->cap) {
                size_t cap = c->cap ? c->cap * 2 : 64;
                TransportWrite *p = reallocarray(c->w, cap, sizeof *p);
                if (!p)
                        return -ENOMEM;
                c->w = p;
                c->cap = cap;
        }
        c->w[c->n++] = (TransportWrite) {
                .src_region = c->o->arena,
                .src_offset = s->src_offset,
                .dst_region = c->o->dst_region,
                .dst_offset = s->dst_offset,
                .length = s->length,
        };
        return 0;
}

/* A remote handoff of GPU pages, group g: the group's bytes of every page are copied
 * into the staging buffer (page i at i × page_size, one batch on the CUDA transport);
 * once that batch completed, stage_landed() posts the peer writes planned here, from
 * the staging buffer to the destination's pages. The group counts both kinds of write;
 * the staging copies count no bytes. */
static int post_group_staged(HandoffObject *o, uint32_t g) {
        HandoffManager *hm = o->hm;
        Transport *gt = gpu_transport(hm);
        uint32_t stage_id = o->staging->region.id;
        int r;

        if (!gt || !o->peer)
                return -ENOTCONN;
        _cleanup_(freep) uint64_t *src = calloc(o->n_pages, sizeof *src);
        _cleanup_(freep) uint64_t *mid = calloc(o->n_pages, sizeof *mid);
        if (!src || !mid)
                return -ENOMEM;
        for (uint32_t i = 0; i < o->n_pages; i++) {
                src[i] = page_offset(o->pool, o->pages[i]);
                mid[i] = (uint64_t)i * o->page_size;
        }
        PlanCtx a = { .o = o, .group = g }, b = { .o = o, .group = g };
        r = handoff_plan_group(&o->layouts[g], src, mid, o->n_pages, 0, plan_collect, &a);
        if (r >= 0)
                r = handoff_plan_group(&o->layouts[g], mid, o->dst_offsets, o->n_pages, hm->slice_size,
                                       plan_collect, &b);
        if (r >= 0 && (a.n == 0 || b.n == 0))
                r = -EINVAL;
        OutWrite *ow = r >= 0 ? malloc(sizeof *ow) : NULL;
        if (r >= 0 && !ow)
                r = -ENOMEM;
        if (r >= 0) {
                *ow = (OutWrite) { .cookie = (++hm->next_cookie << COOKIE_GROUP_BITS) | g, .obj = o, .group = g,
                                   .pending = a.n, .stage = true };
                r = hashmap_put(hm->writes, &ow->cookie, ow);
                if (r < 0)
                        free(ow);
        }
        if (r >= 0) {
                for (size_t k = 0; k < a.n; k++) {
                        a.w[k].dst_region = stage_id;
                        a.w[k].cookie = ow->cookie;
                }
                for (size_t k = 0; k < b.n; k++)
                        b.w[k].src_region = stage_id;
                r = gt->ops->post(gt, NULL, a.w, a.n);
                if (r < 0)
                        free(hashmap_remove(hm->writes, &ow->cookie));
        }
        free(a.w);
        if (r < 0) {
                free(b.w);
                return r;
        }
        o->net[g] = b.w;
        o->n_net[g] = b.n;
        (void)handoff_group_posted(o->h, g, (uint32_t)(a.n + b.n));
        hm->counters.batches++;
        return 0;
}

/* Group g is in the staging buffer (or failed to get there): its peer writes go now,
 * or complete at once with the error, so that the group's count of writes in flight
 * comes down either way. */
static void stage_landed(HandoffObject *o, uint32_t g, int error) {
        HandoffManager *hm = o->hm;
        Transport *nt = peer_manager_transport_for(hm->manager->peers, o->peer);
        TransportWrite *w = o->net ? o->net[g] : NULL;
        size_t n = o->n_net ? o->n_net[g] : 0, i = 0;
        int r = error;

        if (!w)
                return;
        o->net[g] = NULL;
        if (r >= 0 && (!handoff_is_live(o->h) || !o->peer || !nt))
                r = -ECANCELED;
        OutWrite **ow = r >= 0 ? calloc(n, sizeof *ow) : NULL;
        if (r >= 0 && !ow)
                r = -ENOMEM;
        for (i = 0; r >= 0 && i < n; i++) {
                ow[i] = malloc(sizeof(OutWrite));
                if (!ow[i]) {
                        r = -ENOMEM;
                        break;
                }
                *ow[i] = (OutWrite) { .cookie = (++hm->next_cookie << COOKIE_GROUP_BITS) | g, .obj = o, .group = g,
                                      .pending = 1 };
                w[i].cookie = ow[i]->cookie;
                r = hashmap_put(hm->writes, &ow[i]->cookie, ow[i]);
                if (r < 0) {
                        free(ow[i]);
                        break;
                }
        }
        if (r >= 0)
                r = nt->ops->post(nt, o->peer, w, n);
        if (r < 0) {
                for (size_t k = 0; k < i; k++)
                        free(hashmap_remove(hm->writes, &ow[k]->cookie));
                if (r != -ECANCELED)
                        log_warning_errno(r, "handoff %s: cannot send staged group %" PRIu32 ": %m", o->request_str, g);
                for (size_t k = 0; k < n; k++)
                        (void)handoff_write_done(o->h, g, 0, r);
        }
        free(ow);
        free(w);
}

static int post_group(HandoffObject *o, uint32_t g) {
        HandoffManager *hm = o->hm;
        Handoff *h = o->h;
        int r;

        if (o->staging)
                return post_group_staged(o, g);

        if (o->zero_copy) {
                r = handoff_group_posted(h, g, 0);
                if (r >= 0 && o->twin)
                        r = handoff_group_handed_over(o->twin->h, g);
                if (r >= 0)
                        hm->counters.zero_copy_groups++;
                return r;
        }

        Transport *t = o->peer ? peer_manager_transport_for(obj_manager(o)->peers, o->peer)
                     : o->gpu ? gpu_transport(hm)
                              : hm->local;
        if (!t)
                return -ENOTCONN;

        _cleanup_(freep) uint64_t *src = calloc(o->n_pages, sizeof *src);
        if (!src)
                return -ENOMEM;
        for (uint32_t i = 0; i < o->n_pages; i++)
                src[i] = page_offset(o->pool, o->pages[i]);
        PlanCtx c = { .o = o, .group = g };
        /* The CUDA transport takes runs whole (slices only cut a copy-engine operation
         * into several, each costing microseconds). */
        r = handoff_plan_group(&o->layouts[g], src, o->dst_offsets, o->n_pages, o->gpu ? 0 : hm->slice_size,
                               plan_collect, &c);
        if (r < 0) {
                free(c.w);
                return r;
        }
        /* Within this host, the whole batch shares one cookie. */
        size_t n_out = o->peer ? c.n : MIN(c.n, (size_t)1);
        OutWrite **ow = calloc(MAX(n_out, (size_t)1), sizeof *ow);
        if (!ow) {
                free(c.w);
                return -ENOMEM;
        }
        size_t i;
        r = 0;
        for (i = 0; i < n_out; i++) {
                ow[i] = malloc(sizeof(OutWrite));
                if (!ow[i]) {
                        r = -ENOMEM;
                        break;
                }
                *ow[i] = (OutWrite) {
                        .cookie = (++hm->next_cookie << COOKIE_GROUP_BITS) | g,
                        .obj = o,
                        .group = g,
                        .pending = o->peer ? 1 : c.n,
                };
                r = hashmap_put(hm->writes, &ow[i]->cookie, ow[i]);
                if (r < 0) {
                        free(ow[i]);
                        break;
                }
        }
        for (size_t k = 0; r >= 0 && k < c.n; k++)
                c.w[k].cookie = ow[o->peer ? k : 0]->cookie;
        if (r >= 0)
                r = t->ops->post(t, o->peer, c.w, c.n);
        if (r < 0) {
                for (size_t k = 0; k < i; k++) {
                        (void)hashmap_remove(hm->writes, &ow[k]->cookie);
                        free(ow[k]);
                }
                free(ow);
                free(c.w);
                return r;
        }
        free(ow);
        free(c.w);
        (void)handoff_group_posted(h, g, (uint32_t)c.n);
        if (o->twin)
                for (size_t k = 0; k < c.n; k++)
                        (void)handoff_write_landing(o->twin->h, g);
        hm->counters.batches++;
        return 0;
}

static void pump(HandoffObject *o) {
        uint32_t g;
        while (handoff_next_to_post(o->h, &g) == 0) {
                int r = post_group(o, g);
                if (r < 0) {
                        log_warning_errno(r, "handoff %s: cannot ship group %" PRIu32 ": %m", o->request_str, g);
                        (void)handoff_rollback(o->h, HANDOFF_CAUSE_TRANSFER_FAILED, false);
                        break;
                }
        }
}

static void on_completions(HandoffManager *hm, Transport *t) {
        TransportCompletion c[256];
        size_t n;
        while ((n = t->ops->poll(t, c, ELEMENTSOF(c))) > 0)
                for (size_t i = 0; i < n; i++) {
                        OutWrite *w = hashmap_get(hm->writes, &c[i].cookie);
                        if (!w) {
                                log_debug("handoff: completion of unknown write %" PRIu64, c[i].cookie);
                                continue;
                        }
                        HandoffObject *o = w->obj;
                        uint32_t g = w->group;
                        if (w->stage) {
                                /* Into the staging buffer: no bytes moved yet. */
                                if (c[i].error < 0 && w->error == 0)
                                        w->error = c[i].error;
                                (void)handoff_write_done(o->h, g, 0, c[i].error);
                                if (--w->pending == 0) {
                                        int err = w->error;
                                        free(hashmap_remove(hm->writes, &c[i].cookie));
                                        stage_landed(o, g, err);
                                }
                                after_event(o);
                                continue;
                        }
                        if (--w->pending == 0)
                                free(hashmap_remove(hm->writes, &c[i].cookie));
                        uint64_t bytes = c[i].error < 0 ? 0 : c[i].bytes;
                        (void)handoff_write_done(o->h, g, bytes, c[i].error);
                        if (o->twin) {
                                (void)handoff_write_landed(o->twin->h, g, bytes, c[i].error);
                                o->twin->bytes_moved += bytes;
                        }
                        o->bytes_moved += bytes;
                        hm->counters.bytes += bytes;
                        if (c[i].error < 0)
                                log_debug("handoff %s: write of group %" PRIu32 " failed: %s", o->request_str, g,
                                          strerror(-c[i].error));
                        if (o->twin)
                                after_event(o->twin);
                        after_event(o);
                }
}

static int on_local_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        HandoffManager *hm = userdata;
        on_completions(hm, hm->local);
        return 0;
}

static int on_gpu_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        HandoffManager *hm = userdata;
        Transport *t = gpu_transport(hm);
        if (t)
                on_completions(hm, t);
        return 0;
}

static int on_peer_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        HandoffManager *hm = userdata;
        Transport *t = peer_manager_transport(hm->manager->peers);
        if (t)
                on_completions(hm, t);
        return 0;
}

static int on_rdma_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        HandoffManager *hm = userdata;
        Transport *t = peer_manager_rdma(hm->manager->peers);
        if (t)
                on_completions(hm, t);
        return 0;
}

/* ---- destination: reserving pages ---- */

/* A KV arena with pages of page_size that `target` (if any) maps. Prefers `prefer`.
 * Bytes from another host land in host arenas only (the peer transports write into
 * the daemon's mapping); within this host, GPU arenas too (the CUDA transport). */
static Arena *pick_arena(Manager *m, uint64_t page_size, const Worker *target, Arena *prefer, bool host_only) {
        if (prefer && prefer->pages && page_pool_page_size(prefer->pages) == page_size &&
            (!host_only || prefer->domain == MEMORY_HOST) &&
            (!target || (target->arena_mask & (UINT64_C(1) << prefer->index))))
                return prefer;
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (a->usage != ARENA_USAGE_KV || !a->pages || page_pool_page_size(a->pages) != page_size)
                        continue;
                if (host_only && a->domain != MEMORY_HOST)
                        continue;
                if (a->domain == MEMORY_GPU && !m->gpu)
                        continue;
                if (target && !(target->arena_mask & (UINT64_C(1) << a->index)))
                        continue;
                return a;
        }
        return NULL;
}

/* Allocates, leases and indexes the destination's pages. */
static int dest_reserve(HandoffObject *d, Arena *a, uint32_t n_pages) {
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
                        return r; /* obj_free drops what was put */
        }
        return 0;
}

/* ---- source: Prepare ---- */

static int parse_request_id(const char *s, EpdId *ret, Reason *why) {
        if (epd_id_from_string(s, ret) < 0 || epd_id_is_null(ret))
                return reason_set(why, -EINVAL,
                                     "Request id '%s' is not a non-zero 128-bit id in 32 hex digits.", s);
        return 0;
}

static uint64_t layout_hash(const KvLayout *l) {
        uint64_t h = 1469598103934665603ULL;
        uint64_t v[5] = { l->layers, l->tokens_per_block, l->k_bytes_per_token_per_layer,
                          l->v_bytes_per_token_per_layer, l->page_size };
        for (size_t i = 0; i < ELEMENTSOF(v); i++)
                for (int b = 0; b < 8; b++) {
                        h ^= (v[i] >> (8 * b)) & 0xff;
                        h *= 1099511628211ULL;
                }
        return h;
}

static Worker *find_worker(Manager *m, const char *path_or_id) {
        const char *p = strrchr(path_or_id, '/');
        return manager_get_worker(m, p ? p + 1 : path_or_id);
}

static int prepare_error(Reason *why, int r, const char *what) {
        switch (r) {
        case -ENOSPC:
                return reason_set(why, -ENOSPC, "%s: the destination has no room for the pages.", what);
        case -EDQUOT:
                return reason_set(why, -EDQUOT, "%s: too many handoffs.", what);
        case -EPERM:
                return reason_set(why, -EPERM, "%s: the sequence is not yours.", what);
        case -ENOENT:
                return reason_set(why, -ENOENT, "%s: no such sequence.", what);
        case -EINVAL:
                return reason_set(why, -EINVAL, "%s: invalid argument.", what);
        default:
                return r;
        }
}

/* What Prepare resolved from its arguments before anything is allocated. */
typedef struct PrepareCtx {
        Worker *worker;
        Client *client;
        EpdId rid;
        Sequence *sequence;
        bool local;
        Peer *peer;              /* remote: the destination's daemon */
        Worker *target;
        uint32_t n_groups;
        HandoffGroupLayout *layouts;
        uint64_t *bytes;         /* per group */
        uint64_t total_bytes;
        Arena *src_arena, *dst_arena;
        bool gpu;
        PeerWindow *window;      /* remote */
        usec_t timeout;
} PrepareCtx;

static void prepare_ctx_done(PrepareCtx *x) {
        free(x->layouts);
        free(x->bytes);
}

/* The arguments, the caller's sequence, the destination and the target worker. */
static int prepare_check(HandoffManager *hm, const HandoffPrepareArgs *a, PrepareCtx *x, Reason *why) {
        Manager *m = hm->manager;
        Worker *w = x->worker;
        int r;

        r = parse_request_id(a->request_id, &x->rid, why);
        if (r < 0)
                return r;
        if (!w->layout)
                return reason_set(why, -EINVAL,
                                  "Worker %s registered no KV layout: there are no layer groups to ship.", w->id_str);
        if (!m->page_manager)
                return reason_set(why, -EOPNOTSUPP, "No page manager.");
        r = page_manager_lookup(m->page_manager, x->client, a->sequence, SEQUENCE_ACCESS_OWNER, &x->sequence);
        if (r < 0)
                return prepare_error(why, r, "Prepare");
        if (x->sequence->n_pages == 0 || x->sequence->n_pages > HANDOFF_PAGES_MAX)
                return reason_set(why, -EINVAL, "The sequence has %zu pages; a handoff moves 1 to %u.",
                                  x->sequence->n_pages, HANDOFF_PAGES_MAX);
        if (a->n_groups == 0 || a->n_groups > HANDOFF_GROUPS_MAX)
                return reason_set(why, -EINVAL, "Between 1 and %u layer groups.", HANDOFF_GROUPS_MAX);
        uint64_t layers = 0;
        for (size_t g = 0; g < a->n_groups; g++) {
                if (a->layer_groups[g] == 0)
                        return reason_set(why, -EINVAL, "Layer group %zu is empty.", g);
                layers += a->layer_groups[g];
        }
        if (layers != w->layout->layers)
                return reason_set(why, -EINVAL, "The layer groups hold %" PRIu64 " layers; the model has %" PRIu32 ".",
                                  layers, w->layout->layers);
        x->n_groups = (uint32_t)a->n_groups;

        x->local = isempty_str(a->destination) || strcmp(a->destination, m->config.host_id) == 0;
        if (!x->local) {
                if (!m->peers || !(x->peer = peer_manager_find(m->peers, a->destination)))
                        return reason_set(why, -ENOENT, "No peer with host id '%s'.", a->destination);
                if (!peer_is_up(x->peer))
                        return reason_set(why, -EHOSTUNREACH, "Peer '%s' is %s.", a->destination,
                                          peer_state_to_string(peer_state(x->peer)));
        }
        if (a->target && a->target[0] && !(x->target = find_worker(m, a->target)))
                return reason_set(why, -ENOENT, "No worker '%s'.", a->target);
        if (x->target && !x->local)
                return reason_set(why, -EINVAL, "A target worker names a local worker.");
        return 0;
}

/* Each group's byte range within a page, from the model's KV layout, and the arenas. */
static int prepare_layout(HandoffManager *hm, const HandoffPrepareArgs *a, PrepareCtx *x, Reason *why) {
        Manager *m = hm->manager;
        const KvLayout *l = x->worker->layout;

        x->layouts = calloc(x->n_groups, sizeof *x->layouts);
        x->bytes = calloc(x->n_groups, sizeof *x->bytes);
        if (!x->layouts || !x->bytes)
                return -ENOMEM;
        uint32_t first = 0;
        for (uint32_t g = 0; g < x->n_groups; g++) {
                uint64_t off, len;
                if (kv_layout_group_range(l, first, a->layer_groups[g], &off, &len) < 0)
                        return reason_set(why, -EINVAL, "Layer group %u does not fit the layout.", g);
                x->layouts[g].n_ranges = 1;
                x->layouts[g].ranges[0] = (HandoffRange) { .offset = off, .length = len };
                x->bytes[g] = len * x->sequence->n_pages;
                x->total_bytes += x->bytes[g];
                first += a->layer_groups[g];
        }

        x->src_arena = page_manager_sequence_arena(m->page_manager, x->sequence);
        if (!x->src_arena)
                return reason_set(why, -ENOENT, "The sequence's arena is gone.");
        if (x->src_arena->domain == MEMORY_GPU && !m->gpu)
                return reason_set(why, -EOPNOTSUPP, "The GPU domain is off.");
        if (x->local) {
                Arena *want = x->src_arena;
                if (a->arena && a->arena[0] && !(want = manager_find_arena(m, a->arena)))
                        return reason_set(why, -ENOENT, "No arena named '%s'.", a->arena);
                x->dst_arena = pick_arena(m, l->page_size, x->target, want, false);
                if (!x->dst_arena || (a->arena && a->arena[0] && x->dst_arena != want))
                        return reason_set(why, -EINVAL, "No KV arena with pages of %" PRIu64 " bytes%s.", l->page_size,
                                          x->target ? " that the target worker maps" : "");
                /* Within this host, a copy that touches GPU memory goes through the CUDA transport. */
                x->gpu = x->dst_arena != x->src_arena &&
                         (x->src_arena->domain == MEMORY_GPU || x->dst_arena->domain == MEMORY_GPU);
        }
        return 0;
}

/* A congested path takes new work slowly, not into an unbounded queue: the peer's
 * window (docs/telemetry.md, "The handoff window"). */
static int prepare_admit(HandoffManager *hm, const HandoffPrepareArgs *a, PrepareCtx *x, Reason *why) {
        Manager *m = hm->manager;
        PeerWindow *win = window_get(hm, x->peer, true);
        TelemetryPeerStats st;
        usec_t retry;

        if (!win)
                return -ENOMEM;
        x->window = win;
        if (telemetry_peer_stats(m, win->name, &st) < 0)
                st = (TelemetryPeerStats){ .level = BACKPRESSURE_NONE, .reason = BACKPRESSURE_REASON_NONE };
        BackpressureLevel level = st.level;
        int r = backpressure_window_admit(&m->config.telemetry.backpressure, level, st.reason, win->handoffs,
                                          win->bytes, x->total_bytes, &retry, NULL);
        if (r != -EAGAIN)
                return 0;
        const char *reason = backpressure_reason_to_string(st.reason);
        hm->counters.deferred++;
        (void)telemetry_trace(m, a->request_id, TRACE_HANDOFF_PREPARE,
                              &(TraceDetail){ .peer = a->destination, .detail = "deferred: backpressure" });
        log_debug("handoff %s: deferred: peer %s at %s (%s), %u handoffs / %" PRIu64 " bytes in flight", a->request_id,
                  a->destination, backpressure_level_to_string(level), reason, win->handoffs, win->bytes);
        if (backpressure_window_closed(level, st.reason))
                return reason_set(why, -EAGAIN, "Peer '%s' is backpressured (%s: %s); retry_after_usec=%" PRIu64,
                                  a->destination, backpressure_level_to_string(level), reason, retry);
        return reason_set(why, -EAGAIN,
                          "Peer '%s': the handoff window is full (%s: %u handoffs, %" PRIu64
                          " bytes in flight); retry_after_usec=%" PRIu64,
                          a->destination, backpressure_level_to_string(level), win->handoffs, win->bytes, retry);
}

/* The source side: a new attempt's object, leasing every page of the sequence. */
static int prepare_source(HandoffManager *hm, PrepareCtx *x, HandoffObject **ret, Reason *why) {
        HandoffObject *o;
        int r;

        hm->last_token = handoff_next_token(hm->last_token, now_usec(CLOCK_REALTIME));
        r = obj_new(hm, HANDOFF_SOURCE, &x->rid, hm->last_token, x->n_groups, x->bytes, x->timeout, &o);
        if (r < 0)
                return prepare_error(why, r, "Prepare");
        o->layouts = TAKE_PTR(x->layouts);
        o->page_size = x->worker->layout->page_size;
        o->arena = x->src_arena->index;
        o->gpu = x->gpu;
        o->pool = x->sequence->pool;
        o->n_pages = (uint32_t)x->sequence->n_pages;
        o->pages = calloc(o->n_pages, sizeof *o->pages);
        if (x->target)
                o->target_worker = x->target->id;
        r = o->pages ? sequence_lease(x->sequence, 0, o->n_pages, o->pages) : -ENOMEM;
        if (r >= 0) {
                o->holds_pages = true;
                r = obj_link(o, x->client);
        }
        if (r < 0) {
                obj_free(o);
                return prepare_error(why, r, "Prepare");
        }
        *ret = o;
        return 0;
}

/* Within this host: the destination side is a twin object over the same or another
 * arena of this daemon; both are prepared and journaled now. */
static int prepare_local(HandoffManager *hm, PrepareCtx *x, HandoffObject *o, Reason *why) {
        HandoffObject *d;
        int r = obj_new(hm, HANDOFF_DESTINATION, &x->rid, o->h->token, x->n_groups, x->bytes, x->timeout, &d);
        if (r >= 0) {
                d->layouts = calloc(x->n_groups, sizeof *d->layouts);
                if (d->layouts)
                        memcpy(d->layouts, o->layouts, x->n_groups * sizeof *d->layouts);
                d->page_size = o->page_size;
                d->target_worker = o->target_worker;
                d->twin = o;
                d->gpu = x->gpu;
                o->twin = d;
                if (x->dst_arena == x->src_arena) {
                        /* Same arena: the pages themselves are handed over. */
                        o->zero_copy = d->zero_copy = true;
                        d->arena = o->arena;
                        d->pool = o->pool;
                        d->n_pages = o->n_pages;
                        d->pages = calloc(d->n_pages, sizeof *d->pages);
                        if (d->pages)
                                memcpy(d->pages, o->pages, d->n_pages * sizeof *d->pages);
                        else
                                r = -ENOMEM;
                } else
                        r = dest_reserve(d, x->dst_arena, o->n_pages);
                if (r >= 0 && !d->layouts)
                        r = -ENOMEM;
                if (r >= 0 && !o->zero_copy) {
                        o->dst_region = d->arena;
                        o->dst_offsets = calloc(o->n_pages, sizeof *o->dst_offsets);
                        if (!o->dst_offsets)
                                r = -ENOMEM;
                        for (uint32_t i = 0; r >= 0 && i < o->n_pages; i++)
                                o->dst_offsets[i] = page_offset(d->pool, d->pages[i]);
                }
                if (r < 0)
                        obj_free(d);
        }
        if (r < 0) {
                if (r == -ENOSPC) {
                        hm->counters.refused++;
                        count_failure(hm, HANDOFF_CAUSE_NO_SPACE);
                }
                obj_free(o);
                return prepare_error(why, r, "Prepare");
        }
        (void)handoff_prepared(o->h);
        o->notified_state = o->h->state;
        r = journal_prepared(o);
        if (r >= 0)
                r = journal_prepared(d);
        if (r < 0) {
                log_warning_errno(r, "handoff %s: cannot journal Prepare: %m", o->request_str);
                obj_free(d); /* journals the release of what was journaled */
                obj_free(o);
                return prepare_error(why, r, "Prepare");
        }
        hm->counters.prepared++;
        log_debug("handoff %s: prepared locally (%s, %u pages, %u groups)", o->request_str,
                  o->zero_copy ? "same arena" : "copy", o->n_pages, x->n_groups);
        return HANDOFF_PREPARED_NOW;
}

/* To another host: GPU pages go through a pinned host staging buffer (the peer
 * transport sends from host memory); then the destination is asked, and the answer
 * to Prepare waits for its. */
static int prepare_remote(HandoffManager *hm, const HandoffPrepareArgs *a, PrepareCtx *x, HandoffObject *o,
                          HandoffPrepareWaiter *waiter, Reason *why) {
        uint32_t n_groups = x->n_groups;
        int r;

        if (x->src_arena->domain == MEMORY_GPU) {
                o->net = calloc(n_groups, sizeof *o->net);
                o->n_net = calloc(n_groups, sizeof *o->n_net);
                r = o->net && o->n_net ? staging_acquire(hm, (uint64_t)o->n_pages * o->page_size, &o->staging)
                                       : -ENOMEM;
                if (r < 0) {
                        obj_free(o);
                        if (r == -ENOSPC)
                                return reason_set(why, -ENOSPC,
                                                  "No room for staging %" PRIu64 " bytes of GPU pages to '%s'.",
                                                  (uint64_t)x->sequence->n_pages * x->worker->layout->page_size,
                                                  a->destination);
                        return reason_set(why, -EIO, "Cannot stage GPU pages to '%s': %s", a->destination,
                                          strerror(-r));
                }
        }

        o->peer = x->peer;
        snprintf(o->peer_host, sizeof o->peer_host, "%s", a->destination);
        _cleanup_(freep) uint32_t *gr = calloc(n_groups + 1, sizeof *gr);
        _cleanup_(freep) HandoffRange *ranges = calloc(n_groups, sizeof *ranges);
        if (!gr || !ranges) {
                obj_free(o);
                return -ENOMEM;
        }
        for (uint32_t g = 0; g < n_groups; g++) {
                gr[g] = g;
                ranges[g] = o->layouts[g].ranges[0];
        }
        gr[n_groups] = n_groups;
        HandoffMessage pm = {
                .type = HANDOFF_MSG_PREPARE,
                .request_id = x->rid,
                .token = o->h->token,
                .timeout_usec = x->timeout,
                .page_size = o->page_size,
                .layout_hash = layout_hash(x->worker->layout),
                .n_pages = o->n_pages,
                .n_groups = n_groups,
                .group_ranges = gr,
                .ranges = ranges,
                .n_ranges = n_groups,
        };
        _cleanup_(freep) uint8_t *buf = NULL;
        size_t len;
        r = handoff_message_encode(&pm, &buf, &len);
        if (r >= 0)
                r = peer_send(x->peer, HANDOFF_MSG_PREPARE, buf, len);
        if (r < 0) {
                obj_free(o);
                return reason_set(why, -EHOSTUNREACH, "Cannot reach peer '%s': %s", a->destination, strerror(-r));
        }
        o->waiter = waiter;
        o->windowed = true;
        o->window_bytes = x->total_bytes;
        x->window->handoffs++;
        x->window->bytes += x->total_bytes;
        window_publish(hm, x->window);
        hm->counters.prepared++;
        return HANDOFF_PREPARE_PENDING;
}

int handoff_manager_prepare(HandoffManager *hm, Worker *w, const HandoffPrepareArgs *a,
                            HandoffPrepareWaiter *waiter, HandoffObject **ret, Reason *why) {
        Manager *m = hm->manager;
        _cleanup_(prepare_ctx_done) PrepareCtx x = { .worker = w, .client = w->object.owner };
        HandoffObject *o;
        int r;

        r = prepare_check(hm, a, &x, why);
        if (r < 0)
                return r;

        /* Idempotence: the same request, still live, from the same client. */
        HandoffObject *old = hashmap_get(hm->sources, x.rid.bytes);
        if (old && handoff_is_live(old->h)) {
                if (!handoff_object_owned_by(old, x.client))
                        return reason_set(why, -EEXIST, "Request %s has a handoff of another client.", a->request_id);
                if (old->waiter)
                        return reason_set(why, -EBUSY, "Request %s: Prepare is in progress.", a->request_id);
                *ret = old;
                return HANDOFF_PREPARED_ALREADY;
        }

        r = prepare_layout(hm, a, &x, why);
        if (r >= 0 && !x.local)
                r = prepare_admit(hm, a, &x, why);
        if (r < 0)
                return r;
        x.timeout = a->timeout_usec ? a->timeout_usec : m->config.handoff_timeout_usec;
        r = prepare_source(hm, &x, &o, why);
        if (r < 0)
                return r;
        r = x.local ? prepare_local(hm, &x, o, why) : prepare_remote(hm, a, &x, o, waiter, why);
        if (r >= 0)
                *ret = o;
        return r;
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
        send_message(d, &ok);
        free(ok.page_offsets);
}

static void on_remote_prepare(HandoffManager *hm, Peer *p, HandoffMessage *in) {
        Manager *m = hm->manager;
        HandoffObject *old = hashmap_get(hm->destinations, in->request_id.bytes);
        if (old && old->peer == p) {
                if (old->h->token == in->token) {
                        if (handoff_is_live(old->h))
                                send_prepare_ok(old); /* a repeat: same answer */
                        return;
                }
                if (old->h->token > in->token) {
                        refuse(p, in, HANDOFF_CAUSE_REFUSED, -ESTALE);
                        return;
                }
                /* A newer attempt fences the older one off. */
                (void)handoff_rollback(old->h, HANDOFF_CAUSE_REMOTE, true);
                after_event(old);
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
        Arena *a = pick_arena(m, in->page_size, NULL, NULL, true);
        usec_t timeout = in->timeout_usec ? MIN(in->timeout_usec, m->config.handoff_timeout_usec)
                                          : m->config.handoff_timeout_usec;
        HandoffObject *d = NULL;
        int r = a ? obj_new(hm, HANDOFF_DESTINATION, &in->request_id, in->token, in->n_groups, bytes, timeout, &d)
                  : -EINVAL;
        free(bytes);
        if (r >= 0) {
                d->layouts = layouts;
                layouts = NULL;
                d->peer = p;
                snprintf(d->peer_host, sizeof d->peer_host, "%s", peer_host_id(p));
                d->page_size = in->page_size;
                d->target_worker = in->target_worker;
                r = dest_reserve(d, a, in->n_pages);
                if (r >= 0)
                        r = journal_prepared(d); /* before PREPARE_OK acknowledges it */
                if (r < 0) {
                        obj_free(d);
                        d = NULL;
                }
        }
        free(layouts);
        if (r < 0) {
                HandoffCause cause = r == -ENOSPC ? HANDOFF_CAUSE_NO_SPACE : HANDOFF_CAUSE_REFUSED;
                hm->counters.refused++;
                count_failure(hm, cause);
                log_info("handoff %s from %s: refused: %s", epd_id_to_string(&in->request_id, (char[EPD_ID_STRING_MAX]) {}),
                         peer_host_id(p), a ? strerror(-r) : "no host KV arena with this page size");
                refuse(p, in, cause, r == -ENOSPC ? -ENOSPC : (r < 0 ? r : -EINVAL));
                return;
        }
        hm->counters.prepared++;
        send_prepare_ok(d);
}

static HandoffObject *find_for_message(HandoffManager *hm, Peer *p, HandoffRole role, const HandoffMessage *in) {
        HandoffObject *o = hashmap_get(request_map(hm, role), in->request_id.bytes);
        if (!o || o->peer != p || o->h->token != in->token)
                return NULL; /* unknown, another peer's, or an older attempt: fenced off */
        return o;
}

/* The peer callbacks get the Manager, not the HandoffManager: at shutdown this subsystem
 * stops before the peer manager does, which may still call them. */
static int on_peer_message(Peer *p, uint16_t type, const void *payload, size_t len, void *userdata) {
        HandoffManager *hm = ((Manager *)userdata)->handoffs;
        HandoffMessage in;
        HandoffObject *o;
        if (!hm)
                return 0;
        int r = handoff_message_decode(type, payload, len, &in);
        if (r < 0)
                return log_debug_errno(r, "handoff: bad %s message from %s: %m",
                                       strna(handoff_message_type_to_string(type)), peer_host_id(p));

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
                        after_event(o);
                        break;
                }
                o->dst_region = in.region;
                o->dst_offsets = TAKE_PTR(in.page_offsets);
                (void)handoff_prepared(o->h);
                pump(o);
                after_event(o);
                break;

        case HANDOFF_MSG_PREPARE_REFUSED:
                o = find_for_message(hm, p, HANDOFF_SOURCE, &in);
                if (!o)
                        break;
                (void)handoff_rollback(o->h, in.cause, true);
                after_event(o);
                break;

        case HANDOFF_MSG_GROUP_SENT:
                o = find_for_message(hm, p, HANDOFF_DESTINATION, &in);
                if (!o)
                        break;
                if (in.group >= o->h->n_groups || handoff_group_sent_notice(o->h, in.group, in.bytes) == -EINVAL)
                        (void)handoff_rollback(o->h, HANDOFF_CAUSE_PROTOCOL, false);
                after_event(o);
                break;

        case HANDOFF_MSG_COMMIT:
                o = find_for_message(hm, p, HANDOFF_SOURCE, &in);
                if (!o)
                        break;
                if (handoff_commit(o->h, 0) == 1 && counts(o))
                        hm->counters.committed++;
                after_event(o);
                break;

        case HANDOFF_MSG_ROLLBACK:
                o = find_for_message(hm, p, HANDOFF_SOURCE, &in);
                if (!o)
                        o = find_for_message(hm, p, HANDOFF_DESTINATION, &in);
                if (!o)
                        break;
                (void)handoff_rollback(o->h, in.cause, true);
                after_event(o);
                break;
        }
        handoff_message_done(&in);
        return 0;
}

static void on_peer_state(Peer *p, bool up, void *userdata) {
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
                after_event(v[i]);
        free(v);
}

static int on_incoming_validate(Peer *p, uint32_t region, uint64_t offset, uint64_t length, uint64_t cookie,
                                void *userdata) {
        Manager *m = userdata;
        HandoffManager *hm = m->handoffs;
        if (!hm)
                return -ESHUTDOWN;
        if (region >= m->n_arenas || !m->arenas[region]->pages)
                return -ENOENT;
        Arena *a = m->arenas[region];
        uint64_t ps = page_pool_page_size(a->pages);
        if (offset < a->data_offset)
                return -ERANGE;
        uint64_t page = (offset - a->data_offset) / ps;
        uint64_t key = ((uint64_t)region << 32) | page;
        HandoffObject *d = page < UINT32_MAX ? hashmap_get(hm->dest_pages, &key) : NULL;
        uint32_t g = (uint32_t)(cookie & ((1U << COOKIE_GROUP_BITS) - 1));
        if (!d || d->peer != p)
                return -EACCES;
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
        int r = hashmap_put(hm->incoming, &w->key, w);
        if (r < 0) {
                free(w);
                return r; /* -EEXIST: a cookie in flight twice */
        }
        (void)handoff_write_landing(d->h, g);
        return 0;
}

static void on_incoming_done(Peer *p, uint64_t cookie, int error, void *userdata) {
        HandoffManager *hm = ((Manager *)userdata)->handoffs;
        if (!hm)
                return;
        InKey key = { .peer = p, .cookie = cookie };
        InWrite *w = hashmap_remove(hm->incoming, &key);
        if (!w)
                return;
        HandoffObject *d = w->obj;
        uint64_t bytes = error < 0 ? 0 : w->length;
        (void)handoff_write_landed(d->h, w->group, bytes, error);
        d->bytes_moved += bytes;
        hm->counters.bytes += bytes;
        free(w);
        after_event(d);
}

/* ---- decode side: Accept, Commit ---- */

int handoff_manager_accept(HandoffManager *hm, Client *c, const char *request_id, HandoffObject **ret,
                           Reason *why) {
        Manager *m = hm->manager;
        EpdId rid;
        int r = parse_request_id(request_id, &rid, why);
        if (r < 0)
                return r;
        Worker *w = client_get_worker(c);
        if (!w)
                return reason_set(why, -ENOTCONN, "Register as a worker first.");
        HandoffObject *d = hashmap_get(hm->destinations, rid.bytes);
        if (!d)
                return reason_set(why, -ENOENT, "No handoff for request %s here.", request_id);
        if (!epd_id_is_null(&d->target_worker) && !epd_id_equal(&d->target_worker, &w->id))
                return reason_set(why, -EPERM, "Handoff %s is meant for another worker.",
                                     request_id);
        if (!(w->arena_mask & (UINT64_C(1) << d->arena)))
                return reason_set(why, -EPERM,
                                     "Handoff %s lands in arena '%s', which worker %s did not map.", request_id,
                                     m->arenas[d->arena]->name, w->id_str);
        r = handoff_accept(d->h, client_serial(c));
        if (r == -ESTALE)
                return reason_set(why, -ESTALE, "Handoff %s was rolled back (%s).", request_id,
                                     handoff_cause_to_string(d->h->cause));
        if (r == -EPERM)
                return reason_set(why, -EBUSY, "Handoff %s was accepted by another client.", request_id);
        if (r < 0)
                return r;
        if (r > 0) {
                r = obj_link(d, c);
                if (r < 0) {
                        d->h->accepted_by = 0;
                        return reason_set(why, -EDQUOT, "Too many objects for this client.");
                }
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
        if (h->state == HANDOFF_COMMITTED && h->accepted_by == client_serial(c)) {
                *ret_sequence = o->sequence_path ? o->sequence_path : "/";
                return 0;
        }
        if (handoff_is_ended(h))
                return reason_set(why, -ESTALE, "Handoff %s was rolled back (%s).", o->request_str,
                                     handoff_cause_to_string(h->cause));
        if (h->state != HANDOFF_TRANSFERRED)
                return reason_set(why, -EBUSY, "Handoff %s: %" PRIu32 " of %" PRIu32 " layer groups arrived.",
                                     o->request_str, h->n_done, h->n_groups);

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
        HandoffRecord rec = record_of(o, HANDOFF_REC_COMMITTED);
        r = page_manager_sequence_record(s, &put, &put_len);
        if (r >= 0) {
                rec.extra = put;
                rec.extra_len = put_len;
                r = journal_entry(o) ? journal_record(hm, &rec, NULL) : 0;
        }
        if (r < 0) {
                log_warning_errno(r, "handoff %s: cannot journal the commit: %m", o->request_str);
                page_manager_release(s);
                return r;
        }
        r = handoff_commit(h, client_serial(c));
        if (r < 0) { /* cannot happen after the checks above */
                page_manager_release(s);
                return r;
        }
        free(o->sequence_path);
        o->sequence_path = strdup(s->path);
        if (counts(o))
                hm->counters.committed++;
        /* The sequence holds the pages now. */
        if (h->inflight == 0)
                obj_drop_pages(o);
        if (o->twin) {
                HandoffObject *t = o->twin;
                if (handoff_commit(t->h, 0) > 0 && counts(t))
                        hm->counters.committed++;
                after_event(t);
        } else {
                HandoffMessage msg = { .type = HANDOFF_MSG_COMMIT };
                send_message(o, &msg);
        }
        *ret_sequence = o->sequence_path ? o->sequence_path : s->path;
        after_event(o);
        return 0;
}

int handoff_manager_group_ready(HandoffObject *o, uint32_t group, Reason *why) {
        int r = handoff_group_ready(o->h, group);
        if (r == -EPERM)
                return reason_set(why, -EINVAL, "LayerGroupReady is the prefill side's.");
        if (r == -ESTALE)
                return reason_set(why, -ESTALE, "Handoff %s was rolled back (%s).", o->request_str,
                                     handoff_cause_to_string(o->h->cause));
        if (r < 0)
                return reason_set(why, -EINVAL,
                                     "Layer group %" PRIu32 " is out of order or range (next: %" PRIu32 " of %" PRIu32 ").",
                                     group, o->h->n_ready, o->h->n_groups);
        if (r > 0)
                pump(o);
        after_event(o);
        return 0;
}

int handoff_manager_rollback(HandoffObject *o, Reason *why) {
        int r = handoff_rollback(o->h, HANDOFF_CAUSE_REQUESTED, false);
        if (r == -EALREADY)
                return reason_set(why, -EBUSY, "Handoff %s is committed.", o->request_str);
        if (r < 0)
                return reason_set(why, -ESTALE, "Handoff %s was released.", o->request_str);
        after_event(o);
        return 0;
}

void handoff_manager_release(HandoffObject *o) {
        (void)handoff_release(o->h);
        obj_unown(o);
        after_event(o);
}

/* ---- rings ---- */

static void ring_free_object(ClientRing *cr) {
        if (!cr)
                return;
        log_debug("handoff: ring of client %" PRIu64 " closed", cr->serial);
        (void)hashmap_remove(cr->hm->rings, &cr->serial);
        if (cr->object.owner)
                client_object_unlink(&cr->object);
        sd_event_source_disable_unref(cr->source);
        ring_free(cr->ring);
        free(cr);
}

static void release_ring(ClientObject *co) {
        ring_free_object(container_of(co, ClientRing, object));
}

static int on_ring_submit(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        ClientRing *cr = userdata;
        HandoffManager *hm = cr->hm;
        struct epd_ring_record rec, out;
        int r;

        (void)ring_drain_submit(cr->ring);
        for (unsigned budget = 0; budget < 4096; budget++) {
                r = ring_consume(cr->ring, &rec);
                if (r == -EAGAIN)
                        break;
                if (r < 0) {
                        log_warning("handoff: client %" PRIu64 " corrupted its ring; closing it.", cr->serial);
                        ring_free_object(cr);
                        return 0;
                }
                r = ring_record_validate_submission(&rec);
                if (r >= 0 && rec.opcode == EPD_RING_OP_LAYER_GROUP_READY) {
                        HandoffObject *o = hashmap_get(hm->sources, rec.request_id);
                        if (!o || o->h->token != rec.token || !o->owned ||
                            client_serial(o->object.owner) != cr->serial)
                                r = -ENOENT;
                        else {
                                r = handoff_group_ready(o->h, rec.group);
                                if (r > 0)
                                        pump(o);
                                after_event(o);
                        }
                }
                if (r < 0 || rec.opcode == EPD_RING_OP_NOP || (rec.flags & EPD_RING_F_ACK)) {
                        ring_record_completion(&out, rec.user_data, r < 0 ? r : 0);
                        if (ring_post(cr->ring, &out) < 0)
                                hm->counters.ring_fallbacks++;
                }
        }
        (void)ring_kick(cr->ring);
        return 0;
}

int handoff_manager_open_ring(HandoffManager *hm, Client *c, uint32_t sq, uint32_t cq, Ring **ret,
                              Reason *why) {
        uint64_t serial = client_serial(c);
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
        int r = ring_new(sq, cq, &cr->ring);
        if (r >= 0)
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
                ring_free_object(cr);
                if (r == -EDQUOT)
                        return reason_set(why, -EDQUOT, "Too many objects for this client.");
                return r;
        }
        *ret = cr->ring;
        return 0;
}

/* ---- counters ---- */

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
        PUT("ring-fallbacks", c->ring_fallbacks);
        PUT("live", hashmap_size(hm->by_handle));
        PUT("writes-in-flight", hashmap_size(hm->writes) + hashmap_size(hm->incoming));
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
        int r = peer_manager_register_handler(m->peers, HANDOFF_MSG_FIRST, HANDOFF_MSG_LAST, on_peer_message, m);
        if (r >= 0)
                r = peer_manager_add_state_handler(m->peers, on_peer_state, m);
        Transport *t = peer_manager_transport(m->peers);
        if (r >= 0 && t && t->ops->completion_fd(t) >= 0)
                r = sd_event_add_io(m->event, &hm->peer_source, t->ops->completion_fd(t), EPOLLIN, on_peer_completion, hm);
        t = peer_manager_rdma(m->peers);
        if (r >= 0 && t && t->ops->completion_fd(t) >= 0)
                r = sd_event_add_io(m->event, &hm->rdma_source, t->ops->completion_fd(t), EPOLLIN, on_rdma_completion, hm);
        if (r < 0)
                return log_error_errno(r, "handoff: cannot hook into the peer manager: %m");
        peer_manager_set_incoming_validator(m->peers, on_incoming_validate, m);
        peer_manager_set_incoming_done(m->peers, on_incoming_done, m);
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
        hm->windows = hashmap_new(HASHMAP_KEY_STRING, 0);
        m->handoffs = hm;
        if (handoff_journal_init(&hm->journal) < 0)
                return -ENOMEM;
        if (!hm->by_handle || !hm->sources || !hm->destinations || !hm->writes || !hm->incoming ||
            !hm->dest_pages || !hm->rings || !hm->windows)
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
                            on_local_completion, hm);
        if (r < 0)
                return r;
        /* The GPU domain's copies (its subsystem starts first and registered every arena
         * with the CUDA transport). */
        Transport *gt = gpu_transport(hm);
        if (gt) {
                r = sd_event_add_io(m->event, &hm->gpu_source, gt->ops->completion_fd(gt), EPOLLIN,
                                    on_gpu_completion, hm);
                if (r < 0)
                        return log_error_errno(r, "handoff: cannot watch the CUDA transport: %m");
        }
        /* Workers that use the ring hear of backpressure there, without the bus (the
         * telemetry subsystem starts first). */
        if (m->telemetry) {
                r = telemetry_add_backpressure_handler(m->telemetry, on_backpressure, hm);
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
        telemetry_remove_backpressure_handler(m->telemetry, on_backpressure, hm);
        HandoffObject *o;
        ClientRing *cr;
        size_t it;
        if (m->peers && hm->peer_attached) {
                /* No more incoming writes into pages that are about to go. */
                peer_manager_set_incoming_validator(m->peers, NULL, NULL);
                peer_manager_set_incoming_done(m->peers, NULL, NULL);
        }
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
        Transport *gt = gpu_transport(hm);
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
                obj_free(o);
        }
        while ((it = 0, hm->rings && hashmap_iterate(hm->rings, &it, (void **)&cr, NULL)))
                ring_free_object(cr);
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX; i++)
                staging_free(hm, hm->staging[i]);
        void *v;
        while ((it = 0, hm->writes && hashmap_iterate(hm->writes, &it, &v, NULL)))
                free(hashmap_remove(hm->writes, &((OutWrite *)v)->cookie));
        while ((it = 0, hm->incoming && hashmap_iterate(hm->incoming, &it, &v, NULL)))
                free(hashmap_remove(hm->incoming, &((InWrite *)v)->key));
        sd_event_source_disable_unref(hm->local_source);
        sd_event_source_disable_unref(hm->peer_source);
        sd_event_source_disable_unref(hm->rdma_source);
        sd_event_source_disable_unref(hm->gpu_source);
        sd_event_source_disable_unref(hm->attach);
        sd_event_source_disable_unref(hm->journal_grace);
        handoff_journal_done(&hm->journal);
        hashmap_free(hm->by_handle);
        hashmap_free(hm->sources);
        hashmap_free(hm->destinations);
        hashmap_free(hm->writes);
        hashmap_free(hm->incoming);
        hashmap_free(hm->dest_pages);
        hashmap_free(hm->rings);
        while ((it = 0, hm->windows && hashmap_iterate(hm->windows, &it, &v, NULL))) {
                PeerWindow *w = hashmap_remove(hm->windows, ((PeerWindow *)v)->host);
                free(w->name);
                free(w);
        }
        hashmap_free(hm->windows);
        free(hm);
        m->handoffs = NULL;
}

const Subsystem handoff_subsystem = {
        .name = "handoff",
        .init = handoff_init,
        .done = handoff_done,
        .add_bus = bus_handoff_add,
        .journal_families = (const uint8_t[]){ WAL_RECORD_HANDOFF >> 8, 0 },
        .apply_record = handoff_manager_apply_record,
        .restore_finish = handoff_manager_restore_finish,
        .snapshot = handoff_manager_snapshot,
};
