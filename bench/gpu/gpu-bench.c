/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* GPU domain benchmarks, each against a limit measured in the same run:
 *
 *   d2d      GPU arena → GPU arena through the CUDA transport (one contiguous write; 2 MiB
 *            and 256 KiB pages scattered: copy engine one call per page, copy engine
 *            through cuMemcpyBatchAsync, and the batched copy kernel) vs one raw
 *            cuMemcpyDtoDAsync of the same size
 *   d2h/h2d  GPU arena ↔ host arena (memfd, pinned by the transport) vs raw
 *            cuMemcpyDtoHAsync/HtoDAsync with a cuMemAllocHost buffer
 *   pack     pack and unpack kernels (1 MiB and 64 KiB groups) vs raw cuMemcpyDtoDAsync
 *            of the same bytes
 *   vmm      cuMemCreate + export + map, and import + map of the fd, per arena size
 *
 *   small    a 64 KiB copy through the transport, the completion thread polling its
 *            event before it sleeps or sleeping at once, vs a raw copy + synchronize
 *
 * Times are host wall clock from submission to observed completion (the transport's
 * completion fd; for the raw copies, cuStreamSynchronize), median of several runs after
 * a warm-up. Bandwidth counts bytes copied once. */
#include <inttypes.h>
#include <sys/mman.h>
#include <unistd.h>

#include "copy.h"
#include "gpu/gpu-domain.h"
#include "gpu-test-util.h"
#include "pack.h"
#include "transport/cuda.h"

#define MiB (1ULL << 20)
#define GiB (1ULL << 30)
#define REPS 7

typedef struct Row {
        char name[64];
        uint64_t bytes;
        double ms;
        double limit_ms;
        double goal;
} Row;

static Row rows[48];
static size_t n_rows;
/* The median time post() took in the last time_transport() (the host's part before the
 * GPU has the whole batch) and the median drain (from the wake-up that found the batch
 * done to its last completion: the host's part after the GPU), printed with its row. */
static double last_post_ms = -1, last_drain_ms = -1;

static void row(const char *name, uint64_t bytes, double ms, double limit_ms, double goal) {
        Row *r = &rows[n_rows++];
        snprintf(r->name, sizeof r->name, "%s", name);
        r->bytes = bytes;
        r->ms = ms;
        r->limit_ms = limit_ms;
        r->goal = goal;
        printf("RESULT %s bytes=%" PRIu64 " ms=%.3f limit_ms=%.3f ratio=%.3f", name, bytes, ms,
               limit_ms, limit_ms > 0 ? limit_ms / ms : 0);
        if (last_post_ms >= 0)
                printf(" post_ms=%.3f", last_post_ms);
        if (last_drain_ms >= 0)
                printf(" drain_ms=%.3f", last_drain_ms);
        printf("\n");
        last_post_ms = last_drain_ms = -1;
}

typedef struct Bench {
        GpuContext *ctx;
        GpuSystem *s;
        CudaDriver *d;
        Transport *t;
        CUstream stream;
        uint8_t *host;
        uint64_t host_size;
        TransportRegion host_region;
        void *pinned; /* raw baseline buffer */
} Bench;

#define HOST_ID 1000

static Arena *arena_on(Bench *b, uint32_t index, uint64_t size, int gpu) {
        ArenaConfig c = { .name = (char *)"bench", .domain = MEMORY_GPU, .size = size, .gpu = gpu };
        Arena *a;
        CHECK(gpu_context_arena_new(b->ctx, &c, index, &a));
        return a;
}

static Arena *arena(Bench *b, uint32_t index, uint64_t size) {
        return arena_on(b, index, size, 0);
}

static void drop(Bench *b, Arena *a) {
        gpu_context_arena_forget(b->ctx, a);
        gpu_arena_unref(a->gpu);
        close(a->fd);
        free(a->name);
        free(a);
}

static double time_transport_reps(Bench *b, const TransportWrite *w, size_t n, int reps) {
        double v[201], post[201], drain[201];
        REQUIRE(reps <= 201, "too many repetitions");
        CHECK(transport_run(b->t, w, n, NULL)); /* warm-up */
        for (int i = 0; i < reps; i++) {
                double t0 = now_sec();
                CHECK(transport_run_timed(b->t, w, n, &post[i], &drain[i]));
                v[i] = (now_sec() - t0) * 1e3;
                post[i] = (post[i] - t0) * 1e3;
                drain[i] *= 1e3;
        }
        last_post_ms = median(post, reps);
        last_drain_ms = median(drain, reps);
        return median(v, reps);
}

