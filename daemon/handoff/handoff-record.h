/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* WAL records of handoff transitions (types 0x03xx, wal.h; docs/wal.md), and the
 * journal they describe: which handoffs this daemon takes part in, per (request id,
 * role), and how far each got. Every transition is appended before it is acknowledged
 * (the Prepare reply, a group reported done, the Commit reply, a rollback, a release),
 * and the daemon's journal is updated by applying the very record it appended, so
 * replay rebuilds exactly what ran.
 *
 * Every record starts with (little-endian, 32 bytes):
 *   0  16 request id
 *   16 8  fencing token
 *   24 1  role (HandoffRole)
 *   25 1  cause (ROLLED_BACK; else 0)
 *   26 2  reserved, 0
 *   28 4  PREPARED: number of layer groups; GROUPS: groups done in order (no longer
 *         written: progress is not journaled; old logs replay); COMMITTED of a
 *         destination: HANDOFF_REC_COMMIT_PAIR when the source side is in this daemon
 *         (a local handoff) and commits in the same record; else 0
 * PREPARED continues with: u32 arena | u32 n_pages | u64 page size | n_pages × u32 page.
 * COMMITTED of a destination continues with the decode sequence's PUT payload
 * (sequence-record.h), so that the commit and the sequence it made are one record: a
 * crash can leave the handoff committed with its sequence, or neither. In a snapshot,
 * where the sequence has its own record, it continues with the sequence's 16-byte id
 * only.
 *
 * Replay semantics (handoff_journal_apply): PREPARED starts an entry (a larger token
 * replaces an older attempt); GROUPS advances it; COMMITTED and ROLLED_BACK end it
 * either way; RELEASED removes it. After a restart the handoff objects are gone (their
 * transfers cannot continue): handoff_journal_recover() turns every entry still in
 * flight into ROLLED_BACK (cause shutdown) — its destination pages were never in a
 * sequence, so the page pools come back without them — and committed ones stay
 * committed, with their decode sequence restored.
 *
 * Pure (no bus, no WAL I/O): fuzzed by tests/fuzz/fuzz-restart-record.c. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "handoff/handoff.h"
#include "hashmap.h"
#include "id.h"

enum {
        HANDOFF_REC_PREPARED = 0x01,
        HANDOFF_REC_GROUPS = 0x02,
        HANDOFF_REC_COMMITTED = 0x03,
        HANDOFF_REC_ROLLED_BACK = 0x04,
        HANDOFF_REC_RELEASED = 0x05,
};

/* COMMITTED's value: both sides of a local handoff commit in this one record, so that a
 * crash never leaves one side committed and the other in flight. */
#define HANDOFF_REC_COMMIT_PAIR 1u

#define HANDOFF_REC_HEADER_SIZE 32u
#define HANDOFF_REC_PREPARED_SIZE(n_pages) (HANDOFF_REC_HEADER_SIZE + 16u + 4u * (size_t)(n_pages))
#define HANDOFF_JOURNAL_MAX 131072u /* entries: both roles of HANDOFF_MANAGER_MAX handoffs */
#define HANDOFF_JOURNAL_PAGES_MAX 65536u

typedef struct HandoffRecord {
        uint8_t type;
        EpdId request_id;
        uint64_t token;
        HandoffRole role;
        HandoffCause cause;
        uint32_t value;         /* PREPARED: groups; GROUPS: groups done; COMMITTED: 0 or
                                 * HANDOFF_REC_COMMIT_PAIR */
        uint32_t arena;         /* PREPARED */
        uint32_t n_pages;       /* PREPARED */
        uint64_t page_size;     /* PREPARED */
        const uint8_t *pages;   /* PREPARED: n_pages × 4 bytes, inside the parsed buffer */
        const void *extra;      /* COMMITTED: the decode sequence's PUT payload (> 16 bytes)
                                 * or its id (16 bytes), or NULL */
        size_t extra_len;
} HandoffRecord;

/* Bytes of a record's payload; encodes it (buf holds handoff_record_size() bytes). */
size_t handoff_record_size(const HandoffRecord *r);
void handoff_record_encode(void *buf, const HandoffRecord *r, const uint32_t *pages);
/* Parses a payload of type (the low byte of the WAL type): 0 or -EBADMSG. */
int handoff_record_parse(uint8_t type, const void *buf, size_t n, HandoffRecord *ret);

typedef struct HandoffJournalEntry {
        EpdId request_id;
        uint64_t token;
        HandoffRole role;
        HandoffState state;     /* PREPARED (in flight), COMMITTED or ROLLED_BACK */
        HandoffCause cause;
        uint32_t n_groups, groups_done;
        uint32_t arena, n_pages;
        uint64_t page_size;
        uint32_t *pages;
        bool has_sequence;      /* COMMITTED destination: the decode sequence */
        EpdId sequence;
        bool recovered;         /* came back from before a restart */
        uint8_t key[17];        /* request id, role: the map's key */
} HandoffJournalEntry;

typedef struct HandoffJournal {
        Hashmap *entries;       /* HandoffJournalEntry* by (request id, role): 17 bytes */
} HandoffJournal;

int handoff_journal_init(HandoffJournal *j);
void handoff_journal_done(HandoffJournal *j);
/* Applies one record (WAL type's low byte). -EBADMSG malformed; -ENOENT no such entry
 * (or another token); -ESTALE an older attempt's PREPARED; -EALREADY a rollback of a
 * committed entry; -EDQUOT past HANDOFF_JOURNAL_MAX. Nothing changes on error. */
int handoff_journal_apply(HandoffJournal *j, uint8_t type, const void *payload, size_t len);
HandoffJournalEntry *handoff_journal_get(HandoffJournal *j, const EpdId *request_id, HandoffRole role);
size_t handoff_journal_size(const HandoffJournal *j);
bool handoff_journal_iterate(HandoffJournal *j, size_t *i, HandoffJournalEntry **ret);
/* After a replay: every entry is marked recovered; those in flight become ROLLED_BACK
 * (cause SHUTDOWN), each reported to fn (which journals it) if fn is not NULL. Returns
 * how many were rolled back. */
unsigned handoff_journal_recover(HandoffJournal *j, void (*fn)(void *userdata, const HandoffJournalEntry *e),
                                 void *userdata);
/* Snapshot of one entry: calls add for each record that rebuilds it (PREPARED, GROUPS,
 * COMMITTED or ROLLED_BACK, without the sequence: snapshots hold the sequences). */
int handoff_journal_snapshot_entry(const HandoffJournalEntry *e,
                                   int (*add)(void *userdata, uint8_t type, const void *rec, size_t len),
                                   void *userdata);
