/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Restart without loss, with the test playing systemd's part: a notify socket that
 * keeps the fds epdd stores (FDSTORE=1, FDNAME=) and passes them back to the next epdd
 * (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES). A worker writes into the arenas, epdd is
 * killed with SIGKILL, started again, and the worker, reconnecting through libepd,
 * finds every byte as it left it. Without the store the memory is new. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "arena.h"
#include "epd/epd-feature.h"
#include "harness.h"
#include "../check-main.h"

#define STORE_MAX 16

static Harness h;
static int notify_fd = -1;
static char notify_path[300];
static char store_names[STORE_MAX][256];
static int store_fds[STORE_MAX];
static size_t store_n;

static void store_put(const char *name, int fd) {
        for (size_t i = 0; i < store_n; i++)
                if (strcmp(store_names[i], name) == 0) {
                        close(store_fds[i]);
                        store_fds[i] = fd;
                        return;
                }
        ck_assert_uint_lt(store_n, STORE_MAX);
        snprintf(store_names[store_n], sizeof store_names[0], "%s", name);
        store_fds[store_n++] = fd;
}

/* Reads notify messages; stores fds; returns true once READY=1 arrived. */
static bool pump_notify(void) {
        bool ready = false;
        for (;;) {
                char buf[4096];
                union {
                        struct cmsghdr h;
                        uint8_t b[CMSG_SPACE(sizeof(int) * 16)];
                } ctl;
                struct iovec iov = { buf, sizeof buf - 1 };
                struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = &ctl, .msg_controllen = sizeof ctl };
                ssize_t k = recvmsg(notify_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
                if (k < 0)
                        return ready;
                buf[k] = 0;
                int fds[16], nfds = 0;
                for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
                        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
                                nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                                memcpy(fds, CMSG_DATA(c), (size_t)nfds * sizeof(int));
                        }
                if (strstr(buf, "READY=1"))
                        ready = true;
                char *name = strstr(buf, "FDNAME=");
                if (strstr(buf, "FDSTORE=1") && name && nfds == 1) {
                        name += strlen("FDNAME=");
                        name[strcspn(name, "\n")] = 0;
                        store_put(name, fds[0]);
                } else
                        for (int i = 0; i < nfds; i++)
                                close(fds[i]);
        }
}

static void start_epdd(bool with_store) {
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                char cfg[400], names[4096] = "", n[32], p[32];
                int logfd = open(h.log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
                if (logfd >= 0) {
                        dup2(logfd, 2);
                        dup2(logfd, 1);
                }
                size_t k = with_store ? store_n : 0;
                /* Move the stored fds out of the way, then to 3.. in order. */
                int tmp[STORE_MAX];
                for (size_t i = 0; i < k; i++)
                        tmp[i] = fcntl(store_fds[i], F_DUPFD_CLOEXEC, 100);
                for (size_t i = 0; i < k; i++) {
                        if (dup2(tmp[i], 3 + (int)i) < 0)
                                _exit(126);
                        if (i > 0)
                                strcat(names, ":");
                        strcat(names, store_names[i]);
                }
                if (k > 0) {
                        snprintf(n, sizeof n, "%zu", k);
                        snprintf(p, sizeof p, "%d", (int)getpid());
                        setenv("LISTEN_FDS", n, 1);
                        setenv("LISTEN_PID", p, 1);
                        setenv("LISTEN_FDNAMES", names, 1);
                }
                setenv("NOTIFY_SOCKET", notify_path, 1);
                snprintf(cfg, sizeof cfg, "--config=%s", h.config);
                execl(harness_epdd(), harness_epdd(), cfg, (char *)NULL);
                _exit(127);
        }
        h.epdd_pid = pid;
        for (int i = 0; i < 1000; i++) {
                if (pump_notify())
                        return;
                int status;
                ck_assert_int_ne(waitpid(pid, &status, WNOHANG), pid);
                usleep(10000);
        }
        ck_abort_msg("epdd did not become ready");
}

