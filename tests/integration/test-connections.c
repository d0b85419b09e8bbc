/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Direct connections under churn: several threads connect, register, call and close
 * (politely or by shutting the socket down under the daemon) in random interleavings,
 * so that the daemon accepts new connections while others are going away in the same
 * loop iteration. Every Register and every call must succeed; afterwards no worker is
 * left and epdd exits cleanly (under ASan: without a leak). A second test fills
 * MaxClients=: the connection past the limit is refused without a leak, the others keep
 * working, and a freed slot can be used again. A third makes each sd-bus call of a
 * connection's setup fail in turn (fault-sdbus.so preloaded into epdd): every failed
 * connection is closed, the next one works, and epdd exits without a leak. */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "epd/epd-telemetry.h"
#include "harness.h"
#include "macro.h"
#include "../check-main.h"

#define THREADS 6
#define STEPS 300
#define SLOTS 3

static Harness h;
static char address[512];

static const epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                  .v_bytes_per_token = 256, .dtype = "bf16" };

static void start(const char *extra) {
        ck_assert_int_eq(harness_init(&h, extra), 0);
        harness_start(&h, false, address, sizeof address);
}

static void teardown(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}

static bool no_workers(void *userdata) {
        return harness_workers(&h) == 0;
}

typedef struct Churn {
        unsigned seed;
        unsigned connects, calls, closes, failures;
        char first_error[256];
} Churn;

static void churn_fail(Churn *t, epd_client *c, int r, const char *what) {
        if (t->failures++ == 0)
                snprintf(t->first_error, sizeof t->first_error, "%s: %s (%s)", what, strerror(-r),
                         c && epd_last_error_name(c) ? epd_last_error_name(c) : "no error name");
}

static epd_client *churn_close(Churn *t, epd_client *c) {
        /* Half of the closes shut the socket down first, the way a dying worker's
         * connection ends: the daemon sees EOF with nothing said. */
        if (rand_r(&t->seed) % 2) {
                int fd = epd_get_fd(c);
                if (fd >= 0)
                        (void)shutdown(fd, SHUT_RDWR);
        }
        t->closes++;
        return epd_disconnect(c);
}

static void *churn_thread(void *userdata) {
        Churn *t = userdata;
        epd_client *slots[SLOTS] = { NULL };
        for (unsigned step = 0; step < STEPS; step++) {
                unsigned i = (unsigned)rand_r(&t->seed) % SLOTS;
                int r;
                if (!slots[i]) {
                        r = epd_connect(address, &slots[i]);
                        if (r < 0) {
                                churn_fail(t, NULL, r, "connect");
                                slots[i] = NULL;
                                continue;
                        }
                        r = epd_register(slots[i], "prefill", "churn", "cpu", &kv, NULL);
                        if (r < 0) {
                                churn_fail(t, slots[i], r, "register");
                                slots[i] = epd_disconnect(slots[i]);
                                continue;
                        }
                        t->connects++;
                        /* Often close another slot right away: its end and the next
                         * connection's start reach the daemon together. */
                        unsigned j = (i + 1) % SLOTS;
                        if (slots[j] && rand_r(&t->seed) % 2)
                                slots[j] = churn_close(t, slots[j]);
                } else if (rand_r(&t->seed) % 4 == 0) {
                        /* A tool that asks and leaves without reading the answer (its
                         * reply meets a closed socket), as a polling epdctl may. */
                        sd_bus *bus = NULL;
                        r = harness_direct_bus(&h, &bus);
                        if (r >= 0)
                                r = sd_bus_call_method_async(bus, NULL, NULL, "/org/epd1",
                                                             "org.freedesktop.DBus.Properties", "Get",
                                                             NULL, NULL, "ss", "org.epd1.Manager", "Version");
                        if (r >= 0)
                                r = sd_bus_flush(bus);
                        if (r < 0)
                                churn_fail(t, NULL, r, "hit and run");
                        sd_bus_close_unref(bus);
                } else if (rand_r(&t->seed) % 3 == 0) {
                        slots[i] = churn_close(t, slots[i]);
                } else {
                        char *v = NULL;
                        r = epd_get_version(slots[i], &v);
                        if (r < 0)
                                churn_fail(t, slots[i], r, "GetVersion");
                        free(v);
                        t->calls++;
                }
        }
        for (unsigned i = 0; i < SLOTS; i++)
                if (slots[i])
                        slots[i] = churn_close(t, slots[i]);
        return NULL;
}

