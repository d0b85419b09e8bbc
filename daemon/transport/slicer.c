/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"
#include "peer/peer-proto.h"
#include "transport/slicer.h"

int slice_write_init(SliceWrite *w, uint64_t length, uint32_t slice_size) {
        if (length == 0 || slice_size < PEER_SLICE_MIN || slice_size > PEER_SLICE_MAX ||
            peer_slice_count(length, slice_size) > PEER_MAX_SLICES_PER_WRITE)
                return -EINVAL;
        *w = (SliceWrite){ .length = length, .slice_size = slice_size };
        return 0;
}

void slice_queue_push(SliceQueue *q, SliceWrite *w) {
        if (w->queued || w->next_offset >= w->length)
                return;
        QUEUE_PUSH_BACK(rr, q->q, w);
        w->queued = true;
        q->n++;
}

void slice_queue_remove(SliceQueue *q, SliceWrite *w) {
        if (!w->queued)
                return;
        QUEUE_REMOVE(rr, q->q, w);
        w->queued = false;
        q->n--;
}

bool slice_queue_next(SliceQueue *q, Slice *ret) {
        SliceWrite *w = q->q.first;

        if (!w)
                return false;
        slice_queue_remove(q, w);
        ret->write = w;
        ret->offset = w->next_offset;
        ret->length = MIN((uint64_t)w->slice_size, w->length - w->next_offset);
        w->next_offset += ret->length;
        ret->last = w->next_offset >= w->length;
        if (!ret->last)
                slice_queue_push(q, w);
        return true;
}

int slice_tracker_init(SliceTracker *t, uint64_t length, uint32_t slice_size) {
        uint64_t n = peer_slice_count(length, slice_size);

        if (n == 0 || n > PEER_MAX_SLICES_PER_WRITE)
                return -EINVAL;
        *t = (SliceTracker){ .n_slices = n };
        t->bits = calloc(DIV_ROUND_UP(n, 64), sizeof(uint64_t));
        if (!t->bits)
                return -ENOMEM;
        return 0;
}

void slice_tracker_done(SliceTracker *t) {
        free(t->bits);
        t->bits = NULL;
}

int slice_tracker_claim(SliceTracker *t, uint64_t index) {
        uint64_t bit;

        if (index >= t->n_slices)
                return -ERANGE;
        bit = UINT64_C(1) << (index % 64);
        if (t->bits[index / 64] & bit)
                return -EEXIST;
        t->bits[index / 64] |= bit;
        return 0;
}

void slice_tracker_landed(SliceTracker *t) {
        assert(t->n_received < t->n_slices);
        t->n_received++;
}

int slice_tracker_mark(SliceTracker *t, uint64_t index) {
        int r = slice_tracker_claim(t, index);
        if (r >= 0)
                slice_tracker_landed(t);
        return r;
}
