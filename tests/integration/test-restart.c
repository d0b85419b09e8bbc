/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Restart without loss, with the test playing systemd's part: a notify socket that
 * keeps the fds epdd stores (FDSTORE=1, FDNAME=) and passes them back to the next epdd
 * (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES). A worker writes into the arenas, epdd is
 * killed with SIGKILL, started again, and the worker, reconnecting through libepd,
 * finds every byte as it left it. Without the store the memory is new. Built three
 * times: test-restart; test-restart-crash (-DCRASH_LOOP: kill -9 at random moments under
 * a sequence workload); test-restart-crash-directory-handoff (-DCRASH_LOOP_DH: the same
 * under block-directory publishes and handoffs, checking after each restart that every
 * acknowledged entry and handoff transition is there and nothing else). */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/arena.h"
#include "pages/sequence-record.h"
#include "wal/wal.h"
#include "epd/epd-feature.h"
#include "epd/handoff.h"
#include "harness.h"
#include "test-sequence-util.h"
#include "macro.h"
#include "../check-main.h"

#define STORE_MAX 32

static Harness h;
static int notify_fd = -1;
static char notify_path[300];
static char store_names[STORE_MAX][256];
static int store_fds[STORE_MAX];
static size_t store_n;

/* Whether two fds are one open file, as systemd's same_fd() asks (kcmp() first; two
 * pidfds of one process are two files, with one inode). */
static bool same_file(int a, int b) {
        pid_t self = getpid();
        long r = syscall(SYS_kcmp, self, self, 0 /* KCMP_FILE */, a, b);
        if (r >= 0)
                return r == 0;
        struct stat x, y;
        return fstat(a, &x) == 0 && fstat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

/* As systemd's fd store does: a file already stored is not stored twice (whatever its
 * name); another file under a name already there is stored beside it, the newest first
 * (the order LISTEN_FDNAMES passes them); FDSTOREREMOVE drops every fd of the name. */
static void store_put(const char *name, int fd) {
        for (size_t i = 0; i < store_n; i++)
                if (same_file(fd, store_fds[i])) {
                        close(fd);
                        return;
                }
        ck_assert_uint_lt(store_n, STORE_MAX);
        memmove(store_names[1], store_names[0], store_n * sizeof store_names[0]);
        memmove(store_fds + 1, store_fds, store_n * sizeof store_fds[0]);
        snprintf(store_names[0], sizeof store_names[0], "%s", name);
        store_fds[0] = fd;
        store_n++;
}

static void store_remove(const char *name) {
        for (size_t i = 0; i < store_n;)
                if (strcmp(store_names[i], name) == 0) {
                        close(store_fds[i]);
                        store_n--;
                        memmove(store_names[i], store_names[i + 1], (store_n - i) * sizeof store_names[0]);
                        memmove(store_fds + i, store_fds + i + 1, (store_n - i) * sizeof store_fds[0]);
                } else
                        i++;
}

/* The arenas' fds in the store (the worker processes' pidfds, mapper-*, aside). */
static size_t arenas_stored(void) {
        size_t n = 0;
        for (size_t i = 0; i < store_n; i++)
                n += strncmp(store_names[i], "arena-", 6) == 0;
        return n;
}

/* Reads notify messages; stores fds (and forgets them on FDSTOREREMOVE=1); returns true
 * once READY=1 arrived. */
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
                if (strstr(buf, "FDSTOREREMOVE=1") && name) {
                        name += strlen("FDNAME=");
                        name[strcspn(name, "\n")] = 0;
                        store_remove(name);
                        for (int i = 0; i < nfds; i++)
                                close(fds[i]);
                } else if (strstr(buf, "FDSTORE=1") && name && nfds == 1) {
                        name += strlen("FDNAME=");
                        name[strcspn(name, "\n")] = 0;
                        store_put(name, fds[0]);
                } else
                        for (int i = 0; i < nfds; i++)
                                close(fds[i]);
        }
}

/* When set, the next start_epdd() preloads fault-wal.c: epdd is killed with SIGKILL
 * right after WAL record fault_lsn is in the log. */
static uint64_t fault_lsn;
/* When set, the next start_epdd() preloads fault-wal.c with EPD_FAULT_WAL_ENOSPC_LSN:
 * every write of a record from LSN fault_enospc_lsn on fails (a full disk). */
static uint64_t fault_enospc_lsn;
/* With fault_enospc_lsn: the first failing write fails only after this many ms. */
static unsigned fault_enospc_delay_ms;
/* When set, the next start_epdd() preloads fault-wal.c with EPD_FAULT_WAL_SLOW_LSN: the
 * first fault_slow_writes writes of records from fault_slow_lsn on take fault_slow_ms
 * longer each, then succeed. */
static uint64_t fault_slow_lsn;
static unsigned fault_slow_ms, fault_slow_writes = 1;
/* When set, the next start_epdd() preloads fault-wal.c with EPD_FAULT_CLOCK_SHIFT_SEC: its
 * wall clock this many seconds ahead. */
static uint64_t fault_clock_shift_sec;
/* When set, the next start_epdd() preloads fault-malloc.c: a malloc() of this many bytes
 * while fault_malloc_arm (a file) exists fails, once per creation of the file. */
static size_t fault_malloc_size;
static char fault_malloc_arm[300];
/* When set, the next start_epdd() preloads fault-malloc.c with EPD_FAULT_MMAP_SIZE: the
 * first shared mapping of a file of that many bytes while fault_malloc_arm exists fails. */
static size_t fault_mmap_size;

/* In the child about to exec epdd: fault-wal.c preloaded, `var` set to `value`. */
static void preload_fault_wal(const char *var, uint64_t value) {
        const char *asan = getenv("ASAN_OPTIONS");
        char v[32], env[1024];
        if (!asan || !strstr(asan, "verify_asan_link_order=0")) {
                snprintf(env, sizeof env, "%s%sverify_asan_link_order=0", asan ? asan : "",
                         asan && *asan ? ":" : "");
                setenv("ASAN_OPTIONS", env, 1);
        }
        setenv("LD_PRELOAD", getenv("FAULT_WAL"), 1);
        snprintf(v, sizeof v, "%" PRIu64, value);
        setenv(var, v, 1);
}

/* The notify socket of the systemd this test plays (in h.dir), with an empty fd store. */
static void open_notify(void) {
        store_n = 0;
        snprintf(notify_path, sizeof notify_path, "%s/notify", h.dir);
        notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        ck_assert_int_ge(notify_fd, 0);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        strcpy(sa.sun_path, notify_path);
        ck_assert_int_eq(bind(notify_fd, (struct sockaddr *)&sa, sizeof sa), 0);
}

/* open_notify()'s end: the stored fds, the socket and the harness's directory. */
static void close_notify(void) {
        for (size_t i = 0; i < store_n; i++)
                close(store_fds[i]);
        store_n = 0;
        close(notify_fd);
        notify_fd = -1;
        harness_done(&h);
}

static pid_t spawn_epdd(bool with_store) {
        /* What the previous epdd sent after the last pump (a clean stop is not pumped):
         * systemd acts on it before it starts the next one, so does this store. */
        (void)pump_notify();
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                char cfg[400], names[4096] = "", n[32], p[32];
                if (fault_lsn > 0)
                        preload_fault_wal("EPD_FAULT_WAL_LSN", fault_lsn);
                if (fault_enospc_lsn > 0) {
                        preload_fault_wal("EPD_FAULT_WAL_ENOSPC_LSN", fault_enospc_lsn);
                        if (fault_enospc_delay_ms > 0)
                                preload_fault_wal("EPD_FAULT_WAL_ENOSPC_DELAY_MS", fault_enospc_delay_ms);
                }
                if (fault_malloc_size > 0) {
                        preload_fault_wal("EPD_FAULT_MALLOC_SIZE", fault_malloc_size);
                        setenv("LD_PRELOAD", getenv("FAULT_MALLOC"), 1);
                        setenv("EPD_FAULT_MALLOC_ARM", fault_malloc_arm, 1);
                }
                if (fault_mmap_size > 0) {
                        preload_fault_wal("EPD_FAULT_MMAP_SIZE", fault_mmap_size);
                        setenv("LD_PRELOAD", getenv("FAULT_MALLOC"), 1);
                        setenv("EPD_FAULT_MALLOC_ARM", fault_malloc_arm, 1);
                }
                if (fault_clock_shift_sec > 0)
                        preload_fault_wal("EPD_FAULT_CLOCK_SHIFT_SEC", fault_clock_shift_sec);
                if (fault_slow_lsn > 0) {
                        preload_fault_wal("EPD_FAULT_WAL_SLOW_LSN", fault_slow_lsn);
                        preload_fault_wal("EPD_FAULT_WAL_SLOW_MS", fault_slow_ms);
                        preload_fault_wal("EPD_FAULT_WAL_SLOW_WRITES", fault_slow_writes);
                }
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
        harness_note_pid(&h, pid);
        return pid;
}

/* An epdd expected to fail its start: its exit status, or 0 if it became ready (then it
 * is stopped with SIGKILL: a start that should have failed never hangs the test). */
static int run_epdd_to_exit(bool with_store) {
        pid_t pid = spawn_epdd(with_store);
        int status;
        for (int i = 0; i < 3000; i++) {
                if (waitpid(pid, &status, WNOHANG) == pid) {
                        (void)pump_notify();
                        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                }
                if (pump_notify())
                        break;
                usleep(10000);
        }
        (void)kill(pid, SIGKILL);
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        (void)pump_notify();
        return 0;
}

static void start_epdd(bool with_store) {
        pid_t pid = spawn_epdd(with_store);
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
        ck_assert_uint_eq(arenas_stored(), 2);
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
                ck_assert_uint_eq(arenas_stored(), 2); /* taken back, not stored twice */
                worker_touch("host0", false, 1, len, true);
                worker_touch("feat0", false, 2, len, true);
                ck_assert_uint_gt(generation("host0"), g0);
        }

        /* Without the store, a restart starts from fresh memory. */
        kill9_epdd();
        start_epdd(false);
        worker_touch("host0", false, 1, len, false);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

/* The daemon's configuration with these arena sections (as harness_init writes it). */
static void write_arenas(const char *arenas) {
        FILE *f = fopen(h.config, "we");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "[Daemon]\nSocket=%s\nSystemBus=no\nStateDirectory=%s/state\nLogLevel=debug\n"
                   "HostId=test-host\n%s",
                h.socket, h.dir, arenas);
        ck_assert_int_eq(fclose(f), 0);
}

/* Bytes of memory the stored fd of arena `name` holds (its memfd's allocated blocks). */
static uint64_t arena_allocated(const char *name) {
        char want[256];
        struct stat st;
        snprintf(want, sizeof want, "arena-%s", name);
        for (size_t i = 0; i < store_n; i++)
                if (strcmp(store_names[i], want) == 0) {
                        ck_assert_int_eq(fstat(store_fds[i], &st), 0);
                        return (uint64_t)st.st_blocks * 512;
                }
        ck_abort_msg("arena %s is not in the store", name);
        return 0;
}

/* A stored arena comes back only into the slot and size it had: the WAL's records name
 * arenas by index, so an arena taken back at another index (sections reordered) would
 * get another arena's sequences and directory entries over its bytes, and one whose
 * Size= or HugePages= changed would keep its old size. Either starts from fresh memory. */
START_TEST(test_restart_arena_moved_or_resized) {
        const size_t len = 4 << 20;
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Arena:a]\nSize=16M\n[Arena:b]\nSize=16M\n");
        open_notify();
        start_epdd(true);
        ck_assert_uint_eq(arenas_stored(), 2);
        worker_touch("a", true, 1, len, true);
        worker_touch("b", true, 2, len, true);
        kill9_epdd();
        /* The same sections: both taken back. */
        start_epdd(true);
        worker_touch("a", false, 1, len, true);
        worker_touch("b", false, 2, len, true);
        kill9_epdd();
        /* Swapped: a and b change slots; both start fresh. */
        write_arenas("[Arena:b]\nSize=16M\n[Arena:a]\nSize=16M\n");
        start_epdd(true);
        worker_touch("a", false, 1, len, false);
        worker_touch("b", false, 2, len, false);
        worker_touch("a", true, 3, len, true);
        worker_touch("b", true, 4, len, true);
        kill9_epdd();
        /* a grows: fresh, of the new size; b (same slot, same size) taken back. */
        write_arenas("[Arena:b]\nSize=16M\n[Arena:a]\nSize=32M\n");
        start_epdd(true);
        worker_touch("a", false, 3, len, false);
        worker_touch("b", false, 4, len, true);
        ck_assert_uint_eq(arenas_stored(), 2); /* a's old fd left the store, its new one is there */
        kill9_epdd();
        /* Prefault=yes is not a change of shape: b is taken back with its bytes, and
         * every page of it is allocated now (only those written were before). */
        ck_assert_uint_lt(arena_allocated("b"), 16 << 20);
        write_arenas("[Arena:b]\nSize=16M\nPrefault=yes\n[Arena:a]\nSize=32M\n");
        start_epdd(true);
        ck_assert_uint_ge(arena_allocated("b"), 16 << 20);
        worker_touch("b", false, 4, len, true);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

static unsigned log_count(const char *text);

/* A start that fails at one arena leaves the stored arenas after it in systemd's store:
 * the next good start takes them back with their bytes. */
