/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The CUDA transport's batched-kernel path without a GPU: the fake driver loads any
 * module and runs the chunk kernels on the host (FAKE_CUDA_KERNELS=1), so what the host
 * does around them runs in CI: small writes going to the kernel instead of the copy
 * engine, a batch in parts (each its descriptor slot, upload and launch), descriptor
 * slots given back on completion and on failure, the part sizes, the uniform kernel,
 * every write completed once with its own cookie. What the kernels do on a real GPU is
 * tested on the device machine (bench/gpu/run-device.sh). */
#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "copy.h"
#include "gpu/gpu-domain.h"
#include "pack.h"
#include "time-util.h"
#include "transport/cuda.h"
#include "vmm.h"
#include "fake-gpu.h"
#include "../check-main.h"

/* A stand-in for the embedded fatbin (the fake driver loads any image): this test's
 * definition takes the place of the build's, which is empty without nvcc. */
__attribute__((visibility("hidden"))) const unsigned char epd_pack_fatbin[] = { 0x50, 0xed, 0x55, 0xba };
__attribute__((visibility("hidden"))) const size_t epd_pack_fatbin_size = sizeof epd_pack_fatbin;

enum { N = 10000, PIECE = 128 };

typedef struct Fixture {
        GpuContext *g;
        Transport *t;
        GpuCopyEngine *e;
        Arena *a, *b;
        uint8_t *src, *dst;
        TransportWrite *w;
        uint64_t *seen;
} Fixture;

static void setup(Fixture *f) {
        fake_gpu(false);
        ck_assert_int_eq(setenv("FAKE_CUDA_KERNELS", "1", 1), 0);
        ck_assert_int_eq(gpu_context_new(fake(), &f->g), 0);
        f->t = f->g->transport;
        f->e = cuda_transport_engine(f->t);
        /* As epdd sets it ([Gpu] CopyKernel=small): batches of 16 or more small writes. */
        gpu_copy_engine_set_kernel_policy(f->e, GPU_COPY_KERNEL_SMALL, 16);
        f->a = fake_arena(f->g, 1, 2 << 20);
        f->b = fake_arena(f->g, 2, 2 << 20);
        f->src = (uint8_t *)(uintptr_t)f->a->gpu->base;
        f->dst = (uint8_t *)(uintptr_t)f->b->gpu->base;
        for (size_t i = 0; i < (size_t)N * PIECE; i++)
                f->src[i] = (uint8_t)(i * 13 + 5);
        f->w = calloc(N, sizeof *f->w);
        f->seen = calloc(N, sizeof *f->seen);
        ck_assert_ptr_nonnull(f->w);
        ck_assert_ptr_nonnull(f->seen);
        /* Reversed on the destination: nothing coalesces, every write is a descriptor. */
        for (int i = 0; i < N; i++)
                f->w[i] = (TransportWrite) { .src_region = 1, .src_offset = (uint64_t)i * PIECE, .dst_region = 2,
                                             .dst_offset = (uint64_t)(N - 1 - i) * PIECE, .length = PIECE,
                                             .cookie = (uint64_t)i };
}

static void teardown(Fixture *f) {
        fake_arena_free(f->g, f->a);
        fake_arena_free(f->g, f->b);
        gpu_context_free(f->g);
        free(f->w);
        free(f->seen);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_KERNELS"), 0);
}

/* Runs the batch; checks every byte landed and every cookie came back once. */
static void run_and_check(Fixture *f) {
        uint8_t *hit = calloc(N, 1);
        ck_assert_ptr_nonnull(hit);
        memset(f->dst, 0, (size_t)N * PIECE);
        ck_assert_int_eq(run_writes(f->t, f->w, N, f->seen), 0);
        for (int i = 0; i < N; i++) {
                ck_assert_uint_lt(f->seen[i], N);
                ck_assert_uint_eq(hit[f->seen[i]]++, 0);
        }
        for (int i = 0; i < N; i++)
                ck_assert_int_eq(memcmp(f->dst + (size_t)(N - 1 - i) * PIECE, f->src + (size_t)i * PIECE, PIECE), 0);
        free(hit);
}

START_TEST(test_small_writes_go_to_the_kernel_in_parts) {
        Fixture f = {};
        setup(&f);
        uint64_t launches = gpu_copy_engine_stats(f.e)->kernel_launches;
        uint64_t bytes = f.t->stats.bytes;
        void *lib = dlopen(fake(), RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        const unsigned long *waits = dlsym(lib, "fake_cuda_stream_waits");
        ck_assert_ptr_nonnull(waits);
        unsigned long waits0 = __atomic_load_n(waits, __ATOMIC_RELAXED);
        run_and_check(&f);
        /* Parts of 256, 512, 1024, 2048, 4096 writes, then the rest (2064): one launch each,
         * each behind its descriptors' upload on the upload stream (a wait a launch). */
        ck_assert_uint_eq(gpu_copy_engine_stats(f.e)->kernel_launches - launches, 6);
        ck_assert_uint_eq(__atomic_load_n(waits, __ATOMIC_RELAXED) - waits0, 6);
        dlclose(lib);
        ck_assert_uint_eq(f.t->stats.bytes - bytes, (uint64_t)N * PIECE);

        /* Other part sizes: the same bytes, a launch per part: 16 + 32 + 40 x 249 (the
         * last one short; more parts than the 64 descriptor slots, so a part that comes
         * before the completion thread gave one back takes the copy engine: at most
         * that many); one part of 10000 in slots of 4096 descriptors, three launches;
         * parts under the kernel's minimum of 16 writes all go to the copy engine. */
        static const struct {
                size_t first, max;
                uint64_t launches;
        } cases[] = { { 1000, 1000, 10 }, { 16, 40, 2 + 249 }, { N, N, 3 }, { 3, 7, 0 } };
        for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
                cuda_transport_set_parts(f.t, cases[i].first, cases[i].max);
                launches = gpu_copy_engine_stats(f.e)->kernel_launches;
                run_and_check(&f);
                uint64_t got = gpu_copy_engine_stats(f.e)->kernel_launches - launches;
                if (cases[i].launches > 64) {
                        ck_assert_uint_le(got, cases[i].launches);
                        ck_assert_uint_ge(got, 64);
                } else
                        ck_assert_uint_eq(got, cases[i].launches);
        }
        cuda_transport_set_parts(f.t, 256, 4096);

        /* The uniform kernel (every chunk of one length): the same bytes. */
        gpu_copy_engine_set_kernel_uniform(f.e, true);
        run_and_check(&f);
        gpu_copy_engine_set_kernel_uniform(f.e, false);
        teardown(&f);
}
END_TEST

