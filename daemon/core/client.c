/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/client.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "bus-error.h"
#include "core/arena.h"
#include "core/manager.h"
#include "core/mappers.h"
#include "core/worker.h"
#include "log.h"

/* The connection a message came in on: NULL for the bus (unique names identify
 * clients), or the direct connection's serial. */
static int client_key(Manager *m, sd_bus_message *msg, char *buf, size_t n, bool *direct) {
        sd_bus *bus = sd_bus_message_get_bus(msg);
        if (bus == m->bus) {
                const char *sender = sd_bus_message_get_sender(msg);
                if (!sender)
                        return -EBADMSG;
                snprintf(buf, n, "b/%s", sender);
                *direct = false;
        } else {
                uint64_t serial = manager_connection_serial(m, bus);
                if (serial == 0)
                        return -ENOTCONN;
                snprintf(buf, n, "d/%" PRIu64, serial);
                *direct = true;
        }
        return 0;
}

Client *manager_client_lookup_message(Manager *m, sd_bus_message *msg) {
        char key[300];
        bool direct;
        if (client_key(m, msg, key, sizeof key, &direct) < 0)
                return NULL;
        return hashmap_get(m->clients, key);
}

static int on_track_gone(sd_bus_track *t, void *userdata) {
        Client *c = userdata;
        log_debug("Client %s left the bus.", c->key);
        client_gone(c);
        /* Handled: sd-bus puts an empty track whose handler returned 0 back on its queue,
         * and a client that waits for its process (client_gone()) keeps its track: the
         * bus then dispatched this again at every turn, 100 % CPU, every bus call
         * unanswered until the process exited (up to 10 s). */
        return 1;
}

int manager_client_from_message(Manager *m, sd_bus_message *msg, Client **ret) {
        char key[300];
        bool direct;
        int r = client_key(m, msg, key, sizeof key, &direct);
        if (r < 0)
                return r;
        Client *c = hashmap_get(m->clients, key);
        if (c) {
                *ret = c;
                return 0;
        }
        if (hashmap_size(m->clients) - m->clients_departing >= m->config.max_clients)
                return -EUSERS;

        c = calloc(1, sizeof *c);
        if (!c)
                return -ENOMEM;
        c->exit_pidfd = -EBADF;
        c->manager = m;
        c->serial = ++m->next_serial;
        c->bus = sd_bus_ref(sd_bus_message_get_bus(msg));
        c->key = strdup(key);
        if (!c->key) {
                client_free(c);
                return -ENOMEM;
        }
        if (!direct) {
                c->unique_name = strdup(sd_bus_message_get_sender(msg));
                if (!c->unique_name) {
                        client_free(c);
                        return -ENOMEM;
                }
                r = sd_bus_track_new(c->bus, &c->track, on_track_gone, c);
                if (r >= 0)
                        r = sd_bus_track_add_sender(c->track, msg);
                if (r < 0) {
                        client_free(c);
                        return r;
                }
        }
        /* Who the caller is decides what it may touch: credentials that cannot be read
         * refuse the call. No client exists with an unknown uid or pid, so no decision
         * rests on a default value. */
        sd_bus_creds *creds = NULL;
        pid_t pid = 0;
        uid_t uid = 0;
        r = sd_bus_query_sender_creds(msg, SD_BUS_CREDS_PID | SD_BUS_CREDS_EUID, &creds);
        if (r >= 0)
                r = sd_bus_creds_get_pid(creds, &pid);
        if (r >= 0)
                r = sd_bus_creds_get_euid(creds, &uid);
        sd_bus_creds_unref(creds);
        if (r >= 0 && pid <= 0)
                r = -ENODATA;
        if (r < 0) {
                log_warning_errno(r, "Refusing client %s: cannot read its credentials: %m", c->key);
                client_free(c);
                return -EACCES;
        }
        c->pid = pid;
        c->uid = uid;
        r = hashmap_put(m->clients, c->key, c);
        if (r < 0) {
                client_free(c);
                return r;
        }
        log_debug("New client %s (pid %d, uid %u).", c->key, (int)c->pid, (unsigned)c->uid);
        *ret = c;
        return 0;
}

