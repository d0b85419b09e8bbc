/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/worker.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/manager.h"
#include "log.h"
#include "time-util.h"

static const char *const role_names[_WORKER_ROLE_MAX] = {
        [WORKER_ENCODER] = "encoder",
        [WORKER_PREFILL] = "prefill",
        [WORKER_DECODE] = "decode",
        [WORKER_COLOCATED] = "colocated",
        [WORKER_SCHEDULER] = "scheduler",
};

const char *worker_role_to_string(WorkerRole r) {
        return r < _WORKER_ROLE_MAX ? role_names[r] : NULL;
}

int worker_role_from_string(const char *s) {
        for (int i = 0; i < _WORKER_ROLE_MAX; i++)
                if (s && strcmp(s, role_names[i]) == 0)
                        return i;
        return -EINVAL;
}

static bool printable(const char *s) {
        for (; *s; s++)
                if ((unsigned char)*s < 0x20 || *s == 0x7f)
                        return false;
        return true;
}

int worker_validate(const char *role, const char *model, const char *device,
                    const char **error_text) {
        if (worker_role_from_string(role) < 0) {
                *error_text = "unknown role: expected encoder, prefill, decode, colocated or scheduler";
                return -EINVAL;
        }
        if (!model || strlen(model) >= WORKER_MODEL_MAX || !printable(model)) {
                *error_text = "model must be printable and shorter than 256 bytes";
                return -EINVAL;
        }
        if (!device || strlen(device) >= WORKER_DEVICE_MAX || !printable(device)) {
                *error_text = "device must be printable and shorter than 64 bytes";
                return -EINVAL;
        }
        return 0;
}

Worker *manager_get_worker(Manager *m, const char *id_str) {
        Worker *w = hashmap_get(m->workers, id_str);
        /* One whose client left, waiting for its process to exit (client_gone()), takes
         * no more work: no handoff targets it, no grant names it. */
        return w && w->object.owner && w->object.owner->exit_watch ? NULL : w;
}

static void worker_release(ClientObject *o) {
        worker_free(container_of(o, Worker, object));
}

int worker_new(Manager *m, Client *c, WorkerRole role, const char *model, const char *device,
               Worker **ret) {
        /* Workers whose client left and whose process may still write into GPU pages
         * (client_gone()) do not count, as for MaxClients=: the same process registering
         * again on a new connection is not refused while its old worker waits. */
        size_t live = hashmap_size(m->workers), it = 0;
        Worker *o;
        if (live >= m->config.max_workers)
                while (hashmap_iterate(m->workers, &it, (void **)&o, NULL))
                        if (!manager_get_worker(m, o->id_str))
                                live--;
        if (live >= m->config.max_workers)
                return -EUSERS;
        Worker *w = calloc(1, sizeof *w);
        if (!w)
                return -ENOMEM;
        w->manager = m;
        w->role = role;
        w->pid = c->pid;
        w->uid = c->uid;
        w->registered_usec = now_usec(CLOCK_REALTIME);
        int r = epd_id_random(&w->id);
        if (r < 0) {
                free(w);
                return r;
        }
        epd_id_to_string(&w->id, w->id_str);
        if (asprintf(&w->path, "/org/epd1/worker/%s", w->id_str) < 0) {
                free(w);
                return -ENOMEM;
        }
        w->model = strdup(model);
        w->device = strdup(device);
        if (!w->model || !w->device) {
                free(w->model);
                free(w->device);
                free(w->path);
                free(w);
                return -ENOMEM;
        }
        r = client_object_link(c, &w->object, CLIENT_OBJECT_WORKER, worker_release);
        if (r < 0) {
                free(w->model);
                free(w->device);
                free(w->path);
                free(w);
                return r;
        }
        r = hashmap_put(m->workers, w->id_str, w);
        if (r < 0) {
                client_object_unlink(&w->object);
                free(w->model);
                free(w->device);
                free(w->path);
                free(w);
                return r;
        }
        log_info("Registered %s worker %s (model '%s', device '%s', pid %d).",
                 worker_role_to_string(role), w->id_str, model, device, (int)w->pid);
        manager_emit_changed(m, "/org/epd1", "org.epd1.Manager", "Workers");
        *ret = w;
        return 0;
}

void worker_free(Worker *w) {
        if (!w)
                return;
        Manager *m = w->manager;
        log_info("Unregistered %s worker %s (pid %d).", worker_role_to_string(w->role), w->id_str,
                 (int)w->pid);
        hashmap_remove(m->workers, w->id_str);
        /* The hooks see the worker's client (its registered GPU memory goes with it). */
        manager_worker_removed(m, w);
        client_object_unlink(&w->object);
        free(w->name);
        for (size_t i = 0; i < w->n_labels; i++)
                free(w->labels[i]);
        free(w->labels);
        free(w->model);
        free(w->device);
        free(w->path);
        free(w);
        manager_emit_changed(m, "/org/epd1", "org.epd1.Manager", "Workers");
}
