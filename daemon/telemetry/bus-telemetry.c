/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Telemetry at /org/epd1/telemetry: vtable glue only; telemetry.c does the work. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/client.h"
#include "core/manager.h"
#include "log.h"
#include "telemetry/bus-telemetry.h"
#include "telemetry/telemetry-manager.h"

static int property_kernel(sd_bus *bus, const char *path, const char *interface, const char *property,
                           sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        TelemetryCounters c = {};
        if (m->telemetry)
                telemetry_get_counters(m->telemetry, &c);
        return sd_bus_message_append(reply, "b", c.bpf_loaded);
}

static int property_unavailable(sd_bus *bus, const char *path, const char *interface,
                                const char *property, sd_bus_message *reply, void *userdata,
                                sd_bus_error *error) {
        Manager *m = userdata;
        TelemetryCounters c = {};
        if (m->telemetry)
                telemetry_get_counters(m->telemetry, &c);
        return sd_bus_message_append(reply, "s", c.bpf_unavailable ?: "");
}

static int property_pin_dir(sd_bus *bus, const char *path, const char *interface, const char *property,
                            sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        TelemetryCounters c = {};
        if (m->telemetry)
                telemetry_get_counters(m->telemetry, &c);
        return sd_bus_message_append(reply, "s", c.bpf_loaded ? c.pin_dir ?: "" : "");
}

