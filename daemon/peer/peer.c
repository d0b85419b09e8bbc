/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "peer/peer-internal.h"
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "hashmap.h"
#include "log.h"
#include "macro.h"
#include "time-util.h"

/* ---- peers ---- */

void peer_set_error(Peer *p, const char *why, int error) {
        if (error)
                snprintf(p->last_error, sizeof p->last_error, "%s: %s", why, strerror(-error));
        else
                snprintf(p->last_error, sizeof p->last_error, "%s", why);
}

static void notify_state(Peer *p, bool up) {
        PeerManager *pm = p->pm;

        for (size_t i = 0; i < pm->n_state_handlers; i++)
                pm->state_handlers[i].fn(p, up, pm->state_handlers[i].userdata);
}

static int reconnect_cb(sd_event_source *s, uint64_t usec, void *userdata) {
        Peer *p = userdata;
        int r;

        if (p->state != PEER_DOWN || p->retired)
                return 0;
        r = peer_dial(p, PEER_ROLE_CONTROL, 0);
        if (r < 0) {
                peer_set_error(p, "connect", r);
                peer_down(p, r, "connect failed");
        }
        return 0;
}

static void peer_schedule_reconnect(Peer *p) {
        PeerManager *pm = p->pm;
        uint16_t jitter = 0;
        usec_t delay;
        int r;

        if (!p->dialer || !pm->started || p->retired)
                return;
        if (p->backoff_usec == 0)
                p->backoff_usec = PEER_RECONNECT_MIN_USEC;
        delay = p->backoff_usec;
        /* +-25% jitter, so that peers restarting together do not retry in lockstep. */
        (void)peer_auth_random(&jitter, sizeof jitter);
        delay = delay * 3 / 4 + delay / 2 * jitter / UINT16_MAX;
        p->backoff_usec = MIN(p->backoff_usec * 2, PEER_RECONNECT_MAX_USEC);

        if (!p->reconnect_timer)
                r = sd_event_add_time_relative(pm->event, &p->reconnect_timer, CLOCK_MONOTONIC,
                                               delay, 0, reconnect_cb, p);
        else {
                r = sd_event_source_set_time_relative(p->reconnect_timer, delay);
                if (r >= 0)
                        r = sd_event_source_set_enabled(p->reconnect_timer, SD_EVENT_ONESHOT);
        }
        if (r < 0)
                log_warning_errno(r, "peer %s: cannot schedule reconnect: %m", p->name);
}

static usec_t heartbeat_verdict_usec(const Peer *p);

/* How long a session must have lasted for its end to reset the dialer's backoff
 * (PEER_SESSION_STABLE_USEC: longer than the longest backoff, and than the heartbeat's
 * verdict on this session). */
static usec_t session_stable_usec(const Peer *p) {
        return MAX(PEER_SESSION_STABLE_USEC, 2 * heartbeat_verdict_usec(p));
}

/* Ends the session (or the attempt) with p: everything in flight fails with `error`,
 * handlers hear "down", and the dialer reconnects after its backoff: from the shortest
 * again if the session had lasted session_stable_usec(), the longest if another host with
 * our HostId superseded it, else the next of the doubling. */
static void peer_end(Peer *p, int error, const char *why, bool superseded) {
        bool was_up = p->state == PEER_UP;

        p->down_why = NULL; /* a deferred one is this */
        (void)sd_event_source_set_enabled(p->down_defer, SD_EVENT_OFF);
        if (p->state == PEER_DOWN && !p->control) {
                /* An attempt that failed before it had a connection (socket() or
                 * connect() refused at once: no route yet, EMFILE): the one-shot
                 * reconnect timer has fired already, so retry after the backoff unless
                 * a retry is due anyway. Without this the dialer never tried again. */
                int enabled = SD_EVENT_OFF;
                if (!p->reconnect_timer ||
                    (sd_event_source_get_enabled(p->reconnect_timer, &enabled) >= 0 && enabled == SD_EVENT_OFF))
                        peer_schedule_reconnect(p);
                return;
        }
        if (was_up) {
                log_warning("peer %s (%s): down: %s%s%s", p->name, p->host_id, why,
                            error ? ": " : "", error ? strerror(-error) : "");
                p->stats.disconnects++;
                /* Not at AUTH_OK: a session that ends at once (superseded by a host that
                 * shares our HostId, a data stream that cannot attach, silence) would
                 * otherwise come back every PEER_RECONNECT_MIN_USEC for ever. */
                if (superseded)
                        p->backoff_usec = PEER_RECONNECT_MAX_USEC;
                else if (now_usec(CLOCK_MONOTONIC) - p->stats.up_since_usec >= session_stable_usec(p))
                        p->backoff_usec = 0;
        } else
                log_debug("peer %s: connection attempt failed: %s", p->name, why);
        peer_set_error(p, why, error);
        /* Frames held for the idle point (a COMMIT, say) go out before the connection
         * closes, as they would have had they been written at once; best effort. */
        if (p->control && p->control->flush_due)
                (void)peer_conn_flush(p->control);
        p->control = peer_conn_free(p->control);
        /* Handshakes of this peer's data streams (either direction) end with it, and
         * our own dial; a control connection it dialed to us, waiting for AUTH, is a new
         * session (the host restarted and dials again while the old one stood): spared,
         * as a supersede spares it (peer_conn_unpend()). */
        LIST_FOREACH_SAFE(pending, c, n, p->pm->pending)
                if (c->peer == p && !(c->role == PEER_ROLE_CONTROL && !c->dialer))
                        peer_conn_free(c);
        sd_event_source_set_enabled(p->heartbeat_timer, SD_EVENT_OFF);
        p->state = PEER_DOWN;
        p->session_id = 0;
        if (p->pm->tcp)
                tcp_transport_peer_reset(p->pm->tcp, p, error ? error : -ECONNRESET);
        if (was_up)
                notify_state(p, false);
        peer_schedule_reconnect(p);
}

