/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "siphash24.h"
#include "unaligned.h"

#include <string.h>

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                         \
        do {                                                                             \
                v0 += v1;                                                                \
                v1 = ROTL(v1, 13);                                                       \
                v1 ^= v0;                                                                \
                v0 = ROTL(v0, 32);                                                       \
                v2 += v3;                                                                \
                v3 = ROTL(v3, 16);                                                       \
                v3 ^= v2;                                                                \
                v0 += v3;                                                                \
                v3 = ROTL(v3, 21);                                                       \
                v3 ^= v0;                                                                \
                v2 += v1;                                                                \
                v1 = ROTL(v1, 17);                                                       \
                v1 ^= v2;                                                                \
                v2 = ROTL(v2, 32);                                                       \
        } while (0)

static uint64_t le64(const uint8_t *p) {
        return unaligned_read_le64(p);
}

uint64_t siphash24(const void *in, size_t len, const uint8_t k[16]) {
        const uint8_t *m = in;
        uint64_t k0 = le64(k), k1 = le64(k + 8);
        uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1,
                 v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
        uint64_t b = (uint64_t)len << 56;
        size_t i, end = len - (len % 8);

        for (i = 0; i < end; i += 8) {
                uint64_t mi = le64(m + i);
                v3 ^= mi;
                SIPROUND;
                SIPROUND;
                v0 ^= mi;
        }
        for (size_t j = 0; j < len % 8; j++)
                b |= (uint64_t)m[end + j] << (8 * j);
        v3 ^= b;
        SIPROUND;
        SIPROUND;
        v0 ^= b;
        v2 ^= 0xff;
        SIPROUND;
        SIPROUND;
        SIPROUND;
        SIPROUND;
        return v0 ^ v1 ^ v2 ^ v3;
}
