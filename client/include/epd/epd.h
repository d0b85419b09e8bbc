/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* libepd: the client library of epd. Workers (Encoder, Prefill, Decode) and tools
 * use it to reach epdd, register, and map the daemon's arenas.
 *
 * Every function returns 0 (or a positive count) on success and a negative errno on
 * failure; epd_last_error_name() / epd_last_error_message() then say what the daemon
 * answered (an org.epd1.Error.* name), or, for a refusal of libepd's own (a bad
 * argument, not registered, the connection lost), "errno.N" and the reason: never an
 * earlier call's error. A lost connection is -ENOTCONN ("errno.107") whichever way
 * sd-bus saw it, a call a hung daemon did not answer in time -ETIMEDOUT ("errno.110")
 * (docs/api.md#errors). A NULL client is refused (-EINVAL; -ENOTCONN for
 * epd_unregister), never dereferenced. An epd_client is not thread-safe: use one per
 * thread, or lock around it. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct epd_client epd_client;

typedef struct epd_arena {
        const char *name;
        const char *domain;   /* "host" or "gpu" */
        const char *usage;    /* "kv" or "feature" */
        uint64_t size;        /* bytes, header included */
        uint64_t data_offset; /* first byte of pages */
        int gpu;              /* GPU ordinal for gpu arenas, -1 otherwise */
        int fd;               /* owned by the client; closed at disconnect */
        void *base;           /* host arenas: the mapping, after epd_arena_map() */
} epd_arena;

typedef struct epd_kv_layout {
        uint32_t layers;
        uint32_t tokens_per_block;
        uint64_t k_bytes_per_token; /* per token per layer */
        uint64_t v_bytes_per_token;
        const char *dtype;          /* e.g. "bf16" */
} epd_kv_layout;

/* Connects to epdd. `address` may be:
 *   NULL            — $EPD_SOCKET (direct socket path), else $EPD_BUS_ADDRESS (a bus
 *                     on which org.epd1 is owned), else the direct socket
 *                     /run/epd/bus if it exists, else the system bus;
 *   "direct:PATH"   — the daemon's direct socket;
 *   "bus:ADDRESS"   — a D-Bus broker at ADDRESS (e.g. unix:path=/tmp/bus);
 *   "system"        — the system bus. */
int epd_connect(const char *address, epd_client **ret);
/* Unregisters (if registered, without waiting for the answer), unmaps, sends what is
 * queued and closes. It never blocks for long: what a daemon that stopped reading has
 * not taken within 2 s is dropped (the connection's end releases everything of the
 * client's anyway). Calls still unanswered are dropped without their callbacks. Accepts
 * NULL; returns NULL. */
epd_client *epd_disconnect(epd_client *c);

/* Registers this process as a worker. `role` is encoder, prefill, decode, colocated
 * or scheduler. `kv` may be NULL. `arenas` is a NULL-terminated list of arena names,
 * or NULL for the role's defaults. The arenas' fds are received and kept. */
int epd_register(epd_client *c, const char *role, const char *model, const char *device,
                 const epd_kv_layout *kv, const char *const *arenas);
/* The same, with the "name" and NULL-terminated "labels" that epd.conf's [Pool:NAME]
 * worker selectors match (name:GLOB, label:LABEL); either may be NULL. */
int epd_register_named(epd_client *c, const char *role, const char *model, const char *device,
                       const epd_kv_layout *kv, const char *const *arenas, const char *name,
                       const char *const *labels);
/* Refused for a time-out (a stalled daemon), the registration is kept here as it is
 * there: unregister again later. */
int epd_unregister(epd_client *c);
const char *epd_worker_path(const epd_client *c);

size_t epd_arena_count(const epd_client *c);
const epd_arena *epd_arena_get(const epd_client *c, size_t i);
/* Index of the arena called `name`, or -ENOENT. These three read the client's own
 * list: they neither set nor clear the last error. */
int epd_arena_find(const epd_client *c, const char *name);
/* Maps a host arena (read-write, shared) once; later calls return the same mapping. */
int epd_arena_map(epd_client *c, size_t i, void **ret);

/* Daemon facts. Strings are the caller's to free(). */
int epd_get_version(epd_client *c, char **ret);
int epd_get_host_id(epd_client *c, char **ret);

