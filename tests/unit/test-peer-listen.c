/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* What anyone who reaches the listen port can do to it (peer-conn.c, peer-handshake.c).
 *
 * accept() out of fds leaves the connection in the backlog: the listen source is switched
 * off for PEER_ACCEPT_RETRY_USEC and tried again, rather than dispatched at once for
 * ever (100 % CPU, a log line each turn); accepting resumes once fds are free. One
 * wakeup takes at most PEER_ACCEPT_BATCH connections. Refusals of unauthenticated
 * connections (unknown host, wrong key, AUTH_FAIL, another version, malformed frames)
 * are counted, and logged at once the first time, then at most once per interval with
 * their count: a flood of them is a few lines, not one per connection. Real sockets on
 * 127.0.0.0/8, the daemon's own peer code. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#include <systemd/sd-event.h>

#include "peer/peer-internal.h"
#include "peer/peer-manager.h"
#include "../check-main.h"

static unsigned short port_of(int fd) {
        struct sockaddr_in sa;
        socklen_t sl = sizeof sa;
        ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
        return ntohs(sa.sin_port);
}

/* A connection from 127.0.<from >> 8>.<from & 255> (0: 127.0.0.1). */
static int tcp_from(unsigned short port, unsigned from) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port),
                                  .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(fd, 0);
        if (from) {
                struct sockaddr_in me = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000000u | from) };
                ck_assert_int_eq(bind(fd, (struct sockaddr *)&me, sizeof me), 0);
        }
        ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
        return fd;
}

/* Until nothing happened for 50 ms. */
static void run_loop(sd_event *e) {
        for (int i = 0, idle = 0; idle < 5 && i < 100000; i++) {
                int r = sd_event_run(e, 10 * 1000);
                ck_assert_int_ge(r, 0);
                idle = r == 0 ? idle + 1 : 0;
        }
}

/* Runs e for `usec`; the loop's turns meanwhile. */
static uint64_t run_for(sd_event *e, usec_t usec) {
        uint64_t it0 = 0, it1 = 0;
        usec_t end = now_usec(CLOCK_MONOTONIC) + usec;
        (void)sd_event_get_iteration(e, &it0);
        for (usec_t now; (now = now_usec(CLOCK_MONOTONIC)) < end;)
                (void)sd_event_run(e, end - now);
        (void)sd_event_get_iteration(e, &it1);
        return it1 - it0;
}

/* A started peer manager "bb-self" listening on loopback, with one member "aa-m" (which
 * dials us: its HELLO is taken). */
static PeerManager *listening_manager(sd_event **ret_event) {
        char key[64], listen_at[64];
        PeerManager *pm;

        /* In the run's directory, which check_run() removes even after a failed test. */
        const char *run = getenv("EPD_TEST_RUN_DIR");
        snprintf(key, sizeof key, "%s/peer-listen-key-XXXXXX", run ? run : "/tmp");
        int kfd = mkstemp(key);
        ck_assert_int_ge(kfd, 0);
        ck_assert_int_eq(write(kfd, "0123456789abcdef0123456789abcdef", 32), 32);
        close(kfd);
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        int probe = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_eq(bind(probe, (struct sockaddr *)&sa, sizeof sa), 0);
        snprintf(listen_at, sizeof listen_at, "127.0.0.1:%u", port_of(probe));
        close(probe);

        ck_assert_int_ge(sd_event_new(ret_event), 0);
        PeerManagerConfig c = { .host_id = "bb-self", .listen_address = listen_at, .cluster_key_file = key,
                                .heartbeat_usec = 60 * USEC_PER_SEC };
        ck_assert_int_eq(peer_manager_new(&pm, *ret_event, &c), 0);
        unlink(key);
        ck_assert_int_eq(peer_manager_start(pm), 0);
        ck_assert_int_eq(peer_manager_add_member(pm, "aa-m", "127.0.0.1:9", NULL), 0);
        return pm;
}

