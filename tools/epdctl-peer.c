/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl peers: the other hosts, their state, and the path to each with its reason. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epdctl.h"

static const epd_member *member_of(const epd_member *members, size_t n, const char *host) {
        for (size_t i = 0; i < n; i++)
                if (strcmp(members[i].host_id, host) == 0)
                        return members + i;
        return NULL;
}

int verb_peers(epd_client *c, int argc, char **argv) {
        epd_peer *peers = NULL;
        epd_member *members = NULL;
        epd_cluster cl = {};
        size_t n = 0, n_members = 0;
        int r;

        r = epd_list_peers(c, &peers, &n);
        if (r < 0)
                return epdctl_fail(c, r, "peers");
        /* Where membership comes from (static or etcd), each member's lease and shard. */
        if (epd_cluster_get(c, &cl) >= 0 && epd_list_members(c, &members, &n_members) >= 0 && !arg_json) {
                printf("Membership: %s", cl.source);
                if (strcmp(cl.source, "etcd") == 0)
                        printf(" (%s%s%s)", cl.etcd_state, cl.etcd_reason[0] ? ": " : "", cl.etcd_reason);
                printf("\n");
        }
        if (arg_json)
                printf("[");
        else if (n == 0)
                printf("No peers configured.\n");
        else
                printf("%-12s %-16s %-22s %-14s %-9s %-7s %-10s %-12s %-7s %-8s %6s\n", "NAME", "HOST_ID", "ADDRESS",
                       "STATE", "TRANSPORT", "STREAMS", "INTERFACE", "LAST_FRAME", "SOURCE", "LEASE", "SHARE");
        for (size_t i = 0; i < n; i++) {
                epd_peer *p = peers + i;
                const epd_member *mb = member_of(members, n_members, p->host_id);
                if (arg_json) {
                        printf("%s{\"name\":", i ? "," : "");
                        json_string(stdout, p->name);
                        printf(",\"host_id\":");
                        json_string(stdout, p->host_id);
                        printf(",\"address\":");
                        json_string(stdout, p->address);
                        printf(",\"state\":");
                        json_string(stdout, p->state);
                        printf(",\"transport\":");
                        json_string(stdout, p->transport);
                        printf(",\"interface\":");
                        json_string(stdout, p->interface);
                        printf(",\"path_reason\":");
                        json_string(stdout, p->path_reason);
                        printf(",\"streams\":%" PRIu32 ",\"connects\":%" PRIu64 ",\"disconnects\":%" PRIu64,
                               p->streams, p->connects, p->disconnects);
                        if (p->last_frame_usec_ago != UINT64_MAX)
                                printf(",\"last_frame_usec_ago\":%" PRIu64, p->last_frame_usec_ago);
                        printf(",\"last_error\":");
                        json_string(stdout, p->last_error);
                        if (mb) {
                                printf(",\"source\":");
                                json_string(stdout, mb->source);
                                printf(",\"lease\":");
                                json_string(stdout, mb->lease);
                                printf(",\"share_permille\":%" PRIu32 ",\"published_here\":%" PRIu64,
                                       mb->share_permille, mb->published_here);
                        }
                        printf("}");
                } else {
                        char age[32] = "-";
                        if (p->last_frame_usec_ago != UINT64_MAX)
                                snprintf(age, sizeof age, "%" PRIu64 "ms ago", p->last_frame_usec_ago / 1000);
                        char share[16] = "-";
                        if (mb)
                                snprintf(share, sizeof share, "%.1f%%", mb->share_permille / 10.0);
                        printf("%-12s %-16s %-22s %-14s %-9s %-7" PRIu32 " %-10s %-12s %-7s %-8s %6s\n", p->name,
                               p->host_id, p->address, p->state, p->transport, p->streams,
                               p->interface[0] ? p->interface : "-", age, mb ? mb->source : "-",
                               mb ? mb->lease : "-", share);
                        printf("  path: %s\n", p->path_reason);
                        if (p->last_error[0])
                                printf("  last error: %s\n", p->last_error);
                }
        }
        if (arg_json)
                printf("]\n");
        epd_peers_free(peers, n);
        epd_members_free(members, n_members);
        epd_cluster_done(&cl);
        return 0;
}
