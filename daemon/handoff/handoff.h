/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The handoff state machine: one Prefill -> Decode transfer of a sequence, by layer
 * group. Pure: no bus, no sockets, no clocks (callers pass `now`). Each daemon keeps
 * one Handoff per side it plays: the SOURCE (prefill side) and the DESTINATION (decode
 * side); a handoff within one daemon has both objects, with the same identity.
 *
 *   SOURCE:       PREPARING -> PREPARED -> TRANSFERRING -> TRANSFERRED -> COMMITTED -> RELEASED
 *   DESTINATION:               PREPARED -> TRANSFERRING -> TRANSFERRED -> COMMITTED -> RELEASED
 *   any state before COMMITTED -> ROLLED_BACK -> RELEASED
 *
 * Per group, on the source: PENDING -> READY (the worker said LayerGroupReady) ->
 * POSTED (its writes are queued on a transport) -> SENT (every write completed); on the
 * destination: PENDING -> RECEIVED (the source said the group is complete AND every
 * byte of it has landed here). Progress is reported in order: the prefix of
 * consecutive SENT / RECEIVED groups.
 *
 * The identity of a handoff is its request id plus a fencing token; the token of a
 * newer attempt for the same request id is larger, so messages of an older attempt
 * are recognised and refused (-ESTALE).
 *
 * Every event function is idempotent: it returns 1 when it changed something, 0 when
 * it was a repeat of something already done, and a negative errno when the event is
 * illegal in the current state (nothing changes then):
 *   -EINVAL   bad argument (group out of range, byte count mismatch)
 *   -EBUSY    not yet possible (commit before every group arrived, or before Accept)
 *   -EPERM    wrong role or wrong client (accept by a second client, commit by another)
 *   -ESTALE   the handoff already ended (rolled back or released) and the event would
 *             need it alive
 *   -EALREADY the handoff was committed and cannot be rolled back any more
 *
 * Writes in flight are counted: a handoff that ended is only freed (handoff_can_free)
 * when no write into its pages can still land. */

#include <stdbool.h>
#include <stdint.h>

#include "id.h"
#include "time-util.h"

#define HANDOFF_GROUPS_MAX 1024U

typedef enum HandoffRole {
        HANDOFF_SOURCE,
        HANDOFF_DESTINATION,
        _HANDOFF_ROLE_MAX,
} HandoffRole;

typedef enum HandoffState {
        HANDOFF_PREPARING,    /* source: Prepare sent, destination has not answered */
        HANDOFF_PREPARED,     /* destination pages reserved */
        HANDOFF_TRANSFERRING, /* at least one group is moving */
        HANDOFF_TRANSFERRED,  /* every group SENT (source) / RECEIVED (destination) */
        HANDOFF_COMMITTED,    /* the pages are the decode sequence's */
        HANDOFF_RELEASED,     /* final: the handoff object may go */
        HANDOFF_ROLLED_BACK,  /* ended without commit; everything is freed */
        _HANDOFF_STATE_MAX,
} HandoffState;

typedef enum HandoffGroupState {
        HANDOFF_GROUP_PENDING,
        HANDOFF_GROUP_READY,    /* source */
        HANDOFF_GROUP_POSTED,   /* source */
        HANDOFF_GROUP_SENT,     /* source */
        HANDOFF_GROUP_RECEIVED, /* destination */
        _HANDOFF_GROUP_STATE_MAX,
} HandoffGroupState;

/* Why a handoff rolled back (also the failure counters' index). Values are part of
 * the peer protocol and the ring ABI: append only. */
typedef enum HandoffCause {
        HANDOFF_CAUSE_NONE = 0,
        HANDOFF_CAUSE_REQUESTED = 1,       /* Rollback or Release before commit */
        HANDOFF_CAUSE_TIMEOUT = 2,
        HANDOFF_CAUSE_PEER_DOWN = 3,       /* peer dead or connection dropped */
        HANDOFF_CAUSE_WORKER_GONE = 4,     /* the prefill or decode client disconnected */
        HANDOFF_CAUSE_TRANSFER_FAILED = 5, /* a write failed */
        HANDOFF_CAUSE_NO_SPACE = 6,        /* destination refused: no pages */
        HANDOFF_CAUSE_REFUSED = 7,         /* destination refused: invalid or busy */
        HANDOFF_CAUSE_REMOTE = 8,          /* the other side rolled back */
        HANDOFF_CAUSE_SHUTDOWN = 9,
        HANDOFF_CAUSE_PROTOCOL = 10,       /* the peer broke the protocol */
        _HANDOFF_CAUSE_MAX,
} HandoffCause;

typedef struct HandoffGroup {
        HandoffGroupState state;
        uint64_t bytes_expected; /* bytes this group moves (all pages, all its ranges) */
        uint64_t bytes_done;     /* completed writes (source) / landed bytes (destination) */
        uint32_t writes_pending; /* posted (source) / landing (destination), not completed */
        bool notice;             /* destination: the source said it is complete */
        uint64_t ready_usec;     /* source: CLOCK_MONOTONIC when the worker said it is ready
                                  * (set by the manager, for the request's trace) */
} HandoffGroup;

