/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The copy engine's completions on the fake driver (FAKE_CUDA_MODE=gpu): parts on
 * streams that are independent — another GPU's, or another copy path's of the same GPU —
 * complete independently (a slow GPU → host staging copy submitted first does not hold
 * back a GPU → GPU copy submitted after it, nor GPU 0's copy GPU 1's), while the parts
 * of one (device, path) queue still complete in submission order; every job completes
 * once, and the engine's shutdown waits for every queue's parts. Each copy's time is
 * the fake's FAKE_CUDA_EVENT_MS as it was when its event was recorded. */
#include <check.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "system.h"
#include "time-util.h"
#include "vmm.h"
#include "fake-gpu.h"
#include "../check-main.h"

/* The slow copy: long beside the fast one and beside a loaded CI's (or a sanitizer's)
 * scheduling; the fast one must be reaped within half of it. */
#define SLOW_MS 1000
#define FAST_MS 1
#define AREA (2U << 20)

typedef struct Rig {
        GpuSystem *s;
        GpuCopyEngine *e;
        GpuArena *a[2][2]; /* two arenas on each of (up to) two GPUs */
        uint64_t t0;
} Rig;

static void rig_open(Rig *r, int devices) {
        char n[8];
        *r = (Rig) {};
        fake_gpu(false);
        snprintf(n, sizeof n, "%d", devices);
        ck_assert_int_eq(setenv("FAKE_CUDA_DEVICES", n, 1), 0);
        /* Set before any thread runs: later changes only replace the value (a thread of
         * the engine reads the environment through the fake). */
        ck_assert_int_eq(setenv("FAKE_CUDA_EVENT_MS", "0", 1), 0);
        ck_assert_int_eq(gpu_system_open(fake(), &r->s), 0);
        ck_assert_uint_eq(r->s->n_devices, (size_t)devices);
        for (int d = 0; d < devices; d++)
                for (int i = 0; i < 2; i++) {
                        ck_assert_int_eq(gpu_arena_new(r->s, d, AREA, &r->a[d][i]), 0);
                        memset((void *)(uintptr_t)r->a[d][i]->base, 0x10 * (d + 1) + i, AREA);
                }
        ck_assert_int_eq(gpu_copy_engine_new(r->s, &r->e), 0);
}

static void rig_close(Rig *r) {
        r->e = gpu_copy_engine_free(r->e);
        for (int d = 0; d < 2; d++)
                for (int i = 0; i < 2; i++)
                        gpu_arena_unref(r->a[d][i]);
        gpu_system_unref(r->s);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_EVENT_MS"), 0);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_DEVICES"), 0);
}

/* Submits segs, each event done ms after it was recorded. */
static void submit_taking(Rig *r, const GpuCopySeg *segs, size_t n, uint64_t cookie, unsigned ms) {
        char v[16];
        snprintf(v, sizeof v, "%u", ms);
        ck_assert_int_eq(setenv("FAKE_CUDA_EVENT_MS", v, 1), 0);
        ck_assert_int_eq(gpu_copy_submit(r->e, segs, n, cookie), 0);
}

/* Reaps n jobs (cookies 1..n): at[cookie] is when it was reaped, in ms after r->t0;
 * order[k] the k-th cookie reaped. Each job once, without error. */
static void reap_all(Rig *r, size_t n, uint64_t *at, uint64_t *order) {
        size_t got = 0;
        for (size_t i = 1; i <= n; i++)
                at[i] = 0;
        while (got < n) {
                GpuCopyDone d[8];
                ck_assert_int_eq(gpu_copy_wait(r->e, 5000), 1);
                size_t k = gpu_copy_reap(r->e, d, ELEMENTSOF(d));
                uint64_t now = (now_usec(CLOCK_MONOTONIC) - r->t0) / USEC_PER_MSEC;
                for (size_t i = 0; i < k; i++) {
                        ck_assert_int_eq(d[i].error, 0);
                        ck_assert(d[i].cookie >= 1 && d[i].cookie <= n);
                        ck_assert_uint_eq(at[d[i].cookie], 0);
                        at[d[i].cookie] = now + 1; /* 0: not yet */
                        order[got++] = d[i].cookie;
                }
        }
        for (size_t i = 1; i <= n; i++)
                at[i]--;
        ck_assert_uint_eq(gpu_copy_engine_in_flight(r->e), 0);
}

