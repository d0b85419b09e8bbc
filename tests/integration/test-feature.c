/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The feature cache end to end, through libepd: an encoder publishes and a prefill in
 * another process reads the same bytes through its own mapping; N prefills acquire a
 * missing key at once and exactly one produces; a producer killed before publishing
 * fails its waiters at once; bad descriptors get named errors; prefetch announces; the
 * store confines keys; handles come back to zero and memory stays flat over many
 * cycles; a large spilled feature is read back off the event loop (calls made after its
 * Acquire are answered first) and a truncated stored copy is a named error; the
 * introspection matches dbus/org.epd1.Feature.xml. Built twice: over the
 * direct socket, and over a private dbus-daemon (OVER_BUS). */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "epd-internal.h"
#include "epd/epd-feature.h"
#include "epd/epd-telemetry.h"
#include "feature/feature-store.h"
#include "harness.h"
#include "time-util.h"
#include "../check-main.h"

#ifdef OVER_BUS
#define OVER_BUS_MODE true
#else
#define OVER_BUS_MODE false
#endif

static Harness h;
static char address[512];
static char store_dir[300];

/* A 16 MiB cache and a store in the test's directory, with `extra` [Features] lines;
 * `slow`: the fault library's `var` (EPD_FAULT_READ_SLOW, EPD_FAULT_WRITE_SLOW) for epdd,
 * "MS:BYTES:" (the store's directory is the path it applies to), or NULL. */
static void start_with_store_fault(const char *extra, const char *var, const char *slow) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        snprintf(store_dir, sizeof store_dir, "%s/store", h.dir);
        ck_assert_int_eq(mkdir(store_dir, 0700), 0);
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "[Features]\nCacheSize=16M\nStoreDirectory=%s\n%s", store_dir, extra);
        fclose(f);
        if (!slow) {
                harness_start(&h, OVER_BUS_MODE, address, sizeof address);
                return;
        }
        const char *lib = getenv("FAULT_WAL");
        char value[400];
        ck_assert_msg(lib && access(lib, R_OK) == 0, "FAULT_WAL is not set (run through meson test)");
        char *real = realpath(store_dir, NULL); /* what the fault library reads back from /proc */
        ck_assert_ptr_nonnull(real);
        snprintf(value, sizeof value, "%s%s/", slow, real);
        free(real);
        harness_start_preloaded(&h, OVER_BUS_MODE, address, sizeof address, lib, var, value);
}

static void start_with_store(const char *extra, const char *slow) {
        start_with_store_fault(extra, "EPD_FAULT_READ_SLOW", slow);
}

static void setup(void) {
        start_with_store("", NULL);
}

/* A client may hold two objects: a worker registration and one handle. */
static void setup_bounded(void) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "[Features]\nCacheSize=16M\n[Limits]\nMaxObjectsPerClient=2\n");
        fclose(f);
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

/* A store that reads back slowly (every read of 64 KiB or more of its files, a feature's
 * data, 1500 ms longer: the fault library) and [Features] ReadBackTimeout=300ms. */
static void setup_slow_store(void) {
        start_with_store("ReadBackTimeout=300ms\n", "1500:65536:");
}

/* A store on a disk that stalls on every read of its files, the smallest too (a
 * header's 64 bytes): 700 ms longer each. */
static void setup_slow_disk(void) {
        start_with_store("", "700:1:");
}

/* [Features] ProduceTimeout=1s. */
static void setup_produce_timeout(void) {
        start_with_store("ProduceTimeout=1s\n", NULL);
}

static void teardown(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}


static epd_client *worker(const char *role) {
        epd_client *c;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, role, "qwen3-vl-test", "cpu", NULL, NULL), 0);
        return c;
}

/* A counter property of org.epd1.Feature (read on a connection of its own). */
static uint64_t stat_u64(epd_client *unused, const char *name) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus *bus;
        uint64_t v = 0;
        (void)unused;
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        int r = sd_bus_get_property_trivial(bus, harness_destination(&h), "/org/epd1/feature", "org.epd1.Feature",
                                            name, &e, 't', &v);
        ck_assert_msg(r >= 0, "%s: %s", name, e.message);
        sd_bus_error_free(&e);
        sd_bus_flush_close_unref(bus);
        return v;
}

/* One bf16 [rows, 64] embedding and an i64 [1, 3] grid_thw behind it. */
static size_t bundle(uint64_t rows, epd_feature_tensor t[2], uint64_t *bytes) {
        memset(t, 0, 2 * sizeof *t);
        t[0] = (epd_feature_tensor){ .name = "image_embeds", .dtype = "bfloat16", .rank = 2,
                                     .shape = { rows, 64 } };
        t[1] = (epd_feature_tensor){ .name = "grid_thw", .dtype = "i64", .rank = 2,
                                     .shape = { 1, 3 }, .offset = rows * 128 };
        *bytes = rows * 128 + 24;
        return 2;
}

static void fill(void *p, uint64_t n, uint8_t seed) {
        for (uint64_t i = 0; i < n; i++)
                ((uint8_t *)p)[i] = (uint8_t)(seed + i * 31);
}

static bool same(const void *p, uint64_t n, uint8_t seed) {
        for (uint64_t i = 0; i < n; i++)
                if (((const uint8_t *)p)[i] != (uint8_t)(seed + i * 31))
                        return false;
        return true;
}

/* The request id a hit on key shows to a worker of uid (a forked child running as that
 * uid when it is not ours); "?" when the hit fails. */
static void request_id_seen_by(uid_t uid, const char *key, char out[33]) {
        int fds[2];
        ck_assert_int_eq(pipe(fds), 0);
        pid_t pid = harness_fork_as(uid);
        if (pid == 0) {
                char seen[33] = "?";
                epd_client *c = NULL;
                epd_feature *f = NULL;
                close(fds[0]);
                if (epd_connect(address, &c) == 0 && epd_register(c, "prefill", "qwen3-vl-test", "cpu", NULL, NULL) == 0 &&
                    epd_feature_acquire(c, key, false, &f) == 0) {
                        snprintf(seen, sizeof seen, "%s", f->request_id);
                        (void)epd_feature_release(c, f);
                } else
                        fprintf(stderr, "as uid %u: %s\n", (unsigned)uid, c ? epd_last_error_message(c) : "no connection");
                epd_disconnect(c);
                _exit(write(fds[1], seen, sizeof seen) == sizeof seen ? 0 : 3);
        }
        close(fds[1]);
        int status;
        ck_assert_int_eq(read(fds[0], out, 33), 33);
        close(fds[0]);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
}

START_TEST(test_publish_then_hit) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(100, t, &bytes);
        epd_feature *p, *r;

        ck_assert_int_eq(epd_feature_reserve(enc, "sha256:aa|qwen3-vl|pp1", bytes, t, n,
                                             "0123456789abcdef0123456789abcdef", &p), 0);
        ck_assert_str_eq(p->state, "reserved");
        ck_assert_int_ge(p->arena, 0);
        ck_assert_ptr_nonnull(p->data);
        fill(p->data, bytes, 7);
        /* An encode time past an hour is refused by name (it would swell
         * EncoderTimeSavedUSec with every hit); the feature stays reserved. */
        ck_assert_int_eq(epd_feature_publish(enc, p, UINT64_MAX), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.InvalidArgument");
        ck_assert_msg(strstr(epd_last_error_message(enc), "encode_usec"), "%s", epd_last_error_message(enc));
        ck_assert_int_eq(epd_feature_publish(enc, p, 3600ULL * 1000000 + 1), -EINVAL);
        ck_assert_int_eq(epd_feature_refresh(enc, p), 0);
        ck_assert_str_eq(p->state, "reserved");
        ck_assert_uint_eq(stat_u64(enc, "Produced"), 0);
        ck_assert_int_eq(epd_feature_publish(enc, p, 4321), 0);

        ck_assert_int_eq(epd_feature_acquire(pre, "sha256:aa|qwen3-vl|pp1", false, &r), 0);
        ck_assert_str_eq(r->result, "hit");
        ck_assert_str_eq(r->state, "ready");
        ck_assert_uint_eq(r->bytes, bytes);
        ck_assert_str_eq(r->request_id, "0123456789abcdef0123456789abcdef");
        ck_assert_uint_eq(r->n_tensors, 2);
        ck_assert_str_eq(r->tensors[0].name, "image_embeds");
        ck_assert_str_eq(r->tensors[0].dtype, "bf16");
        ck_assert_uint_eq(r->tensors[0].strides[0], 64);
        ck_assert_uint_eq(r->tensors[0].strides[1], 1);
        ck_assert_uint_eq(r->tensors[1].offset, 100 * 128);
        /* another process's mapping, the same bytes */
        ck_assert_ptr_ne(r->data, NULL);
        ck_assert(same(r->data, bytes, 7));
        ck_assert_uint_eq(stat_u64(pre, "Hits"), 1);
        ck_assert_uint_eq(stat_u64(pre, "EncoderTimeSavedUSec"), 4321);
        ck_assert_uint_eq(stat_u64(pre, "Produced"), 1);
        ck_assert_uint_ge(stat_u64(pre, "BytesCached"), bytes);

        /* reserving a ready key again is refused by name */
        epd_feature *x;
        ck_assert_int_eq(epd_feature_reserve(enc, "sha256:aa|qwen3-vl|pp1", bytes, t, n, NULL, &x), -EEXIST);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.Exists");
        /* a handle of one client is not another's */
        ck_assert_int_eq(epd_feature_refresh(enc, r), -EPERM);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.PermissionDenied");

        /* The request id goes to the producer's uid and root only: it names the
         * request's handoffs, which an untargeted Accept takes by it (review). */
        if (geteuid() == 0) {
                char seen[33];
                harness_let_others_in(&h);
                request_id_seen_by(65534, "sha256:aa|qwen3-vl|pp1", seen);
                ck_assert_str_eq(seen, "");
                request_id_seen_by(0, "sha256:aa|qwen3-vl|pp1", seen);
                ck_assert_str_eq(seen, "0123456789abcdef0123456789abcdef");
        }

        ck_assert_int_eq(epd_feature_release(pre, r), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        ck_assert_uint_eq(stat_u64(pre, "Features"), 1); /* stays cached */
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

/* Publish and Release sent together without waiting: a reader is woken by them, every
 * handle is gone once epd_flush() returns, and a refusal comes back from epd_flush(),
 * naming the call, once. */
START_TEST(test_publish_release_nowait) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        epd_feature *p, *w, *r;

        ck_assert_int_eq(epd_flush(enc, 0), 0); /* nothing sent: nothing to wait for */
        ck_assert_int_eq(epd_feature_acquire(enc, "sha256:nowait", true, &p), 0);
        ck_assert_str_eq(p->result, "produce");
        ck_assert_int_eq(epd_feature_acquire(pre, "sha256:nowait", true, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        ck_assert_int_eq(epd_feature_produce(enc, p, bytes, t, n, NULL), 0);
        fill(p->data, bytes, 3);
        ck_assert_int_eq(epd_feature_publish_release(enc, p, 77), 0); /* p is freed */
        ck_assert_int_eq(epd_feature_wait(pre, w, 5 * 1000000ULL), 0);
        ck_assert_str_eq(w->state, "ready");
        ck_assert(same(w->data, bytes, 3));
        ck_assert_int_eq(epd_feature_release(pre, w), 0);
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        ck_assert_uint_eq(stat_u64(pre, "Produced"), 1);

        /* A reader's handle is not the producer's: the Publish is refused, the Release
         * goes through; epd_flush() says so once. */
        ck_assert_int_eq(epd_feature_acquire(enc, "sha256:nowait", false, &r), 0);
        ck_assert_str_eq(r->result, "hit");
        ck_assert_int_eq(epd_feature_publish_release(enc, r, 1), 0);
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), -ESTALE);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.Stale");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(enc), "Publish"));
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);

        /* Many in a row: the replies are taken as the next ones go out. */
        for (int i = 0; i < 64; i++) {
                char key[32];
                snprintf(key, sizeof key, "sha256:nowait-%d", i);
                ck_assert_int_eq(epd_feature_reserve(enc, key, bytes, t, n, NULL, &p), 0);
                fill(p->data, bytes, (uint8_t)i);
                ck_assert_int_eq(epd_feature_publish_release(enc, p, 1), 0);
        }
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        ck_assert_uint_eq(stat_u64(pre, "Produced"), 65);
        /* Sent and not waited for, then the client goes: the daemon still gets both. */
        ck_assert_int_eq(epd_feature_reserve(enc, "sha256:nowait-last", bytes, t, n, NULL, &p), 0);
        ck_assert_int_eq(epd_feature_publish_release(enc, p, 1), 0);
        epd_disconnect(enc);
        ck_assert_int_eq(epd_feature_acquire(pre, "sha256:nowait-last", false, &r), 0);
        ck_assert_str_eq(r->result, "hit");
        ck_assert_int_eq(epd_feature_release(pre, r), 0);
        /* After the client is gone, the call is refused and f freed all the same (the
         * ASan build's leak check says if not). */
        ck_assert_int_eq(epd_feature_reserve(pre, "sha256:nowait-closed", bytes, t, n, NULL, &p), 0);
        epd_disconnect(pre);
        ck_assert_int_eq(epd_feature_publish_release(NULL, p, 1), -EINVAL);

        /* A daemon that stopped reading: what the client queued cannot go, and
         * epd_disconnect() gives up within its bound instead of waiting for ever (as
         * sd_bus_flush() did: Python's Client.close() and __del__ hung with it). */
        enc = worker("encoder");
        static uint64_t hashes[65536];
        ck_assert_int_eq(kill(h.epdd_pid, SIGSTOP), 0);
        int sent = 0;
        for (int i = 0; i < 64 && sent >= 0; i++) { /* 32 MiB: more than any socket buffer */
                sd_bus_message *m = NULL;
                /* (a Ping with a body: refused at once once read, nothing to do) */
                sent = sd_bus_message_new_method_call(enc->bus, &m, harness_destination(&h), "/org/epd1",
                                                      "org.freedesktop.DBus.Peer", "Ping");
                if (sent >= 0)
                        sent = sd_bus_message_append_array(m, 't', hashes, sizeof hashes);
                if (sent >= 0)
                        sent = sd_bus_send(enc->bus, m, NULL);
                sd_bus_message_unref(m);
        }
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        epd_disconnect(enc);
        usec_t took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_int_eq(kill(h.epdd_pid, SIGCONT), 0);
        ck_assert_int_ge(sent, 0);
        ck_assert_msg(took < 5 * 1000000ULL, "epd_disconnect() took %" PRIu64 " us", (uint64_t)took);
        pre = worker("prefill"); /* the daemon serves on */
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        epd_disconnect(pre);
}
END_TEST

