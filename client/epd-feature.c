/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd: org.epd1.Feature. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "proto/feature-desc.h"
#include "epd-internal.h"
#include "epd/epd-feature.h"
#include "macro.h"
#include "time-util.h"

#define FEATURE_PATH "/org/epd1/feature"
#define FEATURE_IFACE "org.epd1.Feature"

static void copy_str(char *dst, size_t n, const char *src) {
        snprintf(dst, n, "%s", src ? src : "");
}

/* Reads (handle, state, error, arena, offset, bytes, descriptor, request_id). */
static int read_info(epd_client *c, sd_bus_message *reply, epd_feature *f) {
        const char *handle, *state, *error, *arena, *req;
        _cleanup_(feature_desc_freep) FeatureDesc *d = NULL;
        const void *bin;
        size_t bin_len;
        int r;

        /* The handle first and alone: a failure past it gives the handle back
         * (drop_unusable()). */
        r = sd_bus_message_read(reply, "s", &handle);
        if (r < 0)
                return epd__error(c, r, NULL);
        copy_str(f->handle, sizeof f->handle, handle);
        r = sd_bus_message_read(reply, "ssstt", &state, &error, &arena, &f->offset, &f->bytes);
        if (r < 0)
                return epd__error(c, r, NULL);
        r = sd_bus_message_read_array(reply, 'y', &bin, &bin_len);
        if (r >= 0)
                r = sd_bus_message_read(reply, "s", &req);
        if (r < 0)
                return epd__error(c, r, NULL);
        copy_str(f->state, sizeof f->state, state);
        copy_str(f->error, sizeof f->error, error);
        copy_str(f->request_id, sizeof f->request_id, req);
        f->arena = arena[0] ? epd_arena_find(c, arena) : -1;
        if (f->arena == -ENOENT)
                f->arena = -1;
        f->data = NULL;
        if (f->arena >= 0) {
                const epd_arena *a = epd_arena_get(c, (size_t)f->arena);
                void *base;
                /* Within the arena's pages, or not mapped at all: the bytes are written
                 * and read through this pointer. */
                if (a && (f->offset < a->data_offset || f->offset > a->size || f->bytes > a->size - f->offset))
                        return epd__error(c, -EBADMSG, &SD_BUS_ERROR_MAKE_CONST(
                                                  "org.epd1.Error.Failed",
                                                  "The daemon placed the feature outside its arena."));
                /* Host arenas only (a GPU feature arena's bytes are reached through
                 * epd_gpu_arena_map()): the call succeeds either way, and must not leave
                 * a refusal of this optional mapping as its last error. */
                if (a && strcmp(a->domain, "host") == 0) {
                        if (epd_arena_map(c, (size_t)f->arena, &base) >= 0)
                                f->data = (uint8_t *)base + f->offset;
                        else
                                epd__clear_error(c);
                }
        }
        f->n_tensors = 0;
        if (bin_len > 0 && feature_desc_parse(bin, bin_len, f->bytes, &d, NULL) >= 0) {
                for (size_t i = 0; i < d->n_tensors; i++) {
                        const FeatureTensor *t = &d->tensors[i];
                        epd_feature_tensor *o = &f->tensors[i];
                        copy_str(f->_names[i][0], sizeof f->_names[i][0], t->name);
                        copy_str(f->_names[i][1], sizeof f->_names[i][1], feature_dtype_to_string(t->dtype));
                        o->name = f->_names[i][0];
                        o->dtype = f->_names[i][1];
                        o->rank = t->rank;
                        memcpy(o->shape, t->shape, sizeof o->shape);
                        memcpy(o->strides, t->strides, sizeof o->strides);
                        o->offset = t->offset;
                }
                f->n_tensors = d->n_tensors;
        }
        return 0;
}

