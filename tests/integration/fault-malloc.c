/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fault injection for test-restart: preloaded into epdd, a malloc() of exactly
 * $EPD_FAULT_MALLOC_SIZE bytes made while the file $EPD_FAULT_MALLOC_ARM exists returns
 * NULL (ENOMEM) and removes the file: one failure per arming, at a chosen call (the test
 * arms it right before the call and picks a size nothing else asks for then). Every
 * other malloc() is the real one. The same for a shared mapping of a file of exactly
 * $EPD_FAULT_MMAP_SIZE bytes (an arena's: mmap() fails with ENOMEM, as under memory
 * pressure). Test builds only: nothing in epdd knows of it. */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

static void *(*real_mmap)(void *, size_t, int, int, int, off_t);

void *mmap(void *addr, size_t n, int prot, int flags, int fd, off_t off) {
        if (!real_mmap)
                real_mmap = (void *(*)(void *, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap");
        const char *size = getenv("EPD_FAULT_MMAP_SIZE"), *arm = getenv("EPD_FAULT_MALLOC_ARM");
        if (size && arm && fd >= 0 && (flags & MAP_SHARED) && n == strtoull(size, NULL, 10) && unlink(arm) == 0) {
                errno = ENOMEM;
                return MAP_FAILED;
        }
        return real_mmap(addr, n, prot, flags, fd, off);
}

static void *(*real_malloc)(size_t);

void *malloc(size_t n) {
        if (!real_malloc)
                real_malloc = (void *(*)(size_t))dlsym(RTLD_NEXT, "malloc");
        const char *size = getenv("EPD_FAULT_MALLOC_SIZE"), *arm = getenv("EPD_FAULT_MALLOC_ARM");
        /* unlink() succeeds for one caller only: the failure happens once per arming. */
        if (size && arm && n == strtoull(size, NULL, 10) && unlink(arm) == 0) {
                errno = ENOMEM;
                return NULL;
        }
        return real_malloc(n);
}
