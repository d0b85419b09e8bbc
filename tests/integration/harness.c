/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "harness.h"
#include "../check-main.h"

#include <check.h>

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

const char *harness_epdd(void) {
        const char *e = getenv("EPDD");
        return e ? e : "epdd";
}

/* The dbus-daemon found in PATH (as a test run without one must see it missing), or
 * NULL. */
static const char *find_dbus_daemon(char *buf, size_t n) {
        const char *path = getenv("PATH");
        if (!path || !*path)
                path = "/usr/bin:/bin";
        while (*path) {
                size_t len = strcspn(path, ":");
                if (len > 0 && len + sizeof "/dbus-daemon" <= n) {
                        memcpy(buf, path, len);
                        memcpy(buf + len, "/dbus-daemon", sizeof "/dbus-daemon");
                        if (access(buf, X_OK) == 0)
                                return buf;
                }
                path += len;
                if (*path == ':')
                        path++;
        }
        return NULL;
}

bool harness_have_dbus_daemon(void) {
        char buf[4096];
        return find_dbus_daemon(buf, sizeof buf) != NULL;
}

void harness_require_bus(bool over_bus) {
        char buf[4096];
        if (over_bus && !find_dbus_daemon(buf, sizeof buf)) {
                printf("SKIP: this test runs over a private dbus-daemon and none is in PATH\n");
                fflush(stdout);
                exit(77);
        }
}

static int write_file(const char *path, const char *text) {
        FILE *f = fopen(path, "we");
        if (!f)
                return -errno;
        fputs(text, f);
        return fclose(f) == 0 ? 0 : -errno;
}

/* Notes a process this harness started in its directory's .pids, so that the test's
 * main can kill it if the test ends before its teardown (check-main.h). */
void harness_note_pid(Harness *h, pid_t pid) {
        char path[sizeof h->dir + 8];
        snprintf(path, sizeof path, "%s/.pids", h->dir);
        FILE *f = fopen(path, "ae");
        if (f) {
                fprintf(f, "%ld\n", (long)pid);
                fclose(f);
        }
}

int harness_init(Harness *h, const char *extra) {
        memset(h, 0, sizeof *h);
        /* Under the run's own directory when the test's main made one (check-main.h). */
        const char *run = getenv("EPD_TEST_RUN_DIR");
        if (run && strncmp(run, CHECK_RUN_PREFIX, strlen(CHECK_RUN_PREFIX)) == 0 && strlen(run) < 200)
                snprintf(h->dir, sizeof h->dir, "%s/epd-test-XXXXXX", run);
        else
                strcpy(h->dir, "/tmp/epd-test-XXXXXX");
        if (!mkdtemp(h->dir))
                return -errno;
        snprintf(h->socket, sizeof h->socket, "%s/bus", h->dir);
        snprintf(h->config, sizeof h->config, "%s/epd.conf", h->dir);
        snprintf(h->log, sizeof h->log, "%s/epdd.log", h->dir);
        char *text;
        if (asprintf(&text,
                     "[Daemon]\nSocket=%s\nSystemBus=no\nStateDirectory=%s/state\nLogLevel=debug\n"
                     "HostId=test-host\n%s\n",
                     h->socket, h->dir, extra ? extra : "") < 0)
                return -ENOMEM;
        int r = write_file(h->config, text);
        free(text);
        return r;
}

