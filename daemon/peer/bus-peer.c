/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Peer at /org/epd1/peer: vtable glue only (dbus/org.epd1.Peer.xml). */
#include <errno.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/manager.h"
#include "log.h"
#include "peer/bus-peer.h"
#include "peer/peer-manager.h"
#include "peer/topology.h"

/* (name, host_id, address, state, transport, interface, path_reason, streams,
 *  usec since last frame, connects, disconnects, last_error) */
#define PEER_STRUCT "(sssssssuttts)"

/* The paths a peer can take (transport.h's kinds; transport.c, on the handoff branch,
 * has the general table). */
static const char *path_transport(const TopologyPath *path) {
        if (path && path->transport == TRANSPORT_RDMA)
                return "rdma";
        return "tcp";
}

static int append_peer(sd_bus_message *reply, Manager *m, Peer *p) {
        const TopologyPath *path = topology_path(m->topology, peer_host_id(p));
        const PeerStats *st = peer_stats(p);
        usec_t now = now_usec(CLOCK_MONOTONIC);
        usec_t age = peer_is_up(p) && st->last_rx_usec <= now ? now - st->last_rx_usec : UINT64_MAX;

        return sd_bus_message_append(reply, PEER_STRUCT, peer_name(p), peer_host_id(p), peer_address(p),
                                     peer_is_retired(p) ? "left" : peer_state_to_string(peer_state(p)),
                                     path_transport(path),
                                     path && path->ifname[0] ? path->ifname : "",
                                     path ? path->reason : "topology unavailable", peer_n_streams_up(p), age,
                                     st->connects, st->disconnects, peer_last_error(p));
}

static int method_list_peers(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        Manager *m = userdata;
        Peer *p;
        int r;

        r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_open_container(reply, 'a', PEER_STRUCT);
        if (r < 0)
                return r;
        for (size_t i = 0; (p = peer_manager_peer(m->peers, i)); i++) {
                r = append_peer(reply, m, p);
                if (r < 0)
                        return r;
        }
        r = sd_bus_message_close_container(reply);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

static int method_get_peer(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        Manager *m = userdata;
        const char *host_id;
        Peer *p;
        int r;

        r = sd_bus_message_read(msg, "s", &host_id);
        if (r < 0)
                return r;
        if (!peer_host_id_is_valid(host_id))
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Invalid host id.");
        p = peer_manager_find(m->peers, host_id);
        if (!p)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No peer with host id '%s'.", host_id);
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        r = append_peer(reply, m, p);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

static int method_list_gpu_nics(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        Manager *m = userdata;
        const TopologyGpu *g;
        int r;

        r = sd_bus_message_new_method_return(msg, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_open_container(reply, 'a', "(siss)");
        if (r < 0)
                return r;
        for (size_t i = 0; (g = topology_gpu(m->topology, i)); i++) {
                r = sd_bus_message_append(reply, "(siss)", g->pci, g->numa_node, g->nic, g->reason);
                if (r < 0)
                        return r;
        }
        r = sd_bus_message_close_container(reply);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

static int property_host_id(sd_bus *bus, const char *path, const char *interface, const char *property,
                            sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "s", m->config.host_id ? m->config.host_id : "");
}

static int property_listen(sd_bus *bus, const char *path, const char *interface, const char *property,
                           sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "s", m->config.listen_address ? m->config.listen_address : "");
}

static int property_heartbeat(sd_bus *bus, const char *path, const char *interface, const char *property,
                              sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "t", m->peers ? peer_manager_heartbeat_usec(m->peers)
                                                          : m->config.heartbeat_usec);
}

static int property_peers_up(sd_bus *bus, const char *path, const char *interface, const char *property,
                             sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        uint32_t n = 0;
        Peer *p;

        for (size_t i = 0; (p = peer_manager_peer(m->peers, i)); i++)
                n += peer_is_up(p);
        return sd_bus_message_append(reply, "u", n);
}

static const sd_bus_vtable peer_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("HostId", "s", property_host_id, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("ListenAddress", "s", property_listen, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("HeartbeatUSec", "t", property_heartbeat, 0, SD_BUS_VTABLE_PROPERTY_EMITS_CHANGE),
        SD_BUS_PROPERTY("PeersUp", "u", property_peers_up, 0, SD_BUS_VTABLE_PROPERTY_EMITS_CHANGE),
        SD_BUS_METHOD_WITH_ARGS("ListPeers", SD_BUS_NO_ARGS, SD_BUS_RESULT("a" PEER_STRUCT, peers),
                                method_list_peers, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("GetPeer", SD_BUS_ARGS("s", host_id), SD_BUS_RESULT(PEER_STRUCT, peer),
                                method_get_peer, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("ListGpuNics", SD_BUS_NO_ARGS, SD_BUS_RESULT("a(siss)", gpus),
                                method_list_gpu_nics, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_SIGNAL_WITH_ARGS("PeerStateChanged", SD_BUS_ARGS("s", host_id, "s", state, "s", reason), 0),
        SD_BUS_VTABLE_END,
};

/* Emits PeerStateChanged and PropertiesChanged(PeersUp). */
static void on_peer_state(Peer *p, bool up, void *userdata) {
        Manager *m = userdata;

        (void)manager_emit_signal(m, PEER_OBJECT_PATH, PEER_INTERFACE, "PeerStateChanged", "sss",
                                  peer_host_id(p), up ? "up" : "down", up ? "" : peer_last_error(p));
        manager_emit_changed(m, PEER_OBJECT_PATH, PEER_INTERFACE, "PeersUp");
}

int bus_peer_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, PEER_OBJECT_PATH, PEER_INTERFACE, peer_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Peer object: %m");
        /* The signals follow the peers' state (a subscription, made once). */
        if (m->peers) {
                r = peer_manager_add_state_handler(m->peers, on_peer_state, m);
                if (r < 0)
                        return log_error_errno(r, "Cannot follow the peers' state: %m");
        }
        return 0;
}
