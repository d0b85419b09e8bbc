/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "cluster/etcd-json.h"

#include <errno.h>
#include <inttypes.h>
#include <json-c/json.h>
#include <openssl/evp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"

/* ---- base64 (OpenSSL's EVP block coder) ---- */

static char *b64_encode(const void *p, size_t n) {
        char *out;

        if (n > ETCD_KV_MAX * 4)
                return NULL;
        out = malloc(4 * DIV_ROUND_UP(n, 3) + 1);
        if (!out)
                return NULL;
        EVP_EncodeBlock((unsigned char *)out, p, (int)n);
        return out;
}

/* Decodes into a new buffer; -EBADMSG for anything but canonical padded base64, -E2BIG
 * past max decoded bytes. */
static int b64_decode(const char *s, size_t n, size_t max, uint8_t **ret, size_t *ret_len) {
        size_t pad = 0;
        uint8_t *out;
        int k;

        if (n % 4 != 0)
                return -EBADMSG;
        if (n / 4 * 3 > max)
                return -E2BIG;
        if (n == 0) {
                *ret = calloc(1, 1);
                *ret_len = 0;
                return *ret ? 0 : -ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
                char c = s[i];
                bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' ||
                          c == '/' || (c == '=' && i >= n - 2);
                if (!ok)
                        return -EBADMSG;
        }
        if (s[n - 1] == '=')
                pad = s[n - 2] == '=' ? 2 : 1;
        else if (s[n - 2] == '=')
                return -EBADMSG;
        out = malloc(n / 4 * 3 + 1);
        if (!out)
                return -ENOMEM;
        k = EVP_DecodeBlock(out, (const unsigned char *)s, (int)n);
        if (k < 0 || (size_t)k < pad) {
                free(out);
                return -EBADMSG;
        }
        out[k - pad] = 0;
        *ret = out;
        *ret_len = (size_t)k - pad;
        return 0;
}

/* ---- requests ---- */

static char *finish(json_object *o) {
        char *s = NULL;
        if (o) {
                const char *t = json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN);
                s = t ? strdup(t) : NULL;
        }
        json_object_put(o);
        return s;
}

static int add_i64(json_object *o, const char *k, int64_t v) {
        char buf[32];
        snprintf(buf, sizeof buf, "%" PRId64, v);
        return json_object_object_add(o, k, json_object_new_string(buf));
}

static int add_u64(json_object *o, const char *k, uint64_t v) {
        char buf[32];
        snprintf(buf, sizeof buf, "%" PRIu64, v);
        return json_object_object_add(o, k, json_object_new_string(buf));
}

static int add_b64(json_object *o, const char *k, const void *p, size_t n) {
        char *b = b64_encode(p, n);
        int r;
        if (!b)
                return -ENOMEM;
        r = json_object_object_add(o, k, json_object_new_string(b));
        free(b);
        return r;
}

char *etcd_json_lease_grant_request(int64_t ttl_sec) {
        json_object *o = json_object_new_object();
        if (o && add_i64(o, "TTL", ttl_sec) < 0) {
                json_object_put(o);
                return NULL;
        }
        return finish(o);
}

char *etcd_json_lease_id_request(uint64_t lease) {
        json_object *o = json_object_new_object();
        if (o && add_u64(o, "ID", lease) < 0) {
                json_object_put(o);
                return NULL;
        }
        return finish(o);
}

char *etcd_json_put_request(const char *key, const void *value, size_t value_len, uint64_t lease) {
        json_object *o = json_object_new_object();
        if (!o)
                return NULL;
        if (add_b64(o, "key", key, strlen(key)) < 0 || add_b64(o, "value", value, value_len) < 0 ||
            (lease && add_u64(o, "lease", lease) < 0)) {
                json_object_put(o);
                return NULL;
        }
        return finish(o);
}

/* The end of the range of every key starting with prefix: the prefix with its last
 * byte + 1 (end holds ETCD_KV_MAX bytes). */
static int prefix_end(const char *prefix, uint8_t *end, size_t *ret_len) {
        size_t n = strlen(prefix);

        if (n == 0 || n >= ETCD_KV_MAX || (uint8_t)prefix[n - 1] == 0xff)
                return -EINVAL;
        memcpy(end, prefix, n);
        end[n - 1]++;
        *ret_len = n;
        return 0;
}

/* Keys from `from` (from_len 0: the prefix itself) to the end of the prefix's range. */
static int add_range_from(json_object *o, const char *prefix, const uint8_t *from, size_t from_len) {
        uint8_t end[ETCD_KV_MAX];
        size_t n;
        int r = prefix_end(prefix, end, &n);

        if (r < 0)
                return r;
        if ((from_len > 0 ? add_b64(o, "key", from, from_len) : add_b64(o, "key", prefix, n)) < 0 ||
            add_b64(o, "range_end", end, n) < 0)
                return -ENOMEM;
        return 0;
}

