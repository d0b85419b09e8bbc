/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The epd ring pair: a public ABI (versioned) for hot-path notifications between a
 * worker and epdd without a D-Bus round trip each, in the manner of io_uring.
 *
 * epdd creates one shared mapping (a sealed memfd) holding a header, a submission queue
 * (SQ: worker -> daemon) and a completion queue (CQ: daemon -> worker), plus two
 * eventfds: the worker writes the "submit" eventfd after queueing submissions, the
 * daemon writes the "complete" eventfd after posting completions. All three fds come
 * from org.epd1.Handoffs.OpenRing. Each queue has one producer and one consumer; the
 * indexes are free-running uint32 counters (slot = index & (entries - 1)).
 *
 * Layout of the mapping (byte offsets, little-endian, all fields naturally aligned):
 *      0  struct epd_ring_header        (64 bytes)
 *     64  sq_head   (uint32; written by the daemon)
 *    128  sq_tail   (uint32; written by the worker)
 *    192  cq_head   (uint32; written by the worker)
 *    256  cq_tail   (uint32; written by the daemon)
 *    320  cq_overflow (uint32; completions the daemon could not post: the CQ and its
 *                    backlog were full; it then sent them as D-Bus signals instead
 *                    where it could)
 *    384  cq_backlog (uint32; written by the daemon: records it keeps, in order, until
 *                    the CQ has room; a worker that finds the CQ empty while this is
 *                    not 0 writes the submit eventfd, with no submission if it has none,
 *                    and the daemon posts them)
 *    448  closed     (uint32; written by the daemon: not 0 once it let go of the ring —
 *                    CloseRing, its client gone, a corrupt queue — then it writes the
 *                    complete eventfd once more; nothing is posted after the records
 *                    already in the CQ, and epd_ring_next() returns -ECONNRESET once they
 *                    are taken, instead of waiting for ever on a live daemon)
 *    header.sq_offset  sq_entries records of 64 bytes
 *    header.cq_offset  cq_entries records of 64 bytes
 *
 * Neither side trusts the other's indexes: each keeps its own copy of the index it
 * owns, and a queue whose indexes are more than `entries` apart is corrupt (EBADMSG).
 * The daemon copies every record out of the mapping before it validates it.
 *
 * Compatibility: version 1. A later version may add opcodes and use reserved fields
 * (zero in version 1); the record size and the offsets above do not change within a
 * major version. A consumer ignores records with an opcode it does not know. */

#include <errno.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define EPD_RING_MAGIC 0x52445045U /* "EPDR" */
#define EPD_RING_VERSION 1U
#define EPD_RING_RECORD_SIZE 64U
#define EPD_RING_ENTRIES_MIN 8U
#define EPD_RING_ENTRIES_MAX 32768U

#define EPD_RING_OFF_SQ_HEAD 64U
#define EPD_RING_OFF_SQ_TAIL 128U
#define EPD_RING_OFF_CQ_HEAD 192U
#define EPD_RING_OFF_CQ_TAIL 256U
#define EPD_RING_OFF_CQ_OVERFLOW 320U
#define EPD_RING_OFF_CQ_BACKLOG 384U
#define EPD_RING_OFF_CLOSED 448U
#define EPD_RING_OFF_RECORDS 512U

struct epd_ring_header {
        uint32_t magic;       /* EPD_RING_MAGIC */
        uint16_t version;     /* EPD_RING_VERSION */
        uint16_t record_size; /* EPD_RING_RECORD_SIZE */
        uint32_t sq_entries;  /* power of two */
        uint32_t cq_entries;  /* power of two */
        uint64_t sq_offset;
        uint64_t cq_offset;
        uint64_t size;        /* of the whole mapping */
        uint32_t flags;       /* 0 in version 1 */
        uint32_t reserved[5];
};

