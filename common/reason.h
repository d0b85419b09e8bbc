/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Why an operation was refused, in words for the caller. Managers and pure code return a
 * negative errno and fill a Reason; the bus glue turns both into a named
 * org.epd1.Error.* whose message is the reason (bus-error.h: epd_bus_error_errno()), so
 * that code below the bus never names D-Bus errors and every refusal says why. */

#include <stddef.h>

#define REASON_MAX 384

typedef struct Reason {
        char text[REASON_MAX]; /* "" when nothing was said */
} Reason;

/* Formats the reason into r (which may be NULL) and returns error, so that a function
 * can `return reason_set(why, -EINVAL, "...", ...)`. */
int reason_set(Reason *r, int error, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