typedef struct Handoff {
        HandoffRole role;
        HandoffState state;
        HandoffCause cause;
        bool remote_rolled_back; /* the rollback came from the other side (no need to tell it) */

        EpdId request_id;
        uint64_t token;

        uint32_t n_groups;
        HandoffGroup *groups;
        uint32_t n_ready;    /* source: prefix of groups the worker said are ready */
        uint32_t n_posted;   /* source: prefix of groups whose writes are queued */
        uint32_t n_done;     /* prefix of SENT / RECEIVED groups */
        uint32_t n_notified; /* prefix already announced (to the peer / to the worker) */
        uint32_t n_complete; /* groups SENT / RECEIVED, in any order */

        uint64_t inflight;   /* writes that may still land in pages of this handoff */
        uint64_t bytes_total;

        uint64_t accepted_by; /* destination: the accepting client's serial, 0 = none */

        usec_t created_usec;
        usec_t deadline_usec; /* USEC_INFINITY: none */
} Handoff;

/* Creates a handoff. A SOURCE starts PREPARING, a DESTINATION PREPARED (it exists only
 * once its pages are reserved). bytes_per_group[g] is what group g moves in all (it
 * may be 0 when pages are handed over without a copy). Timeout 0 or USEC_INFINITY:
 * none. */
int handoff_new(HandoffRole role, const EpdId *request_id, uint64_t token, uint32_t n_groups,
                const uint64_t *bytes_per_group, usec_t now, usec_t timeout, Handoff **ret);
Handoff *handoff_free(Handoff *h);

/* A handoff that is neither committed nor ended. */
bool handoff_is_live(const Handoff *h);
/* Ended (ROLLED_BACK or RELEASED). */
bool handoff_is_ended(const Handoff *h);
/* Ended and no write can still land: pages and the object may be freed. */
bool handoff_can_free(const Handoff *h);
/* Matches the identity (request id and fencing token). */
bool handoff_matches(const Handoff *h, const EpdId *request_id, uint64_t token);

/* Source: the destination reserved the pages. */
int handoff_prepared(Handoff *h);

/* Source: the worker reports that group g is computed. Groups come in order: g may be
 * at most the number already reported (a repeat is 0); a later one is -EINVAL.
 * Allowed while PREPARING too: it is shipped once the destination answered. */
int handoff_group_ready(Handoff *h, uint32_t g);
/* Source: the next READY group that may be posted now, or -EAGAIN. */
int handoff_next_to_post(const Handoff *h, uint32_t *ret);
/* Source: the writes of group g are queued (n_writes of them). With n_writes == 0
 * (pages handed over without a copy) the group is SENT at once. */
int handoff_group_posted(Handoff *h, uint32_t g, uint32_t n_writes);
/* Source: n writes of group g completed, `bytes` in all (error 0 or negative errno: for
 * all n). Always accounted, even after the handoff ended, so that handoff_can_free() is
 * exact; an error rolls a live handoff back (TRANSFER_FAILED). n must be at least 1 and
 * at most the group's writes pending (else -EINVAL, nothing counted). */
int handoff_writes_done(Handoff *h, uint32_t g, uint32_t n, uint64_t bytes, int error);
static inline int handoff_write_done(Handoff *h, uint32_t g, uint64_t bytes, int error) {
        return handoff_writes_done(h, g, 1, bytes, error);
}

/* Destination: whether a write into group g's pages may start now. */
bool handoff_may_land(const Handoff *h, uint32_t g);
/* Destination: n incoming writes into group g were admitted (by the incoming
 * validator); -ESTALE / -EINVAL if they must be refused. */
int handoff_writes_landing(Handoff *h, uint32_t g, uint32_t n);
/* Source: the groups ready and not posted yet, from *ret_first on (0: none, or not in a
 * state to post). */
uint32_t handoff_ready_unposted(const Handoff *h, uint32_t *ret_first);
static inline int handoff_write_landing(Handoff *h, uint32_t g) {
        return handoff_writes_landing(h, g, 1);
}
/* Destination: n admitted incoming writes finished (the bytes that landed, or error);
 * n as for handoff_writes_done(). */
int handoff_writes_landed(Handoff *h, uint32_t g, uint32_t n, uint64_t bytes, int error);
static inline int handoff_write_landed(Handoff *h, uint32_t g, uint64_t bytes, int error) {
        return handoff_writes_landed(h, g, 1, bytes, error);
}
/* Destination: group g's bytes were handed over without a copy (same arena). */
int handoff_group_handed_over(Handoff *h, uint32_t g);
/* Destination: the source says group g is complete with `bytes` bytes. A byte count
 * other than the expected one is -EINVAL (the caller rolls back: PROTOCOL). */
int handoff_group_sent_notice(Handoff *h, uint32_t g, uint64_t bytes);

