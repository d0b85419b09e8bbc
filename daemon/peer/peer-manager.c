/* SPDX-License-Identifier: LGPL-2.1-or-later */
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
#include "list.h"
#include "log.h"
#include "macro.h"
#include "peer/bus-peer.h"
#include "peer/peer-auth.h"
#include "peer/peer-manager.h"
#include "telemetry/telemetry.h"
#include "transport/rdma.h"
#include "transport/tcp.h"

/* Largest payload accepted before a connection is authenticated. */
#define HANDSHAKE_MAX_PAYLOAD 512

typedef enum ConnState {
        CONN_CONNECTING,     /* dialer: connect() in progress */
        CONN_WAIT_HELLO,     /* acceptor */
        CONN_WAIT_CHALLENGE, /* dialer */
        CONN_WAIT_AUTH,      /* acceptor */
        CONN_WAIT_AUTH_OK,   /* dialer */
        CONN_UP,             /* control connection, authenticated */
} ConnState;

typedef struct Conn Conn;
struct Conn {
        PeerManager *pm;
        Peer *peer;              /* dialer: from the start; acceptor: after HELLO */
        int fd;
        sd_event_source *io;
        sd_event_source *timeout;
        bool dialer;
        ConnState state;
        PeerRole role;
        unsigned stream_index;
        uint64_t session_id;
        unsigned n_streams;

        uint8_t nonce_dialer[PEER_NONCE_SIZE];
        uint8_t nonce_acceptor[PEER_NONCE_SIZE];

        /* Input: one frame at a time, header then exactly its payload. */
        uint8_t hdr[PEER_FRAME_HEADER_SIZE];
        size_t hdr_have;
        PeerFrameHeader fh;
        bool have_fh;
        uint8_t *payload;
        size_t payload_have, payload_cap;

        /* Input once up: buffered, several frames per recv(). */
        uint8_t *in;
        size_t in_start, in_end, in_cap;

        /* Output queue. */
        uint8_t *out;
        size_t out_start, out_end, out_cap;
        bool corked;             /* queue without writing; peer_uncork() flushes */

        bool pending; /* on pm->pending */
        LIST_FIELDS(Conn, pending);
};

typedef struct HandlerRange {
        uint16_t first, last;
        PeerMessageHandler fn;
        void *userdata;
} HandlerRange;

typedef struct StateHandler {
        PeerStateHandler fn;
        void *userdata;
} StateHandler;

struct Peer {
        PeerManager *pm;
        char *name;
        char *host_id;
        char *address;
        struct sockaddr_storage sa;
        unsigned sa_len;
        bool dialer;             /* we dial this peer (our host id sorts first) */
        PeerState state;
        Conn *control;
        uint64_t session_id;
        unsigned n_streams;      /* negotiated for this session */
        sd_event_source *reconnect_timer;
        sd_event_source *heartbeat_timer;
        usec_t backoff_usec;
        uint64_t heartbeat_seq;
        PeerStats stats;
        char last_error[160];
        void *transport_state[_TRANSPORT_KIND_MAX]; /* each transport's state of this peer */
};

struct PeerManager {
        sd_event *event;
        char *host_id;
        char *listen_address;
        PeerAuthKey *key;
        usec_t heartbeat_usec;
        unsigned n_streams;
        uint32_t slice_size;

        Peer **peers;
        size_t n_peers;
        Hashmap *by_host_id;

        int listen_fd;
        sd_event_source *listen_source;
        LIST_HEAD(Conn, pending);
        size_t n_pending;

        HandlerRange *handlers;
        size_t n_handlers;
        StateHandler *state_handlers;
        size_t n_state_handlers;
        PeerIncomingValidator validator;
        void *validator_userdata;
        PeerIncomingDone done;
        void *done_userdata;

        Transport *tcp;
        Transport *rdma;        /* NULL without libibverbs */
        bool started;

        /* Called with each authenticated data stream's fd as it is attached (telemetry). */
        void (*stream_attached)(Peer *p, int fd, void *userdata);
        void *stream_attached_userdata;
};

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

static void peer_down(Peer *p, int error, const char *why);
static int conn_io(sd_event_source *s, int fd, uint32_t revents, void *userdata);
static int peer_dial(Peer *p, PeerRole role, unsigned stream_index);
static int conn_read(Conn *c);
static int conn_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len);
static void conn_fail(Conn *c, int error, const char *what);

/* ---- connections ---- */

static Conn *conn_free(Conn *c) {
        if (!c)
                return NULL;
        if (c->pending) {
                LIST_REMOVE(pending, c->pm->pending, c);
                c->pm->n_pending--;
        }
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
                conn_free(c);
        }
        return 0;
}

static int conn_new(PeerManager *pm, int fd, bool dialer, Conn **ret) {
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
        r = sd_event_add_time_relative(pm->event, &c->timeout, CLOCK_MONOTONIC, to, 0,
                                       conn_handshake_timeout, c);
        if (r < 0)
                goto fail;
        *ret = c;
        return 0;
fail:
        c->fd = -EBADF; /* the caller still owns fd */
        conn_free(c);
        return r;
}

static int conn_update_events(Conn *c) {
        uint32_t ev = EPOLLIN;

        if (c->state == CONN_CONNECTING)
                ev = EPOLLOUT;
        else if (c->out_end > c->out_start)
                ev |= EPOLLOUT;
        return sd_event_source_set_io_events(c->io, ev);
}

