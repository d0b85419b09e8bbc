/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "epdtop-model.h"
#include "macro.h"

static void *grow(void *p, size_t *n, size_t size) {
        if (*n >= TOP_MAX_ROWS)
                return NULL;
        char *q = reallocarray(p, *n + 1, size);
        if (!q)
                return NULL;
        memset(q + *n * size, 0, size);
        (*n)++;
        return q;
}

TopArena *top_snapshot_add_arena(TopSnapshot *s) {
        TopArena *a = grow(s->arenas, &s->n_arenas, sizeof *a);
        if (!a)
                return NULL;
        s->arenas = a;
        return &a[s->n_arenas - 1];
}

TopPeer *top_snapshot_add_peer(TopSnapshot *s) {
        TopPeer *p = grow(s->peers, &s->n_peers, sizeof *p);
        if (!p)
                return NULL;
        s->peers = p;
        return &p[s->n_peers - 1];
}

TopPeer *top_snapshot_find_peer(TopSnapshot *s, const char *name) {
        for (size_t i = 0; i < s->n_peers; i++)
                if (strcmp(s->peers[i].name, name) == 0)
                        return &s->peers[i];
        return NULL;
}

TopWorker *top_snapshot_add_worker(TopSnapshot *s) {
        TopWorker *w = grow(s->workers, &s->n_workers, sizeof *w);
        if (!w)
                return NULL;
        s->workers = w;
        return &w[s->n_workers - 1];
}

void top_snapshot_done(TopSnapshot *s) {
        free(s->arenas);
        free(s->peers);
        free(s->workers);
        *s = (TopSnapshot){};
}

void top_model_init(TopModel *m) {
        *m = (TopModel){ .sort = TOP_SORT_NAME };
}

void top_model_done(TopModel *m) {
        top_snapshot_done(&m->cur);
        free(m->peers);
        free(m->order);
        *m = (TopModel){};
}

void top_history_push(TopHistory *h, double v) {
        h->v[h->head] = v;
        h->head = (h->head + 1) % TOP_HISTORY;
        if (h->n < TOP_HISTORY)
                h->n++;
}

double top_history_get(const TopHistory *h, size_t i) {
        if (i >= h->n)
                return 0;
        size_t start = (h->head + TOP_HISTORY - h->n) % TOP_HISTORY;
        return h->v[(start + i) % TOP_HISTORY];
}

/* A counter that went backwards was reset (daemon restart, new connection). */
static double rate(uint64_t now, uint64_t before, double dt) {
        if (dt <= 0 || now < before)
                return 0;
        return (double)(now - before) / dt;
}

static const char *const sort_names[_TOP_SORT_MAX] = {
        [TOP_SORT_NAME] = "name",
        [TOP_SORT_BANDWIDTH] = "bandwidth",
        [TOP_SORT_RTT] = "rtt",
        [TOP_SORT_RETRANSMITS] = "retransmits",
        [TOP_SORT_LEVEL] = "level",
};

const char *top_sort_key_to_string(TopSortKey k) {
        return (unsigned)k < _TOP_SORT_MAX ? sort_names[k] : "?";
}

static const TopModel *sort_model; /* qsort has no context argument in C11 */

static int cmp_double(double a, double b) {
        return a < b ? -1 : a > b ? 1 : 0;
}

static int peer_cmp(const void *a, const void *b) {
        const TopPeer *x = &sort_model->peers[*(const size_t *)a], *y = &sort_model->peers[*(const size_t *)b];
        int c = 0;
        switch (sort_model->sort) {
        case TOP_SORT_BANDWIDTH:
                c = -cmp_double(x->bandwidth, y->bandwidth);
                break;
        case TOP_SORT_RTT:
                c = -cmp_double(x->srtt_us, y->srtt_us);
                break;
        case TOP_SORT_RETRANSMITS:
                c = -cmp_double(x->retransmits_per_sec, y->retransmits_per_sec);
                break;
        case TOP_SORT_LEVEL:
                c = -cmp_double(x->level, y->level);
                break;
        default:
                break;
        }
        if (c == 0)
                c = strcmp(x->name, y->name); /* stable, deterministic tie-break */
        return sort_model->reverse ? -c : c;
}

static int reorder(TopModel *m) {
        size_t *o = reallocarray(m->order, MAX(m->n_peers, (size_t)1), sizeof *o);
        if (!o)
                return -ENOMEM;
        m->order = o;
        m->n_order = 0;
        for (size_t i = 0; i < m->n_peers; i++) {
                const TopPeer *p = &m->peers[i];
                if (!p->present)
                        continue;
                if (m->filter[0] && !strstr(p->name, m->filter) && !strstr(p->reason, m->filter) &&
                    !strstr(p->transport, m->filter))
                        continue;
                o[m->n_order++] = i;
        }
        sort_model = m;
        qsort(o, m->n_order, sizeof *o, peer_cmp);
        sort_model = NULL;
        return 0;
}