/* Event-loop integration: the connection's fd, and processing of what arrived
 * (signals for waits, for example). epd_wait() blocks up to timeout_usec
 * (UINT64_MAX: forever) for something to arrive. A loop that polls the fd itself asks
 * epd_get_events() for the poll events to wait for (POLLIN, and POLLOUT while calls
 * wait to be written) and epd_get_timeout() for when an unanswered call times out
 * (1 and that CLOCK_MONOTONIC usec; 0 and UINT64_MAX when there is none), and calls epd_process() when the fd is
 * ready or that time has passed: not at every turn, where each call costs a read that
 * finds nothing. */
int epd_get_fd(epd_client *c);
int epd_get_events(epd_client *c);
int epd_get_timeout(epd_client *c, uint64_t *ret_usec);
int epd_process(epd_client *c);
/* -EINTR when a signal handler ran meanwhile (as poll() does: the caller decides). */
int epd_wait(epd_client *c, uint64_t timeout_usec);
/* Waits up to timeout_usec, through signals caught meanwhile (UINT64_MAX: forever, and
 * then a caught signal ends it with -EINTR), until every call sent without waiting for
 * its reply (epd_feature_publish_release; epd_handoff_prepare_async, whose callbacks it
 * runs; epd_feature_acquire_or_reserve_send, finished, held or freed: their answers are
 * kept for finish, or released) is answered. Returns the first refusal
 * among them since the last epd_flush() (a negative errno; epd_last_error_name() and
 * _message() name it and the call), -ETIMEDOUT if some are still unanswered,
 * -ENOTCONN once the connection is gone (the calls it ended, and every later flush:
 * never 0 on a dead connection), else 0. -EBUSY from within a callback of the client.
 * Their replies are also taken by epd_process() and epd_wait(). */
int epd_flush(epd_client *c, uint64_t timeout_usec);

/* -- KV pages and sequences (org.epd1.Pages, org.epd1.Sequence; docs/pages.md) --
 * A sequence is the page table of one request or agent branch in one KV arena, named
 * by its object path (a string the caller frees). Page ids index the arena's pages: page
 * p starts at epd_page_offset(arena, page_size, p) in the mapping. Arrays returned
 * through uint32_t ** are malloc()ed; the caller frees them. The caller must be a
 * registered worker. */

static inline uint64_t epd_page_offset(const epd_arena *a, uint64_t page_size, uint32_t page) {
        return a->data_offset + (uint64_t)page * page_size;
}

/* A new sequence of n_pages fresh pages in `arena`. */
int epd_sequence_create(epd_client *c, const char *arena, uint32_t n_pages, char **ret_path,
                        uint32_t **ret_pages, size_t *ret_n_pages);
/* A new sequence made of the longest cached prefix of a chain of block hashes (the
 * worker's chained hashes, e.g. vLLM's); *ret_blocks says how many blocks matched. */
int epd_sequence_create_from_prefix(epd_client *c, const char *arena, const uint64_t *hashes,
                                    size_t n_hashes, char **ret_path, size_t *ret_blocks,
                                    uint32_t **ret_pages, size_t *ret_n_pages);
/* How many leading blocks of the chain are cached (nothing pinned). Returns the count. */
int epd_prefix_match(epd_client *c, const char *arena, const uint64_t *hashes, size_t n_hashes);

int epd_sequence_append(epd_client *c, const char *path, uint32_t n_pages, uint32_t **ret_pages,
                        size_t *ret_n_pages);
int epd_sequence_truncate(epd_client *c, const char *path, uint32_t n_pages);
/* Shares every page with a new sequence owned by the caller; no byte is copied. */
int epd_sequence_clone(epd_client *c, const char *path, char **ret_path);
/* Makes pages [first, first+count) writable (copy-on-write where shared); their ids go to
 * ret_pages[count]. Returns the number of pages the daemon copied; a reply without
 * exactly count ids is -EBADMSG, and nothing is written to ret_pages. */
int epd_sequence_prepare_write(epd_client *c, const char *path, uint32_t first, uint32_t count,
                               uint32_t *ret_pages);
/* Records hashes[i] -> page first+i in the block directory; returns how many were new. */
int epd_sequence_publish(epd_client *c, const char *path, uint32_t first, const uint64_t *hashes,
                         size_t n_hashes);
