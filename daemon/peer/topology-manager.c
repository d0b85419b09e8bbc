/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>

#include "log.h"
#include "peer/topology-manager.h"
#include "peer/topology.h"

static int topology_init(Manager *m) {
        Topology *t;
        int r;

        /* After the peer subsystem in the start order: paths are per peer. */
        r = topology_new(&t, m->event, m->peers);
        if (r == -EOPNOTSUPP) {
                log_info("topology: built without libnl; the path to each peer is the kernel's default route");
                return 0;
        }
        if (r < 0) {
                /* Topology informs choices; without it everything still runs over tcp. */
                log_warning_errno(r, "topology: unavailable, peers use tcp on the default route: %m");
                return 0;
        }
        m->topology = t;
        topology_set_transport_policy(t, m->config.transport_policy);
        return 0;
}

static void topology_done(Manager *m) {
        m->topology = topology_free(m->topology);
}

const Subsystem topology_subsystem = {
        .name = "topology",
        .init = topology_init,
        .done = topology_done,
};
