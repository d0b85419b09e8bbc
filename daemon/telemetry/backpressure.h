/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Backpressure per peer path: a congestion level computed from the kernel's view of the
 * path (RTT inflation over its minimum, retransmit rate, send-queue size and growth, ACK
 * progress) and the daemon's own (handoffs in flight to the peer, free pages at the
 * destination). Pure: no clock, no I/O; the caller passes samples with their time.
 *
 * Hysteresis: a level is entered as soon as one signal crosses its threshold; it is left
 * only after every signal has stayed below `release` times its threshold for
 * `hold_usec`, and then one level at a time. So a path that flaps around a threshold
 * does not flood workers with signals. */

#include <stdbool.h>
#include <stdint.h>

#include "time-util.h"

typedef enum BackpressureLevel {
        BACKPRESSURE_NONE = 0,     /* send freely */
        BACKPRESSURE_ELEVATED = 1, /* slow down: prefer other peers, batch */
        BACKPRESSURE_HIGH = 2,     /* admit no new work for this peer */
        BACKPRESSURE_STALLED = 3,  /* the path is not moving (or gone): the maximum */
        _BACKPRESSURE_LEVEL_MAX,
} BackpressureLevel;

typedef enum BackpressureReason {
        BACKPRESSURE_REASON_NONE = 0,
        BACKPRESSURE_REASON_RTT_INFLATION,
        BACKPRESSURE_REASON_RETRANSMITS,
        BACKPRESSURE_REASON_SEND_QUEUE,
        BACKPRESSURE_REASON_SEND_QUEUE_GROWTH,
        BACKPRESSURE_REASON_HANDOFFS_IN_FLIGHT,
        BACKPRESSURE_REASON_DESTINATION_FULL,
        BACKPRESSURE_REASON_STALLED,
        BACKPRESSURE_REASON_DISCONNECTED,
        _BACKPRESSURE_REASON_MAX,
} BackpressureReason;

/* Thresholds: index 0 enters ELEVATED, index 1 enters HIGH. */
typedef struct BackpressureConfig {
        bool enabled;
        usec_t interval_usec;              /* evaluation period */
        double rtt_inflation[2];           /* srtt / min_rtt */
        uint32_t rtt_floor_usec;           /* inflation only counts above this srtt */
        uint64_t rtt_min_bytes;            /* ... and when this much was acked in the
                                            * interval: an idle connection's srtt is
                                            * mostly delayed ACKs, not queueing */
        double retransmit_rate[2];         /* retransmitted / sent segments, per interval */
        uint64_t send_queue_bytes[2];      /* unacked bytes queued on the socket */
        uint64_t send_queue_growth[2];     /* bytes per second of queue growth */
        unsigned handoffs_in_flight[2];
        double destination_free[2];        /* free page fraction below which it counts */
        usec_t stall_usec;                 /* no ACK progress with data outstanding */
        usec_t hold_usec;                  /* time below before stepping down */
        double release;                    /* step down below release * threshold */
        /* The handoff window per peer (daemon/handoff/handoff-manager.c): handoffs and bytes in
         * flight (prepared, not yet transferred) towards one peer; 0: no bound. */
        unsigned window_handoffs;
        uint64_t window_bytes;
        double window_elevated;            /* fraction of the window left at ELEVATED */
} BackpressureConfig;

/* One observation of a path. Counters are cumulative totals (they may reset when a
 * connection is replaced; a decrease is treated as a new baseline). */
typedef struct BackpressureSample {
        usec_t now;
        bool have_kernel;          /* the kernel fields below are valid */
        bool connected;            /* a connection to the peer exists */
        uint32_t srtt_usec;
        uint32_t min_rtt_usec;
        uint64_t segs_out;
        uint64_t retransmits;
        uint64_t bytes_acked;
        uint64_t send_queue_bytes;
        uint64_t inflight_bytes;
        unsigned handoffs_in_flight;
        uint64_t destination_free_pages;
        uint64_t destination_total_pages; /* 0: unknown */
} BackpressureSample;

/* Rates are taken over at least an interval or this many segments sent. */
#define BACKPRESSURE_RATE_MIN_SEGS 10000U

typedef struct BackpressureState {
        BackpressureLevel level;
        BackpressureReason reason;
        bool have_prev;
        BackpressureSample prev;
        usec_t last_progress;     /* last time bytes_acked moved or nothing was queued */
        uint64_t retransmits_at_progress;
        usec_t below_since;       /* since when the target level is below `level` */
        double retransmit_rate;   /* last computed, for display */
        double rtt_inflation;
        double send_queue_growth; /* bytes/s */
        uint64_t acked_delta;     /* bytes acked since the previous sample */
        uint64_t acked_seen;      /* bytes_acked of the last sample (progress is judged by it) */
} BackpressureState;