/* Writes as much of the output queue as the socket takes. */
static int conn_flush(Conn *c) {
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
        return conn_update_events(c);
}

static int conn_queue(Conn *c, uint16_t type, const void *payload, size_t len) {
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
        return conn_flush(c);
}

static void conn_send_fail(Conn *c, PeerFailReason reason) {
        uint8_t buf[4];
        PeerReason pr = { .reason = reason };

        if (peer_reason_encode(&pr, buf, sizeof buf) > 0)
                (void)conn_queue(c, PEER_MSG_AUTH_FAIL, buf, sizeof buf);
}

static void set_socket_options(PeerManager *pm, int fd) {
        int one = 1;
        unsigned timeout_ms = (unsigned)MIN(pm->heartbeat_usec / USEC_PER_MSEC, (usec_t)UINT32_MAX);

        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        /* Unacknowledged data for longer than the heartbeat bound aborts the connection,
         * so a dead link is noticed on data streams too. */
        (void)setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &timeout_ms, sizeof timeout_ms);
}

/* ---- peers ---- */

static void peer_set_error(Peer *p, const char *why, int error) {
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

        if (p->state != PEER_DOWN)
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

        if (!p->dialer || !pm->started)
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

/* Ends the session (or the attempt) with p: everything in flight fails with `error`,
 * handlers hear "down", and the dialer reconnects after its backoff. */
static void peer_down(Peer *p, int error, const char *why) {
        bool was_up = p->state == PEER_UP;

        if (p->state == PEER_DOWN && !p->control)
                return;
        if (was_up) {
                log_warning("peer %s (%s): down: %s%s%s", p->name, p->host_id, why,
                            error ? ": " : "", error ? strerror(-error) : "");
                p->stats.disconnects++;
        } else
                log_debug("peer %s: connection attempt failed: %s", p->name, why);
        peer_set_error(p, why, error);
        p->control = conn_free(p->control);
        /* Handshakes of this peer's data streams (either direction) end with it. */
        LIST_FOREACH_SAFE(pending, c, n, p->pm->pending)
                if (c->peer == p)
                        conn_free(c);
        sd_event_source_set_enabled(p->heartbeat_timer, SD_EVENT_OFF);
        p->state = PEER_DOWN;
        p->session_id = 0;
        if (p->pm->tcp)
                tcp_transport_peer_reset(p->pm->tcp, p, error ? error : -ECONNRESET);
        if (was_up)
                notify_state(p, false);
        peer_schedule_reconnect(p);
}

void peer_stream_failed(Peer *p, int error, const char *what) {
        peer_down(p, error, what);
}

static int heartbeat_cb(sd_event_source *s, uint64_t usec, void *userdata) {
        Peer *p = userdata;
        PeerManager *pm = p->pm;
        usec_t now = now_usec(CLOCK_MONOTONIC);
        uint8_t buf[16];
        PeerHeartbeat hb;
        int r;

        if (p->state != PEER_UP)
                return 0;
        if (now > p->stats.last_rx_usec + pm->heartbeat_usec) {
                /* Our own loop may have been the slow one: read what already arrived
                 * before calling the peer dead. */
                r = conn_read(p->control);
                if (r == 1)
                        return 0;
                if (r < 0) {
                        conn_fail(p->control, r, r == -ECONNRESET ? "connection closed" : "reading");
                        return 0;
                }
        }
        if (now > p->stats.last_rx_usec + pm->heartbeat_usec) {
                p->stats.heartbeats_missed++;
                peer_down(p, -ETIMEDOUT, "heartbeat timeout");
                return 0;
        }
        hb = (PeerHeartbeat){ .seq = ++p->heartbeat_seq, .time_usec = now };
        (void)peer_heartbeat_encode(&hb, buf, sizeof buf);
        r = conn_queue(p->control, PEER_MSG_HEARTBEAT, buf, sizeof buf);
        if (r < 0) {
                peer_down(p, r, "sending heartbeat");
                return 0;
        }
        (void)sd_event_source_set_time_relative(s, pm->heartbeat_usec / 4);
        (void)sd_event_source_set_enabled(s, SD_EVENT_ON);
        return 0;
}

static int peer_up(Peer *p, Conn *c, uint64_t session_id, unsigned n_streams) {
        PeerManager *pm = p->pm;
        int r;

        if (c->pending) {
                LIST_REMOVE(pending, pm->pending, c);
                pm->n_pending--;
                c->pending = false;
        }
        c->timeout = sd_event_source_disable_unref(c->timeout);
        c->state = CONN_UP;
        p->control = c;
        p->session_id = session_id;
        p->n_streams = n_streams;
        p->state = PEER_UP;
        p->backoff_usec = 0;
        p->stats.connects++;
        p->stats.last_rx_usec = p->stats.up_since_usec = now_usec(CLOCK_MONOTONIC);
        p->last_error[0] = 0;

        if (!p->heartbeat_timer)
                r = sd_event_add_time_relative(pm->event, &p->heartbeat_timer, CLOCK_MONOTONIC,
                                               pm->heartbeat_usec / 4, 0, heartbeat_cb, p);
        else {
                r = sd_event_source_set_time_relative(p->heartbeat_timer, pm->heartbeat_usec / 4);
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

/* ---- dialing ---- */

static int peer_dial(Peer *p, PeerRole role, unsigned stream_index) {
        PeerManager *pm = p->pm;
        _cleanup_(closep) int fd = -EBADF;
        Conn *c;
        int r;

        fd = socket(p->sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, IPPROTO_TCP);
        if (fd < 0)
                return -errno;
        set_socket_options(pm, fd);
        if (connect(fd, (struct sockaddr *)&p->sa, p->sa_len) < 0 && errno != EINPROGRESS)
                return -errno;
        r = conn_new(pm, fd, true, &c);
        if (r < 0)
                return r;
        TAKE_FD(fd);
        c->peer = p;
        c->role = role;
        c->stream_index = stream_index;
        c->state = CONN_CONNECTING;
        r = conn_update_events(c);
        if (r < 0) {
                conn_free(c);
                return r;
        }
        if (role == PEER_ROLE_CONTROL) {
                p->control = c;
                p->state = PEER_CONNECTING;
        } else {
                /* Tracked until authenticated, so that a session reset ends it. */
                c->session_id = p->session_id;
                c->pending = true;
                LIST_PREPEND(pending, pm->pending, c);
                pm->n_pending++;
        }
        return 0;
}

static int dialer_connected(Conn *c) {
        PeerManager *pm = c->pm;
        Peer *p = c->peer;
        uint8_t buf[HANDSHAKE_MAX_PAYLOAD];
        PeerHello h = {
                .role = c->role,
                .min_version = PEER_PROTOCOL_VERSION,
                .max_version = PEER_PROTOCOL_VERSION,
                .stream_index = (uint16_t)c->stream_index,
                .n_streams = c->role == PEER_ROLE_CONTROL ? (uint16_t)pm->n_streams : 0,
                .session_id = c->role == PEER_ROLE_DATA ? c->session_id : 0,
        };
        int err = 0, r;
        socklen_t sl = sizeof err;

        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &sl) < 0)
                return -errno;
        if (err != 0)
                return -err;
        if (c->role == PEER_ROLE_CONTROL)
                p->state = PEER_AUTHENTICATING;
        r = peer_auth_random(c->nonce_dialer, PEER_NONCE_SIZE);
        if (r < 0)
                return r;
        memcpy(h.nonce, c->nonce_dialer, PEER_NONCE_SIZE);
        snprintf(h.host_id, sizeof h.host_id, "%s", pm->host_id);
        r = peer_hello_encode(&h, buf, sizeof buf);
        if (r < 0)
                return r;
        c->state = CONN_WAIT_CHALLENGE;
        return conn_queue(c, PEER_MSG_HELLO, buf, (size_t)r);
}

static void transcript_init(Conn *c, const char *dialer_id, const char *acceptor_id,
                            PeerAuthTranscript *t) {
        *t = (PeerAuthTranscript){
                .dialer_id = dialer_id,
                .acceptor_id = acceptor_id,
                .role = (uint8_t)c->role,
                .session_id = c->role == PEER_ROLE_DATA ? c->session_id : 0,
                .stream_index = (uint16_t)c->stream_index,
        };
        memcpy(t->nonce_dialer, c->nonce_dialer, PEER_NONCE_SIZE);
        memcpy(t->nonce_acceptor, c->nonce_acceptor, PEER_NONCE_SIZE);
}

/* Hands an authenticated data stream to the transport. The Conn is freed, its fd kept. */
static int conn_to_stream(Conn *c) {
        Peer *p = c->peer;
        int fd = TAKE_FD(c->fd);
        unsigned idx = c->stream_index;
        int r;

        conn_free(c);
        if (p->pm->stream_attached)
                p->pm->stream_attached(p, fd, p->pm->stream_attached_userdata);
        r = tcp_transport_attach_stream(p->pm->tcp, p, fd, idx);
        if (r < 0) {
                peer_stream_failed(p, r, "attaching data stream");
                return r;
        }
        log_debug("peer %s: data stream %u up", p->name, idx);
        return 0;
}

/* Return values of frame handlers: <0 error (caller ends the connection), 0 continue,
 * 1 the connection is gone (freed or handed over): do not touch it. */

static int dialer_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len) {
        PeerManager *pm = c->pm;
        Peer *p = c->peer;
        int r;

        if (type == PEER_MSG_AUTH_FAIL) {
                PeerReason pr = {};
                (void)peer_reason_decode(payload, len, &pr);
                p->stats.auth_failures++;
                log_error("peer %s: refused us: %s", p->name, peer_fail_reason_to_string(pr.reason));
                return -EACCES;
        }
        if (c->state == CONN_WAIT_CHALLENGE && type == PEER_MSG_CHALLENGE) {
                PeerChallenge ch;
                PeerAuthTranscript t;
                PeerAuth a;
                uint8_t buf[PEER_MAC_SIZE];

                if (peer_challenge_decode(payload, len, &ch) < 0)
                        return -EBADMSG;
                if (strcmp(ch.host_id, p->host_id) != 0) {
                        log_error("peer %s: answered as host '%s', expected '%s'", p->name,
                                  ch.host_id, p->host_id);
                        p->stats.auth_failures++;
                        conn_send_fail(c, PEER_FAIL_UNKNOWN_HOST);
                        return -EACCES;
                }
                memcpy(c->nonce_acceptor, ch.nonce, PEER_NONCE_SIZE);
                transcript_init(c, pm->host_id, p->host_id, &t);
                if (!peer_auth_verify(pm->key, PEER_AUTH_ACCEPTOR, &t, ch.mac)) {
                        log_error("peer %s: cluster key mismatch (acceptor's proof is wrong)", p->name);
                        p->stats.auth_failures++;
                        conn_send_fail(c, PEER_FAIL_BAD_MAC);
                        return -EACCES;
                }
                r = peer_auth_mac(pm->key, PEER_AUTH_DIALER, &t, a.mac);
                if (r < 0)
                        return r;
                (void)peer_auth_msg_encode(&a, buf, sizeof buf);
                c->state = CONN_WAIT_AUTH_OK;
                return conn_queue(c, PEER_MSG_AUTH, buf, sizeof buf);
        }
        if (c->state == CONN_WAIT_AUTH_OK && type == PEER_MSG_AUTH_OK) {
                PeerAuthOk ok;

                if (peer_auth_ok_decode(payload, len, &ok) < 0)
                        return -EBADMSG;
                if (c->role == PEER_ROLE_CONTROL) {
                        r = peer_up(p, c, ok.session_id, MIN((unsigned)ok.n_streams, pm->n_streams));
                        if (r < 0) {
                                peer_down(p, r, "bringing session up");
                                return 1;
                        }
                        /* A state handler may have ended the session already. */
                        return p->control == c ? 0 : 1;
                }
                if (ok.session_id != p->session_id || p->state != PEER_UP)
                        return -ESTALE;
                conn_to_stream(c);
                return 1;
        }
        return -EBADMSG;
}

