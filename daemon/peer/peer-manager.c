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
#include "peer/bus-peer.h"
#include "telemetry/telemetry-manager.h"

/* ---- the manager ---- */

static Peer *peer_free(Peer *p) {
        if (!p)
                return NULL;
        peer_conn_free(p->control);
        sd_event_source_disable_unref(p->reconnect_timer);
        sd_event_source_disable_unref(p->down_defer);
        sd_event_source_disable_unref(p->heartbeat_timer);
        free(p->name);
        free(p->host_id);
        free(p->address);
        free(p);
        return NULL;
}

PeerManager *peer_manager_free(PeerManager *pm) {
        if (!pm)
                return NULL;
        pm->started = false;
        while (pm->pending)
                peer_conn_free(pm->pending);
        /* A polite goodbye to every peer that is up; best effort. */
        for (size_t i = 0; i < pm->n_peers; i++) {
                Peer *p = pm->peers[i];
                if (p->state == PEER_UP) {
                        PeerReason pr = { .reason = PEER_FAIL_SHUTDOWN };
                        uint8_t buf[4];
                        (void)peer_reason_encode(&pr, buf, sizeof buf);
                        (void)peer_conn_queue(p->control, PEER_MSG_BYE, buf, sizeof buf);
                }
                p->control = peer_conn_free(p->control);
        }
        pm->flush = sd_event_source_disable_unref(pm->flush);
        if (pm->rdma)
                pm->rdma->ops->free(pm->rdma);
        if (pm->tcp)
                pm->tcp->ops->free(pm->tcp);
        for (size_t i = 0; i < pm->n_peers; i++)
                peer_free(pm->peers[i]);
        free(pm->peers);
        hashmap_free(pm->by_host_id);
        peer_notes_done(pm);
        sd_event_source_disable_unref(pm->listen_source);
        safe_close(pm->listen_fd);
        peer_auth_key_free(pm->key);
        free(pm->handlers);
        free(pm->state_handlers);
        free(pm->host_id);
        free(pm->listen_address);
        sd_event_unref(pm->event);
        free(pm);
        return NULL;
}

DEFINE_TRIVIAL_CLEANUP_FUNC(PeerManager *, peer_manager_free);

/* What the transports (tcp, rdma) need from the peer layer: transport-peer.h. */
static void **op_slot(Peer *p, TransportKind kind) {
        return &p->transport_state[kind];
}

static int op_validate_incoming(void *userdata, Peer *p, TransportIncoming *in) {
        return peer_manager_validate_incoming(userdata, p, in);
}

static void op_incoming_done(void *userdata, Peer *p, const TransportIncoming *in, int error) {
        peer_manager_incoming_done(userdata, p, in, error);
}

static int op_register_handler(void *userdata, uint16_t first, uint16_t last, TransportPeerMessageFn fn,
                               void *fn_userdata) {
        return peer_manager_register_handler(userdata, first, last, fn, fn_userdata);
}

static int op_add_state_handler(void *userdata, TransportPeerStateFn fn, void *fn_userdata) {
        return peer_manager_add_state_handler(userdata, fn, fn_userdata);
}

static const TransportPeerOps transport_peer_ops = {
        .name = peer_name,
        .is_up = peer_is_up,
        .slot = op_slot,
        .send = peer_send_core,
        .cork = peer_cork,
        .uncork = peer_uncork,
        .flush_control = peer_flush_control,
        .stream_failed = peer_stream_failed,
        .validate_incoming = op_validate_incoming,
        .incoming_done = op_incoming_done,
        .register_handler = op_register_handler,
        .add_state_handler = op_add_state_handler,
};

