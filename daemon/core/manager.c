/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/manager.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <inttypes.h>
#include <libgen.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <systemd/sd-daemon.h>
#include <systemd/sd-id128.h>
#include <unistd.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/bus-manager.h"
#include "core/fdstore.h"
#include "core/lockfile.h"
#include "core/manager-arenas.h"
#include "core/mappers.h"
#include "core/worker.h"
#include "log.h"
#include "macro.h"
#include "parse-util.h"
#include "time-util.h"

/* Subsystems, in start order (stopped in reverse): daemon/core/subsystem-list.h names
 * them, one SUBSYSTEM(name) line each; each defines `const Subsystem name_subsystem`
 * in its own file. */
#define SUBSYSTEM(n) extern const Subsystem n##_subsystem;
#include "core/subsystem-list.h"
#undef SUBSYSTEM

static const Subsystem *const subsystems[] = {
#define SUBSYSTEM(n) &n##_subsystem,
#include "core/subsystem-list.h"
#undef SUBSYSTEM
        NULL,
};

#define FOREACH_SUBSYSTEM(s)                                                             \
        for (const Subsystem *const *_sp = subsystems, *s; (s = *_sp); _sp++)

const Subsystem *const *manager_subsystems(void) {
        return subsystems;
}

uint64_t manager_pages_taken(Manager *m, const char *request_id, const Arena *a, int64_t n) {
        uint64_t counted = 0;
        FOREACH_SUBSYSTEM(s)
                if (s->pages_taken)
                        counted += s->pages_taken(m, request_id, a, n);
        return counted;
}

/* A direct (peer-to-peer) connection on the daemon's socket. It is keyed by its serial,
 * never by the address of its sd_bus: an address is reused by the next allocation as
 * soon as a bus is freed, so a table keyed by it can confuse a new connection with one
 * that just went away (and refuse or drop the new one). The bus carries its serial in
 * its description ("d/<serial>"), and the Disconnected handler is given its own
 * Connection, so neither direction needs an address lookup. */
typedef struct Connection {
        uint64_t serial; /* the hashmap key */
        sd_bus *bus;
        Manager *manager;
        bool subscribed; /* Manager.Subscribe(true): gets the broadcast signals */
        bool stalled;    /* stopped reading: dropped on the next turn (emit_each) */
        /* Past MaxClients=: served no object, every call answered LimitExceeded, and
         * closed after REFUSED_LINGER_USEC if the client does not close it first. */
        bool refused;
        sd_event_source *linger;
} Connection;

/* Connections past MaxClients= that are told why (at most this many at once; past
 * them a connection is closed as it comes), and how long each is kept. */
#define REFUSED_CONNECTIONS_MAX 16U
#define REFUSED_LINGER_USEC (5 * USEC_PER_SEC)

/* Messages queued to a direct connection (its socket full) past which a subscriber is
 * taken for one that stopped reading. */
#define CONNECTION_QUEUE_MAX 4096U

static Connection *connection_free(Connection *c) {
        if (!c)
                return NULL;
        if (c->manager) {
                Hashmap *map = c->refused ? c->manager->refused : c->manager->connections;
                if (hashmap_get(map, &c->serial) == c)
                        hashmap_remove(map, &c->serial);
        }
        c->linger = sd_event_source_disable_unref(c->linger);
        if (c->bus) {
                /* What the socket took went out; what is queued beyond it is dropped, not
                 * waited for: sd_bus_flush() would wait for ever for a client that stopped
                 * reading, and hold up the stop (or this loop) with it. */
                uint64_t n = 0;
                if (sd_bus_get_n_queued_write(c->bus, &n) >= 0 && n > 0)
                        log_debug("Closing a direct connection with %" PRIu64 " message(s) it did not read.", n);
                sd_bus_detach_event(c->bus);
                sd_bus_close_unref(c->bus);
        }
        free(c);
        return NULL;
}

static void connection_freep(Connection **c) {
        connection_free(*c);
}

static void connection_drop(Connection *conn) {
        char key[64];
        snprintf(key, sizeof key, "d/%" PRIu64, conn->serial);
        Client *c = hashmap_get(conn->manager->clients, key);
        if (c)
                client_gone(c);
        connection_free(conn);
}

uint64_t manager_connection_serial(Manager *m, sd_bus *bus) {
        const char *d;
        uint64_t serial;
        if (!bus || bus == m->bus || sd_bus_get_description(bus, &d) < 0 || strncmp(d, "d/", 2) != 0 ||
            parse_u64(d + 2, &serial) < 0)
                return 0;
        /* Only a connection that is still served: a message that outlived its
         * connection's end (a deferred reply, say) names no client. */
        Connection *conn = hashmap_get(m->connections, &serial);
        return conn && conn->bus == bus ? serial : 0;
}

int manager_connection_subscribe(Manager *m, sd_bus *bus, bool enable) {
        uint64_t serial = manager_connection_serial(m, bus);
        if (serial == 0)
                return 0; /* the bus: its match rules decide who gets what */
        Connection *conn = hashmap_get(m->connections, &serial);
        if (!conn)
                return -ENOTCONN;
        conn->subscribed = enable;
        return 1;
}

static int on_direct_disconnected(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Connection *conn = userdata;
        log_debug("Direct connection %" PRIu64 " closed.", conn->serial);
        connection_drop(conn);
        return 0;
}

static int manager_add_bus_objects(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_argument_check(bus);
        if (r < 0)
                return log_error_errno(r, "Failed to add the argument check: %m");
        r = bus_manager_add(m, bus);
        if (r < 0)
                return r;
        FOREACH_SUBSYSTEM(s)
                if (s->add_bus) {
                        r = s->add_bus(m, bus);
                        if (r < 0)
                                return log_error_errno(r, "Failed to add %s bus objects: %m", s->name);
                }
        return 0;
}

