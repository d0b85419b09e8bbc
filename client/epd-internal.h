/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Shared by the files of libepd (one per API area); not installed. */

#include <systemd/sd-bus.h>

#include "epd/epd.h"
#include "macro.h"

struct epd_client {
        sd_bus *bus;
        bool direct;       /* peer-to-peer: no destination names */
        bool closing;      /* epd_disconnect(): what it dispatches calls no callback of the caller */
        char *worker_path;
        epd_arena *arenas;
        size_t n_arenas;
        char error_name[128];
        char error_message[512];
        /* Calls sent without waiting (epd__call_nowait): how many are unanswered, and the
         * first refusal among them, until epd_flush() returns it. */
        unsigned nowait_pending;
        unsigned async_pending; /* asynchronous calls with a callback (prepare_async): epd_flush() runs them too */
        int nowait_error;
        char nowait_error_name[128];
        char nowait_error_message[512];
};

#define EPD_DESTINATION(c) ((c)->direct ? NULL : "org.epd1")

/* Records the error of a failed call and returns it as a negative errno. */
int epd__error(epd_client *c, int r, const sd_bus_error *e);
int epd__fail(epd_client *c, int r, const char *format, ...) _printf_(3, 4);
void epd__clear_error(epd_client *c);
/* A method call on org.epd1.<interface> at path; on failure, records the error. */
int epd__call(epd_client *c, const char *path, const char *interface, const char *member,
              sd_bus_message **reply, const char *types, ...);
/* Gives back an object the daemon made for a call that then failed here (its reply
 * unreadable past the object's name, or no memory to hand it over): the call's member on
 * path, waited for; the failed call's error stays the one recorded. Returns r. */
int epd__undo(epd_client *c, int r, const char *path, const char *interface, const char *member,
              const char *types, ...);
/* Sends the call without waiting for its reply: the reply is taken by a later
 * epd_process(), epd_wait(), epd_flush() or nowait call, and a refusal is kept (its
 * message prefixed with `member`) for epd_flush() to return. */
int epd__call_nowait(epd_client *c, const char *path, const char *interface, const char *member,
                     const char *types, ...);
/* Sends m without waiting: callback(reply, userdata) runs from sd_bus_process() when the
 * answer comes; userdata is freed with the call (also when sending fails). */
int epd__send_async(epd_client *c, sd_bus_message *m, sd_bus_message_handler_t callback, void *userdata);
/* Like epd__call, with a message the caller filled (sd_bus_message_new_method_call). */
int epd__new_call(epd_client *c, const char *path, const char *interface, const char *member,
                  sd_bus_message **ret);
int epd__send(epd_client *c, sd_bus_message *m, sd_bus_message **reply);
/* With the call's own timeout (0: sd-bus's default, 25 s). */
int epd__send_timeout(epd_client *c, sd_bus_message *m, uint64_t timeout_usec, sd_bus_message **reply);
/* epd_feature_wait against a daemon without org.epd1.Feature.Wait: woken by FeatureReady,
 * then Describe, until deadline (CLOCK_MONOTONIC usec; UINT64_MAX: none). Internal, and
 * for the tests (the daemon of the same build has Wait). */
struct epd_feature;
int epd__feature_wait_signal(epd_client *c, struct epd_feature *f, uint64_t deadline);
