/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdtop: live view of epdd, like top/nvtop: the serving side (each worker's pages,
 * handoffs in and out, features produced and hit; handoff latency P50/P99 and the
 * feature hit rate over the last interval), arenas, and the peer paths (bandwidth, RTT,
 * retransmits, backpressure, transport). Reads the daemon over its bus API and the BPF
 * maps it pinned; all arithmetic and layout is in epdtop-model.c. epdtop(1).
 *
 *   epdtop                      interactive (? help, q quit, s sort, r reverse, / filter, p pause)
 *   epdtop --batch -n 3         three text snapshots, one per delay
 *   epdtop --json -n 2          JSON snapshots, one per line (rates from the 2nd on) */
#include <curses.h>
#include <errno.h>
#include <getopt.h>
#include <locale.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bpf/epd-telemetry.h"
#include "epd-internal.h"
#include "epdtop-model.h"
#include "epdtop-pins.h"
#include "macro.h"
#include "tool-connect.h"

static const char *arg_address = NULL;
static const char *arg_pins = NULL;
static double arg_delay = 1.0;
static long arg_iterations = -1;
static bool arg_batch = false, arg_json = false;

typedef struct Source {
        epd_client *client;
        char pin_dir[256];
} Source;

static void copy(char *dst, size_t n, const char *src) {
        snprintf(dst, n, "%s", src ? src : "");
}

static int get_property(Source *src, const char *path, const char *iface, const char *prop,
                        const char *type, sd_bus_message **reply) {
        return sd_bus_get_property(src->client->bus, EPD_DESTINATION(src->client), path, iface, prop, NULL,
                                   reply, type);
}

/* org.epd1.Worker.Stats and Name of one worker. */
static int read_worker_stats(Source *src, const char *path, TopWorker *w) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        char *name = NULL;
        if (sd_bus_get_property_string(src->client->bus, EPD_DESTINATION(src->client), path, "org.epd1.Worker", "Name",
                                       NULL, &name) >= 0) {
                copy(w->name, sizeof w->name, name);
                free(name);
        }
        int r = get_property(src, path, "org.epd1.Worker", "Stats", "a{st}", &reply);
        if (r >= 0)
                r = sd_bus_message_enter_container(reply, 'a', "{st}");
        if (r < 0)
                return r; /* an older daemon: the columns show "-" */
        const char *k;
        uint64_t v;
        const struct {
                const char *key;
                uint64_t *dst;
        } keys[] = {
                { "sequences", &w->sequences },           { "pages", &w->pages },
                { "handoffs_out", &w->handoffs_out },     { "handoffs_in", &w->handoffs_in },
                { "features_produced", &w->features_produced }, { "feature_hits", &w->feature_hits },
                { "feature_misses", &w->feature_misses },
        };
        while ((r = sd_bus_message_read(reply, "{st}", &k, &v)) > 0)
                for (size_t i = 0; i < ELEMENTSOF(keys); i++)
                        if (strcmp(k, keys[i].key) == 0)
                                *keys[i].dst = v;
        w->have_stats = r >= 0;
        return r;
}

/* The feature cache (org.epd1.Feature) and the handoffs (org.epd1.Handoffs): counters,
 * and the duration histogram of every path summed. */
