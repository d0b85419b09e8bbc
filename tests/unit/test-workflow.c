/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pages/sequence-record.h"
#include "wal/wal.h"
#include "workflow/workflow.h"
#include "../check-main.h"

#define BT 16 /* tokens per page */

/* A model of the pages subsystem: sequences with a page count, by id. */
typedef struct Store {
        Hashmap *seqs; /* SeqModel* by id bytes */
        unsigned clones, releases, alone_releases;
        bool fail_journal;
        Wal *wal;
} Store;

typedef struct SeqModel {
        EpdId id;
        size_t pages;
} SeqModel;

static SeqModel *store_add(Store *s, size_t pages) {
        SeqModel *m = calloc(1, sizeof *m);
        ck_assert_ptr_nonnull(m);
        ck_assert_int_eq(epd_id_random(&m->id), 0);
        m->pages = pages;
        ck_assert_int_eq(hashmap_put(s->seqs, m->id.bytes, m), 0);
        return m;
}

/* The PUT payload of a model sequence (page ids: 0..pages-1). */
static void *put_record(const SeqModel *m, size_t *ret_len) {
        PageId *pages = calloc(MAX(m->pages, (size_t)1), sizeof *pages);
        ck_assert_ptr_nonnull(pages);
        for (size_t i = 0; i < m->pages; i++)
                pages[i] = (PageId)i;
        *ret_len = sequence_record_put_size(0, (uint32_t)m->pages);
        void *buf = malloc(*ret_len);
        ck_assert_ptr_nonnull(buf);
        sequence_record_put_encode(buf, &m->id, 0, 0, 4096, 1, NULL, 0, pages, (uint32_t)m->pages);
        free(pages);
        return buf;
}

static int op_clone(void *ud, const EpdId *seq, size_t n, EpdId *ret, void **ret_put, size_t *ret_put_len) {
        Store *s = ud;
        SeqModel *m = hashmap_get(s->seqs, seq->bytes);
        if (!m)
                return -ESTALE;
        SeqModel *c = store_add(s, MIN(n, m->pages));
        *ret = c->id;
        *ret_put = put_record(c, ret_put_len);
        s->clones++;
        return 0;
}

static int op_release(void *ud, const EpdId *seq) {
        Store *s = ud;
        SeqModel *m = hashmap_remove(s->seqs, seq->bytes);
        if (!m)
                return -ENOENT;
        free(m);
        s->releases++;
        return 0;
}

/* A release with its own DEL: counted apart (workflow_forget()'s, whose transition has
 * no record). */
static int op_release_alone(void *ud, const EpdId *seq) {
        Store *s = ud;
        int r = op_release(ud, seq);
        if (r >= 0) {
                s->releases--;
                s->alone_releases++;
        }
        return r;
}

static int op_check(void *ud, const EpdId *seq, size_t *pages, size_t *bt) {
        Store *s = ud;
        SeqModel *m = hashmap_get(s->seqs, seq->bytes);
        if (!m)
                return -ESTALE;
        *pages = m->pages;
        *bt = BT;
        return 0;
}

static int op_journal(void *ud, const void *rec, size_t len) {
        Store *s = ud;
        if (s->fail_journal)
                return -EIO;
        if (!s->wal)
                return 0;
        return wal_append(s->wal, WAL_RECORD_WORKFLOW + ((const uint8_t *)rec)[0], rec, len, NULL);
}

/* Replay into a store: the sequence part of the workflow records. */
static int op_apply_sequence(void *ud, bool put, const void *payload, size_t len) {
        Store *s = ud;
        SeqModel *m;
        if (!put) {
                ck_assert_uint_eq(len, 16);
                m = hashmap_remove(s->seqs, payload);
                if (!m)
                        return -ENOENT;
                free(m);
                return 0;
        }
        SequenceRecord rec;
        ck_assert_int_eq(sequence_record_put_parse(payload, len, &rec), 0);
        m = hashmap_get(s->seqs, rec.id.bytes);
        if (!m) {
                m = calloc(1, sizeof *m);
                ck_assert_ptr_nonnull(m);
                m->id = rec.id;
                ck_assert_int_eq(hashmap_put(s->seqs, m->id.bytes, m), 0);
        }
        m->pages = rec.n_pages;
        return 0;
}

