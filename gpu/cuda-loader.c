/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "cuda-loader.h"
#include "log.h"

typedef CUresult (*GetProcAddressV2)(const char *symbol, void **pfn, int version,
                                     uint64_t flags, int *status);
typedef CUresult (*GetProcAddressV1)(const char *symbol, void **pfn, int version,
                                     uint64_t flags);

int cuda_result_to_errno(CUresult r) {
        switch (r) {
        case CUDA_SUCCESS:
                return 0;
        case CUDA_ERROR_INVALID_VALUE:
        case CUDA_ERROR_INVALID_CONTEXT:
                return -EINVAL;
        case CUDA_ERROR_OUT_OF_MEMORY:
                return -ENOMEM;
        case CUDA_ERROR_NOT_INITIALIZED:
        case CUDA_ERROR_DEINITIALIZED:
                return -ENXIO;
        case CUDA_ERROR_NO_DEVICE:
        case CUDA_ERROR_INVALID_DEVICE:
        case CUDA_ERROR_STUB_LIBRARY:
                return -ENODEV;
        case CUDA_ERROR_INSUFFICIENT_DRIVER:
        case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
        case CUDA_ERROR_NOT_SUPPORTED:
        case CUDA_ERROR_PEER_ACCESS_UNSUPPORTED:
                return -EOPNOTSUPP;
        case CUDA_ERROR_INVALID_IMAGE:
        case CUDA_ERROR_NO_BINARY_FOR_GPU:
        case CUDA_ERROR_INVALID_PTX:
                return -ENOEXEC;
        case CUDA_ERROR_ALREADY_MAPPED:
                return -EBUSY;
        case CUDA_ERROR_NOT_MAPPED:
        case CUDA_ERROR_NOT_FOUND:
        case CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
                return -ENOENT;
        case CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
        case CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                return -EEXIST;
        case CUDA_ERROR_INVALID_HANDLE:
                return -EBADF;
        case CUDA_ERROR_NOT_READY:
                return -EAGAIN;
        case CUDA_ERROR_ILLEGAL_ADDRESS:
                return -EFAULT;
        case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
                return -ENOSPC;
        case CUDA_ERROR_NOT_PERMITTED:
                return -EPERM;
        case CUDA_ERROR_TIMEOUT:
                return -ETIMEDOUT;
        case CUDA_ERROR_OPERATING_SYSTEM:
        case CUDA_ERROR_LAUNCH_FAILED:
        default:
                return -EIO;
        }
}

