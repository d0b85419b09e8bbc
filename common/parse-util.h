/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Strict parsers for configuration values: the whole string must parse, no silent
 * truncation, overflow is an error. All return 0 or a negative errno. */

#include <stdbool.h>
#include <stdint.h>

#include "time-util.h"

int parse_bool(const char *s, bool *ret);
int parse_u64(const char *s, uint64_t *ret);
int parse_u32(const char *s, uint32_t *ret);
/* Sizes: "4096", "64K", "256M", "2G", "1T" (powers of 1024; an optional "iB"/"B"). */
int parse_size(const char *s, uint64_t *ret);
/* Durations: "2s", "500ms", "1min", "100us", or plain seconds. */
int parse_duration(const char *s, usec_t *ret);
/* Formats a size as e.g. "256.0M" into buf. */
const char *format_size(char *buf, size_t n, uint64_t size);
