/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "transport/local.h"
#include "transport/transport-util.h"
#include "../check-main.h"

#define SZ (4U << 20)

static void region_init(TransportRegion *r, uint32_t id, void *base) {
        *r = (TransportRegion) { .id = id, .domain = MEMORY_HOST, .host_base = base, .size = SZ };
}

/* Waits on the completion fd and collects n completions (cookie -> index). */
static void collect(Transport *t, TransportCompletion *out, size_t n) {
        size_t got = 0;
        while (got < n) {
                struct pollfd p = { .fd = t->ops->completion_fd(t), .events = POLLIN };
                ck_assert_int_eq(poll(&p, 1, 10000), 1);
                got += t->ops->poll(t, out + got, n - got);
        }
}

START_TEST(test_copy) {
        Transport *t = NULL;
        uint8_t *a = malloc(SZ), *b = calloc(1, SZ);
        TransportRegion ra, rb;
        for (size_t i = 0; i < SZ; i++)
                a[i] = (uint8_t)(i * 7 + 3);
        region_init(&ra, 0, a);
        region_init(&rb, 1, b);

        ck_assert_int_eq(local_transport_new(3, &t), 0);
        ck_assert_int_eq(t->ops->kind, TRANSPORT_LOCAL);
        ck_assert_str_eq(transport_kind_to_string(t->ops->kind), "local");
        ck_assert_int_eq(t->ops->register_region(t, &ra), 0);
        ck_assert_int_eq(t->ops->register_region(t, &rb), 0);
        ck_assert_int_eq(t->ops->register_region(t, &ra), 0);
        TransportRegion clash = ra;
        ck_assert_int_eq(t->ops->register_region(t, &clash), -EEXIST);
        TransportRegion gpu = { .id = 5, .domain = MEMORY_GPU, .size = SZ };
        ck_assert_int_eq(t->ops->register_region(t, &gpu), -EOPNOTSUPP);

        /* 64 slices of 64 KiB from a to b, reversed order of offsets. */
        enum { N = 64 };
        TransportWrite w[N];
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 0, .src_offset = (uint64_t)i * 65536,
                                          .dst_region = 1, .dst_offset = (uint64_t)(N - 1 - i) * 65536,
                                          .length = 65536, .cookie = 1000 + i };
        ck_assert_int_eq(t->ops->post(t, NULL, w, N), 0);
        TransportCompletion c[N];
        collect(t, c, N);
        bool seen[N] = {};
        for (int i = 0; i < N; i++) {
                ck_assert_int_eq(c[i].error, 0);
                ck_assert_uint_eq(c[i].bytes, 65536);
                ck_assert(c[i].cookie >= 1000 && c[i].cookie < 1000 + N);
                ck_assert(!seen[c[i].cookie - 1000]);
                seen[c[i].cookie - 1000] = true;
        }
        for (int i = 0; i < N; i++)
                ck_assert_mem_eq(b + (size_t)(N - 1 - i) * 65536, a + (size_t)i * 65536, 65536);
        ck_assert_uint_eq(t->stats.bytes, (uint64_t)N * 65536);
        ck_assert_uint_eq(t->stats.writes, N);
        ck_assert_uint_eq(t->stats.batches, 1);
        ck_assert_uint_eq(local_transport_inflight(t), 0);

        /* Within one region (memmove), and onto itself (no copy). */
        TransportWrite m[2] = {
                { .src_region = 1, .src_offset = 0, .dst_region = 1, .dst_offset = 100, .length = 1000, .cookie = 1 },
                { .src_region = 0, .src_offset = 4096, .dst_region = 0, .dst_offset = 4096, .length = 4096, .cookie = 2 },
        };
        uint8_t *expect = malloc(1000);
        memcpy(expect, b, 1000);
        ck_assert_int_eq(t->ops->post(t, NULL, m, 1), 0);
        collect(t, c, 1);
        ck_assert_mem_eq(b + 100, expect, 1000);
        ck_assert_int_eq(t->ops->post(t, NULL, m + 1, 1), 0);
        collect(t, c, 1);
        ck_assert_uint_eq(c[0].cookie, 2);
        free(expect);

        t->ops->unregister_region(t, &rb);
        t->ops->unregister_region(t, &ra);
        t->ops->free(t);
        free(a);
        free(b);
}
END_TEST

/* Small batches (at most 64 writes, 64 KiB) are copied by post() itself; their
 * completions come through the fd like the others, and a refused one copies nothing. */
