/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/mappers.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core/arena.h"
#include "core/client.h"
#include "core/manager.h"
#include "id.h"
#include "log.h"

#define MAPPER_PREFIX "mapper-"

/* A process of this start that was handed host arenas: stored as
 * mapper-<start token>-<pid>-<clients>, stored again under the new count when it
 * changes (a restart waits for that many registrations of it). */
typedef struct Mapper {
        pid_t pid;
        unsigned n_clients;
        char name[80];
} Mapper;

/* One of the previous start's, its process still running: part of the fence. */
typedef struct OldMapper {
        Manager *manager;
        int pidfd;
        pid_t pid; /* as the pidfd says (/proc/self/fdinfo) */
        unsigned clients_left; /* its clients with host arenas then: each registers again */
        char *name;
        sd_event_source *watch;
} OldMapper;

struct MapperSet {
        Mapper *cur;
        size_t n_cur;
        OldMapper **old;
        size_t n_old;
        sd_event_source *fence_timer;
        char token[17]; /* this start's, in the names it stores */
        bool fenced;
};

static MapperSet *set_get(Manager *m) {
        if (!m->mappers)
                m->mappers = calloc(1, sizeof *m->mappers);
        return m->mappers;
}

static pid_t pidfd_pid(int fd) {
        char path[64], line[128];
        pid_t pid = -1;
        snprintf(path, sizeof path, "/proc/self/fdinfo/%d", fd);
        FILE *f = fopen(path, "re");
        if (!f)
                return -1;
        while (fgets(line, sizeof line, f))
                if (sscanf(line, "Pid: %d", &pid) == 1)
                        break;
        fclose(f);
        return pid;
}

static OldMapper *old_free(OldMapper *o) {
        if (!o)
                return NULL;
        sd_event_source_disable_unref(o->watch);
        safe_close(o->pidfd);
        free(o->name);
        free(o);
        return NULL;
}

int mappers_take(Manager *m, FdStore *store) {
        MapperSet *s = set_get(m);
        if (!s)
                return log_oom();
        for (size_t i = 0; store && i < store->n; i++) {
                const char *name = store->names ? store->names[i] : NULL;
                if (!name || strncmp(name, MAPPER_PREFIX, strlen(MAPPER_PREFIX)) != 0)
                        continue;
                int fd = fdstore_take(store, name);
                if (fd < 0)
                        continue;
                OldMapper *o = calloc(1, sizeof *o), **v = reallocarray(s->old, s->n_old + 1, sizeof *v);
                if (v)
                        s->old = v;
                if (!o || !v || !(o->name = strdup(name))) {
                        /* Kept in systemd's store: the next start looks again. */
                        free(o);
                        safe_close(fd);
                        return log_oom();
                }
                o->manager = m;
                o->pidfd = fd;
                o->pid = pidfd_pid(fd);
                const char *dash = strrchr(name, '-');
                unsigned n = 0;
                o->clients_left = dash && sscanf(dash + 1, "%u", &n) == 1 && n > 0 ? n : 1;
                s->old[s->n_old++] = o;
        }
        return 0;
}

static void fence_set(Manager *m, bool on) {
        for (const Subsystem *const *sp = manager_subsystems(); *sp; sp++)
                if ((*sp)->fence)
                        (*sp)->fence(m, on);
}

static void fence_end(Manager *m, const char *why) {
        MapperSet *s = m->mappers;
        if (!s || !s->fenced)
                return;
        s->fenced = false;
        s->fence_timer = sd_event_source_disable_unref(s->fence_timer);
        fence_set(m, false);
        log_info("Restored feature arenas unfenced: %s.", why);
}

/* o's process is done with the arenas (exited, or the wait is over): out of the store. */
static void old_forget(Manager *m, OldMapper *o) {
        MapperSet *s = m->mappers;
        (void)fdstore_remove(o->name);
        for (size_t i = 0; i < s->n_old; i++)
                if (s->old[i] == o) {
                        s->old[i] = s->old[--s->n_old];
                        break;
                }
        old_free(o);
}

static int on_old_exited(sd_event_source *src, int fd, uint32_t revents, void *userdata) {
        OldMapper *o = userdata;
        Manager *m = o->manager;
        log_debug("Worker process %d of before the restart has exited.", (int)o->pid);
        old_forget(m, o);
        if (m->mappers->n_old == 0)
                fence_end(m, "every worker process of before the restart has exited");
        return 0;
}

static int on_fence_over(sd_event_source *src, uint64_t usec, void *userdata) {
        Manager *m = userdata;
        MapperSet *s = m->mappers;
        char pids[256] = "";
        size_t k = 0;
        for (size_t i = 0; i < s->n_old && k < sizeof pids - 16; i++)
                k += (size_t)snprintf(pids + k, sizeof pids - k, "%s%d", i ? " " : "", (int)s->old[i]->pid);
        log_warning("Worker process(es) of before the restart still run after %u s (pid %s): ending the fence of "
                    "the restored feature arenas (one that still reads or writes a feature it held then may see "
                    "its bytes change).",
                    (unsigned)(MAPPERS_FENCE_USEC / USEC_PER_SEC), pids);
        while (s->n_old > 0)
                old_forget(m, s->old[0]);
        fence_end(m, "the wait is over");
        return 0;
}

