/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Handoffs and copy-on-write on GPU arenas through epdd, on its direct socket:
 *  - GPU → GPU, GPU → host and host → GPU handoffs within one daemon (the CUDA
 *    transport): layer groups land in order with exact bytes, the trace says "cuda",
 *    and afterwards no page stays allocated;
 *  - rollback: the decode worker dies mid-handoff, and (fake driver only) every copy
 *    fails: the handoff rolls back and nothing is retained;
 *  - copy-on-write: a clone of a sequence in a GPU arena shares its pages; writing one
 *    page copies exactly that page (CowCopies 1), the original keeps its bytes;
 *  - to another host (a second epdd, "bravo", peered over loopback TCP): GPU pages are
 *    staged through pinned host memory and land exactly in bravo's host arena, twice
 *    (the staging buffer is reused), and a failing staging copy rolls back both sides.
 *
 * With a GPU (the device machine) it runs on the real driver. Without one it runs on
 * the fake driver's gpu mode (tests/unit/fake-libcuda.c: device memory is memfd-backed
 * host memory, copies are memcpy), given by meson as FAKE_LIBCUDA, in epdd's
 * environment and this process's (EPD_LIBCUDA, FAKE_CUDA_MODE=gpu). */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda-loader.h"
#include "epd-internal.h"
#include "epd/epd-feature.h"
#include "epd/epd-gpu.h"
#include "epd/epd-telemetry.h"
#include "epd/handoff.h"
#include "handoff/handoff-manager.h" /* HANDOFF_STAGING_MAX */
#include "harness.h"
#include "test-sequence-util.h"
#include "../check-main.h"
#include "system.h"
#include "vmm.h"

#define LAYERS 8
#define TOKENS 16
#define KV_BYTES 256
#define LAYER_BYTES (TOKENS * 2 * KV_BYTES) /* 8 KiB: K and V of one layer */
#define PAGE_SIZE (LAYERS * LAYER_BYTES)    /* 64 KiB */
#define N_PAGES 24
#define BIG_PAGES 400 /* a handoff whose batches go in slices (of the 512 pages an arena has) */

#define CONFIG                                                                           \
        "[Daemon]\nHostId=alpha\n"                                                       \
        "[Arena:host0]\nSize=16M\n"                                                      \
        "[Arena:gpu0]\nDomain=gpu\nGpu=0\nSize=32M\n"                                    \
        "[Arena:gpu1]\nDomain=gpu\nGpu=0\nSize=32M\n"

static Harness h;
static char address[512];
static bool fake;
static GpuSystem *sys;
static const epd_kv_layout kv = { .layers = LAYERS, .tokens_per_block = TOKENS, .k_bytes_per_token = KV_BYTES,
                                  .v_bytes_per_token = KV_BYTES, .dtype = "bfloat16" };
static const uint32_t groups4[4] = { 2, 2, 2, 2 };

/* Whether this machine has a usable GPU, asked in a child so that this process's
 * CUDA state starts only once the choice is made. */
static bool have_gpu(void) {
        pid_t pid = fork();
        if (pid == 0) {
                GpuSystem *s = NULL;
                _exit(gpu_system_open(NULL, &s) == 0 ? 0 : 1);
        }
        int st;
        return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

/* Real driver or the fake one; exits 77 when neither. Called once, before anything. */
static void choose_driver(void) {
        static bool done;
        if (done)
                return;
        done = true;
        if (!have_gpu()) {
                const char *f = getenv("FAKE_LIBCUDA");
                if (!f || access(f, R_OK) < 0) {
                        printf("SKIP: no GPU and no fake libcuda (FAKE_LIBCUDA)\n");
                        exit(77);
                }
                fake = true;
                if (setenv("EPD_LIBCUDA", f, 1) < 0 || setenv("FAKE_CUDA_MODE", "gpu", 1) < 0)
                        exit(EXIT_FAILURE);
        }
        printf("driver: %s\n", fake ? "fake (FAKE_CUDA_MODE=gpu)" : "the real one");
}

static const char *copy_delay_ms = "0"; /* epdd's FAKE_CUDA_COPY_DELAY_MS */
static const char *submit_delay_ms = "0"; /* and FAKE_CUDA_SUBMIT_DELAY_MS (batch submissions) */

static void start(const char *fail_copies) {
        choose_driver();
        if (fake) {
                ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", fail_copies, 1), 0);
                ck_assert_int_eq(setenv("FAKE_CUDA_COPY_DELAY_MS", copy_delay_ms, 1), 0);
                ck_assert_int_eq(setenv("FAKE_CUDA_IMPORT_DELAY_MS", copy_delay_ms, 1), 0);
                ck_assert_int_eq(setenv("FAKE_CUDA_SUBMIT_DELAY_MS", submit_delay_ms, 1), 0);
        }
        ck_assert_int_eq(harness_init(&h, CONFIG), 0);
        harness_direct_address(&h, address, sizeof address);
        char no_room[300];
        snprintf(no_room, sizeof no_room, "%s/no-room", h.dir);
        if (fake)
                ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_RESERVE_FILE", no_room, 1), 0);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
        /* Only epdd fails (or waits for) its copies; this process's own (filling,
         * checking) work at once. */
        if (fake) {
                ck_assert_int_eq(unsetenv("FAKE_CUDA_FAIL_RESERVE_FILE"), 0);
                ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", "0", 1), 0);
                ck_assert_int_eq(setenv("FAKE_CUDA_COPY_DELAY_MS", "0", 1), 0);
                ck_assert_int_eq(setenv("FAKE_CUDA_IMPORT_DELAY_MS", "0", 1), 0);
        }
        if (!sys) {
                ck_assert_int_eq(gpu_system_open(getenv("EPD_LIBCUDA"), &sys), 0);
                ck_assert_int_eq(gpu_device_make_current(sys, &sys->devices[0]), 0);
        }
}

static void setup(void) {
        start("0");
}

static void teardown(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}

static epd_client *worker(const char *role) {
        epd_client *c = NULL;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, role, "model", "cuda:0", &kv, NULL), 0);
        return c;
}

/* ---- memory of either domain, seen from this process ---- */

typedef struct Mem {
        bool gpu;
        uint8_t *host;       /* host arena mapping */
        uint64_t dev;        /* GPU arena device pointer */
        EpdGpu *g;
        EpdGpuMapping *m;
} Mem;

static Mem map_arena(epd_client *c, const char *name) {
        Mem x = {};
        int i = epd_arena_find(c, name);
        ck_assert_int_ge(i, 0);
        x.gpu = strncmp(name, "gpu", 3) == 0;
        if (x.gpu) {
                ck_assert_int_eq(epd_gpu_open(&x.g), 0);
                ck_assert_int_eq(epd_gpu_arena_map(c, x.g, (size_t)i, &x.m), 0);
                x.dev = epd_gpu_mapping_device_pointer(x.m);
        } else {
                void *base;
                ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
                x.host = base;
        }
        return x;
}

static void unmap_arena(Mem *x) {
        if (x->gpu) {
                epd_gpu_unmap(x->m);
                epd_gpu_close(x->g);
        }
}

static void mem_write(Mem *x, uint64_t off, const void *buf, size_t n) {
        if (!x->gpu) {
                memcpy(x->host + off, buf, n);
                return;
        }
        ck_assert_int_eq(CU(sys->driver, cuMemcpyHtoD, x->dev + off, buf, n), 0);
}

static void mem_read(Mem *x, uint64_t off, void *buf, size_t n) {
        if (!x->gpu) {
                memcpy(buf, x->host + off, n);
                return;
        }
        ck_assert_int_eq(CU(sys->driver, cuMemcpyDtoH, buf, x->dev + off, n), 0);
}

static uint8_t pattern(uint32_t seed, uint32_t page, uint32_t layer, uint32_t k) {
        return (uint8_t)(seed * 101 + page * 31 + (page >> 8) * 17 + layer * 7 + k * 13 + 1);
}

static void fill_pages(Mem *x, const uint64_t *offs, uint32_t n, uint32_t seed) {
        static uint8_t page[PAGE_SIZE];
        for (uint32_t p = 0; p < n; p++) {
                for (uint32_t l = 0; l < LAYERS; l++)
                        for (uint32_t k = 0; k < LAYER_BYTES; k++)
                                page[(size_t)l * LAYER_BYTES + k] = pattern(seed, p, l, k);
                mem_write(x, offs[p], page, PAGE_SIZE);
        }
}

/* Whether layers [first, first+count) of every page hold the pattern. */
static bool layers_equal(Mem *x, const uint64_t *offs, uint32_t n, uint32_t first, uint32_t count, uint32_t seed) {
        static uint8_t page[PAGE_SIZE];
        for (uint32_t p = 0; p < n; p++) {
                mem_read(x, offs[p], page, PAGE_SIZE);
                for (uint32_t l = first; l < first + count; l++)
                        for (uint32_t k = 0; k < LAYER_BYTES; k++)
                                if (page[(size_t)l * LAYER_BYTES + k] != pattern(seed, p, l, k))
                                        return false;
        }
        return true;
}

/* ---- bus helpers ---- */

static char *make_sequence(epd_client *c, const char *arena, uint32_t n, uint64_t *offs) {
        sd_bus_message *reply = NULL;
        const char *path;
        const void *pages;
        size_t sz;
        int r = epd__call(c, "/org/epd1/pages", "org.epd1.Pages", "CreateSequence", &reply, "su", arena, n);
        ck_assert_msg(r == 0, "CreateSequence: %s", epd_last_error_message(c));
        ck_assert_int_ge(sd_bus_message_read(reply, "o", &path), 0);
        ck_assert_int_ge(sd_bus_message_read_array(reply, 'u', &pages, &sz), 0);
        char *p = strdup(path);
        sd_bus_message_unref(reply);
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, p, "org.epd1.Sequence", "Offsets", &e, &reply, "at"), 0);
        const void *o;
        ck_assert_int_ge(sd_bus_message_read_array(reply, 't', &o, &sz), 0);
        ck_assert_uint_eq(sz / 8, n);
        memcpy(offs, o, sz);
        sd_bus_message_unref(reply);
        return p;
}

/* A clone of the sequence at path, owned by c: its path (free it). */
static char *clone_sequence(epd_client *c, const char *path) {
        sd_bus_message *reply = NULL;
        const char *cp;
        ck_assert_int_eq(epd__call(c, path, "org.epd1.Sequence", "Clone", &reply, NULL), 0);
        ck_assert_int_ge(sd_bus_message_read(reply, "o", &cp), 0);
        char *clone = strdup(cp);
        sd_bus_message_unref(reply);
        return clone;
}

static void release_sequence(epd_client *c, const char *path) {
        ck_assert_int_eq(epd__call(c, path, "org.epd1.Sequence", "Release", NULL, NULL), 0);
}

/* Pages of an arena that are not free, from Pages.Pools. */
static uint64_t arena_live(epd_client *c, const char *arena) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        uint64_t live = UINT64_MAX;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, "/org/epd1/pages", "org.epd1.Pages", "Pools", &e, &reply,
                                             "a(sttttttttttt)"), 0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(sttttttttttt)"), 0);
        const char *name;
        uint64_t v[11];
        while (sd_bus_message_read(reply, "(sttttttttttt)", &name, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                                   &v[7], &v[8], &v[9], &v[10]) > 0)
                if (strcmp(name, arena) == 0)
                        live = v[1] - v[2]; /* total - free */
        sd_bus_message_unref(reply);
        return live == UINT64_MAX ? 0 : live;
}

static uint64_t counter_of(epd_client *c, const char *path, const char *interface, const char *property,
                           const char *name) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        uint64_t found = UINT64_MAX;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, path, interface, property, &e, &reply, "a{st}"), 0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "{st}"), 0);
        const char *k;
        uint64_t v;
        while (sd_bus_message_read(reply, "{st}", &k, &v) > 0)
                if (strcmp(k, name) == 0)
                        found = v;
        sd_bus_message_unref(reply);
        ck_assert_msg(found != UINT64_MAX, "no counter %s", name);
        return found;
}

static uint64_t counter(epd_client *c, const char *name) {
        return counter_of(c, "/org/epd1/handoffs", "org.epd1.Handoffs", "Counters", name);
}

/* org.epd1.Gpu.CopyCounters: the handoffs' copy engine ("cow-" prefixed: copy-on-write). */
static uint64_t copy_counter(epd_client *c, const char *name) {
        return counter_of(c, "/org/epd1", "org.epd1.Gpu", "CopyCounters", name);
}