/* Submissions (worker -> daemon). */
enum {
        /* Ping: the daemon answers with an EPD_RING_EV_COMPLETION of the same user_data. */
        EPD_RING_OP_NOP = 1,
        /* The prefill worker finished layer group `group` of the handoff (request_id,
         * token): the daemon ships it. Answered by a completion with result 0 or
         * -errno (only when flags has EPD_RING_F_ACK, or on error). */
        EPD_RING_OP_LAYER_GROUP_READY = 2,
        /* The decode worker takes the handoff of request_id as soon as it is prepared
         * on this host (at once when it is here already), waiting up to arg0
         * microseconds (0: the daemon's HandoffTimeout=; at most an hour). Answered by
         * an EPD_RING_EV_HANDOFF_ACCEPTED record, or by an EPD_RING_EV_COMPLETION with
         * -ETIMEDOUT, or Accept's errors (-EPERM, -EBUSY, -ESTALE, ...). From then on
         * the handoff's progress comes on this ring; org.epd1.Handoffs.Accept (a repeat:
         * it changes nothing) gives the page offsets. token, group, count, arg1: 0. */
        EPD_RING_OP_ACCEPT = 3,
        /* The decode worker commits the handoff (request_id, token) it accepted (on this
         * ring or by Accept): org.epd1.Handoff.Commit, and with EPD_RING_COMMIT_RELEASE
         * in arg0 its Release too (CommitAndRelease), without a bus round trip. Answered
         * once the records are durable by an EPD_RING_EV_COMPLETION: user_data echoed,
         * result 0 or Commit's -errno (-EBUSY: groups still missing, -ESTALE: rolled
         * back, -EPERM: accepted by another client, -ENOENT: no such handoff here or
         * another token); on success its request_id field holds the decode sequence's
         * id (the object /org/epd1/sequence/ and those 16 bytes as 32 hex digits:
         * epd_ring_record_sequence_path()). group, count, arg1: 0. */
        EPD_RING_OP_COMMIT = 4,
};

/* EPD_RING_OP_COMMIT's arg0. */
#define EPD_RING_COMMIT_RELEASE 0x1ULL

/* Completions and events (daemon -> worker). */
enum {
        /* Answer to a submission: user_data echoed, result 0 or -errno. */
        EPD_RING_EV_COMPLETION = 0x81,
        /* Handoff progress: groups [0, group) are complete (SENT on the source,
         * RECEIVED on the destination) out of `count`; arg0 = bytes moved so far. */
        EPD_RING_EV_GROUP_PROGRESS = 0x82,
        /* Handoff state change: arg0 = EPD_HANDOFF_STATE_*, arg1 = EPD_HANDOFF_CAUSE_*. */
        EPD_RING_EV_HANDOFF_STATE = 0x83,
        /* Backpressure notice, posted to every ring when a peer path's level changes
         * (the same moment as the org.epd1.Telemetry.Backpressure signal). Fields:
         * bytes 8..39 (user_data, request_id and token together) = the peer's host id,
         * NUL-padded (not terminated when it is exactly 32 bytes; flags has
         * EPD_RING_F_PEER_TRUNCATED when it is longer and was cut: ask the bus then);
         * group = level (EPD_BACKPRESSURE_*), count = reason (EPD_BACKPRESSURE_REASON_*),
         * arg0 = how full the peer's handoff window is, in permille (1000 = full or
         * closed), arg1 = the delay in microseconds the daemon asks before new work
         * for that peer (0: none). Decode with epd_ring_record_backpressure(). */
        EPD_RING_EV_BACKPRESSURE = 0x84,
        /* Answer to EPD_RING_OP_ACCEPT: user_data echoed; the handoff (request_id,
         * token) is this worker's: group = groups already landed, count = groups,
         * arg0 = pages, arg1 = the arena's index among those this worker mapped
         * (the order of epd_arena_get(): RegisterWorker's answer, which lists only
         * the arenas the worker asked for), not its place in org.epd1.Manager.Arenas. */
        EPD_RING_EV_HANDOFF_ACCEPTED = 0x85,
};

/* Backpressure levels and reasons in EPD_RING_EV_BACKPRESSURE (the same numbers as the
 * D-Bus signal's level; the reasons' names are its reason strings). */
#ifndef EPD_BACKPRESSURE_LEVELS
#define EPD_BACKPRESSURE_LEVELS 1
enum {
        EPD_BACKPRESSURE_NONE = 0,     /* send freely */
        EPD_BACKPRESSURE_ELEVATED = 1, /* the window is smaller: prefer other peers */
        EPD_BACKPRESSURE_HIGH = 2,     /* from loss: no new handoff to this peer; from queueing: as elevated */
        EPD_BACKPRESSURE_STALLED = 3,  /* the path is not moving, or gone */
};
#endif

