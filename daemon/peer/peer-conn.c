/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "peer/peer-internal.h"
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "hashmap.h"
#include "log.h"
#include "macro.h"

static const char *const peer_state_table[_PEER_STATE_MAX] = {
        [PEER_DOWN] = "down",
        [PEER_CONNECTING] = "connecting",
        [PEER_AUTHENTICATING] = "authenticating",
        [PEER_UP] = "up",
};

const char *peer_state_to_string(PeerState s) {
        if ((unsigned)s >= _PEER_STATE_MAX)
                return NULL;
        return peer_state_table[s];
}

static int conn_io(sd_event_source *s, int fd, uint32_t revents, void *userdata);
static int conn_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len);

/* ---- refusals, counted and logged with a bound ---- */

static const int note_level[_PEER_NOTE_MAX] = {
        [PEER_NOTE_UNKNOWN_HOST] = LOG_WARNING,
        [PEER_NOTE_BAD_MAC] = LOG_ERR,
        [PEER_NOTE_REFUSED_US] = LOG_ERR,
        [PEER_NOTE_VERSION] = LOG_WARNING,
        [PEER_NOTE_PROTOCOL] = LOG_WARNING,
        [PEER_NOTE_EVICTED] = LOG_WARNING,
        [PEER_NOTE_ACCEPT] = LOG_WARNING,
};

static usec_t note_interval(const PeerManager *pm) {
        return pm->note_interval_usec ? pm->note_interval_usec : PEER_NOTE_INTERVAL_USEC;
}

/* One line of a kind: its latest event, and how many it stands for. */
static void note_say(PeerManager *pm, PeerNoteKind kind, usec_t now) {
        PeerNote *n = pm->notes + kind;

        if (n->unsaid > 1)
                log_full(note_level[kind], "%s (and %" PRIu64 " more like it in the last %" PRIu64 " s; %" PRIu64
                         " in all)", n->last, n->unsaid - 1,
                         (uint64_t)MAX((now - n->said_usec + USEC_PER_SEC / 2) / USEC_PER_SEC, (usec_t)1), n->total);
        else if (n->total > 1)
                log_full(note_level[kind], "%s (%" PRIu64 " in all)", n->last, n->total);
        else
                log_full(note_level[kind], "%s", n->last);
        n->unsaid = 0;
        n->said_usec = now;
}

static void note_arm(PeerManager *pm);

static int on_note_timer(sd_event_source *s, uint64_t usec, void *userdata) {
        PeerManager *pm = userdata;
        usec_t now = now_usec(CLOCK_MONOTONIC);

        for (unsigned k = 0; k < _PEER_NOTE_MAX; k++)
                if (pm->notes[k].unsaid > 0 && now >= pm->notes[k].said_usec + note_interval(pm))
                        note_say(pm, k, now);
        note_arm(pm);
        return 0;
}

void peer_notes_done(PeerManager *pm) {
        usec_t now = now_usec(CLOCK_MONOTONIC);

        for (unsigned k = 0; k < _PEER_NOTE_MAX; k++)
                if (pm->notes[k].unsaid > 0)
                        note_say(pm, k, now);
        pm->note_timer = sd_event_source_disable_unref(pm->note_timer);
        pm->listen_retry = sd_event_source_disable_unref(pm->listen_retry);
}

/* The note timer, at the earliest time a kind with something unsaid may speak again.
 * Without a listen source (nothing of others' to refuse) or a timer, what is unsaid is
 * said with the kind's next event past its interval. */
static void note_arm(PeerManager *pm) {
        usec_t next = USEC_INFINITY;
        int r;

        for (unsigned k = 0; k < _PEER_NOTE_MAX; k++)
                if (pm->notes[k].unsaid > 0)
                        next = MIN(next, pm->notes[k].said_usec + note_interval(pm));
        if (next == USEC_INFINITY) {
                (void)sd_event_source_set_enabled(pm->note_timer, SD_EVENT_OFF);
                return;
        }
        if (!pm->listen_source)
                return;
        if (!pm->note_timer)
                r = sd_event_add_time(pm->event, &pm->note_timer, CLOCK_MONOTONIC, next, 0, on_note_timer, pm);
        else {
                r = sd_event_source_set_time(pm->note_timer, next);
                if (r >= 0)
                        r = sd_event_source_set_enabled(pm->note_timer, SD_EVENT_ONESHOT);
        }
        if (r < 0)
                log_debug_errno(r, "peer: cannot arm the timer of refusal counts: %m");
}

