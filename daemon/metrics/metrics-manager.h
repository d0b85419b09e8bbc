/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The metrics subsystem of epdd: when [Metrics] Listen= is set, an HTTP endpoint
 * (GET /metrics) in the Prometheus text format or OpenMetrics, served by libmicrohttpd
 * as an sd-event source of the daemon's loop (metrics-http.c): its epoll fd is watched
 * by the loop, and the answer is rendered on the loop from every subsystem's counters
 * (metrics-collect.c), so no lock and no thread stands between a scrape and the values.
 * Bounded: 32 connections at once, 8 per address, 10 s of idleness. Off by default.
 * docs/telemetry.md#prometheus. */

#include <stdint.h>

#include "core/manager.h"

typedef struct MetricsHttp MetricsHttp;

typedef struct MetricsServer {
        Manager *manager;
        MetricsHttp *http;
        char *url;          /* http://HOST:PORT/metrics, as bound (the port resolved) */
        uint64_t scrapes;   /* /metrics rendered */
        uint64_t refused;   /* other paths and methods */
        /* Renders are rationed (METRICS_RENDER_BURST, then METRICS_RENDER_PER_SEC, one
         * ration for both formats): past that, a scrape gets the last body rendered in
         * its format while it is younger than METRICS_RENDER_MAX_AGE_USEC, so that
         * clients scraping in a loop cannot hold the event loop rendering, and a body
         * is never older than a second. */
        double tokens;
        usec_t tokens_at;
        char *last[2];      /* by MetricsFormat */
        size_t last_len[2];
        usec_t last_at[2];  /* when last[] was rendered (CLOCK_MONOTONIC) */
} MetricsServer;

#define METRICS_RENDER_BURST 20
#define METRICS_RENDER_PER_SEC 20
#define METRICS_RENDER_MAX_AGE_USEC USEC_PER_SEC

extern const Subsystem metrics_subsystem;

/* The exposition of the daemon's counters now, in `format`: a malloc()ed buffer. */
int metrics_server_render(MetricsServer *s, int format, char **ret, size_t *ret_len);

/* metrics-http.c (or metrics-http-none.c without libmicrohttpd): serve `listen`
 * (HOST:PORT) on the manager's loop; *ret_url says where. */
int metrics_http_start(MetricsServer *s, const char *listen, MetricsHttp **ret, char **ret_url);
MetricsHttp *metrics_http_stop(MetricsHttp *h);
