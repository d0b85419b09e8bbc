/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

typedef struct Manager Manager;

/* org.epd1.Pages at /org/epd1/pages and org.epd1.Sequence objects under
 * /org/epd1/sequence (dbus/org.epd1.Pages.xml, dbus/org.epd1.Sequence.xml). */
int bus_sequence_add(Manager *m, sd_bus *bus);
