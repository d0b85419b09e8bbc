/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdtop: live view of epdd, like top/nvtop: arenas, features, handoffs, peer paths
 * (bandwidth, RTT, retransmits, backpressure) and workers. Reads the daemon over its
 * bus API and the BPF maps it pinned; all arithmetic and layout is in epdtop-model.c.
 *
 *   epdtop                      interactive (q quit, s sort, r reverse, / filter, p pause)
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
                        read_cluster(src, s);
                }
        }
        if (src->pin_dir[0])
                (void)top_pins_read(src->pin_dir, s);
}

/* ---- text output (batch) ---- */

static void print_text(const TopModel *m) {
        const TopSnapshot *s = &m->cur;
        char b1[32], b2[32], b3[32];

        printf("epdtop: host %s, epdd %s, %s; kernel telemetry %s%s%s", s->host[0] ? s->host : "?",
               s->version[0] ? s->version : "?", s->bus ? "connected" : "daemon not reachable",
               s->kernel ? "on" : "off", s->kernel_unavailable[0] ? ": " : "", s->kernel_unavailable);
        printf("%s%s\n", s->membership[0] ? "; membership " : "", s->membership);
        printf("ARENAS\n%-16s %-6s %-8s %10s %8s %8s %8s %8s\n", "NAME", "DOMAIN", "USAGE", "SIZE", "USED",
               "FREE", "SHARED", "LEASED");
        for (size_t i = 0; i < s->n_arenas; i++) {
                const TopArena *a = &s->arenas[i];
                if (a->have_pages)
                        printf("%-16s %-6s %-8s %10s %8lu %8lu %8lu %8lu\n", a->name, a->domain, a->usage,
                               top_format_bytes(b1, sizeof b1, (double)a->size), (unsigned long)a->pages_used,
                               (unsigned long)a->pages_free, (unsigned long)a->pages_shared,
                               (unsigned long)a->pages_leased);
                else
                        printf("%-16s %-6s %-8s %10s %8s %8s %8s %8s\n", a->name, a->domain, a->usage,
                               top_format_bytes(b1, sizeof b1, (double)a->size), "-", "-", "-", "-");
        }
        printf("PEERS\n%-16s %5s %10s %8s %8s %8s %8s %-9s %-7s %6s %s\n", "NAME", "CONNS", "BANDWIDTH", "SRTT",
               "MINRTT", "RETR/S", "QUEUE", "LEVEL", "LEASE", "SHARE", "REASON");
        for (size_t i = 0; i < m->n_order; i++) {
                const TopPeer *p = top_model_peer(m, i);
                char share[16] = "-";
                if (p->lease[0])
                        snprintf(share, sizeof share, "%.1f%%", p->share_permille / 10.0);
                printf("%-16s %5u %10s %8s %8s %8.1f %8s %-9s %-7s %6s %s\n", p->name, p->conns,
                       top_format_rate(b1, sizeof b1, p->bandwidth), top_format_usec(b2, sizeof b2, p->srtt_us),
                       top_format_usec(b3, sizeof b3, p->min_rtt_us), p->retransmits_per_sec,
                       top_format_bytes((char[32]){}, 32, (double)p->send_queue), top_level_to_string(p->level),
                       p->lease[0] ? p->lease : "-", share, p->reason);
        }
        printf("WORKERS\n%-34s %-10s %-24s %-8s %s\n", "ID", "ROLE", "MODEL", "DEVICE", "PID");
        for (size_t i = 0; i < s->n_workers; i++) {
                const TopWorker *w = &s->workers[i];
                printf("%-34s %-10s %-24s %-8s %u\n", w->id, w->role, w->model, w->device, w->pid);
        }
        printf("\n");
        fflush(stdout);
}

/* ---- curses ---- */

enum { PAIR_NONE = 1, PAIR_ELEVATED, PAIR_HIGH, PAIR_STALLED, PAIR_TITLE };