typedef struct WaitState {
        epd_client *c;
        const char *path;
        const char *state;
} WaitState;

static bool state_is(void *userdata) {
        WaitState *w = userdata;
        epd_handoff_status s;
        if (epd_handoff_get(w->c, w->path, &s) < 0)
                return false;
        return strcmp(s.state, w->state) == 0;
}

static void wait_state(epd_client *c, const char *path, const char *state) {
        WaitState w = { c, path, state };
        ck_assert_msg(harness_wait_for(state_is, &w, 10000), "%s never became %s", path, state);
}

static const char *rid(unsigned n) {
        static char buf[8][33];
        static unsigned i;
        char *b = buf[i++ % 8];
        snprintf(b, 33, "%032x", n + 0x100);
        return b;
}

/* ---- handoffs ---- */

static void handoff_between(const char *from, const char *to, unsigned id) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, from, N_PAGES, src);
        Mem ms = map_arena(p, from), md = map_arena(d, to);
        fill_pages(&ms, src, N_PAGES, id);
        uint64_t live_to = arena_live(p, to), bytes0 = counter(p, "bytes");

        char *path = NULL;
        uint64_t token = 0;
        epd_handoff_options o = { .arena = to };
        int r = epd_handoff_prepare(p, rid(id), NULL, seq, groups4, 4, &o, &path, &token);
        ck_assert_msg(r == 0, "Prepare %s → %s: %s", from, to, epd_last_error_message(p));
        ck_assert_uint_eq(arena_live(p, to), live_to + N_PAGES);

        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(id), &acc), 0);
        ck_assert_str_eq(acc.arena, to);
        ck_assert_uint_eq(acc.n_pages, N_PAGES);
        for (uint32_t g = 0; g < 4; g++) {
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
                epd_handoff_status s;
                for (int i = 0; i < 1000; i++) {
                        ck_assert_int_eq(epd_handoff_get(d, acc.path, &s), 0);
                        ck_assert_uint_le(s.groups_done, g + 1);
                        if (s.groups_done == g + 1)
                                break;
                        usleep(5000);
                }
                ck_assert_uint_eq(s.groups_done, g + 1);
                /* Exactly the layers of groups 0..g have landed, bytes exact. */
                ck_assert(layers_equal(&md, acc.offsets, N_PAGES, 0, 2 * (g + 1), id));
                if (g < 3)
                        ck_assert(!layers_equal(&md, acc.offsets, N_PAGES, 2 * (g + 1), 2, id));
        }
        char *dseq = NULL;
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        wait_state(p, path, "committed");
        epd_handoff_status s;
        ck_assert_int_eq(epd_handoff_get(d, acc.path, &s), 0);
        ck_assert_uint_eq(s.bytes, (uint64_t)N_PAGES * PAGE_SIZE);
        ck_assert_uint_eq(counter(p, "bytes") - bytes0, (uint64_t)N_PAGES * PAGE_SIZE);

        /* The request's trace names the CUDA transport. */
        epd_trace_event *ev = NULL;
        size_t n_ev = 0;
        unsigned n_sent = 0;
        ck_assert_int_eq(epd_trace_get(p, rid(id), &ev, &n_ev, NULL), 0);
        for (size_t i = 0; i < n_ev; i++)
                if (strcmp(ev[i].type, "group-sent") == 0) {
                        ck_assert_str_eq(ev[i].transport, "cuda");
                        n_sent++;
                }
        ck_assert_uint_eq(n_sent, 4);
        free(ev);

        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        /* The decode sequence holds the pages; releasing it frees them. */
        ck_assert_uint_eq(arena_live(p, to), live_to + N_PAGES);
        release_sequence(d, dseq);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, to), 0);
        ck_assert_uint_eq(arena_live(p, from), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        ck_assert_uint_eq(counter(p, "writes-in-flight"), 0);
        printf("handoff %s -> %s: %u pages, 4 layer groups, exact bytes, nothing retained\n", from, to, N_PAGES);
        free(dseq);
        free(path);
        free(seq);
        epd_handoff_accepted_done(&acc);
        unmap_arena(&ms);
        unmap_arena(&md);
        epd_disconnect(p);
        epd_disconnect(d);
}

START_TEST(test_gpu_to_gpu) {
        handoff_between("gpu0", "gpu1", 1);
}
END_TEST

START_TEST(test_gpu_to_host) {
        handoff_between("gpu0", "host0", 2);
}
END_TEST

START_TEST(test_host_to_gpu) {
        handoff_between("host0", "gpu1", 3);
}
END_TEST

/* The decode side of a 4-group handoff whose groups were reported ready: waits until
 * they have landed, checks the bytes (fill_pages' seed), commits and releases both sides. */
static void landed_commit_release_n(epd_client *p, epd_client *d, Mem *md, epd_handoff_accepted *acc, char *path,
                                    uint32_t seed, uint32_t n_pages) {
        epd_handoff_status s = {};
        for (int i = 0; i < 2000 && s.groups_done < 4; i++) {
                ck_assert_int_eq(epd_handoff_get(d, acc->path, &s), 0);
                if (s.groups_done < 4)
                        usleep(5000);
        }
        ck_assert_uint_eq(s.groups_done, 4);
        ck_assert_uint_eq(acc->n_pages, n_pages);
        ck_assert(layers_equal(md, acc->offsets, n_pages, 0, LAYERS, seed));
        char *dseq = NULL;
        ck_assert_int_eq(epd_handoff_commit(d, acc->path, &dseq), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc->path), 0);
        release_sequence(d, dseq);
        free(dseq);
        free(path);
        epd_handoff_accepted_done(acc);
}

static void landed_commit_release(epd_client *p, epd_client *d, Mem *md, epd_handoff_accepted *acc, char *path,
                                  uint32_t seed) {
        landed_commit_release_n(p, d, md, acc, path, seed, N_PAGES);
}

/* Layer groups reported ready from the GPU: the notifier records an event per group on
 * the stream and its thread submits LayerGroupReady on the ring once the event is done;
 * the caller never waits. Then (fake driver only) an event that fails: that group is
 * never reported, the flush says why, and the handoff is rolled back. */
START_TEST(test_notifier) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "gpu0", N_PAGES, src);
        Mem ms = map_arena(p, "gpu0"), md = map_arena(d, "gpu1");
        fill_pages(&ms, src, N_PAGES, 9);
        char *path = NULL;
        uint64_t token = 0;
        epd_handoff_options o = { .arena = "gpu1" };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(9), NULL, seq, groups4, 4, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(9), &acc), 0);

        epd_ring_client *ring = NULL;
        EpdGpuNotifier *n = NULL;
        ck_assert_int_eq(epd_ring_open(p, 64, 64, &ring), 0);
        ck_assert_int_eq(epd_gpu_notifier_new(ms.g, 0, ring, &n), 0);
        ck_assert_int_eq(epd_gpu_notifier_ready_after(n, 0, "not an id", token, 0), -EINVAL);
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_gpu_notifier_ready_after(n, 0, rid(9), token, g), 0);
        ck_assert_int_eq(epd_gpu_notifier_flush(n, 10 * 1000000ULL), 0);
        ck_assert_uint_eq(epd_gpu_notifier_pending(n), 0);
        ck_assert_uint_eq(epd_gpu_notifier_submitted(n), 4);
        landed_commit_release(p, d, &md, &acc, path, 9);

        /* Every group after one event (a save that wrote every layer in one launch). */
        fill_pages(&ms, src, N_PAGES, 11);
        ck_assert_int_eq(epd_handoff_prepare(p, rid(11), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_accept(d, rid(11), &acc), 0);
        ck_assert_int_eq(epd_gpu_notifier_ready_after_range(n, 0, rid(11), token, 0, 0), -EINVAL);
        ck_assert_int_eq(epd_gpu_notifier_ready_after_range(n, 0, rid(11), token, UINT32_MAX, 2), -EINVAL);
        ck_assert_int_eq(epd_gpu_notifier_ready_after_range(n, 0, rid(11), token, 0, 4), 0);
        ck_assert_int_eq(epd_gpu_notifier_flush(n, 10 * 1000000ULL), 0);
        ck_assert_uint_eq(epd_gpu_notifier_submitted(n), 8);
        landed_commit_release(p, d, &md, &acc, path, 11);

        if (fake) {
                ck_assert_int_eq(epd_handoff_prepare(p, rid(10), NULL, seq, groups4, 4, &o, &path, &token), 0);
                ck_assert_int_eq(epd_handoff_accept(d, rid(10), &acc), 0);
                ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_EVENTS", "1", 1), 0);
                ck_assert_int_eq(epd_gpu_notifier_ready_after(n, 0, rid(10), token, 0), 0);
                int e = epd_gpu_notifier_flush(n, 10 * 1000000ULL);
                ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_EVENTS", "0", 1), 0);
                ck_assert_msg(e < 0 && e != -ETIMEDOUT, "flush after a failed event: %d", e);
                ck_assert_int_eq(epd_gpu_notifier_flush(n, 0), 0); /* the error was said once */
                ck_assert_uint_eq(epd_gpu_notifier_submitted(n), 8);
                epd_handoff_status s;
                ck_assert_int_eq(epd_handoff_get(d, acc.path, &s), 0);
                ck_assert_uint_eq(s.groups_done, 0);
                ck_assert_int_eq(epd_handoff_rollback(p, path), 0);
                wait_state(d, acc.path, "rolled-back");
                ck_assert_int_eq(epd_handoff_release(p, path), 0);
                ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
                free(path);
                epd_handoff_accepted_done(&acc);
        }
        n = epd_gpu_notifier_free(n);
        ring = epd_ring_close(ring);
        release_sequence(p, seq);
        free(seq);
        unmap_arena(&ms);
        unmap_arena(&md);
        ck_assert_uint_eq(counter(p, "live"), 0);
        printf("notifier: 4 groups reported ready from events, 4 more from one event, exact bytes%s\n",
               fake ? "; a failed event reported by the flush, its group never shipped" : "");
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* The decode worker accepts and dies mid-handoff: rolled back, nothing retained. */
START_TEST(test_decode_dies) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "gpu0", N_PAGES, src);
        char *path = NULL;
        uint64_t token;
        epd_handoff_options o = { .arena = "gpu1" };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(4), NULL, seq, groups4, 4, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(4), &acc), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 0), 0);
        epd_disconnect(d);
        wait_state(p, path, "rolled-back");
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 1), -ESTALE);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_uint_eq(arena_live(p, "gpu1"), 0);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "gpu0"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        ck_assert_uint_eq(counter(p, "failures.worker-gone"), 1);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(seq);
        epd_disconnect(p);
}
END_TEST

/* Every copy of epdd's fails (fake driver): the handoff rolls back with
 * transfer-failed; no page stays allocated or leased. */
START_TEST(test_copy_fails) {
        if (!fake) {
                printf("copy failure injection needs the fake driver: skipped on a real GPU\n");
                return;
        }
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "gpu0", N_PAGES, src);
        char *path = NULL;
        uint64_t token;
        epd_handoff_options o = { .arena = "gpu1" };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(5), NULL, seq, groups4, 4, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(5), &acc), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 0), 0);
        wait_state(p, path, "rolled-back");
        wait_state(d, acc.path, "rolled-back");
        epd_handoff_status s;
        ck_assert_int_eq(epd_handoff_get(p, path, &s), 0);
        ck_assert_str_eq(s.cause, "transfer-failed");
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, NULL), -ESTALE);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_uint_eq(arena_live(p, "gpu1"), 0);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "gpu0"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        ck_assert_uint_eq(counter(p, "writes-in-flight"), 0);
        ck_assert_uint_eq(counter(p, "failures.transfer-failed"), 1);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* The same before any decode worker accepted it, every group ready at Prepare: both
 * sides roll back in one batch of completions (neither told by the other), and the
 * destination, owned by nobody, goes while its source's word is on its way to it (a use
 * after free and a double free in epdd before, under ASan). */
