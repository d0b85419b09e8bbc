/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Manager: vtable and method glue only; bookkeeping lives in worker.c. */
#include "core/bus-dict.h"
#include "core/bus-manager.h"

#include <errno.h>
#include <string.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/manager.h"
#include "core/mappers.h"
#include "core/worker.h"
#include "log.h"
#include "sched/pool-select.h"

static int property_version(sd_bus *bus, const char *path, const char *interface,
                            const char *property, sd_bus_message *reply, void *userdata,
                            sd_bus_error *error) {
        return sd_bus_message_append(reply, "s", EPD_VERSION);
}

static int property_host_id(sd_bus *bus, const char *path, const char *interface,
                            const char *property, sd_bus_message *reply, void *userdata,
                            sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "s", m->config.host_id);
}

static int property_started_at(sd_bus *bus, const char *path, const char *interface,
                               const char *property, sd_bus_message *reply, void *userdata,
                               sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "t", (uint64_t)m->started_usec);
}

static int property_state_directory(sd_bus *bus, const char *path, const char *interface,
                                    const char *property, sd_bus_message *reply, void *userdata,
                                    sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "s", m->config.state_dir);
}

static int property_socket(sd_bus *bus, const char *path, const char *interface,
                           const char *property, sd_bus_message *reply, void *userdata,
                           sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "s", m->config.socket_path);
}

static int property_arenas(sd_bus *bus, const char *path, const char *interface,
                           const char *property, sd_bus_message *reply, void *userdata,
                           sd_bus_error *error) {
        Manager *m = userdata;
        int r = sd_bus_message_open_container(reply, 'a', "(ssstt)");
        for (size_t i = 0; r >= 0 && i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                r = sd_bus_message_append(reply, "(ssstt)", a->name,
                                          memory_domain_to_string(a->domain),
                                          arena_usage_to_string(a->usage), a->size, a->data_offset);
        }
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        return r;
}

static int property_workers(sd_bus *bus, const char *path, const char *interface,
                            const char *property, sd_bus_message *reply, void *userdata,
                            sd_bus_error *error) {
        Manager *m = userdata;
        Worker *w;
        size_t it = 0;
        int r = sd_bus_message_open_container(reply, 'a', "(osssu)");
        while (r >= 0 && hashmap_iterate(m->workers, &it, (void **)&w, NULL))
                r = sd_bus_message_append(reply, "(osssu)", w->path, worker_role_to_string(w->role),
                                          w->model, w->device, (uint32_t)w->pid);
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        return r;
}

static int property_clients(sd_bus *bus, const char *path, const char *interface,
                            const char *property, sd_bus_message *reply, void *userdata,
                            sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "u", (uint32_t)hashmap_size(m->clients));
}

/* The event loop's stalls (Manager.loop_stalls): (count, longest µs, what, when). */
static int property_loop_stalls(sd_bus *bus, const char *path, const char *interface,
                                const char *property, sd_bus_message *reply, void *userdata,
                                sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "(ttst)", m->loop_stalls, m->loop_stall_max_usec,
                                     m->loop_stall_max_what, m->loop_stall_max_at);
}

/* Which arenas a role maps unless the worker names them with the "arenas" option. */
static bool role_wants_arena(WorkerRole role, const Arena *a) {
        switch (role) {
        case WORKER_ENCODER:
                return a->usage == ARENA_USAGE_FEATURE;
        case WORKER_DECODE:
                return a->usage == ARENA_USAGE_KV;
        case WORKER_PREFILL:
        case WORKER_COLOCATED:
                return true;
        default:
                return false;
        }
}

/* Options "name" (s) and "labels" (as): what [Pool:NAME] worker selectors match. */
typedef struct WorkerSelectOptions {
        char *name;
        char **labels;
        size_t n_labels;
} WorkerSelectOptions;

static void select_options_done(WorkerSelectOptions *o) {
        free(o->name);
        for (size_t i = 0; i < o->n_labels; i++)
                free(o->labels[i]);
        free(o->labels);
        *o = (WorkerSelectOptions){};
}

/* RegisterWorker's options (dbus/org.epd1.Manager.xml). */
typedef struct RegisterOptions {
        char **arenas;
        bool arenas_given;
        const char *name;
        char **labels;
        bool labels_given;
        uint32_t kv_layers, kv_tokens_per_block;
        uint64_t kv_k_bytes_per_token, kv_v_bytes_per_token;
        const char *kv_dtype;
        bool kv_given[5];
} RegisterOptions;

