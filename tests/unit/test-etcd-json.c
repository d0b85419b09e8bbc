/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* etcd's JSON gateway format (daemon/cluster/etcd-json.c) on answers as etcd 3.4 sends
 * them, and this host's record in etcd (daemon/cluster/member-record.c). */
#include <check.h>
#include <errno.h>
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/etcd-json.h"
#include "cluster/member-record.h"
#include "../check-main.h"

#define S(x) x, strlen(x)

START_TEST(test_requests) {
        char *s = etcd_json_put_request("/epd/members/a", "{}", 2, 0x1234);
        json_object *o = json_tokener_parse(s), *v;
        ck_assert_ptr_nonnull(o);
        ck_assert(json_object_object_get_ex(o, "key", &v));
        ck_assert_str_eq(json_object_get_string(v), "L2VwZC9tZW1iZXJzL2E="); /* base64("/epd/members/a") */
        ck_assert(json_object_object_get_ex(o, "value", &v));
        ck_assert_str_eq(json_object_get_string(v), "e30=");
        ck_assert(json_object_object_get_ex(o, "lease", &v));
        ck_assert_str_eq(json_object_get_string(v), "4660");
        json_object_put(o);
        free(s);

        /* The range of a prefix ends at the prefix with its last byte + 1: "/epd/" -> "/epd0". */
        EtcdRange range;
        ck_assert_int_eq(etcd_range_init(&range, "/epd/"), 0);
        s = etcd_range_request(&range);
        o = json_tokener_parse(s);
        ck_assert(json_object_object_get_ex(o, "range_end", &v));
        ck_assert_str_eq(json_object_get_string(v), "L2VwZDA=");
        json_object_put(o);
        free(s);
        s = etcd_json_watch_request("/epd/", 42);
        ck_assert_ptr_nonnull(strstr(s, "\"start_revision\":\"42\""));
        ck_assert_ptr_nonnull(strstr(s, "\"create_request\""));
        free(s);
        ck_assert_int_eq(etcd_range_init(&range, ""), -EINVAL);
        ck_assert_int_eq(etcd_range_init(&range, "/epd\xff"), -EINVAL);
        /* One key, at a revision: no range_end. */
        s = etcd_json_get_request("/epd/members/a", 40);
        o = json_tokener_parse(s);
        ck_assert(json_object_object_get_ex(o, "key", &v));
        ck_assert_str_eq(json_object_get_string(v), "L2VwZC9tZW1iZXJzL2E=");
        ck_assert(json_object_object_get_ex(o, "revision", &v));
        ck_assert_str_eq(json_object_get_string(v), "40");
        ck_assert(!json_object_object_get_ex(o, "range_end", &v));
        json_object_put(o);
        free(s);
}
END_TEST