void peer_note(PeerManager *pm, PeerNoteKind kind, const char *fmt, ...) {
        PeerNote *n = pm->notes + kind;
        usec_t now = now_usec(CLOCK_MONOTONIC);
        va_list ap;

        va_start(ap, fmt);
        (void)vsnprintf(n->last, sizeof n->last, fmt, ap);
        va_end(ap);
        n->total++;
        n->unsaid++;
        if (n->said_usec == 0 || now >= n->said_usec + note_interval(pm))
                note_say(pm, kind, now);
        else
                note_arm(pm);
}

static const char *sockaddr_to_string(const struct sockaddr_storage *sa, char buf[static 64]) {
        char a[INET6_ADDRSTRLEN];

        if (sa->ss_family == AF_INET &&
            inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, a, sizeof a))
                snprintf(buf, 64, "%s:%u", a, ntohs(((const struct sockaddr_in *)sa)->sin_port));
        else if (sa->ss_family == AF_INET6 &&
                 inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, a, sizeof a))
                snprintf(buf, 64, "[%s]:%u", a, ntohs(((const struct sockaddr_in6 *)sa)->sin6_port));
        else
                snprintf(buf, 64, "?");
        return buf;
}

const char *peer_conn_from(const Conn *c, char buf[static 64]) {
        return sockaddr_to_string(&c->from, buf);
}

/* ---- connections ---- */

void peer_conn_pend(Conn *c) {
        if (c->pending)
                return;
        c->pending = true;
        LIST_PREPEND(pending, c->pm->pending, c);
        if (!c->dialer)
                c->pm->n_pending++;
}

void peer_conn_unpend(Conn *c) {
        if (!c->pending)
                return;
        c->pending = false;
        LIST_REMOVE(pending, c->pm->pending, c);
        if (!c->dialer)
                c->pm->n_pending--;
}

Conn *peer_conn_free(Conn *c) {
        if (!c)
                return NULL;
        peer_conn_unpend(c);
        if (c->flush_due)
                LIST_REMOVE(due, c->pm->flush_due, c);
        sd_event_source_disable_unref(c->io);
        sd_event_source_disable_unref(c->timeout);
        safe_close(c->fd);
        free(c->payload);
        free(c->in);
        free(c->out);
        free(c);
        return NULL;
}

static int conn_handshake_timeout(sd_event_source *s, uint64_t usec, void *userdata) {
        Conn *c = userdata;

        if (c->role == PEER_ROLE_CONTROL && c->peer && c->peer->control == c)
                peer_down(c->peer, -ETIMEDOUT, "handshake timed out");
        else if (c->dialer && c->peer)
                peer_stream_failed(c->peer, -ETIMEDOUT, "data stream handshake timed out");
        else {
                log_debug("peer: unauthenticated connection timed out");
                peer_conn_free(c);
        }
        return 0;
}

int peer_conn_new(PeerManager *pm, int fd, bool dialer, Conn **ret) {
        Conn *c;
        usec_t to = MAX(pm->heartbeat_usec, USEC_PER_SEC);
        int r;

        c = calloc(1, sizeof *c);
        if (!c)
                return -ENOMEM;
        c->pm = pm;
        c->fd = fd;
        c->dialer = dialer;
        r = sd_event_add_io(pm->event, &c->io, fd, EPOLLIN, conn_io, c);
        if (r < 0)
                goto fail;
        /* Ahead of the data streams when both are readable: a pipelined write's PREPARE
         * read before its data, which would otherwise park its stream (and the
         * acknowledgements that free the sender's window before more data). */
        (void)sd_event_source_set_priority(c->io, SD_EVENT_PRIORITY_NORMAL - 1);
        r = sd_event_add_time_relative(pm->event, &c->timeout, CLOCK_MONOTONIC, to, 0,
                                       conn_handshake_timeout, c);
        if (r < 0)
                goto fail;
        *ret = c;
        return 0;
fail:
        c->fd = -EBADF; /* the caller still owns fd */
        peer_conn_free(c);
        return r;
}

