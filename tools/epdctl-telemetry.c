/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl trace REQUEST_ID, epdctl paths. */
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

static const char *level_name(uint32_t level) {
        static const char *const levels[] = { "none", "elevated", "high", "stalled" };
        return level < ELEMENTSOF(levels) ? levels[level] : "?";
}

int epdctl_read_paths(epd_client *c, EpdctlPath **ret, size_t *ret_n) {
        sd_bus_message *reply = NULL;
        EpdctlPath *v = NULL;
        size_t n = 0;
        int r = epd__call(c, "/org/epd1/telemetry", "org.epd1.Telemetry", "GetPeers", &reply, NULL);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(reply, 'a', "(sa{sv})");
        while (r >= 0) {
                const char *name, *reason = "";
                r = sd_bus_message_enter_container(reply, 'r', "sa{sv}");
                if (r <= 0)
                        break;
                EpdctlPath *q = reallocarray(v, n + 1, sizeof *v);
                if (!q) {
                        r = -ENOMEM;
                        break;
                }
                v = q;
                EpdctlPath *p = &v[n++];
                *p = (EpdctlPath){};
                r = sd_bus_message_read(reply, "s", &name);
                if (r >= 0) {
                        snprintf(p->peer, sizeof p->peer, "%s", name);
                        r = sd_bus_message_enter_container(reply, 'a', "{sv}");
                }
                while (r > 0) {
                        const char *key;
                        int kernel;
                        r = sd_bus_message_enter_container(reply, 'e', "sv");
                        if (r <= 0)
                                break;
                        r = sd_bus_message_read(reply, "s", &key);
                        if (r < 0)
                                break;
                        if (strcmp(key, "kernel") == 0 && (r = sd_bus_message_read(reply, "v", "b", &kernel)) >= 0)
                                p->kernel = kernel;
                        else if (strcmp(key, "connections") == 0)
                                r = sd_bus_message_read(reply, "v", "u", &p->connections);
                        else if (strcmp(key, "srtt_us") == 0)
                                r = sd_bus_message_read(reply, "v", "u", &p->srtt_us);
                        else if (strcmp(key, "min_rtt_us") == 0)
                                r = sd_bus_message_read(reply, "v", "u", &p->min_rtt_us);
                        else if (strcmp(key, "level") == 0)
                                r = sd_bus_message_read(reply, "v", "u", &p->level);
                        else if (strcmp(key, "bytes_acked") == 0)
                                r = sd_bus_message_read(reply, "v", "t", &p->bytes_acked);
                        else if (strcmp(key, "retransmits") == 0)
                                r = sd_bus_message_read(reply, "v", "t", &p->retransmits);
                        else if (strcmp(key, "reason") == 0 && (r = sd_bus_message_read(reply, "v", "s", &reason)) >= 0)
                                snprintf(p->reason, sizeof p->reason, "%s", reason);
                        else if (strcmp(key, "kernel") != 0 && strcmp(key, "reason") != 0)
                                r = sd_bus_message_skip(reply, "v");
                        if (r >= 0)
                                r = sd_bus_message_exit_container(reply);
                        if (r >= 0)
                                r = 1;
                }
                p->level_name = level_name(p->level);
                if (r >= 0)
                        r = sd_bus_message_exit_container(reply);
                if (r >= 0)
                        r = sd_bus_message_exit_container(reply);
        }
        sd_bus_message_unref(reply);
        if (r < 0) {
                free(v);
                return r;
        }
        *ret = v;
        *ret_n = n;
        return 0;
}

int verb_paths(epd_client *c, int argc, char **argv) {
        EpdctlPath *v = NULL;
        size_t n = 0;
        int r = epdctl_read_paths(c, &v, &n);
        if (r < 0)
                return epdctl_fail(c, r, "paths");
        if (!arg_json)
                printf("%-20s %5s %9s %9s %12s %9s %-9s %s\n", "PEER", "CONNS", "SRTT", "MIN_RTT",
                       "ACKED", "RETRANS", "LEVEL", "REASON");
        else
                printf("[");
        for (size_t i = 0; i < n; i++) {
                const EpdctlPath *p = &v[i];
                if (arg_json) {
                        printf("%s{\"peer\":", i ? "," : "");
                        json_string(stdout, p->peer);
                        printf(",\"kernel\":%s,\"connections\":%u,\"srtt_us\":%u,\"min_rtt_us\":%u,\"bytes_acked\":%" PRIu64
                               ",\"retransmits\":%" PRIu64 ",\"level\":",
                               p->kernel ? "true" : "false", p->connections, p->srtt_us, p->min_rtt_us, p->bytes_acked,
                               p->retransmits);
                        json_string(stdout, p->level_name);
                        printf(",\"reason\":");
                        json_string(stdout, p->reason);
                        printf("}");
                } else
                        printf("%-20s %5u %7uus %7uus %12" PRIu64 " %9" PRIu64 " %-9s %s\n", p->peer, p->connections,
                               p->srtt_us, p->min_rtt_us, p->bytes_acked, p->retransmits, p->level_name, p->reason);
        }
        if (arg_json)
                printf("]\n");
        free(v);
        return 0;
}
