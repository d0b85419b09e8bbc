/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include "core/manager.h"

extern const Subsystem gpu_subsystem;

/* Copy-on-write of `length` bytes within the GPU arena `userdata` (an Arena*), from
 * offset src to dst: a PageCopyFn (sequence.h). */
int gpu_manager_page_copy(void *userdata, uint64_t dst, uint64_t src, uint64_t length);