int peer_conn_update_events(Conn *c) {
        uint32_t ev = EPOLLIN;

        if (c->state == CONN_CONNECTING)
                ev = EPOLLOUT;
        else if (c->out_end > c->out_start)
                ev |= EPOLLOUT;
        return sd_event_source_set_io_events(c->io, ev);
}

/* Writes as much of the output queue as the socket takes. */
int peer_conn_flush(Conn *c) {
        while (c->out_end > c->out_start) {
                ssize_t n = send(c->fd, c->out + c->out_start, c->out_end - c->out_start,
                                 MSG_NOSIGNAL | MSG_DONTWAIT);
                if (n < 0) {
                        if (errno == EINTR)
                                continue;
                        if (errno == EAGAIN)
                                break;
                        return -errno;
                }
                c->out_start += (size_t)n;
        }
        if (c->out_start == c->out_end)
                c->out_start = c->out_end = 0;
        return peer_conn_update_events(c);
}

int peer_conn_queue(Conn *c, uint16_t type, const void *payload, size_t len) {
        size_t need;
        int r;

        if (len > peer_frame_max_payload(type))
                return -EMSGSIZE;
        need = PEER_FRAME_HEADER_SIZE + len;
        if (c->out_end - c->out_start + need > PEER_OUTPUT_MAX)
                return -ENOBUFS;
        if (c->out_start > 0 && c->out_end + need > c->out_cap) {
                memmove(c->out, c->out + c->out_start, c->out_end - c->out_start);
                c->out_end -= c->out_start;
                c->out_start = 0;
        }
        if (c->out_end + need > c->out_cap) {
                size_t cap = MAX(c->out_cap * 2, c->out_end + need);
                uint8_t *b = realloc(c->out, MAX(cap, (size_t)4096));
                if (!b)
                        return -ENOMEM;
                c->out = b;
                c->out_cap = MAX(cap, (size_t)4096);
        }
        r = peer_frame_build(c->out + c->out_end, c->out_cap - c->out_end, type, payload, len);
        if (r < 0)
                return r;
        c->out_end += (size_t)r;
        if (c->peer && c->state == CONN_UP) {
                c->peer->stats.frames_out++;
                c->peer->stats.bytes_out += (uint64_t)r;
        }
        if (c->corked)
                return 0;
        return peer_conn_flush_soon(c);
}

void peer_conn_send_fail(Conn *c, PeerFailReason reason) {
        uint8_t buf[4];
        PeerReason pr = { .reason = reason };

        if (peer_reason_encode(&pr, buf, sizeof buf) > 0)
                (void)peer_conn_queue(c, PEER_MSG_AUTH_FAIL, buf, sizeof buf);
}

void peer_conn_say_bye(Conn *c, PeerFailReason reason) {
        PeerReason pr = { .reason = reason };
        uint8_t buf[4096];

        c->corked = false;
        if (peer_reason_encode(&pr, buf, sizeof buf) < 0 || peer_conn_queue(c, PEER_MSG_BYE, buf, 4) < 0 ||
            peer_conn_flush(c) < 0)
                return;
        for (unsigned i = 0; i < 64; i++)
                if (recv(c->fd, buf, sizeof buf, MSG_DONTWAIT) <= 0)
                        break;
}

void peer_set_socket_options(PeerManager *pm, int fd) {
        int one = 1;
        unsigned timeout_ms = (unsigned)MIN(pm->heartbeat_usec / USEC_PER_MSEC, (usec_t)UINT32_MAX);

        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        /* Unacknowledged data for longer than the heartbeat bound aborts the connection,
         * so a dead link is noticed on data streams too. */
        (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout_ms, sizeof timeout_ms);
}

void peer_set_stream_timeout(PeerManager *pm, int fd) {
        /* A data stream the receiver parks (not read, up to TCP_PARK_TIMEOUT_USEC) keeps
         * the sender's window closed: past TCP_USER_TIMEOUT the kernel aborts the
         * connection although the receiver answers every probe (Linux 5.11 on), and the
         * whole session with it. The peer's death is the control connection's verdict
         * (heartbeats); a data stream gives up only past the longest park. */
        usec_t t = pm->heartbeat_usec + TCP_PARK_TIMEOUT_USEC;
        unsigned timeout_ms = (unsigned)MIN(t / USEC_PER_MSEC, (usec_t)UINT32_MAX);
        (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout_ms, sizeof timeout_ms);
}

