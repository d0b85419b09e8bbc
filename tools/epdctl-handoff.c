/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl handoffs: the handoffs this daemon takes part in, and the counters. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "epdctl.h"
#include "macro.h"

int verb_handoffs(epd_client *c, int argc, char **argv);

int verb_handoffs(epd_client *c, int argc, char **argv) {
        sd_bus_message *reply = NULL, *counters = NULL;
        /* Both read before anything is printed: a failure prints no half of the output
         * (with --json, no JSON cut short). */
        int r = epdctl_get_property(c, "/org/epd1/handoffs", "org.epd1.Handoffs", "Handoffs", "a(ossssuuts)", &reply);
        if (r < 0)
                return epdctl_fail(c, r, "Handoffs");
        r = epdctl_get_property(c, "/org/epd1/handoffs", "org.epd1.Handoffs", "Counters", "a{st}", &counters);
        if (r < 0) {
                sd_bus_message_unref(reply);
                return epdctl_fail(c, r, "Counters");
        }
        r = sd_bus_message_enter_container(reply, 'a', "(ossssuuts)");
        if (r < 0)
                goto fail;
        if (arg_json)
                printf("{\"handoffs\":[");
        else
                printf("%-32s %-11s %-12s %-16s %7s %12s %s\n", "REQUEST", "ROLE", "STATE", "PEER", "GROUPS", "BYTES",
                       "CAUSE");
        const char *path, *rid, *role, *state, *peer, *cause;
        uint32_t done, n;
        uint64_t bytes;
        bool first = true;
        while ((r = sd_bus_message_read(reply, "(ossssuuts)", &path, &rid, &role, &state, &peer, &done, &n, &bytes,
                                        &cause)) > 0) {
                if (arg_json) {
                        printf("%s{\"path\":", first ? "" : ",");
                        json_string(stdout, path);
                        printf(",\"request_id\":");
                        json_string(stdout, rid);
                        printf(",\"role\":");
                        json_string(stdout, role);
                        printf(",\"state\":");
                        json_string(stdout, state);
                        printf(",\"peer\":");
                        json_string(stdout, peer);
                        printf(",\"groups_done\":%" PRIu32 ",\"groups\":%" PRIu32 ",\"bytes\":%" PRIu64 ",\"cause\":",
                               done, n, bytes);
                        json_string(stdout, cause);
                        printf("}");
                } else {
                        char g[16];
                        snprintf(g, sizeof g, "%" PRIu32 "/%" PRIu32, done, n);
                        printf("%-32s %-11s %-12s %-16s %7s %12" PRIu64 " %s\n", rid, role, state,
                               peer[0] ? peer : "(local)", g, bytes, strcmp(cause, "none") ? cause : "");
                }
                first = false;
        }
        if (r < 0)
                goto fail;
        sd_bus_message_unref(reply);
        reply = TAKE_PTR(counters);
        r = sd_bus_message_enter_container(reply, 'a', "{st}");
        if (r < 0)
                goto fail;
        printf(arg_json ? "],\"counters\":{" : "\nCounters:\n");
        const char *k;
        uint64_t v;
        first = true;
        while ((r = sd_bus_message_read(reply, "{st}", &k, &v)) > 0) {
                if (arg_json) {
                        printf("%s", first ? "" : ",");
                        json_string(stdout, k);
                        printf(":%" PRIu64, v);
                } else if (v > 0 || !strchr(k, '.'))
                        printf("  %-26s %" PRIu64 "\n", k, v);
                first = false;
        }
        if (r < 0)
                goto fail;
        if (arg_json)
                printf("}}\n");
        sd_bus_message_unref(reply);
        return 0;
fail:
        sd_bus_message_unref(reply);
        sd_bus_message_unref(counters);
        fprintf(stderr, "Bad reply: %s\n", strerror(-r));
        return r;
}
