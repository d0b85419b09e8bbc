/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The write-ahead log: every workflow, directory-ownership and handoff transition is
 * appended here before it is acknowledged, so that a kill -9 at any point loses
 * nothing that a client was told had happened.
 *
 * On disk (docs/wal.md): a directory holding `wal.log` and, after the first
 * compaction, `wal.snapshot`. Both start with a 40-byte checksummed file header and
 * continue with records:
 *
 *   u32 length | u32 crc32c | u64 lsn | u16 type | u16 flags | u32 reserved | payload,
 *   padded to 8 bytes; all little-endian. The CRC covers everything but itself.
 *
 * LSNs are consecutive. Replay applies the snapshot (which ends with a SNAPSHOT_END
 * record), then every log record past the snapshot's LSN. A torn record (the file
 * ends inside it) or a corrupt one (bad CRC, bad length, out-of-order LSN) ends the
 * log: it and everything after it are cut, never applied.
 *
 * The parsing half (wal_parse_*) is pure and fuzzed; the file half does plain
 * synchronous I/O on a local file, which is what a WAL must do before acknowledging. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "macro.h"

#define WAL_FILE_MAGIC "EPDWAL\0\1"
#define WAL_FILE_VERSION 1u
#define WAL_FILE_HEADER_SIZE 40u
#define WAL_RECORD_HEADER_SIZE 24u
#define WAL_RECORD_PAYLOAD_MAX (1u << 20) /* larger lengths are corruption */

typedef enum WalFileKind {
        WAL_FILE_LOG = 1,
        WAL_FILE_SNAPSHOT = 2,
} WalFileKind;

/* Record types: the high byte names the subsystem that owns the payload format. */
enum {
        WAL_RECORD_SNAPSHOT_END = 0x0001, /* payload: u64 number of records before it */
        WAL_RECORD_WORKFLOW = 0x0100,     /* 0x01xx: workflow.c */
        WAL_RECORD_DIRECTORY = 0x0200,    /* 0x02xx: directory ownership */
        WAL_RECORD_HANDOFF = 0x0300,      /* 0x03xx: handoff transitions */
        WAL_RECORD_SEQUENCE = 0x0400,     /* 0x04xx: committed sequences */
        WAL_RECORD_FEATURE = 0x0500,      /* 0x05xx: published features */
        WAL_RECORD_TEST = 0x7f00,         /* tests and benchmarks */
};

typedef enum WalSyncPolicy {
        WAL_SYNC_ALWAYS, /* fdatasync before every append returns */
        WAL_SYNC_BATCH,  /* group commit: wal_sync() once per batch, before its replies */
        WAL_SYNC_NONE,   /* never fsync: survives a crash of epdd, not of the machine */
        _WAL_SYNC_POLICY_MAX,
} WalSyncPolicy;

typedef struct WalRecord {
        uint64_t lsn;
        uint16_t type;
        uint16_t flags;
        uint32_t length;
        const void *payload; /* points into the buffer being parsed */
} WalRecord;

typedef struct WalFileHeader {
        WalFileKind kind;
        uint64_t base_lsn; /* log: first record is base_lsn+1; snapshot: state as of it */
        uint64_t created_usec;
} WalFileHeader;

typedef struct WalStats {
        uint64_t appended;
        uint64_t appended_bytes;
        uint64_t syncs;
        uint64_t replayed;      /* log records applied at the last replay */
        uint64_t snapshot_records;
        uint64_t cut_bytes;     /* bytes cut from the log's tail at the last replay */
        uint64_t torn;          /* replays that found a torn tail */
        uint64_t corrupt;       /* replays that found a corrupt record */
        uint64_t cut_records;   /* well-formed records after the damage the last replay cut
                                 * (kept in wal.log.cut-LSN): 0 for a torn tail */
        bool cut_scan_incomplete; /* the last replay's scan of the cut bytes stopped at its
                                   * bound (crafted bytes): they are kept as if records follow */
        uint64_t compactions;
        uint64_t log_bytes;     /* current size of wal.log */
} WalStats;

/* Called for every record replayed, in LSN order. A negative return stops the
 * replay and is returned by it. `from_snapshot` tells snapshot records apart. */
typedef int (*WalApplyFn)(void *userdata, const WalRecord *r, bool from_snapshot);

/* ---- pure parsing (fuzzed) ---- */

/* Bytes a record with this payload length takes on disk (header + padded payload). */
size_t wal_record_size(size_t payload_len);
/* Encodes one record into buf (which must hold wal_record_size(len) bytes). */
void wal_record_encode(void *buf, uint64_t lsn, uint16_t type, const void *payload, size_t len);
/* Parses the record at the start of buf. 0 and *ret_size on success; -EAGAIN when
 * buf ends inside the record (torn); -EBADMSG when it is corrupt. */
