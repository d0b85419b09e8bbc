/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/client.h"
#include "core/worker.h"
#include "feature/feature.h"
#include "handoff/handoff-manager.h"
#include "hashmap.h"
#include "log.h"
#include "pages/pages.h"
#include "peer/peer-manager.h"
#include "sched/pool-select.h"
#include "sched/scheduler-manager.h"
#include "telemetry/telemetry-manager.h"

#define EXPIRE_INTERVAL_USEC (1 * USEC_PER_SEC)
#define WORKER_SLOTS_DEFAULT 8u

unsigned scheduler_stages_of_role(int role) {
        switch (role) {
        case WORKER_ENCODER:
                return 1u << SCHED_STAGE_ENCODE;
        case WORKER_PREFILL:
                return 1u << SCHED_STAGE_PREFILL;
        case WORKER_DECODE:
                return 1u << SCHED_STAGE_DECODE;
        case WORKER_COLOCATED:
                return 1u << SCHED_STAGE_PREFILL | 1u << SCHED_STAGE_DECODE;
        default:
                return 0;
        }
}

/* Event sources of the subsystem, hung on the Scheduler (sched_set_userdata). */
typedef struct SchedulerGlue {
        sd_event_source *expire;
        Hashmap *hosts;            /* WorkerHost* by worker id (ConfigureWorker "Host") */
        /* ConfigureWorker(Pools=): the pools a worker limited itself to, by id_str
         * (the worker's own string is the key; value: mask | SCHED_OVERRIDE_SET). */
        Hashmap *overrides;
} SchedulerGlue;

#define SCHED_OVERRIDE_SET (1u << 16)

static SchedulerGlue *glue(Manager *m) {
        return m->scheduler ? sched_get_userdata(m->scheduler) : NULL;
}

/* A worker's host (the key is the entry's own `worker`). */
typedef struct WorkerHost {
        char worker[EPD_ID_STRING_MAX];
        char host[PEER_HOST_ID_MAX + 1];
} WorkerHost;

static void host_forget(SchedulerGlue *g, const char *worker_id) {
        if (g && g->hosts)
                free(hashmap_remove(g->hosts, worker_id));
}

static const char *host_of(SchedulerGlue *g, const char *worker_id) {
        WorkerHost *h = g && g->hosts ? hashmap_get(g->hosts, worker_id) : NULL;
        return h ? h->host : NULL;
}

int scheduler_set_worker_host(Manager *m, const char *worker_id, const char *host) {
        SchedulerGlue *g = glue(m);
        if (!g || !worker_id)
                return -EINVAL;
        if (!manager_get_worker(m, worker_id))
                return -ENOENT;
        if (host && strlen(host) > PEER_HOST_ID_MAX)
                return -EINVAL;
        if (!host || !host[0] || strcmp(host, m->config.host_id) == 0) {
                host_forget(g, worker_id);
                return 0;
        }
        /* A failure leaves the host it had. */
        WorkerHost *h = calloc(1, sizeof *h), *old = NULL;
        if (!h)
                return -ENOMEM;
        snprintf(h->worker, sizeof h->worker, "%s", worker_id);
        snprintf(h->host, sizeof h->host, "%s", host);
        int r = hashmap_replace(g->hosts, h->worker, h, (void **)&old);
        if (r < 0) {
                free(h);
                return r;
        }
        free(old);
        return 0;
}

SchedPressure scheduler_path_pressure(BackpressureLevel level, BackpressureReason reason, bool window_full) {
        if (backpressure_window_closed(level, reason))
                return SCHED_PRESSURE_STOP;
        if (window_full)
                return SCHED_PRESSURE_HIGH;
        return level >= BACKPRESSURE_ELEVATED ? SCHED_PRESSURE_ELEVATED : SCHED_PRESSURE_OK;
}

