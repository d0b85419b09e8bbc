/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/arena.h"
#include "../check-main.h"

START_TEST(test_size_round) {
        uint64_t s;
        ck_assert_int_eq(arena_size_round(1 << 20, 4096, &s), 0);
        ck_assert_uint_eq(s, (1 << 20) + 4096); /* header page in front */
        ck_assert_int_eq(arena_size_round((1 << 20) + 1, 4096, &s), 0);
        ck_assert_uint_eq(s, (1 << 20) + 8192);
        ck_assert_int_eq(arena_size_round(3ULL << 20, 2ULL << 20, &s), 0);
        ck_assert_uint_eq(s, 6ULL << 20); /* 3M + 2M header, rounded to 2M */
        ck_assert_int_eq(arena_size_round(100, 4096, &s), -ERANGE);
        ck_assert_int_eq(arena_size_round(1ULL << 50, 4096, &s), -E2BIG);
        ck_assert_int_eq(arena_size_round(UINT64_MAX, 4096, &s), -E2BIG);
        ck_assert_int_eq(arena_size_round(1 << 20, 3000, &s), -EINVAL);
        ck_assert_int_eq(arena_size_round(1 << 20, 0, &s), -EINVAL);
        ck_assert_uint_eq(arena_header_size(4096), 4096);
        ck_assert_uint_eq(arena_header_size(2ULL << 20), 2ULL << 20);
}
END_TEST

/* NumaNode= on a huge-page arena binds the huge pages as they are faulted in, through
 * this thread's policy, and puts the thread's own policy back as it was (the unit's
 * NUMAPolicy=, a numactl wrapper), whether the huge pages came or the arena fell back to
 * normal pages. It was reset to the default, for every later allocation of the daemon. */
START_TEST(test_numa_policy_kept) {
        const unsigned long bits = 16 * 8 * sizeof(unsigned long);
        unsigned long mask[16] = { 1 }, got[16] = { 0 };
        int mode = -1;
        if (syscall(SYS_set_mempolicy, 3 /* MPOL_INTERLEAVE */, mask, bits) < 0)
                return; /* no NUMA support in this kernel */
        ArenaConfig c = { .name = (char *)"tn", .domain = MEMORY_HOST, .usage = ARENA_USAGE_KV,
                          .size = 4 << 20, .hugepages = HUGEPAGES_TRY, .numa_node = 0, .gpu = -1 };
        Arena *a;
        ck_assert_int_eq(arena_new_host(&c, 1, "h1", &a), 0);
        ck_assert_int_eq(syscall(SYS_get_mempolicy, &mode, got, bits, NULL, 0), 0);
        ck_assert_int_eq(mode, 3);
        ck_assert_uint_eq(got[0] & 1, 1);
        arena_free(a);
        ck_assert_int_eq(syscall(SYS_set_mempolicy, 0, NULL, 0), 0);
}
END_TEST

START_TEST(test_host_arena) {
        ArenaConfig c = { .name = (char *)"t0", .domain = MEMORY_HOST, .usage = ARENA_USAGE_KV,
                          .size = 1 << 20, .hugepages = HUGEPAGES_NO, .numa_node = -1, .gpu = -1 };
        Arena *a;
        ck_assert_int_eq(arena_new_host(&c, 3, "h1", &a), 0);
        ck_assert_uint_eq(a->size, (1 << 20) + 4096);
        ck_assert_uint_eq(a->data_offset, 4096);
        ck_assert_uint_eq(arena_data_size(a), 1 << 20);
        const ArenaHeader *h = a->base;
        ck_assert_int_eq(memcmp(h->magic, EPD_ARENA_MAGIC, 8), 0);
        ck_assert_uint_eq(h->index, 3);
        ck_assert_str_eq(h->name, "t0");
        ck_assert_str_eq(h->host_id, "h1");
        ck_assert_uint_eq(h->generation, 0);
        /* The fd is sealed against resizing. */
        ck_assert_int_lt(ftruncate(a->fd, 4096), 0);
        ck_assert_int_eq(errno, EPERM);
        /* Another mapping of the fd sees the same bytes (what a worker does). */
        void *p = mmap(NULL, a->size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, 0);
        ck_assert_ptr_ne(p, MAP_FAILED);
        memset((char *)a->base + a->data_offset, 0xab, 100);
        ck_assert_int_eq(((unsigned char *)p)[a->data_offset + 99], 0xab);
        munmap(p, a->size);

        /* Re-adopting the fd (after a restart) keeps the data and bumps the generation. */
        int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 3);
        arena_free(a);
        ck_assert_int_eq(arena_adopt_host(&c, 3, fd, "h1", &a), 0);
        h = a->base;
        ck_assert_uint_eq(h->generation, 1);
        ck_assert_int_eq(((unsigned char *)a->base)[a->data_offset + 99], 0xab);
        int fd2 = fcntl(a->fd, F_DUPFD_CLOEXEC, 3);
        arena_free(a);
        /* An fd that holds another arena is refused, and stays the caller's. */
        ArenaConfig other = c;
        other.name = (char *)"other";
        ck_assert_int_eq(arena_adopt_host(&other, 3, fd2, "h1", &a), -EBADMSG);
        ck_assert_int_eq(fcntl(fd2, F_GETFD), FD_CLOEXEC);
        close(fd2);
}
END_TEST

