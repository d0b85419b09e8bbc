/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "cluster/membership.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

#include "hashmap.h"
#include "macro.h"

struct Membership {
        char self[MEMBER_HOST_ID_MAX + 1];
        size_t max;
        usec_t grace;
        MembershipEventFn fn;
        void *userdata;

        Member **members;
        size_t n_members;
        Hashmap *by_host; /* Member* by info.host_id */

        EtcdLink link;
        char link_reason[160];
        int64_t revision;
        uint64_t epoch;   /* of the resync in progress */
        bool resyncing;
        MembershipStats stats;

        /* Records refused for want of room, oldest first, latest record per host: the
         * first places that free up go to them (etcd sends a member's record once; a
         * refused one would otherwise wait for the next full read). */
        MemberInfo *waiting;
        size_t n_waiting;
};

#define MEMBERSHIP_WAITING_MAX 64

static const char *const member_state_table[_MEMBER_STATE_MAX] = {
        [MEMBER_ALIVE] = "alive",
        [MEMBER_MISSING] = "missing",
};

static const char *const etcd_link_table[_ETCD_LINK_MAX] = {
        [ETCD_LINK_CONNECTING] = "connecting",
        [ETCD_LINK_UP] = "up",
        [ETCD_LINK_DEGRADED] = "degraded",
};

bool membership_self_key_lost(bool session_up, int64_t put_revision, int64_t revision) {
        return session_up && revision >= put_revision;
}

const char *member_state_to_string(MemberState s) {
        return (unsigned)s < _MEMBER_STATE_MAX ? member_state_table[s] : NULL;
}

const char *etcd_link_to_string(EtcdLink l) {
        return (unsigned)l < _ETCD_LINK_MAX ? etcd_link_table[l] : NULL;
}

static bool host_id_valid(const char *s) {
        size_t n = strnlen(s, MEMBER_HOST_ID_MAX + 1);
        if (n == 0 || n > MEMBER_HOST_ID_MAX)
                return false;
        for (size_t i = 0; i < n; i++)
                if (!isalnum((unsigned char)s[i]) && !strchr("-_.", s[i]))
                        return false;
        return true;
}

static bool field_valid(const char *s, size_t max) {
        size_t n = strnlen(s, max + 1);
        if (n > max)
                return false;
        for (size_t i = 0; i < n; i++)
                if (!isprint((unsigned char)s[i]))
                        return false;
        return true;
}

bool member_info_is_valid(const MemberInfo *info) {
        const char *colon;

        if (!info || !host_id_valid(info->host_id))
                return false;
        if (!field_valid(info->address, MEMBER_ADDRESS_MAX) || !field_valid(info->transports, MEMBER_FIELD_MAX) ||
            !field_valid(info->arenas, MEMBER_FIELD_MAX) || !field_valid(info->nics, MEMBER_FIELD_MAX))
                return false;
        /* HOST:PORT; the peer layer parses the address itself (numeric only). */
        colon = strrchr(info->address, ':');
        return colon && colon != info->address && colon[1] != 0;
}

int membership_new(Membership **ret, const char *self, size_t max, usec_t grace, MembershipEventFn fn,
                   void *userdata) {
        Membership *ms;

        if (!ret || !self || !host_id_valid(self) || max == 0 || !fn)
                return -EINVAL;
        ms = calloc(1, sizeof *ms);
        if (!ms)
                return -ENOMEM;
        ms->by_host = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!ms->by_host) {
                free(ms);
                return -ENOMEM;
        }
        snprintf(ms->self, sizeof ms->self, "%s", self);
        ms->max = max;
        ms->grace = grace;
        ms->fn = fn;
        ms->userdata = userdata;
        ms->link = ETCD_LINK_CONNECTING;
        *ret = ms;
        return 0;
}

Membership *membership_free(Membership *ms) {
        if (!ms)
                return NULL;
        for (size_t i = 0; i < ms->n_members; i++)
                free(ms->members[i]);
        free(ms->members);
        free(ms->waiting);
        hashmap_free(ms->by_host);
        free(ms);
        return NULL;
}

static ssize_t waiting_find(const Membership *ms, const char *host_id) {
        for (size_t i = 0; i < ms->n_waiting; i++)
                if (strcmp(ms->waiting[i].host_id, host_id) == 0)
                        return (ssize_t)i;
        return -1;
}

