/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "telemetry/backpressure.h"
#include "telemetry/telemetry-config.h"
#include "../check-main.h"

#define MS USEC_PER_MSEC

static BackpressureConfig cfg(void) {
        BackpressureConfig c;
        backpressure_config_defaults(&c);
        return c;
}

/* A healthy path: 1 ms RTT at its minimum, data flowing and acked. */
static BackpressureSample healthy(usec_t now, uint64_t k) {
        return (BackpressureSample){
                .now = now,
                .have_kernel = true,
                .connected = true,
                .srtt_usec = 1000,
                .min_rtt_usec = 1000,
                .segs_out = 1000 * k,
                .retransmits = 0,
                .bytes_acked = 1000000 * k,
                .send_queue_bytes = 100000,
                .inflight_bytes = 50000,
        };
}

START_TEST(test_healthy_stays_none) {
        BackpressureConfig c = cfg();
        BackpressureState s;
        backpressure_state_init(&s);
        for (uint64_t k = 1; k < 50; k++) {
                BackpressureSample x = healthy(k * 200 * MS, k);
                ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
                ck_assert_int_eq(s.level, BACKPRESSURE_NONE);
        }
}
END_TEST

/* Raised by the handoffs in flight themselves, the window is not narrowed below the
 * count that raised it (it would drain below the threshold and open again, over and
 * over); the byte window still narrows. */
START_TEST(test_window_in_flight) {
        BackpressureConfig c;
        BackpressureWindow w;
        usec_t retry;
        const BackpressureReason F = BACKPRESSURE_REASON_HANDOFFS_IN_FLIGHT;
        backpressure_config_defaults(&c); /* window 128 handoffs, 4G; elevated from 64 in flight; 0.25 */
        ck_assert_int_eq(backpressure_config_verify(&c, NULL), 0);
        backpressure_window(&c, BACKPRESSURE_ELEVATED, F, &w);
        ck_assert(!w.closed);
        ck_assert_uint_eq(w.handoffs, 64);
        ck_assert_uint_eq(w.bytes, 1ULL << 30);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_ELEVATED, F, 63, 0, 1, 0, &retry, NULL), 0);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_ELEVATED, F, 64, 0, 1, 0, &retry, NULL), -EAGAIN);
        backpressure_window(&c, BACKPRESSURE_HIGH, F, &w);
        ck_assert(!w.closed);
        ck_assert_uint_eq(w.handoffs, 64);
        /* Other queueing reasons narrow it as before; never wider than the window. */
        backpressure_window(&c, BACKPRESSURE_ELEVATED, BACKPRESSURE_REASON_SEND_QUEUE, &w);
        ck_assert_uint_eq(w.handoffs, 32);
        ck_assert_int_eq(backpressure_config_set(&c, "WindowHandoffs", "16"), 0);
        backpressure_window(&c, BACKPRESSURE_ELEVATED, F, &w);
        ck_assert_uint_eq(w.handoffs, 16);
}
END_TEST

/* A merely full window is tried again about when its next handoff leaves: the average
 * stay over the number in it, within [100 us, Interval]; one Interval before any left. */
START_TEST(test_full_retry) {
        BackpressureConfig c;
        backpressure_config_defaults(&c);
        ck_assert_int_eq(backpressure_config_set(&c, "Interval", "200ms"), 0);
        ck_assert_uint_eq(backpressure_full_retry(&c, 0, 64), 200 * USEC_PER_MSEC);
        ck_assert_uint_eq(backpressure_full_retry(&c, 6400, 64), 100);
        ck_assert_uint_eq(backpressure_full_retry(&c, 64000, 64), 1000);
        ck_assert_uint_eq(backpressure_full_retry(&c, 640, 64), BACKPRESSURE_RETRY_MIN_USEC);
        ck_assert_uint_eq(backpressure_full_retry(&c, 10 * USEC_PER_SEC, 4), 200 * USEC_PER_MSEC);
        ck_assert_uint_eq(backpressure_full_retry(&c, 5000, 0), 5000);
        /* What a Prepare would get: the same retry when the window is full, none while it
         * takes one (the ring record's retry-after says so, at elevated as at none). */
        usec_t retry = 1;
        const BackpressureReason Q = BACKPRESSURE_REASON_RTT_INFLATION;
        ck_assert_int_eq(backpressure_config_set(&c, "WindowHandoffs", "8"), 0); /* 2 at elevated */
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_ELEVATED, Q, 1, 0, 0, 6400, &retry, NULL), 0);
        ck_assert_uint_eq(retry, 0);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_ELEVATED, Q, 2, 0, 0, 6400, &retry, NULL), -EAGAIN);
        ck_assert_uint_eq(retry, 3200);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_ELEVATED, Q, 2, 0, 0, 0, &retry, NULL), -EAGAIN);
        ck_assert_uint_eq(retry, 200 * USEC_PER_MSEC);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_HIGH, BACKPRESSURE_REASON_RETRANSMITS, 0, 0, 0, 6400, &retry,
                                                   NULL),
                         -EAGAIN);
        ck_assert_uint_eq(retry, USEC_PER_SEC); /* closed: Hold */
        /* The average: the first sets it, each next one weighs 1/8. */
        usec_t a = backpressure_held_average(0, 800);
        ck_assert_uint_eq(a, 800);
        a = backpressure_held_average(a, 1600);
        ck_assert_uint_eq(a, 900);
        ck_assert_uint_eq(backpressure_held_average(0, 0), 1);
}
END_TEST

