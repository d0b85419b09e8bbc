/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The daemon's subsystems in start order (stopped in reverse): one line each.
 * Included by manager.c with SUBSYSTEM() defined; no include guard on purpose. */
SUBSYSTEM(gpu)
SUBSYSTEM(pages)
SUBSYSTEM(feature)
SUBSYSTEM(telemetry)
SUBSYSTEM(peer)
SUBSYSTEM(topology)
SUBSYSTEM(directory)
SUBSYSTEM(cluster)
SUBSYSTEM(handoff)
SUBSYSTEM(scheduler)
SUBSYSTEM(placement)
SUBSYSTEM(workflows)
SUBSYSTEM(wal)
