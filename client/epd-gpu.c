/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#include "epd-internal.h"
#include "epd/epd-gpu.h"
#include "epd/handoff.h"
#include "id.h"
#include "system.h"
#include "kvcopy.h"
#include "macro.h"
#include "time-util.h"
#include "vmm.h"

struct EpdGpu {
        GpuSystem *system;
        /* The handle is used from several threads (a worker's copy stream and its
         * notifier, the Python binding's sink): its count and lazy kernels are locked. */
        pthread_mutex_t lock;
        unsigned n_mappings;     /* and page tables and notifiers: each keeps the handle */
        bool closing;
        GpuKernels **kernels;    /* per ordinal, loaded on first use */
        int *kernels_error;      /* per ordinal: why they could not be loaded (0: not tried) */
};

struct EpdGpuPages {
        EpdGpu *gpu;
        int ordinal;
        uint64_t *pages;         /* on the host */
        size_t n_pages;
        uint64_t page_size;
        CUdeviceptr dev;         /* the same in device memory */
        CUevent uploaded;        /* recorded after the upload: copies wait for it
                                  * before they read the table, until it completed */
        atomic_bool upload_done; /* seen complete: copies wait no more */
};

struct EpdGpuMapping {
        EpdGpu *gpu;
        GpuArena *arena;
};

static void epd_gpu_free(EpdGpu *g) {
        GpuCtxSaved cs = gpu_ctx_save(g->system); /* unloading kernels makes each device current */
        for (size_t i = 0; g->kernels && i < g->system->n_devices; i++)
                gpu_kernels_free(g->kernels[i]);
        gpu_ctx_restore(g->system, &cs);
        free(g->kernels);
        free(g->kernels_error);
        gpu_system_unref(g->system);
        pthread_mutex_destroy(&g->lock);
        free(g);
}

/* One more user of the handle (a mapping, page table or notifier); -EINVAL once it is
 * being closed. */
static int gpu_hold(EpdGpu *g) {
        pthread_mutex_lock(&g->lock);
        bool closing = g->closing;
        if (!closing)
                g->n_mappings++;
        pthread_mutex_unlock(&g->lock);
        return closing ? -EINVAL : 0;
}

/* One user fewer: the last one after epd_gpu_close() frees the handle. */
static void gpu_release(EpdGpu *g) {
        pthread_mutex_lock(&g->lock);
        bool last = --g->n_mappings == 0 && g->closing;
        pthread_mutex_unlock(&g->lock);
        if (last)
                epd_gpu_free(g);
}

int epd_gpu_open(EpdGpu **ret) {
        EpdGpu *g;
        int r;

        if (!ret)
                return -EINVAL;
        g = calloc(1, sizeof *g);
        if (!g)
                return -ENOMEM;
        r = gpu_system_open(secure_getenv("EPD_LIBCUDA"), &g->system);
        if (r < 0) {
                free(g);
                return r;
        }
        pthread_mutex_init(&g->lock, NULL);
        g->kernels = calloc(MAX(g->system->n_devices, (size_t)1), sizeof *g->kernels);
        g->kernels_error = calloc(MAX(g->system->n_devices, (size_t)1), sizeof *g->kernels_error);
        if (!g->kernels || !g->kernels_error) {
                epd_gpu_free(g);
                return -ENOMEM;
        }
        *ret = g;
        return 0;
}

/* The handle lives until its last mapping is gone, so that unmapping after close is
 * safe. */
EpdGpu *epd_gpu_close(EpdGpu *g) {
        if (!g)
                return NULL;
        pthread_mutex_lock(&g->lock);
        g->closing = true;
        bool unused = g->n_mappings == 0;
        pthread_mutex_unlock(&g->lock);
        if (unused)
                epd_gpu_free(g);
        return NULL;
}

const char *epd_gpu_strerror(int error) {
        return cuda_absence_to_string(error);
}

/* Whether g was closed (epd_gpu_close()): the calls that take no hold of their own
 * refuse it. The handle still lives while a mapping, page table or notifier holds it;
 * once none does, it is freed, and calling with it is the caller's use after free. */