START_TEST(test_churn) {
        start(NULL);
        pthread_t threads[THREADS];
        Churn churn[THREADS];
        for (unsigned i = 0; i < THREADS; i++) {
                churn[i] = (Churn){ .seed = 0x5eed + i * 7919 };
                ck_assert_int_eq(pthread_create(&threads[i], NULL, churn_thread, &churn[i]), 0);
        }
        unsigned connects = 0, calls = 0, failures = 0;
        for (unsigned i = 0; i < THREADS; i++) {
                ck_assert_int_eq(pthread_join(threads[i], NULL), 0);
                connects += churn[i].connects;
                calls += churn[i].calls;
                failures += churn[i].failures;
                if (churn[i].failures)
                        fprintf(stderr, "thread %u: %u failures, first %s\n", i, churn[i].failures,
                                churn[i].first_error);
        }
        fprintf(stderr, "churn: %u registrations, %u calls, %u failures\n", connects, calls, failures);
        ck_assert_uint_eq(failures, 0);
        ck_assert_uint_gt(connects, THREADS * STEPS / 10);
        /* Every closed connection released its worker. */
        ck_assert(harness_wait_for(no_workers, NULL, 10000));
        teardown();
}
END_TEST

static void on_backpressure(epd_client *c, const char *peer, unsigned level, const char *reason,
                            void *userdata) {
}

/* Register and unregister a worker n times on c: each change of Workers is a broadcast
 * signal to the subscribers. */
static void churn_workers(epd_client *c, unsigned n) {
        for (unsigned i = 0; i < n; i++) {
                ck_assert_int_eq(epd_register(c, "decode", "m", "cpu", NULL, NULL), 0);
                ck_assert_int_eq(epd_unregister(c), 0);
        }
}

static bool stalled_dropped(void *userdata) {
        return harness_log_has(&h, "Disconnecting a direct client that has not read");
}

/* A direct client that subscribed to the broadcast signals and stopped reading: its
 * socket fills, and the daemon neither waits for it when stopping (SIGTERM ends epdd at
 * once, the messages it did not read dropped) nor piles up its signals without bound
 * (past CONNECTION_QUEUE_MAX queued messages it is disconnected). */