START_TEST(test_rtt_inflation) {
        BackpressureConfig c = cfg();
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = healthy(200 * MS, 1);
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);

        x = healthy(400 * MS, 2);
        x.srtt_usec = 2500; /* 2.5x */
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_ELEVATED);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_RTT_INFLATION);

        x = healthy(600 * MS, 3);
        x.srtt_usec = 5000; /* 5x */
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_HIGH);
        ck_assert(s.rtt_inflation > 4.9 && s.rtt_inflation < 5.1);
}
END_TEST

START_TEST(test_rtt_floor) {
        /* On a LAN, 40us over a 10us minimum is 4x but means nothing. */
        BackpressureConfig c = cfg();
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = healthy(200 * MS, 1);
        x.srtt_usec = 40;
        x.min_rtt_usec = 10;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        ck_assert_int_eq(s.level, BACKPRESSURE_NONE);
}
END_TEST

START_TEST(test_rtt_idle) {
        /* Small heartbeats with delayed ACKs: srtt 40 ms over a 20 us minimum, but
         * almost nothing acked: not congestion. */
        BackpressureConfig c = cfg();
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = { .now = 0, .have_kernel = true, .connected = true, .srtt_usec = 40000,
                                 .min_rtt_usec = 20, .segs_out = 10, .bytes_acked = 300 };
        for (int i = 0; i < 20; i++) {
                x.now += 200 * MS;
                x.segs_out += 1;
                x.bytes_acked += 30;
                ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        }
        ck_assert_int_eq(s.level, BACKPRESSURE_NONE);
        /* The same srtt while moving data is. */
        x.now += 200 * MS;
        x.bytes_acked += 1 << 20;
        x.segs_out += 700;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_RTT_INFLATION);
        ck_assert_int_eq(backpressure_config_set(&c, "RTTMinBytes", "1M"), 0);
        ck_assert_uint_eq(c.rtt_min_bytes, 1 << 20);
}
END_TEST

START_TEST(test_retransmits) {
        BackpressureConfig c = cfg();
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = healthy(200 * MS, 1);
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        ck_assert_int_eq(s.level, BACKPRESSURE_NONE);

        x = healthy(400 * MS, 2); /* +1000 segments */
        x.retransmits = 20;       /* 2% */
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_ELEVATED);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_RETRANSMITS);

        x = healthy(600 * MS, 3);
        x.retransmits = 120; /* +100 over 1000: 10% */
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_HIGH);
}
END_TEST

/* A path losing 0.5 % (below RetransmitRateElevated's 1 %), 20000 segments a second,
 * evaluated on the interval's timer and also at every retransmit (telemetry evaluates a
 * peer at once when its ring reports one): the rates must come from windows long enough
 * to mean something, not from the few segments since the last evaluation. */