static bool gpu_closing(EpdGpu *g) {
        pthread_mutex_lock(&g->lock);
        bool closing = g->closing;
        pthread_mutex_unlock(&g->lock);
        return closing;
}

int epd_gpu_ordinal_from_pci_bus_id(EpdGpu *g, const char *pci_bus_id) {
        if (!g || !pci_bus_id || gpu_closing(g))
                return -EINVAL;
        for (size_t i = 0; i < g->system->n_devices; i++)
                if (strcasecmp(g->system->devices[i].pci_bus_id, pci_bus_id) == 0)
                        return (int)i;
        return -ENODEV;
}

int epd_gpu_map(EpdGpu *g, int fd, uint64_t size, int ordinal, EpdGpuMapping **ret) {
        EpdGpuMapping *m;
        int r;

        if (!g || !ret || gpu_hold(g) < 0)
                return -EINVAL;
        m = calloc(1, sizeof *m);
        if (!m) {
                gpu_release(g);
                return -ENOMEM;
        }
        GpuCtxSaved cs = gpu_ctx_save(g->system);
        r = gpu_arena_import(g->system, ordinal, fd, size, &m->arena);
        gpu_ctx_restore(g->system, &cs);
        if (r < 0) {
                free(m);
                gpu_release(g);
                return r;
        }
        m->gpu = g;
        *ret = m;
        return 0;
}

uint64_t epd_gpu_mapping_device_pointer(const EpdGpuMapping *m) {
        return m ? m->arena->base : 0;
}

uint64_t epd_gpu_mapping_size(const EpdGpuMapping *m) {
        return m ? m->arena->size : 0;
}

int epd_gpu_mapping_ordinal(const EpdGpuMapping *m) {
        return m ? m->arena->ordinal : -EINVAL;
}

EpdGpuMapping *epd_gpu_unmap(EpdGpuMapping *m) {
        EpdGpu *g;

        if (!m)
                return NULL;
        g = m->gpu;
        GpuCtxSaved cs = gpu_ctx_save(g->system);
        gpu_arena_unref(m->arena);
        gpu_ctx_restore(g->system, &cs);
        free(m);
        gpu_release(g);
        return NULL;
}

int epd_gpu_export(EpdGpu *g, uint64_t device_pointer, int *ret_fd) {
        if (!g || !ret_fd || device_pointer == 0)
                return -EINVAL;
        /* Held for the call: a close meanwhile does not free the handle under it. */
        if (gpu_hold(g) < 0)
                return -EINVAL;
        int r = gpu_export_allocation(g->system, device_pointer, ret_fd);
        gpu_release(g);
        return r;
}

int epd_gpu_daemon_pci_bus_id(epd_client *c, uint32_t daemon_ordinal, char *buf, size_t n) {
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        const char *pci, *name;
        uint32_t ordinal;
        int vmm, fd, gdr, r;
        uint64_t mem;

        if (!c || !buf || n == 0)
                return epd__error(c, -EINVAL, NULL);
        epd__clear_error(c);
        r = sd_bus_get_property(c->bus, EPD_DESTINATION(c), "/org/epd1", "org.epd1.Gpu", "Gpus",
                                &e, &reply, "a(ussbbbt)");
        if (r < 0) {
                r = epd__error(c, r, &e);
                sd_bus_error_free(&e);
                return r;
        }
        r = sd_bus_message_enter_container(reply, 'a', "(ussbbbt)");
        while (r >= 0 && (r = sd_bus_message_read(reply, "(ussbbbt)", &ordinal, &pci, &name, &vmm,
                                                   &fd, &gdr, &mem)) > 0)
                if (ordinal == daemon_ordinal) {
                        snprintf(buf, n, "%s", pci);
                        sd_bus_message_unref(reply);
                        return 0;
                }
        sd_bus_message_unref(reply);
        if (r < 0)
                return epd__error(c, r, NULL);
        return epd__fail(c, -ENODEV, "The daemon lists no GPU %" PRIu32 ".", daemon_ordinal);
}

