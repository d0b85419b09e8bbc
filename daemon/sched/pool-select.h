/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Which workers serve a scheduler pool at a stage ([Pool:NAME] EncodeWorkers=,
 * PrefillWorkers=, DecodeWorkers= in epd.conf; docs/scheduler.md). A selector list is
 * whitespace-separated; a worker is selected when any selector matches it:
 *
 *   *               every worker
 *   name:GLOB       the worker's "name" registration option
 *   role:ROLE       encoder, prefill, decode or colocated
 *   model:GLOB      the model it registered
 *   device:GLOB     the device it registered
 *   label:LABEL     one of its "labels" registration option's entries (exact)
 *
 * GLOB is fnmatch(3) syntax. Pure; unit-tested in tests/unit/test-config.c. */

#include <stdbool.h>
#include <stddef.h>

#define POOL_SELECT_MAX 4096 /* bytes of one list */
#define POOL_SELECT_LABELS_MAX 32
#define POOL_SELECT_LABEL_MAX 64

typedef struct PoolSelectWorker {
        const char *name;   /* may be NULL */
        const char *role;
        const char *model;
        const char *device;
        const char *const *labels; /* n_labels entries */
        size_t n_labels;
} PoolSelectWorker;

/* Checks a list's syntax: 0, or -EINVAL with *ret_bad pointing at a static text
 * naming what is wrong (the offending selector is copied to bad_buf). */
int pool_select_validate(const char *list, char *bad_buf, size_t bad_len, const char **ret_why);
/* Whether w is selected by list (NULL or empty list: every worker). */
bool pool_select_match(const char *list, const PoolSelectWorker *w);
/* Checks a label (registration option): 1 to 63 printable characters, no space. */
bool pool_select_label_valid(const char *label);