static double time_transport(Bench *b, const TransportWrite *w, size_t n) {
        return time_transport_reps(b, w, n, REPS);
}

typedef enum { RAW_D2D, RAW_D2H, RAW_H2D } RawKind;

static double time_raw(Bench *b, RawKind k, CUdeviceptr dst, CUdeviceptr src, void *host, uint64_t len) {
        double v[REPS + 1];
        for (int i = 0; i <= REPS; i++) {
                double t0 = now_sec();
                switch (k) {
                case RAW_D2D:
                        CHECK(CU(b->d, cuMemcpyDtoDAsync, dst, src, len, b->stream));
                        break;
                case RAW_D2H:
                        CHECK(CU(b->d, cuMemcpyDtoHAsync, host, src, len, b->stream));
                        break;
                case RAW_H2D:
                        CHECK(CU(b->d, cuMemcpyHtoDAsync, dst, host, len, b->stream));
                        break;
                }
                CHECK(CU(b->d, cuStreamSynchronize, b->stream));
                v[i] = (now_sec() - t0) * 1e3;
        }
        return median(v + 1, REPS); /* first is the warm-up */
}

/* The batched copy kernel on its own, on the same writes as a transport row: the
 * descriptors built beforehand in pinned memory, then uploaded and launched either in
 * one launch or in the transport's parts (POST_PART_FIRST writes, doubling up to
 * POST_PART), one synchronize at the end; host wall clock, median of REPS. Between this
 * and the transport row lies what the transport adds: validating and preparing the
 * writes, its completion thread, and expanding the batch into per-write completions. */
static double time_kernel_alone(Bench *b, GpuKernels *k, const TransportWrite *w, size_t n, const Arena *x,
                                const Arena *y, bool parts) {
        GpuChunk *host = NULL;
        CUdeviceptr dev = 0;
        double v[REPS + 1];

        CHECK(CU(b->d, cuMemAllocHost, (void **)&host, n * sizeof *host));
        CHECK(CU(b->d, cuMemAlloc, &dev, n * sizeof *host));
        for (size_t i = 0; i < n; i++)
                host[i] = (GpuChunk) { .src = x->gpu->base + w[i].src_offset, .dst = y->gpu->base + w[i].dst_offset,
                                       .len = w[i].length };
        for (int i = 0; i <= REPS; i++) {
                double t0 = now_sec();
                size_t part = parts ? 256 : n;
                for (size_t at = 0; at < n; at += part, part = MIN(2 * part, (size_t)4096)) {
                        size_t m = MIN(part, n - at);
                        CHECK(gpu_kernels_copy_chunks(k, b->stream, host + at, dev + at * sizeof *host, m));
                        if (!parts)
                                break;
                }
                CHECK(CU(b->d, cuStreamSynchronize, b->stream));
                v[i] = (now_sec() - t0) * 1e3;
        }
        (void)CU(b->d, cuMemFree, dev);
        (void)CU(b->d, cuMemFreeHost, host);
        return median(v + 1, REPS);
}

