/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Built without libcurl and json-c: [Cluster] Etcd= is refused, with the reason; the
 * static peers of [Peer:NAME] work as before. */
#include <errno.h>

#include "cluster/cluster-manager.h"
#include "log.h"

int cluster_etcd_start(ClusterManager *cm) {
        return log_error_errno(EOPNOTSUPP, "cluster: [Cluster] Etcd= needs epdd built with libcurl and json-c");
}

void cluster_etcd_stop(ClusterManager *cm) {
}

void cluster_etcd_register_again(ClusterManager *cm) {
}
