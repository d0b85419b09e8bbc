/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "copy.h"
#include "hashmap.h"
#include "log.h"
#include "system.h"
#include "transport/cuda.h"
#include "vmm.h"

typedef struct CudaRegion {
        uint64_t id;               /* hashmap key */
        TransportRegion *region;
        GpuArena *arena;           /* GPU regions: referenced */
        bool pinned;               /* host regions: cuMemHostRegister done here */
        unsigned batches;          /* pinned: batches in flight that copy into or out of it */
} CudaRegion;

/* The pinned host regions a batch names, tracked one by one up to this many (a batch
 * nearly always names one or two); past that the batch counts as naming them all. */
#define BATCH_PINNED_MAX 4

typedef struct CudaBatch {
        size_t n, cap;
        uint64_t *cookies;
        uint64_t *lengths;
        /* The batch goes to the engine in parts (POST_PART_FIRST writes, then twice as
         * many each time up to POST_PART), so that the GPU starts on the first part
         * while the host prepares the next: it completes once every part has, with the
         * first error of any. */
        unsigned parts, parts_done;
        int error;
        uint64_t bytes;
        /* While in flight: its pinned host regions hold it in their `batches`, so that
         * unpinning one waits for these batches alone; `wide`: it named more. */
        CudaRegion *pinned[BATCH_PINNED_MAX];
        unsigned n_pinned;
        bool wide;
} CudaBatch;

/* Writes per part of a batch handed to the copy engine (one descriptor slot each). The
 * first part is small, so that the GPU starts after a few microseconds of the host's
 * preparation, and each next part twice the last, up to POST_PART: the host prepares a
 * part while the GPU copies the one before, which is twice as long. */
#define POST_PART 4096U
#define POST_PART_FIRST 256U

/* Finished batches kept for reuse, with their arrays: a post of thousands of writes
 * would otherwise map fresh pages for them (and fault them in) every time. */
#define SPARE_BATCHES 4

typedef struct CudaTransport {
        Transport base;
        GpuSystem *system;
        CudaArenaLookup lookup;  /* device base → GpuArena of the daemon (or registered) */
        void *lookup_userdata;
        GpuCopyEngine *engine;
        Hashmap *regions;          /* region id → CudaRegion */
        /* Per-write completions expanded from finished batches, not yet polled. */
        TransportCompletion *ready;
        size_t n_ready, ready_head, ready_cap;
        size_t n_in_flight;        /* writes posted, not yet in ready */
        size_t wide_in_flight;     /* batches in flight naming > BATCH_PINNED_MAX pinned regions */
        /* The segments of the post in progress (the engine copies what it keeps). */
        GpuCopySeg *segs;
        size_t segs_cap;
        CudaBatch *spare[SPARE_BATCHES];
        size_t n_spare;
        size_t part_first, part_max; /* POST_PART_FIRST, POST_PART unless set */
} CudaTransport;

static CudaTransport *to_cuda(Transport *t) {
        return container_of(t, CudaTransport, base);
}

static int cuda_register_region(Transport *t, TransportRegion *r) {
        CudaTransport *c = to_cuda(t);
        CudaRegion *cr;
        int k;

        if (!r || r->size == 0)
                return -EINVAL;
        if (hashmap_contains(c->regions, &(uint64_t) { r->id }))
                return -EEXIST;
        cr = calloc(1, sizeof *cr);
        if (!cr)
                return -ENOMEM;
        cr->id = r->id;
        cr->region = r;
        if (r->domain == MEMORY_GPU) {
                GpuArena *a = c->lookup(c->lookup_userdata, r->device_base);
                if (!a || a->size < r->size) {
                        free(cr);
                        return -ENOENT; /* not memory this daemon mapped */
                }
                /* Its GPU's copy lane set up now, not on the first handoff's path. */
                k = gpu_copy_engine_use_device(c->engine, a->ordinal);
                if (k < 0) {
                        free(cr);
                        return k;
                }
                cr->arena = gpu_arena_ref(a);
        } else {
                k = gpu_host_register(c->system, r->host_base, r->size);
                if (k < 0 && k != -EEXIST) {
                        free(cr);
                        return k;
                }
                cr->pinned = k >= 0;
        }
        k = hashmap_put(c->regions, &cr->id, cr);
        if (k < 0) {
                if (cr->pinned)
                        (void)gpu_host_unregister(c->system, r->host_base);
                gpu_arena_unref(cr->arena);
                free(cr);
                return k;
        }
        /* r->transport_data is left alone: a region may be registered with several
         * transports; this one finds its state by region id. */
        return 0;
}

