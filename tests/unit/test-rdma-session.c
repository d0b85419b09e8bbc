/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The RDMA session state machine (rdma-session.h): setup over CONNECT, the drain of
 * outstanding work requests after a fault, the fallback to tcp and its recovery. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma-session.h"
#include "../check-main.h"

#define A(x) RDMA_ACT_##x

static void ready(RdmaSession *s) {
        rdma_session_init(s, 4);
        ck_assert_uint_eq(rdma_session_peer_up(s, true), A(CREATE_QP) | A(SEND_CONNECT) | A(CHANGED));
        ck_assert_int_eq(s->state, RDMA_SESSION_OFFERED);
        ck_assert(!rdma_session_can_post(s));
        ck_assert_uint_eq(rdma_session_remote(s, true, true), A(CONNECT_QP) | A(CHANGED));
        ck_assert_int_eq(s->state, RDMA_SESSION_READY);
        ck_assert(rdma_session_can_post(s));
}

START_TEST(test_setup) {
        RdmaSession s;

        ready(&s);
        /* The peer's CONNECT first: we answer with ours and connect at once. */
        rdma_session_init(&s, 4);
        s.peer_up = true;
        ck_assert_uint_eq(rdma_session_remote(&s, true, true),
                          A(CREATE_QP) | A(SEND_CONNECT) | A(CONNECT_QP) | A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_READY);

        /* No local port: "none", whatever the peer offers. */
        rdma_session_init(&s, 4);
        ck_assert_uint_eq(rdma_session_peer_up(&s, false), A(SEND_NONE) | A(CHANGED));
        ck_assert_uint_eq(rdma_session_remote(&s, true, false), A(SEND_NONE) | A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_IDLE);
        /* ... and when our port comes up, we offer (the peer dropped its QP on "none"). */
        ck_assert_uint_eq(rdma_session_local_ok(&s, true), A(CREATE_QP) | A(SEND_CONNECT));
        ck_assert_int_eq(s.state, RDMA_SESSION_OFFERED);

        /* We offered, the peer has none: the QP goes (nothing outstanding: at once). */
        rdma_session_init(&s, 4);
        (void)rdma_session_peer_up(&s, true);
        ck_assert_uint_eq(rdma_session_remote(&s, false, true), A(QP_ERROR) | A(FINALIZE) | A(CHANGED));
        ck_assert_uint_eq(rdma_session_finalized(&s, true), A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_IDLE);
        /* Not offered again to a peer that said none. */
        ck_assert_uint_eq(rdma_session_local_ok(&s, true), 0);
        ck_assert_str_eq(s.failure, "");
}
END_TEST

START_TEST(test_outstanding_bound) {
        RdmaSession s;

        ready(&s);
        for (int i = 0; i < 4; i++) {
                ck_assert(rdma_session_can_post(&s));
                rdma_session_wr_posted(&s);
        }
        ck_assert(!rdma_session_can_post(&s));
        ck_assert_uint_eq(rdma_session_wr_done(&s), 0);
        ck_assert(rdma_session_can_post(&s));
        ck_assert_uint_eq(s.outstanding, 3);
}
END_TEST

START_TEST(test_wr_error_drains_then_reconnects) {
        RdmaSession s;

        ready(&s);
        rdma_session_wr_posted(&s);
        rdma_session_wr_posted(&s);
        rdma_session_wr_posted(&s);
        /* The first failure: the QP goes to error, nothing is freed yet. */
        ck_assert_uint_eq(rdma_session_fault(&s, RDMA_FAULT_WR, NULL), A(QP_ERROR) | A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_DRAINING);
        ck_assert(!rdma_session_can_post(&s));
        /* The rest flush; only the last one finalizes. */
        ck_assert_uint_eq(rdma_session_wr_done(&s), 0);
        ck_assert_uint_eq(rdma_session_wr_done(&s), 0);
        ck_assert_uint_eq(rdma_session_fault(&s, RDMA_FAULT_WR, NULL), 0); /* a second error: no new drain */
        ck_assert_uint_eq(rdma_session_wr_done(&s), A(FINALIZE));
        ck_assert_uint_eq(rdma_session_finalized(&s, true), A(RECONNECT) | A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_IDLE);
        ck_assert_str_eq(s.failure, ""); /* not a fallback: the new session tries again */
        /* The new session sets up again. */
        ck_assert_uint_eq(rdma_session_peer_up(&s, true), A(CREATE_QP) | A(SEND_CONNECT) | A(CHANGED));
}
END_TEST

