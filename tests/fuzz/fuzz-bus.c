/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The daemon's bus surface under generated method calls, in process: epdd's own objects
 * (manager_new + manager_startup, every subsystem, the real vtables) serve a direct socket
 * in a temporary directory; a fuzz client connects to it through sd-bus like any worker
 * and sends calls generated from the input: the method from the interfaces' XML (dbus/),
 * its arguments from the method's signature, with boundary and random values, object
 * paths that exist (its own, another client's, made up), and fds of every kind (memfd,
 * sealed memfd, both ends of a pipe, a socket, /dev/null, a directory, an O_PATH fd, an
 * eventfd, a pipe whose other end is closed). Both sides run on this one thread: the
 * fuzzer pumps the daemon's event loop while it waits for a reply.
 *
 * Checked after every call:
 *  - an error reply is named org.epd1.Error.* (or sd-bus's own routing errors for a
 *    path or interface that does not exist): never a System.Error.* errno nor a bare
 *    InvalidArgs;
 *  - a reply comes: within 5 s for every method but those that wait by design;
 *  - the observer, another client holding a worker and a sequence, sees them exactly as
 *    before (its objects counted the same, its sequence's pages the same);
 *  - the daemon's counts agree: workers registered = clients' worker objects.
 * Checked after the fuzz client hangs up (end of every input): the daemon holds exactly
 * what it held before the input (clients, workers, sequences). The temporary directory
 * goes at exit, and before a failure aborts. */
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <systemd/sd-bus.h>
#include <systemd/sd-event.h>

#include "core/client.h"
#include "core/manager.h"
#include "hashmap.h"
#include "pages/page-manager.h"

#ifndef BUS_XML_DIR
#error "BUS_XML_DIR must name the directory of the D-Bus interface XML"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static bool listed(const char *const *list, const char *name);

/* Methods that wait by design (AcceptWait: for a handoff, up to its timeout_usec): no
 * reply within 100 ms is their normal course, and the hang-up at the end must end the
 * wait. Every other call is answered at once: no reply in 5 s fails the fuzzer. */
static const char *const waiting_methods[] = {
        "AcceptWait",
        NULL,
};

/* sd-bus's routing, not a refusal of the daemon: the call named no object/interface/member
 * served at that path (the fuzzer sends interfaces to paths that lack them on purpose). */
static const char *const routing_errors[] = {
        "org.freedesktop.DBus.Error.UnknownObject",
        "org.freedesktop.DBus.Error.UnknownInterface",
        "org.freedesktop.DBus.Error.UnknownMethod",
        "org.freedesktop.DBus.Error.UnknownProperty",
        NULL,
};

typedef struct Method {
        char iface[64], name[64], sig[128], path[64];
} Method;

static Method methods[256];
static size_t n_methods;
static Manager *m;
static sd_bus *observer;
static char dir[] = "/tmp/epd-fuzz-bus-XXXXXX";
static bool dir_made; /* mkdtemp() succeeded: remove_dir() has a directory to remove */
static char socket_path[256];
static char observer_worker[128], observer_seq[128];
static unsigned observer_objects[_CLIENT_OBJECT_TYPE_MAX];
static char *observer_pages; /* the observer's sequence's Pages, as text */

#define POOL_MAX 64
static char *pool[POOL_MAX]; /* object paths seen in replies, and the observer's */
static size_t n_pool;

/* Removes the temporary directory (socket, epd.conf, state/), at exit and before a
 * failure aborts. */
static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
        (void)st, (void)flag, (void)ftw;
        (void)remove(path);
        return 0;
}