static void read_serving(Source *src, TopSnapshot *s) {
        sd_bus *bus = src->client->bus;
        const char *dest = EPD_DESTINATION(src->client);
        TopFeatures *f = &s->features;
        f->known = sd_bus_get_property_trivial(bus, dest, "/org/epd1/feature", "org.epd1.Feature", "Hits", NULL, 't',
                                               &f->hits) >= 0 &&
                   sd_bus_get_property_trivial(bus, dest, "/org/epd1/feature", "org.epd1.Feature", "Misses", NULL, 't',
                                               &f->misses) >= 0;
        (void)sd_bus_get_property_trivial(bus, dest, "/org/epd1/feature", "org.epd1.Feature", "BytesCached", NULL, 't',
                                          &f->bytes);
        (void)sd_bus_get_property_trivial(bus, dest, "/org/epd1/feature", "org.epd1.Feature", "Features", NULL, 't',
                                          &f->entries);

        _cleanup_(sd_bus_message_unrefp) sd_bus_message *counters = NULL, *paths = NULL;
        TopHandoffs *h = &s->handoffs;
        if (get_property(src, "/org/epd1/handoffs", "org.epd1.Handoffs", "Counters", "a{st}", &counters) >= 0 &&
            sd_bus_message_enter_container(counters, 'a', "{st}") >= 0) {
                const char *k;
                uint64_t v;
                h->known = true;
                while (sd_bus_message_read(counters, "{st}", &k, &v) > 0) {
                        if (strcmp(k, "live") == 0)
                                h->in_flight = v;
                        else if (strcmp(k, "committed") == 0)
                                h->completed = v;
                        else if (strcmp(k, "rolled-back") == 0)
                                h->failed = v;
                        else if (strcmp(k, "bytes") == 0)
                                h->bytes = v;
                }
        }
        if (!h->known ||
            get_property(src, "/org/epd1/handoffs", "org.epd1.Handoffs", "Paths", "a(ssttttttat)", &paths) < 0 ||
            sd_bus_message_enter_container(paths, 'a', "(ssttttttat)") < 0)
                return;
        h->have_durations = true;
        while (sd_bus_message_enter_container(paths, 'r', "ssttttttat") > 0) {
                const uint64_t *counts;
                size_t size;
                if (sd_bus_message_skip(paths, "sstttttt") < 0 ||
                    sd_bus_message_read_array(paths, 't', (const void **)&counts, &size) < 0) {
                        h->have_durations = false;
                        break;
                }
                for (size_t i = 0; i < MIN(size / sizeof(uint64_t), (size_t)HISTOGRAM_BUCKETS + 1); i++)
                        h->durations[i] += counts[i];
                if (sd_bus_message_exit_container(paths) < 0)
                        break;
        }
}

/* The peers the daemon is configured with (org.epd1.Peer): their state and transport,
 * and a row for those the kernel telemetry has nothing on (down ones). */
static void read_peer_list(Source *src, TopSnapshot *s) {
        epd_peer *peers = NULL;
        size_t n = 0;
        if (epd_list_peers(src->client, &peers, &n) < 0)
                return;
        for (size_t i = 0; i < n; i++) {
                TopPeer *p = top_snapshot_find_peer(s, peers[i].host_id);
                if (!p)
                        p = top_snapshot_find_peer(s, peers[i].name);
                if (!p) {
                        p = top_snapshot_add_peer(s);
                        if (!p)
                                break;
                        copy(p->name, sizeof p->name, peers[i].host_id);
                }
                copy(p->state, sizeof p->state, peers[i].state);
                if (!p->transport[0])
                        copy(p->transport, sizeof p->transport, peers[i].transport);
                if (!p->transport_why[0])
                        copy(p->transport_why, sizeof p->transport_why, peers[i].path_reason);
        }
        epd_peers_free(peers, n);
}

