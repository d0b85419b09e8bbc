/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma-proto.h"
#include "../check-main.h"

static void roundtrip(const RdmaMessage *m, RdmaMessage *out) {
        uint8_t buf[RDMA_PROTO_MAX_PAYLOAD];
        int n = rdma_message_encode(m, buf, sizeof buf);
        ck_assert_int_gt(n, 0);
        ck_assert_int_eq(rdma_message_decode(m->type, buf, (size_t)n, out), 0);
        /* Every strict prefix and one extra byte are refused. */
        for (int i = 0; i < n; i++) {
                RdmaMessage x;
                ck_assert_int_eq(rdma_message_decode(m->type, buf, (size_t)i, &x), -EBADMSG);
        }
        {
                uint8_t big[RDMA_PROTO_MAX_PAYLOAD + 1] = {};
                RdmaMessage x;
                memcpy(big, buf, (size_t)n);
                ck_assert_int_eq(rdma_message_decode(m->type, big, (size_t)n + 1, &x), -EBADMSG);
        }
}

START_TEST(test_connect) {
        RdmaMessage m = { .type = RDMA_MSG_CONNECT }, d;
        uint8_t buf[RDMA_PROTO_MAX_PAYLOAD];

        m.connect.have_rdma = true;
        m.connect.port = 1;
        m.connect.mtu = 3;
        m.connect.gid_index = 1;
        m.connect.qpn = 0x11;
        m.connect.psn = 0xabcdef;
        for (int i = 0; i < 16; i++)
                m.connect.gid[i] = (uint8_t)i;
        strcpy(m.connect.device, "rxe0");
        roundtrip(&m, &d);
        ck_assert(d.connect.have_rdma);
        ck_assert_uint_eq(d.connect.qpn, 0x11);
        ck_assert_uint_eq(d.connect.psn, 0xabcdef);
        ck_assert_str_eq(d.connect.device, "rxe0");
        ck_assert_int_eq(memcmp(d.connect.gid, m.connect.gid, 16), 0);

        /* Out of range fields do not encode. */
        m.connect.qpn = 0x1000000;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.connect.qpn = 0;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.connect.qpn = 1;
        m.connect.mtu = 6;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.connect.mtu = 5;
        m.connect.port = 0;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.connect.port = 1;
        m.connect.device[0] = 0;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        strcpy(m.connect.device, "bad\nname");
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        ck_assert_int_eq(rdma_message_encode(&m, buf, 4), -EINVAL);

        /* "none": everything else is zero. */
        m = (RdmaMessage){ .type = RDMA_MSG_CONNECT };
        roundtrip(&m, &d);
        ck_assert(!d.connect.have_rdma);
        {
                uint8_t p[29] = {};
                p[5] = 1; /* a qpn without HAVE_RDMA */
                ck_assert_int_eq(rdma_message_decode(RDMA_MSG_CONNECT, p, sizeof p, &d), -EBADMSG);
                p[5] = 0;
                p[0] = 0x80; /* unknown flag */
                ck_assert_int_eq(rdma_message_decode(RDMA_MSG_CONNECT, p, sizeof p, &d), -EBADMSG);
        }
}
END_TEST

START_TEST(test_grant_down) {
        RdmaMessage m = { .type = RDMA_MSG_GRANT }, d;
        uint8_t buf[RDMA_PROTO_MAX_PAYLOAD];

        m.grant.write_id = 42;
        m.grant.region = 3;
        m.grant.rkey = 0xdeadbeef;
        m.grant.addr = 0x7f0000001000;
        m.grant.length = 1 << 20;
        roundtrip(&m, &d);
        ck_assert_uint_eq(d.grant.write_id, 42);
        ck_assert_uint_eq(d.grant.rkey, 0xdeadbeef);
        ck_assert_uint_eq(d.grant.length, 1 << 20);
        m.grant.length = 0;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.grant.length = 1;
        m.grant.write_id = (uint64_t)UINT32_MAX + 1; /* the immediate carries 32 bits */
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.grant.write_id = 0;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.grant.write_id = 42;
        m.grant.length = 2;
        m.grant.addr = UINT64_MAX; /* wraps */
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);

        m = (RdmaMessage){ .type = RDMA_MSG_DOWN };
        m.down.error = EIO;
        strcpy(m.down.reason, "IBV_EVENT_DEVICE_FATAL on rxe0");
        roundtrip(&m, &d);
        ck_assert_uint_eq(d.down.error, EIO);
        ck_assert_str_eq(d.down.reason, "IBV_EVENT_DEVICE_FATAL on rxe0");
        /* The longest reason there is, into a buffer of exactly the maximum size. */
        memset(m.down.reason, 'A', RDMA_PROTO_REASON_MAX);
        m.down.reason[RDMA_PROTO_REASON_MAX] = 0;
        uint8_t *exact = malloc(RDMA_PROTO_MAX_PAYLOAD);
        ck_assert_ptr_nonnull(exact);
        int n = rdma_message_encode(&m, exact, RDMA_PROTO_MAX_PAYLOAD);
        ck_assert_int_eq(n, 5 + (int)RDMA_PROTO_REASON_MAX);
        ck_assert_int_eq(rdma_message_decode(RDMA_MSG_DOWN, exact, (size_t)n, &d), 0);
        ck_assert_str_eq(d.down.reason, m.down.reason);
        free(exact);
        m.down.error = 0;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.down.error = 5000;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
}
END_TEST

