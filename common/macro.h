/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Small helpers shared by epdd, libepd and the tools: cleanup attributes,
 * ownership transfer, array sizes, alignment. Nothing here allocates. */

#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#define _cleanup_(f) __attribute__((cleanup(f)))
#define _unused_ __attribute__((unused))
#define _pure_ __attribute__((pure))
#define _printf_(a, b) __attribute__((format(printf, a, b)))
#define _likely_(x) (__builtin_expect(!!(x), 1))
#define _unlikely_(x) (__builtin_expect(!!(x), 0))
#define _warn_unused_result_ __attribute__((warn_unused_result))

#define ELEMENTSOF(x) (sizeof(x) / sizeof((x)[0]))
#define MIN(a, b) ((a) < (b) ? (a) : (b))
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define CLAMP(x, lo, hi) MIN(MAX((x), (lo)), (hi))
#define DIV_ROUND_UP(x, y) (((x) + (y) - 1) / (y))
#define ALIGN_TO(x, a) (((x) + (a) - 1) / (a) * (a))
#define IS_POWER_OF_2(x) ((x) != 0 && (((x) & ((x) - 1)) == 0))

#define container_of(ptr, type, member) ((type *)((char *)(ptr) - offsetof(type, member)))

/* Take ownership of a pointer or fd: returns the value and clears the source so that
 * a cleanup handler on it does nothing. */
#define TAKE_PTR(p)                                                                      \
        ({                                                                               \
                __typeof__(p) _tp_ = (p);                                                \
                (p) = NULL;                                                              \
                _tp_;                                                                    \
        })
#define TAKE_FD(fd)                                                                      \
        ({                                                                               \
                int _tfd_ = (fd);                                                        \
                (fd) = -EBADF;                                                           \
                _tfd_;                                                                   \
        })

static inline void freep(void *p) {
        free(*(void **)p);
}

static inline int safe_close(int fd) {
        if (fd >= 0) {
                int saved = errno;
                (void)close(fd);
                errno = saved;
        }
        return -EBADF;
}

static inline void closep(int *fd) {
        *fd = safe_close(*fd);
}

/* Declare foo_freep() for a destructor foo_free(Foo *) that accepts NULL. */
#define DEFINE_TRIVIAL_CLEANUP_FUNC(type, func)                                          \
        static inline void func##p(type *p) {                                           \
                if (*p)                                                                  \
                        *p = func(*p);                                                   \
        }

/* Overflow-checked arithmetic: return true on overflow. */
#define MUL_OVERFLOW(a, b, r) __builtin_mul_overflow((a), (b), (r))
#define ADD_OVERFLOW(a, b, r) __builtin_add_overflow((a), (b), (r))

static inline int negative_errno(void) {
        return errno > 0 ? -errno : -EIO;
}

#define RET_NERRNO(expr)                                                                 \
        ({                                                                               \
                int _r_ = (int)(expr);                                                   \
                _r_ < 0 ? negative_errno() : _r_;                                        \
        })