static int read_manager(Source *src, TopSnapshot *s) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *arenas = NULL, *workers = NULL;
        char *str = NULL;
        int r;

        r = sd_bus_get_property_string(src->client->bus, EPD_DESTINATION(src->client), "/org/epd1",
                                       "org.epd1.Manager", "Version", NULL, &str);
        if (r < 0)
                return r;
        copy(s->version, sizeof s->version, str);
        free(str);
        if (sd_bus_get_property_string(src->client->bus, EPD_DESTINATION(src->client), "/org/epd1",
                                       "org.epd1.Manager", "HostId", NULL, &str) >= 0) {
                copy(s->host, sizeof s->host, str);
                free(str);
        }

        r = get_property(src, "/org/epd1", "org.epd1.Manager", "Arenas", "a(ssstt)", &arenas);
        if (r >= 0)
                r = sd_bus_message_enter_container(arenas, 'a', "(ssstt)");
        while (r > 0) {
                const char *name, *domain, *usage;
                uint64_t size, off;
                r = sd_bus_message_read(arenas, "(ssstt)", &name, &domain, &usage, &size, &off);
                if (r <= 0)
                        break;
                TopArena *a = top_snapshot_add_arena(s);
                if (!a)
                        break;
                copy(a->name, sizeof a->name, name);
                copy(a->domain, sizeof a->domain, domain);
                copy(a->usage, sizeof a->usage, usage);
                a->size = size;
        }

        /* Page pools of KV arenas (org.epd1.Pages), when the daemon has them. */
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *pools = NULL;
        r = get_property(src, "/org/epd1/pages", "org.epd1.Pages", "Pools", "a(sttttttttttt)", &pools);
        if (r >= 0)
                r = sd_bus_message_enter_container(pools, 'a', "(sttttttttttt)");
        while (r > 0) {
                const char *name;
                uint64_t page_size, total, free_pages, live, cached, shared, leased, cow, saved, ev, fails;
                r = sd_bus_message_read(pools, "(sttttttttttt)", &name, &page_size, &total, &free_pages, &live,
                                        &cached, &shared, &leased, &cow, &saved, &ev, &fails);
                if (r <= 0)
                        break;
                for (size_t i = 0; i < s->n_arenas; i++)
                        if (strcmp(s->arenas[i].name, name) == 0) {
                                TopArena *a = &s->arenas[i];
                                a->have_pages = true;
                                a->page_size = page_size;
                                a->pages_total = total;
                                a->pages_free = free_pages;
                                a->pages_used = total >= free_pages ? total - free_pages : 0;
                                a->pages_shared = shared;
                                a->pages_leased = leased;
                        }
        }

        r = get_property(src, "/org/epd1", "org.epd1.Manager", "Workers", "a(osssu)", &workers);
        if (r >= 0)
                r = sd_bus_message_enter_container(workers, 'a', "(osssu)");
        while (r > 0) {
                const char *path, *role, *model, *device;
                uint32_t pid;
                r = sd_bus_message_read(workers, "(osssu)", &path, &role, &model, &device, &pid);
                if (r <= 0)
                        break;
                TopWorker *w = top_snapshot_add_worker(s);
                if (!w)
                        break;
                const char *slash = strrchr(path, '/');
                copy(w->id, sizeof w->id, slash ? slash + 1 : path);
                copy(w->role, sizeof w->role, role);
                copy(w->model, sizeof w->model, model);
                copy(w->device, sizeof w->device, device);
                w->pid = pid;
                (void)read_worker_stats(src, path, w);
        }
        return 0;
}

static int read_peer_dict(sd_bus_message *m, TopPeer *p) {
        int r = sd_bus_message_enter_container(m, 'a', "{sv}");
        while (r > 0) {
                const char *key;
                r = sd_bus_message_enter_container(m, 'e', "sv");
                if (r <= 0)
                        break;
                r = sd_bus_message_read(m, "s", &key);
                if (r < 0)
                        return r;
                int b;
                const char *str;
                if (strcmp(key, "kernel") == 0 && (r = sd_bus_message_read(m, "v", "b", &b)) >= 0)
                        p->kernel = b;
                else if (strcmp(key, "connections") == 0)
                        r = sd_bus_message_read(m, "v", "u", &p->conns);
                else if (strcmp(key, "srtt_us") == 0)
                        r = sd_bus_message_read(m, "v", "u", &p->srtt_us);
                else if (strcmp(key, "min_rtt_us") == 0)
                        r = sd_bus_message_read(m, "v", "u", &p->min_rtt_us);
                else if (strcmp(key, "cwnd") == 0)
                        r = sd_bus_message_read(m, "v", "u", &p->cwnd);
                else if (strcmp(key, "bytes_acked") == 0)
                        r = sd_bus_message_read(m, "v", "t", &p->bytes_acked);
                else if (strcmp(key, "bytes_sent") == 0)
                        r = sd_bus_message_read(m, "v", "t", &p->bytes_sent);
                else if (strcmp(key, "retransmits") == 0)
                        r = sd_bus_message_read(m, "v", "t", &p->retransmits);
                else if (strcmp(key, "send_queue") == 0)
                        r = sd_bus_message_read(m, "v", "t", &p->send_queue);
                else if (strcmp(key, "level") == 0)
                        r = sd_bus_message_read(m, "v", "u", &p->level);
                else if (strcmp(key, "reason") == 0 && (r = sd_bus_message_read(m, "v", "s", &str)) >= 0)
                        copy(p->reason, sizeof p->reason, str);
                else if (strcmp(key, "transport") == 0 && (r = sd_bus_message_read(m, "v", "s", &str)) >= 0)
                        copy(p->transport, sizeof p->transport, str);
                else if (strcmp(key, "transport_why") == 0 &&
                         (r = sd_bus_message_read(m, "v", "s", &str)) >= 0)
                        copy(p->transport_why, sizeof p->transport_why, str);
                else
                        r = sd_bus_message_skip(m, "v");
                if (r < 0)
                        return r;
                r = sd_bus_message_exit_container(m);
                if (r >= 0)
                        r = 1;
        }
        if (r < 0)
                return r;
        return sd_bus_message_exit_container(m);
}

