/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "conf-table.h"
#include "macro.h"
#include "parse-util.h"
#include "telemetry/backpressure.h"

static const char *const level_names[_BACKPRESSURE_LEVEL_MAX] = {
        [BACKPRESSURE_NONE] = "none",
        [BACKPRESSURE_ELEVATED] = "elevated",
        [BACKPRESSURE_HIGH] = "high",
        [BACKPRESSURE_STALLED] = "stalled",
};

static const char *const reason_names[_BACKPRESSURE_REASON_MAX] = {
        [BACKPRESSURE_REASON_NONE] = "none",
        [BACKPRESSURE_REASON_RTT_INFLATION] = "rtt-inflation",
        [BACKPRESSURE_REASON_RETRANSMITS] = "retransmits",
        [BACKPRESSURE_REASON_SEND_QUEUE] = "send-queue",
        [BACKPRESSURE_REASON_SEND_QUEUE_GROWTH] = "send-queue-growth",
        [BACKPRESSURE_REASON_HANDOFFS_IN_FLIGHT] = "handoffs-in-flight",
        [BACKPRESSURE_REASON_DESTINATION_FULL] = "destination-full",
        [BACKPRESSURE_REASON_STALLED] = "stalled",
        [BACKPRESSURE_REASON_DISCONNECTED] = "disconnected",
};

const char *backpressure_level_to_string(BackpressureLevel l) {
        return (unsigned)l < _BACKPRESSURE_LEVEL_MAX ? level_names[l] : NULL;
}

const char *backpressure_reason_to_string(BackpressureReason r) {
        return (unsigned)r < _BACKPRESSURE_REASON_MAX ? reason_names[r] : NULL;
}

int backpressure_level_from_string(const char *s) {
        if (!s)
                return -EINVAL;
        for (unsigned i = 0; i < _BACKPRESSURE_LEVEL_MAX; i++)
                if (strcmp(s, level_names[i]) == 0)
                        return (int)i;
        return -EINVAL;
}

void backpressure_config_defaults(BackpressureConfig *c) {
        *c = (BackpressureConfig){
                .enabled = true,
                .interval_usec = 200 * USEC_PER_MSEC,
                .rtt_inflation = { 2.0, 4.0 },
                .rtt_floor_usec = 500,
                .rtt_min_bytes = 64 * 1024,
                .retransmit_rate = { 0.01, 0.05 },
                .send_queue_bytes = { 4ULL << 20, 16ULL << 20 },
                .send_queue_growth = { 32ULL << 20, 128ULL << 20 },
                .handoffs_in_flight = { 64, 256 },
                .destination_free = { 0.10, 0.02 },
                .stall_usec = 2 * USEC_PER_SEC,
                .hold_usec = 1 * USEC_PER_SEC,
                .release = 0.8,
                .window_handoffs = 128,
                .window_bytes = 4ULL << 30,
                .window_elevated = 0.25,
        };
}

static int p_interval(const char *value, void *dst) {
        usec_t u;
        int r = parse_duration(value, &u);
        if (r < 0)
                return r;
        if (u < USEC_PER_MSEC || u > 60 * USEC_PER_SEC)
                return -EINVAL;
        *(usec_t *)dst = u;
        return 0;
}

static int p_rtt_floor(const char *value, void *dst) {
        usec_t u;
        int r = parse_duration(value, &u);
        if (r < 0)
                return r;
        if (u > UINT32_MAX)
                return -EINVAL;
        *(uint32_t *)dst = (uint32_t)u;
        return 0;
}

