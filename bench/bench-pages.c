/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* bench-pages: what sharing KV pages buys, against limits measured in the same run.
 *
 *   1. Clone of a 64 MiB agent KV state (64 pages of 1 MiB: 32 layers x 16 tokens x
 *      (1024 + 1024) bytes, bf16) versus a deep copy of the same bytes with memcpy;
 *      bytes copied at clone time are counted through the copy callback (must be 0).
 *      Then the first write to one page of the clone: one page copied.
 *   2. Page alloc+free rate on a pool of 1M pages, versus a bare free list of ids.
 *   3. Directory lookup rate (longest-prefix walks with pin and unpin) over 1M cached
 *      blocks, versus bare hash-table gets of the same keys.
 *   Afterwards: retained pages and orphan directory entries, which must both be 0.
 *
 * Usage: bench-pages [--quick]   (--quick: fewer repetitions, for CI smoke runs) */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pages/directory.h"
#include "hashmap.h"
#include "pages/kvlayout.h"
#include "pages/pages.h"
#include "pages/sequence.h"
#include "time-util.h"

static uint64_t bytes_copied;

typedef struct HostArena {
        uint8_t *base;
} HostArena;

static int host_copy(void *userdata, uint64_t dst, uint64_t src, uint64_t length) {
        HostArena *a = userdata;
        memcpy(a->base + dst, a->base + src, length);
        bytes_copied += length;
        return 0;
}