START_TEST(test_failed_start_keeps_the_store) {
        const size_t len = 4 << 20;
        const char *arenas = "[Arena:a]\nSize=16M\n[Arena:b]\nSize=16M\n[Arena:c]\nSize=16M\n";
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas(arenas);
        open_notify();
        start_epdd(true);
        ck_assert_uint_eq(arenas_stored(), 3);
        worker_touch("a", true, 1, len, true);
        worker_touch("c", true, 3, len, true);
        kill9_epdd();
        /* b now asks for more huge pages than this machine has: the start fails there. */
        write_arenas("[Arena:a]\nSize=16M\n[Arena:b]\nSize=64G\nHugePages=yes\n[Arena:c]\nSize=16M\n");
        ck_assert_int_ne(run_epdd_to_exit(true), 0);
        ck_assert_msg(log_count("HugePages=yes but") > 0, "the start did not fail at arena b");
        write_arenas(arenas);
        /* Arena a's stored memory cannot be mapped for now (ENOMEM): the start fails and
         * the fd stays in the store, not dropped for fresh memory. */
        snprintf(fault_malloc_arm, sizeof fault_malloc_arm, "%s/arm-mmap", h.dir);
        int afd = open(fault_malloc_arm, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        ck_assert_int_ge(afd, 0);
        close(afd);
        fault_mmap_size = (16 << 20) + 4096; /* the arena's file: its header page and 16M */
        size_t stored = store_n;
        ck_assert_int_ne(run_epdd_to_exit(true), 0);
        fault_mmap_size = 0;
        ck_assert_int_ne(access(fault_malloc_arm, F_OK), 0); /* the fault was taken */
        ck_assert_msg(log_count("stays in the fd store") > 0, "the start did not fail at arena a");
        ck_assert_uint_eq(store_n, stored);
        start_epdd(true);
        worker_touch("a", false, 1, len, true);
        worker_touch("c", false, 3, len, true);

        /* An older copy of arena a's file stored under its name too (systemd keeps both,
         * the newest first): a is taken back from the newest, and dropping the older copy
         * (by name) does not drop the one taken back with it. */
        kill9_epdd();
        size_t ai = STORE_MAX;
        for (size_t i = 0; i < store_n; i++)
                if (strcmp(store_names[i], "arena-a") == 0)
                        ai = i;
        ck_assert_uint_lt(ai, store_n);
        struct stat st;
        ck_assert_int_eq(fstat(store_fds[ai], &st), 0);
        int old = memfd_create("stale-arena-a", MFD_CLOEXEC);
        ck_assert_int_ge(old, 0);
        ck_assert_int_eq(ftruncate(old, st.st_size), 0);
        off_t in = 0, out = 0;
        ck_assert_int_eq(copy_file_range(store_fds[ai], &in, old, &out, 4096, 0), 4096); /* its header */
        ck_assert_uint_lt(store_n, STORE_MAX);
        snprintf(store_names[store_n], sizeof store_names[0], "arena-a"); /* older: after it */
        store_fds[store_n++] = old;
        start_epdd(true);
        worker_touch("a", false, 1, len, true);
        size_t copies = 0;
        for (size_t i = 0; i < store_n; i++)
                copies += strcmp(store_names[i], "arena-a") == 0;
        ck_assert_uint_eq(copies, 1);
        ck_assert_uint_ge(log_count("older copy of one taken back"), 1);
        kill9_epdd();
        start_epdd(true);
        worker_touch("a", false, 1, len, true); /* still stored, and the right one */

        /* A newer copy under the name that is no arena's file: refused, and the older
         * copy, the arena's, taken back instead; the refused one is not stored again. */
        kill9_epdd();
        int bogus = memfd_create("not-an-arena", MFD_CLOEXEC);
        ck_assert_int_ge(bogus, 0);
        ck_assert_int_eq(ftruncate(bogus, st.st_size), 0);
        struct stat bst;
        ck_assert_int_eq(fstat(bogus, &bst), 0);
        store_put("arena-a", bogus); /* the newest: first */
        start_epdd(true);
        copies = 0;
        for (size_t i = 0; i < store_n; i++)
                if (strcmp(store_names[i], "arena-a") == 0) {
                        struct stat x;
                        ck_assert_int_eq(fstat(store_fds[i], &x), 0);
                        ck_assert_msg(x.st_ino != bst.st_ino, "the refused copy was stored again");
                        copies++;
                }
        ck_assert_uint_eq(copies, 1);
        worker_touch("a", false, 1, len, true); /* the bytes of before: the older copy's */
        ck_assert_uint_ge(log_count("does not hold that arena"), 1);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

/* -- committed sequences and cached features across kill -9 -- */

/* 4 layers x 16 tokens x (256 + 256) bytes: 32 KiB pages. */
static const epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                  .v_bytes_per_token = 256, .dtype = "bf16" };
#define KV_PAGE (4 * 16 * 512)
#define FEAT_BYTES (3 * 4096 * 4)
#define N_SEQ_PAGES 12

/* A worker of layout l with host0 mapped, and feat0 too when ret_feat0 is given. */
static epd_client *worker_of(const epd_kv_layout *l, uint8_t **ret_host0, uint8_t **ret_feat0) {
        char address[512];
        epd_client *c;
        void *base;
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        int r = epd_register(c, "colocated", "m", "cpu", l, NULL);
        ck_assert_msg(r == 0, "register: %s", epd_last_error_message(c));
        int i = epd_arena_find(c, "host0");
        ck_assert_int_ge(i, 0);
        ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
        *ret_host0 = base;
        if (ret_feat0) {
                i = epd_arena_find(c, "feat0");
                ck_assert_int_ge(i, 0);
                ck_assert_int_eq(epd_arena_map(c, (size_t)i, &base), 0);
                *ret_feat0 = base;
        }
        return c;
}

static epd_client *kv_worker(uint8_t **ret_host0, uint8_t **ret_feat0) {
        return worker_of(&kv, ret_host0, ret_feat0);
}

/* Lines of epdd's log (every start appends to it) that hold text. */
static unsigned log_count(const char *text) {
        FILE *f = fopen(h.log, "re");
        ck_assert_ptr_nonnull(f);
        char line[4096];
        unsigned n = 0;
        while (fgets(line, sizeof line, f))
                n += strstr(line, text) != NULL;
        fclose(f);
        return n;
}

/* The restored sequences keep host0's page size (its memory survived in the store):
 * said once per start, and a worker of another layout is told so, by name. */
static void check_journal_pool_reported(unsigned starts_with_journal) {
        ck_assert_uint_eq(log_count("Arena host0 keeps KV pages of 32768 bytes: "), starts_with_journal);
        char address[512];
        epd_client *c;
        harness_direct_address(&h, address, sizeof address);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        epd_kv_layout other = kv;
        other.layers = 8;
        ck_assert_int_eq(epd_register(c, "decode", "m", "cpu", &other, NULL), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        ck_assert_msg(strstr(epd_last_error_message(c), "KV pages of 65536 bytes do not fit arena host0, which holds "
                                                        "pages of 32768 bytes (restored from the journal of the "
                                                        "previous run)"),
                      "message: %s", epd_last_error_message(c));
        epd_disconnect(c);
}

static uint64_t page_at(epd_client *c, uint32_t page) {
        return epd_page_offset(epd_arena_get(c, (size_t)epd_arena_find(c, "host0")), KV_PAGE, page);
}

static void write_page(epd_client *c, uint8_t *host0, uint32_t page, unsigned tag) {
        uint8_t *d = host0 + page_at(c, page);
        for (size_t k = 0; k < KV_PAGE; k++)
                d[k] = pattern(k, tag);
}

/* How many bytes of `page` differ from pattern `tag`. */
static size_t page_diff(epd_client *c, const uint8_t *host0, uint32_t page, unsigned tag) {
        const uint8_t *d = host0 + page_at(c, page);
        size_t diff = 0;
        for (size_t k = 0; k < KV_PAGE; k++)
                diff += d[k] != pattern(k, tag);
        return diff;
}

static void check_page(epd_client *c, uint8_t *host0, uint32_t page, unsigned tag) {
        size_t diff = page_diff(c, host0, page, tag);
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
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\nCompactSize=32K\n"), 0);
        open_notify();
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
                check_journal_pool_reported(round + 1);
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
        close_notify();
}
END_TEST

/* kill -9 now (c connected, b held), restart, and check that ka (written 0xaa) is no
 * hit with another feature's bytes. */
static void crash_then_check_a(epd_client *c, epd_feature *b, const char *ka, unsigned round) {
        uint8_t *host0, *feat0;
        epd_feature *a = NULL;
        kill9_epdd();
        epd_disconnect(c);
        (void)epd_feature_release(NULL, b); /* the daemon is gone: only the struct */

        start_epdd(true);
        c = kv_worker(&host0, &feat0);
        int r = epd_feature_acquire(c, ka, false, &a);
        if (r == 0) {
                ck_assert_msg(strcmp(a->result, "hit") != 0 || ((uint8_t *)a->data)[0] == 0xaa,
                              "round %u: %s answered a hit holding another feature's bytes (0x%02x)", round, ka,
                              ((uint8_t *)a->data)[0]);
                ck_assert_int_eq(epd_feature_release(c, a), 0);
        }
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
}

/* An evicted feature's region handed to the next producer: that producer hears of it only
 * once the eviction's GONE is durable. Otherwise a kill -9 right after it wrote could
 * leave the evicted feature's READY in the log over the new bytes, and the restarted
 * epdd would answer a hit with another feature's bytes. */
START_TEST(test_evicted_region_reused_before_crash) {
        ck_assert_int_eq(harness_init(&h, "[Features]\nCacheSize=64K\n"), 0);
        open_notify();

        for (unsigned round = 0; round < 3; round++) {
                start_epdd(true);
                uint8_t *host0, *feat0;
                epd_client *c = kv_worker(&host0, &feat0);
                epd_feature_tensor t = { .name = "pixels", .dtype = "u8", .rank = 1, .shape = { 48 * 1024 } };
                char ka[32], kb[32];
                snprintf(ka, sizeof ka, "image:A%u", round);
                snprintf(kb, sizeof kb, "image:B%u", round);
                epd_feature *a = NULL, *b = NULL;
                ck_assert_int_eq(epd_feature_reserve(c, ka, 48 * 1024, &t, 1, NULL, &a), 0);
                memset(a->data, 0xaa, 48 * 1024);
                ck_assert_int_eq(epd_feature_publish(c, a, 1), 0);
                uint64_t off = a->offset;
                ck_assert_int_eq(epd_feature_release(c, a), 0);
                /* B does not fit beside A (64K of cache): A is evicted, B takes its place. */
                ck_assert_int_eq(epd_feature_reserve(c, kb, 48 * 1024, &t, 1, NULL, &b), 0);
                ck_assert_uint_eq(b->offset, off);
                memset(b->data, 0xbb, 48 * 1024);
                crash_then_check_a(c, b, ka, round);
        }
        close_notify();
}
END_TEST

/* The same for a region handed to a feature read back from the store: the read waits for
 * the evicted feature's GONE to be durable before it writes into the region, or a kill -9
 * right after the load could leave the evicted feature's READY over the loaded bytes. */
/* A counter of org.epd1.Feature. */
static uint64_t feature_stat(const char *name) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        uint64_t v = UINT64_MAX;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, NULL, "/org/epd1/feature", "org.epd1.Feature", name, &e, 't',
                                                     &v),
                         0);
        sd_bus_flush_close_unref(bus);
        return v;
}

static unsigned store_files(const char *dir, bool remove) {
        DIR *d = opendir(dir);
        unsigned k = 0;
        ck_assert_ptr_nonnull(d);
        for (struct dirent *de; (de = readdir(d));)
                if (strncmp(de->d_name, "f-", 2) == 0 && strstr(de->d_name, ".feat")) {
                        k++;
                        if (remove)
                                ck_assert_int_eq(unlinkat(dirfd(d), de->d_name, 0), 0);
                }
        closedir(d);
        return k;
}

START_TEST(test_loaded_region_reused_before_crash) {
        char store[300], line[400];
        ck_assert_int_eq(harness_init(&h, "[Features]\nCacheSize=64K\n"), 0);
        snprintf(store, sizeof store, "%s/store", h.dir);
        ck_assert_int_eq(mkdir(store, 0700), 0);
        snprintf(line, sizeof line, "StoreDirectory=%s\n", store);
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fputs(line, f);
        fclose(f);
        open_notify();

        for (unsigned round = 0; round < 3; round++) {
                (void)store_files(store, true); /* the last round's */
                start_epdd(true);
                uint8_t *host0, *feat0;
                epd_client *c = kv_worker(&host0, &feat0);
                epd_feature_tensor t = { .name = "pixels", .dtype = "u8", .rank = 1, .shape = { 48 * 1024 } };
                char ka[32], kb[32];
                snprintf(ka, sizeof ka, "image:A%u", round);
                snprintf(kb, sizeof kb, "image:B%u", round);
                epd_feature *a = NULL, *b = NULL;
                /* B, then A in B's place (B is spilled to the store). B's reservation may
                 * evict the last round's A, kept over the restart: its spill is waited
                 * for, so that B's finds the spill queue (CacheSize=, 64 KiB) empty and
                 * is written, not dropped; the store's file is then B's. */
                ck_assert_int_eq(epd_feature_reserve(c, kb, 48 * 1024, &t, 1, NULL, &b), 0);
                memset(b->data, 0xbb, 48 * 1024);
                ck_assert_int_eq(epd_feature_publish(c, b, 1), 0);
                ck_assert_int_eq(epd_feature_release(c, b), 0);
                for (unsigned i = 0; feature_stat("SpillPendingBytes") > 0; i++) {
                        ck_assert_msg(i < 1000, "round %u: the last round's A was never spilled", round);
                        usleep(10000);
                }
                uint64_t written = feature_stat("SpillWritten");
                ck_assert_int_eq(epd_feature_reserve(c, ka, 48 * 1024, &t, 1, NULL, &a), 0);
                memset(a->data, 0xaa, 48 * 1024);
                ck_assert_int_eq(epd_feature_publish(c, a, 1), 0);
                uint64_t off = a->offset;
                ck_assert_int_eq(epd_feature_release(c, a), 0);
                for (unsigned i = 0; feature_stat("SpillWritten") == written; i++) {
                        ck_assert_msg(i < 1000, "round %u: B was never spilled", round);
                        usleep(10000);
                }
                ck_assert_uint_eq(feature_stat("SpillDropped"), 0);
                ck_assert_uint_ge(store_files(store, false), 1);
                usleep(50000); /* B's GONE is durable by now (lazy bound: milliseconds) */
                /* Reading B back evicts A and takes A's region. */
                ck_assert_int_eq(epd_feature_acquire(c, kb, false, &b), 0);
                ck_assert_str_eq(b->result, "hit");
                ck_assert_uint_eq(b->offset, off);
                ck_assert_uint_eq(((uint8_t *)b->data)[0], 0xbb);
                crash_then_check_a(c, b, ka, round);
        }
        close_notify();
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
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\nCompactSize=16K\n"), 0);
        open_notify();
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
        /* CompactSize=16K: snapshots (sequences as PUT records) were taken and killed
         * in the middle of, and restored from. */
        char cmd[600];
        snprintf(cmd, sizeof cmd, "grep -q 'WAL compacted' %s", h.log);
        ck_assert_int_eq(system(cmd), 0);
        ck_assert_uint_gt(acked_total, CRASH_ROUNDS);
        for (unsigned i = 0; i < CRASH_SEQS; i++)
                model_clear(&seqs[i]);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST


/* -- kill -9 under a block-directory and handoff workload, many times -- */

#define DH_ROUNDS 12
#define DH_ENTRIES_MAX 96
#define DH_HANDOFFS_MAX 96

typedef struct DirEntry {
        uint64_t hash;
        uint32_t page;
        unsigned tag;
} DirEntry;

typedef enum {
        HO_PREPARED,
        HO_COMMITTED,
        HO_ROLLED_BACK,
        HO_RECOVERED_ROLLED_BACK, /* in flight at a kill: rolled back at the restart */
        HO_RELEASED,
        HO_RELEASED_KEPT,         /* released after its commit: the decode sequence stays */
        HO_SOURCE_RELEASED,       /* the kill came between releasing the source and the
                                   * destination: the destination's release was never
                                   * acknowledged, so its committed entry may stay (until
                                   * the journal's grace period); the decode sequence stays */
} HoState;

typedef struct HoModel {
        char rid[33];
        HoState state;
        char *src, *dst;      /* handoff paths (NULL after a restart: the objects are gone) */
        char *seq;            /* the prefill sequence */
        char *decode;         /* committed: the decode sequence */
        uint32_t *pages;      /* committed: its pages */
        size_t n_pages;
} HoModel;

static void ho_forget_objects(HoModel *m) {
        free(m->src);
        free(m->dst);
        m->src = m->dst = NULL;
}

static bool wait_transferred(epd_client *c, const char *path) {
        for (int i = 0; i < 500; i++) {
                epd_handoff_status st;
                if (epd_handoff_get(c, path, &st) < 0)
                        return false;
                if (strcmp(st.state, "transferred") == 0)
                        return true;
                usleep(2000);
        }
        return false;
}

typedef struct JournalRow {
        char rid[33], role[16], state[24], cause[24], seq[128];
        bool recovered;
} JournalRow;

static size_t read_journal(JournalRow *rows, size_t max) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        size_t n = 0;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        int r = sd_bus_get_property(bus, NULL, "/org/epd1/handoffs", "org.epd1.Handoffs", "Journal", &e, &reply,
                                    "a(sstssuuob)");
        ck_assert_msg(r >= 0, "Journal: %s", e.message);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(sstssuuob)"), 0);
        const char *rid, *role, *state, *cause, *seq;
        uint64_t token;
        uint32_t done, groups;
        int rec;
        while ((r = sd_bus_message_read(reply, "(sstssuuob)", &rid, &role, &token, &state, &cause, &done, &groups,
                                        &seq, &rec)) > 0) {
                ck_assert_uint_lt(n, max);
                JournalRow *x = &rows[n++];
                snprintf(x->rid, sizeof x->rid, "%s", rid);
                snprintf(x->role, sizeof x->role, "%s", role);
                snprintf(x->state, sizeof x->state, "%s", state);
                snprintf(x->cause, sizeof x->cause, "%s", cause);
                snprintf(x->seq, sizeof x->seq, "%s", seq);
                x->recovered = rec;
        }
        ck_assert_int_ge(r, 0);
        sd_bus_error_free(&e);
        sd_bus_flush_close_unref(bus);
        return n;
}

static const JournalRow *journal_find(const JournalRow *rows, size_t n, const char *rid, const char *role) {
        for (size_t i = 0; i < n; i++)
                if (strcmp(rows[i].rid, rid) == 0 && strcmp(rows[i].role, role) == 0)
                        return &rows[i];
        return NULL;
}

/* (free, live, cached idle, leased) pages of an arena's pool. */
static void pool_counts(const char *arena, uint64_t ret[4]) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property(bus, NULL, "/org/epd1/pages", "org.epd1.Pages", "Pools", &e, &reply,
                                             "a(sttttttttttt)"),
                         0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(sttttttttttt)"), 0);
        const char *name;
        uint64_t v[11];
        bool found = false;
        while (sd_bus_message_read(reply, "(sttttttttttt)", &name, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                                   &v[7], &v[8], &v[9], &v[10]) > 0)
                if (strcmp(name, arena) == 0) {
                        /* page_size total free live cached_idle shared leased ... */
                        ret[0] = v[2];
                        ret[1] = v[3];
                        ret[2] = v[4];
                        ret[3] = v[6];
                        found = true;
                }
        if (!found) /* no pool yet: nothing in it */
                ret[0] = ret[1] = ret[2] = ret[3] = 0;
        sd_bus_flush_close_unref(bus);
}

static uint64_t directory_entries(void) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        uint64_t v[8];
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property(bus, NULL, "/org/epd1/pages", "org.epd1.Pages", "Directory", &e, &reply,
                                             "(tttttttt)"),
                         0);
        ck_assert_int_ge(sd_bus_message_read(reply, "(tttttttt)", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7]),
                         0);
        sd_bus_flush_close_unref(bus);
        return v[0];
}

