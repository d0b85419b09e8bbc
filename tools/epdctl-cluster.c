/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl cluster: where membership comes from, etcd's state, every member with its lease
 * and the directory shards it owns. epdctl placement HASH...: where the longest cached
 * prefix of a request's block hashes lives (org.epd1.Placement.LocatePrefix). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epdctl.h"
#include "parse-util.h"

static void json_member(const epd_member *m) {
        printf("{\"host_id\":");
        json_string(stdout, m->host_id);
        printf(",\"address\":");
        json_string(stdout, m->address);
        printf(",\"source\":");
        json_string(stdout, m->source);
        printf(",\"lease\":");
        json_string(stdout, m->lease);
        printf(",\"session\":");
        json_string(stdout, m->session);
        printf(",\"last_error\":");
        json_string(stdout, m->last_error);
        printf(",\"transports\":");
        json_string(stdout, m->transports);
        printf(",\"arenas\":");
        json_string(stdout, m->arenas);
        printf(",\"nics\":");
        json_string(stdout, m->nics);
        printf(",\"gpus\":%" PRIu32 ",\"share_permille\":%" PRIu32 ",\"published_here\":%" PRIu64 "}", m->gpus,
               m->share_permille, m->published_here);
}

/* The directory forwarding's counters (org.epd1.Placement.Counters), as JSON members. */
static void json_directory_counters(epd_client *c) {
        sd_bus_message *reply = NULL;
        const char *name;
        uint64_t v;
        bool first = true;

        printf(",\"directory\":{");
        if (epdctl_get_property(c, "/org/epd1/placement", "org.epd1.Placement", "Counters", "a(st)", &reply) >= 0 &&
            sd_bus_message_enter_container(reply, 'a', "(st)") >= 0)
                while (sd_bus_message_read(reply, "(st)", &name, &v) > 0) {
                        printf("%s", first ? "" : ",");
                        json_string(stdout, name);
                        printf(":%" PRIu64, v);
                        first = false;
                }
        printf("}");
        sd_bus_message_unref(reply);
}

int verb_cluster(epd_client *c, int argc, char **argv) {
        epd_member *members = NULL;
        epd_cluster cl;
        size_t n = 0;
        int r;

        r = epd_cluster_get(c, &cl);
        if (r < 0 && epd_last_error_name(c) &&
            strcmp(epd_last_error_name(c), "org.freedesktop.DBus.Error.UnknownObject") == 0) {
                /* No peer subsystem, so no Cluster object: a daemon on its own. */
                if (arg_json)
                        printf("{\"source\":\"none\",\"members\":[]}\n");
                else
                        printf("Membership: none (this epdd has no peers; [Cluster] Listen= with [Peer:NAME] "
                               "sections or Etcd= in epd.conf make a cluster).\n");
                return 0;
        }
        if (r < 0)
                return epdctl_fail(c, r, "cluster");
        r = epd_list_members(c, &members, &n);
        if (r < 0) {
                epd_cluster_done(&cl);
                return epdctl_fail(c, r, "cluster members");
        }
        if (arg_json) {
                printf("{\"source\":");
                json_string(stdout, cl.source);
                printf(",\"etcd_state\":");
                json_string(stdout, cl.etcd_state);
                printf(",\"etcd_reason\":");
                json_string(stdout, cl.etcd_reason);
                printf(",\"etcd_prefix\":");
                json_string(stdout, cl.etcd_prefix);
                printf(",\"lease_id\":%" PRIu64 ",\"lease_ttl_usec\":%" PRIu64 ",\"revision\":%" PRIu64
                       ",\"shard_records\":%" PRIu64 ",\"members_alive\":%" PRIu32 ",\"members\":[",
                       cl.lease_id, cl.lease_ttl_usec, cl.revision, cl.shard_records, cl.members_alive);
                for (size_t i = 0; i < n; i++) {
                        printf("%s", i ? "," : "");
                        json_member(members + i);
                }
                printf("]");
                json_directory_counters(c);
                printf("}\n");
        } else {
                printf("Membership: %s", cl.source);
                if (strcmp(cl.source, "etcd") == 0)
                        printf(" (%s: %s), prefix %s, lease %" PRIx64 " TTL %" PRIu64 "s, revision %" PRIu64,
                               cl.etcd_state, cl.etcd_reason, cl.etcd_prefix, cl.lease_id,
                               cl.lease_ttl_usec / 1000000, cl.revision);
                printf("\nDirectory records owned here: %" PRIu64 "\n\n", cl.shard_records);
                printf("%-16s %-22s %-7s %-8s %-14s %6s %9s  %s\n", "HOST_ID", "ADDRESS", "SOURCE", "LEASE",
                       "SESSION", "SHARE", "PUBLISHED", "TRANSPORTS/ARENAS");
                for (size_t i = 0; i < n; i++) {
                        epd_member *m = members + i;
                        printf("%-16s %-22s %-7s %-8s %-14s %5.1f%% %9" PRIu64 "  %s %s\n", m->host_id, m->address,
                               m->source, m->lease, m->session, m->share_permille / 10.0, m->published_here,
                               m->transports[0] ? m->transports : "-", m->arenas);
                        if (m->last_error[0] && strcmp(m->session, "up") != 0)
                                printf("  last error: %s\n", m->last_error);
                }
        }
        epd_members_free(members, n);
        epd_cluster_done(&cl);
        return 0;
}

