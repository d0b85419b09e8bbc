/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The bus glue's one error mechanism (docs/api.md, "Errors"). Every interface is added
 * through bus_glue_add_vtable(), which serves a copy of its vtable whose method handlers
 * and property getters/setters are wrapped: a negative return without an error set, or
 * an error of another namespace (System.Error.*, org.freedesktop.DBus.Error.*), becomes
 * the org.epd1.Error.* that epd_bus_error_errno() maps its errno to, naming the method or
 * property. bus_glue_add_argument_check() refuses a call whose arguments do not have the
 * method's signature with org.epd1.Error.InvalidArgument naming the first argument that
 * is wrong and the type it must have (sd-bus would answer a bare InvalidArgs). */

#include <systemd/sd-bus.h>

/* sd_bus_add_object_vtable() when find is NULL, sd_bus_add_fallback_vtable() otherwise
 * (path is then the prefix). */
int bus_glue_add_vtable(sd_bus *bus, const char *path, const char *interface, const sd_bus_vtable *vtable,
                        sd_bus_object_find_t find, void *userdata);

/* Installs the argument check on one connection (a filter ahead of sd-bus's dispatch). */
int bus_glue_add_argument_check(sd_bus *bus);

/* The error reply to a call answered later (after its handler returned): the name that
 * the errno r maps to (epd_bus_error_errno()), `message` (may be NULL) as its text. For
 * a deferred reply that cannot be built, so that the caller is answered all the same. */
int bus_glue_reply_errno(sd_bus_message *call, int r, const char *message);

/* 0 when the connection the call came on can carry file descriptors; else the named
 * Unsupported error in `error`, saying that `what` needs them (a client of the direct
 * socket that did not negotiate fd passing). On a bus this is epdd's own link to the
 * broker, which passes fds: whether the caller's does is the broker's to know (a reply
 * it cannot deliver is dropped there). */
int bus_glue_require_fds(sd_bus_message *msg, const char *what, sd_bus_error *error);

/* Turns the outcome r of a handler for interface.member into a named error in `error`:
 * what the wrapped handlers do, exposed for the unit test. Returns r. */
int bus_glue_name_error(sd_bus_error *error, int r, const char *interface, const char *member);

/* The wrapped handlers also time themselves: the last method or property access that
 * took BUS_GLUE_SLOW_USEC or longer is named here ("org.epd1.Gpu.RegisterMemory",
 * "Get org.epd1.Pages.Pools"), with a generation that counts such calls, so that the
 * event loop's stall accounting (manager.c) can say which call held it. */
#define BUS_GLUE_SLOW_USEC 1000U
uint64_t bus_glue_slow_generation(void);
const char *bus_glue_slow_what(void);