int epd_gpu_arena_map(epd_client *c, EpdGpu *g, size_t i, EpdGpuMapping **ret) {
        const epd_arena *a = epd_arena_get(c, i);
        char pci[64];
        int r, ordinal;

        if (!a || !g || !ret)
                return epd__error(c, -EINVAL, NULL);
        if (strcmp(a->domain, "gpu") != 0 || a->gpu < 0)
                return epd__error(c, -EOPNOTSUPP, NULL); /* host arenas: epd_arena_map() */
        r = epd_gpu_daemon_pci_bus_id(c, (uint32_t)a->gpu, pci, sizeof pci);
        if (r < 0)
                return r;
        ordinal = epd_gpu_ordinal_from_pci_bus_id(g, pci);
        if (ordinal < 0)
                return epd__fail(c, ordinal,
                                 "Arena %s lives on the GPU at %s, which this process cannot see "
                                 "(CUDA_VISIBLE_DEVICES?).", a->name, pci);
        r = epd_gpu_map(g, a->fd, a->size, ordinal, ret);
        return r < 0 ? epd__fail(c, r, "Cannot map GPU arena %s: %s", a->name, strerror(-r)) : r;
}

static int register_memory(epd_client *c, EpdGpu *g, int ordinal, uint64_t device_pointer, uint64_t size,
                           uint32_t *ret_region);

int epd_gpu_register_memory(epd_client *c, EpdGpu *g, int ordinal, uint64_t device_pointer,
                            uint64_t size, uint32_t *ret_region) {
        int r;

        if (!c || !g || !ret_region)
                return epd__error(c, -EINVAL, NULL);
        /* Held for the call: after epd_gpu_close() refused (a closed handle may be freed). */
        if (gpu_hold(g) < 0)
                return epd__fail(c, -EINVAL, "The GPU handle is closed.");
        r = register_memory(c, g, ordinal, device_pointer, size, ret_region);
        gpu_release(g);
        return r;
}

static int register_memory(epd_client *c, EpdGpu *g, int ordinal, uint64_t device_pointer, uint64_t size,
                           uint32_t *ret_region) {
        sd_bus_message *reply = NULL;
        uint32_t region;
        int fd, r;

        if (ordinal < 0 || (size_t)ordinal >= g->system->n_devices)
                return epd__error(c, -EINVAL, NULL);
        epd__clear_error(c); /* a refusal below is this call's, never an earlier one's */
        /* The export is of the whole allocation, and the daemon maps it from its start:
         * a pointer inside one would have the daemon's writes land before it, over the
         * worker's other tensors. Only [start, start + size) of an allocation is taken
         * (where the driver can say where it starts). */
        CUdeviceptr base = 0;
        size_t length = 0;
        /* The call needs a current context: the ordinal's, the caller's put back after. */
        GpuCtxSaved cs = gpu_ctx_save(g->system);
        CUresult got = gpu_device_make_current(g->system, &g->system->devices[ordinal]) >= 0
                               ? g->system->driver->cuMemGetAddressRange(&base, &length, (CUdeviceptr)device_pointer)
                               : CUDA_ERROR_INVALID_CONTEXT;
        gpu_ctx_restore(g->system, &cs);
        if (got == CUDA_SUCCESS) {
                if (base != (CUdeviceptr)device_pointer)
                        return epd__error(c, -EINVAL, &SD_BUS_ERROR_MAKE_CONST(
                                                  "org.epd1.Error.InvalidArgument",
                                                  "The pointer is not the start of its allocation: register the "
                                                  "allocation's start and address the tensor by its offset."));
                if (size > length)
                        return epd__error(c, -EINVAL, &SD_BUS_ERROR_MAKE_CONST(
                                                  "org.epd1.Error.InvalidArgument",
                                                  "The size runs past the end of the allocation."));
        }
        r = epd_gpu_export(g, device_pointer, &fd);
        if (r < 0)
                return epd__fail(c, r, "Cannot export the allocation at 0x%" PRIx64 " (%s): is it CUDA VMM memory "
                                 "made shareable as a POSIX fd?", device_pointer, strerror(-r));
        r = epd__call(c, "/org/epd1", "org.epd1.Gpu", "RegisterMemory", &reply, "hts", fd, size,
                      g->system->devices[ordinal].pci_bus_id);
        close(fd); /* sd-bus sent its own duplicate */
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "u", &region);
        sd_bus_message_unref(reply);
        if (r < 0)
                return epd__error(c, r, NULL);
        *ret_region = region;
        return 0;
}

