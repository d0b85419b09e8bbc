/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The named errors of the org.epd1 API (docs/api.md lists them), and the
 * mapping to and from negative errno, shared by the daemon and libepd. */

#include <systemd/sd-bus.h>

#define EPD_ERROR_NOT_FOUND "org.epd1.Error.NotFound"
#define EPD_ERROR_INVALID_ARGUMENT "org.epd1.Error.InvalidArgument"
#define EPD_ERROR_NO_SPACE "org.epd1.Error.NoSpace"
#define EPD_ERROR_BUSY "org.epd1.Error.Busy"
#define EPD_ERROR_PERMISSION_DENIED "org.epd1.Error.PermissionDenied"
#define EPD_ERROR_NOT_REGISTERED "org.epd1.Error.NotRegistered"
#define EPD_ERROR_LIMIT_EXCEEDED "org.epd1.Error.LimitExceeded"
#define EPD_ERROR_EXISTS "org.epd1.Error.Exists"
#define EPD_ERROR_TIMEOUT "org.epd1.Error.Timeout"
#define EPD_ERROR_FAILED "org.epd1.Error.Failed"
#define EPD_ERROR_UNSUPPORTED "org.epd1.Error.Unsupported"
#define EPD_ERROR_STALE "org.epd1.Error.Stale"
#define EPD_ERROR_PEER_UNAVAILABLE "org.epd1.Error.PeerUnavailable"
/* A congested path: new work for it is deferred; the message ends with
 * "retry_after_usec=N" (libepd: epd_last_error_retry_after_usec()). */
#define EPD_ERROR_BACKPRESSURE "org.epd1.Error.Backpressure"

/* Registers the errno mapping with sd-bus, so that sd_bus_error_set_errno() and
 * sd_bus_error_get_errno() translate both ways. Call once per process. */
int epd_bus_error_register(void);

/* Sets a named error with a formatted message; returns the negative errno that the
 * name maps to, so a method handler can `return epd_bus_error(error, EPD_ERROR_..., ...)`. */
int epd_bus_error(sd_bus_error *error, const char *name, const char *fmt, ...)
        __attribute__((format(printf, 3, 4)));

/* Sets the named error that the negative errno `error` maps to (the table above), with
 * `message` (or strerror when it is NULL or empty) as its text; an errno outside the
 * table is org.epd1.Error.Failed with strerror after the message. Returns `error`. */
int epd_bus_error_errno(sd_bus_error *e, int error, const char *message);

/* The negative errno a named error maps to (-EIO for unknown names). */
int epd_bus_error_to_errno(const char *name);
