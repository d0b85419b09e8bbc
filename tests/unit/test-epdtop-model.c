/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bpf/epd-telemetry.h"
#include "epdtop-model.h"
#include "macro.h"
#include "pages/directory-proto.h"
#include "peer/peer-proto.h"
#include "telemetry/telemetry.h"
#include "../check-main.h"

/* A row holds every name the daemon can give it whole. */
_Static_assert(TOP_HOST_ID_MAX == PEER_HOST_ID_MAX, "a peer row holds the longest host id");
_Static_assert(TOP_HOST_ID_MAX >= TELEMETRY_PEER_NAME_MAX, "a peer row holds telemetry's longest peer name");
_Static_assert(TOP_ARENA_NAME_MAX == DIRECTORY_NAME_MAX, "an arena row holds the longest arena name");

static void add_peer(TopSnapshot *s, const char *name, uint64_t acked, uint64_t retrans, uint32_t srtt,
                     unsigned level) {
        TopPeer *p = top_snapshot_add_peer(s);
        ck_assert_ptr_nonnull(p);
        snprintf(p->name, sizeof p->name, "%s", name);
        p->kernel = true;
        p->conns = 1;
        p->bytes_acked = acked;
        p->retransmits = retrans;
        p->srtt_us = srtt;
        p->min_rtt_us = 100;
        p->level = level;
        snprintf(p->reason, sizeof p->reason, "%s", level ? "retransmits" : "none");
}

static void snap(TopModel *m, usec_t ts, uint64_t scale) {
        TopSnapshot s = { .ts = ts, .bus = true };
        snprintf(s.host, sizeof s.host, "hostA");
        TopArena *a = top_snapshot_add_arena(&s);
        snprintf(a->name, sizeof a->name, "host0");
        a->size = 256 << 20;
        add_peer(&s, "beta", 1000 * scale, 0, 900, 0);
        add_peer(&s, "alpha", 5000 * scale, 10 * scale, 300, 2);
        add_peer(&s, "gamma", 100 * scale, 0, 5000, 1);
        TopWorker *w = top_snapshot_add_worker(&s);
        snprintf(w->id, sizeof w->id, "w1");
        s.features = (TopFeatures){ .known = true, .hits = 30 * scale, .misses = 10 * scale };
        s.handoffs = (TopHandoffs){ .known = true, .bytes = 1000000 * scale, .failed = scale };
        ck_assert_int_eq(top_model_update(m, &s), 0);
        ck_assert_ptr_null(s.peers);
}

/* Peers come and go (epdtop runs for days against a changing cluster): the model
 * forgets ones gone away rather than refuse a new one past TOP_MAX_ROWS, so every
 * update takes its snapshot; a peer that stays keeps its history. */
START_TEST(test_peers_come_and_go) {
        TopModel m;
        char name[32];

        top_model_init(&m);
        for (unsigned i = 0; i < TOP_MAX_ROWS + 10; i++) {
                TopSnapshot s = { .ts = 1000000 + (usec_t)i * 1000000, .bus = true };
                TopArena *a = top_snapshot_add_arena(&s);
                ck_assert_ptr_nonnull(a);
                snprintf(name, sizeof name, "peer-%u", i);
                add_peer(&s, "stays", 1000 * (uint64_t)i, 0, 300, 0);
                add_peer(&s, name, 1000, 0, 300, 0);
                ck_assert_int_eq(top_model_update(&m, &s), 0);
                ck_assert_ptr_null(s.peers);
                ck_assert_ptr_null(s.arenas);
                ck_assert_uint_eq(m.n_order, 2);
                ck_assert_uint_le(m.n_peers, TOP_MAX_ROWS);
        }
        const TopPeer *p = NULL;
        for (size_t i = 0; i < m.n_order; i++)
                if (strcmp(top_model_peer(&m, i)->name, "stays") == 0)
                        p = top_model_peer(&m, i);
        ck_assert_ptr_nonnull(p);
        ck_assert(p->bandwidth == 1000.0);
        ck_assert_uint_eq(p->rtt_history.n, MIN((size_t)TOP_MAX_ROWS + 10, (size_t)TOP_HISTORY));
        top_model_done(&m);
}
END_TEST

