/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "feature/feature-load.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include "list.h"
#include "log.h"
#include "macro.h"

typedef struct LoadJob {
        Feature *feature;
        char *key;
        bool probe;               /* a lookup (the entry is its result), not a read */
        FeatureStoreEntry entry;
        int fd;
        void *dst;
        uint64_t size;
        uint32_t crc;
        int result;
        int removed;              /* a failed read: 0 its copy removed, -ESTALE a save's kept, else why not */
        LIST_FIELDS(struct LoadJob, jobs);
} LoadJob;

struct FeatureLoader {
        FeatureStore *store;
        sd_event_source *source;
        int efd;
        pthread_t thread;
        bool started;
        pthread_mutex_t lock;
        pthread_cond_t cond;
        bool stop;
        LIST_HEAD(LoadJob, queue); /* to read (taken from the tail: oldest first) */
        LIST_HEAD(LoadJob, done);  /* read, for the loop */
        FeatureLoaderStats stats;
};

static LoadJob *job_free(LoadJob *j) {
        if (!j)
                return NULL;
        safe_close(j->fd);
        feature_store_entry_done(&j->entry);
        free(j->key);
        free(j);
        return NULL;
}

static void *loader_thread(void *userdata) {
        FeatureLoader *l = userdata;

        pthread_mutex_lock(&l->lock);
        for (;;) {
                while (!l->stop && !l->queue)
                        pthread_cond_wait(&l->cond, &l->lock);
                if (l->stop)
                        break;
                LoadJob *j = l->queue;
                while (j->jobs_next)
                        j = j->jobs_next;
                LIST_REMOVE(jobs, l->queue, j);
                pthread_mutex_unlock(&l->lock);

                if (j->probe)
                        /* A file that does not parse is removed by the lookup itself. */
                        j->result = feature_store_lookup(l->store, j->key, &j->entry);
                else {
                        FeatureStoreEntry e = { .fd = j->fd, .size = j->size, .crc = j->crc };
                        j->result = feature_store_entry_read(&e, j->dst);
                        struct stat st;
                        if (j->result < 0)
                                /* Short or unreadable: it would fail again; the next Acquire
                                 * produces the feature afresh. Unless a save has put a new
                                 * copy under its name since (kept). */
                                j->removed = fstat(j->fd, &st) < 0
                                                     ? negative_errno()
                                                     : feature_store_remove_file(l->store, j->key, st.st_ino);
                        j->fd = safe_close(j->fd);
                }

                pthread_mutex_lock(&l->lock);
                LIST_PREPEND(jobs, l->done, j);
                uint64_t one = 1;
                (void)!write(l->efd, &one, sizeof one);
        }
        pthread_mutex_unlock(&l->lock);
        return NULL;
}

static int on_done(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        FeatureLoader *l = userdata;
        uint64_t n;
        LoadJob *done;

        (void)!read(l->efd, &n, sizeof n);
        pthread_mutex_lock(&l->lock);
        done = l->done;
        l->done = NULL;
        pthread_mutex_unlock(&l->lock);
        /* Oldest first. */
        LoadJob *j = done;
        while (j && j->jobs_next)
                j = j->jobs_next;
        while (j) {
                LoadJob *prev = j->jobs_prev;
                if (j->probe) {
                        if (j->result < 0) {
                                l->stats.failed++;
                                if (j->result == -ENOENT)
                                        log_warning("Feature %.64s: its stored copy is gone (removed from the store's "
                                                    "directory by something else?) or its name holds another "
                                                    "key's file; a miss.", j->key);
                                else if (j->result == -EBADMSG)
                                        log_warning("Feature %.64s: its stored copy's header is damaged; removed it "
                                                    "(unless a save has put a new copy there since), a miss.", j->key);
                                else
                                        log_warning_errno(j->result, "Feature %.64s: cannot look its stored copy up "
                                                          "(open, stat or read), a miss: %m", j->key);
                        }
                        /* On success the read follows (queued through the cache's loader);
                         * on failure the Acquires that waited are asked again (a miss). */
                        feature_probe_done(j->feature, j->result, &j->entry);
                } else {
                        if (j->result < 0) {
                                l->stats.failed++;
                                if (j->removed == 0)
                                        log_warning_errno(j->result, "Feature %.64s: cannot read it back from the "
                                                          "store, removed it: %m", j->key);
                                else if (j->removed == -ESTALE)
                                        log_warning_errno(j->result, "Feature %.64s: cannot read it back from the "
                                                          "store (%m); a save has put a new copy there since, kept.",
                                                          j->key);
                                else
                                        log_warning_errno(j->result, "Feature %.64s: cannot read it back from the "
                                                          "store (%m), nor remove it (%s).", j->key,
                                                          strerror(-j->removed));
                        } else
                                l->stats.loaded++;
                        feature_load_done(j->feature, j->result);
                }
                job_free(j);
                j = prev;
        }
        return 0;
}