START_TEST(test_copy_fails_unaccepted) {
        if (!fake) {
                printf("copy failure injection needs the fake driver: skipped on a real GPU\n");
                return;
        }
        epd_client *p = worker("prefill");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "gpu0", N_PAGES, src);
        char *path = NULL;
        uint64_t token;
        epd_handoff_options o = { .arena = "gpu1", .ready = 4 };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(6), NULL, seq, groups4, 4, &o, &path, &token), 0);
        wait_state(p, path, "rolled-back");
        epd_handoff_status s;
        ck_assert_int_eq(epd_handoff_get(p, path, &s), 0);
        ck_assert_str_eq(s.cause, "transfer-failed");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_uint_eq(arena_live(p, "gpu1"), 0);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "gpu0"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        ck_assert_uint_eq(counter(p, "writes-in-flight"), 0);
        free(path);
        free(seq);
        epd_disconnect(p);
}
END_TEST

static void setup_failing(void) {
        start("1");
}

/* ---- copy-on-write ---- */

static uint64_t cow_copies(epd_client *c, const char *path) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        uint64_t v = UINT64_MAX;
        ck_assert_int_ge(sd_bus_get_property_trivial(c->bus, NULL, path, "org.epd1.Sequence", "CowCopies", &e, 't', &v), 0);
        return v;
}

START_TEST(test_cow) {
        epd_client *c = worker("prefill");
        uint64_t offs[N_PAGES], clone_offs[N_PAGES], after[N_PAGES];
        char *seq = make_sequence(c, "gpu0", N_PAGES, offs);
        Mem m = map_arena(c, "gpu0");
        fill_pages(&m, offs, N_PAGES, 7);

        sd_bus_message *reply = NULL;
        char *clone = clone_sequence(c, seq);
        sequence_offsets(c, clone, clone_offs, N_PAGES);
        ck_assert(memcmp(offs, clone_offs, sizeof offs) == 0); /* shares every page */
        ck_assert_uint_eq(arena_live(c, "gpu0"), N_PAGES);

        /* Write page 5 of the clone: the daemon copies exactly that page. */
        const void *pages;
        size_t sz;
        uint32_t copied = 0;
        int r = epd__call(c, clone, "org.epd1.Sequence", "PrepareWrite", &reply, "uu", 5, 1);
        ck_assert_msg(r == 0, "PrepareWrite: %s", epd_last_error_message(c));
        ck_assert_int_ge(sd_bus_message_read_array(reply, 'u', &pages, &sz), 0);
        ck_assert_int_ge(sd_bus_message_read(reply, "u", &copied), 0);
        sd_bus_message_unref(reply);
        ck_assert_uint_eq(copied, 1);
        ck_assert_uint_eq(cow_copies(c, clone), 1);
        ck_assert_uint_eq(arena_live(c, "gpu0"), N_PAGES + 1);
        sequence_offsets(c, clone, after, N_PAGES);
        for (uint32_t i = 0; i < N_PAGES; i++)
                if (i == 5)
                        ck_assert_uint_ne(after[i], offs[i]);
                else
                        ck_assert_uint_eq(after[i], offs[i]);
        /* The copy holds the page's bytes (the copy engine's work). */
        static uint8_t a[PAGE_SIZE], b[PAGE_SIZE];
        mem_read(&m, offs[5], a, PAGE_SIZE);
        mem_read(&m, after[5], b, PAGE_SIZE);
        ck_assert(memcmp(a, b, PAGE_SIZE) == 0);
        /* Writing the private page leaves the original alone. */
        memset(b, 0xee, PAGE_SIZE);
        mem_write(&m, after[5], b, PAGE_SIZE);
        mem_read(&m, offs[5], a, PAGE_SIZE);
        ck_assert_uint_ne(a[0], 0xee);
        /* Writing it again copies nothing more. */
        ck_assert_int_eq(epd__call(c, clone, "org.epd1.Sequence", "PrepareWrite", &reply, "uu", 5, 1), 0);
        ck_assert_int_ge(sd_bus_message_read_array(reply, 'u', &pages, &sz), 0);
        ck_assert_int_ge(sd_bus_message_read(reply, "u", &copied), 0);
        sd_bus_message_unref(reply);
        ck_assert_uint_eq(copied, 0);
        ck_assert_uint_eq(cow_copies(c, clone), 1);

        release_sequence(c, clone);
        ck_assert_uint_eq(arena_live(c, "gpu0"), N_PAGES);
        release_sequence(c, seq);
        ck_assert_uint_eq(arena_live(c, "gpu0"), 0);
        printf("CoW on a GPU arena: 1 of %u shared pages written, exactly 1 copied\n", N_PAGES);
        free(clone);
        free(seq);
        unmap_arena(&m);
        epd_disconnect(c);
}
END_TEST

static void setup_slow_copies(void) {
        copy_delay_ms = "400";
        start("0");
        copy_delay_ms = "0";
}

/* Copies that take 1000 ms and submissions that hold the host 300 ms (a merged batch of
 * tens of thousands of writes takes milliseconds to plan). */
static void setup_slow_submissions(void) {
        copy_delay_ms = "1000";
        submit_delay_ms = "300";
        start("0");
        copy_delay_ms = submit_delay_ms = "0";
}

/* Layer groups of uneven sizes (2, 2, 1 and 3 of the 8 layers). */
static const uint32_t groups_uneven[4] = { 2, 2, 1, 3 };

static bool log_has(void *userdata) {
        return harness_log_has(&h, userdata);
}

/* Appends `lines` to epdd's configuration and reloads it (SIGHUP), waiting for `said` in
 * its log (the GPU handoff settings line) and for the reload's end. */
static void reload_with(const char *lines, const char *said) {
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fputs(lines, f);
        fclose(f);
        ck_assert_int_eq(kill(h.epdd_pid, SIGHUP), 0);
        ck_assert(harness_wait_for(log_has, (void *)said, 5000));
        ck_assert(harness_wait_for(log_has, (void *)"Configuration reloaded", 5000));
}

/* One handoff gpu0 -> gpu1 of the uneven groups: Prepare with `ready` groups computed,
 * the rest reported ready at once; checks every layer's bytes at the end; returns the
 * batches and merged groups it took. queue > 0 (slow fake copies): that many batches
 * are on the GPU right after the calls, none landed yet. ring (the decode's, or NULL):
 * *ret_first_usec is when group 0 reached it, after the first LayerGroupReady. */
static void queued_handoff_n(epd_client *p, epd_client *d, uint32_t id, uint32_t ready, unsigned queue,
                             epd_ring_client *ring, uint64_t *ret_first_usec, uint64_t *ret_batches,
                             uint64_t *ret_merged, uint32_t n_pages) {
        uint64_t *src = calloc(n_pages, sizeof *src);
        ck_assert_ptr_nonnull(src);
        char *seq = make_sequence(p, "gpu0", n_pages, src);
        Mem ms = map_arena(p, "gpu0"), md = map_arena(d, "gpu1");
        fill_pages(&ms, src, n_pages, id);
        uint64_t batches0 = counter(p, "batches"), merged0 = counter(p, "merged-groups");
        uint64_t copied0 = copy_counter(p, "bytes"), failures0 = copy_counter(p, "failures");
        char *path = NULL;
        uint64_t token = 0;
        epd_handoff_options o = { .arena = "gpu1", .ready = ready };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(id), NULL, seq, groups_uneven, 4, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(id), &acc), 0);
        uint64_t t0 = async_now_us();
        for (uint32_t g = ready; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        for (uint64_t first = 0; ring && !first;) {
                struct epd_ring_record rec;
                ck_assert_int_eq(epd_ring_next(ring, &rec, 10 * UINT64_C(1000000)), 0);
                if (rec.token == acc.token && rec.opcode == EPD_RING_EV_GROUP_PROGRESS && rec.group >= 1)
                        *ret_first_usec = first = async_now_us() - t0;
        }
        if (queue > 0) {
                /* E.g. with BatchesInFlight=2: group 0 copying, group 1 queued behind it;
                 * 2 and 3 wait (the copies take 400 ms: the calls above took a few). */
                epd_handoff_status s;
                ck_assert_int_eq(epd_handoff_get(d, acc.path, &s), 0);
                ck_assert_uint_eq(s.groups_done, 0);
                ck_assert_uint_eq(counter(p, "batches") - batches0, queue);
        }
        landed_commit_release_n(p, d, &md, &acc, path, id, n_pages); /* every layer exact; frees path */
        /* The copy engine moved every byte of it, as org.epd1.Gpu.CopyCounters tells. */
        ck_assert_uint_eq(copy_counter(p, "bytes") - copied0, (uint64_t)n_pages * PAGE_SIZE);
        ck_assert_uint_eq(copy_counter(p, "failures"), failures0);
        *ret_batches = counter(p, "batches") - batches0;
        *ret_merged = counter(p, "merged-groups") - merged0;
        ck_assert_uint_eq(counter(p, "writes-in-flight"), 0);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "gpu0"), 0);
        ck_assert_uint_eq(arena_live(p, "gpu1"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        free(seq);
        free(src);
        unmap_arena(&ms);
        unmap_arena(&md);
}

static void queued_handoff(epd_client *p, epd_client *d, uint32_t id, uint32_t ready, unsigned queue,
                           epd_ring_client *ring, uint64_t *ret_first_usec, uint64_t *ret_batches,
                           uint64_t *ret_merged) {
        queued_handoff_n(p, d, id, ready, queue, ring, ret_first_usec, ret_batches, ret_merged, N_PAGES);
}

/* `epdctl gpus` prints the copy engines' counters (org.epd1.Gpu.CopyCounters). */
static void epdctl_shows_copies(void) {
        char out[8192];
        harness_epdctl(address, "gpus", out, sizeof out);
        printf("$ epdctl gpus\n%s", out);
        ck_assert_msg(strstr(out, "copies: batches ") && strstr(out, " strided-copies ") &&
                              strstr(out, " cow-batches "),
                      "no copy counters in: %s", out);
}

/* Layer groups that queue up on a local GPU handoff: with a batch copying and one queued
 * behind it (each copy takes 400 ms here), groups reported ready beyond that wait, then
 * go as one batch with their pieces of each page next to each other (fewer, larger
 * copies); groups computed already at Prepare go together at once; [Gpu] MergeGroups=1
 * (reloaded) sends every group alone. Every group lands with exact bytes, uneven group
 * sizes included (a group's writes taken for another's would be caught: the bytes
 * landed are counted per group). On a real GPU copies are fast: groups may or may not
 * queue up, and only bytes and counts are checked. */
START_TEST(test_queued_groups_go_together) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t b, merged;

        queued_handoff(p, d, 40, 0, fake ? 2 : 0, NULL, NULL, &b, &merged);
        if (fake) {
                ck_assert_uint_eq(b, 3); /* group 0, group 1, then 2 and 3 together */
                ck_assert_uint_eq(merged, 2);
        } else {
                ck_assert_uint_le(b, 4);
                ck_assert_uint_eq(b + merged - (merged ? 1 : 0), 4);
        }
        printf("4 groups ready at once: %" PRIu64 " batches, %" PRIu64 " groups merged, exact bytes\n", b, merged);

        queued_handoff(p, d, 41, 4, 0, NULL, NULL, &b, &merged); /* all computed at Prepare */
        ck_assert_uint_eq(b, 1);
        ck_assert_uint_eq(merged, 4);

        reload_with("[Gpu]\nMergeGroups=1\n", "MergeGroups=1 BatchesInFlight=2");
        queued_handoff(p, d, 42, 4, 0, NULL, NULL, &b, &merged);
        ck_assert_uint_eq(b, 4);
        ck_assert_uint_eq(merged, 0);

        /* [Gpu] BatchesInFlight=3 (reloaded), MergeGroups=4 again: three groups go to
         * the GPU as they are reported, alone; the fourth waits for one to land. */
        reload_with("MergeGroups=4\nBatchesInFlight=3\n", "MergeGroups=4 BatchesInFlight=3");
        queued_handoff(p, d, 43, 0, fake ? 3 : 0, NULL, NULL, &b, &merged);
        if (fake) {
                ck_assert_uint_eq(b, 4);
                ck_assert_uint_eq(merged, 0);
        } else
                ck_assert_uint_le(b, 4);
        epdctl_shows_copies();

        /* StridedCopies= and CompletionSpin= reload too (the engines take them at once). */
        reload_with("StridedCopies=yes\nCompletionSpin=20us\n", "BatchesInFlight=3 CompletionSpin=20us StridedCopies=yes");
        queued_handoff(p, d, 44, 4, 0, NULL, NULL, &b, &merged); /* 8 KiB pieces: under 2D copies' rows */
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A landed group reaches its reader before the next batch is prepared: four groups
 * ready at once, group 0 then group 1 posted (each submission holding epdd's loop 300
 * ms), groups 2 and 3 queued; group 0's copy lands 1000 ms after its post, and the decode
 * worker, waiting on its ring, has it then (about 1300 ms after the first
 * LayerGroupReady); only after that are groups 2 and 3 posted (another 300 ms). Before,
 * the landing waited for that post: about 1600 ms. */
START_TEST(test_landed_before_next_batch) {
        if (!fake) {
                printf("real driver: submissions are not slowed down here\n");
                return;
        }
        epd_client *p = worker("prefill"), *d = worker("decode");
        epd_ring_client *ring = NULL;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &ring), 0);
        uint64_t first = 0, b, merged;
        queued_handoff(p, d, 50, 0, 0, ring, &first, &b, &merged); /* every layer exact */
        printf("group 0 on the decode's ring %" PRIu64 " ms after the first LayerGroupReady\n", first / 1000);
        ck_assert_uint_ge(first, 1250 * 1000);
        ck_assert_msg(first < 1500 * 1000, "group 0 reached the decode %" PRIu64 " ms after ready: it waited for "
                                             "the next batch's post", first / 1000);
        ck_assert_uint_eq(b, 3); /* 0, 1, then 2 and 3 together */
        ring = epd_ring_close(ring);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* Batches of hundreds of pages go to the transport in slices of pages (the first of
 * about 256 writes, each next one twice the last), each planned while the GPU copies
 * the one before (`gpu-slices` counts the posts): every byte lands exactly, four groups
 * merged (the uneven groups: 1600 writes of 8 to 24 KiB, in slices of 64, 128 and 208
 * pages) or each alone ([Gpu] MergeGroups=1: 400 writes, slices of 256 and 144 pages). */
