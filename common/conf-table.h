/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Keys of a configuration section parsed from a table (as systemd's ConfigTableItem):
 * the key, the parser of its value, and where the value goes. Keys match without
 * regard to case. */

#include <stddef.h>

/* Parses value into dst (the field at the item's offset); 0 or a negative errno. */
typedef int (*ConfValueParser)(const char *value, void *dst);

typedef struct ConfTableItem {
        const char *key;
        ConfValueParser parse;
        size_t offset;
} ConfTableItem;

/* Sets key of the section whose fields start at base: the parser's result, or -ENOENT
 * for a key the table does not have. */
int conf_table_set(const ConfTableItem *items, size_t n, void *base, const char *key, const char *value);

/* Parsers of the common value types. */
int conf_parse_bool(const char *value, void *dst);      /* bool */
int conf_parse_size(const char *value, void *dst);      /* uint64_t, "64K", "4G" */
int conf_parse_duration(const char *value, void *dst);  /* usec_t, "2s", "500ms" */
int conf_parse_unsigned(const char *value, void *dst);  /* unsigned */
int conf_parse_ratio(const char *value, void *dst);     /* double, finite, >= 0 */
