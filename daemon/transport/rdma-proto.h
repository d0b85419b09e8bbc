/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The RDMA messages of the peer protocol (range 0x0400-0x04ff), carried on the existing
 * control connection. Pure: encode/decode with validation, no I/O. Big-endian, fixed
 * layouts, no trailing bytes; a payload that fails validation ends the connection.
 *
 *   CONNECT   (both ways) this side's RDMA endpoint for the peer, or "none":
 *     u8 flags (RDMA_CONNECT_HAVE_RDMA), u8 port, u8 mtu (IBV_MTU_* 1..5), u8 gid_index,
 *     u32 qpn (24 bits), u32 psn (24 bits), 16 bytes gid, u8 name_len, name bytes
 *     (the device, printable, 1..63 bytes; 0 bytes and all other fields 0 without
 *     RDMA_CONNECT_HAVE_RDMA).
 *   GRANT     receiver -> sender: remote access to the one range a REQUEST named, after
 *     the receiver's incoming validator accepted it: u64 write id (1..2^32-1), u32
 *     region, u32 rkey, u64 remote address, u64 length.
 *   DOWN      either way: RDMA to this peer stops (device fatal, port down, QP error);
 *     both fall back to tcp: u32 errno (1..4095), u8 len, reason bytes (printable).
 *   REQUEST   sender -> receiver: one write it wants to RDMA WRITE: u64 write id
 *     (1..2^32-1: its last work request carries it as the immediate), u64 cookie (the
 *     handoff's, for the validator), u32 region, u64 offset, u64 length (> 0), u64
 *     attempt (peer protocol 3: the handoff attempt's token, 0 for none: the receiver
 *     grants the write only while the pages are that attempt's, so that a late REQUEST
 *     of a rolled-back attempt is never granted into the pages of the next one).
 *   ACK       receiver -> sender: u64 write id, u32 errno (0..4095): 0 once the write's
 *     immediate arrived (every byte landed, in QP order), or why the REQUEST was
 *     refused (then no GRANT was sent).
 * See docs/rdma.md. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define RDMA_MSG_FIRST 0x0400U
#define RDMA_MSG_LAST 0x04ffU

typedef enum RdmaMessageType {
        RDMA_MSG_CONNECT = 0x0401,
        RDMA_MSG_GRANT = 0x0402,
        RDMA_MSG_DOWN = 0x0403,
        RDMA_MSG_REQUEST = 0x0404,
        RDMA_MSG_ACK = 0x0405,
} RdmaMessageType;

#define RDMA_WRITE_ID_MAX UINT32_MAX

#define RDMA_CONNECT_HAVE_RDMA 0x01U
#define RDMA_PROTO_NAME_MAX 63U
#define RDMA_PROTO_REASON_MAX 200U
/* The largest payload: DOWN with the longest reason (5 + 200), CONNECT being 29 + 63. */
#define RDMA_PROTO_MAX_PAYLOAD (5 + RDMA_PROTO_REASON_MAX)

typedef struct RdmaMessage {
        RdmaMessageType type;
        union {
                struct {
                        bool have_rdma;
                        uint8_t port, mtu, gid_index;
                        uint32_t qpn, psn;
                        uint8_t gid[16];
                        char device[RDMA_PROTO_NAME_MAX + 1];
                } connect;
                struct {
                        uint64_t write_id;
                        uint32_t region, rkey;
                        uint64_t addr, length;
                } grant;
                struct {
                        uint64_t write_id, cookie;
                        uint32_t region;
                        uint64_t offset, length;
                        uint64_t attempt;
                } request;
                struct {
                        uint64_t write_id;
                        uint32_t error;
                } ack;
                struct {
                        uint32_t error;
                        char reason[RDMA_PROTO_REASON_MAX + 1];
                } down;
        };
} RdmaMessage;

/* Validates and decodes one payload of message `type`. Returns 0, -EBADMSG (malformed),
 * or -EOPNOTSUPP (a type of the range that this version does not know). */
int rdma_message_decode(uint16_t type, const void *payload, size_t len, RdmaMessage *ret);
/* Encodes m into buf (at least RDMA_PROTO_MAX_PAYLOAD bytes). Returns the payload
 * length, or -EINVAL if m would not pass rdma_message_decode. */
int rdma_message_encode(const RdmaMessage *m, uint8_t *buf, size_t size);