SchedPressure scheduler_pair_pressure(const char *prefill_host, const char *decode_host, SchedPeerPathFn peer_path,
                                      void *userdata) {
        const char *hf = prefill_host && prefill_host[0] ? prefill_host : NULL;
        const char *ht = decode_host && decode_host[0] ? decode_host : NULL;
        SchedPeerPath v = {};

        if (!hf && !ht)
                return SCHED_PRESSURE_OK; /* both here */
        if (hf && ht)
                return SCHED_PRESSURE_OK; /* on one other host, or between two: not a path we see */
        /* The decode elsewhere: this host's handoffs to it, which our window and the
         * telemetry of our path to it gate. The prefill elsewhere: its host's handoffs to
         * this one, which that host's window to us gates (its Prepare is deferred there);
         * ours to it, and its destination's fill, are the other direction. Only a peer
         * that is down (one control connection carries both directions) says something
         * of it. */
        bool outgoing = ht != NULL;
        if (!peer_path || peer_path(userdata, outgoing ? ht : hf, outgoing, &v) < 0)
                return SCHED_PRESSURE_OK; /* not a configured peer: nothing known */
        if (!v.up)
                return SCHED_PRESSURE_STOP;
        if (!outgoing || !v.has_telemetry)
                return SCHED_PRESSURE_OK;
        return scheduler_path_pressure(v.level, v.reason, v.window_full);
}

typedef struct PathLookup {
        Manager *manager;
        const char *host; /* the last one looked up, and what was found */
        SchedPeerPath found;
} PathLookup;

static int peer_path(void *userdata, const char *host, bool outgoing, SchedPeerPath *ret) {
        PathLookup *l = userdata;
        Manager *m = l->manager;
        Peer *p = m->peers ? peer_manager_find(m->peers, host) : NULL;
        TelemetryPeerStats st;

        if (!p)
                return -ENOENT;
        *ret = (SchedPeerPath){ .up = peer_is_up(p) };
        /* Telemetry keys peers by host id, as the handoff windows are. */
        if (ret->up && outgoing && telemetry_peer_stats(m, peer_host_id(p), &st) >= 0) {
                unsigned n;
                uint64_t bytes;
                handoff_manager_window(m->handoffs, host, &n, &bytes);
                ret->has_telemetry = true;
                ret->level = st.level;
                ret->reason = st.reason;
                ret->window_full = backpressure_window_admit(&m->config.telemetry.backpressure, st.level, st.reason,
                                                             n, bytes, 0, 0, NULL, NULL) < 0;
        }
        l->host = host;
        l->found = *ret;
        return 0;
}

/* The path from a prefill to a decode worker: the peer path to whichever of them is on
 * another host (scheduler_pair_pressure()). */
static SchedPressure path(void *userdata, const char *from, const char *to) {
        Manager *m = userdata;
        SchedulerGlue *g = glue(m);
        PathLookup l = { .manager = m };
        SchedPressure pr = scheduler_pair_pressure(host_of(g, from), host_of(g, to), peer_path, &l);

        if (pr != SCHED_PRESSURE_OK && l.host && !l.found.up)
                log_debug("Scheduler: path %s -> %s: peer %s is down.", from, to, l.host);
        else if (pr != SCHED_PRESSURE_OK && l.host)
                log_debug("Scheduler: path %s -> %s (peer %s) is %s (%s)%s.", from, to, l.host,
                          backpressure_level_to_string(l.found.level), backpressure_reason_to_string(l.found.reason),
                          l.found.window_full ? ", handoff window full" : "");
        return pr;
}

/* The scheduler's config from epd.conf's [Pool:NAME] sections over the defaults. */
static void sched_config_from(const Config *c, SchedConfig *ret) {
        sched_config_defaults(ret);
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                ret->pools[t] = c->pools[t].policy;
}

