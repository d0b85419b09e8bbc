/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Helpers shared by the GPU device test and benchmark (bench/gpu/): random data, fd
 * passing (SCM_RIGHTS, as D-Bus passes type `h`), timing, and waiting for transport
 * completions through the completion fd (poll, no spinning). */

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "macro.h"
#include "transport/transport.h"

#define CHECK(expr)                                                                      \
        do {                                                                             \
                int _r = (expr);                                                         \
                if (_r < 0) {                                                            \
                        fprintf(stderr, "%s:%d: %s failed: %s\n", __FILE__, __LINE__,    \
                                #expr, strerror(-_r));                                   \
                        exit(EXIT_FAILURE);                                              \
                }                                                                        \
        } while (0)

#define REQUIRE(cond, ...)                                                               \
        do {                                                                             \
                if (!(cond)) {                                                           \
                        fprintf(stderr, "%s:%d: ", __FILE__, __LINE__);                  \
                        fprintf(stderr, __VA_ARGS__);                                    \
                        fputc('\n', stderr);                                             \
                        exit(EXIT_FAILURE);                                              \
                }                                                                        \
        } while (0)

static inline double now_sec(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Deterministic random bytes: byte i of stream `seed` depends only on (seed, i / 8). */
static inline uint64_t mix64(uint64_t x) {
        x ^= x >> 33;
        x *= 0xff51afd7ed558ccdULL;
        x ^= x >> 33;
        x *= 0xc4ceb9fe1a85ec53ULL;
        x ^= x >> 33;
        return x;
}

/* Fills buf (len multiple of 8) with the words [first_word, ...) of stream seed. */
static inline void fill_random(void *buf, uint64_t len, uint64_t seed, uint64_t first_word) {
        uint64_t *w = buf;
        for (uint64_t i = 0; i < len / 8; i++)
                w[i] = mix64(seed * 0x9e3779b97f4a7c15ULL + first_word + i);
}

static inline int send_fd(int sock, int fd, const void *data, size_t len) {
        struct iovec iov = { .iov_base = (void *)data, .iov_len = len };
        union {
                struct cmsghdr h;
                char buf[CMSG_SPACE(sizeof(int))];
        } c = {};
        struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1 };

        if (fd >= 0) {
                m.msg_control = c.buf;
                m.msg_controllen = sizeof c.buf;
                struct cmsghdr *h = CMSG_FIRSTHDR(&m);
                h->cmsg_level = SOL_SOCKET;
                h->cmsg_type = SCM_RIGHTS;
                h->cmsg_len = CMSG_LEN(sizeof(int));
                memcpy(CMSG_DATA(h), &fd, sizeof fd);
        }
        return sendmsg(sock, &m, MSG_NOSIGNAL) == (ssize_t)len ? 0 : -errno;
}

/* Receives exactly len bytes and at most one fd (-1 if none), O_CLOEXEC. */
static inline int recv_fd(int sock, int *ret_fd, void *data, size_t len) {
        struct iovec iov = { .iov_base = data, .iov_len = len };
        union {
                struct cmsghdr h;
                char buf[CMSG_SPACE(sizeof(int))];
        } c = {};
        struct msghdr m = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = c.buf,
                            .msg_controllen = sizeof c.buf };
        ssize_t n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC | MSG_WAITALL);
        struct cmsghdr *h;

        if (n < 0)
                return -errno;
        if ((size_t)n != len)
                return -EPROTO;
        *ret_fd = -1;
        for (h = CMSG_FIRSTHDR(&m); h; h = CMSG_NXTHDR(&m, h))
                if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SCM_RIGHTS)
                        memcpy(ret_fd, CMSG_DATA(h), sizeof(int));
        return 0;
}

/* Posts a batch and waits for all of its completions (poll on the completion fd).
 * Returns the first error, or 0; *ret_count gets the completions seen; *ret_posted the
 * time post() returned; *ret_drained the time from the last wake-up before the first
 * completion came out (the batch done on the GPU, its completion fd readable) to the
 * last completion (the host's part after the copy). */
static inline int transport_run_full(Transport *t, const TransportWrite *w, size_t n,
                                     size_t *ret_count, double *ret_posted, double *ret_drained) {
        TransportCompletion c[256];
        size_t seen = 0;
        int err = 0, r;
        double woke, first = 0;

        r = t->ops->post(t, NULL, w, n);
        if (r < 0)
                return r;
        woke = now_sec();
        if (ret_posted)
                *ret_posted = woke;
        while (seen < n) {
                struct pollfd p = { .fd = t->ops->completion_fd(t), .events = POLLIN };
                size_t k = t->ops->poll(t, c, ELEMENTSOF(c));

                for (size_t i = 0; i < k; i++)
                        if (c[i].error < 0 && err == 0)
                                err = c[i].error;
                if (k > 0 && seen == 0)
                        first = woke;
                seen += k;
                if (k == 0) {
                        if (poll(&p, 1, 10000) <= 0)
                                return -ETIMEDOUT;
                        woke = now_sec();
                }
        }
        if (ret_count)
                *ret_count = seen;
        if (ret_drained)
                *ret_drained = now_sec() - first;
        return err;
}

static inline int transport_run(Transport *t, const TransportWrite *w, size_t n, size_t *ret_count) {
        return transport_run_full(t, w, n, ret_count, NULL, NULL);
}

/* The same; *ret_posted gets now_sec() when post() returned, *ret_drained the host's
 * part after the copy (transport_run_full). */
static inline int transport_run_timed(Transport *t, const TransportWrite *w, size_t n, double *ret_posted,
                                      double *ret_drained) {
        return transport_run_full(t, w, n, NULL, ret_posted, ret_drained);
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static inline double median(double *v, size_t n) {
        qsort(v, n, sizeof *v, cmp_double);
        return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}
