/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "macro.h"
#include "peer/peer-proto.h"
#include "../check-main.h"

static void header_bytes(uint8_t b[16], uint16_t type, uint32_t len) {
        peer_frame_header_encode(b, type, len);
}

START_TEST(test_header_roundtrip) {
        uint8_t b[16];
        PeerFrameHeader h;

        header_bytes(b, 0x0123, 77);
        ck_assert_int_eq(peer_frame_header_decode(b, sizeof b, &h), 0);
        ck_assert_uint_eq(h.type, 0x0123);
        ck_assert_uint_eq(h.length, 77);
        ck_assert_uint_eq(h.version, PEER_PROTOCOL_VERSION);
        /* Big-endian on the wire. */
        ck_assert_uint_eq(b[0], 'E');
        ck_assert_uint_eq(b[3], 'P');
        ck_assert_uint_eq(b[6], 0x01);
        ck_assert_uint_eq(b[7], 0x23);
        ck_assert_uint_eq(b[11], 77);
}
END_TEST

START_TEST(test_header_malformed) {
        uint8_t b[16], c[16];
        PeerFrameHeader h;

        header_bytes(b, PEER_MSG_HEARTBEAT, 16);
        /* Too short, for every length below the header size. */
        for (size_t n = 0; n < 16; n++)
                ck_assert_int_eq(peer_frame_header_decode(b, n, &h), -EBADMSG);
        ck_assert_int_eq(peer_frame_header_decode(NULL, 16, &h), -EBADMSG);
        /* Any flipped magic byte. */
        for (int i = 0; i < 4; i++) {
                memcpy(c, b, 16);
                c[i] ^= 0x20;
                ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EBADMSG);
        }
        /* Other versions. */
        memcpy(c, b, 16);
        c[4] = 0;
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EPROTONOSUPPORT);
        c[4] = PEER_PROTOCOL_VERSION + 1;
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EPROTONOSUPPORT);
        /* Any flag bit. */
        for (int bit = 0; bit < 8; bit++) {
                memcpy(c, b, 16);
                c[5] = (uint8_t)(1 << bit);
                ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EBADMSG);
        }
        /* Reserved bytes. */
        for (int i = 12; i < 16; i++) {
                memcpy(c, b, 16);
                c[i] = 1;
                ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EBADMSG);
        }
        /* Lengths at and past the bounds. */
        header_bytes(c, PEER_MSG_HANDOFF_FIRST, PEER_FRAME_MAX_PAYLOAD);
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), 0);
        header_bytes(c, PEER_MSG_HANDOFF_FIRST, PEER_FRAME_MAX_PAYLOAD + 1);
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EMSGSIZE);
        header_bytes(c, PEER_MSG_HELLO, UINT32_MAX);
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EMSGSIZE);
        header_bytes(c, PEER_MSG_DATA, PEER_DATA_HEADER_SIZE + PEER_SLICE_MAX);
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), 0);
        header_bytes(c, PEER_MSG_DATA, PEER_DATA_HEADER_SIZE + PEER_SLICE_MAX + 1);
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EMSGSIZE);
        /* DATA without any slice byte. */
        header_bytes(c, PEER_MSG_DATA, PEER_DATA_HEADER_SIZE);
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EBADMSG);
        header_bytes(c, PEER_MSG_DATA, 0);
        ck_assert_int_eq(peer_frame_header_decode(c, 16, &h), -EBADMSG);
}
END_TEST

