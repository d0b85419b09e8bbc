/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* A stand-in for libcuda.so.1 in unit tests. Every entry point is resolved through
 * cuGetProcAddress_v2, as with the real driver; FAKE_CUDA_MODE says what it is:
 *   nodevice  cuInit fails with CUDA_ERROR_NO_DEVICE (a driver but no GPU)
 *   zero      cuInit works, cuDeviceGetCount says 0
 *   old       cuDriverGetVersion says 11.0
 *   missing   one entry point cannot be resolved
 *   gpu       one fake GPU whose "device memory" is host memory: VMM allocations are
 *             memfds (exported fds are dups, imports map the same pages), device
 *             pointers are addresses in this process, copies are memcpy, and stream
 *             callbacks run at once. FAKE_CUDA_FAIL_COPIES=1 makes every stream
 *             callback report CUDA_ERROR_ILLEGAL_ADDRESS. FAKE_CUDA_COPY_DELAY_MS=N
 *             makes a copy take N ms as the host sees it, as on a GPU that another
 *             context holds: a synchronous cuMemcpyDtoD returns after N ms, and an
 *             event waited for (behind asynchronous copies) completes N ms later.
 *             FAKE_CUDA_IMPORT_DELAY_MS=N: importing an exported allocation takes N ms.
 *             FAKE_CUDA_EVENT_MS=N: an event is done N ms after it was recorded
 *             (cuEventQuery says not ready before), and FAKE_CUDA_SYNC_LAG_MS=M makes
 *             cuEventSynchronize return M ms after that, as a blocking-sync wake-up
 *             that comes late.
 *             FAKE_CUDA_KERNELS=1: any module loads, and the batched copy kernels
 *             (epd_copy_chunks, epd_copy_uniform) run on the host when launched: each
 *             descriptor's bytes copied as the kernel copies them. The KV kernels are
 *             not emulated (a launch of one fails). FAKE_CUDA_DEVICES=N: N such GPUs
 *             (default 1); fake_cuda_retained(dev) says how many references on a
 *             device's primary context are held, fake_cuda_live() how many cuMemAlloc
 *             allocations and events are not freed. FAKE_CUDA_FAIL_CTX_SET=1: making a
 *             context current fails (after binding it, as a context whose sticky error
 *             the driver reports when it is bound); making none current still works. FAKE_CUDA_FAIL_ALLOC=1 and
 *             FAKE_CUDA_FAIL_ALLOC_HOST=1: cuMemAlloc and cuMemAllocHost fail (out of
 *             memory). FAKE_CUDA_EVENT_MS may change between submissions: each event
 *             keeps the value it was recorded with, a per-copy delay (events are
 *             independent: the fake's streams do not order them).
 * It lets the GPU domain's logic (arenas, transport, completions, registrations) run
 * in CI; the real driver is exercised on the device machine. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void (*Callback)(void *stream, CUresult status, void *userdata);

#define OK 0
#define E_INVALID 1
#define E_NO_DEVICE 100
#define E_NOT_FOUND 500
#define E_NOT_SUPPORTED 801

static const char *mode(void) {
        const char *m = getenv("FAKE_CUDA_MODE");
        return m ? m : "nodevice";
}

static int is_gpu(void) {
        return strcmp(mode(), "gpu") == 0;
}

/* ---- allocations: a handle is a memfd plus its size ---- */

typedef struct Handle {
        int fd;
        size_t size;
        int device; /* the GPU it was made on: in the memfd's name, so imports know it */
} Handle;

/* The part of CUmemAllocationProp the fake reads and writes. */
typedef struct Prop {
        int type, handle_types;
        struct {
                int type, id;
        } location;
} Prop;

#define MAX_MAPS 256
static struct {
        CUdeviceptr base;
        size_t size;
        int fd;
} maps[MAX_MAPS];
static pthread_mutex_t maps_lock = PTHREAD_MUTEX_INITIALIZER;

static CUresult f_init(unsigned flags) {
        return strcmp(mode(), "nodevice") == 0 ? E_NO_DEVICE : OK;
}
static CUresult f_version(int *v) {
        *v = strcmp(mode(), "old") == 0 ? 11000 : 13000;
        return OK;
}
/* FAKE_CUDA_DEVICES=N (gpu mode): N fake GPUs, all alike (default 1). */
static int n_devices(void) {
        const char *n = getenv("FAKE_CUDA_DEVICES");
        int v = n ? atoi(n) : 1;
        return is_gpu() ? (v >= 1 && v <= 64 ? v : 1) : 0;
}
static CUresult f_count(int *n) {
        *n = n_devices();
        return OK;
}
static CUresult f_error_name(CUresult e, const char **s) {
        *s = e == E_NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : e == 700 ? "CUDA_ERROR_ILLEGAL_ADDRESS" : "CUDA_ERROR_FAKE";
        return OK;
}
static CUresult f_device_get(int *dev, int ordinal) {
        if (ordinal < 0 || ordinal >= n_devices())
                return 101;
        *dev = ordinal;
        return OK;
}
static CUresult f_name(char *name, int len, int dev) {
        snprintf(name, (size_t)len, "Fake GPU");
        return OK;
}
static CUresult f_pci(char *bus, int len, int dev) {
        snprintf(bus, (size_t)len, "0000:%02X:00.0", 0xAB + dev);
        return OK;
}
static CUresult f_total(size_t *b, int dev) {
        *b = 1ULL << 30;
        return OK;
}
static CUresult f_attr(int *v, int attr, int dev) {
        switch (attr) {
        case 11: *v = 2147483647; break; /* max pitch, as an H100/H200 reports */
        case 16: *v = 4; break;   /* multiprocessors */
        case 40: *v = 2; break;   /* copy engines */
        case 102: *v = 1; break;  /* VMM */
        case 103: *v = 1; break;  /* POSIX fd */
        default: *v = 0;
        }
        return OK;
}
static CUresult f_peer(int *can, int a, int b) {
        *can = 0;
        return OK;
}
/* Primary contexts retained and not released, per device: fake_cuda_retained(). */
static int retained[64];
int fake_cuda_retained(int dev);
int fake_cuda_retained(int dev) {
        return dev >= 0 && dev < 64 ? __atomic_load_n(&retained[dev], __ATOMIC_RELAXED) : -1;
}
static CUresult f_retain(void **ctx, int dev) {
        if (dev < 0 || dev >= 64)
                return 101;
        __atomic_add_fetch(&retained[dev], 1, __ATOMIC_RELAXED);
        *ctx = (void *)(uintptr_t)(0x1 + dev);
        return OK;
}
static CUresult f_release(int dev) {
        if (dev < 0 || dev >= 64)
                return 101;
        __atomic_sub_fetch(&retained[dev], 1, __ATOMIC_RELAXED);
        return OK;
}
/* The calling thread's current context, as the driver keeps it: a pthread key, not
 * __thread, whose block in this dlopen()ed library is dynamic TLS, which LeakSanitizer's
 * leak check at a sanitized test's exit read at a bogus address and crashed on ("Tracer
 * caught signal 11", "DTLS 7 at 0x128"), failing every later case of test-gpu-handoff
 * once three more were added. */
static pthread_key_t ctx_key;
static pthread_once_t ctx_once = PTHREAD_ONCE_INIT;
static void ctx_key_make(void) {
        (void)pthread_key_create(&ctx_key, NULL);
}
static void *current_ctx_get(void) {
        (void)pthread_once(&ctx_once, ctx_key_make);
        return pthread_getspecific(ctx_key);
}
#define current_ctx current_ctx_get()
static CUresult f_ctx_set(void *ctx) {
        const char *fail = getenv("FAKE_CUDA_FAIL_CTX_SET");
        (void)pthread_once(&ctx_once, ctx_key_make);
        (void)pthread_setspecific(ctx_key, ctx);
        return ctx && fail && strcmp(fail, "1") == 0 ? 201 /* CUDA_ERROR_INVALID_CONTEXT */ : OK;
}
/* cuMemAlloc allocations and events not freed: fake_cuda_live(). */
static int live;
int fake_cuda_live(void);
int fake_cuda_live(void) {
        return __atomic_load_n(&live, __ATOMIC_RELAXED);
}
static CUresult f_ctx_get(void **ctx) {
        *ctx = current_ctx;
        return OK;
}
/* Read by tests (dlsym): cuStreamSynchronize calls (the loop waiting on a stream). */
unsigned long fake_cuda_stream_syncs;
static CUresult f_stream_sync(void *stream) {
        __atomic_add_fetch(&fake_cuda_stream_syncs, 1, __ATOMIC_RELAXED);
        return OK;
}
static CUresult f_ok_ptr(void *p) {
        return OK;
}
static CUresult f_ok_void(void) {
        return OK;
}
static CUresult f_granularity(size_t *g, const void *prop, int opt) {
        *g = 2 << 20;
        return OK;
}
static CUresult f_mem_create(unsigned long long *h, size_t size, const void *prop, unsigned long long flags) {
        const Prop *p = prop;
        char name[32];
        if (!p || p->location.type != 1 || p->location.id < 0 || p->location.id >= n_devices())
                return E_INVALID;
        Handle *x = calloc(1, sizeof *x);
        if (!x)
                return 2;
        x->device = p->location.id;
        snprintf(name, sizeof name, "fake-gpu-%d", x->device);
        x->fd = memfd_create(name, MFD_CLOEXEC);
        if (x->fd < 0 || ftruncate(x->fd, (off_t)size) < 0) {
                free(x);
                return 2;
        }
        x->size = size;
        *h = (unsigned long long)(uintptr_t)x;
        return OK;
}
static CUresult f_mem_release(unsigned long long h) {
        Handle *x = (Handle *)(uintptr_t)h;
        close(x->fd);
        free(x);
        return OK;
}
static CUresult f_export(void *out, unsigned long long h, int type, unsigned long long flags) {
        Handle *x = (Handle *)(uintptr_t)h;
        int fd = dup(x->fd); /* like the driver: no FD_CLOEXEC */
        if (fd < 0)
                return 304;
        *(int *)out = fd;
        return OK;
}
/* Sleeps for the milliseconds the environment variable says (none: no sleep). */
static void env_delay(const char *var) {
        const char *d = getenv(var);
        long ms = d ? strtol(d, NULL, 10) : 0;
        if (ms > 0)
                (void)nanosleep(&(struct timespec) { .tv_sec = ms / 1000, .tv_nsec = (ms % 1000) * 1000000L }, NULL);
}

/* "/memfd:fake-gpu-N (deleted)": made on GPU N; any other file counts as GPU 0's. */
static int device_of(int fd) {
        char path[64], target[128];
        int device = 0;
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        ssize_t k = readlink(path, target, sizeof target - 1);
        if (k > 0) {
                target[k] = 0;
                (void)sscanf(target, "/memfd:fake-gpu-%d", &device);
        }
        return device;
}
static CUresult f_import(unsigned long long *h, void *os_handle, int type) {
        env_delay("FAKE_CUDA_IMPORT_DELAY_MS");
        int fd = (int)(intptr_t)os_handle;
        off_t size = lseek(fd, 0, SEEK_END);
        if (size <= 0)
                return E_INVALID; /* not an allocation */
        Handle *x = calloc(1, sizeof *x);
        if (!x)
                return 2;
        x->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        x->size = (size_t)size;
        x->device = device_of(fd);
        *h = (unsigned long long)(uintptr_t)x;
        return OK;
}
static CUresult f_props(Prop *p, unsigned long long h) {
        Handle *x = (Handle *)(uintptr_t)h;
        *p = (Prop) { .type = 1, .handle_types = 1, .location = { .type = 1, .id = x->device } };
        return OK;
}
/* FAKE_CUDA_FAIL_RESERVE_FILE=PATH: while PATH exists, address reservations fail with
 * CUDA_ERROR_OUT_OF_MEMORY (a GPU whose address space is spent; a test makes the file
 * once the daemon's own arenas are up). */
static CUresult f_reserve(CUdeviceptr *p, size_t size, size_t align, CUdeviceptr addr, unsigned long long fl) {
        const char *fail = getenv("FAKE_CUDA_FAIL_RESERVE_FILE");
        if (fail && access(fail, F_OK) == 0)
                return 2;
        void *m = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED)
                return 2;
        *p = (CUdeviceptr)(uintptr_t)m;
        return OK;
}
static CUresult f_addr_free(CUdeviceptr p, size_t size) {
        munmap((void *)(uintptr_t)p, size);
        return OK;
}
static CUresult f_map(CUdeviceptr p, size_t size, size_t off, unsigned long long h, unsigned long long fl) {
        Handle *x = (Handle *)(uintptr_t)h;
        if (size + off > x->size)
                return E_INVALID;
        if (mmap((void *)(uintptr_t)p, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, x->fd,
                 (off_t)off) == MAP_FAILED)
                return 2;
        pthread_mutex_lock(&maps_lock);
        for (int i = 0; i < MAX_MAPS; i++)
                if (maps[i].base == 0) {
                        maps[i].base = p;
                        maps[i].size = size;
                        maps[i].fd = x->fd;
                        break;
                }
        pthread_mutex_unlock(&maps_lock);
        return OK;
}
static CUresult f_unmap(CUdeviceptr p, size_t size) {
        mmap((void *)(uintptr_t)p, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        pthread_mutex_lock(&maps_lock);
        for (int i = 0; i < MAX_MAPS; i++)
                if (maps[i].base == p)
                        maps[i].base = 0;
        pthread_mutex_unlock(&maps_lock);
        return OK;
}
static CUresult f_set_access(CUdeviceptr p, size_t size, const void *desc, size_t n) {
        return n >= 1 ? OK : E_INVALID;
}
/* The mapping of a VMM allocation that holds ptr: its start and size. */
static CUresult f_address_range(CUdeviceptr *base, size_t *size, CUdeviceptr ptr) {
        CUresult r = E_INVALID;
        pthread_mutex_lock(&maps_lock);
        for (int i = 0; i < MAX_MAPS; i++)
                if (maps[i].base && ptr >= maps[i].base && ptr < maps[i].base + maps[i].size) {
                        if (base)
                                *base = maps[i].base;
                        if (size)
                                *size = maps[i].size;
                        r = OK;
                        break;
                }
        pthread_mutex_unlock(&maps_lock);
        return r;
}
static CUresult f_retain_handle(unsigned long long *h, void *addr) {
        CUdeviceptr a = (CUdeviceptr)(uintptr_t)addr;
        CUresult r = E_INVALID;
        pthread_mutex_lock(&maps_lock);
        for (int i = 0; i < MAX_MAPS; i++)
                if (maps[i].base && a >= maps[i].base && a < maps[i].base + maps[i].size) {
                        Handle *x = calloc(1, sizeof *x);
                        if (x) {
                                x->fd = fcntl(maps[i].fd, F_DUPFD_CLOEXEC, 3);
                                x->size = maps[i].size;
                                x->device = device_of(x->fd);
                                *h = (unsigned long long)(uintptr_t)x;
                                r = OK;
                        }
                        break;
                }
        pthread_mutex_unlock(&maps_lock);
        return r;
}
/* FAKE_CUDA_FAIL_ALLOC=1 / FAKE_CUDA_FAIL_ALLOC_HOST=1: cuMemAlloc / cuMemAllocHost
 * fail with CUDA_ERROR_OUT_OF_MEMORY, as on a GPU (or a host) out of memory. */
static int env_on(const char *var) {
        const char *v = getenv(var);
        return v && strcmp(v, "1") == 0;
}
static CUresult f_alloc(CUdeviceptr *p, size_t size) {
        if (env_on("FAKE_CUDA_FAIL_ALLOC"))
                return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
        void *m = malloc(size);
        if (!m)
                return 2;
        __atomic_add_fetch(&live, 1, __ATOMIC_RELAXED);
        *p = (CUdeviceptr)(uintptr_t)m;
        return OK;
}
static CUresult f_free(CUdeviceptr p) {
        if (p)
                __atomic_sub_fetch(&live, 1, __ATOMIC_RELAXED);
        free((void *)(uintptr_t)p);
        return OK;
}
static CUresult f_alloc_host(void **p, size_t size) {
        if (env_on("FAKE_CUDA_FAIL_ALLOC_HOST"))
                return 2;
        *p = malloc(size);
        return *p ? OK : 2;
}
static CUresult f_free_host(void *p) {
        free(p);
        return OK;
}
static CUresult f_host_register(void *p, size_t size, unsigned flags) {
        if (!current_ctx)
                return 201; /* CUDA_ERROR_INVALID_CONTEXT, as the driver says */
        return p && size ? OK : E_INVALID;
}
static CUresult f_host_unregister(void *p) {
        return current_ctx ? OK : 201;
}
static void copy_delay(void) {
        env_delay("FAKE_CUDA_COPY_DELAY_MS");
}
static CUresult f_copy_now(CUdeviceptr dst, CUdeviceptr src, size_t n) {
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
        return OK;
}
static CUresult f_copy(CUdeviceptr dst, CUdeviceptr src, size_t n) {
        copy_delay();
        return f_copy_now(dst, src, n);
}
/* FAKE_CUDA_FAIL_ASYNC_AFTER=N: the asynchronous copy calls after the first N (counted
 * while it is set) fail as they are enqueued, as a driver refusing work does; with the
 * CUresult FAKE_CUDA_ASYNC_ERROR (default CUDA_ERROR_INVALID_VALUE). */
static CUresult async_refused(void) {
        static unsigned long calls;
        const char *after = getenv("FAKE_CUDA_FAIL_ASYNC_AFTER"), *error = getenv("FAKE_CUDA_ASYNC_ERROR");
        if (!after) {
                calls = 0;
                return 0;
        }
        if (calls++ < strtoul(after, NULL, 10))
                return 0;
        return error ? (CUresult)strtoul(error, NULL, 10) : E_INVALID;
}
static CUresult f_copy_async(CUdeviceptr dst, CUdeviceptr src, size_t n, void *stream) {
        CUresult refused = async_refused();
        if (refused)
                return refused;
        return f_copy_now(dst, src, n);
}
static CUresult f_copy_peer_async(CUdeviceptr dst, void *dc, CUdeviceptr src, void *sc, size_t n, void *s) {
        CUresult refused = async_refused();
        if (refused)
                return refused;
        return f_copy_now(dst, src, n);
}
static CUresult f_batch_async(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                              void *attrs, size_t *idx, size_t n_attrs, void *stream) {
        /* FAKE_CUDA_SUBMIT_DELAY_MS: a submission that holds its caller (a host busy
         * preparing a large batch). */
        env_delay("FAKE_CUDA_SUBMIT_DELAY_MS");
        CUresult refused = async_refused();
        if (refused)
                return refused;
        for (size_t i = 0; i < count; i++)
                f_copy_now(dsts[i], srcs[i], sizes[i]);
        return OK;
}
/* CUDA_MEMCPY2D_v2 (gpu/cuda-loader.h). */
enum { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2 };
typedef struct CUDA_MEMCPY2D {
        size_t srcXInBytes, srcY;
        int srcMemoryType;
        const void *srcHost;
        CUdeviceptr srcDevice;
        void *srcArray;
        size_t srcPitch;
        size_t dstXInBytes, dstY;
        int dstMemoryType;
        void *dstHost;
        CUdeviceptr dstDevice;
        void *dstArray;
        size_t dstPitch;
        size_t WidthInBytes, Height;
} CUDA_MEMCPY2D;
/* Read by tests (dlsym): 2D copies and the rows they moved. */
unsigned long fake_cuda_copies_2d, fake_cuda_rows_2d;
static CUresult f_copy_2d_async(const CUDA_MEMCPY2D *c, void *stream) {
        const char *no = getenv("FAKE_CUDA_NO_2D");
        if (no && *no == '1')
                return 801; /* CUDA_ERROR_NOT_SUPPORTED: a driver without them */
        CUresult refused = async_refused();
        if (refused)
                return refused;
        if (c->WidthInBytes > c->srcPitch || c->WidthInBytes > c->dstPitch)
                return E_INVALID; /* as the driver: rows may not overlap on either side */
        const uint8_t *src = c->srcMemoryType == CU_MEMORYTYPE_HOST ? c->srcHost
                                                                     : (const uint8_t *)(uintptr_t)c->srcDevice;
        uint8_t *dst = c->dstMemoryType == CU_MEMORYTYPE_HOST ? c->dstHost : (uint8_t *)(uintptr_t)c->dstDevice;
        for (size_t y = 0; y < c->Height; y++)
                memcpy(dst + (c->dstY + y) * c->dstPitch + c->dstXInBytes,
                       src + (c->srcY + y) * c->srcPitch + c->srcXInBytes, c->WidthInBytes);
        __atomic_add_fetch(&fake_cuda_copies_2d, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&fake_cuda_rows_2d, c->Height, __ATOMIC_RELAXED);
        return OK;
}
static CUresult f_memset8(CUdeviceptr dst, unsigned char v, size_t n) {
        memset((void *)(uintptr_t)dst, v, n);
        return OK;
}
static CUresult f_memset32_async(CUdeviceptr dst, unsigned v, size_t n, void *s) {
        unsigned *p = (unsigned *)(uintptr_t)dst;
        for (size_t i = 0; i < n; i++)
                p[i] = v;
        return OK;
}
static CUresult f_stream_create(void **s, unsigned flags) {
        static int token;
        *s = &token;
        return OK;
}
static CUresult f_add_callback(void *stream, Callback cb, void *userdata, unsigned flags) {
        /* The work before it is done already (copies are synchronous here). */
        const char *fail = getenv("FAKE_CUDA_FAIL_COPIES");
        cb(stream, fail && *fail == '1' ? 700 : OK, userdata);
        return OK;
}
/* An event holds the time it was last recorded (the streams run their work at once, so
 * that is when the work before it was done): cuEventElapsedTime gives the real time
 * between two records. */
typedef struct FakeEvent {
        struct timespec recorded;
        int was_recorded;
        /* FAKE_CUDA_EVENT_MS and _SYNC_LAG_MS as they were when it was recorded (read
         * on the recording thread, not on the thread that polls it). */
        long done_ms, sync_lag_ms;
} FakeEvent;
static long env_ms(const char *var) {
        const char *d = getenv(var);
        return d ? strtol(d, NULL, 10) : 0;
}
static CUresult f_event_create(void **e, unsigned flags) {
        *e = calloc(1, sizeof(FakeEvent));
        if (*e)
                __atomic_add_fetch(&live, 1, __ATOMIC_RELAXED);
        return *e ? OK : 2 /* CUDA_ERROR_OUT_OF_MEMORY */;
}
static CUresult f_event_destroy(void *e) {
        if (e)
                __atomic_sub_fetch(&live, 1, __ATOMIC_RELAXED);
        free(e);
        return OK;
}
/* Streams run their work at once, so an event is complete when recorded; waiting for
 * one fails (as after a fault on its stream) with FAKE_CUDA_FAIL_EVENTS=1, and with
 * FAKE_CUDA_FAIL_COPIES=1 (the copies before it failed). */
static CUresult f_event_record(void *e, void *stream) {
        FakeEvent *f = e;
        clock_gettime(CLOCK_MONOTONIC, &f->recorded);
        f->was_recorded = 1;
        f->done_ms = env_ms("FAKE_CUDA_EVENT_MS");
        f->sync_lag_ms = env_ms("FAKE_CUDA_SYNC_LAG_MS");
        return OK;
}
/* Read by tests (dlsym) to see that a stream was made to wait. */
unsigned long fake_cuda_stream_waits;
static CUresult f_stream_wait_event(void *stream, void *e, unsigned flags) {
        __atomic_add_fetch(&fake_cuda_stream_waits, 1, __ATOMIC_RELAXED);
        return OK; /* the streams run their work at once */
}
/* FAKE_CUDA_EVENT_MS: when the event is done (CLOCK_MONOTONIC ns); 0: at once. */
static int64_t event_done_ns(const FakeEvent *f) {
        if (f->done_ms <= 0 || !f->was_recorded)
                return 0;
        return (int64_t)f->recorded.tv_sec * 1000000000 + f->recorded.tv_nsec + (int64_t)f->done_ms * 1000000;
}
static int64_t mono_ns(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
static CUresult f_event_sync(void *e) {
        const FakeEvent *f = e;
        int64_t done = event_done_ns(f);
        if (done > 0) {
                int64_t at = done + (int64_t)f->sync_lag_ms * 1000000;
                struct timespec ts = { .tv_sec = at / 1000000000, .tv_nsec = at % 1000000000 };
                while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                        ;
        }
        copy_delay();
        const char *fail = getenv("FAKE_CUDA_FAIL_EVENTS"), *copies = getenv("FAKE_CUDA_FAIL_COPIES");
        return (fail && strcmp(fail, "1") == 0) || (copies && strcmp(copies, "1") == 0)
                       ? 700 /* CUDA_ERROR_ILLEGAL_ADDRESS */
                       : OK;
}
/* Done at once, as the streams run their work at once; not yet while copies are slowed
 * down (FAKE_CUDA_COPY_DELAY_MS: cuEventSynchronize waits), failed as f_event_sync. */
static CUresult f_event_query(void *e) {
        const char *fail = getenv("FAKE_CUDA_FAIL_EVENTS"), *copies = getenv("FAKE_CUDA_FAIL_COPIES");
        const char *delay = getenv("FAKE_CUDA_COPY_DELAY_MS");
        if ((fail && strcmp(fail, "1") == 0) || (copies && strcmp(copies, "1") == 0))
                return 700;
        int64_t done = event_done_ns(e);
        if (done > 0 && mono_ns() < done)
                return 600;
        return delay && strtol(delay, NULL, 10) > 0 ? 600 /* CUDA_ERROR_NOT_READY */ : OK;
}
static CUresult f_event_elapsed(float *ms, void *a, void *b) {
        const FakeEvent *x = a, *y = b;
        if (!x->was_recorded || !y->was_recorded)
                return 600; /* CUDA_ERROR_NOT_READY, as for an event never recorded */
        *ms = (float)((double)(y->recorded.tv_sec - x->recorded.tv_sec) * 1e3 +
                      (double)(y->recorded.tv_nsec - x->recorded.tv_nsec) / 1e6);
        return OK;
}
/* ---- kernels: none, or with FAKE_CUDA_KERNELS=1 the chunk copies on the host ---- */

typedef struct FakeFunction {
        const char *name;
        int copies_chunks;
} FakeFunction;

static FakeFunction fake_functions[] = {
        { "epd_copy_chunks", 1 },
        { "epd_copy_uniform", 1 },
        { "epd_kv_rows", 0 },
        { "epd_kv_layers", 0 },
};

static int fake_kernels(void) {
        const char *k = getenv("FAKE_CUDA_KERNELS");
        return is_gpu() && k && strcmp(k, "1") == 0;
}

static CUresult f_module_load(void **m, const void *image) {
        static int token;
        if (!fake_kernels() || !image)
                return E_NOT_SUPPORTED; /* no kernels on a fake GPU */
        *m = &token;
        return OK;
}
static CUresult f_module_function(void **f, void *m, const char *name) {
        for (size_t i = 0; i < sizeof fake_functions / sizeof fake_functions[0]; i++)
                if (strcmp(fake_functions[i].name, name) == 0) {
                        *f = &fake_functions[i];
                        return OK;
                }
        return E_NOT_FOUND;
}
/* The chunk kernels' first two parameters: the descriptors' device address and their
 * count (gpu/pack.cu, EpdChunk). The grid must cover something. */
static CUresult f_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                         unsigned shared, void *stream, void **params, void **extra) {
        const FakeFunction *fn = f;
        if (!fn || !params || gx == 0 || gy == 0 || gz == 0 || bx == 0 || by == 0 || bz == 0)
                return E_INVALID;
        if (!fn->copies_chunks)
                return E_NOT_SUPPORTED;
        const struct {
                unsigned long long src, dst, len;
        } *c = (const void *)(uintptr_t)*(const CUdeviceptr *)params[0];
        unsigned n = *(const unsigned *)params[1];
        for (unsigned i = 0; i < n; i++)
                memmove((void *)(uintptr_t)c[i].dst, (const void *)(uintptr_t)c[i].src, c[i].len);
        return OK;
}
static CUresult f_unsupported(void) {
        return E_NOT_SUPPORTED;
}

static const struct {
        const char *name;
        void *fn;
} table[] = {
        { "cuInit", (void *)f_init },
        { "cuDriverGetVersion", (void *)f_version },
        { "cuGetErrorName", (void *)f_error_name },
        { "cuDeviceGetCount", (void *)f_count },
        { "cuDeviceGet", (void *)f_device_get },
        { "cuDeviceGetName", (void *)f_name },
        { "cuDeviceGetAttribute", (void *)f_attr },
        { "cuDeviceGetPCIBusId", (void *)f_pci },
        { "cuDeviceTotalMem", (void *)f_total },
        { "cuDeviceCanAccessPeer", (void *)f_peer },
        { "cuDevicePrimaryCtxRetain", (void *)f_retain },
        { "cuDevicePrimaryCtxRelease", (void *)f_release },
        { "cuCtxSetCurrent", (void *)f_ctx_set },
        { "cuCtxGetCurrent", (void *)f_ctx_get },
        { "cuCtxSynchronize", (void *)f_ok_void },
        { "cuMemGetAllocationGranularity", (void *)f_granularity },
        { "cuMemCreate", (void *)f_mem_create },
        { "cuMemRelease", (void *)f_mem_release },
        { "cuMemExportToShareableHandle", (void *)f_export },
        { "cuMemImportFromShareableHandle", (void *)f_import },
        { "cuMemRetainAllocationHandle", (void *)f_retain_handle },
        { "cuMemGetAllocationPropertiesFromHandle", (void *)f_props },
        { "cuMemGetAddressRange", (void *)f_address_range },
        { "cuMemAddressReserve", (void *)f_reserve },
        { "cuMemAddressFree", (void *)f_addr_free },
        { "cuMemMap", (void *)f_map },
        { "cuMemUnmap", (void *)f_unmap },
        { "cuMemSetAccess", (void *)f_set_access },
        { "cuMemAlloc", (void *)f_alloc },
        { "cuMemFree", (void *)f_free },
        { "cuMemAllocHost", (void *)f_alloc_host },
        { "cuMemFreeHost", (void *)f_free_host },
        { "cuMemHostRegister", (void *)f_host_register },
        { "cuMemHostUnregister", (void *)f_host_unregister },
        { "cuMemcpyDtoD", (void *)f_copy },
        { "cuMemcpyDtoH", (void *)f_copy },
        { "cuMemcpyHtoD", (void *)f_copy },
        { "cuMemcpyDtoDAsync", (void *)f_copy_async },
        { "cuMemcpyDtoHAsync", (void *)f_copy_async },
        { "cuMemcpyHtoDAsync", (void *)f_copy_async },
        { "cuMemcpyPeerAsync", (void *)f_copy_peer_async },
        { "cuMemcpyBatchAsync", (void *)f_batch_async },
        { "cuMemcpy2DAsync", (void *)f_copy_2d_async },
        { "cuMemsetD8", (void *)f_memset8 },
        { "cuMemsetD32Async", (void *)f_memset32_async },
        { "cuStreamCreate", (void *)f_stream_create },
        { "cuStreamDestroy", (void *)f_ok_ptr },
        { "cuStreamSynchronize", (void *)f_stream_sync },
        { "cuStreamAddCallback", (void *)f_add_callback },
        { "cuEventCreate", (void *)f_event_create },
        { "cuEventDestroy", (void *)f_event_destroy },
        { "cuEventRecord", (void *)f_event_record },
        { "cuStreamWaitEvent", (void *)f_stream_wait_event },
        { "cuEventSynchronize", (void *)f_event_sync },
        { "cuEventQuery", (void *)f_event_query },
        { "cuEventElapsedTime", (void *)f_event_elapsed },
        { "cuModuleLoadData", (void *)f_module_load },
        { "cuModuleGetFunction", (void *)f_module_function },
        { "cuModuleUnload", (void *)f_ok_ptr },
        { "cuLaunchKernel", (void *)f_launch },
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status);
CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version,
                             unsigned long long flags, int *status) {
        if (status)
                *status = 0;
        if (strcmp(symbol, "cuLaunchKernel") == 0 && strcmp(mode(), "missing") == 0) {
                *pfn = NULL;
                return E_NOT_FOUND;
        }
        for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
                if (strcmp(table[i].name, symbol) == 0) {
                        *pfn = table[i].fn;
                        return OK;
                }
        /* The rest are never reached on a fake GPU (kernels fail to load first). */
        *pfn = (void *)f_unsupported;
        return OK;
}
