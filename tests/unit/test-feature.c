/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "feature/feature-alloc.h"
#include "feature/feature-internal.h"
#include "feature/feature-store.h"
#include "feature/feature.h"
#include "macro.h"
#include "unaligned.h"
#include "../check-main.h"

#define CHUNK 4096u
#define ARENA_CHUNKS 64u
#define DATA_OFFSET 8192u

static uint8_t *arena_mem;
static unsigned n_ready_events, n_failed_events;
static int last_error;
static FeatureRef *release_in_callback; /* a ref the state callback drops, as bus-feature does */

static void on_state(FeatureCache *c, Feature *f, void *userdata) {
        (void)c;
        (void)userdata;
        if (f->state == FEATURE_READY)
                n_ready_events++;
        else if (f->state == FEATURE_FAILED) {
                n_failed_events++;
                last_error = f->error;
        }
        if (release_in_callback && release_in_callback->feature == f)
                feature_ref_release(TAKE_PTR(release_in_callback));
}

static FeatureCache *cache_new(uint64_t budget) {
        FeatureCache *c;
        FeatureCacheConfig cfg = { .budget_bytes = budget, .max_refs = 64,
                                   .announce_timeout_usec = 1000 };

        ck_assert_int_eq(feature_cache_new(&cfg, &c), 0);
        free(arena_mem);
        arena_mem = calloc(1, DATA_OFFSET + ARENA_CHUNKS * CHUNK);
        ck_assert_int_eq(feature_cache_add_arena(c, 3, arena_mem, DATA_OFFSET, ARENA_CHUNKS * CHUNK, CHUNK), 0);
        ck_assert_int_eq(feature_cache_add_arena(c, 3, arena_mem, 0, CHUNK, CHUNK), -EEXIST);
        feature_cache_set_callback(c, on_state, NULL);
        n_ready_events = n_failed_events = 0;
        last_error = 0;
        return c;
}

static FeatureDesc *desc_bytes(uint64_t n) {
        FeatureDesc *d;
        ck_assert_int_eq(feature_desc_new(1, &d), 0);
        strcpy(d->tensors[0].name, "image_embeds");
        d->tensors[0].dtype = FEATURE_DTYPE_U8;
        d->tensors[0].rank = 1;
        d->tensors[0].shape[0] = n;
        d->tensors[0].strides[0] = 1;
        return d;
}

/* Reserve, fill with a pattern, publish; returns the producer ref (now a reader). */
static FeatureRef *produce(FeatureCache *c, const char *key, uint64_t bytes, uint8_t fill) {
        FeatureDesc *d = desc_bytes(bytes);
        FeatureRef *r;
        ck_assert_int_eq(feature_reserve(c, key, bytes, &d, NULL, &r, NULL), 0);
        ck_assert_ptr_null(d);
        memset(feature_data(r->feature), fill, bytes);
        ck_assert_int_eq(feature_publish(r, 1000), 0);
        return r;
}

/* An announced feature (Prefetch) that a reader waits for: a producer whose reservation
 * is refused gives the claim back (feature_ref_unclaim), the reader keeps waiting, and
 * the next producer serves it. */