START_TEST(test_many_batches_in_flight) {
        /* More parts in flight than descriptor slots (64): a part that finds none goes
         * to the copy engine instead; every batch still completes whole. */
        Fixture f = {};
        setup(&f);
        enum { BATCHES = 40 };
        cuda_transport_set_parts(f.t, 64, 64); /* 157 parts a batch */
        memset(f.dst, 0, (size_t)N * PIECE);
        uint64_t before = gpu_copy_engine_stats(f.e)->kernel_launches;
        for (int k = 0; k < BATCHES; k++)
                ck_assert_int_eq(f.t->ops->post(f.t, NULL, f.w, N), 0);
        size_t seen = 0;
        TransportCompletion c[256];
        while (seen < (size_t)BATCHES * N) {
                struct pollfd p = { .fd = f.t->ops->completion_fd(f.t), .events = POLLIN };
                size_t k = f.t->ops->poll(f.t, c, ELEMENTSOF(c));
                for (size_t i = 0; i < k; i++) {
                        ck_assert_int_eq(c[i].error, 0);
                        seen += c[i].writes;
                }
                if (k == 0)
                        ck_assert_int_eq(poll(&p, 1, 5000), 1);
        }
        ck_assert_uint_eq(gpu_copy_engine_in_flight(f.e), 0);
        ck_assert_uint_gt(gpu_copy_engine_stats(f.e)->kernel_launches, before);
        for (int i = 0; i < N; i++)
                ck_assert_int_eq(memcmp(f.dst + (size_t)(N - 1 - i) * PIECE, f.src + (size_t)i * PIECE, PIECE), 0);
        /* Every slot came back: a batch afterwards still takes the kernel, part by part. */
        cuda_transport_set_parts(f.t, 256, 4096);
        uint64_t launches = gpu_copy_engine_stats(f.e)->kernel_launches;
        run_and_check(&f);
        ck_assert_uint_eq(gpu_copy_engine_stats(f.e)->kernel_launches - launches, 6);
        teardown(&f);
}
END_TEST

START_TEST(test_failed_kernels_give_their_slots_back) {
        /* The copies fail (as after a fault on the stream): every write fails once, and
         * the descriptor slots are free again for the next batch, which succeeds. */
        Fixture f = {};
        setup(&f);
        uint64_t failures = f.t->stats.failures;
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", "1", 1), 0);
        for (int k = 0; k < 20; k++) /* 20 x 6 parts: more than the 64 slots, if any leaked */
                ck_assert_int_eq(run_writes(f.t, f.w, N, NULL), -EFAULT);
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", "0", 1), 0);
        ck_assert_uint_eq(f.t->stats.failures - failures, 20ULL * N);
        uint64_t launches = gpu_copy_engine_stats(f.e)->kernel_launches;
        run_and_check(&f);
        ck_assert_uint_eq(gpu_copy_engine_stats(f.e)->kernel_launches - launches, 6);
        teardown(&f);
}
END_TEST

/* Posts f->w (N writes, cookies base .. base + k - 1) and collects every completion:
 * per cookie, its writes and bytes; checks each is error-free and, while 16 or fewer
 * cookies alternate, that they come once each in the order each first appears. Returns
 * how many completions came. */
static size_t post_and_collect(Fixture *f, uint64_t base, unsigned k, uint64_t *writes, uint64_t *bytes) {
        size_t seen = 0, completions = 0;
        TransportCompletion c[64];

        ck_assert_int_eq(f->t->ops->post(f->t, NULL, f->w, N), 0);
        while (seen < N) {
                struct pollfd p = { .fd = f->t->ops->completion_fd(f->t), .events = POLLIN };
                size_t m = f->t->ops->poll(f->t, c, ELEMENTSOF(c));
                for (size_t i = 0; i < m; i++) {
                        ck_assert_int_eq(c[i].error, 0);
                        ck_assert_uint_ge(c[i].cookie, base);
                        ck_assert_uint_lt(c[i].cookie, base + k);
                        if (k <= 16)
                                ck_assert_uint_eq(c[i].cookie, base + completions); /* first appearance */
                        writes[c[i].cookie - base] += c[i].writes;
                        bytes[c[i].cookie - base] += c[i].bytes;
                        seen += c[i].writes;
                        completions++;
                }
                if (m == 0)
                        ck_assert_int_eq(poll(&p, 1, 5000), 1);
        }
        ck_assert_uint_eq(seen, N);
        if (k <= 16)
                ck_assert_uint_eq(completions, k); /* the batch completes once, each cookie once */
        return completions;
}

