/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Pages (/org/epd1/pages) and org.epd1.Sequence (/org/epd1/sequence/<id>):
 * vtable and method glue only; the bookkeeping is page-manager.c, sequence.c, pages.c
 * and directory.c. */
#include "pages/bus-sequence.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/arena.h"
#include "core/bus-manager.h"
#include "core/bus-objects.h"
#include "core/manager.h"
#include "core/worker.h"
#include "log.h"
#include "macro.h"
#include "pages/page-manager.h"
#include "pages/sequence-record.h"
#include "wal/wal-manager.h"

#define PAGES_PATH "/org/epd1/pages"

/* Maps the errno of a pages operation to a named error. */
static int pages_error(sd_bus_error *error, int r, const char *what) {
        int copy = page_copy_errno(r);
        if (copy < 0)
                return epd_bus_error(error, EPD_ERROR_FAILED,
                                     "%s: the copy-on-write of shared pages failed (%s); nothing changed.", what,
                                     strerror(-copy));
        switch (r) {
        case -ENOSPC:
                return epd_bus_error(error, EPD_ERROR_NO_SPACE, "%s: not enough free KV pages.", what);
        case -E2BIG:
        case -EDQUOT:
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "%s: limit exceeded.", what);
        case -EPERM:
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "%s: the sequence belongs to another client.", what);
        case -ENOENT:
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "%s: no such object.", what);
        case -EINVAL:
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "%s: invalid argument.", what);
        case -EOPNOTSUPP:
                return epd_bus_error(error, EPD_ERROR_UNSUPPORTED,
                                     "%s: this arena has no copy path for copy-on-write yet.", what);
        case -ESTALE:
                return epd_bus_error(error, EPD_ERROR_STALE, "%s: a page is no longer allocated.", what);
        case -EOVERFLOW:
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "%s: a page has too many references.", what);
        case -ERANGE:
                return epd_bus_error(error, EPD_ERROR_FAILED, "%s: a page lies outside its arena.", what);
        case -ENODEV:
                return epd_bus_error(error, EPD_ERROR_FAILED, "%s: the arena's GPU copy engine is not running.", what);
        default:
                return r;
        }
}

/* The KV arena `name` that worker w may use, with its pool. */
static int kv_arena(Manager *m, Worker *w, const char *name, Arena **ret, sd_bus_error *error) {
        Arena *a = manager_find_arena(m, name);
        if (!a)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No arena named '%s'.", name);
        if (a->usage != ARENA_USAGE_KV)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "Arena '%s' does not hold KV pages.", name);
        if (!(w->arena_mask & (UINT64_C(1) << a->index)))
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "Worker %s did not map arena '%s'.", w->id_str, name);
        if (!a->pages)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Arena '%s' has no page size yet: register a worker with a KV layout first.", name);
        *ret = a;
        return 0;
}

static int read_hashes(sd_bus_message *msg, const uint64_t **ret, size_t *n, sd_bus_error *error) {
        const void *p;
        size_t sz;
        int r = sd_bus_message_read_array(msg, 't', &p, &sz);
        if (r < 0)
                return r;
        if (sz / sizeof(uint64_t) > DIRECTORY_CHAIN_MAX)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "At most %" PRIu32 " hashes per call.",
                                     DIRECTORY_CHAIN_MAX);
        *ret = p;
        *n = sz / sizeof(uint64_t);
        return 0;
}

static int reply_pages(sd_bus_message *reply, const PageId *pages, size_t n) {
        return sd_bus_message_append_array(reply, 'u', pages, n * sizeof(PageId));
}

/* Sends the reply of a method that journaled: after the WAL made it durable
 * (Sync=batch: once per loop iteration). */
static int reply_journaled(Manager *m, sd_bus_message *msg, sd_bus_message *reply) {
        return wal_manager_reply(m, msg, reply);
}

/* Journals a transition that was applied: on failure the caller gets an error (the
 * change stays in memory but is not acknowledged as durable). */
static int journal_as(Sequence *s, sd_bus_error *error, const char *what, bool removed) {
        int r = removed ? page_manager_journal(s) : page_manager_journal_addition(s);
        if (r == -E2BIG)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "%s: a sequence of %zu pages is too large to journal (at most %" PRIu32 ").",
                                     what, s->n_pages, (uint32_t)SEQUENCE_REC_PAGES_MAX);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_FAILED, "%s: cannot journal the change: %s", what,
                                     strerror(-r));
        return 0;
}

