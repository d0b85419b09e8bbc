/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "handoff/handoff.h"
#include "macro.h"
#include "../check-main.h"

static const uint64_t bytes2[2] = { 100, 50 };

static EpdId rid(uint8_t v) {
        EpdId id = {};
        memset(id.bytes, v, sizeof id.bytes);
        return id;
}

/* Source states reachable with legal events, in this order. */
enum { S_PREPARING, S_PREPARED, S_TRANSFERRING, S_TRANSFERRED, S_COMMITTED, S_ROLLED_BACK,
       S_RELEASED, _S_MAX };
static const HandoffState src_states[_S_MAX] = {
        HANDOFF_PREPARING, HANDOFF_PREPARED, HANDOFF_TRANSFERRING, HANDOFF_TRANSFERRED,
        HANDOFF_COMMITTED, HANDOFF_ROLLED_BACK, HANDOFF_RELEASED,
};

static Handoff *source_in(int s) {
        EpdId id = rid(1);
        Handoff *h = NULL;
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 7, 2, bytes2, 1000, 5000, &h), 0);
        ck_assert_int_eq(h->state, HANDOFF_PREPARING);
        if (s == S_PREPARING)
                return h;
        ck_assert_int_eq(handoff_prepared(h), 1);
        if (s == S_PREPARED)
                return h;
        if (s == S_ROLLED_BACK) {
                ck_assert_int_eq(handoff_rollback(h, HANDOFF_CAUSE_REQUESTED, false), 1);
                return h;
        }
        ck_assert_int_eq(handoff_group_ready(h, 0), 1);
        ck_assert_int_eq(handoff_group_posted(h, 0, 1), 1);
        ck_assert_int_eq(h->state, HANDOFF_TRANSFERRING);
        if (s == S_TRANSFERRING)
                return h;
        ck_assert_int_eq(handoff_write_done(h, 0, 100, 0), 1);
        ck_assert_int_eq(handoff_group_ready(h, 1), 1);
        ck_assert_int_eq(handoff_group_posted(h, 1, 1), 1);
        ck_assert_int_eq(handoff_write_done(h, 1, 50, 0), 1);
        ck_assert_int_eq(h->state, HANDOFF_TRANSFERRED);
        if (s == S_TRANSFERRED)
                return h;
        ck_assert_int_eq(handoff_commit(h, 0), 1);
        if (s == S_COMMITTED)
                return h;
        ck_assert_int_eq(handoff_release(h), 1);
        return h;
}

enum { D_PREPARED, D_TRANSFERRING, D_TRANSFERRED, D_COMMITTED, D_ROLLED_BACK, D_RELEASED, _D_MAX };
static const HandoffState dst_states[_D_MAX] = {
        HANDOFF_PREPARED, HANDOFF_TRANSFERRING, HANDOFF_TRANSFERRED,
        HANDOFF_COMMITTED, HANDOFF_ROLLED_BACK, HANDOFF_RELEASED,
};

static Handoff *destination_in(int s) {
        EpdId id = rid(2);
        Handoff *h = NULL;
        ck_assert_int_eq(handoff_new(HANDOFF_DESTINATION, &id, 9, 2, bytes2, 1000, 5000, &h), 0);
        ck_assert_int_eq(h->state, HANDOFF_PREPARED);
        if (s == D_PREPARED)
                return h;
        if (s == D_ROLLED_BACK) {
                ck_assert_int_eq(handoff_rollback(h, HANDOFF_CAUSE_REQUESTED, false), 1);
                return h;
        }
        ck_assert_int_eq(handoff_write_landing(h, 0), 1);
        ck_assert_int_eq(h->state, HANDOFF_TRANSFERRING);
        if (s == D_TRANSFERRING)
                return h;
        ck_assert_int_eq(handoff_write_landed(h, 0, 100, 0), 1);
        ck_assert_int_eq(handoff_group_sent_notice(h, 0, 100), 1);
        ck_assert_int_eq(handoff_write_landing(h, 1), 1);
        ck_assert_int_eq(handoff_write_landed(h, 1, 50, 0), 1);
        ck_assert_int_eq(handoff_group_sent_notice(h, 1, 50), 1);
        ck_assert_int_eq(h->state, HANDOFF_TRANSFERRED);
        if (s == D_TRANSFERRED)
                return h;
        ck_assert_int_eq(handoff_accept(h, 42), 1);
        ck_assert_int_eq(handoff_commit(h, 42), 1);
        if (s == D_COMMITTED)
                return h;
        ck_assert_int_eq(handoff_release(h), 1);
        return h;
}

/* Applies one event to a handoff freshly put in each state; checks the return code and
 * that an illegal event (negative) changed nothing. */
typedef int (*event_fn)(Handoff *h);

