/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The GPU domain without a GPU: the run-time loader reports absence cleanly (no
 * library, a driver without a device, an old driver), CUresult maps to errno, the
 * declared ABI layouts match the driver's, and the pure planning of GPU arenas, copy
 * paths and pack/unpack is right. With the fake driver's "gpu" mode (device memory that
 * is host memory), the GPU domain's logic runs too: arenas exported and imported by fd,
 * the CUDA transport's validation, copies and completions, registered external memory,
 * error propagation. The real GPU is tested on the device machine
 * (bench/gpu/run-device.sh). */
#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "epd/epd-gpu.h"
#include "transport/cuda.h"
#include "cuda-loader.h"
#include "gpu/gpu-domain.h"
#include "pack.h"
#include "system.h"
#include "vmm.h"
#include "fake-gpu.h"

/* The layouts of cuda.h (CUDA 12.0 – 13.0) on LP64. */
_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc");
_Static_assert(offsetof(CUmemAllocationProp, location) == 8, "prop.location");
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "prop.win32");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "prop.allocFlags");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp");
_Static_assert(sizeof(GpuChunk) == 24, "GpuChunk matches EpdChunk in pack.cu");
/* CUDA_MEMCPY2D_v2 as in cuda.h (x86-64 and aarch64). */
_Static_assert(offsetof(CUDA_MEMCPY2D, srcMemoryType) == 16, "2d.srcMemoryType");
_Static_assert(offsetof(CUDA_MEMCPY2D, srcDevice) == 32, "2d.srcDevice");
_Static_assert(offsetof(CUDA_MEMCPY2D, srcPitch) == 48, "2d.srcPitch");
_Static_assert(offsetof(CUDA_MEMCPY2D, dstMemoryType) == 72, "2d.dstMemoryType");
_Static_assert(offsetof(CUDA_MEMCPY2D, dstDevice) == 88, "2d.dstDevice");
_Static_assert(offsetof(CUDA_MEMCPY2D, dstPitch) == 104, "2d.dstPitch");
_Static_assert(offsetof(CUDA_MEMCPY2D, WidthInBytes) == 112, "2d.WidthInBytes");
_Static_assert(sizeof(CUDA_MEMCPY2D) == 128, "CUDA_MEMCPY2D");

START_TEST(test_no_library) {
        CudaDriver *d = (CudaDriver *)0x1;
        GpuSystem *s = NULL;
        GpuContext *g = NULL;

        ck_assert_int_eq(cuda_driver_open("/nonexistent/libcuda.so.1", &d), -ENOENT);
        ck_assert_ptr_eq(d, (CudaDriver *)0x1); /* untouched on failure */
        ck_assert_ptr_nonnull(strstr(cuda_absence_to_string(-ENOENT), "no GPU"));
        ck_assert_int_eq(gpu_system_open("/nonexistent/libcuda.so.1", &s), -ENOENT);
        ck_assert_ptr_null(s);
        ck_assert_int_eq(gpu_context_new("/nonexistent/libcuda.so.1", &g), -ENOENT);
        ck_assert_ptr_null(g);
}
END_TEST

START_TEST(test_not_a_driver) {
        CudaDriver *d = NULL;

        /* A library that loads but is no CUDA driver. */
        ck_assert_int_eq(cuda_driver_open("libm.so.6", &d), -EOPNOTSUPP);
        ck_assert_ptr_null(d);
        ck_assert_ptr_nonnull(strstr(cuda_absence_to_string(-EOPNOTSUPP), "too old"));
}
END_TEST

START_TEST(test_fake_driver_modes) {
        static const struct {
                const char *mode;
                int error;
        } cases[] = {
                { "nodevice", -ENODEV },
                { "zero", -ENODEV },
                { "old", -EOPNOTSUPP },
                { "missing", -EOPNOTSUPP },
        };

        for (size_t i = 0; i < ELEMENTSOF(cases); i++) {
                CudaDriver *d = NULL;
                GpuContext *g = NULL;

                ck_assert_int_eq(setenv("FAKE_CUDA_MODE", cases[i].mode, 1), 0);
                ck_assert_int_eq(cuda_driver_open(fake(), &d), cases[i].error);
                ck_assert_ptr_null(d);
                ck_assert_int_eq(gpu_context_new(fake(), &g), cases[i].error);
                ck_assert_ptr_null(g);
        }
        ck_assert_ptr_nonnull(strstr(cuda_absence_to_string(-ENODEV), "no CUDA device"));
}
END_TEST

START_TEST(test_real_driver_if_any) {
        CudaDriver *d = NULL;
        int r = cuda_driver_open(NULL, &d);

        /* Whatever this machine has, the answer is clean: a driver, or a named absence. */
        ck_assert_msg(r == 0 || r == -ENOENT || r == -ENODEV || r == -EOPNOTSUPP,
                      "unexpected %d", r);
        if (r == 0) {
                ck_assert_int_gt(d->n_devices, 0);
                ck_assert_int_ge(d->driver_version, EPD_CUDA_API_VERSION);
        }
        cuda_driver_close(d);
}
END_TEST

START_TEST(test_result_to_errno) {
        ck_assert_int_eq(cuda_result_to_errno(CUDA_SUCCESS), 0);
        ck_assert_int_eq(cuda_result_to_errno(CUDA_ERROR_INVALID_VALUE), -EINVAL);
        ck_assert_int_eq(cuda_result_to_errno(CUDA_ERROR_OUT_OF_MEMORY), -ENOMEM);
        ck_assert_int_eq(cuda_result_to_errno(CUDA_ERROR_NO_DEVICE), -ENODEV);
        ck_assert_int_eq(cuda_result_to_errno(CUDA_ERROR_NOT_SUPPORTED), -EOPNOTSUPP);
        ck_assert_int_eq(cuda_result_to_errno(CUDA_ERROR_NOT_PERMITTED), -EPERM);
        ck_assert_int_eq(cuda_result_to_errno(CUDA_ERROR_ILLEGAL_ADDRESS), -EFAULT);
        ck_assert_int_eq(cuda_result_to_errno(CUDA_ERROR_NOT_READY), -EAGAIN);
        ck_assert_int_eq(cuda_result_to_errno(CUDA_ERROR_NO_BINARY_FOR_GPU), -ENOEXEC);
        ck_assert_int_eq(cuda_result_to_errno(12345), -EIO);
        for (int r = 1; r < 1000; r++)
                ck_assert_int_lt(cuda_result_to_errno(r), 0);
        ck_assert_str_eq(cuda_result_name(NULL, CUDA_ERROR_OUT_OF_MEMORY), "CUDA_ERROR_OUT_OF_MEMORY");
        ck_assert_ptr_nonnull(cuda_result_name(NULL, 4242));
}
END_TEST

START_TEST(test_size_round) {
        uint64_t v;

        ck_assert_int_eq(gpu_arena_size_round(1, 2 << 20, &v), 0);
        ck_assert_uint_eq(v, 2 << 20);
        ck_assert_int_eq(gpu_arena_size_round(4 << 20, 2 << 20, &v), 0);
        ck_assert_uint_eq(v, 4 << 20);
        ck_assert_int_eq(gpu_arena_size_round((4 << 20) + 1, 2 << 20, &v), 0);
        ck_assert_uint_eq(v, 6 << 20);
        ck_assert_int_eq(gpu_arena_size_round(0, 2 << 20, &v), -EINVAL);
        ck_assert_int_eq(gpu_arena_size_round(10, 0, &v), -EINVAL);
        ck_assert_int_eq(gpu_arena_size_round(10, 3 << 20, &v), -EINVAL);
        ck_assert_int_eq(gpu_arena_size_round(UINT64_MAX - 5, 2 << 20, &v), -ERANGE);
}
END_TEST