int epd_gpu_release_memory(epd_client *c, uint32_t region) {
        if (!c)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, "/org/epd1", "org.epd1.Gpu", "ReleaseMemory", NULL, "u", region);
}

/* ---- KV pages (gpu/kvcopy.h) ---- */

/* The batched kernels of a GPU, or NULL (built without them, or the driver has none):
 * the copies then go row by row. */
static GpuKernels *kernels_of(EpdGpu *g, int ordinal) {
        pthread_mutex_lock(&g->lock);
        if (!g->kernels[ordinal] && g->kernels_error[ordinal] == 0) {
                int r = gpu_kernels_load(g->system, ordinal, &g->kernels[ordinal]);
                g->kernels_error[ordinal] = r < 0 ? r : 1;
        }
        GpuKernels *k = g->kernels[ordinal];
        pthread_mutex_unlock(&g->lock);
        return k;
}

static int pages_new(EpdGpu *g, int ordinal, const uint64_t *page_addresses, size_t n_pages, uint64_t page_size,
                     uint64_t stream, EpdGpuPages **ret) {
        EpdGpuPages *p;
        GpuDevice *d;
        int r;

        if (!g || !ret || (n_pages > 0 && !page_addresses) || page_size == 0)
                return -EINVAL;
        if (n_pages > SIZE_MAX / sizeof *p->pages)
                return -ENOMEM; /* the table's bytes do not fit in a size_t */
        d = gpu_system_device(g->system, ordinal);
        if (!d)
                return -ENODEV;
        if (gpu_hold(g) < 0)
                return -EINVAL;
        p = calloc(1, sizeof *p);
        if (!p) {
                gpu_release(g);
                return -ENOMEM;
        }
        p->gpu = g;
        p->ordinal = ordinal;
        p->n_pages = n_pages;
        p->page_size = page_size;
        p->pages = malloc(MAX(n_pages, (size_t)1) * sizeof *p->pages);
        r = p->pages ? gpu_device_make_current(g->system, d) : -ENOMEM;
        if (r >= 0 && n_pages > 0) {
                memcpy(p->pages, page_addresses, n_pages * sizeof *p->pages);
                r = CU(g->system->driver, cuMemAlloc, &p->dev, n_pages * sizeof *p->pages);
                if (r >= 0)
                        r = CU(g->system->driver, cuMemcpyHtoDAsync, p->dev, p->pages, n_pages * sizeof *p->pages,
                               (CUstream)(uintptr_t)stream);
                if (r >= 0)
                        r = CU(g->system->driver, cuEventCreate, &p->uploaded, CU_EVENT_DISABLE_TIMING);
                if (r >= 0)
                        r = CU(g->system->driver, cuEventRecord, p->uploaded, (CUstream)(uintptr_t)stream);
        }
        if (r < 0) {
                if (p->uploaded)
                        (void)CU(g->system->driver, cuEventDestroy, p->uploaded);
                if (p->dev)
                        (void)CU(g->system->driver, cuMemFree, p->dev);
                free(p->pages);
                free(p);
                gpu_release(g);
                return r;
        }
        *ret = p;
        return 0;
}

/* Every call below that makes a device's context current puts the caller's back. */
int epd_gpu_pages_new(EpdGpu *g, int ordinal, const uint64_t *page_addresses, size_t n_pages, uint64_t page_size,
                      uint64_t stream, EpdGpuPages **ret) {
        if (!g)
                return -EINVAL;
        GpuCtxSaved cs = gpu_ctx_save(g->system);
        int r = pages_new(g, ordinal, page_addresses, n_pages, page_size, stream, ret);
        gpu_ctx_restore(g->system, &cs);
        return r;
}

