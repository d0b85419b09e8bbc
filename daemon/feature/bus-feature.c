/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Feature at /org/epd1/feature: the feature cache on the bus. The cache itself
 * is pure (feature.c); this file holds the subsystem hooks, the per-client handles
 * (ClientObjects: a dying client releases them, and a producer that dies before
 * publishing fails its waiters at once), the FeatureReady/FeatureWanted signals, the
 * announce timer, and the vtable. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-objects.h"
#include "feature/feature-load.h"
#include "feature/feature-spill.h"
#include "feature/feature-store.h"
#include "feature/feature.h"
#include "hashmap.h"
#include "id.h"
#include "list.h"
#include "log.h"
#include "macro.h"
#include "core/manager.h"
#include "wal/wal-manager.h"
#include "core/worker.h"

#define FEATURE_PATH "/org/epd1/feature"
#define FEATURE_IFACE "org.epd1.Feature"
#define FEATURE_CHUNK_DEFAULT (64ULL << 10)
#define PREFETCH_KEYS_MAX 1024u
#define SPILL_PENDING_MAX (256ULL << 20) /* bytes copied and queued for the store */

typedef struct FeatureHandle FeatureHandle;

typedef struct FeatureBus {
        Manager *manager;
        FeatureStore *store;
        FeatureSpiller *spiller; /* writes evictions to the store off the event loop */
        Hashmap *handles;        /* FeatureHandle* by id bytes */
        sd_event_source *timer;  /* announce deadlines */
        FeatureLoader *loader;   /* reads spilled features back off the event loop */
        LIST_HEAD(FeatureHandle, pending); /* Acquires answered when their load ends */
} FeatureBus;

struct FeatureHandle {
        ClientObject object;
        FeatureBus *fb;
        EpdId id;
        FeatureRef *ref;
        sd_bus_message *pending; /* the Acquire, while its feature is read back */
        LIST_FIELDS(FeatureHandle, pending);
};

static int append_info(sd_bus_message *reply, FeatureBus *fb, FeatureHandle *h);
static void handle_release(ClientObject *o);

static FeatureBus *bus_of(Manager *m) {
        return m->features ? feature_cache_get_userdata(m->features) : NULL;
}

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

static void on_state(FeatureCache *c, Feature *f, void *userdata) {
        FeatureBus *fb = userdata;
        int r = manager_emit_signal(fb->manager, FEATURE_PATH, FEATURE_IFACE, "FeatureReady", "sss",
                                    f->key, feature_state_to_string(f->state),
                                    error_text(f->error));
        if (r < 0)
                log_debug_errno(r, "Cannot emit FeatureReady: %m");
        /* Acquires that waited for this feature's load: answered now. */
        FeatureHandle *next;
        for (FeatureHandle *h = fb->pending; h; h = next) {
                next = h->pending_next;
                if (h->ref->feature != f)
                        continue;
                _cleanup_(sd_bus_message_unrefp) sd_bus_message *msg = TAKE_PTR(h->pending);
                LIST_REMOVE(pending, fb->pending, h);
                if (f->state == FEATURE_READY) {
                        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
                        r = sd_bus_message_new_method_return(msg, &reply);
                        if (r >= 0)
                                r = sd_bus_message_append(reply, "s", "hit");
                        if (r >= 0)
                                r = append_info(reply, fb, h);
                        if (r >= 0)
                                r = sd_bus_send(NULL, reply, NULL);
                        if (r >= 0)
                                continue;
                        log_debug_errno(r, "Cannot answer an Acquire of %.64s: %m", f->key);
                } else
                        (void)sd_bus_reply_method_errorf(msg, EPD_ERROR_FAILED,
                                                         "Feature '%.64s' could not be read back from the store (%s); the stored copy was removed, acquire it again to produce it.",
                                                         f->key, strerror(-f->error));
                /* The caller never learnt this handle. */
                handle_release(&h->object);
        }
}

static int on_timer(sd_event_source *s, uint64_t usec, void *userdata);

