/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The tcp transport: bulk writes to peer hosts over a few authenticated TCP data
 * streams per peer (their handshake lives in peer/, which hands the connected fds
 * over). Slices of all writes to a peer are sent round-robin (slicer.h) over whichever
 * stream can take them; the receiver recv()s each slice straight into the destination
 * region after asking the incoming validator, and acknowledges on the control
 * connection the writes whose every slice landed, as runs of write ids (WRITE_ACKS), one
 * frame per wakeup; a refused write is acknowledged alone with its error. A write may
 * carry an immediate (delivered with its completion: a completion flag in-band) and be
 * addressed relative to a target the receiver resolves; a stream whose next write names
 * a target the receiver does not know yet waits (TCP holds the bytes back) until it is
 * announced (resume_incoming). */

#include <stdint.h>
#include <systemd/sd-event.h>

#include "peer/peer-proto.h"
#include "transport/transport-peer.h"

/* A stream whose next write names a target the receiver does not know yet (its
 * PREPARE is still on the control connection), or pages whose freeing record is not
 * durable yet, is parked (not read) at most this long. Its sender's window may stay
 * closed as long: data streams' TCP_USER_TIMEOUT is longer (peer_set_stream_timeout()). */
#define TCP_PARK_TIMEOUT_USEC (10ULL * 1000000ULL)

/* An incoming write none of whose bytes arrived for this long (and at most half as long
 * again: checked every half) ends the session: its sender stopped in the middle (a bug,
 * or a peer holding the destination's pages), and nothing else would ever free them.
 * Longer than any park (above), after which the stream fails on its own. */
#define TCP_IN_STALL_USEC (30ULL * 1000000ULL)
/* The slice maps of one peer's incoming writes (a bit per slice) take at most this
 * much memory: a peer whose writes in flight would need more breaks the protocol. */
#define TCP_IN_MAPS_MAX (64ULL << 20)

/* peers: the peer layer's operations (copied). */
int tcp_transport_new(Transport **ret, sd_event *e, const TransportPeerOps *peers, uint32_t slice_size);
/* For tests: the stall bound of incoming writes (TCP_IN_STALL_USEC). */
void tcp_transport_set_in_stall(Transport *t, uint64_t usec);
/* Takes fd (an authenticated data stream of p's current session). */
int tcp_transport_attach_stream(Transport *t, Peer *p, int fd, unsigned index);
/* The session with p ended: every write in flight both ways completes with `error`,
 * streams are closed, and no byte lands afterwards. */
void tcp_transport_peer_reset(Transport *t, Peer *p, int error);
/* WRITE_ACK from p. */
void tcp_transport_write_acked(Transport *t, Peer *p, uint64_t write_id, int error);
/* WRITE_ACKS: every write of the runs landed. */
void tcp_transport_writes_acked(Transport *t, Peer *p, const PeerAckRun *runs, size_t n);
unsigned tcp_transport_streams_up(Transport *t, Peer *p);
/* Posts waiting for the loop to idle go out if the oldest has waited its bound: for a
 * loop that may not idle (manager_run()'s, after every dispatch). */
void tcp_transport_flush_overdue(Transport *t);
/* Writes queued or awaiting acknowledgement to p, and incoming writes from p. */
void tcp_transport_peer_inflight(Transport *t, Peer *p, uint64_t *out, uint64_t *in);
