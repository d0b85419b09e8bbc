/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Layered handoffs within one epdd: a prefill client and a decode client of the same
 * daemon. Between two host arenas (bytes exact, groups in order), within one arena (the
 * pages handed over, zero bytes copied), over the ring, and the failures: the decode
 * worker dies, a handoff times out, admission says NoSpace, illegal calls get named
 * errors; after each, no page stays allocated. The live introspection matches dbus/. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epd-internal.h"
#include "epd/epd-telemetry.h"
#include "epd/handoff.h"
#include "harness.h"
#include "test-sequence-util.h"
#include "time-util.h"
#include "../check-main.h"

#define LAYERS 8
#define TOKENS 16
#define KV_BYTES 256
#define LAYER_BYTES (TOKENS * 2 * KV_BYTES) /* 8 KiB: K and V of one layer */
#define PAGE_SIZE (LAYERS * LAYER_BYTES)    /* 64 KiB */
#define N_PAGES 16

static Harness h;
static char address[512];
static const epd_kv_layout kv = { .layers = LAYERS, .tokens_per_block = TOKENS, .k_bytes_per_token = KV_BYTES,
                                  .v_bytes_per_token = KV_BYTES, .dtype = "bfloat16" };
static const uint32_t groups4[4] = { 2, 2, 2, 2 };

static void setup(void) {
        ck_assert_int_eq(harness_init(&h, "[Daemon]\nHostId=alpha\n"
                                          "[Arena:kv0]\nSize=64M\n"
                                          "[Arena:kv1]\nSize=16M\n"), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
}

static void teardown(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}

static epd_client *worker(const char *role) {
        epd_client *c = NULL;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, role, "model", "cpu", &kv, NULL), 0);
        return c;
}

/* A sequence of n pages in `arena`; its page offsets go to offs[]. */
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
        if (offs)
                sequence_offsets(c, p, offs, n);
        return p;
}

static void release_sequence(epd_client *c, const char *path) {
        ck_assert_int_eq(epd__call(c, path, "org.epd1.Sequence", "Release", NULL, NULL), 0);
}

static void *arena_base(epd_client *c, const char *name) {
        int i = epd_arena_find(c, name);
        ck_assert_int_ge(i, 0);
        void *base;
        ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
        return base;
}

static uint8_t pattern(uint32_t page, uint32_t layer, uint32_t k) {
        return (uint8_t)(page * 31 + layer * 7 + k * 13 + 1);
}

static void fill_pages(uint8_t *base, const uint64_t *offs, uint32_t n) {
        for (uint32_t p = 0; p < n; p++)
                for (uint32_t l = 0; l < LAYERS; l++)
                        for (uint32_t k = 0; k < LAYER_BYTES; k++)
                                base[offs[p] + (uint64_t)l * LAYER_BYTES + k] = pattern(p, l, k);
}

static bool layers_equal(const uint8_t *base, const uint64_t *offs, uint32_t n, uint32_t first, uint32_t count) {
        for (uint32_t p = 0; p < n; p++)
                for (uint32_t l = first; l < first + count; l++)
                        for (uint32_t k = 0; k < LAYER_BYTES; k++)
                                if (base[offs[p] + (uint64_t)l * LAYER_BYTES + k] != pattern(p, l, k))
                                        return false;
        return true;
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

static uint64_t counter(epd_client *c, const char *name) {
        return harness_handoff_counter(c->bus, name);
}

/* Handoffs.Paths: the row of (peer, transport), its counts and its duration histogram. */
typedef struct PathRow {
        uint64_t out, in, failed, bytes_out, bytes_in, sum_usec, count;
} PathRow;

static bool path_row(epd_client *c, const char *peer, const char *transport, PathRow *ret) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        bool found = false;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, "/org/epd1/handoffs", "org.epd1.Handoffs", "Paths", &e, &reply,
                                             "a(ssttttttat)"),
                         0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(ssttttttat)"), 0);
        while (sd_bus_message_enter_container(reply, 'r', "ssttttttat") > 0) {
                const char *p, *t;
                PathRow r = {};
                const uint64_t *counts;
                size_t size;
                ck_assert_int_ge(sd_bus_message_read(reply, "sstttttt", &p, &t, &r.out, &r.in, &r.failed, &r.bytes_out,
                                                     &r.bytes_in, &r.sum_usec),
                                 0);
                ck_assert_int_ge(sd_bus_message_read_array(reply, 't', (const void **)&counts, &size), 0);
                ck_assert_uint_eq(size, 19 * sizeof(uint64_t)); /* HISTOGRAM_BUCKETS + 1 */
                for (size_t i = 0; i < size / sizeof(uint64_t); i++)
                        r.count += counts[i];
                ck_assert_int_ge(sd_bus_message_exit_container(reply), 0);
                if (strcmp(p, peer) == 0 && strcmp(t, transport) == 0) {
                        *ret = r;
                        found = true;
                }
        }
        sd_bus_message_unref(reply);
        return found;
}

static void status(epd_client *c, const char *path, epd_handoff_status *s) {
        ck_assert_int_eq(epd_handoff_get(c, path, s), 0);
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

static bool kv1_free(void *userdata) {
        return arena_live(userdata, "kv1") == 0;
}

static void wait_state(epd_client *c, const char *path, const char *state) {
        WaitState w = { c, path, state };
        ck_assert_msg(harness_wait_for(state_is, &w, 5000), "%s never became %s", path, state);
}

static const char *rid(unsigned n) {
        static char buf[8][33];
        static unsigned i;
        char *b = buf[i++ % 8];
        snprintf(b, 33, "%032x", n + 1);
        return b;
}

START_TEST(test_two_arenas) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "kv0", N_PAGES, src);
        uint8_t *pbase = arena_base(p, "kv0");
        uint8_t *dbase = arena_base(d, "kv1");
        fill_pages(pbase, src, N_PAGES);
        uint64_t live1 = arena_live(p, "kv1");

        char *path = NULL;
        uint64_t token = 0, token2 = 0;
        epd_handoff_options o = { .arena = "kv1" };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(1), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_uint_gt(token, 0);
        /* Idempotent: the same request again is the same handoff. */
        char *again = NULL;
        ck_assert_int_eq(epd_handoff_prepare(p, rid(1), NULL, seq, groups4, 4, &o, &again, &token2), 0);
        ck_assert_str_eq(again, path);
        ck_assert_uint_eq(token2, token);
        free(again);
        ck_assert_uint_eq(arena_live(p, "kv1"), live1 + N_PAGES); /* reserved */

        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(1), &acc), 0);
        ck_assert_str_eq(acc.arena, "kv1");
        ck_assert_uint_eq(acc.n_pages, N_PAGES);
        ck_assert_uint_eq(acc.n_groups, 4);
        ck_assert_uint_eq(acc.token, token);
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, NULL), -EBUSY); /* nothing arrived */
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 1), -EINVAL); /* out of order */
        ck_assert_int_eq(epd_handoff_layer_group_ready(d, path, 0), -EPERM);  /* not the owner */

        for (uint32_t g = 0; g < 4; g++) {
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0); /* idempotent */
                epd_handoff_status s;
                for (int i = 0; i < 500; i++) {
                        status(d, acc.path, &s);
                        ck_assert_uint_le(s.groups_done, g + 1); /* never ahead of the prefill */
                        if (s.groups_done == g + 1)
                                break;
                        usleep(10000);
                }
                ck_assert_uint_eq(s.groups_done, g + 1);
                /* Exactly the layers of groups 0..g have landed. */
                ck_assert(layers_equal(dbase, acc.offsets, N_PAGES, 0, 2 * (g + 1)));
                if (g < 3)
                        ck_assert(!layers_equal(dbase, acc.offsets, N_PAGES, 2 * (g + 1), 2));
        }
        char *dseq = NULL, *dseq2 = NULL;
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq2), 0); /* idempotent */
        ck_assert_str_eq(dseq, dseq2);
        wait_state(p, path, "committed");
        ck_assert_int_eq(epd_handoff_rollback(p, path), -EBUSY);
        epd_handoff_status s;
        status(d, acc.path, &s);
        ck_assert_uint_eq(s.bytes, (uint64_t)N_PAGES * PAGE_SIZE);
        ck_assert_uint_eq(counter(p, "committed"), 1);
        ck_assert_uint_eq(counter(p, "bytes"), (uint64_t)N_PAGES * PAGE_SIZE);
        /* Per path: once, as the source counts it, with its duration. */
        PathRow row;
        ck_assert(path_row(p, "local", "local", &row));
        ck_assert_uint_eq(row.out, 1);
        ck_assert_uint_eq(row.in, 0);
        ck_assert_uint_eq(row.failed, 0);
        ck_assert_uint_eq(row.bytes_out, (uint64_t)N_PAGES * PAGE_SIZE);
        ck_assert_uint_eq(row.count, 1);
        ck_assert_uint_gt(row.sum_usec, 0);

        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_lt(epd_handoff_release(d, acc.path), 0); /* gone: no such object */

        /* The request's trace (epdctl trace): prepare, every group sent and received
         * with its bytes and transport, commit and release, in order. */
        epd_trace_event *ev = NULL;
        size_t n_ev = 0;
        ck_assert_int_eq(epd_trace_get(p, rid(1), &ev, &n_ev, NULL), 0);
        unsigned n_sent = 0, n_received = 0, n_commit = 0, n_release = 0, n_prepare = 0, n_ready = 0;
        uint64_t sent_bytes = 0;
        for (size_t i = 0; i < n_ev; i++) {
                if (i > 0)
                        ck_assert_uint_ge(ev[i].ts_usec, ev[0].ts_usec);
                if (strcmp(ev[i].type, "handoff-prepare") == 0)
                        n_prepare++;
                else if (strcmp(ev[i].type, "group-ready") == 0) {
                        /* The first group's (the repeated LayerGroupReady is not an
                         * event), before it is sent; with the group's bytes. */
                        ck_assert_int_eq(ev[i].group, 0);
                        ck_assert_uint_eq(n_sent, 0);
                        ck_assert_uint_eq(ev[i].bytes, (uint64_t)N_PAGES * PAGE_SIZE / 4);
                        n_ready++;
                } else if (strcmp(ev[i].type, "group-sent") == 0) {
                        ck_assert_int_eq(ev[i].group, (int32_t)n_sent);
                        ck_assert_uint_eq(n_ready, 1);
                        /* The time from its LayerGroupReady to its landing: the test
                         * waited for each group before readying the next. */
                        ck_assert_uint_lt(ev[i].duration_usec, 5 * 1000000ULL);
                        ck_assert_str_eq(ev[i].transport, "local");
                        sent_bytes += ev[i].bytes;
                        n_sent++;
                } else if (strcmp(ev[i].type, "group-received") == 0)
                        n_received++;
                else if (strcmp(ev[i].type, "commit") == 0)
                        n_commit++;
                else if (strcmp(ev[i].type, "release") == 0)
                        n_release++;
        }
        ck_assert_uint_eq(n_prepare, 2); /* source and destination */
        ck_assert_uint_eq(n_ready, 1);
        ck_assert_uint_eq(n_sent, 4);
        ck_assert_uint_eq(n_received, 4);
        ck_assert_uint_eq(sent_bytes, (uint64_t)N_PAGES * PAGE_SIZE);
        ck_assert_uint_ge(n_commit, 1);
        ck_assert_uint_eq(n_release, 2);
        ck_assert_str_eq(ev[0].type, "handoff-prepare");
        free(ev);
        /* The decode sequence holds the pages; releasing it frees them. */
        ck_assert_uint_eq(arena_live(p, "kv1"), live1 + N_PAGES);
        release_sequence(d, dseq);
        ck_assert_uint_eq(arena_live(p, "kv1"), live1);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "kv0"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        free(dseq);
        free(dseq2);
        free(path);
        free(seq);
        epd_handoff_accepted_done(&acc);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