EpdGpuPages *epd_gpu_pages_free(EpdGpuPages *p) {
        EpdGpu *g;

        if (!p)
                return NULL;
        g = p->gpu;
        GpuCtxSaved cs = gpu_ctx_save(g->system);
        /* Freed also when the device's context cannot be made current: the memory and
         * the event are of the primary context, which the handle keeps retained, and
         * the driver frees them from another current context too (or says why not). */
        (void)gpu_device_make_current(g->system, &g->system->devices[p->ordinal]);
        if (p->dev)
                (void)CU(g->system->driver, cuMemFree, p->dev); /* waits for its users */
        if (p->uploaded)
                (void)CU(g->system->driver, cuEventDestroy, p->uploaded);
        gpu_ctx_restore(g->system, &cs);
        free(p->pages);
        free(p);
        gpu_release(g);
        return NULL;
}

/* A copy reads the table only after its upload landed (an upload from pageable memory
 * may return before its DMA is done): its stream waits for the upload's event until
 * that has completed, then no copy waits any more. Stream handles are not compared to
 * skip the wait: the per-thread default stream has one handle in every thread, and a
 * destroyed stream's handle can come back as a new stream's. */
static int after_upload(EpdGpuPages *p, uint64_t stream) {
        const CudaDriver *d = p->gpu->system->driver;

        if (!p->uploaded || atomic_load_explicit(&p->upload_done, memory_order_relaxed))
                return 0;
        CUresult q = d->cuEventQuery(p->uploaded);
        if (q == CUDA_SUCCESS) {
                atomic_store_explicit(&p->upload_done, true, memory_order_relaxed);
                return 0;
        }
        if (q != CUDA_ERROR_NOT_READY)
                return cuda_check(d, q, "cuEventQuery");
        return CU(d, cuStreamWaitEvent, (CUstream)(uintptr_t)stream, p->uploaded, 0);
}

static int kv_copy(EpdGpuPages *p, const epd_kv_rows *r, uint64_t stream, GpuKvDirection d) {
        EpdGpu *g;
        int e;

        if (!p || !r)
                return -EINVAL;
        e = gpu_kv_rows_check((const GpuKvRows *)r, p->n_pages, p->page_size);
        if (e < 0)
                return e;
        g = p->gpu;
        GpuCtxSaved cs = gpu_ctx_save(g->system);
        e = gpu_device_make_current(g->system, &g->system->devices[p->ordinal]);
        if (e >= 0)
                e = after_upload(p, stream);
        if (e >= 0)
                e = gpu_kv_rows_copy(g->system, kernels_of(g, p->ordinal), (CUstream)(uintptr_t)stream, p->dev,
                                     p->pages, p->n_pages, (const GpuKvRows *)r, d);
        gpu_ctx_restore(g->system, &cs);
        return e;
}

static int kv_copy_many(EpdGpuPages *p, const epd_kv_rows *rows, size_t n, uint64_t stream, GpuKvDirection d) {
        if (!p || (n > 0 && !rows))
                return -EINVAL;
        for (size_t i = 0; i < n; i++) {
                int e = gpu_kv_rows_check((const GpuKvRows *)&rows[i], p->n_pages, p->page_size);
                if (e < 0)
                        return e;
        }
        if (n == 0)
                return 0;
        EpdGpu *g = p->gpu;
        GpuCtxSaved cs = gpu_ctx_save(g->system);
        int e = gpu_device_make_current(g->system, &g->system->devices[p->ordinal]);
        if (e >= 0)
                e = after_upload(p, stream);
        if (e >= 0)
                e = gpu_kv_rows_copy_many(g->system, kernels_of(g, p->ordinal), (CUstream)(uintptr_t)stream,
                                          p->dev, p->pages, p->n_pages, (const GpuKvRows *)rows, n, d);
        gpu_ctx_restore(g->system, &cs);
        return e;
}

int epd_gpu_kv_write_many(EpdGpuPages *p, const epd_kv_rows *rows, size_t n, uint64_t stream) {
        return kv_copy_many(p, rows, n, stream, GPU_KV_TO_PAGES);
}