static int build_desc(epd_client *c, const epd_feature_tensor *tensors, size_t n, void **ret,
                      size_t *ret_size) {
        _cleanup_(feature_desc_freep) FeatureDesc *d = NULL;
        int r;

        if (!tensors || n == 0 || n > EPD_FEATURE_TENSORS_MAX)
                return epd__error(c, -EINVAL, NULL);
        r = feature_desc_new(n, &d);
        if (r < 0)
                return epd__error(c, r, NULL);
        for (size_t i = 0; i < n; i++) {
                const epd_feature_tensor *t = &tensors[i];
                FeatureTensor *o = &d->tensors[i];
                int dt = feature_dtype_from_string(t->dtype);
                bool contiguous = true;

                if (!t->name || strlen(t->name) > FEATURE_TENSOR_NAME_MAX || dt < 0 ||
                    t->rank > FEATURE_RANK_MAX) {
                        snprintf(c->error_name, sizeof c->error_name, "org.epd1.Error.InvalidArgument");
                        snprintf(c->error_message, sizeof c->error_message,
                                 "Tensor %zu: bad name, dtype or rank.", i);
                        return -EINVAL; /* the name and message just set */
                }
                strcpy(o->name, t->name);
                o->dtype = (uint32_t)dt;
                o->rank = t->rank;
                o->offset = t->offset;
                for (uint32_t j = 0; j < t->rank; j++) {
                        o->shape[j] = t->shape[j];
                        if (t->strides[j])
                                contiguous = false;
                }
                if (contiguous) {
                        uint64_t s = 1;
                        for (uint32_t j = t->rank; j > 0; j--) {
                                o->strides[j - 1] = s;
                                s *= t->shape[j - 1] ? t->shape[j - 1] : 1;
                        }
                } else
                        memcpy(o->strides, t->strides, sizeof o->strides);
        }
        r = feature_desc_serialize(d, ret, ret_size);
        return r < 0 ? epd__error(c, r, NULL) : 0;
}

/* A handle that cannot be used (a reply malformed or placed outside the arena, a Publish
 * that could not be sent): given back, not left held until the connection goes; the
 * error stays the one that made it unusable. */
static int drop_unusable(epd_client *c, epd_feature *f, int r) {
        char name[sizeof c->error_name], message[sizeof c->error_message];
        memcpy(name, c->error_name, sizeof name);
        memcpy(message, c->error_message, sizeof message);
        (void)epd_feature_release(c, f); /* Release when it has a handle; frees f */
        memcpy(c->error_name, name, sizeof name);
        memcpy(c->error_message, message, sizeof message);
        return r;
}

int epd_feature_acquire(epd_client *c, const char *key, bool may_produce, epd_feature **ret) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *result;
        epd_feature *f;
        int r;

        if (!c || !key || !ret || strlen(key) > EPD_FEATURE_KEY_MAX)
                return epd__error(c, -EINVAL, NULL);
        /* Before the call: no handle granted and then lost for want of memory. */
        f = calloc(1, sizeof *f);
        if (!f)
                return epd__error(c, -ENOMEM, NULL);
        copy_str(f->key, sizeof f->key, key);
        r = epd__call(c, FEATURE_PATH, FEATURE_IFACE, "Acquire", &reply, "sb", key, (int)may_produce);
        if (r < 0) {
                free(f);
                return r;
        }
        r = sd_bus_message_read(reply, "s", &result);
        if (r >= 0) {
                copy_str(f->result, sizeof f->result, result);
                r = read_info(c, reply, f);
        }
        if (r < 0)
                return drop_unusable(c, f, r);
        *ret = f;
        return 0;
}

/* Reserve's or AcquireOrReserve's call, its arguments appended. */
static int reserve_message(epd_client *c, const char *member, const char *key, uint64_t bytes,
                           const epd_feature_tensor *tensors, size_t n, const char *request_id, sd_bus_message **ret) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
        _cleanup_(freep) void *bin = NULL;
        size_t bin_len;
        int r;

        r = build_desc(c, tensors, n, &bin, &bin_len);
        if (r < 0)
                return r;
        r = epd__new_call(c, FEATURE_PATH, FEATURE_IFACE, member, &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "st", key, bytes);
        if (r >= 0)
                r = sd_bus_message_append_array(m, 'y', bin, bin_len);
        if (r >= 0)
                r = sd_bus_message_append(m, "s", request_id ? request_id : "");
        if (r < 0)
                return epd__error(c, r, NULL);
        *ret = TAKE_PTR(m);
        return 0;
}

/* Reserve's or AcquireOrReserve's answer into f (with_result: it starts with Acquire's). */
static int reserve_reply(epd_client *c, sd_bus_message *reply, bool with_result, epd_feature *f) {
        const char *result;
        if (with_result) {
                int r = sd_bus_message_read(reply, "s", &result);
                if (r < 0)
                        return epd__error(c, r, NULL);
                copy_str(f->result, sizeof f->result, result);
        }
        return read_info(c, reply, f);
}

