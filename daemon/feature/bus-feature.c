/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Feature at /org/epd1/feature: the feature cache on the bus (vtable, replies,
 * error names, the FeatureReady/FeatureWanted signals). The subsystem is
 * feature-manager.c, the cache itself feature.c. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/bus-objects.h"
#include "core/client.h"
#include "core/manager.h"
#include "core/mappers.h"
#include "core/worker.h"
#include "feature/bus-feature.h"
#include "feature/feature-load.h"
#include "feature/feature-manager.h"
#include "feature/feature-spill.h"
#include "feature/feature-store.h"
#include "feature/feature.h"
#include "hashmap.h"
#include "id.h"
#include "list.h"
#include "log.h"
#include "macro.h"
#include "telemetry/telemetry-manager.h"
#include "wal/wal-manager.h"

#define PREFETCH_KEYS_MAX 1024u

static const char *error_text(int error) {
        switch (error) {
        case 0:
                return "";
        case -EPIPE:
                return "producer-gone";
        case -ETIMEDOUT:
                return "timeout";
        case -ECANCELED:
                return "producer-failed";
        default:
                return "failed";
        }
}

/* A signal of the Feature object to client c alone (unicast: on the bus it names c as
 * its destination; on a direct connection only c's peer is there). */
static int send_unicast(Client *c, const char *member, const char *types, ...) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *msg = NULL;
        va_list ap;
        int r = sd_bus_message_new_signal(c->bus, &msg, FEATURE_PATH, FEATURE_IFACE, member);
        if (r >= 0 && c->unique_name)
                r = sd_bus_message_set_destination(msg, c->unique_name);
        if (r >= 0) {
                va_start(ap, types);
                r = sd_bus_message_appendv(msg, types, ap);
                va_end(ap);
        }
        if (r >= 0)
                r = sd_bus_send(c->bus, msg, NULL);
        return r;
}

static int send_ready(Client *c, Feature *f) {
        return send_unicast(c, "FeatureReady", "sss", f->key, feature_state_to_string(f->state),
                            error_text(f->error));
}

/* FeatureWanted goes to the registered encoders only, each alone: a key is a content
 * hash of someone's input (docs/security.md). */
static void emit_wanted(Manager *m, const char *key) {
        Worker *w;
        size_t it = 0;
        while (hashmap_iterate(m->workers, &it, (void **)&w, NULL)) {
                Client *c = w->object.owner;
                if (w->role != WORKER_ENCODER || !c || !c->bus || c->dying)
                        continue;
                int r = send_unicast(c, "FeatureWanted", "s", key);
                if (r < 0)
                        log_debug_errno(r, "Cannot send FeatureWanted to client %" PRIu64 ": %m", c->serial);
        }
}

static void acquire_loaded(FeatureLoadWaiter *w, FeatureHandle *h, int error);

/* Whether h's client hears of its feature's new state: not while h's Acquire is still
 * unanswered (a read back's): its caller never learnt the handle, and hears through the
 * reply (a hit, an error, or, for a stored copy found unusable, the re-run's miss). A
 * Wait in progress is no such Acquire: its caller holds the handle. */
static bool holder_hears(const FeatureHandle *h) {
        const Client *c = h->object.owner;
        return !(h->waiter && h->waiter->done == acquire_loaded) && c && c->bus;
}

/* Up to this many handles on a feature, a client told already is found by looking back
 * along the list; past it, through a table of the clients told. */
#define READY_SCAN_MAX 16u

/* Whether a handle before h in its feature's list told h's client already. */
static bool told_before(const FeatureHolders *g, const FeatureHandle *h) {
        for (const FeatureHandle *x = g->handles; x && x != h; x = x->holders_next)
                if (x->object.owner == h->object.owner && holder_hears(x))
                        return true;
        return false;
}

/* FeatureReady goes to the clients that hold a handle on the feature (its producer,
 * readers and waiters, pins; not an Acquire still waiting for its read back), once
 * each, as a unicast signal: a key is a content hash of someone's input, and nobody
 * else learns that it was produced. The feature's own handles are walked, not every
 * handle of the daemon. */
void bus_feature_emit_ready(Manager *m, Feature *f) {
        FeatureManager *fm = feature_manager_get(m);
        FeatureHolders *g = feature_manager_holders(fm, f);
        Hashmap *sent = NULL;

        if (!g)
                return;
        if (g->n_handles > READY_SCAN_MAX) {
                sent = hashmap_new(HASHMAP_KEY_U64, sizeof(uint64_t));
                if (!sent) {
                        log_oom();
                        return;
                }
        }
        LIST_FOREACH(holders, h, g->handles) {
                Client *c = h->object.owner;
                if (!holder_hears(h) || (sent ? hashmap_contains(sent, &c->serial) : told_before(g, h)))
                        continue;
                if (sent && hashmap_put(sent, &c->serial, c) < 0) {
                        log_oom();
                        break;
                }
                int r = send_ready(c, f);
                if (r < 0)
                        log_debug_errno(r, "Cannot send FeatureReady to client %" PRIu64 ": %m", c->serial);
        }
        hashmap_free(sent);
}

/* The caller's handle named by id_str, or a named error. */
static int handle_lookup(FeatureManager *fm, sd_bus_message *msg, const char *id_str, FeatureHandle **ret,
                         sd_bus_error *error) {
        Reason why = {};
        int r = feature_handle_lookup(fm, manager_client_lookup_message(fm->manager, msg), id_str, ret, &why);
        return r < 0 ? epd_bus_error_errno(error, r, why.text) : 0;
}

static int client_error(int r, sd_bus_error *error) {
        if (r == -EUSERS)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "Too many clients.");
        if (r == -EDQUOT)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "Too many objects for this client.");
        if (r == -ESHUTDOWN)
                return epd_bus_error(error, EPD_ERROR_STALE, "The client is going away.");
        return r;
}

