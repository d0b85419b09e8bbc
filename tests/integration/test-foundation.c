/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The foundation end to end: epdd serves, a worker registers through libepd, maps an
 * arena and reads what the daemon wrote; a worker killed with SIGKILL is released; bad
 * input gets named errors and the daemon keeps serving; the live introspection matches
 * the XML in dbus/. Built twice: over the direct socket, and over a private dbus-daemon
 * (OVER_BUS). */
#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/arena.h"
#include "harness.h"
#include "../check-main.h"

#ifdef OVER_BUS
#define OVER_BUS_MODE true
#else
#define OVER_BUS_MODE false
#endif

static Harness h;
static char address[512];

static void setup(void) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

static void teardown(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}

static int want_workers;
static bool workers_are(void *userdata) {
        return harness_workers(&h) == want_workers;
}

START_TEST(test_register_map_kill) {
        epd_client *c;
        epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                             .v_bytes_per_token = 256, .dtype = "bf16" };
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "qwen3-vl-test", "cpu", &kv, NULL), 0);
        ck_assert_ptr_nonnull(epd_worker_path(c));
        ck_assert_uint_eq(epd_arena_count(c), 2);

        /* What the daemon wrote at the start of the arena is visible through our map. */
        int i = epd_arena_find(c, "host0");
        ck_assert_int_ge(i, 0);
        void *base;
        ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
        const ArenaHeader *hdr = base;
        ck_assert_int_eq(memcmp(hdr->magic, EPD_ARENA_MAGIC, 8), 0);
        ck_assert_str_eq(hdr->name, "host0");
        ck_assert_str_eq(hdr->host_id, "test-host");
        ck_assert_uint_eq(hdr->size, epd_arena_get(c, (size_t)i)->size);
        /* The mapping is shared memory: a write lands in the daemon's arena. */
        memset((char *)base + hdr->data_offset, 0x5a, 4096);

        ck_assert_int_eq(harness_workers(&h), 1);

        /* A worker process killed with SIGKILL is unregistered with everything it held. */
        int pfd[2];
        ck_assert_int_eq(pipe(pfd), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                epd_client *cc;
                if (epd_connect(address, &cc) < 0 ||
                    epd_register(cc, "decode", "qwen3-vl-test", "cpu", &kv, NULL) < 0)
                        _exit(1);
                void *p;
                if (epd_arena_map(cc, 0, &p) < 0)
                        _exit(2);
                if (write(pfd[1], "x", 1) != 1)
                        _exit(3);
                pause();
                _exit(0);
        }
        close(pfd[1]);
        char x;
        ck_assert_int_eq(read(pfd[0], &x, 1), 1);
        close(pfd[0]);
        ck_assert_int_eq(harness_workers(&h), 2);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        want_workers = 1;
        ck_assert(harness_wait_for(workers_are, NULL, 5000));

        ck_assert_int_eq(epd_unregister(c), 0);
        ck_assert_int_eq(harness_workers(&h), 0);
        epd_disconnect(c);
}
END_TEST

static void expect_error(sd_bus *bus, const char *name, const char *member, const char *types, ...) {
        sd_bus_message *m = NULL, *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(sd_bus_message_new_method_call(bus, &m, harness_destination(&h), "/org/epd1",
                                                        "org.epd1.Manager", member), 0);
        if (types) {
                va_list ap;
                va_start(ap, types);
                ck_assert_int_ge(sd_bus_message_appendv(m, types, ap), 0);
                va_end(ap);
        }
        int r = sd_bus_call(bus, m, 0, &e, &reply);
        ck_assert_int_lt(r, 0);
        ck_assert_msg(sd_bus_error_has_name(&e, name), "%s: expected %s, got %s (%s)", member, name,
                      e.name, e.message);
        sd_bus_error_free(&e);
        sd_bus_message_unref(m);
        sd_bus_message_unref(reply);
}

