/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* KV pages and sequences over the bus: a client creates, writes, clones (zero copy),
 * writes again (copy-on-write done by the daemon in the shared arena), publishes blocks
 * and finds them again by prefix, releases; a client killed mid-way leaves zero
 * retained pages; a second client cannot touch the first's sequences without a grant.
 * The live introspection matches dbus/org.epd1.Pages.xml and org.epd1.Sequence.xml.
 * Built twice: over the direct socket, and over a private dbus-daemon (OVER_BUS). */
#include <check.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../../client/epd-internal.h"
#include "harness.h"
#include "macro.h"
#include "../check-main.h"

#ifdef OVER_BUS
#define OVER_BUS_MODE true
#else
#define OVER_BUS_MODE false
#endif

static Harness h;
static char address[512];

/* 4 layers x 16 tokens x (256 + 256) bytes: 32 KiB pages. */
static const epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                  .v_bytes_per_token = 256, .dtype = "bf16" };
#define PAGE_SIZE (4 * 16 * 512)

static void setup(void) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

/* A second KV arena whose page size is configured: its pool exists from the start. */
static void setup_page_size(void) {
        ck_assert_int_eq(harness_init(&h, "[Arena:kv1]\nUsage=kv\nSize=16M\nPageSize=64K\n"), 0);
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

/* A KV arena whose page size the first layout sets, before one whose page size is
 * configured. */
static void setup_two_kv(void) {
        ck_assert_int_eq(harness_init(&h, "[Arena:kva]\nUsage=kv\nSize=16M\n"
                                          "[Arena:kv1]\nUsage=kv\nSize=16M\nPageSize=64K\n"), 0);
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

/* The state (and so the WAL) on tmpfs: an fdatasync costs next to nothing, so the
 * writer thread does not batch by itself while one runs. */
static char shm_dir[64];
static void setup_shm(void) {
        strcpy(shm_dir, "/dev/shm/epd-test-XXXXXX");
        if (!mkdtemp(shm_dir))
                ck_abort_msg("mkdtemp %s: %s", shm_dir, strerror(errno));
        char extra[200];
        snprintf(extra, sizeof extra, "[Daemon]\nStateDirectory=%s/state\n", shm_dir);
        ck_assert_int_eq(harness_init(&h, extra), 0);
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

static void teardown_shm(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
        char cmd[100];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", shm_dir);
        ck_assert_int_eq(system(cmd), 0);
}

/* A WAL whose compaction cannot write its snapshot (a directory where the snapshot's
 * temporary file goes): the first compaction fails and the log takes no more records. */
static void setup_compaction_fails(void) {
        char p[400];
        ck_assert_int_eq(harness_init(&h, "[Wal]\nCompactSize=16K\n"), 0);
        snprintf(p, sizeof p, "%s/state", h.dir);
        ck_assert_int_eq(mkdir(p, 0755), 0);
        snprintf(p, sizeof p, "%s/state/wal", h.dir);
        ck_assert_int_eq(mkdir(p, 0755), 0);
        snprintf(p, sizeof p, "%s/state/wal/wal.snapshot.tmp", h.dir);
        ck_assert_int_eq(mkdir(p, 0755), 0);
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

/* epdd with fault-wal.c: every write of a WAL record from LSN 40 on fails with ENOSPC. */
static void setup_disk_full(void) {
        const char *lib = getenv("FAULT_WAL");
        ck_assert_msg(lib, "FAULT_WAL is not set (run through meson test)");
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        harness_start_preloaded(&h, OVER_BUS_MODE, address, sizeof address, lib, "EPD_FAULT_WAL_ENOSPC_LSN", "40");
}

static void teardown(void) {
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}

typedef struct PoolStats {
        uint64_t page_size, total, free, live, idle, shared, leased, cow, saved, evictions, failures;
} PoolStats;

static int pool_stats(PoolStats *ret) {
        sd_bus *bus;
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        int r = harness_raw_bus(&h, &bus);
        if (r < 0)
                return r;
        r = sd_bus_get_property(bus, harness_destination(&h), "/org/epd1/pages", "org.epd1.Pages", "Pools", &e, &reply,
                                "a(sttttttttttt)");
        sd_bus_error_free(&e);
        if (r >= 0)
                r = sd_bus_message_enter_container(reply, 'a', "(sttttttttttt)");
        int found = -ENOENT;
        while (r >= 0) {
                const char *name;
                PoolStats s;
                r = sd_bus_message_read(reply, "(sttttttttttt)", &name, &s.page_size, &s.total, &s.free,
                                        &s.live, &s.idle, &s.shared, &s.leased, &s.cow, &s.saved,
                                        &s.evictions, &s.failures);
                if (r <= 0)
                        break;
                if (strcmp(name, "host0") == 0) {
                        *ret = s;
                        found = 0;
                }
        }
        sd_bus_message_unref(reply);
        sd_bus_flush_close_unref(bus);
        return r < 0 ? r : found;
}

static int n_pools(void) {
        sd_bus *bus;
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        int n = 0, r = harness_raw_bus(&h, &bus);
        ck_assert_int_ge(r, 0);
        r = sd_bus_get_property(bus, harness_destination(&h), "/org/epd1/pages", "org.epd1.Pages", "Pools", &e, &reply,
                                "a(sttttttttttt)");
        sd_bus_error_free(&e);
        ck_assert_int_ge(r, 0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(sttttttttttt)"), 0);
        while ((r = sd_bus_message_skip(reply, "(sttttttttttt)")) > 0)
                n++;
        sd_bus_message_unref(reply);
        sd_bus_flush_close_unref(bus);
        return n;
}

static bool no_live_pages(void *userdata) {
        PoolStats s;
        return pool_stats(&s) == 0 && s.live == 0;
}

static epd_client *worker(const char *role, void **base, const epd_arena **arena) {
        epd_client *c;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, role, "qwen3-vl-test", "cpu", &kv, NULL), 0);
        int i = epd_arena_find(c, "host0");
        ck_assert_int_ge(i, 0);
        if (base)
                ck_assert_int_eq(epd_arena_map(c, (size_t)i, base), 0);
        if (arena)
                *arena = epd_arena_get(c, (size_t)i);
        return c;
}

static uint8_t *page(void *base, const epd_arena *a, uint32_t id) {
        return (uint8_t *)base + epd_page_offset(a, PAGE_SIZE, id);
}

START_TEST(test_clone_write_release) {
        void *base;
        const epd_arena *a;
        epd_client *c = worker("prefill", &base, &a);
        char *seq = NULL, *clone = NULL, *again = NULL;
        uint32_t *pages = NULL, *cpages = NULL, *apages = NULL, w[4];
        size_t n, cn, an, blocks;
        uint64_t ps;
        PoolStats st;

        ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &seq, &pages, &n), 0);
        ck_assert_uint_eq(n, 4);
        ck_assert_int_eq(epd_sequence_get_page_size(c, seq, &ps), 0);
        ck_assert_uint_eq(ps, PAGE_SIZE);
        for (size_t i = 0; i < n; i++)
                memset(page(base, a, pages[i]), (int)(0x10 + i), PAGE_SIZE);

        /* Clone: shares everything, copies nothing. */
        ck_assert_int_eq(pool_stats(&st), 0);
        uint64_t cow_before = st.cow;
        ck_assert_int_eq(epd_sequence_clone(c, seq, &clone), 0);
        ck_assert_int_eq(epd_sequence_get_pages(c, clone, &cpages, &cn), 0);
        ck_assert_uint_eq(cn, 4);
        ck_assert_mem_eq(cpages, pages, 4 * sizeof(uint32_t));
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.cow, cow_before);
        ck_assert_uint_eq(st.shared, 4);
        ck_assert_uint_eq(st.saved, 4 * PAGE_SIZE);

        /* Write pages 1 and 2 of the clone: the daemon copies exactly those two. */
        ck_assert_int_eq(epd_sequence_prepare_write(c, clone, 1, 2, w), 2);
        ck_assert_uint_ne(w[0], pages[1]);
        ck_assert_uint_ne(w[1], pages[2]);
        ck_assert_uint_eq(page(base, a, w[0])[0], 0x11);
        ck_assert_uint_eq(page(base, a, w[1])[PAGE_SIZE - 1], 0x12);
        memset(page(base, a, w[0]), 0x77, PAGE_SIZE);
        ck_assert_uint_eq(page(base, a, pages[1])[0], 0x11); /* the original is intact */
        ck_assert_int_eq(epd_sequence_prepare_write(c, clone, 1, 2, w), 0);
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.cow, cow_before + 2);
        ck_assert_uint_eq(st.shared, 2);

        /* Publish the original's blocks, release it, find them again by prefix. */
        uint64_t hashes[5] = { 0xa1, 0xa2, 0xa3, 0xa4, 0xa5 };
        ck_assert_int_eq(epd_sequence_publish(c, seq, 0, hashes, 4), 4);
        ck_assert_int_eq(epd_sequence_publish(c, seq, 0, hashes, 4), 0);
        ck_assert_int_eq(epd_sequence_release(c, seq), 0);
        ck_assert_int_lt(epd_sequence_release(c, seq), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.freedesktop.DBus.Error.UnknownObject");
        ck_assert_int_eq(epd_prefix_match(c, "host0", hashes, 5), 4);
        ck_assert_int_eq(epd_sequence_create_from_prefix(c, "host0", hashes, 5, &again, &blocks, &apages, &an), 0);
        ck_assert_uint_eq(blocks, 4);
        ck_assert_mem_eq(apages, pages, 4 * sizeof(uint32_t));
        ck_assert_uint_eq(page(base, a, apages[3])[7], 0x13);
        /* A cached block is immutable: writing it copies. */
        ck_assert_int_eq(epd_sequence_prepare_write(c, again, 0, 1, w), 1);

        ck_assert_int_eq(epd_sequence_truncate(c, clone, 1), 0);
        ck_assert_int_eq(epd_sequence_truncate(c, clone, 5), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        ck_assert_int_eq(epd_sequence_release(c, clone), 0);
        ck_assert_int_eq(epd_sequence_release(c, again), 0);
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.live, 0);
        ck_assert_uint_eq(st.idle, 4); /* the published blocks stay cached */
        ck_assert_uint_eq(st.free + st.idle, st.total);

        /* Running out of pages is a named error, and changes nothing. */
        char *huge = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)st.total + 1, &huge, NULL, NULL), -ENOSPC);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.NoSpace");
        ck_assert_int_eq(epd_sequence_create(c, "nosuch", 1, &huge, NULL, NULL), -ENOENT);
        ck_assert_int_eq(epd_sequence_create(c, "feat0", 1, &huge, NULL, NULL), -EINVAL);
        /* Filling the arena evicts the cached blocks (LRU), then fits. */
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)st.total, &huge, NULL, NULL), 0);
        ck_assert_int_eq(epd_prefix_match(c, "host0", hashes, 5), 0);
        ck_assert_int_eq(epd_sequence_release(c, huge), 0);
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.free, st.total);
        ck_assert_uint_eq(st.evictions, 4);

        free(seq);
        free(clone);
        free(again);
        free(huge);
        free(pages);
        free(cpages);
        free(apages);
        epd_disconnect(c);
}
END_TEST