static void bench_d2d(Bench *b) {
        const uint64_t S = 4 * GiB;
        Arena *x = arena(b, 1, S), *y = arena(b, 2, S);
        GpuCopyEngine *eng = cuda_transport_engine(b->t);
        TransportWrite *w = calloc(S / (256 * 1024), sizeof *w);
        REQUIRE(w, "oom");
        CHECK(gpu_device_make_current(b->s, &b->s->devices[0]));
        double raw = time_raw(b, RAW_D2D, y->gpu->base, x->gpu->base, NULL, S);

        w[0] = (TransportWrite) { .src_region = x->index, .dst_region = y->index, .length = S };
        row("d2d contiguous (copy engine)", S, time_transport(b, w, 1), raw, 0.9);
        /* A small copy is all completion: submission to the transport's fd, median of 201,
         * the completion thread polling its event for 50 µs first or sleeping at once (the
         * default), against a raw copy and cuStreamSynchronize. */
        {
                const uint64_t small = 64 * 1024;
                double v[202];
                for (int i = 0; i < 202; i++) {
                        double t0 = now_sec();
                        CHECK(CU(b->d, cuMemcpyDtoDAsync, y->gpu->base, x->gpu->base, small, b->stream));
                        CHECK(CU(b->d, cuStreamSynchronize, b->stream));
                        v[i] = (now_sec() - t0) * 1e3;
                }
                double raw_small = median(v + 1, 201);
                w[0].length = small;
                gpu_copy_engine_set_spin(eng, 50);
                row("d2d 64K, completion (poll, then sleep)", small, time_transport_reps(b, w, 1, 201), raw_small, 0);
                gpu_copy_engine_set_spin(eng, 0);
                row("d2d 64K, completion (sleep at once)", small, time_transport_reps(b, w, 1, 201), raw_small, 0);
                gpu_copy_engine_set_spin(eng, GPU_COPY_SPIN_USEC);
                w[0].length = S;
        }
        /* Adjacent pages, one write each: the transport coalesces them into one copy. */
        for (uint64_t i = 0; i < S / (2 * MiB); i++)
                w[i] = (TransportWrite) { .src_region = x->index, .src_offset = i * 2 * MiB, .dst_region = y->index,
                                          .dst_offset = i * 2 * MiB, .length = 2 * MiB, .cookie = i };
        row("d2d 2048K pages in a run (coalesced)", S, time_transport(b, w, S / (2 * MiB)), raw, 0.9);

        const uint64_t pages[] = { 2 * MiB, 256 * 1024 };
        GpuKernels *kernels = NULL;
        if (gpu_kernels_load(b->s, 0, &kernels) < 0)
                kernels = NULL; /* built without nvcc: the rows that need it are left out */
        for (size_t p = 0; p < ELEMENTSOF(pages); p++) {
                uint64_t n = S / pages[p];
                for (uint64_t i = 0; i < n; i++) {
                        /* Scattered: page i goes to page (i * 7919) mod n, no coalescing. */
                        w[i] = (TransportWrite) { .src_region = x->index, .src_offset = i * pages[p],
                                                  .dst_region = y->index,
                                                  .dst_offset = ((i * 7919) % n) * pages[p],
                                                  .length = pages[p], .cookie = i };
                }
                char name[64];
                gpu_copy_engine_set_kernel_batching(eng, false, 0);
                gpu_copy_engine_set_batch_api(eng, false);
                snprintf(name, sizeof name, "d2d %" PRIu64 "K pages (CE, per call)", pages[p] >> 10);
                row(name, S, time_transport(b, w, n), raw, 0.9);
                gpu_copy_engine_set_d2d_streams(eng, 4);
                snprintf(name, sizeof name, "d2d %" PRIu64 "K pages (CE, 4 streams)", pages[p] >> 10);
                row(name, S, time_transport(b, w, n), raw, 0.9);
                gpu_copy_engine_set_d2d_streams(eng, 1);
                gpu_copy_engine_set_batch_api(eng, true);
                snprintf(name, sizeof name, "d2d %" PRIu64 "K pages (CE, batch API)", pages[p] >> 10);
                row(name, S, time_transport(b, w, n), raw, 0.9);
                gpu_copy_engine_set_kernel_batching(eng, true, 16);
                snprintf(name, sizeof name, "d2d %" PRIu64 "K pages (kernel batch)", pages[p] >> 10);
                row(name, S, time_transport(b, w, n), raw, 0.9);
                /* The transport's parts: fewer and larger, or the whole batch at once. */
                cuda_transport_set_parts(b->t, 1024, 16384);
                snprintf(name, sizeof name, "d2d %" PRIu64 "K pages (kernel, parts 1K-16K)", pages[p] >> 10);
                row(name, S, time_transport(b, w, n), raw, 0.9);
                cuda_transport_set_parts(b->t, n, n);
                snprintf(name, sizeof name, "d2d %" PRIu64 "K pages (kernel, one part)", pages[p] >> 10);
                row(name, S, time_transport(b, w, n), raw, 0.9);
                cuda_transport_set_parts(b->t, 256, 4096);
                if (kernels) {
                        snprintf(name, sizeof name, "d2d %" PRIu64 "K pages, kernel, 1 launch", pages[p] >> 10);
                        row(name, S, time_kernel_alone(b, kernels, w, n, x, y, false), raw, 0.9);
                        snprintf(name, sizeof name, "d2d %" PRIu64 "K pages, kernel, parts", pages[p] >> 10);
                        row(name, S, time_kernel_alone(b, kernels, w, n, x, y, true), raw, 0.9);
                }
                gpu_copy_engine_set_kernel_uniform(eng, true);
                snprintf(name, sizeof name, "d2d %" PRIu64 "K pages (kernel, uniform)", pages[p] >> 10);
                row(name, S, time_transport(b, w, n), raw, 0.9);
                gpu_copy_engine_set_kernel_uniform(eng, false);
                gpu_copy_engine_set_kernel_batching(eng, false, 0);
        }
        gpu_kernels_free(kernels);

        /* Sub-page layer groups: group g is the 256 KiB piece g of every 2 MiB page, the
         * pages in order on both sides (a sequence's pages, allocated together), the 8
         * groups one after another: runs that one 2D copy each moves (StridedCopies=yes),
         * or the batched kernel (the default), against the raw contiguous copy; and a raw
         * cuMemcpy2DAsync per group, the 2D copy alone. */
        {
                const uint64_t piece = 256 * 1024, pages_n = S / (2 * MiB);
                uint64_t n = 0;
                for (uint64_t g = 0; g < 8; g++)
                        for (uint64_t i = 0; i < pages_n; i++, n++)
                                w[n] = (TransportWrite) { .src_region = x->index, .src_offset = i * 2 * MiB + g * piece,
                                                          .dst_region = y->index, .dst_offset = i * 2 * MiB + g * piece,
                                                          .length = piece, .cookie = n };
                gpu_copy_engine_set_kernel_batching(eng, true, 16);
                gpu_copy_engine_set_strided(eng, true);
                row("d2d 8 groups of 256K pieces of 2M pages (2D copies)", S, time_transport(b, w, n), raw, 0.9);
                gpu_copy_engine_set_strided(eng, false);
                row("d2d 8 groups of 256K pieces of 2M pages (kernel)", S, time_transport(b, w, n), raw, 0.9);
                gpu_copy_engine_set_kernel_batching(eng, false, 0);
                double v[REPS + 1];
                for (int rep = 0; rep <= REPS; rep++) {
                        double t0 = now_sec();
                        for (uint64_t g = 0; g < 8; g++) {
                                CUDA_MEMCPY2D c = { .srcMemoryType = CU_MEMORYTYPE_DEVICE,
                                                    .srcDevice = x->gpu->base + g * piece, .srcPitch = 2 * MiB,
                                                    .dstMemoryType = CU_MEMORYTYPE_DEVICE,
                                                    .dstDevice = y->gpu->base + g * piece, .dstPitch = 2 * MiB,
                                                    .WidthInBytes = piece, .Height = pages_n };
                                CHECK(CU(b->d, cuMemcpy2DAsync, &c, b->stream));
                        }
                        CHECK(CU(b->d, cuStreamSynchronize, b->stream));
                        v[rep] = (now_sec() - t0) * 1e3;
                }
                last_post_ms = last_drain_ms = -1;
                row("d2d 8 groups of 256K pieces, raw cuMemcpy2DAsync", S, median(v + 1, REPS), raw, 0.9);
        }
        free(w);
        drop(b, x);
        drop(b, y);
}

