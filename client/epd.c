/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "bus-error.h"
#include "epd-internal.h"
#include "macro.h"
#include "time-util.h"

#define DEFAULT_SOCKET "/run/epd/bus"

void epd__clear_error(epd_client *c) {
        if (c)
                c->error_name[0] = c->error_message[0] = 0;
}

/* Records a refusal of libepd's own (no call made, or its reply unusable), so that
 * epd_last_error_name() never names an earlier call's error: "errno.N" and the text
 * given (strerror's when none). */
int epd__fail(epd_client *c, int r, const char *format, ...) {
        if (!c)
                return r;
        snprintf(c->error_name, sizeof c->error_name, "errno.%d", -r);
        if (format) {
                va_list ap;
                va_start(ap, format);
                vsnprintf(c->error_message, sizeof c->error_message, format, ap);
                va_end(ap);
        } else
                snprintf(c->error_message, sizeof c->error_message, "%s", strerror(-r));
        return r;
}

/* Whether the connection to epdd is gone (closed, or closing: sd-bus saw its end). */
static bool bus_gone(const epd_client *c) {
        return !c->bus || sd_bus_is_open(c->bus) <= 0;
}

static bool errno_is_disconnect(int k) {
        return k == -ECONNRESET || k == -EPIPE || k == -ECONNABORTED || k == -ESHUTDOWN || k == -ENETRESET;
}

/* An error that sd-bus made itself, not one of a reply of the daemon's (whose errors are
 * org.epd1.Error.* and sd-bus's routing names): a call's timeout, the connection's end,
 * an errno of its own. */
static bool error_is_local(const sd_bus_error *e) {
        return strncmp(e->name, "System.Error.", strlen("System.Error.")) == 0 ||
               sd_bus_error_has_name(e, SD_BUS_ERROR_NO_REPLY) || sd_bus_error_has_name(e, SD_BUS_ERROR_TIMEOUT) ||
               sd_bus_error_has_name(e, SD_BUS_ERROR_DISCONNECTED);
}

/* Names error r (e: the call's error, or NULL) into name and message: the daemon's
 * name and words for its refusals; "errno.N" for libepd's own, a lost connection as
 * ENOTCONN whichever way sd-bus said it (ECONNRESET, EPIPE, ENOTCONN, or NoReply for a
 * call pending at the end), a timeout of the call's as ETIMEDOUT. member, when known,
 * starts the message. Returns the negative errno. */
static int describe(const epd_client *c, int r, const sd_bus_error *e, const char *member, char *name,
                    size_t n_name, char *message, size_t n_message) {
        const char *sep = member ? ": " : "";
        if (!member)
                member = "";
        if (e && sd_bus_error_is_set(e) && !error_is_local(e)) {
                snprintf(name, n_name, "%s", e->name);
                snprintf(message, n_message, "%s%s%s", member, sep, e->message ?: "");
                int m = sd_bus_error_get_errno(e);
                return m > 0 ? -m : (r < 0 ? r : -EIO);
        }
        bool set = e && sd_bus_error_is_set(e);
        int k = set && sd_bus_error_get_errno(e) > 0 ? -sd_bus_error_get_errno(e) : r < 0 ? r : -EIO;
        bool no_reply = set && sd_bus_error_has_name(e, SD_BUS_ERROR_NO_REPLY);
        if (errno_is_disconnect(k) ||
            ((k == -ENOTCONN || no_reply) && bus_gone(c))) {
                snprintf(name, n_name, "errno.%d", ENOTCONN);
                snprintf(message, n_message, "%s%sthe connection to epdd is closed", member, sep);
                return -ENOTCONN;
        }
        snprintf(name, n_name, "errno.%d", -k);
        if (k == -ETIMEDOUT)
                snprintf(message, n_message, "%s%sno answer from epdd in time", member, sep);
        else
                snprintf(message, n_message, "%s%s%s", member, sep, set && e->message ? e->message : strerror(-k));
        return k;
}

static int record_error(epd_client *c, int r, const sd_bus_error *e, const char *member) {
        if (!c)
                return r;
        return describe(c, r, e, member, c->error_name, sizeof c->error_name, c->error_message,
                        sizeof c->error_message);
}

int epd__error(epd_client *c, int r, const sd_bus_error *e) {
        return record_error(c, r, e, NULL);
}