static void check_matrix(Handoff *(*make)(int), int n, const HandoffState *states,
                         event_fn ev, const int *expect, const char *name) {
        for (int s = 0; s < n; s++) {
                Handoff *h = make(s);
                ck_assert_int_eq(h->state, states[s]);
                Handoff before = *h;
                int r = ev(h);
                ck_assert_msg(r == expect[s], "%s in %s: got %d, want %d", name,
                              handoff_state_to_string(states[s]), r, expect[s]);
                if (r < 0) {
                        ck_assert_int_eq(h->state, before.state);
                        ck_assert_int_eq(h->cause, before.cause);
                        ck_assert_uint_eq(h->inflight, before.inflight);
                        ck_assert_uint_eq(h->n_done, before.n_done);
                        ck_assert_uint_eq(h->accepted_by, before.accepted_by);
                }
                handoff_free(h);
        }
}

static int ev_prepared(Handoff *h) { return handoff_prepared(h); }
static int ev_commit0(Handoff *h) { return handoff_commit(h, 0); }
static int ev_commit42(Handoff *h) { return handoff_commit(h, 42); }
static int ev_commit43(Handoff *h) { return handoff_commit(h, 43); }
static int ev_accept42(Handoff *h) { return handoff_accept(h, 42); }
static int ev_accept43(Handoff *h) { return handoff_accept(h, 43); }
static int ev_accept0(Handoff *h) { return handoff_accept(h, 0); }
static int ev_rollback(Handoff *h) { return handoff_rollback(h, HANDOFF_CAUSE_REQUESTED, false); }
static int ev_rollback_none(Handoff *h) { return handoff_rollback(h, HANDOFF_CAUSE_NONE, false); }
static int ev_release(Handoff *h) { return handoff_release(h); }
static int ev_ready0(Handoff *h) { return handoff_group_ready(h, 0); }
static int ev_ready1(Handoff *h) { return handoff_group_ready(h, 1); }
static int ev_ready9(Handoff *h) { return handoff_group_ready(h, 9); }
static int ev_posted0(Handoff *h) { return handoff_group_posted(h, 0, 3); }
static int ev_write_done0(Handoff *h) { return handoff_write_done(h, 0, 100, 0); }
static int ev_landing0(Handoff *h) { return handoff_write_landing(h, 0); }
static int ev_landing1(Handoff *h) { return handoff_write_landing(h, 1); }
static int ev_landed1(Handoff *h) { return handoff_write_landed(h, 1, 50, 0); }
static int ev_notice0(Handoff *h) { return handoff_group_sent_notice(h, 0, 100); }
static int ev_notice0_bad(Handoff *h) { return handoff_group_sent_notice(h, 0, 99); }
static int ev_handed1(Handoff *h) { return handoff_group_handed_over(h, 1); }
static int ev_timeout(Handoff *h) { return handoff_check_timeout(h, 1000 + 5000); }
static int ev_not_yet(Handoff *h) { return handoff_check_timeout(h, 1000 + 4999); }