START_TEST(test_same_arena_zero_copy) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "kv0", N_PAGES, src);
        uint64_t live0 = arena_live(p, "kv0");
        char *path;
        uint64_t token;
        ck_assert_int_eq(epd_handoff_prepare(p, rid(2), "alpha", seq, groups4, 4, NULL, &path, &token), 0);
        ck_assert_uint_eq(arena_live(p, "kv0"), live0); /* nothing allocated */
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(2), &acc), 0);
        ck_assert_uint_eq(acc.groups_done, 4);
        for (size_t i = 0; i < N_PAGES; i++)
                ck_assert_uint_eq(acc.offsets[i], src[i]); /* the very same pages */
        char *dseq;
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        epd_handoff_status s;
        status(d, acc.path, &s);
        ck_assert_uint_eq(s.bytes, 0);
        ck_assert_uint_eq(counter(p, "bytes"), 0);
        ck_assert_uint_eq(counter(p, "zero-copy-groups"), 4);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "kv0"), N_PAGES); /* now the decode sequence's */
        release_sequence(d, dseq);
        ck_assert_uint_eq(arena_live(p, "kv0"), 0);
        free(dseq);
        free(path);
        free(seq);
        epd_handoff_accepted_done(&acc);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* Handoff signals reach only whom they concern: a client that called Watch(true), and the
 * owner without a ring; neither the owner with a ring nor a bystander. */
typedef struct SignalCount {
        unsigned state, progress;
} SignalCount;

static int on_handoff_signal(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        SignalCount *n = userdata;
        if (sd_bus_message_is_signal(m, "org.epd1.Handoff", "StateChanged"))
                n->state++;
        else if (sd_bus_message_is_signal(m, "org.epd1.Handoff", "Progress"))
                n->progress++;
        return 0;
}

static void count_signals(epd_client *c, SignalCount *n) {
        ck_assert_int_ge(sd_bus_match_signal(c->bus, NULL, NULL, NULL, "org.epd1.Handoff", NULL, on_handoff_signal, n),
                         0);
}

static void drain(epd_client *const *cs, size_t n) {
        /* Signals were sent before the replies the test waited for: what is queued is all. */
        for (int round = 0; round < 20; round++)
                for (size_t i = 0; i < n; i++) {
                        while (sd_bus_process(cs[i]->bus, NULL) > 0)
                                ;
                        (void)sd_bus_wait(cs[i]->bus, 5000);
                }
}

START_TEST(test_watch_signals) {
        epd_client *p = worker("prefill"), *d = worker("decode"), *w = NULL, *x = NULL;
        ck_assert_int_eq(epd_connect(address, &w), 0);
        ck_assert_int_eq(epd_connect(address, &x), 0);
        SignalCount np = {}, nd = {}, nw = {}, nx = {};
        count_signals(p, &np);
        count_signals(d, &nd);
        count_signals(w, &nw);
        count_signals(x, &nx);
        ck_assert_int_eq(epd_handoff_watch(w, true), 0);
        ck_assert_int_eq(epd_handoff_watch(w, true), 0); /* a repeat */
        epd_ring_client *dr = NULL;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);

        char *seq = make_sequence(p, "kv0", N_PAGES, NULL), *path, *dseq;
        uint64_t token;
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_prepare(p, rid(40), "alpha", seq, groups4, 4, NULL, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_accept(d, rid(40), &acc), 0);
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        wait_state(d, acc.path, "transferred");
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        wait_state(p, path, "committed");
        epd_client *all[] = { p, d, w, x };
        drain(all, 4);
        /* The watcher saw both sides' states and the destination's progress; the owner
         * without a ring (the prefill) its own states; the decode worker, whose ring took
         * every record, and the bystander nothing. */
        ck_assert_msg(nw.state >= 4 && nw.progress >= 1, "watcher: %u states, %u progress", nw.state, nw.progress);
        ck_assert_msg(np.state >= 2, "owner without a ring: %u states", np.state);
        ck_assert_msg(nd.state == 0 && nd.progress == 0, "owner with a ring: %u states, %u progress", nd.state,
                      nd.progress);
        ck_assert_msg(nx.state == 0 && nx.progress == 0, "bystander: %u states, %u progress", nx.state, nx.progress);

        /* Watch(false): no more. */
        ck_assert_int_eq(epd_handoff_watch(w, false), 0);
        unsigned before = nw.state;
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        drain(all, 4);
        ck_assert_uint_eq(nw.state, before);
        ck_assert_uint_eq(nx.state, 0);
        release_sequence(d, dseq);
        release_sequence(p, seq);
        free(dseq);
        free(path);
        free(seq);
        epd_handoff_accepted_done(&acc);
        epd_ring_close(dr);
        epd_disconnect(w);
        epd_disconnect(x);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* release_on_commit and CommitAndRelease: the source side goes by itself once the
 * destination commits (its ring hears "committed"), the destination's in the Commit
 * call; the decode sequence stays its caller's. No Release call on either side. */
START_TEST(test_commit_and_release) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "kv0", N_PAGES, src);
        fill_pages(arena_base(p, "kv0"), src, N_PAGES);
        uint64_t live1 = arena_live(p, "kv1");
        epd_ring_client *pr;
        ck_assert_int_eq(epd_ring_open(p, 64, 64, &pr), 0);

        char *path = NULL, *dseq = NULL;
        uint64_t token = 0;
        epd_handoff_options o = { .arena = "kv1", .ready = 4, .release_on_commit = true };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(7), NULL, seq, groups4, 4, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(7), &acc), 0);
        wait_state(d, acc.path, "transferred");
        ck_assert(layers_equal(arena_base(d, "kv1"), acc.offsets, N_PAGES, 0, LAYERS));
        ck_assert_uint_eq(counter(p, "live"), 2);
        ck_assert_int_eq(epd_handoff_commit_and_release(d, acc.path, &dseq), 0);
        ck_assert_ptr_nonnull(dseq);

        /* The prefill's ring says committed (the daemon released the source side in
         * the same turn: as after a Release, no record says so). */
        struct epd_ring_record out;
        bool committed = false;
        for (int i = 0; i < 64 && !committed; i++) {
                ck_assert_int_eq(epd_ring_next(pr, &out, 5000000), 0);
                committed = out.opcode == EPD_RING_EV_HANDOFF_STATE && out.arg0 == EPD_HANDOFF_STATE_COMMITTED;
        }
        ck_assert(committed);
        /* Both objects are gone; a Release now finds nothing. */
        ck_assert_uint_eq(counter(p, "live"), 0);
        ck_assert_uint_eq(counter(p, "committed"), 1);
        ck_assert_uint_eq(counter(p, "released"), 2);
        ck_assert_int_lt(epd_handoff_release(p, path), 0);
        ck_assert_int_lt(epd_handoff_release(d, acc.path), 0);
        /* The decode sequence holds the pages until its owner releases it. */
        ck_assert_uint_eq(arena_live(p, "kv1"), live1 + N_PAGES);
        release_sequence(d, dseq);
        ck_assert_uint_eq(arena_live(p, "kv1"), live1);
        release_sequence(p, seq);
        epd_ring_close(pr);
        free(dseq);
        free(path);
        free(seq);
        epd_handoff_accepted_done(&acc);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

static int on_state_committed(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        unsigned *n = userdata;
        const char *state = NULL, *cause = NULL;
        if (sd_bus_message_is_signal(m, "org.epd1.Handoff", "StateChanged") &&
            sd_bus_message_read(m, "ss", &state, &cause) >= 0 && strcmp(state, "committed") == 0)
                (*n)++;
        return 0;
}

/* release_on_commit with no ring on the prefill side: its owner hears "committed" as a
 * StateChanged signal before the daemon releases the object (it heard nothing: the
 * signal went out after the release, to nobody, the object gone and its owner unable to
 * tell a commit from a failure). */
START_TEST(test_commit_and_release_without_ring) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "kv0", N_PAGES, src);
        fill_pages(arena_base(p, "kv0"), src, N_PAGES);
        unsigned committed = 0;
        ck_assert_int_ge(sd_bus_match_signal(p->bus, NULL, NULL, NULL, "org.epd1.Handoff", "StateChanged",
                                             on_state_committed, &committed),
                         0);
        char *path = NULL, *dseq = NULL;
        uint64_t token = 0;
        epd_handoff_options o = { .arena = "kv1", .ready = 4, .release_on_commit = true };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(17), NULL, seq, groups4, 4, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(17), &acc), 0);
        wait_state(d, acc.path, "transferred");
        ck_assert_int_eq(epd_handoff_commit_and_release(d, acc.path, &dseq), 0);
        for (int i = 0; i < 50 && committed == 0; i++) {
                while (sd_bus_process(p->bus, NULL) > 0)
                        ;
                if (committed == 0)
                        (void)sd_bus_wait(p->bus, 100000);
        }
        ck_assert_uint_eq(committed, 1);
        ck_assert_uint_eq(counter(p, "live"), 0);
        release_sequence(d, dseq);
        release_sequence(p, seq);
        free(dseq);
        free(path);
        free(seq);
        epd_handoff_accepted_done(&acc);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

typedef struct Prepared {
        int calls, error;
        char path[128], error_name[128];
        uint64_t token;
} Prepared;

static void on_prepared(epd_client *c, int error, const char *path, uint64_t token, void *userdata) {
        Prepared *p = userdata;
        p->calls++;
        p->error = error;
        p->token = token;
        snprintf(p->path, sizeof p->path, "%s", path ? path : "");
        snprintf(p->error_name, sizeof p->error_name, "%s", error < 0 ? epd_last_error_name(c) : "");
}