/* Stderr into a file, from now until capture_end(), which returns what was written. */
static int capture_start(void) {
        fflush(stderr);
        int saved = dup(STDERR_FILENO);
        ck_assert_int_ge(saved, 0);
        int fd = open("/tmp", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_ge(dup2(fd, STDERR_FILENO), 0);
        close(fd);
        return saved;
}

static char *capture_end(int saved) {
        fflush(stderr);
        off_t n = lseek(STDERR_FILENO, 0, SEEK_END);
        ck_assert_int_ge(n, 0);
        char *s = calloc(1, (size_t)n + 1);
        ck_assert_ptr_nonnull(s);
        ck_assert_int_eq(pread(STDERR_FILENO, s, (size_t)n, 0), n);
        ck_assert_int_ge(dup2(saved, STDERR_FILENO), 0);
        close(saved);
        return s;
}

/* Lines of log that contain what; *ret_events: what they stand for (a line stands for
 * one event, plus the N of its "and N more like it"). */
static unsigned lines_with(const char *log, const char *what, uint64_t *ret_events) {
        unsigned n = 0;
        uint64_t events = 0;

        for (const char *l = log; *l;) {
                const char *end = strchrnul(l, '\n');
                char line[1024];
                snprintf(line, sizeof line, "%.*s", (int)(end - l), l);
                if (strstr(line, what)) {
                        const char *more = strstr(line, "(and ");
                        n++;
                        events += 1 + (more ? strtoull(more + 5, NULL, 10) : 0);
                }
                l = *end ? end + 1 : end;
        }
        if (ret_events)
                *ret_events = events;
        return n;
}

/* Out of fds: the connection waits in the backlog while the listen source is off, and
 * accept() is tried again every PEER_ACCEPT_RETRY_USEC, with one line of log; once fds
 * are free again it is taken. Before: the loop turned without end, a line each turn. */
START_TEST(test_accept_out_of_fds) {
        sd_event *e;
        PeerManager *pm = listening_manager(&e);
        unsigned short port = port_of(pm->listen_fd);

        /* One connection taken first, as any daemon has by then: the loop's monotonic
         * timer fd exists (a timer of that clock added when out of fds would need one). */
        int first = tcp_from(port, 0);
        run_loop(e);
        ck_assert_uint_eq(pm->n_pending, 1);

        int saved = capture_start();
        int client = tcp_from(port, 0);
        struct rlimit old, low;
        ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
        low = (struct rlimit){ .rlim_cur = MIN(old.rlim_cur, (rlim_t)256), .rlim_max = old.rlim_max };
        ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &low), 0);
        int fill[256];
        unsigned n_fill = 0;
        while (n_fill < ELEMENTSOF(fill) && (fill[n_fill] = fcntl(client, F_DUPFD_CLOEXEC, 0)) >= 0)
                n_fill++;
        int fill_errno = errno;

        /* Half a second out of fds: what it cost. */
        uint64_t turns = run_for(e, 500 * USEC_PER_MSEC);
        size_t pending = pm->n_pending;
        uint64_t failed = pm->notes[PEER_NOTE_ACCEPT].total, paused = pm->accept_paused;

        /* Fds free again: the connection is taken. */
        for (unsigned i = 0; i < n_fill; i++)
                close(fill[i]);
        ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
        for (unsigned i = 0; i < 40 && pm->n_pending < 2; i++)
                run_for(e, 50 * USEC_PER_MSEC);
        size_t pending_after = pm->n_pending;
        char *log = capture_end(saved);
        unsigned said = lines_with(log, "accept failed", NULL);
        fprintf(stderr, "out of fds for 0.5 s: %" PRIu64 " turns of the loop, %" PRIu64 " accept() failures, "
                        "%" PRIu64 " pauses, %u line(s) of log\n", turns, failed, paused, said);

        ck_assert_int_eq(fill_errno, EMFILE);
        ck_assert_uint_eq(pending, 1);
        /* A retry every 100 ms is two dispatches (its timer, the listen source): about 10. */
        ck_assert_msg(turns <= 40, "%" PRIu64 " turns of the loop in 0.5 s out of fds", turns);
        ck_assert_msg(said <= 2, "%u lines of log in 0.5 s out of fds", said);
        ck_assert_uint_ge(failed, 2); /* tried again */
        ck_assert_uint_eq(paused, failed);
        ck_assert_uint_eq(pending_after, 2);

        free(log);
        close(client);
        close(first);
        peer_manager_free(pm);
        sd_event_unref(e);
}
END_TEST