#define SRC(ev, ...)                                                                     \
        do {                                                                             \
                const int _e[_S_MAX] = { __VA_ARGS__ };                                  \
                check_matrix(source_in, _S_MAX, src_states, ev, _e, #ev);                \
        } while (0)
#define DST(ev, ...)                                                                     \
        do {                                                                             \
                const int _e[_D_MAX] = { __VA_ARGS__ };                                  \
                check_matrix(destination_in, _D_MAX, dst_states, ev, _e, #ev);           \
        } while (0)

START_TEST(test_source_matrix) {
        /*                   PREPARING PREPARED TRANSFERRING TRANSFERRED COMMITTED ROLLED_BACK RELEASED */
        SRC(ev_prepared,      1,       0,       0,           0,          0,        -ESTALE,    -ESTALE);
        SRC(ev_commit0,       -EBUSY,  -EBUSY,  -EBUSY,      1,          0,        -ESTALE,    -ESTALE);
        SRC(ev_commit42,      -EPERM,  -EPERM,  -EPERM,      -EPERM,     -EPERM,   -EPERM,     -EPERM);
        SRC(ev_accept42,      -EPERM,  -EPERM,  -EPERM,      -EPERM,     -EPERM,   -EPERM,     -EPERM);
        SRC(ev_rollback,      1,       1,       1,           1,          -EALREADY, 0,         -ESTALE);
        SRC(ev_rollback_none, -EINVAL, -EINVAL, -EINVAL,     -EINVAL,    -EINVAL,  -EINVAL,    -EINVAL);
        SRC(ev_release,       1,       1,       1,           1,          1,        1,          0);
        SRC(ev_ready0,        1,       1,       0,           0,          0,        -ESTALE,    -ESTALE);
        SRC(ev_ready1,        -EINVAL, -EINVAL, 1,           0,          0,        -ESTALE,    -ESTALE);
        SRC(ev_ready9,        -EINVAL, -EINVAL, -EINVAL,     -EINVAL,    -EINVAL,  -EINVAL,    -EINVAL);
        SRC(ev_posted0,       -EBUSY,  -EINVAL, 0,           0,          0,        -ESTALE,    0);
        SRC(ev_write_done0,   -EINVAL, -EINVAL, 1,           -EINVAL,    -EINVAL,  -EINVAL,    -EINVAL);
        SRC(ev_landing0,      -EPERM,  -EPERM,  -EPERM,      -EPERM,     -EPERM,   -EPERM,     -EPERM);
        SRC(ev_notice0,       -EPERM,  -EPERM,  -EPERM,      -EPERM,     -EPERM,   -EPERM,     -EPERM);
        SRC(ev_handed1,       -EPERM,  -EPERM,  -EPERM,      -EPERM,     -EPERM,   -EPERM,     -EPERM);
        SRC(ev_timeout,       1,       1,       1,           1,          0,        0,          0);
        SRC(ev_not_yet,       0,       0,       0,           0,          0,        0,          0);
}
END_TEST

START_TEST(test_destination_matrix) {
        /*                   PREPARED TRANSFERRING TRANSFERRED COMMITTED ROLLED_BACK RELEASED */
        DST(ev_prepared,      -EPERM,  -EPERM,     -EPERM,     -EPERM,   -EPERM,     -EPERM);
        DST(ev_ready0,        -EPERM,  -EPERM,     -EPERM,     -EPERM,   -EPERM,     -EPERM);
        DST(ev_posted0,       -EPERM,  -EPERM,     -EPERM,     -EPERM,   -EPERM,     -EPERM);
        DST(ev_accept42,      1,       1,          1,          0,        -ESTALE,    -ESTALE);
        DST(ev_accept43,      1,       1,          1,          -EPERM,   -ESTALE,    -ESTALE);
        DST(ev_accept0,       -EINVAL, -EINVAL,    -EINVAL,    -EINVAL,  -EINVAL,    -EINVAL);
        DST(ev_commit42,      -EBUSY,  -EBUSY,     -EBUSY,     0,        -ESTALE,    -ESTALE);
        DST(ev_commit43,      -EBUSY,  -EBUSY,     -EBUSY,     -EPERM,   -ESTALE,    -ESTALE);
        DST(ev_commit0,       -EPERM,  -EPERM,     -EPERM,     -EPERM,   -EPERM,     -EPERM);
        DST(ev_rollback,      1,       1,          1,          -EALREADY, 0,         -ESTALE);
        DST(ev_release,       1,       1,          1,          1,        1,          0);
        DST(ev_landing0,      1,       1,          -EINVAL,    -ESTALE,  -ESTALE,    -ESTALE);
        DST(ev_landing1,      1,       1,          -EINVAL,    -ESTALE,  -ESTALE,    -ESTALE);
        DST(ev_landed1,       -EINVAL, -EINVAL,    -EINVAL,    -EINVAL,  -EINVAL,    -EINVAL);
        DST(ev_notice0,       1,       1,          0,          0,        -ESTALE,    0);
        DST(ev_notice0_bad,   -EINVAL, -EINVAL,    -EINVAL,    -EINVAL,  -ESTALE,    -EINVAL);
        DST(ev_handed1,       1,       1,          0,          0,        -ESTALE,    0);
        DST(ev_write_done0,   -EPERM,  -EPERM,     -EPERM,     -EPERM,   -EPERM,     -EPERM);
        DST(ev_timeout,       1,       1,          1,          0,        0,          0);
        DST(ev_not_yet,       0,       0,          0,          0,        0,          0);
}
END_TEST

START_TEST(test_new_invalid) {
        EpdId id = rid(3), null = {};
        Handoff *h = NULL;
        uint64_t huge[2] = { UINT64_MAX, 1 };
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &null, 1, 1, NULL, 0, 0, &h), -EINVAL);
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 0, 1, NULL, 0, 0, &h), -EINVAL);
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 1, 0, NULL, 0, 0, &h), -EINVAL);
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 1, HANDOFF_GROUPS_MAX + 1, NULL, 0, 0, &h), -EINVAL);
        ck_assert_int_eq(handoff_new(_HANDOFF_ROLE_MAX, &id, 1, 1, NULL, 0, 0, &h), -EINVAL);
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, NULL, 1, 1, NULL, 0, 0, &h), -EINVAL);
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 1, 2, huge, 0, 0, &h), -EOVERFLOW);
        ck_assert_ptr_null(h);
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 1, HANDOFF_GROUPS_MAX, NULL, 0, 0, &h), 0);
        ck_assert_uint_eq(h->deadline_usec, USEC_INFINITY);
        ck_assert_int_eq(handoff_check_timeout(h, UINT64_MAX - 1), 0);
        h = handoff_free(h);
        /* A deadline past the end of time is none. */
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 1, 1, NULL, UINT64_MAX - 5, 10, &h), 0);
        ck_assert_uint_eq(h->deadline_usec, USEC_INFINITY);
        handoff_free(h);
        ck_assert_ptr_null(handoff_free(NULL));
}
END_TEST