START_TEST(test_request_ack) {
        RdmaMessage m = { .type = RDMA_MSG_REQUEST }, d;
        uint8_t buf[RDMA_PROTO_MAX_PAYLOAD];

        m.request.write_id = UINT32_MAX;
        m.request.cookie = UINT64_C(0x123456789) << 8 | 3;
        m.request.region = 2;
        m.request.offset = 1 << 16;
        m.request.length = 65536;
        roundtrip(&m, &d);
        ck_assert_uint_eq(d.request.write_id, UINT32_MAX);
        ck_assert_uint_eq(d.request.cookie, m.request.cookie);
        ck_assert_uint_eq(d.request.region, 2);
        ck_assert_uint_eq(d.request.offset, 1 << 16);
        ck_assert_uint_eq(d.request.length, 65536);
        ck_assert_uint_eq(d.request.attempt, 0);
        /* The attempt's token (protocol 3): it travels, and the REQUEST of protocol 2,
         * without it, is refused rather than read short. */
        m.request.attempt = UINT64_C(0x1807a5b3c2d1e0f9);
        int n = rdma_message_encode(&m, buf, sizeof buf);
        ck_assert_int_eq(n, 44);
        ck_assert_int_eq(rdma_message_decode(RDMA_MSG_REQUEST, buf, (size_t)n, &d), 0);
        ck_assert_uint_eq(d.request.attempt, m.request.attempt);
        ck_assert_int_eq(rdma_message_decode(RDMA_MSG_REQUEST, buf, 36, &d), -EBADMSG);
        m.request.length = 0;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.request.length = 2;
        m.request.offset = UINT64_MAX;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
        m.request.offset = 0;
        m.request.write_id = 0;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);

        m = (RdmaMessage){ .type = RDMA_MSG_ACK };
        m.ack.write_id = 7;
        roundtrip(&m, &d);
        ck_assert_uint_eq(d.ack.write_id, 7);
        ck_assert_uint_eq(d.ack.error, 0);
        m.ack.error = EACCES;
        roundtrip(&m, &d);
        ck_assert_uint_eq(d.ack.error, EACCES);
        m.ack.error = 4096;
        ck_assert_int_eq(rdma_message_encode(&m, buf, sizeof buf), -EINVAL);
}
END_TEST

START_TEST(test_types) {
        RdmaMessage d;
        uint8_t p[1] = {};
        ck_assert_int_eq(rdma_message_decode(0x0499, p, 0, &d), -EOPNOTSUPP);
        ck_assert_int_eq(rdma_message_decode(0x0400, p, 0, &d), -EOPNOTSUPP);
        ck_assert_int_eq(rdma_message_decode(0x0100, p, 0, &d), -EBADMSG);
        ck_assert_int_eq(rdma_message_decode(RDMA_MSG_GRANT, NULL, 1, &d), -EINVAL);
        d.type = 0x0499;
        ck_assert_int_eq(rdma_message_encode(&d, (uint8_t[RDMA_PROTO_MAX_PAYLOAD]){}, RDMA_PROTO_MAX_PAYLOAD),
                         -EINVAL);
}
END_TEST

int main(void) {
        Suite *s = suite_create("rdma-proto");
        TCase *tc = tcase_create("rdma-proto");
        tcase_add_test(tc, test_connect);
        tcase_add_test(tc, test_grant_down);
        tcase_add_test(tc, test_request_ack);
        tcase_add_test(tc, test_types);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
