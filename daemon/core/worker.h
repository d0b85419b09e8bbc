/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* A registered worker: an Encoder, Prefill or Decode process (or a tool). Registration
 * bookkeeping is pure (worker.c); the bus object is in bus-worker.c. */

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "core/client.h"
#include "id.h"

typedef struct KvLayout KvLayout;

typedef enum WorkerRole {
        WORKER_ENCODER,
        WORKER_PREFILL,
        WORKER_DECODE,
        WORKER_COLOCATED, /* prefill and decode in one process */
        WORKER_SCHEDULER, /* proxies, schedulers: no KV of their own */
        _WORKER_ROLE_MAX,
} WorkerRole;

/* The KV layout a prefill/decode worker describes at registration (options
 * "kv.layers", "kv.tokens_per_block", "kv.k_bytes_per_token", "kv.v_bytes_per_token",
 * "kv.dtype"); the pages subsystem derives its KvLayout from it. Byte counts are per
 * token per layer. */
typedef struct WorkerKvOptions {
        bool set;
        uint32_t layers;
        uint32_t tokens_per_block;
        uint64_t k_bytes_per_token;
        uint64_t v_bytes_per_token;
        char dtype[16];
} WorkerKvOptions;

/* What a worker did, for epdtop, epdctl and the metrics (org.epd1.Worker.Stats). The
 * counters are bumped by the subsystems where it happens; `pages` (KV pages its
 * sequences hold) is filled in when asked, by the pages subsystem's worker_stats hook. */
typedef struct WorkerStats WorkerStats;
struct WorkerStats {
        uint64_t handoffs_out;      /* handoffs it prepared (a prefill worker) */
        uint64_t handoffs_in;       /* handoffs it accepted (a decode worker) */
        uint64_t features_produced; /* features it published (an encoder) */
        uint64_t feature_hits;      /* its Acquires that found the feature (or its load) */
        uint64_t feature_misses;    /* its Acquires told to produce */
        uint64_t sequences;         /* sequences it owns (filled in when asked) */
        uint64_t pages;             /* KV pages those sequences hold, shared ones included */
};

#define WORKER_MODEL_MAX 256
#define WORKER_DEVICE_MAX 64

struct Worker {
        ClientObject object; /* owner, release */
        Manager *manager;
        EpdId id;
        char id_str[EPD_ID_STRING_MAX];
        char *path; /* /org/epd1/worker/<id> */
        WorkerRole role;
        char *model;
        char *device;
        pid_t pid;
        uid_t uid;
        uint64_t registered_usec; /* CLOCK_REALTIME */
        WorkerKvOptions kv;       /* as registered */
        KvLayout *layout;         /* derived by the pages subsystem; freed by its
                                   * worker_gone hook */
        uint64_t arena_mask;      /* arenas this worker may map (bit = arena index) */
        uint64_t pools_made;      /* KV pools its registration made (pages); undone if
                                   * the registration fails after the pages hook */
        bool established;         /* its RegisterWorker reply went out: it stands */
        /* Options "name" and "labels": what [Pool:NAME] worker selectors match
         * (pool-select.h). NULL / none when not given. */
        char *name;
        char **labels;
        size_t n_labels;
        WorkerStats stats;
};

const char *worker_role_to_string(WorkerRole r);
int worker_role_from_string(const char *s);

/* Validates the registration arguments; fills *error_text on failure. Pure. */
int worker_validate(const char *role, const char *model, const char *device,
                    const char **error_text);

int worker_new(Manager *m, Client *c, WorkerRole role, const char *model,
               const char *device, Worker **ret);
/* Unregisters and frees: the same path as UnregisterWorker and client death. */
void worker_free(Worker *w);
Worker *manager_get_worker(Manager *m, const char *id_str);