static int cache_error(const Manager *m, int r, const char *key, sd_bus_error *error) {
        switch (r) {
        case -EUSERS:
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "Too many feature handles in the daemon.");
        case -ENOSPC:
                if (feature_cache_fenced(m->features))
                        return epd_bus_error(error, EPD_ERROR_NO_SPACE,
                                             "No room for feature '%.64s': %" PRIu64 " bytes free at epdd's restart are held "
                                             "back, and the features restored kept, until the worker processes of before "
                                             "it exit or register again (at most %u s; docs/wal.md).",
                                             key, feature_cache_stats(m->features)->bytes_fenced,
                                             (unsigned)(MAPPERS_FENCE_USEC / USEC_PER_SEC));
                return epd_bus_error(error, EPD_ERROR_NO_SPACE,
                                     "No room for feature '%.64s': everything cached is in use or pinned.", key);
        case -E2BIG:
                return epd_bus_error(error, EPD_ERROR_NO_SPACE,
                                     "Feature '%.64s' is larger than the feature cache, or than every feature arena this worker maps.", key);
        case -ENODEV:
                return epd_bus_error(error, EPD_ERROR_UNSUPPORTED,
                                     "No feature arena is configured ([Arena:NAME] Usage=feature).");
        case -EEXIST:
                return epd_bus_error(error, EPD_ERROR_EXISTS, "Feature '%.64s' is already ready.", key);
        case -EBUSY:
                return epd_bus_error(error, EPD_ERROR_BUSY, "Feature '%.64s' is being produced by another client.", key);
        case -ENOENT:
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No feature '%.64s'.", key);
        case -EBADMSG:
                return epd_bus_error(error, EPD_ERROR_FAILED,
                                     "The stored copy of feature '%.64s' is truncated or corrupt; it was removed.", key);
        default:
                return r;
        }
}

static int check_key(const char *key, sd_bus_error *error) {
        if (!feature_key_valid(key))
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "A feature key is 1 to %u bytes.", FEATURE_KEY_MAX);
        return 0;
}

/* A step of a request in its trace (docs/telemetry.md): under the request id the caller
 * gave (Reserve, AcquireOrReserve) or the feature's producer gave (Publish, Fail);
 * nothing without one. */
static void trace_step(Manager *m, const Client *by, const EpdId *req, TraceEventType type, const char *key,
                       uint64_t bytes, usec_t duration, const char *what) {
        char id[EPD_ID_STRING_MAX], detail[TRACE_DETAIL_MAX];

        if (!req || epd_id_is_null(req))
                return;
        snprintf(detail, sizeof detail, "%.40s%skey=%.48s", what ?: "", what ? " " : "", key);
        /* by: the client whose call it was; its uid may read the trace. */
        (void)telemetry_trace(m, epd_id_to_string(req, id), type,
                              &(TraceDetail) { .bytes = bytes, .duration_usec = duration, .detail = detail,
                                               .has_uid = by != NULL, .uid = by ? (uint32_t)by->uid : 0 });
}

/* (handle, state, error, arena, offset, bytes, descriptor, request id) */
#define FEATURE_INFO_TYPES "sssstayss"

static int append_info(sd_bus_message *reply, FeatureManager *fm, FeatureHandle *h) {
        Feature *f = h->ref->feature;
        _cleanup_(freep) void *desc = NULL;
        size_t desc_len = 0;
        char id[EPD_ID_STRING_MAX], req[EPD_ID_STRING_MAX] = "";
        const char *arena = "";
        int r;

        if (f->has_region && f->arena < fm->manager->n_arenas)
                arena = fm->manager->arenas[f->arena]->name;
        if (f->desc) {
                r = feature_desc_serialize(f->desc, &desc, &desc_len);
                if (r < 0)
                        return r;
        }
        /* Not to every holder: a request id names its handoffs (an untargeted Accept
         * takes one by it), so only the producer's uid and root learn it here. */
        uid_t uid = h->object.owner ? h->object.owner->uid : (uid_t)-1;
        if (!epd_id_is_null(&f->request_id) && (uid == 0 || uid == (uid_t)f->producer_uid))
                epd_id_to_string(&f->request_id, req);
        r = sd_bus_message_append(reply, "ssss", epd_id_to_string(&h->id, id),
                                  feature_state_to_string(f->state), error_text(f->error), arena);
        if (r >= 0)
                r = sd_bus_message_append(reply, "t", f->has_region ? f->offset : (uint64_t)0);
        if (r >= 0)
                r = sd_bus_message_append(reply, "t", f->bytes);
        if (r >= 0)
                r = sd_bus_message_append_array(reply, 'y', desc, desc_len);
        if (r >= 0)
                r = sd_bus_message_append(reply, "s", req);
        return r;
}

/* An Acquire answered once its feature is read back from the store, or refused with
 * Error.Timeout past [Features] ReadBackTimeout= (its handle released: a caller whose own
 * call timed out meanwhile would never learn of it, and it would stay the caller's until
 * it disconnects). */
typedef struct AcquireCall {
        FeatureLoadWaiter waiter;
        sd_bus_message *msg;
        FeatureHandle *h;
        sd_event_source *timer;
        usec_t timeout; /* as armed (a reload may change the setting meanwhile) */
        usec_t deadline; /* CLOCK_MONOTONIC; 0: none */
        Manager *m;
        sd_bus_message_handler_t method; /* the call's method, to run it again */
        EpdId req; /* AcquireOrReserve's request: its trace's hit when the bytes are back */
        bool trace;
} AcquireCall;

/* A call run again once the dispatch that failed its first answer is over: its stored
 * copy's lookup found none usable, so it is a miss now (told to produce, to wait, or
 * NotFound), as it would have been had that been known when it came. */
typedef struct AcquireAgain {
        Manager *m;
        sd_bus_message *msg;
        sd_bus_message_handler_t method;
        usec_t deadline; /* the first read back's: a read back again waits no longer */
} AcquireAgain;

static void acquire_again_free(void *userdata) {
        AcquireAgain *a = userdata;
        sd_bus_message_unref(a->msg);
        free(a);
}

