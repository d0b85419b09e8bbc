/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* RDMA over libibverbs: device discovery (this file's first part) and, later, the
 * transport behind transport.h. Built from rdma.c with libibverbs, from rdma-noverbs.c
 * without it (which finds no devices). See docs/rdma.md. */

#include <stdbool.h>
#include <stddef.h>

#include "rdma-select.h"

/* Whether this build carries the RDMA data path (RDMA WRITE between peers). */
extern const bool rdma_data_path_built;

/* Lists the RDMA ports of this host and the netdev each carries: the devices come from
 * ibv_get_device_list, the netdevs from sysfs (gid_attrs/ndevs), the port state from
 * ibv_query_port. Logs "no RDMA devices" (info) when there are none, and nothing on the
 * next calls unless the answer changes (*logged_none carries that between calls); the
 * caller logs the links it found when they change.
 * Returns the number of links or a negative errno. */
int rdma_discover(RdmaLink *links, size_t max, bool *logged_none);
