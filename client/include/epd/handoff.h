/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* libepd: layered KV handoffs (org.epd1.Handoffs / org.epd1.Handoff) and the ring pair
 * (epd/ring.h). See docs/handoff.md for the flow:
 *
 *   prefill: epd_handoff_prepare() -> per layer group: epd_handoff_layer_group_ready()
 *            (or epd_ring_layer_group_ready() without a bus round trip) -> wait for the
 *            state "committed" -> epd_handoff_release()
 *   decode:  epd_handoff_accept() (or epd_handoff_accept_wait() / epd_ring_accept() before the
 *            prefill prepared it) -> progress (ring records, or epd_handoff_get()) ->
 *            epd_handoff_commit() (the pages become a sequence of its own) ->
 *            epd_handoff_release()
 *
 * Every function returns 0 or a negative errno (epd_last_error_name() says more). */

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "epd/epd.h"

#include "epd/ring.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epd_handoff_options {
        const char *arena;     /* local destination arena; NULL: the sequence's own */
        const char *target;    /* worker path that will accept; NULL: any */
        uint64_t timeout_usec; /* 0: the daemon's HandoffTimeout= */
        uint32_t ready;        /* layer groups [0, ready) are computed already: they ship
                                * with Prepare, no LayerGroupReady needed for them */
        bool release_on_commit; /* the source side is released once the destination
                                 * commits (its ring says committed first): no
                                 * epd_handoff_release() for it */
} epd_handoff_options;

/* request_id: 32 hex digits. destination: a host id, or NULL/"" for this host. The
 * handoff's object path (the caller frees it) and fencing token come back. */
int epd_handoff_prepare(epd_client *c, const char *request_id, const char *destination,
                        const char *sequence, const uint32_t *layer_groups, size_t n_groups,
                        const epd_handoff_options *opts, char **ret_path, uint64_t *ret_token);
/* Prepare without waiting for the answer, for a worker that keeps many handoffs in flight
 * on one connection: the call is sent now and fn runs from epd_process(), epd_wait() or
 * epd_flush() when the daemon answers: error 0 with the handoff's path (valid during the
 * call) and token, or the refusal as a negative errno (epd_last_error_name() and
 * _message() say more during the call). fn must not call libepd on c (the bus is being
 * processed): it records what it needs and returns. A refusal of the arguments
 * themselves (EINVAL) returns at once and fn is never called; a connection that breaks
 * while processing answers fn with its error; epd_disconnect() drops calls still
 * unanswered without calling fn. */
typedef void (*epd_handoff_prepared_fn)(epd_client *c, int error, const char *path, uint64_t token,
                                        void *userdata);
int epd_handoff_prepare_async(epd_client *c, const char *request_id, const char *destination,
                              const char *sequence, const uint32_t *layer_groups, size_t n_groups,
                              const epd_handoff_options *opts, epd_handoff_prepared_fn fn, void *userdata);
int epd_handoff_layer_group_ready(epd_client *c, const char *handoff, uint32_t group);

typedef struct epd_handoff_accepted {
        char *path;
        uint64_t token;
        char *arena;
        uint64_t *offsets; /* arena offset of each page, in order */
        size_t n_pages;
        uint32_t n_groups;
        uint32_t groups_done;
} epd_handoff_accepted;

int epd_handoff_accept(epd_client *c, const char *request_id, epd_handoff_accepted *ret);
/* Accept once the handoff of request_id is prepared on this host: at once when it is
 * here, else waiting up to timeout_usec (at most an hour) for it to arrive; accepted
 * before its first byte lands, so its progress reaches this client's ring. -ETIMEDOUT
 * (org.epd1.Error.Timeout) when none came; -ESTALE (org.epd1.Error.Stale) at once when
 * the request's handoff rolled back here before anyone accepted it (the message says
 * when and why), as from epd_handoff_accept(). Without blocking: epd_ring_accept(). */
int epd_handoff_accept_wait(epd_client *c, const char *request_id, uint64_t timeout_usec,
                            epd_handoff_accepted *ret);
void epd_handoff_accepted_done(epd_handoff_accepted *a);

/* The decode sequence's object path comes back (the caller frees it). */
int epd_handoff_commit(epd_client *c, const char *handoff, char **ret_sequence);
/* Commit, then release the handoff, in one call (one round trip, one sync): the decode
 * sequence stays the caller's. */
int epd_handoff_commit_and_release(epd_client *c, const char *handoff, char **ret_sequence);
int epd_handoff_rollback(epd_client *c, const char *handoff);
int epd_handoff_release(epd_client *c, const char *handoff);
/* enable: this client gets the Progress and StateChanged signals of every handoff (a
 * monitor); without it, only its own handoffs' and only when its ring could not take
 * the record (or it has none). Ends with the connection. */
int epd_handoff_watch(epd_client *c, bool enable);