/* Several Prepares in flight on one connection, answered through epd_flush(): each its
 * own path and token, a refusal with its name; the handoffs are as real as Prepare's. */
START_TEST(test_prepare_async) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        char *seqs[3];
        Prepared got[4] = {};
        epd_handoff_options o = { .arena = "kv1", .ready = 4, .release_on_commit = true };
        for (int i = 0; i < 3; i++) {
                seqs[i] = make_sequence(p, "kv0", N_PAGES, NULL);
                ck_assert_int_eq(epd_handoff_prepare_async(p, rid(40 + i), NULL, seqs[i], groups4, 4, &o, on_prepared,
                                                           &got[i]), 0);
        }
        ck_assert_int_eq(epd_handoff_prepare_async(p, rid(43), NULL, "/org/epd1/sequence/00000000000000000000000000000bad",
                                                   groups4, 4, &o, on_prepared, &got[3]), 0);
        ck_assert_int_eq(epd_handoff_prepare_async(p, "not-an-id", NULL, seqs[0], groups4, 4, &o, NULL, NULL), -EINVAL);
        /* epd_flush() waits for their answers and runs the callbacks. */
        ck_assert_int_eq(epd_flush(p, 5000000), 0);
        for (int i = 0; i < 3; i++) {
                ck_assert_int_eq(got[i].calls, 1);
                ck_assert_int_eq(got[i].error, 0);
                ck_assert(strncmp(got[i].path, "/org/epd1/handoff/", 18) == 0);
                ck_assert_uint_ne(got[i].token, 0);
                for (int k = 0; k < i; k++)
                        ck_assert_uint_ne(got[i].token, got[k].token);
        }
        ck_assert_int_eq(got[3].calls, 1);
        ck_assert_int_lt(got[3].error, 0);
        ck_assert_str_eq(got[3].error_name, "org.epd1.Error.NotFound");
        /* The decode side takes them as any other. */
        for (int i = 0; i < 3; i++) {
                epd_handoff_accepted acc;
                char *dseq = NULL;
                ck_assert_int_eq(epd_handoff_accept(d, rid(40 + i), &acc), 0);
                ck_assert_uint_eq(acc.token, got[i].token);
                wait_state(d, acc.path, "transferred");
                ck_assert_int_eq(epd_handoff_commit_and_release(d, acc.path, &dseq), 0);
                ck_assert_int_eq(epd_sequence_release_nowait(d, dseq), 0);
                free(dseq);
                epd_handoff_accepted_done(&acc);
        }
        ck_assert_int_eq(epd_flush(d, 5000000), 0);
        ck_assert_int_eq(epd_sequence_release_nowait(d, "/org/epd1/sequence/00000000000000000000000000000bad"), 0);
        ck_assert_int_lt(epd_flush(d, 5000000), 0); /* the refusal comes back here */
        for (int i = 0; i < 3; i++) {
                release_sequence(p, seqs[i]);
                free(seqs[i]);
        }
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A worker's own poll loop (as bench-handoff-latency --pipeline): it waits for the
 * events epd_get_events() names and until epd_get_timeout(), and calls epd_process()
 * only when the fd is ready or that time passed. Calls in flight give a deadline and
 * their answers wake the poll; with none left there is no deadline. */