START_TEST(test_host_id) {
        char longid[PEER_HOST_ID_MAX + 2];

        ck_assert(peer_host_id_is_valid("host-a"));
        ck_assert(peer_host_id_is_valid("a.b_c:d-9"));
        ck_assert(!peer_host_id_is_valid(""));
        ck_assert(!peer_host_id_is_valid(NULL));
        ck_assert(!peer_host_id_is_valid("a b"));
        ck_assert(!peer_host_id_is_valid("a/b"));
        ck_assert(!peer_host_id_is_valid("\xc3\xa9"));
        memset(longid, 'x', sizeof longid);
        longid[PEER_HOST_ID_MAX] = 0;
        ck_assert(peer_host_id_is_valid(longid));
        longid[PEER_HOST_ID_MAX] = 'x';
        longid[PEER_HOST_ID_MAX + 1] = 0;
        ck_assert(!peer_host_id_is_valid(longid));
        /* 63 at most, as HostId= takes them and the block directory keeps them: a peer
         * of 64 was taken here, and the handoffs to it, named by the first 63, never
         * left its window (which then refused every Prepare to it). */
        char id64[65];
        memset(id64, 'h', 64);
        id64[64] = 0;
        ck_assert(!peer_host_id_is_valid(id64));
        id64[63] = 0;
        ck_assert(peer_host_id_is_valid(id64));
}
END_TEST

static PeerHello sample_hello(void) {
        PeerHello h = {
                .role = PEER_ROLE_CONTROL,
                .min_version = 1,
                .max_version = 1,
                .n_streams = 4,
        };
        for (int i = 0; i < PEER_NONCE_SIZE; i++)
                h.nonce[i] = (uint8_t)i;
        strcpy(h.host_id, "alpha");
        return h;
}

START_TEST(test_hello) {
        uint8_t buf[256];
        PeerHello h = sample_hello(), d;
        int n;

        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_gt(n, 0);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), 0);
        ck_assert_str_eq(d.host_id, "alpha");
        ck_assert_uint_eq(d.n_streams, 4);
        ck_assert_mem_eq(d.nonce, h.nonce, PEER_NONCE_SIZE);

        /* Every truncation and one extra byte. */
        for (int k = 0; k < n; k++)
                ck_assert_int_eq(peer_hello_decode(buf, (size_t)k, &d), -EBADMSG);
        buf[n] = 0;
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n + 1, &d), -EBADMSG);

        /* Too small a buffer to encode into. */
        ck_assert_int_eq(peer_hello_encode(&h, buf, 10), -ENOBUFS);
        ck_assert_int_eq(peer_hello_encode(&h, buf, (size_t)n - 1), -ENOBUFS);
        /* Invalid host id refused at encode time. */
        strcpy(h.host_id, "bad id");
        ck_assert_int_eq(peer_hello_encode(&h, buf, sizeof buf), -EINVAL);
}
END_TEST

START_TEST(test_hello_fields) {
        uint8_t buf[256];
        PeerHello h, d;
        int n;

        /* Roles and the fields each allows. */
        h = sample_hello();
        h.role = 3;
        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        h = sample_hello();
        h.session_id = 5; /* control with a session */
        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        h = sample_hello();
        h.n_streams = PEER_MAX_STREAMS + 1;
        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        h = sample_hello();
        h.role = PEER_ROLE_DATA; /* data without a session */
        h.n_streams = 0;
        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        h.session_id = 9;
        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), 0);
        h.stream_index = PEER_MAX_STREAMS;
        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        /* Versions: min 0, min > max. */
        h = sample_hello();
        h.min_version = 0;
        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        h.min_version = 3;
        h.max_version = 2;
        n = peer_hello_encode(&h, buf, sizeof buf);
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        /* Pad byte, host id length 0, host id length past the end, bad characters,
         * embedded NUL. */
        h = sample_hello();
        n = peer_hello_encode(&h, buf, sizeof buf);
        buf[3] = 1;
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        n = peer_hello_encode(&h, buf, sizeof buf);
        size_t idlen_at = 1 + 1 + 1 + 1 + 2 + 2 + 8 + PEER_NONCE_SIZE;
        buf[idlen_at] = 0;
        ck_assert_int_eq(peer_hello_decode(buf, idlen_at + 1, &d), -EBADMSG);
        n = peer_hello_encode(&h, buf, sizeof buf);
        buf[idlen_at] = 200;
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        n = peer_hello_encode(&h, buf, sizeof buf);
        buf[idlen_at + 2] = ' ';
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
        n = peer_hello_encode(&h, buf, sizeof buf);
        buf[idlen_at + 2] = 0;
        ck_assert_int_eq(peer_hello_decode(buf, (size_t)n, &d), -EBADMSG);
}
END_TEST