int harness_start_bus(Harness *h) {
        char conf[300];
        snprintf(conf, sizeof conf, "%s/dbus.conf", h->dir);
        char *text;
        if (asprintf(&text,
                     "<!DOCTYPE busconfig PUBLIC \"-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN\"\n"
                     " \"http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd\">\n"
                     "<busconfig><type>system</type><listen>unix:path=%s/dbus.sock</listen>\n"
                     "<auth>EXTERNAL</auth>\n"
                     "<policy context=\"default\"><allow user=\"*\"/><allow own=\"*\"/>\n"
                     "<allow send_type=\"method_call\"/><allow send_type=\"signal\"/>\n"
                     "<allow send_requested_reply=\"true\" send_type=\"method_return\"/>\n"
                     "<allow send_requested_reply=\"true\" send_type=\"error\"/>\n"
                     "<allow receive_type=\"method_call\"/><allow receive_type=\"method_return\"/>\n"
                     "<allow receive_type=\"error\"/><allow receive_type=\"signal\"/>\n"
                     "<allow send_destination=\"*\"/></policy></busconfig>\n",
                     h->dir) < 0)
                return -ENOMEM;
        int r = write_file(conf, text);
        free(text);
        if (r < 0)
                return r;
        char daemon[4096];
        if (!find_dbus_daemon(daemon, sizeof daemon))
                return -ENOENT;
        pid_t pid = fork();
        if (pid < 0)
                return -errno;
        if (pid == 0) {
                char arg[400];
                snprintf(arg, sizeof arg, "--config-file=%s", conf);
                int null = open("/dev/null", O_RDWR);
                dup2(null, 0);
                execl(daemon, "dbus-daemon", "--nofork", "--nopidfile", "--nosyslog", arg,
                      (char *)NULL);
                _exit(127);
        }
        h->dbus_pid = pid;
        harness_note_pid(h, pid);
        snprintf(h->bus_address, sizeof h->bus_address, "unix:path=%s/dbus.sock", h->dir);
        char sock[320];
        snprintf(sock, sizeof sock, "%s/dbus.sock", h->dir);
        for (int i = 0; i < 500; i++) {
                if (access(sock, F_OK) == 0)
                        return 0;
                usleep(10000);
        }
        return -ETIMEDOUT;
}

static bool socket_serves(const char *path) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        if (strlen(path) >= sizeof sa.sun_path) {
                if (fd >= 0)
                        close(fd);
                return false;
        }
        memcpy(sa.sun_path, path, strlen(path) + 1);
        bool ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0;
        if (fd >= 0)
                close(fd);
        return ok;
}

/* Plays systemd's part: a datagram socket whose path goes to epdd as NOTIFY_SOCKET. */
static int notify_socket(Harness *h, char *path, size_t n) {
        snprintf(path, n, "%s/notify", h->dir);
        (void)unlink(path);
        int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        if (fd < 0)
                return -errno;
        if (strlen(path) >= sizeof sa.sun_path) {
                close(fd);
                return -ENAMETOOLONG;
        }
        memcpy(sa.sun_path, path, strlen(path) + 1);
        if (bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
                int r = -errno;
                close(fd);
                return r;
        }
        return fd;
}

