/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Telemetry: what the kernel sees of epd's own peer connections (through the BPF
 * programs in bpf/, optional), per-peer backpressure from that and from the daemon's
 * own load, and per-request traces. Owned by the Manager (m->telemetry); the BPF ring
 * buffer and the evaluation timer are sd-event sources of the manager's loop.
 *
 * The Telemetry object also works without a Manager (telemetry_new on any sd_event),
 * which tests and benchmarks use. */

#include <stdbool.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "macro.h"
#include "telemetry/backpressure.h"
#include "telemetry/telemetry-config.h"
#include "telemetry/telemetry-event.h"
#include "telemetry/trace.h"

typedef struct Telemetry Telemetry;

#define TELEMETRY_BACKPRESSURE_HANDLERS_MAX 4
/* A peer's name: a host id (HostId=, at most 63 characters). */
#define TELEMETRY_PEER_NAME_MAX 63

/* Called when a peer's backpressure level changes. */
typedef void (*TelemetryBackpressureFn)(Telemetry *t, const char *peer, BackpressureLevel level,
                                        BackpressureReason reason, void *userdata);

/* A peer path as tools and the bus see it. */
/* Counters of a peer's TCP traffic for export: they never go down. Connections that were
 * untracked count with their last values, and one whose kernel record is missing for a
 * moment with the values last seen. */
typedef struct TelemetryPeerTotals {
        uint64_t bytes_sent, bytes_acked, bytes_received, bytes_retrans;
        uint64_t segs_out, retransmits;
} TelemetryPeerTotals;

/* One connection's counters as read from the kernel, carried into its totals: the byte
 * counters are the kernel's 64-bit ones, taken as they are; segs_out and total_retrans
 * are 32-bit in the kernel's tcp_sock (a busy connection wraps segs_out within the
 * hour), so they advance by their difference modulo 2^32 from the last reading (raw_*)
 * and keep growing past a wrap. The first reading (have_raw false) is taken as it is. */
typedef struct TelemetryConnReading {
        TelemetryPeerTotals totals;
        TelemetryPeerTotals base; /* its byte counts when tracked (TCP_INFO): not counted */
        uint32_t raw_segs_out, raw_retrans;
        bool have_raw;
} TelemetryConnReading;

/* Where a connection's counts stand when it is tracked (the kernel counts from the
 * socket's creation): only what follows counts. A socket tracked again (untracked, or
 * under another peer's name) counted its whole history twice. */
void telemetry_conn_reading_start(TelemetryConnReading *r, uint64_t bytes_sent, uint64_t bytes_acked,
                                  uint64_t bytes_received, uint64_t bytes_retrans, uint32_t segs_out,
                                  uint32_t total_retrans);

void telemetry_conn_reading_update(TelemetryConnReading *r, uint64_t bytes_sent, uint64_t bytes_acked,
                                   uint64_t bytes_received, uint64_t bytes_retrans, uint32_t segs_out,
                                   uint32_t total_retrans);
/* kept = the larger of kept and now, field by field: an exported counter never goes down,
 * and one field that cannot move (a connection's record missing for a moment) does not
 * hold the others back. */
void telemetry_totals_merge_max(TelemetryPeerTotals *kept, const TelemetryPeerTotals *now);

typedef struct TelemetryPeerStats {
        const char *name;
        bool kernel;                  /* the kernel fields are valid (BPF loaded) */
        unsigned tracked;             /* connections tracked (path.n_conns: those the
                                       * kernel has reported on yet) */
        TelemetryPathStats path;
        BackpressureLevel level;
        BackpressureReason reason;
        double rtt_inflation;
        double retransmit_rate;
        unsigned handoffs_in_flight;
        uint64_t destination_free_pages, destination_total_pages;
        uint64_t events;              /* ring events seen for this peer */
        TelemetryPeerTotals totals;   /* monotonic: what /metrics exports as counters */
} TelemetryPeerStats;

typedef struct TelemetryCounters {
        bool bpf_loaded;
        const char *bpf_unavailable;  /* why not, or NULL */
        const char *pin_dir;          /* where the maps are pinned, or NULL */
        uint64_t ring_events;         /* decoded */
        uint64_t ring_bad;            /* failed to decode */
        uint64_t ring_wakeups;
        uint64_t kernel_events;       /* from the BPF counters */
        uint64_t kernel_dropped;
        uint64_t kernel_run_nsec;     /* time in the BPF programs (when stats are on) */
        uint64_t kernel_runs;
        unsigned tracked;
        unsigned peers;
        size_t traces;
        uint64_t traces_evicted;
} TelemetryCounters;

int telemetry_new(Telemetry **ret, sd_event *event, const TelemetryConfig *config);
Telemetry *telemetry_free(Telemetry *t);
DEFINE_TRIVIAL_CLEANUP_FUNC(Telemetry *, telemetry_free);

/* Loads the BPF programs when configured; when that is impossible, logs why once and
 * carries on without (returns 0). Starts the evaluation timer. */
int telemetry_start(Telemetry *t);
int telemetry_reconfigure(Telemetry *t, const TelemetryConfig *config);
/* Subscribes fn to every change of a peer's backpressure level (in order of
 * subscription; -ENOSPC past TELEMETRY_BACKPRESSURE_HANDLERS_MAX). */
int telemetry_add_backpressure_handler(Telemetry *t, TelemetryBackpressureFn fn, void *userdata);
void telemetry_remove_backpressure_handler(Telemetry *t, TelemetryBackpressureFn fn, void *userdata);

/* Tracks a connection of the daemon's own (the peer subsystem's) to peer: -EEXIST when
 * the socket is tracked already. */
int telemetry_track(Telemetry *t, int fd, const char *peer);
/* The same for a client's connection (TrackSocket): it stays tracked until untracked,
 * whatever happens to the daemon's own connections to the peer. */
int telemetry_track_client(Telemetry *t, int fd, const char *peer);
int telemetry_untrack(Telemetry *t, int fd);
/* Untracks the daemon's own connections to peer (it went down); clients' stay. */
int telemetry_untrack_all(Telemetry *t, const char *peer);
/* The daemon's own load towards a peer, folded into its backpressure. */
int telemetry_set_peer_load(Telemetry *t, const char *peer, unsigned handoffs_in_flight,
                            uint64_t destination_free_pages, uint64_t destination_total_pages);
int telemetry_get_peer(Telemetry *t, const char *peer, TelemetryPeerStats *ret);
/* Iterates peers: `size_t i = 0; TelemetryPeerStats s; while (telemetry_iterate_peers(t, &i, &s) > 0)`. */
int telemetry_iterate_peers(Telemetry *t, size_t *state, TelemetryPeerStats *ret);
BackpressureLevel telemetry_get_level(Telemetry *t, const char *peer);
/* Re-reads the kernel's records and re-evaluates every peer now. */
int telemetry_evaluate(Telemetry *t);
void telemetry_get_counters(Telemetry *t, TelemetryCounters *ret);

int telemetry_record(Telemetry *t, const char *request_id, TraceEventType type, const TraceDetail *d);
int telemetry_record_n(Telemetry *t, const char *request_id, TraceEventType type, const TraceDetail *d, size_t n);
const TraceRequest *telemetry_get_trace(Telemetry *t, const char *request_id);

