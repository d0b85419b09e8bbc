/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Internal to handoff/: the structures and functions the files of the handoff manager
 * share. The API other subsystems and the bus glue use is handoff-manager.h. */

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>

#include "core/arena.h"
#include "core/worker.h"
#include "handoff/bus-handoff.h"
#include "handoff/handoff-manager.h"
#include "handoff/handoff-proto.h"
#include "log.h"
#include "macro.h"
#include "pages/page-manager.h"
#include "peer/peer-manager.h"
#include "telemetry/telemetry-manager.h"
#include "wal/wal-manager.h"

/* Writes this daemon posted (source side), by cookie: one per write to a peer (whose
 * cookies travel and must be unique), one per group's batch within this host (every
 * write of the batch carries the cookie; `pending` of them have not completed). */
typedef struct OutWrite {
        uint64_t cookie;
        HandoffObject *obj;
        uint32_t group;
        size_t pending;
        bool stage;   /* a GPU → staging copy (CUDA transport) of a remote handoff */
        bool ends_batch; /* local GPU: the last group of its batch (HandoffObject.gpu_batches) */
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
        uint64_t id;                   /* this ring, not the client's next one */
        Ring *ring;
        sd_event_source *source;
        bool kick_queued;              /* on hm->kick_pending: kicked by on_kicks() */
        bool lost;                     /* an answer could not be posted: closed at the next kick */
        LIST_FIELDS(struct ClientRing, kick);
} ClientRing;

/* Posts the answer to a submission (a completion, an ACCEPTED record), which has no
 * D-Bus fallback: a ring that cannot take it (its backlog full: the worker does not
 * drain its CQ; out of memory; a corrupt CQ) is closed at the next kick, so the worker
 * learns (-ECONNRESET from epd_ring_next()) instead of waiting for ever. */
void handoff_ring_answer(ClientRing *cr, const struct epd_ring_record *rec);

/* Wakes the ring's worker once the loop is done with the event that woke it: the
 * records posted meanwhile (a handoff's groups landed in one read, its state) cost one
 * eventfd write and one wake-up of the worker, not one each. */
void handoff_ring_kick_later(ClientRing *cr);
/* Kicks every ring handoff_ring_kick_later() queued (the after_dispatch hook). */
void handoff_rings_kick_pending(HandoffManager *hm);

/* A client that asked for every handoff's signals (org.epd1.Handoffs.Watch). */
typedef struct HandoffWatcher {
        ClientObject object;
        HandoffManager *hm;
        uint64_t serial;
} HandoffWatcher;

/* Handoffs in flight towards one peer (source side): from Prepare until every group is
 * transferred, or the handoff ends. Bounded by the backpressure window
 * (backpressure_window_admit); one per peer ever used, freed at shutdown. */
typedef struct PeerWindow {
        char host[PEER_HOST_ID_MAX + 1]; /* key: the peer's host id, as telemetry names it */
        unsigned handoffs;
        uint64_t bytes;
        usec_t held_avg;                 /* how long a handoff stays in the window (a moving
                                          * average; 0 before the first leaves) */
} PeerWindow;

#define COOKIE_GROUP_BITS 10
_Static_assert((1U << COOKIE_GROUP_BITS) >= HANDOFF_GROUPS_MAX, "cookie group bits");

/* The most layer groups of a local GPU handoff posted in one batch (handoff_pump(),
 * [Gpu] MergeGroups= up to this): the CUDA transport completes a batch once per cookie
 * for only so many cookies (past that, thousands of completions again). */
#define HANDOFF_GPU_MERGE_MAX 16

/* The writes of one group, as planned (handoff_plan_group). */
typedef struct PlanCtx {
        HandoffObject *o;
        uint32_t group;
        TransportWrite *w;
        size_t n, cap;
} PlanCtx;

static inline bool isempty_str(const char *s) {
        return !s || !s[0];
}

static inline const char *strna(const char *s) {
        return s ? s : "n/a";
}

void handoff_after_event(HandoffObject *o);
/* Keeps o from being freed until the matching unhold, which tells it of what happened
 * meanwhile (handoff_after_event()) and may free it: for a caller that tells several
 * objects, each of which may free the others. */
void handoff_obj_hold(HandoffObject *o);
void handoff_obj_unhold(HandoffObject *o);

/* handoff-manager.c: lifetime of handoff objects, the central step after every event */
uint64_t handoff_client_serial(const Client *c);
/* The index of the daemon's arena `arena` among those c's worker mapped: the order of
 * epd_arena_get() on its side (EPD_RING_EV_HANDOFF_ACCEPTED's arg1); UINT32_MAX when it
 * mapped no such arena. */