static int journal(Sequence *s, sd_bus_error *error, const char *what) {
        return journal_as(s, error, what, true);
}

/* The most pages a sequence may have, checked before anything changes: one whose
 * journal record would be too large cannot be made durable. */
static int check_pages(Manager *m, uint64_t n, const char *what, sd_bus_error *error) {
        size_t max = page_manager_max_pages(m->page_manager);
        if (n > max)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "%s: a sequence of %" PRIu64 " pages; at most %zu%s.", what, n, max,
                                     max < SEQUENCE_PAGES_MAX ? " (the largest the journal records)" : "");
        return 0;
}

/* Registers a fresh sequence for the worker's client; frees it on failure. */
static int register_new(Manager *m, Worker *w, Arena *a, Sequence *s, sd_bus_error *error) {
        size_t n = s->n_pages;
        int r = page_manager_register(m->page_manager, s, w->object.owner, a);
        if (r < 0) {
                sequence_free(s);
                if (r == -EDQUOT)
                        return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                             "Too many objects for this client or sequences in the daemon.");
                if (r == -E2BIG)
                        return check_pages(m, n, "CreateSequence", error) ?:
                               epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "The sequence is too large to journal.");
                /* The journal refused (EIO: an earlier record was refused), or memory
                 * ran out: named, as the other journaled calls' failures are. */
                return epd_bus_error(error, EPD_ERROR_FAILED, "The new sequence cannot be journaled: %s",
                                     strerror(-r));
        }
        return 0;
}

/* -- org.epd1.Pages -- */

static int method_create_sequence(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *arena;
        uint32_t n;
        Worker *w = NULL;
        Arena *a;
        Sequence *s;
        int r;

        r = sd_bus_message_read(msg, "su", &arena, &n);
        if (r < 0)
                return r;
        r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;
        r = kv_arena(m, w, arena, &a, error);
        if (r < 0)
                return r;
        r = check_pages(m, n, "CreateSequence", error);
        if (r < 0)
                return r;
        /* The limits before the pages: allocating may evict the prefix cache. */
        if (page_manager_room(m->page_manager, w->object.owner) == -EDQUOT)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "Too many objects for this client or sequences in the daemon.");
        r = sequence_new(a->pages, &s);
        if (r < 0)
                return r;
        r = sequence_append(s, n, NULL);
        if (r < 0) {
                sequence_free(s);
                return pages_error(error, r, "CreateSequence");
        }
        r = register_new(m, w, a, s, error);
        if (r < 0)
                return r;

        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "o", s->path);
        if (r >= 0)
                r = reply_pages(reply, s->pages, s->n_pages);
        if (r < 0) {
                page_manager_release(s);
                return r;
        }
        return reply_journaled(m, msg, reply);
}

/* The (arena, block hashes) arguments of the prefix methods: the caller's KV arena. */
static int read_prefix_args(Manager *m, sd_bus_message *msg, Worker **ret_w, Arena **ret_a,
                            const uint64_t **ret_hashes, size_t *ret_n, sd_bus_error *error) {
        const char *arena;
        int r = sd_bus_message_read(msg, "s", &arena);
        if (r < 0)
                return r;
        r = read_hashes(msg, ret_hashes, ret_n, error);
        if (r < 0)
                return r;
        r = manager_require_worker(m, msg, ret_w, error);
        if (r < 0)
                return r;
        return kv_arena(m, *ret_w, arena, ret_a, error);
}