/* A refused connection's every call: why, by name (libepd: EDQUOT). */
static int on_refused_message(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Connection *conn = userdata;
        uint8_t type = 0;

        if (sd_bus_message_get_type(msg, &type) < 0 || type != SD_BUS_MESSAGE_METHOD_CALL)
                return 0;
        (void)sd_bus_reply_method_errorf(msg, EPD_ERROR_LIMIT_EXCEEDED,
                                         "epdd serves at most %u clients at once ([Limits] MaxClients=), and "
                                         "that many are connected: this connection is refused. Retry later, "
                                         "or raise MaxClients=.",
                                         conn->manager->config.max_clients);
        return 1;
}

static int on_refused_linger(sd_event_source *s, uint64_t usec, void *userdata) {
        Connection *conn = userdata;
        log_debug("Closing refused direct connection %" PRIu64 ".", conn->serial);
        connection_free(conn);
        return 0;
}

/* Sets up the server side of an accepted socket; takes fd in every case. On failure,
 * everything made so far is freed with the Connection (the caller's cleanup). A
 * refused connection (conn->refused) gets no object: every call is answered
 * LimitExceeded until it closes or lingered REFUSED_LINGER_USEC. */
static int connection_setup(Connection *conn, int fd) {
        Manager *m = conn->manager;
        char desc[32];
        sd_id128_t id;
        int r;

        r = sd_id128_randomize(&id);
        if (r >= 0)
                r = sd_bus_new(&conn->bus);
        if (r < 0) {
                safe_close(fd);
                return r;
        }
        r = sd_bus_set_fd(conn->bus, fd, fd);
        if (r < 0) {
                safe_close(fd);
                return r;
        }
        snprintf(desc, sizeof desc, "d/%" PRIu64, conn->serial);
        r = sd_bus_set_description(conn->bus, desc);
        if (r >= 0)
                r = sd_bus_set_server(conn->bus, true, id);
        if (r >= 0)
                r = sd_bus_negotiate_fds(conn->bus, true);
        if (r >= 0)
                r = sd_bus_set_anonymous(conn->bus, false);
        if (r >= 0)
                r = sd_bus_match_signal(conn->bus, NULL, "org.freedesktop.DBus.Local",
                                        "/org/freedesktop/DBus/Local",
                                        "org.freedesktop.DBus.Local", "Disconnected",
                                        on_direct_disconnected, conn);
        if (r >= 0)
                r = conn->refused ? sd_bus_add_filter(conn->bus, NULL, on_refused_message, conn)
                                  : manager_add_bus_objects(m, conn->bus);
        if (r >= 0 && conn->refused)
                r = sd_event_add_time_relative(m->event, &conn->linger, CLOCK_MONOTONIC, REFUSED_LINGER_USEC, 0,
                                               on_refused_linger, conn);
        if (r >= 0)
                r = sd_bus_start(conn->bus);
        if (r >= 0)
                r = hashmap_put(conn->refused ? m->refused : m->connections, &conn->serial, conn);
        if (r >= 0)
                r = sd_bus_attach_event(conn->bus, m->event, SD_EVENT_PRIORITY_NORMAL);
        /* Not flushed and closed by sd-bus when the loop exits (that flush has no
         * timeout): connection_free() closes it. */
        if (r >= 0)
                r = sd_bus_set_close_on_exit(conn->bus, false);
        return r;
}

static int on_direct_connection(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Manager *m = userdata;
        _cleanup_(closep) int cfd = accept4(fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (cfd < 0) {
                if (errno != EAGAIN && errno != EINTR)
                        log_warning_errno(errno, "accept() on the direct socket failed: %m");
                return 0;
        }
        bool refuse = hashmap_size(m->connections) >= m->config.max_clients;
        if (refuse && hashmap_size(m->refused) >= REFUSED_CONNECTIONS_MAX) {
                log_warning("Refusing direct connection: %u clients already connected (MaxClients=), and "
                            "%u more being told so; closed.",
                            m->config.max_clients, REFUSED_CONNECTIONS_MAX);
                return 0;
        }
        if (refuse)
                log_warning("Refusing direct connection: %u clients already connected (MaxClients=); its "
                            "calls are answered LimitExceeded.",
                            m->config.max_clients);
        _cleanup_(connection_freep) Connection *conn = calloc(1, sizeof *conn);
        if (!conn) {
                log_oom();
                return 0;
        }
        conn->manager = m;
        conn->refused = refuse;
        conn->serial = ++m->next_serial;
        int r = connection_setup(conn, TAKE_FD(cfd));
        if (r < 0) {
                log_warning_errno(r, "Failed to set up direct connection %" PRIu64 ": %m", conn->serial);
                return 0;
        }
        Connection *c = TAKE_PTR(conn); /* the map owns it; its Disconnected frees it */
        log_debug("Direct connection %" PRIu64 " accepted.", c->serial);
        return 0;
}

static int mkdir_parents(const char *path, mode_t mode) {
        _cleanup_(freep) char *p = strdup(path);
        if (!p)
                return -ENOMEM;
        for (char *s = p + 1; (s = strchr(s, '/')); s++) {
                *s = 0;
                if (mkdir(p, mode) < 0 && errno != EEXIST)
                        return -errno;
                *s = '/';
        }
        return 0;
}

/* Gives path (the socket or its directory) the socket's group. Refused (EPERM: epdd
 * is neither root nor a member), SocketGroup= is an error; the default group epd is
 * not, and path keeps the daemon's group. */
static int manager_chgrp_socket(Manager *m, const char *path) {
        const char *name = m->config.socket_group ?: EPD_GROUP;
        if (m->socket_gid == (gid_t)-1 ||
            fchownat(AT_FDCWD, path, (uid_t)-1, m->socket_gid, AT_SYMLINK_NOFOLLOW) >= 0)
                return 0;
        if (errno == EPERM && !m->config.socket_group) {
                log_notice_errno(errno, "Cannot give %s group %s (%m): it keeps the daemon's group.", path, name);
                return 0;
        }
        return log_error_errno(errno, "Cannot give %s group %s: %m", path, name);
}

/* The direct socket appears at its path only once it listens: it is bound under a
 * temporary name in the same directory (<path>.<pid>), given its group, put to listen,
 * and renamed onto the path. A client (or a script) that sees the path can connect
 * at once; bound at the path itself, a connect() between bind() and listen() was
 * refused (ECONNREFUSED), and a caller waiting for the file raced the daemon. A
 * stale socket at the path (a previous run's) is replaced by the rename; any other
 * kind of file there is an error, never removed. */
static int manager_listen_direct(Manager *m) {
        const char *path = m->config.socket_path;
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        char tmp[sizeof sa.sun_path];
        struct stat st;

        if (strlen(path) >= sizeof sa.sun_path)
                return log_error_errno(ENAMETOOLONG, "Socket path %s is too long.", path);
        int n = snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid());
        if (n < 0 || (size_t)n >= sizeof tmp)
                return log_error_errno(ENAMETOOLONG, "Socket path %s is too long for its temporary name %s.<pid> "
                                       "(at most %zu characters with it).", path, path, sizeof tmp - 1);
        strcpy(sa.sun_path, tmp);

        int r = mkdir_parents(path, 0755);
        if (r < 0)
                return log_error_errno(r, "Cannot create the directory of %s: %m", path);
        if (lstat(path, &st) == 0 && !S_ISSOCK(st.st_mode))
                return log_error_errno(EEXIST, "Cannot serve the direct socket %s: a file that is not a socket "
                                       "is there.", path);
        _cleanup_(closep) int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
                return log_error_errno(errno, "socket(): %m");
        /* A temporary name left by a daemon of this pid that died between bind() and
         * rename(): only a socket is removed. */
        if (lstat(tmp, &st) == 0 && S_ISSOCK(st.st_mode))
                (void)unlink(tmp);
        mode_t old = umask(0117); /* rw for owner and group (epd) */
        r = bind(fd, (struct sockaddr *)&sa, sizeof sa);
        umask(old);
        if (r < 0)
                return log_error_errno(errno, "Cannot bind the direct socket %s: %m", tmp);
        /* The group whose members may connect (docs/security.md), however epdd was
         * started: as root by hand the socket would otherwise be root's. */
        r = manager_chgrp_socket(m, tmp);
        if (r >= 0 && listen(fd, SOMAXCONN) < 0)
                r = log_error_errno(errno, "listen() on %s: %m", tmp);
        if (r >= 0 && rename(tmp, path) < 0)
                r = log_error_errno(errno, "Cannot rename the direct socket %s to %s: %m", tmp, path);
        if (r < 0) {
                (void)unlink(tmp);
                return r;
        }
        r = sd_event_add_io(m->event, &m->direct_source, fd, EPOLLIN, on_direct_connection, m);
        if (r < 0) {
                (void)unlink(path);
                return log_error_errno(r, "Cannot watch the direct socket: %m");
        }
        m->direct_fd = TAKE_FD(fd);
        log_info("Serving the direct socket %s.", path);
        return 0;
}