START_TEST(test_lease_answers) {
        uint64_t id;
        int64_t ttl;
        char err[128];

        ck_assert_int_eq(etcd_json_lease_grant(S("{\"header\":{\"cluster_id\":\"1\",\"revision\":\"5\"},"
                                                 "\"ID\":\"7587862072307451637\",\"TTL\":\"2\"}"),
                                               &id, &ttl, err, sizeof err),
                         0);
        ck_assert_uint_eq(id, 7587862072307451637ULL);
        ck_assert_int_eq(ttl, 2);
        /* An error answer says why. */
        ck_assert_int_eq(etcd_json_lease_grant(S("{\"error\":\"etcdserver: too many requests\",\"code\":14,"
                                                 "\"message\":\"etcdserver: too many requests\"}"),
                                               &id, &ttl, err, sizeof err),
                         -EIO);
        ck_assert_ptr_nonnull(strstr(err, "too many requests"));
        ck_assert_int_eq(etcd_json_lease_grant(S("{\"ID\":\"0\",\"TTL\":\"2\"}"), &id, &ttl, NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_lease_grant(S("{\"ID\":\"-3\",\"TTL\":\"2\"}"), &id, &ttl, NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_lease_grant(S("{\"ID\":\"3x\",\"TTL\":\"2\"}"), &id, &ttl, NULL, 0), -EBADMSG);

        ck_assert_int_eq(etcd_json_keepalive(S("{\"result\":{\"header\":{},\"ID\":\"5\",\"TTL\":\"2\"}}\n"), &ttl,
                                             NULL, 0),
                         0);
        ck_assert_int_eq(ttl, 2);
        /* A lease that is gone: no TTL. */
        ck_assert_int_eq(etcd_json_keepalive(S("{\"result\":{\"header\":{},\"ID\":\"5\"}}"), &ttl, NULL, 0), 0);
        ck_assert_int_eq(ttl, 0);
        ck_assert_int_eq(etcd_json_keepalive(S("{\"ID\":\"5\"}"), &ttl, NULL, 0), -EBADMSG);
        /* Trailing garbage, truncation, not an object. */
        ck_assert_int_eq(etcd_json_check(S("{} x"), NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_check(S("{\"header\":"), NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_check(S("[1]"), NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_check(S("{\"header\":{}}"), NULL, 0), 0);
        /* A put's answer, as etcd 3.4's gateway sends it: the put's revision (what a
         * resync's revision is compared with to tell a lost key from a read before it). */
        int64_t rev = -1;
        ck_assert_int_eq(etcd_json_put(S("{\"header\":{\"cluster_id\":\"14841639068965178418\",\"member_id\":"
                                         "\"10276657743932975437\",\"revision\":\"42\",\"raft_term\":\"2\"}}"),
                                       &rev, NULL, 0),
                         0);
        ck_assert_int_eq(rev, 42);
        ck_assert_int_eq(etcd_json_put(S("{\"header\":{}}"), &rev, NULL, 0), 0);
        ck_assert_int_eq(rev, 0); /* none: unknown */
        ck_assert_int_eq(etcd_json_put(S("{\"header\":{\"revision\":\"x\"}}"), &rev, NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_put(S("{\"header\":{\"revision\":\"-3\"}}"), &rev, NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_put(S("{\"header\":5}"), &rev, NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_put(S("{\"error\":\"etcdserver: requested lease not found\",\"code\":5}"), &rev,
                                       err, sizeof err),
                         -EIO);
        ck_assert_str_eq(err, "etcd: etcdserver: requested lease not found");
}
END_TEST

typedef struct Seen {
        char keys[8][64];
        char values[8][64];
        bool put[8];
        int64_t rev[8];
        size_t n;
} Seen;

static int on_kv(void *userdata, const EtcdKv *kv) {
        Seen *s = userdata;
        ck_assert_uint_lt(s->n, 8);
        snprintf(s->keys[s->n], 64, "%.*s", (int)kv->key_len, (const char *)kv->key);
        snprintf(s->values[s->n], 64, "%.*s", (int)kv->value_len, kv->value ? (const char *)kv->value : "");
        s->rev[s->n] = kv->mod_revision;
        s->put[s->n++] = true;
        return 0;
}

static int on_event(void *userdata, bool put, const EtcdKv *kv) {
        Seen *s = userdata;
        int r = on_kv(userdata, kv);
        s->put[s->n - 1] = put;
        return r;
}

START_TEST(test_range_and_watch) {
        Seen s = {};
        int64_t rev;
        EtcdWatchInfo wi;

        /* Keys "/epd/members/a" and "/epd/members/b", values "1" and "2". */
        ck_assert_int_eq(etcd_json_range(S("{\"header\":{\"revision\":\"12\"},\"kvs\":["
                                           "{\"key\":\"L2VwZC9tZW1iZXJzL2E=\",\"create_revision\":\"3\","
                                           "\"mod_revision\":\"3\",\"version\":\"1\",\"value\":\"MQ==\",\"lease\":\"9\"},"
                                           "{\"key\":\"L2VwZC9tZW1iZXJzL2I=\",\"mod_revision\":\"11\",\"value\":\"Mg==\"}],"
                                           "\"count\":\"2\"}"),
                                         &rev, on_kv, &s, NULL, 0),
                         0);
        ck_assert_int_eq(rev, 12);
        ck_assert_uint_eq(s.n, 2);
        ck_assert_str_eq(s.keys[0], "/epd/members/a");
        ck_assert_str_eq(s.values[1], "2");
        ck_assert_int_eq(s.rev[1], 11);
        /* An empty range has no kvs at all. */
        s.n = 0;
        ck_assert_int_eq(etcd_json_range(S("{\"header\":{\"revision\":\"12\"}}"), &rev, on_kv, &s, NULL, 0), 0);
        ck_assert_uint_eq(s.n, 0);
        /* Bad base64 anywhere is refused. */
        ck_assert_int_eq(etcd_json_range(S("{\"kvs\":[{\"key\":\"L2V*\"}]}"), &rev, on_kv, &s, NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_range(S("{\"kvs\":[{\"key\":\"L2V\"}]}"), &rev, on_kv, &s, NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_range(S("{\"kvs\":[{\"key\":\"L2=w\"}]}"), &rev, on_kv, &s, NULL, 0), -EBADMSG);
        ck_assert_int_eq(etcd_json_range(S("{\"kvs\":{}}"), &rev, on_kv, &s, NULL, 0), -EBADMSG);

        ck_assert_int_eq(etcd_json_watch(S("{\"result\":{\"header\":{\"revision\":\"12\"},\"created\":true}}"), &wi,
                                         on_event, &s, NULL, 0),
                         0);
        ck_assert(wi.created);
        ck_assert_int_eq(wi.revision, 12);
        s.n = 0;
        /* A put (type left out) and a delete. */
        ck_assert_int_eq(etcd_json_watch(S("{\"result\":{\"header\":{\"revision\":\"14\"},\"events\":["
                                           "{\"kv\":{\"key\":\"L2VwZC9tZW1iZXJzL2E=\",\"mod_revision\":\"13\",\"value\":\"Mw==\"}},"
                                           "{\"type\":\"DELETE\",\"kv\":{\"key\":\"L2VwZC9tZW1iZXJzL2I=\",\"mod_revision\":\"14\"}}]}}"),
                                         &wi, on_event, &s, NULL, 0),
                         0);
        ck_assert_uint_eq(s.n, 2);
        ck_assert(s.put[0]);
        ck_assert_str_eq(s.values[0], "3");
        ck_assert(!s.put[1]);
        ck_assert_str_eq(s.keys[1], "/epd/members/b");
        /* Compaction: the caller must read everything again. */
        ck_assert_int_eq(etcd_json_watch(S("{\"result\":{\"canceled\":true,\"compact_revision\":\"40\","
                                           "\"cancel_reason\":\"mvcc: required revision has been compacted\"}}"),
                                         &wi, on_event, &s, NULL, 0),
                         0);
        ck_assert(wi.canceled);
        ck_assert_int_eq(wi.compact_revision, 40);
        ck_assert_ptr_nonnull(strstr(wi.cancel_reason, "compacted"));
        ck_assert_int_eq(etcd_json_watch(S("{\"result\":{\"events\":[{\"type\":\"BOGUS\",\"kv\":{\"key\":\"YQ==\"}}]}}"),
                                         &wi, on_event, &s, NULL, 0),
                         -EBADMSG);
        ck_assert_int_eq(etcd_json_watch(S("{\"result\":{\"events\":[{\"type\":\"PUT\"}]}}"), &wi, on_event, &s, NULL,
                                         0),
                         -EBADMSG);
        ck_assert_int_eq(etcd_json_watch(S("{\"error\":{\"grpc_code\":14}}"), &wi, on_event, &s, NULL, 0), -EIO);
}
END_TEST

/* A key or value longer than epd takes (ETCD_KV_MAX) under the prefix does not fail the
 * whole answer (which froze membership on every host until someone deleted it): an
 * over-long key is skipped, an over-long value comes as dropped, and the kvs around
 * them are read. */
static char *b64_of(size_t n, char c) {
        size_t len = (n + 2) / 3 * 4;
        char *o = malloc(len + 1);
        ck_assert_ptr_nonnull(o);
        /* n bytes of c ('A' = 0x41 repeated encodes as "QUFB"): multiples of 3 only. */
        ck_assert_uint_eq(n % 3, 0);
        ck_assert_int_eq(c, 'A');
        for (size_t i = 0; i < len; i += 4)
                memcpy(o + i, "QUFB", 4);
        o[len] = 0;
        return o;
}

/* A watch stream's error is an object: its message is what is said, not "error". */
START_TEST(test_stream_error_message) {
        EtcdWatchInfo wi;
        char err[128] = "";
        ck_assert_int_eq(etcd_json_watch(S("{\"error\":{\"grpc_code\":14,\"http_code\":503,"
                                           "\"message\":\"etcdserver: no leader\"}}"),
                                         &wi, NULL, NULL, err, sizeof err),
                         -EIO);
        ck_assert_str_eq(err, "etcd: etcdserver: no leader");
}
END_TEST

START_TEST(test_oversized_kv_skipped) {
        Seen s = {};
        int64_t rev;
        EtcdWatchInfo wi;
        char *big = b64_of(ETCD_KV_MAX + 5, 'A'), *msg = NULL;

        ck_assert_int_ge(asprintf(&msg, "{\"header\":{\"revision\":\"20\"},\"kvs\":["
                                        "{\"key\":\"L2VwZC9tZW1iZXJzL2E=\",\"mod_revision\":\"3\",\"value\":\"MQ==\"},"
                                        "{\"key\":\"%s\",\"mod_revision\":\"4\",\"value\":\"MQ==\"},"
                                        "{\"key\":\"L2VwZC9tZW1iZXJzL2I=\",\"mod_revision\":\"5\",\"value\":\"%s\"},"
                                        "{\"key\":\"L2VwZC9tZW1iZXJzL2M=\",\"mod_revision\":\"6\",\"value\":\"Mw==\"}]}",
                                  big, big),
                         0);
        ck_assert_int_eq(etcd_json_range(msg, strlen(msg), &rev, on_kv, &s, NULL, 0), 0);
        ck_assert_int_eq(rev, 20);
        ck_assert_uint_eq(s.n, 3);
        ck_assert_str_eq(s.keys[0], "/epd/members/a");
        ck_assert_str_eq(s.keys[1], "/epd/members/b");
        ck_assert_str_eq(s.values[1], ""); /* dropped */
        ck_assert_str_eq(s.keys[2], "/epd/members/c");
        ck_assert_str_eq(s.values[2], "3");
        free(msg);

        s.n = 0;
        ck_assert_int_ge(asprintf(&msg, "{\"result\":{\"header\":{\"revision\":\"21\"},\"events\":["
                                        "{\"kv\":{\"key\":\"%s\",\"mod_revision\":\"21\",\"value\":\"MQ==\"}},"
                                        "{\"kv\":{\"key\":\"L2VwZC9tZW1iZXJzL2I=\",\"mod_revision\":\"21\","
                                        "\"value\":\"%s\"}}]}}",
                                  big, big),
                         0);
        ck_assert_int_eq(etcd_json_watch(msg, strlen(msg), &wi, on_event, &s, NULL, 0), 0);
        ck_assert_uint_eq(s.n, 1);
        ck_assert_str_eq(s.keys[0], "/epd/members/b");
        ck_assert_str_eq(s.values[0], "");
        free(msg);
        free(big);
}
END_TEST

/* A request's member k as a string ("" when it has none). */
static void request_field(const EtcdRange *range, const char *k, char *buf, size_t size) {
        char *s = etcd_range_request(range);
        json_object *o, *v;

        ck_assert_ptr_nonnull(s);
        o = json_tokener_parse(s);
        ck_assert_ptr_nonnull(o);
        snprintf(buf, size, "%s", json_object_object_get_ex(o, k, &v) ? json_object_get_string(v) : "");
        json_object_put(o);
        free(s);
}

#define ASSERT_FIELD(range, k, want)                                   \
        do {                                                           \
                char _b[8192];                                         \
                request_field(range, k, _b, sizeof _b);                \
                ck_assert_str_eq(_b, want);                            \
        } while (0)

#define KEY_A "{\"key\":\"L2VwZC9tZW1iZXJzL2E=\",\"mod_revision\":\"3\",\"value\":\"MQ==\"}"
#define KEY_B "{\"key\":\"L2VwZC9tZW1iZXJzL2I=\",\"mod_revision\":\"4\",\"value\":\"Mg==\"}"
#define KEY_C "{\"key\":\"L2VwZC9tZW1iZXJzL2M=\",\"mod_revision\":\"5\",\"value\":\"Mw==\"}"
#define COMPACTED "{\"error\":\"etcdserver: mvcc: required revision has been compacted\",\"message\":" \
                  "\"etcdserver: mvcc: required revision has been compacted\",\"code\":11}"

/* The read of a prefix in pages: one answer of everything under it was capped (16 MiB)
 * and whoever wrote more there stopped every resync for good. Each page asks for a
 * limit; etcd's "more" asks for the next, from the last key + "\0", at the first page's
 * revision (one snapshot); a compacted revision reads again from the start. */
START_TEST(test_range_pages) {
        EtcdRange range;
        Seen s = {};
        char err[128];

        ck_assert_int_eq(etcd_range_init(&range, "/epd/members/"), 0);
        ASSERT_FIELD(&range, "key", "L2VwZC9tZW1iZXJzLw==");       /* "/epd/members/" */
        ASSERT_FIELD(&range, "range_end", "L2VwZC9tZW1iZXJzMA==");  /* "/epd/members0" */
        ASSERT_FIELD(&range, "limit", "1000");
        ASSERT_FIELD(&range, "revision", "");                       /* the latest */
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"header\":{\"revision\":\"40\"},\"kvs\":[" KEY_A "," KEY_B
                                                     "],\"more\":true,\"count\":\"3\"}"),
                                           on_kv, &s, err, sizeof err),
                         1);
        ck_assert_int_eq(range.revision, 40);
        /* The next page: after "/epd/members/b", at revision 40, same end. */
        ASSERT_FIELD(&range, "key", "L2VwZC9tZW1iZXJzL2IA");        /* "/epd/members/b\0" */
        ASSERT_FIELD(&range, "range_end", "L2VwZC9tZW1iZXJzMA==");
        ASSERT_FIELD(&range, "revision", "40");
        ASSERT_FIELD(&range, "limit", "1000");
        /* Its header says the store moved on: the read stays at 40. */
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"header\":{\"revision\":\"45\"},\"kvs\":[" KEY_C
                                                     "],\"count\":\"1\"}"),
                                           on_kv, &s, err, sizeof err),
                         0);
        ck_assert_int_eq(range.revision, 40);
        ck_assert(!range.cut);
        ck_assert_uint_eq(range.pages, 2);
        ck_assert_uint_eq(range.keys, 3);
        ck_assert_uint_eq(s.n, 3);
        ck_assert_str_eq(s.keys[2], "/epd/members/c");

        /* Compacted between pages: -ESTALE, and the read starts over at the latest. */
        ck_assert_int_eq(etcd_range_init(&range, "/epd/members/"), 0);
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"header\":{\"revision\":\"40\"},\"kvs\":[" KEY_A
                                                     "],\"more\":true}"),
                                           NULL, NULL, err, sizeof err),
                         1);
        ck_assert_int_eq(etcd_range_answer(&range, S(COMPACTED), NULL, NULL, err, sizeof err), -ESTALE);
        ck_assert_ptr_nonnull(strstr(err, "compacted"));
        ck_assert_int_eq(etcd_range_restart(&range), 0);
        ASSERT_FIELD(&range, "key", "L2VwZC9tZW1iZXJzLw==");
        ASSERT_FIELD(&range, "revision", "");
        ck_assert_uint_eq(range.pages, 2); /* the pages taken still count */
        /* Any other error answer is one (-EIO). */
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"error\":\"etcdserver: request timed out\",\"code\":14}"),
                                           NULL, NULL, err, sizeof err),
                         -EIO);

        /* "more" that does not move on would loop: refused. */
        ck_assert_int_eq(etcd_range_init(&range, "/epd/members/"), 0);
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"header\":{\"revision\":\"40\"},\"more\":true}"), NULL,
                                           NULL, err, sizeof err),
                         -EBADMSG);
        ck_assert_int_eq(etcd_range_init(&range, "/epd/members/"), 0);
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"header\":{\"revision\":\"40\"},\"kvs\":[" KEY_B
                                                     "],\"more\":true}"),
                                           NULL, NULL, err, sizeof err),
                         1);
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"header\":{\"revision\":\"40\"},\"kvs\":[" KEY_A
                                                     "],\"more\":true}"),
                                           NULL, NULL, err, sizeof err),
                         -EBADMSG);
        /* Nor without a revision to read the next page at. */
        ck_assert_int_eq(etcd_range_init(&range, "/epd/members/"), 0);
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"kvs\":[" KEY_A "],\"more\":true}"), NULL, NULL, err,
                                           sizeof err),
                         -EBADMSG);
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"kvs\":[" KEY_A "],\"more\":\"yes\"}"), NULL, NULL, err,
                                           sizeof err),
                         -EBADMSG);
}
END_TEST

