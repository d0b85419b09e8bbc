/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The WAL subsystem of epdd: opens <StateDirectory>/wal at start and replays it into
 * the subsystems that journal (workflows, directory ownership, handoffs, sequences,
 * features: wal.h), and runs the writer thread (wal-writer.h) that writes, syncs and
 * compacts the log off the event loop, one fdatasync for every record that arrived
 * meanwhile (group commit). A method that journaled hands its reply to
 * wal_manager_reply(), which sends it once the records before it are durable. */

#include "core/manager.h"
#include "wal/wal-writer.h"
#include "wal/wal.h"

extern const Subsystem wal_subsystem;

/* Appends a record (nothing is acknowledged yet): queued for the writer thread, no
 * I/O here. -ENOTCONN without a WAL; -EIO once the log failed (wal-writer.h). */
int wal_manager_append(Manager *m, uint16_t type, const void *payload, size_t len);
/* A change already made whose record could not even be built (no memory for it): as a
 * refused append, nothing is journaled or acknowledged from now on (until a restart),
 * and nothing freed is counted settled again. Returns the refusal (error, or the
 * earlier one). -ENOTCONN without a journal. */
int wal_manager_refuse(Manager *m, int error, const char *what);
/* Sends reply (to call) once every record this daemon appended before it is durable
 * (at once when they are); if the writer failed, call gets org.epd1.Error.Failed
 * instead: nothing is acknowledged that is not durable. Replies leave in the order
 * they were handed in. Takes references; returns 1 (for a method handler) or -errno. */
int wal_manager_reply(Manager *m, sd_bus_message *call, sd_bus_message *reply);
/* The general form: fn(userdata, 0) once every record appended so far is durable (at
 * once when it is), fn(userdata, -errno) when it cannot become durable. For
 * acknowledgements that are not D-Bus replies (a message to a peer, a ring record). */
int wal_manager_after_durable(Manager *m, WalWaitFn fn, void *userdata);
/* Room for n waits, so that the next n wal_manager_after_durable() calls cannot fail
 * for memory: taken before a change whose answer, once it is made, must not be an
 * error. */
int wal_manager_reserve_waits(Manager *m, size_t n);
/* The same with an empty reply. */
int wal_manager_reply_empty(Manager *m, sd_bus_message *call);
/* The LSN of the last record this loop appended (0: none, or no WAL), and whether the
 * records up to lsn are durable (always without a WAL). */
uint64_t wal_manager_last_lsn(Manager *m);
bool wal_manager_durable(Manager *m, uint64_t lsn);
/* A subsystem's "wait for this record" mark: *mark is an LSN it appended (0: none;
 * UINT64_MAX: refused, never durable). True once the record is durable, clearing it. */
bool wal_manager_mark_durable(Manager *m, uint64_t *mark);

/* The writer's counters (for the bus, epdctl and metrics): appended, syncs, records
 * per sync, the durable point, ... -ENOTCONN without a WAL (zeros). */
typedef struct WalManagerStats {
        WalWriterStats writer;
        const char *policy;
        uint64_t replies_waiting;
} WalManagerStats;
int wal_manager_stats(Manager *m, WalManagerStats *ret);
/* The same as counters in a stable order, like handoff_manager_counters(): name and
 * value, returns how many there are. */
size_t wal_manager_counters(Manager *m, const char **names, uint64_t *values, size_t n);
