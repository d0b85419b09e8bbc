/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "transport/rdma-internal.h"

RdmaTransport *rdma_of(Transport *t) {
        return container_of(t, RdmaTransport, base);
}


void rdma_complete(RdmaTransport *t, uint64_t cookie, int error, uint64_t bytes) {
        transport_done_push(&t->base, &t->done, t->efd, cookie, error, bytes);
}

int rdma_fd_prepare(int fd) {
        int fl = fcntl(fd, F_GETFL);
        if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0)
                return -errno;
        return 0;
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
                        rdma_fault(rp, RDMA_FAULT_WR, -EIO, NULL);
                        return;
                }
                w->wrs++;
                rdma_session_wr_posted(&rp->s);
        }
}

static void protocol_error(RdmaPeer *rp, const char *what) {
        log_warning("rdma: peer %s: %s; resetting the session", rp_name(rp), what);
        rdma_fault(rp, RDMA_FAULT_WR, -EBADMSG, NULL);
}

static void on_send_wc(RdmaPeer *rp, const struct ibv_wc *wc) {
        uint64_t id = wc->wr_id;
        OutWrite *w = hashmap_get(rp->out, &id);
        unsigned a;

        rp->progress++;
        if (w && w->wrs > 0)
                w->wrs--;
        a = rdma_session_wr_done(&rp->s);
        if (wc->status != IBV_WC_SUCCESS) {
                if (rp->s.state != RDMA_SESSION_DRAINING)
                        log_warning("rdma: peer %s: RDMA WRITE failed: %s (vendor error 0x%x)", rp_name(rp),
                                    ibv_wc_status_str(wc->status), wc->vendor_err);
                if (rp->s.state != RDMA_SESSION_DRAINING)
                        rdma_fault(rp, RDMA_FAULT_WR, wc->status == IBV_WC_RETRY_EXC_ERR ? -ETIMEDOUT : -EIO, NULL);
        } else if (w && w->acked && w->wrs == 0)
                rdma_complete_write(rp, w, 0);
        if (a)
                rdma_run(rp, a);
        else if (rp->s.state == RDMA_SESSION_READY)
                pump(rp);
}

