/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Helpers shared by the transport implementations (pure). */

#include "transport/transport.h"

int transport_kind_from_string(const char *s);
/* 0 if [offset, offset+length) is a non-empty range inside the region; -ERANGE if not,
 * -ENOENT for no region. */
int transport_region_check(const TransportRegion *r, uint64_t offset, uint64_t length);

/* The completions a transport has for the handoff code, behind its eventfd `efd` (readable
 * while any is queued): tcp, rdma and local share it. items[head, head + n) are queued:
 * taking some moves the head, not the rest (a session reset completes up to 65536 writes
 * at once, taken 256 at a time: shifting the rest each time was quadratic, on the loop). */
typedef struct TransportDoneQueue {
        TransportCompletion *items;
        size_t head, n, cap;
} TransportDoneQueue;

/* Appends c: 0, or -ENOMEM (nothing queued). */
int transport_done_queue_add(TransportDoneQueue *q, const TransportCompletion *c);
/* Moves up to n of the oldest into c; how many. */
size_t transport_done_queue_take(TransportDoneQueue *q, TransportCompletion *c, size_t n);

/* Queues one completion, counts it in t->stats, kicks efd when the queue was empty. Out
 * of memory the completion is logged as lost (it would leak a lease: said loudly). */
void transport_done_push(Transport *t, TransportDoneQueue *q, int efd, uint64_t cookie, int error, uint64_t bytes);
/* Takes up to n completions into c (TransportOps.poll); efd stays readable while more wait. */
size_t transport_done_take(TransportDoneQueue *q, int efd, TransportCompletion *c, size_t n);