START_TEST(test_rates_from_deltas) {
        TopModel m;
        top_model_init(&m);
        snap(&m, 1000000, 1);
        ck_assert_uint_eq(m.n_order, 3);
        /* First snapshot: no rates. */
        for (size_t i = 0; i < m.n_order; i++)
                ck_assert(top_model_peer(&m, i)->bandwidth == 0);
        snap(&m, 3000000, 3); /* 2 s later, counters x3 */
        const TopPeer *alpha = NULL;
        for (size_t i = 0; i < m.n_order; i++)
                if (strcmp(top_model_peer(&m, i)->name, "alpha") == 0)
                        alpha = top_model_peer(&m, i);
        ck_assert_ptr_nonnull(alpha);
        ck_assert(alpha->bandwidth == 5000.0); /* (15000-5000)/2 */
        ck_assert(alpha->retransmits_per_sec == 10.0);
        ck_assert_uint_eq(alpha->bandwidth_history.n, 1);
        ck_assert_uint_eq(alpha->rtt_history.n, 2);
        ck_assert(m.cur.handoffs.throughput == 1000000.0);
        ck_assert(m.cur.handoffs.failures_per_sec == 1.0);
        ck_assert(m.cur.features.hit_rate == 0.75);

        /* A counter reset (daemon restarted) gives 0, not a huge number. */
        snap(&m, 4000000, 1);
        for (size_t i = 0; i < m.n_order; i++)
                ck_assert(top_model_peer(&m, i)->bandwidth == 0);
        top_model_done(&m);
}
END_TEST

START_TEST(test_sort_filter) {
        TopModel m;
        top_model_init(&m);
        snap(&m, 1000000, 1);
        snap(&m, 2000000, 2);
        ck_assert_str_eq(top_model_peer(&m, 0)->name, "alpha");
        ck_assert_str_eq(top_model_peer(&m, 2)->name, "gamma");
        top_model_set_sort(&m, TOP_SORT_RTT, false);
        ck_assert_str_eq(top_model_peer(&m, 0)->name, "gamma");
        top_model_set_sort(&m, TOP_SORT_RTT, true);
        ck_assert_str_eq(top_model_peer(&m, 0)->name, "alpha");
        top_model_set_sort(&m, TOP_SORT_BANDWIDTH, false);
        ck_assert_str_eq(top_model_peer(&m, 0)->name, "alpha");
        top_model_set_sort(&m, TOP_SORT_LEVEL, false);
        ck_assert_str_eq(top_model_peer(&m, 0)->name, "alpha");
        ck_assert_str_eq(top_model_peer(&m, 1)->name, "gamma");
        top_model_cycle_sort(&m);
        ck_assert_int_eq(m.sort, TOP_SORT_NAME);
        top_model_set_filter(&m, "mm");
        ck_assert_uint_eq(m.n_order, 1);
        ck_assert_str_eq(top_model_peer(&m, 0)->name, "gamma");
        ck_assert_ptr_null(top_model_peer(&m, 1));
        top_model_set_filter(&m, "retrans"); /* matches the reason too */
        ck_assert_uint_eq(m.n_order, 2);
        top_model_set_filter(&m, "");
        ck_assert_uint_eq(m.n_order, 3);

        /* A peer that disappears is hidden but keeps its history for when it returns. */
        TopSnapshot s = { .ts = 3000000 };
        add_peer(&s, "beta", 5000, 0, 900, 0);
        ck_assert_int_eq(top_model_update(&m, &s), 0);
        ck_assert_uint_eq(m.n_order, 1);
        ck_assert_uint_eq(m.n_peers, 3);
        top_model_done(&m);
}
END_TEST

