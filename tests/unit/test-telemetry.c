/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The telemetry table of tracked connections, without the kernel part (not started):
 * the daemon's own connections to a peer go when the peer goes down; a client's
 * (TrackSocket) stay until the client untracks them; a socket is tracked once. */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <systemd/sd-event.h>
#include <sys/socket.h>
#include <unistd.h>

#include "telemetry/telemetry.h"
#include "../check-main.h"

static void tcp_pair(int *a, int *b) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t l = sizeof sa;
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(s, 0);
        ck_assert_int_eq(bind(s, (struct sockaddr *)&sa, sizeof sa), 0);
        ck_assert_int_eq(listen(s, 4), 0);
        ck_assert_int_eq(getsockname(s, (struct sockaddr *)&sa, &l), 0);
        *a = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(*a, 0);
        ck_assert_int_eq(connect(*a, (struct sockaddr *)&sa, sizeof sa), 0);
        *b = accept4(s, NULL, NULL, SOCK_CLOEXEC);
        ck_assert_int_ge(*b, 0);
        close(s);
}

static unsigned tracked(Telemetry *t, const char *peer) {
        TelemetryPeerStats st;
        ck_assert_int_eq(telemetry_get_peer(t, peer, &st), 0);
        return st.tracked;
}

START_TEST(test_peer_down_keeps_clients_connections) {
        sd_event *e;
        Telemetry *t;
        int own[2], client[2];
        ck_assert_int_ge(sd_event_new(&e), 0);
        ck_assert_int_eq(telemetry_new(&t, e, NULL), 0);
        tcp_pair(&own[0], &own[1]);
        tcp_pair(&client[0], &client[1]);

        ck_assert_int_eq(telemetry_track(t, own[0], "hostB"), 0);
        ck_assert_int_eq(telemetry_track_client(t, client[0], "hostB"), 0);
        ck_assert_int_eq(telemetry_track_client(t, client[0], "hostB"), -EEXIST);
        ck_assert_int_eq(telemetry_track(t, own[0], "hostB"), -EEXIST);
        ck_assert_uint_eq(tracked(t, "hostB"), 2);

        /* hostB went down: the daemon's own connection to it is gone, the client's is
         * still the client's to untrack. */
        ck_assert_int_eq(telemetry_untrack_all(t, "hostB"), 0);
        ck_assert_uint_eq(tracked(t, "hostB"), 1);
        ck_assert_int_eq(telemetry_untrack(t, own[0]), -ENOENT);
        ck_assert_int_eq(telemetry_untrack(t, client[0]), 0);
        ck_assert_uint_eq(tracked(t, "hostB"), 0);
        ck_assert_int_eq(telemetry_untrack(t, client[0]), -ENOENT);

        for (int i = 0; i < 2; i++) {
                close(own[i]);
                close(client[i]);
        }
        telemetry_free(t);
        sd_event_unref(e);
}
END_TEST

/* The kernel's segs_out and total_retrans are 32-bit: a connection's totals carry on
 * across their wrap, and the peer's exported totals keep moving with the bytes (they
 * froze, every field of them, from the wrap until 4G more segments had gone). */
START_TEST(test_counters_carry_on_past_the_kernels_32_bit_wrap) {
        TelemetryConnReading r = {};
        TelemetryPeerTotals kept = {};

        telemetry_conn_reading_update(&r, 1000, 900, 50, 0, 0xFFFFFFF0u, 0xFFFFFFFFu);
        ck_assert_uint_eq(r.totals.segs_out, 0xFFFFFFF0u);
        ck_assert_uint_eq(r.totals.retransmits, 0xFFFFFFFFu);
        telemetry_totals_merge_max(&kept, &r.totals);

        /* 0x20 segments and 2 retransmits later, both past 2^32. */
        telemetry_conn_reading_update(&r, 5000, 4000, 60, 10, 0x10u, 1u);
        ck_assert_uint_eq(r.totals.segs_out, 0xFFFFFFF0ull + 0x20);
        ck_assert_uint_eq(r.totals.retransmits, 0xFFFFFFFFull + 2);
        ck_assert_uint_eq(r.totals.bytes_sent, 5000);
        telemetry_totals_merge_max(&kept, &r.totals);
        ck_assert_uint_eq(kept.bytes_sent, 5000);
        ck_assert_uint_eq(kept.bytes_acked, 4000);
        ck_assert_uint_eq(kept.segs_out, 0x100000010ull);

        /* A field that reads lower (a record read while another connection's is missing)
         * stays where it was; the others still move. */
        TelemetryPeerTotals lower = kept;
        lower.segs_out -= 5;
        lower.bytes_sent += 100;
        telemetry_totals_merge_max(&kept, &lower);
        ck_assert_uint_eq(kept.segs_out, 0x100000010ull);
        ck_assert_uint_eq(kept.bytes_sent, 5100);
}
END_TEST

int main(void) {
        Suite *s = suite_create("telemetry");
        TCase *tc = tcase_create("telemetry");
        tcase_add_test(tc, test_peer_down_keeps_clients_connections);
        tcase_add_test(tc, test_counters_carry_on_past_the_kernels_32_bit_wrap);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
