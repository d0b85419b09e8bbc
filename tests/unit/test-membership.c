/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The membership state machine (daemon/cluster/membership.c): joins, updates, leaves in
 * revision order, resyncs with a grace period for members missing from them, the
 * bound, invalid records. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "cluster/membership.h"
#include "../check-main.h"

typedef struct Log {
        char ev[64][96];
        size_t n;
} Log;

static void on_event(void *userdata, MembershipEvent ev, const Member *m, const char *why) {
        Log *l = userdata;
        const char *name = ev == MEMBERSHIP_JOIN ? "join" : ev == MEMBERSHIP_LEAVE ? "leave" : "update";
        ck_assert_uint_lt(l->n, 64);
        snprintf(l->ev[l->n++], sizeof l->ev[0], "%s %s %s", name, m->info.host_id,
                 member_state_to_string(m->state));
}

static MemberInfo info(const char *host, const char *addr, int64_t rev) {
        MemberInfo i = {};
        snprintf(i.host_id, sizeof i.host_id, "%s", host);
        snprintf(i.address, sizeof i.address, "%s", addr);
        snprintf(i.transports, sizeof i.transports, "tcp");
        i.revision = rev;
        i.lease = 7;
        return i;
}

START_TEST(test_join_update_leave) {
        Membership *ms;
        Log l = {};
        MemberInfo a = info("alpha", "10.0.0.1:7100", 5), self = info("self", "10.0.0.9:7100", 6);

        ck_assert_int_eq(membership_new(&ms, "self", 8, 2 * USEC_PER_SEC, on_event, &l), 0);
        ck_assert_str_eq(etcd_link_to_string(membership_link(ms)), "connecting");
        ck_assert_int_eq(membership_put(ms, &a), 0);
        ck_assert_int_eq(membership_put(ms, &self), 0); /* this host's own key: not a member */
        ck_assert_uint_eq(membership_size(ms), 1);
        ck_assert_uint_eq(l.n, 1);
        ck_assert_str_eq(l.ev[0], "join alpha alive");
        ck_assert_int_eq(membership_revision(ms), 6);

        /* The same record again: nothing to report. A newer one with a new address: update. */
        ck_assert_int_eq(membership_put(ms, &a), 0);
        ck_assert_uint_eq(l.n, 1);
        a = info("alpha", "10.0.0.2:7100", 8);
        ck_assert_int_eq(membership_put(ms, &a), 0);
        ck_assert_uint_eq(l.n, 2);
        ck_assert_str_eq(l.ev[1], "update alpha alive");
        ck_assert_str_eq(membership_get(ms, "alpha")->info.address, "10.0.0.2:7100");

        /* An older put is stale (an event that crossed a resync): ignored, counted. */
        MemberInfo old = info("alpha", "10.0.0.3:7100", 7);
        ck_assert_int_eq(membership_put(ms, &old), 0);
        ck_assert_str_eq(membership_get(ms, "alpha")->info.address, "10.0.0.2:7100");
        /* So is an older delete. */
        ck_assert_int_eq(membership_delete(ms, "alpha", 7, "old"), 0);
        ck_assert_ptr_nonnull(membership_get(ms, "alpha"));
        MembershipStats st;
        membership_stats(ms, &st);
        ck_assert_uint_eq(st.stale, 2);

        ck_assert_int_eq(membership_delete(ms, "alpha", 9, "lease expired"), 0);
        ck_assert_ptr_null(membership_get(ms, "alpha"));
        ck_assert_str_eq(l.ev[2], "leave alpha alive");
        /* Deleting what is not there changes nothing. */
        ck_assert_int_eq(membership_delete(ms, "nobody", 10, NULL), 0);
        ck_assert_uint_eq(l.n, 3);
        /* It comes back: a join again. */
        a.revision = 11;
        ck_assert_int_eq(membership_put(ms, &a), 0);
        ck_assert_str_eq(l.ev[3], "join alpha alive");
        membership_free(ms);
}
END_TEST