START_TEST(test_small_batches) {
        Transport *t = NULL;
        uint8_t *a = malloc(SZ), *b = calloc(1, SZ);
        TransportRegion ra, rb;
        for (size_t i = 0; i < SZ; i++)
                a[i] = (uint8_t)(i * 13 + 1);
        region_init(&ra, 0, a);
        region_init(&rb, 1, b);
        ck_assert_int_eq(local_transport_new(2, &t), 0);
        ck_assert_int_eq(t->ops->register_region(t, &ra), 0);
        ck_assert_int_eq(t->ops->register_region(t, &rb), 0);

        /* 36 layer groups of 1792 bytes (63 KiB): copied before post() returns. */
        enum { N = 36, L = 1792 };
        TransportWrite w[N + 30];
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 0, .src_offset = (uint64_t)i * L, .dst_region = 1,
                                          .dst_offset = (uint64_t)i * 4096, .length = L, .cookie = 500 + i };
        ck_assert_int_eq(t->ops->post(t, NULL, w, N), 0);
        for (int i = 0; i < N; i++)
                ck_assert_mem_eq(b + (size_t)i * 4096, a + (size_t)i * L, L);
        ck_assert_uint_eq(local_transport_inflight(t), N);
        TransportCompletion c[N + 30];
        collect(t, c, N);
        for (int i = 0; i < N; i++) {
                ck_assert_int_eq(c[i].error, 0);
                ck_assert_uint_eq(c[i].bytes, L);
                ck_assert_uint_eq(c[i].cookie, 500 + i);
        }
        ck_assert_uint_eq(local_transport_inflight(t), 0);
        struct pollfd p = { .fd = t->ops->completion_fd(t), .events = POLLIN };
        ck_assert_int_eq(poll(&p, 1, 0), 0); /* nothing more */

        /* A refused small batch copies nothing, not even its valid writes. */
        memset(b, 0, SZ);
        w[1].dst_region = 7;
        ck_assert_int_eq(t->ops->post(t, NULL, w, 2), -ENOENT);
        for (size_t i = 0; i < 2 * 4096; i++)
                ck_assert_uint_eq(b[i], 0);
        ck_assert_uint_eq(local_transport_inflight(t), 0);
        w[1].dst_region = 1;

        /* Past 64 writes or 64 KiB, the copy threads: the same bytes and completions. */
        for (int i = 0; i < N + 30; i++)
                w[i] = (TransportWrite) { .src_region = 0, .src_offset = (uint64_t)i * 1024, .dst_region = 1,
                                          .dst_offset = (uint64_t)i * 1024, .length = 1024, .cookie = i };
        ck_assert_int_eq(t->ops->post(t, NULL, w, N + 30), 0);
        collect(t, c, N + 30);
        ck_assert_mem_eq(b, a, (size_t)(N + 30) * 1024);
        TransportWrite big = { .src_region = 0, .dst_region = 1, .length = (64U << 10) + 1, .cookie = 99 };
        ck_assert_int_eq(t->ops->post(t, NULL, &big, 1), 0);
        collect(t, c, 1);
        ck_assert_uint_eq(c[0].cookie, 99);
        ck_assert_mem_eq(b, a, (64U << 10) + 1);
        ck_assert_uint_eq(local_transport_inflight(t), 0);
        ck_assert_uint_eq(t->stats.batches, 3);
        t->ops->free(t);
        free(a);
        free(b);
}
END_TEST

START_TEST(test_reject) {
        Transport *t = NULL;
        uint8_t *a = malloc(SZ), *b = malloc(SZ);
        TransportRegion ra, rb;
        region_init(&ra, 0, a);
        region_init(&rb, 1, b);
        ck_assert_int_eq(local_transport_new(1, &t), 0);
        ck_assert_int_eq(t->ops->register_region(t, &ra), 0);
        ck_assert_int_eq(t->ops->register_region(t, &rb), 0);

        TransportWrite ok = { .src_region = 0, .dst_region = 1, .length = 10, .cookie = 1 };
        TransportWrite w[2] = { ok, ok };
        w[1].dst_offset = SZ - 5; /* past the end */
        ck_assert_int_eq(t->ops->post(t, NULL, w, 2), -ERANGE);
        w[1] = ok;
        w[1].src_offset = UINT64_MAX - 2; /* overflow */
        ck_assert_int_eq(t->ops->post(t, NULL, w, 2), -ERANGE);
        w[1] = ok;
        w[1].length = 0;
        ck_assert_int_eq(t->ops->post(t, NULL, w, 2), -ERANGE);
        w[1] = ok;
        w[1].dst_region = 7;
        ck_assert_int_eq(t->ops->post(t, NULL, w, 2), -ENOENT);
        w[1].dst_region = 9999;
        ck_assert_int_eq(t->ops->post(t, NULL, w, 2), -ENOENT);
        ck_assert_int_eq(t->ops->post(t, (void *)1, &ok, 1), -EINVAL);
        ck_assert_int_eq(t->ops->post(t, NULL, NULL, 0), 0);
        /* Nothing of a refused batch was queued. */
        ck_assert_uint_eq(local_transport_inflight(t), 0);
        ck_assert_uint_eq(t->stats.batches, 0);

        ck_assert_int_eq(transport_region_check(NULL, 0, 1), -ENOENT);
        ck_assert_int_eq(transport_region_check(&ra, SZ - 1, 1), 0);
        ck_assert_int_eq(transport_region_check(&ra, SZ, 1), -ERANGE);
        ck_assert_int_eq(transport_kind_from_string("tcp"), TRANSPORT_TCP);
        ck_assert_int_eq(transport_kind_from_string("carrier-pigeon"), -EINVAL);
        ck_assert_ptr_null(transport_kind_to_string(_TRANSPORT_KIND_MAX));
        ck_assert_int_eq(local_transport_new(LOCAL_TRANSPORT_THREADS_MAX + 1, &t), -EINVAL);
        t->ops->free(t);
        free(a);
        free(b);
}
END_TEST