static int manager_connect_bus(Manager *m) {
        int r;
        if (!m->config.bus_address && !m->config.system_bus)
                return 0;
        if (m->config.bus_address) {
                r = sd_bus_new(&m->bus);
                if (r >= 0)
                        r = sd_bus_set_address(m->bus, m->config.bus_address);
                if (r >= 0)
                        r = sd_bus_set_bus_client(m->bus, true);
                if (r >= 0)
                        r = sd_bus_negotiate_fds(m->bus, true);
                if (r >= 0)
                        r = sd_bus_negotiate_creds(m->bus, true, SD_BUS_CREDS_PID | SD_BUS_CREDS_EUID);
                if (r >= 0)
                        r = sd_bus_start(m->bus);
        } else
                r = sd_bus_open_system(&m->bus);
        if (r < 0) {
                m->bus = sd_bus_unref(m->bus);
                if (m->config.bus_address)
                        return log_error_errno(r, "Cannot connect to the bus at %s: %m",
                                               m->config.bus_address);
                log_notice_errno(r, "No system bus (%m); serving the direct socket only.");
                return 0;
        }
        r = manager_add_bus_objects(m, m->bus);
        if (r < 0)
                return r;
        r = sd_bus_request_name(m->bus, "org.epd1", 0);
        if (r < 0) {
                log_error_errno(r, "Cannot own the name org.epd1 on the %s bus: %m",
                                m->config.bus_address ? "configured" : "system");
                if (m->config.bus_address)
                        return r;
                /* The system bus refused (no policy installed, say): go on directly. */
                m->bus = sd_bus_flush_close_unref(m->bus);
                return 0;
        }
        r = sd_bus_attach_event(m->bus, m->event, SD_EVENT_PRIORITY_NORMAL);
        if (r < 0)
                return log_error_errno(r, "Cannot attach the bus to the event loop: %m");
        log_info("Owning org.epd1 on the %s bus.", m->config.bus_address ? "configured" : "system");
        return 0;
}

static int on_signal(sd_event_source *s, const struct signalfd_siginfo *si, void *userdata) {
        Manager *m = userdata;
        if (si->ssi_signo == SIGHUP) {
                (void)manager_reload(m);
                return 0;
        }
        log_info("Received %s, stopping.", strsignal((int)si->ssi_signo));
        (void)sd_notify(false, "STOPPING=1\nSTATUS=Stopping.");
        return sd_event_exit(sd_event_source_get_event(s), 0);
}

static int host_id_default(char **ret) {
        char buf[256] = { 0 };
        FILE *f = fopen("/etc/machine-id", "re");
        if (f) {
                if (fgets(buf, sizeof buf, f))
                        buf[strcspn(buf, "\n")] = 0;
                fclose(f);
        }
        if (strlen(buf) < 8 && gethostname(buf, sizeof buf - 1) < 0)
                snprintf(buf, sizeof buf, "localhost");
        if (strlen(buf) > 63)
                buf[63] = 0;
        *ret = strdup(buf);
        return *ret ? 0 : -ENOMEM;
}