/* Several groups' writes interleaved page by page in one batch (a handoff posting the
 * layer groups that queued up behind its earlier ones): one completion per cookie, its
 * writes and bytes summed, in the order each cookie first appears (the handoff counts
 * its batch done at the last one), however the cookies alternate; past 16 distinct
 * cookies alternating, a completion per run, whose writes still add up. The second
 * pass has pieces that continue each other on both sides: they coalesce into one copy
 * per four, and each cookie still gets exactly its own writes and bytes. */
START_TEST(test_interleaved_cookies_complete_once_each) {
        Fixture f = {};
        setup(&f);
        static const unsigned kinds[] = { 3, 16, 20 };
        for (size_t q = 0; q < ELEMENTSOF(kinds); q++) {
                unsigned k = kinds[q];
                uint64_t writes[20] = {}, bytes[20] = {};
                for (int i = 0; i < N; i++)
                        f.w[i].cookie = 1000 + (uint64_t)(i % (int)k);
                memset(f.dst, 0, (size_t)N * PIECE);
                post_and_collect(&f, 1000, k, writes, bytes);
                for (unsigned j = 0; j < k; j++) {
                        uint64_t want = N / k + (j < N % k ? 1 : 0);
                        ck_assert_uint_eq(writes[j], want);
                        ck_assert_uint_eq(bytes[j], want * PIECE);
                }
                for (int i = 0; i < N; i++)
                        ck_assert_int_eq(
                                memcmp(f.dst + (size_t)(N - 1 - i) * PIECE, f.src + (size_t)i * PIECE, PIECE), 0);
        }

        /* Four cookies, piece i of "page" i / 4 at the same offset on both sides: each
         * page's four pieces continue each other and go as one copy. */
        for (int i = 0; i < N; i++)
                f.w[i] = (TransportWrite) { .src_region = 1, .src_offset = (uint64_t)i * PIECE, .dst_region = 2,
                                            .dst_offset = (uint64_t)i * PIECE, .length = PIECE,
                                            .cookie = 2000 + (uint64_t)(i % 4) };
        uint64_t segments = gpu_copy_engine_stats(f.e)->segments, writes[4] = {}, bytes[4] = {};
        memset(f.dst, 0, (size_t)N * PIECE);
        post_and_collect(&f, 2000, 4, writes, bytes);
        for (int j = 0; j < 4; j++) {
                ck_assert_uint_eq(writes[j], N / 4);
                ck_assert_uint_eq(bytes[j], (uint64_t)N / 4 * PIECE);
        }
        /* Coalesced within each part (a part's edges may cut a run): far fewer copies. */
        ck_assert_uint_lt(gpu_copy_engine_stats(f.e)->segments - segments, N / 2);
        ck_assert_int_eq(memcmp(f.dst, f.src, (size_t)N * PIECE), 0);
        teardown(&f);
}
END_TEST

START_TEST(test_few_writes_stay_on_the_copy_engine) {
        /* Fewer writes than the kernel's minimum (16) go to the copy engine. */
        Fixture f = {};
        setup(&f);
        TransportWrite w[4];
        for (int i = 0; i < 4; i++)
                w[i] = (TransportWrite) { .src_region = 1, .src_offset = (uint64_t)i * (256 << 10), .dst_region = 2,
                                          .dst_offset = (uint64_t)(3 - i) * (256 << 10), .length = 256 << 10,
                                          .cookie = (uint64_t)i };
        uint64_t launches = gpu_copy_engine_stats(f.e)->kernel_launches;
        ck_assert_int_eq(run_writes(f.t, w, 4, NULL), 0);
        ck_assert_uint_eq(gpu_copy_engine_stats(f.e)->kernel_launches - launches, 0);
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(memcmp(f.dst + (size_t)(3 - i) * (256 << 10), f.src + (size_t)i * (256 << 10),
                                        256 << 10), 0);
        teardown(&f);
}
END_TEST

static usec_t unregister_timed(Transport *t, TransportRegion *r) {
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        t->ops->unregister_region(t, r);
        return now_usec(CLOCK_MONOTONIC) - t0;
}

/* Unregistering a pinned host region (a handoff's idle staging buffer given up for
 * room, on epdd's loop) waits only for the copies into or out of that region, not for
 * every copy on the engine: a GPU → GPU batch of another handoff still copying (400 ms
 * here) does not hold it; a copy out of the region itself does, and its completion is
 * still delivered afterwards, bytes landed. */