static void timer_arm(FeatureBus *fb, usec_t next) {
        if (next == USEC_INFINITY) {
                if (fb->timer)
                        (void)sd_event_source_set_enabled(fb->timer, SD_EVENT_OFF);
                return;
        }
        if (!fb->timer) {
                int r = sd_event_add_time(fb->manager->event, &fb->timer, CLOCK_MONOTONIC, next,
                                          10 * USEC_PER_MSEC, on_timer, fb);
                if (r < 0)
                        log_warning_errno(r, "Cannot arm the feature announce timer: %m");
                return;
        }
        (void)sd_event_source_set_time(fb->timer, next);
        (void)sd_event_source_set_enabled(fb->timer, SD_EVENT_ONESHOT);
}

static int on_timer(sd_event_source *s, uint64_t usec, void *userdata) {
        FeatureBus *fb = userdata;
        timer_arm(fb, feature_cache_expire(fb->manager->features, now_usec(CLOCK_MONOTONIC)));
        return 0;
}

/* Handles. */

static void handle_release(ClientObject *o) {
        FeatureHandle *h = container_of(o, FeatureHandle, object);
        if (h->pending) {
                LIST_REMOVE(pending, h->fb->pending, h);
                h->pending = sd_bus_message_unref(h->pending);
        }
        client_object_unlink(o);
        hashmap_remove(h->fb->handles, &h->id);
        feature_ref_release(h->ref); /* a producer's release fails its waiters */
        free(h);
}

static int handle_new(FeatureBus *fb, Client *c, FeatureRef *ref, FeatureHandle **ret) {
        FeatureHandle *h = calloc(1, sizeof *h);
        int r;

        if (!h)
                return -ENOMEM;
        h->fb = fb;
        h->ref = ref;
        r = epd_id_random(&h->id);
        if (r >= 0)
                r = client_object_link(c, &h->object,
                                       ref->kind == FEATURE_REF_PIN ? CLIENT_OBJECT_PIN
                                                                    : CLIENT_OBJECT_FEATURE_REF,
                                       handle_release);
        if (r < 0) {
                free(h);
                return r;
        }
        r = hashmap_put(fb->handles, &h->id, h);
        if (r < 0) {
                client_object_unlink(&h->object);
                free(h);
                return r;
        }
        ref->userdata = h;
        *ret = h;
        return 0;
}

/* The caller's handle named by id_str, or a named error. */
static int handle_lookup(FeatureBus *fb, sd_bus_message *msg, const char *id_str,
                         FeatureHandle **ret, sd_bus_error *error) {
        EpdId id;
        FeatureHandle *h;

        if (epd_id_from_string(id_str, &id) < 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "'%.64s' is not a handle.", id_str);
        h = hashmap_get(fb->handles, &id);
        if (!h)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No feature handle %s.", id_str);
        if (h->object.owner != manager_client_lookup_message(fb->manager, msg))
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "Feature handle %s belongs to another client.", id_str);
        *ret = h;
        return 0;
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

