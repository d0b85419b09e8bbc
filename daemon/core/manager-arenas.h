/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The manager's arenas at start and at the end: made by their domain's subsystem or, for
 * host memory, taken back from systemd's fd store with their bytes (core/fdstore.h,
 * docs/wal.md "Restart without loss"). */

typedef struct Manager Manager;
typedef struct Arena Arena;

/* Every configured arena, in order; the worker processes a previous epdd stored go to
 * core/mappers.h. A failure leaves the rest of the store for the next start. */
int manager_setup_arenas(Manager *m);
/* Fresh host arenas into the fd store: only once the WAL's restore dropped, durably,
 * the state journaled for their slots. */
void manager_store_fresh_arenas(Manager *m);
void manager_arena_release(Manager *m, Arena *a);
