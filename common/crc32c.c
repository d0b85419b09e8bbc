/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <pthread.h>
#include <string.h>

#include "crc32c.h"

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t table[8][256];
static pthread_once_t table_once = PTHREAD_ONCE_INIT;

static void table_init(void) {
        for (uint32_t i = 0; i < 256; i++) {
                uint32_t c = i;
                for (int k = 0; k < 8; k++)
                        c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
                table[0][i] = c;
        }
        for (uint32_t i = 0; i < 256; i++)
                for (int t = 1; t < 8; t++)
                        table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xff];
}

static uint32_t crc32c_sw(uint32_t c, const uint8_t *p, size_t n) {
        (void)pthread_once(&table_once, table_init);
        while (n > 0 && ((uintptr_t)p & 7)) {
                c = table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
                n--;
        }
        while (n >= 8) {
                uint64_t w;
                memcpy(&w, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
                w = __builtin_bswap64(w);
#endif
                w ^= c;
                c = table[7][w & 0xff] ^ table[6][(w >> 8) & 0xff] ^ table[5][(w >> 16) & 0xff] ^
                    table[4][(w >> 24) & 0xff] ^ table[3][(w >> 32) & 0xff] ^
                    table[2][(w >> 40) & 0xff] ^ table[1][(w >> 48) & 0xff] ^ table[0][w >> 56];
                p += 8;
                n -= 8;
        }
        while (n-- > 0)
                c = table[0][(c ^ *p++) & 0xff] ^ (c >> 8);
        return c;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t c, const uint8_t *p, size_t n) {
        uint64_t c64 = c;
        while (n > 0 && ((uintptr_t)p & 7)) {
                c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
                n--;
        }
        while (n >= 8) {
                uint64_t w;
                memcpy(&w, p, 8);
                c64 = __builtin_ia32_crc32di(c64, w);
                p += 8;
                n -= 8;
        }
        while (n-- > 0)
                c64 = __builtin_ia32_crc32qi((uint32_t)c64, *p++);
        return (uint32_t)c64;
}
#endif

uint32_t crc32c(uint32_t crc, const void *buf, size_t n) {
        const uint8_t *p = buf;
        uint32_t c = ~crc;

#if defined(__x86_64__)
        if (__builtin_cpu_supports("sse4.2"))
                return ~crc32c_hw(c, p, n);
#endif
        return ~crc32c_sw(c, p, n);
}

uint32_t crc32c_portable(uint32_t crc, const void *buf, size_t n) {
        return ~crc32c_sw(~crc, buf, n);
}
