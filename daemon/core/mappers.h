/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Workers that outlive a restart (docs/wal.md, "Workers that outlive a restart").
 * A worker handed host arenas' fds maps them and keeps its mapping across an epdd
 * restart: the arenas come back from the fd store with their bytes, but what the worker
 * held (a feature it was writing, one it was reading) is not journaled, so its regions
 * look free to the new epdd. So that nothing is handed out under a worker of before
 * that may still touch it, epdd keeps a pidfd of every such process in systemd's fd
 * store (FDNAME=mapper-<start token>-<pid>-<clients>, one per process), and a start that gets
 * some back whose process still runs fences the restored feature arenas (the
 * subsystems' `fence` hook) until each has exited or registered again with host arenas as
 * many times as it had clients with them (the count is in the stored name: a worker's
 * client that registers after the restart has dropped what it held before, its old
 * client can do nothing more), or MAPPERS_FENCE_USEC has passed (the same wait as for a departed
 * client's GPU pages: core/client.c). Outside systemd
 * nothing is stored, and nothing needs to be: no memory survives the restart. */

#include <stdbool.h>

#include "core/fdstore.h"
#include "time-util.h"

typedef struct Manager Manager;
typedef struct Client Client;
typedef struct MapperSet MapperSet;

#define MAPPERS_FENCE_USEC (10 * USEC_PER_SEC)

/* At start, with the fd store: takes the mappers' pidfds a previous epdd stored. */
int mappers_take(Manager *m, FdStore *store);
/* After the journal's replay: those whose process still runs fence the restored arenas
 * (logged); the others are forgotten. */
int mappers_start(Manager *m);
/* c was handed host arenas' fds: its process is kept in the store while any client of
 * it is (best effort, logged at debug; outside systemd nothing is stored), and is no
 * longer waited for if it was a worker of before the restart. */
void mappers_add(Manager *m, Client *c);
/* c is freed: the last client of its process takes it out of the store, unless epdd is
 * stopping (the next start needs it). */
void mappers_drop(Manager *m, Client *c);
void mappers_free(Manager *m);
