/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Scheduler at /org/epd1 (dbus/org.epd1.Scheduler.xml): vtable glue only. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/bus-dict.h"
#include "core/bus-manager.h"
#include "core/client.h"
#include "core/worker.h"
#include "log.h"
#include "sched/scheduler-manager.h"
#include "telemetry/telemetry-manager.h"

#define WORKER_PREFIX "/org/epd1/worker/"

static int worker_path(char *buf, size_t n, const char *id) {
        if (!id)
                return snprintf(buf, n, "/");
        return snprintf(buf, n, WORKER_PREFIX "%s", id);
}

/* A request's images: each key is looked up on the loop at Admit. */
#define SCHED_FEATURE_KEYS_MAX 1024U

typedef struct Hints {
        uint64_t pages_needed;
        bool multimodal;
        char **feature_keys;
        bool feature_keys_given;
} Hints;

static int read_hints(Manager *m, sd_bus_message *msg, SchedHints *h, SchedulerAffinity *aff,
                      sd_bus_error *error) {
        static const BusDictItem items[] = {
                BUS_DICT("PagesNeeded", "t", Hints, pages_needed),
                BUS_DICT("Multimodal", "b", Hints, multimodal),
                BUS_DICT_FLAG("FeatureKeys", "as", Hints, feature_keys, feature_keys_given),
                {},
        };
        Hints x = {};
        int r = bus_dict_read(msg, items, &x, "hint", error);
        size_t n_keys = 0;
        while (r >= 0 && x.feature_keys && x.feature_keys[n_keys])
                n_keys++;
        if (n_keys > SCHED_FEATURE_KEYS_MAX)
                r = epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "At most %u FeatureKeys, not %zu.",
                                  SCHED_FEATURE_KEYS_MAX, n_keys);
        if (r >= 0) {
                h->pages_needed = x.pages_needed;
                h->needs_encoder = x.multimodal;
                if (x.feature_keys_given) {
                        aff->features_cached = scheduler_features_cached(m, x.feature_keys);
                        h->affinity_key = aff;
                }
        }
        bus_dict_strv_free(x.feature_keys);
        return r;
}