/* Acquire and Reserve in one call: a miss comes back reserved, a hit and a wait as
 * Acquire's, a refused reservation leaves no feature behind. */
START_TEST(test_acquire_or_reserve) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(20, t, &bytes);
        epd_feature *p, *w, *r;

        ck_assert_int_eq(epd_feature_acquire_or_reserve(enc, "sha256:aor", bytes, t, n,
                                                        "00000000000000000000000000000abc", &p), 0);
        ck_assert_str_eq(p->result, "produce");
        ck_assert_str_eq(p->state, "reserved");
        ck_assert_ptr_nonnull(p->data);
        ck_assert_uint_eq(p->bytes, bytes);
        ck_assert_uint_eq(p->n_tensors, 2);
        /* another producer meanwhile waits, as with Acquire */
        ck_assert_int_eq(epd_feature_acquire_or_reserve(pre, "sha256:aor", bytes, t, n, NULL, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        fill(p->data, bytes, 9);
        ck_assert_int_eq(epd_feature_publish(enc, p, 5), 0);
        ck_assert_int_eq(epd_feature_wait(pre, w, 5 * 1000000ULL), 0);
        ck_assert(same(w->data, bytes, 9));
        ck_assert_str_eq(w->request_id, "00000000000000000000000000000abc");
        ck_assert_int_eq(epd_feature_release(pre, w), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        /* then a hit: nothing reserved */
        ck_assert_int_eq(epd_feature_acquire_or_reserve(pre, "sha256:aor", bytes, t, n,
                                                        "00000000000000000000000000000def", &r), 0);
        ck_assert_str_eq(r->result, "hit");
        ck_assert(same(r->data, bytes, 9));
        ck_assert_int_eq(epd_feature_release(pre, r), 0);

        /* Each request's trace: the producer's miss, the encoder's start and its publish
         * (with the encode time it reported); the second request's hit. A call without a
         * request id leaves no trace. */
        static const struct {
                const char *request, *types[4];
        } want[] = {
                { "00000000000000000000000000000abc", { "acquire-miss", "encode-start", "publish", NULL } },
                { "00000000000000000000000000000def", { "acquire-hit", NULL } },
        };
        for (size_t q = 0; q < ELEMENTSOF(want); q++) {
                epd_trace_event *ev = NULL;
                size_t n_ev = 0, k = 0;
                ck_assert_int_eq(epd_trace_get(pre, want[q].request, &ev, &n_ev, NULL), 0);
                for (; k < n_ev && want[q].types[k]; k++) {
                        ck_assert_str_eq(ev[k].type, want[q].types[k]);
                        ck_assert_ptr_nonnull(strstr(ev[k].detail, "key=sha256:aor"));
                        ck_assert_uint_eq(ev[k].bytes, bytes);
                }
                ck_assert_uint_eq(k, n_ev);
                ck_assert_ptr_null(want[q].types[k]);
                if (q == 0)
                        ck_assert_uint_eq(ev[2].duration_usec, 5); /* Publish's encode_usec */
                else
                        ck_assert_ptr_nonnull(strstr(ev[0].detail, "hit"));
                free(ev);
        }
        ck_assert_uint_eq(stat_u64(pre, "Produced"), 1);
        ck_assert_uint_eq(stat_u64(pre, "BytesReserved"), 0);

        /* A reservation refused: the call's error, named; no feature left to wait for,
         * and, as for a refused Reserve, no failure or miss counted (nobody was told to
         * produce). */
        uint64_t features = stat_u64(pre, "Features");
        uint64_t failed = stat_u64(pre, "Failed"), misses = stat_u64(pre, "Misses");
        ck_assert_int_eq(epd_feature_acquire_or_reserve(enc, "sha256:aor-big", 64ULL << 20, t, n, NULL, &p),
                         -ENOSPC);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.NoSpace");
        ck_assert_uint_eq(stat_u64(pre, "Failed"), failed);
        ck_assert_uint_eq(stat_u64(pre, "Misses"), misses);
        ck_assert_int_eq(epd_feature_reserve(enc, "sha256:aor-big", 64ULL << 20, t, n, NULL, &p), -ENOSPC);
        ck_assert_uint_eq(stat_u64(pre, "Failed"), failed);
        ck_assert_uint_eq(stat_u64(pre, "Misses"), misses);
        ck_assert_int_eq(epd_feature_acquire_or_reserve(enc, "sha256:aor-big", bytes, t, n, "x", &p), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.InvalidArgument");
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        ck_assert_int_eq(epd_feature_acquire(pre, "sha256:aor-big", true, &r), 0);
        ck_assert_str_eq(r->result, "produce"); /* fresh: the refused one was not kept */
        ck_assert_int_eq(epd_feature_release(pre, r), 0);
        ck_assert_uint_le(stat_u64(pre, "Features"), features);

        /* A producer that fails: an error in its request's trace, with the reason. */
        ck_assert_int_eq(epd_feature_reserve(enc, "sha256:aor-fail", bytes, t, n, "000000000000000000000000000000fa",
                                             &p), 0);
        ck_assert_int_eq(epd_feature_fail(enc, p, "vision tower OOM"), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        epd_trace_event *ev = NULL;
        size_t n_ev = 0;
        ck_assert_int_eq(epd_trace_get(enc, "000000000000000000000000000000fa", &ev, &n_ev, NULL), 0);
        ck_assert_uint_eq(n_ev, 2);
        ck_assert_str_eq(ev[0].type, "encode-start");
        ck_assert_str_eq(ev[1].type, "error");
        ck_assert_ptr_nonnull(strstr(ev[1].detail, "vision tower OOM"));
        ck_assert_ptr_nonnull(strstr(ev[1].detail, "key=sha256:aor-fail"));
        free(ev);

        /* A reason whose multibyte character the trace cuts in two (it keeps 32 bytes):
         * the trace stays readable, the cut bytes replaced. Before, GetTrace failed for
         * good (sd-bus refuses invalid UTF-8) until the trace was evicted. */
        ck_assert_int_eq(epd_feature_reserve(enc, "sha256:aor-fail2", bytes, t, n, "000000000000000000000000000000fb",
                                             &p), 0);
        ck_assert_int_eq(epd_feature_fail(enc, p, "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\xe2\x82\xac and more"), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        ck_assert_int_eq(epd_trace_get(enc, "000000000000000000000000000000fb", &ev, &n_ev, NULL), 0);
        ck_assert_uint_eq(n_ev, 2);
        ck_assert_ptr_nonnull(strstr(ev[1].detail, "failed: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx?"));
        free(ev);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

/* A round trip on c: epdd has read everything c sent before it (one connection, in
 * order). */
static void round_trip(epd_client *c) {
        epd_feature *f = NULL;
        ck_assert_int_eq(epd_feature_acquire(c, "sha256:aos-sync", false, &f), -ENOENT);
}

typedef struct FreeInCallback {
        epd_client *c;
        epd_feature_call *call;
} FreeInCallback;

/* A reply callback that frees a call (while that call's finish dispatches it). */
static int free_call_in_callback(sd_bus_message *m, void *userdata, sd_bus_error *ret_error) {
        FreeInCallback *x = userdata;
        epd_feature_call_free(x->c, x->call);
        return 0;
}

/* AcquireOrReserve in two steps: sent, the caller works, then the answer is taken; and
 * every way of not taking it leaves nothing held. */
START_TEST(test_acquire_or_reserve_send) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(20, t, &bytes);
        epd_feature_call *call;
        epd_feature *p, *r;

        /* Sent; the caller works meanwhile; the answer is a reservation to write. */
        ck_assert_int_eq(epd_feature_acquire_or_reserve_send(enc, "sha256:aos", bytes, t, n,
                                                             "00000000000000000000000000000a05", &call), 0);
        uint8_t *work = malloc(bytes);
        ck_assert_ptr_nonnull(work);
        fill(work, bytes, 4);
        ck_assert_int_eq(epd_feature_call_finish(enc, call, 5 * 1000000ULL, &p), 0);
        ck_assert(epd_feature_call_taken(call));
        ck_assert_int_eq(epd_feature_call_finish(enc, call, 5 * 1000000ULL, &r), -EALREADY);
        epd_feature_call_free(enc, call); /* finished: only freed */
        ck_assert_str_eq(p->result, "produce");
        ck_assert_str_eq(p->state, "reserved");
        ck_assert_ptr_nonnull(p->data);
        ck_assert_uint_eq(p->bytes, bytes);
        ck_assert_uint_eq(p->n_tensors, 2);
        memcpy(p->data, work, bytes);
        free(work);
        ck_assert_int_eq(epd_feature_publish_release(enc, p, 7), 0);
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        /* Then a hit, the bytes as written. */
        ck_assert_int_eq(epd_feature_acquire_or_reserve_send(pre, "sha256:aos", bytes, t, n, NULL, &call), 0);
        ck_assert_int_eq(epd_feature_call_finish(pre, call, 5 * 1000000ULL, &r), 0);
        epd_feature_call_free(pre, call);
        ck_assert_str_eq(r->result, "hit");
        ck_assert(same(r->data, bytes, 4));
        ck_assert_int_eq(epd_feature_release(pre, r), 0);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);

        /* Refused: finish returns the refusal, named; nothing held. */
        ck_assert_int_eq(epd_feature_acquire_or_reserve_send(enc, "sha256:aos-big", 64ULL << 20, t, n, NULL, &call),
                         0);
        ck_assert_int_eq(epd_feature_call_finish(enc, call, 5 * 1000000ULL, &p), -ENOSPC);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.NoSpace");
        epd_feature_call_free(enc, call);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);

        /* Given up before the answer: the handle it brings is released when it comes. */
        ck_assert_int_eq(epd_feature_acquire_or_reserve_send(enc, "sha256:aos-1", bytes, t, n, NULL, &call), 0);
        epd_feature_call_free(enc, call);
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        round_trip(enc);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        ck_assert_int_eq(epd_feature_acquire(pre, "sha256:aos-1", true, &r), 0);
        ck_assert_str_eq(r->result, "produce"); /* the abandoned producer's claim went with its handle */
        ck_assert_int_eq(epd_feature_release(pre, r), 0);

        /* Given up after the answer came in (taken by epd_flush), before finish. */
        ck_assert_int_eq(epd_feature_acquire_or_reserve_send(enc, "sha256:aos-2", bytes, t, n, NULL, &call), 0);
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 1);
        epd_feature_call_free(enc, call);
        round_trip(enc);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);

        /* No answer in time (epdd stopped): -ETIMEDOUT, the call still the caller's, and
         * its answer taken by a later finish. The call has no sd-bus timeout of its own
         * (the client's default made 100 ms here): only finish's applies. */
        ck_assert_int_ge(sd_bus_set_method_call_timeout(enc->bus, 100 * 1000), 0);
        ck_assert_int_eq(kill(h.epdd_pid, SIGSTOP), 0);
        int sent = epd_feature_acquire_or_reserve_send(enc, "sha256:aos-3", bytes, t, n, NULL, &call);
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        int first = sent < 0 ? sent : epd_feature_call_finish(enc, call, 400 * 1000, &p);
        usec_t waited = now_usec(CLOCK_MONOTONIC) - t0;
        bool named = strstr(epd_last_error_message(enc), "sha256:aos-3") != NULL;
        ck_assert_int_eq(kill(h.epdd_pid, SIGCONT), 0); /* before any assertion: teardown needs it */
        ck_assert_int_eq(sent, 0);
        ck_assert_int_eq(first, -ETIMEDOUT);
        ck_assert(!epd_feature_call_taken(call));
        ck_assert_uint_ge(waited, 400 * 1000);
        ck_assert(named);
        ck_assert_int_eq(epd_feature_call_finish(enc, call, 5 * 1000000ULL, &p), 0);
        epd_feature_call_free(enc, call);
        ck_assert_str_eq(p->result, "produce");
        ck_assert_int_eq(epd_feature_fail(enc, p, "test"), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        /* Given up after a timeout: the late answer's handle is released when it comes. */
        ck_assert_int_eq(kill(h.epdd_pid, SIGSTOP), 0);
        sent = epd_feature_acquire_or_reserve_send(enc, "sha256:aos-5", bytes, t, n, NULL, &call);
        first = sent < 0 ? sent : epd_feature_call_finish(enc, call, 100 * 1000, &p);
        ck_assert_int_eq(kill(h.epdd_pid, SIGCONT), 0);
        ck_assert_int_eq(sent, 0);
        ck_assert_int_eq(first, -ETIMEDOUT);
        epd_feature_call_free(enc, call);
        ck_assert_int_eq(sd_bus_set_method_call_timeout(enc->bus, 0), 0); /* the default again */
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        round_trip(enc);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);

        /* Freed by a callback that its own finish dispatched: that finish ends
         * (-ECANCELED), the call is freed once, its answer's handle released. */
        FreeInCallback x = { .c = enc };
        ck_assert_int_ge(sd_bus_call_method_async(enc->bus, NULL, harness_destination(&h), "/org/epd1/feature",
                                                  "org.freedesktop.DBus.Peer", "Ping", free_call_in_callback, &x,
                                                  NULL),
                         0);
        ck_assert_int_eq(epd_feature_acquire_or_reserve_send(enc, "sha256:aos-6", bytes, t, n, NULL, &x.call), 0);
        ck_assert_int_eq(epd_feature_call_finish(enc, x.call, 5 * 1000000ULL, &p), -ECANCELED);
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        round_trip(enc);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        /* The same with the answer in already (taken by epd_flush), the freeing callback's
         * message read when finish begins: finish's one step dispatches it. Before, the
         * free freed the call at once and finish wrote into it (ASan: use after free). */
        FreeInCallback y = { .c = enc };
        ck_assert_int_eq(epd_feature_acquire_or_reserve_send(enc, "sha256:aos-7", bytes, t, n, NULL, &y.call), 0);
        ck_assert_int_eq(epd_flush(enc, 5 * 1000000ULL), 0);
        ck_assert_int_ge(sd_bus_call_method_async(enc->bus, NULL, harness_destination(&h), "/org/epd1/feature",
                                                  "org.freedesktop.DBus.Peer", "Ping", free_call_in_callback, &y,
                                                  NULL),
                         0);
        ck_assert_int_ge(sd_bus_flush(enc->bus), 0);
        ck_assert_int_gt(sd_bus_wait(enc->bus, 5 * 1000000ULL), 0);
        ck_assert_int_eq(epd_feature_call_finish(enc, y.call, 5 * 1000000ULL, &p), -ECANCELED);
        round_trip(enc);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);

        /* The client disconnected with a call unfinished: freed with no client (the
         * daemon released what the connection held). */
        ck_assert_int_eq(epd_feature_acquire_or_reserve_send(enc, "sha256:aos-4", bytes, t, n, NULL, &call), 0);
        epd_disconnect(enc);
        epd_feature_call_free(NULL, call);
        round_trip(pre);
        for (int i = 0; i < 100 && stat_u64(pre, "Handles") != 0; i++)
                usleep(10 * 1000); /* the disconnect is seen on epdd's loop */
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        epd_disconnect(pre);
}
END_TEST

