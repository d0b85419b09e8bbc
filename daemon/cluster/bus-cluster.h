/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

typedef struct Manager Manager;

#define CLUSTER_OBJECT_PATH "/org/epd1/cluster"
#define CLUSTER_INTERFACE "org.epd1.Cluster"

/* org.epd1.Cluster at /org/epd1/cluster (dbus/org.epd1.Cluster.xml), where peers run. */
int bus_cluster_add(Manager *m, sd_bus *bus);
/* PropertiesChanged of EtcdState and EtcdReason; of LeaseId; MemberChanged and MembersAlive. */
void bus_cluster_emit_state(Manager *m);
void bus_cluster_emit_lease(Manager *m);
void bus_cluster_emit_member(Manager *m, const char *host_id, const char *change, const char *reason);