START_TEST(test_refused_claim_of_announced) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        FeaturePrefetchResult pr;
        FeatureAcquireResult res;
        FeatureRef *w, *p;

        ck_assert_int_eq(feature_prefetch(c, "img:ann", 0, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_ANNOUNCED);
        ck_assert_int_eq(feature_acquire(c, "img:ann", false, 0, &w, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_WAIT);
        ck_assert_int_eq(feature_acquire(c, "img:ann", true, 0, &p, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        ck_assert_uint_eq(feature_cache_stats(c)->n_announced, 0);
        FeatureDesc *d = desc_bytes(2 * ARENA_CHUNKS * CHUNK);
        ck_assert_int_lt(feature_ref_reserve(p, 2 * ARENA_CHUNKS * CHUNK, &d, NULL, NULL), 0);
        feature_desc_free(d);
        feature_ref_unclaim(p);
        ck_assert_int_eq(w->feature->state, FEATURE_RESERVED); /* not failed */
        ck_assert_uint_eq(feature_cache_stats(c)->n_announced, 1);
        /* Another producer takes it and serves the reader. */
        ck_assert_int_eq(feature_acquire(c, "img:ann", true, 0, &p, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        d = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_ref_reserve(p, CHUNK, &d, NULL, NULL), 0);
        ck_assert_int_eq(feature_publish(p, 1), 0);
        ck_assert_int_eq(w->feature->state, FEATURE_READY);
        feature_ref_release(p);
        feature_ref_release(w);
        /* Its deadline still holds once it is back among the announced. */
        ck_assert_int_eq(feature_prefetch(c, "img:late", 0, &pr), 0);
        ck_assert_int_eq(feature_acquire(c, "img:late", false, 0, &w, &res), 0);
        ck_assert_int_eq(feature_acquire(c, "img:late", true, 0, &p, &res), 0);
        feature_ref_unclaim(p);
        (void)feature_cache_expire(c, USEC_INFINITY - 1);
        ck_assert_int_eq(w->feature->state, FEATURE_FAILED);
        feature_ref_release(w);
}
END_TEST

/* A claim refused for want of room (AcquireOrReserve's NoSpace) changes no counter, as
 * a refused Reserve changes none: a fresh feature nobody else saw is dropped, not failed
 * (no failure counted, nobody told), and its Acquire is no miss (the caller was never
 * told to produce). An announced one nobody waits for stays announced, as a refused
 * Reserve leaves it. */
START_TEST(test_refused_claim_counts_nothing) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        FeaturePrefetchResult pr;
        FeatureAcquireResult res;
        FeatureRef *held, *p, *x = NULL;
        FeatureDesc *d;

        held = produce(c, "everything", ARENA_CHUNKS * CHUNK, 1); /* no room left, none to evict */
        FeatureStats before = *feature_cache_stats(c);
        unsigned failed_events = n_failed_events;

        /* A plain Reserve refused: nothing changes. */
        d = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_reserve(c, "fresh", CHUNK, &d, NULL, &x, NULL), -ENOSPC);
        feature_desc_free(d);
        ck_assert_ptr_null(feature_cache_get(c, "fresh"));
        ck_assert_uint_eq(feature_cache_stats(c)->failed, before.failed);
        ck_assert_uint_eq(feature_cache_stats(c)->misses, before.misses);

        /* The same refusal through Acquire (produce) and its Reserve. */
        ck_assert_int_eq(feature_acquire(c, "fresh", true, 0, &p, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        d = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_ref_reserve(p, CHUNK, &d, NULL, NULL), -ENOSPC);
        feature_desc_free(d);
        feature_ref_unclaim(p);
        ck_assert_ptr_null(feature_cache_get(c, "fresh"));
        ck_assert_uint_eq(feature_cache_stats(c)->failed, before.failed);
        ck_assert_uint_eq(feature_cache_stats(c)->misses, before.misses);
        ck_assert_uint_eq(n_failed_events, failed_events);
        ck_assert_uint_eq(feature_cache_stats(c)->n_features, before.n_features);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, before.n_refs);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);

        /* Announced, nobody waiting: back among the announced, as after a refused Reserve. */
        ck_assert_int_eq(feature_prefetch(c, "ann", 0, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_ANNOUNCED);
        d = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_reserve(c, "ann", CHUNK, &d, NULL, &x, NULL), -ENOSPC);
        feature_desc_free(d);
        ck_assert_uint_eq(feature_cache_stats(c)->n_announced, 1);
        ck_assert_int_eq(feature_acquire(c, "ann", true, 0, &p, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        d = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_ref_reserve(p, CHUNK, &d, NULL, NULL), -ENOSPC);
        feature_desc_free(d);
        feature_ref_unclaim(p);
        ck_assert_ptr_nonnull(feature_cache_get(c, "ann"));
        ck_assert_uint_eq(feature_cache_stats(c)->n_announced, 1);
        ck_assert_uint_eq(feature_cache_stats(c)->failed, before.failed);
        ck_assert_uint_eq(feature_cache_stats(c)->misses, before.misses);
        ck_assert_uint_eq(n_failed_events, failed_events);
        /* Its deadline holds: it fails then, as an announcement nobody claimed. */
        (void)feature_cache_expire(c, USEC_INFINITY - 1);
        ck_assert_ptr_null(feature_cache_get(c, "ann"));
        ck_assert_uint_eq(feature_cache_stats(c)->n_announced, 0);

        /* Told to produce and reserved: that Acquire is a miss. */
        feature_ref_release(held);
        ck_assert_int_eq(feature_acquire(c, "fresh", true, 0, &p, &res), 0);
        d = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_ref_reserve(p, CHUNK, &d, NULL, NULL), 0);
        ck_assert_uint_eq(feature_cache_stats(c)->misses, before.misses + 1);
        feature_ref_release(p);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
}
END_TEST

START_TEST(test_coalesce_and_publish) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        FeatureRef *p, *w1, *w2, *h;
        FeatureAcquireResult res;
        EpdId req = { { 1, 2, 3 } };

        ck_assert_int_eq(feature_acquire(c, "img:abc", false, 0, &p, &res), -ENOENT);
        ck_assert_int_eq(feature_acquire(c, "img:abc", true, 0, &p, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        ck_assert_int_eq(p->kind, FEATURE_REF_PRODUCER);
        ck_assert_int_eq(p->feature->state, FEATURE_RESERVED);
        ck_assert(!p->feature->has_region);
        /* everyone else waits, whether or not they could produce */
        ck_assert_int_eq(feature_acquire(c, "img:abc", true, 0, &w1, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_WAIT);
        ck_assert_int_eq(feature_acquire(c, "img:abc", false, 0, &w2, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_WAIT);
        ck_assert_ptr_eq(w1->feature, p->feature);
        ck_assert_uint_eq(feature_cache_stats(c)->coalesced_waits, 2);
        ck_assert_uint_eq(feature_cache_stats(c)->misses, 2);

        /* a second producer is refused; a waiter cannot publish */
        FeatureDesc *d = desc_bytes(10000);
        FeatureRef *x;
        ck_assert_int_eq(feature_reserve(c, "img:abc", 10000, &d, NULL, &x, NULL), -EBUSY);
        ck_assert_int_eq(feature_publish(w1, 0), -EBADSLT);
        ck_assert_int_eq(feature_publish(p, 0), -EBADSLT); /* no region yet */
        ck_assert_int_eq(feature_ref_reserve(w1, 10000, &d, NULL, NULL), -EBADSLT);
        ck_assert_int_eq(feature_ref_reserve(p, 10000, &d, &req, NULL), 0);
        ck_assert_ptr_null(d);
        ck_assert_int_eq(feature_ref_reserve(p, 10000, &d, NULL, NULL), -EALREADY);
        ck_assert_uint_eq(p->feature->size, 3 * CHUNK);
        ck_assert_uint_eq(p->feature->arena, 3);
        ck_assert_uint_ge(p->feature->offset, DATA_OFFSET);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 3 * CHUNK);
        memset(feature_data(p->feature), 0x5a, 10000);
        ck_assert_uint_eq(n_ready_events, 0);
        ck_assert_int_eq(feature_publish(p, 2500), 0);
        ck_assert_uint_eq(n_ready_events, 1);
        ck_assert_int_eq(w1->feature->state, FEATURE_READY);
        ck_assert_int_eq(p->kind, FEATURE_REF_READER);
        ck_assert(epd_id_equal(&p->feature->request_id, &req));
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_cached, 3 * CHUNK);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
        /* all readers see the same bytes */
        const uint8_t *b = feature_data(w2->feature);
        for (int i = 0; i < 10000; i++)
                ck_assert_uint_eq(b[i], 0x5a);

        feature_ref_release(p);
        feature_ref_release(w1);
        feature_ref_release(w2);
        ck_assert(p == NULL || true);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
        /* stays cached after its last reader */
        ck_assert_int_eq(feature_acquire(c, "img:abc", true, 0, &h, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        ck_assert_uint_eq(feature_cache_stats(c)->hits, 1);
        ck_assert_uint_eq(feature_cache_stats(c)->encoder_usec_saved, 2500);
        ck_assert_int_eq(feature_reserve(c, "fresh", 10, &d, NULL, &x, NULL), -EINVAL); /* no desc */
        ck_assert_ptr_null(feature_cache_get(c, "fresh"));
        d = desc_bytes(10);
        ck_assert_int_eq(feature_reserve(c, "img:abc", 10, &d, NULL, &x, NULL), -EEXIST);
        feature_desc_free(d);
        feature_ref_release(h);
}
END_TEST

START_TEST(test_fail_wakes_waiters) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        FeatureRef *p, *w;
        FeatureAcquireResult res;
        FeatureDesc *d = desc_bytes(100);

        ck_assert_int_eq(feature_reserve(c, "k", 100, &d, NULL, &p, NULL), 0);
        ck_assert_int_eq(feature_acquire(c, "k", true, 0, &w, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_WAIT);
        ck_assert_int_eq(feature_fail(w, -EIO), -EBADSLT);
        ck_assert_int_eq(feature_fail(p, -ENOMEM), 0);
        ck_assert_uint_eq(n_failed_events, 1);
        ck_assert_int_eq(last_error, -ENOMEM);
        ck_assert_int_eq(w->feature->state, FEATURE_FAILED);
        ck_assert_int_eq(w->feature->error, -ENOMEM);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
        ck_assert_uint_eq(feature_cache_stats(c)->n_features, 0);
        ck_assert_ptr_null(feature_cache_get(c, "k"));
        /* the key starts over while the old refs still see FAILED */
        FeatureRef *p2;
        ck_assert_int_eq(feature_acquire(c, "k", true, 0, &p2, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        ck_assert_ptr_ne(p2->feature, w->feature);
        ck_assert_int_eq(feature_publish(p, 0), -EBADSLT);
        feature_ref_release(w);
        feature_ref_release(p);

        /* a producer that goes away before publishing fails its waiters with EPIPE */
        ck_assert_int_eq(feature_acquire(c, "k", false, 0, &w, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_WAIT);
        feature_ref_release(p2);
        ck_assert_uint_eq(n_failed_events, 2);
        ck_assert_int_eq(w->feature->state, FEATURE_FAILED);
        ck_assert_int_eq(w->feature->error, -EPIPE);
        feature_ref_release(w);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
        ck_assert_uint_eq(feature_cache_stats(c)->failed, 2);
}
END_TEST

/* A produce timeout of 1000 and key "slow" reserved (3 chunks) at 10 by its producer. */
static FeatureRef *slow_producer(FeatureCache *c) {
        FeatureRef *p;
        FeatureAcquireResult res;
        feature_cache_set_produce_timeout(c, 1000);
        ck_assert_int_eq(feature_acquire(c, "slow", true, 10, &p, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        FeatureDesc *d = desc_bytes(3 * CHUNK);
        ck_assert_int_eq(feature_ref_reserve(p, 3 * CHUNK, &d, NULL, NULL), 0);
        return p;
}

/* A producer that does not publish within the produce timeout fails the feature with
 * -ETIMEDOUT: its waiters hear it and the next Acquire produces; its region stays
 * allocated (it may still be writing) until its reference goes. One that publishes in
 * time, gives its claim back or fails is out of the deadline queue. */
START_TEST(test_produce_timeout) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        FeatureRef *p, *w, *q;
        FeatureAcquireResult res;

        p = slow_producer(c);
        ck_assert_int_eq(feature_acquire(c, "slow", true, 20, &w, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_WAIT);
        ck_assert_uint_eq(feature_cache_expire(c, 500), 1010);
        ck_assert_int_eq(w->feature->state, FEATURE_RESERVED);
        ck_assert_uint_eq(feature_cache_expire(c, 1010), USEC_INFINITY);
        ck_assert_int_eq(w->feature->state, FEATURE_FAILED);
        ck_assert_int_eq(w->feature->error, -ETIMEDOUT);
        ck_assert_uint_eq(feature_cache_stats(c)->produce_timeouts, 1);
        /* The region is still the late producer's. */
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 3 * CHUNK);
        ck_assert_int_eq(feature_publish(p, 1), -EBADSLT);
        ck_assert_int_eq(feature_acquire(c, "slow", true, 1020, &q, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        feature_ref_release(w);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 3 * CHUNK);
        feature_ref_release(p);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
        ck_assert_int_eq(feature_allocator_check(c->arenas[0].alloc), 0);
        ck_assert_uint_eq(feature_allocator_used(c->arenas[0].alloc), 0);

        /* In time: published, out of the queue. */
        FeatureDesc *d = desc_bytes(100);
        ck_assert_int_eq(feature_ref_reserve(q, 100, &d, NULL, NULL), 0);
        ck_assert_int_eq(feature_publish(q, 1), 0);
        ck_assert_uint_eq(feature_cache_expire(c, 5000), USEC_INFINITY);
        ck_assert_int_eq(q->feature->state, FEATURE_READY);
        feature_ref_release(q);
        /* A Reserve's producer gets the deadline from the caller (the bus glue). */
        d = desc_bytes(100);
        ck_assert_int_eq(feature_reserve(c, "r", 100, &d, NULL, &p, NULL), 0);
        feature_producing_start(c, p->feature, 6000);
        ck_assert_uint_eq(feature_cache_expire(c, 6000), 7000);
        ck_assert_int_eq(feature_fail(p, -EIO), 0);
        ck_assert_uint_eq(feature_cache_expire(c, 7000), USEC_INFINITY);
        feature_ref_release(p);
        /* A reload that lowers the timeout: a new claim's earlier deadline goes first. */
        FeatureRef *old_claim, *new_claim;
        feature_cache_set_produce_timeout(c, 5000);
        ck_assert_int_eq(feature_acquire(c, "old", true, 7000, &old_claim, &res), 0);
        feature_cache_set_produce_timeout(c, 100);
        ck_assert_int_eq(feature_acquire(c, "new", true, 7100, &new_claim, &res), 0);
        ck_assert_uint_eq(feature_cache_expire(c, 7100), 7200);
        ck_assert_uint_eq(feature_cache_expire(c, 7200), 12000);
        ck_assert_int_eq(new_claim->feature->state, FEATURE_FAILED);
        ck_assert_int_eq(old_claim->feature->state, FEATURE_RESERVED);
        feature_ref_release(new_claim);
        feature_ref_release(old_claim);
        ck_assert_uint_eq(feature_cache_expire(c, 12000), USEC_INFINITY);
        /* 0: no deadline. */
        feature_cache_set_produce_timeout(c, 0);
        ck_assert_int_eq(feature_acquire(c, "never", true, 8000, &p, &res), 0);
        ck_assert_uint_eq(feature_cache_expire(c, UINT64_MAX - 1), USEC_INFINITY);
        feature_ref_release(p);
        ck_assert_uint_eq(feature_cache_stats(c)->produce_timeouts, 2);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
}
END_TEST

/* A producer past its produce deadline whose waiter still holds the failed feature: the
 * region is the producer's alone, and goes with the producer's reference, not with the
 * last reference to the feature (docs/features.md: "until its handle goes"). Before,
 * it stayed allocated, and counted in BytesReserved, until the waiter went too. */
START_TEST(test_produce_timeout_region_goes_with_producer) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        FeatureRef *p, *w, *pin, *q;
        FeatureAcquireResult res;

        p = slow_producer(c);
        ck_assert_int_eq(feature_acquire(c, "slow", false, 20, &w, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_WAIT);
        ck_assert_int_eq(feature_pin(c, "slow", &pin), 0);
        ck_assert_uint_eq(feature_cache_expire(c, 1010), USEC_INFINITY);
        ck_assert_int_eq(w->feature->state, FEATURE_FAILED);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 3 * CHUNK);
        ck_assert_uint_eq(feature_allocator_used(c->arenas[0].alloc), 3 * CHUNK);
        /* The producer goes first: its region with it, the waiter and the pin kept. */
        feature_ref_release(p);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
        ck_assert_int_eq(feature_allocator_check(c->arenas[0].alloc), 0);
        ck_assert_uint_eq(feature_allocator_used(c->arenas[0].alloc), 0);
        ck_assert_int_eq(w->feature->state, FEATURE_FAILED);
        ck_assert_int_eq(w->feature->error, -ETIMEDOUT);
        ck_assert(!w->feature->has_region);
        /* Its chunks are handed out again while the failed feature is still held. */
        ck_assert_int_eq(feature_acquire(c, "slow", true, 1020, &q, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        FeatureDesc *d = desc_bytes(ARENA_CHUNKS * CHUNK);
        ck_assert_int_eq(feature_ref_reserve(q, ARENA_CHUNKS * CHUNK, &d, NULL, NULL), 0);
        ck_assert_int_eq(feature_publish(q, 1), 0);
        feature_ref_release(w);
        feature_ref_release(pin);
        feature_ref_release(q);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_cached, ARENA_CHUNKS * CHUNK);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
}
END_TEST

static int journal_result, journal_ready_records;
static int journal_refusing(FeatureCache *c, uint16_t rec, const void *payload, size_t len, void *userdata) {
        if (rec == FEATURE_REC_READY && journal_result == 0)
                journal_ready_records++;
        return journal_result;
}

/* A Publish whose READY record the journal refuses is refused itself: the feature stays
 * reserved (no reader woken, nothing acknowledged as durable), and the producer may
 * publish again once the journal takes it. */
START_TEST(test_publish_refused_without_its_record) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        FeatureDesc *d = desc_bytes(100);
        FeatureRef *p, *w;
        feature_cache_set_journal(c, journal_refusing, NULL);
        journal_result = -ENOSPC;
        journal_ready_records = 0;
        ck_assert_int_eq(feature_reserve(c, "k", 100, &d, NULL, &p, NULL), 0);
        FeatureAcquireResult res;
        ck_assert_int_eq(feature_acquire(c, "k", false, 0, &w, &res), 0);
        ck_assert_int_eq(feature_publish(p, 7), -ENOSPC);
        ck_assert_int_eq(p->feature->state, FEATURE_RESERVED);
        ck_assert_int_eq(p->kind, FEATURE_REF_PRODUCER);
        ck_assert_int_eq(n_ready_events, 0);
        journal_result = 0;
        ck_assert_int_eq(feature_publish(p, 7), 0);
        ck_assert_int_eq(p->feature->state, FEATURE_READY);
        ck_assert_int_eq(journal_ready_records, 1);
        ck_assert_int_eq(n_ready_events, 1);
        feature_ref_release(w);
        feature_ref_release(p);
}
END_TEST

START_TEST(test_reserve_errors) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(16 * CHUNK);
        FeatureDescIssue issue;
        FeatureRef *r;
        FeatureDesc *d;
        char key[FEATURE_KEY_MAX + 2];

        d = desc_bytes(200);
        ck_assert_int_eq(feature_reserve(c, "k", 100, &d, NULL, &r, &issue), -EINVAL);
        ck_assert_int_eq(issue.error, FEATURE_DESC_OUT_OF_RANGE);
        ck_assert_ptr_nonnull(d); /* not taken */
        ck_assert_uint_eq(feature_cache_stats(c)->n_features, 0);
        ck_assert_int_eq(feature_reserve(c, "k", 17 * CHUNK, &d, NULL, &r, &issue), -E2BIG);
        ck_assert_int_eq(feature_reserve(c, "", 300, &d, NULL, &r, &issue), -EINVAL);
        memset(key, 'k', sizeof key);
        key[FEATURE_KEY_MAX + 1] = 0;
        ck_assert_int_eq(feature_reserve(c, key, 300, &d, NULL, &r, &issue), -EINVAL);
        key[FEATURE_KEY_MAX] = 0;
        ck_assert_int_eq(feature_reserve(c, key, 300, &d, NULL, &r, &issue), 0);
        /* placement follows the producer's arenas: arena 3 only, or none of them */
        {
                FeatureDesc *pd = desc_bytes(100);
                FeatureRef *x;
                ck_assert_int_eq(feature_reserve_in(c, "placed", 100, 1ULL << 5, &pd, NULL, &x, NULL), -E2BIG);
                ck_assert_int_eq(feature_reserve_in(c, "placed", 100, 1ULL << 3, &pd, NULL, &x, NULL), 0);
                ck_assert_uint_eq(x->feature->arena, 3);
                feature_ref_release(x);
        }
        ck_assert_int_eq(feature_fail(r, 5), 0); /* positive error becomes -EIO */
        {
                /* no feature arena at all */
                FeatureCacheConfig cfg = { .budget_bytes = 1 << 20 };
                _cleanup_(feature_cache_freep) FeatureCache *c2 = NULL;
                FeatureDesc *d2 = desc_bytes(10);
                FeatureRef *x;
                ck_assert_int_eq(feature_cache_new(&cfg, &c2), 0);
                ck_assert_int_eq(feature_reserve(c2, "k", 10, &d2, NULL, &x, NULL), -ENODEV);
                ck_assert_uint_eq(feature_cache_stats(c2)->n_features, 0);
                feature_desc_free(d2);
        }
        ck_assert_int_eq(r->feature->error, -EIO);
        feature_ref_release(r);
        ck_assert_uint_eq(feature_cache_stats(c)->n_features, 0);
}
END_TEST

/* A reservation limited to some arenas evicts only where it could be placed: with
 * every run of arena 3 held, a request for arena 3 is refused without touching the
 * features cached in arena 5; once arena 3 has an unreferenced feature, that one goes
 * (and nothing in arena 5). When the budget is what is short, the coldest goes,
 * wherever it is. */
START_TEST(test_evict_in_allowed_arenas) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(2 * ARENA_CHUNKS * CHUNK);
        _cleanup_(freep) uint8_t *mem5 = calloc(1, 16 * CHUNK);
        FeatureRef *held[16], *x;
        FeatureDesc *d;
        char key[16];

        ck_assert_int_eq(feature_cache_add_arena(c, 5, mem5, 0, 16 * CHUNK, CHUNK), 0);
        for (int i = 0; i < 16; i++) {
                snprintf(key, sizeof key, "h%d", i);
                d = desc_bytes(4 * CHUNK);
                ck_assert_int_eq(feature_reserve_in(c, key, 4 * CHUNK, 1ULL << 3, &d, NULL, &held[i], NULL), 0);
                ck_assert_int_eq(feature_publish(held[i], 1), 0);
        }
        for (int i = 0; i < 4; i++) {
                snprintf(key, sizeof key, "c%d", i);
                d = desc_bytes(4 * CHUNK);
                ck_assert_int_eq(feature_reserve_in(c, key, 4 * CHUNK, 1ULL << 5, &d, NULL, &x, NULL), 0);
                ck_assert_int_eq(feature_publish(x, 1), 0);
                feature_ref_release(x);
        }
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_cached, 80 * CHUNK);

        /* the budget has room, arena 3 has none and nothing evictable: refused, and
         * arena 5 keeps its features */
        d = desc_bytes(4 * CHUNK);
        ck_assert_int_eq(feature_reserve_in(c, "new", 4 * CHUNK, 1ULL << 3, &d, NULL, &x, NULL), -ENOSPC);
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 0);
        for (int i = 0; i < 4; i++) {
                snprintf(key, sizeof key, "c%d", i);
                ck_assert_ptr_nonnull(feature_cache_get(c, key));
        }
        ck_assert_ptr_null(feature_cache_get(c, "new"));

        /* h0 becomes evictable (hotter than every c*): it alone goes */
        feature_ref_release(held[0]);
        ck_assert_int_eq(feature_reserve_in(c, "new", 4 * CHUNK, 1ULL << 3, &d, NULL, &x, NULL), 0);
        ck_assert_uint_eq(x->feature->arena, 3);
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 1);
        ck_assert_ptr_null(feature_cache_get(c, "h0"));
        for (int i = 0; i < 4; i++) {
                snprintf(key, sizeof key, "c%d", i);
                ck_assert_ptr_nonnull(feature_cache_get(c, key));
        }
        ck_assert_int_eq(feature_publish(x, 1), 0);
        feature_ref_release(x);

        /* the budget is short and arena 3 full: "new" (arena 3) makes the run, and it
         * frees the budget too, so nothing in arena 5 goes */
        feature_cache_set_budget(c, 80 * CHUNK);
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 1);
        d = desc_bytes(4 * CHUNK);
        ck_assert_int_eq(feature_reserve_in(c, "new2", 4 * CHUNK, 1ULL << 3, &d, NULL, &x, NULL), 0);
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 2);
        ck_assert_ptr_null(feature_cache_get(c, "new"));
        ck_assert_ptr_nonnull(feature_cache_get(c, "c0"));
        ck_assert_int_eq(feature_publish(x, 1), 0);
        feature_ref_release(x);

        /* arena 5 has a free run but the budget is short: the coldest goes, though it
         * is in arena 3 */
        feature_cache_set_budget(c, 76 * CHUNK); /* c0 goes */
        ck_assert_ptr_null(feature_cache_get(c, "c0"));
        for (int i = 1; i < 4; i++) {
                FeatureAcquireResult res;
                snprintf(key, sizeof key, "c%d", i);
                ck_assert_int_eq(feature_acquire(c, key, false, 0, &x, &res), 0);
                feature_ref_release(x); /* hotter than new2 */
        }
        d = desc_bytes(4 * CHUNK);
        ck_assert_int_eq(feature_reserve_in(c, "x5", 4 * CHUNK, 1ULL << 5, &d, NULL, &x, NULL), 0);
        ck_assert_uint_eq(x->feature->arena, 5);
        ck_assert_ptr_null(feature_cache_get(c, "new2"));
        for (int i = 1; i < 4; i++) {
                snprintf(key, sizeof key, "c%d", i);
                ck_assert_ptr_nonnull(feature_cache_get(c, key));
        }
        feature_ref_release(x);
        for (int i = 1; i < 16; i++)
                feature_ref_release(held[i]);
}
END_TEST

/* A region is whole chunks of its arena: a request that fits the budget in bytes but
 * not once its arena rounds it up evicts nothing (it emptied the cold list, then was
 * refused anyway). */
START_TEST(test_evict_counts_chunk_rounding) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(40 * CHUNK);
        _cleanup_(freep) uint8_t *mem7 = calloc(1, 32 * CHUNK);
        FeatureRef *held[7], *x;
        FeatureDesc *d;
        char key[16];

        ck_assert_int_eq(feature_cache_add_arena(c, 7, mem7, 0, 32 * CHUNK, 16 * CHUNK), 0);
        for (int i = 0; i < 7; i++) {
                snprintf(key, sizeof key, "h%d", i);
                d = desc_bytes(4 * CHUNK);
                ck_assert_int_eq(feature_reserve_in(c, key, 4 * CHUNK, 1ULL << 3, &d, NULL, &held[i], NULL), 0);
                ck_assert_int_eq(feature_publish(held[i], 1), 0);
        }
        for (int i = 0; i < 2; i++) {
                snprintf(key, sizeof key, "c%d", i);
                d = desc_bytes(4 * CHUNK);
                ck_assert_int_eq(feature_reserve_in(c, key, 4 * CHUNK, 1ULL << 3, &d, NULL, &x, NULL), 0);
                ck_assert_int_eq(feature_publish(x, 1), 0);
                feature_ref_release(x);
        }
        /* 36 chunks cached, 8 of them cold: 5 chunks would fit the budget, but arena 7
         * makes them 16, and 28 held + 16 > 40 */
        d = desc_bytes(5 * CHUNK);
        ck_assert_int_eq(feature_reserve_in(c, "big", 5 * CHUNK, 1ULL << 7, &d, NULL, &x, NULL), -ENOSPC);
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 0);
        ck_assert_ptr_nonnull(feature_cache_get(c, "c0"));
        ck_assert_ptr_nonnull(feature_cache_get(c, "c1"));
        /* a region larger than the budget once rounded is too big, not short of room */
        feature_cache_set_budget(c, 48 * CHUNK);
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 0);
        ck_assert_int_eq(feature_reserve_in(c, "big", 5 * CHUNK, 1ULL << 7, &d, NULL, &x, NULL), 0);
        ck_assert_uint_eq(x->feature->arena, 7);
        ck_assert_uint_eq(x->feature->size, 16 * CHUNK);
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 1); /* 28 + 4 + 16 = 48 */
        ck_assert_ptr_null(feature_cache_get(c, "c0"));
        ck_assert_ptr_nonnull(feature_cache_get(c, "c1"));
        feature_ref_release(x);
        feature_cache_set_budget(c, 15 * CHUNK);
        d = desc_bytes(5 * CHUNK);
        ck_assert_int_eq(feature_reserve_in(c, "big2", 5 * CHUNK, 1ULL << 7, &d, NULL, &x, NULL), -E2BIG);
        feature_desc_free(d);
        for (int i = 0; i < 7; i++)
                feature_ref_release(held[i]);
}
END_TEST

