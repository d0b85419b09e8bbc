/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "bpf/epd-telemetry.h"
#include "macro.h"
#include "parse-util.h"
#include "telemetry/telemetry-config.h"

int telemetry_config_defaults(TelemetryConfig *c) {
        *c = (TelemetryConfig){
                .bpf = true,
                .pin_dir = strdup(EPD_TELEMETRY_PIN_DIR),
                .sample_interval_usec = 10 * USEC_PER_MSEC,
                .wakeup_bytes = 16 * 1024,
                .trace_requests = 4096,
                .trace_events = 256,
                .max_peers = 256,
        };
        backpressure_config_defaults(&c->backpressure);
        return c->pin_dir ? 0 : -ENOMEM;
}

void telemetry_config_done(TelemetryConfig *c) {
        if (!c)
                return;
        free(c->pin_dir);
        c->pin_dir = NULL;
}

int telemetry_config_copy(TelemetryConfig *dst, const TelemetryConfig *src) {
        *dst = *src;
        dst->pin_dir = NULL;
        if (src->pin_dir && !(dst->pin_dir = strdup(src->pin_dir)))
                return -ENOMEM;
        return 0;
}

static int set_unsigned(const char *value, unsigned *ret, unsigned lo, unsigned hi) {
        uint32_t v;
        int r = parse_u32(value, &v);
        if (r < 0)
                return r;
        if (v < lo || v > hi)
                return -EINVAL;
        *ret = v;
        return 0;
}

int telemetry_config_set(TelemetryConfig *c, const char *section, const char *key, const char *value) {
        if (!c || !section || !key || !value)
                return -EINVAL;

        if (strcasecmp(section, "Backpressure") == 0)
                return backpressure_config_set(&c->backpressure, key, value);
        if (strcasecmp(section, "Telemetry") != 0)
                return -ENOENT;

        if (strcasecmp(key, "BPF") == 0)
                return parse_bool(value, &c->bpf);
        if (strcasecmp(key, "PinDirectory") == 0) {
                bool b;
                char *p;
                if (value[0] == '\0' || (parse_bool(value, &b) == 0 && !b))
                        p = NULL;
                else if (value[0] != '/' || strlen(value) > 200 || strstr(value, "/../") ||
                         strstr(value, "//"))
                        return -EINVAL;
                else if (!(p = strdup(value)))
                        return -ENOMEM;
                free(c->pin_dir);
                c->pin_dir = p;
                return 0;
        }
        if (strcasecmp(key, "SampleInterval") == 0) {
                usec_t u;
                int r = parse_duration(value, &u);
                if (r < 0)
                        return r;
                if (u > 10 * USEC_PER_SEC)
                        return -EINVAL;
                c->sample_interval_usec = u;
                return 0;
        }
        if (strcasecmp(key, "WakeupBytes") == 0) {
                uint64_t v;
                int r = parse_size(value, &v);
                if (r < 0)
                        return r;
                if (v > EPD_TELEMETRY_RINGBUF_BYTES / 2)
                        return -EINVAL;
                c->wakeup_bytes = (unsigned)v;
                return 0;
        }
        if (strcasecmp(key, "TraceRequests") == 0)
                return set_unsigned(value, &c->trace_requests, 1, 1u << 20);
        if (strcasecmp(key, "TraceEvents") == 0)
                return set_unsigned(value, &c->trace_events, 1, 65536);
        if (strcasecmp(key, "MaxPeers") == 0)
                return set_unsigned(value, &c->max_peers, 1, 65536);
        return -ENOENT;
}

int telemetry_config_verify(const TelemetryConfig *c, const char **ret_problem) {
        return backpressure_config_verify(&c->backpressure, ret_problem);
}
