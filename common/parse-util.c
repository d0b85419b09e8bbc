/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "parse-util.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <inttypes.h>

#include "macro.h"

int parse_bool(const char *s, bool *ret) {
        static const char *const yes[] = { "1", "yes", "y", "true", "t", "on" };
        static const char *const no[] = { "0", "no", "n", "false", "f", "off" };
        if (!s)
                return -EINVAL;
        for (size_t i = 0; i < ELEMENTSOF(yes); i++)
                if (strcasecmp(s, yes[i]) == 0) {
                        *ret = true;
                        return 0;
                }
        for (size_t i = 0; i < ELEMENTSOF(no); i++)
                if (strcasecmp(s, no[i]) == 0) {
                        *ret = false;
                        return 0;
                }
        return -EINVAL;
}

static int parse_u64_prefix(const char *s, uint64_t *ret, const char **end) {
        char *e;
        if (!s || !isdigit((unsigned char)*s))
                return -EINVAL;
        errno = 0;
        unsigned long long v = strtoull(s, &e, 10);
        if (errno == ERANGE)
                return -ERANGE;
        if (errno)
                return -EINVAL;
        *ret = v;
        *end = e;
        return 0;
}

int parse_u64(const char *s, uint64_t *ret) {
        const char *e;
        uint64_t v;
        int r = parse_u64_prefix(s, &v, &e);
        if (r < 0)
                return r;
        if (*e)
                return -EINVAL;
        *ret = v;
        return 0;
}

int parse_u32(const char *s, uint32_t *ret) {
        uint64_t v;
        int r = parse_u64(s, &v);
        if (r < 0)
                return r;
        if (v > UINT32_MAX)
                return -ERANGE;
        *ret = (uint32_t)v;
        return 0;
}

/* A number with one of the table's unit suffixes, times the unit's factor. */
typedef struct Unit {
        const char *suffix;
        uint64_t factor;
} Unit;

static int parse_with_unit(const char *s, const Unit *table, size_t n, uint64_t *ret) {
        const char *e;
        uint64_t v, out;
        int r = parse_u64_prefix(s, &v, &e);
        if (r < 0)
                return r;
        for (size_t i = 0; i < n; i++)
                if (strcmp(e, table[i].suffix) == 0) {
                        if (MUL_OVERFLOW(v, table[i].factor, &out))
                                return -ERANGE;
                        *ret = out;
                        return 0;
                }
        return -EINVAL;
}

int parse_size(const char *s, uint64_t *ret) {
        static const Unit table[] = {
                { "", 1ULL },           { "B", 1ULL },
                { "K", 1ULL << 10 },    { "KB", 1ULL << 10 }, { "KiB", 1ULL << 10 },
                { "M", 1ULL << 20 },    { "MB", 1ULL << 20 }, { "MiB", 1ULL << 20 },
                { "G", 1ULL << 30 },    { "GB", 1ULL << 30 }, { "GiB", 1ULL << 30 },
                { "T", 1ULL << 40 },    { "TB", 1ULL << 40 }, { "TiB", 1ULL << 40 },
        };
        return parse_with_unit(s, table, ELEMENTSOF(table), ret);
}

int parse_duration(const char *s, usec_t *ret) {
        static const Unit table[] = {
                { "", USEC_PER_SEC },      { "s", USEC_PER_SEC },   { "sec", USEC_PER_SEC },
                { "ms", USEC_PER_MSEC },   { "msec", USEC_PER_MSEC }, { "us", 1 },
                { "usec", 1 },             { "min", 60 * USEC_PER_SEC },
                { "m", 60 * USEC_PER_SEC }, { "h", 3600 * USEC_PER_SEC },
        };
        return parse_with_unit(s, table, ELEMENTSOF(table), ret);
}

const char *format_size(char *buf, size_t n, uint64_t size) {
        static const char units[] = "BKMGTPE";
        double v = (double)size;
        size_t u = 0;
        /* 1023.95 and up print as 1024.0 of this unit: the next one says it (1.0M). */
        while (v >= 1023.95 && u < sizeof units - 2) {
                v /= 1024.0;
                u++;
        }
        if (u == 0)
                snprintf(buf, n, "%" PRIu64 "B", size);
        else
                snprintf(buf, n, "%.1f%c", v, units[u]);
        return buf;
}