/* GPU 0 → GPU 1 (where there are two): one contiguous write through the transport
 * (peer access where the pair has it, else cuMemcpyPeerAsync) vs a raw
 * cuMemcpyPeerAsync of the same size. */
static void bench_peer(Bench *b) {
        const uint64_t S = 4 * GiB;
        double v[REPS + 1];

        if (b->s->n_devices < 2) {
                printf("peer: one GPU, GPU 0 -> GPU 1 not measured\n");
                return;
        }
        Arena *x = arena_on(b, 6, S, 0), *y = arena_on(b, 7, S, 1);
        CHECK(gpu_device_make_current(b->s, &b->s->devices[0]));
        for (int i = 0; i <= REPS; i++) {
                double t0 = now_sec();
                CHECK(CU(b->d, cuMemcpyPeerAsync, y->gpu->base, b->s->devices[1].ctx, x->gpu->base,
                         b->s->devices[0].ctx, S, b->stream));
                CHECK(CU(b->d, cuStreamSynchronize, b->stream));
                v[i] = (now_sec() - t0) * 1e3;
        }
        TransportWrite w = { .src_region = x->index, .dst_region = y->index, .length = S };
        row(gpu_system_can_access_peer(b->s, 1, 0) ? "peer gpu0->gpu1 contiguous (P2P)" : "peer gpu0->gpu1 contiguous (staged)",
            S, time_transport(b, &w, 1), median(v + 1, REPS), 0.9);
        drop(b, x);
        drop(b, y);
}

