/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Helpers shared by the transport implementations (pure). */

#include "transport/transport.h"

int transport_kind_from_string(const char *s);
/* 0 if [offset, offset+length) is a non-empty range inside the region; -ERANGE if not,
 * -ENOENT for no region. */
int transport_region_check(const TransportRegion *r, uint64_t offset, uint64_t length);

/* The completions a transport has for the handoff code, behind its eventfd `efd` (readable
 * while any is queued): tcp and rdma share it. */
typedef struct TransportDoneQueue {
        TransportCompletion *items;
        size_t n, cap;
} TransportDoneQueue;

/* Queues one completion, counts it in t->stats, kicks efd when the queue was empty. Out
 * of memory the completion is logged as lost (it would leak a lease: said loudly). */
void transport_done_push(Transport *t, TransportDoneQueue *q, int efd, uint64_t cookie, int error, uint64_t bytes);
/* Takes up to n completions into c (TransportOps.poll); efd stays readable while more wait. */
size_t transport_done_take(TransportDoneQueue *q, int efd, TransportCompletion *c, size_t n);
