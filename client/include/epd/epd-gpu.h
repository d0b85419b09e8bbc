/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* libepd, GPU side: map the daemon's GPU arenas into this process and export this
 * process's own GPU memory for registration. The CUDA driver is loaded at run time;
 * nothing here needs a GPU to link, and every function returns 0 or a negative errno:
 * -ENOENT (no NVIDIA driver) and -ENODEV (no GPU) from epd_gpu_open() mean "no GPU",
 * which epd_gpu_strerror() says in words.
 *
 * A GPU arena arrives as an fd (D-Bus type `h`) with its size and its GPU's PCI bus id;
 * the daemon keeps owning the memory: unmapping, or this process dying, only drops this
 * process's mapping. The device pointer is valid in the device's primary context (the
 * one the CUDA runtime, and so PyTorch, uses).
 *
 * Threads: one EpdGpu may be used from several threads at once (mappings, page tables
 * and notifiers made and freed on any of them); one mapping, page table or notifier is
 * used by one thread at a time. epd_gpu_close() ends the handle once its last mapping,
 * page table and notifier are gone (they may still be used and freed after it); with
 * none left it frees the handle at once. So no call may use the handle itself after
 * epd_gpu_close() has been called, nor race it from another thread: a call that does
 * while a mapping still holds it is refused (-EINVAL), but one that does after the last
 * is a use after free. */

#include <stdint.h>

#include "epd/epd.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct EpdGpu EpdGpu;
typedef struct EpdGpuMapping EpdGpuMapping;

int epd_gpu_open(EpdGpu **ret);
EpdGpu *epd_gpu_close(EpdGpu *g);
const char *epd_gpu_strerror(int error);

/* This process's ordinal for the GPU with the given PCI bus id ("0000:19:00.0"; case
 * does not matter), which differs from the daemon's under CUDA_VISIBLE_DEVICES; or
 * -ENODEV when this process cannot see that GPU. */
int epd_gpu_ordinal_from_pci_bus_id(EpdGpu *g, const char *pci_bus_id);

/* Maps an arena. `fd` is not consumed. */
int epd_gpu_map(EpdGpu *g, int fd, uint64_t size, int ordinal, EpdGpuMapping **ret);
uint64_t epd_gpu_mapping_device_pointer(const EpdGpuMapping *m);
uint64_t epd_gpu_mapping_size(const EpdGpuMapping *m);
/* This process's ordinal of the mapping's GPU. */
int epd_gpu_mapping_ordinal(const EpdGpuMapping *m);
EpdGpuMapping *epd_gpu_unmap(EpdGpuMapping *m);

/* Exports memory this process allocated itself with cuMemCreate and a POSIX-fd handle
 * type, mapped at `device_pointer`, as a new fd (O_CLOEXEC), for registration with the
 * daemon as external memory. The process keeps ownership: the daemon never frees it,
 * and drops its mapping when the registration is released or this process goes. */
int epd_gpu_export(EpdGpu *g, uint64_t device_pointer, int *ret_fd);

/* KV pages and the model's cache, one layer at a time (docs/e2e.md): the batched
 * scatter of a layer's K and V into the pages (a prefill's save) and the gather back
 * (a decode's load), for any number of pages, in one step. The tensors are (1, H, S, D)
 * attention-cache tensors with a contiguous last dimension: a row of row_bytes (D ×
 * element size) per head and token, head h's row of token s at h × head_stride +
 * s × token_stride bytes (0, 0: (H, S, D) contiguous). In a page, the layer's K rows start at k_offset and
 * its V rows at v_offset, token-major (the row of the page's token t and head h at
 * (t × H + h) × row_bytes, as vLLM's cache blocks). Token s is in page s / T. */
typedef struct epd_kv_rows {
        uint64_t k, v;               /* the tensors' addresses (device pointers on a GPU) */
        uint64_t tokens;             /* S: tokens [0, S) of the layer */
        uint32_t heads;              /* H */
        uint32_t tokens_per_page;    /* T */
        uint64_t row_bytes;          /* D × element size */
        uint64_t k_offset, v_offset; /* the layer's K and V rows within a page */
        uint64_t head_stride;        /* bytes between heads; 0: tokens × row_bytes */
        uint64_t token_stride;       /* bytes between tokens; 0: row_bytes */
} epd_kv_rows;

/* A page table on one GPU (pages of a GPU arena this process mapped): the addresses of
 * a sequence's pages, copied to device memory once so that each layer's copy is one
 * kernel launch. Enqueued on `stream` (a CUstream; 0: the default stream); copies, on
 * any stream, wait for the upload (an event) before they read the table, until it has
 * completed. */
typedef struct EpdGpuPages EpdGpuPages;
int epd_gpu_pages_new(EpdGpu *g, int ordinal, const uint64_t *page_addresses, size_t n_pages, uint64_t page_size,
                      uint64_t stream, EpdGpuPages **ret);
