/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The peer protocol's wire format (daemon <-> daemon). Pure: no sockets, no I/O.
 *
 * Every frame is a 16-byte header followed by `length` payload bytes. All integers are
 * big-endian. The header and each payload are validated here before anything else
 * looks at them; a frame that fails validation ends the connection.
 *
 *   0  u32 magic     PEER_FRAME_MAGIC ("EPDP")
 *   4  u8  version   PEER_PROTOCOL_VERSION
 *   5  u8  flags     no flag is defined in version 1: must be 0
 *   6  u16 type      message type (ranges below)
 *   8  u32 length    payload bytes after the header
 *  12  u32 reserved  must be 0
 *
 * Message types are grouped in ranges; each range belongs to one subsystem, which
 * registers a handler for it (peer.h). See docs/peer-protocol.md. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PEER_FRAME_MAGIC UINT32_C(0x45504450) /* "EPDP" */
#define PEER_PROTOCOL_VERSION 3 /* 2: DATA header with flags, immediate and target; WRITE_ACKS.
                                 * 3: the rdma REQUEST names the handoff attempt */
#define PEER_FRAME_HEADER_SIZE 16

/* Largest payload of any frame other than DATA (control messages of every range). */
#define PEER_FRAME_MAX_PAYLOAD (1024U * 1024U)

/* Bulk slices (DATA frames): a write is cut into slices of slice_size bytes (the last
 * one shorter). */
#define PEER_SLICE_MIN (4U * 1024U)
#define PEER_SLICE_MAX (16U * 1024U * 1024U)
#define PEER_SLICE_DEFAULT (1024U * 1024U)
#define PEER_MAX_SLICES_PER_WRITE (UINT64_C(1) << 20)

/* Message type ranges. */
#define PEER_MSG_CORE_FIRST 0x0000
#define PEER_MSG_CORE_LAST 0x00ff
#define PEER_MSG_HANDOFF_FIRST 0x0100
#define PEER_MSG_HANDOFF_LAST 0x01ff
#define PEER_MSG_DIRECTORY_FIRST 0x0200
#define PEER_MSG_DIRECTORY_LAST 0x02ff
#define PEER_MSG_TELEMETRY_FIRST 0x0300
#define PEER_MSG_TELEMETRY_LAST 0x03ff
#define PEER_MSG_RDMA_FIRST 0x0400 /* rdma-proto.h */
#define PEER_MSG_RDMA_LAST 0x04ff

/* Core messages (handled by peer.c itself). */
enum {
        PEER_MSG_HELLO = 0x0001,      /* dialer -> acceptor */
        PEER_MSG_CHALLENGE = 0x0002,  /* acceptor -> dialer */
        PEER_MSG_AUTH = 0x0003,       /* dialer -> acceptor */
        PEER_MSG_AUTH_OK = 0x0004,    /* acceptor -> dialer */
        PEER_MSG_AUTH_FAIL = 0x0005,  /* either way, then close */
        PEER_MSG_HEARTBEAT = 0x0006,  /* both ways, on the control connection */
        PEER_MSG_BYE = 0x0007,        /* orderly close */
        PEER_MSG_DATA = 0x0010,       /* one slice of a bulk write (data streams) */
        PEER_MSG_WRITE_ACK = 0x0011,  /* receiver -> sender: a write failed (or landed) */
        PEER_MSG_WRITE_ACKS = 0x0012, /* receiver -> sender: runs of writes that landed */
};

typedef enum PeerRole {
        PEER_ROLE_CONTROL = 1,
        PEER_ROLE_DATA = 2,
} PeerRole;

#define PEER_NONCE_SIZE 32
#define PEER_MAC_SIZE 32
#define PEER_HOST_ID_MAX 63 /* as HostId= (config_host_id_problem()), directory names, member records */
#define PEER_MAX_STREAMS 16

typedef struct PeerFrameHeader {
        uint8_t version;
        uint8_t flags;
        uint16_t type;
        uint32_t length;
} PeerFrameHeader;

