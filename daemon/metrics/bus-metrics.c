/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Metrics: where the Prometheus endpoint is, and how often it was scraped. */
#include "metrics/bus-metrics.h"

#include "core/bus-glue.h"
#include "log.h"
#include "metrics/metrics-manager.h"

static int property_address(sd_bus *bus, const char *path, const char *interface, const char *property,
                            sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "s", m->metrics ? m->metrics->url : "");
}

static int property_scrapes(sd_bus *bus, const char *path, const char *interface, const char *property,
                            sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "t", m->metrics ? m->metrics->scrapes : (uint64_t)0);
}

static const sd_bus_vtable metrics_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Address", "s", property_address, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Scrapes", "t", property_scrapes, 0, 0),
        SD_BUS_VTABLE_END,
};

int bus_metrics_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, "/org/epd1", "org.epd1.Metrics", metrics_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Metrics interface: %m");
        return 0;
}