int epd_gpu_kv_read_many(EpdGpuPages *p, const epd_kv_rows *rows, size_t n, uint64_t stream) {
        return kv_copy_many(p, rows, n, stream, GPU_KV_FROM_PAGES);
}

int epd_gpu_kv_write(EpdGpuPages *p, const epd_kv_rows *r, uint64_t stream) {
        return kv_copy(p, r, stream, GPU_KV_TO_PAGES);
}

int epd_gpu_kv_read(EpdGpuPages *p, const epd_kv_rows *r, uint64_t stream) {
        return kv_copy(p, r, stream, GPU_KV_FROM_PAGES);
}

static int kv_copy_host(const uint64_t *pages, size_t n_pages, uint64_t page_size, const epd_kv_rows *r,
                        GpuKvDirection d) {
        if (!r || (n_pages > 0 && !pages))
                return -EINVAL;
        int e = gpu_kv_rows_check((const GpuKvRows *)r, n_pages, page_size);
        if (e < 0)
                return e;
        gpu_kv_rows_copy_host((const GpuKvRows *)r, pages, d);
        return 0;
}

int epd_kv_write_host(const uint64_t *page_addresses, size_t n_pages, uint64_t page_size, const epd_kv_rows *r) {
        return kv_copy_host(page_addresses, n_pages, page_size, r, GPU_KV_TO_PAGES);
}

int epd_kv_read_host(const uint64_t *page_addresses, size_t n_pages, uint64_t page_size, const epd_kv_rows *r) {
        return kv_copy_host(page_addresses, n_pages, page_size, r, GPU_KV_FROM_PAGES);
}

_Static_assert(sizeof(epd_kv_rows) == sizeof(GpuKvRows) && offsetof(epd_kv_rows, v_offset) == offsetof(GpuKvRows, v_offset),
               "epd_kv_rows is GpuKvRows");

/* ---- layer groups reported ready from the GPU (epd_gpu_notifier_*) ---- */

#define NOTIFIER_RING_FULL_USEC 1000000ULL /* how long a full ring is retried */

typedef struct Notice {
        CUevent event;
        EpdId request;
        uint64_t token;
        uint32_t group, count; /* groups [group, group + count) */
} Notice;

struct EpdGpuNotifier {
        EpdGpu *gpu;
        int ordinal;
        epd_ring_client *ring;
        pthread_t thread;
        pthread_mutex_t lock;
        pthread_cond_t more;     /* a notice was queued, or stop */
        pthread_cond_t finished; /* a notice was dealt with */
        Notice *queue;           /* circular: [head, head + len) */
        size_t cap, head, len;
        CUevent *spare;          /* recorded and waited for: reused */
        size_t n_spare, cap_spare;
        uint64_t asked, done, submitted;
        int error;               /* the first since the last flush */
        bool stop;
};

/* Submits one LayerGroupReady, retrying a full ring for a while (the daemon drains it on
 * its loop). */
static int notice_submit_one(epd_ring_client *ring, const Notice *q, uint32_t group) {
        struct epd_ring_record rec;
        uint64_t deadline = 0;

        epd_ring_record_layer_group_ready(&rec, q->request.bytes, q->token, group, 0);
        for (;;) {
                int e = epd_ring_submit(ring, &rec);
                if (e != -EAGAIN)
                        return e;
                uint64_t now = now_usec(CLOCK_MONOTONIC);
                if (deadline == 0)
                        deadline = now + NOTIFIER_RING_FULL_USEC;
                else if (now >= deadline)
                        return -EAGAIN;
                usleep(50);
        }
}

/* The notice's groups, in order; how many went on the ring, or the error that stopped
 * the rest (the groups after it are not reported: their handoff rolls back). */
static int notice_submit(epd_ring_client *ring, const Notice *q, uint64_t *submitted) {
        for (uint32_t i = 0; i < q->count; i++) {
                int e = notice_submit_one(ring, q, q->group + i);
                if (e < 0)
                        return e;
                (*submitted)++;
        }
        return 0;
}

