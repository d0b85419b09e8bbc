/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* A stand-in for libcuda.so.1 in unit tests: resolves every entry point through
 * cuGetProcAddress_v2 like the real driver, and answers as FAKE_CUDA_MODE says:
 *   nodevice  cuInit fails with CUDA_ERROR_NO_DEVICE (a driver but no GPU)
 *   zero      cuInit works, cuDeviceGetCount says 0
 *   old       cuDriverGetVersion says 11.0
 *   missing   one entry point cannot be resolved */
#include <stdlib.h>
#include <string.h>

typedef int CUresult;

static const char *mode(void) {
        const char *m = getenv("FAKE_CUDA_MODE");
        return m ? m : "nodevice";
}

static CUresult fake_init(unsigned flags) {
        return strcmp(mode(), "nodevice") == 0 ? 100 : 0;
}

static CUresult fake_version(int *v) {
        *v = strcmp(mode(), "old") == 0 ? 11000 : 13000;
        return 0;
}

static CUresult fake_count(int *n) {
        *n = 0;
        return 0;
}

static CUresult fake_error_name(CUresult e, const char **s) {
        *s = e == 100 ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_FAKE";
        return 0;
}

static CUresult fake_unsupported(void) {
        return 801;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status) {
        if (status)
                *status = 0;
        if (strcmp(symbol, "cuInit") == 0)
                *pfn = (void *)fake_init;
        else if (strcmp(symbol, "cuDriverGetVersion") == 0)
                *pfn = (void *)fake_version;
        else if (strcmp(symbol, "cuDeviceGetCount") == 0)
                *pfn = (void *)fake_count;
        else if (strcmp(symbol, "cuGetErrorName") == 0)
                *pfn = (void *)fake_error_name;
        else if (strcmp(symbol, "cuLaunchKernel") == 0 && strcmp(mode(), "missing") == 0) {
                *pfn = NULL;
                return 500; /* CUDA_ERROR_NOT_FOUND */
        } else
                /* Never called by the tests: they stop at cuInit or the device count. */
                *pfn = (void *)fake_unsupported;
        return 0;
}