const char *epd_last_error_name(const epd_client *c) {
        return c && c->error_name[0] ? c->error_name : NULL;
}

const char *epd_last_error_message(const epd_client *c) {
        return c && c->error_message[0] ? c->error_message : NULL;
}

uint64_t epd_last_error_retry_after_usec(const epd_client *c) {
        const char *p = c ? strstr(c->error_message, "retry_after_usec=") : NULL;
        if (!p)
                return 0;
        char *end;
        errno = 0;
        unsigned long long v = strtoull(p + strlen("retry_after_usec="), &end, 10);
        return errno == 0 && end != p + strlen("retry_after_usec=") ? (uint64_t)v : 0;
}

int epd__new_call(epd_client *c, const char *path, const char *interface, const char *member,
                  sd_bus_message **ret) {
        int r = sd_bus_message_new_method_call(c->bus, ret, EPD_DESTINATION(c), path, interface, member);
        return r < 0 ? epd__error(c, r, NULL) : 0;
}

int epd__send(epd_client *c, sd_bus_message *m, sd_bus_message **reply) {
        return epd__send_timeout(c, m, 0, reply);
}

int epd__send_timeout(epd_client *c, sd_bus_message *m, uint64_t timeout_usec, sd_bus_message **reply) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        epd__clear_error(c);
        int r = sd_bus_call(c->bus, m, timeout_usec, &e, reply);
        if (r < 0)
                r = record_error(c, r, &e, sd_bus_error_is_set(&e) && !error_is_local(&e)
                                                   ? NULL : sd_bus_message_get_member(m));
        sd_bus_error_free(&e);
        return r < 0 ? r : 0;
}

/* A method call with its arguments appended (types and ap as sd_bus_message_appendv). */
static int new_call_v(epd_client *c, const char *path, const char *interface, const char *member,
                      sd_bus_message **ret, const char *types, va_list ap) {
        sd_bus_message *m = NULL;
        int r = epd__new_call(c, path, interface, member, &m);
        if (r < 0)
                return r;
        if (types) {
                r = sd_bus_message_appendv(m, types, ap);
                if (r < 0) {
                        sd_bus_message_unref(m);
                        return epd__error(c, r, NULL);
                }
        }
        *ret = m;
        return 0;
}

int epd__call(epd_client *c, const char *path, const char *interface, const char *member,
              sd_bus_message **reply, const char *types, ...) {
        sd_bus_message *m = NULL;
        va_list ap;
        va_start(ap, types);
        int r = new_call_v(c, path, interface, member, &m, types, ap);
        va_end(ap);
        if (r < 0)
                return r;
        r = epd__send(c, m, reply);
        sd_bus_message_unref(m);
        return r;
}

int epd__undo(epd_client *c, int r, const char *path, const char *interface, const char *member,
              const char *types, ...) {
        char name[sizeof c->error_name], message[sizeof c->error_message];
        sd_bus_message *m = NULL;
        va_list ap;
        memcpy(name, c->error_name, sizeof name);
        memcpy(message, c->error_message, sizeof message);
        va_start(ap, types);
        int k = new_call_v(c, path, interface, member, &m, types, ap);
        va_end(ap);
        if (k >= 0)
                (void)epd__send(c, m, NULL);
        sd_bus_message_unref(m);
        memcpy(c->error_name, name, sizeof name);
        memcpy(c->error_message, message, sizeof message);
        return r;
}

typedef struct NowaitCall {
        epd_client *client;
        char member[64];
} NowaitCall;

static int on_nowait_reply(sd_bus_message *m, void *userdata, sd_bus_error *ret_error) {
        NowaitCall *call = userdata;
        epd_client *c = call->client;
        const sd_bus_error *e = sd_bus_message_get_error(m);

        if (c->nowait_pending > 0)
                c->nowait_pending--;
        /* A call pending when the connection closed is answered by sd-bus (NoReply): the
         * connection's end, said as the blocking calls say it. */
        if (e && c->nowait_error == 0)
                c->nowait_error = describe(c, -EIO, e, call->member, c->nowait_error_name,
                                           sizeof c->nowait_error_name, c->nowait_error_message,
                                           sizeof c->nowait_error_message);
        return 0;
}

/* Dispatches what has arrived, without blocking, while calls sent without waiting
 * (nowait, or asynchronous with a callback) are unanswered. Not from within a callback
 * of the connection (sd-bus refuses sd_bus_process() there): the replies wait for the
 * caller's next turn. */
