/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <string.h>

#include "log.h"
#include "macro.h"
#include "transport/rdma.h"

/* The RDMA WRITE path (QPs, MRs, completions) is not in this build yet: discovery and
 * the choice are, so peers report why they use tcp. See docs/rdma.md. */
const bool rdma_data_path_built = false;

int rdma_discover(RdmaLink *links, size_t max, bool *logged_none) {
        RdmaLink sys[RDMA_MAX_LINKS];
        struct ibv_device **list;
        int n_dev = 0, n_sys;
        size_t n = 0;

        list = ibv_get_device_list(&n_dev);
        if (!list) {
                /* ENOSYS: no kernel support (no uverbs); treated as no devices. */
                if (errno != ENOSYS)
                        log_debug("rdma: ibv_get_device_list: %m");
                n_dev = 0;
        }
        n_sys = n_dev > 0 ? rdma_links_from_sysfs("/sys", sys, ELEMENTSOF(sys)) : 0;
        if (n_sys < 0) {
                log_warning_errno(n_sys, "rdma: reading /sys/class/infiniband: %m");
                n_sys = 0;
        }
        for (int d = 0; d < n_dev; d++) {
                const char *name = ibv_get_device_name(list[d]);
                struct ibv_context *ctx;

                if (!name)
                        continue;
                ctx = ibv_open_device(list[d]);
                for (int i = 0; i < n_sys; i++) {
                        struct ibv_port_attr pa;

                        if (strcmp(sys[i].device, name) != 0)
                                continue;
                        if (ctx && ibv_query_port(ctx, sys[i].port, &pa) == 0) {
                                sys[i].active = pa.state == IBV_PORT_ACTIVE;
                                snprintf(sys[i].state, sizeof sys[i].state, "%s",
                                         ibv_port_state_str(pa.state));
                        }
                        if (n < max)
                                links[n++] = sys[i];
                }
                if (ctx)
                        ibv_close_device(ctx);
        }
        if (list)
                ibv_free_device_list(list);

        if (n == 0) {
                if (logged_none && !*logged_none) {
                        if (n_dev > 0)
                                log_info("rdma: no RDMA devices carry a network interface (%d without one); peers use tcp",
                                         n_dev);
                        else
                                log_info("rdma: no RDMA devices; peers use tcp");
                }
                if (logged_none)
                        *logged_none = true;
        } else if (logged_none)
                *logged_none = false;
        return (int)n;
}
