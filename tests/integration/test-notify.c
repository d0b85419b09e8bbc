/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The sd_notify protocol as epd.service (Type=notify, NotifyAccess=main, WatchdogSec=)
 * relies on it. The test plays systemd's part: a datagram socket passed to epdd as
 * NOTIFY_SOCKET, with WATCHDOG_USEC and WATCHDOG_PID set as systemd sets them, and
 * checks that
 *   - READY=1 comes only once epdd serves: when it arrives, the direct socket answers a
 *     call, and on a bus the name org.epd1 is already owned; a bad configuration never
 *     gets to READY=1;
 *   - every message comes from epdd's main process (NotifyAccess=main would drop
 *     others) and READY=1 carries a STATUS= line;
 *   - WATCHDOG=1 arrives repeatedly from the event loop, never further apart than the
 *     watchdog period, also while the loop serves calls;
 *   - SIGHUP gives RELOADING=1, then READY=1 again;
 *   - SIGTERM gives STOPPING=1, no READY=1 after it, and exit status 0.
 * Arrival times are the kernel's (SO_TIMESTAMPNS), so the test's own scheduling does
 * not count against epdd. */
#include <check.h>
#include <errno.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "time-util.h"
#include "../check-main.h"

#define WATCHDOG_USEC (200 * USEC_PER_MSEC)

typedef struct Msg {
        char text[4096];
        pid_t pid;     /* sender, from SCM_CREDENTIALS */
        usec_t at;     /* arrival, CLOCK_REALTIME, from SO_TIMESTAMPNS */
} Msg;

static Harness h;
static int notify_fd = -1;
static char notify_path[320];

static bool has_line(const char *text, const char *line) {
        size_t n = strlen(line);
        for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
                if (strncmp(p, line, n) == 0 && (p[n] == '\n' || p[n] == 0))
                        return true;
        return false;
}

static bool has_prefix_line(const char *text, const char *prefix) {
        size_t n = strlen(prefix);
        for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
                if (strncmp(p, prefix, n) == 0)
                        return true;
        return false;
}

static int notify_open(void) {
        snprintf(notify_path, sizeof notify_path, "%s/notify", h.dir);
        int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
                return -errno;
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        if (strlen(notify_path) >= sizeof sa.sun_path) {
                close(fd);
                return -ENAMETOOLONG;
        }
        strcpy(sa.sun_path, notify_path);
        int one = 1;
        if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 ||
            setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &one, sizeof one) < 0 ||
            setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &one, sizeof one) < 0) {
                int r = -errno;
                close(fd);
                return r;
        }
        return fd;
}

/* Receives one message, waiting up to timeout_ms. 1: got one, 0: timeout. */
static int notify_recv(Msg *m, int timeout_ms) {
        struct pollfd p = { .fd = notify_fd, .events = POLLIN };
        int r = poll(&p, 1, timeout_ms);
        if (r < 0)
                return -errno;
        if (r == 0)
                return 0;
        union {
                struct cmsghdr h;
                char buf[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(sizeof(struct timespec))];
        } control;
        struct iovec iov = { .iov_base = m->text, .iov_len = sizeof m->text - 1 };
        struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1,
                             .msg_control = &control, .msg_controllen = sizeof control };
        ssize_t k = recvmsg(notify_fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (k < 0)
                return errno == EAGAIN ? 0 : -errno;
        m->text[k] = 0;
        m->pid = 0;
        m->at = now_usec(CLOCK_REALTIME);
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
                        struct ucred u;
                        memcpy(&u, CMSG_DATA(c), sizeof u);
                        m->pid = u.pid;
                } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
                        struct timespec ts;
                        memcpy(&ts, CMSG_DATA(c), sizeof ts);
                        m->at = (usec_t)ts.tv_sec * USEC_PER_SEC + (usec_t)ts.tv_nsec / NSEC_PER_USEC;
                }
        }
        return 1;
}