START_TEST(test_identity) {
        EpdId a = rid(4), b = rid(5);
        Handoff *h = NULL;
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &a, 77, 1, NULL, 0, 0, &h), 0);
        ck_assert(handoff_matches(h, &a, 77));
        ck_assert(!handoff_matches(h, &a, 76));
        ck_assert(!handoff_matches(h, &b, 77));
        /* The identity survives prepare -> commit -> release. */
        ck_assert_int_eq(handoff_prepared(h), 1);
        ck_assert_int_eq(handoff_group_ready(h, 0), 1);
        ck_assert_int_eq(handoff_group_posted(h, 0, 0), 1);
        ck_assert_int_eq(handoff_commit(h, 0), 1);
        ck_assert_int_eq(handoff_release(h), 1);
        ck_assert(handoff_matches(h, &a, 77));
        handoff_free(h);

        uint64_t t1 = handoff_next_token(0, 1000);
        uint64_t t2 = handoff_next_token(t1, 1000);
        uint64_t t3 = handoff_next_token(t2, 5); /* the clock went back */
        ck_assert_uint_eq(t1, 1000);
        ck_assert_uint_gt(t2, t1);
        ck_assert_uint_gt(t3, t2);
        ck_assert_uint_ne(handoff_next_token(UINT64_MAX, 0), 0);
}
END_TEST

START_TEST(test_source_progress_in_order) {
        EpdId id = rid(6);
        uint64_t bytes[4] = { 10, 20, 30, 40 };
        Handoff *h = NULL;
        uint32_t g, from, to;
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 1, 4, bytes, 0, 0, &h), 0);

        /* Ready before the destination answered: recorded, not postable yet. */
        ck_assert_int_eq(handoff_group_ready(h, 1), -EINVAL); /* out of order */
        ck_assert_int_eq(handoff_group_ready(h, 0), 1);
        ck_assert_int_eq(handoff_group_ready(h, 0), 0);
        ck_assert_int_eq(handoff_next_to_post(h, &g), -EAGAIN);
        ck_assert_int_eq(handoff_group_posted(h, 0, 1), -EBUSY);
        ck_assert_int_eq(handoff_prepared(h), 1);
        ck_assert_int_eq(handoff_next_to_post(h, &g), 0);
        ck_assert_uint_eq(g, 0);
        ck_assert_int_eq(handoff_group_posted(h, 1, 1), -EINVAL); /* not ready */
        ck_assert_int_eq(handoff_group_posted(h, 0, 2), 1);
        ck_assert_int_eq(handoff_group_posted(h, 0, 2), 0);
        ck_assert_int_eq(handoff_next_to_post(h, &g), -EAGAIN);
        for (uint32_t i = 1; i < 4; i++) {
                ck_assert_int_eq(handoff_group_ready(h, i), 1);
                ck_assert_int_eq(handoff_next_to_post(h, &g), 0);
                ck_assert_uint_eq(g, i);
                ck_assert_int_eq(handoff_group_posted(h, i, 1), 1);
        }
        ck_assert_uint_eq(h->inflight, 5);

        /* Group 3 finishes first: nothing to announce yet. */
        ck_assert_int_eq(handoff_write_done(h, 3, 40, 0), 1);
        ck_assert_int_eq(h->groups[3].state, HANDOFF_GROUP_SENT);
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 0);
        /* Group 0 in two writes. */
        ck_assert_int_eq(handoff_write_done(h, 0, 4, 0), 1);
        ck_assert_int_eq(h->groups[0].state, HANDOFF_GROUP_POSTED);
        ck_assert_int_eq(handoff_write_done(h, 0, 6, 0), 1);
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 1);
        ck_assert_uint_eq(from, 0);
        ck_assert_uint_eq(to, 1);
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 0);
        ck_assert_int_eq(handoff_write_done(h, 2, 30, 0), 1);
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 0);
        ck_assert_int_eq(h->state, HANDOFF_TRANSFERRING);
        ck_assert_int_eq(handoff_write_done(h, 1, 20, 0), 1);
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 1);
        ck_assert_uint_eq(from, 1);
        ck_assert_uint_eq(to, 4);
        ck_assert_int_eq(h->state, HANDOFF_TRANSFERRED);
        ck_assert_uint_eq(h->inflight, 0);
        ck_assert_int_eq(handoff_write_done(h, 1, 20, 0), -EINVAL); /* no write pending */
        ck_assert_int_eq(handoff_commit(h, 0), 1);
        ck_assert(!handoff_can_free(h));
        ck_assert_int_eq(handoff_release(h), 1);
        ck_assert(handoff_can_free(h));
        handoff_free(h);
}
END_TEST