static int read_telemetry(Source *src, TopSnapshot *s) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL, *stats = NULL;
        sd_bus *bus = src->client->bus;
        const char *dest = EPD_DESTINATION(src->client);
        char *str = NULL;
        int b = 0, r;

        r = sd_bus_get_property_trivial(bus, dest, "/org/epd1/telemetry", "org.epd1.Telemetry",
                                        "KernelTelemetry", NULL, 'b', &b);
        if (r < 0)
                return r; /* a daemon without the telemetry subsystem */
        s->kernel = b;
        if (sd_bus_get_property_string(bus, dest, "/org/epd1/telemetry", "org.epd1.Telemetry",
                                       "KernelTelemetryUnavailable", NULL, &str) >= 0) {
                copy(s->kernel_unavailable, sizeof s->kernel_unavailable, str);
                free(str);
        }
        if (!arg_pins && sd_bus_get_property_string(bus, dest, "/org/epd1/telemetry", "org.epd1.Telemetry",
                                                    "PinDirectory", NULL, &str) >= 0) {
                copy(src->pin_dir, sizeof src->pin_dir, str);
                free(str);
        }

        if (sd_bus_call_method(bus, dest, "/org/epd1/telemetry", "org.epd1.Telemetry", "GetStats", NULL,
                               &stats, NULL) >= 0 &&
            sd_bus_message_enter_container(stats, 'a', "{st}") > 0) {
                const char *k;
                uint64_t v;
                while (sd_bus_message_read(stats, "{st}", &k, &v) > 0)
                        if (strcmp(k, "ring_events") == 0)
                                s->ring_events = v;
        }

        r = sd_bus_call_method(bus, dest, "/org/epd1/telemetry", "org.epd1.Telemetry", "GetPeers", NULL,
                               &reply, NULL);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(reply, 'a', "(sa{sv})");
        while (r > 0) {
                const char *name;
                r = sd_bus_message_enter_container(reply, 'r', "sa{sv}");
                if (r <= 0)
                        break;
                r = sd_bus_message_read(reply, "s", &name);
                if (r < 0)
                        break;
                TopPeer *p = top_snapshot_add_peer(s);
                if (!p)
                        return -ENOMEM;
                copy(p->name, sizeof p->name, name);
                r = read_peer_dict(reply, p);
                if (r >= 0)
                        r = sd_bus_message_exit_container(reply);
                if (r >= 0)
                        r = 1;
        }
        return r < 0 ? r : 0;
}

/* Membership (org.epd1.Cluster): the source and etcd's state for the header, each
 * peer's lease and share of the directory. Absent without peers. */
static void read_cluster(Source *src, TopSnapshot *s) {
        epd_member *members = NULL;
        epd_cluster cl;
        size_t n = 0;

        if (epd_cluster_get(src->client, &cl) < 0)
                return;
        if (strcmp(cl.source, "etcd") == 0)
                snprintf(s->membership, sizeof s->membership, "etcd %s, %u alive", cl.etcd_state, cl.members_alive);
        else
                snprintf(s->membership, sizeof s->membership, "static");
        epd_cluster_done(&cl);
        if (epd_list_members(src->client, &members, &n) < 0)
                return;
        for (size_t i = 0; i < s->n_peers; i++)
                for (size_t k = 0; k < n; k++)
                        if (strcmp(s->peers[i].name, members[k].host_id) == 0) {
                                copy(s->peers[i].lease, sizeof s->peers[i].lease, members[k].lease);
                                s->peers[i].share_permille = members[k].share_permille;
                        }
        epd_members_free(members, n);
}