static int method_admit(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *request_id, *type;
        uint64_t deadline_rel;
        SchedHints hints = {};
        SchedulerAffinity aff = {};
        SchedDecision d;
        TaskType t;
        int r;

        Client *c, *owner;
        r = sd_bus_message_read(msg, "sst", &request_id, &type, &deadline_rel);
        if (r < 0)
                return r;
        r = read_hints(m, msg, &hints, &aff, error);
        if (r < 0)
                return r;
        /* The request will be the caller's: refused when who it is cannot be read. */
        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        bool outstanding = scheduler_request_owner(m, request_id, &owner) >= 0;
        if (outstanding && owner && owner != c)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "Request %s was admitted by another client.", request_id);
        if (!outstanding && c->n_objects[CLIENT_OBJECT_REQUEST] >= m->config.max_requests_per_client)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "This client has %u requests outstanding, the most [Limits] "
                                     "MaxRequestsPerClient= allows.", c->n_objects[CLIENT_OBJECT_REQUEST]);
        /* The request would be a new object of the caller's: asked before the scheduler
         * decides anything. Admitted, then cancelled when it could not be the caller's,
         * it moved everyone's pool counters and rho and pushed other requests back. */
        r = outstanding ? 0 : client_object_room(c);
        if (r == -EDQUOT)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "This client holds %u objects, the most [Limits] MaxObjectsPerClient= allows; "
                                     "request %s is not admitted.", m->config.max_objects_per_client, request_id);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_FAILED, "This client is going away; request %s is not admitted.",
                                     request_id);
        t = task_type_from_string(type);
        if (t < 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Unknown task type '%s' (thinking, interactive or hybrid).", type);
        usec_t now = now_usec(CLOCK_MONOTONIC);
        if (deadline_rel > 24ULL * 3600 * USEC_PER_SEC)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Deadline beyond one day.");
        scheduler_refresh_pages(m);
        r = sched_admit(m->scheduler, request_id, t, deadline_rel > 0 ? now + deadline_rel : 0, &hints, now, &d);
        if (r == -EINVAL)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Invalid request id (1 to %d printable characters).", SCHED_REQUEST_ID_MAX);
        if (r == -EEXIST)
                return epd_bus_error(error, EPD_ERROR_EXISTS,
                                     "Request %s is outstanding with another task type.", request_id);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_FAILED, "Cannot admit request %s: %s", request_id,
                                     strerror(-r));
        /* Newly outstanding (admitted): it belongs to the caller from now on. */
        if (!outstanding && scheduler_request_owner(m, request_id, &owner) >= 0 && !owner) {
                r = scheduler_own_request(m, request_id, c);
                if (r == -EDQUOT) /* room was asked above: not expected */
                        return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                             "This client holds as many objects as [Limits] allows.");
                if (r < 0) /* the request was cancelled: nobody would own it */
                        return epd_bus_error(error, EPD_ERROR_FAILED,
                                             "Request %s was admitted but cannot be made this client's (%s); it "
                                             "was cancelled.", request_id, strerror(-r));
        }

        /* The request's trace: the verdict and why (backpressure on its own), the time it
         * is predicted to take or to wait. */
        char what[TRACE_DETAIL_MAX];
        snprintf(what, sizeof what, "%s %s%s%s", type, sched_verdict_to_string(d.verdict),
                 d.verdict == SCHED_ADMIT ? "" : ": ",
                 d.verdict == SCHED_ADMIT ? "" : sched_reason_to_string(d.reason));
        (void)telemetry_trace(m, request_id, d.reason == SCHED_REASON_BACKPRESSURE ? TRACE_BACKPRESSURE : TRACE_ADMIT,
                              &(TraceDetail) { .detail = what,
                                               .duration_usec = d.verdict == SCHED_ADMIT ? d.predicted
                                                                                                : d.retry_after,
                                               .has_uid = true, .uid = (uint32_t)c->uid });

        char p[_SCHED_STAGE_MAX][128];
        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                worker_path(p[st], sizeof p[st], d.worker[st]);
        return sd_bus_reply_method_return(msg, "sstti" "ooo", sched_verdict_to_string(d.verdict),
                                          sched_reason_to_string(d.reason), (uint64_t)d.retry_after,
                                          (uint64_t)d.predicted, (int32_t)d.priority, p[SCHED_STAGE_ENCODE],
                                          p[SCHED_STAGE_PREFILL], p[SCHED_STAGE_DECODE]);
}

static int method_complete(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *request_id, *stage;
        uint64_t service;
        int ok, r;

        r = sd_bus_message_read(msg, "sstb", &request_id, &stage, &service, &ok);
        if (r < 0)
                return r;
        SchedStage st = sched_stage_from_string(stage);
        if (st < 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Unknown stage '%s' (encode, prefill or decode).", stage);
        /* A stage is reported by the client that admitted the request, the worker the
         * stage was given to, or root; nobody else. */
        Client *c, *owner;
        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        if (scheduler_request_owner(m, request_id, &owner) >= 0 && owner && owner != c && c->uid != 0) {
                const char *assigned = sched_request_stage_worker(m->scheduler, request_id, st);
                Worker *w = client_get_worker(c);
                /* A stage already reported (its worker repeating itself) or never needed
                 * is not outstanding, whoever asks. */
                if (!assigned)
                        return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No outstanding %s stage of request %s.",
                                             stage, request_id);
                if (!w || strcmp(assigned, w->id_str) != 0)
                        return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                             "Request %s was admitted by another client and its %s stage "
                                             "was not given to this worker.", request_id, stage);
        }
        r = sched_complete(m->scheduler, request_id, st, service, ok, now_usec(CLOCK_MONOTONIC));
        if (r == -ENOENT)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND,
                                     "No outstanding %s stage of request %s.", stage, request_id);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_FAILED, "Cannot complete the %s stage of request %s: %s", stage,
                                     request_id, strerror(-r));
        char what[TRACE_DETAIL_MAX];
        snprintf(what, sizeof what, "%s %s", stage, ok ? "done" : "failed");
        (void)telemetry_trace(m, request_id, ok ? TRACE_STAGE_DONE : TRACE_ERROR,
                              &(TraceDetail) { .detail = what, .duration_usec = service, .has_uid = true,
                                               .uid = (uint32_t)c->uid });
        return sd_bus_reply_method_return(msg, NULL);
}

