/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* epd.conf: INI with [Daemon], [Limits], [Arena:NAME]... sections. Parsing is pure:
 * every bad section, key or value is reported with file:line and what was expected,
 * and a file with any error is rejected as a whole (nothing half-applied). Subsystems
 * add their sections through the table in config.c. */

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#define CONFIG_GPU_BATCHES_MAX 16U
/* Socket= and --socket=: shorter than this. sun_path holds 108 bytes, and the socket is
 * bound as <path>.<pid> first (a pid has at most 7 digits), then renamed
 * (manager_listen_direct()). */
#define CONFIG_SOCKET_PATH_MAX 100U

#include "core/arena.h"
#include "sched/scheduler.h"
#include "telemetry/telemetry-config.h"
#include "time-util.h"

typedef struct PeerConfig {
        char *name;
        char *address;  /* host:port */
        char *host_id;
} PeerConfig;

/* [Pool:thinking], [Pool:interactive], [Pool:hybrid]: a scheduler pool's policy and the
 * workers that serve it per stage (selector lists, pool-select.h; NULL: every worker
 * of the stage). Defaults: sched_config_defaults(). docs/scheduler.md. */
typedef struct PoolConfig {
        SchedPoolPolicy policy;
        char *workers[_SCHED_STAGE_MAX];
        bool high_set, low_set; /* watermarks given; otherwise 3/4 and 1/2 of QueueMax */
} PoolConfig;

typedef struct Config {
        /* [Daemon] */
        char *host_id;           /* default: /etc/machine-id or hostname */
        char *socket_path;       /* direct socket, default /run/epd/bus */
        char *socket_group;      /* SocketGroup=: the socket's group; NULL: "epd" if it exists */
        char *bus_address;       /* NULL: the system bus if there is one */
        bool system_bus;         /* try the system bus (default yes) */
        int log_level;
        char *state_dir;

        /* [Limits] */
        unsigned max_clients;
        unsigned max_workers;
        unsigned max_objects_per_client;
        unsigned max_requests_per_client; /* outstanding scheduler requests (Admit) */
        uint64_t max_request_bytes; /* largest size a client may ask for in one call */
        usec_t attach_grace_usec;   /* objects restored at start wait this long for Attach */
        uint64_t workflow_token_bytes; /* the workflows' tokens, all together (4 bytes a token) */

        /* [Arena:NAME] */
        ArenaConfig *arenas;
        size_t n_arenas;

        /* [Peer:NAME] and [Cluster] (multi-host; see docs/config.md) */
        PeerConfig *peers;
        size_t n_peers;
        char *listen_address;
        char *cluster_key_file;
        usec_t heartbeat_usec;
        usec_t handoff_timeout_usec;
        unsigned peer_streams;      /* DataStreams=: TCP data streams per peer */
        uint64_t peer_slice_size;   /* SliceSize=: bulk writes are sent in slices of this */
        uint64_t handoff_pipeline_bytes; /* PipelineBytes=: handoffs up to this size to another
                                     * host ship without waiting for the destination (0: never) */
        int transport_policy;       /* Transport=: TransportPolicy (rdma-select.h), auto */
        /* [Cluster] membership in etcd (docs/cluster.md); no Etcd=: static peers only */
        char **etcd_endpoints;      /* Etcd=: NULL-terminated URLs, or NULL */
        char *etcd_prefix;          /* EtcdPrefix=: key prefix, "/epd/" */
        usec_t etcd_lease_ttl_usec; /* EtcdLeaseTTL=: a member's lease, 10s */
        char *etcd_ca_file;         /* EtcdCAFile=, EtcdCertFile=, EtcdKeyFile=: TLS */
        char *etcd_cert_file;
        char *etcd_key_file;
        unsigned max_members;       /* MaxMembers=: members taken from etcd, 256 */
        usec_t directory_cache_usec; /* DirectoryCacheTime=: remote lookup answers kept, 1s */

        /* [Features] */
        uint64_t feature_cache_bytes;
        char *feature_store_dir;
        uint64_t feature_store_max_bytes; /* 0: no limit */
        usec_t feature_read_back_timeout_usec; /* an Acquire waiting for a read back; 0: none */
        usec_t feature_produce_timeout_usec;   /* a producer's claim until Publish; 0: none */

        /* [Telemetry] and [Backpressure] (docs/telemetry.md) */
        TelemetryConfig telemetry;
        /* [Wal] (docs/wal.md) */
        int wal_sync;            /* WalSyncPolicy: always, batch (default), none */
        uint64_t wal_compact_bytes; /* compact when the log grows past this */
        /* [Gpu] (docs/gpu.md); BatchesInFlight= is at most CONFIG_GPU_BATCHES_MAX */
        int gpu_copy_kernel;     /* GpuCopyKernelPolicy: never, small (default), always */
        unsigned gpu_merge_groups; /* a local GPU handoff's queued groups a batch (1: none merged) */
        unsigned gpu_batches_in_flight; /* a local GPU handoff's batches on the GPU at once (1-16) */
        usec_t gpu_completion_spin_usec; /* the copy engine polls a part's event this long (0: sleeps) */
        bool gpu_strided_copies; /* evenly spaced runs of pieces as one 2D copy (default off) */
        /* [Metrics] (docs/telemetry.md#prometheus): HOST:PORT of the HTTP endpoint, NULL: off */
        char *metrics_listen;
        /* [Pool:NAME] (docs/scheduler.md), by TaskType */
        PoolConfig pools[_TASK_TYPE_MAX];

        /* Subsystem-private sections live beside the core: see config.c. */
} Config;

/* Fills in the embedded defaults (what runs with no config file at all). */
int config_defaults(Config *c);
/* Why value is no host id (1-63 of letters, digits, '-', '_', '.'), or NULL. */
const char *config_host_id_problem(const char *value);
/* Parses a whole file (or a string, for tests) over the defaults. On error, *errors
 * receives a newline-separated list of "file:line: message" and nothing is applied. */
/* Opens a file holding a secret (ClusterKeyFile=, EtcdKeyFile=) for reading: a regular
 * file neither group nor others may read or write. Its fd, or a negative errno, with
 * *ret_why (when not NULL) saying what is wrong with the file when that is the cause. */
int config_secret_file_open(const char *path, const char **ret_why);
int config_parse_file(Config *c, const char *path, char **errors);
int config_parse_string(Config *c, const char *text, const char *name, char **errors);
void config_done(Config *c);

/* What a reload from running c to n cannot apply, each said in a notice (it takes
 * effect at the next restart): how many there were. */
unsigned config_restart_notices(const Config *c, const Config *n);