static void poll_sources(Source *src, TopSnapshot *s) {
        *s = (TopSnapshot){ .ts = now_usec(CLOCK_MONOTONIC) };

        if (!src->client && epd_connect(arg_address, &src->client) < 0)
                src->client = NULL;
        if (src->client) {
                if (read_manager(src, s) < 0) {
                        /* The daemon went away: reconnect on the next poll. */
                        src->client = epd_disconnect(src->client);
                        top_snapshot_done(s);
                        *s = (TopSnapshot){ .ts = now_usec(CLOCK_MONOTONIC) };
                } else {
                        s->bus = true;
                        (void)read_telemetry(src, s);
                        read_peer_list(src, s);
                        read_serving(src, s);
                        read_cluster(src, s); /* after the peers: it adds their leases */
                }
        }
        /* Maps of another layout are not read; why goes to the header and the JSON (and,
         * in batch mode, once to standard error), never over the curses screen. */
        if (src->pin_dir[0] && top_pins_read_why(src->pin_dir, s, s->pins_refused, sizeof s->pins_refused) != -EPROTO)
                s->pins_refused[0] = '\0';
}

/* ---- text output (batch) ---- */

static void print_text(const TopModel *m) {
        /* Every column, whatever the terminal: a snapshot for a file or a pipe. */
        TopLayout l = top_layout(1000, 1000, m);
        char line[1200];
        for (int i = 0; i < TOP_HEADER_LINES; i++) {
                top_header_line(m, i, 1000, line, sizeof line);
                printf("%s\n", line);
        }
        printf("%s\n", top_table_line(m, &l, TOP_TABLE_ARENAS, NULL, line, sizeof line));
        for (size_t i = 0; i < m->cur.n_arenas; i++)
                printf("%s\n", top_table_line(m, &l, TOP_TABLE_ARENAS, &m->cur.arenas[i], line, sizeof line));
        printf("%s\n", top_table_line(m, &l, TOP_TABLE_WORKERS, NULL, line, sizeof line));
        for (size_t i = 0; i < m->cur.n_workers; i++)
                printf("%s\n", top_table_line(m, &l, TOP_TABLE_WORKERS, &m->cur.workers[i], line, sizeof line));
        printf("%s\n", top_table_line(m, &l, TOP_TABLE_PEERS, NULL, line, sizeof line));
        for (size_t i = 0; i < m->n_order; i++)
                printf("%s\n", top_table_line(m, &l, TOP_TABLE_PEERS, top_model_peer(m, i), line, sizeof line));
        printf("\n");
        fflush(stdout);
}

/* ---- curses ---- */

enum { PAIR_NONE = 1, PAIR_ELEVATED, PAIR_HIGH, PAIR_STALLED, PAIR_TITLE };

static void draw_title(const TopModel *m, const TopLayout *l, TopTable t, int y, int cols, const char *extra) {
        char line[1200];
        attron(A_BOLD | COLOR_PAIR(PAIR_TITLE));
        mvaddnstr(y, 0, top_table_line(m, l, t, NULL, line, sizeof line), cols);
        if (extra)
                addnstr(extra, MAX(cols - (int)strlen(line), 0));
        attroff(A_BOLD | COLOR_PAIR(PAIR_TITLE));
}

static void draw_more(const TopSection *s) {
        if (s->hidden && s->height > 1)
                mvprintw(s->y + 1 + (int)s->shown, 0, "  (+%zu more)", s->hidden);
}

