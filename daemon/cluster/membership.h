/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Membership: which epdd hosts are in the cluster, as the coordination service (etcd)
 * says, applied in revision order. Pure: no sockets, threads or event loop; the
 * cluster manager feeds it what its etcd threads read and acts on what it reports.
 *
 * Each host registers a key under the cluster's prefix, bound to a lease it keeps
 * alive. The watch reports puts and deletes (a delete: the lease expired or was
 * revoked: the member is gone). When the watch had to be started again (etcd was
 * unreachable, or the history was compacted), a full read of the prefix (a resync)
 * replaces what is known: a member absent from it is not dropped at once but becomes
 * MISSING for a grace period (its lease may simply not be back yet after an etcd
 * restart), and goes only if it has not come back by then. While etcd cannot be
 * reached, nothing changes: the last known membership stays, and the state says so.
 *
 * Events (join, update, leave) go to one callback, in the order they happen. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "time-util.h"

#define MEMBER_HOST_ID_MAX 63
#define MEMBER_ADDRESS_MAX 63
#define MEMBER_FIELD_MAX 255
#define MEMBER_MAC_SIZE 32  /* HMAC-SHA256 */

typedef struct MemberInfo {
        char host_id[MEMBER_HOST_ID_MAX + 1];
        char address[MEMBER_ADDRESS_MAX + 1];   /* numeric HOST:PORT of its peer listener */
        char transports[MEMBER_FIELD_MAX + 1];  /* "tcp", "tcp,rdma" */
        char arenas[MEMBER_FIELD_MAX + 1];      /* "kv0:host:64M,feat0:host:64M" */
        char nics[MEMBER_FIELD_MAX + 1];        /* NIC topology summary */
        uint32_t gpus;
        uint64_t started_usec;                  /* CLOCK_REALTIME, tells restarts apart */
        uint8_t mac[MEMBER_MAC_SIZE];           /* over the fields above (member-record.h) */
        bool has_mac;                           /* the record carried one */
        uint64_t lease;                         /* etcd lease id (from the key, not the value) */
        int64_t revision;                       /* etcd mod_revision of the key */
} MemberInfo;

typedef enum MemberState {
        MEMBER_ALIVE,   /* its key is in etcd */
        MEMBER_MISSING, /* absent from the last resync: gone unless back within the grace */
        _MEMBER_STATE_MAX,
} MemberState;

typedef enum MembershipEvent {
        MEMBERSHIP_JOIN,   /* a new member (or one that had left) */
        MEMBERSHIP_UPDATE, /* its record changed (address, restart, lease) */
        MEMBERSHIP_LEAVE,  /* its key went, or it stayed missing past the grace */
} MembershipEvent;

typedef enum EtcdLink {
        ETCD_LINK_CONNECTING, /* not yet registered and watching */
        ETCD_LINK_UP,         /* registered under a live lease, watch running */
        ETCD_LINK_DEGRADED,   /* unreachable: serving on the last known membership */
        _ETCD_LINK_MAX,
} EtcdLink;

typedef struct Member {
        MemberInfo info;
        MemberState state;
        usec_t missing_deadline; /* MEMBER_MISSING: when it leaves */
        usec_t joined_usec;      /* CLOCK_MONOTONIC */
        uint64_t epoch;          /* internal: the last resync that saw it */
} Member;

typedef struct Membership Membership;
typedef void (*MembershipEventFn)(void *userdata, MembershipEvent ev, const Member *m, const char *why);

/* self: this host's id (its own key is not a member: it is this host). max: bound on
 * members; a join past it is refused (counted in refused). grace: how long a member
 * missing from a resync stays. */
int membership_new(Membership **ret, const char *self, size_t max, usec_t grace, MembershipEventFn fn,
                   void *userdata);
Membership *membership_free(Membership *ms);

/* A put seen by the watch. Older revisions than the member's are ignored. -EINVAL for
 * an invalid record; 0 applied or ignored; -ENOSPC past the bound: the record then waits
 * (the latest of each host, at most 64) and joins when a member leaves, unless its host's
 * delete comes first. */
int membership_put(Membership *ms, const MemberInfo *info);
/* A delete seen by the watch (lease expired or revoked, key deleted). */
int membership_delete(Membership *ms, const char *host_id, int64_t revision, const char *why);

/* A resync: begin, put every key of the read, end. Members not in it become MISSING
 * (deadline now + grace); members in it are ALIVE again. A resync's records are what etcd
 * holds (never stale); a resync at a revision below the known one (etcd lost its data)
 * starts the revisions over. */
void membership_resync_begin(Membership *ms, int64_t revision);
int membership_resync_put(Membership *ms, const MemberInfo *info);
/* listed_up_to: NULL for a whole read; for one cut short (at MaxMembers= records, the
 * first in key order), the last host id it listed: members after it are not taken for
 * missing, those before it that it did not list are. */
void membership_resync_end(Membership *ms, usec_t now, const char *listed_up_to);
/* Members missing past their deadline leave. Returns the next deadline (USEC_INFINITY
 * if none). */
usec_t membership_tick(Membership *ms, usec_t now);

void membership_set_link(Membership *ms, EtcdLink link, const char *why);
EtcdLink membership_link(const Membership *ms);
const char *membership_link_reason(const Membership *ms);
int64_t membership_revision(const Membership *ms);

const Member *membership_get(const Membership *ms, const char *host_id);
size_t membership_size(const Membership *ms);
/* Iteration in no particular order: `for (size_t i = 0; (m = membership_member(ms, i)); i++)`. */
const Member *membership_member(const Membership *ms, size_t i);

typedef struct MembershipStats {
        uint64_t joins, updates, leaves;
        uint64_t resyncs;
        uint64_t refused;       /* joins past the bound */
        uint64_t admitted;      /* refused records taken later, when a place freed */
        uint64_t stale;         /* puts or deletes older than what is known */
        uint64_t revision_resets; /* resyncs at a revision below the known one (etcd lost its data) */
        uint64_t link_changes;
} MembershipStats;
void membership_stats(const Membership *ms, MembershipStats *ret);

/* Whether this host's key is gone from etcd, by a view of etcd at `revision` that lacks
 * it (a resync that did not list it, a delete of it, a record there that is not valid):
 * only while the session is up, and only for a view at or after the put that registered
 * it (put_revision, the put's own revision, as etcd answered it). The watch thread's
 * first read may be taken before the session's put but reach the loop after the session
 * said it was up: that read says nothing of the key, and taking it for a loss put the key
 * again under a new lease (an extra UPDATE on every member). */
bool membership_self_key_lost(bool session_up, int64_t put_revision, int64_t revision);

const char *member_state_to_string(MemberState s);
const char *etcd_link_to_string(EtcdLink l);
/* Checks a record's fields (host id charset, numeric address, lengths). */
bool member_info_is_valid(const MemberInfo *info);
