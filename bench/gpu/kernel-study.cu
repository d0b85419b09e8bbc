// SPDX-License-Identifier: LGPL-2.1-or-later
// Which way of copying many scattered chunks between two GPU arenas comes closest to one
// raw cuMemcpyDtoDAsync of the same bytes? A standalone study (built with nvcc by
// bench/gpu/run-device.sh, not part of epd): the arenas are made as epdd makes them
// (cuMemCreate + cuMemMap, 2 MiB granularity), the descriptors are on the GPU before the
// clock starts, and each kernel is timed alone with CUDA events (median of 7 after a
// warm-up). Every kernel's result is checked byte for byte once per case.
//
// Kernels: the 2-D grid of pack.cu (tiles of 16, 64 and 256 KiB; with and without the
// streaming cache hints; 4 and 8 loads in flight per thread) and a Hopper bulk-copy
// (TMA) kernel: one warp per block, a ring of shared-memory stages filled by
// cp.async.bulk global→shared and drained by cp.async.bulk shared→global.
//
// Cases: 256 KiB pieces contiguous on both sides (the kernel's own ceiling), 2 MiB pages
// scattered, 256 KiB pages scattered, and layer groups: 8 groups of 256 KiB in each
// 2 MiB page, pages scattered, shipped group by group (what a handoff between GPU arenas
// moves); the same with the pages in order on both sides, where a group is also one
// strided copy on a copy engine (cuMemcpy2DAsync, one call a group).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CK(x)                                                                                  \
        do {                                                                                   \
                CUresult r_ = (x);                                                             \
                if (r_ != CUDA_SUCCESS) {                                                      \
                        const char *s_ = "?";                                                  \
                        cuGetErrorString(r_, &s_);                                             \
                        fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s_);         \
                        exit(1);                                                               \
                }                                                                              \
        } while (0)
#define RK(x)                                                                                  \
        do {                                                                                   \
                cudaError_t r_ = (x);                                                          \
                if (r_ != cudaSuccess) {                                                       \
                        fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,              \
                                cudaGetErrorString(r_));                                       \
                        exit(1);                                                               \
                }                                                                              \
        } while (0)

struct Chunk {
        unsigned long long src, dst, len;
};

template <bool STREAM>
__device__ __forceinline__ uint4 ld(const uint4 *p) {
        if (STREAM)
                return __ldcs(p);
        return *p;
}
template <bool STREAM>
__device__ __forceinline__ void st(uint4 *p, uint4 v) {
        if (STREAM)
                __stcs(p, v);
        else
                *p = v;
}

// pack.cu's epd_copy_chunks, with the cache hints and the loads in flight as parameters
// (16-byte aligned chunks only: the study's are).
template <bool STREAM, int U>
__global__ void __launch_bounds__(256) copy_tiles(const Chunk *__restrict__ chunks, unsigned n, unsigned tile_words) {
        for (unsigned c = blockIdx.y; c < n; c += gridDim.y) {
                const Chunk e = chunks[c];
                const unsigned long long begin = (unsigned long long)blockIdx.x * tile_words;
                const uint4 *__restrict__ s = (const uint4 *)e.src;
                uint4 *__restrict__ d = (uint4 *)e.dst;
                const unsigned long long nw = e.len / 16;
                if (begin >= nw)
                        continue;
                const unsigned long long end = min(begin + tile_words, nw);
                unsigned long long i = begin + threadIdx.x;
                for (; i + (U - 1) * 256 < end; i += U * 256) {
                        uint4 v[U];
#pragma unroll
                        for (int u = 0; u < U; u++)
                                v[u] = ld<STREAM>(s + i + u * 256);
#pragma unroll
                        for (int u = 0; u < U; u++)
                                st<STREAM>(d + i + u * 256, v[u]);
                }
                for (; i < end; i += 256)
                        st<STREAM>(d + i, ld<STREAM>(s + i));
        }
}

