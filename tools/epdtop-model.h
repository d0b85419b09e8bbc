/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* epdtop's model and layout: pure (no bus, no curses), unit-tested. A snapshot is what
 * one poll read (bus and pinned maps); the model keeps the previous one to compute
 * rates from deltas, a history per peer for sparklines, the sort order and the filter.
 * The layout splits a terminal of any size into sections. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "time-util.h"

#define TOP_HISTORY 120
#define TOP_NAME_MAX 32
#define TOP_MAX_ROWS 4096   /* per section: a snapshot never holds more */

typedef struct TopHistory {
        double v[TOP_HISTORY];
        size_t n, head;         /* head: next slot to write */
} TopHistory;

typedef struct TopArena {
        char name[TOP_NAME_MAX], domain[16], usage[16];
        uint64_t size;
        bool have_pages;        /* page counts are known (pages subsystem) */
        uint64_t pages_total, pages_used, pages_free, pages_shared, pages_leased;
} TopArena;

typedef struct TopPeer {
        char name[TOP_NAME_MAX];
        bool kernel;            /* kernel fields valid */
        uint32_t conns, srtt_us, min_rtt_us, cwnd;
        uint64_t bytes_acked, bytes_sent, retransmits, send_queue;
        unsigned level;         /* 0 none .. 3 stalled */
        char reason[32];
        char transport[16];
        char transport_why[64];
        /* Membership (org.epd1.Cluster.ListMembers, matched by host id): "static",
         * "alive", "missing", "left"; "" when unknown. */
        char lease[12];
        uint32_t share_permille; /* of the directory's hash space */
        /* Derived by the model: */
        double bandwidth;       /* acked bytes/s */
        double retransmits_per_sec;
        TopHistory bandwidth_history, rtt_history;
        bool present;           /* in the latest snapshot */
} TopPeer;

typedef struct TopWorker {
        char id[40], role[16], model[48], device[24];
        uint32_t pid;
} TopWorker;

typedef struct TopFeatures {
        bool known;
        uint64_t hits, misses, bytes, entries;
        double hit_rate;        /* over the last interval (all time if no delta) */
} TopFeatures;

typedef struct TopHandoffs {
        bool known;
        uint64_t in_flight, completed, failed, bytes;
        double throughput;      /* bytes/s */
        double failures_per_sec;
} TopHandoffs;

typedef struct TopSnapshot {
        usec_t ts;              /* CLOCK_MONOTONIC of the poll */
        char host[64], version[32];
        bool bus;               /* read from the daemon */
        bool pins;              /* read from the pinned maps */
        bool kernel;            /* daemon reports kernel telemetry loaded */
        char kernel_unavailable[160];
        uint64_t ring_events;
        TopArena *arenas;
        size_t n_arenas;
        TopPeer *peers;
        size_t n_peers;
        TopWorker *workers;
        size_t n_workers;
        TopFeatures features;
        TopHandoffs handoffs;
        /* Where membership comes from: "static", or "etcd up/connecting/degraded" and
         * the members alive; "" without peers. */
        char membership[96];
} TopSnapshot;

typedef enum TopSortKey {
        TOP_SORT_NAME,
        TOP_SORT_BANDWIDTH,
        TOP_SORT_RTT,
        TOP_SORT_RETRANSMITS,
        TOP_SORT_LEVEL,
        _TOP_SORT_MAX,
} TopSortKey;

typedef struct TopModel {
        TopSnapshot cur;
        bool have_prev;
        usec_t prev_ts;
        TopFeatures prev_features;
        TopHandoffs prev_handoffs;
        TopHistory handoff_history;
        TopPeer *peers;         /* persistent, with history; includes ones gone away */
        size_t n_peers;
        size_t *order;          /* indices into peers: filtered and sorted */
        size_t n_order;
        TopSortKey sort;
        bool reverse;
        char filter[64];
        uint64_t updates;
} TopModel;

/* Snapshot building (bounded to TOP_MAX_ROWS per section). Return a pointer to the
 * new zeroed row, or NULL (out of memory or full). */
TopArena *top_snapshot_add_arena(TopSnapshot *s);
TopPeer *top_snapshot_add_peer(TopSnapshot *s);
TopPeer *top_snapshot_find_peer(TopSnapshot *s, const char *name);
TopWorker *top_snapshot_add_worker(TopSnapshot *s);
void top_snapshot_done(TopSnapshot *s);

void top_model_init(TopModel *m);
void top_model_done(TopModel *m);
/* Takes ownership of *s (cleared on return). */
int top_model_update(TopModel *m, TopSnapshot *s);
void top_model_set_sort(TopModel *m, TopSortKey key, bool reverse);
void top_model_cycle_sort(TopModel *m);
void top_model_set_filter(TopModel *m, const char *filter);
const TopPeer *top_model_peer(const TopModel *m, size_t i); /* i-th visible */
const char *top_sort_key_to_string(TopSortKey k);

void top_history_push(TopHistory *h, double v);
/* i = 0 is the oldest kept. */
double top_history_get(const TopHistory *h, size_t i);

/* UTF-8 sparkline of the last `width` values scaled to their maximum (▁..█); returns
 * buf. buf needs 3 * width + 1 bytes. */
char *top_sparkline(const TopHistory *h, size_t width, char *buf, size_t size);

char *top_format_bytes(char *buf, size_t n, double bytes);
char *top_format_rate(char *buf, size_t n, double bytes_per_sec);
char *top_format_usec(char *buf, size_t n, double usec);
const char *top_level_to_string(unsigned level);

typedef struct TopSection {
        int y, height;          /* title row at y, then height - 1 rows */
        size_t shown;           /* data rows that fit */
        size_t hidden;          /* rows that did not fit */
} TopSection;

typedef struct TopLayout {
        bool too_small;         /* below 40x10: only a message */
        int header_y, header_height;
        TopSection arenas, peers, workers;
        int status_y;           /* last row: keys, filter */
        bool sparklines;        /* wide enough for the bandwidth sparkline */
        int sparkline_width;
        bool reason_column;
        bool transport_column;
} TopLayout;

/* Lays out rows x cols for the model's current content. Peers get room first, then
 * arenas, then workers; every section keeps its title row. */
TopLayout top_layout(int rows, int cols, const TopModel *m);

/* One JSON object: the snapshot with derived rates (what --json prints). */
int top_model_json(const TopModel *m, FILE *f);