static int method_create_from_prefix(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        PageManager *pm = m->page_manager;
        _cleanup_(freep) PageId *pins = NULL;
        const uint64_t *hashes = NULL;
        size_t n = 0, len = 0;
        Worker *w = NULL;
        Arena *a;
        Sequence *s;
        int r;

        r = read_prefix_args(m, msg, &w, &a, &hashes, &n, error);
        if (r < 0)
                return r;
        pins = malloc(MAX(n, (size_t)1) * sizeof(PageId));
        if (!pins)
                return -ENOMEM;
        r = directory_lookup(pm->directory, a->pages, hashes, n, pins, &len);
        if (r < 0)
                return pages_error(error, r, "CreateFromPrefix");
        /* The sequence is as long as what matched, not as the chain asked about (up to
         * DIRECTORY_CHAIN_MAX hashes, as MatchPrefix takes). */
        r = check_pages(m, len, "CreateFromPrefix", error);
        if (r < 0) {
                for (size_t i = 0; i < len; i++)
                        (void)page_unref(a->pages, pins[i]);
                return r;
        }
        /* The pins become the sequence's references. */
        r = sequence_new_from_pages(a->pages, pins, len, &s);
        for (size_t i = 0; i < len; i++)
                (void)page_unref(a->pages, pins[i]);
        if (r < 0)
                return pages_error(error, r, "CreateFromPrefix");
        r = register_new(m, w, a, s, error);
        if (r < 0)
                return r;

        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "ou", s->path, (uint32_t)len);
        if (r >= 0)
                r = reply_pages(reply, s->pages, s->n_pages);
        if (r < 0) {
                page_manager_release(s);
                return r;
        }
        return reply_journaled(m, msg, reply);
}

/* After a restart: the sequence's uid (or root) takes it back (docs/wal.md). */
static int method_attach(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *id;
        Client *c;
        int r = sd_bus_message_read(msg, "s", &id);
        if (r < 0)
                return r;
        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        Sequence *s = page_manager_get(m->page_manager, id);
        if (!s)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No sequence %s.", id);
        r = page_manager_attach(m->page_manager, s, c);
        if (r == -EBUSY)
                return epd_bus_error(error, EPD_ERROR_BUSY, "Sequence %s is attached to another client.", id);
        if (r == -EADDRINUSE)
                return epd_bus_error(error, EPD_ERROR_BUSY,
                                     "Sequence %s is the head of a workflow branch: the workflow owns it "
                                     "(org.epd1.Workflow.Attach takes the workflow back).", id);
        if (r == -EPERM)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED, "Sequence %s belongs to uid %" PRIu32 ".",
                                     id, s->uid);
        if (r == -EDQUOT)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "Too many objects for this client.");
        if (r < 0)
                return r;
        return sd_bus_reply_method_return(msg, "o", s->path);
}

static int method_match_prefix(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const uint64_t *hashes = NULL;
        size_t n = 0;
        Worker *w = NULL;
        Arena *a;
        int r;

        r = read_prefix_args(m, msg, &w, &a, &hashes, &n, error);
        if (r < 0)
                return r;
        size_t len = directory_match_len(m->page_manager->directory, a->pages, hashes, n);
        return sd_bus_reply_method_return(msg, "u", (uint32_t)len);
}

static int property_pools(sd_bus *bus, const char *path, const char *interface,
                          const char *property, sd_bus_message *reply, void *userdata,
                          sd_bus_error *error) {
        Manager *m = userdata;
        int r = sd_bus_message_open_container(reply, 'a', "(sttttttttttt)");
        for (size_t i = 0; r >= 0 && i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                PagePoolStats st;
                if (!a->pages)
                        continue;
                page_pool_stats(a->pages, &st);
                r = sd_bus_message_append(reply, "(sttttttttttt)", a->name, st.page_size, st.total,
                                          st.free, st.live, st.cached_idle, st.shared, st.leased,
                                          st.cow_copies, st.bytes_saved, st.evictions, st.alloc_failures);
        }
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        return r;
}

static int property_directory(sd_bus *bus, const char *path, const char *interface,
                              const char *property, sd_bus_message *reply, void *userdata,
                              sd_bus_error *error) {
        Manager *m = userdata;
        DirectoryStats st;
        directory_stats(m->page_manager->directory, &st);
        return sd_bus_message_append(reply, "(tttttttt)", st.entries, st.lookups, st.hits, st.misses,
                                     st.inserts, st.conflicts, st.evictions, st.removals);
}

static const char *owner_path(const Sequence *s) {
        Worker *w = s->object.owner ? client_get_worker(s->object.owner) : NULL;
        return w ? w->path : "/";
}

