/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "utf8.h"

#include <stddef.h>
#include <stdint.h>

/* The length of the valid sequence at p (1 to 4), or 0. */
static size_t sequence(const unsigned char *p) {
        unsigned char c = p[0];
        uint32_t cp;
        size_t n;

        if (c < 0x80)
                return 1;
        if (c >= 0xc2 && c <= 0xdf) {
                n = 2;
                cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
                n = 3;
                cp = c & 0x0f;
        } else if (c >= 0xf0 && c <= 0xf4) {
                n = 4;
                cp = c & 0x07;
        } else
                return 0;
        for (size_t i = 1; i < n; i++) {
                if ((p[i] & 0xc0) != 0x80) /* also the terminating NUL: cut off */
                        return 0;
                cp = cp << 6 | (p[i] & 0x3f);
        }
        if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) || (cp >= 0xd800 && cp <= 0xdfff))
                return 0; /* overlong, past Unicode, or a surrogate */
        return n;
}

void utf8_make_valid(char *s) {
        unsigned char *p = (unsigned char *)s;

        if (!p)
                return;
        while (*p) {
                size_t n = sequence(p);
                if (n == 0 || (n == 1 && (*p < 0x20 || *p == 0x7f))) {
                        *p++ = '?';
                        continue;
                }
                p += n;
        }
}
