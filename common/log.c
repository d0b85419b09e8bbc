/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

static int log_max_level = LOG_INFO;
static int log_prefix = -1;

void log_set_max_level(int level) {
        log_max_level = CLAMP(level, LOG_EMERG, LOG_DEBUG);
}

int log_get_max_level(void) {
        return log_max_level;
}

void log_set_prefix(int enable) {
        log_prefix = enable;
}

int log_level_from_string(const char *s) {
        static const char *const names[] = {
                "emerg", "alert", "crit", "err", "warning", "notice", "info", "debug",
        };
        if (!s || !*s)
                return -EINVAL;
        for (size_t i = 0; i < ELEMENTSOF(names); i++)
                if (strcasecmp(s, names[i]) == 0)
                        return (int)i;
        if (strcasecmp(s, "error") == 0)
                return LOG_ERR;
        if (strcasecmp(s, "warn") == 0)
                return LOG_WARNING;
        if (s[0] >= '0' && s[0] <= '7' && s[1] == 0)
                return s[0] - '0';
        return -EINVAL;
}

int log_internal(int level, int error, const char *file, int line, const char *fmt, ...) {
        char buf[2048];
        va_list ap;
        int e = abs(error);

        if (log_prefix < 0)
                log_prefix = !isatty(STDERR_FILENO) || getenv("JOURNAL_STREAM") != NULL;

        /* %m expands to the error passed in, not to whatever errno happens to be. */
        errno = e;
        va_start(ap, fmt);
        vsnprintf(buf, sizeof buf, fmt, ap);
        va_end(ap);

        if (log_max_level >= LOG_DEBUG && file)
                fprintf(stderr, log_prefix ? "<%d>%s (%s:%d)\n" : "%.0d%s (%s:%d)\n",
                        log_prefix ? (level & LOG_PRIMASK) : 0, buf, file, line);
        else if (log_prefix)
                fprintf(stderr, "<%d>%s\n", level & LOG_PRIMASK, buf);
        else
                fprintf(stderr, "%s\n", buf);
        errno = e;
        return -e;
}