static void kill9_epdd(void) {
        int status;
        ck_assert_int_eq(kill(h.epdd_pid, SIGKILL), 0);
        ck_assert_int_eq(waitpid(h.epdd_pid, &status, 0), h.epdd_pid);
        h.epdd_pid = 0;
        pump_notify();
}

static uint8_t pattern(size_t i, unsigned round) {
        return (uint8_t)((i * 2654435761u) >> 13) ^ (uint8_t)round;
}

/* Registers, maps the arena, checks or writes `len` bytes of the pattern. */
static void worker_touch(const char *arena, bool write, unsigned round, size_t len, bool expect_same) {
        char address[512];
        epd_client *c;
        void *base;
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "colocated", "m", "cpu", NULL, NULL), 0);
        int i = epd_arena_find(c, arena);
        ck_assert_int_ge(i, 0);
        ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
        const epd_arena *a = epd_arena_get(c, (size_t)i);
        uint8_t *d = (uint8_t *)base + a->data_offset;
        ck_assert_uint_le(len, a->size - a->data_offset);
        if (write)
                for (size_t k = 0; k < len; k++)
                        d[k] = pattern(k, round);
        else {
                size_t diff = 0;
                for (size_t k = 0; k < len; k++)
                        diff += d[k] != pattern(k, round);
                if (expect_same)
                        ck_assert_msg(diff == 0, "%s: %zu of %zu bytes changed across the restart", arena, diff, len);
                else
                        ck_assert_msg(diff > len / 2, "%s: the bytes survived without the fd store?", arena);
        }
        /* The daemon bumps the generation every time it maps the arena. */
        const ArenaHeader *hd = base;
        ck_assert_int_eq(memcmp(hd->magic, EPD_ARENA_MAGIC, 8), 0);
        epd_disconnect(c);
}

static uint64_t generation(const char *arena) {
        char address[512];
        epd_client *c;
        void *base;
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "colocated", "m", "cpu", NULL, NULL), 0);
        int i = epd_arena_find(c, arena);
        ck_assert_int_ge(i, 0);
        ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
        uint64_t g = ((const ArenaHeader *)base)->generation;
        epd_disconnect(c);
        return g;
}

START_TEST(test_restart_keeps_arenas) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        snprintf(notify_path, sizeof notify_path, "%s/notify", h.dir);
        notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        ck_assert_int_ge(notify_fd, 0);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        strcpy(sa.sun_path, notify_path);
        ck_assert_int_eq(bind(notify_fd, (struct sockaddr *)&sa, sizeof sa), 0);

        start_epdd(true);
        /* Every host arena went into the store. */
        ck_assert_uint_eq(store_n, 2);
        const size_t len = 8 << 20;
        worker_touch("host0", true, 1, len, true);
        worker_touch("feat0", true, 2, len, true);
        uint64_t g0 = generation("host0");

        /* Several kill -9 / restart rounds; a worker connected at the kill. */
        for (unsigned round = 0; round < 3; round++) {
                char address[512];
                epd_client *busy;
                harness_direct_address(&h, address, sizeof address);
                ck_assert_int_eq(epd_connect(address, &busy), 0);
                ck_assert_int_eq(epd_register(busy, "decode", "m", "cpu", NULL, NULL), 0);
                kill9_epdd();
                epd_disconnect(busy);
                start_epdd(true);
                ck_assert_uint_eq(store_n, 2); /* taken back, not stored twice */
                worker_touch("host0", false, 1, len, true);
                worker_touch("feat0", false, 2, len, true);
                ck_assert_uint_gt(generation("host0"), g0);
        }

        /* Without the store, a restart starts from fresh memory. */
        kill9_epdd();
        start_epdd(false);
        worker_touch("host0", false, 1, len, false);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        for (size_t i = 0; i < store_n; i++)
                close(store_fds[i]);
        close(notify_fd);
        harness_done(&h);
}
END_TEST

/* -- committed sequences and cached features across kill -9 -- */

/* 4 layers x 16 tokens x (256 + 256) bytes: 32 KiB pages. */
static const epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                  .v_bytes_per_token = 256, .dtype = "bf16" };
#define KV_PAGE (4 * 16 * 512)
#define FEAT_BYTES (3 * 4096 * 4)
#define N_SEQ_PAGES 12

