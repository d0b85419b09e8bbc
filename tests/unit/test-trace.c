/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "telemetry/trace.h"
#include "../check-main.h"

START_TEST(test_ids) {
        ck_assert(trace_request_id_valid("req-1"));
        ck_assert(trace_request_id_valid("cmpl-9f2e:0.a_b"));
        ck_assert(!trace_request_id_valid(""));
        ck_assert(!trace_request_id_valid(NULL));
        ck_assert(!trace_request_id_valid("a b"));
        ck_assert(!trace_request_id_valid("a/b"));
        char id[80];
        memset(id, 'x', 64);
        id[64] = '\0';
        ck_assert(trace_request_id_valid(id));
        id[64] = 'x';
        id[65] = '\0';
        ck_assert(!trace_request_id_valid(id));
}
END_TEST

/* A 32-hex-digit id (the feature and handoff calls' own, which the daemon prints in
 * lowercase) is one trace however a caller spells it; other ids keep their case. */
START_TEST(test_hex_ids_one_trace) {
        _cleanup_(trace_store_freep) TraceStore *t = trace_store_new(16, 64);
        ck_assert_ptr_nonnull(t);
        ck_assert_int_eq(trace_store_add(t, "0123456789ABCDEF0123456789abcdef", 1, TRACE_ADMIT, NULL), 0);
        ck_assert_int_eq(trace_store_add(t, "0123456789abcdef0123456789abcdef", 2, TRACE_PUBLISH, NULL), 0);
        ck_assert_uint_eq(trace_store_size(t), 1);
        const TraceRequest *r = trace_store_get(t, "0123456789ABCDEF0123456789ABCDEF");
        ck_assert_ptr_nonnull(r);
        ck_assert_uint_eq(r->n_events, 2);
        ck_assert_str_eq(r->id, "0123456789abcdef0123456789abcdef");
        ck_assert_int_eq(trace_store_add(t, "Req-A", 3, TRACE_ADMIT, NULL), 0);
        ck_assert_int_eq(trace_store_add(t, "req-a", 4, TRACE_ADMIT, NULL), 0);
        ck_assert_uint_eq(trace_store_size(t), 3);
        /* 32 characters, not all hex: as it is. */
        ck_assert_int_eq(trace_store_add(t, "0123456789ABCDEF0123456789ABCDEG", 5, TRACE_ADMIT, NULL), 0);
        ck_assert_ptr_null(trace_store_get(t, "0123456789abcdef0123456789abcdeg"));
        trace_store_remove(t, "0123456789ABCDEF0123456789ABCDEF");
        ck_assert_ptr_null(trace_store_get(t, "0123456789abcdef0123456789abcdef"));
}
END_TEST

START_TEST(test_record_and_format) {
        _cleanup_(trace_store_freep) TraceStore *t = trace_store_new(16, 64);
        ck_assert_ptr_nonnull(t);
        ck_assert_int_eq(trace_store_add(t, "r1", 1000, TRACE_ENCODE_START, NULL), 0);
        ck_assert_int_eq(trace_store_add(t, "r1", 9000, TRACE_PUBLISH,
                                         &(TraceDetail){ .bytes = 4 << 20, .detail = "key=abc" }), 0);
        ck_assert_int_eq(trace_store_add(t, "r1", 12000, TRACE_GROUP_SENT,
                                         &(TraceDetail){ .has_group = true, .group = 0, .bytes = 1 << 20,
                                                         .transport = "tcp", .peer = "hostB",
                                                         .duration_usec = 1500 }), 0);
        ck_assert_int_eq(trace_store_add(t, "r1", 20000, TRACE_ROLLBACK,
                                         &(TraceDetail){ .detail = "peer hostB disconnected" }), 0);
        ck_assert_int_eq(trace_store_add(t, "bad id", 1, TRACE_COMMIT, NULL), -EINVAL);
        ck_assert_int_eq(trace_store_add(t, "r1", 1, _TRACE_EVENT_TYPE_MAX, NULL), -EINVAL);

        const TraceRequest *r = trace_store_get(t, "r1");
        ck_assert_ptr_nonnull(r);
        ck_assert_uint_eq(r->n_events, 4);
        ck_assert_int_eq(r->events[0].group, -1);
        ck_assert_int_eq(r->events[2].group, 0);
        ck_assert_str_eq(r->events[2].transport, "tcp");

        char *buf = NULL;
        size_t n = 0;
        FILE *f = open_memstream(&buf, &n);
        ck_assert_int_eq(trace_request_format(r, f), 0);
        fclose(f);
        ck_assert_ptr_nonnull(strstr(buf, "request r1: 4 events, 19.000ms"));
        ck_assert_ptr_nonnull(strstr(buf, "+0.000ms encode-start"));
        ck_assert_ptr_nonnull(strstr(buf, "group-sent       group=0 bytes=1.0M transport=tcp peer=hostB took=1.500ms"));
        ck_assert_ptr_nonnull(strstr(buf, "rollback         peer hostB disconnected"));
        free(buf);
}
END_TEST