void peer_down(Peer *p, int error, const char *why) {
        peer_end(p, error, why, false);
}

/* Our session was superseded (BYE superseded): the acceptor took a newer control
 * connection that authenticated with our HostId. We never dial a second one while ours
 * is up, so another host uses our HostId (a cloned /etc/machine-id, a copied
 * configuration): we wait the longest backoff, so that the two of us end each other's
 * sessions once per PEER_RECONNECT_MAX_USEC at most (not ten times a second), and say so. */
void peer_superseded(Peer *p) {
        log_error("peer %s (%s): our session was superseded by another connection that authenticated as our "
                  "HostId '%s': two hosts use HostId=%s (a cloned /etc/machine-id?), give each its own; "
                  "next attempt in %u s",
                  p->name, p->host_id, p->pm->host_id, p->pm->host_id,
                  (unsigned)(PEER_RECONNECT_MAX_USEC / USEC_PER_SEC));
        peer_end(p, -ECONNRESET, "superseded: another host uses our HostId", true);
}

/* A new authenticated control connection from p's host while its session is up: a
 * restarted host whose old connection is not reset yet, or another host with the same
 * HostId. The old session ends, its dialer told why (BYE superseded): if it is alive it
 * is the duplicate, backs off to the longest and logs it (peer_superseded()). */
void peer_supersede(Peer *p, Conn *by) {
        char was[64] = "?", now[64];

        peer_conn_from(by, now);
        if (p->state == PEER_UP && p->control) {
                peer_conn_from(p->control, was);
                peer_conn_say_bye(p->control, PEER_FAIL_SUPERSEDED);
        }
        log_warning("peer %s (%s): session from %s superseded by a new connection from %s (a restarted host; "
                    "if it repeats, two hosts share HostId=%s)", p->name, p->host_id, was, now, p->host_id);
        peer_down(p, -ECONNRESET, "superseded by a new connection");
}

void peer_stream_failed(Peer *p, int error, const char *what) {
        peer_down(p, error, what);
}

/* The two sides' HeartbeatInterval may differ (hosts configured apart, a rolling
 * reload). The dialer learns the acceptor's from AUTH_OK and takes the smaller to send
 * (every quarter of it) and the larger for its verdict: each side then hears from the
 * other within its own bound, whichever dialed. The acceptor keeps its own for both.
 * A reload (SIGHUP) changes our own mid-session, which the peer does not learn: until
 * the session ends each side also keeps to the interval it had when the session came up
 * (sends no slower, judges no sooner), or a reload to a longer interval on one host had
 * the other declare it dead on the next idle stretch, and one to a shorter interval
 * judged a peer still sending at the old pace too soon. */
static usec_t heartbeat_send_usec(const Peer *p) {
        usec_t own = p->pm->heartbeat_usec, theirs = p->their_heartbeat_usec, then = p->session_heartbeat_usec;
        if (then > 0)
                own = MIN(own, then);
        return theirs > 0 ? MIN(own, theirs) : own;
}

static usec_t heartbeat_verdict_usec(const Peer *p) {
        return MAX(MAX(p->pm->heartbeat_usec, p->their_heartbeat_usec), p->session_heartbeat_usec);
}

