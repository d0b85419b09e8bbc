/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* WAL records of committed sequences (types 0x04xx, wal.h; docs/wal.md). Every
 * committed transition of a registered sequence (create, append, truncate, clone,
 * copy-on-write remap, grant, revoke) journals the sequence's whole state as one PUT
 * record; its release journals a DEL. Replay keeps the last PUT per id, and the page
 * pools' reference counts and free lists are rebuilt from the sequences that remain
 * (page_pool_restore()), so refcounts are exact by construction. Snapshots hold one
 * PUT per live sequence.
 *
 * PUT payload, little-endian:
 *   0   16  sequence id
 *   16  4   arena index
 *   20  4   owner uid (who may Attach after a restart)
 *   24  8   page size
 *   32  8   created (µs, realtime)
 *   40  4   number of grants G (<= SEQUENCE_GRANTS_MAX)
 *   44  4   number of pages N
 *   48  16G granted worker ids
 *   ..  4N  page ids
 * DEL payload: 16-byte id.
 *
 * Pure: encode and parse only (fuzzed by tests/fuzz/fuzz-sequence-record.c). */

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "id.h"
#include "pages/pages.h"

enum {
        SEQUENCE_REC_PUT = 0x01,
        SEQUENCE_REC_DEL = 0x02,
};

#define SEQUENCE_REC_HEADER_SIZE 48u
/* Pages one record can hold inside WAL_RECORD_PAYLOAD_MAX with every grant. */
#define SEQUENCE_REC_PAGES_MAX ((UINT32_C(1) << 20) / 4 - 512)

typedef struct SequenceRecord {
        EpdId id;
        uint32_t arena;
        uint32_t uid;
        uint64_t page_size;
        uint64_t created_usec;
        uint32_t n_grants;
        const uint8_t *grants; /* n_grants × 16 bytes, inside the parsed buffer */
        uint32_t n_pages;
        const uint8_t *pages;  /* n_pages × 4 bytes (little-endian), inside the buffer */
} SequenceRecord;

/* Bytes of a PUT record's payload. */
size_t sequence_record_put_size(uint32_t n_grants, uint32_t n_pages);
/* Encodes a PUT into buf (sequence_record_put_size() bytes); grants are 16-byte ids. */
void sequence_record_put_encode(void *buf, const EpdId *id, uint32_t arena, uint32_t uid,
                                uint64_t page_size, uint64_t created_usec, const EpdId *grants,
                                uint32_t n_grants, const PageId *pages, uint32_t n_pages);
/* Parses a PUT payload: 0, or -EBADMSG if it is malformed. */
int sequence_record_put_parse(const void *buf, size_t n, SequenceRecord *ret);
/* Parses a DEL payload. */
int sequence_record_del_parse(const void *buf, size_t n, EpdId *ret);
/* Page i of a parsed PUT. */
PageId sequence_record_page(const SequenceRecord *r, uint32_t i);
