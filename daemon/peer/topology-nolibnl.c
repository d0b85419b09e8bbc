/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Built instead of topology.c without libnl: no route tracking, no GPU/NIC map; peers
 * still work over tcp on whatever route the kernel picks. */
#include <errno.h>

#include "peer/topology.h"

int topology_new(Topology **ret, sd_event *e, PeerManager *pm) {
        return -EOPNOTSUPP;
}
Topology *topology_free(Topology *t) {
        return NULL;
}
void topology_set_transport_policy(Topology *t, int policy) {
}
int topology_refresh(Topology *t) {
        return -EOPNOTSUPP;
}
void topology_refresh_soon(Topology *t) {
}
const TopologyPath *topology_path(Topology *t, const char *host_id) {
        return NULL;
}
size_t topology_paths_resolved(Topology *t) {
        return 0;
}
size_t topology_n_gpus(Topology *t) {
        return 0;
}
const TopologyGpu *topology_gpu(Topology *t, size_t i) {
        return NULL;
}
