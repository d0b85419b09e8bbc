/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Workflow at /org/epd1 (dbus/org.epd1.Workflow.xml): vtable glue only.
 * Workflows are named by their id (32 hex digits); branches by number. */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/worker.h"
#include "log.h"
#include "pages/bus-sequence.h"
#include "pages/page-manager.h"
#include "wal/wal-manager.h"
#include "workflow/workflow-manager.h"

static int map_error(sd_bus_error *error, int r, const char *what) {
        switch (r) {
        case -ESTALE:
                return epd_bus_error(error, EPD_ERROR_STALE,
                                     "%s: the sequence it needs is not on this daemon (lost, or not restored).", what);
        case -ENOENT:
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "%s: no such workflow or branch.", what);
        case -EDQUOT:
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "%s: limit reached (workflows or sequences in the daemon, objects this "
                                     "client holds, %u branch ids per workflow over its life, dropped ones "
                                     "included, or a transition larger than one journal record).",
                                     what, WORKFLOW_BRANCHES_MAX);
        case -E2BIG:
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "%s: too large (tokens of a workflow, or pages of a sequence past what its "
                                     "journal record holds).",
                                     what);
        case -EOVERFLOW:
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "%s: the workflows' tokens would pass [Limits] WorkflowTokenMemory= "
                                     "(a fork keeps a copy of its parent's tokens).",
                                     what);
        case -EINVAL:
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "%s: invalid argument.", what);
        case -EPERM:
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED, "%s: not yours.", what);
        case -ENOSPC:
                return epd_bus_error(error, EPD_ERROR_NO_SPACE, "%s: no room (KV pages or objects).", what);
        case -ENOTCONN:
        case -EIO:
        case -ENOBUFS:
                return epd_bus_error(error, EPD_ERROR_FAILED, "%s: the journal could not take the change (%s).",
                                     what, strerror(-r));
        case -ESHUTDOWN:
                return epd_bus_error(error, EPD_ERROR_FAILED, "%s: epdd is stopping.", what);
        case -ENOMEM:
                return epd_bus_error(error, EPD_ERROR_FAILED, "%s: out of memory.", what);
        default:
                return epd_bus_error(error, EPD_ERROR_FAILED, "%s: %s", what, strerror(-r));
        }
}

/* The caller (a registered worker, for its client and KV block size) as the glue's call. */
static int begin_worker(Manager *m, sd_bus_message *msg, Client **ret, Worker **ret_worker, sd_bus_error *error) {
        Worker *w;
        int r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;
        workflows_set_call(m, &(WorkflowCall){ .m = m, .client = w->object.owner,
                                               .block_tokens = w->kv.tokens_per_block });
        *ret = w->object.owner;
        if (ret_worker)
                *ret_worker = w;
        return 0;
}

static int begin(Manager *m, sd_bus_message *msg, Client **ret, sd_bus_error *error) {
        return begin_worker(m, msg, ret, NULL, error);
}

/* The workflow, which must be the caller's. */
static int get_own(Manager *m, Client *c, const char *id, Workflow **ret, sd_bus_error *error) {
        Workflow *w = workflow_get(m->workflows, id);
        if (!w)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No workflow %s.", id);
        if (workflows_owner(w) != c)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     workflows_owner(w) ? "Workflow %s belongs to another client."
                                                        : "Workflow %s has no owner since the restart; Attach first.",
                                     id);
        *ret = w;
        return 0;
}

/* Fork and Advance make the branch's next head in its head's arena, and Advance counts
 * the shared prefix in the caller's blocks: so the caller must map that arena, as Create
 * and Attach ask (a client that registered again may map other arenas, in another
 * layout, and still own the workflow). A branch or head that is not there is left to
 * the workflow's own answer. */
/* Branch b's head sequence, if the branch is alive and its head here. */
static Sequence *branch_head(Manager *m, Workflow *w, uint32_t b) {
        char id[EPD_ID_STRING_MAX];

        if (b >= w->n_branches || !w->branches[b].alive || !m->page_manager)
                return NULL;
        return page_manager_get(m->page_manager, epd_id_to_string(&w->branches[b].head, id));
}

static int require_head_arena(Manager *m, Worker *wk, Workflow *w, uint32_t branch, sd_bus_error *error) {
        Sequence *s = branch_head(m, w, branch);
        return s ? bus_sequence_require_arena(m, wk, s, error) : 0;
}

