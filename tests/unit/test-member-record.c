/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Member records in etcd are signed with the cluster key (daemon/cluster/member-record.c):
 * whoever can write etcd must not make a member dial an address of its choosing. A
 * record's MAC covers every field a peer acts on and the prefix it is registered under;
 * a record with a field rewritten, made with another key, or without a MAC is refused. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/member-record.h"
#include "peer/peer-auth.h"
#include "../check-main.h"

#define PREFIX "/epd/"

static PeerAuthKey *key(const char *k) {
        PeerAuthKey *ret = NULL;
        ck_assert_int_eq(peer_auth_key_from_bytes(k, strlen(k), &ret), 0);
        return ret;
}

static MemberInfo record(void) {
        MemberInfo i = {};
        snprintf(i.host_id, sizeof i.host_id, "alpha");
        snprintf(i.address, sizeof i.address, "10.1.0.1:7100");
        snprintf(i.transports, sizeof i.transports, "tcp,rdma");
        snprintf(i.arenas, sizeof i.arenas, "kv0:host:64M");
        snprintf(i.nics, sizeof i.nics, "gpu0->eth1");
        i.gpus = 1;
        i.started_usec = 1764750000123456ULL;
        return i;
}

/* What a peer reads back from etcd: the value encoded, then parsed under the key's host. */
static int reread(const MemberInfo *in, const char *host, MemberInfo *out) {
        char *v = member_record_encode(in);
        int r;
        ck_assert_ptr_nonnull(v);
        r = member_record_parse(host, (const uint8_t *)v, strlen(v), out);
        free(v);
        return r;
}

START_TEST(test_sign_verify) {
        PeerAuthKey *k = key("0123456789abcdef0123456789abcdef");
        MemberInfo in = record(), out;

        ck_assert_int_eq(member_record_verify(k, PREFIX, &in), -ENOKEY);
        ck_assert_int_eq(member_record_sign(k, PREFIX, &in), 0);
        ck_assert(in.has_mac);
        ck_assert_int_eq(member_record_verify(k, PREFIX, &in), 0);
        /* Through etcd: encoded, parsed, still verifies, and says version 2 with its MAC. */
        char *v = member_record_encode(&in);
        ck_assert_ptr_nonnull(strstr(v, "\"version\":2"));
        ck_assert_ptr_nonnull(strstr(v, "\"mac\":\""));
        free(v);
        ck_assert_int_eq(reread(&in, "alpha", &out), 0);
        ck_assert(out.has_mac);
        ck_assert_int_eq(memcmp(out.mac, in.mac, MEMBER_MAC_SIZE), 0);
        ck_assert_int_eq(member_record_verify(k, PREFIX, &out), 0);
        /* Deterministic: the same record signs the same. */
        MemberInfo again = record();
        ck_assert_int_eq(member_record_sign(k, PREFIX, &again), 0);
        ck_assert_int_eq(memcmp(again.mac, in.mac, MEMBER_MAC_SIZE), 0);
        peer_auth_key_free(k);
}
END_TEST

/* The attack: the record rewritten to another address, its MAC kept. */
START_TEST(test_tampered_address) {
        PeerAuthKey *k = key("0123456789abcdef0123456789abcdef");
        MemberInfo in = record(), out;

        ck_assert_int_eq(member_record_sign(k, PREFIX, &in), 0);
        snprintf(in.address, sizeof in.address, "10.66.0.1:7100");
        ck_assert_int_eq(reread(&in, "alpha", &out), 0); /* a well-formed record... */
        ck_assert_int_eq(member_record_verify(k, PREFIX, &out), -EPERM); /* ...refused */
        /* Its port alone. */
        in = record();
        ck_assert_int_eq(member_record_sign(k, PREFIX, &in), 0);
        snprintf(in.address, sizeof in.address, "10.1.0.1:7101");
        ck_assert_int_eq(member_record_verify(k, PREFIX, &in), -EPERM);
        peer_auth_key_free(k);
}
END_TEST

/* Another host's valid record put under another host's key, host id rewritten. */
START_TEST(test_tampered_host_id) {
        PeerAuthKey *k = key("0123456789abcdef0123456789abcdef");
        MemberInfo in = record(), out;

        ck_assert_int_eq(member_record_sign(k, PREFIX, &in), 0);
        snprintf(in.host_id, sizeof in.host_id, "bravo");
        ck_assert_int_eq(reread(&in, "bravo", &out), 0);
        ck_assert_int_eq(member_record_verify(k, PREFIX, &out), -EPERM);
        /* The same bytes under another host's key do not even parse (host ids differ). */
        in = record();
        ck_assert_int_eq(member_record_sign(k, PREFIX, &in), 0);
        ck_assert_int_eq(reread(&in, "bravo", &out), -EBADMSG);
        peer_auth_key_free(k);
}
END_TEST