enum {
        EPD_BACKPRESSURE_REASON_NONE = 0,
        EPD_BACKPRESSURE_REASON_RTT_INFLATION = 1,
        EPD_BACKPRESSURE_REASON_RETRANSMITS = 2,
        EPD_BACKPRESSURE_REASON_SEND_QUEUE = 3,
        EPD_BACKPRESSURE_REASON_SEND_QUEUE_GROWTH = 4,
        EPD_BACKPRESSURE_REASON_HANDOFFS_IN_FLIGHT = 5,
        EPD_BACKPRESSURE_REASON_DESTINATION_FULL = 6,
        EPD_BACKPRESSURE_REASON_STALLED = 7,
        EPD_BACKPRESSURE_REASON_DISCONNECTED = 8,
};

#define EPD_RING_PEER_MAX 32U

/* Record flags. */
#define EPD_RING_F_ACK 0x0001U /* submission: answer with a completion even on success */
#define EPD_RING_F_PEER_TRUNCATED 0x0002U /* backpressure: the host id was longer than 32 bytes */

/* Handoff states and causes as seen in ring records and on the bus. */
enum {
        EPD_HANDOFF_STATE_PREPARING = 0,
        EPD_HANDOFF_STATE_PREPARED = 1,
        EPD_HANDOFF_STATE_TRANSFERRING = 2,
        EPD_HANDOFF_STATE_TRANSFERRED = 3,
        EPD_HANDOFF_STATE_COMMITTED = 4,
        EPD_HANDOFF_STATE_RELEASED = 5,
        EPD_HANDOFF_STATE_ROLLED_BACK = 6,
};

enum {
        EPD_HANDOFF_CAUSE_NONE = 0,
        EPD_HANDOFF_CAUSE_REQUESTED = 1,
        EPD_HANDOFF_CAUSE_TIMEOUT = 2,
        EPD_HANDOFF_CAUSE_PEER_DOWN = 3,
        EPD_HANDOFF_CAUSE_WORKER_GONE = 4,
        EPD_HANDOFF_CAUSE_TRANSFER_FAILED = 5,
        EPD_HANDOFF_CAUSE_NO_SPACE = 6,
        EPD_HANDOFF_CAUSE_REFUSED = 7,
        EPD_HANDOFF_CAUSE_REMOTE = 8,
        EPD_HANDOFF_CAUSE_SHUTDOWN = 9,
        EPD_HANDOFF_CAUSE_PROTOCOL = 10,
};

struct epd_ring_record {
        uint16_t opcode;
        uint16_t flags;
        int32_t result;
        uint64_t user_data;
        uint8_t request_id[16];
        uint64_t token;
        uint32_t group;
        uint32_t count;
        uint64_t arg0;
        uint64_t arg1;
};

/* C++ (a worker's own code includes this header) has static_assert, not _Static_assert. */
#ifdef __cplusplus
static_assert(sizeof(struct epd_ring_header) == 64, "ring header ABI");
static_assert(sizeof(struct epd_ring_record) == EPD_RING_RECORD_SIZE, "ring record ABI");
#else
_Static_assert(sizeof(struct epd_ring_header) == 64, "ring header ABI");
_Static_assert(sizeof(struct epd_ring_record) == EPD_RING_RECORD_SIZE, "ring record ABI");
#endif

/* One direction of the pair, as seen by one side. `local` is this side's private copy
 * of the index it owns (the tail when producing, the head when consuming). */
struct epd_ring_queue {
        uint32_t *head;
        uint32_t *tail;
        struct epd_ring_record *records;
        uint32_t entries;
        uint32_t local;
};

struct epd_ring {
        void *base;
        uint64_t size;
        struct epd_ring_queue sq;
        struct epd_ring_queue cq;
        uint32_t *cq_overflow;
};

static inline int epd_ring_entries_valid(uint32_t n) {
        return n >= EPD_RING_ENTRIES_MIN && n <= EPD_RING_ENTRIES_MAX && (n & (n - 1)) == 0;
}

/* Bytes the mapping needs for these sizes (before rounding to pages). */
static inline uint64_t epd_ring_size(uint32_t sq_entries, uint32_t cq_entries) {
        return EPD_RING_OFF_RECORDS + ((uint64_t)sq_entries + cq_entries) * EPD_RING_RECORD_SIZE;
}

/* Checks a mapped ring's header against the mapping's size and sets up the views.
 * `daemon` selects the side: the daemon consumes the SQ and produces the CQ. */