static int cache_error(int r, const char *key, sd_bus_error *error) {
        switch (r) {
        case -EUSERS:
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "Too many feature handles in the daemon.");
        case -ENOSPC:
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

/* (handle, state, error, arena, offset, bytes, descriptor, request id) */
#define FEATURE_INFO_TYPES "sssstayss"

static int append_info(sd_bus_message *reply, FeatureBus *fb, FeatureHandle *h) {
        Feature *f = h->ref->feature;
        _cleanup_(freep) void *desc = NULL;
        size_t desc_len = 0;
        char id[EPD_ID_STRING_MAX], req[EPD_ID_STRING_MAX] = "";
        const char *arena = "";
        int r;

        if (f->has_region && f->arena < fb->manager->n_arenas)
                arena = fb->manager->arenas[f->arena]->name;
        if (f->desc) {
                r = feature_desc_serialize(f->desc, &desc, &desc_len);
                if (r < 0)
                        return r;
        }
        if (!epd_id_is_null(&f->request_id))
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

static const char *const acquire_results[] = {
        [FEATURE_ACQUIRE_HIT] = "hit",
        [FEATURE_ACQUIRE_WAIT] = "wait",
        [FEATURE_ACQUIRE_PRODUCE] = "produce",
        [FEATURE_ACQUIRE_LOADING] = "hit", /* answered once loaded */
};

static int method_acquire(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        FeatureBus *fb = bus_of(m);
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        FeatureAcquireResult res;
        FeatureHandle *h;
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
        r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;
        r = feature_acquire(m->features, key, may_produce, now_usec(CLOCK_MONOTONIC), &ref, &res);
        if (r < 0)
                return cache_error(r, key, error);
        r = handle_new(fb, w->object.owner, ref, &h);
        if (r < 0) {
                feature_ref_release(ref);
                return client_error(r, error);
        }
        if (res == FEATURE_ACQUIRE_LOADING) {
                /* Read back off the loop; on_state() answers. */
                h->pending = sd_bus_message_ref(msg);
                LIST_PREPEND(pending, fb->pending, h);
                return 1;
        }
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "s", acquire_results[res]);
        if (r >= 0)
                r = append_info(reply, fb, h);
        if (r >= 0)
                r = sd_bus_send(NULL, reply, NULL);
        if (r < 0) {
                handle_release(&h->object);
                return r;
        }
        return 1;
}

static int method_reserve(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        FeatureBus *fb = bus_of(m);
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        _cleanup_(feature_desc_freep) FeatureDesc *desc = NULL;
        FeatureDescIssue issue;
        FeatureHandle *h = NULL;
        const char *key, *req_str;
        const void *bin;
        size_t bin_len;
        uint64_t bytes;
        EpdId req = {};
        Worker *w;
        Feature *f;
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
        if (req_str[0] && epd_id_from_string(req_str, &req) < 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "request_id must be 32 hex digits or empty.");
        if (bin_len > FEATURE_DESC_BINARY_MAX)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Descriptor too long.");
        r = feature_desc_parse(bin, bin_len, bytes, &desc, &issue);
        if (r < 0) {
                char text[256];
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Bad descriptor: %s.",
                                     feature_desc_issue_format(&issue, NULL, text, sizeof text));
        }
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
                        return cache_error(r, key, error);
        } else {
                FeatureRef *ref;
                r = feature_reserve_in(m->features, key, bytes, w->arena_mask, &desc, &req, &ref, &issue);
                if (r < 0)
                        return cache_error(r, key, error);
                r = handle_new(fb, w->object.owner, ref, &h);
                if (r < 0) {
                        feature_ref_release(ref); /* fails it: nobody waited yet */
                        return client_error(r, error);
                }
        }
        timer_arm(fb, feature_cache_expire(m->features, now_usec(CLOCK_MONOTONIC)));

        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = append_info(reply, fb, h);
        if (r >= 0)
                r = sd_bus_send(NULL, reply, NULL);
        return r < 0 ? r : 1;
}

static int method_publish(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureBus *fb = bus_of(userdata);
        FeatureHandle *h;
        const char *id;
        uint64_t encode_usec;
        int r;

        r = sd_bus_message_read(msg, "st", &id, &encode_usec);
        if (r < 0)
                return r;
        r = handle_lookup(fb, msg, id, &h, error);
        if (r < 0)
                return r;
        r = feature_publish(h->ref, encode_usec);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_STALE,
                                     "Handle %s is not the producer of a reserved feature.", id);
        /* READY was journaled (docs/wal.md): the reply waits until it is durable. */
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        return wal_manager_reply(fb->manager, msg, reply);
}

static int method_fail(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureBus *fb = bus_of(userdata);
        FeatureHandle *h;
        const char *id, *reason;
        int r;

        r = sd_bus_message_read(msg, "ss", &id, &reason);
        if (r < 0)
                return r;
        r = handle_lookup(fb, msg, id, &h, error);
        if (r < 0)
                return r;
        if (h->ref->kind == FEATURE_REF_PRODUCER)
                log_debug("Feature '%.64s' failed: %.200s", h->ref->feature->key, reason);
        r = feature_fail(h->ref, -ECANCELED);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_STALE,
                                     "Handle %s is not the producer of a reserved feature.", id);
        /* READY was journaled (docs/wal.md): the reply waits until it is durable. */
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        return wal_manager_reply(fb->manager, msg, reply);
}

static int method_describe(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureBus *fb = bus_of(userdata);
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        FeatureHandle *h;
        const char *id;
        int r;

        r = sd_bus_message_read(msg, "s", &id);
        if (r < 0)
                return r;
        r = handle_lookup(fb, msg, id, &h, error);
        if (r < 0)
                return r;
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = append_info(reply, fb, h);
        if (r >= 0)
                r = sd_bus_send(NULL, reply, NULL);
        return r < 0 ? r : 1;
}