void top_model_set_sort(TopModel *m, TopSortKey key, bool reverse) {
        m->sort = (unsigned)key < _TOP_SORT_MAX ? key : TOP_SORT_NAME;
        m->reverse = reverse;
        (void)reorder(m);
}

void top_model_cycle_sort(TopModel *m) {
        top_model_set_sort(m, (TopSortKey)((m->sort + 1) % _TOP_SORT_MAX), m->reverse);
}

void top_model_set_filter(TopModel *m, const char *filter) {
        snprintf(m->filter, sizeof m->filter, "%s", filter ? filter : "");
        (void)reorder(m);
}

const TopPeer *top_model_peer(const TopModel *m, size_t i) {
        return i < m->n_order ? &m->peers[m->order[i]] : NULL;
}

static TopPeer *model_find_peer(TopModel *m, const char *name) {
        for (size_t i = 0; i < m->n_peers; i++)
                if (strcmp(m->peers[i].name, name) == 0)
                        return &m->peers[i];
        return NULL;
}

int top_model_update(TopModel *m, TopSnapshot *s) {
        double dt = m->have_prev && s->ts > m->prev_ts ? (double)(s->ts - m->prev_ts) / 1e6 : 0;

        for (size_t i = 0; i < m->n_peers; i++)
                m->peers[i].present = false;

        for (size_t i = 0; i < s->n_peers; i++) {
                const TopPeer *in = &s->peers[i];
                TopPeer *p = model_find_peer(m, in->name);
                if (!p) {
                        TopPeer *n = grow(m->peers, &m->n_peers, sizeof *n);
                        if (!n)
                                return -ENOMEM;
                        m->peers = n;
                        p = &n[m->n_peers - 1];
                        *p = *in;
                        p->bandwidth = p->retransmits_per_sec = 0;
                        memset(&p->bandwidth_history, 0, sizeof p->bandwidth_history);
                        memset(&p->rtt_history, 0, sizeof p->rtt_history);
                } else {
                        double bw = dt > 0 ? rate(in->bytes_acked, p->bytes_acked, dt) : 0;
                        double rt = dt > 0 ? rate(in->retransmits, p->retransmits, dt) : 0;
                        TopHistory bh = p->bandwidth_history, rh = p->rtt_history;
                        *p = *in;
                        p->bandwidth = bw;
                        p->retransmits_per_sec = rt;
                        p->bandwidth_history = bh;
                        p->rtt_history = rh;
                        if (dt > 0)
                                top_history_push(&p->bandwidth_history, bw);
                }
                top_history_push(&p->rtt_history, p->srtt_us);
                p->present = true;
        }

        TopFeatures *f = &s->features;
        if (f->known) {
                uint64_t dh = 0, dm = 0;
                if (m->have_prev && m->prev_features.known && f->hits >= m->prev_features.hits &&
                    f->misses >= m->prev_features.misses) {
                        dh = f->hits - m->prev_features.hits;
                        dm = f->misses - m->prev_features.misses;
                }
                if (dh + dm == 0) {
                        dh = f->hits;
                        dm = f->misses;
                }
                f->hit_rate = dh + dm ? (double)dh / (double)(dh + dm) : 0;
        }
        TopHandoffs *h = &s->handoffs;
        if (h->known && m->have_prev && m->prev_handoffs.known && dt > 0) {
                h->throughput = rate(h->bytes, m->prev_handoffs.bytes, dt);
                h->failures_per_sec = rate(h->failed, m->prev_handoffs.failed, dt);
                top_history_push(&m->handoff_history, h->throughput);
        }

        m->prev_features = s->features;
        m->prev_handoffs = s->handoffs;
        m->prev_ts = s->ts;
        m->have_prev = true;
        m->updates++;

        top_snapshot_done(&m->cur);
        m->cur = *s;
        *s = (TopSnapshot){};
        /* The snapshot's peers now live in m->peers with their derived values. */
        free(m->cur.peers);
        m->cur.peers = NULL;
        m->cur.n_peers = 0;
        return reorder(m);
}

char *top_sparkline(const TopHistory *h, size_t width, char *buf, size_t size) {
        static const char *const bars[] = { "▁", "▂", "▃", "▄", "▅", "▆", "▇", "█" };
        size_t n = MIN(width, h->n), start = h->n - n, o = 0;
        double max = 0;

        if (size == 0)
                return buf;
        for (size_t i = 0; i < n; i++)
                max = MAX(max, top_history_get(h, start + i));
        /* Pad on the left, so the newest value is always at the right edge. */
        for (size_t i = n; i < width && o + 1 < size; i++)
                buf[o++] = ' ';
        for (size_t i = 0; i < n && o + 4 <= size; i++) {
                double v = top_history_get(h, start + i);
                int k = max > 0 ? (int)lround(v / max * 7.0) : 0;
                k = CLAMP(k, 0, 7);
                memcpy(buf + o, bars[k], 3);
                o += 3;
        }
        buf[o] = '\0';
        return buf;
}

