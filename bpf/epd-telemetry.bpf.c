// SPDX-License-Identifier: LGPL-2.1-or-later OR BSD-2-Clause
/* Kernel-side telemetry of epd's own peer connections.
 *
 * Only sockets whose cookie the daemon put into the "tracked" map are observed; every
 * other socket on the host costs one hash lookup and nothing else. For those, three
 * BTF tracepoints keep a per-connection record in "conns" (pinned, so tools read it
 * without the daemon) and push events into a ring buffer that the daemon consumes
 * inside its event loop:
 *   tcp:tcp_probe            every ACK processed in ESTABLISHED: RTT, cwnd, queue
 *   tcp:tcp_retransmit_skb   every retransmitted segment
 *   sock:inet_sock_set_state state changes (a closing connection is reported at once)
 * Samples are rate-limited per connection and do not wake the reader until enough
 * bytes are queued; retransmits and state changes wake it at once. */

#include "vmlinux.h"
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>

#include "epd-telemetry.h"

#define AF_INET 2
#define AF_INET6 10
#define IPPROTO_TCP 6

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct {
        __uint(type, BPF_MAP_TYPE_HASH);
        __uint(max_entries, EPD_TELEMETRY_MAX_CONNS);
        __type(key, __u64);
        __type(value, struct epd_conn_info);
} tracked SEC(".maps");

/* A record created here just after the daemon untracked its socket (the program looked
 * "tracked" up before the delete) is deleted by no untrack: the daemon prunes records
 * of sockets it does not track (telemetry_bpf_prune()). (Not an LRU: its per-CPU free
 * lists evict live records well before the map is full on hosts with many CPUs.) */
struct {
        __uint(type, BPF_MAP_TYPE_HASH);
        __uint(max_entries, EPD_TELEMETRY_MAX_CONNS);
        __type(key, __u64);
        __type(value, struct epd_conn_stats);
} conns SEC(".maps");

struct {
        __uint(type, BPF_MAP_TYPE_RINGBUF);
        __uint(max_entries, EPD_TELEMETRY_RINGBUF_BYTES);
} events SEC(".maps");

struct {
        __uint(type, BPF_MAP_TYPE_ARRAY);
        __uint(max_entries, 1);
        __type(key, __u32);
        __type(value, struct epd_telemetry_config);
} settings SEC(".maps");

struct {
        __uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
        __uint(max_entries, _EPD_COUNTER_MAX);
        __type(key, __u32);
        __type(value, __u64);
} counters SEC(".maps");

static __always_inline void count(__u32 which) {
        __u64 *v = bpf_map_lookup_elem(&counters, &which);
        if (v)
                (*v)++;
}

static __always_inline struct epd_conn_stats *conn_lookup(const struct sock *sk, __u64 *ret_cookie,
                                                          __u32 *ret_peer) {
        /* Read the cookie, do not create one: bpf_get_socket_cookie() would assign a
         * cookie (an atomic on a global counter) to every socket on the host that
         * passes here. Tracked sockets always have one: the daemon asked SO_COOKIE. */
        __u64 cookie = (__u64)BPF_CORE_READ(sk, __sk_common.skc_cookie.counter);
        if (cookie == 0)
                return NULL;
        struct epd_conn_info *info = bpf_map_lookup_elem(&tracked, &cookie);
        if (!info)
                return NULL;

        *ret_cookie = cookie;
        *ret_peer = info->peer_id;

        struct epd_conn_stats *st = bpf_map_lookup_elem(&conns, &cookie);
        if (st)
                return st;

        struct epd_conn_stats zero = {
                .cookie = cookie,
                .peer_id = info->peer_id,
                .first_ns = bpf_ktime_get_ns(),
        };
        bpf_map_update_elem(&conns, &cookie, &zero, BPF_NOEXIST);
        return bpf_map_lookup_elem(&conns, &cookie);
}

static __always_inline void fill_from_tcp(struct epd_conn_stats *st, const struct sock *sk) {
        struct tcp_sock *tp = bpf_skc_to_tcp_sock((void *)sk);
        if (!tp)
                return;

        st->state = BPF_CORE_READ(sk, __sk_common.skc_state);
        st->srtt_us = tp->srtt_us >> 3;
        st->mdev_us = tp->mdev_us >> 2;
        st->min_rtt_us = tp->rtt_min.s[0].v;
        st->snd_cwnd = tp->snd_cwnd;
        st->snd_ssthresh = tp->snd_ssthresh;
        st->packets_out = tp->packets_out;
        st->retrans_out = tp->retrans_out;
        st->lost_out = tp->lost_out;
        st->total_retrans = tp->total_retrans;
        st->send_queue = tp->write_seq - tp->snd_una;
        st->inflight_bytes = tp->snd_nxt - tp->snd_una;
        st->mss = tp->mss_cache;
        st->bytes_sent = tp->bytes_sent;
        st->bytes_acked = tp->bytes_acked;
        st->bytes_received = tp->bytes_received;
        st->bytes_retrans = tp->bytes_retrans;
        st->segs_out = tp->segs_out;
}