/* Eviction for want of a run takes features only from arenas where evicting can make
 * one: arena 3's cold features cannot (too few), arena 5's can. */
START_TEST(test_evict_where_it_helps) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(1024 * CHUNK);
        _cleanup_(freep) uint8_t *mem5 = calloc(1, 16 * CHUNK);
        FeatureRef *held[62], *x;
        FeatureDesc *d;
        char key[16];

        ck_assert_int_eq(feature_cache_add_arena(c, 5, mem5, 0, 16 * CHUNK, CHUNK), 0);
        for (int i = 0; i < 62; i++) {
                snprintf(key, sizeof key, "h%d", i);
                d = desc_bytes(CHUNK);
                ck_assert_int_eq(feature_reserve_in(c, key, CHUNK, 1ULL << 3, &d, NULL, &held[i], NULL), 0);
                ck_assert_int_eq(feature_publish(held[i], 1), 0);
        }
        for (int i = 0; i < 2; i++) { /* arena 3's last two chunks, cold first */
                snprintf(key, sizeof key, "a%d", i);
                d = desc_bytes(CHUNK);
                ck_assert_int_eq(feature_reserve_in(c, key, CHUNK, 1ULL << 3, &d, NULL, &x, NULL), 0);
                ck_assert_int_eq(feature_publish(x, 1), 0);
                feature_ref_release(x);
        }
        for (int i = 0; i < 4; i++) { /* arena 5, full, warmer */
                snprintf(key, sizeof key, "b%d", i);
                d = desc_bytes(4 * CHUNK);
                ck_assert_int_eq(feature_reserve_in(c, key, 4 * CHUNK, 1ULL << 5, &d, NULL, &x, NULL), 0);
                ck_assert_int_eq(feature_publish(x, 1), 0);
                feature_ref_release(x);
        }
        d = desc_bytes(8 * CHUNK);
        ck_assert_int_eq(feature_reserve_in(c, "new", 8 * CHUNK, (1ULL << 3) | (1ULL << 5), &d, NULL, &x, NULL), 0);
        ck_assert_uint_eq(x->feature->arena, 5);
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 2);
        ck_assert_ptr_nonnull(feature_cache_get(c, "a0"));
        ck_assert_ptr_nonnull(feature_cache_get(c, "a1"));
        ck_assert_ptr_null(feature_cache_get(c, "b0"));
        ck_assert_ptr_null(feature_cache_get(c, "b1"));
        feature_ref_release(x);
        for (int i = 0; i < 62; i++)
                feature_ref_release(held[i]);
}
END_TEST

/* Eviction beside a large arena that cannot help: the cold end holds 32,768 features
 * of arena 4, a Reserve allowed in arena 3 only (16,384 features, full) evicts half of
 * it. Each eviction walked the cold list past all of arena 4's (2.8 s at -O2, on the
 * loop; review), and every Reserve that had to evict walked it whole once more. Now
 * each arena keeps its own cold list and evictable bytes: the coldest of arena 3 go, in
 * order, none of arena 4's, well within a second even sanitized. */
static double mono_s(void) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}
START_TEST(test_evict_beside_large_arena) {
        enum { OTHER = 32768, MINE = 16384 };
        FeatureCache *c;
        FeatureCacheConfig cfg = { .budget_bytes = UINT64_MAX / 4, .max_refs = 1u << 20 };
        FeatureRef *r;
        FeatureDesc *d;
        char key[32];

        ck_assert_int_eq(feature_cache_new(&cfg, &c), 0);
        /* Arenas the daemon does not map (a GPU's): no base. */
        ck_assert_int_eq(feature_cache_add_arena(c, 3, NULL, 0, (uint64_t)MINE * CHUNK, CHUNK), 0);
        ck_assert_int_eq(feature_cache_add_arena(c, 4, NULL, 0, (uint64_t)OTHER * CHUNK, CHUNK), 0);
        for (unsigned i = 0; i < OTHER + MINE; i++) {
                bool other = i < OTHER; /* the colder */
                snprintf(key, sizeof key, "%s%u", other ? "other-" : "mine-", other ? i : i - OTHER);
                d = desc_bytes(CHUNK);
                ck_assert_int_eq(feature_reserve_in(c, key, CHUNK, 1ULL << (other ? 4 : 3), &d, NULL, &r, NULL), 0);
                ck_assert_int_eq(feature_publish(r, 1), 0);
                feature_ref_release(r);
        }
        /* mine-1 warmed: the coldest of arena 3 are mine-0, mine-2, mine-3... */
        FeatureAcquireResult res;
        ck_assert_int_eq(feature_acquire(c, "mine-1", false, 0, &r, &res), 0);
        feature_ref_release(r);
        d = desc_bytes((uint64_t)MINE / 2 * CHUNK);
        double t0 = mono_s();
        ck_assert_int_eq(feature_reserve_in(c, "big", (uint64_t)MINE / 2 * CHUNK, 1ULL << 3, &d, NULL, &r, NULL), 0);
        double took = mono_s() - t0;
        printf("half of arena 3 beside %u features of arena 4: %u evictions in %.1f ms\n", OTHER,
               (unsigned)feature_cache_stats(c)->evictions, took * 1e3);
        /* A run of MINE / 2 chunks past the warm mine-1: mine-0, then mine-2 to
         * mine-(MINE / 2 + 1). */
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, MINE / 2 + 1);
        ck_assert_ptr_null(feature_cache_get(c, "mine-0"));
        ck_assert_ptr_nonnull(feature_cache_get(c, "mine-1"));
        snprintf(key, sizeof key, "mine-%u", MINE / 2 + 1);
        ck_assert_ptr_null(feature_cache_get(c, key));
        snprintf(key, sizeof key, "mine-%u", MINE / 2 + 2);
        ck_assert_ptr_nonnull(feature_cache_get(c, key));
        ck_assert_ptr_nonnull(feature_cache_get(c, "other-0"));
        ck_assert_msg(took < 1.0, "%.3f s", took);
        feature_ref_release(r);
        feature_cache_free(c);
}
END_TEST

