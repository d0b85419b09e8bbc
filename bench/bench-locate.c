/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* bench-locate: the latency of finding where a prefix of block hashes is cached, from
 * one client of one epdd, interleaved with its limits (bench/bench-cluster.py drives it
 * on hosts in network namespaces; docs/cluster.md):
 *
 *   bench-locate ADDRESS ARENA BASE N_BLOCKS ITERATIONS
 *
 * per iteration, one after the other on the same connection:
 *   - a bare sd-bus round trip to the same daemon (org.freedesktop.DBus.Peer.Ping);
 *   - Pages.MatchPrefix(ARENA, chain): this host's own directory (a local lookup);
 *   - Placement.LocatePrefix(chain): the owners of the blocks across the cluster.
 * The chain is BASE, BASE+1, ... BASE+N_BLOCKS-1 (as handoff-client publishes it). It
 * prints median, p99 and mean of each in microseconds, and the blocks each found. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "epd-internal.h"
#include "epd/epd.h"

static double now_us(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static void report(const char *label, double *v, size_t n) {
        double sum = 0;
        for (size_t i = 0; i < n; i++)
                sum += v[i];
        qsort(v, n, sizeof *v, cmp_double);
        printf("%-34s median %8.1f us  p99 %8.1f us  mean %8.1f us\n", label, v[n / 2], v[n * 99 / 100],
               sum / (double)n);
}

int main(int argc, char **argv) {
        /* The layout of tests/integration/handoff-client.c: 64 KiB pages. */
        static const epd_kv_layout kv = { .layers = 8, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                          .v_bytes_per_token = 256, .dtype = "bfloat16" };
        epd_client *c = NULL;
        uint64_t *hashes;
        size_t n, iters;
        uint32_t matched = 0;
        epd_placement p = {};
        int r;

        if (argc != 6) {
                fprintf(stderr, "usage: bench-locate ADDRESS ARENA BASE N_BLOCKS ITERATIONS\n");
                return 2;
        }
        n = strtoul(argv[4], NULL, 0);
        iters = strtoul(argv[5], NULL, 0);
        hashes = calloc(n, sizeof *hashes);
        double *ping = calloc(iters, sizeof(double)), *match = calloc(iters, sizeof(double)),
               *loc = calloc(iters, sizeof(double));
        if (!hashes || !ping || !match || !loc || n == 0 || iters == 0)
                return 2;
        for (size_t i = 0; i < n; i++)
                hashes[i] = strtoull(argv[3], NULL, 0) + i;
        if ((r = epd_connect(argv[1], &c)) < 0 ||
            (r = epd_register(c, "decode", "bench-locate", "cpu", &kv, NULL)) < 0) {
                fprintf(stderr, "connect/register: %s %s\n", strerror(-r), c ? epd_last_error_message(c) ?: "" : "");
                return 1;
        }
        for (size_t i = 0; i < iters + 100; i++) {
                double t0 = now_us(), t1, t2, t3;
                r = sd_bus_call_method(c->bus, NULL, "/org/epd1", "org.freedesktop.DBus.Peer", "Ping", NULL, NULL,
                                       NULL);
                t1 = now_us();
                if (r >= 0 && (r = epd_prefix_match(c, argv[2], hashes, n)) >= 0)
                        matched = (uint32_t)r;
                t2 = now_us();
                epd_placement_done(&p);
                if (r >= 0)
                        r = epd_locate_prefix(c, hashes, n, &p);
                t3 = now_us();
                if (r < 0) {
                        fprintf(stderr, "iteration %zu: %s %s\n", i, strerror(-r), epd_last_error_message(c) ?: "");
                        return 1;
                }
                if (i >= 100) { /* the first 100 warm up */
                        ping[i - 100] = t1 - t0;
                        match[i - 100] = t2 - t1;
                        loc[i - 100] = t3 - t2;
                }
        }
        printf("%zu-block prefix, %zu iterations, this host's MatchPrefix found %u blocks, LocatePrefix %u on %s "
               "(owners missing %u)\n",
               n, iters, matched, p.n_blocks, p.host[0] ? p.host : "-", p.owners_missing);
        report("limit  bare round trip (Peer.Ping)", ping, iters);
        report("local  Pages.MatchPrefix", match, iters);
        report("epd    Placement.LocatePrefix", loc, iters);
        epd_placement_done(&p);
        epd_disconnect(c);
        free(hashes);
        free(ping);
        free(match);
        free(loc);
        return 0;
}
