/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* What integration tests read of a sequence through a client's own connection. */

#include <check.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <systemd/sd-bus.h>

#include "epd-internal.h"

/* The arena offsets of sequence `path`'s n pages (its Offsets property); fails the test
 * unless it has exactly n. */
static inline void sequence_offsets(epd_client *c, const char *path, uint64_t *offs, uint32_t n) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const void *o;
        size_t sz;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, path, "org.epd1.Sequence", "Offsets", &e, &reply, "at"), 0);
        ck_assert_int_ge(sd_bus_message_read_array(reply, 't', &o, &sz), 0);
        ck_assert_uint_eq(sz / 8, n);
        memcpy(offs, o, sz);
        sd_bus_message_unref(reply);
}

/* A call sent without waiting for its reply: the reply lands in *a (async_wait()). */
typedef struct AsyncCall {
        bool done;
        char error[512];  /* "Name: message" of an error reply, else empty */
        uint32_t copied;  /* a PrepareWrite's: the pages it copied */
        uint64_t started, usec;
} AsyncCall;

static inline uint64_t async_now_us(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

static inline int async_call_done(sd_bus_message *m, void *userdata, sd_bus_error *ret_error) {
        AsyncCall *a = userdata;
        const sd_bus_error *e = sd_bus_message_get_error(m);
        a->done = true;
        a->usec = async_now_us() - a->started;
        if (e) {
                snprintf(a->error, sizeof a->error, "%s: %s", e->name, e->message ? e->message : "");
                return 0;
        }
        if (sd_bus_message_has_signature(m, "auu")) {
                const void *pages;
                size_t sz;
                ck_assert_int_ge(sd_bus_message_read_array(m, 'u', &pages, &sz), 0);
                ck_assert_int_ge(sd_bus_message_read(m, "u", &a->copied), 0);
        }
        return 0;
}

/* Sends m (and drops the caller's reference). */
static inline void async_call(epd_client *c, sd_bus_message *m, AsyncCall *a) {
        *a = (AsyncCall) { .started = async_now_us() };
        ck_assert_int_ge(sd_bus_call_async(c->bus, NULL, m, async_call_done, a, 30 * 1000000ULL), 0);
        sd_bus_message_unref(m);
        ck_assert_int_ge(sd_bus_flush(c->bus), 0);
}

static inline void prepare_write_async(epd_client *c, const char *path, uint32_t first, uint32_t count,
                                       AsyncCall *a) {
        sd_bus_message *m = NULL;
        ck_assert_int_ge(epd__new_call(c, path, "org.epd1.Sequence", "PrepareWrite", &m), 0);
        ck_assert_int_ge(sd_bus_message_append(m, "uu", first, count), 0);
        async_call(c, m, a);
}

static inline void async_wait(epd_client *c, AsyncCall *a) {
        while (!a->done) {
                int r = sd_bus_process(c->bus, NULL);
                ck_assert_int_ge(r, 0);
                if (r == 0)
                        ck_assert_int_ge(sd_bus_wait(c->bus, 5 * 1000000ULL), 0);
        }
}
