/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "cluster/cluster-manager.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/bus-cluster.h"
#include "log.h"
#include "macro.h"
#include "peer/peer-manager.h"
#include "peer/topology.h"
#include "utf8.h"

/* ---- the loop side ---- */

static void refresh_link(ClusterManager *cm) {
        EtcdLink before = membership_link(cm->members), link;
        char why[300];

        if (cm->session_up && cm->watch_up) {
                link = ETCD_LINK_UP;
                snprintf(why, sizeof why, "registered at %s, lease %" PRIx64, cm->endpoint, cm->lease);
                cm->ever_up = true;
        } else {
                const char *e = !cm->session_up && cm->session_error[0] ? cm->session_error : cm->watch_error;
                /* Not yet registered and not failing: still connecting. */
                link = e[0] ? ETCD_LINK_DEGRADED : ETCD_LINK_CONNECTING;
                snprintf(why, sizeof why, "%s", e[0] ? e : "connecting");
        }
        utf8_make_valid(why); /* etcd's or a proxy's text, cut: it is the EtcdReason property */
        if (link == before && strcmp(why, membership_link_reason(cm->members)) == 0)
                return;
        membership_set_link(cm->members, link, why);
        if (link == ETCD_LINK_DEGRADED && before != ETCD_LINK_DEGRADED)
                log_warning("cluster: etcd unreachable (%s); serving on the last known membership of %zu member(s)",
                            why, membership_size(cm->members));
        else if (link == ETCD_LINK_UP && before != ETCD_LINK_UP)
                log_info("cluster: %s", why);
        bus_cluster_emit_state(cm->manager);
}

static void arm_tick(ClusterManager *cm, usec_t next) {
        if (next == USEC_INFINITY) {
                (void)sd_event_source_set_enabled(cm->tick, SD_EVENT_OFF);
                return;
        }
        (void)sd_event_source_set_time(cm->tick, next);
        (void)sd_event_source_set_enabled(cm->tick, SD_EVENT_ONESHOT);
}

static void own_key_lost(ClusterManager *cm, int64_t revision, const char *why);

void cluster_on_session(ClusterManager *cm, bool up, uint64_t lease, int64_t put_revision, const char *error,
                        const char *endpoint) {
        int64_t lost = 0;

        /* A new put (or none now): a loss of the key may be asked about again. */
        if (!up || put_revision == 0 || put_revision != cm->put_revision) {
                if (cm->registering_again)
                        lost = cm->lost_revision;
                cm->registering_again = false;
                cm->lost_revision = 0;
        }
        cm->session_up = up;
        cm->lease = up ? lease : 0;
        cm->put_revision = up ? put_revision : 0;
        snprintf(cm->session_error, sizeof cm->session_error, "%s", error ?: "");
        if (endpoint && endpoint[0])
                snprintf(cm->endpoint, sizeof cm->endpoint, "%s", endpoint);
        refresh_link(cm);
        bus_cluster_emit_lease(cm->manager);
        /* Said lost again while the put that answered was under way: by a view at or
         * after that put (the key overwritten again since), lost again. */
        if (up && lost > 0)
                own_key_lost(cm, lost, "was deleted or overwritten again after it was put");
}

void cluster_on_watch(ClusterManager *cm, bool up, const char *error) {
        cm->watch_up = up;
        snprintf(cm->watch_error, sizeof cm->watch_error, "%s", error ?: "");
        refresh_link(cm);
}

/* This host's own key, as etcd has it: another epdd with the same HostId= overwrote it. */
static void check_own_key(ClusterManager *cm, const MemberInfo *info) {
        if (strcmp(info->host_id, cm->self.host_id) != 0 || info->started_usec == cm->self.started_usec)
                return;
        if (info->started_usec == cm->foreign_started)
                return; /* said already */
        cm->foreign_started = info->started_usec;
        log_error("cluster: another epdd registered this host id (%s) in etcd from %s: host ids must be unique",
                  info->host_id, info->address);
}

/* This host's key is gone from etcd while its session is up (deleted by hand, or by
 * another epdd with the same HostId= that stopped and revoked its lease, or overwritten
 * with a record that is not valid): without a new put, every other member would drop
 * this host for as long as it runs. revision: of the view that says so; one from before
 * the put that registered the key (the watch's first read, taken before the session's
 * put and applied after it) says nothing. */
