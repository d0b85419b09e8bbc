/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* What a transport to other hosts (tcp, rdma) needs from the layer that owns the
 * connections to them (peer/): the peer layer implements these operations and hands
 * them to a transport when it creates it, so that no transport calls into peer/ by
 * name. A Peer is opaque here: the handle the peer layer passes to post(),
 * cancel_peer() and the calls below. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "transport/transport.h"

typedef struct Peer Peer;

/* Bound on incoming writes in flight per peer and transport. */
#define PEER_INCOMING_MAX 65536

typedef int (*TransportPeerMessageFn)(Peer *p, uint16_t type, const void *payload, size_t len,
                                      void *userdata);
typedef void (*TransportPeerStateFn)(Peer *p, bool up, void *userdata);

typedef struct TransportPeerOps {
        const char *(*name)(Peer *p);
        bool (*is_up)(Peer *p);
        /* A slot per peer and transport kind where the transport keeps its state of
         * that peer (NULL until it sets it). */
        void **(*slot)(Peer *p, TransportKind kind);
        /* Queues a message on the peer's control connection: a core message of the
         * transport's (WRITE_ACK) or one of a range it registered. -ENOTCONN when the
         * peer is not up. */
        int (*send)(Peer *p, uint16_t type, const void *payload, size_t len);
        /* Batches the control frames queued until uncork() into one write. */
        void (*cork)(Peer *p);
        void (*uncork)(Peer *p);
        /* Writes the control frames the peer layer holds for the loop's idle point now
         * (optional): data about to leave goes after the PREPARE that announces it. */
        void (*flush_control)(Peer *p);
        /* A data stream or queue pair broke: the whole session with p is reset. */
        void (*stream_failed)(Peer *p, int error, const char *what);

        /* Asked before any byte of an incoming write lands: 0 to accept (a TARGET
         * write's region and offset resolved in *in), -EAGAIN to ask again later (its
         * target is not known yet: resume_incoming()), other negative errno to refuse.
         * Then told once per accepted write when every byte landed (error 0; in->imm
         * with TRANSPORT_WRITE_IMM) or what ended it. */
        int (*validate_incoming)(void *userdata, Peer *p, TransportIncoming *in);
        void (*incoming_done)(void *userdata, Peer *p, const TransportIncoming *in, int error);
        /* Subscriptions: messages of a type range, and peers going up or down. */
        int (*register_handler)(void *userdata, uint16_t first, uint16_t last, TransportPeerMessageFn fn,
                                void *fn_userdata);
        int (*add_state_handler)(void *userdata, TransportPeerStateFn fn, void *fn_userdata);

        void *userdata; /* the peer layer's own, passed to the calls above that take it */
} TransportPeerOps;
