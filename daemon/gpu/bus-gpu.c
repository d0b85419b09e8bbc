/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* org.epd1.Gpu at /org/epd1 (dbus/org.epd1.Gpu.xml): the GPUs and their peer access,
 * and registration of workers' own GPU memory. Vtable glue only; gpu-domain.c has the
 * logic. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <inttypes.h>
#include <string.h>
#include <strings.h>

#include "bus-error.h"
#include "core/bus-glue.h"
#include "core/client.h"
#include "core/manager.h"
#include "core/worker.h"
#include "gpu/bus-gpu.h"
#include "gpu/gpu-domain.h"
#include "gpu/gpu-manager.h"
#include "log.h"

/* A worker's registered GPU memory: a client object, released by ReleaseMemory, by
 * UnregisterWorker's client teardown or by the client's death, through one function. */
typedef struct GpuRegistration {
        ClientObject object;
        GpuExternal *external;
} GpuRegistration;

static void gpu_registration_release(ClientObject *o) {
        GpuRegistration *g = container_of(o, GpuRegistration, object);
        client_object_unlink(o);
        /* Drops the daemon's import only: the memory stays the worker's. */
        gpu_external_release(g->external);
        free(g);
}

static int property_enabled(sd_bus *bus, const char *path, const char *interface,
                            const char *property, sd_bus_message *reply, void *userdata,
                            sd_bus_error *error) {
        Manager *m = userdata;
        return sd_bus_message_append(reply, "b", m->gpu != NULL);
}

static int property_status(sd_bus *bus, const char *path, const char *interface,
                           const char *property, sd_bus_message *reply, void *userdata,
                           sd_bus_error *error) {
        Manager *m = userdata;
        char buf[128];

        if (!m->gpu)
                return sd_bus_message_append(reply, "s", "off: no Domain=gpu arena is configured");
        snprintf(buf, sizeof buf, "on: CUDA driver %d.%d, %zu GPU(s)",
                 m->gpu->system->driver->driver_version / 1000,
                 (m->gpu->system->driver->driver_version % 1000) / 10, m->gpu->system->n_devices);
        return sd_bus_message_append(reply, "s", buf);
}

static int property_gpus(sd_bus *bus, const char *path, const char *interface,
                         const char *property, sd_bus_message *reply, void *userdata,
                         sd_bus_error *error) {
        Manager *m = userdata;
        int r = sd_bus_message_open_container(reply, 'a', "(ussbbbt)");
        for (size_t i = 0; r >= 0 && m->gpu && i < m->gpu->system->n_devices; i++) {
                const GpuDevice *g = &m->gpu->system->devices[i];
                r = sd_bus_message_append(reply, "(ussbbbt)", (uint32_t)g->ordinal, g->pci_bus_id,
                                          g->name, (int)g->vmm, (int)g->posix_fd, (int)g->gdr_vmm,
                                          g->total_memory);
        }
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        return r;
}

static int property_peer_access(sd_bus *bus, const char *path, const char *interface,
                                const char *property, sd_bus_message *reply, void *userdata,
                                sd_bus_error *error) {
        Manager *m = userdata;
        int r = sd_bus_message_open_container(reply, 'a', "(uu)");
        size_t n = m->gpu ? m->gpu->system->n_devices : 0;
        for (size_t i = 0; r >= 0 && i < n; i++)
                for (size_t j = 0; r >= 0 && j < n; j++)
                        if (i != j && gpu_system_can_access_peer(m->gpu->system, (int)i, (int)j))
                                r = sd_bus_message_append(reply, "(uu)", (uint32_t)i, (uint32_t)j);
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        return r;
}

/* The copy engines' counters: the handoffs' ("NAME") and the copy-on-write copies'
 * ("cow-NAME"); none without the GPU domain. */
static int property_copy_counters(sd_bus *bus, const char *path, const char *interface,
                                  const char *property, sd_bus_message *reply, void *userdata,
                                  sd_bus_error *error) {
        Manager *m = userdata;
        const GpuCopyStats *st[2];
        int r = sd_bus_message_open_container(reply, 'a', "{st}");
        gpu_manager_copy_stats(m, &st[0], &st[1]);
        for (int cow = 0; r >= 0 && cow < 2; cow++)
                for (size_t i = 0; r >= 0 && st[cow] && i < gpu_copy_counters_n; i++) {
                        char name[64];
                        snprintf(name, sizeof name, "%s%s", cow ? "cow-" : "", gpu_copy_counters[i].name);
                        r = sd_bus_message_append(reply, "{st}", name,
                                                  gpu_copy_counter_value(st[cow], &gpu_copy_counters[i]));
                }
        if (r >= 0)
                r = sd_bus_message_close_container(reply);
        return r;
}