static epd_client *kv_worker(uint8_t **ret_host0, uint8_t **ret_feat0) {
        char address[512];
        epd_client *c;
        void *base;
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        ck_assert_int_eq(epd_register(c, "colocated", "m", "cpu", &kv, NULL), 0);
        int i = epd_arena_find(c, "host0");
        ck_assert_int_ge(i, 0);
        ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
        *ret_host0 = base;
        i = epd_arena_find(c, "feat0");
        ck_assert_int_ge(i, 0);
        ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
        *ret_feat0 = base;
        return c;
}

static uint64_t page_at(epd_client *c, uint32_t page) {
        return epd_page_offset(epd_arena_get(c, (size_t)epd_arena_find(c, "host0")), KV_PAGE, page);
}

static void write_page(epd_client *c, uint8_t *host0, uint32_t page, unsigned tag) {
        uint8_t *d = host0 + page_at(c, page);
        for (size_t k = 0; k < KV_PAGE; k++)
                d[k] = pattern(k, tag);
}

static void check_page(epd_client *c, uint8_t *host0, uint32_t page, unsigned tag) {
        const uint8_t *d = host0 + page_at(c, page);
        size_t diff = 0;
        for (size_t k = 0; k < KV_PAGE; k++)
                diff += d[k] != pattern(k, tag);
        ck_assert_msg(diff == 0, "page %u: %zu bytes changed across the restart", page, diff);
}

static const char *id_of(const char *path) {
        return strrchr(path, '/') + 1;
}

/* A second client that keeps creating, growing and dropping sequences while epdd is
 * killed: the load of the restart. It exits when the daemon goes away. */
static pid_t start_load(void) {
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                char address[512];
                epd_client *c;
                harness_direct_address(&h, address, sizeof address);
                if (epd_connect(address, &c) < 0 || epd_register(c, "decode", "m", "cpu", &kv, NULL) < 0)
                        _exit(1);
                for (unsigned i = 0;; i++) {
                        char *p = NULL;
                        if (epd_sequence_create(c, "host0", 2, &p, NULL, NULL) < 0)
                                _exit(0);
                        if (epd_sequence_append(c, p, 1, NULL, NULL) < 0)
                                _exit(0);
                        if (i % 2 == 0 && epd_sequence_release(c, p) < 0)
                                _exit(0);
                        free(p);
                }
        }
        return pid;
}