static int drain_nowait(epd_client *c) {
        int r = 0;
        if (sd_bus_get_current_message(c->bus))
                return 0;
        while ((c->nowait_pending > 0 || c->async_pending > 0) && (r = sd_bus_process(c->bus, NULL)) > 0)
                ;
        return r;
}

int epd__send_async(epd_client *c, sd_bus_message *m, sd_bus_message_handler_t callback, void *userdata) {
        sd_bus_slot *slot = NULL;
        int r = sd_bus_call_async(c->bus, &slot, m, callback, userdata, 0);
        if (r < 0) {
                free(userdata);
                return epd__error(c, r, NULL);
        }
        (void)sd_bus_slot_set_destroy_callback(slot, free);
        (void)sd_bus_slot_set_floating(slot, 1);
        sd_bus_slot_unref(slot); /* the bus holds it until the reply (or its own end) */
        epd__clear_error(c);
        return 0;
}

int epd__call_nowait(epd_client *c, const char *path, const char *interface, const char *member,
                     const char *types, ...) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
        va_list ap;
        va_start(ap, types);
        int r = new_call_v(c, path, interface, member, &m, types, ap);
        va_end(ap);
        if (r < 0)
                return r;
        /* Replies of earlier ones that are in already: keep the queue short. */
        r = drain_nowait(c);
        if (r < 0)
                return epd__error(c, r, NULL);
        /* The call's name goes with its slot (a reply does not carry it), freed with it. */
        NowaitCall *call = calloc(1, sizeof *call);
        if (!call)
                return epd__error(c, -ENOMEM, NULL);
        call->client = c;
        snprintf(call->member, sizeof call->member, "%s", member);
        r = epd__send_async(c, m, on_nowait_reply, call);
        if (r < 0)
                return r;
        c->nowait_pending++;
        return 0;
}

int epd_flush(epd_client *c, uint64_t timeout_usec) {
        uint64_t now, until;
        int r;

        if (!c)
                return epd__error(c, -EINVAL, NULL);
        if (sd_bus_get_current_message(c->bus))
                return epd__fail(c, -EBUSY, "epd_flush() cannot wait from within a callback of the same client");
        until = usec_add(now_usec(CLOCK_MONOTONIC), timeout_usec);
        for (;;) {
                r = drain_nowait(c);
                if (r < 0)
                        return epd__error(c, r, NULL);
                if (c->nowait_pending == 0 && c->async_pending == 0)
                        break;
                now = now_usec(CLOCK_MONOTONIC);
                if (now >= until)
                        return epd__fail(c, -ETIMEDOUT, "%u call(s) sent without waiting are not answered yet",
                                         c->nowait_pending + c->async_pending);
                r = sd_bus_wait(c->bus, until == UINT64_MAX ? UINT64_MAX : until - now);
                /* A signal caught meanwhile is not an answer: wait on until the deadline
                 * (what flush reports is a refusal, a timeout or 0). A wait without one
                 * ends, so that a signal can still stop it. */
                if (r < 0 && (r != -EINTR || until == UINT64_MAX))
                        return epd__error(c, r, NULL);
        }
        epd__clear_error(c);
        if (c->nowait_error < 0) {
                r = c->nowait_error;
                c->nowait_error = 0;
                snprintf(c->error_name, sizeof c->error_name, "%s", c->nowait_error_name);
                snprintf(c->error_message, sizeof c->error_message, "%s", c->nowait_error_message);
                return r;
        }
        /* Every call answered, but the connection is gone: what the caller sends next
         * goes nowhere, so this flush, and every later one, says so. */
        if (bus_gone(c))
                return epd__error(c, -ENOTCONN, NULL);
        return 0;
}

static int connect_direct(epd_client *c, const char *path) {
        char *addr;
        if (asprintf(&addr, "unix:path=%s", path) < 0)
                return epd__error(c, -ENOMEM, NULL);
        int r = sd_bus_new(&c->bus);
        if (r >= 0)
                r = sd_bus_set_address(c->bus, addr);
        if (r >= 0)
                r = sd_bus_negotiate_fds(c->bus, true);
        if (r >= 0)
                r = sd_bus_start(c->bus);
        free(addr);
        c->direct = true;
        return r;
}