uint32_t handoff_worker_arena_index(Client *c, uint32_t arena);
void handoff_count_failure(HandoffManager *hm, HandoffCause c);
bool handoff_counts(const HandoffObject *o);
Transport *handoff_gpu_transport(HandoffManager *hm);
void handoff_obj_drop_pages(HandoffObject *o);
void handoff_obj_free(HandoffObject *o);
int handoff_obj_link(HandoffObject *o, Client *c);
Manager *handoff_obj_manager(HandoffObject *o);
/* How long a Prepare waits for its destination's answer: below sd-bus's default call
 * timeout (25 s), so that a caller hears the outcome instead of giving up first. */
#define HANDOFF_PREPARE_ANSWER_USEC (20 * USEC_PER_SEC)
/* Moves the object's timer to `when` (USEC_INFINITY: off); the deadline is checked when
 * it fires, and an earlier firing while a Prepare waits rolls it back (timeout). */
int handoff_obj_arm_timer(HandoffObject *o, usec_t when);
int handoff_obj_new(HandoffManager *hm, HandoffRole role, const EpdId *request_id, uint64_t token,
                    uint32_t n_groups, const uint64_t *bytes_per_group, usec_t timeout,
                    HandoffObject **ret);
Hashmap *handoff_request_map(HandoffManager *hm, HandoffRole role);

/* handoff-source.c: the source side: Prepare, shipping groups, completions */
int handoff_on_gpu_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata);
int handoff_on_local_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata);
int handoff_on_peer_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata);
int handoff_on_rdma_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata);
int handoff_parse_request_id(const char *s, EpdId *ret, Reason *why);
void handoff_pump(HandoffObject *o);
/* The worker says group g is ready (LayerGroupReady, its ring, or Prepare's `ready`):
 * handoff_group_ready(), and the first time its time (and for group 0 a group-ready
 * trace event).
 * Returns as handoff_group_ready() (1: newly ready, the caller pumps). */
int handoff_obj_group_ready(HandoffObject *o, uint32_t g);
/* Marks o unsettled until every record that freed pages so far is durable (its
 * destination pages may be among them): a local source posts nothing, a pipelined
 * destination's writes wait, until then (handoff-dest.c). Returns 0 (waiting, or
 * durable already: o is settled) or the journal's error, o left as it was: the caller
 * refuses the Prepare. */
int handoff_settle_wait(HandoffObject *o);
/* o goes: its settle wait, if one is under way, answers nobody (but still resumes the
 * peer's parked streams). */
void handoff_settle_forget(HandoffObject *o);
/* The last write of group g of a handoff whose completions ride the data: it carries
 * the group's immediate (handoff-proto.h). */
void handoff_mark_group_end(HandoffObject *o, uint32_t g, TransportWrite *w);
void handoff_send_message(HandoffObject *o, HandoffMessage *m);
/* The same once every record journaled so far is durable (the object may be gone by
 * then); not at all if the journal fails. */
void handoff_send_message_when_durable(HandoffObject *o, HandoffMessage *m);

/* handoff-dest.c: the destination side: remote Prepare, incoming writes, Accept, Commit */
int handoff_dest_accept(HandoffManager *hm, Client *c, HandoffObject *d, HandoffObject **ret, Reason *why);
int handoff_dest_reserve(HandoffObject *d, Arena *a, uint32_t n_pages);
void handoff_on_incoming_done(Peer *p, const TransportIncoming *in, int error, void *userdata);
int handoff_on_incoming_validate(Peer *p, TransportIncoming *in, void *userdata);
HandoffObject *handoff_slot_get(HandoffManager *hm, Peer *p, uint64_t slot);
void handoff_slot_forget(HandoffObject *d);
/* A stalled source (handoff_pump(): no room in its transport's writes to the peer) leaves
 * the queue of those waiting for completions. */
void handoff_unstall_forget(HandoffObject *o);
/* Queues o until writes to its peer complete (once). */
void handoff_stall(HandoffObject *o);
/* Writes to other hosts completed: the sources that waited for room post again, first
 * come first, each once (past the dispatch's writes they yield instead). */
void handoff_unstall(HandoffManager *hm);
/* The remote writes posted in this dispatch are below HANDOFF_TURN_WRITES_MAX;
 * handoff_turn_count() adds n to them. */
bool handoff_turn_has_room(HandoffManager *hm);
void handoff_turn_count(HandoffManager *hm, size_t n);
/* o's next groups wait for the next dispatch (true), behind the sources that yielded
 * before it; false when no wakeup could be armed (they go now). */
bool handoff_yield(HandoffObject *o);
/* After every dispatch of manager_run()'s loop: yielded sources that waited
 * HANDOFF_YIELD_TURNS dispatches go next. */
