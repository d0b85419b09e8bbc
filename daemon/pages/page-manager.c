/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/page-manager.h"

#include <assert.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/arena.h"
#include "core/worker.h"
#include "gpu/gpu-manager.h"
#include "log.h"
#include "macro.h"
#include "pages/bus-sequence.h"
#include "pages/directory-record.h"
#include "pages/sequence-record.h"
#include "time-util.h"
#include "wal/wal-manager.h"

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
        if (!pm->pool_origin[a->index]) {
                const char *o = pm->replaying || pm->restoring ? "restored from the journal of the previous run"
                                                               : "set by the first KV layout that used the arena";
                pm->pool_origin[a->index] = strdup(o); /* NULL: the refusal says less */
        }
        if (a->domain == MEMORY_HOST && a->base) {
                ((ArenaHeader *)a->base)->page_size = page_size;
                if (!pm->copy[a->index]) {
                        pm->copy[a->index] = host_copy;
                        pm->copy_userdata[a->index] = a;
                }
        } else if (a->domain == MEMORY_GPU && a->gpu && !pm->copy_async[a->index]) {
                /* The copy engine, off the event loop (gpu-manager.c). */
                pm->copy_async[a->index] = gpu_manager_page_copy_async;
                pm->copy_userdata[a->index] = pm->manager;
        }
        log_info("Arena %s: %" PRIu64 " KV pages of %" PRIu64 " bytes.", a->name,
                 page_pool_size(pool), page_size);
        *ret = pool;
        return 0;
}

static void sequence_object_release(ClientObject *o) {
        page_manager_release(container_of(o, Sequence, object));
}

int page_manager_room(PageManager *pm, Client *c) {
        if (hashmap_size(pm->sequences) >= PAGE_MANAGER_SEQUENCES_MAX)
                return -EDQUOT;
        return c && client_object_room(c) == -EDQUOT ? -EDQUOT : 0;
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
        s->uid = (uint32_t)c->uid;
        r = page_manager_journal_addition(s);
        if (r < 0) {
                (void)hashmap_remove(pm->sequences, s->id_str);
                client_object_unlink(&s->object);
                s->manager = NULL;
                goto fail;
        }
        pm->sequences_created++;
        return 0;
fail:
        s->path = (free(s->path), NULL);
        return r;
}

static void removals_take_frees(PageManager *pm, int appended);

void page_manager_release(Sequence *s) {
        if (!s)
                return;
        PageManager *pm = s->manager;
        if (s->object.owner)
                client_object_unlink(&s->object);
        if (pm) {
                if (hashmap_get(pm->sequences, s->id_str) == s) {
                        (void)hashmap_remove(pm->sequences, s->id_str);
                        if (!pm->replaying && !pm->journal_held && !pm->manager->stopping) {
                                int r = wal_manager_append(pm->manager, WAL_RECORD_SEQUENCE + SEQUENCE_REC_DEL,
                                                           s->id.bytes, sizeof s->id.bytes);
                                if (r < 0 && r != -ENOTCONN)
                                        log_warning_errno(r, "Sequence %s: cannot journal its release: %m",
                                                          s->id_str);
                                sequence_free(s);
                                /* Refused, its pages go free with no record saying so: the
                                 * daemon writes into no freed page from now on. */
                                removals_take_frees(pm, r == -ENOTCONN ? 0 : r);
                                pm->sequences_released++;
                                return;
                        }
                }
                pm->sequences_released++;
        }
        sequence_free(s);
}

static int put_encode(const Sequence *s, void **ret, size_t *ret_len) {
        if (s->n_pages > SEQUENCE_REC_PAGES_MAX)
                return -E2BIG;
        size_t len = sequence_record_put_size((uint32_t)s->n_grants, (uint32_t)s->n_pages);
        void *buf = malloc(len);
        if (!buf)
                return -ENOMEM;
        sequence_record_put_encode(buf, &s->id, s->arena, s->uid, page_pool_page_size(s->pool),
                                   s->created_usec, s->grants, (uint32_t)s->n_grants, s->pages,
                                   (uint32_t)s->n_pages);
        *ret = buf;
        *ret_len = len;
        return 0;
}

int page_manager_sequence_record(Sequence *s, void **ret, size_t *ret_len) {
        return put_encode(s, ret, ret_len);
}

/* Pages returned to FREE since the last look: the record that freed them is the last
 * one appended, or an earlier one (each path journals its frees in the same turn of
 * the loop; an eviction journals its DEL before it frees the page), so they are marked
 * with the last LSN. Taken right after each record that frees (a Release's DEL, a
 * Truncate's or a copy-on-write's PUT), where the last LSN is that record's, and again
 * before the daemon writes into fresh pages, for the frees another record covers (a
 * handoff's, a workflow's). `appended` < 0: the record that was to cover them was
 * refused: the daemon never writes into those pages (their mark never settles). */
static bool stamp_durable(void *userdata, uint64_t stamp) {
        return stamp != UINT64_MAX && wal_manager_durable(userdata, stamp);
}

static void removals_take_frees(PageManager *pm, int appended) {
        Manager *m = pm->manager;
        if (!m->wal)
                return;
        uint64_t stamp = appended < 0 ? UINT64_MAX : wal_manager_last_lsn(m);
        for (size_t i = 0; i < m->n_arenas; i++) {
                page_pool_set_durable(m->arenas[i]->pages, stamp_durable, m);
                page_pool_mark_frees(m->arenas[i]->pages, stamp);
        }
}