static void own_key_lost(ClusterManager *cm, int64_t revision, const char *why) {
        if (!membership_self_key_lost(cm->session_up, cm->put_revision, revision)) {
                if (cm->session_up)
                        log_debug("cluster: this host's key %s %s at revision %" PRId64 ", before its put at %" PRId64
                                  ": not lost",
                                  cm->key, why, revision, cm->put_revision);
                return; /* down: the session registers anyway when it comes back */
        }
        if (cm->registering_again) {
                /* Asked already, the put that answers not reported yet: whether this view
                 * comes after that put is known once it is. */
                cm->lost_revision = MAX(cm->lost_revision, revision);
                return;
        }
        cm->registering_again = true;
        log_warning("cluster: this host's key %s %s while its lease lives; registering again", cm->key, why);
        cluster_etcd_register_again(cm);
}

/* ---- records refused: not signed with the cluster key ---- */

#define REFUSAL_LOG_BURST 10
#define REFUSAL_LOG_INTERVAL_USEC (10 * USEC_PER_SEC)

/* At most REFUSAL_LOG_BURST warnings in REFUSAL_LOG_INTERVAL_USEC: whoever can write etcd
 * can put refused records without end. */
static void refusal_log(ClusterManager *cm, const MemberRefusal *f) {
        usec_t now = now_usec(CLOCK_MONOTONIC);

        if (cm->refusal_log_window == 0 || now >= cm->refusal_log_window + REFUSAL_LOG_INTERVAL_USEC) {
                if (cm->refusal_unlogged > 0)
                        log_warning("cluster: %" PRIu64 " more member records in etcd refused (not signed with the "
                                    "cluster key), not logged one by one",
                                    cm->refusal_unlogged);
                cm->refusal_log_window = now;
                cm->refusal_logged = 0;
                cm->refusal_unlogged = 0;
        }
        if (cm->refusal_logged >= REFUSAL_LOG_BURST) {
                cm->refusal_unlogged++;
                return;
        }
        cm->refusal_logged++;
        log_warning("cluster: member record of %s in etcd refused: %s; %s is not dialed (%" PRIu64
                    " record(s) refused so far)",
                    f->host_id, cluster_refusal_reason(f->error), f->address[0] ? f->address : "its address",
                    cm->records_refused);
}

const char *cluster_refusal_reason(int error) {
        switch (error) {
        case -ENOKEY:
                return "it is not signed (written by an epdd from before member records were signed, or by hand)";
        case -EPERM:
                return "its MAC does not verify with the cluster key (another key, or a field rewritten)";
        default:
                return "its MAC cannot be checked";
        }
}

static ssize_t refusal_find(ClusterManager *cm, const char *host_id) {
        for (size_t i = 0; i < cm->n_refused; i++)
                if (strcmp(cm->refused[i].host_id, host_id) == 0)
                        return (ssize_t)i;
        return -1;
}

static void refusal_forget(ClusterManager *cm, const char *host_id) {
        ssize_t i = refusal_find(cm, host_id);
        if (i < 0)
                return;
        memmove(cm->refused + i, cm->refused + i + 1, (cm->n_refused - (size_t)i - 1) * sizeof *cm->refused);
        cm->n_refused--;
}

/* Whether f is news: not the refused record of its host already known (a resync reads the
 * same ones again). */
static bool refusal_is_new(ClusterManager *cm, const MemberRefusal *f) {
        ssize_t i = refusal_find(cm, f->host_id);
        return i < 0 || cm->refused[i].revision != f->revision;
}

/* A refused record seen by the watch: counted, said, kept (its host's latest; past the
 * bound, the oldest goes). This host's own goes to own_key_lost() instead. */
static void refusal_note(ClusterManager *cm, const MemberRefusal *f) {
        if (!refusal_is_new(cm, f))
                return;
        cm->records_refused++;
        refusal_log(cm, f);
        if (strcmp(f->host_id, cm->self.host_id) == 0)
                return;
        refusal_forget(cm, f->host_id);
        if (cm->n_refused == CLUSTER_REFUSED_MAX) {
                memmove(cm->refused, cm->refused + 1, (CLUSTER_REFUSED_MAX - 1) * sizeof *cm->refused);
                cm->n_refused--;
        }
        cm->refused[cm->n_refused++] = *f;
}

const MemberRefusal *cluster_refusal(ClusterManager *cm, const char *host_id) {
        ssize_t i = cm && host_id ? refusal_find(cm, host_id) : -1;
        return i >= 0 ? &cm->refused[i] : NULL;
}

const MemberRefusal *cluster_refusal_at(ClusterManager *cm, size_t i) {
        return cm && i < cm->n_refused ? &cm->refused[i] : NULL;
}