/* Reserve, or AcquireOrReserve (with_result: the reply starts with Acquire's result). */
static int reserve_call(epd_client *c, const char *member, bool with_result, const char *key, uint64_t bytes,
                        const epd_feature_tensor *tensors, size_t n, const char *request_id, epd_feature *f) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        int r = reserve_message(c, member, key, bytes, tensors, n, request_id, &m);
        if (r < 0)
                return r;
        r = epd__send(c, m, &reply);
        if (r < 0)
                return r;
        return reserve_reply(c, reply, with_result, f);
}

static int reserve(epd_client *c, const char *key, uint64_t bytes, const epd_feature_tensor *tensors,
                   size_t n, const char *request_id, epd_feature *f) {
        return reserve_call(c, "Reserve", false, key, bytes, tensors, n, request_id, f);
}

/* Reserve or AcquireOrReserve into a new epd_feature for key. */
static int reserve_new(epd_client *c, const char *member, bool with_result, const char *key, uint64_t bytes,
                       const epd_feature_tensor *tensors, size_t n_tensors, const char *request_id,
                       epd_feature **ret) {
        epd_feature *f;
        int r;

        if (!c || !key || !ret || strlen(key) > EPD_FEATURE_KEY_MAX)
                return epd__error(c, -EINVAL, NULL);
        f = calloc(1, sizeof *f);
        if (!f)
                return epd__error(c, -ENOMEM, NULL);
        copy_str(f->key, sizeof f->key, key);
        r = reserve_call(c, member, with_result, key, bytes, tensors, n_tensors, request_id, f);
        if (r < 0)
                return drop_unusable(c, f, r);
        *ret = f;
        return 0;
}

int epd_feature_acquire_or_reserve(epd_client *c, const char *key, uint64_t bytes,
                                   const epd_feature_tensor *tensors, size_t n_tensors, const char *request_id,
                                   epd_feature **ret) {
        return reserve_new(c, "AcquireOrReserve", true, key, bytes, tensors, n_tensors, request_id, ret);
}

/* An AcquireOrReserve on its way: sent, its answer taken by epd_feature_call_finish().
 * The slot's reply callback keeps the answer; the slot's destroy callback notes that no
 * answer will come any more (the answer came, or the connection went) and frees the
 * call when its caller has given it up meanwhile. */
struct epd_feature_call {
        epd_client *client;     /* while the slot lives: the bus (and client) are alive */
        epd_feature *f;         /* allocated at the send: no handle granted, then lost for want of memory */
        sd_bus_message *reply;  /* the answer (a method return or an error), once in */
        bool slot_gone;         /* no answer will come any more */
        bool taken;             /* finish took the answer (or learned there is none) */
        bool abandoned;         /* its caller freed it unanswered: the destroy callback frees it */
        bool in_finish;         /* finish runs on it: a free from a callback it dispatches only marks it */
};

/* Releases the handle of an answer nobody takes, without waiting (from a callback:
 * no sd_bus_process() of ours there). */
static void release_unwanted(epd_client *c, sd_bus_message *reply) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
        const char *result, *handle;
        if (!reply || sd_bus_message_is_method_error(reply, NULL) || sd_bus_message_rewind(reply, true) < 0 ||
            sd_bus_message_read(reply, "ss", &result, &handle) < 0 || !handle[0])
                return;
        if (sd_bus_message_new_method_call(c->bus, &m, EPD_DESTINATION(c), FEATURE_PATH, FEATURE_IFACE,
                                           "Release") >= 0 &&
            sd_bus_message_append(m, "s", handle) >= 0 && sd_bus_message_set_expect_reply(m, 0) >= 0)
                (void)sd_bus_send(c->bus, m, NULL);
}

static void call_free_now(epd_feature_call *call) {
        sd_bus_message_unref(call->reply);
        free(call->f);
        free(call);
}

static int on_feature_call_reply(sd_bus_message *m, void *userdata, sd_bus_error *ret_error) {
        epd_feature_call *call = userdata;
        epd_client *c = call->client;
        if (c->async_pending > 0)
                c->async_pending--;
        if (call->abandoned)
                release_unwanted(c, m);
        else
                call->reply = sd_bus_message_ref(m);
        return 0;
}