START_TEST(test_bad_descriptor) {
        epd_client *enc = worker("encoder");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        epd_feature *p;

        t[1].offset = 8; /* inside image_embeds */
        ck_assert_int_eq(epd_feature_reserve(enc, "k", bytes, t, n, NULL, &p), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.InvalidArgument");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(enc), "overlap"));
        t[1].offset = bytes; /* past the end */
        ck_assert_int_eq(epd_feature_reserve(enc, "k", bytes, t, n, NULL, &p), -EINVAL);
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(enc), "out-of-range"));
        bundle(10, t, &bytes);
        t[0].dtype = "complex128";
        ck_assert_int_eq(epd_feature_reserve(enc, "k", bytes, t, n, NULL, &p), -EINVAL);
        bundle(10, t, &bytes);
        ck_assert_int_eq(epd_feature_reserve(enc, "k", 0, t, n, NULL, &p), -EINVAL);
        ck_assert_int_eq(epd_feature_reserve(enc, "k", bytes, t, n, "not-an-id", &p), -EINVAL);
        /* larger than the whole cache */
        ck_assert_int_eq(epd_feature_reserve(enc, "k", 64ULL << 20, t, n, NULL, &p), -ENOSPC);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.NoSpace");
        /* an unregistered client is told so */
        epd_client *anon;
        ck_assert_int_eq(epd_connect(address, &anon), 0);
        ck_assert_int_eq(epd_feature_acquire(anon, "k", true, &p), -ENOTCONN);
        ck_assert_str_eq(epd_last_error_name(anon), "org.epd1.Error.NotRegistered");
        epd_disconnect(anon);
        ck_assert_uint_eq(stat_u64(enc, "Features"), 0);
        epd_disconnect(enc);
}
END_TEST

#define N_CLIENTS 8

/* N prefill processes acquire the same missing key at once (may_produce): exactly one
 * is told to produce; the others wait without polling; all read the same bytes. */
START_TEST(test_coalescing) {
        int start[2], results[2];
        pid_t pids[N_CLIENTS];
        const char *key = "sha256:coalesce";

        ck_assert_int_eq(pipe(start), 0);
        ck_assert_int_eq(pipe(results), 0);
        for (int i = 0; i < N_CLIENTS; i++) {
                pids[i] = fork();
                ck_assert_int_ge(pids[i], 0);
                if (pids[i] == 0) {
                        epd_client *c;
                        epd_feature *f;
                        char go, line = 'E';
                        close(start[1]);
                        if (epd_connect(address, &c) < 0 || epd_register(c, "prefill", "m", "cpu", NULL, NULL) < 0)
                                _exit(10);
                        if (read(start[0], &go, 1) != 1) /* all at once */
                                _exit(11);
                        if (epd_feature_acquire(c, key, true, &f) < 0)
                                _exit(12);
                        if (strcmp(f->result, "produce") == 0) {
                                epd_feature_tensor t[2];
                                uint64_t bytes;
                                size_t n = bundle(1000, t, &bytes);
                                if (epd_feature_produce(c, f, bytes, t, n, NULL) < 0 || !f->data)
                                        _exit(13);
                                fill(f->data, bytes, 99);
                                usleep(200 * 1000); /* the others are waiting now */
                                if (epd_feature_publish(c, f, 200000) < 0)
                                        _exit(14);
                                line = 'P';
                        } else {
                                if (epd_feature_wait(c, f, 30 * 1000000ULL) < 0)
                                        _exit(15);
                                line = strcmp(f->result, "wait") == 0 ? 'W' : 'H';
                        }
                        if (!f->data || f->bytes != 1000 * 128 + 24 || !same(f->data, f->bytes, 99))
                                _exit(16);
                        if (write(results[1], &line, 1) != 1)
                                _exit(17);
                        epd_feature_release(c, f);
                        epd_disconnect(c);
                        _exit(0);
                }
        }
        close(start[0]);
        close(results[1]);
        usleep(300 * 1000); /* let them connect and register */
        char go[N_CLIENTS];
        memset(go, 'g', sizeof go);
        ck_assert_int_eq(write(start[1], go, sizeof go), N_CLIENTS);
        close(start[1]);
        int producers = 0, waiters = 0, hits = 0;
        for (int i = 0; i < N_CLIENTS; i++) {
                int status;
                ck_assert_int_eq(waitpid(pids[i], &status, 0), pids[i]);
                ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child %d: status %d", i,
                              WEXITSTATUS(status));
        }
        char c;
        while (read(results[0], &c, 1) == 1) {
                producers += c == 'P';
                waiters += c == 'W';
                hits += c == 'H';
        }
        close(results[0]);
        ck_assert_int_eq(producers, 1);
        ck_assert_int_eq(producers + waiters + hits, N_CLIENTS);

        epd_client *obs = worker("scheduler");
        ck_assert_uint_eq(stat_u64(obs, "Produced"), 1);
        ck_assert_uint_eq(stat_u64(obs, "CoalescedWaits"), (uint64_t)waiters);
        ck_assert_uint_eq(stat_u64(obs, "Handles"), 0);
        epd_disconnect(obs);
}
END_TEST

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* A producer killed before it publishes: its waiters fail at once (not at their
 * timeout), and the key can be produced again. */
