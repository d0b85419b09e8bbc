/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The etcd side of the ClusterManager: the session and watch threads (libcurl through
 * etcd's JSON gateway) and the queue through which they post to the event loop
 * (an eventfd). Everything here but efd_io() runs on the threads; efd_io() hands each
 * event to cluster-manager.c on the loop. */
#include "cluster/cluster-manager.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "cluster/etcd-client.h"
#include "cluster/etcd-json.h"
#include "cluster/member-record.h"
#include "log.h"
#include "macro.h"
#include "time-util.h"
#include "peer/peer-auth.h"
#include "peer/peer-manager.h"
#include "peer/topology.h"
#include "transport/rdma.h"

#define CALL_TIMEOUT_MS 2000L
#define BACKOFF_MIN_MS 100
#define BACKOFF_MAX_MS 2000

typedef enum ClusterEventType {
        EV_SESSION,   /* up (lease) or down (error) */
        EV_WATCH,     /* up or down (error) */
        EV_RESYNC,    /* a full read: infos[n] at revision */
        EV_PUT,
        EV_DELETE,
} ClusterEventType;

struct ClusterEvent {
        ClusterEventType type;
        bool up;
        uint64_t lease;
        int64_t revision;        /* EV_SESSION: of the put that registered this host */
        char text[256];          /* error, or the deleted host id */
        char endpoint[256];
        MemberInfo *infos;       /* EV_RESYNC: n; EV_PUT: 1 */
        bool partial;            /* EV_RESYNC: records past MaxMembers= were left out */
        bool invalid;            /* EV_DELETE: a PUT of a record that is not valid */
        size_t n;
        MemberRefusal *refused;  /* EV_RESYNC: n_refused records refused (of refused_total);
                                  * EV_DELETE: 1, a put of a record refused */
        size_t n_refused;
        uint64_t refused_total;
        ClusterEvent *next;
};

/* ---- posting from the threads ---- */

static void post(ClusterManager *cm, ClusterEvent *ev) {
        uint64_t one = 1;

        pthread_mutex_lock(&cm->lock);
        if (cm->queue_tail)
                cm->queue_tail->next = ev;
        else
                cm->queue = ev;
        cm->queue_tail = ev;
        pthread_mutex_unlock(&cm->lock);
        (void)!write(cm->efd, &one, sizeof one);
}

static ClusterEvent *event_new(ClusterEventType type) {
        ClusterEvent *ev = calloc(1, sizeof *ev);
        if (ev)
                ev->type = type;
        return ev;
}

static void post_state(ClusterManager *cm, ClusterEventType type, bool up, uint64_t lease, int64_t revision,
                       const char *text, EtcdClient *c) {
        ClusterEvent *ev = event_new(type);
        if (!ev)
                return;
        ev->up = up;
        ev->lease = lease;
        ev->revision = revision;
        snprintf(ev->text, sizeof ev->text, "%s", text ?: "");
        snprintf(ev->endpoint, sizeof ev->endpoint, "%s", c ? etcd_client_endpoint(c) : "");
        post(cm, ev);
}

/* Sleeps up to ms, or until stop. Returns true when stopping. */
static bool nap(ClusterManager *cm, long ms, bool session) {
        struct timespec ts;
        bool stop;

        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_sec += ms / 1000;
        ts.tv_nsec += (ms % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000L;
        }
        pthread_mutex_lock(&cm->lock);
        while (!(stop = atomic_load(&cm->stop)) && !(session && atomic_load(&cm->key_lost)))
                if (pthread_cond_timedwait(&cm->cond, &cm->lock, &ts) == ETIMEDOUT)
                        break;
        pthread_mutex_unlock(&cm->lock);
        return stop || atomic_load(&cm->stop);
}

void cluster_etcd_register_again(ClusterManager *cm) {
        if (!cm->session_started)
                return;
        pthread_mutex_lock(&cm->lock);
        atomic_store(&cm->key_lost, true);
        pthread_cond_broadcast(&cm->cond);
        pthread_mutex_unlock(&cm->lock);
}

static EtcdClient *client_new(ClusterManager *cm, const atomic_bool *cancel) {
        const Config *c = &cm->manager->config;
        EtcdTls tls = { c->etcd_ca_file, c->etcd_cert_file, c->etcd_key_file };
        EtcdClient *ec;

        return etcd_client_new(&ec, c->etcd_endpoints, &tls, cancel) < 0 ? NULL : ec;
}

/* ---- the session thread: lease, registration, keepalives ---- */

/* A keepalive gives each endpoint a third of the lease's TTL (at most CALL_TIMEOUT_MS)
 * and the whole call until 9/10 of the TTL after the last one that etcd answered (at
 * least one attempt): an endpoint that hangs (connected, answering nothing) costs the
 * call one attempt, and the next endpoint is asked while the lease still lives. */
static long keepalive_attempt_ms(int64_t ttl_sec) {
        return CLAMP((long)ttl_sec * 1000 / 3, 100L, CALL_TIMEOUT_MS);
}

typedef struct Session {
        ClusterManager *cm;
        EtcdClient *c;
        ssize_t hung_said;     /* the hung endpoint said last, or -1 */
        EtcdClient *probe;     /* watch_endpoint_check()'s client, of one endpoint */
        size_t probe_for;
} Session;

/* After each call: an endpoint it found hung is said once, and the watch's attempt on
 * it (a stream open and silent) ended so that it reads again through the next one. */
static void endpoint_hung(Session *s, bool ok) {
        long ms;
        ssize_t h = etcd_client_hung(s->c, &ms);

        if (h < 0)
                return;
        if (h != s->hung_said) {
                if (ok)
                        log_warning("cluster: etcd endpoint %s stopped answering (nothing within %ld ms); going on "
                                    "with %s",
                                    etcd_client_endpoint_at(s->c, (size_t)h), ms, etcd_client_endpoint(s->c));
                else
                        log_warning("cluster: etcd endpoint %s stopped answering (nothing within %ld ms)",
                                    etcd_client_endpoint_at(s->c, (size_t)h), ms);
        }
        s->hung_said = h;
        etcd_client_abandon(s->cm->watch_client, (size_t)h, now_usec(CLOCK_MONOTONIC));
}

static int call(Session *s, const char *path, char *body, char **ret, size_t *ret_len, char *err, size_t n) {
        int r;
        if (!body)
                return -ENOMEM;
        r = etcd_client_call(s->c, path, body, CALL_TIMEOUT_MS, ret, ret_len, err, n);
        free(body);
        endpoint_hung(s, r >= 0);
        return r;
}

/* A lease, and this host's record put under it: *ret_revision is the put's revision. */
static int session_register(Session *s, uint64_t *ret_lease, int64_t *ret_revision, char *err, size_t n) {
        ClusterManager *cm = s->cm;
        char *ans = NULL;
        size_t len;
        int64_t ttl;
        int r;

        r = call(s, "/v3/lease/grant", etcd_json_lease_grant_request(cm->ttl_sec), &ans, &len, err, n);
        if (r >= 0)
                r = etcd_json_lease_grant(ans, len, ret_lease, &ttl, err, n);
        free(ans);
        ans = NULL;
        if (r < 0)
                return r;
        r = call(s, "/v3/kv/put", etcd_json_put_request(cm->key, cm->value, strlen(cm->value), *ret_lease), &ans,
                 &len, err, n);
        if (r >= 0)
                r = etcd_json_put(ans, len, ret_revision, err, n);
        free(ans);
        if (r < 0 && !atomic_load(&cm->stop)) {
                /* The next try grants a lease of its own: this one goes now, not at the
                 * end of its TTL (a put refused for good would otherwise leave one per
                 * retry). Best effort, within half a second. */
                char *body = etcd_json_lease_id_request(*ret_lease);
                ans = NULL;
                if (body)
                        (void)etcd_client_call_within(s->c, "/v3/lease/revoke", body, 500, 500, &ans, NULL, NULL, 0);
                free(ans);
                free(body);
                *ret_lease = 0;
        }
        return r;
}

/* The session's probe client: freed (when replaced) and published under the lock, so
 * that cluster_etcd_stop() can wake a probe in progress. */
static void probe_set(Session *s, EtcdClient *p) {
        ClusterManager *cm = s->cm;
        pthread_mutex_lock(&cm->lock);
        EtcdClient *old = s->probe;
        s->probe = cm->probe = p;
        pthread_mutex_unlock(&cm->lock);
        etcd_client_free(old);
}

/* The watch may follow an endpoint the session does not use (each fails over on its
 * own), where the session's keepalives cannot find it hung: that endpoint is asked for
 * its status within min(ms, a keepalive's attempt), on a client of its own kept while
 * the watch stays there; hung, the watch's stream on it ends. */
static void watch_endpoint_check(Session *s, long ms) {
        ClusterManager *cm = s->cm;
        ssize_t w = etcd_client_busy(cm->watch_client);
        char *ans = NULL, err[256];

        /* Ending: abandoned by a call of the session that found it hung, its thread not
         * yet woken (the next keepalive may come at once, after a call that took the
         * hung endpoint's whole attempt). */
        if (w < 0 || (size_t)w == etcd_client_current(s->c) || etcd_client_busy_ending(cm->watch_client))
                return; /* not streaming, followed by the session too, or ending */
        if (s->probe && s->probe_for != (size_t)w)
                probe_set(s, NULL);
        if (!s->probe) {
                EtcdClient *p;
                if (etcd_client_new_one(&p, cm->watch_client, (size_t)w) < 0)
                        return; /* out of memory: the next keepalive tries again */
                probe_set(s, p);
                s->probe_for = (size_t)w;
        }
        long attempt = MIN(keepalive_attempt_ms(cm->ttl_sec), ms);
        if (attempt < 100)
                return; /* no time before the next keepalive */
        usec_t start = now_usec(CLOCK_MONOTONIC);
        int r = etcd_client_call_within(s->probe, "/v3/maintenance/status", "{}", attempt, attempt, &ans, NULL, err,
                                        sizeof err);
        free(ans);
        if (r < 0 && etcd_client_hung(s->probe, NULL) == 0) {
                log_warning("cluster: etcd endpoint %s, which the watch follows, stopped answering (nothing within "
                            "%ld ms); the watch reads again through the next one",
                            etcd_client_endpoint_at(s->c, (size_t)w), attempt);
                /* Only an attempt begun before the probe: a later one is a new chance. */
                etcd_client_abandon(cm->watch_client, (size_t)w, start);
        }
}

static void *session_main(void *userdata) {
        ClusterManager *cm = userdata;
        Session s = { .cm = cm, .c = cm->session_client, .hung_said = -1 };
        EtcdClient *c = s.c;
        long backoff = BACKOFF_MIN_MS;
        usec_t period = (usec_t)cm->ttl_sec * USEC_PER_SEC / 3;
        uint64_t lease = 0;
        int64_t put_revision = 0;
        char err[256];

        while (!atomic_load(&cm->stop)) {
                atomic_store(&cm->key_lost, false); /* this put is the one asked for */
                usec_t refreshed = now_usec(CLOCK_MONOTONIC); /* the lease is no older than this */
                int r = session_register(&s, &lease, &put_revision, err, sizeof err);
                if (r < 0 && atomic_load(&cm->stop))
                        break; /* ended by the stop (a lease granted meanwhile is revoked below) */
                if (r < 0) {
                        lease = 0;
                        if (!err[0])
                                snprintf(err, sizeof err, "%s: %s", etcd_client_endpoint(c), strerror(-r));
                        post_state(cm, EV_SESSION, false, 0, 0, err, c);
                        if (nap(cm, backoff, true))
                                break;
                        backoff = MIN(backoff * 2, (long)BACKOFF_MAX_MS);
                        continue;
                }
                backoff = BACKOFF_MIN_MS;
                post_state(cm, EV_SESSION, true, lease, put_revision, "", c);
                size_t registered_at = etcd_client_current(c);
                /* Keepalives every third of the TTL after the last one etcd answered
                 * (whatever a probe took meanwhile), until the lease is lost or etcd
                 * stops answering. */
                for (;;) {
                        usec_t now = now_usec(CLOCK_MONOTONIC), next = refreshed + period;
                        if (nap(cm, next > now ? (long)((next - now) / 1000) : 0, true))
                                break;
                        char *ans = NULL, *body;
                        size_t len;
                        int64_t ttl = 0;

                        if (atomic_exchange(&cm->key_lost, false)) {
                                /* The key is gone but the lease lives: a new lease and put
                                 * (the old lease, without keys now, expires unrefreshed). */
                                break;
                        }

                        now = now_usec(CLOCK_MONOTONIC);
                        usec_t until = refreshed + (usec_t)cm->ttl_sec * 900000;
                        long attempt = keepalive_attempt_ms(cm->ttl_sec);
                        body = etcd_json_lease_id_request(lease);
                        r = body ? etcd_client_call_within(c, "/v3/lease/keepalive", body, attempt,
                                                           until > now ? MAX((long)((until - now) / 1000), attempt)
                                                                       : attempt,
                                                           &ans, &len, err, sizeof err)
                                 : -ENOMEM;
                        free(body);
                        endpoint_hung(&s, r >= 0);
                        if (r >= 0)
                                r = etcd_json_keepalive(ans, len, &ttl, err, sizeof err);
                        free(ans);
                        if (r >= 0 && ttl == 0) {
                                snprintf(err, sizeof err, "lease %" PRIx64 " expired in etcd; registering again", lease);
                                r = -ENOENT;
                        }
                        if (r < 0 && atomic_load(&cm->stop))
                                break; /* ended by the stop: nothing to report */
                        if (r < 0) {
                                if (!err[0])
                                        snprintf(err, sizeof err, "keepalive: %s", strerror(-r));
                                post_state(cm, EV_SESSION, false, 0, 0, err, c);
                                break;
                        }
                        refreshed = now;
                        if (etcd_client_current(c) != registered_at) {
                                /* Moved on to another endpoint: EtcdReason names it. */
                                registered_at = etcd_client_current(c);
                                post_state(cm, EV_SESSION, true, lease, put_revision, "", c);
                        }
                        now = now_usec(CLOCK_MONOTONIC);
                        next = refreshed + period;
                        watch_endpoint_check(&s, next > now ? (long)((next - now) / 1000) : 0);
                }
        }
        probe_set(&s, NULL);
        /* A clean stop revokes the lease: the others see this host leave at once
         * instead of after the TTL. Best effort: on a client no longer cancelled (stop
         * set session_cancel before stop, which ended the loop). */
        atomic_store(&cm->session_cancel, false);
        char *body = lease ? etcd_json_lease_id_request(lease) : NULL;
        if (body) {
                /* Half a second in all, first at the endpoint that answered last: with
                 * every endpoint hung, half a second each would hold the stop longer. */
                char *ans = NULL;
                (void)etcd_client_call_within(c, "/v3/lease/revoke", body, 500, 500, &ans, NULL, NULL, 0);
                free(ans);
                free(body);
        }
        return NULL;
}

/* ---- the watch thread: read the prefix, then follow it ---- */

typedef struct WatchCtx {
        ClusterManager *cm;
        EtcdClient *c;
        MemberInfo *infos;
        size_t n, cap;
        size_t n_others, skipped; /* records of other hosts taken, and past MaxMembers= */
        bool own_seen;         /* this host's record is among infos */
        int64_t revision;      /* the last revision seen */
        bool created;          /* the watch's stream was created, in this attempt */
        MemberRefusal refused[CLUSTER_REFUSED_MAX]; /* a read's refused records */
        size_t n_refused;
        uint64_t refused_total;
        char err[256];
} WatchCtx;

/* A member key and record, or -EINVAL/-EBADMSG (not a member key, or a malformed
 * record: skipped), or -ENOKEY/-EPERM: a record whose MAC does not verify with the
 * cluster key (member_record_verify()), what it claims in *ret_refusal. Such a record is
 * refused: never applied, never dialed. */
static int kv_info(ClusterManager *cm, const EtcdKv *kv, MemberInfo *ret, MemberRefusal *ret_refusal) {
        char host[MEMBER_HOST_ID_MAX + 1];
        int r = member_key_host(cm->prefix, kv->key, kv->key_len, host, sizeof host);
        if (r < 0)
                return r;
        r = member_record_parse(host, kv->value, kv->value_len, ret);
        if (r < 0)
                return r;
        r = member_record_verify(cm->auth_key, cm->prefix, ret);
        if (r < 0) {
                *ret_refusal = (MemberRefusal){ .error = r == -ENOKEY ? -ENOKEY : -EPERM,
                                                .revision = kv->mod_revision };
                snprintf(ret_refusal->host_id, sizeof ret_refusal->host_id, "%s", ret->host_id);
                snprintf(ret_refusal->address, sizeof ret_refusal->address, "%s", ret->address);
                return ret_refusal->error;
        }
        ret->lease = kv->lease;
        ret->revision = kv->mod_revision;
        return 0;
}

static int range_kv(void *userdata, const EtcdKv *kv) {
        WatchCtx *w = userdata;
        MemberRefusal f;
        MemberInfo info;
        int r = kv_info(w->cm, kv, &info, &f);

        if (r == -ENOKEY || r == -EPERM) {
                /* Not signed with the cluster key: skipped as a malformed one, and
                 * reported (the first CLUSTER_REFUSED_MAX). */
                if (w->n_refused < CLUSTER_REFUSED_MAX)
                        w->refused[w->n_refused++] = f;
                w->refused_total++;
                return 0;
        }
        if (r < 0)
                return 0; /* not a member record, or a malformed one: ignored */
        /* Past MaxMembers= the loop would refuse them anyway: whoever can write the prefix
         * must not make every epdd allocate and copy without bound (the read itself is
         * bounded: ETCD_RANGE_PAGES_MAX). This host's own record is always taken. */
        if (strcmp(info.host_id, w->cm->self.host_id) == 0) {
                if (w->own_seen)
                        return 0; /* read again on its own after a read cut short */
                w->own_seen = true;
        } else {
                if (w->n_others >= w->cm->max_members) {
                        w->skipped++;
                        return 0;
                }
                w->n_others++;
        }
        if (w->n == w->cap) {
                size_t cap = MAX(w->cap * 2, (size_t)16);
                MemberInfo *n = reallocarray(w->infos, cap, sizeof *n);
                if (!n)
                        return -ENOMEM;
                w->infos = n;
                w->cap = cap;
        }
        w->infos[w->n++] = info;
        return 0;
}

static int watch_event(void *userdata, bool put, const EtcdKv *kv) {
        WatchCtx *w = userdata;
        ClusterEvent *ev;
        MemberRefusal f;
        char host[MEMBER_HOST_ID_MAX + 1];
        int r;

        if (kv->mod_revision > w->revision)
                w->revision = kv->mod_revision;
        if (member_key_host(w->cm->prefix, kv->key, kv->key_len, host, sizeof host) < 0)
                return 0;
        ev = event_new(put ? EV_PUT : EV_DELETE);
        if (!ev)
                return -ENOMEM;
        ev->revision = kv->mod_revision;
        if (put) {
                ev->infos = calloc(1, sizeof *ev->infos);
                if (!ev->infos) {
                        free(ev);
                        return -ENOMEM;
                }
                r = kv_info(w->cm, kv, ev->infos, &f);
                if (r >= 0) {
                        ev->n = 1;
                        post(w->cm, ev);
                        return 0;
                }
                /* A member's key overwritten with what is not a valid record, or with
                 * one not signed with the cluster key: the member it named is gone (a
                 * resync would skip the key too, so every view ends the same), not kept
                 * on its old record, and nothing dials what the record says. */
                free(ev->infos);
                ev->infos = NULL;
                ev->type = EV_DELETE;
                ev->invalid = true;
                if (r == -ENOKEY || r == -EPERM) {
                        ev->refused = malloc(sizeof *ev->refused);
                        if (!ev->refused) {
                                free(ev);
                                return -ENOMEM;
                        }
                        *ev->refused = f;
                        ev->n_refused = 1;
                }
        }
        snprintf(ev->text, sizeof ev->text, "%s", host);
        post(w->cm, ev);
        return 0;
}

static int watch_message(void *userdata, const char *msg, size_t len) {
        WatchCtx *w = userdata;
        EtcdWatchInfo info;
        int r = etcd_json_watch(msg, len, &info, watch_event, w, w->err, sizeof w->err);

        if (r < 0) {
                if (!w->err[0])
                        snprintf(w->err, sizeof w->err, "watch: malformed message from etcd");
                return r;
        }
        if (info.compact_revision > 0 || info.canceled) {
                snprintf(w->err, sizeof w->err, "watch canceled by etcd%s%s", info.cancel_reason[0] ? ": " : "",
                         info.cancel_reason);
                return -ESTALE; /* read everything again */
        }
        if (info.created && !w->created) {
                w->created = true;
                post_state(w->cm, EV_WATCH, true, 0, 0, "", w->c);
        }
        return 0;
}

/* A page's answer, or a refusal's body (its code tells a compacted revision), to the
 * range read; err keeps the client's message of a refusal that is not that. */
static int range_page(WatchCtx *w, EtcdRange *range, int r, const char *ans, size_t len) {
        char why[sizeof w->err];

        if (r >= 0)
                return etcd_range_answer(range, ans, len, range_kv, w, w->err, sizeof w->err);
        if (r != -EIO || !ans)
                return r;
        r = etcd_range_answer(range, ans, len, NULL, NULL, why, sizeof why);
        return r == -ESTALE ? r : -EIO;
}

/* Every member record, in pages of at most ETCD_RANGE_PAGE_KEYS keys, all at the first
 * page's revision (w->revision): one snapshot, as one answer was, and the watch goes on
 * from the next revision. One answer of the whole prefix was capped by the client (16
 * MiB): whoever could write more under it (junk keys that every resync skips) kept
 * every epdd from ever finishing a resync, degraded, with no member joining or leaving.
 * Past ETCD_RANGE_PAGES_MAX answers the read stops (*ret_cut): the members after its
 * last key stay as they were, as past MaxMembers=. */
static int resync_read(WatchCtx *w, bool *ret_cut) {
        EtcdRange range;
        int r;

        r = etcd_range_init(&range, w->cm->members_prefix);
        if (r < 0)
                return r;
        for (;;) {
                char *ans = NULL, *body = etcd_range_request(&range);
                size_t len = 0;

                r = body ? etcd_client_call(w->c, "/v3/kv/range", body, CALL_TIMEOUT_MS, &ans, &len, w->err,
                                            sizeof w->err)
                         : -ENOMEM;
                free(body);
                if (r == -EMSGSIZE) {
                        /* Keys of this page with values past any record's (whoever wrote
                         * them): fewer keys per page, or the read stops at them. */
                        free(ans);
                        w->err[0] = 0;
                        r = etcd_range_too_big(&range);
                        if (r > 0)
                                continue;
                        break;
                }
                r = range_page(w, &range, r, ans, len);
                free(ans);
                if (r == -ESTALE && range.revision > 0) {
                        /* Compacted past the snapshot's revision between two pages: read it
                         * all again at a new one (within the same bound of pages). */
                        log_info("cluster: etcd compacted revision %" PRId64 " during a read of %s; reading again",
                                 range.revision, w->cm->members_prefix);
                        w->n = w->n_others = w->skipped = 0;
                        w->n_refused = 0;
                        w->refused_total = 0;
                        w->own_seen = false;
                        w->err[0] = 0;
                        r = etcd_range_restart(&range);
                        if (r < 0) {
                                snprintf(w->err, sizeof w->err,
                                         "etcd compacted its history during every read of %s (%u answers)",
                                         w->cm->members_prefix, range.pages);
                                return r;
                        }
                        continue;
                }
                if (r <= 0)
                        break;
        }
        if (r < 0)
                return r;
        if (range.revision <= 0) {
                /* Cut before a first page: no snapshot to watch from. */
                snprintf(w->err, sizeof w->err, "etcd: a single key under %s is past the answer's cap",
                         w->cm->members_prefix);
                return -EMSGSIZE;
        }
        w->revision = range.revision;
        *ret_cut = range.cut;
        if (!range.cut)
                return 0;
        log_warning("cluster: etcd holds more under %s than a read takes (%u answers, %" PRIu64
                    " keys); members after the last key read are kept as they were",
                    w->cm->members_prefix, range.pages, range.keys);
        if (!w->own_seen) {
                /* This host's record may be past the cut: read on its own, at the same
                 * revision, so that its host does not take it for lost and register
                 * again at every resync. */
                char *ans = NULL, *body = etcd_json_get_request(w->cm->key, range.revision);
                size_t len = 0;
                int64_t rev;

                r = body ? etcd_client_call(w->c, "/v3/kv/range", body, CALL_TIMEOUT_MS, &ans, &len, w->err,
                                            sizeof w->err)
                         : -ENOMEM;
                free(body);
                if (r >= 0)
                        r = etcd_json_range(ans, len, &rev, range_kv, w, w->err, sizeof w->err);
                free(ans);
                if (r == -ESTALE) {
                        /* Compacted since: the next resync reads it all again. */
                        snprintf(w->err, sizeof w->err, "etcd compacted revision %" PRId64 " during a read of %s",
                                 range.revision, w->cm->members_prefix);
                        return r;
                }
                if (r < 0)
                        return r;
        }
        return 0;
}

static int watch_once(WatchCtx *w) {
        ClusterEvent *ev;
        char *req;
        bool cut = false;
        int r;

        w->n = w->n_others = w->skipped = 0;
        w->n_refused = 0;
        w->refused_total = 0;
        w->own_seen = false;
        w->err[0] = 0;
        /* Not created in this attempt until etcd says so: a read that fails after an
         * earlier attempt's stream had worked is a failure to back off from, not a
         * stream that ended (every epdd read everything again every 100 ms through an
         * etcd outage). */
        w->created = false;
        /* Member records only: other keys under the prefix are not read at all. */
        r = resync_read(w, &cut);
        if (r < 0)
                return r;
        if (w->skipped > 0)
                log_warning("cluster: etcd holds %zu more member records than MaxMembers=%u; they are ignored",
                            w->skipped, w->cm->max_members);
        ev = event_new(EV_RESYNC);
        if (!ev)
                return -ENOMEM;
        ev->revision = w->revision;
        ev->partial = w->skipped > 0 || cut;
        ev->n = w->n;
        if (w->n > 0) {
                ev->infos = malloc(w->n * sizeof *ev->infos);
                if (!ev->infos) {
                        free(ev);
                        return -ENOMEM;
                }
                memcpy(ev->infos, w->infos, w->n * sizeof *ev->infos);
        }
        if (w->n_refused > 0) {
                ev->refused = malloc(w->n_refused * sizeof *ev->refused);
                if (!ev->refused) {
                        free(ev->infos);
                        free(ev);
                        return -ENOMEM;
                }
                memcpy(ev->refused, w->refused, w->n_refused * sizeof *ev->refused);
        }
        ev->n_refused = w->n_refused;
        ev->refused_total = w->refused_total;
        post(w->cm, ev);
        /* Everything after the read, in order. */
        req = etcd_json_watch_request(w->cm->members_prefix, w->revision + 1);
        if (!req)
                return -ENOMEM;
        r = etcd_client_stream(w->c, "/v3/watch", req, watch_message, w, w->err[0] ? NULL : w->err, sizeof w->err);
        free(req);
        return r;
}

static void *watch_main(void *userdata) {
        ClusterManager *cm = userdata;
        WatchCtx w = { .cm = cm };
        long backoff = BACKOFF_MIN_MS;

        w.c = cm->watch_client;
        while (!atomic_load(&cm->stop)) {
                int r = watch_once(&w);
                if (atomic_load(&cm->stop))
                        break;
                if (r == -ETIMEDOUT && etcd_client_hung(w.c, NULL) >= 0 && w.created) {
                        /* Ended by the session, which found the endpoint hung: read
                         * again through the next one at once. Membership is not
                         * degraded by it unless that fails too. */
                        log_info("cluster: %s; the watch reads again through %s", w.err, etcd_client_endpoint(w.c));
                        continue;
                }
                if (!w.err[0])
                        snprintf(w.err, sizeof w.err, "watch: %s: %s", etcd_client_endpoint(w.c), strerror(-r));
                post_state(cm, EV_WATCH, false, 0, 0, w.err, w.c);
                if (w.created)
                        backoff = BACKOFF_MIN_MS; /* its stream had worked: retry soon */
                if (nap(cm, backoff, false))
                        break;
                backoff = MIN(backoff * 2, (long)BACKOFF_MAX_MS);
        }
        free(w.infos);
        return NULL;
}

/* ---- to the loop ---- */

static void event_free(ClusterEvent *ev) {
        free(ev->infos);
        free(ev->refused);
        free(ev);
}

static void apply(ClusterManager *cm, ClusterEvent *ev) {
        switch (ev->type) {
        case EV_SESSION:
                cluster_on_session(cm, ev->up, ev->lease, ev->revision, ev->text, ev->endpoint);
                break;
        case EV_WATCH:
                cluster_on_watch(cm, ev->up, ev->text);
                break;
        case EV_RESYNC:
                cluster_on_resync(cm, ev->revision, ev->infos, ev->n, ev->partial, ev->refused, ev->n_refused,
                                  ev->refused_total);
                break;
        case EV_PUT:
                cluster_on_put(cm, ev->infos);
                break;
        case EV_DELETE:
                cluster_on_delete(cm, ev->text, ev->revision, ev->invalid, ev->n_refused ? ev->refused : NULL);
                break;
        }
}

static int efd_io(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        ClusterManager *cm = userdata;
        ClusterEvent *list;
        uint64_t v;

        (void)!read(cm->efd, &v, sizeof v);
        pthread_mutex_lock(&cm->lock);
        list = cm->queue;
        cm->queue = cm->queue_tail = NULL;
        pthread_mutex_unlock(&cm->lock);
        while (list) {
                ClusterEvent *next = list->next;
                apply(cm, list);
                event_free(list);
                list = next;
        }
        return 0;
}

/* ---- this host's record ---- */

static void append(char *buf, size_t size, const char *s) {
        size_t n = strlen(buf);
        if (n < size)
                snprintf(buf + n, size - n, "%s", s);
}

static int build_record(ClusterManager *cm) {
        Manager *m = cm->manager;
        MemberInfo info = {};
        char arena[128];
        int r;

        snprintf(info.host_id, sizeof info.host_id, "%s", m->config.host_id);
        snprintf(info.address, sizeof info.address, "%s", m->config.listen_address);
        RdmaLink links[8];
        bool logged = true; /* rdma.c said it at start already */
        snprintf(info.transports, sizeof info.transports, "tcp%s",
                 peer_manager_rdma(m->peers) && rdma_discover(links, ELEMENTSOF(links), &logged) > 0 ? ",rdma" : "");
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                snprintf(arena, sizeof arena, "%s%s:%s:%" PRIu64 "M", i ? "," : "", a->name,
                         a->domain == MEMORY_GPU ? "gpu" : "host", (uint64_t)(a->size >> 20));
                append(info.arenas, sizeof info.arenas, arena);
        }
        info.gpus = (uint32_t)topology_n_gpus(m->topology);
        for (size_t i = 0; i < info.gpus; i++) {
                const TopologyGpu *g = topology_gpu(m->topology, i);
                snprintf(arena, sizeof arena, "%sgpu%zu->%s", i ? "," : "", i, g && g->nic[0] ? g->nic : "none");
                append(info.nics, sizeof info.nics, arena);
        }
        if (!info.nics[0])
                snprintf(info.nics, sizeof info.nics, "no GPUs");
        info.started_usec = now_usec(CLOCK_REALTIME);
        /* Signed: the others dial only what a record signed with the cluster key says. */
        r = member_record_sign(cm->auth_key, cm->prefix, &info);
        if (r < 0)
                return r;
        cm->self = info;
        cm->value = member_record_encode(&info);
        return cm->value ? 0 : -ENOMEM;
}

