/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The Manager owns every subsystem and every event source of epdd. */

#include <stdbool.h>
#include <systemd/sd-bus.h>
#include <systemd/sd-event.h>

#include "core/arena.h"
#include "core/client.h"
#include "core/config.h"
#include "hashmap.h"
#include "reason.h"

/* A dispatch of the event loop this long or longer counts as a stall (Manager.loop_stalls). */
#define MANAGER_STALL_USEC 1000U

typedef struct Manager Manager;
typedef struct Worker Worker;
typedef struct WorkerStats WorkerStats;

/* Writes one record of a subsystem's snapshot (wal/wal.h record type). */
typedef int (*SubsystemSnapshotAdd)(void *userdata, uint16_t type, const void *rec, size_t len);

/* Journaling (wal/): the WAL subsystem calls these, never a subsystem by name. Replay
 * hands every record of the families listed in `families` (wal.h: WAL_RECORD_X >> 8,
 * ended by 0) to apply_record: -EBADMSG means malformed (logged, skipped), -ENOENT or
 * -ESTALE that nothing was left to apply. Once every record is in, restore_finish runs,
 * in start order. At compaction, snapshot writes the subsystem's live state through
 * add, in start order (so a later subsystem may refer to an earlier one's records). */
typedef struct SubsystemJournal {
        const uint8_t *families;
        int (*apply_record)(Manager *m, uint16_t type, const void *payload, size_t len);
        int (*restore_finish)(Manager *m);
        int (*snapshot)(Manager *m, SubsystemSnapshotAdd add, void *userdata);
} SubsystemJournal;

/* Arenas of another memory domain than host memory (GPU): the subsystem whose domain is
 * the configured Domain= makes them at start, before any init, and releases its part of
 * them after every done (the Arena itself is freed after). */
typedef struct SubsystemArenas {
        int domain; /* MemoryDomain */
        int (*make)(Manager *m, const ArenaConfig *c, uint32_t index, Arena **ret);
        void (*release)(Manager *m, Arena *a);
} SubsystemArenas;

/* Subsystems hook into the manager through this table, so that adding one does not
 * touch every other: each may be NULL. See manager.c:subsystems[]. */
typedef struct Subsystem {
        const char *name;
        /* Checks what init would refuse of m->config without side effects (no socket
         * bound, no file written, no device opened) and logs why: run by
         * manager_verify(), at start-up and by `epdd --check-config`. */
        int (*verify)(Manager *m);
        int (*init)(Manager *m);                 /* after arenas, before the bus */
        void (*done)(Manager *m);                /* at shutdown, before arenas go */
        int (*add_bus)(Manager *m, sd_bus *bus); /* on every connection */
        int (*reload)(Manager *m, const Config *new_config); /* > 0: that many changes take a
                                                              * restart (each said in the log) */
        /* A worker registered / is about to be freed (unregistered or its client died):
         * drop anything of the subsystem that refers to it. A refusal of worker_added
         * says why in `why`, which the caller of RegisterWorker gets as the message. */
        int (*worker_added)(Manager *m, Worker *w, Reason *why);
        void (*worker_gone)(Manager *m, Worker *w);
        /* A worker's client left while its process still runs, and what it holds waits
         * for the process to exit (client_gone()): hand it no more work. Idempotent with
         * worker_gone, which still follows. */
        void (*worker_departing)(Manager *m, Worker *w);
        /* Fills in what the subsystem counts of a worker on demand (core/worker.h). */
        void (*worker_stats)(Manager *m, Worker *w, WorkerStats *st);
        /* After every event manager_run()'s loop dispatched (while Manager.in_loop):
         * work a callback queued for "right after this callback" is done here rather than
         * in a defer source of its own, which would cost the loop another turn (an
         * epoll_wait) per callback that queued it. A subsystem that uses it keeps a defer
         * source as its fallback for when Manager.in_loop is false. */
        void (*after_dispatch)(Manager *m);
        /* manager_run()'s loop is about to wait for events (only while Manager.in_loop):
         * returns the CLOCK_MONOTONIC µs by which the subsystem needs the loop back (the
         * wait's timeout; its after_dispatch runs then), UINT64_MAX if none. A deadline
         * checked there and in after_dispatch needs no sd-event timer, whose every move
         * costs a timerfd_settime. Nothing is pending as far as the loop knows, but fds
         * are not polled again before this: it is not the idle point an idle-priority
         * defer source finds. The loop is armed: the hook must not add, enable or re-time
         * an event source, which the wait would not see. */
        uint64_t (*before_wait)(Manager *m);
        /* Worker processes of before a restart still run and may still use the restored
         * host arenas (core/mappers.h): on, hand out none of their bytes that are free
         * now and evict nothing restored; off, as before. Once on, off follows once. */
        void (*fence)(Manager *m, bool on);
        /* A handoff's Prepare for request_id took n KV pages of arena a for its
         * destination (allocated, or the prefill's own handed over in place): the
         * scheduler stops holding them back apart (manager_pages_taken()); n < 0: -n
         * allocated ones went back to the pool uncommitted (a rollback). Returns how
         * many it counted (the caller gives back exactly those). */
        uint64_t (*pages_taken)(Manager *m, const char *request_id, const Arena *a, int64_t n);
        const SubsystemJournal *journal; /* NULL: journals nothing */
        const SubsystemArenas *arenas;   /* NULL: makes no arenas */
} Subsystem;

/* What the command line set (NULL / -1: not given): it overrides the configuration
 * file, at start and at every reload. */