START_TEST(test_own_poll_loop) {
        epd_client *p = worker("prefill");
        char *seqs[3];
        Prepared got[3] = {};
        uint64_t t;
        epd_handoff_options o = { .arena = "kv1", .ready = 4, .release_on_commit = true };

        ck_assert_int_eq(epd_get_events(NULL), -EINVAL);
        ck_assert_int_eq(epd_get_timeout(p, NULL), -EINVAL);
        ck_assert_int_eq(epd_get_timeout(p, &t), 0);
        ck_assert_uint_eq(t, UINT64_MAX); /* nothing asked: no deadline (0) */
        for (int i = 0; i < 3; i++) {
                seqs[i] = make_sequence(p, "kv0", N_PAGES, NULL);
                ck_assert_int_eq(epd_handoff_prepare_async(p, rid(60 + i), NULL, seqs[i], groups4, 4, &o, on_prepared,
                                                           &got[i]), 0);
        }
        ck_assert_int_eq(epd_get_timeout(p, &t), 1);
        ck_assert(t != UINT64_MAX); /* the calls' deadline, or 0: something read is waiting */
        int ev = epd_get_events(p);
        ck_assert_int_ge(ev, 0);
        ck_assert((ev & POLLIN) || t == 0); /* input polled for, or processing due now */

        struct timespec ts;
        uint64_t now;
        unsigned polls = 0, processed = 0;
        while (got[0].calls + got[1].calls + got[2].calls < 3) {
                ck_assert_uint_lt(polls++, 1000);
                ev = epd_get_events(p);
                ck_assert_int_ge(ev, 0);
                ck_assert_int_ge(epd_get_timeout(p, &t), 0);
                clock_gettime(CLOCK_MONOTONIC, &ts);
                now = (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
                int ms = t == UINT64_MAX ? 100 : t <= now ? 0 : (t - now) / 1000 + 1 < 100 ? (int)((t - now) / 1000 + 1) : 100;
                struct pollfd pfd = { .fd = epd_get_fd(p), .events = (short)ev };
                ck_assert_int_ge(poll(&pfd, 1, ms), 0);
                clock_gettime(CLOCK_MONOTONIC, &ts);
                now = (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
                if (pfd.revents || t <= now) {
                        ck_assert_int_ge(epd_process(p), 0);
                        processed++;
                }
        }
        ck_assert_uint_ge(processed, 1);
        for (int i = 0; i < 3; i++) {
                ck_assert_int_eq(got[i].calls, 1);
                ck_assert_int_eq(got[i].error, 0);
        }
        ck_assert_int_eq(epd_get_timeout(p, &t), 0);
        ck_assert_uint_eq(t, UINT64_MAX); /* every call answered */
        for (int i = 0; i < 3; i++) {
                ck_assert_int_eq(epd_handoff_rollback(p, got[i].path), 0);
                release_sequence(p, seqs[i]);
                free(seqs[i]);
        }
        epd_disconnect(p);
}
END_TEST

/* The answers to NOPs 0 .. n-1, in order. */
static void expect_nop_answers(epd_ring_client *r, unsigned n) {
        struct epd_ring_record out;
        for (unsigned i = 0; i < n; i++) {
                ck_assert_int_eq(epd_ring_next(r, &out, 5000000), 0);
                ck_assert_uint_eq(out.opcode, EPD_RING_EV_COMPLETION);
                ck_assert_uint_eq(out.user_data, i);
                ck_assert_int_eq(out.result, 0);
        }
}

/* More submissions than the daemon takes in one turn of its loop (4096), queued before
 * one wakeup: every one is answered (the daemon wakes itself for the rest), none waits
 * for the worker's next submission. */
START_TEST(test_ring_submissions_past_one_turn) {
        epd_client *p = worker("prefill");
        epd_ring_client *pr;
        enum { N = 5000 };
        ck_assert_int_eq(epd_ring_open(p, 8192, 8192, &pr), 0);
        struct epd_ring_record rec = { .opcode = EPD_RING_OP_NOP };
        for (unsigned i = 0; i < N - 1; i++) {
                rec.user_data = i;
                ck_assert_int_eq(epd_ring_produce(&pr->ring.sq, &rec), 0); /* no wakeup yet */
        }
        rec.user_data = N - 1;
        ck_assert_int_eq(epd_ring_submit(pr, &rec), 0); /* the one wakeup */
        expect_nop_answers(pr, N);
        epd_ring_close(pr);
        epd_disconnect(p);
}
END_TEST

/* A worker that lets its CQ fill up loses no answer: the daemon keeps what does not fit
 * and posts it once the worker drained the CQ (epd_ring_next wakes it for them). */
START_TEST(test_ring_answers_past_a_full_cq) {
        epd_client *p = worker("prefill");
        epd_ring_client *pr;
        enum { N = 20 };
        ck_assert_int_eq(epd_ring_open(p, 64, 8, &pr), 0);
        struct epd_ring_record rec = { .opcode = EPD_RING_OP_NOP };
        for (unsigned i = 0; i < N; i++) {
                rec.user_data = i;
                ck_assert_int_eq(epd_ring_submit(pr, &rec), 0);
        }
        /* Every one answered before the worker takes any: 8 in the CQ, 12 kept back. */
        for (int i = 0; i < 500 && __atomic_load_n(epd_ring_cq_backlog(&pr->ring), __ATOMIC_ACQUIRE) < N - 8; i++)
                usleep(10000);
        ck_assert_uint_eq(__atomic_load_n(epd_ring_cq_backlog(&pr->ring), __ATOMIC_ACQUIRE), N - 8);
        expect_nop_answers(pr, N);
        ck_assert_uint_eq(__atomic_load_n(pr->ring.cq_overflow, __ATOMIC_ACQUIRE), 0);
        ck_assert_uint_eq(counter(p, "ring-backlogged"), N - 8);
        ck_assert_uint_eq(counter(p, "ring-fallbacks"), 0);
        epd_ring_close(pr);
        epd_disconnect(p);
}
END_TEST

/* An answer the ring cannot take (the worker never drains its CQ: the CQ and the
 * backlog, 4 x its entries, are full) has no D-Bus form: the daemon closes the ring, so
 * the worker takes what was posted and then hears -ECONNRESET, instead of waiting for
 * ever for an answer that was dropped; its client opens another. */
START_TEST(test_ring_lost_answer_closes_it) {
        epd_client *p = worker("prefill");
        epd_ring_client *pr;
        struct epd_ring_record out;
        enum { CQ = 8, N = CQ + 4 * CQ + 1 };
        ck_assert_int_eq(epd_ring_open(p, 64, CQ, &pr), 0);
        struct epd_ring_record rec = { .opcode = EPD_RING_OP_NOP };
        for (unsigned i = 0; i < N; i++) {
                rec.user_data = i;
                ck_assert_int_eq(epd_ring_submit(pr, &rec), 0);
        }
        for (int i = 0; i < 500 && counter(p, "rings-lost") == 0; i++)
                usleep(10000);
        ck_assert_uint_eq(counter(p, "rings-lost"), 1);
        expect_nop_answers(pr, CQ);
        ck_assert_int_eq(epd_ring_next(pr, &out, 5 * USEC_PER_SEC), -ECONNRESET);
        ck_assert(harness_log_has(&h, "could not take the answer to a submission"));
        epd_ring_close(pr);
        ck_assert_int_eq(epd_ring_open(p, 64, CQ, &pr), 0);
        rec.user_data = 0;
        ck_assert_int_eq(epd_ring_submit(pr, &rec), 0);
        expect_nop_answers(pr, 1);
        ck_assert_int_eq(epd_ring_release(p, pr), 0);

        /* A completion queue the worker corrupted (its head far past the tail): the
         * answer cannot be posted; the ring is closed at once, not left open (and
         * OpenRing refused Exists) until the worker's next submission. */
        ck_assert_int_eq(epd_ring_open(p, 64, CQ, &pr), 0);
        __atomic_store_n((uint32_t *)((uint8_t *)pr->base + EPD_RING_OFF_CQ_HEAD), 100000U, __ATOMIC_RELEASE);
        ck_assert_int_eq(epd_ring_submit(pr, &rec), 0);
        for (int i = 0; i < 500 && counter(p, "rings-lost") == 1; i++)
                usleep(10000);
        ck_assert_uint_eq(counter(p, "rings-lost"), 2);
        ck_assert(harness_log_has(&h, "has a corrupt completion queue"));
        epd_ring_close(pr);
        ck_assert_int_eq(epd_ring_open(p, 64, CQ, &pr), 0);
        ck_assert_int_eq(epd_ring_release(p, pr), 0);
        epd_disconnect(p);
}
END_TEST

/* A ring ACCEPT's wait ends when it asked, not up to sd-event's default 250 ms slack
 * later (a handoff arriving in between was accepted after the wait had ended). */
START_TEST(test_ring_accept_wait_ends_on_time) {
        epd_client *d = worker("decode");
        epd_ring_client *dr;
        struct epd_ring_record out;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        for (unsigned i = 0; i < 5; i++) {
                usec_t t0 = now_usec(CLOCK_MONOTONIC);
                ck_assert_int_eq(epd_ring_accept(dr, rid(90 + i), 2000, i), 0);
                ck_assert_int_eq(epd_ring_next(dr, &out, 5 * USEC_PER_SEC), 0);
                usec_t took = now_usec(CLOCK_MONOTONIC) - t0;
                ck_assert_uint_eq(out.opcode, EPD_RING_EV_COMPLETION);
                ck_assert_uint_eq(out.user_data, i);
                ck_assert_int_eq(out.result, -ETIMEDOUT);
                ck_assert_msg(took < 60 * USEC_PER_MSEC, "a 2 ms wait answered after %" PRIu64 " us", took);
        }
        ck_assert_int_eq(epd_ring_release(d, dr), 0);
        epd_disconnect(d);
}
END_TEST

/* A waiting ring ACCEPT is one of its client's objects; the handoff it accepts takes its
 * room: a client at MaxObjectsPerClient with the wait counted accepts (it heard Quota
 * before). A wait of 0 lasts HandoffTimeout=, however long that is (a wait is at most an
 * hour): with HandoffTimeout=2h it waits (it was refused Invalid). */
START_TEST(test_ring_accept_at_the_object_limit) {
        ck_assert_int_eq(harness_restart(&h, "[Daemon]\nHostId=alpha\n"
                                          "[Cluster]\nHandoffTimeout=2h\n"
                                          "[Arena:kv0]\nSize=64M\n"
                                          "[Arena:kv1]\nSize=16M\n"
                                          "[Limits]\nMaxObjectsPerClient=3\n", address, sizeof address), 0);

        epd_client *p = worker("prefill"), *d = worker("decode");
        epd_ring_client *dr;
        struct epd_ring_record out;
        epd_handoff_options o = { .arena = "kv1" };
        char *path;
        uint64_t token;
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);          /* the worker, the ring */
        ck_assert_int_eq(epd_ring_accept(dr, rid(80), 0, 5), 0);     /* and the wait: 3 */
        struct epd_ring_record nop = { .opcode = EPD_RING_OP_NOP, .user_data = 6 };
        ck_assert_int_eq(epd_ring_submit(dr, &nop), 0);
        ck_assert_int_eq(epd_ring_next(dr, &out, 5 * USEC_PER_SEC), 0);
        ck_assert_uint_eq(out.opcode, EPD_RING_EV_COMPLETION);
        ck_assert_uint_eq(out.user_data, 6); /* the ACCEPT waits: no answer before the NOP's */
        ck_assert_int_eq(epd_handoff_prepare(p, rid(80), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_int_eq(epd_ring_next(dr, &out, 5 * USEC_PER_SEC), 0);
        ck_assert_msg(out.opcode == EPD_RING_EV_HANDOFF_ACCEPTED, "opcode %u, result %d", out.opcode, out.result);
        ck_assert_uint_eq(out.user_data, 5);
        ck_assert_uint_eq(out.token, token);
        ck_assert_int_eq(epd_handoff_rollback(p, path), 0);
        free(path);
        ck_assert_int_eq(epd_ring_release(d, dr), 0);
        release_sequence(p, seq);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A caller's timeout shortens HandoffTimeout=, never lifts it: UINT64_MAX was no
 * deadline at all, and a prefill that stalled while connected held the pages on both
 * sides for good. */
START_TEST(test_prepare_timeout_is_bounded) {
        ck_assert_int_eq(harness_restart(&h, "[Daemon]\nHostId=alpha\n"
                                          "[Cluster]\nHandoffTimeout=1s\n"
                                          "[Arena:kv0]\nSize=64M\n"
                                          "[Arena:kv1]\nSize=16M\n", address, sizeof address), 0);

        epd_client *p = worker("prefill"), *d = worker("decode");
        epd_handoff_options o = { .arena = "kv1", .timeout_usec = UINT64_MAX };
        char *path;
        uint64_t token;
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        ck_assert_int_eq(epd_handoff_prepare(p, rid(81), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_uint_eq(arena_live(p, "kv1"), N_PAGES);
        /* Accepted, then the prefill ships nothing and stays connected. */
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(81), &acc), 0);
        usleep(1500 * 1000);
        wait_state(p, path, "rolled-back");
        epd_handoff_status s;
        status(p, path, &s);
        ck_assert_str_eq(s.cause, "timeout");
        ck_assert_uint_eq(arena_live(p, "kv1"), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        release_sequence(p, seq);
        free(seq);
        epd_disconnect(d);
        epd_disconnect(p);
}
END_TEST

/* OpenRing from a connection that cannot take fds: its answer cannot carry the ring's
 * fds, so the ring goes again: every try hears the same error, none "Exists" (before, the
 * first left a ring behind that nobody could use, holding its memory until the client
 * left). */
START_TEST(test_open_ring_without_fd_passing) {
        char addr[320];
        snprintf(addr, sizeof addr, "unix:path=%s", h.socket);
        sd_bus *bus = NULL;
        ck_assert_int_ge(sd_bus_new(&bus), 0);
        ck_assert_int_ge(sd_bus_set_address(bus, addr), 0);
        ck_assert_int_ge(sd_bus_negotiate_fds(bus, false), 0);
        ck_assert_int_ge(sd_bus_start(bus), 0);
        for (int i = 0; i < 2; i++) {
                sd_bus_error e = SD_BUS_ERROR_NULL;
                sd_bus_message *reply = NULL;
                int r = sd_bus_call_method(bus, NULL, "/org/epd1/handoffs", "org.epd1.Handoffs", "OpenRing", &e, &reply,
                                           "uu", 64U, 64U);
                ck_assert_int_lt(r, 0);
                ck_assert_msg(sd_bus_error_has_name(&e, "org.epd1.Error.Unsupported"), "try %d: %s: %s", i, e.name,
                              e.message);
                sd_bus_error_free(&e);
                sd_bus_message_unref(reply);
        }
        sd_bus_flush_close_unref(bus);
}
END_TEST

START_TEST(test_ring) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        epd_ring_client *pr, *dr, *dup;
        ck_assert_int_eq(epd_ring_open(p, 64, 64, &pr), 0);
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dup), -EEXIST);
        ck_assert_int_eq(epd_ring_open(p, 7, 64, &dup), -EINVAL);
        /* Closed on both sides (CloseRing), a client opens another; without one, NotFound. */
        ck_assert_int_eq(epd_ring_release(d, dr), 0);
        ck_assert_int_eq(epd__call(d, "/org/epd1/handoffs", "org.epd1.Handoffs", "CloseRing", NULL, NULL), -ENOENT);
        ck_assert_str_eq(epd_last_error_name(d), "org.epd1.Error.NotFound");
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        /* Let go of at the daemon while the client still maps it (a bare CloseRing): a
         * submission says so rather than queue records nobody reads. */
        struct epd_ring_record nop = { .opcode = EPD_RING_OP_NOP, .user_data = 1 };
        ck_assert_int_eq(epd__call(d, "/org/epd1/handoffs", "org.epd1.Handoffs", "CloseRing", NULL, NULL), 0);
        ck_assert_int_eq(epd_ring_submit(dr, &nop), -ECONNRESET);
        epd_ring_close(dr);
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);

        /* Ping. */
        struct epd_ring_record rec = { .opcode = EPD_RING_OP_NOP, .user_data = 77 }, out;
        ck_assert_int_eq(epd_ring_submit(pr, &rec), 0);
        ck_assert_int_eq(epd_ring_next(pr, &out, 5000000), 0);
        ck_assert_uint_eq(out.opcode, EPD_RING_EV_COMPLETION);
        ck_assert_uint_eq(out.user_data, 77);
        ck_assert_int_eq(out.result, 0);

        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        char *path;
        uint64_t token;
        epd_handoff_options o = { .arena = "kv1" };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(3), NULL, seq, groups4, 4, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(3), &acc), 0);

        /* A wrong token is refused through the ring too. */
        ck_assert_int_eq(epd_ring_layer_group_ready(pr, rid(3), token + 1, 0, 5), 0);
        do
                ck_assert_int_eq(epd_ring_next(pr, &out, 5000000), 0);
        while (out.opcode != EPD_RING_EV_COMPLETION);
        ck_assert_uint_eq(out.user_data, 5);
        ck_assert_int_eq(out.result, -ENOENT);

        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_ring_layer_group_ready(pr, rid(3), token, g, 100 + g), 0);
        /* The decode side sees progress in order on its ring, without a bus call. */
        uint32_t last = 0;
        while (last < 4) {
                ck_assert_int_eq(epd_ring_next(dr, &out, 5000000), 0);
                if (out.opcode != EPD_RING_EV_GROUP_PROGRESS)
                        continue;
                ck_assert_uint_gt(out.group, last);
                ck_assert_uint_eq(out.count, 4);
                ck_assert_uint_eq(out.token, token);
                last = out.group;
        }
        char *dseq;
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        /* The prefill sees its handoff committed on its ring. */
        bool committed = false;
        while (!committed) {
                ck_assert_int_eq(epd_ring_next(pr, &out, 5000000), 0);
                if (out.opcode == EPD_RING_EV_HANDOFF_STATE && out.arg0 == EPD_HANDOFF_STATE_COMMITTED)
                        committed = true;
        }
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        release_sequence(d, dseq);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "kv1"), 0);
        free(dseq);
        free(path);
        free(seq);
        epd_handoff_accepted_done(&acc);
        epd_ring_close(pr);
        epd_ring_close(dr);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* The decode worker waits for a handoff that is not prepared yet, on its ring and with a
 * blocking AcceptWait: it owns the handoff before any byte lands, and sees every group's
 * progress on its ring. */