int manager_client_require(Manager *m, sd_bus_message *msg, Client **ret, sd_bus_error *error) {
        int r = manager_client_from_message(m, msg, ret);
        if (r == -EACCES)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "The caller's credentials (pid, uid) cannot be read; the call is refused.");
        if (r == -EUSERS)
                return epd_bus_error(error, EPD_ERROR_LIMIT_EXCEEDED,
                                     "epdd serves at most %u clients at once ([Limits] MaxClients=), and that "
                                     "many are connected.",
                                     m->config.max_clients);
        return r;
}

int manager_reader(Manager *m, sd_bus_message *msg, bool *ret_root, Client **ret_client) {
        uid_t uid;
        int r = manager_reader_uid(m, msg, &uid, ret_client);
        if (r < 0)
                return r;
        *ret_root = uid == 0;
        return 0;
}

int manager_reader_uid(Manager *m, sd_bus_message *msg, uid_t *ret_uid, Client **ret_client) {
        Client *c = msg ? manager_client_lookup_message(m, msg) : NULL;
        uid_t uid = (uid_t)-1;
        if (c)
                /* Read when the client was made: on a bus whose broker attaches no
                 * credentials, asking again is a blocking call to the broker from the loop,
                 * at every property read (epdtop polls them). */
                uid = c->uid;
        else {
                sd_bus_creds *creds = NULL;
                int r = msg ? sd_bus_query_sender_creds(msg, SD_BUS_CREDS_EUID, &creds) : -EINVAL;
                if (r >= 0)
                        r = sd_bus_creds_get_euid(creds, &uid);
                sd_bus_creds_unref(creds);
                if (r < 0)
                        return -EACCES;
        }
        if (uid == (uid_t)-1)
                return -EACCES;
        *ret_uid = uid;
        if (ret_client)
                *ret_client = c;
        return 0;
}

int manager_reader_require(Manager *m, sd_bus_message *msg, const char *what, bool *ret_root,
                           Client **ret_client, sd_bus_error *error) {
        if (manager_reader(m, msg, ret_root, ret_client) < 0)
                return epd_bus_error(error, EPD_ERROR_PERMISSION_DENIED,
                                     "The caller's uid cannot be read; %s is refused.", what);
        return 0;
}

int client_object_room(const Client *c) {
        unsigned total = 0;
        for (int i = 0; i < _CLIENT_OBJECT_TYPE_MAX; i++)
                total += c->n_objects[i];
        if (c->dying || c->exit_watch) /* gone, or its process awaited (client_gone()) */
                return -ESHUTDOWN;
        if (total >= c->manager->config.max_objects_per_client)
                return -EDQUOT;
        return 0;
}

int client_object_link(Client *c, ClientObject *o, ClientObjectType type,
                       void (*release)(ClientObject *o)) {
        int r = client_object_room(c);
        if (r < 0)
                return r;
        if (type == CLIENT_OBJECT_WORKER && c->n_objects[type] >= 1)
                return -EALREADY;
        o->owner = c;
        o->type = type;
        o->release = release;
        LIST_PREPEND(objects, c->objects, o);
        c->n_objects[type]++;
        if (type == CLIENT_OBJECT_WORKER)
                c->worker = o;
        return 0;
}

void client_object_unlink(ClientObject *o) {
        Client *c = o->owner;
        if (!c)
                return;
        LIST_REMOVE(objects, c->objects, o);
        c->n_objects[o->type]--;
        if (c->worker == o)
                c->worker = NULL;
        o->owner = NULL;
}

Worker *client_get_worker(Client *c) {
        return c && c->worker ? container_of(c->worker, Worker, object) : NULL;
}

static void client_release_objects(Client *c) {
        /* Objects that depend on the worker registration (sequences, handoffs, ...) go
         * first, the registration last. Each release unlinks its object and may release
         * others, so always restart from the head. */
        for (;;) {
                ClientObject *victim = NULL;
                LIST_FOREACH(objects, o, c->objects)
                        if (o->type != CLIENT_OBJECT_WORKER) {
                                victim = o;
                                break;
                        }
                if (!victim)
                        break;
                victim->release(victim);
        }
        while (c->objects)
                c->objects->release(c->objects);
}