unsigned scheduler_worker_pools(Manager *m, Worker *w, SchedStage st) {
        const PoolSelectWorker psw = {
                .name = w->name,
                .role = worker_role_to_string(w->role),
                .model = w->model,
                .device = w->device,
                .labels = (const char *const *)w->labels,
                .n_labels = w->n_labels,
        };
        SchedulerGlue *g = glue(m);
        unsigned pools = 0;

        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                if (pool_select_match(m->config.pools[t].workers[st], &psw))
                        pools |= 1u << t;
        if (g && g->overrides) {
                uintptr_t o = (uintptr_t)hashmap_get(g->overrides, w->id_str);
                if (o & SCHED_OVERRIDE_SET)
                        pools &= (unsigned)o;
        }
        return pools;
}

int scheduler_set_pool_override(Manager *m, Worker *w, unsigned pools) {
        SchedulerGlue *g = glue(m);
        if (!g)
                return -ENOTCONN;
        if (!g->overrides && !(g->overrides = hashmap_new(HASHMAP_KEY_STRING, 0)))
                return -ENOMEM;
        if (pools == 0) {
                (void)hashmap_remove(g->overrides, w->id_str);
                return 0;
        }
        return hashmap_replace(g->overrides, w->id_str, (void *)(uintptr_t)(pools | SCHED_OVERRIDE_SET), NULL);
}

static int on_expire(sd_event_source *s, uint64_t usec, void *userdata) {
        Manager *m = userdata;
        unsigned n = sched_expire(m->scheduler, now_usec(CLOCK_MONOTONIC));
        if (n > 0)
                log_notice("Scheduler: %u request(s) dropped: no Complete() by deadline + grace.", n);
        (void)sd_event_source_set_time_relative(s, EXPIRE_INTERVAL_USEC);
        return 0;
}

bool scheduler_features_cached(Manager *m, char **keys) {
        if (!m->features || !keys || !keys[0])
                return false;
        for (char **k = keys; *k; k++) {
                Feature *f = feature_key_valid(*k) ? feature_cache_get(m->features, *k) : NULL;
                /* RESERVED counts only with bytes on their way: an encoder writing it, or
                 * a stored copy being read back. A Prefetch's placeholder has neither:
                 * skipping the encoder would leave the prefill waiting for nobody. */
                if (!f || (f->state != FEATURE_READY &&
                           (f->state != FEATURE_RESERVED || (!f->producer && !feature_loading(f)))))
                        return false;
        }
        return true;
}

/* The encode stage is skipped when the request's features are cached: the feature
 * cache is host-wide, so every prefill worker here sees the same hits. */
static double affinity(void *userdata, const char *worker, SchedStage stage, const SchedHints *h) {
        const SchedulerAffinity *a = h->affinity_key;
        return stage == SCHED_STAGE_ENCODE && a && a->features_cached ? 1.0 : 0.0;
}

typedef struct SchedOwned {
        ClientObject object;
        Manager *manager;
        char id[SCHED_REQUEST_ID_MAX + 1];
} SchedOwned;

/* The scheduler ended an owned request (completed, failed, expired, cancelled, freed). */
static void request_finished(void *userdata, const char *request_id, void *owner) {
        SchedOwned *x = owner;
        client_object_unlink(&x->object);
        free(x);
}

/* One request ends with its owned object. */
static void owned_end(ClientObject *o) {
        SchedOwned *x = container_of(o, SchedOwned, object);
        Manager *m = x->manager;
        if (m->scheduler && sched_cancel(m->scheduler, x->id, now_usec(CLOCK_MONOTONIC)) >= 0)
                return; /* request_finished() freed x */
        client_object_unlink(o);
        free(x);
}

static void owned_release(ClientObject *o);

/* Every request client c admitted ends, together (sched_cancel_many()): one walk of each
 * queue they leave per priority, not one per request (ended one by one, each walked the
 * rest of both queues it left: ~n^2 entries on the loop for a client at
 * MaxRequestsPerClient=), with the results of ending them one at a time in the order of
 * c's objects, newest first, as client_free() releases them. Each one's object goes
 * with it (request_finished()); any left (its request not outstanding, no scheduler, or
 * no memory for the list) goes alone. */