START_TEST(test_device_lost_falls_back) {
        RdmaSession s;

        ready(&s);
        rdma_session_wr_posted(&s);
        ck_assert_uint_eq(rdma_session_fault(&s, RDMA_FAULT_LOCAL, "rxe1: device removed"),
                          A(QP_ERROR) | A(SEND_DOWN) | A(CHANGED));
        ck_assert_str_eq(s.failure, "rxe1: device removed");
        ck_assert_uint_eq(rdma_session_wr_done(&s), A(FINALIZE));
        /* No reconnect, no new offer while the failure stands. */
        ck_assert_uint_eq(rdma_session_finalized(&s, true), A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_IDLE);
        ck_assert_uint_eq(rdma_session_remote(&s, true, true), A(SEND_NONE) | A(CHANGED));
        ck_assert_str_eq(s.failure, "rxe1: device removed");
        /* The port is back: the failure clears and we offer again. */
        ck_assert_uint_eq(rdma_session_local_ok(&s, true), A(CHANGED) | A(CREATE_QP) | A(SEND_CONNECT));
        ck_assert_str_eq(s.failure, "");
}
END_TEST

START_TEST(test_remote_down) {
        RdmaSession s;

        ready(&s);
        ck_assert_uint_eq(rdma_session_fault(&s, RDMA_FAULT_REMOTE, "the peer stopped RDMA: rxe0 port 1 down"),
                          A(QP_ERROR) | A(FINALIZE) | A(CHANGED));
        ck_assert_uint_eq(rdma_session_finalized(&s, true), A(CHANGED));
        ck_assert_str_eq(s.failure, "the peer stopped RDMA: rxe0 port 1 down");
        /* Our port changes do not clear the peer's failure ... */
        ck_assert_uint_eq(rdma_session_local_ok(&s, true), 0);
        /* ... the peer offering again does. */
        ck_assert_uint_eq(rdma_session_remote(&s, true, true),
                          A(CREATE_QP) | A(SEND_CONNECT) | A(CONNECT_QP) | A(CHANGED));
        ck_assert_str_eq(s.failure, "");
        ck_assert_int_eq(s.state, RDMA_SESSION_READY);
}
END_TEST

START_TEST(test_peer_down_during_drain) {
        RdmaSession s;

        ready(&s);
        rdma_session_wr_posted(&s);
        ck_assert_uint_eq(rdma_session_fault(&s, RDMA_FAULT_PEER_DOWN, NULL), A(QP_ERROR) | A(CHANGED));
        /* The session comes back before the flush: nothing starts until FINALIZE. */
        ck_assert_uint_eq(rdma_session_peer_up(&s, true), A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_DRAINING);
        ck_assert_uint_eq(rdma_session_remote(&s, true, true), 0);
        ck_assert_uint_eq(rdma_session_wr_done(&s), A(FINALIZE));
        /* Then we offer and connect to the offer that came meanwhile. */
        ck_assert_uint_eq(rdma_session_finalized(&s, true),
                          A(CREATE_QP) | A(SEND_CONNECT) | A(CONNECT_QP) | A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_READY);

        /* A peer that goes down while idle changes nothing but the announcement. */
        rdma_session_init(&s, 4);
        ck_assert_uint_eq(rdma_session_fault(&s, RDMA_FAULT_PEER_DOWN, NULL), A(CHANGED));
        ck_assert_int_eq(s.state, RDMA_SESSION_IDLE);
}
END_TEST

START_TEST(test_route_loses_port) {
        RdmaSession s;

        ready(&s);
        ck_assert_uint_eq(rdma_session_local_ok(&s, false),
                          A(QP_ERROR) | A(SEND_DOWN) | A(FINALIZE) | A(CHANGED));
        ck_assert_ptr_nonnull(strstr(s.failure, "no longer has an ACTIVE RDMA port"));
        /* A CONNECT_QP on a QP that was replaced restarts cleanly. */
        ready(&s);
        ck_assert_uint_eq(rdma_session_remote(&s, true, true), A(QP_ERROR) | A(FINALIZE) | A(CHANGED));
        ck_assert_uint_eq(rdma_session_finalized(&s, true), A(RECONNECT) | A(CHANGED));
        ck_assert_str_eq(rdma_session_state_to_string(RDMA_SESSION_DRAINING), "draining");
}
END_TEST

int main(void) {
        Suite *su = suite_create("rdma-session");
        TCase *tc = tcase_create("rdma-session");
        tcase_add_test(tc, test_setup);
        tcase_add_test(tc, test_outstanding_bound);
        tcase_add_test(tc, test_wr_error_drains_then_reconnects);
        tcase_add_test(tc, test_device_lost_falls_back);
        tcase_add_test(tc, test_remote_down);
        tcase_add_test(tc, test_peer_down_during_drain);
        tcase_add_test(tc, test_route_loses_port);
        suite_add_tcase(su, tc);
        return check_run(su, CK_FORK_GETENV);
}