/* Lets another registered worker read and clone the sequence (its worker path). */
int epd_sequence_grant(epd_client *c, const char *path, const char *worker_path);
int epd_sequence_revoke(epd_client *c, const char *path, const char *worker_path);
int epd_sequence_release(epd_client *c, const char *path);
/* Release without waiting for the answer (a refusal is returned by epd_flush()). */
int epd_sequence_release_nowait(epd_client *c, const char *path);
/* After epdd restarted: takes back a sequence (its id or path) that this uid owned.
 * Sequences that nobody attaches within the grace period are released (docs/wal.md). */
int epd_sequence_attach(epd_client *c, const char *id_or_path, char **ret_path);
/* The current page table, the page size, and the arena's name (free() it). */
int epd_sequence_get_pages(epd_client *c, const char *path, uint32_t **ret_pages, size_t *ret_n_pages);
int epd_sequence_get_page_size(epd_client *c, const char *path, uint64_t *ret);
int epd_sequence_get_arena(epd_client *c, const char *path, char **ret);

/* -- admission (org.epd1.Scheduler; docs/scheduler.md) --
 * Admit a request of a task type ("thinking", "interactive", "hybrid") with a deadline
 * relative to now (0: the pool's default). The answer says admit (with the workers to
 * use, as object paths; "" for a stage not used), defer (come back after
 * retry_after_usec) or reject, and why. Each worker reports each stage it finished
 * with epd_complete() ("encode", "prefill", "decode"); the decode stage, or ok=false,
 * ends the request. */
typedef enum epd_verdict { EPD_ADMIT, EPD_DEFER, EPD_REJECT } epd_verdict;

typedef struct epd_admission {
        epd_verdict verdict;
        char reason[32];
        uint64_t retry_after_usec;
        uint64_t predicted_usec;
        int priority;            /* serve waiting requests by it, FIFO within it */
        char encoder[96], prefill[96], decode[96];
} epd_admission;

int epd_admit(epd_client *c, const char *request_id, const char *task_type, uint64_t deadline_usec,
              uint64_t pages_needed, bool multimodal, epd_admission *ret);
int epd_complete(epd_client *c, const char *request_id, const char *stage, uint64_t service_usec, bool ok);
/* This worker's capacity for the scheduler: requests it runs at once, its queue bound
 * (0: 4 x slots), and (decode) its free KV pages. */
int epd_configure_worker(epd_client *c, uint32_t slots, uint32_t queue_limit, uint64_t free_pages);
/* Where this (decode) worker's KV lands: the host id of the epdd that receives it ("" or
 * NULL: this host). Admit then weighs the backpressure of the path to that peer. */
int epd_configure_worker_host(epd_client *c, const char *host);

/* -- agent workflows (org.epd1.Workflow; docs/scheduler.md#workflows) --
 * A workflow (named by a 32-hex-digit id) holds branches; each branch's head is a
 * sequence (object path). Strings returned are the caller's to free(). Every call is in
 * the daemon's WAL before it returns; after an epdd restart, epd_workflow_attach() takes
 * a workflow back (same uid). A workflow whose sequences are not on the daemon fails
 * with org.epd1.Error.Stale (-ESTALE). */
typedef struct epd_segment {
        uint32_t prev_block;  /* first block (page) of the predecessor */
        uint32_t n_blocks;
        uint32_t new_offset;  /* token offset in the new sequence */
        bool aligned;         /* at a page boundary: the pages can be shared as they are */
} epd_segment;

int epd_workflow_create(epd_client *c, const char *sequence, const uint32_t *tokens, size_t n_tokens,
                        char **ret_workflow, char **ret_head);
int epd_workflow_fork(epd_client *c, const char *workflow, uint32_t branch, uint32_t *ret_branch, char **ret_head);
/* The new head shares *ret_prefix_blocks pages with the predecessor; with segments,
 * *ret_segments (malloc()ed) lists predecessor blocks found elsewhere in tokens. */
int epd_workflow_advance(epd_client *c, const char *workflow, uint32_t branch, const uint32_t *tokens,
                         size_t n_tokens, bool segments, char **ret_head, uint32_t *ret_prefix_blocks,
                         epd_segment **ret_segments, size_t *ret_n_segments);