static double now_s(void) {
        return (double)now_nsec(CLOCK_MONOTONIC) / 1e9;
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static double median(double *v, size_t n) {
        qsort(v, n, sizeof *v, cmp_double);
        return v[n / 2];
}

static volatile uint64_t sink;

#define CHECK(expr)                                                                      \
        do {                                                                             \
                if (!(expr)) {                                                           \
                        fprintf(stderr, "bench-pages: %s:%d: %s failed\n", __FILE__,     \
                                __LINE__, #expr);                                        \
                        exit(EXIT_FAILURE);                                              \
                }                                                                        \
        } while (0)

static void bench_clone(bool quick) {
        KvLayout l;
        const size_t state_pages = 64;
        const size_t reps = quick ? 5 : 21;
        const size_t clone_reps = quick ? 2000 : 20000;

        CHECK(kv_layout_init(&l, 32, 16, 1024, 1024, "bfloat16", NULL) == 0);
        CHECK(l.page_size == 1 << 20);
        const uint64_t state_bytes = state_pages * l.page_size;
        /* Arena: the state, room for copy-on-write, and a separate deep-copy target. */
        const size_t arena_pages = state_pages + 8;
        HostArena a = { .base = aligned_alloc(4096, arena_pages * l.page_size) };
        uint8_t *copy_dst = aligned_alloc(4096, state_bytes);
        CHECK(a.base && copy_dst);
        memset(a.base, 0x5a, arena_pages * l.page_size); /* fault everything in */
        memset(copy_dst, 0, state_bytes);

        PagePool *pool;
        Sequence *s, *c;
        CHECK(page_pool_new(arena_pages, l.page_size, 0, &pool) == 0);
        CHECK(sequence_new(pool, &s) == 0);
        CHECK(sequence_append(s, state_pages, NULL) == 0);
        for (size_t i = 0; i < state_pages; i++)
                memset(a.base + page_offset(pool, s->pages[i]), (int)i, l.page_size);

        /* The limit: a deep copy of the same bytes. */
        double t[64];
        for (size_t r = 0; r < reps; r++) {
                double t0 = now_s();
                for (size_t i = 0; i < state_pages; i++)
                        memcpy(copy_dst + i * l.page_size, a.base + page_offset(pool, s->pages[i]), l.page_size);
                t[r] = now_s() - t0;
                sink += copy_dst[r];
        }
        double deep = median(t, reps);

        /* Clone (and release the clone), many times. */
        bytes_copied = 0;
        for (size_t r = 0; r < reps; r++) {
                double t0 = now_s();
                for (size_t k = 0; k < clone_reps; k++) {
                        CHECK(sequence_clone(s, &c) == 0);
                        sequence_free(c);
                }
                t[r] = (now_s() - t0) / (double)clone_reps;
        }
        double clone = median(t, reps);
        uint64_t clone_copied = bytes_copied;

        /* Clone alone (without its release), once, for the record. */
        double t0 = now_s();
        CHECK(sequence_clone(s, &c) == 0);
        double clone_once = now_s() - t0;
        PagePoolStats st;
        page_pool_stats(pool, &st);
        CHECK(st.shared == state_pages);

        /* The first write to one page of the clone copies exactly that page. */
        PageId w;
        size_t copied;
        bytes_copied = 0;
        t0 = now_s();
        CHECK(sequence_prepare_write(c, 7, 1, host_copy, &a, &w, &copied) == 0);
        double cow = now_s() - t0;
        CHECK(copied == 1 && bytes_copied == l.page_size);
        CHECK(a.base[page_offset(pool, w)] == 7);

        printf("clone of a %" PRIu64 " MiB KV state (%zu pages of %" PRIu64 " KiB):\n", state_bytes >> 20,
               state_pages, l.page_size >> 10);
        printf("  limit   deep copy (memcpy)     %10.3f ms   %6.2f GB/s\n", deep * 1e3,
               (double)state_bytes / deep / 1e9);
        printf("  epd     clone + release        %10.3f us   bytes copied at clone: %" PRIu64 "\n",
               clone * 1e6, clone_copied);
        printf("          (one cold clone        %10.3f us)\n", clone_once * 1e6);
        printf("  ratio   deep copy / clone      %10.0fx\n", deep / clone);
        printf("  first write to 1 page of the clone: %" PRIu64 " bytes copied in %.3f ms\n", bytes_copied,
               cow * 1e3);

        sequence_free(c);
        sequence_free(s);
        CHECK(page_pool_retained(pool) == 0);
        CHECK(page_pool_verify(pool) == 0);
        page_pool_free(pool);
        free(a.base);
        free(copy_dst);
}

static void bench_alloc(bool quick, PagePool **ret_pool) {
        const size_t n = 1 << 20;
        const size_t reps = quick ? 3 : 9;
        PagePool *pool;
        PageId *ids = malloc(n * sizeof *ids);
        uint32_t *stack = malloc(n * sizeof *stack);
        double t[16];
        CHECK(ids && stack);
        CHECK(page_pool_new(n, 4096, 0, &pool) == 0);

        /* The limit: the bare free list that any O(1) allocator of fixed-size slots is,
         * ids threaded through a next[] array, with no refcount or statistics. */
        uint32_t head = 0;
        for (size_t i = 0; i < n; i++)
                stack[i] = i + 1 < n ? (uint32_t)(i + 1) : UINT32_MAX;
        for (size_t r = 0; r < reps; r++) {
                double t0 = now_s();
                for (size_t i = 0; i < n; i++) {
                        ids[i] = head;
                        head = stack[head];
                        __asm__ volatile("" : "+r"(head));
                }
                for (size_t i = n; i > 0; i--) {
                        stack[ids[i - 1]] = head;
                        head = ids[i - 1];
                        __asm__ volatile("" : "+r"(head));
                }
                t[r] = now_s() - t0;
                sink += ids[r];
        }
        double limit = median(t, reps);

        for (size_t r = 0; r < reps; r++) {
                double t0 = now_s();
                for (size_t i = 0; i < n; i++)
                        if (page_pool_alloc(pool, &ids[i]) < 0)
                                abort();
                for (size_t i = 0; i < n; i++)
                        if (page_unref(pool, ids[i]) < 0)
                                abort();
                t[r] = now_s() - t0;
        }
        double epd = median(t, reps);
        CHECK(page_pool_free_count(pool) == n);

        printf("page alloc + free, pool of %zu pages:\n", n);
        printf("  limit   bare free list         %10.1f M ops/s\n", 2.0 * (double)n / limit / 1e6);
        printf("  epd     page_pool_alloc/unref  %10.1f M ops/s   (achieved/limit %.2f)\n",
               2.0 * (double)n / epd / 1e6, limit / epd);
        free(ids);
        free(stack);
        *ret_pool = pool;
}

static void bench_directory(bool quick, PagePool *pool) {
        const size_t n = page_pool_size(pool);
        const size_t chain = 1024, lookups = quick ? 256 : 2048;
        const size_t reps = quick ? 3 : 7;
        Directory *d;
        Sequence *s;
        uint64_t *hashes = malloc(n * sizeof *hashes);
        PageId *got = malloc(chain * sizeof *got);
        double t[16];
        CHECK(hashes && got);

        /* 1M blocks of one long prompt, chained like vLLM's block hashes. */
        uint64_t parent = 0;
        for (size_t i = 0; i < n; i++) {
                uint64_t block[2] = { parent, i % 7 /* repetitive tokens */ };
                parent = hashes[i] = hashmap_hash_bytes(block, sizeof block);
        }
        CHECK(directory_new(&d) == 0);
        directory_attach_pool(d, pool);
        CHECK(sequence_new(pool, &s) == 0);
        CHECK(sequence_append(s, n, NULL) == 0);
        double t0 = now_s();
        CHECK(directory_insert_chain(d, pool, hashes, s->pages, n) == (int)n);
        double insert = now_s() - t0;
        sequence_free(s); /* every page is now cached and IDLE */
        CHECK(page_pool_retained(pool) == n);

        /* The limit: bare gets of the same keys in a table of the same size. */
        Hashmap *h = hashmap_new(HASHMAP_KEY_U64, 0);
        CHECK(h);
        for (size_t i = 0; i < n; i++)
                CHECK(hashmap_put(h, &hashes[i], &hashes[i]) == 0);
        uint64_t x = 88172645463325252ULL;
        for (size_t r = 0; r < reps; r++) {
                double t1 = now_s();
                for (size_t k = 0; k < lookups; k++) {
                        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                        size_t start = x % (n - chain);
                        for (size_t i = 0; i < chain; i++)
                                sink += (uintptr_t)hashmap_get(h, &hashes[start + i]);
                }
                t[r] = now_s() - t1;
        }
        double limit = median(t, reps);

        DirectoryStats before, after;
        directory_stats(d, &before);
        for (size_t r = 0; r < reps; r++) {
                double t1 = now_s();
                for (size_t k = 0; k < lookups; k++) {
                        size_t len;
                        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
                        size_t start = x % (n - chain);
                        CHECK(directory_lookup(d, pool, hashes + start, chain, got, &len) == 0 && len == chain);
                        for (size_t i = 0; i < len; i++)
                                (void)page_unref(pool, got[i]);
                }
                t[r] = now_s() - t1;
        }
        double epd = median(t, reps);
        directory_stats(d, &after);
        double blocks = (double)(lookups * chain);

        printf("directory, %zu cached blocks (insert %.1f M/s):\n", n, (double)n / insert / 1e6);
        printf("  limit   bare hashmap_get       %10.1f M blocks/s\n", blocks / limit / 1e6);
        printf("  epd     lookup + pin + unpin   %10.1f M blocks/s   (achieved/limit %.2f)\n",
               blocks / epd / 1e6, limit / epd);
        printf("          probes per block: %.3f\n",
               (double)(after.probes - before.probes) / (blocks * (double)reps));

        /* Everything goes back. */
        directory_clear(d);
        size_t orphans = directory_orphans(d);
        printf("after the run: retained pages %" PRIu64 ", directory entries %zu, orphan entries %zu\n",
               page_pool_retained(pool), directory_size(d), orphans);
        CHECK(page_pool_retained(pool) == 0 && directory_size(d) == 0 && orphans == 0);
        CHECK(page_pool_verify(pool) == 0);
        directory_free(d);
        hashmap_free(h);
        free(hashes);
        free(got);
}

int main(int argc, char *argv[]) {
        bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
        PagePool *pool;

        bench_clone(quick);
        bench_alloc(quick, &pool);
        bench_directory(quick, pool);
        page_pool_free(pool);
        return EXIT_SUCCESS;
}