START_TEST(test_source_write_failure) {
        EpdId id = rid(7);
        uint64_t bytes[2] = { 10, 10 };
        Handoff *h = NULL;
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 1, 2, bytes, 0, 0, &h), 0);
        ck_assert_int_eq(handoff_prepared(h), 1);
        ck_assert_int_eq(handoff_group_ready(h, 0), 1);
        ck_assert_int_eq(handoff_group_posted(h, 0, 3), 1);
        ck_assert_int_eq(handoff_write_done(h, 0, 0, -EIO), 1);
        ck_assert_int_eq(h->state, HANDOFF_ROLLED_BACK);
        ck_assert_int_eq(h->cause, HANDOFF_CAUSE_TRANSFER_FAILED);
        ck_assert(!h->remote_rolled_back);
        /* Two writes may still land: not freeable, even once released. */
        ck_assert_int_eq(handoff_release(h), 1);
        ck_assert(!handoff_can_free(h));
        ck_assert_int_eq(handoff_write_done(h, 0, 5, 0), 1);
        ck_assert(!handoff_can_free(h));
        ck_assert_int_eq(handoff_write_done(h, 0, 0, -ECANCELED), 1);
        ck_assert(handoff_can_free(h));
        ck_assert_int_eq(handoff_write_done(h, 0, 0, 0), -EINVAL);
        ck_assert_int_eq(h->cause, HANDOFF_CAUSE_TRANSFER_FAILED);
        handoff_free(h);

        /* Bytes that do not add up roll back too. */
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 2, 2, bytes, 0, 0, &h), 0);
        ck_assert_int_eq(handoff_prepared(h), 1);
        ck_assert_int_eq(handoff_group_ready(h, 0), 1);
        ck_assert_int_eq(handoff_group_posted(h, 0, 1), 1);
        ck_assert_int_eq(handoff_write_done(h, 0, 9, 0), 1);
        ck_assert_int_eq(h->state, HANDOFF_ROLLED_BACK);
        handoff_free(h);
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 3, 2, bytes, 0, 0, &h), 0);
        ck_assert_int_eq(handoff_prepared(h), 1);
        ck_assert_int_eq(handoff_group_ready(h, 0), 1);
        ck_assert_int_eq(handoff_group_posted(h, 0, 2), 1);
        ck_assert_int_eq(handoff_write_done(h, 0, 11, 0), 1);
        ck_assert_int_eq(h->state, HANDOFF_ROLLED_BACK);
        ck_assert_int_eq(handoff_write_done(h, 0, 11, 0), 1);
        ck_assert(handoff_can_free(h));
        handoff_free(h);
}
END_TEST

START_TEST(test_destination_landing) {
        EpdId id = rid(8);
        uint64_t bytes[3] = { 100, 100, 100 };
        Handoff *h = NULL;
        uint32_t from, to;
        ck_assert_int_eq(handoff_new(HANDOFF_DESTINATION, &id, 1, 3, bytes, 0, 0, &h), 0);
        ck_assert(handoff_may_land(h, 0));
        ck_assert(!handoff_may_land(h, 3));

        /* Notice before the bytes: not received until they landed. */
        ck_assert_int_eq(handoff_group_sent_notice(h, 0, 100), 1);
        ck_assert_int_eq(h->groups[0].state, HANDOFF_GROUP_PENDING);
        ck_assert_int_eq(handoff_write_landing(h, 0), 1);
        ck_assert_int_eq(handoff_write_landing(h, 0), 1);
        ck_assert_int_eq(handoff_write_landed(h, 0, 60, 0), 1);
        ck_assert_int_eq(h->groups[0].state, HANDOFF_GROUP_PENDING);
        ck_assert_int_eq(handoff_write_landed(h, 0, 40, 0), 1);
        ck_assert_int_eq(h->groups[0].state, HANDOFF_GROUP_RECEIVED);
        ck_assert(!handoff_may_land(h, 0));
        ck_assert_int_eq(handoff_write_landing(h, 0), -EINVAL);
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 1);
        ck_assert_uint_eq(to, 1);

        /* Group 2 before group 1: progress waits for 1. */
        ck_assert_int_eq(handoff_group_handed_over(h, 2), 1);
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 0);
        ck_assert_int_eq(handoff_write_landing(h, 1), 1);
        ck_assert_int_eq(handoff_group_handed_over(h, 1), -EBUSY);
        ck_assert_int_eq(handoff_write_landed(h, 1, 100, 0), 1);
        ck_assert_int_eq(handoff_group_sent_notice(h, 1, 99), -EINVAL);
        ck_assert_int_eq(handoff_group_sent_notice(h, 1, 100), 1);
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 1);
        ck_assert_uint_eq(from, 1);
        ck_assert_uint_eq(to, 3);
        ck_assert_int_eq(h->state, HANDOFF_TRANSFERRED);

        ck_assert_int_eq(handoff_commit(h, 5), -EBUSY); /* not accepted */
        ck_assert_int_eq(handoff_accept(h, 5), 1);
        ck_assert_int_eq(handoff_accept(h, 5), 0);
        ck_assert_int_eq(handoff_accept(h, 6), -EPERM);
        ck_assert_int_eq(handoff_commit(h, 6), -EPERM);
        ck_assert_int_eq(handoff_commit(h, 5), 1);
        ck_assert_int_eq(handoff_commit(h, 5), 0);
        ck_assert_int_eq(handoff_rollback(h, HANDOFF_CAUSE_PEER_DOWN, true), -EALREADY);
        ck_assert_int_eq(handoff_release(h), 1);
        ck_assert(handoff_can_free(h));
        handoff_free(h);
}
END_TEST

