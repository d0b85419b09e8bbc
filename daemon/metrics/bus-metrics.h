/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

#include "core/manager.h"

/* org.epd1.Metrics on /org/epd1 (dbus/org.epd1.Metrics.xml). */
int bus_metrics_add(Manager *m, sd_bus *bus);