static void on_recv_wc(RdmaPeer *rp, const struct ibv_wc *wc) {
        RdmaTransport *t = rp->t;
        InWrite *w;
        uint64_t id;

        rp->progress++;
        if (rp->recvs > 0)
                rp->recvs--;
        if (wc->status != IBV_WC_SUCCESS) {
                if (rp->s.state != RDMA_SESSION_DRAINING && wc->status != IBV_WC_WR_FLUSH_ERR) {
                        log_warning("rdma: peer %s: receive failed: %s", rp_name(rp),
                                    ibv_wc_status_str(wc->status));
                        rdma_fault(rp, RDMA_FAULT_WR, -EIO, NULL);
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
        t->peers_ops.incoming_done(t->peers_ops.userdata, rp->peer,
                                   &(TransportIncoming){ .cookie = w->cookie, .length = w->length }, 0);
        rdma_send_ack(rp, w->write_id, 0);
        free(w);
        if (rp->s.state == RDMA_SESSION_READY && rp->qp && rdma_post_recvs(rp) < 0)
                rdma_fault(rp, RDMA_FAULT_WR, -EIO, NULL);
}

static void peer_poll(RdmaPeer *rp) {
        struct ibv_cq *cq = rp->cq;

        rp->t->peers_ops.cork(rp->peer);
        while (cq && rp->cq == cq) {
                struct ibv_wc wc[32];
                int n = ibv_poll_cq(cq, ELEMENTSOF(wc), wc);
                if (n <= 0) {
                        if (n < 0)
                                rdma_fault(rp, RDMA_FAULT_WR, -EIO, NULL);
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

int rdma_on_comp(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        RdmaDevice *d = userdata;
        struct ibv_cq *cq;
        void *ctx;

        /* Held across the loop: a dead device's last flushed completion finalizes its
         * last peer, whose put would otherwise free d (and its channel) under us. */
        d->users++;
        while (ibv_get_cq_event(d->channel, &cq, &ctx) == 0) {
                RdmaPeer *rp = ctx;
                ibv_ack_cq_events(cq, 1);
                if (rp->cq != cq)
                        continue;
                (void)ibv_req_notify_cq(cq, 0);
                peer_poll(rp);
        }
        rdma_device_put(d);
        return 0;
}

/* The device `d` (or its port `port`, 0: all) is gone: every peer on it drains and
 * falls back to tcp, visibly. */
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
                r = t->peers_ops.validate_incoming(t->peers_ops.userdata, rp->peer,
                                                   &(TransportIncoming){ .region = m->request.region,
                                                                         .offset = m->request.offset,
                                                                         .length = m->request.length,
                                                                         .cookie = m->request.cookie,
                                                                         .flags = m->request.attempt
                                                                                          ? TRANSPORT_WRITE_ATTEMPT
                                                                                          : 0,
                                                                         .target = m->request.attempt });
        if (r == -EAGAIN)
                r = -EPROTO; /* rdma writes name real regions: there is nothing to wait for */
        if (r < 0) {
                log_debug_errno(r, "rdma: peer %s: refused write %llu (region %u, %llu+%llu): %m", rp_name(rp),
                                (unsigned long long)id, m->request.region, (unsigned long long)m->request.offset,
                                (unsigned long long)m->request.length);
                rdma_send_ack(rp, id, r);
                return;
        }
        w = calloc(1, sizeof *w);
        if (w)
                *w = (InWrite){ .write_id = id, .cookie = m->request.cookie, .length = m->request.length };
        /* The map keeps a pointer to the key: the one inside w. */
        if (!w || hashmap_put(rp->in, &w->write_id, w) < 0) {
                free(w);
                t->peers_ops.incoming_done(t->peers_ops.userdata, rp->peer,
                                           &(TransportIncoming){ .cookie = m->request.cookie }, -ENOMEM);
                rdma_send_ack(rp, id, -ENOMEM);
                return;
        }
        rdma_send_msg(rp, &(RdmaMessage){
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
        rp->progress++;
        w->granted = true;
        w->rkey = m->grant.rkey;
        w->raddr = m->grant.addr;
        slice_queue_push(&rp->queue, &w->sw);
        pump(rp);
}

static void on_ack(RdmaPeer *rp, const RdmaMessage *m) {
        uint64_t id = m->ack.write_id;
        OutWrite *w = hashmap_get(rp->out, &id);

        rp->progress++;
        if (!w) {
                protocol_error(rp, "an acknowledgement for an unknown write");
                return;
        }
        if (m->ack.error) {
                if (w->granted) {
                        protocol_error(rp, "a refusal of a granted write");
                        return;
                }
                rdma_complete_write(rp, w, -(int)m->ack.error);
                return;
        }
        if (!w->granted || w->sw.next_offset < w->sw.length) {
                protocol_error(rp, "an acknowledgement before the write was sent");
                return;
        }
        w->acked = true;
        if (w->wrs == 0)
                rdma_complete_write(rp, w, 0);
}

static int on_message(Peer *p, uint16_t type, const void *payload, size_t len, void *userdata) {
        RdmaTransport *t = userdata;
        RdmaPeer *rp = rdma_peer_get(t, p);
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
                rdma_run(rp, rdma_session_remote(&rp->s, m.connect.have_rdma, rdma_local_ok(rp, NULL)));
                break;
        case RDMA_MSG_DOWN: {
                char why[RDMA_FAILURE_MAX];
                snprintf(why, sizeof why, "the peer stopped RDMA: %.120s", m.down.reason);
                log_warning("rdma: peer %s: %s; falling back to tcp", t->peers_ops.name(p), why);
                rdma_fault(rp, RDMA_FAULT_REMOTE, -ENETDOWN, why);
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
        RdmaPeer *rp = rdma_peer_get(t, p);

        if (!rp) {
                log_error("rdma: peer %s: out of memory; it uses tcp", t->peers_ops.name(p));
                return;
        }
        if (up) {
                /* A new session: an error left by a fault of the last one that never
                 * reached a finalize (the peer went down while idle) is not this one's. */
                if (rp->s.state == RDMA_SESSION_IDLE)
                        rp->fail_error = 0;
                rdma_run(rp, rdma_session_peer_up(&rp->s, rdma_local_ok(rp, NULL)));
        } else
                rdma_fault(rp, RDMA_FAULT_PEER_DOWN, -ECONNRESET, NULL);
}

/* ---- the vtable ---- */

static int rdma_register_region(Transport *tt, TransportRegion *r) {
        RdmaTransport *t = rdma_of(tt);

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
                        (void)rdma_mr_register(d, r);
        return 0;
}

static void rdma_unregister_region(Transport *tt, TransportRegion *r) {
        RdmaTransport *t = rdma_of(tt);

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
        RdmaTransport *t = rdma_of(tt);
        Peer *p = peer;
        RdmaPeer *rp;
        uint64_t *ids;

        if (!p || (!w && n > 0) || n > MAX_POST)
                return -EINVAL;
        rp = rdma_peer_find(t, p);
        if (!rp || rp->s.state != RDMA_SESSION_READY || !t->peers_ops.is_up(p))
                return -ENOTCONN;
        if (hashmap_size(rp->out) + n > MAX_OUT_WRITES)
                return -ENOBUFS;
        for (size_t i = 0; i < n; i++) {
                const TransportRegion *src = w[i].src_region < MAX_REGIONS ? t->regions[w[i].src_region] : NULL;
                if ((w[i].flags & ~TRANSPORT_WRITE_ATTEMPT) || ((w[i].flags & TRANSPORT_WRITE_ATTEMPT) && !w[i].target))
                        return -EOPNOTSUPP; /* writes name real regions, completions carry nothing */
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

                if (o && slice_write_init(&o->sw, w[i].length, t->slice_size) < 0) {
                        free(o);
                        o = NULL;
                        r = -EINVAL; /* more slices than a write may have */
                }
                if (o) {
                        do
                                o->write_id = rp->next_write_id++;
                        while (o->write_id == 0 || hashmap_contains(rp->out, &o->write_id));
                        o->cookie = w[i].cookie;
                        o->src = t->regions[w[i].src_region];
                        o->src_offset = w[i].src_offset;
                        o->dst_region = w[i].dst_region;
                        o->dst_offset = w[i].dst_offset;
                        o->attempt = w[i].flags & TRANSPORT_WRITE_ATTEMPT ? w[i].target : 0;
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
        rdma_write_watch(rp);
        t->peers_ops.cork(p);
        for (size_t i = 0; i < n && rp->s.state == RDMA_SESSION_READY; i++) {
                OutWrite *o = hashmap_get(rp->out, &ids[i]);
                if (!o)
                        continue;
                rdma_send_msg(rp, &(RdmaMessage){
                                     .type = RDMA_MSG_REQUEST,
                                     .request = { .write_id = o->write_id,
                                                  .cookie = o->cookie,
                                                  .region = o->dst_region,
                                                  .offset = o->dst_offset,
                                                  .length = o->sw.length,
                                                  .attempt = o->attempt },
                             });
        }
        t->peers_ops.uncork(p);
        free(ids);
        t->base.stats.batches++;
        return 0;
}

static int rdma_completion_fd(Transport *tt) {
        return rdma_of(tt)->efd;
}

static size_t rdma_poll(Transport *tt, TransportCompletion *c, size_t n) {
        RdmaTransport *t = rdma_of(tt);
        return transport_done_take(&t->done, t->efd, c, n);
}

static void rdma_cancel_peer(Transport *tt, void *peer) {
        RdmaPeer *rp = peer ? rdma_peer_find(rdma_of(tt), peer) : NULL;

        /* As for tcp: ending the session is what guarantees that nothing lands. */
        if (rp && rp->s.state != RDMA_SESSION_IDLE)
                rdma_fault(rp, RDMA_FAULT_WR, -ECANCELED, NULL);
}

static void rdma_free(Transport *tt) {
        RdmaTransport *t;

        if (!tt)
                return;
        t = rdma_of(tt);
        while (t->peers) {
                RdmaPeer *rp = t->peers;
                size_t i = 0;
                void *v;

                sd_event_source_disable_unref(rp->drain_timer);
                sd_event_source_disable_unref(rp->write_watch);
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
                rdma_device_free(d);
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
        .caps = TRANSPORT_CAP_ATTEMPT,
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
        rdma_watch_devices(t);
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
        t = rdma_of(tt);
        t->lookup = lookup;
        t->changed = changed;
        t->topology = userdata;
}

void rdma_transport_links_changed(Transport *tt) {
        RdmaTransport *t;

        if (!tt)
                return;
        t = rdma_of(tt);
        LIST_FOREACH(peers, rp, t->peers) {
                RdmaLink l;
                bool ok = rdma_local_ok(rp, &l);
                /* The QP's device must still be the one on the route. */
                if (ok && rp->dev && strcmp(l.device, rp->dev->name) != 0)
                        ok = false;
                if (!ok && (rp->s.state == RDMA_SESSION_OFFERED || rp->s.state == RDMA_SESSION_READY))
                        log_warning("rdma: peer %s: the route no longer leaves through an ACTIVE port of %s; "
                                    "falling back to tcp", rp_name(rp), rp->dev ? rp->dev->name : "?");
                rdma_run(rp, rdma_session_local_ok(&rp->s, ok));
        }
}

void rdma_transport_peer_info(Transport *tt, Peer *p, RdmaPeerInfo *info) {
        RdmaPeer *rp = tt ? rdma_peer_find(rdma_of(tt), p) : NULL;

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
        RdmaPeer *rp = tt ? rdma_peer_find(rdma_of(tt), p) : NULL;
        return rp && rp->s.state == RDMA_SESSION_READY;
}