/* ---- the control connection, once up ---- */

static int control_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len) {
        Peer *p = c->peer;
        PeerManager *pm = c->pm;

        p->stats.frames_in++;
        p->stats.bytes_in += PEER_FRAME_HEADER_SIZE + len;

        switch (type) {
        case PEER_MSG_HEARTBEAT: {
                PeerHeartbeat hb;
                return peer_heartbeat_decode(payload, len, &hb) < 0 ? -EBADMSG : 0;
        }
        case PEER_MSG_BYE: {
                PeerReason pr = {};
                (void)peer_reason_decode(payload, len, &pr);
                if (pr.reason == PEER_FAIL_SUPERSEDED && p->dialer)
                        peer_superseded(p); /* another host with our HostId */
                else
                        peer_down(p, -ECONNRESET, "peer said goodbye");
                return 1;
        }
        case PEER_MSG_WRITE_ACK: {
                PeerWriteAck a;
                if (peer_write_ack_decode(payload, len, &a) < 0)
                        return -EBADMSG;
                tcp_transport_write_acked(pm->tcp, p, a.write_id, a.error);
                return p->control == c ? 0 : 1;
        }
        case PEER_MSG_WRITE_ACKS: {
                size_t n, max = len >= 8 ? (len - 8) / 16 : 0;
                _cleanup_(freep) PeerAckRun *runs = calloc(MAX(max, (size_t)1), sizeof *runs);
                if (!runs)
                        return -ENOMEM;
                if (peer_write_acks_decode(payload, len, runs, max, &n) < 0)
                        return -EBADMSG;
                tcp_transport_writes_acked(pm->tcp, p, runs, n);
                return p->control == c ? 0 : 1;
        }
        }
        if (type <= PEER_MSG_CORE_LAST)
                return -EBADMSG;
        for (size_t i = 0; i < pm->n_handlers; i++) {
                HandlerRange *h = pm->handlers + i;
                if (type >= h->first && type <= h->last) {
                        uint64_t sid = p->session_id;
                        int r = h->fn(p, type, payload, len, h->userdata);
                        if (r < 0)
                                log_debug_errno(r, "peer %s: handler for %s message 0x%04x failed: %m",
                                                p->name, peer_msg_type_to_string(type), type);
                        /* The handler may have ended the session. */
                        return p->control == c && p->session_id == sid ? 0 : 1;
                }
        }
        log_debug("peer %s: no handler for message type 0x%04x, ignored", p->name, type);
        return 0;
}

static int conn_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len) {
        if (c->state == CONN_UP)
                return control_frame(c, type, payload, len);
        if (c->dialer)
                return peer_dialer_frame(c, type, payload, len);
        return peer_acceptor_frame(c, type, payload, len);
}

/* Ends a connection after an error: a control connection takes its peer's session
 * with it; a handshake connection just goes. */
void peer_conn_fail(Conn *c, int error, const char *what) {
        Peer *p = c->peer;

        if (error == -EBADMSG || error == -EMSGSIZE || error == -EPROTONOSUPPORT) {
                if (p)
                        p->stats.protocol_errors++;
                if (!c->dialer && c->state != CONN_UP) {
                        /* Anyone's, before authentication: counted, logged with a bound
                         * (another version was noted as such already). */
                        char from[64];
                        if (error != -EPROTONOSUPPORT)
                                peer_note(c->pm, PEER_NOTE_PROTOCOL,
                                          "peer: protocol error (%s: %s) on an unauthenticated connection from %s%s%s",
                                          what, strerror(-error), peer_conn_from(c, from),
                                          p ? " naming host " : "", p ? p->host_id : "");
                } else
                        log_warning_errno(error, "peer %s: protocol error (%s): %m", p ? p->name : "(unknown)",
                                          what);
        }
        if (p && p->control == c)
                peer_down(p, error, what);
        else if (p && c->dialer && c->role == PEER_ROLE_DATA)
                peer_stream_failed(p, error, what);
        else
                peer_conn_free(c);
}

#define CONTROL_READ_SIZE (64U * 1024U)

