/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "id.h"

#include <errno.h>
#include <string.h>
#include <sys/random.h>

int epd_id_random(EpdId *ret) {
        size_t done = 0;
        while (done < sizeof ret->bytes) {
                ssize_t n = getrandom(ret->bytes + done, sizeof ret->bytes - done, 0);
                if (n < 0) {
                        if (errno == EINTR)
                                continue;
                        return -errno;
                }
                done += (size_t)n;
        }
        return 0;
}

char *epd_id_to_string(const EpdId *id, char buf[static EPD_ID_STRING_MAX]) {
        static const char hex[] = "0123456789abcdef";
        for (size_t i = 0; i < 16; i++) {
                buf[2 * i] = hex[id->bytes[i] >> 4];
                buf[2 * i + 1] = hex[id->bytes[i] & 15];
        }
        buf[32] = 0;
        return buf;
}

static int unhex(char c) {
        if (c >= '0' && c <= '9')
                return c - '0';
        if (c >= 'a' && c <= 'f')
                return c - 'a' + 10;
        if (c >= 'A' && c <= 'F')
                return c - 'A' + 10;
        return -EINVAL;
}

int epd_id_from_string(const char *s, EpdId *ret) {
        if (!s || strlen(s) != 32)
                return -EINVAL;
        for (size_t i = 0; i < 16; i++) {
                int a = unhex(s[2 * i]), b = unhex(s[2 * i + 1]);
                if (a < 0 || b < 0)
                        return -EINVAL;
                ret->bytes[i] = (uint8_t)(a << 4 | b);
        }
        return 0;
}

bool epd_id_is_null(const EpdId *id) {
        static const EpdId null;
        return memcmp(id, &null, sizeof null) == 0;
}

bool epd_id_equal(const EpdId *a, const EpdId *b) {
        return memcmp(a, b, sizeof *a) == 0;
}