START_TEST(test_resync_grace) {
        Membership *ms;
        Log l = {};
        MemberInfo a = info("alpha", "10.0.0.1:7100", 3), b = info("bravo", "10.0.0.2:7100", 4);
        usec_t now = 1000 * USEC_PER_SEC;

        ck_assert_int_eq(membership_new(&ms, "self", 8, 2 * USEC_PER_SEC, on_event, &l), 0);
        membership_resync_begin(ms, 4);
        ck_assert_int_eq(membership_resync_put(ms, &a), 0);
        ck_assert_int_eq(membership_resync_put(ms, &b), 0);
        membership_resync_end(ms, now, NULL);
        ck_assert_uint_eq(membership_size(ms), 2);
        ck_assert_uint_eq(membership_tick(ms, now), USEC_INFINITY);

        /* etcd came back without bravo (its lease not re-granted yet): missing, not gone. */
        membership_resync_begin(ms, 20);
        ck_assert_int_eq(membership_resync_put(ms, &a), 0);
        membership_resync_end(ms, now, NULL);
        ck_assert_str_eq(l.ev[l.n - 1], "update bravo missing");
        ck_assert_int_eq(membership_get(ms, "bravo")->state, MEMBER_MISSING);
        ck_assert_uint_eq(membership_tick(ms, now + USEC_PER_SEC), now + 2 * USEC_PER_SEC);
        ck_assert_ptr_nonnull(membership_get(ms, "bravo"));
        /* It re-registers within the grace: alive again, no leave. */
        b.revision = 21;
        ck_assert_int_eq(membership_put(ms, &b), 0);
        ck_assert_int_eq(membership_get(ms, "bravo")->state, MEMBER_ALIVE);
        ck_assert_str_eq(l.ev[l.n - 1], "update bravo alive");
        ck_assert_uint_eq(membership_tick(ms, now + 10 * USEC_PER_SEC), USEC_INFINITY);
        ck_assert_uint_eq(membership_size(ms), 2);

        /* Missing again, and this time it stays away: it leaves at the deadline. */
        membership_resync_begin(ms, 30);
        ck_assert_int_eq(membership_resync_put(ms, &a), 0);
        membership_resync_end(ms, now, NULL);
        ck_assert_ptr_nonnull(membership_get(ms, "bravo"));
        ck_assert_uint_eq(membership_tick(ms, now + 2 * USEC_PER_SEC), USEC_INFINITY);
        ck_assert_ptr_null(membership_get(ms, "bravo"));
        ck_assert_str_eq(l.ev[l.n - 1], "leave bravo missing");
        ck_assert_uint_eq(membership_size(ms), 1);
        /* A put outside a resync through the resync call is refused. */
        ck_assert_int_eq(membership_resync_put(ms, &a), -EINVAL);
        membership_free(ms);
}
END_TEST

START_TEST(test_bound_and_validation) {
        Membership *ms;
        Log l = {};
        char host[16];

        ck_assert_int_eq(membership_new(&ms, "bad id!", 2, 0, on_event, &l), -EINVAL);
        ck_assert_int_eq(membership_new(&ms, "self", 0, 0, on_event, &l), -EINVAL);
        ck_assert_int_eq(membership_new(&ms, "self", 2, 0, on_event, &l), 0);
        for (int i = 0; i < 2; i++) {
                snprintf(host, sizeof host, "h%d", i);
                MemberInfo m = info(host, "10.0.0.1:7100", i + 1);
                ck_assert_int_eq(membership_put(ms, &m), 0);
        }
        MemberInfo extra = info("h2", "10.0.0.1:7100", 3);
        ck_assert_int_eq(membership_put(ms, &extra), -ENOSPC);
        MembershipStats st;
        membership_stats(ms, &st);
        ck_assert_uint_eq(st.refused, 1);
        ck_assert_uint_eq(st.joins, 2);

        MemberInfo bad = info("x y", "10.0.0.1:7100", 4);
        ck_assert_int_eq(membership_put(ms, &bad), -EINVAL);
        bad = info("ok", "no-port", 4);
        ck_assert_int_eq(membership_put(ms, &bad), -EINVAL);
        bad = info("ok", "10.0.0.1:", 4);
        ck_assert_int_eq(membership_put(ms, &bad), -EINVAL);
        bad = info("ok", "10.0.0.1:7100", 4);
        bad.arenas[0] = '\n';
        ck_assert_int_eq(membership_put(ms, &bad), -EINVAL);
        ck_assert_uint_eq(membership_size(ms), 2);

        membership_set_link(ms, ETCD_LINK_DEGRADED, "etcd: connection refused");
        ck_assert_int_eq(membership_link(ms), ETCD_LINK_DEGRADED);
        ck_assert_str_eq(membership_link_reason(ms), "etcd: connection refused");
        /* Degraded changes nothing about who is a member. */
        ck_assert_uint_eq(membership_size(ms), 2);
        membership_free(ms);
}
END_TEST

