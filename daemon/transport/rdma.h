/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* RDMA over libibverbs: device discovery and the transport behind transport.h. Built
 * from rdma.c with libibverbs, from rdma-noverbs.c without it (which finds no devices
 * and has no transport). See docs/rdma.md.
 *
 * The transport: one protection domain per device (opened when a peer first needs
 * it), each host arena registered once per device (ibv_reg_mr), one RC queue pair per
 * peer set up over the peer's control connection (rdma-proto.h), RDMA WRITE of slices
 * with a bounded number of work requests outstanding per QP, the last slice of a write
 * WITH_IMM so that the receiver learns, in QP order, that every byte landed. The
 * receiver validates each write (the peer manager's incoming validator) before it
 * grants the range. The completion channel's fd, the async event fd and an inotify
 * watch on /dev/infiniband are sd-event sources. The session logic (faults, drain,
 * fallback) is rdma-session.h. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "transport/rdma-select.h"
#include "transport/transport-peer.h"
#include "transport/transport.h"


/* Whether this build carries the RDMA data path (RDMA WRITE between peers). */
extern const bool rdma_data_path_built;

/* Lists the RDMA ports of this host and the netdev each carries: the devices come from
 * ibv_get_device_list, the netdevs from sysfs (gid_attrs/ndevs), the port state from
 * ibv_query_port. Logs "no RDMA devices" (info) when there are none, and nothing on the
 * next calls unless the answer changes (*logged_none carries that between calls); the
 * caller logs the links it found when they change.
 * Returns the number of links or a negative errno. */
int rdma_discover(RdmaLink *links, size_t max, bool *logged_none);

/* The RDMA port this host would use towards p, with the source address of its route
 * (to pick the GID); 0, or a negative errno when the policy, the route or the port
 * rules RDMA out. Provided by topology.c. */
typedef int (*RdmaLinkLookup)(Peer *p, RdmaLink *ret, char *src, size_t src_size, void *userdata);
/* The choice of some peer may have changed (topology re-resolves its paths). */
typedef void (*RdmaChanged)(void *userdata);

/* -EOPNOTSUPP without libibverbs. Registers its handler for the 0x0400 message range
 * and a peer state handler through peers (copied). */
int rdma_transport_new(Transport **ret, sd_event *e, const TransportPeerOps *peers, uint32_t slice_size);
void rdma_transport_set_topology(Transport *t, RdmaLinkLookup lookup, RdmaChanged changed, void *userdata);
/* Re-checks every peer against the current links (a route or port changed). */
void rdma_transport_links_changed(Transport *t);

typedef struct RdmaPeerInfo {
        bool announced;          /* the peer's CONNECT of this session came */
        bool remote_rdma;        /* ... offering a QP */
        bool ready;              /* the QPs are connected: writes go over RDMA */
        const char *state;       /* rdma-session state */
        char device[RDMA_NAME_MAX]; /* the peer's device, "" if none */
        char failure[160];       /* why RDMA to this peer is off, "" if it is not */
        uint64_t bytes, writes;  /* moved to this peer over RDMA */
} RdmaPeerInfo;
/* Fills info (all zero when t is NULL or does not know p). */
void rdma_transport_peer_info(Transport *t, Peer *p, RdmaPeerInfo *info);
bool rdma_transport_peer_ready(Transport *t, Peer *p);
