/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fault injection for test-connections and test-bus-errors: preloaded into epdd, it
 * makes one call of the sd-bus functions below fail with -ENOMEM (those that set up a
 * direct connection; those a handler builds its reply with). The plan is
 * the file named by $EPD_FAULT_FILE: "FUNCTION N" fails the Nth call of FUNCTION
 * counted from when the file was written (each new plan, a new inode, restarts the
 * count); no file, no fault. Only calls the real library would have made are counted,
 * and the real function runs for every call that does not fail. Also memfd_create()
 * of a worker's ring ("epd-ring"), failing with EMFILE as when epdd is out of fds.
 * With $EPD_FAULT_SNDBUF=N, a socket's send buffer is set to N bytes at most (sd-bus asks
 * for 8 MiB), so that a test fills a client's socket with a few hundred messages. */
#include <dlfcn.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <systemd/sd-bus.h>

static ino_t plan_ino;
static unsigned count;

static bool fail_now(const char *fn) {
        const char *path = getenv("EPD_FAULT_FILE");
        char name[64];
        unsigned n;
        struct stat st;
        if (!path || stat(path, &st) < 0)
                return false;
        if (st.st_ino != plan_ino) {
                plan_ino = st.st_ino;
                count = 0;
        }
        FILE *f = fopen(path, "re");
        if (!f)
                return false;
        int k = fscanf(f, "%63s %u", name, &n);
        fclose(f);
        if (k != 2 || strcmp(name, fn) != 0)
                return false;
        return ++count == n;
}

#define REAL(fn) ((__typeof__(&fn))dlsym(RTLD_NEXT, #fn))

int setsockopt(int fd, int level, int name, const void *value, socklen_t len) {
        static int (*real)(int, int, int, const void *, socklen_t);
        const char *cap = getenv("EPD_FAULT_SNDBUF");
        if (!real)
                real = (int (*)(int, int, int, const void *, socklen_t))dlsym(RTLD_NEXT, "setsockopt");
        if (cap && level == SOL_SOCKET && (name == SO_SNDBUF || name == SO_SNDBUFFORCE) && len == sizeof(int) &&
            *(const int *)value > atoi(cap)) {
                int v = atoi(cap);
                return real(fd, level, name, &v, sizeof v);
        }
        return real(fd, level, name, value, len);
}

int memfd_create(const char *name, unsigned int flags) {
        if (name && strcmp(name, "epd-ring") == 0 && fail_now(__func__)) {
                errno = EMFILE;
                return -1;
        }
        return REAL(memfd_create)(name, flags);
}

int sd_bus_add_object_vtable(sd_bus *bus, sd_bus_slot **slot, const char *path, const char *interface,
                             const sd_bus_vtable *vtable, void *userdata) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_add_object_vtable)(bus, slot, path, interface, vtable, userdata);
}

int sd_bus_add_fallback_vtable(sd_bus *bus, sd_bus_slot **slot, const char *prefix, const char *interface,
                               const sd_bus_vtable *vtable, sd_bus_object_find_t find, void *userdata) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_add_fallback_vtable)(bus, slot, prefix, interface, vtable, find, userdata);
}

int sd_bus_add_node_enumerator(sd_bus *bus, sd_bus_slot **slot, const char *path,
                               sd_bus_node_enumerator_t callback, void *userdata) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_add_node_enumerator)(bus, slot, path, callback, userdata);
}

int sd_bus_match_signal(sd_bus *bus, sd_bus_slot **ret, const char *sender, const char *path,
                        const char *interface, const char *member, sd_bus_message_handler_t callback,
                        void *userdata) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_match_signal)(bus, ret, sender, path, interface, member, callback, userdata);
}

int sd_bus_set_description(sd_bus *bus, const char *description) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_set_description)(bus, description);
}

int sd_bus_start(sd_bus *bus) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_start)(bus);
}

int sd_bus_attach_event(sd_bus *bus, sd_event *e, int priority) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_attach_event)(bus, e, priority);
}

/* test-connections' credentials test: the daemon cannot read a caller's credentials. */
int sd_bus_query_sender_creds(sd_bus_message *m, uint64_t mask, sd_bus_creds **creds) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_query_sender_creds)(m, mask, creds);
}

/* test-bus-errors: a method handler's own reply cannot be made, so the handler returns a
 * bare errno (the bus glue must name it). */
int sd_bus_message_new_method_return(sd_bus_message *call, sd_bus_message **m) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_message_new_method_return)(call, m);
}

/* test-bus-errors: a property getter cannot build its value. Calls inside libsystemd
 * count too (sd-bus opens the variant around a property's value itself). */
int sd_bus_message_open_container(sd_bus_message *m, char type, const char *contents) {
        if (fail_now(__func__))
                return -ENOMEM;
        return REAL(sd_bus_message_open_container)(m, type, contents);
}