static void batch_free(CudaBatch *b) {
        if (!b)
                return;
        free(b->cookies);
        free(b->lengths);
        free(b);
}

/* A batch for n writes: a spare one that is large enough, or a new one. */
static CudaBatch *batch_get(CudaTransport *c, size_t n) {
        CudaBatch *b;

        for (size_t i = 0; i < c->n_spare; i++)
                if (c->spare[i]->cap >= n) {
                        b = c->spare[i];
                        c->spare[i] = c->spare[--c->n_spare];
                        b->n = 0;
                        b->parts = b->parts_done = 0;
                        b->error = 0;
                        b->bytes = 0;
                        b->n_pinned = 0;
                        b->wide = false;
                        return b;
                }
        b = calloc(1, sizeof *b);
        if (!b)
                return NULL;
        b->cookies = malloc(n * sizeof *b->cookies);
        b->lengths = malloc(n * sizeof *b->lengths);
        if (!b->cookies || !b->lengths) {
                batch_free(b);
                return NULL;
        }
        b->cap = n;
        return b;
}

/* Keeps a finished batch for reuse (replacing the smallest spare), or frees it. */
static void batch_put(CudaTransport *c, CudaBatch *b) {
        size_t smallest = 0;

        if (!b)
                return;
        if (c->n_spare < SPARE_BATCHES) {
                c->spare[c->n_spare++] = b;
                return;
        }
        for (size_t i = 1; i < c->n_spare; i++)
                if (c->spare[i]->cap < c->spare[smallest]->cap)
                        smallest = i;
        if (c->spare[smallest]->cap < b->cap) {
                batch_free(c->spare[smallest]);
                c->spare[smallest] = b;
        } else
                batch_free(b);
}

/* The completions of a finished batch: one per cookie (a handoff's group posts thousands
 * of writes under one; several groups posted together interleave theirs page by page),
 * writes counted and bytes summed, in the order each cookie first appears. Up to
 * CUDA_COOKIES_MERGED distinct cookies are merged at once; past that the ones gathered
 * so far go out and gathering starts over (with more cookies alternating, a completion
 * per run: their writes still add up). */
static void ready_push(CudaTransport *c, size_t *at, const TransportCompletion *t) {
        c->ready[*at] = *t;
        if (++*at == c->ready_cap)
                *at = 0;
        c->n_ready++;
}

static void batch_complete(CudaTransport *c, CudaBatch *b) {
        TransportCompletion m[CUDA_COOKIES_MERGED];
        size_t n_m = 0, last = 0;
        /* Thousands of writes per batch: no division per entry. */
        size_t at = c->ready_head + c->n_ready;
        if (at >= c->ready_cap)
                at -= c->ready_cap;

        for (size_t j = 0, k; j < b->n; j = k) {
                uint64_t bytes = 0;
                for (k = j; k < b->n && k - j < UINT32_MAX && b->cookies[k] == b->cookies[j]; k++)
                        bytes += b->lengths[k];
                size_t i = last < n_m && m[last].cookie == b->cookies[j] ? last : n_m;
                for (size_t q = 0; i == n_m && q < n_m; q++)
                        if (m[q].cookie == b->cookies[j] && (uint64_t)m[q].writes + (k - j) <= UINT32_MAX)
                                i = q;
                if (i == n_m) {
                        if (n_m == CUDA_COOKIES_MERGED) {
                                for (size_t q = 0; q < n_m; q++)
                                        ready_push(c, &at, &m[q]);
                                n_m = i = 0;
                        }
                        m[n_m++] = (TransportCompletion) { .cookie = b->cookies[j], .error = b->error };
                }
                m[i].writes += (uint32_t)(k - j);
                m[i].bytes += b->error < 0 ? 0 : bytes;
                last = i;
        }
        for (size_t q = 0; q < n_m; q++)
                ready_push(c, &at, &m[q]);
}