START_TEST(test_bad_input) {
        sd_bus *bus;
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        char longname[400];
        memset(longname, 'm', sizeof longname - 1);
        longname[sizeof longname - 1] = 0;

        expect_error(bus, "org.epd1.Error.InvalidArgument", "RegisterWorker", "ss", "prefill", "m");
        expect_error(bus, "org.epd1.Error.InvalidArgument", "RegisterWorker", "uuu", 1, 2, 3);
        expect_error(bus, "org.epd1.Error.InvalidArgument", "RegisterWorker", "sssa{sv}", "janitor", "m", "cpu", 0);
        expect_error(bus, "org.epd1.Error.InvalidArgument", "RegisterWorker", "sssa{sv}", "prefill", longname, "cpu", 0);
        expect_error(bus, "org.epd1.Error.InvalidArgument", "RegisterWorker", "sssa{sv}", "prefill", "m", "bad\001dev", 0);
        expect_error(bus, "org.epd1.Error.InvalidArgument", "RegisterWorker", "sssa{sv}", "prefill", "m", "cpu", 1,
                     "frobnicate", "u", 1);
        expect_error(bus, "org.epd1.Error.InvalidArgument", "RegisterWorker", "sssa{sv}", "prefill", "m", "cpu", 1,
                     "kv.layers", "s", "many");
        expect_error(bus, "org.epd1.Error.NotFound", "RegisterWorker", "sssa{sv}", "prefill", "m", "cpu", 1,
                     "arenas", "as", 1, "nosuch");
        expect_error(bus, "org.epd1.Error.NotFound", "UnregisterWorker", "o", "/org/epd1/worker/00000000000000000000000000000000");
        expect_error(bus, "org.epd1.Error.InvalidArgument", "UnregisterWorker", "o", "/org/epd1");
        expect_error(bus, "org.freedesktop.DBus.Error.UnknownMethod", "SelfDestruct", NULL);

        /* A second client cannot unregister the first one's worker. */
        epd_client *c;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "encoder", "m", "cpu", NULL, NULL), 0);
        expect_error(bus, "org.epd1.Error.PermissionDenied", "UnregisterWorker", "o", epd_worker_path(c));
        /* Registering twice on one connection is refused by name. */
        ck_assert_int_eq(epd_register(c, "encoder", "m", "cpu", NULL, NULL), -EALREADY);
        epd_client *d;
        ck_assert_int_eq(epd_connect(address, &d), 0);
        ck_assert_int_eq(epd_register(d, "encoder", "m", "cpu", NULL, NULL), 0);
        ck_assert_int_eq(epd_unregister(d), 0);
        ck_assert_int_eq(epd_unregister(d), -ENOTCONN);
        epd_disconnect(d);

        /* Still serving. */
        ck_assert_int_eq(harness_count_workers(bus, harness_destination(&h)), 1);
        epd_disconnect(c);
        want_workers = 0;
        ck_assert(harness_wait_for(workers_are, NULL, 5000));
        sd_bus_flush_close_unref(bus);
}
END_TEST

/* A refusal of libepd's own is named as such: epd_last_error_name() never names an
 * earlier call's error. A NULL client is refused, not dereferenced. */
START_TEST(test_local_refusals_named) {
        epd_client *c;
        char *s = NULL;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        const char *const nosuch[] = { "nosuch", NULL };
        ck_assert_int_eq(epd_register(c, "encoder", "m", "cpu", NULL, nosuch), -ENOENT);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.NotFound");

        ck_assert_int_eq(epd_unregister(c), -ENOTCONN);
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), "not registered"));

        ck_assert_int_eq(epd_register(c, "encoder", "m", "cpu", NULL, NULL), 0);
        ck_assert_ptr_null(epd_last_error_name(c));
        ck_assert_int_eq(epd_register(c, "encoder", "m", "cpu", NULL, NULL), -EALREADY);
        ck_assert_str_eq(epd_last_error_name(c), "errno.114");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), epd_worker_path(c)));

        ck_assert_int_eq(epd_sequence_create(c, NULL, 1, &s, NULL, NULL), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "errno.22");
        ck_assert_int_eq(epd_arena_map(c, 99, (void **)&s), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "errno.22");
        ck_assert_int_ge(epd_wait(c, 0), 0);
        ck_assert_int_ge(epd_get_fd(c), 0);

        ck_assert_int_eq(epd_get_fd(NULL), -EINVAL);
        ck_assert_int_eq(epd_process(NULL), -EINVAL);
        ck_assert_int_eq(epd_wait(NULL, 0), -EINVAL);
        ck_assert_int_eq(epd_get_version(NULL, &s), -EINVAL);
        ck_assert_int_eq(epd_unregister(NULL), -ENOTCONN);
        ck_assert_ptr_null(epd_last_error_name(NULL));
        epd_disconnect(c);
}
END_TEST

#ifndef OVER_BUS
static unsigned changed_seen;
static int on_changed(sd_bus_message *m, void *userdata, sd_bus_error *e) {
        if (sd_bus_message_is_signal(m, "org.freedesktop.DBus.Properties", "PropertiesChanged"))
                changed_seen++;
        return 0;
}