/* One wakeup takes at most PEER_ACCEPT_BATCH connections; the rest wake the loop again
 * (before: the whole backlog, however long). */
START_TEST(test_accept_batch_bounded) {
        sd_event *e;
        PeerManager *pm = listening_manager(&e);
        unsigned short port = port_of(pm->listen_fd);
        int fds[40];

        for (unsigned i = 0; i < ELEMENTSOF(fds); i++)
                fds[i] = tcp_from(port, 0x100 + i);
        for (unsigned i = 0; i < 100 && pm->n_pending == 0; i++)
                ck_assert_int_ge(sd_event_run(e, 100 * 1000), 0);
        ck_assert_msg(pm->n_pending <= PEER_ACCEPT_BATCH, "%zu connections taken in one wakeup", pm->n_pending);
        ck_assert_uint_ge(pm->n_pending, 1);
        run_loop(e);
        ck_assert_uint_eq(pm->n_pending, ELEMENTSOF(fds));

        for (unsigned i = 0; i < ELEMENTSOF(fds); i++)
                close(fds[i]);
        peer_manager_free(pm);
        sd_event_unref(e);
}
END_TEST

/* ---- refusals ---- */

static size_t frame(uint8_t *buf, uint16_t type, const void *payload, size_t len) {
        int n = peer_frame_build(buf, PEER_FRAME_HEADER_SIZE + 512, type, payload, len);
        ck_assert_int_gt(n, 0);
        return (size_t)n;
}

static size_t hello(uint8_t *buf, const char *host_id) {
        PeerHello h = { .role = PEER_ROLE_CONTROL, .min_version = PEER_PROTOCOL_VERSION,
                        .max_version = PEER_PROTOCOL_VERSION, .n_streams = 2 };
        uint8_t p[512];
        snprintf(h.host_id, sizeof h.host_id, "%s", host_id);
        int n = peer_hello_encode(&h, p, sizeof p);
        ck_assert_int_gt(n, 0);
        return frame(buf, PEER_MSG_HELLO, p, (size_t)n);
}

typedef enum Bad {
        BAD_UNKNOWN_HOST, /* HELLO naming a host we do not know */
        BAD_MAC,          /* HELLO naming aa-m, then AUTH with a wrong proof */
        BAD_AUTH_FAIL,    /* HELLO naming aa-m, then AUTH_FAIL */
        BAD_VERSION,      /* a version 1 header */
        BAD_FRAME,        /* a header whose length is past the bound before authentication */
        _BAD_MAX,
} Bad;

static const struct {
        PeerNoteKind kind;
        const char *said; /* in its log lines */
} bad_table[_BAD_MAX] = {
        [BAD_UNKNOWN_HOST] = { PEER_NOTE_UNKNOWN_HOST, "unknown host" },
        [BAD_MAC] = { PEER_NOTE_BAD_MAC, "cluster key mismatch" },
        [BAD_AUTH_FAIL] = { PEER_NOTE_REFUSED_US, "refused our proof" },
        [BAD_VERSION] = { PEER_NOTE_VERSION, "speaks protocol version" },
        [BAD_FRAME] = { PEER_NOTE_PROTOCOL, "protocol error" },
};