static void register_options_done(RegisterOptions *o) {
        bus_dict_strv_free(o->arenas);
        bus_dict_strv_free(o->labels);
}

static int parse_options(Manager *m, sd_bus_message *msg, WorkerKvOptions *kv,
                         uint64_t *arena_mask, bool *arenas_given, WorkerSelectOptions *sel,
                         sd_bus_error *error) {
        static const BusDictItem items[] = {
                BUS_DICT_FLAG("arenas", "as", RegisterOptions, arenas, arenas_given),
                BUS_DICT("name", "s", RegisterOptions, name),
                BUS_DICT_FLAG("labels", "as", RegisterOptions, labels, labels_given),
                BUS_DICT_FLAG("kv.layers", "u", RegisterOptions, kv_layers, kv_given[0]),
                BUS_DICT_FLAG("kv.tokens_per_block", "u", RegisterOptions, kv_tokens_per_block, kv_given[1]),
                BUS_DICT_FLAG("kv.k_bytes_per_token", "t", RegisterOptions, kv_k_bytes_per_token, kv_given[2]),
                BUS_DICT_FLAG("kv.v_bytes_per_token", "t", RegisterOptions, kv_v_bytes_per_token, kv_given[3]),
                BUS_DICT_FLAG("kv.dtype", "s", RegisterOptions, kv_dtype, kv_given[4]),
                {},
        };
        _cleanup_(register_options_done) RegisterOptions o = {};
        int r = bus_dict_read(msg, items, &o, "option", error);
        if (r < 0)
                return r;

        *arenas_given = o.arenas_given;
        for (char **n = o.arenas; n && *n; n++) {
                Arena *a = manager_find_arena(m, *n);
                if (!a)
                        return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No arena named '%s'.", *n);
                *arena_mask |= 1ULL << a->index;
        }
        if (o.name) {
                if (!pool_select_label_valid(o.name))
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                             "Option 'name' must be 1 to 63 printable characters without spaces.");
                sel->name = strdup(o.name);
                if (!sel->name)
                        return -ENOMEM;
        }
        if (o.labels_given) {
                size_t n = 0;
                bool ok = true;
                for (char **i = o.labels; i && *i; i++, n++)
                        ok = ok && pool_select_label_valid(*i);
                if (!ok || n > POOL_SELECT_LABELS_MAX)
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                             "Option 'labels': at most %d labels of 1 to 63 printable characters without spaces.",
                                             POOL_SELECT_LABELS_MAX);
                sel->labels = TAKE_PTR(o.labels);
                sel->n_labels = n;
        }
        if (o.kv_dtype && (strlen(o.kv_dtype) == 0 || strlen(o.kv_dtype) >= sizeof kv->dtype))
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "kv.dtype must be 1 to 15 characters.");
        for (size_t i = 0; i < ELEMENTSOF(o.kv_given); i++)
                kv->set = kv->set || o.kv_given[i];
        kv->layers = o.kv_layers;
        kv->tokens_per_block = o.kv_tokens_per_block;
        kv->k_bytes_per_token = o.kv_k_bytes_per_token;
        kv->v_bytes_per_token = o.kv_v_bytes_per_token;
        if (o.kv_dtype)
                strcpy(kv->dtype, o.kv_dtype);
        return 0;
}

