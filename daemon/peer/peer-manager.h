/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* PeerManager: the daemon's connections to the other epdd hosts listed in config.
 *
 * Per peer there is one control connection (framed messages, peer-proto.h) and, once
 * it is authenticated, a few data streams that carry bulk writes (transport/tcp.c).
 * Of two peers, the one with the smaller host id dials and the other accepts; every
 * connection, control or data, authenticates both ways with the cluster key
 * (peer-auth.h) before any other frame is accepted. Heartbeats run on the control
 * connection: a peer from which nothing arrived for heartbeat_usec is declared down,
 * and everything in flight with it completes with an error on both sides. The dialer
 * reconnects with exponential backoff. Everything is an sd-event source; nothing
 * blocks.
 *
 * Message types are uint16 ranges: 0x0000-0x00ff core (hello, auth, heartbeat, bye,
 * data), 0x0100-0x01ff handoff, 0x0200-0x02ff directory, 0x0300-0x03ff telemetry. A
 * subsystem registers a handler for its range. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "core/config.h"
#include "peer/peer-proto.h"
#include "time-util.h"
#include "transport/transport.h"

typedef struct PeerManager PeerManager;
typedef struct Peer Peer;
typedef struct Manager Manager;

typedef int (*PeerMessageHandler)(Peer *p, uint16_t type, const void *payload, size_t len,
                                  void *userdata);
typedef void (*PeerStateHandler)(Peer *p, bool up, void *userdata);
/* Asked before any byte of an incoming write lands: 0 to accept (a write relative to a
 * target resolved into in->region and in->offset), -EAGAIN when its target is not known
 * yet (asked again after peer_manager_resume_incoming()), another negative errno to
 * refuse (the bytes are then discarded and the sender's write fails with that error). */
typedef int (*PeerIncomingValidator)(Peer *p, TransportIncoming *in, void *userdata);
/* Told once per accepted incoming write: error 0 when every byte has landed (with its
 * immediate, when it carries one), or the error that ended it (connection dropped: no
 * byte of it lands after this call). */
typedef void (*PeerIncomingDone)(Peer *p, const TransportIncoming *in, int error, void *userdata);

typedef enum PeerState {
        PEER_DOWN,           /* not connected; the dialer waits for its backoff */
        PEER_CONNECTING,     /* TCP connect in progress (dialer) */
        PEER_AUTHENTICATING, /* TCP up, challenge-response running */
        PEER_UP,             /* authenticated, heartbeats flowing */
        _PEER_STATE_MAX,
} PeerState;

const char *peer_state_to_string(PeerState s);

#define PEER_HEARTBEAT_DEFAULT_USEC (2 * USEC_PER_SEC)
#define PEER_STREAMS_DEFAULT 2
#define PEER_RECONNECT_MIN_USEC (100 * USEC_PER_MSEC)
#define PEER_RECONNECT_MAX_USEC (5 * USEC_PER_SEC)
/* Bound on what one peer may have queued on its control connection. */
#define PEER_OUTPUT_MAX (64U * 1024U * 1024U)
/* Bound on unauthenticated connections others opened to us at once, and on those from
 * one address that have not said HELLO yet (two peers' control connection and every
 * data stream: 2 x (1 + PEER_MAX_STREAMS)): past either, the oldest of them (of that
 * address) is closed for the new one (peer-conn.c: pending_make_room()). */
#define PEER_PENDING_MAX 128
#define PEER_PENDING_PER_ADDRESS 34

typedef struct PeerManagerConfig {
        const char *host_id;
        const char *listen_address;     /* host:port; NULL: do not listen */
        const PeerConfig *peers;
        size_t n_peers;
        const char *cluster_key_file;   /* required when there are peers */
        usec_t heartbeat_usec;          /* 0: PEER_HEARTBEAT_DEFAULT_USEC */
        unsigned n_streams;             /* data streams per peer; 0: default */
        uint32_t slice_size;            /* 0: PEER_SLICE_DEFAULT */
} PeerManagerConfig;

typedef struct PeerStats {
        uint64_t frames_in, frames_out;
        uint64_t bytes_in, bytes_out;         /* control frames */
        uint64_t heartbeats_missed;           /* down transitions by heartbeat timeout */
        uint64_t connects, disconnects;
        uint64_t auth_failures;
        uint64_t protocol_errors;
        uint64_t writes_refused;              /* incoming writes the validator refused */
        usec_t last_rx_usec;
        usec_t up_since_usec;
} PeerStats;

struct PeerAuthKey;
/* Everything of c that peer_manager_new() refuses, checked without side effects: the
 * cluster key is loaded (and handed to ret_key, which may be NULL), the listen and peer
 * addresses parsed, the peers' host ids checked. Logs what is wrong. Also run by
 * `epdd --check-config`, so that it says what start-up would. */
int peer_manager_config_verify(const PeerManagerConfig *c, struct PeerAuthKey **ret_key);
int peer_manager_new(PeerManager **ret, sd_event *e, const PeerManagerConfig *c);
/* Starts listening and dialing. */
int peer_manager_start(PeerManager *pm);
PeerManager *peer_manager_free(PeerManager *pm);

int peer_manager_register_handler(PeerManager *pm, uint16_t first, uint16_t last,
                                  PeerMessageHandler h, void *userdata);