START_TEST(test_retransmit_wakeups_short_windows) {
        BackpressureConfig c = cfg();
        BackpressureState s;
        backpressure_state_init(&s);
        unsigned high = 0, elevated = 0, evaluations = 0;
        uint64_t retr = 0, x64 = 88172645463325252ULL;
        for (usec_t t = MS; t <= 10 * USEC_PER_SEC; t += MS) {
                uint64_t segs = t / MS * 20; /* 20 a millisecond */
                /* A retransmit in one millisecond of ten, at random: one in 200 segments. */
                x64 ^= x64 << 13;
                x64 ^= x64 >> 7;
                x64 ^= x64 << 17;
                bool retransmit = x64 % 10 == 0;
                retr += retransmit;
                if (!retransmit && t % (200 * MS) != 0)
                        continue;
                BackpressureSample x = healthy(t, 0);
                x.segs_out = segs;
                x.retransmits = retr;
                x.bytes_acked = segs * 1000;
                ck_assert_int_ge(backpressure_update(&s, &c, &x), 0);
                evaluations++;
                high += s.level == BACKPRESSURE_HIGH;
                elevated += s.level == BACKPRESSURE_ELEVATED;
        }
        ck_assert_uint_gt(evaluations, 900);
        ck_assert_uint_eq(high, 0);
        ck_assert_uint_eq(elevated, 0);
        ck_assert_int_eq(s.level, BACKPRESSURE_NONE);
        ck_assert(s.retransmit_rate > 0 && s.retransmit_rate < c.retransmit_rate[0]);
}
END_TEST

START_TEST(test_hysteresis) {
        BackpressureConfig c = cfg();
        c.hold_usec = 1000 * MS;
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = healthy(0, 1);
        x.srtt_usec = 5000;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_HIGH);

        /* 3.5x: below the HIGH threshold (4.0) but above release * 4.0 = 3.2: stays. */
        usec_t t = 0;
        for (int i = 0; i < 20; i++) {
                t += 200 * MS;
                x = healthy(t, 2 + i);
                x.srtt_usec = 3500;
                ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
                ck_assert_int_eq(s.level, BACKPRESSURE_HIGH);
        }

        /* 3.0x: below release; stays HIGH for hold, then steps to ELEVATED (3.0 >= 2.0). */
        int changes = 0;
        usec_t changed_at = 0;
        for (int i = 0; i < 10; i++) {
                t += 200 * MS;
                x = healthy(t, 30 + i);
                x.srtt_usec = 3000;
                int r = backpressure_update(&s, &c, &x);
                ck_assert_int_ge(r, 0);
                if (r) {
                        changes++;
                        changed_at = t;
                }
        }
        ck_assert_int_eq(changes, 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_ELEVATED);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_RTT_INFLATION);
        ck_assert_uint_ge(changed_at, 20 * 200 * MS + 1000 * MS);

        /* Back to healthy: steps down to NONE after another hold. */
        for (int i = 0; i < 10; i++) {
                t += 200 * MS;
                x = healthy(t, 50 + i);
                (void)backpressure_update(&s, &c, &x);
        }
        ck_assert_int_eq(s.level, BACKPRESSURE_NONE);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_NONE);

        /* A single spike re-enters immediately. */
        t += 200 * MS;
        x = healthy(t, 70);
        x.srtt_usec = 9000;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_HIGH);
}
END_TEST

/* A stall is judged from the last progress seen, also by the evaluations between two
 * full windows (a retransmit's wakeup): not from the rates' baseline, which would see
 * progress for up to an interval after the ACKs stopped. */
START_TEST(test_stall_between_windows) {
        BackpressureConfig c = cfg();
        c.stall_usec = 1000 * MS;
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = healthy(0, 1);
        x.retransmits = 1;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        /* 20 ms later the last ACK progress; then only retransmits, every 20 ms. */
        x.now = 20 * MS;
        x.bytes_acked += 1000;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        usec_t t = 20 * MS;
        while (t < 20 * MS + 1000 * MS) {
                t += 20 * MS;
                x.now = t;
                x.retransmits++;
                x.segs_out += 1000; /* the rate stays low */
                (void)backpressure_update(&s, &c, &x);
        }
        /* 1000 ms after the last progress (not after the window that followed it). */
        ck_assert_int_eq(s.level, BACKPRESSURE_STALLED);
}
END_TEST

