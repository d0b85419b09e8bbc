/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd: org.epd1.Cluster (membership) and org.epd1.Placement (where a prefix lives). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "epd-internal.h"
#include "epd/epd.h"

#define CLUSTER_PATH "/org/epd1/cluster"
#define CLUSTER_IFACE "org.epd1.Cluster"
#define MEMBER_STRUCT "(sssssssssuut)"

static int get_property(epd_client *c, const char *name, const char *type, void *ret) {
        sd_bus_message *reply = NULL;
        int r = epd__call(c, CLUSTER_PATH, "org.freedesktop.DBus.Properties", "Get", &reply, "ss", CLUSTER_IFACE,
                          name);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(reply, 'v', type);
        if (r >= 0)
                r = sd_bus_message_read_basic(reply, type[0], ret);
        if (r >= 0 && type[0] == 's') {
                char *s = strdup(*(const char **)ret);
                *(char **)ret = s;
                if (!s)
                        r = -ENOMEM;
        }
        sd_bus_message_unref(reply);
        return r < 0 ? epd__error(c, r, NULL) : 0;
}

void epd_cluster_done(epd_cluster *cl) {
        if (!cl)
                return;
        free(cl->source);
        free(cl->etcd_state);
        free(cl->etcd_reason);
        free(cl->etcd_prefix);
        *cl = (epd_cluster){};
}

int epd_cluster_get(epd_client *c, epd_cluster *ret) {
        epd_cluster cl = {};
        int r;

        if (!c || !ret)
                return epd__error(c, -EINVAL, NULL);
        epd__clear_error(c);
        if ((r = get_property(c, "Source", "s", &cl.source)) < 0 ||
            (r = get_property(c, "EtcdState", "s", &cl.etcd_state)) < 0 ||
            (r = get_property(c, "EtcdReason", "s", &cl.etcd_reason)) < 0 ||
            (r = get_property(c, "EtcdPrefix", "s", &cl.etcd_prefix)) < 0 ||
            (r = get_property(c, "LeaseId", "t", &cl.lease_id)) < 0 ||
            (r = get_property(c, "LeaseTTLUSec", "t", &cl.lease_ttl_usec)) < 0 ||
            (r = get_property(c, "Revision", "t", &cl.revision)) < 0 ||
            (r = get_property(c, "ShardRecords", "t", &cl.shard_records)) < 0 ||
            (r = get_property(c, "MembersAlive", "u", &cl.members_alive)) < 0) {
                epd_cluster_done(&cl);
                return r;
        }
        *ret = cl;
        return 0;
}

void epd_members_free(epd_member *members, size_t n) {
        for (size_t i = 0; members && i < n; i++) {
                epd_member *m = members + i;
                free(m->host_id);
                free(m->address);
                free(m->source);
                free(m->lease);
                free(m->session);
                free(m->last_error);
                free(m->transports);
                free(m->arenas);
                free(m->nics);
        }
        free(members);
}

int epd_list_members(epd_client *c, epd_member **ret, size_t *ret_n) {
        sd_bus_message *reply = NULL;
        epd_member *members = NULL;
        size_t n = 0;
        int r;

        if (!c || !ret || !ret_n)
                return epd__error(c, -EINVAL, NULL);
        epd__clear_error(c);
        r = epd__call(c, CLUSTER_PATH, CLUSTER_IFACE, "ListMembers", &reply, NULL);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(reply, 'a', MEMBER_STRUCT);
        while (r >= 0) {
                const char *s[9];
                uint32_t gpus, share;
                uint64_t published;
                epd_member *nm;

                r = sd_bus_message_read(reply, MEMBER_STRUCT, &s[0], &s[1], &s[2], &s[3], &s[4], &s[5], &s[6], &s[7],
                                        &s[8], &gpus, &share, &published);
                if (r <= 0)
                        break;
                nm = realloc(members, (n + 1) * sizeof *nm);
                if (!nm) {
                        r = -ENOMEM;
                        break;
                }
                members = nm;
                members[n++] = (epd_member){
                        .host_id = strdup(s[0]), .address = strdup(s[1]), .source = strdup(s[2]),
                        .lease = strdup(s[3]), .session = strdup(s[4]), .last_error = strdup(s[5]),
                        .transports = strdup(s[6]), .arenas = strdup(s[7]), .nics = strdup(s[8]),
                        .gpus = gpus, .share_permille = share, .published_here = published,
                };
                epd_member *m = members + n - 1;
                if (!m->host_id || !m->address || !m->source || !m->lease || !m->session || !m->last_error ||
                    !m->transports || !m->arenas || !m->nics) {
                        r = -ENOMEM;
                        break;
                }
        }
        sd_bus_message_unref(reply);
        if (r < 0) {
                epd_members_free(members, n);
                return epd__error(c, r, NULL);
        }
        *ret = members;
        *ret_n = n;
        return (int)n;
}

void epd_placement_done(epd_placement *p) {
        if (!p)
                return;
        free(p->host);
        free(p->arena);
        free(p->worker);
        for (size_t i = 0; i < p->n_candidates; i++) {
                free(p->candidates[i].host);
                free(p->candidates[i].arena);
                free(p->candidates[i].worker);
        }
        free(p->candidates);
        *p = (epd_placement){};
}

int epd_locate_prefix(epd_client *c, const uint64_t *hashes, size_t n, epd_placement *ret) {
        sd_bus_message *m = NULL, *reply = NULL;
        epd_placement p = {};
        const char *host, *arena, *worker;
        int r;

        if (!c || !ret || (n > 0 && !hashes))
                return epd__error(c, -EINVAL, NULL);
        epd__clear_error(c);
        r = epd__new_call(c, "/org/epd1/placement", "org.epd1.Placement", "LocatePrefix", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append_array(m, 't', hashes, n * sizeof *hashes);
        if (r < 0) {
                sd_bus_message_unref(m);
                return epd__error(c, r, NULL);
        }
        r = epd__send(c, m, &reply);
        sd_bus_message_unref(m);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "usss", &p.n_blocks, &host, &arena, &worker);
        if (r >= 0 && (!(p.host = strdup(host)) || !(p.arena = strdup(arena)) || !(p.worker = strdup(worker))))
                r = -ENOMEM;
        if (r >= 0)
                r = sd_bus_message_enter_container(reply, 'a', "(sssu)");
        while (r >= 0) {
                epd_placement_candidate *nc;
                uint32_t blocks;

                r = sd_bus_message_read(reply, "(sssu)", &host, &arena, &worker, &blocks);
                if (r <= 0)
                        break;
                nc = realloc(p.candidates, (p.n_candidates + 1) * sizeof *nc);
                if (!nc) {
                        r = -ENOMEM;
                        break;
                }
                p.candidates = nc;
                nc += p.n_candidates++;
                *nc = (epd_placement_candidate){ strdup(host), strdup(arena), strdup(worker), blocks };
                if (!nc->host || !nc->arena || !nc->worker)
                        r = -ENOMEM;
        }
        if (r >= 0)
                r = sd_bus_message_exit_container(reply);
        if (r >= 0)
                r = sd_bus_message_read(reply, "u", &p.owners_missing);
        sd_bus_message_unref(reply);
        if (r < 0) {
                epd_placement_done(&p);
                return epd__error(c, r, NULL);
        }
        *ret = p;
        return 0;
}
