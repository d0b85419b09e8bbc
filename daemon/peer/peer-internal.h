/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Internal to peer/: the connection, peer and manager structures shared by
 * peer-conn.c (framed control connections, the listen socket), peer-handshake.c
 * (dialing, accepting, authentication), peer.c (one peer's session: up, down,
 * heartbeats, reconnects) and peer-manager.c (the PeerManager and its Subsystem). */

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>
#include <systemd/sd-event.h>

#include "list.h"
#include "peer/peer-auth.h"
#include "peer/peer-manager.h"
#include "transport/rdma.h"
#include "transport/tcp.h"

/* Largest payload accepted before a connection is authenticated. */
#define HANDSHAKE_MAX_PAYLOAD 512

/* A session resets its dialer's reconnect backoff only once it has lasted
 * PEER_SESSION_STABLE_USEC, or two of its heartbeat bounds if that is longer
 * (peer_down()). Longer than the longest backoff with its jitter (5 s + 25 %), so that
 * two dialers that keep ending each other's session (two hosts with one HostId) never
 * reset each other's; longer than the heartbeat's verdict, so that a session that dies of
 * silence right after AUTH_OK does not count as one that worked. Before, AUTH_OK alone
 * reset it, and such sessions came back every 100 ms for ever. */
#define PEER_SESSION_STABLE_USEC (10 * USEC_PER_SEC)

/* Connections taken from the listen socket per wakeup (the rest wake the loop again: it
 * is level-triggered), so that a burst of them does not hold up heartbeats and data. */
#define PEER_ACCEPT_BATCH 16
/* accept() out of fds or memory (EMFILE, ENFILE, ENOBUFS, ENOMEM): the connection stays in
 * the backlog and the level-triggered listen socket would wake the loop at once, for ever;
 * it is switched off for this long instead, then tried again. */
#define PEER_ACCEPT_RETRY_USEC (100 * USEC_PER_MSEC)

/* What anyone who reaches the listen port can cause at will, once per connection: each
 * kind is counted, logged at once the first time, then at most once per
 * PEER_NOTE_INTERVAL_USEC with how many there were since its last line (peer_note()). */
#define PEER_NOTE_INTERVAL_USEC (10 * USEC_PER_SEC)
typedef enum PeerNoteKind {
        PEER_NOTE_UNKNOWN_HOST, /* HELLO naming a host we take no connection from */
        PEER_NOTE_BAD_MAC,      /* AUTH with a wrong proof: another cluster key */
        PEER_NOTE_REFUSED_US,   /* AUTH_FAIL from a connection that named a known host */
        PEER_NOTE_VERSION,      /* a first frame of another protocol version */
        PEER_NOTE_PROTOCOL,     /* a malformed frame before authentication */
        PEER_NOTE_EVICTED,      /* closed for a newer one (pending_make_room()) */
        PEER_NOTE_ACCEPT,       /* accept() or setting up an accepted connection failed */
        _PEER_NOTE_MAX,
} PeerNoteKind;

