/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* A minimal worker for tests that drive epd from outside C (the boot test under
 * systemd): connects through libepd, registers, maps its first host arena and checks
 * the header the daemon wrote there. With --hold it then stays registered until
 * SIGTERM/SIGINT (or until killed, to show that the daemon releases it).
 *
 *   epd-test-worker [--hold] ADDRESS ROLE
 *
 * ADDRESS is a libepd address (direct:PATH, bus:ADDR, system) or "default".
 * Prints "registered PATH", "mapped NAME HOST-ID", "holding"; on failure prints
 * "error STEP ERRNO-NAME D-BUS-ERROR-NAME" and exits 2 (connect), 3 (register) or
 * 4 (map). */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "arena.h"
#include "epd/epd.h"

static int fail(epd_client *c, const char *step, int r, int code) {
        const char *name = c ? epd_last_error_name(c) : NULL;
        printf("error %s %s %s\n", step, strerrorname_np(-r) ?: "?", name && *name ? name : "-");
        fflush(stdout);
        epd_disconnect(c);
        return code;
}

int main(int argc, char *argv[]) {
        bool hold = argc > 1 && strcmp(argv[1], "--hold") == 0;
        if (argc != 3 + hold) {
                fprintf(stderr, "Usage: %s [--hold] ADDRESS ROLE\n", argv[0]);
                return EXIT_FAILURE;
        }
        const char *address = argv[1 + hold], *role = argv[2 + hold];
        if (strcmp(address, "default") == 0)
                address = NULL;

        /* Blocked before anything else, so a SIGTERM while holding is taken by sigwait. */
        sigset_t mask;
        sigemptyset(&mask);
        sigaddset(&mask, SIGTERM);
        sigaddset(&mask, SIGINT);
        sigprocmask(SIG_BLOCK, &mask, NULL);

        epd_client *c = NULL;
        int r = epd_connect(address, &c);
        if (r < 0)
                return fail(NULL, "connect", r, 2);
        epd_kv_layout kv = { .layers = 2, .tokens_per_block = 16, .k_bytes_per_token = 128,
                             .v_bytes_per_token = 128, .dtype = "bf16" };
        r = epd_register(c, role, "boot-test-model", "cpu", &kv, NULL);
        if (r < 0)
                return fail(c, "register", r, 3);
        printf("registered %s\n", epd_worker_path(c));
        for (size_t i = 0; i < epd_arena_count(c); i++) {
                const epd_arena *a = epd_arena_get(c, i);
                if (strcmp(a->domain, "host") != 0)
                        continue;
                void *base;
                r = epd_arena_map(c, i, &base);
                if (r < 0)
                        return fail(c, "map", r, 4);
                const ArenaHeader *hdr = base;
                if (memcmp(hdr->magic, EPD_ARENA_MAGIC, 8) != 0 || strcmp(hdr->name, a->name) != 0)
                        return fail(c, "map", -EBADMSG, 4);
                printf("mapped %s %s\n", hdr->name, hdr->host_id);
                break;
        }
        if (hold) {
                printf("holding\n");
                fflush(stdout);
                int sig;
                sigwait(&mask, &sig);
        }
        fflush(stdout);
        r = epd_unregister(c);
        if (r < 0)
                return fail(c, "unregister", r, 3);
        epd_disconnect(c);
        return EXIT_SUCCESS;
}
