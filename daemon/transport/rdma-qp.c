/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "transport/rdma-internal.h"

/* ---- peers ---- */

RdmaPeer *rdma_peer_find(RdmaTransport *t, Peer *p) {
        LIST_FOREACH(peers, rp, t->peers)
                if (rp->peer == p)
                        return rp;
        return NULL;
}

RdmaPeer *rdma_peer_get(RdmaTransport *t, Peer *p) {
        RdmaPeer *rp = rdma_peer_find(t, p);

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

bool rdma_local_ok(RdmaPeer *rp, RdmaLink *link) {
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

void rdma_send_msg(RdmaPeer *rp, const RdmaMessage *m) {
        uint8_t buf[RDMA_PROTO_MAX_PAYLOAD];
        int n = rdma_message_encode(m, buf, sizeof buf);

        if (n < 0) {
                log_error("rdma: peer %s: cannot encode message 0x%04x", rp_name(rp), m->type);
                return;
        }
        /* Failing to queue ends the peer's session (peer_send_core(), on the loop's next
         * turn); the state handler then fails every write of the session. */
        (void)rp->t->peers_ops.send(rp->peer, (uint16_t)m->type, buf, (size_t)n);
}

void rdma_send_ack(RdmaPeer *rp, uint64_t write_id, int error) {
        rdma_send_msg(rp, &(RdmaMessage){ .type = RDMA_MSG_ACK, .ack = { .write_id = write_id, .error = (uint32_t)-error } });
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

int rdma_post_recvs(RdmaPeer *rp) {
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
        r = rdma_device_get(t, rp->link.device, &rp->dev);
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
        r = rdma_post_recvs(rp);
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

void rdma_complete_write(RdmaPeer *rp, OutWrite *w, int error) {
        hashmap_remove(rp->out, &w->write_id);
        if (error == 0) {
                rp->bytes += w->sw.length;
                rp->writes++;
        }
        rdma_complete(rp->t, w->cookie, error, error ? 0 : w->sw.length);
        out_write_free(rp, w);
}

/* Destroys the QP and CQ (no byte moves through them afterwards), then fails every
 * write both ways. */
void rdma_finalize(RdmaPeer *rp) {
        RdmaTransport *t = rp->t;
        int error = rp->fail_error ?: -ECONNRESET;
        size_t i = 0;
        void *v;

        rp->drain_timer = sd_event_source_disable_unref(rp->drain_timer);
        rp->write_watch = sd_event_source_disable_unref(rp->write_watch);
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
                rdma_device_put(d);
        }
        while (hashmap_iterate(rp->out, &i, &v, NULL)) {
                OutWrite *w = v;
                rdma_complete(t, w->cookie, error, 0);
                free(w);
        }
        hashmap_clear(rp->out);
        rp->queue = (SliceQueue){};
        i = 0;
        while (hashmap_iterate(rp->in, &i, &v, NULL)) {
                InWrite *w = v;
                t->peers_ops.incoming_done(t->peers_ops.userdata, rp->peer,
                                           &(TransportIncoming){ .cookie = w->cookie, .length = w->length }, error);
                free(w);
        }
        hashmap_clear(rp->in);
        rp->fail_error = 0;
}

/* The write watch, on the sending side: writes out and no progress since the check
 * before, twice in a row, fail the queue pair (finalize fails every write both ways; the
 * peer reconnects). With no write left, the watch stops. (The receiving side cannot
 * watch: the bytes of a granted write arrive without its CPU seeing them, and the first
 * completion may come only once every granted write is nearly across.) */
static int on_write_watch(sd_event_source *s, uint64_t usec, void *userdata) {
        RdmaPeer *rp = userdata;
        size_t out = hashmap_size(rp->out);

        /* No write left, or the queue pair already failing (a drain bounds itself, and a
         * fault now would reset the peer's whole session at the drain's end). */
        if (out == 0 || rp->s.state != RDMA_SESSION_READY) {
                rp->write_watch = sd_event_source_disable_unref(rp->write_watch);
                rp->idle_checks = 0;
                return 0;
        }
        if (rp->progress != rp->seen) {
                rp->seen = rp->progress;
                rp->idle_checks = 0;
        } else if (++rp->idle_checks >= 2) {
                char why[RDMA_FAILURE_MAX];
                snprintf(why, sizeof why, "%zu write(s) out made no progress for %llu s", out,
                         (unsigned long long)(2 * WRITE_WATCH_USEC / USEC_PER_SEC));
                log_warning("rdma: peer %s: %s; failing the queue pair", rp_name(rp), why);
                rp->write_watch = sd_event_source_disable_unref(rp->write_watch);
                rp->idle_checks = 0;
                rdma_fault(rp, RDMA_FAULT_WR, -ETIMEDOUT, why);
                return 0;
        }
        if (sd_event_source_set_time_relative(s, WRITE_WATCH_USEC) < 0 ||
            sd_event_source_set_enabled(s, SD_EVENT_ONESHOT) < 0)
                rp->write_watch = sd_event_source_disable_unref(rp->write_watch);
        return 0;
}

void rdma_write_watch(RdmaPeer *rp) {
        if (rp->write_watch)
                return;
        rp->seen = rp->progress;
        rp->idle_checks = 0;
        if (sd_event_add_time_relative(rp->t->event, &rp->write_watch, CLOCK_MONOTONIC, WRITE_WATCH_USEC,
                                       USEC_PER_SEC, on_write_watch, rp) < 0)
                log_debug("rdma: peer %s: cannot arm the write watch", rp_name(rp));
}

static int on_drain_timeout(sd_event_source *s, uint64_t usec, void *userdata) {
        RdmaPeer *rp = userdata;

        log_warning("rdma: peer %s: %u work request(s) not flushed after %llu ms; destroying the QP",
                    rp_name(rp), rp->s.outstanding, (unsigned long long)(DRAIN_TIMEOUT_USEC / USEC_PER_MSEC));
        rp->s.outstanding = 0;
        rdma_run(rp, RDMA_ACT_FINALIZE);
        return 0;
}

void rdma_fault(RdmaPeer *rp, RdmaFault f, int error, const char *reason) {
        if (!rp->fail_error)
                rp->fail_error = error;
        rdma_run(rp, rdma_session_fault(&rp->s, f, reason));
}

/* Performs the actions of a session transition, in their order. */
/* This side cannot use its device for p: p goes over tcp, and says why. */
static void local_failure(RdmaPeer *rp, const char *what, int error) {
        char why[RDMA_FAILURE_MAX];
        snprintf(why, sizeof why, "%s on %s: %s", what, rp->link.device, strerror(-error));
        log_warning("rdma: peer %s: %s; using tcp", rp_name(rp), why);
        rdma_fault(rp, RDMA_FAULT_LOCAL, -ENODEV, why);
}

void rdma_run(RdmaPeer *rp, unsigned a) {
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
                rdma_send_msg(rp, &m);
        }
        if (a & RDMA_ACT_FINALIZE) {
                rdma_finalize(rp);
                rdma_run(rp, rdma_session_finalized(&rp->s, rdma_local_ok(rp, NULL)));
                a &= ~(unsigned)RDMA_ACT_CHANGED; /* the nested run reported it */
        }
        if (a & RDMA_ACT_CREATE_QP) {
                r = create_qp(rp);
                if (r < 0) {
                        local_failure(rp, "cannot set up a queue pair", r);
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
                rdma_send_msg(rp, &m);
        }
        if (a & RDMA_ACT_SEND_NONE)
                rdma_send_msg(rp, &(RdmaMessage){ .type = RDMA_MSG_CONNECT });
        if (a & RDMA_ACT_CONNECT_QP) {
                r = connect_qp(rp);
                if (r < 0) {
                        local_failure(rp, "cannot connect the queue pair", r);
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
