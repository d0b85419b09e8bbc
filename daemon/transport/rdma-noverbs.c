/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Built instead of rdma.c without libibverbs: there are no RDMA devices to use. */
#include <errno.h>
#include <string.h>

#include "log.h"
#include "transport/rdma.h"

const bool rdma_data_path_built = false;

int rdma_discover(RdmaLink *links, size_t max, bool *logged_none) {
        if (logged_none && !*logged_none) {
                log_info("rdma: no RDMA devices (built without libibverbs); peers use tcp");
                *logged_none = true;
        }
        return 0;
}

int rdma_transport_new(Transport **ret, sd_event *e, const TransportPeerOps *peers, uint32_t slice_size) {
        return -EOPNOTSUPP;
}

void rdma_transport_set_topology(Transport *t, RdmaLinkLookup lookup, RdmaChanged changed, void *userdata) {
}

void rdma_transport_links_changed(Transport *t) {
}

void rdma_transport_peer_info(Transport *t, Peer *p, RdmaPeerInfo *info) {
        memset(info, 0, sizeof *info);
}

bool rdma_transport_peer_ready(Transport *t, Peer *p) {
        return false;
}