static void client_requests_end(Manager *m, Client *c) {
        unsigned n = c->n_objects[CLIENT_OBJECT_REQUEST];
        _cleanup_(freep) const char **ids = NULL;
        size_t k = 0;

        if (n == 0)
                return;
        if (m->scheduler && (ids = calloc(n, sizeof *ids))) {
                LIST_FOREACH(objects, o, c->objects)
                        if (o->release == owned_release && k < n)
                                ids[k++] = container_of(o, SchedOwned, object)->id;
                (void)sched_cancel_many(m->scheduler, ids, k, now_usec(CLOCK_MONOTONIC));
        }
        LIST_FOREACH_SAFE(objects, o, next, c->objects)
                if (o->release == owned_release)
                        owned_end(o);
}

/* Its client goes (disconnect, UnregisterWorker of a worker's connection): the request
 * ends with it, so nothing it admitted holds the scheduler's capacity. client_free()
 * releases the objects one by one; the first request of a dying client takes all of
 * that client's with it (a release may release others: client_release_objects()). */
static void owned_release(ClientObject *o) {
        Client *c = o->owner;
        if (c && c->dying)
                client_requests_end(container_of(o, SchedOwned, object)->manager, c);
        else
                owned_end(o);
}

int scheduler_request_owner(Manager *m, const char *request_id, Client **ret) {
        void *owner = NULL;
        int r = m->scheduler ? sched_request_get_owner(m->scheduler, request_id, &owner) : -ENOENT;
        if (r < 0)
                return r;
        *ret = owner ? ((SchedOwned *)owner)->object.owner : NULL;
        return 0;
}

int scheduler_own_request(Manager *m, const char *request_id, Client *c) {
        SchedOwned *x;
        int r;

        if (c->n_objects[CLIENT_OBJECT_REQUEST] >= m->config.max_requests_per_client)
                r = -EDQUOT;
        else if (!(x = calloc(1, sizeof *x)))
                r = -ENOMEM;
        else {
                x->manager = m;
                snprintf(x->id, sizeof x->id, "%s", request_id);
                r = client_object_link(c, &x->object, CLIENT_OBJECT_REQUEST, owned_release);
                if (r >= 0)
                        r = sched_request_set_owner(m->scheduler, request_id, x);
                if (r < 0) {
                        client_object_unlink(&x->object);
                        free(x);
                }
        }
        if (r < 0)
                (void)sched_cancel(m->scheduler, request_id, now_usec(CLOCK_MONOTONIC));
        return r;
}

static int scheduler_init(Manager *m) {
        SchedConfig c;
        int r;

        sched_config_from(&m->config, &c);
        r = sched_new(&c, &m->scheduler);
        if (r < 0)
                return log_error_errno(r, "Cannot create the scheduler: %m");
        SchedulerGlue *g = calloc(1, sizeof *g);
        if (!g)
                return log_oom();
        sched_set_userdata(m->scheduler, g);
        g->hosts = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!g->hosts)
                return log_oom();
        sched_set_ops(m->scheduler, &(SchedOps){ .affinity = affinity, .path = path,
                                                 .finished = request_finished, .userdata = m });
        r = sd_event_add_time_relative(m->event, &g->expire, CLOCK_MONOTONIC,
                                       EXPIRE_INTERVAL_USEC, USEC_PER_SEC / 10, on_expire, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the scheduler's expiry timer: %m");
        (void)sd_event_source_set_enabled(g->expire, SD_EVENT_ON);
        return 0;
}

static void scheduler_done(Manager *m) {
        SchedulerGlue *g = m->scheduler ? sched_get_userdata(m->scheduler) : NULL;
        if (g) {
                sd_event_source_disable_unref(g->expire);
                void *v;
                size_t it;
                while ((it = 0, g->hosts && hashmap_iterate(g->hosts, &it, &v, NULL)))
                        free(hashmap_remove(g->hosts, ((WorkerHost *)v)->worker));
                hashmap_free(g->hosts);
                hashmap_free(g->overrides);
                free(g);
        }
        m->scheduler = sched_free(m->scheduler);
}