static uint32_t ring_wait_for(epd_ring_client *r, uint16_t opcode, struct epd_ring_record *out) {
        do
                ck_assert_int_eq(epd_ring_next(r, out, 5000000), 0);
        while (out->opcode != opcode);
        return out->group;
}

/* The handoff of `seq` (kv0 -> kv1) as request `request`: accepted on d's ring first
 * (user_data ud), then prepared by p; returns its path, *token its token. */
static char *ring_accepted_handoff(epd_client *p, epd_ring_client *dr, const char *request, const char *seq,
                                   uint64_t ud, uint64_t *token) {
        epd_handoff_options o = { .arena = "kv1" };
        struct epd_ring_record out;
        char *path;
        ck_assert_int_eq(epd_ring_accept(dr, request, 5000000, ud), 0);
        ck_assert_int_eq(epd_handoff_prepare(p, request, NULL, seq, groups4, 4, &o, &path, token), 0);
        ring_wait_for(dr, EPD_RING_EV_HANDOFF_ACCEPTED, &out);
        ck_assert_uint_eq(out.user_data, ud);
        ck_assert_uint_eq(out.token, *token);
        return path;
}

/* Every group of the handoff at `path` reported ready by p, and seen landed, in order,
 * on the decode side's ring dr. */
static void ring_all_landed(epd_client *p, const char *path, epd_ring_client *dr) {
        struct epd_ring_record out;
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        uint32_t last = 0;
        while (last < 4) {
                uint32_t done = ring_wait_for(dr, EPD_RING_EV_GROUP_PROGRESS, &out);
                ck_assert_uint_gt(done, last);
                last = done;
        }
}

/* HANDOFF_ACCEPTED's arena is the index in the worker's own epd_arena_get() order: a
 * decode worker that mapped kv1 alone has it at 0, though it is the daemon's second
 * arena (answered on the ring at once and, before Prepare, from the expect). */
START_TEST(test_ring_accepted_arena_is_the_workers) {
        epd_client *p = worker("prefill"), *d = NULL;
        const char *only_kv1[] = { "kv1", NULL };
        ck_assert_int_eq(epd_connect(address, &d), 0);
        ck_assert_int_eq(epd_register(d, "decode", "model", "cpu", &kv, only_kv1), 0);
        ck_assert_uint_eq(epd_arena_count(d), 1);
        ck_assert_int_eq(epd_arena_find(d, "kv1"), 0);
        epd_ring_client *dr;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        epd_handoff_options o = { .arena = "kv1", .ready = 4 };
        struct epd_ring_record out;
        for (int k = 0; k < 2; k++) {
                char *seq = make_sequence(p, "kv0", N_PAGES, NULL), *path, *dseq;
                uint64_t token;
                if (k == 0) /* accepted before Prepare: the expect answers */
                        ck_assert_int_eq(epd_ring_accept(dr, rid(70 + k), 5000000, 70 + k), 0);
                ck_assert_int_eq(epd_handoff_prepare(p, rid(70 + k), NULL, seq, groups4, 4, &o, &path, &token), 0);
                if (k == 1) /* after Prepare: answered at once */
                        ck_assert_int_eq(epd_ring_accept(dr, rid(70 + k), 5000000, 70 + k), 0);
                ring_wait_for(dr, EPD_RING_EV_HANDOFF_ACCEPTED, &out);
                ck_assert_uint_eq(out.user_data, 70 + k);
                ck_assert_uint_eq(out.token, token);
                ck_assert_uint_eq(out.arg1, 0);
                ck_assert_str_eq(epd_arena_get(d, out.arg1)->name, "kv1");
                epd_handoff_accepted acc;
                ck_assert_int_eq(epd_handoff_accept(d, rid(70 + k), &acc), 0); /* a repeat: its path */
                wait_state(d, acc.path, "transferred");
                ck_assert_int_eq(epd_handoff_commit_and_release(d, acc.path, &dseq), 0);
                release_sequence(d, dseq);
                epd_handoff_accepted_done(&acc);
                free(dseq);
                free(path);
                release_sequence(p, seq);
                free(seq);
        }
        epd_ring_close(dr);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* The source sequence released: nothing left live, nothing in the destination arena. */
static void nothing_left(epd_client *p, char *seq) {
        release_sequence(p, seq);
        free(seq);
        ck_assert_uint_eq(arena_live(p, "kv1"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
}

START_TEST(test_accept_wait) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        epd_ring_client *dr;
        struct epd_ring_record out;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        epd_handoff_options o = { .arena = "kv1" };
        char *path;
        uint64_t token;

        /* Nothing arrives: the ring says when the wait ends, so does AcceptWait. */
        ck_assert_int_eq(epd_ring_accept(dr, rid(20), 100000, 7), 0);
        ring_wait_for(dr, EPD_RING_EV_COMPLETION, &out);
        ck_assert_uint_eq(out.user_data, 7);
        ck_assert_int_eq(out.result, -ETIMEDOUT);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept_wait(d, rid(20), 100000, &acc), -ETIMEDOUT);
        ck_assert_str_eq(epd_last_error_name(d), "org.epd1.Error.Timeout");
        ck_assert_int_eq(epd_handoff_accept_wait(d, "nothex", 100000, &acc), -EINVAL);
        ck_assert_int_eq(epd_handoff_accept_wait(d, rid(20), 7200ULL * 1000000ULL, &acc), -EINVAL);

        /* On the ring, before Prepare: accepted the moment it is prepared. */
        ck_assert_int_eq(epd_ring_accept(dr, rid(21), 5000000, 8), 0);
        /* A second waiter of another client for the same request: Busy, once it arrives. */
        epd_client *d2 = worker("decode");
        epd_ring_client *dr2;
        ck_assert_int_eq(epd_ring_open(d2, 64, 64, &dr2), 0);
        ck_assert_int_eq(epd_ring_accept(dr2, rid(21), 5000000, 9), 0);
        usleep(50000); /* both wait in the daemon now */
        ck_assert_int_eq(epd_handoff_prepare(p, rid(21), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ring_wait_for(dr, EPD_RING_EV_HANDOFF_ACCEPTED, &out);
        ck_assert_uint_eq(out.user_data, 8);
        ck_assert_uint_eq(out.token, token);
        ck_assert_uint_eq(out.count, 4);
        ck_assert_uint_eq(out.group, 0);
        ck_assert_uint_eq(out.arg0, N_PAGES);
        ck_assert_int_eq((int)out.arg1, epd_arena_find(d, "kv1"));
        ring_wait_for(dr2, EPD_RING_EV_COMPLETION, &out);
        ck_assert_uint_eq(out.user_data, 9);
        ck_assert_int_eq(out.result, -EBUSY);
        epd_ring_close(dr2);
        epd_disconnect(d2);
        /* Accept is a repeat now: it gives the offsets. */
        ck_assert_int_eq(epd_handoff_accept(d, rid(21), &acc), 0);
        ck_assert_uint_eq(acc.token, token);
        ck_assert_uint_eq(acc.n_pages, N_PAGES);
        ring_all_landed(p, path, dr);
        char *dseq;
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        wait_state(p, path, "committed");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        release_sequence(d, dseq);
        free(dseq);
        free(path);
        epd_handoff_accepted_done(&acc);

        /* Blocking AcceptWait in another process, prepared while it waits. */
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                epd_client *c = NULL;
                epd_handoff_accepted a;
                if (epd_connect(address, &c) < 0 || epd_register(c, "decode", "model", "cpu", &kv, NULL) < 0)
                        _exit(1);
                if (epd_handoff_accept_wait(c, rid(22), 5000000, &a) < 0 || a.n_pages != N_PAGES || a.n_groups != 4)
                        _exit(2);
                epd_handoff_status st = {};
                for (int i = 0; i < 500 && st.groups_done < 4; i++) {
                        if (epd_handoff_get(c, a.path, &st) < 0)
                                _exit(3);
                        usleep(10000);
                }
                char *s2 = NULL;
                if (epd_handoff_commit(c, a.path, &s2) < 0)
                        _exit(4);
                _exit(0); /* the sequence and the handoff go with the connection */
        }
        usleep(100000);
        ck_assert_int_eq(epd_handoff_prepare(p, rid(22), NULL, seq, groups4, 4, &o, &path, &token), 0);
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        ck_assert(WIFEXITED(st));
        ck_assert_int_eq(WEXITSTATUS(st), 0);
        wait_state(p, path, "committed");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);

        /* A waiter whose client goes away leaves nothing behind. */
        ck_assert_int_eq(epd_ring_accept(dr, rid(23), 5000000, 10), 0);
        epd_ring_close(dr);
        epd_disconnect(d);
        d = worker("decode");
        ck_assert_int_eq(epd_handoff_prepare(p, rid(23), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_accept(d, rid(23), &acc), 0); /* nobody took it */
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        nothing_left(p, seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A handoff that rolls back before its decode accepts it (its deadline passed while the
 * decode was busy): the decode's late AcceptWait, Accept and ring ACCEPT hear Stale and
 * why at once, not NotFound or a wait to their own deadline; a newer attempt for the
 * request is accepted as usual. */
START_TEST(test_accept_after_rollback) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        epd_ring_client *dr;
        struct epd_ring_record out;
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        epd_handoff_options o = { .arena = "kv1", .timeout_usec = 100000 };
        char *path, *path2;
        uint64_t token, token2;

        ck_assert_int_eq(epd_handoff_prepare(p, rid(24), NULL, seq, groups4, 4, &o, &path, &token), 0);
        wait_state(p, path, "rolled-back");
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_handoff_accept_wait(d, rid(24), 5000000, &acc), -ESTALE);
        ck_assert_uint_lt(now_usec(CLOCK_MONOTONIC) - t0, 2000000); /* at once, not in 5 s */
        ck_assert_str_eq(epd_last_error_name(d), "org.epd1.Error.Stale");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(d), "rolled back here"));
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(d), "(timeout)"));
        ck_assert_int_eq(epd_handoff_accept(d, rid(24), &acc), -ESTALE);
        ck_assert_int_eq(epd_ring_accept(dr, rid(24), 5000000, 11), 0);
        ring_wait_for(dr, EPD_RING_EV_COMPLETION, &out);
        ck_assert_uint_eq(out.user_data, 11);
        ck_assert_int_eq(out.result, -ESTALE);
        /* Another request's wait is not affected. */
        ck_assert_int_eq(epd_handoff_accept_wait(d, rid(25), 50000, &acc), -ETIMEDOUT);

        /* The source tries again (a newer token): accepted as usual. */
        o.timeout_usec = 0;
        ck_assert_int_eq(epd_handoff_prepare(p, rid(24), NULL, seq, groups4, 4, &o, &path2, &token2), 0);
        ck_assert_uint_gt(token2, token);
        ck_assert_int_eq(epd_handoff_accept_wait(d, rid(24), 5000000, &acc), 0);
        ck_assert_uint_eq(acc.token, token2);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path2), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(path2);
        nothing_left(p, seq);
        epd_ring_close(dr);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A ring ACCEPT still waiting when its client closes the ring goes with it: the handoff
 * that arrives later is not taken for a client that will never hear of it (another
 * client accepts it), and the client's next ring gets no answer meant for the old one. */
