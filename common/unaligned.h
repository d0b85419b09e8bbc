/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Fixed-width integers at any address, in a given byte order: the one place where the
 * wire formats and records (WAL, peer protocol, descriptors) turn integers into bytes
 * and back. */

#include <endian.h>
#include <stdint.h>
#include <string.h>

#define UNALIGNED_ACCESSORS(bits)                                                         \
        static inline uint##bits##_t unaligned_read_le##bits(const void *p) {             \
                uint##bits##_t v;                                                         \
                memcpy(&v, p, sizeof v);                                                  \
                return le##bits##toh(v);                                                  \
        }                                                                                 \
        static inline uint##bits##_t unaligned_read_be##bits(const void *p) {             \
                uint##bits##_t v;                                                         \
                memcpy(&v, p, sizeof v);                                                  \
                return be##bits##toh(v);                                                  \
        }                                                                                 \
        static inline void unaligned_write_le##bits(void *p, uint##bits##_t v) {          \
                v = htole##bits(v);                                                       \
                memcpy(p, &v, sizeof v);                                                  \
        }                                                                                 \
        static inline void unaligned_write_be##bits(void *p, uint##bits##_t v) {          \
                v = htobe##bits(v);                                                       \
                memcpy(p, &v, sizeof v);                                                  \
        }

UNALIGNED_ACCESSORS(16)
UNALIGNED_ACCESSORS(32)
UNALIGNED_ACCESSORS(64)
#undef UNALIGNED_ACCESSORS

/* The low n bytes (1 to 8) of v, little-endian; and back. */
static inline void unaligned_write_le(void *p, uint64_t v, unsigned n) {
        uint8_t *b = p;
        for (unsigned i = 0; i < n; i++)
                b[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t unaligned_read_le(const void *p, unsigned n) {
        const uint8_t *b = p;
        uint64_t v = 0;
        for (unsigned i = n; i > 0; i--)
                v = v << 8 | b[i - 1];
        return v;
}
