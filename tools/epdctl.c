/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl: inspect and drive epdd from the command line. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "epd-internal.h"
#include "epdctl.h"
#include "macro.h"
#include "parse-util.h"
#include "time-util.h"
#include "tool-connect.h"

bool arg_json = false;
static const char *arg_address = NULL;

static void help(void) {
        printf("Usage: epdctl [OPTIONS] COMMAND [ARGS]\n\n"
               "Inspect and drive epdd. Options may come before or after the command.\n\n"
               "Commands:\n");
        for (const EpdctlVerb *v = epdctl_verbs; v->name; v++)
                printf("  %-22s %s\n", v->usage ? v->usage : v->name, v->help);
        printf("\nOptions:\n"
               "  -A --address=ADDR   direct:PATH, bus:ADDRESS or system (default: $EPD_SOCKET,\n"
               "                      $EPD_BUS_ADDRESS, /run/epd/bus, then the system bus)\n"
               "  -j --json           Print JSON for scripts\n"
               "  -h --help           Show this help (also: epdctl help)\n"
               "     --version        Show the version\n\n"
               "See epdctl(1).\n");
}

void json_string(FILE *f, const char *s) {
        fputc('"', f);
        for (; s && *s; s++) {
                unsigned char ch = (unsigned char)*s;
                if (ch == '"' || ch == '\\')
                        fprintf(f, "\\%c", ch);
                else if (ch < 0x20)
                        fprintf(f, "\\u%04x", ch);
                else
                        fputc(ch, f);
        }
        fputc('"', f);
}

int epdctl_fail(epd_client *c, int r, const char *what) {
        const char *name = epd_last_error_name(c), *msg = epd_last_error_message(c);
        if (name)
                fprintf(stderr, "%s: %s: %s\n", what, name, msg ? msg : "");
        else
                fprintf(stderr, "%s: %s\n", what, strerror(-r));
        return r;
}

int epdctl_get_property(epd_client *c, const char *path, const char *interface,
                        const char *property, const char *type, sd_bus_message **reply) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        epd__clear_error(c);
        int r = sd_bus_get_property(c->bus, EPD_DESTINATION(c), path, interface, property, &e,
                                    reply, type);
        if (r < 0)
                r = epd__error(c, r, &e);
        sd_bus_error_free(&e);
        return r;
}

static int get_u64(epd_client *c, const char *path, const char *iface, const char *prop, uint64_t *ret) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        int r = sd_bus_get_property_trivial(c->bus, EPD_DESTINATION(c), path, iface, prop, &e, 't', ret);
        sd_bus_error_free(&e);
        return r;
}

static char *get_string(epd_client *c, const char *path, const char *iface, const char *prop) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        char *s = NULL;
        if (sd_bus_get_property_string(c->bus, EPD_DESTINATION(c), path, iface, prop, &e, &s) < 0)
                s = NULL;
        sd_bus_error_free(&e);
        return s;
}

static void format_uptime(char *buf, size_t n, uint64_t sec) {
        if (sec >= 86400)
                snprintf(buf, n, "%" PRIu64 "d %" PRIu64 "h %" PRIu64 "min", sec / 86400, sec % 86400 / 3600,
                         sec % 3600 / 60);
        else if (sec >= 3600)
                snprintf(buf, n, "%" PRIu64 "h %" PRIu64 "min", sec / 3600, sec % 3600 / 60);
        else if (sec >= 60)
                snprintf(buf, n, "%" PRIu64 "min %" PRIu64 "s", sec / 60, sec % 60);
        else
                snprintf(buf, n, "%" PRIu64 "s", sec);
}

/* Daemon, uptime, where it serves and keeps its state, clients, workers by role, arenas,
 * peers (up of configured, with the worst backpressure), the metrics endpoint. */
