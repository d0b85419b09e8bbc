/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd: org.epd1.Telemetry. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "epd-internal.h"
#include "epd/epd-telemetry.h"

#define TELEMETRY_PATH "/org/epd1/telemetry"
#define TELEMETRY_IFACE "org.epd1.Telemetry"

static void copy(char *dst, size_t n, const char *src) {
        size_t l = src ? strnlen(src, n - 1) : 0;
        if (l)
                memcpy(dst, src, l);
        dst[l] = '\0';
}

int epd_trace_get(epd_client *c, const char *request_id, epd_trace_event **ret, size_t *n,
                           uint64_t *dropped) {
        sd_bus_message *reply = NULL;
        epd_trace_event *v = NULL;
        size_t k = 0, cap = 0;
        uint64_t d = 0;
        int r;

        if (!c || !request_id || !ret || !n)
                return epd__error(c, -EINVAL, NULL);
        r = epd__call(c, TELEMETRY_PATH, TELEMETRY_IFACE, "GetTrace", &reply, "s", request_id);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(reply, 'a', "(tsittsss)");
        for (;;) {
                if (r < 0)
                        break;
                uint64_t ts, bytes, dur;
                int32_t group;
                const char *type, *transport, *peer, *detail;
                r = sd_bus_message_read(reply, "(tsittsss)", &ts, &type, &group, &bytes, &dur, &transport,
                                        &peer, &detail);
                if (r <= 0)
                        break;
                if (k == cap) {
                        size_t nc = cap ? cap * 2 : 16;
                        epd_trace_event *t = realloc(v, nc * sizeof *t);
                        if (!t) {
                                r = -ENOMEM;
                                break;
                        }
                        v = t;
                        cap = nc;
                }
                epd_trace_event *e = &v[k++];
                *e = (epd_trace_event){ .ts_usec = ts, .group = group, .bytes = bytes, .duration_usec = dur };
                copy(e->type, sizeof e->type, type);
                copy(e->transport, sizeof e->transport, transport);
                copy(e->peer, sizeof e->peer, peer);
                copy(e->detail, sizeof e->detail, detail);
        }
        if (r >= 0)
                r = sd_bus_message_exit_container(reply);
        if (r >= 0)
                r = sd_bus_message_read(reply, "t", &d);
        sd_bus_message_unref(reply);
        if (r < 0) {
                free(v);
                return epd__error(c, r, NULL);
        }
        *ret = v;
        *n = k;
        if (dropped)
                *dropped = d;
        return 0;
}

int epd_telemetry_track_socket(epd_client *c, int fd, const char *peer) {
        if (!c || fd < 0 || !peer)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, TELEMETRY_PATH, TELEMETRY_IFACE, "TrackSocket", NULL, "hs", fd, peer);
}

int epd_telemetry_untrack_socket(epd_client *c, int fd) {
        if (!c || fd < 0)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, TELEMETRY_PATH, TELEMETRY_IFACE, "UntrackSocket", NULL, "h", fd);
}

typedef struct BackpressureSubscription {
        epd_client *client;
        epd_backpressure_fn fn;
        void *userdata;
} BackpressureSubscription;

static int on_backpressure(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        BackpressureSubscription *s = userdata;
        const char *peer, *reason;
        uint32_t level;
        if (s->client->closing || sd_bus_message_read(m, "sus", &peer, &level, &reason) < 0)
                return 0;
        s->fn(s->client, peer, level, reason, s->userdata);
        return 0;
}

int epd_backpressure_subscribe(epd_client *c, epd_backpressure_fn fn, void *userdata) {
        if (!c || !fn)
                return epd__error(c, -EINVAL, NULL);
        BackpressureSubscription *s = calloc(1, sizeof *s);
        if (!s)
                return epd__error(c, -ENOMEM, NULL);
        *s = (BackpressureSubscription){ c, fn, userdata };
        /* A direct connection gets broadcast signals only once it asks for them. */
        int k = c->direct ? epd__call(c, "/org/epd1", "org.epd1.Manager", "Subscribe", NULL, "b", 1) : 0;
        if (k < 0) {
                free(s);
                return k;
        }
        sd_bus_slot *slot = NULL;
        int r = sd_bus_match_signal(c->bus, &slot, c->direct ? NULL : "org.epd1", TELEMETRY_PATH,
                                    TELEMETRY_IFACE, "Backpressure", on_backpressure, s);
        if (r < 0) {
                free(s);
                return epd__error(c, r, NULL);
        }
        /* The slot lives as long as the connection; it frees the subscription with it. */
        (void)sd_bus_slot_set_destroy_callback(slot, free);
        (void)sd_bus_slot_set_floating(slot, true);
        sd_bus_slot_unref(slot);
        return 0;
}
