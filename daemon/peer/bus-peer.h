/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <stdbool.h>
#include <systemd/sd-bus.h>

typedef struct Manager Manager;
typedef struct Peer Peer;

#define PEER_OBJECT_PATH "/org/epd1/peer"
#define PEER_INTERFACE "org.epd1.Peer"

/* org.epd1.Peer at /org/epd1/peer (dbus/org.epd1.Peer.xml). */
int bus_peer_add(Manager *m, sd_bus *bus);
