/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "list.h"
#include "macro.h"
#include "transport/local.h"
#include "transport/transport-util.h"

typedef struct LocalJob LocalJob;
struct LocalJob {
        uint8_t *dst;
        const uint8_t *src;
        uint64_t length;
        uint64_t cookie;
        bool same_region;
        LIST_FIELDS(LocalJob, queue);
};

typedef struct LocalTransport {
        Transport base;
        TransportRegion *regions[LOCAL_TRANSPORT_REGIONS_MAX];

        pthread_mutex_t lock;
        pthread_cond_t cond;
        QUEUE_HEAD(LocalJob, jobs);       /* queued, not started */
        TransportDoneQueue done;          /* finished, not yet polled */
        uint64_t inflight;                /* queued + running + finished-not-polled */
        bool stop;

        int efd;
        pthread_t *threads;
        unsigned n_threads;
} LocalTransport;

static LocalTransport *LT(Transport *t) {
        return container_of(t, LocalTransport, base);
}

/* Under the lock. Returns whether the eventfd must be kicked (the list was empty). */
static bool push_done(LocalTransport *l, uint64_t cookie, int error, uint64_t bytes) {
        if (transport_done_queue_add(&l->done, &(TransportCompletion){ .cookie = cookie, .error = error, .writes = 1,
                                                                        .bytes = bytes }) < 0)
                abort(); /* a completion must never be lost */
        return l->done.n == 1;
}

static void kick(LocalTransport *l) {
        uint64_t one = 1;
        /* EAGAIN means the counter is saturated: the loop is woken anyway. */
        (void)!write(l->efd, &one, sizeof one);
}

static void job_copy(const LocalJob *j) {
        if (j->dst == j->src)
                return;
        if (j->same_region)
                memmove(j->dst, j->src, j->length);
        else
                memcpy(j->dst, j->src, j->length);
}

#define LOCAL_BATCH_MAX 32

static void *worker(void *userdata) {
        LocalTransport *l = userdata;
        LocalJob *batch[LOCAL_BATCH_MAX];

        pthread_mutex_lock(&l->lock);
        for (;;) {
                while (!l->stop && !l->jobs.first)
                        pthread_cond_wait(&l->cond, &l->lock);
                if (l->stop)
                        break;
                /* Take a share of the queue at once: one lock round trip per batch, not
                 * per write, while the other threads still get work. */
                size_t n = 0, queued = 0;
                for (LocalJob *j = l->jobs.first; j && queued < LOCAL_BATCH_MAX * l->n_threads; j = j->queue_next)
                        queued++;
                size_t want = CLAMP(queued / l->n_threads, (size_t)1, (size_t)LOCAL_BATCH_MAX);
                while (n < want && l->jobs.first) {
                        LocalJob *j = l->jobs.first;
                        QUEUE_REMOVE(queue, l->jobs, j);
                        batch[n++] = j;
                }
                pthread_mutex_unlock(&l->lock);

                for (size_t i = 0; i < n; i++)
                        job_copy(batch[i]);

                pthread_mutex_lock(&l->lock);
                bool k = false;
                for (size_t i = 0; i < n; i++) {
                        k |= push_done(l, batch[i]->cookie, 0, batch[i]->length);
                        free(batch[i]);
                }
                if (k)
                        kick(l);
        }
        pthread_mutex_unlock(&l->lock);
        return NULL;
}

static int local_register(Transport *t, TransportRegion *r) {
        LocalTransport *l = LT(t);
        if (!r || r->id >= LOCAL_TRANSPORT_REGIONS_MAX)
                return -EINVAL;
        if (r->domain != MEMORY_HOST || !r->host_base || r->size == 0)
                return -EOPNOTSUPP;
        pthread_mutex_lock(&l->lock);
        int e = 0;
        if (l->regions[r->id] && l->regions[r->id] != r)
                e = -EEXIST;
        else
                l->regions[r->id] = r;
        pthread_mutex_unlock(&l->lock);
        return e;
}

static void local_unregister(Transport *t, TransportRegion *r) {
        LocalTransport *l = LT(t);
        if (!r || r->id >= LOCAL_TRANSPORT_REGIONS_MAX)
                return;
        pthread_mutex_lock(&l->lock);
        if (l->regions[r->id] == r)
                l->regions[r->id] = NULL;
        pthread_mutex_unlock(&l->lock);
}