static int method_get_stats(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        TelemetryCounters c = {};
        int r;

        if (m->telemetry)
                telemetry_get_counters(m->telemetry, &c);
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_append(reply, "a{st}", 12,
                                  "ring_events", c.ring_events,
                                  "ring_bad", c.ring_bad,
                                  "ring_wakeups", c.ring_wakeups,
                                  "kernel_events", c.kernel_events,
                                  "kernel_dropped", c.kernel_dropped,
                                  "tracked_connections", (uint64_t)c.tracked,
                                  "peers", (uint64_t)c.peers,
                                  "traces", (uint64_t)c.traces,
                                  "traces_evicted", c.traces_evicted,
                                  "kernel_telemetry", (uint64_t)c.bpf_loaded,
                                  "kernel_run_nsec", c.kernel_run_nsec,
                                  "kernel_runs", c.kernel_runs);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

static int append_peer(sd_bus_message *reply, const TelemetryPeerStats *p) {
        int r = sd_bus_message_open_container(reply, 'r', "sa{sv}");
        if (r < 0)
                return r;
        r = sd_bus_message_append(reply, "s", p->name);
        if (r < 0)
                return r;
        r = sd_bus_message_append(
                reply, "a{sv}", 23,
                "kernel", "b", (int)p->kernel,
                "connections", "u", p->tracked,
                "established", "u", p->path.n_established,
                "srtt_us", "u", p->path.srtt_usec,
                "min_rtt_us", "u", p->path.min_rtt_usec,
                "cwnd", "u", p->path.cwnd,
                "bytes_sent", "t", p->path.bytes_sent,
                "bytes_acked", "t", p->path.bytes_acked,
                "bytes_received", "t", p->path.bytes_received,
                "bytes_retrans", "t", p->path.bytes_retrans,
                "segs_out", "t", p->path.segs_out,
                "retransmits", "t", p->path.retransmits,
                "send_queue", "t", p->path.send_queue,
                "level", "u", (uint32_t)p->level,
                "reason", "s", backpressure_reason_to_string(p->reason),
                "rtt_inflation", "d", p->rtt_inflation,
                "retransmit_rate", "d", p->retransmit_rate,
                "handoffs_in_flight", "u", p->handoffs_in_flight,
                "destination_free_pages", "t", p->destination_free_pages,
                "destination_total_pages", "t", p->destination_total_pages,
                "total_bytes_sent", "t", p->totals.bytes_sent,
                "total_bytes_acked", "t", p->totals.bytes_acked,
                "total_retransmits", "t", p->totals.retransmits);
        if (r < 0)
                return r;
        return sd_bus_message_close_container(reply);
}

static int method_get_peers(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r;

        r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_open_container(reply, 'a', "(sa{sv})");
        if (r < 0)
                return r;
        if (m->telemetry) {
                TelemetryPeerStats p;
                size_t i = 0;
                while (telemetry_iterate_peers(m->telemetry, &i, &p) > 0) {
                        r = append_peer(reply, &p);
                        if (r < 0)
                                return r;
                }
        }
        r = sd_bus_message_close_container(reply);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

static int method_get_trace(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *id;
        int r;

        r = sd_bus_message_read(msg, "s", &id);
        if (r < 0)
                return r;
        if (!trace_request_id_valid(id))
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Invalid request id (1-64 characters of A-Z a-z 0-9 . _ : -)");
        /* A trace names its request's steps, sizes and feature keys. The request id is
         * the caller's choice (anyone may record events under anyone's): root reads every
         * event, another uid those its own calls and objects recorded; one with none
         * hears NotFound, as for no trace at all (docs/security.md). No client is made
         * for the reader. */
        uid_t uid;
        if (manager_reader_uid(m, msg, &uid, NULL) < 0)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "The caller's uid cannot be read; GetTrace is refused.");
        const TraceRequest *t = m->telemetry ? telemetry_get_trace(m->telemetry, id) : NULL;
        size_t shown = 0;
        for (size_t i = 0; t && i < t->n_events; i++)
                shown += trace_event_readable(&t->events[i], (uint32_t)uid);
        if (!t || (shown == 0 && uid != 0))
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No trace for request '%s'", id);

        r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_open_container(reply, 'a', "(tsittsss)");
        if (r < 0)
                return r;
        for (size_t i = 0; i < t->n_events; i++) {
                const TraceEvent *e = &t->events[i];
                if (!trace_event_readable(e, (uint32_t)uid))
                        continue;
                r = sd_bus_message_append(reply, "(tsittsss)", e->ts_usec,
                                          trace_event_type_to_string(e->type), e->group, e->bytes,
                                          e->duration_usec, e->transport, e->peer, e->detail);
                if (r < 0)
                        return r;
        }
        r = sd_bus_message_close_container(reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "t", t->n_dropped);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

/* A TCP connection of a client's own (a worker's transfer socket), tracked for
 * kernel telemetry until the client untracks it or goes away. The daemon keeps a
 * duplicate of the fd, so that the socket's cookie stays valid while tracked. */
typedef struct TrackedSocket {
        ClientObject object;
        Manager *manager;
        int fd;
        uint64_t cookie;
        bool tracked; /* telemetry_track_client() took it: only then is it ours to untrack */
} TrackedSocket;

static void tracked_socket_release(ClientObject *o) {
        TrackedSocket *t = container_of(o, TrackedSocket, object);
        if (t->tracked && t->manager->telemetry)
                (void)telemetry_untrack(t->manager->telemetry, t->fd);
        client_object_unlink(o);
        safe_close(t->fd);
        free(t);
}

static uint64_t socket_cookie(int fd) {
        uint64_t c = 0;
        socklen_t l = sizeof c;
        return getsockopt(fd, SOL_SOCKET, SO_COOKIE, &c, &l) < 0 ? 0 : c;
}

static int check_tcp_socket(int fd, sd_bus_error *error) {
        int v = 0;
        socklen_t l = sizeof v;
        if (getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &v, &l) < 0 || v != IPPROTO_TCP)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Not a TCP socket");
        return 0;
}

static int method_track_socket(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *peer;
        Client *c;
        int fd, r;

        r = sd_bus_message_read(msg, "hs", &fd, &peer);
        if (r < 0)
                return r;
        r = check_tcp_socket(fd, error);
        if (r < 0)
                return r;
        if (!*peer || strlen(peer) > TELEMETRY_PEER_NAME_MAX)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Peer names are 1-%d bytes (a host id)",
                                     TELEMETRY_PEER_NAME_MAX);
        if (!m->telemetry)
                return epd_bus_error(error, EPD_ERROR_UNSUPPORTED, "Telemetry is not running");

        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        TrackedSocket *t = calloc(1, sizeof *t);
        if (!t)
                return -ENOMEM;
        t->manager = m;
        t->fd = fcntl(fd, F_DUPFD_CLOEXEC, 3);
        if (t->fd < 0) {
                r = -errno;
                free(t);
                return r;
        }
        t->cookie = socket_cookie(t->fd);
        r = client_object_link(c, &t->object, CLIENT_OBJECT_OTHER, tracked_socket_release);
        if (r < 0) {
                safe_close(t->fd);
                free(t);
                if (r == -EDQUOT)
                        return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "Too many objects for this client");
                return r;
        }
        r = telemetry_track_client(m->telemetry, t->fd, peer);
        t->tracked = r >= 0;
        if (r < 0) {
                tracked_socket_release(&t->object);
                if (r == -EEXIST)
                        return epd_bus_error(error, EPD_ERROR_EXISTS, "This socket is already tracked");
                if (r == -ENOSPC)
                        return epd_bus_error(error, EPD_ERROR_NO_SPACE, "Too many tracked connections or peers");
                if (r == -EINVAL)
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Invalid peer name");
                return r;
        }
        return sd_bus_reply_method_return(msg, NULL);
}