static void draw(const TopModel *m, bool paused, const char *prompt) {
        int rows, cols;
        char line[1200];

        getmaxyx(stdscr, rows, cols);
        erase();
        TopLayout l = top_layout(rows, cols, m);
        if (l.too_small) {
                mvaddnstr(0, 0, "epdtop: terminal too small", cols);
                refresh();
                return;
        }
        const TopSnapshot *s = &m->cur;
        for (int i = 0; i < TOP_HEADER_LINES; i++) {
                top_header_line(m, i, cols, line, sizeof line);
                mvaddnstr(l.header_y + i, 0, line, cols);
        }

        draw_title(m, &l, TOP_TABLE_ARENAS, l.arenas.y, cols, NULL);
        for (size_t i = 0; i < l.arenas.shown; i++)
                mvaddnstr(l.arenas.y + 1 + (int)i, 0,
                          top_table_line(m, &l, TOP_TABLE_ARENAS, &s->arenas[i], line, sizeof line), cols);
        draw_more(&l.arenas);

        if (l.workers.height > 0)
                draw_title(m, &l, TOP_TABLE_WORKERS, l.workers.y, cols, NULL);
        for (size_t i = 0; i < l.workers.shown; i++)
                mvaddnstr(l.workers.y + 1 + (int)i, 0,
                          top_table_line(m, &l, TOP_TABLE_WORKERS, &s->workers[i], line, sizeof line), cols);
        draw_more(&l.workers);

        if (l.peers.height > 0)
                draw_title(m, &l, TOP_TABLE_PEERS, l.peers.y, cols, l.sparklines ? " BANDWIDTH HISTORY" : NULL);
        for (size_t i = 0; i < l.peers.shown; i++) {
                const TopPeer *p = top_model_peer(m, i);
                int y = l.peers.y + 1 + (int)i;
                top_table_line(m, &l, TOP_TABLE_PEERS, p, line, sizeof line);
                mvaddnstr(y, 0, line, cols);
                /* The level, coloured where it stands in the line. */
                const char *lv = top_level_to_string(p->level);
                const char *at = top_layout_shows(&l, TOP_TABLE_PEERS, "LEVEL") ? strstr(line + 16, lv) : NULL;
                if (at && p->level > 0) {
                        attron(COLOR_PAIR(PAIR_NONE + (int)MIN(p->level, 3u)) | (p->level >= 2 ? A_BOLD : 0));
                        mvaddnstr(y, (int)(at - line), lv, cols - (int)(at - line));
                        attroff(COLOR_PAIR(PAIR_NONE + (int)MIN(p->level, 3u)) | A_BOLD);
                }
                if (l.sparklines) {
                        char spark[3 * 64 + 1];
                        mvaddstr(y, l.width[TOP_TABLE_PEERS] + 1,
                                 top_sparkline(&p->bandwidth_history, (size_t)l.sparkline_width, spark, sizeof spark));
                }
        }
        draw_more(&l.peers);

        move(l.status_y, 0);
        attron(A_REVERSE);
        if (prompt)
                snprintf(line, sizeof line, "filter: %s", prompt);
        else
                snprintf(line, sizeof line, " ? help  q quit  s sort:%s  r reverse  / filter%s%s  p %s ",
                         top_sort_key_to_string(m->sort), m->filter[0] ? ":" : "", m->filter,
                         paused ? "resume [PAUSED]" : "pause");
        addnstr(line, cols);
        attroff(A_REVERSE);
        refresh();
}

static const char *const help_lines[] = {
        "epdtop - keys",
        "",
        "  ?          this help (any key closes it)",
        "  q          quit",
        "  s          sort the peers by the next key: name, bandwidth, rtt, retransmits, level",
        "  r          reverse the sort",
        "  /          filter the peers by name, reason or transport (Enter applies, Esc cancels)",
        "  c          clear the filter",
        "  p, space   pause / resume the updates",
        "",
        "Header: handoffs in flight and per second, KV bytes moved per second, the P50/P99",
        "Prepare-to-Commit latency and the feature cache's hit rate, over the last interval.",
        "WORKERS: PAGES KV pages its sequences hold; HO-OUT/HO-IN handoffs it prepared/accepted,",
        "HO/S both per second; FEAT-PROD features it published, FEAT-HIT/FEAT-MISS its lookups.",
        "PEERS: BANDWIDTH acked bytes/s, SRTT/MINRTT the kernel's RTT, RETR/S retransmits/s,",
        "QUEUE send queue, LEVEL backpressure (none, elevated, high, stalled) and its REASON,",
        "TRANSPORT tcp or rdma, STATE of the control connection; with cluster membership, LEASE",
        "(static, or in etcd: alive, missing, left) and SHARE of the block directory's hash",
        "space. Narrow terminals drop columns.",
        "See epdtop(1).",
};

