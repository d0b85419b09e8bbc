/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

typedef struct Manager Manager;

/* org.epd1.Handoffs at /org/epd1/handoff and org.epd1.Handoff objects under it. */
int bus_handoff_add(Manager *m, sd_bus *bus);