START_TEST(test_ring_accept_goes_with_the_ring) {
        epd_client *p = worker("prefill"), *d = worker("decode"), *d2 = worker("decode");
        epd_ring_client *dr;
        struct epd_ring_record out;
        epd_handoff_accepted acc;
        char *path;
        uint64_t token;
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        epd_handoff_options o = { .arena = "kv1" };

        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        ck_assert_int_eq(epd_ring_accept(dr, rid(26), 5000000, 12), 0);
        /* A NOP behind it: answered once the daemon has taken the ACCEPT (in order). */
        struct epd_ring_record nop = { .opcode = EPD_RING_OP_NOP, .user_data = 13 };
        ck_assert_int_eq(epd_ring_submit(dr, &nop), 0);
        ring_wait_for(dr, EPD_RING_EV_COMPLETION, &out);
        ck_assert_uint_eq(out.user_data, 13);
        ck_assert_int_eq(epd_ring_release(d, dr), 0);
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        ck_assert_int_eq(epd_handoff_prepare(p, rid(26), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_accept(d2, rid(26), &acc), 0); /* nobody took it */
        ck_assert_int_eq(epd_ring_next(dr, &out, 200000), -EAGAIN);  /* nothing for the new ring */
        ck_assert_int_eq(epd_handoff_release(d2, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        nothing_left(p, seq);
        epd_ring_close(dr);
        epd_disconnect(p);
        epd_disconnect(d);
        epd_disconnect(d2);
}
END_TEST

/* Commit on the ring (EPD_RING_OP_COMMIT): refused with Commit's errors before the
 * groups arrived, for another token, by another client; then committed and released in
 * one submission, answered once durable with the decode sequence; the source sees it
 * committed; nothing left. */
START_TEST(test_ring_commit) {
        epd_client *p = worker("prefill"), *d = worker("decode"), *d2 = worker("decode");
        epd_ring_client *dr, *dr2;
        struct epd_ring_record out, bad;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        ck_assert_int_eq(epd_ring_open(d2, 64, 64, &dr2), 0);
        uint64_t offs[N_PAGES];
        char *seq = make_sequence(p, "kv0", N_PAGES, offs);
        fill_pages(arena_base(p, "kv0"), offs, N_PAGES);
        uint64_t token;

        ck_assert_int_eq(epd_ring_commit(dr, rid(30), 0, 1, 1), -EINVAL); /* no token */
        ck_assert_int_eq(epd_ring_commit(dr, "nothex", 1, 1, 1), -EINVAL);
        char *path = ring_accepted_handoff(p, dr, rid(30), seq, 40, &token);

        /* Refusals, each a completion with the error; nothing changes. */
        ck_assert_int_eq(epd_ring_commit(dr, rid(30), token, 1, 41), 0); /* groups missing */
        ring_wait_for(dr, EPD_RING_EV_COMPLETION, &out);
        ck_assert_uint_eq(out.user_data, 41);
        ck_assert_int_eq(out.result, -EBUSY);
        ck_assert_int_eq(epd_ring_commit(dr, rid(30), token + 1, 1, 42), 0); /* another token */
        ring_wait_for(dr, EPD_RING_EV_COMPLETION, &out);
        ck_assert_int_eq(out.result, -ENOENT);
        ck_assert_int_eq(epd_ring_commit(dr2, rid(30), token, 1, 43), 0); /* not its handoff */
        ring_wait_for(dr2, EPD_RING_EV_COMPLETION, &out);
        ck_assert_uint_eq(out.user_data, 43);
        ck_assert_int_eq(out.result, -EPERM);
        uint8_t id[16];
        memset(id, 0x30, sizeof id);
        epd_ring_record_commit(&bad, id, token, 1, 44);
        bad.arg0 = 2; /* an unknown flag */
        ck_assert_int_eq(epd_ring_submit(dr, &bad), 0);
        ring_wait_for(dr, EPD_RING_EV_COMPLETION, &out);
        ck_assert_uint_eq(out.user_data, 44);
        ck_assert_int_eq(out.result, -EINVAL);

        ring_all_landed(p, path, dr);

        /* Commit and release in one submission: the decode sequence comes back. */
        ck_assert_int_eq(epd_ring_commit(dr, rid(30), token, 1, 45), 0);
        for (;;) {
                ring_wait_for(dr, EPD_RING_EV_COMPLETION, &out);
                if (out.user_data == 45)
                        break;
        }
        ck_assert_int_eq(out.result, 0);
        char dseq[EPD_RING_SEQUENCE_PATH_MAX];
        ck_assert_int_eq(epd_ring_record_sequence_path(&out, dseq, 8), -ENOBUFS);
        ck_assert_int_eq(epd_ring_record_sequence_path(&out, dseq, sizeof dseq), 0);
        ck_assert(strncmp(dseq, "/org/epd1/sequence/", 19) == 0);
        ck_assert_uint_eq(strlen(dseq), 51);
        /* It is the decode client's sequence, holding the bytes the prefill wrote. */
        uint64_t doffs[N_PAGES];
        sequence_offsets(d, dseq, doffs, N_PAGES);
        ck_assert(layers_equal(arena_base(d, "kv1"), doffs, N_PAGES, 0, LAYERS));
        wait_state(p, path, "committed");
        /* Released with the commit: the handoff is gone on the decode side. */
        ck_assert_int_eq(epd_ring_commit(dr, rid(30), token, 0, 46), 0);
        ring_wait_for(dr, EPD_RING_EV_COMPLETION, &out);
        ck_assert_uint_eq(out.user_data, 46);
        ck_assert_int_eq(out.result, -ENOENT);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        release_sequence(d, dseq);
        release_sequence(p, seq);
        free(seq);
        free(path);
        epd_ring_close(dr);
        epd_ring_close(dr2);
        ck_assert_uint_eq(arena_live(p, "kv1"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        epd_disconnect(p);
        epd_disconnect(d);
        epd_disconnect(d2);
}
END_TEST

/* A worker that unmaps its ring right after a COMMIT (epd_ring_close() tells the daemon
 * nothing: the ring lives until the client goes): the commit stands (the source sees it
 * committed), its answer lands where nobody reads it, and the decode sequence goes with
 * the client. */
/* The decode side gone: kv1 empties (its decode sequence released with its client);
 * then the source's sequence goes. Frees seq and path. */
static void source_done(epd_client *p, char *seq, char *path) {
        for (int i = 0; i < 200 && arena_live(p, "kv1") > 0; i++)
                usleep(10000);
        ck_assert_uint_eq(arena_live(p, "kv1"), 0);
        release_sequence(p, seq);
        free(seq);
        free(path);
}

START_TEST(test_ring_commit_ring_closed) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        epd_ring_client *dr;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        uint64_t token;
        char *path = ring_accepted_handoff(p, dr, rid(31), seq, 50, &token);
        ring_all_landed(p, path, dr);
        ck_assert_int_eq(epd_ring_commit(dr, rid(31), token, 1, 51), 0);
        epd_ring_close(dr); /* before its answer, most likely */
        wait_state(p, path, "committed");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_uint_gt(arena_live(p, "kv1"), 0); /* the decode sequence */
        epd_disconnect(d);
        source_done(p, seq, path);
        ck_assert_uint_eq(counter(p, "live"), 0);
        epd_disconnect(p);
}
END_TEST

/* epdd again, every write of its journal `ms` milliseconds slower (fault-wal.c). */
static void restart_with_slow_journal(const char *ms) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        setenv("EPD_FAULT_WAL_SLOW_MS", ms, 1);
        setenv("EPD_FAULT_WAL_SLOW_WRITES", "1000000", 1);
        ck_assert_int_eq(harness_start_epdd_preloaded(&h, getenv("FAULT_WAL"), "EPD_FAULT_WAL_SLOW_LSN", "1"), 0);
        unsetenv("EPD_FAULT_WAL_SLOW_MS");
        unsetenv("EPD_FAULT_WAL_SLOW_WRITES");
}

/* A ring COMMIT answered once its records are durable goes to the ring it came on: the
 * worker closed that ring and opened another before the answer (a slow disk keeps the
 * records from being durable meanwhile), and the new ring hears nothing of it, where its
 * own user_data 51 could mean a commit of its own. */
START_TEST(test_ring_commit_answer_stays_with_its_ring) {
        restart_with_slow_journal("200");
        epd_client *p = worker("prefill"), *d = worker("decode");
        epd_ring_client *dr, *dr2;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        uint64_t token;
        char *path = ring_accepted_handoff(p, dr, rid(32), seq, 50, &token);
        ring_all_landed(p, path, dr);
        ck_assert_int_eq(epd_ring_commit(dr, rid(32), token, 1, 51), 0);
        ck_assert_int_eq(epd_ring_release(d, dr), 0); /* both sides; the records take 200 ms to be durable */
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr2), 0);
        struct epd_ring_record out;
        int r = epd_ring_next(dr2, &out, 1000000);
        ck_assert_msg(r == -EAGAIN, "the new ring got a record (opcode %#x, user_data %" PRIu64 ")", out.opcode,
                      out.user_data);
        wait_state(p, path, "committed");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_ring_close(dr2);
        epd_disconnect(d);
        source_done(p, seq, path);
        epd_disconnect(p);
}
END_TEST

/* The daemon lets go of a ring whose queue the worker corrupted, and the client stays
 * connected: a wait on the ring ends with ECONNRESET at once (no record will ever come),
 * not at its timeout, nor never with none; the connection still serves calls. */
START_TEST(test_ring_wait_ends_when_the_daemon_lets_go) {
        epd_client *d = worker("decode");
        epd_ring_client *dr;
        struct epd_ring_record out;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        ck_assert_int_eq(epd_ring_next(dr, &out, 0), -EAGAIN);
        /* A tail far past the head: the daemon finds the queue corrupt and closes it. */
        __atomic_store_n((uint32_t *)((uint8_t *)dr->base + EPD_RING_OFF_SQ_TAIL), 100000U, __ATOMIC_RELEASE);
        uint64_t one = 1;
        ck_assert_int_eq(write(dr->submit_fd, &one, sizeof one), (ssize_t)sizeof one);
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_ring_next(dr, &out, 10 * USEC_PER_SEC), -ECONNRESET);
        ck_assert_uint_lt(now_usec(CLOCK_MONOTONIC) - t0, 5 * USEC_PER_SEC);
        ck_assert_int_eq(epd_ring_next(dr, &out, UINT64_MAX), -ECONNRESET); /* and stays so */
        ck_assert(harness_log_has(&h, "corrupted its ring"));
        epd_ring_close(dr);
        /* The client lives on: another ring, and calls. */
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        ck_assert_int_eq(epd_ring_next(dr, &out, 0), -EAGAIN);
        ck_assert_int_eq(epd_ring_release(d, dr), 0);
        epd_disconnect(d);
}
END_TEST