START_TEST(test_directory_handoff_crash_loop) {
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\nCompactSize=32K\n"
                                          "[Arena:host0]\nSize=64M\n[Arena:host1]\nSize=64M\n"
                                          "[Arena:feat0]\nUsage=feature\nSize=16M\nPageSize=64K\n"),
                         0);
        open_notify();
        start_epdd(true);

        static DirEntry dir[DH_ENTRIES_MAX];
        static HoModel ho[DH_HANDOFFS_MAX];
        size_t n_dir = 0, n_ho = 0;
        uint64_t x = (uint64_t)getpid() << 1 | 1, next_hash = 0x5eed0000ULL;
        unsigned acked = 0, tag = 1;
        static const uint32_t groups[2] = { 2, 2 };
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);

        for (unsigned round = 0; round < DH_ROUNDS; round++) {
                pid_t killer = fork();
                ck_assert_int_ge(killer, 0);
                if (killer == 0) {
                        usleep(30000 + (unsigned)(x % 200000));
                        kill(h.epdd_pid, SIGKILL);
                        _exit(0);
                }
                uint64_t pending_hash[2] = { 0, 0 }; /* a Publish in flight */
                uint32_t pending_page[2] = { 0, 0 };
                unsigned pending_tag = 0;
                int ho_in_flight = -1;
                for (;;) {
                        x = x * 6364136223846793005ULL + 1442695040888963407ULL;
                        unsigned k = (unsigned)(x >> 33);
                        int r = 0;
                        pending_hash[0] = pending_hash[1] = 0;
                        ho_in_flight = -1;
                        if (k % 3 == 0 && n_dir + 2 > DH_ENTRIES_MAX) {
                                uint64_t never = 0xdeadbeef00000000ULL;
                                if (epd_prefix_match(c, "host0", &never, 1) < 0)
                                        break;
                                continue;
                        }
                        if (k % 3 == 0) {
                                /* Publish two blocks, then let the sequence go: the pages
                                 * stay, cached by the directory only. */
                                char *p = NULL;
                                uint32_t *pg = NULL;
                                size_t n = 0;
                                uint64_t hs[2] = { next_hash++, next_hash++ };
                                r = epd_sequence_create(c, "host0", 2, &p, &pg, &n);
                                if (r < 0)
                                        break;
                                write_page(c, host0, pg[0], tag);
                                write_page(c, host0, pg[1], tag + 1);
                                pending_hash[0] = hs[0];
                                pending_hash[1] = hs[1];
                                pending_page[0] = pg[0];
                                pending_page[1] = pg[1];
                                pending_tag = tag;
                                r = epd_sequence_publish(c, p, 0, hs, 2);
                                if (r >= 0) {
                                        ck_assert_int_eq(r, 2);
                                        dir[n_dir++] = (DirEntry){ hs[0], pg[0], tag };
                                        dir[n_dir++] = (DirEntry){ hs[1], pg[1], tag + 1 };
                                        acked++;
                                        pending_hash[0] = pending_hash[1] = 0;
                                        r = epd_sequence_release(c, p);
                                }
                                tag += 2;
                                free(p);
                                free(pg);
                                if (r < 0)
                                        break;
                                acked++;
                                continue;
                        }
                        unsigned i = (k >> 8) % (n_ho + 1);
                        if ((i == n_ho && n_ho >= DH_HANDOFFS_MAX) || (i < n_ho && !ho[i].src)) {
                                /* Nothing to do on this one (full, or only its journal entry
                                 * is left from before a restart): a lookup instead, which
                                 * also notices the kill. */
                                uint64_t never = 0xdeadbeef00000000ULL;
                                if (epd_prefix_match(c, "host0", &never, 1) < 0)
                                        break;
                                continue;
                        }
                        if (i == n_ho) {
                                /* A new handoff into the other arena (pages are copied). */
                                HoModel *m = &ho[n_ho];
                                *m = (HoModel){};
                                snprintf(m->rid, sizeof m->rid, "%016llx%016llx", (unsigned long long)round,
                                         (unsigned long long)(x >> 1));
                                r = epd_sequence_create(c, "host0", 2, &m->seq, NULL, NULL);
                                if (r < 0)
                                        break;
                                n_ho++;
                                ho_in_flight = (int)i;
                                m->state = HO_RELEASED; /* until acknowledged */
                                epd_handoff_options o = { .arena = "host1" };
                                r = epd_handoff_prepare(c, m->rid, NULL, m->seq, groups, 2, &o, &m->src, NULL);
                                if (r < 0)
                                        break;
                                m->state = HO_PREPARED;
                                acked++;
                                continue;
                        }
                        HoModel *m = &ho[i];
                        ho_in_flight = (int)i;
                        if (m->state == HO_PREPARED && (k >> 20) % 3 != 0) {
                                /* Ship both groups, accept, commit. */
                                epd_handoff_accepted acc = {};
                                r = epd_handoff_layer_group_ready(c, m->src, 0);
                                if (r >= 0)
                                        r = epd_handoff_layer_group_ready(c, m->src, 1);
                                if (r >= 0)
                                        r = epd_handoff_accept(c, m->rid, &acc);
                                if (r < 0)
                                        break;
                                m->dst = strdup(acc.path);
                                epd_handoff_accepted_done(&acc);
                                if (!wait_transferred(c, m->dst))
                                        break;
                                r = epd_handoff_commit(c, m->dst, &m->decode);
                                if (r < 0)
                                        break;
                                m->state = HO_COMMITTED;
                                acked++;
                                if (epd_sequence_get_pages(c, m->decode, &m->pages, &m->n_pages) < 0)
                                        break;
                                continue;
                        }
                        if (m->state == HO_PREPARED) {
                                r = epd_handoff_rollback(c, m->src);
                                if (r < 0)
                                        break;
                                m->state = HO_ROLLED_BACK;
                                acked++;
                                continue;
                        }
                        /* Ended: release its sides (a committed decode sequence stays). */
                        r = epd_handoff_release(c, m->src);
                        if (r >= 0 && m->dst)
                                r = epd_handoff_release(c, m->dst);
                        if (r < 0)
                                break;
                        if (m->state == HO_COMMITTED)
                                m->state = HO_RELEASED_KEPT; /* released, decode sequence kept */
                        else
                                m->state = HO_RELEASED;
                        ho_forget_objects(m);
                        acked++;
                }
                int status;
                waitpid(killer, &status, 0);
                ck_assert_int_eq(waitpid(h.epdd_pid, &status, 0), h.epdd_pid);
                h.epdd_pid = 0;
                pump_notify();
                epd_disconnect(c);
                start_epdd(true);
                c = kv_worker(&host0, &feat0);

                /* Directory: every acknowledged entry is back, on its page, with its
                 * bytes; nothing else (at most the two of a Publish in flight). */
                for (size_t j = 0; j < n_dir; j++) {
                        char *p = NULL;
                        uint32_t *pg = NULL;
                        size_t blocks = 0, n = 0;
                        ck_assert_int_eq(epd_prefix_match(c, "host0", &dir[j].hash, 1), 1);
                        ck_assert_int_eq(epd_sequence_create_from_prefix(c, "host0", &dir[j].hash, 1, &p, &blocks, &pg,
                                                                          &n),
                                         0);
                        ck_assert_uint_eq(blocks, 1);
                        ck_assert_uint_eq(pg[0], dir[j].page);
                        check_page(c, host0, pg[0], dir[j].tag);
                        ck_assert_int_eq(epd_sequence_release(c, p), 0);
                        free(p);
                        free(pg);
                }
                uint64_t never = 0xdeadbeef00000000ULL + round;
                ck_assert_int_eq(epd_prefix_match(c, "host0", &never, 1), 0);
                uint64_t entries = directory_entries();
                int pending = pending_hash[0] != 0 ? epd_prefix_match(c, "host0", pending_hash, 2) : 0;
                ck_assert_int_ge(pending, 0);
                ck_assert_msg(entries == n_dir + (unsigned)pending, "directory: %llu entries, %zu acknowledged (+%d in flight)",
                              (unsigned long long)entries, n_dir, pending);
                /* What the call in flight published is there now: the model takes it. */
                for (int j = 0; j < pending; j++)
                        dir[n_dir++] = (DirEntry){ pending_hash[j], pending_page[j], pending_tag + (unsigned)j };

                /* Handoffs: in flight at the kill -> rolled back (shutdown); committed stay
                 * committed with their decode sequence; released ones are gone. */
                static JournalRow rows[4 * DH_HANDOFFS_MAX];
                size_t n_rows = read_journal(rows, ELEMENTSOF(rows));
                uint64_t committed_pages = 0;
                for (size_t j = 0; j < n_ho; j++) {
                        HoModel *m = &ho[j];
                        const JournalRow *src = journal_find(rows, n_rows, m->rid, "source");
                        const JournalRow *dst = journal_find(rows, n_rows, m->rid, "destination");
                        if ((int)j == ho_in_flight) {
                                /* The call in flight: as acknowledged, or as it would have left it. */
                                if (m->state == HO_RELEASED && src) {
                                        ck_assert_str_eq(src->state, "rolled-back");
                                        m->state = HO_RECOVERED_ROLLED_BACK;
                                } else if (m->state == HO_PREPARED && dst && strcmp(dst->state, "committed") == 0) {
                                        /* The commit went through on the destination (its
                                         * record carries the decode sequence); the kill may
                                         * have come before the source's own record. */
                                        m->decode = strdup(dst->seq);
                                        ck_assert_int_eq(epd_sequence_attach(c, m->decode, NULL), 0);
                                        ck_assert_int_eq(epd_sequence_get_pages(c, m->decode, &m->pages, &m->n_pages), 0);
                                        m->state = HO_COMMITTED;
                                } else if (m->state == HO_PREPARED && src) {
                                        ck_assert_str_eq(src->state, "rolled-back");
                                        /* A Rollback whose reply the kill cut off, or a
                                         * Prepare rolled back at the restart. */
                                        m->state = strcmp(src->cause, "requested") == 0 ? HO_ROLLED_BACK
                                                                                         : HO_RECOVERED_ROLLED_BACK;
                                } else if (m->state == HO_COMMITTED && !src && dst) {
                                        ck_assert_str_eq(dst->state, "committed");
                                        m->state = HO_SOURCE_RELEASED;
                                } else if (m->state == HO_COMMITTED && !src) {
                                        m->state = HO_RELEASED_KEPT; /* the release went through */
                                } else if (m->state == HO_ROLLED_BACK && !src) {
                                        m->state = HO_RELEASED;
                                } else if (m->state == HO_ROLLED_BACK && src) {
                                        ck_assert_str_eq(src->state, "rolled-back");
                                } else if (m->state == HO_COMMITTED) {
                                        ck_assert_ptr_nonnull(src);
                                        ck_assert_str_eq(src->state, "committed");
                                }
                                if (m->state == HO_COMMITTED && m->decode) {
                                        ck_assert_int_eq(epd_sequence_attach(c, m->decode, NULL), 0);
                                        /* The kill may have cut off the page lookup that
                                         * followed the acknowledged commit. */
                                        if (!m->pages)
                                                ck_assert_int_eq(epd_sequence_get_pages(c, m->decode, &m->pages,
                                                                                        &m->n_pages), 0);
                                        committed_pages += m->n_pages;
                                } else if ((m->state == HO_RELEASED_KEPT || m->state == HO_SOURCE_RELEASED) &&
                                           m->decode) {
                                        ck_assert_int_eq(epd_sequence_attach(c, m->decode, NULL), 0);
                                        committed_pages += m->n_pages;
                                }
                                ho_forget_objects(m);
                                continue;
                        }
                        switch (m->state) {
                        case HO_PREPARED:
                        case HO_RECOVERED_ROLLED_BACK:
                                ck_assert_msg(src, "handoff %s: acknowledged Prepare, no journal entry", m->rid);
                                ck_assert_str_eq(src->state, "rolled-back");
                                ck_assert_str_eq(src->cause, "shutdown");
                                ck_assert(src->recovered);
                                if (dst) {
                                        ck_assert_str_eq(dst->state, "rolled-back");
                                        ck_assert_str_eq(dst->cause, "shutdown");
                                }
                                m->state = HO_RECOVERED_ROLLED_BACK;
                                break;
                        case HO_ROLLED_BACK:
                                ck_assert_msg(src, "handoff %s: acknowledged rollback, no journal entry", m->rid);
                                ck_assert_str_eq(src->state, "rolled-back");
                                ck_assert_str_eq(src->cause, "requested");
                                break;
                        case HO_COMMITTED: {
                                ck_assert_msg(src && dst, "handoff %s: acknowledged commit, journal entries missing", m->rid);
                                ck_assert_str_eq(src->state, "committed");
                                ck_assert_str_eq(dst->state, "committed");
                                ck_assert_str_eq(dst->seq, m->decode);
                                break;
                        }
                        case HO_SOURCE_RELEASED:
                                ck_assert_msg(!src, "handoff %s: released source still journaled", m->rid);
                                if (dst)
                                        ck_assert_str_eq(dst->state, "committed");
                                break;
                        default: /* released */
                                ck_assert_msg(!src && !dst, "handoff %s: released, still journaled (source %s, destination %s)",
                                              m->rid, src ? src->state : "-", dst ? dst->state : "-");
                                break;
                        }
                        if (m->decode && (m->state == HO_COMMITTED || m->state == HO_RELEASED_KEPT ||
                                          m->state == HO_SOURCE_RELEASED)) {
                                /* The decode sequence is back with its exact pages. */
                                uint32_t *p = NULL;
                                size_t n = 0;
                                ck_assert_int_eq(epd_sequence_attach(c, m->decode, NULL), 0);
                                ck_assert_int_eq(epd_sequence_get_pages(c, m->decode, &p, &n), 0);
                                ck_assert_uint_eq(n, m->n_pages);
                                ck_assert_int_eq(memcmp(p, m->pages, n * sizeof *p), 0);
                                committed_pages += n;
                                free(p);
                        }
                        ho_forget_objects(m);
                }
                /* Nothing else in the journal. */
                for (size_t j = 0; j < n_rows; j++) {
                        bool known = false;
                        for (size_t q = 0; q < n_ho && !known; q++)
                                known = strcmp(ho[q].rid, rows[j].rid) == 0;
                        ck_assert_msg(known, "journal entry %s (%s) was never acknowledged", rows[j].rid, rows[j].role);
                        ck_assert(rows[j].recovered);
                }
                /* The destination arena holds exactly the committed decode sequences:
                 * the pages of handoffs rolled back at the restart are free again. */
                uint64_t pc[4];
                pool_counts("host1", pc);
                if (pc[1] != committed_pages) {
                        for (size_t q = 0; q < n_ho; q++)
                                fprintf(stderr, "model %s state %d decode %s%s\n", ho[q].rid, (int)ho[q].state,
                                        ho[q].decode ?: "-", (int)q == ho_in_flight ? " (in flight)" : "");
                        for (size_t j = 0; j < n_rows; j++)
                                fprintf(stderr, "journal %s %s %s %s %s\n", rows[j].rid, rows[j].role, rows[j].state,
                                        rows[j].cause, rows[j].seq);
                }
                ck_assert_msg(pc[1] == committed_pages && pc[2] == 0 && pc[3] == 0,
                              "host1: %llu live, %llu cached, %llu leased pages; %llu committed",
                              (unsigned long long)pc[1], (unsigned long long)pc[2], (unsigned long long)pc[3],
                              (unsigned long long)committed_pages);
        }
        printf("directory/handoff crash loop: %u kill -9 restarts, %u acknowledged transitions checked, "
               "%zu directory entries, %zu handoffs\n",
               DH_ROUNDS, acked, n_dir, n_ho);
        char cmd[600];
        snprintf(cmd, sizeof cmd, "grep -q 'WAL compacted' %s", h.log);
        ck_assert_int_eq(system(cmd), 0);
        ck_assert_uint_gt(acked, DH_ROUNDS);
        for (size_t j = 0; j < n_ho; j++) {
                ho_forget_objects(&ho[j]);
                free(ho[j].seq);
                free(ho[j].decode);
                free(ho[j].pages);
        }
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

/* -- a crash right after every WAL record of a scripted workload -- */

/* Every kind of journaled transition, one after the other (sequences, the block
 * directory, a feature, a handoff, workflows), run once to count its records, then
 * once per record N with epdd killed right after record N is in the log
 * (tests/integration/fault-wal.c). After each restart: every acknowledged transition
 * is there whole, the one in flight wholly or not at all, and no sequence is left
 * without an owner: once the worker has attached what it knows, only the heads of
 * live workflow branches are ownerless (plus, when the call in flight created a
 * sequence or a workflow, the one it made); when it has released everything, no page
 * is held. */

#define EV_SEQS 4
#define EV_WFS 2
#define EV_BR 8
#define EV_PAGES 64
#define EV_KEY "image:every-record"

typedef struct EvSeq {
        char path[128]; /* "": none */
        uint32_t pages[EV_PAGES];
        size_t n;
        bool known;     /* pages read back */
} EvSeq;

typedef struct EvWf {
        char id[40];    /* "": none */
        unsigned n_branches;
        bool alive[EV_BR];
        uint64_t steps[EV_BR];
        uint32_t ntok[EV_BR];
} EvWf;

typedef enum { EH_NONE, EH_PREPARED, EH_ACCEPTED, EH_COMMITTED, EH_SRC_RELEASED, EH_RELEASED } EvHo;

typedef struct EvModel {
        EvSeq seq[EV_SEQS];
        EvWf wf[EV_WFS];
        unsigned dir_entries;
        bool feature;
        EvHo ho;
        char decode[128];
} EvModel;

typedef struct EvRun {
        EvModel acked, after; /* after: acked plus the call in flight */
        /* The call in flight makes an object whose name it never got: a sequence
         * (CreateSequence, Clone), or a workflow with its head sequence (Create). */
        bool stray_ok, stray_workflow;
        const char *step;
        unsigned n_acked;
        char rid[33];
} EvRun;

static void ev_begin(EvRun *x, const char *step, bool stray_ok) {
        x->after = x->acked;
        x->step = step;
        x->stray_ok = stray_ok;
        x->stray_workflow = stray_ok && strncmp(step, "Workflow.", 9) == 0;
}

static void ev_ack(EvRun *x) {
        x->acked = x->after;
        x->n_acked++;
        x->step = NULL;
        x->stray_ok = x->stray_workflow = false;
}

/* Reads a sequence's table into the model (the acknowledged state); false if epdd died
 * under the read (then nothing is in flight). */
static bool ev_read(epd_client *c, EvRun *x, unsigned i) {
        EvSeq *q = &x->acked.seq[i];
        uint32_t *p = NULL;
        size_t n = 0;
        x->after = x->acked;
        if (epd_sequence_get_pages(c, q->path, &p, &n) < 0)
                return false;
        ck_assert_uint_le(n, EV_PAGES);
        memcpy(q->pages, p, n * sizeof *p);
        q->n = n;
        q->known = true;
        free(p);
        x->after = x->acked;
        return true;
}

static void ev_set_path(EvSeq *q, char *path) {
        snprintf(q->path, sizeof q->path, "%s", path);
        q->n = 0;
        q->known = false;
        free(path);
}

static void ev_tokens(uint32_t *t, size_t n, uint32_t base, size_t same) {
        for (size_t i = 0; i < n; i++)
                t[i] = i < same ? 1000 + (uint32_t)i : base + (uint32_t)i;
}

/* The workload; returns when a call fails (epdd died under it: x->step names it) or
 * at the end (x->step NULL). */