static __always_inline __u64 wakeup_flag(const struct epd_telemetry_config *cfg, bool urgent) {
        if (urgent)
                return BPF_RB_FORCE_WAKEUP;
        __u32 threshold = cfg ? cfg->wakeup_bytes : 0;
        if (threshold == 0)
                return 0;
        return bpf_ringbuf_query(&events, BPF_RB_AVAIL_DATA) >= threshold ? BPF_RB_FORCE_WAKEUP
                                                                         : BPF_RB_NO_WAKEUP;
}

static __always_inline void emit(const struct epd_conn_stats *st, __u16 type, __u64 now,
                                 __u32 old_state, __u32 new_state, bool urgent) {
        __u32 zero = 0;
        struct epd_telemetry_config *cfg = bpf_map_lookup_elem(&settings, &zero);

        struct epd_event *e = bpf_ringbuf_reserve(&events, sizeof(*e), 0);
        if (!e) {
                count(EPD_COUNTER_DROPPED);
                return;
        }
        e->abi = EPD_TELEMETRY_ABI;
        e->type = type;
        e->peer_id = st->peer_id;
        e->cookie = st->cookie;
        e->ts_ns = now;
        e->srtt_us = st->srtt_us;
        e->min_rtt_us = st->min_rtt_us;
        e->snd_cwnd = st->snd_cwnd;
        e->send_queue = st->send_queue;
        e->inflight_bytes = st->inflight_bytes;
        e->total_retrans = st->total_retrans;
        e->old_state = old_state;
        e->new_state = new_state;
        e->bytes_acked = st->bytes_acked;
        e->bytes_sent = st->bytes_sent;
        bpf_ringbuf_submit(e, wakeup_flag(cfg, urgent));
        count(EPD_COUNTER_EVENTS);
}

SEC("tp_btf/tcp_probe")
int BPF_PROG(epd_tcp_probe, struct sock *sk, const struct sk_buff *skb) {
        __u64 cookie;
        __u32 peer;
        struct epd_conn_stats *st = conn_lookup(sk, &cookie, &peer);
        if (!st)
                return 0;

        __u64 now = bpf_ktime_get_ns();
        fill_from_tcp(st, sk);
        st->probes++;
        st->last_probe_ns = now;
        count(EPD_COUNTER_PROBES);

        __u32 zero = 0;
        struct epd_telemetry_config *cfg = bpf_map_lookup_elem(&settings, &zero);
        __u64 interval = cfg ? cfg->sample_interval_ns : 0;
        if (interval == 0 || now - st->last_event_ns >= interval) {
                st->last_event_ns = now;
                emit(st, EPD_EVENT_SAMPLE, now, st->state, st->state, false);
        }
        return 0;
}

SEC("tp_btf/tcp_retransmit_skb")
int BPF_PROG(epd_tcp_retransmit, const struct sock *sk, const struct sk_buff *skb) {
        __u64 cookie;
        __u32 peer;
        struct epd_conn_stats *st = conn_lookup(sk, &cookie, &peer);
        if (!st)
                return 0;

        __u64 now = bpf_ktime_get_ns();
        fill_from_tcp(st, sk);
        st->retransmit_events++;
        st->last_retrans_ns = now;
        emit(st, EPD_EVENT_RETRANSMIT, now, st->state, st->state, true);
        return 0;
}

SEC("tp_btf/inet_sock_set_state")
int BPF_PROG(epd_sock_set_state, const struct sock *sk, const int oldstate, const int newstate) {
        if (BPF_CORE_READ(sk, sk_protocol) != IPPROTO_TCP)
                return 0;

        __u64 cookie;
        __u32 peer;
        struct epd_conn_stats *st = conn_lookup(sk, &cookie, &peer);
        if (!st)
                return 0;

        __u64 now = bpf_ktime_get_ns();
        fill_from_tcp(st, sk);
        st->state = newstate;
        emit(st, EPD_EVENT_STATE, now, oldstate, newstate, true);
        return 0;
}
