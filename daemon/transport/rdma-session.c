/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <stdio.h>
#include <string.h>

#include "transport/rdma-session.h"

static const char *const state_table[_RDMA_SESSION_STATE_MAX] = {
        [RDMA_SESSION_IDLE] = "idle",
        [RDMA_SESSION_OFFERED] = "offered",
        [RDMA_SESSION_READY] = "ready",
        [RDMA_SESSION_DRAINING] = "draining",
};

const char *rdma_session_state_to_string(RdmaSessionState s) {
        return s >= 0 && s < _RDMA_SESSION_STATE_MAX ? state_table[s] : NULL;
}

void rdma_session_init(RdmaSession *s, unsigned max_outstanding) {
        *s = (RdmaSession){ .max_outstanding = max_outstanding ? max_outstanding : 1 };
}

/* From IDLE with the peer up: offer a QP, or say "none". */
static unsigned start(RdmaSession *s, bool local_ok) {
        if (s->state != RDMA_SESSION_IDLE || !s->peer_up)
                return 0;
        if (!local_ok || s->failure[0]) {
                /* The peer drops whatever QP it offered when it reads this: an offer
                 * of its that we saw is void. */
                s->remote_announced = s->remote_rdma = false;
                return RDMA_ACT_SEND_NONE;
        }
        if (s->remote_announced && s->remote_rdma) {
                s->state = RDMA_SESSION_READY;
                return RDMA_ACT_CREATE_QP | RDMA_ACT_SEND_CONNECT | RDMA_ACT_CONNECT_QP | RDMA_ACT_CHANGED;
        }
        s->state = RDMA_SESSION_OFFERED;
        return RDMA_ACT_CREATE_QP | RDMA_ACT_SEND_CONNECT;
}

unsigned rdma_session_peer_up(RdmaSession *s, bool local_ok) {
        s->peer_up = true;
        s->remote_announced = s->remote_rdma = false;
        s->failure[0] = 0;
        s->local_failure = false;
        return start(s, local_ok) | RDMA_ACT_CHANGED;
}

static unsigned drain(RdmaSession *s) {
        if (s->state != RDMA_SESSION_OFFERED && s->state != RDMA_SESSION_READY)
                return 0;
        s->state = RDMA_SESSION_DRAINING;
        /* The peer's QP was offered for the pair that goes now: void. (A "none" stays
         * on record, so that we do not offer again to a peer without RDMA.) */
        if (s->remote_rdma)
                s->remote_announced = s->remote_rdma = false;
        return RDMA_ACT_QP_ERROR | RDMA_ACT_CHANGED | (s->outstanding == 0 ? RDMA_ACT_FINALIZE : 0);
}

unsigned rdma_session_remote(RdmaSession *s, bool have, bool local_ok) {
        s->remote_announced = true;
        s->remote_rdma = have;
        if (!have)
                return rdma_session_fault(s, RDMA_FAULT_NO_REMOTE, NULL) | RDMA_ACT_CHANGED;
        if (s->failure[0] && !s->local_failure)
                s->failure[0] = 0; /* the peer offers RDMA again after its DOWN */
        switch (s->state) {
        case RDMA_SESSION_IDLE:
                return start(s, local_ok) | RDMA_ACT_CHANGED;
        case RDMA_SESSION_OFFERED:
                s->state = RDMA_SESSION_READY;
                return RDMA_ACT_CONNECT_QP | RDMA_ACT_CHANGED;
        case RDMA_SESSION_READY:
                /* The peer replaced its QP under a live one: start over cleanly. */
                return rdma_session_fault(s, RDMA_FAULT_WR, NULL);
        default:
                return 0; /* recorded; finalize starts again from it */
        }
}

unsigned rdma_session_fault(RdmaSession *s, RdmaFault f, const char *reason) {
        unsigned a = 0;

        switch (f) {
        case RDMA_FAULT_WR:
                if (s->state == RDMA_SESSION_OFFERED || s->state == RDMA_SESSION_READY ||
                    s->state == RDMA_SESSION_DRAINING)
                        s->reconnect = s->peer_up;
                break;
        case RDMA_FAULT_LOCAL:
                if (!s->failure[0] || !s->local_failure) {
                        snprintf(s->failure, sizeof s->failure, "%s", reason && reason[0] ? reason : "RDMA device failed");
                        s->local_failure = true;
                        a |= RDMA_ACT_CHANGED;
                        if (s->peer_up && s->state != RDMA_SESSION_IDLE)
                                a |= RDMA_ACT_SEND_DOWN;
                }
                break;
        case RDMA_FAULT_REMOTE:
                if (!s->failure[0]) {
                        snprintf(s->failure, sizeof s->failure, "%s", reason && reason[0] ? reason : "the peer stopped RDMA");
                        s->local_failure = false;
                        a |= RDMA_ACT_CHANGED;
                }
                break;
        case RDMA_FAULT_NO_REMOTE:
                break;
        case RDMA_FAULT_PEER_DOWN:
                s->peer_up = false;
                s->remote_announced = s->remote_rdma = false;
                s->reconnect = false;
                a |= RDMA_ACT_CHANGED;
                break;
        }
        return a | drain(s);
}

unsigned rdma_session_local_ok(RdmaSession *s, bool local_ok) {
        unsigned a = 0;

        if (local_ok && s->local_failure) {
                s->failure[0] = 0;
                s->local_failure = false;
                a |= RDMA_ACT_CHANGED;
        }
        if (!local_ok && (s->state == RDMA_SESSION_OFFERED || s->state == RDMA_SESSION_READY))
                return a | rdma_session_fault(s, RDMA_FAULT_LOCAL, "the route to the peer no longer has an ACTIVE RDMA port");
        /* An idle session offers when the port becomes usable; not to a peer that
         * said "none" (offering again is then the peer's move, or the next
         * session's). */
        if (s->state == RDMA_SESSION_IDLE && local_ok && s->peer_up && !s->failure[0] &&
            (!s->remote_announced || s->remote_rdma))
                a |= start(s, local_ok);
        return a;
}

unsigned rdma_session_finalized(RdmaSession *s, bool local_ok) {
        unsigned a = RDMA_ACT_CHANGED;

        if (s->state != RDMA_SESSION_DRAINING)
                return 0;
        s->state = RDMA_SESSION_IDLE;
        s->outstanding = 0;
        if (s->reconnect) {
                s->reconnect = false;
                return a | RDMA_ACT_RECONNECT;
        }
        /* A session that came up again during the drain offers again now. */
        if (s->peer_up && !s->failure[0] && local_ok && (!s->remote_announced || s->remote_rdma))
                a |= start(s, local_ok);
        return a;
}

void rdma_session_wr_posted(RdmaSession *s) {
        s->outstanding++;
}

unsigned rdma_session_wr_done(RdmaSession *s) {
        if (s->outstanding > 0)
                s->outstanding--;
        return s->state == RDMA_SESSION_DRAINING && s->outstanding == 0 ? RDMA_ACT_FINALIZE : 0;
}
