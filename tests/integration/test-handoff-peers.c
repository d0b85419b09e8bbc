/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Layered handoffs between two epdd hosts ("alpha" and "bravo", peers over loopback
 * TCP with the cluster key): the prefill client on alpha, the decode client on bravo.
 * (a third, "charlie", peers with alpha only).
 * Bytes land exactly and groups arrive in order; the decode worker dying, the remote
 * daemon killed with SIGKILL mid-transfer and admission (NoSpace) all end in a rollback
 * on both sides, with every page free again within the heartbeat bound. The network
 * namespace variants (cut links, packet loss) are in test-peer-netns.py. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "epd-internal.h"
#include "epd/handoff.h"
#include "harness.h"
#include "time-util.h"
#include "../check-main.h"

#define LAYERS 8
#define TOKENS 16
#define KV_BYTES 256
#define LAYER_BYTES (TOKENS * 2 * KV_BYTES)
#define PAGE_SIZE (LAYERS * LAYER_BYTES)
#define N_PAGES 64

static Harness ha, hb, hc;
static char addr_a[512], addr_b[512], addr_c[512], keyfile[128];
static const epd_kv_layout kv = { .layers = LAYERS, .tokens_per_block = TOKENS, .k_bytes_per_token = KV_BYTES,
                                  .v_bytes_per_token = KV_BYTES, .dtype = "bfloat16" };
static const uint32_t groups4[4] = { 2, 2, 2, 2 };

static void three_conf(size_t i, unsigned port, char *buf, size_t size, void *userdata) {
        const char *heartbeat = userdata ? userdata : "500ms";
        if (i == 0)
                snprintf(buf, size,
                         "[Daemon]\nHostId=alpha\n[Arena:kv0]\nSize=32M\n"
                         "[Cluster]\nListen=127.0.0.1:%u\nClusterKeyFile=%s\nHeartbeatInterval=%s\n"
                         "[Peer:bravo-link]\nAddress=127.0.0.1:%u\nHostId=bravo\n"
                         "[Peer:charlie]\nAddress=127.0.0.1:%u\nHostId=charlie\n",
                         port, keyfile, heartbeat, port + 1, port + 2);
        else
                snprintf(buf, size,
                         "[Daemon]\nHostId=%s\n[Arena:kv0]\nSize=%s\n"
                         "[Cluster]\nListen=127.0.0.1:%u\nClusterKeyFile=%s\nHeartbeatInterval=%s\n"
                         "[Peer:alpha]\nAddress=127.0.0.1:%u\nHostId=alpha\n",
                         i == 1 ? "bravo" : "charlie", i == 1 ? "6M" : "32M", port + (unsigned)i, keyfile, heartbeat,
                         port);
}

/* The three daemons name each other's ports: harness_start_cluster() retries a set of
 * ports another process took meanwhile. */
static char faultfile[128];

/* What fault-peer.c (preloaded into the three daemons) does: in the daemon pid, a send()
 * of a peer frame of type fails with EPIPE; every fdatasync() takes sync_ms longer. */
static void fault_set(pid_t pid, unsigned type, unsigned sync_ms) {
        FILE *f = fopen(faultfile, "we");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "%d %x %u\n", (int)pid, type, sync_ms);
        ck_assert_int_eq(fclose(f), 0);
}

/* In the daemon pid, frames of type go out with payload byte offset XORed with mask. */
static void fault_flip(pid_t pid, unsigned type, unsigned offset, unsigned mask) {
        FILE *f = fopen(faultfile, "we");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "%d %x 0 %x %x\n", (int)pid, type, offset, mask);
        ck_assert_int_eq(fclose(f), 0);
}

static void fault_clear(void) {
        (void)unlink(faultfile);
}

static bool epdd_alive(Harness *hx) {
        int status;
        return waitpid(hx->epdd_pid, &status, WNOHANG) == 0;
}

static const char *setup_heartbeat; /* HeartbeatInterval= of the next setup(), NULL: 500ms */

static void setup(void) {
        /* Under the run's directory: check_run() removes it even after a failed test,
         * which never reaches its teardown. */
        const char *run = getenv("EPD_TEST_RUN_DIR");
        snprintf(faultfile, sizeof faultfile, "%s/handoff-fault-%d", run ? run : "/tmp", (int)getpid());
        fault_clear();
        snprintf(keyfile, sizeof keyfile, "%s/handoff-key-%d", run ? run : "/tmp", (int)getpid());
        int fd = open(keyfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, "handoff-test-cluster-key-0123456789\n", 36), 36);
        close(fd);
        Harness *all[3] = { &ha, &hb, &hc };
        /* Every daemon carries fault-peer.c, idle until a test writes its file. */
        const char *asan = getenv("ASAN_OPTIONS");
        char *old_asan = asan ? strdup(asan) : NULL, env[1024];
        snprintf(env, sizeof env, "%s%sverify_asan_link_order=0", asan ? asan : "", asan && *asan ? ":" : "");
        ck_assert_int_eq(setenv("ASAN_OPTIONS", env, 1), 0);
        ck_assert_int_eq(setenv("LD_PRELOAD", getenv("FAULT_PEER"), 1), 0);
        ck_assert_int_eq(setenv("EPD_FAULT_PEER_FILE", faultfile, 1), 0);
        int r = harness_start_cluster(all, 3, three_conf, (void *)setup_heartbeat);
        unsetenv("LD_PRELOAD");
        if (old_asan)
                setenv("ASAN_OPTIONS", old_asan, 1);
        else
                unsetenv("ASAN_OPTIONS");
        free(old_asan);
        if (r < 0)
                unlink(keyfile);
        ck_assert_msg(r == 0, "cannot start the three daemons: %s", strerror(-r));
        harness_direct_address(&ha, addr_a, sizeof addr_a);
        harness_direct_address(&hb, addr_b, sizeof addr_b);
        harness_direct_address(&hc, addr_c, sizeof addr_c);
}

/* Tens of thousands of writes take an ASan build's daemons seconds of their loops: a
 * heartbeat bound of 4 x 2 s, not 4 x 500 ms, for the tests that move them. */
static void setup_slow_heartbeat(void) {
        setup_heartbeat = "2s";
        setup();
        setup_heartbeat = NULL;
}

static void teardown(void) {
        fault_clear();
        harness_done(&ha);
        harness_done(&hb);
        harness_done(&hc);
        unlink(keyfile);
}

static epd_client *worker(const char *address, const char *role) {
        epd_client *c = NULL;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, role, "model", "cpu", &kv, NULL), 0);
        return c;
}

static char *make_sequence(epd_client *c, uint32_t n, uint64_t *offs) {
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        const char *path;
        size_t sz;
        const void *o;
        int r = epd__call(c, "/org/epd1/pages", "org.epd1.Pages", "CreateSequence", &reply, "su", "kv0", n);
        ck_assert_msg(r == 0, "CreateSequence: %s", epd_last_error_message(c));
        ck_assert_int_ge(sd_bus_message_read(reply, "o", &path), 0);
        char *p = strdup(path);
        sd_bus_message_unref(reply);
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, p, "org.epd1.Sequence", "Offsets", &e, &reply, "at"), 0);
        ck_assert_int_ge(sd_bus_message_read_array(reply, 't', &o, &sz), 0);
        if (offs)
                memcpy(offs, o, sz);
        sd_bus_message_unref(reply);
        return p;
}

static uint8_t pattern(uint32_t page, uint32_t layer, uint32_t k) {
        return (uint8_t)(page * 29 + layer * 11 + k * 3 + 7);
}

static bool layers_equal(const uint8_t *base, const uint64_t *offs, uint32_t n, uint32_t first, uint32_t count) {
        for (uint32_t p = 0; p < n; p++)
                for (uint32_t l = first; l < first + count; l++)
                        for (uint32_t k = 0; k < LAYER_BYTES; k++)
                                if (base[offs[p] + (uint64_t)l * LAYER_BYTES + k] != pattern(p, l, k))
                                        return false;
        return true;
}

