/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* HandoffManager: the handoff subsystem of epdd. It drives one Handoff state machine
 * (handoff.h) per side of every handoff this daemon takes part in, owns the pages and
 * leases a handoff holds, moves the bytes of each layer group as soon as the prefill
 * worker reports it ready (within this host the local transport, or the CUDA transport
 * when a GPU arena is on either side; to another host rdma once the peer's queue pairs
 * are connected (peer_manager_transport_for), tcp otherwise, GPU pages staged through
 * pinned host memory either way), speaks the handoff messages of the peer protocol
 * (handoff-proto.h), and
 * serves the workers' ring pairs (ring.h). The bus glue is bus-handoff.c; the manager
 * is handoff-manager.c with handoff-source.c, handoff-dest.c, handoff-journal.c,
 * handoff-stage.c, handoff-window.c and handoff-ring.c beside it.
 *
 * Page ownership, the rule that no page is freed while a write into it can land:
 *   source       leases every page of the prefill sequence at Prepare; the leases end
 *                when the handoff is committed or ended AND no write of it is in flight.
 *   destination  allocates its pages at Prepare (one reference + one lease each, held
 *                by the handoff); Commit builds the decode sequence over them (its own
 *                references) and then drops the handoff's; a rollback drops them once
 *                no incoming write is in flight (the incoming validator admits no new
 *                write into an ended handoff).
 *   same arena   (local handoff, destination arena = source arena): no page is
 *                allocated and no byte moves; Commit gives the decode sequence
 *                references to the source pages. */

#include <stdbool.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "core/client.h"
#include "core/manager.h"
#include "handoff/handoff-record.h"
#include "handoff/handoff.h"
#include "handoff/ring.h"
#include "hashmap.h"
#include "histogram.h"
#include "id.h"
#include "pages/pages.h"
#include "peer/peer-proto.h"
#include "reason.h"
#include "telemetry/backpressure.h"
#include "transport/transport.h"

#define HANDOFF_PATH "/org/epd1/handoffs"
#define HANDOFF_PATH_PREFIX "/org/epd1/handoff"
#define HANDOFF_MANAGER_MAX 65536U      /* handoff objects in the daemon */
#define HANDOFF_SLICE_DEFAULT (4U << 20) /* bytes per write */
/* GPU pages to another host go through pinned host staging memory (one buffer per
 * handoff, its region registered with the CUDA and the peer transport, ids from
 * HANDOFF_STAGING_REGION_BASE), at most this many bytes of it at a time. */
#define HANDOFF_STAGING_REGION_BASE 768U
#define HANDOFF_STAGING_MAX 256U
#define HANDOFF_STAGING_BYTES_MAX (8ULL << 30)

/* What the handoffs of one (peer, transport) did: "local" for handoffs within this
 * host, the peer's host id otherwise; the transport that moved the bytes ("zero-copy",
 * "local", "cuda", "tcp", "rdma"). A handoff counts on the side that prepared it (out)
 * and, between hosts, also on the side that accepted it (in). For the bus
 * (Handoffs.Paths), epdtop and the metrics. */
typedef struct HandoffPath {
        char peer[64];
        char transport[16];
        uint64_t handoffs_out, handoffs_in;  /* committed */
        uint64_t failed;                     /* rolled back, either side */
        uint64_t bytes_out, bytes_in;
        Histogram duration;                  /* Prepare to Commit, on the source */
} HandoffPath;
#define HANDOFF_PATHS_MAX 1024U

typedef struct HandoffManager HandoffManager;
typedef struct HandoffObject HandoffObject;
typedef struct HandoffStaging HandoffStaging;
typedef struct Peer Peer;

/* A caller waiting for the answer to a Prepare that asked another host (the bus
 * layer's, which keeps what it needs to reply beside it): done() is called once, with
 * the handoff (error 0), or with a negative errno and why it failed (o NULL). */
typedef struct HandoffPrepareWaiter HandoffPrepareWaiter;
struct HandoffPrepareWaiter {
        void (*done)(HandoffPrepareWaiter *w, HandoffObject *o, int error, const char *why);
};

/* A pipelined handoff's slot at the destination: (peer, slot) -> HandoffObject. */
typedef struct SlotKey {
        Peer *peer;
        uint64_t slot;
} SlotKey;

