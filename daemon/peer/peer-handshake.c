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

/* ---- dialing ---- */

int peer_dial(Peer *p, PeerRole role, unsigned stream_index) {
        PeerManager *pm = p->pm;
        _cleanup_(closep) int fd = -EBADF;
        Conn *c;
        int r;

        fd = socket(p->sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, IPPROTO_TCP);
        if (fd < 0)
                return -errno;
        peer_set_socket_options(pm, fd);
        if (connect(fd, (struct sockaddr *)&p->sa, p->sa_len) < 0 && errno != EINPROGRESS)
                return -errno;
        r = peer_conn_new(pm, fd, true, &c);
        if (r < 0)
                return r;
        TAKE_FD(fd);
        c->peer = p;
        c->role = role;
        c->stream_index = stream_index;
        c->state = CONN_CONNECTING;
        r = peer_conn_update_events(c);
        if (r < 0) {
                peer_conn_free(c);
                return r;
        }
        if (role == PEER_ROLE_CONTROL) {
                p->control = c;
                p->state = PEER_CONNECTING;
        } else {
                /* Tracked until authenticated, so that a session reset ends it. */
                c->session_id = p->session_id;
                peer_conn_pend(c);
        }
        return 0;
}

int peer_dialer_connected(Conn *c) {
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
        return peer_conn_queue(c, PEER_MSG_HELLO, buf, (size_t)r);
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

        peer_conn_free(c);
        peer_set_stream_timeout(p->pm, fd);
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

int peer_dialer_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len) {
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
                        peer_conn_send_fail(c, PEER_FAIL_UNKNOWN_HOST);
                        return -EACCES;
                }
                memcpy(c->nonce_acceptor, ch.nonce, PEER_NONCE_SIZE);
                transcript_init(c, pm->host_id, p->host_id, &t);
                if (!peer_auth_verify(pm->key, PEER_AUTH_ACCEPTOR, &t, ch.mac)) {
                        log_error("peer %s: cluster key mismatch (acceptor's proof is wrong)", p->name);
                        p->stats.auth_failures++;
                        peer_conn_send_fail(c, PEER_FAIL_BAD_MAC);
                        return -EACCES;
                }
                r = peer_auth_mac(pm->key, PEER_AUTH_DIALER, &t, a.mac);
                if (r < 0)
                        return r;
                (void)peer_auth_msg_encode(&a, buf, sizeof buf);
                c->state = CONN_WAIT_AUTH_OK;
                return peer_conn_queue(c, PEER_MSG_AUTH, buf, sizeof buf);
        }
        if (c->state == CONN_WAIT_AUTH_OK && type == PEER_MSG_AUTH_OK) {
                PeerAuthOk ok;

                if (peer_auth_ok_decode(payload, len, &ok) < 0)
                        return -EBADMSG;
                if (c->role == PEER_ROLE_CONTROL) {
                        p->their_heartbeat_usec = (usec_t)ok.heartbeat_ms * USEC_PER_MSEC;
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

int peer_acceptor_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len) {
        PeerManager *pm = c->pm;
        int r;

        if (type == PEER_MSG_AUTH_FAIL && c->peer) {
                PeerReason pr = {};
                char from[64];
                (void)peer_reason_decode(payload, len, &pr);
                c->peer->stats.auth_failures++;
                /* Anyone may name a known host in a HELLO and then say this: counted, and
                 * logged with a bound. */
                peer_note(pm, PEER_NOTE_REFUSED_US, "peer %s: a connection from %s refused our proof: %s",
                          c->peer->name, peer_conn_from(c, from), peer_fail_reason_to_string(pr.reason));
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
                        char from[64];
                        peer_note(pm, PEER_NOTE_VERSION,
                                  "peer: a connection from %s (host '%s') speaks protocol versions %u to %u, this epdd "
                                  "version %u: refused (AUTH_FAIL version)",
                                  peer_conn_from(c, from), h.host_id, h.min_version, h.max_version,
                                  PEER_PROTOCOL_VERSION);
                        peer_conn_send_fail(c, PEER_FAIL_VERSION);
                        return -EPROTONOSUPPORT;
                }
                p = hashmap_get(pm->by_host_id, h.host_id);
                if (!p || p->dialer || p->retired) {
                        char from[64];
                        peer_note(pm, PEER_NOTE_UNKNOWN_HOST, "peer: refused connection from unknown host '%s' (%s)",
                                  h.host_id, peer_conn_from(c, from));
                        peer_conn_send_fail(c, PEER_FAIL_UNKNOWN_HOST);
                        return -EACCES;
                }
                c->peer = p;
                c->role = h.role;
                c->stream_index = h.stream_index;
                c->session_id = h.session_id;
                c->n_streams = MIN((unsigned)h.n_streams, pm->n_streams);
                if (h.role == PEER_ROLE_DATA &&
                    (p->state != PEER_UP || h.session_id != p->session_id || h.stream_index >= p->n_streams)) {
                        peer_conn_send_fail(c, PEER_FAIL_SESSION);
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
                return peer_conn_queue(c, PEER_MSG_CHALLENGE, buf, (size_t)r);
        }
        if (c->state == CONN_WAIT_AUTH && type == PEER_MSG_AUTH) {
                Peer *p = c->peer;
                if (p->retired) { /* left the membership since its HELLO */
                        peer_conn_send_fail(c, PEER_FAIL_UNKNOWN_HOST);
                        return -EACCES;
                }
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
                        char from[64];
                        peer_note(pm, PEER_NOTE_BAD_MAC,
                                  "peer %s: refused a connection from %s: cluster key mismatch (dialer's proof is "
                                  "wrong)", p->name, peer_conn_from(c, from));
                        p->stats.auth_failures++;
                        peer_conn_send_fail(c, PEER_FAIL_BAD_MAC);
                        return -EACCES;
                }
                if (c->role == PEER_ROLE_CONTROL) {
                        uint64_t sid = 0;
                        /* Off the pending list first: ending the old session ends the
                         * handshakes of its peer, and this one must survive that. */
                        peer_conn_unpend(c);
                        if (p->state == PEER_UP || p->control)
                                peer_supersede(p, c);
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
                        r = peer_conn_queue(c, PEER_MSG_AUTH_OK, buf, (size_t)r);
                        if (r < 0)
                                return r;
                        p->their_heartbeat_usec = 0; /* accepted: ours, both ways */
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
                r = peer_conn_queue(c, PEER_MSG_AUTH_OK, buf, (size_t)r);
                if (r < 0)
                        return r;
                if (c->out_end != c->out_start)
                        return -EAGAIN;
                conn_to_stream(c);
                return 1;
        }
        return -EBADMSG;
}