/* Subscribes fn to peers going up or down (once: the same fn and userdata again is a
 * no-op). */
int peer_manager_add_state_handler(PeerManager *pm, PeerStateHandler fn, void *userdata);
void peer_manager_set_incoming_validator(PeerManager *pm, PeerIncomingValidator fn, void *userdata);
void peer_manager_set_incoming_done(PeerManager *pm, PeerIncomingDone fn, void *userdata);
/* Incoming writes of p that waited for their target are asked about again. */
void peer_manager_resume_incoming(PeerManager *pm, Peer *p);

/* The tcp transport (owned by the manager). post(t, peer, writes, n): src_region names
 * a local region registered with register_region, dst_region/dst_offset the REMOTE
 * one. A write completes on the transport's completion fd once the receiver has
 * confirmed that every byte landed, or with an error. */
Transport *peer_manager_transport(PeerManager *pm);
/* The rdma transport (transport/rdma.h; NULL without libibverbs), same post() contract. */
Transport *peer_manager_rdma(PeerManager *pm);
/* The transport that moves bytes to p now: rdma once its queue pair with p is
 * connected, tcp otherwise. */
Transport *peer_manager_transport_for(PeerManager *pm, Peer *p);

Peer *peer_manager_find(PeerManager *pm, const char *host_id);
/* Iteration over every peer ever known, configured ones and members, retired members
 * included (skip them with peer_is_retired() where only live peers matter): `for (size_t
 * i = 0; (p = peer_manager_peer(pm, i)); i++)`. Peers are only ever appended: an index
 * names the same peer for the manager's life. */
Peer *peer_manager_peer(PeerManager *pm, size_t i);
size_t peer_manager_n_peers(PeerManager *pm);
const char *peer_manager_host_id(PeerManager *pm);
usec_t peer_manager_heartbeat_usec(PeerManager *pm);

/* Sends a message of a registered (non-core) range on the control connection.
 * -ENOTCONN if the peer is not up, -EMSGSIZE, -ENOBUFS if its queue is full. */
int peer_send(Peer *p, uint16_t type, const void *payload, size_t len);
const char *peer_host_id(Peer *p);
const char *peer_name(Peer *p);
const char *peer_address(Peer *p);
bool peer_is_up(Peer *p);
PeerState peer_state(Peer *p);
const PeerStats *peer_stats(Peer *p);
/* Why the peer last went down ("" if never): "heartbeat timeout", "connection reset", ... */
const char *peer_last_error(Peer *p);
unsigned peer_n_streams_up(Peer *p);
/* The control connection's fd (-1 when down), e.g. for per-connection telemetry. */
int peer_control_fd(Peer *p);

/* Membership from a coordination service (daemon/cluster/): peers added and retired at
 * run time, authenticated with the cluster key exactly as configured ones.
 *
 * add_member adds a peer (or brings back a retired one, with its address updated) and
 * dials it if our host id sorts first; -EEXIST for the host id of a configured peer or
 * of this host, -ENOSPC past PEER_MEMBERS_MAX members at once (retired ones do not
 * count) or PEER_OBJECTS_MAX peers ever known, -EINVAL for a bad id or address.
 * retire_member ends the session (everything in flight with it fails and the state
 * handlers hear "down": handoffs roll back), and the peer is no longer dialed and its
 * connections are refused until it is added again. A retired Peer stays allocated
 * (transports and handoffs may still name it) and is reused when the same host comes
 * back: it stays in peer_manager_peer()'s iteration and in ListPeers (state "left"),
 * but topology does not resolve its path (no netlink work per member that ever left)
 * and /metrics does not export it. -ENOENT for an unknown host id, -EPERM for a
 * configured peer. */
#define PEER_MEMBERS_MAX 1024
#define PEER_OBJECTS_MAX 65536 /* a retired Peer stays: bounds memory under endless churn */
int peer_manager_add_member(PeerManager *pm, const char *host_id, const char *address, Peer **ret);
int peer_manager_retire_member(PeerManager *pm, const char *host_id);
/* Whether p came from the membership (true) or from a [Peer:NAME] section. */
bool peer_is_member(Peer *p);
bool peer_is_retired(Peer *p);

/* Applies a new heartbeat bound (config reload). */
void peer_manager_set_heartbeat(PeerManager *pm, usec_t usec);

/* Subsystem glue (manager.c's table): builds the PeerManager from Manager->config. */
#include "core/manager.h"
extern const Subsystem peer_subsystem;

/* ---- Internal to the peer folder (the transports reach these through TransportPeerOps) ---- */
PeerManager *peer_get_manager(Peer *p);
uint64_t peer_session_id(Peer *p);
/* Core messages (WRITE_ACK) of the transports. */
int peer_send_core(Peer *p, uint16_t type, const void *payload, size_t len);
int peer_manager_validate_incoming(PeerManager *pm, Peer *p, TransportIncoming *in);
void peer_manager_incoming_done(PeerManager *pm, Peer *p, const TransportIncoming *in, int error);
/* Batches control frames (acknowledgements) queued until peer_uncork() into one write. */
void peer_cork(Peer *p);
void peer_uncork(Peer *p);
/* A data stream broke: the whole session with the peer is reset. */
void peer_stream_failed(Peer *p, int error, const char *what);