static void waiting_drop(Membership *ms, size_t i) {
        memmove(ms->waiting + i, ms->waiting + i + 1, (ms->n_waiting - i - 1) * sizeof *ms->waiting);
        ms->n_waiting--;
}

/* A record refused for want of room waits for a place: its latest record, in the order
 * first refused; past the bound the oldest is forgotten (a full read finds it again). */
static void waiting_add(Membership *ms, const MemberInfo *info) {
        ssize_t i = waiting_find(ms, info->host_id);
        if (i >= 0) {
                if (info->revision >= ms->waiting[i].revision)
                        ms->waiting[i] = *info;
                return;
        }
        if (!ms->waiting) {
                ms->waiting = calloc(MEMBERSHIP_WAITING_MAX, sizeof *ms->waiting);
                if (!ms->waiting)
                        return; /* a full read finds it again */
        }
        if (ms->n_waiting == MEMBERSHIP_WAITING_MAX)
                waiting_drop(ms, 0);
        ms->waiting[ms->n_waiting++] = *info;
}

static int apply_put(Membership *ms, const MemberInfo *info, bool authoritative);

/* Places freed: to the records that waited for one, oldest first. */
static void waiting_admit(Membership *ms) {
        while (ms->n_waiting > 0 && ms->n_members < ms->max) {
                MemberInfo info = ms->waiting[0];
                waiting_drop(ms, 0);
                ms->stats.admitted++;
                (void)apply_put(ms, &info, false);
        }
}

static void member_remove(Membership *ms, Member *m, const char *why) {
        (void)hashmap_remove(ms->by_host, m->info.host_id);
        for (size_t i = 0; i < ms->n_members; i++)
                if (ms->members[i] == m) {
                        ms->members[i] = ms->members[--ms->n_members];
                        break;
                }
        ms->stats.leaves++;
        ms->fn(ms->userdata, MEMBERSHIP_LEAVE, m, why);
        free(m);
        waiting_admit(ms);
}

static bool info_differs(const MemberInfo *a, const MemberInfo *b) {
        return strcmp(a->address, b->address) != 0 || strcmp(a->transports, b->transports) != 0 ||
               strcmp(a->arenas, b->arenas) != 0 || strcmp(a->nics, b->nics) != 0 || a->gpus != b->gpus ||
               a->started_usec != b->started_usec || a->lease != b->lease;
}

/* authoritative: a resync's record, read with the whole prefix at one revision: it is
 * what etcd holds now, whatever revision it carries (after etcd lost its data, lower
 * ones than those seen before). A watch's record older than what is known is stale. */
static int apply_put(Membership *ms, const MemberInfo *info, bool authoritative) {
        Member *m, **nm;
        int r;

        if (!member_info_is_valid(info))
                return -EINVAL;
        if (info->revision > ms->revision)
                ms->revision = info->revision;
        if (strcmp(info->host_id, ms->self) == 0)
                return 0; /* this host's own key */
        m = hashmap_get(ms->by_host, info->host_id);
        if (m) {
                bool was_missing = m->state == MEMBER_MISSING, changed;

                if (!authoritative && info->revision < m->info.revision) {
                        ms->stats.stale++;
                        return 0;
                }
                m->epoch = ms->epoch;
                m->state = MEMBER_ALIVE;
                changed = info_differs(&m->info, info);
                m->info = *info;
                if (changed || was_missing) {
                        ms->stats.updates++;
                        ms->fn(ms->userdata, MEMBERSHIP_UPDATE, m, was_missing ? "back in etcd" : "record changed");
                }
                return 0;
        }
        if (ms->n_members >= ms->max) {
                ms->stats.refused++;
                waiting_add(ms, info);
                return -ENOSPC;
        }
        ssize_t w = waiting_find(ms, info->host_id);
        if (w >= 0)
                waiting_drop(ms, (size_t)w);
        m = calloc(1, sizeof *m);
        if (!m)
                return -ENOMEM;
        nm = reallocarray(ms->members, ms->n_members + 1, sizeof *nm);
        if (!nm) {
                free(m);
                return -ENOMEM;
        }
        ms->members = nm;
        m->info = *info;
        m->state = MEMBER_ALIVE;
        m->epoch = ms->epoch;
        m->joined_usec = now_usec(CLOCK_MONOTONIC);
        r = hashmap_put(ms->by_host, m->info.host_id, m);
        if (r < 0) {
                free(m);
                return r;
        }
        ms->members[ms->n_members++] = m;
        ms->stats.joins++;
        ms->fn(ms->userdata, MEMBERSHIP_JOIN, m, "registered in etcd");
        return 0;
}

