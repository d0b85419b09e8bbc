/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* What each epdd registers about itself in etcd: the key PREFIX "members/" HOST_ID and
 * a JSON value (json-c):
 *
 *   {"version": 1, "host_id": "alpha", "address": "10.0.0.1:7100",
 *    "transports": "tcp,rdma", "arenas": "kv0:host:64M", "gpus": 0,
 *    "nics": "eth0", "started_usec": 1764750000000000}
 *
 * Pure; unit-tested and fuzzed (the values come from etcd, written by any member). */

#include <stddef.h>
#include <stdint.h>

#include "cluster/membership.h"

#define MEMBER_RECORD_VERSION 1
#define MEMBER_KEY_DIR "members/"

/* PREFIX members/HOST_ID into buf; -ENAMETOOLONG if it does not fit. */
int member_key(const char *prefix, const char *host_id, char *buf, size_t size);
/* The host id of a member key under prefix, or -EINVAL for any other key. */
int member_key_host(const char *prefix, const uint8_t *key, size_t key_len, char *ret, size_t size);

/* The JSON value of info (malloc'ed), or NULL without memory. */
char *member_record_encode(const MemberInfo *info);
/* Parses a value; the host id in it must be host (the key's). Unknown members are
 * ignored (newer versions may add some); a version other than 1, a missing or wrong
 * typed field, or a field too long is -EBADMSG. */
int member_record_parse(const char *host, const uint8_t *value, size_t len, MemberInfo *ret);
