/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The directory's peer messages (daemon/pages/directory-proto.c): round trips, every
 * truncation, every header field, names, bounds, a newer version. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "pages/directory-proto.h"
#include "../check-main.h"

static void check_truncations(uint16_t type, const uint8_t *p, size_t len) {
        DirectoryMessage m;
        for (size_t k = 0; k < len; k++)
                ck_assert_msg(directory_message_parse(type, p, k, &m) < 0, "type %#x accepted %zu of %zu bytes", type,
                              k, len);
        /* And one byte too many. */
        uint8_t *longer = malloc(len + 1);
        memcpy(longer, p, len);
        longer[len] = 0;
        ck_assert_int_eq(directory_message_parse(type, longer, len + 1, &m), -EBADMSG);
        free(longer);
}

START_TEST(test_publish_round_trip) {
        uint64_t h[3] = { 1, 0xffffffffffffffffULL, 42 };
        DirectoryMessage m;
        uint8_t *p;
        size_t len;

        ck_assert_int_eq(directory_publish_encode(DIRECTORY_MSG_PUBLISH, "kv0", "prefill-0", h, 3, &p, &len), 0);
        ck_assert_uint_eq(len, 8 + 1 + 3 + 1 + 9 + 24);
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_PUBLISH, p, len, &m), 0);
        ck_assert_uint_eq(m.count, 3);
        ck_assert_str_eq(m.arena, "kv0");
        ck_assert_str_eq(m.worker, "prefill-0");
        ck_assert_uint_eq(m.hashes[1], h[1]);
        directory_message_done(&m);
        check_truncations(DIRECTORY_MSG_PUBLISH, p, len);

        /* Header fields: a newer version is told apart from garbage. */
        p[0] = 2;
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_PUBLISH, p, len, &m), -EPROTONOSUPPORT);
        p[0] = 0;
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_PUBLISH, p, len, &m), -EBADMSG);
        p[0] = 1;
        for (int i = 1; i < 4; i++) {
                p[i] = 1;
                ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_PUBLISH, p, len, &m), -EBADMSG);
                p[i] = 0;
        }
        /* A count that disagrees with the payload. */
        p[4] = 4;
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_PUBLISH, p, len, &m), -EBADMSG);
        p[4] = 3;
        /* A name with a control character. */
        p[10] = '\n';
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_PUBLISH, p, len, &m), -EBADMSG);
        free(p);

        /* Empty names are allowed (a restored entry has no publisher); bad ones are not. */
        ck_assert_int_eq(directory_publish_encode(DIRECTORY_MSG_UNPUBLISH, "", "", h, 1, &p, &len), 0);
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_UNPUBLISH, p, len, &m), 0);
        directory_message_done(&m);
        free(p);
        ck_assert_int_eq(directory_publish_encode(DIRECTORY_MSG_PUBLISH, "kv\t", "", h, 1, &p, &len), -EINVAL);
        ck_assert_int_eq(directory_publish_encode(DIRECTORY_MSG_PUBLISH, "kv0", "", h, 0, &p, &len), -EINVAL);
        ck_assert_int_eq(directory_publish_encode(DIRECTORY_MSG_LOOKUP, "kv0", "", h, 1, &p, &len), -EINVAL);
        char longname[80];
        memset(longname, 'a', sizeof longname - 1);
        longname[79] = 0;
        ck_assert_int_eq(directory_publish_encode(DIRECTORY_MSG_PUBLISH, longname, "", h, 1, &p, &len), -EINVAL);
        /* The batch bound. */
        uint64_t *many = calloc(DIRECTORY_BATCH_MAX + 1, sizeof *many);
        ck_assert_int_eq(directory_publish_encode(DIRECTORY_MSG_PUBLISH, "kv0", "", many, DIRECTORY_BATCH_MAX, &p, &len),
                         0);
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_PUBLISH, p, len, &m), 0);
        directory_message_done(&m);
        free(p);
        ck_assert_int_eq(
                directory_publish_encode(DIRECTORY_MSG_PUBLISH, "kv0", "", many, DIRECTORY_BATCH_MAX + 1, &p, &len),
                -EINVAL);
        free(many);
}
END_TEST

