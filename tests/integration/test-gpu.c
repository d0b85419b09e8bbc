/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The GPU domain through epdd, on its direct socket:
 *  - without a GPU arena configured: org.epd1.Gpu says the domain is off, introspects
 *    as dbus/org.epd1.Gpu.xml, refuses RegisterMemory with a named error, and `epdctl
 *    gpus` says so; libcuda is never loaded;
 *  - with [Arena:kvgpu] Domain=gpu on a machine without a GPU: epdd refuses to start and
 *    says "no GPU" (this runs in CI);
 *  - with a GPU (the device machine): two worker processes register through libepd and
 *    map the daemon's GPU arena (epd_gpu_arena_map); the first writes and dies without
 *    unregistering, the second reads its bytes; a worker registers its own GPU memory
 *    (RegisterMemory), releases it, registers again and dies; epdd ends up with no
 *    workers and exits cleanly. */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda-loader.h"
#include "epd/epd-gpu.h"
#include "harness.h"
#include "../check-main.h"
#include "system.h"
#include "vmm.h"

#define GPU_ARENA "[Arena:kvgpu]\nDomain=gpu\nGpu=0\nSize=256M\nUsage=kv\n"

static const epd_kv_layout kv = { .layers = 4, .tokens_per_block = 16, .k_bytes_per_token = 256,
                                  .v_bytes_per_token = 256, .dtype = "bf16" };

/* Whether this machine has a usable GPU, asked in a child so that this process never
 * initializes CUDA (its children could not use it after fork). */