/* ---- accepting ---- */

static int acceptor_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len) {
        PeerManager *pm = c->pm;
        int r;

        if (type == PEER_MSG_AUTH_FAIL && c->peer) {
                PeerReason pr = {};
                (void)peer_reason_decode(payload, len, &pr);
                c->peer->stats.auth_failures++;
                log_error("peer %s: refused our proof: %s", c->peer->name, peer_fail_reason_to_string(pr.reason));
                return -EACCES;
        }
        if (c->state == CONN_WAIT_HELLO && type == PEER_MSG_HELLO) {
                PeerHello h;
                PeerChallenge ch = {};
                PeerAuthTranscript t;
                uint8_t buf[HANDSHAKE_MAX_PAYLOAD];
                Peer *p;

                if (peer_hello_decode(payload, len, &h) < 0)
                        return -EBADMSG;
                if (h.min_version > PEER_PROTOCOL_VERSION || h.max_version < PEER_PROTOCOL_VERSION) {
                        conn_send_fail(c, PEER_FAIL_VERSION);
                        return -EPROTONOSUPPORT;
                }
                p = hashmap_get(pm->by_host_id, h.host_id);
                if (!p || p->dialer) {
                        log_warning("peer: refused connection from unknown host '%s'", h.host_id);
                        conn_send_fail(c, PEER_FAIL_UNKNOWN_HOST);
                        return -EACCES;
                }
                c->peer = p;
                c->role = h.role;
                c->stream_index = h.stream_index;
                c->session_id = h.session_id;
                c->n_streams = MIN((unsigned)h.n_streams, pm->n_streams);
                if (h.role == PEER_ROLE_DATA &&
                    (p->state != PEER_UP || h.session_id != p->session_id || h.stream_index >= p->n_streams)) {
                        conn_send_fail(c, PEER_FAIL_SESSION);
                        return -ESTALE;
                }
                memcpy(c->nonce_dialer, h.nonce, PEER_NONCE_SIZE);
                r = peer_auth_random(c->nonce_acceptor, PEER_NONCE_SIZE);
                if (r < 0)
                        return r;
                memcpy(ch.nonce, c->nonce_acceptor, PEER_NONCE_SIZE);
                snprintf(ch.host_id, sizeof ch.host_id, "%s", pm->host_id);
                transcript_init(c, p->host_id, pm->host_id, &t);
                r = peer_auth_mac(pm->key, PEER_AUTH_ACCEPTOR, &t, ch.mac);
                if (r < 0)
                        return r;
                r = peer_challenge_encode(&ch, buf, sizeof buf);
                if (r < 0)
                        return r;
                c->state = CONN_WAIT_AUTH;
                return conn_queue(c, PEER_MSG_CHALLENGE, buf, (size_t)r);
        }
        if (c->state == CONN_WAIT_AUTH && type == PEER_MSG_AUTH) {
                Peer *p = c->peer;
                PeerAuth a;
                PeerAuthTranscript t;
                PeerAuthOk ok = {
                        .heartbeat_ms = (uint32_t)MAX(pm->heartbeat_usec / USEC_PER_MSEC, (usec_t)1),
                };
                uint8_t buf[32];

                if (peer_auth_msg_decode(payload, len, &a) < 0)
                        return -EBADMSG;
                transcript_init(c, p->host_id, pm->host_id, &t);
                if (!peer_auth_verify(pm->key, PEER_AUTH_DIALER, &t, a.mac)) {
                        log_error("peer %s: refused: cluster key mismatch (dialer's proof is wrong)", p->name);
                        p->stats.auth_failures++;
                        conn_send_fail(c, PEER_FAIL_BAD_MAC);
                        return -EACCES;
                }
                if (c->role == PEER_ROLE_CONTROL) {
                        uint64_t sid = 0;
                        /* Off the pending list first: ending the old session ends the
                         * handshakes of its peer, and this one must survive that. */
                        if (c->pending) {
                                LIST_REMOVE(pending, pm->pending, c);
                                pm->n_pending--;
                                c->pending = false;
                        }
                        if (p->state == PEER_UP || p->control)
                                peer_down(p, -ECONNRESET, "superseded by a new connection");
                        do {
                                r = peer_auth_random(&sid, sizeof sid);
                                if (r < 0)
                                        return r;
                        } while (sid == 0);
                        ok.session_id = sid;
                        ok.n_streams = (uint16_t)c->n_streams;
                        r = peer_auth_ok_encode(&ok, buf, sizeof buf);
                        if (r < 0)
                                return r;
                        c->state = CONN_UP; /* counts the frame below */
                        r = conn_queue(c, PEER_MSG_AUTH_OK, buf, (size_t)r);
                        if (r < 0)
                                return r;
                        r = peer_up(p, c, sid, c->n_streams);
                        if (r < 0) {
                                peer_down(p, r, "bringing session up");
                                return 1;
                        }
                        return p->control == c ? 0 : 1;
                }
                /* Data stream: the AUTH_OK must be on the wire before the transport owns
                 * the fd (a fresh socket's buffer always takes these few bytes). */
                if (p->state != PEER_UP || c->session_id != p->session_id)
                        return -ESTALE;
                ok.session_id = p->session_id;
                ok.n_streams = (uint16_t)p->n_streams;
                r = peer_auth_ok_encode(&ok, buf, sizeof buf);
                if (r < 0)
                        return r;
                r = conn_queue(c, PEER_MSG_AUTH_OK, buf, (size_t)r);
                if (r < 0)
                        return r;
                if (c->out_end != c->out_start)
                        return -EAGAIN;
                conn_to_stream(c);
                return 1;
        }
        return -EBADMSG;
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
                return dialer_frame(c, type, payload, len);
        return acceptor_frame(c, type, payload, len);
}