static void draw(const TopModel *m, bool paused, const char *prompt) {
        int rows, cols;
        char b1[32], b2[32], b3[32], b4[32];

        getmaxyx(stdscr, rows, cols);
        erase();
        TopLayout l = top_layout(rows, cols, m);
        if (l.too_small) {
                mvaddnstr(0, 0, "epdtop: terminal too small", cols);
                refresh();
                return;
        }
        const TopSnapshot *s = &m->cur;

        mvprintw(0, 0, "epdtop - host %s  epdd %s  %s  kernel telemetry: %s%s%s", s->host[0] ? s->host : "?",
                 s->version[0] ? s->version : "?", s->bus ? "" : "[daemon not reachable]",
                 s->kernel ? "on" : (s->kernel_unavailable[0] ? s->kernel_unavailable : "off"),
                 s->membership[0] ? "  membership: " : "", s->membership);
        if (s->features.known)
                mvprintw(1, 0, "features: %.0f%% hit, %s", s->features.hit_rate * 100,
                         top_format_bytes(b1, sizeof b1, (double)s->features.bytes));
        else
                mvprintw(1, 0, "features: -");
        if (s->handoffs.known)
                printw("   handoffs: %lu in flight, %s, %.1f failures/s", (unsigned long)s->handoffs.in_flight,
                       top_format_rate(b2, sizeof b2, s->handoffs.throughput), s->handoffs.failures_per_sec);
        else
                printw("   handoffs: -");
        printw("   ring events: %lu", (unsigned long)s->ring_events);

        attron(A_BOLD | COLOR_PAIR(PAIR_TITLE));
        mvprintw(l.arenas.y, 0, "%-16s %-6s %-8s %10s %8s %8s %8s %8s", "ARENA", "DOMAIN", "USAGE", "SIZE", "USED",
                 "FREE", "SHARED", "LEASED");
        attroff(A_BOLD | COLOR_PAIR(PAIR_TITLE));
        for (size_t i = 0; i < l.arenas.shown; i++) {
                const TopArena *a = &s->arenas[i];
                mvprintw(l.arenas.y + 1 + (int)i, 0, "%-16s %-6s %-8s %10s", a->name, a->domain, a->usage,
                         top_format_bytes(b1, sizeof b1, (double)a->size));
                if (a->have_pages)
                        printw(" %8lu %8lu %8lu %8lu", (unsigned long)a->pages_used, (unsigned long)a->pages_free,
                               (unsigned long)a->pages_shared, (unsigned long)a->pages_leased);
                else
                        printw(" %8s %8s %8s %8s", "-", "-", "-", "-");
        }
        if (l.arenas.hidden && l.arenas.height > 1)
                mvprintw(l.arenas.y + 1 + (int)l.arenas.shown, 0, "  (+%zu more)", l.arenas.hidden);

        attron(A_BOLD | COLOR_PAIR(PAIR_TITLE));
        mvprintw(l.peers.y, 0, "%-16s %5s %10s %8s %8s %8s %8s %-9s", "PEER", "CONNS", "BANDWIDTH", "SRTT",
                 "MINRTT", "RETR/S", "QUEUE", "LEVEL");
        if (l.reason_column)
                printw(" %-19s", "REASON");
        if (l.transport_column)
                printw(" %-9s", "TRANSPORT");
        if (l.transport_column && s->membership[0])
                printw(" %-7s", "LEASE");
        if (l.sparklines)
                printw(" BANDWIDTH HISTORY");
        attroff(A_BOLD | COLOR_PAIR(PAIR_TITLE));
        for (size_t i = 0; i < l.peers.shown; i++) {
                const TopPeer *p = top_model_peer(m, i);
                int y = l.peers.y + 1 + (int)i;
                mvprintw(y, 0, "%-16.16s %5u %10s %8s %8s %8.1f %8s ", p->name, p->conns,
                         top_format_rate(b1, sizeof b1, p->bandwidth), top_format_usec(b2, sizeof b2, p->srtt_us),
                         top_format_usec(b3, sizeof b3, p->min_rtt_us), p->retransmits_per_sec,
                         top_format_bytes(b4, sizeof b4, (double)p->send_queue));
                attron(COLOR_PAIR(PAIR_NONE + (int)MIN(p->level, 3u)) | (p->level >= 2 ? A_BOLD : 0));
                printw("%-9s", top_level_to_string(p->level));
                attroff(COLOR_PAIR(PAIR_NONE + (int)MIN(p->level, 3u)) | A_BOLD);
                if (l.reason_column)
                        printw(" %-19.19s", p->reason);
                if (l.transport_column)
                        printw(" %-9.9s", p->transport[0] ? p->transport : "-");
                if (l.transport_column && s->membership[0])
                        printw(" %-7.7s", p->lease[0] ? p->lease : "-");
                if (l.sparklines) {
                        char spark[3 * 64 + 1];
                        printw(" %s", top_sparkline(&p->bandwidth_history, (size_t)l.sparkline_width, spark,
                                                     sizeof spark));
                }
        }
        if (l.peers.hidden && l.peers.height > 1)
                mvprintw(l.peers.y + 1 + (int)l.peers.shown, 0, "  (+%zu more)", l.peers.hidden);

        attron(A_BOLD | COLOR_PAIR(PAIR_TITLE));
        if (l.workers.height > 0)
                mvprintw(l.workers.y, 0, "%-34s %-10s %-24s %-8s %s", "WORKER", "ROLE", "MODEL", "DEVICE", "PID");
        attroff(A_BOLD | COLOR_PAIR(PAIR_TITLE));
        for (size_t i = 0; i < l.workers.shown; i++) {
                const TopWorker *w = &s->workers[i];
                mvprintw(l.workers.y + 1 + (int)i, 0, "%-34.34s %-10s %-24.24s %-8.8s %u", w->id, w->role,
                         w->model, w->device, w->pid);
        }
        if (l.workers.hidden && l.workers.height > 1)
                mvprintw(l.workers.y + 1 + (int)l.workers.shown, 0, "  (+%zu more)", l.workers.hidden);

        move(l.status_y, 0);
        attron(A_REVERSE);
        if (prompt)
                printw("filter: %s", prompt);
        else
                printw(" q quit  s sort:%s  r reverse  / filter%s%s  p %s ", top_sort_key_to_string(m->sort),
                       m->filter[0] ? ":" : "", m->filter, paused ? "resume [PAUSED]" : "pause");
        attroff(A_REVERSE);
        refresh();
}

