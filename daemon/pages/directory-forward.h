/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The block directory across hosts (docs/cluster.md): the "directory" subsystem.
 *
 * The directory is sharded by owner over the live members: this host and every peer
 * whose session is up (configured or from etcd), by rendezvous hashing. Each entry a
 * local Publish makes is told to the owner of its hash (PUBLISH, batched per owner and
 * flushed within a millisecond), each that goes (removal, eviction) too (UNPUBLISH).
 * The owner keeps the records (directory-shard.h). When the set of live members
 * changes, owners forget the hashes they no longer own and every host publishes its
 * entries whose owner changed to the new owner; a peer that goes down takes its
 * records with it. directory_forward_locate() asks the owners of a chain of hashes
 * who holds each block (LOOKUP/ANSWER, answers cached for DirectoryCacheTime=) and
 * hands the holders per block to a waiter; this host's own blocks come from its
 * directory directly. Without peers everything is local and answered at once. */

#include <stddef.h>
#include <stdint.h>

#include "core/manager.h"
#include "pages/directory-shard.h"

typedef struct DirectoryForward DirectoryForward;

/* How long a locate waits for remote owners; an owner silent past it counts as
 * holding nothing (owners_missing). */
#define DIRECTORY_LOCATE_TIMEOUT_USEC (500 * USEC_PER_MSEC)
/* Locates in flight at once. */
#define DIRECTORY_LOCATES_MAX 1024U
/* Hashes in one locate, and in all the locates in flight together: each takes an answer
 * entry of about 1.5 KiB (its holders) until the owners answered, so the second bounds
 * what callers, none of them charged for it, can make epdd hold at once (~200 MiB). */
#define DIRECTORY_LOCATE_HASHES_MAX 65536U
#define DIRECTORY_LOCATE_HASHES_IN_FLIGHT_MAX (2 * DIRECTORY_LOCATE_HASHES_MAX)
/* Records this host keeps as an owner, and remote answers it caches. */
#define DIRECTORY_SHARD_RECORDS_MAX (4U << 20)
#define DIRECTORY_CACHE_MAX (256U << 10)

typedef struct DirectoryLocateResult {
        size_t n;                       /* hashes asked */
        DirectoryAnswerEntry *entries;  /* n: the holders of each block */
        unsigned owners_missing;        /* owners that did not answer */
} DirectoryLocateResult;

typedef struct DirectoryLocateWaiter DirectoryLocateWaiter;
struct DirectoryLocateWaiter {
        /* Called once, with the result (owned by the forwarder: valid during the call). */
        void (*done)(DirectoryLocateWaiter *w, const DirectoryLocateResult *res);
};

/* Starts a locate of hashes[0..n): w->done() is called once, possibly before this
 * returns. -EINVAL (n 0 or too many), -EBUSY (too many in flight), -ENOMEM. */
int directory_forward_locate(DirectoryForward *df, const uint64_t *hashes, size_t n, DirectoryLocateWaiter *w);

typedef struct DirectoryForwardStats {
        uint64_t lookups, remote_queries, remote_answers, remote_timeouts;
        uint64_t cache_hits, cache_misses;
        uint64_t published_forwarded, unpublished_forwarded, records_received, records_dropped;
        uint64_t republished, send_failures, misdirected;
} DirectoryForwardStats;
void directory_forward_stats(DirectoryForward *df, DirectoryForwardStats *ret);

/* Records this host keeps as an owner. */
size_t directory_forward_records(DirectoryForward *df);
/* The live members the hashes are sharded over (this host first), and its count. */
const char *const *directory_forward_hosts(DirectoryForward *df, size_t *ret_n);
/* Of this host's directory entries, how many the given host owns now (counted as the
 * entries change and when the owners change; exact once a rebalance has finished). */
uint64_t directory_forward_entries_owned_by(DirectoryForward *df, const char *host);
/* The part of the hash space host owns now, in permille (0 for a host that owns none). */
uint32_t directory_forward_share_permille(DirectoryForward *df, const char *host);

extern const Subsystem directory_subsystem;