static int verb_status(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *workers = NULL, *arenas = NULL;
        char *version = NULL, *host = NULL;
        uint32_t clients = 0;
        uint64_t started = 0;
        int r;
        if ((r = epd_get_version(c, &version)) < 0 || (r = epd_get_host_id(c, &host)) < 0)
                return epdctl_fail(c, r, "status");
        sd_bus_error e = SD_BUS_ERROR_NULL;
        (void)sd_bus_get_property_trivial(c->bus, EPD_DESTINATION(c), "/org/epd1", "org.epd1.Manager", "Clients", &e,
                                          'u', &clients);
        sd_bus_error_free(&e);
        (void)get_u64(c, "/org/epd1", "org.epd1.Manager", "StartedAt", &started);
        char *state = get_string(c, "/org/epd1", "org.epd1.Manager", "StateDirectory");
        char *sock = get_string(c, "/org/epd1", "org.epd1.Manager", "Socket");
        char *metrics = get_string(c, "/org/epd1", "org.epd1.Metrics", "Address");
        unsigned n_workers = 0, n_arenas = 0, by_role[8] = {};
        static const char *const roles[] = { "encoder", "prefill", "decode", "colocated", "scheduler" };
        if (epdctl_get_property(c, "/org/epd1", "org.epd1.Manager", "Workers", "a(osssu)", &workers) >= 0 &&
            sd_bus_message_enter_container(workers, 'a', "(osssu)") >= 0) {
                const char *path, *role, *model, *device;
                uint32_t pid;
                while (sd_bus_message_read(workers, "(osssu)", &path, &role, &model, &device, &pid) > 0) {
                        n_workers++;
                        for (size_t i = 0; i < ELEMENTSOF(roles); i++)
                                if (strcmp(role, roles[i]) == 0)
                                        by_role[i]++;
                }
        }
        if (epdctl_get_property(c, "/org/epd1", "org.epd1.Manager", "Arenas", "a(ssstt)", &arenas) >= 0 &&
            sd_bus_message_enter_container(arenas, 'a', "(ssstt)") >= 0)
                while (sd_bus_message_skip(arenas, "(ssstt)") > 0)
                        n_arenas++;
        epd_peer *peers = NULL;
        size_t n_peers = 0, n_up = 0;
        if (epd_list_peers(c, &peers, &n_peers) < 0)
                n_peers = 0;
        for (size_t i = 0; i < n_peers; i++)
                n_up += strcmp(peers[i].state, "up") == 0;
        EpdctlPath *paths = NULL;
        size_t n_paths = 0;
        if (epdctl_read_paths(c, &paths, &n_paths) < 0)
                n_paths = 0;
        const EpdctlPath *worst = NULL;
        for (size_t i = 0; i < n_paths; i++)
                if (!worst || paths[i].level > worst->level)
                        worst = &paths[i];
        uint64_t now = now_usec(CLOCK_REALTIME), up = started && now > started ? (now - started) / USEC_PER_SEC : 0;
        /* The event loop's stalls: dispatches of 1 ms or longer. */
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *stalls_msg = NULL;
        uint64_t stalls = 0, stall_max = 0, stall_at = 0;
        const char *stall_what = "";
        if (epdctl_get_property(c, "/org/epd1", "org.epd1.Manager", "LoopStalls", "(ttst)", &stalls_msg) < 0 ||
            sd_bus_message_read(stalls_msg, "(ttst)", &stalls, &stall_max, &stall_what, &stall_at) < 0)
                stall_what = "";

        if (arg_json) {
                printf("{\"version\":");
                json_string(stdout, version);
                printf(",\"host_id\":");
                json_string(stdout, host);
                printf(",\"started_at_usec\":%" PRIu64 ",\"uptime_sec\":%" PRIu64 ",\"socket\":", started, up);
                json_string(stdout, sock ?: "");
                printf(",\"state_directory\":");
                json_string(stdout, state ?: "");
                printf(",\"clients\":%u,\"workers\":%u,\"workers_by_role\":{", clients, n_workers);
                for (size_t i = 0; i < ELEMENTSOF(roles); i++)
                        printf("%s\"%s\":%u", i ? "," : "", roles[i], by_role[i]);
                printf("},\"arenas\":%u,\"peers\":%zu,\"peers_up\":%zu,\"backpressure\":[", n_arenas, n_peers, n_up);
                for (size_t i = 0; i < n_paths; i++) {
                        printf("%s{\"peer\":", i ? "," : "");
                        json_string(stdout, paths[i].peer);
                        printf(",\"level\":");
                        json_string(stdout, paths[i].level_name);
                        printf(",\"reason\":");
                        json_string(stdout, paths[i].reason);
                        printf("}");
                }
                printf("],\"loop_stalls\":%" PRIu64 ",\"loop_stall_max_usec\":%" PRIu64 ",\"loop_stall_max_what\":",
                       stalls, stall_max);
                json_string(stdout, stall_what);
                printf(",\"loop_stall_max_at_usec\":%" PRIu64 ",\"metrics\":", stall_at);
                json_string(stdout, metrics ?: "");
                printf("}\n");
        } else {
                char b[64];
                format_uptime(b, sizeof b, up);
                printf("epdd %s on host %s, up %s\n", version, host, b);
                printf("  socket:       %s\n  state:        %s\n", sock ?: "?", state ?: "?");
                printf("  clients:      %u\n  workers:      %u", clients, n_workers);
                bool first = true;
                for (size_t i = 0; i < ELEMENTSOF(roles); i++)
                        if (by_role[i]) {
                                printf("%s%u %s", first ? " (" : ", ", by_role[i], roles[i]);
                                first = false;
                        }
                printf("%s\n  arenas:       %u\n", first ? "" : ")", n_arenas);
                if (n_peers == 0)
                        printf("  peers:        none configured\n");
                else {
                        printf("  peers:        %zu of %zu up", n_up, n_peers);
                        for (size_t i = 0; i < n_peers; i++)
                                printf("%s%s %s", i ? ", " : " (", peers[i].host_id, peers[i].state);
                        printf(")\n");
                }
                if (!worst || worst->level == 0)
                        printf("  backpressure: none%s\n", n_paths ? "" : " (no peer paths)");
                else
                        printf("  backpressure: %s to %s (%s)%s\n", worst->level_name, worst->peer, worst->reason,
                               n_paths > 1 ? "; epdctl paths shows every peer" : "");
                if (stalls == 0)
                        printf("  event loop:   no dispatch held it 1 ms or longer\n");
                else
                        printf("  event loop:   %" PRIu64 " dispatch%s held it 1 ms or longer; the longest %" PRIu64
                               ".%03" PRIu64 " ms, %s\n",
                               stalls, stalls == 1 ? "" : "es", stall_max / 1000, stall_max % 1000, stall_what);
                printf("  metrics:      %s\n", metrics && *metrics ? metrics : "off ([Metrics] Listen= in epd.conf)");
        }
        epd_peers_free(peers, n_peers);
        free(paths);
        free(version);
        free(host);
        free(state);
        free(sock);
        free(metrics);
        return 0;
}