static void remove_dir(void) {
        if (!dir_made)
                return;
        (void)nftw(dir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static _Noreturn void fail(void) {
        remove_dir();
        abort();
}

static void die(const char *what, int r) {
        fprintf(stderr, "fuzz-bus: %s: %s\n", what, strerror(r < 0 ? -r : r));
        fail();
}

static void pool_add(const char *p) {
        for (size_t i = 0; i < n_pool; i++)
                if (strcmp(pool[i], p) == 0)
                        return;
        if (n_pool < POOL_MAX)
                pool[n_pool++] = strdup(p);
}

/* ---- the interfaces, from the XML ---- */

static const char *default_path(const char *iface) {
        static const struct { const char *iface, *path; } map[] = {
                { "org.epd1.Feature", "/org/epd1/feature" },   { "org.epd1.Handoffs", "/org/epd1/handoffs" },
                { "org.epd1.Pages", "/org/epd1/pages" },       { "org.epd1.Peer", "/org/epd1/peer" },
                { "org.epd1.Placement", "/org/epd1/placement" }, { "org.epd1.Telemetry", "/org/epd1/telemetry" },
                { "org.epd1.Cluster", "/org/epd1/cluster" },   { "org.epd1.Sequence", "/org/epd1/sequence/" },
                { "org.epd1.Handoff", "/org/epd1/handoff/" },  { "org.epd1.Worker", "/org/epd1/worker/" },
        };
        for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
                if (strcmp(map[i].iface, iface) == 0)
                        return map[i].path;
        return "/org/epd1";
}

static bool attr(const char *tag, const char *end, const char *name, char *out, size_t n) {
        char key[32];
        snprintf(key, sizeof key, " %s=\"", name);
        const char *p = strstr(tag, key);
        if (!p || p > end)
                return false;
        p += strlen(key);
        const char *q = strchr(p, '"');
        if (!q || (size_t)(q - p) >= n)
                return false;
        memcpy(out, p, (size_t)(q - p));
        out[q - p] = 0;
        return true;
}

static void load_xml(const char *path) {
        FILE *f = fopen(path, "re");
        if (!f)
                die(path, errno);
        static char text[256 * 1024];
        size_t n = fread(text, 1, sizeof text - 1, f);
        fclose(f);
        text[n] = 0;
        char iface[64] = "";
        for (char *p = text; (p = strchr(p, '<')); p++) {
                char *end = strchr(p, '>');
                if (!end)
                        break;
                if (strncmp(p, "<!--", 4) == 0) {
                        char *c = strstr(p, "-->");
                        if (!c)
                                break;
                        p = c;
                        continue;
                }
                if (strncmp(p, "<interface ", 11) == 0)
                        attr(p, end, "name", iface, sizeof iface);
                else if (strncmp(p, "<method ", 8) == 0 && iface[0] && n_methods < 256) {
                        Method *mt = &methods[n_methods];
                        if (!attr(p, end, "name", mt->name, sizeof mt->name))
                                continue;
                        snprintf(mt->iface, sizeof mt->iface, "%s", iface);
                        snprintf(mt->path, sizeof mt->path, "%s", default_path(iface));
                        mt->sig[0] = 0;
                        n_methods++;
                        if (end[-1] == '/')
                                continue; /* <method name="X"/> */
                        char *close = strstr(end, "</method>");
                        for (char *a = end; close && (a = strstr(a, "<arg ")) && a < close; a++) {
                                char *ae = strchr(a, '>'), type[64], dirn[8] = "in";
                                if (!attr(a, ae, "type", type, sizeof type))
                                        continue;
                                attr(a, ae, "direction", dirn, sizeof dirn);
                                if (strcmp(dirn, "in") == 0 && strlen(mt->sig) + strlen(type) < sizeof mt->sig)
                                        strcat(mt->sig, type);
                        }
                }
        }
}

/* ---- the input ---- */

typedef struct In {
        const uint8_t *d;
        size_t n;
} In;

static uint8_t u8(In *in) {
        if (!in->n)
                return 0;
        in->n--;
        return *in->d++;
}

static uint64_t u64(In *in) {
        uint64_t v = 0;
        for (int i = 0; i < 8; i++)
                v = v << 8 | u8(in);
        return v;
}

static const char *const words[] = {
        "", "host0", "kv0", "prefill", "decode", "encoder", "cpu", "cuda:0", "m", "x", "bfloat16", "float8_e4m3fn", "Slots", "PagesNeeded",
        "Deadline", "Priority", "Pool", "Arena", "Model", "bf16", "fp8", "../../etc/passwd", "/", "a/b", ".",
        "00000000000000000000000000000000", "ffffffffffffffffffffffffffffffff", "local", "alpha", "\t\n",
        "é", "tcp", "rdma", "auto", "name", "arenas", "kv.layers", "kv.tokens_per_block", "kv.k_bytes_per_token",
        "kv.v_bytes_per_token", "kv.dtype", "Tokens", "Hashes",
};

static char *gen_string(In *in) {
        uint8_t k = u8(in);
        if (k < 160)
                return strdup(words[k % (sizeof words / sizeof words[0])]);
        if (k < 170) { /* long */
                size_t n = 200 + (size_t)u8(in) * 16;
                char *s = malloc(n + 1);
                memset(s, 'a' + k % 26, n);
                s[n] = 0;
                return s;
        }
        if (k < 180 && observer_seq[0]) /* another client's id */
                return strdup(strrchr(k & 1 ? observer_seq : observer_worker, '/') + 1);
        size_t n = u8(in) % 24; /* printable ASCII */
        char *s = malloc(n + 1);
        for (size_t i = 0; i < n; i++)
                s[i] = (char)(0x20 + u8(in) % 0x5f);
        s[n] = 0;
        return s;
}

static const char *gen_path(In *in) {
        static const char *const made_up[] = { "/", "/org/epd1/sequence/00000000000000000000000000000000",
                                               "/org/epd1/worker/x", "/org/epd1/handoff/0" };
        uint8_t k = u8(in);
        if (n_pool && k < 200)
                return pool[k % n_pool];
        return made_up[k % 4];
}

static int gen_fd(In *in) {
        int p[2], fd = -1;
        switch (u8(in) % 10) {
        case 0:
                fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
                if (fd >= 0 && ftruncate(fd, (off_t)(u8(in) % 3) * 4096) < 0) {
                        close(fd);
                        fd = -1;
                }
                break;
        case 1:
                fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING);
                if (fd >= 0) {
                        (void)ftruncate(fd, 65536);
                        (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
                }
                break;
        case 2:
        case 3:
                if (pipe2(p, O_CLOEXEC) == 0) {
                        fd = p[u8(in) & 1];
                        close(p[fd == p[0]]);
                        /* case 3: the other end is closed; case 2 keeps a pipe with a live end */
                }
                break;
        case 4:
                if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, p) == 0) {
                        fd = p[0];
                        close(p[1]);
                }
                break;
        case 5:
                fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
                break;
        case 6:
                fd = open("/dev/null", O_RDWR | O_CLOEXEC);
                break;
        case 7:
                fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
                break;
        case 8:
                fd = open(dir, O_PATH | O_CLOEXEC);
                break;
        default:
                fd = eventfd(0, EFD_CLOEXEC);
                break;
        }
        return fd < 0 ? open("/dev/null", O_RDONLY | O_CLOEXEC) : fd;
}