static int property_sequences(sd_bus *bus, const char *path, const char *interface,
                              const char *property, sd_bus_message *reply, void *userdata,
                              sd_bus_error *error) {
        Manager *m = userdata;
        sd_bus_message *msg = sd_bus_get_current_message(bus);
        Sequence *s;
        size_t it = 0;
        /* Root sees every sequence; anyone else those it may read itself (its own and
         * those granted to it), as each sequence's own properties allow. */
        bool root;
        Client *c;
        int r = manager_reader_require(m, msg, "Sequences", &root, &c, error);
        if (r < 0)
                return r;
        r = sd_bus_message_open_container(reply, 'a', "(oosuut)");
        while (r >= 0 && hashmap_iterate(m->page_manager->sequences, &it, (void **)&s, NULL)) {
                if (!root && page_manager_check_access(s, c, SEQUENCE_ACCESS_READ) < 0)
                        continue;
                Arena *a = page_manager_sequence_arena(m->page_manager, s);
                r = sd_bus_message_append(reply, "(oosuut)", s->path, owner_path(s), a ? a->name : "",
                                          (uint32_t)s->n_pages, (uint32_t)sequence_shared_pages(s),
                                          s->cow_copies);
        }
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        return r;
}

static const sd_bus_vtable pages_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Pools", "a(sttttttttttt)", property_pools, 0, 0),
        SD_BUS_PROPERTY("Directory", "(tttttttt)", property_directory, 0, 0),
        SD_BUS_PROPERTY("Sequences", "a(oosuut)", property_sequences, 0, 0),
        SD_BUS_METHOD_WITH_ARGS("CreateSequence", SD_BUS_ARGS("s", arena, "u", n_pages),
                                SD_BUS_RESULT("o", sequence, "au", pages), method_create_sequence,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("CreateFromPrefix", SD_BUS_ARGS("s", arena, "at", hashes),
                                SD_BUS_RESULT("o", sequence, "u", n_blocks, "au", pages),
                                method_create_from_prefix, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("MatchPrefix", SD_BUS_ARGS("s", arena, "at", hashes),
                                SD_BUS_RESULT("u", n_blocks), method_match_prefix,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Attach", SD_BUS_ARGS("s", sequence), SD_BUS_RESULT("o", path),
                                method_attach, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_VTABLE_END,
};

/* -- org.epd1.Sequence -- */

/* The caller's client, and the access check; sets a named error. */
static int access_check(Manager *m, sd_bus_message *msg, Sequence *s, SequenceAccess access,
                        Client **ret, sd_bus_error *error) {
        Client *c = manager_client_lookup_message(m, msg);
        if (page_manager_check_access(s, c, access) < 0)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "Sequence %s belongs to another client%s.", s->id_str,
                                     access == SEQUENCE_ACCESS_READ ? " and was not granted to this worker" : "");
        if (ret)
                *ret = c;
        return 0;
}

static Manager *seq_manager(Sequence *s) {
        return s->manager->manager;
}

static int method_append(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Sequence *s = userdata;
        size_t before = s->n_pages;
        uint32_t n;
        int r = sd_bus_message_read(msg, "u", &n);
        if (r < 0)
                return r;
        r = access_check(seq_manager(s), msg, s, SEQUENCE_ACCESS_OWNER, NULL, error);
        if (r < 0)
                return r;
        r = check_pages(seq_manager(s), (uint64_t)before + n, "Append", error);
        if (r < 0)
                return r;
        r = sequence_append(s, n, NULL);
        if (r < 0)
                return pages_error(error, r, "Append");
        r = journal_as(s, error, "Append", false);
        if (r < 0) {
                /* Refused: the pages go again (no record names them, nobody was told of
                 * them), or a later record of the sequence would journal them after all. */
                (void)sequence_truncate(s, before);
                return r;
        }
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = reply_pages(reply, s->pages + before, n);
        if (r < 0)
                return r;
        return reply_journaled(seq_manager(s), msg, reply);
}

static int method_truncate(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Sequence *s = userdata;
        uint32_t n;
        int r = sd_bus_message_read(msg, "u", &n);
        if (r < 0)
                return r;
        r = access_check(seq_manager(s), msg, s, SEQUENCE_ACCESS_OWNER, NULL, error);
        if (r < 0)
                return r;
        if (n > s->n_pages)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Truncate to %" PRIu32 " pages: the sequence has %zu.", n, s->n_pages);
        r = sequence_truncate(s, n);
        if (r < 0)
                return pages_error(error, r, "Truncate");
        r = journal(s, error, "Truncate");
        if (r < 0)
                return r;
        return wal_manager_reply_empty(seq_manager(s), msg);
}

int bus_sequence_require_arena(Manager *m, const Worker *w, const Sequence *s, sd_bus_error *error) {
        Arena *a = m->page_manager ? page_manager_sequence_arena(m->page_manager, s) : NULL;
        if (!a || !(w->arena_mask & (UINT64_C(1) << a->index)))
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "Worker %s did not map the sequence's arena.", w->id_str);
        return 0;
}