static int add_prefix_range(json_object *o, const char *prefix) {
        return add_range_from(o, prefix, NULL, 0);
}

char *etcd_json_get_request(const char *key, int64_t revision) {
        json_object *o = json_object_new_object();
        if (!o || add_b64(o, "key", key, strlen(key)) < 0 || (revision > 0 && add_i64(o, "revision", revision) < 0)) {
                json_object_put(o);
                return NULL;
        }
        return finish(o);
}

char *etcd_json_watch_request(const char *prefix, int64_t start_revision) {
        json_object *o = json_object_new_object(), *c = json_object_new_object();
        if (!o || !c || add_prefix_range(c, prefix) < 0 ||
            (start_revision > 0 && add_i64(c, "start_revision", start_revision) < 0) ||
            json_object_object_add(o, "create_request", c) < 0) {
                json_object_put(c);
                json_object_put(o);
                return NULL;
        }
        return finish(o);
}

/* ---- answers ---- */

static int parse(const char *body, size_t len, json_object **ret) {
        json_tokener *tok;
        json_object *o;

        if (!body || len == 0 || len > (16U << 20))
                return -EBADMSG;
        tok = json_tokener_new();
        if (!tok)
                return -ENOMEM;
        o = json_tokener_parse_ex(tok, body, (int)len);
        /* One complete object and nothing but whitespace after it. */
        if (!o || json_tokener_get_error(tok) != json_tokener_success || !json_object_is_type(o, json_type_object)) {
                json_object_put(o);
                json_tokener_free(tok);
                return -EBADMSG;
        }
        for (size_t i = (size_t)json_tokener_get_parse_end(tok); i < len; i++)
                if (!strchr(" \t\r\n", body[i])) {
                        json_object_put(o);
                        json_tokener_free(tok);
                        return -EBADMSG;
                }
        json_tokener_free(tok);
        *ret = o;
        return 0;
}

/* A member that etcd sends as a decimal string (or, from some versions, a number). */
static int get_i64(json_object *o, const char *k, int64_t *ret, bool required) {
        json_object *v;
        const char *s;
        char *end;
        long long x;

        if (!json_object_object_get_ex(o, k, &v) || json_object_is_type(v, json_type_null)) {
                if (required)
                        return -EBADMSG;
                *ret = 0;
                return 0;
        }
        if (json_object_is_type(v, json_type_int)) {
                *ret = json_object_get_int64(v);
                return 0;
        }
        if (!json_object_is_type(v, json_type_string))
                return -EBADMSG;
        s = json_object_get_string(v);
        if (!s || !*s || strlen(s) > 20)
                return -EBADMSG;
        errno = 0;
        x = strtoll(s, &end, 10);
        if (errno || *end)
                return -EBADMSG;
        *ret = x;
        return 0;
}

static int get_u64(json_object *o, const char *k, uint64_t *ret, bool required) {
        json_object *v;
        const char *s;
        char *end;
        unsigned long long x;

        if (!json_object_object_get_ex(o, k, &v) || json_object_is_type(v, json_type_null)) {
                if (required)
                        return -EBADMSG;
                *ret = 0;
                return 0;
        }
        if (json_object_is_type(v, json_type_int)) {
                int64_t i = json_object_get_int64(v);
                if (i < 0)
                        return -EBADMSG;
                *ret = (uint64_t)i;
                return 0;
        }
        if (!json_object_is_type(v, json_type_string))
                return -EBADMSG;
        s = json_object_get_string(v);
        if (!s || !*s || strlen(s) > 20 || *s == '-' || *s == '+' || *s == ' ')
                return -EBADMSG;
        errno = 0;
        x = strtoull(s, &end, 10);
        if (errno || *end)
                return -EBADMSG;
        *ret = x;
        return 0;
}

static int get_bool(json_object *o, const char *k, bool *ret) {
        json_object *v;
        *ret = false;
        if (!json_object_object_get_ex(o, k, &v) || json_object_is_type(v, json_type_null))
                return 0;
        if (!json_object_is_type(v, json_type_boolean))
                return -EBADMSG;
        *ret = json_object_get_boolean(v);
        return 0;
}