/* Appends one complete type from *sig; advances *sig past it. */
static int gen_value(sd_bus_message *msg, const char **sig, In *in, int depth);

static size_t type_len(const char *s) {
        if (*s == 'a')
                return 1 + type_len(s + 1);
        if (*s == '(' || *s == '{') {
                char open = *s, close = open == '(' ? ')' : '}';
                int lvl = 0;
                for (size_t i = 0; s[i]; i++) {
                        if (s[i] == open)
                                lvl++;
                        else if (s[i] == close && --lvl == 0)
                                return i + 1;
                }
                return strlen(s);
        }
        return 1;
}

static int gen_value(sd_bus_message *msg, const char **sig, In *in, int depth) {
        char t = **sig;
        int r;
        switch (t) {
        case 'y': { uint8_t v = u8(in); (*sig)++; return sd_bus_message_append_basic(msg, t, &v); }
        case 'b': { int v = u8(in) & 1; (*sig)++; return sd_bus_message_append_basic(msg, t, &v); }
        case 'n': case 'q': case 'i': case 'u': case 'x': case 't': {
                static const uint64_t edge[] = { 0, 1, 2, 3, 4, 16, 64, 4096, 65536, 0x7fffffff, 0x80000000,
                                                 0xffffffff, 0x7fffffffffffffffULL, 0x8000000000000000ULL,
                                                 UINT64_MAX, 1000000 };
                uint8_t k = u8(in);
                uint64_t v = k < 192 ? edge[k % 16] : u64(in);
                (*sig)++;
                if (t == 'n' || t == 'q') { uint16_t x = (uint16_t)v; return sd_bus_message_append_basic(msg, t, &x); }
                if (t == 'i' || t == 'u') { uint32_t x = (uint32_t)v; return sd_bus_message_append_basic(msg, t, &x); }
                return sd_bus_message_append_basic(msg, t, &v);
        }
        case 'd': {
                static const double edge[] = { 0, -1, 0.5, 1e308, -1e308, 1e-300, __builtin_nan(""), __builtin_inf() };
                double v = edge[u8(in) % 8];
                (*sig)++;
                return sd_bus_message_append_basic(msg, t, &v);
        }
        case 's': {
                char *s = gen_string(in);
                (*sig)++;
                r = sd_bus_message_append_basic(msg, t, s);
                free(s);
                return r;
        }
        case 'o': (*sig)++; return sd_bus_message_append_basic(msg, t, gen_path(in));
        case 'g': {
                static const char *const g[] = { "", "s", "a{sv}", "u", "v" };
                (*sig)++;
                return sd_bus_message_append_basic(msg, t, g[u8(in) % 5]);
        }
        case 'h': {
                int fd = gen_fd(in);
                (*sig)++;
                r = sd_bus_message_append_basic(msg, t, &fd); /* dups it */
                close(fd);
                return r;
        }
        case 'v': {
                static const char *const vt[] = { "s", "u", "t", "i", "b", "d", "as", "x", "ay", "o", "at", "a{sv}" };
                const char *inner = depth > 3 ? "u" : vt[u8(in) % 12], *p = inner;
                (*sig)++;
                r = sd_bus_message_open_container(msg, 'v', inner);
                if (r >= 0)
                        r = gen_value(msg, &p, in, depth + 1);
                return r < 0 ? r : sd_bus_message_close_container(msg);
        }
        case 'a': {
                size_t el = type_len(*sig + 1);
                char contents[128];
                if (el >= sizeof contents)
                        return -EINVAL;
                memcpy(contents, *sig + 1, el);
                contents[el] = 0;
                unsigned n = depth > 3 ? 0 : u8(in) % 6;
                if (u8(in) == 0xff)
                        n = 200; /* a long one now and then */
                r = sd_bus_message_open_container(msg, 'a', contents);
                for (unsigned i = 0; r >= 0 && i < n; i++) {
                        const char *p = contents;
                        r = gen_value(msg, &p, in, depth + 1);
                }
                *sig += 1 + el;
                return r < 0 ? r : sd_bus_message_close_container(msg);
        }
        case '(': case '{': {
                size_t len = type_len(*sig);
                char contents[128];
                if (len < 2 || len - 2 >= sizeof contents)
                        return -EINVAL;
                memcpy(contents, *sig + 1, len - 2);
                contents[len - 2] = 0;
                r = sd_bus_message_open_container(msg, t == '(' ? 'r' : 'e', contents);
                for (const char *p = contents; r >= 0 && *p;)
                        r = gen_value(msg, &p, in, depth + 1);
                *sig += len;
                return r < 0 ? r : sd_bus_message_close_container(msg);
        }
        default:
                return -EINVAL;
        }
}

