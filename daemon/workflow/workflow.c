/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <endian.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "pages/sequence-record.h"
#include "unaligned.h"
#include "wal/wal.h"
#include "workflow/workflow.h"

struct WorkflowManager {
        WorkflowOps ops;
        Hashmap *workflows; /* Workflow* by id_str */
        unsigned max_workflows;
        /* The live branches' heads (WorkflowBranch* by head id bytes, keys in the
         * branches), built on the first question after a change: the pages' grace asks
         * about every orphan sequence in a row, with no transition between. */
        Hashmap *heads;
        bool heads_fresh; /* built since the last applied record */
        /* Tokens the live branches keep (each branch its head's, a fork a copy of its
         * parent's), against the budget (0: none): a workflow is a few calls, but its
         * tokens are the daemon's memory (docs/scheduler.md, "Workflows"). Replay applies
         * what was acknowledged whatever the budget is now. */
        uint64_t tokens_held, tokens_max;
};

/* ---- records ----
 * u8 op | u8 flags | u16 0 | 16 bytes workflow id | op-specific, little-endian:
 *   CREATE        u32 uid | id seq | u32 n | n x u32 tokens
 *   FORK          u32 parent | u32 branch | id seq
 *   ADVANCE       u32 branch | id seq | u32 n | tokens
 *   MERGE         u32 from | u32 into
 *   DROP          u32 branch
 *   RELEASE       -
 *   STATE_BRANCH  u32 uid | u32 branch | u32 alive | u64 steps | id seq | u32 n | tokens
 * then, with flags WORKFLOW_REC_F_SEQUENCES (every live transition since it exists; not
 * STATE_BRANCH), the sequence part:
 *   u32 n_put | n_put x (u32 len | PUT payload, sequence-record.h) | u32 n_del | n_del x id
 * CREATE, FORK and ADVANCE put exactly the sequence they name (their clone). Records
 * without the flag (older logs) have no sequence part: their sequences have records of
 * their own. */

#define SEQUENCE_PART_MAX WORKFLOW_BRANCHES_MAX

typedef struct Rec {
        uint8_t op;
        EpdId wf;
        uint32_t uid, a, b, alive;
        uint64_t steps;
        EpdId seq;
        uint32_t *tokens; /* owned */
        uint32_t n_tokens;
        /* The sequence part (inside the decoded buffer), when flags has it. */
        bool has_sequences;
        const uint8_t *sequences;
        size_t sequences_len;
} Rec;

typedef struct Buf {
        uint8_t *p;
        size_t n, cap;
        bool oom;
} Buf;

static void put(Buf *b, const void *data, size_t n) {
        if (b->oom)
                return;
        if (b->n + n > b->cap) {
                size_t cap = MAX(b->cap * 2, b->n + n + 64);
                uint8_t *p = realloc(b->p, cap);
                if (!p) {
                        b->oom = true;
                        return;
                }
                b->p = p;
                b->cap = cap;
        }
        memcpy(b->p + b->n, data, n);
        b->n += n;
}

static void put32(Buf *b, uint32_t v) {
        uint8_t x[4];
        unaligned_write_le32(x, v);
        put(b, x, sizeof x);
}

static void put64(Buf *b, uint64_t v) {
        uint8_t x[8];
        unaligned_write_le64(x, v);
        put(b, x, sizeof x);
}

static void put_tokens(Buf *b, const uint32_t *t, size_t n) {
        put32(b, (uint32_t)n);
        for (size_t i = 0; i < n; i++)
                put32(b, t[i]);
}

static void put_header(Buf *b, uint8_t op, uint8_t flags, const EpdId *wf) {
        uint8_t h[4] = { op, flags, 0, 0 };
        put(b, h, 4);
        put(b, wf->bytes, 16);
}

/* The sequence part: the PUT of the sequence the transition made (or none), the DELs of
 * those it lets go of. */
static void put_sequences(Buf *b, const void *put_rec, size_t put_len, const EpdId *dels, size_t n_dels) {
        put32(b, put_rec ? 1 : 0);
        if (put_rec) {
                put32(b, (uint32_t)put_len);
                put(b, put_rec, put_len);
        }
        put32(b, (uint32_t)n_dels);
        for (size_t i = 0; i < n_dels; i++)
                put(b, dels[i].bytes, 16);
}

