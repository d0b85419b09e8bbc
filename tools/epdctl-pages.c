/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl pages, epdctl sequences: KV page pools, the block directory, sequences. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "epdctl.h"
#include "macro.h"
#include "parse-util.h"

int verb_pages(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *pools = NULL, *dir = NULL;
        int r = epdctl_get_property(c, "/org/epd1/pages", "org.epd1.Pages", "Pools", "a(sttttttttttt)", &pools);
        if (r < 0)
                return epdctl_fail(c, r, "pages");
        r = epdctl_get_property(c, "/org/epd1/pages", "org.epd1.Pages", "Directory", "(tttttttt)", &dir);
        if (r < 0)
                return epdctl_fail(c, r, "pages");
        r = sd_bus_message_enter_container(pools, 'a', "(sttttttttttt)");
        if (r < 0)
                return r;
        if (arg_json)
                printf("{\"pools\":[");
        else
                printf("%-12s %9s %9s %9s %9s %9s %9s %9s %9s %10s %9s\n", "ARENA", "PAGE", "TOTAL", "FREE",
                       "LIVE", "CACHED", "SHARED", "LEASED", "COW", "SAVED", "EVICTED");
        const char *name;
        uint64_t ps, total, free_, live, idle, shared, leased, cow, saved, evictions, failures;
        bool first = true;
        while ((r = sd_bus_message_read(pools, "(sttttttttttt)", &name, &ps, &total, &free_, &live, &idle,
                                        &shared, &leased, &cow, &saved, &evictions, &failures)) > 0) {
                if (arg_json) {
                        printf("%s{\"arena\":", first ? "" : ",");
                        json_string(stdout, name);
                        printf(",\"page_size\":%" PRIu64 ",\"total\":%" PRIu64 ",\"free\":%" PRIu64
                               ",\"live\":%" PRIu64 ",\"cached_idle\":%" PRIu64 ",\"shared\":%" PRIu64
                               ",\"leased\":%" PRIu64 ",\"cow_copies\":%" PRIu64 ",\"bytes_saved\":%" PRIu64
                               ",\"evictions\":%" PRIu64 ",\"alloc_failures\":%" PRIu64 "}",
                               ps, total, free_, live, idle, shared, leased, cow, saved, evictions, failures);
                } else {
                        char a[32], b[32];
                        printf("%-12s %9s %9" PRIu64 " %9" PRIu64 " %9" PRIu64 " %9" PRIu64 " %9" PRIu64
                               " %9" PRIu64 " %9" PRIu64 " %10s %9" PRIu64 "\n",
                               name, format_size(a, sizeof a, ps), total, free_, live, idle, shared, leased, cow,
                               format_size(b, sizeof b, saved), evictions);
                }
                first = false;
        }
        if (r < 0)
                return r;
        if (first && !arg_json)
                printf("(no KV arena has pages yet: they appear when a worker registers a KV layout)\n");
        uint64_t entries, lookups, hits, misses, inserts, conflicts, devict, removals;
        r = sd_bus_message_read(dir, "(tttttttt)", &entries, &lookups, &hits, &misses, &inserts, &conflicts,
                                &devict, &removals);
        if (r < 0)
                return r;
        if (arg_json)
                printf("],\"directory\":{\"entries\":%" PRIu64 ",\"lookups\":%" PRIu64 ",\"hits\":%" PRIu64
                       ",\"misses\":%" PRIu64 ",\"inserts\":%" PRIu64 ",\"conflicts\":%" PRIu64
                       ",\"evictions\":%" PRIu64 ",\"removals\":%" PRIu64 "}}\n",
                       entries, lookups, hits, misses, inserts, conflicts, devict, removals);
        else
                printf("\nDirectory: %" PRIu64 " entries; %" PRIu64 " lookups, %" PRIu64 " block hits, %" PRIu64
                       " misses; %" PRIu64 " inserts (%" PRIu64 " conflicts), %" PRIu64 " evictions, %" PRIu64
                       " removals\n",
                       entries, lookups, hits, misses, inserts, conflicts, devict, removals);
        return 0;
}

int verb_sequences(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r = epdctl_get_property(c, "/org/epd1/pages", "org.epd1.Pages", "Sequences", "a(oosuut)", &reply);
        if (r < 0)
                return epdctl_fail(c, r, "sequences");
        r = sd_bus_message_enter_container(reply, 'a', "(oosuut)");
        if (r < 0)
                return r;
        if (arg_json)
                printf("[");
        else
                printf("%-34s %-34s %-12s %8s %8s %8s\n", "SEQUENCE", "OWNER", "ARENA", "PAGES", "SHARED", "COW");
        const char *path, *owner, *arena;
        uint32_t pages, shared;
        uint64_t cow;
        bool first = true;
        while ((r = sd_bus_message_read(reply, "(oosuut)", &path, &owner, &arena, &pages, &shared, &cow)) > 0) {
                const char *id = strrchr(path, '/') + 1, *oid = strrchr(owner, '/') + 1;
                if (arg_json) {
                        printf("%s{\"id\":", first ? "" : ",");
                        json_string(stdout, id);
                        printf(",\"path\":");
                        json_string(stdout, path);
                        printf(",\"owner\":");
                        json_string(stdout, owner);
                        printf(",\"arena\":");
                        json_string(stdout, arena);
                        printf(",\"pages\":%u,\"shared_pages\":%u,\"cow_copies\":%" PRIu64 "}", pages, shared, cow);
                } else
                        printf("%-34s %-34s %-12s %8u %8u %8" PRIu64 "\n", id, *oid ? oid : "-", arena, pages,
                               shared, cow);
                first = false;
        }
        if (arg_json)
                printf("]\n");
        return r < 0 ? r : 0;
}
