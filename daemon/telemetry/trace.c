/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "hashmap.h"
#include "parse-util.h"
#include "telemetry/trace.h"
#include "utf8.h"

struct TraceStore {
        Hashmap *by_id;                 /* TraceRequest* by id */
        LIST_HEAD(TraceRequest, oldest); /* newest first: prepend; tail is the oldest */
        TraceRequest *tail;
        size_t max_requests, max_events;
        uint64_t n_evicted;
};

static const char *const type_names[_TRACE_EVENT_TYPE_MAX] = {
        [TRACE_ADMIT] = "admit",
        [TRACE_STAGE_DONE] = "stage-done",
        [TRACE_ENCODE_START] = "encode-start",
        [TRACE_PUBLISH] = "publish",
        [TRACE_ACQUIRE_HIT] = "acquire-hit",
        [TRACE_ACQUIRE_MISS] = "acquire-miss",
        [TRACE_HANDOFF_PREPARE] = "handoff-prepare",
        [TRACE_GROUP_READY] = "group-ready",
        [TRACE_GROUP_SENT] = "group-sent",
        [TRACE_GROUP_RECEIVED] = "group-received",
        [TRACE_COMMIT] = "commit",
        [TRACE_ROLLBACK] = "rollback",
        [TRACE_RELEASE] = "release",
        [TRACE_BACKPRESSURE] = "backpressure",
        [TRACE_ERROR] = "error",
};

const char *trace_event_type_to_string(TraceEventType t) {
        return (unsigned)t < _TRACE_EVENT_TYPE_MAX ? type_names[t] : NULL;
}

int trace_event_type_from_string(const char *s) {
        if (!s)
                return -EINVAL;
        for (unsigned i = 0; i < _TRACE_EVENT_TYPE_MAX; i++)
                if (strcmp(s, type_names[i]) == 0)
                        return (int)i;
        return -EINVAL;
}

bool trace_request_id_valid(const char *id) {
        if (!id)
                return false;
        size_t n = 0;
        for (const char *p = id; *p; p++, n++) {
                char c = *p;
                if (n >= TRACE_REQUEST_ID_MAX)
                        return false;
                if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == ':' || c == '-'))
                        return false;
        }
        return n > 0;
}

/* A request id of 32 hex digits (what the feature and handoff calls take, printed in
 * lowercase by the daemon) in lowercase, so that a caller's uppercase spelling of it in
 * Admit, or in GetTrace, names the same trace; any other id as it is. */