/* Completions that stand for several writes (a transport's merged completion): counted
 * by n on both sides; n of 0 or more than pending is refused with nothing counted. */
START_TEST(test_counted_writes) {
        EpdId id = rid(9);
        uint64_t bytes[1] = { 8192 };
        Handoff *s = NULL, *d = NULL;
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 1, 1, bytes, 0, 0, &s), 0);
        ck_assert_int_eq(handoff_new(HANDOFF_DESTINATION, &id, 1, 1, bytes, 0, 0, &d), 0);
        ck_assert_int_eq(handoff_prepared(s), 1);
        ck_assert_int_eq(handoff_group_ready(s, 0), 1);
        ck_assert_int_eq(handoff_group_posted(s, 0, 4096), 1);
        ck_assert_int_eq(handoff_writes_landing(d, 0, 4096), 1);
        ck_assert_uint_eq(d->groups[0].writes_pending, 4096);
        ck_assert_uint_eq(d->inflight, 4096);
        ck_assert_int_eq(handoff_writes_landing(d, 0, 0), -EINVAL);
        ck_assert_int_eq(handoff_writes_landing(d, 0, UINT32_MAX), -EINVAL); /* would wrap */

        ck_assert_int_eq(handoff_writes_done(s, 0, 0, 0, 0), -EINVAL);
        ck_assert_int_eq(handoff_writes_done(s, 0, 4097, 8192, 0), -EINVAL);
        ck_assert_uint_eq(s->groups[0].writes_pending, 4096);
        ck_assert_int_eq(handoff_writes_done(s, 0, 4000, 8000, 0), 1);
        ck_assert_int_eq(s->state, HANDOFF_TRANSFERRING);
        ck_assert_int_eq(handoff_writes_done(s, 0, 96, 192, 0), 1);
        ck_assert_int_eq(s->state, HANDOFF_TRANSFERRED);
        ck_assert_uint_eq(s->inflight, 0);

        ck_assert_int_eq(handoff_writes_landed(d, 0, 4097, 8192, 0), -EINVAL);
        ck_assert_int_eq(handoff_writes_landed(d, 0, 4096, 8192, 0), 1);
        ck_assert_int_eq(handoff_group_sent_notice(d, 0, 8192), 1);
        ck_assert_int_eq(d->groups[0].state, HANDOFF_GROUP_RECEIVED);
        ck_assert_uint_eq(d->inflight, 0);
        handoff_free(s);
        handoff_free(d);
}
END_TEST

START_TEST(test_destination_rollback_while_landing) {
        EpdId id = rid(9);
        uint64_t bytes[1] = { 100 };
        Handoff *h = NULL;
        ck_assert_int_eq(handoff_new(HANDOFF_DESTINATION, &id, 1, 1, bytes, 0, 0, &h), 0);
        ck_assert_int_eq(handoff_accept(h, 3), 1);
        ck_assert_int_eq(handoff_write_landing(h, 0), 1);
        ck_assert_int_eq(handoff_rollback(h, HANDOFF_CAUSE_PEER_DOWN, true), 1);
        ck_assert(h->remote_rolled_back);
        ck_assert_int_eq(handoff_rollback(h, HANDOFF_CAUSE_TIMEOUT, false), 0);
        ck_assert_int_eq(h->cause, HANDOFF_CAUSE_PEER_DOWN); /* the first cause stays */
        /* No new write may start; the one in flight keeps the pages. */
        ck_assert(!handoff_may_land(h, 0));
        ck_assert_int_eq(handoff_write_landing(h, 0), -ESTALE);
        ck_assert_int_eq(handoff_release(h), 1);
        ck_assert(!handoff_can_free(h));
        ck_assert_int_eq(handoff_write_landed(h, 0, 100, 0), 1);
        ck_assert(handoff_can_free(h));
        uint32_t from, to;
        ck_assert_int_eq(handoff_take_progress(h, &from, &to), 0);
        handoff_free(h);

        /* Too many bytes is a protocol error. */
        ck_assert_int_eq(handoff_new(HANDOFF_DESTINATION, &id, 2, 1, bytes, 0, 0, &h), 0);
        ck_assert_int_eq(handoff_write_landing(h, 0), 1);
        ck_assert_int_eq(handoff_write_landed(h, 0, 101, 0), 1);
        ck_assert_int_eq(h->state, HANDOFF_ROLLED_BACK);
        ck_assert_int_eq(h->cause, HANDOFF_CAUSE_PROTOCOL);
        handoff_free(h);

        /* A failed incoming write. */
        ck_assert_int_eq(handoff_new(HANDOFF_DESTINATION, &id, 3, 1, bytes, 0, 0, &h), 0);
        ck_assert_int_eq(handoff_write_landing(h, 0), 1);
        ck_assert_int_eq(handoff_write_landed(h, 0, 0, -ECONNRESET), 1);
        ck_assert_int_eq(h->cause, HANDOFF_CAUSE_TRANSFER_FAILED);
        ck_assert(handoff_can_free(h));
        handoff_free(h);
}
END_TEST

