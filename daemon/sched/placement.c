/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "sched/placement.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static bool holds(const DirectoryAnswerEntry *e, const char *host, const char *arena) {
        for (unsigned i = 0; i < e->n_holders; i++)
                if (strcmp(e->holders[i].host, host) == 0 && strcmp(e->holders[i].arena, arena) == 0)
                        return true;
        return false;
}

static const char *rank_self;

static int compare(const void *a, const void *b) {
        const PlacementCandidate *x = a, *y = b;
        bool xs = strcmp(x->host, rank_self) == 0, ys = strcmp(y->host, rank_self) == 0;
        int c;

        if (x->n_blocks != y->n_blocks)
                return x->n_blocks > y->n_blocks ? -1 : 1;
        if (xs != ys)
                return xs ? -1 : 1;
        c = strcmp(x->host, y->host);
        return c ? c : strcmp(x->arena, y->arena);
}

int placement_rank(const DirectoryAnswerEntry *entries, size_t n, const char *self, PlacementCandidate **ret,
                   size_t *ret_n) {
        PlacementCandidate *c;
        size_t k = 0;

        if ((!entries && n > 0) || !self || !ret || !ret_n)
                return -EINVAL;
        *ret = NULL;
        *ret_n = 0;
        if (n == 0 || entries[0].n_holders == 0)
                return 0;
        if (entries[0].n_holders > DIRECTORY_HOLDERS_MAX)
                return -EINVAL;
        c = calloc(entries[0].n_holders, sizeof *c);
        if (!c)
                return -ENOMEM;
        /* Only the holders of the first block can hold a prefix. */
        for (unsigned i = 0; i < entries[0].n_holders; i++) {
                const DirectoryHolder *h = entries[0].holders + i;
                bool dup = false;

                for (size_t j = 0; j < k; j++)
                        dup |= strcmp(c[j].host, h->host) == 0 && strcmp(c[j].arena, h->arena) == 0;
                if (dup)
                        continue;
                snprintf(c[k].host, sizeof c[k].host, "%s", h->host);
                snprintf(c[k].arena, sizeof c[k].arena, "%s", h->arena);
                snprintf(c[k].worker, sizeof c[k].worker, "%s", h->worker);
                while (c[k].n_blocks < n && holds(entries + c[k].n_blocks, h->host, h->arena))
                        c[k].n_blocks++;
                k++;
        }
        rank_self = self;
        qsort(c, k, sizeof *c, compare);
        rank_self = NULL;
        *ret = c;
        *ret_n = k;
        return 0;
}
