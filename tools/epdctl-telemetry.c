/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl trace REQUEST_ID, epdctl peers. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epd-internal.h"
#include "epd/epd-telemetry.h"
#include "epdctl.h"
#include "macro.h"
#include "parse-util.h"

int verb_trace(epd_client *c, int argc, char **argv) {
        epd_trace_event *ev = NULL;
        size_t n = 0;
        uint64_t dropped = 0;

        if (argc != 1) {
                fprintf(stderr, "Usage: epdctl trace REQUEST_ID\n");
                return -EINVAL;
        }
        int r = epd_trace_get(c, argv[0], &ev, &n, &dropped);
        if (r < 0)
                return epdctl_fail(c, r, "trace");

        uint64_t t0 = UINT64_MAX, t1 = 0;
        for (size_t i = 0; i < n; i++) {
                t0 = MIN(t0, ev[i].ts_usec);
                t1 = MAX(t1, ev[i].ts_usec);
        }
        if (arg_json) {
                printf("{\"request\":");
                json_string(stdout, argv[0]);
                printf(",\"dropped\":%" PRIu64 ",\"events\":[", dropped);
                for (size_t i = 0; i < n; i++) {
                        const epd_trace_event *e = &ev[i];
                        printf("%s{\"ts_usec\":%" PRIu64 ",\"offset_usec\":%" PRIu64 ",\"type\":", i ? "," : "",
                               e->ts_usec, e->ts_usec - t0);
                        json_string(stdout, e->type);
                        printf(",\"group\":%" PRIi32 ",\"bytes\":%" PRIu64 ",\"duration_usec\":%" PRIu64
                               ",\"transport\":",
                               e->group, e->bytes, e->duration_usec);
                        json_string(stdout, e->transport);
                        printf(",\"peer\":");
                        json_string(stdout, e->peer);
                        printf(",\"detail\":");
                        json_string(stdout, e->detail);
                        printf("}");
                }
                printf("]}\n");
        } else {
                printf("request %s: %zu events over %.3f ms%s\n", argv[0], n,
                       n ? (double)(t1 - t0) / 1000.0 : 0.0, dropped ? " (some dropped)" : "");
                for (size_t i = 0; i < n; i++) {
                        const epd_trace_event *e = &ev[i];
                        char buf[32];
                        printf("  %+10.3fms  %-16s", (double)(e->ts_usec - t0) / 1000.0, e->type);
                        if (e->group >= 0)
                                printf(" group=%" PRIi32, e->group);
                        if (e->bytes)
                                printf(" bytes=%s", format_size(buf, sizeof buf, e->bytes));
                        if (e->transport[0])
                                printf(" via=%s", e->transport);
                        if (e->peer[0])
                                printf(" peer=%s", e->peer);
                        if (e->duration_usec)
                                printf(" took=%.3fms", (double)e->duration_usec / 1000.0);
                        if (e->detail[0])
                                printf("  %s", e->detail);
                        printf("\n");
                }
                if (dropped)
                        printf("  ... %" PRIu64 " more events were not kept\n", dropped);
        }
        free(ev);
        return 0;
}

int verb_paths(epd_client *c, int argc, char **argv) {
        sd_bus_message *reply = NULL;
        int r = epd__call(c, "/org/epd1/telemetry", "org.epd1.Telemetry", "GetPeers", &reply, NULL);
        if (r < 0)
                return epdctl_fail(c, r, "peers");
        r = sd_bus_message_enter_container(reply, 'a', "(sa{sv})");
        if (!arg_json)
                printf("%-20s %5s %9s %9s %12s %9s %-9s %s\n", "PEER", "CONNS", "SRTT", "MIN_RTT",
                       "ACKED", "RETRANS", "LEVEL", "REASON");
        else
                printf("[");
        bool first = true;
        while (r >= 0) {
                const char *name;
                r = sd_bus_message_enter_container(reply, 'r', "sa{sv}");
                if (r <= 0)
                        break;
                r = sd_bus_message_read(reply, "s", &name);
                uint32_t conns = 0, srtt = 0, min_rtt = 0, level = 0;
                uint64_t acked = 0, retrans = 0;
                const char *reason = "";
                if (r >= 0)
                        r = sd_bus_message_enter_container(reply, 'a', "{sv}");
                while (r > 0) {
                        const char *key;
                        r = sd_bus_message_enter_container(reply, 'e', "sv");
                        if (r <= 0)
                                break;
                        r = sd_bus_message_read(reply, "s", &key);
                        if (r < 0)
                                break;
                        if (strcmp(key, "connections") == 0)
                                r = sd_bus_message_read(reply, "v", "u", &conns);
                        else if (strcmp(key, "srtt_us") == 0)
                                r = sd_bus_message_read(reply, "v", "u", &srtt);
                        else if (strcmp(key, "min_rtt_us") == 0)
                                r = sd_bus_message_read(reply, "v", "u", &min_rtt);
                        else if (strcmp(key, "level") == 0)
                                r = sd_bus_message_read(reply, "v", "u", &level);
                        else if (strcmp(key, "bytes_acked") == 0)
                                r = sd_bus_message_read(reply, "v", "t", &acked);
                        else if (strcmp(key, "retransmits") == 0)
                                r = sd_bus_message_read(reply, "v", "t", &retrans);
                        else if (strcmp(key, "reason") == 0)
                                r = sd_bus_message_read(reply, "v", "s", &reason);
                        else
                                r = sd_bus_message_skip(reply, "v");
                        if (r >= 0)
                                r = sd_bus_message_exit_container(reply);
                        if (r >= 0)
                                r = 1;
                }
                if (r >= 0)
                        r = sd_bus_message_exit_container(reply);
                if (r >= 0)
                        r = sd_bus_message_exit_container(reply);
                if (r < 0)
                        break;
                static const char *const levels[] = { "none", "elevated", "high", "stalled" };
                const char *lv = level < ELEMENTSOF(levels) ? levels[level] : "?";
                if (arg_json) {
                        printf("%s{\"peer\":", first ? "" : ",");
                        json_string(stdout, name);
                        printf(",\"connections\":%u,\"srtt_us\":%u,\"min_rtt_us\":%u,\"bytes_acked\":%" PRIu64
                               ",\"retransmits\":%" PRIu64 ",\"level\":",
                               conns, srtt, min_rtt, acked, retrans);
                        json_string(stdout, lv);
                        printf(",\"reason\":");
                        json_string(stdout, reason);
                        printf("}");
                } else
                        printf("%-20s %5u %7uus %7uus %12" PRIu64 " %9" PRIu64 " %-9s %s\n", name, conns, srtt,
                               min_rtt, acked, retrans, lv, reason);
                first = false;
        }
        if (arg_json)
                printf("]\n");
        sd_bus_message_unref(reply);
        return r < 0 ? r : 0;
}