#define B(f) offsetof(BackpressureConfig, f)
static const ConfTableItem backpressure_items[] = {
        { "Enabled", conf_parse_bool, B(enabled) },
        { "Interval", p_interval, B(interval_usec) },
        { "RTTInflationElevated", conf_parse_ratio, B(rtt_inflation[0]) },
        { "RTTInflationHigh", conf_parse_ratio, B(rtt_inflation[1]) },
        { "RTTFloor", p_rtt_floor, B(rtt_floor_usec) },
        { "RTTMinBytes", conf_parse_size, B(rtt_min_bytes) },
        { "RetransmitRateElevated", conf_parse_ratio, B(retransmit_rate[0]) },
        { "RetransmitRateHigh", conf_parse_ratio, B(retransmit_rate[1]) },
        { "SendQueueElevated", conf_parse_size, B(send_queue_bytes[0]) },
        { "SendQueueHigh", conf_parse_size, B(send_queue_bytes[1]) },
        { "SendQueueGrowthElevated", conf_parse_size, B(send_queue_growth[0]) },
        { "SendQueueGrowthHigh", conf_parse_size, B(send_queue_growth[1]) },
        { "HandoffsElevated", conf_parse_unsigned, B(handoffs_in_flight[0]) },
        { "HandoffsHigh", conf_parse_unsigned, B(handoffs_in_flight[1]) },
        { "DestinationFreeElevated", conf_parse_ratio, B(destination_free[0]) },
        { "DestinationFreeHigh", conf_parse_ratio, B(destination_free[1]) },
        { "StallTimeout", conf_parse_duration, B(stall_usec) },
        { "Hold", conf_parse_duration, B(hold_usec) },
        { "Release", conf_parse_ratio, B(release) },
        { "WindowHandoffs", conf_parse_unsigned, B(window_handoffs) },
        { "WindowBytes", conf_parse_size, B(window_bytes) },
        { "WindowElevated", conf_parse_ratio, B(window_elevated) },
};
#undef B

int backpressure_config_set(BackpressureConfig *c, const char *key, const char *value) {
        if (!c || !key || !value)
                return -EINVAL;
        return conf_table_set(backpressure_items, ELEMENTSOF(backpressure_items), c, key, value);
}

int backpressure_config_verify(const BackpressureConfig *c, const char **ret_problem) {
        const char *p = NULL;

#define ORDERED(a) ((a)[0] == 0 || (a)[1] == 0 || (a)[0] <= (a)[1])
        if (!ORDERED(c->rtt_inflation))
                p = "RTTInflationElevated must not exceed RTTInflationHigh";
        else if ((c->rtt_inflation[0] != 0 && c->rtt_inflation[0] < 1.0) ||
                 (c->rtt_inflation[1] != 0 && c->rtt_inflation[1] < 1.0))
                p = "RTTInflationElevated and RTTInflationHigh must be at least 1.0 (srtt over min RTT)";
        else if (!ORDERED(c->retransmit_rate))
                p = "RetransmitRateElevated must not exceed RetransmitRateHigh";
        else if (c->retransmit_rate[0] > 1.0 || c->retransmit_rate[1] > 1.0)
                p = "retransmit rates are fractions of sent segments (0..1)";
        else if (!ORDERED(c->send_queue_bytes))
                p = "SendQueueElevated must not exceed SendQueueHigh";
        else if (!ORDERED(c->send_queue_growth))
                p = "SendQueueGrowthElevated must not exceed SendQueueGrowthHigh";
        else if (!ORDERED(c->handoffs_in_flight))
                p = "HandoffsElevated must not exceed HandoffsHigh";
        else if (c->destination_free[0] > 1.0 || c->destination_free[1] > 1.0)
                p = "destination free thresholds are fractions (0..1)";
        else if (c->destination_free[0] != 0 && c->destination_free[1] > c->destination_free[0])
                p = "DestinationFreeHigh must not exceed DestinationFreeElevated";
        else if (c->release <= 0.0 || c->release > 1.0)
                p = "Release must be in (0, 1]";
        else if (c->interval_usec == 0)
                p = "Interval must not be zero";
        else if (c->window_elevated <= 0.0 || c->window_elevated > 1.0)
                p = "WindowElevated must be in (0, 1]";
#undef ORDERED

        if (ret_problem)
                *ret_problem = p;
        return p ? -EINVAL : 0;
}

void backpressure_state_init(BackpressureState *s) {
        *s = (BackpressureState){};
}

/* Level for "bigger is worse" signals; a zero threshold is off. */
static BackpressureLevel level_above(double v, double elevated, double high, double scale) {
        if (high > 0 && v >= high * scale)
                return BACKPRESSURE_HIGH;
        if (elevated > 0 && v >= elevated * scale)
                return BACKPRESSURE_ELEVATED;
        return BACKPRESSURE_NONE;
}

