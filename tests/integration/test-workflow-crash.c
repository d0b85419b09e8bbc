/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Workflows and the WAL end to end. A worker runs an agent workload (create, fork,
 * advance with segment matches, drop) while epdd is killed with SIGKILL at a random
 * moment; after each restart the worker re-attaches and checks that every
 * acknowledged transition is there and nothing else (at most the one call in flight
 * when epdd died). Also: named errors for a workflow whose sequences are not on the
 * daemon (after the restart), and the live introspection against the XML. */
#include <check.h>
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"
#include "macro.h"
#include "../check-main.h"

#define BRANCHES 64

static Harness h;

typedef struct Model {
        char id[64];
        unsigned n_branches;
        bool alive[BRANCHES];
        uint64_t steps[BRANCHES];
        uint32_t n_tokens[BRANCHES];
} Model;

static int call(sd_bus *bus, const char *member, sd_bus_message **reply, const char *types, ...) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        va_list ap;
        int r = sd_bus_message_new_method_call(bus, &m, NULL, "/org/epd1", "org.epd1.Workflow", member);
        if (r < 0)
                return r;
        va_start(ap, types);
        r = sd_bus_message_appendv(m, types, ap);
        va_end(ap);
        if (r < 0)
                return r;
        r = sd_bus_call(bus, m, 5 * 1000000, &e, reply);
        sd_bus_error_free(&e);
        return r;
}

static int call_tokens(sd_bus *bus, const char *member, sd_bus_message **reply, const char *wf, uint32_t branch,
                       const uint32_t *t, size_t n, const char *seq) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        int r = sd_bus_message_new_method_call(bus, &m, NULL, "/org/epd1", "org.epd1.Workflow", member);
        if (r >= 0)
                r = seq ? sd_bus_message_append(m, "o", seq) : sd_bus_message_append(m, "su", wf, branch);
        if (r >= 0)
                r = sd_bus_message_append_array(m, 'u', t, n * sizeof *t);
        if (r >= 0 && !seq)
                r = sd_bus_message_append(m, "b", 1);
        if (r < 0)
                return r;
        r = sd_bus_call(bus, m, 5 * 1000000, &e, reply);
        sd_bus_error_free(&e);
        return r;
}

/* A registered worker on its own connection, with a KV layout of 16 tokens per page. */
static sd_bus *worker(void) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus *bus;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_message_new_method_call(bus, &m, NULL, "/org/epd1", "org.epd1.Manager",
                                                        "RegisterWorker"),
                         0);
        ck_assert_int_ge(sd_bus_message_append(m, "sss", "prefill", "m", "cpu"), 0);
        ck_assert_int_ge(sd_bus_message_append(m, "a{sv}", 5, "kv.layers", "u", 2, "kv.tokens_per_block", "u", 16,
                                               "kv.k_bytes_per_token", "t", (uint64_t)64, "kv.v_bytes_per_token", "t",
                                               (uint64_t)64, "kv.dtype", "s", "bf16"),
                         0);
        int r = sd_bus_call(bus, m, 5 * 1000000, &e, &reply);
        ck_assert_msg(r >= 0, "RegisterWorker: %s", e.message);
        sd_bus_error_free(&e);
        return bus;
}

static char *new_sequence(sd_bus *bus, uint32_t pages) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        const char *path;
        int r = sd_bus_call_method(bus, NULL, "/org/epd1/pages", "org.epd1.Pages", "CreateSequence", &e, &reply, "su",
                                   "host0", pages);
        ck_assert_msg(r >= 0, "CreateSequence: %s", e.message);
        ck_assert_int_ge(sd_bus_message_read(reply, "o", &path), 0);
        sd_bus_error_free(&e);
        return strdup(path);
}

