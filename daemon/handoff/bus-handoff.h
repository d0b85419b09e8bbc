/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <stdint.h>
#include <systemd/sd-bus.h>

typedef struct Manager Manager;
typedef struct HandoffObject HandoffObject;

/* org.epd1.Handoffs at /org/epd1/handoff and org.epd1.Handoff objects under it. */
int bus_handoff_add(Manager *m, sd_bus *bus);
/* The object's Progress (groups done) and StateChanged signals. */
void bus_handoff_emit_progress(HandoffObject *o, uint32_t done);
void bus_handoff_emit_state(HandoffObject *o);