BackpressureLevel backpressure_evaluate(const BackpressureState *s, const BackpressureConfig *c,
                                        const BackpressureSample *x, double scale,
                                        BackpressureReason *ret_reason) {
        BackpressureLevel best = BACKPRESSURE_NONE, l;
        BackpressureReason why = BACKPRESSURE_REASON_NONE;

#define CONSIDER(level, reason)                                                          \
        do {                                                                             \
                l = (level);                                                             \
                if (l > best) {                                                          \
                        best = l;                                                        \
                        why = (reason);                                                  \
                }                                                                        \
        } while (0)

        if (!x->connected) {
                if (ret_reason)
                        *ret_reason = BACKPRESSURE_REASON_DISCONNECTED;
                return BACKPRESSURE_STALLED;
        }

        if (x->have_kernel) {
                /* The kernel's records lag one ACK (tcp_probe fires before the ACK is
                 * processed), so an idle connection can look like it has data
                 * outstanding. A stall is therefore: no ACK progress for stall_usec
                 * *and* the kernel retransmitting (RTOs firing) meanwhile. */
                bool outstanding = x->send_queue_bytes > 0 || x->inflight_bytes > 0;
                if (c->stall_usec > 0 && outstanding && x->retransmits > s->retransmits_at_progress &&
                    x->now >= s->last_progress &&
                    x->now - s->last_progress >= c->stall_usec) {
                        if (ret_reason)
                                *ret_reason = BACKPRESSURE_REASON_STALLED;
                        return BACKPRESSURE_STALLED;
                }

                /* Loss first: at a tie it is the reason given (it closes the handoff
                 * window; queueing alone only narrows it). */
                CONSIDER(level_above(s->retransmit_rate, c->retransmit_rate[0],
                                     c->retransmit_rate[1], scale),
                         BACKPRESSURE_REASON_RETRANSMITS);
                if (x->min_rtt_usec > 0 && x->srtt_usec >= c->rtt_floor_usec &&
                    s->acked_delta >= c->rtt_min_bytes)
                        CONSIDER(level_above(s->rtt_inflation, c->rtt_inflation[0],
                                             c->rtt_inflation[1], scale),
                                 BACKPRESSURE_REASON_RTT_INFLATION);
                CONSIDER(level_above((double)x->send_queue_bytes, (double)c->send_queue_bytes[0],
                                     (double)c->send_queue_bytes[1], scale),
                         BACKPRESSURE_REASON_SEND_QUEUE);
                CONSIDER(level_above(s->send_queue_growth, (double)c->send_queue_growth[0],
                                     (double)c->send_queue_growth[1], scale),
                         BACKPRESSURE_REASON_SEND_QUEUE_GROWTH);
        }

        CONSIDER(level_above((double)x->handoffs_in_flight, (double)c->handoffs_in_flight[0],
                             (double)c->handoffs_in_flight[1], scale),
                 BACKPRESSURE_REASON_HANDOFFS_IN_FLIGHT);

        if (x->destination_total_pages > 0) {
                double free_frac = (double)x->destination_free_pages / (double)x->destination_total_pages;
                /* Smaller is worse: leaving needs more room than entering. */
                l = BACKPRESSURE_NONE;
                if (c->destination_free[1] > 0 && free_frac <= c->destination_free[1] / scale)
                        l = BACKPRESSURE_HIGH;
                else if (c->destination_free[0] > 0 && free_frac <= c->destination_free[0] / scale)
                        l = BACKPRESSURE_ELEVATED;
                CONSIDER(l, BACKPRESSURE_REASON_DESTINATION_FULL);
        }
#undef CONSIDER

        if (ret_reason)
                *ret_reason = why;
        return best;
}

/* Whether x is too close to the previous sample for rates: an urgent evaluation (a
 * retransmit woke it) milliseconds after the last would see one retransmit in a handful of
 * segments as a loss rate of tens of per cent and close the window on a path losing far
 * less than any threshold. Rates wait for an interval or BACKPRESSURE_RATE_MIN_SEGS segments
 * since their baseline (what the interval's timer gives them); RTT, stalls and disconnects
 * are judged at once. */