static const struct {
        CUresult r;
        const char *name;
} builtin_names[] = {
        { CUDA_SUCCESS, "CUDA_SUCCESS" },
        { CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE" },
        { CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY" },
        { CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED" },
        { CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE" },
        { CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE" },
        { CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED" },
        { CUDA_ERROR_ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS" },
};

const char *cuda_result_name(const CudaDriver *d, CUresult r) {
        const char *s = NULL;

        if (d && d->cuGetErrorName && d->cuGetErrorName(r, &s) == CUDA_SUCCESS && s)
                return s;
        for (size_t i = 0; i < ELEMENTSOF(builtin_names); i++)
                if (builtin_names[i].r == r)
                        return builtin_names[i].name;
        return "CUDA_ERROR_(unknown)";
}

const char *cuda_absence_to_string(int error) {
        switch (-abs(error)) {
        case 0:
                return "CUDA driver loaded";
        case -ENOENT:
                return "no GPU: the NVIDIA driver (libcuda.so.1) is not installed";
        case -ENODEV:
                return "no GPU: the NVIDIA driver reports no CUDA device";
        case -EOPNOTSUPP:
                return "no GPU support: the NVIDIA driver is too old (CUDA 12.0 or newer needed)";
        default:
                return "the CUDA driver failed to initialize";
        }
}

int cuda_check(const CudaDriver *d, CUresult r, const char *what) {
        if (r == CUDA_SUCCESS)
                return 0;
        int e = cuda_result_to_errno(r);
        log_debug("%s: %s (%d)", what, cuda_result_name(d, r), r);
        return e;
}

CudaDriver *cuda_driver_close(CudaDriver *d) {
        if (!d)
                return NULL;
        /* The driver stays initialized for the process: libcuda has no cuFini, and
         * unloading it while contexts exist is not supported; dlclose only drops our
         * reference to the library. */
        if (d->dl)
                dlclose(d->dl);
        free(d);
        return NULL;
}

int cuda_driver_open(const char *library, CudaDriver **ret) {
        _cleanup_(cuda_driver_closep) CudaDriver *d = NULL;
        GetProcAddressV2 gpa2;
        GetProcAddressV1 gpa1 = NULL;
        int r;

        d = calloc(1, sizeof *d);
        if (!d)
                return -ENOMEM;

        d->dl = dlopen(library ?: "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!d->dl) {
                log_debug("dlopen(%s): %s", library ?: "libcuda.so.1", dlerror());
                return -ENOENT;
        }

        gpa2 = (GetProcAddressV2)dlsym(d->dl, "cuGetProcAddress_v2");
        if (!gpa2)
                gpa1 = (GetProcAddressV1)dlsym(d->dl, "cuGetProcAddress");
        if (!gpa2 && !gpa1) {
                log_debug("libcuda has no cuGetProcAddress: driver older than CUDA 11.3");
                return -EOPNOTSUPP;
        }

#define EPD_CUDA_RESOLVE(name, params)                                                   \
        {                                                                                \
                void *p_ = NULL;                                                         \
                int status_ = 0;                                                         \
                CUresult cr_ = gpa2 ? gpa2(#name, &p_, EPD_CUDA_API_VERSION,             \
                                           CU_GET_PROC_ADDRESS_DEFAULT, &status_)        \
                                    : gpa1(#name, &p_, EPD_CUDA_API_VERSION,             \
                                           CU_GET_PROC_ADDRESS_DEFAULT);                 \
                if (cr_ != CUDA_SUCCESS || !p_) {                                        \
                        log_debug("cuGetProcAddress(%s): %d/%d", #name, cr_, status_);   \
                        return -EOPNOTSUPP;                                              \
                }                                                                        \
                memcpy(&d->name, &p_, sizeof p_);                                        \
        }
        EPD_CUDA_FUNCTIONS(EPD_CUDA_RESOLVE)
#undef EPD_CUDA_RESOLVE

        r = CU(d, cuDriverGetVersion, &d->driver_version);
        if (r < 0)
                return r;
        if (d->driver_version < EPD_CUDA_API_VERSION)
                return -EOPNOTSUPP;

        /* Optional ones: only where the driver is new enough for the declared version. */
#define EPD_CUDA_RESOLVE_OPT(name, version, params)                                      \
        if (d->driver_version >= (version)) {                                            \
                void *p_ = NULL;                                                         \
                int status_ = 0;                                                         \
                CUresult cr_ = gpa2 ? gpa2(#name, &p_, (version),                        \
                                           CU_GET_PROC_ADDRESS_DEFAULT, &status_)        \
                                    : gpa1(#name, &p_, (version),                        \
                                           CU_GET_PROC_ADDRESS_DEFAULT);                 \
                if (cr_ == CUDA_SUCCESS && p_)                                           \
                        memcpy(&d->name, &p_, sizeof p_);                                \
        }
        EPD_CUDA_OPTIONAL_FUNCTIONS(EPD_CUDA_RESOLVE_OPT)
#undef EPD_CUDA_RESOLVE_OPT

        r = CU(d, cuInit, 0);
        if (r == -ENODEV)
                return -ENODEV;
        if (r < 0)
                return r;
        r = CU(d, cuDeviceGetCount, &d->n_devices);
        if (r < 0)
                return r;
        if (d->n_devices <= 0)
                return -ENODEV;

        *ret = TAKE_PTR(d);
        return 0;
}
