/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the metrics endpoint's Accept header reading (daemon/metrics/metrics.c: what
 * any client of the HTTP listener sends). Whatever the bytes, the answer is one of the
 * two formats, OpenMetrics only where the header names it, and the same bytes give the
 * same answer. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "metrics/metrics.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        char *s = malloc(size + 1);
        if (!s)
                return 0;
        memcpy(s, data, size);
        s[size] = 0; /* a header is text: it ends at its first NUL */
        MetricsFormat f = metrics_format_from_accept(s);
        if (f != METRICS_FORMAT_TEXT && f != METRICS_FORMAT_OPENMETRICS)
                abort();
        if (f == METRICS_FORMAT_OPENMETRICS && !strcasestr(s, "application/openmetrics-text"))
                abort();
        if (metrics_format_from_accept(s) != f)
                abort();
        free(s);
        return 0;
}
