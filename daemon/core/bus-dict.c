/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/bus-dict.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"

void bus_dict_strv_free(char **l) {
        for (char **i = l; i && *i; i++)
                free(*i);
        free(l);
}

static int unknown_key(const BusDictItem *items, const char *key, const char *what, sd_bus_error *error) {
        char keys[512] = "";
        size_t n = 0;
        for (const BusDictItem *i = items; i->key && n < sizeof keys; i++)
                n += (size_t)snprintf(keys + n, sizeof keys - n, "%s%s", n ? ", " : "", i->key);
        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Unknown %s '%s'; the %ss are: %s.", what, key,
                             what, keys);
}

static int read_value(sd_bus_message *msg, const BusDictItem *i, void *dest) {
        void *p = (uint8_t *)dest + i->offset;
        int r;

        switch (i->signature[0]) {
        case 's':
        case 'o':
                return sd_bus_message_read(msg, "v", i->signature, (const char **)p);
        case 'b': {
                int b;
                r = sd_bus_message_read(msg, "v", "b", &b);
                if (r >= 0)
                        *(bool *)p = b;
                return r;
        }
        case 'u':
                return sd_bus_message_read(msg, "v", "u", (uint32_t *)p);
        case 't':
                return sd_bus_message_read(msg, "v", "t", (uint64_t *)p);
        case 'a': {
                char **l = NULL;
                r = sd_bus_message_enter_container(msg, 'v', "as");
                if (r >= 0)
                        r = sd_bus_message_read_strv(msg, &l);
                if (r >= 0)
                        r = sd_bus_message_exit_container(msg);
                if (r < 0) {
                        bus_dict_strv_free(l);
                        return r;
                }
                bus_dict_strv_free(*(char ***)p);
                *(char ***)p = l;
                return 0;
        }
        default:
                return -EINVAL;
        }
}

int bus_dict_read(sd_bus_message *msg, const BusDictItem *items, void *dest, const char *what,
                  sd_bus_error *error) {
        int r = sd_bus_message_enter_container(msg, 'a', "{sv}");
        if (r < 0)
                return r;
        while ((r = sd_bus_message_enter_container(msg, 'e', "sv")) > 0) {
                const char *key, *contents;
                const BusDictItem *i;

                r = sd_bus_message_read(msg, "s", &key);
                if (r < 0)
                        return r;
                for (i = items; i->key && strcmp(i->key, key) != 0; i++)
                        ;
                if (!i->key)
                        return unknown_key(items, key, what, error);
                r = sd_bus_message_peek_type(msg, NULL, &contents);
                if (r < 0)
                        return r;
                if (strcmp(contents, i->signature) != 0)
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                             "The %s '%s' must have type '%s', not '%s'.", what, key, i->signature,
                                             contents);
                r = read_value(msg, i, dest);
                if (r < 0)
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "The %s '%s' cannot be read: %s.", what,
                                             key, strerror(-r));
                if (i->given != BUS_DICT_NO_FLAG)
                        *(bool *)((uint8_t *)dest + i->given) = true;
                r = sd_bus_message_exit_container(msg);
                if (r < 0)
                        return r;
        }
        if (r < 0)
                return r;
        return sd_bus_message_exit_container(msg);
}
