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
 * 4 (map).
 *
 *   epd-test-worker --state-put ADDRESS    (restart without loss, under systemd)
 *   epd-test-worker --state-check ADDRESS SEQUENCE
 *
 * --state-put creates a committed sequence of 8 KV pages and a cached feature, fills
 * both with a known pattern, prints "holding SEQUENCE" and stays connected until
 * SIGTERM or SIGKILL (the daemon restarts under it). --state-check, after the restart,
 * Attaches the sequence, compares its pages' bytes, acquires the feature without
 * producing it (it must be a hit) and compares its bytes; prints "state ok" or
 * "error STEP ..." and exits 5. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/arena.h"
#include "epd/epd-feature.h"
#include "epd/epd.h"

#define STATE_PAGES 8
#define STATE_FEATURE "boot-test:image"
#define STATE_FEATURE_BYTES (2 * 1024 * 4)

static int fail(epd_client *c, const char *step, int r, int code) {
        const char *name = c ? epd_last_error_name(c) : NULL;
        printf("error %s %s %s\n", step, strerrorname_np(-r) ?: "?", name && *name ? name : "-");
        fflush(stdout);
        epd_disconnect(c);
        return code;
}

static uint8_t pattern(size_t i, unsigned tag) {
        return (uint8_t)(((i * 2654435761u) >> 13) ^ (tag * 31u));
}

static int arena_base(epd_client *c, const char *usage_name, uint8_t **ret, const epd_arena **ret_a) {
        int i = epd_arena_find(c, usage_name);
        void *base;
        if (i < 0)
                return i;
        int r = epd_arena_map(c, (size_t)i, &base);
        if (r < 0)
                return r;
        *ret = base;
        *ret_a = epd_arena_get(c, (size_t)i);
        return 0;
}

/* The KV arena is the first host arena a colocated worker maps; the feature arena is
 * where the feature lands (f->arena). */
static int kv_arena(epd_client *c, uint8_t **ret, const epd_arena **ret_a) {
        for (size_t i = 0; i < epd_arena_count(c); i++) {
                const epd_arena *a = epd_arena_get(c, i);
                if (strcmp(a->domain, "host") == 0 && strcmp(a->usage, "kv") == 0)
                        return arena_base(c, a->name, ret, ret_a);
        }
        return -ENOENT;
}

static int state(bool put, const char *address, const char *seq) {
        epd_kv_layout kv = { .layers = 2, .tokens_per_block = 16, .k_bytes_per_token = 128,
                             .v_bytes_per_token = 128, .dtype = "bf16" };
        epd_client *c = NULL;
        const epd_arena *a;
        uint8_t *base;
        uint32_t *pages = NULL;
        size_t n = 0;
        uint64_t page_size = 0;
        char *path = NULL;
        epd_feature *f = NULL;
        epd_feature_tensor t = { .name = "pixels", .dtype = "f32", .rank = 2, .shape = { 2, 1024 } };
        int r = epd_connect(address, &c);
        if (r < 0)
                return fail(NULL, "connect", r, 2);
        r = epd_register(c, "colocated", "boot-test-model", "cpu", &kv, NULL);
        if (r < 0)
                return fail(c, "register", r, 3);
        r = kv_arena(c, &base, &a);
        if (r < 0)
                return fail(c, "map", r, 4);
        if (put) {
                r = epd_sequence_create(c, a->name, STATE_PAGES, &path, &pages, &n);
                if (r < 0)
                        return fail(c, "create", r, 5);
        } else {
                r = epd_sequence_attach(c, seq, &path);
                if (r < 0)
                        return fail(c, "attach", r, 5);
                r = epd_sequence_get_pages(c, path, &pages, &n);
                if (r < 0 || n != STATE_PAGES)
                        return fail(c, "pages", r < 0 ? r : -EBADMSG, 5);
        }
        r = epd_sequence_get_page_size(c, path, &page_size);
        if (r < 0)
                return fail(c, "page-size", r, 5);
        for (size_t p = 0; p < n; p++) {
                uint8_t *d = base + epd_page_offset(a, page_size, pages[p]);
                for (size_t k = 0; k < page_size; k++) {
                        if (put)
                                d[k] = pattern(k, (unsigned)p);
                        else if (d[k] != pattern(k, (unsigned)p))
                                return fail(c, "sequence-bytes", -EBADMSG, 5);
                }
        }
        r = epd_feature_acquire(c, STATE_FEATURE, put, &f);
        if (r < 0)
                return fail(c, "acquire", r, 5);
        if (put) {
                if (strcmp(f->result, "produce") != 0)
                        return fail(c, "produce", -EEXIST, 5);
                r = epd_feature_produce(c, f, STATE_FEATURE_BYTES, &t, 1, NULL);
                if (r < 0 || !f->data)
                        return fail(c, "produce", r < 0 ? r : -ENODATA, 5);
                for (size_t k = 0; k < STATE_FEATURE_BYTES; k++)
                        ((uint8_t *)f->data)[k] = pattern(k, 99);
                r = epd_feature_publish(c, f, 1000);
                if (r < 0)
                        return fail(c, "publish", r, 5);
        } else {
                if (strcmp(f->result, "hit") != 0 || !f->data || f->bytes != STATE_FEATURE_BYTES)
                        return fail(c, "feature-hit", -ENOENT, 5);
                for (size_t k = 0; k < STATE_FEATURE_BYTES; k++)
                        if (((uint8_t *)f->data)[k] != pattern(k, 99))
                                return fail(c, "feature-bytes", -EBADMSG, 5);
        }
        (void)epd_feature_release(c, f);
        if (put) {
                sigset_t mask;
                int sig;
                sigemptyset(&mask);
                sigaddset(&mask, SIGTERM);
                sigaddset(&mask, SIGINT);
                printf("holding %s\n", path);
                fflush(stdout);
                sigwait(&mask, &sig);
        } else {
                printf("state ok\n");
                /* Released, so that the state does not outlive the test. */
                (void)epd_sequence_release(c, path);
        }
        fflush(stdout);
        free(pages);
        free(path);
        epd_disconnect(c);
        return EXIT_SUCCESS;
}

int main(int argc, char *argv[]) {
        if (argc >= 3 && (strcmp(argv[1], "--state-put") == 0 || strcmp(argv[1], "--state-check") == 0)) {
                bool put = strcmp(argv[1], "--state-put") == 0;
                sigset_t mask;
                sigemptyset(&mask);
                sigaddset(&mask, SIGTERM);
                sigaddset(&mask, SIGINT);
                sigprocmask(SIG_BLOCK, &mask, NULL);
                if (argc != 3 + !put)
                        return EXIT_FAILURE;
                return state(put, strcmp(argv[2], "default") == 0 ? NULL : argv[2], put ? NULL : argv[3]);
        }
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
