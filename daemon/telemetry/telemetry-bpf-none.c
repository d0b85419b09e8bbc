/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fallback when epd is built without BPF (meson -Dbpf=disabled, or clang, bpftool or
 * libbpf.a missing at build time). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "telemetry/telemetry-bpf.h"

int telemetry_bpf_open(TelemetryBpf **ret, const char *pin_dir, uint64_t sample_interval_nsec,
                       uint32_t wakeup_bytes, TelemetryBpfEventFn fn, void *userdata,
                       char **ret_why) {
        if (ret_why)
                *ret_why = strdup("epd was built without BPF support (-Dbpf)");
        return -EOPNOTSUPP;
}

TelemetryBpf *telemetry_bpf_free(TelemetryBpf *b) {
        return NULL;
}

const char *telemetry_bpf_pin_dir(TelemetryBpf *b) {
        return NULL;
}

int telemetry_bpf_ring_fd(TelemetryBpf *b) {
        return -EOPNOTSUPP;
}

int telemetry_bpf_consume(TelemetryBpf *b) {
        return -EOPNOTSUPP;
}

int telemetry_bpf_track(TelemetryBpf *b, uint64_t cookie, uint32_t peer_id, const char *peer) {
        return -EOPNOTSUPP;
}

int telemetry_bpf_untrack(TelemetryBpf *b, uint64_t cookie) {
        return -EOPNOTSUPP;
}

int telemetry_bpf_prune(TelemetryBpf *b, bool (*keep)(void *userdata, uint64_t cookie), void *userdata) {
        return 0;
}

int telemetry_bpf_conn_stats(TelemetryBpf *b, uint64_t cookie, struct epd_conn_stats *ret) {
        return -EOPNOTSUPP;
}

int telemetry_bpf_counters(TelemetryBpf *b, uint64_t ret[_EPD_COUNTER_MAX]) {
        return -EOPNOTSUPP;
}

int telemetry_bpf_prog_stats(TelemetryBpf *b, uint64_t *ret_run_nsec, uint64_t *ret_runs) {
        return -EOPNOTSUPP;
}

int telemetry_bpf_enable_stats(void) {
        return -EOPNOTSUPP;
}
