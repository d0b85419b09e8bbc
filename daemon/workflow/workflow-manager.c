/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "pages/page-manager.h"
#include "pages/sequence-record.h"
#include "wal/wal-manager.h"
#include "workflow/workflow-manager.h"


typedef struct Binding {
        ClientObject object;
        Manager *m;
        Workflow *w;
} Binding;

typedef struct Glue {
        WorkflowCall call;
} Glue;

static Glue *glue_of(Manager *m) {
        return m->workflows ? workflow_manager_userdata(m->workflows) : NULL;
}

/* The ops' userdata is the Glue; one WorkflowManager per Manager. */
/* The clone is registered with its own journaling held back: its PUT goes into the
 * workflow transition's record (workflow.h). */
static int op_clone(void *userdata, const EpdId *seq, size_t n_pages, EpdId *ret, void **ret_put,
                    size_t *ret_put_len) {
        Glue *g = userdata;
        Manager *m = g->call.m;
        char id[EPD_ID_STRING_MAX];
        Sequence *s, *c;
        int r;

        if (!m->page_manager)
                return -ESTALE;
        s = page_manager_get(m->page_manager, epd_id_to_string(seq, id));
        if (!s)
                return -ESTALE;
        if (!g->call.client)
                return -EPERM;
        Arena *a = page_manager_sequence_arena(m->page_manager, s);
        if (!a)
                return -ESTALE;
        r = sequence_clone(s, &c);
        if (r < 0)
                return r;
        if (n_pages < sequence_size(c)) {
                r = sequence_truncate(c, n_pages);
                if (r < 0) {
                        sequence_free(c);
                        return r;
                }
        }
        m->page_manager->journal_held = true;
        r = page_manager_register(m->page_manager, c, g->call.client, a);
        m->page_manager->journal_held = false;
        if (r < 0) {
                sequence_free(c);
                return r;
        }
        r = page_manager_sequence_record(c, ret_put, ret_put_len);
        if (r < 0) {
                m->page_manager->journal_held = true;
                page_manager_release(c); /* never journaled */
                m->page_manager->journal_held = false;
                return r;
        }
        *ret = c->id;
        return 0;
}

static Sequence *sequence_of(Glue *g, const EpdId *seq) {
        char id[EPD_ID_STRING_MAX];
        return g->call.m->page_manager ? page_manager_get(g->call.m->page_manager, epd_id_to_string(seq, id)) : NULL;
}

static int op_release(void *userdata, const EpdId *seq) {
        Glue *g = userdata;
        Sequence *s = sequence_of(g, seq);
        if (!s)
                return -ENOENT;
        /* Its DEL is in the transition's record (or it was never journaled). */
        g->call.m->page_manager->journal_held = true;
        page_manager_release(s);
        g->call.m->page_manager->journal_held = false;
        /* That record was appended before the transition applied: the pages freed now
         * are covered by the last LSN (not by whatever a later write appends). */
        page_manager_take_frees(g->call.m->page_manager);
        return 0;
}

static int op_release_alone(void *userdata, const EpdId *seq) {
        Sequence *s = sequence_of(userdata, seq);
        if (!s)
                return -ENOENT;
        /* Its own DEL; a refused one leaves its pages marked never settled. */
        page_manager_release(s);
        return 0;
}

static int op_check(void *userdata, const EpdId *seq, size_t *ret_pages, size_t *ret_block_tokens) {
        Glue *g = userdata;
        Sequence *s = sequence_of(g, seq);
        if (!s)
                return -ESTALE;
        *ret_pages = sequence_size(s);
        /* The caller's tokens per block; 0 when it registered no KV layout (Advance then
         * refuses: a guessed block size would share pages of other tokens). */
        *ret_block_tokens = g->call.block_tokens;
        return 0;
}

static int op_journal(void *userdata, const void *record, size_t len) {
        Glue *g = userdata;
        const uint8_t *p = record;
        return wal_manager_append(g->call.m, (uint16_t)(WAL_RECORD_WORKFLOW + p[0]), record, len);
}

/* Replay: a PUT or DEL of a workflow record's sequence part. */
static int op_apply_sequence(void *userdata, bool put, const void *payload, size_t len) {
        Glue *g = userdata;
        PageManager *pm = g->call.m->page_manager;
        if (!pm)
                return 0;
        return page_manager_apply_record(pm, WAL_RECORD_SEQUENCE + (put ? SEQUENCE_REC_PUT : SEQUENCE_REC_DEL), payload,
                                         len);
}

static void binding_release(ClientObject *o) {
        Binding *b = container_of(o, Binding, object);
        Manager *m = b->m;
        Workflow *w = b->w;

        client_object_unlink(o);
        w->owner = NULL;
        free(b);
        /* epdd is stopping (cleanly, its loop finished, or after the loop failed): the
         * workflow stays in the WAL, for its client to Attach to after the restart. */
        if (m->stopping || sd_event_get_state(m->event) == SD_EVENT_FINISHED)
                return;
        /* The client is gone: so is its workflow (journaled like an explicit Release). */
        workflows_set_call(m, &(WorkflowCall){ .m = m });
        int r = workflow_release(m->workflows, w);
        if (r < 0) {
                log_warning_errno(r, "Cannot journal the release of workflow %s of a departed client (%m): "
                                  "released in memory; a restart brings it back until its attach grace ends.",
                                  w->id_str);
                workflow_forget(m->workflows, w);
        }
}