/* An authenticated control connection: recv() in bulk, then dispatch every complete
 * frame in the buffer. (Handshakes read exactly one frame at a time instead, so that
 * no byte of what follows is taken from a data stream before the transport owns it.)
 * A recv() that returns less than it asked for has emptied the socket: what it brought
 * is dispatched and reading stops there, rather than with one more recv() that only
 * says EAGAIN. The fd is level-triggered (no EPOLLET), so bytes that arrive meanwhile
 * wake the loop again. */
static int conn_read_buffered(Conn *c) {
        size_t budget = 64;
        bool drained = false;

        for (;;) {
                ssize_t n;

                /* Dispatch what is complete. */
                for (;;) {
                        PeerFrameHeader fh;
                        size_t have = c->in_end - c->in_start;
                        int r;

                        if (have < PEER_FRAME_HEADER_SIZE)
                                break;
                        r = peer_frame_header_decode(c->in + c->in_start, have, &fh);
                        if (r < 0)
                                return r;
                        if (fh.type == PEER_MSG_DATA)
                                return -EBADMSG; /* bulk belongs on data streams */
                        if (have < PEER_FRAME_HEADER_SIZE + (size_t)fh.length) {
                                size_t need = PEER_FRAME_HEADER_SIZE + (size_t)fh.length;
                                if (need > c->in_cap) {
                                        uint8_t *b = realloc(c->in, need);
                                        if (!b)
                                                return -ENOMEM;
                                        c->in = b;
                                        c->in_cap = need;
                                }
                                break;
                        }
                        c->in_start += PEER_FRAME_HEADER_SIZE + fh.length;
                        c->peer->stats.last_rx_usec = now_usec(CLOCK_MONOTONIC);
                        r = conn_frame(c, fh.type, c->in + c->in_start - fh.length, fh.length);
                        if (r != 0)
                                return r; /* 1: the connection is gone */
                }
                if (c->in_start > 0) {
                        memmove(c->in, c->in + c->in_start, c->in_end - c->in_start);
                        c->in_end -= c->in_start;
                        c->in_start = 0;
                }
                /* Everything read so far is dispatched: stop when the socket is empty,
                 * or after `budget` reads (the rest wakes the loop again: level-triggered). */
                if (drained || budget-- == 0)
                        return 0;
                if (!c->in) {
                        c->in = malloc(CONTROL_READ_SIZE);
                        if (!c->in)
                                return -ENOMEM;
                        c->in_cap = CONTROL_READ_SIZE;
                }
                size_t want = c->in_cap - c->in_end;
                n = recv(c->fd, c->in + c->in_end, want, MSG_DONTWAIT);
                if (n < 0)
                        return errno == EAGAIN || errno == EINTR ? 0 : -errno;
                if (n == 0)
                        return -ECONNRESET;
                c->in_end += (size_t)n;
                drained = (size_t)n < want;
        }
}