static WorkflowOps ops_for(Store *s) {
        return (WorkflowOps){ .clone = op_clone, .release = op_release, .release_alone = op_release_alone,
                              .check = op_check,
                              .journal = op_journal, .apply_sequence = op_apply_sequence, .userdata = s };
}

static void store_init(Store *s) {
        *s = (Store){ .seqs = hashmap_new(HASHMAP_KEY_BYTES, 16) };
        ck_assert_ptr_nonnull(s->seqs);
}

static void store_done(Store *s) {
        SeqModel *m;
        size_t i = 0;
        while (hashmap_iterate(s->seqs, &i, (void **)&m, NULL))
                free(m);
        hashmap_free(s->seqs);
}

static uint32_t *toks(size_t n, uint32_t seed) {
        uint32_t *t = malloc(MAX(n, (size_t)1) * sizeof *t);
        for (size_t i = 0; i < n; i++)
                t[i] = seed * 1000003u + (uint32_t)i * 7919u;
        return t;
}

START_TEST(test_lifecycle) {
        Store s;
        store_init(&s);
        WorkflowOps ops = ops_for(&s);
        WorkflowManager *wm;
        ck_assert_int_eq(workflow_manager_new(&ops, 0, &wm), 0);

        SeqModel *root = store_add(&s, 4);
        uint32_t *t0 = toks(64, 1);
        Workflow *w;
        ck_assert_int_eq(workflow_create(wm, &root->id, t0, 64, 1000, &w), 0);
        ck_assert_uint_eq(workflow_count(wm), 1);
        ck_assert_ptr_eq(workflow_get(wm, w->id_str), w);
        ck_assert_uint_eq(w->n_branches, 1);
        ck_assert(!epd_id_equal(&w->branches[0].head, &root->id)); /* its own clone */

        /* Fork: a clone of the head. */
        uint32_t b1;
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b1), 0);
        ck_assert_uint_eq(b1, 1);
        ck_assert_uint_eq(w->branches[1].n_tokens, 64);
        ck_assert_int_eq(workflow_fork(wm, w, 9, &b1), -ENOENT);

        /* Advance branch 1: the first 40 tokens are the same -> 2 full pages reused,
         * and the predecessor's page 3 reappears at token 80 (aligned). */
        uint32_t *t1 = toks(112, 2);
        memcpy(t1, t0, 40 * sizeof *t1);
        memcpy(t1 + 80, t0 + 48, 16 * sizeof *t1);
        WorkflowAdvance a;
        ck_assert_int_eq(workflow_advance(wm, w, 1, t1, 112, true, NULL, &a), 0);
        ck_assert_uint_eq(a.prefix_blocks, 2);
        ck_assert_uint_eq(a.match.n_segments, 1);
        ck_assert_uint_eq(a.match.segments[0].prev_block, 3);
        ck_assert_uint_eq(a.match.segments[0].new_offset, 80);
        ck_assert(epd_id_equal(&a.head, &w->branches[1].head));
        ck_assert_uint_eq(((SeqModel *)hashmap_get(s.seqs, a.head.bytes))->pages, 2);
        ck_assert_uint_eq(w->branches[1].steps, 1);
        match_result_done(&a.match);
        /* Without segments: the prefix only. */
        ck_assert_int_eq(workflow_advance(wm, w, 1, t1, 100, false, NULL, &a), 0);
        ck_assert_uint_eq(a.prefix_blocks, 2); /* the head has 2 pages */
        ck_assert_uint_eq(a.match.n_segments, 0);

        /* A merge whose source head is gone (its owner released it) is Stale, and
         * branch 0 keeps its head; then 1's head comes back and the merge is made. */
        EpdId h0 = w->branches[0].head, h1 = w->branches[1].head;
        SeqModel *gone = hashmap_remove(s.seqs, h1.bytes);
        ck_assert_ptr_nonnull(gone);
        unsigned releases = s.releases;
        ck_assert_int_eq(workflow_merge(wm, w, 1, 0), -ESTALE);
        ck_assert_ptr_nonnull(hashmap_get(s.seqs, h0.bytes));
        ck_assert(epd_id_equal(&w->branches[0].head, &h0));
        ck_assert(w->branches[1].alive);
        ck_assert_uint_eq(s.releases, releases);
        ck_assert_int_eq(hashmap_put(s.seqs, gone->id.bytes, gone), 0);

        /* Merge 1 into 0, then 0 is the only branch. */
        ck_assert_int_eq(workflow_merge(wm, w, 1, 1), -EINVAL);
        ck_assert_int_eq(workflow_merge(wm, w, 1, 0), 0);
        ck_assert(!w->branches[1].alive);
        ck_assert_uint_eq(w->branches[0].n_tokens, 100);
        ck_assert_int_eq(workflow_drop(wm, w, 1), -ENOENT);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b1), 0);
        ck_assert_uint_eq(b1, 2);
        ck_assert_int_eq(workflow_drop(wm, w, 2), 0);

        /* Release: every sequence the workflow held is gone; only the root remains. */
        ck_assert_int_eq(workflow_release(wm, w), 0);
        ck_assert_uint_eq(workflow_count(wm), 0);
        ck_assert_uint_eq(hashmap_size(s.seqs), 1);
        ck_assert_uint_eq(s.clones, s.releases);
        workflow_manager_free(wm);
        store_done(&s);
        free(t0);
        free(t1);
}
END_TEST

