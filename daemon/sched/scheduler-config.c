/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The scheduler's names (task types, stages, verdicts, reasons) and its config's
 * defaults and checks (scheduler.h): what the config parser and the bus use without a
 * Scheduler, apart from the admission and routing logic in scheduler.c. */
#include <errno.h>
#include <string.h>

#include "sched/scheduler.h"

/* ---- names ---- */

static const char *const task_type_table[_TASK_TYPE_MAX] = {
        [TASK_THINKING] = "thinking",
        [TASK_INTERACTIVE] = "interactive",
        [TASK_HYBRID] = "hybrid",
};
static const char *const stage_table[_SCHED_STAGE_MAX] = {
        [SCHED_STAGE_ENCODE] = "encode",
        [SCHED_STAGE_PREFILL] = "prefill",
        [SCHED_STAGE_DECODE] = "decode",
};
static const char *const verdict_table[_SCHED_VERDICT_MAX] = {
        [SCHED_ADMIT] = "admit",
        [SCHED_DEFER] = "defer",
        [SCHED_REJECT] = "reject",
};
static const char *const reason_table[_SCHED_REASON_MAX] = {
        [SCHED_REASON_NONE] = "none",
        [SCHED_REASON_QUEUE_FULL] = "queue-full",
        [SCHED_REASON_WATERMARK] = "over-watermark",
        [SCHED_REASON_NO_WORKERS] = "no-workers",
        [SCHED_REASON_DEADLINE_INFEASIBLE] = "deadline-infeasible",
        [SCHED_REASON_WOULD_MISS_DEADLINE] = "would-miss-deadline",
        [SCHED_REASON_BUSY] = "busy",
        [SCHED_REASON_NO_PAGES] = "no-pages",
        [SCHED_REASON_BACKPRESSURE] = "backpressure",
        [SCHED_REASON_OVERLOADED] = "overloaded",
        [SCHED_REASON_TOO_MANY] = "too-many-requests",
};

const char *task_type_to_string(TaskType t) {
        return t >= 0 && t < _TASK_TYPE_MAX ? task_type_table[t] : NULL;
}
TaskType task_type_from_string(const char *s) {
        for (int i = 0; s && i < _TASK_TYPE_MAX; i++)
                if (strcmp(s, task_type_table[i]) == 0)
                        return (TaskType)i;
        return _TASK_TYPE_INVALID;
}
const char *sched_stage_to_string(SchedStage s) {
        return s >= 0 && s < _SCHED_STAGE_MAX ? stage_table[s] : NULL;
}
SchedStage sched_stage_from_string(const char *s) {
        for (int i = 0; s && i < _SCHED_STAGE_MAX; i++)
                if (strcmp(s, stage_table[i]) == 0)
                        return (SchedStage)i;
        return _SCHED_STAGE_INVALID;
}
const char *sched_verdict_to_string(SchedVerdict v) {
        return v >= 0 && v < _SCHED_VERDICT_MAX ? verdict_table[v] : NULL;
}
const char *sched_reason_to_string(SchedReason r) {
        return r >= 0 && r < _SCHED_REASON_MAX ? reason_table[r] : NULL;
}

/* ---- config ---- */

void sched_config_defaults(SchedConfig *c) {
        *c = (SchedConfig){
                .max_requests = SCHED_REQUESTS_MAX_DEFAULT,
                .rate_window = 10 * USEC_PER_SEC,
                .retry_min = 10 * USEC_PER_MSEC,
                .retry_max = 10 * USEC_PER_SEC,
                .expire_grace = 60 * USEC_PER_SEC,
        };
        c->pools[TASK_INTERACTIVE] = (SchedPoolPolicy){
                .priority = 2, .default_deadline = 2 * USEC_PER_SEC,
                .queue_max = 4096, .high_watermark = 3072, .low_watermark = 2048,
                .worker_share = 1.0, .reject_rho = 2.0,
                .service_estimate = { 50 * USEC_PER_MSEC, 100 * USEC_PER_MSEC, 500 * USEC_PER_MSEC },
        };
        c->pools[TASK_HYBRID] = (SchedPoolPolicy){
                .priority = 1, .default_deadline = 10 * USEC_PER_SEC,
                .queue_max = 4096, .high_watermark = 3072, .low_watermark = 2048,
                .worker_share = 0.75, .reject_rho = 2.0,
                .service_estimate = { 50 * USEC_PER_MSEC, 200 * USEC_PER_MSEC, 2 * USEC_PER_SEC },
        };
        c->pools[TASK_THINKING] = (SchedPoolPolicy){
                .priority = 0, .default_deadline = 60 * USEC_PER_SEC,
                .queue_max = 4096, .high_watermark = 3072, .low_watermark = 2048,
                .worker_share = 0.5, .reject_rho = 2.0,
                .service_estimate = { 50 * USEC_PER_MSEC, 200 * USEC_PER_MSEC, 10 * USEC_PER_SEC },
        };
}

int sched_config_validate(const SchedConfig *c, const char **error_text) {
        const char *e = NULL;

        if (c->max_requests == 0)
                e = "MaxRequests must be positive";
        else if (c->rate_window == 0)
                e = "RateWindow must be positive";
        else if (c->retry_min == 0 || c->retry_min > c->retry_max)
                e = "RetryMin must be positive and not above RetryMax";
        for (int t = 0; !e && t < _TASK_TYPE_MAX; t++) {
                const SchedPoolPolicy *p = &c->pools[t];
                if (p->queue_max == 0 || p->high_watermark == 0 || p->high_watermark > p->queue_max ||
                    p->low_watermark >= p->high_watermark)
                        e = "watermarks must satisfy LowWatermark < HighWatermark <= QueueMax";
                else if (!(p->worker_share > 0 && p->worker_share <= 1))
                        e = "WorkerShare must be in (0, 1]";
                else if (!(p->reject_rho == 0 || p->reject_rho >= 1))
                        e = "RejectRho must be 0 (off) or at least 1";
                else if (p->default_deadline == 0)
                        e = "DefaultDeadline must be positive";
                for (int st = 0; !e && st < _SCHED_STAGE_MAX; st++)
                        if (p->service_estimate[st] == 0)
                                e = "ServiceEstimate must be positive";
        }
        if (error_text)
                *error_text = e;
        return e ? -EINVAL : 0;
}
