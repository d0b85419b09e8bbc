/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* RDMA device discovery from sysfs and the per-peer transport choice. Pure: no verbs
 * calls, no sockets; sysfs is read from a root directory the caller names, so the unit
 * test builds a fake tree. transport/rdma.c adds what only libibverbs knows.
 *
 * The choice (rdma_select) for one peer:
 *   Transport=tcp   -> tcp, always.
 *   Transport=auto  -> rdma when this host has an ACTIVE RDMA port on the interface that
 *                      routes to the peer AND the peer announced an RDMA port on its route
 *                      back AND this build has the RDMA data path; tcp otherwise.
 *   Transport=rdma  -> as auto, but a peer that cannot use RDMA is logged as a warning
 *                      (the reason says "forced"); it still falls back to tcp, so a
 *                      misconfigured cluster degrades instead of stopping.
 * The reason string always says which condition decided. */

#include <net/if.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "transport/transport.h"

#define RDMA_NAME_MAX 64
#define RDMA_MAX_LINKS 64
#define RDMA_MAX_GID_INDEX 16

typedef enum TransportPolicy {
        TRANSPORT_POLICY_AUTO,
        TRANSPORT_POLICY_TCP,
        TRANSPORT_POLICY_RDMA,
        _TRANSPORT_POLICY_MAX,
} TransportPolicy;

const char *transport_policy_to_string(TransportPolicy p);
/* Returns the policy or -EINVAL. */
int transport_policy_from_string(const char *s);

/* One (device, port, netdev) triple: an RDMA port and a network interface it carries
 * (RoCE/soft-RoCE: the netdev of a GID; InfiniBand: the IPoIB interface). */
typedef struct RdmaLink {
        char device[RDMA_NAME_MAX];
        uint8_t port;                /* 1-based, as verbs numbers ports */
        char netdev[IF_NAMESIZE];
        int gid_index;               /* first GID index that names this netdev */
        bool active;                 /* port state ACTIVE */
        char state[24];              /* the port state as sysfs spells it ("ACTIVE") */
} RdmaLink;

/* Reads <root>/class/infiniband/<dev>/ports/<p>/{state,gid_attrs/ndevs/<i>} into links
 * (at most max, one per distinct netdev of a port). root is normally "/sys". Returns the
 * number of links found (0 when there is no RDMA device), or a negative errno. */
int rdma_links_from_sysfs(const char *root, RdmaLink *links, size_t max);

/* Parses a sysfs port state line ("4: ACTIVE"). Returns true when ACTIVE; copies the
 * name after the colon into state. */
bool rdma_parse_port_state(const char *line, char *state, size_t n);

/* The link that carries netdev ifname, preferring an ACTIVE one; NULL if none. */
const RdmaLink *rdma_link_for_netdev(const RdmaLink *links, size_t n, const char *ifname);

typedef struct RdmaSelectInput {
        TransportPolicy policy;
        bool rdma_built;             /* this build has the RDMA data path */
        size_t n_links;              /* RDMA links on this host (0: "no RDMA devices") */
        const char *ifname;          /* interface routing to the peer; "" or NULL if none */
        const RdmaLink *local;       /* rdma_link_for_netdev(ifname) or NULL */
        bool peer_announced;         /* the peer told us about its side */
        bool peer_rdma;              /* ... and has an ACTIVE RDMA port on its route to us */
        const char *peer_device;     /* its device name, for the reason (may be NULL) */
        const char *failure;         /* non-NULL: RDMA to this peer failed (device gone,
                                      * port down, QP error); stays tcp until cleared */
} RdmaSelectInput;

/* Returns TRANSPORT_RDMA or TRANSPORT_TCP and writes why into reason. *warn is set when
 * the configuration asked for RDMA and did not get it. */
TransportKind rdma_select(const RdmaSelectInput *in, char *reason, size_t n, bool *warn);
