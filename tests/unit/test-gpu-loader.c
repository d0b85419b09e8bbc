/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The GPU domain without a GPU: the run-time loader reports absence cleanly (no
 * library, a driver without a device, an old driver), CUresult maps to errno, the
 * declared ABI layouts match the driver's, and the pure planning of GPU arenas, copy
 * paths and pack/unpack is right. The GPU itself is tested on the device machine
 * (bench/gpu/run-device.sh). */
#include <check.h>
#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "cuda-loader.h"
#include "gpu-domain.h"
#include "pack.h"
#include "system.h"
#include "vmm.h"

/* The layouts of cuda.h (CUDA 12.0 – 13.0) on LP64. */
_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc");
_Static_assert(offsetof(CUmemAllocationProp, location) == 8, "prop.location");
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "prop.win32");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "prop.allocFlags");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp");
_Static_assert(sizeof(GpuChunk) == 24, "GpuChunk matches EpdChunk in pack.cu");

static const char *fake(void) {
        const char *p = getenv("FAKE_LIBCUDA");
        ck_assert_msg(p, "FAKE_LIBCUDA not set (run through meson test)");
        return p;
}

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

START_TEST(test_grid) {
        unsigned gx, gy;

        gpu_chunks_grid(1, 1ULL << 30, 132, &gx, &gy);
        ck_assert_uint_eq(gy, 1);
        ck_assert_uint_eq(gx, 132 * 8);
        gpu_chunks_grid(4096, 64 << 10, 132, &gx, &gy);
        ck_assert_uint_eq(gy, 4096);
        ck_assert_uint_eq(gx, 1);
        gpu_chunks_grid(100000, 16, 132, &gx, &gy);
        ck_assert_uint_eq(gy, 65535);
        ck_assert_uint_eq(gx, 1);
        gpu_chunks_grid(0, 0, 0, &gx, &gy);
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
        tcase_add_test(tc, test_grid);
        tcase_add_test(tc, test_copy_path);
        tcase_add_test(tc, test_format);
        tcase_add_test(tc, test_kernels_built);
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