int harness_start_epdd(Harness *h, const char *const *extra_args) {
        const char *argv[32];
        size_t n = 0;
        char cfg[320], busarg[420];
        argv[n++] = harness_epdd();
        snprintf(cfg, sizeof cfg, "--config=%s", h->config);
        argv[n++] = cfg;
        if (h->bus_address[0]) {
                snprintf(busarg, sizeof busarg, "--bus-address=%s", h->bus_address);
                argv[n++] = busarg;
        }
        for (size_t i = 0; extra_args && extra_args[i] && n < 30; i++)
                argv[n++] = extra_args[i];
        argv[n] = NULL;
        char npath[320];
        int nfd = notify_socket(h, npath, sizeof npath);
        if (nfd < 0)
                return nfd;
        pid_t pid = fork();
        if (pid < 0)
                return -errno;
        if (pid == 0) {
                int fd = open(h->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
                if (fd >= 0) {
                        dup2(fd, 2);
                        dup2(fd, 1);
                }
                setenv("NOTIFY_SOCKET", npath, 1);
                execv(argv[0], (char **)argv);
                _exit(127);
        }
        h->epdd_pid = pid;
        harness_note_pid(h, pid);
        /* Serving means READY=1: the direct socket listens and the bus name is owned. */
        for (int i = 0; i < 1000; i++) {
                int status;
                char buf[4096];
                ssize_t k;
                while ((k = recv(nfd, buf, sizeof buf - 1, 0)) > 0) {
                        buf[k] = 0;
                        if (strstr(buf, "READY=1")) {
                                close(nfd);
                                return socket_serves(h->socket) ? 0 : -EPROTO;
                        }
                }
                if (waitpid(pid, &status, WNOHANG) == pid) {
                        close(nfd);
                        h->epdd_pid = 0;
                        fprintf(stderr, "epdd exited during startup; its log:\n");
                        char cmd[400];
                        snprintf(cmd, sizeof cmd, "cat %s >&2", h->log);
                        if (system(cmd) < 0)
                                perror("system");
                        return -ECHILD;
                }
                usleep(10000);
        }
        close(nfd);
        return -ETIMEDOUT;
}

static int stop_pid(pid_t *pid, int sig, unsigned timeout_ms) {
        int status;
        if (*pid <= 0)
                return 0;
        kill(*pid, sig);
        for (unsigned i = 0; i < timeout_ms / 10; i++) {
                if (waitpid(*pid, &status, WNOHANG) == *pid) {
                        *pid = 0;
                        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                }
                usleep(10000);
        }
        kill(*pid, SIGKILL);
        waitpid(*pid, &status, 0);
        *pid = 0;
        return -ETIMEDOUT;
}

int harness_stop_epdd(Harness *h) {
        return stop_pid(&h->epdd_pid, SIGTERM, 10000);
}

bool harness_log_has(Harness *h, const char *needle) {
        FILE *f = fopen(h->log, "re");
        if (!f)
                return false;
        char line[4096];
        bool found = false;
        while (!found && fgets(line, sizeof line, f))
                found = strstr(line, needle) != NULL;
        fclose(f);
        return found;
}

void harness_epdctl(const char *address, const char *args, char *out, size_t size) {
        char cmd[1024];
        const char *root = getenv("BUILD_ROOT");
        snprintf(cmd, sizeof cmd, "%s/tools/epdctl -A '%s' %s", root ? root : ".", address, args);
        FILE *p = popen(cmd, "re");
        ck_assert_ptr_nonnull(p);
        size_t n = fread(out, 1, size - 1, p);
        out[n] = 0;
        ck_assert_int_eq(pclose(p), 0);
}

int harness_restart(Harness *h, const char *extra, char *address, size_t n) {
        int r = harness_stop_epdd(h);
        if (r < 0)
                return r;
        harness_done(h);
        r = harness_init(h, extra);
        if (r < 0)
                return r;
        harness_direct_address(h, address, n);
        return harness_start_epdd(h, NULL);
}

void harness_done(Harness *h) {
        int r = stop_pid(&h->epdd_pid, SIGTERM, 10000);
        if (r != 0) {
                fprintf(stderr, "epdd did not stop cleanly (%d); its log:\n", r);
                char cmd[400];
                snprintf(cmd, sizeof cmd, "tail -n 50 %s >&2", h->log);
                if (system(cmd) < 0)
                        perror("system");
        }
        stop_pid(&h->dbus_pid, SIGTERM, 5000);
        if (h->dir[0] && strncmp(h->dir, "/tmp/epd-test-", 14) == 0) {
                char cmd[300];
                snprintf(cmd, sizeof cmd, "rm -rf '%s'", h->dir);
                if (system(cmd) < 0)
                        perror("system");
        }
}

int harness_start_epdd_preloaded(Harness *h, const char *lib, const char *var, const char *value) {
        if (!lib)
                return harness_start_epdd(h, NULL);
        const char *asan = getenv("ASAN_OPTIONS");
        char *old_asan = asan ? strdup(asan) : NULL, env[1200];
        snprintf(env, sizeof env, "%s%sverify_asan_link_order=0", asan ? asan : "", asan && *asan ? ":" : "");
        setenv("ASAN_OPTIONS", env, 1);
        setenv("LD_PRELOAD", lib, 1);
        if (var)
                setenv(var, value, 1);
        int r = harness_start_epdd(h, NULL);
        unsetenv("LD_PRELOAD");
        if (var)
                unsetenv(var);
        if (old_asan)
                setenv("ASAN_OPTIONS", old_asan, 1);
        else
                unsetenv("ASAN_OPTIONS");
        free(old_asan);
        return r;
}

void harness_let_others_in(Harness *h) {
        char bus_sock[sizeof h->dir + 16];
        ck_assert_int_eq(chmod(h->dir, 0711), 0);
        ck_assert_int_eq(chmod(h->socket, 0666), 0);
        snprintf(bus_sock, sizeof bus_sock, "%s/dbus.sock", h->dir);
        if (h->bus_address[0])
                ck_assert_int_eq(chmod(bus_sock, 0666), 0);
}

pid_t harness_fork_as(uid_t uid) {
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0 && uid != geteuid() &&
            (setgroups(0, NULL) < 0 || setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0))
                _exit(2);
        return pid;
}

