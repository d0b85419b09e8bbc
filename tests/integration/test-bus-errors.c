/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Malformed arguments anywhere in the API come back as org.epd1.Error.InvalidArgument
 * naming the argument and the type it must have, never as a System.Error.* errno or a
 * bare InvalidArgs: hints and options of the wrong variant type (Scheduler.Admit,
 * Scheduler.ConfigureWorker, Manager.RegisterWorker, Handoffs.Prepare), values of a
 * variant that is not what its type says, and a call whose arguments have the wrong
 * signature altogether. A handler that fails with a bare errno (its reply cannot be
 * made: fault-sdbus.so preloaded into epdd) is org.epd1.Error.Failed naming the method,
 * not org.freedesktop.DBus.Error.NoMemory. */
#include <check.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "../check-main.h"

static Harness h;
static sd_bus *bus;
static char worker[256];

static char fault_file[400];

static void setup(void) {
        const char *lib = getenv("FAULT_SDBUS");
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        snprintf(fault_file, sizeof fault_file, "%s/fault", h.dir);
        /* fault-sdbus.so in epdd: no plan file, no fault, until test_bare_errno writes one. */
        ck_assert_int_eq(harness_start_epdd_preloaded(&h, lib, "EPD_FAULT_FILE", fault_file), 0);
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);

        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *p;
        int r = sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &e, &reply,
                                   "sssa{sv}", "decode", "m", "cpu", 0);
        ck_assert_msg(r >= 0, "RegisterWorker: %s", e.message);
        ck_assert_int_ge(sd_bus_message_read(reply, "o", &p), 0);
        snprintf(worker, sizeof worker, "%s", p);
        sd_bus_message_unref(reply);
}

static void teardown(void) {
        sd_bus_flush_close_unref(bus);
        bus = NULL;
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}

/* Calls iface.member on path with `types` and the values after it; the call must fail
 * with org.epd1.Error.InvalidArgument whose message holds every string of `expect`
 * (NULL-terminated). */
static void expect_invalid(const char *path, const char *iface, const char *member, const char *const *expect,
                           const char *types, ...) {
        sd_bus_message *msg = NULL, *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        va_list ap;

        ck_assert_int_ge(sd_bus_message_new_method_call(bus, &msg, NULL, path, iface, member), 0);
        va_start(ap, types);
        ck_assert_int_ge(sd_bus_message_appendv(msg, types, ap), 0);
        va_end(ap);
        int r = sd_bus_call(bus, msg, 10 * 1000000, &e, &reply);
        ck_assert_msg(r < 0, "%s.%s(%s) succeeded", iface, member, types);
        ck_assert_msg(strcmp(e.name, "org.epd1.Error.InvalidArgument") == 0, "%s.%s(%s): %s: %s", iface, member,
                      types, e.name, e.message);
        for (const char *const *x = expect; *x; x++)
                ck_assert_msg(strstr(e.message, *x), "%s.%s(%s): '%s' does not say '%s'", iface, member, types,
                              e.message, *x);
        sd_bus_error_free(&e);
        sd_bus_message_unref(reply);
        sd_bus_message_unref(msg);
}

#define WORDS(...) ((const char *const[]){ __VA_ARGS__, NULL })

/* The cases: Admit hints and ConfigureWorker options of the wrong variant type. */
START_TEST(test_scheduler_wrong_variants) {
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "Admit", WORDS("PagesNeeded", "'t'", "'s'"),
                       "ssta{sv}", "r1", "interactive", (uint64_t)0, 1, "PagesNeeded", "s", "x");
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "Admit", WORDS("Multimodal", "'b'"), "ssta{sv}", "r1",
                       "interactive", (uint64_t)0, 1, "Multimodal", "u", 1);
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "Admit", WORDS("FeatureKeys", "'as'", "'at'"),
                       "ssta{sv}", "r1", "interactive", (uint64_t)0, 1, "FeatureKeys", "at", 2, (uint64_t)1,
                       (uint64_t)2);
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", WORDS("Slots", "'u'", "'s'"), "oa{sv}",
                       worker, 1, "Slots", "s", "x");
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", WORDS("FreePages", "'t'"), "oa{sv}",
                       worker, 1, "FreePages", "u", 3);
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", WORDS("Pools", "'as'"), "oa{sv}",
                       worker, 1, "Pools", "s", "interactive");
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", WORDS("Host", "'s'"), "oa{sv}",
                       worker, 1, "Host", "a{sv}", 0);
}
END_TEST

/* The other a{sv} readers, variants nested in variants, and arguments of the wrong
 * signature: each names what was wrong. */
