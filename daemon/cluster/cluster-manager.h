/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* ClusterManager: membership in etcd (docs/cluster.md), the "cluster" subsystem.
 *
 * With [Cluster] Etcd=, this host registers itself under PREFIX members/HOST_ID, bound
 * to a lease it keeps alive, and watches the prefix. Two threads talk to etcd (libcurl
 * through etcd's JSON gateway; etcd-client.c): the session thread grants the lease,
 * puts the record and sends keepalives (every third of the TTL), granting a new lease
 * and putting the record again whenever etcd lost it; the watch thread reads the prefix
 * and then follows it with a watch, reading it again (a resync) whenever the watch
 * broke. Both post what they learn to the event loop through an eventfd; the loop
 * applies it to the Membership (membership.h) and acts: a member that joins becomes a
 * peer (peer_manager_add_member(): dialed or accepted, authenticated with the cluster
 * key exactly as configured peers), a member that leaves is retired (its session ends:
 * handoffs with it roll back, its directory records go, its shards move). While etcd
 * cannot be reached the membership stays as it was and EtcdState says "degraded";
 * nothing on the loop ever waits for etcd.
 *
 * Without Etcd= the subsystem only reports the static membership on the bus. */

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <systemd/sd-event.h>

#include "cluster/membership.h"
#include "core/manager.h"

typedef struct ClusterEvent ClusterEvent;

typedef struct ClusterManager {
        Manager *manager;
        bool etcd;               /* Etcd= configured */
        Membership *members;
        char *key;               /* PREFIX members/HOST_ID */
        char *value;             /* this host's record (JSON) */
        MemberInfo self;         /* what it says */
        /* What the threads read of the configuration, copied at start: a reload swaps
         * Manager.config for its checks while they run. */
        char *prefix;            /* EtcdPrefix= */
        char *members_prefix;    /* EtcdPrefix= + members/: what is read and watched */
        unsigned max_members;    /* MaxMembers= */
        uint64_t foreign_started; /* another registration of our host id, reported */
        int64_t ttl_sec;

        /* Threads and what they post. */
        atomic_bool stop;
        atomic_bool session_cancel; /* the session client's cancel flag: set with stop, cleared
                                     * by the session thread for its lease revoke on the way out */
        struct EtcdClient *probe; /* the session's probe client while it has one (lock) */
        atomic_bool key_lost;    /* this host's key is gone from etcd while its lease lives:
                                  * the session thread registers again */
        pthread_t session_thread, watch_thread;
        struct EtcdClient *session_client, *watch_client; /* one per thread */
        bool session_started, watch_started;
        pthread_mutex_t lock;
        pthread_cond_t cond;     /* wakes the threads' sleeps on stop */
        ClusterEvent *queue, *queue_tail;
        int efd;
        sd_event_source *efd_source;
        sd_event_source *tick;   /* missing members' deadlines */

        /* As the threads last reported (loop side). */
        bool session_up, watch_up, ever_up;
        uint64_t lease;
        char session_error[256], watch_error[256];
        char endpoint[256];
} ClusterManager;

extern const Subsystem cluster_subsystem;

/* The etcd side (cluster-etcd.c; cluster-etcd-none.c without libcurl and json-c):
 * start registers this host's record and starts the threads, stop ends them (the
 * session revokes its lease on the way) and drops what they posted. */
int cluster_etcd_start(ClusterManager *cm);
void cluster_etcd_stop(ClusterManager *cm);
/* Wakes the session thread to put this host's record again under a new lease (its key
 * was deleted, or a resync did not find it, while the session was up). */
void cluster_etcd_register_again(ClusterManager *cm);
/* What the threads learned, applied on the loop (cluster-manager.c). */
void cluster_on_session(ClusterManager *cm, bool up, uint64_t lease, const char *error, const char *endpoint);
void cluster_on_watch(ClusterManager *cm, bool up, const char *error);
void cluster_on_resync(ClusterManager *cm, int64_t revision, const MemberInfo *infos, size_t n, bool partial);
void cluster_on_put(ClusterManager *cm, const MemberInfo *info);
void cluster_on_delete(ClusterManager *cm, const char *host_id, int64_t revision, bool invalid);

/* For the bus glue. */
const char *cluster_source(ClusterManager *cm);
const char *cluster_etcd_state(ClusterManager *cm);
const char *cluster_etcd_reason(ClusterManager *cm);