// The same tiles, handed out per SM: the blocks resident on one SM take the next tiles of
// the chunk that SM is on (a chunk is claimed from a global counter by the block that
// draws its first tile), so an SM touches one or two pages of either arena at a time
// instead of one a block. Tickets: ctr[0] is the global chunk counter, ctr[1 + smid] the
// SM's ticket counter; slot[smid * 64 + j % 64] publishes the SM's j-th chunk as
// (j + 1) << 32 | chunk. ctr and slot are zeroed before each launch.
template <int U>
__global__ void __launch_bounds__(256) copy_sm_local(const Chunk *__restrict__ chunks, unsigned n, unsigned tile_words,
                                                     unsigned tiles_per_chunk, unsigned *ctr,
                                                     unsigned long long *slot) {
        unsigned smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        __shared__ unsigned long long claim;
        for (;;) {
                if (threadIdx.x == 0) {
                        const unsigned k = atomicAdd(&ctr[1 + smid], 1);
                        const unsigned j = k / tiles_per_chunk, t = k - j * tiles_per_chunk;
                        volatile unsigned long long *sl = &slot[(unsigned long long)smid * 64 + j % 64];
                        unsigned long long v;
                        if (t == 0) {
                                v = (unsigned long long)(j + 1) << 32 | atomicAdd(&ctr[0], 1);
                                *sl = v;
                                __threadfence();
                        } else
                                while (((v = *sl) >> 32) != j + 1)
                                        ;
                        claim = (v & 0xffffffffULL) | (unsigned long long)t << 40;
                }
                __syncthreads();
                const unsigned long long cl = claim;
                __syncthreads();
                const unsigned c = (unsigned)(cl & 0xffffffffULL), t = (unsigned)(cl >> 40);
                if (c >= n)
                        return;
                const Chunk e = chunks[c];
                const unsigned long long begin = (unsigned long long)t * tile_words;
                const uint4 *__restrict__ s = (const uint4 *)e.src;
                uint4 *__restrict__ d = (uint4 *)e.dst;
                const unsigned long long end = min(begin + tile_words, e.len / 16);
                unsigned long long i = begin + threadIdx.x;
                for (; i + (U - 1) * 256 < end; i += U * 256) {
                        uint4 v[U];
#pragma unroll
                        for (int u = 0; u < U; u++)
                                v[u] = __ldcs(s + i + u * 256);
#pragma unroll
                        for (int u = 0; u < U; u++)
                                __stcs(d + i + u * 256, v[u]);
                }
                for (; i < end; i += 256)
                        __stcs(d + i, __ldcs(s + i));
        }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define HAVE_TMA 1
#endif

__device__ __forceinline__ unsigned smem_addr(const void *p) {
        return (unsigned)__cvta_generic_to_shared(p);
}

// Bulk copies through shared memory. Work item t is stage_bytes of chunk t / per_chunk
// (chunks of one length here; the last piece of a chunk may be shorter). Blocks take items
// t = blockIdx.x, + gridDim.x, ...; lane 0 of the one warp issues everything: STAGES loads
// in flight, each store issued as soon as its load lands, a stage reused once the store
// from it has read it.
template <int STAGES>
__global__ void __launch_bounds__(32) copy_bulk(const Chunk *__restrict__ chunks, unsigned n,
                                                unsigned stage_bytes, unsigned long long per_chunk) {
#ifdef HAVE_TMA
        extern __shared__ __align__(128) unsigned char buf[];
        __shared__ __align__(8) unsigned long long bar[STAGES];
        if (threadIdx.x != 0)
                return;
        const unsigned long long items = per_chunk * n;
        for (int s = 0; s < STAGES; s++)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[s])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

        unsigned phase[STAGES];
        unsigned long long item_of[STAGES];
        unsigned bytes_of[STAGES];
        for (int s = 0; s < STAGES; s++)
                phase[s] = 0;

        auto issue_load = [&](int s, unsigned long long t) {
                const Chunk e = chunks[t / per_chunk];
                const unsigned long long off = (t % per_chunk) * stage_bytes;
                const unsigned b = (unsigned)min((unsigned long long)stage_bytes, e.len - off);
                item_of[s] = t;
                bytes_of[s] = b;
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar[s])),
                             "r"(b)
                             : "memory");
                asm volatile(
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                                smem_addr(buf + (size_t)s * stage_bytes)),
                        "l"(e.src + off), "r"(b), "r"(smem_addr(&bar[s]))
                        : "memory");
        };

        unsigned long long next = blockIdx.x;
        int loaded = 0;
        for (; loaded < STAGES && next < items; loaded++, next += gridDim.x)
                issue_load(loaded, next);
        for (int k = 0, s = 0; k < loaded; k++, s = (s + 1) % STAGES) {
                unsigned ok = 0;
                while (!ok)
                        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                                     "selp.u32 %0, 1, 0, p; }"
                                     : "=r"(ok)
                                     : "r"(smem_addr(&bar[s])), "r"(phase[s])
                                     : "memory");
                phase[s] ^= 1;
                const unsigned long long t = item_of[s];
                const Chunk e = chunks[t / per_chunk];
                const unsigned long long off = (t % per_chunk) * stage_bytes;
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(e.dst + off),
                             "r"(smem_addr(buf + (size_t)s * stage_bytes)), "r"(bytes_of[s])
                             : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                if (next < items) {
                        /* Reuse this stage once its store has read it: wait for all but
                         * nothing newer than it (the store just issued is the newest). */
                        asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                        issue_load(s, next);
                        next += gridDim.x;
                        loaded++;
                }
        }
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