typedef struct WorkerOptions {
        uint32_t slots, queue_limit;
        uint64_t free_pages;
        bool have_pages;
        const char *host;
        char **pools;
} WorkerOptions;

static void worker_options_done(WorkerOptions *o) {
        bus_dict_strv_free(o->pools);
}

static int method_configure_worker(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        unsigned pools = 0;
        int r;

        Worker *w;
        r = bus_read_worker(m, msg, true, &w, error);
        if (r < 0)
                return r;

        static const BusDictItem items[] = {
                BUS_DICT("Slots", "u", WorkerOptions, slots),
                BUS_DICT("QueueLimit", "u", WorkerOptions, queue_limit),
                BUS_DICT_FLAG("FreePages", "t", WorkerOptions, free_pages, have_pages),
                BUS_DICT("Host", "s", WorkerOptions, host),
                BUS_DICT("Pools", "as", WorkerOptions, pools),
                {},
        };
        _cleanup_(worker_options_done) WorkerOptions o = {};
        r = bus_dict_read(msg, items, &o, "option", error);
        if (r < 0)
                return r;
        for (char **i = o.pools; i && *i; i++) {
                TaskType t = task_type_from_string(*i);
                if (t < 0)
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Unknown pool '%s'.", *i);
                pools |= 1u << t;
        }
        uint32_t slots = o.slots, queue_limit = o.queue_limit;
        uint64_t free_pages = o.free_pages;
        bool have_pages = o.have_pages;
        const char *host = o.host;

        /* Every option is checked before any is applied: a call refused for its
         * arguments changes nothing (an internal failure below, out of memory, may leave
         * the options before it applied; its error says which failed). */
        if (slots > 65536 || queue_limit > (1u << 20))
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Slots must be 1..65536 and QueueLimit at most 1048576 (got %" PRIu32
                                     " and %" PRIu32 ").", slots, queue_limit);

        /* Each option given changes what it names, in place: the worker's admitted
         * requests run there already and stay; new ones see the new capacity. An option
         * not given is left as it is (Pools= given once stays until given again). The
         * Host setter checks the id before it changes anything, so it goes first. */
        if (host) {
                r = scheduler_set_worker_host(m, w->id_str, host);
                if (r == -EINVAL)
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Host '%s' is not a host id.", host);
                if (r < 0)
                        return epd_bus_error(error, EPD_ERROR_FAILED, "Cannot set worker %s's host to '%s': %s",
                                             w->id_str, host, r == -ENOTCONN ? "the scheduler is not running"
                                                                             : strerror(-r));
        }
        unsigned stages = scheduler_stages_of_role(w->role);
        if (pools != 0) {
                /* Pools= narrows what the [Pool:NAME] selectors give the worker. */
                r = scheduler_set_pool_override(m, w, pools);
                if (r < 0)
                        return epd_bus_error(error, EPD_ERROR_FAILED, "Cannot set worker %s's pools: %s", w->id_str,
                                             r == -ENOTCONN ? "the scheduler is not running" : strerror(-r));
        }
        for (int st = 0; st < _SCHED_STAGE_MAX; st++) {
                if (!(stages & (1u << st)))
                        continue;
                if (slots > 0 || queue_limit > 0) {
                        r = sched_worker_set_capacity(m->scheduler, w->id_str, (SchedStage)st, slots, queue_limit);
                        if (r < 0)
                                return epd_bus_error(error, EPD_ERROR_FAILED, "Cannot change worker %s's capacity: %s",
                                                     w->id_str, strerror(-r));
                }
                if (pools != 0) {
                        r = sched_worker_set_pools(m->scheduler, w->id_str, (SchedStage)st,
                                                   scheduler_worker_pools(m, w, (SchedStage)st));
                        if (r < 0)
                                return epd_bus_error(error, EPD_ERROR_FAILED, "Cannot change worker %s's pools: %s",
                                                     w->id_str, strerror(-r));
                }
        }
        if (have_pages && (stages & (1u << SCHED_STAGE_DECODE)))
                (void)sched_worker_set_free_pages(m->scheduler, w->id_str, free_pages);
        return sd_bus_reply_method_return(msg, NULL);
}

