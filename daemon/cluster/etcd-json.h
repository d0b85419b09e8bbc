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
char *etcd_json_watch_request(const char *prefix, int64_t start_revision);

int etcd_json_lease_grant(const char *body, size_t len, uint64_t *ret_id, int64_t *ret_ttl, char *err,
                          size_t err_size);
/* ret_ttl 0: the lease is gone (expired or revoked). */
int etcd_json_keepalive(const char *body, size_t len, int64_t *ret_ttl, char *err, size_t err_size);
/* Any answer that is not an error (put, revoke): 0 or -EIO/-EBADMSG. */
int etcd_json_check(const char *body, size_t len, char *err, size_t err_size);
/* A put's answer: the revision of the put (its header's; 0 if it has none). */
int etcd_json_put(const char *body, size_t len, int64_t *ret_revision, char *err, size_t err_size);

typedef int (*EtcdKvFn)(void *userdata, const EtcdKv *kv);
/* A range answer: the store's revision, and fn for every key (a negative return stops
 * and is returned). A key longer than ETCD_KV_MAX is skipped, not a failure of the
 * answer: whoever can write under the prefix cannot stop every epdd from reading it; a
 * longer value comes as value_dropped (value NULL). -ESTALE for etcd's OutOfRange (code
 * 11): the revision asked for is compacted away (or not there yet). */
int etcd_json_range(const char *body, size_t len, int64_t *ret_revision, EtcdKvFn fn, void *userdata, char *err,
                    size_t err_size);

/* The range of one key (at revision, > 0; 0: the latest). */
char *etcd_json_get_request(const char *key, int64_t revision);

/* Every key under a prefix, read in pages: the client caps an answer (16 MiB), and
 * whoever can write under the prefix can put more there than one answer holds.
 *
 * Keys asked for per page: a page of keys and values as long as epd takes (ETCD_KV_MAX
 * each, 11 KiB of JSON with base64 and the other fields) is 11 MiB, within the cap with
 * room; a page of longer values (keys epd skips) past the cap is asked again with half
 * the keys (etcd_range_too_big()), and the next with twice as many again. */
#define ETCD_RANGE_PAGE_KEYS 1000
/* Answers one read takes (past the cap or refused ones too) before it stops, cut short:
 * at most 64,000 keys and 1 GiB, whatever sits under the prefix. */
#define ETCD_RANGE_PAGES_MAX 64

typedef struct EtcdRange {
        const char *prefix;     /* not owned */
        int64_t limit;          /* keys asked for in the next page */
        int64_t revision;       /* the first page's: every later page reads at it (0: none yet) */
        uint8_t from[ETCD_KV_MAX + 1]; /* where the next page starts (from_len 0: the prefix) */
        size_t from_len;
        unsigned pages;         /* answers taken, over restarts too */
        uint64_t keys;          /* keys in them */
        bool cut;               /* stopped at a bound: keys from `from` on are not read */
} EtcdRange;

/* Fails with -EINVAL for a prefix that has no range (empty, ending in 0xff, too long). */
int etcd_range_init(EtcdRange *r, const char *prefix);
/* The next page's request: {key, range_end, limit[, revision]}. NULL without memory. */
char *etcd_range_request(const EtcdRange *r);
/* A page's answer, fn for each of its keys as etcd_json_range(). 1: the next page is to
 * be asked; 0: the read is over (all of it, or r->cut at ETCD_RANGE_PAGES_MAX); -ESTALE:
 * etcd no longer has the first page's revision (compacted between pages): read again
 * from the start (etcd_range_restart()) at a new one; -EBADMSG also for an answer that
 * says there is more but does not move on (no keys, or keys before the page's start). */
int etcd_range_answer(EtcdRange *r, const char *body, size_t len, EtcdKvFn fn, void *userdata, char *err,
                      size_t err_size);
/* The page's answer was past the client's cap: 1, ask again with half the keys; 0, the
 * read is cut (one key alone past the cap, or the bound reached). */
int etcd_range_too_big(EtcdRange *r);
/* From the first page again, at the revision of the next answer; the pages already taken
 * still count: -ESTALE when no page is left. */
int etcd_range_restart(EtcdRange *r);

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