START_TEST(test_stall_and_disconnect) {
        BackpressureConfig c = cfg();
        c.stall_usec = 1000 * MS;
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = healthy(0, 1);
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);

        /* ACKs stop while data is queued, but no retransmits: the records just lag
         * (an idle connection); not a stall. */
        usec_t t = 0;
        int r = 0;
        for (int i = 0; i < 10; i++) {
                t += 200 * MS;
                x = healthy(t, 1);
                r = backpressure_update(&s, &c, &x);
                ck_assert_int_eq(r, 0);
        }
        /* Now the kernel retransmits (RTOs) and nothing is acked. */
        x.retransmits = 1;
        backpressure_state_init(&s);
        x.now = t;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        for (int i = 0; i < 4; i++) {
                t += 200 * MS;
                x.now = t;
                x.retransmits++;
                x.segs_out += 1000; /* keep the rate below its thresholds */
                r = backpressure_update(&s, &c, &x);
                ck_assert_int_eq(r, 0);
        }
        t += 200 * MS; /* 1000 ms without progress */
        x.now = t;
        x.retransmits++;
        x.segs_out += 1000;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_STALLED);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_STALLED);

        /* Idle with nothing queued is not a stall. */
        backpressure_state_init(&s);
        x = healthy(0, 1);
        x.send_queue_bytes = x.inflight_bytes = 0;
        for (int i = 0; i < 20; i++) {
                x.now += 200 * MS;
                ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        }

        /* The connection is gone. */
        x.connected = false;
        x.now += 200 * MS;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_STALLED);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_DISCONNECTED);
}
END_TEST

START_TEST(test_daemon_load) {
        BackpressureConfig c = cfg();
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = { .now = 1, .connected = true, .handoffs_in_flight = 70 };
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_ELEVATED);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_HANDOFFS_IN_FLIGHT);

        x.now += 200 * MS;
        x.handoffs_in_flight = 0;
        x.destination_total_pages = 1000;
        x.destination_free_pages = 10; /* 1% free */
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_HIGH);
        ck_assert_int_eq(s.reason, BACKPRESSURE_REASON_DESTINATION_FULL);

        BackpressureReason why;
        x.destination_free_pages = 500;
        ck_assert_int_eq(backpressure_evaluate(&s, &c, &x, 1.0, &why), BACKPRESSURE_NONE);
        /* 9% free: elevated (at most 10%) */
        x.destination_free_pages = 90;
        ck_assert_int_eq(backpressure_evaluate(&s, &c, &x, 1.0, &why), BACKPRESSURE_ELEVATED);
        /* 11% free is not enough to leave with release 0.8 (needs 12.5%). */
        x.destination_free_pages = 110;
        ck_assert_int_eq(backpressure_evaluate(&s, &c, &x, 1.0, &why), BACKPRESSURE_NONE);
        ck_assert_int_eq(backpressure_evaluate(&s, &c, &x, c.release, &why), BACKPRESSURE_ELEVATED);
}
END_TEST

START_TEST(test_counter_reset_and_order) {
        BackpressureConfig c = cfg();
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = healthy(1000 * MS, 10);
        x.retransmits = 500;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        /* A new connection: counters start over; no spurious rate. */
        x = healthy(1200 * MS, 1);
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        ck_assert(s.retransmit_rate == 0.0);
        /* Time going backwards is refused. */
        x.now = 10;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), -EINVAL);
        /* Retransmits with nothing new sent: rate 1. */
        x = healthy(1400 * MS, 1);
        x.retransmits = 3;
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 1);
        ck_assert_int_eq(s.level, BACKPRESSURE_HIGH);
}
END_TEST

START_TEST(test_disabled) {
        BackpressureConfig c = cfg();
        c.enabled = false;
        BackpressureState s;
        backpressure_state_init(&s);
        BackpressureSample x = { .now = 1, .connected = false };
        ck_assert_int_eq(backpressure_update(&s, &c, &x), 0);
        ck_assert_int_eq(s.level, BACKPRESSURE_NONE);
}
END_TEST

