/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Prefix-aware placement (docs/cluster.md): from the holders of each block of a
 * request's chain of block hashes (what the directory's owners answered), the longest
 * cached prefix each (host, arena) holds, ranked: longest first, then this host (no
 * transfer at all), then host id and arena in order. A prefix counts only from the
 * first block on and stops at its first block the candidate does not hold: KV of a
 * later block is useless without the blocks before it. Pure; unit-tested. */

#include <stddef.h>
#include <stdint.h>

#include "pages/directory-proto.h"

typedef struct PlacementCandidate {
        char host[DIRECTORY_NAME_MAX + 1];
        char arena[DIRECTORY_NAME_MAX + 1];
        char worker[DIRECTORY_NAME_MAX + 1]; /* who published the prefix's first block */
        uint32_t n_blocks;
} PlacementCandidate;

/* The candidates (malloc'ed; *ret_n of them, 0 and NULL when nobody holds the first
 * block), ranked. self: this host's id. */
int placement_rank(const DirectoryAnswerEntry *entries, size_t n, const char *self, PlacementCandidate **ret,
                   size_t *ret_n);
