/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "peer/peer-auth.h"
#include "../check-main.h"

static PeerAuthKey *key(const char *s) {
        PeerAuthKey *k = NULL;
        ck_assert_int_eq(peer_auth_key_from_bytes(s, strlen(s), &k), 0);
        return k;
}

static PeerAuthTranscript transcript(void) {
        PeerAuthTranscript t = {
                .dialer_id = "host-a",
                .acceptor_id = "host-b",
                .role = PEER_ROLE_CONTROL,
        };
        memset(t.nonce_dialer, 1, PEER_NONCE_SIZE);
        memset(t.nonce_acceptor, 2, PEER_NONCE_SIZE);
        return t;
}

START_TEST(test_mac_roundtrip) {
        PeerAuthKey *k = key("0123456789abcdef0123456789abcdef");
        PeerAuthTranscript t = transcript();
        uint8_t mac[PEER_MAC_SIZE], mac2[PEER_MAC_SIZE];

        ck_assert_int_eq(peer_auth_mac(k, PEER_AUTH_DIALER, &t, mac), 0);
        ck_assert(peer_auth_verify(k, PEER_AUTH_DIALER, &t, mac));
        /* Deterministic. */
        ck_assert_int_eq(peer_auth_mac(k, PEER_AUTH_DIALER, &t, mac2), 0);
        ck_assert_mem_eq(mac, mac2, PEER_MAC_SIZE);
        /* A dialer's proof is no acceptor's proof (no reflection). */
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &t, mac));
        /* Any flipped bit of the MAC fails. */
        for (int i = 0; i < PEER_MAC_SIZE * 8; i++) {
                mac2[i / 8] ^= (uint8_t)(1 << (i % 8));
                ck_assert(!peer_auth_verify(k, PEER_AUTH_DIALER, &t, mac2));
                mac2[i / 8] ^= (uint8_t)(1 << (i % 8));
        }
        peer_auth_key_free(k);
}
END_TEST

START_TEST(test_transcript_binding) {
        PeerAuthKey *k = key("0123456789abcdef0123456789abcdef");
        PeerAuthTranscript t = transcript(), u;
        uint8_t mac[PEER_MAC_SIZE];

        ck_assert_int_eq(peer_auth_mac(k, PEER_AUTH_ACCEPTOR, &t, mac), 0);
        u = t;
        u.nonce_dialer[5] ^= 1;
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &u, mac));
        u = t;
        u.nonce_acceptor[31] ^= 1;
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &u, mac));
        u = t;
        u.dialer_id = "host-c";
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &u, mac));
        u = t;
        u.acceptor_id = "host-a";
        u.dialer_id = "host-b"; /* swapped roles */
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &u, mac));
        u = t;
        u.dialer_id = "host-ah"; /* id boundaries are length-prefixed */
        u.acceptor_id = "ost-b";
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &u, mac));
        u = t;
        u.role = PEER_ROLE_DATA;
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &u, mac));
        u = t;
        u.session_id = 1;
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &u, mac));
        u = t;
        u.stream_index = 1;
        ck_assert(!peer_auth_verify(k, PEER_AUTH_ACCEPTOR, &u, mac));
        peer_auth_key_free(k);
}
END_TEST

START_TEST(test_wrong_key) {
        PeerAuthKey *k1 = key("0123456789abcdef0123456789abcdef");
        PeerAuthKey *k2 = key("0123456789abcdef0123456789abcdeF");
        PeerAuthTranscript t = transcript();
        uint8_t mac[PEER_MAC_SIZE];

        ck_assert_int_eq(peer_auth_mac(k1, PEER_AUTH_DIALER, &t, mac), 0);
        ck_assert(!peer_auth_verify(k2, PEER_AUTH_DIALER, &t, mac));
        peer_auth_key_free(k1);
        peer_auth_key_free(k2);
}
END_TEST

START_TEST(test_key_bounds) {
        PeerAuthKey *k = NULL;
        uint8_t big[PEER_AUTH_KEY_MAX + 1] = {};
        PeerAuthTranscript t = transcript();
        uint8_t mac[PEER_MAC_SIZE];

        ck_assert_int_eq(peer_auth_key_from_bytes("short", 5, &k), -EINVAL);
        ck_assert_int_eq(peer_auth_key_from_bytes(big, sizeof big, &k), -EINVAL);
        ck_assert_int_eq(peer_auth_key_from_bytes(NULL, 32, &k), -EINVAL);
        ck_assert_int_eq(peer_auth_key_from_bytes(big, PEER_AUTH_KEY_MAX, &k), 0);
        /* Invalid ids are refused, not MACed. */
        t.dialer_id = "bad id";
        ck_assert_int_eq(peer_auth_mac(k, PEER_AUTH_DIALER, &t, mac), -EINVAL);
        ck_assert(!peer_auth_verify(k, PEER_AUTH_DIALER, &t, mac));
        ck_assert_ptr_null(peer_auth_key_free(k));
        ck_assert_ptr_null(peer_auth_key_free(NULL));
}
END_TEST