START_TEST(test_cancel) {
        Transport *t = NULL;
        uint8_t *a = malloc(SZ), *b = malloc(SZ);
        TransportRegion ra, rb;
        region_init(&ra, 0, a);
        region_init(&rb, 1, b);
        ck_assert_int_eq(local_transport_new(1, &t), 0);
        ck_assert_int_eq(t->ops->register_region(t, &ra), 0);
        ck_assert_int_eq(t->ops->register_region(t, &rb), 0);

        enum { N = 200 };
        TransportWrite w[N];
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 0, .dst_region = 1, .length = SZ, .cookie = i };
        ck_assert_int_eq(t->ops->post(t, NULL, w, N), 0);
        t->ops->cancel_peer(t, NULL);
        /* Every write completes exactly once: done, or cancelled before it started. */
        TransportCompletion c[N];
        collect(t, c, N);
        int cancelled = 0;
        bool seen[N] = {};
        for (int i = 0; i < N; i++) {
                ck_assert(!seen[c[i].cookie]);
                seen[c[i].cookie] = true;
                if (c[i].error == -ECANCELED) {
                        ck_assert_uint_eq(c[i].bytes, 0);
                        cancelled++;
                } else {
                        ck_assert_int_eq(c[i].error, 0);
                        ck_assert_uint_eq(c[i].bytes, SZ);
                }
        }
        ck_assert_int_gt(cancelled, 0);
        ck_assert_uint_eq(t->stats.failures, (uint64_t)cancelled);
        ck_assert_uint_eq(local_transport_inflight(t), 0);

        /* Freeing with work queued drops it without a crash. */
        ck_assert_int_eq(t->ops->post(t, NULL, w, N), 0);
        t->ops->free(t);
        free(a);
        free(b);
}
END_TEST

/* The completion queue tcp, rdma and local share: first in, first out across growth and
 * reuse of its array; taking the oldest moves no other (a reset's 65536 completions were
 * shifted on every take of 256: quadratic, on the event loop). */
START_TEST(test_done_queue) {
        static const TransportOps ops = { .name = "test" };
        Transport t = { .ops = &ops };
        TransportDoneQueue q = {};
        TransportCompletion c[256];
        int efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        uint64_t next_in = 0, next_out = 0;

        ck_assert_int_ge(efd, 0);
        for (int i = 0; i < 1000; i++)
                transport_done_push(&t, &q, efd, next_in++, 0, 1);
        ck_assert_uint_eq(transport_done_take(&q, efd, c, 256), 256);
        for (size_t i = 0; i < 256; i++)
                ck_assert_uint_eq(c[i].cookie, next_out++);
        /* The rest stayed where they were. */
        ck_assert_uint_eq(q.items[256].cookie, 256);
        ck_assert_uint_eq(q.items[999].cookie, 999);
        struct pollfd p = { .fd = efd, .events = POLLIN };
        ck_assert_int_eq(poll(&p, 1, 0), 1); /* more are queued: still readable */

        /* Interleaved: order kept while the array is reused and grows. */
        for (int round = 0; round < 200; round++) {
                for (int i = 0; i < 97; i++)
                        transport_done_push(&t, &q, efd, next_in++, 0, 1);
                size_t k = transport_done_take(&q, efd, c, 1 + round % 256);
                for (size_t i = 0; i < k; i++)
                        ck_assert_uint_eq(c[i].cookie, next_out++);
        }
        size_t k;
        while ((k = transport_done_take(&q, efd, c, 256)) > 0)
                for (size_t i = 0; i < k; i++)
                        ck_assert_uint_eq(c[i].cookie, next_out++);
        ck_assert_uint_eq(next_out, next_in);
        ck_assert_uint_eq(t.stats.writes, next_in);
        ck_assert_int_eq(poll(&p, 1, 0), 0); /* empty: not readable */
        free(q.items);
        close(efd);
}
END_TEST

int main(void) {
        Suite *s = suite_create("transport-local");
        TCase *tc = tcase_create("transport-local");
        tcase_add_test(tc, test_copy);
        tcase_add_test(tc, test_reject);
        tcase_add_test(tc, test_cancel);
        tcase_add_test(tc, test_small_batches);
        tcase_add_test(tc, test_done_queue);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
