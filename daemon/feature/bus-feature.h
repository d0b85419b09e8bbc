/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

typedef struct Manager Manager;
typedef struct Feature Feature;

/* org.epd1.Feature at /org/epd1/feature (dbus/org.epd1.Feature.xml). */
int bus_feature_add(Manager *m, sd_bus *bus);
/* FeatureReady for f's new state. */
void bus_feature_emit_ready(Manager *m, Feature *f);
