/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <stddef.h>

#include "epdtop-model.h"

/* Reads the maps epdd pinned under dir (bpf/epd-telemetry.h) into the snapshot: one
 * peer row per peer name, summing its connections. Rows the bus already gave keep the
 * daemon's level and reason; the kernel fields are refreshed. Returns 0 (s->pins set),
 * -ENOENT when nothing is pinned there, -EOPNOTSUPP without BPF support, and -EPROTO
 * when the maps there are not of the layout this epdtop reads: a map's type, key or
 * value size differs, or the "settings" map's ABI is not EPD_TELEMETRY_ABI (an epdd of
 * another version, or another program's maps). Those are not read and the snapshot is
 * left as it was; why (the map, its sizes and the expected ones) goes to why (why_size
 * bytes; why may be NULL). */
int top_pins_read_why(const char *dir, TopSnapshot *s, char *why, size_t why_size);