EpdGpuPages *epd_gpu_pages_free(EpdGpuPages *p);
/* Tensors → pages, and pages → tensors, enqueued on `stream` (nothing waits: the caller
 * records an event or synchronizes when it needs the bytes). One launch of the batched
 * kernel where it is built in and the rows are 16-byte aligned; else one copy per row. */
int epd_gpu_kv_write(EpdGpuPages *p, const epd_kv_rows *r, uint64_t stream);
int epd_gpu_kv_read(EpdGpuPages *p, const epd_kv_rows *r, uint64_t stream);
/* The same for n layers in one call (rows[i]: one layer's tensors and offsets), such as a
 * decode loading every layer of a finished handoff at once: every rows[i] is checked
 * before anything is enqueued (all or nothing); layers of one geometry (the same tensor
 * shape, strides and dtype: one model's) go in one launch of the several-layer kernel,
 * up to 64 a launch, others one launch each. */
int epd_gpu_kv_write_many(EpdGpuPages *p, const epd_kv_rows *rows, size_t n, uint64_t stream);
int epd_gpu_kv_read_many(EpdGpuPages *p, const epd_kv_rows *rows, size_t n, uint64_t stream);
/* The same copies in host memory (host arenas; the reference of the GPU copies). */
int epd_kv_write_host(const uint64_t *page_addresses, size_t n_pages, uint64_t page_size, const epd_kv_rows *r);
int epd_kv_read_host(const uint64_t *page_addresses, size_t n_pages, uint64_t page_size, const epd_kv_rows *r);

/* Layer groups reported ready from the GPU, without the caller waiting (docs/e2e.md):
 * epd_gpu_notifier_ready_after() records an event on `stream` (everything enqueued there
 * so far: the group's writes) and returns; the notifier's thread waits for that event
 * (a blocking-sync event: it sleeps, it does not spin) and then submits the group's
 * LayerGroupReady on the ring (epd_ring_layer_group_ready()), in the order they were
 * asked for. The ring may be used from the caller's thread meanwhile (submission is
 * serialized). epd_gpu_notifier_flush() waits until every group asked for so far is on
 * the ring, up to timeout_usec (UINT64_MAX: forever), and returns 0, -ETIMEDOUT, or the
 * first error since the last flush: a failed event (the CUDA error as -errno), a ring
 * that stayed full for a second (-EAGAIN) (a bad request id is refused when the group
 * is asked for, -EINVAL); a group whose
 * notice failed is not reported ready, so its handoff times out and rolls back, never
 * ships unwritten bytes. epd_gpu_notifier_free() flushes (forever) and ends the thread;
 * the ring and the EpdGpu must outlive the notifier. */
struct epd_ring_client;
typedef struct EpdGpuNotifier EpdGpuNotifier;
int epd_gpu_notifier_new(EpdGpu *g, int ordinal, struct epd_ring_client *ring, EpdGpuNotifier **ret);
int epd_gpu_notifier_ready_after(EpdGpuNotifier *n, uint64_t stream, const char *request_id, uint64_t token,
                                 uint32_t group);
/* Groups [first, first + count) ready after one event: a save that writes every layer
 * in one launch reports every group with one notice (submitted in order). */
int epd_gpu_notifier_ready_after_range(EpdGpuNotifier *n, uint64_t stream, const char *request_id, uint64_t token,
                                       uint32_t first, uint32_t count);
int epd_gpu_notifier_flush(EpdGpuNotifier *n, uint64_t timeout_usec);
/* Notices asked for and not yet on the ring, and how many groups went on the ring in all. */
uint64_t epd_gpu_notifier_pending(EpdGpuNotifier *n);
uint64_t epd_gpu_notifier_submitted(EpdGpuNotifier *n);
EpdGpuNotifier *epd_gpu_notifier_free(EpdGpuNotifier *n);

/* With a daemon connection (epd.h): */

/* Maps GPU arena i of this worker's registration (epd_arena_get(c, i)->domain "gpu"),
 * on this process's ordinal of the daemon's GPU (found by PCI bus id through
 * org.epd1.Gpu.Gpus). The mapping is the caller's; unmap with epd_gpu_unmap(). */
int epd_gpu_arena_map(epd_client *c, EpdGpu *g, size_t i, EpdGpuMapping **ret);

/* Registers memory this process allocated itself (see epd_gpu_export) on its GPU
 * `ordinal` with the daemon (org.epd1.Gpu.RegisterMemory): the daemon can then copy into
 * and out of it. *ret_region is the daemon's id for it. The process keeps ownership;
 * the registration ends with epd_gpu_release_memory(), UnregisterWorker, or the end of
 * the connection. */
int epd_gpu_register_memory(epd_client *c, EpdGpu *g, int ordinal, uint64_t device_pointer,
                            uint64_t size, uint32_t *ret_region);
int epd_gpu_release_memory(epd_client *c, uint32_t region);

/* The daemon's GPUs (org.epd1.Gpu): count, and the PCI bus id of the daemon's ordinal
 * (copied into buf). */
int epd_gpu_daemon_pci_bus_id(epd_client *c, uint32_t daemon_ordinal, char *buf, size_t n);

#ifdef __cplusplus
}
#endif