typedef struct Cursor {
        const uint8_t *p;
        size_t n;
        bool bad;
} Cursor;

static const uint8_t *take(Cursor *c, size_t n) {
        const uint8_t *p = c->p;
        if (c->bad || c->n < n) {
                c->bad = true;
                return NULL;
        }
        c->p += n;
        c->n -= n;
        return p;
}

static uint32_t get32(Cursor *c) {
        const uint8_t *p = take(c, 4);
        return p ? unaligned_read_le32(p) : 0;
}

static uint64_t get64(Cursor *c) {
        const uint8_t *p = take(c, 8);
        return p ? unaligned_read_le64(p) : 0;
}

static void get_id(Cursor *c, EpdId *id) {
        const uint8_t *p = take(c, 16);
        if (p)
                memcpy(id->bytes, p, 16);
}

static int get_tokens(Cursor *c, Rec *r) {
        uint32_t n = get32(c);
        const uint8_t *p;

        if (c->bad || n > WORKFLOW_TOKENS_MAX || c->n / 4 < n)
                return -EBADMSG;
        p = take(c, (size_t)n * 4);
        r->tokens = malloc(MAX((size_t)n, (size_t)1) * sizeof(uint32_t));
        if (!r->tokens)
                return -ENOMEM;
        for (uint32_t i = 0; i < n; i++)
                r->tokens[i] = unaligned_read_le32(p + 4 * i);
        r->n_tokens = n;
        return 0;
}

/* Checks the sequence part at c (and takes it): well-formed PUTs, at most one, naming
 * the record's sequence when it has one; a bounded number of DELs. */
static int sequences_decode(Cursor *c, Rec *r) {
        const uint8_t *start = c->p;
        uint32_t n_put = get32(c);

        if (c->bad || n_put > 1)
                return -EBADMSG;
        for (uint32_t i = 0; i < n_put; i++) {
                uint32_t n = get32(c);
                const uint8_t *p = take(c, n);
                SequenceRecord sr;
                if (!p || sequence_record_put_parse(p, n, &sr) < 0)
                        return -EBADMSG;
                bool names_seq = r->op == WORKFLOW_REC_CREATE || r->op == WORKFLOW_REC_FORK ||
                                 r->op == WORKFLOW_REC_ADVANCE;
                if (!names_seq || !epd_id_equal(&sr.id, &r->seq))
                        return -EBADMSG;
        }
        uint32_t n_del = get32(c);
        if (c->bad || n_del > SEQUENCE_PART_MAX || c->n / 16 < n_del)
                return -EBADMSG;
        (void)take(c, (size_t)n_del * 16);
        r->has_sequences = true;
        r->sequences = start;
        r->sequences_len = (size_t)(c->p - start);
        return 0;
}

static int rec_decode(const void *data, size_t len, Rec *r) {
        Cursor c = { .p = data, .n = len };
        const uint8_t *h;
        int k = 0;

        *r = (Rec){};
        h = take(&c, 4);
        if (!h || (h[1] & ~WORKFLOW_REC_F_SEQUENCES) || h[2] || h[3])
                return -EBADMSG;
        r->op = h[0];
        get_id(&c, &r->wf);
        switch (r->op) {
        case WORKFLOW_REC_CREATE:
                r->uid = get32(&c);
                get_id(&c, &r->seq);
                k = get_tokens(&c, r);
                break;
        case WORKFLOW_REC_FORK:
                r->a = get32(&c);
                r->b = get32(&c);
                get_id(&c, &r->seq);
                break;
        case WORKFLOW_REC_ADVANCE:
                r->a = get32(&c);
                get_id(&c, &r->seq);
                k = get_tokens(&c, r);
                break;
        case WORKFLOW_REC_MERGE:
                r->a = get32(&c);
                r->b = get32(&c);
                break;
        case WORKFLOW_REC_DROP:
                r->a = get32(&c);
                break;
        case WORKFLOW_REC_RELEASE:
                break;
        case WORKFLOW_REC_STATE_BRANCH:
                r->uid = get32(&c);
                r->a = get32(&c);
                r->alive = get32(&c);
                r->steps = get64(&c);
                get_id(&c, &r->seq);
                k = get_tokens(&c, r);
                break;
        default:
                return -EBADMSG;
        }
        if (k == 0 && (h[1] & WORKFLOW_REC_F_SEQUENCES))
                k = r->op == WORKFLOW_REC_STATE_BRANCH || c.bad ? -EBADMSG : sequences_decode(&c, r);
        if (k == 0 && (c.bad || c.n != 0))
                k = -EBADMSG;
        if (k == 0 && (r->a >= WORKFLOW_BRANCHES_MAX || r->b >= WORKFLOW_BRANCHES_MAX || r->alive > 1))
                k = -EBADMSG;
        if (k < 0) {
                free(r->tokens);
                r->tokens = NULL;
        }
        return k;
}