static int method_untrack_socket(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        Client *c = manager_client_lookup_message(m, msg);
        int fd, r;

        r = sd_bus_message_read(msg, "h", &fd);
        if (r < 0)
                return r;
        uint64_t cookie = socket_cookie(fd);
        if (c && cookie)
                LIST_FOREACH(objects, o, c->objects) {
                        if (o->release != tracked_socket_release)
                                continue;
                        TrackedSocket *t = container_of(o, TrackedSocket, object);
                        if (t->cookie != cookie)
                                continue;
                        tracked_socket_release(o);
                        return sd_bus_reply_method_return(msg, NULL);
                }
        return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "This client does not track that socket");
}

static const sd_bus_vtable telemetry_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("KernelTelemetry", "b", property_kernel, 0, 0),
        SD_BUS_PROPERTY("KernelTelemetryUnavailable", "s", property_unavailable, 0, 0),
        SD_BUS_PROPERTY("PinDirectory", "s", property_pin_dir, 0, 0),
        SD_BUS_METHOD_WITH_ARGS("GetStats", SD_BUS_NO_ARGS, SD_BUS_RESULT("a{st}", counters),
                                method_get_stats, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("GetPeers", SD_BUS_NO_ARGS, SD_BUS_RESULT("a(sa{sv})", peers),
                                method_get_peers, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("GetTrace", SD_BUS_ARGS("s", request_id),
                                SD_BUS_RESULT("a(tsittsss)", events, "t", dropped), method_get_trace,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("TrackSocket", SD_BUS_ARGS("h", socket, "s", peer), SD_BUS_NO_RESULT,
                                method_track_socket, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("UntrackSocket", SD_BUS_ARGS("h", socket), SD_BUS_NO_RESULT,
                                method_untrack_socket, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_SIGNAL_WITH_ARGS("Backpressure", SD_BUS_ARGS("s", peer, "u", level, "s", reason), 0),
        SD_BUS_VTABLE_END,
};

int bus_telemetry_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, TELEMETRY_OBJECT_PATH, TELEMETRY_INTERFACE,
                                         telemetry_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Telemetry object: %m");
        return 0;
}

int bus_telemetry_emit_backpressure(Manager *m, const char *peer, BackpressureLevel level,
                                    BackpressureReason reason) {
        return manager_emit_signal(m, TELEMETRY_OBJECT_PATH, TELEMETRY_INTERFACE, "Backpressure", "sus",
                                   peer, (uint32_t)level, backpressure_reason_to_string(reason));
}