// The same, but a stage is refilled only after the next load has landed and the store
// before it has been read (one store kept in flight while the next load goes out).
template <int STAGES>
__global__ void __launch_bounds__(32) copy_bulk2(const Chunk *__restrict__ chunks, unsigned n,
                                                 unsigned stage_bytes, unsigned long long per_chunk) {
#ifdef HAVE_TMA
        extern __shared__ __align__(128) unsigned char buf[];
        __shared__ __align__(8) unsigned long long bar[STAGES];
        if (threadIdx.x != 0)
                return;
        const unsigned long long items = per_chunk * n;
        for (int s = 0; s < STAGES; s++)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[s])));
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

        unsigned phase[STAGES];
        unsigned long long item_of[STAGES];
        unsigned bytes_of[STAGES];
        for (int s = 0; s < STAGES; s++)
                phase[s] = 0;
        auto issue_load = [&](int s, unsigned long long t) {
                const Chunk e = chunks[t / per_chunk];
                const unsigned long long off = (t % per_chunk) * stage_bytes;
                const unsigned b = (unsigned)min((unsigned long long)stage_bytes, e.len - off);
                item_of[s] = t;
                bytes_of[s] = b;
                asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar[s])),
                             "r"(b)
                             : "memory");
                asm volatile(
                        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                                smem_addr(buf + (size_t)s * stage_bytes)),
                        "l"(e.src + off), "r"(b), "r"(smem_addr(&bar[s]))
                        : "memory");
        };
        /* Stage s holds item k (k % STAGES == s); all stages are loaded first. Iteration
         * k waits for load k, stores it, then refills the stage of item k - 1 once that
         * store has read it (all store groups but the newest done reading): one store
         * stays in flight while the next load goes out. */
        unsigned long long next = blockIdx.x;
        int issued = 0;
        for (; issued < STAGES && next < items; issued++, next += gridDim.x)
                issue_load(issued, next);
        for (int k = 0; k < issued; k++) {
                const int s = k % STAGES;
                unsigned ok = 0;
                while (!ok)
                        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                                     "selp.u32 %0, 1, 0, p; }"
                                     : "=r"(ok)
                                     : "r"(smem_addr(&bar[s])), "r"(phase[s])
                                     : "memory");
                phase[s] ^= 1;
                const unsigned long long t = item_of[s];
                const Chunk e = chunks[t / per_chunk];
                const unsigned long long off = (t % per_chunk) * stage_bytes;
                asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(e.dst + off),
                             "r"(smem_addr(buf + (size_t)s * stage_bytes)), "r"(bytes_of[s])
                             : "memory");
                asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                if (k >= 1 && next < items) {
                        asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
                        issue_load(issued % STAGES, next);
                        next += gridDim.x;
                        issued++;
                }
        }
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
#endif
}

