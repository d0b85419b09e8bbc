/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Placement at /org/epd1/placement: vtable glue only (dbus/org.epd1.Placement.xml).
 * LocatePrefix asks the directory's owners (pages/directory-forward.h) and replies when
 * they answered, through a waiter: no manager holds the D-Bus message. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/manager.h"
#include "log.h"
#include "macro.h"
#include "pages/directory-forward.h"
#include "sched/placement.h"

#define PLACEMENT_OBJECT_PATH "/org/epd1/placement"
#define PLACEMENT_INTERFACE "org.epd1.Placement"

typedef struct LocateCall {
        DirectoryLocateWaiter waiter;
        Manager *m;
        sd_bus_message *msg;
} LocateCall;

static int reply_locate(LocateCall *lc, const DirectoryLocateResult *res) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        PlacementCandidate *c = NULL;
        size_t n = 0;
        int r;

        r = placement_rank(res->entries, res->n, lc->m->config.host_id, &c, &n);
        if (r < 0)
                return bus_glue_reply_errno(lc->msg, r, "Cannot rank the holders.");
        r = sd_bus_message_new_method_return(lc->msg, &reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "usss", n ? c[0].n_blocks : 0, n ? c[0].host : "",
                                          n ? c[0].arena : "", n ? c[0].worker : "");
        if (r >= 0)
                r = sd_bus_message_open_container(reply, 'a', "(sssu)");
        for (size_t i = 0; r >= 0 && i < n; i++)
                r = sd_bus_message_append(reply, "(sssu)", c[i].host, c[i].arena, c[i].worker, c[i].n_blocks);
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "u", res->owners_missing);
        free(c);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

static void locate_done(DirectoryLocateWaiter *w, const DirectoryLocateResult *res) {
        LocateCall *lc = container_of(w, LocateCall, waiter);
        int r = reply_locate(lc, res);
        if (r < 0) {
                /* the reply could not be built: answered all the same */
                log_debug_errno(r, "placement: cannot reply to LocatePrefix: %m");
                (void)bus_glue_reply_errno(lc->msg, r, "Cannot build the reply.");
        }
        sd_bus_message_unref(lc->msg);
        free(lc);
}

static int method_locate_prefix(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const void *p;
        size_t sz, n;
        LocateCall *lc;
        int r;

        r = sd_bus_message_read_array(msg, 't', &p, &sz);
        if (r < 0)
                return r;
        n = sz / sizeof(uint64_t);
        if (n == 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "LocatePrefix needs at least one hash.");
        if (n > DIRECTORY_LOCATE_HASHES_MAX)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "At most %u hashes per LocatePrefix, not %zu.",
                                     DIRECTORY_LOCATE_HASHES_MAX, n);
        if (!m->directory_forward)
                return epd_bus_error(error, EPD_ERROR_UNSUPPORTED, "This daemon has no block directory.");
        lc = calloc(1, sizeof *lc);
        if (!lc)
                return -ENOMEM;
        lc->waiter.done = locate_done;
        lc->m = m;
        lc->msg = sd_bus_message_ref(msg);
        r = directory_forward_locate(m->directory_forward, p, n, &lc->waiter);
        if (r < 0) {
                sd_bus_message_unref(lc->msg);
                free(lc);
                if (r == -EBUSY)
                        return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                             "Too many LocatePrefix calls in flight already (at most %u, and %u "
                                             "hashes together); try again.",
                                             DIRECTORY_LOCATES_MAX, DIRECTORY_LOCATE_HASHES_IN_FLIGHT_MAX);
                return r;
        }
        return 1; /* replied, or replies when the owners answered */
}

static int property_counters(sd_bus *bus, const char *path, const char *interface, const char *property,
                             sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        DirectoryForwardStats s;
        int r;

        directory_forward_stats(m->directory_forward, &s);
        const struct {
                const char *name;
                uint64_t v;
        } c[] = {
                { "lookups", s.lookups },
                { "remote-queries", s.remote_queries },
                { "remote-answers", s.remote_answers },
                { "remote-timeouts", s.remote_timeouts },
                { "cache-hits", s.cache_hits },
                { "cache-misses", s.cache_misses },
                { "published-forwarded", s.published_forwarded },
                { "unpublished-forwarded", s.unpublished_forwarded },
                { "records-received", s.records_received },
                { "records-dropped", s.records_dropped },
                { "republished", s.republished },
                { "send-failures", s.send_failures },
        };
        r = sd_bus_message_open_container(reply, 'a', "(st)");
        for (size_t i = 0; r >= 0 && i < ELEMENTSOF(c); i++)
                r = sd_bus_message_append(reply, "(st)", c[i].name, c[i].v);
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        return r;
}

static const sd_bus_vtable placement_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_METHOD_WITH_ARGS("LocatePrefix", SD_BUS_ARGS("at", hashes),
                                SD_BUS_RESULT("u", n_blocks, "s", host, "s", arena, "s", worker, "a(sssu)", candidates,
                                              "u", owners_missing),
                                method_locate_prefix, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_PROPERTY("Counters", "a(st)", property_counters, 0, 0),
        SD_BUS_VTABLE_END,
};

static int bus_placement_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, PLACEMENT_OBJECT_PATH, PLACEMENT_INTERFACE, placement_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Placement object: %m");
        return 0;
}

/* Placement has no state of its own: the directory's owners hold it. Its subsystem
 * entry only puts the object on every connection. */
const Subsystem placement_subsystem = {
        .name = "placement",
        .add_bus = bus_placement_add,
};
