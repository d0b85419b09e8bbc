/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "feature/feature-spill.h"
#include "feature/feature-store.h"
#include "log.h"
#include "macro.h"

typedef struct SpillJob {
        struct SpillJob *next;
        char *key;
        FeatureDesc *desc;
        EpdId request_id;
        usec_t encode_usec;
        uint64_t size;
        void *data;
} SpillJob;

struct FeatureSpiller {
        FeatureStore *store;
        pthread_t thread;
        pthread_mutex_t lock;
        pthread_cond_t work, idle;
        SpillJob *head, *tail;
        bool stop, busy;
        uint64_t max_pending;
        FeatureSpillerStats stats;
};

static SpillJob *job_free(SpillJob *j) {
        if (!j)
                return NULL;
        free(j->key);
        feature_desc_free(j->desc);
        free(j->data);
        free(j);
        return NULL;
}

static void *spill_thread(void *userdata) {
        FeatureSpiller *s = userdata;

        pthread_mutex_lock(&s->lock);
        for (;;) {
                while (!s->head && !s->stop)
                        pthread_cond_wait(&s->work, &s->lock);
                SpillJob *j = s->head;
                if (!j)
                        break; /* stop, and nothing left */
                s->head = j->next;
                if (!s->head)
                        s->tail = NULL;
                s->busy = true;
                pthread_mutex_unlock(&s->lock);

                int r = feature_store_save(s->store,
                                           &(FeatureStoreRecord){ .key = j->key,
                                                                  .size = j->size,
                                                                  .desc = j->desc,
                                                                  .request_id = j->request_id,
                                                                  .encode_usec = j->encode_usec },
                                           j->data);
                if (r < 0)
                        log_debug_errno(r, "Failed to spill a feature to the store, dropped: %m");

                pthread_mutex_lock(&s->lock);
                s->busy = false;
                s->stats.pending_bytes -= j->size;
                if (r < 0)
                        s->stats.failed++;
                else
                        s->stats.written++;
                job_free(j);
                if (!s->head)
                        pthread_cond_broadcast(&s->idle);
        }
        pthread_cond_broadcast(&s->idle);
        pthread_mutex_unlock(&s->lock);
        return NULL;
}

int feature_spiller_new(FeatureStore *store, uint64_t max_pending_bytes, FeatureSpiller **ret) {
        FeatureSpiller *s;
        int r;

        if (!store)
                return -EINVAL;
        s = calloc(1, sizeof *s);
        if (!s)
                return -ENOMEM;
        s->store = store;
        s->max_pending = max_pending_bytes;
        pthread_mutex_init(&s->lock, NULL);
        pthread_cond_init(&s->work, NULL);
        pthread_cond_init(&s->idle, NULL);
        r = -pthread_create(&s->thread, NULL, spill_thread, s);
        if (r < 0) {
                pthread_mutex_destroy(&s->lock);
                pthread_cond_destroy(&s->work);
                pthread_cond_destroy(&s->idle);
                free(s);
                return r;
        }
        *ret = s;
        return 0;
}

FeatureSpiller *feature_spiller_free(FeatureSpiller *s) {
        if (!s)
                return NULL;
        pthread_mutex_lock(&s->lock);
        s->stop = true;
        pthread_cond_signal(&s->work);
        pthread_mutex_unlock(&s->lock);
        pthread_join(s->thread, NULL);
        pthread_mutex_destroy(&s->lock);
        pthread_cond_destroy(&s->work);
        pthread_cond_destroy(&s->idle);
        free(s);
        return NULL;
}

void feature_spiller_set_max_pending(FeatureSpiller *s, uint64_t max_pending_bytes) {
        pthread_mutex_lock(&s->lock);
        s->max_pending = max_pending_bytes;
        pthread_mutex_unlock(&s->lock);
}

/* A feature not spilled for want of memory to copy it: dropped, as past the bound. */
static int count_dropped(FeatureSpiller *s, int error) {
        pthread_mutex_lock(&s->lock);
        s->stats.dropped++;
        pthread_mutex_unlock(&s->lock);
        return error;
}

int feature_spiller_queue(FeatureCache *c, const Feature *f, const void *data, void *userdata) {
        FeatureSpiller *s = userdata;
        SpillJob *j;

        pthread_mutex_lock(&s->lock);
        bool room = s->stats.pending_bytes + f->bytes <= s->max_pending && !s->stop;
        if (!room)
                s->stats.dropped++;
        pthread_mutex_unlock(&s->lock);
        if (!room)
                return -ENOBUFS;

        j = calloc(1, sizeof *j);
        if (!j)
                return count_dropped(s, -ENOMEM);
        j->key = strdup(f->key);
        j->desc = feature_desc_dup(f->desc);
        j->data = malloc(f->bytes ? f->bytes : 1);
        if (!j->key || !j->desc || !j->data) {
                job_free(j);
                return count_dropped(s, -ENOMEM);
        }
        memcpy(j->data, data, f->bytes);
        j->size = f->bytes;
        j->request_id = f->request_id;
        j->encode_usec = f->encode_usec;

        pthread_mutex_lock(&s->lock);
        if (s->tail)
                s->tail->next = j;
        else
                s->head = j;
        s->tail = j;
        s->stats.pending_bytes += j->size;
        s->stats.queued++;
        pthread_cond_signal(&s->work);
        pthread_mutex_unlock(&s->lock);
        return 0;
}

void feature_spiller_stats(FeatureSpiller *s, FeatureSpillerStats *ret) {
        pthread_mutex_lock(&s->lock);
        *ret = s->stats;
        pthread_mutex_unlock(&s->lock);
}

void feature_spiller_flush(FeatureSpiller *s) {
        pthread_mutex_lock(&s->lock);
        while (s->head || s->busy)
                pthread_cond_wait(&s->idle, &s->lock);
        pthread_mutex_unlock(&s->lock);
}