static void ev_workload(epd_client *c, EvRun *x, uint8_t *host0) {
        char *p = NULL;
        uint32_t t[128];
        int r;

        ev_begin(x, "CreateSequence", true);
        if (epd_sequence_create(c, "host0", 4, &p, NULL, NULL) < 0)
                return;
        ev_set_path(&x->after.seq[0], p);
        ev_ack(x);
        if (!ev_read(c, x, 0))
                return;
        ev_begin(x, "Append", false);
        x->after.seq[0].known = false;
        x->after.seq[0].n = 6;
        if (epd_sequence_append(c, x->acked.seq[0].path, 2, NULL, NULL) < 0)
                return;
        ev_ack(x);
        if (!ev_read(c, x, 0))
                return;
        ev_begin(x, "Clone", true);
        if (epd_sequence_clone(c, x->acked.seq[0].path, &p) < 0)
                return;
        ev_set_path(&x->after.seq[1], p);
        ev_ack(x);
        if (!ev_read(c, x, 1))
                return;
        ev_begin(x, "PrepareWrite", false);
        x->after.seq[1].known = false;
        uint32_t w0;
        if (epd_sequence_prepare_write(c, x->acked.seq[1].path, 0, 1, &w0) < 0)
                return;
        ev_ack(x);
        if (!ev_read(c, x, 1))
                return;
        ev_begin(x, "Truncate", false);
        x->after.seq[0].known = false;
        x->after.seq[0].n = 5;
        if (epd_sequence_truncate(c, x->acked.seq[0].path, 5) < 0)
                return;
        ev_ack(x);
        if (!ev_read(c, x, 0))
                return;
        ev_begin(x, "Grant", false);
        if (epd_sequence_grant(c, x->acked.seq[0].path, epd_worker_path(c)) < 0)
                return;
        ev_ack(x);

        /* Two blocks published, then their sequence released: the directory alone
         * holds the pages. */
        uint32_t *pg = NULL;
        size_t n = 0;
        ev_begin(x, "CreateSequence", true);
        if (epd_sequence_create(c, "host0", 2, &p, &pg, &n) < 0)
                return;
        ev_set_path(&x->after.seq[2], p);
        x->after.seq[2].n = n;
        memcpy(x->after.seq[2].pages, pg, n * sizeof *pg);
        x->after.seq[2].known = true;
        ev_ack(x);
        write_page(c, host0, pg[0], 11);
        write_page(c, host0, pg[1], 12);
        free(pg);
        uint64_t hashes[2] = { 0xe7e40001ULL, 0xe7e40002ULL };
        ev_begin(x, "Publish", false);
        x->after.dir_entries = 2;
        if (epd_sequence_publish(c, x->acked.seq[2].path, 0, hashes, 2) < 0)
                return;
        ev_ack(x);
        ev_begin(x, "Release", false);
        x->after.seq[2] = (EvSeq){};
        if (epd_sequence_release(c, x->acked.seq[2].path) < 0)
                return;
        ev_ack(x);

        /* A feature produced and published (READY), its handle released. */
        ev_begin(x, "feature", false);
        x->after.feature = true;
        epd_feature *f = NULL;
        epd_feature_tensor ft = { .name = "pixels", .dtype = "f32", .rank = 2, .shape = { 3, 4096 } };
        if (epd_feature_acquire(c, EV_KEY, true, &f) < 0)
                return;
        ck_assert_str_eq(f->result, "produce");
        r = epd_feature_produce(c, f, FEAT_BYTES, &ft, 1, NULL);
        if (r >= 0) {
                memset(f->data, 0x5a, FEAT_BYTES);
                r = epd_feature_publish(c, f, 77);
        }
        if (epd_feature_release(c, f) < 0 || r < 0) /* frees f either way */
                return;
        ev_ack(x);

        /* A handoff into host1: prepare, ship, accept, commit, release both sides. */
        static const uint32_t groups[2] = { 2, 2 };
        char *src = NULL, *dst = NULL, *decode = NULL;
        ev_begin(x, "CreateSequence", true);
        if (epd_sequence_create(c, "host0", 2, &p, NULL, NULL) < 0)
                return;
        ev_set_path(&x->after.seq[3], p);
        x->after.seq[3].n = 2;
        ev_ack(x);
        ev_begin(x, "handoff Prepare", false);
        x->after.ho = EH_PREPARED;
        epd_handoff_options o = { .arena = "host1" };
        if (epd_handoff_prepare(c, x->rid, NULL, x->acked.seq[3].path, groups, 2, &o, &src, NULL) < 0)
                return;
        ev_ack(x);
        ev_begin(x, "handoff Accept", false);
        x->after.ho = EH_ACCEPTED;
        epd_handoff_accepted acc = {};
        r = epd_handoff_layer_group_ready(c, src, 0);
        if (r >= 0)
                r = epd_handoff_layer_group_ready(c, src, 1);
        if (r >= 0)
                r = epd_handoff_accept(c, x->rid, &acc);
        if (r < 0)
                goto out;
        dst = strdup(acc.path);
        epd_handoff_accepted_done(&acc);
        ev_ack(x);
        if (!wait_transferred(c, dst))
                goto out;
        ev_begin(x, "handoff Commit", false);
        x->after.ho = EH_COMMITTED;
        if (epd_handoff_commit(c, dst, &decode) < 0)
                goto out;
        snprintf(x->after.decode, sizeof x->after.decode, "%s", decode);
        ev_ack(x);
        ev_begin(x, "handoff Release (source)", false);
        x->after.ho = EH_SRC_RELEASED;
        if (epd_handoff_release(c, src) < 0)
                goto out;
        ev_ack(x);
        ev_begin(x, "handoff Release (destination)", false);
        x->after.ho = EH_RELEASED;
        if (epd_handoff_release(c, dst) < 0)
                goto out;
        ev_ack(x);

        /* Workflows: every transition. */
        EvWf *w = &x->after.wf[0];
        char *id = NULL, *head = NULL;
        uint32_t nb, prefix;
        ev_begin(x, "Workflow.Create", true);
        ev_tokens(t, 64, 0, 64);
        if (epd_workflow_create(c, x->acked.seq[0].path, t, 64, &id, &head) < 0)
                goto out;
        snprintf(w->id, sizeof w->id, "%s", id);
        w->n_branches = 1;
        w->alive[0] = true;
        w->ntok[0] = 64;
        free(id);
        free(head);
        ev_ack(x);
        w = &x->after.wf[0];
        ev_begin(x, "Workflow.Fork", false);
        w->alive[1] = true;
        w->ntok[1] = 64;
        w->n_branches = 2;
        if (epd_workflow_fork(c, w->id, 0, &nb, &head) < 0)
                goto out;
        free(head);
        ev_ack(x);
        ev_begin(x, "Workflow.Advance", false);
        w->steps[1]++;
        w->ntok[1] = 80;
        ev_tokens(t, 80, 5000, 32);
        if (epd_workflow_advance(c, w->id, 1, t, 80, false, &head, &prefix, NULL, NULL) < 0)
                goto out;
        ck_assert_uint_eq(prefix, 2);
        free(head);
        ev_ack(x);
        ev_begin(x, "Workflow.Fork", false);
        w->alive[2] = true;
        w->steps[2] = w->steps[1];
        w->ntok[2] = 80;
        w->n_branches = 3;
        if (epd_workflow_fork(c, w->id, 1, &nb, &head) < 0)
                goto out;
        free(head);
        ev_ack(x);
        ev_begin(x, "Workflow.Merge", false);
        w->ntok[0] = w->ntok[2];
        w->steps[0] = MAX(w->steps[0], w->steps[2]) + 1;
        w->alive[2] = false;
        if (epd_workflow_merge(c, w->id, 2, 0) < 0)
                goto out;
        ev_ack(x);
        ev_begin(x, "Workflow.Drop", false);
        w->alive[1] = false;
        if (epd_workflow_drop(c, w->id, 1) < 0)
                goto out;
        ev_ack(x);
        w = &x->after.wf[1];
        ev_begin(x, "Workflow.Create", true);
        ev_tokens(t, 48, 0, 48);
        if (epd_workflow_create(c, x->acked.seq[1].path, t, 48, &id, &head) < 0)
                goto out;
        snprintf(w->id, sizeof w->id, "%s", id);
        w->n_branches = 1;
        w->alive[0] = true;
        w->ntok[0] = 48;
        free(id);
        free(head);
        ev_ack(x);
        w = &x->after.wf[1];
        ev_begin(x, "Workflow.Advance", false);
        w->steps[0]++;
        w->ntok[0] = 96;
        ev_tokens(t, 96, 9000, 40);
        if (epd_workflow_advance(c, w->id, 0, t, 96, true, &head, &prefix, NULL, NULL) < 0)
                goto out;
        free(head);
        ev_ack(x);
        ev_begin(x, "Workflow.Release", false);
        x->after.wf[0] = (EvWf){};
        if (epd_workflow_release(c, x->acked.wf[0].id) < 0)
                goto out;
        ev_ack(x);
        ev_begin(x, "Release", false);
        x->after.seq[1] = (EvSeq){};
        if (epd_sequence_release(c, x->acked.seq[1].path) < 0)
                goto out;
        ev_ack(x);
out:
        free(src);
        free(dst);
        free(decode);
}

typedef struct EvNames {
        char (*path)[128];
        size_t n, cap;
} EvNames;

static void ev_names_add(EvNames *s, const char *path) {
        if (s->n == s->cap) {
                s->cap = MAX(s->cap * 2, (size_t)16);
                s->path = realloc(s->path, s->cap * sizeof *s->path);
                ck_assert_ptr_nonnull(s->path);
        }
        snprintf(s->path[s->n++], sizeof s->path[0], "%s", path);
}

static bool ev_names_has(const EvNames *s, const char *path) {
        for (size_t i = 0; i < s->n; i++)
                if (strcmp(s->path[i], path) == 0)
                        return true;
        return false;
}

/* Every sequence of the daemon: path and owner worker ("/" for none). */
static size_t ev_sequences(EvNames *paths, EvNames *owners) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        int r = sd_bus_get_property(bus, NULL, "/org/epd1/pages", "org.epd1.Pages", "Sequences", &e, &reply,
                                    "a(oosuut)");
        ck_assert_msg(r >= 0, "Sequences: %s", e.message);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "(oosuut)"), 0);
        const char *path, *owner, *arena;
        uint32_t n, shared;
        uint64_t cow;
        while ((r = sd_bus_message_read(reply, "(oosuut)", &path, &owner, &arena, &n, &shared, &cow)) > 0) {
                ev_names_add(paths, path);
                ev_names_add(owners, owner);
        }
        ck_assert_int_ge(r, 0);
        sd_bus_error_free(&e);
        sd_bus_flush_close_unref(bus);
        return paths->n;
}

static bool ev_seq_matches(const EvSeq *q, const uint32_t *p, size_t n) {
        return q->path[0] && n == q->n && (!q->known || memcmp(p, q->pages, n * sizeof *p) == 0);
}

static bool ev_wf_matches(const EvWf *w, const epd_workflow_branch *br, size_t n) {
        if (!w->id[0] || n != w->n_branches)
                return false;
        for (size_t i = 0; i < n; i++)
                if (br[i].alive != w->alive[i] ||
                    (w->alive[i] && (br[i].steps != w->steps[i] || br[i].n_tokens != w->ntok[i])))
                        return false;
        return true;
}

/* After the restart: the checks above; then releases everything, and no page is held
 * but the directory's. */
static void ev_check(epd_client *c, EvRun *x, uint64_t lsn) {
        const EvModel *A = &x->acked, *B = &x->after;
        EvNames mine = {}, heads = {};
        char what[160];
        snprintf(what, sizeof what, "killed after record %" PRIu64 " (in flight: %s)", lsn, x->step ?: "nothing");

        /* Sequences: as acknowledged, or as the call in flight left them. */
        for (unsigned i = 0; i < EV_SEQS; i++) {
                const EvSeq *a = &A->seq[i], *b = &B->seq[i];
                const char *path = a->path[0] ? a->path : b->path;
                if (!path[0])
                        continue;
                int r = epd_sequence_attach(c, path, NULL);
                if (r < 0) {
                        ck_assert_msg(!a->path[0] || !b->path[0], "%s: acknowledged sequence %s is gone", what, path);
                        continue;
                }
                uint32_t *p = NULL;
                size_t n = 0;
                ck_assert_int_eq(epd_sequence_get_pages(c, path, &p, &n), 0);
                ck_assert_msg(ev_seq_matches(a, p, n) || ev_seq_matches(b, p, n),
                              "%s: sequence %s has %zu pages, neither as acknowledged (%zu) nor as the call in "
                              "flight left it (%zu)", what, path, n, a->n, b->n);
                free(p);
                ev_names_add(&mine, path);
        }

        /* The handoff: its journal entries and decode sequence. */
        JournalRow rows[8];
        size_t n_rows = read_journal(rows, ELEMENTSOF(rows));
        const JournalRow *src = journal_find(rows, n_rows, x->rid, "source");
        const JournalRow *dst = journal_find(rows, n_rows, x->rid, "destination");
        ck_assert_uint_eq(n_rows, (src != NULL) + (dst != NULL));
        EvHo seen;
        if (!src && !dst)
                seen = A->ho >= EH_COMMITTED ? EH_RELEASED : EH_NONE;
        else if (src && strcmp(src->state, "rolled-back") == 0) {
                ck_assert_str_eq(src->cause, "shutdown");
                ck_assert(src->recovered);
                if (dst)
                        ck_assert_str_eq(dst->state, "rolled-back");
                seen = EH_PREPARED;
        } else if (src) {
                ck_assert_str_eq(src->state, "committed");
                ck_assert_msg(dst && strcmp(dst->state, "committed") == 0, "%s: handoff source committed alone", what);
                seen = EH_COMMITTED;
        } else {
                ck_assert_str_eq(dst->state, "committed");
                seen = EH_SRC_RELEASED;
        }
#define HO_IS(m, s) ((m) == (s) || ((s) == EH_PREPARED && (m) == EH_ACCEPTED))
        ck_assert_msg(HO_IS(A->ho, seen) || HO_IS(B->ho, seen), "%s: handoff journal says %d, acknowledged %d, "
                      "in flight %d", what, (int)seen, (int)A->ho, (int)B->ho);
        const char *decode = A->decode[0] ? A->decode : dst && seen >= EH_COMMITTED ? dst->seq : "";
        if (seen >= EH_COMMITTED) {
                ck_assert_msg(decode[0], "%s: committed handoff without its decode sequence", what);
                ck_assert_msg(epd_sequence_attach(c, decode, NULL) == 0, "%s: decode sequence %s is gone", what, decode);
                ev_names_add(&mine, decode);
        }

        /* The feature: READY once acknowledged. */
        epd_feature *f = NULL;
        int r = epd_feature_acquire(c, EV_KEY, false, &f);
        bool hit = r == 0 && strcmp(f->result, "hit") == 0;
        if (r == 0)
                ck_assert_int_eq(epd_feature_release(c, f), 0);
        ck_assert_msg(hit == A->feature || hit == B->feature, "%s: feature %s", what, hit ? "ready" : "missing");

        /* The directory: the acknowledged entries (a Publish in flight: some of its). */
        uint64_t entries = directory_entries();
        ck_assert_msg(entries >= MIN(A->dir_entries, B->dir_entries) && entries <= MAX(A->dir_entries, B->dir_entries),
                      "%s: %" PRIu64 " directory entries, acknowledged %u", what, entries, A->dir_entries);

        /* Workflows: as acknowledged or as the call in flight left them; their live
         * branches' heads are sequences of the daemon. */
        unsigned known = 0;
        for (unsigned i = 0; i < EV_WFS; i++) {
                const EvWf *a = &A->wf[i], *b = &B->wf[i];
                const char *id = a->id[0] ? a->id : b->id;
                if (!id[0])
                        continue;
                if (epd_workflow_attach(c, id) < 0) {
                        ck_assert_msg(!a->id[0] || !b->id[0], "%s: acknowledged workflow %s is gone", what, id);
                        continue;
                }
                known++;
                epd_workflow_branch *br = NULL;
                size_t nbr = 0;
                ck_assert_int_ge(epd_workflow_get_branches(c, id, &br, &nbr), 0);
                ck_assert_msg(ev_wf_matches(a, br, nbr) || ev_wf_matches(b, br, nbr),
                              "%s: workflow %s matches neither the acknowledged state nor it plus the call in flight",
                              what, id);
                for (size_t j = 0; j < nbr; j++)
                        if (br[j].alive)
                                ev_names_add(&heads, br[j].head);
                epd_workflow_branches_free(br, nbr);
        }
        uint32_t count = 0;
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, NULL, "/org/epd1", "org.epd1.Workflow", "Count", &e, 'u', &count),
                         0);
        sd_bus_flush_close_unref(bus);
        ck_assert_msg(count == known || (x->stray_workflow && count == known + 1), "%s: %u workflows, %u known", what,
                      count, known);

        /* Nothing without an owner: every sequence is one the worker attached, or the
         * head of a live branch; at most the one a call in flight made and never named
         * (for a workflow's Create, only if the workflow it heads is there). */
        EvNames all = {}, owners = {};
        size_t n_all = ev_sequences(&all, &owners), strays = 0;
        for (size_t i = 0; i < heads.n; i++)
                ck_assert_msg(ev_names_has(&all, heads.path[i]), "%s: branch head %s is not a sequence", what,
                              heads.path[i]);
        for (size_t i = 0; i < n_all; i++) {
                if (ev_names_has(&heads, all.path[i]))
                        continue;
                if (strcmp(owners.path[i], "/") != 0) {
                        ck_assert_msg(ev_names_has(&mine, all.path[i]), "%s: sequence %s owned by %s", what,
                                      all.path[i], owners.path[i]);
                        continue;
                }
                fprintf(stderr, "%s: sequence %s has no owner and no branch heads on it\n", what, all.path[i]);
                strays++;
                /* Taken, to be released with the rest; but the head of the workflow that a
                 * Create in flight made (nobody can name it) is that workflow's: Attach
                 * refuses it (Busy), and it goes with the workflow at the grace's end. */
                int ra = epd_sequence_attach(c, all.path[i], NULL);
                if (ra == -EBUSY && x->stray_workflow && count > known)
                        continue;
                ck_assert_int_eq(ra, 0);
                ev_names_add(&mine, all.path[i]);
        }
        size_t strays_ok = x->stray_workflow ? count - known : x->stray_ok ? 1 : 0;
        ck_assert_msg(strays <= strays_ok, "%s: %zu sequences without an owner or a branch", what, strays);

        /* Let go of everything: no page stays held (but the directory's cached ones). */
        for (unsigned i = 0; i < EV_WFS; i++) {
                const char *id = A->wf[i].id[0] ? A->wf[i].id : B->wf[i].id;
                if (id[0])
                        (void)epd_workflow_release(c, id);
        }
        for (size_t i = 0; i < mine.n; i++)
                ck_assert_int_eq(epd_sequence_release(c, mine.path[i]), 0);
        uint64_t pc[4];
        pool_counts("host0", pc);
        /* (A workflow whose Create was in flight holds its head: nobody can name it.) */
        if (count == known)
                ck_assert_msg(pc[1] == 0 && pc[3] == 0 && pc[2] == entries,
                              "%s: host0 keeps %" PRIu64 " live, %" PRIu64 " cached (%" PRIu64 " entries), %" PRIu64
                              " leased pages after everything was released", what, pc[1], pc[2], entries, pc[3]);
        pool_counts("host1", pc);
        ck_assert_msg(pc[1] == 0 && pc[2] == 0 && pc[3] == 0, "%s: host1 keeps pages", what);
        free(mine.path);
        free(heads.path);
        free(all.path);
        free(owners.path);
}

