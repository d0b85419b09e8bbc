/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <string.h>

#include "macro.h"
#include "telemetry/telemetry-event.h"

/* Linux TCP states (include/net/tcp_states.h). */
enum {
        EPD_TCP_ESTABLISHED = 1,
        EPD_TCP_SYN_SENT,
        EPD_TCP_SYN_RECV,
        EPD_TCP_FIN_WAIT1,
        EPD_TCP_FIN_WAIT2,
        EPD_TCP_TIME_WAIT,
        EPD_TCP_CLOSE,
        EPD_TCP_CLOSE_WAIT,
        EPD_TCP_LAST_ACK,
        EPD_TCP_LISTEN,
        EPD_TCP_CLOSING,
        EPD_TCP_NEW_SYN_RECV,
        EPD_TCP_BOUND_INACTIVE,
        _EPD_TCP_MAX,
};

static const char *const tcp_states[_EPD_TCP_MAX] = {
        [EPD_TCP_ESTABLISHED] = "established",
        [EPD_TCP_SYN_SENT] = "syn-sent",
        [EPD_TCP_SYN_RECV] = "syn-recv",
        [EPD_TCP_FIN_WAIT1] = "fin-wait1",
        [EPD_TCP_FIN_WAIT2] = "fin-wait2",
        [EPD_TCP_TIME_WAIT] = "time-wait",
        [EPD_TCP_CLOSE] = "close",
        [EPD_TCP_CLOSE_WAIT] = "close-wait",
        [EPD_TCP_LAST_ACK] = "last-ack",
        [EPD_TCP_LISTEN] = "listen",
        [EPD_TCP_CLOSING] = "closing",
        [EPD_TCP_NEW_SYN_RECV] = "new-syn-recv",
        [EPD_TCP_BOUND_INACTIVE] = "bound-inactive",
};

const char *tcp_state_to_string(uint32_t state) {
        return state < _EPD_TCP_MAX && tcp_states[state] ? tcp_states[state] : "unknown";
}

int tcp_state_is_closing(uint32_t state) {
        switch (state) {
        case EPD_TCP_FIN_WAIT1:
        case EPD_TCP_FIN_WAIT2:
        case EPD_TCP_TIME_WAIT:
        case EPD_TCP_CLOSE:
        case EPD_TCP_CLOSE_WAIT:
        case EPD_TCP_LAST_ACK:
        case EPD_TCP_CLOSING:
                return 1;
        default:
                return 0;
        }
}

int telemetry_event_decode(const void *data, size_t size, TelemetryEvent *ret) {
        struct epd_event e;

        if (!data || !ret || size < sizeof e)
                return -EBADMSG;
        memcpy(&e, data, sizeof e); /* ring records are 8-byte aligned, but be safe */

        if (e.abi != EPD_TELEMETRY_ABI)
                return -EBADMSG;
        if (e.type != EPD_EVENT_SAMPLE && e.type != EPD_EVENT_RETRANSMIT && e.type != EPD_EVENT_STATE)
                return -EBADMSG;
        if (e.old_state >= _EPD_TCP_MAX || e.new_state >= _EPD_TCP_MAX)
                return -EBADMSG;

        *ret = (TelemetryEvent){
                .type = (TelemetryEventType)e.type,
                .peer_id = e.peer_id,
                .cookie = e.cookie,
                .ts_nsec = e.ts_ns,
                .srtt_usec = e.srtt_us,
                .min_rtt_usec = e.min_rtt_us,
                .cwnd = e.snd_cwnd,
                .send_queue = e.send_queue,
                .inflight = e.inflight_bytes,
                .total_retrans = e.total_retrans,
                .old_state = e.old_state,
                .new_state = e.new_state,
                .bytes_acked = e.bytes_acked,
                .bytes_sent = e.bytes_sent,
        };
        return 0;
}

void telemetry_path_stats_add(TelemetryPathStats *p, const struct epd_conn_stats *c) {
        p->n_conns++;
        if (c->state == EPD_TCP_ESTABLISHED)
                p->n_established++;
        p->bytes_sent += c->bytes_sent;
        p->bytes_acked += c->bytes_acked;
        p->bytes_received += c->bytes_received;
        p->bytes_retrans += c->bytes_retrans;
        p->segs_out += c->segs_out;
        p->retransmits += c->total_retrans;
        /* A closed connection (reset, or gone): its queue, window and RTT are the last it
         * had, not the path's (a socket reset with bytes queued kept the path "high" for
         * as long as a client kept it tracked). Its counts stay. */
        if (c->state == EPD_TCP_CLOSE)
                return;
        p->srtt_usec = MAX(p->srtt_usec, c->srtt_us);
        if (c->min_rtt_us > 0 && c->min_rtt_us != UINT32_MAX &&
            (p->min_rtt_usec == 0 || c->min_rtt_us < p->min_rtt_usec))
                p->min_rtt_usec = c->min_rtt_us;
        p->cwnd += c->snd_cwnd;
        p->send_queue += c->send_queue;
        p->inflight += c->inflight_bytes;
        p->last_probe_nsec = MAX(p->last_probe_nsec, c->last_probe_ns);
}