/* Ends a connection after an error: a control connection takes its peer's session
 * with it; a handshake connection just goes. */
static void conn_fail(Conn *c, int error, const char *what) {
        Peer *p = c->peer;

        if (error == -EBADMSG || error == -EMSGSIZE || error == -EPROTONOSUPPORT) {
                if (p)
                        p->stats.protocol_errors++;
                log_warning_errno(error, "peer %s: protocol error (%s): %m", p ? p->name : "(unknown)", what);
        }
        if (p && p->control == c)
                peer_down(p, error, what);
        else if (p && c->dialer && c->role == PEER_ROLE_DATA)
                peer_stream_failed(p, error, what);
        else
                conn_free(c);
}

#define CONTROL_READ_SIZE (64U * 1024U)

/* An authenticated control connection: recv() in bulk, then dispatch every complete
 * frame in the buffer. (Handshakes read exactly one frame at a time instead, so that
 * no byte of what follows is taken from a data stream before the transport owns it.) */
static int conn_read_buffered(Conn *c) {
        size_t budget = 64;

        while (budget-- > 0) {
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
                if (!c->in) {
                        c->in = malloc(CONTROL_READ_SIZE);
                        if (!c->in)
                                return -ENOMEM;
                        c->in_cap = CONTROL_READ_SIZE;
                }
                n = recv(c->fd, c->in + c->in_end, c->in_cap - c->in_end, MSG_DONTWAIT);
                if (n < 0)
                        return errno == EAGAIN || errno == EINTR ? 0 : -errno;
                if (n == 0)
                        return -ECONNRESET;
                c->in_end += (size_t)n;
        }
        return 0;
}