/* The last LSN in the log of the state directory (read offline); with types, their
 * record types are printed. */
static uint64_t ev_last_lsn(bool types) {
        char path[400];
        snprintf(path, sizeof path, "%s/state/wal/wal.log", h.dir);
        FILE *f = fopen(path, "re");
        ck_assert_ptr_nonnull(f);
        uint8_t hdr[40], rec[24];
        ck_assert_uint_eq(fread(hdr, 1, sizeof hdr, f), sizeof hdr);
        uint64_t last = 0;
        memcpy(&last, hdr + 16, 8); /* the base LSN */
        while (fread(rec, 1, sizeof rec, f) == sizeof rec) {
                uint32_t len;
                uint64_t lsn;
                memcpy(&len, rec, 4);
                memcpy(&lsn, rec + 8, 8);
                if (lsn == 0)
                        break; /* the zeros the log writes ahead */
                last = lsn;
                if (types)
                        printf(" %" PRIu64 ":%02x%02x", last, rec[17], rec[16]);
                ck_assert_int_eq(fseek(f, (long)((len + 7) & ~7u), SEEK_CUR), 0);
        }
        fclose(f);
        return last;
}

static void ev_fresh_state(void) {
        char cmd[400];
        for (size_t i = 0; i < store_n; i++)
                close(store_fds[i]);
        store_n = 0;
        snprintf(cmd, sizeof cmd, "rm -rf '%s/state'", h.dir);
        ck_assert_int_eq(system(cmd), 0);
}

START_TEST(test_crash_every_record) {
        if (!getenv("FAULT_WAL")) {
                fprintf(stderr, "FAULT_WAL is not set (run through meson test): skipped.\n");
                exit(77);
        }
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\n"
                                          "[Arena:host0]\nSize=16M\n[Arena:host1]\nSize=16M\n"
                                          "[Arena:feat0]\nUsage=feature\nSize=16M\nPageSize=64K\n"),
                         0);
        snprintf(notify_path, sizeof notify_path, "%s/notify", h.dir);
        notify_fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        ck_assert_int_ge(notify_fd, 0);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        strcpy(sa.sun_path, notify_path);
        ck_assert_int_eq(bind(notify_fd, (struct sockaddr *)&sa, sizeof sa), 0);

        /* The workload once, whole: how many records it makes. */
        uint8_t *host0, *feat0;
        EvRun x = {};
        snprintf(x.rid, sizeof x.rid, "%032x", 0xe7e4);
        ev_fresh_state();
        start_epdd(true);
        epd_client *c = kv_worker(&host0, &feat0);
        ev_workload(c, &x, host0);
        ck_assert_msg(!x.step, "the workload failed at %s without a fault", x.step);
        usleep(20000); /* records nobody waits for are written within 5 ms */
        kill9_epdd();
        epd_disconnect(c);
        printf("records (LSN:type):");
        uint64_t records = ev_last_lsn(true), checked = 0;
        printf("\n");
        ck_assert_uint_ge(records, 25);
        printf("crash after every record: the workload makes %" PRIu64 " records, %u transitions\n", records,
               x.n_acked);

        for (uint64_t lsn = 1; lsn <= records; lsn++) {
                ev_fresh_state();
                x = (EvRun){};
                snprintf(x.rid, sizeof x.rid, "%032" PRIx64, lsn);
                fault_lsn = lsn;
                start_epdd(true);
                fault_lsn = 0;
                c = kv_worker(&host0, &feat0);
                ev_workload(c, &x, host0);
                int status;
                ck_assert_int_eq(waitpid(h.epdd_pid, &status, 0), h.epdd_pid);
                ck_assert_msg(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL,
                              "epdd was to be killed after record %" PRIu64 " (status %d)", lsn, status);
                h.epdd_pid = 0;
                pump_notify();
                epd_disconnect(c);
                /* The log ends exactly there. */
                ck_assert_uint_eq(ev_last_lsn(false), lsn);

                start_epdd(true);
                c = kv_worker(&host0, &feat0);
                ev_check(c, &x, lsn);
                printf("record %" PRIu64 ": %u transitions acknowledged, in flight: %s\n", lsn, x.n_acked,
                       x.step ?: "nothing");
                checked += x.n_acked;
                epd_disconnect(c);
                ck_assert_int_eq(harness_stop_epdd(&h), 0);
        }
        printf("crash after every record: %" PRIu64 " kill -9 restarts, %" PRIu64 " acknowledged transitions checked\n",
               records, checked);
        ev_fresh_state();
        close(notify_fd);
        harness_done(&h);
}
END_TEST

/* An idle directory page evicted by a copy-on-write must not be overwritten by the copy
 * before the eviction's DEL is durable: if that DEL never becomes durable (a failed
 * write; a kill -9 in the window), the restart restores the entry on the page, which
 * would hold another block's bytes. The setup: H published on a page that goes idle
 * (cached), a sequence and its clone sharing another page, every free page taken: the
 * clone's PrepareWrite evicts H for its copy. Returns the last LSN before it. */
static uint64_t cow_evict_setup(epd_client *c, uint8_t *host0, char **ret_s3) {
        const uint64_t H = 0x1234;
        char *s1 = NULL, *s2 = NULL, *s3 = NULL, *s4 = NULL;
        uint32_t *p = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &s1, &p, &n), 0);
        write_page(c, host0, p[0], 1);
        free(p);
        ck_assert_int_eq(epd_sequence_publish(c, s1, 0, &H, 1), 1);
        ck_assert_int_eq(epd_sequence_release(c, s1), 0);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &s2, &p, &n), 0);
        write_page(c, host0, p[0], 2);
        free(p);
        ck_assert_int_eq(epd_sequence_clone(c, s2, &s3), 0);
        uint64_t pc[4];
        pool_counts("host0", pc);
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)pc[0], &s4, NULL, NULL), 0);
        usleep(20000);
        free(s1); free(s2); free(s4);
        *ret_s3 = s3;
        return ev_last_lsn(false);
}

START_TEST(test_cow_into_evicted_entry) {
        const uint64_t H = 0x1234;
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Wal]\nSync=batch\n[Arena:host0]\nSize=2M\nUsage=kv\n[Arena:feat0]\nSize=16M\nUsage=feature\nPageSize=64K\n");
        open_notify();
        /* A dry run: the LSN the eviction's DEL gets. */
        start_epdd(true);
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        char *s3 = NULL;
        uint64_t L = cow_evict_setup(c, host0, &s3);
        uint32_t w = 0;
        ck_assert_int_eq(epd_sequence_prepare_write(c, s3, 0, 1, &w), 1);
        free(s3);
        kill9_epdd();
        epd_disconnect(c);
        ev_fresh_state();
        /* Again, with the disk full from the eviction's DEL on: it never becomes
         * durable, and the copy must not have gone into H's page. */

        fault_enospc_lsn = L + 1;
        start_epdd(true);
        fault_enospc_lsn = 0;
        c = kv_worker(&host0, &feat0);
        ck_assert_uint_eq(cow_evict_setup(c, host0, &s3), L);
        (void)epd_sequence_prepare_write(c, s3, 0, 1, &w); /* refused: its journal failed */
        free(s3);
        kill9_epdd();
        epd_disconnect(c);
        start_epdd(true);
        c = kv_worker(&host0, &feat0);
        char *path = NULL;
        size_t blocks = 0, n = 0;
        uint32_t *pages = NULL;
        ck_assert_int_eq(epd_sequence_create_from_prefix(c, "host0", &H, 1, &path, &blocks, &pages, &n), 0);
        if (blocks == 1) {
                size_t diff1 = page_diff(c, host0, pages[0], 1), diff2 = page_diff(c, host0, pages[0], 2);
                ck_assert_msg(diff1 == 0, "the directory entry came back on page %u holding another block (%zu bytes "
                              "differ from it, %zu from the copied one)", pages[0], diff1, diff2);
        }
        free(path);
        free(pages);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST


/* After a kill -9: epdd again, with the sequence at `path` back on n pages whose bytes
 * are pattern tags[i] each; then stopped. */
static void sequence_back(const char *path, const unsigned *tags, size_t n, const char *what) {
        uint8_t *host0, *feat0;
        start_epdd(true);
        epd_client *c = kv_worker(&host0, &feat0);
        ck_assert_int_eq(epd_sequence_attach(c, id_of(path), NULL), 0);
        uint32_t *pages = NULL;
        size_t got = 0;
        ck_assert_int_eq(epd_sequence_get_pages(c, path, &pages, &got), 0);
        ck_assert_uint_eq(got, n);
        for (size_t i = 0; i < n; i++) {
                size_t diff = page_diff(c, host0, pages[i], tags[i]);
                ck_assert_msg(diff == 0, "%s: page %zu of the sequence came back on page %u, %zu of whose bytes are "
                              "not its own", what, i, pages[i], diff);
        }
        free(pages);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
}

/* The daemon writes into pages freed by a sequence only once the record that freed them
 * (a Release's DEL, a Truncate's PUT) is durable: a kill -9 before it brings the
 * sequence back on its old pages, which would hold the copy's bytes. Three ways in: a
 * Release then a clone's PrepareWrite (the copy-on-write takes the freed page), a
 * Truncate then the same, a Release then a local handoff into that arena (its copy).
 * The setup: s1 on host0 (pattern 1), s2 and its clone s3 sharing a page (pattern 2),
 * s5 on host1, every other page of host0 taken. Returns the last LSN before the freeing
 * record. */
enum { FREED_RELEASE_COW, FREED_TRUNCATE_COW, FREED_RELEASE_HANDOFF, _FREED_MAX };

static uint64_t freed_setup(epd_client *c, uint8_t *host0, char **ret_s1, char **ret_s3, char **ret_s5) {
        char *s1 = NULL, *s2 = NULL, *s4 = NULL;
        uint32_t *p = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &s1, &p, &n), 0);
        write_page(c, host0, p[0], 1);
        free(p);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &s2, &p, &n), 0);
        write_page(c, host0, p[0], 2);
        free(p);
        ck_assert_int_eq(epd_sequence_clone(c, s2, ret_s3), 0);
        ck_assert_int_eq(epd_sequence_create(c, "host1", 1, ret_s5, NULL, NULL), 0);
        uint64_t pc[4];
        pool_counts("host0", pc);
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)pc[0], &s4, NULL, NULL), 0);
        usleep(20000);
        free(s2);
        free(s4);
        *ret_s1 = s1;
        return ev_last_lsn(false);
}

/* The freeing record, then the daemon's write into the freed page. */
static uint64_t handoff_counter(const char *name) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        uint64_t found = UINT64_MAX, v;
        const char *k;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property(bus, NULL, "/org/epd1/handoffs", "org.epd1.Handoffs", "Counters", &e,
                                             &reply, "a{st}"),
                         0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "{st}"), 0);
        while (sd_bus_message_read(reply, "{st}", &k, &v) > 0)
                if (strcmp(k, name) == 0)
                        found = v;
        sd_bus_flush_close_unref(bus);
        ck_assert_msg(found != UINT64_MAX, "no counter %s", name);
        return found;
}

static void freed_then_written(epd_client *c, unsigned variant, const char *s1, const char *s3, const char *s5) {
        static const uint32_t groups[] = { 1, 1, 1, 1 };
        uint32_t w = 0;
        if (variant == FREED_TRUNCATE_COW)
                (void)epd_sequence_truncate(c, s1, 0);
        else if (variant == FREED_RELEASE_COW)
                (void)epd_sequence_release(c, s1);
        else
                /* Not waited for: the Prepare comes while the DEL is being written, before
                 * the journal is known to refuse (Prepare journals before it copies). */
                ck_assert_int_eq(epd_sequence_release_nowait(c, s1), 0);
        if (variant == FREED_RELEASE_HANDOFF) {
                epd_handoff_options o = { .arena = "host0", .ready = 4 };
                char *path = NULL;
                uint64_t token = 0;
                (void)epd_handoff_prepare(c, "0123456789abcdef0123456789abcdef", NULL, s5, groups, 4, &o, &path,
                                          &token);
                free(path);
                /* The DEL's write took its time to fail (fault_enospc_delay_ms): the
                 * Prepare was journaled meanwhile, so what kept its copy out of the
                 * freed page is the wait for the DEL, not a journal already refusing. */
                ck_assert_uint_eq(handoff_counter("journal-waits"), 1);
        } else
                (void)epd_sequence_prepare_write(c, s3, 0, 1, &w);
}

START_TEST(test_write_into_freed_pages) {
        static const char *const what[] = { "Release then PrepareWrite", "Truncate then PrepareWrite",
                                            "Release then a local handoff" };
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Wal]\nSync=batch\n[Arena:host0]\nSize=2M\nUsage=kv\n[Arena:host1]\nSize=2M\nUsage=kv\n"
                     "[Arena:feat0]\nSize=16M\nUsage=feature\nPageSize=64K\n");
        open_notify();
        for (unsigned v = 0; v < _FREED_MAX; v++) {
                ev_fresh_state();
                /* A dry run: the LSN the freeing record gets. */
                start_epdd(true);
                uint8_t *host0, *feat0;
                epd_client *c = kv_worker(&host0, &feat0);
                char *s1 = NULL, *s3 = NULL, *s5 = NULL;
                uint64_t L = freed_setup(c, host0, &s1, &s3, &s5);
                free(s1);
                free(s3);
                free(s5);
                kill9_epdd();
                epd_disconnect(c);
                ev_fresh_state();
                /* Again, the disk full from that record on: it never becomes durable. */
                fault_enospc_lsn = L + 1;
                fault_enospc_delay_ms = v == FREED_RELEASE_HANDOFF ? 300 : 0;
                start_epdd(true);
                fault_enospc_lsn = 0;
                fault_enospc_delay_ms = 0;
                c = kv_worker(&host0, &feat0);
                ck_assert_uint_eq(freed_setup(c, host0, &s1, &s3, &s5), L);
                freed_then_written(c, v, s1, s3, s5);
                free(s3);
                free(s5);
                kill9_epdd();
                epd_disconnect(c);
                /* s1 comes back, whole, on its page with its own bytes. */
                static const unsigned tag1[] = { 1 };
                sequence_back(s1, tag1, 1, what[v]);
                free(s1);
        }
        close_notify();
}
END_TEST


