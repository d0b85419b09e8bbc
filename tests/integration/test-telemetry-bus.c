/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Telemetry end to end on a live epdd: the introspection matches the XML; the
 * calls answer; bad input gets named errors; a TCP socket handed over with TrackSocket
 * is tracked until UntrackSocket, or until its client disconnects. Kernel telemetry
 * may or may not load here (root, BTF): both are valid, the bus API is the same. */
#include <arpa/inet.h>
#include <dirent.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epd/epd-telemetry.h"
#include "harness.h"
#include "../check-main.h"

static Harness h;
static char address[512];

static void setup(void) {
        /* No pins: tests must not touch the host's /sys/fs/bpf/epd. */
        ck_assert_int_eq(harness_init(&h, "[Telemetry]\nPinDirectory=no\nMaxPeers=4\n"), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
}

static void teardown(void) {
        harness_stop_epdd(&h);
        harness_done(&h);
}

static uint64_t stat_value(sd_bus *bus, const char *key) {
        sd_bus_message *reply = NULL;
        const char *k;
        uint64_t v, found = UINT64_MAX;
        ck_assert_int_ge(sd_bus_call_method(bus, NULL, "/org/epd1/telemetry", "org.epd1.Telemetry", "GetStats",
                                            NULL, &reply, NULL), 0);
        ck_assert_int_gt(sd_bus_message_enter_container(reply, 'a', "{st}"), 0);
        while (sd_bus_message_read(reply, "{st}", &k, &v) > 0)
                if (strcmp(k, key) == 0)
                        found = v;
        sd_bus_message_unref(reply);
        ck_assert_uint_ne(found, UINT64_MAX);
        return found;
}

/* A uint64 field of GetPeers' dict for peer (UINT64_MAX: no such peer). */
static uint64_t peer_value(sd_bus *bus, const char *peer, const char *key) {
        sd_bus_message *reply = NULL;
        uint64_t found = UINT64_MAX;
        const char *name;
        ck_assert_int_ge(sd_bus_call_method(bus, NULL, "/org/epd1/telemetry", "org.epd1.Telemetry", "GetPeers",
                                            NULL, &reply, NULL), 0);
        ck_assert_int_gt(sd_bus_message_enter_container(reply, 'a', "(sa{sv})"), 0);
        while (sd_bus_message_enter_container(reply, 'r', "sa{sv}") > 0) {
                ck_assert_int_ge(sd_bus_message_read(reply, "s", &name), 0);
                ck_assert_int_gt(sd_bus_message_enter_container(reply, 'a', "{sv}"), 0);
                const char *k;
                while (sd_bus_message_enter_container(reply, 'e', "sv") > 0) {
                        ck_assert_int_ge(sd_bus_message_read(reply, "s", &k), 0);
                        if (strcmp(name, peer) == 0 && strcmp(k, key) == 0)
                                ck_assert_int_ge(sd_bus_message_read(reply, "v", "t", &found), 0);
                        else
                                ck_assert_int_ge(sd_bus_message_skip(reply, "v"), 0);
                        ck_assert_int_ge(sd_bus_message_exit_container(reply), 0);
                }
                ck_assert_int_ge(sd_bus_message_exit_container(reply), 0);
                ck_assert_int_ge(sd_bus_message_exit_container(reply), 0);
        }
        sd_bus_message_unref(reply);
        return found;
}

/* How many fds the daemon holds. */
static unsigned daemon_fds(void) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/fd", (int)h.epdd_pid);
        DIR *d = opendir(path);
        ck_assert_ptr_nonnull(d);
        unsigned n = 0;
        for (struct dirent *e; (e = readdir(d));)
                n += e->d_name[0] != '.';
        closedir(d);
        return n;
}

static void tcp_pair(int *a, int *b) {
        int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t sl = sizeof sa;
        ck_assert_int_ge(l, 0);
        ck_assert_int_eq(bind(l, (struct sockaddr *)&sa, sizeof sa), 0);
        ck_assert_int_eq(listen(l, 1), 0);
        ck_assert_int_eq(getsockname(l, (struct sockaddr *)&sa, &sl), 0);
        *a = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_eq(connect(*a, (struct sockaddr *)&sa, sizeof sa), 0);
        *b = accept4(l, NULL, NULL, SOCK_CLOEXEC);
        ck_assert_int_ge(*b, 0);
        close(l);
}

/* The last Backpressure level heard for made-up-0..4 (UINT_MAX: none heard). */
static unsigned made_up_level[5];
static void on_made_up_level(epd_client *c, const char *peer, unsigned level, const char *reason, void *userdata) {
        int k;
        if (sscanf(peer, "made-up-%d", &k) == 1 && k >= 0 && k < 5)
                made_up_level[k] = level;
}