struct HandoffObject {
        HandoffManager *hm;
        Handoff *h;
        EpdId handle;
        char handle_str[EPD_ID_STRING_MAX];
        char request_str[EPD_ID_STRING_MAX];
        char *path;
        ClientObject object;     /* owner: the prefill client (source), the accepting
                                  * decode client (destination, after Accept) */
        bool owned;
        bool in_request_map;
        bool release_on_commit;  /* source: released (and freed) once committed, without a
                                  * Release call; its ring hears "committed" first */

        int journal_error;       /* remote source: its PREPARED record was refused (the
                                  * Prepare's answer says so) */

        Peer *peer;              /* the other daemon; NULL for a local handoff */
        Transport *net;          /* remote: the transport its writes take (chosen at Prepare) */
        bool imm;                /* remote: group completions ride the data (no GROUP_SENT) */
        bool commit_received;    /* source: the destination's COMMIT came while this side's
                                  * write completions were still queued (past a turn's
                                  * bound): applied once they are taken (TRANSFERRED) */
        uint64_t slot;           /* remote, pipelined: the slot its writes name (0: none) */
        SlotKey slot_key;        /* destination: its key in hm->slots */
        HandoffObject *twin;     /* local handoff: the other side */
        unsigned signals;        /* HANDOFF_SIG_*: signals to send at the end of this loop
                                  * iteration (coalesced: the latest state and progress) */
        LIST_FIELDS(HandoffObject, signal);
        bool stalled;            /* remote source waiting to post: a group's post found the
                                  * transport's writes to the peer at their bound (queued in
                                  * hm->stalled until writes complete), or, yielded, the
                                  * dispatch's writes were posted (in hm->yielded until the
                                  * next): handoff-window.c */
        bool yielded;
        LIST_FIELDS(HandoffObject, stall);
        /* The whole host id: the handoff window is left by this name (handoff-window.c),
         * so a cut one would never drain its peer's window. */
        char peer_host[PEER_HOST_ID_MAX + 1];

        uint32_t arena;          /* arena of `pages` */
        PagePool *pool;
        PageId *pages;
        uint32_t n_pages;
        bool holds_pages;        /* leases (source) / refs + leases (destination) */
        uint64_t *page_keys;     /* destination: keys in hm->dest_pages */
        bool zero_copy;
        uint32_t sched_taken;    /* destination: pages the scheduler counted taken at Prepare
                                  * (given back, exactly those, if they return uncommitted) */
        int refused_error;       /* source: the errno a PREPARE_REFUSED gave (negative), 0 */
        unsigned in_event;       /* handoff_after_event() calls on it under way, and
                                  * holds (handoff_obj_hold()): it is not freed meanwhile */
        bool unsettled;          /* local source, pipelined destination: the destination
                                  * pages may have been freed by a record not yet durable;
                                  * nothing lands in them until it is (handoff_settle_wait()) */
        struct SettleWait *settle; /* while unsettled: the wait that settles it (this
                                  * object, not the request's newest attempt) */
        bool gpu;                /* local, through the CUDA transport (a GPU arena on a side) */
        uint32_t gpu_batches;    /* gpu: its batches on the GPU, not yet landed (handoff_pump()) */
        HandoffStaging *staging; /* remote with GPU source pages: GPU → host staging → peer;
                                  * given back (NULL) once committed or ended */
        bool staged;             /* took a staging buffer: its groups go through one */
        TransportWrite **net_writes; /* staged: per group, the peer writes, posted once it is staged */
        size_t *n_net;
        bool *stage_landed;      /* staged: per group, in the staging buffer (its peer writes
                                  * go in group order, handoff_stage_send_landed()) */
        const char *transport;   /* what moved its last group (TransportOps name, "zero-copy") */

        /* Where the bytes go (source): the destination's arena region and page offsets. */
        uint32_t dst_region;
        uint64_t *dst_offsets;

        uint64_t page_size;
        HandoffGroupLayout *layouts; /* per group */
        uint64_t bytes_moved;
        EpdId target_worker;
        uint64_t window_bytes;   /* source, remote: bytes it holds in the peer's window;
                                  * in the window while `windowed` */
        usec_t window_since;     /* CLOCK_MONOTONIC, when it entered the window */
        bool windowed;

        HandoffPrepareWaiter *waiter;  /* source: a Prepare waiting for the destination */
        sd_event_source *timer;
        HandoffState notified_state;
        uint64_t sequence_serial;      /* destination: what Commit made (for repeats) */
        char *sequence_path;
};

