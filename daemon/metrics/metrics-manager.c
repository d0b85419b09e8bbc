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

int metrics_server_render(MetricsServer *s, int format, char **ret, size_t *ret_len) {
        char *buf = NULL;
        size_t len = 0;
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
        free(s);
        m->metrics = NULL;
}

const Subsystem metrics_subsystem = {
        .name = "metrics",
        .init = metrics_init,
        .done = metrics_done,
        .add_bus = bus_metrics_add,
};
