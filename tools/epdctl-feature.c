/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl features: the feature cache's telemetry (org.epd1.Feature properties). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "epd-internal.h"
#include "epdctl.h"
#include "macro.h"
#include "parse-util.h"

static const struct {
        const char *property, *label, *json;
        bool size;
        bool optional; /* newer than some daemons: left out where the daemon lacks it */
} rows[] = {
        { "Hits", "hits", "hits", false },
        { "Misses", "misses", "misses", false },
        { "CoalescedWaits", "coalesced waits", "coalesced_waits", false },
        { "Produced", "produced", "produced", false },
        { "Failed", "failed", "failed", false },
        { "Evictions", "evictions", "evictions", false },
        { "Spilled", "queued for the store", "spilled", false },
        { "SpillWritten", "written to the store", "spill_written", false, true },
        { "SpillFailed", "store writes failed", "spill_failed", false, true },
        { "SpillDropped", "not spilled (queue full)", "spill_dropped", false, true },
        { "SpillPendingBytes", "spill queue", "spill_pending_bytes", true, true },
        { "Loaded", "loaded from store", "loaded", false },
        { "ReadBackTimeouts", "read-back timeouts", "read_back_timeouts", false, true },
        { "ProduceTimeouts", "produce timeouts", "produce_timeouts", false, true },
        { "PrefetchRequests", "prefetch requests", "prefetch_requests", false },
        { "PrefetchHits", "prefetch hits", "prefetch_hits", false },
        { "EncoderTimeSavedUSec", "encoder time saved", "encoder_time_saved_usec", false },
        { "BytesCached", "bytes cached", "bytes_cached", true },
        { "BytesReserved", "bytes reserved", "bytes_reserved", true },
        { "BytesFenced", "bytes fenced (restart)", "bytes_fenced", true },
        { "CacheBytes", "budget", "cache_bytes", true },
        { "Features", "features", "features", false },
        { "Handles", "handles", "handles", false },
};

int verb_features(epd_client *c, int argc, char **argv) {
        uint64_t v[ELEMENTSOF(rows)];
        bool have[ELEMENTSOF(rows)];
        char *store = NULL;
        int r;

        for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                sd_bus_error e = SD_BUS_ERROR_NULL;
                epd__clear_error(c);
                r = sd_bus_get_property_trivial(c->bus, EPD_DESTINATION(c), "/org/epd1/feature",
                                                "org.epd1.Feature", rows[i].property, &e, 't', &v[i]);
                have[i] = r >= 0;
                if (r < 0 && rows[i].optional && sd_bus_error_has_name(&e, SD_BUS_ERROR_UNKNOWN_PROPERTY)) {
                        sd_bus_error_free(&e);
                        continue;
                }
                if (r < 0) {
                        r = epd__error(c, r, &e);
                        sd_bus_error_free(&e);
                        return epdctl_fail(c, r, "features");
                }
        }
        sd_bus_error e = SD_BUS_ERROR_NULL;
        (void)sd_bus_get_property_string(c->bus, EPD_DESTINATION(c), "/org/epd1/feature",
                                         "org.epd1.Feature", "StoreDirectory", &e, &store);
        sd_bus_error_free(&e);

        uint64_t lookups = v[0] + v[1];
        if (arg_json) {
                printf("{");
                for (size_t i = 0; i < ELEMENTSOF(rows); i++)
                        if (have[i])
                                printf("%s\"%s\":%" PRIu64, i ? "," : "", rows[i].json, v[i]);
                printf(",\"store_directory\":");
                json_string(stdout, store ? store : "");
                printf("}\n");
        } else {
                printf("Feature cache");
                if (lookups)
                        printf(" (hit rate %.1f%%)", 100.0 * (double)v[0] / (double)lookups);
                printf("\n");
                for (size_t i = 0; i < ELEMENTSOF(rows); i++) {
                        char s[32];
                        if (!have[i])
                                continue;
                        if (rows[i].size)
                                printf("  %-20s %s\n", rows[i].label, format_size(s, sizeof s, v[i]));
                        else if (strcmp(rows[i].property, "EncoderTimeSavedUSec") == 0)
                                printf("  %-20s %.3f s\n", rows[i].label, (double)v[i] / 1e6);
                        else
                                printf("  %-20s %" PRIu64 "\n", rows[i].label, v[i]);
                }
                printf("  %-20s %s\n", "store", store && store[0] ? store : "(none)");
        }
        free(store);
        return 0;
}