static void bench_host(Bench *b) {
        const uint64_t S = b->host_size;
        Arena *x = arena(b, 3, S);
        TransportWrite w[512];
        double raw;

        CHECK(gpu_device_make_current(b->s, &b->s->devices[0]));
        raw = time_raw(b, RAW_D2H, 0, x->gpu->base, b->pinned, S);
        w[0] = (TransportWrite) { .src_region = x->index, .dst_region = HOST_ID, .length = S };
        row("d2h contiguous (pinned arena)", S, time_transport(b, w, 1), raw, 0.9);
        for (uint64_t i = 0; i < 512; i++)
                w[i] = (TransportWrite) { .src_region = x->index, .src_offset = i * 2 * MiB,
                                          .dst_region = HOST_ID, .dst_offset = ((i * 7919) % 512) * 2 * MiB,
                                          .length = 2 * MiB, .cookie = i };
        row("d2h 2M pages", S, time_transport(b, w, 512), raw, 0.9);

        raw = time_raw(b, RAW_H2D, x->gpu->base, 0, b->pinned, S);
        w[0] = (TransportWrite) { .src_region = HOST_ID, .dst_region = x->index, .length = S };
        row("h2d contiguous (pinned arena)", S, time_transport(b, w, 1), raw, 0.9);
        for (uint64_t i = 0; i < 512; i++)
                w[i] = (TransportWrite) { .src_region = HOST_ID, .src_offset = i * 2 * MiB,
                                          .dst_region = x->index, .dst_offset = ((i * 7919) % 512) * 2 * MiB,
                                          .length = 2 * MiB, .cookie = i };
        row("h2d 2M pages", S, time_transport(b, w, 512), raw, 0.9);
        drop(b, x);
}

static void bench_pack(Bench *b) {
        GpuKernels *k = NULL;
        int r = gpu_kernels_load(b->s, 0, &k);
        if (r == -EOPNOTSUPP) {
                printf("pack: built without nvcc, skipped\n");
                return;
        }
        CHECK(r);
        const uint64_t S = 4 * GiB, staging = 1 * GiB;
        Arena *pages = arena(b, 4, S), *st = arena(b, 5, staging);
        GpuChunk *desc_host;
        CUdeviceptr desc_dev;
        const struct {
                uint64_t page, group_off, group;
        } cases[] = { { 4 * MiB, 1 * MiB, 1 * MiB }, { 256 * 1024, 64 * 1024, 64 * 1024 } };

        CHECK(gpu_device_make_current(b->s, &b->s->devices[0]));
        CHECK(CU(b->d, cuMemAllocHost, (void **)&desc_host, GPU_CHUNKS_MAX * sizeof(GpuChunk)));
        CHECK(CU(b->d, cuMemAlloc, &desc_dev, GPU_CHUNKS_MAX * sizeof(GpuChunk)));
        double raw = time_raw(b, RAW_D2D, st->gpu->base, pages->gpu->base, NULL, staging);

        for (size_t c = 0; c < ELEMENTSOF(cases); c++) {
                size_t n = staging / cases[c].group;
                uint64_t *offs = malloc(n * sizeof *offs);
                REQUIRE(offs && n <= GPU_CHUNKS_MAX, "setup");
                for (size_t i = 0; i < n; i++)
                        offs[i] = ((i * 7919) % (S / cases[c].page)) * cases[c].page;
                for (int dir = 0; dir < 2; dir++) {
                        double v[REPS + 1];
                        CHECK(gpu_pack_plan(pages->gpu->base, offs, n, cases[c].group_off,
                                            cases[c].group, st->gpu->base, desc_host));
                        if (dir)
                                gpu_chunks_reverse(desc_host, n);
                        for (int i = 0; i <= REPS; i++) {
                                double t0 = now_sec();
                                CHECK(gpu_kernels_copy_chunks(k, b->stream, desc_host, desc_dev, n));
                                CHECK(CU(b->d, cuStreamSynchronize, b->stream));
                                v[i] = (now_sec() - t0) * 1e3;
                        }
                        char name[48];
                        snprintf(name, sizeof name, "%s %" PRIu64 "K groups x%zu", dir ? "unpack" : "pack",
                                 cases[c].group >> 10, n);
                        row(name, staging, median(v + 1, REPS), raw, 0.8);
                }
                free(offs);
        }
        (void)CU(b->d, cuMemFree, desc_dev);
        (void)CU(b->d, cuMemFreeHost, desc_host);
        drop(b, pages);
        drop(b, st);
        gpu_kernels_free(k);
}

