/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/bus-glue.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "macro.h"
#include "time-util.h"

static const char *strna(const char *s) {
        return s ? s : "n/a";
}

/* One entry per interface: the vtable as written and the copy that is served. The
 * copies live as long as the process (sd-bus keeps pointers into them). */
typedef struct GlueVtable {
        char *interface;
        const sd_bus_vtable *original;
        sd_bus_vtable *served;
} GlueVtable;

#define GLUE_MAX 64
static GlueVtable glue[GLUE_MAX];
static size_t n_glue;
static pthread_mutex_t glue_lock = PTHREAD_MUTEX_INITIALIZER;

static const sd_bus_vtable *glue_find(const char *interface, const char *member, int type) {
        const sd_bus_vtable *found = NULL;
        if (!interface || !member)
                return NULL;
        pthread_mutex_lock(&glue_lock);
        for (size_t i = 0; i < n_glue && !found; i++) {
                if (strcmp(glue[i].interface, interface) != 0)
                        continue;
                for (const sd_bus_vtable *v = glue[i].original; v->type != _SD_BUS_VTABLE_END; v++) {
                        if (v->type != type && !(type == _SD_BUS_VTABLE_PROPERTY &&
                                                 v->type == _SD_BUS_VTABLE_WRITABLE_PROPERTY))
                                continue;
                        const char *name = v->type == _SD_BUS_VTABLE_METHOD ? v->x.method.member : v->x.property.member;
                        if (strcmp(name, member) == 0) {
                                found = v;
                                break;
                        }
                }
        }
        pthread_mutex_unlock(&glue_lock);
        return found;
}

/* Errnos that only sd-bus's message readers return: a value that is not what its type
 * or signature says. */
static bool reader_errno(int r) {
        return r == -ENXIO || r == -EBADMSG || r == -ENOMSG;
}

int bus_glue_name_error(sd_bus_error *error, int r, const char *interface, const char *member) {
        char text[512];

        if (sd_bus_error_is_set(error)) {
                if (strncmp(error->name, "org.epd1.Error.", 15) == 0)
                        return r;
                /* Another namespace: keep the message, take the name from the table. */
                int e = sd_bus_error_get_errno(error);
                snprintf(text, sizeof text, "%s.%s: %s", interface, member, error->message ? error->message : "");
                sd_bus_error_free(error);
                (void)epd_bus_error_errno(error, -(e > 0 ? e : EIO), text);
                return r < 0 ? r : -(e > 0 ? e : EIO);
        }
        if (r >= 0)
                return r;
        if (reader_errno(r))
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "%s.%s: an argument cannot be read (%s).",
                                     interface, member, strerror(-r));
        snprintf(text, sizeof text, "%s.%s: %s.", interface, member, strerror(-r));
        return epd_bus_error_errno(error, r, text);
}

int bus_glue_require_fds(sd_bus_message *msg, const char *what, sd_bus_error *error) {
        if (sd_bus_can_send(sd_bus_message_get_bus(msg), SD_BUS_TYPE_UNIX_FD) > 0)
                return 0;
        return epd_bus_error(error, EPD_ERROR_UNSUPPORTED,
                             "%s answers with file descriptors, which this connection cannot carry (connect over a "
                             "Unix socket with fd passing).", what);
}

int bus_glue_reply_errno(sd_bus_message *call, int r, const char *message) {
        _cleanup_(sd_bus_error_free) sd_bus_error e = SD_BUS_ERROR_NULL;
        (void)epd_bus_error_errno(&e, r < 0 ? r : -EIO, message);
        return sd_bus_reply_method_error(call, &e);
}

/* Per thread: the handlers run on their event loop's thread, which reads these. */
static _Thread_local uint64_t slow_generation;
static _Thread_local char slow_what[160];

uint64_t bus_glue_slow_generation(void) {
        return slow_generation;
}

const char *bus_glue_slow_what(void) {
        return slow_what;
}

