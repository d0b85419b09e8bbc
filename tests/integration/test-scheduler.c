/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Scheduler end to end over the direct socket: workers register and say their
 * capacity, a tool admits requests and the workers report their stages; bad input gets
 * named errors; a worker that dies takes its requests with it and is no longer chosen;
 * the live introspection matches dbus/org.epd1.Scheduler.xml. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "epd-internal.h"
#include "epd/epd-telemetry.h"
#include "harness.h"
#include "../check-main.h"

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

/* A new connection registered as a worker of `role` (model "m", cpu). */
static epd_client *registered(const char *role) {
        epd_client *c;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, role, "m", "cpu", NULL, NULL), 0);
        return c;
}

/* The types and details of request rid's trace, in order ("type detail;" each). */
static void trace_of(epd_client *c, const char *rid, char *buf, size_t size) {
        epd_trace_event *ev = NULL;
        size_t n = 0, used = 0;
        buf[0] = 0;
        ck_assert_int_eq(epd_trace_get(c, rid, &ev, &n, NULL), 0);
        for (size_t i = 0; i < n && used < size; i++)
                used += (size_t)snprintf(buf + used, size - used, "%s %s;", ev[i].type, ev[i].detail);
        free(ev);
}

START_TEST(test_admit_complete) {
        epd_client *p, *d, *tool;
        epd_admission a;

        ck_assert_int_eq(epd_connect(address, &tool), 0);
        /* No workers yet: rejected, with the reason. */
        ck_assert_int_eq(epd_admit(tool, "r0", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_REJECT);
        ck_assert_str_eq(a.reason, "no-workers");

        p = registered("prefill");
        d = registered("decode");
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
        /* Each request's trace: the verdict and why, each stage reported done. */
        char tr[1024];
        trace_of(tool, "r1", tr, sizeof tr);
        ck_assert_str_eq(tr, "admit interactive admit;stage-done prefill done;stage-done decode done;");
        trace_of(tool, "r2", tr, sizeof tr);
        ck_assert_str_eq(tr, "admit thinking defer: no-pages;");
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

/* ConfigureWorker changes what it names in place: a decode worker reporting its
 * capacity again (as epd_configure_worker() does, Slots always sent) keeps the requests
 * it was given; Pools= alone is taken, and stays when Slots come later. */
START_TEST(test_configure_keeps_admitted) {
        epd_client *p, *d, *tool;
        epd_admission a;

        ck_assert_int_eq(epd_connect(address, &tool), 0);
        p = registered("prefill");
        d = registered("decode");
        ck_assert_int_eq(epd_configure_worker(d, 4, 0, 100), 0);
        ck_assert_int_eq(epd_admit(tool, "c1", "interactive", 5 * 1000000, 10, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_uint_eq(outstanding(), 1);
        ck_assert_int_eq(epd_configure_worker(d, 4, 0, 100), 0); /* the same again */
        ck_assert_uint_eq(outstanding(), 1);
        ck_assert_int_eq(epd_configure_worker(d, 8, 0, 200), 0); /* more room */
        ck_assert_uint_eq(outstanding(), 1);
        ck_assert_int_eq(epd_complete(p, "c1", "prefill", 20000, true), 0);
        ck_assert_int_eq(epd_complete(d, "c1", "decode", 100000, true), 0);
        ck_assert_uint_eq(outstanding(), 0);

        /* Pools= alone: the decode worker serves thinking only. */
        ck_assert_int_eq(epd__call(d, "/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", NULL, "oa{sv}",
                                   epd_worker_path(d), 1, "Pools", "as", 1, "thinking"),
                         0);
        ck_assert_int_eq(epd_admit(tool, "c2", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_REJECT);
        ck_assert_str_eq(a.reason, "no-workers");
        /* A later report of its capacity leaves that as it is. */
        ck_assert_int_eq(epd_configure_worker(d, 4, 0, 100), 0);
        ck_assert_int_eq(epd_admit(tool, "c3", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_REJECT);
        ck_assert_int_eq(epd_admit(tool, "c4", "thinking", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        /* Out of range: named. */
        ck_assert_int_lt(epd_configure_worker(d, 70000, 0, 100), 0);
        ck_assert_str_eq(epd_last_error_name(d), "org.epd1.Error.InvalidArgument");
        epd_disconnect(d);
        d = NULL;

        /* Two decode workers of one arena: the pages promised to one are not promised to
         * the other again. */
        static const epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                          .v_bytes_per_token = 256, .dtype = "bf16" };
        epd_client *k1, *k2;
        ck_assert_int_eq(epd_connect(address, &k1), 0);
        ck_assert_int_eq(epd_register(k1, "decode", "m", "cpu", &kv, NULL), 0);
        ck_assert_int_eq(epd_connect(address, &k2), 0);
        ck_assert_int_eq(epd_register(k2, "decode", "m", "cpu", &kv, NULL), 0);
        ck_assert_int_eq(epd_admit(tool, "big1", "hybrid", 0, 6000, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_int_eq(epd_admit(tool, "big2", "hybrid", 0, 6000, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_DEFER);
        ck_assert_str_eq(a.reason, "no-pages");
        epd_disconnect(k1);
        epd_disconnect(k2);

        epd_disconnect(p);
        epd_disconnect(tool);
}
END_TEST

/* An encoder is chosen for multimodal input, unless its features are in the cache
 * (READY, or being produced by another request; not a Prefetch's placeholder that
 * nobody produces). */
START_TEST(test_feature_affinity) {
        epd_client *p, *d;
        p = registered("prefill");
        d = registered("decode");

        sd_bus *bus;
        sd_bus_error err = SD_BUS_ERROR_NULL;
        const char *verdict, *reason, *enc, *pre, *dec;
        uint64_t retry, predicted;
        int32_t prio;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        /* The encoder registers on this connection: Acquire needs a registered worker. */
        sd_bus_message *reg = NULL;
        const char *enc_path;
        ck_assert_int_ge(sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &err, &reg,
                                            "sssa{sv}", "encoder", "m", "cpu", 0),
                         0);
        ck_assert_int_ge(sd_bus_message_read(reg, "o", &enc_path), 0);
        char encoder[128];
        snprintf(encoder, sizeof encoder, "%s", enc_path);
        sd_bus_message_unref(reg);
        /* cached 2: a Prefetch's placeholder, which nobody produces: not cached. */
        for (int cached = 0; cached < 3; cached++) {
                sd_bus_message *reply = NULL;
                const char *key = cached == 2 ? "img-2" : "img-1";
                char rid[16];
                int r;
                snprintf(rid, sizeof rid, "mm-%d", cached);
                if (cached == 2) {
                        sd_bus_message *pf = NULL;
                        r = sd_bus_call_method(bus, NULL, "/org/epd1/feature", "org.epd1.Feature", "Prefetch", &err,
                                               &pf, "as", 1, key);
                        ck_assert_msg(r >= 0, "Prefetch: %s", err.message);
                        sd_bus_message_unref(pf);
                } else if (cached) {
                        /* A producer takes the key: the feature is RESERVED from now on. */
                        sd_bus_message *acq = NULL;
                        r = sd_bus_call_method(bus, NULL, "/org/epd1/feature", "org.epd1.Feature", "Acquire", &err,
                                               &acq, "sb", "img-1", 1);
                        ck_assert_msg(r >= 0, "Acquire: %s", err.message);
                        sd_bus_message_unref(acq);
                }
                r = sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Scheduler", "Admit", &err, &reply,
                                           "ssta{sv}", rid, "interactive", (uint64_t)0, 2, "Multimodal", "b", 1,
                                           "FeatureKeys", "as", 1, key);
                ck_assert_msg(r >= 0, "Admit: %s", err.message);
                ck_assert_int_ge(sd_bus_message_read(reply, "sstti" "ooo", &verdict, &reason, &retry, &predicted,
                                                     &prio, &enc, &pre, &dec),
                                 0);
                ck_assert_str_eq(verdict, "admit");
                if (cached == 1)
                        ck_assert_str_eq(enc, "/");
                else
                        ck_assert_str_eq(enc, encoder);
                sd_bus_message_unref(reply);
        }
        /* At most 1024 keys: each is looked up on the loop (review). */
        sd_bus_message *big = NULL;
        ck_assert_int_ge(sd_bus_message_new_method_call(bus, &big, NULL, "/org/epd1", "org.epd1.Scheduler", "Admit"), 0);
        ck_assert_int_ge(sd_bus_message_append(big, "sst", "%032x", "interactive", (uint64_t)0), 0);
        ck_assert_int_ge(sd_bus_message_open_container(big, 'a', "{sv}"), 0);
        ck_assert_int_ge(sd_bus_message_open_container(big, 'e', "sv"), 0);
        ck_assert_int_ge(sd_bus_message_append(big, "s", "FeatureKeys"), 0);
        ck_assert_int_ge(sd_bus_message_open_container(big, 'v', "as"), 0);
        ck_assert_int_ge(sd_bus_message_open_container(big, 'a', "s"), 0);
        for (int i = 0; i < 1025; i++)
                ck_assert_int_ge(sd_bus_message_append(big, "s", "img-1"), 0);
        for (int i = 0; i < 4; i++)
                ck_assert_int_ge(sd_bus_message_close_container(big), 0);
        ck_assert_int_lt(sd_bus_call(bus, big, 0, &err, NULL), 0);
        ck_assert_str_eq(err.name, "org.epd1.Error.LimitExceeded");
        ck_assert_ptr_nonnull(strstr(err.message, "1024 FeatureKeys"));
        sd_bus_message_unref(big);
        sd_bus_error_free(&err);
        sd_bus_flush_close_unref(bus);
        epd_disconnect(d);
        epd_disconnect(p);
}
END_TEST

/* [Pool:NAME] in epd.conf: which decode workers serve a pool and its priority change
 * what Admit chooses; a reload (SIGHUP) applies a new file and refuses a bad one. */
static sd_bus *register_named(Harness *hh, const char *role, const char *name, const char *label, char *path,
                              size_t n) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *p;
        int r;
        ck_assert_int_ge(harness_direct_bus(hh, &bus), 0);
        if (label)
                r = sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &e, &reply,
                                       "sssa{sv}", role, "m", "cpu", 2, "name", "s", name, "labels", "as", 1, label);
        else
                r = sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &e, &reply,
                                       "sssa{sv}", role, "m", "cpu", 1, "name", "s", name);
        ck_assert_msg(r >= 0, "RegisterWorker: %s", e.message);
        ck_assert_int_ge(sd_bus_message_read(reply, "o", &p), 0);
        snprintf(path, n, "%s", p);
        sd_bus_message_unref(reply);
        return bus;
}

typedef struct Choice {
        char verdict[32], reason[64], decode[128];
        int32_t priority;
} Choice;

static void admit(sd_bus *bus, const char *rid, const char *type, Choice *c) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *verdict, *reason, *enc, *pre, *dec;
        uint64_t retry, predicted;
        int r = sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Scheduler", "Admit", &e, &reply, "ssta{sv}", rid,
                                   type, (uint64_t)0, 0);
        ck_assert_msg(r >= 0, "Admit: %s", e.message);
        ck_assert_int_ge(sd_bus_message_read(reply, "sstti" "ooo", &verdict, &reason, &retry, &predicted, &c->priority,
                                             &enc, &pre, &dec),
                         0);
        snprintf(c->verdict, sizeof c->verdict, "%s", verdict);
        snprintf(c->reason, sizeof c->reason, "%s", reason);
        snprintf(c->decode, sizeof c->decode, "%s", dec);
        sd_bus_message_unref(reply);
}

static void write_config(Harness *hh, const char *pools) {
        FILE *f = fopen(hh->config, "we");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "[Daemon]\nSocket=%s\nSystemBus=no\nStateDirectory=%s/state\n%s", hh->socket, hh->dir, pools);
        ck_assert_int_eq(fclose(f), 0);
}

typedef struct ReloadWait {
        sd_bus *bus;
        const char *type;
        const char *want_decode;
        unsigned n;
} ReloadWait;

static bool chosen(void *userdata) {
        ReloadWait *w = userdata;
        Choice c;
        char rid[32];
        snprintf(rid, sizeof rid, "poll-%u", w->n++);
        admit(w->bus, rid, w->type, &c);
        return strcmp(c.verdict, "admit") == 0 && strcmp(c.decode, w->want_decode) == 0;
}

START_TEST(test_pool_config) {
        Harness p;
        char fast[128], slow[128], pre[128], path[128];
        Choice c;

        ck_assert_int_eq(harness_init(&p, "[Pool:interactive]\nPriority=9\nDecodeWorkers=label:fast\n"
                                          "[Pool:thinking]\nDecodeWorkers=name:slow-*\n"),
                         0);
        ck_assert_int_eq(harness_start_epdd(&p, NULL), 0);
        /* The prefill worker through libepd, as a worker would. */
        char paddr[512];
        epd_client *bp;
        static const char *const plabels[] = { "p", "h200", NULL };
        harness_direct_address(&p, paddr, sizeof paddr);
        ck_assert_int_eq(epd_connect(paddr, &bp), 0);
        ck_assert_int_eq(epd_register_named(bp, "prefill", "m", "cpu", NULL, NULL, "pre-0", plabels), 0);
        snprintf(pre, sizeof pre, "%s", epd_worker_path(bp));
        sd_bus *bf = register_named(&p, "decode", "fast-0", "fast", fast, sizeof fast);
        sd_bus *bs = register_named(&p, "decode", "slow-1", NULL, slow, sizeof slow);
        sd_bus *tool;
        ck_assert_int_ge(harness_direct_bus(&p, &tool), 0);
        /* What the selectors match is visible on the worker. */
        {
                sd_bus_error e = SD_BUS_ERROR_NULL;
                char *name = NULL, **labels = NULL;
                ck_assert_int_ge(sd_bus_get_property_string(tool, NULL, fast, "org.epd1.Worker", "Name", &e, &name), 0);
                ck_assert_str_eq(name, "fast-0");
                ck_assert_int_ge(sd_bus_get_property_strv(tool, NULL, fast, "org.epd1.Worker", "Labels", &e, &labels), 0);
                ck_assert_ptr_nonnull(labels);
                ck_assert_str_eq(labels[0], "fast");
                ck_assert_ptr_null(labels[1]);
                free(name);
                free(labels[0]);
                free(labels);
                ck_assert_int_ge(sd_bus_get_property_strv(tool, NULL, pre, "org.epd1.Worker", "Labels", &e, &labels), 0);
                ck_assert_str_eq(labels[0], "p");
                ck_assert_str_eq(labels[1], "h200");
                ck_assert_ptr_null(labels[2]);
                free(labels[0]);
                free(labels[1]);
                free(labels);
        }

        /* The pools' decode workers are the configured ones, whatever the load. */
        for (int i = 0; i < 3; i++) {
                char rid[32];
                snprintf(rid, sizeof rid, "i-%d", i);
                admit(tool, rid, "interactive", &c);
                ck_assert_str_eq(c.verdict, "admit");
                ck_assert_str_eq(c.decode, fast);
                ck_assert_int_eq(c.priority, 9);
                snprintf(rid, sizeof rid, "t-%d", i);
                admit(tool, rid, "thinking", &c);
                ck_assert_str_eq(c.verdict, "admit");
                ck_assert_str_eq(c.decode, slow);
        }

        /* Reload: interactive moves to the slow worker; the hybrid pool is served by
         * nobody at decode, so it is rejected with the reason. */
        write_config(&p, "[Pool:interactive]\nDecodeWorkers=name:slow-*\n"
                         "[Pool:hybrid]\nDecodeWorkers=label:none-has-this\n");
        ck_assert_int_eq(kill(p.epdd_pid, SIGHUP), 0);
        ReloadWait w = { .bus = tool, .type = "interactive", .want_decode = slow };
        ck_assert(harness_wait_for(chosen, &w, 5000));
        admit(tool, "after-reload", "interactive", &c);
        ck_assert_str_eq(c.decode, slow);
        ck_assert_int_eq(c.priority, 2); /* back to the default */
        admit(tool, "h-0", "hybrid", &c);
        ck_assert_str_eq(c.verdict, "reject");
        ck_assert_str_eq(c.reason, "no-workers");

        /* A bad file is refused as a whole: the running policies stay. */
        write_config(&p, "[Pool:interactive]\nDecodeWorkers=label:fast\nHighWatermark=99999\n");
        ck_assert_int_eq(kill(p.epdd_pid, SIGHUP), 0);
        usleep(300 * 1000);
        admit(tool, "after-bad-reload", "interactive", &c);
        ck_assert_str_eq(c.verdict, "admit");
        ck_assert_str_eq(c.decode, slow);
        FILE *log = fopen(p.log, "re");
        ck_assert_ptr_nonnull(log);
        char line[1024];
        bool named = false;
        while (fgets(line, sizeof line, log))
                if (strstr(line, "HighWatermark=99999"))
                        named = true;
        fclose(log);
        ck_assert_msg(named, "the refused reload does not name the key in %s", p.log);

        (void)path;
        sd_bus_flush_close_unref(tool);
        sd_bus_flush_close_unref(bs);
        sd_bus_flush_close_unref(bf);
        epd_disconnect(bp);
        ck_assert_int_eq(harness_stop_epdd(&p), 0);
        harness_done(&p);
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

/* A call by another uid (65534) on its own connection: the error name it got, or "" when
 * the call succeeded. */
static void call_as_nobody(const char *member, const char *request_id, char *ret, size_t n) {
        int fds[2];
        ck_assert_int_eq(pipe(fds), 0);
        pid_t pid = harness_fork_as(65534);
        if (pid == 0) {
                char name[200] = "";
                sd_bus *raw = NULL;
                sd_bus_message *reply = NULL;
                sd_bus_error e = SD_BUS_ERROR_NULL;
                int r;
                close(fds[0]);
                r = harness_raw_bus(&h, &raw);
                if (r < 0) {
                        fprintf(stderr, "uid 65534: no connection: %s\n", strerror(-r));
                        _exit(4);
                }
                if (strcmp(member, "Complete") == 0)
                        r = sd_bus_call_method(raw, harness_destination(&h), "/org/epd1", "org.epd1.Scheduler",
                                               "Complete", &e, &reply, "sstb", request_id, "prefill",
                                               (uint64_t)1000, 1);
                else
                        r = sd_bus_call_method(raw, harness_destination(&h), "/org/epd1", "org.epd1.Scheduler",
                                               "Admit", &e, &reply, "ssta{sv}", request_id, "interactive",
                                               (uint64_t)0, 0);
                if (r < 0)
                        snprintf(name, sizeof name, "%s", e.name ? e.name : "?");
                if (write(fds[1], name, sizeof name) != (ssize_t)sizeof name)
                        _exit(3);
                _exit(0);
        }
        close(fds[1]);
        char name[200] = "-";
        int status;
        ck_assert_int_eq(read(fds[0], name, sizeof name), (ssize_t)sizeof name);
        close(fds[0]);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the uid 65534 child failed");
        snprintf(ret, n, "%s", name);
}

/* Requests belong to the client that admitted them: gone with it, completed only by it,
 * the worker given the stage, or root; their number per client bounded. */
START_TEST(test_requests_belong_to_their_client) {
        epd_client *p, *d, *tool, *other;
        epd_admission a;
        char name[200];

        p = registered("prefill");
        d = registered("decode");
        ck_assert_int_eq(epd_configure_worker(d, 64, 0, 1000), 0);
        ck_assert_int_eq(epd_connect(address, &tool), 0);
        ck_assert_int_eq(epd_admit(tool, "o1", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_int_eq(epd_admit(tool, "o2", "interactive", 3600ULL * 1000000, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        /* Its own repeat is its first admission again (idempotent). */
        ck_assert_int_eq(epd_admit(tool, "o2", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_uint_eq(outstanding(), 2);

        /* Another user (nobody, let through the directory and socket) may neither
         * complete nor claim them. */
        if (geteuid() != 0) {
                printf("SKIP part: not root, cannot call as another uid\n");
                goto bound;
        }
        harness_let_others_in(&h);
        call_as_nobody("Complete", "o1", name, sizeof name);
        ck_assert_str_eq(name, "org.epd1.Error.PermissionDenied");
        call_as_nobody("Admit", "o1", name, sizeof name);
        ck_assert_str_eq(name, "org.epd1.Error.PermissionDenied");
        ck_assert_uint_eq(outstanding(), 2);

bound:
        /* The bound per client ([Limits] MaxRequestsPerClient=3 here). */
        ck_assert_int_eq(epd_admit(tool, "o3", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_int_lt(epd_admit(tool, "o4", "interactive", 0, 1, false, &a), 0);
        ck_assert_str_eq(epd_last_error_name(tool), "org.epd1.Error.LimitExceeded");
        ck_assert_uint_eq(outstanding(), 3);
        /* Another client has its own allowance. */
        ck_assert_int_eq(epd_connect(address, &other), 0);
        ck_assert_int_eq(epd_admit(other, "o4", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        /* The workers given the stages report them (o1 ends). */
        ck_assert_int_eq(epd_complete(p, "o1", "prefill", 1000, true), 0);
        ck_assert_int_eq(epd_complete(d, "o1", "decode", 1000, true), 0);
        ck_assert_uint_eq(outstanding(), 3);

        /* The admitting client goes: its requests go with it, at once, not at their
         * deadline (o2's is an hour away). */
        epd_disconnect(tool);
        for (int i = 0; i < 200 && outstanding() != 1; i++)
                usleep(5000);
        ck_assert_uint_eq(outstanding(), 1);
        epd_disconnect(other);
        for (int i = 0; i < 200 && outstanding() != 0; i++)
                usleep(5000);
        ck_assert_uint_eq(outstanding(), 0);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A worker of uid 65534 in a child: it registers (role), tells it is ready, waits for
 * the word, reports Complete of request `rid` for each of `stages` in turn and sends
 * back each one's error ("" when accepted; with the message when `message`). */
typedef struct NobodyWorker {
        pid_t pid;
        int ready[2], go[2], result[2];
} NobodyWorker;

#define NOBODY_STAGES 2

static void nobody_worker_start(NobodyWorker *n, const char *role, const char *rid,
                                const char *const stages[NOBODY_STAGES], bool message) {
        harness_let_others_in(&h);
        ck_assert_int_eq(pipe(n->ready), 0);
        ck_assert_int_eq(pipe(n->go), 0);
        ck_assert_int_eq(pipe(n->result), 0);
        n->pid = harness_fork_as(65534);
        if (n->pid == 0) {
                char names[NOBODY_STAGES][200] = { "", "" }, c = 0;
                epd_client *w;
                if (epd_connect(address, &w) < 0 || epd_register(w, role, "m", "cpu", NULL, NULL) < 0 ||
                    (strcmp(role, "decode") == 0 && epd_configure_worker(w, 64, 0, 1000) < 0))
                        _exit(3);
                if (write(n->ready[1], &c, 1) != 1 || read(n->go[0], &c, 1) != 1)
                        _exit(4);
                for (int i = 0; i < NOBODY_STAGES; i++)
                        if (epd_complete(w, rid, stages[i], 1000, true) < 0)
                                snprintf(names[i], sizeof names[i], "%s%s%s", epd_last_error_name(w),
                                         message ? " " : "", message ? epd_last_error_message(w) : "");
                if (write(n->result[1], names, sizeof names) != (ssize_t)sizeof names)
                        _exit(5);
                epd_disconnect(w);
                _exit(0);
        }
        char c;
        ck_assert_int_eq(read(n->ready[0], &c, 1), 1);
}

/* Lets it report (the request admitted meanwhile) and collects what it was told. */
static void nobody_worker_finish(NobodyWorker *n, char names[NOBODY_STAGES][200]) {
        char c = 0;
        int status;
        ck_assert_int_eq(write(n->go[1], &c, 1), 1);
        ck_assert_int_eq(read(n->result[0], names, NOBODY_STAGES * 200), NOBODY_STAGES * 200);
        ck_assert_int_eq(waitpid(n->pid, &status, 0), n->pid);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the uid 65534 worker failed (%d)", status);
        for (int i = 0; i < 2; i++) {
                close(n->ready[i]);
                close(n->go[i]);
                close(n->result[i]);
        }
}

/* The worker a stage was given to reports it, as the user it runs as (not root): a
 * decode worker of uid 65534 completes the decode stage of a request another client
 * admitted, and may not report the prefill stage it was not given. */
START_TEST(test_stage_worker_not_root) {
        if (geteuid() != 0) {
                printf("SKIP: not root, cannot run a worker as another uid\n");
                return;
        }
        NobodyWorker n;
        char names[NOBODY_STAGES][200];
        nobody_worker_start(&n, "decode", "s1", (const char *const[]){ "prefill", "decode" }, false);
        epd_client *p, *tool;
        epd_admission a;
        p = registered("prefill");
        ck_assert_int_eq(epd_connect(address, &tool), 0);
        ck_assert_int_eq(epd_admit(tool, "s1", "interactive", 3600ULL * 1000000, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_uint_eq(outstanding(), 1);
        nobody_worker_finish(&n, names);
        ck_assert_str_eq(names[0], "org.epd1.Error.PermissionDenied");
        ck_assert_str_eq(names[1], "");
        /* Its decode stage, the last, ended the request. */
        ck_assert_uint_eq(outstanding(), 0);
        epd_disconnect(tool);
        epd_disconnect(p);
}
END_TEST

/* A stage reported once is no longer outstanding: its worker (not root, not the
 * admitting client) repeating the report is told NotFound, not that the stage "was not
 * given to this worker", and the request waits for its decode as before. */
START_TEST(test_stage_repeat_not_outstanding) {
        if (geteuid() != 0) {
                printf("SKIP: not root, cannot run a worker as another uid\n");
                return;
        }
        NobodyWorker n;
        char names[NOBODY_STAGES][200];
        nobody_worker_start(&n, "prefill", "s2", (const char *const[]){ "prefill", "prefill" }, true);
        epd_client *d, *tool;
        epd_admission a;
        d = registered("decode");
        ck_assert_int_eq(epd_configure_worker(d, 64, 0, 1000), 0);
        ck_assert_int_eq(epd_connect(address, &tool), 0);
        ck_assert_int_eq(epd_admit(tool, "s2", "interactive", 3600ULL * 1000000, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        nobody_worker_finish(&n, names);
        ck_assert_str_eq(names[0], "");
        ck_assert_msg(strncmp(names[1], "org.epd1.Error.NotFound No outstanding prefill stage", 52) == 0, "%s",
                      names[1]);
        ck_assert_uint_eq(outstanding(), 1);
        ck_assert_int_eq(epd_complete(d, "s2", "decode", 1000, true), 0);
        ck_assert_uint_eq(outstanding(), 0);
        epd_disconnect(tool);
        epd_disconnect(d);
}
END_TEST

/* A refused ConfigureWorker changes nothing: not Host (the decode worker would sit
 * behind a peer that is down, and every pair with it be blocked), not Pools. */
START_TEST(test_configure_refused_changes_nothing) {
        Harness p;
        char paddr[512];
        epd_client *pre, *dec, *tool;
        epd_admission a;

        /* A peer nobody listens for: a worker on its host is behind a path that is down. */
        char keyfile[] = "/tmp/epd-sched-key-XXXXXX", conf[256];
        int kfd = mkstemp(keyfile);
        ck_assert_int_ge(kfd, 0);
        ck_assert_int_eq(write(kfd, "0123456789abcdef0123456789abcdef", 32), 32);
        close(kfd);
        snprintf(conf, sizeof conf, "[Cluster]\nClusterKeyFile=%s\n[Peer:bravo]\nAddress=127.0.0.1:9\nHostId=bravo\n",
                 keyfile);
        ck_assert_int_eq(harness_init(&p, conf), 0);
        ck_assert_int_eq(harness_start_epdd(&p, NULL), 0);
        harness_direct_address(&p, paddr, sizeof paddr);
        ck_assert_int_eq(epd_connect(paddr, &tool), 0);
        ck_assert_int_eq(epd_connect(paddr, &pre), 0);
        ck_assert_int_eq(epd_register(pre, "prefill", "m", "cpu", NULL, NULL), 0);
        ck_assert_int_eq(epd_connect(paddr, &dec), 0);
        ck_assert_int_eq(epd_register(dec, "decode", "m", "cpu", NULL, NULL), 0);
        ck_assert_int_eq(epd_configure_worker(dec, 4, 0, 100), 0);
        ck_assert_int_eq(epd_admit(tool, "r1", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);

        /* Host with an out-of-range Slots: refused, and the worker is still here. */
        ck_assert_int_lt(epd__call(dec, "/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", NULL, "oa{sv}",
                                   epd_worker_path(dec), 2, "Host", "s", "bravo", "Slots", "u", 70000),
                         0);
        ck_assert_str_eq(epd_last_error_name(dec), "org.epd1.Error.InvalidArgument");
        ck_assert_int_eq(epd_admit(tool, "r2", "interactive", 0, 1, false, &a), 0);
        ck_assert_msg(a.verdict == EPD_ADMIT, "after a refused Host=bravo: %s", a.reason);
        /* Pools with an out-of-range QueueLimit: refused, the worker serves every pool. */
        ck_assert_int_lt(epd__call(dec, "/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", NULL, "oa{sv}",
                                   epd_worker_path(dec), 2, "Pools", "as", 1, "thinking", "QueueLimit", "u",
                                   (uint32_t)(2u << 20)),
                         0);
        ck_assert_str_eq(epd_last_error_name(dec), "org.epd1.Error.InvalidArgument");
        ck_assert_int_eq(epd_admit(tool, "r3", "interactive", 0, 1, false, &a), 0);
        ck_assert_msg(a.verdict == EPD_ADMIT, "after a refused Pools=thinking: %s", a.reason);
        /* Given alone, Host does what it says: the path to bravo is down. */
        ck_assert_int_eq(epd__call(dec, "/org/epd1", "org.epd1.Scheduler", "ConfigureWorker", NULL, "oa{sv}",
                                   epd_worker_path(dec), 1, "Host", "s", "bravo"),
                         0);
        ck_assert_int_eq(epd_admit(tool, "r4", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_DEFER);
        ck_assert_str_eq(a.reason, "backpressure");
        char tr[256];
        trace_of(tool, "r4", tr, sizeof tr);
        ck_assert_str_eq(tr, "backpressure interactive defer: backpressure;");

        epd_disconnect(dec);
        epd_disconnect(pre);
        epd_disconnect(tool);
        ck_assert_int_eq(harness_stop_epdd(&p), 0);
        harness_done(&p);
        unlink(keyfile);
}
END_TEST

/* A pool's counters, as the Pools property has them. */
typedef struct PoolCounts {
        uint32_t queue, queue_peak;
        uint64_t admitted, deferred, rejected, completed, failed;
} PoolCounts;

static void pool_counts(const char *pool, PoolCounts *ret) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *name;
        uint32_t q, peak;
        double rate[4];
        uint64_t v[7];
        bool found = false;
        int r;

        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        r = sd_bus_get_property(bus, NULL, "/org/epd1", "org.epd1.Scheduler", "Pools", &e, &reply,
                                "a(suuddddttttttt)");
        ck_assert_msg(r >= 0, "Pools: %s", e.message);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(suuddddttttttt)"), 0);
        while ((r = sd_bus_message_read(reply, "(suuddddttttttt)", &name, &q, &peak, &rate[0], &rate[1], &rate[2],
                                        &rate[3], &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6])) > 0)
                if (strcmp(name, pool) == 0) {
                        *ret = (PoolCounts){ .queue = q, .queue_peak = peak, .admitted = v[0], .deferred = v[1],
                                             .rejected = v[2], .completed = v[3], .failed = v[4] };
                        found = true;
                }
        ck_assert_int_ge(r, 0);
        ck_assert(found);
        sd_bus_message_unref(reply);
        sd_bus_flush_close_unref(bus);
}

/* A client at [Limits] MaxObjectsPerClient= (2 here) is refused a new request before the
 * scheduler decides anything: it used to be admitted (counted, its predicted end pushing
 * others back), then cancelled when it could not be made the client's (counted failed),
 * so its refused calls moved every client's pool counters and rho. */
START_TEST(test_objects_full_refused_before_admit) {
        epd_client *p, *d, *tool;
        epd_admission a;
        PoolCounts before, after;

        p = registered("prefill");
        d = registered("decode");
        ck_assert_int_eq(epd_configure_worker(d, 64, 0, 1000), 0);
        ck_assert_int_eq(epd_connect(address, &tool), 0);
        ck_assert_int_eq(epd_admit(tool, "q1", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_int_eq(epd_admit(tool, "q2", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);

        /* Full: refused with the reason, and nothing of the scheduler moved. */
        pool_counts("interactive", &before);
        ck_assert_int_lt(epd_admit(tool, "q3", "interactive", 0, 1, false, &a), 0);
        ck_assert_str_eq(epd_last_error_name(tool), "org.epd1.Error.LimitExceeded");
        pool_counts("interactive", &after);
        ck_assert_uint_eq(after.admitted, before.admitted);
        ck_assert_uint_eq(after.failed, before.failed);
        ck_assert_uint_eq(after.deferred, before.deferred);
        ck_assert_uint_eq(after.rejected, before.rejected);
        ck_assert_uint_eq(after.queue, 2);
        ck_assert_uint_eq(after.queue_peak, before.queue_peak);
        ck_assert_uint_eq(outstanding(), 2);
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(tool), "MaxObjectsPerClient="));
        /* Its own outstanding request again is no new object: answered as it stands. */
        ck_assert_int_eq(epd_admit(tool, "q1", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);

        /* Room again once one ends. */
        ck_assert_int_eq(epd_complete(p, "q1", "prefill", 1000, true), 0);
        ck_assert_int_eq(epd_complete(d, "q1", "decode", 1000, true), 0);
        ck_assert_int_eq(epd_admit(tool, "q3", "interactive", 0, 1, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_uint_eq(outstanding(), 2);
        epd_disconnect(tool);
        epd_disconnect(d);
        epd_disconnect(p);
}
END_TEST

/* A client at [Limits] MaxRequestsPerClient= (1024 by default), its requests in all
 * three pools, disconnects: they all end with it, at once (counted failed in their
 * pools; one batch in epdd, not one queue walk each: tests/unit/test-scheduler.c
 * counts that), and another client's requests on the same workers stay and complete. */
START_TEST(test_client_leaving_with_many_requests) {
        enum { N = 1024 };
        static const char *const pools[] = { "thinking", "interactive", "hybrid" };
        epd_client *p, *d, *tool, *other;
        epd_admission a;
        PoolCounts before[3], after[3];
        char rid[32];

        p = registered("prefill");
        ck_assert_int_eq(epd_configure_worker(p, 2048, 0, 0), 0);
        d = registered("decode");
        ck_assert_int_eq(epd_configure_worker(d, 2048, 0, 100000), 0);
        ck_assert_int_eq(epd_connect(address, &other), 0);
        for (int t = 0; t < 3; t++) {
                snprintf(rid, sizeof rid, "k%d", t);
                ck_assert_int_eq(epd_admit(other, rid, pools[t], 3600ULL * 1000000, 1, false, &a), 0);
                ck_assert_int_eq(a.verdict, EPD_ADMIT);
        }
        ck_assert_int_eq(epd_connect(address, &tool), 0);
        for (unsigned i = 0; i < N; i++) {
                snprintf(rid, sizeof rid, "l%u", i);
                ck_assert_int_eq(epd_admit(tool, rid, pools[i % 3], 3600ULL * 1000000, 1, false, &a), 0);
                ck_assert_msg(a.verdict == EPD_ADMIT, "%s: %s", rid, a.reason);
        }
        ck_assert_int_lt(epd_admit(tool, "l-past", "interactive", 3600ULL * 1000000, 1, false, &a), 0);
        ck_assert_str_eq(epd_last_error_name(tool), "org.epd1.Error.LimitExceeded");
        ck_assert_uint_eq(outstanding(), N + 3);
        for (int t = 0; t < 3; t++)
                pool_counts(pools[t], &before[t]);

        epd_disconnect(tool);
        for (int i = 0; i < 400 && outstanding() != 3; i++)
                usleep(5000);
        ck_assert_uint_eq(outstanding(), 3);
        for (int t = 0; t < 3; t++) {
                pool_counts(pools[t], &after[t]);
                ck_assert_uint_eq(after[t].queue, 1);
                ck_assert_uint_eq(after[t].failed - before[t].failed, N / 3 + ((unsigned)t < N % 3));
                ck_assert_uint_eq(after[t].completed, before[t].completed);
        }

        /* The other client's stay theirs, and end as usual. */
        for (int t = 0; t < 3; t++) {
                snprintf(rid, sizeof rid, "k%d", t);
                ck_assert_int_eq(epd_complete(p, rid, "prefill", 1000, true), 0);
                ck_assert_int_eq(epd_complete(d, rid, "decode", 1000, true), 0);
                pool_counts(pools[t], &after[t]);
                ck_assert_uint_eq(after[t].completed, before[t].completed + 1);
                ck_assert_uint_eq(after[t].queue, 0);
        }
        ck_assert_uint_eq(outstanding(), 0);
        epd_disconnect(other);
        epd_disconnect(d);
        epd_disconnect(p);
}
END_TEST

static void setup_bounded(void) {
        ck_assert_int_eq(harness_init(&h, "[Limits]\nMaxRequestsPerClient=3\n"), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
}

static void setup_objects(void) {
        ck_assert_int_eq(harness_init(&h, "[Limits]\nMaxObjectsPerClient=2\n"), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
}

int main(void) {
        Suite *s = suite_create("scheduler");
        TCase *tc = tcase_create("scheduler");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_admit_complete);
        tcase_add_test(tc, test_configure_keeps_admitted);
        tcase_add_test(tc, test_feature_affinity);
        tcase_add_test(tc, test_introspection);
        tcase_add_test(tc, test_client_leaving_with_many_requests);
        suite_add_tcase(s, tc);
        TCase *to = tcase_create("ownership");
        tcase_add_checked_fixture(to, setup_bounded, teardown);
        tcase_set_timeout(to, 60);
        tcase_add_test(to, test_requests_belong_to_their_client);
        tcase_add_test(to, test_stage_worker_not_root);
        tcase_add_test(to, test_stage_repeat_not_outstanding);
        suite_add_tcase(s, to);
        TCase *tb = tcase_create("objects");
        tcase_add_checked_fixture(tb, setup_objects, teardown);
        tcase_set_timeout(tb, 60);
        tcase_add_test(tb, test_objects_full_refused_before_admit);
        suite_add_tcase(s, tb);
        TCase *tp = tcase_create("pool-config");
        tcase_set_timeout(tp, 60);
        tcase_add_test(tp, test_pool_config);
        tcase_add_test(tp, test_configure_refused_changes_nothing);
        suite_add_tcase(s, tp);
        return check_run(s, CK_NOFORK);
}