/* What a connection of that kind says. */
static size_t bad_bytes(Bad b, uint8_t buf[static 1024]) {
        size_t n = 0;
        uint8_t p[64] = {};

        switch (b) {
        case BAD_UNKNOWN_HOST:
                return hello(buf, "zz-nobody");
        case BAD_MAC:
                n = hello(buf, "aa-m");
                return n + frame(buf + n, PEER_MSG_AUTH, p, PEER_MAC_SIZE);
        case BAD_AUTH_FAIL: {
                PeerReason pr = { .reason = PEER_FAIL_BAD_MAC };
                n = hello(buf, "aa-m");
                (void)peer_reason_encode(&pr, p, 4);
                return n + frame(buf + n, PEER_MSG_AUTH_FAIL, p, 4);
        }
        case BAD_VERSION:
                n = hello(buf, "aa-m");
                buf[4] = 1;
                return PEER_FRAME_HEADER_SIZE; /* the header only: the rest is never read */
        case BAD_FRAME:
                peer_frame_header_encode(buf, PEER_MSG_HELLO, 1000);
                return PEER_FRAME_HEADER_SIZE;
        default:
                abort();
        }
}

/* 60 connections of each kind: each kind says one line during the flood, and one more
 * once its interval has passed, with the count; the counters count every one. Before:
 * one line (or two) per connection. */
START_TEST(test_refusals_counted) {
        const unsigned per_kind = 60, batch = 20;
        sd_event *e;
        PeerManager *pm = listening_manager(&e);
        unsigned short port = port_of(pm->listen_fd);
        pm->note_interval_usec = 3 * USEC_PER_SEC;
        unsigned during[_BAD_MAX];
        uint64_t events_during[_BAD_MAX], events_after[_BAD_MAX];

        int saved = capture_start();
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        for (Bad b = 0; b < _BAD_MAX; b++)
                for (unsigned i = 0; i < per_kind; i += batch) {
                        int fds[20];
                        uint8_t buf[1024];
                        size_t n = bad_bytes(b, buf);
                        for (unsigned j = 0; j < batch; j++) {
                                fds[j] = tcp_from(port, 0x100 + b * per_kind + i + j);
                                ck_assert_int_eq(send(fds[j], buf, n, MSG_NOSIGNAL), (ssize_t)n);
                        }
                        run_loop(e);
                        for (unsigned j = 0; j < batch; j++)
                                close(fds[j]);
                }
        usec_t flood = now_usec(CLOCK_MONOTONIC) - t0;
        run_loop(e);
        char *log = capture_end(saved);
        for (Bad b = 0; b < _BAD_MAX; b++)
                during[b] = lines_with(log, bad_table[b].said, &events_during[b]);
        free(log);

        /* Past the interval: what each kind left unsaid, with its count. */
        saved = capture_start();
        run_for(e, pm->note_interval_usec + 500 * USEC_PER_MSEC);
        char *later = capture_end(saved);
        fputs(later, stderr);

        unsigned after[_BAD_MAX];
        for (Bad b = 0; b < _BAD_MAX; b++) {
                after[b] = lines_with(later, bad_table[b].said, &events_after[b]);
                fprintf(stderr, "'%s': %u line(s) during %" PRIu64 " ms of flood, %u after; they count %" PRIu64
                                " connection(s), the counter %" PRIu64 "\n",
                        bad_table[b].said, during[b], (uint64_t)(flood / USEC_PER_MSEC), after[b],
                        events_during[b] + events_after[b], pm->notes[bad_table[b].kind].total);
        }
        for (Bad b = 0; b < _BAD_MAX; b++) {
                uint64_t total = pm->notes[bad_table[b].kind].total;
                /* The first at once, then at most one per interval. */
                ck_assert_msg(during[b] <= 1 + flood / pm->note_interval_usec + 1,
                              "'%s': %u lines for %u connections", bad_table[b].said, during[b], per_kind);
                ck_assert_uint_eq(total, per_kind);
                ck_assert_uint_le(after[b], 1);
                /* Every one is in the lines' counts. */
                ck_assert_uint_eq(events_during[b] + events_after[b], per_kind);
        }
        free(later);
        ck_assert_uint_eq(peer_stats(peer_manager_find(pm, "aa-m"))->auth_failures, 2 * per_kind);
        peer_manager_free(pm);
        sd_event_unref(e);
}
END_TEST

int main(void) {
        Suite *s = suite_create("peer-listen");
        TCase *tc = tcase_create("peer-listen");
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_accept_out_of_fds);
        tcase_add_test(tc, test_accept_batch_bounded);
        tcase_add_test(tc, test_refusals_counted);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
