/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Built without libmicrohttpd: [Metrics] Listen= cannot be served, and says so. */
#include <errno.h>

#include "log.h"
#include "metrics/metrics-manager.h"

int metrics_http_start(MetricsServer *s, const char *listen_address, MetricsHttp **ret, char **ret_url) {
        log_error("[Metrics] Listen=%s: this epdd was built without libmicrohttpd (meson option metrics), "
                  "so it cannot serve metrics. Remove the setting, or rebuild with libmicrohttpd-dev installed.",
                  listen_address);
        return -EOPNOTSUPP;
}

MetricsHttp *metrics_http_stop(MetricsHttp *h) {
        return NULL;
}