typedef struct PeerHello {
        uint8_t role;           /* PeerRole */
        uint8_t min_version;
        uint8_t max_version;
        uint16_t stream_index;  /* data streams: 0..n_streams-1; control: 0 */
        uint16_t n_streams;     /* control: how many data streams the dialer will open */
        uint64_t session_id;    /* data streams: from AUTH_OK; control: 0 */
        uint8_t nonce[PEER_NONCE_SIZE];
        char host_id[PEER_HOST_ID_MAX + 1];
} PeerHello;

typedef struct PeerChallenge {
        uint8_t nonce[PEER_NONCE_SIZE];
        uint8_t mac[PEER_MAC_SIZE];
        char host_id[PEER_HOST_ID_MAX + 1];
} PeerChallenge;

typedef struct PeerAuth {
        uint8_t mac[PEER_MAC_SIZE];
} PeerAuth;

/* The acceptor's heartbeat interval an AUTH_OK may name: HeartbeatInterval='s range
 * (100 ms to a day). Out of it the dialer would beat every 250 µs or never judge the
 * peer dead: refused (-EBADMSG). */
#define PEER_HEARTBEAT_MS_MIN 100u
#define PEER_HEARTBEAT_MS_MAX (24u * 3600u * 1000u)

typedef struct PeerAuthOk {
        uint64_t session_id;
        uint32_t heartbeat_ms;
        uint16_t n_streams;     /* accepted number of data streams */
} PeerAuthOk;

typedef enum PeerFailReason {
        PEER_FAIL_UNKNOWN_HOST = 1,
        PEER_FAIL_BAD_MAC = 2,
        PEER_FAIL_VERSION = 3,
        PEER_FAIL_SESSION = 4,
        PEER_FAIL_PROTOCOL = 5,
        PEER_FAIL_SHUTDOWN = 6,
        PEER_FAIL_SUPERSEDED = 7,
} PeerFailReason;

typedef struct PeerReason {
        uint32_t reason; /* PeerFailReason; AUTH_FAIL and BYE */
} PeerReason;

typedef struct PeerHeartbeat {
        uint64_t seq;
        uint64_t time_usec; /* sender's CLOCK_MONOTONIC, echoed nowhere: for logs */
} PeerHeartbeat;

#define PEER_DATA_HEADER_SIZE 72
/* DATA flags (the same in every slice of a write). */
#define PEER_DATA_F_IMM 0x1u    /* `imm` is delivered to the receiver with the write's completion */
#define PEER_DATA_F_TARGET 0x2u /* dst_offset is relative to `target`, an object of the
                                 * receiver's (a handoff's slot), which resolves it */
#define PEER_DATA_F_ALL (PEER_DATA_F_IMM | PEER_DATA_F_TARGET)
typedef struct PeerDataHeader {
        uint64_t write_id;      /* sender-chosen, unique per session and direction */
        uint64_t cookie;        /* the sender's TransportWrite.cookie */
        uint64_t dst_offset;    /* of the whole write, in the receiver's region (or target) */
        uint64_t total_length;  /* of the whole write */
        uint64_t slice_offset;  /* of this slice within the write */
        uint32_t region;        /* receiver's region id (0 with F_TARGET) */
        uint32_t slice_size;    /* every slice but the last has this size */
        uint64_t target;        /* F_TARGET; else 0 */
        uint64_t imm;           /* F_IMM; else 0 */
        uint32_t flags;         /* PEER_DATA_F_*; then 4 reserved bytes, 0 */
} PeerDataHeader;

typedef struct PeerWriteAck {
        uint64_t write_id;
        int32_t error;          /* 0 or negative errno (wire: two's complement) */
} PeerWriteAck;
#define PEER_WRITE_ACK_SIZE 12

/* WRITE_ACKS: every write of each run [first, first + count) landed without error
 * (errors go one by one in WRITE_ACK). Payload: u32 n_runs, u32 reserved (0), then
 * n_runs × (u64 first, u32 count, u32 reserved). */
typedef struct PeerAckRun {
        uint64_t first;
        uint32_t count;         /* >= 1 */
} PeerAckRun;
#define PEER_WRITE_ACKS_RUNS_MAX 4096
#define PEER_WRITE_ACKS_SIZE(n) (8u + 16u * (size_t)(n))

/* Header. decode validates magic, version, flags, reserved bits and the length bound
 * of the type; `len` must be at least PEER_FRAME_HEADER_SIZE. */
