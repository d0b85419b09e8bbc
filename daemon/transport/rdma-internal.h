/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Internal to the verbs transport: the structures shared by rdma-device.c (discovery,
 * protection domains, memory registration, device events), rdma-qp.c (one queue pair per
 * peer: creation, connection, faults, drain) and rdma.c (the data path, the 0x04xx
 * control messages and the Transport vtable). */

#include <arpa/inet.h>
#include <assert.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/inotify.h>
#include <sys/random.h>
#include <unistd.h>
#include "hashmap.h"
#include "list.h"
#include "log.h"
#include "macro.h"
#include "peer/peer-proto.h"
#include "time-util.h"
#include "transport/rdma-proto.h"
#include "transport/rdma-session.h"
#include "transport/rdma.h"
#include "transport/slicer.h"
#include "transport/transport-peer.h"
#include "transport/transport-util.h"
/* ---- the transport ---- */

#define MAX_REGIONS 1024
#define MAX_POST 65536
/* Work requests per QP: send queue, receive queue (one receive per WITH_IMM write), and
 * the bound on slices in flight (below both, so neither queue overflows). */
#define SQ_DEPTH 128U
#define RQ_DEPTH 128U
#define MAX_OUTSTANDING 32U
/* A work request moves at most this much: with MAX_OUTSTANDING, 8 MiB in flight per QP
 * (far above a NIC's bandwidth-delay product), while soft-RoCE, which runs a posted
 * request's packets partly inside ibv_post_send, never holds the loop for long. */
#define MAX_SLICE (256U * 1024U)
/* Writes requested, granted or in flight to one peer. */
#define MAX_OUT_WRITES 65536U
/* Flushed completions that do not come within this are given up on: the QP is destroyed
 * (which also stops the device from touching the buffers) before anything is freed. */
#define DRAIN_TIMEOUT_USEC (2 * USEC_PER_SEC)
/* Writes this side sent to a peer, none of which moved for 20-30 s (no grant,
 * acknowledgement or work request completion; a work request that fails says so within
 * the RC retries, ~4 s), fail the queue pair: the peer stopped answering in the middle
 * (requested, never granted; written, never acknowledged), and the source pages of those
 * writes would otherwise stay held as long as the session lived. Checked every
 * WRITE_WATCH_USEC; stalled after 2 checks in a row without progress. Only the sender
 * watches (rdma-qp.c: on_write_watch()). */
#define WRITE_WATCH_USEC (10 * USEC_PER_SEC)
/* RC transport timer: 4.096 us * 2^17 ~ 0.5 s per try, 6 retries (7 would mean
 * "forever" to soft-RoCE): a peer that stops answering fails the work request after
 * ~4 s (longer than soft-RoCE's stalls under emulation). The receiver-not-ready retry
 * is infinite (7). */
#define QP_TIMEOUT 17
#define QP_RETRY 6
#define WR_RECV_FLAG (UINT64_C(1) << 63)

typedef struct RdmaTransport RdmaTransport;
typedef struct RdmaDevice RdmaDevice;
typedef struct RdmaPeer RdmaPeer;

struct RdmaDevice {
        RdmaTransport *t;
        char name[RDMA_NAME_MAX];
        struct ibv_context *ctx;
        struct ibv_pd *pd;
        struct ibv_comp_channel *channel;
        sd_event_source *comp_source, *async_source;
        struct ibv_mr *mrs[MAX_REGIONS];
        unsigned users;          /* peers with a CQ/QP on it */
        bool dead;               /* fatal, or removed: closed once unused */
        LIST_FIELDS(RdmaDevice, devices);
};

typedef struct OutWrite {
        SliceWrite sw;           /* first: container_of from the slice queue */
        uint64_t write_id;
        uint64_t cookie;
        const TransportRegion *src;
        uint64_t src_offset;
        uint32_t dst_region;
        uint64_t dst_offset;
        uint64_t attempt;        /* TRANSPORT_WRITE_ATTEMPT's token, or 0 */
        uint32_t rkey;
        uint64_t raddr;
        bool granted, acked;
        unsigned wrs;            /* work requests posted, not completed */
} OutWrite;

typedef struct InWrite {
        uint64_t write_id;
        uint64_t cookie, length;
} InWrite;

struct RdmaPeer {
        RdmaTransport *t;
        Peer *peer;
        RdmaSession s;
        RdmaDevice *dev;
        RdmaLink link;           /* of the QP */
        struct ibv_cq *cq;
        struct ibv_qp *qp;
        uint32_t psn;
        int gid_index;
        union ibv_gid gid;
        enum ibv_mtu mtu;
        unsigned recvs;          /* receives posted */
        /* The peer's side, from its CONNECT. */
        uint32_t r_qpn, r_psn;
        uint8_t r_gid[16];
        uint8_t r_mtu;
        char r_device[RDMA_NAME_MAX];
        int fail_error;          /* what the writes complete with when drained */
        Hashmap *out;            /* OutWrite* by write_id */
        Hashmap *in;             /* InWrite* by write_id */
        SliceQueue queue;        /* granted writes with slices left to post */
        uint32_t next_write_id;
        sd_event_source *drain_timer;
        sd_event_source *write_watch; /* while writes are out: WRITE_WATCH_USEC */
        uint64_t progress, seen; /* grants, acks and completions; as the watch saw them */
        unsigned idle_checks;
        uint64_t bytes, writes, bytes_in;
        LIST_FIELDS(RdmaPeer, peers);
};

struct RdmaTransport {
        Transport base;
        sd_event *event;
        TransportPeerOps peers_ops; /* the peer layer: control messages, validation */
        uint32_t slice_size;
        TransportRegion *regions[MAX_REGIONS];
        LIST_HEAD(RdmaDevice, devices);
        LIST_HEAD(RdmaPeer, peers);
        RdmaLinkLookup lookup;
        RdmaChanged changed;
        void *topology;
        int efd;
        TransportDoneQueue done;
        int inotify_fd;
        sd_event_source *inotify_source;
};

static inline const char *rp_name(RdmaPeer *rp) {
        return rp->t->peers_ops.name(rp->peer);
}

void rdma_complete(RdmaTransport *t, uint64_t cookie, int error, uint64_t bytes);
void rdma_complete_write(RdmaPeer *rp, OutWrite *w, int error);
RdmaDevice *rdma_device_free(RdmaDevice *d);
int rdma_device_get(RdmaTransport *t, const char *name, RdmaDevice **ret);
void rdma_device_put(RdmaDevice *d);
void rdma_fault(RdmaPeer *rp, RdmaFault f, int error, const char *reason);
/* A write posted: the write watch armed. */
void rdma_write_watch(RdmaPeer *rp);
int rdma_fd_prepare(int fd);
void rdma_finalize(RdmaPeer *rp);
bool rdma_local_ok(RdmaPeer *rp, RdmaLink *link);
int rdma_mr_register(RdmaDevice *d, TransportRegion *r);
int rdma_on_comp(sd_event_source *s, int fd, uint32_t revents, void *userdata);
RdmaPeer *rdma_peer_find(RdmaTransport *t, Peer *p);
RdmaPeer *rdma_peer_get(RdmaTransport *t, Peer *p);
int rdma_post_recvs(RdmaPeer *rp);
RdmaTransport *rdma_of(Transport *t);
void rdma_run(RdmaPeer *rp, unsigned a);
void rdma_send_ack(RdmaPeer *rp, uint64_t write_id, int error);
void rdma_send_msg(RdmaPeer *rp, const RdmaMessage *m);
void rdma_watch_devices(RdmaTransport *t);
