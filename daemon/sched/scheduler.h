/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* (Named scheduler.h, not sched.h: daemon/ is on the include path and sched.h would
 * shadow the C library's <sched.h>, which <pthread.h> includes.) */

/* Admission and routing (docs/scheduler.md). Pure: no bus, no clock of its own —
 * every call takes `now` (CLOCK_MONOTONIC in epdd, a simulated clock in the tests).
 *
 * Requests come in three task types, each with a pool policy. Admit() answers
 * admit (with the encoder, prefill and decode worker to use), defer (with a
 * retry-after) or reject (with a reason), from:
 *   - the pool's outstanding requests against its watermarks and hard bound,
 *   - per (worker, pool) service times learnt from Complete() reports (an EWMA of
 *     the mean and of the deviation, like TCP's RTO: estimate = srtt + 4 rttvar),
 *   - the predicted completion on each candidate path versus the deadline,
 *     including the delay it would add to lower-priority work already admitted
 *     (which must still meet its own deadlines),
 *   - free KV pages at the decode worker (reserved per admitted request),
 *   - affinity (a worker that holds the request's features or prefix pages skips
 *     part of the work) and the backpressure level of the prefill -> decode path,
 *   - rho = arrival rate / service capacity: while a pool is overloaded past its
 *     policy's reject_rho, work that would be deferred is rejected instead.
 *
 * The contract with workers: a worker runs up to `slots` requests at once and
 * starts waiting ones by pool priority, FIFO within a priority (vLLM's priority
 * scheduling policy). Nothing here is unbounded: requests, workers, request ids. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "macro.h"
#include "time-util.h"

#define SCHED_REQUEST_ID_MAX 128
#define SCHED_WORKER_ID_MAX 64
#define SCHED_WORKERS_MAX 1024
#define SCHED_REQUESTS_MAX_DEFAULT 65536u

typedef enum TaskType {
        TASK_THINKING,
        TASK_INTERACTIVE,
        TASK_HYBRID,
        _TASK_TYPE_MAX,
        _TASK_TYPE_INVALID = -EINVAL,
} TaskType;

typedef enum SchedStage {
        SCHED_STAGE_ENCODE,
        SCHED_STAGE_PREFILL,
        SCHED_STAGE_DECODE,
        _SCHED_STAGE_MAX,
        _SCHED_STAGE_INVALID = -EINVAL,
} SchedStage;

typedef enum SchedVerdict {
        SCHED_ADMIT,
        SCHED_DEFER,
        SCHED_REJECT,
        _SCHED_VERDICT_MAX,
} SchedVerdict;

typedef enum SchedReason {
        SCHED_REASON_NONE,
        SCHED_REASON_QUEUE_FULL,         /* reject: pool at its hard bound */
        SCHED_REASON_WATERMARK,          /* defer: pool above its high watermark, draining */
        SCHED_REASON_NO_WORKERS,         /* reject: no worker serves a needed stage */
        SCHED_REASON_DEADLINE_INFEASIBLE,/* reject: even idle workers would miss it */
        SCHED_REASON_WOULD_MISS_DEADLINE,/* reject: waiting for room would miss it */
        SCHED_REASON_BUSY,               /* defer: no worker has room in time now */
        SCHED_REASON_NO_PAGES,           /* defer: no decode worker has the free pages */
        SCHED_REASON_BACKPRESSURE,       /* defer: every usable path is backpressured */
        SCHED_REASON_OVERLOADED,         /* reject: rho above the pool's reject_rho */
        SCHED_REASON_TOO_MANY,           /* defer: the scheduler's request table is full */
        _SCHED_REASON_MAX,
} SchedReason;

/* Backpressure of a path, as the telemetry subsystem reports it. */
typedef enum SchedPressure {
        SCHED_PRESSURE_OK,
        SCHED_PRESSURE_ELEVATED, /* usable; other paths preferred */
        SCHED_PRESSURE_HIGH,     /* only the highest-priority pool may use it */
        SCHED_PRESSURE_STOP,     /* nothing new */
        _SCHED_PRESSURE_MAX,
} SchedPressure;

typedef struct SchedPoolPolicy {
        int priority;              /* higher is served first */
        usec_t default_deadline;   /* relative; used when Admit() gives none */
        unsigned queue_max;        /* hard bound on outstanding requests */
        unsigned high_watermark;   /* at or above: defer until back at low_watermark */
        unsigned low_watermark;
        double worker_share;       /* fraction of a worker's queue this pool may fill */
        double reject_rho;         /* defer turns into reject above this rho (0: never) */
        usec_t service_estimate[_SCHED_STAGE_MAX]; /* before any Complete() report */
} SchedPoolPolicy;

