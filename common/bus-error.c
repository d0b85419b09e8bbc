/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "bus-error.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "macro.h"

static const sd_bus_error_map epd_error_map[] = {
        SD_BUS_ERROR_MAP(EPD_ERROR_NOT_FOUND, ENOENT),
        SD_BUS_ERROR_MAP(EPD_ERROR_INVALID_ARGUMENT, EINVAL),
        SD_BUS_ERROR_MAP(EPD_ERROR_NO_SPACE, ENOSPC),
        SD_BUS_ERROR_MAP(EPD_ERROR_BUSY, EBUSY),
        SD_BUS_ERROR_MAP(EPD_ERROR_PERMISSION_DENIED, EPERM),
        SD_BUS_ERROR_MAP(EPD_ERROR_NOT_REGISTERED, ENOTCONN),
        SD_BUS_ERROR_MAP(EPD_ERROR_LIMIT_EXCEEDED, EDQUOT),
        SD_BUS_ERROR_MAP(EPD_ERROR_EXISTS, EEXIST),
        SD_BUS_ERROR_MAP(EPD_ERROR_TIMEOUT, ETIMEDOUT),
        SD_BUS_ERROR_MAP(EPD_ERROR_FAILED, EIO),
        SD_BUS_ERROR_MAP(EPD_ERROR_UNSUPPORTED, EOPNOTSUPP),
        SD_BUS_ERROR_MAP(EPD_ERROR_STALE, ESTALE),
        SD_BUS_ERROR_MAP(EPD_ERROR_PEER_UNAVAILABLE, EHOSTUNREACH),
        SD_BUS_ERROR_MAP(EPD_ERROR_BACKPRESSURE, EAGAIN),
        SD_BUS_ERROR_MAP_END,
};

static int register_result;

static void register_once(void) {
        register_result = sd_bus_error_add_map(epd_error_map);
}

int epd_bus_error_register(void) {
        /* sd_bus_error_add_map() grows a process-wide table without a lock: threads that
         * connect at once (one client each) must not register concurrently. */
        static pthread_once_t once = PTHREAD_ONCE_INIT;
        (void)pthread_once(&once, register_once);
        return register_result < 0 ? register_result : 0;
}

int epd_bus_error_to_errno(const char *name) {
        if (!name)
                return -EIO;
        for (const sd_bus_error_map *e = epd_error_map; e->name; e++)
                if (strcmp(e->name, name) == 0)
                        return -e->code;
        return -EIO;
}

int epd_bus_error_errno(sd_bus_error *e, int error, const char *message) {
        if (error >= 0)
                return error;
        for (const sd_bus_error_map *m = epd_error_map; m->name; m++)
                if (m->code == -error) {
                        (void)sd_bus_error_set(e, m->name, message && message[0] ? message : strerror(-error));
                        return error;
                }
        /* Outside the table: org.epd1.Error.Failed, the errno's text in the message. */
        if (message && message[0])
                (void)sd_bus_error_setf(e, EPD_ERROR_FAILED, "%s (%s)", message, strerror(-error));
        else
                (void)sd_bus_error_set(e, EPD_ERROR_FAILED, strerror(-error));
        return error;
}

int epd_bus_error(sd_bus_error *error, const char *name, const char *fmt, ...) {
        va_list ap;
        va_start(ap, fmt);
        int r = sd_bus_error_setfv(error, name, fmt, ap);
        va_end(ap);
        (void)r;
        return epd_bus_error_to_errno(name);
}
