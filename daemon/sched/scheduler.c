/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "hashmap.h"
#include "list.h"
#include "sched/scheduler.h"

#define TOP_CANDIDATES 4

typedef struct SchedRequest SchedRequest;
typedef struct SchedWorker SchedWorker;

typedef struct Estimator {
        double srtt, rttvar; /* usec */
        uint64_t n;
        usec_t since;        /* its excess decays from here while nothing of the pool is
                              * outstanding: the last sample, or the last time the
                              * worker was left with none (est_decayed) */
} Estimator;

typedef struct Rate {
        double count;
        usec_t last;
} Rate;

typedef struct StageRef {
        SchedRequest *req;
        SchedWorker *worker; /* NULL: stage skipped or done */
        usec_t service;      /* conservative estimate at admission */
        usec_t pushed;       /* how far its admission pushed lower-priority work queued there */
        usec_t back;         /* leaving: what that work gets back (worker_give_back()) */
        bool leaving;        /* left, still linked until worker_give_back() */
        LIST_FIELDS(struct StageRef, queue);
} StageRef;

struct SchedRequest {
        char id[SCHED_REQUEST_ID_MAX + 1];
        TaskType type;
        int priority;
        uint64_t seq;        /* admission order: which requests its admission pushed back */
        usec_t admitted, deadline, predicted_end, stage_start, predicted;
        uint64_t pages;      /* held back at the decode worker now (in its reserved_pages) */
        uint64_t want;       /* PagesNeeded, until its prefill completes */
        uint64_t held;       /* pages its handoffs hold out of the pool meanwhile: pages is
                              * want less these (the free count has them no more) */
        void *owner;         /* the caller's (sched_request_set_owner), told at the end */
        SchedRequest *leaving_next; /* requests_finish()'s list; NULL off one */
        StageRef stages[_SCHED_STAGE_MAX];
};

struct SchedWorker {
        char id[SCHED_WORKER_ID_MAX + 1];
        SchedStage stage;
        unsigned pools, slots, queue_limit;
        unsigned queue_limit_set; /* as configured; 0: none, 4 x slots (follows Slots) */
        uint64_t free_pages, reserved_pages;
        uint64_t largest_pages; /* the most one of its arenas has free (a handoff lands in
                                 * one); UINT64_MAX: not known */
        unsigned outstanding;
        unsigned outstanding_by_pool[_TASK_TYPE_MAX];
        Estimator est[_TASK_TYPE_MAX];
        LIST_HEAD(StageRef, queue); /* newest first: admission prepends (SchedRequest.seq falls) */
        bool removing;          /* sched_worker_remove(): nothing stays to give back to */
        unsigned n_leaving;     /* refs left but linked, for worker_give_back() */
        int leaving_top;        /* the highest priority among them */
        SchedWorker *leaving_next; /* give_backs()'s list */
};

typedef struct Pool {
        unsigned queue, queue_peak;
        bool throttled;
        Rate arrivals, completions;
        SchedPoolMetrics m;
} Pool;

struct Scheduler {
        SchedConfig config;
        SchedOps ops;
        void *userdata;
        Hashmap *requests; /* SchedRequest* by id */
        SchedWorker **workers[_SCHED_STAGE_MAX];
        size_t n_workers[_SCHED_STAGE_MAX];
        Pool pools[_TASK_TYPE_MAX];
        usec_t soonest_end; /* soonest_end()'s walk, kept while no request comes or goes */
        bool soonest_valid;
        uint64_t admissions; /* the last SchedRequest.seq */
        uint64_t give_back_steps; /* queue entries the give-backs visited (sched_give_back_steps()) */
};

/* ---- small math ---- */

static double rate_decayed(const Rate *r, usec_t now, usec_t tau) {
        if (now <= r->last)
                return r->count;
        return r->count * exp(-(double)(now - r->last) / (double)tau);
}

static void rate_tick(Rate *r, usec_t now, usec_t tau) {
        r->count = rate_decayed(r, now, tau) + 1.0;
        r->last = MAX(now, r->last);
}

static double rate_get(const Rate *r, usec_t now, usec_t tau) {
        return rate_decayed(r, now, tau) / ((double)tau / USEC_PER_SEC);
}

/* A service time longer than this (a day: no deadline is longer) is taken as this. */
#define SCHED_SERVICE_MAX (24ULL * 3600 * USEC_PER_SEC)

/* The conservative figure is srtt + 4 rttvar, or 1.5 x the pool's estimate before any
 * sample (its base: srtt at the estimate and rttvar at its eighth, as a first sample equal
 * to the estimate leaves them). A worker with nothing of the pool outstanding whose figure
 * rose above the base stays unchosen for it, so no sample would ever bring it back (other
 * pools' work, which may keep the worker busy all along, brings none): while none is
 * outstanding the excess halves every rate_window, and the worker is tried again.
 *
 * est_decayed() is the estimate with that decay applied up to now, srtt and rttvar each
 * shrinking towards its share of the base (one already below its share stays, and the
 * other takes the whole decay), so that srtt + 4 rttvar is exactly base + excess x
 * 2^(-idle / rate_window). It is kept (est_settle) when the pool gets work at the worker
 * again: the figure that admitted that work is what its report then updates. A report
 * going into the undecayed estimate restarted the decay from the whole excess (one
 * normal request got in about once a minute after a single 60 s report). */