/* A pinned host region the batch copies into or out of (validated, not posted yet). */
static void batch_note_pinned(CudaBatch *b, CudaRegion *cr) {
        if (!cr->pinned || b->wide)
                return;
        for (unsigned i = 0; i < b->n_pinned; i++)
                if (b->pinned[i] == cr)
                        return;
        if (b->n_pinned < BATCH_PINNED_MAX)
                b->pinned[b->n_pinned++] = cr;
        else
                b->wide = true;
}

/* The batch went to the engine (in flight) or finished (±1). */
static void batch_hold_pinned(CudaTransport *c, CudaBatch *b, int d) {
        if (b->wide)
                c->wide_in_flight += (size_t)d;
        else
                for (unsigned i = 0; i < b->n_pinned; i++)
                        b->pinned[i]->batches += (unsigned)d;
}

/* Moves finished batches from the engine into completions (batch_complete()). Room for
 * every write in flight was reserved at post time. Returns how many batches were
 * reaped. */
static size_t reap_into_ready(CudaTransport *c) {
        GpuCopyDone d[16];
        size_t m, total = 0;

        while ((m = gpu_copy_reap(c->engine, d, ELEMENTSOF(d))) > 0) {
                for (size_t i = 0; i < m; i++) {
                        CudaBatch *b = (CudaBatch *)(uintptr_t)d[i].cookie;

                        if (d[i].error < 0 && b->error == 0)
                                b->error = d[i].error;
                        b->bytes += d[i].bytes;
                        if (++b->parts_done < b->parts)
                                continue;
                        if (b->error < 0)
                                c->base.stats.failures += b->n;
                        else
                                c->base.stats.bytes += b->bytes;
                        batch_complete(c, b);
                        c->n_in_flight -= b->n;
                        batch_hold_pinned(c, b, -1);
                        batch_put(c, b);
                }
                total += m;
        }
        return total;
}

static void cuda_region_free(CudaTransport *c, CudaRegion *cr) {
        if (cr->pinned) {
                /* Unpinning under a copy in flight would fault it: let the batches that
                 * copy into or out of this region finish (on the caller's thread, epdd's
                 * loop: a staging buffer given up for room is idle, so there are none
                 * then), not every batch on the engine. */
                while ((cr->batches > 0 || c->wide_in_flight > 0) && gpu_copy_engine_in_flight(c->engine) > 0) {
                        /* It does not give up: a poll() that fails sleeps instead. */
                        (void)gpu_copy_wait(c->engine, 1000);
                        (void)reap_into_ready(c);
                }
                /* The reaps drained the completion fd: the loop learns of what they left
                 * in the ready queue only if the fd is readable again. */
                if (c->n_ready > 0)
                        gpu_copy_engine_kick(c->engine);
                (void)gpu_host_unregister(c->system, cr->region->host_base);
        }
        gpu_arena_unref(cr->arena); /* batches in flight hold their own references */
        free(cr);
}

static void cuda_unregister_region(Transport *t, TransportRegion *r) {
        CudaTransport *c = to_cuda(t);
        CudaRegion *cr = hashmap_remove(c->regions, &(uint64_t) { r->id });

        if (cr)
                cuda_region_free(c, cr);
}

static int seg_side(CudaRegion *cr, uint64_t offset, uint64_t length, GpuArena **arena,
                    void **host) {
        if (offset > cr->region->size || length > cr->region->size - offset)
                return -ERANGE;
        if (cr->arena)
                *arena = cr->arena;
        else
                *host = cr->region->host_base;
        return 0;
}

