/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Members added and retired at run time (peer_manager_add_member/retire_member): at
 * most PEER_MEMBERS_MAX at once; retired ones do not count, so a long-lived cluster
 * whose hosts come and go under new ids keeps taking new members. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <systemd/sd-event.h>

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

int main(void) {
        Suite *s = suite_create("peer-members");
        TCase *tc = tcase_create("peer-members");
        tcase_add_test(tc, test_retired_members_do_not_count);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
