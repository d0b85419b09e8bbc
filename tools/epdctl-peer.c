/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl peers: the other hosts, their state, and the path to each with its reason. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "epdctl.h"

int verb_peers(epd_client *c, int argc, char **argv) {
        epd_peer *peers = NULL;
        size_t n = 0;
        int r;

        r = epd_list_peers(c, &peers, &n);
        if (r < 0)
                return epdctl_fail(c, r, "peers");
        if (arg_json)
                printf("[");
        else if (n == 0)
                printf("No peers configured.\n");
        else
                printf("%-12s %-16s %-22s %-14s %-9s %-7s %-10s %s\n", "NAME", "HOST_ID", "ADDRESS", "STATE",
                       "TRANSPORT", "STREAMS", "INTERFACE", "LAST_FRAME");
        for (size_t i = 0; i < n; i++) {
                epd_peer *p = peers + i;
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
                        printf("}");
                } else {
                        char age[32] = "-";
                        if (p->last_frame_usec_ago != UINT64_MAX)
                                snprintf(age, sizeof age, "%" PRIu64 "ms ago", p->last_frame_usec_ago / 1000);
                        printf("%-12s %-16s %-22s %-14s %-9s %-7" PRIu32 " %-10s %s\n", p->name, p->host_id,
                               p->address, p->state, p->transport, p->streams,
                               p->interface[0] ? p->interface : "-", age);
                        printf("  path: %s\n", p->path_reason);
                        if (p->last_error[0])
                                printf("  last error: %s\n", p->last_error);
                }
        }
        if (arg_json)
                printf("]\n");
        epd_peers_free(peers, n);
        return 0;
}