/* base64 of n bytes (malloc'ed), for keys built here. */
static char *b64(const void *p, size_t n) {
        static const char tbl[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        const uint8_t *k = p;
        char *out = malloc((n + 2) / 3 * 4 + 1);
        size_t o = 0;

        ck_assert_ptr_nonnull(out);
        for (size_t i = 0; i < n; i += 3) {
                unsigned v = (unsigned)k[i] << 16 | (i + 1 < n ? (unsigned)k[i + 1] << 8 : 0) |
                             (i + 2 < n ? k[i + 2] : 0);
                out[o++] = tbl[v >> 18 & 63];
                out[o++] = tbl[v >> 12 & 63];
                out[o++] = i + 1 < n ? tbl[v >> 6 & 63] : '=';
                out[o++] = i + 2 < n ? tbl[v & 63] : '=';
        }
        out[o] = 0;
        return out;
}

/* An answer of one key that says there is more. */
static int answer_more(EtcdRange *range, const void *key, size_t n, EtcdKvFn fn, Seen *s) {
        char *k = b64(key, n), *msg = NULL, err[128];
        int r;

        ck_assert_int_ge(asprintf(&msg, "{\"header\":{\"revision\":\"9\"},\"kvs\":[{\"key\":\"%s\",\"value\":\"MQ==\"}],"
                                        "\"more\":true}",
                                  k),
                         0);
        r = etcd_range_answer(range, msg, strlen(msg), fn, s, err, sizeof err);
        free(msg);
        free(k);
        return r;
}

/* A page past the client's cap is asked again with half the keys, down to one; the next
 * page asks for twice as many again. Past ETCD_RANGE_PAGES_MAX answers the read stops,
 * cut: whatever sits under the prefix, a read is bounded. */
START_TEST(test_range_bounds) {
        EtcdRange range;
        char err[128];

        ck_assert_int_eq(etcd_range_init(&range, "/epd/members/"), 0);
        ck_assert_int_eq(etcd_range_too_big(&range), 1);
        ASSERT_FIELD(&range, "limit", "500");
        ck_assert_int_eq(etcd_range_too_big(&range), 1);
        ASSERT_FIELD(&range, "limit", "250");
        ASSERT_FIELD(&range, "revision", "");
        ck_assert_int_eq(etcd_range_answer(&range, S("{\"header\":{\"revision\":\"7\"},\"kvs\":[" KEY_A
                                                     "],\"more\":true}"),
                                           NULL, NULL, err, sizeof err),
                         1);
        ASSERT_FIELD(&range, "limit", "500");
        ASSERT_FIELD(&range, "revision", "7");
        for (int i = 0; i < 20; i++)
                if (etcd_range_too_big(&range) == 0)
                        break;
        ck_assert(range.cut); /* one key alone past the cap: the read stops there */
        ASSERT_FIELD(&range, "limit", "1");

        /* Every answer says there is more: the read stops after ETCD_RANGE_PAGES_MAX. */
        ck_assert_int_eq(etcd_range_init(&range, "/epd/members/"), 0);
        unsigned pages = 0;
        int r;
        do {
                char key[32];
                snprintf(key, sizeof key, "/epd/members/p%04u", pages++);
                r = answer_more(&range, key, strlen(key), NULL, NULL);
        } while (r == 1 && pages < 1000);
        ck_assert_int_eq(r, 0);
        ck_assert(range.cut);
        ck_assert_uint_eq(pages, ETCD_RANGE_PAGES_MAX);
        ck_assert_uint_eq(range.pages, ETCD_RANGE_PAGES_MAX);
        ASSERT_FIELD(&range, "key", "L2VwZC9tZW1iZXJzL3AwMDYzAA=="); /* "/epd/members/p0063\0": where it stopped */
        /* No restart past the bound either. */
        ck_assert_int_eq(etcd_range_restart(&range), -ESTALE);
}
END_TEST

/* A key longer than epd reads (a junk writer's) still moves the read on, and the next
 * page's key stays small whatever its length: it starts where keys stop beginning with
 * its first ETCD_KV_MAX bytes (only longer keys are passed: epd skips them anyway). */
START_TEST(test_range_long_key) {
        EtcdRange range;
        uint8_t key[ETCD_KV_MAX + 5];
        Seen s = {};

        memset(key, 'A', sizeof key);
        ck_assert_int_eq(etcd_range_init(&range, "A"), 0);
        ck_assert_int_eq(answer_more(&range, key, sizeof key, on_kv, &s), 1);
        ck_assert_uint_eq(s.n, 0); /* skipped */
        ck_assert_uint_eq(range.from_len, ETCD_KV_MAX);
        for (size_t i = 0; i + 1 < ETCD_KV_MAX; i++)
                ck_assert_int_eq(range.from[i], 'A');
        ck_assert_int_eq(range.from[ETCD_KV_MAX - 1], 'B');
        char *req = etcd_range_request(&range);
        ck_assert_ptr_nonnull(req);
        ck_assert_uint_lt(strlen(req), ETCD_KV_MAX * 2); /* not the whole key */
        free(req);

        /* Nothing of the range after it ("A" and 0xff bytes on): the read is over. */
        memset(key + 1, 0xff, sizeof key - 1);
        ck_assert_int_eq(etcd_range_init(&range, "A"), 0);
        ck_assert_int_eq(answer_more(&range, key, sizeof key, NULL, NULL), 0);
        ck_assert(!range.cut);
        /* A short one: its key + "\0". */
        ck_assert_int_eq(etcd_range_init(&range, "A"), 0);
        ck_assert_int_eq(answer_more(&range, "AB", 2, NULL, NULL), 1);
        ASSERT_FIELD(&range, "key", "QUIA");     /* "AB\0" */
        ASSERT_FIELD(&range, "range_end", "Qg=="); /* "B" */
}
END_TEST

START_TEST(test_member_record) {
        MemberInfo in = {}, out;
        char key[128], host[64];
        char *v;

        snprintf(in.host_id, sizeof in.host_id, "alpha");
        snprintf(in.address, sizeof in.address, "10.1.0.1:7100");
        snprintf(in.transports, sizeof in.transports, "tcp,rdma");
        snprintf(in.arenas, sizeof in.arenas, "kv0:host:64M,g0:gpu:1024M");
        snprintf(in.nics, sizeof in.nics, "gpu0->eth1");
        in.gpus = 1;
        in.started_usec = 1764750000123456ULL;
        v = member_record_encode(&in);
        ck_assert_ptr_nonnull(v);
        ck_assert_int_eq(member_record_parse("alpha", (const uint8_t *)v, strlen(v), &out), 0);
        ck_assert_str_eq(out.address, in.address);
        ck_assert_str_eq(out.arenas, in.arenas);
        ck_assert_uint_eq(out.gpus, 1);
        ck_assert_uint_eq(out.started_usec, in.started_usec);
        ck_assert(!out.has_mac); /* none given: member_record_verify() refuses it */
        ck_assert_ptr_nonnull(strstr(v, "\"version\":2"));
        ck_assert_ptr_null(strstr(v, "\"mac\""));
        /* The record's host id must be the key's. */
        ck_assert_int_eq(member_record_parse("bravo", (const uint8_t *)v, strlen(v), &out), -EBADMSG);
        free(v);

        const char *bad[] = {
                "{\"version\":3,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\"}",
                "{\"version\":0,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\"}",
                "{\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\"}",
                "{\"version\":1,\"host_id\":\"alpha\"}",
                "{\"version\":1,\"host_id\":\"alpha\",\"address\":7100}",
                "{\"version\":1,\"host_id\":\"alpha\",\"address\":\"nocolon\"}",
                "{\"version\":1,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"gpus\":-1}",
                "{\"version\":1,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"started_usec\":\"-5\"}",
                "{\"version\":1,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\"} trailing",
                "not json",
        };
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
                ck_assert_msg(member_record_parse("alpha", (const uint8_t *)bad[i], strlen(bad[i]), &out) == -EBADMSG,
                              "accepted: %s", bad[i]);
        /* Unknown fields are fine (a newer epdd may add some). */
        const char *newer = "{\"version\":1,\"host_id\":\"alpha\",\"address\":\"10.1.0.1:7100\",\"zone\":\"b\"}";
        ck_assert_int_eq(member_record_parse("alpha", (const uint8_t *)newer, strlen(newer), &out), 0);

        ck_assert_int_eq(member_key("/epd/", "alpha", key, sizeof key), 0);
        ck_assert_str_eq(key, "/epd/members/alpha");
        char small[10];
        ck_assert_int_eq(member_key("/epd/", "alpha", small, sizeof small), -ENAMETOOLONG);
        ck_assert_int_eq(member_key_host("/epd/", (const uint8_t *)key, strlen(key), host, sizeof host), 0);
        ck_assert_str_eq(host, "alpha");
        ck_assert_int_eq(member_key_host("/epd/", (const uint8_t *)"/epd/members/", 13, host, sizeof host), -EINVAL);
        ck_assert_int_eq(member_key_host("/epd/", (const uint8_t *)"/epd/other/x", 12, host, sizeof host), -EINVAL);
        ck_assert_int_eq(member_key_host("/epd/", (const uint8_t *)"/epd/members/a\0b", 16, host, sizeof host), -EINVAL);
}
END_TEST

int main(void) {
        Suite *s = suite_create("etcd-json");
        TCase *tc = tcase_create("etcd-json");
        tcase_add_test(tc, test_requests);
        tcase_add_test(tc, test_lease_answers);
        tcase_add_test(tc, test_range_and_watch);
        tcase_add_test(tc, test_oversized_kv_skipped);
        tcase_add_test(tc, test_stream_error_message);
        tcase_add_test(tc, test_range_pages);
        tcase_add_test(tc, test_range_bounds);
        tcase_add_test(tc, test_range_long_key);
        tcase_add_test(tc, test_member_record);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