START_TEST(test_history_sparkline) {
        TopHistory h = {};
        char buf[3 * 200 + 1];
        ck_assert_str_eq(top_sparkline(&h, 4, buf, sizeof buf), "    ");
        for (int i = 0; i <= 7; i++)
                top_history_push(&h, i);
        ck_assert_str_eq(top_sparkline(&h, 8, buf, sizeof buf), "▁▂▃▄▅▆▇█");
        ck_assert_str_eq(top_sparkline(&h, 2, buf, sizeof buf), "▇█");
        ck_assert_str_eq(top_sparkline(&h, 10, buf, sizeof buf), "  ▁▂▃▄▅▆▇█");
        for (int i = 0; i < 500; i++)
                top_history_push(&h, i);
        ck_assert_uint_eq(h.n, TOP_HISTORY);
        ck_assert(top_history_get(&h, 0) == 500 - TOP_HISTORY);
        ck_assert(top_history_get(&h, TOP_HISTORY - 1) == 499);
        ck_assert(top_history_get(&h, TOP_HISTORY) == 0);
        /* Never overflows a small buffer. */
        char small[8];
        top_sparkline(&h, 100, small, sizeof small);
        ck_assert_uint_lt(strlen(small), sizeof small);
        /* All zeros: flat. */
        TopHistory z = {};
        top_history_push(&z, 0);
        top_history_push(&z, 0);
        ck_assert_str_eq(top_sparkline(&z, 2, buf, sizeof buf), "▁▁");
}
END_TEST

START_TEST(test_format) {
        char b[32];
        ck_assert_str_eq(top_format_bytes(b, sizeof b, 512), "512B");
        ck_assert_str_eq(top_format_bytes(b, sizeof b, 1536), "1.5K");
        ck_assert_str_eq(top_format_bytes(b, sizeof b, 3.0 * (1 << 30)), "3.0G");
        ck_assert_str_eq(top_format_rate(b, sizeof b, 2 << 20), "2.0M/s");
        ck_assert_str_eq(top_format_usec(b, sizeof b, 250), "250us");
        ck_assert_str_eq(top_format_usec(b, sizeof b, 2500), "2.5ms");
        ck_assert_str_eq(top_format_usec(b, sizeof b, 3e6), "3.00s");
        ck_assert_str_eq(top_level_to_string(3), "stalled");
        ck_assert_str_eq(top_level_to_string(9), "?");
}
END_TEST

static void check_layout(int rows, int cols, const TopModel *m) {
        TopLayout l = top_layout(rows, cols, m);
        if (rows < 10 || cols < 40) {
                ck_assert(l.too_small);
                return;
        }
        ck_assert(!l.too_small);
        /* Sections are in order, do not overlap, and end before the status line. */
        ck_assert_int_ge(l.arenas.y, l.header_y + l.header_height);
        ck_assert_int_eq(l.workers.y, l.arenas.y + l.arenas.height);
        ck_assert_int_eq(l.peers.y, l.workers.y + l.workers.height);
        ck_assert_int_le(l.peers.y + l.peers.height, l.status_y);
        ck_assert_int_eq(l.status_y, rows - 1);
        /* Every row is either shown or counted as hidden. */
        ck_assert_uint_eq(l.arenas.shown + l.arenas.hidden, m->cur.n_arenas);
        ck_assert_uint_eq(l.peers.shown + l.peers.hidden, m->n_order);
        ck_assert_uint_eq(l.workers.shown + l.workers.hidden, m->cur.n_workers);
        /* Shown rows plus the "+N more" line fit under each title. */
        const TopSection *secs[] = { &l.arenas, &l.peers, &l.workers };
        for (size_t i = 0; i < ELEMENTSOF(secs); i++)
                ck_assert_int_le((int)secs[i]->shown + (secs[i]->hidden && secs[i]->height > 1 ? 1 : 0),
                                 MAX(secs[i]->height - 1, 0));
        if (l.sparklines)
                ck_assert_int_gt(l.sparkline_width, 0);
        /* No line is wider than the terminal: nothing wraps. */
        char buf[1024];
        for (int t = 0; t < _TOP_TABLE_MAX; t++) {
                ck_assert_int_le(l.width[t], cols);
                ck_assert_uint_le(strlen(top_table_line(m, &l, (TopTable)t, NULL, buf, sizeof buf)), (size_t)cols);
        }
        for (size_t i = 0; i < m->cur.n_workers; i++)
                ck_assert_uint_le(strlen(top_table_line(m, &l, TOP_TABLE_WORKERS, &m->cur.workers[i], buf, sizeof buf)),
                                  (size_t)cols);
        for (size_t i = 0; i < m->n_order; i++)
                ck_assert_uint_le(strlen(top_table_line(m, &l, TOP_TABLE_PEERS, top_model_peer(m, i), buf, sizeof buf)),
                                  (size_t)cols);
        for (int i = 0; i < TOP_HEADER_LINES; i++) {
                top_header_line(m, i, cols, buf, sizeof buf);
                ck_assert_uint_le(strlen(buf), (size_t)cols);
        }
        if (l.sparklines)
                ck_assert_int_le(l.width[TOP_TABLE_PEERS] + 1 + l.sparkline_width, cols);
}

