/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Between the copy engine (copy.c) and its completion threads' wait (copy-pace.c). */

#include <stdint.h>

#include "copy.h"

/* Waits for a part's event: queued at queued_usec, `bytes` long (0: no pace for it),
 * on a path whose pace is *pace; spin_usec as gpu_copy_engine_set_spin(). Returns the
 * event's outcome (0 or a negative errno); *how says how its end was seen and *look when
 * it was last seen running (late) or when the thread woke from its timer (overslept),
 * for gpu_copy_pace_observe(). */
int gpu_copy_event_wait(GpuSystem *s, CUevent event, uint64_t queued_usec, uint64_t bytes, const GpuCopyPace *pace,
                        unsigned spin_usec, GpuCopySeen *how, uint64_t *look);