/* The tokens the branches keep count against one budget: a fork keeps a copy of its
 * parent's, an advance replaces its branch's, a drop, a merge and a release give theirs
 * back. Past the budget Create, Fork and Advance are refused (and change nothing);
 * before, 512 calls over one KV page grew epdd by 400 MB. */
START_TEST(test_token_budget) {
        Store s;
        store_init(&s);
        WorkflowOps ops = ops_for(&s);
        WorkflowManager *wm;
        ck_assert_int_eq(workflow_manager_new(&ops, 0, &wm), 0);
        workflow_manager_set_token_budget(wm, 1000);
        SeqModel *root = store_add(&s, 4);
        uint32_t *t = toks(400, 3);
        Workflow *w, *w2;
        uint32_t b;
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 1001, 1000, &w), -EOVERFLOW);
        ck_assert_uint_eq(workflow_count(wm), 0);
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 400, 1000, &w), 0);
        ck_assert_uint_eq(workflow_manager_tokens(wm), 400);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b), 0); /* 800 */
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b), -EOVERFLOW);
        ck_assert_uint_eq(w->n_branches, 2);
        ck_assert_uint_eq(workflow_manager_tokens(wm), 800);
        unsigned clones = s.clones, releases = s.releases;
        /* Advance replaces: 400 -> 600 is 1000 held; 601 would pass. */
        WorkflowAdvance a;
        ck_assert_int_eq(workflow_advance(wm, w, 1, t, 601, false, NULL, &a), -EOVERFLOW);
        ck_assert_uint_eq(s.clones - s.releases, clones - releases); /* nothing left behind */
        uint32_t *t6 = toks(600, 4);
        ck_assert_int_eq(workflow_advance(wm, w, 1, t6, 600, false, NULL, &a), 0);
        ck_assert_uint_eq(workflow_manager_tokens(wm), 1000);
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 1, 1000, &w2), -EOVERFLOW);
        /* Given back: a drop, then a merge (the target's old tokens go). */
        ck_assert_int_eq(workflow_drop(wm, w, 1), 0);
        ck_assert_uint_eq(workflow_manager_tokens(wm), 400);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b), 0);
        ck_assert_int_eq(workflow_merge(wm, w, b, 0), 0);
        ck_assert_uint_eq(workflow_manager_tokens(wm), 400);
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 400, 1000, &w2), 0);
        ck_assert_uint_eq(workflow_manager_tokens(wm), 800);
        ck_assert_int_eq(workflow_release(wm, w), 0);
        ck_assert_int_eq(workflow_release(wm, w2), 0);
        ck_assert_uint_eq(workflow_manager_tokens(wm), 0);
        /* No budget: as before. */
        workflow_manager_set_token_budget(wm, 0);
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 400, 1000, &w), 0);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b), 0);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b), 0);
        ck_assert_uint_eq(workflow_manager_tokens(wm), 1200);
        ck_assert_int_eq(workflow_release(wm, w), 0);
        workflow_manager_free(wm);
        store_done(&s);
        free(t);
        free(t6);
}
END_TEST

