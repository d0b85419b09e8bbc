/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* A completion thread of the copy engine (one per device and path) waiting for a
 * part's event: the pace it learns of its path (gpu_copy_pace_*, copy.h) and the wait
 * that sleeps until shortly before the predicted end, polls, naps, and only then takes
 * the blocking sync. */
#include <errno.h>
#include <time.h>

#include "copy-internal.h"
#include "macro.h"
#include "time-util.h"

/* The pace of one path of one GPU, learned by its completion thread from the parts it
 * saw end. Optimistic on purpose: it rises at once to a faster part and falls an eighth
 * of the way to a slower one, so that a predicted end falls early rather than late (a
 * part predicted early costs polling, one predicted late a wake-up after its end). */
uint64_t gpu_copy_pace_predict(const GpuCopyPace *p, uint64_t queued_usec, uint64_t bytes) {
        if (p->bytes_per_usec <= 0)
                return 0;
        /* A part queued behind another starts when that one ends. */
        uint64_t start = MAX(queued_usec, p->last_end_usec);
        return start + (uint64_t)((double)bytes / p->bytes_per_usec);
}

/* The pace becomes at least v (a part went at least that fast). */
static void pace_raise(GpuCopyPace *p, double v) {
        if (v > p->bytes_per_usec)
                p->bytes_per_usec = MIN(v, GPU_COPY_PACE_MAX);
}

void gpu_copy_pace_observe(GpuCopyPace *p, uint64_t queued_usec, uint64_t bytes, uint64_t seen_usec, GpuCopySeen how,
                           uint64_t look_usec) {
        uint64_t start = MAX(queued_usec, p->last_end_usec);
        bool sized = bytes >= GPU_COPY_PACE_MIN_BYTES;

        switch (how) {
        case GPU_COPY_SEEN_AT_ONCE:
                /* Ended by the first look, which may come long after (the thread was on
                 * another part): it took at most this long, so it went at least this
                 * fast; a pace not known yet stays so. */
                if (sized && p->bytes_per_usec > 0 && seen_usec > start)
                        pace_raise(p, (double)bytes / (double)(seen_usec - start));
                break;
        case GPU_COPY_SEEN_OVERSLEPT:
                /* Ended before the thread woke from its timer at look_usec: faster than
                 * thought, by how much is not known. */
                if (p->bytes_per_usec > 0)
                        pace_raise(p, p->bytes_per_usec * 1.5);
                if (sized && look_usec > start)
                        pace_raise(p, (double)bytes / (double)(look_usec - start));
                break;
        case GPU_COPY_SEEN_POLLING:
                if (sized && seen_usec >= start + GPU_COPY_PACE_MIN_USEC) {
                        double v = (double)bytes / (double)(seen_usec - start);
                        if (v > p->bytes_per_usec)
                                pace_raise(p, v);
                        else
                                p->bytes_per_usec += (v - p->bytes_per_usec) / 8;
                }
                break;
        case GPU_COPY_SEEN_LATE:
                /* Seen at a wake-up of unknown lateness; but it was still running at the
                 * last look (look_usec): no faster than that. A pace not known yet starts
                 * there; a known one falls an eighth of the way, as for a slower part
                 * (one part held up behind other work must not make the next ones wait
                 * for a timer long after their end). */
                if (sized && look_usec >= start + GPU_COPY_PACE_MIN_USEC) {
                        double bound = (double)bytes / (double)(look_usec - start);
                        if (p->bytes_per_usec <= 0)
                                p->bytes_per_usec = bound;
                        else if (p->bytes_per_usec > bound)
                                p->bytes_per_usec += (bound - p->bytes_per_usec) / 8;
                }
                break;
        }
        p->last_end_usec = MAX(p->last_end_usec, seen_usec);
}

/* Longest the completion thread sleeps on its timer before a part's predicted end
 * (then it polls and naps): parts longer than this and the naps together are left to
 * the blocking sync, whose late wake-up is small beside them. */