START_TEST(test_lru_budget) {
        /* budget of 4 features of 4 chunks each */
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(16 * CHUNK);
        FeatureAcquireResult res;
        FeatureRef *h;
        char key[16];

        for (int i = 0; i < 4; i++) {
                snprintf(key, sizeof key, "k%d", i);
                feature_ref_release(produce(c, key, 4 * CHUNK, (uint8_t)i));
        }
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_cached, 16 * CHUNK);
        /* touch k0: it becomes the hottest */
        ck_assert_int_eq(feature_acquire(c, "k0", false, 0, &h, &res), 0);
        feature_ref_release(h);
        /* k4 evicts the coldest: k1 */
        feature_ref_release(produce(c, "k4", 4 * CHUNK, 4));
        ck_assert_ptr_null(feature_cache_get(c, "k1"));
        ck_assert_ptr_nonnull(feature_cache_get(c, "k0"));
        ck_assert_uint_eq(feature_cache_stats(c)->evictions, 1);
        /* a held feature is not evicted: hold k2, add k5 (8 chunks): k3 and k0 go */
        ck_assert_int_eq(feature_acquire(c, "k2", false, 0, &h, &res), 0);
        feature_ref_release(produce(c, "k5", 8 * CHUNK, 5));
        ck_assert_ptr_nonnull(feature_cache_get(c, "k2"));
        ck_assert_ptr_null(feature_cache_get(c, "k3"));
        ck_assert_ptr_null(feature_cache_get(c, "k0"));
        ck_assert_ptr_nonnull(feature_cache_get(c, "k4"));
        ck_assert_uint_le(feature_cache_stats(c)->bytes_cached, 16 * CHUNK);
        feature_ref_release(h);
        /* the budget shrinks: evicted down to it */
        feature_cache_set_budget(c, 8 * CHUNK);
        ck_assert_uint_le(feature_cache_stats(c)->bytes_cached, 8 * CHUNK);
        /* LRU order was k4, k5, k2 (released last): k4 and k5 go */
        ck_assert_ptr_nonnull(feature_cache_get(c, "k2"));
        ck_assert_ptr_null(feature_cache_get(c, "k5"));
        ck_assert_uint_eq(feature_cache_flush(c), 1);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_cached, 0);
        ck_assert_uint_eq(feature_cache_stats(c)->n_features, 0);
}
END_TEST

START_TEST(test_pins) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(8 * CHUNK);
        FeatureRef *pin, *r;
        FeatureDesc *d;

        ck_assert_int_eq(feature_pin(c, "nope", &pin), -ENOENT);
        feature_ref_release(produce(c, "a", 4 * CHUNK, 1));
        feature_ref_release(produce(c, "b", 4 * CHUNK, 2));
        ck_assert_int_eq(feature_pin(c, "a", &pin), 0);
        ck_assert_int_eq(pin->kind, FEATURE_REF_PIN);
        /* "a" is the coldest but pinned: "b" goes */
        feature_ref_release(produce(c, "c", 4 * CHUNK, 3));
        ck_assert_ptr_nonnull(feature_cache_get(c, "a"));
        ck_assert_ptr_null(feature_cache_get(c, "b"));
        /* nothing evictable left beyond "c": a pinned "a" and a held "c" → no space */
        FeatureAcquireResult res;
        ck_assert_int_eq(feature_acquire(c, "c", false, 0, &r, &res), 0);
        d = desc_bytes(CHUNK);
        FeatureRef *x;
        ck_assert_int_eq(feature_reserve(c, "d", CHUNK, &d, NULL, &x, NULL), -ENOSPC);
        ck_assert_ptr_null(feature_cache_get(c, "d"));
        ck_assert_uint_eq(feature_cache_flush(c), 0);
        feature_ref_release(pin); /* "a" enters the LRU first: coldest */
        feature_ref_release(r);
        ck_assert_int_eq(feature_reserve(c, "d", CHUNK, &d, NULL, &x, NULL), 0);
        ck_assert_ptr_null(feature_cache_get(c, "a")); /* the unpinned coldest went */
        feature_ref_release(x);
}
END_TEST

/* A store in a fresh directory of its own (dir: TMP_STORE bytes), attached to c. */
#define TMP_STORE "/tmp/test-feature-XXXXXX" /* mkdtemp's template */
static FeatureStore *tmp_store_open(FeatureCache *c, char dir[static sizeof TMP_STORE]) {
        FeatureStore *st;
        memcpy(dir, TMP_STORE, sizeof TMP_STORE);
        ck_assert_ptr_nonnull(mkdtemp(dir));
        ck_assert_int_eq(feature_store_open(dir, 0, &st), 0);
        feature_cache_set_store(c, st);
        return st;
}

/* The store and its directory gone (the cache detached from it first). */
static void tmp_store_close(FeatureCache *c, FeatureStore *st, const char *dir) {
        char cmd[64];
        if (c)
                feature_cache_set_store(c, NULL);
        feature_store_free(st);
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        ck_assert_int_eq(system(cmd), 0);
}

static void save(FeatureStore *st, const char *key, uint64_t bytes, uint8_t fill) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = desc_bytes(bytes);
        _cleanup_(freep) uint8_t *data = malloc(bytes);
        memset(data, fill, bytes);
        ck_assert_int_eq(feature_store_save(st, &(FeatureStoreRecord){ .key = key, .size = bytes, .desc = d },
                                            data), 0);
}

/* A stored copy there is no room to read back (everything cached is held): an Acquire
 * that may not produce hears NoSpace, not that the feature is absent. */
