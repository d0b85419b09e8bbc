/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "page-manager.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "arena.h"
#include "bus-sequence.h"
#include "log.h"
#include "macro.h"
#include "time-util.h"
#include "worker.h"

static int host_copy(void *userdata, uint64_t dst, uint64_t src, uint64_t length) {
        Arena *a = userdata;
        uint64_t end_d, end_s;

        if (!a->base || ADD_OVERFLOW(dst, length, &end_d) || ADD_OVERFLOW(src, length, &end_s) ||
            end_d > a->size || end_s > a->size)
                return -EINVAL;
        memcpy((uint8_t *)a->base + dst, (const uint8_t *)a->base + src, length);
        return 0;
}

int page_manager_pool(PageManager *pm, Arena *a, uint64_t page_size, PagePool **ret) {
        PagePool *pool;
        int r;

        if (a->usage != ARENA_USAGE_KV)
                return -EINVAL;
        if (a->pages) {
                if (page_pool_page_size(a->pages) != page_size)
                        return -EBUSY;
                *ret = a->pages;
                return 0;
        }
        if (page_size == 0 || arena_data_size(a) / page_size == 0)
                return -ENOSPC;
        r = page_pool_new(arena_data_size(a) / page_size, page_size, a->data_offset, &pool);
        if (r < 0)
                return r;
        directory_attach_pool(pm->directory, pool);
        a->pages = pool;
        if (a->domain == MEMORY_HOST && a->base) {
                ((ArenaHeader *)a->base)->page_size = page_size;
                if (!pm->copy[a->index]) {
                        pm->copy[a->index] = host_copy;
                        pm->copy_userdata[a->index] = a;
                }
        }
        log_info("Arena %s: %" PRIu64 " KV pages of %" PRIu64 " bytes.", a->name,
                 page_pool_size(pool), page_size);
        *ret = pool;
        return 0;
}

void page_manager_set_copy(PageManager *pm, uint32_t arena, PageCopyFn fn, void *userdata) {
        if (!pm || arena >= pm->manager->n_arenas)
                return;
        pm->copy[arena] = fn;
        pm->copy_userdata[arena] = userdata;
}

static void sequence_object_release(ClientObject *o) {
        page_manager_release(container_of(o, Sequence, object));
}

int page_manager_register(PageManager *pm, Sequence *s, Client *c, Arena *a) {
        int r;

        if (!pm || !s || !c || !a || s->pool != a->pages)
                return -EINVAL;
        if (hashmap_size(pm->sequences) >= PAGE_MANAGER_SEQUENCES_MAX)
                return -EDQUOT;
        r = epd_id_random(&s->id);
        if (r < 0)
                return r;
        epd_id_to_string(&s->id, s->id_str);
        if (asprintf(&s->path, SEQUENCE_PATH_PREFIX "/%s", s->id_str) < 0) {
                s->path = NULL;
                return -ENOMEM;
        }
        r = client_object_link(c, &s->object, CLIENT_OBJECT_SEQUENCE, sequence_object_release);
        if (r < 0)
                goto fail;
        r = hashmap_put(pm->sequences, s->id_str, s);
        if (r < 0) {
                client_object_unlink(&s->object);
                goto fail;
        }
        s->manager = pm;
        s->arena = a->index;
        s->created_usec = now_usec(CLOCK_REALTIME);
        pm->sequences_created++;
        return 0;
fail:
        s->path = (free(s->path), NULL);
        return r;
}

void page_manager_release(Sequence *s) {
        if (!s)
                return;
        PageManager *pm = s->manager;
        if (s->object.owner)
                client_object_unlink(&s->object);
        if (pm) {
                if (hashmap_get(pm->sequences, s->id_str) == s)
                        (void)hashmap_remove(pm->sequences, s->id_str);
                pm->sequences_released++;
        }
        sequence_free(s);
}

Sequence *page_manager_get(PageManager *pm, const char *id_or_path) {
        if (!pm || !id_or_path)
                return NULL;
        const char *id = id_or_path;
        size_t l = strlen(SEQUENCE_PATH_PREFIX "/");
        if (strncmp(id_or_path, SEQUENCE_PATH_PREFIX "/", l) == 0)
                id = id_or_path + l;
        return hashmap_get(pm->sequences, id);
}

static bool granted(const Sequence *s, Client *c) {
        Worker *w = client_get_worker(c);
        if (!w)
                return false;
        for (size_t i = 0; i < s->n_grants; i++)
                if (epd_id_equal(&s->grants[i], &w->id))
                        return true;
        return false;
}

int page_manager_check_access(const Sequence *s, Client *c, SequenceAccess access) {
        if (!s || !c)
                return -EPERM;
        if (s->object.owner == c)
                return 0;
        if (access == SEQUENCE_ACCESS_READ && granted(s, c))
                return 0;
        return -EPERM;
}

int page_manager_lookup(PageManager *pm, Client *c, const char *id_or_path,
                        SequenceAccess access, Sequence **ret) {
        Sequence *s = page_manager_get(pm, id_or_path);
        if (!s)
                return -ENOENT;
        int r = page_manager_check_access(s, c, access);
        if (r < 0)
                return r;
        *ret = s;
        return 0;
}

Arena *page_manager_sequence_arena(PageManager *pm, const Sequence *s) {
        if (!pm || !s || s->arena >= pm->manager->n_arenas)
                return NULL;
        return pm->manager->arenas[s->arena];
}

static int no_copy(void *userdata, uint64_t dst, uint64_t src, uint64_t length) {
        return -EOPNOTSUPP;
}

