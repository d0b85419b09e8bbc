/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include "core/manager.h"

extern const Subsystem gpu_subsystem;

/* For the arena setup: creates a configured Domain=gpu arena, loading the driver on
 * first use. Fails with a clear "no GPU" message where there is none. */
int manager_gpu_arena_new(Manager *m, const ArenaConfig *c, uint32_t index, Arena **ret);
void manager_arena_free(Manager *m, Arena *a);
/* Copy-on-write of `length` bytes within the GPU arena `userdata` (an Arena*), from
 * offset src to dst: a PageCopyFn (sequence.h). */
int manager_gpu_page_copy(void *userdata, uint64_t dst, uint64_t src, uint64_t length);