__global__ void fill(unsigned *p, unsigned long long n, unsigned seed) {
        for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
             i += (unsigned long long)gridDim.x * blockDim.x)
                p[i] = (unsigned)(i * 2654435761ULL) ^ seed;
}

__global__ void verify(const Chunk *chunks, unsigned n, unsigned long long *bad) {
        for (unsigned c = blockIdx.y; c < n; c += gridDim.y) {
                const Chunk e = chunks[c];
                const unsigned *s = (const unsigned *)e.src, *d = (const unsigned *)e.dst;
                for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < e.len / 4;
                     i += (unsigned long long)gridDim.x * blockDim.x)
                        if (s[i] != d[i])
                                atomicAdd(bad, 1ULL);
        }
}

static CUdeviceptr arena(size_t size) {
        CUmemAllocationProp p = {};
        p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        p.location.id = 0;
        p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        size_t g = 0;
        CK(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
        size = (size + g - 1) / g * g;
        CUmemGenericAllocationHandle h;
        CK(cuMemCreate(&h, size, &p, 0));
        CUdeviceptr base;
        CK(cuMemAddressReserve(&base, size, 0, 0, 0));
        CK(cuMemMap(base, size, 0, h, 0));
        CUmemAccessDesc a = {};
        a.location = p.location;
        a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        CK(cuMemSetAccess(base, size, &a, 1));
        static bool said;
        if (!said)
                printf("arena granularity %zu KiB\n", g >> 10), said = true;
        return base;
}

static const size_t MiB = 1 << 20;
static const size_t S = 4096 * MiB;
static cudaStream_t stream;
static cudaEvent_t ev0, ev1;

template <typename F>
static double time_it(F launch) {
        std::vector<float> v;
        launch(); // warm-up
        for (int i = 0; i < 7; i++) {
                RK(cudaEventRecord(ev0, stream));
                launch();
                RK(cudaEventRecord(ev1, stream));
                RK(cudaEventSynchronize(ev1));
                float ms;
                RK(cudaEventElapsedTime(&ms, ev0, ev1));
                v.push_back(ms);
        }
        RK(cudaGetLastError());
        std::sort(v.begin(), v.end());
        return v[3];
}

int main() {
        RK(cudaSetDevice(0));
        RK(cudaFree(0));
        RK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        RK(cudaEventCreate(&ev0));
        RK(cudaEventCreate(&ev1));
        int sms = 0;
        RK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
        CUdeviceptr x = arena(S), y = arena(S);
        fill<<<1024, 256, 0, stream>>>((unsigned *)x, S / 4, 0x5eed);
        RK(cudaStreamSynchronize(stream));

        double raw = time_it([&] { CK(cuMemcpyDtoDAsync(y, x, S, (CUstream)stream)); });
        printf("raw cuMemcpyDtoDAsync 4 GiB: %.3f ms, %.1f GB/s; %d SMs\n", raw, S / raw / 1e6, sms);

        struct Case {
                const char *name;
                std::vector<Chunk> c;
        };
        std::vector<Case> cases;
        {
                Case a{ "256K contiguous", {} };
                for (size_t i = 0; i < S / (256 * 1024); i++)
                        a.c.push_back({ x + i * 256 * 1024, y + i * 256 * 1024, 256 * 1024 });
                cases.push_back(a);
        }
        for (size_t p : { 2 * MiB, 256 * 1024ul }) {
                Case a{ p == 2 * MiB ? "2M pages scattered" : "256K pages scattered", {} };
                size_t n = S / p;
                for (size_t i = 0; i < n; i++)
                        a.c.push_back({ x + i * p, y + ((i * 7919) % n) * p, p });
                cases.push_back(a);
        }
        {
                Case a{ "8 groups x 256K of 2M pages", {} };
                size_t n = S / (2 * MiB);
                for (size_t g = 0; g < 8; g++)
                        for (size_t i = 0; i < n; i++)
                                a.c.push_back({ x + i * 2 * MiB + g * 256 * 1024, y + ((i * 7919) % n) * 2 * MiB + g * 256 * 1024,
                                                256 * 1024 });
                cases.push_back(a);
        }
        {
                /* Pages in the same order on both sides (a sequence allocated in one
                 * piece): a group is then one strided 2-D copy (the copy-engine row). */
                Case a{ "8 groups x 256K, pages in order", {} };
                size_t n = S / (2 * MiB);
                for (size_t g = 0; g < 8; g++)
                        for (size_t i = 0; i < n; i++)
                                a.c.push_back({ x + i * 2 * MiB + g * 256 * 1024, y + i * 2 * MiB + g * 256 * 1024,
                                                256 * 1024 });
                cases.push_back(a);
        }
        {
                Case a{ "8 groups x 256K, sorted by dst", cases[cases.size() - 2].c };
                std::sort(a.c.begin(), a.c.end(), [](const Chunk &l, const Chunk &r) { return l.dst < r.dst; });
                cases.push_back(a);
        }

        Chunk *dc;
        RK(cudaMalloc(&dc, sizeof(Chunk) * 65536));
        unsigned long long *bad;
        RK(cudaMalloc(&bad, 8));
        unsigned *sm_ctr;
        unsigned long long *sm_slot;
        RK(cudaMalloc(&sm_ctr, sizeof(unsigned) * 1025));
        RK(cudaMalloc(&sm_slot, sizeof(unsigned long long) * 1024 * 64));

        for (auto &cs : cases) {
                unsigned n = (unsigned)cs.c.size();
                unsigned long long len = cs.c[0].len;
                RK(cudaMemcpy(dc, cs.c.data(), sizeof(Chunk) * n, cudaMemcpyHostToDevice));
                auto check = [&](const char *kname) {
                        RK(cudaMemsetAsync(bad, 0, 8, stream));
                        verify<<<dim3(64, std::min(n, 65535u)), 256, 0, stream>>>(dc, n, bad);
                        unsigned long long b = 0;
                        RK(cudaMemcpyAsync(&b, bad, 8, cudaMemcpyDeviceToHost, stream));
                        RK(cudaStreamSynchronize(stream));
                        if (b)
                                printf("  %s: %llu WORDS WRONG\n", kname, b);
                        return b == 0;
                };
                auto row = [&](const char *kname, double ms) {
                        printf("STUDY | %-34s | %-30s | %7.3f | %7.1f | %.3f |\n", cs.name, kname, ms, S / ms / 1e6,
                               raw / ms);
                };
                auto tiles = [&](auto kern, unsigned tile, const char *kname) {
                        unsigned gx = (unsigned)((len + tile - 1) / tile), gy = std::min(n, 65535u);
                        RK(cudaMemsetAsync((void *)y, 0, S, stream));
                        double ms = time_it([&] { kern<<<dim3(gx, gy), 256, 0, stream>>>(dc, n, tile / 16); });
                        if (check(kname))
                                row(kname, ms);
                };
                tiles(copy_tiles<true, 4>, 64 * 1024, "2-D grid 64K cs U4");
                tiles(copy_tiles<true, 4>, 16 * 1024, "2-D grid 16K cs U4 (pack.cu)");
                if (strstr(cs.name, "pages in order")) {
                        /* Each group as one cuMemcpy2DAsync (256 KiB rows at a 2 MiB pitch). */
                        const size_t pages = S / (2 * MiB);
                        RK(cudaMemsetAsync((void *)y, 0, S, stream));
                        double ms = time_it([&] {
                                for (size_t g = 0; g < 8; g++) {
                                        CUDA_MEMCPY2D m = {};
                                        m.srcMemoryType = m.dstMemoryType = CU_MEMORYTYPE_DEVICE;
                                        m.srcDevice = x + g * 256 * 1024;
                                        m.dstDevice = y + g * 256 * 1024;
                                        m.srcPitch = m.dstPitch = 2 * MiB;
                                        m.WidthInBytes = 256 * 1024;
                                        m.Height = pages;
                                        CK(cuMemcpy2DAsync(&m, (CUstream)stream));
                                }
                        });
                        if (check("copy engine, 2-D, 1 call a group"))
                                row("copy engine, 2-D, 1 call a group", ms);
                }
                {
                        /* Tiles handed out per SM (copy_sm_local). */
                        for (unsigned tile : { 16u * 1024, 32u * 1024 }) {
                                const unsigned per = (unsigned)((len + tile - 1) / tile);
                                int nsm = 0;
                                RK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
                                RK(cudaMemsetAsync((void *)y, 0, S, stream));
                                double ms = time_it([&] {
                                        RK(cudaMemsetAsync(sm_ctr, 0, sizeof(unsigned) * 1025, stream));
                                        RK(cudaMemsetAsync(sm_slot, 0, sizeof(unsigned long long) * 1024 * 64, stream));
                                        copy_sm_local<4><<<nsm * 8, 256, 0, stream>>>(dc, n, tile / 16, per, sm_ctr, sm_slot);
                                });
                                char kname[64];
                                snprintf(kname, sizeof kname, "per-SM tiles %uK cs U4", tile >> 10);
                                if (check(kname))
                                        row(kname, ms);
                        }
                }
                tiles(copy_tiles<true, 4>, 256 * 1024, "2-D grid 256K cs U4");
                tiles(copy_tiles<false, 4>, 64 * 1024, "2-D grid 64K plain U4");
                tiles(copy_tiles<true, 8>, 64 * 1024, "2-D grid 64K cs U8");
                tiles(copy_tiles<false, 8>, 32 * 1024, "2-D grid 32K plain U8");
#ifdef STUDY_TMA
                auto bulk = [&](auto kern, int stages, unsigned stage, int per_sm, const char *kname) {
                        size_t smem = (size_t)stages * stage;
                        RK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
                        unsigned long long per = (len + stage - 1) / stage;
                        unsigned grid = (unsigned)std::min<unsigned long long>(per * n, (unsigned long long)sms * per_sm);
                        RK(cudaMemsetAsync((void *)y, 0, S, stream));
                        double ms = time_it([&] { kern<<<grid, 32, smem, stream>>>(dc, n, stage, per); });
                        if (check(kname))
                                row(kname, ms);
                };
                bulk(copy_bulk<4>, 4, 32 * 1024, 1, "bulk 4x32K, 1/SM");
                bulk(copy_bulk<4>, 4, 16 * 1024, 2, "bulk 4x16K, 2/SM");
                bulk(copy_bulk<4>, 4, 16 * 1024, 3, "bulk 4x16K, 3/SM");
                bulk(copy_bulk<8>, 8, 16 * 1024, 1, "bulk 8x16K, 1/SM");
                bulk(copy_bulk2<4>, 4, 32 * 1024, 1, "bulk2 4x32K, 1/SM");
                bulk(copy_bulk2<6>, 6, 32 * 1024, 1, "bulk2 6x32K, 1/SM");
                bulk(copy_bulk2<4>, 4, 16 * 1024, 3, "bulk2 4x16K, 3/SM");
                bulk(copy_bulk2<8>, 8, 8 * 1024, 3, "bulk2 8x8K, 3/SM");
#endif
        }
        printf("done\n");
        return 0;
}