int manager_new(Manager **ret, const char *config_path) {
        _cleanup_(freep) Manager *m = calloc(1, sizeof *m);
        int r;
        if (!m)
                return log_oom();
        m->direct_fd = m->socket_lock_fd = m->state_lock_fd = -EBADF;
        m->socket_gid = (gid_t)-1;
        m->cmdline = (ManagerCmdline){ .log_level = -1, .system_bus = -1 };
        r = config_defaults(&m->config);
        if (r < 0)
                return log_oom();
        if (config_path || access(EPD_CONFIG_FILE, F_OK) == 0) {
                const char *path = config_path ?: EPD_CONFIG_FILE;
                char *errors = NULL;
                r = config_parse_file(&m->config, path, &errors);
                if (r < 0) {
                        if (errors)
                                log_error("Invalid configuration:\n%s", errors);
                        else
                                log_error_errno(r, "Cannot read configuration %s: %m", path);
                        free(errors);
                        config_done(&m->config);
                        return r;
                }
                m->config_path = strdup(path);
                if (!m->config_path) {
                        config_done(&m->config);
                        return log_oom();
                }
        }
        m->clients = hashmap_new(HASHMAP_KEY_STRING, 0);
        m->workers = hashmap_new(HASHMAP_KEY_STRING, 0);
        m->connections = hashmap_new(HASHMAP_KEY_U64, 0);
        m->refused = hashmap_new(HASHMAP_KEY_U64, 0);
        if (!m->clients || !m->workers || !m->connections || !m->refused) {
                manager_free(TAKE_PTR(m));
                return log_oom();
        }
        /* A loop of its own, not sd_event_default(): the default loop checks its thread
         * with a gettid() system call on every turn (one per dispatched event). */
        r = sd_event_new(&m->event);
        if (r < 0) {
                manager_free(TAKE_PTR(m));
                return log_error_errno(r, "Cannot allocate the event loop: %m");
        }
        *ret = TAKE_PTR(m);
        return 0;
}

/* The socket's directory: mode 0750 and the socket's group, so that members of the
 * group (and nobody else) can reach the socket; docs/security.md. Made here; *ret_own:
 * it is this daemon's to give its group and mode (made now, or the default runtime
 * directory /run/epd owned by this user, as an earlier epdd started by hand may have
 * left it; any other directory that already exists is the administrator's and is left
 * as it is). That is done only once the socket's lock is taken
 * (manager_own_socket_dir()): a second epdd refused the lock changes nothing of the
 * first's. */
static int manager_make_socket_dir(Manager *m, bool *ret_own) {
        const char *path = m->config.socket_path;
        _cleanup_(freep) char *d = strdup(path), *d_default = strdup(EPD_SOCKET_PATH);
        struct stat st;
        int r;

        *ret_own = false;
        if (!d || !d_default)
                return log_oom();
        const char *dir = dirname(d), *dir_default = dirname(d_default);
        r = mkdir_parents(dir, 0755);
        if (r < 0)
                return log_error_errno(r, "Cannot create the directory of %s: %m", path);
        bool made = mkdir(dir, 0750) == 0;
        if (!made && errno != EEXIST)
                return log_error_errno(errno, "Cannot create the directory of %s: %m", path);
        *ret_own = made || (strcmp(dir, dir_default) == 0 && stat(dir, &st) >= 0 && S_ISDIR(st.st_mode) &&
                            st.st_uid == geteuid());
        return 0;
}

static int manager_own_socket_dir(Manager *m) {
        _cleanup_(freep) char *d = strdup(m->config.socket_path);
        int r;

        if (!d)
                return log_oom();
        const char *dir = dirname(d);
        r = manager_chgrp_socket(m, dir);
        if (r < 0)
                return r;
        /* Not the umask's: exactly 0750. */
        if (chmod(dir, 0750) < 0)
                return log_error_errno(errno, "Cannot make %s mode 0750: %m", dir);
        return 0;
}

/* SocketGroup=, or group epd where it exists; a SocketGroup= that does not exist is an
 * error. Without either, the socket keeps epdd's own group (root's, started by hand). */
static int manager_resolve_socket_group(Manager *m) {
        const char *name = m->config.socket_group ?: EPD_GROUP;
        struct group grp, *g = NULL;
        char buf[16384];
        int r = getgrnam_r(name, &grp, buf, sizeof buf, &g);

        m->socket_gid = (gid_t)-1;
        if (r == 0 && g) {
                m->socket_gid = g->gr_gid;
                return 0;
        }
        if (m->config.socket_group) {
                if (r != 0)
                        return log_error_errno(r, "[Daemon] SocketGroup=%s: cannot look the group up: %m", name);
                return log_error_errno(ENOENT, "[Daemon] SocketGroup=%s: no such group.", name);
        }
        log_debug("No group %s: the direct socket keeps the daemon's group.", name);
        return 0;
}

/* What arena_new_host() refuses of a host arena's size, without making it. */
static int manager_verify_arenas(Manager *m) {
        for (size_t i = 0; i < m->config.n_arenas; i++) {
                const ArenaConfig *c = &m->config.arenas[i];
                uint64_t size;
                int r;
                if (c->domain != MEMORY_HOST)
                        continue;
                r = arena_size_round(c->size, 4096, &size); /* arena.c: HOST_PAGE */
                if (r < 0)
                        return log_error_errno(r, "Arena '%s': Size=%" PRIu64 " is out of range: %m", c->name, c->size);
        }
        return 0;
}

int manager_verify(Manager *m) {
        int r;
        if (!m->config.host_id) {
                r = host_id_default(&m->config.host_id);
                if (r < 0)
                        return log_oom();
        }
        /* A subsystem listed twice would register its bus objects twice and make every
         * connection fail: refuse to start instead. */
        for (size_t i = 0; subsystems[i]; i++)
                for (size_t j = i + 1; subsystems[j]; j++)
                        if (subsystems[i] == subsystems[j])
                                return log_error_errno(EINVAL, "Subsystem %s is listed twice in subsystem-list.h.",
                                                       subsystems[i]->name);
        r = manager_resolve_socket_group(m);
        if (r < 0)
                return r;
        r = manager_verify_arenas(m);
        if (r < 0)
                return r;
        FOREACH_SUBSYSTEM(s)
                if (s->verify) {
                        r = s->verify(m);
                        if (r < 0)
                                return r; /* logged */
                }
        return 0;
}