static int journal_put(Sequence *s, bool removed);

int page_manager_journal(Sequence *s) {
        return journal_put(s, true);
}

int page_manager_journal_addition(Sequence *s) {
        return journal_put(s, false);
}

/* removed: the change took something from the table the log still gives the sequence
 * (pages: a Truncate, a copy-on-write's swap; a grant), so a record that cannot be
 * built is a refusal; without (a new sequence, appended pages, a new grant) the call
 * fails and nothing else changes. */
static int journal_put(Sequence *s, bool removed) {
        PageManager *pm = s ? s->manager : NULL;
        _cleanup_(freep) void *buf = NULL;
        size_t len;
        int r;

        if (!pm || pm->replaying || pm->journal_held || pm->manager->stopping || !pm->manager->wal)
                return 0;
        r = put_encode(s, &buf, &len);
        if (r < 0 && !removed)
                return r;
        if (r < 0) {
                /* The table changed already (a Truncate, a copy-on-write's swap): a
                 * record that cannot be built is one the log refused. Pages it freed, or
                 * that the next records free while the log still gives them to this
                 * sequence, must never count as settled: they would be written into,
                 * and a crash would bring this sequence back over another's bytes. */
                int k = wal_manager_refuse(pm->manager, r, "a sequence's page table");
                if (k == -ENOTCONN)
                        return r;
                removals_take_frees(pm, r);
                return r;
        }
        r = wal_manager_append(pm->manager, WAL_RECORD_SEQUENCE + SEQUENCE_REC_PUT, buf, len);
        if (r == -ENOTCONN)
                return 0;
        removals_take_frees(pm, r);
        return r;
}

/* ---- block directory ownership in the WAL (directory-record.h) ---- */

static int pool_arena(PageManager *pm, const PagePool *pool, uint32_t *ret) {
        for (size_t i = 0; i < pm->manager->n_arenas; i++)
                if (pm->manager->arenas[i]->pages == pool) {
                        *ret = (uint32_t)i;
                        return 0;
                }
        return -ENODEV;
}

static int directory_record(PageManager *pm, bool put, uint64_t hash, PagePool *pool, PageId page,
                            uint8_t buf[static DIRECTORY_REC_PUT_SIZE], size_t *ret_len) {
        if (!put) {
                directory_record_del_encode(buf, hash);
                *ret_len = DIRECTORY_REC_DEL_SIZE;
                return 0;
        }
        DirectoryRecord rec = { .hash = hash, .page = page, .page_size = page_pool_page_size(pool) };
        int r = pool_arena(pm, pool, &rec.arena);
        if (r < 0)
                return r;
        directory_record_put_encode(buf, &rec);
        *ret_len = DIRECTORY_REC_PUT_SIZE;
        return 0;
}

static int directory_journal_wal(PageManager *pm, bool put, uint64_t hash, PagePool *pool, PageId page) {
        uint8_t buf[DIRECTORY_REC_PUT_SIZE];
        size_t len;

        if (pm->replaying || pm->manager->stopping || !pm->manager->wal)
                return 0;
        int r = directory_record(pm, put, hash, pool, page, buf, &len);
        if (r >= 0)
                r = wal_manager_append(pm->manager, WAL_RECORD_DIRECTORY + (put ? DIRECTORY_REC_PUT : DIRECTORY_REC_DEL),
                                       buf, len);
        if (r < 0 && r != -ENOTCONN) {
                /* A put is undone by the directory; a removal does not happen (the
                 * entry and its page stay cached: an eviction fails, a Remove says
                 * why), so a restart never finds the hash on a page reused since. */
                log_warning_errno(r, "Block directory: cannot journal the %s of %016" PRIx64 ": %m",
                                  put ? "entry" : "removal", hash);
                return r;
        }
        return 0;
}

/* Every entry that appears or goes: into the WAL, then to the observer (the cluster-wide
 * directory), which hears only what stands. */
static int directory_journal(void *userdata, bool put, uint64_t hash, PagePool *pool, PageId page) {
        PageManager *pm = userdata;
        int r = directory_journal_wal(pm, put, hash, pool, page);

        if (r >= 0 && pm->observer && !pm->manager->stopping) {
                uint32_t a;
                const char *arena = pool && pool_arena(pm, pool, &a) >= 0 ? pm->manager->arenas[a]->name : "";
                pm->observer(pm->observer_userdata, put, hash, arena, put && pm->publishing_worker ? pm->publishing_worker : "");
        }
        return r;
}

void page_manager_set_directory_observer(PageManager *pm, PageDirectoryObserver fn, void *userdata) {
        pm->observer = fn;
        pm->observer_userdata = userdata;
}

int page_manager_publish(Sequence *s, uint32_t first, const uint64_t *hashes, size_t n, const char *worker) {
        PageManager *pm = s->manager;
        int r;

        if ((uint64_t)first + n > s->n_pages)
                return -ERANGE;
        pm->publishing_worker = worker;
        r = directory_insert_chain(pm->directory, s->pool, hashes, s->pages + first, n);
        pm->publishing_worker = NULL;
        return r;
}