static void on_feature_call_destroy(void *userdata) {
        epd_feature_call *call = userdata;
        call->slot_gone = true;
        call->client = NULL; /* may be on its way out (epd_disconnect) */
        if (call->abandoned && !call->in_finish)
                call_free_now(call);
}

int epd_feature_acquire_or_reserve_send(epd_client *c, const char *key, uint64_t bytes,
                                        const epd_feature_tensor *tensors, size_t n_tensors,
                                        const char *request_id, epd_feature_call **ret) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
        sd_bus_slot *slot = NULL;
        epd_feature_call *call;
        int r;

        if (!c || !key || !ret || strlen(key) > EPD_FEATURE_KEY_MAX)
                return epd__error(c, -EINVAL, NULL);
        r = reserve_message(c, "AcquireOrReserve", key, bytes, tensors, n_tensors, request_id, &m);
        if (r < 0)
                return r;
        call = calloc(1, sizeof *call);
        if (call)
                call->f = calloc(1, sizeof *call->f);
        if (!call || !call->f) {
                free(call);
                return epd__error(c, -ENOMEM, NULL);
        }
        copy_str(call->f->key, sizeof call->f->key, key);
        call->client = c;
        r = sd_bus_call_async(c->bus, &slot, m, on_feature_call_reply, call, UINT64_MAX);
        if (r < 0) {
                call_free_now(call);
                return epd__error(c, r, NULL);
        }
        (void)sd_bus_slot_set_destroy_callback(slot, on_feature_call_destroy);
        (void)sd_bus_slot_set_floating(slot, 1);
        sd_bus_slot_unref(slot); /* the bus holds it until the answer (or its own end) */
        c->async_pending++;
        epd__clear_error(c);
        *ret = call;
        return 0;
}

int epd_feature_call_finish(epd_client *c, epd_feature_call *call, uint64_t timeout_usec, epd_feature **ret) {
        uint64_t until, now;
        epd_feature *f;
        int r;

        if (!c || !call || !ret)
                return epd__error(c, -EINVAL, NULL);
        if (call->taken)
                return epd__fail(c, -EALREADY, "AcquireOrReserve: its answer was taken already");
        /* From a callback of this connection sd_bus_process() cannot run (its answer
         * may be queued already): finish it after the callback. */
        if (sd_bus_get_current_message(c->bus))
                return epd__fail(c, -EBUSY, "AcquireOrReserve of %s: its answer cannot be taken from within a "
                                            "callback of the same connection", call->f->key);
        until = usec_add(now_usec(CLOCK_MONOTONIC), timeout_usec);
        for (;;) {
                call->in_finish = true;
                r = sd_bus_process(c->bus, NULL);
                call->in_finish = false;
                if (call->abandoned) {
                        /* Freed by a callback this step dispatched: what the free left to
                         * the destroy callback is done here (the reply callback released
                         * an answer that came with this step; one that came before is
                         * released here). */
                        if (call->slot_gone) {
                                if (call->reply)
                                        release_unwanted(c, call->reply);
                                call_free_now(call);
                        }
                        return epd__fail(c, -ECANCELED, "AcquireOrReserve: the call was freed while being finished");
                }
                /* The answer may have come with this step, which then returns 0 (a reply
                 * or error that sd-bus made itself, as when the connection closes). */
                if (call->reply || call->slot_gone)
                        break;
                if (r < 0)
                        return epd__error(c, r, NULL);
                now = now_usec(CLOCK_MONOTONIC);
                if (now >= until)
                        return epd__fail(c, -ETIMEDOUT, "AcquireOrReserve of %s: no answer in time", call->f->key);
                if (r > 0)
                        continue;
                r = sd_bus_wait(c->bus, until == UINT64_MAX ? UINT64_MAX : until - now);
                if (r < 0) /* -EINTR: a signal, whose handler the caller may want to run */
                        return epd__error(c, r, NULL);
        }
        call->taken = true; /* whatever follows: the answer is the caller's now, or none */
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = TAKE_PTR(call->reply);
        if (!reply)
                /* The connection went without an answer: the daemon released whatever the
                 * call had with it. */
                return epd__fail(c, -ENOTCONN, "AcquireOrReserve of %s: the connection closed before the answer",
                                 call->f->key);
        const sd_bus_error *e = sd_bus_message_get_error(reply);
        if (e) {
                /* sd-bus answers a call pending when the connection closes with NoReply:
                 * the connection is what went, not the time. */
                if (sd_bus_error_has_name(e, SD_BUS_ERROR_NO_REPLY) && sd_bus_is_open(c->bus) <= 0)
                        return epd__fail(c, -ENOTCONN, "AcquireOrReserve of %s: the connection to epdd closed "
                                                       "before the answer", call->f->key);
                int k = sd_bus_error_get_errno(e);
                return epd__error(c, k > 0 ? -k : -EIO, e);
        }
        f = TAKE_PTR(call->f);
        r = reserve_reply(c, reply, true, f);
        if (r < 0)
                return drop_unusable(c, f, r);
        epd__clear_error(c);
        *ret = f;
        return 0;
}