/* ---- state ---- */

static Workflow *workflow_free_one(Workflow *w) {
        if (!w)
                return NULL;
        for (uint32_t i = 0; i < w->n_branches; i++)
                free(w->branches[i].tokens);
        free(w);
        return NULL;
}

int workflow_manager_new(const WorkflowOps *ops, unsigned max_workflows, WorkflowManager **ret) {
        WorkflowManager *wm;

        if (!ops || !ops->clone || !ops->release || !ops->check)
                return -EINVAL;
        wm = calloc(1, sizeof *wm);
        if (!wm)
                return -ENOMEM;
        wm->ops = *ops;
        wm->max_workflows = max_workflows > 0 ? max_workflows : WORKFLOWS_MAX_DEFAULT;
        wm->workflows = hashmap_new(HASHMAP_KEY_STRING, 0);
        if (!wm->workflows) {
                free(wm);
                return -ENOMEM;
        }
        *ret = wm;
        return 0;
}

void workflow_manager_set_token_budget(WorkflowManager *wm, uint64_t tokens) {
        wm->tokens_max = tokens;
}

uint64_t workflow_manager_tokens(const WorkflowManager *wm) {
        return wm->tokens_held;
}

/* Whether the live branches may keep `more` tokens besides those of `less` that go. */
static int token_room(const WorkflowManager *wm, uint64_t more, uint64_t less) {
        uint64_t held = wm->tokens_held - MIN(wm->tokens_held, less);
        return wm->tokens_max > 0 && held + more > wm->tokens_max ? -EOVERFLOW : 0;
}

WorkflowManager *workflow_manager_free(WorkflowManager *wm) {
        Workflow *w;
        size_t i = 0;

        if (!wm)
                return NULL;
        while (hashmap_iterate(wm->workflows, &i, (void **)&w, NULL))
                workflow_free_one(w);
        hashmap_free(wm->workflows);
        hashmap_free(wm->heads);
        free(wm);
        return NULL;
}

void *workflow_manager_userdata(const WorkflowManager *wm) {
        return wm->ops.userdata;
}

Workflow *workflow_get(WorkflowManager *wm, const char *id_str) {
        return id_str ? hashmap_get(wm->workflows, id_str) : NULL;
}

size_t workflow_count(const WorkflowManager *wm) {
        return hashmap_size(wm->workflows);
}

bool workflow_iterate(WorkflowManager *wm, size_t *state, Workflow **ret) {
        return hashmap_iterate(wm->workflows, state, (void **)ret, NULL);
}

static int heads_build(WorkflowManager *wm) {
        Workflow *w;
        size_t it = 0;
        int k;

        if (!wm->heads && !(wm->heads = hashmap_new(HASHMAP_KEY_BYTES, sizeof(EpdId))))
                return -ENOMEM;
        hashmap_clear(wm->heads);
        while (workflow_iterate(wm, &it, &w))
                for (uint32_t b = 0; b < w->n_branches; b++) {
                        WorkflowBranch *br = &w->branches[b];
                        if (!br->alive)
                                continue;
                        k = hashmap_put(wm->heads, br->head.bytes, br);
                        if (k < 0 && k != -EEXIST) {
                                hashmap_clear(wm->heads);
                                return k;
                        }
                }
        wm->heads_fresh = true;
        return 0;
}

bool workflow_heads_on(WorkflowManager *wm, const EpdId *seq) {
        Workflow *w;
        size_t it = 0;

        if (wm->heads_fresh || heads_build(wm) >= 0)
                return hashmap_contains(wm->heads, seq->bytes);
        /* No memory for the set: the walk, slow but the same answer. */
        while (workflow_iterate(wm, &it, &w))
                for (uint32_t b = 0; b < w->n_branches; b++)
                        if (w->branches[b].alive && epd_id_equal(&w->branches[b].head, seq))
                                return true;
        return false;
}