START_TEST(test_pack_plan) {
        uint64_t pages[] = { 3 * 4096, 0, 7 * 4096, 1 * 4096 };
        GpuChunk c[4];

        ck_assert_int_eq(gpu_pack_plan(0x10000000, pages, 4, 512, 1024, 0x20000000, c), 0);
        for (size_t i = 0; i < 4; i++) {
                ck_assert_uint_eq(c[i].src, 0x10000000 + pages[i] + 512);
                ck_assert_uint_eq(c[i].dst, 0x20000000 + i * 1024);
                ck_assert_uint_eq(c[i].len, 1024);
        }
        ck_assert_uint_eq(gpu_chunks_bytes(c, 4), 4096);
        gpu_chunks_reverse(c, 4);
        ck_assert_uint_eq(c[2].src, 0x20000000 + 2 * 1024);
        ck_assert_uint_eq(c[2].dst, 0x10000000 + 7 * 4096 + 512);
        ck_assert_int_eq(gpu_pack_plan(UINT64_MAX - 10, pages, 4, 0, 1024, 0, c), -ERANGE);
        ck_assert_int_eq(gpu_pack_plan(0, NULL, 3, 0, 1, 0, c), -EINVAL);
        ck_assert_int_eq(gpu_pack_plan(0, NULL, 0, 0, 1, 0, NULL), 0);
}
END_TEST

START_TEST(test_coalesce) {
        GpuChunk c[] = {
                { 0, 1000, 100 },   /* merges with the next two */
                { 100, 1100, 50 },
                { 150, 1150, 0 },   /* empty: dropped */
                { 150, 1150, 10 },
                { 500, 2000, 10 },  /* src gap */
                { 510, 2020, 10 },  /* dst gap */
                { 520, 2030, 10 },  /* merges */
        };
        size_t n = gpu_chunks_coalesce(c, ELEMENTSOF(c));

        ck_assert_uint_eq(n, 3);
        ck_assert_uint_eq(c[0].src, 0);
        ck_assert_uint_eq(c[0].len, 160);
        ck_assert_uint_eq(c[1].src, 500);
        ck_assert_uint_eq(c[1].len, 10);
        ck_assert_uint_eq(c[2].src, 510);
        ck_assert_uint_eq(c[2].len, 20);
        ck_assert_uint_eq(gpu_chunks_coalesce(c, 0), 0);
}
END_TEST

/* The transport's merging of writes that continue each other, and the kernel policy. */
START_TEST(test_segs_coalesce) {
        GpuArena x = {}, y = {};
        uint8_t host[64];
        GpuCopySeg s[] = {
                { .src = &x, .dst = &y, .src_offset = 0, .dst_offset = 4096, .length = 2048 },
                { .src = &x, .dst = &y, .src_offset = 2048, .dst_offset = 6144, .length = 2048 }, /* merges */
                { .src = &x, .dst = &y, .src_offset = 4096, .dst_offset = 0, .length = 2048 },    /* dst gap */
                { .src = &x, .dst = &x, .src_offset = 4096, .dst_offset = 2048, .length = 2048 }, /* other dst */
                { .src = &x, .dst = &x, .src_offset = 6144, .dst_offset = 4096, .length = 2048 }, /* would overlap */
                { .src = &x, .dst_host = host, .src_offset = 10240, .dst_offset = 0, .length = 32 },
                { .src = &x, .dst_host = host, .src_offset = 10272, .dst_offset = 32, .length = 32 }, /* merges */
        };
        size_t n = gpu_copy_segs_coalesce(s, ELEMENTSOF(s));
        ck_assert_uint_eq(n, 5);
        ck_assert_uint_eq(s[0].length, 4096);
        ck_assert_uint_eq(s[1].src_offset, 4096);
        ck_assert_ptr_eq(s[2].dst, &x);
        ck_assert_uint_eq(s[2].length, 2048);
        ck_assert_uint_eq(s[3].src_offset, 6144);
        ck_assert_uint_eq(s[3].length, 2048);
        ck_assert_ptr_eq(s[4].dst_host, host);
        ck_assert_uint_eq(s[4].length, 64);
        ck_assert_uint_eq(gpu_copy_segs_coalesce(s, 0), 0);

        /* A peer group lands on device 0 from devices 1 and 2; device 0 reaches 1 only:
         * a kernel on 0 would read device 2's memory without peer access (a fault that
         * ends the context), so the group is not the kernel's. */
        bool peer[9] = { [0 * 3 + 1] = true, [1 * 3 + 0] = true, [2 * 3 + 0] = true };
        GpuSystem sys = { .n_devices = 3, .peer = peer };
        GpuArena d0 = { .ordinal = 0 }, d1 = { .ordinal = 1 }, d2 = { .ordinal = 2 };
        GpuCopySeg pg[] = {
                { .src = &d1, .dst = &d0, .length = 64 },
                { .src = &d1, .dst = &d0, .src_offset = 64, .length = 64 },
                { .src = &d2, .dst = &d0, .length = 64 },
        };
        size_t order[] = { 2, 0, 1 };
        ck_assert(gpu_copy_sources_reachable(&sys, 0, pg, NULL, 2));
        ck_assert(!gpu_copy_sources_reachable(&sys, 0, pg, NULL, 3)); /* the first two reachable, the third not */
        ck_assert(!gpu_copy_sources_reachable(&sys, 0, pg, order, 3));
        ck_assert(gpu_copy_sources_reachable(&sys, 0, pg, order + 1, 2));
        ck_assert(gpu_copy_sources_reachable(&sys, 2, pg, order, 1)); /* its own memory */
        ck_assert(!gpu_copy_sources_reachable(&sys, 1, pg, order, 1));
        GpuCopySeg from_host = { .src_host = host, .dst = &d0, .length = 64 };
        ck_assert(!gpu_copy_sources_reachable(&sys, 0, &from_host, NULL, 1));

        ck_assert(!gpu_copy_kernel_wanted(GPU_COPY_KERNEL_NEVER, 16, 1000, 1000 << 20));
        ck_assert(gpu_copy_kernel_wanted(GPU_COPY_KERNEL_ALWAYS, 16, 16, 16ULL << 30));
        ck_assert(!gpu_copy_kernel_wanted(GPU_COPY_KERNEL_ALWAYS, 16, 15, 15));
        ck_assert(gpu_copy_kernel_wanted(GPU_COPY_KERNEL_SMALL, 16, 4096, 4096ULL << 21));   /* 2 MiB each */
        ck_assert(!gpu_copy_kernel_wanted(GPU_COPY_KERNEL_SMALL, 16, 16, 16 * (16ULL << 20))); /* 16 MiB each */
        ck_assert(!gpu_copy_kernel_wanted(GPU_COPY_KERNEL_SMALL, 16, 0, 0));
        ck_assert_str_eq(gpu_copy_kernel_policy_to_string(GPU_COPY_KERNEL_SMALL), "small");
        ck_assert_int_eq(gpu_copy_kernel_policy_from_string("always"), GPU_COPY_KERNEL_ALWAYS);
        ck_assert_int_eq(gpu_copy_kernel_policy_from_string("sometimes"), -EINVAL);
}
END_TEST

START_TEST(test_grid) {
        unsigned gx, gy;

        gpu_chunks_grid(1, 1ULL << 30, 132, &gx, &gy);
        ck_assert_uint_eq(gy, 1);
        ck_assert_uint_eq(gx, (1U << 30) / GPU_CHUNK_TILE);
        gpu_chunks_grid(4096, GPU_CHUNK_TILE, 132, &gx, &gy);
        ck_assert_uint_eq(gy, 4096);
        ck_assert_uint_eq(gx, 1);
        gpu_chunks_grid(4096, 4 * GPU_CHUNK_TILE + 16, 132, &gx, &gy); /* a partial last tile */
        ck_assert_uint_eq(gx, 5);
        gpu_chunks_grid(100000, 16, 132, &gx, &gy);
        ck_assert_uint_eq(gy, 65535);
        ck_assert_uint_eq(gx, 1);
        gpu_chunks_grid(0, 0, 0, &gx, &gy);
        ck_assert(gpu_chunks_uniform((GpuChunk[]) { { 16, 32, 4096 }, { 8192, 64, 4096 } }, 2));
        ck_assert(!gpu_chunks_uniform((GpuChunk[]) { { 16, 32, 4096 }, { 8192, 64, 4080 } }, 2));
        ck_assert(!gpu_chunks_uniform((GpuChunk[]) { { 16, 32, 4096 }, { 8193, 64, 4096 } }, 2));
        ck_assert(!gpu_chunks_uniform((GpuChunk[]) { { 16, 32, 0 } }, 1));
        ck_assert(!gpu_chunks_uniform(NULL, 0));
        ck_assert_uint_ge(gx, 1);
        ck_assert_uint_ge(gy, 1);
}
END_TEST

