/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The workflows subsystem of epdd: the pure WorkflowManager (workflow.h) in
 * Manager.workflows, its sequences reached through the pages subsystem, its records
 * journaled in the WAL (wal-manager.h), each workflow a ClientObject of the client that
 * created or re-attached it (released when that client goes). Workflows replayed after
 * a restart have no owner until a client of the same uid (or root) calls Attach. */

#include "core/manager.h"
#include "workflow/workflow.h"

extern const Subsystem workflows_subsystem;

/* The glue's state for one call: who calls, with which block size. */
typedef struct WorkflowCall {
        Manager *m;
        Client *client;       /* owner of new sequences */
        size_t block_tokens;  /* the calling worker's KV block, 0 if unknown */
} WorkflowCall;

/* Sets the caller for the next workflow_*() calls (the ops read it). */
void workflows_set_call(Manager *m, const WorkflowCall *call);
/* Binds w to client c (-EDQUOT past the client's limit, -EBUSY if bound). */
int workflows_bind(Manager *m, Workflow *w, Client *c);
/* Unbinds w from its client without releasing it (explicit Release, shutdown). */
void workflows_unbind(Workflow *w);
/* The client w is bound to, or NULL. */
Client *workflows_owner(Workflow *w);
int bus_workflow_add(Manager *m, sd_bus *bus);
