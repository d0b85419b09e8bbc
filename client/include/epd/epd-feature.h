/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* libepd: the feature cache (org.epd1.Feature; docs/features.md).
 *
 * An Encoder reserves a region for a content key, writes the tensors into the mapped
 * feature arena, and publishes it. A Prefill acquires the key: a hit gives the bytes
 * at once (no vision encoder run); otherwise it waits (epd_feature_wait, no polling)
 * while someone else produces it, or it is told to produce it itself. Every
 * epd_feature is a handle in the daemon; epd_feature_release() gives it back and
 * frees the struct. Handles of a client that disconnects or dies are released by the
 * daemon; a producer that goes before publishing fails the waiters ("producer-gone"). */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "epd/epd.h"

#ifdef __cplusplus
extern "C" {
#endif

#define EPD_FEATURE_RANK_MAX 8
#define EPD_FEATURE_TENSORS_MAX 64
#define EPD_FEATURE_KEY_MAX 256

typedef struct epd_feature_tensor {
        const char *name;     /* [A-Za-z0-9_.:-], 1..64 bytes, unique in the bundle */
        const char *dtype;    /* "bf16", "f16", "f32", "i64", ... or torch names ("bfloat16") */
        uint32_t rank;        /* 0..8 */
        uint64_t shape[EPD_FEATURE_RANK_MAX];
        uint64_t strides[EPD_FEATURE_RANK_MAX]; /* in elements; all zero: contiguous row-major */
        uint64_t offset;      /* bytes from the start of the feature */
} epd_feature_tensor;

typedef struct epd_feature {
        char key[EPD_FEATURE_KEY_MAX + 1];
        char handle[33];
        char result[16];      /* from acquire: "hit", "wait" or "produce"; else "" */
        char state[16];       /* "reserved", "ready", "failed" or "evicted" */
        char error[32];       /* failed: "producer-gone", "timeout", "producer-failed", ... */
        /* arena and data belong to the registration the handle was had under: after
         * epd_unregister() (or a new registration) the mapping is gone and the index may
         * name another arena; epd_feature_refresh() reads both again. */
        int arena;            /* index for epd_arena_get(); -1 while there is no region */
        uint64_t offset;      /* of the bytes in the arena fd */
        uint64_t bytes;
        void *data;           /* their mapping (host arenas, mapped on demand), or NULL */
        char request_id[33];  /* of the request that produced it ("" if none) */
        size_t n_tensors;
        epd_feature_tensor tensors[EPD_FEATURE_TENSORS_MAX]; /* strings point into _names */
        char _names[EPD_FEATURE_TENSORS_MAX][2][72];
} epd_feature;

/* Acquires key. *ret->result says what to do: "hit" (read ret->data), "wait" (call
 * epd_feature_wait), or "produce" (only with may_produce: call epd_feature_produce,
 * write, epd_feature_publish). Without may_produce a missing key is -ENOENT. */
int epd_feature_acquire(epd_client *c, const char *key, bool may_produce, epd_feature **ret);

/* Encoder: reserves `bytes` for key, described by the tensors. -EEXIST if it is ready,
 * -EBUSY if another client produces it, -EINVAL for a bad descriptor (the error
 * message names the problem), -ENOSPC if the cache cannot make room. */
int epd_feature_reserve(epd_client *c, const char *key, uint64_t bytes,
                        const epd_feature_tensor *tensors, size_t n_tensors,
                        const char *request_id, epd_feature **ret);
/* Acquire with may_produce and, when the result is "produce", the reservation of
 * epd_feature_reserve() in the same call (one round trip for a producer that knows its
 * output's layout before it runs): *ret->result is "hit", "wait" or "produce" (then
 * reserved: write ret->data, publish). A refused reservation is the call's error, as
 * epd_feature_reserve()'s, and leaves no feature behind. */
int epd_feature_acquire_or_reserve(epd_client *c, const char *key, uint64_t bytes,
                                   const epd_feature_tensor *tensors, size_t n_tensors, const char *request_id,
                                   epd_feature **ret);
/* epd_feature_acquire_or_reserve() in two steps, so that the caller works while the
 * call is on its way (an encoder uploads its inputs, say): _send() sends it and returns
 * at once; epd_feature_call_finish() waits for the answer (timeout_usec, UINT64_MAX: no
 * limit) and returns it as epd_feature_acquire_or_reserve() does, in *ret. Replies and
 * signals that arrive meanwhile are dispatched by finish (as epd_process() does). The
 * call has no time limit of its own: it waits for finish's, and an answer however late
 * still finds it. -ETIMEDOUT (no answer in time), -EINTR (a signal came) and -EBUSY
 * (called from within a callback of the same client) leave the answer to come: finish
 * again if you like. Once finish has taken the answer (a feature, a named refusal, or
 * -ENOTCONN: the connection went), a later finish is -EALREADY.
 * The caller frees every call with epd_feature_call_free(), finished or not: a handle
 * in an answer that finish did not take is released (at once, or when the answer comes:
 * a Release that asks for no reply). After epd_disconnect() free with a NULL client (the
 * daemon released what the connection held). A call freed from a callback that its own
 * finish dispatched ends that finish with -ECANCELED. epd_flush() waits for the answers
 * of calls not yet answered, freed ones too (their handles are released as they come).
 * One thread per client, as for every call. */
typedef struct epd_feature_call epd_feature_call;
int epd_feature_acquire_or_reserve_send(epd_client *c, const char *key, uint64_t bytes,
                                        const epd_feature_tensor *tensors, size_t n_tensors,
                                        const char *request_id, epd_feature_call **ret);
int epd_feature_call_finish(epd_client *c, epd_feature_call *call, uint64_t timeout_usec, epd_feature **ret);
/* Whether finish has taken the call's answer: its return was the answer's (a refusal
 * whose errno happens to be ETIMEDOUT, EINTR or EBUSY included), not a wait cut short. */
bool epd_feature_call_taken(const epd_feature_call *call);
void epd_feature_call_free(epd_client *c, epd_feature_call *call);
/* The same for a feature acquired with result "produce": updates f. -ESTALE
 * (org.epd1.Error.Stale) when its production timed out ([Features] ProduceTimeout=) or
 * failed meanwhile: f keeps its handle (release it, and acquire the key again). */
int epd_feature_produce(epd_client *c, epd_feature *f, uint64_t bytes,
                        const epd_feature_tensor *tensors, size_t n_tensors,
                        const char *request_id);
int epd_feature_publish(epd_client *c, epd_feature *f, uint64_t encode_usec);
/* Publishes f and releases its handle without waiting: both calls are sent at once, in
 * this order, and f is freed. The Publish's reply waits in epdd for the journal's sync
 * (docs/wal.md), which the producer need not: the feature is READY for readers as soon
 * as epdd has read the call (a reader that comes first is told to wait, and woken). A
 * refusal (Error.Stale: not the producer of a reserved feature) comes back from
 * epd_flush(). Returns 0 once both are sent; on a failure to send, the handle is
 * released as epd_feature_release() does. f is freed whatever the result: -EINVAL for
 * a NULL client (after epd_disconnect()) frees it too. */
int epd_feature_publish_release(epd_client *c, epd_feature *f, uint64_t encode_usec);
int epd_feature_fail(epd_client *c, epd_feature *f, const char *reason);

/* Blocks until f is no longer "reserved", or timeout_usec (UINT64_MAX: forever).
 * Returns 0 when ready, -ETIMEDOUT, or -EPIPE when it failed (f->error says why;
 * named "errno.32", the message saying the same).
 * One Wait call, which the daemon answers when the feature is published or fails
 * (0: only looks); never polls the daemon (an older daemon: woken by FeatureReady). */
int epd_feature_wait(epd_client *c, epd_feature *f, uint64_t timeout_usec);
/* Reads f's state again from the daemon. */
int epd_feature_refresh(epd_client *c, epd_feature *f);

/* Pins key (READY or being produced): never evicted until released. */
int epd_feature_pin(epd_client *c, const char *key, epd_feature **ret);

/* Releases the handle and frees f (also when the daemon is gone). NULL is fine. After
 * epd_disconnect(), the daemon has released every handle already: free the structs
 * with epd_feature_release(NULL, f). */
int epd_feature_release(epd_client *c, epd_feature *f);

/* Announces keys that will be needed soon. Returns how many are already cached (in
 * memory or in the store); the rest are announced to encoders (FeatureWanted). */
int epd_feature_prefetch(epd_client *c, const char *const *keys, size_t n);

#ifdef __cplusplus
}
#endif