START_TEST(test_killed_client_leaves_nothing) {
        int pfd[2];
        ck_assert_int_eq(pipe(pfd), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                epd_client *cc = worker("prefill", NULL, NULL);
                char *s, *cl;
                uint32_t w[8];
                uint64_t hashes[2] = { 0xb1, 0xb2 };
                if (epd_sequence_create(cc, "host0", 8, &s, NULL, NULL) < 0 ||
                    epd_sequence_clone(cc, s, &cl) < 0 || epd_sequence_prepare_write(cc, cl, 0, 8, w) != 8 ||
                    epd_sequence_publish(cc, s, 0, hashes, 2) != 2 ||
                    epd_sequence_create(cc, "host0", 5, NULL, NULL, NULL) < 0)
                        _exit(1);
                if (write(pfd[1], "x", 1) != 1)
                        _exit(3);
                pause();
                _exit(0);
        }
        close(pfd[1]);
        char x;
        ck_assert_int_eq(read(pfd[0], &x, 1), 1);
        close(pfd[0]);
        PoolStats st;
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.live, 8 + 8 + 5);
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        ck_assert(harness_wait_for(no_live_pages, NULL, 5000));
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.live, 0);
        ck_assert_uint_eq(st.shared, 0);
        ck_assert_uint_eq(st.idle, 2); /* published blocks outlive their writer, unpinned */
        ck_assert_uint_eq(st.free + st.idle, st.total);

        /* ...and nothing retains them: a client can take the whole arena (evicting the
         * two cached blocks), and after it lets go every page is free. */
        epd_client *c = worker("prefill", NULL, NULL);
        char *all = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)st.total, &all, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_release(c, all), 0);
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.free, st.total);
        free(all);
        epd_disconnect(c);
}
END_TEST

static void expect_seq_error(sd_bus *bus, const char *path, const char *name, const char *member,
                             const char *types, ...) {
        sd_bus_message *m = NULL, *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(sd_bus_message_new_method_call(bus, &m, harness_destination(&h), path, "org.epd1.Sequence", member), 0);
        if (types) {
                va_list ap;
                va_start(ap, types);
                ck_assert_int_ge(sd_bus_message_appendv(m, types, ap), 0);
                va_end(ap);
        }
        int r = sd_bus_call(bus, m, 0, &e, &reply);
        ck_assert_int_lt(r, 0);
        ck_assert_msg(sd_bus_error_has_name(&e, name), "%s: expected %s, got %s (%s)", member, name, e.name,
                      e.message);
        sd_bus_error_free(&e);
        sd_bus_message_unref(m);
        sd_bus_message_unref(reply);
}