START_TEST(test_subscriber_not_reading) {
        epd_client *idle, *busy;
        const char *lib = getenv("FAULT_SDBUS");
        ck_assert_msg(lib && access(lib, R_OK) == 0, "FAULT_SDBUS is not set (run through meson test)");
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        /* The daemon's sockets get a 64 KiB send buffer, not 8 MiB: full in a few
         * hundred signals. */
        ck_assert_int_eq(harness_start_epdd_preloaded(&h, lib, "EPD_FAULT_SNDBUF", "65536"), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(epd_connect(address, &idle), 0);
        ck_assert_int_eq(epd_backpressure_subscribe(idle, on_backpressure, NULL), 0);
        ck_assert_int_eq(epd_connect(address, &busy), 0);
        /* Past the bound: the idle subscriber is disconnected, the busy client is not.
         * Changes that come faster than the loop turns go out as one signal (a burst is
         * one PropertiesChanged), so how many changes make 4096 signals depends on the
         * machine's load: more until it is dropped, up to ten times the bound. */
        for (unsigned i = 0; i < 40 && !stalled_dropped(NULL); i++)
                churn_workers(busy, 1000);
        ck_assert_msg(harness_wait_for(stalled_dropped, NULL, 5000),
                      "the subscriber that stopped reading is still connected");
        epd_disconnect(idle);
        /* Below the bound, with its socket full: the stop does not wait for it. */
        ck_assert_int_eq(epd_connect(address, &idle), 0);
        ck_assert_int_eq(epd_backpressure_subscribe(idle, on_backpressure, NULL), 0);
        churn_workers(busy, 1500);
        ck_assert_int_eq(harness_stop_epdd(&h), 0); /* -ETIMEDOUT after 10 s: it waited */
        epd_disconnect(idle);
        epd_disconnect(busy);
        harness_done(&h);
}
END_TEST

#define LIMIT 4

START_TEST(test_limit) {
        start("[Limits]\nMaxClients=" "4" "\n");
        epd_client *c[LIMIT + 1];
        /* The raw bus of harness_workers() takes a slot while it is open. */
        for (unsigned i = 0; i < LIMIT - 1; i++) {
                ck_assert_int_eq(epd_connect(address, &c[i]), 0);
                ck_assert_int_eq(epd_register(c[i], "decode", "limit", "cpu", &kv, NULL), 0);
        }
        ck_assert_int_eq(epd_connect(address, &c[LIMIT - 1]), 0);
        char *v = NULL;
        ck_assert_int_eq(epd_get_version(c[LIMIT - 1], &v), 0);
        free(v);
        /* Past the limit: refused, told why by name, and the others still answer. */
        for (unsigned k = 0; k < 3; k++) {
                ck_assert_int_eq(epd_connect(address, &c[LIMIT]), 0);
                ck_assert_int_eq(epd_get_version(c[LIMIT], &v), -EDQUOT);
                ck_assert_str_eq(epd_last_error_name(c[LIMIT]), "org.epd1.Error.LimitExceeded");
                ck_assert_ptr_nonnull(strstr(epd_last_error_message(c[LIMIT]), "MaxClients=)"));
                ck_assert_int_eq(epd_register(c[LIMIT], "decode", "limit", "cpu", &kv, NULL), -EDQUOT);
                c[LIMIT] = epd_disconnect(c[LIMIT]);
        }
        /* More than the daemon tells at once (16, each kept 5 s): closed as they come. */
        epd_client *more[20] = { NULL };
        unsigned told = 0;
        for (unsigned k = 0; k < ELEMENTSOF(more); k++)
                if (epd_connect(address, &more[k]) < 0)
                        more[k] = NULL; /* closed before libepd's connect returned */
        for (unsigned k = 0; k < ELEMENTSOF(more); k++) {
                int e = more[k] ? epd_get_version(more[k], &v) : -ECONNRESET;
                ck_assert_int_lt(e, 0);
                told += e == -EDQUOT;
        }
        /* The three above may not all be gone from the daemon's count yet. */
        ck_assert_uint_le(told, 16);
        ck_assert_uint_ge(told, 13);
        for (unsigned k = 0; k < ELEMENTSOF(more); k++)
                more[k] = epd_disconnect(more[k]);
        for (unsigned i = 0; i < LIMIT; i++) {
                ck_assert_int_eq(epd_get_version(c[i], &v), 0);
                free(v);
        }
        /* A closed connection frees its slot. */
        c[0] = epd_disconnect(c[0]);
        bool ok = false;
        for (unsigned tries = 0; !ok && tries < 100; tries++) {
                ck_assert_int_eq(epd_connect(address, &c[0]), 0);
                ok = epd_register(c[0], "decode", "limit", "cpu", &kv, NULL) >= 0;
                if (!ok) {
                        c[0] = epd_disconnect(c[0]);
                        usleep(20 * 1000);
                }
        }
        ck_assert(ok);
        for (unsigned i = 0; i < LIMIT; i++)
                c[i] = epd_disconnect(c[i]);
        ck_assert(harness_wait_for(no_workers, NULL, 10000));
        teardown();
}
END_TEST

static const char *const setup_calls[] = {
        "sd_bus_set_description", "sd_bus_match_signal", "sd_bus_add_object_vtable",
        "sd_bus_add_fallback_vtable", "sd_bus_add_node_enumerator", "sd_bus_start",
        "sd_bus_attach_event",
};

/* A new plan: written beside and renamed, so the preloaded library sees a new file. */
static void plan(const char *path, const char *text) {
        char tmp[PATH_MAX];
        ck_assert_int_lt(snprintf(tmp, sizeof tmp, "%s.new", path), (int)sizeof tmp);
        FILE *f = fopen(tmp, "we");
        ck_assert_ptr_nonnull(f);
        fputs(text, f);
        fclose(f);
        ck_assert_int_eq(rename(tmp, path), 0);
}

/* Connects, registers and asks once; true if all of it worked. */
static bool connection_works(void) {
        epd_client *c;
        char *v = NULL;
        if (epd_connect(address, &c) < 0)
                return false;
        bool ok = epd_register(c, "prefill", "faults", "cpu", &kv, NULL) >= 0 && epd_get_version(c, &v) >= 0;
        free(v);
        epd_disconnect(c);
        return ok;
}

START_TEST(test_setup_faults) {
        const char *lib = getenv("FAULT_SDBUS");
        char fault_file[400];
        if (!lib || access(lib, R_OK) < 0) {
                fprintf(stderr, "FAULT_SDBUS is not set (run through meson test): skipped.\n");
                return;
        }
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        snprintf(fault_file, sizeof fault_file, "%s/fault", h.dir);
        /* For epdd only: the test itself runs unchanged. */
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd_preloaded(&h, lib, "EPD_FAULT_FILE", fault_file), 0);

        ck_assert(connection_works());
        unsigned failed = 0;
        for (size_t i = 0; i < ELEMENTSOF(setup_calls); i++) {
                /* The 1st, 2nd, ... call of this function in one connection's setup
                 * fails, until N passes the number of calls a setup makes. */
                unsigned n;
                for (n = 1; n < 32; n++) {
                        char text[128];
                        snprintf(text, sizeof text, "%s %u\n", setup_calls[i], n);
                        plan(fault_file, text);
                        if (connection_works())
                                break;
                        failed++;
                        /* the connection after a failed one is served */
                        plan(fault_file, "none 0\n");
                        ck_assert_msg(connection_works(), "after %s #%u failed", setup_calls[i], n);
                }
                ck_assert_msg(n > 1, "%s never failed a connection", setup_calls[i]);
                ck_assert_uint_lt(n, 32);
        }
        fprintf(stderr, "setup faults: %u connections failed, each cleaned up\n", failed);
        unlink(fault_file);
        ck_assert(connection_works());
        ck_assert(harness_wait_for(no_workers, NULL, 10000));
        teardown(); /* exit status 0: under ASan, nothing leaked */
}
END_TEST


