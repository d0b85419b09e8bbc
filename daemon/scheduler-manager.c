/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "feature.h"
#include "log.h"
#include "pages.h"
#include "pool-select.h"
#include "scheduler-manager.h"
#include "worker.h"

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
        /* ConfigureWorker(Pools=): the pools a worker limited itself to, by id_str
         * (the worker's own string is the key; value: mask | SCHED_OVERRIDE_SET). */
        Hashmap *overrides;
} SchedulerGlue;

#define SCHED_OVERRIDE_SET (1u << 16)

static SchedulerGlue *glue(Manager *m) {
        return m->scheduler ? sched_get_userdata(m->scheduler) : NULL;
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
                if (!f || (f->state != FEATURE_READY && f->state != FEATURE_RESERVED))
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
        sched_set_ops(m->scheduler, &(SchedOps){ .affinity = affinity, .userdata = m });
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
                hashmap_free(g->overrides);
                free(g);
        }
        m->scheduler = sched_free(m->scheduler);
}

static int scheduler_worker_added(Manager *m, Worker *w) {
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
                        return log_warning_errno(r, "Scheduler: cannot add worker %s: %m", w->id_str);
                }
        }
        return 0;
}

void scheduler_refresh_pages(Manager *m) {
        Worker *w;
        size_t it = 0;

        while (hashmap_iterate(m->workers, &it, (void **)&w, NULL)) {
                uint64_t free_pages = 0;
                bool any = false;
                if (!(scheduler_stages_of_role(w->role) & (1u << SCHED_STAGE_DECODE)))
                        continue;
                for (size_t i = 0; i < m->n_arenas && i < 64; i++) {
                        Arena *a = m->arenas[i];
                        PagePoolStats st;
                        if (!(w->arena_mask & (UINT64_C(1) << i)) || a->usage != ARENA_USAGE_KV || !a->pages)
                                continue;
                        page_pool_stats(a->pages, &st);
                        free_pages += st.free + st.cached_idle; /* idle cached pages are evictable */
                        any = true;
                }
                /* Without a page pool yet, ConfigureWorker(FreePages=) is what counts. */
                if (any)
                        (void)sched_worker_set_free_pages(m->scheduler, w->id_str, free_pages);
        }
}

static void scheduler_worker_gone(Manager *m, Worker *w) {
        SchedulerGlue *g = glue(m);
        if (!m->scheduler)
                return;
        if (g && g->overrides)
                (void)hashmap_remove(g->overrides, w->id_str);
        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                (void)sched_worker_remove(m->scheduler, w->id_str, (SchedStage)st, now_usec(CLOCK_MONOTONIC));
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
};