static const char *canonical_id(const char *id, char buf[static TRACE_REQUEST_ID_MAX + 1]) {
        size_t n = 0;
        bool upper = false;
        for (; id[n]; n++) {
                char c = id[n];
                if (n >= 32 || !((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F')))
                        return id;
                upper = upper || (c >= 'A' && c <= 'F');
        }
        if (n != 32 || !upper)
                return id;
        for (size_t i = 0; i <= n; i++)
                buf[i] = (char)(id[i] >= 'A' && id[i] <= 'F' ? id[i] - 'A' + 'a' : id[i]);
        return buf;
}

TraceStore *trace_store_new(size_t max_requests, size_t max_events) {
        if (max_requests == 0 || max_events == 0)
                return NULL;
        TraceStore *t = calloc(1, sizeof *t);
        if (!t)
                return NULL;
        t->by_id = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!t->by_id) {
                free(t);
                return NULL;
        }
        t->max_requests = max_requests;
        t->max_events = max_events;
        return t;
}

static void request_free(TraceRequest *r) {
        if (!r)
                return;
        free(r->events);
        free(r);
}

static void store_unlink(TraceStore *t, TraceRequest *r) {
        if (t->tail == r)
                t->tail = r->age_prev;
        LIST_REMOVE(age, t->oldest, r);
        hashmap_remove(t->by_id, r->id);
}

TraceStore *trace_store_free(TraceStore *t) {
        if (!t)
                return NULL;
        LIST_FOREACH_SAFE(age, r, n, t->oldest)
                request_free(r);
        hashmap_free(t->by_id);
        free(t);
        return NULL;
}

size_t trace_store_size(const TraceStore *t) {
        return t ? hashmap_size(t->by_id) : 0;
}

uint64_t trace_store_evicted(const TraceStore *t) {
        return t ? t->n_evicted : 0;
}

const TraceRequest *trace_store_get(const TraceStore *t, const char *request_id) {
        char buf[TRACE_REQUEST_ID_MAX + 1];
        if (!t || !request_id)
                return NULL;
        return hashmap_get(t->by_id, canonical_id(request_id, buf));
}

void trace_store_remove(TraceStore *t, const char *request_id) {
        char buf[TRACE_REQUEST_ID_MAX + 1];
        TraceRequest *r = t && request_id ? hashmap_get(t->by_id, canonical_id(request_id, buf)) : NULL;
        if (!r)
                return;
        store_unlink(t, r);
        request_free(r);
}

static void copy_field(char *dst, size_t n, const char *src) {
        if (!src) {
                dst[0] = '\0';
                return;
        }
        size_t l = strnlen(src, n - 1);
        memcpy(dst, src, l);
        dst[l] = '\0';
        utf8_make_valid(dst); /* cut anywhere, and a client's text: GetTrace must stay readable */
}

static bool per_group(TraceEventType type) {
        return type == TRACE_GROUP_SENT || type == TRACE_GROUP_RECEIVED;
}

/* A request's events are full: an event that is not per layer group (a commit, a
 * rollback, a release, an error) takes the place of the latest per-group one, so that a
 * handoff of many groups still shows how it ended; the one given up is counted as
 * dropped. False when there is none (the new event is dropped). */
static bool make_room(TraceRequest *r, TraceEventType type) {
        if (per_group(type))
                return false;
        for (size_t k = r->n_events; k > 0; k--)
                if (per_group(r->events[k - 1].type)) {
                        memmove(&r->events[k - 1], &r->events[k], (r->n_events - k) * sizeof *r->events);
                        r->n_events--;
                        r->n_dropped++;
                        return true;
                }
        return false;
}

int trace_store_add_n(TraceStore *t, const char *request_id, usec_t ts, TraceEventType type, const TraceDetail *d,
                      size_t n) {
        char buf[TRACE_REQUEST_ID_MAX + 1];
        if (!t || !trace_request_id_valid(request_id) || (unsigned)type >= _TRACE_EVENT_TYPE_MAX || (n > 0 && !d))
                return -EINVAL;
        request_id = canonical_id(request_id, buf);

        TraceRequest *r = hashmap_get(t->by_id, request_id);
        if (!r) {
                if (hashmap_size(t->by_id) >= t->max_requests && t->tail) {
                        /* Full: the oldest request goes, and its memory (its events'
                         * array too) serves the new one, so that a busy daemon records
                         * its requests without allocating for each. */
                        TraceRequest *victim = t->tail;
                        store_unlink(t, victim);
                        t->n_evicted++;
                        TraceEvent *events = victim->events;
                        size_t n_allocated = victim->n_allocated;
                        *victim = (TraceRequest) { .events = events, .n_allocated = n_allocated };
                        r = victim;
                } else {
                        r = calloc(1, sizeof *r);
                        if (!r)
                                return -ENOMEM;
                }
                strcpy(r->id, request_id); /* length checked above */
                r->first_usec = ts;
                int k = hashmap_put(t->by_id, r->id, r);
                if (k < 0) {
                        request_free(r);
                        return k;
                }
                LIST_PREPEND(age, t->oldest, r);
                if (!t->tail)
                        t->tail = r;

                while (hashmap_size(t->by_id) > t->max_requests && t->tail && t->tail != r) {
                        TraceRequest *victim = t->tail;
                        store_unlink(t, victim);
                        request_free(victim);
                        t->n_evicted++;
                }
        }

        r->first_usec = MIN(r->first_usec, ts);
        r->last_usec = MAX(r->last_usec, ts);
        for (size_t i = 0; i < n; i++) {
                if (r->n_events >= t->max_events && !make_room(r, type)) {
                        r->n_dropped += n - i;
                        return 0;
                }
                if (r->n_events == r->n_allocated) {
                        size_t k = r->n_allocated ? r->n_allocated * 2 : 8;
                        k = MIN(MAX(k, MIN(r->n_events + (n - i), t->max_events)), t->max_events);
                        TraceEvent *e = reallocarray(r->events, k, sizeof *e);
                        if (!e)
                                return -ENOMEM;
                        r->events = e;
                        r->n_allocated = k;
                }

                TraceEvent *e = &r->events[r->n_events++];
                *e = (TraceEvent){
                        .ts_usec = ts,
                        .type = type,
                        .group = d[i].has_group ? d[i].group : -1,
                        .bytes = d[i].bytes,
                        .duration_usec = d[i].duration_usec,
                        .has_uid = d[i].has_uid,
                        .uid = d[i].uid,
                };
                copy_field(e->transport, sizeof e->transport, d[i].transport);
                copy_field(e->peer, sizeof e->peer, d[i].peer);
                copy_field(e->detail, sizeof e->detail, d[i].detail);
        }
        return 0;
}

bool trace_event_readable(const TraceEvent *e, uint32_t uid) {
        return uid == 0 || (e->has_uid && e->uid == uid);
}

int trace_store_add(TraceStore *t, const char *request_id, usec_t ts, TraceEventType type,
                    const TraceDetail *d) {
        return trace_store_add_n(t, request_id, ts, type, d ?: &(const TraceDetail){}, 1);
}

int trace_request_format(const TraceRequest *r, FILE *f) {
        if (!r || !f)
                return -EINVAL;
        fprintf(f, "request %s: %zu events", r->id, r->n_events);
        if (r->n_dropped > 0)
                fprintf(f, " (%" PRIu64 " more dropped)", r->n_dropped);
        fprintf(f, ", %.3fms\n", (double)(r->last_usec - r->first_usec) / 1000.0);

        for (size_t i = 0; i < r->n_events; i++) {
                const TraceEvent *e = &r->events[i];
                char buf[32];
                /* Events may come from several threads of one host out of order. */
                double rel = ((double)e->ts_usec - (double)r->first_usec) / 1000.0;
                fprintf(f, "  %+10.3fms %-16s", rel, trace_event_type_to_string(e->type));
                if (e->group >= 0)
                        fprintf(f, " group=%" PRIi32, e->group);
                if (e->bytes > 0)
                        fprintf(f, " bytes=%s", format_size(buf, sizeof buf, e->bytes));
                if (e->transport[0])
                        fprintf(f, " transport=%s", e->transport);
                if (e->peer[0])
                        fprintf(f, " peer=%s", e->peer);
                if (e->duration_usec > 0)
                        fprintf(f, " took=%.3fms", (double)e->duration_usec / 1000.0);
                if (e->detail[0])
                        fprintf(f, " %s", e->detail);
                fputc('\n', f);
        }
        return ferror(f) ? -EIO : 0;
}
