/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "telemetry/telemetry-manager.h"

#include <errno.h>

#include "log.h"
#include "macro.h"
#include "telemetry/bus-telemetry.h"

int telemetry_track_socket(Manager *m, int fd, const char *peer) {
        if (!m->telemetry)
                return 0;
        int r = telemetry_track(m->telemetry, fd, peer);
        if (r < 0)
                log_debug_errno(r, "Not tracking the connection to %s: %m", peer);
        return r == -EEXIST ? 0 : r;
}

int telemetry_untrack_socket(Manager *m, int fd) {
        if (!m->telemetry)
                return 0;
        int r = telemetry_untrack(m->telemetry, fd);
        return r == -ENOENT ? 0 : r;
}

int telemetry_untrack_peer(Manager *m, const char *peer) {
        if (!m->telemetry)
                return 0;
        int r = telemetry_untrack_all(m->telemetry, peer);
        return r == -ENOENT ? 0 : r;
}

int telemetry_peer_stats(Manager *m, const char *peer, TelemetryPeerStats *ret) {
        if (!m->telemetry)
                return -ENOENT;
        return telemetry_get_peer(m->telemetry, peer, ret);
}

int telemetry_peer_load(Manager *m, const char *peer, unsigned handoffs_in_flight,
                        uint64_t destination_free_pages, uint64_t destination_total_pages) {
        if (!m->telemetry)
                return 0;
        return telemetry_set_peer_load(m->telemetry, peer, handoffs_in_flight, destination_free_pages,
                                       destination_total_pages);
}

BackpressureLevel telemetry_peer_backpressure(Manager *m, const char *peer) {
        return m->telemetry ? telemetry_get_level(m->telemetry, peer) : BACKPRESSURE_NONE;
}

int telemetry_trace(Manager *m, const char *request_id, TraceEventType type, const TraceDetail *d) {
        if (!m->telemetry || !request_id)
                return 0;
        return telemetry_record(m->telemetry, request_id, type, d);
}

int telemetry_trace_n(Manager *m, const char *request_id, TraceEventType type, const TraceDetail *d, size_t n) {
        if (!m->telemetry || !request_id)
                return 0;
        return telemetry_record_n(m->telemetry, request_id, type, d, n);
}

static void on_backpressure_bus(Telemetry *t, const char *peer, BackpressureLevel level,
                                BackpressureReason reason, void *userdata) {
        Manager *m = userdata;
        int r = bus_telemetry_emit_backpressure(m, peer, level, reason);
        if (r < 0)
                log_warning_errno(r, "Cannot emit Backpressure for %s: %m", peer);
}

static int subsystem_init(Manager *m) {
        _cleanup_(telemetry_freep) Telemetry *t = NULL;
        int r;

        r = telemetry_new(&t, m->event, &m->config.telemetry);
        if (r < 0)
                return log_error_errno(r, "Cannot set up telemetry: %m");
        r = telemetry_add_backpressure_handler(t, on_backpressure_bus, m);
        if (r < 0)
                return log_error_errno(r, "Cannot subscribe to backpressure: %m");
        r = telemetry_start(t);
        if (r < 0)
                return r;
        m->telemetry = TAKE_PTR(t);
        return 0;
}

static void subsystem_done(Manager *m) {
        m->telemetry = telemetry_free(m->telemetry);
}

static int subsystem_reload(Manager *m, const Config *n) {
        if (!m->telemetry)
                return 0;
        return telemetry_reconfigure(m->telemetry, &n->telemetry);
}

const Subsystem telemetry_subsystem = {
        .name = "telemetry",
        .init = subsystem_init,
        .done = subsystem_done,
        .add_bus = bus_telemetry_add,
        .reload = subsystem_reload,
};
