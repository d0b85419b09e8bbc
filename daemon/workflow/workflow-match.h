/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Segment matching for agent steps: which page-aligned blocks of the predecessor's
 * token sequence reappear in the new sequence, and where. The common prefix (same
 * blocks at the same positions) is reported apart: the block directory serves it.
 * The rest are segments — runs of consecutive predecessor blocks found at another
 * position of the new sequence (tool output pasted back, a reordered history).
 * Whether a moved segment's KV is valid for the model is the worker's call; epd
 * reports the matches, aligned or not, and shares no page of them: the new head
 * (workflow_advance) is a clone of the common prefix's pages only.
 *
 * Linear time: a Karp-Rabin rolling hash modulo 2^61-1 with a random base over the
 * new sequence, a table of the predecessor's block hashes, every candidate verified
 * token by token, greedy leftmost matching that jumps past each match. Every token of
 * the new sequence is hashed O(1) times and verified O(1) times (a failed
 * verification needs a hash collision), so the work is O(n_prev + n_new), also on
 * repetitive input — the prototype's greedy longest-common-substring was O(N*M) there.
 * Pure; `ops` counts the work so the tests can check the bound. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define WORKFLOW_MATCH_TOKENS_MAX ((size_t)1 << 24)
#define WORKFLOW_MATCH_BLOCK_MAX 4096u

typedef struct MatchSegment {
        size_t prev_block; /* first block of the predecessor */
        size_t n_blocks;   /* consecutive blocks */
        size_t new_offset; /* token offset in the new sequence */
        bool aligned;      /* new_offset is block-aligned: the pages can be shared as is */
} MatchSegment;

typedef struct MatchOptions {
        size_t block_tokens; /* tokens per page (KV block) */
        size_t min_blocks;   /* shortest segment worth reporting (0 or 1: any) */
        bool aligned_only;   /* only block-aligned positions of the new sequence */
        uint64_t seed;       /* hash base; 0: random per call */
        size_t max_segments; /* 0: no limit beyond n_new / block_tokens */
} MatchOptions;

typedef struct MatchResult {
        size_t prefix_blocks;  /* leading blocks equal at equal positions */
        MatchSegment *segments;
        size_t n_segments;
        size_t matched_blocks; /* in segments */
        bool truncated;        /* stopped at max_segments */
        uint64_t ops;          /* token comparisons and hash steps */
} MatchResult;

/* -EINVAL for a bad block size or NULL with a length, -E2BIG past the token limit. */
int workflow_match(const uint32_t *prev, size_t n_prev, const uint32_t *next, size_t n_next,
                   const MatchOptions *o, MatchResult *ret);
void match_result_done(MatchResult *r);