/* The exported counters never go down: a connection untracked keeps counting with its
 * last values (the live sum over tracked connections drops, which Prometheus would take
 * for a counter reset). Needs the kernel telemetry. */
START_TEST(test_totals_survive_untrack) {
        sd_bus *bus;
        epd_client *c;
        int kernel = 0;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, NULL, "/org/epd1/telemetry", "org.epd1.Telemetry",
                                                     "KernelTelemetry", NULL, 'b', &kernel), 0);
        if (!kernel) {
                printf("kernel telemetry not loaded here: totals not checked\n");
                epd_disconnect(c);
                sd_bus_flush_close_unref(bus);
                return;
        }
        int a, b, x, y;
        static char buf[1 << 16];
        tcp_pair(&a, &b);
        tcp_pair(&x, &y);
        ck_assert_int_eq(epd_telemetry_track_socket(c, a, "peerT"), 0);
        ck_assert_int_eq(epd_telemetry_track_socket(c, x, "peerT"), 0);
        for (int i = 0; i < 16; i++) {
                ck_assert_int_eq(write(a, buf, sizeof buf), (ssize_t)sizeof buf);
                ck_assert_int_eq(write(x, buf, sizeof buf), (ssize_t)sizeof buf);
                for (size_t got = 0; got < sizeof buf;) {
                        ssize_t k = read(b, buf, sizeof buf - got);
                        ck_assert_int_gt(k, 0);
                        got += (size_t)k;
                }
                for (size_t got = 0; got < sizeof buf;) {
                        ssize_t k = read(y, buf, sizeof buf - got);
                        ck_assert_int_gt(k, 0);
                        got += (size_t)k;
                }
        }
        uint64_t t1 = 0;
        for (int i = 0; i < 50 && (t1 = peer_value(bus, "peerT", "total_bytes_sent")) < 2 * 16 * sizeof buf; i++)
                usleep(100000);
        ck_assert_uint_ge(t1, 2 * 16 * sizeof buf);
        ck_assert_int_eq(epd_telemetry_untrack_socket(c, a), 0);
        usleep(500000); /* past an evaluation */
        ck_assert_uint_lt(peer_value(bus, "peerT", "bytes_sent"), t1); /* the live sum went down... */
        ck_assert_uint_ge(peer_value(bus, "peerT", "total_bytes_sent"), t1); /* ...the counter did not */
        ck_assert_int_eq(epd_telemetry_untrack_socket(c, x), 0);
        close(a);
        close(b);
        close(x);
        close(y);
        epd_disconnect(c);
        sd_bus_flush_close_unref(bus);
}
END_TEST

/* Clients' TrackSocket cannot take every place of a peer: the daemon's own control
 * connection and data streams to it always find room (20 of 64 are kept for them). */
START_TEST(test_client_tracking_bounded) {
        epd_client *c;
        enum { CLIENT_MAX = 64 - 20 };
        int a[CLIENT_MAX + 1], b[CLIENT_MAX + 1];
        ck_assert_int_eq(epd_connect(address, &c), 0);
        for (int i = 0; i <= CLIENT_MAX; i++) {
                tcp_pair(&a[i], &b[i]);
                int r = epd_telemetry_track_socket(c, a[i], "peerQ");
                if (i < CLIENT_MAX)
                        ck_assert_msg(r == 0, "socket %d: %s", i, epd_last_error_message(c));
                else {
                        ck_assert_int_lt(r, 0);
                        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.NoSpace");
                }
        }
        for (int i = 0; i <= CLIENT_MAX; i++) {
                if (i < CLIENT_MAX)
                        ck_assert_int_eq(epd_telemetry_untrack_socket(c, a[i]), 0);
                close(a[i]);
                close(b[i]);
        }
        epd_disconnect(c);
}
END_TEST

START_TEST(test_introspection) {
        sd_bus *bus;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        const char *src = getenv("SOURCE_ROOT");
        ck_assert_ptr_nonnull(src);
        char f[512];
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Telemetry.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, NULL, "/org/epd1/telemetry", f), 0);
        sd_bus_flush_close_unref(bus);
}
END_TEST

/* A request's trace in the scheduler's words: an Admit (no workers here: a Reject,
 * traced all the same) under request_id by client c. */
static int admit(const char *request_id) {
        sd_bus *bus = NULL;
        sd_bus_message *verdict = NULL;
        int r = harness_direct_bus(&h, &bus);
        if (r >= 0)
                r = sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Scheduler", "Admit", NULL, &verdict,
                                       "ssta{sv}", request_id, "interactive", (uint64_t)0, 0);
        sd_bus_message_unref(verdict);
        sd_bus_flush_close_unref(bus);
        return r;
}

