/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Helpers of the unit tests that run the GPU domain on the fake driver
 * (tests/unit/fake-libcuda.c, FAKE_CUDA_MODE=gpu): the driver's path, its mode, arenas
 * on the fake GPU and a transport batch run to its last completion. */
#pragma once

#include <check.h>
#include <poll.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

#include "gpu/gpu-domain.h"
#include "macro.h"
#include "transport/transport.h"

static inline const char *fake(void) {
        const char *p = getenv("FAKE_LIBCUDA");
        ck_assert_msg(p, "FAKE_LIBCUDA not set (run through meson test)");
        return p;
}

static inline void fake_gpu(bool fail_copies) {
        ck_assert_int_eq(setenv("FAKE_CUDA_MODE", "gpu", 1), 0);
        ck_assert_int_eq(setenv("FAKE_CUDA_FAIL_COPIES", fail_copies ? "1" : "0", 1), 0);
}

static inline Arena *fake_arena(GpuContext *g, uint32_t index, uint64_t size) {
        ArenaConfig c = { .name = (char *)"t", .domain = MEMORY_GPU, .size = size, .gpu = 0 };
        Arena *a = NULL;
        ck_assert_int_eq(gpu_context_arena_new(g, &c, index, &a), 0);
        return a;
}

static inline void fake_arena_free(GpuContext *g, Arena *a) {
        gpu_context_arena_forget(g, a);
        gpu_arena_unref(a->gpu);
        close(a->fd);
        free(a->name);
        free(a);
}

/* Posts and collects every completion through the completion fd; cookies_seen gets a
 * write's cookie for each write a completion stands for (c.writes of them). */
static inline int run_writes(Transport *t, const TransportWrite *w, size_t n, uint64_t *cookies_seen) {
        TransportCompletion c[64];
        size_t seen = 0;
        int err = 0, r;

        r = t->ops->post(t, NULL, w, n);
        if (r < 0)
                return r;
        while (seen < n) {
                struct pollfd p = { .fd = t->ops->completion_fd(t), .events = POLLIN };
                size_t k = t->ops->poll(t, c, ELEMENTSOF(c));
                for (size_t i = 0; i < k; i++) {
                        if (c[i].error < 0 && err == 0)
                                err = c[i].error;
                        ck_assert_uint_ge(c[i].writes, 1);
                        ck_assert_uint_le(seen + c[i].writes, n);
                        for (uint32_t j = 0; cookies_seen && j < c[i].writes; j++)
                                cookies_seen[seen + j] = c[i].cookie;
                        seen += c[i].writes;
                }
                if (k == 0)
                        ck_assert_int_eq(poll(&p, 1, 5000), 1);
        }
        return err;
}
