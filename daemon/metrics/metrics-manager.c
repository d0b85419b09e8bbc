/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "metrics/metrics-manager.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "macro.h"
#include "metrics/bus-metrics.h"
#include "metrics/metrics-collect.h"
#include "metrics/metrics.h"
#include "time-util.h"

static char *memdup(const char *p, size_t n) {
        char *d = malloc(n);
        return d ? memcpy(d, p, n) : NULL;
}

int metrics_server_render(MetricsServer *s, int format, char **ret, size_t *ret_len) {
        char *buf = NULL;
        size_t len = 0;
        usec_t now = now_usec(CLOCK_MONOTONIC);
        bool fmt_ok = format >= 0 && format < (int)ELEMENTSOF(s->last);

        s->tokens = MIN((double)METRICS_RENDER_BURST,
                        s->tokens + (double)(now - s->tokens_at) * METRICS_RENDER_PER_SEC / USEC_PER_SEC);
        s->tokens_at = now;
        /* Past the ration, the last body of this format, unless it is older than
         * METRICS_RENDER_MAX_AGE_USEC: the ration is shared by both formats, so without
         * that a client taking every render of one would keep the other's body stale. */
        if (fmt_ok && s->tokens < 1 && s->last[format] &&
            now - s->last_at[format] < METRICS_RENDER_MAX_AGE_USEC) {
                buf = memdup(s->last[format], s->last_len[format] + 1);
                if (!buf)
                        return -ENOMEM;
                *ret = buf;
                *ret_len = s->last_len[format];
                return 0;
        }
        s->tokens = MAX(s->tokens - 1, 0.0);
        FILE *f = open_memstream(&buf, &len);
        if (!f)
                return -ENOMEM;
        MetricsWriter w;
        metrics_writer_init(&w, f, (MetricsFormat)format);
        metrics_collect(s->manager, &w, ++s->scrapes);
        int r = metrics_writer_finish(&w);
        if (fclose(f) != 0 && r == 0)
                r = -ENOMEM;
        if (r < 0) {
                free(buf);
                return log_warning_errno(r, "Cannot render the metrics: %m");
        }
        if (fmt_ok) {
                char *copy = memdup(buf, len + 1);
                if (copy) {
                        free(s->last[format]);
                        s->last[format] = copy;
                        s->last_len[format] = len;
                        s->last_at[format] = now;
                }
        }
        *ret = buf;
        *ret_len = len;
        return 0;
}

static int metrics_init(Manager *m) {
        if (!m->config.metrics_listen)
                return 0;
        MetricsServer *s = calloc(1, sizeof *s);
        if (!s)
                return log_oom();
        s->manager = m;
        s->tokens = METRICS_RENDER_BURST;
        s->tokens_at = now_usec(CLOCK_MONOTONIC);
        int r = metrics_http_start(s, m->config.metrics_listen, &s->http, &s->url);
        if (r < 0) {
                free(s);
                return r; /* logged */
        }
        m->metrics = s;
        log_info("Serving Prometheus metrics on %s.", s->url);
        return 0;
}

static void metrics_done(Manager *m) {
        MetricsServer *s = m->metrics;
        if (!s)
                return;
        s->http = metrics_http_stop(s->http);
        free(s->url);
        for (size_t i = 0; i < ELEMENTSOF(s->last); i++)
                free(s->last[i]);
        free(s);
        m->metrics = NULL;
}

const Subsystem metrics_subsystem = {
        .name = "metrics",
        .init = metrics_init,
        .done = metrics_done,
        .add_bus = bus_metrics_add,
};