static bool rate_window_short(const BackpressureState *s, const BackpressureConfig *c, const BackpressureSample *x) {
        const BackpressureSample *p = &s->prev;
        if (!s->have_prev || !p->have_kernel || !x->have_kernel || x->segs_out < p->segs_out ||
            x->retransmits < p->retransmits || x->bytes_acked < p->bytes_acked)
                return false; /* derive() takes a new baseline */
        return x->now - p->now < c->interval_usec && x->segs_out - p->segs_out < BACKPRESSURE_RATE_MIN_SEGS;
}

static void derive(BackpressureState *s, const BackpressureSample *x) {
        s->rtt_inflation = x->min_rtt_usec > 0 ? (double)x->srtt_usec / (double)x->min_rtt_usec : 0.0;

        if (!s->have_prev || !s->prev.have_kernel || !x->have_kernel) {
                s->retransmit_rate = 0;
                s->send_queue_growth = 0;
                /* No interval yet: judge RTT by the totals so far. */
                s->acked_delta = x->bytes_acked;
                s->last_progress = x->now;
                s->retransmits_at_progress = x->retransmits;
                return;
        }

        const BackpressureSample *p = &s->prev;
        if (x->segs_out < p->segs_out || x->retransmits < p->retransmits ||
            x->bytes_acked < p->bytes_acked) {
                /* A new connection replaced the old one: new baseline. */
                s->retransmit_rate = 0;
                s->send_queue_growth = 0;
                s->acked_delta = x->bytes_acked;
                s->last_progress = x->now;
                s->retransmits_at_progress = x->retransmits;
                return;
        }

        s->acked_delta = x->bytes_acked - p->bytes_acked;
        uint64_t dsegs = x->segs_out - p->segs_out;
        uint64_t dretr = x->retransmits - p->retransmits;
        if (dsegs > 0)
                s->retransmit_rate = MIN(1.0, (double)dretr / (double)dsegs);
        else
                s->retransmit_rate = dretr > 0 ? 1.0 : 0.0;

        usec_t dt = x->now - p->now;
        if (dt > 0 && x->send_queue_bytes > p->send_queue_bytes)
                s->send_queue_growth = (double)(x->send_queue_bytes - p->send_queue_bytes) *
                                       (double)USEC_PER_SEC / (double)dt;
        else
                s->send_queue_growth = 0;

        /* Progress since the last sample (not the rates' baseline, which may be older). */
        if (x->bytes_acked > s->acked_seen || (x->send_queue_bytes == 0 && x->inflight_bytes == 0)) {
                s->last_progress = x->now;
                s->retransmits_at_progress = x->retransmits;
        }
}

int backpressure_update(BackpressureState *s, const BackpressureConfig *c, const BackpressureSample *x) {
        if (s->have_prev && x->now < s->prev.now)
                return -EINVAL;

        if (rate_window_short(s, c, x)) {
                /* The rates of the last full window stand; the baseline stays. */
                s->rtt_inflation = x->min_rtt_usec > 0 ? (double)x->srtt_usec / (double)x->min_rtt_usec : 0.0;
                if (x->bytes_acked > s->acked_seen || (x->send_queue_bytes == 0 && x->inflight_bytes == 0)) {
                        s->last_progress = x->now;
                        s->retransmits_at_progress = x->retransmits;
                }
                s->acked_seen = x->bytes_acked;
        } else {
                derive(s, x);
                s->prev = *x;
                s->have_prev = true;
                s->acked_seen = x->bytes_acked;
        }

        if (!c->enabled) {
                bool changed = s->level != BACKPRESSURE_NONE;
                s->level = BACKPRESSURE_NONE;
                s->reason = BACKPRESSURE_REASON_NONE;
                return changed;
        }

        BackpressureReason enter_reason, stay_reason;
        BackpressureLevel enter = backpressure_evaluate(s, c, x, 1.0, &enter_reason);
        BackpressureLevel stay = backpressure_evaluate(s, c, x, c->release, &stay_reason);

        if (enter > s->level) {
                s->level = enter;
                s->reason = enter_reason;
                s->below_since = 0;
                return 1;
        }

        if (stay < s->level) {
                if (s->below_since == 0) {
                        s->below_since = x->now ? x->now : 1;
                        return 0;
                }
                if (x->now - s->below_since < c->hold_usec)
                        return 0;
                s->level--;
                if (stay == s->level)
                        s->reason = stay_reason;
                else if (s->level == BACKPRESSURE_NONE)
                        s->reason = BACKPRESSURE_REASON_NONE;
                s->below_since = s->level > stay ? x->now : 0;
                return 1;
        }

        s->below_since = 0;
        if (enter == s->level && enter != BACKPRESSURE_NONE)
                s->reason = enter_reason;
        return 0;
}