typedef struct PeerNote {
        uint64_t total;         /* since start */
        uint64_t unsaid;        /* since its last line */
        usec_t said_usec;       /* its last line (CLOCK_MONOTONIC); 0: none yet */
        char last[224];         /* the latest one, in words: the next line shows it */
} PeerNote;

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
        bool flush_due;          /* on pm->flush_due: written when the loop idles */
        LIST_FIELDS(Conn, due);

        bool pending; /* on pm->pending */
        LIST_FIELDS(Conn, pending);
        struct sockaddr_storage from; /* accepted: the address it came from */
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
        bool member;             /* added at run time from the cluster's membership */
        bool retired;            /* a member that left: not dialed, connections refused */
        PeerState state;
        Conn *control;
        uint64_t session_id;
        unsigned n_streams;      /* negotiated for this session */
        sd_event_source *reconnect_timer;
        sd_event_source *heartbeat_timer;
        sd_event_source *down_defer; /* a write failed under a caller: peer_down() next turn */
        int down_error;
        const char *down_why;
        usec_t backoff_usec;
        usec_t their_heartbeat_usec; /* the acceptor's HeartbeatInterval (its AUTH_OK), when we
                                      * dialed this session; 0: not known (we accepted it) */
        usec_t session_heartbeat_usec; /* our own HeartbeatInterval when the session came up:
                                        * what the peer was told, or judges by, until it ends */
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
        size_t n_members;        /* of them, added at run time (peer_manager_add_member)
                                  * and not retired */
        Hashmap *by_host_id;

        int listen_fd;
        sd_event_source *listen_source;
        LIST_HEAD(Conn, pending);  /* not yet authenticated, ours and others' */
        size_t n_pending;          /* of them, the ones others opened to us: the bound
                                    * PEER_PENDING_MAX is on these (our own dials do not
                                    * take their places) */
        /* Refusals of others' connections, counted and logged with a bound (peer_note()).
         * note_timer says what a kind left unsaid once its interval has passed;
         * listen_retry switches the listen source back on after an accept() that ran
         * out of fds (PEER_ACCEPT_RETRY_USEC). Both go in peer_manager_free()
         * (peer_notes_done()). */
        PeerNote notes[_PEER_NOTE_MAX];
        usec_t note_interval_usec; /* 0: PEER_NOTE_INTERVAL_USEC (tests shorten it) */
        sd_event_source *note_timer;
        sd_event_source *listen_retry;
        uint64_t accept_paused;    /* times the listen source was switched off */

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

        /* Control frames queued while the loop is busy, written when it idles (before
         * the data streams' posts: a PREPARE ahead of its data) or when the oldest has
         * waited PEER_FLUSH_MAX_USEC (peer_flush_overdue()). */
        sd_event_source *flush;
        LIST_HEAD(Conn, flush_due);
        uint64_t flush_since;

        /* Called with each authenticated data stream's fd as it is attached (telemetry). */
        void (*stream_attached)(Peer *p, int fd, void *userdata);
        void *stream_attached_userdata;
};

/* Counts one event of `kind` (in words, for the log: "peer: ..." or "peer NAME: ...") and
 * logs it now if its kind said nothing for pm->note_interval_usec, else later, with the
 * count of those it stands for. */
void peer_note(PeerManager *pm, PeerNoteKind kind, const char *fmt, ...) _printf_(3, 4);
/* What the notes left unsaid is said, and their timer and the accept retry go (at
 * peer_manager_free()). */
void peer_notes_done(PeerManager *pm);
/* "ADDR:PORT" of an accepted connection, for the log. */
const char *peer_conn_from(const Conn *c, char buf[static 64]);
/* The acceptor's side of a supersede: the old session's dialer is told (BYE superseded)
 * before the session ends, so that it backs off and says why. */
void peer_supersede(Peer *p, Conn *by);
/* The dialer's side: the acceptor said our session was superseded (BYE superseded). */
void peer_superseded(Peer *p);

int peer_acceptor_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len);
void peer_conn_fail(Conn *c, int error, const char *what);
int peer_conn_flush(Conn *c);
int peer_conn_flush_soon(Conn *c);
void peer_flush_overdue(PeerManager *pm);
void peer_flush_control(Peer *p);
Conn *peer_conn_free(Conn *c);
int peer_conn_new(PeerManager *pm, int fd, bool dialer, Conn **ret);
/* On the pending list (until authenticated, so that a session reset ends it), and off. */
void peer_conn_pend(Conn *c);
void peer_conn_unpend(Conn *c);
int peer_conn_queue(Conn *c, uint16_t type, const void *payload, size_t len);
int peer_conn_read(Conn *c);
void peer_conn_send_fail(Conn *c, PeerFailReason reason);
/* BYE(reason) on an up connection about to be closed, written now; then what waits in its
 * socket is read and dropped (bounded), so that the close sends a FIN behind the BYE
 * rather than a reset that may lose it (Linux resets a connection closed with unread
 * input, and drops what it had not sent yet). */
void peer_conn_say_bye(Conn *c, PeerFailReason reason);
int peer_conn_update_events(Conn *c);
int peer_dialer_connected(Conn *c);
int peer_dialer_frame(Conn *c, uint16_t type, const uint8_t *payload, size_t len);
int peer_listen_io(sd_event_source *s, int fd, uint32_t revents, void *userdata);
int peer_dial(Peer *p, PeerRole role, unsigned stream_index);
void peer_down(Peer *p, int error, const char *why);
void peer_set_error(Peer *p, const char *why, int error);
int peer_up(Peer *p, Conn *c, uint64_t session_id, unsigned n_streams);
void peer_set_socket_options(PeerManager *pm, int fd);
/* A data stream's TCP_USER_TIMEOUT: the heartbeat bound plus the longest park. */
void peer_set_stream_timeout(PeerManager *pm, int fd);
