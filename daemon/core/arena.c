/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/arena.h"
#include "core/fdstore.h"

#include <errno.h>
#include <inttypes.h>
#include <fcntl.h>
#include <linux/memfd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "log.h"
#include "macro.h"
#include "time-util.h"

#define HOST_PAGE 4096ULL
#define HUGE_PAGE (2ULL << 20)
#define ARENA_MIN_SIZE (64ULL << 10)
#define ARENA_MAX_SIZE (1ULL << 46)

static const char *const usage_names[_ARENA_USAGE_MAX] = {
        [ARENA_USAGE_KV] = "kv",
        [ARENA_USAGE_FEATURE] = "feature",
};

const char *arena_usage_to_string(ArenaUsage u) {
        return u < _ARENA_USAGE_MAX ? usage_names[u] : NULL;
}

int arena_usage_from_string(const char *s) {
        for (int i = 0; i < _ARENA_USAGE_MAX; i++)
                if (s && strcmp(s, usage_names[i]) == 0)
                        return i;
        return -EINVAL;
}

const char *memory_domain_to_string(MemoryDomain d) {
        return d == MEMORY_GPU ? "gpu" : "host";
}

uint64_t arena_header_size(uint64_t granularity) {
        return ALIGN_TO((uint64_t)sizeof(ArenaHeader), granularity);
}

int arena_size_round(uint64_t requested, uint64_t granularity, uint64_t *ret) {
        if (granularity == 0 || !IS_POWER_OF_2(granularity))
                return -EINVAL;
        if (requested < ARENA_MIN_SIZE)
                return -ERANGE;
        if (requested > ARENA_MAX_SIZE)
                return -E2BIG;
        uint64_t total;
        /* Room for the header page in front of the data. */
        if (ADD_OVERFLOW(requested, arena_header_size(granularity), &total))
                return -E2BIG;
        *ret = ALIGN_TO(total, granularity);
        return 0;
}

#define NUMA_MASK_WORDS 16

static int numa_mask(int node, unsigned long mask[static NUMA_MASK_WORDS]) {
        memset(mask, 0, NUMA_MASK_WORDS * sizeof *mask);
        if (node < 0 || node >= (int)(NUMA_MASK_WORDS * 8 * sizeof(unsigned long)))
                return -EINVAL;
        mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
        return 0;
}

static int bind_numa(void *p, uint64_t size, int node) {
        unsigned long mask[NUMA_MASK_WORDS];
        if (node < 0)
                return 0;
        if (numa_mask(node, mask) < 0)
                return -EINVAL;
        /* MPOL_BIND = 2; the raw syscall avoids a libnuma dependency. */
        if (syscall(SYS_mbind, p, size, 2, mask, NUMA_MASK_WORDS * 8 * sizeof(unsigned long), 0) < 0)
                return -errno;
        return 0;
}

static void write_header(Arena *a, const char *host_id) {
        ArenaHeader *h = a->base;
        uint64_t generation = 0;
        if (memcmp(h->magic, EPD_ARENA_MAGIC, 8) == 0)
                generation = h->generation + 1;
        memset(h, 0, sizeof *h);
        memcpy(h->magic, EPD_ARENA_MAGIC, 8);
        h->version = EPD_ARENA_HEADER_VERSION;
        h->index = a->index;
        h->size = a->size;
        h->data_offset = a->data_offset;
        snprintf(h->name, sizeof h->name, "%s", a->name);
        snprintf(h->host_id, sizeof h->host_id, "%s", host_id ? host_id : "");
        h->generation = generation;
}

static int arena_map(Arena *a, const ArenaConfig *c) {
        void *p = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
        if (p == MAP_FAILED)
                return log_error_errno(errno, "Failed to map arena '%s' (%" PRIu64 " bytes): %m",
                                       a->name, a->size);
        a->base = p;
        int r = bind_numa(p, a->size, c->numa_node);
        if (r < 0)
                log_warning_errno(r, "Arena '%s': cannot bind to NUMA node %d, using any: %m",
                                  a->name, c->numa_node);
        a->region = (TransportRegion){
                .id = a->index,
                .domain = MEMORY_HOST,
                .gpu_ordinal = -1,
                .host_base = a->base,
                .size = a->size,
        };
        return 0;
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Prefault=yes: every page of the memfd is allocated now (fallocate, under the mapping's
 * NUMA policy, touching no byte an adopted arena holds), so that memory short fails the
 * start instead of a worker's first write, and no first write pays the allocation. Then
 * epdd's own mapping is populated (write faults: the pages are cleared now, and its page
 * table, 2 MiB a GiB, is filled), so that its sends and receives take no fault either; a
 * kernel without MADV_POPULATE_WRITE leaves that part to the first use. Huge pages were
 * allocated by memfd_sized() already. */
