/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "metrics/metrics.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "macro.h"

const char *metrics_format_content_type(MetricsFormat format) {
        return format == METRICS_FORMAT_OPENMETRICS ? "application/openmetrics-text; version=1.0.0; charset=utf-8"
                                                    : "text/plain; version=0.0.4; charset=utf-8";
}

/* The q of one media range's parameters (";q=0.5"): 1 without one, 0 for one that does
 * not read as a number from 0 to 1 (RFC 9110: at most three decimals). */
static double accept_q(const char *params, size_t len) {
        for (size_t i = 0; i < len; i++) {
                if (params[i] != ';')
                        continue;
                size_t j = i + 1;
                while (j < len && (params[j] == ' ' || params[j] == '\t'))
                        j++;
                if (j + 1 < len && (params[j] == 'q' || params[j] == 'Q') && params[j + 1] == '=') {
                        char buf[8] = "";
                        size_t n = MIN(len - (j + 2), sizeof buf - 1);
                        memcpy(buf, params + j + 2, n);
                        char *end;
                        double q = strtod(buf, &end);
                        return end != buf && q >= 0 && q <= 1 ? q : 0;
                }
        }
        return 1;
}

/* OpenMetrics when the scraper weighs it above zero and not below the text format
 * (text/plain, or a wildcard range that takes it): Prometheus asks for OpenMetrics first,
 * q=1. A range that names it with q=0 ("not acceptable") is no request for it. */
MetricsFormat metrics_format_from_accept(const char *accept) {
        double q_om = 0, q_text = 0;
        const char *p = accept;

        while (p && *p) {
                size_t len = strcspn(p, ",");
                const char *t = p;
                while (t < p + len && (*t == ' ' || *t == '\t'))
                        t++;
                size_t type_len = strcspn(t, ";,");
                while (type_len > 0 && (t[type_len - 1] == ' ' || t[type_len - 1] == '\t'))
                        type_len--;
                double q = accept_q(t + type_len, len - (size_t)(t - p) - type_len);
#define IS(x) (type_len == strlen(x) && strncasecmp(t, x, type_len) == 0)
                if (IS("application/openmetrics-text"))
                        q_om = MAX(q_om, q);
                else if (IS("text/plain") || IS("text/*") || IS("*/*"))
                        q_text = MAX(q_text, q);
#undef IS
                p += len;
                if (*p == ',')
                        p++;
        }
        return q_om > 0 && q_om >= q_text ? METRICS_FORMAT_OPENMETRICS : METRICS_FORMAT_TEXT;
}

void metrics_writer_init(MetricsWriter *w, FILE *f, MetricsFormat format) {
        *w = (MetricsWriter){ .f = f, .format = format };
}

static void fail(MetricsWriter *w, int error) {
        if (w->error == 0)
                w->error = error;
}

static bool valid_name(const char *s, bool label) {
        if (!s || !*s || (!label && strlen(s) >= 100))
                return false;
        for (const char *p = s; *p; p++) {
                bool alpha = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || *p == '_' ||
                             (!label && *p == ':');
                if (!alpha && !(p > s && *p >= '0' && *p <= '9'))
                        return false;
        }
        return !(label && strncmp(s, "__", 2) == 0);
}

static bool ends_with(const char *s, const char *suffix) {
        size_t a = strlen(s), b = strlen(suffix);
        return a > b && s[a - b - 1] == '_' && strcmp(s + a - b, suffix) == 0;
}

/* Help text: backslash and newline escaped (and the double quote in OpenMetrics). */
static void put_escaped(MetricsWriter *w, const char *s, bool quote) {
        for (; s && *s; s++) {
                if (*s == '\\')
                        fputs("\\\\", w->f);
                else if (*s == '\n')
                        fputs("\\n", w->f);
                else if (*s == '"' && quote)
                        fputs("\\\"", w->f);
                else
                        fputc(*s, w->f);
        }
}

static const char *type_name(const MetricsWriter *w, MetricType t) {
        switch (t) {
        case METRIC_COUNTER:
                return "counter";
        case METRIC_HISTOGRAM:
                return "histogram";
        case METRIC_INFO:
                return w->format == METRICS_FORMAT_OPENMETRICS ? "info" : "gauge";
        default:
                return "gauge";
        }
}

void metrics_family(MetricsWriter *w, const char *name, MetricType type, const char *unit, const char *help) {
        if (!valid_name(name, false) || ends_with(name, "total") || ends_with(name, "info") ||
            (unit && !ends_with(name, unit))) {
                fail(w, -EINVAL);
                w->in_family = false;
                return;
        }
        snprintf(w->family, sizeof w->family, "%s", name);
        w->type = type;
        w->in_family = true;
        w->families++;
        /* In the text format, TYPE and HELP name what the samples are called. */
        const char *suffix = "";
        if (w->format == METRICS_FORMAT_TEXT)
                suffix = type == METRIC_COUNTER ? "_total" : type == METRIC_INFO ? "_info" : "";
        fprintf(w->f, "# HELP %s%s ", name, suffix);
        put_escaped(w, help, w->format == METRICS_FORMAT_OPENMETRICS);
        fprintf(w->f, "\n# TYPE %s%s %s\n", name, suffix, type_name(w, type));
        if (unit && w->format == METRICS_FORMAT_OPENMETRICS)
                fprintf(w->f, "# UNIT %s %s\n", name, unit);
}