static int property_pools(sd_bus *bus, const char *path, const char *interface, const char *property,
                          sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        usec_t now = now_usec(CLOCK_MONOTONIC);
        int r = sd_bus_message_open_container(reply, 'a', "(suuddddttttttt)");
        for (int t = 0; r >= 0 && t < _TASK_TYPE_MAX; t++) {
                SchedPoolMetrics pm;
                sched_pool_metrics(m->scheduler, (TaskType)t, now, &pm);
                r = sd_bus_message_append(reply, "(suuddddttttttt)", task_type_to_string(t), pm.queue,
                                          pm.queue_peak, pm.arrival_rate, pm.service_rate, pm.capacity,
                                          pm.rho, pm.admitted, pm.deferred, pm.rejected, pm.completed,
                                          pm.failed, pm.deadline_misses, pm.expired);
        }
        if (r < 0)
                return r;
        return sd_bus_message_close_container(reply);
}

static int property_reasons(sd_bus *bus, const char *path, const char *interface, const char *property,
                            sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        int r = sd_bus_message_open_container(reply, 'a', "(sst)");
        for (int t = 0; r >= 0 && t < _TASK_TYPE_MAX; t++) {
                SchedPoolMetrics pm;
                sched_pool_metrics(m->scheduler, (TaskType)t, now_usec(CLOCK_MONOTONIC), &pm);
                for (int k = 1; r >= 0 && k < _SCHED_REASON_MAX; k++)
                        if (pm.by_reason[k] > 0)
                                r = sd_bus_message_append(reply, "(sst)", task_type_to_string(t),
                                                          sched_reason_to_string(k), pm.by_reason[k]);
        }
        if (r < 0)
                return r;
        return sd_bus_message_close_container(reply);
}

static int property_outstanding(sd_bus *bus, const char *path, const char *interface,
                                const char *property, sd_bus_message *reply, void *userdata,
                                sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "u", sched_outstanding(m->scheduler));
}

static const sd_bus_vtable scheduler_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Pools", "a(suuddddttttttt)", property_pools, 0, 0),
        SD_BUS_PROPERTY("Reasons", "a(sst)", property_reasons, 0, 0),
        SD_BUS_PROPERTY("Outstanding", "u", property_outstanding, 0, 0),
        SD_BUS_METHOD_WITH_ARGS("Admit",
                                SD_BUS_ARGS("s", request_id, "s", task_type, "t", deadline_usec, "a{sv}", hints),
                                SD_BUS_RESULT("s", verdict, "s", reason, "t", retry_after_usec, "t",
                                              predicted_usec, "i", priority, "o", encoder, "o", prefill, "o",
                                              decode),
                                method_admit, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Complete",
                                SD_BUS_ARGS("s", request_id, "s", stage, "t", service_usec, "b", ok),
                                SD_BUS_NO_RESULT, method_complete, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("ConfigureWorker", SD_BUS_ARGS("o", worker, "a{sv}", options),
                                SD_BUS_NO_RESULT, method_configure_worker, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_VTABLE_END,
};

int bus_scheduler_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, "/org/epd1", "org.epd1.Scheduler", scheduler_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Scheduler interface: %m");
        return 0;
}