/* {"error": "...", "code": N, "message": "..."}: -EIO with the message. */
static int check_error(json_object *o, char *err, size_t err_size) {
        json_object *e;

        if (!json_object_object_get_ex(o, "error", &e) && !json_object_object_get_ex(o, "message", &e))
                return 0;
        /* A stream's error is an object ({"grpc_code":14,"message":"..."}): its message. */
        json_object *msg;
        if (json_object_is_type(e, json_type_object) && json_object_object_get_ex(e, "message", &msg))
                e = msg;
        if (err && err_size)
                snprintf(err, err_size, "etcd: %s",
                         json_object_is_type(e, json_type_string) ? json_object_get_string(e) : "error");
        return -EIO;
}

int etcd_json_check(const char *body, size_t len, char *err, size_t err_size) {
        json_object *o;
        int r = parse(body, len, &o);
        if (r < 0)
                return r;
        r = check_error(o, err, err_size);
        json_object_put(o);
        return r;
}

static int header_revision(json_object *o, int64_t *ret);

int etcd_json_put(const char *body, size_t len, int64_t *ret_revision, char *err, size_t err_size) {
        json_object *o;
        int r = parse(body, len, &o);
        if (r < 0)
                return r;
        r = check_error(o, err, err_size);
        if (r >= 0)
                r = header_revision(o, ret_revision);
        if (r >= 0 && *ret_revision < 0)
                r = -EBADMSG;
        json_object_put(o);
        return r;
}

int etcd_json_lease_grant(const char *body, size_t len, uint64_t *ret_id, int64_t *ret_ttl, char *err,
                          size_t err_size) {
        json_object *o;
        int r = parse(body, len, &o);
        if (r < 0)
                return r;
        r = check_error(o, err, err_size);
        if (r >= 0)
                r = get_u64(o, "ID", ret_id, true);
        if (r >= 0)
                r = get_i64(o, "TTL", ret_ttl, true);
        if (r >= 0 && (*ret_id == 0 || *ret_ttl <= 0))
                r = -EBADMSG;
        json_object_put(o);
        return r;
}

int etcd_json_keepalive(const char *body, size_t len, int64_t *ret_ttl, char *err, size_t err_size) {
        json_object *o, *res;
        int r = parse(body, len, &o);
        if (r < 0)
                return r;
        r = check_error(o, err, err_size);
        if (r >= 0) {
                /* The gateway streams {"result": {...}}; a lease that is gone has no TTL. */
                if (!json_object_object_get_ex(o, "result", &res) || !json_object_is_type(res, json_type_object))
                        r = -EBADMSG;
                else
                        r = get_i64(res, "TTL", ret_ttl, false);
                if (r >= 0 && *ret_ttl < 0)
                        r = -EBADMSG;
        }
        json_object_put(o);
        return r;
}

static int parse_kv(json_object *k, EtcdKv *kv, uint8_t **key, uint8_t **value) {
        json_object *v;
        int r;

        *kv = (EtcdKv){};
        if (!json_object_is_type(k, json_type_object))
                return -EBADMSG;
        if (!json_object_object_get_ex(k, "key", &v) || !json_object_is_type(v, json_type_string))
                return -EBADMSG;
        r = b64_decode(json_object_get_string(v), (size_t)json_object_get_string_len(v), ETCD_KV_MAX, key,
                       &kv->key_len);
        if (r < 0)
                return r; /* -E2BIG: the caller skips it */
        kv->key = *key;
        if (json_object_object_get_ex(k, "value", &v) && !json_object_is_type(v, json_type_null)) {
                if (!json_object_is_type(v, json_type_string))
                        return -EBADMSG;
                r = b64_decode(json_object_get_string(v), (size_t)json_object_get_string_len(v), ETCD_KV_MAX,
                               value, &kv->value_len);
                if (r == -E2BIG) {
                        kv->value_dropped = true; /* the key still says whose it is */
                        kv->value_len = 0;
                } else if (r < 0)
                        return r;
                else
                        kv->value = *value;
        }
        r = get_i64(k, "mod_revision", &kv->mod_revision, false);
        if (r >= 0)
                r = get_u64(k, "lease", &kv->lease, false);
        return r;
}

static int header_revision(json_object *o, int64_t *ret) {
        json_object *h;
        *ret = 0;
        if (!json_object_object_get_ex(o, "header", &h))
                return 0;
        if (!json_object_is_type(h, json_type_object))
                return -EBADMSG;
        return get_i64(h, "revision", ret, false);
}

/* etcd's OutOfRange (gRPC code 11): a revision compacted away, or not there yet. */
static bool error_out_of_range(json_object *o) {
        json_object *c;
        return json_object_object_get_ex(o, "code", &c) && json_object_is_type(c, json_type_int) &&
               json_object_get_int64(c) == 11;
}