void peer_frame_header_encode(void *buf, uint16_t type, uint32_t length);
int peer_frame_header_decode(const void *buf, size_t len, PeerFrameHeader *ret);
/* Largest payload allowed for a type (DATA: slice header + PEER_SLICE_MAX). */
uint32_t peer_frame_max_payload(uint16_t type);

/* Host ids: 1..63 bytes (PEER_HOST_ID_MAX) of [A-Za-z0-9._:-]. */
bool peer_host_id_is_valid(const char *s);

/* Payload encoders write into buf (of size n) and return the bytes written, or
 * -ENOBUFS / -EINVAL. Decoders validate every field and return 0 or -EBADMSG. */
int peer_hello_encode(const PeerHello *h, void *buf, size_t n);
int peer_hello_decode(const void *buf, size_t n, PeerHello *ret);
int peer_challenge_encode(const PeerChallenge *c, void *buf, size_t n);
int peer_challenge_decode(const void *buf, size_t n, PeerChallenge *ret);
int peer_auth_msg_encode(const PeerAuth *a, void *buf, size_t n);
int peer_auth_msg_decode(const void *buf, size_t n, PeerAuth *ret);
int peer_auth_ok_encode(const PeerAuthOk *o, void *buf, size_t n);
int peer_auth_ok_decode(const void *buf, size_t n, PeerAuthOk *ret);
int peer_reason_encode(const PeerReason *r, void *buf, size_t n);
int peer_reason_decode(const void *buf, size_t n, PeerReason *ret);
int peer_heartbeat_encode(const PeerHeartbeat *h, void *buf, size_t n);
int peer_heartbeat_decode(const void *buf, size_t n, PeerHeartbeat *ret);
int peer_write_ack_encode(const PeerWriteAck *a, void *buf, size_t n);
int peer_write_ack_decode(const void *buf, size_t n, PeerWriteAck *ret);
/* Cumulative acknowledgement: the write ids ids[0..n) (any order, no repeats; sorted in
 * place) as runs of consecutive ids, at most max of them; returns how many, and in
 * *ret_used how many ids they cover (the rest go in the next frame). */
size_t peer_ack_runs_build(uint64_t *ids, size_t n, PeerAckRun *runs, size_t max, size_t *ret_used);
/* runs: 1..PEER_WRITE_ACKS_RUNS_MAX; decode fills at most `max` runs and says how many. */
int peer_write_acks_encode(const PeerAckRun *runs, size_t n_runs, void *buf, size_t n);
int peer_write_acks_decode(const void *buf, size_t n, PeerAckRun *runs, size_t max, size_t *ret_n);

/* DATA: the slice header is the first PEER_DATA_HEADER_SIZE bytes of the payload; the
 * slice bytes follow. decode checks the header against the frame's payload length
 * (slice length = payload_length - PEER_DATA_HEADER_SIZE): the slice lies inside the
 * write, sits on a slice boundary, has exactly the length the boundary implies, and no
 * sum overflows; flags are known ones, and target / imm are 0 without their flag. */
int peer_data_header_encode(const PeerDataHeader *d, void *buf, size_t n);
int peer_data_header_decode(const void *buf, size_t n, uint32_t payload_length,
                            PeerDataHeader *ret);
/* Number of slices of a write of `total` bytes cut at `slice_size`. */
uint64_t peer_slice_count(uint64_t total, uint32_t slice_size);
/* Length of slice `index`. */
uint64_t peer_slice_length(uint64_t total, uint32_t slice_size, uint64_t index);

/* Frames a whole message: header + payload into buf. Returns the frame size or
 * -ENOBUFS / -EMSGSIZE. */
int peer_frame_build(void *buf, size_t n, uint16_t type, const void *payload, size_t len);

const char *peer_msg_type_to_string(uint16_t type);
const char *peer_fail_reason_to_string(uint32_t reason);

/* "A.B.C.D:port", "[v6]:port" (numeric only: nothing here may block on DNS). Port
 * 1..65535. Returns 0 or -EINVAL. */
struct sockaddr_storage;
int peer_address_parse(const char *s, struct sockaddr_storage *ret, unsigned *ret_len);
