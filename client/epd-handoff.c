/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd: handoffs and the ring pair. */
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "epd-internal.h"
#include "epd/handoff.h"
#include "id.h"
#include "macro.h"
#include "time-util.h"

#define HANDOFFS_PATH "/org/epd1/handoffs"
#define IFACE_HANDOFFS "org.epd1.Handoffs"
#define IFACE_HANDOFF "org.epd1.Handoff"

static int dup_string(epd_client *c, const char *s, char **ret) {
        char *d = strdup(s);
        if (!d)
                return epd__error(c, -ENOMEM, NULL);
        *ret = d;
        return 0;
}

/* The Prepare call's message (the caller sends and unrefs it). */
static int prepare_message(epd_client *c, const char *request_id, const char *destination, const char *sequence,
                           const uint32_t *layer_groups, size_t n_groups, const epd_handoff_options *opts,
                           sd_bus_message **ret) {
        sd_bus_message *m = NULL;
        if (!c || !request_id || !sequence || (!layer_groups && n_groups > 0))
                return epd__error(c, -EINVAL, NULL);
        int r = epd__new_call(c, HANDOFFS_PATH, IFACE_HANDOFFS, "Prepare", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "sso", request_id, destination ? destination : "", sequence);
        if (r >= 0)
                r = sd_bus_message_append_array(m, 'u', layer_groups, n_groups * sizeof(uint32_t));
        if (r >= 0)
                r = sd_bus_message_open_container(m, 'a', "{sv}");
        if (r >= 0 && opts && opts->arena)
                r = sd_bus_message_append(m, "{sv}", "arena", "s", opts->arena);
        if (r >= 0 && opts && opts->target)
                r = sd_bus_message_append(m, "{sv}", "target", "o", opts->target);
        if (r >= 0 && opts && opts->timeout_usec)
                r = sd_bus_message_append(m, "{sv}", "timeout_usec", "t", opts->timeout_usec);
        if (r >= 0 && opts && opts->ready)
                r = sd_bus_message_append(m, "{sv}", "ready", "u", opts->ready);
        if (r >= 0 && opts && opts->release_on_commit)
                r = sd_bus_message_append(m, "{sv}", "release_on_commit", "b", 1);
        if (r >= 0)
                r = sd_bus_message_close_container(m);
        if (r < 0) {
                sd_bus_message_unref(m);
                return epd__error(c, r, NULL);
        }
        *ret = m;
        return 0;
}

int epd_handoff_prepare(epd_client *c, const char *request_id, const char *destination,
                        const char *sequence, const uint32_t *layer_groups, size_t n_groups,
                        const epd_handoff_options *opts, char **ret_path, uint64_t *ret_token) {
        sd_bus_message *m = NULL, *reply = NULL;
        const char *path;
        uint64_t token;
        int r = prepare_message(c, request_id, destination, sequence, layer_groups, n_groups, opts, &m);
        if (r < 0)
                return r;
        r = epd__send(c, m, &reply);
        sd_bus_message_unref(m);
        if (r < 0)
                return r;
        /* The path first and alone: past it the daemon made the handoff, which a failure
         * below gives back (as the registration's and the features' do). */
        r = sd_bus_message_read(reply, "o", &path);
        if (r < 0) {
                sd_bus_message_unref(reply);
                return epd__error(c, r, NULL);
        }
        r = sd_bus_message_read(reply, "t", &token);
        if (r < 0)
                r = epd__error(c, r, NULL);
        else if (ret_path)
                r = dup_string(c, path, ret_path);
        if (r < 0)
                (void)epd__undo(c, r, path, IFACE_HANDOFF, "Release", NULL);
        else if (ret_token)
                *ret_token = token;
        sd_bus_message_unref(reply);
        return r < 0 ? r : 0;
}

typedef struct PrepareCall {
        epd_client *client;
        epd_handoff_prepared_fn fn;
        void *userdata;
} PrepareCall;

