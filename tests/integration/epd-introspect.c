/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Development helper: prints the live introspection XML of an object of epdd, over
 * the direct socket (busctl cannot speak peer to peer). Used to write the XML in dbus/:
 *   epd-introspect /run/epd/bus /org/epd1 */
#include <stdio.h>
#include <systemd/sd-bus.h>

int main(int argc, char *argv[]) {
        sd_bus *bus = NULL;
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        const char *xml;
        char addr[512];
        if (argc != 3) {
                fprintf(stderr, "Usage: epd-introspect SOCKET PATH\n");
                return 2;
        }
        snprintf(addr, sizeof addr, "unix:path=%s", argv[1]);
        if (sd_bus_new(&bus) < 0 || sd_bus_set_address(bus, addr) < 0 || sd_bus_start(bus) < 0 ||
            sd_bus_call_method(bus, NULL, argv[2], "org.freedesktop.DBus.Introspectable",
                               "Introspect", &e, &reply, NULL) < 0 ||
            sd_bus_message_read(reply, "s", &xml) < 0) {
                fprintf(stderr, "Introspection failed: %s\n", e.message ? e.message : "cannot connect");
                return 1;
        }
        fputs(xml, stdout);
        sd_bus_message_unref(reply);
        sd_bus_flush_close_unref(bus);
        return 0;
}