START_TEST(test_sliced_batches) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t b, merged, slices = counter(p, "gpu-slices");

        queued_handoff_n(p, d, 60, 4, 0, NULL, NULL, &b, &merged, BIG_PAGES); /* all computed at Prepare */
        ck_assert_uint_eq(b, 1);
        ck_assert_uint_eq(merged, 4);
        ck_assert_uint_eq(counter(p, "gpu-slices") - slices, 3);
        slices = counter(p, "gpu-slices");
        reload_with("[Gpu]\nMergeGroups=1\n", "MergeGroups=1 BatchesInFlight=2");
        queued_handoff_n(p, d, 61, 4, 0, NULL, NULL, &b, &merged, BIG_PAGES);
        ck_assert_uint_eq(b, 4);
        ck_assert_uint_eq(merged, 0);
        /* Group 0 goes with the engine idle, in 2 slices (256 and 144 pages); group 1 at
         * once behind it, still on the engine with as many bytes as a quarter of the
         * largest slice (2048 pages, all 400 here): in one. Groups 2 and 3 go as batches
         * land, in 1 or 2 each, as what is still in flight then says. */
        ck_assert_uint_ge(counter(p, "gpu-slices") - slices, 5);
        ck_assert_uint_le(counter(p, "gpu-slices") - slices, 7);
        slices = counter(p, "gpu-slices");
        queued_handoff_n(p, d, 62, 0, 0, NULL, NULL, &b, &merged, BIG_PAGES); /* reported one by one */
        ck_assert_uint_eq(b, 4);
        /* Each in 2 slices with the engine idle (the fake driver's copies are done when
         * the next LayerGroupReady comes), in 1 behind the group before still copying
         * (a real GPU's). */
        ck_assert_uint_ge(counter(p, "gpu-slices") - slices, 5);
        ck_assert_uint_le(counter(p, "gpu-slices") - slices, 8);
        /* A batch of few pages is one slice. */
        slices = counter(p, "gpu-slices");
        queued_handoff(p, d, 63, 4, 0, NULL, NULL, &b, &merged);
        ck_assert_uint_eq(counter(p, "gpu-slices") - slices, 4);
        printf("%u pages, 4 groups: exact in one merged batch and in four, each in slices\n", BIG_PAGES);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

static bool gpu_arenas_empty(void *userdata) {
        epd_client *c = userdata;
        return arena_live(c, "gpu0") == 0 && arena_live(c, "gpu1") == 0;
}

/* The driver takes a batch's first slice, then refuses the next (fake driver: every
 * asynchronous copy call after the first; group 0 of 400 pages, slices of 256 and 144
 * pages): the handoff rolls back at once with
 * transfer-failed, the slice in flight (its copies take 400 ms here) still completes and
 * is accounted, its bytes counted, and once it has, nothing stays allocated or leased.
 * Then a handoff whose first slice is refused: the same, with nothing in flight. */
START_TEST(test_later_slice_refused) {
        if (!fake) {
                printf("real driver: copies are not refused here\n");
                return;
        }
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t *src = calloc(BIG_PAGES, sizeof *src);
        ck_assert_ptr_nonnull(src);
        for (uint32_t round = 0; round < 2; round++) {
                uint32_t n = round == 0 ? BIG_PAGES : N_PAGES;
                uint64_t copied0 = copy_counter(p, "bytes"), slices0 = counter(p, "gpu-slices");
                char *seq = make_sequence(p, "gpu0", n, src);
                char *path = NULL;
                uint64_t token;
                epd_handoff_options o = { .arena = "gpu1" };
                ck_assert_int_eq(epd_handoff_prepare(p, rid(70 + round), NULL, seq, groups4, 4, &o, &path, &token),
                                 0);
                epd_handoff_accepted acc;
                ck_assert_int_eq(epd_handoff_accept(d, rid(70 + round), &acc), 0);
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 0), 0);
                wait_state(p, path, "rolled-back");
                wait_state(d, acc.path, "rolled-back");
                if (round == 0) {
                        /* Refused as it was posted, the first slice still copying; not a
                         * copy that failed on the GPU. */
                        ck_assert(harness_log_has(&h, "cannot ship groups 0-0"));
                        ck_assert_uint_gt(counter(p, "writes-in-flight"), 0);
                        ck_assert_uint_gt(arena_live(p, "gpu1"), 0);
                }
                epd_handoff_status s;
                ck_assert_int_eq(epd_handoff_get(p, path, &s), 0);
                ck_assert_str_eq(s.cause, "transfer-failed");
                ck_assert_int_eq(epd_handoff_get(d, acc.path, &s), 0);
                ck_assert_str_eq(s.cause, "transfer-failed");
                ck_assert_int_eq(epd_handoff_commit(d, acc.path, NULL), -ESTALE);
                ck_assert_int_eq(epd_handoff_release(p, path), 0);
                ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
                release_sequence(p, seq);
                ck_assert_msg(harness_wait_for(gpu_arenas_empty, p, 10000), "pages left: gpu0 %" PRIu64 " gpu1 %" PRIu64,
                              arena_live(p, "gpu0"), arena_live(p, "gpu1"));
                ck_assert_uint_eq(counter(p, "live"), 0);
                ck_assert_uint_eq(counter(p, "writes-in-flight"), 0);
                ck_assert_uint_eq(counter(p, "failures.transfer-failed"), round + 1);
                /* Group 0 (2 layers, 16 KiB) of the first slice's 256 pages, then nothing. */
                ck_assert_uint_eq(copy_counter(p, "bytes") - copied0, round == 0 ? 256 * 2 * LAYER_BYTES : 0);
                ck_assert_uint_eq(counter(p, "gpu-slices") - slices0, round == 0 ? 1 : 0);
                epd_handoff_accepted_done(&acc);
                free(path);
                free(seq);
        }
        free(src);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A GPU copy-on-write waits for the GPU, never on epdd's event loop: with every copy
 * taking 400 ms (the fake driver, as when the workers' kernels hold the GPU), other
 * calls are answered meanwhile, the table keeps its shared page until the copy is
 * done, and a sequence released under its copy frees every page once the copy ends. */
START_TEST(test_cow_off_loop) {
        if (!fake) {
                printf("real driver: copies are not slowed down here; test_cow covers the copy\n");
                return;
        }
        epd_client *c = worker("decode"), *o = worker("prefill");
        uint64_t offs[N_PAGES], during[N_PAGES], after[N_PAGES];
        char *seq = make_sequence(c, "gpu0", N_PAGES, offs);
        Mem m = map_arena(c, "gpu0");
        fill_pages(&m, offs, N_PAGES, 3);
        char *clone = clone_sequence(c, seq);

        AsyncCall a;
        prepare_write_async(c, clone, 5, 1, &a);
        /* While the copy runs: another client's call, and the same client's. */
        uint64_t t0 = async_now_us();
        ck_assert_uint_eq(arena_live(o, "gpu0"), N_PAGES + 1); /* the fresh page, held by the copy */
        uint64_t other = async_now_us() - t0;
        sequence_offsets(c, clone, during, N_PAGES);
        ck_assert(!a.done);
        ck_assert_uint_eq(during[5], offs[5]); /* unchanged until the copy is done */
        ck_assert_msg(other < 200000, "a call took %" PRIu64 " us while a copy-on-write was under way", other);
        async_wait(c, &a);
        ck_assert_msg(a.error[0] == 0, "PrepareWrite: %s", a.error);
        ck_assert_uint_eq(a.copied, 1);
        ck_assert_uint_ge(a.usec, 350000); /* it did wait for the copy */
        ck_assert_uint_eq(cow_copies(c, clone), 1);
        sequence_offsets(c, clone, after, N_PAGES);
        ck_assert_uint_ne(after[5], offs[5]);
        static uint8_t x[PAGE_SIZE], y[PAGE_SIZE];
        mem_read(&m, offs[5], x, PAGE_SIZE);
        mem_read(&m, after[5], y, PAGE_SIZE);
        ck_assert(memcmp(x, y, PAGE_SIZE) == 0);
        printf("CoW of a GPU page under a 400 ms copy: another call answered in %" PRIu64 " us, the write in %" PRIu64 " us\n",
               other, a.usec);

        /* Released while its copy runs: the caller hears NotFound, nothing leaks. */
        prepare_write_async(c, clone, 7, 2, &a);
        release_sequence(c, clone);
        ck_assert(!a.done);
        async_wait(c, &a);
        ck_assert_msg(strstr(a.error, "org.epd1.Error.NotFound") && strstr(a.error, "released"), "got %s", a.error);
        ck_assert_uint_eq(arena_live(c, "gpu0"), N_PAGES);
        ck_assert_uint_eq(cow_copies(c, seq), 0);

        /* Disconnected while its copy runs: the same. */
        epd_client *w = worker("decode");
        release_sequence(c, seq);
        ck_assert_uint_eq(arena_live(o, "gpu0"), 0);
        char *own = make_sequence(w, "gpu0", 4, offs);
        char *wc = clone_sequence(w, own);
        prepare_write_async(w, wc, 0, 4, &a);
        ck_assert_int_ge(sd_bus_flush(w->bus), 0);
        epd_disconnect(w);
        uint64_t live = UINT64_MAX;
        for (int i = 0; i < 150 && (live = arena_live(o, "gpu0")) != 0; i++)
                usleep(20000);
        ck_assert_uint_eq(live, 0);

        free(wc);
        free(own);
        free(clone);
        free(seq);
        unmap_arena(&m);
        epd_disconnect(c);
        epd_disconnect(o);
}
END_TEST

typedef struct LiveIs {
        epd_client *c;
        uint64_t live;
} LiveIs;

static bool gpu0_live_is(void *userdata) {
        LiveIs *l = userdata;
        return arena_live(l->c, "gpu0") == l->live;
}

/* A worker's connection closes while its process still runs (a dying process's files
 * close before its GPU contexts go, and its kernels may still write into the pages it
 * mapped): its GPU pages are not handed out again until the process has exited. */
START_TEST(test_gpu_pages_wait_for_the_process) {
        epd_client *o = worker("prefill");
        uint64_t offs[4];
        char *seq = make_sequence(o, "gpu0", 4, offs);
        uint64_t base = arena_live(o, "gpu0");
        int to_parent[2], to_child[2];
        ck_assert_int_eq(pipe2(to_parent, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(to_child, O_CLOEXEC), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                epd_client *c = NULL;
                char *path = NULL, go;
                if (epd_connect(address, &c) < 0 || epd_register(c, "decode", "model", "cuda:0", &kv, NULL) < 0 ||
                    epd_sequence_create(c, "gpu0", 8, &path, NULL, NULL) < 0)
                        _exit(1);
                const char *wp = epd_worker_path(c);
                (void)shutdown(epd_get_fd(c), SHUT_RDWR); /* gone, as far as epdd can see */
                if (write(to_parent[1], wp, strlen(wp) + 1) < 0 || read(to_child[0], &go, 1) != 1)
                        _exit(1);
                _exit(0);
        }
        close(to_parent[1]);
        close(to_child[0]);
        char target[256] = "";
        ck_assert_int_gt(read(to_parent[0], target, sizeof target - 1), 0);
        usleep(300000);
        ck_assert_uint_eq(arena_live(o, "gpu0"), base + 8); /* held while the process runs */
        /* It takes no more work meanwhile: a handoff meant for it is refused. */
        char *hp = NULL;
        uint64_t token;
        epd_handoff_options opt = { .target = target };
        ck_assert_int_lt(epd_handoff_prepare(o, "0000000000000000000000000000d1e5", NULL, seq, groups4, 4, &opt, &hp,
                                             &token), 0);
        ck_assert_msg(strstr(epd_last_error_message(o), "No worker"), "%s", epd_last_error_message(o));
        ck_assert_int_eq(write(to_child[1], "x", 1), 1);
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        LiveIs l = { o, base };
        ck_assert_msg(harness_wait_for(gpu0_live_is, &l, 3000), "gpu0 still holds %" PRIu64 " pages",
                      arena_live(o, "gpu0"));
        close(to_parent[0]);
        close(to_child[1]);
        release_sequence(o, seq);
        free(seq);
        epd_disconnect(o);
}
END_TEST

/* An encoder that maps GPU memory loses its connection while its process runs (its
 * GPU pages wait for the process to exit, up to 10 s): the feature it was producing
 * fails at once (a prefill waiting for it hears so, not at the process's exit), and its
 * region is not handed out again until the process is gone (its GPU work may still
 * write there); the key is produced anew meanwhile, elsewhere. */
/* Scheduler.Outstanding, read on a connection of its own. */
static uint32_t outstanding(void) {
        sd_bus *bus = NULL;
        uint32_t n = UINT32_MAX;
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, harness_destination(&h), "/org/epd1", "org.epd1.Scheduler",
                                                     "Outstanding", NULL, 'u', &n),
                         0);
        sd_bus_flush_close_unref(bus);
        return n;
}

