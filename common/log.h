/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Logging to stderr with syslog priority prefixes ("<3>message"), which journald
 * parses when stderr is connected to it. Errors are logged once, where handled. */

#include <errno.h>
#include <syslog.h>

#include "macro.h"

void log_set_max_level(int level);
int log_get_max_level(void);
/* Parse "emerg".."debug" or "0".."7"; returns the level or -EINVAL. */
int log_level_from_string(const char *s);
/* When false (a terminal), priorities are not printed as "<N>" prefixes. */
void log_set_prefix(int enable);

/* Logs and returns -abs(error) (or 0 when error is 0), so that
 * `return log_error_errno(r, "...: %m")` works, with %m expanding to strerror(error). */
int log_internal(int level, int error, const char *file, int line, const char *fmt, ...)
        _printf_(5, 6);

#define log_full_errno(level, error, ...)                                                \
        ({                                                                               \
                int _l = (level), _e = (error);                                          \
                (_l & LOG_PRIMASK) <= log_get_max_level()                                \
                        ? log_internal(_l, _e, __FILE__, __LINE__, __VA_ARGS__)          \
                        : -abs(_e);                                                      \
        })
#define log_full(level, ...) (void)log_full_errno(level, 0, __VA_ARGS__)

#define log_debug(...) log_full(LOG_DEBUG, __VA_ARGS__)
#define log_info(...) log_full(LOG_INFO, __VA_ARGS__)
#define log_notice(...) log_full(LOG_NOTICE, __VA_ARGS__)
#define log_warning(...) log_full(LOG_WARNING, __VA_ARGS__)
#define log_error(...) log_full(LOG_ERR, __VA_ARGS__)

#define log_debug_errno(e, ...) log_full_errno(LOG_DEBUG, e, __VA_ARGS__)
#define log_info_errno(e, ...) log_full_errno(LOG_INFO, e, __VA_ARGS__)
#define log_notice_errno(e, ...) log_full_errno(LOG_NOTICE, e, __VA_ARGS__)
#define log_warning_errno(e, ...) log_full_errno(LOG_WARNING, e, __VA_ARGS__)
#define log_error_errno(e, ...) log_full_errno(LOG_ERR, e, __VA_ARGS__)

#define log_oom() log_error_errno(ENOMEM, "Out of memory.")