/* GPU 0's slow copy, submitted first, does not delay GPU 1's fast one: the fast job is
 * reaped long before the slow one ends, whether the completion thread sleeps in the
 * blocking sync at once (spin 0) or polls and naps first (the default). */
START_TEST(test_other_gpu_does_not_wait) {
        static const unsigned spins[] = { 0, GPU_COPY_SPIN_USEC };
        Rig r;
        rig_open(&r, 2);
        for (size_t k = 0; k < ELEMENTSOF(spins); k++) {
                gpu_copy_engine_set_spin(r.e, spins[k]);
                GpuCopySeg slow = { .src = r.a[0][0], .dst = r.a[0][1], .length = 1 << 20 };
                GpuCopySeg fast = { .src = r.a[1][0], .dst = r.a[1][1], .length = 1 << 20 };
                uint64_t at[3], order[2];
                r.t0 = now_usec(CLOCK_MONOTONIC);
                submit_taking(&r, &slow, 1, 1, SLOW_MS);
                submit_taking(&r, &fast, 1, 2, FAST_MS);
                reap_all(&r, 2, at, order);
                ck_assert_uint_eq(order[0], 2);
                ck_assert_uint_lt(at[2], SLOW_MS / 2);
                ck_assert_uint_ge(at[1], SLOW_MS);
                /* The bytes landed on each GPU. */
                ck_assert_uint_eq(((const uint8_t *)(uintptr_t)r.a[0][1]->base)[4096], 0x10);
                ck_assert_uint_eq(((const uint8_t *)(uintptr_t)r.a[1][1]->base)[4096], 0x20);
        }
        rig_close(&r);
}
END_TEST

/* On one GPU, a slow GPU → host copy (staging) submitted first does not delay a fast
 * same-GPU copy submitted after it; a job with parts on two paths completes once, with
 * its last part, and does not delay a fast job on a third path; two parts on one path
 * still complete in submission order (a stream runs its work in order: the fast one
 * behind the slow one is not reported before it), while a third path's does not wait. */
START_TEST(test_other_path_does_not_wait) {
        static uint8_t host[1 << 20] __attribute__((aligned(4096)));
        Rig r;
        rig_open(&r, 1);
        ck_assert_int_eq(gpu_host_register(r.s, host, sizeof host), 0);
        GpuCopySeg d2h = { .src = r.a[0][0], .dst_host = host, .length = sizeof host };
        GpuCopySeg d2d = { .src = r.a[0][0], .dst = r.a[0][1], .length = 1 << 20 };
        GpuCopySeg d2d2 = { .src = r.a[0][0], .dst = r.a[0][1], .src_offset = 1 << 20, .dst_offset = 1 << 20,
                            .length = 1 << 20 };
        GpuCopySeg h2d = { .src_host = host, .dst = r.a[0][0], .dst_offset = 1 << 20, .length = 4096 };
        GpuCopySeg both[2] = { d2h, d2d2 };
        uint64_t at[4], order[3];

        /* Staging first, then a GPU → GPU layer group. */
        r.t0 = now_usec(CLOCK_MONOTONIC);
        submit_taking(&r, &d2h, 1, 1, SLOW_MS);
        submit_taking(&r, &d2d, 1, 2, FAST_MS);
        reap_all(&r, 2, at, order);
        ck_assert_uint_eq(order[0], 2);
        ck_assert_uint_lt(at[2], SLOW_MS / 2);
        ck_assert_uint_ge(at[1], SLOW_MS);
        ck_assert_uint_eq(host[100], 0x10);
        ck_assert_uint_eq(((const uint8_t *)(uintptr_t)r.a[0][1]->base)[100], 0x10);

        /* A slow job with parts on two paths, then a fast host → GPU job (a third
         * queue): the slow job completes once, when both its parts have. */
        r.t0 = now_usec(CLOCK_MONOTONIC);
        submit_taking(&r, both, 2, 1, SLOW_MS);
        submit_taking(&r, &h2d, 1, 2, FAST_MS);
        reap_all(&r, 2, at, order);
        ck_assert_uint_eq(order[0], 2);
        ck_assert_uint_lt(at[2], SLOW_MS / 2);
        ck_assert_uint_ge(at[1], SLOW_MS);

        /* One path: in order. */
        r.t0 = now_usec(CLOCK_MONOTONIC);
        submit_taking(&r, &d2d, 1, 1, SLOW_MS / 2);
        submit_taking(&r, &d2d2, 1, 2, FAST_MS);
        submit_taking(&r, &d2h, 1, 3, FAST_MS);
        reap_all(&r, 3, at, order);
        ck_assert_uint_eq(order[0], 3);
        ck_assert_uint_lt(at[3], SLOW_MS / 4);
        ck_assert_uint_ge(at[1], SLOW_MS / 2);
        ck_assert_uint_ge(at[2], at[1]);

        /* Each path learned its own pace (a diagnostic): a known path, a known device. */
        GpuCopyPace p;
        ck_assert_int_eq(gpu_copy_engine_pace(r.e, 0, GPU_COPY_D2H, &p), 0);
        ck_assert_uint_gt(p.last_end_usec, 0);
        ck_assert_int_eq(gpu_copy_engine_pace(r.e, 0, GPU_COPY_SAME_GPU, &p), 0);
        ck_assert_uint_gt(p.last_end_usec, 0);
        ck_assert_int_eq(gpu_copy_engine_pace(r.e, 1, GPU_COPY_SAME_GPU, &p), -EINVAL);
        ck_assert_int_eq(gpu_host_unregister(r.s, host), 0);
        rig_close(&r);
}
END_TEST