/* ---- the daemon's side ---- */

static void pump_once(int timeout_usec) {
        int r = sd_event_run(m->event, (uint64_t)timeout_usec);
        if (r < 0)
                die("sd_event_run", r);
}

/* Sends msg on bus and runs the daemon until the reply comes or wait_ms pass; NULL
 * without a reply, with *hung_up set when the connection is gone. */
static sd_bus_message *call_for(sd_bus *bus, sd_bus_message *msg, int wait_ms, bool *hung_up) {
        uint64_t cookie;
        sd_bus_message *reply = NULL;
        int r = sd_bus_send(bus, msg, &cookie);
        if (r < 0) {
                *hung_up = true;
                return NULL;
        }
        for (int i = 0; i < wait_ms && !reply; i++) {
                sd_bus_message *in = NULL;
                pump_once(0);
                while ((r = sd_bus_process(bus, &in)) > 0) {
                        if (in) {
                                uint64_t rc;
                                if (sd_bus_message_get_reply_cookie(in, &rc) >= 0 && rc == cookie) {
                                        reply = in;
                                        break;
                                }
                                sd_bus_message_unref(in);
                                in = NULL;
                        }
                }
                if (r < 0) {
                        *hung_up = true;
                        return NULL; /* the daemon hung up on us */
                }
                if (!reply) {
                        pump_once(1000);
                        (void)sd_bus_wait(bus, 0);
                }
        }
        return reply;
}

static sd_bus_message *call(sd_bus *bus, sd_bus_message *msg) {
        bool hung_up = false;
        return call_for(bus, msg, 5000, &hung_up);
}

