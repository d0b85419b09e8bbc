/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Members added and retired at run time (peer_manager_add_member/retire_member): at
 * most PEER_MEMBERS_MAX at once; retired ones do not count, so a long-lived cluster
 * whose hosts come and go under new ids keeps taking new members. */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <systemd/sd-event.h>
#include <unistd.h>

#include "peer/peer-manager.h"
#include "../check-main.h"

START_TEST(test_retired_members_do_not_count) {
        sd_event *e;
        PeerManager *pm;
        char id[32];
        ck_assert_int_ge(sd_event_new(&e), 0);
        PeerManagerConfig c = { .host_id = "self" };
        ck_assert_int_eq(peer_manager_new(&pm, e, &c), 0);

        for (unsigned i = 0; i < PEER_MEMBERS_MAX; i++) {
                snprintf(id, sizeof id, "h%u", i);
                ck_assert_int_eq(peer_manager_add_member(pm, id, "127.0.0.1:9", NULL), 0);
        }
        ck_assert_int_eq(peer_manager_add_member(pm, "one-too-many", "127.0.0.1:9", NULL), -ENOSPC);
        /* Known already: no new member, no refusal. */
        ck_assert_int_eq(peer_manager_add_member(pm, "h7", "127.0.0.1:9", NULL), 0);
        ck_assert_int_eq(peer_manager_add_member(pm, "h7", "127.0.0.1:10", NULL), 0);

        /* Every one of them leaves: new hosts take their places. */
        for (unsigned i = 0; i < PEER_MEMBERS_MAX; i++) {
                snprintf(id, sizeof id, "h%u", i);
                ck_assert_int_eq(peer_manager_retire_member(pm, id), 0);
                ck_assert_int_eq(peer_manager_retire_member(pm, id), 0); /* once */
        }
        ck_assert_int_eq(peer_manager_add_member(pm, "one-too-many", "127.0.0.1:9", NULL), 0);
        for (unsigned i = 1; i < PEER_MEMBERS_MAX; i++) {
                snprintf(id, sizeof id, "n%u", i);
                ck_assert_int_eq(peer_manager_add_member(pm, id, "127.0.0.1:9", NULL), 0);
        }
        /* Full again: a retired one coming back is a member like a new one. */
        ck_assert_int_eq(peer_manager_add_member(pm, "h3", "127.0.0.1:9", NULL), -ENOSPC);
        ck_assert_int_eq(peer_manager_retire_member(pm, "n5"), 0);
        ck_assert_int_eq(peer_manager_add_member(pm, "h3", "127.0.0.1:9", NULL), 0);
        ck_assert(!peer_is_retired(peer_manager_find(pm, "h3")));
        ck_assert(peer_is_retired(peer_manager_find(pm, "n5")));

        peer_manager_free(pm);
        sd_event_unref(e);
}
END_TEST

static int noop_timer(sd_event_source *s, uint64_t usec, void *userdata) {
        return 0;
}

/* A dial whose socket() fails at once (EMFILE here; no route to the peer yet is the
 * same) leaves no connection behind: the dialer must still try again after its
 * backoff. Before, the peer stayed down until a restart. */
START_TEST(test_dial_failing_at_once_is_retried) {
        sd_event *e;
        PeerManager *pm;
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t sl = sizeof sa;
        char addr[64];
        int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        ck_assert_int_ge(lfd, 0);
        ck_assert_int_eq(bind(lfd, (struct sockaddr *)&sa, sizeof sa), 0);
        ck_assert_int_eq(listen(lfd, 8), 0);
        ck_assert_int_eq(getsockname(lfd, (struct sockaddr *)&sa, &sl), 0);
        snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)ntohs(sa.sin_port));

        ck_assert_int_ge(sd_event_new(&e), 0);
        /* The loop's monotonic timerfd exists before the limit below. */
        sd_event_source *t = NULL;
        ck_assert_int_ge(sd_event_add_time_relative(e, &t, CLOCK_MONOTONIC, 3600 * USEC_PER_SEC, 0, noop_timer, NULL),
                         0);
        PeerManagerConfig c = { .host_id = "a-self" };
        ck_assert_int_eq(peer_manager_new(&pm, e, &c), 0);
        ck_assert_int_eq(peer_manager_add_member(pm, "z-peer", addr, NULL), 0); /* we dial: "a-self" < "z-peer" */

        /* No fd left: the first dial fails in socket(). */
        struct rlimit old, low;
        ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
        int probe = dup(0);
        ck_assert_int_ge(probe, 0);
        close(probe);
        low = (struct rlimit){ .rlim_cur = (rlim_t)probe, .rlim_max = old.rlim_max };
        ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
        ck_assert_int_eq(peer_manager_start(pm), 0);
        ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
        ck_assert_int_lt(accept(lfd, NULL, NULL), 0);

        /* fds again: the retry after the backoff (100 ms, +-25 %) connects. */
        int conn = -1;
        for (int i = 0; i < 300 && conn < 0; i++) {
                ck_assert_int_ge(sd_event_run(e, 10 * USEC_PER_MSEC), 0);
                conn = accept(lfd, NULL, NULL);
        }
        ck_assert_msg(conn >= 0, "the dialer never tried again");
        close(conn);

        peer_manager_free(pm);
        sd_event_source_unref(t);
        sd_event_unref(e);
        close(lfd);
}
END_TEST

int main(void) {
        Suite *s = suite_create("peer-members");
        TCase *tc = tcase_create("peer-members");
        tcase_add_test(tc, test_retired_members_do_not_count);
        tcase_add_test(tc, test_dial_failing_at_once_is_retried);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