static Workflow *lookup(WorkflowManager *wm, const EpdId *id) {
        char s[EPD_ID_STRING_MAX];
        return hashmap_get(wm->workflows, epd_id_to_string(id, s));
}

static WorkflowBranch *branch_get(Workflow *w, uint32_t b) {
        return b < w->n_branches && w->branches[b].alive ? &w->branches[b] : NULL;
}

/* What applying a record allocates, made before it is journaled: after the journal the
 * record must apply, or the log holds what memory does not (a refused Fork's branch
 * replayed over the acknowledged retry's). */
typedef struct Prep {
        Workflow *created; /* CREATE (or a first STATE_BRANCH): the new workflow, already in the map */
        uint32_t *tokens;  /* FORK: the parent's tokens, copied */
} Prep;

static int rec_prepare(WorkflowManager *wm, const Rec *r, Prep *p) {
        Workflow *w = lookup(wm, &r->wf);
        const WorkflowBranch *parent;
        int k;

        *p = (Prep){};
        switch (r->op) {
        case WORKFLOW_REC_CREATE:
        case WORKFLOW_REC_STATE_BRANCH:
                if (r->op == WORKFLOW_REC_CREATE && w)
                        return -EEXIST;
                if (w)
                        return 0;
                if (hashmap_size(wm->workflows) >= wm->max_workflows)
                        return -EDQUOT;
                w = calloc(1, sizeof *w);
                if (!w)
                        return -ENOMEM;
                w->id = r->wf;
                epd_id_to_string(&w->id, w->id_str);
                w->uid = r->uid;
                k = hashmap_put(wm->workflows, w->id_str, w);
                if (k < 0) {
                        free(w);
                        return k;
                }
                p->created = w;
                return 0;
        case WORKFLOW_REC_FORK:
                if (!w || !(parent = branch_get(w, r->a)))
                        return -ENOENT;
                if (r->b != w->n_branches)
                        return -EEXIST;
                p->tokens = malloc(MAX(parent->n_tokens, (size_t)1) * sizeof *p->tokens);
                if (!p->tokens)
                        return -ENOMEM;
                memcpy(p->tokens, parent->tokens, parent->n_tokens * sizeof *p->tokens);
                return 0;
        default:
                return 0;
        }
}

/* A prepared record that is not applied after all (its journal refused it). */
static void prep_undo(WorkflowManager *wm, Prep *p) {
        if (p->created) {
                hashmap_remove(wm->workflows, p->created->id_str);
                free(p->created);
        }
        free(p->tokens);
        *p = (Prep){};
}

/* Applies a decoded and prepared record, taking its tokens and what rec_prepare()
 * allocated: nothing here allocates. Checks consistency first and changes nothing on
 * error. The live operations validate the same things before journaling, so after a
 * successful journal this cannot fail. */