/* A new peer in pm->peers and pm->by_host_id. */
static int peer_new(PeerManager *pm, const char *name, const char *host_id, const char *address, Peer **ret) {
        Peer **np, *p;
        int r;

        if (hashmap_contains(pm->by_host_id, host_id))
                return -EEXIST;
        np = reallocarray(pm->peers, pm->n_peers + 1, sizeof *np);
        if (!np)
                return -ENOMEM;
        pm->peers = np;
        p = calloc(1, sizeof *p);
        if (!p)
                return -ENOMEM;
        p->pm = pm;
        p->name = strdup(name);
        p->host_id = strdup(host_id);
        p->address = strdup(address);
        if (!p->name || !p->host_id || !p->address) {
                peer_free(p);
                return -ENOMEM;
        }
        if (peer_address_parse(p->address, &p->sa, &p->sa_len) < 0) {
                peer_free(p);
                return -EINVAL;
        }
        p->dialer = strcmp(pm->host_id, p->host_id) < 0;
        r = hashmap_put(pm->by_host_id, p->host_id, p);
        if (r < 0) {
                peer_free(p);
                return r;
        }
        pm->peers[pm->n_peers++] = p;
        if (ret)
                *ret = p;
        return 0;
}

int peer_manager_config_verify(const PeerManagerConfig *c, PeerAuthKey **ret_key) {
        _cleanup_(peer_auth_key_freep) PeerAuthKey *key = NULL;
        struct sockaddr_storage sa;
        unsigned sl;
        int r;

        if (c->n_peers == 0 && !c->listen_address)
                return 0;
        if (!c->cluster_key_file)
                return log_error_errno(EINVAL, "peer: [Cluster] ClusterKeyFile= is required with peers and Listen=");
        const char *why = NULL;
        r = peer_auth_key_load(c->cluster_key_file, &key, &why);
        if (r < 0) {
                if (why)
                        return log_error_errno(r, "peer: cannot load the cluster key %s: %s", c->cluster_key_file,
                                               why);
                return log_error_errno(r, "peer: cannot load the cluster key %s: %m", c->cluster_key_file);
        }
        if (c->listen_address && peer_address_parse(c->listen_address, &sa, &sl) < 0)
                return log_error_errno(EINVAL, "peer: invalid [Cluster] Listen= '%s' (numeric host:port)",
                                       c->listen_address);
        for (size_t i = 0; i < c->n_peers; i++) {
                const PeerConfig *pc = c->peers + i;

                if (!peer_host_id_is_valid(pc->host_id) || strcmp(pc->host_id, c->host_id) == 0)
                        return log_error_errno(EINVAL, "peer %s: invalid HostId= '%s'", pc->name,
                                               pc->host_id ? pc->host_id : "");
                if (!pc->address || peer_address_parse(pc->address, &sa, &sl) < 0)
                        return log_error_errno(EINVAL, "peer %s: invalid Address= '%s' (numeric host:port)",
                                               pc->name, pc->address ? pc->address : "");
                for (size_t j = 0; j < i; j++)
                        if (strcmp(c->peers[j].host_id, pc->host_id) == 0)
                                return log_error_errno(EEXIST, "peer %s: duplicate HostId= '%s'", pc->name,
                                                       pc->host_id);
        }
        if (ret_key)
                *ret_key = TAKE_PTR(key);
        return 0;
}