static void put_labels(MetricsWriter *w, const MetricLabel *labels, size_t n, const char *le) {
        if (n == 0 && !le)
                return;
        fputc('{', w->f);
        for (size_t i = 0; i < n; i++) {
                if (!valid_name(labels[i].name, true) || strcmp(labels[i].name, "le") == 0) {
                        fail(w, -EINVAL);
                        continue;
                }
                fprintf(w->f, "%s%s=\"", i ? "," : "", labels[i].name);
                const char *v = labels[i].value ? labels[i].value : "";
                for (; *v; v++)
                        if (*v == '\\')
                                fputs("\\\\", w->f);
                        else if (*v == '"')
                                fputs("\\\"", w->f);
                        else if (*v == '\n')
                                fputs("\\n", w->f);
                        else
                                fputc(*v, w->f);
                fputc('"', w->f);
        }
        if (le)
                fprintf(w->f, "%sle=\"%s\"", n ? "," : "", le);
        fputc('}', w->f);
}

static void put_double(MetricsWriter *w, double v) {
        if (isnan(v))
                fputs("NaN", w->f);
        else if (isinf(v))
                fputs(v > 0 ? "+Inf" : "-Inf", w->f);
        else if (v == (double)(int64_t)v && fabs(v) < 1e15)
                fprintf(w->f, "%" PRId64, (int64_t)v);
        else {
                /* The shortest of 15 or 17 digits that reads back as v. */
                char b[64];
                snprintf(b, sizeof b, "%.15g", v);
                if (strtod(b, NULL) != v)
                        snprintf(b, sizeof b, "%.17g", v);
                fputs(b, w->f);
        }
}

static bool sample_start(MetricsWriter *w, MetricType want_histogram) {
        if (!w->in_family || (w->type == METRIC_HISTOGRAM) != (want_histogram == METRIC_HISTOGRAM)) {
                fail(w, -EINVAL);
                return false;
        }
        return true;
}

static void sample_name(MetricsWriter *w) {
        fputs(w->family, w->f);
        if (w->type == METRIC_COUNTER)
                fputs("_total", w->f);
        else if (w->type == METRIC_INFO)
                fputs("_info", w->f);
}

void metrics_sample_u64(MetricsWriter *w, const MetricLabel *labels, size_t n_labels, uint64_t value) {
        if (!sample_start(w, METRIC_GAUGE))
                return;
        sample_name(w);
        put_labels(w, labels, n_labels, NULL);
        fprintf(w->f, " %" PRIu64 "\n", value);
}

void metrics_sample(MetricsWriter *w, const MetricLabel *labels, size_t n_labels, double value) {
        if (!sample_start(w, METRIC_GAUGE))
                return;
        if (w->type == METRIC_COUNTER && !(value >= 0)) {
                fail(w, -EINVAL); /* a counter is a non-negative number */
                return;
        }
        sample_name(w);
        put_labels(w, labels, n_labels, NULL);
        fputc(' ', w->f);
        put_double(w, value);
        fputc('\n', w->f);
}

void metrics_histogram(MetricsWriter *w, const MetricLabel *labels, size_t n_labels, const uint64_t *bounds,
                       double scale, const uint64_t *counts, size_t n, double sum) {
        if (!sample_start(w, METRIC_HISTOGRAM) || n == 0 || !(scale > 0)) {
                fail(w, -EINVAL);
                return;
        }
        uint64_t cumulative = 0;
        for (size_t i = 0; i < n; i++) {
                char le[64];
                cumulative += counts[i];
                if (i + 1 < n)
                        snprintf(le, sizeof le, "%.9g", (double)bounds[i] / scale);
                else
                        snprintf(le, sizeof le, "+Inf");
                fprintf(w->f, "%s_bucket", w->family);
                put_labels(w, labels, n_labels, le);
                fprintf(w->f, " %" PRIu64 "\n", cumulative);
        }
        fprintf(w->f, "%s_count", w->family);
        put_labels(w, labels, n_labels, NULL);
        fprintf(w->f, " %" PRIu64 "\n%s_sum", cumulative, w->family);
        put_labels(w, labels, n_labels, NULL);
        fputc(' ', w->f);
        put_double(w, sum);
        fputc('\n', w->f);
}

int metrics_writer_finish(MetricsWriter *w) {
        if (w->format == METRICS_FORMAT_OPENMETRICS)
                fputs("# EOF\n", w->f);
        if (fflush(w->f) != 0 || ferror(w->f))
                fail(w, -EIO);
        return w->error;
}
