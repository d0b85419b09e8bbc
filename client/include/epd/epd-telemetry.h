/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* libepd: telemetry (org.epd1.Telemetry): per-request traces, peer paths and the
 * Backpressure signal. See docs/telemetry.md. */

#include <stddef.h>
#include <stdint.h>

#include "epd/epd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epd_trace_event {
        uint64_t ts_usec;          /* CLOCK_REALTIME on the daemon's host */
        char type[24];             /* "encode-start", "group-sent", "rollback", ... */
        int32_t group;             /* layer group, -1: none */
        uint64_t bytes;
        uint64_t duration_usec;
        char transport[16];
        char peer[32];
        char detail[96];
} epd_trace_event;

/* The recorded events of one request. *ret is malloc()ed (free() it); *dropped counts
 * events beyond the daemon's per-request bound. -ENOENT (org.epd1.Error.NotFound) when
 * the daemon has no trace of that id. */
int epd_trace_get(epd_client *c, const char *request_id, epd_trace_event **ret, size_t *n,
                  uint64_t *dropped);

/* Tracks a TCP connection of the caller's own (e.g. a worker's transfer socket) for
 * kernel telemetry and backpressure, under the peer name given; the daemon keeps a
 * duplicate of the fd until epd_telemetry_untrack_socket() or until this client
 * disconnects. */
int epd_telemetry_track_socket(epd_client *c, int fd, const char *peer);
int epd_telemetry_untrack_socket(epd_client *c, int fd);

/* Backpressure levels of org.epd1.Telemetry.Backpressure(peer, level, reason) (also in
 * the ring's backpressure record, epd/ring.h). */
#ifndef EPD_BACKPRESSURE_LEVELS
#define EPD_BACKPRESSURE_LEVELS 1
enum {
        EPD_BACKPRESSURE_NONE = 0,
        EPD_BACKPRESSURE_ELEVATED = 1,
        EPD_BACKPRESSURE_HIGH = 2,
        EPD_BACKPRESSURE_STALLED = 3,
};
#endif

typedef void (*epd_backpressure_fn)(epd_client *c, const char *peer, unsigned level,
                                    const char *reason, void *userdata);
/* Calls fn on every Backpressure signal; dispatched from epd_process()/epd_wait(). */
int epd_backpressure_subscribe(epd_client *c, epd_backpressure_fn fn, void *userdata);

#ifdef __cplusplus
}
#endif