static void draw_help(void) {
        int rows, cols;
        getmaxyx(stdscr, rows, cols);
        erase();
        for (size_t i = 0; i < ELEMENTSOF(help_lines) && (int)i < rows; i++)
                mvaddnstr((int)i, 0, help_lines[i], cols);
        refresh();
}

static volatile sig_atomic_t stop;
static void on_signal(int sig) {
        stop = 1;
}

static int run_interactive(Source *src, TopModel *m) {
        bool paused = false, editing = false, helping = false;
        char input[64] = "";
        usec_t next = 0;

        setlocale(LC_ALL, "");
        if (!initscr())
                return -EIO;
        cbreak();
        noecho();
        keypad(stdscr, TRUE);
        curs_set(0);
        timeout(100);
        if (has_colors()) {
                start_color();
                use_default_colors();
                init_pair(PAIR_NONE, COLOR_GREEN, -1);
                init_pair(PAIR_ELEVATED, COLOR_YELLOW, -1);
                init_pair(PAIR_HIGH, COLOR_RED, -1);
                init_pair(PAIR_STALLED, COLOR_MAGENTA, -1);
                init_pair(PAIR_TITLE, COLOR_CYAN, -1);
        }

        for (long n = 0; !stop && (arg_iterations < 0 || n < arg_iterations);) {
                usec_t now = now_usec(CLOCK_MONOTONIC);
                if (!paused && now >= next) {
                        TopSnapshot s;
                        poll_sources(src, &s);
                        (void)top_model_update(m, &s);
                        next = now + (usec_t)(arg_delay * 1e6);
                        n++;
                        if (helping)
                                draw_help();
                        else
                                draw(m, paused, editing ? input : NULL);
                }
                int ch = getch();
                if (ch == ERR)
                        continue;
                if (helping) {
                        if (ch != KEY_RESIZE)
                                helping = false;
                } else if (ch == '?' || ch == 'h' || ch == KEY_F(1))
                        helping = true;
                else if (editing) {
                        size_t l = strlen(input);
                        if (ch == '\n' || ch == KEY_ENTER) {
                                editing = false;
                                top_model_set_filter(m, input);
                        } else if (ch == 27) {
                                editing = false;
                        } else if ((ch == KEY_BACKSPACE || ch == 127 || ch == 8) && l > 0)
                                input[l - 1] = '\0';
                        else if (ch >= 0x20 && ch < 0x7f && l + 1 < sizeof input) {
                                input[l] = (char)ch;
                                input[l + 1] = '\0';
                        }
                } else if (ch == 'q' || ch == 'Q')
                        break;
                else if (ch == 's')
                        top_model_cycle_sort(m);
                else if (ch == 'r')
                        top_model_set_sort(m, m->sort, !m->reverse);
                else if (ch == 'p' || ch == ' ')
                        paused = !paused;
                else if (ch == '/') {
                        editing = true;
                        input[0] = '\0';
                } else if (ch == 'c')
                        top_model_set_filter(m, "");
                /* KEY_RESIZE and every key redraw with the new size. */
                if (helping)
                        draw_help();
                else
                        draw(m, paused, editing ? input : NULL);
        }
        endwin();
        return 0;
}

static void help(void) {
        printf("Usage: epdtop [OPTIONS]\n\n"
               "Live view of epdd: the serving side (workers' pages, handoffs and features; handoff\n"
               "latency and feature hit rate over the last interval), arenas, and the peer paths.\n\n"
               "  -A --address=ADDR     direct:PATH, bus:ADDRESS or system (as epdctl)\n"
               "  -d --delay=SECONDS    between updates (default 1)\n"
               "  -n --iterations=N     stop after N updates\n"
               "  -b --batch            print text snapshots instead of the live view\n"
               "  -j --json             print JSON snapshots, one per line\n"
               "     --pins=DIR         read the pinned BPF maps from DIR (default: the daemon's)\n"
               "     --sort=KEY         name, bandwidth, rtt, retransmits, level\n"
               "     --filter=TEXT      only peers whose name, reason or transport contain TEXT\n"
               "  -h --help             show this help\n"
               "     --version          show the version\n\n"
               "Keys: ? help, q quit, s next sort key, r reverse, / filter (Enter to apply), c clear\n"
               "      filter, p or space pause. See epdtop(1).\n");
}