char *top_format_bytes(char *buf, size_t n, double bytes) {
        static const char *const units[] = { "B", "K", "M", "G", "T", "P" };
        size_t u = 0;
        while (bytes >= 1024 && u + 1 < ELEMENTSOF(units)) {
                bytes /= 1024;
                u++;
        }
        if (u == 0)
                snprintf(buf, n, "%.0f%s", bytes, units[u]);
        else
                snprintf(buf, n, "%.1f%s", bytes, units[u]);
        return buf;
}

char *top_format_rate(char *buf, size_t n, double bytes_per_sec) {
        char b[32];
        snprintf(buf, n, "%s/s", top_format_bytes(b, sizeof b, bytes_per_sec));
        return buf;
}

char *top_format_usec(char *buf, size_t n, double usec) {
        if (usec < 1000)
                snprintf(buf, n, "%.0fus", usec);
        else if (usec < 1000000)
                snprintf(buf, n, "%.1fms", usec / 1000);
        else
                snprintf(buf, n, "%.2fs", usec / 1e6);
        return buf;
}

const char *top_level_to_string(unsigned level) {
        static const char *const l[] = { "none", "elevated", "high", "stalled" };
        return level < ELEMENTSOF(l) ? l[level] : "?";
}

static void section(TopSection *s, int *y, int avail, size_t rows) {
        /* A section is its title plus its rows; with no room for any row it still
         * shows its title and how many rows are hidden. */
        int want = 1 + (int)MIN(rows, (size_t)TOP_MAX_ROWS);
        int h = MIN(want, avail);
        s->y = *y;
        s->height = MAX(h, 0);
        s->shown = h > 1 ? (size_t)(h - 1) : 0;
        /* When rows are cut, the last row says "+N more". */
        if (s->shown < rows && s->shown > 0)
                s->shown--;
        s->hidden = rows - s->shown;
        *y += s->height;
}

TopLayout top_layout(int rows, int cols, const TopModel *m) {
        TopLayout l = {};

        if (rows < 10 || cols < 40) {
                l.too_small = true;
                return l;
        }
        l.header_y = 0;
        l.header_height = 3; /* host/version/kernel; features/handoffs; blank */
        l.status_y = rows - 1;

        int avail = rows - l.header_height - 1; /* minus status line */
        size_t na = m->cur.n_arenas, np = m->n_order, nw = m->cur.n_workers;

        /* Minimums first (titles + up to 2 rows each), then peers, arenas, workers. */
        int min_a = 1 + (int)MIN(na, (size_t)2), min_w = 1 + (int)MIN(nw, (size_t)2);
        int for_peers = MAX(avail - min_a - min_w, 1);
        int peers_h = MIN(1 + (int)np, for_peers);
        int rest = avail - peers_h;
        int arenas_h = MIN(1 + (int)na, MAX(rest - min_w, MIN(rest, 1)));
        int workers_h = MAX(rest - arenas_h, 0);

        int y = l.header_height;
        section(&l.arenas, &y, arenas_h, na);
        section(&l.peers, &y, peers_h, np);
        section(&l.workers, &y, workers_h, nw);

        /* Columns: name 16, conns 5, bw 10, rtt 8, min 8, retr/s 8, queue 8, level 9 = ~80. */
        l.transport_column = cols >= 100;
        l.reason_column = cols >= 90;
        int used = 80 + (l.reason_column ? 20 : 0) + (l.transport_column ? 10 : 0);
        l.sparklines = cols - used >= 12;
        l.sparkline_width = l.sparklines ? MIN(cols - used - 2, 60) : 0;
        return l;
}

static void json_str(FILE *f, const char *s) {
        fputc('"', f);
        for (; s && *s; s++) {
                unsigned char c = (unsigned char)*s;
                if (c == '"' || c == '\\')
                        fprintf(f, "\\%c", c);
                else if (c < 0x20)
                        fprintf(f, "\\u%04x", c);
                else
                        fputc(c, f);
        }
        fputc('"', f);
}

static void json_num(FILE *f, double v) {
        if (!isfinite(v))
                v = 0;
        fprintf(f, "%.6g", v);
}

