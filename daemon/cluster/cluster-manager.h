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
 * handoffs with it roll back, its directory records go, its shards move). Records are
 * signed with the cluster key (member-record.h): one that does not verify is refused
 * (never applied, never dialed; listed with lease "refused"). While etcd
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
struct PeerAuthKey;

/* A member record in etcd that was refused: not signed with the cluster key
 * (member_record_verify()). Its member is not one (it never is dialed at what the record
 * says); ListMembers shows it, lease "refused". */
typedef struct MemberRefusal {
        char host_id[MEMBER_HOST_ID_MAX + 1];
        char address[MEMBER_ADDRESS_MAX + 1]; /* what the record claims: never dialed */
        int error;                            /* -ENOKEY (unsigned) or -EPERM (MAC refused) */
        int64_t revision;                     /* the key's mod_revision */
} MemberRefusal;

/* Refused records kept for ListMembers (the latest of each host). */
#define CLUSTER_REFUSED_MAX 64

typedef struct ClusterManager {
        Manager *manager;
        bool etcd;               /* Etcd= configured */
        Membership *members;
        char *key;               /* PREFIX members/HOST_ID */
        char *value;             /* this host's record (JSON), signed */
        MemberInfo self;         /* what it says */
        struct PeerAuthKey *auth_key; /* ClusterKeyFile=: signs this record, verifies the others'
                                       * (read-only once the threads run) */
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
        int64_t put_revision;    /* of the put that registered this host's key (0: unknown) */
        bool registering_again;  /* asked for since the last put reported: no second ask */
        int64_t lost_revision;   /* meanwhile, the latest view that said the key is lost */
        MemberRefusal refused[CLUSTER_REFUSED_MAX]; /* refused records in etcd now */
        size_t n_refused;
        uint64_t records_refused; /* refused records seen, each once (host, revision) */
        usec_t refusal_log_window; /* rate limit of their warnings */
        unsigned refusal_logged;
        uint64_t refusal_unlogged;
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
/* put_revision: the revision of the put that registered this host's key (up). */
void cluster_on_session(ClusterManager *cm, bool up, uint64_t lease, int64_t put_revision, const char *error,
                        const char *endpoint);
void cluster_on_watch(ClusterManager *cm, bool up, const char *error);
/* refused[n_refused]: the records of the read that were refused (at most
 * CLUSTER_REFUSED_MAX of them, of refused_total). */
void cluster_on_resync(ClusterManager *cm, int64_t revision, const MemberInfo *infos, size_t n, bool partial,
                       const MemberRefusal *refused, size_t n_refused, uint64_t refused_total);
void cluster_on_put(ClusterManager *cm, const MemberInfo *info);
/* refusal: a put of a record that was refused (invalid is then true too), else NULL. */
void cluster_on_delete(ClusterManager *cm, const char *host_id, int64_t revision, bool invalid,
                       const MemberRefusal *refusal);
/* The refused record of host_id, or NULL; the i-th, or NULL past the last. */
const MemberRefusal *cluster_refusal(ClusterManager *cm, const char *host_id);
const MemberRefusal *cluster_refusal_at(ClusterManager *cm, size_t i);
/* Why a record was refused (MemberRefusal.error), in words. */
const char *cluster_refusal_reason(int error);

/* For the bus glue. */
const char *cluster_source(ClusterManager *cm);
const char *cluster_etcd_state(ClusterManager *cm);
const char *cluster_etcd_reason(ClusterManager *cm);
