/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Contiguous region allocator for one feature arena. Features are variable-size and
 * each must be one contiguous byte range of the arena fd (a worker maps the arena once
 * and reads a tensor at base + offset), so the arena is cut into fixed chunks
 * (ArenaConfig.page_size) and regions are runs of chunks.
 *
 * The algorithm is two-level segregated fit (TLSF, Masmano et al. 2004): free runs are
 * kept in 16 lists per power of two; allocation takes the first run from the smallest
 * non-empty class that is guaranteed to fit (two bitmap scans, O(1)), splits it, and
 * freeing coalesces with both neighbours in O(1) through boundary tags. All metadata
 * lives outside the arena (the arena may be GPU memory that the daemon never maps):
 * 17 bytes per chunk.
 *
 * Pure: no I/O, not thread-safe (the daemon's event loop owns it). */

#include <stdbool.h>
#include <stdint.h>

typedef struct FeatureAllocator FeatureAllocator;

/* Manages [base, base + size) in units of chunk bytes (size is rounded down to whole
 * chunks). chunk must be a power of two; -EINVAL otherwise or if nothing fits. */
int feature_allocator_new(uint64_t base, uint64_t size, uint64_t chunk, FeatureAllocator **ret);
FeatureAllocator *feature_allocator_free(FeatureAllocator *a);

/* Allocates bytes (rounded up to chunks) as one contiguous run. Returns the absolute
 * offset (base + ...) and the rounded length. -EINVAL for 0 bytes, -ENOSPC when no run
 * is large enough (the total may still be). */
int feature_allocator_alloc(FeatureAllocator *a, uint64_t bytes, uint64_t *ret_offset,
                            uint64_t *ret_length);
/* Frees a run returned by alloc. -EINVAL if offset is not the start of an allocated
 * run (double free, or never allocated): nothing changes then. */
/* Allocates exactly the chunks of [offset, offset + bytes) (restore after a restart).
 * -EBUSY if any of them is in use, -EINVAL/-ERANGE for a region outside the arena. */
int feature_allocator_alloc_at(FeatureAllocator *a, uint64_t offset, uint64_t bytes, uint64_t *ret_length);
int feature_allocator_release(FeatureAllocator *a, uint64_t offset);

uint64_t feature_allocator_chunk(const FeatureAllocator *a);
uint64_t feature_allocator_total(const FeatureAllocator *a);
uint64_t feature_allocator_used(const FeatureAllocator *a);
uint64_t feature_allocator_n_allocations(const FeatureAllocator *a);
/* Bytes of metadata kept outside the arena. */
uint64_t feature_allocator_overhead(const FeatureAllocator *a);
/* Length of the largest free run, in bytes (O(number of chunks); for tests/stats). */
uint64_t feature_allocator_largest_free(const FeatureAllocator *a);

/* The first free run that starts at or after the run holding offset from (the arena's
 * start for an offset below it): its offset and
 * length in bytes; -ENOENT when there is none (O(runs walked): for the fence after a
 * restart, not per request). */
int feature_allocator_next_free(const FeatureAllocator *a, uint64_t from, uint64_t *ret_offset,
                                uint64_t *ret_length);
/* Walks every run and checks every invariant (tags, lists, bitmaps, counters, no two
 * adjacent free runs). Returns 0 or -EUCLEAN. For tests. */
int feature_allocator_check(const FeatureAllocator *a);

static inline void feature_allocator_freep(FeatureAllocator **a) {
        feature_allocator_free(*a);
}