/* Entries of Pages.Sequences read on a connection of its own by uid (a forked child
 * running as that uid when it is not ours), or -1 when the read fails. */
static int sequences_seen_by(uid_t uid) {
        int fds[2];
        ck_assert_int_eq(pipe(fds), 0);
        pid_t pid = harness_fork_as(uid);
        if (pid == 0) {
                close(fds[0]);
                int n = -1;
                sd_bus *raw = NULL;
                sd_bus_message *reply = NULL;
                sd_bus_error e = SD_BUS_ERROR_NULL;
                if (harness_raw_bus(&h, &raw) >= 0 &&
                    sd_bus_get_property(raw, harness_destination(&h), "/org/epd1/pages", "org.epd1.Pages",
                                        "Sequences", &e, &reply, "a(oosuut)") >= 0 &&
                    sd_bus_message_enter_container(reply, 'a', "(oosuut)") >= 0) {
                        n = 0;
                        while (sd_bus_message_skip(reply, "(oosuut)") > 0)
                                n++;
                } else
                        fprintf(stderr, "Sequences as uid %u: %s\n", (unsigned)uid, e.message ? e.message : "no bus");
                if (write(fds[1], &n, sizeof n) != sizeof n)
                        _exit(3);
                _exit(0);
        }
        close(fds[1]);
        int n = -2, status;
        ck_assert_int_eq(read(fds[0], &n, sizeof n), (ssize_t)sizeof n);
        close(fds[0]);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        return n;
}

/* A grant to a worker that is gone holds no place: its id never comes back (a
 * restarted worker registers with a new one), so the 16 grants of a sequence are not
 * used up by workers that came and went. */
START_TEST(test_grants_of_gone_workers) {
        epd_client *a = worker("prefill", NULL, NULL);
        char *seq = NULL;
        ck_assert_int_eq(epd_sequence_create(a, "host0", 1, &seq, NULL, NULL), 0);
        for (int i = 0; i < 20; i++) {
                epd_client *b = worker("decode", NULL, NULL);
                ck_assert_msg(epd_sequence_grant(a, seq, epd_worker_path(b)) == 0, "grant %d: %s", i,
                              epd_last_error_message(a));
                epd_disconnect(b);
                /* Gone once the daemon has seen the disconnect. */
                for (int k = 0; k < 200 && harness_workers(&h) > 1; k++)
                        usleep(5000);
        }
        /* 16 live grantees still fill it. */
        epd_client *live[17];
        for (int i = 0; i < 17; i++) {
                live[i] = worker("decode", NULL, NULL);
                int r = epd_sequence_grant(a, seq, epd_worker_path(live[i]));
                if (i < 16)
                        ck_assert_msg(r == 0, "grant %d: %s", i, epd_last_error_message(a));
                else {
                        ck_assert_int_lt(r, 0);
                        ck_assert_str_eq(epd_last_error_name(a), "org.epd1.Error.LimitExceeded");
                }
        }
        for (int i = 0; i < 17; i++)
                epd_disconnect(live[i]);
        ck_assert_int_eq(epd_sequence_release(a, seq), 0);
        free(seq);
        epd_disconnect(a);
}
END_TEST

/* A sequence longer than its journal record can hold is refused before anything
 * changes, with LimitExceeded naming the limit: not created, not appended to. */
START_TEST(test_journal_record_limit) {
        epd_client *c = worker("prefill", NULL, NULL);
        const uint32_t max = (1u << 20) / 4 - 512; /* SEQUENCE_REC_PAGES_MAX */
        char *s = NULL;
        uint32_t *pages = NULL;
        size_t n = 0;
        ck_assert_int_lt(epd_sequence_create(c, "host0", max + 1, &s, NULL, NULL), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.LimitExceeded");
        ck_assert_msg(strstr(epd_last_error_message(c), "at most 261632"), "%s", epd_last_error_message(c));
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &s, NULL, NULL), 0);
        ck_assert_int_lt(epd_sequence_append(c, s, max - 1, NULL, NULL), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.LimitExceeded");
        ck_assert_int_eq(epd_sequence_get_pages(c, s, &pages, &n), 0);
        ck_assert_uint_eq(n, 2);
        free(pages);
        /* CreateFromPrefix: the limit is on what matched, not on the chain asked about
         * (test_create_from_prefix_long_chain). */
        ck_assert_int_eq(epd_sequence_release(c, s), 0);
        free(s);
        epd_disconnect(c);
}
END_TEST

START_TEST(test_other_client_needs_grant) {
        epd_client *a = worker("prefill", NULL, NULL), *b = worker("decode", NULL, NULL);
        char *seq = NULL, *mine = NULL, *stolen = NULL;
        uint32_t *pages = NULL;
        size_t n;
        sd_bus *raw;

        ck_assert_int_eq(epd_sequence_create(a, "host0", 3, &seq, NULL, NULL), 0);

        /* Pages.Sequences lists, to anyone but root, only what the caller may read:
         * another uid (here nobody, let through the directory and sockets) sees
         * nothing of A's, where each sequence's Owner refuses it too. */
        if (geteuid() == 0) {
                harness_let_others_in(&h);
                ck_assert_int_eq(sequences_seen_by(0), 1);
                ck_assert_int_eq(sequences_seen_by(65534), 0);
        } else
                ck_assert_int_eq(sequences_seen_by(geteuid()), 0);

        /* B: every method and property is refused by name. */
        ck_assert_int_eq(epd_sequence_append(b, seq, 1, NULL, NULL), -EPERM);
        ck_assert_str_eq(epd_last_error_name(b), "org.epd1.Error.PermissionDenied");
        ck_assert_int_eq(epd_sequence_truncate(b, seq, 0), -EPERM);
        ck_assert_int_eq(epd_sequence_prepare_write(b, seq, 0, 1, NULL), -EPERM);
        ck_assert_int_eq(epd_sequence_release(b, seq), -EPERM);
        ck_assert_int_eq(epd_sequence_clone(b, seq, &stolen), -EPERM);
        ck_assert_int_eq(epd_sequence_get_pages(b, seq, &pages, &n), -EPERM);
        ck_assert_int_eq(epd_sequence_grant(b, seq, epd_worker_path(b)), -EPERM);
        uint64_t hh = 1;
        ck_assert_int_eq(epd_sequence_publish(b, seq, 0, &hh, 1), -EPERM);

        /* An unregistered connection gets nothing either. */
        ck_assert_int_ge(harness_raw_bus(&h, &raw), 0);
        expect_seq_error(raw, seq, "org.epd1.Error.PermissionDenied", "Release", NULL);
        expect_seq_error(raw, seq, "org.epd1.Error.PermissionDenied", "Clone", NULL);
        expect_seq_error(raw, "/org/epd1/sequence/00000000000000000000000000000000",
                         "org.freedesktop.DBus.Error.UnknownObject", "Release", NULL);

        /* Granted: B can read and clone (its clone is its own), still not release A's. */
        ck_assert_int_eq(epd_sequence_grant(a, seq, epd_worker_path(b)), 0);
        ck_assert_int_eq(epd_sequence_grant(a, seq, "/org/epd1/worker/00000000000000000000000000000000"), -ENOENT);
        ck_assert_int_eq(epd_sequence_get_pages(b, seq, &pages, &n), 0);
        ck_assert_uint_eq(n, 3);
        ck_assert_int_eq(epd_sequence_clone(b, seq, &mine), 0);
        ck_assert_int_eq(epd_sequence_release(b, seq), -EPERM);
        ck_assert_int_eq(epd_sequence_prepare_write(b, mine, 0, 3, NULL), 3);
        ck_assert_int_eq(epd_sequence_release(a, mine), -EPERM);

        /* Revoked: refused again. */
        ck_assert_int_eq(epd_sequence_revoke(a, seq, epd_worker_path(b)), 0);
        ck_assert_int_eq(epd_sequence_revoke(a, seq, epd_worker_path(b)), -ENOENT);
        ck_assert_int_eq(epd_sequence_clone(b, seq, &stolen), -EPERM);

        /* A disconnects: its sequence goes; B's clone keeps its own pages. */
        epd_disconnect(a);
        PoolStats st;
        ck_assert(harness_wait_for(no_live_pages, NULL, 300) == false);
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.live, 3);
        epd_disconnect(b);
        ck_assert(harness_wait_for(no_live_pages, NULL, 5000));

        sd_bus_flush_close_unref(raw);
        free(seq);
        free(mine);
        free(pages);
}
END_TEST