static char *write_key_file(const char *content, mode_t mode) {
        char *path = strdup("/tmp/test-peer-auth-XXXXXX");
        int fd = mkstemp(path);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, content, strlen(content)), (ssize_t)strlen(content));
        ck_assert_int_eq(fchmod(fd, mode), 0);
        close(fd);
        return path;
}

START_TEST(test_key_file) {
        PeerAuthKey *k = NULL, *k2 = NULL;
        PeerAuthTranscript t = transcript();
        uint8_t mac[PEER_MAC_SIZE];
        char *p;

        /* Trailing newline is not part of the key. */
        p = write_key_file("0123456789abcdef0123456789abcdef\n", 0600);
        ck_assert_int_eq(peer_auth_key_load(p, &k, NULL), 0);
        k2 = key("0123456789abcdef0123456789abcdef");
        ck_assert_int_eq(peer_auth_mac(k, PEER_AUTH_DIALER, &t, mac), 0);
        ck_assert(peer_auth_verify(k2, PEER_AUTH_DIALER, &t, mac));
        peer_auth_key_free(k);
        peer_auth_key_free(k2);
        unlink(p);
        free(p);

        /* Readable by others: refused. */
        p = write_key_file("0123456789abcdef0123456789abcdef\n", 0644);
        ck_assert_int_eq(peer_auth_key_load(p, &k, NULL), -EPERM);
        unlink(p);
        free(p);

        /* Too short after trimming. */
        p = write_key_file("short\n\n\n  \n", 0600);
        ck_assert_int_eq(peer_auth_key_load(p, &k, NULL), -EINVAL);
        unlink(p);
        free(p);

        ck_assert_int_eq(peer_auth_key_load("/nonexistent/key", &k, NULL), -ENOENT);
        ck_assert_int_eq(peer_auth_key_load("/tmp", &k, NULL), -EINVAL);

        /* Every refusal says why in words (epdd logs it, at start and --check-config). */
        const char *why = NULL;
        ck_assert_int_eq(peer_auth_key_load("/tmp", &k, &why), -EINVAL);
        ck_assert_str_eq(why, "it is a directory, not a file");
        ck_assert_int_eq(peer_auth_key_load("/dev/zero", &k, &why), -EINVAL);
        ck_assert_str_eq(why, "it is not a regular file (a device, FIFO or socket)");
        p = write_key_file("", 0600);
        ck_assert_int_eq(peer_auth_key_load(p, &k, &why), -EINVAL);
        ck_assert_ptr_nonnull(strstr(why, "it is empty"));
        unlink(p);
        free(p);
        p = write_key_file("0123456789abcdef0123456789abcdef\n", 0640);
        ck_assert_int_eq(peer_auth_key_load(p, &k, &why), -EPERM);
        ck_assert_ptr_nonnull(strstr(why, "chmod 600"));
        unlink(p);
        free(p);
        p = write_key_file("0123456789abcdef0123456789abcdef\n", 0600);
        ck_assert_int_eq(peer_auth_key_load(p, &k, &why), 0);
        ck_assert_ptr_null(why);
        peer_auth_key_free(k);
        unlink(p);
        free(p);
        ck_assert_int_eq(peer_auth_key_load("/nonexistent/key", &k, &why), -ENOENT);
        ck_assert_ptr_null(why);
}
END_TEST

START_TEST(test_random) {
        uint8_t a[32] = {}, b[32] = {};
        ck_assert_int_eq(peer_auth_random(a, sizeof a), 0);
        ck_assert_int_eq(peer_auth_random(b, sizeof b), 0);
        ck_assert(memcmp(a, b, sizeof a) != 0);
}
END_TEST

int main(void) {
        Suite *s = suite_create("peer-auth");
        TCase *tc = tcase_create("auth");
        tcase_add_test(tc, test_mac_roundtrip);
        tcase_add_test(tc, test_transcript_binding);
        tcase_add_test(tc, test_wrong_key);
        tcase_add_test(tc, test_key_bounds);
        tcase_add_test(tc, test_key_file);
        tcase_add_test(tc, test_random);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