START_TEST(test_layout) {
        TopModel m;
        top_model_init(&m);
        TopSnapshot s = { .ts = 1 };
        char name[32];
        for (int i = 0; i < 40; i++) {
                snprintf(name, sizeof name, "peer%02d", i);
                add_peer(&s, name, 1, 0, 100, 0);
        }
        for (int i = 0; i < 5; i++)
                snprintf(top_snapshot_add_arena(&s)->name, sizeof s.arenas[0].name, "a%d", i);
        for (int i = 0; i < 7; i++) {
                TopWorker *w = top_snapshot_add_worker(&s);
                snprintf(w->id, sizeof w->id, "%08x%024d", i, i);
                snprintf(w->role, sizeof w->role, "prefill");
                snprintf(w->model, sizeof w->model, "Qwen3-VL-8B-Instruct-with-a-long-name");
                snprintf(w->device, sizeof w->device, "cuda:%d", i);
                w->pid = 4000000 + (uint32_t)i; /* seven digits */
                w->have_stats = true;
                w->pages = 123456789;
        }
        ck_assert_int_eq(top_model_update(&m, &s), 0);

        /* Every size from tiny to huge, as a resize would produce. */
        for (int rows = 1; rows < 120; rows += 1)
                for (int cols = 1; cols < 300; cols += 7)
                        check_layout(rows, cols, &m);

        TopLayout l = top_layout(24, 80, &m);
        ck_assert(!l.sparklines);
        ck_assert_uint_gt(l.peers.shown, 5);
        ck_assert_uint_gt(l.peers.hidden, 0);
        ck_assert_uint_gt(l.arenas.shown, 0);
        ck_assert_uint_gt(l.workers.shown, 2);
        /* At 80x24 the serving side's essentials stay: the worker's PID, pages and
         * handoffs, the peer's transport. */
        ck_assert(top_layout_shows(&l, TOP_TABLE_WORKERS, "PID"));
        ck_assert(top_layout_shows(&l, TOP_TABLE_WORKERS, "PAGES"));
        ck_assert(top_layout_shows(&l, TOP_TABLE_WORKERS, "HO-OUT"));
        ck_assert(top_layout_shows(&l, TOP_TABLE_WORKERS, "FEAT-HIT"));
        ck_assert(top_layout_shows(&l, TOP_TABLE_PEERS, "TRANSPORT"));
        ck_assert(!top_layout_shows(&l, TOP_TABLE_PEERS, "REASON"));
        char line[512];
        top_table_line(&m, &l, TOP_TABLE_WORKERS, &m.cur.workers[0], line, sizeof line);
        ck_assert_ptr_nonnull(strstr(line, "4000000"));
        ck_assert_ptr_nonnull(strstr(line, "123.5M"));
        l = top_layout(60, 200, &m);
        ck_assert(l.sparklines);
        ck_assert(top_layout_shows(&l, TOP_TABLE_PEERS, "REASON") && top_layout_shows(&l, TOP_TABLE_PEERS, "TRANSPORT"));
        ck_assert(top_layout_shows(&l, TOP_TABLE_WORKERS, "MODEL") && top_layout_shows(&l, TOP_TABLE_WORKERS, "FEAT-MISS"));
        ck_assert_uint_eq(l.arenas.shown, 5);
        ck_assert_uint_eq(l.workers.hidden + l.workers.shown, 7);

        /* Empty model. */
        TopModel e;
        top_model_init(&e);
        check_layout(24, 80, &e);
        top_model_done(&e);
        top_model_done(&m);
}
END_TEST

/* The serving side over the last interval: handoff quantiles from the difference of two
 * duration histograms, the feature hit rate of the interval, each worker's handoff rate. */