static int connect_bus(epd_client *c, const char *address) {
        int r;
        if (!address)
                return sd_bus_open_system(&c->bus);
        r = sd_bus_new(&c->bus);
        if (r >= 0)
                r = sd_bus_set_address(c->bus, address);
        if (r >= 0)
                r = sd_bus_set_bus_client(c->bus, true);
        if (r >= 0)
                r = sd_bus_negotiate_fds(c->bus, true);
        if (r >= 0)
                r = sd_bus_start(c->bus);
        return r;
}

int epd_connect(const char *address, epd_client **ret) {
        epd_client *c = calloc(1, sizeof *c);
        int r;
        if (!c)
                return -ENOMEM;
        (void)epd_bus_error_register();
        const char *e;
        if (address && strncmp(address, "direct:", 7) == 0)
                r = connect_direct(c, address + 7);
        else if (address && strncmp(address, "bus:", 4) == 0)
                r = connect_bus(c, address + 4);
        else if (address && strcmp(address, "system") == 0)
                r = connect_bus(c, NULL);
        else if (address)
                r = -EINVAL;
        else if ((e = getenv("EPD_SOCKET")) && *e)
                r = connect_direct(c, e);
        else if ((e = getenv("EPD_BUS_ADDRESS")) && *e)
                r = connect_bus(c, e);
        else if (access(DEFAULT_SOCKET, F_OK) == 0)
                r = connect_direct(c, DEFAULT_SOCKET);
        else
                r = connect_bus(c, NULL);
        if (r < 0) {
                sd_bus_unref(c->bus);
                free(c);
                return r;
        }
        *ret = c;
        return 0;
}

static void drop_arenas(epd_client *c) {
        for (size_t i = 0; i < c->n_arenas; i++) {
                epd_arena *a = &c->arenas[i];
                if (a->base)
                        munmap(a->base, a->size);
                safe_close(a->fd);
                free((char *)a->name);
                free((char *)a->domain);
                free((char *)a->usage);
        }
        free(c->arenas);
        c->arenas = NULL;
        c->n_arenas = 0;
}

/* What is queued to send goes out, for at most EPD_DISCONNECT_FLUSH_USEC: a daemon that
 * stopped reading (stopped, or stalled) must not keep the caller, Python's __del__ among
 * them, for ever (sd_bus_flush() waits without a bound). What cannot go is dropped: the
 * connection's end releases everything of the client's anyway. Replies that come
 * meanwhile are dispatched, with c->closing set: no callback of the caller runs. */
#define EPD_DISCONNECT_FLUSH_USEC (2 * 1000000ULL)

static void flush_bounded(epd_client *c) {
        uint64_t until = usec_add(now_usec(CLOCK_MONOTONIC), EPD_DISCONNECT_FLUSH_USEC), queued = 0, now;
        int r;

        while (sd_bus_get_n_queued_write(c->bus, &queued) >= 0 && queued > 0) {
                /* The bound holds however much arrives meanwhile. */
                now = now_usec(CLOCK_MONOTONIC);
                if (now >= until)
                        return;
                r = sd_bus_process(c->bus, NULL); /* writes what the socket takes */
                if (r < 0)
                        return;
                if (r > 0)
                        continue;
                r = sd_bus_wait(c->bus, until - now);
                if (r < 0 && r != -EINTR)
                        return;
        }
}

epd_client *epd_disconnect(epd_client *c) {
        if (!c)
                return NULL;
        c->closing = true;
        /* Unregistered without waiting for the answer: the daemon reads it before the
         * connection's end, and frees the worker at once rather than as a departed one. */
        if (c->worker_path)
                (void)epd__call_nowait(c, "/org/epd1", "org.epd1.Manager", "UnregisterWorker", "o", c->worker_path);
        free(c->worker_path);
        c->worker_path = NULL;
        drop_arenas(c);
        flush_bounded(c);
        sd_bus_close_unref(c->bus);
        free(c);
        return NULL;
}

int epd_register(epd_client *c, const char *role, const char *model, const char *device,
                 const epd_kv_layout *kv, const char *const *arenas) {
        return epd_register_named(c, role, model, device, kv, arenas, NULL, NULL);
}

