/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Test helper: prints the signals epdd sends on one direct connection, one line each,
 * for SECONDS (busctl monitor needs a bus broker; epdd's socket is peer to peer):
 *   epd-signals SOCKET SECONDS
 * "ready" once connected and subscribed (Manager.Subscribe answered: the broadcast
 * signals from then on reach this helper),
 * then per signal "PATH INTERFACE MEMBER ARG...": basic arguments as text, a container
 * as "[...]"; PropertiesChanged as "PATH org.freedesktop.DBus.Properties
 * PropertiesChanged IFACE NAME=VALUE..." for the basic values it carries and
 * "NAME=?" for the others. Exit 0 at the end of SECONDS, 1 when the daemon goes away
 * or on errors. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <systemd/sd-bus.h>

static int print_basic(sd_bus_message *m, char type) {
        union {
                uint8_t y;
                int b;
                int16_t n;
                uint16_t q;
                int32_t i;
                uint32_t u;
                int64_t x;
                uint64_t t;
                double d;
                const char *s;
        } v;
        int r = sd_bus_message_read_basic(m, type, &v);
        if (r < 0)
                return r;
        switch (type) {
        case 'y': printf("%u", v.y); break;
        case 'b': printf("%s", v.b ? "true" : "false"); break;
        case 'n': printf("%d", v.n); break;
        case 'q': printf("%u", v.q); break;
        case 'i': printf("%" PRIi32, v.i); break;
        case 'u': printf("%" PRIu32, v.u); break;
        case 'x': printf("%" PRIi64, v.x); break;
        case 't': printf("%" PRIu64, v.t); break;
        case 'd': printf("%g", v.d); break;
        case 'h': printf("fd"); break;
        default: printf("%s", v.s); break; /* s, o, g */
        }
        return 0;
}

static int print_args(sd_bus_message *m) {
        char type;
        const char *contents;
        int r;

        while ((r = sd_bus_message_peek_type(m, &type, &contents)) > 0) {
                printf(" ");
                if (type == SD_BUS_TYPE_ARRAY || type == SD_BUS_TYPE_STRUCT || type == SD_BUS_TYPE_VARIANT ||
                    type == SD_BUS_TYPE_DICT_ENTRY) {
                        printf("[...]");
                        r = sd_bus_message_skip(m, NULL);
                } else
                        r = print_basic(m, type);
                if (r < 0)
                        return r;
        }
        return r;
}

static int print_properties_changed(sd_bus_message *m) {
        const char *iface, *name, *contents;
        char type;
        int r;

        r = sd_bus_message_read(m, "s", &iface);
        if (r < 0)
                return r;
        printf(" %s", iface);
        r = sd_bus_message_enter_container(m, 'a', "{sv}");
        if (r < 0)
                return r;
        while ((r = sd_bus_message_enter_container(m, 'e', "sv")) > 0) {
                r = sd_bus_message_read(m, "s", &name);
                if (r >= 0)
                        r = sd_bus_message_peek_type(m, &type, &contents);
                if (r < 0)
                        return r;
                printf(" %s=", name);
                if (contents && strlen(contents) == 1 && strchr("ybnqiuxtdsog", contents[0])) {
                        r = sd_bus_message_enter_container(m, 'v', contents);
                        if (r >= 0)
                                r = print_basic(m, contents[0]);
                        if (r >= 0)
                                r = sd_bus_message_exit_container(m);
                } else {
                        printf("?");
                        r = sd_bus_message_skip(m, "v");
                }
                if (r >= 0)
                        r = sd_bus_message_exit_container(m);
                if (r < 0)
                        return r;
        }
        if (r < 0)
                return r;
        r = sd_bus_message_exit_container(m);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(m, 'a', "s");
        while (r >= 0 && (r = sd_bus_message_read(m, "s", &name)) > 0)
                printf(" %s=?", name);
        return r < 0 ? r : sd_bus_message_exit_container(m);
}

static int on_message(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        uint8_t type;
        int r;

        (void)userdata;
        (void)error;
        if (sd_bus_message_get_type(m, &type) < 0 || type != SD_BUS_MESSAGE_SIGNAL)
                return 0;
        printf("%s %s %s", sd_bus_message_get_path(m), sd_bus_message_get_interface(m),
               sd_bus_message_get_member(m));
        if (sd_bus_message_is_signal(m, "org.freedesktop.DBus.Properties", "PropertiesChanged"))
                r = print_properties_changed(m);
        else
                r = print_args(m);
        printf("%s\n", r < 0 ? " (unreadable)" : "");
        fflush(stdout);
        return 0;
}

static uint64_t now_usec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

int main(int argc, char *argv[]) {
        sd_bus *bus = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        char addr[512];
        uint64_t end;
        int r;

        if (argc != 3) {
                fprintf(stderr, "Usage: epd-signals SOCKET SECONDS\n");
                return 2;
        }
        end = now_usec() + (uint64_t)(strtod(argv[2], NULL) * 1e6);
        snprintf(addr, sizeof addr, "unix:path=%s", argv[1]);
        if (sd_bus_new(&bus) < 0 || sd_bus_set_address(bus, addr) < 0 ||
            sd_bus_add_filter(bus, NULL, on_message, NULL) < 0 || sd_bus_start(bus) < 0 ||
            sd_bus_call_method(bus, NULL, "/org/epd1", "org.epd1.Manager", "Subscribe", &e, NULL, "b", 1) < 0) {
                fprintf(stderr, "epd-signals: cannot reach %s: %s\n", argv[1], e.message ? e.message : "");
                return 1;
        }
        printf("ready\n");
        fflush(stdout);
        for (uint64_t t; (t = now_usec()) < end;) {
                r = sd_bus_process(bus, NULL);
                if (r < 0) {
                        fprintf(stderr, "epd-signals: %s\n", strerror(-r));
                        return 1;
                }
                if (r > 0)
                        continue;
                r = sd_bus_wait(bus, end - t);
                if (r < 0 && r != -EINTR) {
                        fprintf(stderr, "epd-signals: %s\n", strerror(-r));
                        return 1;
                }
        }
        sd_bus_flush_close_unref(bus);
        return 0;
}
