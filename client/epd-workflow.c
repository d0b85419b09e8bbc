/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd: agent workflows (org.epd1.Workflow; docs/scheduler.md#workflows). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "epd-internal.h"
#include "macro.h"

#define WF_PATH "/org/epd1"
#define WF_IFACE "org.epd1.Workflow"

static int dup_out(epd_client *c, const char *s, char **ret) {
        if (!ret)
                return 0;
        *ret = strdup(s);
        return *ret ? 0 : epd__error(c, -ENOMEM, NULL);
}

int epd_workflow_create(epd_client *c, const char *sequence, const uint32_t *tokens, size_t n_tokens,
                        char **ret_workflow, char **ret_head) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        const char *id, *head;
        int r;

        if (!c || !sequence || (n_tokens > 0 && !tokens))
                return epd__error(c, -EINVAL, NULL);
        r = epd__new_call(c, WF_PATH, WF_IFACE, "Create", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "o", sequence);
        if (r >= 0)
                r = sd_bus_message_append_array(m, 'u', tokens, n_tokens * sizeof *tokens);
        if (r < 0)
                return epd__error(c, r, NULL);
        r = epd__send(c, m, &reply);
        if (r < 0)
                return r;
        /* The id first and alone: past it the daemon made the workflow, which a failure
         * below releases (no half answer, nothing left held). */
        r = sd_bus_message_read(reply, "s", &id);
        if (r < 0)
                return epd__error(c, r, NULL);
        _cleanup_(freep) char *w = NULL, *h = NULL;
        r = sd_bus_message_read(reply, "o", &head);
        if (r < 0)
                r = epd__error(c, r, NULL);
        if (r >= 0)
                r = dup_out(c, id, ret_workflow ? &w : NULL);
        if (r >= 0)
                r = dup_out(c, head, ret_head ? &h : NULL);
        if (r < 0)
                return epd__undo(c, r, WF_PATH, WF_IFACE, "Release", "s", id);
        if (ret_workflow)
                *ret_workflow = TAKE_PTR(w);
        if (ret_head)
                *ret_head = TAKE_PTR(h);
        return 0;
}

int epd_workflow_fork(epd_client *c, const char *workflow, uint32_t branch, uint32_t *ret_branch, char **ret_head) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        const char *head;
        uint32_t nb;
        int r;

        if (!c || !workflow)
                return epd__error(c, -EINVAL, NULL);
        r = epd__call(c, WF_PATH, WF_IFACE, "Fork", &reply, "su", workflow, branch);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "u", &nb);
        if (r < 0)
                return epd__error(c, r, NULL);
        /* Past the branch the daemon made it: a failure below drops it again. */
        r = sd_bus_message_read(reply, "o", &head);
        if (r < 0)
                r = epd__error(c, r, NULL);
        else
                r = dup_out(c, head, ret_head);
        if (r < 0)
                return epd__undo(c, r, WF_PATH, WF_IFACE, "Drop", "su", workflow, nb);
        if (ret_branch)
                *ret_branch = nb;
        return 0;
}