static Estimator est_decayed(const Scheduler *s, const SchedWorker *w, TaskType t, usec_t now) {
        Estimator e = w->est[t];
        double est = (double)s->config.pools[t].service_estimate[w->stage];
        double xs = e.srtt - est, xv = 4 * (e.rttvar - est / 8), excess = xs + xv, f;

        if (e.n == 0 || w->outstanding_by_pool[t] > 0 || now <= e.since || !(excess > 0))
                return e;
        f = exp2(-(double)(now - e.since) / (double)s->config.rate_window);
        if (xs >= 0 && xv >= 0) {
                xs *= f;
                xv *= f;
        } else if (xs < 0)
                xv = excess * f - xs;
        else
                xs = excess * f - xv;
        e.srtt = est + xs;
        e.rttvar = MAX(est / 8 + xv / 4, 0.0);
        e.since = now;
        return e;
}

/* Keeps the decay so far: w gets work of pool t (none was outstanding), or was left with
 * none (the decay starts now). */
static void est_settle(Scheduler *s, SchedWorker *w, TaskType t, usec_t now) {
        if (w->outstanding_by_pool[t] > 0)
                return;
        w->est[t] = est_decayed(s, w, t, now);
        w->est[t].since = MAX(now, w->est[t].since);
}

/* TCP's estimator (RFC 6298), from the decayed estimate, with Linux's care for samples
 * below srtt (tcp_rtt_estimator, after Eifel): their distance beyond rttvar counts an
 * eighth as much. A fast report then never raises the figure: srtt falls by d / 8 and
 * 4 rttvar rises by at most that (d: its distance below srtt). Otherwise the first
 * normal report after a slow one, its distance from the inflated srtt taken as
 * variance, pushed the figure back up. */
static void est_sample(Scheduler *s, SchedWorker *w, TaskType t, double sample, usec_t now) {
        Estimator *e = &w->est[t];

        *e = est_decayed(s, w, t, now);
        sample = CLAMP(sample, 1.0, (double)SCHED_SERVICE_MAX);
        e->since = MAX(now, e->since);
        if (e->n == 0) {
                e->srtt = sample;
                e->rttvar = sample / 8;
        } else {
                double err = sample - e->srtt, d = fabs(err);
                if (err < 0 && d > e->rttvar)
                        e->rttvar += (d - e->rttvar) / 32;
                else
                        e->rttvar = 0.75 * e->rttvar + 0.25 * d;
                e->srtt += err / 8;
        }
        e->n++;
}

static double est_mean(const Scheduler *s, const SchedWorker *w, TaskType t, usec_t now) {
        Estimator e = est_decayed(s, w, t, now);
        return e.n > 0 ? e.srtt : (double)s->config.pools[t].service_estimate[w->stage];
}

static usec_t est_conservative(const Scheduler *s, const SchedWorker *w, TaskType t, usec_t now) {
        Estimator e = est_decayed(s, w, t, now);
        double v = e.n > 0 ? e.srtt + 4 * e.rttvar : 1.5 * (double)s->config.pools[t].service_estimate[w->stage];
        return (usec_t)CLAMP(v, 1.0, (double)SCHED_SERVICE_MAX);
}

/* ---- lifetime ---- */

int sched_new(const SchedConfig *c, Scheduler **ret) {
        Scheduler *s;
        int r;

        r = sched_config_validate(c, NULL);
        if (r < 0)
                return r;
        s = calloc(1, sizeof *s);
        if (!s)
                return -ENOMEM;
        s->config = *c;
        s->requests = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!s->requests) {
                free(s);
                return -ENOMEM;
        }
        *ret = s;
        return 0;
}

static void request_free(SchedRequest *r) {
        free(r);
}

Scheduler *sched_free(Scheduler *s) {
        SchedRequest *r;
        size_t i = 0;

        if (!s)
                return NULL;
        while (hashmap_iterate(s->requests, &i, (void **)&r, NULL)) {
                if (r->owner && s->ops.finished)
                        s->ops.finished(s->ops.userdata, r->id, r->owner);
                request_free(r);
        }
        hashmap_free(s->requests);
        for (int st = 0; st < _SCHED_STAGE_MAX; st++) {
                for (size_t k = 0; k < s->n_workers[st]; k++)
                        free(s->workers[st][k]);
                free(s->workers[st]);
        }
        free(s);
        return NULL;
}

void sched_set_ops(Scheduler *s, const SchedOps *ops) {
        s->ops = ops ? *ops : (SchedOps){};
}

void sched_set_userdata(Scheduler *s, void *userdata) {
        s->userdata = userdata;
}

void *sched_get_userdata(const Scheduler *s) {
        return s->userdata;
}

int sched_reconfigure(Scheduler *s, const SchedConfig *c) {
        int r = sched_config_validate(c, NULL);
        if (r < 0)
                return r;
        s->config = *c;
        return 0;
}

unsigned sched_outstanding(const Scheduler *s) {
        return (unsigned)hashmap_size(s->requests);
}

uint64_t sched_give_back_steps(const Scheduler *s) {
        return s->give_back_steps;
}

/* ---- workers ---- */

static bool id_valid(const char *id, size_t max) {
        size_t n;

        if (!id)
                return false;
        n = strnlen(id, max + 1);
        if (n == 0 || n > max)
                return false;
        for (size_t i = 0; i < n; i++)
                if (id[i] <= ' ' || id[i] >= 0x7f)
                        return false;
        return true;
}

static SchedWorker *worker_find(Scheduler *s, const char *id, SchedStage stage, size_t *idx) {
        for (size_t k = 0; k < s->n_workers[stage]; k++)
                if (strcmp(s->workers[stage][k]->id, id) == 0) {
                        if (idx)
                                *idx = k;
                        return s->workers[stage][k];
                }
        return NULL;
}

/* The queue limit as configured, else 4 x slots; never below the slots. An option not
 * given stays as it was: a configured limit outlives a change of Slots. */
static void worker_queue_limit(SchedWorker *w) {
        w->queue_limit = MAX(w->queue_limit_set > 0 ? w->queue_limit_set : 4 * w->slots, w->slots);
}