struct HandoffManager {
        Manager *manager;
        Hashmap *by_handle;       /* HandoffObject* by handle_str */
        Hashmap *sources;         /* HandoffObject* by request id bytes */
        Hashmap *destinations;    /* HandoffObject* by request id bytes */
        Hashmap *writes;          /* outgoing writes in flight by cookie */
        Hashmap *incoming;        /* incoming writes in flight by (peer, cookie) */
        Hashmap *dest_pages;      /* destination HandoffObject* by (arena << 32 | page) */
        Hashmap *rings;           /* ClientRing* by client serial */
        Hashmap *watchers;        /* HandoffWatcher* by client serial: Watch(true) */
        LIST_HEAD(HandoffObject, signal_pending); /* objects with signals to send */
        QUEUE_HEAD(HandoffObject, stalled);       /* remote sources waiting for room in
                                                   * their transport's writes in flight */
        sd_event_source *signal_source;           /* sends them (a defer source) */
        QUEUE_HEAD(HandoffObject, yielded);       /* remote sources waiting for the next dispatch */
        sd_event_source *yield_source;            /* pumps those (a defer source, below normal) */
        uint64_t yield_armed;                     /* the iteration it was armed in */
        uint64_t turn;            /* the loop iteration turn_writes counts */
        uint32_t turn_writes;     /* remote writes posted by pumps in that iteration */
        LIST_HEAD(struct ClientRing, kick_pending); /* rings with records to announce */
        sd_event_source *kick_source;             /* announces them outside manager_run() (a defer source) */
        Hashmap *windows;         /* PeerWindow* by peer host id: handoffs in flight */
        Hashmap *expects;         /* waiters for a handoff to arrive, by request id (handoff-expect.c) */
        /* Destinations rolled back before anyone accepted them, the last
         * HANDOFF_ENDINGS_MAX (handoff-expect.c): an Accept or AcceptWait for one is
         * answered Stale with why at once, not NotFound or a wait to its deadline. */
        struct HandoffEnding *endings;
        size_t endings_next;
        Hashmap *ending_map;      /* HandoffEnding* by request id */
        /* Pipelined handoffs (handoff-proto.h: HANDOFF_PREPARE_F_PIPELINED). */
        uint64_t next_slot;       /* source: the last slot given */
        uint64_t next_ring_id;    /* the last ClientRing.id given */
        Hashmap *slots;           /* destination: HandoffObject* by (peer, slot) */
        Hashmap *peer_slots;      /* destination: PeerSlots* by peer: the last slot announced */
        Transport *local;
        sd_event_source *local_source;
        sd_event_source *peer_source;
        sd_event_source *rdma_source;
        sd_event_source *gpu_source;  /* the CUDA transport's completions (m->gpu) */
        uint64_t staging_bytes;   /* in all staging buffers */
        HandoffStaging *staging[HANDOFF_STAGING_MAX]; /* by slot, busy or idle */
        sd_event_source *attach;  /* deferred: hooks into the peer manager */
        bool peer_attached;
        uint64_t next_cookie;
        uint64_t last_token;
        uint64_t slice_size;
        HandoffCounters counters;
        HandoffPath *paths;       /* HandoffPath, by (peer, transport), n_paths of them */
        size_t n_paths;
        /* What the WAL says about every handoff here (handoff-record.h): updated by
         * applying each record as it is appended, rebuilt from them at start. */
        HandoffJournal journal;
        sd_event_source *journal_grace; /* drops the entries recovered at start */
};

extern const Subsystem handoff_subsystem;

HandoffObject *handoff_manager_get(HandoffManager *hm, const char *handle_or_path);

/* Operations of the bus glue (bus-handoff.c). Each returns 0 or a negative errno and,
 * on error, says why in `why` (the bus glue names the error from the errno). */
typedef struct HandoffPrepareArgs {
        const char *request_id;
        const char *destination;     /* host id; "" or this host: local */
        const char *sequence;
        const uint32_t *layer_groups; /* layers per group */
        size_t n_groups;
        const char *arena;           /* destination arena (local), NULL: the source's */
        const char *target;          /* worker path or id that will accept, NULL: any */
        uint64_t timeout_usec;       /* 0: config */
        uint32_t ready;              /* layer groups [0, ready) are computed already */
        bool release_on_commit;      /* the source side is released when it commits */
} HandoffPrepareArgs;

typedef enum HandoffPrepareResult {
        HANDOFF_PREPARED_NOW,     /* *ret is prepared and journaled: answer once durable */
        HANDOFF_PREPARED_ALREADY, /* a repeat of a live Prepare of the caller's: *ret, at once */
        HANDOFF_PREPARE_PENDING,  /* another host was asked: waiter->done() answers later */
} HandoffPrepareResult;

