/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "cluster/member-record.h"

#include <errno.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int member_key(const char *prefix, const char *host_id, char *buf, size_t size) {
        int n = snprintf(buf, size, "%s" MEMBER_KEY_DIR "%s", prefix, host_id);
        return n < 0 || (size_t)n >= size ? -ENAMETOOLONG : 0;
}

int member_key_host(const char *prefix, const uint8_t *key, size_t key_len, char *ret, size_t size) {
        size_t pl = strlen(prefix), dl = strlen(MEMBER_KEY_DIR), n;

        if (key_len <= pl + dl || memcmp(key, prefix, pl) != 0 || memcmp(key + pl, MEMBER_KEY_DIR, dl) != 0)
                return -EINVAL;
        n = key_len - pl - dl;
        if (n >= size || n > MEMBER_HOST_ID_MAX || memchr(key + pl + dl, 0, n))
                return -EINVAL;
        memcpy(ret, key + pl + dl, n);
        ret[n] = 0;
        return 0;
}

char *member_record_encode(const MemberInfo *info) {
        json_object *o = json_object_new_object();
        char started[32];
        char *s = NULL;

        if (!o)
                return NULL;
        snprintf(started, sizeof started, "%" PRIu64, info->started_usec);
        if (json_object_object_add(o, "version", json_object_new_int(MEMBER_RECORD_VERSION)) >= 0 &&
            json_object_object_add(o, "host_id", json_object_new_string(info->host_id)) >= 0 &&
            json_object_object_add(o, "address", json_object_new_string(info->address)) >= 0 &&
            json_object_object_add(o, "transports", json_object_new_string(info->transports)) >= 0 &&
            json_object_object_add(o, "arenas", json_object_new_string(info->arenas)) >= 0 &&
            json_object_object_add(o, "gpus", json_object_new_int64(info->gpus)) >= 0 &&
            json_object_object_add(o, "nics", json_object_new_string(info->nics)) >= 0 &&
            json_object_object_add(o, "started_usec", json_object_new_string(started)) >= 0) {
                const char *t = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN);
                s = t ? strdup(t) : NULL;
        }
        json_object_put(o);
        return s;
}

static int get_str(json_object *o, const char *k, char *dst, size_t size, bool required) {
        json_object *v;
        const char *s;
        size_t n;

        if (!json_object_object_get_ex(o, k, &v)) {
                if (required)
                        return -EBADMSG;
                dst[0] = 0;
                return 0;
        }
        if (!json_object_is_type(v, json_type_string))
                return -EBADMSG;
        s = json_object_get_string(v);
        n = (size_t)json_object_get_string_len(v);
        if (n >= size || memchr(s, 0, n))
                return -EBADMSG;
        memcpy(dst, s, n + 1);
        return 0;
}

int member_record_parse(const char *host, const uint8_t *value, size_t len, MemberInfo *ret) {
        json_tokener *tok;
        json_object *o, *v;
        MemberInfo info = {};
        int r = -EBADMSG;

        if (!value || len == 0 || len > 4096)
                return -EBADMSG;
        tok = json_tokener_new();
        if (!tok)
                return -ENOMEM;
        o = json_tokener_parse_ex(tok, (const char *)value, (int)len);
        if (!o || json_tokener_get_error(tok) != json_tokener_success ||
            (size_t)json_tokener_get_parse_end(tok) != len || !json_object_is_type(o, json_type_object))
                goto out;
        if (!json_object_object_get_ex(o, "version", &v) || !json_object_is_type(v, json_type_int) ||
            json_object_get_int64(v) != MEMBER_RECORD_VERSION)
                goto out;
        if (get_str(o, "host_id", info.host_id, sizeof info.host_id, true) < 0 ||
            get_str(o, "address", info.address, sizeof info.address, true) < 0 ||
            get_str(o, "transports", info.transports, sizeof info.transports, false) < 0 ||
            get_str(o, "arenas", info.arenas, sizeof info.arenas, false) < 0 ||
            get_str(o, "nics", info.nics, sizeof info.nics, false) < 0)
                goto out;
        if (json_object_object_get_ex(o, "gpus", &v)) {
                int64_t g;
                if (!json_object_is_type(v, json_type_int) || (g = json_object_get_int64(v)) < 0 || g > 4096)
                        goto out;
                info.gpus = (uint32_t)g;
        }
        if (json_object_object_get_ex(o, "started_usec", &v)) {
                char buf[24], *end;
                if (get_str(o, "started_usec", buf, sizeof buf, true) < 0 || !buf[0] || buf[0] == '-')
                        goto out;
                errno = 0;
                info.started_usec = strtoull(buf, &end, 10);
                if (errno || *end)
                        goto out;
        }
        if (strcmp(info.host_id, host) != 0 || !member_info_is_valid(&info))
                goto out;
        *ret = info;
        r = 0;
out:
        json_object_put(o);
        json_tokener_free(tok);
        return r;
}