static void arm_malloc_fault(void) {
        int fd = open(fault_malloc_arm, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        close(fd);
}

/* A Truncate whose PUT cannot even be built (its buffer's allocation fails): the table
 * changed in memory, the log still gives the freed page to the sequence. That is a
 * refused record: nothing is journaled or acknowledged after it, so the freed page is
 * never counted settled and a copy-on-write cannot take it (it was the only free page).
 * Killed and restarted, the sequence comes back whole on its own bytes. */
START_TEST(test_unbuildable_record_is_refused) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Wal]\nSync=batch\n[Arena:host0]\nSize=2M\nUsage=kv\n[Arena:feat0]\nSize=16M\nUsage=feature\n"
                     "PageSize=64K\n");
        open_notify();
        ev_fresh_state();
        enum { S1_PAGES = 36 };
        snprintf(fault_malloc_arm, sizeof fault_malloc_arm, "%s/arm-malloc", h.dir);
        /* The PUT of s1 truncated by one page: 188 bytes, asked for by nothing else then. */
        fault_malloc_size = SEQUENCE_REC_HEADER_SIZE + 4 * (S1_PAGES - 1);
        start_epdd(true);
        fault_malloc_size = 0;
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        /* A new sequence whose record cannot be built (35 pages: the same size) is
         * refused alone: it took nothing from anyone, so the journal goes on. */
        char *none = NULL;
        arm_malloc_fault();
        ck_assert_int_lt(epd_sequence_create(c, "host0", S1_PAGES - 1, &none, NULL, NULL), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        ck_assert_int_ne(access(fault_malloc_arm, F_OK), 0); /* it fired */
        ck_assert_int_eq(epd_sequence_create(c, "host0", S1_PAGES - 1, &none, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_release(c, none), 0);
        free(none);
        char *s1 = NULL, *s2 = NULL, *s3 = NULL, *fill = NULL;
        uint32_t *p = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", S1_PAGES, &s1, &p, &n), 0);
        for (size_t i = 0; i < n; i++)
                write_page(c, host0, p[i], 1);
        free(p);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &s2, &p, &n), 0);
        write_page(c, host0, p[0], 2);
        free(p);
        ck_assert_int_eq(epd_sequence_clone(c, s2, &s3), 0);
        uint64_t pc[4];
        pool_counts("host0", pc);
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)pc[0], &fill, NULL, NULL), 0);

        arm_malloc_fault();
        int r = epd_sequence_truncate(c, s1, S1_PAGES - 1);
        ck_assert_int_lt(r, 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        ck_assert_msg(strstr(epd_last_error_message(c), "cannot journal"), "%s", epd_last_error_message(c));
        ck_assert_int_ne(access(fault_malloc_arm, F_OK), 0);
        /* The only free page is s1's last: the copy-on-write of s3's shared page would
         * take it. The journal refuses now, so it is refused, and nothing is written. */
        uint32_t w = 0;
        ck_assert_int_lt(epd_sequence_prepare_write(c, s3, 0, 1, &w), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        /* Nor a new sequence (a clone needs no page): a named refusal, not an errno. */
        char *s4 = NULL;
        ck_assert_int_lt(epd_sequence_clone(c, s2, &s4), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
        ck_assert_ptr_null(s4);
        kill9_epdd();
        epd_disconnect(c);

        unsigned tags[S1_PAGES];
        for (size_t i = 0; i < S1_PAGES; i++)
                tags[i] = 1;
        sequence_back(s1, tags, S1_PAGES, "truncated without its record");
        free(s1);
        free(s2);
        free(s3);
        free(fill);
        close_notify();
}
END_TEST

/* Block-directory entries whose arena's page pool is first made when they are restored
 * (the snapshot holds their PUTs and no sequence of that arena): a start that has no
 * memory for the pool fails, and the next one brings them back. It journaled their
 * removal for good instead (the prefix cache of the arena gone after a passing
 * allocation failure). host0 is 2112 KiB: 66 pages of 32 KiB, a pool's table of 66 x 32
 * bytes that nothing else asks for; the sequences that fill the log live in host1. */
START_TEST(test_directory_pool_without_memory_fails_the_start) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Wal]\nSync=batch\nCompactSize=4K\n[Arena:host0]\nSize=2112K\nUsage=kv\n[Arena:host1]\nSize=2M\n"
                     "Usage=kv\n");
        open_notify();
        start_epdd(true);
        uint8_t *host0;
        epd_client *c = kv_worker(&host0, NULL);
        char *s = NULL;
        uint32_t *p = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &s, &p, &n), 0);
        ck_assert_uint_eq(n, 2);
        write_page(c, host0, p[0], 7);
        write_page(c, host0, p[1], 8);
        free(p);
        const uint64_t hs[2] = { 0x5eed0001, 0x5eed0002 };
        ck_assert_int_eq(epd_sequence_publish(c, s, 0, hs, 2), 2);
        ck_assert_int_eq(epd_sequence_release(c, s), 0);
        free(s);
        /* Records in host1 until the log was compacted with no sequence of host0 left. */
        unsigned before = log_count("WAL compacted");
        for (int i = 0; i < 4000 && log_count("WAL compacted") < before + 2; i++) {
                char *t = NULL;
                ck_assert_int_eq(epd_sequence_create(c, "host1", 1, &t, NULL, NULL), 0);
                ck_assert_int_eq(epd_sequence_release(c, t), 0);
                free(t);
        }
        ck_assert_uint_ge(log_count("WAL compacted"), before + 2);
        ck_assert_int_eq(epd_prefix_match(c, "host0", hs, 2), 2);
        kill9_epdd();
        epd_disconnect(c);

        snprintf(fault_malloc_arm, sizeof fault_malloc_arm, "%s/arm-malloc", h.dir);
        arm_malloc_fault();
        fault_malloc_size = 66 * 32;
        int r = run_epdd_to_exit(true);
        fault_malloc_size = 0;
        ck_assert_int_ne(access(fault_malloc_arm, F_OK), 0); /* it fired */
        ck_assert_msg(r != 0, "the start went on without memory for host0's pool");
        ck_assert_uint_eq(log_count("no memory to restore its entries' page pools"), 1);

        start_epdd(true);
        c = kv_worker(&host0, NULL);
        ck_assert_int_eq(epd_prefix_match(c, "host0", hs, 2), 2);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

/* A worker of the other KV layout (8 layers: pages of 64 KiB) with host0 mapped. */
static epd_client *wide_worker(uint8_t **ret_host0) {
        epd_kv_layout wide = kv;
        wide.layers = 8;
        return worker_of(&wide, ret_host0, NULL);
}

/* A new sequence of n wide pages in host0, each filled with the pattern of round + its
 * index; its path. */
static char *wide_sequence_write(epd_client *c, uint8_t *host0, uint32_t n_pages, unsigned round) {
        char *path = NULL;
        uint32_t *pages = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", n_pages, &path, &pages, &n), 0);
        const epd_arena *a = epd_arena_get(c, (size_t)epd_arena_find(c, "host0"));
        for (size_t i = 0; i < n; i++)
                for (size_t k = 0; k < 2 * KV_PAGE; k++)
                        host0[epd_page_offset(a, 2 * KV_PAGE, pages[i]) + k] = pattern(k, round + (unsigned)i);
        free(pages);
        return path;
}

/* Attaches the sequence at path and checks its n pages hold what wide_sequence_write()
 * wrote. */
static void wide_sequence_check(epd_client *c, uint8_t *host0, const char *path, size_t n_pages, unsigned round) {
        uint32_t *pages = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_attach(c, id_of(path), NULL), 0);
        ck_assert_int_eq(epd_sequence_get_pages(c, path, &pages, &n), 0);
        ck_assert_uint_eq(n, n_pages);
        const epd_arena *a = epd_arena_get(c, (size_t)epd_arena_find(c, "host0"));
        for (size_t i = 0; i < n; i++) {
                size_t diff = 0;
                for (size_t k = 0; k < 2 * KV_PAGE; k++)
                        diff += host0[epd_page_offset(a, 2 * KV_PAGE, pages[i]) + k] != pattern(k, round + (unsigned)i);
                ck_assert_msg(diff == 0, "page %zu of %s: %zu bytes not its own", i, path, diff);
        }
        free(pages);
}

/* A log holding two page sizes of one arena, one after the other: run A's sequence of
 * 32 KiB pages; run B, its arena memory new (no fd store), dropped it (journaled) and
 * its pool, and a worker of 64 KiB pages made S2 there; run C adopts run B's memory and
 * replays the whole log. S2 was acknowledged: it comes back with its bytes, and workers
 * of 64 KiB pages are welcome (the replay skipped S2's record as of another page size,
 * and kept run A's size for good). */
START_TEST(test_page_size_set_again_after_memory_lost) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Wal]\nSync=batch\n[Arena:host0]\nSize=2M\nUsage=kv\n[Arena:feat0]\nSize=16M\nUsage=feature\n"
                     "PageSize=64K\n");
        open_notify();
        ev_fresh_state();
        uint8_t *host0, *feat0;
        start_epdd(false);
        epd_client *c = kv_worker(&host0, &feat0);
        char *s1 = NULL, *s2 = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &s1, NULL, NULL), 0);
        kill9_epdd();
        epd_disconnect(c);

        start_epdd(false); /* run A's memory is gone */
        c = wide_worker(&host0);
        s2 = wide_sequence_write(c, host0, 3, 5);
        kill9_epdd();
        epd_disconnect(c);

        start_epdd(true); /* run B's memory, from its store */
        c = wide_worker(&host0);
        wide_sequence_check(c, host0, s2, 3, 5);
        ck_assert_int_eq(epd_sequence_attach(c, id_of(s1), NULL), -ENOENT); /* dropped in run B */
        ck_assert_uint_ge(log_count("were all released; its later records use pages of 65536 bytes"), 1);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        free(s1);
        free(s2);
        close_notify();
}
END_TEST

/* An adopted arena whose page size was changed (PageSize=) between runs: the journal's
 * sequences of the old size do not apply, and their drop is journaled (a DEL each), so
 * that a later start with the old setting does not bring them back over pages the
 * sequences of the new size wrote meanwhile. */
START_TEST(test_changed_page_size_journals_drop) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        const char *plain = "[Wal]\nSync=batch\n[Arena:host0]\nSize=2M\nUsage=kv\n";
        write_arenas(plain);
        open_notify();
        ev_fresh_state();
        uint8_t *host0;
        start_epdd(false);
        epd_client *c = worker_of(&kv, &host0, NULL);
        char *s1 = NULL, *s2 = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 6, &s1, NULL, NULL), 0);
        kill9_epdd();
        epd_disconnect(c);

        write_arenas("[Wal]\nSync=batch\n[Arena:host0]\nSize=2M\nUsage=kv\nPageSize=64K\n");
        start_epdd(true); /* the same memory, another page size */
        ck_assert_uint_ge(log_count("does not apply"), 1);
        c = wide_worker(&host0);
        ck_assert_int_eq(epd_sequence_attach(c, id_of(s1), NULL), -ENOENT);
        s2 = wide_sequence_write(c, host0, 3, 9);
        kill9_epdd();
        epd_disconnect(c);

        write_arenas(plain); /* the old setting again */
        start_epdd(true);
        c = wide_worker(&host0);
        ck_assert_int_eq(epd_sequence_attach(c, id_of(s1), NULL), -ENOENT); /* not back */
        wide_sequence_check(c, host0, s2, 3, 9);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        free(s1);
        free(s2);
        close_notify();
}
END_TEST

/* The handoff journal's entries restored at start that nobody takes up are released at
 * the end of the same grace as the sequences' ([Limits] AttachGrace=, 1 s here), not of
 * a built-in 300 s. */
START_TEST(test_handoff_journal_grace_is_attach_grace) {
        ck_assert_int_eq(harness_init(&h, "[Limits]\nAttachGrace=1s\n[Wal]\nSync=batch\n"
                                          "[Arena:host0]\nSize=8M\n[Arena:host1]\nSize=8M\n"
                                          "[Arena:feat0]\nUsage=feature\nSize=16M\nPageSize=64K\n"),
                         0);
        open_notify();
        start_epdd(true);
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        static const uint32_t groups[2] = { 2, 2 };
        char *seq = NULL, *src = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &seq, NULL, NULL), 0);
        epd_handoff_options o = { .arena = "host1" };
        ck_assert_int_eq(epd_handoff_prepare(c, "00000000000000000000000000abcdef", NULL, seq, groups, 2, &o, &src,
                                             NULL),
                         0);
        JournalRow rows[8];
        ck_assert_uint_ge(read_journal(rows, ELEMENTSOF(rows)), 1); /* its source side (and destination) */
        kill9_epdd();
        epd_disconnect(c);

        start_epdd(true);
        ck_assert_uint_ge(read_journal(rows, ELEMENTSOF(rows)), 1); /* restored, rolled back */
        size_t n = 1;
        for (int i = 0; i < 300 && (n = read_journal(rows, ELEMENTSOF(rows))) > 0; i++)
                usleep(10000);
        ck_assert_uint_eq(n, 0);
        ck_assert_uint_ge(log_count("journal entries of before the restart released"), 1);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        free(seq);
        free(src);
        close_notify();
}
END_TEST

/* A handoff journaled by a run whose wall clock was ahead (an hour here), retried after a
 * restart with the clock right: the retry's token is above the recovered entry's, so
 * the Prepare is taken. Before, the new run's tokens started from its own clock, below
 * the entry's: the retry was refused as stale until the journal's grace ended. */
START_TEST(test_retry_after_clock_step_back) {
        ck_assert_int_eq(harness_init(&h, "[Wal]\nSync=batch\n[Arena:host0]\nSize=8M\n[Arena:host1]\nSize=8M\n"
                                          "[Arena:feat0]\nUsage=feature\nSize=16M\nPageSize=64K\n"),
                         0);
        open_notify();
        fault_clock_shift_sec = 3600;
        start_epdd(true);
        fault_clock_shift_sec = 0;
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        static const uint32_t groups[2] = { 2, 2 };
        char *seq = NULL, *src = NULL;
        uint64_t ahead = 0, token = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &seq, NULL, NULL), 0);
        epd_handoff_options o = { .arena = "host1" };
        ck_assert_int_eq(epd_handoff_prepare(c, "000000000000000000000000001234ab", NULL, seq, groups, 2, &o, &src,
                                             &ahead),
                         0);
        free(src);
        kill9_epdd();
        epd_disconnect(c);

        start_epdd(true);
        c = kv_worker(&host0, &feat0);
        free(seq);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &seq, NULL, NULL), 0);
        int r = epd_handoff_prepare(c, "000000000000000000000000001234ab", NULL, seq, groups, 2, &o, &src, &token);
        ck_assert_msg(r == 0, "the retry: %s: %s", epd_last_error_name(c), epd_last_error_message(c));
        ck_assert_uint_gt(token, ahead);
        ck_assert_int_eq(epd_handoff_release(c, src), 0);
        free(src);
        free(seq);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

static int apply_nothing(void *userdata, const WalRecord *r, bool from_snapshot) {
        return 0;
}

/* A PUT this build cannot read (checksummed, but not of its format: another version's,
 * say) after the PUT that made the sequence: the sequence does not come back in the
 * state the earlier record gave it (the pages the unread one freed may be another
 * sequence's by then); it is dropped as one whose record does not apply, and said so.
 * Before, the unread record was skipped and the earlier state restored. */
START_TEST(test_unreadable_put_drops_sequence) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Arena:host0]\nSize=2M\nUsage=kv\n[Arena:feat0]\nSize=16M\nUsage=feature\nPageSize=64K\n");
        open_notify();
        ev_fresh_state();
        start_epdd(true);
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        char *seq = NULL, *other = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &seq, NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &other, NULL, NULL), 0);
        kill9_epdd();
        epd_disconnect(c);

        char dir[400];
        snprintf(dir, sizeof dir, "%s/state/wal", h.dir);
        Wal *w = NULL;
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_ALWAYS, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply_nothing, NULL), 0);
        uint8_t put[SEQUENCE_REC_HEADER_SIZE + 4] = {};
        EpdId id;
        ck_assert_int_eq(epd_id_from_string(id_of(seq), &id), 0);
        memcpy(put, id.bytes, sizeof id.bytes);
        put[24] = 0xff; /* a page size, and a length that no page table fits */
        ck_assert_int_eq(wal_append(w, WAL_RECORD_SEQUENCE + SEQUENCE_REC_PUT, put, sizeof put, NULL), 0);
        wal_free(w);

        start_epdd(true);
        c = kv_worker(&host0, &feat0);
        ck_assert_int_lt(epd_sequence_attach(c, id_of(seq), NULL), 0);
        ck_assert_int_eq(epd_sequence_attach(c, id_of(other), NULL), 0); /* the rest is there */
        ck_assert_uint_ge(log_count("did not apply to this configuration and were dropped"), 1);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        free(seq);
        free(other);
        close_notify();
}
END_TEST

static uint32_t workflow_count_now(void) {
        uint32_t count = 0;
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, NULL, "/org/epd1", "org.epd1.Workflow", "Count", &e, 'u', &count),
                         0);
        sd_bus_flush_close_unref(bus);
        return count;
}

/* A workflow restored at start that no client attaches goes when the attach grace ends
 * ([Limits] AttachGrace=, 1 s here), its heads' pages with it: before, it stayed for
 * good (its branches kept their heads past the sequences' grace), and so did its slot
 * of the daemon's workflow limit. One attached in time stays. */
START_TEST(test_unattached_workflow_released_at_grace) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Limits]\nAttachGrace=1s\n[Arena:host0]\nSize=2M\nUsage=kv\n[Arena:feat0]\nSize=16M\n"
                     "Usage=feature\nPageSize=64K\n");
        open_notify();
        ev_fresh_state();
        uint8_t *host0, *feat0;
        start_epdd(true);
        epd_client *c = kv_worker(&host0, &feat0);
        uint32_t tokens[64];
        for (unsigned i = 0; i < 64; i++)
                tokens[i] = i;
        char *wf[2] = { NULL, NULL }, *head = NULL, *fork_head = NULL;
        for (int k = 0; k < 2; k++) {
                char *root = NULL;
                ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &root, NULL, NULL), 0);
                ck_assert_int_eq(epd_workflow_create(c, root, tokens, 64, &wf[k], &head), 0);
                free(head);
                uint32_t b;
                ck_assert_int_eq(epd_workflow_fork(c, wf[k], 0, &b, &head), 0);
                if (k == 0)
                        fork_head = head;
                else
                        free(head);
                ck_assert_int_eq(epd_sequence_release(c, root), 0);
                free(root);
        }
        ck_assert_uint_eq(workflow_count_now(), 2);
        kill9_epdd();
        epd_disconnect(c);

        start_epdd(true);
        c = kv_worker(&host0, &feat0);
        ck_assert_uint_eq(workflow_count_now(), 2);
        /* A branch's head is the workflow's, not to be attached on its own: the workflow
         * releases it at the grace's end (or at its next transition), under whoever
         * would have attached it, while it wrote there. */
        ck_assert_int_eq(epd_sequence_attach(c, id_of(fork_head), NULL), -EBUSY);
        ck_assert_msg(strstr(epd_last_error_message(c), "head of a workflow branch"), "%s",
                      epd_last_error_message(c));
        free(fork_head);
        ck_assert_int_eq(epd_workflow_attach(c, wf[1]), 0); /* this one is taken back */
        uint64_t pc[4];
        for (int i = 0; i < 300 && workflow_count_now() > 1; i++)
                usleep(10000);
        ck_assert_uint_eq(workflow_count_now(), 1);
        ck_assert_uint_ge(log_count("workflows restored at start were not attached in time and were released"), 1);
        pool_counts("host0", pc);
        ck_assert_uint_eq(pc[1], 4); /* live: the attached workflow's two heads, sharing 4 pages */
        ck_assert_int_eq(epd_workflow_release(c, wf[1]), 0);
        pool_counts("host0", pc);
        ck_assert_uint_eq(pc[1], 0);

        /* A workflow whose every branch was dropped holds no sequence: restored along
         * with none at all, it goes at the grace's end too (the grace is armed for
         * workflows as well as for sequences). */
        char *root = NULL, *wf2 = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &root, NULL, NULL), 0);
        ck_assert_int_eq(epd_workflow_create(c, root, tokens, 64, &wf2, &head), 0);
        free(head);
        ck_assert_int_eq(epd_workflow_drop(c, wf2, 0), 0);
        ck_assert_int_eq(epd_sequence_release(c, root), 0);
        free(root);
        ck_assert_uint_eq(workflow_count_now(), 1);
        kill9_epdd();
        epd_disconnect(c);
        start_epdd(true);
        c = kv_worker(&host0, &feat0);
        ck_assert_uint_eq(workflow_count_now(), 1);
        for (int i = 0; i < 300 && workflow_count_now() > 0; i++)
                usleep(10000);
        ck_assert_uint_eq(workflow_count_now(), 0);
        free(wf2);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        free(wf[0]);
        free(wf[1]);
        close_notify();
}
END_TEST