static int rec_apply(WorkflowManager *wm, Rec *r, Prep *p) {
        Workflow *w = lookup(wm, &r->wf);
        WorkflowBranch *b, *into;
        int k = 0;

        wm->heads_fresh = false; /* its keys may point into freed branches */
        switch (r->op) {
        case WORKFLOW_REC_CREATE:
        case WORKFLOW_REC_STATE_BRANCH:
                if (!w || (r->op == WORKFLOW_REC_CREATE && w != p->created)) {
                        k = w ? -EEXIST : -ENOENT;
                        break;
                }
                p->created = NULL; /* in the map, and now applied */
                uint32_t bi = r->op == WORKFLOW_REC_CREATE ? 0 : r->a;
                b = &w->branches[bi];
                free(b->tokens);
                wm->tokens_held -= MIN(wm->tokens_held, (uint64_t)b->n_tokens);
                wm->tokens_held += r->n_tokens;
                *b = (WorkflowBranch){ .id = bi, .alive = r->op == WORKFLOW_REC_CREATE || r->alive,
                                       .head = r->seq, .steps = r->steps,
                                       .tokens = TAKE_PTR(r->tokens), .n_tokens = r->n_tokens };
                w->n_branches = MAX(w->n_branches, bi + 1);
                break;
        case WORKFLOW_REC_FORK:
                if (!p->tokens) {
                        k = -EINVAL; /* not prepared (rec_prepare() makes the copy) */
                        break;
                }
                if (!w || !branch_get(w, r->a)) {
                        k = -ENOENT;
                        break;
                }
                if (r->b != w->n_branches) {
                        k = -EEXIST;
                        break;
                }
                b = &w->branches[r->b];
                const WorkflowBranch *parent = &w->branches[r->a];
                wm->tokens_held += parent->n_tokens;
                *b = (WorkflowBranch){ .id = r->b, .alive = true, .head = r->seq, .steps = parent->steps,
                                       .tokens = TAKE_PTR(p->tokens), .n_tokens = parent->n_tokens };
                w->n_branches++;
                break;
        case WORKFLOW_REC_ADVANCE:
                if (!w || !(b = branch_get(w, r->a))) {
                        k = -ENOENT;
                        break;
                }
                free(b->tokens);
                wm->tokens_held -= MIN(wm->tokens_held, (uint64_t)b->n_tokens);
                wm->tokens_held += r->n_tokens;
                b->tokens = TAKE_PTR(r->tokens);
                b->n_tokens = r->n_tokens;
                b->head = r->seq;
                b->steps++;
                break;
        case WORKFLOW_REC_MERGE:
                if (!w || !(b = branch_get(w, r->a)) || !(into = branch_get(w, r->b)) || r->a == r->b) {
                        k = -ENOENT;
                        break;
                }
                free(into->tokens);
                wm->tokens_held -= MIN(wm->tokens_held, (uint64_t)into->n_tokens);
                into->tokens = TAKE_PTR(b->tokens);
                into->n_tokens = b->n_tokens;
                into->head = b->head;
                into->steps = MAX(into->steps, b->steps) + 1;
                b->alive = false;
                b->n_tokens = 0;
                break;
        case WORKFLOW_REC_DROP:
                if (!w || !(b = branch_get(w, r->a))) {
                        k = -ENOENT;
                        break;
                }
                b->alive = false;
                free(b->tokens);
                wm->tokens_held -= MIN(wm->tokens_held, (uint64_t)b->n_tokens);
                b->tokens = NULL;
                b->n_tokens = 0;
                break;
        case WORKFLOW_REC_RELEASE:
                if (!w) {
                        k = -ENOENT;
                        break;
                }
                for (uint32_t i = 0; i < w->n_branches; i++)
                        wm->tokens_held -= MIN(wm->tokens_held, (uint64_t)w->branches[i].n_tokens);
                hashmap_remove(wm->workflows, w->id_str);
                workflow_free_one(w);
                break;
        default:
                k = -EBADMSG;
        }
        free(r->tokens);
        r->tokens = NULL;
        prep_undo(wm, p); /* what this record did not take (on an error only) */
        return k;
}

/* Replay of a record's sequence part, after its workflow part applied: the clone's
 * PUT, then the DELs. A DEL of a sequence that is not there (gone with its arena's
 * memory, or released by its client first) is no error. */
static int sequences_apply(WorkflowManager *wm, const Rec *r) {
        Cursor c = { .p = r->sequences, .n = r->sequences_len };
        int ret = 0;

        if (!wm->ops.apply_sequence)
                return 0;
        for (uint32_t i = 0, n_put = get32(&c); i < n_put; i++) {
                uint32_t n = get32(&c);
                const uint8_t *p = take(&c, n);
                int k = wm->ops.apply_sequence(wm->ops.userdata, true, p, n);
                if (k < 0 && ret == 0)
                        ret = k;
        }
        for (uint32_t i = 0, n_del = get32(&c); i < n_del; i++) {
                int k = wm->ops.apply_sequence(wm->ops.userdata, false, take(&c, 16), 16);
                if (k < 0 && k != -ENOENT && ret == 0)
                        ret = k;
        }
        return ret;
}

int workflow_apply_record(WorkflowManager *wm, const void *record, size_t len) {
        Prep p;
        Rec r;
        int k = rec_decode(record, len, &r);
        if (k < 0)
                return k;
        k = rec_prepare(wm, &r, &p);
        if (k < 0) {
                free(r.tokens);
                return k;
        }
        k = rec_apply(wm, &r, &p);
        if (k < 0 || !r.has_sequences)
                return k;
        return sequences_apply(wm, &r);
}

