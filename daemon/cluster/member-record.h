/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* What each epdd registers about itself in etcd: the key PREFIX "members/" HOST_ID and
 * a JSON value (json-c):
 *
 *   {"version": 2, "host_id": "alpha", "address": "10.0.0.1:7100",
 *    "transports": "tcp,rdma", "arenas": "kv0:host:64M", "gpus": 0,
 *    "nics": "eth0", "started_usec": "1764750000000000", "mac": "<64 hex digits>"}
 *
 * "mac" is HMAC-SHA256 with the cluster key (peer_auth_keyed_mac(), context
 * MEMBER_RECORD_MAC_CONTEXT) over the key's prefix and every other field: etcd holds no
 * secret, and whoever can write there must not make members dial an address of its
 * choosing (and relay the handshake to the real host: in the middle of a session that
 * both ends take for authenticated). A record without a MAC that verifies is refused.
 *
 * Pure; unit-tested and fuzzed (the values come from etcd, written by any member). */

#include <stddef.h>
#include <stdint.h>

#include "cluster/membership.h"

#define MEMBER_RECORD_VERSION 2 /* signed; 1: before records were signed (refused) */
#define MEMBER_RECORD_MAC_CONTEXT "epd member record v2"
#define MEMBER_KEY_DIR "members/"

/* PREFIX members/HOST_ID into buf; -ENAMETOOLONG if it does not fit. */
int member_key(const char *prefix, const char *host_id, char *buf, size_t size);
/* The host id of a member key under prefix, or -EINVAL for any other key. */
int member_key_host(const char *prefix, const uint8_t *key, size_t key_len, char *ret, size_t size);

struct PeerAuthKey;

/* The JSON value of info (malloc'ed), or NULL without memory; its MAC as info has it
 * (member_record_sign()), none if info->has_mac is false. */
char *member_record_encode(const MemberInfo *info);
/* Parses a value; the host id in it must be host (the key's). Unknown members are
 * ignored (newer versions may add some, outside the MAC: nothing acts on them); a
 * version other than 1 or 2, a missing or wrong typed field, a field too long, or a
 * "mac" that is not 64 lowercase hex digits is -EBADMSG. A record without "mac" parses
 * (has_mac false), for member_record_verify() to refuse it by name. */
int member_record_parse(const char *host, const uint8_t *value, size_t len, MemberInfo *ret);

/* Sets info->mac (and has_mac): the MAC with k over prefix (EtcdPrefix=, the key's) and
 * the record's fields (host id, address, transports, arenas, nics, gpus, started_usec).
 * -EINVAL for an invalid record; -ENOMEM, -EIO from libcrypto. */
int member_record_sign(const struct PeerAuthKey *k, const char *prefix, MemberInfo *info);
/* 0: info's MAC is the one k makes over its fields under prefix (compared in constant
 * time); -ENOKEY: it carries none (an epdd from before records were signed); -EPERM:
 * another key made it, or a field was changed since (an address rewritten in etcd);
 * -EINVAL for an invalid record. */
int member_record_verify(const struct PeerAuthKey *k, const char *prefix, const MemberInfo *info);
