/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <stdbool.h>
#include <systemd/sd-bus.h>

typedef struct Manager Manager;

/* org.epd1.Manager at /org/epd1 and org.epd1.Worker objects under /org/epd1/worker. */
int bus_manager_add(Manager *m, sd_bus *bus);
int bus_worker_add(Manager *m, sd_bus *bus);

typedef struct Worker Worker;
/* Reads a worker's object path (an "o" argument) and finds it: InvalidArgument for a
 * path that is not a worker's, NotFound for no such worker; with own, PermissionDenied
 * unless the caller's client registered it. */
int bus_read_worker(Manager *m, sd_bus_message *msg, bool own, Worker **ret, sd_bus_error *error);
