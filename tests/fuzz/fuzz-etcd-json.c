/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes what epdd reads from etcd (cluster/etcd-json.c, cluster/member-record.c): byte 0
 * picks the parser, the rest is the answer. Every parser must refuse or accept without
 * crashing; a member record that parses must re-encode and parse to the same record. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/etcd-json.h"
#include "cluster/member-record.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int on_kv(void *userdata, const EtcdKv *kv) {
        MemberInfo info;
        char host[MEMBER_HOST_ID_MAX + 1];

        if (kv->key_len > ETCD_KV_MAX || kv->value_len > ETCD_KV_MAX)
                abort();
        if (member_key_host("/epd/", kv->key, kv->key_len, host, sizeof host) >= 0 && kv->value &&
            member_record_parse(host, kv->value, kv->value_len, &info) >= 0 && !member_info_is_valid(&info))
                abort();
        return 0;
}

static int on_event(void *userdata, bool put, const EtcdKv *kv) {
        return on_kv(userdata, kv);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        const char *body = (const char *)data + 1;
        size_t len = size - 1;
        char err[128];
        uint64_t id;
        int64_t ttl, rev;
        EtcdWatchInfo wi;
        MemberInfo info, again;

        if (size < 1)
                return 0;
        switch (data[0] % 6) {
        case 0:
                (void)etcd_json_lease_grant(body, len, &id, &ttl, err, sizeof err);
                break;
        case 1:
                (void)etcd_json_keepalive(body, len, &ttl, err, sizeof err);
                break;
        case 2:
                (void)etcd_json_range(body, len, &rev, on_kv, NULL, err, sizeof err);
                break;
        case 3:
                (void)etcd_json_watch(body, len, &wi, on_event, NULL, err, sizeof err);
                break;
        case 4:
                (void)etcd_json_check(body, len, err, sizeof err);
                break;
        default:
                if (member_record_parse("alpha", (const uint8_t *)body, len, &info) >= 0) {
                        char *v = member_record_encode(&info);
                        if (!v || member_record_parse("alpha", (const uint8_t *)v, strlen(v), &again) < 0 ||
                            strcmp(info.address, again.address) != 0 || strcmp(info.arenas, again.arenas) != 0 ||
                            info.gpus != again.gpus || info.started_usec != again.started_usec)
                                abort();
                        free(v);
                }
                break;
        }
        return 0;
}