START_TEST(test_bounds) {
        _cleanup_(trace_store_freep) TraceStore *t = trace_store_new(3, 4);
        char id[16];
        for (int i = 0; i < 10; i++) {
                snprintf(id, sizeof id, "req%d", i);
                ck_assert_int_eq(trace_store_add(t, id, (usec_t)i, TRACE_ENCODE_START, NULL), 0);
                ck_assert_uint_le(trace_store_size(t), 3);
        }
        ck_assert_uint_eq(trace_store_evicted(t), 7);
        ck_assert_ptr_null(trace_store_get(t, "req6"));
        ck_assert_ptr_nonnull(trace_store_get(t, "req7"));
        ck_assert_ptr_nonnull(trace_store_get(t, "req9"));

        /* Per-request bound: the first events are kept, later ones counted. */
        for (int i = 0; i < 10; i++)
                ck_assert_int_eq(trace_store_add(t, "req9", 100 + (usec_t)i, TRACE_GROUP_SENT, NULL), 0);
        const TraceRequest *r = trace_store_get(t, "req9");
        ck_assert_uint_eq(r->n_events, 4);
        ck_assert_uint_eq(r->n_dropped, 7);
        ck_assert_int_eq(r->events[0].type, TRACE_ENCODE_START);
        /* How it ended is kept: a commit and a release take the places of the latest
         * per-group events (counted dropped); another group-sent is dropped itself. */
        ck_assert_int_eq(trace_store_add(t, "req9", 200, TRACE_COMMIT, NULL), 0);
        ck_assert_int_eq(trace_store_add(t, "req9", 201, TRACE_GROUP_SENT, NULL), 0);
        ck_assert_int_eq(trace_store_add(t, "req9", 202, TRACE_RELEASE, NULL), 0);
        ck_assert_uint_eq(r->n_events, 4);
        ck_assert_uint_eq(r->n_dropped, 10);
        ck_assert_int_eq(r->events[0].type, TRACE_ENCODE_START);
        ck_assert_int_eq(r->events[1].type, TRACE_GROUP_SENT);
        ck_assert_uint_eq(r->events[1].ts_usec, 100); /* the first groups stay */
        ck_assert_int_eq(r->events[2].type, TRACE_COMMIT);
        ck_assert_int_eq(r->events[3].type, TRACE_RELEASE);
        /* The last per-group event gives way to another release; with none left, the
         * error after it is dropped as before. */
        ck_assert_int_eq(trace_store_add(t, "req9", 203, TRACE_RELEASE, NULL), 0);
        ck_assert_int_eq(trace_store_add(t, "req9", 204, TRACE_ERROR, NULL), 0);
        ck_assert_uint_eq(r->n_events, 4);
        ck_assert_int_eq(r->events[3].type, TRACE_RELEASE);
        ck_assert_int_eq(r->events[1].type, TRACE_COMMIT);

        /* Long strings are truncated, not overflowed. */
        char longs[300];
        memset(longs, 'y', sizeof longs - 1);
        longs[sizeof longs - 1] = '\0';
        ck_assert_int_eq(trace_store_add(t, "long", 1, TRACE_ERROR,
                                         &(TraceDetail){ .transport = longs, .peer = longs, .detail = longs }), 0);
        r = trace_store_get(t, "long");
        ck_assert_uint_eq(strlen(r->events[0].transport), TRACE_TRANSPORT_MAX - 1);
        ck_assert_uint_eq(strlen(r->events[0].detail), TRACE_DETAIL_MAX - 1);

        trace_store_remove(t, "long");
        ck_assert_ptr_null(trace_store_get(t, "long"));
        trace_store_remove(t, "long");
        /* Removing the oldest and the newest keeps the age list consistent. */
        trace_store_remove(t, "req8");
        trace_store_remove(t, "req9");
        for (int i = 20; i < 30; i++) {
                snprintf(id, sizeof id, "req%d", i);
                ck_assert_int_eq(trace_store_add(t, id, (usec_t)i, TRACE_COMMIT, NULL), 0);
        }
        ck_assert_uint_eq(trace_store_size(t), 3);
        ck_assert_ptr_nonnull(trace_store_get(t, "req29"));
        ck_assert_ptr_null(trace_store_new(0, 1));
}
END_TEST