START_TEST(test_other_readers) {
        expect_invalid("/org/epd1", "org.epd1.Manager", "RegisterWorker", WORDS("kv.layers", "'u'", "'s'"),
                       "sssa{sv}", "decode", "m", "cpu", 1, "kv.layers", "s", "x");
        expect_invalid("/org/epd1", "org.epd1.Manager", "RegisterWorker", WORDS("arenas", "'as'", "'v'"),
                       "sssa{sv}", "decode", "m", "cpu", 1, "arenas", "v", "s", "host0");
        expect_invalid("/org/epd1", "org.epd1.Manager", "RegisterWorker", WORDS("name", "'s'", "'ay'"),
                       "sssa{sv}", "decode", "m", "cpu", 1, "name", "ay", 1, 'x');
        expect_invalid("/org/epd1/handoffs", "org.epd1.Handoffs", "Prepare", WORDS("timeout_usec", "'t'", "'d'"),
                       "ssoaua{sv}", "00000000000000000000000000000001", "", "/org/epd1/sequence/x", 1, 1, 1,
                       "timeout_usec", "d", 1.5);
        expect_invalid("/org/epd1/handoffs", "org.epd1.Handoffs", "Prepare", WORDS("target", "'o'", "'s'"),
                       "ssoaua{sv}", "00000000000000000000000000000001", "", "/org/epd1/sequence/x", 1, 1, 1,
                       "target", "s", "/org/epd1/worker/x");
        /* The arguments themselves of the wrong signature: named by the method's argument
         * names, not sd-bus's bare InvalidArgs. */
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "Admit", WORDS("Admit", "hints", "ssta{sv}"), "sst",
                       "r1", "interactive", (uint64_t)0);
        expect_invalid("/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", WORDS("worker", "'o'", "'s'"), "sa{sv}",
                       worker, 0);
        expect_invalid("/org/epd1/pages", "org.epd1.Pages", "CreateSequence", WORDS("CreateSequence", "su"), "s",
                       "host0");

        /* A call without an interface: routed by sd-bus (the glue finds handlers by
         * interface), never a crash nor a reply outside the rule. */
        sd_bus_message *msg = NULL, *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(sd_bus_message_new_method_call(bus, &msg, NULL, "/org/epd1", NULL, "Admit"), 0);
        ck_assert_int_ge(sd_bus_message_append(msg, "ssta{sv}", "r1", "interactive", (uint64_t)0, 0), 0);
        ck_assert_int_lt(sd_bus_call(bus, msg, 10 * 1000000, &e, &reply), 0);
        ck_assert_msg(strncmp(e.name, "org.epd1.Error.", 15) == 0 ||
                              strncmp(e.name, "org.freedesktop.DBus.Error.Unknown", 34) == 0,
                      "Admit without an interface: %s: %s", e.name, e.message);
        sd_bus_error_free(&e);
        sd_bus_message_unref(msg);

        /* The daemon serves on, and the worker it has is still there. */
        ck_assert_int_eq(harness_count_workers(bus, NULL), 1);
}
END_TEST

/* Writes the fault plan as a new file renamed over the old one: a new inode while the
 * old one exists, so fault-sdbus restarts its count. A plan fails one call only: the
 * calls after it are served. */
static void plan(const char *text) {
        char tmp[420];
        snprintf(tmp, sizeof tmp, "%s.new", fault_file);
        FILE *f = fopen(tmp, "we");
        ck_assert_ptr_nonnull(f);
        fputs(text, f);
        ck_assert_int_eq(fclose(f), 0);
        ck_assert_int_eq(rename(tmp, fault_file), 0);
}

/* A handler whose reply cannot be made, or a getter its value, returns a bare -ENOMEM:
 * named by the glue. */
START_TEST(test_bare_errno) {
        ck_assert_msg(getenv("FAULT_SDBUS"), "FAULT_SDBUS is not set (run through meson test)");
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        int r;

        /* A property getter's bare errno: the same table. (First: the daemon does nothing
         * else in between, which could take the planned call.) */
        /* the 1st: sd-bus's own, the variant around the value; the 2nd: the getter's */
        plan("sd_bus_message_open_container 2\n");
        r = sd_bus_call_method(bus, NULL, "/org/epd1", "org.freedesktop.DBus.Properties", "Get", &e, &reply, "ss",
                               "org.epd1.Manager", "Arenas");
        ck_assert_int_lt(r, 0);
        ck_assert_msg(strcmp(e.name, "org.epd1.Error.Failed") == 0, "Get(Arenas): %s: %s", e.name, e.message);
        ck_assert_msg(strstr(e.message, "org.epd1.Manager.Arenas"), "'%s' does not name the property", e.message);
        sd_bus_error_free(&e);
        r = sd_bus_call_method(bus, NULL, "/org/epd1", "org.freedesktop.DBus.Properties", "Get", &e, &reply, "ss",
                               "org.epd1.Manager", "Arenas");
        ck_assert_msg(r >= 0, "Get(Arenas): %s", e.message);
        sd_bus_message_unref(reply);

        /* A method handler's. */
        sd_bus *other; /* one worker per connection: setup's holds one */
        ck_assert_int_ge(harness_direct_bus(&h, &other), 0);
        plan("sd_bus_message_new_method_return 1\n");
        r = sd_bus_call_method(other, NULL, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &e, &reply,
                                   "sssa{sv}", "prefill", "m", "cpu", 0);
        ck_assert_int_lt(r, 0);
        ck_assert_msg(strcmp(e.name, "org.epd1.Error.Failed") == 0, "RegisterWorker: %s: %s", e.name, e.message);
        ck_assert_msg(strstr(e.message, "org.epd1.Manager.RegisterWorker") &&
                              strstr(e.message, strerror(ENOMEM)),
                      "'%s' names neither the method nor the errno", e.message);
        sd_bus_error_free(&e);
        /* the failed registration left nothing behind; the next one is served */
        ck_assert_int_eq(harness_count_workers(bus, NULL), 1);
        r = sd_bus_call_method(other, NULL, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &e, &reply,
                               "sssa{sv}", "prefill", "m", "cpu", 0);
        ck_assert_msg(r >= 0, "RegisterWorker: %s", e.message);
        sd_bus_message_unref(reply);
        ck_assert_int_eq(harness_count_workers(bus, NULL), 2);
        sd_bus_flush_close_unref(other);

        ck_assert_int_eq(unlink(fault_file), 0);
}
END_TEST