/* A trace names its request's steps, sizes and feature keys, and a request id is the
 * caller's choice: root reads every event, another uid only those its own calls
 * recorded; one with none hears NotFound, as for no trace. Before, any member of the
 * socket's group who knew a request id read the whole trace; and a first fix that let a
 * uid read a trace once it had an event in it was undone by an Admit of the same id
 * (review). */
START_TEST(test_trace_readers) {
        static const char mine[] = "00000000000000000000000000000a01", theirs[] = "00000000000000000000000000000a02";
        epd_client *c;
        epd_trace_event *ev = NULL;
        size_t n = 0;

        if (geteuid() != 0) {
                printf("not root: no other uid to read as\n");
                return;
        }
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_ge(admit(mine), 0);
        ck_assert_int_eq(epd_trace_get(c, mine, &ev, &n, NULL), 0);
        ck_assert_uint_eq(n, 1);
        free(ev);
        harness_let_others_in(&h);
        pid_t pid = harness_fork_as(65534);
        if (pid == 0) {
                epd_client *o = NULL;
                epd_trace_event *e = NULL;
                size_t k = 0;
                if (epd_connect(address, &o) < 0)
                        _exit(3);
                if (epd_trace_get(o, mine, &e, &k, NULL) != -ENOENT ||
                    strcmp(epd_last_error_name(o) ?: "", "org.epd1.Error.NotFound") != 0) {
                        fprintf(stderr, "uid 65534 read root's trace: %s\n", epd_last_error_name(o) ?: "(read)");
                        _exit(4);
                }
                /* Its own Admit under root's id: it reads its own event, not root's. */
                if (admit(mine) < 0)
                        _exit(6);
                if (epd_trace_get(o, mine, &e, &k, NULL) < 0 || k != 1) {
                        fprintf(stderr, "uid 65534 read %zu events of root's trace\n", k);
                        _exit(7);
                }
                free(e);
                if (admit(theirs) < 0)
                        _exit(8);
                if (epd_trace_get(o, theirs, &e, &k, NULL) < 0 || k != 1)
                        _exit(5); /* its own */
                free(e);
                epd_disconnect(o);
                _exit(0);
        }
        int status;
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "uid 65534: exit %d", WEXITSTATUS(status));
        ck_assert_int_eq(epd_trace_get(c, mine, &ev, &n, NULL), 0); /* root reads every event */
        ck_assert_uint_eq(n, 2);
        free(ev);
        ck_assert_int_eq(epd_trace_get(c, theirs, &ev, &n, NULL), 0);
        ck_assert_uint_eq(n, 1);
        free(ev);
        epd_disconnect(c);
}
END_TEST

