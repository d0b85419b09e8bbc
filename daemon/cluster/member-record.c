/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "cluster/member-record.h"

#include <errno.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"
#include "peer/peer-auth.h"

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

static const char hexdigits[] = "0123456789abcdef";

char *member_record_encode(const MemberInfo *info) {
        json_object *o = json_object_new_object();
        char started[32], mac[2 * MEMBER_MAC_SIZE + 1];
        char *s = NULL;

        if (!o)
                return NULL;
        snprintf(started, sizeof started, "%" PRIu64, info->started_usec);
        for (size_t i = 0; i < MEMBER_MAC_SIZE; i++) {
                mac[2 * i] = hexdigits[info->mac[i] >> 4];
                mac[2 * i + 1] = hexdigits[info->mac[i] & 15];
        }
        mac[2 * MEMBER_MAC_SIZE] = 0;
        if (json_object_object_add(o, "version", json_object_new_int(MEMBER_RECORD_VERSION)) >= 0 &&
            json_object_object_add(o, "host_id", json_object_new_string(info->host_id)) >= 0 &&
            json_object_object_add(o, "address", json_object_new_string(info->address)) >= 0 &&
            json_object_object_add(o, "transports", json_object_new_string(info->transports)) >= 0 &&
            json_object_object_add(o, "arenas", json_object_new_string(info->arenas)) >= 0 &&
            json_object_object_add(o, "gpus", json_object_new_int64(info->gpus)) >= 0 &&
            json_object_object_add(o, "nics", json_object_new_string(info->nics)) >= 0 &&
            json_object_object_add(o, "started_usec", json_object_new_string(started)) >= 0 &&
            (!info->has_mac || json_object_object_add(o, "mac", json_object_new_string(mac)) >= 0)) {
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
            (json_object_get_int64(v) != 1 && json_object_get_int64(v) != MEMBER_RECORD_VERSION))
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
        if (json_object_object_get_ex(o, "mac", &v)) {
                char hex[2 * MEMBER_MAC_SIZE + 1];
                if (get_str(o, "mac", hex, sizeof hex, true) < 0 || strlen(hex) != 2 * MEMBER_MAC_SIZE)
                        goto out;
                for (size_t i = 0; i < 2 * MEMBER_MAC_SIZE; i++) {
                        const char *d = strchr(hexdigits, hex[i]);
                        if (!hex[i] || !d)
                                goto out;
                        info.mac[i / 2] = (uint8_t)(info.mac[i / 2] << 4 | (d - hexdigits));
                }
                info.has_mac = true;
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

/* What the MAC covers, unambiguously: every string length-prefixed (32 bits, big
 * endian), the numbers at fixed width. NULL without memory. */
static uint8_t *signed_bytes(const char *prefix, const MemberInfo *info, size_t *ret_len) {
        const char *strs[] = { prefix, info->host_id, info->address, info->transports, info->arenas, info->nics };
        size_t len = 4 + 8, off = 0;
        uint8_t *buf;

        for (size_t i = 0; i < ELEMENTSOF(strs); i++)
                len += 4 + strlen(strs[i]);
        buf = malloc(len);
        if (!buf)
                return NULL;
        for (size_t i = 0; i < ELEMENTSOF(strs); i++) {
                uint32_t n = (uint32_t)strlen(strs[i]);
                for (int b = 3; b >= 0; b--)
                        buf[off++] = (uint8_t)(n >> (8 * b));
                memcpy(buf + off, strs[i], n);
                off += n;
        }
        for (int b = 3; b >= 0; b--)
                buf[off++] = (uint8_t)(info->gpus >> (8 * b));
        for (int b = 7; b >= 0; b--)
                buf[off++] = (uint8_t)(info->started_usec >> (8 * b));
        *ret_len = off;
        return buf;
}

static int record_mac(const PeerAuthKey *k, const char *prefix, const MemberInfo *info,
                      uint8_t out[static MEMBER_MAC_SIZE]) {
        uint8_t *buf;
        size_t len;
        int r;

        if (!k || !prefix || strlen(prefix) > 4096 || !member_info_is_valid(info))
                return -EINVAL;
        buf = signed_bytes(prefix, info, &len);
        if (!buf)
                return -ENOMEM;
        r = peer_auth_keyed_mac(k, MEMBER_RECORD_MAC_CONTEXT, buf, len, out);
        free(buf);
        return r;
}

int member_record_sign(const PeerAuthKey *k, const char *prefix, MemberInfo *info) {
        uint8_t mac[MEMBER_MAC_SIZE];
        int r = record_mac(k, prefix, info, mac);
        if (r < 0)
                return r;
        memcpy(info->mac, mac, sizeof mac);
        info->has_mac = true;
        return 0;
}

int member_record_verify(const PeerAuthKey *k, const char *prefix, const MemberInfo *info) {
        uint8_t mac[MEMBER_MAC_SIZE];
        int r;

        if (!info)
                return -EINVAL;
        if (!info->has_mac)
                return -ENOKEY;
        r = record_mac(k, prefix, info, mac);
        if (r < 0)
                return r;
        r = CRYPTO_memcmp(mac, info->mac, sizeof mac) == 0 ? 0 : -EPERM;
        OPENSSL_cleanse(mac, sizeof mac);
        return r;
}