/* A daemon without the pages: a named error, never a crash; a failed journal changes
 * nothing and leaks nothing. */
START_TEST(test_missing_pages_and_journal_failure) {
        Store s;
        store_init(&s);
        WorkflowOps ops = ops_for(&s);
        WorkflowManager *wm;
        ck_assert_int_eq(workflow_manager_new(&ops, 2, &wm), 0);

        EpdId nowhere;
        ck_assert_int_eq(epd_id_random(&nowhere), 0);
        Workflow *w;
        ck_assert_int_eq(workflow_create(wm, &nowhere, NULL, 0, 0, &w), -ESTALE);

        SeqModel *root = store_add(&s, 2);
        uint32_t *t = toks(32, 3);
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 32, 0, &w), 0);
        /* The pages of the head vanish (lost, or never restored after a restart). */
        ck_assert_int_eq(op_release(&s, &w->branches[0].head), 0);
        WorkflowAdvance a;
        ck_assert_int_eq(workflow_advance(wm, w, 0, t, 32, true, NULL, &a), -ESTALE);
        uint32_t nb;
        ck_assert_int_eq(workflow_fork(wm, w, 0, &nb), -ESTALE);
        ck_assert_int_eq(workflow_release(wm, w), 0); /* still releasable */

        unsigned before = hashmap_size(s.seqs);
        s.fail_journal = true;
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 32, 0, &w), -EIO);
        ck_assert_uint_eq(workflow_count(wm), 0);
        ck_assert_uint_eq(hashmap_size(s.seqs), before);
        s.fail_journal = false;
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 32, 0, &w), 0);
        s.fail_journal = true;
        ck_assert_int_eq(workflow_fork(wm, w, 0, &nb), -EIO);
        ck_assert_uint_eq(w->n_branches, 1);
        ck_assert_int_eq(workflow_advance(wm, w, 0, t, 20, false, NULL, &a), -EIO);
        ck_assert_uint_eq(w->branches[0].n_tokens, 32);
        ck_assert_int_eq(workflow_drop(wm, w, 0), -EIO);
        ck_assert(w->branches[0].alive);
        ck_assert_uint_eq(hashmap_size(s.seqs), before + 1);
        s.fail_journal = false;

        /* Limits. */
        Workflow *w2;
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 32, 0, &w2), 0);
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 32, 0, &w2), -EDQUOT);
        ck_assert_int_eq(workflow_create(wm, &root->id, t, WORKFLOW_TOKENS_MAX + 1, 0, &w2), -E2BIG);
        for (uint32_t i = 1; i < WORKFLOW_BRANCHES_MAX; i++)
                ck_assert_int_eq(workflow_fork(wm, w, 0, &nb), 0);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &nb), -EDQUOT);

        /* Garbage records are refused, not applied. */
        uint8_t junk[64] = { WORKFLOW_REC_FORK };
        for (size_t n = 0; n < sizeof junk; n++)
                ck_assert_int_lt(workflow_apply_record(wm, junk, n), 0);
        junk[0] = 99;
        ck_assert_int_eq(workflow_apply_record(wm, junk, 20), -EBADMSG);
        workflow_manager_free(wm);
        store_done(&s);
        free(t);
}
END_TEST

/* A release the journal refuses, with nobody left to retry it (the client gone): the
 * workflow goes from memory all the same and its heads with it, so that neither its
 * pages nor its slot of the limit stay until a restart; the heads of dropped branches
 * are not released twice, and no record is written. */
