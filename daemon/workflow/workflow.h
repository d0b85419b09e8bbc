/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Agent workflows (docs/scheduler.md#workflows): a session of steps over branches,
 * each branch pointing at the sequence (KV page table) of its latest step.
 *
 *   create   a workflow over a root sequence (the workflow holds its own CoW clone)
 *   fork     a new branch from a branch's head: a CoW clone, no byte copied
 *   advance  a branch to a new step with new tokens: the new head is a clone of the
 *            predecessor's longest block-aligned common prefix (the rest is for the
 *            worker to compute); optionally, segments of the predecessor that reappear
 *            elsewhere in the new tokens are reported (workflow-match.h)
 *   merge    a branch into another (the target adopts the source's head), the source goes
 *   drop     a branch; release the whole workflow
 *
 * Every transition is journaled (the WAL, through ops->journal) after its side
 * effects on sequences are prepared and before it is applied and acknowledged; a
 * failed journal undoes the side effects. The transition's record carries those side
 * effects too: the PUT of the sequence it made (a clone) and the DEL of every sequence
 * it lets go of, which are not journaled on their own. One checksummed record: after a
 * crash the whole transition is there or none of it, never a clone that no branch
 * heads on or a replaced head still held. Replay rebuilds the same state from the
 * records and hands their sequence part to ops->apply_sequence. A workflow whose
 * sequences are not on this daemon (lost, or not restored) answers -ESTALE, never
 * crashes.
 *
 * Pure: sequences are reached through WorkflowOps (the pages subsystem in epdd, a
 * model in the tests). */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "hashmap.h"
#include "id.h"
#include "macro.h"
#include "workflow/workflow-match.h"

#define WORKFLOW_BRANCHES_MAX 64u
#define WORKFLOW_TOKENS_MAX 200000u /* per step: a WAL record holds them */
#define WORKFLOWS_MAX_DEFAULT 4096u

enum {
        WORKFLOW_REC_CREATE = 1,
        WORKFLOW_REC_FORK,
        WORKFLOW_REC_ADVANCE,
        WORKFLOW_REC_MERGE,
        WORKFLOW_REC_DROP,
        WORKFLOW_REC_RELEASE,
        WORKFLOW_REC_STATE_BRANCH, /* snapshot: one branch with its head and tokens */
        _WORKFLOW_REC_MAX,
};

/* Record flags (the record's second byte): the record carries its sequence part
 * (docs/wal.md). Records of before it (flags 0) still replay. */
#define WORKFLOW_REC_F_SEQUENCES 0x01u

typedef struct WorkflowOps {
        /* A CoW clone of the first n_pages pages of seq (SIZE_MAX: all) -> *ret, not
         * journaled on its own: its PUT payload (pages/sequence-record.h) goes to
         * *ret_put (the caller frees it), for the transition's record. */
        int (*clone)(void *userdata, const EpdId *seq, size_t n_pages, EpdId *ret, void **ret_put,
                     size_t *ret_put_len);
        /* Releases seq without journaling it: its DEL is in the transition's record (or
         * it was never journaled: an undone clone). */
        int (*release)(void *userdata, const EpdId *seq);
        /* Releases seq with its own DEL journaled; if the journal refuses it, its pages
         * are never handed out again before a restart (the log still gives them to it).
         * For workflow_forget(), whose transition has no record. */
        int (*release_alone)(void *userdata, const EpdId *seq);
        /* 0 if seq is here with all its pages (its page count and tokens per page to
         * *ret_pages, *ret_block_tokens); -ESTALE / -ENOENT if not. */
        int (*check)(void *userdata, const EpdId *seq, size_t *ret_pages, size_t *ret_block_tokens);
        /* Appends one record to the journal (the WAL); durable per its policy on return. */
        int (*journal)(void *userdata, const void *record, size_t len);
        /* Replay: the sequence part of a record, one PUT payload (put) or DEL id (16
         * bytes) at a time, after its workflow part applied. Optional. */
        int (*apply_sequence)(void *userdata, bool put, const void *payload, size_t len);
        void *userdata;
} WorkflowOps;

typedef struct WorkflowBranch {
        uint32_t id;
        bool alive;
        EpdId head;             /* sequence of the latest step */
        uint64_t steps;
        uint32_t *tokens;       /* tokens of the head, for matching */
        size_t n_tokens;
} WorkflowBranch;

typedef struct Workflow {
        EpdId id;
        char id_str[EPD_ID_STRING_MAX];
        uid_t uid;              /* who may attach to it after a restart */
        WorkflowBranch branches[WORKFLOW_BRANCHES_MAX];
        uint32_t n_branches;    /* ids handed out (dropped ones stay, not alive) */
        void *owner;            /* opaque, for the bus glue (its ClientObject) */
} Workflow;

typedef struct WorkflowAdvance {
        EpdId head;             /* the new step's sequence */
        size_t prefix_blocks;   /* pages reused from the predecessor */
        MatchResult match;      /* segments, when asked for */
} WorkflowAdvance;

typedef struct WorkflowManager WorkflowManager;

int workflow_manager_new(const WorkflowOps *ops, unsigned max_workflows, WorkflowManager **ret);
/* Frees the in-memory state only: sequences are not released, nothing is journaled
 * (the daemon is stopping; the WAL keeps the workflows). */
WorkflowManager *workflow_manager_free(WorkflowManager *wm);
DEFINE_TRIVIAL_CLEANUP_FUNC(WorkflowManager *, workflow_manager_free);

/* The tokens the live branches may keep, all workflows together (0: no bound; epdd sets
 * [Limits] WorkflowTokenMemory= / 4). Create, Fork and Advance past it are -EOVERFLOW;
 * replay is not bounded (what was acknowledged comes back). */
void workflow_manager_set_token_budget(WorkflowManager *wm, uint64_t tokens);
uint64_t workflow_manager_tokens(const WorkflowManager *wm);

/* The ops' userdata. */
void *workflow_manager_userdata(const WorkflowManager *wm);

Workflow *workflow_get(WorkflowManager *wm, const char *id_str);
size_t workflow_count(const WorkflowManager *wm);
/* Iteration, as hashmap_iterate. */
bool workflow_iterate(WorkflowManager *wm, size_t *state, Workflow **ret);
/* Whether a live branch of some workflow heads on seq (such a sequence outlives the
 * pages' Attach grace: workflows are attached without their heads). */
bool workflow_heads_on(WorkflowManager *wm, const EpdId *seq);

int workflow_create(WorkflowManager *wm, const EpdId *root, const uint32_t *tokens, size_t n_tokens,
                    uid_t uid, Workflow **ret);
int workflow_fork(WorkflowManager *wm, Workflow *w, uint32_t branch, uint32_t *ret_branch);
/* want_segments: also report moved segments (o: matching options, block size from the
 * sequence when o->block_tokens is 0). ret->match is the caller's (match_result_done). */
int workflow_advance(WorkflowManager *wm, Workflow *w, uint32_t branch, const uint32_t *tokens,
                     size_t n_tokens, bool want_segments, const MatchOptions *o, WorkflowAdvance *ret);
int workflow_merge(WorkflowManager *wm, Workflow *w, uint32_t from, uint32_t into);
int workflow_drop(WorkflowManager *wm, Workflow *w, uint32_t branch);
/* Releases every sequence and forgets the workflow (journaled). */
int workflow_release(WorkflowManager *wm, Workflow *w);
/* The same in memory when the journal refused workflow_release()'s record and nobody
 * is left to retry it (its client is gone, or the attach grace ended): the heads go
 * (each sequence's release journaled or, refused too, its pages quarantined) and so
 * does the workflow, which a restart brings back ownerless (no Release record) to go
 * at the end of that start's attach grace. Kept, it would hold its pages and its slot
 * of the daemon's limit until a restart. */
void workflow_forget(WorkflowManager *wm, Workflow *w);

/* Applies one journaled record (replay). -EBADMSG for a malformed record (its sequence
 * part included: nothing of it is applied); records that do not fit the state (a fork
 * of an unknown workflow) are -ENOENT/-EEXIST and leave the state unchanged, their
 * sequence part not applied either. */
int workflow_apply_record(WorkflowManager *wm, const void *record, size_t len);
/* Emits the whole state as records (compaction): add(userdata, record, len). */
int workflow_snapshot(WorkflowManager *wm, int (*add)(void *userdata, const void *record, size_t len),
                      void *userdata);
