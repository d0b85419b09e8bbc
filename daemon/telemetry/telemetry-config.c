/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "bpf/epd-telemetry.h"
#include "conf-table.h"
#include "macro.h"
#include "parse-util.h"
#include "telemetry/telemetry-config.h"

/* Whether this is the host's epdd: the process systemd executed itself for a service
 * (epd.service binds the pin directory in), which it tells by SYSTEMD_EXEC_PID (systemd
 * 248 and later). A process that merely descends from some service (tests under a CI
 * runner's, say) inherits that variable with another pid. */
static bool host_service(void) {
        const char *e = getenv("SYSTEMD_EXEC_PID");
        char *end;
        if (!e || !*e)
                return false;
        errno = 0;
        unsigned long pid = strtoul(e, &end, 10);
        return errno == 0 && *end == '\0' && pid == (unsigned long)getpid();
}

int telemetry_config_defaults(TelemetryConfig *c) {
        /* The host's epdd (started by systemd, whose unit binds the directory in) pins
         * its maps where tools look by default; one started by hand (a test, a demo, a
         * second daemon) pins nowhere unless told: it would take the host's path. */
        bool service = host_service();
        *c = (TelemetryConfig){
                .bpf = true,
                .pin_dir = service ? strdup(EPD_TELEMETRY_PIN_DIR) : NULL,
                .sample_interval_usec = 10 * USEC_PER_MSEC,
                .wakeup_bytes = 16 * 1024,
                .trace_requests = 4096,
                .trace_events = 256,
                .max_peers = 256,
        };
        backpressure_config_defaults(&c->backpressure);
        return c->pin_dir || !service ? 0 : -ENOMEM;
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

static int p_pin_dir(const char *value, void *dst) {
        char **pin = dst, *p;
        bool b;
        if (value[0] == '\0' || (parse_bool(value, &b) == 0 && !b))
                p = NULL;
        else if (value[0] != '/' || strlen(value) > 200 || strstr(value, "/../") || strstr(value, "//"))
                return -EINVAL;
        else if (!(p = strdup(value)))
                return -ENOMEM;
        free(*pin);
        *pin = p;
        return 0;
}

static int p_sample_interval(const char *value, void *dst) {
        usec_t u;
        int r = parse_duration(value, &u);
        if (r < 0)
                return r;
        if (u > 10 * USEC_PER_SEC)
                return -EINVAL;
        *(usec_t *)dst = u;
        return 0;
}

static int p_wakeup_bytes(const char *value, void *dst) {
        uint64_t v;
        int r = parse_size(value, &v);
        if (r < 0)
                return r;
        if (v > EPD_TELEMETRY_RINGBUF_BYTES / 2)
                return -EINVAL;
        *(unsigned *)dst = (unsigned)v;
        return 0;
}

static int unsigned_in(const char *value, void *dst, unsigned lo, unsigned hi) {
        unsigned v;
        int r = conf_parse_unsigned(value, &v);
        if (r < 0)
                return r;
        if (v < lo || v > hi)
                return -EINVAL;
        *(unsigned *)dst = v;
        return 0;
}

static int p_trace_requests(const char *value, void *dst) {
        return unsigned_in(value, dst, 1, 1u << 20);
}

static int p_1_65536(const char *value, void *dst) {
        return unsigned_in(value, dst, 1, 65536);
}

#define T(f) offsetof(TelemetryConfig, f)
static const ConfTableItem telemetry_items[] = {
        { "BPF", conf_parse_bool, T(bpf) },
        { "PinDirectory", p_pin_dir, T(pin_dir) },
        { "SampleInterval", p_sample_interval, T(sample_interval_usec) },
        { "WakeupBytes", p_wakeup_bytes, T(wakeup_bytes) },
        { "TraceRequests", p_trace_requests, T(trace_requests) },
        { "TraceEvents", p_1_65536, T(trace_events) },
        { "MaxPeers", p_1_65536, T(max_peers) },
};
#undef T

int telemetry_config_set(TelemetryConfig *c, const char *section, const char *key, const char *value) {
        if (!c || !section || !key || !value)
                return -EINVAL;
        if (strcasecmp(section, "Backpressure") == 0)
                return backpressure_config_set(&c->backpressure, key, value);
        if (strcasecmp(section, "Telemetry") != 0)
                return -ENOENT;
        return conf_table_set(telemetry_items, ELEMENTSOF(telemetry_items), c, key, value);
}

int telemetry_config_verify(const TelemetryConfig *c, const char **ret_problem) {
        return backpressure_config_verify(&c->backpressure, ret_problem);
}
