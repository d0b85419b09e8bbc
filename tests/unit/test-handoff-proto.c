/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "handoff/handoff-proto.h"
#include "../check-main.h"

static EpdId rid(uint8_t v) {
        EpdId id = {};
        memset(id.bytes, v, sizeof id.bytes);
        return id;
}

/* A PREPARE of 3 groups over 1000-byte pages: group 0 one range, group 1 two, group 2 one. */
static uint32_t gr[4] = { 0, 1, 3, 4 };
static HandoffRange rg[4] = { { 0, 300 }, { 300, 100 }, { 500, 100 }, { 600, 400 } };

static HandoffMessage prepare_msg(void) {
        return (HandoffMessage) {
                .type = HANDOFF_MSG_PREPARE,
                .request_id = rid(1),
                .token = 1234,
                .timeout_usec = 5000000,
                .page_size = 1000,
                .layout_hash = 0xfeedULL,
                .target_worker = rid(9),
                .n_pages = 16,
                .n_groups = 3,
                .group_ranges = gr,
                .ranges = rg,
                .n_ranges = 4,
        };
}

static void roundtrip(const HandoffMessage *m, HandoffMessage *out, uint8_t **buf, size_t *len) {
        ck_assert_int_eq(handoff_message_encode(m, buf, len), 0);
        ck_assert_int_eq(handoff_message_decode(m->type, *buf, *len, out), 0);
        ck_assert_uint_eq(out->type, m->type);
        ck_assert(epd_id_equal(&out->request_id, &m->request_id));
        ck_assert_uint_eq(out->token, m->token);
        /* Every truncation and every extension is refused. */
        for (size_t l = 0; l < *len; l++) {
                HandoffMessage x;
                ck_assert_int_eq(handoff_message_decode(m->type, *buf, l, &x), -EBADMSG);
        }
        uint8_t *longer = malloc(*len + 1);
        memcpy(longer, *buf, *len);
        longer[*len] = 0;
        HandoffMessage x;
        ck_assert_int_eq(handoff_message_decode(m->type, longer, *len + 1, &x), -EBADMSG);
        free(longer);
}

START_TEST(test_prepare) {
        HandoffMessage m = prepare_msg(), d;
        uint8_t *buf;
        size_t len;
        roundtrip(&m, &d, &buf, &len);
        ck_assert_uint_eq(len, 16 + 8 + 24 + 16 + 8 + 16 + 3 * 4 + 4 * 16);
        ck_assert_uint_eq(d.timeout_usec, 5000000);
        ck_assert_uint_eq(d.page_size, 1000);
        ck_assert_uint_eq(d.layout_hash, 0xfeed);
        ck_assert(epd_id_equal(&d.target_worker, &m.target_worker));
        ck_assert_uint_eq(d.n_pages, 16);
        ck_assert_uint_eq(d.n_groups, 3);
        ck_assert_uint_eq(d.n_ranges, 4);
        HandoffGroupLayout l;
        ck_assert_int_eq(handoff_message_group_layout(&d, 1, &l), 0);
        ck_assert_uint_eq(l.n_ranges, 2);
        ck_assert_uint_eq(l.ranges[1].offset, 500);
        ck_assert_int_eq(handoff_message_group_layout(&d, 3, &l), -EINVAL);
        /* Byte-exact re-encoding. */
        uint8_t *again;
        size_t len2;
        ck_assert_int_eq(handoff_message_encode(&d, &again, &len2), 0);
        ck_assert_uint_eq(len2, len);
        ck_assert_mem_eq(again, buf, len);
        free(again);
        handoff_message_done(&d);

        /* A range past the page, in the bytes. Offset of group 2's range length:
         * fixed 72, group 0 = 4+16, group 1 = 4+32, group 2 head 4, offset 8. */
        size_t at = 72 + 20 + 36 + 4 + 8;
        buf[at] = 0xff;
        buf[at + 1] = 0xff;
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        free(buf);
}
END_TEST

