/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The WAL subsystem of epdd: opens <StateDirectory>/wal at start and replays it into
 * the subsystems that journal (workflows, directory ownership, handoffs, sequences,
 * features: wal.h), compacts it past [Wal] CompactSize=, and does group
 * commit for Sync=batch: a method that journaled hands its reply to
 * wal_manager_reply(), which sends it once the records before it are on disk (one
 * fdatasync per event-loop iteration, however many records). */

#include "core/manager.h"
#include "wal/wal.h"

extern const Subsystem wal_subsystem;

/* Appends a record (nothing is acknowledged yet). -ENOTCONN without a WAL. */
int wal_manager_append(Manager *m, uint16_t type, const void *payload, size_t len);
/* Sends reply (to call) now when nothing waits for a sync, or after the batch's sync;
 * if that sync fails, call gets org.epd1.Error.Failed instead: nothing is acknowledged
 * that is not durable. Takes references; returns 1 (for a method handler) or -errno. */
int wal_manager_reply(Manager *m, sd_bus_message *call, sd_bus_message *reply);
/* The same with an empty reply. */
int wal_manager_reply_empty(Manager *m, sd_bus_message *call);
