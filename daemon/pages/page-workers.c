/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The pages subsystem's worker hooks: a KV worker's layout checked against the arenas
 * it maps (their pools made with its page size, or refused), undone when its
 * registration fails, and what a worker holds (WorkerStats). */
#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>

#include "core/arena.h"
#include "core/client.h"
#include "core/worker.h"
#include "log.h"
#include "macro.h"
#include "pages/page-manager.h"

int pages_worker_added(Manager *m, Worker *w, Reason *refused) {
        PageManager *pm = m->page_manager;
        const char *why = NULL;
        KvLayout l;
        int r;

        if (!pm || !w->kv.set)
                return 0;
        r = kv_layout_init(&l, w->kv.layers, w->kv.tokens_per_block, w->kv.k_bytes_per_token,
                           w->kv.v_bytes_per_token, w->kv.dtype, &why);
        if (r < 0) {
                log_warning("Worker %s: invalid KV layout: %s", w->id_str, why);
                return reason_set(refused, -EINVAL, "Invalid KV layout: %s", why);
        }
        if (l.page_size < KV_PAGE_SIZE_MIN) {
                log_warning("Worker %s: KV pages of %" PRIu64 " bytes refused (at least %u).", w->id_str, l.page_size,
                            KV_PAGE_SIZE_MIN);
                return reason_set(refused, -EINVAL,
                                  "Invalid KV layout: its pages (layers x tokens per block x bytes per token, each "
                                  "layer padded to 256 bytes) are %" PRIu64 " bytes, below %u, the smallest page an arena "
                                  "holds (as for [Arena] PageSize=): put more tokens in a block.",
                                  l.page_size, KV_PAGE_SIZE_MIN);
        }
        /* Every KV arena the worker maps must hold pages of this size. The pools this
         * makes go again if a later arena refuses: a refused worker sets no page size. */
        uint64_t made = 0;
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                PagePool *pool;
                if (!(w->arena_mask & (UINT64_C(1) << i)) || a->usage != ARENA_USAGE_KV)
                        continue;
                bool had = a->pages;
                r = page_manager_pool(pm, a, l.page_size, &pool);
                if (r >= 0 && !had)
                        made |= UINT64_C(1) << i;
                if (r < 0)
                        for (size_t j = 0; j < m->n_arenas; j++)
                                if (made & (UINT64_C(1) << j))
                                        page_manager_pool_drop(pm, m->arenas[j]);
                if (r == -EBUSY) {
                        const char *origin = pm->pool_origin[i];
                        log_warning("Worker %s: KV pages of %" PRIu64 " bytes do not fit arena %s, which holds pages of %" PRIu64 " bytes%s%s%s.",
                                    w->id_str, l.page_size, a->name, page_pool_page_size(a->pages),
                                    origin ? " (" : "", origin ?: "", origin ? ")" : "");
                        return reason_set(refused, -EINVAL,
                                          "KV pages of %" PRIu64 " bytes do not fit arena %s, which holds pages of %" PRIu64
                                          " bytes%s%s%s. Register with that KV layout, or map another KV arena "
                                          "(RegisterWorker option 'arenas'; [Arena:NAME] in epd.conf).",
                                          l.page_size, a->name, page_pool_page_size(a->pages),
                                          origin ? " (" : "", origin ?: "", origin ? ")" : "");
                }
                if (r < 0) {
                        log_warning_errno(r, "Worker %s: arena %s cannot hold pages of %" PRIu64 " bytes: %m",
                                          w->id_str, a->name, l.page_size);
                        return reason_set(refused, r == -ENOSPC ? -ENOSPC : -EINVAL,
                                          "Arena %s (%" PRIu64 " bytes of pages) cannot hold KV pages of %" PRIu64
                                          " bytes: %s.", a->name, arena_data_size(a), l.page_size, strerror(-r));
                }
        }
        w->layout = malloc(sizeof(KvLayout));
        if (!w->layout) {
                for (size_t j = 0; j < m->n_arenas; j++)
                        if (made & (UINT64_C(1) << j))
                                page_manager_pool_drop(pm, m->arenas[j]);
                return -ENOMEM;
        }
        *w->layout = l;
        w->pools_made = made;
        return 0;
}

void pages_worker_gone(Manager *m, Worker *w) {
        /* A registration refused after this subsystem's hook (another subsystem's, or its
         * reply not sent) sets no page size either: the pools it made go, still empty
         * (nothing ran between). Once it stands, they stay with their pages. */
        for (size_t i = 0; !w->established && m->page_manager && i < m->n_arenas; i++)
                if ((w->pools_made & (UINT64_C(1) << i)) && m->arenas[i]->pages &&
                    page_pool_retained(m->arenas[i]->pages) == 0)
                        page_manager_pool_drop(m->page_manager, m->arenas[i]);
        w->pools_made = 0;
        free(w->layout);
        w->layout = NULL;
}

/* The sequences of the worker's client and the pages they hold (a page two of them
 * share counts twice: it is what the worker holds, not what it alone holds). */
void pages_worker_stats(Manager *m, Worker *w, WorkerStats *st) {
        Client *c = w->object.owner;
        if (!c)
                return;
        LIST_FOREACH(objects, o, c->objects)
                if (o->type == CLIENT_OBJECT_SEQUENCE) {
                        const Sequence *s = container_of(o, Sequence, object);
                        st->sequences++;
                        st->pages += s->n_pages;
                }
}