int sched_worker_add(Scheduler *s, const SchedWorkerInfo *info) {
        SchedWorker *w, **a;
        SchedStage st = info->stage;

        if (!id_valid(info->id, SCHED_WORKER_ID_MAX) || st < 0 || st >= _SCHED_STAGE_MAX ||
            info->slots == 0 || info->slots > 65536 || info->queue_limit > 1u << 20 ||
            (info->pools & ~((1u << _TASK_TYPE_MAX) - 1)))
                return -EINVAL;
        if (worker_find(s, info->id, st, NULL))
                return -EEXIST;
        if (s->n_workers[st] >= SCHED_WORKERS_MAX)
                return -EDQUOT;
        a = reallocarray(s->workers[st], s->n_workers[st] + 1, sizeof *a);
        if (!a)
                return -ENOMEM;
        s->workers[st] = a;
        w = calloc(1, sizeof *w);
        if (!w)
                return -ENOMEM;
        strcpy(w->id, info->id);
        w->stage = st;
        w->pools = info->pools;
        w->slots = info->slots;
        w->queue_limit_set = info->queue_limit;
        worker_queue_limit(w);
        w->free_pages = info->free_pages;
        w->largest_pages = UINT64_MAX;
        a[s->n_workers[st]++] = w;
        return 0;
}

int sched_worker_set_free_pages(Scheduler *s, const char *id, uint64_t free_pages) {
        return sched_worker_set_pages(s, id, free_pages, UINT64_MAX);
}

int sched_worker_set_pages(Scheduler *s, const char *id, uint64_t free_pages, uint64_t largest) {
        SchedWorker *w = id ? worker_find(s, id, SCHED_STAGE_DECODE, NULL) : NULL;
        if (!w)
                return -ENOENT;
        w->free_pages = free_pages;
        w->largest_pages = largest;
        return 0;
}

int sched_worker_set_capacity(Scheduler *s, const char *id, SchedStage stage, unsigned slots, unsigned queue_limit) {
        if (!id || stage < 0 || stage >= _SCHED_STAGE_MAX || slots > 65536 || queue_limit > 1u << 20)
                return -EINVAL;
        SchedWorker *w = worker_find(s, id, stage, NULL);
        if (!w)
                return -ENOENT;
        if (slots > 0)
                w->slots = slots;
        if (queue_limit > 0)
                w->queue_limit_set = queue_limit;
        worker_queue_limit(w);
        return 0;
}

int sched_worker_set_pools(Scheduler *s, const char *id, SchedStage stage, unsigned pools) {
        if (!id || stage < 0 || stage >= _SCHED_STAGE_MAX || (pools & ~((1u << _TASK_TYPE_MAX) - 1)))
                return -EINVAL;
        SchedWorker *w = worker_find(s, id, stage, NULL);
        if (!w)
                return -ENOENT;
        w->pools = pools;
        return 0;
}

uint64_t sched_worker_reserved_pages(Scheduler *s, const char *id) {
        SchedWorker *w = id ? worker_find(s, id, SCHED_STAGE_DECODE, NULL) : NULL;
        return w ? w->reserved_pages : 0;
}

unsigned sched_worker_get_pools(Scheduler *s, const char *id, SchedStage stage) {
        SchedWorker *w = id && stage >= 0 && stage < _SCHED_STAGE_MAX ? worker_find(s, id, stage, NULL) : NULL;
        return w ? w->pools : 0;
}

/* ---- requests ---- */

/* r's stage st leaves its worker w (done there, or the request over) having used `used`
 * of its predicted service. Its admission pushed the lower-priority requests already
 * queued on w back by ref->pushed: they get back the share it did not use, never to
 * before now or their admission (else a request that ended early kept their predicted
 * ends late for good). The give-back is left on the ref, still linked, and w on
 * *touched: give_backs() walks each queue once for all the stages leaving together (a
 * walk each made ending q requests at once O(q^2): test_leaving_together_linear). */
static void stage_leave(Scheduler *s, SchedRequest *r, SchedStage st, usec_t used, usec_t now,
                        SchedWorker **touched) {
        StageRef *ref = &r->stages[st];
        SchedWorker *w = ref->worker;

        if (!w)
                return;
        w->outstanding--;
        w->outstanding_by_pool[r->type]--;
        est_settle(s, w, r->type, now); /* left with none of the pool: the decay starts */
        if (st == SCHED_STAGE_DECODE)
                w->reserved_pages -= MIN(w->reserved_pages, r->pages);
        ref->worker = NULL;

        /* The share of the push (as made, whatever the slots are now) that it did not use;
         * none where the worker goes (everything queued there goes with it). */
        usec_t back = !w->removing && used < ref->service && ref->service > 0
                              ? (usec_t)((unsigned __int128)ref->pushed * (ref->service - used) / ref->service)
                              : 0;
        if (back == 0) {
                LIST_REMOVE(queue, w->queue, ref);
                return;
        }
        ref->back = back;
        ref->leaving = true;
        if (w->n_leaving++ == 0) {
                w->leaving_top = r->priority;
                w->leaving_next = *touched;
                *touched = w;
        } else
                w->leaving_top = MAX(w->leaving_top, r->priority);
}

/* Unlinks the stages that left w together (stage_leave()) and gives their pushes back to
 * the lower-priority requests that stay, queued there before them: one walk of the queue
 * per priority among those leaving, highest first. The queue is newest first, so the
 * leaving stages of that priority met so far in a walk are exactly those admitted after
 * the entry at hand, and the entry gets back their sum: each give-back is clamped at the
 * same floor (now and its admission do not change), so one clamp of the sum ends where
 * one at a time did. */