/* Every other field a peer acts on, and the prefix, are covered. */
START_TEST(test_tampered_fields) {
        PeerAuthKey *k = key("0123456789abcdef0123456789abcdef");
        MemberInfo signed_ = record(), t;

        ck_assert_int_eq(member_record_sign(k, PREFIX, &signed_), 0);
        t = signed_;
        snprintf(t.transports, sizeof t.transports, "tcp");
        ck_assert_int_eq(member_record_verify(k, PREFIX, &t), -EPERM);
        t = signed_;
        snprintf(t.arenas, sizeof t.arenas, "kv0:host:128M");
        ck_assert_int_eq(member_record_verify(k, PREFIX, &t), -EPERM);
        t = signed_;
        snprintf(t.nics, sizeof t.nics, "gpu0->eth2");
        ck_assert_int_eq(member_record_verify(k, PREFIX, &t), -EPERM);
        t = signed_;
        t.gpus = 2;
        ck_assert_int_eq(member_record_verify(k, PREFIX, &t), -EPERM);
        t = signed_;
        t.started_usec++;
        ck_assert_int_eq(member_record_verify(k, PREFIX, &t), -EPERM);
        t = signed_;
        t.mac[0] ^= 1;
        ck_assert_int_eq(member_record_verify(k, PREFIX, &t), -EPERM);
        /* Moved to another prefix (another cluster with the same key). */
        ck_assert_int_eq(member_record_verify(k, "/other/", &signed_), -EPERM);
        /* Length-prefixed: bytes moved from one field to the next do not verify. */
        t = signed_;
        snprintf(t.transports, sizeof t.transports, "tcp,rdm");
        snprintf(t.arenas, sizeof t.arenas, "akv0:host:64M");
        ck_assert_int_eq(member_record_verify(k, PREFIX, &t), -EPERM);
        /* Not covered: what comes from the key, not the value. */
        t = signed_;
        t.lease = 77;
        t.revision = 99;
        ck_assert_int_eq(member_record_verify(k, PREFIX, &t), 0);
        peer_auth_key_free(k);
}
END_TEST

START_TEST(test_wrong_key) {
        PeerAuthKey *k = key("0123456789abcdef0123456789abcdef"), *other = key("0123456789abcdef0123456789abcdeF");
        MemberInfo in = record(), out;

        ck_assert_int_eq(member_record_sign(other, PREFIX, &in), 0);
        ck_assert_int_eq(reread(&in, "alpha", &out), 0);
        ck_assert_int_eq(member_record_verify(k, PREFIX, &out), -EPERM);
        ck_assert_int_eq(member_record_verify(other, PREFIX, &out), 0);
        /* Not a handshake MAC either: another context, another MAC. */
        uint8_t a[PEER_MAC_SIZE], b[PEER_MAC_SIZE];
        ck_assert_int_eq(peer_auth_keyed_mac(k, "one", "x", 1, a), 0);
        ck_assert_int_eq(peer_auth_keyed_mac(k, "two", "x", 1, b), 0);
        ck_assert_int_ne(memcmp(a, b, sizeof a), 0);
        ck_assert_int_eq(peer_auth_keyed_mac(k, "", "x", 1, a), -EINVAL);
        ck_assert_int_eq(peer_auth_keyed_mac(NULL, "one", "x", 1, a), -EINVAL);
        peer_auth_key_free(k);
        peer_auth_key_free(other);
}
END_TEST

/* A record without a MAC (an epdd from before records were signed, or one written by
 * hand) parses, and is refused by name; a malformed MAC does not parse. */
START_TEST(test_missing_mac) {
        PeerAuthKey *k = key("0123456789abcdef0123456789abcdef");
        MemberInfo out;
        const char *v1 = "{\"version\":1,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"transports\":\"tcp\","
                         "\"started_usec\":\"1764750000123456\"}";
        ck_assert_int_eq(member_record_parse("alpha", (const uint8_t *)v1, strlen(v1), &out), 0);
        ck_assert(!out.has_mac);
        ck_assert_int_eq(member_record_verify(k, PREFIX, &out), -ENOKEY);
        const char *v2 = "{\"version\":2,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\"}";
        ck_assert_int_eq(member_record_parse("alpha", (const uint8_t *)v2, strlen(v2), &out), 0);
        ck_assert_int_eq(member_record_verify(k, PREFIX, &out), -ENOKEY);

        const char *bad[] = {
                "{\"version\":2,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"mac\":\"\"}",
                "{\"version\":2,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"mac\":\"00\"}",
                "{\"version\":2,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"mac\":5}",
                /* 64 digits, one not hex; then one upper case; then 66 digits */
                "{\"version\":2,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"mac\":"
                "\"000000000000000000000000000000000000000000000000000000000000000g\"}",
                "{\"version\":2,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"mac\":"
                "\"000000000000000000000000000000000000000000000000000000000000000A\"}",
                "{\"version\":2,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"mac\":"
                "\"000000000000000000000000000000000000000000000000000000000000000000\"}",
                "{\"version\":3,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"mac\":"
                "\"0000000000000000000000000000000000000000000000000000000000000000\"}",
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
                ck_assert_msg(member_record_parse("alpha", (const uint8_t *)bad[i], strlen(bad[i]), &out) == -EBADMSG,
                              "accepted: %s", bad[i]);
        /* A well-formed MAC of zeros: parses, refused. */
        const char *zeros = "{\"version\":2,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"mac\":"
                            "\"0000000000000000000000000000000000000000000000000000000000000000\"}";
        ck_assert_int_eq(member_record_parse("alpha", (const uint8_t *)zeros, strlen(zeros), &out), 0);
        ck_assert(out.has_mac);
        ck_assert_int_eq(member_record_verify(k, PREFIX, &out), -EPERM);
        /* Nothing to check without a key, or of an invalid record. */
        MemberInfo in = record();
        ck_assert_int_eq(member_record_sign(NULL, PREFIX, &in), -EINVAL);
        snprintf(in.address, sizeof in.address, "nocolon");
        ck_assert_int_eq(member_record_sign(k, PREFIX, &in), -EINVAL);
        peer_auth_key_free(k);
}
END_TEST

int main(void) {
        Suite *s = suite_create("member-record");
        TCase *tc = tcase_create("member-record");
        tcase_add_test(tc, test_sign_verify);
        tcase_add_test(tc, test_tampered_address);
        tcase_add_test(tc, test_tampered_host_id);
        tcase_add_test(tc, test_tampered_fields);
        tcase_add_test(tc, test_wrong_key);
        tcase_add_test(tc, test_missing_mac);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