/* One daemon per socket and per state directory (core/lockfile.h). Taken before any
 * arena is made or any file of the state directory opened, so that a second epdd
 * started on the same socket or directory changes nothing of the first. */
static int manager_take_locks(Manager *m) {
        _cleanup_(freep) char *sock_lock = NULL, *state_lock = NULL;
        pid_t holder = 0;
        int r;

        if (asprintf(&sock_lock, "%s.lock", m->config.socket_path) < 0 ||
            asprintf(&state_lock, "%s/epdd.lock", m->config.state_dir) < 0)
                return log_oom();
        bool own_dir;
        r = manager_make_socket_dir(m, &own_dir);
        if (r < 0)
                return r;
        r = lockfile_take(sock_lock, &holder);
        if (r == -EBUSY) {
                if (holder > 0)
                        log_error("Socket %s is served by another epdd (pid %d): refusing to start. Stop that "
                                  "daemon first, or give this one its own --socket= and StateDirectory=.",
                                  m->config.socket_path, (int)holder);
                else
                        log_error("Socket %s is served by another epdd (its pid is not visible here): refusing "
                                  "to start. Stop that daemon first, or give this one its own --socket= and "
                                  "StateDirectory=.", m->config.socket_path);
                return -EBUSY;
        }
        if (r < 0)
                return log_error_errno(r, "Cannot lock %s: %m", sock_lock);
        m->socket_lock_fd = r;
        if (own_dir) {
                r = manager_own_socket_dir(m);
                if (r < 0)
                        return r;
        }

        /* Under systemd, StateDirectory= made it; elsewhere make it (one level). */
        if (mkdir(m->config.state_dir, 0755) < 0 && errno != EEXIST)
                return log_error_errno(errno, "Cannot create the state directory %s: %m", m->config.state_dir);
        holder = 0;
        r = lockfile_take(state_lock, &holder);
        if (r == -EBUSY) {
                log_error("State directory %s is in use by another epdd (pid %d): two daemons never share a "
                          "WAL. Give this one its own StateDirectory=.", m->config.state_dir, (int)holder);
                return -EBUSY;
        }
        if (r < 0)
                return log_error_errno(r, "Cannot lock %s: %m", state_lock);
        m->state_lock_fd = r;
        return 0;
}

int manager_startup(Manager *m) {
        int r;
        m->started_usec = now_usec(CLOCK_REALTIME);
        log_set_max_level(m->config.log_level);
        /* The very checks `epdd --check-config` runs, before anything is made. */
        r = manager_verify(m);
        if (r < 0)
                return r;
        (void)epd_bus_error_register();

        sigset_t mask;
        sigemptyset(&mask);
        sigaddset(&mask, SIGTERM);
        sigaddset(&mask, SIGINT);
        sigaddset(&mask, SIGHUP);
        sigprocmask(SIG_BLOCK, &mask, NULL);
        (void)signal(SIGPIPE, SIG_IGN);
        if ((r = sd_event_add_signal(m->event, &m->sigterm, SIGTERM, on_signal, m)) < 0 ||
            (r = sd_event_add_signal(m->event, &m->sigint, SIGINT, on_signal, m)) < 0 ||
            (r = sd_event_add_signal(m->event, &m->sighup, SIGHUP, on_signal, m)) < 0)
                return log_error_errno(r, "Cannot watch signals: %m");

        r = manager_take_locks(m);
        if (r < 0)
                return r;
        r = manager_setup_arenas(m);
        if (r < 0)
                return r;

        FOREACH_SUBSYSTEM(s)
                if (s->init) {
                        r = s->init(m);
                        if (r < 0)
                                return log_error_errno(r, "Cannot start %s: %m", s->name);
                }
        /* The journal is replayed: fresh host arenas go into the fd store, and workers
         * of before that still run fence what they may use, before any call is served. */
        manager_store_fresh_arenas(m);
        r = mappers_start(m);
        if (r < 0)
                return r;

        r = manager_listen_direct(m);
        if (r < 0)
                return r;
        r = manager_connect_bus(m);
        if (r < 0)
                return r;

        /* Pings the watchdog from the loop itself when WATCHDOG_USEC is set. */
        r = sd_event_set_watchdog(m->event, true);
        if (r < 0)
                log_warning_errno(r, "Cannot enable the watchdog: %m");
        return 0;
}

static void manager_after_dispatch(Manager *m) {
        FOREACH_SUBSYSTEM(s)
                if (s->after_dispatch)
                        s->after_dispatch(m);
}

/* The wait's timeout: until the earliest time a before_wait hook asked for. */
static uint64_t manager_before_wait(Manager *m) {
        uint64_t until = UINT64_MAX;
        FOREACH_SUBSYSTEM(s)
                if (s->before_wait) {
                        uint64_t u = s->before_wait(m);
                        until = MIN(until, u);
                }
        if (until == UINT64_MAX)
                return UINT64_MAX;
        uint64_t now = now_usec(CLOCK_MONOTONIC);
        return until > now ? until - now : 0;
}

/* A dispatch that began at t0 (CLOCK_MONOTONIC) is over: a stall if it took
 * MANAGER_STALL_USEC or longer, named by the bus call that took as long if one did (the
 * glue's generation moved past gen). Two clock reads per dispatch, no system call. */
static void manager_note_dispatch(Manager *m, uint64_t t0, uint64_t gen) {
        uint64_t d = now_usec(CLOCK_MONOTONIC) - t0;
        if (d < MANAGER_STALL_USEC)
                return;
        const char *what = bus_glue_slow_generation() != gen ? bus_glue_slow_what() : "an event source";
        m->loop_stalls++;
        if (d <= m->loop_stall_max_usec) {
                log_debug("The event loop was busy for %" PRIu64 " us with %s.", d, what);
                return;
        }
        m->loop_stall_max_usec = d;
        m->loop_stall_max_at = now_usec(CLOCK_REALTIME);
        snprintf(m->loop_stall_max_what, sizeof m->loop_stall_max_what, "%s", what);
        /* A new longest one: rare by construction, so worth a line. */
        log_full(d >= 100 * MANAGER_STALL_USEC ? LOG_WARNING : LOG_INFO,
                 "The event loop was busy for %" PRIu64 ".%03" PRIu64 " ms with %s: every other call waited (the longest so far).",
                 d / 1000, d % 1000, what);
}