START_TEST(test_forget_when_release_refused) {
        Store s;
        store_init(&s);
        WorkflowOps ops = ops_for(&s);
        WorkflowManager *wm;
        ck_assert_int_eq(workflow_manager_new(&ops, 1, &wm), 0);
        SeqModel *root = store_add(&s, 2);
        uint32_t *t = toks(32, 5);
        Workflow *w;
        uint32_t b1, b2;
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 32, 0, &w), 0);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b1), 0);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &b2), 0);
        ck_assert_int_eq(workflow_drop(wm, w, b1), 0);
        ck_assert(workflow_heads_on(wm, &w->branches[b2].head));
        EpdId head = w->branches[b2].head;
        unsigned releases = s.releases, held = hashmap_size(s.seqs);
        s.fail_journal = true;
        ck_assert_int_eq(workflow_release(wm, w), -EIO);
        ck_assert_uint_eq(workflow_count(wm), 1);
        workflow_forget(wm, w);
        ck_assert_uint_eq(workflow_count(wm), 0);
        /* The two live heads, once each, each with its own DEL (no record covers them). */
        ck_assert_uint_eq(s.releases, releases);
        ck_assert_uint_eq(s.alone_releases, 2);
        ck_assert_uint_eq(hashmap_size(s.seqs), held - 2);
        ck_assert(!workflow_heads_on(wm, &head));
        /* Its slot is free: the limit (1 here) lets another in once the journal takes it. */
        s.fail_journal = false;
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 32, 0, &w), 0);
        ck_assert_int_eq(workflow_release(wm, w), 0);
        workflow_manager_free(wm);
        store_done(&s);
        free(t);
}
END_TEST

static void assert_same(WorkflowManager *a, WorkflowManager *b) {
        ck_assert_uint_eq(workflow_count(a), workflow_count(b));
        size_t it = 0;
        Workflow *w;
        while (workflow_iterate(a, &it, &w)) {
                Workflow *v = workflow_get(b, w->id_str);
                ck_assert_ptr_nonnull(v);
                ck_assert_uint_eq(w->uid, v->uid);
                ck_assert_uint_eq(w->n_branches, v->n_branches);
                for (uint32_t i = 0; i < w->n_branches; i++) {
                        const WorkflowBranch *x = &w->branches[i], *y = &v->branches[i];
                        ck_assert_int_eq(x->alive, y->alive);
                        if (!x->alive)
                                continue;
                        ck_assert(epd_id_equal(&x->head, &y->head));
                        ck_assert_uint_eq(x->steps, y->steps);
                        ck_assert_uint_eq(x->n_tokens, y->n_tokens);
                        ck_assert_int_eq(memcmp(x->tokens, y->tokens, x->n_tokens * 4), 0);
                }
        }
}

/* Replay of the first `limit` log records only (a crash right after record limit). */
static uint64_t replay_limit = UINT64_MAX, replay_seen;

static int replay_apply(void *ud, const WalRecord *r, bool from_snapshot) {
        ck_assert_uint_eq(r->type >> 8, WAL_RECORD_WORKFLOW >> 8);
        if (!from_snapshot && ++replay_seen > replay_limit)
                return 0;
        return workflow_apply_record(ud, r->payload, r->length);
}

static int snap_add(void *ud, const void *rec, size_t len) {
        return wal_snapshot_add(ud, WAL_RECORD_WORKFLOW + WORKFLOW_REC_STATE_BRANCH, rec, len);
}

static int snap_fn(void *ud, WalSnapshot *snap) {
        return workflow_snapshot(ud, snap_add, snap);
}

/* Replays dir into a fresh manager over the fresh store s (which gets the sequence
 * part of the records). */
static WorkflowManager *replayed(const char *dir, Store *s) {
        WorkflowOps ops = ops_for(s);
        WorkflowManager *r;
        Wal *w;
        ck_assert_int_eq(workflow_manager_new(&ops, 0, &r), 0);
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        replay_seen = 0;
        ck_assert_int_eq(wal_replay(w, replay_apply, r), 0);
        wal_free(w);
        return r;
}

/* The replayed store holds exactly the live heads of the replayed workflows, with the
 * page counts the live store has for them (live: NULL to skip that): no sequence
 * without a branch, no branch without its sequence. */