START_TEST(test_serving_interval) {
        TopModel m;
        top_model_init(&m);
        TopSnapshot s = { .ts = 1000000, .bus = true };
        Histogram h = {};
        for (int i = 0; i < 1000; i++)
                histogram_observe(&h, 80); /* an old, fast history */
        s.handoffs = (TopHandoffs){ .known = true, .completed = 1000, .have_durations = true };
        memcpy(s.handoffs.durations, h.counts, sizeof h.counts);
        s.features = (TopFeatures){ .known = true, .hits = 900, .misses = 100 };
        TopWorker *w = top_snapshot_add_worker(&s);
        snprintf(w->id, sizeof w->id, "w1");
        w->have_stats = true;
        w->handoffs_out = 10;
        ck_assert_int_eq(top_model_update(&m, &s), 0);
        /* One snapshot: since the start. */
        ck_assert(!m.cur.handoffs.latency_interval && m.cur.handoffs.p50_usec <= 100);
        ck_assert(!m.cur.features.hit_rate_interval && m.cur.features.hit_rate == 0.9);

        s = (TopSnapshot){ .ts = 3000000, .bus = true };
        for (int i = 0; i < 10; i++)
                histogram_observe(&h, 40000); /* the last interval: slow */
        s.handoffs = (TopHandoffs){ .known = true, .completed = 1010, .have_durations = true };
        memcpy(s.handoffs.durations, h.counts, sizeof h.counts);
        s.features = (TopFeatures){ .known = true, .hits = 901, .misses = 103 };
        w = top_snapshot_add_worker(&s);
        snprintf(w->id, sizeof w->id, "w1");
        w->have_stats = true;
        w->handoffs_out = 30;
        ck_assert_int_eq(top_model_update(&m, &s), 0);
        ck_assert(m.interval == 2.0);
        ck_assert(m.cur.handoffs.latency_interval);
        ck_assert(m.cur.handoffs.p50_usec > 25000 && m.cur.handoffs.p50_usec <= 50000);
        ck_assert(m.cur.handoffs.p99_usec > 25000 && m.cur.handoffs.p99_usec <= 50000);
        ck_assert(m.cur.handoffs.completed_per_sec == 5.0);
        ck_assert(m.cur.features.hit_rate_interval && m.cur.features.hit_rate == 0.25);
        ck_assert(m.cur.workers[0].handoffs_per_sec == 10.0);
        char buf[256];
        top_header_line(&m, 1, 200, buf, sizeof buf);
        ck_assert_ptr_nonnull(strstr(buf, "(last 2.0s)"));
        ck_assert_ptr_nonnull(strstr(buf, "P50 "));
        top_header_line(&m, 2, 200, buf, sizeof buf);
        ck_assert_ptr_nonnull(strstr(buf, "hit rate 25% (last 2.0s)"));
        top_model_done(&m);
}
END_TEST