/* A hash as vLLM prints it (decimal) or as 0x... hexadecimal; nothing before the digits
 * (no sign, no blank). */
static int parse_hash(const char *s, uint64_t *ret) {
        char *end;
        errno = 0;
        /* Base 10 unless 0x: a decimal hash with a leading 0 is not octal. */
        bool hex = s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
        unsigned long long v = strtoull(s, &end, hex ? 16 : 10);
        if (errno || end == s || *end || !(*s >= '0' && *s <= '9'))
                return -EINVAL;
        *ret = v;
        return 0;
}

int verb_placement(epd_client *c, int argc, char **argv) {
        epd_placement p;
        uint64_t *hashes;
        int r;

        if (argc < 1) {
                fprintf(stderr, "Usage: epdctl placement HASH...\n");
                return -EINVAL;
        }
        hashes = calloc((size_t)argc, sizeof *hashes);
        if (!hashes)
                return -ENOMEM;
        for (int i = 0; i < argc; i++)
                if (parse_hash(argv[i], hashes + i) < 0) {
                        fprintf(stderr, "Invalid block hash '%s': expected a number (decimal or 0x hex).\n", argv[i]);
                        free(hashes);
                        return -EINVAL;
                }
        r = epd_locate_prefix(c, hashes, (size_t)argc, &p);
        free(hashes);
        if (r < 0)
                return epdctl_fail(c, r, "placement");
        if (arg_json) {
                printf("{\"n_blocks\":%" PRIu32 ",\"host\":", p.n_blocks);
                json_string(stdout, p.host);
                printf(",\"arena\":");
                json_string(stdout, p.arena);
                printf(",\"worker\":");
                json_string(stdout, p.worker);
                printf(",\"owners_missing\":%" PRIu32 ",\"candidates\":[", p.owners_missing);
                for (size_t i = 0; i < p.n_candidates; i++) {
                        printf("%s{\"host\":", i ? "," : "");
                        json_string(stdout, p.candidates[i].host);
                        printf(",\"arena\":");
                        json_string(stdout, p.candidates[i].arena);
                        printf(",\"worker\":");
                        json_string(stdout, p.candidates[i].worker);
                        printf(",\"n_blocks\":%" PRIu32 "}", p.candidates[i].n_blocks);
                }
                printf("]}\n");
        } else {
                if (p.n_blocks == 0)
                        printf("No host caches the first block of this prefix (%d blocks asked).\n", argc);
                else
                        printf("Best: %s, arena %s, worker %s: %" PRIu32 " of %d blocks cached\n", p.host, p.arena,
                               p.worker[0] ? p.worker : "-", p.n_blocks, argc);
                for (size_t i = 0; i < p.n_candidates; i++)
                        printf("  %-16s %-12s %-24s %" PRIu32 " blocks\n", p.candidates[i].host, p.candidates[i].arena,
                               p.candidates[i].worker[0] ? p.candidates[i].worker : "-", p.candidates[i].n_blocks);
                if (p.owners_missing)
                        printf("  %" PRIu32 " directory owner(s) did not answer in time: their blocks count as not cached\n",
                               p.owners_missing);
        }
        epd_placement_done(&p);
        return 0;
}