int workflows_bind(Manager *m, Workflow *w, Client *c) {
        Binding *b;
        int r;

        if (w->owner)
                return -EBUSY;
        b = calloc(1, sizeof *b);
        if (!b)
                return -ENOMEM;
        b->m = m;
        b->w = w;
        r = client_object_link(c, &b->object, CLIENT_OBJECT_WORKFLOW, binding_release);
        if (r < 0) {
                free(b);
                return r;
        }
        w->owner = b;
        return 0;
}

Client *workflows_owner(Workflow *w) {
        Binding *b = w->owner;
        return b ? b->object.owner : NULL;
}

void workflows_unbind(Workflow *w) {
        Binding *b = w->owner;
        if (b) {
                client_object_unlink(&b->object);
                free(b);
                w->owner = NULL;
        }
}

static void unbind_all(Manager *m) {
        Workflow *w;
        size_t it = 0;
        while (workflow_iterate(m->workflows, &it, &w))
                workflows_unbind(w);
}

void workflows_set_call(Manager *m, const WorkflowCall *call) {
        Glue *g = glue_of(m);
        if (g)
                g->call = *call;
}

/* A live branch that heads on a sequence keeps it past the pages' attach grace. */
static bool keeps_sequence(void *userdata, const EpdId *id) {
        Manager *m = userdata;
        return m->workflows && workflow_heads_on(m->workflows, id);
}

/* The pages' attach grace ended: workflows restored at start that no client attached
 * go (journaled as a Release), their heads with them; or they and the pages their
 * heads hold would stay for good, and with them their slots of the daemon's limit. */
static void workflows_grace_ends(void *userdata) {
        Manager *m = userdata;
        Workflow *w;
        size_t it = 0, n = 0, k = 0;
        if (!m->workflows || workflow_count(m->workflows) == 0)
                return;
        _cleanup_(freep) Workflow **v = calloc(workflow_count(m->workflows), sizeof *v);
        if (!v) {
                log_warning("No memory to release the workflows nobody attached; they stay until a restart.");
                return;
        }
        while (workflow_iterate(m->workflows, &it, &w))
                if (!w->owner)
                        v[n++] = w;
        for (size_t i = 0; i < n; i++) {
                workflows_set_call(m, &(WorkflowCall){ .m = m });
                int r = workflow_release(m->workflows, v[i]);
                if (r < 0) {
                        log_warning_errno(r, "Cannot journal the release of workflow %s that nobody attached "
                                          "(%m): released in memory; a restart brings it back.", v[i]->id_str);
                        workflow_forget(m->workflows, v[i]);
                }
                k++;
        }
        if (k > 0)
                log_info("%zu workflows restored at start were not attached in time and were released.", k);
}

/* [Limits] WorkflowTokenMemory= in whole tokens (rounded up: 1 to 3 bytes is a token, not
 * "no bound"). */
static uint64_t token_budget(const Config *c) {
        return DIV_ROUND_UP(c->workflow_token_bytes, sizeof(uint32_t));
}

static int workflows_init(Manager *m) {
        Glue *g = calloc(1, sizeof *g);
        int r;

        if (!g)
                return log_oom();
        g->call.m = m;
        WorkflowOps ops = { .clone = op_clone, .release = op_release, .release_alone = op_release_alone, .check = op_check,
                            .journal = op_journal, .apply_sequence = op_apply_sequence, .userdata = g };
        r = workflow_manager_new(&ops, 0, &m->workflows);
        if (r < 0) {
                free(g);
                return log_error_errno(r, "Cannot create the workflow manager: %m");
        }
        workflow_manager_set_token_budget(m->workflows, token_budget(&m->config));
        if (m->page_manager)
                page_manager_set_keeper(m->page_manager, keeps_sequence, workflows_grace_ends, m);
        return 0;
}

static void workflows_done(Manager *m) {
        Glue *g = glue_of(m);
        if (m->workflows)
                unbind_all(m);
        if (m->page_manager)
                page_manager_set_keeper(m->page_manager, NULL, NULL, NULL);
        /* In memory only: the WAL keeps the workflows for the next start. */
        m->workflows = workflow_manager_free(m->workflows);
        free(g);
}

static int workflows_apply_record(Manager *m, uint16_t type, const void *payload, size_t len) {
        return m->workflows ? workflow_apply_record(m->workflows, payload, len) : 0;
}

typedef struct SnapshotAdd {
        SubsystemSnapshotAdd add;
        void *userdata;
} SnapshotAdd;

static int snapshot_add_branch(void *userdata, const void *rec, size_t len) {
        SnapshotAdd *a = userdata;
        return a->add(a->userdata, WAL_RECORD_WORKFLOW + WORKFLOW_REC_STATE_BRANCH, rec, len);
}

static int workflows_snapshot(Manager *m, SubsystemSnapshotAdd add, void *userdata) {
        if (!m->workflows)
                return 0;
        return workflow_snapshot(m->workflows, snapshot_add_branch, &(SnapshotAdd){ add, userdata });
}

static const SubsystemJournal workflows_journal_hooks = {
        .families = (const uint8_t[]){ WAL_RECORD_WORKFLOW >> 8, 0 },
        .apply_record = workflows_apply_record,
        .snapshot = workflows_snapshot,
};

static int workflows_reload(Manager *m, const Config *c) {
        if (m->workflows)
                workflow_manager_set_token_budget(m->workflows, token_budget(c));
        return 0;
}

const Subsystem workflows_subsystem = {
        .name = "workflows",
        .init = workflows_init,
        .done = workflows_done,
        .reload = workflows_reload,
        .add_bus = bus_workflow_add,
        .journal = &workflows_journal_hooks,
};