START_TEST(test_producer_killed) {
        const char *key = "sha256:doomed";
        int ready[2];
        char x;

        ck_assert_int_eq(pipe(ready), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                epd_client *c;
                epd_feature *f;
                epd_feature_tensor t[2];
                uint64_t bytes;
                size_t n = bundle(10, t, &bytes);
                if (epd_connect(address, &c) < 0 || epd_register(c, "encoder", "m", "cpu", NULL, NULL) < 0 ||
                    epd_feature_reserve(c, key, bytes, t, n, NULL, &f) < 0)
                        _exit(1);
                if (write(ready[1], "r", 1) != 1)
                        _exit(2);
                pause();
                _exit(0);
        }
        close(ready[1]);
        ck_assert_int_eq(read(ready[0], &x, 1), 1);
        close(ready[0]);

        epd_client *pre = worker("prefill");
        epd_feature *w;
        ck_assert_int_eq(epd_feature_acquire(pre, key, true, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        ck_assert_int_eq(epd_feature_wait(pre, w, 200 * 1000), -ETIMEDOUT); /* still producing */

        double t0 = now_s();
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        /* a generous timeout: the wait must end long before it, with the failure */
        ck_assert_int_eq(epd_feature_wait(pre, w, 60 * 1000000ULL), -EPIPE);
        double waited = now_s() - t0;
        ck_assert_str_eq(w->state, "failed");
        ck_assert_str_eq(w->error, "producer-gone");
        ck_assert_msg(waited < 30.0, "waited %.1f s", waited);
        ck_assert_int_eq(epd_feature_release(pre, w), 0);

        /* the key starts over: this time the prefill produces */
        ck_assert_int_eq(epd_feature_acquire(pre, key, true, &w), 0);
        ck_assert_str_eq(w->result, "produce");
        /* and an explicit Fail reaches waiters too */
        epd_client *other = worker("prefill");
        epd_feature *w2;
        ck_assert_int_eq(epd_feature_acquire(other, key, false, &w2), 0);
        ck_assert_str_eq(w2->result, "wait");
        ck_assert_int_eq(epd_feature_fail(pre, w, "vision tower OOM"), 0);
        ck_assert_int_eq(epd_feature_wait(other, w2, 60 * 1000000ULL), -EPIPE);
        ck_assert_str_eq(w2->error, "producer-failed");
        epd_feature_release(other, w2);
        epd_feature_release(pre, w);
        ck_assert_uint_eq(stat_u64(pre, "Failed"), 2);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        epd_disconnect(other);
        epd_disconnect(pre);
}
END_TEST

static bool stored(void *userdata);
static int count_ready(sd_bus_message *m, void *userdata, sd_bus_error *e);

START_TEST(test_prefetch_pin_store) {
        epd_client *sched = worker("scheduler"), *enc = worker("encoder"), *pre = worker("prefill");
        const char *keys[] = { "img:1", "img:2" };
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(4096, t, &bytes); /* ~512 KiB */
        epd_feature *w, *p, *pin;

        ck_assert_int_eq(epd_feature_prefetch(sched, keys, 2), 0); /* none cached: announced */
        ck_assert_int_eq(epd_feature_acquire(pre, "img:1", false, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        ck_assert_int_eq(epd_feature_reserve(enc, "img:1", bytes, t, n, NULL, &p), 0);
        fill(p->data, bytes, 1);
        ck_assert_int_eq(epd_feature_publish(enc, p, 10), 0);
        ck_assert_int_eq(epd_feature_wait(pre, w, 10 * 1000000ULL), 0);
        ck_assert(same(w->data, bytes, 1));
        epd_feature_release(pre, w);
        epd_feature_release(enc, p);
        ck_assert_int_eq(epd_feature_prefetch(sched, keys, 1), 1); /* now present */

        /* pin img:1, then push 40 more features through a 16 MiB cache */
        ck_assert_int_eq(epd_feature_pin(pre, "img:1", &pin), 0);
        ck_assert_str_eq(pin->state, "ready");
        for (int i = 0; i < 40; i++) {
                char key[32];
                snprintf(key, sizeof key, "flood:%d", i);
                ck_assert_int_eq(epd_feature_reserve(enc, key, bytes, t, n, NULL, &p), 0);
                fill(p->data, bytes, (uint8_t)i);
                ck_assert_int_eq(epd_feature_publish(enc, p, 10), 0);
                epd_feature_release(enc, p);
        }
        ck_assert_uint_gt(stat_u64(pre, "Evictions"), 0);
        ck_assert_uint_gt(stat_u64(pre, "Spilled"), 0);
        ck_assert_uint_le(stat_u64(pre, "BytesCached"), 16 << 20);
        /* the pinned one is still in memory */
        ck_assert_int_eq(epd_feature_acquire(pre, "img:1", false, &w), 0);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 1));
        epd_feature_release(pre, w);
        epd_feature_release(pre, pin);
        /* an evicted one comes back from the store */
        uint64_t loaded = stat_u64(pre, "Loaded");
        /* (written by the spill thread: give it a moment) */
        int k = -ENOENT;
        for (int i = 0; i < 500 && k == -ENOENT; i++)
                if ((k = epd_feature_acquire(pre, "flood:0", false, &w)) == -ENOENT)
                        usleep(10000);
        ck_assert_int_eq(k, 0);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 0));
        ck_assert_uint_eq(stat_u64(pre, "Loaded"), loaded + 1);
        epd_feature_release(pre, w);
        /* another, through AcquireOrReserve with a request id: a hit, and its request's
         * trace says it was read back, once the bytes are */
        const char *rid = "000000000000000000000000000000b1";
        ck_assert(harness_wait_for(stored, (void *)"flood:1", 10000));
        ck_assert_int_eq(epd_feature_acquire_or_reserve(pre, "flood:1", bytes, t, n, rid, &w), 0);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 1));
        ck_assert_uint_eq(stat_u64(pre, "Loaded"), loaded + 2);
        epd_feature_release(pre, w);
        epd_trace_event *ev = NULL;
        size_t n_ev = 0;
        ck_assert_int_eq(epd_trace_get(pre, rid, &ev, &n_ev, NULL), 0);
        ck_assert_uint_eq(n_ev, 1);
        ck_assert_str_eq(ev[0].type, "acquire-hit");
        ck_assert_ptr_nonnull(strstr(ev[0].detail, "read-back"));
        ck_assert_uint_eq(ev[0].bytes, bytes);
        free(ev);

        /* keys that look like paths stay inside the store directory */
        ck_assert_int_eq(epd_feature_reserve(enc, "../../escape", bytes, t, n, NULL, &p), 0);
        ck_assert_int_eq(epd_feature_publish(enc, p, 10), 0);
        epd_feature_release(enc, p);
        /* only f-<hash>.feat files in the store (and the spill thread's .tmp- files while
         * it writes), and nothing named after the key around it */
        char cmd[900];
        snprintf(cmd, sizeof cmd,
                 "test -z \"$(find '%s' -mindepth 1 ! -name 'f-*.feat' ! -name '.tmp-*')\" && "
                 "test -z \"$(find '%s' /tmp -maxdepth 2 -name escape 2>/dev/null)\"",
                 store_dir, h.dir);
        ck_assert_int_eq(system(cmd), 0);
        epd_disconnect(sched);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

static int wanted_count;
static char wanted_key[64];

static int on_wanted(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        const char *key;
        if (sd_bus_message_read(m, "s", &key) >= 0) {
                snprintf(wanted_key, sizeof wanted_key, "%s", key);
                wanted_count++;
        }
        return 0;
}

static uint64_t cache_bytes;
static bool cache_bytes_is(void *userdata) {
        return stat_u64(NULL, "CacheBytes") == cache_bytes;
}

/* Prefetch announces FeatureWanted to the registered encoders only; other clients cannot touch a handle;
 * a reload changes the budget and evicts down to it. */
/* The stored file of key, and whether it is there (complete: the spill thread writes a
 * temporary file and renames it). */
static void store_path(const char *key, char *buf, size_t n) {
        char name[FEATURE_STORE_NAME_MAX];
        ck_assert_int_eq(feature_store_name(key, name), 0);
        snprintf(buf, n, "%s/%s", store_dir, name);
}

static bool stored(void *userdata) {
        char path[400];
        store_path(userdata, path, sizeof path);
        return access(path, F_OK) == 0;
}

static bool no_handles(void *userdata) {
        return stat_u64(NULL, "Handles") == 0;
}

typedef struct Answer {
        int order;
        uint64_t at; /* CLOCK_MONOTONIC, µs */
        char result[32];
        char error[128];
} Answer;

static int answered;

static int on_answer(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        Answer *a = userdata;
        const char *s = NULL;
        a->order = ++answered;
        a->at = now_usec(CLOCK_MONOTONIC);
        if (sd_bus_message_is_method_error(m, NULL))
                snprintf(a->error, sizeof a->error, "%s", sd_bus_message_get_error(m)->name);
        else if (sd_bus_message_read(m, "s", &s) > 0)
                snprintf(a->result, sizeof a->result, "%s", s);
        return 0;
}

/* Publishes keys[0] and keys[1], 12 MiB each (bytes seeded 7 and 8): two do not fit the
 * 16 MiB cache, so keys[1] takes keys[0]'s room and keys[0] goes to the store. Returns
 * their size. */
/* Publishes key, 12 MiB of bytes seeded `seed`: its size. */
static uint64_t publish_one(epd_client *enc, const char *key, uint8_t seed) {
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(96 * 1024, t, &bytes);
        epd_feature *p;

        ck_assert_int_eq(epd_feature_reserve(enc, key, bytes, t, n, NULL, &p), 0);
        fill(p->data, bytes, seed);
        ck_assert_int_eq(epd_feature_publish(enc, p, 10), 0);
        epd_feature_release(enc, p);
        return bytes;
}

static uint64_t publish_big(epd_client *enc, const char *const keys[2]) {
        uint64_t bytes = publish_one(enc, keys[0], 7);
        (void)publish_one(enc, keys[1], 8);
        ck_assert(harness_wait_for(stored, (void *)keys[0], 10000));
        return bytes;
}

/* On a raw connection of its own, registered as a prefill worker: Acquire key, then at
 * once three small calls (Get) on the same connection; returns once all four are
 * answered, with the time the Acquire was sent (ret_t0, may be NULL). The caller closes
 * the connection (which releases the handle). */
static sd_bus *acquire_beside_gets(const char *key, Answer *acquire, Answer gets[3], uint64_t *ret_t0) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *dest = harness_destination(&h);
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_call_method(bus, dest, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &e,
                                            &reply, "sssa{sv}", "prefill", "raw", "cpu", 0), 0);
        sd_bus_message_unref(reply);
        *acquire = (Answer) {};
        answered = 0;
        if (ret_t0)
                *ret_t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, dest, "/org/epd1/feature", "org.epd1.Feature",
                                                  "Acquire", on_answer, acquire, "sb", key, 0), 0);
        for (int i = 0; i < 3; i++) {
                gets[i] = (Answer) {};
                ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, dest, "/org/epd1",
                                                          "org.freedesktop.DBus.Properties", "Get", on_answer,
                                                          &gets[i], "ss", "org.epd1.Manager", "HostId"), 0);
        }
        while (answered < 4) {
                int r = sd_bus_process(bus, NULL);
                ck_assert_int_ge(r, 0);
                if (r == 0)
                        ck_assert_int_ge(sd_bus_wait(bus, 30 * 1000000ULL), 0);
        }
        return bus;
}

START_TEST(test_load_off_loop) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        const char *keys[] = { "big:0", "big:1" };
        uint64_t bytes = publish_big(enc, keys);
        epd_feature *w;
        char path[400];

        uint64_t loaded = stat_u64(pre, "Loaded");

        /* Acquire big:0, then at once ask three small things on the same connection.
         * The daemon reads big:0 back on a thread: the small answers come first. (Read
         * on the event loop, the Acquire's answer came first, whatever the file's size.) */
        Answer acquire, gets[3];
        sd_bus *bus = acquire_beside_gets(keys[0], &acquire, gets, NULL);
        ck_assert_str_eq(acquire.error, "");
        ck_assert_str_eq(acquire.result, "hit");
        ck_assert_msg(gets[0].order < acquire.order, "Get answered %d, Acquire %d", gets[0].order, acquire.order);
        ck_assert_uint_eq(stat_u64(pre, "Loaded"), loaded + 1);
        /* the bytes are the ones published */
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], false, &w), 0);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 7));
        epd_feature_release(pre, w);
        sd_bus_flush_close_unref(bus); /* releases the raw handle (once the daemon sees it) */
        ck_assert(harness_wait_for(no_handles, NULL, 10000));

        /* big:0 took big:1's room back; big:1 comes back the same way through libepd */
        ck_assert(harness_wait_for(stored, (void *)keys[1], 10000));
        ck_assert_int_eq(epd_feature_acquire(pre, keys[1], false, &w), 0);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 8));
        epd_feature_release(pre, w);

        /* A stored copy whose data is damaged (not the bytes published: its CRC32C) is a
         * named error once read, and is removed: the next producer makes the feature
         * afresh. */
        store_path(keys[0], path, sizeof path);
        struct stat st;
        ck_assert_int_eq(stat(path, &st), 0);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(pwrite(fd, "\xff", 1, st.st_size - 1), 1); /* the data's last byte (seeded 7) */
        close(fd);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], false, &w), -EIO);
        ck_assert_str_eq(epd_last_error_name(pre), "org.epd1.Error.Failed");
        ck_assert_int_ne(access(path, F_OK), 0);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], false, &w), -ENOENT);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], true, &w), 0);
        ck_assert_str_eq(w->result, "produce");
        epd_feature_release(pre, w);
        (void)publish_one(enc, keys[0], 7);
        /* One whose header does not match its size (truncated) is no stored copy: found
         * off the loop, removed, and the Acquire that found it is a miss, told to
         * produce in that same call. */
        ck_assert(harness_wait_for(stored, (void *)keys[1], 10000)); /* big:0 took its room */
        store_path(keys[1], path, sizeof path);
        ck_assert_int_eq(truncate(path, 4096), 0);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[1], true, &w), 0);
        ck_assert_str_eq(w->result, "produce");
        ck_assert_int_ne(access(path, F_OK), 0);
        epd_feature_release(pre, w);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[1], false, &w), -ENOENT);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