int peer_manager_new(PeerManager **ret, sd_event *e, const PeerManagerConfig *c) {
        _cleanup_(peer_manager_freep) PeerManager *pm = NULL;
        int r;

        if (!ret || !e || !c || !peer_host_id_is_valid(c->host_id))
                return -EINVAL;
        pm = calloc(1, sizeof *pm);
        if (!pm)
                return -ENOMEM;
        pm->listen_fd = -EBADF;
        pm->event = sd_event_ref(e);
        pm->host_id = strdup(c->host_id);
        if (!pm->host_id)
                return -ENOMEM;
        if (c->listen_address) {
                pm->listen_address = strdup(c->listen_address);
                if (!pm->listen_address)
                        return -ENOMEM;
        }
        pm->heartbeat_usec = c->heartbeat_usec ? c->heartbeat_usec : PEER_HEARTBEAT_DEFAULT_USEC;
        /* The range AUTH_OK carries (peer-proto.h), as HeartbeatInterval= is checked. */
        if (pm->heartbeat_usec < PEER_HEARTBEAT_MS_MIN * USEC_PER_MSEC ||
            pm->heartbeat_usec > (usec_t)PEER_HEARTBEAT_MS_MAX * USEC_PER_MSEC)
                return -EINVAL;
        pm->n_streams = c->n_streams ? c->n_streams : PEER_STREAMS_DEFAULT;
        if (pm->n_streams > PEER_MAX_STREAMS)
                return -EINVAL;
        pm->slice_size = c->slice_size ? c->slice_size : PEER_SLICE_DEFAULT;
        if (pm->slice_size < PEER_SLICE_MIN || pm->slice_size > PEER_SLICE_MAX)
                return -EINVAL;

        r = peer_manager_config_verify(c, &pm->key);
        if (r < 0)
                return r;

        pm->by_host_id = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!pm->by_host_id)
                return -ENOMEM;
        for (size_t i = 0; i < c->n_peers; i++) {
                const PeerConfig *pc = c->peers + i;

                r = peer_new(pm, pc->name ? pc->name : pc->host_id, pc->host_id, pc->address ? pc->address : "",
                             NULL);
                if (r == -EINVAL)
                        return log_error_errno(r, "peer %s: invalid Address= '%s' (numeric host:port)", pc->name,
                                               pc->address ? pc->address : "");
                if (r == -EEXIST)
                        return log_error_errno(r, "peer %s: duplicate HostId= '%s'", pc->name, pc->host_id);
                if (r < 0)
                        return r;
        }

        TransportPeerOps ops = transport_peer_ops;
        ops.userdata = pm;
        r = tcp_transport_new(&pm->tcp, e, &ops, pm->slice_size);
        if (r < 0)
                return r;
        /* Peers choose rdma per path (topology.c); without it everything is tcp. */
        r = rdma_transport_new(&pm->rdma, e, &ops, pm->slice_size);
        if (r < 0 && r != -EOPNOTSUPP)
                log_warning_errno(r, "peer: cannot start the RDMA transport, peers use tcp: %m");
        *ret = TAKE_PTR(pm);
        return 0;
}

int peer_manager_start(PeerManager *pm) {
        int r;

        if (pm->started)
                return 0;
        if (pm->listen_address) {
                struct sockaddr_storage sa;
                unsigned sl;
                int one = 1;
                _cleanup_(closep) int fd = -EBADF;

                if (peer_address_parse(pm->listen_address, &sa, &sl) < 0)
                        return log_error_errno(EINVAL, "peer: invalid [Cluster] Listen= '%s'", pm->listen_address);
                fd = socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, IPPROTO_TCP);
                if (fd < 0)
                        return log_error_errno(errno, "peer: socket: %m");
                (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
                if (bind(fd, (struct sockaddr *)&sa, sl) < 0)
                        return log_error_errno(errno, "peer: cannot listen on %s: %m", pm->listen_address);
                if (listen(fd, 128) < 0)
                        return log_error_errno(errno, "peer: listen: %m");
                r = sd_event_add_io(pm->event, &pm->listen_source, fd, EPOLLIN, peer_listen_io, pm);
                if (r < 0)
                        return r;
                pm->listen_fd = TAKE_FD(fd);
        }
        pm->started = true;
        for (size_t i = 0; i < pm->n_peers; i++) {
                Peer *p = pm->peers[i];
                if (!p->dialer)
                        continue;
                r = peer_dial(p, PEER_ROLE_CONTROL, 0);
                if (r < 0) {
                        peer_set_error(p, "connect", r);
                        peer_down(p, r, "connect failed");
                }
        }
        return 0;
}