START_TEST(test_layouts) {
        epd_client *c, *d;
        char *seq = NULL;

        /* Before any layout, the KV arena has no pages. */
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &seq, NULL, NULL), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        epd_disconnect(c);

        /* An invalid layout is refused at registration, by name. */
        epd_kv_layout bad = kv;
        bad.layers = 0;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &bad, NULL), -EINVAL);
        /* The pages subsystem's refusal reaches the caller named, with its reason. */
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), "Invalid KV layout: "));
        bad = kv;
        bad.dtype = "float13";
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &bad, NULL), -EINVAL);
        /* Pages below 4 KiB (one layer of one token of one byte: 256 with its padding)
         * would cost the daemon 32 bytes of bookkeeping each, an eighth of the arena:
         * refused as [Arena] PageSize= is, and no pool is made. */
        bad = (epd_kv_layout){ .layers = 1, .tokens_per_block = 1, .k_bytes_per_token = 1, .dtype = "uint8" };
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &bad, NULL), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        ck_assert_msg(strstr(epd_last_error_message(c), "are 256 bytes, below 4096"), "message: %s",
                      epd_last_error_message(c));
        /* Whichever arenas it maps (a feature arena holds no pages). */
        const char *const feat_only[] = { "feat0", NULL };
        bad.layers = 15; /* 3840 bytes */
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &bad, feat_only), -EINVAL);
        bad.layers = 16; /* 4096 bytes: the smallest page */
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &bad, feat_only), 0);
        ck_assert_int_eq(epd_unregister(c), 0);
        epd_disconnect(c);

        /* The first layout fixes the arena's page size; another size is refused. */
        c = worker("prefill", NULL, NULL);
        ck_assert_int_eq(epd_connect(address, &d), 0);
        epd_kv_layout other = kv;
        other.layers = 8;
        ck_assert_int_eq(epd_register(d, "decode", "m", "cpu", &other, NULL), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(d), "org.epd1.Error.InvalidArgument");
        ck_assert_msg(strstr(epd_last_error_message(d), "KV pages of 65536 bytes do not fit arena host0, which holds "
                                                        "pages of 32768 bytes (set by the first KV layout"),
                      "message: %s", epd_last_error_message(d));
        /* ...unless the worker maps only other arenas. */
        const char *const feat[] = { "feat0", NULL };
        ck_assert_int_eq(epd_register(d, "decode", "m", "cpu", &other, feat), 0);
        PoolStats st;
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.page_size, PAGE_SIZE);
        /* A worker that did not map a sequence's arena (its blocks are not that arena's
         * pages) may neither clone the sequence nor make a workflow of it, granted or
         * not: its Advance would count the prefix in blocks of another size. */
        char *x = NULL, *wf = NULL, *head = NULL;
        uint32_t tokens[32];
        for (uint32_t i = 0; i < 32; i++)
                tokens[i] = i;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &seq, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_grant(c, seq, epd_worker_path(d)), 0);
        ck_assert_int_eq(epd_sequence_clone(d, seq, &x), -EPERM);
        ck_assert_int_eq(epd_workflow_create(d, seq, tokens, 32, &wf, &head), -EPERM);
        ck_assert_str_eq(epd_last_error_name(d), "org.epd1.Error.PermissionDenied");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(d), "did not map the sequence's arena"));
        ck_assert_msg(epd_workflow_create(c, seq, tokens, 32, &wf, &head) == 0, "%s", epd_last_error_message(c));
        /* The workflow's client registered again, now mapping only the feature arena
         * (in another layout): its workflow stays its own, but Fork and Advance would
         * make heads in an arena it does not map, counted in blocks of another size. */
        ck_assert_int_eq(epd_unregister(c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &other, feat), 0);
        uint32_t nb = 0, prefix = 0;
        char *h2 = NULL;
        ck_assert_int_eq(epd_workflow_fork(c, wf, 0, &nb, &h2), -EPERM);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.PermissionDenied");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), "did not map the sequence's arena"));
        ck_assert_int_eq(epd_workflow_advance(c, wf, 0, tokens, 32, false, &h2, &prefix, NULL, NULL), -EPERM);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.PermissionDenied");
        ck_assert_ptr_null(h2);
        /* Registered on the arena again: both go through. */
        ck_assert_int_eq(epd_unregister(c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &kv, NULL), 0);
        ck_assert_msg(epd_workflow_fork(c, wf, 0, &nb, &h2) == 0, "%s", epd_last_error_message(c));
        free(h2);
        h2 = NULL;
        ck_assert_msg(epd_workflow_advance(c, wf, 0, tokens, 32, false, &h2, &prefix, NULL, NULL) == 0, "%s",
                      epd_last_error_message(c));
        free(h2);
        free(wf);
        free(head);
        free(seq);
        epd_disconnect(d);
        epd_disconnect(c);
}
END_TEST