static int conn_read(Conn *c) {
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
                r = dialer_connected(c);
                if (r < 0)
                        conn_fail(c, r, "connect");
                return 0;
        }
        if (revents & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                r = conn_read(c);
                if (r == 1)
                        return 0;
                if (r < 0) {
                        conn_fail(c, r, r == -ECONNRESET ? "connection closed" :
                                        r == -EACCES ? "authentication failed" : "reading");
                        return 0;
                }
        }
        r = conn_flush(c);
        if (r < 0)
                conn_fail(c, r, "writing");
        return 0;
}

static int listen_io(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        PeerManager *pm = userdata;

        for (;;) {
                _cleanup_(closep) int cfd = -EBADF;
                Conn *c;
                int r;

                cfd = accept4(fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
                if (cfd < 0) {
                        if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
                                log_warning_errno(errno, "peer: accept failed: %m");
                        return 0;
                }
                if (pm->n_pending >= PEER_PENDING_MAX) {
                        log_warning("peer: too many unauthenticated connections, refusing one");
                        continue;
                }
                set_socket_options(pm, cfd);
                r = conn_new(pm, cfd, false, &c);
                if (r < 0) {
                        log_warning_errno(r, "peer: cannot set up accepted connection: %m");
                        continue;
                }
                TAKE_FD(cfd);
                c->state = CONN_WAIT_HELLO;
                c->pending = true;
                LIST_PREPEND(pending, pm->pending, c);
                pm->n_pending++;
        }
}

/* ---- the manager ---- */

static Peer *peer_free(Peer *p) {
        if (!p)
                return NULL;
        conn_free(p->control);
        sd_event_source_disable_unref(p->reconnect_timer);
        sd_event_source_disable_unref(p->heartbeat_timer);
        free(p->name);
        free(p->host_id);
        free(p->address);
        free(p);
        return NULL;
}

PeerManager *peer_manager_free(PeerManager *pm) {
        if (!pm)
                return NULL;
        pm->started = false;
        while (pm->pending)
                conn_free(pm->pending);
        /* A polite goodbye to every peer that is up; best effort. */
        for (size_t i = 0; i < pm->n_peers; i++) {
                Peer *p = pm->peers[i];
                if (p->state == PEER_UP) {
                        PeerReason pr = { .reason = PEER_FAIL_SHUTDOWN };
                        uint8_t buf[4];
                        (void)peer_reason_encode(&pr, buf, sizeof buf);
                        (void)conn_queue(p->control, PEER_MSG_BYE, buf, sizeof buf);
                }
                p->control = conn_free(p->control);
        }
        if (pm->rdma)
                pm->rdma->ops->free(pm->rdma);
        if (pm->tcp)
                pm->tcp->ops->free(pm->tcp);
        for (size_t i = 0; i < pm->n_peers; i++)
                peer_free(pm->peers[i]);
        free(pm->peers);
        hashmap_free(pm->by_host_id);
        sd_event_source_disable_unref(pm->listen_source);
        safe_close(pm->listen_fd);
        peer_auth_key_free(pm->key);
        free(pm->handlers);
        free(pm->state_handlers);
        free(pm->host_id);
        free(pm->listen_address);
        sd_event_unref(pm->event);
        free(pm);
        return NULL;
}

DEFINE_TRIVIAL_CLEANUP_FUNC(PeerManager *, peer_manager_free);

/* What the transports (tcp, rdma) need from the peer layer: transport-peer.h. */
static void **op_slot(Peer *p, TransportKind kind) {
        return &p->transport_state[kind];
}

static int op_validate_incoming(void *userdata, Peer *p, uint32_t region, uint64_t offset, uint64_t length,
                                uint64_t cookie) {
        return peer_manager_validate_incoming(userdata, p, region, offset, length, cookie);
}

static void op_incoming_done(void *userdata, Peer *p, uint64_t cookie, int error) {
        peer_manager_incoming_done(userdata, p, cookie, error);
}

static int op_register_handler(void *userdata, uint16_t first, uint16_t last, TransportPeerMessageFn fn,
                               void *fn_userdata) {
        return peer_manager_register_handler(userdata, first, last, fn, fn_userdata);
}

static int op_add_state_handler(void *userdata, TransportPeerStateFn fn, void *fn_userdata) {
        return peer_manager_add_state_handler(userdata, fn, fn_userdata);
}

static const TransportPeerOps transport_peer_ops = {
        .name = peer_name,
        .is_up = peer_is_up,
        .slot = op_slot,
        .send = peer_send_core,
        .cork = peer_cork,
        .uncork = peer_uncork,
        .stream_failed = peer_stream_failed,
        .validate_incoming = op_validate_incoming,
        .incoming_done = op_incoming_done,
        .register_handler = op_register_handler,
        .add_state_handler = op_add_state_handler,
};

int peer_manager_new(PeerManager **ret, sd_event *e, const PeerManagerConfig *c) {
        _cleanup_(peer_manager_freep) PeerManager *pm = NULL;
        int r;

        if (!ret || !e || !c || !peer_host_id_is_valid(c->host_id))
                return -EINVAL;
        pm = calloc(1, sizeof *pm);
        if (!pm)
                return -ENOMEM;
        pm->listen_fd = -EBADF;
        pm->event = sd_event_ref(e);
        pm->host_id = strdup(c->host_id);
        if (!pm->host_id)
                return -ENOMEM;
        if (c->listen_address) {
                pm->listen_address = strdup(c->listen_address);
                if (!pm->listen_address)
                        return -ENOMEM;
        }
        pm->heartbeat_usec = c->heartbeat_usec ? c->heartbeat_usec : PEER_HEARTBEAT_DEFAULT_USEC;
        if (pm->heartbeat_usec < 40 * USEC_PER_MSEC)
                return -EINVAL;
        pm->n_streams = c->n_streams ? c->n_streams : PEER_STREAMS_DEFAULT;
        if (pm->n_streams > PEER_MAX_STREAMS)
                return -EINVAL;
        pm->slice_size = c->slice_size ? c->slice_size : PEER_SLICE_DEFAULT;
        if (pm->slice_size < PEER_SLICE_MIN || pm->slice_size > PEER_SLICE_MAX)
                return -EINVAL;

        if (c->n_peers > 0 || c->listen_address) {
                if (!c->cluster_key_file)
                        return log_error_errno(EINVAL, "peer: [Cluster] KeyFile= is required with peers");
                r = peer_auth_key_load(c->cluster_key_file, &pm->key);
                if (r < 0)
                        return log_error_errno(r, "peer: cannot load cluster key %s: %m%s", c->cluster_key_file,
                                               r == -EPERM ? " (readable by others; chmod 600)" : "");
        }

        pm->by_host_id = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!pm->by_host_id)
                return -ENOMEM;
        if (c->n_peers > 0) {
                pm->peers = calloc(c->n_peers, sizeof *pm->peers);
                if (!pm->peers)
                        return -ENOMEM;
        }
        for (size_t i = 0; i < c->n_peers; i++) {
                const PeerConfig *pc = c->peers + i;
                Peer *p;

                if (!peer_host_id_is_valid(pc->host_id) || strcmp(pc->host_id, pm->host_id) == 0)
                        return log_error_errno(EINVAL, "peer %s: invalid HostId= '%s'", pc->name,
                                               pc->host_id ? pc->host_id : "");
                p = calloc(1, sizeof *p);
                if (!p)
                        return -ENOMEM;
                pm->peers[pm->n_peers++] = p;
                p->pm = pm;
                p->name = strdup(pc->name ? pc->name : pc->host_id);
                p->host_id = strdup(pc->host_id);
                p->address = strdup(pc->address ? pc->address : "");
                if (!p->name || !p->host_id || !p->address)
                        return -ENOMEM;
                if (peer_address_parse(p->address, &p->sa, &p->sa_len) < 0)
                        return log_error_errno(EINVAL, "peer %s: invalid Address= '%s' (numeric host:port)",
                                               p->name, p->address);
                p->dialer = strcmp(pm->host_id, p->host_id) < 0;
                r = hashmap_put(pm->by_host_id, p->host_id, p);
                if (r < 0)
                        return log_error_errno(r, "peer %s: duplicate HostId= '%s'", p->name, p->host_id);
        }

        TransportPeerOps ops = transport_peer_ops;
        ops.userdata = pm;
        r = tcp_transport_new(&pm->tcp, e, &ops, pm->slice_size);
        if (r < 0)
                return r;
        /* Peers choose rdma per path (topology.c); without it everything is tcp. */
        r = rdma_transport_new(&pm->rdma, e, &ops, pm->slice_size);
        if (r < 0 && r != -EOPNOTSUPP)
                log_warning_errno(r, "peer: cannot start the RDMA transport, peers use tcp: %m");
        *ret = TAKE_PTR(pm);
        return 0;
}