int epd_register_named(epd_client *c, const char *role, const char *model, const char *device,
                       const epd_kv_layout *kv, const char *const *arenas, const char *worker_name,
                       const char *const *labels) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        int r;
        if (!c || !role || !model || !device)
                return epd__error(c, -EINVAL, NULL);
        if (c->worker_path)
                return epd__fail(c, -EALREADY, "this client is already registered, as %s", c->worker_path);
        r = epd__new_call(c, "/org/epd1", "org.epd1.Manager", "RegisterWorker", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "sss", role, model, device);
        if (r >= 0)
                r = sd_bus_message_open_container(m, 'a', "{sv}");
        if (r >= 0 && kv) {
                r = sd_bus_message_append(m, "{sv}{sv}{sv}{sv}", "kv.layers", "u", kv->layers,
                                          "kv.tokens_per_block", "u", kv->tokens_per_block,
                                          "kv.k_bytes_per_token", "t", kv->k_bytes_per_token,
                                          "kv.v_bytes_per_token", "t", kv->v_bytes_per_token);
                if (r >= 0 && kv->dtype)
                        r = sd_bus_message_append(m, "{sv}", "kv.dtype", "s", kv->dtype);
        }
        if (r >= 0 && arenas) {
                r = sd_bus_message_open_container(m, 'e', "sv");
                if (r >= 0)
                        r = sd_bus_message_append(m, "s", "arenas");
                if (r >= 0)
                        r = sd_bus_message_open_container(m, 'v', "as");
                if (r >= 0)
                        r = sd_bus_message_append_strv(m, (char **)arenas);
                if (r >= 0)
                        r = sd_bus_message_close_container(m);
                if (r >= 0)
                        r = sd_bus_message_close_container(m);
        }
        if (r >= 0 && worker_name)
                r = sd_bus_message_append(m, "{sv}", "name", "s", worker_name);
        if (r >= 0 && labels) {
                r = sd_bus_message_open_container(m, 'e', "sv");
                if (r >= 0)
                        r = sd_bus_message_append(m, "s", "labels");
                if (r >= 0)
                        r = sd_bus_message_open_container(m, 'v', "as");
                if (r >= 0)
                        r = sd_bus_message_append_strv(m, (char **)labels);
                if (r >= 0)
                        r = sd_bus_message_close_container(m);
                if (r >= 0)
                        r = sd_bus_message_close_container(m);
        }
        if (r >= 0)
                r = sd_bus_message_close_container(m);
        if (r < 0)
                return epd__error(c, r, NULL);
        r = epd__send(c, m, &reply);
        if (r < 0)
                return r;

        const char *path;
        r = sd_bus_message_read(reply, "o", &path);
        if (r < 0)
                return epd__error(c, r, NULL);
        drop_arenas(c);
        r = sd_bus_message_enter_container(reply, 'a', "(sssttuh)");
        if (r < 0)
                goto fail; /* registered, but its arenas unreadable: undone below */
        for (;;) {
                const char *name, *domain, *usage;
                uint64_t size, data_offset;
                uint32_t gpu;
                int fd;
                r = sd_bus_message_read(reply, "(sssttuh)", &name, &domain, &usage, &size,
                                        &data_offset, &gpu, &fd);
                if (r < 0)
                        goto fail;
                if (r == 0)
                        break;
                epd_arena *n = realloc(c->arenas, (c->n_arenas + 1) * sizeof *n);
                if (!n) {
                        r = -ENOMEM;
                        goto fail;
                }
                c->arenas = n;
                epd_arena *a = &c->arenas[c->n_arenas];
                *a = (epd_arena){
                        .size = size,
                        .data_offset = data_offset,
                        .gpu = gpu == UINT32_MAX ? -1 : (int)gpu,
                        .fd = fcntl(fd, F_DUPFD_CLOEXEC, 3),
                        .name = strdup(name),
                        .domain = strdup(domain),
                        .usage = strdup(usage),
                };
                c->n_arenas++;
                if (a->fd < 0 || !a->name || !a->domain || !a->usage) {
                        r = a->fd < 0 ? -errno : -ENOMEM;
                        goto fail;
                }
        }
        c->worker_path = strdup(path);
        if (!c->worker_path) {
                r = -ENOMEM;
                goto fail;
        }
        return 0;
fail:
        drop_arenas(c);
        /* The daemon registered us: undo, so that nothing is left behind. */
        (void)epd__call(c, "/org/epd1", "org.epd1.Manager", "UnregisterWorker", NULL, "o", path);
        return epd__error(c, r, NULL);
}

