/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "transport/rdma-internal.h"

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

/* ---- devices ---- */

static int on_async(sd_event_source *s, int fd, uint32_t revents, void *userdata);

int rdma_mr_register(RdmaDevice *d, TransportRegion *r) {
        if (d->mrs[r->id])
                return 0;
        d->mrs[r->id] = ibv_reg_mr(d->pd, r->host_base, r->size,
                                   IBV_ACCESS_LOCAL_WRITE | (r->source_only ? 0 : IBV_ACCESS_REMOTE_WRITE));
        if (!d->mrs[r->id])
                return log_warning_errno(errno, "rdma: %s: cannot register arena %u (%llu bytes): %m", d->name,
                                         r->id, (unsigned long long)r->size);
        return 0;
}

RdmaDevice *rdma_device_free(RdmaDevice *d) {
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

void rdma_device_put(RdmaDevice *d) {
        RdmaTransport *t = d->t;

        assert(d->users > 0);
        if (--d->users > 0 || !d->dead)
                return;
        /* Closing lets the kernel finish unregistering a removed device. */
        log_info("rdma: %s closed", d->name);
        LIST_REMOVE(devices, t->devices, d);
        rdma_device_free(d);
}

int rdma_device_get(RdmaTransport *t, const char *name, RdmaDevice **ret) {
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
                rdma_device_free(d);
                return -ENODEV;
        }
        d->pd = ibv_alloc_pd(d->ctx);
        d->channel = d->pd ? ibv_create_comp_channel(d->ctx) : NULL;
        if (!d->channel) {
                r = -errno;
                rdma_device_free(d);
                return r ?: -EIO;
        }
        r = rdma_fd_prepare(d->channel->fd);
        if (r >= 0)
                r = rdma_fd_prepare(d->ctx->async_fd);
        if (r >= 0)
                r = sd_event_add_io(t->event, &d->comp_source, d->channel->fd, EPOLLIN, rdma_on_comp, d);
        if (r >= 0)
                r = sd_event_add_io(t->event, &d->async_source, d->ctx->async_fd, EPOLLIN, on_async, d);
        for (size_t i = 0; r >= 0 && i < MAX_REGIONS; i++)
                if (t->regions[i]) {
                        r = rdma_mr_register(d, t->regions[i]);
                        n_mr++;
                }
        if (r < 0) {
                rdma_device_free(d);
                return r;
        }
        LIST_PREPEND(devices, t->devices, d);
        rdma_watch_devices(t);
        log_info("rdma: opened %s: one protection domain, %u host arena(s) registered", d->name, n_mr);
        *ret = d;
        return 0;
}

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
                rdma_fault(rp, RDMA_FAULT_LOCAL, -ENODEV, why);
        }
        rdma_device_put(d);
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
                                        rdma_fault(rp, RDMA_FAULT_WR, -EIO, NULL);
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
void rdma_watch_devices(RdmaTransport *t) {
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