static void worker_give_back(Scheduler *s, SchedWorker *w, usec_t now) {
        int level = w->leaving_top;

        while (w->n_leaving > 0) {
                usec_t back = 0;
                int next = INT_MIN;

                for (StageRef *o = w->queue, *n; o && (back > 0 || w->n_leaving > 0); o = n) {
                        n = o->queue_next;
                        s->give_back_steps++;
                        if (o->leaving && o->req->priority >= level) {
                                back = usec_add(back, o->back);
                                o->leaving = false;
                                LIST_REMOVE(queue, w->queue, o);
                                w->n_leaving--;
                        } else if (o->leaving)
                                next = MAX(next, o->req->priority);
                        else if (back > 0 && o->req->priority < level) {
                                /* Never to before now (nor its admission): an end in the
                                 * past would read as overdue. */
                                usec_t floor = MAX(o->req->admitted, now), pe = o->req->predicted_end;
                                if (pe > floor)
                                        o->req->predicted_end = pe - MIN(back, pe - floor);
                        }
                }
                level = next;
        }
        s->soonest_valid = false;
}

static void give_backs(Scheduler *s, SchedWorker *touched, usec_t now) {
        while (touched) {
                SchedWorker *w = touched;
                touched = w->leaving_next;
                w->leaving_next = NULL;
                worker_give_back(s, w, now);
        }
}

/* A stage done (Complete): it leaves its worker's queue. */
static void stage_release(Scheduler *s, SchedRequest *r, SchedStage st, usec_t used, usec_t now) {
        SchedWorker *touched = NULL;

        stage_leave(s, r, st, used, now, &touched);
        give_backs(s, touched, now);
}

static void pool_update_throttle(Scheduler *s, TaskType t) {
        Pool *p = &s->pools[t];
        const SchedPoolPolicy *pp = &s->config.pools[t];

        if (p->queue >= pp->high_watermark)
                p->throttled = true;
        else if (p->queue <= pp->low_watermark)
                p->throttled = false;
}

typedef enum FinishHow { FINISH_OK, FINISH_FAILED, FINISH_EXPIRED } FinishHow;

/* Ends the requests on the list (linked by leaving_next) together, as ending them one
 * at a time would: each stage leaves its worker (stage_leave()), the give-backs in one
 * walk per worker and priority, then each is counted, and all are out of the table
 * before any owner is told (in list order). */
static void requests_finish(Scheduler *s, SchedRequest *list, FinishHow how, usec_t now) {
        SchedWorker *touched = NULL;

        if (!list)
                return;
        for (SchedRequest *r = list; r; r = r->leaving_next) {
                bool first = true;

                /* The first stage left is the one under way since stage_start; the later
                 * ones never ran. */
                for (int st = 0; st < _SCHED_STAGE_MAX; st++) {
                        if (!r->stages[st].worker)
                                continue;
                        stage_leave(s, r, (SchedStage)st, first && now > r->stage_start ? now - r->stage_start : 0,
                                    now, &touched);
                        first = false;
                }
        }
        give_backs(s, touched, now);

        for (SchedRequest *r = list; r; r = r->leaving_next) {
                Pool *p = &s->pools[r->type];

                p->queue--;
                pool_update_throttle(s, r->type);
                if (how == FINISH_OK) {
                        p->m.completed++;
                        rate_tick(&p->completions, now, s->config.rate_window);
                        if (now > r->deadline)
                                p->m.deadline_misses++;
                } else if (how == FINISH_EXPIRED) {
                        p->m.expired++;
                        p->m.deadline_misses++;
                } else
                        p->m.failed++;
                hashmap_remove(s->requests, r->id);
        }
        s->soonest_valid = false;
        while (list) {
                SchedRequest *r = list;

                list = r->leaving_next;
                if (r->owner && s->ops.finished)
                        s->ops.finished(s->ops.userdata, r->id, r->owner);
                request_free(r);
        }
}

static void request_finish(Scheduler *s, SchedRequest *r, FinishHow how, usec_t now) {
        r->leaving_next = NULL;
        requests_finish(s, r, how, now);
}

/* Its requests end together: one walk of each other queue they leave (per priority),
 * not one per request (requests_finish()). */
int sched_worker_remove(Scheduler *s, const char *id, SchedStage stage, usec_t now) {
        SchedRequest *list = NULL, **tail = &list;
        SchedWorker *w;
        size_t idx;

        if (!id || stage < 0 || stage >= _SCHED_STAGE_MAX)
                return -EINVAL;
        w = worker_find(s, id, stage, &idx);
        if (!w)
                return -ENOENT;
        /* Newest first, as they used to end one by one. */
        LIST_FOREACH(queue, ref, w->queue) {
                ref->req->leaving_next = NULL;
                *tail = ref->req;
                tail = &ref->req->leaving_next;
        }
        w->removing = true;
        requests_finish(s, list, FINISH_FAILED, now);
        memmove(&s->workers[stage][idx], &s->workers[stage][idx + 1],
                (s->n_workers[stage] - idx - 1) * sizeof(SchedWorker *));
        s->n_workers[stage]--;
        free(w);
        return 0;
}

/* ---- admission ---- */

typedef struct Candidate {
        SchedWorker *w;
        usec_t service; /* conservative, after affinity */
        usec_t time;    /* wait + service */
} Candidate;

typedef struct StageEval {
        Candidate top[TOP_CANDIDATES];
        size_t n_top;
        size_t n_serving;   /* workers that serve the pool at this stage */
        bool no_pages;      /* some worker had room but not the pages */
        usec_t idle;        /* best service time on an idle worker */
        usec_t retry;       /* shortest expected time until one of them frees room */
} StageEval;