int epd_workflow_merge(epd_client *c, const char *workflow, uint32_t from, uint32_t into);
int epd_workflow_drop(epd_client *c, const char *workflow, uint32_t branch);
int epd_workflow_release(epd_client *c, const char *workflow);
int epd_workflow_attach(epd_client *c, const char *workflow);

typedef struct epd_workflow_branch {
        uint32_t branch;
        bool alive;           /* false once dropped or merged away */
        char *head;           /* the head sequence's object path; "/" when not alive */
        uint64_t steps;
        uint32_t n_tokens;    /* tokens of the head */
} epd_workflow_branch;

/* Every branch the workflow handed out, in order; free with epd_workflow_branches_free(). */
int epd_workflow_get_branches(epd_client *c, const char *workflow, epd_workflow_branch **ret, size_t *ret_n);
void epd_workflow_branches_free(epd_workflow_branch *b, size_t n);

const char *epd_last_error_name(const epd_client *c);
const char *epd_last_error_message(const epd_client *c);
/* After org.epd1.Error.Backpressure (-EAGAIN): the delay in microseconds the daemon asks
 * before the same work is tried again ("retry_after_usec=N" in the message); 0 when the
 * last error carried none. */
uint64_t epd_last_error_retry_after_usec(const epd_client *c);

/* Peers (org.epd1.Peer): the other hosts this daemon talks to. */
typedef struct epd_peer {
        char *name;
        char *host_id;
        char *address;
        char *state;          /* "down", "connecting", "authenticating", "up" */
        char *transport;      /* "tcp" (or "rdma") */
        char *interface;      /* the interface that routes to it, "" if none */
        char *path_reason;    /* why that path */
        uint32_t streams;     /* data streams up */
        uint64_t last_frame_usec_ago; /* UINT64_MAX when down */
        uint64_t connects, disconnects;
        char *last_error;
} epd_peer;

/* Lists the configured peers; free the array with epd_peers_free(). */
int epd_list_peers(epd_client *c, epd_peer **ret, size_t *n);
void epd_peers_free(epd_peer *peers, size_t n);

/* ---- org.epd1.Cluster and org.epd1.Placement (docs/cluster.md) ---- */

typedef struct epd_cluster {
        char *source;        /* "static" or "etcd" */
        char *etcd_state;    /* "off", "connecting", "up", "degraded" */
        char *etcd_reason;
        char *etcd_prefix;
        uint64_t lease_id;
        uint64_t lease_ttl_usec;
        uint64_t revision;
        uint64_t shard_records; /* directory records this host keeps as an owner */
        uint32_t members_alive;
} epd_cluster;

typedef struct epd_member {
        char *host_id, *address;
        char *source;        /* "self", "static", "etcd" */
        char *lease;         /* "self", "static", "alive", "missing", "left" */
        char *session;       /* the peer connection's state; "self" */
        char *last_error;
        char *transports, *arenas, *nics;
        uint32_t gpus;
        uint32_t share_permille;  /* of the directory's hash space it owns now */
        uint64_t published_here;  /* this host's entries whose records it holds */
} epd_member;

/* The Cluster object's properties (-ENOENT style errors where the daemon has no peers:
 * its Cluster object exists only with [Cluster] Listen= or peers). */
int epd_cluster_get(epd_client *c, epd_cluster *ret);
void epd_cluster_done(epd_cluster *cl);
/* Every member, this host first; free with epd_members_free(). Returns the count. */
int epd_list_members(epd_client *c, epd_member **ret, size_t *n);
void epd_members_free(epd_member *members, size_t n);

typedef struct epd_placement_candidate {
        char *host, *arena, *worker;
        uint32_t n_blocks;
} epd_placement_candidate;

typedef struct epd_placement {
        uint32_t n_blocks;   /* of the best candidate; 0 when nobody holds the first block */
        char *host, *arena, *worker;
        epd_placement_candidate *candidates; /* longest first */
        size_t n_candidates;
        uint32_t owners_missing;             /* owners that did not answer in time */
} epd_placement;

/* Where the longest cached prefix of a request's chained block hashes lives. */
int epd_locate_prefix(epd_client *c, const uint64_t *hashes, size_t n, epd_placement *ret);
void epd_placement_done(epd_placement *p);

#ifdef __cplusplus
}
#endif
