/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* daemon/metrics/metrics.c: the exposition formats, byte for byte; and what
 * metrics-collect.c exports of the peers. */
#include <check.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-event.h>

#include "core/manager.h"
#include "macro.h"
#include "metrics/metrics-collect.h"
#include "metrics/metrics.h"
#include "peer/peer-manager.h"
#include "telemetry/telemetry.h"
#include "../check-main.h"

static char *buf;
static size_t len;
static FILE *f;

static MetricsWriter start(MetricsFormat format) {
        f = open_memstream(&buf, &len);
        ck_assert_ptr_nonnull(f);
        MetricsWriter w;
        metrics_writer_init(&w, f, format);
        return w;
}

static const char *finish(MetricsWriter *w, int want) {
        ck_assert_int_eq(metrics_writer_finish(w), want);
        fclose(f);
        return buf;
}

static void write_sample_set(MetricsWriter *w) {
        metrics_family(w, "epd_handoff_bytes", METRIC_COUNTER, "bytes", "KV bytes moved.\nPer peer.");
        metrics_sample_u64(w, METRIC_LABELS({ "peer", "bravo" }, { "transport", "tcp" }), 1048576);
        metrics_sample_u64(w, METRIC_LABELS({ "peer", "we\"ird\\ho\nst" }, { "transport", "rdma" }), 0);
        metrics_family(w, "epd_scheduler_rho", METRIC_GAUGE, NULL, "Load.");
        metrics_sample(w, METRIC_LABELS({ "pool", "hybrid" }), 0.25);
        metrics_sample(w, METRIC_LABELS({ "pool", "thinking" }), NAN);
        metrics_family(w, "epd_build", METRIC_INFO, NULL, "Version.");
        metrics_sample_u64(w, METRIC_LABELS({ "version", "0.1.0" }), 1);
        metrics_family(w, "epd_handoff_duration_seconds", METRIC_HISTOGRAM, "seconds", "Prepare to Commit.");
        static const uint64_t bounds[] = { 1000, 250000 };
        static const uint64_t counts[] = { 3, 0, 2 };
        metrics_histogram(w, METRIC_LABELS({ "peer", "local" }), bounds, 1e6, counts, 3, 9.5);
}

START_TEST(test_text_format) {
        MetricsWriter w = start(METRICS_FORMAT_TEXT);
        write_sample_set(&w);
        ck_assert_str_eq(finish(&w, 0),
                         "# HELP epd_handoff_bytes_total KV bytes moved.\\nPer peer.\n"
                         "# TYPE epd_handoff_bytes_total counter\n"
                         "epd_handoff_bytes_total{peer=\"bravo\",transport=\"tcp\"} 1048576\n"
                         "epd_handoff_bytes_total{peer=\"we\\\"ird\\\\ho\\nst\",transport=\"rdma\"} 0\n"
                         "# HELP epd_scheduler_rho Load.\n"
                         "# TYPE epd_scheduler_rho gauge\n"
                         "epd_scheduler_rho{pool=\"hybrid\"} 0.25\n"
                         "epd_scheduler_rho{pool=\"thinking\"} NaN\n"
                         "# HELP epd_build_info Version.\n"
                         "# TYPE epd_build_info gauge\n"
                         "epd_build_info{version=\"0.1.0\"} 1\n"
                         "# HELP epd_handoff_duration_seconds Prepare to Commit.\n"
                         "# TYPE epd_handoff_duration_seconds histogram\n"
                         "epd_handoff_duration_seconds_bucket{peer=\"local\",le=\"0.001\"} 3\n"
                         "epd_handoff_duration_seconds_bucket{peer=\"local\",le=\"0.25\"} 3\n"
                         "epd_handoff_duration_seconds_bucket{peer=\"local\",le=\"+Inf\"} 5\n"
                         "epd_handoff_duration_seconds_count{peer=\"local\"} 5\n"
                         "epd_handoff_duration_seconds_sum{peer=\"local\"} 9.5\n");
        free(buf);
}
END_TEST

START_TEST(test_openmetrics) {
        MetricsWriter w = start(METRICS_FORMAT_OPENMETRICS);
        write_sample_set(&w);
        const char *out = finish(&w, 0);
        /* Family names without the sample suffix, UNIT lines, info type, # EOF last. */
        ck_assert_ptr_nonnull(strstr(out, "# HELP epd_handoff_bytes KV bytes moved.\\nPer peer.\n"
                                          "# TYPE epd_handoff_bytes counter\n"
                                          "# UNIT epd_handoff_bytes bytes\n"
                                          "epd_handoff_bytes_total{peer=\"bravo\",transport=\"tcp\"} 1048576\n"));
        ck_assert_ptr_nonnull(strstr(out, "# TYPE epd_build info\nepd_build_info{version=\"0.1.0\"} 1\n"));
        ck_assert_ptr_nonnull(strstr(out, "# UNIT epd_handoff_duration_seconds seconds\n"));
        size_t n = strlen(out);
        ck_assert(n > 6 && strcmp(out + n - 6, "# EOF\n") == 0);
        free(buf);
}
END_TEST