int harness_start_cluster(Harness *const *h, size_t n,
                          void (*conf)(size_t i, unsigned port, char *buf, size_t size, void *userdata),
                          void *userdata) {
        unsigned seed = (unsigned)getpid() ^ (unsigned)time(NULL);
        char buf[2048];
        int r = -EADDRINUSE;
        for (int attempt = 0; attempt < 20 && r == -EADDRINUSE; attempt++) {
                unsigned port = 20000 + (unsigned)(rand_r(&seed) % (36000 / n)) * (unsigned)n;
                r = 0;
                for (size_t i = 0; i < n && r == 0; i++) {
                        conf(i, port, buf, sizeof buf, userdata);
                        r = harness_init(h[i], buf);
                        if (r < 0)
                                return r;
                }
                for (size_t i = 0; i < n && r == 0; i++) {
                        r = harness_start_epdd(h[i], NULL);
                        if (r < 0 && harness_log_has(h[i], "Address already in use"))
                                r = -EADDRINUSE;
                }
                if (r == 0)
                        return 0;
                for (size_t i = 0; i < n; i++) {
                        harness_done(h[i]);
                        memset(h[i], 0, sizeof *h[i]);
                }
                if (r == -EADDRINUSE)
                        fprintf(stderr, "ports %u..%u: one is in use, trying others\n", port, port + (unsigned)n - 1);
        }
        return r;
}

const char *harness_direct_address(Harness *h, char *buf, size_t n) {
        snprintf(buf, n, "direct:%s", h->socket);
        return buf;
}

bool harness_wait_for(bool (*cond)(void *userdata), void *userdata, unsigned timeout_ms) {
        for (unsigned i = 0; i <= timeout_ms / 10; i++) {
                if (cond(userdata))
                        return true;
                usleep(10000);
        }
        return false;
}

bool harness_telemetry_lists(sd_bus *bus, const char *peer) {
        sd_bus_message *reply = NULL;
        const char *name;
        bool found = false;
        ck_assert_int_ge(sd_bus_call_method(bus, NULL, "/org/epd1/telemetry", "org.epd1.Telemetry", "GetPeers", NULL,
                                            &reply, NULL),
                         0);
        ck_assert_int_gt(sd_bus_message_enter_container(reply, 'a', "(sa{sv})"), 0);
        while (sd_bus_message_enter_container(reply, 'r', "sa{sv}") > 0) {
                ck_assert_int_ge(sd_bus_message_read(reply, "s", &name), 0);
                found = found || strcmp(name, peer) == 0;
                ck_assert_int_ge(sd_bus_message_skip(reply, "a{sv}"), 0);
                ck_assert_int_ge(sd_bus_message_exit_container(reply), 0);
        }
        sd_bus_message_unref(reply);
        return found;
}

uint64_t harness_handoff_counter(sd_bus *bus, const char *name) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        uint64_t found = UINT64_MAX;
        ck_assert_int_ge(sd_bus_get_property(bus, NULL, "/org/epd1/handoffs", "org.epd1.Handoffs", "Counters", &e,
                                             &reply, "a{st}"), 0);
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

int harness_direct_bus(Harness *h, sd_bus **ret) {
        sd_bus *bus = NULL;
        char addr[320];
        snprintf(addr, sizeof addr, "unix:path=%s", h->socket);
        int r = sd_bus_new(&bus);
        if (r >= 0)
                r = sd_bus_set_address(bus, addr);
        if (r >= 0)
                r = sd_bus_negotiate_fds(bus, true);
        if (r >= 0)
                r = sd_bus_start(bus);
        if (r < 0) {
                sd_bus_unref(bus);
                return r;
        }
        *ret = bus;
        return 0;
}

/* Whitespace-insensitive extraction of <interface name="X">...</interface>. */
static char *extract_interface(const char *xml, const char *name) {
        char open[256];
        snprintf(open, sizeof open, "<interface name=\"%s\">", name);
        const char *a = strstr(xml, open);
        if (!a)
                return NULL;
        const char *b = strstr(a, "</interface>");
        if (!b)
                return NULL;
        size_t len = (size_t)(b - a) + strlen("</interface>");
        char *out = malloc(len + 1), *o = out;
        if (!out)
                return NULL;
        bool in_comment = false;
        for (size_t i = 0; i < len; i++) {
                if (!in_comment && strncmp(a + i, "<!--", 4) == 0)
                        in_comment = true;
                if (in_comment) {
                        if (strncmp(a + i, "-->", 3) == 0) {
                                in_comment = false;
                                i += 2;
                        }
                        continue;
                }
                if (a[i] == ' ' || a[i] == '\n' || a[i] == '\t' || a[i] == '\r')
                        continue;
                *o++ = a[i];
        }
        *o = 0;
        return out;
}

