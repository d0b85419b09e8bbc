/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Payloads of the handoff messages of the peer protocol (types 0x0100-0x01ff). The
 * peer layer frames, authenticates and delivers them; this file turns payload bytes
 * into validated structs and back. Pure; fuzzed (tests/fuzz/fuzz-handoff-proto.c).
 *
 * All integers are little-endian, fields are packed in the order listed, and a payload
 * must have exactly its length: no trailing bytes. Reserved fields must be zero.
 *
 *  PREPARE          source -> destination: reserve pages for a handoff
 *      request_id[16] token:u64 timeout_usec:u64 page_size:u64 layout_hash:u64
 *      target_worker[16] n_pages:u32 n_groups:u32 flags:u32 reserved:u32 slot:u64
 *      n_groups x { n_ranges:u16 reserved:u16 n_ranges x { offset:u64 length:u64 } }
 *    flags: HANDOFF_PREPARE_F_IMM: group completions ride the data (each group's last
 *      write carries an immediate, handoff_group_imm()): no GROUP_SENT;
 *      HANDOFF_PREPARE_F_PIPELINED (with a non-zero slot, larger than every earlier one
 *      of the session): the source does not wait for PREPARE_OK (none is sent) and
 *      addresses its writes to the slot (TRANSPORT_WRITE_TARGET, offsets
 *      handoff_slot_offset()); a refusal is PREPARE_REFUSED as ever.
 *      HANDOFF_PREPARE_F_TARGETED (not with PIPELINED; a slot as above): the source
 *      waits for PREPARE_OK, then addresses its writes to the slot all the same, so
 *      that a write of this attempt can never land in pages the destination gave to
 *      another after a rollback (the slot is gone then: refused).
 *  PREPARE_OK       destination -> source: pages reserved
 *      request_id[16] token:u64 region:u32 n_pages:u32 n_pages x { offset:u64 }
 *  PREPARE_REFUSED  destination -> source: admission said no
 *      request_id[16] token:u64 cause:u32 error:u32 (positive errno)
 *  GROUP_SENT       source -> destination: every write of the group completed
 *      request_id[16] token:u64 group:u32 reserved:u32 bytes:u64
 *  COMMIT           destination -> source: the decode worker committed
 *      request_id[16] token:u64
 *  ROLLBACK         either way: the sender rolled the handoff back
 *      request_id[16] token:u64 cause:u32 reserved:u32
 */

#include <stddef.h>
#include <stdint.h>

#include "handoff/handoff.h"
#include "id.h"

#define HANDOFF_MSG_FIRST 0x0100U
#define HANDOFF_MSG_LAST 0x01ffU

typedef enum HandoffMessageType {
        HANDOFF_MSG_PREPARE = 0x0100,
        HANDOFF_MSG_PREPARE_OK = 0x0101,
        HANDOFF_MSG_PREPARE_REFUSED = 0x0102,
        HANDOFF_MSG_GROUP_SENT = 0x0103,
        HANDOFF_MSG_COMMIT = 0x0104,
        HANDOFF_MSG_ROLLBACK = 0x0105,
} HandoffMessageType;

#define HANDOFF_PAGES_MAX 65536U        /* pages of one handoff */
#define HANDOFF_PROTO_RANGES_MAX 8192U  /* ranges of all groups of one PREPARE */
#define HANDOFF_PAGE_SIZE_MAX (1ULL << 32)

#define HANDOFF_PREPARE_F_IMM 0x1u
#define HANDOFF_PREPARE_F_PIPELINED 0x2u
#define HANDOFF_PREPARE_F_TARGETED 0x4u
#define HANDOFF_PREPARE_F_ALL (HANDOFF_PREPARE_F_IMM | HANDOFF_PREPARE_F_PIPELINED | HANDOFF_PREPARE_F_TARGETED)
#define HANDOFF_PREPARE_F_SLOT (HANDOFF_PREPARE_F_PIPELINED | HANDOFF_PREPARE_F_TARGETED)

/* A pipelined handoff's write offsets: page index and offset within the page. */
static inline uint64_t handoff_slot_offset(uint32_t page, uint64_t in_page) {
        return ((uint64_t)page << 32) | in_page;
}
/* The immediate of a group's last write: the group and the bytes it moves in all. */
static inline uint64_t handoff_group_imm(uint32_t group, uint64_t bytes) {
        return (bytes << 10) | group;
}
#define HANDOFF_IMM_GROUP(imm) ((uint32_t)((imm) & 1023u))
#define HANDOFF_IMM_BYTES(imm) ((imm) >> 10)

typedef struct HandoffMessage {
        uint16_t type;
        EpdId request_id;
        uint64_t token;

        /* PREPARE */
        uint64_t timeout_usec;
        uint64_t page_size;
        uint64_t layout_hash;
        EpdId target_worker;      /* null: any decode worker may accept */
        uint32_t n_groups;
        uint32_t flags;           /* HANDOFF_PREPARE_F_* */
        uint64_t slot;            /* F_PIPELINED */
        uint32_t *group_ranges;   /* n_groups + 1 entries: group g's ranges are
                                   * ranges[group_ranges[g] .. group_ranges[g+1]) */
        HandoffRange *ranges;
        uint32_t n_ranges;

        /* PREPARE, PREPARE_OK */
        uint32_t n_pages;
        /* PREPARE_OK */
        uint32_t region;
        uint64_t *page_offsets;   /* n_pages */

        /* PREPARE_REFUSED, ROLLBACK */
        HandoffCause cause;
        int error;                /* PREPARE_REFUSED: negative errno */

        /* GROUP_SENT */
        uint32_t group;
        uint64_t bytes;
} HandoffMessage;

/* Frees the arrays of a decoded or built message (not the struct). */
void handoff_message_done(HandoffMessage *m);

/* Validates and decodes a payload. -EBADMSG for malformed or invalid content,
 * -EOPNOTSUPP for a type in the handoff range that this version does not know. On
 * error *ret holds nothing to free. */
int handoff_message_decode(uint16_t type, const void *payload, size_t len, HandoffMessage *ret);

/* What a message that handoff_message_decode() refused still says, so that its handoff
 * can be answered rather than left waiting: the request id and token every message
 * starts with (-EBADMSG if the payload is shorter), and of a PREPARE whose fixed part is
 * whole, its flags and slot as sent (unchecked; ret->n_groups stays 0). Allocates
 * nothing. */
int handoff_message_decode_head(uint16_t type, const void *payload, size_t len, HandoffMessage *ret);

/* Encodes a message (validated the same way as on decode: an invalid one is -EINVAL).
 * *ret is malloc()ed. */
int handoff_message_encode(const HandoffMessage *m, uint8_t **ret, size_t *ret_len);

/* Fills the layout of group g of a PREPARE. */
int handoff_message_group_layout(const HandoffMessage *m, uint32_t g, HandoffGroupLayout *ret);

const char *handoff_message_type_to_string(uint16_t type);