int peer_manager_register_handler(PeerManager *pm, uint16_t first, uint16_t last,
                                  PeerMessageHandler h, void *userdata) {
        HandlerRange *n;

        if (!pm || !h || first > last || first <= PEER_MSG_CORE_LAST)
                return -EINVAL;
        for (size_t i = 0; i < pm->n_handlers; i++)
                if (first <= pm->handlers[i].last && last >= pm->handlers[i].first)
                        return -EEXIST;
        n = reallocarray(pm->handlers, pm->n_handlers + 1, sizeof *n);
        if (!n)
                return -ENOMEM;
        pm->handlers = n;
        pm->handlers[pm->n_handlers++] = (HandlerRange){ first, last, h, userdata };
        return 0;
}

int peer_manager_add_state_handler(PeerManager *pm, PeerStateHandler fn, void *userdata) {
        StateHandler *n;

        if (!pm || !fn)
                return -EINVAL;
        for (size_t i = 0; i < pm->n_state_handlers; i++)
                if (pm->state_handlers[i].fn == fn && pm->state_handlers[i].userdata == userdata)
                        return 0; /* subscribed already */
        n = reallocarray(pm->state_handlers, pm->n_state_handlers + 1, sizeof *n);
        if (!n)
                return -ENOMEM;
        pm->state_handlers = n;
        pm->state_handlers[pm->n_state_handlers++] = (StateHandler){ fn, userdata };
        return 0;
}

void peer_manager_set_incoming_validator(PeerManager *pm, PeerIncomingValidator fn, void *userdata) {
        pm->validator = fn;
        pm->validator_userdata = userdata;
}

void peer_manager_set_incoming_done(PeerManager *pm, PeerIncomingDone fn, void *userdata) {
        pm->done = fn;
        pm->done_userdata = userdata;
}

int peer_manager_validate_incoming(PeerManager *pm, Peer *p, TransportIncoming *in) {
        int r;

        /* Nothing lands without an owner that said yes. */
        if (!pm->validator)
                r = -EPERM;
        else
                r = pm->validator(p, in, pm->validator_userdata);
        if (r < 0 && r != -EAGAIN)
                p->stats.writes_refused++;
        return r < 0 ? r : 0;
}

void peer_manager_incoming_done(PeerManager *pm, Peer *p, const TransportIncoming *in, int error) {
        if (pm->done)
                pm->done(p, in, error, pm->done_userdata);
}

void peer_manager_resume_incoming(PeerManager *pm, Peer *p) {
        if (pm->tcp && pm->tcp->ops->resume_incoming)
                pm->tcp->ops->resume_incoming(pm->tcp, p);
}

Transport *peer_manager_transport(PeerManager *pm) {
        return pm ? pm->tcp : NULL;
}

Transport *peer_manager_rdma(PeerManager *pm) {
        return pm ? pm->rdma : NULL;
}

Transport *peer_manager_transport_for(PeerManager *pm, Peer *p) {
        if (!pm)
                return NULL;
        if (pm->rdma && rdma_transport_peer_ready(pm->rdma, p))
                return pm->rdma;
        return pm->tcp;
}

int peer_manager_add_member(PeerManager *pm, const char *host_id, const char *address, Peer **ret) {
        struct sockaddr_storage sa;
        unsigned sl;
        Peer *p;
        int r;

        if (!pm || !peer_host_id_is_valid(host_id) || !address || peer_address_parse(address, &sa, &sl) < 0)
                return -EINVAL;
        if (strcmp(host_id, pm->host_id) == 0)
                return -EEXIST;
        p = hashmap_get(pm->by_host_id, host_id);
        if (p && !p->member)
                return -EEXIST; /* a [Peer:NAME] section has it */
        if ((!p || p->retired) && pm->n_members >= PEER_MEMBERS_MAX)
                return -ENOSPC;
        if (!p) {
                if (pm->n_peers >= PEER_OBJECTS_MAX)
                        return -ENOSPC;
                r = peer_new(pm, host_id, host_id, address, &p);
                if (r < 0)
                        return r;
                p->member = true;
                p->retired = true; /* counted below, as one that comes back */
        }
        if (strcmp(p->address, address) != 0) {
                char *a = strdup(address);
                if (!a)
                        return -ENOMEM;
                free(p->address);
                p->address = a;
                p->sa = sa;
                p->sa_len = sl;
                log_info("peer %s: member address now %s", p->name, a);
        } else if (!p->retired) {
                if (ret)
                        *ret = p;
                return 0; /* known already */
        }
        if (p->retired)
                pm->n_members++;
        p->retired = false;
        p->backoff_usec = 0;
        if (pm->started && p->dialer && p->state == PEER_DOWN && !p->control) {
                r = peer_dial(p, PEER_ROLE_CONTROL, 0);
                if (r < 0) {
                        peer_set_error(p, "connect", r);
                        peer_down(p, r, "connect failed");
                }
        }
        if (ret)
                *ret = p;
        return 0;
}