/* Every message the daemon sent conn up to now has arrived (a round trip after it). */
static void drain(sd_bus *conn) {
        ck_assert_int_ge(sd_bus_call_method(conn, NULL, "/", "org.freedesktop.DBus.Peer", "Ping", NULL, NULL, NULL), 0);
        while (sd_bus_process(conn, NULL) > 0)
                ;
}

/* A direct connection gets the broadcast signals only once it subscribed: a worker
 * registering is PropertiesChanged (Manager.Workers) to a subscriber, nothing to
 * another connection; Subscribe(false) ends it. */
START_TEST(test_broadcast_to_subscribers) {
        sd_bus *quiet, *listener;
        epd_client *c;
        ck_assert_int_ge(harness_direct_bus(&h, &quiet), 0);
        ck_assert_int_ge(harness_direct_bus(&h, &listener), 0);
        ck_assert_int_ge(sd_bus_add_filter(quiet, NULL, on_changed, NULL), 0);
        ck_assert_int_ge(sd_bus_call_method(listener, NULL, "/org/epd1", "org.epd1.Manager", "Subscribe", NULL, NULL,
                                            "b", 1), 0);
        drain(quiet);
        changed_seen = 0;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", NULL, NULL), 0);
        /* The listener: the signal comes (coalesced, within 10 ms). */
        unsigned got = 0;
        sd_bus_slot *slot = NULL;
        ck_assert_int_ge(sd_bus_match_signal(listener, &slot, NULL, "/org/epd1", "org.freedesktop.DBus.Properties",
                                             "PropertiesChanged", on_changed, NULL), 0);
        for (int i = 0; i < 500 && changed_seen == 0; i++) {
                while (sd_bus_process(listener, NULL) > 0)
                        ;
                if (changed_seen == 0)
                        sd_bus_wait(listener, 10000);
        }
        got = changed_seen;
        ck_assert_uint_ge(got, 1);
        /* The quiet connection: nothing, everything sent to it being in. */
        changed_seen = 0;
        drain(quiet);
        ck_assert_uint_eq(changed_seen, 0);
        /* Unsubscribed: nothing more for the listener either. */
        ck_assert_int_ge(sd_bus_call_method(listener, NULL, "/org/epd1", "org.epd1.Manager", "Subscribe", NULL, NULL,
                                            "b", 0), 0);
        epd_disconnect(c); /* the worker goes: Workers changes */
        usleep(50000);      /* past the coalescing bound */
        changed_seen = 0;
        drain(listener);
        ck_assert_uint_eq(changed_seen, 0);
        sd_bus_slot_unref(slot);
        sd_bus_flush_close_unref(quiet);
        sd_bus_flush_close_unref(listener);
}
END_TEST
#endif

START_TEST(test_introspection) {
        sd_bus *bus;
        epd_client *c;
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "decode", "m", "cpu", NULL, NULL), 0);
        const char *src = getenv("SOURCE_ROOT");
        ck_assert_ptr_nonnull(src);
        char f[512];
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Manager.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, harness_destination(&h), "/org/epd1", f), 0);
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Worker.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, harness_destination(&h), epd_worker_path(c), f), 0);
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Metrics.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, harness_destination(&h), "/org/epd1", f), 0);
        /* Worker.Stats: every counter by name, zero for a worker that did nothing yet. */
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(sd_bus_get_property(bus, harness_destination(&h), epd_worker_path(c), "org.epd1.Worker", "Stats",
                                             &e, &reply, "a{st}"),
                         0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "{st}"), 0);
        const char *k;
        uint64_t v;
        unsigned n = 0;
        while (sd_bus_message_read(reply, "{st}", &k, &v) > 0) {
                ck_assert_uint_eq(v, 0);
                n++;
        }
        ck_assert_uint_eq(n, 7);
        sd_bus_message_unref(reply);
        epd_disconnect(c);
        sd_bus_flush_close_unref(bus);
}
END_TEST

int main(void) {
        harness_require_bus(OVER_BUS_MODE);
        Suite *s = suite_create("foundation");
        TCase *tc = tcase_create("foundation");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_register_map_kill);
        tcase_add_test(tc, test_bad_input);
        tcase_add_test(tc, test_local_refusals_named);
        tcase_add_test(tc, test_introspection);
#ifndef OVER_BUS
        tcase_add_test(tc, test_broadcast_to_subscribers);
#endif
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