static int acquire_again(sd_event_source *s, void *userdata) {
        AcquireAgain *a = userdata;
        _cleanup_(sd_bus_error_free) sd_bus_error error = SD_BUS_ERROR_NULL;
        int r;

        r = sd_bus_message_rewind(a->msg, true);
        if (r >= 0) {
                FeatureManager *fm = feature_manager_get(a->m);
                fm->rerun_deadline = a->deadline;
                r = a->method(a->msg, a->m, &error);
                fm->rerun_deadline = 0;
        }
        /* Named as the vtable's wrapper names a handler's refusal. */
        r = bus_glue_name_error(&error, r, sd_bus_message_get_interface(a->msg), sd_bus_message_get_member(a->msg));
        if (sd_bus_error_is_set(&error))
                (void)sd_bus_reply_method_error(a->msg, &error);
        else if (r < 0)
                (void)bus_glue_reply_errno(a->msg, r, "Cannot answer the Acquire.");
        sd_event_source_disable_unref(s); /* frees a (acquire_again_free) */
        return 0;
}

static int acquire_later(AcquireCall *call) {
        sd_event_source *s = NULL;
        AcquireAgain *a = malloc(sizeof *a);
        int r;

        if (!a)
                return -ENOMEM;
        *a = (AcquireAgain) { .m = call->m, .msg = sd_bus_message_ref(call->msg), .method = call->method,
                              .deadline = call->deadline };
        r = sd_event_add_defer(call->m->event, &s, acquire_again, a);
        if (r < 0) {
                acquire_again_free(a);
                return r;
        }
        /* Owned by the loop from here: freed after it runs, or with the loop at exit. */
        (void)sd_event_source_set_destroy_callback(s, acquire_again_free);
        (void)sd_event_source_set_floating(s, true);
        sd_event_source_unref(s);
        return 0;
}

static void acquire_loaded(FeatureLoadWaiter *w, FeatureHandle *h, int error) {
        AcquireCall *call = container_of(w, AcquireCall, waiter);
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *msg = call->msg;
        int r = 0;

        sd_event_source_disable_unref(call->timer);
        if (error < 0 && error != -ECANCELED && feature_lookup_failed(h->ref->feature) && acquire_later(call) >= 0) {
                free(call);
                feature_handle_release(h); /* the caller never learnt it */
                return;
        }
        bool trace = call->trace;
        EpdId req = call->req;
        free(call);
        if (error == -ECANCELED)
                return; /* the handle went first: its client is gone */
        if (error == 0) {
                _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
                Worker *wk = h->object.owner ? client_get_worker(h->object.owner) : NULL;
                if (wk)
                        wk->stats.feature_hits++; /* now that the bytes are back */
                r = sd_bus_message_new_method_return(msg, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "s", "hit");
                if (r >= 0)
                        r = append_info(reply, h->fm, h);
                if (r >= 0)
                        r = sd_bus_send(NULL, reply, NULL);
                if (r >= 0 && trace)
                        trace_step(h->fm->manager, h->object.owner, &req, TRACE_ACQUIRE_HIT, h->ref->feature->key,
                                   h->ref->feature->bytes, 0, "read-back");
                if (r >= 0)
                        return;
                log_debug_errno(r, "Cannot answer an Acquire of %.64s: %m", h->ref->feature->key);
                (void)bus_glue_reply_errno(msg, r, "Cannot build the reply.");
        } else
                (void)sd_bus_reply_method_errorf(msg, EPD_ERROR_FAILED,
                                                 "Feature '%.64s' could not be read back from the store (%s); "
                                                 "acquire it again (a damaged copy is removed from the store, and "
                                                 "the next Acquire produces it).",
                                                 h->ref->feature->key, strerror(-error));
        /* The caller never learnt this handle. */
        feature_handle_release(h);
}

static int acquire_read_back_timeout(sd_event_source *s, uint64_t usec, void *userdata) {
        AcquireCall *call = userdata;
        FeatureHandle *h = call->h;

        log_warning("Feature %.64s: still being read back from the store after %" PRIu64
                    " ms ([Features] ReadBackTimeout=): its Acquire is refused; the read goes on.",
                    h->ref->feature->key, (uint64_t)(call->timeout / 1000));
        feature_cache_count_read_back_timeout(h->fm->manager->features);
        (void)sd_bus_reply_method_errorf(call->msg, EPD_ERROR_TIMEOUT,
                                         "Feature '%.64s' is still being read back from the store after %" PRIu64
                                         " ms ([Features] ReadBackTimeout=); acquire it again.",
                                         h->ref->feature->key, (uint64_t)(call->timeout / 1000));
        /* The caller never learns this handle: released, which ends the call
         * (acquire_loaded(), -ECANCELED, frees it and this source). The read goes on for
         * the cache. */
        feature_handle_release(h);
        return 0;
}

/* A Wait answered once its feature settles (READY or FAILED): the same answer as
 * Describe's, from which the caller learns which. */
typedef struct WaitCall {
        FeatureLoadWaiter waiter;
        sd_bus_message *msg;
} WaitCall;

/* A region's reply waiting for the evictions' GONE records. */
typedef struct RegionReply {
        FeatureManager *fm;
        sd_bus_message *msg, *reply;
        EpdId handle;
        bool own;
} RegionReply;

static void region_durable(void *userdata, int error) {
        RegionReply *rr = userdata;
        if (error >= 0)
                (void)sd_bus_send(NULL, rr->reply, NULL);
        else {
                /* Refused: the caller never learns the handle this call made, so it
                 * goes, and the reservation with it (no key left reserved by a handle
                 * nobody can name, no region held for it). */
                FeatureHandle *h = rr->own ? hashmap_get(rr->fm->handles, &rr->handle) : NULL;
                if (h)
                        feature_handle_release(h);
                (void)sd_bus_reply_method_errorf(rr->msg, EPD_ERROR_FAILED,
                                                 "The eviction that made room for the region cannot be journaled "
                                                 "(%s)%s.",
                                                 strerror(-error), rr->own ? "; nothing is reserved" : "");
        }
        sd_bus_message_unref(rr->msg);
        sd_bus_message_unref(rr->reply);
        free(rr);
}