void handoff_yield_after_dispatch(HandoffManager *hm);
#define HANDOFF_YIELD_TURNS 16
/* Remote writes the pumps post in one dispatch of the loop: past them a source's next
 * groups wait (hm->yielded, pumped by a defer source below the normal priority, so that
 * what was pending meanwhile goes first), so that a handoff of tens of
 * thousands of page writes does not hold the loop (heartbeats, other handoffs, bus
 * calls) for the whole of it: 65536 posts took 51 ms of one dispatch in a release build
 * on the development VM. A group is never split: a dispatch posts at most this plus
 * one group. */
#define HANDOFF_TURN_WRITES_MAX 8192
/* Completions of writes to other hosts taken in one dispatch (the rest at the next turn). */
#define HANDOFF_TURN_COMPLETIONS_MAX 8192
/* Staged: the peer writes of the groups in the staging buffer go, in group order, until
 * one finds no room (o is stalled) or one is still being staged; once o has ended,
 * those waiting complete cancelled. */
void handoff_stage_send_landed(HandoffObject *o);
void handoff_slots_peer_down(HandoffManager *hm, Peer *p);
int handoff_on_peer_message(Peer *p, uint16_t type, const void *payload, size_t len, void *userdata);
void handoff_on_peer_state(Peer *p, bool up, void *userdata);
Arena *handoff_pick_arena(Manager *m, uint64_t page_size, uint32_t n_pages, const Worker *target, Arena *prefer,
                          bool host_only);

/* handoff-expect.c: decode workers waiting for their request's handoff (AcceptWait, ring) */
void handoff_expect_arrived(HandoffObject *d);
void handoff_expect_done(HandoffManager *hm);
void handoff_expect_drop_ring(HandoffManager *hm, uint64_t client_serial);
#define HANDOFF_ENDINGS_MAX 1024
typedef struct HandoffEnding HandoffEnding;
void handoff_ending_remember(HandoffObject *d);
/* A destination rolled back before it was announced to its waiters (AcceptWait, ring
 * ACCEPT; handoff_expect_arrived() never ran for it): they hear Stale and why now,
 * not at their deadlines. */
void handoff_expect_ended(HandoffObject *d);
void handoff_ending_forget(HandoffManager *hm, const EpdId *request_id);
/* -ESTALE and why if request_id's last destination here rolled back before anyone
 * accepted it; 0 if not. */
int handoff_ending_refuse(HandoffManager *hm, const EpdId *request_id, const char *request_str, Reason *why);
void handoff_endings_free(HandoffManager *hm);

/* handoff-journal.c: the WAL: every transition appended before it is acknowledged */
int handoff_manager_apply_record(Manager *m, uint16_t type, const void *payload, size_t len);
int handoff_manager_restore_finish(Manager *m);
int handoff_manager_snapshot(Manager *m, int (*add)(void *userdata, uint16_t type, const void *rec, size_t len),
                             void *userdata);
HandoffJournalEntry *handoff_journal_entry_of(HandoffObject *o);
int handoff_journal_prepared(HandoffObject *o);
int handoff_journal_append(HandoffManager *hm, const HandoffRecord *r, const uint32_t *pages);
void handoff_journal_released(HandoffObject *o);
void handoff_journal_state(HandoffObject *o);
HandoffRecord handoff_record_of(HandoffObject *o, uint8_t type);

/* handoff-stage.c: GPU pages to another host, through pinned staging buffers */
int handoff_plan_collect(const HandoffSlice *s, void *userdata);
int handoff_post_group_staged(HandoffObject *o, uint32_t g);
void handoff_stage_landed(HandoffObject *o, uint32_t g, int error);
int handoff_staging_acquire(HandoffManager *hm, uint64_t size, HandoffStaging **ret);
void handoff_staging_free(HandoffManager *hm, HandoffStaging *st);
void handoff_staging_put(HandoffObject *o);
void handoff_staging_count(const HandoffManager *hm, uint64_t *ret_buffers, uint64_t *ret_busy);

/* handoff-window.c: the per-peer backpressure window */
void handoff_on_backpressure(Telemetry *t, const char *peer, BackpressureLevel level,
                             BackpressureReason reason, void *userdata);
PeerWindow *handoff_window_get(HandoffManager *hm, Peer *peer, bool create);
void handoff_window_leave(HandoffObject *o);
void handoff_window_publish(HandoffManager *hm, PeerWindow *w);

/* handoff-ring.c: the workers' rings: notifications, LayerGroupReady submissions */
void handoff_notify_progress(HandoffObject *o, uint32_t done);
void handoff_notify_state(HandoffObject *o);
void handoff_ring_free(ClientRing *cr);
void handoff_watcher_free(HandoffWatcher *w);