static void assert_heads_only(WorkflowManager *wm, Store *replay, Store *live) {
        size_t heads = 0, it = 0;
        Workflow *w;
        while (workflow_iterate(wm, &it, &w))
                for (uint32_t i = 0; i < w->n_branches; i++) {
                        if (!w->branches[i].alive)
                                continue;
                        heads++;
                        SeqModel *m = hashmap_get(replay->seqs, w->branches[i].head.bytes);
                        ck_assert_msg(m, "workflow %s branch %u heads on a sequence the journal does not have",
                                      w->id_str, i);
                        if (live) {
                                SeqModel *l = hashmap_get(live->seqs, w->branches[i].head.bytes);
                                ck_assert_ptr_nonnull(l);
                                ck_assert_uint_eq(m->pages, l->pages);
                        }
                }
        ck_assert_msg(hashmap_size(replay->seqs) == heads, "%zu sequences replayed, %zu live heads",
                      (size_t)hashmap_size(replay->seqs), heads);
}

/* Random operations journaled to a real WAL; replay (and replay after compaction)
 * rebuilds exactly the same state. */
START_TEST(test_wal_replay_model) {
        char dir[] = "/tmp/test-workflow-XXXXXX";
        ck_assert_ptr_nonnull(mkdtemp(dir));
        Store s;
        store_init(&s);
        WorkflowOps ops = ops_for(&s);
        WorkflowManager *wm;
        ck_assert_int_eq(workflow_manager_new(&ops, 0, &wm), 0);
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_BATCH, &s.wal), 0);
        ck_assert_int_eq(wal_replay(s.wal, replay_apply, wm), 0);

        SeqModel *root = store_add(&s, 8);
        uint64_t x = 5;
        Workflow *ws[8] = {};
        for (int step = 0; step < 600; step++) {
                x = x * 6364136223846793005ULL + 1442695040888963407ULL;
                unsigned k = (unsigned)(x >> 33), wi = k % 8;
                Workflow *w = ws[wi];
                if (!w) {
                        uint32_t *t = toks(k % 200, k);
                        ck_assert_int_eq(workflow_create(wm, &root->id, t, k % 200, k % 3, &ws[wi]), 0);
                        free(t);
                        continue;
                }
                uint32_t b = (k >> 3) % w->n_branches, nb;
                switch ((k >> 8) % 6) {
                case 0:
                        if (w->branches[b].alive && w->n_branches < WORKFLOW_BRANCHES_MAX)
                                ck_assert_int_eq(workflow_fork(wm, w, b, &nb), 0);
                        break;
                case 1:
                case 2:
                        if (w->branches[b].alive) {
                                size_t n = (k >> 12) % 300;
                                uint32_t *t = toks(n, k);
                                memcpy(t, w->branches[b].tokens, MIN(n, w->branches[b].n_tokens) / 2 * 4);
                                WorkflowAdvance a;
                                ck_assert_int_eq(workflow_advance(wm, w, b, t, n, k & 1, NULL, &a), 0);
                                match_result_done(&a.match);
                                free(t);
                        }
                        break;
                case 3: {
                        uint32_t c = (k >> 16) % w->n_branches;
                        if (b != c && w->branches[b].alive && w->branches[c].alive)
                                ck_assert_int_eq(workflow_merge(wm, w, b, c), 0);
                        break;
                }
                case 4:
                        if (w->branches[b].alive)
                                ck_assert_int_eq(workflow_drop(wm, w, b), 0);
                        break;
                default:
                        if ((k >> 20) % 4 == 0) {
                                ck_assert_int_eq(workflow_release(wm, w), 0);
                                ws[wi] = NULL;
                        }
                }
                if (step == 300)
                        ck_assert_int_eq(wal_compact(s.wal, snap_fn, wm), 0);
        }
        ck_assert_int_eq(wal_sync(s.wal), 0);

        /* (The snapshot has the workflows only: their sequences' PUTs are the pages
         * subsystem's part of it, so the store is checked on the log alone.) */
        Store rs;
        store_init(&rs);
        WorkflowManager *r = replayed(dir, &rs);
        assert_same(wm, r);
        assert_same(r, wm);
        workflow_manager_free(r);
        store_done(&rs);

        ck_assert_int_eq(wal_compact(s.wal, snap_fn, wm), 0);
        store_init(&rs);
        r = replayed(dir, &rs);
        assert_same(wm, r);
        assert_same(r, wm);
        workflow_manager_free(r);
        store_done(&rs);

        /* Every sequence in the store is the root or a live head: nothing leaked. */
        size_t heads = 1, it = 0;
        Workflow *w;
        while (workflow_iterate(wm, &it, &w))
                for (uint32_t i = 0; i < w->n_branches; i++)
                        heads += w->branches[i].alive;
        ck_assert_uint_eq(hashmap_size(s.seqs), heads);

        wal_free(s.wal);
        workflow_manager_free(wm);
        store_done(&s);
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* A crash right after any record: every transition carries its sequences in its own
 * record, so the replay of any prefix of the log has exactly one sequence per live
 * branch, none without a branch (docs/wal.md). */