typedef struct epd_handoff_status {
        char state[24];
        char cause[24];
        uint32_t groups_done;
        uint32_t n_groups;
        uint64_t bytes;
} epd_handoff_status;

int epd_handoff_get(epd_client *c, const char *handoff, epd_handoff_status *ret);

/* ---- the ring pair ---- */

typedef struct epd_ring_client {
        struct epd_ring ring;
        void *base;
        uint64_t size;
        int memfd;
        int submit_fd;
        int complete_fd;
        pthread_mutex_t submit_lock; /* the SQ has one producer at a time (epd_gpu_notifier) */
        int daemon_fd;               /* a pidfd of the daemon (-1: none): readable once it
                                      * exits, which ends a wait in epd_ring_next() */
} epd_ring_client;

/* Opens this client's ring (sq/cq: powers of two, 8..32768) and maps it (a failure
 * after the daemon made it closes it there too: the client may try again). A wait on it
 * (epd_ring_next()) ends with -ECONNRESET when the daemon exits or lets go of the ring
 * while living on (CloseRing, the client disconnected for not reading its bus
 * connection, a corrupt queue), once the records posted before are taken. A daemon
 * that exits is seen through its pidfd, which only the direct socket gives: over a
 * D-Bus broker there is none (epd_ring_daemon_fd() is -ENODATA), and a wait for a dead
 * daemon ends by its timeout alone. */
int epd_ring_open(epd_client *c, uint32_t sq_entries, uint32_t cq_entries, epd_ring_client **ret);
epd_ring_client *epd_ring_close(epd_ring_client *r);
/* Closes the daemon's side of c's ring (CloseRing), then r as epd_ring_close() does: the
 * client's notifications go back to D-Bus signals and it may open another ring. (Without
 * it the daemon keeps the ring until the client disconnects.) The daemon's answer (0, or
 * -ENOENT when it had no ring for c); r is closed either way. */
int epd_ring_release(epd_client *c, epd_ring_client *r);
/* Queues a submission and kicks the daemon. -EAGAIN when the SQ is full, -ECONNRESET
 * once the daemon has let go of the ring (nothing submitted would be read). */
int epd_ring_submit(epd_ring_client *r, const struct epd_ring_record *rec);
/* LayerGroupReady(group) of the handoff (request_id as 32 hex digits, token). */
int epd_ring_layer_group_ready(epd_ring_client *r, const char *request_id, uint64_t token,
                               uint32_t group, uint64_t user_data);
/* Asks the daemon to accept the handoff of request_id for this client as soon as it is
 * prepared here (waiting up to timeout_usec; 0: the daemon's HandoffTimeout=). The answer
 * comes on the ring: EPD_RING_EV_HANDOFF_ACCEPTED with user_data (then its progress
 * records), or an EPD_RING_EV_COMPLETION with the error. epd_handoff_accept() gives the
 * page offsets afterwards (a repeat: it changes nothing). */
int epd_ring_accept(epd_ring_client *r, const char *request_id, uint64_t timeout_usec, uint64_t user_data);
/* Commits the handoff (request_id, token) this client accepted, and releases it too when
 * release is non-zero (CommitAndRelease), without a bus round trip. The answer comes on
 * the ring once durable: an EPD_RING_EV_COMPLETION with user_data, result 0 or -errno,
 * and on success the decode sequence (epd_ring_record_sequence_path()). */
int epd_ring_commit(epd_ring_client *r, const char *request_id, uint64_t token, int release, uint64_t user_data);
/* The ring's completion eventfd, readable when records were posted: poll it (with
 * others) instead of polling the daemon; then take the records with epd_ring_next(r, .., 0)
 * until it returns -EAGAIN, which also clears the fd (it stays readable until then). */
int epd_ring_fd(const epd_ring_client *r);
/* A pidfd of the daemon (readable once it exited), for callers that poll epd_ring_fd()
 * in their own loop: poll it too, or a dead daemon is never noticed. -ENODATA when there
 * is none (a bus connection, an older kernel). The ring owns it. */
int epd_ring_daemon_fd(const epd_ring_client *r);
/* Takes the next completion or event, waiting up to timeout_usec (UINT64_MAX: forever;
 * 0: do not wait). -EAGAIN when none came in time. */
int epd_ring_next(epd_ring_client *r, struct epd_ring_record *rec, uint64_t timeout_usec);
/* How many records the daemon could not post on this ring since it was opened (the CQ and
 * its backlog were full: EPD_RING_OFF_CQ_OVERFLOW). It sent them as D-Bus signals
 * instead (Progress, StateChanged), which a caller that only reads its ring never sees:
 * when the count moved since a handoff's last look, the ring's records may miss some of
 * that handoff's progress or state, and epd_handoff_get() says where it is. 0 for NULL. */
uint32_t epd_ring_overflows(const epd_ring_client *r);

#ifdef __cplusplus
}
#endif
