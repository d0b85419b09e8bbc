/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl: inspect and drive epdd from the command line. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "epd-internal.h"
#include "epdctl.h"
#include "macro.h"
#include "parse-util.h"

bool arg_json = false;
static const char *arg_address = NULL;

static void help(void) {
        printf("Usage: epdctl [OPTIONS] COMMAND\n\n"
               "Commands:\n");
        for (const EpdctlVerb *v = epdctl_verbs; v->name; v++)
                printf("  %-22s %s\n", v->usage ? v->usage : v->name, v->help);
        printf("\nOptions:\n"
               "  -A --address=ADDR   direct:PATH, bus:ADDRESS or system (default: as libepd)\n"
               "  -j --json           Print JSON for scripts\n"
               "  -h --help           Show this help\n");
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

static int verb_status(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *workers = NULL, *arenas = NULL;
        char *version = NULL, *host = NULL;
        uint32_t clients = 0;
        int r;
        if ((r = epd_get_version(c, &version)) < 0 || (r = epd_get_host_id(c, &host)) < 0)
                return epdctl_fail(c, r, "status");
        sd_bus_error e = SD_BUS_ERROR_NULL;
        r = sd_bus_get_property_trivial(c->bus, EPD_DESTINATION(c), "/org/epd1", "org.epd1.Manager",
                                        "Clients", &e, 'u', &clients);
        sd_bus_error_free(&e);
        unsigned n_workers = 0, n_arenas = 0;
        if (epdctl_get_property(c, "/org/epd1", "org.epd1.Manager", "Workers", "a(osssu)", &workers) >= 0 &&
            sd_bus_message_enter_container(workers, 'a', "(osssu)") >= 0)
                while (sd_bus_message_skip(workers, "(osssu)") > 0)
                        n_workers++;
        if (epdctl_get_property(c, "/org/epd1", "org.epd1.Manager", "Arenas", "a(ssstt)", &arenas) >= 0 &&
            sd_bus_message_enter_container(arenas, 'a', "(ssstt)") >= 0)
                while (sd_bus_message_skip(arenas, "(ssstt)") > 0)
                        n_arenas++;
        if (arg_json) {
                printf("{\"version\":");
                json_string(stdout, version);
                printf(",\"host_id\":");
                json_string(stdout, host);
                printf(",\"clients\":%u,\"workers\":%u,\"arenas\":%u}\n", clients, n_workers, n_arenas);
        } else
                printf("epdd %s on host %s\n  clients: %u\n  workers: %u\n  arenas:  %u\n", version,
                       host, clients, n_workers, n_arenas);
        free(version);
        free(host);
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

/* -- verb table: subsystems add their verbs in their own files (epdctl.h) -- */
const EpdctlVerb epdctl_verbs[] = {
        { "status", NULL, "Daemon version, host, clients, workers, arenas", verb_status },
        { "workers", NULL, "Registered workers", verb_workers },
        { "arenas", NULL, "Memory arenas", verb_arenas },
        { "pages", NULL, "KV page pools per arena and the block directory", verb_pages },
        { "sequences", NULL, "KV sequences: owner, arena, pages, sharing", verb_sequences },
        { "features", NULL, "Feature cache: hits, misses, coalesced waits, bytes, evictions", verb_features },
        { "handoffs", NULL, "Handoffs in flight and their counters", verb_handoffs },
        { "trace", "trace REQUEST_ID", "One request's path with timings, encode to decode", verb_trace },
        { "paths", NULL, "Peer paths as the kernel sees them: RTT, retransmits, backpressure", verb_paths },
        { "scheduler", NULL, "Admission pools: queues, rates, rho, verdicts and their reasons", verb_scheduler },
        { "journal", NULL, "The WAL (sync policy, LSNs, size) and the number of workflows", verb_journal },
        /* -- more verbs -- */
        { "peers", NULL, "Peer hosts: state, streams, and the path to each with its reason", verb_peers },
        { "gpus", NULL, "GPUs of the GPU domain and their peer access", verb_gpus },
        { "cluster", NULL, "Membership: static or etcd, etcd's state, each member's lease and directory shard", verb_cluster },
        { "placement", "placement HASH...", "Which host and worker hold the longest cached prefix of these block hashes", verb_placement },
        {},
};

int main(int argc, char *argv[]) {
        static const struct option options[] = {
                { "address", required_argument, NULL, 'A' },
                { "json", no_argument, NULL, 'j' },
                { "help", no_argument, NULL, 'h' },
                {},
        };
        int c;
        while ((c = getopt_long(argc, argv, "+A:jh", options, NULL)) >= 0)
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
                default:
                        return 1;
                }
        const char *verb = optind < argc ? argv[optind] : "status";
        const EpdctlVerb *v;
        for (v = epdctl_verbs; v->name; v++)
                if (strcmp(v->name, verb) == 0)
                        break;
        if (!v->name) {
                fprintf(stderr, "Unknown command '%s'; see epdctl --help.\n", verb);
                return 1;
        }
        epd_client *client = NULL;
        int r = epd_connect(arg_address, &client);
        if (r < 0) {
                fprintf(stderr, "Cannot connect to epdd: %s\n", strerror(-r));
                return 1;
        }
        r = v->run(client, argc - optind - (optind < argc), argv + optind + (optind < argc));
        epd_disconnect(client);
        return r < 0 ? 1 : 0;
}