static int cuda_post(Transport *t, void *peer, const TransportWrite *w, size_t n) {
        CudaTransport *c = to_cuda(t);
        GpuCopySeg *segs;
        CudaBatch *b;
        int r;

        if (peer)
                return -EOPNOTSUPP; /* same host only */
        if (n == 0 || !w)
                return -EINVAL;
        if (MIN(n, c->part_max) > c->segs_cap) {
                GpuCopySeg *m = realloc(c->segs, MIN(n, c->part_max) * sizeof *m);
                if (!m)
                        return -ENOMEM;
                c->segs = m;
                c->segs_cap = MIN(n, c->part_max);
        }
        segs = c->segs;
        b = batch_get(c, n);
        if (!b)
                return -ENOMEM;
        /* A completion slot for every write is reserved up front, so that poll never has
         * to drop one. */
        if (c->n_ready + c->n_in_flight + n > c->ready_cap) {
                size_t cap = MAX(c->ready_cap * 2, c->n_ready + c->n_in_flight + n + 64);
                TransportCompletion *q = malloc(cap * sizeof *q);
                if (!q) {
                        r = -ENOMEM;
                        goto fail;
                }
                for (size_t i = 0; i < c->n_ready; i++)
                        q[i] = c->ready[(c->ready_head + i) % c->ready_cap];
                free(c->ready);
                c->ready = q;
                c->ready_cap = cap;
                c->ready_head = 0;
        }

        /* Every write is checked before any part goes: a bad one refuses the whole
         * batch, with nothing in flight (as every transport's post does). */
        CudaRegion *src = NULL, *dst = NULL;
        for (size_t i = 0; i < n; i++) {
                /* A batch nearly always names the same two regions: look up only changes. */
                if (!src || src->id != w[i].src_region)
                        src = hashmap_get(c->regions, &(uint64_t) { w[i].src_region });
                if (!dst || dst->id != w[i].dst_region)
                        dst = hashmap_get(c->regions, &(uint64_t) { w[i].dst_region });
                if (!src || !dst) {
                        r = -ENOENT;
                        goto fail;
                }
                batch_note_pinned(b, src);
                batch_note_pinned(b, dst);
                if (!src->arena && !dst->arena) {
                        r = -EINVAL; /* host → host: the local transport's */
                        goto fail;
                }
                if (w[i].src_offset > src->region->size || w[i].length > src->region->size - w[i].src_offset ||
                    w[i].dst_offset > dst->region->size || w[i].length > dst->region->size - w[i].dst_offset) {
                        r = -ERANGE;
                        goto fail;
                }
                /* What the engine refuses (seg_validate), refused here for the whole batch:
                 * found in a later part, earlier parts would already be on the GPU. */
                if (w[i].length == 0 ||
                    (src == dst && w[i].src_offset < w[i].dst_offset + w[i].length &&
                     w[i].dst_offset < w[i].src_offset + w[i].length)) {
                        r = -EINVAL;
                        goto fail;
                }
        }

        /* Small first parts get an idle GPU going within microseconds; behind work still
         * in flight (the handoff's previous layer group) the GPU is busy anyway, and each
         * part costs its descriptors' upload between two kernels: whole parts then. */
        size_t part0 = 0, part_len = gpu_copy_engine_in_flight(c->engine) > 0 ? c->part_max : c->part_first;
        src = dst = NULL;
        for (size_t i = 0; i < n; i++) {
                GpuCopySeg *sg = &segs[i - part0];

                if (!src || src->id != w[i].src_region)
                        src = hashmap_get(c->regions, &(uint64_t) { w[i].src_region });
                if (!dst || dst->id != w[i].dst_region)
                        dst = hashmap_get(c->regions, &(uint64_t) { w[i].dst_region });
                *sg = (GpuCopySeg) {
                        .src_offset = w[i].src_offset,
                        .dst_offset = w[i].dst_offset,
                        .length = w[i].length,
                };
                (void)seg_side(src, w[i].src_offset, w[i].length, &sg->src, &sg->src_host);
                (void)seg_side(dst, w[i].dst_offset, w[i].length, &sg->dst, &sg->dst_host);
                b->cookies[i] = w[i].cookie;
                b->lengths[i] = w[i].length;
                if (i + 1 - part0 < part_len && i + 1 < n)
                        continue;
                /* A part is ready: to the engine now, so the GPU works on it while the
                 * next one is prepared. Writes that continue each other (adjacent pages
                 * of a run, on both sides) become one copy: the copy engine costs
                 * microseconds per operation, whatever its size. The batch still
                 * completes every write with its own cookie. */
                r = gpu_copy_submit(c->engine, segs, gpu_copy_segs_coalesce(segs, i + 1 - part0),
                                    (uint64_t)(uintptr_t)b);
                if (r < 0) {
                        if (b->parts == 0)
                                goto fail;
                        /* Earlier parts are in flight: the batch completes when they
                         * have, every write with this error (the rest is never copied),
                         * each under its own cookie. */
                        b->error = r;
                        for (size_t j = i + 1; j < n; j++) {
                                b->cookies[j] = w[j].cookie;
                                b->lengths[j] = w[j].length;
                        }
                        break;
                }
                b->parts++;
                part0 = i + 1;
                part_len = MIN(2 * part_len, c->part_max);
        }
        b->n = n;
        c->n_in_flight += n;
        batch_hold_pinned(c, b, +1); /* reaped on this thread only: not before this */
        t->stats.batches++;
        t->stats.writes += n;
        return 0;

fail:
        batch_put(c, b);
        return r;
}