bool epd_feature_call_taken(const epd_feature_call *call) {
        return call && call->taken;
}

void epd_feature_call_free(epd_client *c, epd_feature_call *call) {
        if (!call)
                return;
        /* From a callback that the call's own finish dispatched, that finish frees it. */
        if (call->slot_gone && !call->in_finish) {
                /* Answered (or the connection went): a handle in an answer that finish
                 * did not take goes back. */
                if (c && call->reply)
                        release_unwanted(c, call->reply);
                call_free_now(call);
                return;
        }
        call->abandoned = true; /* the reply callback releases, the destroy callback frees */
}

int epd_feature_reserve(epd_client *c, const char *key, uint64_t bytes,
                        const epd_feature_tensor *tensors, size_t n_tensors,
                        const char *request_id, epd_feature **ret) {
        return reserve_new(c, "Reserve", false, key, bytes, tensors, n_tensors, request_id, ret);
}

/* Reserve for the handle f holds (Acquire told it to produce): the answer is that
 * handle's. One that names another handle (a daemon that made a new feature, as one
 * did for a producer whose production had timed out) is refused and the other handle
 * given back: f keeps its own, which its caller releases. */
int epd_feature_produce(epd_client *c, epd_feature *f, uint64_t bytes,
                        const epd_feature_tensor *tensors, size_t n_tensors,
                        const char *request_id) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        const char *handle;
        int r;

        if (!c || !f)
                return epd__error(c, -EINVAL, NULL);
        if (!f->handle[0])
                return reserve(c, f->key, bytes, tensors, n_tensors, request_id, f);
        r = reserve_message(c, "Reserve", f->key, bytes, tensors, n_tensors, request_id, &m);
        if (r < 0)
                return r;
        r = epd__send(c, m, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "s", &handle);
        if (r < 0)
                return epd__error(c, r, NULL);
        if (strcmp(handle, f->handle) != 0) {
                char other[sizeof f->handle];
                copy_str(other, sizeof other, handle);
                snprintf(c->error_name, sizeof c->error_name, "org.epd1.Error.Stale");
                snprintf(c->error_message, sizeof c->error_message,
                         "Reserve of %s answered with handle %s, not the handle %s that was told to produce it; "
                         "the other handle was given back: release this one and acquire the key again.",
                         f->key, other, f->handle);
                return epd__undo(c, -ESTALE, FEATURE_PATH, FEATURE_IFACE, "Release", "s", other);
        }
        r = sd_bus_message_rewind(reply, true);
        if (r < 0)
                return epd__error(c, r, NULL);
        return read_info(c, reply, f);
}

int epd_feature_publish(epd_client *c, epd_feature *f, uint64_t encode_usec) {
        int r;
        if (!c || !f)
                return epd__error(c, -EINVAL, NULL);
        r = epd__call(c, FEATURE_PATH, FEATURE_IFACE, "Publish", NULL, "st", f->handle, encode_usec);
        if (r >= 0)
                copy_str(f->state, sizeof f->state, "ready");
        return r;
}

