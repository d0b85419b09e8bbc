/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* GPU domain tests that need a real GPU (run by bench/gpu/run-device.sh on the device
 * machine; on a machine without a GPU they exit 77 and say why):
 *
 *   share     the daemon side creates a GPU arena (GpuContext, as epdd does) and passes
 *             its fd over a unix socket to two worker processes (fork+exec), which map
 *             it through libepd (epd_gpu_map); worker A writes, exits; worker B reads
 *             A's bytes, writes its own, exits; the daemon reads both back
 *   external  a worker allocates its own VMM memory, exports it (epd_gpu_export); the
 *             daemon imports it (gpu_context_register_external), copies into it through
 *             the CUDA transport, releases it; the worker's memory stays intact
 *   handoff   scattered pages of one GPU arena → another through the CUDA transport:
 *             exact bytes, one completion per write with its cookie
 *   cow       a cloned sequence writes 5 of 64 shared pages: exactly those are copied
 *             (through the transport) before the write; the originals are unchanged
 *   pack      pack/unpack kernels against a host reference on random data, aligned
 *             and unaligned layer groups
 *   kv-rows   the KV layer scatter/gather kernel against the host copy (kvcopy.h) */
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "copy.h"
#include "epd/epd-gpu.h"
#include "gpu/gpu-domain.h"
#include "gpu-test-util.h"
#include "kvcopy.h"
#include "pack.h"
#include "transport/cuda.h"

#define MiB (1ULL << 20)
#define GiB (1ULL << 30)

typedef struct ShareMsg {
        uint64_t size;
        uint64_t offset;
        uint64_t length;
        uint64_t seed;
        uint64_t check_offset; /* bytes to verify before writing (0 length: none) */
        uint64_t check_length;
        uint64_t check_seed;
        char pci_bus_id[32];
} ShareMsg;

typedef struct Reply {
        int status;
        double import_map_ms;
        uint64_t device_ptr;
} Reply;

/* ---- worker processes (exec'ed: a fresh process, as a real worker is) ---- */