int peer_manager_start(PeerManager *pm) {
        int r;

        if (pm->started)
                return 0;
        if (pm->listen_address) {
                struct sockaddr_storage sa;
                unsigned sl;
                int one = 1;
                _cleanup_(closep) int fd = -EBADF;

                if (peer_address_parse(pm->listen_address, &sa, &sl) < 0)
                        return log_error_errno(EINVAL, "peer: invalid [Cluster] Listen= '%s'", pm->listen_address);
                fd = socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, IPPROTO_TCP);
                if (fd < 0)
                        return log_error_errno(errno, "peer: socket: %m");
                (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
                if (bind(fd, (struct sockaddr *)&sa, sl) < 0)
                        return log_error_errno(errno, "peer: cannot listen on %s: %m", pm->listen_address);
                if (listen(fd, 128) < 0)
                        return log_error_errno(errno, "peer: listen: %m");
                r = sd_event_add_io(pm->event, &pm->listen_source, fd, EPOLLIN, listen_io, pm);
                if (r < 0)
                        return r;
                pm->listen_fd = TAKE_FD(fd);
        }
        pm->started = true;
        for (size_t i = 0; i < pm->n_peers; i++) {
                Peer *p = pm->peers[i];
                if (!p->dialer)
                        continue;
                r = peer_dial(p, PEER_ROLE_CONTROL, 0);
                if (r < 0) {
                        peer_set_error(p, "connect", r);
                        peer_down(p, r, "connect failed");
                }
        }
        return 0;
}

