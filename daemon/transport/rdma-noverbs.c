/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Built instead of rdma.c without libibverbs: there are no RDMA devices to use. */
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
