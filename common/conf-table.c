/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "conf-table.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "parse-util.h"

int conf_table_set(const ConfTableItem *items, size_t n, void *base, const char *key, const char *value) {
        for (size_t i = 0; i < n; i++)
                if (strcasecmp(items[i].key, key) == 0)
                        return items[i].parse(value, (char *)base + items[i].offset);
        return -ENOENT;
}

int conf_parse_bool(const char *value, void *dst) {
        return parse_bool(value, dst);
}

int conf_parse_size(const char *value, void *dst) {
        return parse_size(value, dst);
}

int conf_parse_duration(const char *value, void *dst) {
        return parse_duration(value, dst);
}

int conf_parse_unsigned(const char *value, void *dst) {
        uint32_t v;
        int r = parse_u32(value, &v);
        if (r < 0)
                return r;
        *(unsigned *)dst = v;
        return 0;
}

int conf_parse_ratio(const char *value, void *dst) {
        char *end;
        /* Decimal digits and one point only, as the other strict parsers: strtod alone
         * takes leading blanks, hex floats and "-0". */
        if (!value[0] || strspn(value, "0123456789.") != strlen(value))
                return -EINVAL;
        errno = 0;
        double v = strtod(value, &end);
        if (errno != 0 || end == value || *end != '\0' || !isfinite(v) || v < 0)
                return -EINVAL;
        *(double *)dst = v;
        return 0;
}
