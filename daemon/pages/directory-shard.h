/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The cluster-wide side of the block directory (docs/cluster.md). Pure; unit-tested.
 *
 * DirectoryShard: the records this host keeps as the OWNER of hashes (rendezvous
 * hashing over the live members): hash -> the hosts that cache that block (each with
 * its arena and the worker that published it), at most DIRECTORY_HOLDERS_MAX per
 * hash. Records are caches of caches: a holder that goes away takes its records with
 * it (drop_host), and a hash whose owner changes is forgotten here (prune) and
 * published again by its holders to the new owner.
 *
 * DirectoryCache: answers that remote owners gave, kept until they expire (a bounded
 * time, DirectoryCacheTime=) and at most `max` of them (the oldest go first). */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pages/directory-proto.h"
#include "time-util.h"

typedef struct DirectoryShard DirectoryShard;

int directory_shard_new(DirectoryShard **ret, size_t max_records);
DirectoryShard *directory_shard_free(DirectoryShard *sh);

/* Adds (or refreshes) host's record of hash. -ENOSPC past max_records (or past the
 * names it can hold), -E2BIG when the hash has DIRECTORY_HOLDERS_MAX holders already,
 * -EINVAL for invalid names. */
int directory_shard_put(DirectoryShard *sh, uint64_t hash, const char *host, const char *arena, const char *worker);
/* Removes host's record of hash in arena (-ENOENT if there is none). */
int directory_shard_del(DirectoryShard *sh, uint64_t hash, const char *host, const char *arena);
/* Removes every record of host; returns how many. */
size_t directory_shard_drop_host(DirectoryShard *sh, const char *host);
/* Removes every hash for which keep() is false; returns how many records went. */
size_t directory_shard_prune(DirectoryShard *sh, bool (*keep)(void *userdata, uint64_t hash), void *userdata);
/* Forgets every record of hash; returns how many went. */
size_t directory_shard_forget(DirectoryShard *sh, uint64_t hash);
/* Every hash held (malloc'ed array in *ret), for work done in steps over a snapshot. */
int directory_shard_keys(const DirectoryShard *sh, uint64_t **ret, size_t *ret_n);
/* The holders of hash (ret->n_holders 0 if none). */
void directory_shard_get(const DirectoryShard *sh, uint64_t hash, DirectoryAnswerEntry *ret);
/* Puts this host's own knowledge, which is exact, into an answer for its hash: host
 * holds the block in arena (for worker), or not at all when arena is NULL. A holder
 * entry of host that says otherwise (a remote owner's record or a cached answer from
 * before this host dropped the block) goes; host's entry takes the last slot of a full
 * answer. */
void directory_answer_set_self(DirectoryAnswerEntry *e, const char *host, const char *arena, const char *worker);
/* Records (holder entries) and hashes held. */
size_t directory_shard_records(const DirectoryShard *sh);
/* How often the name table was compacted (it was full). */
uint64_t directory_shard_compactions(const DirectoryShard *sh);
size_t directory_shard_hashes(const DirectoryShard *sh);

typedef struct DirectoryCache DirectoryCache;

int directory_cache_new(DirectoryCache **ret, size_t max);
DirectoryCache *directory_cache_free(DirectoryCache *c);
/* Keeps e (an owner's answer, possibly with no holders) until now + ttl. */
int directory_cache_put(DirectoryCache *c, const DirectoryAnswerEntry *e, usec_t now, usec_t ttl);
/* The cached answer for hash if it has not expired: true and *ret filled. */
bool directory_cache_get(DirectoryCache *c, uint64_t hash, usec_t now, DirectoryAnswerEntry *ret);
void directory_cache_clear(DirectoryCache *c);
size_t directory_cache_size(const DirectoryCache *c);