START_TEST(test_calls_and_errors) {
        sd_bus *bus;
        epd_client *c;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_eq(epd_connect(address, &c), 0);

        int kernel = -1;
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, NULL, "/org/epd1/telemetry", "org.epd1.Telemetry",
                                                     "KernelTelemetry", NULL, 'b', &kernel), 0);
        char *why = NULL;
        ck_assert_int_ge(sd_bus_get_property_string(bus, NULL, "/org/epd1/telemetry", "org.epd1.Telemetry",
                                                    "KernelTelemetryUnavailable", NULL, &why), 0);
        /* Either it loaded, or the daemon says why not. */
        ck_assert(kernel ? why[0] == '\0' : why[0] != '\0');
        printf("kernel telemetry: %s%s\n", kernel ? "loaded" : "unavailable: ", why);
        free(why);
        ck_assert_uint_eq(stat_value(bus, "tracked_connections"), 0);

        epd_trace_event *ev = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_trace_get(c, "no-such-request", &ev, &n, NULL), -ENOENT);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.NotFound");
        ck_assert_int_eq(epd_trace_get(c, "bad id!", &ev, &n, NULL), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");

        /* Not a TCP socket. */
        int p[2];
        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        ck_assert_int_lt(epd_telemetry_track_socket(c, p[0], "peerX"), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        close(p[0]);
        close(p[1]);

        int a, b;
        tcp_pair(&a, &b);
        ck_assert_int_lt(epd_telemetry_track_socket(c, a, ""), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        /* Peers are named by host id: up to 63 characters. */
        ck_assert_int_lt(epd_telemetry_track_socket(
                                 c, a, "0123456789012345678901234567890123456789012345678901234567890123"),
                         0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        ck_assert_int_eq(epd_telemetry_track_socket(c, a, "host-id-of-forty-characters-0123456789ab"), 0);
        ck_assert_int_eq(epd_telemetry_untrack_socket(c, a), 0);
        /* Names come and go (MaxPeers=4 here): a peer nothing refers to any more gives
         * its entry up to a new one, so made-up names never use the table up. One that
         * was announced backpressured (disconnected) is announced none when forgotten. */
        for (int k = 0; k < 5; k++)
                made_up_level[k] = UINT_MAX;
        ck_assert_int_eq(epd_backpressure_subscribe(c, on_made_up_level, NULL), 0);
        for (int k = 0; k < 12; k++) {
                char name[32];
                snprintf(name, sizeof name, "made-up-%d", k);
                ck_assert_msg(epd_telemetry_track_socket(c, a, name) == 0, "%s: %s", name, epd_last_error_message(c));
                ck_assert_int_eq(epd_telemetry_untrack_socket(c, a), 0);
                if (k < 5)
                        usleep(250000); /* past an evaluation: the peer reads "disconnected" */
        }

        for (int i = 0; i < 50; i++)
                (void)epd_wait(c, 10000);
        unsigned forgotten = 0;
        for (int k = 0; k < 5; k++) {
                char name[32];
                snprintf(name, sizeof name, "made-up-%d", k);
                ck_assert_msg(made_up_level[k] != UINT_MAX, "%s: never announced", name);
                if (harness_telemetry_lists(bus, name))
                        continue;
                /* Forgotten for a later name after it was announced stalled. */
                forgotten++;
                ck_assert_msg(made_up_level[k] == 0, "%s: forgotten, last level heard %u", name, made_up_level[k]);
        }
        ck_assert_uint_ge(forgotten, 1);
        ck_assert_int_eq(epd_telemetry_track_socket(c, a, "peerX"), 0);
        ck_assert_uint_eq(stat_value(bus, "tracked_connections"), 1);
        ck_assert_int_lt(epd_telemetry_track_socket(c, a, "peerX"), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Exists");
        /* The refused second call leaves the first registration as it was, and keeps
         * nothing of its own: refusals repeated do not pile up duplicate fds. */
        ck_assert_uint_eq(stat_value(bus, "tracked_connections"), 1);
        unsigned fds_before = daemon_fds();
        for (int k = 0; k < 64; k++) {
                ck_assert_int_lt(epd_telemetry_track_socket(c, a, "peerX"), 0);
                ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Exists");
        }
        ck_assert_uint_eq(stat_value(bus, "tracked_connections"), 1);
        ck_assert_uint_le(daemon_fds(), fds_before + 2);
        /* Another client cannot untrack it. */
        epd_client *other;
        ck_assert_int_eq(epd_connect(address, &other), 0);
        ck_assert_int_lt(epd_telemetry_untrack_socket(other, a), 0);
        ck_assert_str_eq(epd_last_error_name(other), "org.epd1.Error.NotFound");
        epd_disconnect(other);

        ck_assert_int_eq(epd_telemetry_untrack_socket(c, a), 0);
        ck_assert_uint_eq(stat_value(bus, "tracked_connections"), 0);
        ck_assert_int_lt(epd_telemetry_untrack_socket(c, a), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.NotFound");

        /* The peer stays known, with its kernel view when there is one. */
        sd_bus_message *reply = NULL;
        ck_assert_int_ge(sd_bus_call_method(bus, NULL, "/org/epd1/telemetry", "org.epd1.Telemetry", "GetPeers",
                                            NULL, &reply, NULL), 0);
        ck_assert_int_gt(sd_bus_message_enter_container(reply, 'a', "(sa{sv})"), 0);
        const char *name;
        ck_assert_int_gt(sd_bus_message_enter_container(reply, 'r', "sa{sv}"), 0);
        ck_assert_int_ge(sd_bus_message_read(reply, "s", &name), 0);
        ck_assert_str_eq(name, "peerX");
        sd_bus_message_unref(reply);

        /* A client that disconnects releases what it tracked. */
        ck_assert_int_eq(epd_telemetry_track_socket(c, a, "peerX"), 0);
        ck_assert_uint_eq(stat_value(bus, "tracked_connections"), 1);
        epd_disconnect(c);
        for (int i = 0; i < 50 && stat_value(bus, "tracked_connections") != 0; i++)
                usleep(100000);
        ck_assert_uint_eq(stat_value(bus, "tracked_connections"), 0);
        close(a);
        close(b);
        sd_bus_flush_close_unref(bus);
}
END_TEST

int main(void) {
        Suite *s = suite_create("telemetry-bus");
        TCase *tc = tcase_create("telemetry-bus");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_client_tracking_bounded);
        tcase_add_test(tc, test_introspection);
        tcase_add_test(tc, test_calls_and_errors);
        tcase_add_test(tc, test_trace_readers);
        tcase_add_test(tc, test_totals_survive_untrack);
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