/* The reply that hands a producer its region: sent once every evicted feature's GONE is
 * durable (the region may be one of theirs), at once when they are. own: h was made
 * for this call (released if the journal refuses: the caller would never learn it). */
static int send_region(FeatureManager *fm, sd_bus_message *msg, sd_bus_message *reply, FeatureHandle *h, bool own) {
        if (feature_manager_region_settled(fm))
                return sd_bus_send(NULL, reply, NULL);
        RegionReply *rr = calloc(1, sizeof *rr);
        if (!rr)
                return -ENOMEM;
        *rr = (RegionReply) { .fm = fm, .msg = sd_bus_message_ref(msg), .reply = sd_bus_message_ref(reply),
                              .handle = h->id, .own = own };
        int r = wal_manager_after_durable(fm->manager, region_durable, rr);
        if (r < 0) {
                sd_bus_message_unref(rr->msg);
                sd_bus_message_unref(rr->reply);
                free(rr);
                return r;
        }
        return 1;
}

static int reply_info_as(FeatureManager *fm, sd_bus_message *msg, FeatureHandle *h, bool own) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = append_info(reply, fm, h);
        if (r >= 0)
                r = h->ref->feature->state == FEATURE_RESERVED && h->ref->feature->has_region &&
                                    h->ref->feature->producer == h->ref
                            ? send_region(fm, msg, reply, h, own)
                            : sd_bus_send(NULL, reply, NULL);
        return r;
}

static int reply_info(FeatureManager *fm, sd_bus_message *msg, FeatureHandle *h) {
        return reply_info_as(fm, msg, h, false);
}

static void wait_settled(FeatureLoadWaiter *w, FeatureHandle *h, int error) {
        WaitCall *call = container_of(w, WaitCall, waiter);
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *msg = call->msg;
        int r;

        free(call);
        /* By the feature's state, not the error (a failed feature's error may be any). */
        if (h->ref->feature->state == FEATURE_RESERVED) {
                if (error == -ESTALE)
                        (void)sd_bus_reply_method_errorf(msg, EPD_ERROR_STALE,
                                                         "A later Wait on the same feature handle took its place.");
                else /* the handle went first (its client, or a Release) */
                        (void)sd_bus_reply_method_errorf(msg, EPD_ERROR_NOT_FOUND,
                                                         "The feature handle was released while waiting.");
                return;
        }
        /* READY, or FAILED (the info says so, with the error). */
        r = reply_info(h->fm, msg, h);
        if (r < 0) {
                log_debug_errno(r, "Cannot answer a Wait for %.64s: %m", h->ref->feature->key);
                (void)bus_glue_reply_errno(msg, r, "Cannot build the reply.");
        }
}

static const char *const acquire_results[] = {
        [FEATURE_ACQUIRE_HIT] = "hit",
        [FEATURE_ACQUIRE_WAIT] = "wait",
        [FEATURE_ACQUIRE_PRODUCE] = "produce",
        [FEATURE_ACQUIRE_LOADING] = "hit", /* answered once loaded */
};

/* Acquire's and AcquireOrReserve's answer: a handle on ref for the caller, and the
 * result with the handle's info; a feature being read back is answered when loaded. */
static int acquire_answer(FeatureManager *fm, sd_bus_message *msg, sd_bus_message_handler_t method, Worker *w,
                          FeatureRef *ref, FeatureAcquireResult res, const EpdId *trace_req, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        FeatureHandle *h;
        int r;

        r = feature_handle_new(fm, w->object.owner, ref, &h);
        if (r < 0) {
                feature_ref_unclaim(ref); /* a producer's: the announced waiters keep waiting */
                feature_manager_arm_timer(fm); /* back among the announced: its deadline */
                return client_error(r, error);
        }
        if (res == FEATURE_ACQUIRE_LOADING) {
                /* Read back off the loop; acquire_loaded() answers (a hit). */
                AcquireCall *call = calloc(1, sizeof *call);
                if (!call) {
                        feature_handle_release(h);
                        return -ENOMEM;
                }
                usec_t timeout = fm->manager->config.feature_read_back_timeout_usec, now = now_usec(CLOCK_MONOTONIC);
                *call = (AcquireCall) { .waiter.done = acquire_loaded, .msg = sd_bus_message_ref(msg), .h = h,
                                        .timeout = timeout, .m = fm->manager, .method = method,
                                        .trace = trace_req != NULL, .req = trace_req ? *trace_req : (EpdId){} };
                if (timeout > 0) {
                        /* An Acquire asked again after a failed lookup keeps its first
                         * deadline: it waits no longer in all than the setting says. */
                        call->deadline = fm->rerun_deadline > 0 ? fm->rerun_deadline : now + timeout;
                        /* Within a twentieth of it (accuracy 0 would be sd-event's 250 ms). */
                        r = sd_event_add_time(fm->manager->event, &call->timer, CLOCK_MONOTONIC, call->deadline,
                                              MAX(timeout / 20, (usec_t)1), acquire_read_back_timeout, call);
                        if (r < 0) {
                                sd_bus_message_unref(call->msg);
                                free(call);
                                feature_handle_release(h);
                                return r;
                        }
                }
                feature_handle_wait_load(h, &call->waiter);
                return 1;
        }
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "s", acquire_results[res]);
        if (r >= 0)
                r = append_info(reply, fm, h);
        if (r >= 0)
                r = res == FEATURE_ACQUIRE_PRODUCE && ref->feature->has_region ? send_region(fm, msg, reply, h, true)
                                                                              : sd_bus_send(NULL, reply, NULL);
        if (r < 0) {
                feature_handle_release(h);
                return r;
        }
        /* Counted once answered: a claim refused (its handle, or AcquireOrReserve's
         * reservation) was never told to produce. */
        feature_manager_count_acquire(w, res);
        return 1;
}

/* Acquire's and AcquireOrReserve's common part: the calling worker, its reference on
 * key and what to do with it (counted in its stats once answered: acquire_answer()). */