int page_manager_prepare_write(PageManager *pm, Sequence *s, size_t first, size_t count,
                               PageId *ret_pages, size_t *ret_copied) {
        if (!pm || !s || s->arena >= pm->manager->n_arenas)
                return -EINVAL;
        /* Without a copy function (a GPU arena before the GPU domain installed one),
         * writes that need no copy still work; the others fail with -EOPNOTSUPP. */
        PageCopyFn fn = pm->copy[s->arena] ?: no_copy;
        return sequence_prepare_write(s, first, count, fn, pm->copy_userdata[s->arena],
                                      ret_pages, ret_copied);
}

int page_manager_grant(Sequence *s, const EpdId *worker) {
        for (size_t i = 0; i < s->n_grants; i++)
                if (epd_id_equal(&s->grants[i], worker))
                        return 0;
        if (s->n_grants >= SEQUENCE_GRANTS_MAX)
                return -EDQUOT;
        s->grants[s->n_grants++] = *worker;
        return 0;
}

int page_manager_revoke(Sequence *s, const EpdId *worker) {
        for (size_t i = 0; i < s->n_grants; i++)
                if (epd_id_equal(&s->grants[i], worker)) {
                        s->grants[i] = s->grants[--s->n_grants];
                        return 0;
                }
        return -ENOENT;
}

/* -- subsystem hooks -- */

/* Owners of directory entries: this host and the configured peers. */
static int set_hosts(PageManager *pm, const Config *c) {
        if (c->n_peers == 0)
                return directory_set_hosts(pm->directory, NULL, 0, 0);
        size_t n = c->n_peers + 1;
        const char **hosts = calloc(n, sizeof *hosts);
        if (!hosts)
                return -ENOMEM;
        hosts[0] = c->host_id ?: pm->manager->config.host_id;
        for (size_t i = 0; i < c->n_peers; i++)
                hosts[i + 1] = c->peers[i].host_id;
        int r = directory_set_hosts(pm->directory, hosts, n, 0);
        free(hosts);
        return r;
}

static int pages_init(Manager *m) {
        PageManager *pm = calloc(1, sizeof *pm);
        int r;

        if (!pm)
                return -ENOMEM;
        pm->manager = m;
        pm->sequences = hashmap_new(HASHMAP_KEY_STRING, 0);
        pm->copy = calloc(MAX(m->n_arenas, (size_t)1), sizeof *pm->copy);
        pm->copy_userdata = calloc(MAX(m->n_arenas, (size_t)1), sizeof *pm->copy_userdata);
        r = directory_new(&pm->directory);
        if (r < 0 || !pm->sequences || !pm->copy || !pm->copy_userdata) {
                directory_free(pm->directory);
                hashmap_free(pm->sequences);
                free(pm->copy);
                free(pm->copy_userdata);
                free(pm);
                return -ENOMEM;
        }
        m->page_manager = pm;

        r = set_hosts(pm, &m->config);
        if (r < 0)
                return log_error_errno(r, "Cannot set the directory's hosts: %m");

        /* KV arenas with a configured PageSize= get their pool now. */
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                PagePool *pool;
                if (a->usage != ARENA_USAGE_KV || m->config.arenas[i].page_size == 0)
                        continue;
                r = page_manager_pool(pm, a, m->config.arenas[i].page_size, &pool);
                if (r < 0)
                        return log_error_errno(r, "Arena %s: cannot create its page pool: %m", a->name);
        }
        return 0;
}

static void pages_done(Manager *m) {
        PageManager *pm = m->page_manager;
        Sequence *s;
        size_t it;

        if (!pm)
                return;
        /* Clients are gone by now; anything left is released here. */
        while ((it = 0, hashmap_iterate(pm->sequences, &it, (void **)&s, NULL)))
                page_manager_release(s);
        pm->directory = directory_free(pm->directory);
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (!a->pages)
                        continue;
                if (page_pool_retained(a->pages) > 0)
                        log_warning("Arena %s: %" PRIu64 " pages still leased at shutdown.", a->name,
                                    page_pool_retained(a->pages));
                a->pages = page_pool_free(a->pages);
        }
        hashmap_free(pm->sequences);
        free(pm->copy);
        free(pm->copy_userdata);
        free(pm);
        m->page_manager = NULL;
}

static int pages_worker_added(Manager *m, Worker *w) {
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
                return -EINVAL;
        }
        /* Every KV arena the worker maps must hold pages of this size. */
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                PagePool *pool;
                if (!(w->arena_mask & (UINT64_C(1) << i)) || a->usage != ARENA_USAGE_KV)
                        continue;
                r = page_manager_pool(pm, a, l.page_size, &pool);
                if (r == -EBUSY) {
                        log_warning("Worker %s: KV pages of %" PRIu64 " bytes do not fit arena %s, which holds pages of %" PRIu64 " bytes.",
                                    w->id_str, l.page_size, a->name, page_pool_page_size(a->pages));
                        return -EINVAL;
                }
                if (r < 0) {
                        log_warning_errno(r, "Worker %s: arena %s cannot hold pages of %" PRIu64 " bytes: %m",
                                          w->id_str, a->name, l.page_size);
                        return r == -ENOSPC ? -ENOSPC : -EINVAL;
                }
        }
        w->layout = malloc(sizeof(KvLayout));
        if (!w->layout)
                return -ENOMEM;
        *w->layout = l;
        return 0;
}

static int pages_reload(Manager *m, const Config *c) {
        /* Peers may come and go: directory ownership follows. Arenas need a restart. */
        return m->page_manager ? set_hosts(m->page_manager, c) : 0;
}

static void pages_worker_gone(Manager *m, Worker *w) {
        free(w->layout);
        w->layout = NULL;
}

const Subsystem pages_subsystem = {
        .name = "pages",
        .init = pages_init,
        .done = pages_done,
        .add_bus = bus_sequence_add,
        .reload = pages_reload,
        .worker_added = pages_worker_added,
        .worker_gone = pages_worker_gone,
};