static int cuda_completion_fd(Transport *t) {
        return gpu_copy_engine_fd(to_cuda(t)->engine);
}

static size_t cuda_poll(Transport *t, TransportCompletion *out, size_t n) {
        CudaTransport *c = to_cuda(t);
        size_t k = 0;

        do {
                while (k < n && c->n_ready > 0) {
                        /* The ready entries up to the ring's end (or the count) in one copy. */
                        size_t m = MIN(MIN(n - k, c->n_ready), c->ready_cap - c->ready_head);
                        memcpy(out + k, c->ready + c->ready_head, m * sizeof *out);
                        k += m;
                        c->n_ready -= m;
                        c->ready_head += m;
                        if (c->ready_head == c->ready_cap)
                                c->ready_head = 0;
                }
        } while (k < n && reap_into_ready(c) > 0);
        /* Completions left for the next call (this one's out was full): keep the fd
         * readable for them, whatever the caller's loop does until then. */
        if (c->n_ready > 0)
                gpu_copy_engine_kick(c->engine);
        return k;
}

static void cuda_cancel_peer(Transport *t, void *peer) {
        /* Same-host copies have no peer to lose; a copy on the copy engine cannot be
         * recalled, and it completes normally. */
}

static void cuda_free(Transport *t) {
        CudaTransport *c;
        size_t i = 0;
        void *v;

        if (!t)
                return;
        c = to_cuda(t);
        /* Waits for everything in flight; the completions are dropped with it. */
        if (c->engine && c->ready)
                while (gpu_copy_engine_in_flight(c->engine) > 0 &&
                       gpu_copy_wait(c->engine, 1000) >= 0)
                        (void)reap_into_ready(c);
        if (c->regions) {
                while (hashmap_iterate(c->regions, &i, &v, NULL)) {
                        CudaRegion *cr = v;
                        if (cr->pinned)
                                (void)gpu_host_unregister(c->system, cr->region->host_base);
                        cr->pinned = false;
                        gpu_arena_unref(cr->arena);
                        free(cr);
                }
                hashmap_free(c->regions);
        }
        gpu_copy_engine_free(c->engine);
        for (size_t k = 0; k < c->n_spare; k++)
                batch_free(c->spare[k]);
        free(c->segs);
        free(c->ready);
        free(c);
}

static const TransportOps cuda_ops = {
        .kind = TRANSPORT_CUDA,
        .name = "cuda",
        .register_region = cuda_register_region,
        .unregister_region = cuda_unregister_region,
        .post = cuda_post,
        .completion_fd = cuda_completion_fd,
        .poll = cuda_poll,
        .cancel_peer = cuda_cancel_peer,
        .free = cuda_free,
};

int cuda_transport_new(GpuSystem *system, CudaArenaLookup lookup, void *userdata, Transport **ret) {
        CudaTransport *c;
        int r;

        c = calloc(1, sizeof *c);
        if (!c)
                return -ENOMEM;
        c->base.ops = &cuda_ops;
        c->part_first = POST_PART_FIRST;
        c->part_max = POST_PART;
        c->system = system;
        c->lookup = lookup;
        c->lookup_userdata = userdata;
        c->regions = hashmap_new(HASHMAP_KEY_U64, 0);
        if (!c->regions) {
                free(c);
                return -ENOMEM;
        }
        r = gpu_copy_engine_new(system, &c->engine);
        if (r < 0) {
                cuda_free(&c->base);
                return r;
        }
        *ret = &c->base;
        return 0;
}

GpuCopyEngine *cuda_transport_engine(Transport *t) {
        return to_cuda(t)->engine;
}

void cuda_transport_set_parts(Transport *t, size_t first, size_t max) {
        CudaTransport *c = to_cuda(t);

        c->part_max = CLAMP(max, (size_t)1, (size_t)65536);
        c->part_first = CLAMP(first, (size_t)1, c->part_max);
}