static int acquire_for(Manager *m, sd_bus_message *msg, const char *key, bool may_produce, Worker **ret_w,
                       FeatureRef **ret_ref, FeatureAcquireResult *ret_res, sd_bus_error *error) {
        int r = manager_require_worker(m, msg, ret_w, error);
        if (r < 0)
                return r;
        /* The handle the answer needs, asked for first: refused after the claim, a
         * producer's claim would be given back (and its reservation, evictions done). */
        r = client_object_room((*ret_w)->object.owner);
        if (r < 0)
                return client_error(r, error);
        r = feature_acquire(m->features, key, may_produce, now_usec(CLOCK_MONOTONIC), ret_ref, ret_res);
        if (r < 0)
                return cache_error(m, r, key, error);
        if (*ret_res == FEATURE_ACQUIRE_PRODUCE)
                feature_manager_arm_timer(feature_manager_get(m)); /* its produce deadline */
        return 0;
}

static int method_acquire(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        FeatureManager *fm = feature_manager_get(m);
        FeatureAcquireResult res;
        FeatureRef *ref;
        Worker *w;
        const char *key;
        int may_produce, r;

        r = sd_bus_message_read(msg, "sb", &key, &may_produce);
        if (r < 0)
                return r;
        r = check_key(key, error);
        if (r < 0)
                return r;
        r = acquire_for(m, msg, key, may_produce, &w, &ref, &res, error);
        if (r < 0)
                return r;
        return acquire_answer(fm, msg, method_acquire, w, ref, res, NULL, error);
}

/* Reserve's and AcquireOrReserve's arguments: (key, bytes, descriptor, request_id),
 * each checked, the descriptor parsed against bytes. */
static int read_reservation(Manager *m, sd_bus_message *msg, const char **ret_key, uint64_t *ret_bytes,
                            FeatureDesc **ret_desc, EpdId *ret_req, sd_bus_error *error) {
        FeatureDescIssue issue;
        const char *key, *req_str;
        const void *bin;
        size_t bin_len;
        uint64_t bytes;
        int r;

        r = sd_bus_message_read(msg, "st", &key, &bytes);
        if (r >= 0)
                r = sd_bus_message_read_array(msg, 'y', &bin, &bin_len);
        if (r >= 0)
                r = sd_bus_message_read(msg, "s", &req_str);
        if (r < 0)
                return r;
        r = check_key(key, error);
        if (r < 0)
                return r;
        if (bytes == 0 || bytes > m->config.max_request_bytes)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "bytes must be 1 to %" PRIu64 ".", m->config.max_request_bytes);
        *ret_req = (EpdId) {};
        if (req_str[0] && epd_id_from_string(req_str, ret_req) < 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "request_id must be 32 hex digits or empty.");
        if (bin_len > FEATURE_DESC_BINARY_MAX)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Descriptor too long.");
        r = feature_desc_parse(bin, bin_len, bytes, ret_desc, &issue);
        if (r < 0) {
                char text[256];
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Bad descriptor: %s.",
                                     feature_desc_issue_format(&issue, NULL, text, sizeof text));
        }
        *ret_key = key;
        *ret_bytes = bytes;
        return 0;
}

/* Acquire with may_produce, and when the caller is told to produce, Reserve through the
 * new handle in the same call: a producer that knows its output's layout before it runs
 * makes one round trip instead of two. A refused reservation fails a fresh feature
 * (nobody can have waited for it yet); an announced one (Prefetch) that others wait for
 * goes back to waiting for a producer. It is answered like Reserve's. */
static int method_acquire_or_reserve(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        FeatureManager *fm = feature_manager_get(m);
        _cleanup_(feature_desc_freep) FeatureDesc *desc = NULL;
        FeatureAcquireResult res;
        FeatureDescIssue issue;
        FeatureRef *ref;
        const char *key = NULL;
        uint64_t bytes = 0;
        EpdId req;
        Worker *w;
        int r;

        r = read_reservation(m, msg, &key, &bytes, &desc, &req, error);
        if (r < 0)
                return r;
        r = acquire_for(m, msg, key, true, &w, &ref, &res, error);
        if (r < 0)
                return r;
        if (res == FEATURE_ACQUIRE_PRODUCE) {
                r = feature_ref_reserve_in(ref, bytes, w->arena_mask, &desc, &req, &issue);
                if (r < 0) {
                        feature_ref_unclaim(ref);
                        feature_manager_arm_timer(fm); /* it may wait for a producer again */
                        return cache_error(m, r, key, error);
                }
                ref->feature->producer_uid = (uint32_t)w->object.owner->uid;
                /* (the timer was armed for its deadline by acquire_for()) */
        }
        /* The feature's size, before the answer: a refused one releases the reference. */
        uint64_t have = ref->feature->bytes;
        r = acquire_answer(fm, msg, method_acquire_or_reserve, w, ref, res, &req, error);
        if (r >= 0 && res == FEATURE_ACQUIRE_PRODUCE) {
                trace_step(m, w->object.owner, &req, TRACE_ACQUIRE_MISS, key, bytes, 0, NULL);
                trace_step(m, w->object.owner, &req, TRACE_ENCODE_START, key, bytes, 0, NULL);
        } else if (r >= 0 && res != FEATURE_ACQUIRE_LOADING) /* a read back's: when its bytes are back */
                trace_step(m, w->object.owner, &req, TRACE_ACQUIRE_HIT, key, have, 0, acquire_results[res]);
        return r;
}

/* Reserve's refusal for a key whose production through the caller's handle h failed. */
static int late_reserve_error(const FeatureHandle *h, const char *key, sd_bus_error *error) {
        char id[EPD_ID_STRING_MAX];
        const Feature *f = h->ref->feature;

        epd_id_to_string(&h->id, id);
        if (f->error == -ETIMEDOUT) {
                uint64_t ms = h->produce_timeout / USEC_PER_MSEC;
                return epd_bus_error(error, EPD_ERROR_STALE,
                                     "Production of feature '%.64s' through handle %s timed out after %" PRIu64
                                     ".%03" PRIu64 " s ([Features] ProduceTimeout=) and failed; release the handle "
                                     "and acquire the key again.",
                                     key, id, ms / 1000, ms % 1000);
        }
        return epd_bus_error(error, EPD_ERROR_STALE,
                             "Production of feature '%.64s' through handle %s failed (%s); release the handle and "
                             "acquire the key again.",
                             key, id, error_text(f->error));
}

