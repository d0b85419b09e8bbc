/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdd: parses arguments, builds the Manager, runs the loop. Nothing else. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/manager.h"
#include "log.h"

static const char *arg_config = NULL;
static const char *arg_bus_address = NULL;
static const char *arg_socket = NULL;
static const char *arg_host_id = NULL;
static const char *arg_state_directory = NULL;
static int arg_log_level = -1;
static int arg_system_bus = -1;
static bool arg_check_config = false;

static void help(void) {
        printf("Usage: epdd [OPTIONS]\n\n"
               "The epd daemon: owns feature buffers and KV pages for Encoder, Prefill and\n"
               "Decode workers, serves org.epd1 on D-Bus and on a direct socket.\n\n"
               "  -c --config=PATH          Configuration file (default " EPD_CONFIG_FILE ")\n"
               "     --bus-address=ADDR     Serve this bus instead of the system bus\n"
               "     --no-system-bus        Serve the direct socket only\n"
               "  -s --socket=PATH          Direct socket (default " EPD_SOCKET_PATH ")\n"
               "     --state-directory=DIR  The WAL's directory (default " EPD_STATE_DIR ")\n"
               "     --host-id=ID           This host's id in a cluster\n"
               "     --log-level=LEVEL      emerg..debug\n"
               "     --check-config         Run start-up's checks of the configuration and exit\n"
               "  -h --help                 Show this help\n"
               "     --version              Show the version\n");
}

static int parse_argv(int argc, char *argv[]) {
        enum { ARG_BUS = 0x100, ARG_NO_SYSTEM_BUS, ARG_HOST_ID, ARG_LOG_LEVEL, ARG_CHECK, ARG_VERSION, ARG_STATE };
        static const struct option options[] = {
                { "config", required_argument, NULL, 'c' },
                { "bus-address", required_argument, NULL, ARG_BUS },
                { "no-system-bus", no_argument, NULL, ARG_NO_SYSTEM_BUS },
                { "socket", required_argument, NULL, 's' },
                { "host-id", required_argument, NULL, ARG_HOST_ID },
                { "state-directory", required_argument, NULL, ARG_STATE },
                { "log-level", required_argument, NULL, ARG_LOG_LEVEL },
                { "check-config", no_argument, NULL, ARG_CHECK },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, ARG_VERSION },
                {},
        };
        int c;
        while ((c = getopt_long(argc, argv, "c:s:h", options, NULL)) >= 0)
                switch (c) {
                case 'c':
                        arg_config = optarg;
                        break;
                case ARG_BUS:
                        arg_bus_address = optarg;
                        break;
                case ARG_NO_SYSTEM_BUS:
                        arg_system_bus = 0;
                        break;
                case 's':
                        if (optarg[0] != '/' || strlen(optarg) >= CONFIG_SOCKET_PATH_MAX) {
                                log_error("--socket= needs an absolute path shorter than %u bytes (it is bound "
                                          "as <path>.<pid>, then renamed).", CONFIG_SOCKET_PATH_MAX);
                                return -EINVAL;
                        }
                        arg_socket = optarg;
                        break;
                case ARG_HOST_ID: {
                        const char *why = config_host_id_problem(optarg);
                        if (why) {
                                log_error("--host-id=%s: %s.", optarg, why);
                                return -EINVAL;
                        }
                        arg_host_id = optarg;
                        break;
                }
                case ARG_STATE:
                        if (optarg[0] != '/') {
                                log_error("--state-directory= needs an absolute path.");
                                return -EINVAL;
                        }
                        arg_state_directory = optarg;
                        break;
                case ARG_LOG_LEVEL:
                        arg_log_level = log_level_from_string(optarg);
                        if (arg_log_level < 0) {
                                log_error("Invalid --log-level=%s.", optarg);
                                return -EINVAL;
                        }
                        break;
                case ARG_CHECK:
                        arg_check_config = true;
                        break;
                case 'h':
                        help();
                        return 0;
                case ARG_VERSION:
                        printf("epdd " EPD_VERSION "\n");
                        return 0;
                default:
                        return -EINVAL;
                }
        if (optind < argc) {
                log_error("epdd takes no positional arguments.");
                return -EINVAL;
        }
        return 1;
}

int main(int argc, char *argv[]) {
        Manager *m = NULL;
        int r = parse_argv(argc, argv);
        if (r <= 0)
                return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;

        r = manager_new(&m, arg_config);
        if (r < 0)
                return EXIT_FAILURE;
        /* The command line wins over the file, at start and at every reload. */
        m->cmdline = (ManagerCmdline){ .bus_address = arg_bus_address, .socket = arg_socket,
                                       .host_id = arg_host_id, .state_dir = arg_state_directory,
                                       .log_level = arg_log_level, .system_bus = arg_system_bus };
        if (manager_apply_cmdline(m, &m->config) < 0) {
                log_oom();
                manager_free(m);
                return EXIT_FAILURE;
        }

        if (arg_check_config) {
                /* The checks start-up runs first, with its messages; nothing is bound,
                 * created or written (no socket, runtime or state directory). */
                log_set_max_level(m->config.log_level);
                r = manager_verify(m);
                if (r >= 0)
                        printf("Configuration OK: %zu arena(s), %zu peer(s).\n", m->config.n_arenas,
                               m->config.n_peers);
                manager_free(m);
                return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
        }
        r = manager_startup(m);
        if (r >= 0)
                r = manager_run(m);
        manager_free(m);
        return r < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}