static int on_prepared(sd_bus_message *m, void *userdata, sd_bus_error *ret_error) {
        PrepareCall *call = userdata;
        epd_client *c = call->client;
        const sd_bus_error *e = sd_bus_message_get_error(m);
        const char *path = NULL;
        uint64_t token = 0;
        int r = 0;

        if (c->async_pending > 0)
                c->async_pending--;

        if (e)
                r = epd__error(c, sd_bus_error_get_errno(e) > 0 ? -sd_bus_error_get_errno(e) : -EIO, e);
        else if ((r = sd_bus_message_read(m, "o", &path)) < 0)
                r = epd__error(c, r, NULL);
        else if ((r = sd_bus_message_read(m, "t", &token)) < 0) {
                /* Past the path the daemon made the handoff, and fn gets no path to give it
                 * back by: given back here, as the synchronous prepare does (not while
                 * disconnecting: the connection's end lets go of it). */
                r = epd__error(c, r, NULL);
                if (!c->closing)
                        (void)epd__undo(c, r, path, IFACE_HANDOFF, "Release", NULL);
        } else
                epd__clear_error(c);
        if (!c->closing) /* epd_disconnect() drops it without calling fn */
                call->fn(c, r < 0 ? r : 0, r < 0 ? NULL : path, r < 0 ? 0 : token, call->userdata);
        return 0;
}

int epd_handoff_prepare_async(epd_client *c, const char *request_id, const char *destination,
                              const char *sequence, const uint32_t *layer_groups, size_t n_groups,
                              const epd_handoff_options *opts, epd_handoff_prepared_fn fn, void *userdata) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *m = NULL;
        if (!fn)
                return epd__error(c, -EINVAL, NULL);
        int r = prepare_message(c, request_id, destination, sequence, layer_groups, n_groups, opts, &m);
        if (r < 0)
                return r;
        PrepareCall *call = calloc(1, sizeof *call);
        if (!call)
                return epd__error(c, -ENOMEM, NULL);
        *call = (PrepareCall) { .client = c, .fn = fn, .userdata = userdata };
        r = epd__send_async(c, m, on_prepared, call);
        if (r >= 0)
                c->async_pending++;
        return r;
}

int epd_handoff_layer_group_ready(epd_client *c, const char *handoff, uint32_t group) {
        if (!c || !handoff)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, handoff, IFACE_HANDOFF, "LayerGroupReady", NULL, "u", group);
}

void epd_handoff_accepted_done(epd_handoff_accepted *a) {
        if (!a)
                return;
        free(a->path);
        free(a->arena);
        free(a->offsets);
        memset(a, 0, sizeof *a);
}

static int read_accepted(epd_client *c, sd_bus_message *reply, epd_handoff_accepted *ret) {
        const char *path, *arena;
        const void *offs;
        size_t sz;
        /* The path first and alone: past it the handoff is this client's, which a failure
         * below gives back (Release: rolled back), as Prepare's is. */
        int r = sd_bus_message_read(reply, "o", &path);
        if (r < 0) {
                sd_bus_message_unref(reply);
                return epd__error(c, r, NULL);
        }
        r = sd_bus_message_read(reply, "ts", &ret->token, &arena);
        if (r >= 0)
                r = sd_bus_message_read_array(reply, 't', &offs, &sz);
        if (r >= 0)
                r = sd_bus_message_read(reply, "uu", &ret->n_groups, &ret->groups_done);
        if (r >= 0) {
                ret->path = strdup(path);
                ret->arena = strdup(arena);
                ret->n_pages = sz / sizeof(uint64_t);
                ret->offsets = malloc(sz ? sz : 1);
                if (!ret->path || !ret->arena || !ret->offsets)
                        r = -ENOMEM;
                else
                        memcpy(ret->offsets, offs, sz);
        }
        if (r < 0) {
                epd_handoff_accepted_done(ret);
                r = epd__undo(c, epd__error(c, r, NULL), path, IFACE_HANDOFF, "Release", NULL);
        }
        sd_bus_message_unref(reply); /* path is the reply's */
        return r < 0 ? r : 0;
}