START_TEST(test_copy_path) {
        bool peer[] = { false, true, false, false };
        GpuSystem s = { .n_devices = 2, .peer = peer };
        GpuArena a0 = { .ordinal = 0, .size = 1 << 20 }, a1 = { .ordinal = 1, .size = 1 << 20 };
        char host[16];

        ck_assert_int_eq(gpu_copy_path(&s, &(GpuCopySeg) { .src = &a0, .dst = &a0 }), GPU_COPY_SAME_GPU);
        ck_assert_int_eq(gpu_copy_path(&s, &(GpuCopySeg) { .src = &a0, .dst = &a1 }), GPU_COPY_PEER);
        ck_assert_int_eq(gpu_copy_path(&s, &(GpuCopySeg) { .src = &a1, .dst_host = host }), GPU_COPY_D2H);
        ck_assert_int_eq(gpu_copy_path(&s, &(GpuCopySeg) { .src_host = host, .dst = &a1 }), GPU_COPY_H2D);
        ck_assert_int_lt(gpu_copy_path(&s, &(GpuCopySeg) { .src_host = host, .dst_host = host }), 0);
        ck_assert_int_lt(gpu_copy_path(&s, &(GpuCopySeg) { .src = &a0 }), 0);
        ck_assert(gpu_system_can_access_peer(&s, 0, 1));
        ck_assert(!gpu_system_can_access_peer(&s, 1, 0));
        ck_assert(gpu_system_can_access_peer(&s, 1, 1));
        ck_assert(!gpu_system_can_access_peer(&s, 0, 2));
        ck_assert(!gpu_system_can_access_peer(&s, -1, 0));
        ck_assert_str_eq(gpu_copy_path_to_string(GPU_COPY_PEER), "peer");
        ck_assert_ptr_null(gpu_copy_path_to_string(_GPU_COPY_PATH_MAX));
        ck_assert(gpu_arena_range_ok(&a0, 0, 1 << 20));
        ck_assert(!gpu_arena_range_ok(&a0, 1, 1 << 20));
        ck_assert(!gpu_arena_range_ok(&a0, UINT64_MAX, 2));
}
END_TEST

START_TEST(test_format) {
        bool peer[] = { false, true, true, false };
        GpuDevice dev[2] = {
                { .ordinal = 0, .name = "Fake A", .pci_bus_id = "0000:19:00.0", .vmm = true },
                { .ordinal = 1, .name = "Fake B", .pci_bus_id = "0000:3b:00.0" },
        };
        GpuSystem s = { .n_devices = 2, .devices = dev, .peer = peer };
        char *text = NULL;

        ck_assert_int_eq(gpu_system_format(&s, &text), 0);
        ck_assert_ptr_nonnull(strstr(text, "0000:19:00.0"));
        ck_assert_ptr_nonnull(strstr(text, "0000:3b:00.0"));
        ck_assert_ptr_nonnull(strstr(text, "peer access"));
        free(text);
}
END_TEST

START_TEST(test_kernels_built) {
#if HAVE_CUDA_KERNELS
        /* nvcc was found: the fatbin is embedded (fatbin magic 0xba55ed50). */
        ck_assert_uint_gt(epd_pack_fatbin_size, 16);
        ck_assert_uint_eq(epd_pack_fatbin[0], 0x50);
        ck_assert_uint_eq(epd_pack_fatbin[1], 0xed);
        ck_assert_uint_eq(epd_pack_fatbin[2], 0x55);
        ck_assert_uint_eq(epd_pack_fatbin[3], 0xba);
#else
        ck_assert_uint_eq(epd_pack_fatbin_size, 0);
#endif
}
END_TEST


/* ---- the fake GPU ---- */

START_TEST(test_fake_system) {
        GpuSystem *s = NULL;
        char *text = NULL;

        fake_gpu(false);
        ck_assert_int_eq(gpu_system_open(fake(), &s), 0);
        ck_assert_uint_eq(s->n_devices, 1);
        ck_assert_str_eq(s->devices[0].pci_bus_id, "0000:ab:00.0"); /* lower-cased */
        ck_assert(s->devices[0].vmm && s->devices[0].posix_fd);
        ck_assert_uint_eq(s->devices[0].granularity, 2 << 20);
        ck_assert_int_eq(gpu_system_format(s, &text), 0);
        ck_assert_ptr_nonnull(strstr(text, "Fake GPU"));
        free(text);
        gpu_system_unref(s);
}
END_TEST

/* A process makes a GPU's context only when it uses that GPU: on a host of four, the
 * one it works on, not the three it can see beside it (a context takes hundreds of
 * MiB of each GPU's memory). Threads that race for it take one reference. */