static int method_clone(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Sequence *s = userdata, *c;
        Manager *m = seq_manager(s);
        Worker *w = NULL;
        int r;

        r = access_check(m, msg, s, SEQUENCE_ACCESS_READ, NULL, error);
        if (r < 0)
                return r;
        r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;
        r = bus_sequence_require_arena(m, w, s, error);
        if (r < 0)
                return r;
        Arena *a = page_manager_sequence_arena(s->manager, s);
        r = sequence_clone(s, &c);
        if (r < 0)
                return pages_error(error, r, "Clone");
        r = register_new(m, w, a, c, error);
        if (r < 0)
                return r;
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "o", c->path);
        if (r < 0) {
                page_manager_release(c);
                return r;
        }
        return reply_journaled(m, msg, reply);
}

/* The reply of a PrepareWrite: the range's pages and how many were copied, after the
 * journal made a copy's remapping durable. */
static int prepare_write_reply(Sequence *s, sd_bus_message *msg, uint32_t first, uint32_t count, size_t copied,
                               sd_bus_error *error) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int r;

        if ((uint64_t)first + count > s->n_pages)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Pages %" PRIu32 "+%" PRIu32 " are outside the sequence (%zu pages).",
                                     first, count, s->n_pages);
        if (copied > 0) {
                /* copy-on-write remapped pages of the table */
                r = journal(s, error, "PrepareWrite");
                if (r < 0)
                        return r;
        }
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = reply_pages(reply, s->pages + first, count);
        if (r >= 0)
                r = sd_bus_message_append(reply, "u", (uint32_t)copied);
        if (r < 0)
                return r;
        return reply_journaled(seq_manager(s), msg, reply);
}

/* A PrepareWrite whose copies run on the GPU's copy engine, off the loop. */
typedef struct PrepareWriteCall {
        sd_bus_message *msg;
        uint32_t first, count;
} PrepareWriteCall;

/* The refusals of a copy-on-write round's plan (as against its copy's failure, whose
 * errno is the driver's and says nothing to the caller). */
static bool plan_refusal(int error) {
        return error == -ENOSPC || error == -EOPNOTSUPP || error == -EOVERFLOW || error == -EDQUOT || error == -E2BIG;
}

static void prepare_write_ready(void *userdata, Sequence *s, int error, size_t copied) {
        PrepareWriteCall *call = userdata;
        _cleanup_(sd_bus_error_free) sd_bus_error e = SD_BUS_ERROR_NULL;
        int r = error;

        if (error == -ECANCELED)
                goto done; /* the daemon is stopping: the caller hears of it by the disconnect */
        /* A copy's failure is wrapped (page_copy_failed()): none of the plan's errnos
         * below, the Failed at the end, with the driver's errno. */
        int copy = page_copy_errno(error);
        if (error == -ENOENT)
                r = epd_bus_error(&e, EPD_ERROR_NOT_FOUND,
                                  "PrepareWrite: the sequence was released while its pages were being copied.");
        else if (error == -EBUSY)
                r = epd_bus_error(&e, EPD_ERROR_BUSY,
                                  "PrepareWrite: pages %" PRIu32 "+%" PRIu32 " were shared again (cloned, "
                                  "published or leased) each time their copies finished; try again.",
                                  call->first, call->count);
        else if (error == -EINVAL && s && (uint64_t)call->first + call->count > s->n_pages)
                /* Truncated by its owner while the copies ran: the range is gone, not a
                 * copy that failed. */
                r = epd_bus_error(&e, EPD_ERROR_INVALID_ARGUMENT,
                                  "PrepareWrite: pages %" PRIu32 "+%" PRIu32 " are outside the sequence (%zu pages): "
                                  "it was truncated while its pages were being copied%s.",
                                  call->first, call->count, s->n_pages,
                                  copied > 0 ? " (the pages copied before stay copied)" : "");
        else if (plan_refusal(error))
                /* A later round's plan refused (no free page...): named as the first
                 * round's refusal would be, not as a failed copy. */
                r = pages_error(&e, error, copied > 0 ? "PrepareWrite (the pages copied in an earlier round "
                                                        "stay copied)"
                                                      : "PrepareWrite");
        else if (error < 0 && copied > 0)
                r = epd_bus_error(&e, EPD_ERROR_FAILED,
                                  "PrepareWrite: the copy-on-write of shared pages failed (%s); the %zu pages "
                                  "copied in an earlier round (the range was shared again meanwhile) stay copied.",
                                  strerror(-(copy ?: error)), copied);
        else if (error < 0)
                r = epd_bus_error(&e, EPD_ERROR_FAILED,
                                  "PrepareWrite: the copy-on-write of shared pages failed (%s); nothing changed.",
                                  strerror(-(copy ?: error)));
        else
                r = prepare_write_reply(s, call->msg, call->first, call->count, copied, &e);
        if (r < 0) {
                if (sd_bus_error_is_set(&e))
                        (void)sd_bus_reply_method_error(call->msg, &e);
                else
                        (void)bus_glue_reply_errno(call->msg, r, "PrepareWrite: the reply could not be built.");
        }
done:
        sd_bus_message_unref(call->msg);
        free(call);
}