int cluster_etcd_start(ClusterManager *cm) {
        Manager *m = cm->manager;
        const Config *c = &m->config;
        char key[512];
        int r;

        r = etcd_global_init();
        if (r < 0)
                return log_error_errno(r, "cluster: cannot initialize libcurl: %m");
        r = member_key(c->etcd_prefix, c->host_id, key, sizeof key);
        if (r < 0)
                return r;
        cm->key = strdup(key);
        cm->prefix = strdup(c->etcd_prefix);
        if (asprintf(&cm->members_prefix, "%s%s", c->etcd_prefix, MEMBER_KEY_DIR) < 0)
                cm->members_prefix = NULL;
        if (!cm->key || !cm->prefix || !cm->members_prefix)
                return -ENOMEM;
        cm->max_members = c->max_members;
        /* The peers' copy of the key is theirs (peer-manager.c): this one signs and checks
         * the member records. Config requires ClusterKeyFile= with Etcd=. */
        const char *why = NULL;
        r = peer_auth_key_load(c->cluster_key_file, &cm->auth_key, &why);
        if (r < 0) {
                if (why)
                        return log_error_errno(r, "cluster: cannot load the cluster key %s: %s", c->cluster_key_file,
                                               why);
                return log_error_errno(r, "cluster: cannot load the cluster key %s: %m", c->cluster_key_file);
        }
        r = build_record(cm);
        if (r < 0)
                return r;
        cm->ttl_sec = (int64_t)(c->etcd_lease_ttl_usec / USEC_PER_SEC);
        cm->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (cm->efd < 0)
                return -errno;
        r = sd_event_add_io(m->event, &cm->efd_source, cm->efd, EPOLLIN, efd_io, cm);
        if (r < 0)
                return r;
        /* Both clients' calls end at stop (woken for it): a keepalive or a probe waiting
         * on a hung endpoint would hold the stop up to nine tenths of the lease TTL. The
         * session's flag is its own: cleared again for the lease revoke on the way out. */
        cm->session_client = client_new(cm, &cm->session_cancel);
        cm->watch_client = client_new(cm, &cm->stop);
        if (!cm->session_client || !cm->watch_client)
                return -ENOMEM;
        r = -pthread_create(&cm->session_thread, NULL, session_main, cm);
        if (r < 0)
                return r;
        cm->session_started = true;
        r = -pthread_create(&cm->watch_thread, NULL, watch_main, cm);
        if (r < 0)
                return r;
        cm->watch_started = true;
        log_info("cluster: membership in etcd at %s, key %s, lease TTL %" PRId64 "s", c->etcd_endpoints[0], cm->key,
                 cm->ttl_sec);
        return 0;
}

void cluster_etcd_stop(ClusterManager *cm) {
        atomic_store(&cm->session_cancel, true);
        atomic_store(&cm->stop, true);
        pthread_mutex_lock(&cm->lock);
        pthread_cond_broadcast(&cm->cond);
        etcd_client_wakeup(cm->probe);
        pthread_mutex_unlock(&cm->lock);
        etcd_client_wakeup(cm->session_client);
        etcd_client_wakeup(cm->watch_client);
        if (cm->watch_started)
                pthread_join(cm->watch_thread, NULL);
        if (cm->session_started)
                pthread_join(cm->session_thread, NULL);
        cm->watch_started = cm->session_started = false;
        cm->watch_client = etcd_client_free(cm->watch_client);
        cm->session_client = etcd_client_free(cm->session_client);
        while (cm->queue) {
                ClusterEvent *n = cm->queue->next;
                event_free(cm->queue);
                cm->queue = n;
        }
        cm->queue_tail = NULL;
        cm->efd_source = sd_event_source_disable_unref(cm->efd_source);
        if (cm->efd >= 0)
                close(cm->efd);
        cm->efd = -1;
        cm->auth_key = peer_auth_key_free(cm->auth_key);
}