static void check_recovered(sd_bus *bus, const Model *acked, const Model *after) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        ck_assert_int_ge(call(bus, "Attach", NULL, "s", acked->id), 0);
        ck_assert_int_ge(call(bus, "GetBranches", &reply, "s", acked->id), 0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(ubotu)"), 0);
        Model got = {};
        uint32_t b, nt;
        int alive;
        const char *head;
        uint64_t steps;
        int r;
        while ((r = sd_bus_message_read(reply, "(ubotu)", &b, &alive, &head, &steps, &nt)) > 0) {
                ck_assert_uint_lt(b, BRANCHES);
                got.n_branches = b + 1;
                got.alive[b] = alive;
                got.steps[b] = alive ? steps : 0;
                got.n_tokens[b] = alive ? nt : 0;
        }
        ck_assert_int_ge(r, 0);
        /* Exactly the acknowledged state, or that plus the one call in flight. */
        bool same_acked = got.n_branches == acked->n_branches, same_after = got.n_branches == after->n_branches;
        for (unsigned i = 0; i < BRANCHES; i++) {
                if (got.alive[i] != acked->alive[i] || got.steps[i] != (acked->alive[i] ? acked->steps[i] : 0) ||
                    got.n_tokens[i] != (acked->alive[i] ? acked->n_tokens[i] : 0))
                        same_acked = false;
                if (got.alive[i] != after->alive[i] || got.steps[i] != (after->alive[i] ? after->steps[i] : 0) ||
                    got.n_tokens[i] != (after->alive[i] ? after->n_tokens[i] : 0))
                        same_after = false;
        }
        ck_assert_msg(same_acked || same_after, "recovered workflow %s matches neither the acknowledged state "
                                                "nor it plus the call in flight", acked->id);
}

static int kill_after(pid_t pid, unsigned usec) {
        pid_t k = fork();
        if (k == 0) {
                usleep(usec);
                kill(pid, SIGKILL);
                _exit(0);
        }
        return k;
}