static inline int epd_ring_attach(struct epd_ring *r, void *base, uint64_t size, int daemon) {
        struct epd_ring_header h;
        if (!r || !base || size < sizeof h)
                return -EINVAL;
        memcpy(&h, base, sizeof h);
        if (h.magic != EPD_RING_MAGIC || h.version != EPD_RING_VERSION ||
            h.record_size != EPD_RING_RECORD_SIZE)
                return -EPROTONOSUPPORT;
        if (!epd_ring_entries_valid(h.sq_entries) || !epd_ring_entries_valid(h.cq_entries) ||
            h.size > size || h.sq_offset < EPD_RING_OFF_RECORDS || h.cq_offset < EPD_RING_OFF_RECORDS ||
            h.sq_offset % EPD_RING_RECORD_SIZE || h.cq_offset % EPD_RING_RECORD_SIZE ||
            h.sq_offset > h.size || h.cq_offset > h.size ||
            h.size - h.sq_offset < (uint64_t)h.sq_entries * EPD_RING_RECORD_SIZE ||
            h.size - h.cq_offset < (uint64_t)h.cq_entries * EPD_RING_RECORD_SIZE ||
            (h.cq_offset < h.sq_offset + (uint64_t)h.sq_entries * EPD_RING_RECORD_SIZE &&
             h.sq_offset < h.cq_offset + (uint64_t)h.cq_entries * EPD_RING_RECORD_SIZE))
                return -EBADMSG;

        uint8_t *b = (uint8_t *)base;
        r->base = base;
        r->size = h.size;
        r->sq.head = (uint32_t *)(b + EPD_RING_OFF_SQ_HEAD);
        r->sq.tail = (uint32_t *)(b + EPD_RING_OFF_SQ_TAIL);
        r->sq.records = (struct epd_ring_record *)(b + h.sq_offset);
        r->sq.entries = h.sq_entries;
        r->cq.head = (uint32_t *)(b + EPD_RING_OFF_CQ_HEAD);
        r->cq.tail = (uint32_t *)(b + EPD_RING_OFF_CQ_TAIL);
        r->cq.records = (struct epd_ring_record *)(b + h.cq_offset);
        r->cq.entries = h.cq_entries;
        r->cq_overflow = (uint32_t *)(b + EPD_RING_OFF_CQ_OVERFLOW);
        /* Each side owns one index of each queue. */
        r->sq.local = __atomic_load_n(daemon ? r->sq.head : r->sq.tail, __ATOMIC_ACQUIRE);
        r->cq.local = __atomic_load_n(daemon ? r->cq.tail : r->cq.head, __ATOMIC_ACQUIRE);
        return 0;
}

/* Producer: queues one record. -EAGAIN when full, -EBADMSG when the consumer's index
 * is impossible (a corrupt or hostile peer). */
static inline int epd_ring_produce(struct epd_ring_queue *q, const struct epd_ring_record *rec) {
        uint32_t tail = q->local;
        uint32_t head = __atomic_load_n(q->head, __ATOMIC_ACQUIRE);
        uint32_t used = tail - head;
        if (used > q->entries)
                return -EBADMSG;
        if (used == q->entries)
                return -EAGAIN;
        memcpy(&q->records[tail & (q->entries - 1)], rec, sizeof *rec);
        q->local = tail + 1;
        __atomic_store_n(q->tail, tail + 1, __ATOMIC_RELEASE);
        return 0;
}

/* Consumer: copies one record out. -EAGAIN when empty, -EBADMSG when corrupt. */
static inline int epd_ring_consume(struct epd_ring_queue *q, struct epd_ring_record *rec) {
        uint32_t head = q->local;
        uint32_t tail = __atomic_load_n(q->tail, __ATOMIC_ACQUIRE);
        uint32_t avail = tail - head;
        if (avail == 0)
                return -EAGAIN;
        if (avail > q->entries)
                return -EBADMSG;
        memcpy(rec, &q->records[head & (q->entries - 1)], sizeof *rec);
        q->local = head + 1;
        __atomic_store_n(q->head, head + 1, __ATOMIC_RELEASE);
        return 0;
}

/* The daemon's count of records waiting for room in the CQ (the field at
 * EPD_RING_OFF_CQ_BACKLOG). */
static inline uint32_t *epd_ring_cq_backlog(const struct epd_ring *r) {
        return (uint32_t *)((uint8_t *)r->base + EPD_RING_OFF_CQ_BACKLOG);
}

/* Not 0 once the daemon let go of the ring (EPD_RING_OFF_CLOSED). */
static inline uint32_t *epd_ring_closed(const struct epd_ring *r) {
        return (uint32_t *)((uint8_t *)r->base + EPD_RING_OFF_CLOSED);
}

