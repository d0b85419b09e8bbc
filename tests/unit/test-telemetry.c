/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The telemetry table of tracked connections, without the kernel part (not started):
 * the daemon's own connections to a peer go when the peer goes down; a client's
 * (TrackSocket) stay until the client untracks them; a socket is tracked once. */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
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

/* Clients' TrackSocket names fill at most three quarters of MaxPeers= (192 of 256):
 * the daemon's own peer still gets an entry (its telemetry, backpressure and handoff
 * load). A client that tracked sockets under 256 made-up names left it none (-ENOSPC
 * for both). */
START_TEST(test_clients_leave_room_for_own_peers) {
        sd_event *e;
        Telemetry *t;
        int fds[256];
        unsigned tracked = 0, refused = 0;
        ck_assert_int_ge(sd_event_new(&e), 0);
        ck_assert_int_eq(telemetry_new(&t, e, NULL), 0);
        for (int i = 0; i < 256; i++) {
                char name[32];
                snprintf(name, sizeof name, "made-up-%d", i);
                fds[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                ck_assert_int_ge(fds[i], 0);
                int r = telemetry_track_client(t, fds[i], name);
                ck_assert(r == 0 || r == -ENOSPC);
                tracked += r == 0;
                refused += r == -ENOSPC;
        }
        ck_assert_uint_eq(tracked, 192);
        ck_assert_uint_eq(refused, 64);
        int own[2];
        tcp_pair(&own[0], &own[1]);
        ck_assert_int_eq(telemetry_track(t, own[0], "real-peer"), 0);
        ck_assert_int_eq(telemetry_set_peer_load(t, "real-peer", 5, 0, 0), 0);
        for (int i = 0; i < 256; i++)
                close(fds[i]);
        close(own[0]);
        close(own[1]);
        telemetry_free(t);
        sd_event_unref(e);
}
END_TEST

/* Telemetry started with its BPF programs loaded, or NULL (SKIP printed, nothing left)
 * where this kernel or user cannot load them. */
static Telemetry *start_kernel_telemetry(sd_event **e, const TelemetryConfig *cfg, const char *test) {
        Telemetry *t;
        TelemetryCounters k;
        ck_assert_int_ge(sd_event_new(e), 0);
        ck_assert_int_eq(telemetry_new(&t, *e, cfg), 0);
        ck_assert_int_eq(telemetry_start(t), 0);
        telemetry_get_counters(t, &k);
        if (k.bpf_loaded)
                return t;
        printf("SKIP %s: no kernel telemetry (%s)\n", test, k.bpf_unavailable ? k.bpf_unavailable : "?");
        telemetry_free(t);
        *e = sd_event_unref(*e);
        return NULL;
}

/* A tracked client socket reset with bytes queued: its last send queue stays out of
 * the path's figures, and the level goes back to none while the daemon's own
 * connection to the peer moves (it stayed high, send-queue, as long as the client kept
 * the socket tracked). Needs the kernel telemetry (BPF): skipped without it. */
START_TEST(test_dead_socket_leaves_the_path) {
        sd_event *e;
        TelemetryConfig cfg;
        ck_assert_int_eq(telemetry_config_defaults(&cfg), 0);
        cfg.backpressure.hold_usec = 100 * USEC_PER_MSEC;
        Telemetry *t = start_kernel_telemetry(&e, &cfg, "test_dead_socket_leaves_the_path");
        telemetry_config_done(&cfg);
        if (!t)
                return;
        int own[2], c[2];
        tcp_pair(&own[0], &own[1]);
        tcp_pair(&c[0], &c[1]);
        ck_assert_int_eq(telemetry_track(t, own[0], "hostB"), 0);
        ck_assert_int_eq(telemetry_track_client(t, c[0], "hostB"), 0);
        int big = 64 << 20, small = 4096;
        ck_assert_int_eq(setsockopt(c[0], SOL_SOCKET, SO_SNDBUFFORCE, &big, sizeof big), 0);
        (void)setsockopt(c[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
        ck_assert_int_eq(fcntl(c[0], F_SETFL, O_NONBLOCK), 0);
        static char buf[1 << 20];
        size_t queued = 0;
        for (int i = 0; i < 200; i++) {
                ssize_t n = write(c[0], buf, sizeof buf);
                if (n < 0)
                        break;
                queued += (size_t)n;
        }
        ck_assert_uint_gt(queued, 1 << 20);
        usleep(50000);
        telemetry_evaluate(t);
        close(c[1]); /* unread bytes: a reset; the client's socket is dead, still tracked */
        usleep(100000);
        TelemetryPeerStats st = {};
        for (int i = 0; i < 30; i++) {
                ck_assert_int_eq(write(own[0], "ping", 4), 4);
                ck_assert_int_eq(read(own[1], buf, 4), 4);
                telemetry_evaluate(t);
                ck_assert_int_eq(telemetry_get_peer(t, "hostB", &st), 0);
                if (i >= 10 && st.level == BACKPRESSURE_NONE)
                        break;
                usleep(100000);
        }
        ck_assert_msg(st.level == BACKPRESSURE_NONE, "level %s (%s), send queue %llu, established %u of %u",
                      backpressure_level_to_string(st.level), backpressure_reason_to_string(st.reason),
                      (unsigned long long)st.path.send_queue, st.path.n_established, st.path.n_conns);
        ck_assert_uint_lt(st.path.send_queue, 1 << 20);
        close(c[0]);
        close(own[0]);
        close(own[1]);
        telemetry_free(t);
        sd_event_unref(e);
}
END_TEST

/* A socket untracked and tracked again counts from where it stood when tracked: its
 * history is in the peer's totals once (the kernel counts from the socket's creation;
 * a re-track counted the first 1 MiB twice). Needs the kernel telemetry (BPF). */
START_TEST(test_retrack_counts_once) {
        sd_event *e;
        int c[2];
        Telemetry *t = start_kernel_telemetry(&e, NULL, "test_retrack_counts_once");
        if (!t)
                return;
        tcp_pair(&c[0], &c[1]);
        ck_assert_int_eq(telemetry_track_client(t, c[0], "hostB"), 0);
        static char buf[1 << 20];
        ck_assert_int_eq(write(c[0], buf, sizeof buf), (ssize_t)sizeof buf);
        for (size_t got = 0; got < sizeof buf;) {
                ssize_t n = read(c[1], buf, sizeof buf - got);
                ck_assert_int_gt(n, 0);
                got += (size_t)n;
        }
        usleep(100000);
        telemetry_evaluate(t);
        TelemetryPeerStats st;
        ck_assert_int_eq(telemetry_get_peer(t, "hostB", &st), 0);
        uint64_t first = st.totals.bytes_acked;
        ck_assert_uint_ge(first, 900000); /* most of it acknowledged by now */

        ck_assert_int_eq(telemetry_untrack(t, c[0]), 0);
        ck_assert_int_eq(telemetry_track_client(t, c[0], "hostB"), 0);
        ck_assert_int_eq(write(c[0], "x", 1), 1); /* so that the kernel reports it again */
        ck_assert_int_eq(read(c[1], buf, 1), 1);
        usleep(100000);
        telemetry_evaluate(t);
        ck_assert_int_eq(telemetry_get_peer(t, "hostB", &st), 0);
        ck_assert_msg(st.totals.bytes_acked <= first + 1000, "acked %llu after 1 byte more than %llu",
                      (unsigned long long)st.totals.bytes_acked, (unsigned long long)first);
        close(c[0]);
        close(c[1]);
        telemetry_free(t);
        sd_event_unref(e);
}
END_TEST

/* Clients' names stay within their share while the daemon's peers are down: 240 own
 * peers tracked, all their connections then gone (their entries idle), clients' new
 * names take no more than 192 entries in all, and 64 own peers get one back. Each
 * client name used to reclaim one idle entry for itself: clients ended with 240 and
 * only 16 own peers got one. */
START_TEST(test_client_names_stay_in_their_share) {
        sd_event *e;
        Telemetry *t;
        static int own[240], cl[512];
        char name[32];
        unsigned clients = 0, back = 0;
        ck_assert_int_ge(sd_event_new(&e), 0);
        ck_assert_int_eq(telemetry_new(&t, e, NULL), 0);
        for (int i = 0; i < 240; i++) {
                snprintf(name, sizeof name, "own-%d", i);
                own[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                ck_assert_int_eq(telemetry_track(t, own[i], name), 0);
        }
        for (int i = 0; i < 512; i++) {
                if (i == 256) /* every own peer's connections gone (a partition): idle entries */
                        for (int j = 0; j < 240; j++) {
                                snprintf(name, sizeof name, "own-%d", j);
                                ck_assert_int_eq(telemetry_untrack_all(t, name), 0);
                        }
                snprintf(name, sizeof name, "made-up-%d", i);
                cl[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                clients += telemetry_track_client(t, cl[i], name) == 0;
        }
        ck_assert_uint_le(clients, 192);
        for (int i = 0; i < 240; i++) {
                snprintf(name, sizeof name, "own-%d", i);
                int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                back += telemetry_track(t, fd, name) == 0;
                close(fd);
        }
        ck_assert_uint_ge(back, 64);
        for (int i = 0; i < 240; i++)
                close(own[i]);
        for (int i = 0; i < 512; i++)
                close(cl[i]);
        telemetry_free(t);
        sd_event_unref(e);
}
END_TEST

int main(void) {
        Suite *s = suite_create("telemetry");
        TCase *tc = tcase_create("telemetry");
        tcase_add_test(tc, test_peer_down_keeps_clients_connections);
        tcase_add_test(tc, test_counters_carry_on_past_the_kernels_32_bit_wrap);
        tcase_add_test(tc, test_clients_leave_room_for_own_peers);
        tcase_add_test(tc, test_client_names_stay_in_their_share);
        tcase_add_test(tc, test_dead_socket_leaves_the_path);
        tcase_add_test(tc, test_retrack_counts_once);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
