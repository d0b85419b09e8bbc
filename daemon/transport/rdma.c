/* SPDX-License-Identifier: LGPL-2.1-or-later */
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
#include "transport/rdma-proto.h"
#include "transport/rdma-session.h"
#include "time-util.h"
#include "transport/rdma.h"
#include "transport/transport-peer.h"
#include "transport/slicer.h"
#include "transport/transport-util.h"

const bool rdma_data_path_built = true;

int rdma_discover(RdmaLink *links, size_t max, bool *logged_none) {
        RdmaLink sys[RDMA_MAX_LINKS];
        struct ibv_device **list;
        int n_dev = 0, n_sys;
        size_t n = 0;

        list = ibv_get_device_list(&n_dev);
        if (!list) {
                /* ENOSYS: no kernel support (no uverbs); treated as no devices. */
                if (errno != ENOSYS)
                        log_debug("rdma: ibv_get_device_list: %m");
                n_dev = 0;
        }
        n_sys = n_dev > 0 ? rdma_links_from_sysfs("/sys", sys, ELEMENTSOF(sys)) : 0;
        if (n_sys < 0) {
                log_warning_errno(n_sys, "rdma: reading /sys/class/infiniband: %m");
                n_sys = 0;
        }
        for (int d = 0; d < n_dev; d++) {
                const char *name = ibv_get_device_name(list[d]);
                struct ibv_context *ctx;

                if (!name)
                        continue;
                ctx = ibv_open_device(list[d]);
                for (int i = 0; i < n_sys; i++) {
                        struct ibv_port_attr pa;

                        if (strcmp(sys[i].device, name) != 0)
                                continue;
                        if (ctx && ibv_query_port(ctx, sys[i].port, &pa) == 0) {
                                sys[i].active = pa.state == IBV_PORT_ACTIVE;
                                snprintf(sys[i].state, sizeof sys[i].state, "%s",
                                         ibv_port_state_str(pa.state));
                        }
                        if (n < max)
                                links[n++] = sys[i];
                }
                if (ctx)
                        ibv_close_device(ctx);
        }
        if (list)
                ibv_free_device_list(list);

        if (n == 0) {
                if (logged_none && !*logged_none) {
                        if (n_dev > 0)
                                log_info("rdma: no RDMA devices carry a network interface (%d without one); peers use tcp",
                                         n_dev);
                        else
                                log_info("rdma: no RDMA devices; peers use tcp");
                }
                if (logged_none)
                        *logged_none = true;
        } else if (logged_none)
                *logged_none = false;
        return (int)n;
}

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

static RdmaTransport *rdma(Transport *t) {
        return container_of(t, RdmaTransport, base);
}

static void run(RdmaPeer *rp, unsigned a);

static void complete(RdmaTransport *t, uint64_t cookie, int error, uint64_t bytes) {
        transport_done_push(&t->base, &t->done, t->efd, cookie, error, bytes);
}

static int fd_prepare(int fd) {
        int fl = fcntl(fd, F_GETFL);
        if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
                return -errno;
        return 0;
}

/* ---- devices ---- */

static int on_comp(sd_event_source *s, int fd, uint32_t revents, void *userdata);
static int on_async(sd_event_source *s, int fd, uint32_t revents, void *userdata);
static void watch_devices(RdmaTransport *t);