static int method_release(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        FeatureBus *fb = bus_of(userdata);
        FeatureHandle *h;
        const char *id;
        int r;

        r = sd_bus_message_read(msg, "s", &id);
        if (r < 0)
                return r;
        r = handle_lookup(fb, msg, id, &h, error);
        if (r < 0)
                return r;
        handle_release(&h->object);
        return sd_bus_reply_method_return(msg, NULL);
}

static int method_pin(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        FeatureBus *fb = bus_of(m);
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
                return cache_error(r, key, error);
        r = handle_new(fb, w->object.owner, ref, &h);
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
        FeatureBus *fb = bus_of(m);
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
                if (k < 0)
                        r = sd_bus_message_append(reply, "s", "no-space");
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
        timer_arm(fb, feature_cache_expire(m->features, now_usec(CLOCK_MONOTONIC)));
        /* encoders listening for work start on these */
        for (size_t i = 0; r >= 0 && i < n_announced; i++) {
                int k = manager_emit_signal(m, FEATURE_PATH, FEATURE_IFACE, "FeatureWanted", "s",
                                            announced[i]);
                if (k < 0)
                        log_debug_errno(k, "Cannot emit FeatureWanted: %m");
        }
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
STAT_PROPERTY(property_prefetch_requests, prefetch_requests)
STAT_PROPERTY(property_prefetch_hits, prefetch_hits)
STAT_PROPERTY(property_saved, encoder_usec_saved)
STAT_PROPERTY(property_bytes_cached, bytes_cached)
STAT_PROPERTY(property_bytes_reserved, bytes_reserved)
STAT_PROPERTY(property_features, n_features)
STAT_PROPERTY(property_handles, n_refs)

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
                                     bus_of(m)->store && m->config.feature_store_dir ? m->config.feature_store_dir : "");
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
        STAT("Loaded", property_loaded),
        STAT("PrefetchRequests", property_prefetch_requests),
        STAT("PrefetchHits", property_prefetch_hits),
        STAT("EncoderTimeSavedUSec", property_saved),
        STAT("BytesCached", property_bytes_cached),
        STAT("BytesReserved", property_bytes_reserved),
        STAT("Features", property_features),
        STAT("Handles", property_handles),
        SD_BUS_METHOD_WITH_ARGS("Acquire",
                                SD_BUS_ARGS("s", key, "b", may_produce),
                                SD_BUS_RESULT("s", result, "s", handle, "s", state, "s", error,
                                              "s", arena, "t", offset, "t", bytes,
                                              "ay", descriptor, "s", request_id),
                                method_acquire, SD_BUS_VTABLE_UNPRIVILEGED),
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

/* Subsystem hooks. */

static int feature_init(Manager *m) {
        _cleanup_(feature_cache_freep) FeatureCache *c = NULL;
        FeatureBus *fb;
        int r;

        r = feature_cache_new(&(FeatureCacheConfig){ .budget_bytes = m->config.feature_cache_bytes }, &c);
        if (r < 0)
                return log_error_errno(r, "Cannot create the feature cache: %m");
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (a->usage != ARENA_USAGE_FEATURE)
                        continue;
                uint64_t chunk = a->index < m->config.n_arenas ? m->config.arenas[a->index].page_size : 0;
                r = feature_cache_add_arena(c, a->index, a->domain == MEMORY_HOST ? a->base : NULL,
                                            a->data_offset, arena_data_size(a),
                                            chunk ? chunk : FEATURE_CHUNK_DEFAULT);
                if (r < 0)
                        return log_error_errno(r, "Arena '%s': cannot use it for features: %m", a->name);
        }
        fb = calloc(1, sizeof *fb);
        if (!fb)
                return log_oom();
        fb->manager = m;
        fb->handles = hashmap_new(HASHMAP_KEY_BYTES, sizeof(EpdId));
        if (!fb->handles) {
                free(fb);
                return log_oom();
        }
        if (m->config.feature_store_dir) {
                r = feature_store_open(m->config.feature_store_dir, m->config.feature_store_max_bytes,
                                       &fb->store);
                if (r < 0) {
                        hashmap_free(fb->handles);
                        free(fb);
                        return log_error_errno(r, "Feature store %s: %m", m->config.feature_store_dir);
                }
                r = feature_spiller_new(fb->store, MIN(SPILL_PENDING_MAX, m->config.feature_cache_bytes),
                                        &fb->spiller);
                if (r < 0) {
                        feature_store_free(fb->store);
                        hashmap_free(fb->handles);
                        free(fb);
                        return log_error_errno(r, "Cannot start the feature spill thread: %m");
                }
                r = feature_loader_new(m->event, fb->store, &fb->loader);
                if (r < 0) {
                        feature_spiller_free(fb->spiller);
                        feature_store_free(fb->store);
                        hashmap_free(fb->handles);
                        free(fb);
                        return log_error_errno(r, "Cannot start the feature load thread: %m");
                }
                feature_cache_set_store(c, fb->store);
                feature_cache_set_spill(c, feature_spiller_queue, fb->spiller);
                feature_cache_set_loader(c, feature_loader_queue, fb->loader);
        }
        feature_cache_set_callback(c, on_state, fb);
        m->features = TAKE_PTR(c);
        return 0;
}

