/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fault injection for test-restart: preloaded into epdd, a malloc() of exactly
 * $EPD_FAULT_MALLOC_SIZE bytes made while the file $EPD_FAULT_MALLOC_ARM exists returns
 * NULL (ENOMEM) and removes the file: one failure per arming, at a chosen call (the test
 * arms it right before the call and picks a size nothing else asks for then). Every
 * other malloc() is the real one. Test builds only: nothing in epdd knows of it. */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

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