/* sd_event_loop(), made of sd_event_run()'s steps so that the subsystems' hooks run in
 * between: before_wait when nothing is pending and the loop is about to wait (the wait
 * ends by the time they ask), after_dispatch after every dispatch (sd_event_run()
 * dispatches one event source, or the exit sources, each time) and after a wait that
 * timed out. What a callback queued for right after itself is done then, without a
 * defer source's extra turn (an epoll_wait each), and a deadline needs no timer.
 * Returns as sd_event_loop() does: a negative errno of a step, or the code given to
 * sd_event_exit(). */
static int manager_loop(Manager *m) {
        _cleanup_(sd_event_unrefp) sd_event *e = sd_event_ref(m->event); /* as sd_event_loop() */
        int r, code = 0;

        m->in_loop = true;
        while (sd_event_get_state(e) != SD_EVENT_FINISHED) {
                r = sd_event_prepare(e);
                if (r == 0)
                        r = sd_event_wait(e, manager_before_wait(m));
                uint64_t t0 = now_usec(CLOCK_MONOTONIC), gen = bus_glue_slow_generation();
                if (r > 0)
                        r = sd_event_dispatch(e);
                manager_after_dispatch(m);
                manager_note_dispatch(m, t0, gen);
                if (r < 0) {
                        m->in_loop = false;
                        return r;
                }
        }
        m->in_loop = false;
        r = sd_event_get_exit_code(e, &code);
        return r < 0 ? r : code;
}

int manager_run(Manager *m) {
        char status[512];
        /* Asked to stop while starting (the signals were blocked since: a long replay,
         * arenas of huge pages, the bus name): never READY=1 after that. */
        sigset_t pending;
        if (sigpending(&pending) == 0 && (sigismember(&pending, SIGTERM) == 1 || sigismember(&pending, SIGINT) == 1)) {
                log_info("Asked to stop while starting: stopping without serving.");
                (void)sd_notify(false, "STOPPING=1\nSTATUS=Stopping.");
                return 0;
        }
        snprintf(status, sizeof status,
                 "READY=1\nSTATUS=Serving %zu arena(s) on %s%s (host %s).", m->n_arenas,
                 m->config.socket_path, m->bus ? " and the bus" : "", m->config.host_id);
        (void)sd_notify(false, status);
        m->ready_sent = true;
        int r = manager_loop(m);
        (void)sd_notify(false, "STOPPING=1\nSTATUS=Stopping.");
        return r;
}

static int replace_str(char **dst, const char *v) {
        if (!v)
                return 0;
        char *n = strdup(v);
        if (!n)
                return -ENOMEM;
        free(*dst);
        *dst = n;
        return 0;
}

int manager_apply_cmdline(Manager *m, Config *c) {
        const ManagerCmdline *o = &m->cmdline;
        if (replace_str(&c->bus_address, o->bus_address) < 0 || replace_str(&c->socket_path, o->socket) < 0 ||
            replace_str(&c->host_id, o->host_id) < 0 || replace_str(&c->state_dir, o->state_dir) < 0)
                return -ENOMEM;
        if (o->log_level >= 0)
                c->log_level = o->log_level;
        if (o->system_bus >= 0)
                c->system_bus = o->system_bus;
        return 0;
}

/* The checks start-up runs (manager_verify()), on the new configuration n: a reload is
 * refused for what a start would refuse (a cluster key others may read, a SocketGroup=
 * that does not exist, ...). Fills in n's defaults as start-up would (its host id). */
static int reload_verify(Manager *m, Config *n) {
        Config running = m->config;
        gid_t gid = m->socket_gid;
        m->config = *n;
        int r = manager_verify(m);
        *n = m->config;
        m->config = running;
        m->socket_gid = gid;
        return r;
}