static sd_bus_message *call_method(sd_bus *bus, const char *path, const char *iface, const char *member,
                                   const char *types, ...) {
        sd_bus_message *msg = NULL, *reply;
        va_list ap;
        int r = sd_bus_message_new_method_call(bus, &msg, "org.epd1", path, iface, member);
        if (r < 0)
                die("new_method_call", r);
        va_start(ap, types);
        if (types)
                r = sd_bus_message_appendv(msg, types, ap);
        va_end(ap);
        if (r < 0)
                die("append", r);
        reply = call(bus, msg);
        sd_bus_message_unref(msg);
        return reply;
}

static sd_bus *connect_client(void) {
        sd_bus *bus;
        char addr[300];
        int r = sd_bus_new(&bus);
        snprintf(addr, sizeof addr, "unix:path=%s", socket_path);
        if (r >= 0)
                r = sd_bus_set_address(bus, addr);
        if (r >= 0)
                r = sd_bus_negotiate_fds(bus, true);
        if (r >= 0)
                r = sd_bus_start(bus);
        if (r < 0)
                die("connect", r);
        /* The daemon answers the authentication only when pumped: finish it here. Left
         * pending, the first call with an fd argument blocks in sd_bus_send(), which must
         * know whether fds were negotiated, for sd-bus's whole authentication timeout
         * (90 s), and the connection then fails. */
        for (int i = 0; i < 5000 && (r = sd_bus_is_ready(bus)) == 0; i++) {
                pump_once(0);
                r = sd_bus_process(bus, NULL);
                if (r < 0)
                        break;
                if (r == 0) {
                        pump_once(1000);
                        (void)sd_bus_wait(bus, 0);
                }
        }
        if (r <= 0)
                die("authenticating to the daemon", r < 0 ? r : ETIMEDOUT);
        return bus;
}

static void collect_paths(sd_bus_message *reply) {
        /* Every object path anywhere in a reply joins the pool. */
        char type;
        const char *contents;
        int r;
        while ((r = sd_bus_message_peek_type(reply, &type, &contents)) > 0) {
                if (type == 'a' || type == 'r' || type == 'e' || type == 'v') {
                        if (sd_bus_message_enter_container(reply, type, contents) < 0)
                                return;
                        collect_paths(reply);
                        if (sd_bus_message_exit_container(reply) < 0)
                                return;
                } else if (type == 'o') {
                        const char *p;
                        if (sd_bus_message_read_basic(reply, 'o', &p) < 0)
                                return;
                        if (strcmp(p, "/") != 0)
                                pool_add(p);
                } else if (sd_bus_message_skip(reply, (char[]){ type, 0 }) < 0)
                        return;
        }
}

static char *observer_pages_text(void) {
        sd_bus_message *reply = call_method(observer, observer_seq, "org.freedesktop.DBus.Properties", "Get",
                                            "ss", "org.epd1.Sequence", "Pages");
        char *buf = NULL;
        size_t len = 0;
        if (!reply || sd_bus_message_is_method_error(reply, NULL)) {
                fprintf(stderr, "fuzz-bus: the observer cannot read its own sequence's pages: %s\n",
                        reply ? sd_bus_message_get_error(reply)->message : "no reply");
                fail();
        }
        FILE *f = open_memstream(&buf, &len);
        (void)sd_bus_message_dump(reply, f, SD_BUS_MESSAGE_DUMP_SUBTREE_ONLY);
        fclose(f);
        sd_bus_message_unref(reply);
        return buf;
}

static char *observer_key; /* its Client's key in m->clients */

static Client *observer_client(void) {
        return hashmap_get(m->clients, observer_key);
}

static unsigned count_worker_objects(void) {
        size_t i = 0;
        void *v;
        unsigned n = 0;
        while (hashmap_iterate(m->clients, &i, &v, NULL))
                n += ((Client *)v)->n_objects[CLIENT_OBJECT_WORKER];
        return n;
}