START_TEST(test_misuse) {
        MetricsWriter w = start(METRICS_FORMAT_TEXT);
        /* A counter named with _total, a unit that is not the name's suffix, a sample
         * outside a family, a bad label name, a negative counter: each is an error. */
        metrics_family(&w, "epd_x_total", METRIC_COUNTER, NULL, "x");
        ck_assert_int_eq(w.error, -EINVAL);
        w.error = 0;
        metrics_family(&w, "epd_size", METRIC_GAUGE, "bytes", "x");
        ck_assert_int_eq(w.error, -EINVAL);
        w.error = 0;
        metrics_sample_u64(&w, METRIC_NO_LABELS, 1);
        ck_assert_int_eq(w.error, -EINVAL);
        w.error = 0;
        metrics_family(&w, "epd_ok", METRIC_COUNTER, NULL, "x");
        metrics_sample_u64(&w, METRIC_LABELS({ "bad-name", "v" }), 1);
        ck_assert_int_eq(w.error, -EINVAL);
        w.error = 0;
        metrics_sample(&w, METRIC_NO_LABELS, -1);
        ck_assert_int_eq(w.error, -EINVAL);
        finish(&w, -EINVAL);
        free(buf);
}
END_TEST

START_TEST(test_accept) {
        ck_assert_int_eq(metrics_format_from_accept(NULL), METRICS_FORMAT_TEXT);
        ck_assert_int_eq(metrics_format_from_accept("text/plain;version=0.0.4;q=0.5,*/*;q=0.1"), METRICS_FORMAT_TEXT);
        ck_assert_int_eq(metrics_format_from_accept("application/openmetrics-text;version=1.0.0,"
                                                    "text/plain;version=0.0.4;q=0.5"),
                         METRICS_FORMAT_OPENMETRICS);
        /* Prometheus's own header. */
        ck_assert_int_eq(metrics_format_from_accept("application/openmetrics-text;version=1.0.0,application/"
                                                    "openmetrics-text;version=0.0.1;q=0.75,text/plain;"
                                                    "version=0.0.4;q=0.5,*/*;q=0.1"),
                         METRICS_FORMAT_OPENMETRICS);
        /* Named, but not acceptable (q=0), or weighed below the text format: text. Any
         * mention of it gave OpenMetrics. */
        ck_assert_int_eq(metrics_format_from_accept("application/openmetrics-text;q=0, text/plain"),
                         METRICS_FORMAT_TEXT);
        ck_assert_int_eq(metrics_format_from_accept("text/plain;q=0.9,application/openmetrics-text; q=0.2"),
                         METRICS_FORMAT_TEXT);
        ck_assert_int_eq(metrics_format_from_accept("*/*, application/openmetrics-text;q=0.5"), METRICS_FORMAT_TEXT);
        ck_assert_int_eq(metrics_format_from_accept("Application/OpenMetrics-Text ; q=1.0 , text/plain;q=0.5"),
                         METRICS_FORMAT_OPENMETRICS);
        ck_assert_int_eq(metrics_format_from_accept("application/openmetrics-text;q=bogus"), METRICS_FORMAT_TEXT);
        ck_assert_int_eq(metrics_format_from_accept("application/openmetrics-textual"), METRICS_FORMAT_TEXT);
        ck_assert_int_eq(metrics_format_from_accept(""), METRICS_FORMAT_TEXT);
        ck_assert_int_eq(metrics_format_from_accept(",,;q=,"), METRICS_FORMAT_TEXT);
        ck_assert_ptr_nonnull(strstr(metrics_format_content_type(METRICS_FORMAT_TEXT), "version=0.0.4"));
}
END_TEST

/* A member that left the membership has no epd_peer_* series: it is gone from the
 * exposition as a target that went away (before, five series per peer ever known stayed
 * for the daemon's life); live members (and configured peers) stay, and a member that
 * comes back is there again. A Manager with nothing but its peers. */
static Manager *collect_manager;

static const char *collect(void) {
        MetricsWriter w = start(METRICS_FORMAT_TEXT);
        metrics_collect(collect_manager, &w, 1);
        return finish(&w, 0);
}