int peer_manager_retire_member(PeerManager *pm, const char *host_id) {
        Peer *p = pm ? peer_manager_find(pm, host_id) : NULL;

        if (!p)
                return -ENOENT;
        if (!p->member)
                return -EPERM;
        if (p->retired)
                return 0;
        p->retired = true; /* first: peer_down() must not schedule a reconnect */
        pm->n_members--;
        (void)sd_event_source_set_enabled(p->reconnect_timer, SD_EVENT_OFF);
        peer_down(p, -EHOSTDOWN, "left the cluster membership");
        /* Its handshakes under way end too (peer_down() leaves a peer that is down
         * already alone): an AUTH arriving later would bring it up again. */
        LIST_FOREACH_SAFE(pending, c, n, pm->pending)
                if (c->peer == p)
                        peer_conn_free(c);
        return 0;
}

bool peer_is_member(Peer *p) {
        return p && p->member;
}

bool peer_is_retired(Peer *p) {
        return p && p->retired;
}

Peer *peer_manager_find(PeerManager *pm, const char *host_id) {
        if (!pm || !host_id)
                return NULL;
        return hashmap_get(pm->by_host_id, host_id);
}

Peer *peer_manager_peer(PeerManager *pm, size_t i) {
        return pm && i < pm->n_peers ? pm->peers[i] : NULL;
}

size_t peer_manager_n_peers(PeerManager *pm) {
        return pm ? pm->n_peers : 0;
}

const char *peer_manager_host_id(PeerManager *pm) {
        return pm->host_id;
}

usec_t peer_manager_heartbeat_usec(PeerManager *pm) {
        return pm->heartbeat_usec;
}

/* ---- subsystem glue ---- */

void peer_manager_set_heartbeat(PeerManager *pm, usec_t usec) {
        if (usec < PEER_HEARTBEAT_MS_MIN * USEC_PER_MSEC || usec > (usec_t)PEER_HEARTBEAT_MS_MAX * USEC_PER_MSEC)
                return;
        pm->heartbeat_usec = usec;
}

/* Kernel telemetry (daemon/telemetry/telemetry.h) of the control connection and the data
 * streams, keyed by peer: RTT, retransmits, queues, and backpressure from them. Streams
 * are tracked as they attach; everything of the peer is untracked when it goes down. */
static void peer_telemetry_hook(Manager *m, Peer *p, bool up) {
        /* By host id, as the handoff windows ask for their backpressure and as every
         * metric's `peer` label says (a [Peer:NAME] section may be named otherwise). */
        if (!up) {
                (void)telemetry_untrack_peer(m, peer_host_id(p));
                return;
        }
        int fd = peer_control_fd(p);
        if (fd >= 0)
                (void)telemetry_track_socket(m, fd, peer_host_id(p));
}

static void peer_stream_attached(Peer *p, int fd, void *userdata) {
        (void)telemetry_track_socket(userdata, fd, peer_host_id(p));
}

static void peer_state_changed(Peer *p, bool up, void *userdata) {
        Manager *m = userdata;

        peer_telemetry_hook(m, p, up);
}