int peer_conn_read(Conn *c) {
        size_t budget = 256;

        if (c->state == CONN_UP && !c->have_fh && c->hdr_have == 0)
                return conn_read_buffered(c);

        while (budget-- > 0) {
                ssize_t n;

                if (!c->have_fh) {
                        n = recv(c->fd, c->hdr + c->hdr_have, sizeof c->hdr - c->hdr_have, MSG_DONTWAIT);
                        if (n < 0)
                                return errno == EAGAIN || errno == EINTR ? 0 : -errno;
                        if (n == 0)
                                return -ECONNRESET;
                        c->hdr_have += (size_t)n;
                        if (c->hdr_have < sizeof c->hdr)
                                continue;
                        n = peer_frame_header_decode(c->hdr, sizeof c->hdr, &c->fh);
                        if (n == -EPROTONOSUPPORT && c->state != CONN_UP && !c->dialer) {
                                /* Another version's first frame: told why (in a frame of
                                 * ours), and said here with both versions (with a bound:
                                 * anyone can send this). */
                                char from[64];
                                peer_note(c->pm, PEER_NOTE_VERSION,
                                          "peer: a connection from %s speaks protocol version %u, this epdd "
                                          "version %u: refused (AUTH_FAIL version)",
                                          peer_conn_from(c, from), c->hdr[4], PEER_PROTOCOL_VERSION);
                                peer_conn_send_fail(c, PEER_FAIL_VERSION);
                        }
                        if (n < 0)
                                return (int)n;
                        if (c->fh.type == PEER_MSG_DATA)
                                return -EBADMSG; /* bulk belongs on data streams */
                        if (c->state != CONN_UP && c->fh.length > HANDSHAKE_MAX_PAYLOAD)
                                return -EMSGSIZE;
                        c->have_fh = true;
                        c->payload_have = 0;
                        if (c->fh.length > c->payload_cap) {
                                uint8_t *b = realloc(c->payload, c->fh.length);
                                if (!b)
                                        return -ENOMEM;
                                c->payload = b;
                                c->payload_cap = c->fh.length;
                        }
                }
                if (c->payload_have < c->fh.length) {
                        n = recv(c->fd, c->payload + c->payload_have, c->fh.length - c->payload_have, MSG_DONTWAIT);
                        if (n < 0)
                                return errno == EAGAIN || errno == EINTR ? 0 : -errno;
                        if (n == 0)
                                return -ECONNRESET;
                        c->payload_have += (size_t)n;
                        if (c->payload_have < c->fh.length)
                                continue;
                }
                c->have_fh = false;
                c->hdr_have = 0;
                if (c->peer && c->state == CONN_UP)
                        c->peer->stats.last_rx_usec = now_usec(CLOCK_MONOTONIC);
                n = conn_frame(c, c->fh.type, c->payload, c->fh.length);
                if (n != 0)
                        return (int)n;
        }
        return 0;
}

static int conn_io(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Conn *c = userdata;
        int r;

        if (c->state == CONN_CONNECTING) {
                r = peer_dialer_connected(c);
                if (r < 0)
                        peer_conn_fail(c, r, "connect");
                return 0;
        }
        if (revents & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                r = peer_conn_read(c);
                if (r == 1)
                        return 0;
                if (r < 0) {
                        peer_conn_fail(c, r, r == -ECONNRESET ? "connection closed" :
                                        r == -EACCES ? "authentication failed" : "reading");
                        return 0;
                }
        }
        r = peer_conn_flush(c);
        if (r < 0)
                peer_conn_fail(c, r, "writing");
        return 0;
}

static bool same_address(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
        if (a->ss_family != b->ss_family)
                return false;
        if (a->ss_family == AF_INET)
                return ((const struct sockaddr_in *)a)->sin_addr.s_addr ==
                       ((const struct sockaddr_in *)b)->sin_addr.s_addr;
        if (a->ss_family == AF_INET6)
                return memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr,
                              sizeof(struct in6_addr)) == 0;
        return false;
}

/* Room for one more connection from others: past PEER_PENDING_PER_ADDRESS from its
 * address not authenticated yet (silent, or between HELLO and AUTH: a HELLO naming a
 * known host costs nothing to send), that address's oldest is closed; past
 * PEER_PENDING_MAX in all, the oldest that has not said HELLO (or, with none, the
 * oldest of all). A real handshake takes a few round trips, so a flood of
 * connections that say nothing pushes out its own (or, spread over many addresses, only
 * ones older than any handshake) instead of closing the door on every peer until they
 * time out; the per-address bound leaves room for two peers behind one address dialing
 * every data stream at once. Counted, and said with a bound (peer_note()). */
static void pending_make_room(PeerManager *pm, const struct sockaddr_storage *from) {
        Conn *oldest = NULL, *oldest_silent = NULL, *oldest_here = NULL;
        unsigned here = 0;
        char addr[64];

        LIST_FOREACH(pending, c, pm->pending) { /* newest first */
                if (c->dialer)
                        continue;
                oldest = c;
                if (same_address(&c->from, from)) {
                        oldest_here = c;
                        here++;
                }
                if (c->state == CONN_WAIT_HELLO)
                        oldest_silent = c;
        }
        Conn *victim = here >= PEER_PENDING_PER_ADDRESS ? oldest_here
                       : pm->n_pending >= PEER_PENDING_MAX ? (oldest_silent ?: oldest)
                                                           : NULL;
        if (!victim)
                return;
        peer_note(pm, PEER_NOTE_EVICTED,
                  "peer: unauthenticated connection from %s closed for a newer one (at most %u from one address, "
                  "%u in all)",
                  peer_conn_from(victim, addr), PEER_PENDING_PER_ADDRESS, PEER_PENDING_MAX);
        peer_conn_free(victim);
}