int mappers_start(Manager *m) {
        MapperSet *s = set_get(m);
        uint64_t token = 0;
        bool restored = false;
        EpdId id;
        int r;

        if (!s)
                return log_oom();
        if (epd_id_random(&id) >= 0)
                memcpy(&token, id.bytes, sizeof token);
        snprintf(s->token, sizeof s->token, "%016" PRIx64, token);

        for (size_t i = 0; i < m->n_arenas; i++)
                if (m->arenas[i]->domain == MEMORY_HOST && m->arenas[i]->adopted &&
                    m->arenas[i]->usage == ARENA_USAGE_FEATURE)
                        restored = true;
        for (size_t i = 0; i < s->n_old;) {
                OldMapper *o = s->old[i];
                struct pollfd p = { .fd = o->pidfd, .events = POLLIN };
                /* One process under two names (a crash between storing its new count and
                 * removing the old): one entry, the larger count. */
                for (size_t j = i + 1; j < s->n_old;)
                        if (o->pid > 0 && s->old[j]->pid == o->pid) {
                                o->clients_left = MAX(o->clients_left, s->old[j]->clients_left);
                                old_forget(m, s->old[j]);
                        } else
                                j++;
                if (!restored || poll(&p, 1, 0) != 0) {
                        /* Exited (or nothing it mapped came back): nothing to wait for. */
                        old_forget(m, o);
                        continue;
                }
                r = sd_event_add_io(m->event, &o->watch, o->pidfd, EPOLLIN, on_old_exited, o);
                if (r < 0)
                        return log_error_errno(r, "Cannot watch worker process %d of before the restart: %m",
                                               (int)o->pid);
                i++;
        }
        if (s->n_old == 0)
                return 0;
        r = sd_event_add_time_relative(m->event, &s->fence_timer, CLOCK_MONOTONIC, MAPPERS_FENCE_USEC,
                                       USEC_PER_SEC / 10, on_fence_over, m);
        if (r < 0)
                return log_error_errno(r, "Cannot arm the restart fence's timer: %m");
        s->fenced = true;
        fence_set(m, true);
        log_notice("%zu worker process(es) of before the restart still run (pid %d%s): the restored feature arenas "
                   "are fenced (no free byte handed out, no restored feature evicted) until they exit, at most "
                   "%u s.",
                   s->n_old, (int)s->old[0]->pid, s->n_old > 1 ? ", ..." : "",
                   (unsigned)(MAPPERS_FENCE_USEC / USEC_PER_SEC));
        return 0;
}

/* e stored under its current count (the previous name, if any, removed). A pidfd of its
 * own each time: systemd's store keeps one copy of an open file, whatever its names (the
 * same pidfd again would be dropped as stored already, and then removed with the old
 * name). */
static int mapper_store(MapperSet *s, Mapper *e) {
        char name[sizeof e->name];
        snprintf(name, sizeof name, MAPPER_PREFIX "%s-%d-%u", s->token, (int)e->pid, e->n_clients);
        int fd = (int)syscall(SYS_pidfd_open, e->pid, 0);
        if (fd < 0)
                return -errno;
        int r = fdstore_push(name, fd);
        safe_close(fd);
        if (r < 0)
                return r;
        if (e->name[0] && strcmp(e->name, name) != 0)
                (void)fdstore_remove(e->name);
        memcpy(e->name, name, sizeof name);
        return 0;
}

void mappers_add(Manager *m, Client *c) {
        MapperSet *s = set_get(m);
        if (!s || c->pid <= 0)
                return;
        /* A process of before whose clients have all registered again has dropped what
         * they held then (one that had two is waited for until both have). */
        for (size_t i = 0; i < s->n_old; i++)
                if (s->old[i]->pid == c->pid && --s->old[i]->clients_left == 0) {
                        log_debug("Worker process %d of before the restart registered again.", (int)c->pid);
                        old_forget(m, s->old[i]);
                        break;
                }
        if (s->fenced && s->n_old == 0)
                fence_end(m, "every worker process of before the restart has exited or registered again");
        if (c->mapper || !getenv("NOTIFY_SOCKET"))
                return;
        for (size_t i = 0; i < s->n_cur; i++)
                if (s->cur[i].pid == c->pid) {
                        s->cur[i].n_clients++;
                        (void)mapper_store(s, &s->cur[i]); /* failed: under the old count still */
                        c->mapper = true;
                        return;
                }
        Mapper *v = reallocarray(s->cur, s->n_cur + 1, sizeof *v);
        if (!v) {
                log_debug("Worker process %d: out of memory; a restart will not wait for it.", (int)c->pid);
                return;
        }
        s->cur = v;
        Mapper *e = &s->cur[s->n_cur];
        *e = (Mapper){ .pid = c->pid, .n_clients = 1 };
        int r = mapper_store(s, e);
        if (r < 0) {
                log_debug_errno(r, "Worker process %d: not in the fd store (%m); a restart will not wait for it.",
                                (int)c->pid);
                return;
        }
        s->n_cur++;
        c->mapper = true;
}

void mappers_drop(Manager *m, Client *c) {
        MapperSet *s = m->mappers;
        if (!s || !c->mapper)
                return;
        c->mapper = false;
        for (size_t i = 0; i < s->n_cur; i++)
                if (s->cur[i].pid == c->pid) {
                        /* While stopping, the store keeps what the next start needs. */
                        if (m->stopping)
                                return;
                        if (--s->cur[i].n_clients > 0) {
                                (void)mapper_store(s, &s->cur[i]); /* failed: a restart waits for one more */
                                return;
                        }
                        (void)fdstore_remove(s->cur[i].name);
                        s->cur[i] = s->cur[--s->n_cur];
                        return;
                }
}

void mappers_free(Manager *m) {
        MapperSet *s = m->mappers;
        if (!s)
                return;
        /* What is stored stays stored: the next start needs it. */
        for (size_t i = 0; i < s->n_old; i++)
                old_free(s->old[i]);
        free(s->old);
        free(s->cur);
        sd_event_source_disable_unref(s->fence_timer);
        free(s);
        m->mappers = NULL;
}