START_TEST(test_configured_page_size) {
        /* kv1 has its pool before any worker registers. (An [Arena:] section in the
         * file replaces the embedded default arenas.) */
        ck_assert_int_eq(n_pools(), 1);
        epd_client *c;
        epd_kv_layout big = kv;
        big.layers = 8; /* 64 KiB pages: what kv1 holds */
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &big, NULL), 0);
        ck_assert_int_eq(n_pools(), 1);
        char *s = NULL;
        uint64_t ps;
        ck_assert_int_eq(epd_sequence_create(c, "kv1", 2, &s, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_get_page_size(c, s, &ps), 0);
        ck_assert_uint_eq(ps, 64 * 1024);
        ck_assert_int_eq(epd_sequence_create(c, "kv1", 16 * 16, NULL, NULL, NULL), -ENOSPC); /* 16M/64K, less the header */
        free(s);
        epd_disconnect(c);

        /* A 32 KiB layout cannot use kv1. */
        ck_assert_int_eq(epd_connect(address, &c), 0);
        const char *const only_kv1[] = { "kv1", NULL };
        ck_assert_int_eq(epd_register(c, "decode", "m", "cpu", &kv, only_kv1), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        char want[512];
        snprintf(want, sizeof want, "KV pages of 32768 bytes do not fit arena kv1, which holds pages of 65536 bytes "
                 "(set by PageSize= in %s)", h.config);
        ck_assert_msg(strstr(epd_last_error_message(c), want), "message: %s", epd_last_error_message(c));
        epd_disconnect(c);
}
END_TEST

/* A worker refused at a later arena (kv1 holds 64 KiB pages) sets no page size in an
 * earlier one (kva had none): a worker of the right layout then maps kva. */
START_TEST(test_refused_worker_sets_no_page_size) {
        ck_assert_int_eq(n_pools(), 1); /* kv1's, from PageSize= */
        epd_client *c;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cpu", &kv, NULL), -EINVAL); /* 32 KiB: not kv1's */
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        epd_disconnect(c);
        ck_assert_int_eq(n_pools(), 1); /* kva still has none */
        epd_kv_layout big = kv;
        big.layers = 8; /* 64 KiB pages */
        const char *const only_kva[] = { "kva", NULL };
        ck_assert_int_eq(epd_connect(address, &c), 0);
        int r = epd_register(c, "prefill", "m", "cpu", &big, only_kva);
        ck_assert_msg(r == 0, "register: %s", epd_last_error_message(c));
        char *seq = NULL;
        uint64_t ps;
        ck_assert_int_eq(epd_sequence_create(c, "kva", 2, &seq, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_get_page_size(c, seq, &ps), 0);
        ck_assert_uint_eq(ps, 64 * 1024);
        free(seq);
        epd_disconnect(c);
}
END_TEST

static bool log_contains(const char *text) {
        FILE *f = fopen(h.log, "re");
        ck_assert_ptr_nonnull(f);
        char line[2048];
        bool found = false;
        while (!found && fgets(line, sizeof line, f))
                found = strstr(line, text) != NULL;
        fclose(f);
        return found;
}

/* A journal left by a previous run whose sequences used another page size (the demo's
 * 512 KiB pages, say): the arena's memory is new after the restart (no fd store), so
 * those sequences are dropped, and so is the page size they fixed. Before, the replay
 * kept the pool at the journal's size and every worker of another layout was refused
 * with a bare InvalidArgs. */
START_TEST(test_journal_layout_released) {
        epd_kv_layout big = kv;
        big.layers = 64; /* 512 KiB pages */
        epd_client *c;
        char *seq = NULL;
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "demo", "cpu", &big, NULL), 0);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &seq, NULL, NULL), 0);
        free(seq);
        /* The daemon stops with the sequence held: it stays in the WAL. */
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        epd_disconnect(c);

        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0); /* the same bus, if any */
        c = worker("prefill", NULL, NULL); /* 32 KiB pages */
        ck_assert(log_contains("the page size is free again"));
        PoolStats st;
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.page_size, PAGE_SIZE);
        epd_disconnect(c);
}
END_TEST

/* epdctl's output (stderr too) and its exit status. */
static char *run_epdctl_status(const char *args, int *ret_status) {
        const char *build = getenv("BUILD_ROOT");
        ck_assert_ptr_nonnull(build);
        char cmd[2048];
        snprintf(cmd, sizeof cmd, "%s/tools/epdctl -A %s %s 2>&1", build, address, args);
        FILE *f = popen(cmd, "re");
        ck_assert_ptr_nonnull(f);
        static char out[16384];
        size_t n = fread(out, 1, sizeof out - 1, f);
        out[n] = 0;
        int st = pclose(f);
        ck_assert(WIFEXITED(st));
        *ret_status = WEXITSTATUS(st);
        return out;
}

static char *run_epdctl(const char *args) {
        int status;
        char *out = run_epdctl_status(args, &status);
        ck_assert_msg(status == 0, "epdctl %s: exit %d: %s", args, status, out);
        return out;
}

START_TEST(test_epdctl) {
        epd_client *c = worker("prefill", NULL, NULL);
        char *seq = NULL, *clone = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 6, &seq, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_clone(c, seq, &clone), 0);
        const char *out = run_epdctl("sequences");
        ck_assert_ptr_nonnull(strstr(out, strrchr(seq, '/') + 1));
        ck_assert_ptr_nonnull(strstr(out, strrchr(clone, '/') + 1));
        ck_assert_ptr_nonnull(strstr(out, strrchr(epd_worker_path(c), '/') + 1));
        out = run_epdctl("pages");
        ck_assert_ptr_nonnull(strstr(out, "host0"));
        ck_assert_ptr_nonnull(strstr(out, "Directory:"));
        out = run_epdctl("--json pages");
        ck_assert_ptr_nonnull(strstr(out, "\"shared\":6"));
        out = run_epdctl("--json sequences");
        ck_assert_ptr_nonnull(strstr(out, "\"shared_pages\":6"));
        /* placement: hashes in decimal or 0x hex; the longest cached prefix. */
        const uint64_t hs[2] = { 0x1234, 0x5678 };
        ck_assert_int_eq(epd_sequence_publish(c, seq, 0, hs, 2), 2);
        out = run_epdctl("--json placement 4660 0x5678 99");
        ck_assert_msg(strstr(out, "\"n_blocks\":2"), "%s", out);
        out = run_epdctl("placement 0X1234 99");
        ck_assert_msg(strstr(out, "1 of 2 blocks cached"), "%s", out);
        out = run_epdctl("placement 99");
        ck_assert_msg(strstr(out, "No host caches the first block"), "%s", out);
        int status;
        static const char *const bad[] = { "12abc", "0x", "-- -5", "0x1g", "18446744073709551616", "+5", "\" 5\"" };
        for (size_t i = 0; i < ELEMENTSOF(bad); i++) {
                char args[64];
                snprintf(args, sizeof args, "placement 1 %s", bad[i]);
                out = run_epdctl_status(args, &status);
                ck_assert_msg(status != 0 && strstr(out, "Invalid block hash"), "epdctl %s: exit %d: %s", args,
                              status, out);
        }
        out = run_epdctl_status("placement", &status);
        ck_assert_msg(status != 0 && strstr(out, "Usage"), "%s", out);
        free(seq);
        free(clone);
        epd_disconnect(c);
}
END_TEST