static void setup(void) {
        char conf[300];
        if (!mkdtemp(dir))
                die("mkdtemp", errno);
        dir_made = true; /* (its random part may hold an 'X' too) */
        atexit(remove_dir);
        snprintf(conf, sizeof conf, "%s/epd.conf", dir);
        snprintf(socket_path, sizeof socket_path, "%s/bus", dir);
        FILE *f = fopen(conf, "we");
        if (!f)
                die(conf, errno);
        fprintf(f, "[Daemon]\nSocket=%s\nSystemBus=no\nHostId=fuzz\nStateDirectory=%s/state\nLogLevel=crit\n"
                   "[Arena:host0]\nSize=8M\n",
                socket_path, dir);
        fclose(f);
        int r = manager_new(&m, conf);
        if (r < 0)
                die("manager_new", r);
        r = manager_startup(m);
        if (r < 0)
                die("manager_startup", r);

        /* In name order, not the directory's: an input's method index names the same
         * method on every machine, so a seed reproduces what it found anywhere. */
        struct dirent **names = NULL;
        int n_names = scandir(BUS_XML_DIR, &names, NULL, alphasort);
        if (n_names < 0)
                die(BUS_XML_DIR, errno);
        for (int i = 0; i < n_names; i++) {
                char p[512];
                if (strstr(names[i]->d_name, ".xml")) {
                        snprintf(p, sizeof p, "%s/%s", BUS_XML_DIR, names[i]->d_name);
                        load_xml(p);
                }
                free(names[i]);
        }
        free(names);
        if (n_methods < 20)
                die("too few methods in the XML", EINVAL);

        /* The observer: another client with a worker and a sequence, whose objects no
         * call of the fuzz client may change. */
        observer = connect_client();
        sd_bus_message *reply = call_method(observer, "/org/epd1", "org.epd1.Manager", "RegisterWorker",
                                            "sssa{sv}", "decode", "observer-model", "cpu", 5, "kv.dtype", "s", "bfloat16", "kv.layers", "u", 2,
                                            "kv.tokens_per_block", "u", 16, "kv.k_bytes_per_token", "t", (uint64_t)256,
                                            "kv.v_bytes_per_token", "t", (uint64_t)256);
        const char *p;
        if (!reply || sd_bus_message_is_method_error(reply, NULL) || sd_bus_message_read(reply, "o", &p) < 0) {
                fprintf(stderr, "fuzz-bus: RegisterWorker: %s\n",
                        reply ? sd_bus_message_get_error(reply)->message : "no reply");
                die("the observer cannot register", EINVAL);
        }
        snprintf(observer_worker, sizeof observer_worker, "%s", p);
        sd_bus_message_unref(reply);
        reply = call_method(observer, "/org/epd1/pages", "org.epd1.Pages", "CreateSequence", "su", "host0", 2);
        if (!reply || sd_bus_message_is_method_error(reply, NULL) || sd_bus_message_read(reply, "o", &p) < 0) {
                fprintf(stderr, "fuzz-bus: CreateSequence: %s\n",
                        reply && sd_bus_message_is_method_error(reply, NULL) ? sd_bus_message_get_error(reply)->message : "?");
                die("the observer cannot create a sequence", EINVAL);
        }
        snprintf(observer_seq, sizeof observer_seq, "%s", p);
        sd_bus_message_unref(reply);
        pool_add(observer_worker);
        pool_add(observer_seq);
        if (hashmap_size(m->clients) != 1)
                die("the observer is not the daemon's only client", EINVAL);
        size_t it = 0;
        void *v;
        if (!hashmap_iterate(m->clients, &it, &v, NULL))
                die("the observer has no state in the daemon", EINVAL);
        observer_key = strdup(((Client *)v)->key);
        Client *oc = observer_client();
        memcpy(observer_objects, oc->n_objects, sizeof observer_objects);
        observer_pages = observer_pages_text();
}

static bool listed(const char *const *list, const char *name) {
        for (size_t i = 0; list[i]; i++)
                if (strcmp(list[i], name) == 0)
                        return true;
        return false;
}