const char *page_manager_arena_of(PageManager *pm, const PagePool *pool) {
        uint32_t a;
        return pool && pool_arena(pm, pool, &a) >= 0 ? pm->manager->arenas[a]->name : NULL;
}

typedef struct DirectorySnapshotCtx {
        PageManager *pm;
        int (*add)(void *userdata, uint16_t type, const void *rec, size_t len);
        void *userdata;
} DirectorySnapshotCtx;

static int directory_snapshot_one(void *userdata, uint64_t hash, PagePool *pool, PageId page) {
        DirectorySnapshotCtx *c = userdata;
        uint8_t buf[DIRECTORY_REC_PUT_SIZE];
        size_t len;
        int r = directory_record(c->pm, true, hash, pool, page, buf, &len);
        if (r < 0)
                return r;
        return c->add(c->userdata, WAL_RECORD_DIRECTORY + DIRECTORY_REC_PUT, buf, len);
}

int page_manager_apply_directory_record(PageManager *pm, uint16_t type, const void *payload, size_t len) {
        DirectoryRecord rec, *e;
        uint64_t hash;
        int r;

        if (!pm->restored_directory && !(pm->restored_directory = hashmap_new(HASHMAP_KEY_U64, 0)))
                return -ENOMEM;
        switch (type & 0xff) {
        case DIRECTORY_REC_DEL:
                r = directory_record_del_parse(payload, len, &hash);
                if (r < 0)
                        return r;
                e = hashmap_remove(pm->restored_directory, &hash);
                if (!e)
                        return -ENOENT;
                free(e);
                return 0;
        case DIRECTORY_REC_PUT:
                r = directory_record_put_parse(payload, len, &rec);
                if (r < 0)
                        return r;
                break;
        default:
                return -EBADMSG;
        }
        e = hashmap_get(pm->restored_directory, &rec.hash);
        if (e) {
                *e = rec;
                return 0;
        }
        if (hashmap_size(pm->restored_directory) >= (size_t)UINT32_MAX)
                return -EDQUOT;
        e = malloc(sizeof *e);
        if (!e)
                return -ENOMEM;
        *e = rec;
        r = hashmap_put(pm->restored_directory, &e->hash, e);
        if (r < 0)
                free(e);
        return r;
}

/* The restored entry's pool (created if no sequence made it yet): 1 and *ret, or 0 when
 * the entry cannot come back (its arena is gone, its memory is new, it is cut in other
 * pages now, or its page does not fit), or -ENOMEM: no memory for the pool, which says
 * nothing of the entry (the start fails rather than journal its removal for good). */
static int restored_entry_pool(PageManager *pm, const DirectoryRecord *e, PagePool **ret) {
        Manager *m = pm->manager;
        PagePool *pool;
        int r;
        if (e->arena >= m->n_arenas || !m->arenas[e->arena]->adopted)
                return 0;
        r = page_manager_pool(pm, m->arenas[e->arena], e->page_size, &pool);
        if (r == -ENOMEM)
                return r;
        if (r < 0 || e->page >= page_pool_size(pool))
                return 0;
        *ret = pool;
        return 1;
}

/* Drops the entries that cannot come back (journaling their removal, so that a later
 * start does not bring them back over other bytes); counts the pages of the rest.
 * -ENOMEM when a pool could not be made. */
static int restored_directory_prune(PageManager *pm) {
        DirectoryRecord *e;
        PagePool *pool;
        size_t n = 0, it = 0, dropped = 0;
        int r = 0;
        /* Collected in one pass, then removed (a rescan after each was quadratic). */
        _cleanup_(freep) DirectoryRecord **gone = calloc(hashmap_size(pm->restored_directory) + 1, sizeof *gone);
        while (hashmap_iterate(pm->restored_directory, &it, (void **)&e, NULL)) {
                r = restored_entry_pool(pm, e, &pool);
                if (r < 0)
                        break;
                if (r > 0)
                        continue;
                if (gone) {
                        gone[n++] = e;
                        continue;
                }
                /* No memory for the list: one at a time, the scan started over (none may
                 * stay: it names bytes that are gone). */
                (void)hashmap_remove(pm->restored_directory, &e->hash);
                (void)directory_journal(pm, false, e->hash, NULL, 0);
                free(e);
                dropped++;
                it = 0;
        }
        for (size_t i = 0; i < n; i++) {
                (void)hashmap_remove(pm->restored_directory, &gone[i]->hash);
                (void)directory_journal(pm, false, gone[i]->hash, NULL, 0);
                free(gone[i]);
                dropped++;
        }
        if (dropped > 0)
                log_info("%zu journaled block-directory entries dropped: their arena's memory did not survive.",
                         dropped);
        return r < 0 ? r : 0;
}

/* After the pools' references are back: every entry is inserted again (its page LIVE
 * for the moment: a page no sequence holds gets a reference that is dropped after,
 * which leaves it IDLE and evictable, as before the restart). */