START_TEST(test_many) {
        _cleanup_(trace_store_freep) TraceStore *t = trace_store_new(1000, 8);
        char id[32];
        for (int i = 0; i < 100000; i++) {
                snprintf(id, sizeof id, "r%d", i % 3000);
                ck_assert_int_eq(trace_store_add(t, id, (usec_t)i, (TraceEventType)(i % _TRACE_EVENT_TYPE_MAX), NULL), 0);
        }
        ck_assert_uint_eq(trace_store_size(t), 1000);
}
END_TEST

START_TEST(test_evicted_memory_reused) {
        /* A full store gives the oldest request's memory to the next: the new one holds
         * its own events only, its own times, no drops inherited, and grows past the
         * array it was given. */
        _cleanup_(trace_store_freep) TraceStore *t = trace_store_new(2, 40);
        ck_assert_ptr_nonnull(t);
        for (int i = 0; i < 30; i++)
                ck_assert_int_eq(trace_store_add(t, "old", 100 + (usec_t)i, TRACE_GROUP_SENT,
                                                 &(TraceDetail){ .has_group = true, .group = i, .peer = "p-old" }), 0);
        for (int i = 0; i < 50; i++)
                ck_assert_int_eq(trace_store_add(t, "old2", 200, TRACE_COMMIT, NULL), 0);
        ck_assert_uint_eq(trace_store_get(t, "old2")->n_dropped, 10);
        const TraceEvent *old_events = trace_store_get(t, "old")->events;

        ck_assert_int_eq(trace_store_add(t, "new", 5000, TRACE_HANDOFF_PREPARE, &(TraceDetail){ .detail = "source" }),
                         0);
        ck_assert_uint_eq(trace_store_size(t), 2);
        ck_assert_uint_eq(trace_store_evicted(t), 1);
        ck_assert_ptr_null(trace_store_get(t, "old"));
        const TraceRequest *r = trace_store_get(t, "new");
        ck_assert_ptr_nonnull(r);
        ck_assert_ptr_eq(r->events, old_events); /* the evicted request's array, not a new one */
        ck_assert_str_eq(r->id, "new");
        ck_assert_uint_eq(r->n_events, 1);
        ck_assert_uint_eq(r->n_dropped, 0);
        ck_assert_uint_eq(r->first_usec, 5000);
        ck_assert_uint_eq(r->last_usec, 5000);
        ck_assert_int_eq(r->events[0].type, TRACE_HANDOFF_PREPARE);
        ck_assert_int_eq(r->events[0].group, -1);
        ck_assert_str_eq(r->events[0].peer, "");
        ck_assert_str_eq(r->events[0].detail, "source");

        /* The second eviction hands over a request that had dropped events: none carried. */
        ck_assert_int_eq(trace_store_add(t, "newer", 6000, TRACE_COMMIT, NULL), 0);
        ck_assert_ptr_null(trace_store_get(t, "old2"));
        r = trace_store_get(t, "newer");
        ck_assert_uint_eq(r->n_events, 1);
        ck_assert_uint_eq(r->n_dropped, 0);
        /* ... and it grows to the per-request bound as a fresh one would. */
        for (int i = 0; i < 45; i++)
                ck_assert_int_eq(trace_store_add(t, "newer", 6001 + (usec_t)i, TRACE_GROUP_SENT,
                                                 &(TraceDetail){ .has_group = true, .group = i }), 0);
        r = trace_store_get(t, "newer");
        ck_assert_uint_eq(r->n_events, 40);
        ck_assert_uint_eq(r->n_dropped, 6);
        ck_assert_int_eq(r->events[39].group, 38);
        ck_assert_uint_eq(r->last_usec, 6045);
        ck_assert_ptr_nonnull(trace_store_get(t, "new"));
}
END_TEST

