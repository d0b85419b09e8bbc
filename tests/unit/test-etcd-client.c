/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The etcd client (daemon/cluster/etcd-client.c) against small HTTP servers on loopback
 * that answer every request with one canned answer: failing over past endpoints that
 * answer 5xx, and what the error text says afterwards; past endpoints that hang
 * (listening, answering nothing) within a call's time; a stream left open and silent,
 * ended by another thread. */
#include <arpa/inet.h>
#include <check.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cluster/etcd-client.h"
#include "time-util.h"
#include "../check-main.h"

typedef struct Canned {
        int fd;
        const char *answer; /* written whole after the request, then the connection closes */
        char url[64];
        atomic_bool stop;
        atomic_int requests;
        bool hold;          /* the connection is kept open after the answer (a stream) */
        unsigned delay_ms;  /* before each answer */
        int held;
        pthread_t thread;
} Canned;

/* Reads one request: headers, then Content-Length bytes of body. */
static void read_request(int fd) {
        char buf[8192];
        size_t n = 0;
        long body = -1;

        for (;;) {
                ssize_t k = read(fd, buf + n, sizeof buf - 1 - n);
                if (k <= 0)
                        return;
                n += (size_t)k;
                buf[n] = 0;
                char *end = strstr(buf, "\r\n\r\n");
                if (!end)
                        continue;
                if (body < 0) {
                        const char *cl = strcasestr(buf, "Content-Length:");
                        body = cl ? strtol(cl + 15, NULL, 10) : 0;
                }
                if ((long)(n - (size_t)(end + 4 - buf)) >= body)
                        return;
        }
}

static void *canned_main(void *userdata) {
        Canned *c = userdata;
        while (!atomic_load(&c->stop)) {
                struct pollfd p = { .fd = c->fd, .events = POLLIN };
                if (poll(&p, 1, 50) <= 0)
                        continue;
                int s = accept(c->fd, NULL, NULL);
                if (s < 0)
                        continue;
                read_request(s);
                atomic_fetch_add(&c->requests, 1);
                if (c->delay_ms)
                        usleep(c->delay_ms * 1000);
                size_t len = strlen(c->answer), off = 0;
                while (off < len) {
                        ssize_t k = write(s, c->answer + off, len - off);
                        if (k <= 0)
                                break;
                        off += (size_t)k;
                }
                if (c->hold && c->held < 0)
                        c->held = s;
                else
                        close(s);
        }
        if (c->held >= 0)
                close(c->held);
        return NULL;
}

/* A loopback listener on a free port, its URL in c->url. */
static void listen_loopback(Canned *c) {
        struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t len = sizeof a;

        memset(c, 0, sizeof *c);
        c->held = -1;
        c->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(c->fd, 0);
        ck_assert_int_eq(bind(c->fd, (struct sockaddr *)&a, sizeof a), 0);
        ck_assert_int_eq(listen(c->fd, 8), 0);
        ck_assert_int_eq(getsockname(c->fd, (struct sockaddr *)&a, &len), 0);
        snprintf(c->url, sizeof c->url, "http://127.0.0.1:%u", ntohs(a.sin_port));
}

static void canned_start(Canned *c, const char *answer) {
        listen_loopback(c);
        c->answer = answer;
        ck_assert_int_eq(pthread_create(&c->thread, NULL, canned_main, c), 0);
}

/* An endpoint that hangs: the kernel completes the connection and takes the request,
 * nothing ever reads or answers it. */
static void hung_start(Canned *c) {
        listen_loopback(c);
}

static void canned_stop(Canned *c) {
        atomic_store(&c->stop, true);
        pthread_join(c->thread, NULL);
        close(c->fd);
}