static void bench_vmm(Bench *b) {
        const uint64_t sizes[] = { 1 * GiB, 16 * GiB };

        for (size_t i = 0; i < ELEMENTSOF(sizes); i++) {
                double create[5], import[5];
                for (int rep = 0; rep < 5; rep++) {
                        GpuArena *a = NULL, *m = NULL;
                        double t0 = now_sec();
                        CHECK(gpu_arena_new(b->s, 0, sizes[i], &a));
                        create[rep] = (now_sec() - t0) * 1e3;
                        t0 = now_sec();
                        int r = gpu_arena_import(b->s, 0, a->fd, sizes[i], &m);
                        import[rep] = (now_sec() - t0) * 1e3;
                        if (r < 0) {
                                /* Reported, not fatal: the rest of the table still counts. */
                                printf("vmm: import of own fd failed: %s\n", strerror(-r));
                                import[rep] = -1;
                        }
                        gpu_arena_unref(m);
                        gpu_arena_unref(a);
                }
                char name[48];
                snprintf(name, sizeof name, "vmm create+export+map %" PRIu64 "G", sizes[i] >> 30);
                row(name, sizes[i], median(create, 5), 0, 0);
                snprintf(name, sizeof name, "vmm import+map %" PRIu64 "G", sizes[i] >> 30);
                row(name, sizes[i], median(import, 5), 0, 0);
        }
}

int main(void) {
        Bench b = {};
        int r, memfd;

        r = gpu_context_new(NULL, &b.ctx);
        if (r == -ENOENT || r == -ENODEV || r == -EOPNOTSUPP) {
                printf("SKIP: %s\n", cuda_absence_to_string(r));
                return 77;
        }
        CHECK(r);
        b.s = b.ctx->system;
        b.d = b.s->driver;
        b.t = b.ctx->transport;
        CHECK(gpu_device_make_current(b.s, &b.s->devices[0]));
        CHECK(CU(b.d, cuStreamCreate, &b.stream, CU_STREAM_NON_BLOCKING));

        b.host_size = 1 * GiB;
        memfd = memfd_create("epd-bench-host", MFD_CLOEXEC);
        CHECK(memfd < 0 ? -errno : 0);
        CHECK(ftruncate(memfd, (off_t)b.host_size) < 0 ? -errno : 0);
        b.host = mmap(NULL, b.host_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, memfd, 0);
        REQUIRE(b.host != MAP_FAILED, "mmap");
        fill_random(b.host, b.host_size, 1, 0);
        b.host_region = (TransportRegion) { .id = HOST_ID, .domain = MEMORY_HOST, .host_base = b.host,
                                            .size = b.host_size };
        CHECK(b.t->ops->register_region(b.t, &b.host_region));
        CHECK(CU(b.d, cuMemAllocHost, &b.pinned, b.host_size));
        memset(b.pinned, 1, b.host_size);

        bench_d2d(&b);
        bench_peer(&b);
        bench_host(&b);
        bench_pack(&b);
        bench_vmm(&b);

        b.t->ops->unregister_region(b.t, &b.host_region);
        (void)CU(b.d, cuMemFreeHost, b.pinned);
        (void)CU(b.d, cuStreamDestroy, b.stream);
        munmap(b.host, b.host_size);
        close(memfd);
        gpu_context_free(b.ctx);

        printf("\n| benchmark | bytes | ms | GB/s | limit GB/s | ratio | goal |\n");
        printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        for (size_t i = 0; i < n_rows; i++) {
                Row *x = &rows[i];
                if (x->limit_ms > 0)
                        printf("| %s | %" PRIu64 " | %.3f | %.1f | %.1f | %.3f | %.2f |\n", x->name, x->bytes,
                               x->ms, x->bytes / x->ms / 1e6, x->bytes / x->limit_ms / 1e6,
                               x->limit_ms / x->ms, x->goal);
                else
                        printf("| %s | %" PRIu64 " | %.3f | | | | |\n", x->name, x->bytes, x->ms);
        }
        return EXIT_SUCCESS;
}