/* A Fork whose copy of the parent's tokens cannot be allocated: refused, and nothing of
 * it journaled. The client's retry gets the same branch number and is acknowledged; a
 * restart brings that branch back on the retry's head. Before, the copy was made after
 * the record was journaled: the refused Fork's record (the branch on a clone released in
 * memory) was replayed first, and the acknowledged one was skipped as a duplicate. */
START_TEST(test_refused_fork_journals_nothing) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        /* No compaction before the kill: a snapshot from memory would hide the log's
         * content this is about. */
        write_arenas("[Wal]\nCompactSize=64M\n[Arena:host0]\nSize=2M\nUsage=kv\n[Arena:feat0]\nSize=16M\n"
                     "Usage=feature\nPageSize=64K\n");
        open_notify();
        ev_fresh_state();
        enum { N_TOKENS = 1237 }; /* the parent's tokens, 4948 bytes: asked for by nothing else then */
        snprintf(fault_malloc_arm, sizeof fault_malloc_arm, "%s/arm-malloc", h.dir);
        fault_malloc_size = 4 * N_TOKENS;
        start_epdd(true);
        fault_malloc_size = 0;
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        uint32_t *tokens = calloc(N_TOKENS, sizeof *tokens);
        ck_assert_ptr_nonnull(tokens);
        for (unsigned i = 0; i < N_TOKENS; i++)
                tokens[i] = i * 7 + 1;
        char *root = NULL, *wf = NULL, *head = NULL, *forked = NULL;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &root, NULL, NULL), 0);
        ck_assert_int_eq(epd_workflow_create(c, root, tokens, N_TOKENS, &wf, &head), 0);
        free(head);
        uint64_t pc[4];
        pool_counts("host0", pc);
        uint64_t live = pc[1];

        arm_malloc_fault();
        uint32_t b = UINT32_MAX;
        ck_assert_int_lt(epd_workflow_fork(c, wf, 0, &b, &head), 0);
        ck_assert_int_ne(access(fault_malloc_arm, F_OK), 0); /* it fired */
        ck_assert_msg(strncmp(epd_last_error_name(c), "org.epd1.Error.", 15) == 0, "%s", epd_last_error_name(c));
        pool_counts("host0", pc);
        ck_assert_uint_eq(pc[1], live); /* its clone went with it */
        ck_assert_int_eq(epd_workflow_fork(c, wf, 0, &b, &forked), 0);
        ck_assert_uint_eq(b, 1);
        epd_workflow_branch *br = NULL;
        size_t n = 0;
        ck_assert_int_ge(epd_workflow_get_branches(c, wf, &br, &n), 0);
        ck_assert_uint_eq(n, 2);
        ck_assert_str_eq(br[1].head, forked);
        ck_assert_uint_eq(br[1].n_tokens, N_TOKENS);
        epd_workflow_branches_free(br, n);
        ck_assert_int_eq(epd_sequence_release(c, root), 0);
        free(root);

        kill9_epdd();
        epd_disconnect(c);
        start_epdd(true);
        /* A worker that maps only feat0, not host0 where the workflow's heads are, may
         * not take it (its Advance would count the prefix in blocks of another arena):
         * named, and the workflow stays free for a worker that maps host0. */
        {
                char address[512];
                epd_client *d;
                harness_direct_address(&h, address, sizeof address);
                ck_assert_int_eq(epd_connect(address, &d), 0);
                const char *const feat[] = { "feat0", NULL };
                ck_assert_int_eq(epd_register(d, "decode", "m", "cpu", &kv, feat), 0);
                ck_assert_int_eq(epd_workflow_attach(d, wf), -EPERM);
                ck_assert_str_eq(epd_last_error_name(d), "org.epd1.Error.PermissionDenied");
                ck_assert_msg(strstr(epd_last_error_message(d), "did not map the sequence's arena"), "%s",
                              epd_last_error_message(d));
                epd_disconnect(d);
        }
        c = kv_worker(&host0, &feat0);
        ck_assert_int_eq(epd_workflow_attach(c, wf), 0);
        ck_assert_int_ge(epd_workflow_get_branches(c, wf, &br, &n), 0);
        ck_assert_uint_eq(n, 2);
        ck_assert_msg(br[1].alive && strcmp(br[1].head, forked) == 0, "branch 1 came back on %s, acknowledged %s",
                      br[1].head, forked);
        ck_assert_uint_eq(br[1].n_tokens, N_TOKENS);
        epd_workflow_branches_free(br, n);
        /* The heads came back with it: the worker writes on into the head it was given
         * before the restart, as before it (docs/wal.md "Ownership after a restart"). */
        uint32_t wp = UINT32_MAX;
        ck_assert_msg(epd_sequence_prepare_write(c, forked, 0, 1, &wp) >= 0, "%s: %s", epd_last_error_name(c),
                      epd_last_error_message(c));
        ck_assert_uint_ne(wp, UINT32_MAX);
        ck_assert_int_eq(epd_sequence_append(c, forked, 1, NULL, NULL), 0);
        ck_assert_uint_eq(log_count("not applicable"), 0);
        ck_assert_int_eq(epd_workflow_release(c, wf), 0);
        pool_counts("host0", pc);
        ck_assert_uint_eq(pc[1], 0);
        free(wf);
        free(forked);
        free(tokens);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

/* A worker process of before the restart, still running: registered, holding a feature
 * it reserved and writes (not journaled), then waiting to be killed. */
static pid_t start_holder(const char *key) {
        int p[2];
        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                int fd = p[1];
                close(p[0]);
                char address[512];
                epd_client *c;
                epd_feature *f = NULL;
                void *base;
                epd_feature_tensor t = { .name = "pixels", .dtype = "f32", .rank = 2, .shape = { 3, 4096 } };
                harness_direct_address(&h, address, sizeof address);
                if (epd_connect(address, &c) < 0 || epd_register(c, "colocated", "m", "cpu", &kv, NULL) < 0)
                        _exit(1);
                int i = epd_arena_find(c, "feat0");
                if (i < 0 || epd_arena_map(c, (size_t)i, &base) < 0)
                        _exit(2);
                if (epd_feature_acquire(c, key, true, &f) < 0 || epd_feature_produce(c, f, FEAT_BYTES, &t, 1, NULL) < 0)
                        _exit(3);
                memset(f->data, 0x77, FEAT_BYTES);
                uint64_t off = f->offset;
                if (write(fd, &off, sizeof off) != sizeof off)
                        _exit(4);
                for (;;)
                        pause();
        }
        harness_note_pid(&h, pid);
        close(p[1]);
        uint64_t off;
        ssize_t k = read(p[0], &off, sizeof off);
        int status = 0;
        if (k != sizeof off && waitpid(pid, &status, 0) == pid)
                ck_abort_msg("the holder failed: exit status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        close(p[0]);
        return pid;
}

static void wait_unfenced(unsigned max_ms) {
        for (unsigned ms = 0; feature_stat("BytesFenced") > 0; ms += 50) {
                ck_assert_msg(ms < max_ms, "still fenced after %u ms", ms);
                usleep(50000);
        }
}

/* Workers that outlive a restart (core/mappers.h, docs/wal.md): the restarted epdd
 * hands out no byte of the restored feature arena that was free at the restart (a
 * producer of before may still be writing there: its reservation was not journaled)
 * and evicts no restored feature (a reader of before may still read it) until every
 * worker process of before has exited or registered again, or 10 s have passed.
 * Before, the first Reserve after the restart got the region the running producer of
 * before was still writing. */
START_TEST(test_restart_fence_for_running_workers) {
        epd_feature_tensor t = { .name = "pixels", .dtype = "f32", .rank = 2, .shape = { 3, 4096 } };
        ck_assert_int_eq(harness_init(&h, ""), 0);
        open_notify();
        start_epdd(true);
        pid_t holder = start_holder("image:held");

        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        epd_feature *f = NULL;
        ck_assert_int_eq(epd_feature_acquire(c, "image:kept", true, &f), 0);
        ck_assert_int_eq(epd_feature_produce(c, f, FEAT_BYTES, &t, 1, NULL), 0);
        memset(f->data, 0x42, FEAT_BYTES);
        ck_assert_int_eq(epd_feature_publish(c, f, 1000), 0);
        ck_assert_int_eq(epd_feature_release(c, f), 0);

        uint8_t *host0b, *feat0b;
        epd_client *c2 = kv_worker(&host0b, &feat0b); /* this process: two clients with arenas */
        kill9_epdd();
        epd_disconnect(c);
        epd_disconnect(c2);
        start_epdd(true);
        ck_assert_uint_eq(log_count("worker process(es) of before the restart still run"), 1);
        /* This process registers again, once of twice: the holder still runs anyway. */
        c = kv_worker(&host0, &feat0);
        ck_assert_uint_gt(feature_stat("BytesFenced"), 0);
        ck_assert_int_eq(epd_feature_acquire(c, "image:new", true, &f), 0);
        ck_assert_str_eq(f->result, "produce");
        ck_assert_int_eq(epd_feature_produce(c, f, FEAT_BYTES, &t, 1, NULL), -ENOSPC);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.NoSpace");
        ck_assert_msg(strstr(epd_last_error_message(c), "held back"), "%s", epd_last_error_message(c));
        ck_assert_int_eq(epd_feature_release(c, f), 0);
        /* The restored feature was not evicted for it. */
        ck_assert_int_eq(epd_feature_acquire(c, "image:kept", false, &f), 0);
        ck_assert_str_eq(f->result, "hit");
        ck_assert_uint_eq(((uint8_t *)f->data)[FEAT_BYTES - 1], 0x42);
        ck_assert_int_eq(epd_feature_release(c, f), 0);

        /* The holder exits; this process, which had two clients, has registered one
         * again: still fenced (its other client could still be writing). Its second
         * registration ends the fence, and the bytes are handed out again. */
        int status;
        ck_assert_int_eq(kill(holder, SIGKILL), 0);
        ck_assert_int_eq(waitpid(holder, &status, 0), holder);
        usleep(300000);
        ck_assert_uint_gt(feature_stat("BytesFenced"), 0);
        c2 = kv_worker(&host0b, &feat0b);
        wait_unfenced(5000);
        ck_assert_uint_eq(log_count("unfenced: every worker process of before the restart has exited or registered"), 1);
        epd_disconnect(c2);
        ck_assert_int_eq(epd_feature_acquire(c, "image:new", true, &f), 0);
        ck_assert_int_eq(epd_feature_produce(c, f, FEAT_BYTES, &t, 1, NULL), 0);
        ck_assert_int_eq(epd_feature_publish(c, f, 1000), 0);
        ck_assert_int_eq(epd_feature_release(c, f), 0);

        /* A holder that neither exits nor registers again (nor does this process): the
         * fence ends after 10 s, said in the log. */
        holder = start_holder("image:held2");
        kill9_epdd();
        epd_disconnect(c);
        start_epdd(true);
        ck_assert_uint_eq(log_count("worker process(es) of before the restart still run"), 2);
        ck_assert_uint_gt(feature_stat("BytesFenced"), 0);
        usleep(8000000);
        ck_assert_uint_gt(feature_stat("BytesFenced"), 0);
        wait_unfenced(5000);
        ck_assert_uint_eq(log_count("still run after 10 s"), 1);
        ck_assert_int_eq(kill(holder, SIGKILL), 0);
        ck_assert_int_eq(waitpid(holder, &status, 0), holder);
        c = kv_worker(&host0, &feat0);
        ck_assert_int_eq(epd_feature_acquire(c, "image:held2", true, &f), 0);
        ck_assert_int_eq(epd_feature_produce(c, f, FEAT_BYTES, &t, 1, NULL), 0);
        ck_assert_int_eq(epd_feature_release(c, f), 0);
        epd_disconnect(c);

        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

/* A reservation whose region needs an eviction the journal cannot record (the disk is
 * full from the eviction's GONE on): the caller is refused, and the handle the call made
 * and the reservation go with it. Before, the refused caller left a handle it never
 * learned, the key stayed reserved (every later Acquire of it answered "wait", Reserve
 * "Busy") and the region stayed held. */
START_TEST(test_refused_region_reply_reserves_nothing) {
        ck_assert_int_eq(harness_init(&h, "[Features]\nCacheSize=64K\n"), 0);
        open_notify();
        epd_feature_tensor t = { .name = "pixels", .dtype = "u8", .rank = 1, .shape = { 48 * 1024 } };
        uint64_t L = 0;
        for (int run = 0; run < 2; run++) {
                ev_fresh_state();
                if (run == 1)
                        fault_enospc_lsn = L + 1; /* A's eviction (its GONE) and what follows */
                start_epdd(true);
                fault_enospc_lsn = 0;
                uint8_t *host0, *feat0;
                epd_client *c = kv_worker(&host0, &feat0);
                epd_feature *a = NULL, *b = NULL;
                ck_assert_int_eq(epd_feature_reserve(c, "image:A", 48 * 1024, &t, 1, NULL, &a), 0);
                memset(a->data, 0xaa, 48 * 1024);
                ck_assert_int_eq(epd_feature_publish(c, a, 1), 0);
                ck_assert_int_eq(epd_feature_release(c, a), 0);
                if (run == 0) {
                        L = ev_last_lsn(false); /* the dry run: the LSN before the eviction */
                        kill9_epdd();
                        epd_disconnect(c);
                        continue;
                }
                /* B does not fit beside A: A is evicted, its GONE never durable. */
                ck_assert_int_lt(epd_feature_acquire_or_reserve(c, "image:B", 48 * 1024, &t, 1, NULL, &b), 0);
                ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.Failed");
                ck_assert_ptr_null(b);
                ck_assert_uint_eq(feature_stat("Handles"), 0);
                ck_assert_uint_eq(feature_stat("BytesReserved"), 0);
                /* Asked again: refused again (the journal refuses now), never "wait" for a
                 * producer nobody can name. */
                int r = epd_feature_acquire_or_reserve(c, "image:B", 48 * 1024, &t, 1, NULL, &b);
                ck_assert_msg(r < 0 || strcmp(b->result, "wait") != 0, "the key stayed reserved: %s",
                              b ? b->result : "");
                if (r == 0)
                        (void)epd_feature_release(c, b);
                ck_assert_uint_eq(feature_stat("Handles"), 0);
                kill9_epdd();
                epd_disconnect(c);
        }
        close_notify();
}
END_TEST

/* The worker's Stats value of key (its org.epd1.Worker.Stats). */
static uint64_t worker_stat(epd_client *c, const char *key) {
        sd_bus *bus;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *k;
        uint64_t v, found = UINT64_MAX;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        ck_assert_int_ge(sd_bus_get_property(bus, NULL, epd_worker_path(c), "org.epd1.Worker", "Stats", &e, &reply,
                                             "a{st}"),
                         0);
        ck_assert_int_ge(sd_bus_message_enter_container(reply, 'a', "{st}"), 0);
        while (sd_bus_message_read(reply, "{st}", &k, &v) > 0)
                if (strcmp(k, key) == 0)
                        found = v;
        sd_bus_flush_close_unref(bus);
        ck_assert_msg(found != UINT64_MAX, "no worker stat %s", key);
        return found;
}

/* A feature whose stored copy is damaged: the read back fails, the Acquire is refused,
 * and it counts as no hit, for the cache and for the worker (nor as encoder time
 * saved): before, both counted a hit when the read started. */
START_TEST(test_failed_read_back_is_no_hit) {
        char store[300], line[400];
        ck_assert_int_eq(harness_init(&h, "[Features]\nCacheSize=64K\n"), 0);
        snprintf(store, sizeof store, "%s/store", h.dir);
        ck_assert_int_eq(mkdir(store, 0700), 0);
        snprintf(line, sizeof line, "StoreDirectory=%s\n", store);
        FILE *f = fopen(h.config, "ae");
        ck_assert_ptr_nonnull(f);
        fputs(line, f);
        fclose(f);
        open_notify();
        start_epdd(true);
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        epd_feature_tensor t = { .name = "pixels", .dtype = "u8", .rank = 1, .shape = { 48 * 1024 } };
        epd_feature *a = NULL, *b = NULL;
        ck_assert_int_eq(epd_feature_reserve(c, "image:B", 48 * 1024, &t, 1, NULL, &b), 0);
        memset(b->data, 0xbb, 48 * 1024);
        ck_assert_int_eq(epd_feature_publish(c, b, 1000), 0);
        ck_assert_int_eq(epd_feature_release(c, b), 0);
        ck_assert_int_eq(epd_feature_reserve(c, "image:A", 48 * 1024, &t, 1, NULL, &a), 0);
        ck_assert_int_eq(epd_feature_publish(c, a, 1), 0);
        ck_assert_int_eq(epd_feature_release(c, a), 0);
        for (unsigned i = 0; store_files(store, false) < 1; i++) {
                ck_assert_msg(i < 1000, "B was never spilled");
                usleep(10000);
        }
        /* Damage B's stored bytes (its size kept: the read back finds it). */
        DIR *d = opendir(store);
        ck_assert_ptr_nonnull(d);
        for (struct dirent *de; (de = readdir(d));)
                if (strncmp(de->d_name, "f-", 2) == 0) {
                        int fd = openat(dirfd(d), de->d_name, O_WRONLY | O_CLOEXEC);
                        ck_assert_int_ge(fd, 0);
                        struct stat st;
                        ck_assert_int_eq(fstat(fd, &st), 0);
                        uint8_t junk[4096];
                        memset(junk, 0x11, sizeof junk);
                        ck_assert_int_eq(pwrite(fd, junk, sizeof junk, st.st_size / 2), (ssize_t)sizeof junk);
                        close(fd);
                }
        closedir(d);
        uint64_t hits = feature_stat("Hits"), saved = feature_stat("EncoderTimeSavedUSec");
        ck_assert_int_lt(epd_feature_acquire(c, "image:B", false, &b), 0);
        ck_assert_uint_eq(feature_stat("Hits"), hits);
        ck_assert_uint_eq(feature_stat("EncoderTimeSavedUSec"), saved);
        ck_assert_uint_eq(worker_stat(c, "feature_hits"), 0);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST

/* The copy-on-write rounds' tests: one arena of KV pages, a journal that syncs in batches. */
static void cow_rounds_init(void) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas("[Wal]\nSync=batch\n[Arena:host0]\nSize=2M\nUsage=kv\n[Arena:feat0]\nSize=16M\nUsage=feature\n"
                     "PageSize=64K\n");
        open_notify();
}

/* A copy-on-write of more than one round frees the pages its first round copied away
 * from when their sharer went meanwhile; the record that frees them is the sequence's
 * PUT with the new table, and no byte goes into them before that PUT is durable: a kill
 * -9 before it brings the sequence back on them. The setup: A of two pages, P (pattern 1)
 * shared with B (A's clone truncated to one page) and Q (pattern 3), A's alone; every
 * page of host0 taken, X by S. Returns the last LSN before S's release. */
static uint64_t rounds_setup(epd_client *c, uint8_t *host0, char **ret_a, char **ret_b, char **ret_s) {
        char *fill = NULL;
        uint32_t *p = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, ret_a, &p, &n), 0);
        write_page(c, host0, p[0], 1);
        write_page(c, host0, p[1], 3);
        free(p);
        ck_assert_int_eq(epd_sequence_clone(c, *ret_a, ret_b), 0);
        ck_assert_int_eq(epd_sequence_truncate(c, *ret_b, 1), 0);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, ret_s, NULL, NULL), 0);
        uint64_t pc[4];
        pool_counts("host0", pc);
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)pc[0], &fill, NULL, NULL), 0);
        usleep(20000);
        free(fill);
        return ev_last_lsn(false);
}