/* Many jobs over four queues (two GPUs, same-GPU and peer paths; some jobs on several),
 * each completed once; then more left in flight when the engine is freed: its shutdown
 * waits for every queue's parts and joins every completion thread (ASan/TSan see what
 * it leaves). */
START_TEST(test_many_queues_and_shutdown) {
        enum { JOBS = 400 };
        Rig r;
        rig_open(&r, 2);
        uint64_t *at = calloc(JOBS + 1, sizeof *at), *order = calloc(JOBS, sizeof *order);
        ck_assert_ptr_nonnull(at);
        ck_assert_ptr_nonnull(order);
        GpuCopySeg q[4] = {
                { .src = r.a[0][0], .dst = r.a[0][1], .length = 4096 },                     /* GPU 0, same GPU */
                { .src = r.a[1][0], .dst = r.a[1][1], .length = 4096 },                     /* GPU 1, same GPU */
                { .src = r.a[1][0], .dst = r.a[0][1], .dst_offset = 1 << 20, .length = 4096 }, /* GPU 0, peer */
                { .src = r.a[0][0], .dst = r.a[1][1], .dst_offset = 1 << 20, .length = 4096 }, /* GPU 1, peer */
        };
        r.t0 = now_usec(CLOCK_MONOTONIC);
        for (unsigned i = 0; i < JOBS; i++) {
                GpuCopySeg two[2] = { q[i % 4], q[(i + 1) % 4] };
                if (i % 5 == 0)
                        submit_taking(&r, two, 2, i + 1, i % 3);
                else
                        submit_taking(&r, &q[i % 4], 1, i + 1, i % 3);
        }
        reap_all(&r, JOBS, at, order);
        const GpuCopyStats *st = gpu_copy_engine_stats(r.e);
        ck_assert_uint_eq(st->batches, JOBS);
        ck_assert_uint_eq(st->failures, 0);

        /* Left in flight on every queue: the engine's free waits for them (the last
         * one ends 200 ms after it was recorded, before t). */
        for (unsigned i = 0; i < 16; i++)
                submit_taking(&r, &q[i % 4], 1, i + 1, 200);
        uint64_t t = now_usec(CLOCK_MONOTONIC);
        ck_assert_uint_eq(gpu_copy_engine_in_flight(r.e), 16);
        r.e = gpu_copy_engine_free(r.e);
        ck_assert_uint_ge(now_usec(CLOCK_MONOTONIC) - t, 150 * USEC_PER_MSEC);
        free(at);
        free(order);
        rig_close(&r);
}
END_TEST

static Suite *suite(void) {
        Suite *s = suite_create("gpu-completions");
        TCase *tc = tcase_create("core");
        tcase_add_test(tc, test_other_gpu_does_not_wait);
        tcase_add_test(tc, test_other_path_does_not_wait);
        tcase_add_test(tc, test_many_queues_and_shutdown);
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        return check_run(suite(), CK_FORK_GETENV);
}
