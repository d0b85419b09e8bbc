/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

typedef struct Manager Manager;

/* org.epd1.Manager at /org/epd1 and org.epd1.Worker objects under /org/epd1/worker. */
int bus_manager_add(Manager *m, sd_bus *bus);
int bus_worker_add(Manager *m, sd_bus *bus);