/* A caller whose credentials cannot be read is refused, never taken for root (uid 0 of a
 * zeroed client): Register fails with PermissionDenied and leaves no worker behind. */
START_TEST(test_creds_fault) {
        const char *lib = getenv("FAULT_SDBUS");
        char fault_file[400];
        ck_assert_msg(lib && access(lib, R_OK) == 0, "FAULT_SDBUS is not set (run through meson test)");
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        snprintf(fault_file, sizeof fault_file, "%s/fault", h.dir);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd_preloaded(&h, lib, "EPD_FAULT_FILE", fault_file), 0);

        plan(fault_file, "sd_bus_query_sender_creds 1\n");
        epd_client *c;
        ck_assert_int_ge(epd_connect(address, &c), 0);
        int r = epd_register(c, "prefill", "creds", "cpu", &kv, NULL);
        ck_assert_int_lt(r, 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.PermissionDenied");
        epd_disconnect(c);
        ck_assert_int_eq(harness_workers(&h), 0);
        /* the next caller's credentials are read: it is served */
        plan(fault_file, "none 0\n");
        ck_assert(connection_works());
        unlink(fault_file);
        ck_assert(harness_wait_for(no_workers, NULL, 10000));
        teardown();
}
END_TEST

int main(void) {
        Suite *s = suite_create("connections");
        TCase *tc = tcase_create("connections");
        tcase_set_timeout(tc, 240);
        tcase_add_test(tc, test_churn);
        tcase_add_test(tc, test_limit);
        tcase_add_test(tc, test_subscriber_not_reading);
        tcase_add_test(tc, test_setup_faults);
        tcase_add_test(tc, test_creds_fault);
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