START_TEST(test_stored_copy_without_room) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(8 * CHUNK);
        char dir[sizeof TMP_STORE];
        FeatureStore *st = tmp_store_open(c, dir);
        FeatureAcquireResult res;
        FeatureRef *held, *x = NULL;

        save(st, "stored", 4 * CHUNK, 0x5a);
        held = produce(c, "held", 8 * CHUNK, 1);
        ck_assert_int_eq(feature_acquire(c, "stored", false, 0, &x, &res), -ENOSPC);
        ck_assert_int_eq(feature_acquire(c, "absent", false, 0, &x, &res), -ENOENT);
        feature_ref_release(held);
        ck_assert_int_eq(feature_acquire(c, "stored", false, 0, &x, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        ck_assert_uint_eq(((uint8_t *)feature_data(x->feature))[0], 0x5a);
        feature_ref_release(x);
        tmp_store_close(c, st, dir);
}
END_TEST

START_TEST(test_prefetch) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(16 * CHUNK);
        FeaturePrefetchResult pr;
        FeatureAcquireResult res;
        FeatureRef *w, *p, *q;
        FeatureDesc *d;

        feature_ref_release(produce(c, "ready", CHUNK, 1));
        ck_assert_int_eq(feature_prefetch(c, "ready", 0, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_PRESENT);
        ck_assert_int_eq(feature_prefetch(c, "x", 100, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_ANNOUNCED);
        ck_assert_int_eq(feature_prefetch(c, "x", 100, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_PENDING);
        ck_assert_uint_eq(feature_cache_stats(c)->prefetch_hits, 1);
        ck_assert_uint_eq(feature_cache_stats(c)->prefetch_requests, 3);

        /* a prefill that cannot produce waits on the announced key */
        ck_assert_int_eq(feature_acquire(c, "x", false, 150, &w, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_WAIT);
        /* an encoder claims it with Reserve */
        d = desc_bytes(100);
        ck_assert_int_eq(feature_reserve(c, "x", 100, &d, NULL, &p, NULL), 0);
        ck_assert_uint_eq(feature_cache_expire(c, 5000), USEC_INFINITY); /* claimed: no deadline */
        ck_assert_int_eq(feature_publish(p, 7), 0);
        ck_assert_int_eq(w->feature->state, FEATURE_READY);
        feature_ref_release(w);
        feature_ref_release(p);

        /* announced, never produced: waiters fail at the deadline */
        ck_assert_int_eq(feature_prefetch(c, "y", 1000, &pr), 0);
        ck_assert_int_eq(feature_acquire(c, "y", false, 1000, &w, &res), 0);
        ck_assert_uint_eq(feature_cache_expire(c, 1999), 2000);
        ck_assert_int_eq(w->feature->state, FEATURE_RESERVED);
        ck_assert_uint_eq(feature_cache_expire(c, 2000), USEC_INFINITY);
        ck_assert_int_eq(w->feature->state, FEATURE_FAILED);
        ck_assert_int_eq(w->feature->error, -ETIMEDOUT);
        feature_ref_release(w);

        /* announced, then the first Acquire that may produce is told to */
        ck_assert_int_eq(feature_prefetch(c, "z", 0, &pr), 0);
        ck_assert_int_eq(feature_acquire(c, "z", true, 0, &q, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        ck_assert_uint_eq(feature_cache_expire(c, 1u << 30), USEC_INFINITY);
        ck_assert_int_eq(q->feature->state, FEATURE_RESERVED);
        feature_ref_release(q);
        /* announcements are bounded and never evict: a cache full of READY features
         * stays as it is */
        {
                FeatureCacheConfig cfg = { .budget_bytes = 1 << 20, .max_features = 4, .max_announced = 2 };
                _cleanup_(feature_cache_freep) FeatureCache *c2 = NULL;
                ck_assert_int_eq(feature_cache_new(&cfg, &c2), 0);
                ck_assert_int_eq(feature_cache_add_arena(c2, 0, arena_mem, 0, 16 * CHUNK, CHUNK), 0);
                ck_assert_int_eq(feature_prefetch(c2, "a1", 0, &pr), 0);
                ck_assert_int_eq(feature_prefetch(c2, "a2", 0, &pr), 0);
                ck_assert_int_eq(feature_prefetch(c2, "a3", 0, &pr), -ENOSPC);
                ck_assert_uint_eq(feature_cache_stats(c2)->n_announced, 2);
                feature_cache_expire(c2, 1ull << 40);
                ck_assert_uint_eq(feature_cache_stats(c2)->n_announced, 0);
                for (int i = 0; i < 4; i++) {
                        char k[8];
                        snprintf(k, sizeof k, "r%d", i);
                        feature_ref_release(produce(c2, k, CHUNK, 1));
                }
                ck_assert_int_eq(feature_prefetch(c2, "a4", 0, &pr), -ENOSPC);
                ck_assert_uint_eq(feature_cache_stats(c2)->n_features, 4);
                ck_assert_uint_eq(feature_cache_stats(c2)->evictions, 0);
        }
        /* loads from the store that Prefetch starts use free space only: a cache full
         * of cold features keeps them, the stored key is no-space (an Acquire loads
         * it, evicting) */
        {
                _cleanup_(feature_cache_freep) FeatureCache *c3 = cache_new(16 * CHUNK);
                char dir[sizeof TMP_STORE], k[8];
                FeatureStore *st = tmp_store_open(c3, dir);

                save(st, "s0", 4 * CHUNK, 0x10);
                save(st, "s1", 4 * CHUNK, 0x11);
                for (int i = 0; i < 3; i++) {
                        snprintf(k, sizeof k, "r%d", i);
                        feature_ref_release(produce(c3, k, 4 * CHUNK, 1));
                }
                ck_assert_int_eq(feature_prefetch(c3, "s0", 0, &pr), 0);
                ck_assert_int_eq(pr, FEATURE_PREFETCH_LOADED);
                ck_assert_int_eq(feature_cache_get(c3, "s0")->state, FEATURE_READY);
                ck_assert_uint_eq(feature_cache_stats(c3)->evictions, 0);
                ck_assert_int_eq(feature_prefetch(c3, "s1", 0, &pr), -ENOSPC);
                ck_assert_uint_eq(feature_cache_stats(c3)->evictions, 0);
                ck_assert_ptr_null(feature_cache_get(c3, "s1"));
                for (int i = 0; i < 3; i++) {
                        snprintf(k, sizeof k, "r%d", i);
                        ck_assert_ptr_nonnull(feature_cache_get(c3, k));
                }
                ck_assert_int_eq(feature_acquire(c3, "s1", false, 0, &q, &res), 0);
                ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
                ck_assert_uint_eq(feature_cache_stats(c3)->evictions, 1);
                ck_assert_ptr_null(feature_cache_get(c3, "r0"));
                feature_ref_release(q);

                /* A stored copy that cannot be read (damaged: removed) is failed, not
                 * announced: no encoder is sent for it, and the Acquire that comes
                 * produces it (the key is absent now: a later Prefetch announces it). */
                char name[FEATURE_STORE_NAME_MAX];
                save(st, "s2", CHUNK, 0x12);
                ck_assert_int_eq(feature_store_name("s2", name), 0);
                int fd = feature_store_openat(st, name, O_WRONLY, 0);
                ck_assert_int_ge(fd, 0);
                ck_assert_int_eq(ftruncate(fd, 100), 0);
                safe_close(fd);
                ck_assert_int_eq(feature_prefetch(c3, "s2", 0, &pr), -EBADMSG);
                ck_assert_ptr_null(feature_cache_get(c3, "s2"));
                ck_assert_uint_eq(feature_cache_stats(c3)->n_announced, 0);
                ck_assert_int_eq(feature_prefetch(c3, "s2", 0, &pr), 0);
                ck_assert_int_eq(pr, FEATURE_PREFETCH_ANNOUNCED);
                /* One that no mapped arena can ever hold (past the budget) does not
                 * fit either: no-space, never announced. */
                save(st, "s3", 17 * CHUNK, 0x13);
                ck_assert_int_eq(feature_prefetch(c3, "s3", 0, &pr), -E2BIG);
                ck_assert_ptr_null(feature_cache_get(c3, "s3"));
                ck_assert_uint_eq(feature_cache_stats(c3)->n_announced, 1);
                ck_assert_uint_eq(feature_cache_stats(c3)->evictions, 1);
                (void)feature_cache_expire(c3, USEC_INFINITY - 1);
                tmp_store_close(c3, st, dir);
        }
        /* an announce that nobody waits on just goes */
        ck_assert_int_eq(feature_prefetch(c, "lonely", 0, &pr), 0);
        feature_cache_expire(c, 1u << 30);
        ck_assert_ptr_null(feature_cache_get(c, "lonely"));
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
}
END_TEST

START_TEST(test_ref_limit) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(16 * CHUNK);
        FeatureRef *refs[64], *x;
        FeatureAcquireResult res;

        feature_ref_release(produce(c, "k", CHUNK, 1));
        for (int i = 0; i < 64; i++)
                ck_assert_int_eq(feature_acquire(c, "k", false, 0, &refs[i], &res), 0);
        ck_assert_int_eq(feature_acquire(c, "k", false, 0, &x, &res), -EUSERS);
        ck_assert_int_eq(feature_pin(c, "k", &x), -EUSERS);
        for (int i = 0; i < 64; i++)
                feature_ref_release(refs[i]);
        ck_assert_int_eq(feature_acquire(c, "k", false, 0, &x, &res), 0);
        feature_ref_release(x);
}
END_TEST

/* Many request cycles (produce, coalesced waits, hits, failures, prefetch timeouts):
 * the live objects and the heap stay flat. */
START_TEST(test_soak) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(32 * CHUNK);
        FeatureAcquireResult res;
        FeaturePrefetchResult pr;
        size_t heap_after_warmup = 0;
        char key[32];
        unsigned seed = 7;

        for (int round = 0; round < 20000; round++) {
                FeatureRef *p, *w[3];
                snprintf(key, sizeof key, "img:%d", rand_r(&seed) % 64);
                ck_assert_int_eq(feature_acquire(c, key, true, (usec_t)round, &p, &res), 0);
                for (int i = 0; i < 3; i++)
                        ck_assert_int_eq(feature_acquire(c, key, false, (usec_t)round, &w[i], &res), 0);
                if (p->kind == FEATURE_REF_PRODUCER) {
                        uint64_t n = (uint64_t)(rand_r(&seed) % (3 * CHUNK)) + 1;
                        FeatureDesc *d = desc_bytes(n);
                        ck_assert_int_eq(feature_ref_reserve(p, n, &d, NULL, NULL), 0);
                        if (round % 5 == 0)
                                ck_assert_int_eq(feature_fail(p, -EIO), 0);
                        else if (round % 7 != 0) /* every 7th: producer vanishes */
                                ck_assert_int_eq(feature_publish(p, 10), 0);
                }
                feature_ref_release(p);
                for (int i = 0; i < 3; i++) {
                        ck_assert_int_ne(w[i]->feature->state, FEATURE_RESERVED);
                        feature_ref_release(w[i]);
                }
                snprintf(key, sizeof key, "pre:%d", round % 50);
                ck_assert_int_eq(feature_prefetch(c, key, (usec_t)round, &pr), 0);
                feature_cache_expire(c, (usec_t)round);

                ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
                ck_assert_uint_le(feature_cache_stats(c)->n_features, 64 + 50);
                ck_assert_uint_le(feature_cache_stats(c)->bytes_cached, 32 * CHUNK);
                if (round == 2000)
                        heap_after_warmup = mallinfo2().uordblks;
        }
        /* (under ASan mallinfo2 reports nothing; ASan's leak check covers that build) */
        ck_assert_uint_le(mallinfo2().uordblks, heap_after_warmup + 64 * 1024);
        ck_assert_uint_gt(feature_cache_stats(c)->hits, 0);
        ck_assert_uint_gt(feature_cache_stats(c)->evictions, 0);
        ck_assert_uint_gt(feature_cache_stats(c)->failed, 0);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
}
END_TEST

/* -- journal and replay (docs/wal.md) -- */

typedef struct Journal {
        uint16_t type[64];
        uint8_t *payload[64];
        size_t len[64];
        size_t n;
} Journal;

static int journal_fn(FeatureCache *c, uint16_t rec, const void *payload, size_t len, void *userdata) {
        Journal *j = userdata;
        ck_assert_uint_lt(j->n, 64);
        j->type[j->n] = rec;
        j->payload[j->n] = malloc(len ? len : 1);
        memcpy(j->payload[j->n], payload, len);
        j->len[j->n++] = len;
        return 0;
}

static int snap_add(void *userdata, uint16_t type, const void *rec, size_t len) {
        return journal_fn(NULL, type & 0xff, rec, len, userdata);
}

/* A second cache over the same memory (the restarted daemon), arena 3 as cache_new()'s. */
static FeatureCache *cache_over(uint8_t *mem) {
        FeatureCacheConfig cfg = { .budget_bytes = ARENA_CHUNKS * CHUNK, .max_refs = 64 };
        FeatureCache *d;
        ck_assert_int_eq(feature_cache_new(&cfg, &d), 0);
        ck_assert_int_eq(feature_cache_add_arena(d, 3, mem, DATA_OFFSET, ARENA_CHUNKS * CHUNK, CHUNK), 0);
        return d;
}

START_TEST(test_journal_replay) {
        FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK), *d;
        Journal j = {}, snap = {};
        FeatureAcquireResult res;
        FeatureRef *r;

        feature_cache_set_journal(c, journal_fn, &j);
        feature_ref_release(produce(c, "img:a", 3 * CHUNK, 0xa1));
        feature_ref_release(produce(c, "img:b", CHUNK + 5, 0xb2));
        feature_ref_release(produce(c, "img:c", 2 * CHUNK, 0xc3));
        ck_assert_uint_eq(j.n, 3);
        ck_assert_uint_eq(j.type[0], FEATURE_REC_READY);
        /* Budget pressure evicts the coldest (img:a): journaled GONE. */
        feature_cache_set_budget(c, 4 * CHUNK);
        ck_assert_uint_eq(j.n, 4);
        ck_assert_uint_eq(j.type[3], FEATURE_REC_GONE);
        ck_assert_uint_eq(j.len[3], 5);
        ck_assert_int_eq(memcmp(j.payload[3], "img:a", 5), 0);
        ck_assert_int_eq(feature_cache_snapshot(c, snap_add, &snap, 0x500), 0);
        ck_assert_uint_eq(snap.n, 2);

        /* A second cache over the same memory (the restarted daemon) replays the log. */
        uint8_t *mem = arena_mem;
        arena_mem = NULL;
        d = cache_over(mem);
        for (size_t i = 0; i < j.n; i++)
                ck_assert_int_eq(feature_cache_apply_record(d, j.type[i], j.payload[i], j.len[i]), 0);
        ck_assert_uint_eq(feature_cache_stats(d)->n_features, 2);
        ck_assert_uint_eq(feature_cache_stats(d)->bytes_cached, feature_cache_stats(c)->bytes_cached);
        ck_assert_int_eq(feature_acquire(d, "img:a", false, 0, &r, &res), -ENOENT);
        ck_assert_int_eq(feature_acquire(d, "img:b", false, 0, &r, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        ck_assert_uint_eq(r->feature->bytes, CHUNK + 5);
        ck_assert_uint_eq(((uint8_t *)feature_data(r->feature))[CHUNK + 4], 0xb2);
        ck_assert_uint_eq(r->feature->desc->tensors[0].shape[0], CHUNK + 5);
        feature_ref_release(r);
        /* A replayed record twice (snapshot then log) replaces, never leaks a region. */
        for (size_t i = 0; i < snap.n; i++)
                ck_assert_int_eq(feature_cache_apply_record(d, snap.type[i], snap.payload[i], snap.len[i]), 0);
        ck_assert_uint_eq(feature_cache_stats(d)->n_features, 2);
        /* After the journal is set, replay is refused; an arena drop journals GONE. */
        Journal k = {};
        feature_cache_set_journal(d, journal_fn, &k);
        ck_assert_int_eq(feature_cache_apply_record(d, j.type[0], j.payload[0], j.len[0]), -EBUSY);
        ck_assert_uint_eq(feature_cache_drop_arena(d, 3), 2);
        ck_assert_uint_eq(k.n, 2);
        ck_assert_uint_eq(feature_cache_stats(d)->bytes_cached, 0);
        /* Malformed payloads. */
        ck_assert_int_eq(feature_cache_apply_record(c, FEATURE_REC_READY, "x", 1), -EBUSY);
        FeatureRecord fr;
        ck_assert_int_eq(feature_record_ready_parse(j.payload[0], j.len[0] - 1, &fr), -EBADMSG);
        ck_assert_int_eq(feature_record_ready_parse(j.payload[0], j.len[0], &fr), 0);

        for (size_t i = 0; i < j.n; i++)
                free(j.payload[i]);
        for (size_t i = 0; i < snap.n; i++)
                free(snap.payload[i]);
        for (size_t i = 0; i < k.n; i++)
                free(k.payload[i]);
        feature_cache_free(d);
        feature_cache_free(c);
        free(mem);
}
END_TEST

/* The fence after a restart whose workers of before still run (core/mappers.h): a
 * region free at the restart (here the one a producer of before had reserved, and was
 * maybe still writing) is not handed out, and a replayed feature (maybe still being read)
 * is not evicted, while hits on it are served; unfenced, both are as before. */
START_TEST(test_restart_fence) {
        FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK), *d;
        Journal j = {};
        FeatureAcquireResult res;
        FeatureRef *r, *held;

        feature_cache_set_journal(c, journal_fn, &j);
        feature_ref_release(produce(c, "img:a", 16 * CHUNK, 0xa1));
        /* A producer of before, at work when epdd died: its region is not journaled. */
        FeatureDesc *desc = desc_bytes(16 * CHUNK);
        ck_assert_int_eq(feature_reserve(c, "img:w", 16 * CHUNK, &desc, NULL, &held, NULL), 0);
        uint64_t held_off = held->feature->offset;
        ck_assert_uint_eq(j.n, 1);

        uint8_t *mem = arena_mem;
        arena_mem = NULL;
        d = cache_over(mem);
        ck_assert_int_eq(feature_cache_apply_record(d, j.type[0], j.payload[0], j.len[0]), 0);
        ck_assert(!feature_cache_fenced(d));
        /* An arena outside the mask is not fenced. */
        ck_assert_int_eq(feature_cache_fence(d, 1ULL << 2), 0);
        ck_assert(feature_cache_fenced(d));
        feature_cache_unfence(d);
        ck_assert_int_eq(feature_cache_fence(d, 1ULL << 3), (int64_t)(ARENA_CHUNKS - 16) * CHUNK);
        ck_assert_int_eq(feature_cache_fence(d, 1ULL << 3), (int64_t)(ARENA_CHUNKS - 16) * CHUNK);
        ck_assert_uint_eq(feature_cache_stats(d)->bytes_fenced, (ARENA_CHUNKS - 16) * CHUNK);

        /* No room: every free byte is fenced, and the replayed feature is not evicted. */
        desc = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_reserve(d, "img:new", CHUNK, &desc, NULL, &r, NULL), -ENOSPC);
        feature_desc_free(desc);
        ck_assert_uint_eq(feature_cache_flush(d), 0);
        ck_assert_uint_eq(feature_cache_stats(d)->evictions, 0);
        /* A hit is served, and releasing it keeps it off the LRU. */
        ck_assert_int_eq(feature_acquire(d, "img:a", false, 0, &r, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        ck_assert_uint_eq(((uint8_t *)feature_data(r->feature))[7], 0xa1);
        feature_ref_release(r);
        ck_assert_uint_eq(feature_cache_flush(d), 0);
        ck_assert_int_eq(feature_allocator_check(d->arenas[0].alloc), 0);

        /* Unfenced: the free bytes and the feature are the cache's again. */
        feature_cache_unfence(d);
        ck_assert(!feature_cache_fenced(d));
        ck_assert_uint_eq(feature_cache_stats(d)->bytes_fenced, 0);
        ck_assert_int_eq(feature_allocator_check(d->arenas[0].alloc), 0);
        ck_assert_uint_eq(feature_allocator_used(d->arenas[0].alloc), 16 * CHUNK);
        FeatureRef *w = produce(d, "img:new", (ARENA_CHUNKS - 16) * CHUNK, 0x5e);
        ck_assert_uint_le(w->feature->offset, held_off); /* the region of before, among others */
        feature_ref_release(w);
        ck_assert_uint_eq(feature_cache_flush(d), 2);

        for (size_t i = 0; i < j.n; i++)
                free(j.payload[i]);
        feature_ref_release(held);
        feature_cache_free(d);
        feature_cache_free(c);
        free(mem);
}
END_TEST

/* A READY the replay cannot take back (the arena cut into chunks of another size now:
 * its PageSize= changed) is journaled GONE once the journal is set: a later start that
 * cuts the arena as before does not bring it back over the bytes written there since
 * (here B's, at the same offset). Before, a hit on A gave B's bytes. */
START_TEST(test_replay_skipped_is_gone) {
        FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK), *d, *e;
        Journal j = {}, k = {};
        FeatureAcquireResult res;
        FeatureRef *r;

        feature_cache_set_journal(c, journal_fn, &j);
        feature_ref_release(produce(c, "img:a", CHUNK - 16, 0xaa)); /* READY A at offset 0 */
        ck_assert_uint_eq(j.n, 1);
        uint8_t *mem = arena_mem;
        arena_mem = NULL;
        feature_cache_free(c);

        /* Run 2: the same memory cut in chunks of 2 x CHUNK. */
        FeatureCacheConfig cfg = { .budget_bytes = ARENA_CHUNKS * CHUNK, .max_refs = 64 };
        ck_assert_int_eq(feature_cache_new(&cfg, &d), 0);
        ck_assert_int_eq(feature_cache_add_arena(d, 3, mem, DATA_OFFSET, ARENA_CHUNKS * CHUNK, 2 * CHUNK), 0);
        ck_assert_int_eq(feature_cache_apply_record(d, j.type[0], j.payload[0], j.len[0]), -ESTALE);
        feature_cache_set_journal(d, journal_fn, &k);
        ck_assert_uint_eq(k.n, 1); /* GONE A */
        ck_assert_uint_eq(k.type[0], FEATURE_REC_GONE);
        ck_assert_int_eq(memcmp(k.payload[0], "img:a", 5), 0);
        feature_ref_release(produce(d, "img:b", CHUNK - 16, 0xbb)); /* at offset 0 too */
        ck_assert_uint_eq(k.n, 2);
        feature_cache_free(d);

        /* Run 3: cut as in run 1 again, the whole log replayed. */
        ck_assert_int_eq(feature_cache_new(&cfg, &e), 0);
        ck_assert_int_eq(feature_cache_add_arena(e, 3, mem, DATA_OFFSET, ARENA_CHUNKS * CHUNK, CHUNK), 0);
        ck_assert_int_eq(feature_cache_apply_record(e, j.type[0], j.payload[0], j.len[0]), 0);
        ck_assert_int_eq(feature_cache_apply_record(e, k.type[0], k.payload[0], k.len[0]), 0); /* GONE A */
        ck_assert_int_eq(feature_cache_apply_record(e, k.type[1], k.payload[1], k.len[1]), -ESTALE); /* B: 2 x CHUNK */
        ck_assert_int_eq(feature_acquire(e, "img:a", false, 0, &r, &res), -ENOENT);
        ck_assert_int_eq(feature_acquire(e, "img:b", false, 0, &r, &res), -ENOENT);
        ck_assert_uint_eq(feature_cache_stats(e)->n_features, 0);

        for (size_t i = 0; i < j.n; i++)
                free(j.payload[i]);
        for (size_t i = 0; i < k.n; i++)
                free(k.payload[i]);
        feature_cache_free(e);
        free(mem);
}
END_TEST

/* The longest key every API takes (FEATURE_KEY_MAX bytes) replays too: its READY and
 * its GONE. (Replay refused it once, and a refused record ended the replay of the whole
 * log.) */
START_TEST(test_journal_longest_key) {
        FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK), *d;
        Journal j = {};
        FeatureAcquireResult res;
        FeatureRef *r;
        char key[FEATURE_KEY_MAX + 1];

        memset(key, 'k', FEATURE_KEY_MAX);
        key[FEATURE_KEY_MAX] = 0;
        ck_assert(feature_key_valid(key));
        feature_cache_set_journal(c, journal_fn, &j);
        feature_ref_release(produce(c, key, CHUNK, 0x5a));
        ck_assert_uint_eq(j.n, 1);
        uint8_t *mem = arena_mem;
        arena_mem = NULL;
        d = cache_over(mem);
        ck_assert_int_eq(feature_cache_apply_record(d, j.type[0], j.payload[0], j.len[0]), 0);
        ck_assert_int_eq(feature_acquire(d, key, false, 0, &r, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        ck_assert_uint_eq(((uint8_t *)feature_data(r->feature))[0], 0x5a);
        feature_ref_release(r);
        /* Evicted: its GONE replays as well. */
        feature_cache_set_budget(c, 0);
        ck_assert_uint_eq(j.n, 2);
        ck_assert_uint_eq(j.type[1], FEATURE_REC_GONE);
        ck_assert_int_eq(feature_cache_apply_record(d, j.type[1], j.payload[1], j.len[1]), 0);
        ck_assert_int_eq(feature_acquire(d, key, false, 0, &r, &res), -ENOENT);
        for (size_t i = 0; i < j.n; i++)
                free(j.payload[i]);
        feature_cache_free(d);
        feature_cache_free(c);
        free(mem);
}
END_TEST

/* A replay where every READY is skipped (the arena index names no feature arena now):
 * 262,144 of them (a long-running cache's churn), with keys of the longest size sharing
 * all but their last characters. Exactly one GONE is journaled per key still skipped at
 * the end: a key skipped twice (snapshot, then log) once, none for a key that a later
 * GONE or a later READY that applies took back. The skipped keys were kept in a list
 * scanned at every READY and GONE: this replay took minutes, past this test's timeout
 * (and a daemon's start with a full log past systemd's start timeout); it takes about
 * a second now, under ASan too. */
#define MANY_SKIPPED 262144u

static void many_key(char *key, unsigned i) {
        memset(key, 'p', FEATURE_KEY_MAX - 8);
        snprintf(key + FEATURE_KEY_MAX - 8, 9, "%08x", i);
}

/* A READY of key: template's (a well-formed record, t its parse) with arena. */
static size_t many_ready(uint8_t *buf, const uint8_t *template, const FeatureRecord *t, const char *key,
                         uint32_t arena) {
        size_t key_len = strlen(key);
        memcpy(buf, template, FEATURE_REC_HEADER_SIZE);
        unaligned_write_le(buf, arena, 4);
        unaligned_write_le(buf + 4, key_len, 4);
        memcpy(buf + FEATURE_REC_HEADER_SIZE, key, key_len);
        memcpy(buf + FEATURE_REC_HEADER_SIZE + key_len, t->desc, t->desc_len);
        return FEATURE_REC_HEADER_SIZE + key_len + t->desc_len;
}

/* What the journal got. The checks count what is wrong (asserted once at the end):
 * check's assertions each write to the log, 65,536 times over they were most of the
 * test's time. */
typedef struct GoneCount {
        uint8_t *seen; /* per key index: GONEs journaled */
        unsigned n_gone, n_other, n_bad;
} GoneCount;

static int journal_count(FeatureCache *c, uint16_t rec, const void *payload, size_t len, void *userdata) {
        GoneCount *g = userdata;
        char key[FEATURE_KEY_MAX + 1], want[FEATURE_KEY_MAX + 1];
        unsigned i;

        if (rec != FEATURE_REC_GONE) {
                g->n_other++;
                return 0;
        }
        g->n_gone++;
        if (len != FEATURE_KEY_MAX) {
                g->n_bad++;
                return 0;
        }
        memcpy(key, payload, len);
        key[len] = 0;
        if (sscanf(key + FEATURE_KEY_MAX - 8, "%8x", &i) != 1 || i >= MANY_SKIPPED) {
                g->n_bad++;
                return 0;
        }
        many_key(want, i);
        if (strcmp(key, want) != 0)
                g->n_bad++;
        else
                g->seen[i]++;
        return 0;
}

START_TEST(test_replay_many_skipped) {
        FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK), *d;
        Journal j = {};
        GoneCount g = {};
        FeatureAcquireResult res;
        FeatureRef *r;
        char key[FEATURE_KEY_MAX + 1];
        uint8_t *rec;
        size_t len;

        /* A well-formed READY of arena 3, its descriptor the template of the others. */
        feature_cache_set_journal(c, journal_fn, &j);
        feature_ref_release(produce(c, "img:t", CHUNK, 0x7e));
        ck_assert_uint_eq(j.n, 1);
        rec = malloc(FEATURE_REC_HEADER_SIZE + FEATURE_KEY_MAX + j.len[0]);
        ck_assert_ptr_nonnull(rec);
        uint8_t *mem = arena_mem;
        arena_mem = NULL;
        feature_cache_free(c);
        d = cache_over(mem);

        /* Every READY names arena 9, which is not there. */
        FeatureRecord t;
        ck_assert_int_eq(feature_record_ready_parse(j.payload[0], j.len[0], &t), 0);
        unsigned wrong = 0;
        for (unsigned i = 0; i < MANY_SKIPPED; i++) {
                many_key(key, i);
                len = many_ready(rec, j.payload[0], &t, key, 9);
                wrong += feature_cache_apply_record(d, FEATURE_REC_READY, rec, len) != -ENODEV;
        }
        /* The first quarter again (a snapshot, then the log): still one GONE each. */
        for (unsigned i = 0; i < MANY_SKIPPED / 4; i++) {
                many_key(key, i);
                len = many_ready(rec, j.payload[0], &t, key, 9);
                wrong += feature_cache_apply_record(d, FEATURE_REC_READY, rec, len) != -ENODEV;
        }
        /* An eighth GONE later in the log: nothing to journal for them. */
        unsigned taken_back = 0;
        for (unsigned i = 1; i < MANY_SKIPPED; i += 8, taken_back++) {
                many_key(key, i);
                wrong += feature_cache_apply_record(d, FEATURE_REC_GONE, key, strlen(key)) != -ENOENT;
        }
        ck_assert_uint_eq(wrong, 0);
        /* One READY later that applies (its region in arena 3, as journaled): kept. */
        many_key(key, 2);
        len = many_ready(rec, j.payload[0], &t, key, 3);
        ck_assert_int_eq(feature_cache_apply_record(d, FEATURE_REC_READY, rec, len), 0);
        taken_back++;
        ck_assert_uint_eq(feature_cache_stats(d)->n_features, 1);

        g.seen = calloc(MANY_SKIPPED, 1);
        ck_assert_ptr_nonnull(g.seen);
        feature_cache_set_journal(d, journal_count, &g);
        ck_assert_uint_eq(g.n_gone, MANY_SKIPPED - taken_back);
        ck_assert_uint_eq(g.n_other, 0);
        ck_assert_uint_eq(g.n_bad, 0);
        for (unsigned i = 0; i < MANY_SKIPPED; i++)
                wrong += g.seen[i] != (i == 2 || i % 8 == 1 ? 0 : 1);
        ck_assert_uint_eq(wrong, 0);
        /* Said once: none again after a second journal. */
        feature_cache_set_journal(d, journal_count, &g);
        ck_assert_uint_eq(g.n_gone, MANY_SKIPPED - taken_back);
        /* The one that applied is served. */
        ck_assert_int_eq(feature_acquire(d, key, false, 0, &r, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        ck_assert_uint_eq(((uint8_t *)feature_data(r->feature))[CHUNK - 1], 0x7e);
        feature_ref_release(r);

        free(g.seen);
        free(rec);
        for (size_t i = 0; i < j.n; i++)
                free(j.payload[i]);
        feature_cache_free(d);
        free(mem);
}
END_TEST

/* A loader that keeps the job, so that the test plays the load thread. */
static struct {
        Feature *f;
        int fd;
        void *dst;
        uint64_t size;
        uint32_t crc;
        unsigned n;
        int refuse; /* < 0: the loader refuses the job with it (the fd closed) */
} job = { .fd = -EBADF };

static int test_loader(FeatureCache *c, Feature *f, int fd, void *dst, uint64_t size, uint32_t crc, void *userdata) {
        if (job.refuse < 0) {
                safe_close(fd);
                return job.refuse;
        }
        job.f = f;
        job.fd = fd;
        job.dst = dst;
        job.size = size;
        job.crc = crc;
        job.n++;
        return 0;
}

/* The load thread's part, played: the queued job's data read (its bytes checked), its
 * fd closed, and the read's end handed to the loop. */
static void job_land(void) {
        FeatureStoreEntry e = { .fd = job.fd, .size = job.size, .crc = job.crc };
        ck_assert_int_eq(feature_store_entry_read(&e, job.dst), 0);
        job.fd = safe_close(job.fd);
        feature_load_done(job.f, 0);
}

START_TEST(test_async_load) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        char dir[sizeof TMP_STORE];
        FeatureStore *st = tmp_store_open(c, dir);
        FeaturePrefetchResult pr;
        FeatureAcquireResult res;
        FeatureRef *a, *b, *p;
        FeatureDesc *d;

        feature_cache_set_loader(c, test_loader, NULL);
        save(st, "k1", 3 * CHUNK, 0x5a);

        /* The first Acquire starts the load, the second joins it; nobody may produce
         * or announce it meanwhile. */
        ck_assert_int_eq(feature_acquire(c, "k1", true, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_uint_eq(job.n, 1);
        ck_assert_uint_eq(job.size, 3 * CHUNK);
        ck_assert(feature_loading(a->feature));
        ck_assert_int_eq(a->feature->state, FEATURE_RESERVED);
        ck_assert_int_eq(feature_acquire(c, "k1", true, 0, &b, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_uint_eq(job.n, 1);
        d = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_reserve(c, "k1", CHUNK, &d, NULL, &p, NULL), -EBUSY);
        feature_desc_free(d);
        ck_assert_int_eq(feature_prefetch(c, "k1", 0, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_PENDING);
        job_land(); /* the thread's part */
        ck_assert_int_eq(a->feature->state, FEATURE_READY);
        ck_assert(!feature_loading(a->feature));
        ck_assert_uint_eq(n_ready_events, 1);
        ck_assert_uint_eq(((uint8_t *)feature_data(a->feature))[3 * CHUNK - 1], 0x5a);
        ck_assert_uint_eq(feature_cache_stats(c)->loaded, 1);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
        feature_ref_release(a);
        feature_ref_release(b);

        /* A read that fails: the feature FAILS with the error, its waiters are told,
         * and the key is free for a producer. Its readers' Acquires were no hits (the
         * two of k1 were, once its bytes were back). */
        uint64_t hits = feature_cache_stats(c)->hits, saved = feature_cache_stats(c)->encoder_usec_saved;
        ck_assert_uint_eq(hits, 2);
        save(st, "k2", CHUNK, 1);
        ck_assert_int_eq(feature_acquire(c, "k2", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_int_eq(feature_acquire(c, "k2", false, 0, &b, &res), 0);
        job.fd = safe_close(job.fd);
        feature_load_done(job.f, -EBADMSG);
        ck_assert(!feature_lookup_failed(a->feature)); /* its data's read failed: an error */
        ck_assert_uint_eq(feature_cache_stats(c)->hits, hits);
        ck_assert_uint_eq(feature_cache_stats(c)->encoder_usec_saved, saved);
        ck_assert_int_eq(a->feature->state, FEATURE_FAILED);
        ck_assert_int_eq(last_error, -EBADMSG);
        ck_assert_ptr_null(feature_cache_get(c, "k2"));
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
        feature_ref_release(a);
        feature_ref_release(b);

        /* The state callback may drop the last reference (bus-feature answers the
         * Acquire and forgets its handle): the feature outlives the callback, failed... */
        save(st, "k2", CHUNK, 1);
        ck_assert_int_eq(feature_acquire(c, "k2", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        job.fd = safe_close(job.fd);
        release_in_callback = a;
        feature_load_done(job.f, -EIO);
        ck_assert_ptr_null(release_in_callback);
        ck_assert_int_eq(last_error, -EIO);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
        /* ... or READY: then it stays cached */
        save(st, "k4", CHUNK, 4);
        ck_assert_int_eq(feature_acquire(c, "k4", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        release_in_callback = a;
        job_land();
        ck_assert_ptr_null(release_in_callback);
        ck_assert_ptr_nonnull(feature_cache_get(c, "k4"));
        ck_assert_int_eq(feature_cache_get(c, "k4")->state, FEATURE_READY);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);

        /* A stored copy whose header does not match its size is found on the loop:
         * said to a reader (-EBADMSG, and removed), a miss to a producer. */
        save(st, "k3", CHUNK, 2);
        char name[FEATURE_STORE_NAME_MAX];
        ck_assert_int_eq(feature_store_name("k3", name), 0);
        int fd = feature_store_openat(st, name, O_WRONLY, 0);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(ftruncate(fd, 100), 0);
        safe_close(fd);
        ck_assert_int_eq(feature_acquire(c, "k3", false, 0, &a, &res), -EBADMSG);
        ck_assert_int_eq(feature_acquire(c, "k3", false, 0, &a, &res), -ENOENT);
        ck_assert_int_eq(feature_acquire(c, "k3", true, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        feature_ref_release(a);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);

        tmp_store_close(c, st, dir);
}
END_TEST

/* A prober that keeps the lookup, so that the test plays the load thread. */
static struct {
        Feature *f;
        unsigned n;
} probe;

static int test_prober(FeatureCache *c, Feature *f, void *userdata) {
        probe.f = f;
        probe.n++;
        return 0;
}

/* With a prober, the loop makes no lookup: an Acquire of a stored key is LOADING at
 * once, its region reserved from the store's index; the lookup's result hands the read
 * to the loader; a key the store's index does not have is a miss without a probe, and
 * so is one the arenas have no room for; a lookup that finds the copy gone, or larger
 * than the index said, FAILS the feature (its waiters told) and leaves the key free. */
/* EncoderTimeSavedUSec saturates instead of wrapping: Publish's encode_usec comes from
 * the producer (the bus glue bounds it) and a stored copy's from its file. Before,
 * Publish(UINT64_MAX) then three hits read 18446744073709551613. */
START_TEST(test_encoder_time_saturates) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        FeatureAcquireResult res;
        FeatureRef *p, *r[3];
        FeatureDesc *d = desc_bytes(100);

        ck_assert_int_eq(feature_reserve(c, "huge", 100, &d, NULL, &p, NULL), 0);
        ck_assert_int_eq(feature_publish(p, UINT64_MAX), 0);
        for (int i = 0; i < 3; i++) {
                ck_assert_int_eq(feature_acquire(c, "huge", false, 0, &r[i], &res), 0);
                ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        }
        ck_assert_uint_eq(feature_cache_stats(c)->hits, 3);
        ck_assert_uint_eq(feature_cache_stats(c)->encoder_usec_saved, UINT64_MAX);
        for (int i = 0; i < 3; i++)
                feature_ref_release(r[i]);
        feature_ref_release(p);

        /* Read back from the store, a copy whose header says more than half of it: once
         * synchronously (the counter near its top already), then off the loop with two
         * Acquires waiting for the read (from 0). */
        _cleanup_(feature_desc_freep) FeatureDesc *sd = desc_bytes(CHUNK);
        _cleanup_(freep) uint8_t *data = calloc(1, CHUNK);
        char dir[sizeof TMP_STORE];
        FeatureStore *st = tmp_store_open(c, dir);
        for (int i = 0; i < 2; i++)
                ck_assert_int_eq(feature_store_save(st,
                                                    &(FeatureStoreRecord){ .key = i ? "async" : "sync", .size = CHUNK,
                                                                           .desc = sd,
                                                                           .encode_usec = UINT64_MAX / 2 + 1 },
                                                    data), 0);
        c->stats.encoder_usec_saved = UINT64_MAX - 1;
        ck_assert_int_eq(feature_acquire(c, "sync", false, 0, &r[0], &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_HIT);
        ck_assert_uint_eq(feature_cache_stats(c)->encoder_usec_saved, UINT64_MAX);
        feature_ref_release(r[0]);
        c->stats.encoder_usec_saved = 0;
        feature_cache_set_loader(c, test_loader, NULL);
        job.refuse = 0;
        ck_assert_int_eq(feature_acquire(c, "async", false, 0, &r[0], &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_int_eq(feature_acquire(c, "async", false, 0, &r[1], &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        job_land();
        ck_assert_int_eq(r[0]->feature->state, FEATURE_READY);
        ck_assert_uint_eq(feature_cache_stats(c)->hits, 6);
        ck_assert_uint_eq(feature_cache_stats(c)->encoder_usec_saved, UINT64_MAX);
        feature_ref_release(r[0]);
        feature_ref_release(r[1]);
        tmp_store_close(c, st, dir);
}
END_TEST

START_TEST(test_async_probe) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        char dir[sizeof TMP_STORE];
        FeatureStore *st = tmp_store_open(c, dir);
        FeatureAcquireResult res;
        FeatureRef *a, *b, *p;
        FeatureDesc *d;
        FeatureStoreEntry e = { .fd = -EBADF };

        feature_cache_set_loader(c, test_loader, NULL);
        feature_cache_set_prober(c, test_prober, NULL);
        save(st, "k1", 3 * CHUNK, 0x5a);
        job.n = probe.n = 0;

        ck_assert_int_eq(feature_acquire(c, "k1", true, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_uint_eq(probe.n, 1);
        ck_assert_uint_eq(job.n, 0);
        ck_assert(feature_loading(a->feature));
        ck_assert_int_eq(a->feature->state, FEATURE_RESERVED);
        ck_assert(a->feature->has_region); /* of the size the store's index has */
        ck_assert_uint_ge(a->feature->size, 3 * CHUNK);
        ck_assert_int_eq(feature_acquire(c, "k1", false, 0, &b, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_uint_eq(probe.n, 1);
        d = desc_bytes(CHUNK);
        ck_assert_int_eq(feature_reserve(c, "k1", CHUNK, &d, NULL, &p, NULL), -EBUSY);
        feature_desc_free(d);
        /* the thread's lookup, then the loop's part: a region, and the read queued */
        ck_assert_int_eq(feature_store_lookup(st, "k1", &e), 0);
        feature_probe_done(probe.f, 0, &e);
        ck_assert_int_lt(e.fd, 0); /* taken over */
        ck_assert_uint_eq(job.n, 1);
        ck_assert_uint_eq(job.size, 3 * CHUNK);
        ck_assert(a->feature->has_region);
        ck_assert(feature_loading(a->feature));
        job_land();
        ck_assert_int_eq(a->feature->state, FEATURE_READY);
        ck_assert_uint_eq(((uint8_t *)feature_data(a->feature))[3 * CHUNK - 1], 0x5a);
        ck_assert_uint_eq(feature_cache_stats(c)->hits, 2);
        feature_ref_release(a);
        feature_ref_release(b);

        /* not in the store's index: a miss at once, nothing probed */
        ck_assert_int_eq(feature_acquire(c, "absent", false, 0, &a, &res), -ENOENT);
        ck_assert_int_eq(feature_acquire(c, "absent", true, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        ck_assert_uint_eq(probe.n, 1);
        feature_ref_release(a);

        /* the copy is gone when the thread looks */
        uint64_t features = feature_cache_stats(c)->n_features;
        uint64_t failed = feature_cache_stats(c)->failed; /* a producer that left */
        save(st, "k2", CHUNK, 2);
        ck_assert_int_eq(feature_acquire(c, "k2", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_int_eq(feature_store_remove(st, "k2"), 0);
        e = (FeatureStoreEntry){ .fd = -EBADF };
        feature_probe_done(probe.f, feature_store_lookup(st, "k2", &e), &e);
        ck_assert_int_eq(a->feature->state, FEATURE_FAILED);
        ck_assert(feature_lookup_failed(a->feature)); /* asked again, it is a miss */
        ck_assert_int_eq(last_error, -ENOENT);
        ck_assert_ptr_null(feature_cache_get(c, "k2"));
        feature_ref_release(a);
        ck_assert_uint_eq(feature_cache_stats(c)->n_features, features);

        /* a lookup that fails for any other reason (here out of file descriptors):
         * the key leaves the store's index all the same, its file left, so that asking
         * again is a miss and not this lookup once more */
        save(st, "k5", CHUNK, 5);
        ck_assert_int_eq(feature_acquire(c, "k5", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        e = (FeatureStoreEntry){ .fd = -EBADF };
        feature_probe_done(probe.f, -EMFILE, &e);
        ck_assert(feature_lookup_failed(a->feature));
        feature_ref_release(a);
        ck_assert(!feature_store_has(st, "k5", NULL));
        ck_assert_int_eq(feature_acquire(c, "k5", false, 0, &a, &res), -ENOENT);
        ck_assert_uint_eq(probe.n, 3);

        /* a copy larger than every arena: no room is said at once, as for any miss
         * (nothing probed): a miss, the producer told to produce */
        save(st, "huge", (ARENA_CHUNKS + 1) * CHUNK, 3);
        ck_assert_int_eq(feature_acquire(c, "huge", false, 0, &a, &res), -ENOENT);
        ck_assert_int_eq(feature_acquire(c, "huge", true, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_PRODUCE);
        ck_assert_uint_eq(probe.n, 3);
        feature_ref_release(a);

        /* a stored copy larger than the index said (its region): FAILS, not read; the
         * index has the size the lookup read, so asking again reads it back */
        save(st, "k3", CHUNK, 3);
        ck_assert_int_eq(feature_acquire(c, "k3", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_int_eq(feature_store_lookup(st, "k3", &e), 0);
        e.size = a->feature->size + 1;
        feature_probe_done(probe.f, 0, &e);
        ck_assert_int_lt(e.fd, 0);
        ck_assert_int_eq(a->feature->state, FEATURE_FAILED);
        ck_assert(feature_lookup_failed(a->feature));
        ck_assert_int_eq(last_error, -EBADMSG);
        uint64_t bytes;
        ck_assert(feature_store_has(st, "k3", &bytes));
        ck_assert_uint_eq(bytes, CHUNK);
        ck_assert_ptr_null(feature_cache_get(c, "k3"));
        feature_ref_release(a);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, 0);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
        ck_assert_uint_eq(job.n, 1);
        /* none of these lookups is a failure of the cache's (huge's producer left) */
        ck_assert_uint_eq(feature_cache_stats(c)->failed, failed + 1);

        /* a Prefetch that starts a read back is a hit when the bytes land: not when the
         * lookup then finds the copy gone, nor while the read is on its way */
        FeaturePrefetchResult pr;
        uint64_t ph = feature_cache_stats(c)->prefetch_hits;
        save(st, "p1", CHUNK, 7);
        ck_assert_int_eq(feature_prefetch(c, "p1", 0, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_LOADED);
        ck_assert_int_eq(feature_store_remove(st, "p1"), 0);
        e = (FeatureStoreEntry){ .fd = -EBADF };
        feature_probe_done(probe.f, feature_store_lookup(st, "p1", &e), &e);
        ck_assert_ptr_null(feature_cache_get(c, "p1"));
        ck_assert_uint_eq(feature_cache_stats(c)->prefetch_hits, ph);
        save(st, "p2", CHUNK, 8);
        ck_assert_int_eq(feature_prefetch(c, "p2", 0, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_LOADED);
        ck_assert_int_eq(feature_store_lookup(st, "p2", &e), 0);
        feature_probe_done(probe.f, 0, &e);
        ck_assert_uint_eq(feature_cache_stats(c)->prefetch_hits, ph);
        job_land();
        ck_assert_int_eq(feature_cache_get(c, "p2")->state, FEATURE_READY);
        ck_assert_uint_eq(feature_cache_stats(c)->prefetch_hits, ph + 1);
        ck_assert_int_eq(feature_prefetch(c, "p2", 0, &pr), 0);
        ck_assert_int_eq(pr, FEATURE_PREFETCH_PRESENT);
        ck_assert_uint_eq(feature_cache_stats(c)->prefetch_hits, ph + 2);

        feature_cache_free(TAKE_PTR(c)); /* before the store it uses */
        tmp_store_close(NULL, st, dir);
}
END_TEST

/* What a lookup finds out is acted on as far as it still holds: a save of the key that
 * lands between the lookup (on the load thread) and its result (on the loop) keeps its
 * index entry, and asking again reads that copy back; a region reserved from a scan's
 * bound on the size gives back the chunks the data does not need; a read that cannot
 * be queued is a miss, the copy kept on disk. */
START_TEST(test_probe_races) {
        _cleanup_(feature_cache_freep) FeatureCache *c = cache_new(ARENA_CHUNKS * CHUNK);
        char dir[sizeof TMP_STORE];
        FeatureStore *st = tmp_store_open(c, dir), *scanned;
        FeatureStoreEntry e = { .fd = -EBADF };
        FeatureAcquireResult res;
        FeatureRef *a;
        uint64_t bytes;

        feature_cache_set_loader(c, test_loader, NULL);
        feature_cache_set_prober(c, test_prober, NULL);
        job.n = probe.n = 0;

        /* gone when the thread looked; saved again before its result is handled */
        save(st, "k", CHUNK, 1);
        ck_assert_int_eq(feature_acquire(c, "k", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_int_eq(feature_store_remove(st, "k"), 0);
        int r = feature_store_lookup(st, "k", &e);
        ck_assert_int_eq(r, -ENOENT);
        save(st, "k", CHUNK, 2);
        feature_probe_done(probe.f, r, &e);
        ck_assert(feature_lookup_failed(a->feature));
        feature_ref_release(a);
        ck_assert(feature_store_has(st, "k", NULL)); /* the save's entry kept */
        ck_assert_int_eq(feature_acquire(c, "k", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING); /* read back, not a miss */
        ck_assert_int_eq(feature_store_lookup(st, "k", &e), 0);
        feature_probe_done(probe.f, 0, &e);
        ck_assert_uint_eq(job.n, 1);
        job_land();
        ck_assert_int_eq(a->feature->state, FEATURE_READY);
        ck_assert_uint_eq(((uint8_t *)feature_data(a->feature))[0], 2);
        feature_ref_release(a);

        /* a store opened afresh knows its files by their size less the header: a bound.
         * Two chunks of data take three by that bound; two once the header is read. */
        save(st, "two", 2 * CHUNK, 7);
        ck_assert_int_eq(feature_store_open(dir, 0, &scanned), 0);
        feature_cache_set_store(c, scanned);
        ck_assert(feature_store_has(scanned, "two", &bytes));
        ck_assert_uint_gt(bytes, 2 * CHUNK);
        uint64_t reserved = feature_cache_stats(c)->bytes_reserved;
        ck_assert_int_eq(feature_acquire(c, "two", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_uint_eq(a->feature->size, 3 * CHUNK);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, reserved + 3 * CHUNK);
        ck_assert_int_eq(feature_store_lookup(scanned, "two", &e), 0);
        feature_probe_done(probe.f, 0, &e);
        ck_assert_uint_eq(a->feature->size, 2 * CHUNK);
        ck_assert_uint_eq(feature_cache_stats(c)->bytes_reserved, reserved + 2 * CHUNK);
        ck_assert(feature_store_has(scanned, "two", &bytes));
        ck_assert_uint_eq(bytes, 2 * CHUNK); /* exact from now on */
        job_land();
        ck_assert_int_eq(a->feature->state, FEATURE_READY);
        ck_assert_uint_eq(((uint8_t *)feature_data(a->feature))[2 * CHUNK - 1], 7);
        ck_assert_int_eq(feature_allocator_check(feature_arena_of(c, a->feature->arena)->alloc), 0);
        feature_ref_release(a);
        feature_cache_set_store(c, st);
        feature_store_free(scanned);

        /* the loader refuses the read (out of memory): a miss, its copy kept on disk */
        save(st, "q", CHUNK, 9);
        job.refuse = -ENOMEM;
        ck_assert_int_eq(feature_acquire(c, "q", false, 0, &a, &res), 0);
        ck_assert_int_eq(res, FEATURE_ACQUIRE_LOADING);
        ck_assert_int_eq(feature_store_lookup(st, "q", &e), 0);
        feature_probe_done(probe.f, 0, &e);
        job.refuse = 0;
        ck_assert_int_eq(a->feature->state, FEATURE_FAILED);
        ck_assert(feature_lookup_failed(a->feature));
        feature_ref_release(a);
        ck_assert(!feature_store_has(st, "q", NULL));
        ck_assert_int_eq(feature_acquire(c, "q", false, 0, &a, &res), -ENOENT);
        uint64_t files;
        ck_assert_int_eq(feature_store_usage(st, &files, NULL), 0);
        ck_assert_uint_eq(files, 3); /* k, two, q */

        ck_assert_uint_eq(feature_cache_stats(c)->failed, 0);
        ck_assert_uint_eq(feature_cache_stats(c)->n_refs, 0);
        feature_cache_free(TAKE_PTR(c));
        tmp_store_close(NULL, st, dir);
}
END_TEST

int main(void) {
        Suite *s = suite_create("feature");
        TCase *tc = tcase_create("feature");
        tcase_add_test(tc, test_coalesce_and_publish);
        tcase_add_test(tc, test_fail_wakes_waiters);
        tcase_add_test(tc, test_produce_timeout);
        tcase_add_test(tc, test_produce_timeout_region_goes_with_producer);
        tcase_add_test(tc, test_reserve_errors);
        tcase_add_test(tc, test_publish_refused_without_its_record);
        tcase_add_test(tc, test_lru_budget);
        tcase_add_test(tc, test_evict_counts_chunk_rounding);
        tcase_add_test(tc, test_evict_where_it_helps);
        tcase_add_test(tc, test_evict_beside_large_arena);
        tcase_add_test(tc, test_stored_copy_without_room);
        tcase_add_test(tc, test_evict_in_allowed_arenas);
        tcase_add_test(tc, test_pins);
        tcase_add_test(tc, test_prefetch);
        tcase_add_test(tc, test_ref_limit);
        tcase_add_test(tc, test_soak);
        tcase_add_test(tc, test_journal_replay);
        tcase_add_test(tc, test_replay_skipped_is_gone);
        tcase_add_test(tc, test_restart_fence);
        tcase_add_test(tc, test_refused_claim_of_announced);
        tcase_add_test(tc, test_refused_claim_counts_nothing);
        tcase_add_test(tc, test_journal_longest_key);
        tcase_add_test(tc, test_async_load);
        tcase_add_test(tc, test_encoder_time_saturates);
        tcase_add_test(tc, test_async_probe);
        tcase_add_test(tc, test_probe_races);
        suite_add_tcase(s, tc);
        /* Apart, to be run alone (CK_RUN_CASE=replay-many). */
        TCase *many = tcase_create("replay-many");
        tcase_add_test(many, test_replay_many_skipped);
        suite_add_tcase(s, many);
        int r = check_run(s, CK_FORK_GETENV);
        free(arena_mem);
        return r;
}
