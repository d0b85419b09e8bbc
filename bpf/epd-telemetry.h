/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Shared between bpf/epd-telemetry.bpf.c and user space (daemon/telemetry*.c, epdtop):
 * the layouts of the pinned maps and of the ring-buffer events. Every field has a fixed
 * width, so that the same bytes read the same on both sides. Bump EPD_TELEMETRY_ABI when
 * a layout changes: the daemon writes it in the "settings" map
 * (daemon/telemetry/telemetry-bpf.c), the programs in every ring event, and readers
 * refuse another one (telemetry_event_decode(); epdtop's reader of the pins,
 * tools/epdtop-pins.c, which also refuses a pinned map whose type, key or value size is
 * not the one below before reading it). */

#ifndef __VMLINUX_H__
#include <linux/types.h>
#endif

#define EPD_TELEMETRY_ABI 1
#define EPD_TELEMETRY_MAX_CONNS 4096
#define EPD_TELEMETRY_PEER_MAX 32           /* peer name, NUL included */
#define EPD_TELEMETRY_RINGBUF_BYTES (256 * 1024)
#define EPD_TELEMETRY_PIN_DIR "/sys/fs/bpf/epd"

/* Value of the "tracked" map (key: socket cookie, __u64). Written by the daemon when
 * it opens a peer connection; only sockets in this map are observed. */
struct epd_conn_info {
        __u32 peer_id;                      /* daemon's index of the peer */
        __u32 flags;
        char peer[EPD_TELEMETRY_PEER_MAX];  /* peer name, for tools reading pins */
};

/* Value of the "conns" map (key: socket cookie): what the kernel saw of one tracked
 * connection. Counters are totals since the socket was tracked; the reader computes
 * rates from deltas. */
struct epd_conn_stats {
        __u64 cookie;
        __u32 peer_id;
        __u32 state;            /* TCP_ESTABLISHED, ... (last seen) */
        __u32 srtt_us;          /* smoothed RTT */
        __u32 min_rtt_us;       /* windowed minimum RTT (tcp_sock.rtt_min) */
        __u32 mdev_us;          /* RTT mean deviation */
        __u32 snd_cwnd;         /* congestion window, segments */
        __u32 snd_ssthresh;
        __u32 packets_out;      /* segments in flight */
        __u32 retrans_out;
        __u32 lost_out;
        __u32 total_retrans;    /* tcp_sock.total_retrans */
        __u32 send_queue;       /* write_seq - snd_una: bytes queued, not yet acked */
        __u32 inflight_bytes;   /* snd_nxt - snd_una */
        __u32 mss;
        __u64 bytes_sent;       /* tcp_sock.bytes_sent (includes retransmits) */
        __u64 bytes_acked;
        __u64 bytes_received;
        __u64 bytes_retrans;
        __u64 segs_out;
        __u64 retransmit_events; /* tcp:tcp_retransmit_skb hits */
        __u64 probes;            /* tcp:tcp_probe hits (ACKs processed) */
        __u64 first_ns;          /* bpf_ktime_get_ns() when first seen */
        __u64 last_probe_ns;
        __u64 last_retrans_ns;
        __u64 last_event_ns;     /* last SAMPLE pushed to the ring (rate limit) */
};

enum epd_event_type {
        EPD_EVENT_SAMPLE = 1,     /* periodic RTT/cwnd/queue sample, rate-limited */
        EPD_EVENT_RETRANSMIT = 2, /* a segment was retransmitted */
        EPD_EVENT_STATE = 3,      /* TCP state change (e.g. ESTABLISHED -> CLOSE) */
        _EPD_EVENT_MAX,
};

/* One ring-buffer record. */
struct epd_event {
        __u16 abi;
        __u16 type;               /* enum epd_event_type */
        __u32 peer_id;
        __u64 cookie;
        __u64 ts_ns;
        __u32 srtt_us;
        __u32 min_rtt_us;
        __u32 snd_cwnd;
        __u32 send_queue;
        __u32 inflight_bytes;
        __u32 total_retrans;
        __u32 old_state;
        __u32 new_state;
        __u64 bytes_acked;
        __u64 bytes_sent;
};

/* The "settings" array map, one entry, written by the daemon. */
struct epd_telemetry_config {
        __u64 sample_interval_ns; /* at most one SAMPLE per connection per interval */
        __u32 wakeup_bytes;       /* wake the reader when this much is queued */
        __u32 abi;
};

/* Per-CPU counters ("counters" map, index = enum epd_counter). */
enum epd_counter {
        EPD_COUNTER_EVENTS = 0,
        EPD_COUNTER_DROPPED = 1,  /* ring full */
        EPD_COUNTER_PROBES = 2,
        _EPD_COUNTER_MAX,
};