/* `epdctl features -j` against this daemon prints `needle`. */
static void epdctl_features_has(const char *needle) {
        char out[4096];
        harness_epdctl(address, "-j features", out, sizeof out);
        ck_assert_msg(strstr(out, needle), "no %s in: %s", needle, out);
}

static bool reloaded(void *userdata) {
        return harness_log_has(&h, "Configuration reloaded");
}

static bool loaded_one_more(void *userdata) {
        return stat_u64(NULL, "Loaded") > *(uint64_t *)userdata;
}

/* An Acquire whose feature the store reads back slower than [Features] ReadBackTimeout=
 * is refused with Error.Timeout at the timeout, not answered after the caller's own call
 * may have timed out with a handle it never learns of: no handle stays the caller's
 * while it stays connected, and it is no hit. The read goes on for the cache: once it is
 * done, the feature is a hit at once, with the published bytes. The setting reloads. */
START_TEST(test_read_back_timeout) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        const char *keys[] = { "big:0", "big:1" };
        uint64_t bytes = publish_big(enc, keys);
        epd_feature *w = NULL;

        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        uint64_t loaded = stat_u64(pre, "Loaded"), hits = stat_u64(pre, "Hits");
        ck_assert_uint_eq(stat_u64(pre, "ReadBackTimeouts"), 0);

        uint64_t t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], false, &w), -ETIMEDOUT);
        uint64_t took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_str_eq(epd_last_error_name(pre), "org.epd1.Error.Timeout");
        ck_assert_msg(strstr(epd_last_error_message(pre), "ReadBackTimeout="), "%s", epd_last_error_message(pre));
        ck_assert_msg(took >= 250 * 1000 && took < 1400 * 1000, "refused after %" PRIu64 " ms", took / 1000);
        ck_assert_ptr_null(w);
        ck_assert_uint_eq(stat_u64(pre, "ReadBackTimeouts"), 1); /* counted, and said in the log */
        ck_assert(harness_log_has(&h, "still being read back from the store after 300 ms"));
        epdctl_features_has("\"read_back_timeouts\":1");
        /* Nothing stays this client's while it stays connected. */
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        /* Once read back (not counted a hit: nobody was answered): a hit at once, the
         * published bytes. */
        ck_assert(harness_wait_for(loaded_one_more, &loaded, 20000));
        ck_assert_uint_eq(stat_u64(pre, "Hits"), hits);
        t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], false, &w), 0);
        ck_assert_msg(now_usec(CLOCK_MONOTONIC) - t0 < 1000 * 1000, "not read back meanwhile");
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 7));
        ck_assert_uint_eq(stat_u64(pre, "Hits"), hits + 1);
        epd_feature_release(pre, w);
        ck_assert(harness_wait_for(no_handles, NULL, 10000));

        /* Reloaded with ReadBackTimeout=0 (no limit): big:1, in the store since big:0
         * came back, is answered when its slow read lands. */
        ck_assert(harness_wait_for(stored, (void *)keys[1], 10000));
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "ReadBackTimeout=0\n"); /* the last section is [Features] */
        fclose(f);
        ck_assert_int_eq(kill(h.epdd_pid, SIGHUP), 0);
        ck_assert(harness_wait_for(reloaded, NULL, 5000));
        t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[1], false, &w), 0);
        ck_assert_uint_ge(now_usec(CLOCK_MONOTONIC) - t0, 1000 * 1000);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 8));
        epd_feature_release(pre, w);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

/* A stored feature's lookup (its file's open, header, key and descriptor) is made off
 * the event loop as its data's read is: on a disk that stalls on every read, calls that
 * came after its Acquire are answered at once, not after the header's reads (1.4 s here
 * when they were made on the loop). A copy gone from the directory behind the store's
 * back, or one holding another key, is a miss to the Acquire that finds it (told to
 * produce in that same call), and is not opened again. */
START_TEST(test_lookup_off_loop) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        const char *keys[] = { "big:0", "big:1" };
        uint64_t bytes = publish_big(enc, keys);
        epd_feature *w;
        char path[400];

        uint64_t loaded = stat_u64(pre, "Loaded");
        Answer acquire, gets[3];
        uint64_t t0;
        sd_bus *bus = acquire_beside_gets(keys[0], &acquire, gets, &t0);
        for (int i = 0; i < 3; i++) {
                ck_assert_str_eq(gets[i].error, "");
                ck_assert_msg(gets[i].at - t0 < 1000 * 1000, "Get %d answered after %" PRIu64 " ms", i,
                              (gets[i].at - t0) / 1000);
                ck_assert_msg(gets[i].order < acquire.order, "Get answered %d, Acquire %d", gets[i].order,
                              acquire.order);
        }
        ck_assert_str_eq(acquire.error, "");
        ck_assert_str_eq(acquire.result, "hit");
        ck_assert_uint_ge(acquire.at - t0, 3 * 700 * 1000); /* header, key and descriptor, data */
        ck_assert_uint_eq(stat_u64(pre, "Loaded"), loaded + 1);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], false, &w), 0);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 7));
        epd_feature_release(pre, w);
        sd_bus_flush_close_unref(bus);
        ck_assert(harness_wait_for(no_handles, NULL, 10000));

        /* big:1, stored since big:0 came back, removed behind the store's back: the
         * Acquire that finds it gone is a miss (told to produce; NotFound without
         * may_produce), as if it had never been stored. */
        ck_assert(harness_wait_for(stored, (void *)keys[1], 10000));
        store_path(keys[1], path, sizeof path);
        ck_assert_int_eq(unlink(path), 0);
        uint64_t misses = stat_u64(pre, "Misses"), failed = stat_u64(pre, "Failed");
        epd_feature_tensor t[2];
        size_t n = bundle(96 * 1024, t, &(uint64_t){ 0 });
        const char *rid = "000000000000000000000000000000f1";
        unsigned ready_signals = 0;
        sd_bus_slot *slot = NULL;
        ck_assert_int_ge(sd_bus_match_signal(pre->bus, &slot, NULL, "/org/epd1/feature", "org.epd1.Feature",
                                             "FeatureReady", count_ready, &ready_signals), 0);
        ck_assert_int_eq(epd_feature_acquire_or_reserve(pre, keys[1], bytes, t, n, rid, &w), 0);
        ck_assert_str_eq(w->result, "produce");
        /* no FeatureReady "failed" for the failed lookup: the caller never learnt the
         * handle its first dispatch made (a round trip: anything sent before is in) */
        sd_bus_error be = SD_BUS_ERROR_NULL;
        uint64_t handles = 0;
        ck_assert_int_ge(sd_bus_get_property_trivial(pre->bus, harness_destination(&h), "/org/epd1/feature",
                                                     "org.epd1.Feature", "Handles", &be, 't', &handles), 0);
        ck_assert_uint_eq(handles, 1);
        while (sd_bus_process(pre->bus, NULL) > 0)
                ;
        ck_assert_uint_eq(ready_signals, 0);
        sd_bus_slot_unref(slot);
        ck_assert_uint_eq(stat_u64(pre, "Misses"), misses + 1);
        ck_assert_uint_eq(stat_u64(pre, "Failed"), failed); /* a miss, not a failure */
        epd_feature_release(pre, w); /* a producer that leaves: that one fails */
        ck_assert_uint_eq(stat_u64(pre, "Failed"), failed + 1);
        /* its request's trace: the miss and the encoder's start, no read-back hit */
        epd_trace_event *ev = NULL;
        size_t n_ev = 0;
        ck_assert_int_eq(epd_trace_get(pre, rid, &ev, &n_ev, NULL), 0);
        ck_assert_uint_ge(n_ev, 2);
        ck_assert_str_eq(ev[0].type, "acquire-miss");
        ck_assert_str_eq(ev[1].type, "encode-start");
        for (size_t k = 0; k < n_ev; k++)
                ck_assert_str_ne(ev[k].type, "acquire-hit");
        free(ev);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[1], false, &w), -ENOENT);
        ck_assert_str_eq(epd_last_error_name(pre), "org.epd1.Error.NotFound");
        /* big:0's file, holding another key now (as after a collision of the 128-bit
         * names, or damage): not read as big:0, left, a miss; not opened again on every
         * Acquire after. big:1 published anew takes big:0's room (big:0 was read back:
         * its file stays, and is not written again). */
        (void)publish_one(enc, keys[1], 8);
        store_path(keys[0], path, sizeof path);
        ck_assert_int_eq(access(path, F_OK), 0);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(pwrite(fd, "big:9", 5, 64), 5); /* the key, after the 64-byte header */
        close(fd);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], true, &w), 0);
        ck_assert_str_eq(w->result, "produce");
        epd_feature_release(pre, w);
        t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_feature_acquire(pre, keys[0], false, &w), -ENOENT);
        ck_assert_msg(now_usec(CLOCK_MONOTONIC) - t0 < 700 * 1000, "the file was read again");
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

START_TEST(test_wanted_permissions_reload) {
        epd_client *sched = worker("scheduler"), *enc = worker("encoder"), *pre = worker("prefill");
        sd_bus *listener;
        sd_bus_slot *slot = NULL;
        const char *keys[] = { "wanted:1" };
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(8192, t, &bytes); /* 1 MiB */
        epd_feature *p, *r;

        /* FeatureWanted goes to registered encoders only (a key is a content hash of
         * someone's input): the listener registers as one; another connection (a
         * client that is not an encoder) must not receive it. */
        sd_bus *bystander;
        sd_bus_slot *bystander_slot = NULL;
        ck_assert_int_ge(harness_raw_bus(&h, &listener), 0);
        ck_assert_int_ge(harness_raw_bus(&h, &bystander), 0);
        ck_assert_int_ge(sd_bus_match_signal(listener, &slot, NULL, "/org/epd1/feature",
                                             "org.epd1.Feature", "FeatureWanted", on_wanted, NULL), 0);
        ck_assert_int_ge(sd_bus_match_signal(bystander, &bystander_slot, NULL, "/org/epd1/feature",
                                             "org.epd1.Feature", "FeatureWanted", on_wanted, NULL), 0);
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reg = NULL;
        ck_assert_int_ge(sd_bus_call_method(listener, harness_destination(&h), "/org/epd1", "org.epd1.Manager",
                                            "RegisterWorker", &e, &reg, "sssa{sv}", "encoder", "m", "cpu", 0),
                         0);
        sd_bus_message_unref(reg);
        /* A round trip first: on the direct socket the daemon must have accepted the
         * bystander's connection before the signal is emitted, or it would not be sent
         * there whatever the rule. */
        ck_assert_int_ge(sd_bus_call_method(bystander, harness_destination(&h), "/org/epd1", "org.freedesktop.DBus.Peer", "Ping",
                                            NULL, NULL, NULL), 0);
        wanted_count = 0;
        ck_assert_int_eq(epd_feature_prefetch(sched, keys, 1), 0);
        for (int i = 0; i < 3000 && wanted_count == 0; i++) { /* up to 30 s on a loaded CI */
                while (sd_bus_process(listener, NULL) > 0)
                        ;
                if (wanted_count == 0)
                        sd_bus_wait(listener, 10000);
        }
        ck_assert_int_eq(wanted_count, 1);
        ck_assert_str_eq(wanted_key, "wanted:1");
        /* The bystander: a round trip after the signal was sent to the encoder, then
         * everything it was sent is in; none of it is FeatureWanted. */
        ck_assert_int_ge(sd_bus_call_method(bystander, harness_destination(&h), "/org/epd1", "org.freedesktop.DBus.Peer", "Ping",
                                            NULL, NULL, NULL), 0);
        while (sd_bus_process(bystander, NULL) > 0)
                ;
        ck_assert_int_eq(wanted_count, 1);
        sd_bus_slot_unref(bystander_slot);
        sd_bus_flush_close_unref(bystander);
        sd_bus_slot_unref(slot);
        sd_bus_flush_close_unref(listener);

        /* the encoder claims the announced key; nobody else may publish or release it */
        ck_assert_int_eq(epd_feature_reserve(enc, "wanted:1", bytes, t, n, NULL, &p), 0);
        epd_feature stolen = *p;
        ck_assert_int_eq(epd_feature_publish(pre, &stolen, 1), -EPERM);
        ck_assert_str_eq(epd_last_error_name(pre), "org.epd1.Error.PermissionDenied");
        ck_assert_int_eq(epd_feature_fail(pre, &stolen, "no"), -EPERM);
        ck_assert_int_eq(epd_feature_publish(enc, p, 1), 0);
        ck_assert_int_eq(epd_feature_publish(enc, p, 1), -ESTALE); /* twice */
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.Stale");
        epd_feature *bogus = calloc(1, sizeof *bogus);
        strcpy(bogus->handle, "0123456789abcdef0123456789abcdef");
        ck_assert_int_eq(epd_feature_refresh(pre, bogus), -ENOENT);
        strcpy(bogus->handle, "not-a-handle");
        ck_assert_int_eq(epd_feature_refresh(pre, bogus), -EINVAL);
        free(bogus);
        epd_feature_release(enc, p);

        /* fill 8 MiB, then reload with a 4 MiB budget */
        for (int i = 0; i < 8; i++) {
                char key[32];
                snprintf(key, sizeof key, "reload:%d", i);
                ck_assert_int_eq(epd_feature_reserve(enc, key, bytes, t, n, NULL, &p), 0);
                ck_assert_int_eq(epd_feature_publish(enc, p, 1), 0);
                epd_feature_release(enc, p);
        }
        ck_assert_int_eq(epd_feature_acquire(pre, "reload:7", false, &r), 0); /* held */
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "CacheSize=4M\n"); /* the last section is [Features] */
        fclose(f);
        ck_assert_int_eq(kill(h.epdd_pid, SIGHUP), 0);
        cache_bytes = 4 << 20;
        ck_assert(harness_wait_for(cache_bytes_is, NULL, 5000));
        ck_assert_uint_le(stat_u64(NULL, "BytesCached"), 4 << 20);
        ck_assert(same(r->data, 0, 0)); /* (still mapped) */
        ck_assert_int_eq(epd_feature_refresh(pre, r), 0);
        ck_assert_str_eq(r->state, "ready"); /* held: never evicted */
        epd_feature_release(pre, r);
        epd_disconnect(sched);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