static void note_slow(uint64_t since, const char *verb, const char *interface, const char *member) {
        if (now_usec(CLOCK_MONOTONIC) - since < BUS_GLUE_SLOW_USEC)
                return;
        snprintf(slow_what, sizeof slow_what, "%s%s%s.%s", verb, *verb ? " " : "", strna(interface), strna(member));
        slow_generation++;
}

static int method_wrapped(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        const char *interface = sd_bus_message_get_interface(m), *member = sd_bus_message_get_member(m);
        const sd_bus_vtable *v = glue_find(interface, member, _SD_BUS_VTABLE_METHOD);
        if (!v || !v->x.method.handler)
                return epd_bus_error(error, EPD_ERROR_FAILED, "No handler for %s.%s.", strna(interface),
                                     strna(member));
        uint64_t t0 = now_usec(CLOCK_MONOTONIC);
        int r = v->x.method.handler(m, userdata, error);
        note_slow(t0, "", interface, member);
        return bus_glue_name_error(error, r, interface, member);
}

static int get_wrapped(sd_bus *bus, const char *path, const char *interface, const char *property,
                       sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        const sd_bus_vtable *v = glue_find(interface, property, _SD_BUS_VTABLE_PROPERTY);
        if (!v || !v->x.property.get)
                return epd_bus_error(error, EPD_ERROR_FAILED, "No getter for %s.%s.", strna(interface),
                                     strna(property));
        uint64_t t0 = now_usec(CLOCK_MONOTONIC);
        int r = v->x.property.get(bus, path, interface, property, reply, userdata, error);
        note_slow(t0, "Get", interface, property);
        return bus_glue_name_error(error, r, interface, property);
}

static int set_wrapped(sd_bus *bus, const char *path, const char *interface, const char *property,
                       sd_bus_message *value, void *userdata, sd_bus_error *error) {
        const sd_bus_vtable *v = glue_find(interface, property, _SD_BUS_VTABLE_PROPERTY);
        if (!v || !v->x.property.set)
                return epd_bus_error(error, EPD_ERROR_FAILED, "No setter for %s.%s.", strna(interface),
                                     strna(property));
        return bus_glue_name_error(error, v->x.property.set(bus, path, interface, property, value, userdata, error),
                                   interface, property);
}

static int glue_served(const char *interface, const sd_bus_vtable *vtable, const sd_bus_vtable **ret) {
        int r = 0;
        pthread_mutex_lock(&glue_lock);
        for (size_t i = 0; i < n_glue; i++)
                if (strcmp(glue[i].interface, interface) == 0) {
                        /* One vtable per interface: the wrappers find handlers by name. */
                        if (glue[i].original != vtable)
                                r = -EEXIST;
                        else
                                *ret = glue[i].served;
                        goto out;
                }
        if (n_glue == GLUE_MAX) {
                r = -E2BIG;
                goto out;
        }
        size_t n = 0;
        while (vtable[n].type != _SD_BUS_VTABLE_END)
                n++;
        sd_bus_vtable *copy = calloc(n + 1, sizeof *copy);
        char *name = strdup(interface);
        if (!copy || !name) {
                free(copy);
                free(name);
                r = -ENOMEM;
                goto out;
        }
        memcpy(copy, vtable, (n + 1) * sizeof *copy);
        for (size_t i = 0; i < n; i++)
                switch (copy[i].type) {
                case _SD_BUS_VTABLE_METHOD:
                        if (copy[i].x.method.handler)
                                copy[i].x.method.handler = method_wrapped;
                        break;
                case _SD_BUS_VTABLE_WRITABLE_PROPERTY:
                        if (copy[i].x.property.set)
                                copy[i].x.property.set = set_wrapped;
                        __attribute__((fallthrough));
                case _SD_BUS_VTABLE_PROPERTY:
                        if (copy[i].x.property.get)
                                copy[i].x.property.get = get_wrapped;
                        break;
                default:
                        break;
                }
        glue[n_glue++] = (GlueVtable){ .interface = name, .original = vtable, .served = copy };
        *ret = copy;
out:
        pthread_mutex_unlock(&glue_lock);
        return r;
}

