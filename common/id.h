/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* 128-bit random handles given to clients, and their 32-hex-digit text form (also
 * used as the last element of object paths). */

#include <stdbool.h>
#include <stdint.h>

typedef struct EpdId {
        uint8_t bytes[16];
} EpdId;

#define EPD_ID_STRING_MAX 33
/* Random bytes epd_id_random() asks getrandom() for at once (id.c). */
#define EPD_ID_POOL_SIZE 512

/* A fresh unguessable id (from getrandom(), through a pool per thread), or -errno. */
int epd_id_random(EpdId *ret);
char *epd_id_to_string(const EpdId *id, char buf[static EPD_ID_STRING_MAX]);
int epd_id_from_string(const char *s, EpdId *ret);
bool epd_id_is_null(const EpdId *id);
bool epd_id_equal(const EpdId *a, const EpdId *b);