void cluster_on_resync(ClusterManager *cm, int64_t revision, const MemberInfo *infos, size_t n, bool partial,
                       const MemberRefusal *refused, size_t n_refused, uint64_t refused_total) {
        usec_t now = now_usec(CLOCK_MONOTONIC);
        bool own = false, own_refused = false;
        size_t kept = 0;

        /* The refused records are the read's: what etcd holds now. */
        for (size_t i = 0; i < n_refused; i++) {
                if (refusal_is_new(cm, refused + i)) {
                        cm->records_refused++;
                        refusal_log(cm, refused + i);
                }
                if (strcmp(refused[i].host_id, cm->self.host_id) == 0)
                        own_refused = true;
        }
        for (size_t i = 0; i < n_refused && kept < CLUSTER_REFUSED_MAX; i++)
                if (strcmp(refused[i].host_id, cm->self.host_id) != 0)
                        cm->refused[kept++] = refused[i];
        cm->n_refused = kept;
        if (refused_total > n_refused)
                log_warning("cluster: %" PRIu64 " member records in etcd refused by a read (not signed with the "
                            "cluster key); %zu of them kept for ListMembers",
                            refused_total, kept);

        /* Another epdd's record under this host id, only in a read made after this one's
         * own put: a read before it (the watch's first, racing the session's lease and
         * put) finds the record of the epdd this one replaced, killed or crashed, its
         * lease still alive, which is no other epdd. */
        bool after_own_put = cm->session_up && cm->put_revision > 0 && revision >= cm->put_revision;
        membership_resync_begin(cm->members, revision);
        for (size_t i = 0; i < n; i++) {
                if (after_own_put)
                        check_own_key(cm, infos + i);
                own = own || strcmp(infos[i].host_id, cm->self.host_id) == 0;
        }
        if (!own)
                own_key_lost(cm, revision,
                             own_refused ? "holds a record not signed with the cluster key"
                                         : "is missing from a full read of etcd");
        const char *last = NULL; /* of a read cut short: the last other host it listed */
        for (size_t i = 0; i < n; i++) {
                if (membership_resync_put(cm->members, infos + i) == -ENOSPC)
                        log_warning("cluster: member %s refused: MaxMembers=%u reached", infos[i].host_id,
                                    cm->manager->config.max_members);
                if (strcmp(infos[i].host_id, cm->self.host_id) != 0 && (!last || strcmp(infos[i].host_id, last) > 0))
                        last = infos[i].host_id;
        }
        membership_resync_end(cm->members, now, partial ? last ?: "" : NULL);
        arm_tick(cm, membership_tick(cm->members, now));
}

void cluster_on_put(ClusterManager *cm, const MemberInfo *info) {
        check_own_key(cm, info);
        refusal_forget(cm, info->host_id);
        if (membership_put(cm->members, info) == -ENOSPC)
                log_warning("cluster: member %s refused: MaxMembers=%u reached", info->host_id,
                            cm->manager->config.max_members);
}

void cluster_on_delete(ClusterManager *cm, const char *host_id, int64_t revision, bool invalid,
                       const MemberRefusal *refusal) {
        if (refusal)
                refusal_note(cm, refusal);
        else
                refusal_forget(cm, host_id);
        if (strcmp(host_id, cm->self.host_id) == 0)
                own_key_lost(cm, revision,
                             refusal   ? "was overwritten with a record not signed with the cluster key"
                             : invalid ? "was overwritten with an invalid record"
                                       : "was deleted from etcd");
        (void)membership_delete(cm->members, host_id, revision,
                                refusal   ? "its record in etcd is not signed with the cluster key"
                                : invalid ? "its record in etcd was overwritten with one that is not valid"
                                          : "lease expired or revoked in etcd");
}

static int tick_cb(sd_event_source *s, uint64_t usec, void *userdata) {
        ClusterManager *cm = userdata;
        arm_tick(cm, membership_tick(cm->members, now_usec(CLOCK_MONOTONIC)));
        return 0;
}

/* What the Membership reports: members become peers, and stop being peers. */
static void on_member(void *userdata, MembershipEvent ev, const Member *mb, const char *why) {
        ClusterManager *cm = userdata;
        Manager *m = cm->manager;
        const char *host = mb->info.host_id;
        int r;

        switch (ev) {
        case MEMBERSHIP_JOIN:
        case MEMBERSHIP_UPDATE:
                if (mb->state == MEMBER_MISSING) {
                        log_info("cluster: member %s missing from etcd (%s); kept for the grace period", host, why);
                        break;
                }
                r = peer_manager_add_member(m->peers, host, mb->info.address, NULL);
                if (r == -EEXIST)
                        log_debug("cluster: member %s is a configured peer; its [Peer:] section applies", host);
                else if (r < 0)
                        log_warning_errno(r, "cluster: cannot add member %s at %s: %m", host, mb->info.address);
                else if (ev == MEMBERSHIP_JOIN)
                        log_info("cluster: member %s joined at %s (%s)", host, mb->info.address, why);
                /* Once for a resync's burst of joins, not once per member (each
                 * refresh resolves every live peer's path: quadratic on the loop). A
                 * member that comes back is resolved again there. */
                topology_refresh_soon(m->topology);
                break;
        case MEMBERSHIP_LEAVE:
                log_info("cluster: member %s left (%s)", host, why);
                r = peer_manager_retire_member(m->peers, host);
                if (r < 0 && r != -ENOENT && r != -EPERM)
                        log_warning_errno(r, "cluster: cannot retire member %s: %m", host);
                /* Its path says it left (and is no longer resolved) from then on. */
                topology_refresh_soon(m->topology);
                break;
        }
        bus_cluster_emit_member(m, host,
                                ev == MEMBERSHIP_JOIN ? "joined" : ev == MEMBERSHIP_LEAVE ? "left" : "updated", why);
}

