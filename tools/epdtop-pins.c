/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <bpf/bpf.h>

#include "bpf/epd-telemetry.h"
#include "epdtop-pins.h"
#include "macro.h"

static int open_pin(const char *dir, const char *name) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, name);
        int fd = bpf_obj_get(path);
        return fd < 0 ? (errno > 0 ? -errno : fd) : fd;
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

int top_pins_read(const char *dir, TopSnapshot *s) {
        _cleanup_(closep) int tracked = -EBADF, conns = -EBADF;

        tracked = open_pin(dir, "tracked");
        if (tracked < 0)
                return tracked;
        conns = open_pin(dir, "conns");
        if (conns < 0)
                return conns;

        /* Rows from the bus get fresh kernel numbers: reset what we will sum. */
        for (size_t i = 0; i < s->n_peers; i++) {
                TopPeer *p = &s->peers[i];
                p->conns = 0;
                p->srtt_us = p->min_rtt_us = p->cwnd = 0;
                p->bytes_acked = p->bytes_sent = p->retransmits = p->send_queue = 0;
        }

        /* The keys first, each once: bpf_map_get_next_key() starts again from the first
         * key when the previous one was deleted meanwhile (a connection untracked while
         * we read), and the keys it gives again would count twice. Each such restart
         * gives the keys seen so far again, hence the bound of twice the map's size. */
        _cleanup_(freep) uint64_t *keys = malloc(2 * EPD_TELEMETRY_MAX_CONNS * sizeof *keys);
        if (!keys)
                return -ENOMEM;
        size_t n = 0;
        uint64_t next, *prev = NULL;
        while (n < 2 * EPD_TELEMETRY_MAX_CONNS && bpf_map_get_next_key(tracked, prev, &next) == 0) {
                keys[n] = next;
                prev = &keys[n++];
        }
        qsort(keys, n, sizeof *keys, cmp_u64);
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
                if (k == 0 || keys[i] != keys[k - 1])
                        keys[k++] = keys[i];
        n = k;

        for (size_t i = 0; i < n; i++) {
                const uint64_t key = keys[i];
                struct epd_conn_info info;
                struct epd_conn_stats st;
                if (bpf_map_lookup_elem(tracked, &key, &info) < 0)
                        continue; /* untracked since */
                info.peer[sizeof info.peer - 1] = '\0';
                const char *name = info.peer[0] ? info.peer : "?";
                /* The map keeps the first EPD_TELEMETRY_PEER_MAX - 1 characters of the
                 * host id; the bus gave the whole one. */
                TopPeer *p = top_snapshot_find_pinned_peer(s, name, EPD_TELEMETRY_PEER_MAX - 1);
                if (!p) {
                        p = top_snapshot_add_peer(s);
                        if (!p)
                                return -ENOMEM;
                        snprintf(p->name, sizeof p->name, "%s", name);
                        snprintf(p->reason, sizeof p->reason, "%s", "-");
                }
                p->kernel = true;
                p->conns++;
                if (bpf_map_lookup_elem(conns, &key, &st) < 0)
                        continue; /* nothing seen on it yet */
                p->srtt_us = MAX(p->srtt_us, st.srtt_us);
                if (st.min_rtt_us && st.min_rtt_us != UINT32_MAX && (!p->min_rtt_us || st.min_rtt_us < p->min_rtt_us))
                        p->min_rtt_us = st.min_rtt_us;
                p->cwnd += st.snd_cwnd;
                p->bytes_acked += st.bytes_acked;
                p->bytes_sent += st.bytes_sent;
                p->retransmits += st.total_retrans;
                p->send_queue += st.send_queue;
        }
        s->pins = true;
        return 0;
}