static void *notifier_thread(void *userdata) {
        EpdGpuNotifier *n = userdata;
        GpuSystem *s = n->gpu->system;
        int ctx = gpu_device_make_current(s, &s->devices[n->ordinal]);

        pthread_mutex_lock(&n->lock);
        for (;;) {
                while (n->len == 0 && !n->stop)
                        pthread_cond_wait(&n->more, &n->lock);
                if (n->len == 0)
                        break;
                Notice q = n->queue[n->head];
                pthread_mutex_unlock(&n->lock);

                uint64_t submitted = 0;
                int e = ctx < 0 ? ctx : CU(s->driver, cuEventSynchronize, q.event);
                if (e >= 0)
                        e = notice_submit(n->ring, &q, &submitted);

                pthread_mutex_lock(&n->lock);
                n->head = (n->head + 1) % n->cap;
                n->len--;
                n->spare[n->n_spare++] = q.event; /* room: every event is spare or queued */
                n->done++;
                n->submitted += submitted;
                if (e < 0 && n->error == 0)
                        n->error = e;
                pthread_cond_broadcast(&n->finished);
        }
        pthread_mutex_unlock(&n->lock);
        return NULL;
}

int epd_gpu_notifier_new(EpdGpu *g, int ordinal, struct epd_ring_client *ring, EpdGpuNotifier **ret) {
        EpdGpuNotifier *n;
        pthread_condattr_t attr;
        int r;

        if (!g || !ring || !ret || ordinal < 0 || (size_t)ordinal >= g->system->n_devices)
                return -EINVAL;
        if (gpu_hold(g) < 0) /* the handle lives as long as the notifier */
                return -EINVAL;
        n = calloc(1, sizeof *n);
        if (!n) {
                gpu_release(g);
                return -ENOMEM;
        }
        n->gpu = g;
        n->ordinal = ordinal;
        n->ring = ring;
        pthread_mutex_init(&n->lock, NULL);
        pthread_condattr_init(&attr);
        pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        pthread_cond_init(&n->more, &attr);
        pthread_cond_init(&n->finished, &attr);
        pthread_condattr_destroy(&attr);
        r = -pthread_create(&n->thread, NULL, notifier_thread, n);
        if (r < 0) {
                pthread_cond_destroy(&n->more);
                pthread_cond_destroy(&n->finished);
                pthread_mutex_destroy(&n->lock);
                free(n);
                gpu_release(g);
                return r;
        }
        *ret = n;
        return 0;
}

/* Room for one more queued notice and its event (under the lock). */
static int notifier_reserve(EpdGpuNotifier *n) {
        if (n->len == n->cap) {
                size_t cap = n->cap ? 2 * n->cap : 16;
                Notice *q = malloc(cap * sizeof *q);
                if (!q)
                        return -ENOMEM;
                for (size_t i = 0; i < n->len; i++)
                        q[i] = n->queue[(n->head + i) % n->cap];
                free(n->queue);
                n->queue = q;
                n->cap = cap;
                n->head = 0;
        }
        if (n->cap_spare < n->cap) {
                CUevent *sp = realloc(n->spare, n->cap * sizeof *sp);
                if (!sp)
                        return -ENOMEM;
                n->spare = sp;
                n->cap_spare = n->cap;
        }
        return 0;
}