START_TEST(test_config) {
        BackpressureConfig c = cfg();
        const char *why;
        ck_assert_int_eq(backpressure_config_verify(&c, &why), 0);
        ck_assert_int_eq(backpressure_config_set(&c, "RTTInflationHigh", "6.5"), 0);
        ck_assert(c.rtt_inflation[1] == 6.5);
        ck_assert_int_eq(backpressure_config_set(&c, "rttinflationelevated", "7"), 0);
        ck_assert_int_eq(backpressure_config_verify(&c, &why), -EINVAL);
        ck_assert_ptr_nonnull(why);
        c = cfg();
        ck_assert_int_eq(backpressure_config_set(&c, "SendQueueHigh", "64M"), 0);
        ck_assert_uint_eq(c.send_queue_bytes[1], 64ULL << 20);
        ck_assert_int_eq(backpressure_config_set(&c, "StallTimeout", "500ms"), 0);
        ck_assert_uint_eq(c.stall_usec, 500 * MS);
        ck_assert_int_eq(backpressure_config_set(&c, "Interval", "0"), -EINVAL);
        ck_assert_int_eq(backpressure_config_set(&c, "RetransmitRateHigh", "nan"), -EINVAL);
        ck_assert_int_eq(backpressure_config_set(&c, "RetransmitRateHigh", "-1"), -EINVAL);
        ck_assert_int_eq(backpressure_config_set(&c, "RetransmitRateHigh", "0.5x"), -EINVAL);
        ck_assert_int_eq(backpressure_config_set(&c, "Bogus", "1"), -ENOENT);
        ck_assert_int_eq(backpressure_config_set(&c, "Release", "0"), 0);
        ck_assert_int_eq(backpressure_config_verify(&c, &why), -EINVAL);
        c = cfg();
        ck_assert_int_eq(backpressure_config_set(&c, "DestinationFreeHigh", "0.5"), 0);
        ck_assert_int_eq(backpressure_config_verify(&c, &why), -EINVAL);
        /* A zero threshold turns its signal off: High alone is fine. */
        ck_assert_int_eq(backpressure_config_set(&c, "DestinationFreeElevated", "0"), 0);
        ck_assert_int_eq(backpressure_config_verify(&c, &why), 0);
        /* srtt over min RTT is never below 1: a High below it would always hold. */
        c = cfg();
        ck_assert_int_eq(backpressure_config_set(&c, "RTTInflationElevated", "0"), 0);
        ck_assert_int_eq(backpressure_config_set(&c, "RTTInflationHigh", "0.5"), 0);
        ck_assert_int_eq(backpressure_config_verify(&c, &why), -EINVAL);

        ck_assert_str_eq(backpressure_level_to_string(BACKPRESSURE_STALLED), "stalled");
        ck_assert_int_eq(backpressure_level_from_string("high"), BACKPRESSURE_HIGH);
        ck_assert_int_eq(backpressure_level_from_string("x"), -EINVAL);
        ck_assert_ptr_null(backpressure_level_to_string(_BACKPRESSURE_LEVEL_MAX));
        for (int r = 0; r < _BACKPRESSURE_REASON_MAX; r++)
                ck_assert_ptr_nonnull(backpressure_reason_to_string(r));
}
END_TEST