START_TEST(test_restart_keeps_sequences_and_features) {
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\nCompactSize=16K\n"), 0);
        store_n = 0;
        snprintf(notify_path, sizeof notify_path, "%s/notify", h.dir);
        notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        ck_assert_int_ge(notify_fd, 0);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        strcpy(sa.sun_path, notify_path);
        ck_assert_int_eq(bind(notify_fd, (struct sockaddr *)&sa, sizeof sa), 0);
        start_epdd(true);

        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);

        /* A sequence, a clone that shares it, a copy-on-write of the clone's page 0, a
         * truncate, a grant: every transition journaled. */
        char *seq = NULL, *clone = NULL, *gone = NULL;
        uint32_t *pages = NULL, *cpages = NULL;
        size_t n = 0, cn = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", N_SEQ_PAGES - 2, &seq, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_append(c, seq, 2, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_get_pages(c, seq, &pages, &n), 0);
        ck_assert_uint_eq(n, N_SEQ_PAGES);
        for (size_t i = 0; i < n; i++)
                write_page(c, host0, pages[i], (unsigned)i);
        ck_assert_int_eq(epd_sequence_clone(c, seq, &clone), 0);
        uint32_t w0;
        ck_assert_int_eq(epd_sequence_prepare_write(c, clone, 0, 1, &w0), 1);
        write_page(c, host0, w0, 100);
        ck_assert_int_eq(epd_sequence_truncate(c, clone, 6), 0);
        ck_assert_int_eq(epd_sequence_grant(c, seq, epd_worker_path(c)), 0);
        ck_assert_int_eq(epd_sequence_get_pages(c, clone, &cpages, &cn), 0);
        ck_assert_uint_eq(cn, 6);
        ck_assert_uint_eq(cpages[0], w0);
        /* Released before the kill: must stay released. */
        ck_assert_int_eq(epd_sequence_create(c, "host0", 3, &gone, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_release(c, gone), 0);

        /* A cached feature: produced, published, handle released (READY, unreferenced). */
        epd_feature *f = NULL;
        epd_feature_tensor t = { .name = "pixels", .dtype = "f32", .rank = 2, .shape = { 3, 4096 } };
        ck_assert_int_eq(epd_feature_acquire(c, "image:restart", true, &f), 0);
        ck_assert_str_eq(f->result, "produce");
        ck_assert_int_eq(epd_feature_produce(c, f, FEAT_BYTES, &t, 1, NULL), 0);
        ck_assert_ptr_nonnull(f->data);
        for (size_t k = 0; k < FEAT_BYTES; k++)
                ((uint8_t *)f->data)[k] = pattern(k, 7);
        ck_assert_int_eq(epd_feature_publish(c, f, 1234), 0);
        uint64_t feat_offset = f->offset;
        ck_assert_int_eq(epd_feature_release(c, f), 0);

        for (unsigned round = 0; round < 3; round++) {
                pid_t load = start_load();
                usleep(100000 + 50000 * round);
                kill9_epdd();
                int status;
                ck_assert_int_eq(waitpid(load, &status, 0), load);
                epd_disconnect(c);
                start_epdd(true);

                c = kv_worker(&host0, &feat0);
                /* Not attached yet: the restored sequence has no owner. */
                uint32_t *p2 = NULL;
                size_t n2 = 0;
                ck_assert_int_lt(epd_sequence_truncate(c, seq, 1), 0);
                char *path = NULL;
                ck_assert_int_eq(epd_sequence_attach(c, id_of(seq), &path), 0);
                ck_assert_str_eq(path, seq);
                free(path);
                ck_assert_int_eq(epd_sequence_attach(c, clone, NULL), 0);
                ck_assert_int_lt(epd_sequence_attach(c, id_of(gone), NULL), 0);

                ck_assert_int_eq(epd_sequence_get_pages(c, seq, &p2, &n2), 0);
                ck_assert_uint_eq(n2, n);
                ck_assert_int_eq(memcmp(p2, pages, n * sizeof *pages), 0);
                free(p2);
                for (size_t i = 0; i < n; i++)
                        check_page(c, host0, pages[i], (unsigned)i);
                ck_assert_int_eq(epd_sequence_get_pages(c, clone, &p2, &n2), 0);
                ck_assert_uint_eq(n2, cn);
                ck_assert_int_eq(memcmp(p2, cpages, cn * sizeof *cpages), 0);
                free(p2);
                check_page(c, host0, w0, 100);

                /* Refcounts came back: the clone's page 1 is shared, so writing it copies. */
                if (round == 0) {
                        /* New pages never alias restored ones. */
                        char *fresh = NULL;
                        uint32_t *fp = NULL;
                        size_t fn = 0;
                        ck_assert_int_eq(epd_sequence_create(c, "host0", 16, &fresh, &fp, &fn), 0);
                        for (size_t i = 0; i < fn; i++) {
                                for (size_t j = 0; j < n; j++)
                                        ck_assert_uint_ne(fp[i], pages[j]);
                                ck_assert_uint_ne(fp[i], w0);
                        }
                        free(fp);
                        ck_assert_int_eq(epd_sequence_release(c, fresh), 0);
                        free(fresh);
                }

                /* The feature: a hit, without producing, same bytes at the same place. */
                ck_assert_int_eq(epd_feature_acquire(c, "image:restart", false, &f), 0);
                ck_assert_str_eq(f->result, "hit");
                ck_assert_str_eq(f->state, "ready");
                ck_assert_uint_eq(f->offset, feat_offset);
                ck_assert_uint_eq(f->bytes, FEAT_BYTES);
                ck_assert_uint_eq(f->n_tensors, 1);
                ck_assert_ptr_nonnull(f->data);
                size_t diff = 0;
                for (size_t k = 0; k < FEAT_BYTES; k++)
                        diff += ((uint8_t *)f->data)[k] != pattern(k, 7);
                ck_assert_msg(diff == 0, "feature: %zu bytes changed across the restart", diff);
                ck_assert_int_eq(epd_feature_release(c, f), 0);
        }

        /* A release after the restart is journaled too. */
        ck_assert_int_eq(epd_sequence_release(c, clone), 0);
        kill9_epdd();
        epd_disconnect(c);
        start_epdd(true);
        c = kv_worker(&host0, &feat0);
        ck_assert_int_lt(epd_sequence_attach(c, clone, NULL), 0);
        ck_assert_int_eq(epd_sequence_attach(c, seq, NULL), 0);
        epd_disconnect(c);

        free(pages);
        free(cpages);
        free(seq);
        free(clone);
        free(gone);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        for (size_t i = 0; i < store_n; i++)
                close(store_fds[i]);
        close(notify_fd);
        harness_done(&h);
}
END_TEST