/* A Publish sent without waiting for its reply (async_wait()). */
static void publish_async(epd_client *c, const char *path, uint32_t first, uint64_t hash, AsyncCall *a) {
        sd_bus_message *m = NULL;
        ck_assert_int_ge(epd__new_call(c, path, "org.epd1.Sequence", "Publish", &m), 0);
        ck_assert_int_ge(sd_bus_message_append(m, "u", first), 0);
        ck_assert_int_ge(sd_bus_message_append_array(m, 't', &hash, sizeof hash), 0);
        async_call(c, m, a);
}

START_TEST(test_cow_rounds_free_pages) {
        const uint64_t H = 0x5678;
        cow_rounds_init();
        /* A dry run: the LSNs of S's release (L + 1) and of the last record before A's
         * new table (L2). */
        start_epdd(true);
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        char *a = NULL, *b = NULL, *x = NULL;
        uint64_t L = rounds_setup(c, host0, &a, &b, &x);
        ck_assert_int_eq(epd_sequence_release(c, x), 0);
        ck_assert_int_eq(epd_sequence_release(c, b), 0);
        ck_assert_int_eq(epd_sequence_publish(c, a, 1, &H, 1), 1);
        usleep(20000);
        uint64_t L2 = ev_last_lsn(false);
        free(a); free(b); free(x);
        kill9_epdd();
        epd_disconnect(c);
        ev_fresh_state();

        /* Again: S's DEL takes 300 ms to write, the disk is full from L2 + 1 on. A's
         * PrepareWrite of both pages, not waited for: round one copies P into X once the
         * DEL is durable; meanwhile B goes (P is A's alone: round one's commit frees it)
         * and Q is published (shared with the directory: round two copies it, into the
         * only free page, P). */
        fault_slow_lsn = L + 1;
        fault_slow_ms = 300;
        fault_enospc_lsn = L2 + 1;
        start_epdd(true);
        fault_slow_lsn = fault_enospc_lsn = 0;
        c = kv_worker(&host0, &feat0);
        ck_assert_uint_eq(rounds_setup(c, host0, &a, &b, &x), L);
        ck_assert_int_eq(epd_sequence_release_nowait(c, x), 0);
        AsyncCall pw;
        prepare_write_async(c, a, 0, 2, &pw);
        ck_assert_int_eq(epd_sequence_release_nowait(c, b), 0);
        ck_assert_int_eq(epd_sequence_publish(c, a, 1, &H, 1), 1);
        async_wait(c, &pw);
        printf("PrepareWrite over two rounds, the disk full after them: %s\n", pw.error[0] ? pw.error : "ok");
        kill9_epdd();
        epd_disconnect(c);

        /* A comes back on P and Q, each with its own bytes. */
        static const unsigned tags[] = { 1, 3 };
        sequence_back(a, tags, 2, "a copy-on-write of two rounds");
        free(a); free(b); free(x);
        close_notify();
}
END_TEST

/* The same one round later: round one's commit frees nothing (B and C still hold P0),
 * B and C go while round two waits, and round three, its range shared again meanwhile,
 * takes P0 for its copy. What the log says about A until A's next PUT is that P0 is
 * A's: no byte may go into P0 before that PUT is durable. The setup: A of three pages
 * (patterns 1, 3, 5), B and C its clones truncated to P0, S and S2 holding the only
 * other pages (X, Y). Returns the last LSN before S's release. */
static uint64_t rounds3_setup(epd_client *c, uint8_t *host0, char *ret[5]) {
        char *fill = NULL;
        uint32_t *p = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 3, &ret[0], &p, &n), 0);
        for (unsigned i = 0; i < 3; i++)
                write_page(c, host0, p[i], 1 + 2 * i);
        free(p);
        for (unsigned i = 1; i <= 2; i++) {
                ck_assert_int_eq(epd_sequence_clone(c, ret[0], &ret[i]), 0);
                ck_assert_int_eq(epd_sequence_truncate(c, ret[i], 1), 0);
        }
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &ret[3], NULL, NULL), 0);
        ck_assert_int_eq(epd_sequence_create(c, "host0", 1, &ret[4], NULL, NULL), 0);
        uint64_t pc[4];
        pool_counts("host0", pc);
        ck_assert_int_eq(epd_sequence_create(c, "host0", (uint32_t)pc[0], &fill, NULL, NULL), 0);
        usleep(20000);
        free(fill);
        return ev_last_lsn(false);
}

START_TEST(test_cow_rounds_sharers_go_later) {
        const uint64_t H1 = 0x1111, H2 = 0x2222;
        cow_rounds_init();
        /* A dry run: the LSNs of S's release (L + 1) and of the last record before A's
         * next table (L2). */
        start_epdd(true);
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        char *q[5] = { 0 }; /* A, B, C, S, S2 */
        uint64_t L = rounds3_setup(c, host0, q);
        ck_assert_int_eq(epd_sequence_release(c, q[3]), 0);
        ck_assert_int_eq(epd_sequence_release(c, q[4]), 0);
        ck_assert_int_eq(epd_sequence_publish(c, q[0], 1, &H1, 1), 1);
        ck_assert_int_eq(epd_sequence_release(c, q[1]), 0);
        ck_assert_int_eq(epd_sequence_release(c, q[2]), 0);
        ck_assert_int_eq(epd_sequence_publish(c, q[0], 2, &H2, 1), 1);
        usleep(20000);
        uint64_t L2 = ev_last_lsn(false);
        for (unsigned i = 0; i < 5; i++)
                free(q[i]);
        kill9_epdd();
        epd_disconnect(c);
        ev_fresh_state();

        /* Again: the first two writes from S's DEL on take 600 ms each, the disk is full
         * from L2 + 1 on. t = 0: S goes (its DEL in write one), A's PrepareWrite of its
         * three pages (round one copies P0 into X once write one is done, t = 600);
         * t = 100: S2 goes and P1 is published (write two: round two's copy into Y waits
         * for it, until t = 1200); t = 400: B and C go (P0 is free; their DELs in write
         * three) and P2 is published (round three's copy, into P0). */
        fault_slow_lsn = L + 1;
        fault_slow_ms = 600;
        fault_slow_writes = 2;
        fault_enospc_lsn = L2 + 1;
        start_epdd(true);
        fault_slow_lsn = fault_enospc_lsn = 0;
        fault_slow_writes = 1;
        c = kv_worker(&host0, &feat0);
        ck_assert_uint_eq(rounds3_setup(c, host0, q), L);
        AsyncCall pw, pub1, pub2;
        ck_assert_int_eq(epd_sequence_release_nowait(c, q[3]), 0);
        prepare_write_async(c, q[0], 0, 3, &pw);
        usleep(100000);
        ck_assert_int_eq(epd_sequence_release_nowait(c, q[4]), 0);
        publish_async(c, q[0], 1, H1, &pub1);
        usleep(800000);
        ck_assert(!pw.done);
        ck_assert_int_eq(epd_sequence_release_nowait(c, q[1]), 0);
        ck_assert_int_eq(epd_sequence_release_nowait(c, q[2]), 0);
        publish_async(c, q[0], 2, H2, &pub2);
        async_wait(c, &pw);
        async_wait(c, &pub2);
        printf("PrepareWrite over three rounds, sharers gone in the second, the disk full after them: %s\n",
               pw.error[0] ? pw.error : "ok");
        kill9_epdd();
        epd_disconnect(c);

        static const unsigned tags[] = { 1, 3, 5 };
        sequence_back(q[0], tags, 3, "a copy-on-write of three rounds");
        for (unsigned i = 0; i < 5; i++)
                free(q[i]);
        close_notify();
}
END_TEST

/* A start whose arena memory is fresh (the fd store emptied: systemctl stop + start)
 * puts the fresh memfd into the store only once the WAL's drops of the old sequences are
 * durable. Pushed before, a start that died in between (here: it fails at a later arena)
 * had the next start adopt the fresh memory and replay the old PUTs over it: sequences
 * came back over zeros. */
START_TEST(test_fresh_arena_then_failed_start) {
        const char *good = "[Arena:host0]\nSize=64M\nUsage=kv\n[Arena:feat0]\nSize=16M\nUsage=feature\nPageSize=64K\n";
        const char *bad = "[Arena:host0]\nSize=64M\nUsage=kv\n[Arena:feat0]\nSize=64G\nUsage=feature\nHugePages=yes\n";
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        write_arenas(good);
        open_notify();
        start_epdd(true);
        uint8_t *host0, *feat0;
        epd_client *c = kv_worker(&host0, &feat0);
        char *seq = NULL;
        uint32_t *pages = NULL;
        size_t n = 0;
        ck_assert_int_eq(epd_sequence_create(c, "host0", 4, &seq, &pages, &n), 0);
        for (size_t i = 0; i < n; i++)
                write_page(c, host0, pages[i], (unsigned)i);
        kill9_epdd();
        epd_disconnect(c);
        /* systemctl stop; systemctl start: the store is emptied. */
        for (size_t i = 0; i < store_n; i++)
                close(store_fds[i]);
        store_n = 0;
        write_arenas(bad);
        ck_assert_int_ne(run_epdd_to_exit(true), 0);
        write_arenas(good);
        start_epdd(true);
        c = kv_worker(&host0, &feat0);
        int r = epd_sequence_attach(c, id_of(seq), NULL);
        if (r == 0) {
                size_t diff = 0;
                for (size_t i = 0; i < n; i++)
                        diff += page_diff(c, host0, pages[i], (unsigned)i);
                ck_assert_msg(false, "a sequence came back over fresh memory (%zu of %zu bytes differ)", diff,
                              n * (size_t)KV_PAGE);
        }
        free(seq);
        free(pages);
        epd_disconnect(c);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        close_notify();
}
END_TEST


int main(void) {
        Suite *s = suite_create("restart");
        TCase *tc = tcase_create("restart");
        tcase_set_timeout(tc, 400);
#if defined(CRASH_EVERY_RECORD)
        tcase_add_test(tc, test_crash_every_record);
        (void)test_directory_handoff_crash_loop;
        (void)test_sequence_crash_loop;
        (void)test_restart_keeps_arenas;
        (void)test_restart_keeps_sequences_and_features;
        (void)test_evicted_region_reused_before_crash;
        (void)test_loaded_region_reused_before_crash;
        (void)test_restart_arena_moved_or_resized;
        (void)test_failed_start_keeps_the_store;
        (void)test_cow_into_evicted_entry;
        (void)test_write_into_freed_pages;
        (void)test_unbuildable_record_is_refused;
        (void)test_page_size_set_again_after_memory_lost;
        (void)test_changed_page_size_journals_drop;
        (void)test_unattached_workflow_released_at_grace;
        (void)test_refused_fork_journals_nothing;
        (void)test_handoff_journal_grace_is_attach_grace;
        (void)test_retry_after_clock_step_back;
        (void)test_unreadable_put_drops_sequence;
        (void)test_refused_region_reply_reserves_nothing;
        (void)test_failed_read_back_is_no_hit;
        (void)test_restart_fence_for_running_workers;
        (void)test_cow_rounds_free_pages;
        (void)test_cow_rounds_sharers_go_later;
        (void)test_fresh_arena_then_failed_start;
        (void)test_directory_pool_without_memory_fails_the_start;
#elif defined(CRASH_LOOP_DH)
        tcase_add_test(tc, test_directory_handoff_crash_loop);
        (void)test_sequence_crash_loop;
        (void)test_restart_keeps_arenas;
        (void)test_restart_keeps_sequences_and_features;
        (void)test_evicted_region_reused_before_crash;
        (void)test_loaded_region_reused_before_crash;
        (void)test_restart_arena_moved_or_resized;
        (void)test_failed_start_keeps_the_store;
        (void)test_cow_into_evicted_entry;
        (void)test_write_into_freed_pages;
        (void)test_unbuildable_record_is_refused;
        (void)test_page_size_set_again_after_memory_lost;
        (void)test_changed_page_size_journals_drop;
        (void)test_unattached_workflow_released_at_grace;
        (void)test_refused_fork_journals_nothing;
        (void)test_handoff_journal_grace_is_attach_grace;
        (void)test_retry_after_clock_step_back;
        (void)test_unreadable_put_drops_sequence;
        (void)test_refused_region_reply_reserves_nothing;
        (void)test_failed_read_back_is_no_hit;
        (void)test_restart_fence_for_running_workers;
        (void)test_cow_rounds_free_pages;
        (void)test_cow_rounds_sharers_go_later;
        (void)test_fresh_arena_then_failed_start;
        (void)test_directory_pool_without_memory_fails_the_start;
        (void)test_crash_every_record;
#elif defined(CRASH_LOOP)
        tcase_add_test(tc, test_sequence_crash_loop);
        (void)test_directory_handoff_crash_loop;
        (void)test_crash_every_record;
        (void)test_restart_keeps_arenas;
        (void)test_restart_keeps_sequences_and_features;
        (void)test_evicted_region_reused_before_crash;
        (void)test_loaded_region_reused_before_crash;
        (void)test_restart_arena_moved_or_resized;
        (void)test_failed_start_keeps_the_store;
        (void)test_cow_into_evicted_entry;
        (void)test_write_into_freed_pages;
        (void)test_unbuildable_record_is_refused;
        (void)test_page_size_set_again_after_memory_lost;
        (void)test_changed_page_size_journals_drop;
        (void)test_unattached_workflow_released_at_grace;
        (void)test_refused_fork_journals_nothing;
        (void)test_handoff_journal_grace_is_attach_grace;
        (void)test_retry_after_clock_step_back;
        (void)test_unreadable_put_drops_sequence;
        (void)test_refused_region_reply_reserves_nothing;
        (void)test_failed_read_back_is_no_hit;
        (void)test_restart_fence_for_running_workers;
        (void)test_cow_rounds_free_pages;
        (void)test_cow_rounds_sharers_go_later;
        (void)test_fresh_arena_then_failed_start;
        (void)test_directory_pool_without_memory_fails_the_start;
#else
        tcase_add_test(tc, test_restart_keeps_arenas);
        tcase_add_test(tc, test_restart_arena_moved_or_resized);
        tcase_add_test(tc, test_failed_start_keeps_the_store);
        tcase_add_test(tc, test_cow_into_evicted_entry);
        tcase_add_test(tc, test_write_into_freed_pages);
        tcase_add_test(tc, test_unbuildable_record_is_refused);
        tcase_add_test(tc, test_page_size_set_again_after_memory_lost);
        tcase_add_test(tc, test_changed_page_size_journals_drop);
        tcase_add_test(tc, test_unattached_workflow_released_at_grace);
        tcase_add_test(tc, test_refused_fork_journals_nothing);
        tcase_add_test(tc, test_handoff_journal_grace_is_attach_grace);
        tcase_add_test(tc, test_retry_after_clock_step_back);
        tcase_add_test(tc, test_unreadable_put_drops_sequence);
        tcase_add_test(tc, test_refused_region_reply_reserves_nothing);
        tcase_add_test(tc, test_failed_read_back_is_no_hit);
        tcase_add_test(tc, test_restart_fence_for_running_workers);
        tcase_add_test(tc, test_cow_rounds_free_pages);
        tcase_add_test(tc, test_cow_rounds_sharers_go_later);
        tcase_add_test(tc, test_fresh_arena_then_failed_start);
        tcase_add_test(tc, test_directory_pool_without_memory_fails_the_start);
        tcase_add_test(tc, test_restart_keeps_sequences_and_features);
        tcase_add_test(tc, test_evicted_region_reused_before_crash);
        tcase_add_test(tc, test_loaded_region_reused_before_crash);
        (void)test_sequence_crash_loop;
        (void)test_directory_handoff_crash_loop;
        (void)test_crash_every_record;
#endif
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