int epd_unregister(epd_client *c) {
        if (!c || !c->worker_path)
                return epd__fail(c, -ENOTCONN, "this client is not registered");
        int r = epd__call(c, "/org/epd1", "org.epd1.Manager", "UnregisterWorker", NULL, "o",
                          c->worker_path);
        /* Refused for a time-out or a stalled daemon, the worker is still registered
         * there: kept here too (a register() would be refused Exists). Gone there
         * (NotRegistered) or here at once, it is forgotten. */
        if (r < 0 && r != -ENOTCONN && r != -ENOENT && sd_bus_is_open(c->bus) > 0)
                return r;
        free(c->worker_path);
        c->worker_path = NULL;
        drop_arenas(c);
        return r;
}

const char *epd_worker_path(const epd_client *c) {
        return c ? c->worker_path : NULL;
}

size_t epd_arena_count(const epd_client *c) {
        return c ? c->n_arenas : 0;
}

const epd_arena *epd_arena_get(const epd_client *c, size_t i) {
        return c && i < c->n_arenas ? &c->arenas[i] : NULL;
}

int epd_arena_find(const epd_client *c, const char *name) {
        for (size_t i = 0; c && i < c->n_arenas; i++)
                if (strcmp(c->arenas[i].name, name) == 0)
                        return (int)i;
        return -ENOENT;
}

int epd_arena_map(epd_client *c, size_t i, void **ret) {
        if (!c || i >= c->n_arenas)
                return epd__error(c, -EINVAL, NULL);
        epd_arena *a = &c->arenas[i];
        if (strcmp(a->domain, "host") != 0)
                return epd__error(c, -EOPNOTSUPP, NULL); /* GPU arenas: epd_gpu_arena_map() */
        if (!a->base) {
                /* The size is the daemon's word: a file shorter than it would fault
                 * (SIGBUS) at the first touch past its end. */
                struct stat st;
                if (fstat(a->fd, &st) < 0)
                        return epd__error(c, -errno, NULL);
                if ((uint64_t)st.st_size < a->size || a->data_offset > a->size)
                        return epd__fail(c, -EBADMSG,
                                         "arena %s: its file (%" PRIu64 " bytes) is shorter than the daemon's size (%" PRIu64
                                         ") or its data offset lies past that size",
                                         a->name, (uint64_t)st.st_size, a->size);
                void *p = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
                if (p == MAP_FAILED)
                        return epd__error(c, -errno, NULL);
                a->base = p;
        }
        *ret = a->base;
        return 0;
}

static int get_string_property(epd_client *c, const char *property, char **ret) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        if (!c || !ret)
                return epd__error(c, -EINVAL, NULL);
        epd__clear_error(c);
        int r = sd_bus_get_property_string(c->bus, EPD_DESTINATION(c), "/org/epd1",
                                           "org.epd1.Manager", property, &e, ret);
        if (r < 0)
                r = epd__error(c, r, &e);
        sd_bus_error_free(&e);
        return r;
}

int epd_get_version(epd_client *c, char **ret) {
        return get_string_property(c, "Version", ret);
}

int epd_get_host_id(epd_client *c, char **ret) {
        return get_string_property(c, "HostId", ret);
}

int epd_get_fd(epd_client *c) {
        if (!c)
                return -EINVAL;
        int r = sd_bus_get_fd(c->bus);
        return r < 0 ? epd__error(c, r, NULL) : r;
}

int epd_get_events(epd_client *c) {
        if (!c)
                return -EINVAL;
        int r = sd_bus_get_events(c->bus);
        return r < 0 ? epd__error(c, r, NULL) : r;
}

int epd_get_timeout(epd_client *c, uint64_t *ret_usec) {
        if (!c || !ret_usec)
                return epd__error(c, -EINVAL, NULL);
        int r = sd_bus_get_timeout(c->bus, ret_usec);
        return r < 0 ? epd__error(c, r, NULL) : r;
}

int epd_process(epd_client *c) {
        int r, n = 0;
        if (!c)
                return -EINVAL;
        while ((r = sd_bus_process(c->bus, NULL)) > 0)
                n++;
        return r < 0 ? epd__error(c, r, NULL) : n;
}

int epd_wait(epd_client *c, uint64_t timeout_usec) {
        if (!c)
                return -EINVAL;
        int r = sd_bus_wait(c->bus, timeout_usec);
        return r < 0 ? epd__error(c, r, NULL) : epd_process(c);
}