START_TEST(test_fake_contexts_on_use) {
        GpuSystem *s = NULL;

        fake_gpu(false);
        ck_assert_int_eq(setenv("FAKE_CUDA_DEVICES", "4", 1), 0);
        ck_assert_int_eq(gpu_system_open(fake(), &s), 0);
        ck_assert_uint_eq(s->n_devices, 4);
        void *lib = dlopen(fake(), RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        int (*retained)(int) = (int (*)(int))dlsym(lib, "fake_cuda_retained");
        ck_assert_ptr_nonnull(retained);
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(retained(i), 0);
        ck_assert_int_eq(gpu_device_make_current(s, &s->devices[2]), 0);
        ck_assert_ptr_nonnull(gpu_device_ctx(s, &s->devices[2]));
        ck_assert_int_eq(gpu_device_make_current(s, &s->devices[2]), 0);
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(retained(i), i == 2);
        gpu_system_unref(s);
        ck_assert_int_eq(retained(2), 0);
        dlclose(lib);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_DEVICES"), 0);
}
END_TEST

/* A copy engine (epdd's) takes a GPU's context, streams and kernels only when it first
 * copies there or is told that it will: on a host of four whose arenas are on one GPU it
 * holds nothing of the other three. Pinning host memory, with no context current on the
 * thread, borrows one the process holds. */
START_TEST(test_fake_engine_lanes_on_use) {
        GpuSystem *s = NULL;
        GpuCopyEngine *e = NULL;
        GpuArena *a = NULL;
        GpuCopyDone done;
        static char host[16384];

        fake_gpu(false);
        ck_assert_int_eq(setenv("FAKE_CUDA_DEVICES", "4", 1), 0);
        ck_assert_int_eq(gpu_system_open(fake(), &s), 0);
        void *lib = dlopen(fake(), RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        int (*retained)(int) = (int (*)(int))dlsym(lib, "fake_cuda_retained");
        ck_assert_ptr_nonnull(retained);

        ck_assert_int_eq(gpu_copy_engine_new(s, &e), 0);
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(retained(i), 0);
        ck_assert_int_eq(gpu_arena_new(s, 2, 4 << 20, &a), 0);
        ck_assert_int_eq(s->driver->cuCtxSetCurrent(NULL), CUDA_SUCCESS);
        ck_assert_int_eq(gpu_host_register(s, host, sizeof host), 0);
        memset(host, 0x5a, sizeof host);
        GpuCopySeg segs[2] = {
                { .src_host = host, .dst = a, .dst_offset = 0, .length = sizeof host },
                { .src = a, .dst = a, .src_offset = 0, .dst_offset = 2 << 20, .length = sizeof host },
        };
        /* A host offset and length whose sum wraps (each alone passed the old check of
         * host > UINTPTR_MAX - offset - length, which wrapped itself). */
        GpuCopySeg wild = { .src_host = host, .src_offset = UINT64_MAX, .dst = a, .length = 2 };
        ck_assert_int_eq(gpu_copy_submit(e, &wild, 1, 9), -ERANGE);
        ck_assert_int_eq(gpu_copy_submit(e, &segs[0], 1, 1), 0);
        ck_assert_int_eq(gpu_copy_wait(e, 5000), 1);
        ck_assert_uint_eq(gpu_copy_reap(e, &done, 1), 1);
        ck_assert_int_eq(done.error, 0);
        ck_assert_int_eq(gpu_copy_submit(e, &segs[1], 1, 2), 0);
        ck_assert_int_eq(gpu_copy_wait(e, 5000), 1);
        ck_assert_uint_eq(gpu_copy_reap(e, &done, 1), 1);
        ck_assert_int_eq(done.error, 0);
        ck_assert_int_eq(((const char *)(uintptr_t)a->base)[(2 << 20) + 100], 0x5a);
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(retained(i), i == 2);
        /* Set up ahead of use, as epdd does for each GPU it registers memory on. */
        ck_assert_int_eq(gpu_copy_engine_use_device(e, 3), 0);
        ck_assert_int_eq(gpu_copy_engine_use_device(e, 3), 0);
        ck_assert_int_eq(gpu_copy_engine_use_device(e, 4), -ENODEV);
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(retained(i), i >= 2);

        ck_assert_int_eq(gpu_host_unregister(s, host), 0);
        gpu_arena_unref(a);
        gpu_copy_engine_free(e);
        gpu_system_unref(s);
        for (int i = 0; i < 4; i++)
                ck_assert_int_eq(retained(i), 0);
        dlclose(lib);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_DEVICES"), 0);
}
END_TEST

/* The driver refuses a group's second copy as it is enqueued, the first on a stream
 * already: the job ends with the error once that stream drains, on the completion
 * thread. It was a cuStreamSynchronize on the caller's thread (epdd's loop), which
 * waited for every other job queued on that shared stream too. A refusal of the first
 * copy leaves nothing queued: an error at once, and no wait either. */
START_TEST(test_fake_part_refused_no_sync) {
        GpuSystem *s = NULL;
        GpuCopyEngine *e = NULL;
        GpuArena *a = NULL;
        GpuCopyDone done;
        static char host[65536];

        fake_gpu(false);
        ck_assert_int_eq(gpu_system_open(fake(), &s), 0);
        void *lib = dlopen(fake(), RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        unsigned long *syncs = dlsym(lib, "fake_cuda_stream_syncs");
        ck_assert_ptr_nonnull(syncs);
        ck_assert_int_eq(gpu_copy_engine_new(s, &e), 0);
        ck_assert_int_eq(gpu_arena_new(s, 0, 4 << 20, &a), 0);
        ck_assert_int_eq(gpu_host_register(s, host, sizeof host), 0);
        /* GPU to host, irregular: copied segment by segment. */
        GpuCopySeg segs[3] = {
                { .src = a, .src_offset = 0, .dst_host = host, .dst_offset = 0, .length = 4096 },
                { .src = a, .src_offset = 8192, .dst_host = host, .dst_offset = 4096, .length = 4096 },
                { .src = a, .src_offset = 20480, .dst_host = host, .dst_offset = 12288, .length = 8192 },
        };
        unsigned long before = *syncs;
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_ASYNC_AFTER", "1", 1), 0);
        int r = gpu_copy_submit(e, segs, 3, 7);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_FAIL_ASYNC_AFTER"), 0);
        ck_assert_int_eq(r, 0);
        ck_assert_uint_eq(*syncs, before);
        ck_assert_int_eq(gpu_copy_wait(e, 5000), 1);
        ck_assert_uint_eq(gpu_copy_reap(e, &done, 1), 1);
        ck_assert_uint_eq(done.cookie, 7);
        ck_assert_int_eq(done.error, -EINVAL);
        /* The first copy refused: nothing queued, the error at once, no wait. */
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_ASYNC_AFTER", "0", 1), 0);
        r = gpu_copy_submit(e, segs, 3, 8);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_FAIL_ASYNC_AFTER"), 0);
        ck_assert_int_eq(r, -EINVAL);
        ck_assert_uint_eq(*syncs, before);
        /* And the engine goes on. */
        ck_assert_int_eq(gpu_copy_submit(e, segs, 3, 9), 0);
        ck_assert_int_eq(gpu_copy_wait(e, 5000), 1);
        ck_assert_uint_eq(gpu_copy_reap(e, &done, 1), 1);
        ck_assert_int_eq(done.error, 0);
        ck_assert_int_eq(gpu_host_unregister(s, host), 0);
        gpu_arena_unref(a);
        gpu_copy_engine_free(e);
        gpu_system_unref(s);
        dlclose(lib);
}
END_TEST

START_TEST(test_fake_arena_fd) {
        GpuContext *g = NULL;
        GpuArena *imp = NULL;
        Arena *a = NULL;
        ArenaConfig c = { .name = (char *)"g0", .domain = MEMORY_GPU, .size = 3 << 20, .gpu = 0 };
        ArenaConfig bad = c;

        fake_gpu(false);
        ck_assert_int_eq(gpu_context_new(fake(), &g), 0);
        bad.gpu = 1;
        ck_assert_int_eq(gpu_context_arena_new(g, &bad, 0, &a), -ENODEV);
        bad = c;
        bad.domain = MEMORY_HOST;
        ck_assert_int_eq(gpu_context_arena_new(g, &bad, 0, &a), -EINVAL);

        ck_assert_int_eq(gpu_context_arena_new(g, &c, 7, &a), 0);
        ck_assert_uint_eq(a->size, 4 << 20); /* granularity */
        ck_assert_int_eq(a->domain, MEMORY_GPU);
        ck_assert_uint_eq(a->data_offset, 0);
        ck_assert_int_ge(a->fd, 0);
        ck_assert_int_eq(fcntl(a->fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
        ck_assert_int_eq(fcntl(a->gpu->fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
        ck_assert_ptr_eq(gpu_context_lookup(g, a->region.device_base), a->gpu);

        /* The import side (what libepd does in a worker) maps the same memory. */
        ck_assert_int_eq(gpu_arena_import(g->system, 0, a->fd, a->size, &imp), 0);
        ck_assert(!imp->owned);
        memset((void *)(uintptr_t)a->gpu->base, 0x5c, 4096);
        ck_assert_uint_eq(((uint8_t *)(uintptr_t)imp->base)[4095], 0x5c);
        /* The daemon's arena goes first: a worker's mapping keeps the memory. */
        gpu_context_arena_forget(g, a);
        a->gpu = gpu_arena_unref(a->gpu);
        ck_assert_uint_eq(((uint8_t *)(uintptr_t)imp->base)[17], 0x5c);
        gpu_arena_unref(imp);
        ck_assert_int_eq(gpu_arena_import(g->system, 0, -1, 4 << 20, &imp), -EBADF);
        ck_assert_int_eq(gpu_arena_import(g->system, 0, a->fd, 8 << 20, &imp), -EINVAL); /* larger than exported */
        ck_assert_int_eq(gpu_arena_import(g->system, 0, a->fd, 3 << 20, &imp), -EINVAL); /* not granular */
        close(a->fd);
        free(a->name);
        free(a);
        gpu_context_free(g);
}
END_TEST

START_TEST(test_fake_transport) {
        GpuContext *g = NULL;
        Transport *t;
        enum { HOST = 100, N = 64, PAGE = 4096 };
        static uint8_t host[4 << 20];
        TransportRegion hr = { .id = HOST, .domain = MEMORY_HOST, .host_base = host, .size = sizeof host };
        TransportWrite w[N];
        uint64_t seen[N];

        fake_gpu(false);
        ck_assert_int_eq(gpu_context_new(fake(), &g), 0);
        t = g->transport;
        ck_assert_int_eq(t->ops->kind, TRANSPORT_CUDA);
        Arena *a = fake_arena(g, 1, 2 << 20), *b = fake_arena(g, 2, 2 << 20);
        ck_assert_int_eq(t->ops->register_region(t, &hr), 0);
        ck_assert_int_eq(t->ops->register_region(t, &hr), -EEXIST);
        TransportRegion stray = { .id = 55, .domain = MEMORY_GPU, .device_base = 12345, .size = 10 };
        ck_assert_int_eq(t->ops->register_region(t, &stray), -ENOENT);

        for (size_t i = 0; i < sizeof host; i++)
                host[i] = (uint8_t)(i * 7 + 3);
        /* Host → a, a → b scattered pages (several streams), b → host. */
        w[0] = (TransportWrite) { .src_region = HOST, .dst_region = 1, .length = 1 << 20, .cookie = 1 };
        ck_assert_int_eq(run_writes(t, w, 1, seen), 0);
        ck_assert_uint_eq(seen[0], 1);
        gpu_copy_engine_set_d2d_streams(cuda_transport_engine(t), 4);
        gpu_copy_engine_set_batch_api(cuda_transport_engine(t), false);
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 1, .src_offset = (uint64_t)i * PAGE, .dst_region = 2,
                                          .dst_offset = (uint64_t)(N - 1 - i) * PAGE, .length = PAGE,
                                          .cookie = 1000 + (uint64_t)i };
        ck_assert_int_eq(run_writes(t, w, N, seen), 0);
        uint64_t sum = 0;
        for (int i = 0; i < N; i++)
                sum += seen[i];
        ck_assert_uint_eq(sum, N * 1000 + N * (N - 1) / 2); /* each cookie exactly once */
        memset(host + (2 << 20), 0, 1 << 20);
        w[0] = (TransportWrite) { .src_region = 2, .dst_region = HOST, .dst_offset = 2 << 20,
                                  .length = N * PAGE, .cookie = 9 };
        ck_assert_int_eq(run_writes(t, w, 1, NULL), 0);
        for (int i = 0; i < N; i++)
                ck_assert_int_eq(memcmp(host + (2 << 20) + (size_t)(N - 1 - i) * PAGE, host + (size_t)i * PAGE, PAGE), 0);
        const GpuCopyStats *st = gpu_copy_engine_stats(cuda_transport_engine(t));
        ck_assert_uint_eq(st->failures, 0);
        ck_assert_uint_eq(st->bytes_by_path[GPU_COPY_H2D], 1 << 20);
        ck_assert_uint_eq(st->bytes_by_path[GPU_COPY_SAME_GPU], N * PAGE);
        ck_assert_uint_eq(st->bytes_by_path[GPU_COPY_D2H], N * PAGE);
        /* Three paths in one batch (one (device, path) group each, in order): every
         * write done once, each path's bytes counted. */
        memset(host + (3 << 20), 0, 3 * PAGE);
        w[0] = (TransportWrite) { .src_region = HOST, .src_offset = 0, .dst_region = 1, .dst_offset = 1 << 20,
                                  .length = PAGE, .cookie = 21 };
        w[1] = (TransportWrite) { .src_region = 1, .src_offset = 1 << 20, .dst_region = 2, .dst_offset = 1 << 20,
                                  .length = PAGE, .cookie = 22 };
        w[2] = (TransportWrite) { .src_region = 2, .src_offset = 0, .dst_region = HOST, .dst_offset = 3 << 20,
                                  .length = 2 * PAGE, .cookie = 23 };
        ck_assert_int_eq(run_writes(t, w, 3, seen), 0);
        ck_assert_uint_eq(seen[0] + seen[1] + seen[2], 21 + 22 + 23);
        ck_assert_uint_eq(st->bytes_by_path[GPU_COPY_H2D], (1 << 20) + PAGE);
        ck_assert_uint_eq(st->bytes_by_path[GPU_COPY_SAME_GPU], N * PAGE + PAGE);
        ck_assert_uint_eq(st->bytes_by_path[GPU_COPY_D2H], N * PAGE + 2 * PAGE);
        ck_assert_int_eq(memcmp(host + (3 << 20), host + (size_t)(N - 1) * PAGE, PAGE), 0); /* b's page 0 */

        /* Refusals queue nothing. */
        w[0] = (TransportWrite) { .src_region = HOST, .dst_region = HOST, .length = 8 };
        ck_assert_int_eq(t->ops->post(t, NULL, w, 1), -EINVAL);
        w[0] = (TransportWrite) { .src_region = 1, .dst_region = 77, .length = 8 };
        ck_assert_int_eq(t->ops->post(t, NULL, w, 1), -ENOENT);
        w[0] = (TransportWrite) { .src_region = 1, .dst_region = 2, .dst_offset = (2 << 20) - 4, .length = 8 };
        ck_assert_int_eq(t->ops->post(t, NULL, w, 1), -ERANGE);
        w[0] = (TransportWrite) { .src_region = 1, .dst_region = 1, .src_offset = 0, .dst_offset = 4, .length = 8 };
        ck_assert_int_eq(t->ops->post(t, NULL, w, 1), -EINVAL); /* overlapping */
        w[0] = (TransportWrite) { .src_region = 1, .dst_region = 2, .length = 0 };
        ck_assert_int_eq(t->ops->post(t, NULL, w, 1), -EINVAL);
        ck_assert_int_eq(t->ops->post(t, (void *)1, w, 1), -EOPNOTSUPP);
        ck_assert_int_eq(t->ops->post(t, NULL, w, 0), -EINVAL);
        /* A good write followed by a bad one: nothing of the batch is queued. */
        w[0] = (TransportWrite) { .src_region = 1, .dst_region = 2, .length = 8 };
        w[1] = (TransportWrite) { .src_region = 1, .dst_region = 2, .src_offset = 3 << 20, .length = 8 };
        ck_assert_int_eq(t->ops->post(t, NULL, w, 2), -ERANGE);
        TransportCompletion c[4];
        ck_assert_uint_eq(t->ops->poll(t, c, 4), 0);
        ck_assert_uint_eq(gpu_copy_engine_in_flight(cuda_transport_engine(t)), 0);

        /* Kernel batching asked for, but a fake GPU has no kernels: the copy engine does it. */
        gpu_copy_engine_set_kernel_batching(cuda_transport_engine(t), true, 2);
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 2, .src_offset = (uint64_t)i * PAGE, .dst_region = 1,
                                          .dst_offset = (uint64_t)i * PAGE, .length = PAGE, .cookie = (uint64_t)i };
        ck_assert_int_eq(run_writes(t, w, N, NULL), 0);
        ck_assert_uint_eq(st->kernel_launches, 0);

        t->ops->unregister_region(t, &hr);
        fake_arena_free(g, a);
        fake_arena_free(g, b);
        gpu_context_free(g);
}
END_TEST

/* A batch larger than a part (the transport hands the engine 256 writes, then 512, ...
 * up to 4096 at a time, so that the GPU starts while the host prepares the rest; here
 * six parts): every write completes exactly
 * once, after all parts, with its bytes; a bad write anywhere refuses the whole batch
 * before any part goes; a failing copy fails every write of the batch, once. */
START_TEST(test_fake_transport_parts) {
        enum { N = 10000, PIECE = 128 };
        GpuContext *g = NULL;
        TransportWrite *w = calloc(N, sizeof *w);
        uint64_t *seen = calloc(N, sizeof *seen);
        uint8_t *hit = calloc(N, 1);

        fake_gpu(false);
        ck_assert_int_eq(gpu_context_new(fake(), &g), 0);
        Transport *t = g->transport;
        Arena *a = fake_arena(g, 1, 2 << 20), *b = fake_arena(g, 2, 2 << 20);
        uint8_t *src = (uint8_t *)(uintptr_t)a->gpu->base, *dst = (uint8_t *)(uintptr_t)b->gpu->base;
        for (size_t i = 0; i < (size_t)N * PIECE; i++)
                src[i] = (uint8_t)(i * 13 + 5);
        memset(dst, 0, (size_t)N * PIECE);
        /* Reversed on the destination: nothing coalesces. */
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 1, .src_offset = (uint64_t)i * PIECE, .dst_region = 2,
                                          .dst_offset = (uint64_t)(N - 1 - i) * PIECE, .length = PIECE,
                                          .cookie = (uint64_t)i };
        uint64_t batches = t->stats.batches, bytes = t->stats.bytes;
        ck_assert_int_eq(run_writes(t, w, N, seen), 0);
        for (int i = 0; i < N; i++) {
                ck_assert_uint_lt(seen[i], N);
                ck_assert_uint_eq(hit[seen[i]]++, 0);
        }
        for (int i = 0; i < N; i++)
                ck_assert_int_eq(memcmp(dst + (size_t)(N - 1 - i) * PIECE, src + (size_t)i * PIECE, PIECE), 0);
        ck_assert_uint_eq(t->stats.batches - batches, 1);
        ck_assert_uint_eq(t->stats.bytes - bytes, (uint64_t)N * PIECE);

        /* A bad write in the last part: refused whole, nothing queued. */
        w[N - 10].dst_offset = 3 << 20;
        ck_assert_int_eq(t->ops->post(t, NULL, w, N), -ERANGE);
        TransportCompletion c[4];
        ck_assert_uint_eq(t->ops->poll(t, c, 4), 0);
        ck_assert_uint_eq(gpu_copy_engine_in_flight(cuda_transport_engine(t)), 0);
        w[N - 10].dst_offset = 9 * PIECE;

        /* Every part's copies fail: every write fails, once. */
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", "1", 1), 0);
        uint64_t failures = t->stats.failures;
        ck_assert_int_eq(run_writes(t, w, N, NULL), -EFAULT);
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", "0", 1), 0);
        ck_assert_uint_eq(t->stats.failures - failures, N);

        fake_arena_free(g, a);
        fake_arena_free(g, b);
        gpu_context_free(g);
        free(w);
        free(seen);
        free(hit);
}
END_TEST

/* A batch's writes under one cookie complete as one completion (the handoff posts a
 * group's thousands of writes under one, and several groups' interleaved): writes counts
 * them, bytes sums them, in the order each cookie first appears; a failed batch fails
 * each cookie once, with no bytes. */
START_TEST(test_fake_transport_merged) {
        enum { N = 6000, PIECE = 64 };
        GpuContext *g = NULL;
        TransportWrite *w = calloc(N, sizeof *w);

        fake_gpu(false);
        ck_assert_int_eq(gpu_context_new(fake(), &g), 0);
        Transport *t = g->transport;
        Arena *a = fake_arena(g, 1, 2 << 20), *b = fake_arena(g, 2, 2 << 20);
        /* Runs of cookies 7 (5000 writes, over several parts), 8 (1), 7 again (999). */
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 1, .src_offset = (uint64_t)i * PIECE, .dst_region = 2,
                                          .dst_offset = (uint64_t)(N - 1 - i) * PIECE, .length = PIECE,
                                          .cookie = i == 5000 ? 8 : 7 };
        for (int fail = 0; fail <= 1; fail++) {
                ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", fail ? "1" : "0", 1), 0);
                uint64_t failures = t->stats.failures;
                ck_assert_int_eq(t->ops->post(t, NULL, w, N), 0);
                TransportCompletion c[8];
                size_t k = 0;
                while (k < 2) {
                        struct pollfd p = { .fd = t->ops->completion_fd(t), .events = POLLIN };
                        size_t m = t->ops->poll(t, c + k, ELEMENTSOF(c) - k);
                        k += m;
                        if (m == 0)
                                ck_assert_int_eq(poll(&p, 1, 5000), 1);
                }
                ck_assert_uint_eq(t->ops->poll(t, c + k, ELEMENTSOF(c) - k), 0);
                const uint64_t cookie[2] = { 7, 8 };
                const uint32_t writes[2] = { 5999, 1 };
                for (int i = 0; i < 2; i++) {
                        ck_assert_uint_eq(c[i].cookie, cookie[i]);
                        ck_assert_uint_eq(c[i].writes, writes[i]);
                        ck_assert_int_eq(c[i].error, fail ? -EFAULT : 0);
                        ck_assert_uint_eq(c[i].bytes, fail ? 0 : (uint64_t)writes[i] * PIECE);
                }
                ck_assert_uint_eq(t->stats.failures - failures, fail ? N : 0);
                ck_assert_uint_eq(gpu_copy_engine_in_flight(cuda_transport_engine(t)), 0);
        }
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", "0", 1), 0);
        fake_arena_free(g, a);
        fake_arena_free(g, b);
        gpu_context_free(g);
        free(w);
}
END_TEST

START_TEST(test_fake_copy_errors) {
        GpuContext *g = NULL;
        TransportWrite w[3];

        fake_gpu(true);
        ck_assert_int_eq(gpu_context_new(fake(), &g), 0);
        Arena *a = fake_arena(g, 1, 2 << 20), *b = fake_arena(g, 2, 2 << 20);
        for (int i = 0; i < 3; i++)
                w[i] = (TransportWrite) { .src_region = 1, .src_offset = (uint64_t)i * 4096, .dst_region = 2,
                                          .dst_offset = (uint64_t)i * 4096, .length = 4096, .cookie = (uint64_t)i };
        /* The stream reports an illegal address: every write of the batch fails, once. */
        ck_assert_int_eq(run_writes(g->transport, w, 3, NULL), -EFAULT);
        ck_assert_uint_eq(g->transport->stats.failures, 3);
        ck_assert_uint_eq(g->transport->stats.bytes, 0);
        fake_arena_free(g, a);
        fake_arena_free(g, b);
        gpu_context_free(g);
        fake_gpu(false);
}
END_TEST

START_TEST(test_fake_external) {
        GpuContext *g = NULL;
        GpuArena *own = NULL;
        GpuExternal *x = NULL, *y = NULL;
        int fd = -1;

        fake_gpu(false);
        ck_assert_int_eq(gpu_context_new(fake(), &g), 0);
        Arena *a = fake_arena(g, 1, 2 << 20);
        memset((void *)(uintptr_t)a->gpu->base, 0x77, 2 << 20);

        /* "The worker's" own allocation, exported from its device pointer. */
        ck_assert_int_eq(gpu_arena_new(g->system, 0, 4 << 20, &own), 0);
        memset((void *)(uintptr_t)own->base, 0x11, own->size);
        ck_assert_int_eq(gpu_export_allocation(g->system, own->base + 4096, &fd), 0);
        ck_assert_int_eq(fcntl(fd, F_GETFD) & FD_CLOEXEC, FD_CLOEXEC);
        ck_assert_int_eq(gpu_context_register_external(g, 0, fd, own->size, &x), 0);
        ck_assert_int_eq(gpu_context_register_external(g, 3, fd, own->size, &y), -ENODEV);
        ck_assert_uint_ge(x->region.id, GPU_EXTERNAL_REGION_BASE);
        ck_assert(!x->arena->owned);

        TransportWrite w = { .src_region = 1, .dst_region = x->region.id, .dst_offset = 1 << 20,
                             .length = 1 << 20, .cookie = 5 };
        ck_assert_int_eq(run_writes(g->transport, &w, 1, NULL), 0);
        x = gpu_external_release(x);
        /* Released: the region is gone for the daemon... */
        ck_assert_int_eq(g->transport->ops->post(g->transport, NULL, &w, 1), -ENOENT);
        /* ...and the worker's memory is intact and still its own. */
        const uint8_t *p = (const uint8_t *)(uintptr_t)own->base;
        ck_assert_uint_eq(p[0], 0x11);
        ck_assert_uint_eq(p[1 << 20], 0x77);
        ck_assert_uint_eq(p[(2 << 20) - 1], 0x77);
        ck_assert_uint_eq(p[2 << 20], 0x11);

        /* The limit. */
        GpuExternal **many = calloc(GPU_EXTERNAL_MAX, sizeof *many);
        for (unsigned i = 0; i < GPU_EXTERNAL_MAX; i++)
                ck_assert_int_eq(gpu_context_register_external(g, 0, fd, 2 << 20, &many[i]), 0);
        ck_assert_int_eq(gpu_context_register_external(g, 0, fd, 2 << 20, &y), -EDQUOT);
        for (unsigned i = 0; i < GPU_EXTERNAL_MAX; i++)
                gpu_external_release(many[i]);
        free(many);

        close(fd);
        gpu_arena_unref(own);
        fake_arena_free(g, a);
        gpu_context_free(g);
}
END_TEST

/* A batch in parts whose later part the engine refuses: the whole batch is refused up
 * front when the transport can tell (a write of length 0), and otherwise every write
 * completes under its own cookie, never one left from an earlier batch in the reused
 * arrays. */
START_TEST(test_fake_late_part_refused) {
        enum { N = 2000, PIECE = 128 };
#define ASYNC_OK "1" /* the first part is one batched copy call */
        GpuContext *g = NULL;
        TransportWrite *w = calloc(N, sizeof *w);

        fake_gpu(false);
        ck_assert_int_eq(gpu_context_new(fake(), &g), 0);
        Transport *t = g->transport;
        Arena *a = fake_arena(g, 1, 2 << 20), *b = fake_arena(g, 2, 2 << 20);
        /* A first batch with cookies 1000000 + i: its CudaBatch becomes a spare. */
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 1, .src_offset = (uint64_t)i * PIECE, .dst_region = 2,
                                          .dst_offset = (uint64_t)(N - 1 - i) * PIECE, .length = PIECE,
                                          .cookie = 1000000 + (uint64_t)i };
        ck_assert_int_eq(run_writes(t, w, N, NULL), 0);
        /* The same batch, cookies i, write 300 (second part) of length 0. */
        for (int i = 0; i < N; i++)
                w[i].cookie = (uint64_t)i;
        w[300].length = 0;
        int r = t->ops->post(t, NULL, w, N);
        ck_assert_int_eq(r, -EINVAL);
        /* An overlapping copy inside one region: refused whole as well. */
        w[300].length = PIECE;
        w[700].dst_region = 1;
        w[700].dst_offset = w[700].src_offset + PIECE / 2;
        ck_assert_int_eq(t->ops->post(t, NULL, w, N), -EINVAL);
        w[700].dst_region = 2;
        w[700].dst_offset = (uint64_t)(N - 1 - 700) * PIECE;
        /* A later part that the driver refuses as it is enqueued: the first part's copies
         * are on the GPU, so the post stands and every write completes with the error. */
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_ASYNC_AFTER", ASYNC_OK, 1), 0);
        r = t->ops->post(t, NULL, w, N);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_FAIL_ASYNC_AFTER"), 0);
        ck_assert_int_eq(r, 0);
        {
                TransportCompletion c[64];
                size_t seen = 0, stale = 0;
                while (seen < N) {
                        struct pollfd p = { .fd = t->ops->completion_fd(t), .events = POLLIN };
                        size_t k = t->ops->poll(t, c, ELEMENTSOF(c));
                        for (size_t i = 0; i < k; i++) {
                                if (c[i].cookie >= 1000000)
                                        stale += c[i].writes;
                                ck_assert_int_lt(c[i].error, 0);
                                seen += c[i].writes;
                        }
                        if (k == 0)
                                ck_assert_int_eq(poll(&p, 1, 5000), 1);
                }
                ck_assert_uint_eq(stale, 0);
        }
        fake_arena_free(g, a);
        fake_arena_free(g, b);
        gpu_context_free(g);
        free(w);
}
END_TEST

/* Unregistering a pinned host region waits for the copies in flight and reaps them into
 * the transport's ready queue: the completion fd must be readable again, or the loop
 * never hears of them. */
START_TEST(test_fake_unregister_keeps_wakeup) {
        static uint8_t host[1 << 20], host2[1 << 20];
        TransportRegion hr = { .id = 100, .domain = MEMORY_HOST, .host_base = host, .size = sizeof host };
        TransportRegion hr2 = { .id = 101, .domain = MEMORY_HOST, .host_base = host2, .size = sizeof host2 };
        GpuContext *g = NULL;

        fake_gpu(false);
        ck_assert_int_eq(gpu_context_new(fake(), &g), 0);
        Transport *t = g->transport;
        Arena *a = fake_arena(g, 1, 2 << 20), *b = fake_arena(g, 2, 2 << 20);
        ck_assert_int_eq(t->ops->register_region(t, &hr), 0);
        ck_assert_int_eq(t->ops->register_region(t, &hr2), 0);
        TransportWrite w = { .src_region = 1, .dst_region = 2, .length = 4096, .cookie = 42 };
        ck_assert_int_eq(t->ops->post(t, NULL, &w, 1), 0);
        /* Another handoff's staging buffer goes (handoff_staging_free): */
        t->ops->unregister_region(t, &hr2);
        struct pollfd p = { .fd = t->ops->completion_fd(t), .events = POLLIN };
        int readable = poll(&p, 1, 500);
        TransportCompletion c[4];
        size_t k = t->ops->poll(t, c, 4);
        ck_assert_int_eq(readable, 1);
        ck_assert_uint_eq(k, 1);
        ck_assert_uint_eq(c[0].cookie, 42);
        t->ops->unregister_region(t, &hr);
        fake_arena_free(g, a);
        fake_arena_free(g, b);
        gpu_context_free(g);
}
END_TEST

START_TEST(test_fake_libepd) {
        EpdGpu *g = NULL;
        EpdGpuMapping *m = NULL;
        GpuSystem *s = NULL;
        GpuArena *a = NULL;
        int fd = -1;

        fake_gpu(false);
        ck_assert_int_eq(setenv("EPD_LIBCUDA", fake(), 1), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        ck_assert_int_eq(epd_gpu_ordinal_from_pci_bus_id(g, "0000:AB:00.0"), 0);
        ck_assert_int_eq(epd_gpu_ordinal_from_pci_bus_id(g, "0000:01:00.0"), -ENODEV);

        ck_assert_int_eq(gpu_system_open(fake(), &s), 0);
        ck_assert_int_eq(gpu_arena_new(s, 0, 2 << 20, &a), 0);
        memset((void *)(uintptr_t)a->base, 0x42, 2 << 20);
        /* libepd leaves the caller's current context (torch's device) as it found it. */
        CUcontext mine = (CUcontext)(uintptr_t)0x77, now = NULL;
        ck_assert_int_eq(s->driver->cuCtxSetCurrent(mine), CUDA_SUCCESS);
        ck_assert_int_eq(epd_gpu_map(g, a->fd, a->size, 0, &m), 0);
        ck_assert_int_eq(s->driver->cuCtxGetCurrent(&now), CUDA_SUCCESS);
        ck_assert_ptr_eq(now, mine);
        EpdGpuPages *pg = NULL;
        uint64_t page = epd_gpu_mapping_device_pointer(m);
        ck_assert_int_eq(epd_gpu_pages_new(g, 0, &page, 1, 4096, 0, &pg), 0);
        ck_assert_int_eq(s->driver->cuCtxGetCurrent(&now), CUDA_SUCCESS);
        ck_assert_ptr_eq(now, mine);
        epd_gpu_pages_free(pg);
        ck_assert_int_eq(s->driver->cuCtxGetCurrent(&now), CUDA_SUCCESS);
        ck_assert_ptr_eq(now, mine);
        ck_assert_uint_eq(epd_gpu_mapping_size(m), 2 << 20);
        ck_assert_uint_eq(((uint8_t *)(uintptr_t)epd_gpu_mapping_device_pointer(m))[100], 0x42);
        ck_assert_int_eq(epd_gpu_export(g, epd_gpu_mapping_device_pointer(m), &fd), 0);
        close(fd);
        ck_assert_int_eq(epd_gpu_export(g, 0, &fd), -EINVAL);
        /* Closing the handle first is fine: it lives until the last mapping goes. */
        epd_gpu_close(g);
        epd_gpu_unmap(m);
        gpu_arena_unref(a);
        gpu_system_unref(s);
        ck_assert_int_eq(unsetenv("EPD_LIBCUDA"), 0);
}
END_TEST

/* A copy waits for its page table's upload whatever its stream's handle: the
 * per-thread default stream (CU_STREAM_PER_THREAD, 0x2) is one handle in every thread,
 * so a copy on it from another thread than the upload's is on another stream (the wait
 * used to be skipped for the same handle). Once the upload has completed, copies wait
 * no more. */
START_TEST(test_fake_libepd_upload_wait) {
        EpdGpu *g = NULL;
        EpdGpuMapping *m = NULL;
        EpdGpuPages *pg = NULL;
        GpuSystem *s = NULL;
        GpuArena *a = NULL;
        const uint64_t per_thread = 0x2;

        fake_gpu(false);
        ck_assert_int_eq(setenv("EPD_LIBCUDA", fake(), 1), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        ck_assert_int_eq(gpu_system_open(fake(), &s), 0);
        ck_assert_int_eq(gpu_arena_new(s, 0, 2 << 20, &a), 0);
        ck_assert_int_eq(epd_gpu_map(g, a->fd, a->size, 0, &m), 0);
        void *lib = dlopen(fake(), RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        const unsigned long *waits = dlsym(lib, "fake_cuda_stream_waits");
        ck_assert_ptr_nonnull(waits);

        uint64_t page = epd_gpu_mapping_device_pointer(m);
        uint8_t k[16], v[16], k2[16] = { 0 }, v2[16] = { 0 };
        memset(k, 0x11, sizeof k);
        memset(v, 0x22, sizeof v);
        epd_kv_rows w = { .k = (uintptr_t)k, .v = (uintptr_t)v, .tokens = 1, .heads = 1, .tokens_per_page = 1,
                          .row_bytes = 16, .k_offset = 0, .v_offset = 16 };
        epd_kv_rows rd = w;
        rd.k = (uintptr_t)k2;
        rd.v = (uintptr_t)v2;
        /* The upload's event has not completed yet (a GPU that another context holds). */
        ck_assert_int_eq(setenv("FAKE_CUDA_COPY_DELAY_MS", "2", 1), 0);
        ck_assert_int_eq(epd_gpu_pages_new(g, 0, &page, 1, 4096, per_thread, &pg), 0);
        unsigned long before = __atomic_load_n(waits, __ATOMIC_RELAXED);
        ck_assert_int_eq(epd_gpu_kv_write(pg, &w, per_thread), 0);
        ck_assert_uint_eq(__atomic_load_n(waits, __ATOMIC_RELAXED), before + 1);
        /* Completed: no copy waits any more, on any stream. */
        ck_assert_int_eq(unsetenv("FAKE_CUDA_COPY_DELAY_MS"), 0);
        ck_assert_int_eq(epd_gpu_kv_write(pg, &w, per_thread), 0);
        ck_assert_int_eq(epd_gpu_kv_read(pg, &rd, 7), 0);
        ck_assert_uint_eq(__atomic_load_n(waits, __ATOMIC_RELAXED), before + 1);
        ck_assert_int_eq(memcmp(k2, k, sizeof k), 0);
        ck_assert_int_eq(memcmp(v2, v, sizeof v), 0);
        epd_gpu_pages_free(pg);
        epd_gpu_unmap(m);
        epd_gpu_close(g);
        dlclose(lib);
        gpu_arena_unref(a);
        gpu_system_unref(s);
        ck_assert_int_eq(unsetenv("EPD_LIBCUDA"), 0);
}
END_TEST


/* A device whose context cannot be made current: a page table is freed all the same
 * (its device copy and event not leaked), and a notifier's call puts the caller's
 * context back. A closed handle is refused by the calls that take no hold of their
 * own, and a page table whose size in bytes does not fit is refused. */
START_TEST(test_fake_libepd_context_failures) {
        EpdGpu *g = NULL;
        EpdGpuPages *pg = NULL;
        EpdGpuNotifier *n = NULL;
        GpuSystem *s = NULL;
        CUcontext now = NULL, mine = (CUcontext)(uintptr_t)0x77;
        uint64_t page = 0x1000;
        int fd = -1;

        fake_gpu(false);
        ck_assert_int_eq(setenv("EPD_LIBCUDA", fake(), 1), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        ck_assert_int_eq(gpu_system_open(fake(), &s), 0); /* the same driver: the caller's view */
        void *lib = dlopen(fake(), RTLD_NOW | RTLD_NOLOAD);
        ck_assert_ptr_nonnull(lib);
        int (*live)(void) = (int (*)(void))dlsym(lib, "fake_cuda_live");
        ck_assert_ptr_nonnull(live);

        /* Overflow of the table's bytes. */
        ck_assert_int_lt(epd_gpu_pages_new(g, 0, &page, SIZE_MAX / sizeof(uint64_t) + 2, 4096, 0, &pg), 0);
        ck_assert_ptr_null(pg);

        int before = live();
        ck_assert_int_eq(epd_gpu_pages_new(g, 0, &page, 1, 4096, 0, &pg), 0);
        ck_assert_int_eq(live(), before + 2); /* the table's copy and its upload's event */
        static int not_a_ring;
        ck_assert_int_eq(epd_gpu_notifier_new(g, 0, (struct epd_ring_client *)&not_a_ring, &n), 0);

        ck_assert_int_eq(s->driver->cuCtxSetCurrent(mine), CUDA_SUCCESS);
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_CTX_SET", "1", 1), 0);
        ck_assert_int_lt(epd_gpu_notifier_ready_after(n, 0, "0123456789abcdef0123456789abcdef", 1, 0), 0);
        ck_assert_int_eq(s->driver->cuCtxGetCurrent(&now), CUDA_SUCCESS);
        ck_assert_ptr_eq(now, mine);
        epd_gpu_pages_free(pg);
        ck_assert_int_eq(live(), before);
        ck_assert_int_eq(s->driver->cuCtxGetCurrent(&now), CUDA_SUCCESS);
        ck_assert_ptr_eq(now, mine);
        ck_assert_int_eq(unsetenv("FAKE_CUDA_FAIL_CTX_SET"), 0);

        /* Closed, still held by the notifier: refused, not used. */
        epd_gpu_close(g);
        ck_assert_int_eq(epd_gpu_ordinal_from_pci_bus_id(g, "0000:AB:00.0"), -EINVAL);
        ck_assert_int_eq(epd_gpu_export(g, 0x1000, &fd), -EINVAL);
        ck_assert_int_eq(fd, -1);
        epd_gpu_notifier_free(n); /* the last holder: frees the handle */
        gpu_system_unref(s);
        dlclose(lib);
        ck_assert_int_eq(unsetenv("EPD_LIBCUDA"), 0);
}
END_TEST

/* The handle is shared by threads (a worker's copy thread and its notifier, the Python
 * sink): page tables made and freed on two threads at once leave its count right, so
 * that epd_gpu_close() frees it once the last goes (a lost update freed it early, or
 * never: ASan says which). */
static void *tables_loop(void *userdata) {
        EpdGpu *g = userdata;
        uint64_t page = 0x1000;
        for (unsigned i = 0; i < 20000; i++) {
                EpdGpuPages *pg = NULL;
                if (epd_gpu_pages_new(g, 0, &page, 1, 4096, 0, &pg) < 0)
                        return (void *)1;
                epd_gpu_pages_free(pg);
        }
        return NULL;
}

START_TEST(test_fake_libepd_threads) {
        EpdGpu *g = NULL;
        EpdGpuPages *keep = NULL;
        pthread_t t[2];
        void *ret[2];
        uint64_t page = 0x1000;

        fake_gpu(false);
        ck_assert_int_eq(setenv("EPD_LIBCUDA", fake(), 1), 0);
        ck_assert_int_eq(epd_gpu_open(&g), 0);
        ck_assert_int_eq(epd_gpu_pages_new(g, 0, &page, 1, 4096, 0, &keep), 0);
        for (unsigned i = 0; i < 2; i++)
                ck_assert_int_eq(pthread_create(&t[i], NULL, tables_loop, g), 0);
        for (unsigned i = 0; i < 2; i++) {
                ck_assert_int_eq(pthread_join(t[i], &ret[i]), 0);
                ck_assert_ptr_null(ret[i]);
        }
        epd_gpu_close(g);
        /* Closing: nothing new, and the table kept still frees (and with it the handle). */
        EpdGpuPages *late = NULL;
        ck_assert_int_eq(epd_gpu_pages_new(g, 0, &page, 1, 4096, 0, &late), -EINVAL);
        epd_gpu_pages_free(keep);
        ck_assert_int_eq(unsetenv("EPD_LIBCUDA"), 0);
}
END_TEST

static Suite *suite(void) {
        Suite *s = suite_create("gpu-loader");
        TCase *tc = tcase_create("core");

        tcase_add_test(tc, test_no_library);
        tcase_add_test(tc, test_not_a_driver);
        tcase_add_test(tc, test_fake_driver_modes);
        tcase_add_test(tc, test_real_driver_if_any);
        tcase_add_test(tc, test_result_to_errno);
        tcase_add_test(tc, test_size_round);
        tcase_add_test(tc, test_pack_plan);
        tcase_add_test(tc, test_coalesce);
        tcase_add_test(tc, test_segs_coalesce);
        tcase_add_test(tc, test_grid);
        tcase_add_test(tc, test_copy_path);
        tcase_add_test(tc, test_format);
        tcase_add_test(tc, test_kernels_built);
        tcase_add_test(tc, test_fake_system);
        tcase_add_test(tc, test_fake_contexts_on_use);
        tcase_add_test(tc, test_fake_engine_lanes_on_use);
        tcase_add_test(tc, test_fake_part_refused_no_sync);
        tcase_add_test(tc, test_fake_arena_fd);
        tcase_add_test(tc, test_fake_transport);
        tcase_add_test(tc, test_fake_transport_parts);
        tcase_add_test(tc, test_fake_transport_merged);
        tcase_add_test(tc, test_fake_copy_errors);
        tcase_add_test(tc, test_fake_external);
        tcase_add_test(tc, test_fake_libepd);
        tcase_add_test(tc, test_fake_libepd_upload_wait);
        tcase_add_test(tc, test_fake_libepd_threads);
        tcase_add_test(tc, test_fake_libepd_context_failures);
        tcase_add_test(tc, test_fake_late_part_refused);
        tcase_add_test(tc, test_fake_unregister_keeps_wakeup);
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        SRunner *sr = srunner_create(suite());
        int failed;

        srunner_run_all(sr, CK_NORMAL);
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}