/* etcd lost its data: revisions start over, every host registers again at a low
 * revision, and the watch resyncs below the revision known. The members stay (no leave
 * after the grace), and a later delete at the new revisions is not taken for stale. */
START_TEST(test_revision_reset) {
        Membership *ms;
        Log l = {};
        MemberInfo a = info("alpha", "10.0.0.1:7100", 5000);
        MembershipStats st;

        ck_assert_int_eq(membership_new(&ms, "self", 8, 2 * USEC_PER_SEC, on_event, &l), 0);
        ck_assert_int_eq(membership_put(ms, &a), 0);
        a = info("alpha", "10.0.0.1:7100", 4);
        a.lease = 99;
        membership_resync_begin(ms, 10);
        ck_assert_int_eq(membership_resync_put(ms, &a), 0);
        membership_resync_end(ms, 1000, NULL);
        ck_assert_int_eq(membership_revision(ms), 10);
        membership_tick(ms, 1000 + 3 * USEC_PER_SEC);
        ck_assert_ptr_nonnull(membership_get(ms, "alpha"));
        ck_assert_int_eq(membership_get(ms, "alpha")->state, MEMBER_ALIVE);
        ck_assert_int_eq(membership_get(ms, "alpha")->info.lease, 99);
        membership_stats(ms, &st);
        ck_assert_uint_eq(st.revision_resets, 1);
        ck_assert_uint_eq(st.leaves, 0);
        /* A resync cut short (records past MaxMembers= left out) takes no member after
         * its last listed record for missing. */
        membership_resync_begin(ms, 11);
        membership_resync_end(ms, 2000, "aaa");
        membership_tick(ms, 2000 + 3 * USEC_PER_SEC);
        ck_assert_int_eq(membership_get(ms, "alpha")->state, MEMBER_ALIVE);
        /* The host goes away later: its delete at revision 12 is current. */
        ck_assert_int_eq(membership_delete(ms, "alpha", 12, NULL), 0);
        ck_assert_ptr_null(membership_get(ms, "alpha"));
        membership_free(ms);
}
END_TEST

/* A record refused at the bound waits: the first place that frees goes to it (etcd sends
 * a record once), unless its host's delete came first; a resync says again who waits. */
START_TEST(test_refused_waits) {
        Membership *ms;
        Log l = {};
        MembershipStats st;
        MemberInfo a = info("alpha", "10.0.0.1:7100", 1), b = info("bravo", "10.0.0.2:7100", 2),
                   c = info("charlie", "10.0.0.3:7100", 3), d = info("delta", "10.0.0.4:7100", 4);

        ck_assert_int_eq(membership_new(&ms, "self", 2, 2 * USEC_PER_SEC, on_event, &l), 0);
        ck_assert_int_eq(membership_put(ms, &a), 0);
        ck_assert_int_eq(membership_put(ms, &b), 0);
        ck_assert_int_eq(membership_put(ms, &c), -ENOSPC);
        ck_assert_int_eq(membership_put(ms, &d), -ENOSPC);
        c = info("charlie", "10.0.0.33:7100", 5); /* its newer record is the one that waits */
        ck_assert_int_eq(membership_put(ms, &c), -ENOSPC);
        ck_assert_uint_eq(l.n, 2);

        /* alpha leaves: charlie, refused first, takes its place with its latest record. */
        ck_assert_int_eq(membership_delete(ms, "alpha", 6, NULL), 0);
        ck_assert_uint_eq(l.n, 4);
        ck_assert_str_eq(l.ev[2], "leave alpha alive");
        ck_assert_str_eq(l.ev[3], "join charlie alive");
        ck_assert_str_eq(membership_get(ms, "charlie")->info.address, "10.0.0.33:7100");
        ck_assert_ptr_null(membership_get(ms, "delta"));

        /* delta's host goes before a place frees: it is not taken later. */
        ck_assert_int_eq(membership_delete(ms, "delta", 7, NULL), 0);
        ck_assert_int_eq(membership_delete(ms, "bravo", 8, NULL), 0);
        ck_assert_uint_eq(l.n, 5);
        ck_assert_ptr_null(membership_get(ms, "delta"));
        ck_assert_uint_eq(membership_size(ms), 1);
        membership_stats(ms, &st);
        ck_assert_uint_eq(st.refused, 3);
        ck_assert_uint_eq(st.admitted, 1);

        /* Full again; a member missing after a resync leaves at its grace, and the record
         * the resync refused takes its place. */
        ck_assert_int_eq(membership_put(ms, &b), 0);
        ck_assert_uint_eq(membership_size(ms), 2);
        d = info("delta", "10.0.0.4:7100", 9);
        membership_resync_begin(ms, 9);
        ck_assert_int_eq(membership_resync_put(ms, &b), 0);
        ck_assert_int_eq(membership_resync_put(ms, &d), -ENOSPC); /* charlie still holds its place */
        membership_resync_end(ms, 1000, NULL);
        ck_assert_int_eq(membership_get(ms, "charlie")->state, MEMBER_MISSING);
        membership_tick(ms, 1000 + 3 * USEC_PER_SEC);
        ck_assert_ptr_null(membership_get(ms, "charlie"));
        ck_assert_ptr_nonnull(membership_get(ms, "delta"));
        ck_assert_uint_eq(membership_size(ms), 2);
        membership_free(ms);
}
END_TEST

