/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Cluster at /org/epd1/cluster: vtable glue only (dbus/org.epd1.Cluster.xml). */
#include "cluster/bus-cluster.h"

#include <errno.h>
#include <string.h>

#include "cluster/cluster-manager.h"
#include "core/bus-glue.h"
#include "core/manager.h"
#include "log.h"
#include "pages/directory-forward.h"
#include "peer/peer-manager.h"

/* (host_id, address, source, lease, session, last_error, transports, arenas, nics, gpus,
 *  share_permille, published_here) */
#define MEMBER_STRUCT "(sssssssssuut)"

/* owner: whether the host may own directory shards (this host, a peer with a session up).
 * The others own nothing, and asking the directory (a scan of its owners) for each of
 * them made ListMembers O(peers ever known x owners). */
static int append_member(sd_bus_message *reply, Manager *m, const char *host, const char *address, const char *source,
                         const char *lease, const char *session, const char *error, const MemberInfo *info,
                         bool owner) {
        return sd_bus_message_append(reply, MEMBER_STRUCT, host, address, source, lease, session, error,
                                     info ? info->transports : "", info ? info->arenas : "", info ? info->nics : "",
                                     info ? info->gpus : 0,
                                     owner ? directory_forward_share_permille(m->directory_forward, host) : 0,
                                     owner ? directory_forward_entries_owned_by(m->directory_forward, host) : 0);
}

/* A member whose record in etcd was refused (not signed with the cluster key): lease
 * "refused", and why in last_error (the address it claims, never dialed, too). */
static int append_refused(sd_bus_message *reply, Manager *m, const MemberRefusal *f, const char *address,
                          const char *session, bool owner) {
        char why[256];

        snprintf(why, sizeof why, "record in etcd refused: %s (it says %s: not dialed)",
                 cluster_refusal_reason(f->error), f->address);
        return append_member(reply, m, f->host_id, address, "etcd", "refused", session, why, NULL, owner);
}

static int method_list_members(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        Manager *m = userdata;
        ClusterManager *cm = m->cluster;
        Peer *p;
        int r;

        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_open_container(reply, 'a', MEMBER_STRUCT);
        if (r >= 0)
                r = append_member(reply, m, m->config.host_id, m->config.listen_address ?: "", "self", "self", "self",
                                  "", cm && cm->etcd ? &cm->self : NULL, true);
        for (size_t i = 0; r >= 0 && (p = peer_manager_peer(m->peers, i)); i++) {
                const Member *mb = cm && cm->etcd ? membership_get(cm->members, peer_host_id(p)) : NULL;
                const MemberRefusal *f = cm && cm->etcd ? cluster_refusal(cm, peer_host_id(p)) : NULL;
                const char *lease = !peer_is_member(p)          ? "static"
                                    : peer_is_retired(p) || !mb ? "left"
                                                                : member_state_to_string(mb->state);
                if (peer_is_member(p) && (peer_is_retired(p) || !mb) && f) {
                        /* Its latest record is refused: its member left for that. */
                        r = append_refused(reply, m, f, peer_address(p), peer_state_to_string(peer_state(p)),
                                           peer_is_up(p));
                        continue;
                }
                r = append_member(reply, m, peer_host_id(p), peer_address(p), peer_is_member(p) ? "etcd" : "static",
                                  lease, peer_state_to_string(peer_state(p)), peer_last_error(p),
                                  mb ? &mb->info : NULL, peer_is_up(p));
        }
        /* Hosts known from refused records alone: never peers. */
        const MemberRefusal *f;
        for (size_t i = 0; r >= 0 && cm && cm->etcd && (f = cluster_refusal_at(cm, i)); i++)
                if (!peer_manager_find(m->peers, f->host_id))
                        r = append_refused(reply, m, f, f->address, "down", false);
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        if (r < 0)
                return r;
        return sd_bus_send(NULL, reply, NULL);
}

static int property_string(sd_bus *bus, const char *path, const char *interface, const char *property,
                           sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        ClusterManager *cm = m->cluster;
        const char *v = "";

        if (strcmp(property, "Source") == 0)
                v = cluster_source(cm);
        else if (strcmp(property, "EtcdPrefix") == 0)
                v = cm && cm->etcd ? m->config.etcd_prefix : "";
        else if (strcmp(property, "EtcdState") == 0)
                v = cluster_etcd_state(cm);
        else if (strcmp(property, "EtcdReason") == 0)
                v = cluster_etcd_reason(cm);
        return sd_bus_message_append(reply, "s", v);
}

