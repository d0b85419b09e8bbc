/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>

#include "log.h"
#include "pages.h"
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
} SchedulerGlue;

static int on_expire(sd_event_source *s, uint64_t usec, void *userdata) {
        Manager *m = userdata;
        unsigned n = sched_expire(m->scheduler, now_usec(CLOCK_MONOTONIC));
        if (n > 0)
                log_notice("Scheduler: %u request(s) dropped: no Complete() by deadline + grace.", n);
        (void)sd_event_source_set_time_relative(s, EXPIRE_INTERVAL_USEC);
        return 0;
}

static int scheduler_init(Manager *m) {
        SchedConfig c;
        int r;

        sched_config_defaults(&c);
        r = sched_new(&c, &m->scheduler);
        if (r < 0)
                return log_error_errno(r, "Cannot create the scheduler: %m");
        SchedulerGlue *g = calloc(1, sizeof *g);
        if (!g)
                return log_oom();
        sched_set_userdata(m->scheduler, g);
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
                                                           .pools = (1u << _TASK_TYPE_MAX) - 1,
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
        if (!m->scheduler)
                return;
        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                (void)sched_worker_remove(m->scheduler, w->id_str, (SchedStage)st, now_usec(CLOCK_MONOTONIC));
}

const Subsystem scheduler_subsystem = {
        .name = "scheduler",
        .init = scheduler_init,
        .done = scheduler_done,
        .add_bus = bus_scheduler_add,
        .worker_added = scheduler_worker_added,
        .worker_gone = scheduler_worker_gone,
};