static int arena_prefault(Arena *a) {
        usec_t t0 = now_usec(CLOCK_MONOTONIC);

        if (!a->hugepages && fallocate(a->fd, 0, 0, (off_t)a->size) < 0)
                return log_error_errno(errno, "Arena '%s': Prefault=yes but %" PRIu64 " bytes cannot be allocated: %m",
                                       a->name, a->size);
        if (madvise(a->base, a->size, MADV_POPULATE_WRITE) < 0) {
                if (errno != EINVAL)
                        return log_error_errno(errno, "Arena '%s': Prefault=yes but its %" PRIu64
                                                      " bytes cannot be mapped in: %m", a->name, a->size);
                log_debug("Arena '%s': this kernel cannot populate a mapping (MADV_POPULATE_WRITE); its pages are "
                          "allocated, epdd maps them on first use.", a->name);
        }
        log_info("Arena '%s': %" PRIu64 " MiB prefaulted in %" PRIu64 " ms.", a->name, a->size >> 20,
                 (now_usec(CLOCK_MONOTONIC) - t0) / USEC_PER_MSEC);
        return 0;
}

static Arena *arena_alloc(const ArenaConfig *c, uint32_t index) {
        Arena *a = calloc(1, sizeof *a);
        if (!a)
                return NULL;
        a->index = index;
        a->domain = c->domain;
        a->usage = c->usage;
        a->fd = -EBADF;
        a->name = strdup(c->name);
        if (!a->name) {
                free(a);
                return NULL;
        }
        return a;
}

static int memfd_sized(const char *name, uint64_t size, bool huge, int numa_node) {
        char n[64];
        snprintf(n, sizeof n, "epd-arena-%s", name);
        unsigned flags = MFD_CLOEXEC | MFD_ALLOW_SEALING;
        if (huge)
                flags |= MFD_HUGETLB | MFD_HUGE_2MB;
        int fd = memfd_create(n, flags);
        if (fd < 0)
                return -errno;
        if (ftruncate(fd, (off_t)size) < 0) {
                int r = -errno;
                close(fd);
                return r;
        }
        if (huge) {
                /* hugetlb reservations can succeed at ftruncate and fail on fault:
                 * fault every huge page in now, while a failure can still fall back.
                 * The pages are allocated here, under this thread's policy: NumaNode= is
                 * applied around it (an mbind() of the mapping afterwards moved nothing,
                 * and hugetlb keeps no shared policy for later faults). */
                unsigned long mask[NUMA_MASK_WORDS], old_mask[NUMA_MASK_WORDS] = { 0 };
                const unsigned long bits = NUMA_MASK_WORDS * 8 * sizeof(unsigned long);
                int old_mode = 0;
                /* The thread's own policy (NUMAPolicy= of the unit, numactl) comes back
                 * afterwards, whatever it was. */
                bool bound = numa_node >= 0 && numa_mask(numa_node, mask) >= 0 &&
                             syscall(SYS_get_mempolicy, &old_mode, old_mask, bits, NULL, 0) == 0 &&
                             syscall(SYS_set_mempolicy, 2, mask, bits) == 0;
                int r = fallocate(fd, 0, 0, (off_t)size) < 0 ? -errno : 0;
                if (bound)
                        (void)syscall(SYS_set_mempolicy, old_mode, old_mode == 0 ? NULL : old_mask, old_mode == 0 ? 0 : bits);
                if (r < 0) {
                        close(fd);
                        return r;
                }
        }
        return fd;
}

