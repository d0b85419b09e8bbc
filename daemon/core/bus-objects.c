/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/bus-objects.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int bus_enumerate_paths(Hashmap *h, size_t path_offset, bool (*keep)(const void *o, void *userdata),
                        void *userdata, char ***ret) {
        size_t n = hashmap_size(h), i = 0, it = 0;
        char **l = calloc(n + 1, sizeof *l);
        void *o;

        if (!l)
                return -ENOMEM;
        while (hashmap_iterate(h, &it, &o, NULL)) {
                if (keep && !keep(o, userdata))
                        continue;
                l[i] = strdup(*(char **)((char *)o + path_offset));
                if (!l[i]) {
                        while (i > 0)
                                free(l[--i]);
                        free(l);
                        return -ENOMEM;
                }
                i++;
        }
        *ret = l;
        return 0;
}
