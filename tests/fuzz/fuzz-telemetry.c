/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes what telemetry reads from outside the daemon: ring-buffer records (bytes the
 * kernel side writes; decoded by a pure function that must reject anything malformed)
 * and [Telemetry]/[Backpressure] config values. The first byte picks which.
 *   0: the rest is one ring record; a decoded record has a known type and states.
 *   1: the rest is "Section\0Key\0Value"; setting it either fails cleanly or leaves a
 *      config that verifies or is reported as inconsistent, and frees cleanly. */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "telemetry/backpressure.h"
#include "telemetry/telemetry-config.h"
#include "telemetry/telemetry-event.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 1)
                return 0;
        uint8_t mode = data[0] % 2;
        data++;
        size--;

        if (mode == 0) {
                TelemetryEvent e;
                int r = telemetry_event_decode(data, size, &e);
                if (r == 0) {
                        if (e.type != TELEMETRY_EVENT_SAMPLE && e.type != TELEMETRY_EVENT_RETRANSMIT &&
                            e.type != TELEMETRY_EVENT_STATE)
                                abort();
                        if (!tcp_state_to_string(e.old_state) || !tcp_state_to_string(e.new_state))
                                abort();
                        (void)tcp_state_is_closing(e.new_state);
                        /* Aggregation of a record built from it stays sane. */
                        struct epd_conn_stats st = { .srtt_us = e.srtt_usec, .min_rtt_us = e.min_rtt_usec,
                                                     .state = e.new_state, .bytes_acked = e.bytes_acked };
                        TelemetryPathStats p = {};
                        telemetry_path_stats_add(&p, &st);
                        /* A closed connection's RTT is not the path's. */
                        bool closed = strcmp(tcp_state_to_string(e.new_state), "close") == 0;
                        if (p.n_conns != 1 || p.srtt_usec != (closed ? 0 : e.srtt_usec))
                                abort();
                } else if (r != -EBADMSG)
                        abort();
                return 0;
        }

        /* Three NUL-separated strings; copy so they are terminated. */
        char *buf = malloc(size + 3);
        if (!buf)
                return 0;
        memcpy(buf, data, size);
        buf[size] = buf[size + 1] = buf[size + 2] = '\0';
        const char *section = buf;
        const char *key = section + strlen(section) + 1;
        if (key > buf + size)
                key = buf + size + 1;
        const char *value = key + strlen(key) + 1;
        if (value > buf + size + 1)
                value = buf + size + 2;

        TelemetryConfig c;
        if (telemetry_config_defaults(&c) == 0) {
                int r = telemetry_config_set(&c, section, key, value);
                if (r > 0)
                        abort();
                const char *problem = NULL;
                if (telemetry_config_verify(&c, &problem) < 0 && !problem)
                        abort();
                if (c.pin_dir && c.pin_dir[0] != '/')
                        abort();
                TelemetryConfig d;
                if (telemetry_config_copy(&d, &c) == 0)
                        telemetry_config_done(&d);
        }
        telemetry_config_done(&c);
        free(buf);
        return 0;
}