static long rss_kib(pid_t pid) {
        char p[64], line[256];
        long v = -1;
        snprintf(p, sizeof p, "/proc/%d/status", (int)pid);
        FILE *f = fopen(p, "re");
        if (!f)
                return -1;
        while (fgets(line, sizeof line, f))
                if (sscanf(line, "VmRSS: %ld kB", &v) == 1)
                        break;
        fclose(f);
        return v;
}

/* Many request cycles (produce, wait, hit, fail, die): handles come back to zero and
 * the daemon's memory stays flat. Bounded and short. */
START_TEST(test_soak) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(64, t, &bytes);
        long rss_warm = 0;

        for (int round = 0; round < 1500; round++) {
                char key[32];
                epd_feature *a, *b;
                snprintf(key, sizeof key, "soak:%d", round % 300);
                ck_assert_int_eq(epd_feature_acquire(pre, key, true, &a), 0);
                if (strcmp(a->result, "produce") == 0) {
                        ck_assert_int_eq(epd_feature_acquire(enc, key, false, &b), 0);
                        ck_assert_str_eq(b->result, "wait");
                        ck_assert_int_eq(epd_feature_produce(pre, a, bytes, t, n, NULL), 0);
                        if (round % 10 == 0)
                                ck_assert_int_eq(epd_feature_fail(pre, a, "x"), 0);
                        else
                                ck_assert_int_eq(epd_feature_publish(pre, a, 5), 0);
                        int r = epd_feature_wait(enc, b, 10 * 1000000ULL);
                        ck_assert(r == 0 || r == -EPIPE);
                        epd_feature_release(enc, b);
                }
                epd_feature_release(pre, a);
                if (round == 500)
                        rss_warm = rss_kib(h.epdd_pid);
        }
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        ck_assert_uint_le(stat_u64(pre, "Features"), 300);
        long rss_end = rss_kib(h.epdd_pid);
#if defined(__SANITIZE_ADDRESS__)
        /* ASan's quarantine keeps freed memory on purpose; the counters above and its
         * leak check at exit cover this build. */
        (void)rss_warm;
        (void)rss_end;
#else
        ck_assert_msg(rss_end <= rss_warm + 2048, "RSS grew from %ld to %ld KiB", rss_warm, rss_end);
#endif
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

/* Wait's answer: the state, or the error's name. */
static int on_wait(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        Answer *a = userdata;
        const char *handle = NULL, *state = NULL;
        a->order = ++answered;
        if (sd_bus_message_is_method_error(m, NULL))
                snprintf(a->error, sizeof a->error, "%s", sd_bus_message_get_error(m)->name);
        else if (sd_bus_message_read(m, "ss", &handle, &state) > 0)
                snprintf(a->result, sizeof a->result, "%s", state);
        return 0;
}

static void run_until(sd_bus *bus, int n) {
        while (answered < n) {
                int r = sd_bus_process(bus, NULL);
                ck_assert_int_ge(r, 0);
                if (r == 0)
                        ck_assert_int_ge(sd_bus_wait(bus, 30 * 1000000ULL), 0);
        }
}

typedef struct LatePublish {
        epd_client *c;
        epd_feature *f;
        int r;
} LatePublish;

static void *publish_later(void *userdata) {
        LatePublish *l = userdata;
        usleep(100 * 1000);
        l->r = epd_feature_publish(l->c, l->f, 1);
        return NULL;
}

/* The wait libepd falls back to against a daemon without Wait: FeatureReady, then
 * Describe; a timeout, then a Publish from another thread that wakes it. */
START_TEST(test_wait_by_signal) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        epd_feature *p, *r;
        pthread_t th;

        ck_assert_int_eq(epd_feature_reserve(enc, "wait:signal", bytes, t, n, NULL, &p), 0);
        ck_assert_int_eq(epd_feature_acquire(pre, "wait:signal", false, &r), 0);
        ck_assert_str_eq(r->result, "wait");
        ck_assert_int_eq(epd__feature_wait_signal(pre, r, now_usec(CLOCK_MONOTONIC) + 50000), -ETIMEDOUT);
        LatePublish l = { .c = enc, .f = p };
        ck_assert_int_eq(pthread_create(&th, NULL, publish_later, &l), 0);
        ck_assert_int_eq(epd__feature_wait_signal(pre, r, now_usec(CLOCK_MONOTONIC) + 30 * 1000000ULL), 0);
        ck_assert_str_eq(r->state, "ready");
        ck_assert_int_eq(pthread_join(th, NULL), 0);
        ck_assert_int_eq(l.r, 0);
        ck_assert_int_eq(epd_feature_release(pre, r), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

/* Wait(handle) is answered by the Publish, by the failure, or at once when settled; a
 * later Wait takes an earlier one's place (answered Stale); a handle released while
 * waiting answers NotFound; a producer's handle cannot wait for itself. */
START_TEST(test_wait_call) {
        epd_client *enc = worker("encoder");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        epd_feature *p[3];
        const char *keys[] = { "wait:publish", "wait:fail", "wait:release" };
        const char *handles[3];
        sd_bus_message *replies[3] = {};
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *dest = harness_destination(&h);

        for (int i = 0; i < 3; i++)
                ck_assert_int_eq(epd_feature_reserve(enc, keys[i], bytes, t, n, NULL, &p[i]), 0);
        /* The producer's own handle: refused by name, not a wait that never ends. */
        ck_assert_int_eq(epd_feature_wait(enc, p[0], 1000000), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.InvalidArgument");

        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_call_method(bus, dest, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &e,
                                            &reply, "sssa{sv}", "prefill", "raw", "cpu", 0), 0);
        reply = sd_bus_message_unref(reply);
        for (int i = 0; i < 3; i++) {
                const char *result;
                ck_assert_int_ge(sd_bus_call_method(bus, dest, "/org/epd1/feature", "org.epd1.Feature", "Acquire", &e,
                                                    &replies[i], "sb", keys[i], 0), 0);
                ck_assert_int_ge(sd_bus_message_read(replies[i], "ss", &result, &handles[i]), 0);
                ck_assert_str_eq(result, "wait");
        }
        Answer first = {}, second = {}, failed = {}, released = {}, release = {}, settled = {};
        answered = 0;
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, dest, "/org/epd1/feature", "org.epd1.Feature", "Wait",
                                                  on_wait, &first, "s", handles[0]), 0);
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, dest, "/org/epd1/feature", "org.epd1.Feature", "Wait",
                                                  on_wait, &second, "s", handles[0]), 0);
        run_until(bus, 1); /* the first, superseded */
        ck_assert_str_eq(first.error, "org.epd1.Error.Stale");
        ck_assert_int_eq(second.order, 0); /* still waiting */
        ck_assert_int_eq(epd_feature_publish(enc, p[0], 1), 0);
        run_until(bus, 2);
        ck_assert_str_eq(second.error, "");
        ck_assert_str_eq(second.result, "ready");
        /* Settled already: answered at once. */
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, dest, "/org/epd1/feature", "org.epd1.Feature", "Wait",
                                                  on_wait, &settled, "s", handles[0]), 0);
        run_until(bus, 3);
        ck_assert_str_eq(settled.result, "ready");
        /* A producer that fails: the waiter learns it from the answer. */
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, dest, "/org/epd1/feature", "org.epd1.Feature", "Wait",
                                                  on_wait, &failed, "s", handles[1]), 0);
        ck_assert_int_eq(epd_feature_fail(enc, p[1], "encoder-error"), 0);
        run_until(bus, 4);
        ck_assert_str_eq(failed.result, "failed");
        /* Released while waiting: NotFound, and the Release itself succeeds. */
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, dest, "/org/epd1/feature", "org.epd1.Feature", "Wait",
                                                  on_wait, &released, "s", handles[2]), 0);
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, dest, "/org/epd1/feature", "org.epd1.Feature",
                                                  "Release", on_wait, &release, "s", handles[2]), 0);
        run_until(bus, 6);
        ck_assert_str_eq(released.error, "org.epd1.Error.NotFound");
        ck_assert_str_eq(release.error, "");
        for (int i = 0; i < 3; i++) {
                if (i < 2)
                        ck_assert_int_ge(sd_bus_call_method(bus, dest, "/org/epd1/feature", "org.epd1.Feature",
                                                            "Release", &e, NULL, "s", handles[i]), 0);
                sd_bus_message_unref(replies[i]);
                ck_assert_int_eq(epd_feature_release(enc, p[i]), 0);
        }
        ck_assert_uint_eq(stat_u64(NULL, "Handles"), 0);
        sd_bus_flush_close_unref(bus);
        epd_disconnect(enc);
}
END_TEST

START_TEST(test_introspection) {
        sd_bus *bus;
        char f[512];
        const char *src = getenv("SOURCE_ROOT");
        ck_assert_ptr_nonnull(src);
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Feature.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, harness_destination(&h), "/org/epd1/feature", f), 0);
        sd_bus_flush_close_unref(bus);
}
END_TEST

static int count_ready(sd_bus_message *m, void *userdata, sd_bus_error *e) {
        (*(unsigned *)userdata)++;
        return 0;
}

/* FeatureReady reaches the clients holding the feature (its waiter here), never a
 * connection that holds nothing: a key is a content hash of someone's input. */