static int worker_share(int sock) {
        EpdGpu *g = NULL;
        EpdGpuMapping *m = NULL;
        GpuSystem *s = NULL;
        ShareMsg msg;
        Reply reply = {};
        int fd, ordinal;
        void *buf;
        double t0;

        CHECK(recv_fd(sock, &fd, &msg, sizeof msg));
        REQUIRE(fd >= 0, "no fd received");
        CHECK(epd_gpu_open(&g));
        ordinal = epd_gpu_ordinal_from_pci_bus_id(g, msg.pci_bus_id);
        CHECK(ordinal);
        t0 = now_sec();
        CHECK(epd_gpu_map(g, fd, msg.size, ordinal, &m));
        reply.import_map_ms = (now_sec() - t0) * 1e3;
        reply.device_ptr = epd_gpu_mapping_device_pointer(m);
        close(fd); /* the mapping does not need the fd */

        /* Plain driver calls for the data, as the worker's engine would make. */
        CHECK(gpu_system_open(NULL, &s));
        CHECK(gpu_device_make_current(s, &s->devices[ordinal]));
        buf = malloc(MAX(msg.length, msg.check_length));
        REQUIRE(buf, "oom");
        if (msg.check_length > 0) {
                void *want = malloc(msg.check_length);
                REQUIRE(want, "oom");
                fill_random(want, msg.check_length, msg.check_seed, 0);
                CHECK(CU(s->driver, cuMemcpyDtoH, buf, reply.device_ptr + msg.check_offset,
                         msg.check_length));
                if (memcmp(buf, want, msg.check_length) != 0)
                        reply.status = -EBADMSG;
                free(want);
        }
        fill_random(buf, msg.length, msg.seed, 0);
        CHECK(CU(s->driver, cuMemcpyHtoD, reply.device_ptr + msg.offset, buf, msg.length));
        CHECK(CU(s->driver, cuCtxSynchronize));
        free(buf);
        gpu_system_unref(s);
        epd_gpu_unmap(m);
        epd_gpu_close(g);
        CHECK(send_fd(sock, -1, &reply, sizeof reply));
        /* Exits without more ceremony: the daemon's memory must not care. */
        return reply.status < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

static int worker_external(int sock) {
        GpuSystem *s = NULL;
        GpuArena *own = NULL;
        EpdGpu *g = NULL;
        ShareMsg msg;
        Reply reply = {};
        int fd, dummy;
        void *buf, *want;

        CHECK(recv_fd(sock, &dummy, &msg, sizeof msg));
        CHECK(epd_gpu_open(&g));
        CHECK(gpu_system_open(NULL, &s));
        int ordinal = epd_gpu_ordinal_from_pci_bus_id(g, msg.pci_bus_id);
        CHECK(ordinal);
        /* The engine's own allocation: cuMemCreate with a POSIX-fd handle type. */
        CHECK(gpu_arena_new(s, ordinal, msg.size, &own));
        CHECK(CU(s->driver, cuMemsetD8, own->base, 0xa5, own->size));
        CHECK(epd_gpu_export(g, own->base, &fd));
        reply.device_ptr = own->base;
        CHECK(send_fd(sock, fd, &reply, sizeof reply));
        close(fd);

        /* The daemon copied into it and released its import; the memory is still ours. */
        CHECK(recv_fd(sock, &dummy, &msg, sizeof msg));
        buf = malloc(msg.check_length);
        want = malloc(msg.check_length);
        REQUIRE(buf && want, "oom");
        fill_random(want, msg.check_length, msg.check_seed, 0);
        CHECK(gpu_device_make_current(s, &s->devices[ordinal]));
        CHECK(CU(s->driver, cuMemcpyDtoH, buf, own->base + msg.check_offset, msg.check_length));
        if (memcmp(buf, want, msg.check_length) != 0)
                reply.status = -EBADMSG;
        /* The rest is untouched (0xa5) and still writable by its owner. */
        CHECK(CU(s->driver, cuMemcpyDtoH, buf, own->base + msg.check_offset + msg.check_length, 4096));
        for (int i = 0; i < 4096; i++)
                if (((uint8_t *)buf)[i] != 0xa5)
                        reply.status = -EBADMSG;
        CHECK(CU(s->driver, cuMemsetD8, own->base, 0x5a, own->size));
        CHECK(CU(s->driver, cuCtxSynchronize));
        free(buf);
        free(want);
        gpu_arena_unref(own);
        gpu_system_unref(s);
        epd_gpu_close(g);
        CHECK(send_fd(sock, -1, &reply, sizeof reply));
        return reply.status < 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

static pid_t spawn_worker(const char *self, const char *mode, int *ret_sock) {
        int sv[2];
        pid_t pid;

        CHECK(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0 ? -errno : 0);
        pid = fork();
        CHECK(pid < 0 ? -errno : 0);
        if (pid == 0) {
                /* fd 3 without CLOEXEC survives the exec; everything else closes. */
                if (dup2(sv[1], 3) < 0)
                        _exit(127);
                execl(self, self, mode, (char *)NULL);
                _exit(127);
        }
        close(sv[1]);
        *ret_sock = sv[0];
        return pid;
}

static int wait_worker(pid_t pid) {
        int st;
        if (waitpid(pid, &st, 0) < 0)
                return -errno;
        return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -ECHILD;
}

/* ---- daemon side ---- */

typedef struct Env {
        GpuContext *ctx;
        Transport *t;
        GpuSystem *s;
        /* A host arena (memfd, like a host arena of epdd), pinned by the transport. */
        uint8_t *host;
        uint64_t host_size;
        TransportRegion host_region;
} Env;

#define HOST_REGION_ID 1000

static Arena *make_arena(Env *e, const char *name, uint32_t index, uint64_t size) {
        ArenaConfig c = { .name = (char *)name, .domain = MEMORY_GPU, .size = size, .gpu = 0 };
        Arena *a;
        CHECK(gpu_context_arena_new(e->ctx, &c, index, &a));
        return a;
}

static void drop_arena(Env *e, Arena *a) {
        /* What arena_free() does for a GPU arena. */
        gpu_context_arena_forget(e->ctx, a);
        gpu_arena_unref(a->gpu);
        close(a->fd);
        free(a->name);
        free(a);
}

/* Host ↔ arena through the transport (H2D / D2H). */
static void host_to_arena(Env *e, Arena *a, uint64_t dst_off, uint64_t host_off, uint64_t len) {
        TransportWrite w = { .src_region = HOST_REGION_ID, .src_offset = host_off,
                             .dst_region = a->index, .dst_offset = dst_off, .length = len, .cookie = 1 };
        CHECK(transport_run(e->t, &w, 1, NULL));
}

static void arena_to_host(Env *e, Arena *a, uint64_t src_off, uint64_t host_off, uint64_t len) {
        TransportWrite w = { .src_region = a->index, .src_offset = src_off,
                             .dst_region = HOST_REGION_ID, .dst_offset = host_off, .length = len, .cookie = 2 };
        CHECK(transport_run(e->t, &w, 1, NULL));
}

static void test_share(Env *e, const char *self) {
        Arena *a = make_arena(e, "shared", 1, 1 * GiB);
        ShareMsg msg = { .size = a->size, .length = 64 * MiB, .seed = 11 };
        Reply ra, rb;
        pid_t pa, pb;
        int sa, sb;

        snprintf(msg.pci_bus_id, sizeof msg.pci_bus_id, "%s", e->s->devices[0].pci_bus_id);

        pa = spawn_worker(self, "worker-share", &sa);
        msg.offset = 0;
        CHECK(send_fd(sa, a->fd, &msg, sizeof msg));
        CHECK(recv_fd(sa, &(int) { 0 }, &ra, sizeof ra));
        CHECK(wait_worker(pa)); /* A is gone; its bytes must stay */
        close(sa);

        pb = spawn_worker(self, "worker-share", &sb);
        msg.offset = 64 * MiB;
        msg.seed = 22;
        msg.check_offset = 0;
        msg.check_length = 64 * MiB;
        msg.check_seed = 11;
        CHECK(send_fd(sb, a->fd, &msg, sizeof msg));
        CHECK(recv_fd(sb, &(int) { 0 }, &rb, sizeof rb));
        CHECK(wait_worker(pb));
        close(sb);
        REQUIRE(ra.status == 0 && rb.status == 0, "worker saw wrong bytes");

        /* The daemon reads both regions through its own mapping (D2H via transport). */
        arena_to_host(e, a, 0, 0, 128 * MiB);
        uint8_t *want = malloc(64 * MiB);
        REQUIRE(want, "oom");
        fill_random(want, 64 * MiB, 11, 0);
        REQUIRE(memcmp(e->host, want, 64 * MiB) == 0, "worker A's bytes differ in the daemon");
        fill_random(want, 64 * MiB, 22, 0);
        REQUIRE(memcmp(e->host + 64 * MiB, want, 64 * MiB) == 0, "worker B's bytes differ in the daemon");
        free(want);
        printf("RESULT share ok import_map_ms_a=%.3f import_map_ms_b=%.3f\n", ra.import_map_ms,
               rb.import_map_ms);
        drop_arena(e, a);
}

static void test_external(Env *e, const char *self) {
        Arena *src = make_arena(e, "ext-src", 2, 256 * MiB);
        ShareMsg msg = { .size = 256 * MiB };
        GpuExternal *x = NULL;
        Reply r;
        int sock, fd;
        pid_t pid;

        snprintf(msg.pci_bus_id, sizeof msg.pci_bus_id, "%s", e->s->devices[0].pci_bus_id);
        fill_random(e->host, 32 * MiB, 33, 0);
        host_to_arena(e, src, 0, 0, 32 * MiB);

        pid = spawn_worker(self, "worker-external", &sock);
        CHECK(send_fd(sock, -1, &msg, sizeof msg));
        CHECK(recv_fd(sock, &fd, &r, sizeof r));
        REQUIRE(fd >= 0, "worker sent no fd");
        CHECK(gpu_context_register_external(e->ctx, 0, fd, 256 * MiB, &x));
        close(fd);
        REQUIRE(x->arena->owned == false, "external memory must not be owned by the daemon");

        /* Copy 32 MiB from the daemon's arena into the worker's memory at 1 MiB. */
        TransportWrite w = { .src_region = src->index, .dst_region = x->region.id,
                             .dst_offset = 1 * MiB, .length = 32 * MiB, .cookie = 7 };
        CHECK(transport_run(e->t, &w, 1, NULL));
        x = gpu_external_release(x);

        msg.check_offset = 1 * MiB;
        msg.check_length = 32 * MiB;
        msg.check_seed = 33;
        CHECK(send_fd(sock, -1, &msg, sizeof msg));
        CHECK(recv_fd(sock, &fd, &r, sizeof r));
        CHECK(wait_worker(pid));
        close(sock);
        REQUIRE(r.status == 0, "worker's memory was not intact after release");
        printf("RESULT external ok\n");
        drop_arena(e, src);
}

typedef enum { VIA_BATCH_API, VIA_PER_CALL, VIA_STREAMS, VIA_KERNEL } Via;
static const char *const via_names[] = { "copy-engine batch API", "copy-engine per call",
                                         "copy-engine 4 streams", "kernel batch" };

static void test_handoff(Env *e, Via via) {
        const uint64_t page = 2 * MiB, n_pages = 200;
        GpuCopyEngine *eng = cuda_transport_engine(e->t);
        Arena *p = make_arena(e, "prefill", 3, 512 * MiB);
        Arena *d = make_arena(e, "decode", 4, 512 * MiB);
        TransportWrite w[200];
        uint64_t perm[256];
        size_t count = 0;

        fill_random(e->host, p->size, 44, 0);
        host_to_arena(e, p, 0, 0, p->size);
        /* Poison the destination. */
        memset(e->host, 0xee, d->size);
        host_to_arena(e, d, 0, 0, d->size);

        for (uint64_t i = 0; i < 256; i++)
                perm[i] = i;
        for (uint64_t i = 255; i > 0; i--) {
                uint64_t j = mix64(i * 77) % (i + 1), t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
        }
        for (uint64_t i = 0; i < n_pages; i++)
                w[i] = (TransportWrite) { .src_region = p->index, .src_offset = perm[i] * page,
                                          .dst_region = d->index, .dst_offset = perm[255 - i] * page,
                                          .length = page, .cookie = 1000 + i };
        uint64_t before = e->t->stats.bytes;
        gpu_copy_engine_set_batch_api(eng, via == VIA_BATCH_API);
        gpu_copy_engine_set_kernel_batching(eng, via == VIA_KERNEL, 16);
        gpu_copy_engine_set_d2d_streams(eng, via == VIA_STREAMS ? 4 : 1);
        const GpuCopyStats *cs = gpu_copy_engine_stats(eng);
        uint64_t calls = cs->batch_api_calls, launches = cs->kernel_launches;
        CHECK(transport_run(e->t, w, n_pages, &count));
        gpu_copy_engine_set_batch_api(eng, true);
        gpu_copy_engine_set_kernel_batching(eng, false, 16);
        gpu_copy_engine_set_d2d_streams(eng, 1);
        printf("handoff via %s: batch API calls %" PRIu64 ", kernel launches %" PRIu64 "\n",
               via_names[via], cs->batch_api_calls - calls, cs->kernel_launches - launches);
        REQUIRE(count == n_pages, "expected %" PRIu64 " completions, got %zu", n_pages, count);
        REQUIRE(e->t->stats.bytes - before == n_pages * page, "byte count");

        arena_to_host(e, d, 0, 0, d->size);
        uint8_t *want = malloc(page);
        REQUIRE(want, "oom");
        bool moved[256] = {};
        for (uint64_t i = 0; i < n_pages; i++) {
                fill_random(want, page, 44, perm[i] * page / 8);
                REQUIRE(memcmp(e->host + perm[255 - i] * page, want, page) == 0, "page %" PRIu64 " differs", i);
                moved[perm[255 - i]] = true;
        }
        for (uint64_t k = 0; k < 256; k++)
                if (!moved[k])
                        for (uint64_t b = 0; b < page; b += 4096)
                                REQUIRE(e->host[k * page + b] == 0xee, "page %" PRIu64 " written but not a target", k);
        free(want);
        printf("RESULT handoff ok via=\"%s\" pages=%" PRIu64 " bytes=%" PRIu64 "\n", via_names[via],
               n_pages, n_pages * page);
        drop_arena(e, p);
        drop_arena(e, d);
}

/* A layer group's piece of every page (256 KiB at 768 KiB into each 2 MiB page; the
 * source's pages 0..199 in order, the destination's 50..249): the engine moves each part
 * of the batch as one cuMemcpy2DAsync; the pieces land exactly, nothing around them is
 * touched. */
static void test_strided(Env *e) {
        const uint64_t page = 2 * MiB, piece = 256 * 1024, at = 3 * piece, n_pages = 200;
        GpuCopyEngine *eng = cuda_transport_engine(e->t);
        Arena *p = make_arena(e, "prefill", 3, 512 * MiB);
        Arena *d = make_arena(e, "decode", 4, 512 * MiB);
        TransportWrite w[200];
        size_t count = 0;

        fill_random(e->host, p->size, 45, 0);
        host_to_arena(e, p, 0, 0, p->size);
        memset(e->host, 0xee, d->size);
        host_to_arena(e, d, 0, 0, d->size);
        for (uint64_t i = 0; i < n_pages; i++)
                w[i] = (TransportWrite) { .src_region = p->index, .src_offset = i * page + at,
                                          .dst_region = d->index, .dst_offset = (50 + i) * page + at,
                                          .length = piece, .cookie = 2000 + i };
        const GpuCopyStats *cs = gpu_copy_engine_stats(eng);
        uint64_t copies = cs->strided_copies, rows = cs->strided_rows;
        gpu_copy_engine_set_strided(eng, true); /* off by default */
        CHECK(transport_run(e->t, w, n_pages, &count));
        gpu_copy_engine_set_strided(eng, false);
        REQUIRE(count == n_pages, "expected %" PRIu64 " completions, got %zu", n_pages, count);
        REQUIRE(cs->strided_rows - rows == n_pages, "strided rows %" PRIu64, cs->strided_rows - rows);

        arena_to_host(e, d, 0, 0, d->size);
        uint8_t *want = malloc(piece);
        REQUIRE(want, "oom");
        for (uint64_t k = 0; k < 256; k++) {
                bool target = k >= 50 && k < 50 + n_pages;
                if (target) {
                        fill_random(want, piece, 45, ((k - 50) * page + at) / 8);
                        REQUIRE(memcmp(e->host + k * page + at, want, piece) == 0, "page %" PRIu64 "'s piece differs", k);
                }
                for (uint64_t b = 0; b < page; b += 4096)
                        REQUIRE((target && b >= at && b < at + piece) || e->host[k * page + b] == 0xee,
                                "page %" PRIu64 " written outside its piece at %" PRIu64, k, b);
        }
        free(want);
        printf("RESULT strided ok pieces=%" PRIu64 " copies=%" PRIu64 "\n", n_pages, cs->strided_copies - copies);
        drop_arena(e, p);
        drop_arena(e, d);
}

static void test_cow(Env *e) {
        enum { N = 64, POOL = 128 };
        const uint64_t page = 256 * 1024;
        Arena *a = make_arena(e, "cow", 5, POOL * page);
        unsigned refs[POOL] = {}, seq[N], clone[N], next_free = N;
        const unsigned written[] = { 3, 17, 18, 40, 63 };
        uint64_t copies = 0, copied_bytes = 0;

        fill_random(e->host, N * page, 55, 0);
        host_to_arena(e, a, 0, 0, N * page);
        for (unsigned i = 0; i < N; i++) {
                seq[i] = clone[i] = i;
                refs[i] = 2; /* the sequence and its clone share every page */
        }
        for (size_t k = 0; k < ELEMENTSOF(written); k++) {
                unsigned i = written[k], old = clone[i];
                if (refs[old] > 1) {
                        /* Copy on write: the page first, through the GPU copy path. */
                        unsigned fresh = next_free++;
                        TransportWrite w = { .src_region = a->index, .src_offset = old * page,
                                             .dst_region = a->index, .dst_offset = fresh * page,
                                             .length = page, .cookie = i };
                        CHECK(transport_run(e->t, &w, 1, NULL));
                        refs[old]--;
                        refs[fresh] = 1;
                        clone[i] = fresh;
                        copies++;
                        copied_bytes += page;
                }
                /* The clone's write: the first 4 KiB of its private page. */
                memset(e->host + 100 * MiB, 0x40 + (int)k, 4096);
                host_to_arena(e, a, clone[i] * page, 100 * MiB, 4096);
        }
        REQUIRE(copies == ELEMENTSOF(written), "copied %" PRIu64 " pages", copies);

        arena_to_host(e, a, 0, 0, POOL * page);
        uint8_t *want = malloc(page);
        REQUIRE(want, "oom");
        for (unsigned i = 0; i < N; i++) {
                fill_random(want, page, 55, (uint64_t)i * page / 8);
                /* The original sequence is untouched. */
                REQUIRE(memcmp(e->host + seq[i] * page, want, page) == 0, "original page %u changed", i);
                bool w = false;
                for (size_t k = 0; k < ELEMENTSOF(written); k++)
                        if (written[k] == i) {
                                w = true;
                                memset(want, 0x40 + (int)k, 4096);
                        }
                REQUIRE(w == (clone[i] != seq[i]), "page %u: shared=%d after write=%d", i, clone[i] == seq[i], w);
                REQUIRE(memcmp(e->host + clone[i] * page, want, page) == 0, "clone page %u wrong", i);
        }
        /* Pages past the copies were never touched. */
        for (unsigned k = next_free; k < POOL; k++)
                REQUIRE(refs[k] == 0, "pool page %u in use", k);
        free(want);
        printf("RESULT cow ok copied_pages=%" PRIu64 "/%d copied_bytes=%" PRIu64 "\n", copies, N, copied_bytes);
        drop_arena(e, a);
}

static void pack_case(Env *e, GpuKernels *k, Arena *a, Arena *st, uint64_t page, size_t n_pages,
                      uint64_t group_off, uint64_t group_bytes, uint64_t seed) {
        GpuChunk *c = NULL, *desc_host = NULL;
        uint64_t *offs = malloc(n_pages * sizeof *offs);
        CUdeviceptr desc_dev;
        CudaDriver *d = e->s->driver;
        CUstream stream;
        uint8_t *ref;

        REQUIRE(offs, "oom");
        CHECK(CU(d, cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING));
        CHECK(CU(d, cuMemAllocHost, (void **)&desc_host, n_pages * sizeof(GpuChunk)));
        CHECK(CU(d, cuMemAlloc, &desc_dev, n_pages * sizeof(GpuChunk)));
        c = desc_host;

        fill_random(e->host, a->size, seed, 0);
        host_to_arena(e, a, 0, 0, a->size);
        ref = malloc(a->size);
        REQUIRE(ref, "oom");
        memcpy(ref, e->host, a->size);

        for (size_t i = 0; i < n_pages; i++)
                offs[i] = (mix64(seed + i) % (a->size / page)) * page;
        /* Sources may repeat in a gather; unpack below scatters to distinct pages
         * (7919 is prime, so i * 7919 mod pages is distinct for i < pages). */
        REQUIRE(n_pages <= a->size / page, "unpack needs distinct pages");
        memset(e->host, 0xcd, st->size);
        host_to_arena(e, st, 0, 0, st->size);
        CHECK(gpu_pack_plan(a->gpu->base, offs, n_pages, group_off, group_bytes, st->gpu->base, c));
        CHECK(gpu_kernels_copy_chunks(k, stream, c, desc_dev, n_pages));
        CHECK(CU(d, cuStreamSynchronize, stream));
        arena_to_host(e, st, 0, 0, st->size);
        for (size_t i = 0; i < n_pages; i++)
                REQUIRE(memcmp(e->host + i * group_bytes, ref + offs[i] + group_off, group_bytes) == 0,
                        "pack chunk %zu differs (group %" PRIu64 "+%" PRIu64 ")", i, group_off, group_bytes);
        for (uint64_t b = n_pages * group_bytes; b < st->size; b += 4093)
                REQUIRE(e->host[b] == 0xcd, "pack wrote past its staging bytes");

        /* Unpack into distinct pages of the (poisoned) arena. */
        memset(e->host, 0xcd, a->size);
        host_to_arena(e, a, 0, 0, a->size);
        for (size_t i = 0; i < n_pages; i++)
                offs[i] = (uint64_t)((i * 7919) % (a->size / page)) * page;
        CHECK(gpu_pack_plan(a->gpu->base, offs, n_pages, group_off, group_bytes, st->gpu->base, c));
        gpu_chunks_reverse(c, n_pages);
        CHECK(gpu_kernels_copy_chunks(k, stream, c, desc_dev, n_pages));
        CHECK(CU(d, cuStreamSynchronize, stream));
        arena_to_host(e, st, 0, a->size, st->size); /* staging, after the arena in host */
        arena_to_host(e, a, 0, 0, a->size);
        memset(ref, 0xcd, a->size);
        for (size_t i = 0; i < n_pages; i++)
                memcpy(ref + offs[i] + group_off, e->host + a->size + i * group_bytes, group_bytes);
        REQUIRE(memcmp(e->host, ref, a->size) == 0, "unpack differs from the host reference");

        free(ref);
        free(offs);
        (void)CU(d, cuMemFree, desc_dev);
        (void)CU(d, cuMemFreeHost, desc_host);
        (void)CU(d, cuStreamDestroy, stream);
}

static void test_pack(Env *e) {
        GpuKernels *k = NULL;
        int r = gpu_kernels_load(e->s, 0, &k);

        if (r == -EOPNOTSUPP) {
                printf("RESULT pack skipped: built without nvcc\n");
                return;
        }
        CHECK(r);
        Arena *a = make_arena(e, "pack-pages", 6, 256 * MiB);
        Arena *st = make_arena(e, "pack-staging", 7, 64 * MiB);
        /* 16-byte aligned groups (vector path) and odd ones (byte path). */
        /* Each case on the 2-D grid, then with equal aligned chunks on the uniform kernel. */
        for (int u = 0; u < 2; u++) {
                k->uniform = u;
                pack_case(e, k, a, st, 1 * MiB, 60, 256 * 1024, 512 * 1024, 66);
                pack_case(e, k, a, st, 256 * 1024, 500, 4096, 64 * 1024, 67);
                pack_case(e, k, a, st, 1 * MiB, 100, 333, 100003, 68);
                pack_case(e, k, a, st, 1 * MiB, 40, 4112, 200016, 69); /* aligned, 3 tiles and a part */
        }
        k->uniform = false;
        printf("RESULT pack ok cases=8\n");
        drop_arena(e, a);
        drop_arena(e, st);
        gpu_kernels_free(k);
}

/* The KV layer copies (kvcopy.h): the kernel against the host copy, both directions,
 * both tensor layouts, a last page partly used. many: every layer of the page in one
 * launch (gpu_kv_rows_copy_many: epd_kv_layers); else one layer (epd_kv_rows). Pages: a
 * GPU arena; tensors: another. Host image: [pages arena | tensor arena] in e->host. */
static void kv_case(Env *e, GpuKernels *k, Arena *pa, Arena *ta, bool token_major, GpuKvDirection dir, bool many,
                    uint64_t seed) {
        enum { L = 4 };
        const uint32_t H = 8, T = 16;
        const uint64_t row = 256, S = 1000, block = (uint64_t)T * H * row, page = (uint64_t)L * 2 * block,
                       tensor = (uint64_t)H * S * row;
        const size_t n_pages = (S + T - 1) / T;
        /* One layer: the page's third. */
        const unsigned first = many ? 0 : 2, n = many ? L : 1;
        CudaDriver *d = e->s->driver;
        uint64_t *dev_pages = malloc(n_pages * 8), *host_pages = malloc(n_pages * 8);
        uint8_t *img = e->host, *ref = malloc(pa->size + ta->size);
        GpuKvRows rows[L];
        CUdeviceptr table;
        CUstream stream;

        REQUIRE(dev_pages && host_pages && ref, "oom");
        REQUIRE(pa->size + ta->size <= e->host_size && n_pages <= pa->size / page && 2 * L * tensor <= ta->size,
                "sizes");
        for (size_t i = 0; i < n_pages; i++) {
                uint64_t id = (i * 7919 + seed) % (pa->size / page);
                dev_pages[i] = pa->gpu->base + id * page;
                host_pages[i] = (uintptr_t)(img + id * page);
        }
        fill_random(img, pa->size + ta->size, seed, 0);
        host_to_arena(e, pa, 0, 0, pa->size);
        host_to_arena(e, ta, 0, pa->size, ta->size);
        /* The reference on the host image. */
        for (unsigned i = 0; i < n; i++) {
                unsigned l = first + i;
                rows[i] = (GpuKvRows){ .tokens = S, .heads = H, .tokens_per_page = T, .row_bytes = row,
                                       .k_offset = l * 2 * block, .v_offset = l * 2 * block + block,
                                       .head_stride = token_major ? row : 0,
                                       .token_stride = token_major ? H * row : 0 };
                rows[i].k = (uintptr_t)(img + pa->size) + 2 * i * tensor;
                rows[i].v = rows[i].k + tensor;
                CHECK(gpu_kv_rows_check(&rows[i], n_pages, page));
                gpu_kv_rows_copy_host(&rows[i], host_pages, dir);
        }
        memcpy(ref, img, pa->size + ta->size); /* what the GPU must produce */
        /* The GPU run. */
        for (unsigned i = 0; i < n; i++) {
                rows[i].k = ta->gpu->base + 2 * i * tensor;
                rows[i].v = rows[i].k + tensor;
        }
        CHECK(CU(d, cuStreamCreate, &stream, CU_STREAM_NON_BLOCKING));
        CHECK(CU(d, cuMemAlloc, &table, n_pages * 8));
        CHECK(CU(d, cuMemcpyHtoD, table, dev_pages, n_pages * 8));
        REQUIRE(gpu_kv_rows_aligned(&rows[0], dev_pages, n_pages), "aligned");
        if (many) {
                REQUIRE(gpu_kv_rows_uniform(rows, n, dev_pages, n_pages), "uniform");
                CHECK(gpu_kv_rows_copy_many(e->s, k, stream, table, dev_pages, n_pages, rows, n, dir));
        } else
                CHECK(gpu_kv_rows_copy(e->s, k, stream, table, dev_pages, n_pages, &rows[0], dir));
        CHECK(CU(d, cuStreamSynchronize, stream));
        arena_to_host(e, pa, 0, 0, pa->size);
        arena_to_host(e, ta, 0, pa->size, ta->size);
        REQUIRE(memcmp(img, ref, pa->size + ta->size) == 0, "kv %s (%s, %s) differ from the host copy",
                many ? "layers" : "rows", token_major ? "token-major" : "head-major",
                dir == GPU_KV_TO_PAGES ? "scatter" : "gather");
        (void)CU(d, cuMemFree, table);
        (void)CU(d, cuStreamDestroy, stream);
        free(ref);
        free(dev_pages);
        free(host_pages);
}

static void test_kv_rows(Env *e) {
        GpuKernels *k = NULL;
        int r = gpu_kernels_load(e->s, 0, &k);
        if (r == -EOPNOTSUPP) {
                printf("RESULT kv-rows skipped: built without nvcc\n");
                return;
        }
        CHECK(r);
        Arena *pa = make_arena(e, "kv-pages", 8, 128 * MiB);
        Arena *ta = make_arena(e, "kv-tensors", 9, 32 * MiB);
        unsigned cases = 0;
        for (int many = 0; many < 2; many++)
                for (int tm = 0; tm < 2; tm++)
                        for (int dir = 0; dir < 2; dir++, cases++)
                                kv_case(e, k, pa, ta, tm, (GpuKvDirection)dir, many, 70 + cases);
        printf("RESULT kv-rows ok cases=%u (4 one layer a launch, 4 four layers a launch)\n", cases);
        drop_arena(e, pa);
        drop_arena(e, ta);
        gpu_kernels_free(k);
}

int main(int argc, char **argv) {
        Env e = {};
        int sock = 3, r, memfd;

        if (argc > 1 && strcmp(argv[1], "worker-share") == 0)
                return worker_share(sock);
        if (argc > 1 && strcmp(argv[1], "worker-external") == 0)
                return worker_external(sock);

        r = gpu_context_new(NULL, &e.ctx);
        if (r == -ENOENT || r == -ENODEV || r == -EOPNOTSUPP) {
                printf("SKIP: %s\n", cuda_absence_to_string(r));
                return 77;
        }
        CHECK(r);
        e.s = e.ctx->system;
        e.t = e.ctx->transport;
        char *topo = NULL;
        CHECK(gpu_context_format(e.ctx, &topo));
        printf("%s", topo);
        free(topo);

        /* A host arena: memfd, mapped shared, pinned by the transport's registration. */
        e.host_size = 1 * GiB;
        memfd = memfd_create("epd-test-host", MFD_CLOEXEC);
        CHECK(memfd < 0 ? -errno : 0);
        CHECK(ftruncate(memfd, (off_t)e.host_size) < 0 ? -errno : 0);
        e.host = mmap(NULL, e.host_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, memfd, 0);
        REQUIRE(e.host != MAP_FAILED, "mmap: %m");
        e.host_region = (TransportRegion) { .id = HOST_REGION_ID, .domain = MEMORY_HOST,
                                            .host_base = e.host, .size = e.host_size };
        CHECK(e.t->ops->register_region(e.t, &e.host_region));

        /* Refusals first: host → host, unknown regions, out of range. */
        TransportWrite bad = { .src_region = HOST_REGION_ID, .dst_region = HOST_REGION_ID, .length = 8 };
        REQUIRE(e.t->ops->post(e.t, NULL, &bad, 1) == -EINVAL, "host→host must be refused");
        bad.dst_region = 4242;
        REQUIRE(e.t->ops->post(e.t, NULL, &bad, 1) == -ENOENT, "unknown region must be refused");

        test_share(&e, argv[0]);
        test_external(&e, argv[0]);
        test_handoff(&e, VIA_BATCH_API);
        test_handoff(&e, VIA_PER_CALL);
        test_handoff(&e, VIA_STREAMS);
        test_handoff(&e, VIA_KERNEL);
        test_strided(&e);
        test_cow(&e);
        test_pack(&e);
        test_kv_rows(&e);

        const GpuCopyStats *st = gpu_copy_engine_stats(cuda_transport_engine(e.t));
        printf("copy engine: %" PRIu64 " batches, %" PRIu64 " bytes, %" PRIu64 " failures\n",
               st->batches, st->bytes, st->failures);
        REQUIRE(st->failures == 0, "copy failures");

        e.t->ops->unregister_region(e.t, &e.host_region);
        munmap(e.host, e.host_size);
        close(memfd);
        gpu_context_free(e.ctx);
        printf("ALL GPU DEVICE TESTS PASSED\n");
        return EXIT_SUCCESS;
}
