/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The CUDA driver API, loaded at run time with dlopen("libcuda.so.1"), so that epdd and
 * libepd run unchanged on machines without a GPU. Only the few types and constants that
 * epd uses are declared here, with the values and layouts of the driver's ABI (checked
 * with CUDA 13.0's cuda.h; tests/unit/test-gpu-loader.c asserts the struct layouts);
 * the build never needs the toolkit. Every entry point is resolved through
 * cuGetProcAddress for the API version the declarations below match, so the right
 * ABI variant (_v2, ...) is picked by the driver, never guessed by name.
 *
 * Errors: every wrapper here returns 0 or a negative errno; cuda_result_to_errno() is the
 * one place where a CUresult becomes an errno. Absence is distinct and clear:
 *   -ENOENT      no libcuda.so.1 (no NVIDIA driver installed)
 *   -ENODEV      the driver loaded but reports no GPU
 *   -EOPNOTSUPP  the driver is too old (no cuGetProcAddress, or an entry point missing)
 * cuda_absence_to_string() turns those into the sentence to log. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "macro.h"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef void (*CUstreamCallback)(CUstream stream, CUresult status, void *userdata);

enum {
        CUDA_SUCCESS = 0,
        CUDA_ERROR_INVALID_VALUE = 1,
        CUDA_ERROR_OUT_OF_MEMORY = 2,
        CUDA_ERROR_NOT_INITIALIZED = 3,
        CUDA_ERROR_DEINITIALIZED = 4,
        CUDA_ERROR_STUB_LIBRARY = 34,
        CUDA_ERROR_INSUFFICIENT_DRIVER = 35,
        CUDA_ERROR_NO_DEVICE = 100,
        CUDA_ERROR_INVALID_DEVICE = 101,
        CUDA_ERROR_INVALID_IMAGE = 200,
        CUDA_ERROR_INVALID_CONTEXT = 201,
        CUDA_ERROR_ALREADY_MAPPED = 208,
        CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
        CUDA_ERROR_NOT_MAPPED = 211,
        CUDA_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
        CUDA_ERROR_INVALID_PTX = 218,
        CUDA_ERROR_OPERATING_SYSTEM = 304,
        CUDA_ERROR_INVALID_HANDLE = 400,
        CUDA_ERROR_NOT_FOUND = 500,
        CUDA_ERROR_NOT_READY = 600,
        CUDA_ERROR_ILLEGAL_ADDRESS = 700,
        CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
        CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704,
        CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
        CUDA_ERROR_LAUNCH_FAILED = 719,
        CUDA_ERROR_NOT_PERMITTED = 800,
        CUDA_ERROR_NOT_SUPPORTED = 801,
        CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
        CUDA_ERROR_TIMEOUT = 909,
        CUDA_ERROR_UNKNOWN = 999,
};

/* CUdevice_attribute */
enum {
        CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11,
        CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
        CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33,
        CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34,
        CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40,
        CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
        CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50,
        CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
        CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110,
};

enum {
        CU_STREAM_NON_BLOCKING = 0x1,
        CU_EVENT_DEFAULT = 0x0,
        CU_EVENT_BLOCKING_SYNC = 0x1,
        CU_EVENT_DISABLE_TIMING = 0x2,
        CU_MEMHOSTREGISTER_PORTABLE = 0x01,
        CU_MEMHOSTREGISTER_DEVICEMAP = 0x02,
        CU_GET_PROC_ADDRESS_DEFAULT = 0,
};

typedef enum CUmemAllocationType {
        CU_MEM_ALLOCATION_TYPE_PINNED = 0x1,
} CUmemAllocationType;

typedef enum CUmemAllocationHandleType {
        CU_MEM_HANDLE_TYPE_NONE = 0x0,
        CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1,
} CUmemAllocationHandleType;

typedef enum CUmemLocationType {
        CU_MEM_LOCATION_TYPE_DEVICE = 0x1,
} CUmemLocationType;

typedef enum CUmemAccess_flags {
        CU_MEM_ACCESS_FLAGS_PROT_NONE = 0x0,
        CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3,
} CUmemAccess_flags;

typedef enum CUmemAllocationGranularity_flags {
        CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0,
        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 0x1,
} CUmemAllocationGranularity_flags;

typedef struct CUmemLocation {
        CUmemLocationType type;
        int id;
} CUmemLocation;

typedef struct CUmemAllocationProp {
        CUmemAllocationType type;
        CUmemAllocationHandleType requestedHandleTypes;
        CUmemLocation location;
        void *win32HandleMetaData;
        struct {
                unsigned char compressionType;
                unsigned char gpuDirectRDMACapable;
                unsigned short usage;
                unsigned char reserved[4];
        } allocFlags;
} CUmemAllocationProp;

/* For cuMemcpy2DAsync: rows of WidthInBytes, Height of them, each pitch bytes after the
 * last on its side (CUDA_MEMCPY2D_v2: size_t fields). */