bool backpressure_window_closed(BackpressureLevel level, BackpressureReason reason) {
        if (level >= BACKPRESSURE_STALLED)
                return true;
        return level == BACKPRESSURE_HIGH &&
               (reason == BACKPRESSURE_REASON_RETRANSMITS || reason == BACKPRESSURE_REASON_DESTINATION_FULL ||
                reason == BACKPRESSURE_REASON_STALLED || reason == BACKPRESSURE_REASON_DISCONNECTED);
}

void backpressure_window(const BackpressureConfig *c, BackpressureLevel level, BackpressureReason reason,
                         BackpressureWindow *ret) {
        *ret = (BackpressureWindow){ .handoffs = c->window_handoffs, .bytes = c->window_bytes };
        if (!c->enabled)
                return;
        if (backpressure_window_closed(level, reason)) {
                *ret = (BackpressureWindow){ .closed = true };
                return;
        }
        if (level >= BACKPRESSURE_ELEVATED) {
                if (ret->handoffs > 0)
                        ret->handoffs = MAX(1u, (unsigned)((double)ret->handoffs * c->window_elevated));
                /* Raised by the count in flight itself: a window narrower than that count
                 * would drain it below the threshold and open again, over and over. */
                if (reason == BACKPRESSURE_REASON_HANDOFFS_IN_FLIGHT && ret->handoffs > 0)
                        ret->handoffs = MIN(MAX(ret->handoffs, c->handoffs_in_flight[0]), c->window_handoffs);
                if (ret->bytes > 0)
                        ret->bytes = MAX((uint64_t)1, (uint64_t)((double)ret->bytes * c->window_elevated));
        }
}

usec_t backpressure_full_retry(const BackpressureConfig *c, usec_t held_avg, unsigned in_flight) {
        if (held_avg == 0)
                return c->interval_usec;
        usec_t r = held_avg / MAX(in_flight, 1u);
        return CLAMP(r, (usec_t)BACKPRESSURE_RETRY_MIN_USEC, MAX(c->interval_usec, (usec_t)BACKPRESSURE_RETRY_MIN_USEC));
}

usec_t backpressure_held_average(usec_t avg, usec_t held) {
        if (avg == 0)
                return MAX(held, (usec_t)1);
        return MAX(avg - avg / 8 + held / 8, (usec_t)1);
}

static unsigned permille(uint64_t used, uint64_t limit) {
        if (limit == 0)
                return 0;
        if (used >= limit)
                return 1000;
        return (unsigned)(used * 1000 / limit);
}

int backpressure_window_admit(const BackpressureConfig *c, BackpressureLevel level, BackpressureReason reason,
                              unsigned in_flight, uint64_t in_flight_bytes, uint64_t bytes, usec_t held_avg,
                              usec_t *ret_retry_after, unsigned *ret_permille) {
        BackpressureWindow w;
        backpressure_window(c, level, reason, &w);

        usec_t retry = 0;
        unsigned pm = 1000;
        int r = 0;
        if (w.closed) {
                retry = MAX(c->hold_usec, c->interval_usec);
                r = -EAGAIN;
        } else {
                pm = MAX(permille(in_flight, w.handoffs), permille(in_flight_bytes, w.bytes));
                bool full = (w.handoffs > 0 && in_flight >= w.handoffs) ||
                            (w.bytes > 0 && in_flight > 0 && in_flight_bytes + bytes > w.bytes);
                if (full) {
                        retry = backpressure_full_retry(c, held_avg, in_flight);
                        r = -EAGAIN;
                }
        }
        if (ret_retry_after)
                *ret_retry_after = retry;
        if (ret_permille)
                *ret_permille = pm;
        return r;
}