START_TEST(test_cut_after_every_record) {
        char dir[] = "/tmp/test-workflow-XXXXXX";
        ck_assert_ptr_nonnull(mkdtemp(dir));
        Store s;
        store_init(&s);
        WorkflowOps ops = ops_for(&s);
        WorkflowManager *wm;
        ck_assert_int_eq(workflow_manager_new(&ops, 0, &wm), 0);
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &s.wal), 0);
        ck_assert_int_eq(wal_replay(s.wal, replay_apply, wm), 0);

        SeqModel *root = store_add(&s, 8);
        uint32_t *t = toks(100, 9), nb;
        Workflow *w, *w2;
        WorkflowAdvance a;
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 100, 0, &w), 0);
        ck_assert_int_eq(workflow_fork(wm, w, 0, &nb), 0);
        ck_assert_int_eq(workflow_advance(wm, w, 1, t, 60, false, NULL, &a), 0);
        ck_assert_int_eq(workflow_fork(wm, w, 1, &nb), 0);
        ck_assert_int_eq(workflow_merge(wm, w, 2, 0), 0);
        ck_assert_int_eq(workflow_advance(wm, w, 0, t, 90, true, NULL, &a), 0);
        match_result_done(&a.match);
        ck_assert_int_eq(workflow_drop(wm, w, 1), 0);
        ck_assert_int_eq(workflow_create(wm, &root->id, t, 40, 0, &w2), 0);
        ck_assert_int_eq(workflow_fork(wm, w2, 0, &nb), 0);
        ck_assert_int_eq(workflow_release(wm, w), 0);
        ck_assert_int_eq(wal_sync(s.wal), 0);
        uint64_t records = wal_get_stats(s.wal)->appended;
        ck_assert_uint_eq(records, 10);

        for (uint64_t n = 0; n <= records; n++) {
                Store rs;
                store_init(&rs);
                replay_limit = n;
                WorkflowManager *r = replayed(dir, &rs);
                assert_heads_only(r, &rs, n == records ? &s : NULL);
                if (n == records) {
                        assert_same(wm, r);
                        assert_same(r, wm);
                }
                workflow_manager_free(r);
                store_done(&rs);
        }
        replay_limit = UINT64_MAX;

        /* A record of before the sequence part (flags 0) still replays, without one. */
        uint8_t old[4 + 16 + 4] = { WORKFLOW_REC_DROP };
        memcpy(old + 4, w2->id.bytes, 16);
        old[20] = 1;
        ck_assert_int_eq(workflow_apply_record(wm, old, sizeof old), 0);
        ck_assert(!w2->branches[1].alive);
        /* A record whose flags announce a sequence part it lacks is malformed. */
        old[1] = WORKFLOW_REC_F_SEQUENCES;
        ck_assert_int_eq(workflow_apply_record(wm, old, sizeof old), -EBADMSG);

        wal_free(s.wal);
        workflow_manager_free(wm);
        store_done(&s);
        free(t);
        char cmd[128];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        ck_assert_int_eq(system(cmd), 0);
}
END_TEST

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* The pages' Attach grace asks, for each restored sequence nobody re-attached, whether
 * a workflow heads on it. With the largest number of workflows, each of many
 * branches, and as many orphans, the answers for all of them must come at once (a walk
 * over every branch per question took minutes and tripped the watchdog). Also: the
 * answers follow drops, merges and releases. */
