/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* bench-tcp-pingpong: the bare TCP limit for a small handoff between two hosts: the
 * client sends SIZE bytes on one connection (TCP_NODELAY), the server reads them all and
 * answers 8 bytes; the round trip is what a handoff of SIZE bytes needs at least (its
 * bytes there, one word back). bench-handoff-netns.py runs it between the same network
 * namespaces as the daemons, in the same run.
 *
 *   bench-tcp-pingpong server ADDR PORT          (serves one connection, then exits)
 *   bench-tcp-pingpong client ADDR PORT SIZE COUNT [WARMUP]
 *
 * The client prints "RESULT size=N count=N rtt_mean=.. rtt_p50=.. rtt_p99=.." (µs). */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static int io_all(int fd, void *buf, size_t n, int writing) {
        uint8_t *p = buf;
        while (n > 0) {
                ssize_t k = writing ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
                if (k < 0 && errno == EINTR)
                        continue;
                if (k <= 0)
                        return k == 0 ? -ECONNRESET : -errno;
                p += k;
                n -= (size_t)k;
        }
        return 0;
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
        struct sockaddr_in sa = { .sin_family = AF_INET };
        int one = 1, fd;

        if (argc < 4 || inet_pton(AF_INET, argv[2], &sa.sin_addr) != 1) {
                fprintf(stderr, "usage: %s server ADDR PORT | client ADDR PORT SIZE COUNT [WARMUP]\n", argv[0]);
                return 2;
        }
        sa.sin_port = htons((uint16_t)atoi(argv[3]));
        fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0)
                return 1;
        if (strcmp(argv[1], "server") == 0) {
                uint64_t hdr[2];
                uint8_t *buf = NULL;
                size_t cap = 0;
                (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
                if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 1) < 0) {
                        perror("bench-tcp-pingpong: listen");
                        return 1;
                }
                printf("listening\n");
                fflush(stdout);
                int c = accept4(fd, NULL, NULL, SOCK_CLOEXEC);
                if (c < 0)
                        return 1;
                (void)setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                /* Each round: its size (u64, then a pad), the bytes; answered with 8 bytes. */
                while (io_all(c, hdr, sizeof hdr, 0) == 0) {
                        if (hdr[0] > cap) {
                                free(buf);
                                cap = hdr[0];
                                buf = malloc(cap);
                                if (!buf)
                                        return 1;
                        }
                        if (io_all(c, buf, hdr[0], 0) < 0 || io_all(c, hdr, 8, 1) < 0)
                                break;
                }
                close(c);
                close(fd);
                free(buf);
                return 0;
        }
        if (argc < 6)
                return 2;
        size_t size = strtoull(argv[4], NULL, 0);
        unsigned count = (unsigned)strtoul(argv[5], NULL, 0), warmup = argc > 6 ? (unsigned)strtoul(argv[6], NULL, 0) : 100;
        uint8_t *buf = calloc(1, size + 16);
        uint64_t *rtt = calloc(count ? count : 1, sizeof *rtt);
        if (!buf || !rtt || count == 0)
                return 1;
        for (int i = 0; connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0; i++) {
                if (i > 200) {
                        perror("bench-tcp-pingpong: connect");
                        return 1;
                }
                close(fd);
                fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                usleep(10000);
        }
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        memcpy(buf, &(uint64_t){ size }, 8);
        for (unsigned i = 0; i < warmup + count; i++) {
                uint64_t t0 = now_ns(), ack;
                /* One send: the 16-byte header and the bytes. */
                if (io_all(fd, buf, size + 16, 1) < 0 || io_all(fd, &ack, sizeof ack, 0) < 0) {
                        perror("bench-tcp-pingpong: round");
                        return 1;
                }
                if (i >= warmup)
                        rtt[i - warmup] = now_ns() - t0;
        }
        double sum = 0;
        qsort(rtt, count, sizeof *rtt, cmp_u64);
        for (unsigned i = 0; i < count; i++)
                sum += (double)rtt[i];
        printf("RESULT size=%zu count=%u rtt_mean=%.1f rtt_p50=%.1f rtt_p99=%.1f\n", size, count, sum / count / 1e3,
               (double)rtt[count / 2] / 1e3, (double)rtt[(count * 99) / 100] / 1e3);
        close(fd);
        free(buf);
        free(rtt);
        return 0;
}