START_TEST(test_json) {
        TopModel m;
        top_model_init(&m);
        snap(&m, 1000000, 1);
        snap(&m, 2000000, 2);
        char *buf = NULL;
        size_t n = 0;
        FILE *f = open_memstream(&buf, &n);
        ck_assert_int_eq(top_model_json(&m, f), 0);
        fclose(f);
        ck_assert_ptr_nonnull(strstr(buf, "\"host\":\"hostA\""));
        ck_assert_ptr_nonnull(strstr(buf, "\"name\":\"alpha\""));
        ck_assert_ptr_nonnull(strstr(buf, "\"bandwidth\":5000"));
        ck_assert_ptr_nonnull(strstr(buf, "\"level\":\"high\""));
        ck_assert_ptr_nonnull(strstr(buf, "\"hit_rate\":0.75"));
        ck_assert_ptr_nonnull(strstr(buf, "\"arenas\":[{\"name\":\"host0\""));
        ck_assert_int_eq(buf[strlen(buf) - 1], '\n');
        free(buf);

        /* Strings are escaped. */
        TopSnapshot s = { .ts = 3000000 };
        add_peer(&s, "a\"b\\c\n", 1, 0, 1, 0);
        ck_assert_int_eq(top_model_update(&m, &s), 0);
        f = open_memstream(&buf, &n);
        ck_assert_int_eq(top_model_json(&m, f), 0);
        fclose(f);
        ck_assert_ptr_nonnull(strstr(buf, "\"a\\\"b\\\\c\\u000a\""));
        ck_assert_ptr_null(strstr(buf, "\"membership\""));
        ck_assert_ptr_null(strstr(buf, "\"lease\""));
        free(buf);

        /* Membership: its source and state, each peer's lease and share. */
        TopSnapshot c = { .ts = 4000000 };
        snprintf(c.membership, sizeof c.membership, "etcd degraded, 1 alive");
        add_peer(&c, "h1", 1, 0, 1, 0);
        snprintf(c.peers[0].lease, sizeof c.peers[0].lease, "alive");
        c.peers[0].share_permille = 498;
        ck_assert_int_eq(top_model_update(&m, &c), 0);
        f = open_memstream(&buf, &n);
        ck_assert_int_eq(top_model_json(&m, f), 0);
        fclose(f);
        ck_assert_ptr_nonnull(strstr(buf, "\"membership\":\"etcd degraded, 1 alive\""));
        ck_assert_ptr_nonnull(strstr(buf, "\"lease\":\"alive\",\"share_permille\":498}"));
        ck_assert_ptr_null(strstr(buf, "\"pins_refused\""));
        free(buf);

        /* Pinned maps of another layout: said in the header and the JSON, with why. */
        TopSnapshot r = { .ts = 5000000 };
        snprintf(r.pins_refused, sizeof r.pins_refused, "/pins/settings says telemetry ABI 9");
        ck_assert_int_eq(top_model_update(&m, &r), 0);
        f = open_memstream(&buf, &n);
        ck_assert_int_eq(top_model_json(&m, f), 0);
        fclose(f);
        ck_assert_ptr_nonnull(strstr(buf, "\"pins_refused\":\"/pins/settings says telemetry ABI 9\""));
        free(buf);
        char line[512];
        top_header_line(&m, 0, 500, line, sizeof line);
        ck_assert_msg(strstr(line, "[pinned maps of another layout: not read]"), "%s", line);
        top_model_done(&m);
}
END_TEST

/* Peers named by long host ids: the default one (/etc/machine-id) has 32 characters, the
 * peer protocol takes up to 63. epdtop builds a row from the telemetry (GetPeers, the
 * whole id), finds it again by the peer list's host id (state, transport) and by the
 * membership's (lease), and joins the pinned maps' rows, which keep the id's first 31
 * characters. A row cut to 31 characters was found by none of them: the peer list added
 * a second row that the model merged over the first (kernel off, no RTT, bandwidth or
 * backpressure level, even for a stalled peer) and LEASE never showed. */
