/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* etcd's v3 JSON gateway: the request bodies epd sends and the parsing of the answers
 * (json-c; keys and values are base64 in both directions, 64-bit integers are JSON
 * strings). Pure: no sockets, unit-tested and fuzzed, since these are bytes from
 * outside. etcd-client.c does the HTTP with libcurl.
 *
 * Every parser returns 0, -EBADMSG for anything that is not what etcd sends (bad
 * JSON, wrong types, bad base64, numbers out of range), or -EIO for an error answer
 * ({"error": ..., "code": ...}), whose message goes to err (may be NULL). */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Bound on a key or value epd accepts from etcd. */
#define ETCD_KV_MAX 4096

typedef struct EtcdKv {
        const uint8_t *key;
        size_t key_len;
        const uint8_t *value;
        size_t value_len;
        int64_t mod_revision;
        uint64_t lease;
        bool value_dropped;     /* the value was longer than ETCD_KV_MAX: value NULL */
} EtcdKv;

/* Request bodies (malloc'ed, NUL-terminated JSON), or NULL without memory. */
char *etcd_json_lease_grant_request(int64_t ttl_sec);
char *etcd_json_lease_id_request(uint64_t lease); /* keepalive and revoke: {"ID": ...} */
char *etcd_json_put_request(const char *key, const void *value, size_t value_len, uint64_t lease);
/* Every key under prefix: range [prefix, prefix with its last byte + 1). */
char *etcd_json_range_request(const char *prefix);
char *etcd_json_watch_request(const char *prefix, int64_t start_revision);

int etcd_json_lease_grant(const char *body, size_t len, uint64_t *ret_id, int64_t *ret_ttl, char *err,
                          size_t err_size);
/* ret_ttl 0: the lease is gone (expired or revoked). */
int etcd_json_keepalive(const char *body, size_t len, int64_t *ret_ttl, char *err, size_t err_size);
/* Any answer that is not an error (put, revoke): 0 or -EIO/-EBADMSG. */
int etcd_json_check(const char *body, size_t len, char *err, size_t err_size);

typedef int (*EtcdKvFn)(void *userdata, const EtcdKv *kv);
/* A range answer: the store's revision, and fn for every key (a negative return stops
 * and is returned). A key longer than ETCD_KV_MAX is skipped, not a failure of the
 * answer: whoever can write under the prefix cannot stop every epdd from reading it; a
 * longer value comes as value_dropped (value NULL). */
int etcd_json_range(const char *body, size_t len, int64_t *ret_revision, EtcdKvFn fn, void *userdata, char *err,
                    size_t err_size);

/* One message of a watch stream. */
typedef struct EtcdWatchInfo {
        bool created;
        bool canceled;
        int64_t compact_revision; /* > 0: history compacted past our start: resync */
        int64_t revision;         /* the header's */
        char cancel_reason[128];
} EtcdWatchInfo;
/* fn(userdata, put, kv) for every event, in order; a delete's kv has no value. Keys and
 * values longer than ETCD_KV_MAX as for a range. */
typedef int (*EtcdEventFn)(void *userdata, bool put, const EtcdKv *kv);
int etcd_json_watch(const char *msg, size_t len, EtcdWatchInfo *ret, EtcdEventFn fn, void *userdata, char *err,
                    size_t err_size);