START_TEST(test_small_messages) {
        uint8_t buf[256];
        PeerChallenge c = {}, cd;
        PeerAuth a, ad;
        PeerAuthOk o = { .session_id = 42, .heartbeat_ms = 2000, .n_streams = 2 }, od;
        PeerReason rr = { .reason = PEER_FAIL_BAD_MAC }, rd;
        PeerHeartbeat hb = { .seq = 7, .time_usec = 123456789 }, hd;
        PeerWriteAck wa = { .write_id = 99, .error = -ECONNRESET }, wd;
        int n;

        strcpy(c.host_id, "beta");
        memset(c.mac, 0xaa, PEER_MAC_SIZE);
        n = peer_challenge_encode(&c, buf, sizeof buf);
        ck_assert_int_eq(peer_challenge_decode(buf, (size_t)n, &cd), 0);
        ck_assert_str_eq(cd.host_id, "beta");
        for (int k = 0; k < n; k++)
                ck_assert_int_eq(peer_challenge_decode(buf, (size_t)k, &cd), -EBADMSG);
        ck_assert_int_eq(peer_challenge_decode(buf, (size_t)n + 1, &cd), -EBADMSG);

        memset(a.mac, 0x11, PEER_MAC_SIZE);
        n = peer_auth_msg_encode(&a, buf, sizeof buf);
        ck_assert_int_eq(peer_auth_msg_decode(buf, (size_t)n, &ad), 0);
        ck_assert_mem_eq(ad.mac, a.mac, PEER_MAC_SIZE);
        ck_assert_int_eq(peer_auth_msg_decode(buf, (size_t)n - 1, &ad), -EBADMSG);
        ck_assert_int_eq(peer_auth_msg_decode(buf, (size_t)n + 1, &ad), -EBADMSG);

        n = peer_auth_ok_encode(&o, buf, sizeof buf);
        ck_assert_int_eq(peer_auth_ok_decode(buf, (size_t)n, &od), 0);
        ck_assert_uint_eq(od.session_id, 42);
        ck_assert_uint_eq(od.n_streams, 2);
        ck_assert_int_eq(peer_auth_ok_decode(buf, (size_t)n - 1, &od), -EBADMSG);
        o.session_id = 0;
        n = peer_auth_ok_encode(&o, buf, sizeof buf);
        ck_assert_int_eq(peer_auth_ok_decode(buf, (size_t)n, &od), -EBADMSG);
        o.session_id = 1;
        o.n_streams = PEER_MAX_STREAMS + 1;
        n = peer_auth_ok_encode(&o, buf, sizeof buf);
        ck_assert_int_eq(peer_auth_ok_decode(buf, (size_t)n, &od), -EBADMSG);
        o.n_streams = 1;
        o.heartbeat_ms = 0;
        n = peer_auth_ok_encode(&o, buf, sizeof buf);
        ck_assert_int_eq(peer_auth_ok_decode(buf, (size_t)n, &od), -EBADMSG);
        /* An acceptor's interval outside HeartbeatInterval='s range: the dialer beat
         * every 250 µs (1 ms) or never judged it dead (UINT32_MAX). */
        static const uint32_t bad_hb[] = { 1, 99, PEER_HEARTBEAT_MS_MAX + 1, UINT32_MAX };
        for (size_t k = 0; k < ELEMENTSOF(bad_hb); k++) {
                o.heartbeat_ms = bad_hb[k];
                n = peer_auth_ok_encode(&o, buf, sizeof buf);
                ck_assert_int_eq(peer_auth_ok_decode(buf, (size_t)n, &od), -EBADMSG);
        }
        o.heartbeat_ms = PEER_HEARTBEAT_MS_MIN;
        n = peer_auth_ok_encode(&o, buf, sizeof buf);
        ck_assert_int_eq(peer_auth_ok_decode(buf, (size_t)n, &od), 0);
        o.heartbeat_ms = PEER_HEARTBEAT_MS_MAX;
        n = peer_auth_ok_encode(&o, buf, sizeof buf);
        ck_assert_int_eq(peer_auth_ok_decode(buf, (size_t)n, &od), 0);
        ck_assert_uint_eq(od.heartbeat_ms, PEER_HEARTBEAT_MS_MAX);

        n = peer_reason_encode(&rr, buf, sizeof buf);
        ck_assert_int_eq(peer_reason_decode(buf, (size_t)n, &rd), 0);
        ck_assert_uint_eq(rd.reason, PEER_FAIL_BAD_MAC);
        ck_assert_int_eq(peer_reason_decode(buf, 3, &rd), -EBADMSG);

        n = peer_heartbeat_encode(&hb, buf, sizeof buf);
        ck_assert_int_eq(peer_heartbeat_decode(buf, (size_t)n, &hd), 0);
        ck_assert_uint_eq(hd.seq, 7);
        ck_assert_uint_eq(hd.time_usec, 123456789);
        ck_assert_int_eq(peer_heartbeat_decode(buf, 15, &hd), -EBADMSG);
        ck_assert_int_eq(peer_heartbeat_encode(&hb, buf, 15), -ENOBUFS);

        n = peer_write_ack_encode(&wa, buf, sizeof buf);
        ck_assert_int_eq(n, PEER_WRITE_ACK_SIZE);
        ck_assert_int_eq(peer_write_ack_decode(buf, (size_t)n, &wd), 0);
        ck_assert_int_eq(wd.error, -ECONNRESET);
        ck_assert_uint_eq(wd.write_id, 99);
        /* Positive or huge error codes are refused both ways. */
        wa.error = 5;
        ck_assert_int_eq(peer_write_ack_encode(&wa, buf, sizeof buf), -EINVAL);
        memset(buf + 8, 0, 4);
        buf[11] = 5;
        ck_assert_int_eq(peer_write_ack_decode(buf, PEER_WRITE_ACK_SIZE, &wd), -EBADMSG);
        memset(buf + 8, 0x80, 4);
        ck_assert_int_eq(peer_write_ack_decode(buf, PEER_WRITE_ACK_SIZE, &wd), -EBADMSG);
}
END_TEST