static int verb_workers(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r = epdctl_get_property(c, "/org/epd1", "org.epd1.Manager", "Workers", "a(osssu)", &reply);
        if (r < 0)
                return epdctl_fail(c, r, "workers");
        r = sd_bus_message_enter_container(reply, 'a', "(osssu)");
        if (r < 0)
                return r;
        if (arg_json)
                printf("[");
        else
                printf("%-34s %-10s %-24s %-8s %s\n", "ID", "ROLE", "MODEL", "DEVICE", "PID");
        const char *path, *role, *model, *device;
        uint32_t pid;
        bool first = true;
        while ((r = sd_bus_message_read(reply, "(osssu)", &path, &role, &model, &device, &pid)) > 0) {
                const char *id = strrchr(path, '/') + 1;
                if (arg_json) {
                        printf("%s{\"id\":", first ? "" : ",");
                        json_string(stdout, id);
                        printf(",\"path\":");
                        json_string(stdout, path);
                        printf(",\"role\":");
                        json_string(stdout, role);
                        printf(",\"model\":");
                        json_string(stdout, model);
                        printf(",\"device\":");
                        json_string(stdout, device);
                        printf(",\"pid\":%u}", pid);
                } else
                        printf("%-34s %-10s %-24s %-8s %u\n", id, role, model, device, pid);
                first = false;
        }
        if (arg_json)
                printf("]\n");
        return r < 0 ? r : 0;
}

static int verb_arenas(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r = epdctl_get_property(c, "/org/epd1", "org.epd1.Manager", "Arenas", "a(ssstt)", &reply);
        if (r < 0)
                return epdctl_fail(c, r, "arenas");
        r = sd_bus_message_enter_container(reply, 'a', "(ssstt)");
        if (r < 0)
                return r;
        if (arg_json)
                printf("[");
        else
                printf("%-16s %-6s %-8s %10s %12s\n", "NAME", "DOMAIN", "USAGE", "SIZE", "DATA_OFFSET");
        const char *name, *domain, *usage;
        uint64_t size, off;
        bool first = true;
        while ((r = sd_bus_message_read(reply, "(ssstt)", &name, &domain, &usage, &size, &off)) > 0) {
                if (arg_json) {
                        printf("%s{\"name\":", first ? "" : ",");
                        json_string(stdout, name);
                        printf(",\"domain\":");
                        json_string(stdout, domain);
                        printf(",\"usage\":");
                        json_string(stdout, usage);
                        printf(",\"size\":%" PRIu64 ",\"data_offset\":%" PRIu64 "}", size, off);
                } else {
                        char s[32];
                        printf("%-16s %-6s %-8s %10s %12" PRIu64 "\n", name, domain, usage,
                               format_size(s, sizeof s, size), off);
                }
                first = false;
        }
        if (arg_json)
                printf("]\n");
        return r < 0 ? r : 0;
}

