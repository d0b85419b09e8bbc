/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The scheduler subsystem of epdd: owns the pure Scheduler (scheduler.h) in
 * Manager.scheduler, feeds it the registered workers (a colocated worker serves both
 * prefill and decode), drops requests whose workers never reported, and serves
 * org.epd1.Scheduler (bus-scheduler.c). */

#include "core/manager.h"
#include "sched/scheduler.h"
#include "telemetry/backpressure.h"

extern const Subsystem scheduler_subsystem;

/* What Admit's hints told about the request, for SchedOps.affinity (SchedHints.affinity_key). */
typedef struct SchedulerAffinity {
        bool features_cached; /* every FeatureKeys entry is READY (or being produced) here */
} SchedulerAffinity;

/* Whether every key is in the feature cache, READY or RESERVED (a reader then waits
 * for the producer instead of encoding again). False for an empty list. */
bool scheduler_features_cached(Manager *m, char **keys);

/* The pools worker w serves at stage st: those whose [Pool:NAME] selector for the stage
 * matches it (pool-select.h), narrowed by its ConfigureWorker(Pools=). */
unsigned scheduler_worker_pools(Manager *m, Worker *w, SchedStage st);
/* ConfigureWorker(Pools=): limits w to pools (0: no limit of its own). */
int scheduler_set_pool_override(Manager *m, Worker *w, unsigned pools);

/* The stages a worker role serves (bit per SchedStage). */
unsigned scheduler_stages_of_role(int role);
int bus_scheduler_add(Manager *m, sd_bus *bus);
/* Sets each decode worker's free pages from the KV page pools of the arenas it maps
 * (free + evictable idle pages); called before each admission. */
void scheduler_refresh_pages(Manager *m);

/* Where a worker's KV lives, for the path between a prefill and a decode worker: the
 * host id of the epdd that receives its pages (ConfigureWorker "Host"); NULL or "" is
 * this host. -ENOENT for an unknown worker. */
int scheduler_set_worker_host(Manager *m, const char *worker_id, const char *host);

/* The scheduler's view of a path from the telemetry's: a closed handoff window (high
 * from loss or a full destination, or stalled: the handoff path would defer the work
 * with Error.Backpressure) stops new work on it; a full window leaves it to the
 * top-priority pool only; elevated, or high from queueing alone, makes it a second
 * choice. Pure. */
SchedPressure scheduler_path_pressure(BackpressureLevel level, BackpressureReason reason, bool window_full);

/* What this host knows of its peer path to a host: whether the peer is up and, when
 * `outgoing` asks for them, the telemetry of this host's path to it (level, reason) and
 * whether this host's handoff window to it is full. -ENOENT: not a configured peer. */
typedef struct SchedPeerPath {
        bool up;
        bool has_telemetry;
        BackpressureLevel level;
        BackpressureReason reason;
        bool window_full;
} SchedPeerPath;
typedef int (*SchedPeerPathFn)(void *userdata, const char *host, bool outgoing, SchedPeerPath *ret);

/* The backpressure of the path between a prefill worker whose KV is on prefill_host and
 * a decode worker whose KV lands on decode_host (NULL or "": this host; ConfigureWorker
 * "Host"), as SchedOps.path answers it. Both here, both elsewhere, or a host that is not
 * a configured peer: OK. The decode elsewhere: this host's handoffs to it, as
 * scheduler_path_pressure() reads the telemetry and our window (a peer that is down:
 * STOP). The prefill elsewhere: its host's handoffs to this one, gated by its own window
 * to us, of which nothing is known here: STOP when the peer is down (the one control
 * connection carries both directions), else OK; our window to it and its destination's
 * fill are the other direction. Pure: peer_path does the lookups. */
SchedPressure scheduler_pair_pressure(const char *prefill_host, const char *decode_host, SchedPeerPathFn peer_path,
                                      void *userdata);

/* Admitted requests belong to the client that admitted them (a ClientObject of type
 * CLIENT_OBJECT_REQUEST): cancelled when it goes (all of them together, in one batch:
 * sched_cancel_many()), ended by Complete only from it or root.
 * scheduler_request_owner(): 0 and *ret the owning client (NULL: none), or -ENOENT when
 * the request is not outstanding. scheduler_own_request(): links an outstanding request
 * to c (-EDQUOT/-ESHUTDOWN from the client's limits: the request is then cancelled). */
int scheduler_request_owner(Manager *m, const char *request_id, Client **ret);
int scheduler_own_request(Manager *m, const char *request_id, Client *c);