static double affinity(Scheduler *s, const SchedWorker *w, SchedStage st, const SchedHints *h) {
        double a;
        if (!s->ops.affinity)
                return 0;
        a = s->ops.affinity(s->ops.userdata, w ? w->id : NULL, st, h);
        return isfinite(a) ? CLAMP(a, 0.0, 1.0) : 0;
}

/* May a request of pool t join w? The top pool (share 1) may fill the worker's queue;
 * a pool with share < 1 may only hold, together with the pools below it, that share of
 * the worker's slots. So lower-priority work can never occupy every slot, and a
 * higher-priority request always finds a slot free of it within its wait bound. */
static bool pool_has_room(const Scheduler *s, const SchedWorker *w, TaskType t) {
        const SchedPoolPolicy *pp = &s->config.pools[t];
        unsigned n = 0, cap;

        if (w->outstanding >= w->queue_limit)
                return false;
        if (pp->worker_share >= 1.0)
                return true;
        for (int q = 0; q < _TASK_TYPE_MAX; q++)
                if (s->config.pools[q].priority <= pp->priority)
                        n += w->outstanding_by_pool[q];
        cap = (unsigned)((double)w->slots * pp->worker_share);
        return n < MAX(cap, 1u);
}

static void eval_stage(Scheduler *s, SchedStage st, TaskType t, int prio, const SchedHints *h,
                       usec_t now, StageEval *ev) {
        *ev = (StageEval){ .idle = USEC_INFINITY, .retry = USEC_INFINITY };

        for (size_t k = 0; k < s->n_workers[st]; k++) {
                SchedWorker *w = s->workers[st][k];
                usec_t svc, wait, time, sum = 0, max_low = 0;
                unsigned n_low = 0;
                bool ok = true;
                double a;

                if (!(w->pools & (1u << t)))
                        continue;
                ev->n_serving++;
                a = affinity(s, w, st, h);
                svc = (usec_t)((double)est_conservative(s, w, t, now) * (1.0 - a));
                svc = MAX(svc, (usec_t)1);
                ev->idle = MIN(ev->idle, svc);

                /* Work ahead of us: equal or higher priority. Lower-priority requests
                 * (n_low) hold at most n_low slots and are not preempted: with a slot
                 * free of them, the others drain the work ahead; without, the longest
                 * of them may have to end first. In the same pass: whether admitting
                 * here would delay lower-priority work past its deadline (one past it
                 * already is not protected: nothing keeps it on time any more, and it
                 * would shut the higher pools out until it expires). One walk of the
                 * queue, not two. */
                LIST_FOREACH(queue, ref, w->queue) {
                        if (ref->req->priority >= prio)
                                sum += ref->service;
                        else {
                                n_low++;
                                max_low = MAX(max_low, ref->service);
                                const SchedRequest *lr = ref->req;
                                if (lr->deadline > now && lr->predicted_end + svc / w->slots > lr->deadline)
                                        ok = false;
                        }
                }
                if (w->outstanding > 0) {
                        usec_t per = (sum + (usec_t)n_low * max_low) / w->outstanding / w->slots;
                        ev->retry = MIN(ev->retry, MAX(per, (usec_t)1));
                }
                if (!pool_has_room(s, w, t))
                        continue;
                if (st == SCHED_STAGE_DECODE &&
                    (w->reserved_pages > w->free_pages || h->pages_needed > w->free_pages - w->reserved_pages ||
                     h->pages_needed > w->largest_pages)) {
                        ev->no_pages = true;
                        continue;
                }
                if (!ok)
                        continue;
                if (n_low < w->slots)
                        wait = sum / (w->slots - n_low);
                else
                        wait = max_low + sum / w->slots;

                time = wait + svc;
                /* Keep the best few, sorted by time. */
                size_t pos = ev->n_top;
                while (pos > 0 && ev->top[pos - 1].time > time)
                        pos--;
                if (pos >= TOP_CANDIDATES)
                        continue;
                if (ev->n_top < TOP_CANDIDATES)
                        ev->n_top++;
                memmove(&ev->top[pos + 1], &ev->top[pos], (ev->n_top - 1 - pos) * sizeof(Candidate));
                ev->top[pos] = (Candidate){ .w = w, .service = svc, .time = time };
        }
        (void)now;
}

static int top_priority(const Scheduler *s) {
        int m = s->config.pools[0].priority;
        for (int t = 1; t < _TASK_TYPE_MAX; t++)
                m = MAX(m, s->config.pools[t].priority);
        return m;
}

static void fill_decision(const SchedRequest *r, usec_t now, SchedDecision *d) {
        *d = (SchedDecision){
                .verdict = SCHED_ADMIT,
                .deadline = r->deadline,
                .predicted = r->predicted_end > now ? r->predicted_end - now : 0,
                .priority = r->priority,
        };
        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                d->worker[st] = r->stages[st].worker ? r->stages[st].worker->id : NULL;
}

/* When a slot among the outstanding requests is expected to open: the soonest predicted
 * end of those admitted (0, then the least retry, when one is already past its end), so
 * that the callers deferred by a full table come back when one can get in, not every
 * RetryMin all together. One walk of the table while no request comes or goes (a full
 * table defers every Admit: without it each would walk up to MaxRequests entries). */
static usec_t soonest_end(Scheduler *s, usec_t now) {
        if (!s->soonest_valid) {
                usec_t soonest = USEC_INFINITY;
                size_t it = 0;
                void *v;
                while (hashmap_iterate(s->requests, &it, &v, NULL))
                        soonest = MIN(soonest, ((const SchedRequest *)v)->predicted_end);
                s->soonest_end = soonest;
                s->soonest_valid = true;
        }
        return s->soonest_end != USEC_INFINITY && s->soonest_end > now ? s->soonest_end - now : 0;
}