static PeerManagerConfig peer_manager_config(const Config *c) {
        return (PeerManagerConfig){
                .host_id = c->host_id,
                .listen_address = c->listen_address,
                .peers = c->peers,
                .n_peers = c->n_peers,
                .cluster_key_file = c->cluster_key_file,
                .heartbeat_usec = c->heartbeat_usec,
                .n_streams = c->peer_streams,
                .slice_size = (uint32_t)c->peer_slice_size,
        };
}

static int peer_subsystem_verify(Manager *m) {
        PeerManagerConfig pc = peer_manager_config(&m->config);
        return peer_manager_config_verify(&pc, NULL);
}

static int peer_subsystem_init(Manager *m) {
        const Config *c = &m->config;
        PeerManagerConfig pc = peer_manager_config(c);
        PeerManager *pm;
        int r;

        /* Off until configured: a single host has no peer manager at all. */
        if (c->n_peers == 0 && !c->listen_address)
                return 0;
        r = peer_manager_new(&pm, m->event, &pc);
        if (r < 0)
                return log_error_errno(r, "peer: cannot set up the peer manager: %m");
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (a->domain != MEMORY_HOST)
                        continue; /* GPU memory goes over the cuda/rdma paths */
                r = pm->tcp->ops->register_region(pm->tcp, &a->region);
                if (r >= 0 && pm->rdma)
                        r = pm->rdma->ops->register_region(pm->rdma, &a->region);
                if (r < 0) {
                        peer_manager_free(pm);
                        return log_error_errno(r, "peer: cannot register arena %s: %m", a->name);
                }
        }
        pm->stream_attached = peer_stream_attached;
        pm->stream_attached_userdata = m;
        r = peer_manager_add_state_handler(pm, peer_state_changed, m);
        if (r < 0) {
                peer_manager_free(pm);
                return r;
        }
        m->peers = pm;
        return peer_manager_start(pm);
}

static void peer_subsystem_done(Manager *m) {
        m->peers = peer_manager_free(m->peers);
}

static int peer_subsystem_reload(Manager *m, const Config *n) {
        int k = 0;

        /* Peers, addresses and the key take a restart; the heartbeat bound applies now. */
        if (m->peers && n->heartbeat_usec != peer_manager_heartbeat_usec(m->peers)) {
                peer_manager_set_heartbeat(m->peers, n->heartbeat_usec);
                manager_emit_changed(m, PEER_OBJECT_PATH, PEER_INTERFACE, "HeartbeatUSec");
        }
        /* A new key in the same file (a rotation) is a change too: the path comparison of
         * config_restart_notices() does not see it. */
        if (m->peers && m->peers->key && n->cluster_key_file && m->config.cluster_key_file &&
            strcmp(n->cluster_key_file, m->config.cluster_key_file) == 0) {
                _cleanup_(peer_auth_key_freep) PeerAuthKey *key = NULL;
                if (peer_auth_key_load(n->cluster_key_file, &key, NULL) >= 0 &&
                    !peer_auth_key_equal(key, m->peers->key)) {
                        log_notice("The cluster key in %s changed: it takes effect at the next restart (the running "
                                   "key stays in use).", n->cluster_key_file);
                        k++;
                }
        }
        return k;
}

/* Data posted while the loop was busy leaves at its idle point, or when it waited its
 * bound on a loop that does not idle. */
static void peer_after_dispatch(Manager *m) {
        if (!m->peers)
                return;
        peer_flush_overdue(m->peers); /* control first: a PREPARE ahead of its data */
        if (m->peers->tcp)
                tcp_transport_flush_overdue(m->peers->tcp);
}

const Subsystem peer_subsystem = {
        .name = "peer",
        .after_dispatch = peer_after_dispatch,
        .verify = peer_subsystem_verify,
        .init = peer_subsystem_init,
        .done = peer_subsystem_done,
        .add_bus = bus_peer_add,
        .reload = peer_subsystem_reload,
};
