/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include "epdtop-model.h"

/* Reads the maps epdd pinned under dir (bpf/epd-telemetry.h) into the snapshot: one
 * peer row per peer name, summing its connections. Rows the bus already gave keep the
 * daemon's level and reason; the kernel fields are refreshed. Returns 0 (s->pins set),
 * -ENOENT when nothing is pinned there, -EOPNOTSUPP without BPF support. */
int top_pins_read(const char *dir, TopSnapshot *s);
