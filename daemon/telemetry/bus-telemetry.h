/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

#include "telemetry/backpressure.h"

typedef struct Manager Manager;

#define TELEMETRY_OBJECT_PATH "/org/epd1/telemetry"
#define TELEMETRY_INTERFACE "org.epd1.Telemetry"

int bus_telemetry_add(Manager *m, sd_bus *bus);
/* Emits Backpressure(peer, level, reason) on every connection. */
int bus_telemetry_emit_backpressure(Manager *m, const char *peer, BackpressureLevel level,
                                    BackpressureReason reason);
