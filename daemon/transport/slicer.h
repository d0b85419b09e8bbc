/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Slicing of bulk writes (pure; used by the tcp transport).
 *
 * Sender: a SliceQueue holds the writes that still have slices to send, in round-robin
 * order. Each call to slice_queue_next() hands out the next slice of the write at the
 * head and moves that write to the tail, so a small write posted behind a huge one
 * waits for at most one slice of each write ahead of it, never for the whole huge
 * write.
 *
 * Receiver: a SliceTracker records which slices of one incoming write have landed
 * (a bitmap), rejects duplicates, and says when the write is complete. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "list.h"

typedef struct SliceWrite SliceWrite;

struct SliceWrite {
        uint64_t length;
        uint32_t slice_size;
        uint64_t next_offset;   /* first byte not yet handed out */
        bool queued;
        LIST_FIELDS(SliceWrite, rr);
};

typedef struct SliceQueue {
        QUEUE_HEAD(SliceWrite, q);
        size_t n;
} SliceQueue;

typedef struct Slice {
        SliceWrite *write;
        uint64_t offset;
        uint64_t length;
        bool last;              /* the write's last slice */
} Slice;

/* Initialises w for a write of `length` (> 0) bytes cut at slice_size. */
int slice_write_init(SliceWrite *w, uint64_t length, uint32_t slice_size);
void slice_queue_push(SliceQueue *q, SliceWrite *w);
void slice_queue_remove(SliceQueue *q, SliceWrite *w);
/* Hands out the next slice; false if the queue is empty. */
bool slice_queue_next(SliceQueue *q, Slice *ret);
static inline bool slice_queue_empty(const SliceQueue *q) {
        return q->n == 0;
}

typedef struct SliceTracker {
        uint64_t n_slices;
        uint64_t n_received;
        uint64_t *bits;
} SliceTracker;

int slice_tracker_init(SliceTracker *t, uint64_t length, uint32_t slice_size);
void slice_tracker_done(SliceTracker *t);
/* Claims slice `index` when its header arrives, before any of its bytes land: 0, or
 * -ERANGE / -EEXIST (claimed before: a slice sent twice, refused before it can write
 * over bytes another stream is still landing). slice_tracker_landed() once its bytes
 * are in; the write is complete when every slice has landed, so never while a stream is
 * still inside one of its slices. */
int slice_tracker_claim(SliceTracker *t, uint64_t index);
void slice_tracker_landed(SliceTracker *t);
/* Both at once (a slice received whole). */
int slice_tracker_mark(SliceTracker *t, uint64_t index);
static inline bool slice_tracker_complete(const SliceTracker *t) {
        return t->n_received == t->n_slices;
}