int epd_gpu_notifier_ready_after_range(EpdGpuNotifier *n, uint64_t stream, const char *request_id, uint64_t token,
                                       uint32_t first, uint32_t count) {
        GpuSystem *s;
        Notice q = { .token = token, .group = first, .count = count };
        int e;

        if (!n || !request_id || count == 0 || first > UINT32_MAX - count ||
            epd_id_from_string(request_id, &q.request) < 0)
                return -EINVAL;
        s = n->gpu->system;
        GpuCtxSaved cs = gpu_ctx_save(s);
        e = gpu_device_make_current(s, &s->devices[n->ordinal]);
        if (e < 0) {
                gpu_ctx_restore(s, &cs); /* the caller's context, whatever the failure left */
                return e;
        }

        /* Under the lock throughout (the thread holds it only between events): the
         * queue has room for this notice, and every event ever made is either queued or
         * spare, so that `spare` always has room for the ones that come back. */
        pthread_mutex_lock(&n->lock);
        e = notifier_reserve(n);
        if (e >= 0) {
                if (n->n_spare > 0)
                        q.event = n->spare[--n->n_spare];
                else
                        e = CU(s->driver, cuEventCreate, &q.event, CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING);
        }
        if (e >= 0) {
                e = CU(s->driver, cuEventRecord, q.event, (CUstream)(uintptr_t)stream);
                if (e < 0)
                        n->spare[n->n_spare++] = q.event;
        }
        if (e >= 0) {
                n->queue[(n->head + n->len) % n->cap] = q;
                n->len++;
                n->asked++;
                pthread_cond_signal(&n->more);
        }
        pthread_mutex_unlock(&n->lock);
        gpu_ctx_restore(s, &cs);
        return e < 0 ? e : 0;
}

int epd_gpu_notifier_ready_after(EpdGpuNotifier *n, uint64_t stream, const char *request_id, uint64_t token,
                                 uint32_t group) {
        return epd_gpu_notifier_ready_after_range(n, stream, request_id, token, group, 1);
}

int epd_gpu_notifier_flush(EpdGpuNotifier *n, uint64_t timeout_usec) {
        struct timespec deadline;
        int e = 0;

        if (!n)
                return -EINVAL;
        if (timeout_usec != UINT64_MAX) {
                clock_gettime(CLOCK_MONOTONIC, &deadline);
                uint64_t ns = (uint64_t)deadline.tv_nsec + (timeout_usec % 1000000ULL) * 1000ULL;
                deadline.tv_sec += (time_t)(timeout_usec / 1000000ULL + ns / 1000000000ULL);
                deadline.tv_nsec = (long)(ns % 1000000000ULL);
        }
        pthread_mutex_lock(&n->lock);
        uint64_t target = n->asked;
        while (n->done < target && e == 0) {
                if (timeout_usec == UINT64_MAX)
                        pthread_cond_wait(&n->finished, &n->lock);
                else if (pthread_cond_timedwait(&n->finished, &n->lock, &deadline) == ETIMEDOUT)
                        e = -ETIMEDOUT;
        }
        if (e == 0) {
                e = n->error;
                n->error = 0;
        }
        pthread_mutex_unlock(&n->lock);
        return e;
}

uint64_t epd_gpu_notifier_pending(EpdGpuNotifier *n) {
        if (!n)
                return 0;
        pthread_mutex_lock(&n->lock);
        uint64_t v = n->asked - n->done;
        pthread_mutex_unlock(&n->lock);
        return v;
}

uint64_t epd_gpu_notifier_submitted(EpdGpuNotifier *n) {
        if (!n)
                return 0;
        pthread_mutex_lock(&n->lock);
        uint64_t v = n->submitted;
        pthread_mutex_unlock(&n->lock);
        return v;
}

EpdGpuNotifier *epd_gpu_notifier_free(EpdGpuNotifier *n) {
        EpdGpu *g;

        if (!n)
                return NULL;
        (void)epd_gpu_notifier_flush(n, UINT64_MAX);
        pthread_mutex_lock(&n->lock);
        n->stop = true;
        pthread_cond_signal(&n->more);
        pthread_mutex_unlock(&n->lock);
        pthread_join(n->thread, NULL);

        g = n->gpu;
        GpuCtxSaved cs = gpu_ctx_save(g->system);
        if (n->n_spare > 0 && gpu_device_make_current(g->system, &g->system->devices[n->ordinal]) >= 0)
                for (size_t i = 0; i < n->n_spare; i++)
                        (void)CU(g->system->driver, cuEventDestroy, n->spare[i]);
        gpu_ctx_restore(g->system, &cs);
        free(n->spare);
        free(n->queue);
        pthread_cond_destroy(&n->more);
        pthread_cond_destroy(&n->finished);
        pthread_mutex_destroy(&n->lock);
        free(n);
        gpu_release(g);
        return NULL;
}