int verb_handoffs(epd_client *c, int argc, char **argv); /* epdctl-handoff.c */

static int verb_help(epd_client *c, int argc, char **argv) {
        help();
        return 0;
}

/* -- verb table: subsystems add their verbs in their own files (epdctl.h) -- */
const EpdctlVerb epdctl_verbs[] = {
        { "status", NULL, "Daemon, uptime, socket, state, clients, workers, arenas, peers, backpressure", verb_status },
        { "workers", NULL, "Registered workers", verb_workers },
        { "arenas", NULL, "Memory arenas", verb_arenas },
        { "pages", NULL, "KV page pools per arena and the block directory", verb_pages },
        { "sequences", NULL, "KV sequences: owner, arena, pages, sharing", verb_sequences },
        { "features", NULL, "Feature cache: hits, misses, coalesced waits, bytes, evictions", verb_features },
        { "handoffs", NULL, "Handoffs in flight and their counters", verb_handoffs },
        { "trace", "trace REQUEST_ID", "One request's path with timings, encode to decode", verb_trace, 1, 1 },
        { "paths", NULL, "Peer paths as the kernel sees them: RTT, retransmits, backpressure", verb_paths },
        { "scheduler", NULL, "Admission pools: queues, rates, rho, verdicts and their reasons", verb_scheduler },
        { "journal", NULL, "The WAL (sync policy, LSNs, size) and the number of workflows", verb_journal },
        /* -- more verbs -- */
        { "peers", NULL, "Peer hosts: state, streams, and the path to each with its reason", verb_peers },
        { "gpus", NULL, "GPUs of the GPU domain and their peer access", verb_gpus },
        { "cluster", NULL, "Membership: static or etcd, etcd's state, each member's lease and directory shard", verb_cluster },
        { "placement", "placement HASH...", "Which host and worker hold the longest cached prefix of these block hashes", verb_placement, 1, 65536 },
        { "help", NULL, "Show this help", verb_help },
        {},
};

int main(int argc, char *argv[]) {
        enum { ARG_VERSION = 0x100 };
        static const struct option options[] = {
                { "address", required_argument, NULL, 'A' },
                { "json", no_argument, NULL, 'j' },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, ARG_VERSION },
                {},
        };
        int c;
        /* Options anywhere: getopt permutes them in front of the command and its
         * arguments (`epdctl workers --json` is `epdctl --json workers`). */
        while ((c = getopt_long(argc, argv, "A:jh", options, NULL)) >= 0)
                switch (c) {
                case 'A':
                        arg_address = optarg;
                        break;
                case 'j':
                        arg_json = true;
                        break;
                case 'h':
                        help();
                        return 0;
                case ARG_VERSION:
                        printf("epdctl " EPD_VERSION "\n");
                        return 0;
                default:
                        fprintf(stderr, "See epdctl --help.\n");
                        return 1;
                }
        const char *verb = optind < argc ? argv[optind] : "status";
        const EpdctlVerb *v;
        for (v = epdctl_verbs; v->name; v++)
                if (strcmp(v->name, verb) == 0)
                        break;
        if (!v->name) {
                fprintf(stderr, "epdctl: unknown command '%s'; see epdctl --help.\n", verb);
                return 1;
        }
        int nargs = argc - optind - (optind < argc);
        if (nargs < (int)v->min_args || nargs > (int)v->max_args) {
                if (v->max_args == 0)
                        fprintf(stderr, "epdctl %s takes no arguments (got '%s').\n", v->name, argv[optind + 1]);
                else
                        fprintf(stderr, "Usage: epdctl %s\n", v->usage ? v->usage : v->name);
                return 1;
        }
        if (v->run == verb_help)
                return verb_help(NULL, 0, NULL);
        if (tool_address_check("epdctl", arg_address) < 0)
                return 1;
        epd_client *client = NULL;
        int r = tool_connect("epdctl", arg_address, &client);
        if (r < 0)
                return 1;
        r = v->run(client, nargs, argv + optind + (optind < argc));
        epd_disconnect(client);
        return r < 0 ? 1 : 0;
}