#define KEEP_WORKFLOWS WORKFLOWS_MAX_DEFAULT
#define KEEP_BRANCHES 64u
#define KEEP_ASKED 20000u
#define KEEP_BOUND_S 1.5 /* the walk over every branch took ~15 s for these questions */
START_TEST(test_heads_on_many) {
        Store s;
        store_init(&s);
        WorkflowOps ops = ops_for(&s);
        WorkflowManager *wm;
        ck_assert_int_eq(workflow_manager_new(&ops, 0, &wm), 0);
        SeqModel *root = store_add(&s, 1);
        uint32_t t[4] = { 1, 2, 3, 4 }, b;
        Workflow **ws = calloc(KEEP_WORKFLOWS, sizeof *ws);
        ck_assert_ptr_nonnull(ws);
        for (unsigned i = 0; i < KEEP_WORKFLOWS; i++) {
                ck_assert_int_eq(workflow_create(wm, &root->id, t, 4, 1000, &ws[i]), 0);
                for (unsigned j = 1; j < KEEP_BRANCHES; j++)
                        ck_assert_int_eq(workflow_fork(wm, ws[i], 0, &b), 0);
        }
        EpdId *orphans = calloc(KEEP_ASKED, sizeof *orphans);
        ck_assert_ptr_nonnull(orphans);
        for (unsigned i = 0; i < KEEP_ASKED; i++)
                ck_assert_int_eq(epd_id_random(&orphans[i]), 0);

        double start = now_s(), took = 0;
        unsigned asked = 0;
        for (unsigned i = 0; i < KEEP_ASKED && took <= KEEP_BOUND_S; i++) {
                const Workflow *w = ws[(i * 7919u) % KEEP_WORKFLOWS];
                ck_assert(workflow_heads_on(wm, &w->branches[i % KEEP_BRANCHES].head));
                ck_assert(!workflow_heads_on(wm, &orphans[i]));
                asked += 2;
                if (i % 256 == 0)
                        took = now_s() - start;
        }
        took = now_s() - start;
        printf("heads_on: %u questions over %u workflows x %u branches in %.3f s (bound %.1f s)\n", asked,
               KEEP_WORKFLOWS, KEEP_BRANCHES, took, KEEP_BOUND_S);
        ck_assert_msg(took <= KEEP_BOUND_S && asked == 2 * KEEP_ASKED,
                      "%u of %u questions answered in %.3f s, bound %.1f s", asked, 2 * KEEP_ASKED, took,
                      KEEP_BOUND_S);

        /* Dropped and merged-away heads are let go; the merge target's new head kept;
         * a released workflow keeps none. */
        Workflow *w = ws[0];
        EpdId dropped = w->branches[3].head, merged = w->branches[4].head, old_into = w->branches[5].head;
        ck_assert_int_eq(workflow_drop(wm, w, 3), 0);
        ck_assert_int_eq(workflow_merge(wm, w, 4, 5), 0);
        ck_assert(!workflow_heads_on(wm, &dropped));
        ck_assert(!workflow_heads_on(wm, &old_into));
        ck_assert(workflow_heads_on(wm, &merged)); /* branch 5's head now */
        EpdId last = ws[1]->branches[KEEP_BRANCHES - 1].head;
        ck_assert(workflow_heads_on(wm, &last));
        ck_assert_int_eq(workflow_release(wm, ws[1]), 0);
        ck_assert(!workflow_heads_on(wm, &last));

        free(orphans);
        free(ws);
        workflow_manager_free(wm);
        store_done(&s);
}
END_TEST

int main(void) {
        Suite *s = suite_create("workflow");
        TCase *tc = tcase_create("workflow");
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_lifecycle);
        tcase_add_test(tc, test_token_budget);
        tcase_add_test(tc, test_missing_pages_and_journal_failure);
        tcase_add_test(tc, test_forget_when_release_refused);
        tcase_add_test(tc, test_wal_replay_model);
        tcase_add_test(tc, test_cut_after_every_record);
        tcase_add_test(tc, test_heads_on_many);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