int epd_handoff_accept(epd_client *c, const char *request_id, epd_handoff_accepted *ret) {
        sd_bus_message *reply = NULL;
        if (!c || !request_id || !ret)
                return epd__error(c, -EINVAL, NULL);
        memset(ret, 0, sizeof *ret);
        int r = epd__call(c, HANDOFFS_PATH, IFACE_HANDOFFS, "Accept", &reply, "s", request_id);
        if (r < 0)
                return r;
        return read_accepted(c, reply, ret);
}

int epd_handoff_accept_wait(epd_client *c, const char *request_id, uint64_t timeout_usec,
                            epd_handoff_accepted *ret) {
        sd_bus_message *m = NULL, *reply = NULL;
        if (!c || !request_id || !ret)
                return epd__error(c, -EINVAL, NULL);
        memset(ret, 0, sizeof *ret);
        int r = epd__new_call(c, HANDOFFS_PATH, IFACE_HANDOFFS, "AcceptWait", &m);
        if (r < 0)
                return r;
        r = sd_bus_message_append(m, "st", request_id, timeout_usec);
        if (r < 0) {
                sd_bus_message_unref(m);
                return epd__error(c, r, NULL);
        }
        /* The daemon answers by the deadline; the call's own timeout leaves it room. */
        r = epd__send_timeout(c, m, timeout_usec + 5 * 1000000ULL, &reply);
        sd_bus_message_unref(m);
        if (r < 0)
                return r;
        return read_accepted(c, reply, ret);
}

static int commit(epd_client *c, const char *handoff, const char *method, char **ret_sequence) {
        sd_bus_message *reply = NULL;
        const char *seq;
        if (!c || !handoff)
                return epd__error(c, -EINVAL, NULL);
        int r = epd__call(c, handoff, IFACE_HANDOFF, method, &reply, NULL);
        if (r < 0)
                return r;
        r = sd_bus_message_read(reply, "o", &seq);
        if (r >= 0 && ret_sequence) {
                /* The commit made the decode sequence, this client's: given back when it
                 * cannot be handed over. */
                r = dup_string(c, seq, ret_sequence);
                if (r < 0)
                        (void)epd__undo(c, r, seq, "org.epd1.Sequence", "Release", NULL);
        } else if (r < 0)
                r = epd__error(c, r, NULL);
        sd_bus_message_unref(reply);
        return r < 0 ? r : 0;
}

int epd_handoff_commit(epd_client *c, const char *handoff, char **ret_sequence) {
        return commit(c, handoff, "Commit", ret_sequence);
}

int epd_handoff_commit_and_release(epd_client *c, const char *handoff, char **ret_sequence) {
        return commit(c, handoff, "CommitAndRelease", ret_sequence);
}

int epd_handoff_rollback(epd_client *c, const char *handoff) {
        if (!c || !handoff)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, handoff, IFACE_HANDOFF, "Rollback", NULL, NULL);
}

int epd_handoff_watch(epd_client *c, bool enable) {
        if (!c)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, HANDOFFS_PATH, IFACE_HANDOFFS, "Watch", NULL, "b", (int)enable);
}

int epd_handoff_release(epd_client *c, const char *handoff) {
        if (!c || !handoff)
                return epd__error(c, -EINVAL, NULL);
        return epd__call(c, handoff, IFACE_HANDOFF, "Release", NULL, NULL);
}