/* Journal, then apply. The record is decoded and prepared (every allocation its
 * applying needs made) before the journal, so that nothing but a consistency bug can
 * fail after it. A prepared Create's workflow is in the map, without branches, until it
 * applies: the journal's append only queues the record (no snapshot or iteration of
 * the workflows happens inside it), so nothing sees it half made. */
static int commit(WorkflowManager *wm, Buf *b) {
        Prep p = {};
        Rec r;
        int k;

        if (b->oom) {
                free(b->p);
                return -ENOMEM;
        }
        if (b->n > WAL_RECORD_PAYLOAD_MAX) {
                /* The transition and its sequence part do not fit one record. */
                free(b->p);
                return -EDQUOT;
        }
        k = rec_decode(b->p, b->n, &r);
        if (k < 0) {
                free(b->p);
                return k;
        }
        k = rec_prepare(wm, &r, &p);
        if (k >= 0 && wm->ops.journal) {
                k = wm->ops.journal(wm->ops.userdata, b->p, b->n);
                if (k < 0)
                        prep_undo(wm, &p);
        }
        free(b->p);
        if (k < 0) {
                free(r.tokens);
                return k;
        }
        k = rec_apply(wm, &r, &p);
        if (k < 0)
                log_error_errno(k, "Workflow record journaled but not applicable: %m");
        return k;
}

/* Whether seq is on this daemon (1) or not (0): only those get a DEL. */
static size_t present(WorkflowManager *wm, const EpdId *seq) {
        size_t pages, bt;
        return wm->ops.check(wm->ops.userdata, seq, &pages, &bt) >= 0 ? 1 : 0;
}

static void release_seq(WorkflowManager *wm, const EpdId *seq) {
        int k = wm->ops.release(wm->ops.userdata, seq);
        if (k < 0 && k != -ENOENT) {
                char s[EPD_ID_STRING_MAX];
                log_warning_errno(k, "Failed to release sequence %s of a workflow: %m", epd_id_to_string(seq, s));
        }
}

int workflow_create(WorkflowManager *wm, const EpdId *root, const uint32_t *tokens, size_t n_tokens,
                    uid_t uid, Workflow **ret) {
        EpdId id, seq;
        size_t pages, bt, put_len = 0;
        void *put_rec = NULL;
        Buf b = {};
        int k;

        if (!root || (n_tokens > 0 && !tokens))
                return -EINVAL;
        if (n_tokens > WORKFLOW_TOKENS_MAX)
                return -E2BIG;
        if (hashmap_size(wm->workflows) >= wm->max_workflows)
                return -EDQUOT;
        k = token_room(wm, n_tokens, 0);
        if (k < 0)
                return k;
        k = wm->ops.check(wm->ops.userdata, root, &pages, &bt);
        if (k < 0)
                return k;
        k = epd_id_random(&id);
        if (k < 0)
                return k;
        k = wm->ops.clone(wm->ops.userdata, root, SIZE_MAX, &seq, &put_rec, &put_len);
        if (k < 0)
                return k;
        put_header(&b, WORKFLOW_REC_CREATE, WORKFLOW_REC_F_SEQUENCES, &id);
        put32(&b, (uint32_t)uid);
        put(&b, seq.bytes, 16);
        put_tokens(&b, tokens, n_tokens);
        put_sequences(&b, put_rec, put_len, NULL, 0);
        free(put_rec);
        k = commit(wm, &b);
        if (k < 0) {
                release_seq(wm, &seq);
                return k;
        }
        if (ret)
                *ret = lookup(wm, &id);
        return 0;
}

int workflow_fork(WorkflowManager *wm, Workflow *w, uint32_t branch, uint32_t *ret_branch) {
        WorkflowBranch *p = branch_get(w, branch);
        size_t pages, bt, put_len = 0;
        void *put_rec = NULL;
        EpdId seq;
        Buf b = {};
        int k;

        if (!p)
                return -ENOENT;
        if (w->n_branches >= WORKFLOW_BRANCHES_MAX)
                return -EDQUOT;
        k = token_room(wm, p->n_tokens, 0); /* the fork keeps a copy of its parent's */
        if (k < 0)
                return k;
        k = wm->ops.check(wm->ops.userdata, &p->head, &pages, &bt);
        if (k < 0)
                return k;
        k = wm->ops.clone(wm->ops.userdata, &p->head, SIZE_MAX, &seq, &put_rec, &put_len);
        if (k < 0)
                return k;
        uint32_t nb = w->n_branches;
        put_header(&b, WORKFLOW_REC_FORK, WORKFLOW_REC_F_SEQUENCES, &w->id);
        put32(&b, branch);
        put32(&b, nb);
        put(&b, seq.bytes, 16);
        put_sequences(&b, put_rec, put_len, NULL, 0);
        free(put_rec);
        k = commit(wm, &b);
        if (k < 0) {
                release_seq(wm, &seq);
                return k;
        }
        if (ret_branch)
                *ret_branch = nb;
        return 0;
}

