/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd: org.epd1.Peer. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "epd-internal.h"
#include "epd/epd.h"

#define PEER_STRUCT "(sssssssuttts)"

void epd_peers_free(epd_peer *peers, size_t n) {
        if (!peers)
                return;
        for (size_t i = 0; i < n; i++) {
                epd_peer *p = peers + i;
                free(p->name);
                free(p->host_id);
                free(p->address);
                free(p->state);
                free(p->transport);
                free(p->interface);
                free(p->path_reason);
                free(p->last_error);
        }
        free(peers);
}

int epd_list_peers(epd_client *c, epd_peer **ret, size_t *ret_n) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        epd_peer *peers = NULL;
        size_t n = 0;
        int r;

        if (!c || !ret || !ret_n)
                return epd__error(c, -EINVAL, NULL);
        epd__clear_error(c);
        r = sd_bus_call_method(c->bus, EPD_DESTINATION(c), "/org/epd1/peer", "org.epd1.Peer", "ListPeers", &e,
                               &reply, NULL);
        if (r < 0) {
                r = epd__error(c, r, &e);
                sd_bus_error_free(&e);
                return r;
        }
        r = sd_bus_message_enter_container(reply, 'a', PEER_STRUCT);
        while (r >= 0) {
                const char *name, *host, *addr, *state, *transport, *iface, *reason, *err;
                uint32_t streams;
                uint64_t age, connects, disconnects;
                epd_peer *np;

                r = sd_bus_message_read(reply, PEER_STRUCT, &name, &host, &addr, &state, &transport, &iface,
                                        &reason, &streams, &age, &connects, &disconnects, &err);
                if (r <= 0)
                        break;
                np = realloc(peers, (n + 1) * sizeof *np);
                if (!np) {
                        r = -ENOMEM;
                        break;
                }
                peers = np;
                peers[n] = (epd_peer){
                        .name = strdup(name), .host_id = strdup(host), .address = strdup(addr),
                        .state = strdup(state), .transport = strdup(transport), .interface = strdup(iface),
                        .path_reason = strdup(reason), .streams = streams, .last_frame_usec_ago = age,
                        .connects = connects, .disconnects = disconnects, .last_error = strdup(err),
                };
                n++;
                if (!peers[n - 1].name || !peers[n - 1].host_id || !peers[n - 1].address || !peers[n - 1].state ||
                    !peers[n - 1].transport || !peers[n - 1].interface || !peers[n - 1].path_reason ||
                    !peers[n - 1].last_error) {
                        r = -ENOMEM;
                        break;
                }
        }
        sd_bus_message_unref(reply);
        if (r < 0) {
                epd_peers_free(peers, n);
                return epd__error(c, r, NULL); /* named (errno.N), as every refusal is */
        }
        *ret = peers;
        *ret_n = n;
        return (int)n;
}