/* epdd's CPU time so far (user + system), in clock ticks. */
static uint64_t epdd_ticks(void) {
        char path[64], buf[1024];
        snprintf(path, sizeof path, "/proc/%d/stat", (int)h.epdd_pid);
        FILE *f = fopen(path, "re");
        ck_assert_ptr_nonnull(f);
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        const char *p = strrchr(buf, ')');
        ck_assert_ptr_nonnull(p);
        unsigned long long ut = 0, st = 0;
        /* after ") ": state, ppid, pgrp, session, tty, tpgid, flags, minflt, cminflt,
         * majflt, cmajflt, utime, stime */
        ck_assert_int_eq(sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st), 2);
        return ut + st;
}

/* A GPU worker on the bus that leaves its connection while its process runs on: epdd
 * waits for the process before handing its GPU pages out again, and serves everyone
 * else meanwhile. Its bus track, empty but kept, was put back on sd-bus's queue at every
 * dispatch (the handler returned 0): 100 % CPU and no bus call answered until the
 * process exited, up to 10 s. (Skipped without a dbus-daemon: the GPU machine.) */
START_TEST(test_departing_gpu_client_on_the_bus) {
        if (!harness_have_dbus_daemon())
                return;
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
        ck_assert_int_eq(harness_init(&h, CONFIG), 0);
        harness_start(&h, true, address, sizeof address);

        int to_parent[2], to_child[2];
        ck_assert_int_eq(pipe2(to_parent, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(to_child, O_CLOEXEC), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                const char *arenas[] = { "gpu0", NULL };
                epd_client *c = NULL;
                char go;
                if (epd_connect(address, &c) < 0 || epd_register(c, "decode", "model", "cuda:0", &kv, arenas) < 0)
                        _exit(1);
                (void)shutdown(epd_get_fd(c), SHUT_RDWR); /* gone from the bus; the process stays */
                if (write(to_parent[1], "x", 1) != 1 || read(to_child[0], &go, 1) != 1)
                        _exit(1);
                _exit(0);
        }
        close(to_parent[1]);
        close(to_child[0]);
        char x;
        ck_assert_int_eq(read(to_parent[0], &x, 1), 1);
        usleep(300 * 1000); /* the bus tells epdd; it waits for the process */

        uint64_t t0 = epdd_ticks();
        usec_t c0 = now_usec(CLOCK_MONOTONIC);
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        char *version = NULL;
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property_string(bus, harness_destination(&h), "/org/epd1", "org.epd1.Manager",
                                                    "Version", &e, &version),
                         0);
        usec_t took = now_usec(CLOCK_MONOTONIC) - c0;
        free(version);
        sd_bus_flush_close_unref(bus);
        ck_assert_msg(took < USEC_PER_SEC, "a bus call took %" PRIu64 " ms", took / 1000);
        usleep(1000 * 1000);
        uint64_t ticks = epdd_ticks() - t0;
        long hz = sysconf(_SC_CLK_TCK);
        ck_assert_msg(ticks * 1000 / (uint64_t)hz < 500, "epdd used %" PRIu64 " ticks in about 1 s", ticks);

        ck_assert_int_eq(write(to_child[1], "x", 1), 1);
        int status;
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        close(to_parent[0]);
        close(to_child[1]);
}
END_TEST

/* A departed GPU worker whose process still runs does not count against MaxWorkers=, as
 * a departed client does not against MaxClients=: the process registering again on a
 * new connection is not refused while its old worker waits for it. */
START_TEST(test_departed_worker_not_counted) {
        ck_assert_int_eq(harness_restart(&h, CONFIG "[Limits]\nMaxWorkers=1\n", address, sizeof address), 0);

        const char *arenas[] = { "gpu0", NULL };
        epd_client *a = NULL, *b = NULL;
        ck_assert_int_eq(epd_connect(address, &a), 0);
        ck_assert_int_eq(epd_register(a, "decode", "model", "cuda:0", &kv, arenas), 0);
        ck_assert_int_eq(epd_connect(address, &b), 0);
        ck_assert_int_lt(epd_register(b, "decode", "model", "cuda:0", &kv, arenas), 0); /* the limit */
        ck_assert_str_eq(epd_last_error_name(b), "org.epd1.Error.LimitExceeded");
        (void)shutdown(epd_get_fd(a), SHUT_RDWR); /* a's connection goes, this process stays */
        usleep(300 * 1000);
        ck_assert_msg(epd_register(b, "decode", "model", "cuda:0", &kv, arenas) == 0, "%s", epd_last_error_message(b));
        epd_disconnect(b);
        epd_disconnect(a);
}
END_TEST

/* A feature in a GPU feature arena: Reserve and Acquire succeed with no host pointer
 * (its bytes are reached through epd_gpu_arena_map()), and leave no error behind. The
 * client's optional mapping of the arena, refused for a GPU arena (-EOPNOTSUPP), stayed
 * as the successful call's last error (review). */
START_TEST(test_gpu_feature_arena_no_stale_error) {
        ck_assert_int_eq(harness_restart(&h, CONFIG "[Arena:featgpu]\nDomain=gpu\nGpu=0\nUsage=feature\nSize=32M\n",
                                         address, sizeof address),
                         0);
        const char *arenas[] = { "featgpu", "host0", NULL };
        epd_client *c = NULL;
        epd_feature *f = NULL, *g = NULL;
        epd_feature_tensor t = { .name = "x", .dtype = "f32", .rank = 1, .shape = { 256 } };
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "encoder", "model", "cuda:0", &kv, arenas), 0);
        ck_assert_int_eq(epd_feature_reserve(c, "sha256:gpu-feature", 1024, &t, 1, NULL, &f), 0);
        ck_assert_msg(!epd_last_error_name(c), "%s: %s", epd_last_error_name(c), epd_last_error_message(c));
        ck_assert_int_eq(f->arena, epd_arena_find(c, "featgpu"));
        ck_assert_ptr_null(f->data);
        ck_assert_int_eq(epd_feature_publish(c, f, 1), 0);
        ck_assert_int_eq(epd_feature_acquire(c, "sha256:gpu-feature", false, &g), 0);
        ck_assert_str_eq(g->result, "hit");
        ck_assert_msg(!epd_last_error_name(c), "%s: %s", epd_last_error_name(c), epd_last_error_message(c));
        ck_assert_int_eq(epd_feature_wait(c, g, 0), 0); /* settled: no call, no error */
        ck_assert_ptr_null(epd_last_error_name(c));
        ck_assert_int_eq(epd_feature_release(c, g), 0);
        ck_assert_int_eq(epd_feature_release(c, f), 0);
        epd_disconnect(c);
}
END_TEST

START_TEST(test_departing_encoder_fails_its_features_at_once) {
        ck_assert_int_eq(harness_restart(&h, CONFIG "[Arena:feat0]\nUsage=feature\nSize=16M\nPageSize=64K\n", address,
                                         sizeof address),
                         0);

        static const char key[] = "sha256:departing-encoder";
        epd_feature_tensor t = { .name = "x", .dtype = "u8", .rank = 1, .shape = { 65536 } };
        int to_parent[2], to_child[2];
        /* A prefill and a decode worker, so that the encoder's Admit is admitted. */
        const char *farenas[] = { "feat0", NULL };
        epd_client *p = NULL, *dec = NULL;
        ck_assert_int_eq(epd_connect(address, &p), 0);
        ck_assert_int_eq(epd_register(p, "prefill", "model", "cuda:0", &kv, farenas), 0);
        ck_assert_int_eq(epd_connect(address, &dec), 0);
        ck_assert_int_eq(epd_register(dec, "decode", "model", "cuda:0", &kv, NULL), 0);
        ck_assert_int_eq(pipe2(to_parent, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(to_child, O_CLOEXEC), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                const char *arenas[] = { "gpu0", "feat0", NULL };
                epd_client *c = NULL;
                epd_feature *f = NULL;
                char go;
                sd_bus_message *verdict = NULL;
                const char *v = NULL;
                if (epd_connect(address, &c) < 0 || epd_register(c, "encoder", "model", "cuda:0", &kv, arenas) < 0 ||
                    epd_feature_acquire_or_reserve(c, key, 65536, &t, 1, NULL, &f) < 0 ||
                    strcmp(f->result, "produce") != 0)
                        _exit(1);
                /* It admits a request too (a worker may: its own requests are its objects). */
                if (sd_bus_call_method(c->bus, NULL, "/org/epd1", "org.epd1.Scheduler", "Admit", NULL, &verdict,
                                       "ssta{sv}", "0000000000000000000000000000d0e5", "interactive", (uint64_t)0,
                                       0) < 0 ||
                    sd_bus_message_read(verdict, "s", &v) < 0 || strcmp(v, "admit") != 0)
                        _exit(2);
                sd_bus_message_unref(verdict);
                uint64_t off = f->offset;
                if (write(to_parent[1], &off, sizeof off) != (ssize_t)sizeof off || read(to_child[0], &go, 1) != 1)
                        _exit(1);
                (void)shutdown(epd_get_fd(c), SHUT_RDWR); /* gone, as far as epdd can see */
                if (read(to_child[0], &go, 1) != 1)
                        _exit(1);
                _exit(0);
        }
        close(to_parent[1]);
        close(to_child[0]);
        uint64_t held;
        ck_assert_int_eq(read(to_parent[0], &held, sizeof held), (ssize_t)sizeof held);

        epd_feature *w = NULL, *again = NULL;
        ck_assert_uint_eq(outstanding(), 1);
        ck_assert_int_eq(epd_feature_acquire(p, key, false, &w), 0);
        ck_assert_str_eq(w->result, "wait");
        ck_assert_int_eq(write(to_child[1], "x", 1), 1); /* its connection goes */
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_feature_wait(p, w, 8 * USEC_PER_SEC), -EPIPE);
        usec_t took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_msg(took < 3 * USEC_PER_SEC, "the wait ended after %" PRIu64 " ms", took / 1000);
        ck_assert_str_eq(w->error, "producer-gone");
        epd_feature_release(p, w);
        /* The request it admitted ended with its departure too, not once its process is
         * gone or 10 s have passed (docs/scheduler.md: "at once"). */
        ck_assert_uint_eq(outstanding(), 0);

        /* Produced anew meanwhile, not in the region the departing process may write. */
        ck_assert_int_eq(epd_feature_acquire_or_reserve(p, key, 65536, &t, 1, NULL, &again), 0);
        ck_assert_str_eq(again->result, "produce");
        ck_assert_uint_ne(again->offset, held);
        ck_assert_int_eq(epd_feature_release(p, again), 0);

        ck_assert_int_eq(write(to_child[1], "x", 1), 1);
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        close(to_parent[0]);
        close(to_child[1]);
        epd_disconnect(p);
        epd_disconnect(dec);
}
END_TEST