static int heartbeat_cb(sd_event_source *s, uint64_t usec, void *userdata) {
        Peer *p = userdata;
        usec_t now = now_usec(CLOCK_MONOTONIC);
        uint8_t buf[16];
        PeerHeartbeat hb;
        int r;

        if (p->state != PEER_UP)
                return 0;
        if (now > p->stats.last_rx_usec + heartbeat_verdict_usec(p)) {
                /* Our own loop may have been the slow one: read what already arrived
                 * before calling the peer dead. */
                r = peer_conn_read(p->control);
                if (r == 1)
                        return 0;
                if (r < 0) {
                        peer_conn_fail(p->control, r, r == -ECONNRESET ? "connection closed" : "reading");
                        return 0;
                }
        }
        if (now > p->stats.last_rx_usec + heartbeat_verdict_usec(p)) {
                p->stats.heartbeats_missed++;
                peer_down(p, -ETIMEDOUT, "heartbeat timeout");
                return 0;
        }
        hb = (PeerHeartbeat){ .seq = ++p->heartbeat_seq, .time_usec = now };
        (void)peer_heartbeat_encode(&hb, buf, sizeof buf);
        r = peer_conn_queue(p->control, PEER_MSG_HEARTBEAT, buf, sizeof buf);
        if (r < 0) {
                peer_down(p, r, "sending heartbeat");
                return 0;
        }
        (void)sd_event_source_set_time_relative(s, heartbeat_send_usec(p) / 4);
        (void)sd_event_source_set_enabled(s, SD_EVENT_ON);
        return 0;
}

int peer_up(Peer *p, Conn *c, uint64_t session_id, unsigned n_streams) {
        PeerManager *pm = p->pm;
        int r;

        peer_conn_unpend(c);
        c->timeout = sd_event_source_disable_unref(c->timeout);
        c->state = CONN_UP;
        p->control = c;
        p->session_id = session_id;
        p->n_streams = n_streams;
        p->state = PEER_UP;
        /* The backoff stays: only a session that lasts resets it (peer_end()). */
        p->stats.connects++;
        p->stats.last_rx_usec = p->stats.up_since_usec = now_usec(CLOCK_MONOTONIC);
        p->last_error[0] = 0;
        p->session_heartbeat_usec = pm->heartbeat_usec;

        if (!p->heartbeat_timer)
                r = sd_event_add_time_relative(pm->event, &p->heartbeat_timer, CLOCK_MONOTONIC,
                                               heartbeat_send_usec(p) / 4, 0, heartbeat_cb, p);
        else {
                r = sd_event_source_set_time_relative(p->heartbeat_timer, heartbeat_send_usec(p) / 4);
                if (r >= 0)
                        r = sd_event_source_set_enabled(p->heartbeat_timer, SD_EVENT_ON);
        }
        if (r < 0)
                return r;

        log_info("peer %s (%s): up, session %016llx, %u data stream(s)", p->name, p->host_id,
                 (unsigned long long)session_id, n_streams);

        if (p->dialer)
                for (unsigned i = 0; i < n_streams; i++) {
                        r = peer_dial(p, PEER_ROLE_DATA, i);
                        if (r < 0)
                                return r;
                }
        notify_state(p, true);
        return 0;
}

static int down_defer_cb(sd_event_source *s, void *userdata) {
        Peer *p = userdata;
        if (p->down_why)
                peer_down(p, p->down_error, p->down_why);
        return 0;
}

/* A write failed inside a caller's call (a handoff sending its ROLLBACK, say): the
 * session ends on the loop's next turn, not under that caller, whose objects the "down"
 * handlers may free. Until then sends fail (the socket's error stays). */
static void peer_down_later(Peer *p, int error, const char *why) {
        int r;

        if (p->down_why)
                return;
        p->down_error = error;
        p->down_why = why;
        if (!p->down_defer)
                r = sd_event_add_defer(p->pm->event, &p->down_defer, down_defer_cb, p);
        else
                r = sd_event_source_set_enabled(p->down_defer, SD_EVENT_ONESHOT);
        if (r < 0) /* the connection's own handler still sees the broken socket */
                log_warning_errno(r, "peer %s: cannot defer ending the session: %m", p->name);
}

/* ---- control frames at the loop's idle point ---- */

/* What a loop that never idles lets wait, and what goes at once however busy it is. */
#define PEER_FLUSH_MAX_USEC 100U
#define PEER_FLUSH_BYTES (64U * 1024U)

/* Writes what c held for the idle point; a write error ends its session (later). */
static void flush_one(Conn *c) {
        LIST_REMOVE(due, c->pm->flush_due, c);
        c->flush_due = false;
        int r = peer_conn_flush(c);
        if (r < 0 && c->peer && c->peer->control == c)
                peer_down_later(c->peer, r, "writing");
}

static void flush_all(PeerManager *pm) {
        if (pm->flush)
                (void)sd_event_source_set_enabled(pm->flush, SD_EVENT_OFF);
        while (pm->flush_due)
                flush_one(pm->flush_due);
}

