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

TopPeer *top_snapshot_find_pinned_peer(TopSnapshot *s, const char *name, size_t kept) {
        TopPeer *p = top_snapshot_find_peer(s, name);
        if (p || strlen(name) != kept)
                return p;
        /* Only a prefix that names one peer: two whose ids share the kept characters
         * (node names that differ in a suffix) would get each other's numbers. */
        TopPeer *found = NULL;
        for (size_t i = 0; i < s->n_peers; i++)
                if (strncmp(s->peers[i].name, name, kept) == 0) {
                        if (found)
                                return NULL;
                        found = &s->peers[i];
                }
        return found;
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
        free(m->prev_workers);
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

/* The quantiles of the handoffs that completed since the previous snapshot (of every
 * one so far when none did, or after a reset). */
static void handoff_latency(const TopModel *m, TopHandoffs *h) {
        h->p50_usec = h->p99_usec = -1;
        h->latency_interval = false;
        if (!h->known || !h->have_durations)
                return;
        uint64_t d[HISTOGRAM_BUCKETS + 1];
        uint64_t n = 0;
        bool delta = m->have_prev && m->prev_handoffs.have_durations;
        for (size_t i = 0; i <= HISTOGRAM_BUCKETS; i++) {
                uint64_t before = delta ? m->prev_handoffs.durations[i] : 0;
                if (h->durations[i] < before) { /* reset: the daemon restarted */
                        delta = false;
                        break;
                }
                d[i] = h->durations[i] - before;
                n += d[i];
        }
        if (!delta || n == 0) {
                memcpy(d, h->durations, sizeof d);
                h->latency_interval = false;
        } else
                h->latency_interval = true;
        h->p50_usec = histogram_quantile_usec(d, HISTOGRAM_BUCKETS + 1, 0.5);
        h->p99_usec = histogram_quantile_usec(d, HISTOGRAM_BUCKETS + 1, 0.99);
}

/* Handoffs per second of each worker since the previous snapshot; keeps this
 * snapshot's counters for the next. */
static void worker_rates(TopModel *m, TopSnapshot *s, double dt) {
        for (size_t i = 0; i < s->n_workers; i++) {
                TopWorker *w = &s->workers[i];
                w->handoffs_per_sec = 0;
                for (size_t j = 0; dt > 0 && j < m->n_prev_workers; j++)
                        if (strcmp(m->prev_workers[j].id, w->id) == 0)
                                w->handoffs_per_sec =
                                        rate(w->handoffs_out + w->handoffs_in,
                                             m->prev_workers[j].handoffs_out + m->prev_workers[j].handoffs_in, dt);
        }
        TopWorker *copy = s->n_workers ? reallocarray(NULL, s->n_workers, sizeof *copy) : NULL;
        if (copy || s->n_workers == 0) {
                if (copy)
                        memcpy(copy, s->workers, s->n_workers * sizeof *copy);
                free(m->prev_workers);
                m->prev_workers = copy;
                m->n_prev_workers = s->n_workers;
        }
}

/* Marks the model's peers that s lists; when the new ones would not fit in
 * TOP_MAX_ROWS, forgets the ones gone away (kept only so that one coming back finds its
 * history), so that a snapshot, itself bounded, always fits. */
static void mark_present(TopModel *m, const TopSnapshot *s) {
        size_t n_new = 0, k = 0;

        for (size_t i = 0; i < m->n_peers; i++)
                m->peers[i].present = false;
        for (size_t i = 0; i < s->n_peers; i++) {
                TopPeer *p = model_find_peer(m, s->peers[i].name);
                if (p)
                        p->present = true;
                else
                        n_new++;
        }
        if (m->n_peers + n_new <= TOP_MAX_ROWS)
                return;
        for (size_t i = 0; i < m->n_peers; i++)
                if (m->peers[i].present)
                        m->peers[k++] = m->peers[i];
        m->n_peers = k;
}

int top_model_update(TopModel *m, TopSnapshot *s) {
        double dt = m->have_prev && s->ts > m->prev_ts ? (double)(s->ts - m->prev_ts) / 1e6 : 0;

        mark_present(m, s);
        for (size_t i = 0; i < s->n_peers; i++) {
                const TopPeer *in = &s->peers[i];
                TopPeer *p = model_find_peer(m, in->name);
                if (!p) {
                        TopPeer *n = m->peers;
                        if (m->n_peers == m->cap_peers && m->n_peers < TOP_MAX_ROWS) {
                                /* Doubling: a peer is kilobytes of history, and one more
                                 * at a time would copy the whole table each time. */
                                size_t cap = MIN(MAX(m->cap_peers * 2, (size_t)8), (size_t)TOP_MAX_ROWS);
                                n = reallocarray(m->peers, cap, sizeof *n);
                                if (n) {
                                        m->peers = n;
                                        m->cap_peers = cap;
                                }
                        }
                        if (!n || m->n_peers >= m->cap_peers)
                                n = NULL;
                        else
                                memset(&n[m->n_peers++], 0, sizeof *n);
                        if (!n) {
                                /* out of memory: this snapshot is dropped, the last one
                                 * stays on show */
                                top_snapshot_done(s);
                                (void)reorder(m);
                                return -ENOMEM;
                        }
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
                f->hit_rate_interval = dh + dm > 0;
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
                h->completed_per_sec = rate(h->completed, m->prev_handoffs.completed, dt);
                top_history_push(&m->handoff_history, h->throughput);
        }
        handoff_latency(m, h);
        worker_rates(m, s, dt);

        m->prev_features = s->features;
        m->prev_handoffs = s->handoffs;
        m->prev_ts = s->ts;
        m->interval = dt;
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
        char b[24]; /* "1023.9TiB" at most, and room for "/s" in the callers' 32 */
        snprintf(buf, n, "%s/s", top_format_bytes(b, sizeof b, bytes_per_sec));
        return buf;
}

char *top_format_count(char *buf, size_t n, uint64_t v) {
        if (v < 100000)
                snprintf(buf, n, "%" PRIu64, v);
        else if (v < 100000000)
                snprintf(buf, n, "%.1fK", (double)v / 1e3);
        else if (v < UINT64_C(100000000000))
                snprintf(buf, n, "%.1fM", (double)v / 1e6);
        else
                snprintf(buf, n, "%.1fG", (double)v / 1e9);
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

/* ---- tables: columns and the cells of each ---- */

#define CELL(name, Type, ...)                                                            \
        static void name(const TopModel *m, const void *row, char *b, size_t n) {       \
                const Type *r = row;                                                     \
                (void)m;                                                                 \
                __VA_ARGS__;                                                             \
        }

CELL(arena_name, TopArena, snprintf(b, n, "%s", r->name))
CELL(arena_domain, TopArena, snprintf(b, n, "%s", r->domain))
CELL(arena_usage, TopArena, snprintf(b, n, "%s", r->usage))
CELL(arena_size, TopArena, top_format_bytes(b, n, (double)r->size))
CELL(arena_page, TopArena, r->have_pages ? (void)top_format_bytes(b, n, (double)r->page_size) : (void)snprintf(b, n, "-"))
CELL(arena_used, TopArena, r->have_pages ? (void)top_format_count(b, n, r->pages_used) : (void)snprintf(b, n, "-"))
CELL(arena_free, TopArena, r->have_pages ? (void)top_format_count(b, n, r->pages_free) : (void)snprintf(b, n, "-"))
CELL(arena_shared, TopArena, r->have_pages ? (void)top_format_count(b, n, r->pages_shared) : (void)snprintf(b, n, "-"))
CELL(arena_leased, TopArena, r->have_pages ? (void)top_format_count(b, n, r->pages_leased) : (void)snprintf(b, n, "-"))

static const TopColumn arena_columns[] = {
        { "ARENA", 16, 0, true, arena_name },   { "DOMAIN", 6, 3, true, arena_domain },
        { "USAGE", 8, 2, true, arena_usage },   { "SIZE", 8, 0, false, arena_size },
        { "PAGE", 7, 2, false, arena_page },    { "USED", 8, 0, false, arena_used },
        { "FREE", 8, 0, false, arena_free },    { "SHARED", 8, 1, false, arena_shared },
        { "LEASED", 8, 1, false, arena_leased },
};

#define WSTAT(v) (r->have_stats ? (void)top_format_count(b, n, (v)) : (void)snprintf(b, n, "-"))
CELL(worker_id, TopWorker, snprintf(b, n, "%s", r->name[0] ? r->name : r->id))
CELL(worker_role, TopWorker, snprintf(b, n, "%s", r->role))
CELL(worker_model, TopWorker, snprintf(b, n, "%s", r->model))
CELL(worker_device, TopWorker, snprintf(b, n, "%s", r->device))
CELL(worker_pid, TopWorker, snprintf(b, n, "%" PRIu32, r->pid))
CELL(worker_seqs, TopWorker, WSTAT(r->sequences))
CELL(worker_pages, TopWorker, WSTAT(r->pages))
CELL(worker_out, TopWorker, WSTAT(r->handoffs_out))
CELL(worker_in, TopWorker, WSTAT(r->handoffs_in))
CELL(worker_rate, TopWorker, snprintf(b, n, "%.1f", r->handoffs_per_sec))
CELL(worker_produced, TopWorker, WSTAT(r->features_produced))
CELL(worker_hits, TopWorker, WSTAT(r->feature_hits))
CELL(worker_misses, TopWorker, WSTAT(r->feature_misses))
#undef WSTAT

static const TopColumn worker_columns[] = {
        { "WORKER", 12, 0, true, worker_id },       { "ROLE", 9, 0, true, worker_role },
        { "MODEL", 18, 2, true, worker_model },     { "DEVICE", 8, 3, true, worker_device },
        { "PID", 7, 1, false, worker_pid },         { "SEQS", 5, 4, false, worker_seqs },
        { "PAGES", 7, 0, false, worker_pages },     { "HO-OUT", 7, 0, false, worker_out },
        { "HO-IN", 7, 0, false, worker_in },        { "HO/S", 6, 3, false, worker_rate },
        { "FEAT-PROD", 9, 1, false, worker_produced }, { "FEAT-HIT", 8, 1, false, worker_hits },
        { "FEAT-MISS", 9, 4, false, worker_misses },
};

CELL(peer_name, TopPeer, snprintf(b, n, "%s", r->name))
CELL(peer_conns, TopPeer, snprintf(b, n, "%u", r->conns))
CELL(peer_bandwidth, TopPeer, top_format_rate(b, n, r->bandwidth))
CELL(peer_srtt, TopPeer, r->kernel ? (void)top_format_usec(b, n, r->srtt_us) : (void)snprintf(b, n, "-"))
CELL(peer_minrtt, TopPeer, r->kernel ? (void)top_format_usec(b, n, r->min_rtt_us) : (void)snprintf(b, n, "-"))
CELL(peer_retr, TopPeer, snprintf(b, n, "%.1f", r->retransmits_per_sec))
CELL(peer_queue, TopPeer, top_format_bytes(b, n, (double)r->send_queue))
CELL(peer_level, TopPeer, snprintf(b, n, "%s", top_level_to_string(r->level)))
CELL(peer_reason, TopPeer, snprintf(b, n, "%s", r->reason))
CELL(peer_transport, TopPeer, snprintf(b, n, "%s", r->transport[0] ? r->transport : "-"))
CELL(peer_state, TopPeer, snprintf(b, n, "%s", r->state[0] ? r->state : "-"))
CELL(peer_lease, TopPeer, snprintf(b, n, "%s", r->lease[0] ? r->lease : "-"))
CELL(peer_share, TopPeer,
     r->lease[0] ? (void)snprintf(b, n, "%.1f%%", r->share_permille / 10.0) : (void)snprintf(b, n, "-"))

/* Peer columns; more go in as entries here. LEASE and SHARE: cluster membership (the
 * peer's lease in etcd, or static; its share of the directory's hash space). */
static const TopColumn peer_columns[] = {
        { "PEER", 16, 0, true, peer_name },          { "CONNS", 5, 3, false, peer_conns },
        { "BANDWIDTH", 10, 0, false, peer_bandwidth }, { "SRTT", 8, 0, false, peer_srtt },
        { "MINRTT", 8, 2, false, peer_minrtt },      { "RETR/S", 7, 1, false, peer_retr },
        { "QUEUE", 8, 2, false, peer_queue },        { "LEVEL", 9, 0, true, peer_level },
        { "REASON", 19, 2, true, peer_reason },      { "TRANSPORT", 9, 1, true, peer_transport },
        { "STATE", 10, 2, true, peer_state },        { "LEASE", 7, 3, true, peer_lease },
        { "SHARE", 6, 3, false, peer_share },
};
#undef CELL

const TopColumn *top_table_columns(TopTable t, size_t *ret_n) {
        static const struct {
                const TopColumn *c;
                size_t n;
        } tables[_TOP_TABLE_MAX] = {
                [TOP_TABLE_ARENAS] = { arena_columns, ELEMENTSOF(arena_columns) },
                [TOP_TABLE_WORKERS] = { worker_columns, ELEMENTSOF(worker_columns) },
                [TOP_TABLE_PEERS] = { peer_columns, ELEMENTSOF(peer_columns) },
        };
        _Static_assert(ELEMENTSOF(worker_columns) <= TOP_COLUMNS_MAX && ELEMENTSOF(peer_columns) <= TOP_COLUMNS_MAX,
                       "TOP_COLUMNS_MAX");
        if ((unsigned)t >= _TOP_TABLE_MAX) {
                *ret_n = 0;
                return NULL;
        }
        *ret_n = tables[t].n;
        return tables[t].c;
}

/* Keeps the columns that fit `cols`, dropping the highest priority first; returns the
 * width of a line (columns and one space between each). */
static int fit_columns(const TopColumn *c, size_t n, int cols, bool *shown) {
        int width = 0, max_priority = 0;
        for (size_t i = 0; i < n; i++) {
                shown[i] = true;
                width += c[i].width + (i ? 1 : 0);
                max_priority = MAX(max_priority, c[i].priority);
        }
        for (int p = max_priority; p > 0 && width > cols; p--)
                for (size_t i = 0; i < n; i++)
                        if (shown[i] && c[i].priority == p) {
                                shown[i] = false;
                                width -= c[i].width + 1;
                        }
        return width;
}

char *top_table_line(const TopModel *m, const TopLayout *l, TopTable t, const void *row, char *buf, size_t size) {
        size_t n, o = 0;
        const TopColumn *c = top_table_columns(t, &n);
        bool first = true;
        if (size == 0)
                return buf;
        buf[0] = 0;
        for (size_t i = 0; i < n && o + 1 < size; i++) {
                if (!l->shown[t][i])
                        continue;
                char cell[128];
                if (row)
                        c[i].cell(m, row, cell, sizeof cell);
                else
                        snprintf(cell, sizeof cell, "%s", c[i].title);
                /* ASCII only: anything else is shown as '?', so a width is a width. */
                for (char *p = cell; *p; p++)
                        if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e)
                                *p = '?';
                int k = snprintf(buf + o, size - o, c[i].left ? "%s%-*.*s" : "%s%*.*s", first ? "" : " ", c[i].width,
                                 c[i].width, cell);
                if (k < 0)
                        break;
                o = MIN(o + (size_t)k, size - 1);
                first = false;
        }
        /* Cut to the table's width (the columns that are always kept may not fit). */
        if (l->width[t] >= 0 && o > (size_t)l->width[t])
                buf[l->width[t]] = 0;
        /* No trailing blanks. */
        for (size_t k = strlen(buf); k > 0 && buf[k - 1] == ' '; k--)
                buf[k - 1] = 0;
        return buf;
}

bool top_layout_shows(const TopLayout *l, TopTable t, const char *title) {
        size_t n;
        const TopColumn *c = top_table_columns(t, &n);
        for (size_t i = 0; i < n; i++)
                if (strcmp(c[i].title, title) == 0)
                        return l->shown[t][i];
        return false;
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
        l.header_height = TOP_HEADER_LINES;
        l.status_y = rows - 1;

        int avail = rows - l.header_height - 1; /* minus the status line */
        size_t na = m->cur.n_arenas, np = m->n_order, nw = m->cur.n_workers;

        /* Arenas keep their title and up to two rows; workers and peers share the rest
         * (each at least its title), and what they leave goes back to the arenas. */
        int min_a = 1 + (int)MIN(na, (size_t)2);
        int rest = MAX(avail - min_a, 2);
        int want_w = 1 + (int)MIN(nw, (size_t)TOP_MAX_ROWS), want_p = 1 + (int)MIN(np, (size_t)TOP_MAX_ROWS);
        int half = rest / 2, workers_h, peers_h;
        if (want_w + want_p <= rest) {
                workers_h = want_w;
                peers_h = want_p;
        } else if (want_w <= half) {
                workers_h = want_w;
                peers_h = rest - workers_h;
        } else if (want_p <= rest - half) {
                peers_h = want_p;
                workers_h = rest - peers_h;
        } else {
                workers_h = half;
                peers_h = rest - half;
        }
        int arenas_h = MIN(1 + (int)MIN(na, (size_t)TOP_MAX_ROWS), avail - workers_h - peers_h);

        int y = l.header_height;
        section(&l.arenas, &y, MAX(arenas_h, 0), na);
        section(&l.workers, &y, workers_h, nw);
        section(&l.peers, &y, peers_h, np);

        for (int t = 0; t < _TOP_TABLE_MAX; t++) {
                size_t n;
                const TopColumn *c = top_table_columns((TopTable)t, &n);
                l.width[t] = MIN(fit_columns(c, n, cols, l.shown[t]), cols);
        }
        /* The peers' bandwidth sparkline after their columns, when all of them fit and
         * there is room left. */
        size_t np_cols;
        (void)top_table_columns(TOP_TABLE_PEERS, &np_cols);
        bool all = true;
        for (size_t i = 0; i < np_cols; i++)
                all = all && l.shown[TOP_TABLE_PEERS][i];
        int left = cols - l.width[TOP_TABLE_PEERS] - 1;
        l.sparklines = all && left >= 12;
        l.sparkline_width = l.sparklines ? MIN(left, 60) : 0;
        return l;
}

static void cut(char *buf, int cols) {
        if (cols >= 0 && strlen(buf) > (size_t)cols)
                buf[cols] = 0;
}

void top_header_line(const TopModel *m, int line, int cols, char *buf, size_t size) {
        const TopSnapshot *s = &m->cur;
        char a[32], b[32], c[32], d[32];
        char over[48] = "";
        if (m->interval > 0)
                snprintf(over, sizeof over, " (last %.1fs)", m->interval);
        switch (line) {
        case 0:
                snprintf(buf, size, "epdtop - host %s  epdd %s%s%s  kernel telemetry: %s%s%s  (? for help)",
                         s->host[0] ? s->host : "?", s->version[0] ? s->version : "?",
                         s->bus ? "" : "  [daemon not reachable]",
                         s->pins_refused[0] ? "  [pinned maps of another layout: not read]" : "",
                         s->kernel ? "on" : (s->kernel_unavailable[0] ? s->kernel_unavailable : "off"),
                         s->membership[0] ? "  membership: " : "", s->membership);
                break;
        case 1: {
                const TopHandoffs *h = &s->handoffs;
                if (!h->known) {
                        snprintf(buf, size, "handoffs: -");
                        break;
                }
                char lat[96] = "no handoff completed yet";
                if (h->p50_usec >= 0)
                        snprintf(lat, sizeof lat, "P50 %s P99 %s%s", top_format_usec(c, sizeof c, h->p50_usec),
                                 top_format_usec(d, sizeof d, h->p99_usec),
                                 h->latency_interval ? over : " (since start)");
                snprintf(buf, size, "handoffs: %" PRIu64 " in flight, %.1f/s, %s, %s, %" PRIu64 " done, %" PRIu64
                         " failed",
                         h->in_flight, h->completed_per_sec, top_format_rate(a, sizeof a, h->throughput), lat,
                         h->completed, h->failed);
                break;
        }
        default: {
                const TopFeatures *f = &s->features;
                if (!f->known)
                        snprintf(buf, size, "features: -   ring events: %" PRIu64, s->ring_events);
                else
                        snprintf(buf, size, "features: hit rate %.0f%%%s, %" PRIu64 " hits, %" PRIu64 " misses, %s in %"
                                 PRIu64 "; ring events %" PRIu64,
                                 f->hit_rate * 100, f->hit_rate_interval ? over : " (since start)", f->hits, f->misses,
                                 top_format_bytes(b, sizeof b, (double)f->bytes), f->entries, s->ring_events);
                break;
        }
        }
        cut(buf, cols);
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
        if (s->pins_refused[0]) {
                fprintf(f, ",\"pins_refused\":");
                json_str(f, s->pins_refused);
        }
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
                        fprintf(f, ",\"page_size\":%" PRIu64 ",\"pages\":{\"total\":%" PRIu64 ",\"used\":%" PRIu64
                                   ",\"free\":%" PRIu64 ",\"shared\":%" PRIu64 ",\"leased\":%" PRIu64 "}",
                                a->page_size, a->pages_total, a->pages_used, a->pages_free, a->pages_shared,
                                a->pages_leased);
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
                fprintf(f, ",\"state\":");
                json_str(f, p->state);
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
                fprintf(f, ",\"name\":");
                json_str(f, w->name);
                fprintf(f, ",\"pid\":%u", w->pid);
                if (w->have_stats) {
                        fprintf(f, ",\"sequences\":%" PRIu64 ",\"pages\":%" PRIu64 ",\"handoffs_out\":%" PRIu64
                                   ",\"handoffs_in\":%" PRIu64 ",\"features_produced\":%" PRIu64
                                   ",\"feature_hits\":%" PRIu64 ",\"feature_misses\":%" PRIu64 ",\"handoffs_per_sec\":",
                                w->sequences, w->pages, w->handoffs_out, w->handoffs_in, w->features_produced,
                                w->feature_hits, w->feature_misses);
                        json_num(f, w->handoffs_per_sec);
                }
                fputc('}', f);
        }
        fprintf(f, "]");
        if (s->features.known) {
                fprintf(f, ",\"features\":{\"hits\":%" PRIu64 ",\"misses\":%" PRIu64 ",\"bytes\":%" PRIu64
                           ",\"entries\":%" PRIu64 ",\"hit_rate\":",
                        s->features.hits, s->features.misses, s->features.bytes, s->features.entries);
                json_num(f, s->features.hit_rate);
                fprintf(f, ",\"hit_rate_interval\":%s}", s->features.hit_rate_interval ? "true" : "false");
        }
        if (s->handoffs.known) {
                fprintf(f, ",\"handoffs\":{\"in_flight\":%" PRIu64 ",\"completed\":%" PRIu64 ",\"failed\":%" PRIu64
                           ",\"bytes\":%" PRIu64 ",\"throughput\":",
                        s->handoffs.in_flight, s->handoffs.completed, s->handoffs.failed, s->handoffs.bytes);
                json_num(f, s->handoffs.throughput);
                fprintf(f, ",\"failures_per_sec\":");
                json_num(f, s->handoffs.failures_per_sec);
                fprintf(f, ",\"completed_per_sec\":");
                json_num(f, s->handoffs.completed_per_sec);
                if (s->handoffs.p50_usec >= 0) {
                        fprintf(f, ",\"p50_usec\":");
                        json_num(f, s->handoffs.p50_usec);
                        fprintf(f, ",\"p99_usec\":");
                        json_num(f, s->handoffs.p99_usec);
                        fprintf(f, ",\"latency_interval\":%s", s->handoffs.latency_interval ? "true" : "false");
                }
                fputc('}', f);
        }
        fprintf(f, ",\"interval\":");
        json_num(f, m->interval);
        fprintf(f, ",\"sort\":");
        json_str(f, top_sort_key_to_string(m->sort));
        fprintf(f, ",\"filter\":");
        json_str(f, m->filter);
        fprintf(f, "}\n");
        return ferror(f) ? -EIO : 0;
}