static int scheduler_worker_added(Manager *m, Worker *w, Reason *why) {
        unsigned stages = scheduler_stages_of_role(w->role);
        int r;

        if (!m->scheduler)
                return 0;
        for (int st = 0; st < _SCHED_STAGE_MAX; st++) {
                if (!(stages & (1u << st)))
                        continue;
                r = sched_worker_add(m->scheduler, &(SchedWorkerInfo){
                                                           .id = w->id_str,
                                                           .stage = (SchedStage)st,
                                                           .pools = scheduler_worker_pools(m, w, (SchedStage)st),
                                                           .slots = WORKER_SLOTS_DEFAULT,
                                                   });
                if (r < 0) {
                        for (int k = 0; k < st; k++)
                                (void)sched_worker_remove(m->scheduler, w->id_str, (SchedStage)k, 0);
                        log_warning_errno(r, "Scheduler: cannot add worker %s: %m", w->id_str);
                        return reason_set(why, r, "The scheduler cannot add worker %s: %s", w->id_str,
                                          strerror(-r));
                }
        }
        return 0;
}

static uint64_t kv_arena_mask(Manager *m, const Worker *w) {
        uint64_t mask = 0;
        for (size_t i = 0; i < m->n_arenas && i < 64; i++)
                if ((w->arena_mask & (UINT64_C(1) << i)) && m->arenas[i]->usage == ARENA_USAGE_KV &&
                    m->arenas[i]->pages)
                        mask |= UINT64_C(1) << i;
        return mask;
}

/* Whether `w` is a decode worker on a page pool: its KV arenas' mask, else 0. */
static uint64_t decode_kv_mask(Manager *m, const Worker *w) {
        if (!(scheduler_stages_of_role(w->role) & (1u << SCHED_STAGE_DECODE)))
                return 0;
        return kv_arena_mask(m, w);
}

/* Subsystem.pages_taken: if the request's decode worker maps a, its reservation there
 * shrinks by n, or grows back by -n (sched_request_pages_taken()); nothing for a request
 * not admitted here. */
static uint64_t scheduler_pages_taken(Manager *m, const char *request_id, const Arena *a, int64_t n) {
        const char *id;
        Worker *w;

        if (!m->scheduler || !a || n == 0 || a->index >= 64)
                return 0;
        id = sched_request_stage_worker(m->scheduler, request_id, SCHED_STAGE_DECODE);
        w = id ? manager_get_worker(m, id) : NULL;
        if (!w || !(decode_kv_mask(m, w) & (UINT64_C(1) << a->index)))
                return 0;
        return sched_request_pages_taken(m->scheduler, request_id, n);
}

typedef struct ArenaSetPromise {
        uint64_t mask;     /* one set of KV arenas that decode workers use */
        uint64_t reserved; /* the pages the scheduler promised to the workers on exactly that set */
} ArenaSetPromise;

void scheduler_refresh_pages(Manager *m) {
        size_t n = hashmap_size(m->workers), n_sets = 0, it = 0;
        ArenaSetPromise *sets = n > 0 ? calloc(n, sizeof *sets) : NULL;
        Worker *w;

        if (n > 0 && !sets) {
                log_oom();
                return; /* the free pages stay as last set */
        }
        /* The promises, summed per set of arenas (workers sharing a set share its sum):
         * one pass over the workers and one over the sets each, not one over the workers
         * each. */
        while (hashmap_iterate(m->workers, &it, (void **)&w, NULL)) {
                uint64_t mask = decode_kv_mask(m, w);
                size_t k;
                if (mask == 0)
                        continue;
                for (k = 0; k < n_sets && sets[k].mask != mask; k++)
                        ;
                if (k == n_sets)
                        sets[n_sets++].mask = mask;
                sets[k].reserved += sched_worker_reserved_pages(m->scheduler, w->id_str);
        }
        it = 0;
        while (hashmap_iterate(m->workers, &it, (void **)&w, NULL)) {
                uint64_t free_pages = 0, largest = 0, others = 0, mask = decode_kv_mask(m, w);
                /* Without a page pool yet, ConfigureWorker(FreePages=) is what counts. */
                if (mask == 0)
                        continue;
                for (size_t i = 0; i < m->n_arenas && i < 64; i++) {
                        PagePoolStats st;
                        if (!(mask & (UINT64_C(1) << i)))
                                continue;
                        page_pool_stats(m->arenas[i]->pages, &st);
                        free_pages += st.free + st.cached_idle; /* idle cached pages are evictable */
                        largest = MAX(largest, (uint64_t)(st.free + st.cached_idle));
                }
                /* Pages promised to the other decode workers of the same arenas are not
                 * this one's to promise again (the scheduler counts each worker's own). */
                for (size_t k = 0; k < n_sets; k++)
                        if (sets[k].mask & mask)
                                others += sets[k].reserved;
                others -= MIN(others, sched_worker_reserved_pages(m->scheduler, w->id_str));
                free_pages -= MIN(free_pages, others);
                (void)sched_worker_set_pages(m->scheduler, w->id_str, free_pages, largest);
        }
        free(sets);
}