int top_model_json(const TopModel *m, FILE *f) {
        const TopSnapshot *s = &m->cur;
        fprintf(f, "{\"host\":");
        json_str(f, s->host);
        fprintf(f, ",\"version\":");
        json_str(f, s->version);
        fprintf(f, ",\"bus\":%s,\"pins\":%s,\"kernel_telemetry\":%s,\"kernel_unavailable\":",
                s->bus ? "true" : "false", s->pins ? "true" : "false", s->kernel ? "true" : "false");
        json_str(f, s->kernel_unavailable);
        if (s->membership[0]) {
                fprintf(f, ",\"membership\":");
                json_str(f, s->membership);
        }
        fprintf(f, ",\"ring_events\":%" PRIu64 ",\"arenas\":[", s->ring_events);
        for (size_t i = 0; i < s->n_arenas; i++) {
                const TopArena *a = &s->arenas[i];
                fprintf(f, "%s{\"name\":", i ? "," : "");
                json_str(f, a->name);
                fprintf(f, ",\"domain\":");
                json_str(f, a->domain);
                fprintf(f, ",\"usage\":");
                json_str(f, a->usage);
                fprintf(f, ",\"size\":%" PRIu64, a->size);
                if (a->have_pages)
                        fprintf(f, ",\"pages\":{\"total\":%" PRIu64 ",\"used\":%" PRIu64 ",\"free\":%" PRIu64
                                   ",\"shared\":%" PRIu64 ",\"leased\":%" PRIu64 "}",
                                a->pages_total, a->pages_used, a->pages_free, a->pages_shared, a->pages_leased);
                fputc('}', f);
        }
        fprintf(f, "],\"peers\":[");
        for (size_t i = 0; i < m->n_order; i++) {
                const TopPeer *p = top_model_peer(m, i);
                fprintf(f, "%s{\"name\":", i ? "," : "");
                json_str(f, p->name);
                fprintf(f, ",\"kernel\":%s,\"connections\":%u,\"srtt_us\":%u,\"min_rtt_us\":%u,\"cwnd\":%u,"
                           "\"bytes_acked\":%" PRIu64 ",\"bytes_sent\":%" PRIu64 ",\"retransmits\":%" PRIu64
                           ",\"send_queue\":%" PRIu64 ",\"bandwidth\":",
                        p->kernel ? "true" : "false", p->conns, p->srtt_us, p->min_rtt_us, p->cwnd,
                        p->bytes_acked, p->bytes_sent, p->retransmits, p->send_queue);
                json_num(f, p->bandwidth);
                fprintf(f, ",\"retransmits_per_sec\":");
                json_num(f, p->retransmits_per_sec);
                fprintf(f, ",\"level\":");
                json_str(f, top_level_to_string(p->level));
                fprintf(f, ",\"reason\":");
                json_str(f, p->reason);
                fprintf(f, ",\"transport\":");
                json_str(f, p->transport);
                fprintf(f, ",\"transport_why\":");
                json_str(f, p->transport_why);
                if (p->lease[0]) {
                        fprintf(f, ",\"lease\":");
                        json_str(f, p->lease);
                        fprintf(f, ",\"share_permille\":%u", p->share_permille);
                }
                fputc('}', f);
        }
        fprintf(f, "],\"workers\":[");
        for (size_t i = 0; i < s->n_workers; i++) {
                const TopWorker *w = &s->workers[i];
                fprintf(f, "%s{\"id\":", i ? "," : "");
                json_str(f, w->id);
                fprintf(f, ",\"role\":");
                json_str(f, w->role);
                fprintf(f, ",\"model\":");
                json_str(f, w->model);
                fprintf(f, ",\"device\":");
                json_str(f, w->device);
                fprintf(f, ",\"pid\":%u}", w->pid);
        }
        fprintf(f, "]");
        if (s->features.known) {
                fprintf(f, ",\"features\":{\"hits\":%" PRIu64 ",\"misses\":%" PRIu64 ",\"bytes\":%" PRIu64
                           ",\"entries\":%" PRIu64 ",\"hit_rate\":",
                        s->features.hits, s->features.misses, s->features.bytes, s->features.entries);
                json_num(f, s->features.hit_rate);
                fputc('}', f);
        }
        if (s->handoffs.known) {
                fprintf(f, ",\"handoffs\":{\"in_flight\":%" PRIu64 ",\"completed\":%" PRIu64 ",\"failed\":%" PRIu64
                           ",\"bytes\":%" PRIu64 ",\"throughput\":",
                        s->handoffs.in_flight, s->handoffs.completed, s->handoffs.failed, s->handoffs.bytes);
                json_num(f, s->handoffs.throughput);
                fprintf(f, ",\"failures_per_sec\":");
                json_num(f, s->handoffs.failures_per_sec);
                fputc('}', f);
        }
        fprintf(f, ",\"sort\":");
        json_str(f, top_sort_key_to_string(m->sort));
        fprintf(f, ",\"filter\":");
        json_str(f, m->filter);
        fprintf(f, "}\n");
        return ferror(f) ? -EIO : 0;
}