int peer_manager_register_handler(PeerManager *pm, uint16_t first, uint16_t last,
                                  PeerMessageHandler h, void *userdata) {
        HandlerRange *n;

        if (!pm || !h || first > last || first <= PEER_MSG_CORE_LAST)
                return -EINVAL;
        for (size_t i = 0; i < pm->n_handlers; i++)
                if (first <= pm->handlers[i].last && last >= pm->handlers[i].first)
                        return -EEXIST;
        n = reallocarray(pm->handlers, pm->n_handlers + 1, sizeof *n);
        if (!n)
                return -ENOMEM;
        pm->handlers = n;
        pm->handlers[pm->n_handlers++] = (HandlerRange){ first, last, h, userdata };
        return 0;
}

int peer_manager_add_state_handler(PeerManager *pm, PeerStateHandler fn, void *userdata) {
        StateHandler *n;

        if (!pm || !fn)
                return -EINVAL;
        for (size_t i = 0; i < pm->n_state_handlers; i++)
                if (pm->state_handlers[i].fn == fn && pm->state_handlers[i].userdata == userdata)
                        return 0; /* subscribed already */
        n = reallocarray(pm->state_handlers, pm->n_state_handlers + 1, sizeof *n);
        if (!n)
                return -ENOMEM;
        pm->state_handlers = n;
        pm->state_handlers[pm->n_state_handlers++] = (StateHandler){ fn, userdata };
        return 0;
}

void peer_manager_set_incoming_validator(PeerManager *pm, PeerIncomingValidator fn, void *userdata) {
        pm->validator = fn;
        pm->validator_userdata = userdata;
}

void peer_manager_set_incoming_done(PeerManager *pm, PeerIncomingDone fn, void *userdata) {
        pm->done = fn;
        pm->done_userdata = userdata;
}

int peer_manager_validate_incoming(PeerManager *pm, Peer *p, uint32_t region, uint64_t offset,
                                   uint64_t length, uint64_t cookie) {
        int r;

        /* Nothing lands without an owner that said yes. */
        if (!pm->validator)
                r = -EPERM;
        else
                r = pm->validator(p, region, offset, length, cookie, pm->validator_userdata);
        if (r < 0)
                p->stats.writes_refused++;
        return r < 0 ? r : 0;
}

void peer_manager_incoming_done(PeerManager *pm, Peer *p, uint64_t cookie, int error) {
        if (pm->done)
                pm->done(p, cookie, error, pm->done_userdata);
}

Transport *peer_manager_transport(PeerManager *pm) {
        return pm ? pm->tcp : NULL;
}