/* Starts epdd the way systemd does for Type=notify with WatchdogSec=. */
static void start_epdd(const char *config, usec_t watchdog_usec, const char *bus_address) {
        char cfg[400], busarg[450], wd[32];
        const char *argv[8];
        size_t n = 0;
        argv[n++] = harness_epdd();
        snprintf(cfg, sizeof cfg, "--config=%s", config);
        argv[n++] = cfg;
        if (bus_address) {
                snprintf(busarg, sizeof busarg, "--bus-address=%s", bus_address);
                argv[n++] = busarg;
        }
        argv[n] = NULL;
        snprintf(wd, sizeof wd, "%llu", (unsigned long long)watchdog_usec);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                int fd = open(h.log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
                if (fd >= 0) {
                        dup2(fd, 1);
                        dup2(fd, 2);
                }
                char self[32];
                snprintf(self, sizeof self, "%d", (int)getpid());
                setenv("NOTIFY_SOCKET", notify_path, 1);
                if (watchdog_usec > 0) {
                        setenv("WATCHDOG_USEC", wd, 1);
                        setenv("WATCHDOG_PID", self, 1);
                }
                execv(argv[0], (char **)argv);
                _exit(127);
        }
        h.epdd_pid = pid;
}

static void dump_log(void) {
        char cmd[400];
        snprintf(cmd, sizeof cmd, "tail -n 40 %s >&2", h.log);
        if (system(cmd) < 0)
                perror("system");
}

/* Waits for READY=1 (up to 60 s: sanitizers on a loaded machine). Checks on the way
 * that nothing before it claimed readiness and that every sender was the main pid.
 * Returns the READY message in *ready. */
static void wait_ready(Msg *ready) {
        usec_t deadline = now_usec(CLOCK_MONOTONIC) + 60 * USEC_PER_SEC;
        while (now_usec(CLOCK_MONOTONIC) < deadline) {
                int r = notify_recv(ready, 100);
                ck_assert_int_ge(r, 0);
                if (r == 0) {
                        int status;
                        if (waitpid(h.epdd_pid, &status, WNOHANG) == h.epdd_pid) {
                                h.epdd_pid = 0;
                                dump_log();
                                ck_abort_msg("epdd exited during startup");
                        }
                        continue;
                }
                ck_assert_msg(ready->pid == h.epdd_pid, "notification from pid %d, not epdd's main pid %d",
                              (int)ready->pid, (int)h.epdd_pid);
                if (has_line(ready->text, "READY=1"))
                        return;
        }
        dump_log();
        ck_abort_msg("no READY=1 within 60 s");
}

static bool serves_direct(void) {
        sd_bus *bus = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        char *version = NULL;
        int r = harness_direct_bus(&h, &bus);
        if (r >= 0)
                r = sd_bus_get_property_string(bus, NULL, "/org/epd1", "org.epd1.Manager", "Version", &e,
                                               &version);
        if (r < 0)
                fprintf(stderr, "direct call failed: %s (%s)\n", strerror(-r), e.message ?: "");
        bool ok = r >= 0 && version && strcmp(version, EPD_VERSION) == 0;
        free(version);
        sd_bus_error_free(&e);
        sd_bus_flush_close_unref(bus);
        return ok;
}

static void setup(void) {
        ck_assert_int_eq(harness_init(&h, NULL), 0);
        notify_fd = notify_open();
        ck_assert_int_ge(notify_fd, 0);
}

static void teardown(void) {
        harness_done(&h);
        if (notify_fd >= 0)
                close(notify_fd);
        notify_fd = -1;
}

START_TEST(test_ready_after_serving_direct) {
        Msg m;
        start_epdd(h.config, 0, NULL);
        wait_ready(&m);
        /* The moment READY=1 is in, the direct socket must answer a call. */
        ck_assert_msg(serves_direct(), "READY=1 arrived but the direct socket does not answer");
        ck_assert_msg(has_prefix_line(m.text, "STATUS="), "READY=1 without a STATUS= line: %s", m.text);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
}
END_TEST

