/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* [Telemetry] and [Backpressure] sections of epd.conf. Pure. */

#include <stdbool.h>
#include <stddef.h>

#include "telemetry/backpressure.h"
#include "time-util.h"

typedef struct TelemetryConfig {
        /* [Telemetry] */
        bool bpf;                   /* load the BPF programs (default yes; optional) */
        char *pin_dir;              /* default /sys/fs/bpf/epd; "" or "no": do not pin */
        usec_t sample_interval_usec; /* per-connection ring samples at most this often */
        unsigned wakeup_bytes;      /* ring bytes queued before the daemon is woken */
        unsigned trace_requests;    /* requests kept in the trace store */
        unsigned trace_events;      /* events kept per request */
        unsigned max_peers;
        /* [Backpressure] */
        BackpressureConfig backpressure;
} TelemetryConfig;

int telemetry_config_defaults(TelemetryConfig *c);
/* section is "Telemetry" or "Backpressure". -ENOENT: unknown section or key; -EINVAL:
 * bad value; -ENOMEM. */
int telemetry_config_set(TelemetryConfig *c, const char *section, const char *key, const char *value);
/* Cross-field checks after a whole file was parsed; *ret_problem says what is wrong. */
int telemetry_config_verify(const TelemetryConfig *c, const char **ret_problem);
int telemetry_config_copy(TelemetryConfig *dst, const TelemetryConfig *src);
void telemetry_config_done(TelemetryConfig *c);
