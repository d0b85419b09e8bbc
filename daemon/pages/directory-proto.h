/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Payloads of the block-directory messages of the peer protocol (types 0x0200-0x02ff):
 * the directory is sharded by owner host (rendezvous hashing over the live members);
 * a host tells the owner of each block it caches (PUBLISH, batched) and of each it no
 * longer caches (UNPUBLISH), and asks owners who holds the blocks of a prefix (LOOKUP,
 * answered by ANSWER). The holder a PUBLISH names is always the sending peer (its
 * authenticated host id), never a field: no host can publish for another. Pure;
 * unit-tested and fuzzed (tests/fuzz/fuzz-directory-proto.c).
 *
 * Integers are little-endian, fields packed in the order listed, no trailing bytes;
 * flags and reserved fields must be zero. A name is u8 length + bytes (at most 63,
 * printable; a host id: letters, digits, '-', '_', '.').
 *
 *  PUBLISH, UNPUBLISH   holder -> owner
 *      version:u8 flags:u8 reserved:u16 count:u32 arena:name worker:name count x { hash:u64 }
 *  LOOKUP               asker -> owner
 *      version:u8 flags:u8 reserved:u16 count:u32 request:u64 count x { hash:u64 }
 *  ANSWER               owner -> asker, one per LOOKUP, the hashes in the same order
 *      version:u8 flags:u8 reserved:u16 count:u32 request:u64
 *      count x { hash:u64 n_holders:u8 n_holders x { host:name arena:name worker:name } }
 *
 * A version this host does not speak is -EPROTONOSUPPORT (the sender is newer; the
 * message is dropped, the session stays); anything else malformed is -EBADMSG. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define DIRECTORY_MSG_FIRST 0x0200U
#define DIRECTORY_MSG_LAST 0x02ffU

typedef enum DirectoryMessageType {
        DIRECTORY_MSG_PUBLISH = 0x0201,
        DIRECTORY_MSG_UNPUBLISH = 0x0202,
        DIRECTORY_MSG_LOOKUP = 0x0203,
        DIRECTORY_MSG_ANSWER = 0x0204,
} DirectoryMessageType;

#define DIRECTORY_PROTO_VERSION 1
#define DIRECTORY_BATCH_MAX 16384U  /* hashes in one message */
#define DIRECTORY_LOOKUP_MAX 512U   /* hashes in one LOOKUP or ANSWER (an ANSWER stays < 1 MiB) */
#define DIRECTORY_HOLDERS_MAX 8U    /* holders one ANSWER names per hash */
#define DIRECTORY_NAME_MAX 63

typedef struct DirectoryHolder {
        char host[DIRECTORY_NAME_MAX + 1];
        char arena[DIRECTORY_NAME_MAX + 1];
        char worker[DIRECTORY_NAME_MAX + 1];
} DirectoryHolder;

typedef struct DirectoryAnswerEntry {
        uint64_t hash;
        uint8_t n_holders;
        DirectoryHolder holders[DIRECTORY_HOLDERS_MAX];
} DirectoryAnswerEntry;

typedef struct DirectoryMessage {
        uint16_t type;
        uint32_t count;
        uint64_t request;                /* LOOKUP, ANSWER */
        char arena[DIRECTORY_NAME_MAX + 1];  /* PUBLISH, UNPUBLISH */
        char worker[DIRECTORY_NAME_MAX + 1];
        uint64_t *hashes;                /* PUBLISH, UNPUBLISH, LOOKUP: count (malloc'ed) */
        DirectoryAnswerEntry *entries;   /* ANSWER: count (malloc'ed) */
} DirectoryMessage;

/* Parses a payload of type; *ret owns its arrays afterwards (directory_message_done). */
int directory_message_parse(uint16_t type, const void *payload, size_t len, DirectoryMessage *ret);
void directory_message_done(DirectoryMessage *m);

/* Encoders: the payload (malloc'ed) and its length. -EINVAL for a count of 0 or over
 * DIRECTORY_BATCH_MAX, a name that is too long or not printable. */
int directory_publish_encode(uint16_t type, const char *arena, const char *worker, const uint64_t *hashes,
                             size_t n, uint8_t **ret, size_t *ret_len);
int directory_lookup_encode(uint64_t request, const uint64_t *hashes, size_t n, uint8_t **ret, size_t *ret_len);
int directory_answer_encode(uint64_t request, const DirectoryAnswerEntry *entries, size_t n, uint8_t **ret,
                            size_t *ret_len);

bool directory_name_is_valid(const char *s, bool host);