typedef struct SchedConfig {
        SchedPoolPolicy pools[_TASK_TYPE_MAX];
        unsigned max_requests;     /* outstanding, all pools */
        usec_t rate_window;        /* time constant of the rate EWMAs */
        usec_t retry_min, retry_max;
        usec_t expire_grace;       /* a request not completed by deadline + grace is dropped */
} SchedConfig;

/* Fills the embedded defaults (docs/scheduler.md lists them). */
void sched_config_defaults(SchedConfig *c);
int sched_config_validate(const SchedConfig *c, const char **error_text);

typedef struct SchedWorkerInfo {
        const char *id;
        SchedStage stage;       /* the stage it serves (a colocated worker: add it twice) */
        unsigned pools;         /* bit (1 << TaskType) per pool it serves (0: none, for now) */
        unsigned slots;         /* requests it runs at once */
        unsigned queue_limit;   /* outstanding at most; 0: 4 * slots */
        uint64_t free_pages;    /* decode: free KV pages */
} SchedWorkerInfo;

typedef struct SchedHints {
        uint64_t pages_needed;  /* KV pages the decode worker must have free */
        bool needs_encoder;     /* multimodal input */
        const void *affinity_key; /* opaque, passed to ops->affinity */
} SchedHints;

typedef struct SchedOps {
        /* Fraction (0..1) of the stage's work that this worker skips for this request:
         * cached features (1.0 for an encoder: the stage is skipped), prefix pages.
         * worker is NULL when the encode stage is asked about with no encoder
         * registered: 1.0 if the features are cached wherever they are encoded. */
        double (*affinity)(void *userdata, const char *worker, SchedStage stage, const SchedHints *h);
        /* Backpressure of the path between two workers (from -> to). */
        SchedPressure (*path)(void *userdata, const char *from, const char *to);
        /* A request that has an owner ended (completed, failed, expired, cancelled, or the
         * scheduler freed): the owner may go. */
        void (*finished)(void *userdata, const char *request_id, void *owner);
        void *userdata;
} SchedOps;

typedef struct SchedDecision {
        SchedVerdict verdict;
        SchedReason reason;
        usec_t retry_after;            /* defer: relative */
        usec_t deadline;               /* absolute, as used */
        usec_t predicted;              /* admit: predicted completion, relative to now */
        int priority;                  /* admit: what the workers should order by */
        const char *worker[_SCHED_STAGE_MAX]; /* admit: chosen workers (NULL: stage skipped);
                                        * valid until the worker is removed */
} SchedDecision;

typedef struct SchedPoolMetrics {
        unsigned queue;          /* outstanding */
        unsigned queue_peak;
        bool throttled;          /* between high and low watermark */
        double arrival_rate;     /* final decisions (admit + reject) per second */
        double service_rate;     /* completions per second */
        double capacity;         /* requests per second the pool's workers can serve */
        double rho;              /* arrival_rate / capacity */
        uint64_t admitted, deferred, rejected, completed, failed, deadline_misses, expired;
        uint64_t by_reason[_SCHED_REASON_MAX]; /* defers and rejects */
} SchedPoolMetrics;

typedef struct Scheduler Scheduler;

int sched_new(const SchedConfig *c, Scheduler **ret);
Scheduler *sched_free(Scheduler *s);
DEFINE_TRIVIAL_CLEANUP_FUNC(Scheduler *, sched_free);
void sched_set_ops(Scheduler *s, const SchedOps *ops);
/* A pointer for the owner (epdd's glue keeps its event sources there). */
void sched_set_userdata(Scheduler *s, void *userdata);
void *sched_get_userdata(const Scheduler *s);
/* Applies a new config (reload): pool policies and limits; outstanding requests stay. */
int sched_reconfigure(Scheduler *s, const SchedConfig *c);

int sched_worker_add(Scheduler *s, const SchedWorkerInfo *info);
/* Its outstanding requests are dropped (counted as failed). */
int sched_worker_remove(Scheduler *s, const char *id, SchedStage stage, usec_t now);
int sched_worker_set_free_pages(Scheduler *s, const char *id, uint64_t free_pages);
/* The same, and the most free pages one of its arenas has: a request's pages land in one
 * arena (the handoff's), so a request needing more than that is deferred "no-pages" even
 * when the arenas together have room (UINT64_MAX: not known, as set_free_pages). */