int epd_workflow_advance(epd_client *c, const char *workflow, uint32_t branch, const uint32_t *tokens,
                         size_t n_tokens, bool segments, char **ret_head, uint32_t *ret_prefix_blocks,
                         epd_segment **ret_segments, size_t *ret_n_segments) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL, *reply = NULL;
        const char *head;
        uint32_t prefix;
        epd_segment *segs = NULL;
        size_t n = 0, cap = 0;
        int r;

        if (!c || !workflow || (n_tokens > 0 && !tokens))
                return epd__error(c, -EINVAL, NULL);
        r = epd__new_call(c, WF_PATH, WF_IFACE, "Advance", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "su", workflow, branch);
        if (r >= 0)
                r = sd_bus_message_append_array(m, 'u', tokens, n_tokens * sizeof *tokens);
        if (r >= 0)
                r = sd_bus_message_append(m, "b", (int)segments);
        if (r < 0)
                return epd__error(c, r, NULL);
        r = epd__send(c, m, &reply);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "ou", &head, &prefix);
        if (r >= 0)
                r = sd_bus_message_enter_container(reply, 'a', "(uuub)");
        for (;;) {
                uint32_t pb, nb, off;
                int aligned;
                if (r < 0)
                        break;
                r = sd_bus_message_read(reply, "(uuub)", &pb, &nb, &off, &aligned);
                if (r <= 0)
                        break;
                if (n == cap) {
                        cap = cap ? cap * 2 : 8;
                        epd_segment *p = realloc(segs, cap * sizeof *p);
                        if (!p) {
                                r = -ENOMEM;
                                break;
                        }
                        segs = p;
                }
                segs[n++] = (epd_segment){ .prev_block = pb, .n_blocks = nb, .new_offset = off, .aligned = aligned };
        }
        /* The head's path before anything is handed out: out of memory for it, nothing
         * of the answer reaches the caller (the advance itself cannot be undone). */
        if (r >= 0)
                r = dup_out(c, head, ret_head);
        if (r < 0) {
                free(segs);
                return epd__error(c, r, NULL);
        }
        if (ret_prefix_blocks)
                *ret_prefix_blocks = prefix;
        if (ret_segments)
                *ret_segments = segs;
        else
                free(segs);
        if (ret_n_segments)
                *ret_n_segments = n;
        return 0;
}

int epd_workflow_merge(epd_client *c, const char *workflow, uint32_t from, uint32_t into) {
        if (!c || !workflow)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, WF_PATH, WF_IFACE, "Merge", NULL, "suu", workflow, from, into);
}

int epd_workflow_drop(epd_client *c, const char *workflow, uint32_t branch) {
        if (!c || !workflow)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, WF_PATH, WF_IFACE, "Drop", NULL, "su", workflow, branch);
}

int epd_workflow_release(epd_client *c, const char *workflow) {
        if (!c || !workflow)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, WF_PATH, WF_IFACE, "Release", NULL, "s", workflow);
}

int epd_workflow_attach(epd_client *c, const char *workflow) {
        if (!c || !workflow)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, WF_PATH, WF_IFACE, "Attach", NULL, "s", workflow);
}

void epd_workflow_branches_free(epd_workflow_branch *b, size_t n) {
        if (!b)
                return;
        for (size_t i = 0; i < n; i++)
                free(b[i].head);
        free(b);
}

int epd_workflow_get_branches(epd_client *c, const char *workflow, epd_workflow_branch **ret, size_t *ret_n) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        epd_workflow_branch *v = NULL;
        size_t n = 0, cap = 0;
        int r;

        if (!c || !workflow || !ret || !ret_n)
                return epd__error(c, -EINVAL, NULL);
        r = epd__call(c, WF_PATH, WF_IFACE, "GetBranches", &reply, "s", workflow);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(reply, 'a', "(ubotu)");
        for (;;) {
                uint32_t id, nt;
                int alive;
                const char *head;
                uint64_t steps;
                if (r < 0)
                        break;
                r = sd_bus_message_read(reply, "(ubotu)", &id, &alive, &head, &steps, &nt);
                if (r <= 0)
                        break;
                if (n == cap) {
                        cap = cap ? cap * 2 : 8;
                        epd_workflow_branch *p = realloc(v, cap * sizeof *p);
                        if (!p) {
                                r = -ENOMEM;
                                break;
                        }
                        v = p;
                }
                v[n] = (epd_workflow_branch){ .branch = id, .alive = alive, .steps = steps, .n_tokens = nt,
                                              .head = strdup(head) };
                if (!v[n].head) {
                        r = -ENOMEM;
                        break;
                }
                n++;
        }
        if (r < 0) {
                epd_workflow_branches_free(v, n);
                return epd__error(c, r, NULL);
        }
        *ret = v;
        *ret_n = n;
        return (int)MIN(n, (size_t)INT32_MAX);
}
