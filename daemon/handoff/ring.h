/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The daemon's side of a worker's ring pair (ABI: client/include/epd/ring.h): a sealed
 * memfd mapping, the "submit" eventfd the worker kicks and the "complete" eventfd the
 * daemon kicks. No bus and no event loop here: the handoff manager watches the submit
 * fd with sd-event, drains the SQ with ring_consume() and answers with ring_post() +
 * ring_kick(). */

#include <stdbool.h>
#include <stdint.h>

#include "epd/ring.h"

typedef struct Ring {
        int memfd;
        int submit_fd;   /* worker -> daemon */
        int complete_fd; /* daemon -> worker */
        void *base;
        uint64_t size;
        struct epd_ring view;
        bool broken;     /* the worker corrupted the queue indexes */
        bool kick_pending;
        /* Records posted while the CQ was full, oldest first, waiting for room (posted by
         * ring_flush_backlog(): on the next post, kick or submission). */
        struct epd_ring_record *backlog;
        uint32_t backlog_n, backlog_cap;
        uint64_t submitted, posted, overflows, backlogged;
} Ring;

/* Records a ring keeps back for a worker that does not drain its CQ, at most: beyond
 * them a record is dropped and counted in the mapping's cq_overflow. */
#define RING_BACKLOG_MAX(cq_entries) ((cq_entries) * 4U < 16384U ? (cq_entries) * 4U : 16384U)

/* Creates a ring with the given queue sizes (powers of two within the ABI's limits). */
int ring_new(uint32_t sq_entries, uint32_t cq_entries, Ring **ret);
Ring *ring_free(Ring *r);

/* Fetches the next submission. 0 with *rec filled; -EAGAIN when empty; -EBADMSG when
 * the worker corrupted the queue (the ring is then broken for good). The record is a
 * private copy: validate it with ring_record_validate_submission(). */
int ring_consume(Ring *r, struct epd_ring_record *rec);
/* Checks a submission's opcode, flags and reserved fields. */
int ring_record_validate_submission(const struct epd_ring_record *rec);

/* Posts a completion or event, in order after those posted before. With the CQ full it
 * waits in the ring's backlog (the mapping's cq_backlog says how many: a worker that
 * finds its CQ empty while it is not 0 writes the submit eventfd) and is posted once
 * there is room. -ENOBUFS when the backlog is full too (the overflow counter in the
 * mapping is bumped: the caller sends it over D-Bus instead, where it can); -EBADMSG
 * when broken. */
int ring_post(Ring *r, const struct epd_ring_record *rec);
/* Posts what the backlog holds as far as the CQ has room; the number left. */
uint32_t ring_flush_backlog(Ring *r);
/* Makes the submit eventfd readable again: the daemon's loop comes back for submissions
 * it left in the queue (its per-turn budget). */
int ring_wake_submit(Ring *r);
/* Signals the worker once for everything posted since the last kick (the backlog
 * flushed first). */
int ring_kick(Ring *r);
/* Clears the submit eventfd (after it became readable). */
int ring_drain_submit(Ring *r);
/* Tells the worker that nothing more comes (the mapping's closed flag, then a wakeup),
 * before ring_free(). */
void ring_mark_closed(Ring *r);
/* The worker corrupted a queue's indexes: nothing more can be posted or taken. */
static inline bool ring_is_broken(const Ring *r) {
        return r && r->broken;
}

/* Builders of the daemon's records. */
void ring_record_completion(struct epd_ring_record *rec, uint64_t user_data, int result);
void ring_record_group_progress(struct epd_ring_record *rec, const uint8_t request_id[16],
                                uint64_t token, uint32_t groups_done, uint32_t n_groups,
                                uint64_t bytes);
void ring_record_handoff_state(struct epd_ring_record *rec, const uint8_t request_id[16],
                               uint64_t token, uint32_t state, uint32_t cause);
/* The answer to EPD_RING_OP_ACCEPT: the handoff is the worker's now. */
void ring_record_handoff_accepted(struct epd_ring_record *rec, uint64_t user_data, const uint8_t request_id[16],
                                  uint64_t token, uint32_t groups_done, uint32_t n_groups, uint32_t n_pages,
                                  uint32_t arena);
/* peer: its host id (cut at EPD_RING_PEER_MAX bytes, flagged); level and reason as in
 * backpressure.h (the public EPD_BACKPRESSURE_* numbers). */
void ring_record_backpressure(struct epd_ring_record *rec, const char *peer, uint32_t level, uint32_t reason,
                              uint32_t permille, uint64_t delay_usec);

/* The opcode's name, or NULL. */
const char *ring_opcode_to_string(uint16_t opcode);
