/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

typedef struct Manager Manager;
typedef struct Worker Worker;

/* Adds org.epd1.Gpu at /org/epd1 to a connection. */
int bus_gpu_add(Manager *m, sd_bus *bus);
/* Releases the GPU memory registrations of a worker that goes away. */
void bus_gpu_worker_gone(Manager *m, Worker *w);