START_TEST(test_introspection) {
        sd_bus *bus;
        epd_client *c = worker("prefill", NULL, NULL);
        char *seq = NULL;
        ck_assert_int_ge(harness_raw_bus(&h, &bus), 0);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &seq, NULL, NULL), 0);
        const char *src = getenv("SOURCE_ROOT");
        ck_assert_ptr_nonnull(src);
        char f[512];
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Pages.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, harness_destination(&h), "/org/epd1/pages", f), 0);
        snprintf(f, sizeof f, "%s/dbus/org.epd1.Sequence.xml", src);
        ck_assert_int_eq(harness_check_introspection(bus, harness_destination(&h), seq, f), 0);
        free(seq);
        epd_disconnect(c);
        sd_bus_flush_close_unref(bus);
}
END_TEST

/* The WAL writer thread's fdatasyncs so far (org.epd1.Workflow.Journal). */
static uint64_t wal_syncs(sd_bus *bus) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *policy;
        uint64_t assigned, durable, appended, syncs, bytes, compactions, cut;
        int r = sd_bus_get_property(bus, harness_destination(&h), "/org/epd1", "org.epd1.Workflow", "Journal", &e,
                                    &reply, "(sttttttt)");
        ck_assert_msg(r >= 0, "Journal: %s", e.message);
        ck_assert_int_ge(sd_bus_message_read(reply, "(sttttttt)", &policy, &assigned, &durable, &appended, &syncs,
                                             &bytes, &compactions, &cut), 0);
        ck_assert_str_eq(policy, "batch");
        sd_bus_error_free(&e);
        return syncs;
}

static int created(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        ck_assert_msg(!sd_bus_message_is_method_error(m, NULL), "CreateSequence: %s",
                      sd_bus_message_get_error(m) ? sd_bus_message_get_error(m)->message : "?");
        (*(unsigned *)userdata)++;
        return 0;
}

/* Requests that arrive together journal together: their replies wait for one
 * group commit (the writer is urged once the loop has handled every request that was
 * ready), not an fdatasync each. Every reply still comes only once its record is
 * durable (test-restart-crash*). */
START_TEST(test_ready_requests_share_sync) {
        epd_client *c = worker("prefill", NULL, NULL);
        enum { N = 64 };
        unsigned done = 0;
        /* Settle: the registration's records are durable. */
        ck_assert_int_eq(sd_bus_call_method_async(c->bus, NULL, harness_destination(&h), "/org/epd1/pages",
                                                  "org.epd1.Pages", "CreateSequence", created, &done, "su", "host0",
                                                  1),
                         1);
        while (done < 1)
                ck_assert_int_ge(sd_bus_wait(c->bus, UINT64_MAX) >= 0 ? sd_bus_process(c->bus, NULL) : -1, 0);
        uint64_t before = wal_syncs(c->bus);
        done = 0;
        /* N calls sent while epdd is stopped: it finds them all ready at once. (Over
         * the bus, dbus-daemon forwards them meanwhile.) */
        ck_assert_int_ge(sd_bus_set_method_call_timeout(c->bus, 30 * 1000000ULL), 0);
        ck_assert_int_eq(kill(h.epdd_pid, SIGSTOP), 0);
        for (unsigned i = 0; i < N; i++) {
                _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
                ck_assert_int_ge(sd_bus_message_new_method_call(c->bus, &m, harness_destination(&h),
                                                                "/org/epd1/pages", "org.epd1.Pages",
                                                                "CreateSequence"),
                                 0);
                ck_assert_int_ge(sd_bus_message_append(m, "su", "host0", 1), 0);
                ck_assert_int_ge(sd_bus_call_async(c->bus, NULL, m, created, &done, 0), 0);
        }
        ck_assert_int_ge(sd_bus_flush(c->bus), 0);
        usleep(100 * 1000);
        ck_assert_int_eq(kill(h.epdd_pid, SIGCONT), 0);
        while (done < N) {
                int r = sd_bus_process(c->bus, NULL);
                ck_assert_int_ge(r, 0);
                if (r == 0)
                        ck_assert_int_ge(sd_bus_wait(c->bus, UINT64_MAX), 0);
        }
        uint64_t syncs = wal_syncs(c->bus) - before;
        printf("%u journaled requests in one burst: %" PRIu64 " fdatasyncs\n", N, syncs);
        ck_assert_uint_ge(syncs, 1);
        /* Measured: 1–5 with the loop-idle urge on a quiet machine, 1–14 under ASan alone
         * on a 2-vCPU VM, 11 once under ASan in a loaded 2-core CI run and 18 once in a
         * full ASan suite on that VM; 10–12 (direct) and 3–41 (bus) without it. The
         * bound is the one that holds under load: it catches a writer that syncs per
         * request (64), not reliably the loss of the urge alone. */
        ck_assert_uint_le(syncs, N / 2);
        epd_disconnect(c);
}
END_TEST

/* Creates and releases sequences until the journal refuses one (its disk is full from
 * LSN 40: setup_disk_full). */
static void journal_until_refused(epd_client *c) {
        int r = 0;
        for (int i = 0; i < 100 && r == 0; i++) {
                char *b = NULL;
                r = epd_sequence_create(c, "host0", 1, &b, NULL, NULL);
                if (r == 0)
                        r = epd_sequence_release(c, b);
                free(b);
        }
        ck_assert_msg(r < 0, "the journal never refused a record (its disk is full from LSN 40)");
}

/* A Publish whose directory entry the journal refuses says so (Failed, and why), not a
 * bare "Input/output error" (review). */
START_TEST(test_refused_publish_named) {
        epd_client *c = worker("prefill", NULL, NULL);
        char *a = NULL;
        uint64_t hashes[2] = { 0x1234, 0x5678 };
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &a, NULL, NULL), 0);
        journal_until_refused(c);
        ck_assert_int_lt(epd_sequence_publish(c, a, 0, hashes, 2), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        ck_assert_msg(strstr(epd_last_error_message(c), "Publish: cannot journal the directory entries: "),
                      "message: %s", epd_last_error_message(c));
        free(a);
        epd_disconnect(c);
}
END_TEST

/* Once the journal refuses a record, nothing is acknowledged: a Release whose record
 * was refused fails (Failed, saying why) instead of answering success for a change that
 * a restart would undo. The disk fills up at LSN 40 (setup_disk_full). */
START_TEST(test_refused_record_not_acknowledged) {
        epd_client *c = worker("prefill", NULL, NULL);
        char *a = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &a, NULL, NULL), 0);
        journal_until_refused(c);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        ck_assert_int_lt(epd_sequence_release(c, a), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        free(a);
        epd_disconnect(c);
}
END_TEST