typedef struct RangePage {
        int64_t revision;
        bool more;      /* etcd holds more of the range than the answer (its limit) */
        size_t n;       /* kvs in the answer, skipped ones too */
        uint8_t *last;  /* with want_last: the last kv's key, whatever its length (malloc'ed) */
        size_t last_len;
} RangePage;

static int range_parse(const char *body, size_t len, RangePage *p, bool want_last, EtcdKvFn fn, void *userdata,
                       char *err, size_t err_size) {
        json_object *o, *kvs;
        int r;

        *p = (RangePage){};
        r = parse(body, len, &o);
        if (r < 0)
                return r;
        r = check_error(o, err, err_size);
        if (r < 0 && error_out_of_range(o))
                r = -ESTALE;
        if (r >= 0)
                r = header_revision(o, &p->revision);
        if (r >= 0)
                r = get_bool(o, "more", &p->more);
        if (r >= 0 && json_object_object_get_ex(o, "kvs", &kvs)) {
                if (!json_object_is_type(kvs, json_type_array))
                        r = -EBADMSG;
                else
                        p->n = json_object_array_length(kvs);
                for (size_t i = 0; r >= 0 && i < p->n; i++) {
                        uint8_t *key = NULL, *value = NULL;
                        EtcdKv kv;
                        r = parse_kv(json_object_array_get_idx(kvs, i), &kv, &key, &value);
                        if (r == -E2BIG)
                                r = 0; /* a key longer than any epd writes: not ours */
                        else if (r >= 0 && fn)
                                r = fn(userdata, &kv);
                        free(key);
                        free(value);
                }
                if (r >= 0 && want_last && p->n > 0) {
                        /* The next page starts after it, however long it is. */
                        json_object *k = NULL;
                        if (!json_object_object_get_ex(json_object_array_get_idx(kvs, p->n - 1), "key", &k) ||
                            !json_object_is_type(k, json_type_string))
                                r = -EBADMSG;
                        else
                                r = b64_decode(json_object_get_string(k), (size_t)json_object_get_string_len(k),
                                               SIZE_MAX, &p->last, &p->last_len);
                }
        }
        json_object_put(o);
        return r;
}

int etcd_json_range(const char *body, size_t len, int64_t *ret_revision, EtcdKvFn fn, void *userdata, char *err,
                    size_t err_size) {
        RangePage p;
        /* The last key too, as a page's: the fuzz target, which calls this, reaches that
         * parsing as well. */
        int r = range_parse(body, len, &p, true, fn, userdata, err, err_size);
        if (r >= 0)
                *ret_revision = p.revision;
        free(p.last);
        return r;
}

/* ---- a range read in pages ---- */

static int key_cmp(const uint8_t *a, size_t an, const uint8_t *b, size_t bn) {
        int c = memcmp(a, b, MIN(an, bn));
        return c != 0 ? c : an < bn ? -1 : an > bn ? 1 : 0;
}

int etcd_range_init(EtcdRange *r, const char *prefix) {
        uint8_t end[ETCD_KV_MAX];
        size_t n;

        *r = (EtcdRange){ .prefix = prefix, .limit = ETCD_RANGE_PAGE_KEYS };
        return prefix_end(prefix, end, &n);
}

int etcd_range_restart(EtcdRange *r) {
        if (r->pages >= ETCD_RANGE_PAGES_MAX)
                return -ESTALE;
        r->limit = ETCD_RANGE_PAGE_KEYS;
        r->revision = 0;
        r->from_len = 0;
        r->keys = 0;
        r->cut = false;
        return 0;
}

char *etcd_range_request(const EtcdRange *r) {
        json_object *o = json_object_new_object();
        if (!o || add_range_from(o, r->prefix, r->from, r->from_len) < 0 || add_i64(o, "limit", r->limit) < 0 ||
            (r->revision > 0 && add_i64(o, "revision", r->revision) < 0)) {
                json_object_put(o);
                return NULL;
        }
        return finish(o);
}

/* The next page starts right after `last`, at last + "\0". A key too long for `from`
 * (longer than ETCD_KV_MAX: epd reads none) is passed with every key that continues it:
 * the next page starts where keys stop beginning with its first ETCD_KV_MAX bytes (as a
 * prefix's range ends), so that a request stays small whatever etcd holds. 0: nothing of
 * the prefix's range is after it. */
