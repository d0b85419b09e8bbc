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

const char *epd_last_error_name(const epd_client *c);
const char *epd_last_error_message(const epd_client *c);

#ifdef __cplusplus
}
#endif
