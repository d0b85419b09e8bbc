/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* epdtop's model and layout: pure (no bus, no curses), unit-tested. A snapshot is what
 * one poll read (bus and pinned maps); the model keeps the previous one to compute
 * rates from deltas (and the handoff latency and feature hit rate of the last interval),
 * a history per peer for sparklines, the sort order and the filter. The layout splits a
 * terminal of any size into sections; each table (arenas, workers, peers) is a list of
 * columns (TopColumn: title, width, priority, a cell formatter) of which the layout keeps
 * those that fit, so a column is added with one entry in epdtop-model.c and never
 * makes a line wrap. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "histogram.h"
#include "time-util.h"

#define TOP_HISTORY 120
/* A peer row is named by the peer's host id: HostId= and the peer protocol take up to 63
 * characters (PEER_HOST_ID_MAX, daemon/peer/peer-proto.h), and the default,
 * /etc/machine-id, has 32. */
#define TOP_HOST_ID_MAX 63
/* An arena's name: [Arena:NAME] takes up to 31 characters, the block directory's
 * protocol carries up to 63 (DIRECTORY_NAME_MAX, daemon/pages/directory-proto.h). */
#define TOP_ARENA_NAME_MAX 63
#define TOP_MAX_ROWS 4096   /* per section: a snapshot never holds more */

typedef struct TopHistory {
        double v[TOP_HISTORY];
        size_t n, head;         /* head: next slot to write */
} TopHistory;

typedef struct TopArena {
        char name[TOP_ARENA_NAME_MAX + 1], domain[16], usage[16];
        uint64_t size;
        bool have_pages;        /* page counts are known (pages subsystem) */
        uint64_t page_size, pages_total, pages_used, pages_free, pages_shared, pages_leased;
} TopArena;

typedef struct TopPeer {
        char name[TOP_HOST_ID_MAX + 1]; /* the host id; the pinned maps' rows alone: its first characters */
        bool kernel;            /* kernel fields valid */
        uint32_t conns, srtt_us, min_rtt_us, cwnd;
        uint64_t bytes_acked, bytes_sent, retransmits, send_queue;
        unsigned level;         /* 0 none .. 3 stalled */
        char reason[32];
        char transport[16];
        char transport_why[64];
        char state[16];         /* from the peer list: up, connecting, down...; "" if unknown */
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
        char id[40], role[16], model[48], device[24], name[32];
        uint32_t pid;
        bool have_stats;        /* org.epd1.Worker.Stats was read */
        uint64_t sequences, pages, handoffs_out, handoffs_in, features_produced, feature_hits, feature_misses;
        /* Derived by the model, over the last interval: */
        double handoffs_per_sec; /* out + in */
} TopWorker;

typedef struct TopFeatures {
        bool known;
        uint64_t hits, misses, bytes, entries;
        double hit_rate;        /* over the last interval (all time if no delta) */
        bool hit_rate_interval; /* hit_rate is the last interval's (else all time) */
} TopFeatures;

typedef struct TopHandoffs {
        bool known;
        uint64_t in_flight, completed, failed, bytes;
        double throughput;      /* bytes/s */
        double failures_per_sec;
        double completed_per_sec;
        /* Prepare-to-Commit durations of the handoffs this host prepared, all peers and
         * transports: per-bucket counts since the start (common/histogram.h). */
        bool have_durations;
        uint64_t durations[HISTOGRAM_BUCKETS + 1];
        /* Derived by the model: the quantiles of the last interval's handoffs (of all
         * time when none completed in it); -1 when there were none. */
        double p50_usec, p99_usec;
        bool latency_interval;
} TopHandoffs;