static void head_path(char *buf, size_t n, const EpdId *id) {
        char s[EPD_ID_STRING_MAX];
        snprintf(buf, n, SEQUENCE_PATH_PREFIX "/%s", epd_id_to_string(id, s));
}

static int read_tokens(sd_bus_message *msg, const uint32_t **ret, size_t *n) {
        const void *p;
        size_t sz;
        int r = sd_bus_message_read_array(msg, 'u', &p, &sz);
        if (r < 0)
                return r;
        *ret = p;
        *n = sz / sizeof(uint32_t);
        return 0;
}

static int reply(Manager *m, sd_bus_message *msg, sd_bus_message *rep) {
        return wal_manager_reply(m, msg, rep);
}

static int method_create(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *rep = NULL;
        Manager *m = userdata;
        const char *path;
        const uint32_t *tokens;
        size_t n;
        Client *c;
        Worker *wk;
        Sequence *s;
        Workflow *w = NULL;
        char head[128];
        uid_t uid = 0;
        int r;

        r = sd_bus_message_read(msg, "o", &path);
        if (r >= 0)
                r = read_tokens(msg, &tokens, &n);
        if (r < 0)
                return r;
        r = begin_worker(m, msg, &c, &wk, error);
        if (r < 0)
                return r;
        r = m->page_manager ? page_manager_lookup(m->page_manager, c, path, SEQUENCE_ACCESS_READ, &s) : -ENOENT;
        if (r == -ENOENT)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No sequence %s.", path);
        if (r == -EPERM)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED, "Sequence %s is not yours.", path);
        if (r < 0)
                return r;
        r = bus_sequence_require_arena(m, wk, s, error);
        if (r < 0)
                return r;
        uid = c->uid;
        r = workflow_create(m->workflows, &s->id, tokens, n, uid, &w);
        if (r < 0)
                return map_error(error, r, "Create");
        r = workflows_bind(m, w, c);
        if (r < 0) {
                /* Not left ownerless in memory if the journal refuses the release too (a
                 * restart brings it back until its attach grace ends, as for a departed
                 * client's). */
                if (workflow_release(m->workflows, w) < 0)
                        workflow_forget(m->workflows, w);
                return map_error(error, r, "Create");
        }
        head_path(head, sizeof head, &w->branches[0].head);
        r = sd_bus_message_new_method_return(msg, &rep);
        if (r >= 0)
                r = sd_bus_message_append(rep, "so", w->id_str, head);
        if (r < 0)
                return r;
        return reply(m, msg, rep);
}

static int method_fork(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *rep = NULL;
        Manager *m = userdata;
        const char *id;
        uint32_t branch, nb;
        Client *c;
        Worker *wk;
        Workflow *w = NULL;
        char head[128];
        int r;

        r = sd_bus_message_read(msg, "su", &id, &branch);
        if (r < 0)
                return r;
        if ((r = begin_worker(m, msg, &c, &wk, error)) < 0 || (r = get_own(m, c, id, &w, error)) < 0 ||
            (r = require_head_arena(m, wk, w, branch, error)) < 0)
                return r;
        r = workflow_fork(m->workflows, w, branch, &nb);
        if (r < 0)
                return map_error(error, r, "Fork");
        head_path(head, sizeof head, &w->branches[nb].head);
        r = sd_bus_message_new_method_return(msg, &rep);
        if (r >= 0)
                r = sd_bus_message_append(rep, "uo", nb, head);
        if (r < 0)
                return r;
        return reply(m, msg, rep);
}