static int method_register_memory(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        const char *pci;
        uint64_t size;
        Worker *w;
        int fd, ordinal = -1, r;

        r = sd_bus_message_read(msg, "hts", &fd, &size, &pci);
        if (r < 0)
                return r;
        r = manager_require_worker(m, msg, &w, error);
        if (r < 0)
                return r;
        if (!m->gpu)
                return epd_bus_error(error, EPD_ERROR_UNSUPPORTED,
                                     "The GPU domain is off: no Domain=gpu arena is configured.");
        for (size_t i = 0; i < m->gpu->system->n_devices; i++)
                if (strcasecmp(m->gpu->system->devices[i].pci_bus_id, pci) == 0)
                        ordinal = (int)i;
        if (ordinal < 0)
                return epd_bus_error(error, EPD_ERROR_NOT_FOUND, "No GPU with PCI bus id '%s' here.", pci);
        /* The worker's own memory, only mapped here: bounded by the GPU that holds it, not
         * by MaxRequestSize= (what one call may ask of the daemon's memory), which refused
         * every KV cache over 1 GiB by default. The import checks the allocation's size. */
        uint64_t total = m->gpu->system->devices[ordinal].total_memory;
        if (size == 0 || (total > 0 && size > total))
                return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                     "Size %" PRIu64 " is 0 or more than GPU %s holds (%" PRIu64 " bytes).", size,
                                     pci, total);

        /* The daemon's GPU_EXTERNAL_MAX regions are shared: no one worker takes them all. */
        unsigned held = 0;
        LIST_FOREACH(objects, o, w->object.owner->objects)
                held += o->release == gpu_registration_release;
        if (held >= GPU_EXTERNAL_PER_CLIENT_MAX)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "This client has %u GPU memory regions registered already (at most %u a "
                                     "client); release one first.",
                                     held, GPU_EXTERNAL_PER_CLIENT_MAX);
        GpuRegistration *g = calloc(1, sizeof *g);
        if (!g)
                return -ENOMEM;
        r = client_object_link(w->object.owner, &g->object, CLIENT_OBJECT_OTHER, gpu_registration_release);
        if (r < 0) {
                free(g);
                if (r == -EDQUOT)
                        return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED, "Too many objects for this client.");
                return r;
        }
        /* The fd stays the message's: importing takes its own reference. */
        r = gpu_context_register_external(m->gpu, ordinal, fd, size, &g->external);
        if (r < 0) {
                client_object_unlink(&g->object);
                free(g);
                if (r == -EDQUOT)
                        return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                             "Too many registered GPU memory regions (%u).", GPU_EXTERNAL_MAX);
                if (r == -EXDEV)
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                             "The memory behind this fd is not on GPU %s (the CUDA driver "
                                             "places it on another GPU or in host memory): name the GPU "
                                             "that allocated it.", pci);
                if (r == -EINVAL || r == -EBADF || r == -ERANGE || r == -ENOENT)
                        return epd_bus_error(error, EPD_ERROR_INVALID_ARGUMENT,
                                             "Cannot import %" PRIu64 " bytes of GPU memory from this fd: %s.",
                                             size, strerror(-r));
                /* The daemon's side, not the caller's: no room to map it, a driver that
                 * cannot, a driver in trouble. */
                if (r == -ENOMEM || r == -ENOSPC)
                        return epd_bus_error(error, EPD_ERROR_NO_SPACE,
                                             "No room on GPU %s to map %" PRIu64 " bytes of this worker's memory "
                                             "here: %s.", pci, size, strerror(-r));
                if (r == -EOPNOTSUPP)
                        return epd_bus_error(error, EPD_ERROR_UNSUPPORTED,
                                             "The CUDA driver cannot import this memory here: %s.", strerror(-r));
                return epd_bus_error(error, EPD_ERROR_FAILED,
                                     "Cannot import %" PRIu64 " bytes of GPU memory from this fd: %s.", size,
                                     strerror(-r));
        }
        log_debug("Worker %s registered %" PRIu64 " bytes of its GPU memory on %s as region %u.",
                  w->id_str, size, pci, g->external->region.id);
        return sd_bus_reply_method_return(msg, "u", g->external->region.id);
}

static int method_release_memory(sd_bus_message *msg, void *userdata, sd_bus_error *error) {
        Manager *m = userdata;
        uint32_t region;
        Client *c;
        int r;

        r = sd_bus_message_read(msg, "u", &region);
        if (r < 0)
                return r;
        c = manager_client_lookup_message(m, msg);
        LIST_FOREACH(objects, o, c ? c->objects : NULL)
                if (o->release == gpu_registration_release &&
                    container_of(o, GpuRegistration, object)->external->region.id == region) {
                        o->release(o);
                        return sd_bus_reply_method_return(msg, NULL);
                }
        return epd_bus_error(error, EPD_ERROR_NOT_FOUND,
                             "No GPU memory region %u registered by this client.", region);
}

static const sd_bus_vtable gpu_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_PROPERTY("Enabled", "b", property_enabled, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Status", "s", property_status, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("Gpus", "a(ussbbbt)", property_gpus, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("PeerAccess", "a(uu)", property_peer_access, 0, SD_BUS_VTABLE_PROPERTY_CONST),
        SD_BUS_PROPERTY("CopyCounters", "a{st}", property_copy_counters, 0, 0),
        SD_BUS_METHOD_WITH_ARGS("RegisterMemory",
                                SD_BUS_ARGS("h", fd, "t", size, "s", pci_bus_id),
                                SD_BUS_RESULT("u", region),
                                method_register_memory, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_METHOD_WITH_ARGS("ReleaseMemory", SD_BUS_ARGS("u", region), SD_BUS_NO_RESULT,
                                method_release_memory, SD_BUS_VTABLE_UNPRIVILEGED),
        SD_BUS_VTABLE_END,
};

void bus_gpu_worker_gone(Manager *m, Worker *w) {
        Client *c = w->object.owner;

        /* Registered memory is the worker's: when it unregisters, so does its memory. */
        LIST_FOREACH_SAFE(objects, o, n, c ? c->objects : NULL)
                if (o->release == gpu_registration_release)
                        o->release(o);
}

int bus_gpu_add(Manager *m, sd_bus *bus) {
        int r = bus_glue_add_vtable(bus, "/org/epd1", "org.epd1.Gpu", gpu_vtable, NULL, m);
        if (r < 0)
                return log_error_errno(r, "Cannot add the Gpu object: %m");
        return 0;
}