/* An Append or a Grant whose record the journal refuses changes nothing: the sequence
 * keeps its pages (the appended ones went back) and the worker is not let in (both stayed
 * while the caller was told they failed). */
START_TEST(test_refused_append_grant_undone) {
        epd_client *c = worker("prefill", NULL, NULL), *other = worker("decode", NULL, NULL);
        char *a = NULL;
        uint32_t *pages = NULL;
        size_t n = 0;
        PoolStats before, after;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &a, NULL, NULL), 0);
        journal_until_refused(c);
        ck_assert_int_eq(pool_stats(&before), 0);
        ck_assert_int_lt(epd_sequence_append(c, a, 3, NULL, NULL), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        ck_assert_int_eq(epd_sequence_get_pages(c, a, &pages, &n), 0);
        ck_assert_uint_eq(n, 2);
        free(pages);
        ck_assert_int_eq(pool_stats(&after), 0);
        ck_assert_uint_eq(after.free, before.free);
        ck_assert_int_lt(epd_sequence_grant(c, a, epd_worker_path(other)), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        ck_assert_int_eq(epd_sequence_get_pages(other, a, &pages, &n), -EPERM);
        free(a);
        epd_disconnect(other);
        epd_disconnect(c);
}
END_TEST

/* CreateFromPrefix with a chain longer than a sequence may be (up to 1M hashes a call,
 * as MatchPrefix takes), of which a short prefix is cached: the sequence is as long as
 * what matched. It was refused (LimitExceeded, "a sequence of 300000 pages") from the
 * chain's length. */
START_TEST(test_create_from_prefix_long_chain) {
        epd_client *c = worker("prefill", NULL, NULL);
        char *a = NULL, *s = NULL;
        size_t n = 300000, blocks = 0;
        uint64_t *hashes = calloc(n, sizeof *hashes);
        ck_assert_ptr_nonnull(hashes);
        for (size_t i = 0; i < n; i++)
                hashes[i] = 0xabc000 + i;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &a, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_publish(c, a, 0, hashes, 2), 2);
        ck_assert_int_eq(epd_prefix_match(c, "host0", hashes, n), 2);
        ck_assert_msg(epd_sequence_create_from_prefix(c, "host0", hashes, n, &s, &blocks, NULL, NULL) == 0, "%s",
                      epd_last_error_message(c));
        ck_assert_uint_eq(blocks, 2);
        free(hashes);
        free(a);
        free(s);
        epd_disconnect(c);
}
END_TEST

static bool no_workflows(void *userdata) {
        (void)userdata;
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        uint32_t n = UINT32_MAX;
        if (harness_raw_bus(&h, &bus) < 0)
                return false;
        int r = sd_bus_get_property_trivial(bus, harness_destination(&h), "/org/epd1", "org.epd1.Workflow", "Count",
                                            &e, 'u', &n);
        sd_bus_error_free(&e);
        sd_bus_flush_close_unref(bus);
        return r >= 0 && n == 0;
}

/* A client with a workflow goes while the journal refuses records: the release of its
 * workflow cannot be journaled, and the workflow goes all the same (it stayed, ownerless,
 * holding its heads' pages and its slot of the limit, until a restart). */
START_TEST(test_departed_workflow_goes_when_journal_refuses) {
        epd_client *c = worker("prefill", NULL, NULL);
        char *a = NULL, *wf = NULL, *head = NULL, *fork_head = NULL;
        uint32_t tokens[32], branch;
        for (uint32_t i = 0; i < 32; i++)
                tokens[i] = i;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &a, NULL, NULL), 0);
        ck_assert_msg(epd_workflow_create(c, a, tokens, 32, &wf, &head) == 0, "%s", epd_last_error_message(c));
        ck_assert_int_eq(epd_workflow_fork(c, wf, 0, &branch, &fork_head), 0);
        ck_assert(!no_workflows(NULL));
        journal_until_refused(c);
        epd_disconnect(c);
        ck_assert_msg(harness_wait_for(no_workflows, NULL, 5000), "the departed client's workflow stayed");
        free(a);
        free(wf);
        free(head);
        free(fork_head);
}
END_TEST

/* The journal's (policy, last LSN, synced LSN, appended, syncs, log bytes, compactions,
 * cut) from org.epd1.Workflow.Journal: log bytes and compactions here. */
static void wal_size(sd_bus *bus, uint64_t *ret_bytes, uint64_t *ret_compactions) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *policy;
        uint64_t assigned, durable, appended, syncs, cut;
        int r = sd_bus_get_property(bus, harness_destination(&h), "/org/epd1", "org.epd1.Workflow", "Journal", &e,
                                    &reply, "(sttttttt)");
        ck_assert_msg(r >= 0, "Journal: %s", e.message);
        ck_assert_int_ge(sd_bus_message_read(reply, "(sttttttt)", &policy, &assigned, &durable, &appended, &syncs,
                                             ret_bytes, ret_compactions, &cut),
                         0);
        sd_bus_error_free(&e);
}

/* A compaction that cannot write its snapshot (wal.snapshot.tmp is a directory:
 * setup_compaction_fails) costs nothing but the log's growth: every change is still
 * journaled and acknowledged, and once the obstacle is gone a compaction goes through. */
START_TEST(test_failed_compaction_keeps_journaling) {
        epd_client *c = worker("prefill", NULL, NULL);
        char *a = NULL;
        uint64_t bytes, compactions;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &a, NULL, NULL), 0);
        /* CompactSize=16K: a few hundred records past it, several tries failed. */
        for (int i = 0; i < 600; i++) {
                char *b = NULL;
                ck_assert_msg(epd_sequence_create(c, "host0", 1, &b, NULL, NULL) == 0, "create %d: %s", i,
                              epd_last_error_message(c));
                ck_assert_msg(epd_sequence_release(c, b) == 0, "release %d: %s", i, epd_last_error_message(c));
                free(b);
        }
        wal_size(c->bus, &bytes, &compactions);
        ck_assert_uint_eq(compactions, 0);
        ck_assert_uint_gt(bytes, 2 * 16384);
        char p[400];
        snprintf(p, sizeof p, "%s/state/wal/wal.snapshot.tmp", h.dir);
        ck_assert_int_eq(rmdir(p), 0);
        for (int i = 0; i < 2000 && compactions == 0; i++) {
                char *b = NULL;
                ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &b, NULL, NULL), 0);
                ck_assert_int_eq(epd_sequence_release(c, b), 0);
                free(b);
                if (i % 50 == 49)
                        wal_size(c->bus, &bytes, &compactions);
        }
        ck_assert_uint_ge(compactions, 1);
        ck_assert_int_eq(epd_sequence_release(c, a), 0);
        free(a);
        epd_disconnect(c);
}
END_TEST

