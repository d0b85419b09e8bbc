/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Helpers for the bus-*.c files that publish a table of objects under a path prefix
 * (workers, sequences, handoffs): one node enumerator for them all. */

#include <stdbool.h>
#include <stddef.h>

#include <systemd/sd-bus.h>

#include "hashmap.h"

/* The object paths of the objects in h, as the NULL-terminated list an sd-bus node
 * enumerator returns: each value is an object whose `char *` object path is at
 * path_offset (offsetof(Type, path)). With keep, only those it keeps (the objects the
 * reader may see; docs/security.md). */
int bus_enumerate_paths(Hashmap *h, size_t path_offset, bool (*keep)(const void *o, void *userdata),
                        void *userdata, char ***ret);

/* Defines `static int name(...)`, an sd_bus_property_get_t whose body sees the property's
 * object as `Type *var` (the vtable's userdata) beside the getter's arguments (bus,
 * reply, error, ...). */
#define BUS_PROPERTY_GETTER(name, Type, var, ...)                                        \
        static int name(sd_bus *bus, const char *path, const char *interface,            \
                        const char *property, sd_bus_message *reply, void *userdata,      \
                        sd_bus_error *error) {                                            \
                Type *var = userdata;                                                    \
                __VA_ARGS__                                                              \
        }