/* ---- subsystem ---- */

static ClusterManager *cluster_free(ClusterManager *cm) {
        if (!cm)
                return NULL;
        cluster_etcd_stop(cm);
        sd_event_source_disable_unref(cm->tick);
        if (cm->efd >= 0)
                close(cm->efd);
        membership_free(cm->members);
        pthread_cond_destroy(&cm->cond);
        pthread_mutex_destroy(&cm->lock);
        free(cm->key);
        free(cm->value);
        free(cm->prefix);
        free(cm->members_prefix);
        free(cm);
        return NULL;
}

static int cluster_init(Manager *m) {
        ClusterManager *cm;
        pthread_condattr_t ca;
        int r;

        if (!m->peers)
                return 0; /* single host: no membership to speak of */
        cm = calloc(1, sizeof *cm);
        if (!cm)
                return -ENOMEM;
        cm->manager = m;
        cm->efd = -1;
        pthread_mutex_init(&cm->lock, NULL);
        pthread_condattr_init(&ca);
        pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* nap() waits on CLOCK_MONOTONIC */
        pthread_cond_init(&cm->cond, &ca);
        pthread_condattr_destroy(&ca);
        cm->etcd = m->config.etcd_endpoints != NULL;
        if (cm->etcd) {
                const Config *c = &m->config;
                /* A member missing after a resync gets as long as a lease lasts to come back. */
                r = membership_new(&cm->members, c->host_id, c->max_members, c->etcd_lease_ttl_usec, on_member, cm);
                if (r >= 0)
                        r = sd_event_add_time(m->event, &cm->tick, CLOCK_MONOTONIC, USEC_INFINITY, 0, tick_cb, cm);
                if (r >= 0)
                        r = sd_event_source_set_enabled(cm->tick, SD_EVENT_OFF);
                if (r >= 0)
                        r = cluster_etcd_start(cm);
                if (r < 0) {
                        cluster_free(cm);
                        return log_error_errno(r, "cluster: cannot start the etcd membership: %m");
                }
        }
        m->cluster = cm;
        return 0;
}

static void cluster_done(Manager *m) {
        m->cluster = cluster_free(m->cluster);
}

const char *cluster_source(ClusterManager *cm) {
        return cm && cm->etcd ? "etcd" : "static";
}

const char *cluster_etcd_state(ClusterManager *cm) {
        if (!cm || !cm->etcd)
                return "off";
        return etcd_link_to_string(membership_link(cm->members));
}

const char *cluster_etcd_reason(ClusterManager *cm) {
        if (!cm || !cm->etcd)
                return "";
        return membership_link_reason(cm->members);
}

/* [Cluster] EtcdKeyFile= is a TLS private key, checked as ClusterKeyFile= is
 * (peer-auth.c): a regular file nobody but its owner may read or write. Start-up,
 * --check-config and a reload refuse another (curl took any). */
static int cluster_verify(Manager *m) {
        const char *path = m->config.etcd_key_file, *why = NULL;

        if (!path || !m->config.etcd_endpoints)
                return 0;
        _cleanup_(closep) int fd = config_secret_file_open(path, &why);
        if (fd < 0 && why) /* "it is ...": said of the file by name */
                return log_error_errno(fd, "cluster: [Cluster] EtcdKeyFile= %s %s.", path,
                                       strncmp(why, "it ", 3) == 0 ? why + 3 : why);
        if (fd < 0)
                return log_error_errno(fd, "cluster: cannot read [Cluster] EtcdKeyFile= %s: %m", path);
        return 0;
}

const Subsystem cluster_subsystem = {
        .name = "cluster",
        .verify = cluster_verify,
        .init = cluster_init,
        .done = cluster_done,
        .add_bus = bus_cluster_add,
};