int sched_worker_set_pages(Scheduler *s, const char *id, uint64_t free_pages, uint64_t largest);
/* Changes a worker's capacity at a stage in place: slots (0: as it is) and queue limit
 * (0: 4 x slots when slots change, else as it is). Its outstanding requests stay (they
 * run there already); new ones see the new capacity. -ENOENT, -EINVAL (ranges as for
 * sched_worker_add()). */
int sched_worker_set_capacity(Scheduler *s, const char *id, SchedStage stage, unsigned slots, unsigned queue_limit);
/* Changes the pools a worker serves at a stage (a config reload). Its outstanding
 * requests stay; new ones are routed by the new set (0: none). -ENOENT, -EINVAL. */
int sched_worker_set_pools(Scheduler *s, const char *id, SchedStage stage, unsigned pools);
/* The KV pages a decode worker's admitted requests hold back (0 if it is not there):
 * from Admit until their prefill completes (the handoff has the pages then). */
uint64_t sched_worker_reserved_pages(Scheduler *s, const char *id);
/* The pools a worker serves at a stage (bit per TaskType); 0 if it is not there. */
unsigned sched_worker_get_pools(Scheduler *s, const char *id, SchedStage stage);

/* deadline: absolute on the scheduler's clock; 0: now + the pool's default. Admitting
 * an id that is already outstanding admits nothing again (idempotent): *ret is ADMIT
 * with the request as it stands, the same deadline and priority, the predicted time
 * left, and the workers of the stages not completed yet (NULL for a completed one). */
int sched_admit(Scheduler *s, const char *request_id, TaskType type, usec_t deadline,
                const SchedHints *hints, usec_t now, SchedDecision *ret);
/* A stage of a request finished on its worker; service_usec is the time the worker
 * spent (0: the daemon uses the time since the previous stage ended). The decode stage
 * (or ok == false at any stage) ends the request. -ENOENT: unknown request or stage. */
int sched_complete(Scheduler *s, const char *request_id, SchedStage stage, usec_t service_usec,
                   bool ok, usec_t now);
/* A handoff of an outstanding request took n KV pages from its decode worker's pool
 * before its prefill completed (its Prepare): the free count no longer has them, so the
 * request holds back only what it needs beyond what its handoffs hold (not counted
 * twice). n < 0: -n of them came back uncommitted (a rollback). Returns how many it
 * counted, which the handoff gives back when it rolls back (its own, not another
 * attempt's); 0 when the request is not outstanding, has no decode stage or its
 * prefill completed (nothing is held back then). */
uint64_t sched_request_pages_taken(Scheduler *s, const char *request_id, int64_t n);
/* Ends an outstanding request at once, as failed (its owner went away). -ENOENT. */
int sched_cancel(Scheduler *s, const char *request_id, usec_t now);
/* The same for n requests that go together (a client's, when it goes): one walk of each
 * queue they leave per priority among them, not one per request, with the results of
 * ending them one at a time in the order given. Ids not outstanding, and repeats, are
 * skipped; each id is read before any owner is told (ops->finished may free them).
 * Returns how many ended. */
unsigned sched_cancel_many(Scheduler *s, const char *const *request_ids, size_t n, usec_t now);
/* What the caller attaches to an outstanding request (ops->finished gets it back at the
 * end), and reads back; -ENOENT when the request is not outstanding. */
int sched_request_set_owner(Scheduler *s, const char *request_id, void *owner);
int sched_request_get_owner(Scheduler *s, const char *request_id, void **ret);
/* The id of the worker an outstanding request's stage was given to (NULL: none). */
const char *sched_request_stage_worker(Scheduler *s, const char *request_id, SchedStage st);
/* Drops requests whose workers never reported (deadline + grace passed). Returns how many. */
unsigned sched_expire(Scheduler *s, usec_t now);

void sched_pool_metrics(Scheduler *s, TaskType type, usec_t now, SchedPoolMetrics *ret);
unsigned sched_outstanding(const Scheduler *s);
/* Queue entries visited so far giving back the pushes of requests that left (the work
 * behind Complete, Cancel, expiry and worker removal; the tests bound it). */
uint64_t sched_give_back_steps(const Scheduler *s);

const char *task_type_to_string(TaskType t);
TaskType task_type_from_string(const char *s);
const char *sched_stage_to_string(SchedStage s);
SchedStage sched_stage_from_string(const char *s);
const char *sched_verdict_to_string(SchedVerdict v);
const char *sched_reason_to_string(SchedReason r);
