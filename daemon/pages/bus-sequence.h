/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <systemd/sd-bus.h>

typedef struct Manager Manager;
typedef struct Sequence Sequence;
typedef struct Worker Worker;

/* org.epd1.Pages at /org/epd1/pages and org.epd1.Sequence objects under
 * /org/epd1/sequence (dbus/org.epd1.Pages.xml, dbus/org.epd1.Sequence.xml). */
int bus_sequence_add(Manager *m, sd_bus *bus);

/* Worker w mapped the arena of registered sequence s (what Clone, Workflow.Create and
 * Attach require: its KV layout is that arena's); else PermissionDenied in error. */
int bus_sequence_require_arena(Manager *m, const Worker *w, const Sequence *s, sd_bus_error *error);