int manager_reload(Manager *m) {
        Config n;
        char *errors = NULL;
        int r;
        (void)sd_notify(false, "RELOADING=1\nSTATUS=Reloading configuration.");
        /* Started without a file, and one was made since: it is the one to read now. */
        if (!m->config_path && access(EPD_CONFIG_FILE, F_OK) == 0 && !(m->config_path = strdup(EPD_CONFIG_FILE)))
                log_oom();
        if (!m->config_path) {
                log_info("SIGHUP: running on embedded defaults, nothing to reload.");
                (void)sd_notify(false, "READY=1\nSTATUS=Serving.");
                return 0;
        }
        r = config_defaults(&n);
        if (r >= 0)
                r = config_parse_file(&n, m->config_path, &errors);
        if (r < 0) {
                if (errors)
                        log_error("Reload refused, keeping the running configuration:\n%s", errors);
                else
                        log_error_errno(r, "Reload refused: cannot read %s: %m", m->config_path);
                free(errors);
                config_done(&n);
                (void)sd_notify(false, "READY=1\nSTATUS=Serving (reload refused).");
                return r;
        }
        r = manager_apply_cmdline(m, &n);
        if (r < 0) {
                config_done(&n);
                (void)sd_notify(false, "READY=1\nSTATUS=Serving (reload refused).");
                return log_oom();
        }
        r = reload_verify(m, &n);
        if (r < 0) {
                log_error("Reload refused, keeping the running configuration: %s does not pass the checks "
                          "start-up runs (said above).", m->config_path);
                config_done(&n);
                (void)sd_notify(false, "READY=1\nSTATUS=Serving (reload refused).");
                return r;
        }
        /* Reloadable: log level, limits, subsystem settings. The rest needs a restart;
         * say so instead of silently ignoring a change. */
        unsigned pending = config_restart_notices(&m->config, &n);
        char failed[128] = "";
        FOREACH_SUBSYSTEM(s)
                if (s->reload) {
                        r = s->reload(m, &n);
                        if (r < 0) { /* said in the status too: "reloaded" alone would hide it */
                                log_warning_errno(r, "%s: reload failed, keeping its settings: %m", s->name);
                                size_t l = strlen(failed);
                                (void)snprintf(failed + l, sizeof failed - l, "%s%s", l ? ", " : "", s->name);
                        } else
                                pending += (unsigned)r; /* changes it can only take at a restart (said) */
                }
        m->config.log_level = n.log_level;
        log_set_max_level(n.log_level);
        m->config.max_clients = n.max_clients;
        m->config.max_workers = n.max_workers;
        m->config.max_objects_per_client = n.max_objects_per_client;
        m->config.max_request_bytes = n.max_request_bytes;
        m->config.max_requests_per_client = n.max_requests_per_client;
        m->config.workflow_token_bytes = n.workflow_token_bytes; /* workflows_reload() applied it */
        m->config.handoff_pipeline_bytes = n.handoff_pipeline_bytes;
        m->config.heartbeat_usec = n.heartbeat_usec;
        m->config.handoff_timeout_usec = n.handoff_timeout_usec;
        m->config.feature_cache_bytes = n.feature_cache_bytes;
        m->config.feature_read_back_timeout_usec = n.feature_read_back_timeout_usec; /* read at each Acquire */
        m->config.feature_produce_timeout_usec = n.feature_produce_timeout_usec; /* feature_reload() applied it */
        m->config.gpu_merge_groups = n.gpu_merge_groups; /* read at each handoff_pump() */
        m->config.gpu_batches_in_flight = n.gpu_batches_in_flight;
        m->config.gpu_completion_spin_usec = n.gpu_completion_spin_usec; /* gpu_reload() applied these */
        m->config.gpu_strided_copies = n.gpu_strided_copies;
        /* Read by the handoff window and the scheduler's path pressure, not only by
         * telemetry (whose reload took its own copy above). */
        m->config.telemetry.backpressure = n.telemetry.backpressure;
        config_done(&n);
        if (failed[0]) {
                log_warning("Configuration reloaded from %s, except %s (kept its settings, said above).",
                            m->config_path, failed);
                (void)sd_notifyf(false, "READY=1\nSTATUS=Serving (configuration reloaded, except %s).", failed);
                return 0;
        }
        log_info("Configuration reloaded from %s%s.", m->config_path,
                 pending ? "; some changes take effect at the next restart (said above)" : "");
        (void)sd_notify(false, pending ? "READY=1\nSTATUS=Serving (configuration reloaded; some changes need a restart)."
                                       : "READY=1\nSTATUS=Serving (configuration reloaded).");
        return 0;
}

Manager *manager_free(Manager *m) {
        if (!m)
                return NULL;
        /* What the daemon drops while stopping stays in the WAL for the next start. */
        m->stopping = true;
        /* Clients first: their objects refer to subsystems and arenas. */
        if (m->clients) {
                Client *c;
                size_t it = 0;
                while ((it = 0, hashmap_iterate(m->clients, &it, (void **)&c, NULL)))
                        client_free(c);
        }
        if (m->connections) {
                Connection *conn;
                size_t it = 0;
                while ((it = 0, hashmap_iterate(m->connections, &it, (void **)&conn, NULL)))
                        connection_free(conn);
        }
        if (m->refused) {
                Connection *conn;
                size_t it = 0;
                while ((it = 0, hashmap_iterate(m->refused, &it, (void **)&conn, NULL)))
                        connection_free(conn);
        }
        size_t n = 0;
        FOREACH_SUBSYSTEM(s)
                n++;
        for (size_t i = n; i > 0; i--)
                if (subsystems[i - 1]->done)
                        subsystems[i - 1]->done(m);
        m->bus = sd_bus_flush_close_unref(m->bus);
        m->direct_source = sd_event_source_disable_unref(m->direct_source);
        if (m->direct_fd >= 0) {
                m->direct_fd = safe_close(m->direct_fd);
                if (m->config.socket_path)
                        (void)unlink(m->config.socket_path);
        }
        mappers_free(m);
        for (size_t i = 0; i < m->n_arenas; i++)
                manager_arena_release(m, m->arenas[i]);
        free(m->arenas);
        hashmap_free(m->clients);
        hashmap_free(m->workers);
        hashmap_free(m->connections);
        hashmap_free(m->refused);
        sd_event_source_disable_unref(m->sigterm);
        sd_event_source_disable_unref(m->sigint);
        sd_event_source_disable_unref(m->sighup);
        sd_event_source_disable_unref(m->changed_source);
        sd_event_source_disable_unref(m->stalled_source);
        sd_event_unref(m->event);
        /* Last: the socket is unlinked above while the lock still says it is ours. */
        m->socket_lock_fd = safe_close(m->socket_lock_fd);
        m->state_lock_fd = safe_close(m->state_lock_fd);
        config_done(&m->config);
        free(m->config_path);
        free(m);
        return NULL;
}

int manager_worker_added(Manager *m, Worker *w, Reason *why) {
        FOREACH_SUBSYSTEM(s)
                if (s->worker_added) {
                        int r = s->worker_added(m, w, why);
                        if (r < 0)
                                return r;
                }
        return 0;
}

void manager_worker_removed(Manager *m, Worker *w) {
        FOREACH_SUBSYSTEM(s)
                if (s->worker_gone)
                        s->worker_gone(m, w);
}

void manager_worker_stats(Manager *m, Worker *w, WorkerStats *ret) {
        *ret = w->stats;
        FOREACH_SUBSYSTEM(s)
                if (s->worker_stats)
                        s->worker_stats(m, w, ret);
}

/* A stalled subscriber's drop, on the loop's next turn: a signal is emitted from inside
 * other objects' changes, which the drop (its client's objects going) must not free. */