START_TEST(test_timeout_and_release) {
        EpdId id = rid(10);
        Handoff *h = NULL;
        ck_assert_int_eq(handoff_new(HANDOFF_DESTINATION, &id, 1, 1, NULL, 100, 50, &h), 0);
        ck_assert_uint_eq(h->deadline_usec, 150);
        ck_assert_int_eq(handoff_check_timeout(h, 149), 0);
        ck_assert_int_eq(handoff_check_timeout(h, 150), 1);
        ck_assert_int_eq(h->cause, HANDOFF_CAUSE_TIMEOUT);
        ck_assert_int_eq(handoff_check_timeout(h, 151), 0);
        handoff_free(h);

        /* Release of a live handoff rolls it back first. */
        ck_assert_int_eq(handoff_new(HANDOFF_SOURCE, &id, 2, 1, NULL, 0, 0, &h), 0);
        ck_assert_int_eq(handoff_release(h), 1);
        ck_assert_int_eq(h->state, HANDOFF_RELEASED);
        ck_assert_int_eq(h->cause, HANDOFF_CAUSE_REQUESTED);
        ck_assert(handoff_is_ended(h));
        ck_assert(!handoff_is_live(h));
        ck_assert_int_eq(handoff_release(h), 0);
        ck_assert_int_eq(handoff_rollback(h, HANDOFF_CAUSE_REQUESTED, false), -ESTALE);
        handoff_free(h);
}
END_TEST

START_TEST(test_strings) {
        for (int s = 0; s < _HANDOFF_STATE_MAX; s++) {
                ck_assert_ptr_nonnull(handoff_state_to_string(s));
                ck_assert_int_eq(handoff_state_from_string(handoff_state_to_string(s)), s);
        }
        for (int c = 0; c < _HANDOFF_CAUSE_MAX; c++) {
                ck_assert_ptr_nonnull(handoff_cause_to_string(c));
                ck_assert_int_eq(handoff_cause_from_string(handoff_cause_to_string(c)), c);
        }
        for (int g = 0; g < _HANDOFF_GROUP_STATE_MAX; g++)
                ck_assert_ptr_nonnull(handoff_group_state_to_string(g));
        ck_assert_str_eq(handoff_role_to_string(HANDOFF_DESTINATION), "destination");
        ck_assert_ptr_null(handoff_state_to_string(_HANDOFF_STATE_MAX));
        ck_assert_ptr_null(handoff_state_to_string(-1));
        ck_assert_int_eq(handoff_state_from_string("bogus"), -EINVAL);
        ck_assert_int_eq(handoff_cause_from_string(NULL), -EINVAL);
}
END_TEST

START_TEST(test_layout_validate) {
        HandoffGroupLayout l = { .n_ranges = 2, .ranges = { { 0, 100 }, { 200, 100 } } };
        ck_assert_int_eq(handoff_group_layout_validate(&l, 300), 0);
        ck_assert_uint_eq(handoff_group_layout_bytes(&l), 200);
        ck_assert_int_eq(handoff_group_layout_validate(&l, 299), -EINVAL);
        ck_assert_int_eq(handoff_group_layout_validate(&l, 0), -EINVAL);
        l.ranges[1].offset = 50; /* overlap */
        ck_assert_int_eq(handoff_group_layout_validate(&l, 300), -EINVAL);
        l.ranges[1].offset = 100; /* touching is fine */
        ck_assert_int_eq(handoff_group_layout_validate(&l, 300), 0);
        HandoffGroupLayout u = { .n_ranges = 2, .ranges = { { 200, 10 }, { 0, 10 } } };
        ck_assert_int_eq(handoff_group_layout_validate(&u, 300), -EINVAL);
        HandoffGroupLayout z = { .n_ranges = 1, .ranges = { { 0, 0 } } };
        ck_assert_int_eq(handoff_group_layout_validate(&z, 300), -EINVAL);
        HandoffGroupLayout o = { .n_ranges = 1, .ranges = { { UINT64_MAX, 2 } } };
        ck_assert_int_eq(handoff_group_layout_validate(&o, UINT64_MAX), -EINVAL);
        HandoffGroupLayout e = { .n_ranges = 0 };
        ck_assert_int_eq(handoff_group_layout_validate(&e, 300), -EINVAL);
        e.n_ranges = HANDOFF_RANGES_PER_GROUP_MAX + 1;
        ck_assert_int_eq(handoff_group_layout_validate(&e, 300), -EINVAL);
}
END_TEST