Client *client_free(Client *c) {
        if (!c)
                return NULL;
        c->dying = true;
        if (c->exit_watch)
                c->manager->clients_departing--;
        sd_event_source_disable_unref(c->exit_watch);
        sd_event_source_disable_unref(c->exit_timer);
        if (c->exit_pidfd >= 0)
                close(c->exit_pidfd);
        client_release_objects(c);
        mappers_drop(c->manager, c);
        if (c->key && hashmap_get(c->manager->clients, c->key) == c)
                hashmap_remove(c->manager->clients, c->key);
        sd_bus_track_unref(c->track);
        sd_bus_unref(c->bus);
        free(c->unique_name);
        free(c->key);
        free(c);
        return NULL;
}

/* How long a departed client's GPU pages wait for its process to exit. */
#define CLIENT_EXIT_WAIT_USEC (10 * USEC_PER_SEC)

static bool maps_gpu_arena(Client *c) {
        Worker *w = client_get_worker(c);
        Manager *m = c->manager;
        for (size_t i = 0; w && i < m->n_arenas && i < 64; i++)
                if ((w->arena_mask & (1ULL << i)) && m->arenas[i]->domain == MEMORY_GPU)
                        return true;
        return false;
}

static int on_exited(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        Client *c = userdata;
        log_debug("Client %s's process exited: releasing everything it held.", c->key);
        client_free(c);
        return 0;
}

static int on_exit_wait_over(sd_event_source *s, uint64_t usec, void *userdata) {
        Client *c = userdata;
        log_warning("Client %s (pid %d) left its connection %u s ago and its process still runs: releasing its "
                    "GPU pages now (any GPU work of it still writing there would land in their next owner's).",
                    c->key, (int)c->pid, (unsigned)(CLIENT_EXIT_WAIT_USEC / USEC_PER_SEC));
        client_free(c);
        return 0;
}

/* A client whose connection is gone. Its GPU pages are not handed out again while its
 * process may still write into them: the kernel closes a dying process's files in fd
 * order, so epdd can see the socket close before the process's GPU contexts (and the
 * kernels or copies they run into mapped pages) are torn down. Host memory needs no
 * wait (a process's mappings go before its files). */
void client_gone(Client *c) {
        Manager *m = c->manager;
        if (c->exit_watch)
                return; /* waits for its process already */
        if (!c->dying && !m->stopping && c->pid > 0 && maps_gpu_arena(c)) {
                int fd = (int)syscall(SYS_pidfd_open, c->pid, 0);
                struct pollfd p = { .fd = fd, .events = POLLIN };
                if (fd >= 0 && poll(&p, 1, 0) == 0 &&
                    sd_event_add_io(m->event, &c->exit_watch, fd, EPOLLIN, on_exited, c) >= 0 &&
                    sd_event_add_time_relative(m->event, &c->exit_timer, CLOCK_MONOTONIC, CLIENT_EXIT_WAIT_USEC,
                                               USEC_PER_SEC / 10, on_exit_wait_over, c) >= 0) {
                        c->exit_pidfd = fd;
                        m->clients_departing++;
                        log_debug("Client %s left; its GPU pages wait for its process (pid %d) to exit.", c->key,
                                  (int)c->pid);
                        /* No more work for it meanwhile: the scheduler drops it, the
                         * handoffs meant for it alone roll back. */
                        Worker *w = client_get_worker(c);
                        for (const Subsystem *const *sp = manager_subsystems(); w && *sp; sp++)
                                if ((*sp)->worker_departing)
                                        (*sp)->worker_departing(m, w);
                        return;
                }
                c->exit_watch = sd_event_source_disable_unref(c->exit_watch);
                if (fd >= 0)
                        close(fd);
        }
        log_debug("Releasing everything client %s held.", c->key);
        client_free(c);
}

int manager_require_worker(Manager *m, sd_bus_message *msg, Worker **ret, sd_bus_error *error) {
        Client *c = manager_client_lookup_message(m, msg);
        Worker *w = client_get_worker(c);
        if (!w)
                return epd_bus_error(error, EPD_ERROR_NOT_REGISTERED,
                                     "The caller is not a registered worker; call RegisterWorker first.");
        *ret = w;
        return 0;
}