static int restored_directory_insert(PageManager *pm, DirectoryRecord **failed, size_t *ret_n_failed) {
        DirectoryRecord *e;
        PagePool *pool;
        size_t it = 0, n_failed = 0;
        *ret_n_failed = 0;
        while (pm->restored_directory && hashmap_iterate(pm->restored_directory, &it, (void **)&e, NULL)) {
                int r = restored_entry_pool(pm, e, &pool);
                if (r < 0)
                        return r;
                if (r == 0)
                        continue;
                r = directory_insert(pm->directory, pool, e->hash, e->page);
                if (r == -ENOMEM)
                        return r; /* not the entry's fault: the start fails */
                if (r >= 0)
                        pm->directory_restored++;
                else {
                        log_warning_errno(r, "Block directory: entry %016" PRIx64 " (page %" PRIu32 ") does not come back: %m",
                                          e->hash, e->page);
                        failed[n_failed++] = e;
                }
        }
        *ret_n_failed = n_failed;
        return 0;
}

static void restored_directory_free(PageManager *pm) {
        DirectoryRecord *e;
        size_t it = 0;
        while (pm->restored_directory && hashmap_iterate(pm->restored_directory, &it, (void **)&e, NULL))
                free(e);
        hashmap_free(pm->restored_directory);
        pm->restored_directory = NULL;
}

int page_manager_snapshot(PageManager *pm, int (*add)(void *userdata, uint16_t type, const void *rec, size_t len),
                          void *userdata) {
        Sequence *s;
        size_t it = 0;
        int r;

        if (!pm)
                return 0;
        while (hashmap_iterate(pm->sequences, &it, (void **)&s, NULL)) {
                _cleanup_(freep) void *buf = NULL;
                size_t len;
                r = put_encode(s, &buf, &len);
                if (r < 0)
                        return r;
                r = add(userdata, WAL_RECORD_SEQUENCE + SEQUENCE_REC_PUT, buf, len);
                if (r < 0)
                        return r;
        }
        DirectorySnapshotCtx ctx = { .pm = pm, .add = add, .userdata = userdata };
        return directory_foreach(pm->directory, directory_snapshot_one, &ctx);
}

/* Arena a holds no pool any more: its page size is free for the next layout. */
void page_manager_pool_drop(PageManager *pm, Arena *a) {
        directory_detach_pool(pm->directory, a->pages);
        a->pages = page_pool_free(a->pages);
        if (a->domain == MEMORY_HOST && a->base)
                ((ArenaHeader *)a->base)->page_size = 0;
        free(pm->pool_origin[a->index]);
        pm->pool_origin[a->index] = NULL;
}

/* The replay's pool of arena a for a record of page_size. A log can hold two page sizes
 * of one arena, one after the other: a run whose arena memory did not survive dropped
 * the sequences of the first (their DELs are in the log) and its unused pool, and a
 * worker of another layout set the second (drop_unused_journal_pools()). When the
 * second's first record comes, the first's pool holds nothing any more (no sequence, no
 * directory entry) and, with no PageSize= fixing it, is made again with the new size,
 * as that run did: its records are not skipped as of another layout. */
static int replay_pool(PageManager *pm, Arena *a, uint64_t page_size, PagePool **ret) {
        int r = page_manager_pool(pm, a, page_size, ret);
        if (r != -EBUSY || !pm->replaying || pm->manager->config.arenas[a->index].page_size != 0)
                return r;
        Sequence *s;
        size_t it = 0;
        while (hashmap_iterate(pm->sequences, &it, (void **)&s, NULL))
                if (s->pool == a->pages)
                        return r;
        /* The replay's directory entries wait in restored_directory until the end. */
        DirectoryRecord *e;
        it = 0;
        while (pm->restored_directory && hashmap_iterate(pm->restored_directory, &it, (void **)&e, NULL))
                if (e->arena == a->index && e->page_size == page_pool_page_size(a->pages))
                        return r;
        log_info("Arena %s: the journal's sequences of KV pages of %" PRIu64 " bytes were all released; its later "
                 "records use pages of %" PRIu64 " bytes (a layout set after a restart): replayed with those.",
                 a->name, page_pool_page_size(a->pages), page_size);
        page_manager_pool_drop(pm, a);
        return page_manager_pool(pm, a, page_size, ret);
}

/* A sequence of the replay: in the id map, without owner, its pages not referenced yet
 * (page_manager_restore_finish() counts them all at once). */
static void replayed_drop(PageManager *pm, Sequence *s) {
        (void)hashmap_remove(pm->sequences, s->id_str);
        s->n_pages = 0; /* no references were taken */
        sequence_free(s);
}

/* A PUT of the replay that applies (skipped false) or not: one that does not drops what
 * an earlier PUT of that id restored (it is no longer the sequence's state) and is
 * remembered for its DEL (replay_skipped_journal()). */
static int replay_note(PageManager *pm, const EpdId *id, const char *id_str, bool skipped) {
        EpdId *k = pm->replay_skipped ? hashmap_remove(pm->replay_skipped, id->bytes) : NULL;
        free(k);
        if (!skipped)
                return 0;
        Sequence *s = hashmap_get(pm->sequences, id_str);
        if (s)
                replayed_drop(pm, s);
        if (!pm->replay_skipped && !(pm->replay_skipped = hashmap_new(HASHMAP_KEY_BYTES, sizeof id->bytes)))
                return -ENOMEM;
        k = malloc(sizeof *k);
        if (!k)
                return -ENOMEM;
        *k = *id;
        if (hashmap_put(pm->replay_skipped, k->bytes, k) < 0) {
                free(k);
                return -ENOMEM;
        }
        return 0;
}