START_TEST(test_unregister_waits_only_for_its_own_copies) {
        Fixture f = {};
        setup(&f);
        enum { HOST = 1 << 20 };
        uint8_t *h1 = aligned_alloc(4096, HOST), *h2 = aligned_alloc(4096, HOST);
        ck_assert_ptr_nonnull(h1);
        ck_assert_ptr_nonnull(h2);
        memset(h1, 0x11, HOST);
        memset(h2, 0x22, HOST);
        TransportRegion r1 = { .id = 11, .domain = MEMORY_HOST, .host_base = h1, .size = HOST },
                        r2 = { .id = 12, .domain = MEMORY_HOST, .host_base = h2, .size = HOST };
        ck_assert_int_eq(f.t->ops->register_region(f.t, &r1), 0);
        ck_assert_int_eq(f.t->ops->register_region(f.t, &r2), 0);
        /* One copy host r1 → GPU, done before the slow ones start. */
        TransportWrite up = { .src_region = 11, .dst_region = 2, .length = 4096, .cookie = 7 };
        ck_assert_int_eq(run_writes(f.t, &up, 1, NULL), 0);

        ck_assert_int_eq(setenv("FAKE_CUDA_COPY_DELAY_MS", "400", 1), 0);
        ck_assert_int_eq(f.t->ops->post(f.t, NULL, f.w, N), 0); /* GPU → GPU, 400 ms */
        ck_assert_uint_gt(gpu_copy_engine_in_flight(f.e), 0);
        usec_t took = unregister_timed(f.t, &r1);
        ck_assert_uint_lt(took, 200 * USEC_PER_MSEC);

        /* A copy out of r2 in flight: its unregistering waits for it. */
        TransportWrite down = { .src_region = 12, .dst_region = 2, .dst_offset = 3 << 19, .length = 4096, .cookie = 1ULL << 40 };
        ck_assert_int_eq(f.t->ops->post(f.t, NULL, &down, 1), 0);
        took = unregister_timed(f.t, &r2);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_COPY_DELAY_MS"), 0);
        ck_assert_uint_ge(took, 100 * USEC_PER_MSEC);
        /* Every completion still comes, each once: the N writes and the one out of r2. */
        size_t seen = 0, nine = 0;
        TransportCompletion c[64];
        while (seen < (size_t)N + 1) {
                struct pollfd p = { .fd = f.t->ops->completion_fd(f.t), .events = POLLIN };
                size_t k = f.t->ops->poll(f.t, c, ELEMENTSOF(c));
                for (size_t i = 0; i < k; i++) {
                        ck_assert_int_eq(c[i].error, 0);
                        nine += c[i].cookie == 1ULL << 40;
                        seen += c[i].writes;
                }
                if (k == 0)
                        ck_assert_int_eq(poll(&p, 1, 5000), 1);
        }
        ck_assert_uint_eq(seen, (size_t)N + 1);
        ck_assert_uint_eq(nine, 1);
        ck_assert_uint_eq(gpu_copy_engine_in_flight(f.e), 0);
        for (size_t i = 0; i < 4096; i++)
                ck_assert_uint_eq(f.dst[(3 << 19) + i], 0x22);
        free(h1);
        free(h2);
        teardown(&f);
}
END_TEST

/* A batch that copies out of more pinned regions than a batch tracks one by one
 * (BATCH_PINNED_MAX, 4): unpinning any of them still waits for it. */
START_TEST(test_unregister_waits_for_wide_batches) {
        Fixture f = {};
        setup(&f);
        enum { HOST = 1 << 16, K = 6 };
        uint8_t *h[K];
        TransportRegion r[K];
        TransportWrite w[K];
        for (int i = 0; i < K; i++) {
                h[i] = aligned_alloc(4096, HOST);
                ck_assert_ptr_nonnull(h[i]);
                memset(h[i], 0x30 + i, HOST);
                r[i] = (TransportRegion) { .id = 20 + (uint64_t)i, .domain = MEMORY_HOST, .host_base = h[i],
                                           .size = HOST };
                ck_assert_int_eq(f.t->ops->register_region(f.t, &r[i]), 0);
                w[i] = (TransportWrite) { .src_region = 20 + (uint64_t)i, .dst_region = 2,
                                          .dst_offset = (3 << 19) + (uint64_t)i * 4096, .length = 4096,
                                          .cookie = 500 };
        }
        ck_assert_int_eq(setenv("FAKE_CUDA_COPY_DELAY_MS", "300", 1), 0);
        ck_assert_int_eq(f.t->ops->post(f.t, NULL, w, K), 0);
        usec_t took = unregister_timed(f.t, &r[K - 1]); /* the sixth: not among the four tracked */
        ck_assert_int_eq(unsetenv("FAKE_CUDA_COPY_DELAY_MS"), 0);
        ck_assert_uint_ge(took, 100 * USEC_PER_MSEC);
        /* Its completion still comes, once, every byte landed. */
        size_t seen = 0;
        TransportCompletion c[16];
        while (seen < K) {
                struct pollfd p = { .fd = f.t->ops->completion_fd(f.t), .events = POLLIN };
                size_t k = f.t->ops->poll(f.t, c, ELEMENTSOF(c));
                for (size_t i = 0; i < k; i++) {
                        ck_assert_int_eq(c[i].error, 0);
                        ck_assert_uint_eq(c[i].cookie, 500);
                        seen += c[i].writes;
                }
                if (k == 0 && seen < K)
                        ck_assert_int_eq(poll(&p, 1, 5000), 1);
        }
        for (int i = 0; i < K; i++)
                ck_assert_uint_eq(f.dst[(3 << 19) + i * 4096], 0x30 + i);
        for (int i = 0; i < K - 1; i++)
                f.t->ops->unregister_region(f.t, &r[i]);
        for (int i = 0; i < K; i++)
                free(h[i]);
        teardown(&f);
}
END_TEST

/* The copy timeline (a diagnostic: EPD_GPU_COPY_TIMELINE in epdd): a line per part once
 * it is seen done, the parts of one batch in order, each with its segments and bytes,
 * times in order on one clock (the fake's events carry real times); refused once the
 * engine made its events, and when on already. */