#define NO_LEADER_BODY "{\"error\":\"etcdserver: no leader\",\"code\":14}"
static const char NO_LEADER[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                "Content-Length: 43\r\nConnection: close\r\n\r\n" NO_LEADER_BODY;
static const char EMPTY_503[] = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
static const char OK_JSON[] = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                              "Connection: close\r\n\r\n{}";
/* A watch stream that sends one message and ends (etcd restarting, say). */
static const char STREAM[] = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n"
                             "{\"result\":{\"created\":true}}\n";

static atomic_bool never;

static EtcdClient *client(Canned *a, Canned *b) {
        char *endpoints[] = { a->url, b->url, NULL };
        EtcdClient *c;
        ck_assert_int_eq(etcd_client_new(&c, endpoints, NULL, &never), 0);
        return c;
}

START_TEST(test_body_is_each_endpoints_own) {
        /* The first endpoint's 503 says why in its body; the second's has none: the
         * message names the second without the first's body (the buffer kept it). */
        Canned a, b;
        canned_start(&a, NO_LEADER);
        canned_start(&b, EMPTY_503);
        EtcdClient *c = client(&a, &b);
        char err[512], *ans = NULL;
        size_t len;

        ck_assert_int_eq(etcd_client_call(c, "/v3/kv/range", "{}", 2000, &ans, &len, err, sizeof err), -EIO);
        ck_assert_int_eq(atomic_load(&a.requests), 1);
        ck_assert_int_eq(atomic_load(&b.requests), 1);
        ck_assert_msg(strncmp(err, b.url, strlen(b.url)) == 0, "%s", err);
        ck_assert_msg(strstr(err, "HTTP 503") && !strstr(err, "no leader"), "%s", err);

        /* And the first's body is reported as its own. */
        char *rev[] = { b.url, a.url, NULL };
        EtcdClient *c2;
        ck_assert_int_eq(etcd_client_new(&c2, rev, NULL, &never), 0);
        ck_assert_int_eq(etcd_client_call(c2, "/v3/kv/range", "{}", 2000, &ans, &len, err, sizeof err), -EIO);
        ck_assert_msg(strncmp(err, a.url, strlen(a.url)) == 0 && strstr(err, "no leader"), "%s", err);
        etcd_client_free(c2);
        etcd_client_free(c);
        canned_stop(&a);
        canned_stop(&b);
}
END_TEST

START_TEST(test_success_clears_error) {
        Canned a, b;
        canned_start(&a, NO_LEADER);
        canned_start(&b, OK_JSON);
        EtcdClient *c = client(&a, &b);
        char err[512], *ans = NULL;
        size_t len = 0;

        ck_assert_int_eq(etcd_client_call(c, "/v3/kv/range", "{}", 2000, &ans, &len, err, sizeof err), 0);
        ck_assert_str_eq(ans, "{}");
        ck_assert_uint_eq(len, 2);
        ck_assert_str_eq(err, "");
        ck_assert_str_eq(etcd_client_endpoint(c), b.url); /* the one that answered */
        free(ans);
        etcd_client_free(c);
        canned_stop(&a);
        canned_stop(&b);
}
END_TEST

static int count_messages(void *userdata, const char *msg, size_t len) {
        int *n = userdata;
        ck_assert_ptr_nonnull(memmem(msg, len, "created", 7));
        (*n)++;
        return 0;
}

START_TEST(test_stream_end_is_not_an_earlier_failure) {
        /* A watch goes past an endpoint answering 503 to one that streams, and later
         * ends: the text that goes with the end is not the first endpoint's 503 (the
         * daemon reported that as the reason its watch dropped). */
        Canned a, b;
        canned_start(&a, NO_LEADER);
        canned_start(&b, STREAM);
        EtcdClient *c = client(&a, &b);
        char err[512];
        int n = 0;

        ck_assert_int_eq(etcd_client_stream(c, "/v3/watch", "{}", count_messages, &n, err, sizeof err), -ECONNRESET);
        ck_assert_int_eq(n, 1);
        ck_assert_msg(!strstr(err, "503") && !strstr(err, a.url), "%s", err);
        ck_assert_str_eq(etcd_client_endpoint(c), b.url);
        etcd_client_free(c);
        canned_stop(&a);
        canned_stop(&b);
}
END_TEST

static long ms_since(struct timespec *t0) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

START_TEST(test_hung_endpoint_costs_one_attempt) {
        /* A keepalive past a hung endpoint: the next one is asked after the attempt's
         * time, not the whole call's, and the hung one is named. */
        Canned h, b;
        hung_start(&h);
        canned_start(&b, OK_JSON);
        char *endpoints[] = { h.url, b.url, NULL };
        EtcdClient *c;
        char err[512], *ans = NULL;
        size_t len = 0;
        struct timespec t0;

        ck_assert_int_eq(etcd_client_new(&c, endpoints, NULL, &never), 0);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        ck_assert_int_eq(etcd_client_call_within(c, "/v3/lease/keepalive", "{}", 200, 5000, &ans, &len, err,
                                                 sizeof err),
                         0);
        long took = ms_since(&t0);
        ck_assert_msg(took >= 150 && took < 1500, "took %ld ms", took);
        ck_assert_str_eq(ans, "{}");
        ck_assert_int_eq(etcd_client_hung(c, NULL), 0);
        ck_assert_str_eq(etcd_client_endpoint(c), b.url);
        ck_assert_str_eq(etcd_client_endpoint_at(c, 0), h.url);
        free(ans);
        /* The next call goes to the one that answered: nothing hung this time. */
        ck_assert_int_eq(etcd_client_call_within(c, "/v3/lease/keepalive", "{}", 200, 5000, &ans, &len, err,
                                                 sizeof err),
                         0);
        ck_assert_int_eq(etcd_client_hung(c, NULL), -1);
        free(ans);
        etcd_client_free(c);
        canned_stop(&b);
        close(h.fd);
}
END_TEST

START_TEST(test_call_time_bounds_every_attempt) {
        /* Three hung endpoints, 1000 ms an attempt, 1200 ms in all: the second gets the
         * 200 ms left, the third is not asked, and the call ends in time. The first is
         * the hung one, not the second (its attempt was cut short). */
        Canned h[3];
        for (int i = 0; i < 3; i++)
                hung_start(&h[i]);
        char *endpoints[] = { h[0].url, h[1].url, h[2].url, NULL };
        EtcdClient *c;
        char err[512], *ans = NULL;
        struct timespec t0;
        long ms = 0;

        ck_assert_int_eq(etcd_client_new(&c, endpoints, NULL, &never), 0);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        ck_assert_int_eq(etcd_client_call_within(c, "/v3/lease/keepalive", "{}", 1000, 1200, &ans, NULL, err,
                                                 sizeof err),
                         -ETIMEDOUT);
        long took = ms_since(&t0);
        ck_assert_msg(took >= 1150 && took < 1700, "took %ld ms", took);
        ck_assert_msg(strstr(err, h[1].url), "%s", err); /* the last one asked, not the one never asked */
        ck_assert_ptr_null(ans);
        ck_assert_int_eq(etcd_client_hung(c, &ms), 0);
        ck_assert_int_eq(ms, 1000);
        /* No attempt time: the time left is the attempt's (0 would be no timeout). */
        clock_gettime(CLOCK_MONOTONIC, &t0);
        ck_assert_int_eq(etcd_client_call_within(c, "/v3/lease/keepalive", "{}", 0, 300, &ans, NULL, err, sizeof err),
                         -ETIMEDOUT);
        took = ms_since(&t0);
        ck_assert_msg(took >= 250 && took < 800, "took %ld ms", took);
        etcd_client_free(c);
        for (int i = 0; i < 3; i++)
                close(h[i].fd);
}
END_TEST

START_TEST(test_slow_answer_cut_short_is_not_hung) {
        /* A hung endpoint, then one that answers after 300 ms, 300 ms an attempt and
         * 450 in all: the second's attempt is cut to 150 ms and ends unanswered. The
         * hung one is the first; the second is not called hung for the call's time. */
        Canned h, slow;
        hung_start(&h);
        canned_start(&slow, OK_JSON);
        slow.delay_ms = 300;
        char *endpoints[] = { h.url, slow.url, NULL };
        EtcdClient *c;
        char err[512], *ans = NULL;

        ck_assert_int_eq(etcd_client_new(&c, endpoints, NULL, &never), 0);
        ck_assert_int_eq(etcd_client_call_within(c, "/v3/lease/keepalive", "{}", 300, 450, &ans, NULL, err,
                                                 sizeof err),
                         -ETIMEDOUT);
        ck_assert_int_eq(etcd_client_hung(c, NULL), 0);
        etcd_client_free(c);
        /* A call given exactly one attempt's time (a probe of one endpoint) is a whole
         * attempt: its endpoint is hung. */
        char *one[] = { h.url, NULL };
        ck_assert_int_eq(etcd_client_new(&c, one, NULL, &never), 0);
        ck_assert_int_eq(etcd_client_call_within(c, "/v3/maintenance/status", "{}", 200, 200, &ans, NULL, err,
                                                 sizeof err),
                         -EHOSTUNREACH);
        ck_assert_int_eq(etcd_client_hung(c, NULL), 0);
        etcd_client_free(c);
        canned_stop(&slow);
        close(h.fd);
}
END_TEST

typedef struct StreamRun {
        EtcdClient *c;
        atomic_int messages;
        atomic_bool hold, release; /* hold: the callback waits for release */
        int r;
        char err[512];
} StreamRun;

static int count_async(void *userdata, const char *msg, size_t len) {
        StreamRun *s = userdata;
        atomic_fetch_add(&s->messages, 1);
        while (atomic_load(&s->hold) && !atomic_load(&s->release))
                usleep(1000);
        return 0;
}

static void *stream_thread(void *userdata) {
        StreamRun *s = userdata;
        s->r = etcd_client_stream(s->c, "/v3/watch", "{}", count_async, s, s->err, sizeof s->err);
        return NULL;
}

START_TEST(test_abandon_ends_a_silent_stream) {
        /* A watch open on a member that then answers nothing stays open (no timeout on a
         * stream): another thread that found the member hung ends it, and the next
         * endpoint is the current one. */
        Canned a, b;
        canned_start(&a, STREAM);
        a.hold = true;
        canned_start(&b, OK_JSON);
        char *endpoints[] = { a.url, b.url, NULL };
        StreamRun s = {};
        pthread_t t;
        struct timespec t0;

        ck_assert_int_eq(etcd_client_new(&s.c, endpoints, NULL, &never), 0);
        /* An abandon of attempts begun before now is not for one that begins after. */
        etcd_client_abandon(s.c, 0, now_usec(CLOCK_MONOTONIC));
        usleep(2000);
        ck_assert_int_eq(pthread_create(&t, NULL, stream_thread, &s), 0);
        for (int i = 0; i < 500 && atomic_load(&s.messages) == 0; i++)
                usleep(10000);
        ck_assert_int_eq(atomic_load(&s.messages), 1);
        usleep(300000);
        ck_assert_int_eq(pthread_tryjoin_np(t, NULL), EBUSY); /* still open, silent */
        etcd_client_abandon(s.c, 1, now_usec(CLOCK_MONOTONIC)); /* another endpoint: not this stream's */
        usleep(100000);
        ck_assert_int_eq(pthread_tryjoin_np(t, NULL), EBUSY);
        clock_gettime(CLOCK_MONOTONIC, &t0);
        etcd_client_abandon(s.c, 0, now_usec(CLOCK_MONOTONIC));
        ck_assert_int_eq(pthread_join(t, NULL), 0);
        /* At once (the wakeup), not at curl's next poll a second later. */
        ck_assert_msg(ms_since(&t0) < 300, "the stream ended %ld ms after", ms_since(&t0));
        ck_assert_int_eq(s.r, -ETIMEDOUT);
        ck_assert_msg(strstr(s.err, a.url) && strstr(s.err, "stopped answering"), "%s", s.err);
        ck_assert_int_eq(etcd_client_hung(s.c, NULL), 0);
        ck_assert_str_eq(etcd_client_endpoint(s.c), b.url);
        etcd_client_free(s.c);
        canned_stop(&a);
        canned_stop(&b);
}
END_TEST

START_TEST(test_busy_ending_until_seen) {
        /* Between an abandon and its thread seeing it (a poll later: here, held in the
         * stream's callback), the attempt is said ending, so that a watcher on another
         * thread does not take it for one still streaming there and probe its endpoint;
         * not before, not for another endpoint's abandon, not after it ended. */
        Canned a, b;
        canned_start(&a, STREAM);
        a.hold = true;
        canned_start(&b, OK_JSON);
        char *endpoints[] = { a.url, b.url, NULL };
        StreamRun s = { .hold = true };
        pthread_t t;

        ck_assert_int_eq(etcd_client_new(&s.c, endpoints, NULL, &never), 0);
        ck_assert(!etcd_client_busy_ending(s.c));
        ck_assert_int_eq(pthread_create(&t, NULL, stream_thread, &s), 0);
        for (int i = 0; i < 500 && atomic_load(&s.messages) == 0; i++)
                usleep(10000);
        ck_assert_int_eq(atomic_load(&s.messages), 1); /* in the callback, held */
        ck_assert_int_eq(etcd_client_busy(s.c), 0);
        ck_assert(!etcd_client_busy_ending(s.c));
        etcd_client_abandon(s.c, 1, now_usec(CLOCK_MONOTONIC));
        ck_assert(!etcd_client_busy_ending(s.c));
        etcd_client_abandon(s.c, 0, now_usec(CLOCK_MONOTONIC));
        ck_assert(etcd_client_busy_ending(s.c));
        usleep(50000);
        ck_assert(etcd_client_busy_ending(s.c)); /* still: its thread has not seen it */
        ck_assert_int_eq(etcd_client_busy(s.c), 0);
        atomic_store(&s.release, true);
        ck_assert_int_eq(pthread_join(t, NULL), 0);
        ck_assert_int_eq(s.r, -ETIMEDOUT);
        ck_assert_int_eq(etcd_client_busy(s.c), -1);
        ck_assert(!etcd_client_busy_ending(s.c));
        etcd_client_free(s.c);
        canned_stop(&a);
        canned_stop(&b);
}
END_TEST

/* etcd's refusal of a request (4xx: a range at a compacted revision) comes back with
 * its body, whose code tells the caller what to do (read again from the start); 5xx
 * answers go on to the next endpoint as before. */
#define COMPACTED_BODY "{\"error\":\"etcdserver: mvcc: required revision has been compacted\",\"code\":11}"
START_TEST(test_refusal_body_returned) {
        static char refused[512];
        snprintf(refused, sizeof refused,
                 "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                 "Connection: close\r\n\r\n%s",
                 strlen(COMPACTED_BODY), COMPACTED_BODY);
        Canned a, b;
        canned_start(&a, NO_LEADER);
        canned_start(&b, refused);
        EtcdClient *c = client(&a, &b);
        char err[512], *ans = NULL;
        size_t len = 0;

        ck_assert_int_eq(etcd_client_call(c, "/v3/kv/range", "{}", 2000, &ans, &len, err, sizeof err), -EIO);
        ck_assert_ptr_nonnull(ans);
        ck_assert_str_eq(ans, COMPACTED_BODY);
        ck_assert_uint_eq(len, strlen(COMPACTED_BODY));
        ck_assert_msg(strncmp(err, b.url, strlen(b.url)) == 0 && strstr(err, "HTTP 400"), "%s", err);
        free(ans);
        etcd_client_free(c);
        canned_stop(&a);
        canned_stop(&b);
}
END_TEST

int main(void) {
        if (etcd_global_init() < 0) {
                fprintf(stderr, "libcurl's global setup failed\n");
                return EXIT_FAILURE;
        }
        Suite *s = suite_create("etcd-client");
        TCase *tc = tcase_create("etcd-client");
        tcase_add_test(tc, test_body_is_each_endpoints_own);
        tcase_add_test(tc, test_success_clears_error);
        tcase_add_test(tc, test_stream_end_is_not_an_earlier_failure);
        tcase_add_test(tc, test_hung_endpoint_costs_one_attempt);
        tcase_add_test(tc, test_call_time_bounds_every_attempt);
        tcase_add_test(tc, test_slow_answer_cut_short_is_not_hung);
        tcase_add_test(tc, test_abandon_ends_a_silent_stream);
        tcase_add_test(tc, test_busy_ending_until_seen);
        tcase_add_test(tc, test_refusal_body_returned);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