START_TEST(test_crash_loop) {
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\n"), 0);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
        srand((unsigned)time(NULL));
        uint64_t x = (uint64_t)rand() << 1 | 1;
        unsigned total_acked = 0;

        for (int round = 0; round < 12; round++) {
                sd_bus *bus = worker();
                char *seq = new_sequence(bus, 4);
                uint32_t tokens[256];
                for (unsigned i = 0; i < 256; i++)
                        tokens[i] = i * 7 + (unsigned)round;
                _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
                const char *id, *head;
                ck_assert_int_ge(call_tokens(bus, "Create", &reply, NULL, 0, tokens, 64, seq), 0);
                ck_assert_int_ge(sd_bus_message_read(reply, "so", &id, &head), 0);
                Model acked = { .n_branches = 1 }, after;
                snprintf(acked.id, sizeof acked.id, "%s", id);
                acked.alive[0] = true;
                acked.n_tokens[0] = 64;

                pid_t killer = kill_after(h.epdd_pid, 5000 + (unsigned)(rand() % 200000));
                for (int op = 0;; op++) {
                        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
                        unsigned k = (unsigned)(x >> 33), b = k % acked.n_branches;
                        after = acked;
                        int r = 0;
                        if (!acked.alive[b])
                                continue;
                        switch (k % 5) {
                        case 0:
                                if (acked.n_branches >= BRANCHES)
                                        continue;
                                after.alive[after.n_branches] = true;
                                after.steps[after.n_branches] = acked.steps[b];
                                after.n_tokens[after.n_branches] = acked.n_tokens[b];
                                after.n_branches++;
                                r = call(bus, "Fork", NULL, "su", acked.id, b);
                                break;
                        case 4:
                                if (b == 0)
                                        continue;
                                after.alive[b] = false;
                                r = call(bus, "Drop", NULL, "su", acked.id, b);
                                break;
                        default: {
                                size_t n = 32 + (k >> 8) % 224;
                                /* Repeat part of the history elsewhere: segments to find. */
                                for (size_t i = 0; i < n; i++)
                                        tokens[i] = i < 40 ? i * 7 + (unsigned)round : (uint32_t)(k + i % 48);
                                after.steps[b]++;
                                after.n_tokens[b] = (uint32_t)n;
                                r = call_tokens(bus, "Advance", NULL, acked.id, b, tokens, n, NULL);
                                break;
                        }
                        }
                        if (r < 0)
                                break; /* epdd died under this call: it is the one in flight */
                        acked = after;
                        total_acked++;
                }
                int status;
                waitpid(killer, &status, 0);
                ck_assert_int_eq(waitpid(h.epdd_pid, &status, 0), h.epdd_pid);
                ck_assert(WIFSIGNALED(status));
                h.epdd_pid = 0;
                sd_bus_flush_close_unref(bus);
                free(seq);

                ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
                bus = worker();
                check_recovered(bus, &acked, &after);
                /* Its sequences did not survive the crash (no fd store here: the arena
                 * memory is new, so the journaled sequences are dropped at start): a
                 * named error, no crash. test-restart-crash has the fd store. */
                sd_bus_error e = SD_BUS_ERROR_NULL;
                _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *rep = NULL;
                ck_assert_int_ge(sd_bus_message_new_method_call(bus, &m, NULL, "/org/epd1", "org.epd1.Workflow", "Fork"), 0);
                ck_assert_int_ge(sd_bus_message_append(m, "su", acked.id, 0), 0);
                ck_assert_int_lt(sd_bus_call(bus, m, 5 * 1000000, &e, &rep), 0);
                /* (A workflow that reached its 64 branches is refused before its
                 * sequences are looked at.) */
                if (after.n_branches >= BRANCHES || acked.n_branches >= BRANCHES)
                        ck_assert(strcmp(e.name, "org.epd1.Error.Stale") == 0 ||
                                  strcmp(e.name, "org.epd1.Error.LimitExceeded") == 0);
                else
                        ck_assert_str_eq(e.name, "org.epd1.Error.Stale");
                sd_bus_error_free(&e);
                ck_assert_int_ge(call(bus, "Release", NULL, "s", acked.id), 0);
                sd_bus_flush_close_unref(bus);
        }
        printf("crash loop: 12 kill -9 restarts, %u acknowledged transitions checked\n", total_acked);
        ck_assert_uint_gt(total_acked, 12);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}
END_TEST

START_TEST(test_errors_introspection) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        /* Not a registered worker. */
        ck_assert_int_lt(sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Workflow", "Release", &e, NULL, "s",
                                            "00000000000000000000000000000000"),
                         0);
        ck_assert_str_eq(e.name, "org.epd1.Error.NotRegistered");
        sd_bus_error_free(&e);
        const char *src = getenv("SOURCE_ROOT");
        ck_assert_ptr_nonnull(src);
        char f[512];
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Workflow.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, NULL, "/org/epd1", f), 0);
        sd_bus_flush_close_unref(bus);

        bus = worker();
        ck_assert_int_lt(sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Workflow", "Fork", &e, NULL, "su",
                                            "00000000000000000000000000000000", 0),
                         0);
        ck_assert_str_eq(e.name, "org.epd1.Error.NotFound");
        sd_bus_error_free(&e);
        /* Another client's workflow. */
        char *seq = new_sequence(bus, 2);
        uint32_t t[40] = { 1, 2, 3 };
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *id, *head;
        ck_assert_int_ge(call_tokens(bus, "Create", &reply, NULL, 0, t, 40, seq), 0);
        ck_assert_int_ge(sd_bus_message_read(reply, "so", &id, &head), 0);
        char wid[64];
        snprintf(wid, sizeof wid, "%s", id);
        sd_bus *other = worker();
        ck_assert_int_lt(sd_bus_call_method(other, NULL, "/org/epd1", "org.epd1.Workflow", "Fork", &e, NULL, "su", wid, 0),
                         0);
        ck_assert_str_eq(e.name, "org.epd1.Error.PermissionDenied");
        sd_bus_error_free(&e);
        ck_assert_int_lt(sd_bus_call_method(other, NULL, "/org/epd1", "org.epd1.Workflow", "Attach", &e, NULL, "s", wid), 0);
        ck_assert_str_eq(e.name, "org.epd1.Error.Busy");
        sd_bus_error_free(&e);
        /* The owner goes: its workflow is released (Count back to 0). */
        sd_bus_flush_close_unref(bus);
        uint32_t count = 1;
        for (int i = 0; i < 100 && count; i++) {
                usleep(20000);
                ck_assert_int_ge(sd_bus_get_property_trivial(other, NULL, "/org/epd1", "org.epd1.Workflow", "Count", &e,
                                                             'u', &count),
                                 0);
        }
        ck_assert_uint_eq(count, 0);
        sd_bus_flush_close_unref(other);
        free(seq);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}