void backpressure_config_defaults(BackpressureConfig *c);
/* Sets one key of the [Backpressure] config section; -EINVAL for a bad value,
 * -ENOENT for an unknown key. Keys: Enabled, Interval, RTTInflationElevated,
 * RTTInflationHigh, RTTFloor, RTTMinBytes, RetransmitRateElevated, RetransmitRateHigh,
 * SendQueueElevated, SendQueueHigh, SendQueueGrowthElevated, SendQueueGrowthHigh,
 * HandoffsElevated, HandoffsHigh, DestinationFreeElevated, DestinationFreeHigh,
 * StallTimeout, Hold, Release, WindowHandoffs, WindowBytes, WindowElevated. */
int backpressure_config_set(BackpressureConfig *c, const char *key, const char *value);
/* Checks that thresholds are ordered (elevated before high) and in range. */
int backpressure_config_verify(const BackpressureConfig *c, const char **ret_problem);

void backpressure_state_init(BackpressureState *s);
/* Feeds one sample. Returns 1 when the level changed (new level and reason in *s),
 * 0 when not, -EINVAL for a sample older than the previous one. */
int backpressure_update(BackpressureState *s, const BackpressureConfig *c, const BackpressureSample *x);

/* The level the sample alone calls for, without hysteresis, with its main reason;
 * `scale` multiplies the thresholds (1.0 to enter, c->release to leave). */
BackpressureLevel backpressure_evaluate(const BackpressureState *s, const BackpressureConfig *c,
                                        const BackpressureSample *x, double scale,
                                        BackpressureReason *ret_reason);

/* The handoff window towards a peer: at NONE the configured window; at ELEVATED, and at
 * HIGH from queueing alone (RTT inflation, send queue and its growth, handoffs in
 * flight: the path is busy, not failing), window_elevated of it (at least one
 * handoff; from handoffs in flight, not fewer than their elevated threshold); closed (nothing new) at HIGH from loss or a full destination, and at
 * STALLED. 0 in a field of an open window means "no bound". */
typedef struct BackpressureWindow {
        unsigned handoffs;
        uint64_t bytes;
        bool closed;       /* HIGH or STALLED: no new handoff at all */
} BackpressureWindow;

bool backpressure_window_closed(BackpressureLevel level, BackpressureReason reason);
void backpressure_window(const BackpressureConfig *c, BackpressureLevel level, BackpressureReason reason,
                         BackpressureWindow *ret);

/* Whether a new handoff of `bytes` towards a peer at `level`, with `in_flight`
 * handoffs of `in_flight_bytes` already in its window, may start now. Returns 0 when it
 * may; -EAGAIN when it is to be deferred, with *ret_retry_after (relative) set: the
 * earliest the level can step down (Hold) when the window is closed, when it is
 * merely full about when its next handoff leaves (backpressure_full_retry() of
 * held_avg, the window's average stay; 0 when unknown gives one Interval); 0 when it
 * may start. A handoff larger than the byte window still starts
 * when nothing else is in flight (it would never fit otherwise). *ret_permille (may be
 * NULL): how full the window is, 1000 = full or closed. */
int backpressure_window_admit(const BackpressureConfig *c, BackpressureLevel level, BackpressureReason reason,
                              unsigned in_flight, uint64_t in_flight_bytes, uint64_t bytes, usec_t held_avg,
                              usec_t *ret_retry_after, unsigned *ret_permille);

/* When to try again at a window that is merely full: about when its next handoff
 * leaves, the average time one stays in it (held_avg) over the number in it (they
 * leave one after another), at least BACKPRESSURE_RETRY_MIN_USEC and at most one
 * Interval (also what it is before any handoff has left, held_avg 0). */
#define BACKPRESSURE_RETRY_MIN_USEC 100
usec_t backpressure_full_retry(const BackpressureConfig *c, usec_t held_avg, unsigned in_flight);
/* The moving average of the time handoffs stay in a window, with one more: 1/8 of the
 * new one's weight (the first sets it). */
usec_t backpressure_held_average(usec_t avg, usec_t held);

const char *backpressure_level_to_string(BackpressureLevel l);
const char *backpressure_reason_to_string(BackpressureReason r);
int backpressure_level_from_string(const char *s);