/* The groups [*from, *to) newly complete in order since the last call: the source
 * announces them to the destination, the destination to the decode worker. Returns
 * 1 when the range is not empty. */
int handoff_take_progress(Handoff *h, uint32_t *from, uint32_t *to);

/* Destination: the decode worker (client serial, non-zero) takes the handoff. */
int handoff_accept(Handoff *h, uint64_t client);
/* Commit. On the destination, `client` must be the accepting one and every group
 * RECEIVED; on the source (client 0) it is the destination's commit notice and every
 * group must be SENT. */
int handoff_commit(Handoff *h, uint64_t client);
/* Rollback for a cause. Live -> ROLLED_BACK; ROLLED_BACK -> 0; COMMITTED -> -EALREADY;
 * RELEASED -> -ESTALE. `remote` says the other side started it. */
int handoff_rollback(Handoff *h, HandoffCause cause, bool remote);
/* Release: COMMITTED or ROLLED_BACK -> RELEASED (1); RELEASED -> 0; a live handoff is
 * rolled back first (REQUESTED) and then released (1). */
int handoff_release(Handoff *h);
/* Rolls back (TIMEOUT) a live handoff whose deadline passed; 1 if it did. */
int handoff_check_timeout(Handoff *h, usec_t now);

const char *handoff_role_to_string(HandoffRole r);
const char *handoff_state_to_string(HandoffState s);
int handoff_state_from_string(const char *s);
const char *handoff_group_state_to_string(HandoffGroupState s);
const char *handoff_cause_to_string(HandoffCause c);
int handoff_cause_from_string(const char *s);

/* Counters of one daemon's handoffs (bus properties, epdctl handoffs). */
typedef struct HandoffCounters {
        uint64_t prepared;
        uint64_t committed;
        uint64_t rolled_back;
        uint64_t released;
        uint64_t refused;          /* Prepare refused by admission */
        uint64_t deferred;         /* Prepare deferred: the peer's backpressure window */
        uint64_t groups;
        uint64_t bytes;
        uint64_t batches;
        uint64_t zero_copy_groups; /* handed over without a copy */
        uint64_t merged_groups;    /* local GPU: posted in one batch with others that queued up */
        uint64_t gpu_slices;       /* local GPU: a batch's posts to the CUDA transport, a slice each */
        uint64_t ring_fallbacks;   /* notifications sent over D-Bus for want of ring room */
        uint64_t ring_backlogged;  /* records held back for want of CQ room, of rings closed since */
        uint64_t rings_lost;       /* rings closed because an answer could not be posted, or a corrupt CQ */
        uint64_t pipelined;        /* to another host without a round trip before the data */
        uint64_t journal_waits;    /* writes held until the record that freed their pages was durable */
        uint64_t stalls;           /* a remote group held back: the writes in flight to its peer at their bound */
        uint64_t post_yields;      /* a remote source's groups left for the next loop turn: that turn's
                                    * posts were at HANDOFF_TURN_WRITES_MAX writes */
        uint64_t failures[_HANDOFF_CAUSE_MAX];
} HandoffCounters;

/* ---- Planning: which writes move group g ---- */

/* A byte range within every page (from the KV layout: the slices of a layer group). */
typedef struct HandoffRange {
        uint64_t offset;
        uint64_t length;
} HandoffRange;

#define HANDOFF_RANGES_PER_GROUP_MAX 64U

/* How one layer group lies within a page: ranges sorted, within the page, disjoint. */
typedef struct HandoffGroupLayout {
        uint32_t n_ranges;
        HandoffRange ranges[HANDOFF_RANGES_PER_GROUP_MAX];
} HandoffGroupLayout;

/* Validates a group layout against a page size. */
int handoff_group_layout_validate(const HandoffGroupLayout *l, uint64_t page_size);
/* Bytes per page of a group. */
uint64_t handoff_group_layout_bytes(const HandoffGroupLayout *l);

/* A planned write, in region offsets (TransportWrite without the region ids). */
typedef struct HandoffSlice {
        uint64_t src_offset;
        uint64_t dst_offset;
        uint64_t length;
} HandoffSlice;

/* Plans the writes of one group: for each page i, each range of the layout, from
 * src_pages[i] + range to dst_pages[i] + range; adjacent writes that continue each
 * other on both sides are merged, and every write is then cut into slices of at most
 * max_slice bytes (0: no limit). Calls `emit` for each slice in order; a negative
 * return of emit stops and is returned. Returns the number of slices. */
typedef int (*handoff_slice_fn)(const HandoffSlice *s, void *userdata);
int handoff_plan_group(const HandoffGroupLayout *layout, const uint64_t *src_pages,
                       const uint64_t *dst_pages, uint32_t n_pages, uint64_t max_slice,
                       handoff_slice_fn emit, void *userdata);

/* The next fencing token: larger than `last` and than the realtime clock in usec, so
 * that a restarted daemon keeps issuing larger tokens. */
uint64_t handoff_next_token(uint64_t last, usec_t realtime_now);