static int method_register_worker(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *role, *model, *device, *why = NULL;
        WorkerKvOptions kv = { 0 };
        _cleanup_(select_options_done) WorkerSelectOptions sel = {};
        uint64_t mask = 0;
        bool arenas_given = false;
        Client *c;
        Worker *w;
        int r;

        r = sd_bus_message_read(msg, "sss", &role, &model, &device);
        if (r < 0)
                return r;
        if (worker_validate(role, model, device, &why) < 0)
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT, "%s", why);
        r = parse_options(m, msg, &kv, &mask, &arenas_given, &sel, error);
        if (r < 0)
                return r;

        r = manager_client_require(m, msg, &c, error);
        if (r < 0)
                return r;
        WorkerRole wr = (WorkerRole)worker_role_from_string(role);
        r = worker_new(m, c, wr, model, device, &w);
        if (r == -EALREADY)
                return epd_bus_error(error, EPD_ERROR_EXISTS,
                                     "This connection already registered a worker.");
        if (r == -EUSERS)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "Worker limit reached (%u).", m->config.max_workers);
        if (r == -EDQUOT)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "This client holds %u objects already ([Limits] MaxObjectsPerClient=).",
                                     m->config.max_objects_per_client);
        if (r < 0)
                return r;
        w->kv = kv;
        w->name = TAKE_PTR(sel.name);
        w->labels = TAKE_PTR(sel.labels);
        w->n_labels = sel.n_labels;
        sel.n_labels = 0;
        if (!arenas_given)
                for (size_t i = 0; i < m->n_arenas; i++)
                        if (role_wants_arena(wr, m->arenas[i]))
                                mask |= 1ULL << i;
        w->arena_mask = mask;
        if (mask != 0) {
                r = bus_glue_require_fds(msg, "RegisterWorker (the arenas' fds)", error);
                if (r < 0) {
                        worker_free(w);
                        return r;
                }
        }
        Reason refused = {};
        r = manager_worker_added(m, w, &refused);
        if (r < 0) {
                worker_free(w);
                return epd_bus_error_errno(error, r, refused.text);
        }
        /* Host arenas are about to be mapped: a restart waits for this process
         * (core/mappers.h). */
        for (size_t i = 0; i < m->n_arenas && i < 64; i++)
                if ((mask & (1ULL << i)) && m->arenas[i]->domain == MEMORY_HOST) {
                        mappers_add(m, c);
                        break;
                }

        _cleanup_(sd_bus_message_unrefp) sd_bus_message *reply = NULL;
        r = sd_bus_message_new_method_return(msg, &reply);
        if (r >= 0)
                r = sd_bus_message_append(reply, "o", w->path);
        if (r >= 0)
                r = sd_bus_message_open_container(reply, 'a', "(sssttuh)");
        for (size_t i = 0; r >= 0 && i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                if (!(mask & (1ULL << i)))
                        continue;
                r = sd_bus_message_append(reply, "(sssttuh)", a->name,
                                          memory_domain_to_string(a->domain),
                                          arena_usage_to_string(a->usage), a->size, a->data_offset,
                                          (uint32_t)(a->domain == MEMORY_GPU ? a->region.gpu_ordinal : -1),
                                          a->fd);
        }
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        if (r >= 0)
                r = sd_bus_send(NULL, reply, NULL);
        if (r < 0) {
                worker_free(w); /* never registered: what its hooks made for it goes too */
                return r;
        }
        w->established = true;
        return 1;
}

static int method_unregister_worker(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        Worker *w;
        int r = bus_read_worker(m, msg, true, &w, error);
        if (r < 0)
                return r;
        worker_free(w);
        return sd_bus_reply_method_return(msg, NULL);
}

static int method_subscribe(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        int enable;
        int r = sd_bus_message_read(msg, "b", &enable);
        if (r < 0)
                return r;
        r = manager_connection_subscribe(userdata, sd_bus_message_get_bus(msg), enable);
        if (r < 0)
                return epd_bus_error(error, EPD_ERROR_FAILED, "This connection is closing.");
        return sd_bus_reply_method_return(msg, NULL);
}

static const sd_bus_vtable manager_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Version", "s", property_version, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("HostId", "s", property_host_id, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Arenas", "a(ssstt)", property_arenas, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Workers", "a(osssu)", property_workers, 0,
                        SD_BUS_VTABLE_PROPERTY_EMITS_CHANGE),
        SD_BUS_PROPERTY("Clients", "u", property_clients, 0, 0),
        SD_BUS_PROPERTY("LoopStalls", "(ttst)", property_loop_stalls, 0, 0),
        SD_BUS_PROPERTY("StartedAt", "t", property_started_at, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("StateDirectory", "s", property_state_directory, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Socket", "s", property_socket, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_METHOD_WITH_ARGS("RegisterWorker",
                                SD_BUS_ARGS("s", role, "s", model, "s", device, "a{sv}", options),
                                SD_BUS_RESULT("o", worker, "a(sssttuh)", arenas),
                                method_register_worker, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("UnregisterWorker", SD_BUS_ARGS("o", worker), SD_BUS_NO_RESULT,
                                method_unregister_worker, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("Subscribe", SD_BUS_ARGS("b", enable), SD_BUS_NO_RESULT, method_subscribe,
                                SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_VTABLE_END,
};

int bus_manager_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, "/org/epd1", "org.epd1.Manager", manager_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Manager object: %m");
        return bus_worker_add(m, bus);
}