START_TEST(test_timeline_has_a_line_per_part) {
        Fixture f = {};
        setup(&f);
        int fd = memfd_create("timeline", MFD_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        /* Two threads write it (the completion thread, the reaper): whole lines at its end. */
        ck_assert_int_eq(fcntl(fd, F_SETFL, O_APPEND), 0);
        ck_assert_int_eq(gpu_copy_engine_set_timeline(f.e, fd), 0);
        ck_assert_int_eq(gpu_copy_engine_set_timeline(f.e, fd), -EALREADY);
        run_and_check(&f);
        run_and_check(&f);

        ck_assert_int_eq(lseek(fd, 0, SEEK_SET), 0);
        FILE *in = fdopen(fd, "r");
        ck_assert_ptr_nonnull(in);
        char line[512];
        unsigned n = 0, reaps = 0;
        uint64_t segs_sum = 0, bytes_sum = 0, last_job = 0, seen_of[16] = {}, reaped_at[16] = {};
        while (fgets(line, sizeof line, in)) {
                uint64_t job, segs, bytes, enter, queued, seen, at;
                double gs, ge;
                int dev, err;
                if (sscanf(line, "reap job=%" SCNu64 " at=%" SCNu64, &job, &at) == 2) {
                        /* The caller took the job (once): after its part's line. */
                        ck_assert(job >= 1 && job <= 12);
                        ck_assert_uint_eq(reaped_at[job], 0);
                        ck_assert_uint_gt(seen_of[job], 0);
                        reaped_at[job] = at;
                        reaps++;
                        continue;
                }
                ck_assert_int_eq(sscanf(line,
                                        "part job=%" SCNu64 " dev=%d segs=%" SCNu64 " bytes=%" SCNu64
                                        " enter=%" SCNu64 " queued=%" SCNu64 " gpu_start=%lf gpu_end=%lf seen=%" SCNu64
                                        " error=%d",
                                        &job, &dev, &segs, &bytes, &enter, &queued, &gs, &ge, &seen, &err),
                                 10);
                ck_assert_uint_eq(job, last_job + 1); /* a job a part, in order */
                last_job = job;
                ck_assert_int_eq(dev, 0);
                ck_assert_int_eq(err, 0);
                ck_assert_uint_eq(bytes, segs * PIECE);
                ck_assert_uint_le(enter, queued);
                ck_assert_uint_le(queued, seen);
                ck_assert(gs >= 0 && gs <= ge);
                ck_assert(gs + 1000 >= (double)enter);  /* placed from the reference: */
                ck_assert(ge <= (double)seen + 1000);   /* µs of slack, not more */
                segs_sum += segs;
                bytes_sum += bytes;
                ck_assert(job >= 1 && job <= 12);
                seen_of[job] = seen;
                n++;
        }
        fclose(in);
        ck_assert_uint_eq(n, 12); /* 256, 512, 1024, 2048, 4096, 2064 writes, twice */
        ck_assert_uint_eq(reaps, 12);
        for (unsigned j = 1; j <= 12; j++)
                ck_assert_uint_ge(reaped_at[j], seen_of[j]);
        ck_assert_uint_eq(segs_sum, 2ULL * N);
        ck_assert_uint_eq(bytes_sum, 2ULL * N * PIECE);
        teardown(&f);

        /* Once a batch went (its events made without timing): refused. */
        setup(&f);
        run_and_check(&f);
        fd = memfd_create("timeline", MFD_CLOEXEC);
        ck_assert_int_eq(gpu_copy_engine_set_timeline(f.e, fd), -EBUSY);
        close(fd);
        teardown(&f);
}
END_TEST

/* The batched kernel's descriptor memory (pinned on the host and on the GPU, 6 MiB
 * each) cannot be had: the lane runs without the kernel, as when its module does not
 * load, and every write still lands, through the copy engines, instead of the GPU's
 * lane failing to set up (and every copy on it failing -ENOMEM). */
START_TEST(test_lane_without_descriptor_memory) {
        static const char *const knobs[] = { "FAKE_CUDA_FAIL_ALLOC_HOST", "FAKE_CUDA_FAIL_ALLOC" };
        for (size_t k = 0; k < ELEMENTSOF(knobs); k++) {
                Fixture f = {};
                ck_assert_int_eq(setenv(knobs[k], "1", 1), 0);
                setup(&f); /* registering the arenas sets the lane up */
                ck_assert_int_eq(gpu_copy_engine_use_device(f.e, 0), 0);
                uint64_t bytes = f.t->stats.bytes;
                run_and_check(&f);
                run_and_check(&f);
                ck_assert_uint_eq(gpu_copy_engine_stats(f.e)->kernel_launches, 0);
                ck_assert_uint_eq(gpu_copy_engine_stats(f.e)->failures, 0);
                ck_assert_uint_eq(f.t->stats.bytes - bytes, 2ULL * N * PIECE);
                teardown(&f);
                ck_assert_int_eq(unsetenv(knobs[k]), 0);
        }
        /* With it, the same writes take the kernel. */
        Fixture f = {};
        setup(&f);
        run_and_check(&f);
        ck_assert_uint_gt(gpu_copy_engine_stats(f.e)->kernel_launches, 0);
        teardown(&f);
}
END_TEST

/* The completion thread's pace (pure): unknown until a part is seen; a part queued
 * behind the last one starts at its end; seen polling, a faster part raises the pace at
 * once and a slower one lowers it an eighth of the way; a part done at its first look
 * only raises a known pace (its time may be the thread's lateness); one that ended
 * before the thread woke from its timer raises it by half; one seen after the blocking
 * sync lowers it an eighth of the way towards what its last look says (or starts it
 * there); one too small or too short teaches nothing but its end; no pace above the cap. */
START_TEST(test_pace_predicts_and_learns) {
        const uint64_t B = 64ULL << 20;
        GpuCopyPace p = {};
        ck_assert_uint_eq(gpu_copy_pace_predict(&p, 1000, B), 0);
        gpu_copy_pace_observe(&p, 1000, B, 1100, GPU_COPY_SEEN_AT_ONCE, 0); /* unknown stays so */
        ck_assert(p.bytes_per_usec == 0);
        ck_assert_uint_eq(p.last_end_usec, 1100);
        p.last_end_usec = 0;
        gpu_copy_pace_observe(&p, 1000, B, 1100, GPU_COPY_SEEN_POLLING, 0); /* 64 MiB in 100 µs */
        ck_assert(p.bytes_per_usec == (double)B / 100);
        ck_assert_uint_eq(p.last_end_usec, 1100);
        ck_assert_uint_eq(gpu_copy_pace_predict(&p, 1050, B), 1200);     /* behind the last */
        ck_assert_uint_eq(gpu_copy_pace_predict(&p, 2000, B / 2), 2050); /* from its queueing */
        double r = p.bytes_per_usec;
        gpu_copy_pace_observe(&p, 2000, B, 2200, GPU_COPY_SEEN_POLLING, 0); /* half as fast */
        ck_assert(fabs(p.bytes_per_usec - (r + (r / 2 - r) / 8)) < 1e-6);
        gpu_copy_pace_observe(&p, 3000, B, 3050, GPU_COPY_SEEN_POLLING, 0); /* twice as fast */
        ck_assert(p.bytes_per_usec == (double)B / 50);
        r = p.bytes_per_usec;
        gpu_copy_pace_observe(&p, 3100, B, 9000, GPU_COPY_SEEN_AT_ONCE, 0); /* at once, slow: kept */
        ck_assert(p.bytes_per_usec == r);
        gpu_copy_pace_observe(&p, 9000, B, 9025, GPU_COPY_SEEN_AT_ONCE, 0); /* at once, faster: raised */
        ck_assert(p.bytes_per_usec == (double)B / 25);
        r = p.bytes_per_usec;
        gpu_copy_pace_observe(&p, 10000, B, 19000, GPU_COPY_SEEN_OVERSLEPT, 18000); /* overslept */
        ck_assert(p.bytes_per_usec == r * 1.5);
        ck_assert_uint_eq(p.last_end_usec, 19000);
        r = p.bytes_per_usec;
        gpu_copy_pace_observe(&p, 20000, B, 90000, GPU_COPY_SEEN_LATE, 0); /* late, no look: the end only */
        ck_assert(p.bytes_per_usec == r);
        ck_assert_uint_eq(p.last_end_usec, 90000);
        gpu_copy_pace_observe(&p, 100000, 4096, 100500, GPU_COPY_SEEN_POLLING, 0); /* too small */
        gpu_copy_pace_observe(&p, 200000, B, 200010, GPU_COPY_SEEN_POLLING, 0);    /* too short */
        ck_assert(p.bytes_per_usec == r);
        ck_assert_uint_eq(p.last_end_usec, 200010);
        /* Late, still running 40 ms after it started: an eighth of the way down. */
        gpu_copy_pace_observe(&p, 300000, B, 400000, GPU_COPY_SEEN_LATE, 340000);
        ck_assert(fabs(p.bytes_per_usec - (r + ((double)B / 40000 - r) / 8)) < 1e-6);
        ck_assert_uint_eq(p.last_end_usec, 400000);
        GpuCopyPace q = {};
        gpu_copy_pace_observe(&q, 0, 1ULL << 40, 25, GPU_COPY_SEEN_POLLING, 0);
        ck_assert(q.bytes_per_usec == GPU_COPY_PACE_MAX);
        GpuCopyPace u = {};
        gpu_copy_pace_observe(&u, 0, B, 90000, GPU_COPY_SEEN_LATE, 20000); /* unknown: starts at the bound */
        ck_assert(u.bytes_per_usec == (double)B / 20000);
}
END_TEST

/* One 1 MiB copy through the engine, its event done 10 ms after it was recorded and
 * the blocking sync's wake-up 30 ms after that (FAKE_CUDA_EVENT_MS, _SYNC_LAG_MS): how
 * long from its submission until the completion fd said so, in µs. */
static uint64_t one_paced_copy(Fixture *f) {
        GpuCopySeg seg = { .src = f->a->gpu, .dst = f->b->gpu, .src_offset = 0, .dst_offset = 1 << 20,
                           .length = 1 << 20 };
        struct pollfd pfd = { .fd = gpu_copy_engine_fd(f->e), .events = POLLIN };
        GpuCopyDone d;
        uint64_t t0 = now_usec(CLOCK_MONOTONIC);
        ck_assert_int_eq(gpu_copy_submit(f->e, &seg, 1, 77), 0);
        while (gpu_copy_reap(f->e, &d, 1) == 0)
                ck_assert_int_eq(poll(&pfd, 1, 5000), 1);
        ck_assert_int_eq(d.error, 0);
        ck_assert_uint_eq(d.cookie, 77);
        return now_usec(CLOCK_MONOTONIC) - t0;
}

/* The completion thread is awake when a part ends instead of waiting for a late
 * interrupt: the first part, before any pace, is found by polling and naps within a
 * few ms of its end; from then on the thread sleeps on its timer until shortly before
 * the predicted end (the pace learned: 1 MiB in about 10 ms); each part is seen within
 * a few ms of its end. With CompletionSpin=0 every part waits for the blocking sync,
 * which comes 30 ms late. Then parts twice as long: seen by the naps. */
START_TEST(test_completion_awake_before_a_late_interrupt) {
        Fixture f = {};
        setup(&f);
        ck_assert_int_eq(setenv("FAKE_CUDA_EVENT_MS", "10", 1), 0);
        ck_assert_int_eq(setenv("FAKE_CUDA_SYNC_LAG_MS", "30", 1), 0);
        for (int i = 0; i < 4; i++) {
                uint64_t t = one_paced_copy(&f);
                ck_assert_uint_ge(t, 10000);
                ck_assert_uint_lt(t, 35000); /* the late sync: 40 ms (slack for a loaded CI) */
                GpuCopyPace p;
                ck_assert_int_eq(gpu_copy_engine_pace(f.e, 0, GPU_COPY_SAME_GPU, &p), 0);
                /* About 1 MiB in 10 ms, leaning fast (a part that ended before the
                 * thread woke raises it by half). */
                ck_assert(p.bytes_per_usec > (1 << 20) / 15000.0 && p.bytes_per_usec < (1 << 20) / 3000.0);
        }
        gpu_copy_engine_set_spin(f.e, 0);
        ck_assert_uint_ge(one_paced_copy(&f), 40000);

        /* Parts of 20 ms, past the polling window and within the naps (they end 20 ms
         * after the window): seen on time from the start, the pace falling towards
         * them an eighth at a time. */
        gpu_copy_engine_set_spin(f.e, GPU_COPY_SPIN_USEC);
        ck_assert_int_eq(setenv("FAKE_CUDA_EVENT_MS", "20", 1), 0);
        GpuCopyPace before, after;
        ck_assert_int_eq(gpu_copy_engine_pace(f.e, 0, GPU_COPY_SAME_GPU, &before), 0);
        for (int i = 0; i < 3; i++) {
                uint64_t t = one_paced_copy(&f);
                ck_assert_uint_ge(t, 20000);
                ck_assert_uint_lt(t, 40000); /* the late sync: 50 ms */
        }
        ck_assert_int_eq(gpu_copy_engine_pace(f.e, 0, GPU_COPY_SAME_GPU, &after), 0);
        ck_assert(after.bytes_per_usec < before.bytes_per_usec);
        ck_assert(after.bytes_per_usec > (1 << 20) / 20000.0);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_EVENT_MS"), 0);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_SYNC_LAG_MS"), 0);
        teardown(&f);
}
END_TEST

