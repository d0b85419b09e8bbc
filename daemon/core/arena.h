/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* An arena is one region of memory in one domain, created at start from config and
 * mapped by every worker that may use it through an fd passed over D-Bus. Host arenas
 * are memfds (hugetlb when configured and available); GPU arenas are CUDA VMM
 * allocations exported as POSIX fds (gpu/). The first `data_offset` bytes of a host
 * arena hold an ArenaHeader that workers can read to check what they mapped. */

#include <stdbool.h>
#include <stdint.h>

#include "transport/transport.h"

typedef struct PagePool PagePool;
typedef struct GpuArena GpuArena;

typedef enum ArenaUsage {
        ARENA_USAGE_KV,      /* KV pages */
        ARENA_USAGE_FEATURE, /* feature buffers */
        _ARENA_USAGE_MAX,
} ArenaUsage;

typedef enum HugePages {
        HUGEPAGES_NO,
        HUGEPAGES_TRY,
        HUGEPAGES_YES,
} HugePages;

#define EPD_ARENA_MAGIC "EPDARENA"
#define EPD_ARENA_HEADER_VERSION 1

typedef struct ArenaHeader {
        char magic[8];          /* EPD_ARENA_MAGIC */
        uint32_t version;       /* EPD_ARENA_HEADER_VERSION */
        uint32_t index;
        uint64_t size;          /* whole arena */
        uint64_t data_offset;   /* first byte of pages */
        uint64_t page_size;     /* 0 until a layout defines it */
        char name[32];
        char host_id[64];
        uint64_t generation;    /* bumped every time epdd (re)maps it */
} ArenaHeader;

typedef struct ArenaConfig {
        char *name;
        MemoryDomain domain;
        ArenaUsage usage;
        uint64_t size;
        HugePages hugepages;
        int numa_node;          /* -1: any */
        int gpu;                /* for MEMORY_GPU: ordinal */
        uint64_t page_size;     /* for feature arenas: chunk size; KV: from layout */
        bool prefault;          /* host: allocate (and map in epdd) every page at start */
} ArenaConfig;

typedef struct Arena {
        uint32_t index;
        char *name;
        MemoryDomain domain;
        ArenaUsage usage;
        uint64_t size;          /* rounded to the allocation granularity */
        uint64_t data_offset;
        bool hugepages;         /* backed by hugetlb pages */
        bool adopted;           /* taken back from the fd store: its bytes are the old ones */
        int fd;                 /* memfd or exported VMM handle */
        void *base;             /* host: the daemon's mapping */
        GpuArena *gpu;          /* GPU: the VMM allocation */
        PagePool *pages;        /* created when the first layout arrives (pages.h) */
        TransportRegion region;
} Arena;

/* Rounds a requested size up to what the arena will really hold (hugepage or page
 * granularity), with overflow and minimum checks. Pure; unit-tested. */
int arena_size_round(uint64_t requested, uint64_t granularity, uint64_t *ret);
uint64_t arena_header_size(uint64_t granularity);

int arena_new_host(const ArenaConfig *c, uint32_t index, const char *host_id, Arena **ret);
/* Re-adopts an arena fd handed back by systemd's fd store after a restart. */
int arena_adopt_host(const ArenaConfig *c, uint32_t index, int fd, const char *host_id, Arena **ret);
/* The host arena of slot index: taken back from the fd store (the newest stored copy that
 * holds it, under arena-<name>; *ret_adopted true), else fresh memory, the name's stored
 * copies dropped. A stored copy that is the arena's but cannot be mapped now fails it
 * (-errno): fresh memory would lose its pages for good, and the fd stays stored. */
struct FdStore;
int arena_take_or_new_host(struct FdStore *store, const ArenaConfig *c, uint32_t index, const char *host_id,
                           Arena **ret, bool *ret_adopted);
Arena *arena_free(Arena *a);

/* Bytes usable for pages. */
static inline uint64_t arena_data_size(const Arena *a) {
        return a->size - a->data_offset;
}

const char *arena_usage_to_string(ArenaUsage u);
int arena_usage_from_string(const char *s);
const char *memory_domain_to_string(MemoryDomain d);
