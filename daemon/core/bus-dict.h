/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Options and hints passed as a{sv}, read by a table: every key must be one of the
 * table's, with a value of its type; anything else is refused with
 * org.epd1.Error.InvalidArgument naming the key, the type it must have and, for an
 * unknown key, the keys there are. Checks of the values themselves stay with the
 * caller, after the read. */

#include <stdbool.h>
#include <stddef.h>
#include <systemd/sd-bus.h>

typedef struct BusDictItem {
        const char *key;
        /* The variant's type and where its value goes in the destination struct:
         * "s" and "o" const char * (valid while the message is), "b" bool, "u" uint32_t,
         * "t" uint64_t, "as" char ** (a NULL-terminated array the caller frees). */
        const char *signature;
        size_t offset;
        /* A bool in the destination set when the key was given; BUS_DICT_NO_FLAG: none. */
        size_t given;
} BusDictItem;

#define BUS_DICT_NO_FLAG ((size_t)-1)
#define BUS_DICT(k, sig, type, field) { .key = (k), .signature = (sig), .offset = offsetof(type, field), .given = BUS_DICT_NO_FLAG }
#define BUS_DICT_FLAG(k, sig, type, field, flag) \
        { .key = (k), .signature = (sig), .offset = offsetof(type, field), .given = offsetof(type, flag) }

/* Reads the a{sv} at the message's position into dest by items (ended by an entry
 * whose key is NULL). `what` names an entry in errors ("option", "hint"). A key given
 * twice takes its last value. Returns 0, or a negative errno with `error` set. */
int bus_dict_read(sd_bus_message *msg, const BusDictItem *items, void *dest, const char *what,
                  sd_bus_error *error);

/* Frees a NULL-terminated string array read for an "as" entry. */
void bus_dict_strv_free(char **l);
