/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Per-request traces: every feature, handoff and transfer carries its request's id, and
 * each step records an event here, so that one request can be followed from encode to
 * decode (`epdctl trace REQUEST_ID`). Pure and bounded: at most max_requests requests
 * (the oldest is evicted first) and max_events events per request (later ones are
 * counted as dropped, the first ones are kept: they show where the request began). */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "list.h"
#include "macro.h"
#include "time-util.h"

#define TRACE_REQUEST_ID_MAX 64    /* bytes, NUL excluded */
#define TRACE_TRANSPORT_MAX 16
#define TRACE_DETAIL_MAX 96

/* Which call records each: docs/telemetry.md, "Request tracing". */
typedef enum TraceEventType {
        TRACE_ADMIT,
        TRACE_STAGE_DONE,
        TRACE_ENCODE_START,
        TRACE_PUBLISH,
        TRACE_ACQUIRE_HIT,
        TRACE_ACQUIRE_MISS,
        TRACE_HANDOFF_PREPARE,
        TRACE_GROUP_READY,
        TRACE_GROUP_SENT,
        TRACE_GROUP_RECEIVED,
        TRACE_COMMIT,
        TRACE_ROLLBACK,
        TRACE_RELEASE,
        TRACE_BACKPRESSURE,
        TRACE_ERROR,
        _TRACE_EVENT_TYPE_MAX,
} TraceEventType;

/* What a caller passes; all fields optional (zero/NULL: not applicable). */
typedef struct TraceDetail {
        int32_t group;            /* layer group, -1 or 0.. (0 is a valid group: see has_group) */
        bool has_group;
        uint64_t bytes;
        usec_t duration_usec;
        const char *transport;    /* "tcp", "memcpy", "cuda", ... */
        const char *peer;
        const char *detail;       /* free text: why a rollback happened, the key, ... */
        /* The uid of the client whose call (or object) this event records (has_uid):
         * that uid reads the event (docs/security.md); the daemon's own events have
         * none (root's alone). */
        bool has_uid;
        uint32_t uid;
} TraceDetail;

typedef struct TraceEvent {
        usec_t ts_usec;           /* CLOCK_REALTIME of the recording host */
        TraceEventType type;
        int32_t group;            /* -1: none */
        uint64_t bytes;
        usec_t duration_usec;
        char transport[TRACE_TRANSPORT_MAX];
        char peer[32];
        char detail[TRACE_DETAIL_MAX];
        bool has_uid;             /* TraceDetail's */
        uint32_t uid;
} TraceEvent;

/* Whether uid may read e: root reads every event, another uid those its own calls (or
 * objects) recorded. A request id is the caller's choice, so anyone may record events
 * under anyone's: a trace is never shown whole to a uid for having an event in it. */
bool trace_event_readable(const TraceEvent *e, uint32_t uid);

typedef struct TraceRequest TraceRequest;
struct TraceRequest {
        char id[TRACE_REQUEST_ID_MAX + 1];
        usec_t first_usec, last_usec;
        TraceEvent *events;
        size_t n_events, n_allocated;
        uint64_t n_dropped;
        LIST_FIELDS(TraceRequest, age);
};

typedef struct TraceStore TraceStore;

TraceStore *trace_store_new(size_t max_requests, size_t max_events);
TraceStore *trace_store_free(TraceStore *t);
DEFINE_TRIVIAL_CLEANUP_FUNC(TraceStore *, trace_store_free);

/* Valid request ids: 1..64 bytes of [A-Za-z0-9._:-]. */
bool trace_request_id_valid(const char *id);

/* Records one event. -EINVAL for a bad id or type, -ENOMEM. Evicts the oldest request
 * when a new one would exceed the limit. */
int trace_store_add(TraceStore *t, const char *request_id, usec_t ts, TraceEventType type,
                    const TraceDetail *d);
/* The same for n events of one type and time at once (a batch of layer groups): one
 * lookup, one check of the id. */
int trace_store_add_n(TraceStore *t, const char *request_id, usec_t ts, TraceEventType type, const TraceDetail *d,
                      size_t n);
const TraceRequest *trace_store_get(const TraceStore *t, const char *request_id);
size_t trace_store_size(const TraceStore *t);
uint64_t trace_store_evicted(const TraceStore *t);
void trace_store_remove(TraceStore *t, const char *request_id);

const char *trace_event_type_to_string(TraceEventType t);
int trace_event_type_from_string(const char *s);

/* Human-readable timeline, times relative to the first event:
 *   +0.000ms  encode-start
 *   +12.301ms group-sent     group=3 bytes=4.0M transport=tcp took=1.204ms
 */
int trace_request_format(const TraceRequest *r, FILE *f);