/* min_time: the least time the request needs once admitted (0: not known yet). */
static int decide(Scheduler *s, TaskType t, SchedVerdict v, SchedReason reason, usec_t retry,
                  usec_t min_time, usec_t now, SchedDecision *d) {
        Pool *p = &s->pools[t];
        const SchedPoolPolicy *pp = &s->config.pools[t];

        if (v == SCHED_DEFER) {
                retry = CLAMP(retry, s->config.retry_min, s->config.retry_max);
                /* Deferring cannot help when retrying would miss the deadline anyway. */
                if (now + retry + min_time >= d->deadline) {
                        v = SCHED_REJECT;
                        reason = SCHED_REASON_WOULD_MISS_DEADLINE;
                } else if (pp->reject_rho > 0) {
                        SchedPoolMetrics m;
                        sched_pool_metrics(s, t, now, &m);
                        if (m.rho > pp->reject_rho) {
                                v = SCHED_REJECT;
                                reason = SCHED_REASON_OVERLOADED;
                        }
                }
        }
        d->verdict = v;
        d->reason = reason;
        d->retry_after = v == SCHED_DEFER ? retry : 0;
        p->m.by_reason[reason]++;
        if (v == SCHED_DEFER)
                p->m.deferred++;
        else {
                p->m.rejected++;
                /* Load on the pool, counted in its rho: not a request no worker could
                 * ever serve (no worker of a stage, a deadline nothing meets): a client
                 * sending those would otherwise turn everyone's retryable Defers into
                 * overloaded Rejects. */
                if (reason != SCHED_REASON_DEADLINE_INFEASIBLE && reason != SCHED_REASON_NO_WORKERS)
                        rate_tick(&p->arrivals, now, s->config.rate_window);
        }
        return 0;
}

/* Records an admitted request on the chosen workers' queues. */
static int admit(Scheduler *s, const char *request_id, TaskType t, int prio, const SchedHints *hints,
                 const Candidate *best, usec_t best_time, usec_t now, SchedDecision *ret) {
        Pool *p = &s->pools[t];
        SchedRequest *r;
        int k;

        r = calloc(1, sizeof *r);
        if (!r)
                return -ENOMEM;
        strcpy(r->id, request_id);
        r->type = t;
        r->priority = prio;
        r->seq = ++s->admissions;
        r->admitted = r->stage_start = now;
        r->deadline = ret->deadline;
        r->predicted_end = now + best_time;
        r->pages = r->want = hints->pages_needed;
        k = hashmap_put(s->requests, r->id, r);
        if (k < 0) {
                free(r);
                return k;
        }
        s->soonest_valid = false; /* and the predicted ends pushed back below */
        for (int st = 0; st < _SCHED_STAGE_MAX; st++) {
                SchedWorker *w = best[st].w;
                StageRef *ref = &r->stages[st];

                ref->req = r;
                if (!w)
                        continue;
                /* Lower-priority work here is pushed back by our service / slots. */
                ref->pushed = best[st].service / w->slots;
                LIST_FOREACH(queue, o, w->queue)
                        if (o->req->priority < prio)
                                o->req->predicted_end += ref->pushed;
                ref->worker = w;
                ref->service = best[st].service;
                est_settle(s, w, t, now); /* the decayed estimate admitted it */
                LIST_PREPEND(queue, w->queue, ref);
                w->outstanding++;
                w->outstanding_by_pool[t]++;
                if (st == SCHED_STAGE_DECODE)
                        w->reserved_pages += r->pages;
        }
        p->queue++;
        p->queue_peak = MAX(p->queue_peak, p->queue);
        p->m.admitted++;
        rate_tick(&p->arrivals, now, s->config.rate_window);
        pool_update_throttle(s, t);
        fill_decision(r, now, ret);
        return 0;
}