static void replay_skipped_free(PageManager *pm) {
        EpdId *k;
        size_t it = 0;
        while (pm->replay_skipped && hashmap_iterate(pm->replay_skipped, &it, (void **)&k, NULL))
                free(k);
        pm->replay_skipped = hashmap_free(pm->replay_skipped);
}

/* After the replay: a DEL for each sequence whose PUT did not apply. */
static void replay_skipped_journal(PageManager *pm) {
        EpdId *k;
        size_t it = 0, n = 0;
        while (pm->replay_skipped && hashmap_iterate(pm->replay_skipped, &it, (void **)&k, NULL)) {
                int r = wal_manager_append(pm->manager, WAL_RECORD_SEQUENCE + SEQUENCE_REC_DEL, k->bytes,
                                           sizeof k->bytes);
                if (r < 0 && r != -ENOTCONN) {
                        char s[EPD_ID_STRING_MAX];
                        log_warning_errno(r, "Sequence %s: cannot journal that the replay dropped it: %m",
                                          epd_id_to_string(k, s));
                } else
                        n++;
        }
        if (n > 0)
                log_warning("%zu journaled sequences did not apply to this configuration and were dropped "
                            "(journaled: a later start does not bring them back).",
                            n);
        replay_skipped_free(pm);
}

static int apply_put(PageManager *pm, const SequenceRecord *rec, const char *id_str);

int page_manager_apply_record(PageManager *pm, uint16_t type, const void *payload, size_t len) {
        char id_str[EPD_ID_STRING_MAX];
        SequenceRecord rec;
        Sequence *s;
        EpdId id;
        int r;

        switch (type & 0xff) {
        case SEQUENCE_REC_DEL:
                r = sequence_record_del_parse(payload, len, &id);
                if (r < 0)
                        return r;
                epd_id_to_string(&id, id_str);
                (void)replay_note(pm, &id, id_str, false); /* its DEL is in the log already */
                s = hashmap_get(pm->sequences, id_str);
                if (!s)
                        return -ENOENT;
                replayed_drop(pm, s);
                return 0;
        case SEQUENCE_REC_PUT:
                break;
        default:
                return -EBADMSG;
        }

        r = sequence_record_put_parse(payload, len, &rec);
        if (r < 0) {
                /* Unreadable, but it names its sequence: the state an earlier PUT gave it
                 * is not what was acknowledged (the pages this one freed may be another
                 * sequence's now). It goes, as one whose PUT does not apply; the record
                 * itself is skipped. */
                if (payload && len >= sizeof id.bytes) {
                        memcpy(id.bytes, payload, sizeof id.bytes);
                        int k = replay_note(pm, &id, epd_id_to_string(&id, id_str), true);
                        if (k < 0)
                                return k;
                }
                return r;
        }
        epd_id_to_string(&rec.id, id_str);
        r = apply_put(pm, &rec, id_str);
        if (r == -ENOMEM)
                return r; /* the start fails: nothing is dropped for want of memory */
        int k = replay_note(pm, &rec.id, id_str, r < 0);
        return k < 0 ? k : r;
}

static int apply_put(PageManager *pm, const SequenceRecord *rec, const char *id_str) {
        Manager *m = pm->manager;
        PagePool *pool;
        Sequence *s;
        int r;

        if (rec->arena >= m->n_arenas)
                return -ENODEV;
        r = replay_pool(pm, m->arenas[rec->arena], rec->page_size, &pool);
        if (r < 0)
                return r;
        for (uint32_t i = 0; i < rec->n_pages; i++)
                if (sequence_record_page(rec, i) >= page_pool_size(pool))
                        return -ERANGE;

        s = hashmap_get(pm->sequences, id_str);
        if (s && s->pool != pool) {
                replayed_drop(pm, s);
                s = NULL;
        }
        if (!s) {
                if (hashmap_size(pm->sequences) >= PAGE_MANAGER_SEQUENCES_MAX)
                        return -EDQUOT;
                r = sequence_new(pool, &s);
                if (r < 0)
                        return r;
                s->id = rec->id;
                snprintf(s->id_str, sizeof s->id_str, "%s", id_str);
                if (asprintf(&s->path, SEQUENCE_PATH_PREFIX "/%s", s->id_str) < 0) {
                        s->path = NULL;
                        sequence_free(s);
                        return -ENOMEM;
                }
                r = hashmap_put(pm->sequences, s->id_str, s);
                if (r < 0) {
                        sequence_free(s);
                        return r;
                }
                s->manager = pm;
        }
        if (rec->n_pages > s->n_allocated) {
                PageId *p = realloc(s->pages, rec->n_pages * sizeof(PageId));
                if (!p)
                        return -ENOMEM;
                s->pages = p;
                s->n_allocated = rec->n_pages;
        }
        for (uint32_t i = 0; i < rec->n_pages; i++)
                s->pages[i] = sequence_record_page(rec, i);
        s->n_pages = rec->n_pages;
        s->arena = rec->arena;
        s->uid = rec->uid;
        s->created_usec = rec->created_usec;
        s->n_grants = rec->n_grants;
        for (uint32_t i = 0; i < rec->n_grants; i++)
                memcpy(s->grants[i].bytes, rec->grants + 16 * i, 16);
        return 0;
}

void page_manager_set_keeper(PageManager *pm, bool (*keeps)(void *userdata, const EpdId *sequence),
                             void (*grace_ends)(void *userdata), void *userdata) {
        pm->keeps = keeps;
        pm->grace_ends = grace_ends;
        pm->keeps_userdata = userdata;
}