static int range_next(EtcdRange *r, const uint8_t *last, size_t n) {
        uint8_t end[ETCD_KV_MAX];
        size_t end_len;

        if (n < sizeof r->from) {
                memcpy(r->from, last, n);
                r->from[n] = 0;
                r->from_len = n + 1;
        } else {
                n = ETCD_KV_MAX;
                while (n > 0 && last[n - 1] == 0xff)
                        n--;
                if (n == 0)
                        return 0;
                memcpy(r->from, last, n);
                r->from[n - 1]++;
                r->from_len = n;
        }
        if (prefix_end(r->prefix, end, &end_len) < 0)
                return -EINVAL;
        return key_cmp(r->from, r->from_len, end, end_len) < 0;
}

int etcd_range_answer(EtcdRange *r, const char *body, size_t len, EtcdKvFn fn, void *userdata, char *err,
                      size_t err_size) {
        RangePage p;
        int k;

        r->pages++;
        k = range_parse(body, len, &p, true, fn, userdata, err, err_size);
        if (k < 0)
                goto out;
        r->keys += p.n;
        if (r->revision == 0)
                r->revision = p.revision;
        if (!p.more) {
                k = 0;
                goto out;
        }
        /* A next page must be read at this one's revision, and start past this one's
         * last key: anything else would loop. */
        if (r->revision <= 0 || !p.last ||
            (r->from_len > 0 && key_cmp(p.last, p.last_len, r->from, r->from_len) < 0)) {
                k = -EBADMSG;
                goto out;
        }
        k = range_next(r, p.last, p.last_len);
        if (k <= 0)
                goto out;
        r->limit = MIN(r->limit * 2, (int64_t)ETCD_RANGE_PAGE_KEYS); /* back up after a page past the cap */
        if (r->pages >= ETCD_RANGE_PAGES_MAX) {
                r->cut = true;
                k = 0;
        }
out:
        free(p.last);
        return k;
}

int etcd_range_too_big(EtcdRange *r) {
        r->pages++;
        if (r->limit <= 1 || r->pages >= ETCD_RANGE_PAGES_MAX) {
                r->cut = true;
                return 0;
        }
        r->limit /= 2;
        return 1;
}

int etcd_json_watch(const char *msg, size_t len, EtcdWatchInfo *ret, EtcdEventFn fn, void *userdata, char *err,
                    size_t err_size) {
        json_object *o, *res, *evs, *v;
        int r = parse(msg, len, &o);
        if (r < 0)
                return r;
        *ret = (EtcdWatchInfo){};
        r = check_error(o, err, err_size);
        if (r < 0)
                goto out;
        /* The gateway wraps each WatchResponse as {"result": {...}}. */
        if (!json_object_object_get_ex(o, "result", &res) || !json_object_is_type(res, json_type_object)) {
                r = -EBADMSG;
                goto out;
        }
        r = header_revision(res, &ret->revision);
        if (r >= 0)
                r = get_bool(res, "created", &ret->created);
        if (r >= 0)
                r = get_bool(res, "canceled", &ret->canceled);
        if (r >= 0)
                r = get_i64(res, "compact_revision", &ret->compact_revision, false);
        if (r >= 0 && json_object_object_get_ex(res, "cancel_reason", &v) && json_object_is_type(v, json_type_string))
                snprintf(ret->cancel_reason, sizeof ret->cancel_reason, "%s", json_object_get_string(v));
        if (r < 0 || !json_object_object_get_ex(res, "events", &evs))
                goto out;
        if (!json_object_is_type(evs, json_type_array)) {
                r = -EBADMSG;
                goto out;
        }
        for (size_t i = 0; r >= 0 && i < json_object_array_length(evs); i++) {
                json_object *ev = json_object_array_get_idx(evs, i), *kvo, *type;
                uint8_t *key = NULL, *value = NULL;
                bool put = true;
                EtcdKv kv;

                if (!json_object_is_type(ev, json_type_object) || !json_object_object_get_ex(ev, "kv", &kvo)) {
                        r = -EBADMSG;
                        break;
                }
                /* PUT is the enum's zero and left out; DELETE is named. */
                if (json_object_object_get_ex(ev, "type", &type) && !json_object_is_type(type, json_type_null)) {
                        const char *t = json_object_is_type(type, json_type_string) ? json_object_get_string(type)
                                                                                   : NULL;
                        if (t && strcmp(t, "DELETE") == 0)
                                put = false;
                        else if (!t || strcmp(t, "PUT") != 0) {
                                r = -EBADMSG;
                                break;
                        }
                }
                r = parse_kv(kvo, &kv, &key, &value);
                if (r == -E2BIG)
                        r = 0; /* a key longer than any epd writes: not ours */
                else if (r >= 0 && fn)
                        r = fn(userdata, put, &kv);
                free(key);
                free(value);
        }
out:
        json_object_put(o);
        return r;
}