END_TEST

/* Replies to the test's two pipelined calls, in arrival order. */
static struct {
        char order[2][16];
        unsigned n, branches;
} arrived;

static int on_reply(sd_bus_message *m, void *userdata, sd_bus_error *e) {
        const char *what = userdata;
        ck_assert_msg(!sd_bus_message_is_method_error(m, NULL), "%s: %s", what, sd_bus_message_get_error(m)->message);
        if (strcmp(what, "GetBranches") == 0) {
                uint32_t b, nt;
                int alive;
                const char *head;
                uint64_t steps;
                ck_assert_int_ge(sd_bus_message_enter_container(m, 'a', "(ubotu)"), 0);
                while (sd_bus_message_read(m, "(ubotu)", &b, &alive, &head, &steps, &nt) > 0)
                        arrived.branches++;
        }
        snprintf(arrived.order[arrived.n++], sizeof arrived.order[0], "%s", what);
        return 0;
}

/* GetBranches shows no transition before it is durable: its reply waits for the records
 * appended before it, as the transition's own reply does. It answered at once, listing a
 * Fork whose record a crash could still lose (the Fork's caller not yet told). fdatasync
 * made 400 ms slow (fault-peer.c), a Fork and a GetBranches pipelined: the Fork's reply
 * comes first, and GetBranches lists its branch. */
START_TEST(test_reads_after_durable) {
        char fault[400];
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\n"), 0);
        snprintf(fault, sizeof fault, "%s/fault", h.dir);
        ck_assert_int_eq(harness_start_epdd_preloaded(&h, getenv("FAULT_PEER"), "EPD_FAULT_PEER_FILE", fault), 0);
        sd_bus *bus = worker();
        char *seq = new_sequence(bus, 4);
        uint32_t tokens[64];
        for (unsigned i = 0; i < 64; i++)
                tokens[i] = i;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *id, *head;
        ck_assert_int_ge(call_tokens(bus, "Create", &reply, NULL, 0, tokens, 64, seq), 0);
        ck_assert_int_ge(sd_bus_message_read(reply, "so", &id, &head), 0);
        FILE *f = fopen(fault, "we");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "%d 0 400\n", (int)h.epdd_pid); /* slow fdatasync, no other fault */
        fclose(f);
        arrived.n = arrived.branches = 0;
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, NULL, "/org/epd1", "org.epd1.Workflow", "Fork", on_reply,
                                                  (void *)"Fork", "su", id, 0),
                         0);
        ck_assert_int_ge(sd_bus_call_method_async(bus, NULL, NULL, "/org/epd1", "org.epd1.Workflow", "GetBranches",
                                                  on_reply, (void *)"GetBranches", "s", id),
                         0);
        for (int i = 0; i < 500 && arrived.n < 2; i++) {
                int r = sd_bus_process(bus, NULL);
                ck_assert_int_ge(r, 0);
                if (r == 0)
                        ck_assert_int_ge(sd_bus_wait(bus, 20000), 0);
        }
        ck_assert_uint_eq(arrived.n, 2);
        ck_assert_msg(strcmp(arrived.order[0], "Fork") == 0, "GetBranches answered before the Fork was durable");
        ck_assert_uint_eq(arrived.branches, 2);
        ck_assert_int_eq(unlink(fault), 0);
        free(seq);
        sd_bus_flush_close_unref(bus);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}