START_TEST(test_window) {
        BackpressureConfig c;
        BackpressureWindow w;
        usec_t retry;
        unsigned pm;
        const BackpressureReason N = BACKPRESSURE_REASON_NONE, L = BACKPRESSURE_REASON_RETRANSMITS,
                                 Q = BACKPRESSURE_REASON_RTT_INFLATION;
        backpressure_config_defaults(&c);
        ck_assert_int_eq(backpressure_config_set(&c, "WindowHandoffs", "8"), 0);
        ck_assert_int_eq(backpressure_config_set(&c, "WindowBytes", "64M"), 0);
        ck_assert_int_eq(backpressure_config_set(&c, "WindowElevated", "0.25"), 0);
        ck_assert_int_eq(backpressure_config_set(&c, "Hold", "1s"), 0);
        ck_assert_int_eq(backpressure_config_set(&c, "Interval", "200ms"), 0);
        ck_assert_int_eq(backpressure_config_verify(&c, NULL), 0);

        /* The window shrinks with the level and closes at high. */
        backpressure_window(&c, BACKPRESSURE_NONE, BACKPRESSURE_REASON_NONE, &w);
        ck_assert(!w.closed && w.handoffs == 8 && w.bytes == 64ULL << 20);
        backpressure_window(&c, BACKPRESSURE_ELEVATED, Q, &w);
        ck_assert(!w.closed && w.handoffs == 2 && w.bytes == 16ULL << 20);
        backpressure_window(&c, BACKPRESSURE_HIGH, L, &w);
        ck_assert(w.closed && w.handoffs == 0);
        backpressure_window(&c, BACKPRESSURE_HIGH, BACKPRESSURE_REASON_DESTINATION_FULL, &w);
        ck_assert(w.closed);
        backpressure_window(&c, BACKPRESSURE_STALLED, BACKPRESSURE_REASON_STALLED, &w);
        ck_assert(w.closed);
        /* High from queueing alone (busy, not failing): narrowed as at elevated. */
        backpressure_window(&c, BACKPRESSURE_HIGH, Q, &w);
        ck_assert(!w.closed && w.handoffs == 2 && w.bytes == 16ULL << 20);
        backpressure_window(&c, BACKPRESSURE_HIGH, BACKPRESSURE_REASON_SEND_QUEUE, &w);
        ck_assert(!w.closed);
        ck_assert(!backpressure_window_closed(BACKPRESSURE_HIGH, BACKPRESSURE_REASON_HANDOFFS_IN_FLIGHT));
        ck_assert(backpressure_window_closed(BACKPRESSURE_STALLED, BACKPRESSURE_REASON_DISCONNECTED));

        /* none: up to 8 handoffs, up to 64M. */
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_NONE, N, 7, 1 << 20, 1 << 20, 0, &retry, &pm), 0);
        ck_assert_uint_eq(retry, 0);
        ck_assert_uint_eq(pm, 875);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_NONE, N, 8, 1 << 20, 1 << 20, 0, &retry, &pm), -EAGAIN);
        ck_assert_uint_eq(retry, 200 * USEC_PER_MSEC); /* full: one interval */
        ck_assert_uint_eq(pm, 1000);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_NONE, N, 1, 60ULL << 20, 8ULL << 20, 0, &retry, NULL),
                         -EAGAIN);
        /* Bigger than the byte window: alone, it still goes. */
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_NONE, N, 0, 0, 1ULL << 30, 0, &retry, &pm), 0);
        ck_assert_uint_eq(pm, 0);
        /* elevated: 2 handoffs. */
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_ELEVATED, Q, 1, 1 << 20, 1 << 20, 0, &retry, &pm), 0);
        ck_assert_uint_eq(pm, 500);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_ELEVATED, Q, 2, 1 << 20, 1 << 20, 0, &retry, NULL),
                         -EAGAIN);
        /* high and stalled: nothing, even with nothing in flight; retry after Hold. */
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_HIGH, L, 0, 0, 1, 0, &retry, &pm), -EAGAIN);
        ck_assert_uint_eq(retry, USEC_PER_SEC);
        ck_assert_uint_eq(pm, 1000);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_STALLED, BACKPRESSURE_REASON_STALLED, 0, 0, 1, 0, &retry,
                                                   NULL),
                         -EAGAIN);
        /* high from queueing: 2 handoffs, as at elevated; a full window retries after
         * one interval. */
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_HIGH, Q, 1, 0, 1, 0, &retry, NULL), 0);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_HIGH, Q, 2, 0, 1, 0, &retry, NULL), -EAGAIN);
        ck_assert_uint_eq(retry, 200 * USEC_PER_MSEC);

        /* 0: no bound of that kind; a disabled backpressure keeps the window itself. */
        ck_assert_int_eq(backpressure_config_set(&c, "WindowHandoffs", "0"), 0);
        ck_assert_int_eq(backpressure_config_set(&c, "WindowBytes", "0"), 0);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_NONE, N, 100000, 1ULL << 40, 1, 0, &retry, &pm), 0);
        ck_assert_uint_eq(pm, 0);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_HIGH, L, 0, 0, 1, 0, &retry, NULL), -EAGAIN);
        ck_assert_int_eq(backpressure_config_set(&c, "WindowHandoffs", "4"), 0);
        ck_assert_int_eq(backpressure_config_set(&c, "Enabled", "no"), 0);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_HIGH, L, 3, 0, 1, 0, &retry, NULL), 0);
        ck_assert_int_eq(backpressure_window_admit(&c, BACKPRESSURE_NONE, N, 4, 0, 1, 0, &retry, NULL), -EAGAIN);

        /* WindowElevated is a fraction in (0, 1]. */
        ck_assert_int_eq(backpressure_config_set(&c, "WindowElevated", "0"), 0);
        ck_assert_int_eq(backpressure_config_verify(&c, NULL), -EINVAL);
        ck_assert_int_eq(backpressure_config_set(&c, "WindowElevated", "1.5"), 0);
        ck_assert_int_eq(backpressure_config_verify(&c, NULL), -EINVAL);
        ck_assert_int_eq(backpressure_config_set(&c, "WindowElevated", "x"), -EINVAL);
}
END_TEST