static int data_decode(PeerDataHeader d, uint32_t slice_len) {
        uint8_t buf[PEER_DATA_HEADER_SIZE];
        PeerDataHeader out;

        ck_assert_int_eq(peer_data_header_encode(&d, buf, sizeof buf), PEER_DATA_HEADER_SIZE);
        return peer_data_header_decode(buf, sizeof buf, PEER_DATA_HEADER_SIZE + slice_len, &out);
}

START_TEST(test_data_header) {
        PeerDataHeader d = {
                .write_id = 1, .cookie = 2, .dst_offset = 4096, .total_length = 10000,
                .slice_offset = 0, .region = 3, .slice_size = 4096,
        };
        uint8_t buf[PEER_DATA_HEADER_SIZE];
        PeerDataHeader out;

        ck_assert_int_eq(data_decode(d, 4096), 0);
        d.slice_offset = 8192;
        ck_assert_int_eq(data_decode(d, 10000 - 8192), 0);
        /* The last slice with the wrong length, a middle slice too short or too long. */
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        d.slice_offset = 4096;
        ck_assert_int_eq(data_decode(d, 4095), -EBADMSG);
        ck_assert_int_eq(data_decode(d, 4097), -EBADMSG);
        /* Off a slice boundary; past the end. */
        d.slice_offset = 100;
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        d.slice_offset = 12288;
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        /* Slice sizes out of bounds. */
        d.slice_offset = 0;
        d.slice_size = PEER_SLICE_MIN - 1;
        ck_assert_int_eq(data_decode(d, PEER_SLICE_MIN - 1), -EBADMSG);
        d.slice_size = PEER_SLICE_MAX + 1;
        d.total_length = 10;
        ck_assert_int_eq(data_decode(d, 10), -EBADMSG);
        d.slice_size = 0;
        ck_assert_int_eq(data_decode(d, 10), -EBADMSG);
        /* Empty write; offset + length overflow; too many slices. */
        d.slice_size = 4096;
        d.total_length = 0;
        ck_assert_int_eq(data_decode(d, 1), -EBADMSG);
        d.total_length = 4096;
        d.dst_offset = UINT64_MAX - 100;
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        d.dst_offset = 0;
        d.total_length = (uint64_t)4096 * (PEER_MAX_SLICES_PER_WRITE + 1);
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        d.total_length = (uint64_t)4096 * PEER_MAX_SLICES_PER_WRITE;
        ck_assert_int_eq(data_decode(d, 4096), 0);
        /* Huge slice offsets must not overflow the index arithmetic. */
        d.slice_offset = UINT64_MAX - 4095;
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        /* Short buffer, payload lengths out of range. */
        d.slice_offset = 0;
        ck_assert_int_eq(peer_data_header_encode(&d, buf, sizeof buf), PEER_DATA_HEADER_SIZE);
        ck_assert_int_eq(peer_data_header_decode(buf, sizeof buf - 1, PEER_DATA_HEADER_SIZE + 4096, &out), -EBADMSG);
        ck_assert_int_eq(peer_data_header_decode(buf, sizeof buf, PEER_DATA_HEADER_SIZE, &out), -EBADMSG);
        ck_assert_int_eq(peer_data_header_decode(buf, sizeof buf, UINT32_MAX, &out), -EBADMSG);
        ck_assert_int_eq(peer_data_header_encode(&d, buf, sizeof buf - 1), -ENOBUFS);

        /* Flags: an immediate and a target only with their flag; a target write names
         * no region; unknown flags and the reserved word are refused. */
        d.total_length = 4096;
        d.flags = PEER_DATA_F_IMM | PEER_DATA_F_TARGET;
        d.imm = 0x1234;
        d.target = 77;
        d.region = 0;
        ck_assert_int_eq(data_decode(d, 4096), 0);
        ck_assert_int_eq(peer_data_header_encode(&d, buf, sizeof buf), PEER_DATA_HEADER_SIZE);
        ck_assert_int_eq(peer_data_header_decode(buf, sizeof buf, PEER_DATA_HEADER_SIZE + 4096, &out), 0);
        ck_assert_uint_eq(out.imm, 0x1234);
        ck_assert_uint_eq(out.target, 77);
        ck_assert_uint_eq(out.flags, PEER_DATA_F_IMM | PEER_DATA_F_TARGET);
        d.region = 3;
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        d.region = 0;
        d.flags = PEER_DATA_F_TARGET; /* an immediate without its flag */
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        d.flags = PEER_DATA_F_IMM; /* a target without its flag */
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        d.flags = 0x4;
        d.imm = d.target = 0;
        ck_assert_int_eq(data_decode(d, 4096), -EBADMSG);
        d.flags = 0;
        ck_assert_int_eq(peer_data_header_encode(&d, buf, sizeof buf), PEER_DATA_HEADER_SIZE);
        buf[PEER_DATA_HEADER_SIZE - 1] = 1; /* reserved */
        ck_assert_int_eq(peer_data_header_decode(buf, sizeof buf, PEER_DATA_HEADER_SIZE + 4096, &out), -EBADMSG);
}
END_TEST

