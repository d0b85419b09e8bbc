/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* WAL records of block-directory ownership (types 0x02xx, wal.h; docs/wal.md). The
 * directory entry hash -> page keeps its page cached after every sequence let go of it;
 * each insert is journaled as a PUT before the call that made it is acknowledged, and
 * each removal (explicit, LRU eviction to make room, pool teardown) as a DEL before
 * the page can be used for anything else. Replay keeps the last PUT per hash; after
 * the sequences are in, page_manager_restore_finish() gives every entry its page back
 * cached (IDLE, evictable) or shared with the sequences that hold it (LIVE).
 *
 * PUT payload, little-endian (32 bytes):
 *   0  8  block hash
 *   8  4  arena index
 *   12 4  page id
 *   16 8  page size of the arena's pool
 *   24 8  reserved, 0
 * DEL payload: 8-byte block hash.
 *
 * Pure: encode and parse only (fuzzed by tests/fuzz/fuzz-restart-record.c). */

#include <stddef.h>
#include <stdint.h>

enum {
        DIRECTORY_REC_PUT = 0x01,
        DIRECTORY_REC_DEL = 0x02,
};

#define DIRECTORY_REC_PUT_SIZE 32u
#define DIRECTORY_REC_DEL_SIZE 8u

typedef struct DirectoryRecord {
        uint64_t hash;
        uint32_t arena;
        uint32_t page;
        uint64_t page_size;
} DirectoryRecord;

void directory_record_put_encode(void *buf, const DirectoryRecord *r);
void directory_record_del_encode(void *buf, uint64_t hash);
/* 0, or -EBADMSG for a malformed payload. */
int directory_record_put_parse(const void *buf, size_t n, DirectoryRecord *ret);
int directory_record_del_parse(const void *buf, size_t n, uint64_t *ret);
