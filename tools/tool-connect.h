/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* How the tools (epdctl, epdtop, epd-demo) take --address= and say where they tried to
 * connect: the forms libepd knows, checked before connecting (a bare path is refused
 * with the direct: form it probably meant), and, without --address, the place libepd's
 * own order picks ($EPD_SOCKET, $EPD_BUS_ADDRESS, /run/epd/bus, the system bus). */

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "epd/epd.h"

#define TOOL_ADDRESS_FORMS                                                                         \
        "direct:PATH (epdd's direct socket, e.g. direct:/run/epd/bus), bus:ADDRESS (a D-Bus bus "  \
        "where epdd owns org.epd1, e.g. bus:unix:path=/run/dbus/system_bus_socket) or system"

/* 0 when libepd accepts the form; otherwise prints why to stderr and returns -EINVAL. */
static inline int tool_address_check(const char *prog, const char *address) {
        if (!address || strncmp(address, "direct:", 7) == 0 || strncmp(address, "bus:", 4) == 0 ||
            strcmp(address, "system") == 0) {
                if (address && strncmp(address, "direct:", 7) == 0 && address[7] != '/') {
                        fprintf(stderr, "%s: --address=%s: direct: needs an absolute socket path.\n", prog, address);
                        return -EINVAL;
                }
                return 0;
        }
        fprintf(stderr, "%s: --address=%s: expected " TOOL_ADDRESS_FORMS ".\n", prog, address);
        if (address[0] == '/')
                fprintf(stderr, "%s: did you mean --address=direct:%s?\n", prog, address);
        else if (strncmp(address, "unix:", 5) == 0)
                fprintf(stderr, "%s: did you mean --address=bus:%s (a D-Bus address)?\n", prog, address);
        return -EINVAL;
}

/* Where epd_connect(address) goes, in words, for the error message. */
static inline void tool_address_describe(const char *address, char *buf, size_t n) {
        const char *e;
        if (address)
                snprintf(buf, n, "%s", address);
        else if ((e = getenv("EPD_SOCKET")) && *e)
                snprintf(buf, n, "direct:%s (from $EPD_SOCKET)", e);
        else if ((e = getenv("EPD_BUS_ADDRESS")) && *e)
                snprintf(buf, n, "bus:%s (from $EPD_BUS_ADDRESS)", e);
        else if (access("/run/epd/bus", F_OK) == 0)
                snprintf(buf, n, "direct:/run/epd/bus (the default socket)");
        else
                snprintf(buf, n, "the system bus (no --address, $EPD_SOCKET or /run/epd/bus)");
}

/* epd_connect() that says where it tried when it fails. */
static inline int tool_connect(const char *prog, const char *address, epd_client **ret) {
        int r = epd_connect(address, ret);
        if (r < 0) {
                char where[512];
                tool_address_describe(address, where, sizeof where);
                fprintf(stderr, "%s: cannot connect to epdd at %s: %s%s\n", prog, where, strerror(-r),
                        r == -ENOENT || r == -ECONNREFUSED ? " (is epdd running there?)"
                        : r == -EACCES || r == -EPERM       ? " (not root and not in group epd?)"
                                                            : "");
        }
        return r;
}