START_TEST(test_ready_only_to_holders) {
        const char *key = "sha256:private-ready";
        epd_client *enc = worker("encoder"), *pre = worker("prefill"), *other = worker("decode");
        epd_feature *fe, *fw;
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        unsigned got_waiter = 0, got_other = 0, got_raw = 0;
        sd_bus_slot *s1 = NULL, *s2 = NULL, *s3 = NULL;
        sd_bus *raw;

        ck_assert_int_eq(epd_feature_acquire(enc, key, true, &fe), 0);
        ck_assert_str_eq(fe->result, "produce");
        ck_assert_int_eq(epd_feature_produce(enc, fe, bytes, t, n, NULL), 0);
        fill(fe->data, bytes, 5);
        ck_assert_int_eq(epd_feature_acquire(pre, key, false, &fw), 0);
        ck_assert_str_eq(fw->result, "wait");

        ck_assert_int_ge(sd_bus_match_signal(pre->bus, &s1, NULL, "/org/epd1/feature", "org.epd1.Feature",
                                             "FeatureReady", count_ready, &got_waiter), 0);
        ck_assert_int_ge(sd_bus_match_signal(other->bus, &s2, NULL, "/org/epd1/feature", "org.epd1.Feature",
                                             "FeatureReady", count_ready, &got_other), 0);
        ck_assert_int_ge(harness_raw_bus(&h, &raw), 0);
        ck_assert_int_ge(sd_bus_match_signal(raw, &s3, NULL, "/org/epd1/feature", "org.epd1.Feature",
                                             "FeatureReady", count_ready, &got_raw), 0);
        /* The match rules are in place at the bus before the publish. */
        sd_bus_error e = SD_BUS_ERROR_NULL;
        uint64_t v;
        ck_assert_int_ge(sd_bus_get_property_trivial(raw, harness_destination(&h), "/org/epd1/feature",
                                                     "org.epd1.Feature", "Produced", &e, 't', &v), 0);

        ck_assert_int_eq(epd_feature_publish(enc, fe, 1000), 0);

        /* The waiter gets its signal. */
        for (int i = 0; i < 500 && got_waiter == 0; i++) {
                while (sd_bus_process(pre->bus, NULL) > 0)
                        ;
                if (got_waiter == 0)
                        (void)sd_bus_wait(pre->bus, 10000);
        }
        ck_assert_uint_eq(got_waiter, 1);

        /* A round trip to epdd on each other connection: its reply comes after anything
         * epdd sent that connection before, so a FeatureReady would be queued by now. */
        ck_assert_int_ge(sd_bus_get_property_trivial(raw, harness_destination(&h), "/org/epd1/feature",
                                                     "org.epd1.Feature", "Produced", &e, 't', &v), 0);
        ck_assert_uint_eq(v, 1);
        while (sd_bus_process(raw, NULL) > 0)
                ;
        ck_assert_int_ge(sd_bus_get_property_trivial(other->bus, harness_destination(&h), "/org/epd1/feature",
                                                     "org.epd1.Feature", "Produced", &e, 't', &v), 0);
        while (sd_bus_process(other->bus, NULL) > 0)
                ;
        ck_assert_msg(got_raw == 0, "a connection holding nothing received FeatureReady for %s", key);
        ck_assert_msg(got_other == 0, "a worker holding nothing received FeatureReady for %s", key);

        sd_bus_slot_unref(s1);
        sd_bus_slot_unref(s2);
        sd_bus_slot_unref(s3);
        sd_bus_flush_close_unref(raw);
        epd_feature_release(pre, fw);
        epd_feature_release(enc, fe);
        epd_disconnect(enc);
        epd_disconnect(pre);
        epd_disconnect(other);
}
END_TEST

/* A round trip to epdd on bus, then what came before its answer dispatched: a signal
 * epdd sent this connection before is counted by now. */
static void settle(sd_bus *bus) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        uint64_t v;
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, harness_destination(&h), "/org/epd1/feature",
                                                     "org.epd1.Feature", "Produced", &e, 't', &v), 0);
        while (sd_bus_process(bus, NULL) > 0)
                ;
}

/* A reader whose Wait is in progress holds the feature too, and hears FeatureReady
 * (docs/features.md, "Waiting": every holder but an Acquire still waiting for its read
 * back), once. Before, the pending Wait was taken for such an Acquire: no signal. */