static int on_flush(sd_event_source *s, void *userdata) {
        flush_all(userdata);
        return 0;
}

/* An up session's control frames leave together when the loop has nothing else to do:
 * the frames of many handoffs prepared, acknowledged or released one event after
 * another go out in one send() (and one wakeup of the peer) rather than one each. Any
 * other connection, a queue of PEER_FLUSH_BYTES, or no source: written now. */
int peer_conn_flush_soon(Conn *c) {
        PeerManager *pm = c->pm;

        if (!pm->started || c->state != CONN_UP || c->role != PEER_ROLE_CONTROL || !c->peer ||
            c->peer->control != c || c->out_end - c->out_start >= PEER_FLUSH_BYTES)
                return peer_conn_flush(c); /* stays on the list if it is: a no-op there */
        if (c->flush_due)
                return 0;
        if (!pm->flush && sd_event_add_defer(pm->event, &pm->flush, on_flush, pm) >= 0)
                /* Before the data streams' (SD_EVENT_PRIORITY_IDLE - 1): a PREPARE is on
                 * the wire ahead of its pipelined data, which would otherwise wait. */
                (void)sd_event_source_set_priority(pm->flush, SD_EVENT_PRIORITY_IDLE - 2);
        if (!pm->flush || sd_event_source_set_enabled(pm->flush, SD_EVENT_ONESHOT) < 0)
                return peer_conn_flush(c);
        if (!pm->flush_due)
                pm->flush_since = now_usec(CLOCK_MONOTONIC);
        c->flush_due = true;
        LIST_PREPEND(due, pm->flush_due, c);
        return 0;
}

/* The peer's control frames held for the idle point, written now. */
void peer_flush_control(Peer *p) {
        if (p->control && p->control->flush_due)
                flush_one(p->control);
}

void peer_flush_overdue(PeerManager *pm) {
        if (pm && pm->flush_due && now_usec(CLOCK_MONOTONIC) >= pm->flush_since + PEER_FLUSH_MAX_USEC)
                flush_all(pm);
}

int peer_send(Peer *p, uint16_t type, const void *payload, size_t len) {
        int r;

        if (!p || type <= PEER_MSG_CORE_LAST || (len > 0 && !payload))
                return -EINVAL;
        if (p->state != PEER_UP || !p->control)
                return -ENOTCONN;
        if (p->down_why)
                return -ENOTCONN; /* ending: see peer_down_later() */
        r = peer_conn_queue(p->control, type, payload, len);
        if (r < 0 && r != -EMSGSIZE && r != -ENOBUFS) {
                /* The socket itself failed: the session is over. The caller learns
                 * through the state handler as well, once its call has returned. */
                peer_down_later(p, r, "writing");
                return -ENOTCONN;
        }
        return r;
}

void peer_cork(Peer *p) {
        if (p->state == PEER_UP && p->control)
                p->control->corked = true;
}

void peer_uncork(Peer *p) {
        int r;

        if (p->state != PEER_UP || !p->control || !p->control->corked)
                return;
        p->control->corked = false;
        r = peer_conn_flush(p->control);
        if (r < 0)
                peer_down_later(p, r, "writing");
}

int peer_send_core(Peer *p, uint16_t type, const void *payload, size_t len) {
        int r;

        if (p->state != PEER_UP || !p->control || p->down_why)
                return -ENOTCONN;
        r = peer_conn_queue(p->control, type, payload, len);
        /* A transport's control message (an acknowledgement, an RDMA request, grant or
         * ack) that is not queued, a full queue included, leaves its write waiting for
         * ever: the session ends, on the loop's next turn (not under the transport's
         * call), and every write in flight fails with it. */
        if (r < 0)
                peer_down_later(p, r, "queueing a transport message");
        return r;
}

const char *peer_host_id(Peer *p) {
        return p ? p->host_id : NULL;
}
const char *peer_name(Peer *p) {
        return p ? p->name : NULL;
}
const char *peer_address(Peer *p) {
        return p ? p->address : NULL;
}
bool peer_is_up(Peer *p) {
        return p && p->state == PEER_UP;
}
PeerState peer_state(Peer *p) {
        return p->state;
}
const PeerStats *peer_stats(Peer *p) {
        return &p->stats;
}
const char *peer_last_error(Peer *p) {
        return p->last_error;
}
unsigned peer_n_streams_up(Peer *p) {
        return p->pm->tcp ? tcp_transport_streams_up(p->pm->tcp, p) : 0;
}
int peer_control_fd(Peer *p) {
        return p->state == PEER_UP && p->control ? p->control->fd : -1;
}
PeerManager *peer_get_manager(Peer *p) {
        return p->pm;
}
uint64_t peer_session_id(Peer *p) {
        return p->session_id;
}