int wal_record_parse(const void *buf, size_t n, WalRecord *ret, size_t *ret_size);
void wal_file_header_encode(void *buf, const WalFileHeader *h);
int wal_file_header_parse(const void *buf, size_t n, WalFileHeader *ret);

typedef struct WalParseResult {
        WalFileHeader header;
        uint64_t records;    /* records applied (including skipped ones, see below) */
        uint64_t last_lsn;   /* LSN of the last good record (log: base_lsn if none) */
        size_t good_bytes;   /* length of the valid prefix of the file */
        int tail;            /* 0: clean end; -EAGAIN: torn tail; -EBADMSG: corrupt */
        bool ended;          /* a snapshot: its SNAPSHOT_END was read (the last record) */
} WalParseResult;

/* Parses a whole file image: header, then records until the end or the first bad
 * one. Records with lsn <= skip_through are checked but not passed to apply.
 * Returns 0 (see result->tail for how it ended), -EBADMSG for a bad file header, or
 * the first negative value apply returned. */
int wal_parse_buffer(const void *buf, size_t n, uint64_t skip_through, WalApplyFn apply,
                     void *userdata, bool from_snapshot, WalParseResult *result);

const char *wal_sync_policy_to_string(WalSyncPolicy p);
int wal_sync_policy_from_string(const char *s);
const char *wal_record_type_to_string(uint16_t type); /* the subsystem's name */

/* ---- the log ---- */

typedef struct Wal Wal;
typedef struct WalSnapshot WalSnapshot;

/* Opens (creating if needed) the WAL in dir (created 0700 if missing). Nothing is
 * read yet: call wal_replay() once, before the first append. */
int wal_open(const char *dir, WalSyncPolicy policy, Wal **ret);
Wal *wal_free(Wal *w);
DEFINE_TRIVIAL_CLEANUP_FUNC(Wal *, wal_free);

/* Applies the snapshot and the log, cuts a torn or corrupt tail (logging what was
 * cut) and makes the log ready for appends. -EBADMSG if the snapshot itself is bad
 * or the log does not continue it: state would be lost, so nothing is applied past
 * that point and the daemon must not serve from it. */
int wal_replay(Wal *w, WalApplyFn apply, void *userdata);

/* Appends one record; with WAL_SYNC_ALWAYS it is on stable storage when this
 * returns. A failed append leaves the log as it was before the call. */
int wal_append(Wal *w, uint16_t type, const void *payload, size_t len, uint64_t *ret_lsn);
/* Appends records encoded by the caller (wal_record_encode, LSNs last+1..last_lsn in
 * order, `size` bytes in all) with one write; no sync (the writer thread's batches). A
 * failed write is cut back: the log is as before the call. */
int wal_write_encoded(Wal *w, const void *records, size_t size, uint64_t last_lsn);
/* Makes every appended record durable (no-op when already synced, or with NONE). */
int wal_sync(Wal *w);
bool wal_needs_sync(const Wal *w);
uint64_t wal_last_lsn(const Wal *w);   /* appended */
uint64_t wal_synced_lsn(const Wal *w); /* durable under the policy */
void wal_set_policy(Wal *w, WalSyncPolicy p);
WalSyncPolicy wal_get_policy(const Wal *w);
const WalStats *wal_get_stats(const Wal *w);
/* A pointer for the owner (epdd's glue keeps its event sources there). */
void wal_set_userdata(Wal *w, void *userdata);
void *wal_get_userdata(const Wal *w);

/* Compaction: fn writes the whole current state with wal_snapshot_add(); the
 * snapshot replaces the log atomically (write, fsync, rename, fsync dir), so a crash
 * at any point leaves either the old or the new state, both complete. */
typedef int (*WalSnapshotFn)(void *userdata, WalSnapshot *s);
int wal_snapshot_add(WalSnapshot *s, uint16_t type, const void *payload, size_t len);
int wal_compact(Wal *w, WalSnapshotFn fn, void *userdata);
/* The same in two halves, so that the state is taken where it lives (the event loop)
 * and the files are written elsewhere (the writer thread): a whole snapshot file image
 * as of `lsn`, in memory (the caller frees it), and the replacement of the log by it
 * (every record up to lsn must be appended: lsn == wal_last_lsn()). */
int wal_snapshot_build(WalSnapshotFn fn, void *userdata, uint64_t lsn, void **ret, size_t *ret_size,
                       uint64_t *ret_records);
int wal_compact_buffer(Wal *w, const void *snapshot, size_t size, uint64_t lsn, uint64_t records);
/* Whether the log takes no further record: a compaction failed after its snapshot
 * became the truth, or its sync failed. A compaction that failed before (it could not
 * write its snapshot: a full disk, say) leaves the log as it was, appending. */
bool wal_is_broken(const Wal *w);