/* Pages of c's pools (arena NULL: all of them): in use (total - free) or free. */
static uint64_t pool_pages(epd_client *c, const char *arena, bool free_ones) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        uint64_t n = 0;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, "/org/epd1/pages", "org.epd1.Pages", "Pools", &e, &reply,
                                             "a(sttttttttttt)"), 0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(sttttttttttt)"), 0);
        const char *name;
        uint64_t v[11];
        while (sd_bus_message_read(reply, "(sttttttttttt)", &name, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                                   &v[7], &v[8], &v[9], &v[10]) > 0)
                if (!arena || strcmp(name, arena) == 0)
                        n += free_ones ? v[2] : v[1] - v[2];
        sd_bus_message_unref(reply);
        return n;
}

static uint64_t arena_live(epd_client *c) {
        return pool_pages(c, NULL, false);
}

/* Every free page of c's kv0 taken: the next pages handed out there are the next ones
 * freed (a page whose freeing record is not durable yet is otherwise handed out only
 * when no other page is free). NULL if none was free. */
static char *kv0_fill(epd_client *c) {
        uint64_t n = pool_pages(c, "kv0", true);
        return n > 0 ? make_sequence(c, (uint32_t)n, NULL) : NULL;
}

typedef struct Cond {
        epd_client *c;
        const char *path;
        const char *state;
        uint64_t live;
} Cond;

static bool state_is(void *userdata) {
        Cond *w = userdata;
        epd_handoff_status s;
        return epd_handoff_get(w->c, w->path, &s) >= 0 && strcmp(s.state, w->state) == 0;
}

static bool live_is(void *userdata) {
        Cond *w = userdata;
        return arena_live(w->c) == w->live;
}

/* Prepare, retrying while the peers are still connecting. */
static int prepare_to(epd_client *c, const char *host, const char *rid, const char *seq, char **path,
                      uint64_t *token) {
        int r = -EHOSTUNREACH;
        for (int i = 0; i < 500; i++) {
                r = epd_handoff_prepare(c, rid, host, seq, groups4, 4, NULL, path, token);
                if (r != -EHOSTUNREACH)
                        break;
                usleep(20000);
        }
        return r;
}

static int prepare(epd_client *c, const char *rid, const char *seq, char **path, uint64_t *token) {
        return prepare_to(c, "bravo", rid, seq, path, token);
}

/* A pipelined handoff (every group ready at Prepare) from p to bravo, retried while the
 * peers connect, lands at d; both sides released. */
static void pipelined_lands(epd_client *p, epd_client *d, const char *rid, const char *seq) {
        epd_handoff_options o = { .ready = 4 };
        char *path = NULL;
        uint64_t token;
        int r = -EHOSTUNREACH;
        for (int i = 0; i < 500 && r == -EHOSTUNREACH; i++)
                if ((r = epd_handoff_prepare(p, rid, "bravo", seq, groups4, 4, &o, &path, &token)) == -EHOSTUNREACH)
                        usleep(20000);
        ck_assert_msg(r == 0, "%s", epd_last_error_message(p));
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, rid, &acc), 0);
        Cond t = { d, acc.path, "transferred" };
        ck_assert(harness_wait_for(state_is, &t, 5000));
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
}

START_TEST(test_cross_host) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        uint64_t src[N_PAGES];
        char *seq = make_sequence(p, N_PAGES, src);
        int i = epd_arena_find(p, "kv0");
        void *pb, *db;
        ck_assert_int_eq(epd_arena_map(p, (size_t)i, &pb), 0);
        ck_assert_int_eq(epd_arena_map(d, (size_t)epd_arena_find(d, "kv0"), &db), 0);
        for (uint32_t pg = 0; pg < N_PAGES; pg++)
                for (uint32_t l = 0; l < LAYERS; l++)
                        for (uint32_t k = 0; k < LAYER_BYTES; k++)
                                ((uint8_t *)pb)[src[pg] + (uint64_t)l * LAYER_BYTES + k] = pattern(pg, l, k);

        /* The decode worker waits on its ring for the handoff to arrive (no polling),
         * and follows its groups there. */
        epd_ring_client *dr;
        struct epd_ring_record rec;
        ck_assert_int_eq(epd_ring_open(d, 64, 64, &dr), 0);
        ck_assert_int_eq(epd_ring_accept(dr, "000000000000000000000000000000a1", 10000000, 1), 0);
        char *path;
        uint64_t token;
        ck_assert_msg(prepare(p, "000000000000000000000000000000a1", seq, &path, &token) == 0, "Prepare: %s",
                      epd_last_error_message(p));
        do
                ck_assert_int_eq(epd_ring_next(dr, &rec, 5000000), 0);
        while (rec.opcode != EPD_RING_EV_HANDOFF_ACCEPTED);
        ck_assert_uint_eq(rec.token, token);
        ck_assert_uint_eq(rec.arg0, N_PAGES);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, "000000000000000000000000000000a1", &acc), 0);
        ck_assert_uint_eq(acc.token, token);
        ck_assert_uint_eq(acc.n_pages, N_PAGES);
        for (uint32_t g = 0; g < 4; g++) {
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
                do
                        ck_assert_int_eq(epd_ring_next(dr, &rec, 5000000), 0);
                while (rec.opcode != EPD_RING_EV_GROUP_PROGRESS);
                ck_assert_uint_eq(rec.group, g + 1);
                ck_assert(layers_equal(db, acc.offsets, N_PAGES, 0, 2 * (g + 1)));
        }
        epd_ring_close(dr);
        /* alpha calls bravo's section [Peer:bravo-link]: its connections' telemetry (and
         * so the backpressure its handoff window asks for by host id, and every metric's
         * `peer` label) is keyed by the host id. */
        int kernel = 0;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(sd_bus_get_property_trivial(p->bus, NULL, "/org/epd1/telemetry", "org.epd1.Telemetry",
                                                     "KernelTelemetry", &e, 'b', &kernel),
                         0);
        if (kernel) {
                ck_assert(harness_telemetry_lists(p->bus, "bravo"));
                ck_assert(!harness_telemetry_lists(p->bus, "bravo-link"));
        } else
                printf("test_cross_host: kernel telemetry unavailable here: its peer keys not checked\n");
        char *dseq;
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        Cond c = { p, path, "committed" };
        ck_assert(harness_wait_for(state_is, &c, 5000));
        epd_handoff_status s;
        ck_assert_int_eq(epd_handoff_get(d, acc.path, &s), 0);
        ck_assert_uint_eq(s.bytes, (uint64_t)N_PAGES * PAGE_SIZE);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd__call(d, dseq, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        ck_assert_uint_eq(arena_live(d), 0);
        ck_assert_int_eq(epd__call(p, seq, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        ck_assert_uint_eq(arena_live(p), 0);
        free(dseq);
        free(path);
        free(seq);
        epd_handoff_accepted_done(&acc);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

START_TEST(test_faults) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path, *path2;
        uint64_t token;

        /* Admission: bravo's 6 MiB arena holds fewer than 2 x 64 pages of 64 KiB. */
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000b1", seq, &path, &token), 0);
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000b2", seq, &path2, &token), -ENOSPC);
        ck_assert_str_eq(epd_last_error_name(p), "org.epd1.Error.NoSpace");

        /* The decode worker dies after Accept: both sides roll back, bravo frees the pages. */
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                epd_client *dd = NULL;
                epd_handoff_accepted acc;
                if (epd_connect(addr_b, &dd) < 0 || epd_register(dd, "decode", "model", "cpu", &kv, NULL) < 0 ||
                    epd_handoff_accept(dd, "000000000000000000000000000000b1", &acc) < 0)
                        _exit(1);
                kill(getpid(), SIGKILL);
                _exit(2);
        }
        int st;
        ck_assert_int_eq(waitpid(pid, &st, 0), pid);
        ck_assert(WIFSIGNALED(st));
        Cond c = { p, path, "rolled-back" };
        ck_assert(harness_wait_for(state_is, &c, 3000));
        epd_handoff_status s;
        ck_assert_int_eq(epd_handoff_get(p, path, &s), 0);
        ck_assert_str_eq(s.cause, "worker-gone");
        Cond free_b = { .c = d, .live = 0 };
        ck_assert(harness_wait_for(live_is, &free_b, 3000));
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);

        /* bravo is killed with SIGKILL mid-transfer: alpha rolls back within the bound. */
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000b3", seq, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 0), 0);
        kill(hb.epdd_pid, SIGKILL);
        waitpid(hb.epdd_pid, &st, 0);
        hb.epdd_pid = 0;
        Cond c2 = { p, path, "rolled-back" };
        ck_assert_msg(harness_wait_for(state_is, &c2, 3000), "no rollback within 3 s of the peer's death");
        ck_assert_int_eq(epd_handoff_get(p, path, &s), 0);
        ck_assert(strcmp(s.cause, "peer-down") == 0 || strcmp(s.cause, "transfer-failed") == 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 1), -ESTALE);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd__call(p, seq, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        Cond free_a = { .c = p, .live = 0 };
        ck_assert(harness_wait_for(live_is, &free_a, 3000)); /* no lease left behind */
        free(path);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

START_TEST(test_source_dies) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path;
        uint64_t token;
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000c1", seq, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, "000000000000000000000000000000c1", &acc), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, 0), 0);
        ck_assert_uint_eq(arena_live(d), N_PAGES);
        /* alpha dies: bravo's side rolls back within the heartbeat bound, pages free. */
        int st;
        kill(ha.epdd_pid, SIGKILL);
        waitpid(ha.epdd_pid, &st, 0);
        ha.epdd_pid = 0;
        Cond c = { d, acc.path, "rolled-back" };
        ck_assert_msg(harness_wait_for(state_is, &c, 3000), "no rollback within 3 s of the peer's death");
        epd_handoff_status s;
        ck_assert_int_eq(epd_handoff_get(d, acc.path, &s), 0);
        /* Or the write of group 0 that the death cut short, when one was arriving. */
        ck_assert_msg(strcmp(s.cause, "peer-down") == 0 || strcmp(s.cause, "transfer-failed") == 0, "%s", s.cause);
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, NULL), -ESTALE);
        Cond free_b = { .c = d, .live = 0 };
        ck_assert(harness_wait_for(live_is, &free_b, 3000));
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(seq);
        epd_disconnect(d);
        p = epd_disconnect(p);
}
END_TEST