/* A batch this small is copied on the caller's thread: waking a copy thread (a futex
 * each way, the bytes pulled to another CPU's cache) costs more than a memcpy of a few
 * KiB. Its completions still come through the eventfd and poll(), like the others. */
#define LOCAL_INLINE_BYTES (64U << 10)
#define LOCAL_INLINE_WRITES 64U

/* Under the lock: the job of write w, or an error. */
static int job_init(LocalTransport *l, const TransportWrite *w, LocalJob *ret) {
        TransportRegion *s = w->src_region < LOCAL_TRANSPORT_REGIONS_MAX ? l->regions[w->src_region] : NULL;
        TransportRegion *d = w->dst_region < LOCAL_TRANSPORT_REGIONS_MAX ? l->regions[w->dst_region] : NULL;
        if (!s || !d)
                return -ENOENT;
        int e = transport_region_check(s, w->src_offset, w->length);
        if (e == 0)
                e = transport_region_check(d, w->dst_offset, w->length);
        if (e < 0)
                return e;
        *ret = (LocalJob) {
                .src = (const uint8_t *)s->host_base + w->src_offset,
                .dst = (uint8_t *)d->host_base + w->dst_offset,
                .length = w->length,
                .cookie = w->cookie,
                .same_region = s == d,
        };
        return 0;
}

static int post_inline(LocalTransport *l, const TransportWrite *w, size_t n) {
        LocalJob jobs[LOCAL_INLINE_WRITES];
        int e = 0;

        pthread_mutex_lock(&l->lock);
        for (size_t i = 0; i < n && e == 0; i++)
                e = job_init(l, &w[i], &jobs[i]);
        pthread_mutex_unlock(&l->lock);
        if (e < 0)
                return e; /* all or nothing: nothing copied yet */
        for (size_t i = 0; i < n; i++)
                job_copy(&jobs[i]);
        pthread_mutex_lock(&l->lock);
        bool k = false;
        for (size_t i = 0; i < n; i++)
                k |= push_done(l, jobs[i].cookie, 0, jobs[i].length);
        l->inflight += n;
        if (k)
                kick(l);
        pthread_mutex_unlock(&l->lock);
        return 0;
}

static int local_post(Transport *t, void *peer, const TransportWrite *w, size_t n) {
        LocalTransport *l = LT(t);
        if (n == 0)
                return 0;
        if (!w || peer)
                return -EINVAL;

        if (n <= LOCAL_INLINE_WRITES) {
                uint64_t bytes = 0;
                for (size_t i = 0; i < n && bytes <= LOCAL_INLINE_BYTES; i++)
                        bytes += MIN(w[i].length, (uint64_t)LOCAL_INLINE_BYTES + 1);
                if (bytes <= LOCAL_INLINE_BYTES) {
                        int e = post_inline(l, w, n);
                        if (e == 0)
                                t->stats.batches++;
                        return e;
                }
        }

        LocalJob **jobs = calloc(n, sizeof *jobs);
        if (!jobs)
                return -ENOMEM;

        int e = 0;
        size_t i;
        pthread_mutex_lock(&l->lock);
        /* Validate everything first: all or nothing. */
        for (i = 0; i < n; i++) {
                jobs[i] = malloc(sizeof(LocalJob));
                if (!jobs[i]) {
                        e = -ENOMEM;
                        break;
                }
                e = job_init(l, &w[i], jobs[i]);
                if (e < 0)
                        break;
        }
        if (e < 0) {
                pthread_mutex_unlock(&l->lock);
                for (size_t k = 0; k < n; k++)
                        free(jobs[k]);
                free(jobs);
                return e;
        }
        for (i = 0; i < n; i++)
                QUEUE_PUSH_BACK(queue, l->jobs, jobs[i]);
        l->inflight += n;
        pthread_cond_broadcast(&l->cond);
        pthread_mutex_unlock(&l->lock);
        free(jobs);

        t->stats.batches++;
        return 0;
}

static int local_completion_fd(Transport *t) {
        return LT(t)->efd;
}