static int mr_register(RdmaDevice *d, TransportRegion *r) {
        if (d->mrs[r->id])
                return 0;
        d->mrs[r->id] = ibv_reg_mr(d->pd, r->host_base, r->size,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
        if (!d->mrs[r->id])
                return log_warning_errno(errno, "rdma: %s: cannot register arena %u (%llu bytes): %m", d->name,
                                         r->id, (unsigned long long)r->size);
        return 0;
}

static RdmaDevice *device_free(RdmaDevice *d) {
        if (!d)
                return NULL;
        sd_event_source_disable_unref(d->comp_source);
        sd_event_source_disable_unref(d->async_source);
        for (size_t i = 0; i < MAX_REGIONS; i++)
                if (d->mrs[i])
                        (void)ibv_dereg_mr(d->mrs[i]);
        if (d->channel)
                (void)ibv_destroy_comp_channel(d->channel);
        if (d->pd)
                (void)ibv_dealloc_pd(d->pd);
        if (d->ctx)
                (void)ibv_close_device(d->ctx);
        free(d);
        return NULL;
}

static void device_put(RdmaDevice *d) {
        RdmaTransport *t = d->t;

        assert(d->users > 0);
        if (--d->users > 0 || !d->dead)
                return;
        /* Closing lets the kernel finish unregistering a removed device. */
        log_info("rdma: %s closed", d->name);
        LIST_REMOVE(devices, t->devices, d);
        device_free(d);
}

static int device_get(RdmaTransport *t, const char *name, RdmaDevice **ret) {
        struct ibv_device **list;
        RdmaDevice *d;
        unsigned n_mr = 0;
        int n = 0, r;

        LIST_FOREACH(devices, x, t->devices)
                if (!x->dead && strcmp(x->name, name) == 0) {
                        *ret = x;
                        return 0;
                }
        d = calloc(1, sizeof *d);
        if (!d)
                return -ENOMEM;
        d->t = t;
        snprintf(d->name, sizeof d->name, "%s", name);
        list = ibv_get_device_list(&n);
        for (int i = 0; list && i < n; i++)
                if (strcmp(ibv_get_device_name(list[i]), name) == 0) {
                        d->ctx = ibv_open_device(list[i]);
                        r = d->ctx ? 0 : -errno;
                        break;
                }
        if (list)
                ibv_free_device_list(list);
        if (!d->ctx) {
                device_free(d);
                return -ENODEV;
        }
        d->pd = ibv_alloc_pd(d->ctx);
        d->channel = d->pd ? ibv_create_comp_channel(d->ctx) : NULL;
        if (!d->channel) {
                r = -errno;
                device_free(d);
                return r ?: -EIO;
        }
        r = fd_prepare(d->channel->fd);
        if (r >= 0)
                r = fd_prepare(d->ctx->async_fd);
        if (r >= 0)
                r = sd_event_add_io(t->event, &d->comp_source, d->channel->fd, EPOLLIN, on_comp, d);
        if (r >= 0)
                r = sd_event_add_io(t->event, &d->async_source, d->ctx->async_fd, EPOLLIN, on_async, d);
        for (size_t i = 0; r >= 0 && i < MAX_REGIONS; i++)
                if (t->regions[i]) {
                        r = mr_register(d, t->regions[i]);
                        n_mr++;
                }
        if (r < 0) {
                device_free(d);
                return r;
        }
        LIST_PREPEND(devices, t->devices, d);
        watch_devices(t);
        log_info("rdma: opened %s: one protection domain, %u host arena(s) registered", d->name, n_mr);
        *ret = d;
        return 0;
}

/* ---- peers ---- */

static const char *rp_name(RdmaPeer *rp) {
        return rp->t->peers_ops.name(rp->peer);
}

static RdmaPeer *peer_find(RdmaTransport *t, Peer *p) {
        LIST_FOREACH(peers, rp, t->peers)
                if (rp->peer == p)
                        return rp;
        return NULL;
}

static RdmaPeer *peer_get(RdmaTransport *t, Peer *p) {
        RdmaPeer *rp = peer_find(t, p);

        if (rp)
                return rp;
        rp = calloc(1, sizeof *rp);
        if (!rp)
                return NULL;
        rp->t = t;
        rp->peer = p;
        rp->next_write_id = 1;
        rdma_session_init(&rp->s, MAX_OUTSTANDING);
        rp->out = hashmap_new(HASHMAP_KEY_U64, 0);
        rp->in = hashmap_new(HASHMAP_KEY_U64, 0);
        if (!rp->out || !rp->in) {
                hashmap_free(rp->out);
                hashmap_free(rp->in);
                free(rp);
                return NULL;
        }
        LIST_PREPEND(peers, t->peers, rp);
        return rp;
}

static bool local_ok(RdmaPeer *rp, RdmaLink *link) {
        RdmaTransport *t = rp->t;
        RdmaLink l;
        char src[64];

        if (!t->lookup || t->lookup(rp->peer, link ?: &l, src, sizeof src, t->topology) < 0)
                return false;
        /* A device that died stays unusable until discovery no longer lists it. */
        LIST_FOREACH(devices, d, t->devices)
                if (d->dead && strcmp(d->name, (link ?: &l)->device) == 0)
                        return false;
        return true;
}

static void send_msg(RdmaPeer *rp, const RdmaMessage *m) {
        uint8_t buf[RDMA_PROTO_MAX_PAYLOAD];
        int n = rdma_message_encode(m, buf, sizeof buf);

        if (n < 0) {
                log_error("rdma: peer %s: cannot encode message 0x%04x", rp_name(rp), m->type);
                return;
        }
        /* Failing to queue ends the peer's session; the state handler cleans up. */
        (void)rp->t->peers_ops.send(rp->peer, (uint16_t)m->type, buf, (size_t)n);
}

static void send_ack(RdmaPeer *rp, uint64_t write_id, int error) {
        send_msg(rp, &(RdmaMessage){ .type = RDMA_MSG_ACK, .ack = { .write_id = write_id, .error = (uint32_t)-error } });
}

/* Picks the RoCE v2 GID of the port on `netdev` that carries the route's source
 * address (IPv4-mapped), else the first RoCE v2 GID on it, else the discovered one. */
static int choose_gid(RdmaPeer *rp, const char *src) {
        struct ibv_port_attr pa;
        struct in_addr a4 = {};
        unsigned ifindex = if_nametoindex(rp->link.netdev);
        bool have_src = src && inet_pton(AF_INET, src, &a4) == 1;
        int best = -1, any = -1;

        if (ibv_query_port(rp->dev->ctx, rp->link.port, &pa) != 0)
                return -errno;
        if (pa.link_layer != IBV_LINK_LAYER_ETHERNET)
                return -EPROTONOSUPPORT; /* InfiniBand needs LIDs, which are not exchanged */
        rp->mtu = pa.active_mtu;
        for (int i = 0; i < pa.gid_tbl_len && i < 256; i++) {
                struct ibv_gid_entry e;
                const uint8_t *g = e.gid.raw;
                if (ibv_query_gid_ex(rp->dev->ctx, rp->link.port, (uint32_t)i, &e, 0) != 0)
                        continue;
                if (e.gid_type != IBV_GID_TYPE_ROCE_V2 || (ifindex && e.ndev_ifindex != ifindex))
                        continue;
                if (any < 0)
                        any = i;
                bool v4 = !g[0] && !g[1] && !g[2] && !g[3] && !g[4] && !g[5] && !g[6] && !g[7] && !g[8] && !g[9] &&
                          g[10] == 0xff && g[11] == 0xff;
                if (v4 && best < 0 && (!have_src || memcmp(g + 12, &a4, 4) == 0))
                        best = i;
        }
        rp->gid_index = best >= 0 ? best : any >= 0 ? any : rp->link.gid_index;
        if (ibv_query_gid(rp->dev->ctx, rp->link.port, rp->gid_index, &rp->gid) != 0)
                return -errno;
        return 0;
}

static int post_recvs(RdmaPeer *rp) {
        while (rp->recvs < RQ_DEPTH) {
                /* WRITE_WITH_IMM consumes a receive without payload: no scatter list. */
                struct ibv_recv_wr wr = { .wr_id = WR_RECV_FLAG }, *bad;
                int r = ibv_post_recv(rp->qp, &wr, &bad);
                if (r != 0)
                        return -r;
                rp->recvs++;
        }
        return 0;
}

static int create_qp(RdmaPeer *rp) {
        RdmaTransport *t = rp->t;
        char src[64] = "";
        int r;

        if (!t->lookup || t->lookup(rp->peer, &rp->link, src, sizeof src, t->topology) < 0)
                return -ENETUNREACH;
        r = device_get(t, rp->link.device, &rp->dev);
        if (r < 0)
                return r;
        rp->dev->users++;
        r = choose_gid(rp, src);
        if (r < 0)
                return r;
        rp->cq = ibv_create_cq(rp->dev->ctx, (int)(SQ_DEPTH + RQ_DEPTH), rp, rp->dev->channel, 0);
        if (!rp->cq)
                return -errno;
        if (ibv_req_notify_cq(rp->cq, 0) != 0)
                return -EIO;
        struct ibv_qp_init_attr qa = {
                .send_cq = rp->cq,
                .recv_cq = rp->cq,
                .cap = { .max_send_wr = SQ_DEPTH, .max_recv_wr = RQ_DEPTH, .max_send_sge = 1, .max_recv_sge = 1 },
                .qp_type = IBV_QPT_RC,
        };
        rp->qp = ibv_create_qp(rp->dev->pd, &qa);
        if (!rp->qp)
                return -errno;
        struct ibv_qp_attr a = {
                .qp_state = IBV_QPS_INIT,
                .port_num = rp->link.port,
                .qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
        };
        r = ibv_modify_qp(rp->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
        if (r != 0)
                return -r;
        if (getrandom(&rp->psn, sizeof rp->psn, 0) != sizeof rp->psn)
                rp->psn = (uint32_t)now_usec(CLOCK_MONOTONIC);
        rp->psn &= 0xffffff;
        rp->recvs = 0;
        r = post_recvs(rp);
        if (r < 0)
                return r;
        log_info("rdma: peer %s: RC QP %u on %s port %u (GID index %d, MTU %d)", rp_name(rp),
                 rp->qp->qp_num, rp->dev->name, rp->link.port, rp->gid_index, 128 << rp->mtu);
        return 0;
}

static int connect_qp(RdmaPeer *rp) {
        struct ibv_qp_attr a = {
                .qp_state = IBV_QPS_RTR,
                .path_mtu = MIN(rp->mtu, (enum ibv_mtu)rp->r_mtu),
                .dest_qp_num = rp->r_qpn,
                .rq_psn = rp->r_psn,
                .max_dest_rd_atomic = 1,
                .min_rnr_timer = 12,
                .ah_attr = {
                        .is_global = 1,
                        .grh = { .sgid_index = (uint8_t)rp->gid_index, .hop_limit = 64 },
                        .port_num = rp->link.port,
                },
        };
        int r;

        if (!rp->qp)
                return -ENOTCONN;
        memcpy(a.ah_attr.grh.dgid.raw, rp->r_gid, 16);
        r = ibv_modify_qp(rp->qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                              IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
        if (r != 0)
                return -r;
        a = (struct ibv_qp_attr){
                .qp_state = IBV_QPS_RTS,
                .timeout = QP_TIMEOUT,
                .retry_cnt = QP_RETRY,
                .rnr_retry = 7,
                .sq_psn = rp->psn,
                .max_rd_atomic = 1,
        };
        r = ibv_modify_qp(rp->qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                              IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC);
        if (r != 0)
                return -r;
        log_info("rdma: peer %s: QP %u connected to %s QP %u: writes to this peer go over RDMA", rp_name(rp),
                 rp->qp->qp_num, rp->r_device, rp->r_qpn);
        return 0;
}

static void out_write_free(RdmaPeer *rp, OutWrite *w) {
        if (w->sw.queued)
                slice_queue_remove(&rp->queue, &w->sw);
        free(w);
}

static void complete_write(RdmaPeer *rp, OutWrite *w, int error) {
        hashmap_remove(rp->out, &w->write_id);
        if (error == 0) {
                rp->bytes += w->sw.length;
                rp->writes++;
        }
        complete(rp->t, w->cookie, error, error ? 0 : w->sw.length);
        out_write_free(rp, w);
}

/* Destroys the QP and CQ (no byte moves through them afterwards), then fails every
 * write both ways. */
static void finalize(RdmaPeer *rp) {
        RdmaTransport *t = rp->t;
        int error = rp->fail_error ?: -ECONNRESET;
        size_t i = 0;
        void *v;

        rp->drain_timer = sd_event_source_disable_unref(rp->drain_timer);
        if (rp->qp && ibv_destroy_qp(rp->qp) != 0)
                log_warning("rdma: peer %s: ibv_destroy_qp failed", rp_name(rp));
        rp->qp = NULL;
        if (rp->cq && ibv_destroy_cq(rp->cq) != 0)
                log_warning("rdma: peer %s: ibv_destroy_cq failed", rp_name(rp));
        rp->cq = NULL;
        rp->recvs = 0;
        if (rp->dev) {
                RdmaDevice *d = rp->dev;
                rp->dev = NULL;
                device_put(d);
        }
        while (hashmap_iterate(rp->out, &i, &v, NULL)) {
                OutWrite *w = v;
                complete(t, w->cookie, error, 0);
                free(w);
        }
        hashmap_clear(rp->out);
        rp->queue = (SliceQueue){};
        i = 0;
        while (hashmap_iterate(rp->in, &i, &v, NULL)) {
                InWrite *w = v;
                t->peers_ops.incoming_done(t->peers_ops.userdata, rp->peer, w->cookie, error);
                free(w);
        }
        hashmap_clear(rp->in);
        rp->fail_error = 0;
}

static int on_drain_timeout(sd_event_source *s, uint64_t usec, void *userdata) {
        RdmaPeer *rp = userdata;

        log_warning("rdma: peer %s: %u work request(s) not flushed after %llu ms; destroying the QP",
                    rp_name(rp), rp->s.outstanding, (unsigned long long)(DRAIN_TIMEOUT_USEC / USEC_PER_MSEC));
        rp->s.outstanding = 0;
        run(rp, RDMA_ACT_FINALIZE);
        return 0;
}

static void fault(RdmaPeer *rp, RdmaFault f, int error, const char *reason) {
        if (!rp->fail_error)
                rp->fail_error = error;
        run(rp, rdma_session_fault(&rp->s, f, reason));
}

/* Performs the actions of a session transition, in their order. */
static void run(RdmaPeer *rp, unsigned a) {
        RdmaTransport *t = rp->t;
        int r;

        if (a & RDMA_ACT_QP_ERROR) {
                if (rp->qp) {
                        struct ibv_qp_attr qa = { .qp_state = IBV_QPS_ERR };
                        r = ibv_modify_qp(rp->qp, &qa, IBV_QP_STATE);
                        if (r != 0)
                                log_warning("rdma: peer %s: cannot move QP %u to the error state: %s",
                                            rp_name(rp), rp->qp->qp_num, strerror(r));
                }
                if (!(a & RDMA_ACT_FINALIZE) && !rp->drain_timer)
                        (void)sd_event_add_time_relative(t->event, &rp->drain_timer, CLOCK_MONOTONIC,
                                                         DRAIN_TIMEOUT_USEC, 0, on_drain_timeout, rp);
        }
        if (a & RDMA_ACT_SEND_DOWN) {
                RdmaMessage m = { .type = RDMA_MSG_DOWN, .down = { .error = ENODEV } };
                snprintf(m.down.reason, sizeof m.down.reason, "%.*s", (int)RDMA_PROTO_REASON_MAX, rp->s.failure);
                for (char *c = m.down.reason; *c; c++)
                        if (*c < 0x20 || *c > 0x7e)
                                *c = '?';
                send_msg(rp, &m);
        }
        if (a & RDMA_ACT_FINALIZE) {
                finalize(rp);
                run(rp, rdma_session_finalized(&rp->s, local_ok(rp, NULL)));
                a &= ~(unsigned)RDMA_ACT_CHANGED; /* the nested run reported it */
        }
        if (a & RDMA_ACT_CREATE_QP) {
                r = create_qp(rp);
                if (r < 0) {
                        char why[RDMA_FAILURE_MAX];
                        snprintf(why, sizeof why, "cannot set up a queue pair on %s: %s", rp->link.device,
                                 strerror(-r));
                        log_warning("rdma: peer %s: %s; using tcp", rp_name(rp), why);
                        fault(rp, RDMA_FAULT_LOCAL, -ENODEV, why);
                        return;
                }
        }
        if (a & RDMA_ACT_SEND_CONNECT) {
                RdmaMessage m = { .type = RDMA_MSG_CONNECT };
                m.connect.have_rdma = true;
                m.connect.port = rp->link.port;
                m.connect.mtu = (uint8_t)rp->mtu;
                m.connect.gid_index = (uint8_t)rp->gid_index;
                m.connect.qpn = rp->qp->qp_num;
                m.connect.psn = rp->psn;
                memcpy(m.connect.gid, rp->gid.raw, 16);
                snprintf(m.connect.device, sizeof m.connect.device, "%s", rp->dev->name);
                send_msg(rp, &m);
        }
        if (a & RDMA_ACT_SEND_NONE)
                send_msg(rp, &(RdmaMessage){ .type = RDMA_MSG_CONNECT });
        if (a & RDMA_ACT_CONNECT_QP) {
                r = connect_qp(rp);
                if (r < 0) {
                        char why[RDMA_FAILURE_MAX];
                        snprintf(why, sizeof why, "cannot connect the queue pair on %s: %s", rp->link.device,
                                 strerror(-r));
                        log_warning("rdma: peer %s: %s; using tcp", rp_name(rp), why);
                        fault(rp, RDMA_FAULT_LOCAL, -ENODEV, why);
                        return;
                }
        }
        if (a & RDMA_ACT_RECONNECT) {
                log_warning("rdma: peer %s: queue pair failed; reconnecting the peer", rp_name(rp));
                rp->t->peers_ops.stream_failed(rp->peer, -EIO, "RDMA queue pair failed");
        }
        if ((a & RDMA_ACT_CHANGED) && t->changed)
                t->changed(t->topology);
}

/* ---- data path ---- */

static void pump(RdmaPeer *rp) {
        while (rdma_session_can_post(&rp->s)) {
                Slice sl;
                OutWrite *w;
                struct ibv_mr *mr;

                if (!slice_queue_next(&rp->queue, &sl))
                        break;
                w = (OutWrite *)sl.write;
                mr = rp->dev->mrs[w->src->id];
                struct ibv_sge sge = {
                        .addr = (uintptr_t)w->src->host_base + w->src_offset + sl.offset,
                        .length = (uint32_t)sl.length,
                        .lkey = mr->lkey,
                };
                struct ibv_send_wr wr = {
                        .wr_id = w->write_id,
                        .sg_list = &sge,
                        .num_sge = 1,
                        /* The last slice carries the write id: the receiver's completion
                         * of it comes after every earlier slice landed (RC order). */
                        .opcode = sl.last ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE,
                        .send_flags = IBV_SEND_SIGNALED,
                        .imm_data = htonl((uint32_t)w->write_id),
                        .wr.rdma = { .remote_addr = w->raddr + sl.offset, .rkey = w->rkey },
                }, *bad;
                int r = ibv_post_send(rp->qp, &wr, &bad);
                if (r != 0) {
                        log_warning("rdma: peer %s: ibv_post_send: %s", rp_name(rp), strerror(r));
                        fault(rp, RDMA_FAULT_WR, -EIO, NULL);
                        return;
                }
                w->wrs++;
                rdma_session_wr_posted(&rp->s);
        }
}

static void protocol_error(RdmaPeer *rp, const char *what) {
        log_warning("rdma: peer %s: %s; resetting the session", rp_name(rp), what);
        fault(rp, RDMA_FAULT_WR, -EBADMSG, NULL);
}

static void on_send_wc(RdmaPeer *rp, const struct ibv_wc *wc) {
        uint64_t id = wc->wr_id;
        OutWrite *w = hashmap_get(rp->out, &id);
        unsigned a;

        if (w && w->wrs > 0)
                w->wrs--;
        a = rdma_session_wr_done(&rp->s);
        if (wc->status != IBV_WC_SUCCESS) {
                if (rp->s.state != RDMA_SESSION_DRAINING)
                        log_warning("rdma: peer %s: RDMA WRITE failed: %s (vendor error 0x%x)", rp_name(rp),
                                    ibv_wc_status_str(wc->status), wc->vendor_err);
                if (rp->s.state != RDMA_SESSION_DRAINING)
                        fault(rp, RDMA_FAULT_WR, wc->status == IBV_WC_RETRY_EXC_ERR ? -ETIMEDOUT : -EIO, NULL);
        } else if (w && w->acked && w->wrs == 0)
                complete_write(rp, w, 0);
        if (a)
                run(rp, a);
        else if (rp->s.state == RDMA_SESSION_READY)
                pump(rp);
}

static void on_recv_wc(RdmaPeer *rp, const struct ibv_wc *wc) {
        RdmaTransport *t = rp->t;
        InWrite *w;
        uint64_t id;

        if (rp->recvs > 0)
                rp->recvs--;
        if (wc->status != IBV_WC_SUCCESS) {
                if (rp->s.state != RDMA_SESSION_DRAINING && wc->status != IBV_WC_WR_FLUSH_ERR) {
                        log_warning("rdma: peer %s: receive failed: %s", rp_name(rp),
                                    ibv_wc_status_str(wc->status));
                        fault(rp, RDMA_FAULT_WR, -EIO, NULL);
                }
                return;
        }
        if (wc->opcode != IBV_WC_RECV_RDMA_WITH_IMM || !(wc->wc_flags & IBV_WC_WITH_IMM)) {
                protocol_error(rp, "a receive completion without an immediate");
                return;
        }
        id = ntohl(wc->imm_data);
        w = hashmap_remove(rp->in, &id);
        if (!w) {
                protocol_error(rp, "an immediate for a write that was never granted");
                return;
        }
        rp->bytes_in += w->length;
        t->peers_ops.incoming_done(t->peers_ops.userdata, rp->peer, w->cookie, 0);
        send_ack(rp, w->write_id, 0);
        free(w);
        if (rp->s.state == RDMA_SESSION_READY && rp->qp && post_recvs(rp) < 0)
                fault(rp, RDMA_FAULT_WR, -EIO, NULL);
}

static void peer_poll(RdmaPeer *rp) {
        struct ibv_cq *cq = rp->cq;

        rp->t->peers_ops.cork(rp->peer);
        while (cq && rp->cq == cq) {
                struct ibv_wc wc[32];
                int n = ibv_poll_cq(cq, ELEMENTSOF(wc), wc);
                if (n <= 0) {
                        if (n < 0)
                                fault(rp, RDMA_FAULT_WR, -EIO, NULL);
                        break;
                }
                for (int i = 0; i < n && rp->cq == cq; i++) {
                        if (wc[i].wr_id & WR_RECV_FLAG)
                                on_recv_wc(rp, wc + i);
                        else
                                on_send_wc(rp, wc + i);
                }
        }
        rp->t->peers_ops.uncork(rp->peer);
}

static int on_comp(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        RdmaDevice *d = userdata;
        struct ibv_cq *cq;
        void *ctx;

        while (ibv_get_cq_event(d->channel, &cq, &ctx) == 0) {
                RdmaPeer *rp = ctx;
                ibv_ack_cq_events(cq, 1);
                if (rp->cq != cq)
                        continue;
                (void)ibv_req_notify_cq(cq, 0);
                peer_poll(rp);
        }
        return 0;
}

/* The device `d` (or its port `port`, 0: all) is gone: every peer on it drains and
 * falls back to tcp, visibly. */
static void device_lost(RdmaDevice *d, uint8_t port, const char *what) {
        RdmaTransport *t = d->t;
        char why[RDMA_FAILURE_MAX];

        if (port == 0) {
                d->dead = true;
                /* The fds may report errors from now on. */
                (void)sd_event_source_set_enabled(d->async_source, SD_EVENT_OFF);
        }
        d->users++; /* held across the loop: finalize may drop the last user */
        LIST_FOREACH(peers, rp, t->peers) {
                if (rp->dev != d || (port && rp->link.port != port))
                        continue;
                if (port)
                        snprintf(why, sizeof why, "%s port %u: %s", d->name, port, what);
                else
                        snprintf(why, sizeof why, "%s: %s", d->name, what);
                log_warning("rdma: peer %s: %s; falling back to tcp", rp_name(rp), why);
                fault(rp, RDMA_FAULT_LOCAL, -ENODEV, why);
        }
        device_put(d);
        if (t->changed)
                t->changed(t->topology);
}

static int on_async(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        RdmaDevice *d = userdata;
        RdmaTransport *t = d->t;
        struct ibv_async_event ev;

        while (!d->dead && ibv_get_async_event(d->ctx, &ev) == 0) {
                enum ibv_event_type type = ev.event_type;
                struct ibv_qp *qp = ev.element.qp;
                int port = ev.element.port_num;

                /* Acknowledged first: destroying the QP waits for its events' acks. */
                ibv_ack_async_event(&ev);
                log_info("rdma: %s: async event %s", d->name, ibv_event_type_str(type));
                switch (type) {
                case IBV_EVENT_DEVICE_FATAL:
                        device_lost(d, 0, "IBV_EVENT_DEVICE_FATAL");
                        return 0; /* d may be gone */
                case IBV_EVENT_PORT_ERR:
                        device_lost(d, (uint8_t)port, "port went down (IBV_EVENT_PORT_ERR)");
                        break;
                case IBV_EVENT_PORT_ACTIVE:
                case IBV_EVENT_GID_CHANGE:
                        if (t->changed)
                                t->changed(t->topology);
                        break;
                case IBV_EVENT_QP_FATAL:
                case IBV_EVENT_QP_REQ_ERR:
                case IBV_EVENT_QP_ACCESS_ERR:
                        LIST_FOREACH(peers, rp, t->peers)
                                if (rp->qp == qp && rp->s.state != RDMA_SESSION_DRAINING) {
                                        log_warning("rdma: peer %s: %s", rp_name(rp), ibv_event_type_str(type));
                                        fault(rp, RDMA_FAULT_WR, -EIO, NULL);
                                }
                        break;
                default:
                        break;
                }
        }
        if (!d->dead && (revents & (EPOLLERR | EPOLLHUP)))
                device_lost(d, 0, "its event fd failed");
        return 0;
}

/* /dev/infiniband changed: a device whose verbs node went away is gone (soft-RoCE has
 * no fatal event for `rdma link delete`; the kernel waits for us to close it). */
static int on_inotify(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        RdmaTransport *t = userdata;
        uint8_t buf[4096];
        struct ibv_device **list;
        int n = 0;

        while (read(fd, buf, sizeof buf) > 0)
                ;
        list = ibv_get_device_list(&n);
        LIST_FOREACH_SAFE(devices, d, next, t->devices) {
                bool found = false;
                if (d->dead)
                        continue;
                for (int i = 0; list && i < n; i++)
                        if (strcmp(ibv_get_device_name(list[i]), d->name) == 0)
                                found = true;
                if (!found)
                        device_lost(d, 0, "device removed");
        }
        if (list)
                ibv_free_device_list(list);
        if (t->changed)
                t->changed(t->topology);
        return 0;
}

/* Watches /dev/infiniband (from the start, or once a device is first opened: the
 * directory appears with the first verbs device). */
static void watch_devices(RdmaTransport *t) {
        int r;

        if (t->inotify_source)
                return;
        if (t->inotify_fd < 0)
                t->inotify_fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
        if (t->inotify_fd < 0 || inotify_add_watch(t->inotify_fd, "/dev/infiniband", IN_CREATE | IN_DELETE) < 0) {
                log_debug("rdma: not watching /dev/infiniband (yet): %m");
                return;
        }
        r = sd_event_add_io(t->event, &t->inotify_source, t->inotify_fd, EPOLLIN, on_inotify, t);
        if (r < 0)
                log_warning_errno(r, "rdma: cannot watch /dev/infiniband, a removed device is noticed only by its events: %m");
}

/* ---- control messages ---- */

static void on_request(RdmaPeer *rp, const RdmaMessage *m) {
        RdmaTransport *t = rp->t;
        const TransportRegion *reg = m->request.region < MAX_REGIONS ? t->regions[m->request.region] : NULL;
        struct ibv_mr *mr = reg && rp->dev ? rp->dev->mrs[reg->id] : NULL;
        uint64_t id = m->request.write_id, end;
        InWrite *w;
        int r;

        if (rp->s.state != RDMA_SESSION_READY)
                r = -ENOTCONN;
        else if (!mr)
                r = -ENXIO;
        else if (ADD_OVERFLOW(m->request.offset, m->request.length, &end) || end > reg->size)
                r = -ERANGE;
        else if (hashmap_size(rp->in) >= PEER_INCOMING_MAX)
                r = -EBUSY;
        else if (hashmap_contains(rp->in, &id)) {
                protocol_error(rp, "a write id requested twice");
                return;
        } else
                /* Asked once per write, before the peer may write a byte of it. */
                r = t->peers_ops.validate_incoming(t->peers_ops.userdata, rp->peer, m->request.region, m->request.offset,
                                                   m->request.length, m->request.cookie);
        if (r < 0) {
                log_debug_errno(r, "rdma: peer %s: refused write %llu (region %u, %llu+%llu): %m", rp_name(rp),
                                (unsigned long long)id, m->request.region, (unsigned long long)m->request.offset,
                                (unsigned long long)m->request.length);
                send_ack(rp, id, r);
                return;
        }
        w = calloc(1, sizeof *w);
        if (w)
                *w = (InWrite){ .write_id = id, .cookie = m->request.cookie, .length = m->request.length };
        /* The map keeps a pointer to the key: the one inside w. */
        if (!w || hashmap_put(rp->in, &w->write_id, w) < 0) {
                free(w);
                t->peers_ops.incoming_done(t->peers_ops.userdata, rp->peer, m->request.cookie, -ENOMEM);
                send_ack(rp, id, -ENOMEM);
                return;
        }
        send_msg(rp, &(RdmaMessage){
                             .type = RDMA_MSG_GRANT,
                             .grant = { .write_id = id,
                                        .region = m->request.region,
                                        .rkey = mr->rkey,
                                        .addr = (uintptr_t)reg->host_base + m->request.offset,
                                        .length = m->request.length },
                     });
}

static void on_grant(RdmaPeer *rp, const RdmaMessage *m) {
        uint64_t id = m->grant.write_id;
        OutWrite *w = hashmap_get(rp->out, &id);

        if (!w || w->granted || m->grant.length != w->sw.length || m->grant.region != w->dst_region) {
                protocol_error(rp, "a grant that matches no request");
                return;
        }
        w->granted = true;
        w->rkey = m->grant.rkey;
        w->raddr = m->grant.addr;
        slice_queue_push(&rp->queue, &w->sw);
        pump(rp);
}

static void on_ack(RdmaPeer *rp, const RdmaMessage *m) {
        uint64_t id = m->ack.write_id;
        OutWrite *w = hashmap_get(rp->out, &id);

        if (!w) {
                protocol_error(rp, "an acknowledgement for an unknown write");
                return;
        }
        if (m->ack.error) {
                if (w->granted) {
                        protocol_error(rp, "a refusal of a granted write");
                        return;
                }
                complete_write(rp, w, -(int)m->ack.error);
                return;
        }
        if (!w->granted || w->sw.next_offset < w->sw.length) {
                protocol_error(rp, "an acknowledgement before the write was sent");
                return;
        }
        w->acked = true;
        if (w->wrs == 0)
                complete_write(rp, w, 0);
}

static int on_message(Peer *p, uint16_t type, const void *payload, size_t len, void *userdata) {
        RdmaTransport *t = userdata;
        RdmaPeer *rp = peer_get(t, p);
        RdmaMessage m;
        int r;

        if (!rp)
                return -ENOMEM;
        r = rdma_message_decode(type, payload, len, &m);
        if (r == -EOPNOTSUPP)
                return 0; /* a later version's message */
        if (r < 0) {
                log_warning("rdma: peer %s: malformed message 0x%04x", t->peers_ops.name(p), type);
                t->peers_ops.stream_failed(p, -EBADMSG, "malformed RDMA message");
                return r;
        }
        switch (m.type) {
        case RDMA_MSG_CONNECT:
                if (m.connect.have_rdma) {
                        rp->r_qpn = m.connect.qpn;
                        rp->r_psn = m.connect.psn;
                        rp->r_mtu = m.connect.mtu;
                        memcpy(rp->r_gid, m.connect.gid, 16);
                        snprintf(rp->r_device, sizeof rp->r_device, "%s", m.connect.device);
                } else
                        rp->r_device[0] = 0;
                if (!m.connect.have_rdma && rp->s.state != RDMA_SESSION_IDLE && !rp->fail_error)
                        rp->fail_error = -ENETDOWN;
                run(rp, rdma_session_remote(&rp->s, m.connect.have_rdma, local_ok(rp, NULL)));
                break;
        case RDMA_MSG_DOWN: {
                char why[RDMA_FAILURE_MAX];
                snprintf(why, sizeof why, "the peer stopped RDMA: %.120s", m.down.reason);
                log_warning("rdma: peer %s: %s; falling back to tcp", t->peers_ops.name(p), why);
                fault(rp, RDMA_FAULT_REMOTE, -ENETDOWN, why);
                break;
        }
        case RDMA_MSG_REQUEST:
                on_request(rp, &m);
                break;
        case RDMA_MSG_GRANT:
                on_grant(rp, &m);
                break;
        case RDMA_MSG_ACK:
                on_ack(rp, &m);
                break;
        }
        return 0;
}

static void on_peer_state(Peer *p, bool up, void *userdata) {
        RdmaTransport *t = userdata;
        RdmaPeer *rp = peer_get(t, p);

        if (!rp) {
                log_error("rdma: peer %s: out of memory; it uses tcp", t->peers_ops.name(p));
                return;
        }
        if (up)
                run(rp, rdma_session_peer_up(&rp->s, local_ok(rp, NULL)));
        else
                fault(rp, RDMA_FAULT_PEER_DOWN, -ECONNRESET, NULL);
}

/* ---- the vtable ---- */

static int rdma_register_region(Transport *tt, TransportRegion *r) {
        RdmaTransport *t = rdma(tt);

        if (!r || r->id >= MAX_REGIONS)
                return -EINVAL;
        if (r->domain != MEMORY_HOST || !r->host_base)
                /* GPU arenas (ibv_reg_dmabuf_mr, or staging through pinned host memory)
                 * are not wired: handoffs use host arenas (docs/rdma.md). */
                return -EOPNOTSUPP;
        if (t->regions[r->id] && t->regions[r->id] != r)
                return -EEXIST;
        t->regions[r->id] = r;
        LIST_FOREACH(devices, d, t->devices)
                if (!d->dead)
                        (void)mr_register(d, r);
        return 0;
}

static void rdma_unregister_region(Transport *tt, TransportRegion *r) {
        RdmaTransport *t = rdma(tt);

        if (!r || r->id >= MAX_REGIONS || t->regions[r->id] != r)
                return;
        LIST_FOREACH(devices, d, t->devices)
                if (d->mrs[r->id]) {
                        (void)ibv_dereg_mr(d->mrs[r->id]);
                        d->mrs[r->id] = NULL;
                }
        t->regions[r->id] = NULL;
}

static int rdma_post(Transport *tt, void *peer, const TransportWrite *w, size_t n) {
        RdmaTransport *t = rdma(tt);
        Peer *p = peer;
        RdmaPeer *rp;
        uint64_t *ids;

        if (!p || (!w && n > 0) || n > MAX_POST)
                return -EINVAL;
        rp = peer_find(t, p);
        if (!rp || rp->s.state != RDMA_SESSION_READY || !t->peers_ops.is_up(p))
                return -ENOTCONN;
        if (hashmap_size(rp->out) + n > MAX_OUT_WRITES)
                return -ENOBUFS;
        for (size_t i = 0; i < n; i++) {
                const TransportRegion *src = w[i].src_region < MAX_REGIONS ? t->regions[w[i].src_region] : NULL;
                uint64_t end;

                if (!src || !rp->dev->mrs[src->id])
                        return -ENXIO;
                if (w[i].length == 0 || ADD_OVERFLOW(w[i].src_offset, w[i].length, &end) || end > src->size ||
                    ADD_OVERFLOW(w[i].dst_offset, w[i].length, &end))
                        return -EINVAL;
        }
        ids = calloc(MAX(n, (size_t)1), sizeof *ids);
        if (!ids)
                return -ENOMEM;
        for (size_t i = 0; i < n; i++) {
                OutWrite *o = calloc(1, sizeof *o);
                int r = o ? 0 : -ENOMEM;

                if (o) {
                        (void)slice_write_init(&o->sw, w[i].length, t->slice_size);
                        do
                                o->write_id = rp->next_write_id++;
                        while (o->write_id == 0 || hashmap_contains(rp->out, &o->write_id));
                        o->cookie = w[i].cookie;
                        o->src = t->regions[w[i].src_region];
                        o->src_offset = w[i].src_offset;
                        o->dst_region = w[i].dst_region;
                        o->dst_offset = w[i].dst_offset;
                        r = hashmap_put(rp->out, &o->write_id, o);
                        if (r < 0)
                                free(o);
                }
                if (r < 0) {
                        /* All or nothing. */
                        for (size_t k = 0; k < i; k++)
                                free(hashmap_remove(rp->out, &ids[k]));
                        free(ids);
                        return r;
                }
                ids[i] = o->write_id;
        }
        /* From here every write completes through the completion fd, also if the
         * session ends while the requests go out. */
        t->peers_ops.cork(p);
        for (size_t i = 0; i < n && rp->s.state == RDMA_SESSION_READY; i++) {
                OutWrite *o = hashmap_get(rp->out, &ids[i]);
                if (!o)
                        continue;
                send_msg(rp, &(RdmaMessage){
                                     .type = RDMA_MSG_REQUEST,
                                     .request = { .write_id = o->write_id,
                                                  .cookie = o->cookie,
                                                  .region = o->dst_region,
                                                  .offset = o->dst_offset,
                                                  .length = o->sw.length },
                             });
        }
        t->peers_ops.uncork(p);
        free(ids);
        t->base.stats.batches++;
        return 0;
}

static int rdma_completion_fd(Transport *tt) {
        return rdma(tt)->efd;
}

static size_t rdma_poll(Transport *tt, TransportCompletion *c, size_t n) {
        RdmaTransport *t = rdma(tt);
        return transport_done_take(&t->done, t->efd, c, n);
}

static void rdma_cancel_peer(Transport *tt, void *peer) {
        RdmaPeer *rp = peer ? peer_find(rdma(tt), peer) : NULL;

        /* As for tcp: ending the session is what guarantees that nothing lands. */
        if (rp && rp->s.state != RDMA_SESSION_IDLE)
                fault(rp, RDMA_FAULT_WR, -ECANCELED, NULL);
}

static void rdma_free(Transport *tt) {
        RdmaTransport *t;

        if (!tt)
                return;
        t = rdma(tt);
        while (t->peers) {
                RdmaPeer *rp = t->peers;
                size_t i = 0;
                void *v;

                sd_event_source_disable_unref(rp->drain_timer);
                if (rp->qp)
                        (void)ibv_destroy_qp(rp->qp);
                if (rp->cq)
                        (void)ibv_destroy_cq(rp->cq);
                while (hashmap_iterate(rp->out, &i, &v, NULL))
                        free(v);
                i = 0;
                while (hashmap_iterate(rp->in, &i, &v, NULL))
                        free(v);
                hashmap_free(rp->out);
                hashmap_free(rp->in);
                LIST_REMOVE(peers, t->peers, rp);
                free(rp);
        }
        while (t->devices) {
                RdmaDevice *d = t->devices;
                LIST_REMOVE(devices, t->devices, d);
                device_free(d);
        }
        sd_event_source_disable_unref(t->inotify_source);
        safe_close(t->inotify_fd);
        safe_close(t->efd);
        free(t->done.items);
        sd_event_unref(t->event);
        free(t);
}

static const TransportOps rdma_ops = {
        .kind = TRANSPORT_RDMA,
        .name = "rdma",
        .register_region = rdma_register_region,
        .unregister_region = rdma_unregister_region,
        .post = rdma_post,
        .completion_fd = rdma_completion_fd,
        .poll = rdma_poll,
        .cancel_peer = rdma_cancel_peer,
        .free = rdma_free,
};

int rdma_transport_new(Transport **ret, sd_event *e, const TransportPeerOps *peers, uint32_t slice_size) {
        RdmaTransport *t;
        int r;

        if (slice_size < PEER_SLICE_MIN || slice_size > PEER_SLICE_MAX)
                return -EINVAL;
        t = calloc(1, sizeof *t);
        if (!t)
                return -ENOMEM;
        t->base.ops = &rdma_ops;
        t->event = sd_event_ref(e);
        t->peers_ops = *peers;
        t->slice_size = MIN(slice_size, MAX_SLICE);
        t->inotify_fd = -EBADF;
        t->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (t->efd < 0) {
                r = -errno;
                rdma_free(&t->base);
                return r;
        }
        watch_devices(t);
        r = peers->register_handler(peers->userdata, RDMA_MSG_FIRST, RDMA_MSG_LAST, on_message, t);
        if (r >= 0)
                r = peers->add_state_handler(peers->userdata, on_peer_state, t);
        if (r < 0) {
                rdma_free(&t->base);
                return r;
        }
        *ret = &t->base;
        return 0;
}

void rdma_transport_set_topology(Transport *tt, RdmaLinkLookup lookup, RdmaChanged changed, void *userdata) {
        RdmaTransport *t;

        if (!tt)
                return;
        t = rdma(tt);
        t->lookup = lookup;
        t->changed = changed;
        t->topology = userdata;
}

void rdma_transport_links_changed(Transport *tt) {
        RdmaTransport *t;

        if (!tt)
                return;
        t = rdma(tt);
        LIST_FOREACH(peers, rp, t->peers) {
                RdmaLink l;
                bool ok = local_ok(rp, &l);
                /* The QP's device must still be the one on the route. */
                if (ok && rp->dev && strcmp(l.device, rp->dev->name) != 0)
                        ok = false;
                if (!ok && (rp->s.state == RDMA_SESSION_OFFERED || rp->s.state == RDMA_SESSION_READY))
                        log_warning("rdma: peer %s: the route no longer leaves through an ACTIVE port of %s; "
                                    "falling back to tcp", rp_name(rp), rp->dev ? rp->dev->name : "?");
                run(rp, rdma_session_local_ok(&rp->s, ok));
        }
}

void rdma_transport_peer_info(Transport *tt, Peer *p, RdmaPeerInfo *info) {
        RdmaPeer *rp = tt ? peer_find(rdma(tt), p) : NULL;

        memset(info, 0, sizeof *info);
        if (!rp)
                return;
        info->announced = rp->s.remote_announced;
        info->remote_rdma = rp->s.remote_rdma;
        info->ready = rp->s.state == RDMA_SESSION_READY;
        info->state = rdma_session_state_to_string(rp->s.state);
        snprintf(info->device, sizeof info->device, "%s", rp->r_device);
        snprintf(info->failure, sizeof info->failure, "%s", rp->s.failure);
        info->bytes = rp->bytes;
        info->writes = rp->writes;
}

bool rdma_transport_peer_ready(Transport *tt, Peer *p) {
        RdmaPeer *rp = tt ? peer_find(rdma(tt), p) : NULL;
        return rp && rp->s.state == RDMA_SESSION_READY;
}