static int property_endpoints(sd_bus *bus, const char *path, const char *interface, const char *property,
                              sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append_strv(reply, m->config.etcd_endpoints ?: (char *[]){ NULL });
}

static int property_u64(sd_bus *bus, const char *path, const char *interface, const char *property,
                        sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        ClusterManager *cm = m->cluster;
        uint64_t v = 0;

        if (strcmp(property, "LeaseTTLUSec") == 0)
                v = cm && cm->etcd ? m->config.etcd_lease_ttl_usec : 0;
        else if (strcmp(property, "LeaseId") == 0)
                v = cm ? cm->lease : 0;
        else if (strcmp(property, "Revision") == 0)
                v = cm && cm->etcd ? (uint64_t)membership_revision(cm->members) : 0;
        else if (strcmp(property, "ShardRecords") == 0)
                v = directory_forward_records(m->directory_forward);
        return sd_bus_message_append(reply, "t", v);
}

static int property_members_alive(sd_bus *bus, const char *path, const char *interface, const char *property,
                                  sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        ClusterManager *cm = m->cluster;
        const Member *mb;
        uint32_t n = 0;

        for (size_t i = 0; cm && cm->etcd && (mb = membership_member(cm->members, i)); i++)
                n += mb->state == MEMBER_ALIVE;
        return sd_bus_message_append(reply, "u", n);
}

static const sd_bus_vtable cluster_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Source", "s", property_string, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("EtcdEndpoints", "as", property_endpoints, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("EtcdPrefix", "s", property_string, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("LeaseTTLUSec", "t", property_u64, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("EtcdState", "s", property_string, 0, SD_BUS_VTABLE_PROPERTY_EMITS_CHANGE),
        SD_BUS_PROPERTY("EtcdReason", "s", property_string, 0, SD_BUS_VTABLE_PROPERTY_EMITS_CHANGE),
        SD_BUS_PROPERTY("LeaseId", "t", property_u64, 0, SD_BUS_VTABLE_PROPERTY_EMITS_CHANGE),
        SD_BUS_PROPERTY("MembersAlive", "u", property_members_alive, 0, SD_BUS_VTABLE_PROPERTY_EMITS_CHANGE),
        SD_BUS_PROPERTY("Revision", "t", property_u64, 0, 0),
        SD_BUS_PROPERTY("ShardRecords", "t", property_u64, 0, 0),
        SD_BUS_METHOD_WITH_ARGS("ListMembers", SD_BUS_NO_ARGS, SD_BUS_RESULT("a" MEMBER_STRUCT, members),
                                method_list_members, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_SIGNAL_WITH_ARGS("MemberChanged", SD_BUS_ARGS("s", host_id, "s", change, "s", reason), 0),
        SD_BUS_VTABLE_END,
};

int bus_cluster_add(Manager *m, sd_bus *bus) {
        int r;

        if (!m->cluster)
                return 0;
        r = bus_glue_add_vtable(bus, CLUSTER_OBJECT_PATH, CLUSTER_INTERFACE, cluster_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Cluster object: %m");
        return 0;
}

void bus_cluster_emit_state(Manager *m) {
        manager_emit_changed(m, CLUSTER_OBJECT_PATH, CLUSTER_INTERFACE, "EtcdState");
        manager_emit_changed(m, CLUSTER_OBJECT_PATH, CLUSTER_INTERFACE, "EtcdReason");
}

void bus_cluster_emit_lease(Manager *m) {
        manager_emit_changed(m, CLUSTER_OBJECT_PATH, CLUSTER_INTERFACE, "LeaseId");
}

void bus_cluster_emit_member(Manager *m, const char *host_id, const char *change, const char *reason) {
        (void)manager_emit_signal(m, CLUSTER_OBJECT_PATH, CLUSTER_INTERFACE, "MemberChanged", "sss", host_id, change,
                                  reason ?: "");
        manager_emit_changed(m, CLUSTER_OBJECT_PATH, CLUSTER_INTERFACE, "MembersAlive");
}