static size_t count(const char *text, const char *needle) {
        size_t n = 0;
        for (const char *q = text; (q = strstr(q, needle)); q++)
                n++;
        return n;
}

START_TEST(test_retired_member_not_exported) {
        static const char *const families[] = {
                "epd_peer_up{", "epd_peer_connects_total{", "epd_peer_disconnects_total{",
                "epd_peer_heartbeats_missed_total{", "epd_peer_control_bytes_total{",
        };
        sd_event *e;
        PeerManager *pm;
        Telemetry *t;
        const char *out;

        ck_assert_int_ge(sd_event_new(&e), 0);
        PeerManagerConfig c = { .host_id = "self" };
        ck_assert_int_eq(peer_manager_new(&pm, e, &c), 0);
        ck_assert_int_eq(peer_manager_add_member(pm, "stays", "127.0.0.1:9", NULL), 0);
        ck_assert_int_eq(peer_manager_add_member(pm, "gone", "127.0.0.1:9", NULL), 0);
        /* Telemetry (no BPF) keeps an entry per peer it heard of, past the peer's
         * session: its backpressure level is an epd_peer_* series too. */
        ck_assert_int_eq(telemetry_new(&t, e, NULL), 0);
        ck_assert_int_eq(telemetry_set_peer_load(t, "gone", 0, 0, 0), 0);
        ck_assert_int_eq(telemetry_set_peer_load(t, "stays", 0, 0, 0), 0);
        collect_manager = calloc(1, sizeof *collect_manager);
        ck_assert_ptr_nonnull(collect_manager);
        collect_manager->config.host_id = (char *)"self";
        collect_manager->peers = pm;
        collect_manager->telemetry = t;

        out = collect();
        ck_assert_ptr_nonnull(strstr(out, "epd_peer_up{peer=\"gone\",transport=\"tcp\"} 0\n"));
        ck_assert_ptr_nonnull(strstr(out, "epd_peer_backpressure_level{peer=\"gone\","));
        /* five families (control bytes twice), and the backpressure level */
        ck_assert_uint_eq(count(out, "peer=\"gone\""), 7);
        free(buf);

        ck_assert_int_eq(peer_manager_retire_member(pm, "gone"), 0);
        out = collect();
        const char *left = strstr(out, "peer=\"gone\"");
        ck_assert_msg(!left, "a member that left is still exported: ...%.60s", left ? left : "");
        for (size_t i = 0; i < ELEMENTSOF(families); i++) {
                char want[128];
                /* A live member keeps every family. */
                snprintf(want, sizeof want, "%speer=\"stays\"", families[i]);
                ck_assert_msg(strstr(out, want), "%s missing", want);
        }
        ck_assert_ptr_nonnull(strstr(out, "epd_peer_backpressure_level{peer=\"stays\","));
        /* Names telemetry knows that are no peer at all (a client's TrackSocket) stay. */
        ck_assert_int_eq(telemetry_set_peer_load(t, "not-a-peer", 0, 0, 0), 0);
        free(buf);
        out = collect();
        ck_assert_ptr_nonnull(strstr(out, "epd_peer_backpressure_level{peer=\"not-a-peer\","));
        /* The families themselves stay, with or without samples. */
        ck_assert_ptr_nonnull(strstr(out, "# TYPE epd_peer_up gauge\n"));
        free(buf);

        /* Everyone leaves: the families print without a sample. */
        ck_assert_int_eq(peer_manager_retire_member(pm, "stays"), 0);
        out = collect();
        ck_assert_ptr_null(strstr(out, "epd_peer_up{"));
        ck_assert_ptr_nonnull(strstr(out, "# TYPE epd_peer_control_bytes_total counter\n"));
        free(buf);

        /* It comes back: exported again. */
        ck_assert_int_eq(peer_manager_add_member(pm, "gone", "127.0.0.1:9", NULL), 0);
        out = collect();
        ck_assert_uint_eq(count(out, "peer=\"gone\""), 7);
        free(buf);

        free(collect_manager);
        telemetry_free(t);
        peer_manager_free(pm);
        sd_event_unref(e);
}
END_TEST

int main(void) {
        Suite *s = suite_create("metrics");
        TCase *tc = tcase_create("metrics");
        tcase_add_test(tc, test_text_format);
        tcase_add_test(tc, test_openmetrics);
        tcase_add_test(tc, test_misuse);
        tcase_add_test(tc, test_accept);
        suite_add_tcase(s, tc);
        tc = tcase_create("collect");
        tcase_add_test(tc, test_retired_member_not_exported);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