Transport *peer_manager_rdma(PeerManager *pm) {
        return pm ? pm->rdma : NULL;
}

Transport *peer_manager_transport_for(PeerManager *pm, Peer *p) {
        if (!pm)
                return NULL;
        if (pm->rdma && rdma_transport_peer_ready(pm->rdma, p))
                return pm->rdma;
        return pm->tcp;
}

Peer *peer_manager_find(PeerManager *pm, const char *host_id) {
        if (!pm || !host_id)
                return NULL;
        return hashmap_get(pm->by_host_id, host_id);
}

Peer *peer_manager_peer(PeerManager *pm, size_t i) {
        return pm && i < pm->n_peers ? pm->peers[i] : NULL;
}

size_t peer_manager_n_peers(PeerManager *pm) {
        return pm ? pm->n_peers : 0;
}

const char *peer_manager_host_id(PeerManager *pm) {
        return pm->host_id;
}

usec_t peer_manager_heartbeat_usec(PeerManager *pm) {
        return pm->heartbeat_usec;
}

int peer_send(Peer *p, uint16_t type, const void *payload, size_t len) {
        int r;

        if (!p || type <= PEER_MSG_CORE_LAST || (len > 0 && !payload))
                return -EINVAL;
        if (p->state != PEER_UP || !p->control)
                return -ENOTCONN;
        r = conn_queue(p->control, type, payload, len);
        if (r < 0 && r != -EMSGSIZE && r != -ENOBUFS) {
                /* The socket itself failed: the session is over. Defer nothing: the
                 * caller learns through the state handler as well. */
                peer_down(p, r, "writing");
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
        r = conn_flush(p->control);
        if (r < 0)
                peer_down(p, r, "writing");
}

int peer_send_core(Peer *p, uint16_t type, const void *payload, size_t len) {
        int r;

        if (p->state != PEER_UP || !p->control)
                return -ENOTCONN;
        r = conn_queue(p->control, type, payload, len);
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

/* ---- subsystem glue ---- */

void peer_manager_set_heartbeat(PeerManager *pm, usec_t usec) {
        if (usec < 40 * USEC_PER_MSEC)
                return;
        pm->heartbeat_usec = usec;
}

/* Kernel telemetry (daemon/telemetry/telemetry.h) of the control connection and the data
 * streams, keyed by peer: RTT, retransmits, queues, and backpressure from them. Streams
 * are tracked as they attach; everything of the peer is untracked when it goes down. */
static void peer_telemetry_hook(Manager *m, Peer *p, bool up) {
        if (!up) {
                (void)telemetry_untrack_peer(m, p->name);
                return;
        }
        int fd = peer_control_fd(p);
        if (fd >= 0)
                (void)telemetry_track_socket(m, fd, p->name);
}

static void peer_stream_attached(Peer *p, int fd, void *userdata) {
        (void)telemetry_track_socket(userdata, fd, p->name);
}

static void peer_state_changed(Peer *p, bool up, void *userdata) {
        Manager *m = userdata;

        peer_telemetry_hook(m, p, up);
}

static int peer_subsystem_init(Manager *m) {
        const Config *c = &m->config;
        PeerManagerConfig pc = {
                .host_id = c->host_id,
                .listen_address = c->listen_address,
                .peers = c->peers,
                .n_peers = c->n_peers,
                .cluster_key_file = c->cluster_key_file,
                .heartbeat_usec = c->heartbeat_usec,
                .n_streams = c->peer_streams,
                .slice_size = (uint32_t)c->peer_slice_size,
        };
        PeerManager *pm;
        int r;

        /* Off until configured: a single host has no peer manager at all. */
        if (c->n_peers == 0 && !c->listen_address)
                return 0;
        r = peer_manager_new(&pm, m->event, &pc);
        if (r < 0)
                return log_error_errno(r, "peer: cannot set up the peer manager: %m");
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (a->domain != MEMORY_HOST)
                        continue; /* GPU memory goes over the cuda/rdma paths */
                r = pm->tcp->ops->register_region(pm->tcp, &a->region);
                if (r >= 0 && pm->rdma)
                        r = pm->rdma->ops->register_region(pm->rdma, &a->region);
                if (r < 0) {
                        peer_manager_free(pm);
                        return log_error_errno(r, "peer: cannot register arena %s: %m", a->name);
                }
        }
        pm->stream_attached = peer_stream_attached;
        pm->stream_attached_userdata = m;
        r = peer_manager_add_state_handler(pm, peer_state_changed, m);
        if (r < 0) {
                peer_manager_free(pm);
                return r;
        }
        m->peers = pm;
        return peer_manager_start(pm);
}

static void peer_subsystem_done(Manager *m) {
        m->peers = peer_manager_free(m->peers);
}

static int peer_subsystem_reload(Manager *m, const Config *n) {
        /* Peers, addresses and the key take a restart; the heartbeat bound applies now. */
        if (m->peers && n->heartbeat_usec != peer_manager_heartbeat_usec(m->peers)) {
                peer_manager_set_heartbeat(m->peers, n->heartbeat_usec);
                manager_emit_changed(m, PEER_OBJECT_PATH, PEER_INTERFACE, "HeartbeatUSec");
        }
        return 0;
}

const Subsystem peer_subsystem = {
        .name = "peer",
        .init = peer_subsystem_init,
        .done = peer_subsystem_done,
        .add_bus = bus_peer_add,
        .reload = peer_subsystem_reload,
};