int epd_feature_publish_release(epd_client *c, epd_feature *f, uint64_t encode_usec) {
        int r;
        if (!c || !f) {
                /* f is the caller's no more, whatever the result: freed here too (with no
                 * client the daemon released its handle with the connection). */
                free(f);
                return epd__error(c, -EINVAL, NULL);
        }
        r = epd__call_nowait(c, FEATURE_PATH, FEATURE_IFACE, "Publish", "st", f->handle, encode_usec);
        if (r < 0) {
                /* Nothing was sent: give the handle back (the producer's release fails the
                 * feature), keeping the send's error for the caller. */
                return drop_unusable(c, f, r);
        }
        r = epd__call_nowait(c, FEATURE_PATH, FEATURE_IFACE, "Release", "s", f->handle);
        if (r < 0) {
                /* The Publish went; the Release could not be queued: give the handle back
                 * the waiting way (else it pins the feature until the connection goes).
                 * The Publish stands, so this is a success for the caller. */
                r = epd_feature_release(c, f);
                if (r == -ENOTCONN || r == -ECONNRESET)
                        return r;
                epd__clear_error(c); /* a success: not the Release's refusal */
                return 0;
        }
        free(f);
        return 0;
}

int epd_feature_fail(epd_client *c, epd_feature *f, const char *reason) {
        int r;
        if (!c || !f)
                return epd__error(c, -EINVAL, NULL);
        r = epd__call(c, FEATURE_PATH, FEATURE_IFACE, "Fail", NULL, "ss", f->handle, reason ? reason : "");
        if (r >= 0)
                return epd_feature_refresh(c, f);
        return r;
}

int epd_feature_refresh(epd_client *c, epd_feature *f) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r;
        if (!c || !f)
                return epd__error(c, -EINVAL, NULL);
        r = epd__call(c, FEATURE_PATH, FEATURE_IFACE, "Describe", &reply, "s", f->handle);
        if (r < 0)
                return r;
        return read_info(c, reply, f);
}

typedef struct WaitState {
        const char *key;
        bool changed;
} WaitState;

static int on_ready(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        WaitState *w = userdata;
        const char *key;
        if (sd_bus_message_read(m, "s", &key) >= 0 && strcmp(key, w->key) == 0)
                w->changed = true;
        return 0;
}

/* 0 while f is reserved, 1 when ready, else -EPIPE (named: the feature failed, not an
 * earlier call's error). */
static int settled(epd_client *c, epd_feature *f) {
        if (strcmp(f->state, "reserved") == 0)
                return 0;
        if (strcmp(f->state, "ready") == 0)
                return 1;
        return epd__fail(c, -EPIPE, "Feature %s is %s (%s).", f->key, f->state, f->error[0] ? f->error : "no reason given");
}

/* The daemon's Wait: one call, answered when the feature is ready or failed. 1 when
 * answered (f updated), -ETIMEDOUT, -EOPNOTSUPP from a daemon without Wait, or another
 * error. */
static int wait_call(epd_client *c, epd_feature *f, uint64_t timeout_usec) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        int r;

        r = epd__new_call(c, FEATURE_PATH, FEATURE_IFACE, "Wait", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "s", f->handle);
        if (r < 0)
                return epd__error(c, r, NULL);
        /* sd_bus_call: UINT64_MAX waits without a timeout (0 would be its default). */
        r = epd__send_timeout(c, m, timeout_usec, &reply);
        if (r < 0)
                return strcmp(c->error_name, SD_BUS_ERROR_UNKNOWN_METHOD) == 0 ? -EOPNOTSUPP : r;
        r = read_info(c, reply, f);
        return r < 0 ? r : 1;
}

/* The wait against a daemon without Wait: woken by FeatureReady, then Describe. */
int epd__feature_wait_signal(epd_client *c, epd_feature *f, uint64_t deadline) {
        _cleanup_(sd_bus_slot_unrefp) sd_bus_slot *slot = NULL;
        WaitState w = { .key = f->key };
        int r;

        /* Subscribe first, then look: a change after the look arrives as a signal. */
        /* Any sender: a signal only makes us ask the daemon again (Describe), so a forged
         * one cannot change what we report. */
        r = sd_bus_match_signal(c->bus, &slot, NULL, FEATURE_PATH,
                                FEATURE_IFACE, "FeatureReady", on_ready, &w);
        if (r < 0)
                return epd__error(c, r, NULL);
        r = epd_feature_refresh(c, f);
        if (r < 0)
                return r;
        for (;;) {
                if ((r = settled(c, f)) != 0)
                        return r > 0 ? 0 : r;
                while ((r = sd_bus_process(c->bus, NULL)) > 0)
                        ;
                if (r < 0)
                        return epd__error(c, r, NULL);
                if (w.changed) {
                        w.changed = false;
                        r = epd_feature_refresh(c, f);
                        if (r < 0)
                                return r;
                        continue;
                }
                uint64_t now = now_usec(CLOCK_MONOTONIC);
                if (now >= deadline)
                        return epd__error(c, -ETIMEDOUT, NULL);
                r = sd_bus_wait(c->bus, deadline == UINT64_MAX ? UINT64_MAX : deadline - now);
                if (r < 0)
                        return epd__error(c, r, NULL);
        }
}

