/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include "core/manager.h"
#include "copy.h"
#include "pages/pages.h"

extern const Subsystem gpu_subsystem;

/* Copy-on-write of n pages of `length` bytes within GPU arena number `arena` of the
 * Manager `userdata` (dst[i] <- src[i], arena offsets), off the event loop: a
 * PageCopyAsyncFn (pages.h). The copies go to the copy engine at once and the call
 * returns; done(done_userdata, error) runs later on the event loop, once all of them
 * have finished (error: 0 or the first failure). Nothing is queued, and done never
 * runs, when it fails (-ERANGE outside the arena, -ENODEV without a GPU domain). */
int gpu_manager_page_copy_async(void *userdata, uint32_t arena, const uint64_t *dst, const uint64_t *src,
                                size_t n, uint64_t length, PageCopyDoneFn done, void *done_userdata);
/* Waits for every such copy still in flight and runs its done: the page manager's
 * shutdown, before its pools go. */
void gpu_manager_page_copy_drain(Manager *m);

/* The copy engines' counters (the handoffs' and the copy-on-write one), NULL for an
 * engine that does not exist (no GPU domain). */
void gpu_manager_copy_stats(Manager *m, const GpuCopyStats **ret_handoff, const GpuCopyStats **ret_cow);

/* Each counter of GpuCopyStats as org.epd1.Gpu.CopyCounters names it (the copy-on-write
 * engine's with "cow-" before) and as Prometheus exports it, by engine (metric NULL: on
 * the bus only). */
typedef struct GpuCopyCounter {
        const char *name;
        const char *metric, *unit, *help;
        size_t offset;
} GpuCopyCounter;
extern const GpuCopyCounter gpu_copy_counters[];
extern const size_t gpu_copy_counters_n;

static inline uint64_t gpu_copy_counter_value(const GpuCopyStats *st, const GpuCopyCounter *c) {
        return *(const uint64_t *)((const uint8_t *)st + c->offset);
}