int sched_admit(Scheduler *s, const char *request_id, TaskType t, usec_t deadline,
                const SchedHints *hints, usec_t now, SchedDecision *ret) {
        static const SchedHints no_hints = {};
        const SchedPoolPolicy *pp;
        StageEval ev[_SCHED_STAGE_MAX];
        Candidate best[_SCHED_STAGE_MAX] = {};
        SchedRequest *r;
        Pool *p;
        bool need[_SCHED_STAGE_MAX] = { false, true, true };
        usec_t idle = 0, best_time = USEC_INFINITY, retry = 0;
        int prio;

        if (!id_valid(request_id, SCHED_REQUEST_ID_MAX) || t < 0 || t >= _TASK_TYPE_MAX || !ret)
                return -EINVAL;
        if (!hints)
                hints = &no_hints;
        pp = &s->config.pools[t];
        p = &s->pools[t];
        prio = pp->priority;

        r = hashmap_get(s->requests, request_id);
        if (r) {
                if (r->type != t)
                        return -EEXIST;
                fill_decision(r, now, ret);
                return 0;
        }

        *ret = (SchedDecision){ .deadline = deadline > 0 ? deadline : now + pp->default_deadline };
        if (ret->deadline <= now)
                return decide(s, t, SCHED_REJECT, SCHED_REASON_DEADLINE_INFEASIBLE, 0, 0, now, ret);
        if (p->queue >= pp->queue_max)
                return decide(s, t, SCHED_REJECT, SCHED_REASON_QUEUE_FULL, 0, 0, now, ret);
        if (hashmap_size(s->requests) >= s->config.max_requests)
                return decide(s, t, SCHED_DEFER, SCHED_REASON_TOO_MANY, soonest_end(s, now), 0, now, ret);
        pool_update_throttle(s, t);
        if (p->throttled) {
                double rate = rate_get(&p->completions, now, s->config.rate_window);
                /* In double, clamped before the cast: a rate decaying towards zero
                 * would overflow it (undefined; 0 on x86-64, then retry_min). */
                double d = rate > 0 ? (double)(p->queue - pp->low_watermark) / rate * USEC_PER_SEC : INFINITY;
                usec_t drain = d >= (double)s->config.retry_max ? s->config.retry_max : (usec_t)MAX(d, 0.0);
                return decide(s, t, SCHED_DEFER, SCHED_REASON_WATERMARK, drain, 0, now, ret);
        }

        /* The encoder is needed for multimodal input, unless a worker has the features;
         * with no encoder registered the cache is asked without one (worker NULL), so
         * cached features skip the stage whether or not an encoder exists. */
        if (hints->needs_encoder) {
                need[SCHED_STAGE_ENCODE] = true;
                if (s->n_workers[SCHED_STAGE_ENCODE] == 0)
                        need[SCHED_STAGE_ENCODE] = affinity(s, NULL, SCHED_STAGE_ENCODE, hints) < 1.0;
                for (size_t i = 0; i < s->n_workers[SCHED_STAGE_ENCODE]; i++)
                        if (affinity(s, s->workers[SCHED_STAGE_ENCODE][i], SCHED_STAGE_ENCODE, hints) >= 1.0) {
                                need[SCHED_STAGE_ENCODE] = false;
                                break;
                        }
        }

        for (int st = 0; st < _SCHED_STAGE_MAX; st++) {
                if (!need[st])
                        continue;
                eval_stage(s, (SchedStage)st, t, prio, hints, now, &ev[st]);
                if (ev[st].n_serving == 0)
                        return decide(s, t, SCHED_REJECT, SCHED_REASON_NO_WORKERS, 0, 0, now, ret);
                idle += ev[st].idle;
        }
        if (now + idle > ret->deadline)
                return decide(s, t, SCHED_REJECT, SCHED_REASON_DEADLINE_INFEASIBLE, 0, 0, now, ret);

        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                if (need[st] && ev[st].n_top == 0) {
                        SchedReason why = st == SCHED_STAGE_DECODE && ev[st].no_pages ? SCHED_REASON_NO_PAGES
                                                                                    : SCHED_REASON_BUSY;
                        return decide(s, t, SCHED_DEFER, why,
                                      ev[st].retry == USEC_INFINITY ? 0 : ev[st].retry, idle, now, ret);
                }

        /* Encoder: the best one. Prefill x decode: the best pair whose path is usable. */
        if (need[SCHED_STAGE_ENCODE])
                best[SCHED_STAGE_ENCODE] = ev[SCHED_STAGE_ENCODE].top[0];
        bool blocked = false;
        double best_score = INFINITY;
        for (size_t i = 0; i < ev[SCHED_STAGE_PREFILL].n_top; i++)
                for (size_t j = 0; j < ev[SCHED_STAGE_DECODE].n_top; j++) {
                        const Candidate *cp = &ev[SCHED_STAGE_PREFILL].top[i];
                        const Candidate *cd = &ev[SCHED_STAGE_DECODE].top[j];
                        SchedPressure pr = s->ops.path ? s->ops.path(s->ops.userdata, cp->w->id, cd->w->id)
                                                       : SCHED_PRESSURE_OK;
                        double score = (double)cp->time + (double)cd->time;

                        if (pr >= SCHED_PRESSURE_STOP || (pr == SCHED_PRESSURE_HIGH && prio < top_priority(s))) {
                                blocked = true;
                                continue;
                        }
                        if (pr == SCHED_PRESSURE_ELEVATED)
                                score *= 1.5;
                        if (score < best_score) {
                                best_score = score;
                                best[SCHED_STAGE_PREFILL] = *cp;
                                best[SCHED_STAGE_DECODE] = *cd;
                        }
                }
        if (!best[SCHED_STAGE_DECODE].w)
                return decide(s, t, SCHED_DEFER, blocked ? SCHED_REASON_BACKPRESSURE : SCHED_REASON_BUSY,
                              ev[SCHED_STAGE_DECODE].retry == USEC_INFINITY ? 0 : ev[SCHED_STAGE_DECODE].retry,
                              idle, now, ret);

        best_time = 0;
        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
                if (best[st].w)
                        best_time += best[st].time;
        if (now + best_time > ret->deadline) {
                /* Too much work ahead now; it drains at about the rate it was predicted. */
                retry = now + best_time - ret->deadline;
                if (now + retry + idle > ret->deadline)
                        return decide(s, t, SCHED_REJECT, SCHED_REASON_WOULD_MISS_DEADLINE, 0, 0, now, ret);
                return decide(s, t, SCHED_DEFER, SCHED_REASON_BUSY, retry, idle, now, ret);
        }

        return admit(s, request_id, t, prio, hints, best, best_time, now, ret);
}

int sched_complete(Scheduler *s, const char *request_id, SchedStage st, usec_t service_usec,
                   bool ok, usec_t now) {
        SchedRequest *r;
        SchedWorker *w;

        if (!request_id || st < 0 || st >= _SCHED_STAGE_MAX)
                return -EINVAL;
        r = hashmap_get(s->requests, request_id);
        if (!r)
                return -ENOENT;
        w = r->stages[st].worker;
        if (!w)
                return -ENOENT;
        usec_t used = service_usec > 0 ? service_usec : now > r->stage_start ? now - r->stage_start : 1;
        if (ok)
                est_sample(s, w, r->type, (double)used, now);
        r->stage_start = MAX(now, r->stage_start);
        stage_release(s, r, st, used, now);
        if (st == SCHED_STAGE_PREFILL && r->stages[SCHED_STAGE_DECODE].worker) {
                /* The prefill handed its KV off: the handoff took the decode's pages from
                 * the pool (its Prepare reserved them there), so they are out of the free
                 * count now; still reserving them would count them twice. */
                SchedWorker *dw = r->stages[SCHED_STAGE_DECODE].worker;
                dw->reserved_pages -= MIN(dw->reserved_pages, r->pages);
                r->pages = r->want = r->held = 0;
        }

        bool more = false;
        for (int i = st + 1; i < _SCHED_STAGE_MAX; i++)
                if (r->stages[i].worker)
                        more = true;
        if (!ok || !more)
                request_finish(s, r, ok ? FINISH_OK : FINISH_FAILED, now);
        return 0;
}