static int method_prepare_write(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Sequence *s = userdata;
        uint32_t first, count;
        size_t copied;
        int r;

        r = sd_bus_message_read(msg, "uu", &first, &count);
        if (r < 0)
                return r;
        r = access_check(seq_manager(s), msg, s, SEQUENCE_ACCESS_OWNER, NULL, error);
        if (r < 0)
                return r;
        if ((uint64_t)first + count > s->n_pages)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Pages %" PRIu32 "+%" PRIu32 " are outside the sequence (%zu pages).",
                                     first, count, s->n_pages);
        PrepareWriteCall *call = malloc(sizeof *call);
        if (!call)
                return -ENOMEM;
        *call = (PrepareWriteCall) { .msg = msg, .first = first, .count = count };
        r = page_manager_prepare_write_async(s->manager, s, first, count, &copied, prepare_write_ready, call);
        if (r == 1) {
                sd_bus_message_ref(msg); /* answered by prepare_write_ready() */
                return 1;
        }
        free(call);
        if (r < 0)
                return pages_error(error, r, "PrepareWrite");
        return prepare_write_reply(s, msg, first, count, copied, error);
}

/* Who published, for placement answers: the worker's "name" option, else its path. */
static const char *publisher_name(const Worker *w) {
        if (!w)
                return "";
        if (w->name && strlen(w->name) <= 63)
                return w->name;
        return w->path;
}

static int method_publish(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Sequence *s = userdata;
        const uint64_t *hashes = NULL;
        uint32_t first;
        size_t n = 0;
        int r;

        r = sd_bus_message_read(msg, "u", &first);
        if (r < 0)
                return r;
        r = read_hashes(msg, &hashes, &n, error);
        if (r < 0)
                return r;
        Client *c = NULL;
        r = access_check(seq_manager(s), msg, s, SEQUENCE_ACCESS_OWNER, &c, error);
        if (r < 0)
                return r;
        if ((uint64_t)first + n > s->n_pages)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Pages %" PRIu32 "+%zu are outside the sequence (%zu pages).", first, n,
                                     s->n_pages);
        Worker *w = c ? client_get_worker(c) : NULL;
        r = page_manager_publish(s, first, hashes, n, publisher_name(w));
        if (r < 0 && r != -EINVAL && r != -ENOMEM && r != -ERANGE)
                /* The journal refused an entry: it and those after it are not in the
                 * directory; the ones before it are, and durable. */
                return epd_bus_error(error, EPD_ERROR_FAILED,
                                     "Publish: cannot journal the directory entries: %s. The entries before the "
                                     "refused one are published; publish again once the journal takes records.",
                                     strerror(-r));
        if (r < 0)
                return pages_error(error, r, "Publish");
        /* The entries are journaled: acknowledged once durable. */
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        int k = sd_bus_message_new_method_return(msg, &reply);
        if (k >= 0)
                k = sd_bus_message_append(reply, "u", (uint32_t)r);
        if (k < 0)
                return k;
        return reply_journaled(s->manager->manager, msg, reply);
}

static int grant_target(Manager *m, sd_bus_message *msg, Worker **ret, sd_bus_error *error) {
        return bus_read_worker(m, msg, false, ret, error);
}