static int method_reserve(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        FeatureManager *fm = feature_manager_get(m);
        _cleanup_(feature_desc_freep) FeatureDesc *desc = NULL;
        FeatureDescIssue issue;
        FeatureHandle *h = NULL;
        bool own = false;
        const char *key = NULL;
        uint64_t bytes = 0;
        EpdId req;
        Worker *w;
        Feature *f;
        int r;

        r = read_reservation(m, msg, &key, &bytes, &desc, &req, error);
        if (r < 0)
                return r;
        r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;

        /* The caller was told to produce by Acquire: reserve through that handle. */
        f = feature_cache_get(m->features, key);
        if (f && f->producer && f->producer->userdata &&
            ((FeatureHandle *)f->producer->userdata)->object.owner == w->object.owner) {
                h = f->producer->userdata;
                r = feature_ref_reserve_in(h->ref, bytes, w->arena_mask, &desc, &req, &issue);
                if (r == -EALREADY)
                        return epd_bus_error(error, EPD_ERROR_EXISTS, "Feature '%.64s' is already reserved.", key);
                if (r < 0)
                        return cache_error(m, r, key, error);
                h->ref->feature->producer_uid = (uint32_t)w->object.owner->uid;
        } else {
                FeatureRef *ref;
                /* The caller was told to produce, and its production failed meanwhile
                 * (past ProduceTimeout=, or failed): the key left the table, and a
                 * reservation now would be another feature under another handle, while
                 * the caller means the one it holds. */
                FeatureHandle *old = feature_manager_failed_producer(fm, w->object.owner, key);
                if (old)
                        return late_reserve_error(old, key, error);
                /* Before the reservation: it may evict cached features, and a key that
                 * is announced has waiters that a refused handle would fail. */
                r = client_object_room(w->object.owner);
                if (r < 0)
                        return client_error(r, error);
                r = feature_reserve_in(m->features, key, bytes, w->arena_mask, &desc, &req, &ref, &issue);
                if (r < 0)
                        return cache_error(m, r, key, error);
                r = feature_handle_new(fm, w->object.owner, ref, &h);
                if (r < 0) {
                        feature_ref_release(ref); /* out of memory only: room was asked above */
                        return client_error(r, error);
                }
                ref->feature->producer_uid = (uint32_t)w->object.owner->uid;
                feature_producing_start(m->features, ref->feature, now_usec(CLOCK_MONOTONIC));
                own = true;
        }
        feature_manager_arm_timer(fm);
        r = reply_info_as(fm, msg, h, own);
        if (r < 0 && own)
                feature_handle_release(h); /* the caller is refused: it never learns the handle */
        if (r < 0)
                return r;
        trace_step(m, w->object.owner, &req, TRACE_ENCODE_START, key, bytes, 0, NULL);
        return 1;
}

/* Publish and Fail: r is how ending the production went. The feature's new state was
 * journaled (docs/wal.md): the reply waits until it is durable. */
static int producer_ended(FeatureManager *fm, sd_bus_message *msg, const char *id, int r, sd_bus_error *error) {
        if (r == -EBADSLT)
                return epd_bus_error(error, EPD_ERROR_STALE, "Handle %s is not the producer of a reserved feature.",
                                     id);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_FAILED,
                                     "Handle %s: the feature's new state could not be journaled (%s); it stays "
                                     "reserved.",
                                     id, strerror(-r));
        return wal_manager_reply_empty(fm->manager, msg);
}

static int method_publish(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureManager *fm = feature_manager_get(userdata);
        FeatureHandle *h;
        const char *id;
        uint64_t encode_usec;
        int r;

        r = sd_bus_message_read(msg, "st", &id, &encode_usec);
        if (r < 0)
                return r;
        if (encode_usec > FEATURE_ENCODE_USEC_MAX)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "encode_usec must be at most %" PRIu64 " (one hour).",
                                     (uint64_t)FEATURE_ENCODE_USEC_MAX);
        r = handle_lookup(fm, msg, id, &h, error);
        if (r < 0)
                return r;
        r = feature_publish(h->ref, encode_usec);
        if (r >= 0) {
                Feature *f = h->ref->feature;
                feature_manager_count_publish(h);
                trace_step(fm->manager, h->object.owner, &f->request_id, TRACE_PUBLISH, f->key, f->bytes,
                           encode_usec, NULL);
        }
        return producer_ended(fm, msg, id, r, error);
}

static int method_fail(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureManager *fm = feature_manager_get(userdata);
        FeatureHandle *h;
        const char *id, *reason;
        int r;

        r = sd_bus_message_read(msg, "ss", &id, &reason);
        if (r < 0)
                return r;
        r = handle_lookup(fm, msg, id, &h, error);
        if (r < 0)
                return r;
        /* Taken before: a failed fresh feature may leave the cache with its handle. */
        bool producer = h->ref->kind == FEATURE_REF_PRODUCER;
        EpdId req = h->ref->feature->request_id;
        Client *by = h->object.owner; /* the client stays; the handle may go with the feature */
        char key[64], what[TRACE_DETAIL_MAX];
        snprintf(key, sizeof key, "%.63s", h->ref->feature->key);
        snprintf(what, sizeof what, "failed: %.32s", reason);
        if (producer)
                log_debug("Feature '%.64s' failed: %.200s", h->ref->feature->key, reason);
        r = feature_fail(h->ref, -ECANCELED);
        if (r >= 0 && producer)
                trace_step(fm->manager, by, &req, TRACE_ERROR, key, 0, 0, what);
        return producer_ended(fm, msg, id, r, error);
}

/* The one argument of Describe, Wait and Release: the caller's handle. */
static int read_handle(FeatureManager *fm, sd_bus_message *msg, const char **ret_id, FeatureHandle **ret,
                       sd_bus_error *error) {
        int r = sd_bus_message_read(msg, "s", ret_id);
        if (r < 0)
                return r;
        return handle_lookup(fm, msg, *ret_id, ret, error);
}