static void feature_done(Manager *m) {
        FeatureBus *fb = bus_of(m);

        if (!fb)
                return;
        /* Clients (and with them every handle) are gone by now. The load thread stops
         * before the cache (and the regions it reads into) goes. */
        fb->loader = feature_loader_free(fb->loader);
        m->features = feature_cache_free(m->features);
        sd_event_source_disable_unref(fb->timer);
        feature_spiller_free(fb->spiller); /* writes what is queued */
        feature_store_free(fb->store);
        hashmap_free(fb->handles);
        free(fb);
}

static int feature_add_bus(Manager *m, sd_bus *bus) {
        int r = sd_bus_add_object_vtable(bus, NULL, FEATURE_PATH, FEATURE_IFACE, feature_vtable, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Feature object: %m");
        return 0;
}

static int feature_reload(Manager *m, const Config *n) {
        if ((n->feature_store_dir || m->config.feature_store_dir) &&
            (!n->feature_store_dir || !m->config.feature_store_dir ||
             strcmp(n->feature_store_dir, m->config.feature_store_dir) != 0))
                log_notice("[Features] StoreDirectory= changes take effect at the next start.");
        if (n->feature_cache_bytes != feature_cache_budget(m->features)) {
                feature_cache_set_budget(m->features, n->feature_cache_bytes);
                manager_emit_changed(m, FEATURE_PATH, FEATURE_IFACE, "CacheBytes");
        }
        return 0;
}

static int feature_apply_record(Manager *m, uint16_t type, const void *payload, size_t len) {
        return m->features ? feature_cache_apply_record(m->features, type, payload, len) : 0;
}

static int feature_journal(FeatureCache *c, uint16_t rec, const void *payload, size_t len, void *userdata) {
        Manager *m = userdata;
        /* What is dropped while stopping stays in the WAL for the next start. */
        if (m->stopping)
                return 0;
        int r = wal_manager_append(m, WAL_RECORD_FEATURE + rec, payload, len);
        return r == -ENOTCONN ? 0 : r;
}

/* Replay is done: journal from now on, and forget what was journaled in arenas whose
 * memory did not survive the restart. */
static int feature_restore_finish(Manager *m) {
        if (!m->features)
                return 0;
        feature_cache_set_journal(m->features, feature_journal, m);
        for (size_t i = 0; i < m->n_arenas; i++)
                if (!m->arenas[i]->adopted && feature_cache_drop_arena(m->features, (uint32_t)i) > 0)
                        log_info("Arena %s: journaled features dropped: its memory did not survive (no fd store).",
                                 m->arenas[i]->name);
        return 0;
}

static int feature_snapshot(Manager *m, SubsystemSnapshotAdd add, void *userdata) {
        return m->features ? feature_cache_snapshot(m->features, add, userdata, WAL_RECORD_FEATURE) : 0;
}

const Subsystem feature_subsystem = {
        .name = "features",
        .init = feature_init,
        .done = feature_done,
        .add_bus = feature_add_bus,
        .reload = feature_reload,
        .journal_families = (const uint8_t[]){ WAL_RECORD_FEATURE >> 8, 0 },
        .apply_record = feature_apply_record,
        .restore_finish = feature_restore_finish,
        .snapshot = feature_snapshot,
};