static void check_invariants(const char *what) {
        Client *oc = observer_client();
        if (!oc || memcmp(oc->n_objects, observer_objects, sizeof observer_objects) != 0) {
                fprintf(stderr, "fuzz-bus: after %s, the observer's objects changed\n", what);
                fail();
        }
        if (count_worker_objects() != hashmap_size(m->workers)) {
                fprintf(stderr, "fuzz-bus: after %s, %u worker objects for %u workers\n", what,
                        count_worker_objects(), (unsigned)hashmap_size(m->workers));
                fail();
        }
        char *pages = observer_pages_text();
        if (strcmp(pages, observer_pages) != 0) {
                fprintf(stderr, "fuzz-bus: after %s, the observer's sequence changed:\n%s\nwas\n%s\n", what, pages,
                        observer_pages);
                fail();
        }
        free(pages);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (!m)
                setup();
        In in = { data, size };
        unsigned clients0 = hashmap_size(m->clients), workers0 = hashmap_size(m->workers),
                 seqs0 = hashmap_size(m->page_manager->sequences);
        size_t pool0 = n_pool;
        sd_bus *bus = connect_client();

        for (int calls = 0; in.n > 0 && calls < 24; calls++) {
                const Method *mt = &methods[u8(&in) % n_methods];
                char path[160];
                uint8_t how = u8(&in);
                if (mt->path[strlen(mt->path) - 1] == '/') { /* an object of a kind: one from the pool */
                        const char *p = NULL;
                        for (size_t i = 0, k = how; i < n_pool && !p; i++)
                                if (strncmp(pool[(i + k) % n_pool], mt->path, strlen(mt->path)) == 0)
                                        p = pool[(i + k) % n_pool];
                        snprintf(path, sizeof path, "%s", p ? p : gen_path(&in));
                } else
                        snprintf(path, sizeof path, "%s", how < 230 ? mt->path : gen_path(&in));

                sd_bus_message *msg = NULL;
                int r = sd_bus_message_new_method_call(bus, &msg, "org.epd1", path, mt->iface, mt->name);
                for (const char *s = mt->sig; r >= 0 && *s;)
                        r = gen_value(msg, &s, &in, 0);
                /* One more argument than the method takes: refused as InvalidArgument by
                 * the bus glue, never sd-bus's bare InvalidArgs. */
                if (r >= 0 && how == 229)
                        r = sd_bus_message_append(msg, "u", (uint32_t)0);
                if (r < 0) { /* a value sd-bus will not send (e.g. bad UTF-8): not a call */
                        sd_bus_message_unref(msg);
                        continue;
                }
                bool waits = listed(waiting_methods, mt->name);
                bool hung_up = false;
                sd_bus_message *reply = call_for(bus, msg, waits ? 100 : 5000, &hung_up);
                sd_bus_message_unref(msg);
                if (!reply && !hung_up && !waits) {
                        fprintf(stderr, "fuzz-bus: %s.%s(%s) on %s: no reply in 5 s\n", mt->iface, mt->name, mt->sig,
                                path);
                        fail();
                }
                if (reply && sd_bus_message_is_method_error(reply, NULL)) {
                        const sd_bus_error *e = sd_bus_message_get_error(reply);
                        if (strncmp(e->name, "org.epd1.Error.", 15) != 0 && !listed(routing_errors, e->name)) {
                                fprintf(stderr, "fuzz-bus: %s.%s(%s) on %s: error %s: %s\n", mt->iface, mt->name,
                                        mt->sig, path, e->name, e->message);
                                fail();
                        }
                } else if (reply)
                        collect_paths(reply);
                sd_bus_message_unref(reply);
                char what[64 + 64 + 160 + 8];
                snprintf(what, sizeof what, "%s.%s on %s", mt->iface, mt->name, path);
                check_invariants(what);
        }

        /* Hang up: everything of the fuzz client goes, nothing of anyone else does. */
        sd_bus_close_unref(bus); /* no flush: the daemon runs only when pumped */
        for (int i = 0; i < 2000 && hashmap_size(m->clients) > clients0; i++)
                pump_once(1000);
        for (int i = 0; i < 20; i++)
                pump_once(0);
        if (hashmap_size(m->clients) != clients0 || hashmap_size(m->workers) != workers0 ||
            hashmap_size(m->page_manager->sequences) != seqs0) {
                fprintf(stderr, "fuzz-bus: after the fuzz client hung up: clients %u -> %u, workers %u -> %u, "
                                "sequences %u -> %u\n",
                        clients0, (unsigned)hashmap_size(m->clients), workers0, (unsigned)hashmap_size(m->workers),
                        seqs0, (unsigned)hashmap_size(m->page_manager->sequences));
                fail();
        }
        check_invariants("the fuzz client's disconnect");
        /* Paths of objects that are gone stay useful (stale handles) but are bounded. */
        while (n_pool > pool0 + 16)
                free(pool[--n_pool]);
        return 0;
}
