/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdarg.h>
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

/* What epdtop reads of a pinned map: the layout of bpf/epd-telemetry.h. The kernel
 * writes a map's own key and value sizes (a per-CPU map's value once per CPU) into the
 * buffers a lookup or a walk is given: a map of another layout (an epdd of another
 * version still running after an upgrade, another program's maps under --pins=DIR)
 * must not be read into ours. */
typedef struct PinLayout {
        const char *name;
        uint32_t type, key_size, value_size;
} PinLayout;

static const PinLayout layout_tracked = { "tracked", BPF_MAP_TYPE_HASH, sizeof(__u64), sizeof(struct epd_conn_info) };
static const PinLayout layout_conns = { "conns", BPF_MAP_TYPE_HASH, sizeof(__u64), sizeof(struct epd_conn_stats) };
static const PinLayout layout_settings = { "settings", BPF_MAP_TYPE_ARRAY, sizeof(__u32),
                                           sizeof(struct epd_telemetry_config) };

static const char *map_type_str(uint32_t type, char *buf, size_t size) {
        switch (type) {
        case BPF_MAP_TYPE_HASH:
                return "hash";
        case BPF_MAP_TYPE_ARRAY:
                return "array";
        case BPF_MAP_TYPE_PERCPU_HASH:
                return "per-CPU hash";
        case BPF_MAP_TYPE_PERCPU_ARRAY:
                return "per-CPU array";
        case BPF_MAP_TYPE_LRU_HASH:
                return "LRU hash";
        default:
                snprintf(buf, size, "type %u", type);
                return buf;
        }
}

static int refuse(char *why, size_t why_size, const char *fmt, ...) _printf_(3, 4);
static int refuse(char *why, size_t why_size, const char *fmt, ...) {
        va_list ap;
        if (why && why_size > 0) {
                va_start(ap, fmt);
                vsnprintf(why, why_size, fmt, ap);
                va_end(ap);
        }
        return -EPROTO;
}

/* 0 when the map behind fd is of layout l; -EPROTO (why says how it differs) or the
 * error of the query. */
static int check_layout(int fd, const char *dir, const PinLayout *l, char *why, size_t why_size) {
        struct bpf_map_info info = {};
        __u32 len = sizeof info;
        char a[32], b[32];

        if (bpf_obj_get_info_by_fd(fd, &info, &len) < 0)
                return errno > 0 ? -errno : -EIO;
        if (info.type == l->type && info.key_size == l->key_size && info.value_size == l->value_size)
                return 0;
        return refuse(why, why_size,
                      "%s/%s is a %s map of %u-byte keys and %u-byte values; this epdtop reads a %s map of "
                      "%u-byte keys and %u-byte values (telemetry ABI %d): pinned by an epdd of another "
                      "version, or not epdd's",
                      dir, l->name, map_type_str(info.type, a, sizeof a), info.key_size, info.value_size,
                      map_type_str(l->type, b, sizeof b), l->key_size, l->value_size, EPD_TELEMETRY_ABI);
}

/* The pin dir/name, checked against l: its fd, -ENOENT when it is not there, -EPROTO
 * (why set) when it is of another layout. */
static int open_checked(const char *dir, const PinLayout *l, char *why, size_t why_size) {
        _cleanup_(closep) int fd = open_pin(dir, l->name);
        if (fd < 0)
                return fd;
        int r = check_layout(fd, dir, l, why, why_size);
        if (r < 0)
                return r;
        return TAKE_FD(fd);
}

int top_pins_read_why(const char *dir, TopSnapshot *s, char *why, size_t why_size) {
        _cleanup_(closep) int tracked = -EBADF, conns = -EBADF, settings = -EBADF;

        if (why && why_size > 0)
                why[0] = '\0';
        tracked = open_checked(dir, &layout_tracked, why, why_size);
        if (tracked < 0)
                return tracked; /* -ENOENT: nothing pinned there */
        conns = open_checked(dir, &layout_conns, why, why_size);
        if (conns < 0)
                return conns;
        /* The ABI is in the settings the daemon wrote (every epdd pins them beside the
         * others): a layout changed with the sizes kept is refused too. */
        settings = open_checked(dir, &layout_settings, why, why_size);
        if (settings == -ENOENT)
                return refuse(why, why_size,
                              "%s/settings is missing (epdd pins it beside tracked and conns, with the telemetry "
                              "ABI): not epdd's pins",
                              dir);
        if (settings < 0)
                return settings;
        const __u32 zero = 0;
        struct epd_telemetry_config cfg;
        if (bpf_map_lookup_elem(settings, &zero, &cfg) < 0)
                return errno > 0 ? -errno : -EIO;
        if (cfg.abi != EPD_TELEMETRY_ABI)
                return refuse(why, why_size, "%s/settings says telemetry ABI %u; this epdtop reads ABI %d",
                              dir, cfg.abi, EPD_TELEMETRY_ABI);

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