static int register_kv(sd_bus *b, uint32_t layers, sd_bus_error *e) {
        sd_bus_message *reply = NULL;
        int r = sd_bus_call_method(b, NULL, "/org/epd1", "org.epd1.Manager", "RegisterWorker", e, &reply,
                                   "sssa{sv}", "prefill", "m", "cpu", 5, "kv.layers", "u", layers,
                                   "kv.tokens_per_block", "u", 16, "kv.k_bytes_per_token", "t", (uint64_t)64,
                                   "kv.v_bytes_per_token", "t", (uint64_t)64, "kv.dtype", "s", "bfloat16");
        sd_bus_message_unref(reply);
        return r;
}

/* A registration refused after the pages subsystem made the KV arena's pool for its
 * layout (here its reply cannot be made) sets no page size: a worker of another layout
 * registers after it. */
START_TEST(test_failed_registration_sets_no_page_size) {
        ck_assert_msg(getenv("FAULT_SDBUS"), "FAULT_SDBUS is not set (run through meson test)");
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus *other;
        ck_assert_int_ge(harness_direct_bus(&h, &other), 0);
        plan("sd_bus_message_new_method_return 1\n");
        ck_assert_int_lt(register_kv(other, 4, &e), 0);
        ck_assert_msg(strcmp(e.name, "org.epd1.Error.Failed") == 0, "RegisterWorker: %s: %s", e.name, e.message);
        sd_bus_error_free(&e);
        ck_assert_int_eq(unlink(fault_file), 0);
        int r = register_kv(other, 8, &e); /* pages twice the size */
        ck_assert_msg(r >= 0, "RegisterWorker of another layout: %s", e.message);
        sd_bus_flush_close_unref(other);
}
END_TEST

/* OpenRing failing to make the ring (epdd out of fds: its memfd_create fails) is a
 * named refusal saying why; the daemon goes on, and the client's next OpenRing is
 * served. */
START_TEST(test_open_ring_fails) {
        ck_assert_msg(getenv("FAULT_SDBUS"), "FAULT_SDBUS is not set (run through meson test)");
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        plan("memfd_create 1\n");
        int r = sd_bus_call_method(bus, NULL, "/org/epd1/handoffs", "org.epd1.Handoffs", "OpenRing", &e, &reply,
                                   "uu", 64, 64);
        ck_assert_int_lt(r, 0);
        ck_assert_msg(strcmp(e.name, "org.epd1.Error.Failed") == 0, "OpenRing: %s: %s", e.name, e.message);
        ck_assert_msg(strstr(e.message, "Cannot make the ring") && strstr(e.message, strerror(EMFILE)),
                      "'%s' does not say why", e.message);
        sd_bus_error_free(&e);
        ck_assert_int_eq(unlink(fault_file), 0);
        r = sd_bus_call_method(bus, NULL, "/org/epd1/handoffs", "org.epd1.Handoffs", "OpenRing", &e, &reply, "uu",
                               64, 64);
        ck_assert_msg(r >= 0, "OpenRing after the fault: %s", e.message);
        sd_bus_message_unref(reply);
}
END_TEST

int main(void) {
        Suite *s = suite_create("bus-errors");
        TCase *tc = tcase_create("bus-errors");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_scheduler_wrong_variants);
        tcase_add_test(tc, test_other_readers);
        tcase_add_test(tc, test_bare_errno);
        tcase_add_test(tc, test_failed_registration_sets_no_page_size);
        tcase_add_test(tc, test_open_ring_fails);
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