typedef struct ManagerCmdline {
        const char *bus_address, *socket, *host_id, *state_dir;
        int log_level, system_bus;
} ManagerCmdline;

struct Manager {
        sd_event *event;
        Config config;
        char *config_path;
        ManagerCmdline cmdline;

        sd_bus *bus;                 /* system bus or --bus-address; may be NULL */
        int direct_fd;               /* listening direct socket */
        int socket_lock_fd;          /* <socket>.lock, held while serving (core/lockfile.h) */
        gid_t socket_gid;            /* the socket's and its directory's group; -1: epdd's own */
        int state_lock_fd;           /* <StateDirectory>/epdd.lock */
        sd_event_source *direct_source;
        Hashmap *connections;        /* direct connections (manager.c: Connection) by serial */
        Hashmap *refused;            /* those past MaxClients=, told so until they close */
        uint64_t next_serial;

        Hashmap *clients;            /* Client* by key */
        size_t clients_departing;    /* of those: gone, waiting for their process (not in MaxClients=) */

        Hashmap *workers;            /* Worker* by id string */

        Arena **arenas;
        size_t n_arenas;

        sd_event_source *sigterm, *sigint, *sighup;
        /* PropertiesChanged not sent yet (manager_emit_changed): coalesced, one signal
         * per object and interface for every change made meanwhile. */
        sd_event_source *changed_source;
        sd_event_source *stalled_source; /* drops the direct subscribers that stopped reading */
        struct { const char *path, *interface, *property; } changed[16];
        size_t n_changed;
        uint64_t changed_since;      /* CLOCK_MONOTONIC µs of the oldest one */
        uint64_t started_usec;       /* CLOCK_REALTIME at startup (Manager.StartedAt) */
        bool ready_sent;
        bool in_loop;                /* manager_run()'s loop: it runs the after_dispatch and before_wait hooks */
        bool stopping;               /* manager_free(): releases are not journaled */
        /* Dispatches of the loop (a callback and the after_dispatch hooks behind it) that
         * kept it from everything else for MANAGER_STALL_USEC or longer: how many, the
         * longest, what it was (a bus call by name, else "an event source") and when
         * (CLOCK_REALTIME). Manager.LoopStalls and the metrics show them. */
        uint64_t loop_stalls;
        uint64_t loop_stall_max_usec;
        uint64_t loop_stall_max_at;
        char loop_stall_max_what[160];

        /* Subsystem state, owned here. Each subsystem's header defines its type. */
        struct PageManager *page_manager;
        struct FeatureCache *features;
        struct HandoffManager *handoffs;
        struct PeerManager *peers;
        struct Topology *topology;
        struct Telemetry *telemetry;
        struct Scheduler *scheduler;
        struct WorkflowManager *workflows;
        struct Wal *wal;
        struct GpuContext *gpu;
        struct MetricsServer *metrics;
        struct DirectoryForward *directory_forward;
        struct ClusterManager *cluster;
        struct MapperSet *mappers;   /* core/mappers.h */
};

int manager_new(Manager **ret, const char *config_path);
/* The subsystems in start order, NULL-terminated (core/subsystem-list.h). */
const Subsystem *const *manager_subsystems(void);
/* Tells every subsystem of Subsystem.pages_taken; what they counted, together. */
uint64_t manager_pages_taken(Manager *m, const char *request_id, const Arena *a, int64_t n);
Manager *manager_free(Manager *m);
/* Everything start-up checks of the configuration that needs no socket bound and no
 * state directory: the host id, the socket's group, the arenas' sizes, and each
 * subsystem's verify hook (the cluster key loaded, peer addresses parsed, ...). Logs
 * what is wrong, as start-up says it; manager_startup() runs it first, and
 * `epdd --check-config` runs it alone. */
int manager_verify(Manager *m);
int manager_startup(Manager *m);
int manager_run(Manager *m);
int manager_reload(Manager *m);

/* The serial of a direct connection, 0 if `bus` is not one. */
uint64_t manager_connection_serial(Manager *m, sd_bus *bus);
/* The direct connection `bus` gets the broadcast signals (PropertiesChanged,
 * Backpressure, PeerStateChanged, MemberChanged) from now on (enable) or no more.
 * 1 for a direct connection; 0 on the bus (its match rules decide); -ENOTCONN. */
int manager_connection_subscribe(Manager *m, sd_bus *bus, bool enable);

/* Runs the subsystems' worker_added hooks (a failure undoes the registration and says
 * why) and worker_gone hooks. */
int manager_worker_added(Manager *m, Worker *w, Reason *why);
void manager_worker_removed(Manager *m, Worker *w);
/* The worker's counters with what the subsystems fill in on demand. */
void manager_worker_stats(Manager *m, Worker *w, WorkerStats *ret);

Arena *manager_find_arena(Manager *m, const char *name);

/* Applies m->cmdline to c (a configuration read from the file). -ENOMEM. */
int manager_apply_cmdline(Manager *m, Config *c);

/* PropertiesChanged for `property` (of `interface` at `path`; all three static
 * strings) on every connection: coalesced, sent once the loop has handled what was
 * ready (a burst of changes, such as many workers registering at once, is one signal),
 * and within 10 ms however busy the loop is. */
void manager_emit_changed(Manager *m, const char *path, const char *interface,
                          const char *property);
/* Emits a signal on every connection (bus and direct). Ends the message. */
int manager_emit_signal(Manager *m, const char *path, const char *interface,
                        const char *member, const char *types, ...);
