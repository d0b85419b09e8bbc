/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "telemetry/telemetry-event.h"

static struct epd_event built(void) {
        return (struct epd_event){
                .abi = EPD_TELEMETRY_ABI,
                .type = EPD_EVENT_SAMPLE,
                .peer_id = 3,
                .cookie = 0x1122334455667788ULL,
                .ts_ns = 123456789,
                .srtt_us = 850,
                .min_rtt_us = 410,
                .snd_cwnd = 10,
                .send_queue = 65536,
                .inflight_bytes = 14480,
                .total_retrans = 2,
                .old_state = 1,
                .new_state = 1,
                .bytes_acked = 1 << 20,
                .bytes_sent = (1 << 20) + 1448,
        };
}

START_TEST(test_decode) {
        struct epd_event e = built();
        TelemetryEvent d;
        ck_assert_int_eq(telemetry_event_decode(&e, sizeof e, &d), 0);
        ck_assert_int_eq(d.type, TELEMETRY_EVENT_SAMPLE);
        ck_assert_uint_eq(d.peer_id, 3);
        ck_assert_uint_eq(d.cookie, 0x1122334455667788ULL);
        ck_assert_uint_eq(d.ts_nsec, 123456789);
        ck_assert_uint_eq(d.srtt_usec, 850);
        ck_assert_uint_eq(d.min_rtt_usec, 410);
        ck_assert_uint_eq(d.cwnd, 10);
        ck_assert_uint_eq(d.send_queue, 65536);
        ck_assert_uint_eq(d.inflight, 14480);
        ck_assert_uint_eq(d.total_retrans, 2);
        ck_assert_uint_eq(d.bytes_acked, 1 << 20);
        ck_assert_uint_eq(d.bytes_sent, (1 << 20) + 1448);

        e.type = EPD_EVENT_STATE;
        e.old_state = 1;
        e.new_state = 7;
        ck_assert_int_eq(telemetry_event_decode(&e, sizeof e, &d), 0);
        ck_assert_int_eq(d.type, TELEMETRY_EVENT_STATE);
        ck_assert(tcp_state_is_closing(d.new_state));
        ck_assert(!tcp_state_is_closing(d.old_state));
        ck_assert_str_eq(tcp_state_to_string(d.new_state), "close");
        ck_assert_str_eq(tcp_state_to_string(99), "unknown");

        /* Longer records (a future ABI appending fields) decode the known prefix. */
        unsigned char big[sizeof e + 16];
        memset(big, 0xff, sizeof big);
        e = built();
        memcpy(big, &e, sizeof e);
        ck_assert_int_eq(telemetry_event_decode(big, sizeof big, &d), 0);

        /* Unaligned input is fine. */
        unsigned char un[sizeof e + 1];
        memcpy(un + 1, &e, sizeof e);
        ck_assert_int_eq(telemetry_event_decode(un + 1, sizeof e, &d), 0);
        ck_assert_uint_eq(d.cookie, e.cookie);
}
END_TEST

START_TEST(test_decode_rejects) {
        struct epd_event e = built();
        TelemetryEvent d;
        ck_assert_int_eq(telemetry_event_decode(&e, sizeof e - 1, &d), -EBADMSG);
        ck_assert_int_eq(telemetry_event_decode(NULL, sizeof e, &d), -EBADMSG);
        ck_assert_int_eq(telemetry_event_decode(&e, 0, &d), -EBADMSG);
        e.abi = EPD_TELEMETRY_ABI + 1;
        ck_assert_int_eq(telemetry_event_decode(&e, sizeof e, &d), -EBADMSG);
        e = built();
        e.type = 0;
        ck_assert_int_eq(telemetry_event_decode(&e, sizeof e, &d), -EBADMSG);
        e.type = _EPD_EVENT_MAX;
        ck_assert_int_eq(telemetry_event_decode(&e, sizeof e, &d), -EBADMSG);
        e = built();
        e.new_state = 200;
        ck_assert_int_eq(telemetry_event_decode(&e, sizeof e, &d), -EBADMSG);

        /* Arbitrary bytes never crash and are mostly rejected. */
        unsigned char junk[sizeof e];
        unsigned seed = 1;
        for (int i = 0; i < 10000; i++) {
                for (size_t j = 0; j < sizeof junk; j++)
                        junk[j] = (unsigned char)(rand_r(&seed) >> 3);
                (void)telemetry_event_decode(junk, (size_t)rand_r(&seed) % (sizeof junk + 1), &d);
        }
}
END_TEST

START_TEST(test_path_aggregate) {
        TelemetryPathStats p = {};
        struct epd_conn_stats a = {
                .state = 1, .srtt_us = 900, .min_rtt_us = 300, .snd_cwnd = 10,
                .bytes_sent = 1000, .bytes_acked = 900, .segs_out = 10, .total_retrans = 1,
                .send_queue = 100, .inflight_bytes = 50, .last_probe_ns = 5,
        };
        /* Closed (state 7, TCP_CLOSE): its counts stay in the path's, not its queue,
         * window, RTT or last probe. */
        struct epd_conn_stats b = {
                .state = 7, .srtt_us = 5000, .min_rtt_us = 0, .snd_cwnd = 4,
                .bytes_sent = 10, .bytes_acked = 10, .segs_out = 2, .total_retrans = 3,
                .send_queue = 1 << 20, .inflight_bytes = 4096, .last_probe_ns = 9,
        };
        struct epd_conn_stats c = { .state = 1, .srtt_us = 100, .min_rtt_us = 80 };
        telemetry_path_stats_add(&p, &a);
        telemetry_path_stats_add(&p, &b);
        ck_assert_uint_eq(p.n_conns, 2);
        ck_assert_uint_eq(p.n_established, 1);
        ck_assert_uint_eq(p.srtt_usec, 900);
        ck_assert_uint_eq(p.min_rtt_usec, 300); /* zero means "no sample", not a minimum */
        ck_assert_uint_eq(p.cwnd, 10);
        ck_assert_uint_eq(p.send_queue, 100);
        ck_assert_uint_eq(p.inflight, 50);
        ck_assert_uint_eq(p.bytes_sent, 1010);
        ck_assert_uint_eq(p.retransmits, 4);
        ck_assert_uint_eq(p.segs_out, 12);
        ck_assert_uint_eq(p.last_probe_nsec, 5);
        telemetry_path_stats_add(&p, &c);
        ck_assert_uint_eq(p.min_rtt_usec, 80);
}
END_TEST

int main(void) {
        Suite *s = suite_create("telemetry-event");
        TCase *tc = tcase_create("telemetry-event");
        tcase_add_test(tc, test_decode);
        tcase_add_test(tc, test_decode_rejects);
        tcase_add_test(tc, test_path_aggregate);
        suite_add_tcase(s, tc);
        SRunner *sr = srunner_create(s);
        srunner_run_all(sr, CK_NORMAL);
        int failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