START_TEST(test_hugepages_fallback) {
        /* HugePages=try falls back to normal pages when none are reserved. */
        ArenaConfig c = { .name = (char *)"t1", .size = 4 << 20, .hugepages = HUGEPAGES_TRY,
                          .numa_node = -1, .gpu = -1 };
        Arena *a;
        ck_assert_int_eq(arena_new_host(&c, 0, "h", &a), 0);
        ck_assert(a->data_offset == 4096 || a->data_offset == (2 << 20));
        arena_free(a);
}
END_TEST

/* Prefault=yes: the memfd's pages are allocated at start (st_blocks covers the whole
 * arena), for a new arena and for one taken back after a restart; without it only the
 * header page is. */
static uint64_t allocated_bytes(int fd) {
        struct stat st;
        ck_assert_int_eq(fstat(fd, &st), 0);
        return (uint64_t)st.st_blocks * 512;
}

/* Rss of the mapping that starts at base, in bytes (/proc/self/smaps). */
static uint64_t mapping_rss(const void *base) {
        char start[32], line[256];
        bool in = false;
        uint64_t kb = 0;
        FILE *f = fopen("/proc/self/smaps", "re");
        ck_assert_ptr_nonnull(f);
        snprintf(start, sizeof start, "%lx-", (unsigned long)(uintptr_t)base);
        while (fgets(line, sizeof line, f)) {
                if (strchr(line, '-') && strchr(line, ' ') && strchr(line, '-') < strchr(line, ' '))
                        in = strncmp(line, start, strlen(start)) == 0;
                else if (in && sscanf(line, "Rss: %" SCNu64 " kB", &kb) == 1)
                        break;
        }
        fclose(f);
        return kb * 1024;
}

START_TEST(test_prefault) {
        ArenaConfig c = { .name = (char *)"tp", .domain = MEMORY_HOST, .usage = ARENA_USAGE_KV,
                          .size = 8 << 20, .hugepages = HUGEPAGES_NO, .numa_node = -1, .gpu = -1 };
        Arena *a;
        ck_assert_int_eq(arena_new_host(&c, 0, "h", &a), 0);
        ck_assert_uint_le(allocated_bytes(a->fd), 64 << 10);
        int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 3);
        arena_free(a);

        c.prefault = true;
        ck_assert_int_eq(arena_adopt_host(&c, 0, fd, "h", &a), 0);
        ck_assert_uint_ge(allocated_bytes(a->fd), a->size);
        arena_free(a);

        ck_assert_int_eq(arena_new_host(&c, 0, "h", &a), 0);
        ck_assert_uint_ge(allocated_bytes(a->fd), a->size);
        /* The daemon's own mapping is populated too (its page table: Rss of the
         * mapping), where the kernel has MADV_POPULATE_WRITE: no page of it faults on
         * first use. */
        void *probe = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        ck_assert_ptr_ne(probe, MAP_FAILED);
        bool populate = madvise(probe, 4096, 23 /* MADV_POPULATE_WRITE */) == 0;
        munmap(probe, 4096);
        if (populate)
                ck_assert_uint_ge(mapping_rss(a->base), a->size);
        arena_free(a);
}
END_TEST

int main(void) {
        Suite *s = suite_create("arena");
        TCase *tc = tcase_create("arena");
        tcase_add_test(tc, test_size_round);
        tcase_add_test(tc, test_host_arena);
        tcase_add_test(tc, test_numa_policy_kept);
        tcase_add_test(tc, test_hugepages_fallback);
        tcase_add_test(tc, test_prefault);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
