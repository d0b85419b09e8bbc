/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* libepd: the client library of epd. Workers (Encoder, Prefill, Decode) and tools
 * use it to reach epdd, register, and map the daemon's arenas.
 *
 * Every function returns 0 (or a positive count) on success and a negative errno on
 * failure; epd_last_error_name() / epd_last_error_message() then say what the daemon
 * answered (an org.epd1.Error.* name). An epd_client is not thread-safe: use one per
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
/* Unregisters (if registered), unmaps, closes. Accepts NULL; returns NULL. */
epd_client *epd_disconnect(epd_client *c);

/* Registers this process as a worker. `role` is encoder, prefill, decode, colocated
 * or scheduler. `kv` may be NULL. `arenas` is a NULL-terminated list of arena names,
 * or NULL for the role's defaults. The arenas' fds are received and kept. */
int epd_register(epd_client *c, const char *role, const char *model, const char *device,
                 const epd_kv_layout *kv, const char *const *arenas);
int epd_unregister(epd_client *c);
const char *epd_worker_path(const epd_client *c);

size_t epd_arena_count(const epd_client *c);
const epd_arena *epd_arena_get(const epd_client *c, size_t i);
/* Index of the arena called `name`, or -ENOENT. */
int epd_arena_find(const epd_client *c, const char *name);
/* Maps a host arena (read-write, shared) once; later calls return the same mapping. */
int epd_arena_map(epd_client *c, size_t i, void **ret);

/* Daemon facts. Strings are the caller's to free(). */
int epd_get_version(epd_client *c, char **ret);
int epd_get_host_id(epd_client *c, char **ret);

/* Event-loop integration: the connection's fd, and processing of what arrived
 * (signals for waits, for example). epd_wait() blocks up to timeout_usec
 * (UINT64_MAX: forever) for something to arrive. */
int epd_get_fd(epd_client *c);
int epd_process(epd_client *c);
int epd_wait(epd_client *c, uint64_t timeout_usec);

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
 * ret_pages[count]. Returns the number of pages the daemon copied. */
int epd_sequence_prepare_write(epd_client *c, const char *path, uint32_t first, uint32_t count,
                               uint32_t *ret_pages);
/* Records hashes[i] -> page first+i in the block directory; returns how many were new. */
int epd_sequence_publish(epd_client *c, const char *path, uint32_t first, const uint64_t *hashes,
                         size_t n_hashes);
/* Lets another registered worker read and clone the sequence (its worker path). */
int epd_sequence_grant(epd_client *c, const char *path, const char *worker_path);
int epd_sequence_revoke(epd_client *c, const char *path, const char *worker_path);
int epd_sequence_release(epd_client *c, const char *path);
/* The current page table, and the page size. */
int epd_sequence_get_pages(epd_client *c, const char *path, uint32_t **ret_pages, size_t *ret_n_pages);
int epd_sequence_get_page_size(epd_client *c, const char *path, uint64_t *ret);

const char *epd_last_error_name(const epd_client *c);
const char *epd_last_error_message(const epd_client *c);

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

#ifdef __cplusplus
}
#endif