/* -- kill -9 at random moments under a sequence workload, many times -- */

#define CRASH_SEQS 8
#define CRASH_ROUNDS 20

typedef struct SeqModel {
        char *path;     /* NULL: slot empty */
        uint32_t *pages;
        size_t n;
} SeqModel;

static void model_set(SeqModel *m, epd_client *c) {
        free(m->pages);
        m->pages = NULL;
        ck_assert_int_eq(epd_sequence_get_pages(c, m->path, &m->pages, &m->n), 0);
}

static void model_clear(SeqModel *m) {
        free(m->path);
        free(m->pages);
        *m = (SeqModel){};
}

START_TEST(test_sequence_crash_loop) {
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\nCompactSize=32K\n"), 0);
        store_n = 0;
        snprintf(notify_path, sizeof notify_path, "%s/notify", h.dir);
        notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        ck_assert_int_ge(notify_fd, 0);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        strcpy(sa.sun_path, notify_path);
        ck_assert_int_eq(bind(notify_fd, (struct sockaddr *)&sa, sizeof sa), 0);
        start_epdd(true);

        SeqModel seqs[CRASH_SEQS] = {};
        uint64_t x = (uint64_t)getpid() << 1 | 1;
        unsigned acked_total = 0;
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);

        for (unsigned round = 0; round < CRASH_ROUNDS; round++) {
                pid_t killer = fork();
                ck_assert_int_ge(killer, 0);
                if (killer == 0) {
                        usleep(20000 + (unsigned)(x % 150000));
                        kill(h.epdd_pid, SIGKILL);
                        _exit(0);
                }
                int in_flight = -1; /* slot the unacknowledged call touched */
                for (;;) {
                        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
                        unsigned k = (unsigned)(x >> 33), i = k % CRASH_SEQS, j = (k >> 8) % CRASH_SEQS;
                        SeqModel *m = &seqs[i];
                        int r;
                        in_flight = (int)i;
                        if (!m->path) {
                                if ((k >> 16) % 2 == 0 || !seqs[j].path)
                                        r = epd_sequence_create(c, "host0", 1 + (k >> 20) % 4, &m->path, NULL, NULL);
                                else
                                        r = epd_sequence_clone(c, seqs[j].path, &m->path);
                                if (r < 0) {
                                        m->path = NULL;
                                        break;
                                }
                        } else
                                switch ((k >> 16) % 4) {
                                case 0:
                                        r = epd_sequence_append(c, m->path, 1 + (k >> 20) % 3, NULL, NULL);
                                        break;
                                case 1:
                                        r = epd_sequence_truncate(c, m->path, (uint32_t)(m->n / 2));
                                        break;
                                case 2: {
                                        uint32_t w;
                                        r = m->n > 0 ? epd_sequence_prepare_write(c, m->path, 0, 1, &w) : 0;
                                        break;
                                }
                                default:
                                        r = epd_sequence_release(c, m->path);
                                        if (r >= 0) {
                                                model_clear(m);
                                                acked_total++;
                                                continue;
                                        }
                                }
                        if (r < 0)
                                break; /* epdd died under this call */
                        /* Acknowledged: the model follows the daemon's answer. The table
                         * is read back; if epdd dies under that read, the slot is still
                         * the one in flight (the transition was acknowledged, though). */
                        free(m->pages);
                        m->pages = NULL;
                        if (epd_sequence_get_pages(c, m->path, &m->pages, &m->n) < 0) {
                                m->n = SIZE_MAX; /* unknown: acknowledged, not read */
                                break;
                        }
                        acked_total++;
                }
                int status;
                waitpid(killer, &status, 0);
                ck_assert_int_eq(waitpid(h.epdd_pid, &status, 0), h.epdd_pid);
                h.epdd_pid = 0;
                pump_notify();
                epd_disconnect(c);
                start_epdd(true);
                c = kv_worker(&host0, &feat0);

                /* Every acknowledged sequence is back with its exact page table; the one
                 * in flight is either as acknowledged or changed by that call. */
                for (unsigned i = 0; i < CRASH_SEQS; i++) {
                        SeqModel *m = &seqs[i];
                        if (!m->path)
                                continue;
                        int r = epd_sequence_attach(c, m->path, NULL);
                        if ((int)i == in_flight) {
                                if (r < 0) { /* a create or clone that was not acknowledged */
                                        model_clear(m);
                                        continue;
                                }
                                model_set(m, c);
                                continue;
                        }
                        ck_assert_msg(r == 0, "acknowledged sequence %s is gone after the restart", m->path);
                        uint32_t *p = NULL;
                        size_t n = 0;
                        ck_assert_int_eq(epd_sequence_get_pages(c, m->path, &p, &n), 0);
                        ck_assert_uint_eq(n, m->n);
                        ck_assert_int_eq(memcmp(p, m->pages, n * sizeof *p), 0);
                        free(p);
                }
                /* Refcounts are exact: fresh pages never alias a restored one. */
                char *fresh = NULL;
                uint32_t *fp = NULL;
                size_t fn = 0;
                ck_assert_int_eq(epd_sequence_create(c, "host0", 32, &fresh, &fp, &fn), 0);
                for (unsigned i = 0; i < CRASH_SEQS; i++)
                        for (size_t a = 0; seqs[i].path && a < seqs[i].n; a++)
                                for (size_t b = 0; b < fn; b++)
                                        ck_assert_uint_ne(seqs[i].pages[a], fp[b]);
                ck_assert_int_eq(epd_sequence_release(c, fresh), 0);
                free(fresh);
                free(fp);
        }
        printf("sequence crash loop: %u kill -9 restarts, %u acknowledged transitions checked\n", CRASH_ROUNDS,
               acked_total);
        /* CompactSize=32K: snapshots (sequences as PUT records) were taken and killed
         * in the middle of, and restored from. */
        char cmd[600];
        snprintf(cmd, sizeof cmd, "grep -q 'WAL compacted' %s", h.log);
        ck_assert_int_eq(system(cmd), 0);
        ck_assert_uint_gt(acked_total, CRASH_ROUNDS);
        for (unsigned i = 0; i < CRASH_SEQS; i++)
                model_clear(&seqs[i]);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        for (size_t i = 0; i < store_n; i++)
                close(store_fds[i]);
        close(notify_fd);
        harness_done(&h);
}
END_TEST

int main(void) {
        Suite *s = suite_create("restart");
        TCase *tc = tcase_create("restart");
        tcase_set_timeout(tc, 400);
#ifdef CRASH_LOOP
        tcase_add_test(tc, test_sequence_crash_loop);
        (void)test_restart_keeps_arenas;
        (void)test_restart_keeps_sequences_and_features;
#else
        tcase_add_test(tc, test_restart_keeps_arenas);
        tcase_add_test(tc, test_restart_keeps_sequences_and_features);
        (void)test_sequence_crash_loop;
#endif
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