/* Drops the grants to workers that are gone: a worker's id is never used again (a
 * restarted worker registers with a new one), so such a grant only took a place. */
static size_t prune_grants(Manager *m, Sequence *s) {
        size_t n = 0;
        for (size_t i = 0; i < s->n_grants;) {
                char id[EPD_ID_STRING_MAX];
                if (manager_get_worker(m, epd_id_to_string(&s->grants[i], id))) {
                        i++;
                        continue;
                }
                EpdId gone = s->grants[i];
                (void)page_manager_revoke(s, &gone); /* moves the last one to i */
                n++;
        }
        return n;
}

static int method_grant(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Sequence *s = userdata;
        Manager *m = seq_manager(s);
        Worker *w = NULL;
        int r = grant_target(m, msg, &w, error);
        if (r < 0)
                return r;
        r = access_check(m, msg, s, SEQUENCE_ACCESS_OWNER, NULL, error);
        if (r < 0)
                return r;
        bool had = false;
        for (size_t i = 0; i < s->n_grants; i++)
                had = had || epd_id_equal(&s->grants[i], &w->id);
        r = page_manager_grant(s, &w->id);
        if (r == -EDQUOT && prune_grants(m, s) > 0)
                r = page_manager_grant(s, &w->id); /* the pruned grants go in the same record */
        if (r == -EDQUOT)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "At most %d grants per sequence.",
                                     SEQUENCE_GRANTS_MAX);
        if (r < 0)
                return r;
        r = journal_as(s, error, "Grant", false);
        if (r < 0) {
                if (!had) /* refused: the worker is not let in after all */
                        (void)page_manager_revoke(s, &w->id);
                return r;
        }
        return wal_manager_reply_empty(m, msg);
}

static int method_revoke(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Sequence *s = userdata;
        Manager *m = seq_manager(s);
        Worker *w = NULL;
        int r = grant_target(m, msg, &w, error);
        if (r < 0)
                return r;
        r = access_check(m, msg, s, SEQUENCE_ACCESS_OWNER, NULL, error);
        if (r < 0)
                return r;
        r = page_manager_revoke(s, &w->id);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "Worker %s has no grant on %s.", w->id_str,
                                     s->id_str);
        r = journal(s, error, "Revoke");
        if (r < 0)
                return r;
        return wal_manager_reply_empty(m, msg);
}

static int method_release(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Sequence *s = userdata;
        int r = access_check(seq_manager(s), msg, s, SEQUENCE_ACCESS_OWNER, NULL, error);
        if (r < 0)
                return r;
        Manager *m = seq_manager(s);
        page_manager_release(s); /* journals the release */
        return wal_manager_reply_empty(m, msg);
}

/* Properties: visible to the owner and granted workers only. */
static int property_check(sd_bus *bus, Sequence *s, sd_bus_error *error) {
        return access_check(seq_manager(s), sd_bus_get_current_message(bus), s, SEQUENCE_ACCESS_READ, NULL,
                            error);
}

#define SEQ_PROPERTY(name, body)                                                         \
        BUS_PROPERTY_GETTER(name, Sequence, s, {                                         \
                int _r = property_check(bus, s, error);                                  \
                if (_r < 0)                                                              \
                        return _r;                                                       \
                body                                                                     \
        })

SEQ_PROPERTY(property_seq_id, { return sd_bus_message_append(reply, "s", s->id_str); })
SEQ_PROPERTY(property_seq_owner, { return sd_bus_message_append(reply, "o", owner_path(s)); })
SEQ_PROPERTY(property_seq_arena, {
        Arena *a = page_manager_sequence_arena(s->manager, s);
        return sd_bus_message_append(reply, "s", a ? a->name : "");
})
SEQ_PROPERTY(property_seq_page_size, { return sd_bus_message_append(reply, "t", page_pool_page_size(s->pool)); })
SEQ_PROPERTY(property_seq_created, { return sd_bus_message_append(reply, "t", s->created_usec); })
SEQ_PROPERTY(property_seq_pages, { return reply_pages(reply, s->pages, s->n_pages); })
SEQ_PROPERTY(property_seq_offsets, {
        int r = sd_bus_message_open_container(reply, 'a', "t");
        for (size_t i = 0; r >= 0 && i < s->n_pages; i++)
                r = sd_bus_message_append(reply, "t", page_offset(s->pool, s->pages[i]));
        return r < 0 ? r : sd_bus_message_close_container(reply);
})
SEQ_PROPERTY(property_seq_shared, { return sd_bus_message_append(reply, "u", (uint32_t)sequence_shared_pages(s)); })
SEQ_PROPERTY(property_seq_cow, { return sd_bus_message_append(reply, "t", s->cow_copies); })
SEQ_PROPERTY(property_seq_grants, {
        Manager *m = seq_manager(s);
        int r = sd_bus_message_open_container(reply, 'a', "o");
        for (size_t i = 0; r >= 0 && i < s->n_grants; i++) {
                char id[EPD_ID_STRING_MAX];
                Worker *w = manager_get_worker(m, epd_id_to_string(&s->grants[i], id));
                if (w)
                        r = sd_bus_message_append(reply, "o", w->path);
        }
        return r < 0 ? r : sd_bus_message_close_container(reply);
})