static void scheduler_worker_gone(Manager *m, Worker *w) {
        SchedulerGlue *g = glue(m);
        if (!m->scheduler)
                return;
        host_forget(glue(m), w->id_str);
        if (g && g->overrides)
                (void)hashmap_remove(g->overrides, w->id_str);
        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                (void)sched_worker_remove(m->scheduler, w->id_str, (SchedStage)st, now_usec(CLOCK_MONOTONIC));
}

/* The worker's client left while its process still runs (its GPU pages wait for the
 * process: core/client.c): the requests it admitted end now, as its disconnect says
 * (docs/scheduler.md), not when the wait is over. */
static void scheduler_worker_departing(Manager *m, Worker *w) {
        Client *c = w->object.owner;
        scheduler_worker_gone(m, w);
        if (c)
                client_requests_end(m, c);
}

/* [Pool:NAME] is reloadable: policies apply to the next Admit, and every registered
 * worker serves the pools the new selectors give it (outstanding requests stay). */
static int scheduler_reload(Manager *m, const Config *n) {
        SchedConfig c;
        PoolConfig pools[_TASK_TYPE_MAX] = {};
        int r = 0;

        if (!m->scheduler)
                return 0;
        sched_config_from(n, &c);
        for (int t = 0; t < _TASK_TYPE_MAX; t++) {
                pools[t].policy = n->pools[t].policy;
                for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                        if (n->pools[t].workers[st] && !(pools[t].workers[st] = strdup(n->pools[t].workers[st])))
                                r = -ENOMEM;
        }
        if (r >= 0)
                r = sched_reconfigure(m->scheduler, &c);
        if (r < 0) {
                for (int t = 0; t < _TASK_TYPE_MAX; t++)
                        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                                free(pools[t].workers[st]);
                return r;
        }
        for (int t = 0; t < _TASK_TYPE_MAX; t++) {
                for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                        free(m->config.pools[t].workers[st]);
                m->config.pools[t] = pools[t];
        }

        Worker *w;
        size_t it = 0;
        while (hashmap_iterate(m->workers, &it, (void **)&w, NULL)) {
                unsigned stages = scheduler_stages_of_role(w->role);
                for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                        if (stages & (1u << st))
                                (void)sched_worker_set_pools(m->scheduler, w->id_str, (SchedStage)st,
                                                             scheduler_worker_pools(m, w, (SchedStage)st));
        }
        log_info("Scheduler: pool policies reloaded.");
        return 0;
}

const Subsystem scheduler_subsystem = {
        .name = "scheduler",
        .init = scheduler_init,
        .done = scheduler_done,
        .add_bus = bus_scheduler_add,
        .reload = scheduler_reload,
        .worker_added = scheduler_worker_added,
        .worker_gone = scheduler_worker_gone,
        .worker_departing = scheduler_worker_departing,
        .pages_taken = scheduler_pages_taken,
};
