/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Topology: which interface routes to each peer (libnl-route, RTM_GETROUTE), tracked
 * as links, addresses and routes change (an rtnetlink multicast socket as an sd-event
 * source); which NIC sits nearest each GPU (sysfs: PCIe path, NUMA node); and the path
 * chosen per peer with the reason, shown by `epdctl peers` and on org.epd1.Peer.
 *
 * A member that left the cluster membership (peer_is_retired()) keeps its Peer, and so a
 * path, but is not resolved: its path says it left, and the kernel is asked about it
 * again at the first refresh after it comes back. A refresh thus costs netlink work per
 * live peer, not per peer ever known. */

#include <net/if.h>
#include <stdbool.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "peer/peer-proto.h"
#include "peer/topology-pci.h"
#include "transport/transport.h"

typedef struct Topology Topology;
typedef struct PeerManager PeerManager;

typedef struct TopologyPath {
        char host_id[PEER_HOST_ID_MAX + 1];
        char ifname[IF_NAMESIZE];   /* "" while there is no route */
        int ifindex;
        char src[64];               /* preferred source address */
        char gateway[64];           /* "" when directly connected */
        bool link_up;
        int numa_node;              /* of the NIC; -1 unknown or virtual */
        char pci[32];               /* the NIC's PCI address; "" if virtual */
        char rdma[TOPO_NAME_MAX];   /* RDMA device on that NIC, "" if none */
        TransportKind transport;
        char reason[384];
        uint64_t changes;           /* times the interface or its state changed */
        bool retired;               /* a member that left: not resolved (no interface) */
} TopologyPath;

typedef struct TopologyGpu {
        char pci[32];
        int numa_node;
        char nic[IF_NAMESIZE];      /* nearest NIC, "" if none */
        char reason[256];
} TopologyGpu;

/* pm may be NULL (GPU/NIC discovery only). */
int topology_new(Topology **ret, sd_event *e, PeerManager *pm);
Topology *topology_free(Topology *t);
/* [Cluster] Transport= (TransportPolicy, rdma-select.h); re-resolves every path. */
void topology_set_transport_policy(Topology *t, int policy);
/* Re-resolves the path of every peer but retired members now (also done on every
 * rtnetlink change). */
int topology_refresh(Topology *t);
/* The same, once a burst of changes is over (a short timer, re-armed by each call): for
 * callers that may come many times in a row (members joining at a resync). */
void topology_refresh_soon(Topology *t);
/* The path to a peer as of the last refresh (by host id, O(1)); NULL before the first
 * refresh that knew the peer, or without topology. */
const TopologyPath *topology_path(Topology *t, const char *host_id);
/* Paths the last refresh resolved (asked the kernel about): the peers that were not
 * retired members then. */
size_t topology_paths_resolved(Topology *t);
size_t topology_n_gpus(Topology *t);
const TopologyGpu *topology_gpu(Topology *t, size_t i);