static int method_describe(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureManager *fm = feature_manager_get(userdata);
        FeatureHandle *h;
        const char *id;
        int r;

        r = read_handle(fm, msg, &id, &h, error);
        if (r < 0)
                return r;
        r = reply_info(fm, msg, h);
        return r < 0 ? r : 1;
}

/* Wait(handle): answered, as Describe, once the feature is READY or FAILED (at once if
 * it is already): the reader's one round trip, with no signal to watch and no Describe
 * after it. A later Wait on the same handle (the caller gave up on the first) takes the
 * earlier one's place. */
static int method_wait(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureManager *fm = feature_manager_get(userdata);
        FeatureHandle *h;
        const char *id;
        int r;

        r = read_handle(fm, msg, &id, &h, error);
        if (r < 0)
                return r;
        if (h->ref->feature->state != FEATURE_RESERVED) {
                r = reply_info(fm, msg, h);
                return r < 0 ? r : 1;
        }
        if (h->ref->kind != FEATURE_REF_READER)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Feature handle %s is not a reader's: its holder produces '%.64s' (Publish or "
                                     "Fail it) or pins it.",
                                     id, h->ref->feature->key);
        if (h->waiter) {
                if (h->waiter->done != wait_settled)
                        return epd_bus_error(error, EPD_ERROR_BUSY, "Feature handle %s is being answered already.", id);
                FeatureLoadWaiter *old = feature_handle_unwait(h);
                old->done(old, h, -ESTALE);
        }
        WaitCall *call = calloc(1, sizeof *call);
        if (!call)
                return -ENOMEM;
        *call = (WaitCall) { .waiter.done = wait_settled, .msg = sd_bus_message_ref(msg) };
        feature_handle_wait_load(h, &call->waiter);
        return 1;
}

static int method_release(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureManager *fm = feature_manager_get(userdata);
        FeatureHandle *h;
        const char *id;
        int r;

        r = read_handle(fm, msg, &id, &h, error);
        if (r < 0)
                return r;
        feature_handle_release(h);
        return sd_bus_reply_method_return(msg, NULL);
}

static int method_pin(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        FeatureManager *fm = feature_manager_get(m);
        char id[EPD_ID_STRING_MAX];
        FeatureHandle *h;
        FeatureRef *ref;
        const char *key;
        Worker *w;
        int r;

        r = sd_bus_message_read(msg, "s", &key);
        if (r < 0)
                return r;
        r = check_key(key, error);
        if (r < 0)
                return r;
        r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;
        r = feature_pin(m->features, key, &ref);
        if (r < 0)
                return cache_error(m, r, key, error);
        r = feature_handle_new(fm, w->object.owner, ref, &h);
        if (r < 0) {
                feature_ref_release(ref);
                return client_error(r, error);
        }
        return sd_bus_reply_method_return(msg, "s", epd_id_to_string(&h->id, id));
}

static const char *const prefetch_results[] = {
        [FEATURE_PREFETCH_PRESENT] = "present",
        [FEATURE_PREFETCH_LOADED] = "loaded",
        [FEATURE_PREFETCH_PENDING] = "pending",
        [FEATURE_PREFETCH_ANNOUNCED] = "announced",
};

static int method_prefetch(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        FeatureManager *fm = feature_manager_get(m);
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char **announced = NULL;
        char **keys = NULL;
        size_t n = 0, n_announced = 0;
        Worker *w;
        int r;

        r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;
        r = sd_bus_message_read_strv(msg, &keys);
        if (r < 0)
                return r;
        while (keys && keys[n])
                n++;
        if (n > PREFETCH_KEYS_MAX) {
                r = epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                  "At most %u keys per Prefetch.", PREFETCH_KEYS_MAX);
                goto finish;
        }
        for (size_t i = 0; i < n; i++)
                if (!feature_key_valid(keys[i])) {
                        r = check_key(keys[i], error);
                        goto finish;
                }
        announced = calloc(n + 1, sizeof *announced);
        if (!announced) {
                r = -ENOMEM;
                goto finish;
        }
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_open_container(reply, 'a', "s");
        for (size_t i = 0; r >= 0 && i < n; i++) {
                FeaturePrefetchResult res;
                int k = feature_prefetch(m->features, keys[i], now_usec(CLOCK_MONOTONIC), &res);
                if (k < 0) /* no room (or past a bound) is said apart from a failure */
                        r = sd_bus_message_append(reply, "s",
                                                  k == -ENOSPC || k == -E2BIG || k == -EUSERS || k == -EDQUOT
                                                          ? "no-space"
                                                          : "failed");
                else {
                        r = sd_bus_message_append(reply, "s", prefetch_results[res]);
                        if (res == FEATURE_PREFETCH_ANNOUNCED)
                                announced[n_announced++] = keys[i];
                }
        }
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        if (r >= 0)
                r = sd_bus_send(NULL, reply, NULL);
        feature_manager_arm_timer(fm);
        /* encoders listening for work start on these */
        for (size_t i = 0; r >= 0 && i < n_announced; i++)
                emit_wanted(m, announced[i]);
        if (r >= 0)
                r = 1;
finish:
        for (size_t i = 0; keys && keys[i]; i++)
                free(keys[i]);
        free(keys);
        free(announced);
        return r;
}

/* Properties: counters. */
#define STAT_PROPERTY(fn, field)                                                         \
        BUS_PROPERTY_GETTER(fn, Manager, m,                                              \
                            return sd_bus_message_append(reply, "t", feature_cache_stats(m->features)->field);)

