/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <stdbool.h>
#include <stdint.h>
#include <systemd/sd-bus.h>

typedef struct Manager Manager;
typedef struct HandoffObject HandoffObject;

/* org.epd1.Handoffs at /org/epd1/handoff and org.epd1.Handoff objects under it. */
int bus_handoff_add(Manager *m, sd_bus *bus);
/* The object's Progress (groups done) and StateChanged signals. */
/* To the watchers, and to the owner with to_owner (its ring did not take the record). */
void bus_handoff_emit_progress(HandoffObject *o, bool to_owner, uint32_t done);
void bus_handoff_emit_state(HandoffObject *o, bool to_owner);