static const sd_bus_vtable sequence_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Id", "s", property_seq_id, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Owner", "o", property_seq_owner, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Arena", "s", property_seq_arena, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("PageSize", "t", property_seq_page_size, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("CreatedAt", "t", property_seq_created, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Pages", "au", property_seq_pages, 0, 0),
        SD_BUS_PROPERTY("Offsets", "at", property_seq_offsets, 0, 0),
        SD_BUS_PROPERTY("SharedPages", "u", property_seq_shared, 0, 0),
        SD_BUS_PROPERTY("CowCopies", "t", property_seq_cow, 0, 0),
        SD_BUS_PROPERTY("Grants", "ao", property_seq_grants, 0, 0),
        SD_BUS_METHOD_WITH_ARGS("Append", SD_BUS_ARGS("u", n_pages), SD_BUS_RESULT("au", pages),
                                method_append, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Truncate", SD_BUS_ARGS("u", n_pages), SD_BUS_NO_RESULT,
                                method_truncate, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Clone", SD_BUS_NO_ARGS, SD_BUS_RESULT("o", sequence), method_clone,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("PrepareWrite", SD_BUS_ARGS("u", first, "u", count),
                                SD_BUS_RESULT("au", pages, "u", copied), method_prepare_write,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Publish", SD_BUS_ARGS("u", first, "at", hashes),
                                SD_BUS_RESULT("u", inserted), method_publish, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Grant", SD_BUS_ARGS("o", worker), SD_BUS_NO_RESULT, method_grant,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Revoke", SD_BUS_ARGS("o", worker), SD_BUS_NO_RESULT, method_revoke,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Release", SD_BUS_NO_ARGS, SD_BUS_NO_RESULT, method_release,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_VTABLE_END,
};

static int sequence_find(sd_bus *bus, const char *path, const char *interface, void *userdata,
                         void **found, sd_bus_error *error) {
        Manager *m = userdata;
        Sequence *s = page_manager_get(m->page_manager, path);
        if (!s || strcmp(s->path, path) != 0)
                return 0;
        *found = s;
        return 1;
}

static bool sequence_readable(const void *o, void *userdata) {
        return page_manager_check_access(o, userdata, SEQUENCE_ACCESS_READ) >= 0;
}

/* The object tree shows the same sequences as Pages.Sequences: all to root, to anyone
 * else those it may read; a reader whose uid cannot be read sees none (docs/security.md,
 * "The read surface"). */
static int sequence_enumerate(sd_bus *bus, const char *path, void *userdata, char ***nodes,
                              sd_bus_error *error) {
        Manager *m = userdata;
        bool root = false;
        Client *c = NULL;
        if (manager_reader(m, sd_bus_get_current_message(bus), &root, &c) < 0)
                root = false, c = NULL;
        return bus_enumerate_paths(m->page_manager->sequences, offsetof(Sequence, path),
                                   root ? NULL : sequence_readable, c, nodes);
}

int bus_sequence_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, PAGES_PATH, "org.epd1.Pages", pages_vtable, NULL, m);
        if (r >= 0)
                r = bus_glue_add_vtable(bus, SEQUENCE_PATH_PREFIX, "org.epd1.Sequence",
                                               sequence_vtable, sequence_find, m);
        if (r >= 0)
                r = sd_bus_add_node_enumerator(bus, NULL, SEQUENCE_PATH_PREFIX, sequence_enumerate, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Pages and Sequence objects: %m");
        return 0;
}