int harness_check_introspection(sd_bus *bus, const char *destination, const char *path,
                                const char *xml_file) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const char *live;
        int r = sd_bus_call_method(bus, destination, path, "org.freedesktop.DBus.Introspectable",
                                   "Introspect", &e, &reply, NULL);
        if (r < 0) {
                fprintf(stderr, "Introspect %s: %s\n", path, e.message);
                sd_bus_error_free(&e);
                return r;
        }
        r = sd_bus_message_read(reply, "s", &live);
        if (r < 0) {
                sd_bus_message_unref(reply);
                return r;
        }
        FILE *f = fopen(xml_file, "re");
        if (!f) {
                sd_bus_message_unref(reply);
                return -errno;
        }
        char *file = NULL;
        size_t n = 0;
        ssize_t len = getdelim(&file, &n, 0, f);
        fclose(f);
        if (len < 0) {
                sd_bus_message_unref(reply);
                free(file);
                return -EIO;
        }
        const char *p = strstr(file, "<interface name=\"");
        char name[200] = { 0 };
        if (p)
                sscanf(p, "<interface name=\"%199[^\"]\"", name);
        char *want = name[0] ? extract_interface(file, name) : NULL;
        char *got = name[0] ? extract_interface(live, name) : NULL;
        r = want && got && strcmp(want, got) == 0 ? 0 : -EBADMSG;
        if (r < 0)
                fprintf(stderr, "Introspection of %s differs from %s for %s:\nfile: %s\nlive: %s\n",
                        path, xml_file, name, want ? want : "(none)", got ? got : "(none)");
        free(want);
        free(got);
        free(file);
        sd_bus_message_unref(reply);
        return r;
}

int harness_count_workers(sd_bus *bus, const char *destination) {
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        int r = sd_bus_get_property(bus, destination, "/org/epd1", "org.epd1.Manager", "Workers", &e,
                                    &reply, "a(osssu)");
        sd_bus_error_free(&e);
        if (r < 0)
                return r;
        int n = 0;
        r = sd_bus_message_enter_container(reply, 'a', "(osssu)");
        while (r >= 0 && (r = sd_bus_message_skip(reply, "(osssu)")) > 0)
                n++;
        sd_bus_message_unref(reply);
        return r < 0 ? r : n;
}

int harness_workers(Harness *h) {
        sd_bus *bus;
        int r = harness_raw_bus(h, &bus);
        if (r < 0)
                return r;
        r = harness_count_workers(bus, harness_destination(h));
        sd_bus_flush_close_unref(bus);
        return r;
}

void harness_start(Harness *h, bool over_bus, char *address, size_t n) {
        harness_start_preloaded(h, over_bus, address, n, NULL, NULL, NULL);
}

void harness_start_preloaded(Harness *h, bool over_bus, char *address, size_t n, const char *lib, const char *var,
                             const char *value) {
        if (over_bus) {
                int r = harness_start_bus(h);
                if (r == -ENOENT) {
                        printf("SKIP: dbus-daemon is not installed\n");
                        exit(77);
                }
                if (r < 0) {
                        fprintf(stderr, "Cannot start a private dbus-daemon: %s\n", strerror(-r));
                        exit(EXIT_FAILURE);
                }
                snprintf(address, n, "bus:%s", h->bus_address);
        } else
                harness_direct_address(h, address, n);
        int r = harness_start_epdd_preloaded(h, lib, var, value);
        if (r < 0) {
                fprintf(stderr, "Cannot start epdd: %s\n", strerror(-r));
                exit(EXIT_FAILURE);
        }
}

int harness_raw_bus(Harness *h, sd_bus **ret) {
        if (!h->bus_address[0])
                return harness_direct_bus(h, ret);
        sd_bus *bus = NULL;
        int r = sd_bus_new(&bus);
        if (r >= 0)
                r = sd_bus_set_address(bus, h->bus_address);
        if (r >= 0)
                r = sd_bus_set_bus_client(bus, true);
        if (r >= 0)
                r = sd_bus_start(bus);
        if (r < 0) {
                sd_bus_unref(bus);
                return r;
        }
        *ret = bus;
        return 0;
}

const char *harness_destination(const Harness *h) {
        return h->bus_address[0] ? "org.epd1" : NULL;
}
