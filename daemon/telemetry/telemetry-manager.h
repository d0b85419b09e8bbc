/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The telemetry subsystem: the daemon's Telemetry object (telemetry.h), built from
 * [Telemetry] and [Backpressure], reconfigured on reload, its backpressure changes sent
 * as the Backpressure signal; and the calls other subsystems make on it through the
 * Manager. */

#include "core/manager.h"
#include "telemetry/telemetry.h"

/* Manager-facing API, used by the peer, handoff and feature code. All are no-ops that
 * return 0 when telemetry is not running. */
int telemetry_track_socket(Manager *m, int fd, const char *peer);
int telemetry_untrack_socket(Manager *m, int fd);
/* Untracks every connection of a peer (by cookie: the fds may be closed already). */
int telemetry_untrack_peer(Manager *m, const char *peer);
int telemetry_peer_stats(Manager *m, const char *peer, TelemetryPeerStats *ret);
int telemetry_peer_load(Manager *m, const char *peer, unsigned handoffs_in_flight,
                        uint64_t destination_free_pages, uint64_t destination_total_pages);
BackpressureLevel telemetry_peer_backpressure(Manager *m, const char *peer);
int telemetry_trace(Manager *m, const char *request_id, TraceEventType type, const TraceDetail *d);
/* n events of one type at once (the layer groups a batch of completions finished). */
int telemetry_trace_n(Manager *m, const char *request_id, TraceEventType type, const TraceDetail *d, size_t n);

extern const Subsystem telemetry_subsystem;
