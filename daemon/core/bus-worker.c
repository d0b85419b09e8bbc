/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Worker objects at /org/epd1/worker/<id>: vtable glue only. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/bus-manager.h"
#include "core/bus-objects.h"
#include "core/manager.h"
#include "core/worker.h"
#include "log.h"

#define WORKER_PREFIX "/org/epd1/worker"

static int worker_find(sd_bus *bus, const char *path, const char *interface, void *userdata,
                       void **found, sd_bus_error *error) {
        Manager *m = userdata;
        if (strncmp(path, WORKER_PREFIX "/", strlen(WORKER_PREFIX) + 1) != 0)
                return 0;
        Worker *w = manager_get_worker(m, path + strlen(WORKER_PREFIX) + 1);
        if (!w)
                return 0;
        *found = w;
        return 1;
}

static int worker_enumerate(sd_bus *bus, const char *path, void *userdata, char ***nodes,
                            sd_bus_error *error) {
        Manager *m = userdata;
        return bus_enumerate_paths(m->workers, offsetof(Worker, path), NULL, NULL, nodes);
}

BUS_PROPERTY_GETTER(property_role, Worker, w, return sd_bus_message_append(reply, "s", worker_role_to_string(w->role));)
BUS_PROPERTY_GETTER(property_id, Worker, w, return sd_bus_message_append(reply, "s", w->id_str);)
BUS_PROPERTY_GETTER(property_layout, Worker, w,
                    return sd_bus_message_append(reply, "(uutts)", w->kv.layers, w->kv.tokens_per_block,
                                                 w->kv.k_bytes_per_token, w->kv.v_bytes_per_token, w->kv.dtype);)

/* The "name" and "labels" registration options ([Pool:NAME] worker selectors). */
static int property_name(sd_bus *bus, const char *path, const char *interface, const char *property,
                         sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Worker *w = userdata;
        return sd_bus_message_append(reply, "s", w->name ?: "");
}

static int property_labels(sd_bus *bus, const char *path, const char *interface, const char *property,
                           sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Worker *w = userdata;
        int r = sd_bus_message_open_container(reply, 'a', "s");
        for (size_t i = 0; r >= 0 && i < w->n_labels; i++)
                r = sd_bus_message_append(reply, "s", w->labels[i]);
        return r < 0 ? r : sd_bus_message_close_container(reply);
}

/* What the worker did (core/worker.h: WorkerStats), by name. */
static int property_stats(sd_bus *bus, const char *path, const char *interface, const char *property,
                          sd_bus_message *reply, void *userdata, sd_bus_error *error) {
        Worker *w = userdata;
        WorkerStats st;
        manager_worker_stats(w->manager, w, &st);
        const struct {
                const char *key;
                uint64_t v;
        } rows[] = {
                { "sequences", st.sequences },
                { "pages", st.pages },
                { "handoffs_out", st.handoffs_out },
                { "handoffs_in", st.handoffs_in },
                { "features_produced", st.features_produced },
                { "feature_hits", st.feature_hits },
                { "feature_misses", st.feature_misses },
        };
        int r = sd_bus_message_open_container(reply, 'a', "{st}");
        for (size_t i = 0; r >= 0 && i < sizeof rows / sizeof rows[0]; i++)
                r = sd_bus_message_append(reply, "{st}", rows[i].key, rows[i].v);
        return r < 0 ? r : sd_bus_message_close_container(reply);
}

static const sd_bus_vtable worker_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Id", "s", property_id, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Role", "s", property_role, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Model", "s", NULL, offsetof(Worker, model), SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Device", "s", NULL, offsetof(Worker, device), SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Pid", "u", NULL, offsetof(Worker, pid), SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Uid", "u", NULL, offsetof(Worker, uid), SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("RegisteredAt", "t", NULL, offsetof(Worker, registered_usec),
                        SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("KvLayout", "(uutts)", property_layout, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Name", "s", property_name, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Labels", "as", property_labels, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Stats", "a{st}", property_stats, 0, 0),
        SD_BUS_VTABLE_END,
};

int bus_worker_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, WORKER_PREFIX, "org.epd1.Worker",
                                           worker_vtable, worker_find, m);
        if (r >= 0)
                r = sd_bus_add_node_enumerator(bus, NULL, WORKER_PREFIX, worker_enumerate, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Worker objects: %m");
        return 0;
}

int bus_read_worker(Manager *m, sd_bus_message *msg, bool own, Worker **ret, sd_bus_error *error) {
        const char *path;
        int r = sd_bus_message_read(msg, "o", &path);
        if (r < 0)
                return r;
        if (strncmp(path, WORKER_PREFIX "/", strlen(WORKER_PREFIX) + 1) != 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "%s is not a worker path.", path);
        Worker *w = manager_get_worker(m, path + strlen(WORKER_PREFIX) + 1);
        if (!w)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No worker %s.", path);
        if (own) {
                Client *c = manager_client_lookup_message(m, msg);
                if (!c || w->object.owner != c)
                        return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                             "Worker %s belongs to another client.", path);
        }
        *ret = w;
        return 0;
}