/* Cumulative acknowledgement: the ids that landed in one wakeup, in any order, become
 * runs of consecutive ids; past the runs' room the rest is left for the next frame. */
START_TEST(test_ack_runs) {
        uint64_t ids[] = { 7, 3, 4, 10, 5, 11, 1, 100 };
        PeerAckRun runs[8];
        size_t used;
        size_t n = peer_ack_runs_build(ids, ELEMENTSOF(ids), runs, ELEMENTSOF(runs), &used);
        ck_assert_uint_eq(used, ELEMENTSOF(ids));
        ck_assert_uint_eq(n, 5);
        const PeerAckRun want[] = { { 1, 1 }, { 3, 3 }, { 7, 1 }, { 10, 2 }, { 100, 1 } };
        for (size_t i = 0; i < n; i++) {
                ck_assert_uint_eq(runs[i].first, want[i].first);
                ck_assert_uint_eq(runs[i].count, want[i].count);
        }
        /* Room for two runs: [1], [3, 6); the ids from 7 on wait. */
        uint64_t again[] = { 7, 3, 4, 10, 5, 11, 1, 100 };
        n = peer_ack_runs_build(again, ELEMENTSOF(again), runs, 2, &used);
        ck_assert_uint_eq(n, 2);
        ck_assert_uint_eq(used, 4);
        ck_assert_uint_eq(again[used], 7);
        /* 10 000 writes landed in one wakeup, shuffled: one run. */
        static uint64_t many[10000];
        for (size_t i = 0; i < ELEMENTSOF(many); i++)
                many[i] = 5000 + (i * 7919) % ELEMENTSOF(many);
        n = peer_ack_runs_build(many, ELEMENTSOF(many), runs, 1, &used);
        ck_assert_uint_eq(n, 1);
        ck_assert_uint_eq(used, ELEMENTSOF(many));
        ck_assert_uint_eq(runs[0].first, 5000);
        ck_assert_uint_eq(runs[0].count, ELEMENTSOF(many));
        n = peer_ack_runs_build(many, 0, runs, 1, &used);
        ck_assert_uint_eq(n, 0);
        ck_assert_uint_eq(used, 0);
}
END_TEST