START_TEST(test_prepare_invalid) {
        HandoffMessage m = prepare_msg();
        uint8_t *buf = NULL;
        size_t len;
        m.token = 0;
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        m = prepare_msg();
        m.request_id = (EpdId) {};
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        m = prepare_msg();
        m.page_size = 0;
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        m = prepare_msg();
        m.page_size = 999; /* the last range ends at 1000 */
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        m = prepare_msg();
        m.n_pages = 0;
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        m = prepare_msg();
        m.n_pages = HANDOFF_PAGES_MAX + 1;
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        m = prepare_msg();
        uint32_t bad_gr[4] = { 0, 2, 1, 4 }; /* groups going backwards */
        m.group_ranges = bad_gr;
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        m = prepare_msg();
        uint32_t empty_gr[4] = { 0, 0, 3, 4 }; /* a group without ranges */
        m.group_ranges = empty_gr;
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        m = prepare_msg();
        HandoffRange overlap[4] = { { 0, 300 }, { 300, 100 }, { 350, 100 }, { 600, 400 } };
        m.ranges = overlap;
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), -EINVAL);
        ck_assert_ptr_null(buf);

        /* Decoding: a group count far beyond what the payload holds. */
        m = prepare_msg();
        ck_assert_int_eq(handoff_message_encode(&m, &buf, &len), 0);
        HandoffMessage d;
        buf[68] = 0xff; /* n_groups low byte -> 0xff groups */
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[68] = 3;
        buf[88 + 2] = 1; /* group 0's reserved field */
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[88 + 2] = 0;
        buf[88] = 0; /* group 0 with zero ranges */
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[88] = 1;
        buf[76] = 1; /* the reserved word after the flags */
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[76] = 0;
        buf[72] = 0x80; /* an unknown flag */
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[72] = HANDOFF_PREPARE_F_PIPELINED; /* pipelined needs a slot */
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[80] = 9;
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), 0);
        ck_assert_uint_eq(d.slot, 9);
        ck_assert_uint_eq(d.flags, HANDOFF_PREPARE_F_PIPELINED);
        handoff_message_done(&d);
        buf[72] = 0; /* a slot without pipelining */
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[72] = HANDOFF_PREPARE_F_IMM | HANDOFF_PREPARE_F_PIPELINED;
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), 0);
        ck_assert_uint_eq(d.flags, HANDOFF_PREPARE_F_IMM | HANDOFF_PREPARE_F_PIPELINED);
        handoff_message_done(&d);
        /* Targeted (writes to the slot after PREPARE_OK): a slot, and not pipelined too. */
        buf[72] = HANDOFF_PREPARE_F_TARGETED;
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), 0);
        ck_assert_uint_eq(d.slot, 9);
        ck_assert_uint_eq(d.flags, HANDOFF_PREPARE_F_TARGETED);
        handoff_message_done(&d);
        buf[72] = HANDOFF_PREPARE_F_TARGETED | HANDOFF_PREPARE_F_PIPELINED;
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[72] = HANDOFF_PREPARE_F_TARGETED;
        buf[80] = 0;
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), -EBADMSG);
        buf[80] = 9;
        buf[72] = 0;
        buf[80] = 0;
        ck_assert_int_eq(handoff_message_decode(m.type, buf, len, &d), 0);
        handoff_message_done(&d);
        free(buf);
}
END_TEST

