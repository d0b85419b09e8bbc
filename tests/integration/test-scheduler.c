/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Scheduler end to end over the direct socket: workers register and say their
 * capacity, a tool admits requests and the workers report their stages; bad input gets
 * named errors; a worker that dies takes its requests with it and is no longer chosen;
 * the live introspection matches dbus/org.epd1.Scheduler.xml. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static Harness h;
static char address[512];

static void setup(void) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
}

static void teardown(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}

static unsigned outstanding(void) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        uint32_t n = 0;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, NULL, "/org/epd1", "org.epd1.Scheduler", "Outstanding",
                                                     &e, 'u', &n),
                         0);
        sd_bus_flush_close_unref(bus);
        return n;
}

START_TEST(test_admit_complete) {
        epd_client *p, *d, *tool;
        epd_admission a;

        ck_assert_int_eq(epd_connect(address, &tool), 0);
        /* No workers yet: rejected, with the reason. */
        ck_assert_int_eq(epd_admit(tool, "r0", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_REJECT);
        ck_assert_str_eq(a.reason, "no-workers");

        ck_assert_int_eq(epd_connect(address, &p), 0);
        ck_assert_int_eq(epd_register(p, "prefill", "m", "cpu", NULL, NULL), 0);
        ck_assert_int_eq(epd_connect(address, &d), 0);
        ck_assert_int_eq(epd_register(d, "decode", "m", "cpu", NULL, NULL), 0);
        ck_assert_int_eq(epd_configure_worker(d, 4, 0, 100), 0);
        ck_assert_int_eq(epd_configure_worker(tool, 4, 0, 100), -ENOTCONN);

        ck_assert_int_eq(epd_admit(tool, "r1", "interactive", 5 * 1000000, 10, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_str_eq(a.prefill, epd_worker_path(p));
        ck_assert_str_eq(a.decode, epd_worker_path(d));
        ck_assert_str_eq(a.encoder, "");
        ck_assert_int_eq(a.priority, 2);
        ck_assert_uint_eq(outstanding(), 1);
        /* More pages than the decode worker has free: deferred. */
        ck_assert_int_eq(epd_admit(tool, "r2", "thinking", 0, 95, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_DEFER);
        ck_assert_str_eq(a.reason, "no-pages");
        ck_assert_uint_gt(a.retry_after_usec, 0);

        ck_assert_int_eq(epd_complete(p, "r1", "prefill", 20000, true), 0);
        ck_assert_int_eq(epd_complete(d, "r1", "decode", 100000, true), 0);
        ck_assert_uint_eq(outstanding(), 0);
        ck_assert_int_eq(epd_complete(d, "r1", "decode", 100000, true), -ENOENT);
        ck_assert_str_eq(epd_last_error_name(d), "org.epd1.Error.NotFound");

        /* Bad input: named errors, and the daemon serves on. */
        ck_assert_int_lt(epd_admit(tool, "r3", "batch", 0, 0, false, &a), 0);
        ck_assert_str_eq(epd_last_error_name(tool), "org.epd1.Error.InvalidArgument");
        ck_assert_int_lt(epd_admit(tool, "bad id", "hybrid", 0, 0, false, &a), 0);
        ck_assert_str_eq(epd_last_error_name(tool), "org.epd1.Error.InvalidArgument");
        ck_assert_int_lt(epd_complete(tool, "r1", "digest", 0, true), 0);
        ck_assert_str_eq(epd_last_error_name(tool), "org.epd1.Error.InvalidArgument");

        /* The decode worker dies: its requests go with it, and it is not chosen again. */
        ck_assert_int_eq(epd_admit(tool, "r4", "hybrid", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_uint_eq(outstanding(), 1);
        epd_disconnect(d);
        ck_assert_int_eq(epd_admit(tool, "r5", "hybrid", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_REJECT);
        ck_assert_str_eq(a.reason, "no-workers");
        ck_assert_uint_eq(outstanding(), 0);

        /* A decode worker with a KV layout: its free pages come from its arena's pool. */
        static const epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                          .v_bytes_per_token = 256, .dtype = "bf16" };
        epd_client *d2;
        ck_assert_int_eq(epd_connect(address, &d2), 0);
        ck_assert_int_eq(epd_register(d2, "decode", "m", "cpu", &kv, NULL), 0);
        ck_assert_int_eq(epd_admit(tool, "r6", "hybrid", 0, 1000000, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_DEFER);
        ck_assert_str_eq(a.reason, "no-pages");
        ck_assert_int_eq(epd_admit(tool, "r6", "hybrid", 0, 100, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_str_eq(a.decode, epd_worker_path(d2));
        epd_disconnect(d2);

        epd_disconnect(p);
        epd_disconnect(tool);
}
END_TEST

START_TEST(test_introspection) {
        sd_bus *bus;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        const char *src = getenv("SOURCE_ROOT");
        ck_assert_ptr_nonnull(src);
        char f[512];
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Scheduler.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, NULL, "/org/epd1", f), 0);
        sd_bus_flush_close_unref(bus);
}
END_TEST

int main(void) {
        Suite *s = suite_create("scheduler");
        TCase *tc = tcase_create("scheduler");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_admit_complete);
        tcase_add_test(tc, test_introspection);
        suite_add_tcase(s, tc);
        SRunner *sr = srunner_create(s);
        srunner_set_fork_status(sr, CK_NOFORK);
        srunner_run_all(sr, CK_NORMAL);
        int failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