int membership_put(Membership *ms, const MemberInfo *info) {
        if (!ms || !info)
                return -EINVAL;
        return apply_put(ms, info, false);
}

int membership_delete(Membership *ms, const char *host_id, int64_t revision, const char *why) {
        Member *m;

        if (!ms || !host_id)
                return -EINVAL;
        if (revision > ms->revision)
                ms->revision = revision;
        m = hashmap_get(ms->by_host, host_id);
        if (!m) {
                ssize_t w = waiting_find(ms, host_id);
                if (w >= 0 && revision >= ms->waiting[w].revision)
                        waiting_drop(ms, (size_t)w); /* it left before a place freed */
                return 0;
        }
        if (revision < m->info.revision) {
                ms->stats.stale++;
                return 0;
        }
        member_remove(ms, m, why ?: "key deleted");
        return 0;
}

void membership_resync_begin(Membership *ms, int64_t revision) {
        ms->epoch++;
        ms->resyncing = true;
        ms->stats.resyncs++;
        ms->n_waiting = 0; /* the read says again who waits */
        if (revision > 0 && revision < ms->revision) {
                /* etcd's revision went back: it lost its data (or it is a new cluster) and
                 * every host registers again at low revisions. Its revisions start over
                 * here too, or every record and delete from now on would look stale. */
                ms->stats.revision_resets++;
                ms->revision = revision;
                for (size_t i = 0; i < ms->n_members; i++)
                        ms->members[i]->info.revision = 0;
        } else if (revision > ms->revision)
                ms->revision = revision;
}

int membership_resync_put(Membership *ms, const MemberInfo *info) {
        if (!ms || !info || !ms->resyncing)
                return -EINVAL;
        return apply_put(ms, info, true);
}

void membership_resync_end(Membership *ms, usec_t now, const char *listed_up_to) {
        ms->resyncing = false;
        for (size_t i = 0; i < ms->n_members; i++) {
                Member *m = ms->members[i];
                if (m->epoch == ms->epoch || m->state == MEMBER_MISSING)
                        continue;
                /* A read cut short lists the first records in key order: it says
                 * nothing of the members after its last one. */
                if (listed_up_to && strcmp(m->info.host_id, listed_up_to) > 0)
                        continue;
                m->state = MEMBER_MISSING;
                m->missing_deadline = now + ms->grace;
                ms->stats.updates++;
                ms->fn(ms->userdata, MEMBERSHIP_UPDATE, m, "not in etcd after a resync");
        }
}

usec_t membership_tick(Membership *ms, usec_t now) {
        usec_t next = USEC_INFINITY;

        for (size_t i = 0; i < ms->n_members;) {
                Member *m = ms->members[i];
                if (m->state != MEMBER_MISSING) {
                        i++;
                        continue;
                }
                if (now >= m->missing_deadline) {
                        member_remove(ms, m, "missing from etcd past the grace period");
                        continue; /* the last member moved into slot i */
                }
                next = MIN(next, m->missing_deadline);
                i++;
        }
        return next;
}

void membership_set_link(Membership *ms, EtcdLink link, const char *why) {
        if (ms->link != link)
                ms->stats.link_changes++;
        ms->link = link;
        snprintf(ms->link_reason, sizeof ms->link_reason, "%s", why ?: "");
}

EtcdLink membership_link(const Membership *ms) {
        return ms->link;
}

const char *membership_link_reason(const Membership *ms) {
        return ms->link_reason;
}

int64_t membership_revision(const Membership *ms) {
        return ms->revision;
}

const Member *membership_get(const Membership *ms, const char *host_id) {
        return ms && host_id ? hashmap_get(ms->by_host, host_id) : NULL;
}

size_t membership_size(const Membership *ms) {
        return ms ? ms->n_members : 0;
}

const Member *membership_member(const Membership *ms, size_t i) {
        return ms && i < ms->n_members ? ms->members[i] : NULL;
}

void membership_stats(const Membership *ms, MembershipStats *ret) {
        *ret = ms->stats;
}