START_TEST(test_add_n) {
        /* A batch of layer groups: one event each, in order, the cap counted as for one
         * at a time. */
        _cleanup_(trace_store_freep) TraceStore *t = trace_store_new(4, 10);
        TraceDetail d[12];
        for (int i = 0; i < 12; i++)
                d[i] = (TraceDetail){ .has_group = true, .group = i, .bytes = 100 + (uint64_t)i, .transport = "tcp",
                                      .peer = "bravo" };
        ck_assert_int_eq(trace_store_add(t, "req-n", 1000, TRACE_HANDOFF_PREPARE, NULL), 0);
        ck_assert_int_eq(trace_store_add_n(t, "req-n", 2000, TRACE_GROUP_SENT, d, 0), 0);
        ck_assert_int_eq(trace_store_add_n(t, "req-n", 2000, TRACE_GROUP_SENT, d, 12), 0);
        const TraceRequest *r = trace_store_get(t, "req-n");
        ck_assert_ptr_nonnull(r);
        ck_assert_uint_eq(r->n_events, 10);
        ck_assert_uint_eq(r->n_dropped, 3);
        ck_assert_uint_eq(r->last_usec, 2000);
        ck_assert_int_eq(r->events[0].group, -1);
        for (int i = 1; i < 10; i++) {
                ck_assert_int_eq(r->events[i].type, TRACE_GROUP_SENT);
                ck_assert_int_eq(r->events[i].group, i - 1);
                ck_assert_uint_eq(r->events[i].bytes, 100 + (uint64_t)(i - 1));
                ck_assert_str_eq(r->events[i].transport, "tcp");
                ck_assert_str_eq(r->events[i].peer, "bravo");
        }
        ck_assert_int_eq(trace_store_add_n(t, "bad id!", 1, TRACE_GROUP_SENT, d, 1), -EINVAL);
        ck_assert_int_eq(trace_store_add_n(t, "req-n", 1, TRACE_GROUP_SENT, NULL, 1), -EINVAL);
}
END_TEST

/* Who reads which event: root every one, another uid those recorded with its own (an
 * event without one, the daemon's own, is root's alone). */
START_TEST(test_readers) {
        _cleanup_(trace_store_freep) TraceStore *t = trace_store_new(1, 16);
        ck_assert_int_eq(trace_store_add(t, "r1", 1, TRACE_ADMIT, NULL), 0);
        ck_assert_int_eq(trace_store_add(t, "r1", 2, TRACE_PUBLISH, &(TraceDetail){ .has_uid = true, .uid = 1000 }), 0);
        ck_assert_int_eq(trace_store_add(t, "r1", 3, TRACE_COMMIT, &(TraceDetail){ .has_uid = true, .uid = 1001 }), 0);
        const TraceRequest *r = trace_store_get(t, "r1");
        ck_assert_uint_eq(r->n_events, 3);
        for (size_t i = 0; i < 3; i++)
                ck_assert(trace_event_readable(&r->events[i], 0));
        ck_assert(!trace_event_readable(&r->events[0], 1000));
        ck_assert(trace_event_readable(&r->events[1], 1000));
        ck_assert(!trace_event_readable(&r->events[2], 1000));
        ck_assert(trace_event_readable(&r->events[2], 1001));
        ck_assert(!trace_event_readable(&r->events[1], 1001));
}
END_TEST

START_TEST(test_type_names) {
        for (int i = 0; i < _TRACE_EVENT_TYPE_MAX; i++) {
                const char *s = trace_event_type_to_string(i);
                ck_assert_ptr_nonnull(s);
                ck_assert_int_eq(trace_event_type_from_string(s), i);
        }
        ck_assert_int_eq(trace_event_type_from_string("nope"), -EINVAL);
}
END_TEST

int main(void) {
        Suite *s = suite_create("trace");
        TCase *tc = tcase_create("trace");
        tcase_add_test(tc, test_ids);
        tcase_add_test(tc, test_hex_ids_one_trace);
        tcase_add_test(tc, test_record_and_format);
        tcase_add_test(tc, test_bounds);
        tcase_add_test(tc, test_many);
        tcase_add_test(tc, test_readers);
        tcase_add_test(tc, test_evicted_memory_reused);
        tcase_add_test(tc, test_add_n);
        tcase_add_test(tc, test_type_names);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
