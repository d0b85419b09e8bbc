/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The Prometheus exposition formats, written: the text format 0.0.4 that every scraper
 * reads, and OpenMetrics 1.0.0 for a scraper that asks for it (Accept:
 * application/openmetrics-text). A family is begun with its name, type, unit and help;
 * its samples follow with their labels. The writer adds what each format wants: the
 * _total suffix of counter samples (and the TYPE/HELP names that go with it in each
 * format), cumulative _bucket/_count/_sum of histograms, UNIT lines and the closing
 * "# EOF" of OpenMetrics, and escapes label values and help text. Pure: writes to a
 * FILE; unit-tested (tests/unit/test-metrics.c), and `promtool check metrics` reads its
 * output in tests/tools/test-prometheus.py. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef enum MetricsFormat {
        METRICS_FORMAT_TEXT,        /* text/plain; version=0.0.4 */
        METRICS_FORMAT_OPENMETRICS, /* application/openmetrics-text; version=1.0.0 */
} MetricsFormat;

typedef enum MetricType {
        METRIC_COUNTER,   /* name without _total: the samples get it */
        METRIC_GAUGE,
        METRIC_HISTOGRAM, /* samples through metrics_histogram() */
        METRIC_INFO,      /* name without _info: one sample of value 1 per label set */
} MetricType;

typedef struct MetricLabel {
        const char *name;
        const char *value;
} MetricLabel;

/* METRIC_LABELS({ "peer", p }, { "transport", t }): a label array and its length. */
#define METRIC_LABELS(...)                                                               \
        (const MetricLabel[]){ __VA_ARGS__ },                                            \
                sizeof((const MetricLabel[]){ __VA_ARGS__ }) / sizeof(MetricLabel)
#define METRIC_NO_LABELS NULL, 0

typedef struct MetricsWriter {
        FILE *f;
        MetricsFormat format;
        char family[128];
        MetricType type;
        bool in_family;
        unsigned families;
        int error; /* the first misuse or write error (negative errno), sticky */
} MetricsWriter;

/* The content type of a format, for the HTTP answer. */
const char *metrics_format_content_type(MetricsFormat format);
/* OpenMetrics when the Accept header (may be NULL) asks for it, the text format otherwise. */
MetricsFormat metrics_format_from_accept(const char *accept);

void metrics_writer_init(MetricsWriter *w, FILE *f, MetricsFormat format);
/* Begins a family. `unit` (a base unit such as "bytes" or "seconds", or NULL) must be
 * the name's last component. Names are [a-zA-Z_:][a-zA-Z0-9_:]*. */
void metrics_family(MetricsWriter *w, const char *name, MetricType type, const char *unit, const char *help);
void metrics_sample_u64(MetricsWriter *w, const MetricLabel *labels, size_t n_labels, uint64_t value);
void metrics_sample(MetricsWriter *w, const MetricLabel *labels, size_t n_labels, double value);
/* One histogram of the current family: n per-bucket counts (not cumulative) for the
 * upper bounds `bounds` (n - 1 of them: the last count is +Inf), in `scale` units per
 * second (1e6 for bounds in µs), and the sum in seconds. */
void metrics_histogram(MetricsWriter *w, const MetricLabel *labels, size_t n_labels, const uint64_t *bounds,
                       double scale, const uint64_t *counts, size_t n, double sum);
/* Ends the exposition; returns 0 or the first error. */
int metrics_writer_finish(MetricsWriter *w);