static int method_advance(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *rep = NULL;
        Manager *m = userdata;
        const char *id;
        uint32_t branch;
        const uint32_t *tokens;
        size_t n;
        int segments;
        Client *c;
        Workflow *w = NULL;
        WorkflowAdvance a;
        char head[128];
        int r;

        r = sd_bus_message_read(msg, "su", &id, &branch);
        if (r >= 0)
                r = read_tokens(msg, &tokens, &n);
        if (r >= 0)
                r = sd_bus_message_read(msg, "b", &segments);
        if (r < 0)
                return r;
        Worker *caller = NULL;
        if ((r = begin_worker(m, msg, &c, &caller, error)) < 0 || (r = get_own(m, c, id, &w, error)) < 0 ||
            (r = require_head_arena(m, caller, w, branch, error)) < 0)
                return r;
        if (caller->kv.tokens_per_block == 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Advance: the caller registered no KV layout, so the block size (tokens per "
                                     "page) that decides which pages are shared is unknown.");
        if (segments && caller->kv.tokens_per_block > WORKFLOW_MATCH_BLOCK_MAX)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Advance: segments are matched in blocks of at most %u tokens; the caller's "
                                     "KV layout has %" PRIu32 " tokens per page (ask for the shared prefix alone: "
                                     "segments false).",
                                     WORKFLOW_MATCH_BLOCK_MAX, caller->kv.tokens_per_block);
        r = workflow_advance(m->workflows, w, branch, tokens, n, segments, NULL, &a);
        if (r < 0)
                return map_error(error, r, "Advance");
        head_path(head, sizeof head, &a.head);
        r = sd_bus_message_new_method_return(msg, &rep);
        if (r >= 0)
                r = sd_bus_message_append(rep, "ou", head, (uint32_t)a.prefix_blocks);
        if (r >= 0)
                r = sd_bus_message_open_container(rep, 'a', "(uuub)");
        for (size_t i = 0; r >= 0 && i < a.match.n_segments; i++) {
                const MatchSegment *s = &a.match.segments[i];
                r = sd_bus_message_append(rep, "(uuub)", (uint32_t)s->prev_block, (uint32_t)s->n_blocks,
                                          (uint32_t)s->new_offset, (int)s->aligned);
        }
        if (r >= 0)
                r = sd_bus_message_close_container(rep);
        match_result_done(&a.match);
        if (r < 0)
                return r;
        return reply(m, msg, rep);
}

static int simple(sd_bus_message *msg, Manager *m, int r, const char *what, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *rep = NULL;
        if (r < 0)
                return map_error(error, r, what);
        r = sd_bus_message_new_method_return(msg, &rep);
        if (r < 0)
                return r;
        return reply(m, msg, rep);
}

static int method_merge(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *id;
        uint32_t from, into;
        Client *c;
        Workflow *w = NULL;
        int r = sd_bus_message_read(msg, "suu", &id, &from, &into);
        if (r < 0)
                return r;
        if ((r = begin(m, msg, &c, error)) < 0 || (r = get_own(m, c, id, &w, error)) < 0)
                return r;
        return simple(msg, m, workflow_merge(m->workflows, w, from, into), "Merge", error);
}

static int method_drop(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *id;
        uint32_t branch;
        Client *c;
        Workflow *w = NULL;
        int r = sd_bus_message_read(msg, "su", &id, &branch);
        if (r < 0)
                return r;
        if ((r = begin(m, msg, &c, error)) < 0 || (r = get_own(m, c, id, &w, error)) < 0)
                return r;
        return simple(msg, m, workflow_drop(m->workflows, w, branch), "Drop", error);
}

static int method_release(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *id;
        Client *c;
        Workflow *w = NULL;
        int r = sd_bus_message_read(msg, "s", &id);
        if (r < 0)
                return r;
        if ((r = begin(m, msg, &c, error)) < 0 || (r = get_own(m, c, id, &w, error)) < 0)
                return r;
        workflows_unbind(w);
        r = workflow_release(m->workflows, w);
        if (r < 0)
                (void)workflows_bind(m, w, c);
        return simple(msg, m, r, "Release", error);
}

/* The live heads come back with the workflow, to its client, as they were before the
 * restart: the worker goes on writing into the head it was given (Pages.Attach refuses
 * a head, so this is the only way back to it). All or none. */
static int attach_heads(Manager *m, Workflow *w, Client *c) {
        Sequence *linked[WORKFLOW_BRANCHES_MAX];
        size_t n = 0;
        int r = 0;

        for (uint32_t i = 0; i < w->n_branches; i++) {
                Sequence *s = branch_head(m, w, i);
                if (!s || s->object.owner == c)
                        continue;
                r = page_manager_attach_head(m->page_manager, s, c);
                if (r < 0)
                        break;
                linked[n++] = s;
        }
        if (r < 0)
                while (n > 0)
                        client_object_unlink(&linked[--n]->object);
        return r;
}