#define PACE_SLEEP_MAX_USEC 20000U
/* A sleep shorter than this is not worth the timer: poll instead. */
#define PACE_SLEEP_MIN_USEC 20U
/* How late a timer may wake the thread (its timer slack is set to the least): it wakes
 * this much earlier, and polls this much longer. */
#define PACE_TIMER_LATE_USEC 50U
/* Past its polling window a part is looked at every NAP µs (a timer's wake-up, not the
 * interrupt's), for up to NAP_MAX µs; then the blocking sync. */
#define PACE_NAP_USEC 50U
#define PACE_NAP_MAX_USEC 20000U

static void sleep_until(uint64_t usec) {
        struct timespec ts = { .tv_sec = (time_t)(usec / USEC_PER_SEC), .tv_nsec = (long)(usec % USEC_PER_SEC) * 1000 };
        while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR)
                ;
}

/* A part's event, waited for by its queue's completion thread (gpu/copy-internal.h).
 * With spin_usec > 0 (gpu_copy_engine_set_spin()): when the path's pace places the
 * part's end further away than half of spin_usec (and the timer's lateness), the thread
 * sleeps on its timer until then; it polls the event for up to spin_usec (and the timer's lateness), then
 * every PACE_NAP_USEC for up to PACE_NAP_MAX_USEC, and only then waits with the blocking
 * sync (which sleeps until the GPU's interrupt wakes it: 0.1 to 0.7 ms late on some
 * machines, 0.02 ms on others). spin_usec 0: the blocking sync at once. *how says how it
 * was seen (gpu_copy_pace_observe()); *look: when it was last seen running (LATE), or
 * when the thread woke from its timer (OVERSLEPT). */
int gpu_copy_event_wait(GpuSystem *s, CUevent event, uint64_t queued_usec, uint64_t bytes, const GpuCopyPace *pace,
                        unsigned spin_usec, GpuCopySeen *how, uint64_t *look) {
        uint64_t now = now_usec(CLOCK_MONOTONIC), end, lead = spin_usec / 2 + PACE_TIMER_LATE_USEC;
        bool first = true, slept = false;
        CUresult q;

        *how = GPU_COPY_SEEN_LATE;
        *look = 0;
        if (spin_usec == 0)
                return CU(s->driver, cuEventSynchronize, event);
        end = gpu_copy_pace_predict(pace, queued_usec, bytes);
        if (end > now + lead + PACE_SLEEP_MIN_USEC) {
                q = s->driver->cuEventQuery(event);
                if (q != CUDA_ERROR_NOT_READY) {
                        *how = GPU_COPY_SEEN_AT_ONCE;
                        return q == CUDA_SUCCESS ? 0 : cuda_check(s->driver, q, "cuEventQuery");
                }
                first = false;
                sleep_until(MIN(end - lead, now + PACE_SLEEP_MAX_USEC));
                slept = true;
                now = now_usec(CLOCK_MONOTONIC);
                *look = now;
        }
        for (uint64_t spin_end = now + spin_usec + PACE_TIMER_LATE_USEC, nap_end = spin_end + PACE_NAP_MAX_USEC;;) {
                /* The clock before the look: running then, if the look says so. */
                uint64_t before = now_usec(CLOCK_MONOTONIC);
                q = s->driver->cuEventQuery(event);
                if (q != CUDA_ERROR_NOT_READY) {
                        *how = slept ? GPU_COPY_SEEN_OVERSLEPT : first ? GPU_COPY_SEEN_AT_ONCE : GPU_COPY_SEEN_POLLING;
                        return q == CUDA_SUCCESS ? 0 : cuda_check(s->driver, q, "cuEventQuery");
                }
                first = slept = false;
                *look = before;
                now = now_usec(CLOCK_MONOTONIC);
                if (now >= nap_end)
                        return CU(s->driver, cuEventSynchronize, event);
                if (now >= spin_end)
                        sleep_until(now + PACE_NAP_USEC);
        }
}