/* Pieces evenly spaced on both sides (a layer group's piece of each page of a run of
 * pages) go as one 2D copy per run on the copy engines, not through the kernel: each
 * part of the batch one cuMemcpy2DAsync, a break in the spacing a second one; the bytes
 * exact, every write completed once. With StridedCopies off, with rows under 64 KiB and
 * out of order they go to the kernel as before; a driver that refuses 2D copies turns
 * them off and the batch goes through the kernel, exact. */
START_TEST(test_evenly_spaced_pieces_go_as_2d_copies) {
        enum { M = 600 };
        const uint64_t LEN = 64 * 1024, SP = 96 * 1024, DP = 128 * 1024;
        Fixture f = {};
        setup(&f);
        Arena *x = fake_arena(f.g, 3, 80 << 20), *y = fake_arena(f.g, 4, 80 << 20);
        uint8_t *src = (uint8_t *)(uintptr_t)x->gpu->base, *dst = (uint8_t *)(uintptr_t)y->gpu->base;
        TransportWrite *w = calloc(M, sizeof *w);
        uint64_t *seen = calloc(M, sizeof *seen);
        ck_assert_ptr_nonnull(w);
        ck_assert_ptr_nonnull(seen);
        for (uint64_t i = 0; i < (80 << 20); i++)
                src[i] = (uint8_t)(i * 7 + 3);
        const GpuCopyStats *st = gpu_copy_engine_stats(f.e);
        /* Off by default (slower than the kernel on an H100): epdd's StridedCopies=yes. */
        for (uint64_t i = 0; i < M; i++)
                w[i] = (TransportWrite) { .src_region = 3, .src_offset = i * SP, .dst_region = 4,
                                          .dst_offset = i * DP, .length = LEN, .cookie = i };
        ck_assert_int_eq(run_writes(f.t, w, M, seen), 0);
        ck_assert_uint_eq(st->strided_copies, 0);
        ck_assert_uint_eq(st->kernel_launches, 2);
        for (int pass = 0; pass < 5; pass++) {
                uint64_t len = pass == 3 ? 32 * 1024 : LEN;
                for (uint64_t i = 0; i < M; i++)
                        w[i] = (TransportWrite) { .src_region = 3, .src_offset = i * SP, .dst_region = 4,
                                                  .dst_offset = i * DP, .length = len, .cookie = i };
                if (pass == 1)
                        /* From write 300 on, the destination a piece further on: two runs
                         * in the second part (writes 256..599). */
                        for (int i = 300; i < M; i++)
                                w[i].dst_offset = (uint64_t)(i + 1) * DP;
                gpu_copy_engine_set_strided(f.e, pass != 2);
                if (pass == 4)
                        ck_assert_int_eq(setenv("FAKE_CUDA_NO_2D", "1", 1), 0);
                uint64_t copies = st->strided_copies, rows = st->strided_rows, launches = st->kernel_launches;
                memset(dst, 0, 80 << 20);
                ck_assert_int_eq(run_writes(f.t, w, M, seen), 0);
                for (int i = 0; i < M; i++)
                        ck_assert_int_eq(memcmp(dst + w[i].dst_offset, src + w[i].src_offset, len), 0);
                /* Parts of 256 and 344 writes. */
                if (pass < 2) {
                        ck_assert_uint_eq(st->strided_copies - copies, pass == 0 ? 2 : 3);
                        ck_assert_uint_eq(st->strided_rows - rows, M);
                        ck_assert_uint_eq(st->kernel_launches - launches, 0);
                } else {
                        ck_assert_uint_eq(st->strided_copies - copies, 0);
                        ck_assert_uint_eq(st->kernel_launches - launches, 2);
                }
        }
        ck_assert_int_eq(unsetenv("FAKE_CUDA_NO_2D"), 0);
        /* Refused once: off from then on. */
        uint64_t copies = st->strided_copies;
        for (uint64_t i = 0; i < M; i++)
                w[i] = (TransportWrite) { .src_region = 3, .src_offset = i * SP, .dst_region = 4,
                                          .dst_offset = i * DP, .length = LEN, .cookie = i };
        ck_assert_int_eq(run_writes(f.t, w, M, seen), 0);
        ck_assert_uint_eq(st->strided_copies, copies);
        free(w);
        free(seen);
        fake_arena_free(f.g, x);
        fake_arena_free(f.g, y);
        teardown(&f);

        /* The fixture's writes, reversed on the destination: no run; the kernel. */
        setup(&f);
        st = gpu_copy_engine_stats(f.e);
        run_and_check(&f);
        ck_assert_uint_eq(st->strided_copies, 0);
        ck_assert_uint_eq(st->kernel_launches, 6);
        teardown(&f);
}
END_TEST