static volatile sig_atomic_t stop;
static void on_signal(int sig) {
        stop = 1;
}

static int run_interactive(Source *src, TopModel *m) {
        bool paused = false, editing = false;
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
                        draw(m, paused, editing ? input : NULL);
                }
                int ch = getch();
                if (ch == ERR)
                        continue;
                if (editing) {
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
                draw(m, paused, editing ? input : NULL);
        }
        endwin();
        return 0;
}

static void help(void) {
        printf("Usage: epdtop [OPTIONS]\n\n"
               "Live view of epdd: arenas, features, handoffs, peer paths, workers.\n\n"
               "  -A --address=ADDR     direct:PATH, bus:ADDRESS or system (as epdctl)\n"
               "  -d --delay=SECONDS    between updates (default 1)\n"
               "  -n --iterations=N     stop after N updates\n"
               "  -b --batch            print text snapshots instead of the live view\n"
               "  -j --json             print JSON snapshots, one per line\n"
               "     --pins=DIR         read the pinned BPF maps from DIR (default: the daemon's)\n"
               "     --sort=KEY         name, bandwidth, rtt, retransmits, level\n"
               "     --filter=TEXT      only peers whose name, reason or transport contain TEXT\n"
               "  -h --help\n\n"
               "Keys: q quit, s next sort key, r reverse, / filter (Enter to apply), c clear filter,\n"
               "      p or space pause.\n");
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
                default:
                        return 1;
                }
        snprintf(src.pin_dir, sizeof src.pin_dir, "%s", arg_pins ? arg_pins : EPD_TELEMETRY_PIN_DIR);

        signal(SIGINT, on_signal);
        signal(SIGTERM, on_signal);

        int r = 0;
        if (arg_batch || arg_json) {
                long n = arg_iterations > 0 ? arg_iterations : 1;
                for (long i = 0; i < n && !stop; i++) {
                        if (i > 0)
                                usleep((useconds_t)(arg_delay * 1e6));
                        TopSnapshot s;
                        poll_sources(&src, &s);
                        if (top_model_update(&m, &s) < 0) {
                                r = -ENOMEM;
                                break;
                        }
                        if (arg_json)
                                (void)top_model_json(&m, stdout);
                        else
                                print_text(&m);
                        fflush(stdout);
                }
                if (!m.cur.bus && !m.cur.pins) {
                        fprintf(stderr, "epdtop: neither the daemon nor pinned maps are reachable\n");
                        r = -ENOTCONN;
                }
        } else
                r = run_interactive(&src, &m);

        top_model_done(&m);
        epd_disconnect(src.client);
        return r < 0 ? 1 : 0;
}