/* One Properties.GetAll round trip (an idle bus round trip costs tens of µs). */
static int read_status(sd_bus_message *reply, epd_handoff_status *ret) {
        static const struct {
                const char *name;
                char type;
                size_t offset;
        } props[] = {
                { "State", 's', offsetof(epd_handoff_status, state) },
                { "Cause", 's', offsetof(epd_handoff_status, cause) },
                { "GroupsDone", 'u', offsetof(epd_handoff_status, groups_done) },
                { "Groups", 'u', offsetof(epd_handoff_status, n_groups) },
                { "Bytes", 't', offsetof(epd_handoff_status, bytes) },
        };
        unsigned seen = 0;
        const char *name;
        int r;

        r = sd_bus_message_enter_container(reply, 'a', "{sv}");
        while (r >= 0 && (r = sd_bus_message_enter_container(reply, 'e', "sv")) > 0) {
                size_t i;
                r = sd_bus_message_read(reply, "s", &name);
                for (i = 0; r >= 0 && i < ELEMENTSOF(props) && strcmp(props[i].name, name) != 0; i++)
                        ;
                if (r >= 0 && i < ELEMENTSOF(props)) {
                        char t[2] = { props[i].type, 0 };
                        void *dst = (uint8_t *)ret + props[i].offset;
                        r = sd_bus_message_enter_container(reply, 'v', t);
                        if (r >= 0 && props[i].type == 's') {
                                const char *s;
                                r = sd_bus_message_read_basic(reply, 's', &s);
                                if (r >= 0)
                                        snprintf(dst, sizeof ret->state, "%s", s);
                        } else if (r >= 0)
                                r = sd_bus_message_read_basic(reply, props[i].type, dst);
                        if (r >= 0)
                                r = sd_bus_message_exit_container(reply);
                        if (r >= 0)
                                seen |= 1U << i;
                } else if (r >= 0)
                        r = sd_bus_message_skip(reply, "v");
                if (r >= 0)
                        r = sd_bus_message_exit_container(reply);
        }
        if (r >= 0)
                r = sd_bus_message_exit_container(reply);
        if (r >= 0 && seen != (1U << ELEMENTSOF(props)) - 1)
                r = -EBADMSG; /* a daemon without one of them */
        return r;
}

int epd_handoff_get(epd_client *c, const char *handoff, epd_handoff_status *ret) {
        sd_bus_message *reply = NULL;
        if (!c || !handoff || !ret)
                return epd__error(c, -EINVAL, NULL);
        memset(ret, 0, sizeof *ret);
        int r = epd__call(c, handoff, "org.freedesktop.DBus.Properties", "GetAll", &reply, "s", IFACE_HANDOFF);
        if (r < 0)
                return r;
        r = read_status(reply, ret);
        sd_bus_message_unref(reply);
        return r < 0 ? epd__error(c, r, NULL) : 0;
}

/* ---- ring ---- */

epd_ring_client *epd_ring_close(epd_ring_client *r) {
        if (!r)
                return NULL;
        if (r->base && r->base != MAP_FAILED)
                munmap(r->base, r->size);
        if (r->memfd >= 0)
                close(r->memfd);
        if (r->submit_fd >= 0)
                close(r->submit_fd);
        if (r->complete_fd >= 0)
                close(r->complete_fd);
        if (r->daemon_fd >= 0)
                close(r->daemon_fd);
        pthread_mutex_destroy(&r->submit_lock);
        free(r);
        return NULL;
}

int epd_ring_release(epd_client *c, epd_ring_client *r) {
        int e = c ? epd__call(c, HANDOFFS_PATH, IFACE_HANDOFFS, "CloseRing", NULL, NULL) : -EINVAL;
        epd_ring_close(r);
        return e;
}

/* A pidfd of the daemon at the other end of c, on a direct connection. -1 when it cannot
 * be had (a bus connection, an older kernel): a wait then ends only by its timeout. */