START_TEST(test_long_host_ids) {
        const char *ids[] = {
                "0123456789abcdef0123456789abcdef",                                 /* 32, a machine id */
                "host-with-a-long-name.rack-17.row-4.dc-west.example.org-0123456", /* 63 */
        };
        ck_assert_uint_eq(strlen(ids[0]), 32);
        ck_assert_uint_eq(strlen(ids[1]), PEER_HOST_ID_MAX);
        TopModel m;
        top_model_init(&m);
        for (unsigned round = 1; round <= 2; round++) {
                TopSnapshot s = { .ts = round * 1000000, .bus = true };
                snprintf(s.host, sizeof s.host, "%s", ids[1]);
                for (size_t i = 0; i < ELEMENTSOF(ids); i++) /* read_telemetry() */
                        add_peer(&s, ids[i], 1000 * round, 0, 900, 3);
                for (size_t i = 0; i < ELEMENTSOF(ids); i++) {
                        /* read_peer_list() and read_cluster(): by the whole host id. */
                        TopPeer *p = top_snapshot_find_peer(&s, ids[i]);
                        ck_assert_ptr_nonnull(p);
                        ck_assert_ptr_eq(p, &s.peers[i]);
                        snprintf(p->state, sizeof p->state, "up");
                        snprintf(p->transport, sizeof p->transport, "tcp");
                        snprintf(p->lease, sizeof p->lease, "static");
                        /* top_pins_read_why(): the map's copy of the id, cut. */
                        char pinned[EPD_TELEMETRY_PEER_MAX];
                        snprintf(pinned, sizeof pinned, "%s", ids[i]);
                        ck_assert_uint_eq(strlen(pinned), EPD_TELEMETRY_PEER_MAX - 1);
                        ck_assert_ptr_eq(top_snapshot_find_pinned_peer(&s, pinned, EPD_TELEMETRY_PEER_MAX - 1), p);
                }
                /* A shorter name from the maps is a whole id: never a prefix of another. */
                ck_assert_ptr_null(top_snapshot_find_pinned_peer(&s, "0123", EPD_TELEMETRY_PEER_MAX - 1));
                if (round == 1) {
                        /* Two ids that share the kept characters: the cut name is neither's. */
                        TopSnapshot t = { .bus = true };
                        char twin[PEER_HOST_ID_MAX + 1], pinned[EPD_TELEMETRY_PEER_MAX];
                        snprintf(twin, sizeof twin, "%s", ids[1]);
                        twin[strlen(twin) - 1] = 'x';
                        add_peer(&t, ids[1], 1, 0, 900, 3);
                        add_peer(&t, twin, 1, 0, 900, 3);
                        memcpy(pinned, ids[1], sizeof pinned - 1);
                        pinned[sizeof pinned - 1] = 0;
                        ck_assert_ptr_null(top_snapshot_find_pinned_peer(&t, pinned, EPD_TELEMETRY_PEER_MAX - 1));
                        top_snapshot_done(&t);
                }
                ck_assert_uint_eq(s.n_peers, ELEMENTSOF(ids));
                ck_assert_int_eq(top_model_update(&m, &s), 0);
        }
        ck_assert_str_eq(m.cur.host, ids[1]);
        ck_assert_uint_eq(m.n_order, ELEMENTSOF(ids));
        for (size_t i = 0; i < ELEMENTSOF(ids); i++) {
                const TopPeer *p = NULL;
                for (size_t k = 0; k < m.n_order; k++)
                        if (strcmp(top_model_peer(&m, k)->name, ids[i]) == 0)
                                p = top_model_peer(&m, k);
                ck_assert_msg(p, "no row named %s", ids[i]);
                ck_assert(p->kernel);
                ck_assert_uint_eq(p->srtt_us, 900);
                ck_assert_uint_eq(p->level, 3);
                ck_assert(p->bandwidth == 1000.0);
                ck_assert_str_eq(p->state, "up");
                ck_assert_str_eq(p->lease, "static");
        }
        char *buf = NULL;
        size_t n = 0;
        FILE *f = open_memstream(&buf, &n);
        ck_assert_int_eq(top_model_json(&m, f), 0);
        fclose(f);
        char want[128];
        snprintf(want, sizeof want, "{\"name\":\"%s\",\"kernel\":true", ids[1]);
        ck_assert_ptr_nonnull(strstr(buf, want));
        free(buf);
        top_model_done(&m);

        /* An arena's name is whole too (epdtop matches the page pools by it). */
        TopSnapshot a = {};
        TopArena *ar = top_snapshot_add_arena(&a);
        ck_assert_ptr_nonnull(ar);
        const char *arena = "kv-arena-with-the-longest-name-the-block-directory-carries-0123";
        ck_assert_uint_eq(strlen(arena), DIRECTORY_NAME_MAX);
        snprintf(ar->name, sizeof ar->name, "%s", arena);
        ck_assert_str_eq(ar->name, arena);
        top_snapshot_done(&a);
}
END_TEST

int main(void) {
        Suite *s = suite_create("epdtop-model");
        TCase *tc = tcase_create("epdtop-model");
        tcase_add_test(tc, test_rates_from_deltas);
        tcase_add_test(tc, test_peers_come_and_go);
        tcase_add_test(tc, test_sort_filter);
        tcase_add_test(tc, test_history_sparkline);
        tcase_add_test(tc, test_format);
        tcase_add_test(tc, test_layout);
        tcase_add_test(tc, test_json);
        tcase_add_test(tc, test_serving_interval);
        tcase_add_test(tc, test_long_host_ids);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