START_TEST(test_write_acks) {
        PeerAckRun runs[3] = { { 1, 5 }, { 9, 1 }, { 100, 200 } }, back[3];
        uint8_t buf[PEER_WRITE_ACKS_SIZE(3)];
        size_t n;

        ck_assert_int_eq(peer_write_acks_encode(runs, 3, buf, sizeof buf), (int)PEER_WRITE_ACKS_SIZE(3));
        ck_assert_int_eq(peer_write_acks_decode(buf, sizeof buf, back, 3, &n), 0);
        ck_assert_uint_eq(n, 3);
        for (size_t i = 0; i < 3; i++) {
                ck_assert_uint_eq(back[i].first, runs[i].first);
                ck_assert_uint_eq(back[i].count, runs[i].count);
        }
        /* Room for fewer runs than it holds; a length that does not match its count. */
        ck_assert_int_eq(peer_write_acks_decode(buf, sizeof buf, back, 2, &n), -EBADMSG);
        ck_assert_int_eq(peer_write_acks_decode(buf, sizeof buf - 1, back, 3, &n), -EBADMSG);
        ck_assert_int_eq(peer_write_acks_decode(buf, 4, back, 3, &n), -EBADMSG);
        /* An empty run, a run past the end of the ids, reserved words. */
        buf[8 + 16 + 8 + 3] = 0; /* run 1's count (big-endian u32: 1 -> 0) */
        ck_assert_int_eq(peer_write_acks_decode(buf, sizeof buf, back, 3, &n), -EBADMSG);
        buf[8 + 16 + 8 + 3] = 1;
        buf[8 + 12] = 1;
        ck_assert_int_eq(peer_write_acks_decode(buf, sizeof buf, back, 3, &n), -EBADMSG);
        buf[8 + 12] = 0;
        buf[4] = 1;
        ck_assert_int_eq(peer_write_acks_decode(buf, sizeof buf, back, 3, &n), -EBADMSG);
        buf[4] = 0;
        PeerAckRun huge = { UINT64_MAX - 1, 5 };
        ck_assert_int_eq(peer_write_acks_encode(&huge, 1, buf, sizeof buf), -EINVAL);
        ck_assert_int_eq(peer_write_acks_encode(runs, 0, buf, sizeof buf), -EINVAL);
        ck_assert_int_eq(peer_write_acks_encode(runs, 3, buf, sizeof buf - 1), -ENOBUFS);
        memset(buf, 0, 8);
        ck_assert_int_eq(peer_write_acks_decode(buf, 8, back, 3, &n), -EBADMSG); /* no run */
}
END_TEST