/* The run finder alone: rows of one length, the same two sides, one pitch per side of at
 * least the length and at most the device's maximum, increasing; never within one arena. */
START_TEST(test_run_length) {
        GpuArena a = { .base = 1 << 20, .size = 64 << 20 }, b = { .base = 512 << 20, .size = 64 << 20 };
        GpuCopySeg s[8];
        uint64_t sp = 0, dp = 0;
        for (int i = 0; i < 8; i++)
                s[i] = (GpuCopySeg) { .src = &a, .dst = &b, .src_offset = (uint64_t)i * 4096,
                                      .dst_offset = (uint64_t)i * 8192, .length = 1024 };
        ck_assert_uint_eq(gpu_copy_run_length(s, NULL, 0, 8, 1 << 30, &sp, &dp), 8);
        ck_assert_uint_eq(sp, 4096);
        ck_assert_uint_eq(dp, 8192);
        ck_assert_uint_eq(gpu_copy_run_length(s, NULL, 3, 8, 1 << 30, &sp, &dp), 5);
        ck_assert_uint_eq(gpu_copy_run_length(s, NULL, 0, 8, 4096, &sp, &dp), 1);      /* pitch over the max */
        size_t idx[8] = { 0, 1, 2, 3, 7, 6, 5, 4 };
        ck_assert_uint_eq(gpu_copy_run_length(s, idx, 0, 8, 1 << 30, &sp, &dp), 4);     /* then backwards */
        s[5].length = 512;
        ck_assert_uint_eq(gpu_copy_run_length(s, NULL, 0, 8, 1 << 30, &sp, &dp), 5);    /* another length */
        s[5].length = 1024;
        s[2].dst_offset = s[1].dst_offset + 512;                                         /* rows would overlap */
        ck_assert_uint_eq(gpu_copy_run_length(s, NULL, 1, 8, 1 << 30, &sp, &dp), 1);
        s[2].dst_offset = 2 * 8192;
        s[4].dst = &a;                                                                   /* another arena */
        ck_assert_uint_eq(gpu_copy_run_length(s, NULL, 0, 8, 1 << 30, &sp, &dp), 4);
        for (int i = 0; i < 8; i++)
                s[i].dst = &a;                                                           /* one arena */
        ck_assert_uint_eq(gpu_copy_run_length(s, NULL, 0, 8, 1 << 30, &sp, &dp), 1);
}
END_TEST

static Suite *suite(void) {
        Suite *s = suite_create("gpu-kernels-fake");
        TCase *tc = tcase_create("core");

        tcase_add_test(tc, test_small_writes_go_to_the_kernel_in_parts);
        tcase_add_test(tc, test_many_batches_in_flight);
        tcase_add_test(tc, test_failed_kernels_give_their_slots_back);
        tcase_add_test(tc, test_few_writes_stay_on_the_copy_engine);
        tcase_add_test(tc, test_interleaved_cookies_complete_once_each);
        tcase_add_test(tc, test_unregister_waits_only_for_its_own_copies);
        tcase_add_test(tc, test_unregister_waits_for_wide_batches);
        tcase_add_test(tc, test_timeline_has_a_line_per_part);
        tcase_add_test(tc, test_pace_predicts_and_learns);
        tcase_add_test(tc, test_completion_awake_before_a_late_interrupt);
        tcase_add_test(tc, test_evenly_spaced_pieces_go_as_2d_copies);
        tcase_add_test(tc, test_run_length);
        tcase_add_test(tc, test_lane_without_descriptor_memory);
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        return check_run(suite(), CK_FORK_GETENV);
}