int feature_loader_new(sd_event *event, FeatureStore *store, FeatureLoader **ret) {
        FeatureLoader *l = calloc(1, sizeof *l);
        int r;

        if (!l)
                return -ENOMEM;
        l->store = store;
        pthread_mutex_init(&l->lock, NULL);
        pthread_cond_init(&l->cond, NULL);
        l->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (l->efd < 0) {
                r = -errno;
                feature_loader_free(l);
                return r;
        }
        r = sd_event_add_io(event, &l->source, l->efd, EPOLLIN, on_done, l);
        if (r >= 0) {
                r = -pthread_create(&l->thread, NULL, loader_thread, l);
                l->started = r >= 0;
        }
        if (r < 0) {
                feature_loader_free(l);
                return r;
        }
        *ret = l;
        return 0;
}

FeatureLoader *feature_loader_free(FeatureLoader *l) {
        if (!l)
                return NULL;
        if (l->started) {
                pthread_mutex_lock(&l->lock);
                l->stop = true;
                pthread_cond_signal(&l->cond);
                pthread_mutex_unlock(&l->lock);
                pthread_join(l->thread, NULL);
        }
        while (l->queue) {
                LoadJob *j = l->queue;
                LIST_REMOVE(jobs, l->queue, j);
                job_free(j);
        }
        while (l->done) {
                LoadJob *j = l->done;
                LIST_REMOVE(jobs, l->done, j);
                job_free(j);
        }
        sd_event_source_disable_unref(l->source);
        safe_close(l->efd);
        pthread_cond_destroy(&l->cond);
        pthread_mutex_destroy(&l->lock);
        free(l);
        return NULL;
}

static void queue_job(FeatureLoader *l, LoadJob *j) {
        pthread_mutex_lock(&l->lock);
        LIST_PREPEND(jobs, l->queue, j);
        pthread_cond_signal(&l->cond);
        pthread_mutex_unlock(&l->lock);
}

/* A job for f (its key copied: the feature may go while the thread works). */
static LoadJob *job_new(Feature *f) {
        LoadJob *j = calloc(1, sizeof *j);

        if (!j)
                return NULL;
        *j = (LoadJob) { .feature = f, .fd = -EBADF, .entry.fd = -EBADF, .key = strdup(f->key) };
        if (!j->key)
                return job_free(j);
        return j;
}

int feature_loader_probe(FeatureCache *c, Feature *f, void *userdata) {
        FeatureLoader *l = userdata;
        LoadJob *j = job_new(f);

        if (!j)
                return -ENOMEM;
        j->probe = true;
        queue_job(l, j);
        l->stats.probed++;
        return 0;
}

int feature_loader_queue(FeatureCache *c, Feature *f, int fd, void *dst, uint64_t size, uint32_t crc,
                         void *userdata) {
        FeatureLoader *l = userdata;
        LoadJob *j = job_new(f);

        if (!j) {
                safe_close(fd);
                return -ENOMEM;
        }
        j->fd = fd;
        j->dst = dst;
        j->size = size;
        j->crc = crc;
        queue_job(l, j);
        l->stats.queued++;
        return 0;
}

void feature_loader_stats(FeatureLoader *l, FeatureLoaderStats *ret) {
        *ret = l ? l->stats : (FeatureLoaderStats){};
}