static int on_listen_retry(sd_event_source *s, uint64_t usec, void *userdata) {
        PeerManager *pm = userdata;

        (void)sd_event_source_set_enabled(pm->listen_source, SD_EVENT_ON);
        return 0;
}

/* The retry timer, off, made before it is needed: when accept() runs out of fds, adding
 * the loop's first timer of this clock needs an fd too. */
static int listen_retry_new(PeerManager *pm) {
        int r;

        if (pm->listen_retry)
                return 0;
        r = sd_event_add_time_relative(pm->event, &pm->listen_retry, CLOCK_MONOTONIC, PEER_ACCEPT_RETRY_USEC,
                                       PEER_ACCEPT_RETRY_USEC / 10,
                                       on_listen_retry, pm);
        if (r < 0)
                return r;
        return sd_event_source_set_enabled(pm->listen_retry, SD_EVENT_OFF);
}

/* accept() failed for want of fds or memory: the connection stays in the backlog, and the
 * level-triggered listen source would be dispatched again at once, for ever. It is
 * switched off for PEER_ACCEPT_RETRY_USEC instead (without a timer it stays on: each
 * turn then costs an accept() and a count, no log line). */
static void listen_pause(PeerManager *pm) {
        int r = listen_retry_new(pm);

        if (r >= 0)
                r = sd_event_source_set_time_relative(pm->listen_retry, PEER_ACCEPT_RETRY_USEC);
        if (r >= 0)
                r = sd_event_source_set_enabled(pm->listen_retry, SD_EVENT_ONESHOT);
        if (r < 0)
                return;
        if (sd_event_source_set_enabled(pm->listen_source, SD_EVENT_OFF) >= 0)
                pm->accept_paused++;
}

/* Errors of accept() that concern the connection it was taking (gone already, or a
 * network error passed on, see accept(2)): the next one may be fine. */
static bool accept_error_is_its_own(int e) {
        switch (e) {
        case EINTR:
        case ECONNABORTED:
        case EPROTO:
        case ENETDOWN:
        case ENOPROTOOPT:
        case EHOSTDOWN:
        case ENONET:
        case EHOSTUNREACH:
        case ENETUNREACH:
        case ETIMEDOUT:
                return true;
        default:
                return false;
        }
}

int peer_listen_io(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        PeerManager *pm = userdata;

        (void)listen_retry_new(pm);
        for (unsigned i = 0; i < PEER_ACCEPT_BATCH; i++) {
                _cleanup_(closep) int cfd = -EBADF;
                struct sockaddr_storage from = {};
                socklen_t len = sizeof from;
                char addr[64];
                Conn *c;
                int r;

                cfd = accept4(fd, (struct sockaddr *)&from, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
                if (cfd < 0) {
                        int e = errno;
                        if (e == EAGAIN)
                                return 0;
                        if (accept_error_is_its_own(e)) {
                                if (e != EINTR && e != ECONNABORTED)
                                        peer_note(pm, PEER_NOTE_ACCEPT, "peer: accept failed: %s", strerror(e));
                                continue;
                        }
                        /* EMFILE, ENFILE, ENOBUFS, ENOMEM, or anything unexpected. */
                        peer_note(pm, PEER_NOTE_ACCEPT, "peer: accept failed: %s; not accepting for %u ms, then again",
                                  strerror(e), (unsigned)(PEER_ACCEPT_RETRY_USEC / USEC_PER_MSEC));
                        listen_pause(pm);
                        return 0;
                }
                pending_make_room(pm, &from);
                peer_set_socket_options(pm, cfd);
                r = peer_conn_new(pm, cfd, false, &c);
                if (r < 0) {
                        peer_note(pm, PEER_NOTE_ACCEPT, "peer: cannot set up the connection accepted from %s: %s",
                                  sockaddr_to_string(&from, addr), strerror(-r));
                        continue;
                }
                TAKE_FD(cfd);
                c->from = from;
                c->state = CONN_WAIT_HELLO;
                peer_conn_pend(c);
        }
        return 0; /* more wake the loop again */
}