int workflow_advance(WorkflowManager *wm, Workflow *w, uint32_t branch, const uint32_t *tokens,
                     size_t n_tokens, bool want_segments, const MatchOptions *o, WorkflowAdvance *ret) {
        WorkflowBranch *p = branch_get(w, branch);
        MatchOptions mo = o ? *o : (MatchOptions){};
        MatchResult m = {};
        size_t pages, bt, put_len = 0;
        void *put_rec = NULL;
        EpdId seq, old;
        Buf b = {};
        int k;

        if (!p)
                return -ENOENT;
        if ((n_tokens > 0 && !tokens) || !ret)
                return -EINVAL;
        if (n_tokens > WORKFLOW_TOKENS_MAX)
                return -E2BIG;
        k = token_room(wm, n_tokens, p->n_tokens); /* the branch's tokens are replaced */
        if (k < 0)
                return k;
        /* The prototype crashed here when its state layer was missing: name it instead. */
        k = wm->ops.check(wm->ops.userdata, &p->head, &pages, &bt);
        if (k < 0)
                return k;
        if (mo.block_tokens == 0)
                mo.block_tokens = bt;
        if (mo.block_tokens == 0)
                return -EINVAL;
        /* Prefix only, unless segments were asked for: then the full match. */
        if (want_segments)
                k = workflow_match(p->tokens, p->n_tokens, tokens, n_tokens, &mo, &m);
        else {
                /* A scan of the common prefix alone: no table, no segments. */
                size_t lim = MIN(p->n_tokens, n_tokens), i = 0;
                while (i < lim && p->tokens[i] == tokens[i])
                        i++;
                m.prefix_blocks = i / mo.block_tokens;
                k = 0;
        }
        if (k < 0)
                return k;
        /* Only pages that the predecessor's sequence really holds. */
        m.prefix_blocks = MIN(m.prefix_blocks, pages);
        k = wm->ops.clone(wm->ops.userdata, &p->head, m.prefix_blocks, &seq, &put_rec, &put_len);
        if (k < 0) {
                match_result_done(&m);
                return k;
        }
        /* One record: the new head (its PUT), the step, the old head's release (DEL). */
        old = p->head;
        put_header(&b, WORKFLOW_REC_ADVANCE, WORKFLOW_REC_F_SEQUENCES, &w->id);
        put32(&b, branch);
        put(&b, seq.bytes, 16);
        put_tokens(&b, tokens, n_tokens);
        put_sequences(&b, put_rec, put_len, &old, 1);
        free(put_rec);
        k = commit(wm, &b);
        if (k < 0) {
                release_seq(wm, &seq);
                match_result_done(&m);
                return k;
        }
        release_seq(wm, &old);
        *ret = (WorkflowAdvance){ .head = seq, .prefix_blocks = m.prefix_blocks, .match = m };
        return 0;
}

int workflow_merge(WorkflowManager *wm, Workflow *w, uint32_t from, uint32_t into) {
        WorkflowBranch *f = branch_get(w, from), *t = branch_get(w, into);
        EpdId old;
        Buf b = {};
        int k;

        if (!f || !t)
                return -ENOENT;
        if (from == into)
                return -EINVAL;
        /* As Fork and Advance: the head that becomes into's must be here (its owner may
         * have released it), or the merge would release into's KV for a head that is
         * gone and leave both branches on it. */
        size_t pages, bt;
        k = wm->ops.check(wm->ops.userdata, &f->head, &pages, &bt);
        if (k < 0)
                return k;
        old = t->head;
        put_header(&b, WORKFLOW_REC_MERGE, WORKFLOW_REC_F_SEQUENCES, &w->id);
        put32(&b, from);
        put32(&b, into);
        put_sequences(&b, NULL, 0, &old, present(wm, &old));
        k = commit(wm, &b);
        if (k < 0)
                return k;
        release_seq(wm, &old);
        return 0;
}