START_TEST(test_ready_after_name_owned) {
        Msg m;
        int r = harness_start_bus(&h);
        if (r == -ENOENT) {
                /* The other cases still run; this one has nothing to check against. */
                printf("SKIP test_ready_after_name_owned: dbus-daemon is not installed\n");
                return;
        }
        ck_assert_int_eq(r, 0);
        start_epdd(h.config, 0, h.bus_address);
        wait_ready(&m);

        /* READY=1 means the bus name is owned already: ask the bus, then call through it. */
        sd_bus *bus = NULL;
        ck_assert_int_ge(sd_bus_new(&bus), 0);
        ck_assert_int_ge(sd_bus_set_address(bus, h.bus_address), 0);
        ck_assert_int_ge(sd_bus_set_bus_client(bus, true), 0);
        ck_assert_int_ge(sd_bus_start(bus), 0);
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        int has = 0;
        ck_assert_int_ge(sd_bus_call_method(bus, "org.freedesktop.DBus", "/org/freedesktop/DBus",
                                            "org.freedesktop.DBus", "NameHasOwner", &e, &reply, "s",
                                            "org.epd1"), 0);
        ck_assert_int_ge(sd_bus_message_read(reply, "b", &has), 0);
        ck_assert_msg(has, "READY=1 arrived before org.epd1 was owned");
        sd_bus_message_unref(reply);
        char *host = NULL;
        ck_assert_int_ge(sd_bus_get_property_string(bus, "org.epd1", "/org/epd1", "org.epd1.Manager",
                                                    "HostId", &e, &host), 0);
        ck_assert_str_eq(host, "test-host");
        free(host);
        sd_bus_flush_close_unref(bus);
        ck_assert(serves_direct());
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
}
END_TEST

START_TEST(test_watchdog) {
        Msg m;
        start_epdd(h.config, WATCHDOG_USEC, NULL);
        wait_ready(&m);
        usec_t last = m.at, max_gap = 0, first_gap = 0;
        unsigned pings = 0, calls = 0;
        sd_bus *bus = NULL;
        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        /* For 1.5 s, keep the loop busy with calls and collect what it sends. */
        usec_t end = now_usec(CLOCK_MONOTONIC) + 1500 * USEC_PER_MSEC;
        while (now_usec(CLOCK_MONOTONIC) < end) {
                char *v = NULL;
                sd_bus_error e = SD_BUS_ERROR_NULL;
                ck_assert_int_ge(sd_bus_get_property_string(bus, NULL, "/org/epd1", "org.epd1.Manager",
                                                            "Version", &e, &v), 0);
                free(v);
                calls++;
                int r;
                while ((r = notify_recv(&m, 5)) > 0) {
                        ck_assert_int_eq(m.pid, h.epdd_pid);
                        ck_assert_msg(!has_line(m.text, "READY=1") && !has_line(m.text, "STOPPING=1"),
                                      "unexpected notification: %s", m.text);
                        if (!has_line(m.text, "WATCHDOG=1"))
                                continue;
                        usec_t gap = m.at - last;
                        if (pings == 0)
                                first_gap = gap;
                        if (gap > max_gap)
                                max_gap = gap;
                        last = m.at;
                        pings++;
                }
                ck_assert_int_ge(r, 0);
        }
        sd_bus_flush_close_unref(bus);
        printf("watchdog: %u pings in 1.5 s with WATCHDOG_USEC=%llu ms, first after %llu ms, "
               "largest gap %llu ms, %u calls served meanwhile\n",
               pings, (unsigned long long)(WATCHDOG_USEC / USEC_PER_MSEC),
               (unsigned long long)(first_gap / USEC_PER_MSEC),
               (unsigned long long)(max_gap / USEC_PER_MSEC), calls);
        /* systemd kills the service when a period passes without a ping. */
        ck_assert_uint_ge(pings, 4);
        ck_assert_msg(max_gap < WATCHDOG_USEC, "a watchdog gap of %llu us exceeds the period %llu us",
                      (unsigned long long)max_gap, (unsigned long long)WATCHDOG_USEC);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
}
END_TEST

START_TEST(test_reload) {
        Msg m;
        start_epdd(h.config, WATCHDOG_USEC, NULL);
        wait_ready(&m);
        ck_assert_int_eq(kill(h.epdd_pid, SIGHUP), 0);
        bool reloading = false, ready_again = false;
        usec_t deadline = now_usec(CLOCK_MONOTONIC) + 30 * USEC_PER_SEC;
        while (!ready_again && now_usec(CLOCK_MONOTONIC) < deadline) {
                int r = notify_recv(&m, 100);
                ck_assert_int_ge(r, 0);
                if (r == 0)
                        continue;
                ck_assert_int_eq(m.pid, h.epdd_pid);
                if (has_line(m.text, "RELOADING=1"))
                        reloading = true;
                if (has_line(m.text, "READY=1")) {
                        ck_assert_msg(reloading, "READY=1 after SIGHUP without RELOADING=1 first");
                        ck_assert(has_prefix_line(m.text, "STATUS="));
                        ready_again = true;
                }
        }
        ck_assert_msg(reloading && ready_again, "SIGHUP: RELOADING=1 %s, READY=1 %s",
                      reloading ? "seen" : "missing", ready_again ? "seen" : "missing");
        ck_assert(serves_direct());
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
}
END_TEST