int arena_new_host(const ArenaConfig *c, uint32_t index, const char *host_id, Arena **ret) {
        Arena *a = arena_alloc(c, index);
        int r;
        if (!a)
                return log_oom();

        bool huge = c->hugepages != HUGEPAGES_NO;
        uint64_t size;
        if (huge) {
                r = arena_size_round(c->size, HUGE_PAGE, &size);
                if (r >= 0) {
                        a->fd = memfd_sized(c->name, size, true, c->numa_node);
                        if (a->fd < 0 && c->hugepages == HUGEPAGES_YES) {
                                r = a->fd;
                                log_error_errno(r, "Arena '%s': HugePages=yes but %" PRIu64
                                                   " bytes of 2M huge pages are not available: %m",
                                                c->name, size);
                                arena_free(a);
                                return r;
                        }
                        if (a->fd < 0) {
                                log_notice_errno(a->fd, "Arena '%s': huge pages not available (%m), using normal pages.",
                                                 c->name);
                                huge = false;
                        } else {
                                a->size = size;
                                a->data_offset = arena_header_size(HUGE_PAGE);
                                a->hugepages = true;
                        }
                } else
                        huge = false;
        }
        if (!huge) {
                r = arena_size_round(c->size, HOST_PAGE, &size);
                if (r < 0) {
                        log_error_errno(r, "Arena '%s': Size=%" PRIu64 " is out of range: %m", c->name, c->size);
                        arena_free(a);
                        return r;
                }
                a->fd = memfd_sized(c->name, size, false, c->numa_node);
                if (a->fd < 0) {
                        r = log_error_errno(a->fd, "Arena '%s': cannot create %" PRIu64 " byte memfd: %m",
                                            c->name, size);
                        arena_free(a);
                        return r;
                }
                a->size = size;
                a->data_offset = arena_header_size(HOST_PAGE);
        }
        /* Workers must not resize the arena under the daemon. */
        (void)fcntl(a->fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
        r = arena_map(a, c);
        if (r >= 0 && c->prefault)
                r = arena_prefault(a);
        if (r < 0) {
                arena_free(a);
                return r;
        }
        write_header(a, host_id);
        *ret = a;
        return 0;
}

int arena_adopt_host(const ArenaConfig *c, uint32_t index, int fd, const char *host_id, Arena **ret) {
        struct stat st;
        Arena *a;
        int r;

        if (fstat(fd, &st) < 0)
                return -errno;
        /* Not an arena's file at all: dropped (a start that failed on it would fail on
         * every start after). */
        if (!S_ISREG(st.st_mode) || st.st_size < (off_t)sizeof(ArenaHeader))
                return log_error_errno(EBADMSG, "Stored fd for arena '%s' does not hold that arena.", c->name);
        a = arena_alloc(c, index);
        if (!a)
                return log_oom();
        a->fd = fd;
        a->size = (uint64_t)st.st_size;
        r = arena_map(a, c);
        if (r < 0) {
                a->fd = -EBADF; /* the caller still owns it */
                arena_free(a);
                return r;
        }
        ArenaHeader *h = a->base;
        if (a->size < sizeof *h || memcmp(h->magic, EPD_ARENA_MAGIC, 8) != 0 ||
            h->version != EPD_ARENA_HEADER_VERSION || h->size != a->size ||
            h->data_offset >= a->size || strncmp(h->name, c->name, sizeof h->name) != 0) {
                a->fd = -EBADF;
                arena_free(a);
                return log_error_errno(EBADMSG, "Stored fd for arena '%s' does not hold that arena.",
                                       c->name);
        }
        /* Only into the slot and shape it had: the WAL names arenas by index (another
         * slot would give this arena another one's sequences and directory entries), and
         * a changed Size= or HugePages= means fresh memory (docs/wal.md). */
        bool huge = h->data_offset >= HUGE_PAGE;
        uint64_t want = 0;
        if (h->index != index ||
            (huge ? c->hugepages == HUGEPAGES_NO : c->hugepages == HUGEPAGES_YES) ||
            arena_size_round(c->size, huge ? HUGE_PAGE : HOST_PAGE, &want) < 0 || want != a->size ||
            h->data_offset != arena_header_size(huge ? HUGE_PAGE : HOST_PAGE)) {
                uint32_t was = h->index;
                a->fd = -EBADF;
                arena_free(a);
                log_notice("Arena '%s': the stored one was slot %" PRIu32 " of %" PRIu64 " bytes%s, configured now "
                           "slot %" PRIu32 " of %" PRIu64 " bytes: starting from fresh memory.",
                           c->name, was, (uint64_t)st.st_size, huge ? " in huge pages" : "", index, c->size);
                return -ESTALE;
        }
        a->data_offset = h->data_offset;
        a->hugepages = huge;
        a->adopted = true;
        if (c->prefault) {
                r = arena_prefault(a);
                if (r < 0) {
                        a->fd = -EBADF; /* the caller still owns it */
                        arena_free(a);
                        return r;
                }
        }
        write_header(a, host_id);
        *ret = a;
        return 0;
}

Arena *arena_free(Arena *a) {
        if (!a)
                return NULL;
        if (a->base)
                munmap(a->base, a->size);
        safe_close(a->fd);
        free(a->name);
        free(a);
        return NULL;
}

int arena_take_or_new_host(FdStore *store, const ArenaConfig *c, uint32_t index, const char *host_id, Arena **ret,
                           bool *ret_adopted) {
        char fdname[64];
        bool took = false;
        int fd, r;

        *ret_adopted = false;
        snprintf(fdname, sizeof fdname, "arena-%s", c->name);
        while ((fd = fdstore_take(store, fdname)) >= 0) {
                took = true;
                r = arena_adopt_host(c, index, fd, host_id, ret);
                if (r >= 0) {
                        *ret_adopted = true;
                        return 0;
                }
                safe_close(fd);
                if (r != -EBADMSG && r != -ESTALE)
                        /* Not another arena's nor another shape's memory: it could not be
                         * taken back now (mapping it failed). */
                        return log_error_errno(r, "Arena %s: cannot take back its memory (%m); not starting, so "
                                                  "that it stays in the fd store for the next start.",
                                               c->name);
                fdstore_refuse(store); /* an older copy, if any, is tried next */
        }
        if (took)
                fdstore_drop(store, fdname);
        /* Into the fd store once the restore's records are durable (manager_startup). */
        return arena_new_host(c, index, host_id, ret);
}
