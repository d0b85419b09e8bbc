/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "hashmap.h"
#include "macro.h"
#include "workflow/workflow-match.h"

#define MERSENNE61 ((UINT64_C(1) << 61) - 1)

static uint64_t mulmod(uint64_t a, uint64_t b) {
        unsigned __int128 p = (unsigned __int128)a * b;
        uint64_t r = (uint64_t)(p & MERSENNE61) + (uint64_t)(p >> 61);
        return r >= MERSENNE61 ? r - MERSENNE61 : r;
}

static uint64_t addmod(uint64_t a, uint64_t b) {
        uint64_t r = a + b;
        return r >= MERSENNE61 ? r - MERSENNE61 : r;
}

static uint64_t submod(uint64_t a, uint64_t b) {
        return a >= b ? a - b : a + MERSENNE61 - b;
}

/* Tokens are < 2^32 < p; +1 so that a run of token 0 does not hash like nothing. */
static uint64_t tok(uint32_t t) {
        return (uint64_t)t + 1;
}

typedef struct Matcher {
        const uint32_t *prev, *next;
        size_t n_prev, n_next, P;
        uint64_t base, top; /* top = base^(P-1) */
        uint64_t ops;
} Matcher;

static uint64_t hash_block(Matcher *m, const uint32_t *t) {
        uint64_t h = 0;
        for (size_t i = 0; i < m->P; i++)
                h = addmod(mulmod(h, m->base), tok(t[i]));
        m->ops += m->P;
        return h;
}

static bool equal_block(Matcher *m, const uint32_t *a, const uint32_t *b) {
        for (size_t i = 0; i < m->P; i++) {
                m->ops++;
                if (a[i] != b[i])
                        return false;
        }
        return true;
}

static int push_segment(MatchResult *r, size_t *cap, const MatchSegment *s) {
        if (r->n_segments == *cap) {
                size_t n = MAX(*cap * 2, (size_t)16);
                MatchSegment *p = reallocarray(r->segments, n, sizeof *p);
                if (!p)
                        return -ENOMEM;
                r->segments = p;
                *cap = n;
        }
        r->segments[r->n_segments++] = *s;
        r->matched_blocks += s->n_blocks;
        return 0;
}

int workflow_match(const uint32_t *prev, size_t n_prev, const uint32_t *next, size_t n_next,
                   const MatchOptions *o, MatchResult *ret) {
        _cleanup_(freep) uint64_t *hashes = NULL;
        MatchResult r = {};
        Hashmap *table = NULL;
        size_t cap = 0, n_blocks, min_blocks, max_segments, j;
        Matcher m;
        uint64_t h = 0;
        bool have_hash = false;
        int k;

        if (!o || !ret || o->block_tokens == 0 || o->block_tokens > WORKFLOW_MATCH_BLOCK_MAX ||
            (n_prev > 0 && !prev) || (n_next > 0 && !next))
                return -EINVAL;
        if (n_prev > WORKFLOW_MATCH_TOKENS_MAX || n_next > WORKFLOW_MATCH_TOKENS_MAX)
                return -E2BIG;

        m = (Matcher){ .prev = prev, .next = next, .n_prev = n_prev, .n_next = n_next,
                       .P = o->block_tokens, .base = o->seed };
        if (m.base == 0 && getrandom(&m.base, sizeof m.base, 0) != sizeof m.base)
                return -errno;
        m.base = m.base % (MERSENNE61 - 256) + 256;
        m.top = 1;
        for (size_t i = 1; i < m.P; i++)
                m.top = mulmod(m.top, m.base);

        min_blocks = MAX(o->min_blocks, (size_t)1);
        max_segments = o->max_segments > 0 ? o->max_segments : SIZE_MAX;
        n_blocks = n_prev / m.P; /* a partial last block is not a page to share */

        /* The common prefix: the directory's part, reported apart. */
        while ((r.prefix_blocks + 1) * m.P <= MIN(n_prev, n_next) &&
               equal_block(&m, prev + r.prefix_blocks * m.P, next + r.prefix_blocks * m.P))
                r.prefix_blocks++;

        if (n_blocks == 0 || n_next < m.P)
                goto done;

        hashes = malloc(n_blocks * sizeof *hashes);
        table = hashmap_new(HASHMAP_KEY_U64, 0);
        if (!hashes || !table) {
                k = -ENOMEM;
                goto fail;
        }
        for (size_t b = 0; b < n_blocks; b++) {
                hashes[b] = hash_block(&m, prev + b * m.P);
                /* Equal blocks keep the first; a colliding different block is then not
                 * findable, which only loses a match, never makes a wrong one. */
                k = hashmap_put(table, &hashes[b], (void *)(uintptr_t)(b + 1));
                if (k < 0 && k != -EEXIST)
                        goto fail;
        }

        j = r.prefix_blocks * m.P;
        while (j + m.P <= n_next) {
                uintptr_t v;

                if (o->aligned_only && j % m.P != 0) {
                        j = ALIGN_TO(j, m.P);
                        have_hash = false;
                        continue;
                }
                if (!have_hash) {
                        h = hash_block(&m, next + j);
                        have_hash = true;
                }
                m.ops++;
                v = (uintptr_t)hashmap_get(table, &h);
                if (v != 0 && equal_block(&m, prev + (v - 1) * m.P, next + j)) {
                        MatchSegment s = { .prev_block = v - 1, .n_blocks = 1, .new_offset = j,
                                           .aligned = j % m.P == 0 };

                        /* Extend the run while the following blocks follow in both. */
                        while (j + (s.n_blocks + 1) * m.P <= n_next &&
                               s.prev_block + s.n_blocks < n_blocks &&
                               equal_block(&m, prev + (s.prev_block + s.n_blocks) * m.P,
                                           next + j + s.n_blocks * m.P))
                                s.n_blocks++;
                        if (s.n_blocks >= min_blocks) {
                                if (r.n_segments == max_segments) {
                                        r.truncated = true;
                                        break;
                                }
                                k = push_segment(&r, &cap, &s);
                                if (k < 0)
                                        goto fail;
                        }
                        /* Jump past it: every token is matched at most once. */
                        j += s.n_blocks * m.P;
                        have_hash = false;
                        continue;
                }
                if (o->aligned_only) {
                        j += m.P;
                        have_hash = false;
                        continue;
                }
                /* Roll the window by one token. */
                if (j + m.P < n_next) {
                        h = submod(h, mulmod(tok(next[j]), m.top));
                        h = addmod(mulmod(h, m.base), tok(next[j + m.P]));
                        m.ops++;
                }
                j++;
        }

done:
        hashmap_free(table);
        r.ops = m.ops;
        *ret = r;
        return 0;

fail:
        hashmap_free(table);
        free(r.segments);
        return k;
}

void match_result_done(MatchResult *r) {
        if (!r)
                return;
        free(r->segments);
        *r = (MatchResult){};
}