/* Rotating the cluster key in the same file takes a restart, and a reload says so (in
 * its status and log) instead of "reloaded" with the old key silently kept. */
START_TEST(test_reload_key_rotation) {
        char conf[400], key[400];
        snprintf(key, sizeof key, "%s/cluster.key", h.dir);
        snprintf(conf, sizeof conf, "%s/cluster.conf", h.dir);
        FILE *f = fopen(key, "we");
        ck_assert_ptr_nonnull(f);
        fputs("first-cluster-key-0123456789abcdef\n", f);
        ck_assert_int_eq(fclose(f), 0);
        ck_assert_int_eq(chmod(key, 0600), 0);
        int probe = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t sl = sizeof sa;
        ck_assert_int_eq(bind(probe, (struct sockaddr *)&sa, sizeof sa), 0);
        ck_assert_int_eq(getsockname(probe, (struct sockaddr *)&sa, &sl), 0);
        close(probe);
        f = fopen(conf, "we");
        ck_assert_ptr_nonnull(f);
        /* Everything under the test's directory: never the host's /var/lib/epd. */
        fprintf(f,
                "[Daemon]\nSocket=%s\nSystemBus=no\nStateDirectory=%s/state\nHostId=alpha\n[Cluster]\n"
                "Listen=127.0.0.1:%u\nClusterKeyFile=%s\n",
                h.socket, h.dir, ntohs(sa.sin_port), key);
        ck_assert_int_eq(fclose(f), 0);

        Msg m;
        start_epdd(conf, 0, NULL);
        wait_ready(&m);
        for (int round = 0; round < 2; round++) {
                if (round == 1) {
                        f = fopen(key, "we");
                        ck_assert_ptr_nonnull(f);
                        fputs("second-cluster-key-0123456789abcdef\n", f);
                        ck_assert_int_eq(fclose(f), 0);
                }
                ck_assert_int_eq(kill(h.epdd_pid, SIGHUP), 0);
                bool ready = false;
                usec_t deadline = now_usec(CLOCK_MONOTONIC) + 30 * USEC_PER_SEC;
                while (!ready && now_usec(CLOCK_MONOTONIC) < deadline) {
                        int r = notify_recv(&m, 100);
                        ck_assert_int_ge(r, 0);
                        if (r == 0 || !has_line(m.text, "READY=1"))
                                continue;
                        ready = true;
                        bool restart = strstr(m.text, "need a restart") != NULL;
                        ck_assert_msg(restart == (round == 1), "round %d: %s", round, m.text);
                }
                ck_assert(ready);
        }
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
}
END_TEST

static void stop_and_check(int sig) {
        Msg m;
        start_epdd(h.config, WATCHDOG_USEC, NULL);
        wait_ready(&m);
        ck_assert(serves_direct());
        pid_t pid = h.epdd_pid;
        int status = 0;
        ck_assert_int_eq(kill(pid, sig), 0);
        usec_t deadline = now_usec(CLOCK_MONOTONIC) + 30 * USEC_PER_SEC;
        while (waitpid(pid, &status, WNOHANG) != pid) {
                ck_assert_msg(now_usec(CLOCK_MONOTONIC) < deadline, "epdd did not exit on %s",
                              strsignal(sig));
                usleep(10000);
        }
        h.epdd_pid = 0;
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "epdd exit status 0x%x on %s",
                      (unsigned)status, strsignal(sig));
        /* Everything epdd sent is still queued on our socket. */
        bool stopping = false;
        int r;
        while ((r = notify_recv(&m, 0)) > 0) {
                ck_assert_int_eq(m.pid, pid);
                if (has_line(m.text, "STOPPING=1"))
                        stopping = true;
                ck_assert_msg(!(stopping && has_line(m.text, "READY=1")), "READY=1 after STOPPING=1");
        }
        ck_assert_int_ge(r, 0);
        ck_assert_msg(stopping, "no STOPPING=1 on %s", strsignal(sig));
}

START_TEST(test_stopping_on_sigterm) {
        stop_and_check(SIGTERM);
}
END_TEST