uint64_t sched_request_pages_taken(Scheduler *s, const char *request_id, int64_t n) {
        SchedRequest *r = request_id ? hashmap_get(s->requests, request_id) : NULL;
        SchedWorker *dw = r ? r->stages[SCHED_STAGE_DECODE].worker : NULL;
        uint64_t k;

        if (!dw)
                return 0;
        if (r->want == 0)
                return 0; /* its prefill completed: nothing is held back any more */
        if (n >= 0) {
                /* The pool's free count no longer has these pages. */
                k = (uint64_t)n;
                r->held = r->held > UINT64_MAX - k ? UINT64_MAX : r->held + k;
        } else {
                /* A handoff of it rolled back: they are free again. */
                k = MIN((uint64_t)-(n + 1) + 1, r->held);
                r->held -= k;
        }
        /* Held back: what it needs beyond what its handoffs hold now (two attempts of one
         * request, the older one still draining, hold pages of both: only what the
         * pool's count lacks of them is not promised again). */
        uint64_t pages = r->want > r->held ? r->want - r->held : 0;
        dw->reserved_pages = dw->reserved_pages - MIN(dw->reserved_pages, r->pages) + pages;
        r->pages = pages;
        return k;
}

int sched_cancel(Scheduler *s, const char *request_id, usec_t now) {
        SchedRequest *r = request_id ? hashmap_get(s->requests, request_id) : NULL;
        if (!r)
                return -ENOENT;
        request_finish(s, r, FINISH_FAILED, now);
        return 0;
}

unsigned sched_cancel_many(Scheduler *s, const char *const *request_ids, size_t n, usec_t now) {
        SchedRequest *list = NULL, **tail = &list, *last = NULL;
        unsigned k = 0;

        /* All together, in the order given (requests_finish()). A request is on the list
         * when its leaving_next is set or it is the last one: an id given twice ends it
         * once. */
        for (size_t i = 0; i < n; i++) {
                SchedRequest *r = request_ids[i] ? hashmap_get(s->requests, request_ids[i]) : NULL;
                if (!r || r == last || r->leaving_next)
                        continue;
                *tail = last = r;
                tail = &r->leaving_next;
                k++;
        }
        requests_finish(s, list, FINISH_FAILED, now);
        return k;
}

int sched_request_set_owner(Scheduler *s, const char *request_id, void *owner) {
        SchedRequest *r = request_id ? hashmap_get(s->requests, request_id) : NULL;
        if (!r)
                return -ENOENT;
        r->owner = owner;
        return 0;
}

const char *sched_request_stage_worker(Scheduler *s, const char *request_id, SchedStage st) {
        SchedRequest *r = request_id ? hashmap_get(s->requests, request_id) : NULL;
        if (!r || st < 0 || st >= _SCHED_STAGE_MAX || !r->stages[st].worker)
                return NULL;
        return r->stages[st].worker->id;
}

int sched_request_get_owner(Scheduler *s, const char *request_id, void **ret) {
        SchedRequest *r = request_id ? hashmap_get(s->requests, request_id) : NULL;
        if (!r)
                return -ENOENT;
        *ret = r->owner;
        return 0;
}

unsigned sched_expire(Scheduler *s, usec_t now) {
        SchedRequest *list = NULL, **tail = &list, *r;
        size_t i = 0;
        unsigned n = 0;

        /* All of this tick's together: one walk of each queue they leave (per priority),
         * not one per request (requests_finish()). */
        while (hashmap_iterate(s->requests, &i, (void **)&r, NULL))
                if (now > r->deadline && now - r->deadline > s->config.expire_grace) {
                        r->leaving_next = NULL;
                        *tail = r;
                        tail = &r->leaving_next;
                        n++;
                }
        requests_finish(s, list, FINISH_EXPIRED, now);
        return n;
}

void sched_pool_metrics(Scheduler *s, TaskType t, usec_t now, SchedPoolMetrics *ret) {
        Pool *p = &s->pools[t];
        double capacity = INFINITY;
        bool any = false;

        *ret = p->m;
        ret->queue = p->queue;
        ret->queue_peak = p->queue_peak;
        ret->throttled = p->throttled;
        ret->arrival_rate = rate_get(&p->arrivals, now, s->config.rate_window);
        ret->service_rate = rate_get(&p->completions, now, s->config.rate_window);
        /* Capacity: the bottleneck of prefill and decode, each the sum of slots / mean
         * service time of its workers serving this pool. */
        for (int st = SCHED_STAGE_PREFILL; st < _SCHED_STAGE_MAX; st++) {
                double c = 0;
                for (size_t k = 0; k < s->n_workers[st]; k++) {
                        SchedWorker *w = s->workers[st][k];
                        if (w->pools & (1u << t))
                                c += w->slots / (est_mean(s, w, t, now) / USEC_PER_SEC);
                }
                capacity = MIN(capacity, c);
                any = true;
        }
        ret->capacity = any && isfinite(capacity) ? capacity : 0;
        ret->rho = ret->capacity > 0 ? ret->arrival_rate / ret->capacity : ret->arrival_rate > 0 ? INFINITY : 0;
}