static void on_alarm(int sig) {
        (void)sig;
}

/* A signal caught while epd_flush() waits is not its answer: the flush waits on and
 * returns 0 once the call sent without waiting is answered (the daemon's journal takes
 * 300 ms a write here), not -EINTR. */
START_TEST(test_flush_through_a_signal) {
        restart_with_slow_journal("300");
        epd_client *p = worker("prefill");
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        struct sigaction sa = { .sa_handler = on_alarm }, old; /* no SA_RESTART */
        ck_assert_int_eq(sigaction(SIGALRM, &sa, &old), 0);
        ck_assert_int_eq(epd_sequence_release_nowait(p, seq), 0);
        struct itimerval it = { .it_value = { .tv_usec = 50000 } };
        ck_assert_int_eq(setitimer(ITIMER_REAL, &it, NULL), 0);
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_flush(p, 5 * USEC_PER_SEC), 0);
        ck_assert_uint_ge(now_usec(CLOCK_MONOTONIC) - t0, 100000); /* it did wait past the signal */
        /* Without a deadline a signal ends the wait (or nothing could stop it). */
        char *seq2 = make_sequence(p, "kv0", N_PAGES, NULL);
        ck_assert_int_eq(epd_sequence_release_nowait(p, seq2), 0);
        ck_assert_int_eq(setitimer(ITIMER_REAL, &it, NULL), 0);
        ck_assert_int_eq(epd_flush(p, UINT64_MAX), -EINTR);
        ck_assert_int_eq(epd_flush(p, 5 * USEC_PER_SEC), 0);
        ck_assert_int_eq(sigaction(SIGALRM, &old, NULL), 0);
        free(seq2);
        free(seq);
        epd_disconnect(p);
}
END_TEST

START_TEST(test_decode_dies) {
        epd_client *p = worker("prefill");
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        char *path;
        uint64_t token;
        epd_handoff_options o = { .arena = "kv1" };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(4), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 0), 0);

        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                epd_client *d = NULL;
                epd_handoff_accepted acc;
                if (epd_connect(address, &d) < 0 || epd_register(d, "decode", "model", "cpu", &kv, NULL) < 0 ||
                    epd_handoff_accept(d, rid(4), &acc) < 0)
                        _exit(1);
                kill(getpid(), SIGKILL);
                _exit(2);
        }
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        ck_assert(WIFSIGNALED(st));

        wait_state(p, path, "rolled-back");
        epd_handoff_status s;
        status(p, path, &s);
        ck_assert_str_eq(s.cause, "worker-gone");
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 1), -ESTALE);
        ck_assert_uint_eq(arena_live(p, "kv1"), 0); /* the reserved pages are free again */
        ck_assert_uint_ge(counter(p, "failures.worker-gone"), 1);

        /* A new attempt of the same request gets a larger token. */
        char *path2;
        uint64_t token2;
        ck_assert_int_eq(epd_handoff_prepare(p, rid(4), NULL, seq, groups4, 4, &o, &path2, &token2), 0);
        ck_assert_uint_gt(token2, token);
        ck_assert_str_ne(path2, path);
        /* The prefill dies too: everything goes. */
        epd_disconnect(p);
        p = worker("prefill");
        ck_assert_uint_eq(arena_live(p, "kv1"), 0);
        ck_assert_uint_eq(arena_live(p, "kv0"), 0);
        ck_assert_uint_eq(counter(p, "live"), 0);
        free(path);
        free(path2);
        free(seq);
        epd_disconnect(p);
}
END_TEST

/* The decode worker a handoff is meant for (Prepare's target) dies before it accepts:
 * nobody else may accept it, so it rolls back at once (worker-gone), not at its
 * timeout, and both sides' pages are free again. */
START_TEST(test_target_dies_before_accept) {
        epd_client *p = worker("prefill");
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        int to_parent[2], to_child[2];
        ck_assert_int_eq(pipe2(to_parent, O_CLOEXEC), 0);
        ck_assert_int_eq(pipe2(to_child, O_CLOEXEC), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                epd_client *d = NULL;
                char go;
                if (epd_connect(address, &d) < 0 || epd_register(d, "decode", "model", "cpu", &kv, NULL) < 0)
                        _exit(1);
                const char *wp = epd_worker_path(d);
                if (write(to_parent[1], wp, strlen(wp) + 1) < 0 || read(to_child[0], &go, 1) != 1)
                        _exit(1);
                kill(getpid(), SIGKILL);
                _exit(2);
        }
        close(to_parent[1]);
        close(to_child[0]);
        char target[256] = "";
        ck_assert_int_gt(read(to_parent[0], target, sizeof target - 1), 0);
        close(to_parent[0]);

        char *path;
        uint64_t token;
        epd_handoff_options o = { .arena = "kv1", .target = target, .timeout_usec = 60 * USEC_PER_SEC };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(9), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 0), 0);
        ck_assert_uint_gt(arena_live(p, "kv1"), 0);
        ck_assert_int_eq(write(to_child[1], "x", 1), 1);
        close(to_child[1]);
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        ck_assert(WIFSIGNALED(st));

        wait_state(p, path, "rolled-back");
        epd_handoff_status s;
        status(p, path, &s);
        ck_assert_str_eq(s.cause, "worker-gone");
        /* Free once the rollback's record is durable (freed pages wait for it, docs/wal.md):
         * shortly after the state changed, not necessarily before. */
        ck_assert_msg(harness_wait_for(kv1_free, p, 5000), "kv1 still has %" PRIu64 " live pages",
                      arena_live(p, "kv1"));
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);
        free(seq);
        epd_disconnect(p);
}
END_TEST

START_TEST(test_timeout_and_admission) {
        epd_client *p = worker("prefill"), *d = worker("decode");
        char *seq = make_sequence(p, "kv0", N_PAGES, NULL);
        char *path;
        uint64_t token;
        epd_handoff_options o = { .arena = "kv1", .timeout_usec = 200000 };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(5), NULL, seq, groups4, 4, &o, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(5), &acc), 0);
        wait_state(p, path, "rolled-back");
        epd_handoff_status s;
        status(p, path, &s);
        ck_assert_str_eq(s.cause, "timeout");
        wait_state(d, acc.path, "rolled-back");
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, NULL), -ESTALE);
        ck_assert_uint_eq(arena_live(p, "kv1"), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);

        /* Admission: kv1 (16 MiB) holds fewer than 255 pages of 64 KiB. */
        char *big = make_sequence(p, "kv0", 200, NULL);
        epd_handoff_options o2 = { .arena = "kv1" };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(6), NULL, big, groups4, 4, &o2, &path, &token), 0);
        char *path2 = NULL;
        ck_assert_int_eq(epd_handoff_prepare(p, rid(7), NULL, big, groups4, 4, &o2, &path2, &token), -ENOSPC);
        ck_assert_str_eq(epd_last_error_name(p), "org.epd1.Error.NoSpace");
        ck_assert_uint_ge(counter(p, "refused"), 1);
        /* The refusal is in the request's trace, with the reason the caller heard. */
        epd_trace_event *ev = NULL;
        size_t n_ev = 0;
        ck_assert_int_eq(epd_trace_get(p, rid(7), &ev, &n_ev, NULL), 0);
        ck_assert_uint_ge(n_ev, 1);
        ck_assert_str_eq(ev[n_ev - 1].type, "error");
        ck_assert_ptr_nonnull(strstr(ev[n_ev - 1].detail, "prepare refused: "));
        free(ev);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_uint_eq(arena_live(p, "kv1"), 0);
        free(path);

        /* Bad arguments. */
        uint32_t bad[2] = { 3, 3 };
        ck_assert_int_eq(epd_handoff_prepare(p, "xyz", NULL, seq, groups4, 4, NULL, &path, &token), -EINVAL);
        ck_assert_int_eq(epd_handoff_prepare(p, rid(8), NULL, seq, bad, 2, NULL, &path, &token), -EINVAL);
        ck_assert_int_eq(epd_handoff_prepare(p, rid(8), "nohost", seq, groups4, 4, NULL, &path, &token), -ENOENT);
        ck_assert_int_eq(epd_trace_get(p, rid(8), &ev, &n_ev, NULL), 0);
        ck_assert_str_eq(ev[n_ev - 1].type, "error");
        ck_assert_ptr_nonnull(strstr(ev[n_ev - 1].detail, "nohost"));
        free(ev);
        ck_assert_int_eq(epd_handoff_prepare(d, rid(8), NULL, seq, groups4, 4, NULL, &path, &token), -EPERM);
        ck_assert_int_eq(epd_handoff_accept(d, rid(9), &acc), -ENOENT);
        release_sequence(p, big);
        release_sequence(p, seq);
        ck_assert_uint_eq(arena_live(p, "kv0"), 0);
        free(big);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

START_TEST(test_introspection) {
        epd_client *p = worker("prefill");
        sd_bus *bus;
        char f[600];
        ck_assert_int_eq(harness_direct_bus(&h, &bus), 0);
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Handoffs.xml", getenv("SOURCE_ROOT"));
        ck_assert_int_eq(harness_check_introspection(bus, NULL, "/org/epd1/handoffs", f), 0);
        char *seq = make_sequence(p, "kv0", 1, NULL), *path;
        uint64_t token;
        ck_assert_int_eq(epd_handoff_prepare(p, rid(10), NULL, seq, groups4, 4, NULL, &path, &token), 0);
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Handoff.xml", getenv("SOURCE_ROOT"));
        ck_assert_int_eq(harness_check_introspection(bus, NULL, path, f), 0);
        sd_bus_flush_close_unref(bus);
        free(path);
        free(seq);
        epd_disconnect(p);
}
END_TEST