/* Releases the sequences in this order, frees their paths; gpu0 is empty then. */
static void release_all(epd_client *c, char **paths, size_t n) {
        for (size_t i = 0; i < n; i++) {
                release_sequence(c, paths[i]);
                free(paths[i]);
        }
        ck_assert_uint_eq(arena_live(c, "gpu0"), 0);
}

/* A page of the range that was this sequence's alone when the copies were planned, and
 * is shared by a Clone while they run, is copied too before the reply hands the range
 * out as writable: the writer's bytes never land in the clone's KV. */
START_TEST(test_cow_shared_while_copying) {
        if (!fake) {
                printf("real driver: copies are not slowed down here\n");
                return;
        }
        epd_client *c = worker("decode");
        uint64_t offs[N_PAGES], mine[N_PAGES], other[N_PAGES];
        char *seq = make_sequence(c, "gpu0", N_PAGES, offs);
        char *clone = clone_sequence(c, seq);
        AsyncCall a;
        prepare_write_async(c, clone, 6, 1, &a); /* page 6 of the clone: its own */
        async_wait(c, &a);
        ck_assert_msg(a.error[0] == 0, "PrepareWrite: %s", a.error);
        ck_assert_uint_eq(a.copied, 1);

        prepare_write_async(c, clone, 5, 2, &a); /* copies page 5; 6 is exclusive now */
        char *clone2 = clone_sequence(c, clone); /* while it runs: 6 is shared again */
        ck_assert(!a.done);
        async_wait(c, &a);
        ck_assert_msg(a.error[0] == 0, "PrepareWrite: %s", a.error);
        ck_assert_uint_eq(a.copied, 2);
        sequence_offsets(c, clone, mine, N_PAGES);
        sequence_offsets(c, clone2, other, N_PAGES);
        ck_assert_uint_ne(mine[5], other[5]);
        ck_assert_uint_ne(mine[6], other[6]);
        ck_assert_uint_ne(mine[5], offs[5]);

        release_all(c, (char *[]){ clone2, clone, seq }, 3);
        epd_disconnect(c);
}
END_TEST

/* The owner truncates the range away while its copies run: the reply names the range
 * and the sequence's size now (InvalidArgument), not a failed copy. */
START_TEST(test_cow_truncated_while_copying) {
        if (!fake) {
                printf("real driver: copies are not slowed down here\n");
                return;
        }
        epd_client *c = worker("decode");
        uint64_t offs[N_PAGES];
        char *seq = make_sequence(c, "gpu0", N_PAGES, offs);
        char *clone = clone_sequence(c, seq);
        AsyncCall a;
        prepare_write_async(c, clone, 5, 2, &a); /* both shared: copied */
        ck_assert_int_eq(epd_sequence_truncate(c, clone, 5), 0);
        ck_assert(!a.done);
        async_wait(c, &a);
        ck_assert_msg(strstr(a.error, "org.epd1.Error.InvalidArgument") && strstr(a.error, "truncated") &&
                              strstr(a.error, "(5 pages)"),
                      "got %s", a.error);
        release_all(c, (char *[]){ clone, seq }, 2);
        epd_disconnect(c);
}
END_TEST

/* A copy-on-write's second round (a Clone shared a page again while round one's copy
 * ran) that finds no free page is refused by name, NoSpace as round one's would be,
 * saying that round one's copy stays. */
START_TEST(test_cow_later_round_no_space) {
        if (!fake) {
                printf("real driver: copies are not slowed down here\n");
                return;
        }
        epd_client *c = worker("decode");
        uint64_t offs[N_PAGES], one[1];
        char *seq = make_sequence(c, "gpu0", N_PAGES, offs);
        char *clone = clone_sequence(c, seq);
        char *filler = make_sequence(c, "gpu0", 1, one);
        ck_assert_int_eq(epd_sequence_append(c, clone, 1, NULL, NULL), 0); /* page N_PAGES: its own */
        AsyncCall a;
        prepare_write_async(c, clone, N_PAGES - 1, 2, &a);
        char *clone2 = clone_sequence(c, clone); /* while round one runs: N_PAGES is shared */
        for (uint32_t n = 256; n > 0;) { /* and the arena full */
                int k = epd_sequence_append(c, filler, n, NULL, NULL);
                ck_assert_msg(k == 0 || k == -ENOSPC, "Append: %s", epd_last_error_message(c));
                if (k < 0)
                        n /= 2;
        }
        ck_assert(!a.done);
        async_wait(c, &a);
        ck_assert_msg(strstr(a.error, "org.epd1.Error.NoSpace") && strstr(a.error, "stay copied"), "got %s",
                      a.error);
        release_all(c, (char *[]){ filler, clone2, clone, seq }, 4);
        ck_assert_uint_eq(arena_live(c, "gpu0"), 0);
        epd_disconnect(c);
}
END_TEST

/* The copies of a copy-on-write's second round are refused by the driver (fake driver:
 * every asynchronous copy after the first): the first round's copy stays (its bytes are
 * the page's own), the caller hears Error.Failed saying so, the page shared again stays
 * shared, nothing leaks. Round two comes from a Clone while round one's copy runs. */
static void setup_second_copy_refused(void) {
        copy_delay_ms = "400";
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_ASYNC_AFTER", "1", 1), 0);
        start("0");
        ck_assert_int_eq(unsetenv("FAKE_CUDA_FAIL_ASYNC_AFTER"), 0);
        copy_delay_ms = "0";
}

/* A clone's PrepareWrite of page 5 that the driver fails: Error.Failed, naming `want`
 * (the driver's error) when given, and nothing changed; the fresh page goes back. */
static void cow_refused(const char *want) {
        epd_client *c = worker("decode");
        uint64_t offs[N_PAGES], after[N_PAGES];
        char *seq = make_sequence(c, "gpu0", N_PAGES, offs);
        sd_bus_message *reply = NULL;
        char *clone = clone_sequence(c, seq);
        int r = epd__call(c, clone, "org.epd1.Sequence", "PrepareWrite", &reply, "uu", 5, 1);
        ck_assert_int_lt(r, 0);
        ck_assert_msg(strcmp(epd_last_error_name(c), "org.epd1.Error.Failed") == 0, "%s: %s",
                      epd_last_error_name(c), epd_last_error_message(c));
        ck_assert_msg((!want || strstr(epd_last_error_message(c), want)) &&
                      strstr(epd_last_error_message(c), "nothing changed"), "%s", epd_last_error_message(c));
        sequence_offsets(c, clone, after, N_PAGES);
        ck_assert(memcmp(offs, after, sizeof offs) == 0);
        ck_assert_uint_eq(cow_copies(c, clone), 0);
        ck_assert_uint_eq(arena_live(c, "gpu0"), N_PAGES);
        ck_assert_uint_eq(counter(c, "writes-in-flight"), 0);
        release_all(c, (char *[]){ clone, seq }, 2);
        ck_assert_uint_eq(arena_live(c, "gpu0"), 0);
        epd_disconnect(c);
}

/* The driver refuses the first copy as it is enqueued: with CUDA_ERROR_INVALID_VALUE
 * (-EINVAL) the caller heard InvalidArgument "invalid argument", with
 * CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES (-ENOSPC) NoSpace "not enough free KV pages", with
 * CUDA_ERROR_NOT_FOUND (-ENOENT) NotFound: the driver's errno read as a refusal of the
 * plan. It is Failed, naming the driver's error, and nothing changed. */
static const char *refused_error;
static void setup_first_copy_refused(void) {
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_ASYNC_AFTER", "0", 1), 0);
        ck_assert_int_eq(setenv("FAKE_CUDA_ASYNC_ERROR", refused_error, 1), 0);
        start("0");
        ck_assert_int_eq(unsetenv("FAKE_CUDA_FAIL_ASYNC_AFTER"), 0);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_ASYNC_ERROR"), 0);
}
static void setup_first_copy_invalid(void) {
        refused_error = "1"; /* CUDA_ERROR_INVALID_VALUE */
        setup_first_copy_refused();
}
static void setup_first_copy_no_resources(void) {
        refused_error = "701"; /* CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES */
        setup_first_copy_refused();
}
static void setup_first_copy_not_found(void) {
        refused_error = "500"; /* CUDA_ERROR_NOT_FOUND */
        setup_first_copy_refused();
}

START_TEST(test_cow_first_copy_refused) {
        if (fake)
                cow_refused(strcmp(refused_error, "701") == 0   ? strerror(ENOSPC)
                            : strcmp(refused_error, "500") == 0 ? strerror(ENOENT)
                                                                : strerror(EINVAL));
}
END_TEST

START_TEST(test_cow_later_round_fails) {
        if (!fake) {
                printf("real driver: copies are not refused here\n");
                return;
        }
        epd_client *c = worker("decode");
        uint64_t offs[N_PAGES], mine[N_PAGES + 1], other[N_PAGES + 1];
        char *seq = make_sequence(c, "gpu0", N_PAGES, offs);
        Mem m = map_arena(c, "gpu0");
        fill_pages(&m, offs, N_PAGES, 5);
        char *clone = clone_sequence(c, seq);
        /* The clone's last page, N_PAGES, is its own; N_PAGES - 1 is shared. */
        ck_assert_int_eq(epd_sequence_append(c, clone, 1, NULL, NULL), 0);
        AsyncCall a;
        prepare_write_async(c, clone, N_PAGES - 1, 2, &a);
        char *clone2 = clone_sequence(c, clone); /* while round one runs: N_PAGES is shared */
        ck_assert(!a.done);
        async_wait(c, &a);
        ck_assert_msg(strstr(a.error, "org.epd1.Error.Failed") && strstr(a.error, "stay copied"), "got %s",
                      a.error);
        sequence_offsets(c, clone, mine, N_PAGES + 1);
        sequence_offsets(c, clone2, other, N_PAGES + 1);
        ck_assert_uint_ne(mine[N_PAGES - 1], offs[N_PAGES - 1]); /* round one's copy stays */
        ck_assert_uint_eq(other[N_PAGES - 1], offs[N_PAGES - 1]);
        ck_assert_uint_eq(mine[N_PAGES], other[N_PAGES]);       /* round two's did not happen */
        ck_assert_uint_eq(cow_copies(c, clone), 1);
        static uint8_t x[PAGE_SIZE], y[PAGE_SIZE];
        mem_read(&m, offs[N_PAGES - 1], x, PAGE_SIZE);
        mem_read(&m, mine[N_PAGES - 1], y, PAGE_SIZE);
        ck_assert(memcmp(x, y, PAGE_SIZE) == 0);
        /* S: N_PAGES; the clone's copy and the page it shares with clone2: 2 more. */
        ck_assert_uint_eq(arena_live(c, "gpu0"), N_PAGES + 2);
        ck_assert_uint_eq(counter(c, "writes-in-flight"), 0);
        release_all(c, (char *[]){ clone2, clone, seq }, 3);
        unmap_arena(&m);
        epd_disconnect(c);
}
END_TEST

/* Every GPU copy fails (fake driver): a copy-on-write says so with Error.Failed and
 * changes nothing; the fresh page goes back. */
START_TEST(test_cow_copy_fails) {
        if (fake)
                cow_refused(NULL);
}
END_TEST

static void loop_stalls(epd_client *c, uint64_t *n, uint64_t *max_usec, char *what, size_t size) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *w;
        uint64_t at;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, "/org/epd1", "org.epd1.Manager", "LoopStalls", &e, &reply,
                                             "(ttst)"), 0);
        ck_assert_int_ge(sd_bus_message_read(reply, "(ttst)", n, max_usec, &w, &at), 0);
        snprintf(what, size, "%s", w);
        if (*n > 0)
                ck_assert_uint_gt(at, 0);
        sd_bus_message_unref(reply);
}

/* A call that holds the event loop is counted and named: importing a worker's memory
 * takes 400 ms here (the fake driver; the real one maps on the loop too). */