static size_t local_poll(Transport *t, TransportCompletion *c, size_t n) {
        LocalTransport *l = LT(t);
        uint64_t v;

        /* Clear the eventfd first: a completion pushed after this kicks it again. */
        (void)!read(l->efd, &v, sizeof v);

        pthread_mutex_lock(&l->lock);
        size_t k = transport_done_queue_take(&l->done, c, n);
        l->inflight -= k;
        if (l->done.n > 0)
                kick(l); /* more left: come back */
        pthread_mutex_unlock(&l->lock);

        for (size_t i = 0; i < k; i++) {
                if (c[i].error < 0)
                        t->stats.failures++;
                else {
                        t->stats.bytes += c[i].bytes;
                        t->stats.writes++;
                }
        }
        return k;
}

static void local_cancel_peer(Transport *t, void *peer) {
        LocalTransport *l = LT(t);
        pthread_mutex_lock(&l->lock);
        /* Queued jobs never started: no byte of them lands. Running ones finish and
         * complete normally. */
        bool k = false;
        while (l->jobs.first) {
                LocalJob *j = l->jobs.first;
                QUEUE_REMOVE(queue, l->jobs, j);
                k |= push_done(l, j->cookie, -ECANCELED, 0);
                free(j);
        }
        if (k)
                kick(l);
        pthread_mutex_unlock(&l->lock);
}

static void local_free(Transport *t) {
        if (!t)
                return;
        LocalTransport *l = LT(t);
        pthread_mutex_lock(&l->lock);
        l->stop = true;
        pthread_cond_broadcast(&l->cond);
        pthread_mutex_unlock(&l->lock);
        for (unsigned i = 0; i < l->n_threads; i++)
                pthread_join(l->threads[i], NULL);
        while (l->jobs.first) {
                LocalJob *j = l->jobs.first;
                QUEUE_REMOVE(queue, l->jobs, j);
                free(j);
        }
        free(l->threads);
        free(l->done.items);
        safe_close(l->efd);
        pthread_cond_destroy(&l->cond);
        pthread_mutex_destroy(&l->lock);
        free(l);
}

static const TransportOps local_ops = {
        .kind = TRANSPORT_LOCAL,
        .name = "local",
        .register_region = local_register,
        .unregister_region = local_unregister,
        .post = local_post,
        .completion_fd = local_completion_fd,
        .poll = local_poll,
        .cancel_peer = local_cancel_peer,
        .free = local_free,
};

int local_transport_new(unsigned n_threads, Transport **ret) {
        if (!ret || n_threads > LOCAL_TRANSPORT_THREADS_MAX)
                return -EINVAL;
        if (n_threads == 0) {
                long c = sysconf(_SC_NPROCESSORS_ONLN);
                n_threads = (unsigned)CLAMP(c, 1L, 4L);
        }

        LocalTransport *l = calloc(1, sizeof *l);
        if (!l)
                return -ENOMEM;
        l->base.ops = &local_ops;
        l->efd = -EBADF;
        pthread_mutex_init(&l->lock, NULL);
        pthread_cond_init(&l->cond, NULL);

        l->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (l->efd < 0) {
                int e = negative_errno();
                local_free(&l->base);
                return e;
        }
        l->threads = calloc(n_threads, sizeof *l->threads);
        if (!l->threads) {
                local_free(&l->base);
                return -ENOMEM;
        }
        /* Signals belong to the event loop's thread (signalfd): the workers take none. */
        sigset_t all, saved;
        sigfillset(&all);
        pthread_sigmask(SIG_BLOCK, &all, &saved);
        int e = 0;
        for (unsigned i = 0; i < n_threads && e == 0; i++) {
                e = pthread_create(&l->threads[i], NULL, worker, l);
                if (e == 0) {
                        (void)pthread_setname_np(l->threads[i], "epd-local-copy");
                        l->n_threads++;
                }
        }
        pthread_sigmask(SIG_SETMASK, &saved, NULL);
        if (e != 0) {
                local_free(&l->base);
                return -e;
        }
        *ret = &l->base;
        return 0;
}

uint64_t local_transport_inflight(Transport *t) {
        LocalTransport *l = LT(t);
        pthread_mutex_lock(&l->lock);
        uint64_t v = l->inflight;
        pthread_mutex_unlock(&l->lock);
        return v;
}