static int method_attach(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *id;
        Client *c;
        Worker *wk;
        int r = sd_bus_message_read(msg, "s", &id);
        if (r < 0)
                return r;
        if ((r = begin_worker(m, msg, &c, &wk, error)) < 0)
                return r;
        Workflow *w = workflow_get(m->workflows, id);
        if (!w)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No workflow %s.", id);
        if (workflows_owner(w) == c)
                return sd_bus_reply_method_return(msg, NULL);
        if (workflows_owner(w))
                return epd_bus_error(error, EPD_ERROR_BUSY, "Workflow %s is attached to another client.", id);
        if (c->uid != w->uid && c->uid != 0)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "Workflow %s belongs to uid %u.", id, (unsigned)w->uid);
        /* Its heads all lie in one arena: the first live one says which. */
        for (uint32_t i = 0; i < w->n_branches; i++) {
                const Sequence *s = branch_head(m, w, i);
                if (!s)
                        continue;
                r = bus_sequence_require_arena(m, wk, s, error);
                if (r < 0)
                        return r;
                break;
        }
        r = workflows_bind(m, w, c);
        if (r >= 0) {
                r = attach_heads(m, w, c);
                if (r < 0)
                        workflows_unbind(w);
        }
        if (r == -EDQUOT)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "Too many objects for this client.");
        if (r < 0)
                return map_error(error, r, "Attach");
        return sd_bus_reply_method_return(msg, NULL);
}

static int method_get_branches(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *rep = NULL;
        Manager *m = userdata;
        const char *id;
        Client *c;
        Workflow *w = NULL;
        int r = sd_bus_message_read(msg, "s", &id);
        if (r < 0)
                return r;
        if ((r = begin(m, msg, &c, error)) < 0 || (r = get_own(m, c, id, &w, error)) < 0)
                return r;
        r = sd_bus_message_new_method_return(msg, &rep);
        if (r >= 0)
                r = sd_bus_message_open_container(rep, 'a', "(ubotu)");
        for (uint32_t i = 0; r >= 0 && i < w->n_branches; i++) {
                const WorkflowBranch *b = &w->branches[i];
                char head[128] = "/";
                if (b->alive)
                        head_path(head, sizeof head, &b->head);
                r = sd_bus_message_append(rep, "(ubotu)", i, (int)b->alive, head, b->steps, (uint32_t)b->n_tokens);
        }
        if (r >= 0)
                r = sd_bus_message_close_container(rep);
        if (r < 0)
                return r;
        /* Once the records appended before it are durable, as a transition's own reply:
         * it never lists a Fork, Advance or Drop a crash could still undo. */
        return wal_manager_reply(m, msg, rep);
}

static int property_count(sd_bus *bus, const char *path, const char *interface, const char *property,
                          sd_bus_message *rep, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(rep, "u", (uint32_t)workflow_count(m->workflows));
}

static int property_journal(sd_bus *bus, const char *path, const char *interface, const char *property,
                            sd_bus_message *rep, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        WalManagerStats st;
        /* The writer thread's counters: the log is its to touch. */
        bool have = wal_manager_stats(m, &st) >= 0;
        const WalStats *ws = m->wal ? wal_get_stats(m->wal) : &(WalStats){};
        return sd_bus_message_append(rep, "(sttttttt)", have ? st.policy : "", st.writer.assigned_lsn,
                                     st.writer.durable_lsn, st.writer.appended, st.writer.syncs, st.writer.log_bytes,
                                     st.writer.compactions, have ? ws->cut_bytes : 0);
}

static const sd_bus_vtable workflow_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Count", "u", property_count, 0, 0),
        SD_BUS_PROPERTY("Journal", "(sttttttt)", property_journal, 0, 0),
        SD_BUS_METHOD_WITH_ARGS("Create", SD_BUS_ARGS("o", sequence, "au", tokens),
                                SD_BUS_RESULT("s", workflow, "o", head), method_create, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Fork", SD_BUS_ARGS("s", workflow, "u", branch),
                                SD_BUS_RESULT("u", new_branch, "o", head), method_fork, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Advance",
                                SD_BUS_ARGS("s", workflow, "u", branch, "au", tokens, "b", segments),
                                SD_BUS_RESULT("o", head, "u", prefix_blocks, "a(uuub)", matches),
                                method_advance, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Merge", SD_BUS_ARGS("s", workflow, "u", from, "u", into), SD_BUS_NO_RESULT,
                                method_merge, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Drop", SD_BUS_ARGS("s", workflow, "u", branch), SD_BUS_NO_RESULT, method_drop,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Release", SD_BUS_ARGS("s", workflow), SD_BUS_NO_RESULT, method_release,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Attach", SD_BUS_ARGS("s", workflow), SD_BUS_NO_RESULT, method_attach,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("GetBranches", SD_BUS_ARGS("s", workflow), SD_BUS_RESULT("a(ubotu)", branches),
                                method_get_branches, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_VTABLE_END,
};

int bus_workflow_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, "/org/epd1", "org.epd1.Workflow", workflow_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Workflow interface: %m");
        return 0;
}