static int on_grace(sd_event_source *es, uint64_t usec, void *userdata) {
        PageManager *pm = userdata;
        _cleanup_(freep) Sequence **victims = NULL;
        Sequence *s;
        size_t it = 0, n = 0;
        int r;

        pm->grace = sd_event_source_disable_unref(pm->grace);
        if (pm->grace_ends)
                pm->grace_ends(pm->keeps_userdata);
        if (pm->sequences_restored == 0)
                return 0; /* armed for the keeper alone: no sequence waits for its owner */
        /* Collect in one pass, then release: releasing changes the map under an
         * iterator, and restarting the scan after each release made the sweep quadratic
         * in the restored sequences (with a keeper question for each kept one every
         * time), which blocked the loop past the watchdog. */
        victims = calloc(MAX(hashmap_size(pm->sequences), (size_t)1), sizeof *victims);
        if (!victims) {
                log_warning("No memory to release the %zu sequences restored at start that were not "
                            "re-attached; trying again in a minute.", hashmap_size(pm->sequences));
                r = sd_event_add_time_relative(pm->manager->event, &pm->grace, CLOCK_MONOTONIC, 60 * USEC_PER_SEC,
                                               USEC_PER_SEC, on_grace, pm);
                if (r < 0)
                        log_warning_errno(r, "Cannot re-arm the Attach grace period: %m");
                return 0;
        }
        while (hashmap_iterate(pm->sequences, &it, (void **)&s, NULL))
                if (!s->object.owner && !(pm->keeps && pm->keeps(pm->keeps_userdata, &s->id)))
                        victims[n++] = s;
        for (size_t i = 0; i < n; i++)
                page_manager_release(victims[i]); /* journals the release; frees that one only */
        if (n > 0)
                log_info("%zu sequences restored at start were not re-attached in time and were released.", n);
        return 0;
}

/* A KV arena whose pool the replay made from journaled sequences, over memory that is
 * new (no fd store): those sequences are gone, so the page size they fixed is free
 * again; the first KV layout (or PageSize=) sets it, as on a first start. */
static void drop_unused_journal_pools(PageManager *pm) {
        Manager *m = pm->manager;
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                Sequence *s;
                size_t it = 0;
                bool used = false;
                if (!a->pages || a->adopted || m->config.arenas[i].page_size != 0 ||
                    page_pool_retained(a->pages) > 0 || page_pool_free_count(a->pages) != page_pool_size(a->pages))
                        continue;
                while (!used && hashmap_iterate(pm->sequences, &it, (void **)&s, NULL))
                        used = s->pool == a->pages;
                if (used)
                        continue;
                log_notice("Arena %s: the journal's sequences used KV pages of %" PRIu64 " bytes, but the arena's "
                           "memory did not survive the restart (no fd store), so they were dropped and the page "
                           "size is free again: the first worker's KV layout sets it.",
                           a->name, page_pool_page_size(a->pages));
                page_manager_pool_drop(pm, a);
        }
}

/* After the replay: a pool whose page size journaled sequences over surviving memory
 * (fd store) keep is said once, with what a worker of another layout can do. */
static void report_journal_pools(PageManager *pm) {
        Manager *m = pm->manager;
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                Sequence *s;
                size_t it = 0;
                uint64_t n = 0;
                if (!a->pages || m->config.arenas[i].page_size != 0)
                        continue;
                while (hashmap_iterate(pm->sequences, &it, (void **)&s, NULL))
                        n += s->pool == a->pages;
                if (n == 0)
                        continue;
                log_notice("Arena %s keeps KV pages of %" PRIu64 " bytes: %" PRIu64 " sequences restored from the "
                           "journal in %s/wal hold them. Workers with another KV layout are refused on this arena "
                           "until those sequences are released (their owners Attach and Release them, or the %" PRIu64
                           " s grace period ends for those nobody attaches); or give that model its own arena "
                           "([Arena:NAME] in epd.conf, RegisterWorker option 'arenas').",
                           a->name, page_pool_page_size(a->pages), n, m->config.state_dir,
                           (uint64_t)(PAGE_MANAGER_ATTACH_GRACE_USEC / USEC_PER_SEC));
        }
}