START_TEST(test_ready_reaches_a_pending_wait) {
        const char *key = "sha256:ready-to-wait";
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature *p, *w;
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        unsigned got = 0;
        sd_bus_slot *slot = NULL;
        Answer waited = {};

        ck_assert_int_eq(epd_feature_reserve(enc, key, bytes, t, n, NULL, &p), 0);
        ck_assert_int_eq(epd_feature_acquire(pre, key, false, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        ck_assert_int_ge(sd_bus_match_signal(pre->bus, &slot, NULL, "/org/epd1/feature", "org.epd1.Feature",
                                             "FeatureReady", count_ready, &got), 0);
        answered = 0;
        ck_assert_int_ge(sd_bus_call_method_async(pre->bus, NULL, harness_destination(&h), "/org/epd1/feature",
                                                  "org.epd1.Feature", "Wait", on_wait, &waited, "s", w->handle),
                         0);
        settle(pre->bus); /* epdd has the Wait */
        ck_assert_int_eq(waited.order, 0);
        ck_assert_int_eq(epd_feature_publish(enc, p, 1), 0);
        run_until(pre->bus, 1);
        ck_assert_str_eq(waited.error, "");
        ck_assert_str_eq(waited.result, "ready");
        settle(pre->bus);
        ck_assert_msg(got == 1, "a reader with a Wait in progress received %u FeatureReady signals, not 1", got);

        sd_bus_slot_unref(slot);
        ck_assert_int_eq(epd_feature_release(pre, w), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        ck_assert_uint_eq(stat_u64(NULL, "Handles"), 0);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

/* FeatureReady goes to every client holding the feature, whatever its handle (the
 * producer, readers, a pin), once each however many handles it holds (2, and 20: more
 * than epdd looks back along the feature's handles for), and to nobody else: not a
 * client holding another key, not a connection holding nothing. Published, then
 * failed. */
START_TEST(test_ready_to_every_holder) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill"), *pinner = worker("prefill"),
                   *many = worker("prefill"), *other = worker("encoder");
        epd_client *clients[] = { enc, pre, pinner, many, other };
        unsigned got[5] = {}, got_raw = 0;
        sd_bus_slot *slots[6] = {};
        epd_feature *p1, *p2, *po, *r[2], *pn, *m[20];
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        sd_bus *raw;

        ck_assert_int_eq(epd_feature_reserve(enc, "holders:1", bytes, t, n, NULL, &p1), 0);
        ck_assert_int_eq(epd_feature_reserve(enc, "holders:2", bytes, t, n, NULL, &p2), 0);
        for (int i = 0; i < 2; i++) {
                ck_assert_int_eq(epd_feature_acquire(pre, "holders:1", false, &r[i]), 0);
                ck_assert_str_eq(r[i]->result, "wait");
        }
        ck_assert_int_eq(epd_feature_pin(pinner, "holders:1", &pn), 0);
        for (int i = 0; i < 20; i++)
                ck_assert_int_eq(epd_feature_acquire(many, "holders:2", false, &m[i]), 0);
        ck_assert_int_eq(epd_feature_reserve(other, "holders:other", bytes, t, n, NULL, &po), 0);
        for (int i = 0; i < 5; i++)
                ck_assert_int_ge(sd_bus_match_signal(clients[i]->bus, &slots[i], NULL, "/org/epd1/feature",
                                                     "org.epd1.Feature", "FeatureReady", count_ready, &got[i]),
                                 0);
        ck_assert_int_ge(harness_raw_bus(&h, &raw), 0);
        ck_assert_int_ge(sd_bus_match_signal(raw, &slots[5], NULL, "/org/epd1/feature", "org.epd1.Feature",
                                             "FeatureReady", count_ready, &got_raw), 0);
        settle(raw); /* its match rule is in place at the bus */

        fill(p1->data, bytes, 1);
        ck_assert_int_eq(epd_feature_publish(enc, p1, 1), 0);
        for (int i = 0; i < 5; i++)
                settle(clients[i]->bus);
        settle(raw);
        ck_assert_uint_eq(got[0], 1); /* the producer */
        ck_assert_uint_eq(got[1], 1); /* two readers' handles, one client */
        ck_assert_uint_eq(got[2], 1); /* the pin */
        ck_assert_uint_eq(got[3], 0);
        ck_assert_uint_eq(got[4], 0);
        ck_assert_uint_eq(got_raw, 0);

        ck_assert_int_eq(epd_feature_fail(enc, p2, "encoder-error"), 0);
        for (int i = 0; i < 5; i++)
                settle(clients[i]->bus);
        settle(raw);
        ck_assert_uint_eq(got[0], 2); /* its producer still holds it */
        ck_assert_uint_eq(got[1], 1);
        ck_assert_uint_eq(got[2], 1);
        ck_assert_uint_eq(got[3], 1); /* twenty handles, one client */
        ck_assert_uint_eq(got[4], 0);
        ck_assert_uint_eq(got_raw, 0);

        for (int i = 0; i < 6; i++)
                sd_bus_slot_unref(slots[i]);
        sd_bus_flush_close_unref(raw);
        for (int i = 0; i < 20; i++)
                ck_assert_int_eq(epd_feature_release(many, m[i]), 0);
        for (int i = 0; i < 2; i++)
                ck_assert_int_eq(epd_feature_release(pre, r[i]), 0);
        ck_assert_int_eq(epd_feature_release(pinner, pn), 0);
        ck_assert_int_eq(epd_feature_release(enc, p1), 0);
        ck_assert_int_eq(epd_feature_release(enc, p2), 0);
        ck_assert_int_eq(epd_feature_release(other, po), 0);
        ck_assert_uint_eq(stat_u64(NULL, "Handles"), 0);
        for (int i = 0; i < 5; i++)
                epd_disconnect(clients[i]);
}
END_TEST

/* An encoder at its handle limit that claims an announced key is refused before anything
 * changes: the prefill waiting for the key keeps waiting (it was failed, "producer
 * gone"), and another encoder produces it. Through AcquireOrReserve and Reserve. */
START_TEST(test_claim_at_handle_limit_keeps_waiters) {
        epd_client *sched = worker("scheduler"), *full = worker("encoder"), *pre = worker("prefill");
        const char *keys[] = { "lim:1" };
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(64, t, &bytes);
        epd_feature *w, *held, *p, *refused = NULL;

        ck_assert_int_eq(epd_feature_prefetch(sched, keys, 1), 0); /* announced */
        ck_assert_int_eq(epd_feature_acquire(pre, "lim:1", false, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        ck_assert_int_eq(epd_feature_reserve(full, "lim:other", bytes, t, n, NULL, &held), 0);
        uint64_t reserved = stat_u64(NULL, "BytesReserved");
        ck_assert_int_eq(epd_feature_acquire_or_reserve(full, "lim:1", bytes, t, n, NULL, &refused), -EDQUOT);
        ck_assert_str_eq(epd_last_error_name(full), "org.epd1.Error.LimitExceeded");
        ck_assert_int_eq(epd_feature_reserve(full, "lim:1", bytes, t, n, NULL, &refused), -EDQUOT);
        ck_assert_str_eq(epd_last_error_name(full), "org.epd1.Error.LimitExceeded");
        ck_assert_ptr_null(refused);
        ck_assert_uint_eq(stat_u64(NULL, "BytesReserved"), reserved);
        ck_assert_int_eq(epd_feature_refresh(pre, w), 0);
        ck_assert_msg(strcmp(w->state, "failed") != 0, "the waiter was failed by a refused claim");

        epd_client *enc = worker("encoder");
        ck_assert_int_eq(epd_feature_reserve(enc, "lim:1", bytes, t, n, NULL, &p), 0);
        fill(p->data, bytes, 3);
        ck_assert_int_eq(epd_feature_publish(enc, p, 10), 0);
        ck_assert_int_eq(epd_feature_wait(pre, w, 10 * 1000000ULL), 0);
        ck_assert_str_eq(w->state, "ready");
        ck_assert(same(w->data, bytes, 3));
        ck_assert_int_eq(epd_feature_release(pre, w), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        ck_assert_int_eq(epd_feature_release(full, held), 0);
        epd_disconnect(enc);
        epd_disconnect(pre);
        epd_disconnect(full);
        epd_disconnect(sched);
}
END_TEST

/* An encoder told to produce that never publishes (stuck, not gone): past
 * ProduceTimeout= the feature fails with "timeout", its waiter hears it, the next
 * Acquire produces, and its region stays its own until its handle goes. Before, every
 * later Acquire of the key waited for it for ever. */
START_TEST(test_produce_timeout) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        epd_feature *p, *w, *again;

        ck_assert_int_eq(epd_feature_acquire_or_reserve(enc, "sha256:stuck", bytes, t, n, NULL, &p), 0);
        ck_assert_str_eq(p->result, "produce");
        ck_assert_int_eq(epd_feature_acquire(pre, "sha256:stuck", true, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_feature_wait(pre, w, 10 * 1000000ULL), -EPIPE); /* failed: why in w->error */
        usec_t took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_str_eq(w->state, "failed");
        ck_assert_str_eq(w->error, "timeout");
        ck_assert_msg(took >= 800 * 1000ULL && took < 5 * 1000000ULL, "failed after %" PRIu64 " us", (uint64_t)took);
        ck_assert_uint_eq(stat_u64(pre, "ProduceTimeouts"), 1);
        ck_assert_int_eq(epd_feature_release(pre, w), 0);
        /* Produced anew, elsewhere than the late producer's region. */
        ck_assert_int_eq(epd_feature_acquire_or_reserve(pre, "sha256:stuck", bytes, t, n, NULL, &again), 0);
        ck_assert_str_eq(again->result, "produce");
        ck_assert_uint_ne(again->offset, p->offset);
        fill(again->data, bytes, 9);
        ck_assert_int_eq(epd_feature_publish(pre, again, 1), 0);
        /* The late producer is told it is too late. */
        ck_assert_int_lt(epd_feature_publish(enc, p, 1), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        ck_assert_int_eq(epd_feature_release(pre, again), 0);
        ck_assert_uint_eq(stat_u64(pre, "Handles"), 0);
        ck_assert_uint_eq(stat_u64(pre, "BytesReserved"), 0);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

static bool produce_timed_out(void *userdata) {
        return stat_u64(NULL, "ProduceTimeouts") >= 1;
}

/* An encoder told to produce whose encode outlasts ProduceTimeout= and then reserves
 * (epd_feature_produce()): refused by name, f keeps the handle it was told to produce
 * through, and once released nothing is left. Before, the Reserve made another feature
 * under another handle, which replaced f's: the first stayed the client's until it
 * disconnected. Then a reader's handle (told wait) whose producer failed, produced
 * through by mistake: libepd gives back the handle of the feature the Reserve made
 * instead of taking it for f's. */
START_TEST(test_produce_after_timeout) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10, t, &bytes);
        epd_feature *p, *w, *q;
        char held[sizeof p->handle];

        ck_assert_int_eq(epd_feature_acquire(enc, "sha256:slow-encode", true, &p), 0);
        ck_assert_str_eq(p->result, "produce");
        snprintf(held, sizeof held, "%s", p->handle);
        ck_assert(harness_wait_for(produce_timed_out, NULL, 10000));
        ck_assert_int_eq(epd_feature_produce(enc, p, bytes, t, n, NULL), -ESTALE);
        ck_assert_str_eq(epd_last_error_name(enc), "org.epd1.Error.Stale");
        ck_assert_msg(strstr(epd_last_error_message(enc), "timed out after 1.000 s") &&
                              strstr(epd_last_error_message(enc), "sha256:slow-encode"),
                      "%s", epd_last_error_message(enc));
        ck_assert_str_eq(p->handle, held);
        ck_assert_uint_eq(stat_u64(NULL, "Handles"), 1);
        ck_assert_int_eq(epd_feature_refresh(enc, p), 0);
        ck_assert_str_eq(p->state, "failed");
        ck_assert_str_eq(p->error, "timeout");
        ck_assert_int_eq(epd_feature_release(enc, p), 0);
        ck_assert_uint_eq(stat_u64(NULL, "Handles"), 0);
        ck_assert_uint_eq(stat_u64(NULL, "BytesReserved"), 0);
        /* Released, the key is the encoder's to produce again. */
        ck_assert_int_eq(epd_feature_acquire(enc, "sha256:slow-encode", true, &p), 0);
        ck_assert_str_eq(p->result, "produce");
        ck_assert_int_eq(epd_feature_produce(enc, p, bytes, t, n, NULL), 0);
        fill(p->data, bytes, 4);
        ck_assert_int_eq(epd_feature_publish(enc, p, 1), 0);
        ck_assert_int_eq(epd_feature_release(enc, p), 0);

        /* A waiter's handle, its producer failed: the Reserve makes a feature of its own
         * (a handle the caller did not have), given back. */
        ck_assert_int_eq(epd_feature_reserve(enc, "sha256:misused", bytes, t, n, NULL, &q), 0);
        ck_assert_int_eq(epd_feature_acquire(pre, "sha256:misused", true, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        snprintf(held, sizeof held, "%s", w->handle);
        ck_assert_int_eq(epd_feature_fail(enc, q, "encoder-error"), 0);
        ck_assert_int_eq(epd_feature_release(enc, q), 0);
        ck_assert_int_eq(epd_feature_produce(pre, w, bytes, t, n, NULL), -ESTALE);
        ck_assert_str_eq(epd_last_error_name(pre), "org.epd1.Error.Stale");
        ck_assert_str_eq(w->handle, held);
        ck_assert_uint_eq(stat_u64(NULL, "Handles"), 1);
        ck_assert_int_eq(epd_feature_release(pre, w), 0);
        ck_assert_uint_eq(stat_u64(NULL, "Handles"), 0);
        ck_assert_uint_eq(stat_u64(NULL, "BytesReserved"), 0);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

/* What a reload (SIGHUP) changes of the cache besides its budget: the spill queue's
 * bound, the smaller of 256 MiB and CacheSize= (docs/features.md), follows CacheSize=.
 * Started with a 2 MiB cache and reloaded to 16 MiB, a 4 MiB feature evicted is spilled
 * to the store and read back (the bound stayed at the start's 2 MiB, and every such
 * feature was dropped instead). */
static void setup_small_cache(void) {
        start_with_store("CacheSize=2M\n", NULL);
}

static bool reloaded_to_16m(void *userdata) {
        return harness_log_has(&h, "Configuration reloaded") && stat_u64(NULL, "CacheBytes") == 16 << 20;
}

/* Evictions the spill queue has no room for are dropped, and the counters say so: with
 * a 2 MiB cache (and so a 2 MiB queue) and a store that takes 4 s to write a feature's
 * data, the first eviction of a 1.25 MiB feature is queued and the second, meanwhile,
 * dropped; once written, the first is in the store and the second is a miss. */
static void setup_slow_writes(void) {
        start_with_store_fault("CacheSize=2M\n", "EPD_FAULT_WRITE_SLOW", "4000:1000000:");
}

static bool spill_idle(void *userdata) {
        return stat_u64(NULL, "SpillPendingBytes") == 0 && stat_u64(NULL, "SpillWritten") == 1;
}

START_TEST(test_spill_drops_counted) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(10 * 1024, t, &bytes); /* 1.25 MiB + 24 */
        epd_feature *p, *w;
        char key[32];

        for (int i = 0; i < 3; i++) {
                snprintf(key, sizeof key, "mid:%d", i);
                ck_assert_int_eq(epd_feature_reserve(enc, key, bytes, t, n, NULL, &p), 0);
                fill(p->data, bytes, (uint8_t)(i + 1));
                ck_assert_int_eq(epd_feature_publish(enc, p, 10), 0);
                epd_feature_release(enc, p);
                if (i == 1) /* mid:0 evicted and queued; its data's write takes 4 s */
                        ck_assert_uint_eq(stat_u64(NULL, "SpillPendingBytes"), bytes);
        }
        ck_assert_uint_eq(stat_u64(NULL, "Evictions"), 2);
        ck_assert_uint_eq(stat_u64(NULL, "Spilled"), 1);
        ck_assert_uint_eq(stat_u64(NULL, "SpillDropped"), 1);
        ck_assert(harness_wait_for(spill_idle, NULL, 20000));
        ck_assert_uint_eq(stat_u64(NULL, "SpillFailed"), 0);
        ck_assert(stored((void *)"mid:0"));
        ck_assert(!stored((void *)"mid:1"));
        ck_assert_int_eq(epd_feature_acquire(pre, "mid:1", false, &w), -ENOENT);
        ck_assert_int_eq(epd_feature_acquire(pre, "mid:0", false, &w), 0);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 1));
        epd_feature_release(pre, w);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

START_TEST(test_spill_bound_follows_cache_size) {
        epd_client *enc = worker("encoder"), *pre = worker("prefill");
        epd_feature_tensor t[2];
        uint64_t bytes;
        size_t n = bundle(32 * 1024, t, &bytes); /* 4 MiB + 24 */
        epd_feature *p, *w;
        char key[32];

        ck_assert_uint_eq(stat_u64(NULL, "CacheBytes"), 2 << 20);
        /* 4 MiB does not fit a 2 MiB cache */
        ck_assert_int_lt(epd_feature_reserve(enc, "big:0", bytes, t, n, NULL, &p), 0);
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "CacheSize=16M\n"); /* the last section is [Features] */
        fclose(f);
        ck_assert_int_eq(kill(h.epdd_pid, SIGHUP), 0);
        ck_assert(harness_wait_for(reloaded_to_16m, NULL, 5000));

        /* Four of them (in chunks of 64 KiB, 4 MiB + 64 KiB each) do not fit 16 MiB: the
         * fourth evicts the first, which is spilled, not dropped. */
        for (int i = 0; i < 4; i++) {
                snprintf(key, sizeof key, "big:%d", i);
                ck_assert_int_eq(epd_feature_reserve(enc, key, bytes, t, n, NULL, &p), 0);
                fill(p->data, bytes, (uint8_t)(i + 1));
                ck_assert_int_eq(epd_feature_publish(enc, p, 10), 0);
                epd_feature_release(enc, p);
        }
        ck_assert_uint_eq(stat_u64(NULL, "Evictions"), 1);
        ck_assert_uint_eq(stat_u64(NULL, "Spilled"), 1);
        ck_assert(harness_wait_for(stored, (void *)"big:0", 10000));
        /* and read back, with its bytes */
        uint64_t loaded = stat_u64(NULL, "Loaded");
        ck_assert_int_eq(epd_feature_acquire(pre, "big:0", false, &w), 0);
        ck_assert_str_eq(w->result, "hit");
        ck_assert(same(w->data, bytes, 1));
        ck_assert_uint_eq(stat_u64(NULL, "Loaded"), loaded + 1);
        epd_feature_release(pre, w);
        epd_disconnect(enc);
        epd_disconnect(pre);
}
END_TEST

int main(void) {
        harness_require_bus(OVER_BUS_MODE);
        Suite *s = suite_create("feature");
        TCase *tc = tcase_create("feature");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_publish_then_hit);
        tcase_add_test(tc, test_publish_release_nowait);
        tcase_add_test(tc, test_acquire_or_reserve);
        tcase_add_test(tc, test_acquire_or_reserve_send);
        tcase_add_test(tc, test_bad_descriptor);
        tcase_add_test(tc, test_coalescing);
        tcase_add_test(tc, test_ready_only_to_holders);
        tcase_add_test(tc, test_ready_reaches_a_pending_wait);
        tcase_add_test(tc, test_ready_to_every_holder);
        tcase_add_test(tc, test_producer_killed);
        tcase_add_test(tc, test_prefetch_pin_store);
        tcase_add_test(tc, test_load_off_loop);
        tcase_add_test(tc, test_wanted_permissions_reload);
        tcase_add_test(tc, test_soak);
        tcase_add_test(tc, test_wait_call);
        tcase_add_test(tc, test_wait_by_signal);
        tcase_add_test(tc, test_introspection);
        suite_add_tcase(s, tc);
        TCase *tb = tcase_create("bounded");
        tcase_add_checked_fixture(tb, setup_bounded, teardown);
        tcase_set_timeout(tb, 60);
        tcase_add_test(tb, test_claim_at_handle_limit_keeps_waiters);
        suite_add_tcase(s, tb);
        TCase *tr = tcase_create("slow-store");
        tcase_add_checked_fixture(tr, setup_slow_store, teardown);
        tcase_set_timeout(tr, 60);
        tcase_add_test(tr, test_read_back_timeout);
        suite_add_tcase(s, tr);
        TCase *tp = tcase_create("produce-timeout");
        tcase_add_checked_fixture(tp, setup_produce_timeout, teardown);
        tcase_set_timeout(tp, 60);
        tcase_add_test(tp, test_produce_timeout);
        tcase_add_test(tp, test_produce_after_timeout);
        suite_add_tcase(s, tp);
        TCase *td = tcase_create("slow-disk");
        tcase_add_checked_fixture(td, setup_slow_disk, teardown);
        tcase_set_timeout(td, 60);
        tcase_add_test(td, test_lookup_off_loop);
        suite_add_tcase(s, td);
        TCase *tg = tcase_create("reload-grow");
        tcase_add_checked_fixture(tg, setup_small_cache, teardown);
        tcase_set_timeout(tg, 60);
        tcase_add_test(tg, test_spill_bound_follows_cache_size);
        suite_add_tcase(s, tg);
        TCase *tw = tcase_create("slow-writes");
        tcase_add_checked_fixture(tw, setup_slow_writes, teardown);
        tcase_set_timeout(tw, 60);
        tcase_add_test(tw, test_spill_drops_counted);
        suite_add_tcase(s, tw);
        return check_run(s, CK_FORK_GETENV);
}