END_TEST

/* The same through libepd, as a worker would. */
START_TEST(test_libepd) {
        static const epd_kv_layout kv = { .layers = 2, .tokens_per_block = 16, .k_bytes_per_token = 64,
                                          .v_bytes_per_token = 64, .dtype = "bf16" };
        char address[512];
        epd_client *c;
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &kv, NULL), 0);
        char *seq = NULL, *wf = NULL, *head = NULL, *head2 = NULL, *head3 = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &seq, NULL, NULL), 0);
        uint32_t t[64], t2[96];
        for (unsigned i = 0; i < 64; i++)
                t[i] = 1000 + i;
        ck_assert_int_eq(epd_workflow_create(c, seq, t, 64, &wf, &head), 0);
        ck_assert_uint_eq(strlen(wf), 32);
        uint32_t b;
        ck_assert_int_eq(epd_workflow_fork(c, wf, 0, &b, &head2), 0);
        ck_assert_uint_eq(b, 1);
        /* Same first 32 tokens (2 pages), then page 3 of the predecessor at token 64. */
        memcpy(t2, t, 32 * sizeof *t);
        for (unsigned i = 32; i < 64; i++)
                t2[i] = 5000 + i;
        memcpy(t2 + 64, t + 48, 16 * sizeof *t);
        for (unsigned i = 80; i < 96; i++)
                t2[i] = 7000 + i;
        uint32_t prefix;
        epd_segment *segs = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_workflow_advance(c, wf, 1, t2, 96, true, &head3, &prefix, &segs, &n), 0);
        ck_assert_uint_eq(prefix, 2);
        ck_assert_uint_eq(n, 1);
        ck_assert_uint_eq(segs[0].prev_block, 3);
        ck_assert_uint_eq(segs[0].new_offset, 64);
        ck_assert(segs[0].aligned);
        free(segs);
        epd_workflow_branch *br = NULL;
        size_t nbr = 0;
        ck_assert_int_eq(epd_workflow_get_branches(c, wf, &br, &nbr), 2);
        ck_assert_uint_eq(nbr, 2);
        ck_assert(br[0].alive && br[1].alive);
        ck_assert_str_eq(br[1].head, head3);
        ck_assert_uint_eq(br[1].steps, 1);
        ck_assert_uint_eq(br[1].n_tokens, 96);
        ck_assert_uint_eq(br[0].n_tokens, 64);
        epd_workflow_branches_free(br, nbr);
        ck_assert_int_eq(epd_workflow_attach(c, wf), 0);
        ck_assert_int_eq(epd_workflow_drop(c, wf, 1), 0);
        ck_assert_int_eq(epd_workflow_get_branches(c, wf, &br, &nbr), 2);
        ck_assert(br[0].alive && !br[1].alive);
        ck_assert_str_eq(br[1].head, "/");
        epd_workflow_branches_free(br, nbr);
        ck_assert_int_eq(epd_workflow_drop(c, wf, 1), -ENOENT);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.NotFound");
        ck_assert_int_eq(epd_workflow_release(c, wf), 0);
        ck_assert_int_eq(epd_workflow_get_branches(c, wf, &br, &nbr), -ENOENT);
        free(seq);
        free(wf);
        free(head);
        free(head2);
        free(head3);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}
END_TEST

int main(void) {
        Suite *s = suite_create("workflow-crash");
        TCase *tc = tcase_create("workflow-crash");
        tcase_set_timeout(tc, 240);
        tcase_add_test(tc, test_errors_introspection);
        tcase_add_test(tc, test_libepd);
        tcase_add_test(tc, test_reads_after_durable);
        tcase_add_test(tc, test_crash_loop);
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
