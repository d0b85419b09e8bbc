/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/manager-arenas.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/arena.h"
#include "core/fdstore.h"
#include "core/manager.h"
#include "core/mappers.h"
#include "log.h"
#include "parse-util.h"

/* The subsystem that makes arenas of domain d (other than host memory). */
static const Subsystem *domain_owner(MemoryDomain d) {
        for (const Subsystem *const *sp = manager_subsystems(); *sp; sp++)
                if ((*sp)->arenas && (MemoryDomain)(*sp)->arenas->domain == d)
                        return *sp;
        return NULL;
}

void manager_arena_release(Manager *m, Arena *a) {
        if (!a)
                return;
        if (a->domain != MEMORY_HOST) {
                const Subsystem *s = domain_owner(a->domain);
                if (s && s->arenas->release)
                        s->arenas->release(m, a);
        }
        arena_free(a);
}

int manager_setup_arenas(Manager *m) {
        /* Arenas kept in systemd's fd store by a previous epdd come back with their
         * contents (fdstore.h); new ones are put there. */
        _cleanup_(fdstore_freep) FdStore *store = NULL;
        int r;

        (void)fdstore_collect(&store);
        /* The worker processes a previous epdd kept there (core/mappers.h). */
        r = mappers_take(m, store);
        if (r < 0) {
                store = fdstore_close(store);
                return r;
        }
        m->arenas = calloc(m->config.n_arenas, sizeof *m->arenas);
        if (!m->arenas && m->config.n_arenas > 0)
                return log_oom();
        for (size_t i = 0; i < m->config.n_arenas; i++) {
                const ArenaConfig *c = &m->config.arenas[i];
                bool adopted = false;
                if (c->domain != MEMORY_HOST) {
                        const Subsystem *s = domain_owner(c->domain);
                        r = s ? s->arenas->make(m, c, (uint32_t)i, &m->arenas[i]) : -EOPNOTSUPP;
                } else
                        r = arena_take_or_new_host(store, c, (uint32_t)i, m->config.host_id, &m->arenas[i], &adopted);
                if (r < 0) {
                        /* The arenas after this one stay in systemd's store for the next
                         * start: a failure here (a GPU not ready, huge pages short) must
                         * not cost their pages. */
                        store = fdstore_close(store);
                        return r; /* logged */
                }
                m->n_arenas++;
                char sz[32];
                log_info("Arena %s: %s %s, %s%s%s%s.", c->name, memory_domain_to_string(c->domain),
                         arena_usage_to_string(c->usage),
                         format_size(sz, sizeof sz, m->arenas[i]->size),
                         m->arenas[i]->hugepages ? ", huge pages" : "", c->prefault ? ", prefaulted" : "",
                         adopted ? ", taken back from the fd store" : "");
        }
        return 0;
}

void manager_store_fresh_arenas(Manager *m) {
        /* Stored before the restore's drop was durable, a start that died in between
         * would have the next one adopt this fresh memory and replay the old sequences
         * and entries over it. */
        for (size_t i = 0; i < m->n_arenas; i++)
                if (m->config.arenas[i].domain == MEMORY_HOST && !m->arenas[i]->adopted) {
                        char fdname[64];
                        snprintf(fdname, sizeof fdname, "arena-%s", m->config.arenas[i].name);
                        (void)fdstore_push(fdname, m->arenas[i]->fd);
                }
}