int page_manager_restore_finish(PageManager *pm) {
        Manager *m = pm->manager;
        Sequence *s;
        size_t it;
        int r;

        pm->replaying = false;
        pm->restoring = true;
        /* Sequences of an arena whose memory is new (no fd store: not adopted) name
         * bytes that are gone: they are dropped, and the drop is journaled so that a
         * later start does not bring them back over other bytes. */
        uint64_t dropped = 0;
        /* Collected in one pass, then released (a release changes the map under an
         * iterator; a rescan after each was quadratic in the sequences). */
        _cleanup_(freep) Sequence **gone = calloc(MAX(hashmap_size(pm->sequences), (size_t)1), sizeof *gone);
        if (!gone)
                return -ENOMEM;
        it = 0;
        while (hashmap_iterate(pm->sequences, &it, (void **)&s, NULL))
                if (!(s->arena < m->n_arenas && m->arenas[s->arena]->adopted))
                        gone[dropped++] = s;
        for (uint64_t i = 0; i < dropped; i++) {
                gone[i]->n_pages = 0; /* no references were taken */
                page_manager_release(gone[i]); /* journals DEL */
        }
        if (dropped > 0)
                log_info("%" PRIu64 " journaled sequences dropped: their arena's memory did not survive (no fd store).",
                         dropped);
        replay_skipped_journal(pm);
        r = restored_directory_prune(pm);
        if (r < 0)
                return log_error_errno(r, "Block directory: no memory to restore its entries' page pools: %m");
        drop_unused_journal_pools(pm);
        _cleanup_(freep) bool **idle_pools = calloc(MAX(m->n_arenas, (size_t)1), sizeof *idle_pools);
        _cleanup_(freep) DirectoryRecord **failed = calloc(hashmap_size(pm->restored_directory) + 1, sizeof *failed);
        if (!idle_pools || !failed)
                return -ENOMEM;
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                uint64_t n = 0;
                if (!a->pages)
                        continue;
                _cleanup_(freep) bool *idle = NULL;
                _cleanup_(freep) uint32_t *refs = calloc(page_pool_size(a->pages), sizeof *refs);
                if (!refs) {
                        r = -ENOMEM;
                        goto fail;
                }
                it = 0;
                while (hashmap_iterate(pm->sequences, &it, (void **)&s, NULL)) {
                        if (s->pool != a->pages)
                                continue;
                        for (size_t j = 0; j < s->n_pages; j++)
                                if (refs[s->pages[j]]++ == 0)
                                        n++;
                }
                /* Pages that only the directory holds: one reference for the
                 * moment, dropped once their entry is back. */
                DirectoryRecord *e;
                size_t dit = 0;
                while (pm->restored_directory && hashmap_iterate(pm->restored_directory, &dit, (void **)&e, NULL))
                        if (e->arena == i && e->page < page_pool_size(a->pages) &&
                            e->page_size == page_pool_page_size(a->pages) && refs[e->page] == 0) {
                                refs[e->page] = 1;
                                n++;
                                if (!idle && !(idle = calloc(page_pool_size(a->pages), sizeof *idle))) {
                                        r = -ENOMEM;
                                        goto fail;
                                }
                                idle[e->page] = true;
                        }
                if (n == 0)
                        continue;
                r = page_pool_restore(a->pages, refs);
                if (r < 0) {
                        log_error_errno(r, "Arena %s: cannot restore its page pool: %m", a->name);
                        goto fail;
                }
                log_info("Arena %s: %" PRIu64 " KV pages restored from the WAL.", a->name, n);
                idle_pools[i] = TAKE_PTR(idle);
        }
        /* The directory's entries, with the journal quiet: they are in it already. */
        pm->replaying = true;
        size_t n_failed;
        r = restored_directory_insert(pm, failed, &n_failed);
        pm->replaying = false;
        if (r < 0) {
                log_error_errno(r, "Block directory: no memory to restore its entries: %m");
                goto fail;
        }
        /* One that did not come back has its removal journaled, as a pruned one (or a later
         * start brings the hash back over its page, free now); refused, the page stays out of use. */
        for (size_t i = 0; i < n_failed; i++)
                if (directory_journal(pm, false, failed[i]->hash, NULL, 0) < 0 && idle_pools[failed[i]->arena])
                        idle_pools[failed[i]->arena][failed[i]->page] = false;
        for (size_t i = 0; i < m->n_arenas; i++) {
                if (!idle_pools[i])
                        continue;
                for (PageId p = 0; p < page_pool_size(m->arenas[i]->pages); p++)
                        if (idle_pools[i][p])
                                (void)page_unref(m->arenas[i]->pages, p);
                free(idle_pools[i]);
        }
        restored_directory_free(pm);
        pm->restoring = false;
        report_journal_pools(pm);
        if (pm->directory_restored > 0)
                log_info("%" PRIu64 " block-directory entries restored.", pm->directory_restored);
        pm->sequences_restored = hashmap_size(pm->sequences);
        /* With no sequence restored the grace still runs when a keeper has one of its
         * own (the workflows': one whose every branch was dropped holds no sequence, and
         * restored unattached it would stay for good). */
        if (pm->sequences_restored == 0 && !pm->grace_ends)
                return 0;
        usec_t grace = m->config.attach_grace_usec ?: PAGE_MANAGER_ATTACH_GRACE_USEC;
        if (pm->sequences_restored > 0)
                log_info("%" PRIu64 " sequences restored; their owners have %" PRIu64 " s to Attach.",
                         pm->sequences_restored, (uint64_t)(grace / USEC_PER_SEC));
        r = sd_event_add_time_relative(m->event, &pm->grace, CLOCK_MONOTONIC, grace, USEC_PER_SEC / 10, on_grace, pm);
        if (r < 0)
                return log_error_errno(r, "Cannot arm the Attach grace period: %m");
        return 0;
fail:
        for (size_t i = 0; i < m->n_arenas; i++)
                free(idle_pools[i]);
        return r;
}

static int attach(PageManager *pm, Sequence *s, Client *c, bool head) {
        if (!pm || !s || !c)
                return -EINVAL;
        if (s->object.owner == c)
                return 0;
        if (s->object.owner)
                return -EBUSY;
        if ((uint32_t)c->uid != s->uid && c->uid != 0)
                return -EPERM;
        /* A branch's head is the workflow's: attached to a client of its own, it would be
         * released under that client by the workflow's next transition, or with the
         * workflow at the grace's end, while the client still wrote into its pages. */
        if (!head && pm->keeps && pm->keeps(pm->keeps_userdata, &s->id))
                return -EADDRINUSE;
        return client_object_link(c, &s->object, CLIENT_OBJECT_SEQUENCE, sequence_object_release);
}