/* SIGTERM while epdd starts (here its replay of the log reads slowly): it stops without
 * ever saying READY=1, STOPPING=1 and exit status 0. Before, the start went on, said
 * READY=1 after the SIGTERM, and then stopped. */
START_TEST(test_stopping_while_starting) {
        Msg m;
        const char *lib = getenv("FAULT_WAL");
        ck_assert_msg(lib, "FAULT_WAL is not set (run through meson test)");
        start_epdd(h.config, 0, NULL); /* a first start leaves a log to replay */
        wait_ready(&m);
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        while (notify_recv(&m, 0) > 0)
                ;
        const char *asan = getenv("ASAN_OPTIONS");
        char *old_asan = asan ? strdup(asan) : NULL, env[1024];
        snprintf(env, sizeof env, "%s%sverify_asan_link_order=0", asan ? asan : "", asan && *asan ? ":" : "");
        ck_assert_int_eq(setenv("ASAN_OPTIONS", env, 1), 0);
        ck_assert_int_eq(setenv("LD_PRELOAD", lib, 1), 0);
        ck_assert_int_eq(setenv("EPD_FAULT_READ_SLOW", "2000:1:wal.log", 1), 0);
        start_epdd(h.config, 0, NULL);
        unsetenv("LD_PRELOAD");
        unsetenv("EPD_FAULT_READ_SLOW");
        if (old_asan)
                setenv("ASAN_OPTIONS", old_asan, 1);
        else
                unsetenv("ASAN_OPTIONS");
        free(old_asan);
        pid_t pid = h.epdd_pid;
        usleep(500 * 1000); /* in its replay */
        ck_assert_int_eq(kill(pid, SIGTERM), 0);
        int status = 0;
        usec_t deadline = now_usec(CLOCK_MONOTONIC) + 30 * USEC_PER_SEC;
        while (waitpid(pid, &status, WNOHANG) != pid) {
                ck_assert_msg(now_usec(CLOCK_MONOTONIC) < deadline, "epdd did not exit on SIGTERM while starting");
                usleep(10000);
        }
        h.epdd_pid = 0;
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "epdd exit status 0x%x", (unsigned)status);
        bool stopping = false;
        int r;
        while ((r = notify_recv(&m, 0)) > 0) {
                ck_assert_msg(!has_line(m.text, "READY=1"), "READY=1 after a SIGTERM while starting");
                if (has_line(m.text, "STOPPING=1"))
                        stopping = true;
        }
        ck_assert_int_ge(r, 0);
        ck_assert(stopping);
        ck_assert(harness_log_has(&h, "Asked to stop while starting"));
}
END_TEST

START_TEST(test_stopping_on_sigint) {
        stop_and_check(SIGINT);
}
END_TEST

START_TEST(test_bad_config_never_ready) {
        char bad[400];
        snprintf(bad, sizeof bad, "%s/bad.conf", h.dir);
        FILE *f = fopen(bad, "we");
        ck_assert_ptr_nonnull(f);
        fprintf(f, "[Daemon]\nSocket=%s\nSystemBus=no\nNoSuchKey=1\n", h.socket);
        fclose(f);
        start_epdd(bad, WATCHDOG_USEC, NULL);
        int status;
        ck_assert_int_eq(waitpid(h.epdd_pid, &status, 0), h.epdd_pid);
        h.epdd_pid = 0;
        ck_assert(WIFEXITED(status) && WEXITSTATUS(status) != 0);
        Msg m;
        int r;
        while ((r = notify_recv(&m, 0)) > 0)
                ck_assert_msg(!has_line(m.text, "READY=1"), "READY=1 from a daemon that never served");
        ck_assert_int_ge(r, 0);
}
END_TEST

int main(void) {
        Suite *s = suite_create("notify");
        TCase *tc = tcase_create("notify");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_ready_after_serving_direct);
        tcase_add_test(tc, test_ready_after_name_owned);
        tcase_add_test(tc, test_watchdog);
        tcase_add_test(tc, test_reload);
        tcase_add_test(tc, test_reload_key_rotation);
        tcase_add_test(tc, test_stopping_on_sigterm);
        tcase_add_test(tc, test_stopping_on_sigint);
        tcase_add_test(tc, test_stopping_while_starting);
        tcase_add_test(tc, test_bad_config_never_ready);
        suite_add_tcase(s, tc);
        return check_run(s, CK_NOFORK);
}