int workflow_drop(WorkflowManager *wm, Workflow *w, uint32_t branch) {
        WorkflowBranch *p = branch_get(w, branch);
        EpdId old;
        Buf b = {};
        int k;

        if (!p)
                return -ENOENT;
        old = p->head;
        put_header(&b, WORKFLOW_REC_DROP, WORKFLOW_REC_F_SEQUENCES, &w->id);
        put32(&b, branch);
        put_sequences(&b, NULL, 0, &old, present(wm, &old));
        k = commit(wm, &b);
        if (k < 0)
                return k;
        release_seq(wm, &old);
        return 0;
}

int workflow_release(WorkflowManager *wm, Workflow *w) {
        EpdId heads[WORKFLOW_BRANCHES_MAX];
        size_t n = 0;
        Buf b = {};
        int k;

        for (uint32_t i = 0; i < w->n_branches; i++)
                if (w->branches[i].alive)
                        heads[n++] = w->branches[i].head;
        /* The DELs of the heads still here (a departing client's may be gone already). */
        EpdId dels[WORKFLOW_BRANCHES_MAX];
        size_t n_dels = 0;
        for (size_t i = 0; i < n; i++)
                if (present(wm, &heads[i]))
                        dels[n_dels++] = heads[i];
        put_header(&b, WORKFLOW_REC_RELEASE, WORKFLOW_REC_F_SEQUENCES, &w->id);
        put_sequences(&b, NULL, 0, dels, n_dels);
        k = commit(wm, &b);
        if (k < 0)
                return k;
        for (size_t i = 0; i < n; i++)
                release_seq(wm, &heads[i]);
        return 0;
}

void workflow_forget(WorkflowManager *wm, Workflow *w) {
        EpdId heads[WORKFLOW_BRANCHES_MAX];
        size_t n = 0;

        for (uint32_t i = 0; i < w->n_branches; i++)
                if (w->branches[i].alive)
                        heads[n++] = w->branches[i].head;
        wm->heads_fresh = false;
        for (uint32_t i = 0; i < w->n_branches; i++)
                wm->tokens_held -= MIN(wm->tokens_held, (uint64_t)w->branches[i].n_tokens);
        hashmap_remove(wm->workflows, w->id_str);
        workflow_free_one(w);
        /* No record says the heads went (the Release's was refused, or could not be
         * built): each goes with its own DEL, or, refused too, its pages stay out of use
         * until a restart (which brings the workflow and its heads back). Released
         * unjournaled, their pages went to others while the log still gave them to the
         * heads. */
        for (size_t i = 0; i < n; i++) {
                int k = wm->ops.release_alone ? wm->ops.release_alone(wm->ops.userdata, &heads[i]) : -EOPNOTSUPP;
                if (k < 0 && k != -ENOENT) {
                        char s[EPD_ID_STRING_MAX];
                        log_warning_errno(k, "Failed to release sequence %s of a forgotten workflow: %m",
                                          epd_id_to_string(&heads[i], s));
                }
        }
}

int workflow_snapshot(WorkflowManager *wm, int (*add)(void *userdata, const void *record, size_t len),
                      void *userdata) {
        Workflow *w;
        size_t it = 0;
        int k;

        while (hashmap_iterate(wm->workflows, &it, (void **)&w, NULL))
                for (uint32_t i = 0; i < w->n_branches; i++) {
                        const WorkflowBranch *br = &w->branches[i];
                        Buf b = {};

                        put_header(&b, WORKFLOW_REC_STATE_BRANCH, 0, &w->id);
                        put32(&b, (uint32_t)w->uid);
                        put32(&b, i);
                        put32(&b, br->alive);
                        put64(&b, br->steps);
                        put(&b, br->head.bytes, 16);
                        put_tokens(&b, br->tokens, br->n_tokens);
                        if (b.oom) {
                                free(b.p);
                                return -ENOMEM;
                        }
                        k = add(userdata, b.p, b.n);
                        free(b.p);
                        if (k < 0)
                                return k;
                }
        return 0;
}