/* A resync cut short at MaxMembers= lists the first records in key order: members before
 * its last one that it did not list are gone (missing), those after it are not known. */
START_TEST(test_partial_resync_boundary) {
        Membership *ms;
        Log l = {};
        MemberInfo a = info("alpha", "10.0.0.1:7100", 1), b = info("bravo", "10.0.0.2:7100", 2),
                   c = info("charlie", "10.0.0.3:7100", 3), y = info("yankee", "10.0.0.4:7100", 4);

        ck_assert_int_eq(membership_new(&ms, "self", 8, 2 * USEC_PER_SEC, on_event, &l), 0);
        ck_assert_int_eq(membership_put(ms, &a), 0);
        ck_assert_int_eq(membership_put(ms, &b), 0);
        ck_assert_int_eq(membership_put(ms, &y), 0);
        /* The read listed alpha and charlie and stopped there: bravo is gone, yankee is
         * past the cut. */
        membership_resync_begin(ms, 10);
        ck_assert_int_eq(membership_resync_put(ms, &a), 0);
        ck_assert_int_eq(membership_resync_put(ms, &c), 0);
        membership_resync_end(ms, 1000, "charlie");
        ck_assert_int_eq(membership_get(ms, "bravo")->state, MEMBER_MISSING);
        ck_assert_int_eq(membership_get(ms, "yankee")->state, MEMBER_ALIVE);
        ck_assert_int_eq(membership_get(ms, "alpha")->state, MEMBER_ALIVE);
        membership_tick(ms, 1000 + 3 * USEC_PER_SEC);
        ck_assert_ptr_null(membership_get(ms, "bravo"));
        ck_assert_ptr_nonnull(membership_get(ms, "yankee"));
        membership_free(ms);
}
END_TEST

/* Whether this host's key is lost, by a view of etcd without it: only one at or after the
 * put that registered it. The watch thread's first read, taken before the session's put
 * (revision 7) but applied after the session said it was up, made the host put its key
 * again under a new lease: an extra UPDATE on every member at every start. */
START_TEST(test_self_key_lost) {
        /* The startup race: a read at revision 5, the put at 7. */
        ck_assert(!membership_self_key_lost(true, 7, 5));
        ck_assert(!membership_self_key_lost(true, 7, 6));
        /* A read that includes the put and lacks the key, or a delete after it: lost. */
        ck_assert(membership_self_key_lost(true, 7, 7));
        ck_assert(membership_self_key_lost(true, 7, 8));
        /* Session down: it registers anyway when it is back. */
        ck_assert(!membership_self_key_lost(false, 7, 8));
        ck_assert(!membership_self_key_lost(false, 0, 8));
        /* The put's revision unknown (an answer without one): as before, any view. */
        ck_assert(membership_self_key_lost(true, 0, 3));
}
END_TEST

int main(void) {
        Suite *s = suite_create("membership");
        TCase *tc = tcase_create("membership");
        tcase_add_test(tc, test_join_update_leave);
        tcase_add_test(tc, test_resync_grace);
        tcase_add_test(tc, test_bound_and_validation);
        tcase_add_test(tc, test_revision_reset);
        tcase_add_test(tc, test_refused_waits);
        tcase_add_test(tc, test_partial_resync_boundary);
        tcase_add_test(tc, test_self_key_lost);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