START_TEST(test_loop_stall_named) {
        if (!fake) {
                printf("real driver: imports are not slowed down here\n");
                return;
        }
        epd_client *c = worker("decode");
        uint64_t n0, max0, n1, max1;
        char what[200];
        loop_stalls(c, &n0, &max0, what, sizeof what);
        ck_assert_uint_lt(max0, 300000); /* nothing of the kind yet */
        GpuArena *own = NULL;
        EpdGpu *g = NULL;
        uint32_t region;
        ck_assert_int_eq(gpu_arena_new(sys, 0, 4 << 20, &own), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base, own->size, &region), 0);
        loop_stalls(c, &n1, &max1, what, sizeof what);
        ck_assert_uint_ge(n1, n0 + 1);
        ck_assert_uint_ge(max1, 390000);
        ck_assert_str_eq(what, "org.epd1.Gpu.RegisterMemory");
        printf("loop stalls: %" PRIu64 ", the longest %" PRIu64 " us: %s\n", n1, max1, what);
        ck_assert_int_eq(epd_gpu_release_memory(c, region), 0);
        epd_gpu_close(g);
        gpu_arena_unref(own);
        epd_disconnect(c);
}
END_TEST

/* A worker's registered GPU memory goes with its registration (docs/gpu.md): after
 * UnregisterWorker the daemon holds no import of it, on a connection that stays. */
START_TEST(test_unregister_releases_memory) {
        epd_client *c = worker("decode");
        GpuArena *own = NULL;
        EpdGpu *g = NULL;
        uint32_t region;
        ck_assert_int_eq(gpu_arena_new(sys, 0, 4 << 20, &own), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        /* A pointer inside the allocation (the daemon would map it from its start), or a
         * size past its end, is refused before anything is exported. */
        ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base + 4096, 2 << 20, &region), -EINVAL);
        ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base, own->size + 4096, &region), -EINVAL);
        ck_assert_str_eq(epd_last_error_message(c), "The size runs past the end of the allocation.");
        ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base, own->size, &region), 0);
        /* 32 a client: the daemon's 256 are not one worker's to take (review). */
        uint32_t more[31];
        for (int i = 0; i < 31; i++)
                ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base, own->size, &more[i]), 0);
        ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base, own->size, &region), -EDQUOT);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.LimitExceeded");
        ck_assert_int_eq(epd_gpu_release_memory(c, more[30]), 0);
        ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base, own->size, &more[30]), 0);
        ck_assert_int_eq(epd_unregister(c), 0);
        ck_assert_int_eq(epd_gpu_release_memory(c, region), -ENOENT);
        epd_gpu_close(g);
        gpu_arena_unref(own);
        epd_disconnect(c);
}
END_TEST

/* The daemon finds no room to map a worker's memory (the fake driver's reservations
 * fail once the file is there): NoSpace with the driver's error, not InvalidArgument
 * "cannot import ... from this fd", which blamed the caller; nothing is held. */
START_TEST(test_register_memory_no_room) {
        if (!fake)
                return;
        epd_client *c = worker("decode");
        GpuArena *own = NULL;
        EpdGpu *g = NULL;
        uint32_t region;
        char no_room[300];
        snprintf(no_room, sizeof no_room, "%s/no-room", h.dir);
        ck_assert_int_eq(gpu_arena_new(sys, 0, 4 << 20, &own), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        FILE *f = fopen(no_room, "we");
        ck_assert_ptr_nonnull(f);
        fclose(f);
        ck_assert_int_lt(epd_gpu_register_memory(c, g, 0, own->base, own->size, &region), 0);
        ck_assert_msg(strcmp(epd_last_error_name(c), "org.epd1.Error.NoSpace") == 0, "%s: %s",
                      epd_last_error_name(c), epd_last_error_message(c));
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), strerror(ENOMEM)));
        ck_assert_int_eq(unlink(no_room), 0);
        /* Nothing was held: 32 registrations still fit. */
        uint32_t regions[32];
        for (int i = 0; i < 32; i++)
                ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base, own->size, &regions[i]), 0);
        for (int i = 0; i < 32; i++)
                ck_assert_int_eq(epd_gpu_release_memory(c, regions[i]), 0);
        epd_gpu_close(g);
        gpu_arena_unref(own);
        epd_disconnect(c);
}
END_TEST

/* A worker's own memory is not a request for the daemon's: MaxRequestSize= (1 GiB by
 * default) does not bound it, or no KV cache over 1 GiB could be registered (review). */
START_TEST(test_register_memory_over_max_request) {
        ck_assert_int_eq(harness_restart(&h, CONFIG "[Limits]\nMaxRequestSize=1M\n", address, sizeof address), 0);
        epd_client *c = worker("decode");
        GpuArena *own = NULL;
        EpdGpu *g = NULL;
        uint32_t region;
        ck_assert_int_eq(gpu_arena_new(sys, 0, 4 << 20, &own), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        ck_assert_msg(epd_gpu_register_memory(c, g, 0, own->base, own->size, &region) == 0, "%s",
                      epd_last_error_message(c));
        ck_assert_int_eq(epd_gpu_release_memory(c, region), 0);
        epd_gpu_close(g);
        gpu_arena_unref(own);
        epd_disconnect(c);
}
END_TEST

/* The daemon asks the driver where a worker's memory lives and refuses a GPU named
 * wrongly (its copies would run on the wrong device's engines, through peer access or
 * not at all). Two fake GPUs here; a real host needs two. */
START_TEST(test_memory_of_another_gpu) {
        if (sys->n_devices < 2) {
                printf("one GPU: nothing to name wrongly\n");
                return;
        }
        epd_client *c = worker("decode");
        GpuArena *own = NULL;
        EpdGpu *g = NULL;
        uint32_t region;
        ck_assert_int_eq(gpu_arena_new(sys, 1, 4 << 20, &own), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        ck_assert_int_eq(epd_gpu_register_memory(c, g, 0, own->base, own->size, &region), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        printf("refused: %s\n", epd_last_error_message(c));
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), sys->devices[0].pci_bus_id));
        ck_assert_int_eq(epd_gpu_register_memory(c, g, 1, own->base, own->size, &region), 0);
        ck_assert_int_eq(epd_gpu_release_memory(c, region), 0);
        epd_gpu_close(g);
        gpu_arena_unref(own);
        epd_disconnect(c);
}
END_TEST

static void setup_two_gpus(void) {
        choose_driver();
        if (fake)
                ck_assert_int_eq(setenv("FAKE_CUDA_DEVICES", "2", 1), 0);
        start("0");
}

static void teardown_two_gpus(void) {
        teardown();
        ck_assert_int_eq(unsetenv("FAKE_CUDA_DEVICES"), 0);
}

/* ---- to another host ---- */

static Harness hb;
static char address_b[512], keyfile[256];

static void two_conf(size_t i, unsigned port, char *buf, size_t size, void *userdata) {
        if (i == 0)
                snprintf(buf, size,
                         CONFIG "[Cluster]\nListen=127.0.0.1:%u\nClusterKeyFile=%s\nHeartbeatInterval=2s\n"
                                "[Peer:bravo]\nAddress=127.0.0.1:%u\nHostId=bravo\n"
                                "[Backpressure]\nWindowHandoffs=0\n", /* test_staging_slots: 256 at once */
                         port, keyfile, port + 1);
        else
                snprintf(buf, size,
                         "[Daemon]\nHostId=bravo\n[Arena:kv0]\nSize=32M\n"
                         "[Cluster]\nListen=127.0.0.1:%u\nClusterKeyFile=%s\nHeartbeatInterval=2s\n"
                         "[Peer:alpha]\nAddress=127.0.0.1:%u\nHostId=alpha\n",
                         port + 1, keyfile, port);
}

/* alpha and bravo name each other's ports: harness_start_cluster() retries a pair of
 * ports another process took meanwhile (tests run in parallel). */
static void start_two(const char *fail_copies) {
        choose_driver();
        /* In the run's directory, which goes at the end even when a test fails before
         * its teardown (check-main.h). */
        const char *run = getenv("EPD_TEST_RUN_DIR");
        snprintf(keyfile, sizeof keyfile, "%s/epd-gpu-handoff-key-%d", run ? run : "/tmp", (int)getpid());
        int fd = open(keyfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, "gpu-handoff-test-cluster-key-0123456789\n", 40), 40);
        close(fd);
        if (fake)
                ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", fail_copies, 1), 0);
        Harness *both[2] = { &h, &hb };
        int r = harness_start_cluster(both, 2, two_conf, NULL);
        if (r < 0)
                unlink(keyfile);
        ck_assert_msg(r == 0, "cannot start the two daemons: %s", strerror(-r));
        harness_direct_address(&h, address, sizeof address);
        harness_direct_address(&hb, address_b, sizeof address_b);
        if (fake)
                ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", "0", 1), 0);
        if (!sys) {
                ck_assert_int_eq(gpu_system_open(getenv("EPD_LIBCUDA"), &sys), 0);
                ck_assert_int_eq(gpu_device_make_current(sys, &sys->devices[0]), 0);
        }
}

static void setup_two(void) {
        start_two("0");
}

static void setup_two_failing(void) {
        start_two("1");
}

static void teardown_two(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        ck_assert_int_eq(harness_stop_epdd(&hb), 0);
        harness_done(&h);
        harness_done(&hb);
        unlink(keyfile);
}

static epd_client *worker_at(const char *addr, const char *role) {
        epd_client *c = NULL;
        ck_assert_int_eq(epd_connect(addr, &c), 0);
        ck_assert_int_eq(epd_register(c, role, "model", "cuda:0", &kv, NULL), 0);
        return c;
}

/* Prepare to bravo, retrying while the peers are still connecting. */
static int prepare_remote(epd_client *c, const char *r_id, const char *seq, char **path, uint64_t *token) {
        int r = -EHOSTUNREACH;
        for (int i = 0; i < 500; i++) {
                r = epd_handoff_prepare(c, r_id, "bravo", seq, groups4, 4, NULL, path, token);
                if (r != -EHOSTUNREACH)
                        break;
                usleep(20000);
        }
        return r;
}