typedef enum CUmemorytype {
        CU_MEMORYTYPE_HOST = 0x1,
        CU_MEMORYTYPE_DEVICE = 0x2,
} CUmemorytype;

typedef struct CUDA_MEMCPY2D {
        size_t srcXInBytes, srcY;
        CUmemorytype srcMemoryType;
        const void *srcHost;
        CUdeviceptr srcDevice;
        void *srcArray;
        size_t srcPitch;
        size_t dstXInBytes, dstY;
        CUmemorytype dstMemoryType;
        void *dstHost;
        CUdeviceptr dstDevice;
        void *dstArray;
        size_t dstPitch;
        size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;

/* For cuMemcpyBatchAsync (CUDA 12.8+, optional). */
enum {
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 0x1,
};

typedef struct CUmemcpyAttributes {
        int srcAccessOrder;
        CUmemLocation srcLocHint;
        CUmemLocation dstLocHint;
        unsigned flags;
} CUmemcpyAttributes;

typedef struct CUmemAccessDesc {
        CUmemLocation location;
        CUmemAccess_flags flags;
} CUmemAccessDesc;

/* The API version whose signatures are declared here (CUDA 12.0). */
#define EPD_CUDA_API_VERSION 12000

/* X-macro of every entry point epd uses: name, then the parameter list. */
#define EPD_CUDA_FUNCTIONS(X)                                                            \
        X(cuInit, (unsigned flags))                                                      \
        X(cuDriverGetVersion, (int *version))                                            \
        X(cuGetErrorName, (CUresult error, const char **name))                           \
        X(cuGetErrorString, (CUresult error, const char **str))                          \
        X(cuDeviceGetCount, (int *count))                                                \
        X(cuDeviceGet, (CUdevice *dev, int ordinal))                                     \
        X(cuDeviceGetName, (char *name, int len, CUdevice dev))                          \
        X(cuDeviceGetAttribute, (int *value, int attribute, CUdevice dev))               \
        X(cuDeviceGetPCIBusId, (char *bus_id, int len, CUdevice dev))                    \
        X(cuDeviceTotalMem, (size_t *bytes, CUdevice dev))                               \
        X(cuDeviceCanAccessPeer, (int *can, CUdevice dev, CUdevice peer))                \
        X(cuDevicePrimaryCtxRetain, (CUcontext *ctx, CUdevice dev))                      \
        X(cuDevicePrimaryCtxRelease, (CUdevice dev))                                     \
        X(cuCtxSetCurrent, (CUcontext ctx))                                              \
        X(cuCtxGetCurrent, (CUcontext *ctx))                                             \
        X(cuMemGetAllocationGranularity, (size_t *granularity,                          \
                                          const CUmemAllocationProp *prop, int option))  \
        X(cuMemCreate, (CUmemGenericAllocationHandle *handle, size_t size,               \
                        const CUmemAllocationProp *prop, unsigned long long flags))      \
        X(cuMemRelease, (CUmemGenericAllocationHandle handle))                           \
        X(cuMemExportToShareableHandle, (void *shareable, CUmemGenericAllocationHandle h,\
                                         CUmemAllocationHandleType type,                 \
                                         unsigned long long flags))                      \
        X(cuMemImportFromShareableHandle, (CUmemGenericAllocationHandle *handle,         \
                                           void *os_handle,                              \
                                           CUmemAllocationHandleType type))              \
        X(cuMemRetainAllocationHandle, (CUmemGenericAllocationHandle *handle, void *addr))\
        X(cuMemGetAllocationPropertiesFromHandle, (CUmemAllocationProp *prop,           \
                                                   CUmemGenericAllocationHandle handle)) \
        X(cuMemAddressReserve, (CUdeviceptr *ptr, size_t size, size_t alignment,         \
                                CUdeviceptr addr, unsigned long long flags))             \
        X(cuMemAddressFree, (CUdeviceptr ptr, size_t size))                              \
        X(cuMemMap, (CUdeviceptr ptr, size_t size, size_t offset,                        \
                     CUmemGenericAllocationHandle handle, unsigned long long flags))     \
        X(cuMemUnmap, (CUdeviceptr ptr, size_t size))                                    \
        X(cuMemSetAccess, (CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc,    \
                           size_t count))                                                \
        X(cuMemGetAddressRange, (CUdeviceptr *base, size_t *size, CUdeviceptr ptr))      \
        X(cuMemAlloc, (CUdeviceptr *ptr, size_t size))                                   \
        X(cuMemFree, (CUdeviceptr ptr))                                                  \
        X(cuMemAllocHost, (void **ptr, size_t size))                                     \
        X(cuMemFreeHost, (void *ptr))                                                    \
        X(cuMemHostRegister, (void *ptr, size_t size, unsigned flags))                   \
        X(cuMemHostUnregister, (void *ptr))                                              \
        X(cuMemcpyDtoD, (CUdeviceptr dst, CUdeviceptr src, size_t size))                 \
        X(cuMemcpyDtoH, (void *dst, CUdeviceptr src, size_t size))                       \
        X(cuMemcpyHtoD, (CUdeviceptr dst, const void *src, size_t size))                 \
        X(cuMemcpyDtoDAsync, (CUdeviceptr dst, CUdeviceptr src, size_t size, CUstream s))\
        X(cuMemcpyDtoHAsync, (void *dst, CUdeviceptr src, size_t size, CUstream s))      \
        X(cuMemcpyHtoDAsync, (CUdeviceptr dst, const void *src, size_t size, CUstream s))\
        X(cuMemcpyPeerAsync, (CUdeviceptr dst, CUcontext dst_ctx, CUdeviceptr src,       \
                              CUcontext src_ctx, size_t size, CUstream s))               \
        X(cuMemcpy2DAsync, (const CUDA_MEMCPY2D *copy, CUstream s))                      \
        X(cuMemsetD8, (CUdeviceptr dst, unsigned char value, size_t n))                  \
        X(cuMemsetD32Async, (CUdeviceptr dst, unsigned value, size_t n, CUstream s))     \
        X(cuStreamCreate, (CUstream *stream, unsigned flags))                            \
        X(cuStreamDestroy, (CUstream stream))                                            \
        X(cuStreamSynchronize, (CUstream stream))                                        \
        X(cuStreamWaitEvent, (CUstream stream, CUevent event, unsigned flags))           \
        X(cuStreamAddCallback, (CUstream stream, CUstreamCallback cb, void *userdata,    \
                                unsigned flags))                                         \
        X(cuEventCreate, (CUevent *event, unsigned flags))                               \
        X(cuEventDestroy, (CUevent event))                                               \
        X(cuEventRecord, (CUevent event, CUstream stream))                               \
        X(cuEventSynchronize, (CUevent event))                                           \
        X(cuEventQuery, (CUevent event))                                                 \
        X(cuEventElapsedTime, (float *ms, CUevent start, CUevent end))                   \
        X(cuCtxSynchronize, (void))                                                      \
        X(cuModuleLoadData, (CUmodule *module, const void *image))                       \
        X(cuModuleUnload, (CUmodule module))                                             \
        X(cuModuleGetFunction, (CUfunction *f, CUmodule module, const char *name))       \
        X(cuLaunchKernel, (CUfunction f, unsigned gx, unsigned gy, unsigned gz,          \
                           unsigned bx, unsigned by, unsigned bz, unsigned shared_bytes, \
                           CUstream stream, void **params, void **extra))

/* Entry points used when the driver has them (NULL otherwise), with the API version
 * whose signature is declared. */
#define EPD_CUDA_OPTIONAL_FUNCTIONS(X)                                                   \
        X(cuMemcpyBatchAsync, 13000,                                                     \
          (CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,            \
           CUmemcpyAttributes *attrs, size_t *attr_idxs, size_t n_attrs, CUstream s))

typedef struct CudaDriver {
        void *dl;
        int driver_version; /* e.g. 13000 */
        int n_devices;
#define EPD_CUDA_DECLARE_FN(name, params) CUresult (*name) params;
        EPD_CUDA_FUNCTIONS(EPD_CUDA_DECLARE_FN)
#undef EPD_CUDA_DECLARE_FN
#define EPD_CUDA_DECLARE_OPT(name, version, params) CUresult (*name) params;
        EPD_CUDA_OPTIONAL_FUNCTIONS(EPD_CUDA_DECLARE_OPT)
#undef EPD_CUDA_DECLARE_OPT
} CudaDriver;

/* Loads the driver (library NULL: "libcuda.so.1"; a path for tests), resolves every
 * entry point, calls cuInit and counts the devices. Returns -ENOENT, -ENODEV or
 * -EOPNOTSUPP as described above, or another negative errno. */
int cuda_driver_open(const char *library, CudaDriver **ret);
CudaDriver *cuda_driver_close(CudaDriver *d);
DEFINE_TRIVIAL_CLEANUP_FUNC(CudaDriver *, cuda_driver_close);

/* The single CUresult → errno mapping. Pure. */
int cuda_result_to_errno(CUresult r);
/* "CUDA_ERROR_OUT_OF_MEMORY" etc.; works with d == NULL (then from a built-in table). */
const char *cuda_result_name(const CudaDriver *d, CUresult r);
/* What to tell the user for a failed cuda_driver_open(). */
const char *cuda_absence_to_string(int error);

/* Maps r to an errno; logs the CUDA error name at debug level with `what` (the caller
 * logs the failure once, where it is handled). */
int cuda_check(const CudaDriver *d, CUresult r, const char *what);

/* Calls an entry point and returns 0 or a negative errno:
 *     r = CU(d, cuMemCreate, &h, size, &prop, 0); */
#define CU(d, fn, ...) cuda_check((d), (d)->fn(__VA_ARGS__), #fn)