START_TEST(test_slice_math) {
        ck_assert_uint_eq(peer_slice_count(1, 4096), 1);
        ck_assert_uint_eq(peer_slice_count(4096, 4096), 1);
        ck_assert_uint_eq(peer_slice_count(4097, 4096), 2);
        ck_assert_uint_eq(peer_slice_count(UINT64_MAX, 4096), UINT64_MAX / 4096 + 1);
        ck_assert_uint_eq(peer_slice_count(10, 0), 0);
        ck_assert_uint_eq(peer_slice_length(4097, 4096, 0), 4096);
        ck_assert_uint_eq(peer_slice_length(4097, 4096, 1), 1);
        ck_assert_uint_eq(peer_slice_length(4097, 4096, 2), 0);
        ck_assert_uint_eq(peer_slice_length(4097, 4096, UINT64_MAX), 0);
}
END_TEST

START_TEST(test_frame_build) {
        uint8_t buf[64];
        PeerFrameHeader h;
        int n;

        n = peer_frame_build(buf, sizeof buf, PEER_MSG_HANDOFF_FIRST + 3, "hello", 5);
        ck_assert_int_eq(n, PEER_FRAME_HEADER_SIZE + 5);
        ck_assert_int_eq(peer_frame_header_decode(buf, (size_t)n, &h), 0);
        ck_assert_uint_eq(h.length, 5);
        ck_assert_mem_eq(buf + PEER_FRAME_HEADER_SIZE, "hello", 5);
        ck_assert_int_eq(peer_frame_build(buf, 20, PEER_MSG_HANDOFF_FIRST, "hello", 5), -ENOBUFS);
        ck_assert_int_eq(peer_frame_build(buf, sizeof buf, PEER_MSG_HELLO, NULL, PEER_FRAME_MAX_PAYLOAD + 1), -EMSGSIZE);
        ck_assert_str_eq(peer_msg_type_to_string(PEER_MSG_HELLO), "hello");
        ck_assert_str_eq(peer_msg_type_to_string(0x0150), "handoff");
        ck_assert_str_eq(peer_msg_type_to_string(0x0250), "directory");
        ck_assert_str_eq(peer_msg_type_to_string(0x0350), "telemetry");
        ck_assert_str_eq(peer_msg_type_to_string(0x9999), "unknown");
        ck_assert_str_eq(peer_fail_reason_to_string(PEER_FAIL_BAD_MAC), "bad-mac");
}
END_TEST

START_TEST(test_address) {
        struct sockaddr_storage sa;
        unsigned len;

        ck_assert_int_eq(peer_address_parse("10.0.0.1:7000", &sa, &len), 0);
        ck_assert_int_eq(sa.ss_family, AF_INET);
        ck_assert_uint_eq(len, sizeof(struct sockaddr_in));
        ck_assert_uint_eq(ntohs(((struct sockaddr_in *)&sa)->sin_port), 7000);
        ck_assert_int_eq(peer_address_parse("[fd00::1]:65535", &sa, &len), 0);
        ck_assert_int_eq(sa.ss_family, AF_INET6);
        const char *bad[] = {
                "", ":", "10.0.0.1", "10.0.0.1:", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:-1",
                "10.0.0.1:+5", "10.0.0.1:7x", "host.example:80", "fd00::1:80", "[fd00::1]80",
                "[fd00::1]:", "[]:80", "[zz::1]:80", "10.0.0.256:1", " 10.0.0.1:1",
                "10.0.0.1:99999999999999999999",
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
                ck_assert_msg(peer_address_parse(bad[i], &sa, &len) == -EINVAL, "accepted '%s'", bad[i]);
        ck_assert_int_eq(peer_address_parse(NULL, &sa, &len), -EINVAL);
}
END_TEST

static Suite *suite(void) {
        Suite *s = suite_create("peer-proto");
        TCase *tc = tcase_create("core");
        tcase_add_test(tc, test_header_roundtrip);
        tcase_add_test(tc, test_header_malformed);
        tcase_add_test(tc, test_host_id);
        tcase_add_test(tc, test_hello);
        tcase_add_test(tc, test_hello_fields);
        tcase_add_test(tc, test_small_messages);
        tcase_add_test(tc, test_data_header);
        tcase_add_test(tc, test_write_acks);
        tcase_add_test(tc, test_ack_runs);
        tcase_add_test(tc, test_slice_math);
        tcase_add_test(tc, test_frame_build);
        tcase_add_test(tc, test_address);
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        return check_run(suite(), CK_FORK_GETENV);
}