static int daemon_pidfd(epd_client *c) {
        pid_t pid = 0;
        /* Only the direct socket's own peer: a pid a bus broker reports may be of
         * another pid namespace (or reused meanwhile), and a wrong pidfd would end a wait
         * on a live daemon. On a bus, waits end by their timeouts as before. */
        if (c->direct) {
                struct ucred cred;
                socklen_t len = sizeof cred;
                if (getsockopt(sd_bus_get_fd(c->bus), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0)
                        pid = cred.pid;
        }
        if (pid <= 0)
                return -1;
        int fd = (int)syscall(SYS_pidfd_open, pid, 0);
        return fd < 0 ? -1 : fd;
}

int epd_ring_open(epd_client *c, uint32_t sq_entries, uint32_t cq_entries, epd_ring_client **ret) {
        sd_bus_message *reply = NULL;
        int fds[3];
        uint64_t size;
        if (!c || !ret)
                return epd__error(c, -EINVAL, NULL);
        int r = epd__call(c, HANDOFFS_PATH, IFACE_HANDOFFS, "OpenRing", &reply, "uu", sq_entries, cq_entries);
        if (r < 0)
                return r;
        epd_ring_client *rc = calloc(1, sizeof *rc);
        if (!rc) {
                sd_bus_message_unref(reply);
                return epd__error(c, -ENOMEM, NULL);
        }
        rc->memfd = rc->submit_fd = rc->complete_fd = -1;
        rc->daemon_fd = daemon_pidfd(c);
        pthread_mutex_init(&rc->submit_lock, NULL);
        r = sd_bus_message_read(reply, "hhht", &fds[0], &fds[1], &fds[2], &size);
        if (r >= 0) {
                /* The message owns its fds: keep duplicates. */
                rc->memfd = fcntl(fds[0], F_DUPFD_CLOEXEC, 3);
                rc->submit_fd = fcntl(fds[1], F_DUPFD_CLOEXEC, 3);
                rc->complete_fd = fcntl(fds[2], F_DUPFD_CLOEXEC, 3);
                if (rc->memfd < 0 || rc->submit_fd < 0 || rc->complete_fd < 0)
                        r = -errno;
        }
        sd_bus_message_unref(reply);
        if (r >= 0) {
                /* A ring file shorter than the size the daemon gave, or one that can be made
                 * shorter (the daemon seals it), would fault (SIGBUS); a blocking eventfd
                 * would block a wait of 0 or a submission (the daemon makes them
                 * non-blocking). Checked, not trusted. */
                struct stat st;
                int seals = fcntl(rc->memfd, F_GET_SEALS);
                if (fstat(rc->memfd, &st) < 0)
                        r = -errno;
                else if ((uint64_t)st.st_size < size || seals < 0 || !(seals & F_SEAL_SHRINK) ||
                         !(fcntl(rc->submit_fd, F_GETFL) & O_NONBLOCK) ||
                         !(fcntl(rc->complete_fd, F_GETFL) & O_NONBLOCK))
                        r = -EBADMSG;
        }
        if (r >= 0) {
                rc->size = size;
                rc->base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, rc->memfd, 0);
                if (rc->base == MAP_FAILED)
                        r = -errno;
        }
        if (r >= 0)
                r = epd_ring_attach(&rc->ring, rc->base, size, 0);
        if (r < 0) {
                epd_ring_close(rc);
                /* The daemon made the ring: let it go there too, or this client could
                 * never open one again (one ring a client). This call's error stays. */
                (void)epd__call(c, HANDOFFS_PATH, IFACE_HANDOFFS, "CloseRing", NULL, NULL);
                return epd__error(c, r, NULL);
        }
        *ret = rc;
        return 0;
}

int epd_ring_submit(epd_ring_client *r, const struct epd_ring_record *rec) {
        if (!r || !rec)
                return -EINVAL;
        /* The daemon let go of the ring: nothing submitted now would be read. */
        if (__atomic_load_n(epd_ring_closed(&r->ring), __ATOMIC_ACQUIRE))
                return -ECONNRESET;
        pthread_mutex_lock(&r->submit_lock);
        int e = epd_ring_produce(&r->ring.sq, rec);
        pthread_mutex_unlock(&r->submit_lock);
        if (e < 0)
                return e;
        uint64_t one = 1;
        if (write(r->submit_fd, &one, sizeof one) < 0 && errno != EAGAIN)
                return -errno;
        return 0;
}

int epd_ring_layer_group_ready(epd_ring_client *r, const char *request_id, uint64_t token,
                               uint32_t group, uint64_t user_data) {
        EpdId id;
        struct epd_ring_record rec;
        if (!r || !request_id || epd_id_from_string(request_id, &id) < 0)
                return -EINVAL;
        epd_ring_record_layer_group_ready(&rec, id.bytes, token, group, user_data);
        return epd_ring_submit(r, &rec);
}

int epd_ring_accept(epd_ring_client *r, const char *request_id, uint64_t timeout_usec, uint64_t user_data) {
        EpdId id;
        struct epd_ring_record rec;
        if (!r || !request_id || epd_id_from_string(request_id, &id) < 0)
                return -EINVAL;
        epd_ring_record_accept(&rec, id.bytes, timeout_usec, user_data);
        return epd_ring_submit(r, &rec);
}

