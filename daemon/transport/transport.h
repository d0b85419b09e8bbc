/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The transport vtable: how bytes move between memory regions. A transport registers
 * memory regions once, accepts batches of writes, and reports completions (per write,
 * with an error code) through an fd that the daemon watches with sd-event. The
 * implementations (local, tcp, cuda, rdma) live beside this header; the handoff code
 * only sees this interface. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct Transport Transport;
typedef struct TransportRegion TransportRegion;

typedef enum TransportKind {
        TRANSPORT_LOCAL, /* same host: page handover or memcpy on worker threads */
        TRANSPORT_TCP,
        TRANSPORT_CUDA,
        TRANSPORT_RDMA,
        _TRANSPORT_KIND_MAX,
} TransportKind;

const char *transport_kind_to_string(TransportKind k);

typedef enum MemoryDomain {
        MEMORY_HOST,
        MEMORY_GPU,
} MemoryDomain;

/* A registered memory region (normally a whole arena). */
struct TransportRegion {
        uint32_t id;          /* arena index on its host */
        MemoryDomain domain;
        int gpu_ordinal;      /* for MEMORY_GPU */
        void *host_base;      /* for MEMORY_HOST: the daemon's mapping */
        uint64_t device_base; /* for MEMORY_GPU: CUdeviceptr */
        uint64_t size;
        bool source_only;     /* only ever written from (a staging buffer): no peer may
                               * write into it (rdma registers it without remote write) */
        void *transport_data; /* owned by the transport (e.g. an ibv_mr) */
};

/* Write flags (a transport to other hosts supports them when its ops' caps say so). */
#define TRANSPORT_WRITE_IMM 0x1u    /* `imm` reaches the receiver with the write's completion
                                     * (as RDMA's WRITE_WITH_IMM): a completion flag in-band */
#define TRANSPORT_WRITE_TARGET 0x2u /* dst_offset is relative to `target`, an object the
                                     * receiver resolves (its validator); dst_region unused */
#define TRANSPORT_WRITE_ATTEMPT 0x4u /* the write names a real (region, offset) and `target`
                                      * is the handoff attempt's token: the receiver takes
                                      * it only while those pages are that attempt's */

/* One write: bytes [src_offset, src_offset+length) of the source region to
 * [dst_offset, ...) of the destination region. `cookie` comes back on completion. */
typedef struct TransportWrite {
        uint32_t src_region;
        uint64_t src_offset;
        uint32_t dst_region;
        uint64_t dst_offset;
        uint64_t length;
        uint64_t cookie;
        uint32_t flags;  /* TRANSPORT_WRITE_* */
        uint64_t imm;
        uint64_t target;
} TransportWrite;

/* An incoming write as the receiving side's validator sees it: it may resolve a
 * TRANSPORT_WRITE_TARGET write's (region, offset), and is told the same struct (with imm)
 * when the write is done. */
typedef struct TransportIncoming {
        uint32_t region;
        uint64_t offset;
        uint64_t length;
        uint64_t cookie;
        uint32_t flags;
        uint64_t imm;
        uint64_t target;
} TransportIncoming;

#define TRANSPORT_CAP_IMM 0x1u    /* carries TRANSPORT_WRITE_IMM */
#define TRANSPORT_CAP_TARGET 0x2u /* carries TRANSPORT_WRITE_TARGET */
#define TRANSPORT_CAP_ATTEMPT 0x4u /* carries TRANSPORT_WRITE_ATTEMPT */

typedef struct TransportCompletion {
        uint64_t cookie;
        int error; /* 0 or negative errno */
        uint32_t writes; /* how many writes it completes: 1, or more where the transport
                          * merged writes of one batch with the same cookie (the CUDA
                          * transport: a batch of thousands, one completion per cookie);
                          * bytes is then their sum and error theirs */
        uint64_t bytes;
} TransportCompletion;

typedef struct TransportStats {
        uint64_t bytes;
        uint64_t writes;
        uint64_t batches;
        uint64_t failures;
} TransportStats;

typedef struct TransportOps {
        TransportKind kind;
        const char *name;
        unsigned caps;  /* TRANSPORT_CAP_* */
        int (*register_region)(Transport *t, TransportRegion *r);
        void (*unregister_region)(Transport *t, TransportRegion *r);
        /* Queue a batch. Returns 0 if all were queued (each completes later), or a
         * negative errno if none were. `peer` is transport-specific (NULL locally). */
        int (*post)(Transport *t, void *peer, const TransportWrite *w, size_t n);
        /* The fd that becomes readable when completions are ready (-1: none). */
        int (*completion_fd)(Transport *t);
        /* Fetch up to n completions without blocking; returns how many. */
        size_t (*poll)(Transport *t, TransportCompletion *c, size_t n);
        /* Cancels everything in flight for a peer: each write completes with
         * -ECANCELED, after the transport guarantees no byte of it lands later. */
        void (*cancel_peer)(Transport *t, void *peer);
        /* Incoming writes of a peer that the validator asked to wait (-EAGAIN: their
         * target is not known yet) are asked again (optional). */
        void (*resume_incoming)(Transport *t, void *peer);
        /* Posts to peer between plug and unplug (nested) leave together at the last
         * unplug rather than one by one (optional: a transport that batches anyway has
         * neither). */
        void (*plug)(Transport *t, void *peer);
        void (*unplug)(Transport *t, void *peer);
        void (*free)(Transport *t);
} TransportOps;

struct Transport {
        const TransportOps *ops;
        TransportStats stats;
};