int page_manager_attach(PageManager *pm, Sequence *s, Client *c) {
        return attach(pm, s, c, false);
}

int page_manager_attach_head(PageManager *pm, Sequence *s, Client *c) {
        return attach(pm, s, c, true);
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

void page_manager_take_frees(PageManager *pm) {
        if (pm)
                removals_take_frees(pm, 0);
}

bool page_manager_pages_settled(PageManager *pm, PagePool *pool, const PageId *pages, size_t n) {
        if (!pm->manager->wal)
                return true;
        removals_take_frees(pm, 0);
        return page_pool_pages_settled(pool, pages, n);
}

size_t page_manager_max_pages(PageManager *pm) {
        return pm && pm->manager->wal ? MIN((size_t)SEQUENCE_REC_PAGES_MAX, (size_t)SEQUENCE_PAGES_MAX)
                                      : (size_t)SEQUENCE_PAGES_MAX;
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
        pm->replaying = true; /* until the WAL subsystem has replayed (or there is none) */
        pm->sequences = hashmap_new(HASHMAP_KEY_STRING, 0);
        pm->copy = calloc(MAX(m->n_arenas, (size_t)1), sizeof *pm->copy);
        pm->copy_async = calloc(MAX(m->n_arenas, (size_t)1), sizeof *pm->copy_async);
        pm->copy_userdata = calloc(MAX(m->n_arenas, (size_t)1), sizeof *pm->copy_userdata);
        pm->pool_origin = calloc(MAX(m->n_arenas, (size_t)1), sizeof *pm->pool_origin);
        r = directory_new(&pm->directory);
        if (r < 0 || !pm->sequences || !pm->copy || !pm->copy_async || !pm->copy_userdata || !pm->pool_origin) {
                directory_free(pm->directory);
                hashmap_free(pm->sequences);
                free(pm->copy);
                free(pm->copy_async);
                free(pm->copy_userdata);
                free(pm->pool_origin);
                free(pm);
                return -ENOMEM;
        }
        m->page_manager = pm;
        directory_set_journal(pm->directory, directory_journal, pm);

        r = set_hosts(pm, &m->config);
        if (r < 0)
                return log_error_errno(r, "Cannot set the directory's hosts: %m");

        /* KV arenas with a configured PageSize= get their pool now. */
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                PagePool *pool;
                if (a->usage != ARENA_USAGE_KV || m->config.arenas[i].page_size == 0)
                        continue;
                if (asprintf(&pm->pool_origin[i], "set by PageSize= in %s",
                             m->config_path ? m->config_path : "the configuration") < 0) {
                        pm->pool_origin[i] = NULL;
                        return log_oom();
                }
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
        pm->grace = sd_event_source_disable_unref(pm->grace);
        restored_directory_free(pm);
        replay_skipped_free(pm);
        /* Copies under way read and write pages: they finish before the pools go. */
        if (pm->writes_pending > 0)
                gpu_manager_page_copy_drain(m);
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
        free(pm->copy_async);
        free(pm->copy_userdata);
        for (size_t i = 0; pm->pool_origin && i < m->n_arenas; i++)
                free(pm->pool_origin[i]);
        free(pm->pool_origin);
        free(pm);
        m->page_manager = NULL;
}

static int pages_reload(Manager *m, const Config *c) {
        /* Peers may come and go: directory ownership follows their membership, which the
         * cluster-wide directory keeps (the peers that are up: directory-forward.c), not
         * the configured list. Arenas need a restart. */
        if (!m->page_manager || m->directory_forward)
                return 0;
        return set_hosts(m->page_manager, c);
}

static int pages_apply_record(Manager *m, uint16_t type, const void *payload, size_t len) {
        if (!m->page_manager)
                return 0;
        if ((type & 0xff00) == WAL_RECORD_DIRECTORY)
                return page_manager_apply_directory_record(m->page_manager, type, payload, len);
        return page_manager_apply_record(m->page_manager, type, payload, len);
}

static int pages_restore_finish(Manager *m) {
        return m->page_manager ? page_manager_restore_finish(m->page_manager) : 0;
}

static int pages_snapshot(Manager *m, SubsystemSnapshotAdd add, void *userdata) {
        return m->page_manager ? page_manager_snapshot(m->page_manager, add, userdata) : 0;
}

static const SubsystemJournal pages_journal_hooks = {
        .families = (const uint8_t[]){ WAL_RECORD_SEQUENCE >> 8, WAL_RECORD_DIRECTORY >> 8, 0 },
        .apply_record = pages_apply_record,
        .restore_finish = pages_restore_finish,
        .snapshot = pages_snapshot,
};

const Subsystem pages_subsystem = {
        .name = "pages",
        .init = pages_init,
        .done = pages_done,
        .add_bus = bus_sequence_add,
        .reload = pages_reload,
        .worker_added = pages_worker_added,
        .worker_stats = pages_worker_stats,
        .worker_gone = pages_worker_gone,
        .journal = &pages_journal_hooks,
};