/* The scheduler holds back the pages it promised a decode worker until they leave the
 * pool, not longer: once a handoff's Prepare has taken them (here the prefill's own
 * pages, handed over in place), the pool's free count no longer has them, and the
 * promise no longer counts them again. Before, a second request was deferred
 * "no-pages" until the first one's prefill completed, with room for it. */
START_TEST(test_admission_counts_prepared_pages_once) {
        epd_client *p = worker("prefill"), *d = worker("decode"), *tool;
        epd_admission a;
        /* kv0 1024 pages, kv1 256: the decode worker maps both (1280 free). */
        ck_assert_int_eq(epd_connect(address, &tool), 0);
        ck_assert_int_eq(epd_admit(tool, rid(90), "hybrid", 0, 1000, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_str_eq(a.decode, epd_worker_path(d));

        /* The prefill makes its KV: 1000 pages leave the pool (280 free), still promised. */
        char *seq = make_sequence(p, "kv0", 1000, NULL);
        ck_assert_int_eq(epd_admit(tool, rid(91), "hybrid", 0, 200, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_DEFER);
        ck_assert_str_eq(a.reason, "no-pages");

        /* Its handoff to the decode worker takes them: 200 of the 280 can go to another. */
        char *path = NULL;
        uint64_t token = 0;
        epd_handoff_options o = { .target = epd_worker_path(d) };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(90), NULL, seq, groups4, 4, &o, &path, &token), 0);
        ck_assert_int_eq(epd_admit(tool, rid(91), "hybrid", 0, 200, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        /* Not more than there is: the first request's pages are gone from the pool. */
        ck_assert_int_eq(epd_admit(tool, rid(92), "hybrid", 0, 200, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_DEFER);
        ck_assert_str_eq(a.reason, "no-pages");

        ck_assert_int_eq(epd_handoff_rollback(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        release_sequence(p, seq);
        free(path);
        free(seq);
        epd_disconnect(tool); /* its requests are cancelled: nothing reserved */

        /* A copy into kv1 that rolls back gives its pages back to the pool, and the
         * request its reservation: nobody else was promised them meanwhile. */
        ck_assert_int_eq(epd_connect(address, &tool), 0);
        ck_assert_int_eq(epd_admit(tool, rid(93), "hybrid", 0, 200, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        seq = make_sequence(p, "kv0", 200, NULL); /* 1080 free */
        epd_handoff_options o1 = { .target = epd_worker_path(d), .arena = "kv1" };
        ck_assert_int_eq(epd_handoff_prepare(p, rid(93), NULL, seq, groups4, 4, &o1, &path, &token), 0);
        ck_assert_uint_eq(arena_live(p, "kv1"), 200); /* 880 free (824 in kv0), none promised */
        ck_assert_int_eq(epd_admit(tool, rid(94), "hybrid", 0, 800, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_int_eq(epd_handoff_rollback(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_uint_eq(arena_live(p, "kv1"), 0); /* 1080 free, 1000 promised again */
        ck_assert_int_eq(epd_admit(tool, rid(95), "hybrid", 0, 81, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_DEFER);
        ck_assert_str_eq(a.reason, "no-pages");
        release_sequence(p, seq);
        free(path);
        free(seq);
        epd_disconnect(tool);
        epd_disconnect(d);
        epd_disconnect(p);
}
END_TEST

static void setup_three_arenas(void) {
        ck_assert_int_eq(harness_init(&h, "[Daemon]\nHostId=alpha\n"
                                          "[Arena:kv0]\nSize=4M\n"
                                          "[Arena:kva]\nSize=1M\n"
                                          "[Arena:kvb]\nSize=4M\n"), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
}

/* A request's pages land in one arena (its handoff's): a decode worker whose arenas have
 * room together but not one of them alone does not take it ("no-pages"), where the sum
 * admitted it and the Prepare then said NoSpace. */
START_TEST(test_admission_needs_one_arena) {
        static const char *const kv0[] = { "kv0", NULL }, *const ab[] = { "kva", "kvb", NULL };
        epd_client *p, *d, *filler, *tool;
        epd_admission a;
        ck_assert_int_eq(epd_connect(address, &p), 0);
        ck_assert_int_eq(epd_register(p, "prefill", "model", "cpu", &kv, kv0), 0);
        ck_assert_int_eq(epd_connect(address, &d), 0);
        ck_assert_int_eq(epd_register(d, "decode", "model", "cpu", &kv, ab), 0);
        ck_assert_int_eq(epd_connect(address, &filler), 0);
        ck_assert_int_eq(epd_register(filler, "prefill", "model", "cpu", &kv, ab), 0);
        /* 10 pages free in each: kva 16 - 6, kvb 64 - 54. */
        char *fa = make_sequence(filler, "kva", 6, NULL), *fb = make_sequence(filler, "kvb", 54, NULL);
        ck_assert_int_eq(epd_connect(address, &tool), 0);
        ck_assert_int_eq(epd_admit(tool, rid(96), "hybrid", 0, 16, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_DEFER);
        ck_assert_str_eq(a.reason, "no-pages");
        ck_assert_int_eq(epd_admit(tool, rid(97), "hybrid", 0, 10, false, &a), 0);
        ck_assert_int_eq(a.verdict, EPD_ADMIT);
        ck_assert_str_eq(a.decode, epd_worker_path(d));
        epd_disconnect(tool);
        release_sequence(filler, fa);
        release_sequence(filler, fb);
        free(fa);
        free(fb);
        epd_disconnect(filler);
        epd_disconnect(d);
        epd_disconnect(p);
}
END_TEST

/* A handoff into a decode worker that maps two arenas goes to one with room for it:
 * the scheduler admits against them together, and the first of them being full is no
 * NoSpace while the other has the pages. */
START_TEST(test_destination_arena_with_room) {
        static const char *const kv0[] = { "kv0", NULL }, *const ab[] = { "kva", "kvb", NULL };
        epd_client *p, *d, *filler;
        ck_assert_int_eq(epd_connect(address, &p), 0);
        ck_assert_int_eq(epd_register(p, "prefill", "model", "cpu", &kv, kv0), 0);
        ck_assert_int_eq(epd_connect(address, &d), 0);
        ck_assert_int_eq(epd_register(d, "decode", "model", "cpu", &kv, ab), 0);
        ck_assert_int_eq(epd_connect(address, &filler), 0);
        ck_assert_int_eq(epd_register(filler, "decode", "model", "cpu", &kv, ab), 0);
        char *full = make_sequence(filler, "kva", 16, NULL); /* kva: 16 pages of 64 KiB, all taken */

        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, "kv0", N_PAGES, src);
        fill_pages(arena_base(p, "kv0"), src, N_PAGES);
        char *path = NULL;
        uint64_t token = 0;
        epd_handoff_options o = { .target = epd_worker_path(d) };
        ck_assert_msg(epd_handoff_prepare(p, rid(95), NULL, seq, groups4, 4, &o, &path, &token) == 0, "Prepare: %s",
                      epd_last_error_message(p));
        ck_assert_uint_eq(arena_live(p, "kvb"), N_PAGES);
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid(95), &acc), 0);
        ck_assert_str_eq(acc.arena, "kvb");
        ck_assert_uint_eq(acc.n_pages, N_PAGES);
        epd_handoff_status st = {};
        for (int i = 0; i < 500 && st.groups_done < 4; i++) {
                status(d, acc.path, &st);
                if (st.groups_done < 4)
                        usleep(10000);
        }
        ck_assert_uint_eq(st.groups_done, 4);
        ck_assert(layers_equal(arena_base(d, "kvb"), acc.offsets, N_PAGES, 0, LAYERS));
        char *dseq = NULL;
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        wait_state(p, path, "committed");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        release_sequence(d, dseq);
        epd_handoff_accepted_done(&acc);
        release_sequence(p, seq);
        release_sequence(filler, full);
        free(dseq);
        free(path);
        free(seq);
        free(full);
        epd_disconnect(filler);
        epd_disconnect(d);
        epd_disconnect(p);
}
END_TEST

int main(void) {
        if (!getenv("EPDD")) {
                printf("SKIP: EPDD is not set (run through meson test)\n");
                return 77;
        }
        Suite *s = suite_create("handoff-integration");
        TCase *tc = tcase_create("handoff");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_two_arenas);
        tcase_add_test(tc, test_same_arena_zero_copy);
        tcase_add_test(tc, test_commit_and_release);
        tcase_add_test(tc, test_commit_and_release_without_ring);
        tcase_add_test(tc, test_ring);
        tcase_add_test(tc, test_ring_submissions_past_one_turn);
        tcase_add_test(tc, test_ring_answers_past_a_full_cq);
        tcase_add_test(tc, test_ring_lost_answer_closes_it);
        tcase_add_test(tc, test_ring_accept_wait_ends_on_time);
        tcase_add_test(tc, test_ring_accept_at_the_object_limit);
        tcase_add_test(tc, test_prepare_timeout_is_bounded);
        tcase_add_test(tc, test_open_ring_without_fd_passing);
        tcase_add_test(tc, test_prepare_async);
        tcase_add_test(tc, test_own_poll_loop);
        tcase_add_test(tc, test_ring_accepted_arena_is_the_workers);
        tcase_add_test(tc, test_watch_signals);
        tcase_add_test(tc, test_accept_wait);
        tcase_add_test(tc, test_accept_after_rollback);
        tcase_add_test(tc, test_ring_accept_goes_with_the_ring);
        tcase_add_test(tc, test_ring_commit);
        tcase_add_test(tc, test_ring_commit_ring_closed);
        tcase_add_test(tc, test_ring_commit_answer_stays_with_its_ring);
        tcase_add_test(tc, test_ring_wait_ends_when_the_daemon_lets_go);
        tcase_add_test(tc, test_flush_through_a_signal);
        tcase_add_test(tc, test_decode_dies);
        tcase_add_test(tc, test_target_dies_before_accept);
        tcase_add_test(tc, test_timeout_and_admission);
        tcase_add_test(tc, test_introspection);
        tcase_add_test(tc, test_admission_counts_prepared_pages_once);
        suite_add_tcase(s, tc);
        TCase *three = tcase_create("three-arenas");
        tcase_add_checked_fixture(three, setup_three_arenas, teardown);
        tcase_add_test(three, test_destination_arena_with_room);
        tcase_add_test(three, test_admission_needs_one_arena);
        suite_add_tcase(s, three);
        return check_run(s, CK_FORK_GETENV);
}