typedef struct TopSnapshot {
        usec_t ts;              /* CLOCK_MONOTONIC of the poll */
        char host[TOP_HOST_ID_MAX + 1], version[32];
        bool bus;               /* read from the daemon */
        bool pins;              /* read from the pinned maps */
        char pins_refused[256]; /* why the pinned maps were not read (another layout or ABI), "" */
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
        double interval;        /* seconds between the last two snapshots (0: one so far) */
        TopFeatures prev_features;
        TopHandoffs prev_handoffs;
        TopWorker *prev_workers; /* of the previous snapshot, for the workers' rates */
        size_t n_prev_workers;
        TopHistory handoff_history;
        TopPeer *peers;         /* persistent, with history; ones gone away until the table is full */
        size_t n_peers, cap_peers;
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
/* The row of a name that a pinned BPF map gives: the maps keep only the first `kept`
 * characters of a host id (EPD_TELEMETRY_PEER_MAX - 1), so a name of that length that
 * names no row itself matches the one row whose name starts with it (none when several
 * do: their numbers would be one peer's); a shorter one, only its own. */
TopPeer *top_snapshot_find_pinned_peer(TopSnapshot *s, const char *name, size_t kept);
TopWorker *top_snapshot_add_worker(TopSnapshot *s);
void top_snapshot_done(TopSnapshot *s);

void top_model_init(TopModel *m);
void top_model_done(TopModel *m);
/* Takes ownership of *s (freed and cleared on return, whatever it returns). -ENOMEM:
 * the previous snapshot stays current. */
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
char *top_format_count(char *buf, size_t n, uint64_t v); /* 1234567 -> 1.2M */
const char *top_level_to_string(unsigned level);

typedef struct TopSection {
        int y, height;          /* title row at y, then height - 1 rows */
        size_t shown;           /* data rows that fit */
        size_t hidden;          /* rows that did not fit */
} TopSection;

/* A column of a table: `cell` formats row `row` (a TopArena, TopWorker or TopPeer) of
 * model m into buf (NULL row: nothing; the title is `title`). Cells are cut to `width`
 * characters; text is left-aligned, numbers right-aligned. When the terminal is narrow,
 * the columns with the highest `priority` go first (0: never). */
typedef struct TopColumn {
        const char *title;
        int width;
        int priority;
        bool left;
        void (*cell)(const TopModel *m, const void *row, char *buf, size_t n);
} TopColumn;

typedef enum TopTable {
        TOP_TABLE_ARENAS,
        TOP_TABLE_WORKERS,
        TOP_TABLE_PEERS,
        _TOP_TABLE_MAX,
} TopTable;

#define TOP_COLUMNS_MAX 32

/* The columns of a table, and how many. */
const TopColumn *top_table_columns(TopTable t, size_t *ret_n);

typedef struct TopLayout {
        bool too_small;         /* below 40x10: only a message */
        int header_y, header_height;
        TopSection arenas, workers, peers;
        int status_y;           /* last row: keys, filter */
        bool sparklines;        /* wide enough for the bandwidth sparkline after the peer columns */
        int sparkline_width;
        bool shown[_TOP_TABLE_MAX][TOP_COLUMNS_MAX]; /* columns that fit */
        int width[_TOP_TABLE_MAX];                   /* characters of a line of each table */
} TopLayout;

/* Lays out rows x cols for the model's current content: the header, then arenas,
 * workers and peers. Workers and peers get room first, then arenas; every section
 * keeps its title row. In each table the columns that fit `cols` are kept. */
TopLayout top_layout(int rows, int cols, const TopModel *m);
/* Whether the layout shows the column titled `title` of table t. */
bool top_layout_shows(const TopLayout *l, TopTable t, const char *title);
/* One line of table t: the titles (row NULL) or a row's cells, the columns the layout
 * keeps, at most l->width[t] characters (ASCII). */
char *top_table_line(const TopModel *m, const TopLayout *l, TopTable t, const void *row, char *buf, size_t size);
/* The header's lines (the handoffs and features of the last interval), cut to cols. */
#define TOP_HEADER_LINES 3
void top_header_line(const TopModel *m, int line, int cols, char *buf, size_t size);

/* One JSON object: the snapshot with derived rates (what --json prints). */
int top_model_json(const TopModel *m, FILE *f);