START_TEST(test_telemetry_config) {
        TelemetryConfig c;
        /* Pinned by default only by the host's service, the process systemd executed
         * (SYSTEMD_EXEC_PID is its pid; the boot test checks that epd.service pins):
         * not by one started by hand, nor by one that inherited a service's variable. */
        char pid[32];
        ck_assert_int_eq(unsetenv("SYSTEMD_EXEC_PID"), 0);
        ck_assert_int_eq(telemetry_config_defaults(&c), 0);
        ck_assert_ptr_null(c.pin_dir);
        snprintf(pid, sizeof pid, "%d", (int)getppid());
        ck_assert_int_eq(setenv("SYSTEMD_EXEC_PID", pid, 1), 0);
        ck_assert_int_eq(telemetry_config_defaults(&c), 0);
        ck_assert_ptr_null(c.pin_dir);
        snprintf(pid, sizeof pid, "%d", (int)getpid());
        ck_assert_int_eq(setenv("SYSTEMD_EXEC_PID", pid, 1), 0);
        ck_assert_int_eq(telemetry_config_defaults(&c), 0);
        ck_assert_int_eq(unsetenv("SYSTEMD_EXEC_PID"), 0);
        ck_assert_str_eq(c.pin_dir, "/sys/fs/bpf/epd");
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "PinDirectory", "/sys/fs/bpf/epd-test"), 0);
        ck_assert_str_eq(c.pin_dir, "/sys/fs/bpf/epd-test");
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "PinDirectory", "relative"), -EINVAL);
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "PinDirectory", "/a/../b"), -EINVAL);
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "PinDirectory", "no"), 0);
        ck_assert_ptr_null(c.pin_dir);
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "BPF", "no"), 0);
        ck_assert(!c.bpf);
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "SampleInterval", "5ms"), 0);
        ck_assert_uint_eq(c.sample_interval_usec, 5 * MS);
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "WakeupBytes", "1G"), -EINVAL);
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "TraceRequests", "0"), -EINVAL);
        ck_assert_int_eq(telemetry_config_set(&c, "Telemetry", "Nope", "0"), -ENOENT);
        ck_assert_int_eq(telemetry_config_set(&c, "Other", "BPF", "0"), -ENOENT);
        ck_assert_int_eq(telemetry_config_set(&c, "Backpressure", "HandoffsHigh", "9"), 0);
        ck_assert_uint_eq(c.backpressure.handoffs_in_flight[1], 9);
        const char *why;
        ck_assert_int_eq(telemetry_config_verify(&c, &why), -EINVAL); /* 64 > 9 */
        ck_assert_int_eq(telemetry_config_set(&c, "Backpressure", "HandoffsElevated", "5"), 0);
        ck_assert_int_eq(telemetry_config_verify(&c, &why), 0);
        TelemetryConfig d;
        ck_assert_int_eq(telemetry_config_copy(&d, &c), 0);
        telemetry_config_done(&c);
        telemetry_config_done(&d);
}
END_TEST

int main(void) {
        Suite *s = suite_create("backpressure");
        TCase *tc = tcase_create("backpressure");
        tcase_add_test(tc, test_healthy_stays_none);
        tcase_add_test(tc, test_window);
        tcase_add_test(tc, test_window_in_flight);
        tcase_add_test(tc, test_full_retry);
        tcase_add_test(tc, test_rtt_inflation);
        tcase_add_test(tc, test_rtt_floor);
        tcase_add_test(tc, test_rtt_idle);
        tcase_add_test(tc, test_retransmits);
        tcase_add_test(tc, test_retransmit_wakeups_short_windows);
        tcase_add_test(tc, test_stall_between_windows);
        tcase_add_test(tc, test_hysteresis);
        tcase_add_test(tc, test_stall_and_disconnect);
        tcase_add_test(tc, test_daemon_load);
        tcase_add_test(tc, test_counter_reset_and_order);
        tcase_add_test(tc, test_disabled);
        tcase_add_test(tc, test_config);
        tcase_add_test(tc, test_telemetry_config);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
