/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>

#include "log.h"
#include "macro.h"
#include "transport/transport-util.h"
#include "transport/transport.h"

static const char *const kind_table[_TRANSPORT_KIND_MAX] = {
        [TRANSPORT_LOCAL] = "local",
        [TRANSPORT_TCP] = "tcp",
        [TRANSPORT_CUDA] = "cuda",
        [TRANSPORT_RDMA] = "rdma",
};

const char *transport_kind_to_string(TransportKind k) {
        return k >= 0 && k < _TRANSPORT_KIND_MAX ? kind_table[k] : NULL;
}

int transport_kind_from_string(const char *s) {
        if (!s)
                return -EINVAL;
        for (int i = 0; i < _TRANSPORT_KIND_MAX; i++)
                if (strcmp(kind_table[i], s) == 0)
                        return i;
        return -EINVAL;
}

int transport_region_check(const TransportRegion *r, uint64_t offset, uint64_t length) {
        uint64_t end;
        if (!r)
                return -ENOENT;
        if (length == 0 || ADD_OVERFLOW(offset, length, &end) || end > r->size)
                return -ERANGE;
        return 0;
}

int transport_done_queue_add(TransportDoneQueue *q, const TransportCompletion *c) {
        if (q->head + q->n == q->cap) {
                if (q->head > 0 && q->n <= q->cap / 2) {
                        /* Half or more free at the front: move the queued ones there (each
                         * is moved at most once per cap/2 additions). */
                        memmove(q->items, q->items + q->head, q->n * sizeof *q->items);
                        q->head = 0;
                } else {
                        size_t cap = MAX(q->cap * 2, (size_t)64);
                        TransportCompletion *n = reallocarray(q->items, cap, sizeof *n);
                        if (!n)
                                return -ENOMEM;
                        q->items = n;
                        q->cap = cap;
                }
        }
        q->items[q->head + q->n++] = *c;
        return 0;
}

size_t transport_done_queue_take(TransportDoneQueue *q, TransportCompletion *c, size_t n) {
        size_t k = MIN(n, q->n);

        if (k > 0) { /* n == 0: c may be NULL */
                memcpy(c, q->items + q->head, k * sizeof *c);
                q->head += k;
                q->n -= k;
        }
        if (q->n == 0)
                q->head = 0;
        return k;
}

void transport_done_push(Transport *t, TransportDoneQueue *q, int efd, uint64_t cookie, int error, uint64_t bytes) {
        if (transport_done_queue_add(q, &(TransportCompletion){ .cookie = cookie, .error = error, .writes = 1,
                                                                 .bytes = bytes }) < 0) {
                /* Dropped, its handoff would wait for it for ever, holding its leases and
                 * staging buffer (as local.c: never lost). */
                log_error("%s: out of memory queueing a completion (cookie %llu)", t->ops->name,
                          (unsigned long long)cookie);
                abort();
        }
        if (error)
                t->stats.failures++;
        else {
                t->stats.bytes += bytes;
                t->stats.writes++;
        }
        if (q->n == 1)
                (void)eventfd_write(efd, 1);
}

size_t transport_done_take(TransportDoneQueue *q, int efd, TransportCompletion *c, size_t n) {
        eventfd_t v;
        size_t k = MIN(n, q->n);

        (void)eventfd_read(efd, &v);
        if (q->n == 0)
                return 0; /* nothing queued (yet: items may be NULL) */
        k = transport_done_queue_take(q, c, n);
        if (q->n > 0)
                (void)eventfd_write(efd, 1);
        return k;
}