START_TEST(test_lookup_answer_round_trip) {
        uint64_t h[2] = { 7, 8 };
        DirectoryAnswerEntry e[2] = {};
        DirectoryMessage m;
        uint8_t *p;
        size_t len;

        ck_assert_int_eq(directory_lookup_encode(99, h, 2, &p, &len), 0);
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_LOOKUP, p, len, &m), 0);
        ck_assert_uint_eq(m.request, 99);
        ck_assert_uint_eq(m.hashes[0], 7);
        directory_message_done(&m);
        check_truncations(DIRECTORY_MSG_LOOKUP, p, len);
        free(p);
        uint64_t big[DIRECTORY_LOOKUP_MAX + 1] = {};
        ck_assert_int_eq(directory_lookup_encode(1, big, DIRECTORY_LOOKUP_MAX + 1, &p, &len), -EINVAL);

        e[0].hash = 7;
        e[0].n_holders = 2;
        strcpy(e[0].holders[0].host, "alpha");
        strcpy(e[0].holders[0].arena, "kv0");
        strcpy(e[0].holders[0].worker, "w0");
        strcpy(e[0].holders[1].host, "bravo");
        strcpy(e[0].holders[1].arena, "kv1");
        e[1].hash = 8;
        ck_assert_int_eq(directory_answer_encode(99, e, 2, &p, &len), 0);
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_ANSWER, p, len, &m), 0);
        ck_assert_uint_eq(m.count, 2);
        ck_assert_uint_eq(m.entries[0].n_holders, 2);
        ck_assert_str_eq(m.entries[0].holders[1].host, "bravo");
        ck_assert_str_eq(m.entries[0].holders[1].worker, "");
        ck_assert_uint_eq(m.entries[1].n_holders, 0);
        directory_message_done(&m);
        check_truncations(DIRECTORY_MSG_ANSWER, p, len);
        free(p);

        /* A holder's host must be a host id. */
        strcpy(e[0].holders[0].host, "al pha");
        ck_assert_int_eq(directory_answer_encode(99, e, 2, &p, &len), -EINVAL);
        strcpy(e[0].holders[0].host, "");
        ck_assert_int_eq(directory_answer_encode(99, e, 2, &p, &len), -EINVAL);
        e[0].n_holders = DIRECTORY_HOLDERS_MAX + 1;
        ck_assert_int_eq(directory_answer_encode(99, e, 2, &p, &len), -EINVAL);
        /* An unknown type of the range. */
        uint8_t hdr[8] = { 1, 0, 0, 0, 1, 0, 0, 0 };
        ck_assert_int_eq(directory_message_parse(0x0299, hdr, sizeof hdr, &m), -EBADMSG);
}
END_TEST

START_TEST(test_answer_holder_count) {
        /* n_holders past the bound, in an otherwise well-formed ANSWER. */
        uint8_t p[8 + 8 + 9] = { 1, 0, 0, 0, 1, 0, 0, 0 };
        DirectoryMessage m;
        p[16 + 8] = DIRECTORY_HOLDERS_MAX + 1;
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_ANSWER, p, sizeof p, &m), -EBADMSG);
        p[16 + 8] = 0;
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_ANSWER, p, sizeof p, &m), 0);
        directory_message_done(&m);
        /* A count of zero is never valid. */
        p[4] = 0;
        ck_assert_int_eq(directory_message_parse(DIRECTORY_MSG_ANSWER, p, sizeof p, &m), -EBADMSG);
}
END_TEST

int main(void) {
        Suite *s = suite_create("directory-proto");
        TCase *tc = tcase_create("directory-proto");
        tcase_add_test(tc, test_publish_round_trip);
        tcase_add_test(tc, test_lookup_answer_round_trip);
        tcase_add_test(tc, test_answer_holder_count);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
