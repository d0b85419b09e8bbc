/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The topology subsystem: builds the Topology (peer/topology.h) over the peer manager at
 * start, applies [Cluster] Transport=, and frees it at shutdown. */

#include "core/manager.h"

extern const Subsystem topology_subsystem;