int bus_glue_add_vtable(sd_bus *bus, const char *path, const char *interface, const sd_bus_vtable *vtable,
                        sd_bus_object_find_t find, void *userdata) {
        const sd_bus_vtable *served = NULL;
        int r = glue_served(interface, vtable, &served);
        if (r < 0)
                return r;
        if (find)
                return sd_bus_add_fallback_vtable(bus, NULL, path, interface, served, find, userdata);
        return sd_bus_add_object_vtable(bus, NULL, path, interface, served, userdata);
}

/* The length of the complete type at the start of a (valid) signature. */
static size_t type_length(const char *s) {
        if (!*s)
                return 0;
        if (*s == 'a') {
                size_t n = type_length(s + 1);
                return n ? n + 1 : 0;
        }
        if (*s == '(' || *s == '{') {
                char close = *s == '(' ? ')' : '}';
                size_t i = 1;
                while (s[i] && s[i] != close) {
                        size_t n = type_length(s + i);
                        if (!n)
                                return 0;
                        i += n;
                }
                return s[i] ? i + 1 : 0;
        }
        return 1;
}

static int argument_check(sd_bus_message *m, void *userdata, sd_bus_error *unused) {
        (void)userdata, (void)unused;
        if (!sd_bus_message_is_method_call(m, NULL, NULL))
                return 0;
        const char *interface = sd_bus_message_get_interface(m), *member = sd_bus_message_get_member(m);
        const sd_bus_vtable *v = glue_find(interface, member, _SD_BUS_VTABLE_METHOD);
        if (!v)
                return 0; /* sd-bus's routing answers */
        const char *want = v->x.method.signature ? v->x.method.signature : "";
        const char *got = sd_bus_message_get_signature(m, true);
        if (!got)
                got = "";
        if (strcmp(want, got) == 0)
                return 0;

        /* The first argument that differs, by complete types, with its name. */
        const char *names = v->x.method.names, *w = want, *g = got;
        unsigned index = 0;
        for (;;) {
                size_t lw = type_length(w), lg = type_length(g);
                if (lw != lg || strncmp(w, g, lw) != 0 || !lw)
                        break;
                w += lw, g += lg, index++;
                if (names && *names)
                        names += strlen(names) + 1;
        }
        char name[64];
        if (names && *names)
                snprintf(name, sizeof name, "%s", names);
        else
                snprintf(name, sizeof name, "argument %u", index + 1);
        size_t lw = type_length(w), lg = type_length(g);
        _cleanup_(sd_bus_error_free) sd_bus_error e = SD_BUS_ERROR_NULL;
        if (lw && lg)
                (void)epd_bus_error(&e, EPD_ERROR_INVALID_ARGUMENT,
                                    "%s.%s: argument '%s' must have type '%.*s', not '%.*s' (the arguments are "
                                    "'%s').",
                                    interface, member, name, (int)lw, w, (int)lg, g, want);
        else if (lw)
                (void)epd_bus_error(&e, EPD_ERROR_INVALID_ARGUMENT,
                                    "%s.%s: argument '%s' (type '%.*s') is missing (the arguments are '%s', not "
                                    "'%s').",
                                    interface, member, name, (int)lw, w, want, got);
        else
                (void)epd_bus_error(&e, EPD_ERROR_INVALID_ARGUMENT,
                                    "%s.%s: too many arguments: '%s' where the arguments are '%s'.", interface,
                                    member, got, want);
        int r = sd_bus_reply_method_error(m, &e);
        return r < 0 ? r : 1;
}

int bus_glue_add_argument_check(sd_bus *bus) {
        return sd_bus_add_filter(bus, NULL, argument_check, NULL);
}