int epd_ring_commit(epd_ring_client *r, const char *request_id, uint64_t token, int release, uint64_t user_data) {
        EpdId id;
        struct epd_ring_record rec;
        if (!r || !request_id || token == 0 || epd_id_from_string(request_id, &id) < 0)
                return -EINVAL;
        epd_ring_record_commit(&rec, id.bytes, token, release, user_data);
        return epd_ring_submit(r, &rec);
}

int epd_ring_daemon_fd(const epd_ring_client *r) {
        if (!r)
                return -EINVAL;
        return r->daemon_fd >= 0 ? r->daemon_fd : -ENODATA;
}

uint32_t epd_ring_overflows(const epd_ring_client *r) {
        return r ? __atomic_load_n(r->ring.cq_overflow, __ATOMIC_ACQUIRE) : 0;
}

int epd_ring_fd(const epd_ring_client *r) {
        return r ? r->complete_fd : -EINVAL;
}

int epd_ring_next(epd_ring_client *r, struct epd_ring_record *rec, uint64_t timeout_usec) {
        if (!r || !rec)
                return -EINVAL;
        uint64_t deadline = usec_add(now_usec(CLOCK_MONOTONIC), timeout_usec);
        for (;;) {
                int e = epd_ring_consume(&r->ring.cq, rec);
                if (e != -EAGAIN)
                        return e;
                /* Empty: clear the eventfd's count (the wakeups of records already taken)
                 * and look again, for a record whose wakeup that read took. The fd is then
                 * readable only for records posted after this look: a caller polling it in
                 * its own loop does not spin on stale wakeups. The daemon posts a record
                 * before its wakeup, so a count of 0 means no record is missed. */
                uint64_t v;
                /* Polled first: the O_NONBLOCK checked at open belongs to the file
                 * description the daemon shares, which it may have cleared since; a read
                 * of a count of 0 would then block, a wait of 0 included. */
                struct pollfd ready = { .fd = r->complete_fd, .events = POLLIN };
                if (poll(&ready, 1, 0) > 0 && (ready.revents & POLLIN) && read(r->complete_fd, &v, sizeof v) > 0) {
                        e = epd_ring_consume(&r->ring.cq, rec);
                        if (e != -EAGAIN)
                                return e;
                }
                /* The daemon let go of the ring (set after its last record): once those
                 * are taken, nothing more comes, though the daemon lives on. */
                if (__atomic_load_n(epd_ring_closed(&r->ring), __ATOMIC_ACQUIRE)) {
                        e = epd_ring_consume(&r->ring.cq, rec);
                        return e != -EAGAIN ? e : -ECONNRESET;
                }
                /* Records the daemon keeps back for want of room (the CQ was full): the
                 * room is there now; a wakeup has it post them. Read after the head was
                 * published (the daemon looks at the head after setting the count). */
                __atomic_thread_fence(__ATOMIC_SEQ_CST);
                if (__atomic_load_n(epd_ring_cq_backlog(&r->ring), __ATOMIC_RELAXED) > 0) {
                        uint64_t one = 1;
                        if (write(r->submit_fd, &one, sizeof one) < 0 && errno != EAGAIN)
                                return -errno;
                }
                uint64_t now = now_usec(CLOCK_MONOTONIC);
                if (now >= deadline)
                        return -EAGAIN;
                struct pollfd p[2] = { { .fd = r->complete_fd, .events = POLLIN },
                                       { .fd = r->daemon_fd, .events = POLLIN } };
                int ms = deadline == UINT64_MAX ? -1 : (int)MIN((deadline - now + 999) / 1000, (uint64_t)INT32_MAX);
                e = poll(p, r->daemon_fd >= 0 ? 2 : 1, ms);
                if (e < 0 && errno != EINTR)
                        return -errno;
                if (e > 0 && r->daemon_fd >= 0 && (p[1].revents & POLLIN) && !(p[0].revents & POLLIN)) {
                        /* The daemon exited: what it posted before dying (its wakeup perhaps
                         * lost with it) is still taken; then nothing more will come. */
                        e = epd_ring_consume(&r->ring.cq, rec);
                        return e != -EAGAIN ? e : -ECONNRESET;
                }
        }
}