typedef struct Collected {
        HandoffSlice s[256];
        int n;
        int fail_at;
} Collected;

static int collect(const HandoffSlice *s, void *userdata) {
        Collected *c = userdata;
        if (c->n == c->fail_at)
                return -ENOBUFS;
        ck_assert_int_lt(c->n, 256);
        c->s[c->n++] = *s;
        return 0;
}

START_TEST(test_plan_slicing) {
        /* Page 1000 bytes; the group is [100,300) and [600,700) of each page. */
        HandoffGroupLayout l = { .n_ranges = 2, .ranges = { { 100, 200 }, { 600, 100 } } };
        uint64_t src[3] = { 0, 1000, 5000 }, dst[3] = { 10000, 20000, 21000 };
        Collected c = { .fail_at = -1 };
        ck_assert_int_eq(handoff_plan_group(&l, src, dst, 3, 0, collect, &c), 6);
        ck_assert_int_eq(c.n, 6);
        ck_assert_uint_eq(c.s[0].src_offset, 100);
        ck_assert_uint_eq(c.s[0].dst_offset, 10100);
        ck_assert_uint_eq(c.s[0].length, 200);
        ck_assert_uint_eq(c.s[5].src_offset, 5600);
        ck_assert_uint_eq(c.s[5].dst_offset, 21600);
        uint64_t sum = 0;
        for (int i = 0; i < c.n; i++)
                sum += c.s[i].length;
        ck_assert_uint_eq(sum, 3 * handoff_group_layout_bytes(&l));

        /* Slicing: 64-byte slices, every byte once, in order. */
        c = (Collected) { .fail_at = -1 };
        ck_assert_int_eq(handoff_plan_group(&l, src, dst, 3, 64, collect, &c), 3 * (4 + 2));
        sum = 0;
        for (int i = 0; i < c.n; i++) {
                ck_assert_uint_le(c.s[i].length, 64);
                ck_assert_uint_gt(c.s[i].length, 0);
                ck_assert_uint_eq(c.s[i].dst_offset - c.s[i].src_offset,
                                  c.s[i].src_offset < 1000 ? 10000 : c.s[i].src_offset < 5000 ? 19000 : 16000);
                sum += c.s[i].length;
        }
        ck_assert_uint_eq(sum, 900);
        ck_assert_uint_eq(c.s[3].length, 200 - 3 * 64);

        /* Whole pages, contiguous on both sides: merged into one write, then sliced. */
        HandoffGroupLayout whole = { .n_ranges = 1, .ranges = { { 0, 1000 } } };
        uint64_t s2[4] = { 0, 1000, 2000, 4000 }, d2[4] = { 500, 1500, 2500, 3500 };
        c = (Collected) { .fail_at = -1 };
        ck_assert_int_eq(handoff_plan_group(&whole, s2, d2, 4, 0, collect, &c), 2);
        ck_assert_uint_eq(c.s[0].length, 3000);
        ck_assert_uint_eq(c.s[1].src_offset, 4000);
        c = (Collected) { .fail_at = -1 };
        ck_assert_int_eq(handoff_plan_group(&whole, s2, d2, 4, 1024, collect, &c), 4);
        ck_assert_uint_eq(c.s[0].length, 1024);
        ck_assert_uint_eq(c.s[2].length, 3000 - 2048);

        /* Errors of the sink stop the plan; bad arguments; overflow. */
        c = (Collected) { .fail_at = 2 };
        ck_assert_int_eq(handoff_plan_group(&l, src, dst, 3, 0, collect, &c), -ENOBUFS);
        ck_assert_int_eq(handoff_plan_group(&l, NULL, dst, 3, 0, collect, &c), -EINVAL);
        ck_assert_int_eq(handoff_plan_group(NULL, src, dst, 3, 0, collect, &c), -EINVAL);
        uint64_t big[1] = { UINT64_MAX - 150 };
        c = (Collected) { .fail_at = -1 };
        ck_assert_int_eq(handoff_plan_group(&l, big, dst, 1, 0, collect, &c), -EOVERFLOW);
        ck_assert_int_eq(handoff_plan_group(&l, src, dst, 0, 0, collect, &c), 0);
}
END_TEST

int main(void) {
        Suite *s = suite_create("handoff");
        TCase *tc = tcase_create("handoff");
        tcase_add_test(tc, test_source_matrix);
        tcase_add_test(tc, test_destination_matrix);
        tcase_add_test(tc, test_new_invalid);
        tcase_add_test(tc, test_identity);
        tcase_add_test(tc, test_source_progress_in_order);
        tcase_add_test(tc, test_source_write_failure);
        tcase_add_test(tc, test_destination_landing);
        tcase_add_test(tc, test_counted_writes);
        tcase_add_test(tc, test_destination_rollback_while_landing);
        tcase_add_test(tc, test_timeout_and_release);
        tcase_add_test(tc, test_strings);
        tcase_add_test(tc, test_layout_validate);
        tcase_add_test(tc, test_plan_slicing);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