/* Three hosts: alpha hands off to bravo and to charlie at once; bravo dies mid-transfer;
 * the handoff to charlie is not disturbed and commits, the one to bravo rolls back. */
START_TEST(test_three_hosts) {
        epd_client *p = worker(addr_a, "prefill"), *db = worker(addr_b, "decode"), *dc = worker(addr_c, "decode");
        char *seq1 = make_sequence(p, N_PAGES, NULL), *seq2 = make_sequence(p, N_PAGES, NULL);
        char *pb, *pc, *dseq;
        uint64_t tb, tc;
        ck_assert_int_eq(prepare_to(p, "bravo", "000000000000000000000000000000d1", seq1, &pb, &tb), 0);
        ck_assert_int_eq(prepare_to(p, "charlie", "000000000000000000000000000000d2", seq2, &pc, &tc), 0);
        epd_handoff_accepted ab, ac;
        ck_assert_int_eq(epd_handoff_accept(db, "000000000000000000000000000000d1", &ab), 0);
        ck_assert_int_eq(epd_handoff_accept(dc, "000000000000000000000000000000d2", &ac), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, pb, 0), 0);
        ck_assert_int_eq(epd_handoff_layer_group_ready(p, pc, 0), 0);
        int st;
        kill(hb.epdd_pid, SIGKILL);
        waitpid(hb.epdd_pid, &st, 0);
        hb.epdd_pid = 0;
        for (uint32_t g = 1; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, pc, g), 0);
        Cond c1 = { p, pb, "rolled-back" };
        ck_assert(harness_wait_for(state_is, &c1, 3000));
        Cond c2 = { dc, ac.path, "transferred" };
        ck_assert(harness_wait_for(state_is, &c2, 5000));
        ck_assert_int_eq(epd_handoff_commit(dc, ac.path, &dseq), 0);
        Cond c3 = { p, pc, "committed" };
        ck_assert(harness_wait_for(state_is, &c3, 3000));
        ck_assert_int_eq(epd_handoff_release(p, pb), 0);
        ck_assert_int_eq(epd_handoff_release(p, pc), 0);
        ck_assert_int_eq(epd_handoff_release(dc, ac.path), 0);
        ck_assert_int_eq(epd__call(dc, dseq, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        ck_assert_uint_eq(arena_live(dc), 0);
        ck_assert_int_eq(epd__call(p, seq1, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        ck_assert_int_eq(epd__call(p, seq2, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        Cond free_a = { .c = p, .live = 0 };
        ck_assert(harness_wait_for(live_is, &free_a, 3000));
        epd_handoff_accepted_done(&ab);
        epd_handoff_accepted_done(&ac);
        free(seq1);
        free(seq2);
        free(pb);
        free(pc);
        free(dseq);
        epd_disconnect(p);
        epd_disconnect(db);
        epd_disconnect(dc);
}
END_TEST

/* Two attempts of one request at bravo: alpha's, then a newer one prepared on bravo
 * itself. The newer rolls the older back (alpha sees it rolled back at once, not at its
 * timeout); only the newer is accepted and committed, and nothing is left. Both stayed
 * live: alpha's deaf to its messages (the request map names one attempt), and able to
 * commit with no journal entry of its own (the journal keeps the newest). */
START_TEST(test_newer_attempt_fences_another_sources) {
        epd_client *pa = worker(addr_a, "prefill"), *pb = worker(addr_b, "prefill"), *d = worker(addr_b, "decode");
        const char *id = "000000000000000000000000000000f1";
        char *seq_a = make_sequence(pa, N_PAGES, NULL), *seq_b, *path_a, *path_b, *dseq = NULL;
        uint64_t token_a, token_b;
        epd_handoff_accepted acc;

        ck_assert_int_eq(prepare(pa, id, seq_a, &path_a, &token_a), 0);
        seq_b = make_sequence(pb, N_PAGES / 4, NULL); /* bravo's 6 MiB hold alpha's 64 pages and these */
        ck_assert_int_eq(epd_handoff_prepare(pb, id, NULL, seq_b, groups4, 4, NULL, &path_b, &token_b), 0);
        ck_assert_uint_gt(token_b, token_a);
        Cond fenced = { pa, path_a, "rolled-back" };
        ck_assert_msg(harness_wait_for(state_is, &fenced, 3000), "alpha's older attempt stayed live");
        ck_assert_int_eq(epd_handoff_accept(d, id, &acc), 0);
        ck_assert_uint_eq(acc.token, token_b);
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(pb, path_b, g), 0);
        Cond arrived = { d, acc.path, "transferred" };
        ck_assert(harness_wait_for(state_is, &arrived, 5000));
        ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(pb, path_b), 0);
        ck_assert_int_eq(epd_handoff_release(pa, path_a), 0);
        ck_assert_int_eq(epd__call(d, dseq, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        ck_assert_int_eq(epd__call(pb, seq_b, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        ck_assert_int_eq(epd__call(pa, seq_a, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        Cond free_a = { .c = pa, .live = 0 }, free_b = { .c = d, .live = 0 };
        ck_assert(harness_wait_for(live_is, &free_a, 3000));
        ck_assert(harness_wait_for(live_is, &free_b, 3000));
        epd_handoff_accepted_done(&acc);
        free(seq_a);
        free(seq_b);
        free(path_a);
        free(path_b);
        free(dseq);
        epd_disconnect(pa);
        epd_disconnect(pb);
        epd_disconnect(d);
}
END_TEST

/* The TCP_USER_TIMEOUT (ms) of each TCP socket of process pid, through pidfd_getfd():
 * counts those equal to `a` and to `b`. False without pidfd_open() (a kernel before 5.6). */
static bool user_timeouts(pid_t pid, unsigned a, unsigned b, unsigned *n_a, unsigned *n_b) {
        char dir[64];
        int pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
        if (pidfd < 0 && errno == ENOSYS)
                return false;
        ck_assert_int_ge(pidfd, 0);
        snprintf(dir, sizeof dir, "/proc/%d/fd", (int)pid);
        DIR *d = opendir(dir);
        ck_assert_ptr_nonnull(d);
        *n_a = *n_b = 0;
        for (struct dirent *e; (e = readdir(d));) {
                int target = atoi(e->d_name), type = 0;
                unsigned ms = 0;
                socklen_t len = sizeof ms;
                if (e->d_name[0] == '.')
                        continue;
                int fd = (int)syscall(SYS_pidfd_getfd, pidfd, target, 0);
                if (fd < 0)
                        continue;
                if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &type, &(socklen_t){ sizeof type }) == 0 &&
                    type == IPPROTO_TCP && getsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &ms, &len) == 0) {
                        *n_a += ms == a;
                        *n_b += ms == b;
                }
                close(fd);
        }
        closedir(d);
        close(pidfd);
        return true;
}

/* A data stream the receiver parks (up to 10 s) keeps its sender's window closed: with
 * the heartbeat's TCP_USER_TIMEOUT (500 ms here) the kernel aborted it, and the whole
 * session with it, while the receiver answered every probe. Data streams carry the
 * heartbeat bound plus the longest park; the control connection keeps the heartbeat. */
START_TEST(test_data_streams_outlast_a_park) {
        if (geteuid() != 0) {
                printf("SKIP: not root, cannot look into epdd's sockets\n");
                return;
        }
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL), *path;
        uint64_t token;
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000f2", seq, &path, &token), 0);
        unsigned control = 0, data = 0;
        if (!user_timeouts(ha.epdd_pid, 500, 10500, &control, &data))
                printf("SKIP part: no pidfd_getfd() here\n");
        for (int i = 0; i < 300 && data == 0; i++) { /* the streams come up after the control connection */
                if (!user_timeouts(ha.epdd_pid, 500, 10500, &control, &data))
                        goto out;
                if (data == 0)
                        usleep(10000);
        }
        ck_assert_uint_ge(control, 1);
        ck_assert_msg(data >= 1, "no data stream of alpha carries the park's bound (%u at the heartbeat's)", control);
        unsigned bc, bd;
        user_timeouts(hb.epdd_pid, 500, 10500, &bc, &bd);
        ck_assert_uint_ge(bc, 1);
        ck_assert_uint_ge(bd, 1);
out:
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        ck_assert_int_eq(epd__call(p, seq, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        free(path);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* The path of this client's handoff in state, from the Handoffs property. */
static char *handoff_in_state(epd_client *c, const char *state) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        char *found = NULL;
        const char *op, *rid, *role, *st, *peer, *cause;
        uint32_t done, n;
        uint64_t bytes;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, "/org/epd1/handoffs", "org.epd1.Handoffs", "Handoffs", &e,
                                             &reply, "a(ossssuuts)"), 0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(ossssuuts)"), 0);
        while (sd_bus_message_read(reply, "(ossssuuts)", &op, &rid, &role, &st, &peer, &done, &n, &bytes, &cause) > 0)
                if (!found && strcmp(st, state) == 0)
                        found = strdup(op);
        sd_bus_message_unref(reply);
        return found;
}

static void on_prepared(epd_client *c, int error, const char *path, uint64_t token, void *userdata) {
        *(int *)userdata = error == 0 ? 1 : error;
}

/* Rollback of a handoff whose Prepare still waits for its destination: the rollback
 * answers and releases it; the method must not touch it after. */
START_TEST(test_rollback_pending_prepare) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path;
        uint64_t token;
        /* The peers are up (and a large handoff is not pipelined: it waits for bravo). */
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000e0", seq, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);
        ck_assert_int_eq(kill(hb.epdd_pid, SIGSTOP), 0);
        int res = 0;
        /* 4 MiB: above PipelineBytes=, so the Prepare waits for bravo's answer. */
        ck_assert_int_eq(epd_handoff_prepare_async(p, "000000000000000000000000000000e1", "bravo", seq, groups4, 4,
                                                   NULL, on_prepared, &res), 0);
        char *pending = NULL;
        for (int i = 0; i < 200 && !pending; i++) {
                (void)epd_process(p);
                pending = handoff_in_state(p, "preparing");
                if (!pending)
                        usleep(10000);
        }
        ck_assert_msg(pending, "no handoff waiting for its destination");
        int r = epd_handoff_rollback(p, pending);
        ck_assert_msg(r == 0 || r == -ENOENT || r == -ESTALE, "Rollback: %d %s", r, epd_last_error_message(p));
        ck_assert_int_eq(kill(hb.epdd_pid, SIGCONT), 0);
        for (int i = 0; i < 100 && res == 0; i++) {
                (void)epd_process(p);
                usleep(10000);
        }
        ck_assert_int_lt(res, 0); /* the Prepare's answer: rolled back */
        ck_assert_msg(epdd_alive(&ha), "alpha's epdd died");
        ck_assert_int_lt(epd_handoff_get(p, pending, &(epd_handoff_status){}), 0); /* gone */
        free(pending);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* bravo cannot write the ROLLBACK of a handoff its decode worker releases (the peer's
 * reset arrived, unread): the session ends, after the release has returned, not under
 * it. */
START_TEST(test_rollback_send_fails) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path;
        uint64_t token;
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000f1", seq, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, "000000000000000000000000000000f1", &acc), 0);
        fault_set(hb.epdd_pid, 0x0105, 0);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        /* The source learns it from the session's end. */
        Cond c = { p, path, "rolled-back" };
        ck_assert(harness_wait_for(state_is, &c, 3000));
        fault_clear();
        ck_assert_msg(epdd_alive(&hb), "bravo's epdd died");
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* bravo cannot write a PREPARE_OK: the same, from inside the handling of PREPARE. */
START_TEST(test_prepare_ok_send_fails) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path;
        uint64_t token;
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000f2", seq, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);
        fault_set(hb.epdd_pid, 0x0101, 0);
        int r = epd_handoff_prepare(p, "000000000000000000000000000000f3", "bravo", seq, groups4, 4, NULL, &path, &token);
        ck_assert_int_ne(r, 0); /* the session ended under it */
        fault_clear();
        usleep(200000);
        ck_assert_msg(epdd_alive(&hb), "bravo's epdd died");
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

typedef struct CommitArg {
        epd_client *d;
        const char *path;
        int r;
} CommitArg;

static void *commit_thread(void *userdata) {
        CommitArg *a = userdata;
        char *dseq = NULL;
        int r = epd_handoff_commit(a->d, a->path, &dseq);
        free(dseq);
        __atomic_store_n(&a->r, r, __ATOMIC_SEQ_CST);
        return NULL;
}

/* The source hears COMMIT only once the destination's commit record is durable: told
 * before, it drops its pages while a crash could still roll the destination back. */
START_TEST(test_commit_waits_for_durable) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path;
        uint64_t token;
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000f4", seq, &path, &token), 0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, "000000000000000000000000000000f4", &acc), 0);
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        Cond t = { d, acc.path, "transferred" };
        ck_assert(harness_wait_for(state_is, &t, 5000));
        fault_set(hb.epdd_pid, 0, 1500); /* bravo's disk: 1.5 s a sync */
        CommitArg a = { .d = d, .path = acc.path, .r = 1 };
        pthread_t th;
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        ck_assert_int_eq(pthread_create(&th, NULL, commit_thread, &a), 0);
        Cond c = { p, path, "committed" };
        /* The commit's record takes 1.5 s to become durable: the source must not hear
         * of the commit sooner (the reply and COMMIT then leave together). */
        ck_assert(harness_wait_for(state_is, &c, 10000));
        clock_gettime(CLOCK_MONOTONIC, &t1);
        ck_assert_int_eq(pthread_join(th, NULL), 0);
        fault_clear();
        double waited = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
        ck_assert_msg(waited > 1.2, "the source committed %.3f s after the Commit, before its record was durable",
                      waited);
        ck_assert_int_eq(a.r, 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A handoff of N_PAGES pages to bravo, too large to be pipelined (its PREPARE resumes
 * no parked stream), lands within 4 s, its bytes exact: the streams to bravo are not
 * held up by parked writes. */
static void large_handoff_lands(epd_client *p, epd_client *d, void *pb, void *db, const char *request) {
        char *path = NULL;
        uint64_t token;
        epd_handoff_options o = { .ready = 4 };
        epd_handoff_accepted acc;
        uint64_t big[N_PAGES];
        char *large = make_sequence(p, N_PAGES, big);
        for (uint32_t pg = 0; pg < N_PAGES; pg++)
                for (uint32_t l = 0; l < LAYERS; l++)
                        for (uint32_t k = 0; k < LAYER_BYTES; k++)
                                ((uint8_t *)pb)[big[pg] + (uint64_t)l * LAYER_BYTES + k] = pattern(pg, l, k);
        ck_assert_int_eq(epd_handoff_prepare(p, request, "bravo", large, groups4, 4, &o, &path, &token), 0);
        free(large);
        ck_assert_int_eq(epd_handoff_accept(d, request, &acc), 0);
        Cond t = { d, acc.path, "transferred" };
        ck_assert_msg(harness_wait_for(state_is, &t, 4000), "a later handoff on the same streams did not land");
        ck_assert(layers_equal(db, acc.offsets, N_PAGES, 0, LAYERS));
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
}

/* A pipelined handoff's destination pages may be ones a Release just freed: its bytes
 * land there only once that Release's record is durable, or a kill -9 in between would
 * bring the sequence back over them. bravo's disk is slow (1.5 s a sync): half a second
 * after the Prepare the released page still holds its own bytes; the handoff lands
 * once the record is durable. */
START_TEST(test_pipelined_into_freed_pages) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        uint64_t src, freed;
        char *seq = make_sequence(p, 1, &src), *gone = make_sequence(d, 1, &freed);
        void *pb, *db;
        ck_assert_int_eq(epd_arena_map(p, (size_t)epd_arena_find(p, "kv0"), &pb), 0);
        ck_assert_int_eq(epd_arena_map(d, (size_t)epd_arena_find(d, "kv0"), &db), 0);
        for (uint32_t l = 0; l < LAYERS; l++)
                for (uint32_t k = 0; k < LAYER_BYTES; k++)
                        ((uint8_t *)pb)[src + (uint64_t)l * LAYER_BYTES + k] = pattern(0, l, k);
        memset((uint8_t *)db + freed, 0xab, PAGE_SIZE);
        /* One handoff first, the disk as it is: the peers are up. */
        char *path = NULL;
        uint64_t token;
        epd_handoff_options o = { .ready = 4 };
        epd_handoff_accepted acc;
        Cond t = { d, NULL, "transferred" };
        pipelined_lands(p, d, "000000000000000000000000000000f6", seq);

        /* With older free pages at hand, a handoff right after a Release does not take
         * the page just freed, and waits for nothing: it lands while the DEL is still
         * being written. */
        fault_set(hb.epdd_pid, 0, 1500); /* bravo's disk: 1.5 s a sync */
        Cond released = { d, NULL, NULL, arena_live(d) - 1 };
        uint64_t t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(epd_sequence_release_nowait(d, gone), 0);
        ck_assert(harness_wait_for(live_is, &released, 5000));
        ck_assert_int_eq(epd_handoff_prepare(p, "000000000000000000000000000000e7", "bravo", seq, groups4, 4, &o, &path,
                                             &token),
                         0);
        ck_assert_int_eq(epd_handoff_accept(d, "000000000000000000000000000000e7", &acc), 0);
        t.path = acc.path;
        ck_assert(harness_wait_for(state_is, &t, 5000));
        uint64_t took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_msg(acc.offsets[0] != freed, "the handoff took the page just freed");
        ck_assert_msg(took < 1000000, "the handoff waited %" PRIu64 " us: for the DEL of a page it did not take", took);
        ck_assert(layers_equal(db, acc.offsets, 1, 0, LAYERS));
        fault_clear();
        ck_assert_int_eq(epd_flush(d, 5000000), 0); /* the Release's answer */
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(gone);
        gone = make_sequence(d, 1, &freed);
        memset((uint8_t *)db + freed, 0xab, PAGE_SIZE);

        char *filler = kv0_fill(d); /* the handoff takes the page the Release frees */
        fault_set(hb.epdd_pid, 0, 1500); /* bravo's disk: 1.5 s a sync */
        Cond freed_now = { d, NULL, NULL, arena_live(d) - 1 };
        ck_assert_int_eq(epd_sequence_release_nowait(d, gone), 0);
        ck_assert(harness_wait_for(live_is, &freed_now, 5000)); /* taken: its DEL is being written */
        ck_assert_int_eq(epd_handoff_prepare(p, "000000000000000000000000000000f7", "bravo", seq, groups4, 4, &o, &path,
                                             &token),
                         0);
        usleep(500000);
        size_t landed = 0;
        for (size_t k = 0; k < PAGE_SIZE; k++)
                landed += ((const uint8_t *)db)[freed + k] != 0xab;
        ck_assert_int_eq(epd_handoff_accept(d, "000000000000000000000000000000f7", &acc), 0);
        ck_assert_uint_eq(acc.n_pages, 1);
        ck_assert_msg(acc.offsets[0] == freed, "the handoff took page offset %" PRIu64 ", not the freed %" PRIu64,
                      acc.offsets[0], freed);
        ck_assert_msg(landed == 0, "%zu bytes of the handoff landed in the released page before its DEL was durable",
                      landed);
        t.path = acc.path;
        ck_assert(harness_wait_for(state_is, &t, 5000));
        ck_assert(layers_equal(db, acc.offsets, 1, 0, LAYERS));
        fault_clear();
        ck_assert_int_eq(epd_flush(d, 5000000), 0); /* the Release's answer */
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        epd_handoff_accepted_done(&acc);
        free(path);

        /* Parked, then gone before the record is durable (the source rolls back): the
         * stream resumes once it is durable (the gone handoff's writes refused), not at
         * the park's timeout (10 s) with the session reset under every other handoff: a
         * later handoff too large to be pipelined (its PREPARE resumes nothing) lands. */
        free(gone);
        gone = make_sequence(d, 1, &freed);
        fault_set(hb.epdd_pid, 0, 1500);
        freed_now.live = arena_live(d) - 1;
        ck_assert_int_eq(epd_sequence_release_nowait(d, gone), 0);
        ck_assert(harness_wait_for(live_is, &freed_now, 5000));
        ck_assert_int_eq(epd_handoff_prepare(p, "000000000000000000000000000000f8", "bravo", seq, groups4, 4, &o, &path,
                                             &token),
                         0);
        usleep(100000); /* its writes are parked at bravo */
        ck_assert_int_eq(epd_handoff_rollback(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);
        usleep(1600000); /* the DEL is durable */
        fault_clear();
        ck_assert_int_eq(epd_flush(d, 5000000), 0);
        if (filler)
                ck_assert_int_eq(epd_sequence_release(d, filler), 0);
        free(filler);
        large_handoff_lands(p, d, pb, db, "000000000000000000000000000000f9");
        free(seq);
        free(gone);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* One handoff to bravo first (the peers up), then a page of d's freed by a Release
 * whose record bravo's slow disk (1.5 s a sync, left on) has not made durable, with
 * every other page of kv0 taken (the filler returned): the next handoff to bravo
 * reserves that page, unsettled. */
static char *free_page_unsettled(epd_client *p, epd_client *d, const char *seq, const char *gone, const char *request) {
        pipelined_lands(p, d, request, seq);

        char *filler = kv0_fill(d);
        fault_set(hb.epdd_pid, 0, 1500);
        Cond freed_now = { d, NULL, NULL, arena_live(d) - 1 };
        ck_assert_int_eq(epd_sequence_release_nowait(d, gone), 0);
        ck_assert(harness_wait_for(live_is, &freed_now, 5000));
        return filler;
}

/* A pipelined handoff parked on destination pages whose freeing record is not durable
 * yet, accepted by the decode worker, is rolled back and prepared again at once by the
 * source: the retry takes the request's place, but the first attempt (still held by
 * the decode worker, its slot still mapped) is settled all the same when the record is
 * durable. Were it left unsettled, its parked writes would wait for the park's timeout
 * (10 s), and the session be reset under every handoff: a later handoff too large to be
 * pipelined lands. */
START_TEST(test_pipelined_retry_while_unsettled) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        uint64_t src, freed;
        char *seq = make_sequence(p, 1, &src), *gone = make_sequence(d, 1, &freed);
        void *pb, *db;
        ck_assert_int_eq(epd_arena_map(p, (size_t)epd_arena_find(p, "kv0"), &pb), 0);
        ck_assert_int_eq(epd_arena_map(d, (size_t)epd_arena_find(d, "kv0"), &db), 0);
        char *path = NULL, *retry = NULL;
        uint64_t token;
        epd_handoff_options o = { .ready = 4 };
        epd_handoff_accepted acc;
        char *filler = free_page_unsettled(p, d, seq, gone, "000000000000000000000000000000e1");
        int r;
        ck_assert_int_eq(epd_handoff_prepare(p, "000000000000000000000000000000e2", "bravo", seq, groups4, 4, &o, &path,
                                             &token),
                         0);
        ck_assert_int_eq(epd_handoff_accept_wait(d, "000000000000000000000000000000e2", 1000000, &acc), 0);
        usleep(100000); /* its writes are parked at bravo */
        ck_assert_int_eq(epd_handoff_rollback(p, path), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);
        /* At once: bravo takes it or has no page for it (NoSpace), either way the newer
         * attempt at the request. */
        r = epd_handoff_prepare(p, "000000000000000000000000000000e2", "bravo", seq, groups4, 4, &o, &retry, &token);
        ck_assert_msg(r == 0 || r == -ENOSPC, "the retry: %s", epd_last_error_message(p));
        usleep(1600000); /* the DEL is durable */
        fault_clear();
        ck_assert_int_eq(epd_flush(d, 5000000), 0);
        /* The first attempt settles (its own records' sync too) while the decode worker
         * still holds it, its slot mapped. */
        usleep(2500000);
        ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
        epd_handoff_accepted_done(&acc);
        if (retry)
                ck_assert_int_eq(epd_handoff_release(p, retry), 0);
        free(retry);
        if (filler)
                ck_assert_int_eq(epd_sequence_release(d, filler), 0);
        free(filler);

        large_handoff_lands(p, d, pb, db, "000000000000000000000000000000e3");
        ck_assert(!harness_log_has(&hb, "never announced"));
        free(seq);
        free(gone);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* epdd stopped while a pipelined destination (no worker's yet: it belongs to no
 * client) waits for its pages' freeing record: the journal answers the wait while the
 * daemon stops, before the handoffs go; the object's link to the answered wait is gone
 * with it (under ASan a write through it would abort the daemon: not a clean exit). */
START_TEST(test_stop_while_unsettled) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        uint64_t src, freed;
        char *seq = make_sequence(p, 1, &src), *gone = make_sequence(d, 1, &freed);
        char *path = NULL;
        uint64_t token;
        epd_handoff_options o = { .ready = 4 };
        char *filler = free_page_unsettled(p, d, seq, gone, "000000000000000000000000000000e4");
        ck_assert_int_eq(epd_handoff_prepare(p, "000000000000000000000000000000e5", "bravo", seq, groups4, 4, &o, &path,
                                             &token),
                         0);
        usleep(200000); /* bravo holds it, unsettled, its writes parked */
        epd_disconnect(d);
        ck_assert_int_eq(harness_stop_epdd(&hb), 0);
        fault_clear();
        (void)epd_handoff_release(p, path);
        free(path);
        free(filler);
        free(seq);
        free(gone);
        epd_disconnect(p);
}
END_TEST

/* The decode worker commits around the handoff's deadline, while the destination's
 * loop is held up (SIGSTOP) across it: when it resumes, the Commit, its expired timer
 * and the source's word are all waiting. The two sides end in the same state (the
 * destination decides and refuses a commit past its deadline; the source waits for its
 * word two heartbeats past the deadline), never source rolled back and destination
 * committed. */
START_TEST(test_commit_crosses_timeout) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path;
        uint64_t token;
        epd_handoff_options o = { .timeout_usec = 1500000 };
        int r = -EHOSTUNREACH;
        for (int i = 0; i < 500 && r == -EHOSTUNREACH; i++) {
                r = epd_handoff_prepare(p, "000000000000000000000000000000f5", "bravo", seq, groups4, 4, &o, &path,
                                        &token);
                if (r == -EHOSTUNREACH)
                        usleep(20000);
        }
        ck_assert_int_eq(r, 0);
        struct timespec t0, now;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        epd_handoff_accepted acc;
        ck_assert_int_eq(epd_handoff_accept(d, "000000000000000000000000000000f5", &acc), 0);
        for (uint32_t g = 0; g < 4; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        Cond t = { d, acc.path, "transferred" };
        ck_assert(harness_wait_for(state_is, &t, 1000));
        /* bravo stops just before the deadline and resumes after it; the decode commits
         * in between. */
        do {
                usleep(1000);
                clock_gettime(CLOCK_MONOTONIC, &now);
        } while ((now.tv_sec - t0.tv_sec) * 1000000000LL + (now.tv_nsec - t0.tv_nsec) < 1400000000LL);
        ck_assert_int_eq(kill(hb.epdd_pid, SIGSTOP), 0);
        usleep(150000);
        CommitArg a = { .d = d, .path = acc.path, .r = 1 };
        pthread_t th;
        ck_assert_int_eq(pthread_create(&th, NULL, commit_thread, &a), 0);
        usleep(100000);
        ck_assert_int_eq(kill(hb.epdd_pid, SIGCONT), 0);
        ck_assert_int_eq(pthread_join(th, NULL), 0);
        /* Both sides settle (a rollback on either side reaches the other at once). */
        epd_handoff_status s1 = {}, s2 = {};
        for (int i = 0; i < 300; i++) {
                ck_assert_int_eq(epd_handoff_get(p, path, &s1), 0);
                ck_assert_int_eq(epd_handoff_get(d, acc.path, &s2), 0);
                if (strcmp(s1.state, s2.state) == 0 &&
                    (strcmp(s1.state, "committed") == 0 || strcmp(s1.state, "rolled-back") == 0))
                        break;
                usleep(10000);
        }
        ck_assert_msg(strcmp(s1.state, s2.state) == 0, "source %s (%s), destination %s (%s); commit said %d",
                      s1.state, s1.cause, s2.state, s2.cause, a.r);
        ck_assert_int_eq(a.r == 0, strcmp(s2.state, "committed") == 0);
        epd_handoff_accepted_done(&acc);
        free(path);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

static uint64_t peer_disconnects(epd_client *c, const char *name) {
        epd_peer *peers = NULL;
        size_t n = 0;
        uint64_t v = UINT64_MAX;
        ck_assert_int_ge(epd_list_peers(c, &peers, &n), 0);
        for (size_t i = 0; i < n; i++)
                if (strcmp(peers[i].host_id, name) == 0)
                        v = peers[i].disconnects;
        epd_peers_free(peers, n);
        ck_assert_uint_ne(v, UINT64_MAX);
        return v;
}

/* A PREPARE bravo cannot read (alpha sets a flag no version knows, as a newer source
 * would): refused at once, as a protocol failure, and the session stays up. Before, it
 * was dropped: the source's Prepare waited for the 20 s answer bound, and a pipelined
 * source's data parked bravo's stream until the park timeout reset the session. */
START_TEST(test_unreadable_prepare_refused) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path = NULL;
        uint64_t token;
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000c1", seq, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);
        uint64_t disconnects = peer_disconnects(p, "bravo");

        /* PREPARE's flags are the little-endian u32 at payload offset 72. */
        fault_flip(ha.epdd_pid, 0x0100, 72, 0x80);
        uint64_t t0 = now_usec(CLOCK_MONOTONIC);
        int r = epd_handoff_prepare(p, "000000000000000000000000000000c2", "bravo", seq, groups4, 4, NULL, &path,
                                    &token);
        uint64_t took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_int_lt(r, 0);
        ck_assert_msg(took < 5 * USEC_PER_SEC, "the refused Prepare took %" PRIu64 " us", took);
        ck_assert_msg(strncmp(epd_last_error_name(p), "org.epd1.Error.", 15) == 0, "%s", epd_last_error_name(p));
        ck_assert_msg(strstr(epd_last_error_message(p), "protocol"), "%s: %s", epd_last_error_name(p),
                      epd_last_error_message(p));

        /* Pipelined: the groups' data follows the PREPARE at once. Its answer comes
         * once its record is durable: refused already then, or rolled back after. */
        epd_handoff_options o = { .ready = 4 };
        t0 = now_usec(CLOCK_MONOTONIC);
        r = epd_handoff_prepare(p, "000000000000000000000000000000c3", "bravo", seq, groups4, 4, &o, &path, &token);
        if (r < 0) {
                ck_assert_msg(strstr(epd_last_error_message(p), "(protocol)"), "%s: %s", epd_last_error_name(p),
                              epd_last_error_message(p));
        } else {
                Cond c = { p, path, "rolled-back" };
                ck_assert(harness_wait_for(state_is, &c, 5000));
                epd_handoff_status st;
                ck_assert_int_eq(epd_handoff_get(p, path, &st), 0);
                ck_assert_str_eq(st.cause, "protocol");
                ck_assert_int_eq(epd_handoff_release(p, path), 0);
                free(path);
        }
        took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_msg(took < 5 * USEC_PER_SEC, "the refused pipelined handoff took %" PRIu64 " us", took);
        fault_clear();

        /* The session was not reset: the next handoffs, plain and pipelined, land. */
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000c4", seq, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);
        pipelined_lands(p, d, "000000000000000000000000000000c5", seq);
        ck_assert_uint_eq(peer_disconnects(p, "bravo"), disconnects);
        ck_assert_msg(epdd_alive(&hb), "bravo's epdd died");
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* In the daemon pid, every write of a record to its WAL fails with ENOSPC (a full disk). */
static void fault_wal_full(pid_t pid) {
        FILE *f = fopen(faultfile, "we");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "%d 0 0 0 0 1\n", (int)pid);
        ck_assert_int_eq(fclose(f), 0);
}

/* alpha's journal refuses the PREPARED record it writes when bravo answers the Prepare:
 * the Prepare is not acknowledged (a restart would not know the handoff its caller goes
 * on with); it fails saying why, and bravo's reserved pages go back. */
/* The destination's reason for refusing reaches the caller as the same named error a
 * refusal on one host gives: bravo's arena has pages of another size (its first KV
 * layout had twice the layers), so no arena there can take alpha's pages: the caller
 * hears InvalidArgument with the destination's reason, not a bare Failed. */
START_TEST(test_remote_refusal_named) {
        static const epd_kv_layout kv2 = { .layers = 2 * LAYERS, .tokens_per_block = TOKENS,
                                           .k_bytes_per_token = KV_BYTES, .v_bytes_per_token = KV_BYTES,
                                           .dtype = "bfloat16" };
        epd_client *other = NULL;
        ck_assert_int_eq(epd_connect(addr_b, &other), 0);
        ck_assert_int_eq(epd_register(other, "decode", "model2", "cpu", &kv2, NULL), 0);
        epd_client *p = worker(addr_a, "prefill");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path = NULL;
        uint64_t token;
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000c1", seq, &path, &token), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(p), "org.epd1.Error.InvalidArgument");
        ck_assert_msg(strstr(epd_last_error_message(p), "refused") != NULL, "%s", epd_last_error_message(p));
        ck_assert_int_eq(epd__call(p, seq, "org.epd1.Sequence", "Release", NULL, NULL), 0);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(other);
}
END_TEST

/* 16 one-layer groups of 4 KiB pages (a write a page a group), every group ready at
 * Prepare, from alpha to charlie: two handoffs of 4097 and 3000 pages are 113552 writes,
 * past the 65536 a peer takes in flight. The groups past that bound wait for room
 * (`write-stalls`), alpha's loop posts at most 8192 of them a turn (`post-yields`), and
 * both handoffs land, bytes exact. They were rolled back as
 * transfer-failed, the first alone too (65552 writes), and a retry failed the same way. */
START_TEST(test_many_writes_wait_for_room) {
        enum { G = 16, N1 = 4097, N2 = 3000 };
        static const epd_kv_layout kv16 = { .layers = G, .tokens_per_block = 1, .k_bytes_per_token = 128,
                                            .v_bytes_per_token = 128, .dtype = "bfloat16" };
        static const uint32_t n_pages[2] = { N1, N2 };
        static const char *const rids[2] = { "000000000000000000000000000000e1", "000000000000000000000000000000e2" };
        uint32_t groups[G];
        for (uint32_t g = 0; g < G; g++)
                groups[g] = 1;
        epd_client *p = NULL, *d = NULL;
        ck_assert_int_eq(epd_connect(addr_a, &p), 0);
        ck_assert_int_eq(epd_register(p, "prefill", "model", "cpu", &kv16, NULL), 0);
        ck_assert_int_eq(epd_connect(addr_c, &d), 0);
        ck_assert_int_eq(epd_register(d, "decode", "model", "cpu", &kv16, NULL), 0);
        void *pb, *db;
        ck_assert_int_eq(epd_arena_map(p, (size_t)epd_arena_find(p, "kv0"), &pb), 0);
        ck_assert_int_eq(epd_arena_map(d, (size_t)epd_arena_find(d, "kv0"), &db), 0);
        char *seq[2], *path[2];
        uint64_t *src[2], token;
        epd_handoff_options o = { .ready = G };
        for (int h = 0; h < 2; h++) {
                src[h] = calloc(n_pages[h], sizeof *src[h]);
                ck_assert_ptr_nonnull(src[h]);
                seq[h] = make_sequence(p, n_pages[h], src[h]);
                for (uint32_t pg = 0; pg < n_pages[h]; pg++)
                        for (uint32_t k = 0; k < 4096; k++)
                                ((uint8_t *)pb)[src[h][pg] + k] = (uint8_t)(pg * 13 + k * 7 + (uint32_t)h * 101);
        }
        for (int h = 0; h < 2; h++) {
                int r = -EHOSTUNREACH;
                for (int i = 0; i < 500 && r == -EHOSTUNREACH; i++)
                        if ((r = epd_handoff_prepare(p, rids[h], "charlie", seq[h], groups, G, &o, &path[h], &token)) ==
                            -EHOSTUNREACH)
                                usleep(20000);
                ck_assert_msg(r == 0, "Prepare %d: %s", h, epd_last_error_message(p));
        }
        /* charlie's loop held up until alpha's posts (8192 a dispatch at most) reach
         * the bound, whatever charlie took before (113552 writes, 65536 in flight at
         * most), at most 3 s: well within the heartbeat bound (4 x 2 s). */
        ck_assert_int_eq(kill(hc.epdd_pid, SIGSTOP), 0);
        for (int i = 0; i < 150 && harness_handoff_counter(p->bus, "write-stalls") == 0; i++)
                usleep(20000);
        ck_assert_int_eq(kill(hc.epdd_pid, SIGCONT), 0);
        for (int h = 0; h < 2; h++) {
                epd_handoff_accepted acc;
                ck_assert_int_eq(epd_handoff_accept(d, rids[h], &acc), 0);
                ck_assert_uint_eq(acc.n_pages, n_pages[h]);
                Cond t = { d, acc.path, "transferred" };
                ck_assert_msg(harness_wait_for(state_is, &t, 60000), "handoff %d did not land", h);
                size_t bad = 0;
                for (uint32_t pg = 0; pg < n_pages[h]; pg++)
                        for (uint32_t k = 0; k < 4096; k++)
                                bad += ((uint8_t *)db)[acc.offsets[pg] + k] !=
                                       (uint8_t)(pg * 13 + k * 7 + (uint32_t)h * 101);
                ck_assert_msg(bad == 0, "handoff %d: %zu bytes differ", h, bad);
                char *dseq = NULL;
                ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
                Cond c = { p, path[h], "committed" };
                ck_assert(harness_wait_for(state_is, &c, 10000));
                ck_assert_int_eq(epd_handoff_release(d, acc.path), 0);
                ck_assert_int_eq(epd_handoff_release(p, path[h]), 0);
                ck_assert_int_eq(epd__call(d, dseq, "org.epd1.Sequence", "Release", NULL, NULL), 0);
                ck_assert_int_eq(epd__call(p, seq[h], "org.epd1.Sequence", "Release", NULL, NULL), 0);
                epd_handoff_accepted_done(&acc);
                free(dseq);
                free(path[h]);
                free(seq[h]);
                free(src[h]);
        }
        ck_assert_uint_gt(harness_handoff_counter(p->bus, "write-stalls"), 0);
        /* 4097 pages a group: every turn of alpha's loop posted at most 8192 writes. */
        ck_assert_uint_gt(harness_handoff_counter(p->bus, "post-yields"), 0);
        ck_assert_uint_eq(arena_live(p), 0);
        ck_assert_uint_eq(arena_live(d), 0);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

/* A COMMIT that reaches the source with more than HANDOFF_TURN_COMPLETIONS_MAX write
 * completions still queued there: the source takes 8192 of them before it, is still
 * TRANSFERRING, and applies the COMMIT once the rest are taken at the next turns. It
 * was dropped (handoff_commit(): -EBUSY, nothing retried): the source waited for it
 * until its deadline, pages held, and reported the committed handoff rolled back
 * (timeout). Set up: alpha's writes (64 one-layer groups of 64 bytes x 200 pages =
 * 12800 writes, pipelined) sit in the kernel's buffers while charlie is stopped; alpha
 * is stopped while charlie lands them, acknowledges and commits; alpha then reads the
 * acknowledgements and the COMMIT in one go. */
START_TEST(test_commit_behind_many_acks) {
        enum { G = 64, N = 200 };
        static const epd_kv_layout kv64 = { .layers = G, .tokens_per_block = 1, .k_bytes_per_token = 32,
                                            .v_bytes_per_token = 32, .dtype = "bfloat16" };
        static const char *rid = "000000000000000000000000000000f7";
        uint32_t groups[G];
        for (uint32_t g = 0; g < G; g++)
                groups[g] = 1;
        epd_client *p = NULL, *d = NULL;
        ck_assert_int_eq(epd_connect(addr_a, &p), 0);
        ck_assert_int_eq(epd_register(p, "prefill", "model", "cpu", &kv64, NULL), 0);
        ck_assert_int_eq(epd_connect(addr_c, &d), 0);
        ck_assert_int_eq(epd_register(d, "decode", "model", "cpu", &kv64, NULL), 0);
        char *seq = make_sequence(p, N, NULL), *path = NULL;
        uint64_t token;
        /* Peers up first: a small handoff to charlie lands. */
        {
                epd_handoff_options w = { .ready = G };
                char *wseq = make_sequence(p, 1, NULL), *wpath = NULL;
                int q = -EHOSTUNREACH;
                for (int i = 0; i < 500 && q == -EHOSTUNREACH; i++)
                        if ((q = epd_handoff_prepare(p, "000000000000000000000000000000f6", "charlie", wseq, groups, G,
                                                     &w, &wpath, &token)) == -EHOSTUNREACH)
                                usleep(20000);
                ck_assert_msg(q == 0, "warm-up Prepare: %s", epd_last_error_message(p));
                epd_handoff_accepted wacc;
                q = -ENOENT;
                for (int i = 0; i < 200 && q < 0; i++)
                        if ((q = epd_handoff_accept(d, "000000000000000000000000000000f6", &wacc)) < 0)
                                usleep(10000);
                ck_assert_int_eq(q, 0);
                Cond wt = { d, wacc.path, "transferred" };
                ck_assert(harness_wait_for(state_is, &wt, 5000));
                ck_assert_int_eq(epd_handoff_release(d, wacc.path), 0);
                ck_assert_int_eq(epd_handoff_release(p, wpath), 0);
                epd_handoff_accepted_done(&wacc);
                free(wpath);
                free(wseq);
        }
        epd_handoff_options o = { .ready = 0, .timeout_usec = 20 * USEC_PER_SEC };
        ck_assert_int_eq(kill(hc.epdd_pid, SIGSTOP), 0);
        int r = -EHOSTUNREACH;
        for (int i = 0; i < 500 && r == -EHOSTUNREACH; i++)
                if ((r = epd_handoff_prepare(p, rid, "charlie", seq, groups, G, &o, &path, &token)) == -EHOSTUNREACH)
                        usleep(20000);
        ck_assert_msg(r == 0, "Prepare: %s", epd_last_error_message(p));
        for (uint32_t g = 0; g < G; g++)
                ck_assert_int_eq(epd_handoff_layer_group_ready(p, path, g), 0);
        usleep(2000000); /* alpha pushes every write into the sockets */
        ck_assert_int_eq(kill(ha.epdd_pid, SIGSTOP), 0);
        ck_assert_int_eq(kill(hc.epdd_pid, SIGCONT), 0);
        epd_handoff_accepted acc;
        r = -ENOENT;
        for (int i = 0; i < 200 && r < 0; i++)
                if ((r = epd_handoff_accept(d, rid, &acc)) < 0)
                        usleep(10000);
        ck_assert_msg(r == 0, "Accept: %s", epd_last_error_message(d));
        Cond t = { d, acc.path, "transferred" };
        bool landed = harness_wait_for(state_is, &t, 10000);
        char *dseq = NULL;
        if (landed)
                ck_assert_int_eq(epd_handoff_commit(d, acc.path, &dseq), 0);
        ck_assert_int_eq(kill(ha.epdd_pid, SIGCONT), 0);
        ck_assert_msg(landed, "setup: not every write was in the sockets while alpha was stopped");
        Cond dc = { d, acc.path, "committed" };
        ck_assert(state_is(&dc));
        /* The destination committed: the source says so too, long before its deadline. */
        Cond c = { p, path, "committed" };
        bool ok = harness_wait_for(state_is, &c, 3000);
        epd_handoff_status st;
        ck_assert_int_ge(epd_handoff_get(p, path, &st), 0);
        ck_assert_msg(ok, "destination committed, source is '%s' after 3 s", st.state);
        epd_handoff_accepted_done(&acc);
        free(dseq);
        free(path);
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

START_TEST(test_prepared_record_refused) {
        epd_client *p = worker(addr_a, "prefill"), *d = worker(addr_b, "decode");
        char *seq = make_sequence(p, N_PAGES, NULL);
        char *path = NULL;
        uint64_t token;
        ck_assert_int_eq(prepare(p, "000000000000000000000000000000b1", seq, &path, &token), 0);
        ck_assert_int_eq(epd_handoff_release(p, path), 0);
        free(path);
        path = NULL;
        Cond idle = { d, NULL, NULL, arena_live(d) };

        /* The disk fills: the next record alpha writes fails, and the log refuses every
         * one after. A Clone is journaled before its reply. */
        fault_wal_full(ha.epdd_pid);
        sd_bus_message *reply = NULL;
        int r = epd__call(p, seq, "org.epd1.Sequence", "Clone", &reply, "");
        ck_assert_msg(r < 0, "a Clone was acknowledged with the log full");
        sd_bus_message_unref(reply);

        r = epd_handoff_prepare(p, "000000000000000000000000000000b2", "bravo", seq, groups4, 4, NULL, &path, &token);
        ck_assert_msg(r < 0, "a Prepare was acknowledged without its record");
        ck_assert_msg(strncmp(epd_last_error_name(p), "org.epd1.Error.", 15) == 0, "%s", epd_last_error_name(p));
        ck_assert_msg(strstr(epd_last_error_message(p), "cannot journal the Prepare"), "%s: %s",
                      epd_last_error_name(p), epd_last_error_message(p));
        /* bravo was told: what it reserved is free again. */
        ck_assert_msg(harness_wait_for(live_is, &idle, 5000), "bravo holds %" PRIu64 " pages, %" PRIu64 " before",
                      arena_live(d), idle.live);
        fault_clear();
        ck_assert_msg(epdd_alive(&ha), "alpha's epdd died");
        ck_assert_msg(epdd_alive(&hb), "bravo's epdd died");
        free(seq);
        epd_disconnect(p);
        epd_disconnect(d);
}
END_TEST

int main(void) {
        if (!getenv("EPDD")) {
                printf("SKIP: EPDD is not set (run through meson test)\n");
                return 77;
        }
        Suite *s = suite_create("handoff-peers");
        TCase *tc = tcase_create("handoff-peers");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_cross_host);
        tcase_add_test(tc, test_rollback_pending_prepare);
        tcase_add_test(tc, test_rollback_send_fails);
        tcase_add_test(tc, test_prepare_ok_send_fails);
        tcase_add_test(tc, test_commit_waits_for_durable);
        tcase_add_test(tc, test_commit_crosses_timeout);
        tcase_add_test(tc, test_pipelined_into_freed_pages);
        tcase_add_test(tc, test_pipelined_retry_while_unsettled);
        tcase_add_test(tc, test_stop_while_unsettled);
        tcase_add_test(tc, test_faults);
        tcase_add_test(tc, test_source_dies);
        tcase_add_test(tc, test_three_hosts);
        tcase_add_test(tc, test_newer_attempt_fences_another_sources);
        tcase_add_test(tc, test_data_streams_outlast_a_park);
        tcase_add_test(tc, test_unreadable_prepare_refused);
        tcase_add_test(tc, test_prepared_record_refused);
        tcase_add_test(tc, test_remote_refusal_named);
        suite_add_tcase(s, tc);
        TCase *tw = tcase_create("many-writes");
        tcase_add_checked_fixture(tw, setup_slow_heartbeat, teardown);
        tcase_set_timeout(tw, 120);
        tcase_add_test(tw, test_many_writes_wait_for_room);
        tcase_add_test(tw, test_commit_behind_many_acks);
        suite_add_tcase(s, tw);
        return check_run(s, CK_FORK_GETENV);
}