/* Records queued and not yet consumed (0 on a corrupt queue). */
static inline uint32_t epd_ring_pending(const struct epd_ring_queue *q, int producer) {
        uint32_t head = producer ? __atomic_load_n(q->head, __ATOMIC_ACQUIRE) : q->local;
        uint32_t tail = producer ? q->local : __atomic_load_n(q->tail, __ATOMIC_ACQUIRE);
        uint32_t n = tail - head;
        return n > q->entries ? 0 : n;
}

static inline void epd_ring_record_layer_group_ready(struct epd_ring_record *rec,
                                                     const uint8_t request_id[16],
                                                     uint64_t token, uint32_t group,
                                                     uint64_t user_data) {
        memset(rec, 0, sizeof *rec);
        rec->opcode = EPD_RING_OP_LAYER_GROUP_READY;
        memcpy(rec->request_id, request_id, 16);
        rec->token = token;
        rec->group = group;
        rec->user_data = user_data;
}

static inline void epd_ring_record_accept(struct epd_ring_record *rec, const uint8_t request_id[16],
                                          uint64_t timeout_usec, uint64_t user_data) {
        memset(rec, 0, sizeof *rec);
        rec->opcode = EPD_RING_OP_ACCEPT;
        memcpy(rec->request_id, request_id, 16);
        rec->arg0 = timeout_usec;
        rec->user_data = user_data;
}

static inline void epd_ring_record_commit(struct epd_ring_record *rec, const uint8_t request_id[16],
                                          uint64_t token, int release, uint64_t user_data) {
        memset(rec, 0, sizeof *rec);
        rec->opcode = EPD_RING_OP_COMMIT;
        memcpy(rec->request_id, request_id, 16);
        rec->token = token;
        rec->arg0 = release ? EPD_RING_COMMIT_RELEASE : 0;
        rec->user_data = user_data;
}

/* The decode sequence's object path from a successful commit's completion:
 * "/org/epd1/sequence/" and 32 lowercase hex digits (52 bytes with the NUL). 0, or
 * -EINVAL when rec is not such a completion, -ENOBUFS when n is too small. */
#define EPD_RING_SEQUENCE_PATH_MAX 52U
static inline int epd_ring_record_sequence_path(const struct epd_ring_record *rec, char *buf, size_t n) {
        static const char prefix[] = "/org/epd1/sequence/", hex[] = "0123456789abcdef";
        if (!rec || !buf || rec->opcode != EPD_RING_EV_COMPLETION || rec->result != 0)
                return -EINVAL;
        if (n < EPD_RING_SEQUENCE_PATH_MAX)
                return -ENOBUFS;
        memcpy(buf, prefix, sizeof prefix - 1);
        for (unsigned i = 0; i < 16; i++) {
                buf[sizeof prefix - 1 + 2 * i] = hex[rec->request_id[i] >> 4];
                buf[sizeof prefix - 1 + 2 * i + 1] = hex[rec->request_id[i] & 15];
        }
        buf[sizeof prefix - 1 + 32] = 0;
        return 0;
}

/* EPD_RING_EV_BACKPRESSURE, decoded. */
struct epd_ring_backpressure {
        char peer[EPD_RING_PEER_MAX + 1]; /* host id, NUL-terminated */
        int truncated;                    /* the host id was longer and is cut here */
        uint32_t level;                   /* EPD_BACKPRESSURE_* */
        uint32_t reason;                  /* EPD_BACKPRESSURE_REASON_* */
        uint32_t permille;
        uint64_t retry_after_usec;
};

/* Fills *ret from a backpressure record: 0, or -EINVAL when it is not one (another
 * opcode, or a level this version does not know). */
static inline int epd_ring_record_backpressure(const struct epd_ring_record *rec,
                                               struct epd_ring_backpressure *ret) {
        if (!rec || !ret || rec->opcode != EPD_RING_EV_BACKPRESSURE ||
            rec->group > EPD_BACKPRESSURE_STALLED)
                return -EINVAL;
        memset(ret, 0, sizeof *ret);
        memcpy(ret->peer, (const uint8_t *)rec + 8, EPD_RING_PEER_MAX);
        ret->truncated = !!(rec->flags & EPD_RING_F_PEER_TRUNCATED);
        ret->level = rec->group;
        ret->reason = rec->count;
        ret->permille = rec->arg0 > 1000 ? 1000 : (uint32_t)rec->arg0;
        ret->retry_after_usec = rec->arg1;
        return 0;
}

#ifdef __cplusplus
}
#endif
