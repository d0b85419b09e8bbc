/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl scheduler, epdctl journal: admission pools; workflows and the WAL. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "epdctl.h"
#include "macro.h"

int verb_scheduler(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *pools = NULL, *reasons = NULL;
        int r = epdctl_get_property(c, "/org/epd1", "org.epd1.Scheduler", "Pools", "a(suuddddttttttt)", &pools);
        if (r < 0)
                return epdctl_fail(c, r, "scheduler");
        r = epdctl_get_property(c, "/org/epd1", "org.epd1.Scheduler", "Reasons", "a(sst)", &reasons);
        if (r < 0)
                return epdctl_fail(c, r, "scheduler");
        r = sd_bus_message_enter_container(pools, 'a', "(suuddddttttttt)");
        if (r < 0)
                return r;
        if (arg_json)
                printf("{\"pools\":[");
        else
                printf("%-12s %6s %6s %8s %8s %8s %6s %9s %9s %9s %9s %7s %7s\n", "POOL", "QUEUE", "PEAK", "ARRIVE/s",
                       "SERVE/s", "CAP/s", "RHO", "ADMITTED", "DEFERRED", "REJECTED", "COMPLETE", "MISSED", "EXPIRED");
        const char *name;
        uint32_t queue, peak;
        double arr, svc, cap, rho;
        uint64_t adm, def, rej, done, failed, miss, exp;
        bool first = true;
        while ((r = sd_bus_message_read(pools, "(suuddddttttttt)", &name, &queue, &peak, &arr, &svc, &cap, &rho,
                                        &adm, &def, &rej, &done, &failed, &miss, &exp)) > 0) {
                if (arg_json) {
                        printf("%s{\"pool\":", first ? "" : ",");
                        json_string(stdout, name);
                        printf(",\"queue\":%u,\"queue_peak\":%u,\"arrival_rate\":%.3f,\"service_rate\":%.3f,"
                               "\"capacity\":%.3f,\"rho\":%.3f,\"admitted\":%" PRIu64 ",\"deferred\":%" PRIu64
                               ",\"rejected\":%" PRIu64 ",\"completed\":%" PRIu64 ",\"failed\":%" PRIu64
                               ",\"deadline_misses\":%" PRIu64 ",\"expired\":%" PRIu64 "}",
                               queue, peak, arr, svc, cap, rho, adm, def, rej, done, failed, miss, exp);
                } else
                        printf("%-12s %6u %6u %8.2f %8.2f %8.2f %6.2f %9" PRIu64 " %9" PRIu64 " %9" PRIu64
                               " %9" PRIu64 " %7" PRIu64 " %7" PRIu64 "\n",
                               name, queue, peak, arr, svc, cap, rho, adm, def, rej, done, miss, exp);
                first = false;
        }
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(reasons, 'a', "(sst)");
        if (r < 0)
                return r;
        const char *pool, *reason;
        uint64_t n;
        first = true;
        if (arg_json)
                printf("],\"reasons\":[");
        while ((r = sd_bus_message_read(reasons, "(sst)", &pool, &reason, &n)) > 0) {
                if (arg_json) {
                        printf("%s{\"pool\":", first ? "" : ",");
                        json_string(stdout, pool);
                        printf(",\"reason\":");
                        json_string(stdout, reason);
                        printf(",\"count\":%" PRIu64 "}", n);
                } else {
                        if (first)
                                printf("\n%-12s %-22s %9s\n", "POOL", "DEFERRED/REJECTED FOR", "COUNT");
                        printf("%-12s %-22s %9" PRIu64 "\n", pool, reason, n);
                }
                first = false;
        }
        if (arg_json)
                printf("]}\n");
        return r < 0 ? r : 0;
}

int verb_journal(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *j = NULL, *cnt = NULL;
        int r = epdctl_get_property(c, "/org/epd1", "org.epd1.Workflow", "Journal", "(sttttttt)", &j);
        if (r < 0)
                return epdctl_fail(c, r, "journal");
        r = epdctl_get_property(c, "/org/epd1", "org.epd1.Workflow", "Count", "u", &cnt);
        if (r < 0)
                return epdctl_fail(c, r, "journal");
        const char *sync;
        uint64_t last, synced, appended, syncs, bytes, compactions, cut;
        uint32_t workflows;
        r = sd_bus_message_read(j, "(sttttttt)", &sync, &last, &synced, &appended, &syncs, &bytes, &compactions, &cut);
        if (r >= 0)
                r = sd_bus_message_read(cnt, "u", &workflows);
        if (r < 0)
                return r;
        if (arg_json) {
                printf("{\"sync\":");
                json_string(stdout, sync);
                printf(",\"last_lsn\":%" PRIu64 ",\"synced_lsn\":%" PRIu64 ",\"appended\":%" PRIu64 ",\"syncs\":%" PRIu64
                       ",\"log_bytes\":%" PRIu64 ",\"compactions\":%" PRIu64 ",\"cut_at_start\":%" PRIu64
                       ",\"workflows\":%u}\n",
                       last, synced, appended, syncs, bytes, compactions, cut, workflows);
        } else
                printf("WAL sync=%s  last LSN %" PRIu64 "  synced %" PRIu64 "  appended %" PRIu64 " in %" PRIu64
                       " syncs  log %" PRIu64 " bytes  compactions %" PRIu64 "  cut at start %" PRIu64
                       " bytes\nworkflows: %u\n",
                       sync, last, synced, appended, syncs, bytes, compactions, cut, workflows);
        return 0;
}