static void setup_object_limit(void) {
        ck_assert_int_eq(harness_init(&h, "[Limits]\nMaxObjectsPerClient=4\n"), 0);
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

/* A CreateSequence refused at the client's object limit changes nothing: before, it
 * allocated its pages first, evicting the prefix cache's idle blocks to find them, and
 * only then heard the limit, so a client retrying at its limit wiped the shared cache. */
START_TEST(test_refused_create_evicts_nothing) {
        epd_client *c = worker("prefill", NULL, NULL);
        char *seqs[8] = {}, *s = NULL;
        PoolStats st;
        uint64_t hashes[4] = { 0xb1, 0xb2, 0xb3, 0xb4 };
        ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &s, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_publish(c, s, 0, hashes, 4), 4);
        ck_assert_int_eq(epd_sequence_release(c, s), 0);
        free(s);
        s = NULL;
        ck_assert_int_eq(epd_prefix_match(c, "host0", hashes, 4), 4); /* 4 idle cached blocks */

        /* Up to the limit, the last sequence taking every free page. */
        size_t k = 0;
        while (k < ELEMENTSOF(seqs) && epd_sequence_create(c, "host0", 1, &seqs[k], NULL, NULL) == 0)
                k++;
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.LimitExceeded");
        ck_assert_uint_gt(k, 0);
        ck_assert_int_eq(epd_sequence_release(c, seqs[k - 1]), 0);
        free(seqs[k - 1]);
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.idle, 4);
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)st.free, &seqs[k - 1], NULL, NULL), 0);
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.free, 0);

        /* At the limit, with no free page: refused, and the cache is as it was. */
        ck_assert_int_lt(epd_sequence_create(c, "host0", 1, &s, NULL, NULL), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.LimitExceeded");
        ck_assert_int_eq(pool_stats(&st), 0);
        ck_assert_uint_eq(st.idle, 4);
        ck_assert_int_eq(epd_prefix_match(c, "host0", hashes, 4), 4);
        for (size_t i = 0; i < k; i++) {
                ck_assert_int_eq(epd_sequence_release(c, seqs[i]), 0);
                free(seqs[i]);
        }
        epd_disconnect(c);
}
END_TEST

static void setup_workflow_tokens(void) {
        ck_assert_int_eq(harness_init(&h, "[Limits]\nWorkflowTokenMemory=256\n"), 0); /* 64 tokens */
        harness_start(&h, OVER_BUS_MODE, address, sizeof address);
}

/* The workflows' tokens are bounded for the daemon (a fork keeps a copy of its
 * parent's): past [Limits] WorkflowTokenMemory= a Fork is LimitExceeded, saying which
 * limit, and a Drop gives the room back. */
START_TEST(test_workflow_token_memory) {
        epd_client *c = worker("prefill", NULL, NULL);
        uint32_t tokens[32], branch;
        char *seq = NULL, *wf = NULL, *head = NULL, *fork_head = NULL;
        for (uint32_t i = 0; i < 32; i++)
                tokens[i] = i;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &seq, NULL, NULL), 0);
        ck_assert_msg(epd_workflow_create(c, seq, tokens, 32, &wf, &head) == 0, "%s", epd_last_error_message(c));
        ck_assert_int_eq(epd_workflow_fork(c, wf, 0, &branch, &fork_head), 0); /* 64 tokens */
        free(fork_head);
        fork_head = NULL;
        ck_assert_int_lt(epd_workflow_fork(c, wf, 0, &branch, &fork_head), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.LimitExceeded");
        ck_assert_msg(strstr(epd_last_error_message(c), "WorkflowTokenMemory="), "%s", epd_last_error_message(c));
        ck_assert_int_eq(epd_workflow_drop(c, wf, 1), 0);
        ck_assert_int_eq(epd_workflow_fork(c, wf, 0, &branch, &fork_head), 0);
        ck_assert_int_eq(epd_workflow_release(c, wf), 0);
        ck_assert_int_eq(epd_sequence_release(c, seq), 0);
        free(seq);
        free(wf);
        free(head);
        free(fork_head);
        epd_disconnect(c);
}
END_TEST

int main(void) {
        harness_require_bus(OVER_BUS_MODE);
        Suite *s = suite_create("pages");
        TCase *tc = tcase_create("pages");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_clone_write_release);
        tcase_add_test(tc, test_killed_client_leaves_nothing);
        tcase_add_test(tc, test_other_client_needs_grant);
        tcase_add_test(tc, test_grants_of_gone_workers);
        tcase_add_test(tc, test_journal_record_limit);
        tcase_add_test(tc, test_layouts);
        tcase_add_test(tc, test_journal_layout_released);
        tcase_add_test(tc, test_epdctl);
        tcase_add_test(tc, test_introspection);
        tcase_add_test(tc, test_create_from_prefix_long_chain);
        suite_add_tcase(s, tc);
        TCase *tc3 = tcase_create("group-commit");
        tcase_add_checked_fixture(tc3, setup_shm, teardown_shm);
        tcase_set_timeout(tc3, 60);
        tcase_add_test(tc3, test_ready_requests_share_sync);
        suite_add_tcase(s, tc3);

        TCase *tc4 = tcase_create("journal-refused");
        tcase_add_checked_fixture(tc4, setup_disk_full, teardown);
        tcase_set_timeout(tc4, 60);
        tcase_add_test(tc4, test_refused_record_not_acknowledged);
        tcase_add_test(tc4, test_refused_publish_named);
        tcase_add_test(tc4, test_departed_workflow_goes_when_journal_refuses);
        tcase_add_test(tc4, test_refused_append_grant_undone);
        suite_add_tcase(s, tc4);

        TCase *tc5 = tcase_create("compaction-fails");
        tcase_add_checked_fixture(tc5, setup_compaction_fails, teardown);
        tcase_set_timeout(tc5, 120);
        tcase_add_test(tc5, test_failed_compaction_keeps_journaling);
        suite_add_tcase(s, tc5);

        TCase *tc7 = tcase_create("object-limit");
        tcase_add_checked_fixture(tc7, setup_object_limit, teardown);
        tcase_add_test(tc7, test_refused_create_evicts_nothing);
        suite_add_tcase(s, tc7);

        TCase *tc8 = tcase_create("workflow-tokens");
        tcase_add_checked_fixture(tc8, setup_workflow_tokens, teardown);
        tcase_add_test(tc8, test_workflow_token_memory);
        suite_add_tcase(s, tc8);

        TCase *tc6 = tcase_create("two-kv-arenas");
        tcase_add_checked_fixture(tc6, setup_two_kv, teardown);
        tcase_add_test(tc6, test_refused_worker_sets_no_page_size);
        suite_add_tcase(s, tc6);

        TCase *tc2 = tcase_create("configured-page-size");
        tcase_add_checked_fixture(tc2, setup_page_size, teardown);
        tcase_set_timeout(tc2, 60);
        tcase_add_test(tc2, test_configured_page_size);
        suite_add_tcase(s, tc2);
        return check_run(s, CK_NOFORK);
}