static bool have_gpu(void) {
        pid_t pid = fork();
        if (pid == 0) {
                CudaDriver *d = NULL;
                _exit(cuda_driver_open(NULL, &d) == 0 ? 0 : 1);
        }
        int st;
        return pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

static bool log_contains(Harness *h, const char *needle) {
        char buf[65536];
        FILE *f = fopen(h->log, "re");
        size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
        if (f)
                fclose(f);
        buf[n] = 0;
        return strstr(buf, needle) != NULL;
}

static int run_epdctl(const char *address, const char *needle) {
        char cmd[1024];
        const char *root = getenv("BUILD_ROOT");
        snprintf(cmd, sizeof cmd, "%s/tools/epdctl -A %s gpus", root ? root : ".", address);
        FILE *p = popen(cmd, "re");
        if (!p)
                return -errno;
        char out[4096];
        size_t n = fread(out, 1, sizeof out - 1, p);
        out[n] = 0;
        int st = pclose(p);
        printf("$ epdctl gpus\n%s", out);
        return st == 0 && strstr(out, needle) ? 0 : -EBADMSG;
}

START_TEST(test_gpu_off) {
        Harness h;
        char address[512];
        epd_client *c;
        sd_bus *bus;
        int enabled = -1;

        ck_assert_int_eq(harness_init(&h, NULL), 0);
        ck_assert_int_eq(harness_start_epdd(&h, NULL), 0);
        harness_direct_address(&h, address, sizeof address);

        ck_assert_int_ge(harness_direct_bus(&h, &bus), 0);
        char xml[512];
        snprintf(xml, sizeof xml, "%s/dbus/org.epd1.Gpu.xml", getenv("SOURCE_ROOT"));
        ck_assert_int_eq(harness_check_introspection(bus, NULL, "/org/epd1", xml), 0);
        ck_assert_int_ge(sd_bus_get_property_trivial(bus, NULL, "/org/epd1", "org.epd1.Gpu", "Enabled",
                                                     NULL, 'b', &enabled), 0);
        ck_assert_int_eq(enabled, 0);
        sd_bus_flush_close_unref(bus);

        ck_assert_int_eq(epd_connect(address, &c), 0);
        /* Not registered yet: a named error. */
        ck_assert_int_lt(epd_gpu_release_memory(c, 1), 0);
        ck_assert_int_eq(epd_register(c, "prefill", "m", "cuda:0", &kv, NULL), 0);
        ck_assert_int_lt(epd_gpu_release_memory(c, 1), 0);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.NotFound");
        char pci[64];
        ck_assert_int_eq(epd_gpu_daemon_pci_bus_id(c, 0, pci, sizeof pci), -ENODEV);
        epd_disconnect(c);

        ck_assert_int_eq(run_epdctl(address, "off"), 0);
        ck_assert(!log_contains(&h, "libcuda"));
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        harness_done(&h);
}
END_TEST

/* ---- with a GPU ---- */

static void worker_write(const char *address, uint64_t seed) {
        epd_client *c = NULL;
        EpdGpu *g = NULL;
        EpdGpuMapping *m = NULL;
        GpuSystem *s = NULL;
        static uint64_t buf[1 << 17]; /* 1 MiB */
        int i;

        if (epd_connect(address, &c) < 0 || epd_register(c, "prefill", "m", "cuda:0", &kv, NULL) < 0)
                _exit(10);
        i = epd_arena_find(c, "kvgpu");
        if (i < 0 || epd_gpu_open(&g) < 0 || epd_gpu_arena_map(c, g, (size_t)i, &m) < 0)
                _exit(11);
        if (gpu_system_open(NULL, &s) < 0 || gpu_device_make_current(s, &s->devices[0]) < 0)
                _exit(12);
        for (size_t k = 0; k < ELEMENTSOF(buf); k++)
                buf[k] = seed * 1000003 + k;
        if (CU(s->driver, cuMemcpyHtoD, epd_gpu_mapping_device_pointer(m) + 4096, buf, sizeof buf) < 0 ||
            CU(s->driver, cuCtxSynchronize) < 0)
                _exit(13);
        /* Dies without unregistering or unmapping: the daemon's memory must not care. */
        _exit(0);
}

static void worker_read_and_register(const char *address, uint64_t seed) {
        epd_client *c = NULL;
        EpdGpu *g = NULL;
        EpdGpuMapping *m = NULL;
        GpuSystem *s = NULL;
        GpuArena *own = NULL;
        static uint64_t buf[1 << 17];
        uint32_t region, region2;
        int i;

        if (epd_connect(address, &c) < 0 || epd_register(c, "decode", "m", "cuda:0", &kv, NULL) < 0)
                _exit(20);
        i = epd_arena_find(c, "kvgpu");
        if (i < 0 || epd_gpu_open(&g) < 0 || epd_gpu_arena_map(c, g, (size_t)i, &m) < 0)
                _exit(21);
        if (gpu_system_open(NULL, &s) < 0 || gpu_device_make_current(s, &s->devices[0]) < 0)
                _exit(22);
        if (CU(s->driver, cuMemcpyDtoH, buf, epd_gpu_mapping_device_pointer(m) + 4096, sizeof buf) < 0)
                _exit(23);
        for (size_t k = 0; k < ELEMENTSOF(buf); k++)
                if (buf[k] != seed * 1000003 + k)
                        _exit(24);
        epd_gpu_unmap(m);

        /* Its own memory, registered with the daemon, released, registered again. */
        if (gpu_arena_new(s, 0, 64 << 20, &own) < 0)
                _exit(25);
        if (epd_gpu_register_memory(c, g, 0, own->base, own->size, &region) < 0)
                _exit(26);
        if (epd_gpu_release_memory(c, region) < 0)
                _exit(27);
        if (epd_gpu_release_memory(c, region) != -ENOENT)
                _exit(28);
        if (epd_gpu_register_memory(c, g, 0, own->base, own->size, &region2) < 0)
                _exit(29);
        /* Our memory is still ours. */
        if (CU(s->driver, cuMemsetD8, own->base, 7, own->size) < 0 || CU(s->driver, cuCtxSynchronize) < 0)
                _exit(30);
        /* Dies with the registration outstanding: the daemon drops its import. */
        _exit(0);
}

static int run_child(void (*fn)(const char *, uint64_t), const char *address, uint64_t seed) {
        pid_t pid = fork();
        if (pid == 0)
                fn(address, seed);
        int st;
        if (pid < 0 || waitpid(pid, &st, 0) != pid)
                return -errno;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static bool no_workers(void *userdata) {
        Harness *h = userdata;
        sd_bus *bus;
        if (harness_direct_bus(h, &bus) < 0)
                return false;
        int n = harness_count_workers(bus, NULL);
        sd_bus_flush_close_unref(bus);
        return n == 0;
}

START_TEST(test_gpu_arena) {
        Harness h;
        char address[512];
        bool gpu = have_gpu();

        ck_assert_int_eq(harness_init(&h, GPU_ARENA), 0);
        int r = harness_start_epdd(&h, NULL);
        if (!gpu) {
                /* No GPU here: epdd must refuse the GPU arena, clearly. */
                ck_assert_int_lt(r, 0);
                ck_assert_msg(log_contains(&h, "no GPU"), "epdd did not say 'no GPU'");
                printf("No GPU on this machine: epdd refused Domain=gpu with a clear message; "
                       "the shared-arena part runs on a GPU machine (bench/gpu/run-device.sh).\n");
                harness_done(&h);
                return;
        }
        ck_assert_int_eq(r, 0);
        harness_direct_address(&h, address, sizeof address);

        ck_assert_int_eq(run_child(worker_write, address, 42), 0);
        ck_assert_int_eq(run_child(worker_read_and_register, address, 42), 0);
        ck_assert(harness_wait_for(no_workers, &h, 5000));
        ck_assert_int_eq(run_epdctl(address, "on: CUDA driver"), 0);
        ck_assert_int_eq(run_epdctl(address, "copies: batches "), 0); /* org.epd1.Gpu.CopyCounters */
        ck_assert_int_eq(harness_stop_epdd(&h), 0);
        printf("GPU arena shared by two worker processes through epdd; external memory registered and released.\n");
        harness_done(&h);
}
END_TEST

static Suite *suite(void) {
        Suite *s = suite_create("gpu");
        TCase *tc = tcase_create("epdd");
        tcase_add_test(tc, test_gpu_off);
        tcase_add_test(tc, test_gpu_arena);
        tcase_set_timeout(tc, 120);
        suite_add_tcase(s, tc);
        return s;
}

int main(void) {
        return check_run(suite(), CK_FORK_GETENV);
}