static int drop_stalled(sd_event_source *s, void *userdata) {
        Manager *m = userdata;
        Connection *conn;
        size_t it = 0, n = 0;
        uint64_t serials[64];

        /* Collected first: a drop removes from the map being walked. */
        while (n < ELEMENTSOF(serials) && hashmap_iterate(m->connections, &it, (void **)&conn, NULL))
                if (conn->stalled)
                        serials[n++] = conn->serial;
        for (size_t i = 0; i < n; i++) {
                conn = hashmap_get(m->connections, &serials[i]);
                if (!conn)
                        continue;
                log_warning("Disconnecting a direct client that has not read its last %u messages.",
                            CONNECTION_QUEUE_MAX);
                connection_drop(conn);
        }
        if (n == ELEMENTSOF(serials))
                (void)sd_event_source_set_enabled(s, SD_EVENT_ONESHOT); /* more next turn */
        return 0;
}

static void stalled_schedule(Manager *m, Connection *conn) {
        if (conn->stalled)
                return;
        conn->stalled = true;
        if (!m->stalled_source) {
                if (sd_event_add_defer(m->event, &m->stalled_source, drop_stalled, m) < 0)
                        return; /* it stays marked: dropped with the next one */
        } else
                (void)sd_event_source_set_enabled(m->stalled_source, SD_EVENT_ONESHOT);
}

/* A broadcast signal: once on the bus (whose match rules pick its receivers), and on
 * each direct connection that subscribed (Manager.Subscribe): a peer-to-peer connection
 * has no match rules, and a worker that never asked is not woken for them. */
static void emit_each(Manager *m, int (*fn)(sd_bus *bus, void *userdata), void *userdata) {
        Connection *conn;
        size_t it = 0;

        if (m->bus)
                (void)fn(m->bus, userdata);
        while (hashmap_iterate(m->connections, &it, (void **)&conn, NULL)) {
                uint64_t queued = 0;
                if (!conn->subscribed)
                        continue;
                /* A subscriber that stopped reading: its signals would pile up in this
                 * daemon's memory. It is disconnected (its objects go as with any
                 * disconnect); the others are served. */
                if (sd_bus_get_n_queued_write(conn->bus, &queued) >= 0 && queued >= CONNECTION_QUEUE_MAX) {
                        stalled_schedule(m, conn);
                        continue;
                }
                (void)fn(conn->bus, userdata);
        }
}

typedef struct ChangedArgs {
        const char *path, *interface;
        char **properties;
} ChangedArgs;

static int emit_changed_one(sd_bus *bus, void *userdata) {
        ChangedArgs *a = userdata;
        return sd_bus_emit_properties_changed_strv(bus, a->path, a->interface, a->properties);
}

/* Sends what is pending: per (path, interface), one PropertiesChanged naming each
 * property changed meanwhile. */
static void changed_flush(Manager *m) {
        size_t n = m->n_changed;
        bool done[ELEMENTSOF(m->changed)] = {};
        m->n_changed = 0;
        m->changed_since = 0;
        if (m->changed_source)
                (void)sd_event_source_set_enabled(m->changed_source, SD_EVENT_OFF);
        for (size_t i = 0; i < n; i++) {
                if (done[i])
                        continue;
                char *props[ELEMENTSOF(m->changed) + 1];
                size_t k = 0;
                for (size_t j = i; j < n; j++)
                        if (!done[j] && (strcmp(m->changed[j].path, m->changed[i].path) == 0) &&
                            (strcmp(m->changed[j].interface, m->changed[i].interface) == 0)) {
                                props[k++] = (char *)m->changed[j].property;
                                done[j] = true;
                        }
                props[k] = NULL;
                ChangedArgs a = { m->changed[i].path, m->changed[i].interface, props };
                emit_each(m, emit_changed_one, &a);
        }
}

static int on_changed(sd_event_source *s, void *userdata) {
        changed_flush(userdata);
        return 0;
}

#define CHANGED_DELAY_MAX_USEC (10ULL * 1000ULL)

void manager_emit_changed(Manager *m, const char *path, const char *interface,
                          const char *property) {
        if (m->stopping)
                return; /* nobody to tell: the connections go too */
        for (size_t i = 0; i < m->n_changed; i++)
                if ((strcmp(m->changed[i].path, path) == 0) && (strcmp(m->changed[i].interface, interface) == 0) &&
                    (strcmp(m->changed[i].property, property) == 0))
                        goto pending;
        if (m->n_changed == ELEMENTSOF(m->changed))
                changed_flush(m);
        m->changed[m->n_changed++] = (typeof(m->changed[0])){ path, interface, property };
pending:;
        uint64_t now = now_usec(CLOCK_MONOTONIC);
        if (m->changed_since == 0)
                m->changed_since = now;
        if (!m->event || now - m->changed_since >= CHANGED_DELAY_MAX_USEC) {
                changed_flush(m);
                return;
        }
        if (!m->changed_source) {
                if (sd_event_add_defer(m->event, &m->changed_source, on_changed, m) < 0) {
                        changed_flush(m);
                        return;
                }
                /* After the requests that are ready: a burst is one signal. */
                (void)sd_event_source_set_priority(m->changed_source, SD_EVENT_PRIORITY_NORMAL + 10);
        }
        if (sd_event_source_set_enabled(m->changed_source, SD_EVENT_ONESHOT) < 0)
                changed_flush(m);
}

typedef struct SignalArgs {
        const char *path, *interface, *member, *types;
        va_list *ap;
        int r;
} SignalArgs;

static int emit_signal_one(sd_bus *bus, void *userdata) {
        SignalArgs *a = userdata;
        va_list ap;
        va_copy(ap, *a->ap);
        int r = sd_bus_emit_signalv(bus, a->path, a->interface, a->member, a->types, ap);
        va_end(ap);
        if (r < 0)
                a->r = r;
        return r;
}

int manager_emit_signal(Manager *m, const char *path, const char *interface,
                        const char *member, const char *types, ...) {
        va_list ap;
        va_start(ap, types);
        SignalArgs a = { path, interface, member, types, &ap, 0 };
        emit_each(m, emit_signal_one, &a);
        va_end(ap);
        return a.r;
}

Arena *manager_find_arena(Manager *m, const char *name) {
        for (size_t i = 0; i < m->n_arenas; i++)
                if (strcmp(m->arenas[i]->name, name) == 0)
                        return m->arenas[i];
        return NULL;
}
