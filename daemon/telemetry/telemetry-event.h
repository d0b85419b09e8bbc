/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Decoding of what the BPF side produces (ring-buffer records, "conns" map values) and
 * the per-peer aggregation of connection records. Pure: the bytes come in as a buffer,
 * so tests build events by hand and fuzzers feed arbitrary ones. */

#include <stddef.h>
#include <stdint.h>

#include "bpf/epd-telemetry.h"
#include "time-util.h"

typedef enum TelemetryEventType {
        TELEMETRY_EVENT_SAMPLE = EPD_EVENT_SAMPLE,
        TELEMETRY_EVENT_RETRANSMIT = EPD_EVENT_RETRANSMIT,
        TELEMETRY_EVENT_STATE = EPD_EVENT_STATE,
} TelemetryEventType;

typedef struct TelemetryEvent {
        TelemetryEventType type;
        uint32_t peer_id;
        uint64_t cookie;
        uint64_t ts_nsec;         /* CLOCK_MONOTONIC (bpf_ktime_get_ns) */
        uint32_t srtt_usec, min_rtt_usec;
        uint32_t cwnd;
        uint32_t send_queue, inflight;
        uint32_t total_retrans;
        uint32_t old_state, new_state;
        uint64_t bytes_acked, bytes_sent;
} TelemetryEvent;

/* Returns 0 and fills *ret, or -EBADMSG (short, wrong ABI, unknown type, state out of
 * range). Never reads beyond size. */
int telemetry_event_decode(const void *data, size_t size, TelemetryEvent *ret);

/* Whether a TCP state (TCP_ESTABLISHED=1 ... TCP_NEW_SYN_RECV=12) means the connection
 * is gone or going (FIN_WAIT*, TIME_WAIT, CLOSE, CLOSE_WAIT, LAST_ACK, CLOSING). */
int tcp_state_is_closing(uint32_t state);
const char *tcp_state_to_string(uint32_t state);

/* The kernel's view of one peer path: the sum or worst of its tracked connections. */
typedef struct TelemetryPathStats {
        unsigned n_conns;
        unsigned n_established;
        uint32_t srtt_usec;       /* max over connections */
        uint32_t min_rtt_usec;    /* min over connections (nonzero ones) */
        uint32_t cwnd;            /* sum */
        uint64_t bytes_sent, bytes_acked, bytes_received, bytes_retrans;
        uint64_t segs_out;
        uint64_t retransmits;     /* sum of total_retrans */
        uint64_t send_queue;      /* sum */
        uint64_t inflight;        /* sum */
        uint64_t last_probe_nsec; /* most recent ACK processed */
} TelemetryPathStats;

void telemetry_path_stats_add(TelemetryPathStats *p, const struct epd_conn_stats *c);