int epd_feature_wait(epd_client *c, epd_feature *f, uint64_t timeout_usec) {
        uint64_t deadline;
        int r;

        if (!c || !f)
                return epd__error(c, -EINVAL, NULL);
        epd__clear_error(c); /* settled already: no call made, no earlier call's error left */
        if ((r = settled(c, f)) != 0)
                return r > 0 ? 0 : r;
        deadline = usec_add(now_usec(CLOCK_MONOTONIC), timeout_usec);
        if (timeout_usec > 0) {
                /* One round trip answered by the Publish (or the failure); the signal path
                 * only for a daemon that has no Wait. */
                for (;;) {
                        uint64_t now = now_usec(CLOCK_MONOTONIC);
                        if (now >= deadline)
                                return epd__error(c, -ETIMEDOUT, NULL);
                        r = wait_call(c, f, deadline == UINT64_MAX ? UINT64_MAX : deadline - now);
                        if (r == -EOPNOTSUPP)
                                break;
                        if (r < 0)
                                return r;
                        if ((r = settled(c, f)) != 0)
                                return r > 0 ? 0 : r;
                }
        }
        /* A timeout of 0 only looks (Describe once). */
        return epd__feature_wait_signal(c, f, deadline);
}

int epd_feature_pin(epd_client *c, const char *key, epd_feature **ret) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *handle;
        epd_feature *f;
        int r;

        if (!c || !key || !ret || strlen(key) > EPD_FEATURE_KEY_MAX)
                return epd__error(c, -EINVAL, NULL);
        f = calloc(1, sizeof *f);
        if (!f)
                return epd__error(c, -ENOMEM, NULL);
        copy_str(f->key, sizeof f->key, key);
        r = epd__call(c, FEATURE_PATH, FEATURE_IFACE, "Pin", &reply, "s", key);
        if (r >= 0) {
                r = sd_bus_message_read(reply, "s", &handle);
                if (r < 0)
                        r = epd__error(c, r, NULL);
        }
        if (r < 0) {
                free(f);
                return r;
        }
        copy_str(f->handle, sizeof f->handle, handle);
        r = epd_feature_refresh(c, f);
        if (r < 0)
                return drop_unusable(c, f, r); /* keeps Describe's error, not Release's */
        *ret = f;
        return 0;
}

int epd_feature_release(epd_client *c, epd_feature *f) {
        int r = 0;
        if (!f)
                return 0;
        if (c && f->handle[0])
                r = epd__call(c, FEATURE_PATH, FEATURE_IFACE, "Release", NULL, "s", f->handle);
        free(f);
        return r;
}

int epd_feature_prefetch(epd_client *c, const char *const *keys, size_t n) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        const char *res;
        int r, hits = 0;

        if (!c || (!keys && n > 0))
                return epd__error(c, -EINVAL, NULL);
        r = epd__new_call(c, FEATURE_PATH, FEATURE_IFACE, "Prefetch", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_open_container(m, 'a', "s");
        for (size_t i = 0; r >= 0 && i < n; i++)
                r = sd_bus_message_append(m, "s", keys[i]);
        if (r >= 0)
                r = sd_bus_message_close_container(m);
        if (r < 0)
                return epd__error(c, r, NULL);
        r = epd__send(c, m, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(reply, 'a', "s");
        while (r >= 0 && (r = sd_bus_message_read(reply, "s", &res)) > 0)
                if (strcmp(res, "present") == 0 || strcmp(res, "loaded") == 0)
                        hits++;
        return r < 0 ? epd__error(c, r, NULL) : hits;
}