int main(int argc, char *argv[]) {
        static const struct option options[] = {
                { "address", required_argument, NULL, 'A' },
                { "delay", required_argument, NULL, 'd' },
                { "iterations", required_argument, NULL, 'n' },
                { "batch", no_argument, NULL, 'b' },
                { "json", no_argument, NULL, 'j' },
                { "pins", required_argument, NULL, 'P' },
                { "sort", required_argument, NULL, 'S' },
                { "filter", required_argument, NULL, 'F' },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, 'V' },
                {},
        };
        TopModel m;
        Source src = {};
        int c;

        top_model_init(&m);
        while ((c = getopt_long(argc, argv, "A:d:n:bjh", options, NULL)) >= 0)
                switch (c) {
                case 'A':
                        arg_address = optarg;
                        break;
                case 'd':
                        arg_delay = atof(optarg);
                        if (!(arg_delay >= 0.05 && arg_delay <= 3600)) {
                                fprintf(stderr, "--delay must be between 0.05 and 3600 seconds\n");
                                return 1;
                        }
                        break;
                case 'n':
                        arg_iterations = atol(optarg);
                        if (arg_iterations <= 0) {
                                fprintf(stderr, "--iterations must be positive\n");
                                return 1;
                        }
                        break;
                case 'b':
                        arg_batch = true;
                        break;
                case 'j':
                        arg_json = true;
                        break;
                case 'P':
                        arg_pins = optarg;
                        break;
                case 'S': {
                        int k;
                        for (k = 0; k < _TOP_SORT_MAX; k++)
                                if (strcmp(optarg, top_sort_key_to_string(k)) == 0)
                                        break;
                        if (k == _TOP_SORT_MAX) {
                                fprintf(stderr, "Unknown sort key '%s'\n", optarg);
                                return 1;
                        }
                        m.sort = k;
                        break;
                }
                case 'F':
                        top_model_set_filter(&m, optarg);
                        break;
                case 'h':
                        help();
                        return 0;
                case 'V':
                        printf("epdtop " EPD_VERSION "\n");
                        return 0;
                default:
                        fprintf(stderr, "See epdtop --help.\n");
                        return 1;
                }
        if (optind < argc) {
                fprintf(stderr, "epdtop: unexpected argument '%s'; see epdtop --help.\n", argv[optind]);
                return 1;
        }
        if (tool_address_check("epdtop", arg_address) < 0)
                return 1;
        snprintf(src.pin_dir, sizeof src.pin_dir, "%s", arg_pins ? arg_pins : EPD_TELEMETRY_PIN_DIR);

        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);

        int r = 0;
        if (arg_batch || arg_json) {
                long n = arg_iterations > 0 ? arg_iterations : 1;
                char refused[sizeof m.cur.pins_refused] = "";
                for (long i = 0; i < n && !stop; i++) {
                        if (i > 0)
                                usleep((useconds_t)(arg_delay * 1e6));
                        TopSnapshot s;
                        poll_sources(&src, &s);
                        if (top_model_update(&m, &s) < 0) {
                                r = -ENOMEM;
                                break;
                        }
                        if (m.cur.pins_refused[0] && strcmp(m.cur.pins_refused, refused) != 0) {
                                fprintf(stderr, "epdtop: pinned maps not read: %s\n", m.cur.pins_refused);
                                snprintf(refused, sizeof refused, "%s", m.cur.pins_refused);
                        }
                        if (arg_json)
                                (void)top_model_json(&m, stdout);
                        else
                                print_text(&m);
                        fflush(stdout);
                }
                if (!m.cur.bus && !m.cur.pins) {
                        char where[512];
                        tool_address_describe(arg_address, where, sizeof where);
                        fprintf(stderr, "epdtop: neither the daemon (at %s) nor pinned maps (in %s) are reachable\n",
                                where, src.pin_dir);
                        r = -ENOTCONN;
                }
        } else
                r = run_interactive(&src, &m);

        top_model_done(&m);
        epd_disconnect(src.client);
        return r < 0 ? 1 : 0;
}
