/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The RDMA session with one peer: the state machine behind transport/rdma.c, pure (no
 * verbs, no sockets) so that the unit test drives every transition. Each event returns
 * the actions the caller must perform, in the order the flags are listed below.
 *
 *   IDLE      no queue pair. `failure` may say why RDMA to this peer is off (the peer
 *             then uses tcp, and the path reason shows it).
 *   OFFERED   our QP exists (INIT) and our CONNECT went out; the peer's has not come.
 *   READY     both QPs connected (RTS): writes to this peer go over RDMA.
 *   DRAINING  a fault moved the QP to the error state; the work requests still posted
 *             complete (flushed) before anything is freed or reported: only when
 *             `outstanding` reaches 0 (or the drain timer fires) does FINALIZE come.
 *
 * Faults: a work request error or timeout drains and then reconnects the peer (the
 * whole session: its handoffs roll back); a local device that dies, is removed or whose
 * port goes down drains, tells the peer (DOWN) and stays off (failure) until the port
 * is active again or the peer reconnects; a DOWN from the peer does the same on this
 * side without answering. */

#include <stdbool.h>
#include <stddef.h>

typedef enum RdmaSessionState {
        RDMA_SESSION_IDLE,
        RDMA_SESSION_OFFERED,
        RDMA_SESSION_READY,
        RDMA_SESSION_DRAINING,
        _RDMA_SESSION_STATE_MAX,
} RdmaSessionState;

const char *rdma_session_state_to_string(RdmaSessionState s);

typedef enum RdmaFault {
        RDMA_FAULT_WR,          /* a work request failed or timed out; a QP event */
        RDMA_FAULT_LOCAL,       /* our device is fatal/removed, or its port went down */
        RDMA_FAULT_REMOTE,      /* the peer sent DOWN */
        RDMA_FAULT_NO_REMOTE,   /* the peer announced no RDMA while we had a QP */
        RDMA_FAULT_PEER_DOWN,   /* the control session ended */
} RdmaFault;

enum {
        RDMA_ACT_QP_ERROR = 1U << 0,     /* move the QP to IBV_QPS_ERR */
        RDMA_ACT_SEND_DOWN = 1U << 1,    /* tell the peer (DOWN) */
        RDMA_ACT_FINALIZE = 1U << 2,     /* destroy QP+CQ, fail every write, then call
                                          * rdma_session_finalized() */
        RDMA_ACT_CREATE_QP = 1U << 3,    /* create CQ+QP (INIT), post receives */
        RDMA_ACT_SEND_CONNECT = 1U << 4, /* our CONNECT with the QP's numbers */
        RDMA_ACT_SEND_NONE = 1U << 5,    /* CONNECT "none" */
        RDMA_ACT_CONNECT_QP = 1U << 6,   /* RTR + RTS to the peer's numbers */
        RDMA_ACT_RECONNECT = 1U << 7,    /* reset the peer's whole session */
        RDMA_ACT_CHANGED = 1U << 8,      /* the transport choice may have changed */
};

#define RDMA_FAILURE_MAX 160

typedef struct RdmaSession {
        RdmaSessionState state;
        bool peer_up;
        bool remote_announced;   /* the peer's CONNECT of this session came */
        bool remote_rdma;        /* ... and offered a QP */
        bool local_failure;      /* failure comes from our side (cleared by port active) */
        bool reconnect;          /* after the drain: reset the peer's session */
        unsigned outstanding;    /* work requests posted, not completed */
        unsigned max_outstanding;
        char failure[RDMA_FAILURE_MAX]; /* "" when none */
} RdmaSession;

void rdma_session_init(RdmaSession *s, unsigned max_outstanding);

/* The control session came up (new session: forgets the peer's last announcement and
 * any failure). local_ok: an ACTIVE RDMA port carries our route to the peer and the
 * policy allows RDMA. */
unsigned rdma_session_peer_up(RdmaSession *s, bool local_ok);
/* The peer's CONNECT: have = it offers a QP. */
unsigned rdma_session_remote(RdmaSession *s, bool have, bool local_ok);
/* A fault (reason: for the failure text of LOCAL and REMOTE faults). */
unsigned rdma_session_fault(RdmaSession *s, RdmaFault f, const char *reason);
/* Our port is usable again (IBV_EVENT_PORT_ACTIVE, or the route now has a port). */
unsigned rdma_session_local_ok(RdmaSession *s, bool local_ok);
/* The caller finished FINALIZE. */
unsigned rdma_session_finalized(RdmaSession *s, bool local_ok);

static inline bool rdma_session_can_post(const RdmaSession *s) {
        return s->state == RDMA_SESSION_READY && s->outstanding < s->max_outstanding;
}
/* Work request accounting: posted() before ibv_post_send succeeds is undone by
 * done(); done() returns FINALIZE when a drain just ended. */
void rdma_session_wr_posted(RdmaSession *s);
unsigned rdma_session_wr_done(RdmaSession *s);