STAT_PROPERTY(property_hits, hits)
STAT_PROPERTY(property_misses, misses)
STAT_PROPERTY(property_coalesced, coalesced_waits)
STAT_PROPERTY(property_produced, produced)
STAT_PROPERTY(property_failed, failed)
STAT_PROPERTY(property_evictions, evictions)
STAT_PROPERTY(property_spilled, spilled)
STAT_PROPERTY(property_loaded, loaded)
STAT_PROPERTY(property_read_back_timeouts, read_back_timeouts)
STAT_PROPERTY(property_produce_timeouts, produce_timeouts)
STAT_PROPERTY(property_prefetch_requests, prefetch_requests)
STAT_PROPERTY(property_prefetch_hits, prefetch_hits)
STAT_PROPERTY(property_saved, encoder_usec_saved)
STAT_PROPERTY(property_bytes_cached, bytes_cached)
STAT_PROPERTY(property_bytes_reserved, bytes_reserved)
STAT_PROPERTY(property_bytes_fenced, bytes_fenced)
STAT_PROPERTY(property_features, n_features)
STAT_PROPERTY(property_handles, n_refs)

/* The spill thread's counters (zeros without a store): what was written, failed to be
 * written, or dropped at eviction for want of room in its queue (or memory), and the
 * bytes queued now. */
#define SPILL_PROPERTY(fn, field)                                                                \
        BUS_PROPERTY_GETTER(fn, Manager, m, {                                                    \
                FeatureSpillerStats st = {};                                                     \
                FeatureManager *fm = feature_manager_get(m);                                     \
                if (fm && fm->spiller)                                                           \
                        feature_spiller_stats(fm->spiller, &st);                                 \
                return sd_bus_message_append(reply, "t", st.field);                              \
        })

SPILL_PROPERTY(property_spill_written, written)
SPILL_PROPERTY(property_spill_failed, failed)
SPILL_PROPERTY(property_spill_dropped, dropped)
SPILL_PROPERTY(property_spill_pending, pending_bytes)

static int property_budget(sd_bus *bus, const char *path, const char *interface,
                           const char *property, sd_bus_message *reply, void *userdata,
                           sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "t", feature_cache_budget(m->features));
}

static int property_store(sd_bus *bus, const char *path, const char *interface,
                          const char *property, sd_bus_message *reply, void *userdata,
                          sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "s",
                                     feature_manager_get(m)->store && m->config.feature_store_dir ? m->config.feature_store_dir : "");
}

#define STAT(name, fn) SD_BUS_PROPERTY(name, "t", fn, 0, 0)

static const sd_bus_vtable feature_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("CacheBytes", "t", property_budget, 0, SD_BUS_VTABLE_PROPERTY_EMITS_CHANGE),
        SD_BUS_PROPERTY("StoreDirectory", "s", property_store, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        STAT("Hits", property_hits),
        STAT("Misses", property_misses),
        STAT("CoalescedWaits", property_coalesced),
        STAT("Produced", property_produced),
        STAT("Failed", property_failed),
        STAT("Evictions", property_evictions),
        STAT("Spilled", property_spilled),
        STAT("SpillWritten", property_spill_written),
        STAT("SpillFailed", property_spill_failed),
        STAT("SpillDropped", property_spill_dropped),
        STAT("SpillPendingBytes", property_spill_pending),
        STAT("Loaded", property_loaded),
        STAT("ReadBackTimeouts", property_read_back_timeouts),
        STAT("ProduceTimeouts", property_produce_timeouts),
        STAT("PrefetchRequests", property_prefetch_requests),
        STAT("PrefetchHits", property_prefetch_hits),
        STAT("EncoderTimeSavedUSec", property_saved),
        STAT("BytesCached", property_bytes_cached),
        STAT("BytesReserved", property_bytes_reserved),
        STAT("BytesFenced", property_bytes_fenced),
        STAT("Features", property_features),
        STAT("Handles", property_handles),
        SD_BUS_METHOD_WITH_ARGS("Acquire",
                                SD_BUS_ARGS("s", key, "b", may_produce),
                                SD_BUS_RESULT("s", result, "s", handle, "s", state, "s", error,
                                              "s", arena, "t", offset, "t", bytes,
                                              "ay", descriptor, "s", request_id),
                                method_acquire, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("AcquireOrReserve",
                                SD_BUS_ARGS("s", key, "t", bytes, "ay", descriptor, "s", request_id),
                                SD_BUS_RESULT("s", result, "s", handle, "s", state, "s", error,
                                              "s", arena, "t", offset, "t", bytes,
                                              "ay", descriptor, "s", request_id),
                                method_acquire_or_reserve, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Reserve",
                                SD_BUS_ARGS("s", key, "t", bytes, "ay", descriptor, "s", request_id),
                                SD_BUS_RESULT("s", handle, "s", state, "s", error, "s", arena,
                                              "t", offset, "t", bytes, "ay", descriptor,
                                              "s", request_id),
                                method_reserve, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Publish", SD_BUS_ARGS("s", handle, "t", encode_usec),
                                SD_BUS_NO_RESULT, method_publish, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Fail", SD_BUS_ARGS("s", handle, "s", reason), SD_BUS_NO_RESULT,
                                method_fail, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Describe", SD_BUS_ARGS("s", handle),
                                SD_BUS_RESULT("s", handle, "s", state, "s", error, "s", arena,
                                              "t", offset, "t", bytes, "ay", descriptor,
                                              "s", request_id),
                                method_describe, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Wait", SD_BUS_ARGS("s", handle),
                                SD_BUS_RESULT("s", handle, "s", state, "s", error, "s", arena,
                                              "t", offset, "t", bytes, "ay", descriptor,
                                              "s", request_id),
                                method_wait, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Release", SD_BUS_ARGS("s", handle), SD_BUS_NO_RESULT,
                                method_release, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Pin", SD_BUS_ARGS("s", key), SD_BUS_RESULT("s", handle),
                                method_pin, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Prefetch", SD_BUS_ARGS("as", keys), SD_BUS_RESULT("as", results),
                                method_prefetch, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_SIGNAL_WITH_ARGS("FeatureReady", SD_BUS_ARGS("s", key, "s", state, "s", error), 0),
        SD_BUS_SIGNAL_WITH_ARGS("FeatureWanted", SD_BUS_ARGS("s", key), 0),
        SD_BUS_VTABLE_END,
};

int bus_feature_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, FEATURE_PATH, FEATURE_IFACE, feature_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Feature object: %m");
        return 0;
}