START_TEST(test_small_messages) {
        HandoffMessage d;
        uint8_t *buf;
        size_t len;
        uint64_t offs[3] = { 4096, 8192, 1 << 20 };

        HandoffMessage ok = { .type = HANDOFF_MSG_PREPARE_OK, .request_id = rid(2), .token = 5,
                              .region = 3, .n_pages = 3, .page_offsets = offs };
        roundtrip(&ok, &d, &buf, &len);
        ck_assert_uint_eq(d.region, 3);
        ck_assert_uint_eq(d.n_pages, 3);
        ck_assert_uint_eq(d.page_offsets[2], 1 << 20);
        handoff_message_done(&d);
        free(buf);
        ok.n_pages = 0;
        ck_assert_int_eq(handoff_message_encode(&ok, &buf, &len), -EINVAL);

        HandoffMessage ref = { .type = HANDOFF_MSG_PREPARE_REFUSED, .request_id = rid(2), .token = 5,
                               .cause = HANDOFF_CAUSE_NO_SPACE, .error = -ENOSPC };
        roundtrip(&ref, &d, &buf, &len);
        ck_assert_int_eq(d.cause, HANDOFF_CAUSE_NO_SPACE);
        ck_assert_int_eq(d.error, -ENOSPC);
        buf[24] = 0; /* cause none */
        ck_assert_int_eq(handoff_message_decode(ref.type, buf, len, &d), -EBADMSG);
        buf[24] = HANDOFF_CAUSE_NO_SPACE;
        memset(buf + 28, 0, 4); /* error 0 */
        ck_assert_int_eq(handoff_message_decode(ref.type, buf, len, &d), -EBADMSG);
        free(buf);
        ref.error = 0;
        ck_assert_int_eq(handoff_message_encode(&ref, &buf, &len), -EINVAL);
        ref.error = -ENOSPC;
        ref.cause = _HANDOFF_CAUSE_MAX;
        ck_assert_int_eq(handoff_message_encode(&ref, &buf, &len), -EINVAL);

        HandoffMessage sent = { .type = HANDOFF_MSG_GROUP_SENT, .request_id = rid(2), .token = 5,
                                .group = 7, .bytes = 123456789 };
        roundtrip(&sent, &d, &buf, &len);
        ck_assert_uint_eq(d.group, 7);
        ck_assert_uint_eq(d.bytes, 123456789);
        buf[28] = 1; /* reserved */
        ck_assert_int_eq(handoff_message_decode(sent.type, buf, len, &d), -EBADMSG);
        free(buf);
        sent.group = HANDOFF_GROUPS_MAX;
        ck_assert_int_eq(handoff_message_encode(&sent, &buf, &len), -EINVAL);

        HandoffMessage commit = { .type = HANDOFF_MSG_COMMIT, .request_id = rid(2), .token = 5 };
        roundtrip(&commit, &d, &buf, &len);
        ck_assert_uint_eq(len, 24);
        free(buf);

        HandoffMessage rb = { .type = HANDOFF_MSG_ROLLBACK, .request_id = rid(2), .token = 5,
                              .cause = HANDOFF_CAUSE_PEER_DOWN };
        roundtrip(&rb, &d, &buf, &len);
        ck_assert_int_eq(d.cause, HANDOFF_CAUSE_PEER_DOWN);
        free(buf);

        /* Unknown types. */
        uint8_t zero[24] = { 1 };
        zero[16] = 1;
        ck_assert_int_eq(handoff_message_decode(0x01ff, zero, 24, &d), -EOPNOTSUPP);
        ck_assert_int_eq(handoff_message_decode(0x0200, zero, 24, &d), -EINVAL);
        ck_assert_int_eq(handoff_message_decode(HANDOFF_MSG_COMMIT, NULL, 0, &d), -EBADMSG);
        HandoffMessage unknown = { .type = 0x01ff, .request_id = rid(2), .token = 5 };
        ck_assert_int_eq(handoff_message_encode(&unknown, &buf, &len), -EOPNOTSUPP);
        ck_assert_str_eq(handoff_message_type_to_string(HANDOFF_MSG_GROUP_SENT), "group-sent");
        ck_assert_ptr_null(handoff_message_type_to_string(0x01ff));
        handoff_message_done(NULL);
}
END_TEST

/* A group's completion in the data stream: the immediate of its last write names the
 * group (every group up to HANDOFF_GROUPS_MAX) and the bytes it moves in all. A pipelined
 * write's offset names the page and the offset in it. */
START_TEST(test_group_imm) {
        ck_assert_uint_ge(1024, HANDOFF_GROUPS_MAX);
        for (uint32_t g = 0; g < HANDOFF_GROUPS_MAX; g += 37) {
                uint64_t bytes = ((uint64_t)g << 20) + 4096 * g + 1;
                uint64_t imm = handoff_group_imm(g, bytes);
                ck_assert_uint_eq(HANDOFF_IMM_GROUP(imm), g);
                ck_assert_uint_eq(HANDOFF_IMM_BYTES(imm), bytes);
        }
        uint64_t big = (UINT64_C(1) << 53) + 12345; /* far past any arena */
        ck_assert_uint_eq(HANDOFF_IMM_BYTES(handoff_group_imm(HANDOFF_GROUPS_MAX - 1, big)), big);
        ck_assert_uint_eq(HANDOFF_IMM_GROUP(handoff_group_imm(HANDOFF_GROUPS_MAX - 1, big)), HANDOFF_GROUPS_MAX - 1);
        uint64_t off = handoff_slot_offset(7, 65535);
        ck_assert_uint_eq(off >> 32, 7);
        ck_assert_uint_eq(off & UINT32_MAX, 65535);
}
END_TEST

int main(void) {
        Suite *s = suite_create("handoff-proto");
        TCase *tc = tcase_create("handoff-proto");
        tcase_add_test(tc, test_prepare);
        tcase_add_test(tc, test_prepare_invalid);
        tcase_add_test(tc, test_small_messages);
        tcase_add_test(tc, test_group_imm);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