/* Starts a handoff for worker w (whose client owns it). Returns a HandoffPrepareResult,
 * or a negative errno with why. */
int handoff_manager_prepare(HandoffManager *hm, Worker *w, const HandoffPrepareArgs *a,
                            HandoffPrepareWaiter *waiter, HandoffObject **ret, Reason *why);
int handoff_manager_accept(HandoffManager *hm, Client *c, const char *request_id,
                           HandoffObject **ret, Reason *why);
/* A decode worker waiting for the handoff of its request to be prepared here (AcceptWait,
 * or the ring's EPD_RING_OP_ACCEPT): done() is called once, with the handoff accepted for
 * the waiting client (error 0), or with a negative errno and why (o NULL): -ETIMEDOUT at
 * the deadline, Accept's errors, -ECONNRESET when the client went away. */
typedef struct HandoffAcceptWaiter HandoffAcceptWaiter;
struct HandoffAcceptWaiter {
        void (*done)(HandoffAcceptWaiter *w, HandoffObject *o, int error, const char *why);
};
#define HANDOFF_ACCEPT_PENDING 1
#define HANDOFF_ACCEPT_WAIT_MAX (3600ULL * 1000000ULL) /* usec */
/* Accept when the handoff of request_id is here: returns 0 with *ret when it is now (or
 * timeout is 0: then exactly Accept); HANDOFF_ACCEPT_PENDING when it waits (waiter->done()
 * answers later; a NULL waiter answers on the client's ring with user_data); or a
 * negative errno and why. */
int handoff_manager_accept_wait(HandoffManager *hm, Client *c, const char *request_id, usec_t timeout,
                                HandoffAcceptWaiter *waiter, uint64_t user_data, HandoffObject **ret,
                                Reason *why);
int handoff_manager_group_ready(HandoffObject *o, uint32_t group, Reason *why);
int handoff_manager_commit(HandoffObject *o, Client *c, const char **ret_sequence, Reason *why);
int handoff_manager_rollback(HandoffObject *o, Reason *why);
void handoff_manager_release(HandoffObject *o);
#define HANDOFF_SIG_STATE 0x1u          /* StateChanged to the watchers */
#define HANDOFF_SIG_PROGRESS 0x2u       /* Progress to the watchers */
#define HANDOFF_SIG_STATE_OWNER 0x4u    /* ... and to the owner (its ring did not take it) */
#define HANDOFF_SIG_PROGRESS_OWNER 0x8u
/* Queues the signals (HANDOFF_SIG_*) of o; they leave once per loop iteration with the
 * latest state and progress, or when o is freed. */
void handoff_signal_later(HandoffObject *o, unsigned signals);
void handoff_signals_flush_one(HandoffObject *o);
/* Progress and StateChanged go only to the watchers, and to the owner when its ring
 * could not take the record (or it has none): unicast, never to every connection. */
void handoff_emit_signal(HandoffObject *o, bool to_owner, const char *member, const char *types, ...);
/* Watch(enable): the client gets every handoff's Progress and StateChanged signals
 * (until Watch(false) or it goes away). */
int handoff_manager_watch(HandoffManager *hm, Client *c, bool enable, Reason *why);
int handoff_manager_open_ring(HandoffManager *hm, Client *c, uint32_t sq, uint32_t cq, Ring **ret,
                              Reason *why);
/* Frees the client's ring (CloseRing): its notifications go back to D-Bus signals and it
 * may open another. -ENOENT when it has none. */
int handoff_manager_close_ring(HandoffManager *hm, Client *c, Reason *why);
/* Whether client c owns o. */
bool handoff_object_owned_by(const HandoffObject *o, const Client *c);

/* The window towards a peer: handoffs and bytes in flight (0 when none). */
void handoff_manager_window(HandoffManager *hm, const char *peer, unsigned *ret_handoffs, uint64_t *ret_bytes);

/* The i-th (peer, transport) with handoffs, or NULL past the last. */
const HandoffPath *handoff_manager_path(HandoffManager *hm, size_t i);

/* Counters, in a stable order: name and value. */
size_t handoff_manager_counters(HandoffManager *hm, const char **names, uint64_t *values, size_t n);
/* Records the workers' rings held back for want of CQ room (counter ring-backlogged). */
uint64_t handoff_manager_ring_backlogged(HandoffManager *hm);
