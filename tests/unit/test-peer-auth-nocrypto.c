/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* daemon/peer/peer-auth-nocrypto.c, what epdd is built with when libcrypto is missing
 * (-Dcrypto=disabled): every function of peer-auth.h exists (this test links the stub
 * alone, so a missing one fails the build of this test, not only of that configuration)
 * and refuses: no key loads, no MAC is made or accepted, no two keys are equal. */
#include <check.h>
#include <errno.h>
#include <string.h>

#include "peer/peer-auth.h"
#include "../check-main.h"

START_TEST(test_everything_refuses) {
        const char *why = NULL;
        PeerAuthKey *k = NULL;
        PeerAuthTranscript t = { .dialer_id = "a", .acceptor_id = "b", .role = PEER_ROLE_CONTROL };
        uint8_t mac[PEER_MAC_SIZE], buf[8];

        ck_assert_int_eq(peer_auth_key_load("/nonexistent", &k, &why), -EOPNOTSUPP);
        ck_assert_ptr_null(k);
        ck_assert_ptr_nonnull(why);
        ck_assert_ptr_nonnull(strstr(why, "libcrypto"));
        ck_assert_int_eq(peer_auth_key_from_bytes("0123456789abcdef", 16, &k), -EOPNOTSUPP);
        ck_assert_ptr_null(k);
        ck_assert_ptr_null(peer_auth_key_free(NULL));
        ck_assert(!peer_auth_key_equal(NULL, NULL));
        ck_assert_int_eq(peer_auth_random(buf, sizeof buf), -EOPNOTSUPP);
        memset(mac, 0, sizeof mac);
        ck_assert_int_eq(peer_auth_mac(NULL, PEER_AUTH_DIALER, &t, mac), -EOPNOTSUPP);
        ck_assert(!peer_auth_verify(NULL, PEER_AUTH_ACCEPTOR, &t, mac));
        ck_assert_int_eq(peer_auth_keyed_mac(NULL, "member-record", "x", 1, mac), -EOPNOTSUPP);
}
END_TEST

static Suite *suite(void) {
        Suite *s = suite_create("peer-auth-nocrypto");
        TCase *tc = tcase_create("core");
        tcase_add_test(tc, test_everything_refuses);
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        return check_run(suite(), CK_FORK_GETENV);
}