START_TEST(test_gpu_to_other_host) {
        epd_client *p = worker("prefill"), *d = worker_at(address_b, "decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "gpu0", N_PAGES, src);
        Mem ms = map_arena(p, "gpu0"), md = map_arena(d, "kv0");

        for (unsigned round = 0; round < 2; round++) {
                unsigned id = 10 + round;
                fill_pages(&ms, src, N_PAGES, id);
                char *path = NULL;
                uint64_t token;
                int r = prepare_remote(p, rid(id), seq, &path, &token);
                ck_assert_msg(r == 0, "Prepare to bravo: %s", epd_last_error_message(p));
                epd_handoff_accepted acc;
                ck_assert_int_eq(epd_handoff_accept(d, rid(id), &acc), 0);
                ck_assert_uint_eq(acc.n_pages, N_PAGES);
                for (uint32_t g = 0; g < 4; g++) {
                        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
                        epd_handoff_status st = {};
                        for (int i = 0; i < 1000 && st.groups_done < g + 1; i++) {
                                ck_assert_int_eq(epd_handoff_get(d, acc.path, &st), 0);
                                ck_assert_uint_le(st.groups_done, g + 1);
                                if (st.groups_done < g + 1)
                                        usleep(5000);
                        }
                        ck_assert_uint_eq(st.groups_done, g + 1);
                        ck_assert(layers_equal(&md, acc.offsets, N_PAGES, 0, 2 * (g + 1), id));
                        if (g < 3)
                                ck_assert(!layers_equal(&md, acc.offsets, N_PAGES, 2 * (g + 1), 2, id));
                }
                char *dseq = NULL;
                ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
                wait_state(p, path, "committed");
                /* Committed: its staging buffer is idle again before the owner releases
                 * the handoff (one buffer, reused by the second round). */
                ck_assert_uint_eq(counter(p, "staging-buffers"), 1);
                ck_assert_uint_eq(counter(p, "staging-busy"), 0);
                ck_assert_int_eq(epd_handoff_release(p, path), 0);
                ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
                release_sequence(d, dseq);
                ck_assert_uint_eq(arena_live(d, "kv0"), 0);
                ck_assert_uint_eq(counter(p, "writes-in-flight"), 0);
                free(dseq);
                free(path);
                epd_handoff_accepted_done(&acc);
        }
        ck_assert_uint_eq(counter(p, "committed"), 2);
        ck_assert_uint_eq(counter(p, "bytes"), 2ULL * N_PAGES * PAGE_SIZE); /* staging copies count none */
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "gpu0"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        printf("handoff gpu0 -> bravo (staged through host memory): 2 x %u pages, exact bytes\n", N_PAGES);
        free(seq);
        unmap_arena(&ms);
        unmap_arena(&md);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* Staged groups past the bound of writes in flight to a peer (65536) wait for room, in
 * group order, instead of failing the handoff: a handoff of GPU pages to bravo, 2300
 * pages of 8 KiB in 32 one-layer groups of 256 bytes all ready at Prepare (73600 peer
 * writes, a page a group), bravo stopped for a moment once it answered the Prepare (no
 * acknowledgement comes back while alpha stages and sends), lands with exact bytes and
 * leaves nothing behind. It was rolled back (transfer-failed) at the first staged group
 * that did not fit. (Under ASan bravo takes seconds over that many writes once it runs
 * again: the pair's heartbeat bound is 4 x 2 s, not 4 x 500 ms, for it.) */
START_TEST(test_staged_writes_wait_for_room) {
        enum { G = 32, N = 2300, PAGE = 8192 };
        static const epd_kv_layout kv32 = { .layers = G, .tokens_per_block = 1, .k_bytes_per_token = 128,
                                            .v_bytes_per_token = 128, .dtype = "bfloat16" };
        const char *rid_s = "000000000000000000000000000005a1";
        uint32_t groups[G];
        for (uint32_t g = 0; g < G; g++)
                groups[g] = 1;
        epd_client *p = NULL, *d = NULL;
        ck_assert_int_eq(epd_connect(address, &p), 0);
        ck_assert_int_eq(epd_register(p, "prefill", "model", "cuda:0", &kv32, NULL), 0);
        ck_assert_int_eq(epd_connect(address_b, &d), 0);
        ck_assert_int_eq(epd_register(d, "decode", "model", "cuda:0", &kv32, NULL), 0);
        Mem ms = map_arena(p, "gpu0"), md = map_arena(d, "kv0");
        static uint64_t src[N];
        static uint8_t page[PAGE];
        char *path = NULL;
        uint64_t token;
        epd_handoff_options o = { .ready = G };
        char *seq = make_sequence(p, "gpu0", N, src);
        for (uint32_t pg = 0; pg < N; pg++) {
                for (uint32_t b = 0; b < PAGE; b++)
                        page[b] = pattern(70, pg, 0, b);
                mem_write(&ms, src[pg], page, PAGE);
        }
        int r = -EHOSTUNREACH;
        for (int i = 0; i < 500 && r == -EHOSTUNREACH; i++)
                if ((r = epd_handoff_prepare(p, rid_s, "bravo", seq, groups, G, &o, &path, &token)) == -EHOSTUNREACH)
                        usleep(20000);
        ck_assert_int_eq(kill(hb.epdd_pid, SIGSTOP), 0);
        ck_assert_msg(r == 0, "Prepare to bravo: %s", epd_last_error_message(p));
        /* bravo held up until the source's writes reach the bound (posted 8192 a
         * dispatch at most, they may take longer than a fixed pause under ASan), at
         * most 3 s: well within the heartbeat bound (4 x 2 s). bravo may have taken
         * some before it stopped (1812 of them once, when this was 67200 writes, and
         * the bound was never reached): 8064 past the bound. */
        for (int i = 0; i < 150 && counter(p, "write-stalls") == 0; i++)
                usleep(20000);
        ck_assert_int_eq(kill(hb.epdd_pid, SIGCONT), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid_s, &acc), 0);
        ck_assert_uint_eq(acc.n_pages, N);
        wait_state(d, acc.path, "transferred");
        size_t bad = 0;
        for (uint32_t pg = 0; pg < N; pg++) {
                mem_read(&md, acc.offsets[pg], page, PAGE);
                for (uint32_t b = 0; b < PAGE; b++)
                        bad += page[b] != pattern(70, pg, 0, b);
        }
        ck_assert_msg(bad == 0, "%zu bytes differ", bad);
        char *dseq = NULL;
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        wait_state(p, path, "committed");
        ck_assert_uint_gt(counter(p, "write-stalls"), 0);
        /* 2300 writes a group: the staged groups' posts, 8192 a dispatch at most. */
        ck_assert_uint_gt(counter(p, "post-yields"), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        release_sequence(d, dseq);
        release_sequence(p, seq);
        ck_assert_uint_eq(counter(p, "writes-in-flight"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        ck_assert_uint_eq(arena_live(p, "gpu0"), 0);
        ck_assert_uint_eq(arena_live(d, "kv0"), 0);
        epd_handoff_accepted_done(&acc);
        free(dseq);
        free(path);
        free(seq);
        unmap_arena(&ms);
        unmap_arena(&md);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* Staging slots (HANDOFF_STAGING_MAX) all taken by idle buffers too small for the
 * next handoff: one of them gives its slot up, instead of NoSpace until a restart. And
 * a rolled-back handoff's buffer is idle at once, not when its owner releases it. */
START_TEST(test_staging_slots) {
        epd_client *p = worker("prefill"), *d = worker_at(address_b, "decode");
        uint64_t src[64];
        char *one = make_sequence(p, "gpu0", 1, src);
        static char *paths[HANDOFF_STAGING_MAX];
        for (unsigned i = 0; i < HANDOFF_STAGING_MAX; i++) {
                uint64_t token;
                int r = prepare_remote(p, rid(1000 + i), one, &paths[i], &token);
                ck_assert_msg(r == 0, "Prepare %u to bravo: %s", i, epd_last_error_message(p));
        }
        ck_assert_uint_eq(counter(p, "staging-buffers"), HANDOFF_STAGING_MAX);
        ck_assert_uint_eq(counter(p, "staging-busy"), HANDOFF_STAGING_MAX);
        for (unsigned i = 0; i < HANDOFF_STAGING_MAX; i++) {
                ck_assert_int_eq(epd_handoff_rollback(p, paths[i]), 0);
                wait_state(p, paths[i], "rolled-back");
        }
        ck_assert_uint_eq(counter(p, "staging-busy"), 0);
        /* 40 pages of 64 KiB: more than any idle buffer (2 MiB) holds. */
        char *big = make_sequence(p, "gpu0", 40, src);
        char *path = NULL;
        uint64_t token;
        int r = prepare_remote(p, rid(2000), big, &path, &token);
        ck_assert_msg(r == 0, "Prepare with every staging slot idle: %s", epd_last_error_message(p));
        ck_assert_uint_eq(counter(p, "staging-buffers"), HANDOFF_STAGING_MAX);
        ck_assert_uint_eq(counter(p, "staging-busy"), 1);
        ck_assert_int_eq(epd_handoff_rollback(p, path), 0);
        wait_state(p, path, "rolled-back");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        for (unsigned i = 0; i < HANDOFF_STAGING_MAX; i++) {
                ck_assert_int_eq(epd_handoff_release(p, paths[i]), 0);
                free(paths[i]);
        }
        release_sequence(p, one);
        release_sequence(p, big);
        ck_assert_uint_eq(counter(p, "live"), 0);
        ck_assert_uint_eq(arena_live(p, "gpu0"), 0);
        free(path);
        free(one);
        free(big);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* The staging copies fail (fake driver): both sides roll back, nothing is retained. */
START_TEST(test_gpu_to_other_host_fails) {
        if (!fake) {
                printf("copy failure injection needs the fake driver: skipped on a real GPU\n");
                return;
        }
        epd_client *p = worker("prefill"), *d = worker_at(address_b, "decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "gpu0", N_PAGES, src);
        char *path = NULL;
        uint64_t token;
        ck_assert_int_eq(prepare_remote(p, rid(20), seq, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(20), &acc), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 0), 0);
        wait_state(p, path, "rolled-back");
        wait_state(d, acc.path, "rolled-back");
        epd_handoff_status st;
        ck_assert_int_eq(epd_handoff_get(p, path, &st), 0);
        ck_assert_str_eq(st.cause, "transfer-failed");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_uint_eq(arena_live(d, "kv0"), 0);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "gpu0"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        ck_assert_uint_eq(counter(p, "writes-in-flight"), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

static Suite *suite(void) {
        Suite *s = suite_create("gpu-handoff");
        TCase *tc = tcase_create("handoff");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_gpu_to_gpu);
        tcase_add_test(tc, test_gpu_to_host);
        tcase_add_test(tc, test_host_to_gpu);
        tcase_add_test(tc, test_decode_dies);
        tcase_add_test(tc, test_gpu_pages_wait_for_the_process);
        tcase_add_test(tc, test_departing_encoder_fails_its_features_at_once);
        tcase_add_test(tc, test_gpu_feature_arena_no_stale_error);
        tcase_add_test(tc, test_departing_gpu_client_on_the_bus);
        tcase_add_test(tc, test_departed_worker_not_counted);
        tcase_add_test(tc, test_register_memory_over_max_request);
        tcase_add_test(tc, test_register_memory_no_room);
        tcase_add_test(tc, test_cow);
        tcase_add_test(tc, test_notifier);
        tcase_add_test(tc, test_sliced_batches);
        tcase_set_timeout(tc, 120);
        suite_add_tcase(s, tc);
        TCase *ts = tcase_create("slow-copies");
        tcase_add_checked_fixture(ts, setup_slow_copies, teardown);
        tcase_add_test(ts, test_cow_off_loop);
        tcase_add_test(ts, test_queued_groups_go_together);
        tcase_add_test(ts, test_cow_shared_while_copying);
        tcase_add_test(ts, test_cow_truncated_while_copying);
        tcase_add_test(ts, test_cow_later_round_no_space);
        tcase_add_test(ts, test_loop_stall_named);
        tcase_add_test(ts, test_unregister_releases_memory);
        tcase_set_timeout(ts, 120);
        suite_add_tcase(s, ts);
        TCase *t2 = tcase_create("two-gpus");
        tcase_add_checked_fixture(t2, setup_two_gpus, teardown_two_gpus);
        tcase_add_test(t2, test_memory_of_another_gpu);
        suite_add_tcase(s, t2);
        TCase *tq = tcase_create("slow-submissions");
        tcase_add_checked_fixture(tq, setup_slow_submissions, teardown);
        tcase_add_test(tq, test_landed_before_next_batch);
        tcase_set_timeout(tq, 120);
        suite_add_tcase(s, tq);

        TCase *tf = tcase_create("failing-copies");
        tcase_add_checked_fixture(tf, setup_failing, teardown);
        tcase_add_test(tf, test_copy_fails);
        tcase_add_test(tf, test_copy_fails_unaccepted);
        tcase_add_test(tf, test_cow_copy_fails);
        tcase_set_timeout(tf, 120);
        suite_add_tcase(s, tf);
        const struct {
                const char *name;
                void (*setup)(void);
        } refused[] = { { "first-copy-invalid", setup_first_copy_invalid },
                        { "first-copy-no-resources", setup_first_copy_no_resources },
                        { "first-copy-not-found", setup_first_copy_not_found } };
        for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
                TCase *t = tcase_create(refused[i].name);
                tcase_add_checked_fixture(t, refused[i].setup, teardown);
                tcase_add_test(t, test_cow_first_copy_refused);
                tcase_set_timeout(t, 120);
                suite_add_tcase(s, t);
        }
        TCase *tl = tcase_create("second-copy-refused");
        tcase_add_checked_fixture(tl, setup_second_copy_refused, teardown);
        tcase_add_test(tl, test_cow_later_round_fails);
        tcase_add_test(tl, test_later_slice_refused);
        tcase_set_timeout(tl, 120);
        suite_add_tcase(s, tl);
        TCase *tr = tcase_create("other-host");
        tcase_add_checked_fixture(tr, setup_two, teardown_two);
        tcase_add_test(tr, test_gpu_to_other_host);
        tcase_add_test(tr, test_staging_slots);
        tcase_add_test(tr, test_staged_writes_wait_for_room);
        tcase_set_timeout(tr, 120);
        suite_add_tcase(s, tr);
        TCase *trf = tcase_create("other-host-failing-copies");
        tcase_add_checked_fixture(trf, setup_two_failing, teardown_two);
        tcase_add_test(trf, test_gpu_to_other_host_fails);
        tcase_set_timeout(trf, 120);
        suite_add_tcase(s, trf);
        return s;
}

int main(void) {
        /* Before check forks a child per test: this process never starts CUDA. */
        choose_driver();
        return check_run(suite(), CK_FORK_GETENV);
}
